//! The core's promises at the edges, each attacked the way a hostile user would: short
//! timeouts under load, 500 waiters in one process giving up at random, runtimes that come
//! and go, permits dropped off any runtime, keys
//! deleted behind the semaphore's back, absurd timeouts, hostile names, per-key churn, and a
//! Redis server busy with a script.

#[macro_use]
mod support;

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;
use tower_distributed_limit::{
    Backend, Error, MemoryBackend, OutagePolicy, Partitions, RedisBackend, Semaphore,
};

use support::{Redis, eventually};

on_both_backends!(
    a_short_acquire_timeout_is_never_an_outage,
    a_free_slot_is_granted_even_with_a_1ms_timeout,
    an_endless_acquire_timeout_works,
    renewal_survives_a_runtime_that_went_away,
);

/// 1 000 callers with a 1 ms acquire timeout on a full semaphore: every one times out, none
/// is a backend failure, and so none is let through by a fail-open policy.
async fn a_short_acquire_timeout_is_never_an_outage(backend: impl Backend + Clone) {
    let sem = Semaphore::builder("short-timeouts")
        .limit(1)
        .acquire_timeout(Duration::from_millis(1))
        .on_outage(OutagePolicy::FailOpen)
        .build(backend)
        .unwrap();
    let held = sem.acquire().await.unwrap();
    let calls = (0..1000).map(|_| {
        let sem = sem.clone();
        tokio::spawn(async move { sem.acquire().await })
    });
    let mut timeouts = 0;
    for call in calls.collect::<Vec<_>>() {
        match call.await.unwrap() {
            Err(Error::Timeout { .. }) => timeouts += 1,
            Ok(permit) => panic!(
                "admitted past a full semaphore: degraded={}",
                permit.is_degraded()
            ),
            Err(e) => panic!("a short wait on a healthy backend is not an outage: {e}"),
        }
    }
    assert_eq!(timeouts, 1000);
    assert_eq!(sem.outage_decisions(), 0);
    drop(held);
}

/// The acquire timeout bounds the wait in line, not the backend's answer.
async fn a_free_slot_is_granted_even_with_a_1ms_timeout(backend: impl Backend + Clone) {
    let sem = Semaphore::builder("free-slots")
        .limit(500)
        .acquire_timeout(Duration::from_millis(1))
        .build(backend)
        .unwrap();
    let calls: Vec<_> = (0..300)
        .map(|_| {
            let sem = sem.clone();
            tokio::spawn(async move { sem.acquire().await })
        })
        .collect();
    let mut permits = Vec::new();
    for call in calls {
        permits.push(call.await.unwrap().expect("a free slot is granted"));
    }
    assert_eq!(sem.available_permits().await.unwrap(), 200);
}

/// `Duration::MAX` is accepted by the builder, so it must work: no overflow panic.
async fn an_endless_acquire_timeout_works(backend: impl Backend + Clone) {
    let sem = Semaphore::builder("endless")
        .limit(1)
        .acquire_timeout(Duration::MAX)
        .build(backend)
        .unwrap();
    let held = sem.acquire().await.unwrap();
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    drop(held);
    let permit = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter is served once the permit comes back")
        .unwrap()
        .unwrap();
    assert!(!permit.is_lost());
}

/// A permit taken and given back inside a short-lived runtime (a setup step, a `block_on`
/// helper) must not stop later permits from being renewed in the main runtime.
async fn renewal_survives_a_runtime_that_went_away(backend: impl Backend + Clone) {
    let sem = Semaphore::builder("runtimes")
        .limit(1)
        .lease(Duration::from_secs(1))
        .acquire_timeout(Duration::from_millis(200))
        .build(backend)
        .unwrap();
    let setup = sem.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut permit = setup.acquire().await.unwrap();
            permit.release().await.unwrap();
        });
    })
    .join()
    .unwrap();

    let permit = sem.acquire().await.unwrap();
    // Three leases long: only renewal keeps the slot.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!permit.is_lost(), "the permit was not renewed");
    assert!(
        matches!(sem.acquire().await, Err(Error::Timeout { .. })),
        "another caller took the slot of a permit that is still held"
    );
}

/// A permit dropped where no runtime runs cannot be sent at once; it must not stop the next
/// dropped permits from being sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_dropped_off_the_runtime_does_not_stall_later_releases() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("off-runtime")
        .limit(2)
        .lease(Duration::from_secs(60))
        .build(redis.backend().await)
        .unwrap();
    // Another process's view: its own connection, so it carries none of our releases.
    let observer = Semaphore::builder("off-runtime")
        .limit(2)
        .build(redis.backend().await)
        .unwrap();
    let first = sem.acquire().await.unwrap();
    let second = sem.acquire().await.unwrap();
    std::thread::spawn(move || drop(first)).join().unwrap();
    drop(second);
    support::wait_until_available(&observer, 2).await;
}

