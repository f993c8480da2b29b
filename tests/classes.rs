//! Classes inside one limit (`SemaphoreBuilder::class`, `Ask::priority`), against a real
//! redis-server (two backends, as two processes would be) and in process: reservations never
//! lent, caps never passed, a higher class served first, nothing leaked by a cancelled waiter,
//! and a limit below the reservations keeping the total.

#[macro_use]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::task::JoinSet;
use tower_distributed_limit::{Ask, Backend, Error, MemoryBackend, Priority, Semaphore, Share};

use support::{eventually, wait_until_available};

fn gpu(backend: impl Backend) -> Semaphore {
    Semaphore::builder("gpu")
        .limit(6)
        .class(Priority::CRITICAL, Share::reserved(2))
        .class(Priority::BATCH, Share::at_most(2))
        .lease(Duration::from_secs(2))
        .build(backend)
        .unwrap()
}

fn critical() -> Ask {
    Ask::new().priority(Priority::CRITICAL)
}

fn batch() -> Ask {
    Ask::new().priority(Priority::BATCH)
}

/// Two handles on one semaphore: two backends on one Redis (two processes, as far as the
/// script can tell), or two clones of one in-process backend.
async fn pair(redis: Option<&support::Redis>) -> (Semaphore, Semaphore) {
    match redis {
        Some(redis) => (gpu(redis.backend().await), gpu(redis.backend().await)),
        None => {
            let backend = MemoryBackend::new();
            (gpu(backend.clone()), gpu(backend))
        }
    }
}

macro_rules! on_two_processes {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$name(super::pair(None).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                let redis = super::support::Redis::start().await;
                super::$name(super::pair(Some(&redis)).await).await;
            }
        }
    )*};
}

on_two_processes!(
    a_reservation_is_never_lent,
    a_cap_is_never_passed_under_a_hammer,
    a_higher_class_overtakes_a_lower_one_in_line,
    a_cancelled_critical_waiter_leaks_nothing,
    a_limit_below_the_reservations_keeps_the_total,
);

async fn a_reservation_is_never_lent((a, b): (Semaphore, Semaphore)) {
    let _one = a.try_acquire_many(3).await.unwrap().expect("a free slot");
    let _two = b.try_acquire().await.unwrap().expect("a free slot");
    // The last two are CRITICAL's.
    assert!(a.try_acquire().await.unwrap().is_none());
    assert!(b.try_acquire_with(batch()).await.unwrap().is_none());
    let _c1 = b
        .try_acquire_with(critical())
        .await
        .unwrap()
        .expect("reserved");
    let _c2 = a
        .try_acquire_with(critical())
        .await
        .unwrap()
        .expect("reserved");
    assert!(a.try_acquire_with(critical()).await.unwrap().is_none());
    let snapshot = b.snapshot().await.unwrap();
    assert_eq!(snapshot.used, 6);
    let classes: Vec<Priority> = snapshot.holders.iter().map(|h| h.class).collect();
    assert_eq!(
        classes.iter().filter(|&&c| c == Priority::CRITICAL).count(),
        2
    );
}

