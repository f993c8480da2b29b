//! The rate limiter, measured against a real redis-server (issue 13): how exact the shared
//! rate is across OS processes, and what one `check()` costs next to a bare script call.
//!
//! 1. **Accuracy.** Four child processes (this binary again, in a child role) hammer one
//!    `RateLimiter` (200/s, burst 20) with `check()` from four tasks each for
//!    `RATE_BENCH_SECS` seconds (default 10). Every admitted request also `INCR`s a counter key
//!    of its own, which is the count reported (it must equal the sum the children print).
//!    Accuracy = admitted ÷ (burst + rate·t), t the window from the first check sent to the
//!    last answered, on the wall clock all processes share; the target is 1.00 ± 0.02. The
//!    same run with a `MemoryBackend` in each child (four per-process limiters) shows ≈ 4.
//! 2. **Latency.** p50 and p99 of sequential calls from one task, `RATE_BENCH_SAMPLES` each
//!    (default 20 000, after a warm-up), in alternating blocks so machine noise hits every line
//!    alike: `RateLimiter::check()` on a `RedisBackend`; `EVALSHA` of `return 1` on a redis-rs
//!    multiplexed connection (the baseline); `rate.lua` itself by `EVALSHA` on that connection;
//!    and `return 1` on a connection manager set up as the crate's (RESP3, bounded calls). The
//!    differences split `check()`'s extra time into the script, the connection and the crate.
//!    Each line also shows the CPU time per call of this thread (the client) and of
//!    redis-server, from the scheduler (`/proc/<task>/sched`), where the kernel has it. (A
//!    waiting client's CPU time also grows with the server's time: a slower reply costs a
//!    deeper sleep and wake-up.)
//! 3. **Server time.** µs per `EVALSHA` from the server's own `INFO commandstats`, in windows
//!    reset by `CONFIG RESETSTAT` (median of three), for `rate.lua` built up step by step from
//!    `return 1` (a reply of four numbers, `TIME`, `GET` + `SET`, the arguments and the stored
//!    TAT's parsing and writing, the GCRA arithmetic) and for `check()` itself, with the
//!    commands the script runs inside.
//! 4. **The combined layer.** Script calls per request through
//!    `DistributedConcurrencyLimitLayer::new(sem).rate_limit(rate)`, both on the same Redis
//!    (target 1: the permit and the rate in one call, the release riding on the next).
//!
//! Run with `cargo bench --bench rate`; it starts its own redis-server on a free loopback port
//! and takes about 30 s (`RATE_BENCH_SECS=3` for a shorter accuracy window; at most 50, as
//! a child has a minute to report).

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncCommands, PushInfo};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tower_distributed_limit::{MemoryBackend, RateBackend, RateLimiter, RedisBackend};

#[path = "../tests/support/mod.rs"]
mod support;

/// The shared rate of the accuracy runs.
const RATE: u32 = 200;
const BURST: u32 = 20;
const CHILDREN: usize = 4;
/// Tasks calling `check()` in each child.
const TASKS: usize = 4;
/// The longest a refused task sleeps before checking again (its `retry_after` if shorter).
const NAP: Duration = Duration::from_millis(2);

/// Latency: samples per line (after `WARM_UP`), taken in blocks of `BLOCK`, lines alternating.
const WARM_UP: usize = 2_000;
const BLOCK: usize = 500;
/// Server time: calls per window, windows per script (the median is reported).
const WINDOW: usize = 5_000;
const WINDOWS: usize = 3;

const ROLE_REDIS: &str = "rate-redis";
const ROLE_MEMORY: &str = "rate-memory";

