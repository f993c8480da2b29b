//! The permit guard: who holds it, its fencing token, its lease, and release on drop.
//!
//! One mechanism gives members back: a [`MemberGuard`] is a member this process may hold or have
//! queued in the backend, released in the background when dropped. An acquisition under way
//! holds a claim (a cancelled or failed acquire leaks nothing); a [`Permit`] is a claim that
//! was granted.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::Error;
use crate::backend::RateDecision;
use crate::backend::{Ending, Member, Store};
use crate::keeper::Keeper;
use crate::lease::Lease;
use crate::telemetry::{Op, Telemetry};

/// A held share of a [`Semaphore`](crate::Semaphore), given back when dropped.
///
/// Dropping a permit releases it in the background (off the caller's path: with the Redis
/// backend, the release rides along with this process's next call for the semaphore, or a
/// spawned task sends it);
/// [`release`](Permit::release) does it now and reports errors. Either way a holder that dies
/// without releasing keeps its slot only until its lease ends.
///
/// # Examples
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
    claim: MemberGuard,
    token: u64,
    /// The lease as this process knows it, renewed by the semaphore's keeper.
    lease: Arc<Lease>,
    /// The prefetched slots it returns to when dropped, while they want it back.
    returns_to: Option<Weak<dyn TakesBack>>,
}

/// Where a permit done with may go instead of back to the backend: its semaphore's prefetch
/// pool (`semaphore/prefetch.rs`), which keeps the slot held for the next acquire.
pub(crate) trait TakesBack: Send + Sync {
    /// Whether a permit done with may come back rather than go to the backend.
    fn wants_back(&self) -> bool;

    /// Whether the holds that end here are an adaptive limit's samples (`returned` wants
    /// their endings).
    fn learns(&self) -> bool;

    /// `permit`, handed out, is done with; its hold ended as `ending` says (given when the
    /// prefetch [`learns`](Self::learns)).
    fn returned(&self, permit: Permit, ending: Option<Ending>);
}

/// What the permits of one semaphore share: where they are released and who renews them.
pub(crate) struct Origin {
    pub(crate) name: String,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) keeper: Arc<Keeper>,
    /// These are the outage policy's in-process permits.
    pub(crate) degraded: bool,
    pub(crate) telemetry: Telemetry,
}

/// A member this process may hold or have queued in the backend. Until it is given back (or
/// disarmed: nothing was added), dropping it releases the member in the background.
pub(crate) struct MemberGuard {
    origin: Arc<Origin>,
    member: Member,
    armed: bool,
    /// When it became a live permit, for `dlimit_permit_hold_seconds`.
    granted: Option<Instant>,
    /// It is on hand in the prefetch: its release ends no hold (no adaptive sample).
    on_hand: bool,
    /// Its grant also spent a rate limit's allowance, in the same backend call, or the layer
    /// checked the rate once it was held: what the rate limit decided.
    rate: Option<RateDecision>,
    /// Its request was dropped or timed out downstream (`Permit::mark_overloaded`): an adaptive
    /// limit's congestion signal, sent with the release.
    overloaded: AtomicBool,
}

impl MemberGuard {
    /// A fresh member asking `ask`, with the semaphore's lease; `prefetched`: its slot may go to
    /// the prefetch.
    pub(crate) fn new(
        origin: &Arc<Origin>,
        ask: &crate::Ask,
        lease: Duration,
        prefetched: bool,
    ) -> Self {
        MemberGuard {
            origin: origin.clone(),
            member: Member::asking(ask, lease, prefetched),
            armed: true,
            granted: None,
            on_hand: false,
            rate: None,
            overloaded: AtomicBool::new(false),
        }
    }

    pub(crate) fn member(&self) -> &Member {
        &self.member
    }

    /// The backend holds nothing of this member: there is nothing to give back.
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }

    /// The backend granted the member with `token` until `deadline` (by this process's clock,
    /// never later than the backend's). A lease that already ended makes a permit that is lost
    /// at once; the keeper renews the others. `rate`: the grant also spent a rate limit's
    /// allowance, with what that left.
    pub(crate) fn into_permit(
        mut self,
        token: u64,
        deadline: Instant,
        rate: Option<RateDecision>,
    ) -> Permit {
        self.rate = rate;
        let now = Instant::now();
        // Never believed past the configured lease from now, whatever the server said: a
        // server whose clock stepped back reports deadlines a step too far ahead.
        let deadline = deadline.min(now + self.member.lease);
        let lease = Lease::new(deadline, now);
        if now >= deadline {
            self.origin.telemetry.lease_lost();
        } else {
            self.origin.keeper.keep(self.member.clone(), &lease);
            self.origin
                .telemetry
                .holding(self.member.weight, true, Duration::ZERO);
            self.granted = Some(now);
        }
        Permit {
            claim: self,
            token,
            lease,
            returns_to: None,
        }
    }

    /// Held from now on, for the hold time it reports (a prefetched slot handed out).
    fn handed_out(&mut self) {
        self.on_hand = false;
        if self.granted.is_some() {
            self.granted = Some(Instant::now());
        }
    }

    /// The same member, armed, for a new guard; this one is disarmed (its drop does nothing).
    fn take_over(&mut self) -> Option<MemberGuard> {
        if !self.armed {
            return None;
        }
        self.armed = false;
        Some(MemberGuard {
            origin: self.origin.clone(),
            member: self.member.clone(),
            armed: true,
            granted: self.granted,
            on_hand: self.on_hand,
            rate: None,
            overloaded: AtomicBool::new(false),
        })
    }

    /// Gives the member back now; after a success, dropping does nothing.
    async fn release(&mut self) -> Result<(), Error> {
        if self.armed {
            self.origin
                .store
                .release(&self.member, self.ending())
                .await
                .inspect_err(|_| self.origin.telemetry.backend_error(Op::Release))?;
            self.armed = false;
            self.origin.keeper.forget(&self.member);
            self.released();
        }
        Ok(())
    }

    /// How the hold ends now: an adaptive limit's sample (none for a slot on hand in the prefetch).
    fn ending(&self) -> Ending {
        Ending {
            held: (self.granted.filter(|_| !self.on_hand)).map(|granted| granted.elapsed()),
            overloaded: self.overloaded.load(Ordering::Relaxed),
        }
    }

    /// Counts the end of a live permit's hold.
    fn released(&mut self) {
        if let Some(granted) = self.granted.take() {
            let telemetry = &self.origin.telemetry;
            telemetry.holding(self.member.weight, false, granted.elapsed());
        }
    }
}

