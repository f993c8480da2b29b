//! Redis down, service up: once Redis is known to be down, every call fails at once (the
//! outage policy decides in microseconds) while one background probe reconnects; a backend
//! starts without Redis; connect timeouts hold end to end; errors say what to change. Real
//! redis-servers, killed, paused, never started, password-protected, or spoken TLS to.

mod support;

use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tower_distributed_limit::{
    BackendStatus, Error, OutagePolicy, QuorumBackend, RateLimiter, RedisBackend, Semaphore,
};

use support::{Redis, RedisProcess, eventually, free_port, long_lived, signal};

const CALL: Duration = Duration::from_millis(100);
const CONNECT: Duration = Duration::from_millis(100);

fn quick(url: &str) -> tower_distributed_limit::RedisBackendBuilder {
    RedisBackend::builder(url)
        .call_timeout(CALL)
        .connect_timeout(CONNECT)
}

fn semaphore(name: &str, policy: OutagePolicy, backend: RedisBackend) -> Semaphore {
    Semaphore::builder(name)
        .limit(4)
        .acquire_timeout(Duration::from_secs(2))
        .on_outage(policy)
        .build(backend)
        .unwrap()
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Times `n` sequential acquires that must each fail with `Error::Backend`.
async fn refusals(sem: &Semaphore, n: usize) -> Vec<Duration> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let outcome = sem.acquire().await;
        times.push(started.elapsed());
        assert!(matches!(outcome, Err(Error::Backend(_))), "{outcome:?}");
    }
    times
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_redis_is_refused_at_once_under_fail_closed() {
    let mut redis = Redis::start().await;
    let sem = semaphore(
        "killed",
        OutagePolicy::FailClosed,
        quick(&redis.url).connect().await.unwrap(),
    );
    drop(sem.acquire().await.unwrap());

    redis.kill();
    let times = refusals(&sem, 60).await;
    let (median, max) = (median(times.clone()), *times.iter().max().unwrap());
    // Before: every refusal took 1.08 s (the connection manager's reconnects, per call).
    assert!(median <= Duration::from_millis(20), "median {median:?}");
    assert!(
        max <= CALL + CONNECT + Duration::from_millis(200),
        "max {max:?}"
    );

    // The probe brings it back by itself within about its 1 s back-off cap.
    redis.restart().await;
    let back = Instant::now();
    eventually(
        Duration::from_secs(5),
        "acquires from Redis again",
        || async { sem.acquire().await.is_ok_and(|p| !p.is_degraded()) },
    )
    .await;
    assert!(
        back.elapsed() < Duration::from_secs(3),
        "{:?}",
        back.elapsed()
    );
}