/// The rate limiter's script as the crate sends it (the GCRA function, then the call), to call
/// without the crate.
const RATE_LUA: &str = concat!(
    include_str!("../src/backend/lua/gcra.lua"),
    include_str!("../src/backend/lua/rate.lua")
);
const BARE_LUA: &str = "return 1";

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn wall_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_micros() as u64
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    if let Some((role, url)) = support::child_role() {
        child(&role, &url).await;
        return;
    }
    let secs: f64 = env_or("RATE_BENCH_SECS", 10.0);
    let samples: usize = env_or("RATE_BENCH_SAMPLES", 20_000);
    let redis = support::Redis::start().await;
    let mut conn = redis.conn().await;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .expect("INFO server");
    let version = info
        .lines()
        .find_map(|line| line.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .to_owned();
    println!("rate limiter bench, redis {version}\n");

    let latency = latency(&redis, samples).await;
    let server = server_time(&redis).await;
    let shared = accuracy(&redis, ROLE_REDIS, secs).await;
    let local = accuracy(&redis, ROLE_MEMORY, secs).await;

    println!(
        "### Accuracy: {CHILDREN} processes × {TASKS} tasks, rate {RATE}/s, burst {BURST}, \
         {secs} s\n"
    );
    println!("| limiter | window s | checks | admitted | burst + rate·t | accuracy | target |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    println!(
        "{}",
        shared.row("RedisBackend, one shared limiter", "1.00 ± 0.02")
    );
    println!("{}", local.row("MemoryBackend, one per process", "≈ 4.0"));

    println!(
        "\n### Latency: sequential calls from one task, {samples} each, blocks of {BLOCK} \
         alternating\n"
    );
    println!(
        "| call | p50 µs | p99 µs | mean µs | client CPU µs | server CPU µs | p50 ÷ bare | p99 ÷ bare |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let bare = &latency[BARE];
    let cpu = |us: Option<f64>| us.map_or("-".to_owned(), |us| format!("{us:.1}"));
    for (name, line) in LINES.iter().zip(&latency) {
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} | {} | {} | {:.3} | {:.3} |",
            line.p50,
            line.p99,
            line.mean,
            cpu(line.client_cpu),
            cpu(line.server_cpu),
            line.p50 / bare.p50,
            line.p99 / bare.p99
        );
    }
    let (check, script, manager) = (&latency[CHECK], &latency[SCRIPT], &latency[MANAGER]);
    println!(
        "\np50 gap of check() over bare: {:+.1} µs = the script {:+.1} (rate.lua − return 1, \
         same connection) + the connection {:+.1} (manager − multiplexed) + the crate {:+.1} \
         (the rest)",
        check.p50 - bare.p50,
        script.p50 - bare.p50,
        manager.p50 - bare.p50,
        check.p50 - script.p50 - (manager.p50 - bare.p50)
    );
    let delta = |a: Option<f64>, b: Option<f64>| cpu(a.zip(b).map(|(a, b)| a - b));
    println!(
        "CPU per call, check() − bare: client {} µs, server {} µs",
        delta(check.client_cpu, bare.client_cpu),
        delta(check.server_cpu, bare.server_cpu)
    );

    println!(
        "\n### Server time of the script: INFO commandstats, µs per EVALSHA, median of \
         {WINDOWS} windows of {WINDOW} calls\n"
    );
    println!("| script | µs per call | step | inside: calls per EVALSHA (µs each) |");
    println!("|---|---:|---:|---|");
    let mut previous = None;
    for (name, window) in &server {
        let inner: Vec<String> = window
            .inner
            .iter()
            .map(|(command, (calls, usec))| {
                format!(
                    "{command} {:.0} ({:.2})",
                    *calls as f64 / WINDOW as f64,
                    *usec as f64 / (*calls).max(1) as f64
                )
            })
            .collect();
        let inner = if inner.is_empty() {
            "-".to_owned()
        } else {
            inner.join(", ")
        };
        let step = previous.map_or("".to_owned(), |p: f64| {
            format!("{:+.2}", window.per_call - p)
        });
        previous = Some(window.per_call);
        println!("| {name} | {:.2} | {step} | {inner} |", window.per_call);
    }
    let (first, last) = (&server[0].1, &server[server.len() - 1].1);
    println!(
        "\nserver µs per EVALSHA, check() − bare: {:+.2} of the {:+.1} µs p50 gap ({:+.1} \
         mean); a script that only reads the clock, reads and writes the key and answers four \
         numbers already costs {:+.2}",
        last.per_call - first.per_call,
        check.p50 - bare.p50,
        check.mean - bare.mean,
        server[3].1.per_call - first.per_call
    );

    let (requests, calls) = combined(&redis).await;
    println!(
        "\n### The combined layer: `DistributedConcurrencyLimitLayer::new(sem).rate_limit(rate)`, \
         both on one Redis\n\n{requests} requests one after another, {calls} script calls: \
         {:.3} per request (target 1; each carries the previous request's release)",
        calls as f64 / requests as f64
    );
}

