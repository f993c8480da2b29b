//! The HTTP flavor: instances sharing a limit, each refusal's answer, the hook, streaming
//! bodies that hold their permit, fencing tokens in handlers, the builder in any order.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_reject_past_the_shared_limit() {
    let redis = Redis::start().await;
    let probe = Probe::new();
    let mut addrs = Vec::new();
    for _ in 0..2 {
        // Each instance has its own connection, as two pods would.
        let sem = semaphore("shared", 3, redis.backend().await);
        let app = probe.router().layer(
            DistributedConcurrencyLimitLayer::new(sem)
                .reject_when_full()
                .http(),
        );
        addrs.push(serve(app).await);
    }
    let client = client();
    let mut requests = tokio::task::JoinSet::new();
    for i in 0..20 {
        let (client, addr) = (client.clone(), addrs[i % 2]);
        requests.spawn(async move { get_from(&client, addr, "/", None).await });
    }
    // Every request that got no permit is answered at once; three wait in their handlers.
    let mut refused = 0;
    while refused < 17 {
        let response = bounded("a refusal", requests.join_next())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()["retry-after"], "1");
        refused += 1;
    }
    assert_eq!(probe.active(), 3);
    probe.open();
    let mut tokens = Vec::new();
    while let Some(response) = bounded("the held requests", requests.join_next()).await {
        let response = response.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        tokens.push(text(response).await.parse::<u64>().unwrap());
    }
    assert_eq!(tokens.len(), 3);
    tokens.sort();
    tokens.dedup();
    assert_eq!(
        tokens.len(),
        3,
        "fencing tokens are unique across instances"
    );
    assert_eq!(probe.max(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_queue_past_the_shared_limit() {
    let redis = Redis::start().await;
    let probe = Probe::new();
    let check = semaphore("queued", 3, redis.backend().await);
    let mut addrs = Vec::new();
    for _ in 0..2 {
        let sem = semaphore("queued", 3, redis.backend().await);
        let app = probe
            .router()
            .layer(DistributedConcurrencyLimitLayer::new(sem).http());
        addrs.push(serve(app).await);
    }
    let client = client();
    let mut requests = tokio::task::JoinSet::new();
    for i in 0..12 {
        let (client, addr) = (client.clone(), addrs[i % 2]);
        requests.spawn(async move { get_from(&client, addr, "/", None).await });
    }
    wait_until("three handlers to run", || probe.active() == 3).await;
    assert_eq!(available(&check).await, 0);
    // The other nine wait for a permit; none of them runs while the gate is shut.
    assert_eq!(probe.started(), 3);
    probe.open();
    let mut ok = 0;
    while let Some(response) = bounded("every request", requests.join_next()).await {
        assert_eq!(response.unwrap().status(), StatusCode::OK);
        ok += 1;
    }
    assert_eq!(ok, 12, "waiters are served, not refused");
    assert_eq!(probe.started(), 12);
    assert!(probe.max() <= 3, "max {} handlers at once", probe.max());
    wait_available(&check, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_configurable_and_backend_failures_fail_closed() {
    let mut redis = Redis::start().await;
    let sem = semaphore("busy", 1, redis.backend().await);
    let ok = Router::new().route("/", get(|| async { "ok" }));
    let custom = serve(
        ok.clone().layer(
            DistributedConcurrencyLimitLayer::new(sem.clone())
                .reject_when_full()
                .http()
                .status(StatusCode::TOO_MANY_REQUESTS)
                .body("slow down")
                .retry_after(Some(Duration::from_millis(4500))),
        ),
    )
    .await;
    let plain = serve(
        ok.clone().layer(
            DistributedConcurrencyLimitLayer::new(sem.clone())
                .reject_when_full()
                .http()
                .retry_after(None),
        ),
    )
    .await;
    let client = client();
    assert_eq!(text(get_from(&client, custom, "/", None).await).await, "ok");

    let held = sem.acquire().await.unwrap();
    let response = get_from(&client, custom, "/", None).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()["retry-after"], "5");
    assert_eq!(text(response).await, "slow down");
    let response = get_from(&client, plain, "/", None).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().get("retry-after").is_none());
    drop(held);

    // Redis gone: refused (not let through), but as an outage, not as a full limit: the
    // status and body set for "no permit" are not used, the Retry-After hint is.
    redis.kill();
    let response = get_from(&client, custom, "/", None).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()["x-dlimit-refusal"], "outage");
    assert_eq!(response.headers()["retry-after"], "5");
    assert_ne!(text(response).await, "slow down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kind_of_refusal_gets_its_own_answer() {
    use tower_distributed_limit::RateLimiter;

    let mut redis = Redis::start().await;
    let backend = redis.backend().await;
    let sem = |timeout: Duration| {
        Semaphore::builder("kinds")
            .limit(1)
            .acquire_timeout(timeout)
            .max_waiters(1)
            .build(backend.clone())
            .unwrap()
    };
    let ok = Router::new().route("/", get(|| async { "ok" }));
    let layer = |timeout| DistributedConcurrencyLimitLayer::new(sem(timeout)).http();
    let rejecting = serve(ok.clone().layer(layer(BOUND).reject_when_full())).await;
    let waiting = serve(ok.clone().layer(layer(BOUND))).await;
    let impatient = serve(ok.clone().layer(layer(Duration::from_millis(100)))).await;
    let rate = RateLimiter::builder("kinds")
        .rate(1, Duration::from_secs(3600))
        .build(backend.clone())
        .unwrap();
    let rated = serve(ok.clone().layer(layer(BOUND).rate_limit(rate))).await;
    let keyed = serve(
        ok.clone().layer(
            DistributedConcurrencyLimitLayer::partitioned(api_key_partitions(backend.clone(), 8))
                .http(),
        ),
    )
    .await;
    let client = client();
    let mut answers = Vec::new();

    // The rate limiter's one request passes, the next is over the rate.
    assert_eq!(text(get_from(&client, rated, "/", None).await).await, "ok");
    let response = get_from(&client, rated, "/", None).await;
    assert!(
        response.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            > 1
    );
    answers.push(refusal(response).await);

    let held = sem(BOUND).acquire().await.unwrap();
    answers.push(refusal(get_from(&client, rejecting, "/", None).await).await);
    answers.push(refusal(get_from(&client, impatient, "/", None).await).await);
    // One request waits in line (max_waiters 1), so the next one is refused at once.
    let first = tokio::spawn({
        let client = client.clone();
        async move { get_from(&client, waiting, "/", None).await.status() }
    });
    eventually(BOUND, "a waiter in line", || async {
        redis.queue_len("kinds").await == 1
    })
    .await;
    answers.push(refusal(get_from(&client, waiting, "/", None).await).await);
    drop(held);
    assert_eq!(bounded("the waiter", first).await.unwrap(), StatusCode::OK);

    answers.push(refusal(get_from(&client, keyed, "/", None).await).await);
    redis.kill();
    answers.push(refusal(get_from(&client, rejecting, "/", None).await).await);

    let expected = [
        (StatusCode::TOO_MANY_REQUESTS, "rate-limited"),
        (StatusCode::SERVICE_UNAVAILABLE, "full"),
        (StatusCode::SERVICE_UNAVAILABLE, "timeout"),
        (StatusCode::SERVICE_UNAVAILABLE, "too-many-waiters"),
        (StatusCode::BAD_REQUEST, "bad-key"),
        (StatusCode::SERVICE_UNAVAILABLE, "outage"),
    ];
    for ((status, kind, body), (want_status, want_kind)) in answers.iter().zip(expected) {
        assert_eq!(
            (*status, kind.as_str()),
            (want_status, want_kind),
            "{body:?}"
        );
    }
    let mut bodies: Vec<&str> = answers.iter().map(|(_, _, body)| body.as_str()).collect();
    bodies.sort_unstable();
    bodies.dedup();
    assert_eq!(
        bodies.len(),
        expected.len(),
        "one body per kind: {answers:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_refusal_hook_gets_the_error_and_its_answer_is_sent() {
    let mut redis = Redis::start().await;
    let sem = semaphore("hooked", 1, redis.backend().await);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let layer = DistributedConcurrencyLimitLayer::new(sem.clone())
        .http()
        .reject_when_full()
        .on_refusal({
            let seen = seen.clone();
            move |error: &Error| {
                let kind = match error {
                    Error::Full => "full",
                    Error::Backend(_) => "outage",
                    _ => "other",
                };
                seen.lock().unwrap().push(kind);
                Response::builder()
                    .status(StatusCode::IM_A_TEAPOT)
                    .header("x-kind", kind)
                    .body(Bytes::from(format!("hooked: {kind}")))
                    .ok()
            }
        });
    let addr = serve(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;
    let client = client();
    assert_eq!(text(get_from(&client, addr, "/", None).await).await, "ok");
    assert!(
        seen.lock().unwrap().is_empty(),
        "an admitted request is no refusal"
    );

    let held = sem.acquire().await.unwrap();
    let response = get_from(&client, addr, "/", None).await;
    assert_eq!(response.status(), StatusCode::IM_A_TEAPOT);
    assert_eq!(response.headers()["x-kind"], "full");
    assert_eq!(text(response).await, "hooked: full");
    drop(held);

    redis.kill();
    let response = get_from(&client, addr, "/", None).await;
    assert_eq!(response.headers()["x-kind"], "outage");
    assert_eq!(text(response).await, "hooked: outage");
    assert_eq!(*seen.lock().unwrap(), ["full", "outage"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_that_declines_leaves_the_default_answer() {
    let sem = semaphore("declined", 1, MemoryBackend::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = DistributedConcurrencyLimitLayer::new(sem.clone())
        .http()
        .reject_when_full()
        .on_refusal({
            let calls = calls.clone();
            move |_: &Error| {
                calls.fetch_add(1, Ordering::SeqCst);
                None
            }
        });
    let addr = serve(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;
    let _held = sem.acquire().await.unwrap();
    let (status, kind, _) = refusal(get_from(&client(), addr, "/", None).await).await;
    assert_eq!(
        (status, kind.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "full")
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A route whose body streams what the test sends, so the test decides when it ends.
fn streaming_router(chunks: mpsc::Receiver<Bytes>) -> Router {
    let chunks = Arc::new(Mutex::new(Some(chunks)));
    Router::new().route(
        "/stream",
        get(move || {
            let chunks = chunks.lock().unwrap().take().expect("one request");
            async move { Body::from_stream(ReceiverStream::new(chunks).map(Ok::<_, Infallible>)) }
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_body_holds_its_permit_until_its_last_byte() {
    let redis = Redis::start().await;
    let sem = semaphore("stream", 2, redis.backend().await);
    let (send, chunks) = mpsc::channel(1);
    let addr = serve(
        streaming_router(chunks).layer(DistributedConcurrencyLimitLayer::new(sem.clone()).http()),
    )
    .await;
    let response = get_from(&client(), addr, "/stream", None).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    assert_eq!(available(&sem).await, 1, "the head is out, the body holds");

    send.send(Bytes::from_static(b"first")).await.unwrap();
    let frame = bounded("a frame", body.frame()).await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "first");
    assert_eq!(available(&sem).await, 1, "half read, still held");

    send.send(Bytes::from_static(b"last")).await.unwrap();
    drop(send);
    let rest = bounded("the rest", body.collect()).await.unwrap();
    assert_eq!(rest.to_bytes(), "last");
    wait_available(&sem, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_streaming_response_frees_its_permit() {
    let sem = semaphore("abandoned", 1, MemoryBackend::new());
    let (send, chunks) = mpsc::channel(1);
    let addr = serve(
        streaming_router(chunks).layer(DistributedConcurrencyLimitLayer::new(sem.clone()).http()),
    )
    .await;
    let response = get_from(&client(), addr, "/stream", None).await;
    send.send(Bytes::from_static(b"first")).await.unwrap();
    assert_eq!(available(&sem).await, 0);
    // The client goes away mid-body; the server drops the body and with it the permit.
    drop(response);
    wait_available(&sem, 1).await;
    drop(send);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_at_head_frees_the_permit_before_the_body_ends() {
    let sem = semaphore("head", 1, MemoryBackend::new());
    let (send, chunks) = mpsc::channel(1);
    let addr = serve(
        streaming_router(chunks).layer(
            DistributedConcurrencyLimitLayer::new(sem.clone())
                .http()
                .release_at_head(),
        ),
    )
    .await;
    let response = get_from(&client(), addr, "/stream", None).await;
    wait_available(&sem, 1).await;
    send.send(Bytes::from_static(b"still streaming"))
        .await
        .unwrap();
    drop(send);
    assert_eq!(text(response).await, "still streaming");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_reach_the_handler_and_increase() {
    let sem = semaphore("tokens", 1, MemoryBackend::new());
    let app = Router::new()
        .route(
            "/",
            get(
                |Extension(FencingToken(token)): Extension<FencingToken>| async move {
                    token.to_string()
                },
            ),
        )
        .layer(DistributedConcurrencyLimitLayer::new(sem).http());
    let addr = serve(app).await;
    let client = client();
    let mut last = 0;
    for _ in 0..3 {
        let token: u64 = text(get_from(&client, addr, "/", None).await)
            .await
            .parse()
            .unwrap();
        assert!(token > last, "{token} after {last}");
        last = token;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_flavor_builds_in_any_order_and_can_name_its_policy() {
    let sem = semaphore("order", 1, MemoryBackend::new());
    let ok = Router::new().route("/", get(|| async { "ok" }));
    let before = serve(
        ok.clone().layer(
            DistributedConcurrencyLimitLayer::new(sem.clone())
                .reject_when_full()
                .http(),
        ),
    )
    .await;
    let after = serve(
        ok.layer(
            DistributedConcurrencyLimitLayer::new(sem.clone())
                .http()
                .ratelimit_policy_header()
                .reject_when_full(),
        ),
    )
    .await;
    let client = client();
    let _held = sem.acquire().await.unwrap();
    let response = get_from(&client, before, "/", None).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        response.headers().get("ratelimit-policy").is_none(),
        "off by default"
    );
    let response = get_from(&client, after, "/", None).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        response.headers()["ratelimit-policy"],
        "\"concurrency\";q=1;qu=\"concurrent-requests\""
    );
}

#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_handlers_take_the_fencing_token_as_an_extractor() {
    let sem = semaphore("extractor", 1, MemoryBackend::new());
    let route = get(|FencingToken(token): FencingToken| async move { token.to_string() });
    let limited = serve(
        Router::new()
            .route("/", route.clone())
            .layer(DistributedConcurrencyLimitLayer::new(sem).http()),
    )
    .await;
    let bare = serve(Router::new().route("/", route)).await;
    let client = client();
    let token: u64 = text(get_from(&client, limited, "/", None).await)
        .await
        .parse()
        .unwrap();
    assert!(token > 0);
    let response = get_from(&client, bare, "/", None).await;
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
}

/// On an HTTP layer the request closures need no type: `.http()` makes them read
/// `&http::Request<_>`, and axum's router fixes the body (no E0282 as before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_closures_on_an_http_layer_need_no_type() {
    let redis = Redis::start().await;
    let backend = redis.backend().await;
    let sem = semaphore("untyped", 3, backend.clone());
    let limit = DistributedConcurrencyLimitLayer::new(sem)
        .http()
        .weight_by(|req| if req.uri().path() == "/heavy" { 9 } else { 1 })
        .priority_by(|req| match req.headers().contains_key("x-batch") {
            true => tower_distributed_limit::Priority::BATCH,
            false => tower_distributed_limit::Priority::CRITICAL,
        })
        .tenant_by(|req| {
            let key = req.headers().get("x-api-key")?;
            key.to_str().ok().map(str::to_owned)
        });
    let rate = tower_distributed_limit::RateLimiter::builder("untyped")
        .rate(1, Duration::from_secs(3600))
        .burst(1)
        .build(backend)
        .unwrap();
    let per_key = tower_distributed_limit::DistributedRateLimitLayer::new(rate)
        .http()
        .key_by(|req| {
            let key = req.headers().get("x-api-key")?;
            key.to_str().ok().map(str::to_owned)
        });
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/heavy", get(|| async { "ok" }))
        .layer(limit)
        .layer(per_key);
    let (client, addr) = (client(), serve(app).await);

    let ok = get_from(&client, addr, "/", Some("a")).await;
    assert_eq!(ok.status(), StatusCode::OK);
    // The weight closure ran: 9 permits of 3 is a bad weight, answered 500.
    let heavy = get_from(&client, addr, "/heavy", Some("b")).await;
    assert_eq!(heavy.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(heavy.headers()["x-dlimit-refusal"], "config");
    // The key closure ran: key a spent its rate, key c has its own.
    let again = get_from(&client, addr, "/", Some("a")).await;
    assert_eq!(again.status(), StatusCode::TOO_MANY_REQUESTS);
    let other = get_from(&client, addr, "/", Some("c")).await;
    assert_eq!(other.status(), StatusCode::OK);
}
