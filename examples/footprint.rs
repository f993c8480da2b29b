//! One process of `scripts/bench-redis-footprint`: puts many waiters in line on one semaphore
//! in Redis at once (limit 10), to see what a long line costs the script calls every client
//! of the server waits behind.
//!
//! ```text
//! cargo run --release --example footprint -- --redis URL --name NAME --role ROLE \
//!     [--waiters N]      # how many acquire at once (default 2500)
//!     [--process P]      # this process's number, which keeps its tenants apart (default 0)
//!     [--tenants]        # each waiter a tenant of its own, in one of 3 classes
//!     [--go FILE]        # permits granted before FILE exists are held until it does
//!     [--linger-ms MS]   # drain: keep acquiring this long after the go (default 0)
//!     [--budget-ms MS]   # exit after this long whatever happens (default 180000)
//! ```
//!
//! Roles, each waiter one task calling `acquire_with` (a plain `Ask`, or its tenant and class):
//!
//! - `drain`: each permit is held 1 ms (held until the go while there is one), so the line is
//!   served to empty; then, until `--linger-ms` after the go, one acquire every 10 ms, so
//!   calls go on after the line is empty (a killed process's waiters leave it only with a
//!   call).
//! - `cancel`: every task, waiting or holding, is aborted at once at the go: a mass cancel.
//! - `stall`: the permits are never dropped: the process waits to be killed (SIGKILL).
//!
//! Prints one line when done: `acquired <n> failed <n>`, the acquisitions this process made
//! (for calls per acquire) and the acquires that ended in an error.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tower_distributed_limit::{Ask, Permit, Priority, RedisBackend, Semaphore, Share};

const LIMIT: u32 = 10;
const HOLD: Duration = Duration::from_millis(1);
/// Long enough that no waiter times out while 10 000 are served ahead of it.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(120);
/// Short, so a killed holder's slot comes back within the run (the keeper renews the others).
const LEASE: Duration = Duration::from_secs(5);
/// The gap between a lingering process's acquires.
const LINGER_PACE: Duration = Duration::from_millis(10);
/// How long a cancelled process stays up for its releases to go out (they are sent in the
/// background).
const AFTER_CANCEL: Duration = Duration::from_secs(2);

#[derive(Default)]
struct Tally {
    acquired: AtomicU64,
    failed: AtomicU64,
}

fn arg(args: &[String], name: &str) -> Option<String> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).cloned()
}

/// What waiter `i` asks: plain, or its own tenant in one of 3 classes.
fn ask(tenants: bool, process: u32, i: u32) -> Ask {
    if !tenants {
        return Ask::new();
    }
    let class = [Priority::CRITICAL, Priority::NORMAL, Priority::BATCH][i as usize % 3];
    Ask::new()
        .priority(class)
        .tenant(format!("tenant-{process}-{i}"))
}

async fn acquire(sem: &Semaphore, ask: Ask, tally: &Tally) -> Option<Permit> {
    match sem.acquire_with(ask).await {
        Ok(permit) => {
            tally.acquired.fetch_add(1, Ordering::Relaxed);
            Some(permit)
        }
        Err(_) => {
            tally.failed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let url = arg(&args, "--redis").ok_or("--redis URL is required")?;
    let name = arg(&args, "--name").ok_or("--name NAME is required")?;
    let role = arg(&args, "--role").ok_or("--role drain|cancel|stall is required")?;
    if !["drain", "cancel", "stall"].contains(&role.as_str()) {
        return Err(format!("unknown role {role:?}").into());
    }
    let waiters: u32 = arg(&args, "--waiters").map_or(Ok(2500), |n| n.parse())?;
    let process: u32 = arg(&args, "--process").map_or(Ok(0), |n| n.parse())?;
    let tenants = args.iter().any(|a| a == "--tenants");
    let go_file = arg(&args, "--go").map(PathBuf::from);
    let linger = Duration::from_millis(arg(&args, "--linger-ms").map_or(Ok(0), |n| n.parse())?);
    let budget =
        Duration::from_millis(arg(&args, "--budget-ms").map_or(Ok(180_000), |n| n.parse())?);

    let backend = RedisBackend::builder(url.as_str()).connect().await?;
    let mut builder = Semaphore::builder(name)
        .limit(LIMIT)
        .lease(LEASE)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .max_waiters(waiters as usize + 100);
    if tenants {
        builder = builder
            .class(Priority::CRITICAL, Share::reserved(3))
            .class(Priority::BATCH, Share::at_most(6))
            .per_tenant(Share::at_most(1));
    }
    let sem = builder.build(backend)?;
    let tally = Arc::new(Tally::default());

    // The go, watched by one task rather than by every holder.
    let (went, go) = watch::channel(go_file.is_none());
    if let Some(file) = go_file {
        tokio::spawn(async move {
            while !file.exists() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let _ = went.send(true);
        });
    }

    let run = {
        let tally = tally.clone();
        async move {
            let tasks: Vec<_> = (0..waiters)
                .map(|i| {
                    let (sem, tally, role) = (sem.clone(), tally.clone(), role.clone());
                    let mut go = go.clone();
                    tokio::spawn(async move {
                        let Some(permit) = acquire(&sem, ask(tenants, process, i), &tally).await
                        else {
                            return;
                        };
                        if role == "stall" {
                            std::future::pending::<()>().await;
                        }
                        let _ = go.wait_for(|went| *went).await;
                        if role == "drain" {
                            tokio::time::sleep(HOLD).await;
                        }
                        drop(permit);
                    })
                })
                .collect();
            let mut go = go.clone();
            let _ = go.wait_for(|went| *went).await;
            let went_at = Instant::now();
            match role.as_str() {
                "cancel" => {
                    // Every waiting future dropped together, then time for the releases.
                    for task in &tasks {
                        task.abort();
                    }
                    tokio::time::sleep(AFTER_CANCEL).await;
                }
                "stall" => std::future::pending::<()>().await,
                _ => {
                    for task in tasks {
                        let _ = task.await;
                    }
                    // Paced, not closed-loop: calls go on, without a load of their own.
                    while Instant::now() < went_at + linger {
                        if let Some(permit) = acquire(&sem, Ask::new(), &tally).await {
                            tokio::time::sleep(HOLD).await;
                            drop(permit);
                        }
                        tokio::time::sleep(LINGER_PACE).await;
                    }
                }
            }
        }
    };
    let finished = tokio::time::timeout(budget, run).await.is_ok();
    println!(
        "acquired {} failed {}",
        tally.acquired.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed)
    );
    // Out without waiting for stalled tasks or the runtime's shutdown.
    std::process::exit(if finished { 0 } else { 2 })
}
