//! The semaphore: one-shot and waiting acquisition, on the settings its builder checked
//! (`builder.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::{Attempt, Backend, Mode, Opened, Rated};
use crate::keeper::Keeper;
use crate::outage::OutageLog;
use crate::permit::{MemberGuard, Origin, Permit};
use crate::snapshot::Snapshot;
use crate::telemetry::{Op, Outcome, Telemetry};
use crate::waitlist::{Waitlist, Wake};
use crate::{Ask, Error, Priority, RateLimiter};

mod builder;
mod prefetch;

pub use self::builder::SemaphoreBuilder;
use self::builder::{Checked, Settings};
use self::prefetch::{Prefetch, Source};

/// A counting semaphore shared by every process that builds one with the same name on the same
/// backend: at most [`limit`](Semaphore::limit) permits are out at once, across all of them.
///
/// Cheap to clone; clones share everything. Permits are [`Permit`] guards: dropping one gives
/// it back. A holder that dies keeps its slot only until its lease runs out.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_distributed_limit::{MemoryBackend, Semaphore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
/// // In production: RedisBackend::connect("redis://...").await?
/// let sem = Semaphore::builder("llm-api")
///     .limit(2)
///     .lease(Duration::from_secs(30))
///     .acquire_timeout(Duration::from_secs(10))
///     .build(MemoryBackend::new())?;
///
/// let first = sem.acquire().await?;
/// let second = sem.try_acquire().await?.expect("one permit was still free");
/// assert!(second.fencing_token() > first.fencing_token());
/// assert!(sem.try_acquire().await?.is_none()); // full
/// assert_eq!(sem.available_permits().await?, 0);
/// drop(first);
/// let _third = sem.acquire().await?; // the dropped permit came back
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Semaphore {
    inner: Arc<Core>,
}

/// What clones of one `Semaphore` share.
struct Core {
    settings: Settings,
    /// Where permits are released and who renews them.
    origin: Arc<Origin>,
    /// This process's waiters, to which grants are announced.
    waitlist: Arc<Waitlist>,
    /// The in-process semaphore that admits requests while the backend is down (by the outage
    /// policy); `None` when failing closed.
    fallback: Option<Semaphore>,
    outage_decisions: AtomicU64,
    outage_log: OutageLog,
    /// The slots taken ahead of need (`SemaphoreBuilder::prefetch`), where the backend tells
    /// whether anyone waits.
    prefetch: Option<Arc<Prefetch>>,
}

impl std::fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let settings = &self.inner.settings;
        f.debug_struct("Semaphore")
            .field("name", &settings.name)
            .field("limit", &settings.limit)
            .field("lease", &settings.lease)
            .field("acquire_timeout", &settings.acquire_timeout)
            .field("outage", &settings.outage)
            .finish_non_exhaustive()
    }
}

impl Semaphore {
    /// Starts the settings of the semaphore called `name`: every process that uses the same
    /// name on the same backend shares one limit.
    pub fn builder(name: impl Into<String>) -> SemaphoreBuilder {
        SemaphoreBuilder::new(name)
    }
}

impl SemaphoreBuilder {
    /// Checks the settings and opens the semaphore on `backend`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an empty name or one over [`MAX_NAME_LEN`](crate::MAX_NAME_LEN) bytes, a missing or zero
    /// limit, both a limit and an adaptive one, adaptive bounds out of order (see
    /// [`AdaptiveLimit`](crate::AdaptiveLimit)) or on a backend that cannot adapt ([`QuorumBackend`](crate::QuorumBackend)), a lease under 1 ms or over 49 days, a claim window under 1 ms, a zero acquire
    /// timeout or `max_waiters`, or a local outage limit of 0. Nothing is sent to the backend.
    pub fn build(self, backend: impl Backend) -> Result<Semaphore, Error> {
        let Checked { settings, fallback } = self.settings(&backend)?;
        let fallback =
            fallback.map(|local| Semaphore::open(local, &crate::MemoryBackend::new(), None, true));
        Ok(Semaphore::open(settings, &backend, fallback, false))
    }
}

