//! The server-side cost of the semaphore's Lua script as its state grows, read from Redis's own
//! `INFO commandstats` (time spent inside `EVALSHA`), not from client wall time, which the
//! loopback round trip and the client runtime would dominate.
//!
//! Each scenario fills its semaphores with live holders (long leases, kept until the end), then
//! measures windows of uncontended `try_acquire` + `release` cycles (exactly two script calls
//! each), resetting the server's statistics (`CONFIG RESETSTAT`) before each window. Run with
//! `cargo bench --bench script`; it starts its own redis-server on a free loopback port.

use std::collections::BTreeMap;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tower_distributed_limit::{Permit, RedisBackend, Semaphore};

#[path = "../tests/support/mod.rs"]
mod support;

/// Each scenario is measured in `ROUNDS` windows of `CYCLES` cycles and reports the median
/// window: on a shared 2-core machine one window can catch a build or the client's own burst.
const ROUNDS: usize = 5;
const CYCLES: usize = 1_000;
/// Unmeasured cycles first, so the first scenario does not also pay for a cold server.
const WARM_UP: usize = 500;
/// Far above any scenario's holders, so every measured acquire is granted at once.
const LIMIT: u32 = 1_000_000;
/// Longer than the run, so no holder expires mid-measurement.
const LEASE: Duration = Duration::from_secs(3600);

struct Scenario {
    name: &'static str,
    prefix: &'static str,
    semaphores: usize,
    holders_each: usize,
}

const SCENARIOS: [Scenario; 4] = [
    Scenario {
        name: "1 semaphore, 10 holders",
        prefix: "ten",
        semaphores: 1,
        holders_each: 10,
    },
    Scenario {
        name: "1 semaphore, 1 000 holders",
        prefix: "thousand",
        semaphores: 1,
        holders_each: 1_000,
    },
    Scenario {
        name: "1 semaphore, 10 000 holders",
        prefix: "ten-thousand",
        semaphores: 1,
        holders_each: 10_000,
    },
    Scenario {
        name: "1 000 semaphores, 3 holders each",
        prefix: "sem",
        semaphores: 1_000,
        holders_each: 3,
    },
];

/// `INFO commandstats` as command -> (calls, total µs).
type CommandStats = BTreeMap<String, (u64, u64)>;

/// Commands the script ran, as Redis counts those called from Lua too (their time is also
/// inside the script's): everything but the script calls and this bench's own commands.
fn inner_commands(stats: &CommandStats) -> impl Iterator<Item = (&str, (u64, u64))> {
    stats
        .iter()
        .filter(|(name, _)| {
            !matches!(name.as_str(), "evalsha" | "info") && !name.starts_with("config")
        })
        .map(|(name, &counts)| (name.as_str(), counts))
}

/// Fills the scenario's semaphores, warms up, then measures `ROUNDS` windows of `CYCLES`
/// cycles spread over them. Returns each window's statistics and the holders, which must
/// outlive every scenario.
async fn run(
    scenario: &Scenario,
    backend: &RedisBackend,
    stats: &mut MultiplexedConnection,
) -> (Vec<CommandStats>, Vec<Permit>) {
    let semaphores: Vec<Semaphore> = (0..scenario.semaphores)
        .map(|i| {
            Semaphore::builder(format!("{}-{i}", scenario.prefix))
                .limit(LIMIT)
                .lease(LEASE)
                .build(backend.clone())
                .expect("valid settings")
        })
        .collect();
    let mut holders = Vec::with_capacity(scenario.semaphores * scenario.holders_each);
    for sem in &semaphores {
        for _ in 0..scenario.holders_each {
            holders.push(sem.acquire().await.expect("pre-fill acquire"));
        }
    }

    cycles(&semaphores, WARM_UP).await;
    let mut windows = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(stats)
            .await
            .expect("CONFIG RESETSTAT");
        cycles(&semaphores, CYCLES).await;
        let window = support::commandstats(stats).await;
        assert_eq!(
            window.get("evalsha").map_or(0, |&(calls, _)| calls),
            2 * CYCLES as u64,
            "one script call per acquire and per release, and nothing else in the window"
        );
        windows.push(window);
    }
    (windows, holders)
}

/// `count` uncontended acquire + release cycles, round-robin over `semaphores`.
async fn cycles(semaphores: &[Semaphore], count: usize) {
    for sem in semaphores.iter().cycle().take(count) {
        let mut permit = sem
            .try_acquire()
            .await
            .expect("acquire")
            .expect("far below the limit");
        // Explicit, so the release is a script call of its own inside the window.
        permit.release().await.expect("release");
    }
}

/// One scenario's line: its median window, the spread over all windows, and what the script
/// ran (summed over the windows).
fn report(name: &str, windows: &[CommandStats]) -> String {
    let mut per_call: Vec<f64> = windows
        .iter()
        .map(|window| {
            let (calls, usec) = window["evalsha"];
            usec as f64 / calls as f64
        })
        .collect();
    per_call.sort_by(f64::total_cmp);
    let calls: u64 = windows.iter().map(|window| window["evalsha"].0).sum();
    let mut inner = CommandStats::new();
    for window in windows {
        for (command, (n, usec)) in inner_commands(window) {
            let total = inner.entry(command.to_owned()).or_default();
            total.0 += n;
            total.1 += usec;
        }
    }
    let (inner_calls, inner_usec) = inner
        .values()
        .fold((0, 0), |(n, usec), &(m, v)| (n + m, usec + v));
    let spread = format!("{:.2}-{:.2}", per_call[0], per_call[per_call.len() - 1]);
    let cycles = (ROUNDS * CYCLES) as f64;
    let breakdown: Vec<String> = inner
        .iter()
        .map(|(command, &(n, _))| format!("{command} {}", n as f64 / cycles))
        .collect();
    format!(
        "{name:<34} {calls:>7} {:>9.2} {spread:>12} {:>10.2} {:>10.2}\n    per cycle: {}",
        per_call[per_call.len() / 2],
        inner_calls as f64 / calls as f64,
        inner_usec as f64 / calls as f64,
        breakdown.join(", ")
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let redis = support::Redis::start().await;
    let backend = redis.backend().await;
    let mut stats = redis.conn().await;
    let version: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut stats)
        .await
        .expect("INFO server");
    let version = version
        .lines()
        .find_map(|line| line.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .to_owned();

    println!(
        "semaphore script, server side (INFO commandstats), redis {version}: per scenario \
         {ROUNDS} windows of {CYCLES} try_acquire + release cycles; µs per script call is the \
         median window (min-max of all); inner = commands the script ran, per script call\n"
    );
    println!(
        "{:<34} {:>7} {:>9} {:>12} {:>10} {:>10}",
        "scenario", "calls", "µs/call", "min-max", "inner cmds", "inner µs"
    );
    // Dropped holders would be released in the background, maybe inside a later window.
    let mut kept = Vec::new();
    for scenario in &SCENARIOS {
        let (windows, holders) = run(scenario, &backend, &mut stats).await;
        kept.push(holders);
        println!("{}", report(scenario.name, &windows));
    }
}
