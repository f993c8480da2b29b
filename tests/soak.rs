//! Soak test: can the semaphore be caught running more holders than its limit while client
//! processes are frozen and killed, and Redis is killed and restarted?
//!
//! # Shape
//!
//! One private redis-server on a free loopback port (never 6379). Several worker OS processes
//! (this test binary run again as a child, `child_process` with role `soak`), each with
//! several tasks, share ONE semaphore. Each task loops: `acquire`; hold for a random 5-60 ms,
//! or until `Permit::lost` resolves; give the permit back (`release().await` or drop, at
//! random); on an acquire error, count it and go on after a short sleep.
//!
//! The parent injects faults until the run's end:
//! - client faults, every ~3 s (randomised): a random worker is either frozen (SIGSTOP for a
//!   random 0.2-3 s, then SIGCONT) or killed (SIGKILL) and replaced by a fresh process. Kinds
//!   come in shuffled pairs (a freeze and a kill), and so do freeze lengths (one under the
//!   lease, one over), so even a short run sees each;
//! - with Redis restarts, every ~10 s (randomised): redis-server, running with
//!   `--appendonly yes --appendfsync always`, is SIGKILLed and started again on the same port
//!   from its AOF.
//!
//! Then it stops the workers (a line on their stdin; they finish their holds and exit, and are
//! killed if they do not within a bound), reads their logs and checks them offline.
//!
//! # The logs
//!
//! Every worker process writes its own log file (a path passed by the parent), one line per
//! event, each line a single `write(2)` on an `O_APPEND` file (no user-space buffer, so lines
//! survive a SIGKILL of the writer). Times are wall clock (µs since the UNIX epoch): every
//! process shares the machine's clock.
//! - `S <task> <wall µs> <fencing token> <remaining µs> <lost 0|1>`, written after `acquire`
//!   returned `Ok`. The wall clock is read first, then `remaining()`, then `is_lost()`.
//! - `E <task> <wall µs> <lost 0|1>`, written when the task stops holding, before it releases.
//!   The wall clock is read first, then `is_lost()`.
//! - `X <task> <wall µs> <kind>` for an acquire (or release) error.
//!
//! # The counting rule
//!
//! Each hold counts over the interval in which its holder was told that it held the permit:
//! - from its START (`S`) time,
//! - to its END (`E`) time if the permit was not lost at END;
//! - to `min(END, START + remaining-at-START)` if it was lost at END: the holder was only
//!   promised its local lease deadline;
//! - to `START + remaining-at-START` if there is no END (its process was killed);
//! - not at all if the permit was already lost at START.
//!
//! Intervals are half-open. A sweep over all of them gives the largest number of simultaneous
//! holders; every stretch of time with more than `limit` of them is a violation.
//!
//! The machinery only ever shortens intervals, so it cannot invent a violation: START is
//! logged after the grant (and after whatever delay the writer suffers), END before the
//! release; reading the wall clock before `remaining()` makes `START + remaining` no later
//! than the permit's own local deadline (which the crate counts from before the granting
//! call, so never after the Redis deadline); reading the wall clock before `is_lost()` means a
//! permit not lost at the check was not lost at the logged END either. Renewals during a hold
//! are ignored (`START + remaining` undercounts a renewed lease). The only assumption is that
//! the wall clock and the monotonic clock advance at the same rate (within NTP slewing,
//! under a millisecond over a lease).
//!
//! Fencing tokens must also be unique across all holds.
//!
//! # Settings (environment variables)
//!
//! `DLIMIT_SOAK_SECS` (run length; default 20 for `soak_client_faults`, 15 for
//! `soak_redis_restarts`), `DLIMIT_SOAK_PROCS` (4), `DLIMIT_SOAK_TASKS` (8 per process),
//! `DLIMIT_SOAK_FAULTS` (1; 0 disables client faults), `DLIMIT_SOAK_REDIS_RESTARTS` (0 or 1,
//! overrides the test's default), `DLIMIT_SOAK_FAULT_EVERY_MS` (3000),
//! `DLIMIT_SOAK_RESTART_EVERY_MS` (10000), `DLIMIT_SOAK_LIMIT` (5), `DLIMIT_SOAK_LEASE_MS`
//! (1500), `DLIMIT_SOAK_ACQUIRE_TIMEOUT_MS` (5000), `DLIMIT_SOAK_CALL_TIMEOUT_MS` (300),
//! `DLIMIT_SOAK_SEED` (random), `DLIMIT_SOAK_KEEP=1` (keep the logs and the AOF; they are
//! kept anyway when the test fails). `scripts/soak` runs the long form.

