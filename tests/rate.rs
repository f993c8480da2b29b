//! The global rate limit (issue 13): `RateLimiter` on both backends, against a real
//! redis-server, across OS processes, and its layer over real TCP.

#[macro_use]
mod support;

use std::time::Duration;

use redis::AsyncCommands;
use tokio::io::AsyncBufReadExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::{Service, ServiceExt, service_fn};
use tower_distributed_limit::{
    DistributedConcurrencyLimitLayer, DistributedRateLimitLayer, Error, MemoryBackend,
    OutagePolicy, RateBackend, RateLimiter, RedisBackend, Semaphore,
};

use support::{Redis, child_role, child_says, spawn_child};

on_both_backends!(
    a_burst_then_refusals_with_retry_after,
    a_client_that_waits_retry_after_gets_through,
    the_burst_comes_back_after_idle,
    a_refused_cost_spends_nothing,
    partitions_have_their_own_rate,
);

fn limiter(
    name: &str,
    rate: u32,
    period: Duration,
    burst: u32,
    backend: impl RateBackend,
) -> RateLimiter {
    RateLimiter::builder(name)
        .rate(rate, period)
        .burst(burst)
        .build(backend)
        .unwrap()
}

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

const RATE: u32 = 200;
const BURST: u32 = 20;
const SECS: f64 = 3.0;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the other tests"]
async fn child_process() {
    let Some((role, url)) = child_role() else {
        return;
    };
    assert_eq!(role, "hammer");
    let backend = RedisBackend::connect(&url).await.unwrap();
    let rate = limiter("shared", RATE, Duration::from_secs(1), BURST, backend);
    let mut counter = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    rate.check_key("warm-up", 1).await.unwrap();
    println!("DLIMIT ready");
    let mut line = String::new();
    tokio::io::BufReader::new(tokio::io::stdin())
        .read_line(&mut line)
        .await
        .unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs_f64(SECS);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let rate = rate.clone();
        let mut counter = counter.clone();
        tasks.spawn(async move {
            let mut admitted = 0u64;
            while tokio::time::Instant::now() < until {
                let d = rate.check().await.unwrap();
                if d.allowed {
                    admitted += 1;
                    let _: i64 = counter.incr("admitted", 1).await.unwrap();
                } else {
                    let nap = d
                        .retry_after
                        .unwrap()
                        .min(until - tokio::time::Instant::now().min(until));
                    tokio::time::sleep(nap.min(Duration::from_millis(2))).await;
                }
            }
            admitted
        });
    }
    let mut admitted = 0;
    while let Some(n) = tasks.join_next().await {
        admitted += n.unwrap();
    }
    let _: () = redis::cmd("PING").query_async(&mut counter).await.unwrap();
    println!("DLIMIT {admitted}");
}

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

/// The HTTP flavour over real TCP, on Redis: allowed responses carry the RateLimit headers, a
/// refusal is 429 with Retry-After; per-key partitions by header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_flavour_over_tcp() {
    let redis = Redis::start().await;
    let rate = limiter("api", 100, Duration::from_secs(1), 2, redis.backend().await);
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
        first.contains("ratelimit-policy: \"api\";q=100;w=1\r\n"),
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
        refused.contains("ratelimit-policy: \"api\";q=100;w=1\r\n"),
        "{refused}"
    );
    assert!(
        get("bob").await.starts_with("http/1.1 200"),
        "bob has a rate of his own"
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        get("alice").await.starts_with("http/1.1 200"),
        "after the retry time"
    );
}

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

    let before = redis.evalsha_calls().await;
    let first = tokio::spawn(svc.clone().oneshot(()));
    entered.recv().await.unwrap();
    assert_eq!(
        redis.evalsha_calls().await - before,
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
/// HTTP flavour answers a rate refusal 429 with `Retry-After`.
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
