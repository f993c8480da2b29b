//! Partitions: a limit per key, keyless requests, a bounded per-key map, keys from any request.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_limit_each_key_separately() {
    let redis = Redis::start().await;
    let partitions = api_key_partitions(redis.backend().await, 100);
    let probe = Probe::new();
    let addr = serve(
        probe.router().layer(
            DistributedConcurrencyLimitLayer::partitioned(partitions.clone())
                .reject_when_full()
                .http(),
        ),
    )
    .await;
    let client = client();
    let mut held = tokio::task::JoinSet::new();
    for key in ["free-1", "pro-1", "pro-1"] {
        let client = client.clone();
        held.spawn(async move { get_from(&client, addr, "/", Some(key)).await });
    }
    wait_until("three keyed handlers to run", || probe.active() == 3).await;
    // Each key is at its own limit; another key still has room.
    for key in ["free-1", "pro-1"] {
        let response = get_from(&client, addr, "/", Some(key)).await;
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "{key}");
    }
    assert_eq!(available(&partitions.semaphore("free-1").unwrap()).await, 0);
    assert_eq!(available(&partitions.semaphore("pro-1").unwrap()).await, 0);
    assert_eq!(
        partitions.semaphore("pro-1").unwrap().name(),
        "tenants:pro-1"
    );
    held.spawn({
        let client = client.clone();
        async move { get_from(&client, addr, "/", Some("free-2")).await }
    });
    wait_until("a fourth key's handler to run", || probe.active() == 4).await;

    // No key, or a key past max_key_len: 400, and nothing reaches the handler.
    let response = get_from(&client, addr, "/", None).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let response = get_from(&client, addr, "/", Some("x".repeat(17).as_str())).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(probe.started(), 4);

    probe.open();
    while let Some(response) = bounded("the held requests", held.join_next()).await {
        assert_eq!(response.unwrap().status(), StatusCode::OK);
    }
    wait_available(&partitions.semaphore("pro-1").unwrap(), 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_requests_can_share_a_default_semaphore() {
    let backend = MemoryBackend::new();
    let shared = semaphore("anonymous", 1, backend.clone());
    let partitions = Partitions::builder("tenants")
        .key_header(HeaderName::from_static("x-api-key"))
        .limit(1)
        .without_key(WithoutKey::Shared(shared.clone()))
        .build(backend)
        .unwrap();
    let probe = Probe::new();
    let addr = serve(
        probe.router().layer(
            DistributedConcurrencyLimitLayer::partitioned(partitions)
                .reject_when_full()
                .http(),
        ),
    )
    .await;
    let client = client();
    let first = tokio::spawn({
        let client = client.clone();
        async move { get_from(&client, addr, "/", None).await }
    });
    wait_until("the keyless handler to run", || probe.active() == 1).await;
    assert_eq!(available(&shared).await, 0);
    let response = get_from(&client, addr, "/", None).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    probe.open();
    assert_eq!(
        bounded("the first", first).await.unwrap().status(),
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_key_map_stays_within_its_capacity() {
    let partitions = api_key_partitions(MemoryBackend::new(), 4);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(DistributedConcurrencyLimitLayer::partitioned(partitions.clone()).http());
    let addr = serve(app).await;
    let client = client();
    for i in 0..50 {
        let response = get_from(&client, addr, "/", Some(&format!("key-{i}"))).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(partitions.cached() <= 4, "{} cached", partitions.cached());
    }
    assert_eq!(partitions.cached(), 4);
    // An evicted key's semaphore is rebuilt on demand with the same state.
    let sem = partitions.semaphore("key-0").unwrap();
    assert_eq!(available(&sem).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_take_their_key_from_any_request_type() {
    let partitions = Partitions::builder("tenants")
        .key(|job: &Job| Some(job.tenant.clone()))
        .limit(1)
        .max_key_len(8)
        .build(MemoryBackend::new())
        .unwrap();
    let probe = Probe::new();
    let svc = runner(
        DistributedConcurrencyLimitLayer::partitioned(partitions.clone()).reject_when_full(),
        &probe,
    );
    let first = tokio::spawn(svc.clone().oneshot(job("acme", 1)));
    wait_until("acme's job to run", || probe.active() == 1).await;
    let full = svc.clone().oneshot(job("acme", 1)).await.unwrap_err();
    assert!(
        matches!(full.downcast_ref::<Error>(), Some(Error::Full)),
        "{full}"
    );
    let other = tokio::spawn(svc.clone().oneshot(job("globex", 1)));
    wait_until("another tenant's job to run", || probe.active() == 2).await;
    for bad in ["", "much-too-long"] {
        let err = svc.clone().oneshot(job(bad, 1)).await.unwrap_err();
        assert!(
            matches!(err.downcast_ref::<Error>(), Some(Error::BadKey(_))),
            "{bad:?}: {err}"
        );
    }
    probe.open();
    bounded("the first", first).await.unwrap().unwrap();
    bounded("the other", other).await.unwrap().unwrap();
    wait_available(&partitions.semaphore("acme").unwrap(), 1).await;
}
