//! What goes wrong, on purpose: keys deleted behind a holder, Redis killed and restarted,
//! Redis paused, a client paused past its lease, and each outage policy.

mod support;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::io::AsyncWriteExt;
use tower_distributed_limit::{Error, OutagePolicy, RedisBackend, Semaphore};

use support::{Redis, child_role, child_says, eventually, signal, spawn_child};

/// A resource guarded by fencing tokens: it remembers the highest token it has seen and
/// refuses writes that carry an older one.
#[derive(Default)]
struct FencedStore {
    highest: u64,
    writes: Vec<u64>,
}

impl FencedStore {
    fn write(&mut self, token: u64) -> Result<(), String> {
        if token < self.highest {
            return Err(format!("stale token {token}: {} was seen", self.highest));
        }
        self.highest = token;
        self.writes.push(token);
        Ok(())
    }
}

/// One permit with a 1 s lease, so leases run out within the tests.
fn semaphore(name: &str) -> tower_distributed_limit::SemaphoreBuilder {
    Semaphore::builder(name)
        .limit(1)
        .lease(Duration::from_secs(1))
        .acquire_timeout(Duration::from_secs(5))
}

/// The child, by role: `pause` holds the semaphore's only permit until told on stdin to check
/// it; `frozen-waiter` waits in line once and says how that ended; `eight-waiters` queues
/// eight waiters and then waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the other tests"]
async fn child_process() {
    let Some((role, url)) = child_role() else {
        return;
    };
    let backend = RedisBackend::connect(&url).await.unwrap();
    match role.as_str() {
        "pause" => hold_until_checked(backend).await,
        "frozen-waiter" => {
            let sem = frozen().build(backend).unwrap();
            match sem.acquire().await {
                Ok(permit) => println!("DLIMIT held lost={}", permit.is_lost()),
                Err(Error::Timeout { .. }) => println!("DLIMIT timeout"),
                Err(e) => println!("DLIMIT error {e}"),
            }
        }
        "eight-waiters" | "five-waiters" => {
            let (sem, count) = if role == "eight-waiters" {
                (claims().build(backend).unwrap(), 8)
            } else {
                (one_slot().build(backend).unwrap(), 5)
            };
            let waiters: Vec<_> = (0..count)
                .map(|_| {
                    let sem = sem.clone();
                    tokio::spawn(async move { sem.acquire().await })
                })
                .collect();
            println!("DLIMIT started");
            for waiter in waiters {
                let _ = waiter.await;
            }
        }
        role if role.starts_with("ten-waiters ") => {
            let policy = policy_named(&role["ten-waiters ".len()..]);
            let sem = outage_line(policy, outage_backend(&url).await);
            let decided = ten_waiters(&sem);
            println!("DLIMIT started");
            let said: Vec<String> = decided.await.iter().map(Decided::to_string).collect();
            println!("DLIMIT {}", said.join(" "));
        }
        other => panic!("unknown role {other}"),
    }
}

async fn hold_until_checked(backend: RedisBackend) {
    let sem = semaphore("paused").build(backend).unwrap();
    let permit = sem.acquire().await.unwrap();
    println!("DLIMIT held {}", permit.fencing_token());
    let mut line = String::new();
    tokio::io::AsyncBufReadExt::read_line(
        &mut tokio::io::BufReader::new(tokio::io::stdin()),
        &mut line,
    )
    .await
    .unwrap();
    // Right after SIGCONT the deadline has passed; the keeper's next renewal also finds the
    // holder gone. Either way lost() resolves.
    let lost = tokio::time::timeout(Duration::from_secs(2), permit.lost())
        .await
        .is_ok();
    println!("DLIMIT lost={lost} is_lost={}", permit.is_lost());
}

/// Eight permits with a long lease, for the claim-window test.
fn claims() -> tower_distributed_limit::SemaphoreBuilder {
    Semaphore::builder("claims")
        .limit(8)
        .lease(Duration::from_secs(30))
        .acquire_timeout(Duration::from_secs(10))
}

/// One slot with a claim window of 100 ms, for the frozen-process test.
fn one_slot() -> tower_distributed_limit::SemaphoreBuilder {
    Semaphore::builder("one-slot")
        .limit(1)
        .lease(Duration::from_secs(4))
        .claim_window(Duration::from_millis(100))
        .acquire_timeout(Duration::from_secs(30))
}

