//! Permits in this process only: the same semantics as Redis (leases, weights, fencing tokens),
//! for development, tests and single-instance deployments.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::{Attempt, BoxFuture, Handle, sealed::Open};
use crate::Error;
use crate::waitlist::{Hub, Waitlist};

/// An in-process backend with the same semantics as [`RedisBackend`](crate::RedisBackend):
/// leases expire, weights add up, fencing tokens strictly increase. Clones share the permits.
///
/// Use it in development and tests, or as the embedded default of a single instance; use
/// [`RedisBackend`](crate::RedisBackend) to share a limit between processes.
///
/// # Example
///
/// ```
/// use tower_distributed_limit::{MemoryBackend, Semaphore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
/// let backend = MemoryBackend::new();
/// let a = Semaphore::builder("jobs").limit(2).build(backend.clone())?;
/// let b = Semaphore::builder("jobs").limit(2).build(backend)?; // same name, same permits
/// let _p = a.acquire_many(2).await?;
/// assert!(b.try_acquire().await?.is_none());
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct MemoryBackend {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend").finish_non_exhaustive()
    }
}

struct Shared {
    state: Mutex<State>,
    hub: Hub,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            state: Mutex::default(),
            hub: Hub::new(None),
        }
    }
}

#[derive(Default)]
struct State {
    semaphores: HashMap<Arc<str>, Holders>,
    /// One counter for every semaphore: strictly increasing per semaphore, never reset.
    fence: u64,
}

/// The live holders of one semaphore; removed from the map when the last one goes.
#[derive(Default)]
struct Holders {
    by_member: HashMap<String, (Instant, u32)>,
    used: u32,
}

impl Holders {
    /// Drops expired holders and returns the earliest remaining deadline.
    fn purge(&mut self, now: Instant) -> Option<Instant> {
        let mut freed = 0;
        self.by_member.retain(|_, (deadline, weight)| {
            let live = *deadline > now;
            if !live {
                freed += *weight;
            }
            live
        });
        self.used -= freed;
        self.by_member.values().map(|(deadline, _)| *deadline).min()
    }
}

impl MemoryBackend {
    /// A new, empty backend.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Open for MemoryBackend {
    fn open(&self, name: &str) -> Arc<dyn Handle> {
        Arc::new(MemorySemaphore {
            shared: self.shared.clone(),
            name: name.into(),
            waitlist: self.shared.hub.waitlist(name),
        })
    }
}

struct MemorySemaphore {
    shared: Arc<Shared>,
    name: Arc<str>,
    waitlist: Arc<Waitlist>,
}

impl MemorySemaphore {
    fn try_acquire(&self, member: &str, weight: u32, limit: u32, lease: Duration) -> Attempt {
        let now = Instant::now();
        let mut state = self.shared.state();
        let holders = state.semaphores.entry(self.name.clone()).or_default();
        let earliest = holders.purge(now);
        if u64::from(holders.used) + u64::from(weight) > u64::from(limit) {
            let retry_in = earliest.map_or(lease, |deadline| deadline - now);
            if holders.by_member.is_empty() {
                state.semaphores.remove(&self.name);
            }
            return Attempt::Full { retry_in };
        }
        holders.used += weight;
        holders
            .by_member
            .insert(member.to_owned(), (now + lease, weight));
        state.fence += 1;
        Attempt::Granted {
            token: state.fence,
            lease,
        }
    }

    fn remove(&self, member: &str) -> Option<u32> {
        let mut state = self.shared.state();
        let holders = state.semaphores.get_mut(&self.name)?;
        let (_, weight) = holders.by_member.remove(member)?;
        holders.used -= weight;
        if holders.by_member.is_empty() {
            state.semaphores.remove(&self.name);
        }
        Some(weight)
    }
}

impl Handle for MemorySemaphore {
    fn acquire<'a>(
        &'a self,
        member: &'a str,
        weight: u32,
        limit: u32,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Attempt, Error>> {
        let attempt = self.try_acquire(member, weight, limit, lease);
        Box::pin(async move { Ok(attempt) })
    }

    fn release<'a>(&'a self, member: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        if let Some(weight) = self.remove(member) {
            self.waitlist.wake(weight);
        }
        Box::pin(async { Ok(()) })
    }

    fn used(&self) -> BoxFuture<'_, Result<u32, Error>> {
        let now = Instant::now();
        let mut state = self.shared.state();
        let (used, empty) = match state.semaphores.get_mut(&self.name) {
            Some(holders) => {
                holders.purge(now);
                (holders.used, holders.by_member.is_empty())
            }
            None => (0, false),
        };
        if empty {
            state.semaphores.remove(&self.name);
        }
        Box::pin(async move { Ok(used) })
    }

    fn waitlist(&self) -> &Arc<Waitlist> {
        &self.waitlist
    }
}
