//! The combined check, `DistributedConcurrencyLimitLayer::rate_limit`: one script call for both
//! limits on one Redis, all or nothing, a grant from the line spending its rate then, a limiter
//! on another backend with its HTTP answer, each limit's outage policy, and a storm.

use futures_util::FutureExt;
use tower_distributed_limit::Priority;

use super::*;

/// A service whose calls wait at `gate` until let through, telling `entered` when they start.
fn gated(
    gate: &std::sync::Arc<tokio::sync::Semaphore>,
    entered: &tokio::sync::mpsc::UnboundedSender<()>,
) -> impl Service<(), Response = (), Error = tower::BoxError, Future: Send> + Clone + Send + 'static
{
    let (gate, entered) = (gate.clone(), entered.clone());
    service_fn(move |()| {
        let (gate, entered) = (gate.clone(), entered.clone());
        async move {
            let _ = entered.send(());
            gate.acquire().await?.forget();
            Ok::<_, tower::BoxError>(())
        }
    })
}

fn refusal(result: Result<(), tower::BoxError>) -> Option<Error> {
    match result.err()?.downcast::<Error>() {
        Ok(error) => Some(*error),
        Err(other) => panic!("not a crate error: {other}"),
    }
}

/// `DistributedConcurrencyLimitLayer::rate_limit` with both on one Redis: a request granted at
/// once costs one script call for both limits; a request refused for concurrency spends no
/// rate, and one refused for rate adds no holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_combined_check_is_one_call_and_all_or_nothing() {
    let redis = Redis::start().await;
    let backend = redis.backend().await;
    let sem = Semaphore::builder("combo")
        .limit(2)
        .build(backend.clone())
        .unwrap();
    let rate = limiter("combo-rate", 3, Duration::from_secs(3600), 3, backend);
    drop(sem.try_acquire().await.unwrap()); // loads the script
    sem.available_permits().await.unwrap();
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let (entered_tx, mut entered) = tokio::sync::mpsc::unbounded_channel();
    let svc = tower::ServiceBuilder::new()
        .layer(
            DistributedConcurrencyLimitLayer::new(sem.clone())
                .rate_limit(rate)
                .reject_when_full(),
        )
        .service(gated(&gate, &entered_tx));
    let holders = async || -> u64 {
        redis
            .conn()
            .await
            .zcard("dlimit:{combo}:holders")
            .await
            .unwrap()
    };

    let before = redis.script_calls().await;
    let first = tokio::spawn(svc.clone().oneshot(()));
    entered.recv().await.unwrap();
    assert_eq!(
        redis.script_calls().await - before,
        1,
        "permit and rate in one script call"
    );
    let second = tokio::spawn(svc.clone().oneshot(()));
    entered.recv().await.unwrap();
    // Full: refused for concurrency, so it must not spend the third unit of rate.
    assert!(matches!(
        refusal(svc.clone().oneshot(()).await),
        Some(Error::Full)
    ));
    gate.add_permits(2);
    first.await.unwrap().unwrap();
    second.await.unwrap().unwrap();

    let third = tokio::spawn(svc.clone().oneshot(()));
    entered.recv().await.unwrap();
    // The rate is spent now: refused, with no holder added beside the third request's.
    match refusal(svc.clone().oneshot(()).await) {
        Some(Error::RateLimited { retry_after }) => {
            assert!(retry_after > Duration::from_secs(1000), "{retry_after:?}")
        }
        other => panic!("expected RateLimited, got {other:?}"),
    }
    assert_eq!(
        holders().await,
        1,
        "the rate-refused request added a holder"
    );
    gate.add_permits(1);
    third.await.unwrap().unwrap();
}

