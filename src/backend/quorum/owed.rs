//! Releases a node missed because it was down: sent once it answers again, until the member's
//! lease would have ended, so a node that comes back with its data (restarted from its AOF, a
//! partition healed) does not keep the slots for the rest of a lease. While a majority is up
//! such a slot costs nothing at once, but it would count the day another node fails.

use std::collections::HashSet;
use std::sync::Arc;

use tokio::time::Instant;

use super::semaphore::QuorumSemaphore;
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
pub(super) struct Owed {
    releases: Vec<Release>,
    waiting: HashSet<usize>,
}

impl QuorumSemaphore {
    /// Keeps the release `args` for `nodes`, down when it was sent, until `until`; a task sends
    /// it to each once that node is back.
    pub(super) fn owe(&self, nodes: &[usize], args: &[String], until: Instant) {
        let (Some(me), Ok(runtime)) = (self.me.upgrade(), tokio::runtime::Handle::try_current())
        else {
            tracing::warn!(
                "a quorum node missed a release outside a tokio runtime: its slots free when \
                 the lease ends"
            );
            return;
        };
        let now = Instant::now();
        let mut owed = lock(&self.owed);
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
}

/// Sends `node` the releases it is owed whenever it is up, until none is left (each goes with
/// its lease); in between, waits for the node to come back.
async fn pay_when_back(me: Arc<QuorumSemaphore>, node: usize) {
    let server = &me.shared.nodes[node];
    let mut back = server.back.subscribe();
    loop {
        let now = Instant::now();
        let due: Vec<Release> = {
            let mut owed = lock(&me.owed);
            owed.releases.retain(|release| release.until > now);
            if server.health.is_up() {
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
            let answers = me.on_nodes("release", &release.args, |n| n == node).await;
            if answers[node].is_none() {
                lock(&me.owed).releases.push(release);
            }
        }
        let last = {
            let mut owed = lock(&me.owed);
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
                lock(&me.owed).waiting.remove(&node);
                return;
            },
            () = tokio::time::sleep_until(last) => {}
        }
    }
}
