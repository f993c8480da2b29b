//! An axum server whose routes share one concurrency limit with every other instance.
//!
//! Serves on a free loopback port, sends itself a burst of requests, prints what happened and
//! exits. Uses an in-process backend unless `REDIS_URL` is set (`REDIS_URL=redis://127.0.0.1:6379
//! cargo run --example axum_server`), in which case every copy of this program you start shares
//! the same two slots.

mod support;

use std::time::Duration;

use axum::{Extension, Router, routing::get};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::BoxError;
use tower_distributed_limit::{DistributedConcurrencyLimitLayer, FencingToken, Semaphore};

/// A slow handler: the kind of work (a legacy database, a GPU job) the limit protects. The
/// fencing token would go along with its writes.
async fn report(Extension(FencingToken(token)): Extension<FencingToken>) -> String {
    tokio::time::sleep(Duration::from_millis(300)).await;
    format!("report written with fencing token {token}")
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // Two at once across every instance; a request waits at most 100 ms for a slot.
    let sem = support::build(
        Semaphore::builder("example-reports")
            .limit(2)
            .acquire_timeout(Duration::from_millis(100)),
    )
    .await?;
    let app = Router::new()
        .route("/report", get(report))
        .layer(DistributedConcurrencyLimitLayer::new(sem).http());

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
    });
    println!("serving on http://{addr}");

    // Five at once: two are served, three wait 100 ms and get 503 + Retry-After.
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let requests = (0..5).map(|i| {
        let client = client.clone();
        async move {
            let uri = format!("http://{addr}/report").parse()?;
            let response = client.get(uri).await?;
            let status = response.status();
            let retry_after = response.headers().get("retry-after").cloned();
            let body = response.into_body().collect().await?.to_bytes();
            println!(
                "request {i}: {status} retry-after={retry_after:?} {:?}",
                String::from_utf8_lossy(&body).trim_end()
            );
            Ok::<_, BoxError>(status)
        }
    });
    let statuses = futures_join_all(requests).await?;
    let served = statuses.iter().filter(|s| s.is_success()).count();
    println!("{served} served, {} refused", statuses.len() - served);

    let _ = stop.send(());
    server.await??;
    Ok(())
}

/// Runs the futures concurrently and collects their results in order.
async fn futures_join_all<T, F>(futures: impl Iterator<Item = F>) -> Result<Vec<T>, BoxError>
where
    F: std::future::Future<Output = Result<T, BoxError>> + Send + 'static,
    T: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut results = Vec::with_capacity(handles.len());
    for handle in handles {
        results.push(handle.await??);
    }
    Ok(results)
}
