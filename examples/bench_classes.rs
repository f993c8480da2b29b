//! One process of `scripts/bench-classes` (the contract in WORKLOAD.md, "Classes"): half of the
//! load on one semaphore (limit 40, holds of 20 ms) on Redis, shared with the other process.
//!
//! ```text
//! cargo run --release --example bench_classes -- --redis URL --classes on|off --name NAME \
//!     [--reserve N]   # CRITICAL's reservation with classes on (default 16)
//! ```
//!
//! CRITICAL arrives open-loop at 30 % of capacity (capacity = 40 / 20 ms = 2000 holds/s; this
//! process offers half: 300/s), each acquire bounded by 200 ms. BATCH comes from 10 tenants,
//! tenant 0 sending 10× each other's: closed-loop workers, 8 in this process before and after
//! the spike, 240 during it (12 × the limit across both processes). Phases: 6 s before, 10 s
//! spike, 4 s after. BATCH requests name their tenant (`Ask::tenant`), so tenants are served
//! in turn. With `--classes off` every request is NORMAL, without a tenant (today's FIFO
//! line).
//!
//! Prints one line: `before <waits µs,...> spike <waits µs,...> offered <n> admitted <n>
//! batch <grants> flooder <grants> busy <mean in flight during the spike>`, CRITICAL's waits of
//! the admitted, phase by phase, and the spike's BATCH grants and this process's mean in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tower_distributed_limit::{Ask, Priority, RedisBackend, Semaphore, Share};

const HOLD: Duration = Duration::from_millis(20);
const BEFORE: Duration = Duration::from_secs(6);
const SPIKE: Duration = Duration::from_secs(10);
const AFTER: Duration = Duration::from_secs(4);

#[derive(Default)]
struct Tally {
    offered: AtomicU64,
    admitted: AtomicU64,
    batch: AtomicU64,
    flooder: AtomicU64,
    in_flight: AtomicU32,
    waits: std::sync::Mutex<(Vec<u64>, Vec<u64>)>,
}

fn arg(args: &[String], name: &str) -> Option<String> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).cloned()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let url = arg(&args, "--redis").ok_or("--redis URL is required")?;
    let classes = arg(&args, "--classes").is_none_or(|on| on == "on");
    let name = arg(&args, "--name").unwrap_or_else(|| "bench-classes".into());
    let reserve: u32 = arg(&args, "--reserve").map_or(Ok(16), |n| n.parse())?;
    let backend = RedisBackend::connect(url.as_str()).await?;
    let mut builder = Semaphore::builder(name)
        .limit(40)
        .acquire_timeout(Duration::from_secs(30))
        .max_waiters(100_000);
    if classes {
        builder = builder.class(Priority::CRITICAL, Share::reserved(reserve));
    }
    let sem = builder.build(backend)?;
    let (critical, batch) = if classes {
        (Priority::CRITICAL, Priority::BATCH)
    } else {
        (Priority::NORMAL, Priority::NORMAL)
    };
    let tally = Arc::new(Tally::default());
    let start = Instant::now();
    let spike_at = start + BEFORE;
    let spike_end = spike_at + SPIKE;
    let end = spike_end + AFTER;

    // BATCH: closed-loop workers; the spike's extra ones run only through it.
    let mut workers = Vec::new();
    for i in 0..240u32 {
        let (sem, tally) = (sem.clone(), tally.clone());
        let steady = i < 8;
        // 19 shares: tenant 0 has 10 of them, tenants 1..=9 one each.
        let flooding = i % 19 < 10;
        // With classes on, each BATCH request names its tenant, so tenants are served in turn.
        let ask = match (classes, flooding) {
            (false, _) => Ask::new().priority(batch),
            (true, true) => Ask::new().priority(batch).tenant("tenant-0"),
            (true, false) => Ask::new()
                .priority(batch)
                .tenant(format!("tenant-{}", i % 19 - 9)),
        };
        workers.push(tokio::spawn(async move {
            if !steady {
                tokio::time::sleep_until(spike_at).await;
            }
            let until = if steady { end } else { spike_end };
            while Instant::now() < until {
                let Ok(permit) = sem.acquire_with(ask.clone()).await else {
                    continue;
                };
                let now = Instant::now();
                if now >= spike_at && now < spike_end {
                    tally.batch.fetch_add(1, Ordering::Relaxed);
                    if flooding {
                        tally.flooder.fetch_add(1, Ordering::Relaxed);
                    }
                }
                tally.in_flight.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(HOLD).await;
                tally.in_flight.fetch_sub(1, Ordering::Relaxed);
                drop(permit);
            }
        }));
    }

    // CRITICAL: open loop, 300/s, each bounded by 200 ms.
    let arrivals = {
        let (sem, tally) = (sem.clone(), tally.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_micros(3333));
            while Instant::now() < end {
                tick.tick().await;
                let (sem, tally) = (sem.clone(), tally.clone());
                tokio::spawn(async move {
                    let asked = Instant::now();
                    let during_spike = asked >= spike_at && asked < spike_end;
                    if asked < spike_end {
                        tally.offered.fetch_add(1, Ordering::Relaxed);
                    }
                    let wait =
                        tokio::time::timeout(Duration::from_millis(200), sem.acquire_as(critical))
                            .await;
                    let Ok(Ok(permit)) = wait else { return };
                    let waited = asked.elapsed().as_micros() as u64;
                    if asked < spike_end {
                        tally.admitted.fetch_add(1, Ordering::Relaxed);
                        let mut waits = tally.waits.lock().unwrap();
                        if during_spike {
                            waits.1.push(waited)
                        } else {
                            waits.0.push(waited)
                        }
                    }
                    tally.in_flight.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(HOLD).await;
                    tally.in_flight.fetch_sub(1, Ordering::Relaxed);
                    drop(permit);
                });
            }
        })
    };

    // This process's in flight, sampled every 10 ms through the spike (its first second
    // left out: the line is filling).
    tokio::time::sleep_until(spike_at + Duration::from_secs(1)).await;
    let (mut sum, mut samples) = (0u64, 0u64);
    while Instant::now() < spike_end {
        sum += u64::from(tally.in_flight.load(Ordering::Relaxed));
        samples += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    arrivals.await?;
    for worker in workers {
        worker.await?;
    }
    let waits = tally.waits.lock().unwrap();
    let join = |v: &Vec<u64>| match v.is_empty() {
        true => "-".to_owned(),
        false => v.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
    };
    println!(
        "before {} spike {} offered {} admitted {} batch {} flooder {} busy {:.2}",
        join(&waits.0),
        join(&waits.1),
        tally.offered.load(Ordering::Relaxed),
        tally.admitted.load(Ordering::Relaxed),
        tally.batch.load(Ordering::Relaxed),
        tally.flooder.load(Ordering::Relaxed),
        sum as f64 / samples.max(1) as f64,
    );
    Ok(())
}
