//! Operating a semaphore: snapshots of who holds what, and one limit for every process
//! (`set_limit`), on both backends and against a real redis-server, with two OS processes.

#[macro_use]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tower_distributed_limit::{AdaptiveLimit, Backend, Error, RedisBackend, Semaphore};

use support::Redis;

on_both_backends!(
    a_snapshot_shows_the_limit_holders_and_waiters,
    lowering_the_limit_takes_nothing_from_holders,
    unsetting_a_limit_returns_to_the_one_configured,
    available_permits_count_by_the_limit_in_force,
);

/// A waiter that a lower limit pinned by another process makes heavier than the semaphore may
/// hold is dropped from the line and refused at once: told by the call that pinned the limit,
/// not left to learn it at its process's next keep-alive touch (a second after it queued).
async fn a_waiter_a_lower_limit_makes_too_heavy_is_refused_at_once<B: Backend>(ours: B, theirs: B) {
    let build = |backend| {
        Semaphore::builder("shrinks")
            .limit(4)
            .build(backend)
            .unwrap()
    };
    let (sem, operator) = (build(ours), build(theirs));
    let _held = sem.acquire_many(2).await.unwrap();
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire_many(3).await }
    });
    support::eventually(
        Duration::from_secs(5),
        "the heavy waiter in line",
        || async { operator.snapshot().await.unwrap().waiting == 1 },
    )
    .await;
    let pinned = Instant::now();
    operator.set_limit(2).await.unwrap();
    let refused = tokio::time::timeout(Duration::from_millis(500), waiter)
        .await
        .expect("the waiter learned it was dropped only at its next keep-alive")
        .unwrap();
    eprintln!(
        "a waiter made too heavy refused {:?} after the pin",
        pinned.elapsed()
    );
    assert!(
        matches!(&refused, Err(Error::Config(m)) if m.contains("at most 2")),
        "{refused:?}"
    );
}

mod a_waiter_a_lower_limit_makes_too_heavy_is_refused_at_once {
    use tower_distributed_limit::MemoryBackend;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory() {
        let backend = MemoryBackend::new();
        super::a_waiter_a_lower_limit_makes_too_heavy_is_refused_at_once(backend.clone(), backend)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis() {
        let redis = super::Redis::start().await;
        super::a_waiter_a_lower_limit_makes_too_heavy_is_refused_at_once(
            redis.backend().await,
            redis.backend().await,
        )
        .await;
    }
}

/// `available_permits` answers by the limit every process admits by, not by the one this
/// process was built with: stored by another process, pinned by an operator, or adaptive.
async fn available_permits_count_by_the_limit_in_force(backend: impl Backend + Clone) {
    // Stored: the first process's limit (2) is the one in force for a twin built with 10.
    let first = Semaphore::builder("twins")
        .limit(2)
        .build(backend.clone())
        .unwrap();
    let held = first.acquire_many(2).await.unwrap();
    let twin = Semaphore::builder("twins")
        .limit(10)
        .build(backend.clone())
        .unwrap();
    assert_eq!(twin.available_permits().await.unwrap(), 0);
    drop(held);
    // Pinned: 3 in force for a semaphore built with 10.
    let pinned = Semaphore::builder("pinned")
        .limit(10)
        .build(backend.clone())
        .unwrap();
    let _one = pinned.acquire().await.unwrap();
    pinned.set_limit(3).await.unwrap();
    assert_eq!(pinned.available_permits().await.unwrap(), 2);
    // Adaptive: the limit as the first process stored it (from 4), for a twin starting at 8.
    let adaptive = |initial| {
        Semaphore::builder("adaptive")
            .adaptive(AdaptiveLimit::new().initial(initial).min(1).max(50))
            .build(backend.clone())
            .unwrap()
    };
    let _two = adaptive(4).acquire_many(2).await.unwrap();
    let adaptive = adaptive(8);
    assert_eq!(adaptive.available_permits().await.unwrap(), 2);
}

async fn a_snapshot_shows_the_limit_holders_and_waiters(backend: impl Backend + Clone) {
    let sem = Semaphore::builder("snap")
        .limit(3)
        .lease(Duration::from_secs(30))
        .acquire_timeout(Duration::from_secs(10))
        .build(backend)
        .unwrap();
    let first = sem.acquire_many(2).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = sem.acquire().await.unwrap();
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire_many(2).await }
    });
    support::eventually(Duration::from_secs(5), "the waiter in line", || async {
        sem.snapshot().await.unwrap().waiting == 1
    })
    .await;
    let snap = sem.snapshot().await.unwrap();
    assert_eq!((snap.limit, snap.used, snap.waiting), (3, 3, 1));
    let ids: Vec<&str> = snap.holders.iter().map(|h| h.id.as_str()).collect();
    assert_eq!(ids, [first.id(), second.id()], "longest-held first");
    assert_eq!(snap.holders[0].weight, 2);
    assert!(snap.holders[0].held_for >= Duration::from_millis(200));
    assert!(snap.holders[0].held_for < Duration::from_secs(5));
    for holder in &snap.holders {
        assert!(holder.lease_remaining > Duration::from_secs(25));
        assert!(holder.lease_remaining <= Duration::from_secs(30));
    }
    drop(first);
    let third = waiter.await.unwrap().unwrap();
    let snap = sem.snapshot().await.unwrap();
    assert_eq!((snap.used, snap.waiting, snap.holders.len()), (3, 0, 2));
    drop((second, third));
}

