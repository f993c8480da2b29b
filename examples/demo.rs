//! Four simulated service instances share one global limit of 6 requests in flight.
//!
//! Each instance has its own backend connection, as separate processes would, and sends bursts
//! of requests of uneven length. Every 250 ms the demo prints how many hold a slot against the
//! limit, then a summary. With `REDIS_URL` set (e.g. `redis://127.0.0.1:6379`) the permits live
//! in Redis, so you can also start the demo on several machines at once; otherwise the
//! in-process backend stands in.
//!
//! ```sh
//! cargo run --example demo
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example demo
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tower::BoxError;
use tower_distributed_limit::{Error, MemoryBackend, Semaphore};

mod support;

const LIMIT: u32 = 6;
const INSTANCES: usize = 4;
const WORKERS_PER_INSTANCE: usize = 5;
const RUN_FOR: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Stats {
    in_flight: AtomicU32,
    max_in_flight: AtomicU32,
    served: AtomicU64,
    waited_us: AtomicU64,
    timeouts: AtomicU64,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let redis_url = std::env::var("REDIS_URL").ok();
    match &redis_url {
        Some(url) => println!("backend: Redis at {url}"),
        None => println!("backend: in-process (set REDIS_URL to share the limit through Redis)"),
    }
    let memory = MemoryBackend::new();
    let stats = Arc::new(Stats::default());
    let per_instance: Vec<Arc<AtomicU32>> = (0..INSTANCES).map(|_| Arc::default()).collect();
    let deadline = Instant::now() + RUN_FOR;

    let mut workers = Vec::new();
    for (instance, holding) in per_instance.iter().enumerate() {
        // One semaphore object per instance, as each process would build its own.
        let builder = Semaphore::builder("demo-upstream")
            .limit(LIMIT)
            .lease(Duration::from_secs(10))
            .acquire_timeout(Duration::from_secs(3));
        let sem = match &redis_url {
            Some(url) => builder.build(support::redis(url).await?)?,
            None => builder.build(memory.clone())?,
        };
        for worker in 0..WORKERS_PER_INSTANCE {
            let (sem, stats, holding) = (sem.clone(), stats.clone(), holding.clone());
            workers.push(tokio::spawn(async move {
                let mut n = (instance * WORKERS_PER_INSTANCE + worker) as u64;
                while Instant::now() < deadline {
                    let asked = Instant::now();
                    let mut permit = match sem.acquire().await {
                        Ok(permit) => permit,
                        Err(Error::Timeout { .. }) => {
                            stats.timeouts.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        Err(e) => {
                            eprintln!("instance {instance}: {e}");
                            return;
                        }
                    };
                    let waited = asked.elapsed().as_micros() as u64;
                    stats.waited_us.fetch_add(waited, Ordering::Relaxed);
                    let now = stats.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    stats.max_in_flight.fetch_max(now, Ordering::SeqCst);
                    holding.fetch_add(1, Ordering::SeqCst);
                    // A request of 20 to 120 ms.
                    n = n
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    tokio::time::sleep(Duration::from_millis(20 + (n >> 33) % 100)).await;
                    holding.fetch_sub(1, Ordering::SeqCst);
                    stats.in_flight.fetch_sub(1, Ordering::SeqCst);
                    stats.served.fetch_add(1, Ordering::Relaxed);
                    // Dropping would release in the background; releasing here also makes sure
                    // nothing is left in Redis when the demo exits.
                    if let Err(e) = permit.release().await {
                        eprintln!("instance {instance}: {e}");
                    }
                }
            }));
        }
    }

    let mut tick = tokio::time::interval(Duration::from_millis(250));
    while Instant::now() < deadline {
        tick.tick().await;
        let now = stats.in_flight.load(Ordering::SeqCst);
        let bar: String = (0..LIMIT)
            .map(|slot| if slot < now { '#' } else { '.' })
            .collect();
        let instances: Vec<String> = per_instance
            .iter()
            .enumerate()
            .map(|(i, h)| format!("{}:{}", (b'A' + i as u8) as char, h.load(Ordering::SeqCst)))
            .collect();
        println!(
            "in flight {now}/{LIMIT} [{bar}]  per instance {}  served {}",
            instances.join(" "),
            stats.served.load(Ordering::Relaxed)
        );
    }
    for worker in workers {
        let _ = worker.await;
    }

    let served = stats.served.load(Ordering::Relaxed);
    let max = stats.max_in_flight.load(Ordering::SeqCst);
    println!("--- summary ---");
    println!(
        "{INSTANCES} instances x {WORKERS_PER_INSTANCE} workers, global limit {LIMIT}, {:?}",
        RUN_FOR
    );
    println!("requests served: {served}");
    println!("most in flight at once: {max} (limit {LIMIT})");
    println!(
        "mean wait for a slot: {:.1} ms, timeouts: {}",
        stats.waited_us.load(Ordering::Relaxed) as f64 / served.max(1) as f64 / 1000.0,
        stats.timeouts.load(Ordering::Relaxed)
    );
    assert!(max <= LIMIT, "the limit was exceeded");
    Ok(())
}
