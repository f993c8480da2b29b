//! How a grant is won (see the module docs): the slots free on a majority (`free_slots`), taken
//! on every node at once (`take`, and `take_cold` for a cold start), the token sealed, and
//! everything given back when the majority or the validity bound is missed.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::semaphore::{Answers, QuorumSemaphore, integer, integers};
use crate::Error;
use crate::backend::store::Member;
use crate::sync::lock;
use crate::waitlist::KEEPALIVE;

impl QuorumSemaphore {
    /// One try at `member`'s slots.
    pub(super) async fn attempt(&self, member: &Member) -> Result<Try, Error> {
        let lease = member.lease;
        let started = Instant::now();
        let (mut candidates, retry_in) = self.free_slots().await?;
        let weight = member.weight as usize;
        if candidates.len() < weight {
            return Ok(Try::Busy(retry_in));
        }
        fastrand::shuffle(&mut candidates);
        candidates.truncate(weight);
        candidates.sort_unstable();
        lock(&self.held).insert(member.text.clone(), candidates.clone());
        let slots: Vec<String> = candidates.iter().map(u32::to_string).collect();
        let mut args = vec![member.text.to_string(), lease.as_millis().to_string()];
        args.extend(slots.iter().cloned());
        let mut takes = Takes::default();
        takes.count(&self.on_all("take", &args).await);
        if takes.winners.len() < self.majority() && takes.abstaining.len() >= self.majority() {
            // A majority of all the nodes abstain: a cold start (see the module docs). Every
            // node that did not take is asked again, so that every live one takes part.
            let winners = takes.winners.clone();
            let again = self
                .on_nodes("take_cold", &args, |node| !winners.contains(&node))
                .await;
            takes.abstaining.clear();
            takes.count(&again);
        }
        let valid = self.validity(lease, started);
        if takes.winners.len() < self.majority() || valid.is_none() {
            self.give_back(member).await;
            if valid.is_some() && takes.winners.len() + takes.abstaining.len() >= self.majority() {
                return Ok(self.blocked(&takes));
            }
            return Ok(Try::Busy(
                retry_in.min(Duration::from_millis(50 + fastrand::u64(..100))),
            ));
        }
        // Seal the token on the nodes that granted it, so every later owner of these slots
        // gets a larger one.
        let token = takes.token;
        let mut args = vec![member.text.to_string(), token.to_string()];
        args.extend(slots);
        let sealed = self.on_all("seal", &args).await;
        let sealed_winners = (takes.winners.iter())
            .filter(|&&node| sealed[node].as_ref().and_then(integer) == Some(member.weight as i64))
            .count();
        match self.validity(lease, started) {
            Some(valid) if sealed_winners >= self.majority() => {
                Ok(Try::Granted(u64::try_from(token).unwrap_or(0), valid))
            }
            _ => {
                self.give_back(member).await;
                Ok(Try::Busy(retry_in))
            }
        }
    }

    /// The grant that abstaining nodes blocked: when enough of them take part again for a
    /// majority, and the error that says so, naming them.
    fn blocked(&self, takes: &Takes) -> Try {
        let nodes = &self.shared.nodes;
        let mut abstaining = takes.abstaining.clone();
        abstaining.sort_unstable_by_key(|&(_, left)| left);
        let needed = self.majority() - takes.winners.len();
        let ends_in = abstaining[needed - 1].1 + Duration::from_millis(1);
        let which: Vec<String> = (abstaining.iter())
            .map(|&(node, left)| format!("{} (for another {left:.1?})", nodes[node].health.label()))
            .collect();
        let silent: Vec<&str> = (0..nodes.len())
            .filter(|node| !takes.answered.contains(node))
            .map(|node| nodes[node].health.label())
            .collect();
        let silent = match silent.len() {
            0 => String::new(),
            _ => format!("; {} did not answer", silent.join(", ")),
        };
        let error = Error::backend(
            format!(
                "only {} of {} quorum nodes may grant now and a majority ({}) is needed: {} \
                 abstain{} after a restart (a node whose data is younger than a lease may have \
                 forgotten slots it granted, so it takes part again once its data is a lease \
                 old){silent}. This is not a full semaphore: wait for the restarted nodes, or \
                 bring the other nodes back",
                takes.winners.len(),
                nodes.len(),
                self.majority(),
                which.join(", "),
                if abstaining.len() == 1 { "s" } else { "" },
            ),
            None,
        );
        Try::Blocked { ends_in, error }
    }