impl Semaphore {
    /// Opens the semaphore on `backend`. `degraded`: this is the in-process fallback of
    /// another semaphore, whose permits the outage policy hands out.
    fn open(
        settings: Settings,
        backend: &dyn Backend,
        fallback: Option<Semaphore>,
        degraded: bool,
    ) -> Semaphore {
        let Opened { store, waitlist } = backend.open(
            &settings.name,
            settings.limit,
            settings.adaptive,
            &settings.classes,
            settings.claim,
        );
        let origin = Arc::new(Origin {
            name: settings.name.clone(),
            keeper: Keeper::new(
                store.clone(),
                settings.name.clone(),
                settings.lease,
                settings.telemetry.clone(),
            ),
            telemetry: settings.telemetry.clone(),
            store,
            degraded,
        });
        let prefetch = (settings.prefetch > 0)
            .then(|| origin.store.crowding())
            .flatten()
            .map(|crowding| {
                let adaptive = settings.adaptive.is_some();
                Prefetch::new(settings.prefetch, origin.store.clone(), crowding, adaptive)
            });
        Semaphore {
            inner: Arc::new(Core {
                outage_log: OutageLog::new("semaphore", &settings.name, settings.outage),
                settings,
                origin,
                waitlist,
                fallback,
                outage_decisions: AtomicU64::new(0),
                prefetch,
            }),
        }
    }

    /// How many requests the [`OutagePolicy`](crate::OutagePolicy) decided because the backend failed (refused,
    /// let through, or limited locally) since this semaphore was built: alert on its growth.
    pub fn outage_decisions(&self) -> u64 {
        self.inner.outage_decisions.load(Ordering::Relaxed)
    }

    /// The name shared by every process.
    pub fn name(&self) -> &str {
        &self.inner.settings.name
    }

    /// The limit this process was built with (an adaptive limit's initial one). The limit in
    /// force for every process, which `set_limit` or adapting may have moved, is
    /// [`snapshot`](Self::snapshot)`().limit`.
    pub fn limit(&self) -> u32 {
        self.inner.settings.limit
    }

    /// How long a silent holder keeps its slot.
    pub fn lease(&self) -> Duration {
        self.inner.settings.lease
    }

    /// Takes one permit, waiting up to the acquire timeout for one to come free.
    ///
    /// Waiters are served first come, first served across every process, and sleep until
    /// their grant is announced; they do not poll. Cancelling the returned future (dropping it,
    /// a timeout around it) never leaks a permit and leaves the line.
    ///
    /// # Errors
    ///
    /// As [`acquire_many`](Self::acquire_many).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future (a `select!`, a timeout around it) before it resolves
    /// takes nothing and leaves the line; a permit granted meanwhile is released in the
    /// background.
    pub async fn acquire(&self) -> Result<Permit, Error> {
        self.acquire_many(1).await
    }

    /// Takes `weight` permits at once, as one holder, waiting like [`acquire`](Self::acquire).
    ///
    /// The acquire timeout bounds the wait *in line*: with a free slot even a 1 ms timeout
    /// succeeds, and a full semaphore answers [`Error::Timeout`] once it has passed. A backend
    /// that does not answer within its own call timeout counts as failed.
    ///
    /// # Errors
    ///
    /// - [`Error::Config`] at once for a weight of 0 or above the limit (it could never be
    ///   granted);
    /// - [`Error::Timeout`] when no slot came free within the acquire timeout;
    /// - [`Error::TooManyWaiters`] when [`max_waiters`](SemaphoreBuilder::max_waiters) callers of
    ///   this process already wait;
    /// - [`Error::Backend`] when the backend failed and the [`OutagePolicy`](crate::OutagePolicy) refuses.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future (a `select!`, a timeout around it) before it resolves
    /// takes nothing and leaves the line; a permit granted meanwhile is released in the
    /// background.
    pub async fn acquire_many(&self, weight: u32) -> Result<Permit, Error> {
        self.acquire_asked(&Ask::new().weight(weight), None).await
    }

