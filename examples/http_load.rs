//! An axum "hello" server for HTTP load tests, with the middleware stack chosen on the command
//! line, so the cost of a concurrency limit per request can be measured with an external load
//! generator (`scripts/bench-http` drives it with `wrk`).
//!
//! ```sh
//! cargo build --release --example http_load
//! target/release/examples/http_load <STACK> [--port PORT] [--redis-url URL] [--name NAME]
//! ```
//!
//! `STACK` is one of:
//!
//! - `none`: no limit at all, the baseline;
//! - `tower`: tower's `ConcurrencyLimitLayer::new(64)`, a limit per process (its error type is
//!   the inner service's, so axum takes it as is: no error handling needed);
//! - `memory`: `DistributedConcurrencyLimitLayer` (`.http()`) over a `Semaphore` of limit 64 on
//!   `MemoryBackend`: the layer's own cost, without any network;
//! - `redis`: the same over `RedisBackend` (`--redis-url`, default `$REDIS_URL` or
//!   `redis://127.0.0.1:6379`), one semaphore named `--name` (default `http-load`);
//! - `redis-prefetch`: `redis` with `.prefetch(32)`: while nobody waits, up to 32 slots held
//!   ahead of need and handed out without a round trip.
//!
//! The server answers `GET /` with `hello` on `127.0.0.1:PORT` (default 3000), on tokio's
//! multi-thread runtime, and prints `ready: ...` once it accepts connections. It runs until
//! killed.

use std::time::Duration;

use axum::{Router, routing::get};
use tower::BoxError;
use tower::limit::ConcurrencyLimitLayer;
use tower_distributed_limit::{
    DistributedConcurrencyLimitLayer, MemoryBackend, RedisBackend, Semaphore,
};

/// The limit of every limited stack.
const LIMIT: u32 = 64;

/// The `redis-prefetch` stack's prefetch: wrk's 32 connections in flight at most.
const PREFETCH: u32 = 32;

const USAGE: &str = "usage: http_load <none|tower|memory|redis|redis-prefetch> [--port PORT] [--redis-url URL] [--name NAME]";

struct Args {
    stack: String,
    port: u16,
    redis_url: String,
    name: String,
}

fn parse_args() -> Result<Args, BoxError> {
    let mut args = Args {
        stack: String::new(),
        port: 3000,
        redis_url: std::env::var("REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned()),
        name: "http-load".to_owned(),
    };
    let mut argv = std::env::args().skip(1);
    while let Some(arg) = argv.next() {
        let mut value = |flag: &str| argv.next().ok_or_else(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "--port" => {
                let port = value("--port")?;
                args.port = port
                    .parse()
                    .map_err(|_| format!("--port {port:?} is not a port number"))?;
            }
            "--redis-url" => args.redis_url = value("--redis-url")?,
            "--name" => args.name = value("--name")?,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ if arg.starts_with('-') => return Err(format!("unknown option {arg:?}").into()),
            _ if args.stack.is_empty() => args.stack = arg,
            _ => return Err(format!("unexpected argument {arg:?}").into()),
        }
    }
    if args.stack.is_empty() {
        return Err("no stack given".into());
    }
    Ok(args)
}

async fn hello() -> &'static str {
    "hello"
}

/// The semaphore of the `memory` and `redis` stacks.
fn semaphore(name: &str) -> tower_distributed_limit::SemaphoreBuilder {
    Semaphore::builder(name)
        .limit(LIMIT)
        .acquire_timeout(Duration::from_secs(10))
}

async fn app(args: &Args) -> Result<Router, BoxError> {
    let router = Router::new().route("/", get(hello));
    Ok(match args.stack.as_str() {
        "none" => router,
        "tower" => router.layer(ConcurrencyLimitLayer::new(LIMIT as usize)),
        "memory" => {
            let sem = semaphore(&args.name).build(MemoryBackend::new())?;
            router.layer(DistributedConcurrencyLimitLayer::new(sem).http())
        }
        "redis" => {
            let redis = RedisBackend::connect(&args.redis_url)
                .await
                .map_err(|e| format!("cannot connect to {}: {e}", args.redis_url))?;
            let sem = semaphore(&args.name).build(redis)?;
            router.layer(DistributedConcurrencyLimitLayer::new(sem).http())
        }
        "redis-prefetch" => {
            let redis = RedisBackend::connect(&args.redis_url)
                .await
                .map_err(|e| format!("cannot connect to {}: {e}", args.redis_url))?;
            let sem = semaphore(&args.name).prefetch(PREFETCH).build(redis)?;
            router.layer(DistributedConcurrencyLimitLayer::new(sem).http())
        }
        other => return Err(format!("unknown stack {other:?}").into()),
    })
}

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("http_load: {e}\n{USAGE}");
        std::process::exit(2);
    }
}

async fn run() -> Result<(), BoxError> {
    let args = parse_args()?;
    let app = app(&args).await?;
    let addr = ("127.0.0.1", args.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on 127.0.0.1:{}: {e}", args.port))?;
    println!(
        "ready: stack {} on http://{} (limit {LIMIT}, {} worker threads)",
        args.stack,
        listener.local_addr()?,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    axum::serve(listener, app).await?;
    Ok(())
}