/// A request that waited in line spends its rate once granted (a second call), and gives the
/// permit back when the rate refuses then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_granted_from_the_line_spends_its_rate_then() {
    let redis = Redis::start().await;
    let backend = redis.backend().await;
    let sem = Semaphore::builder("line")
        .limit(1)
        .acquire_timeout(Duration::from_secs(10))
        .build(backend.clone())
        .unwrap();
    let rate = limiter("line", 1, Duration::from_secs(3600), 1, backend);
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(10));
    let (entered_tx, _entered) = tokio::sync::mpsc::unbounded_channel();
    let svc = tower::ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).rate_limit(rate))
        .service(gated(&gate, &entered_tx));
    for round in 0..2 {
        let held = sem.acquire().await.unwrap();
        let request = tokio::spawn(svc.clone().oneshot(()));
        support::eventually(Duration::from_secs(5), "the request to queue", || async {
            redis.queue_len("line").await == 1
        })
        .await;
        drop(held);
        let result = tokio::time::timeout(Duration::from_secs(5), request)
            .await
            .expect("the waiter was served")
            .unwrap();
        if round == 0 {
            result.expect("the first grant from the line fits the rate");
        } else {
            assert!(
                matches!(refusal(result), Some(Error::RateLimited { .. })),
                "the second is over the rate"
            );
        }
    }
    support::wait_until_available(&sem, 1).await;
}

/// The limiter on another backend than the semaphore: two calls, still all or nothing; the
/// HTTP flavor answers a rate refusal 429 with `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_combined_check_across_backends_and_its_http_answer() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("apart")
        .limit(1)
        .build(redis.backend().await)
        .unwrap();
    let rate = limiter(
        "apart",
        1,
        Duration::from_secs(3600),
        1,
        MemoryBackend::new(),
    );
    let svc = tower::ServiceBuilder::new()
        .layer(
            DistributedConcurrencyLimitLayer::new(sem.clone())
                .rate_limit(rate)
                .reject_when_full()
                .http(),
        )
        .service(service_fn(|_: http::Request<String>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::from("ok")))
        }));
    let request = || http::Request::new(String::new());
    let held = sem.acquire().await.unwrap();
    let full = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(full.status(), 503, "full: refused for concurrency");
    drop(held);
    support::wait_until_available(&sem, 1).await;
    let ok = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(
        ok.status(),
        200,
        "the refusal for concurrency spent no rate"
    );
    drop(ok);
    // Its permit is given back in the background: wait for it, or the next request may find
    // the limit of 1 still full (503) before the rate is asked.
    support::wait_until_available(&sem, 1).await;
    let limited = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(limited.status(), 429);
    let retry: u64 = limited.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry > 3000, "Retry-After: {retry}");
    drop(limited);
    support::wait_until_available(&sem, 1).await;
}

/// The combined path's answers carry the rate limit's `RateLimit` headers, as the standalone
/// rate layer's do: what each grant's rate left (decided in the same call as the permit on
/// one Redis, or checked after it across backends), and a refusal's wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_combined_path_answers_with_ratelimit_headers() {
    let redis = Redis::start().await;
    let same = redis.backend().await;
    for (name, rate_backend) in [("one-call", Some(same.clone())), ("checked-after", None)] {
        let sem = Semaphore::builder(name)
            .limit(4)
            .build(same.clone())
            .unwrap();
        let period = Duration::from_secs(3600);
        let rate = match rate_backend {
            Some(backend) => limiter(name, 3, period, 3, backend),
            None => limiter(name, 3, period, 3, MemoryBackend::new()),
        };
        let svc = tower::ServiceBuilder::new()
            .layer(
                DistributedConcurrencyLimitLayer::new(sem.clone())
                    .rate_limit(rate)
                    .http(),
            )
            .service(service_fn(|_: http::Request<String>| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(String::from("ok")))
            }));
        for left in [2, 1, 0] {
            let ok = svc
                .clone()
                .oneshot(http::Request::new(String::new()))
                .await
                .unwrap();
            assert_eq!(ok.status(), 200, "{name}");
            let state = ok.headers()["ratelimit"].to_str().unwrap().to_owned();
            assert!(
                state.starts_with(&format!("\"{name}\";r={left};t=")),
                "{name}: {state}"
            );
            assert_eq!(
                ok.headers()["ratelimit-policy"],
                &*format!("\"{name}\";q=3;w=3600")
            );
        }
        support::wait_until_available(&sem, 4).await;
        let limited = svc
            .clone()
            .oneshot(http::Request::new(String::new()))
            .await
            .unwrap();
        assert_eq!(limited.status(), 429, "{name}");
        let state = limited.headers()["ratelimit"].to_str().unwrap().to_owned();
        let t: u64 = state
            .strip_prefix(&format!("\"{name}\";r=0;t="))
            .unwrap_or_else(|| panic!("{name}: {state}"))
            .parse()
            .unwrap();
        assert!(t > 1000, "{name}: {state}");
    }
}

