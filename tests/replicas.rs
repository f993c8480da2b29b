//! `wait_for_replicas`: a grant counts only once a replica acknowledged it. A real master and
//! replica: grants (direct and announced to a waiter) work while the replica follows; with the
//! replica frozen (SIGSTOP), acquires fail within the timeout instead of granting slots that a
//! failover could forget, and nothing is left holding.

mod support;

use std::time::Duration;

use tokio::time::Instant;
use tower_distributed_limit::{Error, RedisBackend, Semaphore};

use support::{Redis, RedisProcess, eventually, signal};

/// A master and one replica that has caught up with it.
async fn master_and_replica() -> (Redis, RedisProcess) {
    let master = Redis::start().await;
    let master_port = master.url.rsplit(':').next().unwrap().to_owned();
    let replica = RedisProcess::start(|port, _| {
        vec![
            "--port".into(),
            port.to_string(),
            "--replicaof".into(),
            "127.0.0.1".into(),
            master_port,
        ]
    })
    .await;
    // Online is not enough: the replica acknowledges writes once it has loaded the first sync.
    eventually(
        Duration::from_secs(10),
        "the replica to acknowledge writes",
        || async {
            let acked: redis::RedisResult<(String, i64)> = redis::pipe()
                .cmd("SET")
                .arg("probe")
                .arg(1)
                .cmd("WAIT")
                .arg(1)
                .arg(100)
                .query_async(&mut master.conn().await)
                .await;
            acked.is_ok_and(|(_, acked)| acked == 1)
        },
    )
    .await;
    (master, replica)
}

fn semaphore(backend: RedisBackend) -> Semaphore {
    Semaphore::builder("replicated")
        .limit(1)
        .acquire_timeout(Duration::from_secs(3))
        .build(backend)
        .unwrap()
}

async fn replicated(master: &Redis, count: u32) -> RedisBackend {
    RedisBackend::builder(master.url.as_str())
        .wait_for_replicas(count, Duration::from_millis(100))
        .connect()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_wait_for_the_replica_and_fail_without_it() {
    let (master, replica) = master_and_replica().await;
    let sem = semaphore(replicated(&master, 1).await);
    let other = semaphore(replicated(&master, 1).await);

    // Healthy: a direct grant, and a grant announced to a waiter (confirmed before it counts).
    let held = sem.acquire().await.expect("one replica acknowledges");
    let waiter = tokio::spawn(async move { other.acquire().await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(held);
    let permit = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter is served")
        .unwrap()
        .expect("the announced grant is confirmed");
    drop(permit);
    support::wait_until_available(&sem, 1).await;

    // The replica stops acknowledging: no grant counts, each refusal is bounded.
    signal(replica.pid(), "STOP");
    let started = Instant::now();
    let err = sem.acquire().await.unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err:?}");
    assert!(err.to_string().contains("replicas"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(sem.outage_decisions(), 1);
    assert!(matches!(sem.try_acquire().await, Err(Error::Backend(_))));

    // The slot the unacknowledged acquire took on the master was given back.
    signal(replica.pid(), "CONT");
    let plain = semaphore(master.backend().await);
    support::wait_until_available(&plain, 1).await;
    // And with the replica back, grants count again.
    eventually(Duration::from_secs(5), "grants to count again", || async {
        sem.try_acquire().await.is_ok_and(|p| p.is_some())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_replicas_than_exist_never_grant() {
    let (master, _replica) = master_and_replica().await;
    let sem = semaphore(replicated(&master, 2).await);
    assert!(matches!(sem.try_acquire().await, Err(Error::Backend(_))));
}

#[tokio::test]
async fn replica_settings_are_checked() {
    for (count, timeout) in [(0, Duration::from_millis(50)), (1, Duration::ZERO)] {
        let err = RedisBackend::builder("redis://127.0.0.1:1")
            .wait_for_replicas(count, timeout)
            .connect()
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
    }
}