mod support;

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tower_distributed_limit::{Error, RedisBackend, Semaphore};

use support::{ROLE, URL, child_role, eventually, signal};

const NAME: &str = "soak";
/// Settings the parent hands to its workers.
const W_LOG: &str = "DLIMIT_SOAK_WORKER_LOG";
const W_TASKS: &str = "DLIMIT_SOAK_WORKER_TASKS";
const W_SEED: &str = "DLIMIT_SOAK_WORKER_SEED";
const W_LIMIT: &str = "DLIMIT_SOAK_WORKER_LIMIT";
const W_LEASE_MS: &str = "DLIMIT_SOAK_WORKER_LEASE_MS";
const W_ACQUIRE_MS: &str = "DLIMIT_SOAK_WORKER_ACQUIRE_MS";
const W_CALL_MS: &str = "DLIMIT_SOAK_WORKER_CALL_MS";

/// The two soak tests take turns: each wants the machine to itself.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_client_faults() {
    let _turn = SERIAL.lock().await;
    soak(Config::from_env(20.0, false)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_redis_restarts() {
    let _turn = SERIAL.lock().await;
    soak(Config::from_env(15.0, true)).await;
}

fn wall_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_micros() as u64
}

fn env_or<T: FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(text) if !text.trim().is_empty() => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={text:?} is not a valid value")),
        _ => default,
    }
}

fn env_flag(name: &str, default: bool) -> bool {
    match std::env::var(name) {
        Ok(text) => match text.trim() {
            "" => default,
            "0" | "false" | "no" | "off" => false,
            "1" | "true" | "yes" | "on" => true,
            other => panic!("{name}={other:?}: use 0 or 1"),
        },
        Err(_) => default,
    }
}

#[derive(Debug, Clone)]
struct Config {
    secs: f64,
    procs: usize,
    tasks: usize,
    faults: bool,
    restarts: bool,
    fault_every: Duration,
    restart_every: Duration,
    limit: u32,
    lease: Duration,
    acquire_timeout: Duration,
    call_timeout: Duration,
    seed: u64,
    keep: bool,
}

impl Config {
    fn from_env(secs: f64, restarts: bool) -> Config {
        let ms = |name, default| Duration::from_millis(env_or(name, default));
        Config {
            secs: env_or("DLIMIT_SOAK_SECS", secs),
            procs: env_or("DLIMIT_SOAK_PROCS", 4),
            tasks: env_or("DLIMIT_SOAK_TASKS", 8),
            faults: env_flag("DLIMIT_SOAK_FAULTS", true),
            restarts: env_flag("DLIMIT_SOAK_REDIS_RESTARTS", restarts),
            fault_every: ms("DLIMIT_SOAK_FAULT_EVERY_MS", 3000),
            restart_every: ms("DLIMIT_SOAK_RESTART_EVERY_MS", 10_000),
            limit: env_or("DLIMIT_SOAK_LIMIT", 5),
            lease: ms("DLIMIT_SOAK_LEASE_MS", 1500),
            acquire_timeout: ms("DLIMIT_SOAK_ACQUIRE_TIMEOUT_MS", 5000),
            call_timeout: ms("DLIMIT_SOAK_CALL_TIMEOUT_MS", 300),
            seed: env_or(
                "DLIMIT_SOAK_SEED",
                wall_us() ^ u64::from(std::process::id()),
            ),
            keep: env_flag("DLIMIT_SOAK_KEEP", false),
        }
    }
}

/// A random duration around `mean`: uniform in [mean/2, 3·mean/2].
fn around(rng: &mut fastrand::Rng, mean: Duration) -> Duration {
    let mean = mean.as_millis() as u64;
    Duration::from_millis(rng.u64(mean / 2..=mean + mean / 2))
}

// ---------------------------------------------------------------------------------------
// The worker process
// ---------------------------------------------------------------------------------------

