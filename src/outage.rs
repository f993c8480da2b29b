//! What a semaphore does when its backend cannot be reached.

/// What [`Semaphore`](crate::Semaphore) answers when its backend fails (Redis unreachable,
/// too slow, restarting). Chosen per semaphore with
/// [`SemaphoreBuilder::on_outage`](crate::SemaphoreBuilder::on_outage); every request decided
/// this way is logged through `tracing` (target `tower_distributed_limit::outage`, level WARN)
/// and counted in [`Semaphore::outage_decisions`](crate::Semaphore::outage_decisions).
///
/// Only backend failures trigger the policy: a full semaphore still waits or times out as
/// usual. Once the backend answers again, requests go back to it by themselves.
///
/// # Example
///
/// ```
/// use tower_distributed_limit::{MemoryBackend, OutagePolicy, Semaphore};
///
/// // 30 connections shared by ~4 instances: during an outage each instance allows 7 itself.
/// let sem = Semaphore::builder("legacy-db")
///     .limit(30)
///     .on_outage(OutagePolicy::Local { limit: 7 })
///     .build(MemoryBackend::new())
///     .unwrap();
/// # let _ = sem;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OutagePolicy {
    /// Refuse: the request gets the backend's [`Error::Backend`](crate::Error::Backend). Safe
    /// for a resource that must never see more than the limit. The default.
    #[default]
    FailClosed,
    /// Let every request through without a limit, with a [`Permit`](crate::Permit) that
    /// [`is_degraded`](crate::Permit::is_degraded). For a limit that protects little compared
    /// with the cost of refusing traffic.
    FailOpen,
    /// Limit in this process alone, to `limit` at once: e.g. the global limit divided by the
    /// expected number of instances.
    Local {
        /// Permits this process may hand out while the backend is down.
        limit: u32,
    },
}

impl OutagePolicy {
    /// How many permits this process may hand out during an outage, if any.
    pub(crate) fn local_limit(self) -> Option<u32> {
        match self {
            OutagePolicy::FailClosed => None,
            OutagePolicy::FailOpen => Some(u32::MAX),
            OutagePolicy::Local { limit } => Some(limit),
        }
    }
}
