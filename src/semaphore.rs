//! The semaphore: validated settings, one-shot and waiting acquisition.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::Error;
use crate::backend::{Attempt, BATCH, Backend, Handle, KEEPALIVE, Member, Mode, Until};
use crate::keeper::{Keeper, Lease};
use crate::outage::OutagePolicy;
use crate::permit::Permit;
use crate::waitlist::Event;

const DEFAULT_LEASE: Duration = Duration::from_secs(30);
const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_MAX_WAITERS: usize = 10_000;
/// The longest lease: leases travel to Redis as 32-bit milliseconds (about 49 days).
const MAX_LEASE: Duration = Duration::from_millis(u32::MAX as u64);

/// A counting semaphore shared by every process that builds one with the same name on the same
/// backend: at most [`limit`](Semaphore::limit) permits are out at once, across all of them.
///
/// Cheap to clone; clones share everything. Permits are [`Permit`] guards: dropping one gives
/// it back. A holder that dies keeps its slot only until its lease runs out.
///
/// # Example
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
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) name: String,
    limit: u32,
    lease: Duration,
    acquire_timeout: Duration,
    max_waiters: usize,
    pub(crate) handle: Arc<dyn Handle>,
    pub(crate) keeper: Arc<Keeper>,
    outage: OutagePolicy,
    /// The in-process semaphore that admits requests while the backend is down (by the outage
    /// policy); `None` when failing closed.
    fallback: Option<Semaphore>,
    outage_decisions: AtomicU64,
    /// This is a fallback: its permits are degraded.
    pub(crate) degraded: bool,
}

impl std::fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Semaphore")
            .field("name", &self.inner.name)
            .field("limit", &self.inner.limit)
            .field("lease", &self.inner.lease)
            .field("acquire_timeout", &self.inner.acquire_timeout)
            .field("outage", &self.inner.outage)
            .finish_non_exhaustive()
    }
}

/// Settings for a [`Semaphore`]; made by [`Semaphore::builder`].
///
/// # Example
///
/// ```
/// use tower_distributed_limit::{Error, MemoryBackend, Semaphore};
///
/// let err = Semaphore::builder("db").build(MemoryBackend::new()).unwrap_err();
/// assert!(matches!(err, Error::Config(_))); // the limit is required
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct SemaphoreBuilder {
    name: String,
    limit: Option<u32>,
    lease: Duration,
    acquire_timeout: Duration,
    max_waiters: usize,
    outage: OutagePolicy,
}

impl SemaphoreBuilder {
    /// How many permits may be out at once, across every process (required, at least 1).
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = Some(limit);
        self
    }

    /// How long a holder that stops answering keeps its slot (default 30 s, at least 1 ms).
    /// A crashed process's permits come back after this long.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long [`Semaphore::acquire`] waits for a permit before
    /// [`Error::Timeout`] (default 10 s, more than zero).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// How many callers of this process may wait for a permit at once (default 10 000); one
    /// more gets [`Error::TooManyWaiters`] at once, so a stalled backend or a burst cannot pile
    /// up tasks without bound.
    pub fn max_waiters(mut self, max: usize) -> Self {
        self.max_waiters = max;
        self
    }

    /// What to do when the backend cannot be reached: refuse (the default), let requests
    /// through, or limit in this process alone. See [`OutagePolicy`].
    pub fn on_outage(mut self, policy: OutagePolicy) -> Self {
        self.outage = policy;
        self
    }

    /// Checks the settings and opens the semaphore on `backend`.
    ///
    /// Fails with [`Error::Config`] for an empty name, a missing or zero limit, a lease under
    /// 1 ms or over 49 days, a zero acquire timeout or `max_waiters`, or a local outage limit
    /// of 0.
    pub fn build(self, backend: impl Backend) -> Result<Semaphore, Error> {
        if self.name.is_empty() {
            return Err(Error::config(
                "the semaphore name is empty; every process sharing the limit must use the same non-empty name",
            ));
        }
        let limit = match self.limit {
            None => {
                return Err(Error::config(format!(
                    "semaphore {:?} has no limit; call .limit(n) with n >= 1",
                    self.name
                )));
            }
            Some(0) => {
                return Err(Error::config(format!(
                    "semaphore {:?} has limit 0, which admits nobody; use a limit of at least 1",
                    self.name
                )));
            }
            Some(limit) => limit,
        };
        if self.lease < Duration::from_millis(1) || self.lease > MAX_LEASE {
            return Err(Error::config(format!(
                "semaphore {:?}: lease {:?} is outside 1 ms ..= 49 days",
                self.name, self.lease
            )));
        }
        if self.max_waiters == 0 {
            return Err(Error::config(format!(
                "semaphore {:?}: max_waiters is 0, which refuses every acquire; use at least 1",
                self.name
            )));
        }
        if self.acquire_timeout.is_zero() {
            return Err(Error::config(format!(
                "semaphore {:?}: acquire_timeout is zero; use try_acquire for a single attempt",
                self.name
            )));
        }
        let fallback = match self.outage.local_limit() {
            None => None,
            Some(0) => {
                return Err(Error::config(format!(
                    "semaphore {:?}: a local outage limit of 0 admits nobody; use \
                     OutagePolicy::FailClosed to refuse during outages",
                    self.name
                )));
            }
            Some(local) => {
                let settings = self.clone().on_outage(OutagePolicy::FailClosed);
                let backend = crate::MemoryBackend::new();
                Some(Semaphore::open(&settings, local, &backend, None, true))
            }
        };
        Ok(Semaphore::open(&self, limit, &backend, fallback, false))
    }
}

