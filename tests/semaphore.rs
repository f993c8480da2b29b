//! Behaviour every backend shares: each body runs once on `MemoryBackend` and once on
//! `RedisBackend` against a real redis-server.

#[macro_use]
mod support;

use std::time::Duration;

use tower_distributed_limit::{Backend, Error, MAX_NAME_LEN, Partitions, RateLimiter, Semaphore};

use support::eventually;

on_both_backends!(
    config_errors,
    weighted_permits_add_up,
    try_acquire_on_a_full_semaphore,
    acquire_times_out,
    cancelled_acquires_leak_nothing,
    dropped_permits_come_back,
    fencing_tokens_strictly_increase,
    waiters_are_woken_by_a_release,
    a_renewed_lease_keeps_its_slot,
    waiters_beyond_the_cap_are_refused_at_once,
);

async fn waiters_beyond_the_cap_are_refused_at_once(backend: impl Backend + Clone) {
    let sem = Semaphore::builder("test")
        .limit(1)
        .max_waiters(2)
        .acquire_timeout(Duration::from_secs(20))
        .build(backend)
        .unwrap();
    let mut held = sem.acquire().await.unwrap();
    let mut waiters = Vec::new();
    for _ in 0..2 {
        let sem = sem.clone();
        waiters.push(started(async move { sem.acquire().await.map(|p| p.fencing_token()) }).await);
    }
    // A third caller would wait beyond the cap: refused at once, not after the 20 s timeout.
    let third = tokio::time::timeout(Duration::from_secs(1), sem.acquire())
        .await
        .expect("refused at once");
    assert!(
        matches!(third, Err(Error::TooManyWaiters { waiting: 2 })),
        "{third:?}"
    );
    held.release().await.unwrap();
    for waiter in waiters {
        assert!(waiter.await.unwrap().unwrap() > held.fencing_token());
    }
}

fn sem(backend: impl Backend, limit: u32) -> Semaphore {
    Semaphore::builder("test")
        .limit(limit)
        .build(backend)
        .expect("valid settings")
}

fn assert_config(result: Result<impl std::fmt::Debug, Error>, mentions: &str) {
    match result {
        Err(Error::Config(message)) => assert!(
            message.contains(mentions),
            "message {message:?} should mention {mentions:?}"
        ),
        other => panic!("expected Error::Config mentioning {mentions:?}, got {other:?}"),
    }
}

async fn config_errors(backend: impl Backend + Clone) {
    let b = || backend.clone();
    assert_config(Semaphore::builder("").limit(1).build(b()), "name is empty");
    // A hostile name (1 MB) would become 1 MB keys: refused, saying the bound.
    let huge = "n".repeat(1 << 20);
    assert_config(
        Semaphore::builder(huge.clone()).limit(1).build(b()),
        "at most 1024 bytes",
    );
    assert!(
        Semaphore::builder("n".repeat(MAX_NAME_LEN))
            .limit(1)
            .build(b())
            .is_ok(),
        "a name of exactly the bound is accepted"
    );
    assert_config(
        Partitions::builder("tenants")
            .key(|_: &()| None::<String>)
            .limit(1)
            .max_key_len(MAX_NAME_LEN)
            .build(b()),
        "at most 1024 bytes",
    );
    assert_config(
        RateLimiter::builder(huge)
            .rate(1, Duration::from_secs(1))
            .build(tower_distributed_limit::MemoryBackend::new()),
        "at most 1024 bytes",
    );
    assert_config(Semaphore::builder("x").build(b()), "no limit");
    assert_config(Semaphore::builder("x").limit(0).build(b()), "limit 0");
    assert_config(
        Semaphore::builder("x")
            .limit(1)
            .lease(Duration::ZERO)
            .build(b()),
        "lease",
    );
    assert_config(
        Semaphore::builder("x")
            .limit(1)
            .lease(Duration::from_secs(60 * 24 * 3600))
            .build(b()),
        "lease",
    );
    assert_config(
        Semaphore::builder("x")
            .limit(1)
            .acquire_timeout(Duration::ZERO)
            .build(b()),
        "acquire_timeout",
    );
    assert_config(
        Semaphore::builder("x").limit(1).max_waiters(0).build(b()),
        "max_waiters",
    );

    // Bad weights are refused at once, even while the semaphore is full and acquire would wait.
    let sem = sem(b(), 2);
    let _held = sem.acquire_many(2).await.unwrap();
    let at_once = Duration::from_secs(1);
    assert_config(
        tokio::time::timeout(at_once, sem.acquire_many(3))
            .await
            .unwrap(),
        "weight",
    );
    assert_config(
        tokio::time::timeout(at_once, sem.acquire_many(0))
            .await
            .unwrap(),
        "weight",
    );
    assert_config(sem.try_acquire_many(3).await, "weight");
    assert_config(sem.try_acquire_many(0).await, "weight");
    // u32::MAX is a valid limit.
    let huge = Semaphore::builder("huge")
        .limit(u32::MAX)
        .build(b())
        .unwrap();
    let all = huge.acquire_many(u32::MAX).await.unwrap();
    assert!(huge.try_acquire().await.unwrap().is_none());
    drop(all);
}