async fn a_cap_is_never_passed_under_a_hammer((a, b): (Semaphore, Semaphore)) {
    let batch_in = Arc::new(AtomicU32::new(0));
    let all_in = Arc::new(AtomicU32::new(0));
    let worst = Arc::new(AtomicU32::new(0));
    let worst_all = Arc::new(AtomicU32::new(0));
    let mut tasks = JoinSet::new();
    for i in 0..40u32 {
        let sem = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (batch_in, all_in) = (batch_in.clone(), all_in.clone());
        let (worst, worst_all) = (worst.clone(), worst_all.clone());
        tasks.spawn(async move {
            for _ in 0..10 {
                let ask = if i % 4 == 0 { Ask::new() } else { batch() };
                let is_batch = ask.get_priority() == Priority::BATCH;
                let permit = sem.acquire_with(ask).await.unwrap();
                if is_batch {
                    let now = batch_in.fetch_add(1, Ordering::SeqCst) + 1;
                    worst.fetch_max(now, Ordering::SeqCst);
                }
                let now = all_in.fetch_add(1, Ordering::SeqCst) + 1;
                worst_all.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
                all_in.fetch_sub(1, Ordering::SeqCst);
                if is_batch {
                    batch_in.fetch_sub(1, Ordering::SeqCst);
                }
                let mut permit = permit;
                permit.release().await.unwrap();
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert!(
        worst.load(Ordering::SeqCst) <= 2,
        "BATCH held {worst:?} > its cap 2"
    );
    // NORMAL and BATCH share what CRITICAL's reservation leaves.
    assert!(
        worst_all.load(Ordering::SeqCst) <= 4,
        "held {worst_all:?} > 6 - 2 reserved"
    );
    assert_eq!(
        worst.load(Ordering::SeqCst),
        2,
        "the hammer never reached the cap"
    );
    wait_until_available(&a, 6).await;
}

async fn a_higher_class_overtakes_a_lower_one_in_line((a, b): (Semaphore, Semaphore)) {
    // Fill what BATCH and NORMAL may take, and CRITICAL's reservation.
    let held = [
        a.acquire_many(3).await.unwrap(),
        a.acquire().await.unwrap(),
        a.acquire_with(critical()).await.unwrap(),
        a.acquire_with(critical()).await.unwrap(),
    ];
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = JoinSet::new();
    let queue = |sem: Semaphore, ask: Ask, label: &'static str| {
        let order = order.clone();
        async move {
            let permit = sem.acquire_with(ask).await.unwrap();
            order.lock().unwrap().push(label);
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(permit);
        }
    };
    tasks.spawn(queue(b.clone(), batch(), "batch"));
    eventually(
        Duration::from_secs(5),
        "the BATCH waiter in line",
        || async { a.snapshot().await.unwrap().waiting == 1 },
    )
    .await;
    tasks.spawn(queue(b.clone(), Ask::new(), "normal"));
    eventually(
        Duration::from_secs(5),
        "the NORMAL waiter in line",
        || async { a.snapshot().await.unwrap().waiting == 2 },
    )
    .await;
    tasks.spawn(queue(b.clone(), critical(), "critical"));
    eventually(
        Duration::from_secs(5),
        "the CRITICAL waiter in line",
        || async { a.snapshot().await.unwrap().waiting == 3 },
    )
    .await;
    // One NORMAL slot frees: CRITICAL, last to come, is served first, then NORMAL, then BATCH.
    let [mut n2, mut n1, mut c1, mut c2] = held;
    n1.release().await.unwrap();
    eventually(Duration::from_secs(5), "the first grant", || async {
        !order.lock().unwrap().is_empty()
    })
    .await;
    // One slot at a time, so each grant is decided alone.
    c1.release().await.unwrap();
    eventually(Duration::from_secs(5), "the second grant", || async {
        order.lock().unwrap().len() == 2
    })
    .await;
    n2.release().await.unwrap();
    c2.release().await.unwrap();
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), ["critical", "normal", "batch"]);
    wait_until_available(&a, 6).await;
}

async fn a_cancelled_critical_waiter_leaks_nothing((a, b): (Semaphore, Semaphore)) {
    let held = [
        a.acquire_many(3).await.unwrap(),
        a.acquire().await.unwrap(),
        a.acquire_with(critical()).await.unwrap(),
        a.acquire_with(critical()).await.unwrap(),
    ];
    for _ in 0..20 {
        let waited =
            tokio::time::timeout(Duration::from_millis(20), b.acquire_with(critical())).await;
        assert!(waited.is_err(), "nothing was free");
    }
    drop(held);
    wait_until_available(&b, 6).await;
    let snapshot = b.snapshot().await.unwrap();
    assert_eq!((snapshot.used, snapshot.waiting), (0, 0));
    // The reservation is whole again.
    let _c = [
        b.try_acquire_with(critical())
            .await
            .unwrap()
            .expect("reserved"),
        b.try_acquire_with(critical())
            .await
            .unwrap()
            .expect("reserved"),
    ];
}

async fn a_limit_below_the_reservations_keeps_the_total((a, b): (Semaphore, Semaphore)) {
    a.set_limit(1).await.unwrap();
    // Only the reserved class is admitted, and never past the limit: the others are refused
    // at once (they could not be admitted until the limit is back above the reservations).
    let refused = b.try_acquire().await.unwrap_err();
    assert!(
        matches!(&refused, Error::Config(m) if m.contains("normal")),
        "{refused:?}"
    );
    let _c = b
        .try_acquire_with(critical())
        .await
        .unwrap()
        .expect("reserved");
    assert!(a.try_acquire_with(critical()).await.unwrap().is_none());
    assert_eq!(a.snapshot().await.unwrap().used, 1);
    a.unset_limit().await.unwrap();
    let _n = a.try_acquire().await.unwrap().expect("the pool is back");
}

on_both_backends!(a_weight_above_its_class_names_the_class);

async fn a_weight_above_its_class_names_the_class(backend: impl Backend) {
    let sem = gpu(backend);
    let err = sem.acquire_with(batch().weight(3)).await.unwrap_err();
    assert!(matches!(&err, Error::Config(m) if m.contains("batch") && m.contains("at most 2")));
    // NORMAL may take what CRITICAL does not reserve; CRITICAL the whole limit.
    assert!(sem.try_acquire_with(Ask::new().weight(5)).await.is_err());
    let whole = sem.try_acquire_with(critical().weight(6)).await.unwrap();
    assert!(whole.is_some());
}

#[test]
fn shares_that_cannot_hold_are_refused_at_build() {
    let over = Semaphore::builder("gpu")
        .limit(4)
        .class(Priority::CRITICAL, Share::reserved(5))
        .build(MemoryBackend::new());
    assert!(matches!(over, Err(Error::Config(m)) if m.contains("reserve 5")));
    let capped_at_zero = Semaphore::builder("gpu")
        .limit(4)
        .class(Priority::BATCH, Share::at_most(0))
        .build(MemoryBackend::new());
    assert!(matches!(capped_at_zero, Err(Error::Config(m)) if m.contains("at most 0")));
}

on_both_backends!(the_layer_serves_the_class_priority_by_gives);

// `priority_by` reads the request by reference: a `String` request is read as `&String`.
#[allow(clippy::ptr_arg)]
fn class_of(label: &String) -> Priority {
    match label.as_str() {
        "critical" => Priority::CRITICAL,
        _ => Priority::BATCH,
    }
}

/// Through the layer: a CRITICAL request that came last is served before a BATCH one.
async fn the_layer_serves_the_class_priority_by_gives(backend: impl Backend) {
    use tower::{Service, ServiceExt};
    use tower_distributed_limit::DistributedConcurrencyLimitLayer;

    let sem = Semaphore::builder("layer-classes")
        .limit(1)
        .build(backend)
        .unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let inner = {
        let order = order.clone();
        tower::service_fn(move |label: String| {
            order.lock().unwrap().push(label);
            async move { Ok::<_, tower::BoxError>(()) }
        })
    };
    let svc = tower::ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).priority_by(class_of))
        .service(inner);
    let mut holder = sem.acquire().await.unwrap();
    let mut tasks = JoinSet::new();
    for (label, waiting) in [("batch", 1), ("critical", 2)] {
        let mut svc = svc.clone();
        let request = label.to_owned();
        tasks.spawn(async move { svc.ready().await.unwrap().call(request).await.unwrap() });
        eventually(Duration::from_secs(5), label, || async {
            sem.snapshot().await.unwrap().waiting == waiting
        })
        .await;
    }
    holder.release().await.unwrap();
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), ["critical", "batch"]);
}

