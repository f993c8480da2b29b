//! What a permit knows of its lease: when it ends by this process's clock, whether the backend
//! dropped it, and a signal when it is lost. Shared by the permit and the keeper that renews it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::sync::lock;

/// What a permit knows of its lease, shared with the keeper that renews it.
pub(crate) struct Lease {
    state: Mutex<LeaseState>,
    changed: Notify,
}

struct LeaseState {
    /// When the lease ends by this process's clock, derived from the backend's clock so it is
    /// never later than the backend's own deadline.
    deadline: Instant,
    /// How long the lease ran when it was last granted or renewed: it is renewed once a third
    /// of that has passed.
    term: Duration,
    /// The backend no longer holds this permit (expired, or removed behind our back).
    gone: bool,
}

impl Lease {
    /// A lease that ends at `deadline`, granted at `now` (already lost if that has passed).
    pub(crate) fn new(deadline: Instant, now: Instant) -> Arc<Self> {
        Arc::new(Lease {
            state: Mutex::new(LeaseState {
                deadline,
                term: deadline.saturating_duration_since(now),
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

    /// When this lease should be renewed, unless it is lost.
    pub(crate) fn due(&self) -> Option<Instant> {
        let state = lock(&self.state);
        if state.gone || Instant::now() >= state.deadline {
            return None;
        }
        let early = state.term.mul_f64(2.0 / 3.0);
        Some(state.deadline.checked_sub(early).unwrap_or(state.deadline))
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
    pub(crate) fn renewed(&self, deadline: Instant) -> bool {
        let mut state = lock(&self.state);
        let now = Instant::now();
        let live = !state.gone && now < state.deadline;
        if live && deadline > state.deadline {
            state.deadline = deadline;
            state.term = deadline - now;
        }
        drop(state);
        self.changed.notify_waiters();
        live
    }

    pub(crate) fn lose(&self) {
        lock(&self.state).gone = true;
        self.changed.notify_waiters();
    }
}
