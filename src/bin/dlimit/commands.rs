//! The commands that print to a terminal: list, show, set-limit, unset-limit, release. Each
//! checks what it is about to act on first, and refuses (exit 1) rather than guess: an unknown
//! name lists the close ones, a limit for a name nobody uses needs `--create`, evicting a live
//! holder needs `--yes`.

use tower_distributed_limit::{Holder, Snapshot};

use crate::Failure;
use crate::fleet::{self, Fleet};
use crate::text::{close_names, duration, terminal};

pub async fn list(fleet: &Fleet, json: bool) -> Result<(), Failure> {
    let semaphores = fleet.semaphores().await?;
    if semaphores.is_empty() {
        eprintln!(
            "dlimit: no semaphore found under the prefix {:?} at {}; {}",
            fleet.prefix(),
            fleet.shown_url(),
            fleet.prefix_hint().await?
        );
    }
    if json {
        let all: Vec<serde_json::Value> = semaphores
            .iter()
            .map(|(name, snap)| fleet::semaphore_json(name, snap))
            .collect();
        println!("{}", serde_json::Value::Array(all));
        return Ok(());
    }
    if semaphores.is_empty() {
        return Ok(());
    }
    println!(
        "{:<40} {:>8} {:>8} {:>8} {:>7}",
        "NAME", "USED", "LIMIT", "WAITING", "PINNED"
    );
    for (name, snap) in &semaphores {
        println!(
            "{:<40} {:>8} {:>8} {:>8} {:>7}",
            terminal(name),
            snap.used,
            limit_text(snap),
            snap.waiting,
            if snap.pinned { "yes" } else { "no" }
        );
    }
    Ok(())
}

pub async fn show(fleet: &Fleet, name: &str, json: bool) -> Result<(), Failure> {
    let snap = known(fleet, name).await?;
    if json {
        println!("{}", fleet::semaphore_json(name, &snap));
        return Ok(());
    }
    println!(
        "semaphore {}: {} of {} used, {} waiting; limit {}",
        terminal(name),
        snap.used,
        limit_text(&snap),
        snap.waiting,
        if snap.pinned {
            "pinned by an operator (`dlimit unset-limit` undoes it)"
        } else {
            "as configured"
        }
    );
    for class in &snap.classes {
        let mut share = String::new();
        if class.reserved > 0 {
            share.push_str(&format!(", {} reserved", class.reserved));
        }
        if let Some(cap) = class.at_most {
            share.push_str(&format!(", at most {cap}"));
        }
        println!(
            "  class {}: {} used, {} waiting{share}",
            class.class, class.used, class.waiting
        );
    }
    for tenant in &snap.tenants_waiting {
        println!(
            "  tenant {:016x}: {} waiting",
            tenant.tenant, tenant.waiting
        );
    }
    let (protocols, warning) = fleet::protocols(&snap);
    if !protocols.is_empty() {
        println!("  protocol versions in the last hour: {protocols}");
    }
    if let Some(warning) = warning {
        println!("  warning: {warning}");
    }
    print_holders(snap.holders.iter());
    Ok(())
}

pub async fn set_limit(fleet: &Fleet, name: &str, limit: u32, create: bool) -> Result<(), Failure> {
    let before = fleet.snapshot(name).await?;
    if before.is_none() && !create {
        return Err(Failure::Refused(
            unknown(
                fleet,
                name,
                ", so pinning a limit would create it: pass --create if that is meant",
            )
            .await?,
        ));
    }
    fleet.semaphore(name)?.set_limit(limit).await?;
    let was = before.map_or(String::new(), |snap| {
        format!(" (was {})", limit_text(&snap))
    });
    println!(
        "semaphore {}: limit pinned at {limit} for every process{was}; \
         `dlimit unset-limit` undoes it",
        terminal(name)
    );
    Ok(())
}

