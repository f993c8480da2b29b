//! The downstream of `scripts/bench-adaptive`: an HTTP server with a true capacity of `C`
//! requests at once, settable while it runs, so an adaptive limit has something to find.
//!
//! ```sh
//! cargo build --release --example adaptive_downstream
//! target/release/examples/adaptive_downstream [--port PORT] [--capacity C] [--base-ms MS]
//! curl -X PUT http://127.0.0.1:PORT/capacity/120   # C = 120 from now on
//! curl http://127.0.0.1:PORT/stats                 # "<in flight> <C> <completed> <now ms> <busy>"
//! ```
//!
//! # The model: processor sharing over `C` workers
//!
//! Every request (`GET /`) brings `base` (default 10 ms) of work. The server has `C` workers;
//! while `n` requests are in flight, each progresses at `min(1, C / n)` of a worker's speed:
//! at most `C` in flight, a request takes exactly `base`; beyond `C`, the `n` requests share the
//! `C` workers evenly, so each takes `base × n / C` if `n` stays put, and in general its time
//! is `base` of work at the rate of every instant it is in flight. It is the egalitarian
//! processor-sharing queue, not FIFO: nothing waits in a line, every request slows down
//! together, as a CPU-bound server with `C` cores does.
//!
//! It is simulated in virtual time, one clock for the whole server: `V` advances at
//! `dV/dt = min(1, C / n)`, a request that arrives at `V = v` finishes when `V = v + base`.
//! One scheduler thread (a plain OS thread with a condition variable, for timing to tens of
//! µs rather than tokio's 1 ms timer) advances `V` at every arrival, completion and change of
//! `C`, and sleeps until the next completion is due. A change of `C` applies from that
//! instant to the remaining work of every request in flight.
//!
//! "In flight" counts requests from the handler's start to the end of their work (not the
//! HTTP parsing around it). `/stats` answers `<in flight> <C> <completed> <unix ms> <busy>`,
//! `busy` being the integral of the in-flight count over time (request·ms), whose growth
//! between two readings divided by the time between them is the mean in flight;
//! `PUT /capacity/{C}` sets `C` (at least 1) and prints `capacity <C> at_ms <unix ms>` on
//! stdout, so the bench knows when each step happened. It prints `ready: http://ADDR` once it
//! accepts connections, and runs until killed.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, put};
use axum::serve::ListenerExt;
use axum::{Router, serve};
use tokio::sync::oneshot;
use tower::BoxError;

const USAGE: &str = "usage: adaptive_downstream [--port PORT] [--capacity C] [--base-ms MS]";

/// The processor-sharing queue, in virtual time (ms of work done by each request in flight).
struct Queue {
    capacity: u32,
    /// The virtual time at `at`.
    virtual_ms: f64,
    at: Instant,
    /// Requests in flight by (virtual finish time in µs, arrival number).
    active: BTreeMap<(u64, u64), oneshot::Sender<()>>,
    arrivals: u64,
    completed: u64,
    /// The integral of the in-flight count over real time (request·ms), for time averages.
    busy_ms: f64,
}

impl Queue {
    /// How fast virtual time runs now: each request's share of a worker.
    fn rate(&self) -> f64 {
        let n = self.active.len().max(1) as f64;
        (f64::from(self.capacity) / n).min(1.0)
    }

    /// Brings the virtual clock to `now` and finishes every request whose work is done.
    fn advance(&mut self, now: Instant) {
        // Completions are processed in order: the rate changes after each one.
        loop {
            let elapsed = now.saturating_duration_since(self.at).as_secs_f64() * 1e3;
            let rate = self.rate();
            let n = self.active.len() as f64;
            let due_in = match self.active.first_key_value() {
                Some((&(finish_us, _), _)) => (finish_us as f64 / 1e3 - self.virtual_ms) / rate,
                None => f64::INFINITY,
            };
            if due_in > elapsed {
                self.virtual_ms += elapsed * rate;
                self.busy_ms += n * elapsed;
                self.at = now;
                return;
            }
            // The first finishes within this step: advance to its finish, complete it, go on.
            let due_in = due_in.max(0.0);
            self.virtual_ms += due_in * rate;
            self.busy_ms += n * due_in;
            self.at += Duration::from_secs_f64(due_in / 1e3);
            let (_, done) = self.active.pop_first().expect("a first key was seen");
            self.completed += 1;
            let _ = done.send(());
        }
    }

