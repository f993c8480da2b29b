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
//! - `X <task> <wall µs> <kind>` for an acquire (or release) error. A `backend` error's kind
//!   says which, from the library's message: `backend:timeout`, `backend:down`,
//!   `backend:dropped`, `backend:refused`, `backend:wait` (too few replicas acknowledged),
//!   `backend:rejected` (a server error reply, e.g. `READONLY`), `backend:sentinel`,
//!   `backend:other`.
//! - `M <kind> <message>` the first time a process sees an error of a kind: the library's
//!   message, shown in the report.
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
//! Fencing tokens must also be unique across all holds (with `DLIMIT_SOAK_PREFETCH`, across
//! processes and overlapping holds: a prefetched slot is handed out again with its token).
//!
//! # Topologies
//!
//! `DLIMIT_SOAK_TOPOLOGY` picks the servers of `soak_topology` (ignored in the normal run:
//! `scripts/soak --sentinel` / `--cluster` runs it); `soak_client_faults` and
//! `soak_redis_restarts` always use `single`:
//! - `single` (the default): the one redis-server above;
//! - `sentinel`: one master and two replicas (each from a config file of its own, which the
//!   sentinels rewrite), watched by three sentinels as `master0` (quorum 2,
//!   `down-after-milliseconds` 1000, `failover-timeout` 2000). Workers connect with
//!   `RedisBackend::sentinel_builder`. Redis faults every ~8 s, in shuffled rounds of three:
//!   SIGKILL the current master and start it again ~3-4 s later (once the sentinels named a
//!   new one) from its config file, empty, on the same port: it comes back as a master and is
//!   turned into a replica by the sentinels some seconds later; SIGSTOP the master for 3-4 s,
//!   then SIGCONT (a deposed master that wakes up still writable); `SENTINEL FAILOVER
//!   master0` sent to a random sentinel;
//! - `cluster`: three masters and three replicas (`cluster-node-timeout` 1000,
//!   `cluster-replica-validity-factor 0`), made with `redis-cli --cluster create`. Workers
//!   connect with `RedisBackend::cluster_builder` and every node's URL. The same three faults,
//!   on a master that is, two times out of three, the one owning the semaphore's slot: SIGKILL
//!   (restarted empty ~3-4 s later, once its replica took over; it rejoins as a replica from
//!   its `nodes.conf`), SIGSTOP for 3-4 s, and `CLUSTER FAILOVER` sent to its replica.
//!
//! Each Redis fault is in the report's timeline with the master before and after it and how
//! long the switch took; the summary counts the faults of each kind and the failovers seen
//! (`+switch-master` lines in a sentinel's log; `Failover election won` lines in the cluster
//! nodes' logs). Client faults go on as above. `DLIMIT_SOAK_WAIT=1` makes every worker use
//! `wait_for_replicas(1, DLIMIT_SOAK_WAIT_MS)` (100 ms). Before any worker starts, the parent
//! builds a backend with the workers' settings: one refused with `Error::Config` (e.g.
//! `wait_for_replicas` on a Cluster, on a version that does not support it) fails the soak
//! at once with the library's message.
//!
//! The counting rule is the same for every topology: all holds, whichever server granted them.
//!
//! Every redis-server, sentinel and worker is SIGKILLed when the test ends or panics; a
//! watchdog shell started with the test kills those still listed (checked by start time, so
//! never a recycled pid) if the test process itself is killed.
//!
//! # Settings (environment variables)
//!
//! `DLIMIT_SOAK_SECS` (run length; default 20 for `soak_client_faults`, 15 for
//! `soak_redis_restarts`, 30 for `soak_topology`), `DLIMIT_SOAK_PROCS` (4), `DLIMIT_SOAK_TASKS`
//! (8 per process), `DLIMIT_SOAK_FAULTS` (1; 0 disables client faults), `DLIMIT_SOAK_REDIS_RESTARTS`
//! (0 or 1, overrides the test's default; `single` only), `DLIMIT_SOAK_FAULT_EVERY_MS` (3000),
//! `DLIMIT_SOAK_RESTART_EVERY_MS` (10000), `DLIMIT_SOAK_TOPOLOGY` (`single`, `sentinel` or
//! `cluster`; `soak_topology` only), `DLIMIT_SOAK_REDIS_FAULTS` (the Sentinel and Cluster
//! faults; defaults to `DLIMIT_SOAK_FAULTS`, so `DLIMIT_SOAK_FAULTS=0` is a baseline with no
//! fault at all), `DLIMIT_SOAK_REDIS_FAULT_EVERY_MS` (8000), `DLIMIT_SOAK_WAIT` (0),
//! `DLIMIT_SOAK_WAIT_MS` (100), `DLIMIT_SOAK_LIMIT` (5), `DLIMIT_SOAK_PREFETCH` (0: slots each
//! worker prefetches), `DLIMIT_SOAK_LEASE_MS`
//! (1500), `DLIMIT_SOAK_ACQUIRE_TIMEOUT_MS` (5000), `DLIMIT_SOAK_CALL_TIMEOUT_MS` (300),
//! `DLIMIT_SOAK_SEED` (random), `DLIMIT_SOAK_KEEP=1` (keep the logs and the AOF; they are
//! kept anyway when the test fails). `scripts/soak` runs the long form.

mod support;

use std::collections::{BTreeSet, HashMap, HashSet};
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
use tower_distributed_limit::{Error, RedisBackend, RedisBackendBuilder, Semaphore};

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
const W_TOPOLOGY: &str = "DLIMIT_SOAK_WORKER_TOPOLOGY";
/// The `wait_for_replicas` timeout in ms; 0 for none.
const W_WAIT_MS: &str = "DLIMIT_SOAK_WORKER_WAIT_MS";
/// `SemaphoreBuilder::prefetch`; 0 for none.
const W_PREFETCH: &str = "DLIMIT_SOAK_WORKER_PREFETCH";
/// The master name the sentinels watch.
const MASTER: &str = "master0";

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

/// A rolling deploy, upgrading: workers of the earlier build of `tests/compat/BASE` hold and
/// wait on the semaphore first, then this build's join, and the client faults go on (freezes,
/// kills and restarts of either build). Never above the limit, every call answered, meta
/// bounded, both builds served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_in_a_rolling_deploy_keeps_the_limit() {
    let _turn = SERIAL.lock().await;
    let mut config = Config::from_env(15.0, false);
    config.base = Some(base_build().await);
    config.base_first = true;
    soak(config).await;
}

/// The same the other way: this build's workers first, the earlier build's joining (a rollback).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_in_a_rolling_deploy_keeps_the_limit() {
    let _turn = SERIAL.lock().await;
    let mut config = Config::from_env(15.0, false);
    config.base = Some(base_build().await);
    soak(config).await;
}

/// The soak test binary of the commit `tests/compat/BASE` names, built once (in a worktree under
/// `target/compat/`, with a target directory of its own) for every test of this run.
async fn base_build() -> PathBuf {
    static BUILT: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    BUILT
        .get_or_init(|| async {
            tokio::task::spawn_blocking(build_base)
                .await
                .expect("the build of the earlier version")
        })
        .await
        .clone()
}

