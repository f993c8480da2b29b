//! Any request type and the generic flavor: cancelled responses, ready services that hold
//! nothing, refusals that downcast to the crate's error, lost leases, job runners, weights and
//! a 1 ms acquire timeout.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_response_future_frees_the_permit() {
    let redis = Redis::start().await;
    let sem = semaphore("dropped", 1, redis.backend().await);
    for http in [false, true] {
        let (inner, mut starts) = stuck();
        let layer = DistributedConcurrencyLimitLayer::new(sem.clone());
        let call = if http {
            let svc = ServiceBuilder::new().layer(layer.http()).service(inner);
            tokio::spawn(async move {
                let _ = svc.oneshot(Request::new(())).await;
            })
        } else {
            let svc = ServiceBuilder::new().layer(layer).service(inner);
            tokio::spawn(async move {
                let _ = svc.oneshot(Request::new(())).await;
            })
        };
        bounded("the inner service to be called", starts.recv())
            .await
            .unwrap();
        assert_eq!(available(&sem).await, 0, "held while the call runs");
        call.abort();
        wait_available(&sem, 1).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ready_service_reserves_nothing_and_its_clone_carries_nothing() {
    let sem = semaphore("ready", 1, MemoryBackend::new());
    let (inner, mut starts) = stuck();
    let mut svc = ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).http())
        .service(inner);
    svc.ready().await.unwrap();
    let mut clone = svc.clone();
    assert_eq!(available(&sem).await, 1, "readiness takes no permit");
    drop(svc);
    assert_eq!(
        available(&sem).await,
        1,
        "a dropped ready service strands nothing"
    );

    // The clone gets its own permit only when it is called.
    clone.ready().await.unwrap();
    let future = clone.call(Request::new(()));
    let call = tokio::spawn(future);
    bounded("the call", starts.recv()).await.unwrap();
    assert_eq!(available(&sem).await, 0);
    call.abort();
    wait_available(&sem, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generic_refusals_downcast_to_the_crate_error() {
    let mut redis = Redis::start().await;
    let sem = Semaphore::builder("generic")
        .limit(1)
        .acquire_timeout(Duration::from_millis(200))
        .build(redis.backend().await)
        .unwrap();
    let server = serve(Router::new().route("/", get(|| async { "ok" }))).await;
    let uri = format!("http://{server}/");
    // A hyper-util client capped by the layer: generic flavor, BoxError out.
    let limited = |layer: DistributedConcurrencyLimitLayer| {
        ServiceBuilder::new().layer(layer).service(client())
    };
    let request = || {
        Request::get(uri.as_str())
            .body(Empty::<Bytes>::new())
            .unwrap()
    };

    let response = bounded(
        "a response",
        limited(DistributedConcurrencyLimitLayer::new(sem.clone())).oneshot(request()),
    )
    .await
    .unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    let held = sem.acquire().await.unwrap();
    let err: BoxError = bounded(
        "a refusal",
        limited(DistributedConcurrencyLimitLayer::new(sem.clone()).reject_when_full())
            .oneshot(request()),
    )
    .await
    .unwrap_err();
    // Not waiting is a refusal of its own (it was Error::Timeout before Error::Full existed).
    assert!(
        matches!(err.downcast_ref::<Error>(), Some(Error::Full)),
        "{err:?}"
    );
    let err = bounded(
        "a timeout",
        limited(DistributedConcurrencyLimitLayer::new(sem.clone())).oneshot(request()),
    )
    .await
    .unwrap_err();
    match err.downcast_ref::<Error>() {
        Some(Error::Timeout { waited }) => assert!(*waited >= Duration::from_millis(200)),
        other => panic!("expected a timeout, got {other:?}"),
    }
    drop(held);

    // A single attempt, so the backend's own timeout (1 s) is not cut short by the 200 ms wait.
    redis.kill();
    let err = bounded(
        "a backend error",
        limited(DistributedConcurrencyLimitLayer::new(sem.clone()).reject_when_full())
            .oneshot(request()),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err.downcast_ref::<Error>(), Some(Error::Backend(_))),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_aborts_the_request_when_asked() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("lost")
        .limit(1)
        .lease(Duration::from_secs(1))
        .acquire_timeout(BOUND)
        .build(redis.backend().await)
        .unwrap();
    let (inner, mut starts) = stuck();
    let svc = ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).abort_when_lease_lost())
        .service(inner);
    let call = tokio::spawn(svc.oneshot(Request::new(())));
    bounded("the inner service to be called", starts.recv())
        .await
        .unwrap();
    // Time is the subject: renewals keep the request's slot past its 1 s lease...
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!call.is_finished(), "aborted while its lease was renewed");
    // ...until the holder is removed behind its back, which the next renewal finds.
    let _: i64 = redis::cmd("DEL")
        .arg("dlimit:{lost}:holders")
        .arg("dlimit:{lost}:meta")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    let error = bounded("the request to be aborted", call)
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(error.downcast_ref::<Error>(), Some(Error::LeaseLost)),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runner_of_any_request_type_is_limited_across_instances() {
    let redis = Redis::start().await;
    let probe = Probe::new();
    let mut instances = Vec::new();
    for _ in 0..2 {
        let sem = semaphore("jobs", 2, redis.backend().await);
        instances.push(runner(DistributedConcurrencyLimitLayer::new(sem), &probe));
    }
    let mut jobs = tokio::task::JoinSet::new();
    for i in 0..8 {
        let svc = instances[i % 2].clone();
        jobs.spawn(svc.oneshot(job("acme", 1)));
    }
    wait_until("two jobs to run", || probe.active() == 2).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(probe.started(), 2, "the others wait for a permit");
    probe.open();
    let mut tokens = Vec::new();
    while let Some(token) = bounded("every job", jobs.join_next()).await {
        tokens.push(token.unwrap().unwrap());
    }
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), 8, "each job ran under its own fencing token");
    assert_eq!(probe.max(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_by_takes_that_many_permits_and_refuses_overweight_at_once() {
    let redis = Redis::start().await;
    let sem = semaphore("gpu", 4, redis.backend().await);
    let probe = Probe::new();
    let weight = |req: &Request<Body>| {
        req.headers()
            .get("x-gpus")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(1)
    };
    let addr = serve(
        probe.router().layer(
            DistributedConcurrencyLimitLayer::new(sem.clone())
                .http()
                .weight_by(weight),
        ),
    )
    .await;
    let client = client();
    let send = |gpus: u32| {
        let client = client.clone();
        async move {
            let request = Request::get(format!("http://{addr}/"))
                .header("x-gpus", gpus)
                .body(Empty::new())
                .unwrap();
            bounded("a response", client.request(request))
                .await
                .unwrap()
        }
    };
    let batch = tokio::spawn(send(3));
    wait_until("the batch to run", || probe.active() == 1).await;
    assert_eq!(available(&sem).await, 1, "a batch of 3 holds 3 permits");
    // Heavier than the whole limit: refused at once, not after the 10 s acquire timeout.
    let started = std::time::Instant::now();
    // A configuration error, not an outage or a full limit: retrying it cannot help.
    let response = send(5).await;
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(response.headers()["x-dlimit-refusal"], "config");
    assert!(started.elapsed() < Duration::from_secs(2));
    // Two fit only once the batch is done.
    let pair = tokio::spawn(send(2));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(probe.started(), 1, "a weight of 2 waits while 1 is free");
    probe.open();
    assert_eq!(
        bounded("the batch", batch).await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(
        bounded("the pair", pair).await.unwrap().status(),
        StatusCode::OK
    );
    wait_available(&sem, 4).await;

    // The generic flavor reports the overweight request as a configuration error.
    let gpus = runner(
        DistributedConcurrencyLimitLayer::new(sem.clone()).weight_by(|job: &Job| job.gpus),
        &Probe::new(),
    );
    let err = bounded("a refusal", gpus.oneshot(job("acme", 5)))
        .await
        .unwrap_err();
    assert!(
        matches!(err.downcast_ref::<Error>(), Some(Error::Config(_))),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_1ms_acquire_timeout_serves_free_slots_and_refuses_only_when_full() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("short")
        .limit(2)
        .acquire_timeout(Duration::from_millis(1))
        .build(redis.backend().await)
        .unwrap();
    let partitions = Partitions::like(
        Semaphore::builder("short-keys").acquire_timeout(Duration::from_millis(1)),
    )
    .key_header(HeaderName::from_static("x-api-key"))
    .limit(2)
    .build(redis.backend().await)
    .unwrap();
    let probe = Probe::new();
    let one = serve(
        probe
            .router()
            .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).http()),
    )
    .await;
    let keyed = serve(
        probe
            .router()
            .layer(DistributedConcurrencyLimitLayer::partitioned(partitions.clone()).http()),
    )
    .await;
    probe.open();
    let client = client();
    for _ in 0..20 {
        for addr in [one, keyed] {
            let response = get_from(&client, addr, "/", Some("acme")).await;
            assert_eq!(response.status(), StatusCode::OK, "a free slot is granted");
        }
    }

    // Contention: the slots are held elsewhere; refusals are "full", never an outage.
    let held = sem.acquire_many(2).await.unwrap();
    let response = get_from(&client, one, "/", None).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let jobs = runner(DistributedConcurrencyLimitLayer::new(sem.clone()), &probe);
    let err = jobs.oneshot(job("acme", 1)).await.unwrap_err();
    assert!(
        matches!(err.downcast_ref::<Error>(), Some(Error::Timeout { .. })),
        "{err}"
    );
    drop(held);
    let mut racing = tokio::task::JoinSet::new();
    for _ in 0..30 {
        let client = client.clone();
        racing.spawn(async move { get_from(&client, keyed, "/", Some("busy")).await.status() });
    }
    let mut ok = 0;
    while let Some(status) = bounded("the racing requests", racing.join_next()).await {
        match status.unwrap() {
            StatusCode::OK => ok += 1,
            StatusCode::SERVICE_UNAVAILABLE => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert!(ok >= 2, "{ok} served");
    assert_eq!(
        sem.outage_decisions(),
        0,
        "no refusal was taken for an outage"
    );
    let busy = partitions.semaphore("busy").unwrap();
    assert_eq!(busy.outage_decisions(), 0, "nor by a partition");
}