/// Admissions of 8 tasks holding 5 ms each, for `run`.
async fn admissions(sem: &Semaphore, run: Duration) -> usize {
    let until = Instant::now() + run;
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let sem = sem.clone();
            tokio::spawn(async move {
                let mut admitted = 0;
                while Instant::now() < until {
                    if let Ok(permit) = sem.acquire().await {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        drop(permit);
                        admitted += 1;
                    }
                }
                admitted
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_keeps_the_traffic_flowing_while_redis_is_dead() {
    let mut redis = Redis::start().await;
    let sem = Semaphore::builder("open")
        .limit(8)
        .on_outage(OutagePolicy::FailOpen)
        .build(quick(&redis.url).connect().await.unwrap())
        .unwrap();
    let up = admissions(&sem, Duration::from_secs(1)).await;
    redis.kill();
    let down = admissions(&sem, Duration::from_secs(1)).await;
    // Before: 5 admissions/s with Redis dead against 596/s with it up.
    assert!(
        down * 2 >= up,
        "{down} admitted with Redis dead, {up} with it up"
    );
    assert!(sem.outage_decisions() as usize >= down);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_redis_costs_one_timeout_then_refusals_at_once() {
    let redis = Redis::start().await;
    let sem = semaphore(
        "paused",
        OutagePolicy::FailClosed,
        quick(&redis.url).connect().await.unwrap(),
    );
    drop(sem.acquire().await.unwrap());

    signal(redis.pid(), "STOP");
    let first = refusals(&sem, 1).await[0];
    let later = refusals(&sem, 30).await;
    signal(redis.pid(), "CONT");
    assert!(
        first <= CALL + CONNECT + Duration::from_millis(200),
        "first {first:?}"
    );
    // Before: every acquire waited the whole call timeout, for as long as the pause lasted.
    let median = median(later.clone());
    assert!(median <= Duration::from_millis(20), "median {median:?}");
    assert!(
        later
            .iter()
            .all(|t| *t <= CALL + CONNECT + Duration::from_millis(200))
    );

    eventually(
        Duration::from_secs(5),
        "acquires from Redis again",
        || async { sem.acquire().await.is_ok_and(|p| !p.is_degraded()) },
    )
    .await;
}

/// Slots given back while Redis is paused are free once it answers again, not when their
/// leases end: a permit dropped then (its release cannot be sent), and an acquire whose call
/// timed out but ran when Redis woke up (it granted a slot to nobody).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_given_back_during_a_pause_are_free_once_redis_answers() {
    let redis = Redis::start().await;
    let lease = Duration::from_secs(30);
    let build = |backend| {
        Semaphore::builder("owed")
            .limit(2)
            .lease(lease)
            .acquire_timeout(Duration::from_millis(500))
            .build(backend)
            .unwrap()
    };
    let ours = build(quick(&redis.url).connect().await.unwrap());
    let other = build(quick(&redis.url).connect().await.unwrap());
    let held = ours.acquire().await.unwrap();
    signal(redis.pid(), "STOP");
    // Sent, never answered: Redis grants it when it wakes up.
    assert!(matches!(ours.acquire().await, Err(Error::Backend(_))));
    drop(held);
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(redis.pid(), "CONT");

    let started = Instant::now();
    let mut permits = Vec::new();
    while permits.len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the slots given back in the pause are still held ({} free)",
            permits.len()
        );
        match other.acquire().await {
            Ok(permit) => permits.push(permit),
            Err(Error::Timeout { .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
    let snapshot = other.snapshot().await.unwrap();
    assert_eq!(snapshot.used, 2, "{:?}", snapshot.holders);
    let theirs: Vec<&str> = permits.iter().map(|permit| permit.id()).collect();
    assert!(
        snapshot
            .holders
            .iter()
            .all(|h| theirs.contains(&h.id.as_str())),
        "{:?}",
        snapshot.holders
    );
}

/// 200 tasks on two backends (one prefetching) through a FLUSHALL, a 700 ms pause and an
/// empty restart: holds go on after each, and once the tasks stop nothing is held or waiting
/// and every slot can be taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_come_through_a_flush_a_pause_and_an_empty_restart() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let mut redis = Redis::start().await;
    let build = |backend, prefetch| {
        Semaphore::builder("through")
            .limit(4)
            .lease(Duration::from_secs(1))
            .acquire_timeout(Duration::from_millis(300))
            .prefetch(prefetch)
            .build(backend)
            .unwrap()
    };
    let ours = build(quick(&redis.url).connect().await.unwrap(), 0);
    let twin = build(quick(&redis.url).connect().await.unwrap(), 2);
    let (holds, stop) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let sem = if i % 2 == 0 {
                ours.clone()
            } else {
                twin.clone()
            };
            let (holds, stop) = (holds.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    match sem.acquire().await {
                        Ok(permit) => {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                            drop(permit);
                            holds.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(Error::Timeout { .. }) => {}
                        Err(Error::Backend(_)) => {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
            })
        })
        .collect();
    let holding = || {
        let from = holds.load(Ordering::Relaxed);
        let holds = holds.clone();
        async move {
            eventually(Duration::from_secs(5), "holds go on", || async {
                holds.load(Ordering::Relaxed) > from + 20
            })
            .await;
        }
    };
    holding().await;
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    holding().await;
    signal(redis.pid(), "STOP");
    tokio::time::sleep(Duration::from_millis(700)).await;
    signal(redis.pid(), "CONT");
    holding().await;
    redis.kill();
    redis.restart().await;
    holding().await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    eventually(
        Duration::from_secs(5),
        "nothing held, nobody waits, and both backends see Redis",
        || async {
            // Each backend's probe finds the restarted server on its own (up to a second
            // apart): the twin may still be refusing at once when `ours` is served again.
            let (Ok(snapshot), Ok(_)) = (ours.snapshot().await, twin.snapshot().await) else {
                return false;
            };
            let pooled = snapshot.holders.iter().filter(|h| h.prefetched).count();
            snapshot.waiting == 0 && snapshot.used as usize == pooled
        },
    )
    .await;
    let permits = futures_util::future::join_all((0..4).map(|_| twin.acquire())).await;
    assert!(permits.iter().all(Result::is_ok), "{permits:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_backend_starts_without_redis_and_serves_once_it_is_up() {
    let mut redis = Redis::start().await;
    redis.kill();

    let started = Instant::now();
    let backend = quick(&redis.url).connect_lazy().unwrap();
    assert!(
        started.elapsed() <= Duration::from_millis(50),
        "{:?}",
        started.elapsed()
    );
    let sem = semaphore("lazy", OutagePolicy::Local { limit: 1 }, backend);
    // Down: the policy decides, at once.
    let first = Instant::now();
    let degraded = sem.acquire().await.unwrap();
    assert!(degraded.is_degraded());
    assert!(
        sem.try_acquire().await.unwrap().is_none(),
        "Local limit of 1"
    );
    assert!(
        first.elapsed() <= Duration::from_millis(100),
        "{:?}",
        first.elapsed()
    );
    drop(degraded);

    redis.restart().await;
    let up = Instant::now();
    eventually(Duration::from_secs(5), "permits from Redis", || async {
        sem.try_acquire()
            .await
            .is_ok_and(|p| p.is_some_and(|p| !p.is_degraded()))
    })
    .await;
    assert!(up.elapsed() <= Duration::from_secs(3), "{:?}", up.elapsed());
    // Waiting works too: the subscriber started with the first connection.
    let held: Vec<_> = hold(&sem, 4).await;
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await.map(|p| p.is_degraded()) }
    });
    eventually(Duration::from_secs(5), "the waiter to queue", || async {
        redis.queue_len("lazy").await == 1
    })
    .await;
    drop(held);
    let degraded = tokio::time::timeout(Duration::from_secs(3), waiter)
        .await
        .expect("the waiter was served")
        .unwrap()
        .unwrap();
    assert!(!degraded);
}

async fn hold(sem: &Semaphore, n: usize) -> Vec<tower_distributed_limit::Permit> {
    let mut permits = Vec::new();
    for _ in 0..n {
        permits.push(sem.acquire().await.unwrap());
    }
    permits
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_lazy_outside_a_runtime_is_a_config_error() {
    let outcome = RedisBackend::connect_lazy("redis://127.0.0.1:1");
    assert!(outcome.is_ok(), "inside a runtime it builds");
    let outside = std::thread::spawn(|| RedisBackend::connect_lazy("redis://127.0.0.1:1"))
        .join()
        .unwrap();
    assert!(matches!(outside, Err(Error::Config(_))), "{outside:?}");
    assert!(matches!(
        RedisBackend::connect_lazy("not a url"),
        Err(Error::Config(_))
    ));
}

/// A port that accepts connections and never answers (a paused or black-holed server), and
/// how many connections it accepted.
async fn silent_port() -> (u16, tokio::sync::watch::Receiver<usize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (count, accepted) = tokio::sync::watch::channel(0);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            count.send_modify(|n| *n += 1);
            tokio::spawn(async move {
                let mut sink = [0u8; 1024];
                while socket.read(&mut sink).await.is_ok_and(|n| n > 0) {}
            });
        }
    });
    (port, accepted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_never_wait_behind_a_connect_attempt_and_one_attempt_runs_at_a_time() {
    let (port, accepted) = silent_port().await;
    let backend = quick(&format!("redis://127.0.0.1:{port}"))
        .connect_lazy()
        .unwrap();
    let sem = semaphore("blackhole", OutagePolicy::FailClosed, backend);
    let started = Instant::now();
    // 200 callers, 10 at a time, over about 1.5 s.
    let mut slowest = Duration::ZERO;
    while started.elapsed() < Duration::from_millis(1500) {
        let calls: Vec<_> = (0..10)
            .map(|_| {
                let sem = sem.clone();
                tokio::spawn(async move {
                    let t = Instant::now();
                    let outcome = sem.acquire().await;
                    (t.elapsed(), outcome.is_err())
                })
            })
            .collect();
        for call in calls {
            let (took, refused) = call.await.unwrap();
            assert!(refused);
            slowest = slowest.max(took);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        slowest <= Duration::from_millis(50),
        "a caller waited {slowest:?}"
    );
    // One probe, backing off: a handful of attempts, not one per caller.
    let attempts = *accepted.borrow();
    assert!((1..=12).contains(&attempts), "{attempts} connect attempts");
}

#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_a_plain_port_fails_within_the_connect_timeout() {
    let redis = Redis::start().await;
    let url = redis.url.replace("redis://", "rediss://");
    let timeout = Duration::from_millis(500);
    // redis-rs reads the system's root certificates for every TLS connection; the first read
    // of a process comes from disk, which took seconds on a loaded CI machine. That read is
    // not the wait under test: one attempt first, unmeasured.
    let _ = RedisBackend::builder(url.as_str())
        .connect_timeout(timeout)
        .connect()
        .await;
    let started = Instant::now();
    let outcome = RedisBackend::builder(url.as_str())
        .connect_timeout(timeout)
        .connect()
        .await;
    let took = started.elapsed();
    let Err(Error::Backend(e)) = outcome else {
        panic!("expected a backend error, got {outcome:?}");
    };
    // Before: 2.04 s (three attempts and their pauses).
    assert!(
        took <= timeout + Duration::from_millis(150),
        "took {took:?}"
    );
    assert!(e.to_string().contains("TLS"), "{e}");

    let (port, _) = silent_port().await;
    let started = Instant::now();
    let silent = RedisBackend::builder(format!("rediss://127.0.0.1:{port}").as_str())
        .connect_timeout(timeout)
        .connect()
        .await;
    assert!(silent.is_err());
    let took = started.elapsed();
    assert!(
        took <= timeout + Duration::from_millis(150),
        "took {took:?}"
    );
}

/// The whole chain of an error's messages, as `{:#}` printers show it.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(" <- ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_password_says_where_the_password_goes() {
    let server = RedisProcess::start(|port, _| {
        vec![
            "--port".into(),
            port.to_string(),
            "--requirepass".into(),
            "s3cret".into(),
        ]
    })
    .await;
    let url = format!("redis://127.0.0.1:{}", server.port);
    let outcome = RedisBackend::connect(&url).await;
    let Err(e) = outcome else {
        panic!("connected without the password");
    };
    let text = chain(&e);
    assert!(text.contains("authentication failed"), "{text}");
    assert!(text.contains("redis://:password@host"), "{text}");
    // The server's own words appear once at most down the chain.
    assert!(text.matches("NOAUTH").count() <= 1, "{text}");
    let parts: Vec<&str> = text.split(" <- ").collect();
    let mut distinct = parts.clone();
    distinct.dedup();
    assert_eq!(parts, distinct, "a message repeated down the chain");
    assert!(
        !text.contains("re-established by itself"),
        "never connected: {text}"
    );

    let with = RedisBackend::connect(&format!("redis://:s3cret@127.0.0.1:{}", server.port))
        .await
        .unwrap();
    let sem = semaphore("auth", OutagePolicy::FailClosed, with);
    assert!(!sem.acquire().await.unwrap().is_degraded());
}

/// A redis-server whose user `app` (password `pw`) has exactly `rules` (ACL SETUSER's, key and
/// channel patterns included, separated by spaces), and the URL that logs in as `app`.
async fn with_user(rules: &str) -> (RedisProcess, String) {
    let rules: Vec<String> = rules.split_whitespace().map(String::from).collect();
    let server = RedisProcess::start(move |port, _| {
        let mut args = vec!["--port".into(), port.to_string()];
        args.extend(["--user", "app", "on", ">pw"].map(String::from));
        args.extend(rules);
        args
    })
    .await;
    let url = format!("redis://app:pw@127.0.0.1:{}", server.port);
    (server, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_eval_rights_is_told_which_commands_to_allow() {
    let (_server, url) = with_user("~* &* +@all -eval -evalsha -fcall").await;
    let backend = RedisBackend::connect(&url).await.unwrap();
    let sem = semaphore("acl", OutagePolicy::FailClosed, backend);
    let Err(e) = sem.acquire().await else {
        panic!("acquired without EVAL");
    };
    let text = chain(&e);
    assert!(text.contains("EVALSHA"), "{text}");
    assert!(text.contains("NOPERM"), "{text}");
}

/// Redis names neither the command nor the key it refuses inside a script; the error names
/// every command the scripts run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_refused_inside_the_script_is_named_among_those_to_allow() {
    let (_server, url) = with_user("~* &* +@all -zadd").await;
    let backend = RedisBackend::connect(&url).await.unwrap();
    let sem = semaphore("acl-inside", OutagePolicy::FailClosed, backend);
    let Err(e) = sem.acquire().await else {
        panic!("acquired without ZADD");
    };
    assert!(matches!(e, Error::AccessDenied(_)), "{e:?}");
    let text = chain(&e);
    assert!(text.contains("inside EVAL"), "{text}");
    assert!(text.contains("ZADD"), "{text}");
    assert!(text.contains("ACL"), "{text}");
}

/// docs/operations.md's least-privilege rules, for the default key prefix (`functions`: with
/// `+fcall +function|load`, the faster calls of Redis 7).
fn least_privilege(functions: bool) -> String {
    format!(
        "~dlimit:* &dlimit:* +eval +evalsha {}+subscribe +unsubscribe +ping +publish +time \
         +info +zadd +zrem +zrange +zrangebyscore +zrangebylex +zremrangebyscore +zcard +zcount \
         +zscore +zscan +hget +hmget +hset +hdel +hscan +get +set +del +exists +pexpireat \
         +persist",
        if functions {
            "+fcall +function|load "
        } else {
            ""
        }
    )
}

/// The commands the errors name are all a semaphore and a rate limiter need on one server, on
/// the keys and channels of the key prefix: a user with only those holds, waits, is handed a
/// slot by another process, and is rate limited; its semaphore's calls are functions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_with_only_the_named_commands_gets_everything() {
    let (server, url) = with_user(&least_privilege(true)).await;
    holds_waits_is_handed_a_slot_and_is_rate_limited(&url).await;
    assert!(
        support::command_calls_at(&format!("redis://127.0.0.1:{}", server.port), "fcall").await > 0
    );
}

/// Without the rights to functions (or on a Redis before 7), the same calls go as scripts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_functions_gets_everything_through_scripts() {
    let (server, url) = with_user(&least_privilege(false)).await;
    holds_waits_is_handed_a_slot_and_is_rate_limited(&url).await;
    // (The refused FCALL is counted as rejected, not as a call.)
    assert_eq!(
        support::command_calls_at(&format!("redis://127.0.0.1:{}", server.port), "fcall").await,
        0
    );
    // FCALL allowed, but not loading the library: scripts too.
    let (server, url) = with_user("~* &* +@all -function").await;
    holds_waits_is_handed_a_slot_and_is_rate_limited(&url).await;
    assert_eq!(
        support::libraries_at(&format!("redis://127.0.0.1:{}", server.port)).await,
        0
    );
}

