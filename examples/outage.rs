//! What a Redis outage costs a service, row by row (issue 20's table): a redis-server of its
//! own on a free loopback port, killed, paused, never started, spoken TLS to, or protected by
//! a password. Prints one `row | figure` line per measurement. Run through
//! `scripts/bench-outage`, which can put an older build's figures beside these.
//!
//! `cargo run --release --example outage`

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tower::ServiceBuilder;
use tower_distributed_limit::{
    DistributedConcurrencyLimitLayer, Error, OutagePolicy, RedisBackend, RedisBackendBuilder,
    Semaphore,
};

const CALL: Duration = Duration::from_millis(100);
const CONNECT: Duration = Duration::from_millis(100);

struct Server {
    child: Child,
    port: u16,
    args: Vec<String>,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let child = spawn(port, &args);
        Server { child, port, args }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn restart(&mut self) {
        self.child = spawn(self.port, &self.args);
    }

    fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

fn spawn(port: u16, args: &[String]) -> Child {
    let child = Command::new("redis-server")
        .args([
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--port",
        ])
        .arg(port.to_string())
        .args(args)
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server on PATH");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

fn quick(url: &str) -> RedisBackendBuilder {
    RedisBackend::builder(url)
        .call_timeout(CALL)
        .connect_timeout(CONNECT)
}

/// The only way this build has to start while Redis is down.
async fn start_without_redis(builder: RedisBackendBuilder) -> Result<RedisBackend, Error> {
    builder.connect_lazy()
}

fn row(what: &str, figure: String) {
    println!("{what} | {figure}");
}

fn median_max(mut times: Vec<Duration>) -> (Duration, Duration) {
    times.sort();
    (times[times.len() / 2], times[times.len() - 1])
}

async fn timed_acquires(sem: &Semaphore, n: usize) -> Vec<Duration> {
    let mut times = Vec::new();
    for _ in 0..n {
        let started = Instant::now();
        let _ = sem.acquire().await;
        times.push(started.elapsed());
    }
    times
}

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
        total += task.await.unwrap_or(0);
    }
    total
}

/// Two processes' worth of tasks (two backends × 20) holding a limit of 4 for 2 ms each,
/// Redis paused for 700 ms: when the holds per 100 ms after SIGCONT first reach 90 % of those
/// before (or "never" within 3 s), and the holds in the 2 s after against the 2 s before.
async fn pause_under_load(server: &Server) -> (String, u64, u64) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let holds = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let backend = quick(&server.url()).connect().await.expect("connect");
        let sem = Semaphore::builder("pause-load")
            .limit(4)
            .lease(Duration::from_secs(10))
            .acquire_timeout(Duration::from_millis(300))
            .build(backend)
            .expect("valid settings");
        for _ in 0..20 {
            let (sem, holds, stop) = (sem.clone(), holds.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    match sem.acquire().await {
                        Ok(permit) => {
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            drop(permit);
                            holds.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                    }
                }
            }));
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = holds.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = holds.load(Ordering::Relaxed) - start;
    server.signal("STOP");
    tokio::time::sleep(Duration::from_millis(700)).await;
    server.signal("CONT");
    let resumed = Instant::now();
    let (mut back, mut after) = (None, 0);
    for window in 0..30 {
        let at = holds.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let n = holds.load(Ordering::Relaxed) - at;
        if back.is_none() && n * 20 >= before * 9 / 10 {
            back = Some(resumed.elapsed());
        }
        if window < 20 {
            after += n;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = task.await;
    }
    let back = back.map_or_else(|| "never within 3 s".to_owned(), |t| format!("{t:.0?}"));
    (back, after, before)
}

fn semaphore(name: &str, policy: OutagePolicy, backend: RedisBackend) -> Semaphore {
    Semaphore::builder(name)
        .limit(8)
        .on_outage(policy)
        .build(backend)
        .expect("valid settings")
}