async fn lowering_the_limit_takes_nothing_from_holders(backend: impl Backend + Clone) {
    let sem = Semaphore::builder("lower")
        .limit(5)
        .lease(Duration::from_secs(1))
        .acquire_timeout(Duration::from_millis(300))
        .build(backend)
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(sem.acquire().await.unwrap());
    }
    assert!(matches!(sem.set_limit(0).await, Err(Error::Config(_))));
    sem.set_limit(2).await.unwrap();
    assert_eq!(sem.snapshot().await.unwrap().limit, 2);
    // Nobody new while 3 hold under a limit of 2; a weight above it is refused outright.
    assert!(sem.try_acquire().await.unwrap().is_none());
    assert!(matches!(sem.acquire_many(3).await, Err(Error::Config(_))));
    // The holders keep their slots past the lease (renewed, not lost).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(held.iter().all(|permit| !permit.is_lost()));
    held.truncate(1);
    let back = sem.acquire().await.expect("1 held, limit 2: room for one");
    assert!(sem.try_acquire().await.unwrap().is_none());
    drop((held, back));
}

async fn unsetting_a_limit_returns_to_the_one_configured(backend: impl Backend + Clone) {
    let sem = Semaphore::builder("unpin")
        .limit(3)
        .acquire_timeout(Duration::from_millis(200))
        .build(backend)
        .unwrap();
    let held = sem.acquire().await.unwrap();
    let snap = sem.snapshot().await.unwrap();
    assert_eq!((snap.limit, snap.pinned), (3, false));
    sem.set_limit(1).await.unwrap();
    sem.set_limit(2).await.unwrap(); // a second pin returns to the configured one too
    let snap = sem.snapshot().await.unwrap();
    assert_eq!((snap.limit, snap.pinned), (2, true));
    let second = sem.acquire().await.unwrap();
    assert!(
        sem.try_acquire().await.unwrap().is_none(),
        "2 held, pinned at 2"
    );
    sem.unset_limit().await.unwrap();
    let snap = sem.snapshot().await.unwrap();
    assert_eq!((snap.limit, snap.pinned), (3, false));
    let third = sem
        .try_acquire()
        .await
        .unwrap()
        .expect("room under the configured 3");
    sem.unset_limit().await.unwrap(); // not pinned: nothing changes
    assert_eq!(sem.snapshot().await.unwrap().limit, 3);
    drop((held, second, third));
}

