//! Test fixtures: a real redis-server per test on a free loopback port, and bounded waits.
#![allow(dead_code, unused_macros)] // each test crate uses its own part of this module

use std::future::Future;
use std::process::Stdio;
use std::time::Duration;

use std::path::{Path, PathBuf};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use redis::aio::MultiplexedConnection;
use redis_test::server::RedisServer;
use tower_distributed_limit::RedisBackend;

/// Runs each listed body as `<name>::memory` and `<name>::redis`: once on an in-process
/// backend, once against a private redis-server.
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$name(tower_distributed_limit::MemoryBackend::new()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                let redis = super::support::Redis::start().await;
                super::$name(redis.backend().await).await;
            }
        }
    )*};
}

/// A private redis-server, killed when dropped.
pub struct Redis {
    server: RedisServer,
    pub url: String,
}

impl Redis {
    /// Starts redis-server on a free port (never 6379) and waits until it answers PING.
    pub async fn start() -> Redis {
        let server = RedisServer::new();
        let (host, port) = server.host_and_port().expect("a TCP server");
        assert_ne!(port, 6379, "tests never use the default port");
        let url = format!("redis://{host}:{port}");
        wait_for_ping(&url).await;
        Redis { server, url }
    }

    pub async fn backend(&self) -> RedisBackend {
        RedisBackend::connect(&self.url)
            .await
            .expect("connect to the test redis")
    }

    /// A plain connection for checking what the crate wrote.
    pub async fn conn(&self) -> MultiplexedConnection {
        redis::Client::open(self.url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// How many wait in the line of semaphore `name` (default key prefix).
    pub async fn queue_len(&self, name: &str) -> u64 {
        redis::cmd("ZCARD")
            .arg(format!("dlimit:{{{name}}}:queue"))
            .query_async(&mut self.conn().await)
            .await
            .unwrap()
    }

    pub async fn dbsize(&self) -> u64 {
        redis::cmd("DBSIZE")
            .query_async(&mut self.conn().await)
            .await
            .unwrap()
    }

    /// How many script calls Redis ran so far (see [`script_calls_at`]).
    pub async fn script_calls(&self) -> u64 {
        script_calls_at(&self.url).await
    }

    pub fn kill(&mut self) {
        self.server.stop();
    }

    /// The redis-server's process id, for SIGSTOP / SIGCONT.
    pub fn pid(&self) -> u32 {
        self.server.process.id()
    }

    /// Starts a fresh, empty redis-server on the same port after [`Redis::kill`].
    pub async fn restart(&mut self) {
        let addr = self.server.client_addr().clone();
        self.server = RedisServer::new_with_addr_and_modules(addr, &[], false);
        wait_for_ping(&self.url).await;
    }
}

/// Marks every quorum node as up for longer than any lease, as if they had served for long (a
/// node restarted among healthy ones abstains for a lease), for the tests that are not about
/// that.
pub async fn long_lived(nodes: &[Redis]) {
    for node in nodes {
        redis::cmd("SET")
            .arg("dlimit:quorum:born")
            .arg(0)
            .exec_async(&mut node.conn().await)
            .await
            .unwrap();
    }
}

/// A redis-server under the clock shim (tests/support/clock_shift.c, built with `cc`): the
/// file named by `variable` (`DLIMIT_CLOCK_SHIFT_FILE` to shift the wall clock,
/// `DLIMIT_CLOCK_PIN_FILE` to pin it) starts as `initial`. The server, and that file's path.
pub async fn redis_with_clock(variable: &str, initial: &str) -> (RedisProcess, PathBuf) {
    let dir = std::env::temp_dir().join(format!("dlimit-clock-{}", fastrand::u64(..)));
    std::fs::create_dir_all(&dir).unwrap();
    let library = dir.join("libclockshift.so");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/clock_shift.c");
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&library)
        .arg(&source)
        .status()
        .expect("run cc to build the clock shim");
    assert!(built.success(), "cc failed to build {}", source.display());
    let file = dir.join("clock");
    std::fs::write(&file, initial).unwrap();
    let env = [
        ("LD_PRELOAD", library.as_os_str()),
        (variable, file.as_os_str()),
    ];
    let server =
        RedisProcess::start_with_env(&env, |port, _| vec!["--port".into(), port.to_string()]).await;
    (server, file)
}

/// A redis-server started with arguments of the test's own (TLS, replication, ...) on a free
/// loopback port, in a temporary directory; killed, and its directory removed, when dropped.
pub struct RedisProcess {
    child: Child,
    pub port: u16,
    pub dir: PathBuf,
    /// What it was started with, to start it again.
    env: Vec<(String, std::ffi::OsString)>,
    args: Vec<String>,
}

impl RedisProcess {
    /// Starts `redis-server` with `args(port, dir)` after a few defaults (loopback only, no
    /// persistence), and waits until the port accepts connections.
    pub async fn start(args: impl FnOnce(u16, &std::path::Path) -> Vec<String>) -> RedisProcess {
        RedisProcess::start_with_env(&[], args).await
    }

