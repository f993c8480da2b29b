//! One client process of `scripts/bench-adaptive`: `--tasks` tokio tasks (default 64), each
//! looping requests through `DistributedConcurrencyLimitLayer::new(sem)` over hyper-util's
//! legacy client to `examples/adaptive_downstream.rs`, from `--start-at` (unix ms) for
//! `--duration` seconds.
//!
//! ```sh
//! cargo build --release --example adaptive_client
//! target/release/examples/adaptive_client <global|per-process|static> --downstream URL \
//!     [--redis-url URL] [--name NAME] [--tasks 64] [--initial 20] [--start-at UNIX_MS] \
//!     [--duration SECONDS] [--sample] [--threads N]
//! ```
//!
//! The stacks:
//!
//! - `global`: one adaptive semaphore on Redis, shared by every client process:
//!   `AdaptiveLimit::new().initial(20).min(2).max(500)` (`--initial N` for another start);
//! - `per-process`: the same builder on a `MemoryBackend` of this process's own: each process
//!   adapts its own limit, as per-process limiters do;
//! - `static`: a fixed `.limit(80)` on Redis, shared.
//!
//! It prints, every 100 ms (lines on stdout, the bench's raw data):
//!
//! - `L <unix ms> <ok> <errors>`: how many requests ended in the last 100 ms, answered or failed;
//! - `T <unix ms> <µs>...`: the downstream latency of each answered one, from the inner call's
//!   start (after the permit was granted) to the response body's end: what the downstream
//!   made it wait, not the wait for a permit;
//! - `E <unix ms> <µs>...`: the same requests end to end, the wait for a permit included;
//! - `M <unix ms> <limit>`: the limit in force, `sem.snapshot().await?.limit` (this process's
//!   own for `per-process`);
//! - with `--sample`, also `D <unix ms> <in flight> <C> <completed> <limit> <busy>`: the
//!   downstream's `/stats` (its in flight, its capacity, its completions so far, its clock and
//!   the integral of its in flight over time, request·ms) and, read at the same tick, the limit
//!   in force.
//!
//! It runs on a current-thread tokio runtime, or a multi-thread one of `--threads N` workers.
//! With `--tasks 0 --sample` it only samples (the bench's sampler: a process of its own, so
//! that when it reads the downstream does not depend on one client's own bursts). At the end
//! it prints `done <ok> <errors>`. Exits 1 if any request failed.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::{Instant, MissedTickBehavior};
use tower::{BoxError, Service, ServiceBuilder, ServiceExt, service_fn};
use tower_distributed_limit::{
    AdaptiveLimit, DistributedConcurrencyLimitLayer, MemoryBackend, RedisBackend, Semaphore,
};

const USAGE: &str = "usage: adaptive_client <global|per-process|static> --downstream URL \
                     [--redis-url URL] [--name NAME] [--tasks N] [--initial N] [--start-at UNIX_MS] \
                     [--duration SECONDS] [--sample] [--threads N]";

/// The adaptive limit of the `global` and `per-process` stacks (`--initial`, default 20).
fn adaptive(initial: u32) -> AdaptiveLimit {
    AdaptiveLimit::new().initial(initial).min(2).max(500)
}

/// The fixed limit of the `static` stack.
const STATIC_LIMIT: u32 = 80;

/// How often the process reports.
const TICK: Duration = Duration::from_millis(100);

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

struct Args {
    stack: String,
    downstream: String,
    redis_url: String,
    name: String,
    tasks: usize,
    initial: u32,
    start_at: Option<u128>,
    duration: f64,
    sample: bool,
}