/// The body of the worker processes; a no-op unless started by the soak test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the soak tests"]
async fn child_process() {
    let Some((role, url)) = child_role() else {
        return;
    };
    assert_eq!(role, "soak", "unknown role");
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let num = |name: &str| -> u64 { var(name).parse().expect("a number") };
    let log = Arc::new(Log::open(Path::new(&var(W_LOG))));
    let tasks = num(W_TASKS) as usize;
    let mut rng = fastrand::Rng::with_seed(num(W_SEED));

    // The parent writes a line (or closes our stdin, e.g. when it dies) to stop us.
    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(async move {
        let mut line = String::new();
        let _ = BufReader::new(tokio::io::stdin())
            .read_line(&mut line)
            .await;
        let _ = stop_tx.send(true);
        // Keep the sender: the tasks read a dropped sender as "stop" too, which is the same.
        std::future::pending::<()>().await;
    });

    // Redis may be down right now (restarting): try again until it answers, or until stopped.
    let call = Duration::from_millis(num(W_CALL_MS));
    let backend = loop {
        let connect = RedisBackend::builder(url.as_str())
            .call_timeout(call)
            .connect_timeout(call)
            .connect();
        match connect.await {
            Ok(backend) => break backend,
            Err(e) => log.line(&format!("X - {} connect:{}", wall_us(), kind(&e))),
        }
        let mut stop = stop.clone();
        tokio::select! {
            _ = sleep(Duration::from_millis(100)) => {}
            _ = stopped(&mut stop) => return,
        }
    };
    let sem = Semaphore::builder(NAME)
        .limit(num(W_LIMIT) as u32)
        .lease(Duration::from_millis(num(W_LEASE_MS)))
        .acquire_timeout(Duration::from_millis(num(W_ACQUIRE_MS)))
        .build(backend)
        .unwrap();

    let handles: Vec<_> = (0..tasks)
        .map(|id| {
            let rng = rng.fork();
            tokio::spawn(task(id, sem.clone(), log.clone(), rng, stop.clone()))
        })
        .collect();
    let mut stop_wait = stop.clone();
    stopped(&mut stop_wait).await;
    // Holds are at most 60 ms and every call is bounded; the parent kills us after its own
    // bound anyway.
    let _ = timeout(Duration::from_secs(5), async {
        for handle in handles {
            let _ = handle.await;
        }
    })
    .await;
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

fn kind(error: &Error) -> &'static str {
    match error {
        Error::Timeout { .. } => "timeout",
        Error::Backend(_) => "backend",
        Error::TooManyWaiters { .. } => "too_many_waiters",
        Error::Config(_) => "config",
        Error::LeaseLost => "lease_lost",
        _ => "other",
    }
}

async fn task(
    id: usize,
    sem: Semaphore,
    log: Arc<Log>,
    mut rng: fastrand::Rng,
    mut stop: watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        let acquired = tokio::select! {
            acquired = sem.acquire() => acquired,
            _ = stopped(&mut stop) => break,
        };
        match acquired {
            Ok(mut permit) => {
                // Wall clock first, then what the permit says (see the counting rule).
                let start = wall_us();
                let remaining = permit.remaining();
                let lost = permit.is_lost();
                log.line(&format!(
                    "S {id} {start} {} {} {}",
                    permit.fencing_token(),
                    remaining.as_micros(),
                    u8::from(lost)
                ));
                let hold = Duration::from_millis(rng.u64(5..=60));
                tokio::select! {
                    _ = sleep(hold) => {}
                    _ = permit.lost() => {}
                }
                let end = wall_us();
                let lost = permit.is_lost();
                log.line(&format!("E {id} {end} {}", u8::from(lost)));
                if rng.bool() {
                    if let Err(e) = permit.release().await {
                        log.line(&format!("X {id} {} release:{}", wall_us(), kind(&e)));
                    }
                } else {
                    drop(permit);
                }
            }
            Err(e) => {
                log.line(&format!("X {id} {} {}", wall_us(), kind(&e)));
                tokio::select! {
                    _ = sleep(Duration::from_millis(rng.u64(10..=100))) => {}
                    _ = stopped(&mut stop) => break,
                }
            }
        }
    }
}

/// One worker's log: each line one `write(2)` on an append-only file, so it reaches the kernel
/// at once and survives a SIGKILL.
struct Log(Mutex<std::fs::File>);

