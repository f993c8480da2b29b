//! Permits in this process only, with the same semantics as Redis: leases, weights, fencing
//! tokens, and one first-come-first-served line.
//!
//! This file is the backend's shell: the lock every semaphore of a [`MemoryBackend`] shares,
//! its clock, and the [`Store`] calls, each one settlement of the semaphore's [`Permits`]
//! (`permits.rs`, the state machine itself) before and after its operation, the grants it made
//! announced once the lock is released. Rate limiters are in `rate.rs`.

mod permits;
mod rate;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use self::permits::Permits;
use crate::backend::gcra::{Cells, Rated};
use crate::backend::member::Member;
use crate::backend::store::{
    Attempt, Ending, Mode, Opened, Samples, Store, default_process_name, sealed::Open,
};
use crate::class::Classes;
use crate::snapshot::Snapshot;
use crate::sync::{BoxFuture, lock};
use crate::waitlist::{ClockReading, Hub, KEEPALIVE, Refresh, Status, Until, Waitlist};
use crate::{AdaptiveLimit, Error};

/// An in-process backend with the same semantics as [`RedisBackend`](crate::RedisBackend):
/// leases expire, weights add up, fencing tokens strictly increase, waiters are served in
/// order. Clones share the permits.
///
/// Use it in development and tests, or as the embedded default of a single instance; use
/// [`RedisBackend`](crate::RedisBackend) to share a limit between processes.
///
/// # Examples
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
    shared: Arc<InProcess>,
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend").finish_non_exhaustive()
    }
}

/// What clones of one `MemoryBackend` share.
struct InProcess {
    state: Mutex<AllPermits>,
    hub: Hub,
    /// The backend's clock reads µs since this instant.
    epoch: Instant,
    /// The rate limiters' state (see `rate.rs`).
    rates: Mutex<Cells>,
}

impl Default for InProcess {
    fn default() -> Self {
        InProcess {
            state: Mutex::default(),
            hub: Hub::new(None),
            epoch: Instant::now(),
            rates: Mutex::default(),
        }
    }
}

impl InProcess {
    /// `at` on the backend's clock, as announcements carry it.
    fn server_us(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_micros()).unwrap_or(u64::MAX)
    }
}

/// Every semaphore of the backend, under one lock.
#[derive(Default)]
struct AllPermits {
    semaphores: HashMap<Arc<str>, Permits>,
    /// One counter for every semaphore: strictly increasing per semaphore, never reset.
    fence: u64,
    /// Idle semaphores kept for their adaptive limit are swept when the map reaches this size,
    /// which then becomes twice the live count (never more than twice the live ones).
    sweep_at: usize,
}

/// This process's name for its holders, read once.
fn process_name() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(default_process_name)
}

impl MemoryBackend {
    /// A new, empty backend.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Open for MemoryBackend {
    fn open(
        &self,
        name: &str,
        limit: u32,
        adaptive: Option<AdaptiveLimit>,
        classes: &Classes,
        _claim: Duration,
    ) -> Opened {
        let waitlist = self.shared.hub.waitlist(name);
        Opened {
            store: Arc::new(MemorySemaphore {
                shared: self.shared.clone(),
                name: name.into(),
                limit,
                adaptive,
                classes: *classes,
                in_force: AtomicU32::new(limit),
                crowded: watch::Sender::new(false),
                waitlist: waitlist.clone(),
            }),
            waitlist,
        }
    }
}

struct MemorySemaphore {
    shared: Arc<InProcess>,
    name: Arc<str>,
    limit: u32,
    adaptive: Option<AdaptiveLimit>,
    classes: Classes,
    /// The limit in force after this semaphore's last call (for `limit_in_force`, without
    /// taking the backend's lock).
    in_force: AtomicU32,
    /// Whether anyone waited after this semaphore's last call (see `Store::crowding`).
    crowded: watch::Sender<bool>,
    waitlist: Arc<Waitlist>,
}

