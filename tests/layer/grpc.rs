//! The gRPC flavor (feature `tonic`): tonic clients and servers see gRPC statuses.

use super::*;

#[cfg(feature = "tonic")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tonic_clients_see_resource_exhausted_and_unavailable() {
    use tonic::Code;
    use tonic::transport::{Endpoint, Server};
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        Server::builder()
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = bounded(
        "a connection",
        Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect(),
    )
    .await
    .unwrap();

    let mut redis = Redis::start().await;
    let sem = semaphore("grpc", 1, redis.backend().await);
    let mut client = HealthClient::new(
        ServiceBuilder::new()
            .layer(
                DistributedConcurrencyLimitLayer::new(sem.clone())
                    .reject_when_full()
                    .grpc(),
            )
            .service(channel.clone()),
    );
    let check = || HealthCheckRequest {
        service: String::new(),
    };
    bounded("a health check", client.check(check()))
        .await
        .unwrap();

    // The same limit, waiting 100 ms at most.
    let impatient = Semaphore::builder("grpc")
        .limit(1)
        .acquire_timeout(Duration::from_millis(100))
        .build(redis.backend().await)
        .unwrap();
    let mut waiting = HealthClient::new(
        ServiceBuilder::new()
            .layer(DistributedConcurrencyLimitLayer::new(impatient).grpc())
            .service(channel),
    );

    let held = sem.acquire().await.unwrap();
    let full = bounded("a refusal", client.check(check()))
        .await
        .unwrap_err();
    assert_eq!(full.code(), Code::ResourceExhausted, "{full:?}");
    let timeout = bounded("a timeout", waiting.check(check()))
        .await
        .unwrap_err();
    assert_eq!(timeout.code(), Code::ResourceExhausted, "{timeout:?}");
    drop(held);

    redis.kill();
    let outage = bounded("a backend failure", client.check(check()))
        .await
        .unwrap_err();
    assert_eq!(outage.code(), Code::Unavailable, "{outage:?}");
    for status in [&full, &timeout, &outage] {
        assert_neutral(status.message());
    }
    assert_ne!(full.message(), timeout.message());
    assert_ne!(full.message(), outage.message());
    assert_eq!(full.metadata().get("x-dlimit-refusal").unwrap(), "full");
    assert_eq!(outage.metadata().get("x-dlimit-refusal").unwrap(), "outage");
}

#[cfg(feature = "tonic")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tonic_servers_answer_refusals_with_a_grpc_status() {
    use tonic::Code;
    use tonic::transport::{Endpoint, Server};
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    let sem = semaphore("grpc-server", 1, MemoryBackend::new());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        Server::builder()
            .layer(
                DistributedConcurrencyLimitLayer::new(sem.clone())
                    .grpc()
                    .reject_when_full(),
            )
            .add_service(health.clone())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = bounded(
        "a connection",
        Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect(),
    )
    .await
    .unwrap();
    let mut client = HealthClient::new(channel);
    let check = || HealthCheckRequest {
        service: String::new(),
    };
    bounded("a health check", client.check(check()))
        .await
        .unwrap();
    let held = sem.acquire().await.unwrap();
    let status = bounded("a refusal", client.check(check()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");

    // On the wire: HTTP 200, trailers-only, grpc-status 8 (RESOURCE_EXHAUSTED).
    let response = ServiceBuilder::new()
        .layer(
            DistributedConcurrencyLimitLayer::new(sem.clone())
                .grpc()
                .reject_when_full(),
        )
        .service(health)
        .oneshot(Request::new(tonic::body::Body::empty()))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["grpc-status"], "8");
    assert_eq!(response.headers()["content-type"], "application/grpc");
    assert!(http_body::Body::is_end_stream(response.body()));
    drop(held);
}

/// The combined check in the gRPC flavor: a request over the rate gets `RESOURCE_EXHAUSTED`
/// (saying it is the rate limit), through a real tonic server and client.
#[cfg(feature = "tonic")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tonic_clients_see_the_rate_limit_of_the_combined_check() {
    use tonic::Code;
    use tonic::transport::{Endpoint, Server};
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    use tower_distributed_limit::RateLimiter;

    let backend = MemoryBackend::new();
    let sem = semaphore("grpc-rate", 4, backend.clone());
    let rate = RateLimiter::builder("grpc-rate")
        .rate(1, Duration::from_secs(3600))
        .build(backend)
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        Server::builder()
            .layer(
                DistributedConcurrencyLimitLayer::new(sem.clone())
                    .rate_limit(rate)
                    .grpc(),
            )
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = bounded(
        "a connection",
        Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect(),
    )
    .await
    .unwrap();
    let mut client = HealthClient::new(channel);
    let check = || HealthCheckRequest {
        service: String::new(),
    };
    bounded("the first check", client.check(check()))
        .await
        .unwrap();
    let status = bounded("a refusal", client.check(check()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("rate limit"), "{status:?}");
    bounded("the permits back", async {
        while sem.available_permits().await.unwrap() != 4 {
            tokio::task::yield_now().await;
        }
    })
    .await;
}