impl Log {
    fn open(path: &Path) -> Log {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        Log(Mutex::new(file))
    }

    fn line(&self, line: &str) {
        let mut file = self.0.lock().unwrap_or_else(|e| e.into_inner());
        file.write_all(format!("{line}\n").as_bytes())
            .expect("write the worker log");
    }
}

// ---------------------------------------------------------------------------------------
// The parent: processes and faults
// ---------------------------------------------------------------------------------------

/// A scratch directory for the logs and the AOF; removed when dropped, unless the test failed
/// (panicking) or `DLIMIT_SOAK_KEEP=1`.
struct Scratch {
    path: PathBuf,
    keep: bool,
}

impl Scratch {
    fn new(keep: bool) -> Scratch {
        let path =
            std::env::temp_dir().join(format!("dlimit-soak-{}-{}", std::process::id(), wall_us()));
        std::fs::create_dir_all(&path).expect("create the scratch directory");
        Scratch { path, keep }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.keep || std::thread::panicking() {
            eprintln!("soak: logs kept in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// A private redis-server, SIGKILLed when dropped.
struct RedisProc {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    persist: bool,
    url: String,
}

fn free_port() -> u16 {
    loop {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = listener.local_addr().unwrap().port();
        if port != 6379 {
            return port;
        }
    }
}

impl RedisProc {
    async fn start(dir: &Path, persist: bool) -> RedisProc {
        let port = free_port();
        let mut redis = RedisProc {
            child: None,
            port,
            dir: dir.to_owned(),
            persist,
            url: format!("redis://127.0.0.1:{port}"),
        };
        redis.spawn().await;
        redis
    }

    /// Starts redis-server on our port (loading the AOF, if any) and waits for PING.
    async fn spawn(&mut self) {
        let bin = std::env::var("REDISRS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let mut cmd = Command::new(bin);
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", ""])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"));
        if self.persist {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        let url = self.url.clone();
        eventually(
            Duration::from_secs(10),
            "redis-server to answer PING",
            || ping(&url),
        )
        .await;
    }

    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = timeout(Duration::from_secs(5), child.wait()).await;
        }
    }
}

async fn ping(url: &str) -> bool {
    let attempt = async {
        let client = redis::Client::open(url).ok()?;
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .ok()
    };
    matches!(timeout(Duration::from_secs(1), attempt).await, Ok(Some(_)))
}

struct Worker {
    label: String,
    slot: usize,
    incarnation: usize,
    child: Child,
}

struct Fleet<'a> {
    config: &'a Config,
    dir: PathBuf,
    url: String,
    workers: Vec<Worker>,
    /// Workers that exited without being told to (label, status).
    unexpected: Vec<String>,
}

impl Fleet<'_> {
    fn spawn(&self, slot: usize, incarnation: usize) -> Worker {
        let label = format!("w{slot}.{incarnation}");
        let log = self.dir.join(format!("{label}.log"));
        let seed = self.config.seed ^ (((slot as u64) << 32) | incarnation as u64);
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "child_process", "--nocapture"])
            .env(ROLE, "soak")
            .env(URL, &self.url)
            .env(W_LOG, &log)
            .env(W_TASKS, self.config.tasks.to_string())
            .env(W_SEED, seed.to_string())
            .env(W_LIMIT, self.config.limit.to_string())
            .env(W_LEASE_MS, self.config.lease.as_millis().to_string())
            .env(
                W_ACQUIRE_MS,
                self.config.acquire_timeout.as_millis().to_string(),
            )
            .env(W_CALL_MS, self.config.call_timeout.as_millis().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the test binary as a worker");
        Worker {
            label,
            slot,
            incarnation,
            child,
        }
    }

    fn check_exits(&mut self) {
        for worker in &mut self.workers {
            if let Ok(Some(status)) = worker.child.try_wait() {
                let seen = format!("{} ({status})", worker.label);
                if !self.unexpected.contains(&seen) {
                    self.unexpected.push(seen);
                }
            }
        }
    }

    /// Tells every worker to stop, waits a bounded time for them to finish their holds, and
    /// kills what is left.
    async fn stop(&mut self) {
        for worker in &mut self.workers {
            if let Some(pid) = worker.child.id() {
                signal(pid, "CONT");
            }
            if let Some(mut stdin) = worker.child.stdin.take() {
                let _ = stdin.write_all(b"stop\n").await;
                let _ = stdin.flush().await;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        for worker in &mut self.workers {
            match tokio::time::timeout_at(deadline, worker.child.wait()).await {
                Ok(Ok(status)) if status.success() => {}
                Ok(status) => self
                    .unexpected
                    .push(format!("{} stopped badly ({status:?})", worker.label)),
                Err(_) => {
                    self.unexpected
                        .push(format!("{} did not stop in time; killed", worker.label));
                    let _ = worker.child.start_kill();
                    let _ = timeout(Duration::from_secs(5), worker.child.wait()).await;
                }
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum FaultKind {
    Freeze,
    Kill,
    RedisRestart,
}

#[derive(Debug, Clone)]
struct Fault {
    kind: FaultKind,
    /// The process it hit (empty for Redis).
    target: String,
    /// SIGSTOP / SIGKILL sent.
    at: u64,
    /// SIGCONT sent / replacement started / Redis answering again.
    until: u64,
}

/// Client faults until `end`: freeze or kill a random worker every ~`fault_every`.
async fn client_faults(
    fleet: &Mutex<Fleet<'_>>,
    end: Instant,
    rng: &mut fastrand::Rng,
) -> Vec<Fault> {
    let mut faults = Vec::new();
    let every = fleet.lock().unwrap().config.fault_every;
    // Freezes and kills come in pairs, in random order, so a short run gets both.
    let mut bag: Vec<FaultKind> = Vec::new();
    // Freezes likewise alternate, in random order, between shorter and longer than the lease
    // (both within 0.2-3 s): only a freeze past the lease lets others take a frozen slot.
    let lease = fleet.lock().unwrap().config.lease.as_millis() as u64;
    let split = lease.clamp(201, 2999);
    let mut lengths: Vec<bool> = Vec::new();
    loop {
        let next = Instant::now() + around(rng, every);
        if next >= end {
            break;
        }
        sleep_until(next).await;
        let slot = rng.usize(..fleet.lock().unwrap().workers.len());
        if bag.is_empty() {
            bag = vec![FaultKind::Freeze, FaultKind::Kill];
            rng.shuffle(&mut bag);
        }
        if bag.pop() == Some(FaultKind::Freeze) {
            let (pid, target) = {
                let mut fleet = fleet.lock().unwrap();
                fleet.check_exits();
                let worker = &fleet.workers[slot];
                (worker.child.id(), worker.label.clone())
            };
            let Some(pid) = pid else { continue };
            if lengths.is_empty() {
                lengths = vec![false, true];
                rng.shuffle(&mut lengths);
            }
            let frozen = match lengths.pop() {
                Some(true) => rng.u64(split..=3000),
                _ => rng.u64(200..split),
            };
            let frozen = Duration::from_millis(frozen);
            let at = wall_us();
            signal(pid, "STOP");
            sleep(frozen).await;
            signal(pid, "CONT");
            faults.push(Fault {
                kind: FaultKind::Freeze,
                target,
                at,
                until: wall_us(),
            });
        } else {
            let (mut old, at) = {
                let mut fleet = fleet.lock().unwrap();
                fleet.check_exits();
                let (slot, incarnation) = {
                    let w = &fleet.workers[slot];
                    (w.slot, w.incarnation)
                };
                let at = wall_us();
                let _ = fleet.workers[slot].child.start_kill();
                let fresh = fleet.spawn(slot, incarnation + 1);
                (std::mem::replace(&mut fleet.workers[slot], fresh), at)
            };
            // The replacement was started right after the kill, above.
            let until = wall_us();
            let _ = timeout(Duration::from_secs(5), old.child.wait()).await;
            faults.push(Fault {
                kind: FaultKind::Kill,
                target: old.label.clone(),
                at,
                until,
            });
        }
    }
    faults
}

/// Redis restarts until `end`: SIGKILL, then start again on the same port from the AOF.
async fn redis_restarts(
    redis: &mut RedisProc,
    every: Duration,
    end: Instant,
    rng: &mut fastrand::Rng,
) -> Vec<Fault> {
    let mut faults = Vec::new();
    loop {
        let next = Instant::now() + around(rng, every);
        if next >= end {
            break;
        }
        sleep_until(next).await;
        let at = wall_us();
        redis.kill().await;
        redis.spawn().await;
        faults.push(Fault {
            kind: FaultKind::RedisRestart,
            target: String::new(),
            at,
            until: wall_us(),
        });
    }
    faults
}

// ---------------------------------------------------------------------------------------
// The parent: the run and the offline check
// ---------------------------------------------------------------------------------------

async fn soak(config: Config) {
    let scratch = Scratch::new(config.keep);
    let mut redis = RedisProc::start(&scratch.path, config.restarts).await;
    let fleet = Fleet {
        config: &config,
        dir: scratch.path.clone(),
        url: redis.url.clone(),
        workers: Vec::new(),
        unexpected: Vec::new(),
    };
    let fleet = Mutex::new(fleet);
    {
        let mut fleet = fleet.lock().unwrap();
        let workers = (0..config.procs).map(|slot| fleet.spawn(slot, 0)).collect();
        fleet.workers = workers;
    }
    let t0 = wall_us();
    let started = Instant::now();
    let end = started + Duration::from_secs_f64(config.secs);
    let mut rng = fastrand::Rng::with_seed(config.seed);
    let mut client_rng = rng.fork();
    let mut redis_rng = rng.fork();

    let clients = async {
        if config.faults {
            client_faults(&fleet, end, &mut client_rng).await
        } else {
            sleep_until(end).await;
            Vec::new()
        }
    };
    let server = async {
        if config.restarts {
            redis_restarts(&mut redis, config.restart_every, end, &mut redis_rng).await
        } else {
            Vec::new()
        }
    };
    let (mut faults, restarts) = tokio::join!(clients, server);
    sleep_until(end).await;
    faults.extend(restarts);
    let mut fleet = fleet.into_inner().unwrap();
    fleet.check_exits();
    let elapsed = started.elapsed();
    fleet.stop().await;
    redis.kill().await;

    let report = analyse(&config, &scratch.path, &faults, t0);
    let unexpected = std::mem::take(&mut fleet.unexpected);
    drop(fleet);

    let count = |kind| faults.iter().filter(|f| f.kind == kind).count();
    let summary = format!(
        "soak summary: {:.1} s, {} procs x {} tasks, limit {}, lease {:?} | holds {} ({:.1}/s; \
         lost at START {}, lost at END {}, no END {}) | faults: {} freezes, {} kills, {} redis \
         restarts | acquire errors: {} | max concurrent {} | violations {} (worst {}, {:.1} ms \
         over the limit in all) | duplicate tokens {} | grants older than a lease at START {} | seed {}",
        elapsed.as_secs_f64(),
        config.procs,
        config.tasks,
        config.limit,
        config.lease,
        report.holds,
        report.holds as f64 / elapsed.as_secs_f64(),
        report.lost_at_start,
        report.lost_at_end,
        report.unended,
        count(FaultKind::Freeze),
        count(FaultKind::Kill),
        count(FaultKind::RedisRestart),
        report.errors,
        report.max_concurrent,
        report.violations,
        report.worst,
        report.over_limit_us as f64 / 1000.0,
        report.duplicate_tokens,
        report.stale_grants,
        config.seed,
    );
    println!("{}{summary}", report.details);
    let _ = std::fs::write(
        scratch.path.join("report.txt"),
        format!("{}{summary}\n", report.details),
    );

    assert!(
        unexpected.is_empty(),
        "workers exited on their own or did not stop: {unexpected:?}"
    );
    let floor = (config.secs * 5.0) as usize;
    assert!(
        report.holds >= floor,
        "only {} holds in {:.1} s (expected at least {floor}): the workers did not work",
        report.holds,
        config.secs
    );
    assert_eq!(
        report.duplicate_tokens, 0,
        "fencing tokens were handed out twice"
    );
    assert_eq!(
        report.violations, 0,
        "more than {} holders at once: {} violations, up to {} holders (seed {})",
        config.limit, report.violations, report.worst, config.seed
    );
}

#[derive(Debug, Clone)]
struct Hold {
    process: String,
    task: u64,
    token: u64,
    start: u64,
    remaining: u64,
    lost_at_start: bool,
    end: Option<(u64, bool)>,
}

impl Hold {
    /// The end of the interval the holder was told it held (see the counting rule); `None`
    /// if it counts for nothing.
    fn until(&self) -> Option<u64> {
        if self.lost_at_start {
            return None;
        }
        let promised = self.start + self.remaining;
        Some(match self.end {
            None => promised,
            Some((end, false)) => end,
            Some((end, true)) => end.min(promised),
        })
    }
}

struct Report {
    holds: usize,
    lost_at_start: usize,
    lost_at_end: usize,
    unended: usize,
    errors: String,
    max_concurrent: usize,
    violations: usize,
    worst: usize,
    over_limit_us: u64,
    duplicate_tokens: usize,
    stale_grants: usize,
    details: String,
}

fn read_logs(dir: &Path) -> (Vec<Hold>, HashMap<String, usize>, usize) {
    let mut holds = Vec::new();
    let mut errors: HashMap<String, usize> = HashMap::new();
    let mut malformed = 0;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read the scratch directory")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.file_name().unwrap().to_string_lossy().starts_with('w'))
        .filter(|path| path.extension().is_some_and(|ext| ext == "log"))
        .collect();
    files.sort();
    for path in files {
        let process = path.file_stem().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).expect("read a worker log");
        let mut open: HashMap<u64, Hold> = HashMap::new();
        for line in text.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let num = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
            match (fields.first().copied(), fields.len()) {
                (Some("S"), 6) => {
                    let (Some(task), Some(start), Some(token), Some(remaining), Some(lost)) =
                        (num(1), num(2), num(3), num(4), num(5))
                    else {
                        malformed += 1;
                        continue;
                    };
                    let hold = Hold {
                        process: process.clone(),
                        task,
                        token,
                        start,
                        remaining,
                        lost_at_start: lost == 1,
                        end: None,
                    };
                    if let Some(unended) = open.insert(task, hold) {
                        // A task holds one permit at a time: cannot happen.
                        malformed += 1;
                        holds.push(unended);
                    }
                }
                (Some("E"), 4) => {
                    let (Some(task), Some(end), Some(lost)) = (num(1), num(2), num(3)) else {
                        malformed += 1;
                        continue;
                    };
                    match open.remove(&task) {
                        Some(mut hold) => {
                            hold.end = Some((end, lost == 1));
                            holds.push(hold);
                        }
                        None => malformed += 1,
                    }
                }
                (Some("X"), 4) => *errors.entry(fields[3].to_owned()).or_default() += 1,
                _ => malformed += 1,
            }
        }
        holds.extend(open.into_values());
    }
    (holds, errors, malformed)
}

struct Episode {
    from: u64,
    to: u64,
    worst: usize,
    at_worst: Vec<usize>,
}

fn analyse(config: &Config, dir: &Path, faults: &[Fault], t0: u64) -> Report {
    let (holds, errors, malformed) = read_logs(dir);
    let limit = config.limit as usize;

    // The sweep: ends before starts at the same instant (half-open intervals).
    let mut events: Vec<(u64, i8, usize)> = Vec::new();
    for (i, hold) in holds.iter().enumerate() {
        if let Some(until) = hold.until().filter(|&until| until > hold.start) {
            events.push((hold.start, 1, i));
            events.push((until, -1, i));
        }
    }
    events.sort_unstable();
    let mut active: BTreeSet<usize> = BTreeSet::new();
    let mut max_concurrent = 0;
    let mut episodes: Vec<Episode> = Vec::new();
    let mut open: Option<Episode> = None;
    for &(at, delta, i) in &events {
        if delta > 0 {
            active.insert(i);
        } else {
            active.remove(&i);
        }
        max_concurrent = max_concurrent.max(active.len());
        if active.len() > limit {
            let episode = open.get_or_insert_with(|| Episode {
                from: at,
                to: at,
                worst: 0,
                at_worst: Vec::new(),
            });
            if active.len() > episode.worst {
                episode.worst = active.len();
                episode.at_worst = active.iter().copied().collect();
            }
        } else if let Some(mut episode) = open.take() {
            episode.to = at;
            episodes.push(episode);
        }
    }

    // The README documents a fencing token as max(last + 1, Redis time in µs), so a token far
    // older than START means the grant was made long before the holder heard of it. Reported,
    // not asserted: the counting rule above is the check.
    let stale_grants = holds
        .iter()
        .filter(|hold| hold.start.saturating_sub(hold.token) > config.lease.as_micros() as u64)
        .count();
    let mut tokens: Vec<u64> = holds.iter().map(|hold| hold.token).collect();
    tokens.sort_unstable();
    let duplicate_tokens = tokens.windows(2).filter(|w| w[0] == w[1]).count();

    let rel = |t: u64| (t as f64 - t0 as f64) / 1000.0;
    // A fencing token is max(last + 1, Redis time in µs): here, about when it was granted.
    let mut details = String::new();
    let _ = writeln!(
        details,
        "soak: {} holds, {} malformed log lines; times below in ms since the start",
        holds.len(),
        malformed
    );
    for fault in faults {
        let _ = writeln!(
            details,
            "  fault {:?} {} at {:.1} .. {:.1}",
            fault.kind,
            fault.target,
            rel(fault.at),
            rel(fault.until)
        );
    }
    for (n, episode) in episodes.iter().take(5).enumerate() {
        let _ = writeln!(
            details,
            "violation {}: {} holders at once (limit {}), over the limit {:.1} .. {:.1}; holders at the worst moment:",
            n + 1,
            episode.worst,
            limit,
            rel(episode.from),
            rel(episode.to)
        );
        let mut at_worst = episode.at_worst.clone();
        at_worst.sort_by_key(|&i| holds[i].start);
        for i in at_worst {
            let hold = &holds[i];
            let end = match hold.end {
                Some((end, lost)) => format!("END {:.1} lost={lost}", rel(end)),
                None => "no END (killed)".to_owned(),
            };
            let _ = writeln!(
                details,
                "    {} task {} token {} (~{:.1} ms before START): START {:.1}, remaining {:.1} ms, \
                 {end}, counted until {:.1}{}",
                hold.process,
                hold.task,
                hold.token,
                (hold.start as f64 - hold.token as f64) / 1000.0,
                rel(hold.start),
                hold.remaining as f64 / 1000.0,
                rel(hold.until().unwrap_or(hold.start)),
                context(hold, faults)
            );
        }
    }
    if episodes.len() > 5 {
        let _ = writeln!(details, "... and {} more violations", episodes.len() - 5);
    }

    let mut errors: Vec<(String, usize)> = errors.into_iter().collect();
    errors.sort();
    let errors = if errors.is_empty() {
        "none".to_owned()
    } else {
        errors
            .iter()
            .map(|(kind, n)| format!("{n} {kind}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Report {
        holds: holds.len(),
        lost_at_start: holds.iter().filter(|h| h.lost_at_start).count(),
        lost_at_end: holds
            .iter()
            .filter(|h| matches!(h.end, Some((_, true))))
            .count(),
        unended: holds.iter().filter(|h| h.end.is_none()).count(),
        errors,
        max_concurrent,
        violations: episodes.len(),
        worst: episodes.iter().map(|e| e.worst).max().unwrap_or(0),
        over_limit_us: episodes.iter().map(|e| e.to - e.from).sum(),
        duplicate_tokens,
        stale_grants,
        details,
    }
}

/// What happened to the hold's process (and to Redis) shortly before it started.
fn context(hold: &Hold, faults: &[Fault]) -> String {
    let mut notes = String::new();
    let last = |kind: FaultKind| {
        faults
            .iter()
            .filter(|f| f.kind == kind && f.at <= hold.start)
            .filter(|f| kind == FaultKind::RedisRestart || f.target == hold.process)
            .max_by_key(|f| f.at)
    };
    if let Some(freeze) = last(FaultKind::Freeze) {
        if freeze.until <= hold.start {
            let _ = write!(
                notes,
                "; SIGCONT {:.1} ms before START, after {:.0} ms frozen",
                (hold.start - freeze.until) as f64 / 1000.0,
                (freeze.until - freeze.at) as f64 / 1000.0
            );
        } else {
            // The wall clock was read during the freeze: START is logged after SIGCONT.
            let _ = write!(notes, "; START during a freeze (read just before SIGSTOP)");
        }
    }
    if let Some(restart) = last(FaultKind::RedisRestart) {
        let _ = write!(
            notes,
            "; redis restarted {:.1} ms before START",
            (hold.start - restart.at) as f64 / 1000.0
        );
    }
    notes
}