    /// One permit in class `priority`, waiting like [`acquire`](Self::acquire): the line serves
    /// a higher class first, inside the share the semaphore gives it
    /// ([`SemaphoreBuilder::class`]).
    ///
    /// # Errors
    ///
    /// As [`acquire_with`](Self::acquire_with).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{MemoryBackend, Priority, Semaphore, Share};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
    /// let sem = Semaphore::builder("gpu")
    ///     .limit(4)
    ///     .class(Priority::CRITICAL, Share::reserved(1))
    ///     .build(MemoryBackend::new())?;
    /// let _batch = sem.acquire_many(3).await?; // everything the reservation leaves
    /// assert!(sem.try_acquire().await?.is_none());
    /// let _critical = sem.acquire_as(Priority::CRITICAL).await?; // its reserved slot
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_as(&self, priority: Priority) -> Result<Permit, Error> {
        self.acquire_asked(&Ask::new().priority(priority), None)
            .await
    }

    /// What `ask` asks (its weight and class), waiting like [`acquire`](Self::acquire).
    ///
    /// # Errors
    ///
    /// As [`acquire_many`](Self::acquire_many); [`Error::Config`] names the class when the
    /// weight is above what its class may ever hold.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{Ask, MemoryBackend, Priority, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
    /// let sem = Semaphore::builder("gpu").limit(4).build(MemoryBackend::new())?;
    /// let permit = sem.acquire_with(Ask::new().priority(Priority::BATCH).weight(2)).await?;
    /// assert_eq!(permit.weight(), 2);
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_with(&self, ask: Ask) -> Result<Permit, Error> {
        self.acquire_asked(&ask, None).await
    }

    /// A span per acquisition (target `tower_distributed_limit::acquire`, DEBUG) with the
    /// semaphore, the weight and the mode; its outcome and wait are recorded when it ends.
    fn span(&self, ask: &Ask, mode: &'static str) -> tracing::Span {
        tracing::debug_span!(target: "tower_distributed_limit::acquire", "acquire",
            semaphore = %self.inner.settings.name, weight = ask.get_weight(),
            class = %ask.get_priority(), mode,
            outcome = tracing::field::Empty, wait_ms = tracing::field::Empty)
    }

    /// A permit as [`acquire_many`](Self::acquire_many) (`wait`) or
    /// [`try_acquire_many`](Self::try_acquire_many) (else [`Error::Full`]) take it, spending
    /// `weight` of `rate` in the same backend call when the backend reaches the limiter there
    /// and the permit is granted at once (`Permit::rate`). For the layer's `rate_limit`.
    pub(crate) async fn acquire_rated(
        &self,
        ask: &Ask,
        wait: bool,
        rate: &RateLimiter,
    ) -> Result<Permit, Error> {
        let rated = rate
            .combinable()
            .filter(|limiter| self.inner.origin.store.combines(limiter))
            .map(|limiter| Rated {
                limiter,
                cost: ask.get_weight(),
            });
        if wait {
            self.acquire_from_store(ask, rated.as_ref()).await
        } else {
            self.try_from_store(ask, rated.as_ref())
                .await?
                .ok_or(Error::Full)
        }
    }

    /// `acquire_with`, with the rate limit it may decide in the same call.
    async fn acquire_asked(&self, ask: &Ask, rate: Option<&Rated>) -> Result<Permit, Error> {
        match self.take_prefetched(ask, rate.is_some()) {
            Some(permit) => Ok(permit),
            None => self.acquire_from_store(ask, rate).await,
        }
    }

    /// `acquire_asked` past the prefetch (for a caller that asked it already: the layer).
    pub(crate) async fn acquire_from_store(
        &self,
        ask: &Ask,
        rate: Option<&Rated>,
    ) -> Result<Permit, Error> {
        async {
            self.check_weight(ask)?;
            let started = Instant::now();
            let deadline = deadline_after(started, self.inner.settings.acquire_timeout);
            let result = match self.wait_for(ask, started, deadline, rate).await {
                Err(e @ Error::Backend(_)) => match self.fallback(e, ask.get_weight()) {
                    Ok(fallback) => fallback.wait_for(ask, started, deadline, None).await,
                    Err(e) => Err(e),
                },
                other => {
                    if matches!(other, Ok(_) | Err(Error::Timeout { .. })) {
                        self.inner.outage_log.answered();
                    }
                    other
                }
            };
            self.report(ask, result.as_ref().map(Some), started);
            result.map(|permit| self.returning_to_prefetch(permit, ask, rate.is_some()))
        }
        .instrument(self.span(ask, "wait"))
        .await
    }

