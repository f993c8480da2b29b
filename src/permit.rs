//! The permit guard: who holds it, its fencing token, its lease, and release on drop.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::Error;
use crate::backend::Member;
use crate::keeper::Lease;
use crate::semaphore::Inner;

/// A held share of a [`Semaphore`](crate::Semaphore), given back when dropped.
///
/// Dropping a permit releases it in the background (off the caller's path: with the Redis
/// backend, the release rides along with this process's next call for the semaphore, or a
/// spawned task sends it);
/// [`release`](Permit::release) does it now and reports errors. Either way a holder that dies
/// without releasing keeps its slot only until its lease ends.
///
/// # Example
///
/// ```
/// use tower_distributed_limit::{MemoryBackend, Semaphore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
/// let sem = Semaphore::builder("reports").limit(3).build(MemoryBackend::new())?;
/// let mut permit = sem.acquire_many(2).await?;
/// assert_eq!(permit.weight(), 2);
/// assert_eq!(permit.id().len(), 32);
/// assert!(!permit.is_lost());
/// // Pass the token to a resource that refuses writes carrying an older one.
/// let token: u64 = permit.fencing_token();
/// # let _ = token;
/// permit.release().await?;
/// permit.release().await?; // releasing twice is harmless
/// assert_eq!(sem.available_permits().await?, 3);
/// # Ok(()) }
/// ```
#[must_use = "a permit is released as soon as it is dropped"]
pub struct Permit {
    semaphore: Arc<Inner>,
    member: Member,
    token: u64,
    /// The lease as this process knows it, renewed by the semaphore's keeper.
    lease: Arc<Lease>,
    released: bool,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("semaphore", &self.semaphore.name)
            .field("id", &self.id())
            .field("weight", &self.member.weight)
            .field("fencing_token", &self.token)
            .field("released", &self.released)
            .finish()
    }
}

impl Permit {
    pub(crate) fn new(
        semaphore: Arc<Inner>,
        member: Member,
        token: u64,
        lease: Arc<Lease>,
    ) -> Self {
        Permit {
            semaphore,
            member,
            token,
            lease,
            released: false,
        }
    }

    /// Unique per acquisition (a random 128-bit id, hex), never reused.
    pub fn id(&self) -> &str {
        self.member.id()
    }

    /// How many permits this guard holds.
    pub fn weight(&self) -> u32 {
        self.member.weight
    }

    /// Strictly increasing per semaphore across all processes: a resource that remembers the
    /// highest token it saw can refuse a holder that was paused past its lease.
    pub fn fencing_token(&self) -> u64 {
        self.token
    }

    /// True once the lease is lost: it could not be renewed before it ended, or the backend
    /// no longer knows this holder. Another holder may have this slot now; a resource guarded
    /// by fencing tokens will refuse this one's. Never turns back to false.
    pub fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }

    /// Resolves when the lease is lost (at once if it is). The semaphore renews the lease of
    /// every live permit, so this only happens when the backend cannot be reached in time,
    /// the process was paused past the lease, or the holder was removed behind its back.
    pub async fn lost(&self) {
        self.lease.lost().await;
    }

    /// [`lost`](Self::lost) as a future that does not borrow the permit.
    pub(crate) fn lost_signal(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let lease = self.lease.clone();
        async move { lease.lost().await }
    }

    /// How long until the lease ends unless renewed (zero once lost).
    pub fn remaining(&self) -> Duration {
        if self.is_lost() {
            return Duration::ZERO;
        }
        self.lease
            .deadline()
            .saturating_duration_since(Instant::now())
    }

    /// True for a permit handed out by the [`OutagePolicy`](crate::OutagePolicy) while the
    /// backend was down: it counts against this process's local limit only (or none).
    pub fn is_degraded(&self) -> bool {
        self.semaphore.degraded
    }

    /// Gives the permit back now and reports whether the backend took it. Idempotent: after a
    /// success further calls do nothing; after an error, calling again (or dropping) retries.
    pub async fn release(&mut self) -> Result<(), Error> {
        if !self.released {
            self.semaphore.handle.release(&self.member).await?;
            self.released = true;
            self.semaphore.keeper.forget(&self.member.text);
        }
        Ok(())
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.released {
            self.semaphore.keeper.forget(&self.member.text);
            self.semaphore.handle.release_later(self.member.clone());
        }
    }
}