    /// The slots free on a majority of the nodes, and when the earliest lease may end.
    pub(super) async fn free_slots(&self) -> Result<(Vec<u32>, Duration), Error> {
        let free = self.on_all("free", &[]).await;
        let answered = free.iter().flatten().count();
        if answered < self.majority() {
            return Err(self.too_few("free", answered));
        }
        let mut counts: HashMap<i64, usize> = HashMap::new();
        let mut retry_in = KEEPALIVE;
        for answer in free.iter().flatten() {
            let Some((first, slots)) = integers(answer).and_then(|values| {
                let (first, slots) = values.split_first()?;
                Some((*first, slots.to_vec()))
            }) else {
                continue;
            };
            if first > 0 {
                retry_in = retry_in.min(Duration::from_millis(first.unsigned_abs()));
            }
            for slot in slots {
                *counts.entry(slot).or_default() += 1;
            }
        }
        let candidates = counts
            .into_iter()
            .filter(|(_, count)| *count >= self.majority())
            .filter_map(|(slot, _)| u32::try_from(slot).ok())
            .collect();
        Ok((candidates, retry_in))
    }

    /// How long a grant asked for at `started` may still be believed.
    pub(super) fn validity(&self, lease: Duration, started: Instant) -> Option<Duration> {
        let drift = lease.mul_f64(self.shared.drift_factor) + Duration::from_millis(2);
        lease
            .checked_sub(started.elapsed())?
            .checked_sub(drift)
            .filter(|valid| !valid.is_zero())
    }

    /// Releases `member`'s slots on every node; a node down meanwhile is sent the release
    /// once it is back (`owe`).
    pub(super) async fn give_back(&self, member: &Member) {
        let Some(slots) = lock(&self.held).remove(&member.text) else {
            return;
        };
        let mut args = vec![member.text.to_string()];
        args.extend(slots.iter().map(u32::to_string));
        let answers = self.on_all("release", &args).await;
        // (A node that was up and late got the release; it runs when the node answers.)
        let missed: Vec<usize> = (answers.iter().enumerate())
            .filter(|&(node, answer)| answer.is_none() && !self.shared.nodes[node].health.is_up())
            .map(|(node, _)| node)
            .collect();
        if !missed.is_empty() {
            self.owe(&missed, &args, Instant::now() + member.lease);
        }
    }
}

/// How one try went.
pub(super) enum Try {
    /// The token, and how long the grant may be believed.
    Granted(u64, Duration),
    /// No set of slots is free on a majority now (or the try was too slow): try again in.
    Busy(Duration),
    /// Nodes abstaining after a restart kept the grant from a majority; enough of them take
    /// part again in `ends_in`. Not a full semaphore: `error` says what it is.
    Blocked { ends_in: Duration, error: Error },
}

/// The answers to `take` (and `take_cold`), by node.
#[derive(Default)]
struct Takes {
    /// The nodes that took every slot.
    winners: Vec<usize>,
    /// The nodes that abstain, and for how much longer.
    abstaining: Vec<(usize, Duration)>,
    /// The nodes that answered at all.
    answered: Vec<usize>,
    /// The largest counter among the winners.
    token: i64,
}

impl Takes {
    /// Adds the nodes' answers to one round of takes.
    fn count(&mut self, answers: &Answers) {
        for (node, answer) in answers.iter().enumerate() {
            let Some(values) = answer.as_ref().and_then(integers) else {
                continue;
            };
            if !self.answered.contains(&node) {
                self.answered.push(node);
            }
            match values.split_first() {
                Some((1, counters)) => {
                    self.winners.push(node);
                    self.token = self.token.max(counters.iter().copied().max().unwrap_or(0));
                }
                Some((2, [left, ..])) => {
                    let left = Duration::from_millis(left.max(&0).unsigned_abs());
                    self.abstaining.push((node, left));
                }
                _ => {}
            }
        }
    }
}