    /// Counts how an acquisition of `ask` ended: a permit, none (full), or an error.
    fn report(&self, ask: &Ask, result: Result<Option<&Permit>, &Error>, started: Instant) {
        let telemetry = &self.inner.settings.telemetry;
        let outcome = match result {
            Ok(Some(permit)) if permit.is_degraded() => Outcome::Degraded,
            Ok(Some(_)) => Outcome::Acquired,
            Ok(None) => Outcome::Rejected,
            Err(Error::Timeout { .. }) => Outcome::Timeout,
            Err(Error::TooManyWaiters { .. }) => Outcome::TooManyWaiters,
            Err(Error::Backend(_) | Error::AccessDenied(_)) => {
                telemetry.backend_error(Op::Acquire);
                Outcome::BackendError
            }
            Err(_) => return,
        };
        let waited = started.elapsed();
        telemetry.acquire(ask.get_priority(), outcome, waited);
        if let Some(limit) = self.inner.origin.store.limit_in_force() {
            telemetry.limit(limit);
        }
        let span = tracing::Span::current();
        span.record("outcome", outcome.as_str());
        span.record("wait_ms", waited.as_secs_f64() * 1000.0);
    }

    /// One attempt at one permit: `Ok(None)` when the semaphore is full.
    ///
    /// # Errors
    ///
    /// As [`try_acquire_many`](Self::try_acquire_many).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future before it resolves takes nothing (a permit granted
    /// meanwhile is released in the background).
    pub async fn try_acquire(&self) -> Result<Option<Permit>, Error> {
        self.try_acquire_many(1).await
    }

    /// One attempt at `weight` permits: `Ok(None)` when they do not fit now, or when others
    /// are already waiting for them (a one-shot attempt does not jump the line).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a weight of 0 or above the limit; [`Error::Backend`] when the
    /// backend failed and the [`OutagePolicy`](crate::OutagePolicy) refuses.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future before it resolves takes nothing (a permit granted
    /// meanwhile is released in the background).
    pub async fn try_acquire_many(&self, weight: u32) -> Result<Option<Permit>, Error> {
        self.try_asked(&Ask::new().weight(weight), None).await
    }

    /// One attempt at one permit in class `priority`: `Ok(None)` when it does not fit now, or
    /// when others of its class or a higher one wait.
    ///
    /// # Errors
    ///
    /// As [`try_acquire_many`](Self::try_acquire_many).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{MemoryBackend, Priority, Semaphore, Share};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
    /// let sem = Semaphore::builder("gpu")
    ///     .limit(2)
    ///     .class(Priority::CRITICAL, Share::reserved(1))
    ///     .build(MemoryBackend::new())?;
    /// let _one = sem.try_acquire().await?.expect("one slot is not reserved");
    /// assert!(sem.try_acquire().await?.is_none()); // the other is CRITICAL's
    /// assert!(sem.try_acquire_as(Priority::CRITICAL).await?.is_some());
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// As [`try_acquire`](Self::try_acquire).
    pub async fn try_acquire_as(&self, priority: Priority) -> Result<Option<Permit>, Error> {
        self.try_acquire_with(Ask::new().priority(priority)).await
    }

    /// One attempt at what `ask` asks: `Ok(None)` when it does not fit now, or when others
    /// of its class or a higher one wait.
    ///
    /// # Errors
    ///
    /// As [`try_acquire_many`](Self::try_acquire_many).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{Ask, MemoryBackend, Priority, Semaphore, Share};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
    /// let sem = Semaphore::builder("gpu")
    ///     .limit(4)
    ///     .class(Priority::BATCH, Share::at_most(1))
    ///     .build(MemoryBackend::new())?;
    /// let batch = Ask::new().priority(Priority::BATCH);
    /// let _one = sem.try_acquire_with(batch.clone()).await?.expect("room for one");
    /// assert!(sem.try_acquire_with(batch).await?.is_none()); // BATCH holds at most 1
    /// assert!(sem.try_acquire().await?.is_some()); // NORMAL shares the rest
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// As [`try_acquire`](Self::try_acquire).
    pub async fn try_acquire_with(&self, ask: Ask) -> Result<Option<Permit>, Error> {
        self.try_asked(&ask, None).await
    }

