//! The benchmark client for the shared benchmark harness (see its README for the contract): one process,
//! `--workers` tokio tasks, each looping acquire -> observer INCR -> hold -> DECR -> release,
//! using the crate's public API as a user would. Prints one JSON line.
//!
//! ```sh
//! cargo build --release --example bench_client
//! RUST_CLIENT=$PWD/target/release/examples/bench_client "$HARNESS"/run.sh
//! ```
//!
//! `--cluster-urls a,b,c` runs the semaphore on a Redis Cluster, `--quorum-urls a,b,c` on a
//! QuorumBackend of independent masters (see `scripts/bench-topologies`); `--prefetch N`
//! prefetches N slots (`RUST_CLIENT="$PWD/target/release/examples/bench_client --prefetch 4"`).
//!
//! Round trips are counted from the crate's own `trace!` event per Redis command (target
//! `tower_distributed_limit::redis`), plus the observer's INCR/DECR.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tokio::time::Instant;
use tower_distributed_limit::{Error, QuorumBackend, RedisBackend, Semaphore};

/// Redis commands the crate sent, counted from its trace events.
static CRATE_CALLS: AtomicU64 = AtomicU64::new(0);

/// A `tracing` subscriber that only counts the crate's per-command events.
struct CountCalls;

impl tracing::Subscriber for CountCalls {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        metadata.target() == "tower_distributed_limit::redis"
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {
        CRATE_CALLS.fetch_add(1, Ordering::Relaxed);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

type Args = HashMap<String, String>;

fn parse_args() -> Args {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    argv.chunks(2)
        .filter_map(|pair| match pair {
            [name, value] => Some((name.trim_start_matches("--").to_owned(), value.clone())),
            _ => None,
        })
        .collect()
}

fn num(args: &Args, name: &str, default: f64) -> f64 {
    args.get(name)
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("--{name} {v:?} is not a number"))
        })
        .unwrap_or(default)
}

fn lib() -> serde_json::Value {
    json!({ "tower-distributed-limit": env!("CARGO_PKG_VERSION"), "redis-rs": "1.8" })
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = parse_args();
    let host = args.get("host").cloned().unwrap_or("127.0.0.1".into());
    let port = num(&args, "port", 6379.0) as u16;
    let url = format!("redis://{host}:{port}");
    let out = match args.get("mode").map(String::as_str) {
        Some("rtt") => rtt(&url, num(&args, "rtt-iterations", 2000.0) as usize).await,
        Some("load") => load(&url, &args).await,
        other => panic!("--mode must be load or rtt, got {other:?}"),
    };
    println!("{out}");
}

/// Bare round trips with the same client library: PING and EVALSHA of `return 1`.
async fn rtt(url: &str, iterations: usize) -> serde_json::Value {
    let client = redis::Client::open(url).expect("a Redis URL");
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg("return 1")
        .query_async(&mut conn)
        .await
        .unwrap();
    let ping = redis::cmd("PING");
    let mut evalsha = redis::cmd("EVALSHA");
    evalsha.arg(&sha).arg(0);
    let (mut ping_us, mut evalsha_us) = (Vec::new(), Vec::new());
    for i in 0..1000 + iterations {
        let t = Instant::now();
        let _: String = ping.query_async(&mut conn).await.unwrap();
        let p = t.elapsed().as_micros() as u64;
        let t = Instant::now();
        let _: i64 = evalsha.query_async(&mut conn).await.unwrap();
        let e = t.elapsed().as_micros() as u64;
        if i >= 1000 {
            ping_us.push(p);
            evalsha_us.push(e);
        }
    }
    json!({ "impl": "tower-distributed-limit", "mode": "rtt", "ping_us": ping_us,
            "evalsha_us": evalsha_us, "lib": lib() })
}

#[derive(Default)]
struct Totals {
    acquired: u64,
    acquired_total: u64,
    timeouts: u64,
    errors: u64,
    pending_at_end: u64,
    pending_wait_us: Vec<u64>,
    wait_us: Vec<u64>,
    release_us: Vec<u64>,
    hold_us_sum: u64,
    max_inflight_local: u64,
    max_inflight_obs: i64,
    obs_calls: u64,
    error_samples: Vec<String>,
}