async fn weighted_permits_add_up(backend: impl Backend + Clone) {
    let sem = sem(backend, 5);
    let mut three = sem.acquire_many(3).await.unwrap();
    assert_eq!(three.weight(), 3);
    assert_eq!(sem.available_permits().await.unwrap(), 2);
    assert!(sem.try_acquire_many(3).await.unwrap().is_none());
    let two = sem.try_acquire_many(2).await.unwrap().expect("2 of 5 free");
    assert_eq!(sem.available_permits().await.unwrap(), 0);
    assert!(sem.try_acquire().await.unwrap().is_none());
    three.release().await.unwrap();
    assert_eq!(sem.available_permits().await.unwrap(), 3);
    // Releasing again changes nothing.
    three.release().await.unwrap();
    assert_eq!(sem.available_permits().await.unwrap(), 3);
    let _three_again = sem.try_acquire_many(3).await.unwrap().expect("3 free");
    drop(two);
    support::wait_until_available(&sem, 2).await;
}

async fn try_acquire_on_a_full_semaphore(backend: impl Backend + Clone) {
    let sem = sem(backend, 2);
    let mut a = sem.try_acquire().await.unwrap().expect("empty semaphore");
    let b = sem.try_acquire().await.unwrap().expect("one left");
    assert_ne!(a.id(), b.id());
    assert!(sem.try_acquire().await.unwrap().is_none());
    a.release().await.unwrap();
    let c = sem.try_acquire().await.unwrap().expect("a was released");
    assert!(c.fencing_token() > b.fencing_token());
}

async fn acquire_times_out(backend: impl Backend + Clone) {
    let sem = Semaphore::builder("test")
        .limit(1)
        .acquire_timeout(Duration::from_millis(300))
        .build(backend)
        .unwrap();
    let _held = sem.acquire().await.unwrap();
    match sem.acquire().await {
        Err(e @ Error::Timeout { waited }) => {
            assert!(
                waited >= Duration::from_millis(300),
                "waited only {waited:?}"
            );
            assert!(waited < Duration::from_secs(3), "waited {waited:?}");
            assert!(e.to_string().contains("acquire_timeout"), "{e}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    // The timed-out waiter left nothing behind.
    assert_eq!(sem.available_permits().await.unwrap(), 0);
}

async fn cancelled_acquires_leak_nothing(backend: impl Backend + Clone) {
    // A 30 s lease: anything leaked would stay taken far longer than this test waits.
    let sem = Semaphore::builder("test")
        .limit(3)
        .lease(Duration::from_secs(30))
        .build(backend)
        .unwrap();
    // Waiters cancelled while the semaphore is full...
    let held: Vec<_> = futures_join(3, |_| sem.acquire()).await;
    let mut waiters = Vec::new();
    for i in 0..40u64 {
        let sem = sem.clone();
        waiters.push(tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_millis(i % 7), sem.acquire()).await;
        }));
    }
    for waiter in waiters {
        waiter.await.unwrap();
    }
    drop(held);
    support::wait_until_available(&sem, 3).await;
    // ...and acquires aborted at every point of their round trip while permits are free.
    let mut tasks = Vec::new();
    for i in 0..200u64 {
        let sem = sem.clone();
        let task = tokio::spawn(async move {
            let permit = sem.acquire().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
            drop(permit);
        });
        if i % 3 == 0 {
            tokio::task::yield_now().await;
        }
        task.abort();
        tasks.push(task);
    }
    for task in tasks {
        let _ = task.await;
    }
    support::wait_until_available(&sem, 3).await;
    // No cancelled waiter is left in the line either: a one-shot attempt, which never jumps
    // the line, gets everything.
    eventually(Duration::from_secs(5), "the line to empty", || async {
        sem.try_acquire_many(3).await.unwrap().is_some()
    })
    .await;
}

/// Polls `future` once (an acquire registers as a waiter on its first poll), then runs it on
/// its own task.
async fn started<F>(future: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let mut future = Box::pin(future);
    tokio::select! {
        biased;
        _ = &mut future => panic!("expected the acquire to wait"),
        _ = std::future::ready(()) => {}
    }
    tokio::spawn(future)
}

/// Acquires `n` permits one after another.
async fn futures_join<F, Fut>(n: usize, mut f: F) -> Vec<tower_distributed_limit::Permit>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<tower_distributed_limit::Permit, Error>>,
{
    let mut permits = Vec::new();
    for i in 0..n {
        permits.push(f(i).await.unwrap());
    }
    permits
}