    /// The real time until the next completion, if any request is in flight.
    fn next_due(&self) -> Option<Duration> {
        let (&(finish_us, _), _) = self.active.first_key_value()?;
        let due_ms = (finish_us as f64 / 1e3 - self.virtual_ms).max(0.0) / self.rate();
        Some(Duration::from_secs_f64(due_ms / 1e3))
    }
}

struct Server {
    queue: Mutex<Queue>,
    /// Wakes the scheduler thread at an arrival or a change of capacity.
    changed: Condvar,
    base_ms: f64,
}

impl Server {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The scheduler thread: finishes requests as their work completes.
    fn schedule(&self) {
        let mut queue = self.queue();
        loop {
            queue.advance(Instant::now());
            queue = match queue.next_due() {
                Some(due) => {
                    self.changed
                        .wait_timeout(queue, due)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.changed.wait(queue).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }

    /// One request's work: `base` at this server's shared rate.
    async fn work(&self) {
        let (done, finished) = oneshot::channel();
        {
            let mut queue = self.queue();
            queue.advance(Instant::now());
            let finish_us = ((queue.virtual_ms + self.base_ms) * 1e3).round() as u64;
            queue.arrivals += 1;
            let key = (finish_us, queue.arrivals);
            queue.active.insert(key, done);
        }
        self.changed.notify_one();
        // The sender is only dropped once the work is done (or the server stops).
        let _ = finished.await;
    }
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

async fn request(State(server): State<Arc<Server>>) -> &'static str {
    server.work().await;
    "done"
}

async fn stats(State(server): State<Arc<Server>>) -> String {
    let mut queue = server.queue();
    queue.advance(Instant::now());
    format!(
        "{} {} {} {} {:.0}\n",
        queue.active.len(),
        queue.capacity,
        queue.completed,
        unix_ms(),
        queue.busy_ms
    )
}

async fn set_capacity(
    State(server): State<Arc<Server>>,
    Path(capacity): Path<u32>,
) -> Result<String, StatusCode> {
    if capacity == 0 {
        return Err(StatusCode::BAD_REQUEST);
    }
    {
        let mut queue = server.queue();
        queue.advance(Instant::now());
        queue.capacity = capacity;
    }
    server.changed.notify_one();
    let line = format!("capacity {capacity} at_ms {}\n", unix_ms());
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(line.as_bytes());
    let _ = stdout.flush();
    Ok(line)
}

struct Args {
    port: u16,
    capacity: u32,
    base_ms: f64,
}

fn parse_args() -> Result<Args, BoxError> {
    let mut args = Args {
        port: 3000,
        capacity: 40,
        base_ms: 10.0,
    };
    let mut argv = std::env::args().skip(1);
    while let Some(arg) = argv.next() {
        let mut value = |flag: &str| argv.next().ok_or_else(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "--port" => args.port = value("--port")?.parse()?,
            "--capacity" => args.capacity = value("--capacity")?.parse()?,
            "--base-ms" => args.base_ms = value("--base-ms")?.parse()?,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => return Err(format!("unexpected argument {arg:?}").into()),
        }
    }
    if args.capacity == 0 || args.base_ms.is_nan() || args.base_ms <= 0.0 {
        return Err("--capacity and --base-ms must be positive".into());
    }
    Ok(args)
}

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("adaptive_downstream: {e}\n{USAGE}");
        std::process::exit(2);
    }
}

async fn run() -> Result<(), BoxError> {
    let args = parse_args()?;
    let server = Arc::new(Server {
        queue: Mutex::new(Queue {
            capacity: args.capacity,
            virtual_ms: 0.0,
            at: Instant::now(),
            active: BTreeMap::new(),
            arrivals: 0,
            completed: 0,
            busy_ms: 0.0,
        }),
        changed: Condvar::new(),
        base_ms: args.base_ms,
    });
    let scheduler = server.clone();
    std::thread::Builder::new()
        .name("scheduler".into())
        .spawn(move || scheduler.schedule())?;

    let app = Router::new()
        .route("/", get(request))
        .route("/stats", get(stats))
        .route("/capacity/{capacity}", put(set_capacity))
        .with_state(server);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port))
        .await
        .map_err(|e| format!("cannot listen on 127.0.0.1:{}: {e}", args.port))?;
    println!(
        "ready: http://{} capacity {} base {} ms",
        listener.local_addr()?,
        args.capacity,
        args.base_ms
    );
    std::io::stdout().flush()?;
    // No Nagle delay on the answers (the clients set TCP_NODELAY too).
    let listener = listener.tap_io(|stream| {
        let _ = stream.set_nodelay(true);
    });
    serve(listener, app).await?;
    Ok(())
}
