//! One semaphore on the quorum: its keys on every node, and each call of `lua/quorum.lua` sent
//! to all the nodes at once (`on_all`), answered by those that answer in time.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::{Script, Value};
use tokio::time::Instant;

use super::owed::{self, Debtor, OwedReleases};
use super::{Nodes, QuorumBackend};
use crate::backend::health;
use crate::backend::redis::CALLS;
use crate::backend::store::{Opened, sealed::Open};
use crate::sync::BoxFuture;
use crate::{AdaptiveLimit, Error};

/// Every operation on one node, in one script.
static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/quorum.lua")));

/// How long the nodes beyond a majority may take to answer once the majority has.
const GRACE: Duration = Duration::from_millis(10);

impl Open for QuorumBackend {
    fn open(
        &self,
        name: &str,
        limit: u32,
        // Refused at build (`cannot_adapt`).
        _adaptive: Option<AdaptiveLimit>,
        // Shares are refused at build (`cannot_share`); priorities and tenants are not served
        // in order (a waiter is a poll of every node, not a place in one line).
        _classes: &crate::class::Classes,
        _claim: Duration,
    ) -> Opened {
        // No hash tag: the nodes are independent masters, not a cluster.
        let base = format!("{}quorum:{name}", self.prefix);
        let channel = format!("{base}:freed");
        let waitlist = self.shared.hub.waitlist(&channel);
        Opened {
            store: Arc::new_cyclic(|me| QuorumSemaphore {
                shared: self.shared.clone(),
                me: me.clone(),
                keys: [
                    format!("{base}:owned"),
                    format!("{base}:owner"),
                    format!("{base}:counter"),
                    format!("{}quorum:born", self.prefix),
                    format!("{base}:limit"),
                    format!("{base}:opened"),
                ],
                channel,
                limit,
                held: Mutex::default(),
                owed: Mutex::default(),
            }),
            waitlist,
        }
    }

    fn cannot_adapt(&self) -> Option<&'static str> {
        // Each node would adapt on the releases it sees, and a grant needs a majority of them:
        // no one limit would be in force anywhere.
        Some(
            "needs one store that decides every grant and sees every release; on a quorum each \
             node would move its own limit, so none would be in force for the fleet. Use a \
             fixed limit (or a RedisBackend, Sentinel or Cluster)",
        )
    }

    fn cannot_share(&self) -> Option<&'static str> {
        // A grant is a majority of nodes' independent grants: a node's share of a class says
        // nothing of what the class holds on the others, so no share could be kept exactly.
        Some(
            "needs one store that sees every class's holders; on a quorum each node counts only \
             its own grants, so no reservation or cap would hold for the fleet. Use a \
             RedisBackend, Sentinel or Cluster for classes or tenants with shares",
        )
    }
}

/// One semaphore on the quorum.
pub(super) struct QuorumSemaphore {
    pub(super) shared: Arc<Nodes>,
    /// Itself, for the releases a task sends after a permit was dropped.
    pub(super) me: Weak<QuorumSemaphore>,
    keys: [String; 6],
    channel: String,
    limit: u32,
    /// The slots of each member this process holds (or is taking).
    pub(super) held: Mutex<HashMap<Arc<str>, Vec<u32>>>,
    /// Releases nodes missed while down, sent when each is back.
    pub(super) owed: Mutex<OwedReleases>,
}

/// One node's answer, or none (failed or too slow).
pub(super) type Answers = Vec<Option<Value>>;

impl QuorumSemaphore {
    /// More than half of all the nodes, down or not.
    pub(super) fn majority(&self) -> usize {
        self.shared.nodes.len() / 2 + 1
    }

    /// `op` with `args` on every node at once; each node's answer, `None` where it failed or
    /// was late. Once a majority has answered, the others get [`GRACE`] more: a dead or paused
    /// node costs a try that much, not a call timeout.
    pub(super) async fn on_all(&self, op: &str, args: &[String]) -> Answers {
        self.on_nodes(op, args, |_| true).await
    }