impl Semaphore {
    /// Starts the settings of the semaphore called `name`: every process that uses the same
    /// name on the same backend shares one limit.
    pub fn builder(name: impl Into<String>) -> SemaphoreBuilder {
        SemaphoreBuilder {
            name: name.into(),
            limit: None,
            lease: DEFAULT_LEASE,
            acquire_timeout: DEFAULT_ACQUIRE_TIMEOUT,
            max_waiters: DEFAULT_MAX_WAITERS,
            outage: OutagePolicy::FailClosed,
        }
    }

    /// `degraded`: this is the in-process fallback of another semaphore.
    fn open(
        settings: &SemaphoreBuilder,
        limit: u32,
        backend: &dyn Backend,
        fallback: Option<Semaphore>,
        degraded: bool,
    ) -> Semaphore {
        let handle = backend.open(&settings.name, limit);
        Semaphore {
            inner: Arc::new(Inner {
                name: settings.name.clone(),
                limit,
                lease: settings.lease,
                acquire_timeout: settings.acquire_timeout,
                max_waiters: settings.max_waiters,
                keeper: Keeper::new(handle.clone(), settings.lease),
                handle,
                outage: settings.outage,
                fallback,
                outage_decisions: AtomicU64::new(0),
                degraded,
            }),
        }
    }

    /// How many requests the [`OutagePolicy`] decided because the backend failed (refused,
    /// let through, or limited locally) since this semaphore was built: alert on its growth.
    pub fn outage_decisions(&self) -> u64 {
        self.inner.outage_decisions.load(Ordering::Relaxed)
    }

    /// The name shared by every process.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// How many permits may be out at once.
    pub fn limit(&self) -> u32 {
        self.inner.limit
    }

    /// How long a silent holder keeps its slot.
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// Takes one permit, waiting up to the acquire timeout for one to come free.
    ///
    /// Waiters are served first come, first served across every process, and sleep until
    /// their grant is announced; they do not poll. Cancelling the returned future (dropping it,
    /// a timeout around it) never leaks a permit and leaves the line.
    pub async fn acquire(&self) -> Result<Permit, Error> {
        self.acquire_many(1).await
    }

    /// Takes `weight` permits at once, as one holder, waiting like [`acquire`](Self::acquire).
    ///
    /// A weight of 0 or above the limit fails at once with [`Error::Config`]. The acquire
    /// timeout bounds the wait *in line*: with a free slot even a 1 ms timeout succeeds, and
    /// a full semaphore answers [`Error::Timeout`] once it has passed. A backend that fails
    /// or does not answer within its own call timeout gives [`Error::Backend`], or what the
    /// semaphore's [`OutagePolicy`] says.
    pub async fn acquire_many(&self, weight: u32) -> Result<Permit, Error> {
        self.check_weight(weight)?;
        let deadline = deadline_after(self.inner.acquire_timeout);
        match self.wait_for(weight, deadline).await {
            Err(e @ Error::Backend(_)) => self.outage(e, weight, Some(deadline)).await,
            other => other,
        }
    }