/// What the limit's tasks hold between acquiring and dropping, and the most ever at once.
#[derive(Clone, Default)]
struct Tally {
    now: std::sync::Arc<std::sync::atomic::AtomicI64>,
    most: std::sync::Arc<std::sync::atomic::AtomicI64>,
}

impl Tally {
    async fn hold(&self, permit: tower_distributed_limit::Permit, for_: Duration) {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.now.fetch_add(1, SeqCst) + 1;
        self.most.fetch_max(now, SeqCst);
        tokio::time::sleep(for_).await;
        self.now.fetch_sub(1, SeqCst);
        drop(permit);
    }
}

/// 500 waiters in one process (and its twin, which prefetches) on a limit of 3, each giving
/// up at random: by its 40 ms acquire timeout, or cancelled mid-wait. Never more than 3 held,
/// no error but timeouts, and once they stop nothing is held or waiting and every slot can
/// be taken at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_waiters_giving_up_at_random_leak_nothing() {
    let redis = Redis::start().await;
    let build = |backend, prefetch| {
        Semaphore::builder("give-up")
            .limit(3)
            .lease(Duration::from_secs(2))
            .acquire_timeout(Duration::from_millis(40))
            .prefetch(prefetch)
            .build(backend)
            .unwrap()
    };
    let ours = build(redis.backend().await, 0);
    let twin = build(redis.backend().await, 2);
    let tally = Tally::default();
    let until = Instant::now() + Duration::from_secs(4);
    let tasks: Vec<_> = (0..500u64)
        .map(|i| {
            let sem = if i % 2 == 0 {
                ours.clone()
            } else {
                twin.clone()
            };
            let tally = tally.clone();
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(i);
                let mut held = 0;
                while Instant::now() < until {
                    let outcome = if rng.bool() {
                        let cancel = Duration::from_millis(rng.u64(0..30));
                        match tokio::time::timeout(cancel, sem.acquire()).await {
                            Ok(outcome) => outcome,
                            Err(_) => continue,
                        }
                    } else {
                        sem.acquire().await
                    };
                    match outcome {
                        Ok(permit) => {
                            let hold = Duration::from_micros(rng.u64(100..3000));
                            tally.hold(permit, hold).await;
                            held += 1;
                        }
                        Err(Error::Timeout { .. }) => {}
                        Err(e) => panic!("not a timeout: {e}"),
                    }
                }
                held
            })
        })
        .collect();
    let mut held = 0;
    for task in tasks {
        held += task.await.unwrap();
    }
    assert!(held > 0, "nobody held at all");
    let most = tally.most.load(std::sync::atomic::Ordering::SeqCst);
    assert!(most <= 3, "{most} held at once on a limit of 3");
    // Only the twin's prefetched slots may stay, and they are free to take.
    eventually(
        Duration::from_secs(5),
        "nothing held, nobody waits",
        || async {
            let snapshot = ours.snapshot().await.unwrap();
            let pooled = snapshot.holders.iter().filter(|h| h.prefetched).count();
            snapshot.waiting == 0 && snapshot.used as usize == pooled
        },
    )
    .await;
    let permits = futures_util::future::join_all((0..3).map(|_| twin.acquire())).await;
    assert!(permits.iter().all(Result::is_ok), "{permits:?}");
}

/// `holders` evicted or deleted while `meta` survives: the semaphore must not go on counting
/// holders that no longer exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_holders_key_does_not_wedge_the_semaphore() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("wedge")
        .limit(2)
        .lease(Duration::from_secs(60))
        .build(redis.backend().await)
        .unwrap();
    let held: Vec<_> = vec![sem.acquire().await.unwrap(), sem.acquire().await.unwrap()];
    let mut conn = redis.conn().await;
    let deleted: u32 = redis::cmd("DEL")
        .arg("dlimit:{wedge}:holders")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    assert_eq!(sem.available_permits().await.unwrap(), 2);
    let again = sem.try_acquire_many(2).await.unwrap();
    assert!(
        again.is_some(),
        "the semaphore trusted a counter over its members"
    );
    // Its keys carry a TTL again, so nothing is left behind.
    for key in ["dlimit:{wedge}:holders", "dlimit:{wedge}:meta"] {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(ttl > 0, "{key} has no TTL ({ttl})");
    }
    drop(held);
}

