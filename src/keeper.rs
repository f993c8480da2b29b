//! Lease renewal: every live permit of a semaphore in this process is renewed by one call per
//! interval (a third of the lease), and a permit the backend no longer knows is marked lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{BATCH, Handle};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a permit knows of its lease, shared with the keeper that renews it.
pub(crate) struct Lease {
    state: Mutex<LeaseState>,
    changed: Notify,
}

struct LeaseState {
    /// When the lease ends by this process's clock, counted from before the call that granted
    /// or renewed it, so never later than the backend's own deadline.
    deadline: Instant,
    /// The backend no longer holds this permit (expired, or removed behind our back).
    gone: bool,
}

impl Lease {
    pub(crate) fn new(deadline: Instant) -> Arc<Self> {
        Arc::new(Lease {
            state: Mutex::new(LeaseState {
                deadline,
                gone: false,
            }),
            changed: Notify::new(),
        })
    }

    pub(crate) fn deadline(&self) -> Instant {
        lock(&self.state).deadline
    }

    pub(crate) fn is_lost(&self) -> bool {
        let state = lock(&self.state);
        state.gone || Instant::now() >= state.deadline
    }

    /// Resolves once the lease is lost: the backend dropped it, or its deadline passed without
    /// a renewal.
    pub(crate) async fn lost(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before reading the state, so a renewal in between is not missed.
            changed.as_mut().enable();
            let deadline = {
                let state = lock(&self.state);
                if state.gone {
                    return;
                }
                state.deadline
            };
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {
                    if Instant::now() >= self.deadline() {
                        return;
                    }
                }
                _ = changed => {}
            }
        }
    }

    /// Moves the deadline to `deadline`; false if the lease was already lost, which a late
    /// renewal does not undo (a holder told it lost its slot stays told).
    fn renewed(&self, deadline: Instant) -> bool {
        let mut state = lock(&self.state);
        let live = !state.gone && Instant::now() < state.deadline;
        if live {
            state.deadline = state.deadline.max(deadline);
        }
        drop(state);
        self.changed.notify_waiters();
        live
    }

    fn lose(&self) {
        lock(&self.state).gone = true;
        self.changed.notify_waiters();
    }
}

/// Renews the live permits of one semaphore. Its task runs only while there are permits.
pub(crate) struct Keeper {
    handle: Arc<dyn Handle>,
    interval: Duration,
    leases: Mutex<Leases>,
}

#[derive(Default)]
struct Leases {
    live: HashMap<Arc<str>, Weak<Lease>>,
    running: bool,
}

impl Keeper {
    pub(crate) fn new(handle: Arc<dyn Handle>, lease: Duration) -> Arc<Self> {
        Arc::new(Keeper {
            handle,
            interval: lease / 3,
            leases: Mutex::default(),
        })
    }

    /// Starts renewing `member`'s lease.
    pub(crate) fn keep(self: &Arc<Self>, member: Arc<str>, lease: &Arc<Lease>) {
        let mut leases = lock(&self.leases);
        leases.live.insert(member, Arc::downgrade(lease));
        if leases.running {
            return;
        }
        // Permits are made inside the runtime; outside one there is nothing to run on, and
        // the lease simply runs out.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            leases.running = true;
            runtime.spawn(self.clone().run());
        }
    }

    /// Stops renewing `member` (released, or lost).
    pub(crate) fn forget(&self, member: &str) {
        lock(&self.leases).live.remove(member);
    }

    async fn run(self: Arc<Self>) {
        loop {
            tokio::time::sleep(self.interval).await;
            let batch: Vec<(Arc<str>, Arc<Lease>)> = {
                let mut leases = lock(&self.leases);
                leases.live.retain(|_, lease| lease.strong_count() > 0);
                if leases.live.is_empty() {
                    leases.running = false;
                    return;
                }
                leases
                    .live
                    .iter()
                    .filter_map(|(member, lease)| Some((member.clone(), lease.upgrade()?)))
                    .collect()
            };
            for chunk in batch.chunks(BATCH) {
                self.renew(chunk).await;
            }
        }
    }

    async fn renew(&self, chunk: &[(Arc<str>, Arc<Lease>)]) {
        let members: Vec<Arc<str>> = chunk.iter().map(|(member, _)| member.clone()).collect();
        let sent = Instant::now();
        match self.handle.renew(&members).await {
            Ok(renewed) => {
                for ((member, lease), renewed) in chunk.iter().zip(renewed) {
                    let kept = match renewed {
                        Some(lease_left) => lease.renewed(sent + lease_left),
                        None => {
                            lease.lose();
                            false
                        }
                    };
                    if !kept {
                        self.forget(member);
                    }
                }
            }
            // The next interval tries again; a lease that runs out meanwhile is lost.
            Err(e) => tracing::warn!(
                error = %e,
                permits = chunk.len(),
                "could not renew leases; they are lost if no renewal succeeds before they end"
            ),
        }
    }
}
