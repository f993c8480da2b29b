//! The quorum's [`Store`] and [`Refresh`]: what the semaphore asks of one semaphore on the
//! nodes, each answer counted only from a majority.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use redis::Value;
use tokio::sync::watch;
use tokio::time::Instant;

use super::grant::Try;
use super::semaphore::{QuorumSemaphore, integer};
use crate::Error;
use crate::backend::gcra::Rated;
use crate::backend::store::{Attempt, Ending, Member, Mode, Store};
use crate::class::Classes;
use crate::snapshot::{Holder, Snapshot};
use crate::sync::{BoxFuture, lock};
use crate::waitlist::{ClockReading, Refresh, Status};

impl Store for QuorumSemaphore {
    fn acquire<'a>(
        &'a self,
        member: &'a Member,
        mode: Mode,
        until: Option<Instant>,
        // Never given: this store combines with no rate limiter (`Store::combines`).
        _rate: Option<&'a Rated>,
    ) -> BoxFuture<'a, Result<Attempt, Error>> {
        Box::pin(async move {
            let sent = Instant::now();
            // No grant is ever announced with a server time: any reading will do.
            let clock = ClockReading {
                local: sent,
                server_us: 0,
            };
            match self.attempt(member).await? {
                Try::Granted(token, remaining) => Ok(Attempt::Granted {
                    token,
                    remaining,
                    rate: None,
                }),
                // An abstention that ends within the wait is waited for; any other is reported.
                Try::Blocked { ends_in, error } => match until {
                    Some(until) if mode != Mode::Once && Instant::now() + ends_in < until => {
                        Ok(Attempt::Queued {
                            retry_in: ends_in,
                            clock,
                        })
                    }
                    _ => Err(error),
                },
                Try::Busy(_) if mode == Mode::Once => Ok(Attempt::Full),
                Try::Busy(retry_in) => Ok(Attempt::Queued { retry_in, clock }),
            }
        })
    }

    // A quorum never adapts its limit, so `overloaded` means nothing here.
    fn release<'a>(
        &'a self,
        member: &'a Member,
        _ending: Ending,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            self.give_back(member).await;
            Ok(())
        })
    }

    fn release_later(&self, member: Member, _ending: Ending) {
        let (Some(me), Ok(runtime)) = (self.me.upgrade(), tokio::runtime::Handle::try_current())
        else {
            tracing::warn!(
                "permit dropped outside a tokio runtime: its slots free when its lease ends"
            );
            return;
        };
        runtime.spawn(async move { me.give_back(&member).await });
    }

    fn renew<'a>(
        &'a self,
        members: &'a [Member],
    ) -> BoxFuture<'a, Result<Vec<Option<Duration>>, Error>> {
        Box::pin(async move {
            let mut renewed = Vec::with_capacity(members.len());
            for member in members {
                let Some(slots) = lock(&self.held).get(&member.text).cloned() else {
                    renewed.push(None);
                    continue;
                };
                let started = Instant::now();
                let mut args = vec![
                    member.text.to_string(),
                    member.lease.as_millis().to_string(),
                ];
                args.extend(slots.iter().map(u32::to_string));
                let answers = self.on_all("renew", &args).await;
                let answered = answers.iter().flatten().count();
                if answered < self.majority() {
                    return Err(self.too_few("renew", answered));
                }
                let kept = answers
                    .iter()
                    .filter(|answer| answer.as_ref().and_then(integer) == Some(slots.len() as i64))
                    .count();
                renewed.push(if kept >= self.majority() {
                    self.validity(member.lease, started)
                } else {
                    None
                });
            }
            Ok(renewed)
        })
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        None
    }

    /// Holders are the members that own slots on a majority of the nodes; there is no line,
    /// and grant times are not kept (`held_for` is zero).
    fn snapshot(&self) -> BoxFuture<'_, Result<Snapshot, Error>> {
        Box::pin(async move {
            let answers = self.on_all("snapshot", &[]).await;
            let answered: Vec<&Value> = answers.iter().flatten().collect();
            if answered.len() < self.majority() {
                return Err(self.too_few("snapshot", answered.len()));
            }
            let mut limits = Vec::new();
            let mut pins = 0;
            // (slot, member) -> on how many nodes, and the least time left.
            let mut seen: HashMap<(i64, String), (usize, i64)> = HashMap::new();
            for answer in answered {
                let Value::Array(items) = answer else {
                    continue;
                };
                let Some(([limit, pin], rest)) = items.split_first_chunk() else {
                    continue;
                };
                limits.extend(integer(limit));
                pins += usize::from(integer(pin) == Some(1));
                for held in rest.chunks_exact(3) {
                    if let (Value::Int(slot), Value::BulkString(member), Value::Int(left)) =
                        (&held[0], &held[1], &held[2])
                    {
                        let member = String::from_utf8_lossy(member).into_owned();
                        let entry = seen.entry((*slot, member)).or_insert((0, i64::MAX));
                        entry.0 += 1;
                        entry.1 = entry.1.min(*left);
                    }
                }
            }
            let mut holders: HashMap<String, (u32, i64)> = HashMap::new();
            for ((_, member), (nodes, left)) in seen {
                if nodes >= self.majority() {
                    let holder = holders.entry(member).or_insert((0, i64::MAX));
                    holder.0 += 1;
                    holder.1 = holder.1.min(left);
                }
            }
            limits.sort_unstable();
            let limit = limits.get(limits.len() / 2).copied().unwrap_or(0);
            let holders: Vec<Holder> = holders
                .into_iter()
                .filter_map(|(member, (slots, left))| {
                    let left = Duration::from_millis(left.max(0).unsigned_abs());
                    let holder = Holder::of(&member, Duration::ZERO, left, String::new())?;
                    // A member holds one slot per permit: what it holds is what a majority
                    // agrees on.
                    Some(Holder {
                        weight: slots,
                        ..holder
                    })
                })
                .collect();
            let mut snapshot = Snapshot {
                limit: u32::try_from(limit.max(0)).unwrap_or(u32::MAX),
                used: holders.iter().map(|holder| holder.weight).sum(),
                waiting: 0,
                pinned: pins >= self.majority(),
                holders,
                classes: Vec::new(),
                tenants_waiting: Vec::new(),
                protocols: Vec::new(),
            };
            // No shares on a quorum (refused at build), and no line it could count by class.
            snapshot.complete(&Classes::default(), snapshot.weights(), [0; 8], []);
            Ok(snapshot)
        })
    }

    fn evict<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let answers = self.on_all("evict", &[id.to_owned()]).await;
            let answered = answers.iter().flatten().count();
            if answered < self.majority() {
                return Err(self.too_few("evict", answered));
            }
            Ok(answers
                .iter()
                .flatten()
                .any(|answer| integer(answer).is_some_and(|n| n > 0)))
        })
    }

    /// Stored on every node; it counts once a majority has it.
    fn set_limit(&self, limit: u32) -> BoxFuture<'_, Result<(), Error>> {
        self.on_majority("set_limit", vec![limit.to_string()])
    }

    fn unset_limit(&self) -> BoxFuture<'_, Result<(), Error>> {
        self.on_majority("unset_limit", Vec::new())
    }

    fn used(&self) -> BoxFuture<'_, Result<u32, Error>> {
        Box::pin(async move {
            let answers = self.on_all("used", &[]).await;
            let mut used: Vec<i64> = answers.iter().flatten().filter_map(integer).collect();
            if used.len() < self.majority() {
                return Err(self.too_few("used", used.len()));
            }
            // The median of the answers: a minority of nodes cannot sway it.
            used.sort_unstable();
            Ok(u32::try_from(used[used.len() / 2].max(0)).unwrap_or(u32::MAX))
        })
    }
}

impl Refresh for QuorumSemaphore {
    /// There is no line across the nodes. The oldest local waiters, as many as slots are free
    /// on a majority, are told to try again; the others keep waiting, so a freed slot does not
    /// set every waiter of the process trying at once.
    fn touch<'a>(
        &'a self,
        members: &'a [Arc<str>],
        _until: Instant,
    ) -> BoxFuture<'a, Result<(Vec<Status>, Duration), Error>> {
        Box::pin(async move {
            let (free, retry_in) = self.free_slots().await?;
            let statuses = (0..members.len())
                .map(|i| {
                    if i < free.len() {
                        Status::Unknown
                    } else {
                        Status::Queued
                    }
                })
                .collect();
            Ok((statuses, retry_in))
        })
    }
}
