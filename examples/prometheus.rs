//! The crate's metrics served to Prometheus, next to an axum service behind the layer.
//!
//! Installs `metrics-exporter-prometheus` on a free loopback port, serves a slow route behind a
//! limit of 2, sends it a burst, then prints the `dlimit_*` lines of the exporter's page and
//! exits. Uses an in-process backend unless `REDIS_URL` is set. Install the recorder before
//! building semaphores: each registers its metrics when it is built.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use axum::{Router, routing::get};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use metrics_exporter_prometheus::PrometheusBuilder;
use tower::BoxError;
use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Semaphore};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let metrics_addr: SocketAddr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
        probe.local_addr()?
    };
    PrometheusBuilder::new()
        .with_http_listener(metrics_addr)
        .install()?;

    let sem = support::build(
        Semaphore::builder("example-metrics")
            .limit(2)
            .acquire_timeout(Duration::from_millis(100)),
    )
    .await?;
    let app = Router::new()
        .route(
            "/work",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(200)).await;
                "done"
            }),
        )
        .layer(DistributedConcurrencyLimitLayer::new(sem).http());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    println!("serving on http://{addr}/work, metrics on http://{metrics_addr}/metrics");

    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let get = |uri: String| {
        let client = client.clone();
        async move {
            let response = client.get(uri.parse()?).await?;
            let status = response.status();
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, BoxError>((status, body))
        }
    };
    // Five at once on a limit of 2: two served, three refused after 100 ms.
    let burst = (0..5).map(|_| get(format!("http://{addr}/work")));
    for result in futures_util::future::join_all(burst).await {
        println!("request: {}", result?.0);
    }
    let (_, page) = get(format!("http://{metrics_addr}/metrics")).await?;
    for line in String::from_utf8_lossy(&page).lines() {
        if line.starts_with("dlimit_") {
            println!("{line}");
        }
    }
    Ok(())
}
