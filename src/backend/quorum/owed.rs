//! Releases a node missed because it was down: sent once it answers again, until the member's
//! lease would have ended, so a node that comes back with its data (restarted from its AOF, a
//! partition healed) does not keep the slots for the rest of a lease. While a majority is up
//! such a slot costs nothing at once, but it would count the day another node fails.
//!
//! It knows no semaphore: the one that owes implements [`Debtor`] (`semaphore.rs`).

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio::time::Instant;

use crate::backend::owed;
use crate::sync::lock;

/// A release one node did not get: the `release` arguments, until the lease would end.
struct Release {
    node: usize,
    args: Vec<String>,
    until: Instant,
}

/// The releases owed to nodes that were down, and the nodes a task waits for.
#[derive(Default)]
pub(super) struct OwedReleases {
    releases: Vec<Release>,
    waiting: HashSet<usize>,
}

/// A semaphore that owes releases, as the task paying them sees it.
pub(super) trait Debtor: Send + Sync + 'static {
    /// What it owes.
    fn owed(&self) -> &Mutex<OwedReleases>;

    /// Whether `node` answers now.
    fn is_up(&self, node: usize) -> bool;

    /// Ticks each time `node` answers again.
    fn back(&self, node: usize) -> watch::Receiver<u64>;

    /// Sends `node` the release `args`; whether it answered.
    fn pay(&self, node: usize, args: &[String]) -> impl Future<Output = bool> + Send;
}

/// Keeps the release `args` for `nodes`, down when it was sent, until `until`; a task sends it
/// to each once that node is back. `me`: the semaphore that owes it (`None` once it is gone).
pub(super) fn owe<D: Debtor>(me: Option<Arc<D>>, nodes: &[usize], args: &[String], until: Instant) {
    let (Some(me), Ok(runtime)) = (me, tokio::runtime::Handle::try_current()) else {
        tracing::warn!(
            "a quorum node missed a release outside a tokio runtime: its slots free when \
             the lease ends"
        );
        return;
    };
    let now = Instant::now();
    let mut owed = lock(me.owed());
    owed.releases.retain(|release| release.until > now);
    for &node in nodes {
        owed.releases.push(Release {
            node,
            args: args.to_vec(),
            until,
        });
        if owed.waiting.insert(node) {
            runtime.spawn(pay_when_back(me.clone(), node));
        }
    }
    owed::bound(&mut owed.releases);
}

/// Sends `node` the releases it is owed whenever it is up, until none is left (each goes with
/// its lease); in between, waits for the node to come back.
async fn pay_when_back<D: Debtor>(me: Arc<D>, node: usize) {
    let mut back = me.back(node);
    loop {
        let now = Instant::now();
        let due: Vec<Release> = {
            let mut owed = lock(me.owed());
            owed.releases.retain(|release| release.until > now);
            if me.is_up(node) {
                let (due, rest) = std::mem::take(&mut owed.releases)
                    .into_iter()
                    .partition(|release| release.node == node);
                owed.releases = rest;
                due
            } else {
                Vec::new()
            }
        };
        for release in due {
            if !me.pay(node, &release.args).await {
                lock(me.owed()).releases.push(release);
            }
        }
        let last = {
            let mut owed = lock(me.owed());
            let last = (owed.releases.iter())
                .filter(|release| release.node == node)
                .map(|release| release.until)
                .max();
            if last.is_none() {
                owed.waiting.remove(&node);
            }
            last
        };
        let Some(last) = last else { return };
        tokio::select! {
            changed = back.changed() => if changed.is_err() {
                lock(me.owed()).waiting.remove(&node);
                return;
            },
            () = tokio::time::sleep_until(last) => {}
        }
    }
}