/// A process frozen with five waiters at the head of a one-slot line: the first grant to it
/// stays unclaimed for one claim window (100 ms), then the slot goes on and the frozen
/// process's other waiters are passed over until it is heard from again, instead of each of
/// them stranding the slot in turn (five provisional terms: 10 s with a 4 s lease before).
/// The slot goes on at the window's end, not at our waiter's next keepalive touch (up to 1 s
/// later before): nobody else calls while the frozen grant runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_process_strands_a_slot_for_one_claim_window() {
    let redis = Redis::start().await;
    let sem = one_slot().build(redis.backend().await).unwrap();
    let held = sem.acquire().await.unwrap();
    let mut child = spawn_child(&redis, "five-waiters");
    assert_eq!(child_says(&mut child).await, "started");
    eventually(Duration::from_secs(10), "five waiters in line", || async {
        redis.queue_len("one-slot").await == 5
    })
    .await;
    signal(child.id().unwrap(), "STOP");
    let ours = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    eventually(Duration::from_secs(5), "our waiter in line", || async {
        redis.queue_len("one-slot").await == 6
    })
    .await;
    let released = Instant::now();
    drop(held);
    let permit = tokio::time::timeout(Duration::from_secs(20), ours)
        .await
        .expect("our waiter is served")
        .unwrap()
        .expect("a permit");
    let waited = released.elapsed();
    eprintln!("served {waited:?} after the release, past five frozen waiters");
    assert!(!permit.is_lost());
    assert!(
        waited < Duration::from_millis(600),
        "the frozen process's waiters stranded the slot for {waited:?}"
    );
    signal(child.id().unwrap(), "CONT");
}

/// A waiter frozen while its grant is announced, and kept frozen until the grant's lease has
/// ended and another process holds the slot, must not wake believing it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_frozen_past_its_grant_does_not_wake_holding_it() {
    let redis = Redis::start().await;
    let sem = frozen().build(redis.backend().await).unwrap();
    let first = sem.acquire().await.unwrap();
    let mut child = spawn_child(&redis, "frozen-waiter");
    eventually(
        Duration::from_secs(10),
        "the child to wait in line",
        || async { redis.queue_len("frozen-waiter").await == 1 },
    )
    .await;
    let pid = child.id().unwrap();
    signal(pid, "STOP");
    // The slot goes to the frozen child, whose grant runs out unclaimed; then it is ours.
    drop(first);
    let second = sem.acquire().await.expect("the unclaimed grant ran out");
    signal(pid, "CONT");
    // While we hold the slot, the child must not report holding it too.
    let said = child_says(&mut child).await;
    assert!(!second.is_lost(), "our own permit was lost meanwhile");
    // It waits on and times out, or, when a call of its own was in flight across the freeze,
    // wakes to that call's timeout (an error): either way without the slot.
    assert!(
        said == "timeout" || said.starts_with("error "),
        "the thawed waiter says {said:?}"
    );
    assert!(child.wait().await.unwrap().success());
}

/// For the frozen-waiter test: a 4 s lease (so a loaded machine cannot lose the parent's permit
/// while the child runs out its wait; a grant from the line is provisional for 2 s) and an 8 s
/// wait (so the child still waits when it is thawed).
fn frozen() -> tower_distributed_limit::SemaphoreBuilder {
    semaphore("frozen-waiter")
        .lease(Duration::from_secs(4))
        .acquire_timeout(Duration::from_secs(8))
}

/// A process killed with eight waiters in line: the grants made to them are provisional and
/// come back within the claim window, not after a whole (30 s) lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_processs_grants_come_back_within_the_claim_window() {
    let redis = Redis::start().await;
    let sem = claims().build(redis.backend().await).unwrap();
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(sem.acquire().await.unwrap());
    }
    let mut child = spawn_child(&redis, "eight-waiters");
    assert_eq!(child_says(&mut child).await, "started");
    eventually(Duration::from_secs(10), "eight waiters in line", || async {
        redis.queue_len("claims").await == 8
    })
    .await;
    child.kill().await.unwrap();
    // Our own waiters queue behind the dead ones.
    let ours: Vec<_> = (0..8)
        .map(|_| {
            let sem = sem.clone();
            tokio::spawn(async move { sem.acquire().await })
        })
        .collect();
    eventually(Duration::from_secs(5), "our waiters in line", || async {
        redis.queue_len("claims").await == 16
    })
    .await;
    let released = Instant::now();
    drop(held);
    // Within the claim window (250 ms) the slots are the dead process's (first come, first
    // served).
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        ours.iter().all(|waiter| !waiter.is_finished()),
        "the slots went to the dead process's waiters first"
    );
    let mut permits = Vec::new();
    for waiter in ours {
        permits.push(
            waiter
                .await
                .unwrap()
                .expect("a slot within the claim window"),
        );
    }
    let reused = released.elapsed();
    eprintln!("every slot in use again {reused:?} after the release");
    assert!(reused < Duration::from_secs(8), "{reused:?}");
}