/// The combined check while Redis is down: each limit's own outage policy decides. Both open:
/// the request runs, on the semaphore's in-process fallback. Either closed: it is refused with
/// `Error::Backend`, and the in-process permit taken meanwhile is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_combined_check_follows_each_outage_policy() {
    let mut redis = Redis::start().await;
    let backend = RedisBackend::builder(redis.url.as_str())
        .call_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let sem = |policy| {
        Semaphore::builder("outage-combo")
            .limit(2)
            .on_outage(policy)
            .build(backend.clone())
            .unwrap()
    };
    let rate = |policy| {
        RateLimiter::builder("outage-combo")
            .rate(10, Duration::from_secs(60))
            .on_outage(policy)
            .build(backend.clone())
            .unwrap()
    };
    let open_sem = sem(OutagePolicy::Local { limit: 1 });
    let service = |sem: &Semaphore, rate: RateLimiter| {
        tower::ServiceBuilder::new()
            .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).rate_limit(rate))
            .service(service_fn(|()| async { Ok::<_, tower::BoxError>(()) }))
    };
    service(&open_sem, rate(OutagePolicy::FailOpen))
        .oneshot(())
        .await
        .expect("Redis is up");
    redis.kill();
    service(&open_sem, rate(OutagePolicy::FailOpen))
        .oneshot(())
        .await
        .expect("both policies admit");
    let closed_rate = service(&open_sem, rate(OutagePolicy::FailClosed))
        .oneshot(())
        .await;
    assert!(matches!(refusal(closed_rate), Some(Error::Backend(_))));
    // The fallback semaphore (limit 1) got its permit back: the next request is admitted.
    service(&open_sem, rate(OutagePolicy::FailOpen))
        .oneshot(())
        .await
        .expect("the fallback's permit came back");
    let closed_sem = sem(OutagePolicy::FailClosed);
    let refused = service(&closed_sem, rate(OutagePolicy::FailOpen))
        .oneshot(())
        .await;
    assert!(matches!(refusal(refused), Some(Error::Backend(_))));
}