fn names(backend: RedisBackend) -> Semaphore {
    Semaphore::builder("names")
        .limit(1)
        .acquire_timeout(Duration::from_secs(5))
        .build(backend)
        .unwrap()
}

/// Holders name their process, `host:pid` by default, whether granted at once or from the
/// line (a name is one per process: each test here has its own server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holders_name_their_process_by_host_and_pid() {
    let redis = Redis::start().await;
    let sem = names(redis.backend().await);
    let first = sem.acquire().await.unwrap();
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    support::eventually(Duration::from_secs(5), "the waiter in line", || async {
        sem.snapshot().await.unwrap().waiting == 1
    })
    .await;
    let process = sem.snapshot().await.unwrap().holders[0].process.clone();
    let pid = format!(":{}", std::process::id());
    assert!(
        process.ends_with(&pid) && process.len() > pid.len(),
        "{process}"
    );
    drop(first);
    let second = waiter.await.unwrap().unwrap();
    let snap = sem.snapshot().await.unwrap();
    assert_eq!(snap.holders[0].id, second.id());
    assert_eq!(snap.holders[0].process, process, "granted from the line");
}

/// A name given to the backend is shown instead, cut to 64 bytes; names are kept beside the
/// semaphore, in its slot, and expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holders_show_the_name_their_process_was_given() {
    let redis = Redis::start().await;
    let backend = RedisBackend::builder(redis.url.as_str())
        .process_name(format!("web-1 (eu) {}", "é".repeat(40)))
        .connect()
        .await
        .unwrap();
    let sem = names(backend);
    sem.set_limit(1).await.unwrap(); // a first call that grants nothing tells the name too
    let held = sem.acquire().await.unwrap();
    let snap = sem.snapshot().await.unwrap();
    let expected = format!("web-1 (eu) {}", "é".repeat(26)); // 11 + 52 bytes: whole chars
    assert_eq!(snap.holders[0].process, expected);
    let key = "dlimit:{names}:procs";
    let mut conn = redis.conn().await;
    let names: Vec<String> = redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(names.len(), 1, "{names:?}");
    assert!(names[0].ends_with(&expected), "{names:?}");
    let ttl: i64 = redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 0 && ttl <= 3_600_000, "the names expire: {ttl}");
    drop(held);
}

/// Redis restarted empty forgets the names; a process tells its own again with its first
/// call on the new connection, not half a minute later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_come_back_after_redis_restarts_empty() {
    let mut redis = Redis::start().await;
    let backend = RedisBackend::builder(redis.url.as_str())
        .process_name("worker-3")
        .connect()
        .await
        .unwrap();
    let sem = names(backend);
    drop(sem.acquire().await.unwrap());
    redis.kill();
    redis.restart().await;
    let held = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match sem.acquire().await {
                Ok(permit) => return permit,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await
    .expect("Redis is back within 5 s");
    let snap = sem.snapshot().await.unwrap();
    assert_eq!(snap.holders[0].id, held.id());
    assert_eq!(snap.holders[0].process, "worker-3");
}

/// An operator pins a limit on a semaphore nobody uses yet (the `dlimit set-limit --create`
/// case, its own limit a placeholder); unpinning returns to the limit the first process was
/// configured with, never to the operator tool's placeholder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_pinned_before_first_use_unpins_to_the_configured_one() {
    let redis = Redis::start().await;
    let operator = Semaphore::builder("early")
        .limit(u32::MAX)
        .build(redis.backend().await)
        .unwrap();
    operator.set_limit(5).await.unwrap();
    let sem = Semaphore::builder("early")
        .limit(2)
        .acquire_timeout(Duration::from_millis(200))
        .build(redis.backend().await)
        .unwrap();
    // Pinned above its own limit of 2, once it has heard so, it may take 5 at once.
    drop(sem.acquire().await.unwrap());
    drop(sem.acquire_many(5).await.unwrap());
    let held: Vec<_> = futures_util::future::join_all((0..3).map(|_| sem.acquire())).await;
    assert!(held.iter().all(Result::is_ok), "pinned at 5: 3 fit");
    operator.unset_limit().await.unwrap();
    let snap = operator.snapshot().await.unwrap();
    assert_eq!((snap.limit, snap.pinned), (2, false));
    assert!(
        sem.try_acquire().await.unwrap().is_none(),
        "3 held over 2: nobody new"
    );
    // Unpinned, the state expires with the holders again.
    let ttl: i64 = redis::cmd("PTTL")
        .arg("dlimit:{early}:meta")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    assert!(ttl > 0, "meta expires again once unpinned: {ttl}");
    drop(held);
}