    /// [`on_all`](Self::on_all), on the nodes whose index `pick` chooses (`None` from the
    /// others).
    pub(super) async fn on_nodes(
        &self,
        op: &str,
        args: &[String],
        pick: impl Fn(usize) -> bool,
    ) -> Answers {
        let mut calls: FuturesUnordered<_> = self
            .shared
            .nodes
            .iter()
            .enumerate()
            .filter(|&(index, node)| pick(index) && health::refuse_while_down(node).is_ok())
            .map(|(index, node)| {
                let node = node.clone();
                let mut invocation = SCRIPT.prepare_invoke();
                for key in &self.keys {
                    invocation.key(key);
                }
                invocation.arg(op).arg(&self.channel).arg(self.limit);
                for arg in args {
                    invocation.arg(arg);
                }
                let bound = self.shared.call_timeout;
                async move {
                    tracing::trace!(target: CALLS, op, "quorum call");
                    let mut conn = node.conn.clone();
                    let call = invocation.invoke_async::<Value>(&mut conn);
                    let answer = match tokio::time::timeout(bound, call).await {
                        Ok(Ok(value)) => Some(value),
                        Ok(Err(e)) => {
                            tracing::debug!(op, error = %e, "a quorum node failed");
                            health::failed(&node, &e);
                            None
                        }
                        Err(_) => {
                            health::timed_out(&node, bound);
                            None
                        }
                    };
                    (index, answer)
                }
            })
            .collect();
        let mut answers: Answers = vec![None; self.shared.nodes.len()];
        let mut answered = 0;
        let mut late = None;
        loop {
            let next = match late {
                None => calls.next().await,
                Some(deadline) => match tokio::time::timeout_at(deadline, calls.next()).await {
                    Ok(next) => next,
                    Err(_) => break,
                },
            };
            let Some((index, answer)) = next else { break };
            if answer.is_some() {
                answered += 1;
                if answered == self.majority() {
                    late = Some(Instant::now() + GRACE);
                }
            }
            answers[index] = answer;
        }
        answers
    }

    /// The error of `op`, which only `answered` nodes answered: fewer than a majority.
    /// `op` with `args` on every node (`set_limit`, `unset_limit`); done once a majority
    /// answered.
    pub(super) fn on_majority(
        &self,
        op: &'static str,
        args: Vec<String>,
    ) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            let answers = self.on_all(op, &args).await;
            let stored = answers.iter().flatten().count();
            if stored < self.majority() {
                return Err(self.too_few(op, stored));
            }
            Ok(())
        })
    }

    pub(super) fn too_few(&self, op: &str, answered: usize) -> Error {
        let down: Vec<&str> = (self.shared.nodes.iter())
            .filter(|node| !node.health.is_up())
            .map(|node| node.health.label())
            .collect();
        let down = match down.len() {
            0 => String::new(),
            _ => format!(
                " ({} down, refused at once until a probe reaches them)",
                down.join(", ")
            ),
        };
        Error::backend(
            format!(
                "only {answered} of {} quorum nodes answered `{op}`{down}; a majority ({}) is \
                 needed. Check the nodes' health",
                self.shared.nodes.len(),
                self.majority()
            ),
            None,
        )
    }
}

/// A reply of integers only.
pub(super) fn integers(value: &Value) -> Option<Vec<i64>> {
    match value {
        Value::Array(items) => items.iter().map(integer).collect(),
        _ => None,
    }
}

/// An integer reply.
pub(super) fn integer(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        _ => None,
    }
}

impl QuorumSemaphore {
    /// Keeps the release `args` for `nodes`, down when it was sent, until `until`; a task sends
    /// it to each once that node is back (`owed.rs`).
    pub(super) fn owe(&self, nodes: &[usize], args: &[String], until: Instant) {
        owed::owe(self.me.upgrade(), nodes, args, until);
    }
}

impl Debtor for QuorumSemaphore {
    fn owed(&self) -> &Mutex<OwedReleases> {
        &self.owed
    }

    fn is_up(&self, node: usize) -> bool {
        self.shared.nodes[node].health.is_up()
    }

    fn back(&self, node: usize) -> tokio::sync::watch::Receiver<u64> {
        self.shared.nodes[node].back.subscribe()
    }

    async fn pay(&self, node: usize, args: &[String]) -> bool {
        let answers = self.on_nodes("release", args, |n| n == node).await;
        answers[node].is_some()
    }
}
