//! `dlimit`: look at and change live semaphores from the command line, or serve a live page
//! of them (feature `cli`).
//!
//! ```text
//! dlimit --url redis://127.0.0.1:6379 list [--json]
//! dlimit --url redis://127.0.0.1:6379 show llm-api [--json]
//! dlimit --url redis://127.0.0.1:6379 set-limit llm-api 50 [--create]
//! dlimit --url redis://127.0.0.1:6379 unset-limit llm-api
//! dlimit --url redis://127.0.0.1:6379 release llm-api 3f2a... [--yes]   # evict a stuck holder
//! dlimit --url redis://127.0.0.1:6379 serve --listen 127.0.0.1:9090
//! ```
//!
//! Built on the public API only (`Semaphore::snapshot`, `set_limit`, `unset_limit`, `evict`),
//! plus `SCAN` for the names and plain reads of the rate limiters' keys, which have no API.
//! Every command is careful in an incident: what it cannot find or would change for good is
//! refused (exit 1) with what to type instead.

mod commands;
mod failure;
mod fleet;
mod metrics;
mod page;
mod serve;
mod text;

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use failure::Failure;
use fleet::Fleet;

/// Printed by `--help`, and the same in docs/operations.md.
const EXIT_CODES: &str = "\
Exit codes:
  0  done (also `list` finding nothing: it says so on stderr)
  1  refused: no such semaphore or holder, `--create` or `--yes` needed, a limit of 0,
     an address `serve` cannot listen on
  2  usage: an unknown command, option or argument
  3  Redis cannot be reached or refused the call (connection, timeout, password, ACL)";

#[derive(Parser)]
#[command(
    name = "dlimit",
    version,
    about = "Look at and change tower-distributed-limit semaphores, or serve a live page of them",
    after_help = EXIT_CODES
)]
struct Cli {
    /// The Redis URL (`redis://`, `rediss://`), or a comma-separated list of Cluster nodes.
    // `REDIS_URL`'s value is never printed in the help: it may hold a password.
    #[arg(
        long,
        env = "REDIS_URL",
        hide_env_values = true,
        default_value = "redis://127.0.0.1:6379"
    )]
    url: String,
    /// The key prefix the services use (`RedisBackend::key_prefix`).
    #[arg(long, default_value = fleet::DEFAULT_PREFIX)]
    prefix: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Every semaphore in use or with a limit set, with used / limit / waiting.
    List {
        /// Print JSON (an array of what `show --json` prints) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One semaphore: its limit in force, use, waiters and holders (with their processes).
    Show {
        /// The semaphore's name.
        name: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Pin the limit every process admits by, at once and until unset.
    SetLimit {
        /// The semaphore's name.
        name: String,
        /// The limit, 1 or more.
        limit: u32,
        /// Pin it even though no process uses this name now (a typo would otherwise create a
        /// semaphore nobody uses).
        #[arg(long)]
        create: bool,
    },
    /// Unpin the limit: the limit in force before the pin is back, for every process.
    UnsetLimit {
        /// The semaphore's name.
        name: String,
    },
    /// Evict a stuck holder by its id (see `show`); its slot goes to the next waiter.
    #[command(visible_alias = "evict")]
    Release {
        /// The semaphore's name.
        name: String,
        /// The holder's id, as `show` lists it.
        holder_id: String,
        /// Evict it: without this, the holder is only shown.
        #[arg(long)]
        yes: bool,
    },
    /// Serve a live page of every semaphore and rate limiter, as JSON too, and the fleet's
    /// gauges for Prometheus.
    ///
    /// `/` the page, `/api/semaphores` and `/api/rate-limiters` the JSON, `/metrics` the
    /// gauges. No authentication: keep it on loopback or behind what guards your operator
    /// pages.
    Serve {
        /// The address to listen on.
        #[arg(long, default_value = "127.0.0.1:9090")]
        listen: SocketAddr,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("dlimit: {}", failure.message());
            failure.exit_code()
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let fleet = Fleet::connect(
        &cli.url,
        &cli.prefix,
        matches!(cli.command, Command::Serve { .. }),
    )
    .await?;
    match cli.command {
        Command::List { json } => commands::list(&fleet, json).await,
        Command::Show { name, json } => commands::show(&fleet, &name, json).await,
        Command::SetLimit {
            name,
            limit,
            create,
        } => commands::set_limit(&fleet, &name, limit, create).await,
        Command::UnsetLimit { name } => commands::unset_limit(&fleet, &name).await,
        Command::Release {
            name,
            holder_id,
            yes,
        } => commands::release(&fleet, &name, &holder_id, yes).await,
        Command::Serve { listen } => serve::serve(fleet, listen).await,
    }
}