/// Redis restarts empty (no persistence) while we hold permits, and another process takes the
/// slots it forgot: our holders learn it as soon as the connection is back, not a third of a
/// lease (10 s here) later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holders_learn_of_an_empty_restart_at_once() {
    let mut redis = Redis::start().await;
    let builder = || {
        Semaphore::builder("forgotten")
            .limit(2)
            .lease(Duration::from_secs(30))
    };
    let ours = builder().build(redis.backend().await).unwrap();
    let held = [ours.acquire().await.unwrap(), ours.acquire().await.unwrap()];
    redis.kill();
    redis.restart().await;
    let theirs = builder().build(redis.backend().await).unwrap();
    let taken = [
        theirs
            .try_acquire()
            .await
            .unwrap()
            .expect("the server forgot our permits"),
        theirs
            .try_acquire()
            .await
            .unwrap()
            .expect("the server forgot our permits"),
    ];
    let overlap = Instant::now();
    tokio::time::timeout(Duration::from_secs(3), async {
        for permit in &held {
            permit.lost().await;
        }
    })
    .await
    .expect("our holders learn within a moment that the server forgot them");
    eprintln!("two holders too many for {:?}", overlap.elapsed());
    drop(taken);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_paused_past_its_lease_is_fenced_off() {
    let redis = Redis::start().await;
    let mut child = spawn_child(&redis, "pause");
    let said = child_says(&mut child).await;
    let stale: u64 = said.strip_prefix("held ").unwrap().parse().unwrap();
    let pid = child.id().unwrap();
    signal(pid, "STOP");

    // While the holder is frozen its lease runs out and another process takes the slot.
    let backend = redis.backend().await;
    let sem = semaphore("paused").build(backend).unwrap();
    let started = Instant::now();
    let permit = sem
        .acquire()
        .await
        .expect("the frozen holder's lease ran out");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "the frozen holder's lease was not kept"
    );
    let mut store = FencedStore::default();
    store.write(permit.fencing_token()).unwrap();

    signal(pid, "CONT");
    let stdin = child.stdin.as_mut().unwrap();
    stdin.write_all(b"check\n").await.unwrap();
    stdin.flush().await.unwrap();
    assert_eq!(child_says(&mut child).await, "lost=true is_lost=true");
    // The woken holder's writes carry its old token and are refused.
    assert!(store.write(stale).is_err());
    assert_eq!(store.writes, vec![permit.fencing_token()]);
    assert!(child.wait().await.unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_keys_makes_the_permit_lost() {
    let redis = Redis::start().await;
    let backend = redis.backend().await;
    let sem = semaphore("deleted").build(backend).unwrap();
    let permit = sem.acquire().await.unwrap();
    assert!(!permit.is_lost());
    let _: i64 = redis::cmd("DEL")
        .arg("dlimit:{deleted}:holders")
        .arg("dlimit:{deleted}:meta")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    // The next renewal (a third of the 1 s lease away) finds the holder gone.
    tokio::time::timeout(Duration::from_millis(1500), permit.lost())
        .await
        .expect("lost within about one lease");
    assert!(permit.is_lost());
    assert_eq!(permit.remaining(), Duration::ZERO);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_redis_gives_bounded_errors_and_recovery_after_a_restart() {
    let mut redis = Redis::start().await;
    let backend = redis.backend().await;
    let sem = semaphore("restart")
        .acquire_timeout(Duration::from_secs(2))
        .build(backend)
        .unwrap();
    sem.acquire().await.unwrap().release().await.unwrap();

    redis.kill();
    let started = Instant::now();
    assert!(matches!(sem.try_acquire().await, Err(Error::Backend(_))));
    assert!(matches!(sem.acquire().await, Err(Error::Backend(_))));
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "errors took {:?}",
        started.elapsed()
    );

    // Same port, empty server (no scripts, no keys): the same backend recovers by itself.
    redis.restart().await;
    eventually(
        Duration::from_secs(10),
        "the semaphore to work again",
        || async { matches!(sem.try_acquire().await, Ok(Some(_))) },
    )
    .await;
    // Waiting works again too: the grant reaches the waiter over the renewed subscription.
    let mut held = sem.acquire().await.unwrap();
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move { sem.acquire().await.map(|p| p.fencing_token()) })
    };
    eventually(Duration::from_secs(5), "the waiter to queue", || async {
        let queued: u64 = redis::cmd("ZCARD")
            .arg("dlimit:{restart}:queue")
            .query_async(&mut redis.conn().await)
            .await
            .unwrap();
        queued == 1
    })
    .await;
    held.release().await.unwrap();
    let token = tokio::time::timeout(Duration::from_secs(3), waiter)
        .await
        .expect("the waiter was served")
        .unwrap()
        .unwrap();
    assert!(token > held.fencing_token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_redis_gives_bounded_errors_and_recovery_after_sigcont() {
    let redis = Redis::start().await;
    let backend = redis.backend().await;
    let sem = semaphore("frozen")
        .acquire_timeout(Duration::from_millis(1500))
        .build(backend)
        .unwrap();
    sem.acquire().await.unwrap().release().await.unwrap();
    // A backend with a tighter, configured bound on every call.
    let quick = RedisBackend::builder(redis.url.as_str())
        .call_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let quick = semaphore("frozen").build(quick).unwrap();
    quick
        .try_acquire()
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();

    signal(redis.pid(), "STOP");
    let started = Instant::now();
    let bounded = quick.try_acquire().await;
    let quick_took = started.elapsed();
    let started = Instant::now();
    let one_shot = sem.try_acquire().await;
    let waited = started.elapsed();
    let waiting = sem.acquire().await;
    let total = started.elapsed();
    signal(redis.pid(), "CONT");
    assert!(matches!(bounded, Err(Error::Backend(_))), "{bounded:?}");
    assert!(
        quick_took < Duration::from_millis(800),
        "the 200 ms bound took {quick_took:?}"
    );
    assert!(matches!(one_shot, Err(Error::Backend(_))), "{one_shot:?}");
    assert!(matches!(waiting, Err(Error::Backend(_))), "{waiting:?}");
    // Bounded by the 1 s call timeout and the 1.5 s acquire timeout (with retries' slack).
    assert!(
        waited < Duration::from_secs(3),
        "try_acquire took {waited:?}"
    );
    assert!(total < Duration::from_secs(6), "both took {total:?}");

    eventually(
        Duration::from_secs(10),
        "the semaphore to work again",
        || async { matches!(sem.try_acquire().await, Ok(Some(_))) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_outage_policy_does_what_it_says() {
    let mut redis = Redis::start().await;
    let backend = redis.backend().await;
    let build = |name: &str, policy| {
        semaphore(name)
            .acquire_timeout(Duration::from_secs(2))
            .on_outage(policy)
            .build(backend.clone())
            .unwrap()
    };
    let closed = build("closed", OutagePolicy::FailClosed);
    let open = build("open", OutagePolicy::FailOpen);
    let local = build("local", OutagePolicy::Local { limit: 1 });
    for sem in [&closed, &open, &local] {
        let permit = sem.acquire().await.unwrap();
        assert!(!permit.is_degraded());
    }

    redis.kill();
    // Fail closed: refused with the backend's error.
    assert!(matches!(closed.acquire().await, Err(Error::Backend(_))));
    assert_eq!(closed.outage_decisions(), 1);
    // Fail open: let through, beyond the limit of 1, marked degraded.
    let a = open.acquire().await.unwrap();
    let b = open.try_acquire().await.unwrap().expect("fail open admits");
    assert!(a.is_degraded() && b.is_degraded());
    assert_eq!(open.outage_decisions(), 2);
    // Local: at most 1 at once in this process.
    let only = local.acquire().await.unwrap();
    assert!(only.is_degraded());
    assert!(local.try_acquire().await.unwrap().is_none());
    drop(only);
    assert!(local.try_acquire().await.unwrap().is_some());
    assert_eq!(local.outage_decisions(), 3);

    // Back to Redis once it answers, with no restart of the process.
    redis.restart().await;
    eventually(
        Duration::from_secs(10),
        "permits from Redis again",
        || async { matches!(open.try_acquire().await, Ok(Some(p)) if !p.is_degraded()) },
    )
    .await;
}

/// The call timeout of the backends whose waiters Redis dies under: every waiter must be
/// decided within it (plus [`SLACK`]) of the kill.
const CALL: Duration = Duration::from_millis(500);
const SLACK: Duration = Duration::from_millis(100);

async fn outage_backend(url: &str) -> RedisBackend {
    RedisBackend::builder(url)
        .call_timeout(CALL)
        .connect()
        .await
        .unwrap()
}

/// One slot, long waits: whoever waits is still in line when Redis dies.
fn outage_line(policy: OutagePolicy, backend: RedisBackend) -> Semaphore {
    Semaphore::builder("outage-line")
        .limit(1)
        .lease(Duration::from_secs(30))
        .acquire_timeout(Duration::from_secs(20))
        .on_outage(policy)
        .build(backend)
        .unwrap()
}

fn policy_named(name: &str) -> OutagePolicy {
    match name {
        "open" => OutagePolicy::FailOpen,
        "closed" => OutagePolicy::FailClosed,
        "local" => OutagePolicy::Local { limit: 10 },
        other => panic!("unknown policy {other}"),
    }
}

/// How one waiter's acquire ended, and when (µs since the epoch: comparable across processes).
struct Decided {
    at_us: u128,
    outcome: &'static str,
}

impl std::fmt::Display for Decided {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.at_us, self.outcome)
    }
}

impl std::str::FromStr for Decided {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (at, outcome) = s.split_once(':').ok_or(s)?;
        let outcome = ["degraded", "held", "backend", "other"]
            .into_iter()
            .find(|known| *known == outcome)
            .ok_or(s)?;
        Ok(Decided {
            at_us: at.parse().map_err(|_| s.to_owned())?,
            outcome,
        })
    }
}

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

/// Ten waiters on `sem`, started now; resolves to how each ended, in the order they queued.
fn ten_waiters(sem: &Semaphore) -> impl std::future::Future<Output = Vec<Decided>> + use<> {
    let waiters: Vec<_> = (0..10)
        .map(|_| {
            let sem = sem.clone();
            tokio::spawn(async move {
                let outcome = match sem.acquire().await {
                    Ok(permit) if permit.is_degraded() => "degraded",
                    Ok(_) => "held",
                    Err(Error::Backend(_)) => "backend",
                    Err(_) => "other",
                };
                // A permit is dropped here: a degraded one frees its local slot only.
                Decided {
                    at_us: now_us(),
                    outcome,
                }
            })
        })
        .collect();
    async move {
        let mut decided = Vec::with_capacity(waiters.len());
        for waiter in waiters {
            decided.push(waiter.await.unwrap());
        }
        decided
    }
}

/// Ten waiters in each of two processes queue on a full semaphore, then Redis is killed: every
/// one of them is decided by `policy` within the call timeout (+ 100 ms) of the kill, not one
/// per keepalive as the oldest waiter's refresh finds the server gone (5 s for 6 waiters
/// before), each with `expected`.
async fn every_waiter_is_decided_at_once(policy: &str, expected: &str) {
    let mut redis = Redis::start().await;
    let sem = outage_line(policy_named(policy), outage_backend(&redis.url).await);
    let _held = sem.acquire().await.unwrap();
    let mut child = spawn_child(&redis, &format!("ten-waiters {policy}"));
    assert_eq!(child_says(&mut child).await, "started");
    let ours = ten_waiters(&sem);
    eventually(
        Duration::from_secs(10),
        "twenty waiters in line",
        || async { redis.queue_len("outage-line").await == 20 },
    )
    .await;

    let killed = now_us();
    redis.kill();
    let ours = tokio::time::timeout(Duration::from_secs(30), ours)
        .await
        .expect("our waiters decided");
    let theirs: Vec<Decided> = child_says(&mut child)
        .await
        .split(' ')
        .map(|d| d.parse().unwrap())
        .collect();
    let (ours_after, theirs_after) = (since(killed, &ours), since(killed, &theirs));
    println!(
        "{policy}: decided after the kill, ours {ours_after:.1?}, the child's {theirs_after:.1?}"
    );
    for (process, decided, after) in [
        ("ours", &ours, &ours_after),
        ("the child's", &theirs, &theirs_after),
    ] {
        assert_eq!(decided.len(), 10);
        for (i, (d, took)) in decided.iter().zip(after).enumerate() {
            assert_eq!(d.outcome, expected, "{process} waiter {i}");
            assert!(
                *took <= CALL + SLACK,
                "{process} waiter {i} decided {took:?} after the kill: {after:.1?}"
            );
        }
    }
    assert!(child.wait().await.unwrap().success());
}

/// How long after `killed` each waiter was decided.
fn since(killed: u128, decided: &[Decided]) -> Vec<Duration> {
    (decided.iter())
        .map(|d| Duration::from_micros(d.at_us.saturating_sub(killed) as u64))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_waiter_in_line_is_admitted_at_once_when_redis_dies_under_fail_open() {
    every_waiter_is_decided_at_once("open", "degraded").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_waiter_in_line_is_refused_at_once_when_redis_dies_under_fail_closed() {
    every_waiter_is_decided_at_once("closed", "backend").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_waiter_in_line_is_admitted_locally_at_once_when_redis_dies_under_local() {
    every_waiter_is_decided_at_once("local", "degraded").await;
}
