//! An outbound hyper-util client capped globally: however many workers run this code, at most
//! three requests to the upstream are in flight at once.
//!
//! Starts a local hyper server that counts its concurrent requests, fires ten requests through
//! the limited client and prints the highest concurrency the server saw. Uses an in-process
//! backend unless `REDIS_URL` is set.

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tower::{BoxError, ServiceBuilder, ServiceExt};
use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Semaphore};

/// An upstream that takes 100 ms per request and remembers its highest concurrency.
async fn start_upstream(max_seen: Arc<AtomicUsize>) -> Result<std::net::SocketAddr, BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let active = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (active, max_seen) = (active.clone(), max_seen.clone());
            let service =
                hyper::service::service_fn(move |_req: Request<hyper::body::Incoming>| {
                    let (active, max_seen) = (active.clone(), max_seen.clone());
                    async move {
                        let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                        max_seen.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        active.fetch_sub(1, Ordering::SeqCst);
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(format!(
                            "{now} in flight"
                        )))))
                    }
                });
            tokio::spawn(async move {
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let max_seen = Arc::new(AtomicUsize::new(0));
    let upstream = start_upstream(max_seen.clone()).await?;

    let sem = support::build(Semaphore::builder("example-upstream").limit(3)).await?;
    // Generic flavor: a request that gets no permit in time fails with a BoxError that
    // downcasts to tower_distributed_limit::Error.
    let client = ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(sem))
        .service(Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>());

    let mut calls = tokio::task::JoinSet::new();
    for i in 0..10 {
        let client = client.clone();
        let request = Request::get(format!("http://{upstream}/")).body(Empty::new())?;
        calls.spawn(async move {
            let response = client.oneshot(request).await?;
            let body = response.into_body().collect().await?.to_bytes();
            println!("request {i}: {}", String::from_utf8_lossy(&body));
            Ok::<_, BoxError>(())
        });
    }
    while let Some(call) = calls.join_next().await {
        call??;
    }
    let max = max_seen.load(Ordering::SeqCst);
    println!("the upstream saw at most {max} requests at once (limit 3)");
    assert!(max <= 3);
    Ok(())
}