    /// [`RedisProcess::start`] with environment variables for the server (e.g. `LD_PRELOAD`).
    pub async fn start_with_env(
        env: &[(&str, &std::ffi::OsStr)],
        args: impl FnOnce(u16, &std::path::Path) -> Vec<String>,
    ) -> RedisProcess {
        let dir = std::env::temp_dir().join(format!("dlimit-redis-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        let env: Vec<(String, std::ffi::OsString)> = (env.iter())
            .map(|(name, value)| (name.to_string(), value.to_os_string()))
            .collect();
        let args = args(port, &dir);
        let child = RedisProcess::spawn(&env, port, &dir, &args).await;
        RedisProcess {
            child,
            port,
            dir,
            env,
            args,
        }
    }

    /// Kills the server (see [`RedisProcess::start_again`]).
    pub async fn kill_for_restart(&mut self) {
        self.child.kill().await.unwrap();
    }

    /// Starts the server again after [`RedisProcess::kill_for_restart`], on the same port and
    /// directory with the same arguments: with persistence, it comes back with its data.
    pub async fn start_again(&mut self) {
        self.child = RedisProcess::spawn(&self.env, self.port, &self.dir, &self.args).await;
    }

    /// The server, once `port` accepts connections.
    async fn spawn(
        env: &[(String, std::ffi::OsString)],
        port: u16,
        dir: &Path,
        args: &[String],
    ) -> Child {
        let child = Command::new("redis-server")
            .envs(env.iter().map(|(name, value)| (name, value)))
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .args(args)
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start redis-server");
        eventually(
            Duration::from_secs(10),
            "redis-server to listen",
            || async {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
            },
        )
        .await;
        child
    }

    /// The process id, for SIGSTOP / SIGCONT.
    pub fn pid(&self) -> u32 {
        self.child.id().expect("running")
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How many script calls the server at `url` ran so far: FCALL, EVALSHA and EVAL.
pub async fn script_calls_at(url: &str) -> u64 {
    let mut calls = 0;
    for name in ["fcall", "evalsha", "eval"] {
        calls += command_calls_at(url, name).await;
    }
    calls
}

/// How many function libraries the server at `url` has (FUNCTION LIST).
pub async fn libraries_at(url: &str) -> usize {
    let mut conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let libraries: Vec<redis::Value> = redis::cmd("FUNCTION")
        .arg("LIST")
        .query_async(&mut conn)
        .await
        .unwrap();
    libraries.len()
}

/// How many times the server at `url` ran the command `name` (lower case) so far (INFO
/// commandstats).
pub async fn command_calls_at(url: &str, name: &str) -> u64 {
    let mut conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    commandstats(&mut conn)
        .await
        .get(name)
        .map_or(0, |&(calls, _)| calls)
}

/// `INFO commandstats` as command (lower case) -> (calls, total µs). Redis counts the commands
/// a script runs too, and their time is also inside the script call's.
pub async fn commandstats(
    conn: &mut MultiplexedConnection,
) -> std::collections::BTreeMap<String, (u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO commandstats");
    info.lines()
        .filter_map(|line| {
            let (name, fields) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let field = |key: &str| {
                fields
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                    .and_then(|v| v.parse().ok())
            };
            Some((name.to_owned(), (field("calls")?, field("usec")?)))
        })
        .collect()
}

/// A loopback port nobody listens on now (never 6379).
pub fn free_port() -> u16 {
    loop {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        if port != 6379 {
            return port;
        }
    }
}

async fn wait_for_ping(url: &str) {
    eventually(
        Duration::from_secs(10),
        "redis-server to answer PING",
        || async {
            let Ok(client) = redis::Client::open(url) else {
                return false;
            };
            match client.get_multiplexed_async_connection().await {
                Ok(mut conn) => redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .is_ok(),
                Err(_) => false,
            }
        },
    )
    .await;
}

/// Sends `signal` (e.g. "STOP", "CONT") to process `pid`, with the shell's built-in `kill`
/// (no package needed). A "STOP" returns only once every thread of the process is stopped:
/// the kernel stops them when the thread the signal went to next runs, which on a busy
/// machine can be milliseconds later, and meanwhile the others go on (a "frozen" waiter once
/// took its grant in that window).
pub fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("kill -{signal} {pid}"))
        .status()
        .expect("run sh");
    assert!(status.success(), "kill -{signal} {pid} failed");
    if signal == "STOP" {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !stopped(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "process {pid} did not stop within 5 s"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Whether every thread of `pid` is stopped (state `T` in `/proc/<pid>/task/*/stat`).
fn stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // `pid (comm) state ...`: the state follows the last ')'.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
                .is_some_and(|state| state == 'T' || state == 't')
        })
    })
}

/// Polls `condition` every 10 ms until it holds; panics naming `what` after `limit`.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if condition().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (at most 5 s) until `sem` has `expected` permits free across every process: the
/// releases sent in the background have all arrived.
pub async fn wait_until_available(sem: &tower_distributed_limit::Semaphore, expected: u32) {
    eventually(
        Duration::from_secs(5),
        &format!("{expected} permits of {:?} to be available", sem.name()),
        || async { sem.available_permits().await.unwrap() == expected },
    )
    .await;
}

pub const ROLE: &str = "DLIMIT_TEST_ROLE";
pub const URL: &str = "DLIMIT_TEST_URL";

/// In a child started by [`spawn_child`] (or the soak test): its role and Redis URL. `None` in
/// a normal test run, where the ignored `child_process` tests do nothing.
pub fn child_role() -> Option<(String, String)> {
    Some((std::env::var(ROLE).ok()?, std::env::var(URL).ok()?))
}

/// Starts this test binary again as a child process playing `role` against `redis`: the
/// binary's `child_process` test (ignored in normal runs) reads [`ROLE`] and [`URL`].
pub fn spawn_child(redis: &Redis, role: &str) -> Child {
    spawn_child_with(role, &redis.url)
}

/// [`spawn_child`] with any URL (or list of URLs) for the child.
pub fn spawn_child_with(role: &str, url: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_process", "--nocapture"])
        .env(ROLE, role)
        .env(URL, url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the test binary as a child")
}

/// Reads the child's stdout until a line starting with `DLIMIT ` and returns the rest.
pub async fn child_says(child: &mut Child) -> String {
    let stdout = child.stdout.as_mut().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let read = async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(said) = line.strip_prefix("DLIMIT ") {
                return said.to_owned();
            }
        }
        panic!("child exited without reporting");
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("child reported in time")
}
