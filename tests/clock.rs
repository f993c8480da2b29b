//! Time that steps: the Redis server's wall clock moved by an `LD_PRELOAD` shim
//! (`support/clock_shift.c`, built with `cc` here), as an NTP step would, while the monotonic
//! clocks stay put. A lease is never believed, nor a slot kept, longer than the configured
//! lease because the server's clock stepped back.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::Instant;
use tower_distributed_limit::{RedisBackend, Semaphore};

use support::{RedisProcess, child_role, child_says, signal, spawn_child_with};

const LEASE: Duration = Duration::from_secs(2);
const STEP_US: i64 = 40_000_000;

/// A redis-server whose wall clock is shifted by what [`Shifted::step`] writes.
struct Shifted {
    server: RedisProcess,
    shift_file: PathBuf,
}

impl Shifted {
    async fn start() -> Shifted {
        let (server, shift_file) = support::redis_with_clock("DLIMIT_CLOCK_SHIFT_FILE", "0").await;
        Shifted { server, shift_file }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.server.port)
    }

    /// Shifts the server's wall clock to `us` from the true time, and waits until its `TIME`
    /// shows it.
    async fn step(&self, us: i64) {
        std::fs::write(&self.shift_file, us.to_string()).unwrap();
        let conn = redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        support::eventually(Duration::from_secs(5), "the server clock to step", || {
            let mut conn = conn.clone();
            async move {
                let (secs, micros): (i64, i64) =
                    redis::cmd("TIME").query_async(&mut conn).await.unwrap();
                let server = secs * 1_000_000 + micros;
                let real = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_micros() as i64;
                (server - real - us).abs() < 1_000_000
            }
        })
        .await;
    }

    /// The latest lease deadline of the semaphore's holders, on the server's clock (ms).
    async fn latest_deadline(&self, name: &str) -> Option<i64> {
        let mut conn = redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let latest: Vec<(String, i64)> = redis::cmd("ZRANGE")
            .arg(format!("dlimit:{{{name}}}:holders"))
            .arg(-1)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut conn)
            .await
            .unwrap();
        latest.first().map(|(_, score)| *score)
    }
}

fn semaphore(name: &str, backend: RedisBackend, limit: u32) -> Semaphore {
    Semaphore::builder(name)
        .limit(limit)
        .lease(LEASE)
        .acquire_timeout(Duration::from_secs(10))
        .build(backend)
        .unwrap()
}

fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Stepped back 40 s, then corrected: while the clock is behind, a renewal must not be told
/// (nor store) a deadline 40 s away, so after the correction the old holders learn they lost
/// their slots within a lease, not after the step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepped_back_never_stretches_a_lease() {
    let redis = Shifted::start().await;
    let holder = semaphore(
        "stepped",
        RedisBackend::connect(&redis.url()).await.unwrap(),
        2,
    );
    let held = [
        holder.acquire().await.unwrap(),
        holder.acquire().await.unwrap(),
    ];
    redis.step(-STEP_US).await;
    // The next renewal runs on the stepped clock: the stored deadlines come back within a
    // lease of the server's (now earlier) time.
    support::eventually(
        Duration::from_secs(5),
        "a renewal on the stepped clock",
        || async {
            redis
                .latest_deadline("stepped")
                .await
                .is_some_and(|deadline| deadline < wall_ms() - STEP_US / 2000)
        },
    )
    .await;
    for permit in &held {
        assert!(
            permit.remaining() <= LEASE,
            "a permit believes {:?} of a {LEASE:?} lease",
            permit.remaining()
        );
    }
    redis.step(0).await;
    let corrected = Instant::now();
    // Another process takes both slots; the old holders must know they lost them soon.
    let other = semaphore(
        "stepped",
        RedisBackend::connect(&redis.url()).await.unwrap(),
        2,
    );
    let taken = [
        other.acquire().await.unwrap(),
        other.acquire().await.unwrap(),
    ];
    for permit in &held {
        tokio::time::timeout(LEASE + Duration::from_secs(1), permit.lost())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "an old holder still believes its permit {:?} after the correction",
                    corrected.elapsed()
                )
            });
    }
    eprintln!(
        "the old holders knew their permits lost {:?} after the correction",
        corrected.elapsed()
    );
    drop(taken);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the other tests"]
async fn child_process() {
    let Some((role, url)) = child_role() else {
        return;
    };
    assert_eq!(role, "hold", "unknown role");
    let sem = semaphore("crashed", RedisBackend::connect(&url).await.unwrap(), 1);
    let _held = sem.acquire().await.unwrap();
    println!("DLIMIT held");
    // Hold until killed.
    let _ = BufReader::new(tokio::io::stdin()).lines().next_line().await;
}

/// A holder that crashed just before the clock stepped back 40 s: its slot frees within a
/// lease (its deadline is clamped to the server's now + lease), not after the step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepped_back_frees_a_crashed_holders_slot_within_a_lease() {
    let redis = Shifted::start().await;
    let mut child = spawn_child_with("hold", &redis.url());
    assert_eq!(child_says(&mut child).await, "held");
    signal(child.id().unwrap(), "KILL");
    let killed = Instant::now();
    redis.step(-STEP_US).await;
    let sem = semaphore(
        "crashed",
        RedisBackend::connect(&redis.url()).await.unwrap(),
        1,
    );
    let permit = sem.acquire().await.unwrap_or_else(|e| {
        panic!(
            "the crashed holder's slot is still taken {:?} after the kill: {e}",
            killed.elapsed()
        )
    });
    let freed = killed.elapsed();
    eprintln!("the crashed holder's slot freed {freed:?} after the kill");
    assert!(
        freed < LEASE + Duration::from_secs(2),
        "the crashed holder's slot freed {freed:?} after the kill (lease {LEASE:?})"
    );
    drop(permit);
}

/// Stepped forward 40 s (lease 30 s): the holder's lease ends early on the server and another
/// process is admitted at once; no single server can prevent that. But the holder's process
/// reads the server's clock in its own calls' replies, sees it jump ahead, and renews at once:
/// it learns of the loss within a round trip of its next call, not at its next renewal (up to
/// a third of the lease, 10 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepped_forward_is_noticed_at_the_next_call() {
    let redis = Shifted::start().await;
    let lease = Duration::from_secs(30);
    let open = |backend| {
        Semaphore::builder("leaped")
            .limit(1)
            .lease(lease)
            .acquire_timeout(Duration::from_secs(5))
            .build(backend)
            .unwrap()
    };
    let holder = open(RedisBackend::connect(&redis.url()).await.unwrap());
    let held = holder.acquire().await.unwrap();
    // The holder's process keeps calling, as a busy service does (here: trying for a second
    // permit of the full semaphore).
    let busy = tokio::spawn({
        let holder = holder.clone();
        async move {
            loop {
                let _ = holder.try_acquire().await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await; // a few readings at the true time
    redis.step(STEP_US).await;
    let other = open(RedisBackend::connect(&redis.url()).await.unwrap());
    let taken = other
        .acquire()
        .await
        .expect("the stepped clock ended the lease early");
    let admitted = Instant::now();
    tokio::time::timeout(Duration::from_secs(2), held.lost())
        .await
        .expect("the holder learns within a round trip of its next call, not a third of the lease");
    eprintln!(
        "the holder knew its permit lost {:?} after the other was admitted",
        admitted.elapsed()
    );
    busy.abort();
    drop(taken);
}
