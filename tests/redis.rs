//! Redis-only behaviour: several OS processes, crashes, keys left behind, bad servers.

mod support;

use std::time::Duration;

use tokio::process::Child;
use tower_distributed_limit::{Error, RedisBackend, Semaphore};

use support::{Redis, child_role, child_says, eventually, spawn_child};

/// The body of the child processes; a no-op unless started by `spawn_child`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the other tests"]
async fn child_process() {
    let Some((role, url)) = child_role() else {
        return;
    };
    let backend = RedisBackend::connect(&url).await.unwrap();
    match role.as_str() {
        // 8 tasks x 25 rounds on a limit of 3, counting holders with an independent counter.
        "hammer" => {
            let sem = Semaphore::builder("shared")
                .limit(3)
                .acquire_timeout(Duration::from_secs(30))
                .build(backend)
                .unwrap();
            let client = redis::Client::open(url.as_str()).unwrap();
            let mut tasks = Vec::new();
            for _ in 0..8 {
                let sem = sem.clone();
                let mut conn = client.get_multiplexed_async_connection().await.unwrap();
                tasks.push(tokio::spawn(async move {
                    let mut max = 0i64;
                    for _ in 0..25 {
                        let mut permit = sem.acquire().await.unwrap();
                        let now: i64 = redis::cmd("INCR")
                            .arg("observed")
                            .query_async(&mut conn)
                            .await
                            .unwrap();
                        max = max.max(now);
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        let _: i64 = redis::cmd("DECR")
                            .arg("observed")
                            .query_async(&mut conn)
                            .await
                            .unwrap();
                        // Awaited, so none is still in flight when the process exits.
                        permit.release().await.unwrap();
                    }
                    max
                }));
            }
            let mut max = 0;
            for task in tasks {
                max = max.max(task.await.unwrap());
            }
            println!("DLIMIT max={max}");
        }
        // Takes 2 of 3 permits with a 1 s lease, reports, and waits to be killed.
        "hold" => {
            let sem = Semaphore::builder("crash")
                .limit(3)
                .lease(Duration::from_secs(1))
                .build(backend)
                .unwrap();
            let permit = sem.acquire_many(2).await.unwrap();
            println!("DLIMIT held {}", permit.fencing_token());
            tokio::time::sleep(Duration::from_secs(120)).await;
        }
        // Queues for a full semaphore and waits to be killed.
        "wait" => {
            let sem = Semaphore::builder("line")
                .limit(1)
                .lease(Duration::from_secs(1))
                .acquire_timeout(Duration::from_secs(120))
                .build(backend)
                .unwrap();
            println!("DLIMIT waiting");
            let _never = sem.acquire().await;
        }
        other => panic!("unknown role {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limit_holds_across_three_processes() {
    let redis = Redis::start().await;
    let mut children: Vec<Child> = (0..3).map(|_| spawn_child(&redis, "hammer")).collect();
    let mut max = 0;
    for child in &mut children {
        let said = child_says(child).await;
        let value: i64 = said.strip_prefix("max=").unwrap().parse().unwrap();
        max = max.max(value);
        assert!(child.wait().await.unwrap().success());
    }
    assert!(max <= 3, "{max} holders at once with a limit of 3");
    assert!(
        max >= 2,
        "the processes never overlapped (max {max}): the test proved nothing"
    );
    // Every permit came back, and what is left of the semaphore (its meta, with the limit in
    // force, until a lease and a half after the last grant) expires by itself.
    let sem = Semaphore::builder("shared")
        .limit(3)
        .build(redis.backend().await)
        .unwrap();
    assert_eq!(sem.available_permits().await.unwrap(), 3);
    let mut conn = redis.conn().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("dlimit:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    for key in keys {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!((1..=45_000).contains(&ttl), "{key} TTL {ttl} ms");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_gives_its_permits_back_after_the_lease() {
    let redis = Redis::start().await;
    let mut child = spawn_child(&redis, "hold");
    let said = child_says(&mut child).await;
    let child_token: u64 = said.strip_prefix("held ").unwrap().parse().unwrap();
    child.kill().await.unwrap();

    let sem = Semaphore::builder("crash")
        .limit(3)
        .lease(Duration::from_secs(1))
        .acquire_timeout(Duration::from_secs(5))
        .build(redis.backend().await)
        .unwrap();
    // The dead process still holds 2 of 3 until its lease ends.
    assert!(sem.try_acquire_many(2).await.unwrap().is_none());
    let permit = sem.acquire_many(3).await.unwrap();
    assert!(permit.fencing_token() > child_token);
    drop(permit);
    // Released and expired: no key outlives its holders.
    eventually(Duration::from_secs(5), "every key to be gone", || async {
        redis.dbsize().await == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expire_with_the_last_lease() {
    let redis = Redis::start().await;
    let mut child = spawn_child(&redis, "hold");
    child_says(&mut child).await;
    let mut conn = redis.conn().await;
    for key in ["dlimit:{crash}:holders", "dlimit:{crash}:meta"] {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap();
        // At most the 1 s lease plus half a lease of slack.
        assert!((1..=1500).contains(&ttl), "{key} TTL {ttl} ms");
    }
    // The holder dies; nobody calls the script again, and Redis drops the keys by itself.
    child.kill().await.unwrap();
    eventually(Duration::from_secs(4), "the keys to expire", || async {
        redis.dbsize().await == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_does_not_poll_redis() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("quiet")
        .limit(1)
        .acquire_timeout(Duration::from_secs(10))
        .build(redis.backend().await)
        .unwrap();
    let mut held = sem.acquire().await.unwrap();
    let before = redis.script_calls().await;
    let waiters: Vec<_> = (0..5)
        .map(|_| {
            let sem = sem.clone();
            tokio::spawn(async move { sem.acquire().await.map(|p| p.fencing_token()) })
        })
        .collect();
    // Time is the subject here: five waiters waiting 1.5 s.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = redis.script_calls().await - before;
    // Each waiter queues with one call; then only the oldest refreshes the line, once when the
    // subscription is confirmed and about once a second. A 10 ms poller would make ~750 calls.
    assert!(
        during <= 16,
        "{during} script calls while 5 waiters waited 1.5 s"
    );
    held.release().await.unwrap();
    for waiter in waiters {
        assert!(waiter.await.unwrap().unwrap() > held.fencing_token());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_is_reloaded_after_script_flush() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("flush")
        .limit(1)
        .build(redis.backend().await)
        .unwrap();
    sem.acquire().await.unwrap().release().await.unwrap();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    let mut permit = sem
        .acquire()
        .await
        .expect("NOSCRIPT is answered by reloading");
    permit.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_the_wrong_type_is_a_clear_error() {
    let redis = Redis::start().await;
    let _: () = redis::cmd("SET")
        .arg("dlimit:{taken}:holders")
        .arg("not a sorted set")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    let sem = Semaphore::builder("taken")
        .limit(1)
        .build(redis.backend().await)
        .unwrap();
    match sem.acquire().await {
        Err(e @ Error::Backend(_)) => {
            let message = e.to_string();
            assert!(message.contains("another type"), "{message}");
            assert!(message.contains("key_prefix"), "{message}");
            assert!(std::error::Error::source(&e).is_some());
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
    // Another prefix keeps clear of the foreign key.
    let sem = Semaphore::builder("taken")
        .limit(1)
        .build(redis.backend().await.key_prefix("other:"))
        .unwrap();
    let permit = sem.acquire().await.unwrap();
    assert_eq!(permit.weight(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_redis_and_bad_urls_are_clear_errors() {
    assert!(matches!(
        RedisBackend::connect("not a url").await,
        Err(Error::Config(_))
    ));
    assert!(matches!(
        RedisBackend::builder("redis://127.0.0.1:1")
            .call_timeout(Duration::ZERO)
            .connect()
            .await,
        Err(Error::Config(_))
    ));
    // A port nobody listens on: a stopped test server.
    let mut redis = Redis::start().await;
    let url = redis.url.clone();
    let backend = redis.backend().await;
    redis.kill();
    let started = std::time::Instant::now();
    match RedisBackend::connect(&url).await {
        Err(e @ Error::Backend(_)) => assert!(e.to_string().contains("Redis"), "{e}"),
        other => panic!("expected a backend error, got {other:?}"),
    }
    // A backend whose server went away answers with an error within the bound, not a hang.
    let sem = Semaphore::builder("gone").limit(1).build(backend).unwrap();
    assert!(matches!(sem.try_acquire().await, Err(Error::Backend(_))));
    assert!(matches!(sem.acquire().await, Err(Error::Backend(_))));
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_different_connections_are_served_in_arrival_order() {
    let redis = Redis::start().await;
    // Two backends: two connections and two subscriptions, as two processes would have.
    let backends = [redis.backend().await, redis.backend().await];
    let sems: Vec<Semaphore> = backends
        .iter()
        .map(|backend| {
            Semaphore::builder("fifo")
                .limit(1)
                .acquire_timeout(Duration::from_secs(20))
                .build(backend.clone())
                .unwrap()
        })
        .collect();
    let mut held = sems[0].acquire().await.unwrap();
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..6u64 {
        let (sem, order) = (sems[(i % 2) as usize].clone(), order.clone());
        waiters.push(tokio::spawn(async move {
            let mut permit = sem.acquire().await.unwrap();
            order.lock().unwrap().push(i);
            permit.release().await.unwrap();
        }));
        // Arrival order is what the line records: wait until this waiter is in it.
        eventually(Duration::from_secs(5), "the waiter to queue", || async {
            redis.queue_len("fifo").await == i + 1
        })
        .await;
    }
    held.release().await.unwrap();
    for waiter in waiters {
        waiter.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4, 5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_waiter_leaves_the_line() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("line")
        .limit(1)
        .acquire_timeout(Duration::from_secs(10))
        .build(redis.backend().await)
        .unwrap();
    let mut held = sem.acquire().await.unwrap();
    let mut child = spawn_child(&redis, "wait");
    assert_eq!(child_says(&mut child).await, "waiting");
    eventually(Duration::from_secs(10), "the child to queue", || async {
        redis.queue_len("line").await == 1
    })
    .await;
    child.kill().await.unwrap();
    // Nobody refreshes the dead waiter: it drops out of the line within the patience (3 s).
    eventually(
        Duration::from_secs(6),
        "the dead waiter to leave",
        || async { redis.queue_len("line").await == 0 },
    )
    .await;
    held.release().await.unwrap();
    let next = sem.try_acquire().await.unwrap();
    assert!(next.is_some(), "the slot went to nobody");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_survives_a_dropped_connection() {
    let redis = Redis::start().await;
    let holder = Semaphore::builder("reconnect")
        .limit(1)
        .build(redis.backend().await)
        .unwrap();
    let waiter_sem = Semaphore::builder("reconnect")
        .limit(1)
        .acquire_timeout(Duration::from_secs(10))
        .build(redis.backend().await)
        .unwrap();
    let mut held = holder.acquire().await.unwrap();
    let waiter = tokio::spawn(async move { waiter_sem.acquire().await.map(|p| p.fencing_token()) });
    eventually(Duration::from_secs(5), "the waiter to queue", || async {
        redis.queue_len("reconnect").await == 1
    })
    .await;
    // Cut every client connection but ours, then hand the slot over while the waiter's
    // connection is gone: its grant announcement is lost and must be collected anyway.
    let mut admin = redis.conn().await;
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("SKIPME")
        .arg("yes")
        .query_async(&mut admin)
        .await
        .unwrap();
    held.release().await.unwrap();
    let token = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter got its grant")
        .unwrap()
        .expect("the waiter rode out the reconnect");
    assert!(token > held.fencing_token());
}

/// Concurrent acquires of one process share script calls (a group commit): the first goes at
/// once, those that arrive while it is in flight all go in the next call. Each is still decided
/// as if alone: every one is granted, with its own token.
#[tokio::test(flavor = "current_thread")]
async fn concurrent_acquires_share_one_call() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("batched")
        .limit(1000)
        .build(redis.backend().await)
        .unwrap();
    drop(sem.try_acquire().await.unwrap()); // loads the script
    sem.available_permits().await.unwrap(); // and sends that release
    let before = redis.script_calls().await;
    let permits = futures_util::future::join_all((0..64).map(|_| sem.try_acquire())).await;
    let calls = redis.script_calls().await - before;
    let mut tokens: Vec<u64> = permits
        .iter()
        .map(|p| {
            p.as_ref()
                .unwrap()
                .as_ref()
                .expect("a free slot")
                .fencing_token()
        })
        .collect();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 64, "every acquire has its own token");
    // The first alone, the 63 queued behind it in calls of at most 16 (docs/protocol.md).
    assert!(
        calls <= 5,
        "64 concurrent acquires took {calls} script calls"
    );
    assert_eq!(sem.available_permits().await.unwrap(), 1000 - 64);
}

/// Under a steady stream of requests (acquire, then drop the permit), releases ride on the
/// acquires in flight: about one script call per request, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_costs_about_one_call_under_concurrency() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("steady")
        .limit(64)
        .build(redis.backend().await)
        .unwrap();
    drop(sem.acquire().await.unwrap());
    let before = redis.script_calls().await;
    const TASKS: usize = 16;
    const ROUNDS: usize = 200;
    let workers: Vec<_> = (0..TASKS)
        .map(|_| {
            let sem = sem.clone();
            tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    let permit = sem.acquire().await.unwrap();
                    tokio::task::yield_now().await;
                    drop(permit);
                    // Writing the response: the next request comes a moment later.
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    let per_request = (redis.script_calls().await - before) as f64 / (TASKS * ROUNDS) as f64;
    println!("{per_request:.3} script calls per request");
    assert!(
        per_request < 1.1,
        "{per_request:.2} script calls per request"
    );
    support::wait_until_available(&sem, 64).await;
}

/// Acquires cancelled while they wait for the call in flight, or while their own call is in
/// flight, leave nothing behind: every slot comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_cancelled_in_the_batch_leak_nothing() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("cancelled")
        .limit(8)
        .build(redis.backend().await)
        .unwrap();
    drop(sem.acquire().await.unwrap());
    for round in 0..20u64 {
        let attempts = (0..32).map(|i| {
            let sem = sem.clone();
            // Cut-offs from 0 to ~300 µs land before, during and after the calls.
            let cut = Duration::from_micros((i * 37 + round * 11) % 300);
            async move {
                if let Ok(Ok(Some(permit))) = tokio::time::timeout(cut, sem.try_acquire()).await {
                    drop(permit);
                }
            }
        });
        futures_util::future::join_all(attempts).await;
    }
    support::wait_until_available(&sem, 8).await;
    // And the semaphore still serves a full house. A cancelled acquire that was queued behind
    // a call in flight may still be sent (and its slot given back) just after the count above
    // was read, so the house is asked for until it is full, within a bound.
    eventually(Duration::from_secs(5), "a full house", || async {
        let held: Vec<_> = futures_util::future::join_all((0..8).map(|_| sem.try_acquire())).await;
        held.iter().all(|p| matches!(p, Ok(Some(_))))
    })
    .await;
}

/// The line's keys always carry a TTL of at most one and a half patience (3 s) past the latest
/// waiter's deadline, even when a join skips the `PEXPIREAT` (the TTL was pushed far enough
/// already) and when the line was deleted behind the script's back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_line_always_expires() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("line-ttl")
        .limit(1)
        .acquire_timeout(Duration::from_secs(30))
        .build(redis.backend().await)
        .unwrap();
    let _held = sem.acquire().await.unwrap();
    let mut conn = redis.conn().await;
    let keys = ["dlimit:{line-ttl}:queue", "dlimit:{line-ttl}:alive"];
    let mut waiters = Vec::new();
    for round in 0..2 {
        for joined in 1..=3 {
            let sem = sem.clone();
            waiters.push(tokio::spawn(async move { sem.acquire().await }));
            eventually(Duration::from_secs(5), "the waiter to queue", || async {
                redis.queue_len("line-ttl").await == joined
            })
            .await;
            for key in keys {
                let ttl: i64 = redis::cmd("PTTL")
                    .arg(key)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                assert!(
                    (1..=4500).contains(&ttl),
                    "round {round}: {key} TTL {ttl} ms"
                );
            }
        }
        // The line vanishes behind the script's back; the next joins must give it a TTL again.
        for waiter in waiters.drain(..) {
            waiter.abort();
        }
        let _: () = redis::cmd("DEL")
            .arg(&keys[..])
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

/// A runtime that goes away with acquire calls in flight and acquires queued behind them (its
/// tasks dropped mid-call, unstarted, or waiting) leaves the semaphore usable from another
/// runtime: nobody waits for a call that will never be answered, and no slot is lost for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_that_goes_away_mid_batch_leaves_the_semaphore_usable() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("vanishing")
        .limit(64)
        .lease(Duration::from_secs(2))
        .build(redis.backend().await)
        .unwrap();
    drop(sem.try_acquire().await.unwrap());
    for round in 0..5u64 {
        let doomed = sem.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                for _ in 0..32 {
                    let sem = doomed.clone();
                    tokio::spawn(async move {
                        let _held = sem.acquire().await;
                        std::future::pending::<()>().await;
                    });
                }
                // Long enough for the first call to be on the wire, with the rest queued.
                tokio::time::sleep(Duration::from_micros(100 * round)).await;
            });
            // Dropped here, with calls in flight and acquires queued behind them.
        })
        .join()
        .unwrap();
        let permit = tokio::time::timeout(Duration::from_secs(3), sem.try_acquire())
            .await
            .unwrap_or_else(|_| panic!("round {round}: the next acquire hung"))
            .unwrap();
        assert!(permit.is_some(), "round {round}: no slot");
    }
    // Whatever the dropped runtimes were granted comes back, at the latest with the lease.
    support::wait_until_available(&sem, 64).await;
}

/// A grant to a waiter is announced on its own process's channel only
/// (`<prefix>{name}:granted:<the first 8 hex digits of its id>`), so other processes' connections
/// do not carry it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_is_announced_to_its_own_process_only() {
    use futures_util::StreamExt;
    let redis = Redis::start().await;
    let sem = Semaphore::builder("fanout")
        .limit(1)
        .acquire_timeout(Duration::from_secs(10))
        .build(redis.backend().await)
        .unwrap();
    let mut pubsub = redis::Client::open(redis.url.as_str())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    pubsub.psubscribe("dlimit:{fanout}:granted*").await.unwrap();
    let held = sem.acquire().await.unwrap();
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await.map(|permit| permit.id().to_owned()) }
    });
    eventually(Duration::from_secs(5), "the waiter to queue", || async {
        redis.queue_len("fanout").await == 1
    })
    .await;
    drop(held);
    let message = tokio::time::timeout(Duration::from_secs(5), pubsub.on_message().next())
        .await
        .expect("the grant was announced")
        .unwrap();
    let id = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let payload: String = message.get_payload().unwrap();
    assert!(payload.starts_with(&id), "announced {payload:?} for {id}");
    assert_eq!(
        message.get_channel_name(),
        format!("dlimit:{{fanout}}:granted:{}", &id[..8])
    );
}

/// 500 waiters of one process, queued in order (most of them by one shared script call): the
/// line serves them in exactly that order, not in the order of their random member ids.
#[tokio::test]
async fn waiters_queued_by_one_call_keep_their_order() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("flood")
        .limit(1)
        .acquire_timeout(Duration::from_secs(60))
        .build(redis.backend().await)
        .unwrap();
    let mut held = sem.acquire().await.unwrap();
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    // A current-thread runtime polls spawned tasks in the order they were spawned.
    let waiters: Vec<_> = (0..500u32)
        .map(|i| {
            let (sem, order) = (sem.clone(), order.clone());
            tokio::spawn(async move {
                let mut permit = sem.acquire().await.unwrap();
                order.lock().unwrap().push(i);
                permit.release().await.unwrap();
            })
        })
        .collect();
    eventually(Duration::from_secs(20), "every waiter to queue", || async {
        redis.queue_len("flood").await == 500
    })
    .await;
    held.release().await.unwrap();
    for waiter in waiters {
        waiter.await.unwrap();
    }
    let order = order.lock().unwrap();
    let inversions = order.windows(2).filter(|w| w[0] > w[1]).count();
    assert_eq!(
        inversions,
        0,
        "served out of arrival order: {:?}",
        &order[..20]
    );
}

async fn encoding(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<String> {
    redis::cmd("OBJECT")
        .arg("ENCODING")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap()
}

/// Whether any member of a zset or field of a hash is the script's 65-byte converter.
async fn converter_left(conn: &mut redis::aio::MultiplexedConnection, name: &str) -> bool {
    let mut names: Vec<String> = Vec::new();
    for zset in ["holders", "queue", "alive"] {
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(format!("dlimit:{{{name}}}:{zset}"))
            .arg(0)
            .arg(-1)
            .query_async(conn)
            .await
            .unwrap();
        names.extend(members);
    }
    for hash in ["meta", "since"] {
        let fields: Vec<String> = redis::cmd("HKEYS")
            .arg(format!("dlimit:{{{name}}}:{hash}"))
            .query_async(conn)
            .await
            .unwrap();
        names.extend(fields);
    }
    names.iter().any(|n| n.starts_with('~'))
}

/// A busy semaphore's keys leave Redis's compact encoding (which scans every member on each
/// lookup) for good, through a member added and removed in the same call: nobody ever sees
/// that member, the counts stay exact, and the line still serves in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_keys_leave_the_compact_encoding_unseen() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("wide")
        .limit(6)
        .acquire_timeout(Duration::from_secs(30))
        .build(redis.backend().await)
        .unwrap();
    let mut conn = redis.conn().await;
    let mut held = Vec::new();
    for _ in 0..6 {
        held.push(sem.acquire().await.unwrap());
    }
    assert_eq!(
        encoding(&mut conn, "dlimit:{wide}:holders")
            .await
            .as_deref(),
        Some("skiplist")
    );
    for hash in ["dlimit:{wide}:since", "dlimit:{wide}:meta"] {
        assert_eq!(
            encoding(&mut conn, hash).await.as_deref(),
            Some("hashtable")
        );
    }
    let snapshot = sem.snapshot().await.unwrap();
    assert_eq!((snapshot.used, snapshot.holders.len()), (6, 6));
    assert!(!converter_left(&mut conn, "wide").await);

    // Five wait; the line converts when its expiry is next pushed (within half a patience of
    // the oldest waiter's refreshes).
    let mut waiters = Vec::new();
    for joined in 1..=5 {
        let sem = sem.clone();
        waiters.push(tokio::spawn(async move {
            sem.acquire().await.map(|p| p.fencing_token())
        }));
        eventually(Duration::from_secs(5), "the waiter to queue", || async {
            redis.queue_len("wide").await == joined
        })
        .await;
    }
    eventually(Duration::from_secs(10), "the line to convert", || async {
        let mut conn = redis.conn().await;
        encoding(&mut conn, "dlimit:{wide}:queue").await.as_deref() == Some("skiplist")
            && encoding(&mut conn, "dlimit:{wide}:alive").await.as_deref() == Some("skiplist")
    })
    .await;
    assert!(!converter_left(&mut conn, "wide").await);
    assert_eq!(sem.snapshot().await.unwrap().waiting, 5);

    // Each release admits the oldest waiter, in arrival order, and never more than the limit.
    let mut last = 0;
    for waiter in waiters {
        drop(held.remove(0));
        let token = waiter.await.unwrap().unwrap();
        assert!(token > last, "served out of order");
        last = token;
        let snapshot = sem.snapshot().await.unwrap();
        assert!(snapshot.used <= 6, "{} held", snapshot.used);
    }
    assert!(!converter_left(&mut conn, "wide").await);
}

/// Semaphore `name` (limit 5) filled and emptied with its keys left compact: exactly five
/// held, the 65-byte member never seen, every slot back after the drops.
async fn fills_and_empties_compact(
    sem: &Semaphore,
    conn: &mut redis::aio::MultiplexedConnection,
    name: &str,
) {
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(sem.acquire().await.unwrap());
    }
    assert!(sem.try_acquire().await.unwrap().is_none(), "a sixth slot");
    let holders = format!("dlimit:{{{name}}}:holders");
    assert_eq!(encoding(conn, &holders).await.as_deref(), Some("listpack"));
    assert!(!converter_left(conn, name).await);
    let snapshot = sem.snapshot().await.unwrap();
    assert_eq!((snapshot.used, snapshot.holders.len()), (5, 5));
    held.clear();
    eventually(Duration::from_secs(5), "the slots to come back", || async {
        sem.snapshot().await.unwrap().used == 0
    })
    .await;
}

/// Where Redis keeps long members in listpacks too (`*-max-listpack-value` raised), nothing
/// converts, and the semaphore works the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_converts_still_counts_exactly() {
    let redis = Redis::start().await;
    let mut conn = redis.conn().await;
    for setting in ["zset-max-listpack-value", "hash-max-listpack-value"] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(setting)
            .arg(1024)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let sem = Semaphore::builder("compact")
        .limit(5)
        .acquire_timeout(Duration::from_secs(30))
        .build(redis.backend().await)
        .unwrap();
    fills_and_empties_compact(&sem, &mut conn, "compact").await;
}

/// A user whose ACL does not allow OBJECT (the encoding check) still gets every permit: the
/// keys stay compact, nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_object_rights_loses_only_the_conversion() {
    let server = support::RedisProcess::start(|port, _| {
        let port = port.to_string();
        [
            "--port", &port, "--user", "app", "on", ">pw", "~*", "&*", "+@all", "-object",
        ]
        .map(String::from)
        .to_vec()
    })
    .await;
    let url = format!("redis://app:pw@127.0.0.1:{}", server.port);
    let backend = RedisBackend::connect(&url).await.unwrap();
    let sem = Semaphore::builder("acl-object")
        .limit(5)
        .acquire_timeout(Duration::from_secs(30))
        .build(backend)
        .unwrap();
    // (The default user may run OBJECT.)
    let mut conn = redis::Client::open(format!("redis://127.0.0.1:{}", server.port))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    fills_and_empties_compact(&sem, &mut conn, "acl-object").await;
}

/// A process of an earlier version shares the semaphore through a rolling upgrade: it keeps
/// its counters in fields of their own (`used`, `count`, `fence`, ...) where this one keeps
/// one `state`. Each version's write makes the other rebuild its counters from the holders, so
/// the limit holds, and tokens stay above every one the old process gave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_of_the_earlier_version_cannot_push_past_the_limit() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("rolling")
        .limit(3)
        .lease(Duration::from_secs(60))
        .build(redis.backend().await)
        .unwrap();
    let held = [sem.acquire().await.unwrap(), sem.acquire().await.unwrap()];
    // The old process grants the third slot its way: a holder, and its counters.
    let mut conn = redis.conn().await;
    let (secs, _): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let old_token: i64 = 4_000_000_000_000_000;
    let _: () = redis::pipe()
        .cmd("ZADD")
        .arg("dlimit:{rolling}:holders")
        .arg(secs * 1000 + 60_000)
        .arg("0123456789abcdef0123456789abcdef:1:60000")
        .cmd("HSET")
        .arg("dlimit:{rolling}:meta")
        .arg(&["used", "3", "count", "3", "fence", &old_token.to_string()])
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        sem.try_acquire().await.unwrap().is_none(),
        "a fourth holder under a limit of 3"
    );
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg("dlimit:{rolling}:meta")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        !fields.iter().any(|f| f == "used" || f == "count"),
        "the old counters stay: {fields:?}"
    );
    drop(held);
    let next = sem.acquire().await.unwrap();
    assert!(
        next.fencing_token() > old_token as u64,
        "a token below the old process's"
    );
    // The two given back, the old process's holder and the new one.
    eventually(Duration::from_secs(5), "the releases", || async {
        sem.snapshot().await.unwrap().used == 2
    })
    .await;
}

/// On Redis 7 the semaphore's calls are functions: the library is loaded with the first call,
/// and again after FUNCTION FLUSH (or a server that came back empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_is_loaded_again_after_function_flush() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("functions")
        .limit(1)
        .build(redis.backend().await)
        .unwrap();
    sem.acquire().await.unwrap().release().await.unwrap();
    assert_eq!(support::libraries_at(&redis.url).await, 1);
    let _: () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    let calls = support::command_calls_at(&redis.url, "fcall").await;
    let mut permit = sem
        .acquire()
        .await
        .expect("a missing function is answered by loading it");
    permit.release().await.unwrap();
    assert_eq!(support::libraries_at(&redis.url).await, 1);
    assert!(support::command_calls_at(&redis.url, "fcall").await > calls);
    assert_eq!(support::command_calls_at(&redis.url, "evalsha").await, 0);
}
