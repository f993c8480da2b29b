//! The adaptive limit (`SemaphoreBuilder::adaptive`) against a real redis-server and in
//! process: one limit for every process, found from the permits' hold times, lowered by
//! `Permit::overloaded`, within its bounds, deaf to holders whose lease ran out, pinned by
//! `set_limit`, and decided by whoever opens the semaphore first.

#[macro_use]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use tokio::task::JoinSet;
use tower_distributed_limit::{
    AdaptiveLimit, Backend, Error, MemoryBackend, QuorumBackend, RedisBackend, Semaphore,
};

use support::eventually;

/// A downstream with `capacity` workers: a request takes 20 ms while at most `capacity` are in
/// flight, and longer in proportion beyond (they share the workers). (Not shorter: the timer's
/// millisecond of jitter would be noise the limit reads as congestion.)
struct Downstream {
    in_flight: AtomicU32,
    capacity: AtomicU32,
}

impl Downstream {
    fn new(capacity: u32) -> Arc<Self> {
        Arc::new(Downstream {
            in_flight: AtomicU32::new(0),
            capacity: AtomicU32::new(capacity),
        })
    }

    async fn serve(&self) {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        let capacity = self.capacity.load(Ordering::SeqCst);
        let share = f64::from(now) / f64::from(capacity);
        tokio::time::sleep(Duration::from_millis(20).mul_f64(share.max(1.0))).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `tasks` tasks per semaphore, each acquiring, calling `downstream` and releasing (marking
/// the permit overloaded while `overloaded` is set), until the set is dropped.
fn load(
    sems: &[Semaphore],
    tasks: usize,
    downstream: &Arc<Downstream>,
    overloaded: &Arc<AtomicBool>,
) -> JoinSet<()> {
    let mut set = JoinSet::new();
    for sem in sems {
        for _ in 0..tasks {
            let (sem, downstream, overloaded) =
                (sem.clone(), downstream.clone(), overloaded.clone());
            set.spawn(async move {
                loop {
                    let Ok(permit) = sem.acquire().await else {
                        continue;
                    };
                    downstream.serve().await;
                    if overloaded.load(Ordering::Relaxed) {
                        permit.mark_overloaded();
                    }
                }
            });
        }
    }
    set
}

fn adaptive(name: &str, limit: AdaptiveLimit, backend: impl Backend) -> Semaphore {
    Semaphore::builder(name)
        .adaptive(limit)
        .lease(Duration::from_secs(2))
        .acquire_timeout(Duration::from_secs(5))
        .build(backend)
        .unwrap()
}

async fn limit_in_force(sem: &Semaphore) -> u32 {
    sem.snapshot().await.unwrap().limit
}

/// Waits (bounded) until the limit in force satisfies `ok`.
async fn limit_reaches(sem: &Semaphore, what: &str, ok: impl Fn(u32) -> bool + Copy) {
    eventually(Duration::from_secs(30), what, || async move {
        ok(limit_in_force(sem).await)
    })
    .await;
}

/// Checks `checks` times, 100 ms apart, that the limit in force is within `limits`.
async fn stays_within(sem: &Semaphore, limits: std::ops::RangeInclusive<u32>, checks: u32) {
    for _ in 0..checks {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let limit = limit_in_force(sem).await;
        assert!(limits.contains(&limit), "{limit} outside {limits:?}");
    }
}

/// Four processes (four connections) on one adaptive semaphore: one limit, the same in every
/// snapshot, that settles near the downstream's capacity, comes down when the downstream
/// slows and goes up when it speeds up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_finds_one_limit_and_it_follows_the_latency() {
    let redis = support::Redis::start().await;
    let mut sems = Vec::new();
    for _ in 0..4 {
        let backend = RedisBackend::connect(&redis.url).await.unwrap();
        let bounds = AdaptiveLimit::new().initial(4).min(1).max(100);
        sems.push(adaptive("fleet", bounds, backend));
    }
    let downstream = Downstream::new(12);
    let calm = Arc::new(AtomicBool::new(false));
    let running = load(&sems, 8, &downstream, &calm);
    limit_reaches(&sems[0], "the limit to grow to about 12", |l| {
        (9..=24).contains(&l)
    })
    .await;
    downstream.capacity.store(4, Ordering::SeqCst);
    limit_reaches(&sems[0], "the limit to come down to about 4", |l| l <= 8).await;
    downstream.capacity.store(24, Ordering::SeqCst);
    // Bounds are loose: on a loaded machine the scheduler's delays are latency too.
    limit_reaches(&sems[0], "the limit to go up towards 24", |l| l >= 12).await;
    drop(running);
    // Quiet now: every process reads the one limit stored with the semaphore.
    let limits: Vec<u32> = futures_util::future::join_all(sems.iter().map(limit_in_force)).await;
    assert!(limits.iter().all(|&l| l == limits[0]), "{limits:?}");
    // The process-side configured value is the initial one.
    assert_eq!(sems[0].limit(), 4);
}

/// The downstream never slows, but every hold is marked overloaded: the limit comes down by
/// a tenth per window until it meets its floor, and never goes below it.
async fn overloaded_holds_bring_the_limit_down_to_its_floor(backend: impl Backend) {
    let sem = adaptive(
        "overloaded",
        AdaptiveLimit::new().initial(40).min(5).max(100),
        backend,
    );
    let downstream = Downstream::new(1000);
    let overloaded = Arc::new(AtomicBool::new(true));
    let running = load(std::slice::from_ref(&sem), 16, &downstream, &overloaded);
    limit_reaches(&sem, "the limit to fall to its floor of 5", |l| l == 5).await;
    stays_within(&sem, 5..=5, 10).await;
    drop(running);
}

/// Fast holds with more callers than the limit: it grows up to its ceiling and stays there.
async fn fast_holds_raise_the_limit_to_its_ceiling(backend: impl Backend) {
    let sem = adaptive(
        "fast",
        AdaptiveLimit::new().initial(2).min(1).max(8),
        backend,
    );
    let downstream = Downstream::new(1000);
    let calm = Arc::new(AtomicBool::new(false));
    let running = load(std::slice::from_ref(&sem), 16, &downstream, &calm);
    limit_reaches(&sem, "the limit to reach its ceiling of 8", |l| l == 8).await;
    // Never above its ceiling (noise may take it a step below, a probe of the no-load
    // latency to half for a few windows every 10 s).
    stays_within(&sem, 4..=8, 10).await;
    assert!(sem.snapshot().await.unwrap().used <= 8);
    drop(running);
}

/// `set_limit` pins an adaptive limit: fast holds that would raise it leave it where it was
/// set.
async fn set_limit_pins_an_adaptive_limit(backend: impl Backend) {
    let sem = adaptive(
        "pinned",
        AdaptiveLimit::new().initial(2).min(1).max(50),
        backend,
    );
    sem.set_limit(3).await.unwrap();
    let downstream = Downstream::new(1000);
    let calm = Arc::new(AtomicBool::new(false));
    let running = load(std::slice::from_ref(&sem), 16, &downstream, &calm);
    stays_within(&sem, 3..=3, 15).await;
    drop(running);
}

/// Whoever opens the semaphore first decides: a fixed limit stored first stays fixed for an
/// adaptive process, and an adaptive one stored first is what a fixed process admits by.
async fn the_first_process_decides_whether_it_adapts(backend: impl Backend + Clone) {
    let fixed = Semaphore::builder("mixed")
        .limit(5)
        .build(backend.clone())
        .unwrap();
    let held = fixed.acquire().await.unwrap();
    let late = adaptive(
        "mixed",
        AdaptiveLimit::new().initial(20).max(50),
        backend.clone(),
    );
    let downstream = Downstream::new(1000);
    let calm = Arc::new(AtomicBool::new(false));
    let running = load(std::slice::from_ref(&late), 16, &downstream, &calm);
    stays_within(&late, 5..=5, 10).await;
    drop(running);
    drop(held);

    let first = adaptive(
        "other",
        AdaptiveLimit::new().initial(2).max(9),
        backend.clone(),
    );
    // The state is made by the first call: this one's.
    let anchor = first.acquire().await.unwrap();
    let second = Semaphore::builder("other")
        .limit(100)
        .build(backend)
        .unwrap();
    let running = load(std::slice::from_ref(&second), 16, &downstream, &calm);
    // The fixed process's releases are samples too, and it admits by the limit in force.
    limit_reaches(&first, "the adaptive limit to reach its ceiling", |l| {
        l == 9
    })
    .await;
    assert!(second.snapshot().await.unwrap().used <= 9);
    drop(running);
    drop(anchor);
}

on_both_backends!(
    overloaded_holds_bring_the_limit_down_to_its_floor,
    fast_holds_raise_the_limit_to_its_ceiling,
    set_limit_pins_an_adaptive_limit,
    the_first_process_decides_whether_it_adapts,
);

/// A holder whose lease runs out (its process was killed) is no latency sample: the limit of
/// a semaphore far from full stays where it was, although that holder was "held" for over a
/// second against holds of 20 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_expired_is_no_sample() {
    let redis = support::Redis::start().await;
    let sem = adaptive(
        "crash",
        AdaptiveLimit::new().initial(20).min(1).max(100),
        redis.backend().await,
    );
    let downstream = Downstream::new(1000);
    let calm = Arc::new(AtomicBool::new(false));
    let running = load(std::slice::from_ref(&sem), 2, &downstream, &calm);
    let mut child = support::spawn_child(&redis, "hold");
    let said = support::child_says(&mut child).await;
    let id = said
        .strip_prefix("held ")
        .expect("the child holds")
        .to_owned();
    let _ = child.start_kill();
    let _ = child.wait().await;
    // The child's slot comes back when its lease (1 s) ends.
    let (id, watched) = (&id, &sem);
    eventually(
        Duration::from_secs(10),
        "the dead holder's lease to end",
        || async move {
            let holders = watched.snapshot().await.unwrap().holders;
            !holders.iter().any(|holder| &holder.id == id)
        },
    )
    .await;
    // A sample of the dead holder's 1 s and more would take it to about 16 at once.
    stays_within(&sem, 18..=20, 10).await;
    drop(running);
}

/// The child of `a_holder_that_expired_is_no_sample`: holds one permit (lease 1 s) and waits
/// to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the other tests"]
async fn child_process() {
    let Some((role, url)) = support::child_role() else {
        return;
    };
    assert_eq!(role, "hold");
    let sem = Semaphore::builder("crash")
        .adaptive(AdaptiveLimit::new().initial(20).min(1).max(100))
        .lease(Duration::from_secs(1))
        .build(RedisBackend::connect(&url).await.unwrap())
        .unwrap();
    let permit = sem.acquire().await.unwrap();
    println!("DLIMIT held {}", permit.id());
    // Renewals stop when the process is killed; until then it holds.
    permit.lost().await;
}

#[tokio::test]
async fn bad_adaptive_settings_are_config_errors() {
    let memory = MemoryBackend::new();
    let build = |builder: tower_distributed_limit::SemaphoreBuilder| builder.build(memory.clone());
    for (builder, says) in [
        (
            Semaphore::builder("x")
                .limit(5)
                .adaptive(AdaptiveLimit::new()),
            "both a limit and an adaptive limit",
        ),
        (
            Semaphore::builder("x").adaptive(AdaptiveLimit::new().min(10).max(5)),
            "1 <= min <= initial <= max",
        ),
        (
            Semaphore::builder("x").adaptive(AdaptiveLimit::new().initial(600).max(500)),
            "1 <= min <= initial <= max",
        ),
        (
            Semaphore::builder("x").adaptive(AdaptiveLimit::new().min(0)),
            "1 <= min <= initial <= max",
        ),
    ] {
        let Err(Error::Config(message)) = build(builder) else {
            panic!("refused");
        };
        assert!(message.contains(says), "{message}");
    }
    // A quorum's nodes would each move their own limit: refused, with the reason.
    let quorum = QuorumBackend::builder(&[
        "redis://127.0.0.1:1",
        "redis://127.0.0.1:2",
        "redis://127.0.0.1:3",
    ])
    .connect_lazy()
    .unwrap();
    let Err(Error::Config(message)) = Semaphore::builder("x")
        .adaptive(AdaptiveLimit::new())
        .build(quorum)
    else {
        panic!("refused on a quorum");
    };
    assert!(message.contains("quorum"), "{message}");
}

/// The layer feeds an adaptive limit with no user code: every response's hold is a sample,
/// and 5xx answers (HTTP), inner errors (generic) and requests an outer timeout dropped are
/// congestion signals that bring it down to its floor, while the same load answered 200
/// leaves it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_marks_failures_and_dropped_requests_overloaded() {
    use bytes::Bytes;
    use http_body_util::Full;
    use tower::{ServiceBuilder, ServiceExt, service_fn};
    use tower_distributed_limit::{DistributedConcurrencyLimitLayer, http};