/// A server without functions at all, as Redis 6 is (FCALL unknown): the calls go as scripts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_functions_gets_everything_through_scripts() {
    let server = RedisProcess::start(|port, _| {
        ["--port", &port.to_string(), "--rename-command", "FCALL", ""]
            .map(String::from)
            .to_vec()
    })
    .await;
    let url = format!("redis://127.0.0.1:{}", server.port);
    holds_waits_is_handed_a_slot_and_is_rate_limited(&url).await;
    assert_eq!(
        support::libraries_at(&url).await,
        0,
        "nothing loaded where it cannot run"
    );
}

async fn holds_waits_is_handed_a_slot_and_is_rate_limited(url: &str) {
    let build = |backend| {
        Semaphore::builder("acl-least")
            .limit(1)
            .acquire_timeout(Duration::from_secs(10))
            .build(backend)
            .unwrap()
    };
    let first = build(RedisBackend::connect(url).await.unwrap());
    let second = build(RedisBackend::connect(url).await.unwrap());
    let held = first.acquire().await.unwrap();
    let waiter = tokio::spawn(async move { second.acquire().await.map(drop) });
    eventually(
        Duration::from_secs(5),
        "the second process waits",
        || async { first.snapshot().await.unwrap().waiting == 1 },
    )
    .await;
    assert_eq!(first.snapshot().await.unwrap().holders.len(), 1);
    drop(held);
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter was never handed the slot")
        .unwrap()
        .unwrap();

    let rate = tower_distributed_limit::RateLimiter::builder("acl-least")
        .rate(1, Duration::from_secs(60))
        .build(RedisBackend::connect(url).await.unwrap())
        .unwrap();
    assert!(rate.check().await.unwrap().allowed);
    assert!(!rate.check().await.unwrap().allowed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_with_two_of_three_nodes_down_fails_fast() {
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(Redis::start().await);
    }
    long_lived(&nodes).await;
    let urls: Vec<String> = nodes.iter().map(|node| node.url.clone()).collect();
    let quorum = QuorumBackend::builder(&urls)
        .call_timeout(CALL)
        .connect_timeout(CONNECT)
        .connect()
        .await
        .unwrap();
    let sem = Semaphore::builder("q")
        .limit(2)
        .acquire_timeout(Duration::from_secs(2))
        .build(quorum)
        .unwrap();
    drop(sem.acquire().await.unwrap());

    nodes[1].kill();
    nodes[2].kill();
    let first = refusals(&sem, 1).await[0];
    assert!(first <= Duration::from_secs(3), "first {first:?}");
    let later = refusals(&sem, 30).await;
    let median = median(later);
    assert!(median <= Duration::from_millis(20), "median {median:?}");

    // A lazy quorum with nothing up starts too, and refuses at once.
    let free: Vec<String> = (0..3)
        .map(|_| format!("redis://127.0.0.1:{}", free_port()))
        .collect();
    let lazy = QuorumBackend::builder(&free).connect_lazy().unwrap();
    let sem = Semaphore::builder("q").limit(2).build(lazy).unwrap();
    let started = Instant::now();
    assert!(matches!(sem.acquire().await, Err(Error::Backend(_))));
    assert!(started.elapsed() <= Duration::from_millis(100));
}

const POLICIES: [OutagePolicy; 3] = [
    OutagePolicy::FailClosed,
    OutagePolicy::FailOpen,
    OutagePolicy::Local { limit: 4 },
];

/// Under every outage policy, a semaphore and a rate limiter on `backend` answer each call
/// with `Error::AccessDenied` whose text contains `says`, and decide none by the policy.
async fn every_policy_is_denied(backend: &RedisBackend, says: &str) {
    for (i, policy) in POLICIES.into_iter().enumerate() {
        let sem = semaphore(&format!("denied-{i}"), policy, backend.clone());
        let rate = RateLimiter::builder(format!("denied-{i}"))
            .rate(100, Duration::from_secs(1))
            .on_outage(policy)
            .build(backend.clone())
            .unwrap();
        let outcomes = [
            sem.acquire().await.map(drop),
            sem.try_acquire().await.map(drop),
            rate.check().await.map(drop),
        ];
        for outcome in outcomes {
            let Err(e @ Error::AccessDenied(_)) = &outcome else {
                panic!("{policy:?}: {outcome:?}")
            };
            let text = chain(e);
            assert!(text.contains(says), "{policy:?}: {text}");
        }
        assert_eq!(sem.outage_decisions(), 0, "{policy:?}");
        assert_eq!(rate.outage_decisions(), 0, "{policy:?}");
    }
}

/// The backend's status, once it is `Denied` (the probe or a call heard the refusal).
async fn denied_status(backend: &RedisBackend) -> String {
    eventually(
        Duration::from_secs(5),
        "the status to say Denied",
        || async { matches!(backend.status(), BackendStatus::Denied { .. }) },
    )
    .await;
    match backend.status() {
        BackendStatus::Denied { reason } => reason,
        other => panic!("{other:?}"),
    }
}

/// A wrong password under `connect_lazy` is not an outage: every call is refused with
/// `Error::AccessDenied` saying where the password goes, whatever the policy (`FailOpen` once
/// admitted them all, with no limit), and the status tells a readiness probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_under_connect_lazy_is_denied_under_every_policy() {
    let server = RedisProcess::start(|port, _| {
        ["--port", &port.to_string(), "--requirepass", "s3cret"]
            .map(String::from)
            .to_vec()
    })
    .await;
    let url = format!("redis://:wrong@127.0.0.1:{}", server.port);
    let backend = quick(&url).connect_lazy().unwrap();
    let reason = denied_status(&backend).await;
    assert!(reason.contains("authentication failed"), "{reason}");
    assert!(reason.contains("redis://:password@host"), "{reason}");
    every_policy_is_denied(&backend, "authentication failed").await;
    assert!(matches!(backend.status(), BackendStatus::Denied { .. }));
}

/// A user without commands the scripts run (ZADD for the semaphore, SET for the rate limiter),
/// under `connect_lazy`: the server answers, but every call is refused with
/// `Error::AccessDenied` naming the commands to allow, whatever the policy, and the status
/// says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_missing_a_permission_under_connect_lazy_is_denied_under_every_policy() {
    let (_server, url) = with_user("~* &* +@all -zadd -set").await;
    let backend = quick(&url).connect_lazy().unwrap();
    eventually(
        Duration::from_secs(5),
        "the lazy backend to connect",
        || async { backend.status() == BackendStatus::Up },
    )
    .await;
    every_policy_is_denied(&backend, "ZADD").await;
    let reason = denied_status(&backend).await;
    assert!(reason.contains("ZADD"), "{reason}");
}