    /// `try_acquire_with`, with the rate limit it may decide in the same call.
    async fn try_asked(&self, ask: &Ask, rate: Option<&Rated>) -> Result<Option<Permit>, Error> {
        match self.take_prefetched(ask, rate.is_some()) {
            Some(permit) => Ok(Some(permit)),
            None => self.try_from_store(ask, rate).await,
        }
    }

    /// `try_asked` past the prefetch (for a caller that asked it already: the layer).
    pub(crate) async fn try_from_store(
        &self,
        ask: &Ask,
        rate: Option<&Rated>,
    ) -> Result<Option<Permit>, Error> {
        async {
            self.check_weight(ask)?;
            let started = Instant::now();
            let result = match self.try_once(ask, rate).await {
                Err(e @ Error::Backend(_)) => match self.fallback(e, ask.get_weight()) {
                    Ok(fallback) => fallback.try_once(ask, None).await,
                    Err(e) => Err(e),
                },
                other => {
                    if other.is_ok() {
                        self.inner.outage_log.answered();
                    }
                    other
                }
            };
            self.report(ask, result.as_ref().map(Option::as_ref), started);
            result.map(|permit| {
                permit.map(|permit| self.returning_to_prefetch(permit, ask, rate.is_some()))
            })
        }
        .instrument(self.span(ask, "once"))
        .await
    }

    async fn try_once(&self, ask: &Ask, rate: Option<&Rated>) -> Result<Option<Permit>, Error> {
        let claim = self.member_guard(ask, rate.is_some());
        let sent = Instant::now();
        let attempt = self
            .inner
            .origin
            .store
            .acquire(claim.member(), Mode::Once, None, rate)
            .await?;
        match attempt {
            Attempt::Granted {
                token,
                remaining,
                rate,
            } => Ok(Some(claim.into_permit(token, sent + remaining, rate))),
            Attempt::RateLimited { retry_after } => {
                claim.disarm();
                Err(Error::RateLimited { retry_after })
            }
            Attempt::Full => {
                claim.disarm();
                Ok(None)
            }
            Attempt::TooHeavy { limit } => {
                claim.disarm();
                Err(self.too_heavy(ask, limit))
            }
            // Not asked for; dropping the claim takes the member out of the line again.
            Attempt::Queued { .. } => Ok(None),
        }
    }

    /// A weight above the limit in force for every process (set, or adapted, below the one this
    /// process knows of).
    fn too_heavy(&self, ask: &Ask, limit: u32) -> Error {
        let weight = ask.get_weight();
        let name = &self.inner.settings.name;
        let classes = &self.inner.settings.classes;
        if classes.any() {
            let tenant = match classes.tenant_cap() {
                Some(cap) if ask.get_tenant().is_some() => {
                    format!(" and its tenant's cap of {cap}")
                }
                _ => String::new(),
            };
            return Error::config(format!(
                "cannot take {weight} permits of semaphore {name:?} in class {}: the most that \
                 class may hold beside the others' reservations under the limit in force{tenant} \
                 is {limit} now; take at most {limit}",
                ask.get_priority()
            ));
        }
        Error::config(format!(
            "cannot take {weight} permits of semaphore {name:?}: the limit every process admits by \
             is {limit} now (set with set_limit); take at most {limit}"
        ))
    }