    fn semaphore() -> Semaphore {
        adaptive(
            "layer",
            AdaptiveLimit::new().initial(40).min(3).max(100),
            MemoryBackend::new(),
        )
    }
    /// 16 requests at a time to `svc` until the limit reaches its floor (or `within` passes);
    /// the limit then. (A macro that spawns each request's own future: a task looping over
    /// the calls trips the compiler's higher-ranked `Send` checks on `BoxError`, with tower's
    /// own layers too.)
    macro_rules! drive {
        ($sem:expr, $within:expr, $svc:expr, $request:expr) => {{
            let mut set = JoinSet::new();
            let start = tokio::time::Instant::now();
            let mut checked = start;
            loop {
                while set.len() < 16 {
                    set.spawn($svc.clone().oneshot($request));
                }
                let _ = set.join_next().await;
                if checked.elapsed() >= Duration::from_millis(50) {
                    checked = tokio::time::Instant::now();
                    if start.elapsed() >= $within || limit_in_force(&$sem).await <= 3 {
                        break;
                    }
                }
            }
            set.abort_all();
            limit_in_force(&$sem).await
        }};
    }
    let answering = |status: u16| {
        move |_: http::Request<()>| async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let mut response = http::Response::new(Full::new(Bytes::from_static(b"hi")));
            *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
            Ok::<_, std::convert::Infallible>(response)
        }
    };

    // HTTP: 200s leave it (16 callers never fill 40), 503s bring it down.
    for (status, floored) in [(200, false), (503, true)] {
        let sem = semaphore();
        let layer = DistributedConcurrencyLimitLayer::new(sem.clone()).http();
        let svc = tower::Layer::layer(&layer, service_fn(answering(status)));
        let within = if floored {
            Duration::from_secs(20)
        } else {
            Duration::from_secs(1)
        };
        let limit = drive!(sem, within, svc, http::Request::new(()));
        assert_eq!(limit == 3, floored, "{status}: limit {limit}");
    }

    // Generic: inner errors.
    let sem = semaphore();
    let svc = tower::Layer::layer(
        &DistributedConcurrencyLimitLayer::new(sem.clone()),
        service_fn(|()| async {
            tokio::time::sleep(Duration::from_millis(2)).await;
            Err::<(), _>(tower::BoxError::from("downstream failed"))
        }),
    );
    let limit = drive!(sem, Duration::from_secs(20), svc, ());
    assert_eq!(limit, 3, "inner errors");

    // An outer timeout drops requests the inner service is still handling.
    let sem = semaphore();
    let svc = ServiceBuilder::new()
        .timeout(Duration::from_millis(1))
        .layer(DistributedConcurrencyLimitLayer::new(sem.clone()))
        .service(service_fn(|()| async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok::<_, tower::BoxError>(())
        }));
    let limit = drive!(sem, Duration::from_secs(20), svc, ());
    assert_eq!(limit, 3, "dropped by a timeout");
}
