//! What the crate tells the operator through `tracing`, read back by a small subscriber of the
//! test's own (one for the binary): a Redis that may evict the crate's keys is warned about
//! once at connect, and permits whose keys vanished are reported when they are found lost.

mod support;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tower_distributed_limit::{RedisBackend, Semaphore};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

use support::{Redis, RedisProcess, eventually};

/// Keeps the message of every WARN event.
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

    fn mentioning(&self, text: &str) -> usize {
        let seen = self.0.lock().unwrap();
        seen.iter().filter(|message| message.contains(text)).count()
    }
}

struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl Subscriber for Warnings {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() == tracing::Level::WARN
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut message = Message(String::new());
        event.record(&mut message);
        self.0.lock().unwrap().push(message.0);
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