fn parse_args() -> Result<Args, BoxError> {
    let mut args = Args {
        stack: String::new(),
        downstream: String::new(),
        redis_url: std::env::var("REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned()),
        name: "bench-adaptive".to_owned(),
        tasks: 64,
        initial: 20,
        start_at: None,
        duration: 10.0,
        sample: false,
    };
    let mut argv = std::env::args().skip(1);
    while let Some(arg) = argv.next() {
        let mut value = |flag: &str| argv.next().ok_or_else(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "--downstream" => args.downstream = value("--downstream")?,
            "--redis-url" => args.redis_url = value("--redis-url")?,
            "--name" => args.name = value("--name")?,
            "--tasks" => args.tasks = value("--tasks")?.parse()?,
            "--initial" => args.initial = value("--initial")?.parse()?,
            "--start-at" => args.start_at = Some(value("--start-at")?.parse()?),
            "--duration" => args.duration = value("--duration")?.parse()?,
            "--sample" => args.sample = true,
            "--threads" => {
                value("--threads")?.parse::<usize>()?;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ if arg.starts_with('-') => return Err(format!("unknown option {arg:?}").into()),
            _ if args.stack.is_empty() => args.stack = arg,
            _ => return Err(format!("unexpected argument {arg:?}").into()),
        }
    }
    if args.stack.is_empty() || args.downstream.is_empty() {
        return Err("a stack and --downstream are needed".into());
    }
    if args.duration.is_nan() || args.duration <= 0.0 {
        return Err("--duration must be positive".into());
    }
    Ok(args)
}

async fn semaphore(args: &Args) -> Result<Semaphore, BoxError> {
    let builder = Semaphore::builder(args.name.as_str()).acquire_timeout(Duration::from_secs(30));
    let redis = || async {
        RedisBackend::connect(&args.redis_url)
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", args.redis_url))
    };
    Ok(match args.stack.as_str() {
        "global" => builder
            .adaptive(adaptive(args.initial))
            .build(redis().await?)?,
        "per-process" => builder
            .adaptive(adaptive(args.initial))
            .build(MemoryBackend::new())?,
        "static" => builder.limit(STATIC_LIMIT).build(redis().await?)?,
        other => return Err(format!("unknown stack {other:?}").into()),
    })
}

/// What ended since the last report.
#[derive(Default)]
struct Interval {
    ok: u64,
    errors: u64,
    /// Downstream latency of each request, µs.
    latency: Vec<u32>,
    /// End to end, the wait for a permit included, µs.
    end_to_end: Vec<u32>,
}

#[derive(Default)]
struct Recorder {
    now: Mutex<Interval>,
    /// Totals: ok, errors.
    totals: Mutex<(u64, u64)>,
}

impl Recorder {
    fn take(&self) -> Interval {
        let taken = std::mem::take(&mut *self.now.lock().unwrap_or_else(|e| e.into_inner()));
        let mut totals = self.totals.lock().unwrap_or_else(|e| e.into_inner());
        totals.0 += taken.ok;
        totals.1 += taken.errors;
        taken
    }

    fn with(&self, f: impl FnOnce(&mut Interval)) {
        f(&mut self.now.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// The `tokio` instant at the unix time `at_ms` (now if it has passed).
fn instant_at(at_ms: u128) -> Instant {
    let now = unix_ms();
    Instant::now() + Duration::from_millis(u64::try_from(at_ms.saturating_sub(now)).unwrap_or(0))
}

/// GETs `url` and returns its body.
async fn get(client: &HttpClient, url: &str) -> Result<Bytes, BoxError> {
    let response = client
        .request(Request::get(url).body(Empty::new())?)
        .await?;
    if !response.status().is_success() {
        return Err(format!("{url}: {}", response.status()).into());
    }
    Ok(response.into_body().collect().await?.to_bytes())
}

fn print(out: &mut impl Write, tag: &str, at: u128, values: &[u32]) {
    let mut line = format!("{tag} {at}");
    for v in values {
        line.push(' ');
        line.push_str(&v.to_string());
    }
    line.push('\n');
    let _ = out.write_all(line.as_bytes());
}

/// Prints what ended in the last tick, the limit in force and, when sampling, the downstream.
async fn report(
    recorder: &Recorder,
    sem: &Semaphore,
    client: &HttpClient,
    stats_url: Option<&str>,
) -> Result<(), BoxError> {
    let (snapshot, stats) = tokio::join!(sem.snapshot(), async {
        match stats_url {
            Some(url) => get(client, url).await.map(Some),
            None => Ok(None),
        }
    });
    let limit = snapshot?.limit;
    let stats = stats?;
    let at = unix_ms();
    let taken = recorder.take();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "M {at} {limit}");
    if let Some(stats) = stats {
        // "<in flight> <C> <completed> <unix ms> <busy request·ms>"
        let stats = String::from_utf8_lossy(&stats);
        let fields: Vec<&str> = stats.split_whitespace().collect();
        if let [in_flight, capacity, completed, then, busy] = fields[..] {
            let _ = writeln!(
                out,
                "D {then} {in_flight} {capacity} {completed} {limit} {busy}"
            );
        } else {
            return Err(format!("unexpected /stats answer {stats:?}").into());
        }
    }
    let _ = writeln!(out, "L {at} {} {}", taken.ok, taken.errors);
    print(&mut out, "T", at, &taken.latency);
    print(&mut out, "E", at, &taken.end_to_end);
    let _ = out.flush();
    Ok(())
}

fn main() {
    // `--threads N` (default 1: a current-thread runtime) is read before the rest.
    let argv: Vec<String> = std::env::args().collect();
    let threads = argv
        .iter()
        .position(|a| a == "--threads")
        .and_then(|i| argv.get(i + 1))
        .and_then(|t| t.parse::<usize>().ok())
        .unwrap_or(1);
    let runtime = if threads > 1 {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    };
    let runtime = runtime.expect("a tokio runtime");
    match runtime.block_on(run()) {
        Ok(0) => {}
        Ok(_) => std::process::exit(1),
        Err(e) => {
            eprintln!("adaptive_client: {e}\n{USAGE}");
            std::process::exit(2);
        }
    }
}

/// Runs the load; returns how many requests failed.
async fn run() -> Result<u64, BoxError> {
    let args = parse_args()?;
    let sem = semaphore(&args).await?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector);
    let base = args.downstream.trim_end_matches('/').to_owned();
    let url = format!("{base}/");
    let stats_url = args.sample.then(|| format!("{base}/stats"));
    // One request at a time before the load, to be sure the downstream answers.
    get(&client, &url).await?;

    let recorder = Arc::new(Recorder::default());
    // The downstream latency is measured inside the limit: from the inner call's start to the
    // end of the response body, which is also when the permit is given back.
    let inner = {
        let (client, recorder) = (client.clone(), recorder.clone());
        service_fn(move |request: Request<Empty<Bytes>>| {
            let (client, recorder) = (client.clone(), recorder.clone());
            async move {
                let start = Instant::now();
                let response = client.request(request).await?;
                let status = response.status();
                response.into_body().collect().await?;
                if !status.is_success() {
                    return Err::<(), BoxError>(format!("downstream answered {status}").into());
                }
                let latency = micros(start.elapsed());
                recorder.with(|now| now.latency.push(latency));
                Ok(())
            }
        })
    };
    let service = ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(sem.clone()))
        .service(inner);

    let start = instant_at(args.start_at.unwrap_or_else(unix_ms));
    let end = start + Duration::from_secs_f64(args.duration);
    println!("ready: {} tasks, stack {}", args.tasks, args.stack);
    tokio::time::sleep_until(start).await;

    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..args.tasks {
        let (mut service, recorder, url) = (service.clone(), recorder.clone(), url.clone());
        tasks.spawn(async move {
            let mut reported = 0;
            while Instant::now() < end {
                let began = Instant::now();
                let request = Request::get(&url)
                    .body(Empty::new())
                    .expect("a GET with an empty body");
                let result = match service.ready().await {
                    Ok(ready) => ready.call(request).await,
                    Err(e) => Err(e),
                };
                match result {
                    Ok(()) => recorder.with(|now| {
                        now.ok += 1;
                        now.end_to_end.push(micros(began.elapsed()));
                    }),
                    Err(e) => {
                        recorder.with(|now| now.errors += 1);
                        if reported < 3 {
                            eprintln!("adaptive_client: a request failed: {e}");
                            reported += 1;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        });
    }

    let mut ticks = tokio::time::interval_at(start + TICK, TICK);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {
                if let Err(e) = report(&recorder, &sem, &client, stats_url.as_deref()).await {
                    eprintln!("adaptive_client: a report failed: {e}");
                }
            }
            joined = tasks.join_next(), if !tasks.is_empty() => match joined {
                Some(joined) => joined?,
                None => break,
            },
            // A sampler (`--tasks 0`) reports until the end.
            _ = tokio::time::sleep_until(end), if tasks.is_empty() => break,
        }
    }
    // What ended after the last tick.
    report(&recorder, &sem, &client, None).await?;
    let (ok, errors) = *recorder.totals.lock().unwrap_or_else(|e| e.into_inner());
    println!("done {ok} {errors}");
    Ok(errors)
}