    /// One attempt at one permit: `Ok(None)` when the semaphore is full.
    pub async fn try_acquire(&self) -> Result<Option<Permit>, Error> {
        self.try_acquire_many(1).await
    }

    /// One attempt at `weight` permits: `Ok(None)` when they do not fit now, or when others
    /// are already waiting for them (a one-shot attempt does not jump the line).
    ///
    /// A weight of 0 or above the limit fails with [`Error::Config`]; a failing backend with
    /// [`Error::Backend`], or what the semaphore's [`OutagePolicy`] says.
    pub async fn try_acquire_many(&self, weight: u32) -> Result<Option<Permit>, Error> {
        self.check_weight(weight)?;
        match self.try_once(weight).await {
            Err(e @ Error::Backend(_)) => match self.outage(e, weight, None).await {
                Ok(permit) => Ok(Some(permit)),
                Err(Error::Timeout { .. }) => Ok(None),
                Err(e) => Err(e),
            },
            other => other,
        }
    }

    async fn try_once(&self, weight: u32) -> Result<Option<Permit>, Error> {
        let mut pending = Pending::new(&self.inner.handle, weight, self.inner.lease);
        let sent = Instant::now();
        let attempt = self
            .inner
            .handle
            .acquire(&pending.member, Mode::Once, None)
            .await?;
        match attempt {
            Attempt::Granted { token, remaining } => {
                Ok(Some(self.permit(pending, token, sent + remaining)))
            }
            Attempt::Full => {
                pending.armed = false;
                Ok(None)
            }
            // Not asked for; the pending guard takes the member out of the line again.
            Attempt::Queued { .. } => Ok(None),
        }
    }

    /// Decides a request the backend could not: by the outage policy, with the in-process
    /// fallback semaphore (waiting up to `deadline`, or a single attempt).
    async fn outage(
        &self,
        error: Error,
        weight: u32,
        deadline: Option<Instant>,
    ) -> Result<Permit, Error> {
        self.inner.outage_decisions.fetch_add(1, Ordering::Relaxed);
        let Some(fallback) = self.inner.fallback.as_ref().filter(|f| weight <= f.limit()) else {
            tracing::warn!(target: "tower_distributed_limit::outage", semaphore = %self.inner.name,
                policy = ?self.inner.outage, error = %error, "backend failed: request refused");
            return Err(error);
        };
        tracing::warn!(target: "tower_distributed_limit::outage", semaphore = %self.inner.name,
            policy = ?self.inner.outage, error = %error,
            "backend failed: request admitted by the outage policy");
        match deadline {
            Some(deadline) => fallback.wait_for(weight, deadline).await,
            None => fallback.try_once(weight).await?.ok_or(Error::Timeout {
                waited: Duration::ZERO,
            }),
        }
    }

    /// The limit minus the weight of live (unexpired) holders, across every process.
    pub async fn available_permits(&self) -> Result<u32, Error> {
        let used = self.inner.handle.used().await?;
        Ok(self.inner.limit.saturating_sub(used))
    }

    fn check_weight(&self, weight: u32) -> Result<(), Error> {
        if weight == 0 || weight > self.inner.limit {
            return Err(Error::config(format!(
                "cannot take {weight} permits of semaphore {:?}: the weight must be 1 ..= its limit {}",
                self.inner.name, self.inner.limit
            )));
        }
        Ok(())
    }