on_both_backends!(an_http_refusal_names_the_class_that_was_full);

/// Through the HTTP layer: a refusal for want of a permit says which class it was.
async fn an_http_refusal_names_the_class_that_was_full(backend: impl Backend) {
    use http::Request;
    use tower::ServiceExt;
    use tower_distributed_limit::DistributedConcurrencyLimitLayer;
    use tower_distributed_limit::layer::CLASS_HEADER;

    let sem = Semaphore::builder("refused-class")
        .limit(1)
        .acquire_timeout(Duration::from_millis(50))
        .build(backend)
        .unwrap();
    let svc = tower::ServiceBuilder::new()
        .layer(
            DistributedConcurrencyLimitLayer::new(sem.clone())
                .http()
                .priority_by(|request: &Request<String>| match request.uri().path() {
                    "/batch" => Priority::BATCH,
                    _ => Priority::CRITICAL,
                }),
        )
        .service(tower::service_fn(|_: Request<String>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
        }));
    let _held = sem.acquire().await.unwrap();
    for (path, class) in [("/batch", "batch"), ("/chat", "critical")] {
        let request = Request::builder().uri(path).body(String::new()).unwrap();
        let response = svc.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), 503);
        assert_eq!(response.headers()[CLASS_HEADER], class);
    }
}
