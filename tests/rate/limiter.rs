//! `RateLimiter` itself: a burst then refusals with `Retry-After`, the burst back after idle,
//! refused costs spending nothing and partitions (each on both backends); config errors; its
//! one expiring key, an empty Redis restart and the outage policies on a real redis-server; the
//! rate across four OS processes (their body is `child_process`, in `main.rs`).

use super::*;

on_both_backends!(
    a_burst_then_refusals_with_retry_after,
    a_client_that_waits_retry_after_gets_through,
    the_burst_comes_back_after_idle,
    a_refused_cost_spends_nothing,
    partitions_have_their_own_rate,
);

async fn a_burst_then_refusals_with_retry_after(backend: impl RateBackend) {
    // One unit a second: a loaded machine would need a whole second between two checks to
    // refill one (at 10/s, 100 ms once did).
    let rate = limiter("burst", 10, Duration::from_secs(10), 5, backend);
    for left in (0..5).rev() {
        let d = rate.check().await.unwrap();
        assert!(d.allowed, "{d:?}");
        assert_eq!(d.remaining, left);
        assert!(d.retry_after.is_none());
        assert!(d.reset_after <= Duration::from_secs(5), "{d:?}");
    }
    let d = rate.check().await.unwrap();
    assert!(!d.allowed);
    assert_eq!(d.remaining, 0);
    let retry = d.retry_after.expect("a refusal says when to retry");
    assert!(
        retry > Duration::from_millis(500) && retry <= Duration::from_secs(1),
        "{d:?}"
    );
    assert!(d.reset_after > Duration::from_secs(4), "{d:?}");
}

async fn a_client_that_waits_retry_after_gets_through(backend: impl RateBackend) {
    let rate = limiter("waiter", 20, Duration::from_secs(1), 1, backend);
    assert!(rate.check().await.unwrap().allowed);
    for _ in 0..5 {
        let d = rate.check().await.unwrap();
        assert!(!d.allowed);
        tokio::time::sleep(d.retry_after.unwrap()).await;
        let d = rate.check().await.unwrap();
        assert!(d.allowed, "waited the hint and was still refused: {d:?}");
    }
}

async fn the_burst_comes_back_after_idle(backend: impl RateBackend) {
    let rate = limiter("idle", 50, Duration::from_secs(1), 10, backend);
    let mut last = None;
    while let d @ Ok(_) = rate.check().await
        && d.as_ref().unwrap().allowed
    {
        last = Some(d.unwrap());
    }
    tokio::time::sleep(last.unwrap().reset_after).await;
    for _ in 0..10 {
        assert!(
            rate.check().await.unwrap().allowed,
            "the whole burst after idle"
        );
    }
    assert!(!rate.check().await.unwrap().allowed);
}

async fn a_refused_cost_spends_nothing(backend: impl RateBackend) {
    let rate = limiter("costly", 1, Duration::from_secs(60), 10, backend);
    assert!(rate.check_n(7).await.unwrap().allowed);
    let d = rate.check_n(4).await.unwrap();
    assert!(!d.allowed && d.remaining == 3, "{d:?}");
    assert!(
        rate.check_n(3).await.unwrap().allowed,
        "the refusal spent nothing"
    );
    assert!(matches!(rate.check_n(11).await, Err(Error::Config(_))));
    assert!(matches!(rate.check_n(0).await, Err(Error::Config(_))));
}

async fn partitions_have_their_own_rate(backend: impl RateBackend) {
    let rate = limiter("tenants", 1, Duration::from_secs(60), 2, backend);
    for key in ["acme", "globex"] {
        assert!(rate.check_key(key, 2).await.unwrap().allowed);
        assert!(!rate.check_key(key, 1).await.unwrap().allowed);
    }
    assert!(
        rate.check().await.unwrap().allowed,
        "the unkeyed state is apart"
    );
    assert!(matches!(rate.check_key("", 1).await, Err(Error::BadKey(_))));
}

#[test]
fn config_errors() {
    let build = |b: tower_distributed_limit::RateLimiterBuilder| b.build(MemoryBackend::new());
    let config = |r: Result<RateLimiter, Error>| match r {
        Err(Error::Config(message)) => message,
        other => panic!("expected a config error, got {other:?}"),
    };
    let second = Duration::from_secs(1);
    assert!(config(build(RateLimiter::builder("a").rate(0, second))).contains("rate of 0"));
    assert!(
        config(build(RateLimiter::builder("a").rate(5, Duration::ZERO))).contains("zero period")
    );
    assert!(
        config(build(RateLimiter::builder("a").rate(5, second).burst(0))).contains("burst of 0")
    );
    assert!(config(build(RateLimiter::builder("a"))).contains("no rate"));
    assert!(config(build(RateLimiter::builder("").rate(5, second))).contains("empty"));
    assert!(
        config(build(
            RateLimiter::builder("a")
                .rate(5, Duration::from_secs(86_400 * 365))
                .burst(1_000_000)
        ))
        .contains("too large")
    );
    assert!(
        config(build(
            RateLimiter::builder("a")
                .rate(5, second)
                .on_outage(OutagePolicy::Local { limit: 0 })
        ))
        .contains("local outage limit")
    );
    let ok = build(RateLimiter::builder("a").rate(5, second)).unwrap();
    assert_eq!(ok.burst(), 5, "the burst defaults to the rate's n");
}