impl Drop for MemberGuard {
    fn drop(&mut self) {
        if self.armed {
            self.origin.keeper.forget(&self.member);
            let ending = self.ending();
            self.origin.store.release_later(self.member.clone(), ending);
            self.released();
        }
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("semaphore", &self.claim.origin.name)
            .field("id", &self.id())
            .field("weight", &self.weight())
            .field("fencing_token", &self.token)
            .field("released", &!self.claim.armed)
            .finish()
    }
}

impl Permit {
    /// What the rate limit decided with its grant, in the same backend call (the layer's
    /// `rate_limit`); `None`: not spent there.
    pub(crate) fn rate(&self) -> Option<&RateDecision> {
        self.claim.rate.as_ref()
    }

    /// Unique per acquisition (a random 128-bit id, hex), never reused.
    pub fn id(&self) -> &str {
        self.claim.member.id()
    }

    /// How many permits this guard holds.
    pub fn weight(&self) -> u32 {
        self.claim.member.weight
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
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only waits.
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
        self.claim.origin.degraded
    }

    /// Marks the request behind this permit as dropped or timed out downstream: a congestion
    /// signal, sent with the release, that lowers an
    /// [adaptive limit](crate::SemaphoreBuilder::adaptive) by a tenth (nothing for a fixed
    /// limit). The layer calls it for you, for the answers
    /// [`overloaded_on_error`](crate::DistributedConcurrencyLimitLayer::overloaded_on_error) (or, over HTTP, [`overloaded_on_status`](crate::DistributedConcurrencyLimitLayer::overloaded_on_status)) names.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{AdaptiveLimit, MemoryBackend, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
    /// let sem = Semaphore::builder("db")
    ///     .adaptive(AdaptiveLimit::new().initial(10))
    ///     .build(MemoryBackend::new())?;
    /// let permit = sem.acquire().await?;
    /// // ... the query behind it timed out:
    /// permit.mark_overloaded();
    /// drop(permit);
    /// # Ok(()) }
    /// ```
    pub fn mark_overloaded(&self) {
        self.claim.overloaded.store(true, Ordering::Relaxed);
    }

    /// Gives the permit back now and reports whether the backend took it. Idempotent: after a
    /// success further calls do nothing; after an error, calling again (or dropping) retries.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the backend could not be reached: the permit is still held by
    /// this guard, and calling again (or dropping it) retries. Its slot comes back at the latest
    /// when its lease ends.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future before it resolves leaves the release to the guard's
    /// drop, which releases in the background.
    pub async fn release(&mut self) -> Result<(), Error> {
        self.claim.release().await
    }

    /// A prefetched permit handed out: its hold counts from now.
    pub(crate) fn handed_out(mut self) -> Permit {
        self.claim.handed_out();
        self
    }

    /// Returns to `pool` when dropped (unless someone waits or the pool is full).
    pub(crate) fn returning_to(mut self, pool: Weak<dyn TakesBack>) -> Permit {
        self.returns_to = Some(pool);
        self
    }

    /// Its member in the backend.
    pub(crate) fn member(&self) -> &Member {
        self.claim.member()
    }

    /// Idle in the prefetch until handed out: released from there, it ends no hold.
    pub(crate) fn on_hand(&mut self) {
        self.claim.on_hand = true;
    }

    /// Released to the backend when dropped, whatever its pool wants.
    pub(crate) fn forget_return(&mut self) {
        self.returns_to = None;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        // Back to its pool while the pool wants it: the slot stays held, renewed by the
        // keeper, for the next acquire. Otherwise the claim's drop releases it.
        let Some(pool) = self.returns_to.as_ref().and_then(Weak::upgrade) else {
            return;
        };
        if self.is_lost() || !pool.wants_back() {
            return;
        }
        // The hold ends here, not in the backend: the pool passes it on as a sample, where a
        // limit learns from it.
        let ending = pool.learns().then(|| self.claim.ending());
        if let Some(claim) = self.claim.take_over() {
            pool.returned(
                Permit {
                    claim,
                    token: self.token,
                    lease: self.lease.clone(),
                    returns_to: self.returns_to.clone(),
                },
                ending,
            );
        }
    }
}
