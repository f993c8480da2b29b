//! Prefetched slots (`SemaphoreBuilder::prefetch`) against a real redis-server (two backends,
//! as two processes would be, and real child processes) and in process: the limit exact
//! under a hammer, acquires served without a round trip while nobody waits, a waiter elsewhere
//! served from the unused slots, a frozen or killed prefetcher leaking nothing past its lease,
//! a pool cut off from Redis serving nothing past it.

#[macro_use]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::task::JoinSet;
use tower_distributed_limit::{
    AdaptiveLimit, Backend, Error, MemoryBackend, RedisBackend, Semaphore,
};

use support::{child_role, child_says, eventually, signal, spawn_child};

fn hot(backend: impl Backend, limit: u32, prefetch: u32) -> Semaphore {
    Semaphore::builder("hot")
        .limit(limit)
        .prefetch(prefetch)
        .lease(Duration::from_secs(2))
        .acquire_timeout(Duration::from_secs(10))
        .build(backend)
        .unwrap()
}

/// Two handles, each prefetching: two backends on one Redis, or two clones in process.
async fn pair(redis: Option<&support::Redis>, limit: u32, prefetch: u32) -> (Semaphore, Semaphore) {
    match redis {
        Some(redis) => (
            hot(redis.backend().await, limit, prefetch),
            hot(redis.backend().await, limit, prefetch),
        ),
        None => {
            let backend = MemoryBackend::new();
            (
                hot(backend.clone(), limit, prefetch),
                hot(backend, limit, prefetch),
            )
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_holds_under_a_hammer_on_redis() {
    let redis = support::Redis::start().await;
    let handles = pair(Some(&redis), 8, 4).await;
    hammer(handles, &redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_holds_under_a_hammer_in_process() {
    let backend = MemoryBackend::new();
    let (a, b) = (hot(backend.clone(), 8, 4), hot(backend, 8, 4));
    hammer_only((a.clone(), b)).await;
    assert!(a.snapshot().await.unwrap().used <= 8);
}

/// 24 tasks over two prefetching handles, each holding a permit for a moment 20 times: never
/// more than the limit in their hands, nor held in Redis (prefetched + handed out + others).
async fn hammer((a, b): (Semaphore, Semaphore), redis: &support::Redis) {
    let watcher = hot(redis.backend().await, 8, 0);
    let worst_held = Arc::new(AtomicU32::new(0));
    let sampling = {
        let (watcher, worst_held) = (watcher.clone(), worst_held.clone());
        tokio::spawn(async move {
            loop {
                let used = watcher.snapshot().await.unwrap().used;
                worst_held.fetch_max(used, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    hammer_only((a.clone(), b.clone())).await;
    sampling.abort();
    assert!(
        worst_held.load(Ordering::SeqCst) <= 8,
        "Redis held {worst_held:?}"
    );
    // Dropped, the handles give every slot back.
    drop((a, b));
    eventually(Duration::from_secs(5), "every slot back", || async {
        watcher.snapshot().await.unwrap().used == 0
    })
    .await;
}

async fn hammer_only((a, b): (Semaphore, Semaphore)) {
    let (in_hand, worst) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let mut tasks = JoinSet::new();
    for i in 0..24u32 {
        let sem = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (in_hand, worst) = (in_hand.clone(), worst.clone());
        tasks.spawn(async move {
            for _ in 0..20 {
                let permit = sem.acquire().await.unwrap();
                worst.fetch_max(in_hand.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
                in_hand.fetch_sub(1, Ordering::SeqCst);
                drop(permit);
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let worst = worst.load(Ordering::SeqCst);
    assert!(worst <= 8, "{worst} permits in hand at once, limit 8");
    assert_eq!(worst, 8, "the hammer never reached the limit");
}

/// While nobody waits, acquires after the first are served from the pool: a hundred of them
/// cost a handful of script calls, not a hundred.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_are_local_while_nobody_waits() {
    let redis = support::Redis::start().await;
    let sem = hot(redis.backend().await, 64, 8);
    drop(sem.acquire().await.unwrap());
    eventually(Duration::from_secs(5), "the pool filled", || async {
        sem.snapshot().await.unwrap().used == 8
    })
    .await;
    // The operator sees them as the pool's; a heavier permit, which never goes there, not.
    let heavy = sem.acquire_many(2).await.unwrap();
    let holders = sem.snapshot().await.unwrap().holders;
    let pooled = |holder: &&tower_distributed_limit::Holder| holder.prefetched;
    assert_eq!(holders.iter().filter(pooled).count(), 8, "{holders:?}");
    let unpooled: Vec<_> = holders.iter().filter(|holder| !holder.prefetched).collect();
    assert_eq!(unpooled.len(), 1, "{holders:?}");
    assert_eq!(unpooled[0].id, heavy.id());
    drop(heavy);
    let before = redis.script_calls().await;
    for _ in 0..100 {
        let permit = sem.acquire().await.unwrap();
        assert!(!permit.is_lost());
        drop(permit);
    }
    let calls = redis.script_calls().await - before;
    assert!(calls <= 3, "{calls} script calls for 100 acquires");
    // Prefetch 0 is today's semaphore: one call each.
    let plain = hot(redis.backend().await, 64, 0);
    let before = redis.script_calls().await;
    for _ in 0..10 {
        plain.acquire().await.unwrap().release().await.unwrap();
    }
    assert!(redis.script_calls().await - before >= 20);
}

/// A waiter in another process gets a slot the prefetcher holds unused: the prefetcher learns
/// of it with its next call (here its check, every 50 ms) and gives the pool back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_elsewhere_gets_the_unused_slots() {
    let redis = support::Redis::start().await;
    let (a, _) = pair(Some(&redis), 4, 4).await;
    let other = hot(redis.backend().await, 4, 0);
    drop(a.acquire().await.unwrap());
    eventually(
        Duration::from_secs(5),
        "a's pool holds every slot",
        || async { other.snapshot().await.unwrap().used == 4 },
    )
    .await;
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let other = other.clone();
            tokio::spawn(async move { other.acquire().await })
        })
        .collect();
    let mut held = Vec::new();
    for waiter in waiters {
        let permit = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("a waiter starved beside unused prefetched slots")
            .unwrap()
            .unwrap();
        held.push(permit);
    }
    // While they wait and hold, the prefetcher takes nothing more.
    assert!(a.try_acquire().await.unwrap().is_none());
    drop(held);
}

/// The same in process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_elsewhere_gets_the_unused_slots_in_process() {
    let (a, other) = pair(None, 2, 2).await;
    drop(a.acquire().await.unwrap());
    eventually(
        Duration::from_secs(5),
        "a's pool holds every slot",
        || async { a.snapshot().await.unwrap().used == 2 },
    )
    .await;
    let holders = a.snapshot().await.unwrap().holders;
    assert!(
        holders.iter().all(|holder| holder.prefetched),
        "{holders:?}"
    );
    let waiter = {
        let other = other.clone();
        tokio::spawn(async move { other.acquire().await })
    };
    eventually(Duration::from_secs(5), "the waiter in line", || async {
        other.snapshot().await.unwrap().waiting == 1
    })
    .await;
    // `a` learns of the waiter with its next call: its check of the pool.
    let permit = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("a waiter starved beside unused prefetched slots")
        .unwrap()
        .unwrap();
    drop(permit);
}

#[test]
fn prefetch_above_the_limit_or_an_adaptive_minimum_is_refused() {
    let over = Semaphore::builder("p")
        .limit(4)
        .prefetch(5)
        .build(MemoryBackend::new());
    assert!(matches!(over, Err(Error::Config(m)) if m.contains("prefetch 5")));
    let adaptive = |prefetch| {
        Semaphore::builder("p")
            .adaptive(AdaptiveLimit::new().initial(20).min(4).max(40))
            .prefetch(prefetch)
            .build(MemoryBackend::new())
    };
    assert!(matches!(adaptive(5), Err(Error::Config(m)) if m.contains("minimum 4")));
    assert!(adaptive(4).is_ok());
}

/// An adaptive semaphore that prefetches learns from the holds handed out of its pool, which
/// never reach the backend as releases: every one marked overloaded, the limit falls.
async fn pooled_holds_teach_the_limit(backend: impl Backend) {
    let sem = Semaphore::builder("learns")
        .adaptive(AdaptiveLimit::new().initial(20).min(2).max(40))
        .prefetch(2)
        .lease(Duration::from_secs(2))
        .build(backend)
        .unwrap();
    drop(sem.acquire().await.unwrap());
    eventually(Duration::from_secs(5), "the pool filled", || async {
        sem.snapshot().await.unwrap().used == 2
    })
    .await;
    let mut ids = std::collections::HashSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sem.snapshot().await.unwrap().limit >= 20 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the limit never learnt from the pool's holds"
        );
        for _ in 0..20 {
            let permit = sem.acquire().await.unwrap();
            ids.insert(permit.id().to_owned());
            permit.mark_overloaded();
        }
        // Time is the subject: the limit moves once per window of 100 ms.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // They came out of the pool: never more slots than the first grant and one refill.
    assert!(ids.len() <= 3, "{} slots for the hand-outs", ids.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_holds_teach_an_adaptive_limit_on_redis() {
    let redis = support::Redis::start().await;
    pooled_holds_teach_the_limit(redis.backend().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_holds_teach_an_adaptive_limit_in_process() {
    pooled_holds_teach_the_limit(MemoryBackend::new()).await;
}

/// A prefetching process killed with its pool full, or frozen: its slots come back when
/// their lease ends (2 s), not later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_or_frozen_prefetcher_leaks_nothing_past_its_lease() {
    let redis = support::Redis::start().await;
    let sem = hot(redis.backend().await, 4, 0);
    for signal_name in ["STOP", "KILL"] {
        let mut child = spawn_child(&redis, "prefetch");
        assert_eq!(child_says(&mut child).await, "prefetched");
        assert_eq!(sem.snapshot().await.unwrap().used, 4);
        signal(child.id().unwrap(), signal_name);
        let all = tokio::time::timeout(Duration::from_secs(6), sem.acquire_many(4))
            .await
            .unwrap_or_else(|_| panic!("the {signal_name}ped prefetcher's slots never came back"))
            .unwrap();
        drop(all);
        signal(child.id().unwrap(), "KILL");
        let _ = child.wait().await;
        support::wait_until_available(&sem, 4).await;
    }
}

/// Redis gone (killed, as a partition looks from this process) with the pool full: the pool
/// hands out only while its lease may still run on the server. A permit handed out after the
/// kill learns it is lost by the lease's end, and once the lease may have ended no acquire is
/// served from the pool (elsewhere the slots are free again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_cut_off_from_redis_serves_nothing_past_its_lease() {
    let mut redis = support::Redis::start().await;
    let sem = Semaphore::builder("cut-off")
        .limit(4)
        .prefetch(2)
        .lease(Duration::from_secs(1))
        .acquire_timeout(Duration::from_millis(200))
        .build(redis.backend().await)
        .unwrap();
    drop(sem.acquire().await.unwrap());
    eventually(Duration::from_secs(2), "the pool filled", || async {
        let snapshot = sem.snapshot().await.unwrap();
        snapshot.used == 2 && snapshot.holders.iter().all(|h| h.prefetched)
    })
    .await;
    redis.kill();
    // Every pooled slot was granted before this: its lease ends within 1 s from here.
    let killed = tokio::time::Instant::now();
    let from_pool = sem
        .acquire()
        .await
        .expect("the pool serves within its lease");
    tokio::time::timeout(Duration::from_secs(2), from_pool.lost())
        .await
        .expect("a permit from the pool never learned its lease was lost");
    assert!(
        killed.elapsed() <= Duration::from_millis(1200),
        "learned {:?} after the kill, past the 1 s lease",
        killed.elapsed()
    );
    // The other pooled slot may have been granted or renewed a little later than the one
    // handed out (its lease a little longer): past a lease from the kill, every one has ended.
    tokio::time::sleep_until(killed + Duration::from_secs(1)).await;
    let past = tokio::time::Instant::now() + Duration::from_millis(500);
    while tokio::time::Instant::now() < past {
        assert!(
            sem.acquire().await.is_err(),
            "served from a pool whose lease may have ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the other tests"]
async fn child_process() {
    let Some((role, url)) = child_role() else {
        return;
    };
    assert_eq!(role, "prefetch", "unknown role");
    let sem = hot(RedisBackend::connect(&url).await.unwrap(), 4, 4);
    drop(sem.acquire().await.unwrap());
    eventually(Duration::from_secs(5), "the pool filled", || async {
        sem.snapshot().await.unwrap().used == 4
    })
    .await;
    println!("DLIMIT prefetched");
    // Hold the pool until killed.
    let _ = BufReader::new(tokio::io::stdin()).lines().next_line().await;
}