async fn dropped_permits_come_back(backend: impl Backend + Clone) {
    let sem = sem(backend, 2);
    let a = sem.acquire().await.unwrap();
    let b = sem.acquire_many(1).await.unwrap();
    assert_eq!(sem.available_permits().await.unwrap(), 0);
    drop(a);
    drop(b);
    support::wait_until_available(&sem, 2).await;
}

async fn fencing_tokens_strictly_increase(backend: impl Backend + Clone) {
    let sem = sem(backend.clone(), 4);
    let other = Semaphore::builder("test").limit(4).build(backend).unwrap();
    let mut last = 0;
    for round in 0..20 {
        let which = if round % 2 == 0 { &sem } else { &other };
        let mut permit = which.acquire().await.unwrap();
        assert!(
            permit.fencing_token() > last,
            "token {} after {last}",
            permit.fencing_token()
        );
        last = permit.fencing_token();
        // Every other round the semaphore empties, so its keys go away in between.
        if round % 2 == 0 {
            permit.release().await.unwrap();
        }
    }
    // Concurrent holders get distinct tokens too.
    let mut tokens = Vec::new();
    let permits = futures_join(4, |_| sem.acquire()).await;
    tokens.extend(permits.iter().map(|p| p.fencing_token()));
    tokens.dedup();
    assert_eq!(tokens.len(), 4);
    assert!(tokens.windows(2).all(|w| w[0] < w[1]));
}

async fn waiters_are_woken_by_a_release(backend: impl Backend + Clone) {
    let sem = Semaphore::builder("test")
        .limit(1)
        .acquire_timeout(Duration::from_secs(20))
        .build(backend)
        .unwrap();
    let mut held = sem.acquire().await.unwrap();
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move {
            let permit = sem.acquire().await.unwrap();
            (tokio::time::Instant::now(), permit.fencing_token())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let released = tokio::time::Instant::now();
    held.release().await.unwrap();
    let (granted, token) = waiter.await.unwrap();
    assert!(token > held.fencing_token());
    // The waiter's fallback timer is at least 250 ms out; only the release can wake it sooner.
    let after = granted - released;
    assert!(
        after < Duration::from_millis(150),
        "granted {after:?} after the release"
    );
}

async fn a_renewed_lease_keeps_its_slot(backend: impl Backend + Clone) {
    let sem = Semaphore::builder("test")
        .limit(1)
        .lease(Duration::from_secs(1))
        .acquire_timeout(Duration::from_millis(3300))
        .build(backend)
        .unwrap();
    let mut held = sem.acquire().await.unwrap();
    // Three leases pass while another caller waits: renewal keeps the slot taken all along.
    match sem.acquire().await {
        Err(Error::Timeout { waited }) => assert!(waited >= Duration::from_secs(3)),
        other => panic!("the slot should have stayed taken, got {other:?}"),
    }
    assert!(!held.is_lost(), "a renewed permit was reported lost");
    assert!(held.remaining() > Duration::ZERO);
    tokio::select! {
        _ = held.lost() => panic!("lost() resolved for a renewed permit"),
        _ = tokio::time::sleep(Duration::from_millis(10)) => {}
    }
    let token = held.fencing_token();
    held.release().await.unwrap();
    let next = sem.acquire().await.unwrap();
    assert!(next.fencing_token() > token);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn waiters_in_one_process_are_served_in_arrival_order() {
    let sem = sem(tower_distributed_limit::MemoryBackend::new(), 1);
    let held = sem.acquire().await.unwrap();
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..5 {
        let (sem, order) = (sem.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire().await.unwrap();
            order.lock().unwrap().push(i);
        }));
        // Let the new task run until it is queued.
        tokio::task::yield_now().await;
    }
    drop(held);
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
}

/// API.md promises these bounds; losing one would break users' `tokio::spawn`s and axum.
#[test]
fn public_types_are_send_sync_and_cheap_to_share() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<Semaphore>();
    send_sync::<tower_distributed_limit::Permit>();
    send_sync::<Error>();
    send_sync::<tower_distributed_limit::RedisBackend>();
    send_sync::<tower_distributed_limit::MemoryBackend>();
    fn clone<T: Clone>() {}
    clone::<Semaphore>();
    clone::<tower_distributed_limit::RedisBackend>();
    clone::<tower_distributed_limit::DistributedConcurrencyLimitLayer>();
    // The acquire future can be spawned.
    fn send<T: Send>(_: &T) {}
    let sem = Semaphore::builder("x")
        .limit(1)
        .build(tower_distributed_limit::MemoryBackend::new())
        .unwrap();
    send(&sem.acquire());
    send(&sem.try_acquire());
}