impl MemorySemaphore {
    fn state(&self) -> MutexGuard<'_, AllPermits> {
        lock(&self.shared.state)
    }

    /// Runs `op` on this semaphore between two settlements, then announces the grants made
    /// (and any waiter dropped).
    fn with<R>(&self, op: impl FnOnce(&mut Permits, Instant, &mut u64) -> R) -> R {
        let now = Instant::now();
        let mut grants = Vec::new();
        let (result, dropped) = {
            let mut guard = self.state();
            let AllPermits {
                semaphores,
                fence,
                sweep_at,
            } = &mut *guard;
            if !semaphores.contains_key(&self.name) && semaphores.len() >= *sweep_at {
                semaphores.retain(|_, permits| !permits.forgettable(now));
                *sweep_at = (semaphores.len() * 2).max(64);
            }
            let permits = semaphores.entry(self.name.clone()).or_insert_with(|| {
                let epoch = self.shared.epoch;
                Permits::new(self.limit, self.adaptive, self.classes, epoch, now)
            });
            let dropped = permits.settle(now, fence, &mut grants);
            let result = op(permits, now, fence);
            let dropped = permits.settle(now, fence, &mut grants) || dropped;
            self.in_force.store(permits.limit(), Ordering::Relaxed);
            let crowded = permits.crowded();
            self.crowded
                .send_if_modified(|was| std::mem::replace(was, crowded) != crowded);
            if permits.forgettable(now) {
                semaphores.remove(&self.name);
            }
            (result, dropped)
        };
        if dropped {
            // A waiter left the line unserved (too heavy now): its waitlist learns at once,
            // as the script's message tells a Redis client.
            self.waitlist.touch_soon();
        }
        for (member, token, deadline) in grants {
            let until = Until::Server(self.shared.server_us(deadline));
            self.waitlist.grant(&member, token, until);
        }
        result
    }
}

impl Store for MemorySemaphore {
    fn acquire<'a>(
        &'a self,
        member: &'a Member,
        mode: Mode,
        _until: Option<Instant>,
        // Never given: this store combines with no rate limiter (`Store::combines`).
        _rate: Option<&'a Rated>,
    ) -> BoxFuture<'a, Result<Attempt, Error>> {
        let attempt = self.with(|permits, now, fence| {
            permits
                .acquire(member, mode, now, fence)
                .unwrap_or_else(|| Attempt::Queued {
                    retry_in: permits.retry_in(now, member.lease),
                    clock: ClockReading {
                        local: now,
                        server_us: self.shared.server_us(now),
                    },
                })
        });
        Box::pin(async move { Ok(attempt) })
    }

    fn release<'a>(
        &'a self,
        member: &'a Member,
        ending: Ending,
    ) -> BoxFuture<'a, Result<(), Error>> {
        self.release_later(member.clone(), ending);
        Box::pin(async { Ok(()) })
    }

    fn release_later(&self, member: Member, ending: Ending) {
        self.with(|permits, now, _| permits.release(&member, ending, now));
    }

    fn sampled(&self, samples: Samples) {
        self.with(|permits, now, _| permits.learn(now, samples));
    }

    fn renew<'a>(
        &'a self,
        members: &'a [Member],
    ) -> BoxFuture<'a, Result<Vec<Option<Duration>>, Error>> {
        let renewed = self.with(|permits, now, _| {
            members
                .iter()
                .map(|member| permits.extend(&member.text, now))
                .collect()
        });
        Box::pin(async move { Ok(renewed) })
    }

    fn used(&self) -> BoxFuture<'_, Result<u32, Error>> {
        let used = self.with(|permits, _, _| permits.used());
        Box::pin(async move { Ok(used) })
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        None
    }

    fn crowding(&self) -> Option<watch::Receiver<bool>> {
        Some(self.crowded.subscribe())
    }

    fn snapshot(&self) -> BoxFuture<'_, Result<Snapshot, Error>> {
        let snapshot = self.with(|permits, now, _| permits.snapshot(now, process_name()));
        Box::pin(async move { Ok(snapshot) })
    }

    fn evict<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, Error>> {
        let evicted = self.with(|permits, _, _| permits.evict(id));
        Box::pin(async move { Ok(evicted) })
    }

    fn limit_in_force(&self) -> Option<u32> {
        Some(self.in_force.load(Ordering::Relaxed))
    }

    fn set_limit(&self, limit: u32) -> BoxFuture<'_, Result<(), Error>> {
        self.with(|permits, _, _| permits.set_limit(limit));
        Box::pin(async { Ok(()) })
    }

    fn unset_limit(&self) -> BoxFuture<'_, Result<(), Error>> {
        self.with(|permits, _, _| permits.unset_limit());
        Box::pin(async { Ok(()) })
    }
}

impl Refresh for MemorySemaphore {
    fn touch<'a>(
        &'a self,
        members: &'a [Arc<str>],
        _until: Instant,
    ) -> BoxFuture<'a, Result<(Vec<Status>, Duration), Error>> {
        let found = self.with(|permits, now, fence| {
            let statuses = members
                .iter()
                .map(|member| permits.status(member, now, fence))
                .collect();
            (statuses, permits.retry_in(now, KEEPALIVE))
        });
        Box::pin(async move { Ok(found) })
    }
}