/// Holds `sem`'s permits with 4 tasks for `run`, counting holders with INCR/DECR on the
/// observer key `holders` at `url`; the largest count seen.
async fn hammer(sem: Semaphore, url: &str, run: Duration) -> i64 {
    let max = Arc::new(AtomicI64::new(0));
    let end = Instant::now() + run;
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (sem, max, url) = (sem.clone(), max.clone(), url.to_owned());
            tokio::spawn(async move {
                let mut conn = redis::Client::open(url)
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap();
                while Instant::now() < end {
                    let Ok(permit) = sem.acquire().await else {
                        continue;
                    };
                    let now: i64 = redis::cmd("INCR")
                        .arg("holders")
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    max.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    let _: i64 = redis::cmd("DECR")
                        .arg("holders")
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    drop(permit);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    max.load(Ordering::SeqCst)
}

fn rolling(limit: u32, backend: RedisBackend) -> Semaphore {
    Semaphore::builder("rolling")
        .limit(limit)
        .acquire_timeout(Duration::from_secs(2))
        .build(backend)
        .unwrap()
}

/// The child: a process built with `.limit(5)`; hammers for 4 s, then says the largest count
/// of holders it saw and the limit in force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the other tests"]
async fn child_process() {
    let Some((role, url)) = support::child_role() else {
        return;
    };
    assert_eq!(role, "limit-5", "unknown role");
    let sem = rolling(5, RedisBackend::connect(&url).await.unwrap());
    let max = hammer(sem.clone(), &url, Duration::from_secs(4)).await;
    println!(
        "DLIMIT max {max} limit {}",
        sem.snapshot().await.unwrap().limit
    );
}

/// Two processes built with limits 2 and 5 share one semaphore: both admit by the first
/// one's, 2; after `set_limit(3)` both report 3 and never run above it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_built_with_different_limits_admit_by_one() {
    let redis = Redis::start().await;
    let ours = rolling(2, redis.backend().await);
    drop(ours.acquire().await.unwrap()); // the first process stores its limit
    let mut child = support::spawn_child_with("limit-5", &redis.url);
    // Both hammer for 1.5 s under the stored limit of 2.
    let before = hammer(ours.clone(), &redis.url, Duration::from_millis(1500)).await;
    assert!(before <= 2, "{before} held at once under a limit of 2");
    ours.set_limit(3).await.unwrap();
    let after = hammer(ours.clone(), &redis.url, Duration::from_millis(1500)).await;
    assert!(after <= 3, "{after} held at once under a limit of 3");
    let said = support::child_says(&mut child).await;
    let (theirs, limit) = said
        .strip_prefix("max ")
        .and_then(|rest| rest.split_once(" limit "))
        .expect(&said);
    let theirs: i64 = theirs.parse().unwrap();
    assert!(theirs <= 3, "the child saw {theirs} at once");
    assert_eq!(limit, "3", "the child admits by the limit set");
    assert_eq!(ours.snapshot().await.unwrap().limit, 3);
    assert_eq!(before.max(after).max(theirs), 3, "the raised limit is used");
    assert!(child.wait().await.unwrap().success());

    // A set limit stays while idle; a configured one goes with the semaphore's keys.
    let pinned: i64 = redis::cmd("PTTL")
        .arg("dlimit:{rolling}:meta")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    assert_eq!(pinned, -1, "a set limit does not expire");
}