    /// The semaphore now, across every process: the limit in force, the weight held, how many
    /// wait, and each holder with how long it has held and how long its lease has left. One
    /// backend call; for dashboards and the `dlimit` command line, not for the request path.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the backend cannot be reached (the outage policy does not apply
    /// to reads).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn snapshot(&self) -> Result<Snapshot, Error> {
        self.inner.origin.store.snapshot().await
    }

    /// Makes `limit` the limit every process using this name admits by, at once and until it
    /// is set again, whatever each was built with (`.limit(n)`). Raising it admits the waiters
    /// that now fit; lowering it takes nothing from current holders (none is lost), and nobody
    /// new is admitted until the weight held fits under it.
    ///
    /// Without `set_limit`, the first process to use a semaphore stores its configured limit
    /// and the others adopt it (a warning is logged where a process was built with another);
    /// that stored limit goes away when the semaphore falls idle and its keys expire. A set
    /// limit stays until [`unset_limit`](Self::unset_limit). On a semaphore whose limit [adapts](crate::SemaphoreBuilder::adaptive),
    /// `set_limit` pins it: it stays where it was set and stops adapting.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{MemoryBackend, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
    /// let backend = MemoryBackend::new();
    /// let old = Semaphore::builder("db").limit(2).build(backend.clone())?;
    /// let new = Semaphore::builder("db").limit(5).build(backend)?; // a rolling deploy
    /// let _p = old.acquire().await?;
    /// assert_eq!(new.snapshot().await?.limit, 2); // the first one's limit is in force
    /// new.set_limit(5).await?;                     // an operator raises it for everyone
    /// assert_eq!(old.snapshot().await?.limit, 5);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for 0; [`Error::Backend`] when the backend cannot be reached (the limit
    /// may or may not have been set: call again).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may or may not leave the new limit set; setting it again is
    /// harmless.
    pub async fn set_limit(&self, limit: u32) -> Result<(), Error> {
        self.check_limit(limit)?;
        self.inner.origin.store.set_limit(limit).await
    }

    /// Undoes [`set_limit`](Self::set_limit), for every process: the limit in force before
    /// it was set is back (on a semaphore pinned before any process used it, the first
    /// configured limit a process calls with), and an [adaptive](crate::SemaphoreBuilder::adaptive)
    /// limit adapts again from there. A semaphore not pinned is left as it is. On a quorum,
    /// every process admits by its own configured limit again.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{MemoryBackend, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
    /// let sem = Semaphore::builder("db").limit(2).build(MemoryBackend::new())?;
    /// let _p = sem.acquire().await?;
    /// sem.set_limit(8).await?;                  // an incident: pinned for everyone
    /// assert!(sem.snapshot().await?.pinned);
    /// sem.unset_limit().await?;                 // over: back to the configured limit
    /// let snap = sem.snapshot().await?;
    /// assert_eq!((snap.limit, snap.pinned), (2, false));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the backend cannot be reached (the pin may or may not be gone:
    /// call again).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may or may not unpin the limit; unpinning again is harmless.
    pub async fn unset_limit(&self) -> Result<(), Error> {
        self.inner.origin.store.unset_limit().await
    }

    fn check_limit(&self, limit: u32) -> Result<(), Error> {
        if limit == 0 {
            return Err(Error::config(format!(
                "semaphore {:?}: a limit of 0 admits nobody; use at least 1",
                self.inner.settings.name
            )));
        }
        Ok(())
    }

    /// Takes the holder whose [`Permit::id`] is `id` out of the semaphore, across every
    /// process: for an operator facing a holder stuck with a long lease (the `dlimit release`
    /// command). Its slot goes to the next waiter. The evicted process is not told until its
    /// next renewal finds it gone (then its permit is lost); until then it may still act, so a
    /// resource that must not see two holders should check fencing tokens: the next holder's
    /// is higher. `Ok(false)` when no holder has that id.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the backend cannot be reached.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may or may not evict the holder; [`snapshot`](Self::snapshot)
    /// tells.
    pub async fn evict(&self, id: &str) -> Result<bool, Error> {
        self.inner.origin.store.evict(id).await
    }

    /// The backend failed: the outage policy decides. Every decision is counted and logged
    /// ([`OutageLog`]); the in-process fallback semaphore admits the request, or the error
    /// stands.
    fn fallback(&self, error: Error, weight: u32) -> Result<&Semaphore, Error> {
        self.inner.outage_decisions.fetch_add(1, Ordering::Relaxed);
        let fallback = self.inner.fallback.as_ref().filter(|f| weight <= f.limit());
        self.inner.outage_log.decided(&error, fallback.is_some());
        fallback.ok_or(error)
    }

    /// The limit in force minus the weight of live (unexpired) holders, across every process.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the backend cannot be reached.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn available_permits(&self) -> Result<u32, Error> {
        let used = self
            .inner
            .origin
            .store
            .used()
            .await
            .inspect_err(|_| self.inner.settings.telemetry.backend_error(Op::Used))?;
        // By the limit in force (pinned, adaptive, or stored by another process), as the
        // store's last answer said, else this process's own.
        let limit = (self.inner.origin.store.limit_in_force()).unwrap_or(self.inner.settings.limit);
        Ok(limit.saturating_sub(used))
    }

    /// A weight of 0, or above any limit this process knows may be in force (its own, an
    /// adaptive one's bound, the one in force as last heard: a pinned one may be higher), is
    /// refused here; the backend refuses one above the limit in force now.
    fn check_weight(&self, ask: &Ask) -> Result<(), Error> {
        let settings = &self.inner.settings;
        let weight = ask.get_weight();
        let most = (settings.limit)
            .max(settings.adaptive.map_or(0, |adaptive| adaptive.max))
            .max(self.inner.origin.store.limit_in_force().unwrap_or(0));
        if weight == 0 || weight > most {
            return Err(Error::config(format!(
                "cannot take {weight} permits of semaphore {:?}: the weight must be 1 ..= its limit {most}",
                settings.name
            )));
        }
        let tenant = ask.get_tenant().is_some();
        if settings.classes.any()
            && weight > settings.classes.most(ask.get_priority(), tenant, most)
        {
            return Err(
                self.too_heavy(ask, settings.classes.most(ask.get_priority(), tenant, most))
            );
        }
        Ok(())
    }

    /// A fresh member for `ask`, marked as the pool's when its slot may go there.
    fn member_guard(&self, ask: &Ask, rated: bool) -> MemberGuard {
        let prefetched = self.prefetch_for(ask, rated).is_some();
        MemberGuard::new(
            &self.inner.origin,
            ask,
            self.inner.settings.lease,
            prefetched,
        )
    }

    /// Waits for a permit until `deadline`. A grant that reached this process only after its
    /// lease ended (the process was paused while it waited) is given back, and the wait goes
    /// on while time remains.
    async fn wait_for(
        &self,
        ask: &Ask,
        started: Instant,
        deadline: Instant,
        rate: Option<&Rated>,
    ) -> Result<Permit, Error> {
        let timeout = || Error::Timeout {
            waited: started.elapsed(),
        };
        loop {
            let permit = self
                .wait_once(ask, deadline, rate)
                .await?
                .ok_or_else(timeout)?;
            if !permit.is_lost() {
                return Ok(permit);
            }
            tracing::debug!(semaphore = %self.inner.settings.name, token = permit.fencing_token(),
                "a grant arrived after its lease ended; queueing again");
            drop(permit);
            if Instant::now() >= deadline {
                return Err(timeout());
            }
        }
    }

    /// One place in line, `None` when the deadline passed: the first call grants at once or
    /// queues the waiter in the backend's line; the grant is then announced to this process's
    /// waitlist, so waiting costs no further round trip. The first call is bounded by the
    /// backend's call timeout, not by `deadline`: a slow answer is not a full semaphore, and a
    /// failed one is an outage.
    async fn wait_once(
        &self,
        ask: &Ask,
        deadline: Instant,
        rate: Option<&Rated>,
    ) -> Result<Option<Permit>, Error> {
        let store = &self.inner.origin.store;
        let claim = self.member_guard(ask, rate.is_some());
        let registered = self
            .inner
            .waitlist
            .register(claim.member().text.clone(), self.inner.settings.max_waiters);
        let (ticket, _waiting) = match registered {
            Ok(ticket) => (ticket, Waiting::new(&self.inner.settings.telemetry)),
            Err(waiting) => {
                // Nothing was sent: nothing to give back.
                claim.disarm();
                return Err(Error::TooManyWaiters { waiting });
            }
        };
        let mut mode = Mode::Join;
        loop {
            let sent = Instant::now();
            // The rate is decided only with the first call; a repeat found the member queued.
            let rated = rate.filter(|_| mode == Mode::Join);
            let call = store.acquire(claim.member(), mode, Some(deadline), rated);
            let attempt = if mode == Mode::Join {
                call.await?
            } else {
                match tokio::time::timeout_at(deadline, call).await {
                    Ok(attempt) => attempt?,
                    Err(_) => return Ok(None),
                }
            };
            mode = Mode::Recheck;
            let (retry_in, clock) = match attempt {
                Attempt::Granted {
                    token,
                    remaining,
                    rate,
                } => {
                    return Ok(Some(claim.into_permit(token, sent + remaining, rate)));
                }
                Attempt::RateLimited { retry_after } => {
                    claim.disarm();
                    return Err(Error::RateLimited { retry_after });
                }
                Attempt::Queued { retry_in, clock } => (retry_in, clock),
                Attempt::TooHeavy { limit } => return Err(self.too_heavy(ask, limit)),
                Attempt::Full => {
                    return Err(Error::backend(
                        "the backend refused to queue a waiter; this is a bug, please report it",
                        None,
                    ));
                }
            };
            match ticket
                .wait_in_line(&**store, clock, retry_in, deadline)
                .await?
            {
                Wake::Granted { token, until } => {
                    return Ok(Some(claim.into_permit(token, until, None)));
                }
                Wake::Forgotten => {}
                Wake::TimedOut => return Ok(None),
            }
        }
    }
}