async fn load(url: &str, args: &Args) -> serde_json::Value {
    tracing::subscriber::set_global_default(CountCalls).expect("the only subscriber");
    let key = args.get("key").cloned().unwrap_or("bench".into());
    let limit = num(args, "limit", 10.0) as u32;
    let workers = num(args, "workers", 1.0) as usize;
    let hold = Duration::from_secs_f64(num(args, "hold-ms", 0.0) / 1000.0);
    let window = Duration::from_secs_f64(num(args, "duration-s", 10.0));
    let acquire_timeout =
        Duration::from_secs_f64(num(args, "acquire-timeout-ms", 30000.0) / 1000.0);
    let start_at_ms = num(args, "start-at-ms", 0.0);
    let observe_key = args.get("observe-key").cloned().unwrap_or_default();

    // `--cluster-urls a,b,c` (scripts/bench-topologies): the semaphore lives on a Redis
    // Cluster; the harness and the observer talk to the node at --host/--port.
    // `--quorum-urls a,b,c`: on a QuorumBackend of independent masters.
    // `--prefetch N`: slots held ahead of need while nobody waits (`SemaphoreBuilder::prefetch`).
    let prefetch = num(args, "prefetch", 0.0) as u32;
    let builder = Semaphore::builder(key)
        .limit(limit)
        .prefetch(prefetch)
        .acquire_timeout(acquire_timeout);
    let sem = if let Some(urls) = args.get("quorum-urls") {
        let urls: Vec<&str> = urls.split(',').collect();
        let quorum = QuorumBackend::connect(&urls)
            .await
            .expect("connect to the quorum");
        builder.build(quorum)
    } else {
        let backend = match args.get("cluster-urls") {
            Some(urls) => {
                let urls: Vec<&str> = urls.split(',').collect();
                RedisBackend::connect_cluster(&urls).await
            }
            None => RedisBackend::connect(url).await,
        }
        .expect("connect to Redis");
        builder.build(backend)
    }
    .expect("valid settings");
    // Warm up before the window: connect and load the script.
    sem.available_permits().await.expect("Redis answers");
    let observer = if observe_key.is_empty() {
        None
    } else {
        let client = redis::Client::open(url).unwrap();
        Some(client.get_multiplexed_async_connection().await.unwrap())
    };

    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        * 1000.0;
    tokio::time::sleep(Duration::from_secs_f64(
        ((start_at_ms - now_ms) / 1000.0).max(0.0),
    ))
    .await;
    let start_lag_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        * 1000.0
        - start_at_ms;
    let started = Instant::now();
    let window_end = started + window;
    let calls_before = CRATE_CALLS.load(Ordering::Relaxed);
    let totals = Arc::new(Mutex::new(Totals::default()));
    let inflight = Arc::new(AtomicU64::new(0));

    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (sem, totals, inflight) = (sem.clone(), totals.clone(), inflight.clone());
        let mut observer = observer.clone();
        let observe_key = observe_key.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = 0u64;
            while Instant::now() < window_end {
                let t0 = Instant::now();
                let outcome = tokio::select! {
                    outcome = sem.acquire() => outcome,
                    _ = tokio::time::sleep_until(window_end) => {
                        {
                            let mut t = totals.lock().unwrap();
                            t.pending_at_end += 1;
                            t.pending_wait_us.push((window_end - t0).as_micros() as u64);
                        }
                        break;
                    }
                };
                let permit = match outcome {
                    Ok(permit) => permit,
                    Err(Error::Timeout { .. }) => {
                        totals.lock().unwrap().timeouts += 1;
                        continue;
                    }
                    Err(e) => {
                        {
                            let mut t = totals.lock().unwrap();
                            t.errors += 1;
                            if t.error_samples.len() < 5 {
                                t.error_samples.push(e.to_string());
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let t1 = Instant::now();
                if t1 > window_end {
                    {
                        let mut t = totals.lock().unwrap();
                        t.acquired_total += 1;
                        t.pending_at_end += 1;
                        t.pending_wait_us.push((window_end - t0).as_micros() as u64);
                    }
                    drop(permit);
                    break;
                }
                let now = inflight.fetch_add(1, Ordering::SeqCst) + 1;
                let mut seen = 0;
                if let Some(conn) = observer.as_mut() {
                    seen = redis::cmd("INCR")
                        .arg(&observe_key)
                        .query_async(conn)
                        .await
                        .unwrap_or(0);
                }
                if !hold.is_zero() {
                    // The simulated work. tokio's timer rounds up to whole milliseconds (10 ms
                    // becomes ~11), so the hold sleeps on a blocking-pool thread, which keeps
                    // it within ~0.1 ms of H.
                    let _ = tokio::task::spawn_blocking(move || std::thread::sleep(hold)).await;
                }
                if let Some(conn) = observer.as_mut() {
                    let _: Result<i64, _> =
                        redis::cmd("DECR").arg(&observe_key).query_async(conn).await;
                }
                inflight.fetch_sub(1, Ordering::SeqCst);
                let t2 = Instant::now();
                // Released in the background, off this request's path.
                drop(permit);
                let t3 = Instant::now();
                mine += 1;
                let mut t = totals.lock().unwrap();
                t.acquired += 1;
                t.acquired_total += 1;
                t.wait_us.push((t1 - t0).as_micros() as u64);
                t.release_us.push((t3 - t2).as_micros() as u64);
                t.hold_us_sum += (t2 - t1).as_micros() as u64;
                t.max_inflight_local = t.max_inflight_local.max(now);
                t.max_inflight_obs = t.max_inflight_obs.max(seen);
                if observer.is_some() {
                    t.obs_calls += 2;
                }
            }
            mine
        }));
    }
    let mut per_worker = Vec::new();
    for task in tasks {
        per_worker.push(task.await.unwrap());
    }
    let elapsed = started.elapsed().as_secs_f64();
    let t = totals.lock().unwrap();
    let client_cmds = CRATE_CALLS.load(Ordering::Relaxed) - calls_before + t.obs_calls;
    json!({
        "impl": "tower-distributed-limit",
        "mode": "load",
        "acquired": t.acquired,
        "acquired_total": t.acquired_total,
        "timeouts": t.timeouts,
        "errors": t.errors,
        "pending_at_end": t.pending_at_end,
        "pending_wait_us": t.pending_wait_us,
        "wait_us": t.wait_us,
        "release_us": t.release_us,
        "max_inflight_local": t.max_inflight_local,
        "max_inflight_obs": t.max_inflight_obs,
        "obs_calls": t.obs_calls,
        "per_worker_acquired": per_worker,
        "hold_mean_ms": t.hold_us_sum as f64 / t.acquired.max(1) as f64 / 1000.0,
        "client_cmds": client_cmds,
        "start_lag_ms": start_lag_ms,
        "elapsed_s": elapsed,
        "pid": std::process::id(),
        "workers": workers,
        "error_samples": t.error_samples,
        "lib": lib(),
        "options": { "lease_ms": 30000, "release": "drop (rides on the next call)", "runtime": "tokio current_thread", "hold": "thread sleep" },
    })
}
