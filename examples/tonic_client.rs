//! A tonic client stack wrapped by the layer: a call that gets no permit fails with a gRPC
//! `Status` (`RESOURCE_EXHAUSTED` when the limit is full, `UNAVAILABLE` when the backend is
//! down) instead of tonic's catch-all `UNKNOWN`.
//!
//! Runs a local gRPC health server (tonic-health, so no protoc is needed), calls it through the
//! limited channel and exits. Uses an in-process backend unless `REDIS_URL` is set.
//! `cargo run --example tonic_client --features tonic`

mod support;

use std::time::Duration;

use tonic::transport::{Endpoint, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tower::{BoxError, ServiceBuilder};
use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Semaphore};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        Server::builder()
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let sem = support::build(
        Semaphore::builder("example-grpc-upstream")
            .limit(1)
            .acquire_timeout(Duration::from_millis(200)),
    )
    .await?;
    let mut client = HealthClient::new(
        ServiceBuilder::new()
            .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).grpc())
            .service(channel),
    );
    let check = || HealthCheckRequest {
        service: String::new(),
    };

    let reply = client.check(check()).await?;
    println!("with a free slot: {:?}", reply.into_inner());

    // Another worker holds the only slot: the call waits 200 ms, then fails with a Status.
    let held = sem.acquire().await?;
    match client.check(check()).await {
        Err(status) => println!("while full: {:?}: {}", status.code(), status.message()),
        Ok(reply) => return Err(format!("expected a refusal, got {reply:?}").into()),
    }
    drop(held);
    Ok(())
}
