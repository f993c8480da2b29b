//! Lease renewal: every live permit of a semaphore in this process is renewed by one batched
//! call once the most urgent of them has used a third of its term, and a permit the backend no
//! longer knows is marked lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::backend::{Member, Store};
use crate::lease::Lease;
use crate::sync::lock;
use crate::telemetry::{Op, Telemetry};

/// The shortest pause before a failed renewal is tried again; it doubles up to a third of the
/// lease.
const RETRY: Duration = Duration::from_millis(50);

/// How long past its planned wake-up a renewal task may go unseen before it is presumed stuck
/// (its runtime stopped being driven, or the process was frozen) and a new one is started.
const STALLED: Duration = Duration::from_secs(5);

/// Renews the live permits of one semaphore. Its task runs only while there are permits, holds
/// the keeper only weakly, and is started again on whatever runtime is current if the last one
/// went away.
pub(crate) struct Keeper {
    store: Arc<dyn Store>,
    /// The semaphore's name, for the log.
    name: String,
    telemetry: Telemetry,
    lease: Duration,
    leases: Mutex<Leases>,
    /// Wakes the task: a more urgent lease arrived, or the last one left.
    wake: Arc<Notify>,
}

#[derive(Default)]
struct Leases {
    live: HashMap<Member, Weak<Lease>>,
    /// The running task's number, if one runs.
    task: Option<u64>,
    tasks: u64,
    /// When the running task plans to wake next.
    wakes_at: Option<Instant>,
}

impl Keeper {
    pub(crate) fn new(
        store: Arc<dyn Store>,
        name: String,
        lease: Duration,
        telemetry: Telemetry,
    ) -> Arc<Self> {
        Arc::new(Keeper {
            store,
            name,
            telemetry,
            lease,
            leases: Mutex::default(),
            wake: Arc::new(Notify::new()),
        })
    }

    /// Starts renewing `member`'s lease.
    pub(crate) fn keep(self: &Arc<Self>, member: Member, lease: &Arc<Lease>) {
        let due = lease.due();
        let mut leases = lock(&self.leases);
        leases.live.insert(member, Arc::downgrade(lease));
        if let (Some(_), Some(wakes_at)) = (leases.task, leases.wakes_at)
            && Instant::now() < wakes_at + STALLED
        {
            if due.is_some_and(|due| due < wakes_at) {
                self.wake.notify_one();
            }
            return;
        }
        // Permits are made inside a runtime; outside one there is nothing to run on, and the
        // lease simply runs out.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            leases.tasks += 1;
            let id = leases.tasks;
            leases.task = Some(id);
            leases.wakes_at = Some(Instant::now());
            let running = Running {
                keeper: Arc::downgrade(self),
                id,
            };
            // Not under the lock: a runtime shutting down drops the task at once, and its
            // drop takes the lock.
            drop(leases);
            runtime.spawn(running.run(self.wake.clone(), self.store.reconnects()));
        }
    }

    /// Stops renewing `member` (released, or lost).
    pub(crate) fn forget(&self, member: &Member) {
        let mut leases = lock(&self.leases);
        if leases.live.remove(member).is_some() && leases.live.is_empty() {
            // The task ends now rather than at its next renewal.
            self.wake.notify_one();
        }
    }

    /// When task `id` should renew next, or `None` when it should end: nothing left to renew,
    /// or another task took over.
    fn next_due(&self, id: u64) -> Option<Instant> {
        let mut leases = lock(&self.leases);
        if leases.task != Some(id) {
            return None;
        }
        let mut next: Option<Instant> = None;
        leases.live.retain(|_, lease| {
            let due = lease.upgrade().and_then(|lease| lease.due());
            if let Some(due) = due {
                next = Some(next.map_or(due, |next| next.min(due)));
            }
            due.is_some()
        });
        if next.is_none() {
            leases.task = None;
        }
        next
    }

    fn planned(&self, id: u64, at: Instant) {
        let mut leases = lock(&self.leases);
        if leases.task == Some(id) {
            leases.wakes_at = Some(at);
        }
    }

    /// Renews every live lease in one call (the store batches a long list); false if it
    /// failed.
    async fn renew_all(&self) -> bool {
        let (members, leases): (Vec<Member>, Vec<Arc<Lease>>) = lock(&self.leases)
            .live
            .iter()
            .filter_map(|(member, lease)| Some((member.clone(), lease.upgrade()?)))
            .unzip();
        let sent = Instant::now();
        match self.store.renew(&members).await {
            Ok(renewed) => {
                // Permits the backend no longer knew while their leases still ran here: their
                // keys were deleted or evicted, or lost in a restart or failover.
                let mut vanished = 0;
                for ((member, lease), renewed) in members.iter().zip(&leases).zip(renewed) {
                    let kept = match renewed {
                        // At most a lease from the renewal's call (see `into_permit`).
                        Some(remaining) => lease.renewed(sent + remaining.min(member.lease)),
                        None => {
                            vanished += usize::from(sent < lease.deadline() && !lease.is_lost());
                            lease.lose();
                            false
                        }
                    };
                    if !kept {
                        self.telemetry.lease_lost();
                        self.forget(member);
                    }
                }
                if vanished > 0 {
                    tracing::warn!(
                        semaphore = %self.name,
                        permits = vanished,
                        "permits were gone from the backend while their leases still ran: its \
                         keys were deleted or evicted (FLUSHALL, maxmemory), or lost in a \
                         restart or failover; they are reported lost"
                    );
                }
                true
            }
            Err(e) => {
                self.telemetry.backend_error(Op::Renew);
                tracing::warn!(
                    semaphore = %self.name,
                    error = %e,
                    permits = members.len(),
                    "could not renew leases; they are lost if no renewal succeeds before they end"
                );
                false
            }
        }
    }
}