pub async fn unset_limit(fleet: &Fleet, name: &str) -> Result<(), Failure> {
    let snap = known(fleet, name).await?;
    if !snap.pinned {
        println!(
            "semaphore {}: its limit is not pinned; the configured limit ({}) is in force",
            terminal(name),
            limit_text(&snap)
        );
        return Ok(());
    }
    let semaphore = fleet.semaphore(name)?;
    semaphore.unset_limit().await?;
    let now = match fleet::limit(&semaphore.snapshot().await?) {
        Some(limit) => format!("every process admits by {limit} again, as before the pin"),
        None => "the first process to use it stores its configured limit".into(),
    };
    println!(
        "semaphore {}: limit unpinned (was {}); {now}",
        terminal(name),
        limit_text(&snap)
    );
    Ok(())
}

pub async fn release(fleet: &Fleet, name: &str, id: &str, yes: bool) -> Result<(), Failure> {
    let snap = known(fleet, name).await?;
    let Some(holder) = snap.holders.iter().find(|holder| holder.id == id) else {
        return Err(Failure::Refused(format!(
            "semaphore {} has no holder {} (a holder whose lease ended is gone already); \
             see `dlimit show`",
            terminal(name),
            terminal(id)
        )));
    };
    if !yes {
        print_holders([holder].into_iter());
        return Err(Failure::Refused(format!(
            "holder {} of semaphore {} is live: evicting it gives its slot to another process \
             while it may still be acting. Pass --yes to evict it",
            terminal(id),
            terminal(name)
        )));
    }
    if !fleet.semaphore(name)?.evict(id).await? {
        return Err(Failure::Refused(format!(
            "holder {} of semaphore {} was gone before it could be evicted (released, or its \
             lease ended)",
            terminal(id),
            terminal(name)
        )));
    }
    println!(
        "semaphore {}: holder {} evicted; its slot goes to the next waiter. The evicted process \
         learns at its next renewal; until then it may still act, so resources must check \
         fencing tokens (the next holder's is higher)",
        terminal(name),
        terminal(id)
    );
    Ok(())
}

/// The snapshot of `name`, or a refusal naming the close names when nobody uses it.
async fn known(fleet: &Fleet, name: &str) -> Result<Snapshot, Failure> {
    match fleet.snapshot(name).await? {
        Some(snap) => Ok(snap),
        None => Err(Failure::Refused(unknown(fleet, name, "").await?)),
    }
}

/// Says that no semaphore `name` is in use (and what acting on it would do: `consequence`),
/// with the names it may have meant, or what to check when the prefix holds none at all.
async fn unknown(fleet: &Fleet, name: &str, consequence: &str) -> Result<String, Failure> {
    let names = fleet.names().await?;
    let mut message = format!(
        "no semaphore {} under the prefix {:?} (nobody uses it, and no limit is pinned for \
         it){consequence}",
        terminal(name),
        fleet.prefix()
    );
    let close = close_names(name, &names);
    if names.is_empty() {
        message = format!(
            "{message}, nor any other at {}; {}",
            fleet.shown_url(),
            fleet.prefix_hint().await?
        );
    } else if close.is_empty() {
        message.push_str("; `dlimit list` shows every one");
    } else {
        let close: Vec<String> = close.iter().map(|name| terminal(name)).collect();
        message = format!("{message}; did you mean: {}?", close.join(", "));
    }
    Ok(message)
}

fn limit_text(snap: &Snapshot) -> String {
    fleet::limit(snap).map_or("-".into(), |limit| limit.to_string())
}

fn print_holders<'a>(holders: impl Iterator<Item = &'a Holder>) {
    println!(
        "{:<34} {:<24} {:>6} {:>10} {:>10}  POOL",
        "HOLDER", "PROCESS", "WEIGHT", "HELD FOR", "LEASE LEFT"
    );
    for holder in holders {
        let process = holder.process.as_str();
        println!(
            "{:<34} {:<24} {:>6} {:>10} {:>10}  {}",
            terminal(&holder.id),
            if process.is_empty() {
                "-".into()
            } else {
                terminal(process)
            },
            holder.weight,
            duration(holder.held_for),
            duration(holder.lease_remaining),
            if holder.prefetched { "prefetched" } else { "-" }
        );
    }
}