/// A call that failed half-way (say an ACL refusing a command after the script's first write)
/// can leave the counters apart from the members: a phantom holder counted and none behind it.
/// The holders' count is checked on every call, so a phantom holder is gone at the next call;
/// the weight they hold once a second, so a phantom weight is gone within one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_apart_from_its_members_is_rebuilt() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("apart")
        .limit(2)
        .lease(Duration::from_secs(60))
        .build(redis.backend().await)
        .unwrap();
    let held = sem.acquire().await.unwrap();
    let conn = redis.conn().await;
    // `state` is nine little-endian doubles, `used` and `count` first: one more of the first
    // `fields` of them.
    let phantom = |fields: usize| {
        let mut conn = conn.clone();
        async move {
            let state: Vec<u8> = redis::cmd("HGET")
                .arg("dlimit:{apart}:meta")
                .arg("state")
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(state.len(), 72);
            let mut phantom = state.clone();
            for field in 0..fields {
                let at = field * 8;
                let value = f64::from_le_bytes(state[at..at + 8].try_into().unwrap());
                assert_eq!(value, 1.0);
                phantom[at..at + 8].copy_from_slice(&2.0f64.to_le_bytes());
            }
            let _: () = redis::cmd("HSET")
                .arg("dlimit:{apart}:meta")
                .arg("state")
                .arg(phantom)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    };
    // A phantom holder: counted again by the very next call.
    phantom(2).await;
    let mut second = sem
        .try_acquire()
        .await
        .unwrap()
        .expect("a phantom holder is counted again at once");
    second.release().await.unwrap();
    // A phantom weight (the count right): counted at first, gone within a second.
    phantom(1).await;
    assert!(
        sem.try_acquire().await.unwrap().is_none(),
        "the phantom weight counts"
    );
    let started = Instant::now();
    eventually(Duration::from_secs(3), "the phantom slot back", || async {
        sem.try_acquire().await.unwrap().is_some()
    })
    .await;
    assert!(started.elapsed() < Duration::from_millis(2500));
    eventually(Duration::from_secs(2), "one held", || async {
        sem.snapshot().await.unwrap().used == 1
    })
    .await;
    drop(held);
}

/// The hash tag Redis Cluster hashes for `key`: the text between the first `{` and the next
/// `}`, when not empty; otherwise the whole key.
fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{')
        && let Some(len) = key[open + 1..].find('}')
        && len > 0
    {
        return &key[open + 1..open + 1 + len];
    }
    key
}

/// Whatever the name, all of a semaphore's keys hash to one slot, and no two names share keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_names_keep_their_keys_in_one_slot_and_apart() {
    let redis = Redis::start().await;
    let backend = redis.backend().await;
    let names = [
        "}", "}x", "a}b", "a", "{", "{a}", "%7D", "%", "%25", "a b\n", "ключ", "}{",
    ];
    let mut held = Vec::new();
    for name in names {
        let sem = Semaphore::builder(name)
            .limit(1)
            .build(backend.clone())
            .unwrap();
        // Every name gets its own slot: none of these is refused as full.
        held.push(
            sem.try_acquire()
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{name:?} shares keys with another name")),
        );
        // And a queued waiter, so the line's keys exist too.
        let waiter = Semaphore::builder(name)
            .limit(1)
            .acquire_timeout(Duration::from_millis(50))
            .build(backend.clone())
            .unwrap();
        assert!(matches!(waiter.acquire().await, Err(Error::Timeout { .. })));
    }
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("dlimit:*")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    let mut by_semaphore: HashMap<&str, Vec<&str>> = HashMap::new();
    for key in &keys {
        let base = key.rsplit_once(':').unwrap().0;
        by_semaphore.entry(base).or_default().push(key);
    }
    assert_eq!(by_semaphore.len(), names.len(), "{keys:?}");
    let mut tags = std::collections::HashSet::new();
    for (base, keys) in &by_semaphore {
        let tag = hash_tag(keys[0]);
        assert_ne!(tag, keys[0], "{base}: no hash tag");
        for key in keys {
            assert_eq!(
                hash_tag(key),
                tag,
                "{key} is in another slot than {}",
                keys[0]
            );
        }
        assert!(tags.insert(tag.to_owned()), "two names share the tag {tag}");
    }
    // Plain names keep the tag an operator expects.
    assert!(keys.contains(&"dlimit:{a}:holders".to_owned()), "{keys:?}");
    drop(held);
}

/// Per-key semaphores used once each must not leave a renewal task behind per key.
#[tokio::test(flavor = "current_thread")]
async fn per_key_churn_leaves_no_tasks_behind() {
    let partitions = Partitions::like(Semaphore::builder("churn").lease(Duration::from_secs(3600)))
        .key(|_: &()| None)
        .limit(1)
        .capacity(16)
        .build(MemoryBackend::new())
        .unwrap();
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    for i in 0..300 {
        let permit = partitions
            .semaphore(&format!("key-{i}"))
            .unwrap()
            .acquire()
            .await
            .unwrap();
        drop(permit);
    }
    eventually(
        Duration::from_secs(2),
        "renewal tasks of released permits to end",
        || async { metrics.num_alive_tasks() <= before + 1 },
    )
    .await;
}