/// A storm of concurrent requests through `rate_limit` (so acquires share script calls, each
/// carrying the rate): never more than the limit at once, never more admitted than the burst,
/// and every refused request spent nothing: what is left of the burst is exactly the burst
/// minus the admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_through_the_combined_check_spends_exactly_what_it_admits() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let redis = Redis::start().await;
    let backend = redis.backend().await;
    let sem = Semaphore::builder("storm")
        .limit(5)
        .build(backend.clone())
        .unwrap();
    let rate = limiter("storm", 1, Duration::from_secs(3600), 40, backend);
    let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let svc = tower::ServiceBuilder::new()
        .layer(
            DistributedConcurrencyLimitLayer::new(sem.clone())
                .rate_limit(rate.clone())
                .reject_when_full(),
        )
        .service(service_fn({
            let (running, most) = (running.clone(), most.clone());
            move |()| {
                let (running, most) = (running.clone(), most.clone());
                async move {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    running.fetch_sub(1, Ordering::SeqCst);
                    Ok::<_, tower::BoxError>(())
                }
            }
        }));
    let mut admitted: u32 = 0;
    for _ in 0..4 {
        let results =
            futures_util::future::join_all((0..100).map(|_| svc.clone().oneshot(()))).await;
        for result in results {
            match refusal(result) {
                None => admitted += 1,
                Some(Error::Full | Error::RateLimited { .. }) => {}
                Some(other) => panic!("unexpected refusal: {other}"),
            }
        }
    }
    assert!(
        most.load(Ordering::SeqCst) <= 5,
        "{} at once",
        most.load(Ordering::SeqCst)
    );
    assert!(admitted > 0 && admitted <= 40, "{admitted} admitted");
    // With 1 per hour, nothing refills during the test.
    let left = 40 - admitted;
    let next = rate.check_n(1).await.unwrap();
    assert_eq!(next.allowed, left > 0, "{admitted} admitted: {next:?}");
    if left > 0 {
        assert_eq!(
            next.remaining + 1,
            left,
            "the refused requests spent rate ({admitted} admitted)"
        );
    }
    support::wait_until_available(&sem, 5).await;
}

/// A flood of batch requests through `rate_limit` on one Redis, with critical requests among
/// them: what each class was admitted, and the refusals of each.
async fn flood(exempt: bool) -> ((u32, u32), (u32, u32)) {
    let redis = Redis::start().await;
    let backend = redis.backend().await;
    // Room for everyone at once: only the rate refuses.
    let sem = Semaphore::builder("flood")
        .limit(1000)
        .build(backend.clone())
        .unwrap();
    let rate = limiter("flood", 5, Duration::from_secs(3600), 5, backend);
    let layer = DistributedConcurrencyLimitLayer::new(sem)
        .priority_by(|class: &Priority| *class)
        .rate_limit(rate.clone())
        .reject_when_full();
    let layer = if exempt {
        layer.rate_limit_exempt(Priority::CRITICAL)
    } else {
        layer
    };
    let svc = tower::ServiceBuilder::new()
        .layer(layer)
        .service(service_fn(|class: Priority| async move {
            Ok::<_, tower::BoxError>(class)
        }));
    // One critical request in every five, all sent at once.
    let classes = (0..200).map(|i| {
        if i % 5 == 0 {
            Priority::CRITICAL
        } else {
            Priority::BATCH
        }
    });
    let results = futures_util::future::join_all(
        classes.map(|class| svc.clone().oneshot(class).map(move |r| (class, r))),
    )
    .await;
    let (mut critical, mut batch) = ((0, 0), (0, 0));
    for (class, result) in results {
        let tally = if class == Priority::CRITICAL {
            &mut critical
        } else {
            &mut batch
        };
        match result.map_err(|e| e.downcast::<Error>().map(|e| *e)) {
            Ok(_) => tally.0 += 1,
            Err(Ok(Error::RateLimited { .. })) => tally.1 += 1,
            Err(other) => panic!("unexpected refusal: {other:?}"),
        }
    }
    // Exempt requests spent nothing: the admitted batch requests spent the whole burst.
    assert!(!rate.check_n(1).await.unwrap().allowed);
    (critical, batch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exempt_critical_requests_are_never_refused_by_a_rate_a_batch_flood_spent() {
    let (critical, batch) = flood(true).await;
    assert_eq!(critical, (40, 0), "critical (admitted, refused)");
    assert_eq!(batch, (5, 155), "batch (admitted, refused)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_exemption_every_class_spends_the_same_rate() {
    let (critical, batch) = flood(false).await;
    assert_eq!(critical.0 + batch.0, 5, "{critical:?} {batch:?}");
    assert!(
        critical.1 >= 35,
        "critical (admitted, refused): {critical:?}"
    );
    assert_eq!(critical.1 + batch.1, 195);
}