    /// Waits for a permit until `deadline`. A grant that reached this process only after its
    /// lease ended (the process was paused while it waited) is given back, and the wait goes
    /// on while time remains.
    async fn wait_for(&self, weight: u32, deadline: Instant) -> Result<Permit, Error> {
        let started = Instant::now();
        loop {
            let permit = self.wait_once(weight, deadline, started).await?;
            if !permit.is_lost() {
                return Ok(permit);
            }
            tracing::debug!(semaphore = %self.inner.name, token = permit.fencing_token(),
                "a grant arrived after its lease ended; queueing again");
            drop(permit);
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    waited: started.elapsed(),
                });
            }
        }
    }

    /// One place in line: the first call grants at once or queues the waiter in the backend's
    /// line; the grant is then announced to this process's waitlist, so waiting costs no
    /// further round trip. The first call is bounded by the backend's call timeout, not by
    /// `deadline`: a slow answer is not a full semaphore, and a failed one is an outage.
    async fn wait_once(
        &self,
        weight: u32,
        deadline: Instant,
        started: Instant,
    ) -> Result<Permit, Error> {
        let timeout = || Error::Timeout {
            waited: started.elapsed(),
        };
        let handle = &self.inner.handle;
        let mut pending = Pending::new(handle, weight, self.inner.lease);
        let registered = handle
            .waitlist()
            .register(pending.member.text.clone(), self.inner.max_waiters);
        let ticket = match registered {
            Ok(ticket) => ticket,
            Err(waiting) => {
                // Nothing was sent: nothing to take back.
                pending.armed = false;
                return Err(Error::TooManyWaiters { waiting });
            }
        };
        let mut mode = Mode::Join;
        loop {
            let sent = Instant::now();
            let call = handle.acquire(&pending.member, mode, Some(deadline));
            let attempt = if mode == Mode::Join {
                call.await?
            } else {
                tokio::time::timeout_at(deadline, call)
                    .await
                    .map_err(|_| timeout())??
            };
            mode = Mode::Recheck;
            let (mut refresh, clock) = match attempt {
                Attempt::Granted { token, remaining } => {
                    return Ok(self.permit(pending, token, sent + remaining));
                }
                Attempt::Queued { retry_in, clock } => (retry_in, clock),
                Attempt::Full => {
                    return Err(Error::backend(
                        "the backend refused to queue a waiter; this is a bug, please report it",
                        None,
                    ));
                }
            };
            ticket.queued();
            loop {
                let event = tokio::time::timeout_at(deadline, ticket.wait(refresh.min(KEEPALIVE)));
                match event.await.map_err(|_| timeout())? {
                    Event::Granted { token, until } => {
                        let until = match until {
                            Until::Server(us) => clock.local_time_of(us),
                            Until::Local(until) => until,
                        };
                        return Ok(self.permit(pending, token, until));
                    }
                    // The backend dropped this waiter from its line: ask again.
                    Event::Retry => break,
                    Event::Touch => {
                        let list = handle.waitlist();
                        let members = list.queued_members();
                        // Batches keep each script call short, however long the line.
                        for batch in members.chunks(BATCH) {
                            let sent = Instant::now();
                            let touch =
                                tokio::time::timeout_at(deadline, handle.touch(batch, deadline));
                            let (statuses, retry_in) = touch.await.map_err(|_| timeout())??;
                            list.apply(batch, &statuses, sent);
                            refresh = retry_in;
                        }
                    }
                }
            }
        }
    }

    fn permit(&self, mut pending: Pending<'_>, token: u64, deadline: Instant) -> Permit {
        // A lease that already ended is lost at once: the keeper does not take it.
        pending.armed = false;
        let lease = Lease::new(deadline);
        if !lease.is_lost() {
            self.inner.keeper.keep(pending.member.text.clone(), &lease);
        }
        Permit::new(self.inner.clone(), pending.member.clone(), token, lease)
    }
}

/// `timeout` from now, or a far future for a timeout too long to add (`Duration::MAX`).
fn deadline_after(timeout: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(CENTURY))
        .unwrap_or(now)
}

/// An acquisition under way: until it turns into a [`Permit`], dropping it (an error, a
/// timeout, a cancelled future) takes the member out of the backend in the background, in
/// case the backend holds or queues it.
struct Pending<'a> {
    handle: &'a Arc<dyn Handle>,
    member: Member,
    armed: bool,
}

impl<'a> Pending<'a> {
    fn new(handle: &'a Arc<dyn Handle>, weight: u32, lease: Duration) -> Self {
        Pending {
            handle,
            member: Member::new(weight, lease),
            armed: true,
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.handle.release_later(self.member.clone());
        }
    }
}