/// Requests through the layer with `rate_limit`, one after another: how many script calls
/// (EVALSHA and EVAL, counted by the server) they cost.
async fn combined(redis: &support::Redis) -> (u64, u64) {
    use tower::{ServiceExt, service_fn};
    use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Semaphore};
    const REQUESTS: u64 = 5_000;
    let backend = redis.backend().await;
    let sem = Semaphore::builder("combined")
        .limit(10)
        .build(backend.clone())
        .expect("a semaphore");
    let rate = limiter("combined", 1_000_000, 1_000_000, backend);
    let svc = tower::ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(sem).rate_limit(rate))
        .service(service_fn(|()| async { Ok::<_, tower::BoxError>(()) }));
    svc.clone().oneshot(()).await.expect("a warm-up request");
    let before = redis.script_calls().await;
    for _ in 0..REQUESTS {
        svc.clone().oneshot(()).await.expect("a request");
    }
    (REQUESTS, redis.script_calls().await - before)
}

// ---------------------------------------------------------------------------------------------
// Accuracy

/// What one accuracy run counted.
struct Count {
    admitted: u64,
    checks: u64,
    window: f64,
}

impl Count {
    fn row(&self, name: &str, target: &str) -> String {
        let allowed = f64::from(BURST) + f64::from(RATE) * self.window;
        format!(
            "| {name} | {:.3} | {} | {} | {allowed:.1} | {:.3} | {target} |",
            self.window,
            self.checks,
            self.admitted,
            self.admitted as f64 / allowed
        )
    }
}

/// Four children in `role` hammer the limiter for `secs`; the admitted requests as the
/// independent counter saw them, and the window they were checked in.
async fn accuracy(redis: &support::Redis, role: &str, secs: f64) -> Count {
    let mut children: Vec<_> = (0..CHILDREN)
        .map(|_| support::spawn_child_with(role, &redis.url))
        .collect();
    for child in &mut children {
        assert_eq!(support::child_says(child).await, "ready");
    }
    for child in &mut children {
        let stdin = child.stdin.as_mut().expect("piped stdin");
        stdin
            .write_all(format!("go {secs}\n").as_bytes())
            .await
            .expect("tell the child to go");
        stdin.flush().await.expect("flush");
    }
    let (mut reported, mut checks, mut first, mut last) = (0, 0, u64::MAX, 0);
    for child in &mut children {
        let said = support::child_says(child).await;
        let numbers: Vec<u64> = said
            .split(' ')
            .map(|n| n.parse().expect("a number"))
            .collect();
        let &[admitted, checked, start, end] = numbers.as_slice() else {
            panic!("the child said {said:?}");
        };
        reported += admitted;
        checks += checked;
        first = first.min(start);
        last = last.max(end);
    }
    for child in &mut children {
        child.wait().await.expect("the child exits");
    }
    let counted: u64 = redis
        .conn()
        .await
        .get(counter(role))
        .await
        .expect("GET counter");
    assert_eq!(counted, reported, "the counter and the children disagree");
    Count {
        admitted: counted,
        checks,
        window: (last - first) as f64 / 1e6,
    }
}

fn counter(role: &str) -> String {
    format!("admitted:{role}")
}

