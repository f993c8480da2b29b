//! The metrics of API.md, read back through `metrics-util`'s debugging recorder: names, kinds,
//! labels and values, for each acquisition result, holds, waiters, lost leases, backend errors
//! and a partition set (labelled by its name, never a key). One test: the recorder is global.

#![cfg(feature = "metrics")]

mod support;

use std::collections::HashMap;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower::ServiceExt;
use tower_distributed_limit::{
    Ask, DistributedConcurrencyLimitLayer, Error, MemoryBackend, OutagePolicy, Partitions,
    Priority, RateLimiter, RedisBackend, Semaphore,
};

use support::{Redis, RedisProcess, eventually};

type Series = (String, Vec<(String, String)>);

/// What the recorder saw so far. Each snapshot gives what changed since the last one (counter
/// increments, gauge moves, histogram samples), so they are added up here.
struct Seen {
    snapshotter: Snapshotter,
    totals: std::sync::Mutex<HashMap<Series, f64>>,
}

impl Seen {
    fn update(&self) -> std::sync::MutexGuard<'_, HashMap<Series, f64>> {
        let mut totals = self.totals.lock().unwrap();
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let key = key.key();
            let mut labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            let total = totals.entry((key.name().to_owned(), labels)).or_default();
            match value {
                DebugValue::Counter(n) => *total += n as f64,
                DebugValue::Histogram(samples) => *total += samples.len() as f64,
                // The crate only moves its gauges up and down, and each snapshot gives the
                // move since the last one.
                DebugValue::Gauge(value) => *total += value.into_inner(),
            }
        }
        totals
    }

    /// A counter's total, a gauge's value or a histogram's number of samples.
    fn get(&self, name: &str, pairs: &[(&str, &str)]) -> f64 {
        let mut labels: Vec<_> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        labels.sort();
        self.update()
            .get(&(name.to_owned(), labels))
            .copied()
            .unwrap_or(0.0)
    }

    fn labels_seen(&self) -> Vec<String> {
        self.update()
            .keys()
            .flat_map(|(_, labels)| labels.iter().map(|(_, v)| v.clone()))
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_is_emitted_with_its_labels() {
    let recorder = DebuggingRecorder::new();
    let metrics = Seen {
        snapshotter: recorder.snapshotter(),
        totals: Default::default(),
    };
    recorder
        .install()
        .expect("the only recorder of this test binary");
    let result = |name, result| {
        metrics.get(
            "dlimit_acquire_total",
            &[("semaphore", name), ("result", result), ("class", "normal")],
        )
    };
    let acquired = |name| result(name, "acquired");

    // Acquired, held, released.
    let sem = Semaphore::builder("m")
        .limit(1)
        .max_waiters(1)
        .acquire_timeout(Duration::from_millis(50))
        .build(MemoryBackend::new())
        .unwrap();
    let held = sem.acquire().await.unwrap();
    assert_eq!(
        metrics.get(
            "dlimit_acquire_wait_seconds",
            &[("semaphore", "m"), ("class", "normal")]
        ),
        1.0
    );
    assert_eq!(acquired("m"), 1.0);
    assert_eq!(
        metrics.get("dlimit_permits_held", &[("semaphore", "m")]),
        1.0
    );
    // The limit in force, as the last acquisition heard it.
    assert_eq!(metrics.get("dlimit_limit", &[("semaphore", "m")]), 1.0);

    // Full: try_acquire is rejected, acquire times out.
    assert!(sem.try_acquire().await.unwrap().is_none());
    assert_eq!(result("m", "rejected"), 1.0);
    assert!(matches!(sem.acquire().await, Err(Error::Timeout { .. })));
    assert_eq!(result("m", "timeout"), 1.0);

    drop(held);
    assert_eq!(
        metrics.get("dlimit_permit_hold_seconds", &[("semaphore", "m")]),
        1.0
    );
    assert_eq!(
        metrics.get("dlimit_permits_held", &[("semaphore", "m")]),
        0.0
    );

    // One waiter is counted; one more is too many.
    let sem = Semaphore::builder("w")
        .limit(1)
        .max_waiters(1)
        .acquire_timeout(Duration::from_secs(10))
        .build(MemoryBackend::new())
        .unwrap();
    let held = sem.acquire().await.unwrap();
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    eventually(Duration::from_secs(5), "one waiter counted", || async {
        metrics.get("dlimit_waiters", &[("semaphore", "w")]) == 1.0
    })
    .await;
    assert!(matches!(
        sem.acquire().await,
        Err(Error::TooManyWaiters { .. })
    ));
    assert_eq!(result("w", "too_many_waiters"), 1.0);
    drop(held);
    drop(waiter.await.unwrap().unwrap());
    assert_eq!(metrics.get("dlimit_waiters", &[("semaphore", "w")]), 0.0);
    assert_eq!(acquired("w"), 2.0);

    // A partition set reports under its own name, never a key's.
    let partitions = Partitions::builder("tenants")
        .key_header(http::HeaderName::from_static("x-tenant"))
        .limit(1)
        .build(MemoryBackend::new())
        .unwrap();
    for key in ["a", "b", "c"] {
        drop(partitions.semaphore(key).unwrap().acquire().await.unwrap());
    }
    assert_eq!(acquired("tenants"), 3.0);
    assert!(
        metrics
            .labels_seen()
            .iter()
            .all(|value| !value.starts_with("tenants:")),
        "a request key became a label"
    );

    // Acquisitions are counted by class, never by tenant.
    let classes = Semaphore::builder("classes")
        .limit(2)
        .build(MemoryBackend::new())
        .unwrap();
    let critical = Ask::new()
        .priority(Priority::CRITICAL)
        .tenant("acme-tenant");
    drop(classes.acquire_with(critical).await.unwrap());
    assert_eq!(
        metrics.get(
            "dlimit_acquire_total",
            &[
                ("semaphore", "classes"),
                ("result", "acquired"),
                ("class", "critical")
            ]
        ),
        1.0
    );
    assert!(
        (metrics.labels_seen().iter()).all(|value| !value.contains("acme")),
        "a tenant became a label"
    );

    // A lease lost behind the holder's back.
    let mut redis = Redis::start().await;
    let sem = Semaphore::builder("lost")
        .limit(1)
        .lease(Duration::from_secs(1))
        .build(redis.backend().await)
        .unwrap();
    let held = sem.acquire().await.unwrap();
    let _: i64 = redis::cmd("DEL")
        .arg("dlimit:{lost}:holders")
        .arg("dlimit:{lost}:meta")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(3), held.lost())
        .await
        .unwrap();
    eventually(Duration::from_secs(2), "the lost lease counted", || async {
        metrics.get("dlimit_lease_lost_total", &[("semaphore", "lost")]) == 1.0
    })
    .await;
    drop(held);

    // Redis down: a backend error, and a degraded permit from the outage policy.
    let backend = RedisBackend::builder(redis.url.as_str())
        .call_timeout(Duration::from_millis(200))
        .connect_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let closed = Semaphore::builder("down")
        .limit(1)
        .build(backend.clone())
        .unwrap();
    let open = Semaphore::builder("open")
        .limit(1)
        .on_outage(OutagePolicy::FailOpen)
        .build(backend)
        .unwrap();
    let server = redis.url.trim_start_matches("redis://").to_owned();
    let up = || metrics.get("dlimit_backend_up", &[("backend", server.as_str())]);
    // This process's two backends to the server are up.
    let before = up();
    assert_eq!(before, 2.0);
    redis.kill();
    assert!(matches!(closed.acquire().await, Err(Error::Backend(_))));
    assert_eq!(result("down", "backend_error"), 1.0);
    assert_eq!(
        metrics.get(
            "dlimit_backend_errors_total",
            &[("semaphore", "down"), ("op", "acquire")]
        ),
        1.0
    );
    assert!(open.acquire().await.unwrap().is_degraded());
    assert_eq!(result("open", "degraded"), 1.0);

    // The backend is marked down: later calls are refused at once, and counted as such.
    assert!(up() <= before - 1.0, "dlimit_backend_up stayed {}", up());
    assert!(matches!(closed.acquire().await, Err(Error::Backend(_))));
    assert!(
        metrics.get(
            "dlimit_backend_fast_failures_total",
            &[("backend", server.as_str())]
        ) >= 1.0
    );
    // Back up once the probe reaches the restarted server.
    redis.restart().await;
    eventually(Duration::from_secs(5), "dlimit_backend_up back", || async {
        up() == before
    })
    .await;

    // A rate limiter: decisions by result (a partition key's too, under the limiter's name),
    // what the last decision on the limiter itself left, the waits refusals asked for.
    let rate = RateLimiter::builder("r")
        .rate(2, Duration::from_secs(3600))
        .build(MemoryBackend::new())
        .unwrap();
    let decisions = |limiter, result| {
        metrics.get(
            "dlimit_rate_decisions_total",
            &[("limiter", limiter), ("result", result)],
        )
    };
    assert!(rate.check().await.unwrap().allowed);
    assert_eq!(
        metrics.get("dlimit_rate_remaining", &[("limiter", "r")]),
        1.0
    );
    assert!(rate.check().await.unwrap().allowed);
    assert!(!rate.check().await.unwrap().allowed);
    assert!(rate.check_key("tenant-a", 1).await.unwrap().allowed);
    assert_eq!(
        (decisions("r", "allowed"), decisions("r", "limited")),
        (3.0, 1.0)
    );
    assert_eq!(
        metrics.get("dlimit_rate_retry_after_seconds", &[("limiter", "r")]),
        1.0
    );
    // Decided with the permit, in one call of the semaphore's script: counted too.
    let combined = Redis::start().await;
    let backend = combined.backend().await;
    let sem = Semaphore::builder("c")
        .limit(5)
        .build(backend.clone())
        .unwrap();
    let rate = RateLimiter::builder("c")
        .rate(1, Duration::from_secs(3600))
        .build(backend)
        .unwrap();
    let svc = tower::ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(sem).rate_limit(rate))
        .service(tower::service_fn(|()| async {
            Ok::<_, tower::BoxError>(())
        }));
    assert!(svc.clone().oneshot(()).await.is_ok());
    assert!(svc.oneshot(()).await.is_err());
    assert_eq!(
        (decisions("c", "allowed"), decisions("c", "limited")),
        (1.0, 1.0)
    );

    // A wrong password is no outage: `dlimit_backend_denied` says so while the backend lives.
    let guarded = RedisProcess::start(|port, _| {
        ["--port", &port.to_string(), "--requirepass", "s3cret"]
            .map(String::from)
            .to_vec()
    })
    .await;
    let server = format!("127.0.0.1:{}", guarded.port);
    let denied = || metrics.get("dlimit_backend_denied", &[("backend", server.as_str())]);
    let backend = RedisBackend::connect_lazy(&format!("redis://:wrong@{server}")).unwrap();
    eventually(Duration::from_secs(5), "dlimit_backend_denied", || async {
        denied() == 1.0
    })
    .await;
    // Its probe may be mid-attempt, holding the backend a moment longer.
    drop(backend);
    eventually(
        Duration::from_secs(5),
        "dlimit_backend_denied gone",
        || async { denied() == 0.0 },
    )
    .await;
}