/// One key, with a TTL of the time until the limiter is full again: nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_that_expires_when_full_again() {
    let redis = Redis::start().await;
    let rate = limiter("ttl", 10, Duration::from_secs(1), 3, redis.backend().await);
    rate.check_n(2).await.unwrap();
    let d = rate.check().await.unwrap();
    let mut conn = redis.conn().await;
    let keys: Vec<String> = conn.keys("*").await.unwrap();
    assert_eq!(keys, vec!["dlimit:{ttl}:rate".to_owned()]);
    let ttl: i64 = conn.pttl("dlimit:{ttl}:rate").await.unwrap();
    assert!(
        ttl > 200 && ttl <= 300,
        "ttl {ttl} ms, reset_after {:?}",
        d.reset_after
    );
    tokio::time::sleep(d.reset_after + Duration::from_millis(5)).await;
    let left: bool = conn.exists("dlimit:{ttl}:rate").await.unwrap();
    assert!(!left, "nothing left behind");
}

/// Redis restarts empty: the same limiter goes on, with a full burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_empty_redis() {
    let mut redis = Redis::start().await;
    let rate = limiter(
        "restart",
        1,
        Duration::from_secs(60),
        2,
        redis.backend().await,
    );
    assert!(rate.check_n(2).await.unwrap().allowed);
    assert!(!rate.check().await.unwrap().allowed);
    redis.kill();
    redis.restart().await;
    let mut d = rate.check().await;
    for _ in 0..20 {
        if d.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        d = rate.check().await;
    }
    let d = d.expect("the connection comes back");
    assert!(d.allowed && d.remaining == 1, "{d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_policies() {
    let mut redis = Redis::start().await;
    let backend = RedisBackend::builder(redis.url.as_str())
        .call_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let with = |policy| {
        RateLimiter::builder("outage")
            .rate(10, Duration::from_secs(60))
            .on_outage(policy)
            .build(backend.clone())
            .unwrap()
    };
    let closed = with(OutagePolicy::FailClosed);
    let open = with(OutagePolicy::FailOpen);
    let local = with(OutagePolicy::Local { limit: 2 });
    redis.kill();
    assert!(matches!(closed.check().await, Err(Error::Backend(_))));
    let d = open.check().await.unwrap();
    assert!(d.allowed && d.degraded);
    for _ in 0..2 {
        let d = local.check().await.unwrap();
        assert!(d.allowed && d.degraded, "{d:?}");
    }
    let d = local.check().await.unwrap();
    assert!(!d.allowed && d.degraded, "{d:?}");
    assert_eq!(closed.outage_decisions() + open.outage_decisions(), 2);
    assert_eq!(local.outage_decisions(), 3);
}

/// Four OS processes hammer one limiter; every admitted request also INCRs an independent
/// counter. The total stays within a few percent of `burst + rate·t`, where four per-process
/// limiters would admit four times that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_holds_across_processes() {
    let redis = Redis::start().await;
    let mut children: Vec<_> = (0..4).map(|_| spawn_child(&redis, "hammer")).collect();
    for child in &mut children {
        assert_eq!(child_says(child).await, "ready");
    }
    let started = std::time::Instant::now();
    for child in &mut children {
        let stdin = child.stdin.as_mut().unwrap();
        stdin.write_all(b"go\n").await.unwrap();
        stdin.flush().await.unwrap();
    }
    let mut reported = 0u64;
    for child in &mut children {
        reported += child_says(child).await.parse::<u64>().unwrap();
    }
    let span = started.elapsed().as_secs_f64().min(SECS + 0.5);
    let counted: u64 = redis.conn().await.get("admitted").await.unwrap();
    assert_eq!(counted, reported);
    let allowed_low = f64::from(BURST) + f64::from(RATE) * SECS;
    let allowed_high = f64::from(BURST) + f64::from(RATE) * span;
    let ratio = counted as f64 / allowed_low;
    eprintln!("admitted {counted} for {allowed_low}..={allowed_high:.0} allowed: ratio {ratio:.3}");
    assert!(
        counted as f64 <= allowed_high * 1.02,
        "over-admitted: {counted} > {allowed_high}"
    );
    assert!(
        counted as f64 >= allowed_low * 0.95,
        "under-admitted: {counted} < {allowed_low}"
    );
}