/// A renewal task. Dropping it (the task ended, or its runtime shut down with it) lets the
/// next permit start another.
struct Running {
    keeper: Weak<Keeper>,
    id: u64,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(keeper) = self.keeper.upgrade() {
            let mut leases = lock(&keeper.leases);
            if leases.task == Some(self.id) {
                leases.task = None;
            }
        }
    }
}

impl Running {
    async fn run(self, wake: Arc<Notify>, mut reconnects: Option<watch::Receiver<u64>>) {
        let mut not_before = Instant::now();
        let mut pause = RETRY;
        // The connection was lost: renew at once (and keep trying) to learn whether the
        // backend still knows our holders.
        let mut urgent = false;
        loop {
            let (due, max_pause) = {
                let Some(keeper) = self.keeper.upgrade() else {
                    return;
                };
                let Some(due) = keeper.next_due(self.id) else {
                    return;
                };
                let at = if urgent {
                    not_before
                } else {
                    due.max(not_before)
                };
                keeper.planned(self.id, at);
                (at, (keeper.lease / 3).max(RETRY))
            };
            let reconnected = async {
                match reconnects.as_mut() {
                    Some(ticks) => ticks.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::time::sleep_until(due) => {}
                _ = wake.notified() => continue,
                open = reconnected => {
                    if open {
                        urgent = true;
                        not_before = Instant::now();
                    } else {
                        reconnects = None;
                    }
                    continue;
                }
            }
            let Some(keeper) = self.keeper.upgrade() else {
                return;
            };
            keeper.planned(self.id, Instant::now() + STALLED);
            if keeper.renew_all().await {
                urgent = false;
                pause = RETRY;
                // A lease the backend could not extend further stays due: no busy loop.
                not_before = Instant::now() + RETRY.min(keeper.lease / 3);
            } else {
                not_before = Instant::now() + pause.mul_f64(0.5 + fastrand::f64() / 2.0);
                pause = (pause * 2).min(max_pause);
            }
        }
    }
}
