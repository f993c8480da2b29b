//! The standalone rate layer, `DistributedRateLimitLayer`: the generic flavor's matchable
//! refusal, and the HTTP flavor's headers and 429 over real TCP.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_generic_layer_refuses_with_a_matchable_error() {
    let rate = limiter("jobs", 1, Duration::from_secs(60), 3, MemoryBackend::new());
    let mut svc = tower::ServiceBuilder::new()
        .layer(DistributedRateLimitLayer::new(rate.clone()).weight_by(|job: &u32| *job))
        .service(service_fn(|job: u32| async move {
            Ok::<_, tower::BoxError>(job)
        }));
    assert_eq!(svc.ready().await.unwrap().call(2).await.unwrap(), 2);
    let err = svc.ready().await.unwrap().call(2).await.unwrap_err();
    match err.downcast_ref::<Error>() {
        Some(Error::RateLimited { retry_after }) => assert!(*retry_after > Duration::from_secs(50)),
        other => panic!("expected RateLimited, got {other:?}"),
    }
    assert_eq!(
        svc.ready().await.unwrap().call(1).await.unwrap(),
        1,
        "the refusal spent nothing"
    );
}

/// The HTTP flavor over real TCP, on Redis: allowed responses carry the RateLimit headers, a
/// refusal is 429 with Retry-After; per-key partitions by header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_flavor_over_tcp() {
    let redis = Redis::start().await;
    // One request every 200 ms after a burst of two: the three first must come within 200 ms
    // (each is a TCP connection and a Redis call: wide enough for a loaded CI machine).
    let rate = limiter("api", 5, Duration::from_secs(1), 2, redis.backend().await);
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "hello" }))
        .layer(
            DistributedRateLimitLayer::new(rate)
                .key_header(http::HeaderName::from_static("x-api-key"))
                .http(),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let get = |key: &'static str| async move {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "GET / HTTP/1.1\r\nhost: test\r\nx-api-key: {key}\r\nconnection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response.to_ascii_lowercase()
    };
    let first = get("alice").await;
    assert!(first.starts_with("http/1.1 200"), "{first}");
    assert!(
        first.contains("ratelimit-policy: \"api\";q=5;w=1\r\n"),
        "{first}"
    );
    assert!(first.contains("ratelimit: \"api\";r=1;t=1\r\n"), "{first}");
    assert!(get("alice").await.starts_with("http/1.1 200"));
    let refused = get("alice").await;
    assert!(refused.starts_with("http/1.1 429"), "{refused}");
    assert!(refused.contains("retry-after: 1\r\n"), "{refused}");
    assert!(
        refused.contains("ratelimit: \"api\";r=0;t=1\r\n"),
        "{refused}"
    );
    assert!(
        refused.contains("ratelimit-policy: \"api\";q=5;w=1\r\n"),
        "{refused}"
    );
    assert!(
        get("bob").await.starts_with("http/1.1 200"),
        "bob has a rate of his own"
    );
    tokio::time::sleep(Duration::from_millis(210)).await;
    assert!(
        get("alice").await.starts_with("http/1.1 200"),
        "after the retry time"
    );
}