/// A child: builds the limiter of its role, says `ready`, waits for `go <secs>`, hammers, and
/// says `<admitted> <checks> <first sent µs> <last answered µs>` (wall clock).
async fn child(role: &str, url: &str) {
    let rate = match role {
        ROLE_REDIS => {
            let backend = RedisBackend::connect(url).await.expect("connect");
            let rate = limiter("accuracy", RATE, BURST, backend);
            // Loads the script and opens the connection, on a key of its own.
            rate.check_key("warm-up", 1).await.expect("warm-up");
            rate
        }
        ROLE_MEMORY => limiter("accuracy", RATE, BURST, MemoryBackend::new()),
        other => panic!("unknown role {other:?}"),
    };
    let mut counter_conn = redis::Client::open(url)
        .expect("a URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let _: () = redis::cmd("PING")
        .query_async(&mut counter_conn)
        .await
        .expect("PING");
    println!("DLIMIT ready");
    let mut line = String::new();
    BufReader::new(tokio::io::stdin())
        .read_line(&mut line)
        .await
        .expect("read go");
    let secs: f64 = line
        .trim()
        .strip_prefix("go ")
        .and_then(|s| s.parse().ok())
        .expect("go <secs>");
    let key = counter(role);
    let start = wall_us();
    let until = tokio::time::Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..TASKS {
        let rate = rate.clone();
        let mut counter_conn = counter_conn.clone();
        let key = key.clone();
        tasks.spawn(async move {
            let (mut admitted, mut checks, mut end) = (0u64, 0u64, 0u64);
            while tokio::time::Instant::now() < until {
                let d = rate.check().await.expect("check");
                end = wall_us();
                checks += 1;
                if d.allowed {
                    admitted += 1;
                    let _: i64 = counter_conn.incr(&key, 1).await.expect("INCR");
                } else {
                    let nap = d.retry_after.unwrap_or(NAP).min(NAP);
                    tokio::time::sleep(nap).await;
                }
            }
            (admitted, checks, end)
        });
    }
    let (mut admitted, mut checks, mut end) = (0, 0, start);
    while let Some(done) = tasks.join_next().await {
        let (a, c, e) = done.expect("a hammering task");
        admitted += a;
        checks += c;
        end = end.max(e);
    }
    println!("DLIMIT {admitted} {checks} {start} {end}");
}

fn limiter(name: &str, rate: u32, burst: u32, backend: impl RateBackend) -> RateLimiter {
    RateLimiter::builder(name)
        .rate(rate, Duration::from_secs(1))
        .burst(burst)
        .build(backend)
        .expect("valid settings")
}

// ---------------------------------------------------------------------------------------------
// Latency

const LINES: [&str; 4] = [
    "`RateLimiter::check()`, RedisBackend",
    "bare `EVALSHA` of `return 1`, multiplexed connection",
    "`EVALSHA` of rate.lua, multiplexed connection",
    "bare `EVALSHA` of `return 1`, connection manager as the crate's",
];
const CHECK: usize = 0;
const BARE: usize = 1;
const SCRIPT: usize = 2;
const MANAGER: usize = 3;

/// The calls measured, each on the connection it is meant to show.
struct Callers {
    limiter: RateLimiter,
    plain: MultiplexedConnection,
    manager: ConnectionManager,
    bare: String,
    rate: String,
}

/// The arguments the crate sends with the rate script: rate, period (µs), burst, cost. The
/// latency lines' rate is far above the call rate, so every check is allowed and runs the
/// script's full path (`GET` and `SET`).
const FAST: [u64; 4] = [1_000_000, 1_000_000, 1_000_000, 1];

impl Callers {
    async fn new(redis: &support::Redis) -> Callers {
        let limiter = limiter(
            "latency",
            FAST[0] as u32,
            FAST[2] as u32,
            redis.backend().await,
        );
        let mut plain = redis.conn().await;
        // As `connection.rs` sets up the crate's (RESP3, pushes taken, bounded calls).
        let config = ConnectionManagerConfig::new()
            .set_push_sender(|_: PushInfo| Ok::<(), std::convert::Infallible>(()))
            .set_automatic_resubscription()
            .set_response_timeout(Some(Duration::from_secs(1)))
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let manager = redis::Client::open(format!("{}?protocol=resp3", redis.url))
            .expect("a URL")
            .get_connection_manager_with_config(config)
            .await
            .expect("a connection manager");
        Callers {
            limiter,
            bare: load(&mut plain, BARE_LUA).await,
            rate: load(&mut plain, RATE_LUA).await,
            plain,
            manager,
        }
    }

    async fn call(&mut self, line: usize) {
        match line {
            CHECK => {
                let d = self.limiter.check().await.expect("check");
                assert!(d.allowed);
            }
            BARE => bare(&mut self.plain, &self.bare).await,
            SCRIPT => {
                let reply = evalsha(&mut self.plain, &self.rate, Some("{raw}:rate"), &FAST).await;
                assert!(matches!(reply, redis::Value::Array(_)));
            }
            MANAGER => bare(&mut self.manager, &self.bare).await,
            _ => unreachable!(),
        }
    }
}

/// Loads `source` (`SCRIPT LOAD`) and returns its SHA.
async fn load(conn: &mut MultiplexedConnection, source: &str) -> String {
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(source)
        .query_async(conn)
        .await
        .expect("SCRIPT LOAD")
}

async fn bare(conn: &mut impl redis::aio::ConnectionLike, sha: &str) {
    let one: i64 = redis::cmd("EVALSHA")
        .arg(sha)
        .arg(0)
        .query_async(conn)
        .await
        .expect("EVALSHA");
    assert_eq!(one, 1);
}

async fn evalsha(
    conn: &mut MultiplexedConnection,
    sha: &str,
    key: Option<&str>,
    args: &[u64],
) -> redis::Value {
    let mut command = redis::cmd("EVALSHA");
    command.arg(sha).arg(usize::from(key.is_some())).arg(key);
    for arg in args {
        command.arg(arg);
    }
    command.query_async(conn).await.expect("EVALSHA")
}

/// The CPU time the thread (`thread-self`) or process has run so far, in ns, from the
/// scheduler's `se.sum_exec_runtime` (precise to the ns, unlike the tick-based `stat`); `None`
/// where `/proc` does not have it.
fn cpu_ns(task: &str) -> Option<f64> {
    let sched = std::fs::read_to_string(format!("/proc/{task}/sched")).ok()?;
    let ms: f64 = sched
        .lines()
        .find_map(|line| line.strip_prefix("se.sum_exec_runtime"))?
        .trim_start_matches([' ', ':'])
        .trim()
        .parse()
        .ok()?;
    Some(ms * 1e6)
}

/// One line's figures: wall time per call, and the CPU time per call of this thread (the
/// client: the runtime is current-thread, the connection's driver task included) and of
/// redis-server's main thread (parsing, the script, the reply, its event loop).
struct Line {
    p50: f64,
    p99: f64,
    mean: f64,
    client_cpu: Option<f64>,
    server_cpu: Option<f64>,
}

/// Every line `samples` times, in blocks of `BLOCK`, the order of the lines turning each round.
async fn latency(redis: &support::Redis, samples: usize) -> Vec<Line> {
    let mut callers = Callers::new(redis).await;
    for line in 0..LINES.len() {
        for _ in 0..WARM_UP {
            callers.call(line).await;
        }
    }
    let server = redis.pid().to_string();
    let mut micros = vec![Vec::with_capacity(samples); LINES.len()];
    let mut cpu = vec![(Some(0.0), Some(0.0)); LINES.len()];
    for round in 0..samples.div_ceil(BLOCK) {
        for turn in 0..LINES.len() {
            let line = (round + turn) % LINES.len();
            let (client, server_before) = (cpu_ns("thread-self"), cpu_ns(&server));
            for _ in 0..BLOCK {
                let started = Instant::now();
                callers.call(line).await;
                micros[line].push(started.elapsed().as_secs_f64() * 1e6);
            }
            let spent = |before: Option<f64>, after: Option<f64>, sum: Option<f64>| {
                Some(sum? + after? - before?)
            };
            cpu[line] = (
                spent(client, cpu_ns("thread-self"), cpu[line].0),
                spent(server_before, cpu_ns(&server), cpu[line].1),
            );
        }
    }
    micros
        .into_iter()
        .zip(cpu)
        .map(|(mut micros, (client, server))| {
            let calls = micros.len() as f64;
            let mean = micros.iter().sum::<f64>() / calls;
            micros.sort_by(f64::total_cmp);
            let at = |q: f64| micros[((calls * q) as usize).min(micros.len() - 1)];
            Line {
                p50: at(0.5),
                p99: at(0.99),
                mean,
                client_cpu: client.map(|ns| ns / calls / 1e3),
                server_cpu: server.map(|ns| ns / calls / 1e3),
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Server time

/// rate.lua built up step by step, each step measured alone: what each part of the script adds
/// to the server's time per call. (name, source, with the key and the crate's four arguments)
const LADDER: [(&str, &str, bool); 6] = [
    ("`return 1`", BARE_LUA, false),
    ("+ a reply of four numbers", "return {1, 2, 3, 4}", false),
    (
        "+ `TIME`",
        "local clock = redis.call('TIME')\nreturn {1, 2, 3, 4}",
        false,
    ),
    (
        "+ `GET` and `SET … PX` of a key (called with the key and four arguments)",
        "local clock = redis.call('TIME')
local stored = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], '1715000000000000 0', 'PX', '1000')
return {1, 2, 3, 4}",
        true,
    ),
    (
        "+ the arguments read, the clock in µs, the stored TAT parsed, the new one formatted",
        "local rate, period = tonumber(ARGV[1]), tonumber(ARGV[2])
local burst, n = tonumber(ARGV[3]), tonumber(ARGV[4])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local us, rem = now, 0
local stored = redis.call('GET', KEYS[1])
if stored then
  us, rem = string.match(stored, '^(%d+) (%d+)$')
  us, rem = tonumber(us), tonumber(rem)
end
redis.call('SET', KEYS[1], string.format('%d %d', now + n, rem), 'PX', string.format('%d', 1000))
return {1, 2, 3, 4}",
        true,
    ),
    ("rate.lua (+ the GCRA arithmetic)", RATE_LUA, true),
];

/// One window's `INFO commandstats`: µs per `EVALSHA`, and the commands run inside it
/// (command -> (calls, µs)).
struct ServerWindow {
    per_call: f64,
    inner: BTreeMap<String, (u64, u64)>,
}

/// The script calls to time: a ladder step by `EVALSHA`, or `check()`.
enum Step {
    Script { sha: String, key: Option<String> },
    Check,
}

async fn window(
    stats: &mut MultiplexedConnection,
    callers: &mut Callers,
    step: &Step,
) -> ServerWindow {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(stats)
        .await
        .expect("CONFIG RESETSTAT");
    for _ in 0..WINDOW {
        match step {
            Step::Script { sha, key: None } => {
                evalsha(&mut callers.plain, sha, None, &[]).await;
            }
            Step::Script { sha, key } => {
                evalsha(&mut callers.plain, sha, key.as_deref(), &FAST).await;
            }
            Step::Check => callers.call(CHECK).await,
        }
    }
    let mut all = support::commandstats(stats).await;
    let (calls, usec) = all.remove("evalsha").expect("EVALSHA counted");
    assert_eq!(calls, WINDOW as u64, "nothing else ran a script");
    all.retain(|name, _| name != "info" && !name.starts_with("config"));
    ServerWindow {
        per_call: usec as f64 / calls as f64,
        inner: all,
    }
}

/// Server µs per `EVALSHA` of every ladder step and of `check()`: the median of `WINDOWS`
/// windows each, the steps taking turns.
async fn server_time(redis: &support::Redis) -> Vec<(&'static str, ServerWindow)> {
    let mut callers = Callers::new(redis).await;
    let mut stats = redis.conn().await;
    let mut steps = Vec::new();
    for (i, &(name, source, keyed)) in LADDER.iter().enumerate() {
        let sha = load(&mut callers.plain, source).await;
        let key = keyed.then(|| format!("{{ladder}}:{i}"));
        steps.push((name, Step::Script { sha, key }));
    }
    steps.push(("rate.lua by `check()`", Step::Check));
    let mut windows: Vec<Vec<ServerWindow>> = steps.iter().map(|_| Vec::new()).collect();
    for _ in 0..WINDOWS {
        for (windows, (_, step)) in windows.iter_mut().zip(&steps) {
            windows.push(window(&mut stats, &mut callers, step).await);
        }
    }
    steps
        .iter()
        .zip(windows)
        .map(|(&(name, _), mut windows)| {
            windows.sort_by(|a, b| a.per_call.total_cmp(&b.per_call));
            (name, windows.swap_remove(windows.len() / 2))
        })
        .collect()
}
