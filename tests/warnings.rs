//! What the crate tells the operator through `tracing`, read back by a small subscriber of the
//! test's own (one for the binary): a Redis that may evict the crate's keys is warned about
//! once at connect, permits whose keys vanished are reported when they are found lost, and an
//! outage is told at its start and end (with a summary while it lasts), not once per request.

mod support;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tower_distributed_limit::{OutagePolicy, RateLimiter, RedisBackend, Semaphore};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

use support::{Redis, RedisProcess, eventually};

/// Keeps the message of every WARN and ERROR event (an ERROR's after `ERROR: `), followed by
/// its other fields (`name=value`).
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

impl Warnings {
    /// The binary's subscriber, installed by the first test that asks.
    fn installed() -> &'static Warnings {
        static WARNINGS: OnceLock<Warnings> = OnceLock::new();
        WARNINGS.get_or_init(|| {
            let warnings = Warnings::default();
            tracing::subscriber::set_global_default(warnings.clone()).unwrap();
            warnings
        })
    }

    /// ERROR events that mention `text`.
    fn errors_about(&self, text: &str) -> usize {
        let seen = self.0.lock().unwrap();
        (seen.iter())
            .filter(|message| message.starts_with("ERROR: ") && message.contains(text))
            .count()
    }

    fn mentioning(&self, text: &str) -> usize {
        let seen = self.0.lock().unwrap();
        seen.iter().filter(|message| message.contains(text)).count()
    }
}

#[derive(Default)]
struct Message {
    message: String,
    fields: String,
}

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            self.fields += &format!(" {}={value:?}", field.name());
        }
    }
}

impl Subscriber for Warnings {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut message = Message::default();
        event.record(&mut message);
        let level = match *event.metadata().level() {
            tracing::Level::ERROR => "ERROR: ",
            _ => "",
        };
        (self.0.lock().unwrap()).push(format!("{level}{}{}", message.message, message.fields));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// A server with `maxmemory` and an evicting policy is warned about once, naming the policy
/// and the fix; one with `noeviction` is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_may_evict_the_keys_is_warned_about() {
    let warnings = Warnings::installed();

    let safe = RedisProcess::start(|port, _| {
        [
            "--port",
            &port.to_string(),
            "--maxmemory",
            "100mb",
            "--maxmemory-policy",
            "noeviction",
        ]
        .map(String::from)
        .to_vec()
    })
    .await;
    let _backend = RedisBackend::connect(&format!("redis://127.0.0.1:{}", safe.port))
        .await
        .unwrap();

    let evicting = RedisProcess::start(|port, _| {
        [
            "--port",
            &port.to_string(),
            "--maxmemory",
            "100mb",
            "--maxmemory-policy",
            "volatile-lru",
        ]
        .map(String::from)
        .to_vec()
    })
    .await;
    let _backend = RedisBackend::connect(&format!("redis://127.0.0.1:{}", evicting.port))
        .await
        .unwrap();
    eventually(Duration::from_secs(5), "the eviction warning", || async {
        warnings.mentioning("maxmemory-policy is volatile-lru") == 1
    })
    .await;
    assert!(
        warnings.mentioning("noeviction") == 1,
        "one warning in all, naming the fix"
    );
}

/// The semaphore's keys flushed behind its holders: the renewal that finds them gone says why
/// they may have gone, once for the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_whose_keys_vanished_are_reported() {
    let warnings = Warnings::installed();
    let redis = Redis::start().await;
    let sem = Semaphore::builder("flushed")
        .limit(2)
        .lease(Duration::from_millis(1500))
        .build(redis.backend().await)
        .unwrap();
    let held = [sem.acquire().await.unwrap(), sem.acquire().await.unwrap()];
    redis::cmd("FLUSHALL")
        .exec_async(&mut redis.conn().await)
        .await
        .unwrap();
    for permit in &held {
        tokio::time::timeout(Duration::from_secs(3), permit.lost())
            .await
            .expect("the next renewal finds the permit gone");
    }
    // Logged once the renewal's answers are all applied, just after the permits learn.
    let said = "gone from the backend while their leases still ran";
    eventually(Duration::from_secs(2), "the warning", || async {
        warnings.mentioning(said) > 0
    })
    .await;
    assert_eq!(
        warnings.mentioning(said),
        1,
        "one warning for the renewal that found both gone"
    );
}

/// WARN lines naming `name` over an outage of Redis during which a semaphore and a rate
/// limiter (both named `name`, both failing open) each decide `requests` calls, and until both
/// are served by Redis again.
async fn warnings_over_an_outage(name: &str, requests: usize) -> usize {
    let warnings = Warnings::installed();
    let mut redis = Redis::start().await;
    let backend = redis.backend().await;
    let sem = Semaphore::builder(name)
        .limit(2)
        .on_outage(OutagePolicy::FailOpen)
        .build(backend.clone())
        .unwrap();
    let rate = RateLimiter::builder(name)
        .rate(1_000_000, Duration::from_secs(1))
        .on_outage(OutagePolicy::FailOpen)
        .build(backend)
        .unwrap();
    drop(sem.acquire().await.unwrap());
    rate.check().await.unwrap();

    redis.kill();
    for _ in 0..requests {
        assert!(sem.acquire().await.unwrap().is_degraded());
        assert!(rate.check().await.unwrap().degraded);
    }
    assert_eq!(sem.outage_decisions(), requests as u64);
    assert_eq!(rate.outage_decisions(), requests as u64);

    redis.restart().await;
    eventually(
        Duration::from_secs(10),
        "Redis serving both again",
        || async {
            !sem.acquire().await.unwrap().is_degraded() && !rate.check().await.unwrap().degraded
        },
    )
    .await;
    warnings.mentioning(name)
}

/// An outage is logged at its start and end for each limiter, whatever the number of
/// requests it decides (each is at DEBUG); before, each request logged a WARN for the
/// semaphore and one for the rate limiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_logs_a_few_warnings_whatever_the_traffic() {
    let few = warnings_over_an_outage("outage-few", 10).await;
    let many = warnings_over_an_outage("outage-many", 500).await;
    println!("WARN lines over an outage: {few} for 10 requests, {many} for 500");
    assert!(many <= 4, "{many} WARN lines for 500 requests");
    assert_eq!(few, many, "as many WARN lines for 10 requests as for 500");
}

/// A wrong password is a configuration error: one ERROR, however many calls it refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_password_is_one_error_whatever_the_calls() {
    let warnings = Warnings::installed();
    let server = RedisProcess::start(|port, _| {
        ["--port", &port.to_string(), "--requirepass", "s3cret"]
            .map(String::from)
            .to_vec()
    })
    .await;
    let label = format!("127.0.0.1:{}", server.port);
    let backend = RedisBackend::connect_lazy(&format!("redis://:wrong@{label}")).unwrap();
    let sem = Semaphore::builder("refused")
        .limit(1)
        .on_outage(OutagePolicy::FailOpen)
        .build(backend)
        .unwrap();
    eventually(Duration::from_secs(5), "the ERROR", || async {
        warnings.errors_about(&label) == 1
    })
    .await;
    for _ in 0..100 {
        assert!(matches!(
            sem.acquire().await,
            Err(tower_distributed_limit::Error::AccessDenied(_))
        ));
    }
    assert_eq!(warnings.errors_about(&label), 1);
}