#[tokio::main]
async fn main() {
    // Redis killed, FailClosed: 60 sequential acquires.
    let mut server = Server::start(&[]);
    let backend = quick(&server.url()).connect().await.expect("connect");
    let closed = semaphore("closed", OutagePolicy::FailClosed, backend.clone());
    drop(closed.acquire().await);
    server.kill();
    let (median, max) = median_max(timed_acquires(&closed, 60).await);
    row(
        "killed, FailClosed: refusal median / max",
        format!("{median:.1?} / {max:.1?}"),
    );

    // FailOpen throughput, up and dead.
    server.restart();
    let open = semaphore("open", OutagePolicy::FailOpen, backend.clone());
    let deadline = Instant::now() + Duration::from_secs(10);
    while open.acquire().await.is_ok_and(|p| p.is_degraded()) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let up = admissions(&open, Duration::from_secs(1)).await;
    server.kill();
    let down = admissions(&open, Duration::from_secs(1)).await;
    row(
        "FailOpen admissions/s, Redis up / dead",
        format!("{up} / {down} ({:.2}x)", down as f64 / up.max(1) as f64),
    );

    // Redis paused, FailClosed: the acquires after the first timeout.
    server.restart();
    let paused = semaphore("paused", OutagePolicy::FailClosed, backend.clone());
    let deadline = Instant::now() + Duration::from_secs(10);
    while paused.acquire().await.is_err() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.signal("STOP");
    let first = timed_acquires(&paused, 1).await[0];
    let (median, max) = median_max(timed_acquires(&paused, 30).await);
    server.signal("CONT");
    row(
        "paused, FailClosed: first / later median / later max",
        format!("{first:.1?} / {median:.1?} / {max:.1?}"),
    );

    // Paused for 700 ms under load: how soon the holds per 100 ms are back, given the slots
    // given back meanwhile.
    let (back, after, before) = pause_under_load(&server).await;
    row(
        "paused 700 ms under load (2 × 20 tasks, limit 4, lease 10 s): back to 90 % after / \
         holds in the 2 s after vs the 2 s before",
        format!("{back} / {after} vs {before}"),
    );

    // Starting while Redis is down, then Redis starts.
    server.kill();
    let started = Instant::now();
    match start_without_redis(quick(&server.url())).await {
        Ok(lazy) => {
            let built = started.elapsed();
            let sem = semaphore("lazy", OutagePolicy::FailClosed, lazy);
            server.restart();
            let up = Instant::now();
            let deadline = up + Duration::from_secs(10);
            while sem.acquire().await.is_err() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            row(
                "start while Redis is down: built in / serving after Redis starts",
                format!("{built:.1?} / {:.0?}", up.elapsed()),
            );
        }
        Err(e) => {
            server.restart();
            row(
                "start while Redis is down: built in / serving after Redis starts",
                format!("impossible ({:.0?}): {e}", started.elapsed()),
            );
        }
    }

    // rediss:// to a plain port.
    let started = Instant::now();
    let tls = RedisBackend::builder(server.url().replace("redis://", "rediss://").as_str())
        .connect_timeout(Duration::from_millis(500))
        .connect()
        .await;
    row(
        "rediss:// to a plain port, connect_timeout 500 ms: fails after",
        format!("{:.0?} ({})", started.elapsed(), tls.is_err()),
    );

    // load_shed over acquire_in_poll_ready, one request at a time, never full.
    let sem = Semaphore::builder("shed")
        .limit(4)
        .build(RedisBackend::connect(&server.url()).await.expect("connect"))
        .expect("valid settings");
    // Through an axum server, as a service meets LoadShed: one client, one request after
    // another.
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(
            ServiceBuilder::new()
                .layer(axum::error_handling::HandleErrorLayer::new(
                    |_: tower::BoxError| async { http::StatusCode::SERVICE_UNAVAILABLE },
                ))
                .load_shed()
                .layer(DistributedConcurrencyLimitLayer::new(sem).acquire_in_poll_ready()),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let mut shed = 0;
    for _ in 0..50 {
        let uri = format!("http://{addr}/").parse().expect("a URI");
        match client.get(uri).await {
            Ok(response) if response.status() == http::StatusCode::OK => {}
            _ => shed += 1,
        }
    }
    row(
        "load_shed over HTTP, one request at a time, free semaphore: shed",
        format!("{shed} of 50"),
    );

    // A password nobody gave.
    let guarded = Server::start(&["--requirepass", "s3cret"]);
    let message = match RedisBackend::connect(&guarded.url()).await {
        Ok(_) => "connected".to_owned(),
        Err(e) => {
            let mut text = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                text.push_str(" <- ");
                text.push_str(&cause.to_string());
                source = cause.source();
            }
            text
        }
    };
    row("no password given: the error chain", message);
}