// ---- Prefetched slots (`prefetch.rs`): where acquires meet the pool. ----

impl Semaphore {
    /// A prefetched permit for `ask`, counted as an acquisition, if prefetching serves it
    /// (see [`prefetched`](Self::prefetched)); synchronous, so the layer skips its acquire
    /// future for it.
    pub(crate) fn take_prefetched(&self, ask: &Ask, rated: bool) -> Option<Permit> {
        let started = Instant::now();
        let permit = self.prefetched(ask, rated)?;
        self.report(ask, Ok(Some(&permit)), started);
        Some(permit)
    }

    /// A prefetched permit for `ask`, if prefetching serves it: one permit of NORMAL without a
    /// tenant or a rate decided with it, while nobody waits. Tops the pool up in the
    /// background when it runs low.
    fn prefetched(&self, ask: &Ask, rated: bool) -> Option<Permit> {
        let pool = self.prefetch_for(ask, rated)?;
        let permit = pool.hand_out()?;
        pool.refill(self);
        Some(permit)
    }

    /// `permit`, granted for `ask` by the backend (the pool had none), returns to the pool
    /// when done with, if prefetching serves `ask`; the pool is topped up now that this
    /// acquire has its slot (not before: the refill would take the slot it needs).
    fn returning_to_prefetch(&self, permit: Permit, ask: &Ask, rated: bool) -> Permit {
        match self.prefetch_for(ask, rated) {
            Some(pool) if !permit.is_degraded() => {
                pool.refill(self);
                permit.returning_to(Arc::<Prefetch>::downgrade(pool))
            }
            _ => permit,
        }
    }

    fn prefetch_for(&self, ask: &Ask, rated: bool) -> Option<&Arc<Prefetch>> {
        let pool = self.inner.prefetch.as_ref()?;
        (!rated && *ask == Ask::new()).then_some(pool)
    }
}

impl Source for Semaphore {
    async fn take(&self, wanted: usize) -> Vec<Permit> {
        let plain = Ask::new();
        let taken = (0..wanted).map(|_| self.try_once(&plain, None));
        let taken: Vec<Result<Option<Permit>, Error>> = futures_util::future::join_all(taken).await;
        taken
            .into_iter()
            .filter_map(|taken| taken.ok().flatten())
            .collect()
    }
}

/// `timeout` after `now`, or a far future for a timeout too long to add (`Duration::MAX`).
fn deadline_after(now: Instant, timeout: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    now.checked_add(timeout)
        .or_else(|| now.checked_add(CENTURY))
        .unwrap_or(now)
}

/// A waiter counted in `dlimit_waiters` while it lives.
struct Waiting<'a>(&'a Telemetry);

impl<'a> Waiting<'a> {
    fn new(telemetry: &'a Telemetry) -> Self {
        telemetry.waiting(true);
        Waiting(telemetry)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting(false);
    }
}