/// A server busy with a long script answers BUSY: that is transient, and an acquire asks again
/// within its timeout instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_server_is_waited_for_within_the_acquire_timeout() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("busy")
        .limit(1)
        .acquire_timeout(Duration::from_secs(5))
        .build(
            RedisBackend::builder(redis.url.as_str())
                .call_timeout(Duration::from_secs(3))
                .connect()
                .await
                .unwrap(),
        )
        .unwrap();
    let mut admin = redis.conn().await;
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("busy-reply-threshold")
        .arg(50)
        .exec_async(&mut admin)
        .await
        .unwrap();
    // A script that never ends, on a connection of its own (it blocks that connection).
    let mut blocked = redis.conn().await;
    let endless = tokio::spawn(async move {
        redis::cmd("EVAL")
            .arg("while true do end")
            .arg(0)
            .exec_async(&mut blocked)
            .await
    });
    eventually(Duration::from_secs(5), "the server to answer BUSY", || {
        let mut admin = admin.clone();
        async move {
            redis::cmd("PING")
                .query_async::<String>(&mut admin)
                .await
                .is_err_and(|e| e.code() == Some("BUSY"))
        }
    })
    .await;
    let started = Instant::now();
    let acquire = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis::cmd("SCRIPT")
        .arg("KILL")
        .exec_async(&mut admin)
        .await
        .unwrap();
    let permit = acquire
        .await
        .unwrap()
        .expect("BUSY is waited out, not an error");
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(sem.outage_decisions(), 0);
    drop(permit);
    assert!(endless.await.unwrap().is_err(), "the script was killed");
}

/// The library flushed (`FUNCTION FLUSH`) every 30 ms under load from two backends: every call
/// that finds it missing loads it again, the limit holds, and nobody fails or waits out its
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_flushed_under_load_is_loaded_again_and_the_limit_holds() {
    let redis = Redis::start().await;
    let tally = Tally::default();
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let sem = Semaphore::builder("flushed")
            .limit(3)
            .acquire_timeout(Duration::from_secs(10))
            .build(redis.backend().await)
            .unwrap();
        for _ in 0..10 {
            let (sem, tally) = (sem.clone(), tally.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..20 {
                    let permit = sem.acquire().await?;
                    tally.hold(permit, Duration::from_millis(2)).await;
                }
                Ok::<_, tower_distributed_limit::Error>(())
            }));
        }
    }
    let mut conn = redis.conn().await;
    let mut flushes = 0;
    while tasks.iter().any(|task| !task.is_finished()) {
        let _: () = redis::cmd("FUNCTION")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .unwrap();
        flushes += 1;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert!(flushes >= 3, "the run ended before {flushes} flushes");
    let most = tally.most.load(std::sync::atomic::Ordering::SeqCst);
    assert!(most <= 3, "{most} held at once under a limit of 3");
}

/// The script keeps what each member says of itself across calls (members meet several
/// calls), but a bounded number of them: 20 000 distinct members refused by a full
/// semaphore leave the functions' Lua memory within 400 KB of where 2 000 left it (1 000
/// members kept are about 300 KB; kept without a bound, the 20 000 took 6 MB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_remembers_a_bounded_number_of_members() {
    async fn refuse(sem: &Semaphore, n: usize) {
        let calls = (0..n).map(|_| {
            let sem = sem.clone();
            tokio::spawn(async move { sem.try_acquire().await })
        });
        for call in futures_util::future::join_all(calls).await {
            assert!(
                call.unwrap().unwrap().is_none(),
                "the full semaphore granted one"
            );
        }
    }
    async fn lua_memory(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
        // A full collection first: what is left is what the library keeps.
        let _: () = redis::cmd("FCALL")
            .arg("test_gc")
            .arg(0)
            .query_async(conn)
            .await
            .unwrap();
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query_async(conn)
            .await
            .unwrap();
        info.lines()
            .find_map(|line| line.strip_prefix("used_memory_vm_functions:"))
            .and_then(|n| n.trim().parse().ok())
            .expect("INFO memory tells the functions' memory")
    }
    let redis = Redis::start().await;
    let mut conn = redis.conn().await;
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(
            "#!lua name=test_gc\n\
             redis.register_function('test_gc', function() collectgarbage('collect') end)",
        )
        .query_async(&mut conn)
        .await
        .unwrap();
    let sem = Semaphore::builder("remembered")
        .limit(1)
        .build(redis.backend().await)
        .unwrap();
    let _held = sem.acquire().await.unwrap();
    refuse(&sem, 2_000).await;
    let before = lua_memory(&mut conn).await;
    refuse(&sem, 20_000).await;
    let after = lua_memory(&mut conn).await;
    assert!(
        after < before + 400_000,
        "the functions' memory grew from {before} to {after} bytes"
    );
}