fn build_base() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let commit = std::fs::read_to_string(root.join("tests/compat/BASE"))
        .expect("tests/compat/BASE names the earlier commit");
    let commit = commit.trim();
    let compat = root.join("target/compat");
    let tree = compat.join(commit);
    let run = |command: &mut std::process::Command, what: &str| {
        let output = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(
            output.status.success(),
            "{what} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        output.stdout
    };
    if !tree.join("Cargo.toml").exists() {
        let git = || {
            let mut git = std::process::Command::new("git");
            git.current_dir(root);
            git
        };
        // (A worktree whose folder was deleted is still registered until pruned.)
        run(git().args(["worktree", "prune"]), "git worktree prune");
        run(
            git()
                .args(["worktree", "add", "--force", "--detach"])
                .arg(&tree)
                .arg(commit),
            &format!("git worktree add of {commit} (CI's clone has the history)"),
        );
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = run(
        std::process::Command::new(cargo)
            .current_dir(&tree)
            .env("CARGO_TARGET_DIR", compat.join("target"))
            .args([
                "test",
                "--test",
                "soak",
                "--no-run",
                "--message-format=json",
            ]),
        &format!("the build of {commit}'s soak test"),
    );
    // The test binary is the artifact with an executable (cargo's JSON messages, one a line).
    String::from_utf8_lossy(&out)
        .lines()
        .filter(|line| {
            line.contains("\"reason\":\"compiler-artifact\"") && line.contains("\"soak\"")
        })
        .find_map(|line| {
            let (_, rest) = line.split_once("\"executable\":\"")?;
            Some(PathBuf::from(rest.split_once('"')?.0))
        })
        .expect("cargo named the soak test binary of the earlier build")
}

/// The soak on the topology `DLIMIT_SOAK_TOPOLOGY` names (see the module docs): long, and
/// with a Sentinel or Cluster of its own, so not part of the normal run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: run by scripts/soak --sentinel / --cluster (DLIMIT_SOAK_TOPOLOGY)"]
async fn soak_topology() {
    let _turn = SERIAL.lock().await;
    let mut config = Config::from_env(30.0, false);
    config.topology = env_or("DLIMIT_SOAK_TOPOLOGY", Topology::Single);
    soak(config).await;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Topology {
    Single,
    Sentinel,
    Cluster,
}

impl FromStr for Topology {
    type Err = String;

    fn from_str(text: &str) -> Result<Topology, String> {
        match text {
            "single" => Ok(Topology::Single),
            "sentinel" => Ok(Topology::Sentinel),
            "cluster" => Ok(Topology::Cluster),
            other => Err(format!("{other:?}: use single, sentinel or cluster")),
        }
    }
}

impl Topology {
    fn name(self) -> &'static str {
        match self {
            Topology::Single => "single",
            Topology::Sentinel => "sentinel",
            Topology::Cluster => "cluster",
        }
    }
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
    /// Slots each worker prefetches (`SemaphoreBuilder::prefetch`).
    prefetch: u32,
    lease: Duration,
    acquire_timeout: Duration,
    call_timeout: Duration,
    seed: u64,
    keep: bool,
    topology: Topology,
    /// `wait_for_replicas(1, this)` in every worker.
    wait: Option<Duration>,
    /// Sentinel and Cluster faults (not `single`: see `restarts`).
    redis_faults: bool,
    redis_fault_every: Duration,
    /// A test binary of an earlier build (`tests/compat/BASE`): the odd slots' workers run it.
    base: Option<PathBuf>,
    /// With `base`: its workers start a second before this build's (else after).
    base_first: bool,
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
            prefetch: env_or("DLIMIT_SOAK_PREFETCH", 0),
            lease: ms("DLIMIT_SOAK_LEASE_MS", 1500),
            acquire_timeout: ms("DLIMIT_SOAK_ACQUIRE_TIMEOUT_MS", 5000),
            call_timeout: ms("DLIMIT_SOAK_CALL_TIMEOUT_MS", 300),
            seed: env_or(
                "DLIMIT_SOAK_SEED",
                wall_us() ^ u64::from(std::process::id()),
            ),
            keep: env_flag("DLIMIT_SOAK_KEEP", false),
            topology: Topology::Single,
            wait: env_flag("DLIMIT_SOAK_WAIT", false).then(|| ms("DLIMIT_SOAK_WAIT_MS", 100)),
            redis_faults: env_flag(
                "DLIMIT_SOAK_REDIS_FAULTS",
                env_flag("DLIMIT_SOAK_FAULTS", true),
            ),
            redis_fault_every: ms("DLIMIT_SOAK_REDIS_FAULT_EVERY_MS", 8000),
            base: None,
            base_first: false,
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
    let topology: Topology = var(W_TOPOLOGY).parse().unwrap();
    let wait = Some(Duration::from_millis(num(W_WAIT_MS))).filter(|wait| !wait.is_zero());
    let urls: Vec<String> = url.split(',').map(str::to_owned).collect();
    let backend = loop {
        match backend_builder(topology, &urls, call, wait).connect().await {
            Ok(backend) => break backend,
            Err(e) => {
                let kind = kind(&e);
                log.line(&format!("X - {} connect:{kind}", wall_us()));
                log.first(&format!("connect:{kind}"), &e);
                // Settings the library refuses will not work on the next try either (the
                // parent checks them before starting any worker).
                if matches!(e, Error::Config(_)) {
                    std::process::exit(3);
                }
            }
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
        .prefetch(num(W_PREFETCH) as u32)
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

/// The settings every worker connects with (the parent checks them first).
fn backend_builder(
    topology: Topology,
    urls: &[String],
    call: Duration,
    wait: Option<Duration>,
) -> RedisBackendBuilder {
    let builder = match topology {
        Topology::Single => RedisBackend::builder(urls[0].as_str()),
        Topology::Sentinel => RedisBackend::sentinel_builder(urls, MASTER),
        Topology::Cluster => RedisBackend::cluster_builder(urls),
    }
    .call_timeout(call)
    .connect_timeout(call);
    match wait {
        Some(wait) => builder.wait_for_replicas(1, wait),
        None => builder,
    }
}

fn kind(error: &Error) -> String {
    match error {
        Error::Timeout { .. } => "timeout".into(),
        Error::Backend(_) => format!("backend:{}", backend_kind(&error.to_string())),
        Error::TooManyWaiters { .. } => "too_many_waiters".into(),
        Error::Config(_) => "config".into(),
        Error::LeaseLost => "lease_lost".into(),
        _ => "other".into(),
    }
}

/// Which backend error, from the library's message (see `redis_error` and `health` in src).
fn backend_kind(message: &str) -> &'static str {
    if message.contains("acknowledged") {
        "wait"
    } else if message.contains(" is down (") {
        "down"
    } else if message.contains("did not answer") {
        "timeout"
    } else if message.contains("lost the connection") {
        "dropped"
    } else if message.contains("refused the connection") || message.contains("connection refused") {
        "refused"
    } else if message.contains("through the sentinels") {
        "sentinel"
    } else if message.contains(" rejected `") {
        "rejected"
    } else {
        "other"
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
                        let kind = kind(&e);
                        log.line(&format!("X {id} {} release:{kind}", wall_us()));
                        log.first(&format!("release:{kind}"), &e);
                    }
                } else {
                    drop(permit);
                }
            }
            Err(e) => {
                let kind = kind(&e);
                log.line(&format!("X {id} {} {kind}", wall_us()));
                log.first(&kind, &e);
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
struct Log(Mutex<std::fs::File>, Mutex<HashSet<String>>);

impl Log {
    fn open(path: &Path) -> Log {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        Log(Mutex::new(file), Mutex::new(HashSet::new()))
    }

    /// An `M` line with the message of the first error of `kind` this process saw.
    fn first(&self, kind: &str, error: &Error) {
        let new = self
            .1
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(kind.to_owned());
        if new {
            let message = error.to_string().replace(['\n', '\r'], " ");
            self.line(&format!("M {kind} {message}"));
        }
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
    pids: PathBuf,
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
    async fn start(dir: &Path, persist: bool, pids: &Path) -> RedisProc {
        let port = free_port();
        let mut redis = RedisProc {
            child: None,
            port,
            dir: dir.to_owned(),
            persist,
            url: format!("redis://127.0.0.1:{port}"),
            pids: pids.to_owned(),
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
        register(&self.pids, "redis", child.id());
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
            unregister(&self.pids, "redis");
        }
    }
}

/// Writes `<pids>/<label>.pid` (the pid and its start time) for the watchdog.
fn register(pids: &Path, label: &str, pid: Option<u32>) {
    let Some(pid) = pid else { return };
    if let Some(start) = start_time(pid) {
        let _ = std::fs::write(
            pids.join(format!("{label}.pid")),
            format!("{pid} {start}\n"),
        );
    }
}

fn unregister(pids: &Path, label: &str) {
    let _ = std::fs::remove_file(pids.join(format!("{label}.pid")));
}

/// The start time of process `pid` (field 22 of `/proc/<pid>/stat`): with the pid, it names
/// one process, never a later one that got the same pid.
fn start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    rest.split(' ').nth(19).map(str::to_owned)
}

/// A shell that waits for this test process to die and then SIGKILLs every process still
/// listed in `pids` (redis-servers, sentinels, workers) whose start time matches: for a test
/// killed with SIGKILL, whose own cleanup never runs. Killed itself when dropped (the normal
/// end, or a panic, after everything else was cleaned up).
struct Watchdog(#[allow(dead_code)] Child);

impl Watchdog {
    fn start(pids: &Path) -> Watchdog {
        const SCRIPT: &str = r#"
parent=$1; dir=$2
while kill -0 "$parent" 2>/dev/null; do sleep 0.5; done
for f in "$dir"/*.pid; do
  [ -e "$f" ] || continue
  read -r pid start < "$f" || continue
  now=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f20)
  if [ -n "$now" ] && [ "$now" = "$start" ]; then kill -9 "$pid" 2>/dev/null; fi
done
"#;
        let child = Command::new("sh")
            .arg("-c")
            .arg(SCRIPT)
            .arg("soak-watchdog")
            .arg(std::process::id().to_string())
            .arg(pids)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start the watchdog shell");
        Watchdog(child)
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
    pids: PathBuf,
    /// The servers' URLs, comma-separated (the sentinels', or every cluster node's).
    url: String,
    workers: Vec<Worker>,
    /// Workers that exited without being told to (label, status).
    unexpected: Vec<String>,
}

impl Fleet<'_> {
    fn spawn(&self, slot: usize, incarnation: usize) -> Worker {
        // With an earlier build, the odd slots run it (its workers' logs end in `-base`).
        let (exe, build) = match &self.config.base {
            Some(base) if slot % 2 == 1 => (base.clone(), "-base"),
            _ => (std::env::current_exe().unwrap(), ""),
        };
        let label = format!("w{slot}.{incarnation}{build}");
        let log = self.dir.join(format!("{label}.log"));
        let seed = self.config.seed ^ (((slot as u64) << 32) | incarnation as u64);
        let child = Command::new(exe)
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
            .env(W_TOPOLOGY, self.config.topology.name())
            .env(
                W_WAIT_MS,
                self.config.wait.unwrap_or_default().as_millis().to_string(),
            )
            .env(W_PREFETCH, self.config.prefetch.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the test binary as a worker");
        register(&self.pids, &label, child.id());
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
            unregister(&self.pids, &worker.label);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum FaultKind {
    Freeze,
    Kill,
    RedisRestart,
    /// Sentinel or Cluster: SIGKILL a master, start it again later.
    MasterKill,
    /// Sentinel or Cluster: SIGSTOP a master, SIGCONT later.
    MasterStop,
    /// `SENTINEL FAILOVER` / `CLUSTER FAILOVER`.
    ForcedFailover,
}

impl FaultKind {
    fn is_redis(self) -> bool {
        !matches!(self, FaultKind::Freeze | FaultKind::Kill)
    }
}

#[derive(Debug, Clone)]
struct Fault {
    kind: FaultKind,
    /// The process it hit (empty for a single Redis; the server's label and port otherwise).
    target: String,
    /// SIGSTOP / SIGKILL / the failover command sent.
    at: u64,
    /// SIGCONT sent / replacement started / Redis answering again / the new master named.
    until: u64,
    /// What the servers did: the master before and after, and when.
    note: String,
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
        if draw(&mut bag, &[FaultKind::Freeze, FaultKind::Kill], rng) == FaultKind::Freeze {
            let (pid, target) = {
                let mut fleet = fleet.lock().unwrap();
                fleet.check_exits();
                let worker = &fleet.workers[slot];
                (worker.child.id(), worker.label.clone())
            };
            let Some(pid) = pid else { continue };
            let frozen = if draw(&mut lengths, &[false, true], rng) {
                rng.u64(split..=3000)
            } else {
                rng.u64(200..split)
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
                note: String::new(),
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
            unregister(&fleet.lock().unwrap().pids, &old.label);
            faults.push(Fault {
                kind: FaultKind::Kill,
                target: old.label.clone(),
                at,
                until,
                note: String::new(),
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
            note: String::new(),
        });
    }
    faults
}

// ---------------------------------------------------------------------------------------
// The parent: Sentinel and Cluster topologies and their faults
// ---------------------------------------------------------------------------------------

/// Sentinel timings: a failover a few seconds after the master stops answering.
const DOWN_AFTER_MS: u64 = 1000;
const FAILOVER_TIMEOUT_MS: u64 = 2000;
/// Cluster: a replica takes over a master that has not answered for this long (plus its
/// election).
const NODE_TIMEOUT_MS: u64 = 1000;
/// How long a fault waits for the servers to name a new master before saying there was none.
const SWITCH_BOUND: Duration = Duration::from_secs(20);

/// Settings every data node shares: no persistence (a killed node comes back empty), full
/// syncs over the socket at once.
const DATA_CONF: &str = "save \"\"\nappendonly no\nrepl-diskless-sync yes\n\
                         repl-diskless-sync-delay 0\n";

/// A redis-server or sentinel of a topology, started from `<dir>/node.conf` (which the
/// sentinels may rewrite); SIGKILLed when dropped.
struct Node {
    label: String,
    port: u16,
    dir: PathBuf,
    sentinel: bool,
    pids: PathBuf,
    child: Option<Child>,
}

impl Node {
    fn new(base: &Path, pids: &Path, label: &str, port: u16, sentinel: bool, conf: &str) -> Node {
        let dir = base.join(label);
        std::fs::create_dir_all(&dir).expect("create a node directory");
        let text = format!(
            "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\nlogfile {log}\n{conf}",
            dir = dir.display(),
            log = dir.join("redis.log").display(),
        );
        std::fs::write(dir.join("node.conf"), text).expect("write a node's config");
        Node {
            label: label.to_owned(),
            port,
            dir,
            sentinel,
            pids: pids.to_owned(),
            child: None,
        }
    }

    /// `label@port`, as the report names servers.
    fn name(&self) -> String {
        format!("{}@{}", self.label, self.port)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref()?.id()
    }

    /// Starts the server from its config file and waits until it answers PING.
    async fn spawn(&mut self) {
        let bin = std::env::var("REDISRS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let mut cmd = Command::new(bin);
        cmd.arg(self.dir.join("node.conf"));
        if self.sentinel {
            cmd.arg("--sentinel");
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start redis-server");
        register(&self.pids, &self.label, child.id());
        self.child = Some(child);
        let url = self.url();
        eventually(
            Duration::from_secs(10),
            &format!("{} to answer PING", self.name()),
            || ping(&url),
        )
        .await;
    }

    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = timeout(Duration::from_secs(5), child.wait()).await;
            unregister(&self.pids, &self.label);
        }
    }

    /// How many lines of this server's log contain `text`.
    fn log_lines(&self, text: &str) -> usize {
        std::fs::read_to_string(self.dir.join("redis.log"))
            .map(|log| log.lines().filter(|line| line.contains(text)).count())
            .unwrap_or(0)
    }
}

fn command(args: &[&str]) -> redis::Cmd {
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    cmd
}

/// One command on a fresh connection to the server on `port`, bounded by 1 s in all.
async fn query<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> Result<T, String> {
    let cmd = command(args);
    let attempt = async {
        let client =
            redis::Client::open(format!("redis://127.0.0.1:{port}")).map_err(|e| e.to_string())?;
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| e.to_string())?;
        cmd.query_async::<T>(&mut conn)
            .await
            .map_err(|e| e.to_string())
    };
    timeout(Duration::from_secs(1), attempt)
        .await
        .unwrap_or_else(|_| Err("no answer within 1 s".into()))
}

/// `field:value` lines of INFO.
fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.trim().strip_prefix(field)?.strip_prefix(':'))
}

/// A flat `[field, value, ...]` reply (SENTINEL MASTER, an entry of SENTINEL REPLICAS).
fn pairs(flat: &[String]) -> HashMap<&str, &str> {
    flat.chunks(2)
        .filter(|pair| pair.len() == 2)
        .map(|pair| (pair[0].as_str(), pair[1].as_str()))
        .collect()
}

fn distinct_ports(n: usize) -> Vec<u16> {
    let mut ports = Vec::new();
    while ports.len() < n {
        let port = free_port();
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    ports
}

/// Polls `check` every 50 ms until it gives `Some`, or `deadline` passes.
async fn poll_until<T, F, Fut>(deadline: Instant, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    loop {
        if let Some(found) = check().await {
            return Some(found);
        }
        if Instant::now() >= deadline {
            return None;
        }
        sleep(Duration::from_millis(50)).await;
    }
}

/// The next of `all`, drawn in shuffled rounds (`bag` holds what is left of the round), so
/// even a short run sees every kind.
fn draw<T: Copy>(bag: &mut Vec<T>, all: &[T], rng: &mut fastrand::Rng) -> T {
    if bag.is_empty() {
        *bag = all.to_vec();
        rng.shuffle(bag);
    }
    bag.pop().expect("a round is never empty")
}

/// The Redis faults of the Sentinel and Cluster runs, drawn in shuffled rounds.
const REDIS_FAULTS: [FaultKind; 3] = [
    FaultKind::MasterKill,
    FaultKind::MasterStop,
    FaultKind::ForcedFailover,
];

/// Waits for the next Redis fault's turn: about `every` after `last` (a second from now at
/// the soonest), then until the servers are healthy again (a fault on a set still recovering
/// from the last one measures nothing new; at most 15 s). What `healthy` found, and a note
/// for the fault when they never were; `None` when no fault fits before `end` (each needs 5 s
/// to play out).
async fn next_redis_fault<T, F, Fut>(
    last: Instant,
    every: Duration,
    end: Instant,
    rng: &mut fastrand::Rng,
    what: &str,
    mut healthy: F,
) -> Option<(Option<T>, String)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let next = (last + around(rng, every)).max(Instant::now() + Duration::from_secs(1));
    if next + Duration::from_secs(5) >= end {
        return None;
    }
    sleep_until(next).await;
    let wait_from = wall_us();
    let health = poll_until(Instant::now() + Duration::from_secs(15), || {
        let check = healthy();
        async move { check.await.ok() }
    })
    .await;
    let note = match health {
        Some(_) => String::new(),
        None => format!(
            " ({what} not healthy after {:.0} ms: {}; faulted anyway)",
            ms_since(wait_from),
            healthy().await.err().unwrap_or_default()
        ),
    };
    Some((health, note))
}

/// Freezes `pid` for `frozen` while `watch` runs: when it was thawed (wall µs), and what
/// `watch` saw.
async fn freeze_during<T>(
    pid: u32,
    frozen: Duration,
    watch: impl std::future::Future<Output = T>,
) -> (u64, T) {
    signal(pid, "STOP");
    let thaw = async {
        sleep(frozen).await;
        signal(pid, "CONT");
        wall_us()
    };
    tokio::join!(thaw, watch)
}

/// Kills `nodes`, thawing any that a fault left frozen.
async fn stop_nodes(nodes: impl Iterator<Item = &mut Node>) {
    for node in nodes {
        if let Some(pid) = node.pid() {
            signal(pid, "CONT");
        }
        node.kill().await;
    }
}

fn ms_since(at: u64) -> f64 {
    (wall_us().saturating_sub(at)) as f64 / 1000.0
}

/// A master, two replicas and three sentinels.
struct SentinelSet {
    data: Vec<Node>,
    sentinels: Vec<Node>,
}

impl SentinelSet {
    async fn start(dir: &Path, pids: &Path) -> SentinelSet {
        let ports = distinct_ports(6);
        let mut data = Vec::new();
        for (i, &port) in ports[..3].iter().enumerate() {
            let conf = if i == 0 {
                DATA_CONF.to_owned()
            } else {
                format!("{DATA_CONF}replicaof 127.0.0.1 {}\n", ports[0])
            };
            data.push(Node::new(dir, pids, &format!("r{i}"), port, false, &conf));
        }
        for node in &mut data {
            node.spawn().await;
        }
        let master = ports[0];
        eventually(
            Duration::from_secs(30),
            "both replicas to be in sync",
            || async move {
                let info: String = query(master, &["INFO", "replication"])
                    .await
                    .unwrap_or_default();
                info.lines()
                    .filter(|line| line.starts_with("slave") && line.contains("state=online"))
                    .count()
                    == 2
            },
        )
        .await;
        let conf = format!(
            "sentinel monitor {MASTER} 127.0.0.1 {master} 2\n\
             sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n\
             sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n\
             sentinel parallel-syncs {MASTER} 2\n"
        );
        let mut sentinels = Vec::new();
        for (i, &port) in ports[3..].iter().enumerate() {
            sentinels.push(Node::new(dir, pids, &format!("s{i}"), port, true, &conf));
        }
        for node in &mut sentinels {
            node.spawn().await;
        }
        // A failover needs a quorum that knows the replicas and each other (hello messages
        // every 2 s).
        for sentinel in &sentinels {
            let port = sentinel.port;
            eventually(
                Duration::from_secs(30),
                "the sentinels to know the replicas and each other",
                || async move {
                    let flat: Vec<String> = query(port, &["SENTINEL", "MASTER", MASTER])
                        .await
                        .unwrap_or_default();
                    let master = pairs(&flat);
                    master.get("num-slaves") == Some(&"2")
                        && master.get("num-other-sentinels") == Some(&"2")
                },
            )
            .await;
        }
        SentinelSet { data, sentinels }
    }

    fn urls(&self) -> Vec<String> {
        self.sentinels.iter().map(Node::url).collect()
    }

    /// The master's port, as the first sentinel that answers names it.
    async fn master(&self) -> Option<u16> {
        for sentinel in &self.sentinels {
            let addr: Result<Vec<String>, _> = query(
                sentinel.port,
                &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER],
            )
            .await;
            if let Ok(addr) = addr
                && let Some(port) = addr.get(1).and_then(|port| port.parse().ok())
            {
                return Some(port);
            }
        }
        None
    }

    fn node(&self, port: u16) -> Option<usize> {
        self.data.iter().position(|node| node.port == port)
    }

    fn name(&self, port: u16) -> String {
        self.node(port)
            .map_or_else(|| format!("?@{port}"), |i| self.data[i].name())
    }

    /// The master's port if the sentinels see it up with no failover going on and at least
    /// one replica in sync that they could promote; otherwise why not.
    async fn healthy(&self) -> Result<u16, String> {
        let sentinel = self.sentinels[0].port;
        let flat: Vec<String> = query(sentinel, &["SENTINEL", "MASTER", MASTER]).await?;
        let master = pairs(&flat);
        let flags = master.get("flags").copied().unwrap_or("?");
        if flags != "master" {
            return Err(format!("master flags {flags}"));
        }
        let port: u16 = master
            .get("port")
            .and_then(|port| port.parse().ok())
            .ok_or("no master port")?;
        let role: Vec<redis::Value> = query(port, &["ROLE"]).await?;
        if !matches!(role.first(), Some(redis::Value::BulkString(role)) if role == b"master") {
            return Err(format!("{} does not say it is a master", self.name(port)));
        }
        let replicas: Vec<Vec<String>> = query(sentinel, &["SENTINEL", "REPLICAS", MASTER]).await?;
        let good = replicas
            .iter()
            .map(|flat| pairs(flat))
            .filter(|replica| {
                replica.get("flags") == Some(&"slave")
                    && replica.get("master-link-status") == Some(&"ok")
                    && replica.get("master-port") == Some(&port.to_string().as_str())
            })
            .count();
        if good == 0 {
            return Err("no replica in sync".into());
        }
        Ok(port)
    }

    /// The new master's port and when the sentinels first named it, polling until `deadline`.
    async fn master_change(&self, from: u16, deadline: Instant) -> Option<(u16, u64)> {
        poll_until(deadline, || async {
            self.master()
                .await
                .filter(|&port| port != from)
                .map(|port| (port, wall_us()))
        })
        .await
    }

    /// `+switch-master` lines in the first sentinel's log: every failover it followed.
    fn failovers_seen(&self) -> usize {
        self.sentinels[0].log_lines("+switch-master")
    }

    async fn shutdown(&mut self) {
        stop_nodes(self.sentinels.iter_mut().chain(self.data.iter_mut())).await;
    }
}

/// The sentinels' faults until `end`, in shuffled rounds of the three kinds.
async fn sentinel_faults(
    set: &mut SentinelSet,
    every: Duration,
    end: Instant,
    rng: &mut fastrand::Rng,
) -> Vec<Fault> {
    let mut faults = Vec::new();
    let mut bag: Vec<FaultKind> = Vec::new();
    let mut last = Instant::now();
    loop {
        let Some((health, unhealthy)) =
            next_redis_fault(last, every, end, rng, "set", || set.healthy()).await
        else {
            break;
        };
        let Some(master) = health.or(set.master().await) else {
            faults.push(Fault {
                kind: FaultKind::ForcedFailover,
                target: String::new(),
                at: wall_us(),
                until: wall_us(),
                note: "skipped: no sentinel names a master".into(),
            });
            last = Instant::now();
            continue;
        };
        let kind = draw(&mut bag, &REDIS_FAULTS, rng);
        let index = set.node(master).expect("the master is one of ours");
        let target = set.data[index].name();
        last = Instant::now();
        let at = wall_us();
        let note;
        let until;
        match kind {
            FaultKind::MasterKill => {
                set.data[index].kill().await;
                let switch = set
                    .master_change(master, Instant::now() + SWITCH_BOUND)
                    .await;
                let back = Duration::from_millis(rng.u64(3000..=4000));
                sleep_until(last + back).await;
                set.data[index].spawn().await;
                until = wall_us();
                note = format!(
                    "SIGKILL master {target}; {}; restarted empty from its config after {:.0} ms",
                    describe_switch(set, switch, at),
                    (until - at) as f64 / 1000.0
                );
            }
            FaultKind::MasterStop => {
                let pid = set.data[index].pid().expect("running");
                let frozen = Duration::from_millis(rng.u64(3000..=4000));
                let watch = set.master_change(master, last + frozen + Duration::from_secs(5));
                let (thawed, switch) = freeze_during(pid, frozen, watch).await;
                until = thawed;
                note = format!(
                    "SIGSTOP master {target} for {} ms; {}",
                    frozen.as_millis(),
                    describe_switch(set, switch, at)
                );
            }
            _ => {
                let sentinel = set.sentinels[rng.usize(..set.sentinels.len())].port;
                // INPROG / NOGOODSLAVE while the sentinels settle: ask again for a while.
                let mut refusals = Vec::new();
                let give_up = Instant::now() + Duration::from_secs(5);
                let sent = loop {
                    match query::<redis::Value>(sentinel, &["SENTINEL", "FAILOVER", MASTER]).await {
                        Ok(_) => break Some(()),
                        Err(e) => refusals.push(e),
                    }
                    if Instant::now() >= give_up {
                        break None;
                    }
                    sleep(Duration::from_millis(200)).await;
                };
                let switch = match sent {
                    Some(()) => {
                        set.master_change(master, Instant::now() + SWITCH_BOUND)
                            .await
                    }
                    None => None,
                };
                until = wall_us();
                note = format!(
                    "SENTINEL FAILOVER {MASTER} to sentinel @{sentinel}{} with {target} master; {}",
                    if refusals.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " ({} refusals, last: {})",
                            refusals.len(),
                            refusals.last().unwrap()
                        )
                    },
                    describe_switch(set, switch, at)
                );
            }
        }
        faults.push(Fault {
            kind,
            target,
            at,
            until,
            note: note + &unhealthy,
        });
    }
    faults
}

fn describe_switch(set: &SentinelSet, switch: Option<(u16, u64)>, at: u64) -> String {
    match switch {
        Some((port, when)) => format!(
            "the sentinels named {} after {:.0} ms",
            set.name(port),
            when.saturating_sub(at) as f64 / 1000.0
        ),
        None => "no new master named".into(),
    }
}

/// One line of CLUSTER NODES.
#[derive(Debug, Clone)]
struct NodeLine {
    id: String,
    port: u16,
    flags: String,
    master: String,
    slots: Vec<(u16, u16)>,
}

impl NodeLine {
    fn parse(line: &str) -> Option<NodeLine> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let addr = fields.get(1)?;
        let port = addr.split('@').next()?.rsplit(':').next()?.parse().ok()?;
        let slots = fields
            .get(8..)
            .unwrap_or_default()
            .iter()
            .filter(|slot| !slot.starts_with('['))
            .filter_map(|slot| match slot.split_once('-') {
                Some((from, to)) => Some((from.parse().ok()?, to.parse().ok()?)),
                None => slot.parse().ok().map(|one| (one, one)),
            })
            .collect();
        Some(NodeLine {
            id: fields[0].to_owned(),
            port,
            flags: fields.get(2)?.to_string(),
            master: fields.get(3)?.to_string(),
            slots,
        })
    }

    fn is_master(&self) -> bool {
        self.flags.split(',').any(|flag| flag == "master")
    }

    /// Flagged failing (`fail`) or suspected (`fail?`), or without an address.
    fn failing(&self) -> bool {
        self.flags
            .split(',')
            .any(|flag| flag == "fail" || flag == "fail?" || flag == "noaddr")
    }

    fn owns(&self, slot: u16) -> bool {
        self.slots
            .iter()
            .any(|&(from, to)| (from..=to).contains(&slot))
    }
}

/// Three masters and three replicas.
struct ClusterSet {
    nodes: Vec<Node>,
    /// The soak semaphore's slot.
    slot: u16,
}

impl ClusterSet {
    async fn start(dir: &Path, pids: &Path) -> ClusterSet {
        let ports = distinct_ports(6);
        let conf = format!(
            "{DATA_CONF}cluster-enabled yes\ncluster-config-file nodes.conf\n\
             cluster-node-timeout {NODE_TIMEOUT_MS}\ncluster-replica-validity-factor 0\n"
        );
        let mut nodes: Vec<Node> = ports
            .iter()
            .enumerate()
            .map(|(i, &port)| Node::new(dir, pids, &format!("c{i}"), port, false, &conf))
            .collect();
        for node in &mut nodes {
            node.spawn().await;
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for port in &ports {
            create.arg(format!("127.0.0.1:{port}"));
        }
        let output = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let output = timeout(Duration::from_secs(60), output)
            .await
            .expect("redis-cli --cluster create finishes within 60 s")
            .expect("run redis-cli (the redis-tools package)");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let key = format!("dlimit:{{{NAME}}}:holders");
        let slot: i64 = query(ports[0], &["CLUSTER", "KEYSLOT", &key])
            .await
            .expect("CLUSTER KEYSLOT");
        let set = ClusterSet {
            nodes,
            slot: slot as u16,
        };
        eventually(
            Duration::from_secs(60),
            "the cluster to be up with a replica for every master",
            || async {
                let mut ok = set.healthy().await.is_ok();
                for node in &set.nodes {
                    let info: String = query(node.port, &["CLUSTER", "INFO"])
                        .await
                        .unwrap_or_default();
                    ok &= info_field(&info, "cluster_state") == Some("ok");
                }
                ok
            },
        )
        .await;
        set
    }

    fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Node::url).collect()
    }

    fn node(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|node| node.port == port)
    }

    fn name(&self, port: u16) -> String {
        self.node(port)
            .map_or_else(|| format!("?@{port}"), |i| self.nodes[i].name())
    }

    /// CLUSTER NODES as the first node that answers (other than `avoid`) sees it.
    async fn view(&self, avoid: Option<u16>) -> Option<Vec<NodeLine>> {
        for node in self.nodes.iter().filter(|node| Some(node.port) != avoid) {
            if node.child.is_none() {
                continue;
            }
            if let Ok(text) = query::<String>(node.port, &["CLUSTER", "NODES"]).await {
                return Some(text.lines().filter_map(NodeLine::parse).collect());
            }
        }
        None
    }

    /// Three masters with slots, none failing, each with a replica not failing; the port of
    /// the soak slot's owner.
    async fn healthy(&self) -> Result<u16, String> {
        let view = self.view(None).await.ok_or("no node answers")?;
        let masters: Vec<&NodeLine> = view
            .iter()
            .filter(|node| node.is_master() && !node.slots.is_empty())
            .collect();
        if masters.len() != 3 {
            return Err(format!("{} masters with slots", masters.len()));
        }
        for master in &masters {
            if master.failing() {
                return Err(format!("{} is {}", self.name(master.port), master.flags));
            }
            let replicas = view
                .iter()
                .filter(|node| node.master == master.id && !node.failing())
                .count();
            if replicas == 0 {
                return Err(format!("{} has no replica", self.name(master.port)));
            }
        }
        masters
            .iter()
            .find(|master| master.owns(self.slot))
            .map(|master| master.port)
            .ok_or_else(|| format!("nobody owns slot {}", self.slot))
    }

    /// The port of the new owner of `slot` (no longer `from`) and when a node other than
    /// `from` first said so, polling until `deadline`.
    async fn owner_change(&self, slot: u16, from: u16, deadline: Instant) -> Option<(u16, u64)> {
        poll_until(deadline, || async {
            let view = self.view(Some(from)).await?;
            view.iter()
                .find(|node| node.is_master() && node.owns(slot) && node.port != from)
                .map(|node| (node.port, wall_us()))
        })
        .await
    }

    /// `Failover election won` lines in the nodes' logs: every promotion of a replica.
    fn failovers_seen(&self) -> usize {
        self.nodes
            .iter()
            .map(|node| node.log_lines("Failover election won"))
            .sum()
    }

    async fn shutdown(&mut self) {
        stop_nodes(self.nodes.iter_mut()).await;
    }
}

/// The cluster's faults until `end`: shuffled rounds of the three kinds, on the soak slot's
/// owner two times out of three (shuffled rounds too), another master otherwise.
async fn cluster_faults(
    set: &mut ClusterSet,
    every: Duration,
    end: Instant,
    rng: &mut fastrand::Rng,
) -> Vec<Fault> {
    let mut faults = Vec::new();
    let mut kinds: Vec<FaultKind> = Vec::new();
    let mut owners: Vec<bool> = Vec::new();
    let mut last = Instant::now();
    loop {
        let Some((_, unhealthy)) =
            next_redis_fault(last, every, end, rng, "cluster", || set.healthy()).await
        else {
            break;
        };
        let Some(view) = set.view(None).await else {
            last = Instant::now();
            continue;
        };
        let masters: Vec<NodeLine> = view
            .iter()
            .filter(|node| node.is_master() && !node.slots.is_empty() && !node.failing())
            .filter(|node| set.node(node.port).is_some())
            .cloned()
            .collect();
        let Some(owner) = masters.iter().find(|node| node.owns(set.slot)).cloned() else {
            last = Instant::now();
            continue;
        };
        let kind = draw(&mut kinds, &REDIS_FAULTS, rng);
        let others: Vec<&NodeLine> = masters.iter().filter(|m| m.port != owner.port).collect();
        let target = match draw(&mut owners, &[true, true, false], rng) {
            false if !others.is_empty() => others[rng.usize(..others.len())].clone(),
            _ => owner.clone(),
        };
        let slot = if target.port == owner.port {
            set.slot
        } else {
            target.slots[0].0
        };
        let index = set.node(target.port).unwrap();
        let name = set.nodes[index].name();
        let role = if target.port == owner.port {
            format!("the soak slot {}'s master", set.slot)
        } else {
            format!("a master of other slots (watching slot {slot})")
        };
        last = Instant::now();
        let at = wall_us();
        let note;
        let until;
        match kind {
            FaultKind::MasterKill => {
                set.nodes[index].kill().await;
                let switch = set
                    .owner_change(slot, target.port, Instant::now() + SWITCH_BOUND)
                    .await;
                let back = Duration::from_millis(rng.u64(3000..=4000));
                sleep_until(last + back).await;
                set.nodes[index].spawn().await;
                until = wall_us();
                note = format!(
                    "SIGKILL {name}, {role}; {}; restarted empty after {:.0} ms",
                    describe_owner(set, switch, at),
                    (until - at) as f64 / 1000.0
                );
            }
            FaultKind::MasterStop => {
                let pid = set.nodes[index].pid().expect("running");
                let frozen = Duration::from_millis(rng.u64(3000..=4000));
                let watch =
                    set.owner_change(slot, target.port, last + frozen + Duration::from_secs(5));
                let (thawed, switch) = freeze_during(pid, frozen, watch).await;
                until = thawed;
                note = format!(
                    "SIGSTOP {name}, {role}, for {} ms; {}",
                    frozen.as_millis(),
                    describe_owner(set, switch, at)
                );
            }
            _ => {
                let replica = view
                    .iter()
                    .find(|node| node.master == target.id && !node.failing())
                    .map(|node| node.port);
                let (sent, switch) = match replica {
                    Some(replica) => {
                        let sent = query::<redis::Value>(replica, &["CLUSTER", "FAILOVER"]).await;
                        let switch = match &sent {
                            Ok(_) => {
                                set.owner_change(slot, target.port, Instant::now() + SWITCH_BOUND)
                                    .await
                            }
                            Err(_) => None,
                        };
                        (
                            match sent {
                                Ok(_) => format!("CLUSTER FAILOVER to {}", set.name(replica)),
                                Err(e) => format!(
                                    "CLUSTER FAILOVER to {} refused: {e}",
                                    set.name(replica)
                                ),
                            },
                            switch,
                        )
                    }
                    None => ("no replica to send CLUSTER FAILOVER to".to_owned(), None),
                };
                until = wall_us();
                note = format!(
                    "{sent}, replica of {name}, {role}; {}",
                    describe_owner(set, switch, at)
                );
            }
        }
        faults.push(Fault {
            kind,
            target: name,
            at,
            until,
            note: note + &unhealthy,
        });
    }
    faults
}

fn describe_owner(set: &ClusterSet, switch: Option<(u16, u64)>, at: u64) -> String {
    match switch {
        Some((port, when)) => format!(
            "{} took the slots over after {:.0} ms",
            set.name(port),
            when.saturating_sub(at) as f64 / 1000.0
        ),
        None => "no replica took over".into(),
    }
}

/// The servers of the run's topology.
enum Servers {
    Single(Box<RedisProc>),
    Sentinel(SentinelSet),
    Cluster(ClusterSet),
}

impl Servers {
    async fn start(config: &Config, dir: &Path, pids: &Path) -> Servers {
        match config.topology {
            Topology::Single => {
                Servers::Single(Box::new(RedisProc::start(dir, config.restarts, pids).await))
            }
            Topology::Sentinel => Servers::Sentinel(SentinelSet::start(dir, pids).await),
            Topology::Cluster => Servers::Cluster(ClusterSet::start(dir, pids).await),
        }
    }

    fn urls(&self) -> Vec<String> {
        match self {
            Servers::Single(redis) => vec![redis.url.clone()],
            Servers::Sentinel(set) => set.urls(),
            Servers::Cluster(set) => set.urls(),
        }
    }

    /// Redis faults until `end`: restarts (single), failovers (Sentinel, Cluster).
    async fn faults(
        &mut self,
        config: &Config,
        end: Instant,
        rng: &mut fastrand::Rng,
    ) -> Vec<Fault> {
        match self {
            Servers::Single(redis) if config.restarts => {
                redis_restarts(redis, config.restart_every, end, rng).await
            }
            Servers::Sentinel(set) if config.redis_faults => {
                sentinel_faults(set, config.redis_fault_every, end, rng).await
            }
            Servers::Cluster(set) if config.redis_faults => {
                cluster_faults(set, config.redis_fault_every, end, rng).await
            }
            _ => Vec::new(),
        }
    }

    fn failovers_seen(&self) -> Option<usize> {
        match self {
            Servers::Single(_) => None,
            Servers::Sentinel(set) => Some(set.failovers_seen()),
            Servers::Cluster(set) => Some(set.failovers_seen()),
        }
    }

    async fn shutdown(&mut self) {
        match self {
            Servers::Single(redis) => redis.kill().await,
            Servers::Sentinel(set) => set.shutdown().await,
            Servers::Cluster(set) => set.shutdown().await,
        }
    }
}

/// Builds a backend with the workers' settings before any worker starts: settings the library
/// refuses (`Error::Config`) fail the soak at once, with its message.
async fn preflight(config: &Config, urls: &[String]) {
    let builder = backend_builder(config.topology, urls, Duration::from_secs(2), config.wait);
    match builder.connect().await {
        Ok(_) => {}
        Err(e @ Error::Config(_)) => panic!(
            "soak: the library refused the workers' settings ({} topology, wait_for_replicas \
             {:?}) with Error::Config: {e}",
            config.topology.name(),
            config.wait
        ),
        Err(e) => panic!(
            "soak: cannot connect to the {} servers: {e}",
            config.topology.name()
        ),
    }
}

// ---------------------------------------------------------------------------------------
// The parent: the run and the offline check
// ---------------------------------------------------------------------------------------

async fn soak(config: Config) {
    let scratch = Scratch::new(config.keep);
    let pids = scratch.path.join("pids");
    std::fs::create_dir_all(&pids).expect("create the pid directory");
    // Declared before the servers and workers, so dropped (killed) after them.
    let _watchdog = Watchdog::start(&pids);
    let mut servers = Servers::start(&config, &scratch.path, &pids).await;
    let urls = servers.urls();
    preflight(&config, &urls).await;
    let fleet = Fleet {
        config: &config,
        dir: scratch.path.clone(),
        pids: pids.clone(),
        url: urls.join(","),
        workers: Vec::new(),
        unexpected: Vec::new(),
    };
    let fleet = Mutex::new(fleet);
    if config.base.is_some() {
        // A rolling deploy: one build's workers hold and wait first, the other's join.
        let first = usize::from(config.base_first);
        for turn in [first, 1 - first] {
            {
                let mut fleet = fleet.lock().unwrap();
                for slot in (0..config.procs).filter(|slot| slot % 2 == turn) {
                    let worker = fleet.spawn(slot, 0);
                    fleet.workers.push(worker);
                }
            }
            if turn == first {
                sleep(Duration::from_secs(1)).await;
            }
        }
        // (Kills replace a worker by its index: keep them by slot.)
        fleet
            .lock()
            .unwrap()
            .workers
            .sort_by_key(|worker| worker.slot);
    } else {
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
    let server = servers.faults(&config, end, &mut redis_rng);
    let (mut faults, restarts, meta_fields) =
        tokio::join!(clients, server, meta_fields(&config, &urls, end));
    sleep_until(end).await;
    faults.extend(restarts);
    // One timeline: the client faults and the servers' interleaved.
    faults.sort_by_key(|fault| fault.at);
    let mut fleet = fleet.into_inner().unwrap();
    fleet.check_exits();
    let elapsed = started.elapsed();
    fleet.stop().await;
    let failovers = servers.failovers_seen();
    servers.shutdown().await;

    let report = analyse(&config, &scratch.path, &faults, t0);
    let builds = Builds::count(&scratch.path);
    let unexpected = std::mem::take(&mut fleet.unexpected);
    drop(fleet);

    let count = |kind| faults.iter().filter(|f| f.kind == kind).count();
    let topology = format!(
        "topology {}{}",
        config.topology.name(),
        match config.wait {
            Some(wait) => format!(" with wait_for_replicas(1, {wait:?})"),
            None => String::new(),
        }
    );
    let failover_faults = match failovers {
        None => String::new(),
        Some(seen) => format!(
            ", {} master kills, {} master stops, {} forced failovers; failovers seen {seen}",
            count(FaultKind::MasterKill),
            count(FaultKind::MasterStop),
            count(FaultKind::ForcedFailover),
        ),
    };
    let summary = format!(
        "soak summary: {:.1} s, {} procs x {} tasks, limit {}, prefetch {}, lease {:?} | {topology} | holds {} \
         ({:.1}/s; lost at START {}, lost at END {}, no END {}) | faults: {} freezes, {} kills, \
         {} redis restarts{failover_faults} | acquire errors: {} | max concurrent {} | \
         violations {} (worst {}, {:.1} ms over the limit in all) | duplicate tokens {} | \
         grants older than a lease at START {} | meta fields at most {} | {} | seed {}",
        elapsed.as_secs_f64(),
        config.procs,
        config.tasks,
        config.limit,
        config.prefetch,
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
        meta_fields.map_or("not read".to_owned(), |n| n.to_string()),
        builds.summary(),
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
    // Meta's fields: the counters and the limit, a silence mark per process at most, and a
    // count per slot held (classes, tenants); an older build's leftovers cleaned.
    let bound = 2 * config.limit as usize + config.procs + 4;
    if let Some(fields) = meta_fields {
        assert!(
            fields <= bound,
            "meta grew to {fields} fields (bound {bound})"
        );
    }
    if config.base.is_some() {
        // Both builds' waiters are served, none of them left to time out in a line that
        // never reaches them.
        for (build, holds, timeouts) in [
            ("this build", builds.holds[0], builds.timeouts[0]),
            ("the earlier build", builds.holds[1], builds.timeouts[1]),
        ] {
            assert!(
                holds >= floor / 4,
                "{build} held only {holds} times in {:.1} s: its waiters are not served",
                config.secs
            );
            assert!(
                timeouts * 20 <= holds,
                "{build}: {timeouts} acquires timed out beside {holds} holds"
            );
        }
    }
}

/// Each build's holds and acquire timeouts, from the workers' logs (an earlier build's end in
/// `-base.log`).
struct Builds {
    holds: [usize; 2],
    timeouts: [usize; 2],
}

impl Builds {
    fn count(dir: &Path) -> Builds {
        let mut builds = Builds {
            holds: [0; 2],
            timeouts: [0; 2],
        };
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.ends_with(".log") {
                continue;
            }
            let build = usize::from(name.ends_with("-base.log"));
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            for line in text.lines() {
                if line.starts_with("S ") {
                    builds.holds[build] += 1;
                } else if line.starts_with("X ") && line.ends_with(" timeout") {
                    builds.timeouts[build] += 1;
                }
            }
        }
        builds
    }

    fn summary(&self) -> String {
        if self.holds[1] + self.timeouts[1] == 0 {
            return "one build".to_owned();
        }
        format!(
            "this build {} holds, {} timeouts; earlier build {} holds, {} timeouts",
            self.holds[0], self.timeouts[0], self.holds[1], self.timeouts[1]
        )
    }
}

/// The most fields the semaphore's meta held, sampled every 100 ms until `end` (one server
/// only: `None` on the other topologies).
async fn meta_fields(config: &Config, urls: &[String], end: Instant) -> Option<usize> {
    if config.topology != Topology::Single {
        return None;
    }
    let client = redis::Client::open(urls[0].as_str()).ok()?;
    let key = format!("dlimit:{{{NAME}}}:meta");
    let mut most = 0;
    while Instant::now() < end {
        // (Redis restarting: tried again at the next sample.)
        if let Ok(Ok(mut conn)) = timeout(
            Duration::from_secs(1),
            client.get_multiplexed_async_connection(),
        )
        .await
        {
            while Instant::now() < end {
                let Ok(Ok(fields)) = timeout(
                    Duration::from_secs(1),
                    redis::cmd("HLEN").arg(&key).query_async::<usize>(&mut conn),
                )
                .await
                else {
                    break;
                };
                most = most.max(fields);
                sleep(Duration::from_millis(100)).await;
            }
        }
        sleep(Duration::from_millis(100)).await;
    }
    Some(most)
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

/// The holds, the errors by kind, the first message of each kind, and how many lines did not
/// parse.
#[allow(clippy::type_complexity)]
fn read_logs(
    dir: &Path,
) -> (
    Vec<Hold>,
    HashMap<String, usize>,
    HashMap<String, String>,
    usize,
) {
    let mut holds = Vec::new();
    let mut errors: HashMap<String, usize> = HashMap::new();
    let mut samples: HashMap<String, String> = HashMap::new();
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
                (Some("M"), n) if n >= 2 => {
                    let message = line.splitn(3, ' ').nth(2).unwrap_or("").to_owned();
                    samples.entry(fields[1].to_owned()).or_insert(message);
                }
                _ => malformed += 1,
            }
        }
        holds.extend(open.into_values());
    }
    (holds, errors, samples, malformed)
}

struct Episode {
    from: u64,
    to: u64,
    worst: usize,
    at_worst: Vec<usize>,
}

fn analyse(config: &Config, dir: &Path, faults: &[Fault], t0: u64) -> Report {
    let (holds, errors, samples, malformed) = read_logs(dir);
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

    // docs/design.md documents a fencing token as max(last + 1, Redis time in µs), so a token far
    // older than START means the grant was made long before the holder heard of it. Reported,
    // not asserted: the counting rule above is the check.
    let stale_grants = holds
        .iter()
        .filter(|hold| hold.start.saturating_sub(hold.token) > config.lease.as_micros() as u64)
        .count();
    // A token is issued once per grant. A prefetched slot is handed out again with its token
    // (docs/design.md): with prefetch, a token may recur in one process, one hold after
    // another, never in two processes or in two holds at once.
    let mut by_token: Vec<&Hold> = holds.iter().collect();
    by_token.sort_unstable_by_key(|hold| (hold.token, hold.start));
    let duplicate_tokens = by_token
        .windows(2)
        .filter(|w| {
            w[0].token == w[1].token
                && (config.prefetch == 0
                    || w[0].process != w[1].process
                    || w[0].until().unwrap_or(w[0].start) > w[1].start)
        })
        .count();

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
            "  fault {:?} {} at {:.1} .. {:.1}{}",
            fault.kind,
            fault.target,
            rel(fault.at),
            rel(fault.until),
            if fault.note.is_empty() {
                String::new()
            } else {
                format!(": {}", fault.note)
            }
        );
    }
    let mut samples: Vec<(String, String)> = samples.into_iter().collect();
    samples.sort();
    for (kind, message) in &samples {
        let _ = writeln!(details, "  first {kind} error: {message}");
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
            .filter(|f| kind.is_redis() || f.target == hold.process)
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
    let redis = faults
        .iter()
        .filter(|f| f.kind.is_redis() && f.kind != FaultKind::RedisRestart && f.at <= hold.start)
        .max_by_key(|f| f.at);
    if let Some(fault) = redis {
        let _ = write!(
            notes,
            "; {:?} {} {:.1} ms before START",
            fault.kind,
            fault.target,
            (hold.start - fault.at) as f64 / 1000.0
        );
    }
    notes
}
