//! `dlimit`: look at and change live semaphores from the command line (feature `cli`).
//!
//! ```text
//! dlimit --url redis://127.0.0.1:6379 list
//! dlimit --url redis://127.0.0.1:6379 show llm-api [--json]
//! dlimit --url redis://127.0.0.1:6379 set-limit llm-api 50
//! dlimit --url redis://127.0.0.1:6379 release llm-api 3f2a...   # evict a stuck holder
//! ```
//!
//! `--url` takes a comma-separated list of nodes for a Redis Cluster (`list` scans each).

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tower_distributed_limit::{Error, RedisBackend, Semaphore, Snapshot};

#[derive(Parser)]
#[command(
    name = "dlimit",
    version,
    about = "Look at and change tower-distributed-limit semaphores"
)]
struct Cli {
    /// The Redis URL (`redis://`, `rediss://`), or a comma-separated list of Cluster nodes.
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    url: String,
    /// The key prefix the services use (`RedisBackend::key_prefix`).
    #[arg(long, default_value = "dlimit:")]
    prefix: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Every semaphore in use or with a limit set, with used / limit / waiting.
    List,
    /// One semaphore: its limit in force, use, waiters and holders.
    Show {
        name: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Set the limit every process admits by, at once and until set again.
    SetLimit { name: String, limit: u32 },
    /// Evict a stuck holder by its id (see `show`).
    Release { name: String, holder_id: String },
}

/// Asked for by this tool, the limit is a placeholder: a semaphore with no limit stored (idle,
/// never used) reports it back, and it is shown as `-`.
const NO_LIMIT: u32 = u32::MAX;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dlimit: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<(), Error> {
    let nodes: Vec<&str> = cli.url.split(',').map(str::trim).collect();
    let backend = if nodes.len() > 1 {
        RedisBackend::cluster_builder(&nodes)
    } else {
        RedisBackend::builder(cli.url.as_str())
    }
    .key_prefix(cli.prefix.clone())
    .call_timeout(Duration::from_secs(2))
    .connect_timeout(Duration::from_secs(2))
    .connect()
    .await?;
    let semaphore = |name: &str| {
        Semaphore::builder(name)
            .limit(NO_LIMIT)
            .build(backend.clone())
    };
    match cli.command {
        Command::List => {
            let mut names = Vec::new();
            for node in &nodes {
                names.extend(scan(node, &cli.prefix).await?);
            }
            names.sort();
            names.dedup();
            println!(
                "{:<40} {:>8} {:>8} {:>8}",
                "NAME", "USED", "LIMIT", "WAITING"
            );
            for name in names {
                let snap = semaphore(&name)?.snapshot().await?;
                println!(
                    "{:<40} {:>8} {:>8} {:>8}",
                    name,
                    snap.used,
                    limit(&snap),
                    snap.waiting
                );
            }
        }
        Command::Show { name, json } => {
            let snap = semaphore(&name)?.snapshot().await?;
            if json {
                println!("{}", to_json(&name, &snap));
            } else {
                println!(
                    "semaphore {name}: {} of {} used, {} waiting",
                    snap.used,
                    limit(&snap),
                    snap.waiting
                );
                println!(
                    "{:<34} {:>6} {:>12} {:>14}",
                    "HOLDER", "WEIGHT", "HELD FOR", "LEASE LEFT"
                );
                for holder in &snap.holders {
                    println!(
                        "{:<34} {:>6} {:>12} {:>14}",
                        holder.id,
                        holder.weight,
                        format!("{:.1?}", holder.held_for),
                        format!("{:.1?}", holder.lease_remaining)
                    );
                }
            }
        }
        Command::SetLimit { name, limit } => {
            semaphore(&name)?.set_limit(limit).await?;
            println!("semaphore {name}: every process now admits by a limit of {limit}");
        }
        Command::Release { name, holder_id } => {
            if semaphore(&name)?.evict(&holder_id).await? {
                println!(
                    "semaphore {name}: holder {holder_id} evicted; its slot goes to the next waiter. \
                     The evicted process learns at its next renewal; until then it may still act, \
                     so resources must check fencing tokens (the next holder's is higher)"
                );
            } else {
                return Err(Error::Config(format!(
                    "semaphore {name} has no holder {holder_id}; see `dlimit show {name}`"
                )));
            }
        }
    }
    Ok(())
}

fn limit(snap: &Snapshot) -> String {
    if snap.limit == NO_LIMIT {
        "-".into()
    } else {
        snap.limit.to_string()
    }
}

/// The semaphores under `prefix` on one node, found with SCAN (never KEYS): each has a `meta`
/// key while it is used or has a limit set.
async fn scan(url: &str, prefix: &str) -> Result<Vec<String>, Error> {
    let fail =
        |e: redis::RedisError| Error::Config(format!("cannot list the semaphores at {url}: {e}"));
    let client = redis::Client::open(url).map_err(fail)?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(fail)?;
    let pattern = format!("{prefix}{{*}}:meta");
    let mut cursor = 0u64;
    let mut names = Vec::new();
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .map_err(fail)?;
        names.extend(keys.iter().filter_map(|key| name_of(key, prefix)));
        if next == 0 {
            return Ok(names);
        }
        cursor = next;
    }
}

/// The semaphore name in `{prefix}{<tag>}:meta`, undoing the tag's percent-encoding of `%`,
/// `{` and `}`.
fn name_of(key: &str, prefix: &str) -> Option<String> {
    let tag = key
        .strip_prefix(prefix)?
        .strip_prefix('{')?
        .strip_suffix("}:meta")?;
    Some(
        tag.replace("%7B", "{")
            .replace("%7D", "}")
            .replace("%25", "%"),
    )
}

fn to_json(name: &str, snap: &Snapshot) -> String {
    let holders: Vec<serde_json::Value> = snap
        .holders
        .iter()
        .map(|holder| {
            serde_json::json!({
                "id": holder.id,
                "weight": holder.weight,
                "held_for_ms": holder.held_for.as_millis() as u64,
                "lease_remaining_ms": holder.lease_remaining.as_millis() as u64,
            })
        })
        .collect();
    serde_json::json!({
        "name": name,
        "limit": (snap.limit != NO_LIMIT).then_some(snap.limit),
        "used": snap.used,
        "waiting": snap.waiting,
        "holders": holders,
    })
    .to_string()
}
