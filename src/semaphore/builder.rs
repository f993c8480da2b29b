//! A semaphore's settings: the builder, its defaults and checks.

use std::time::Duration;

use crate::backend::Backend;
use crate::class::Classes;
use crate::name::check_name_len;
use crate::outage::OutagePolicy;
use crate::telemetry::Telemetry;
use crate::{AdaptiveLimit, Error, Priority, Share};

const DEFAULT_LEASE: Duration = Duration::from_secs(30);

const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_MAX_WAITERS: usize = 10_000;
const DEFAULT_CLAIM_WINDOW: Duration = Duration::from_millis(250);
/// The longest lease: leases travel to Redis as 32-bit milliseconds (about 49 days).
const MAX_LEASE: Duration = Duration::from_millis(u32::MAX as u64);

/// A semaphore's settings, checked by [`SemaphoreBuilder::build`].
pub(super) struct Settings {
    pub(super) name: String,
    pub(super) telemetry: Telemetry,
    pub(super) limit: u32,
    /// The bounds an adaptive limit moves in (`limit` is then its initial value).
    pub(super) adaptive: Option<AdaptiveLimit>,
    pub(super) lease: Duration,
    pub(super) acquire_timeout: Duration,
    pub(super) max_waiters: usize,
    pub(super) outage: OutagePolicy,
    pub(super) claim: Duration,
    /// What each class reserves and may hold.
    pub(super) classes: Classes,
    /// How many free slots this process may take ahead of need (0: none).
    pub(super) prefetch: u32,
}

/// What [`SemaphoreBuilder::settings`] found valid: the semaphore's settings, and its
/// in-process fallback's when the outage policy limits locally.
pub(super) struct Checked {
    pub(super) settings: Settings,
    pub(super) fallback: Option<Settings>,
}

/// Settings for a [`Semaphore`](crate::Semaphore); made by
/// [`Semaphore::builder`](crate::Semaphore::builder).
///
/// # Examples
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
    adaptive: Option<AdaptiveLimit>,
    lease: Duration,
    acquire_timeout: Duration,
    max_waiters: usize,
    outage: OutagePolicy,
    claim: Duration,
    /// The `semaphore` label of its metrics, when it is not the name (a partition set's name).
    label: Option<String>,
    classes: Classes,
    prefetch: u32,
}

impl SemaphoreBuilder {
    /// How many permits may be out at once, across every process (required, at least 1).
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = Some(limit);
        self
    }

    /// A limit found from latency instead of a fixed one: it starts at `adaptive`'s initial
    /// limit and moves within its bounds as permits are released, for every process at once
    /// (see [`AdaptiveLimit`]). Use it instead of [`limit`](Self::limit).
    ///
    /// The first process to open the semaphore (while nobody holds or waits) decides whether
    /// it adapts, as it decides the limit: a process built with a fixed limit admits by the
    /// adaptive limit in force (and logs a warning that its own differs), and its releases
    /// are samples too. [`Semaphore::set_limit`](crate::Semaphore::set_limit) pins the limit: it stops adapting until the
    /// semaphore falls idle and is opened again.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{AdaptiveLimit, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("search")
    ///     .adaptive(AdaptiveLimit::new().initial(16).min(4).max(256))
    ///     .build(MemoryBackend::new())?;
    /// # let _ = sem; Ok::<(), tower_distributed_limit::Error>(())
    /// ```
    pub fn adaptive(mut self, adaptive: AdaptiveLimit) -> Self {
        self.adaptive = Some(adaptive);
        self
    }

    /// How long a holder that stops answering keeps its slot (default 30 s, at least 1 ms).
    /// A crashed process's permits come back after this long.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long [`Semaphore::acquire`](crate::Semaphore::acquire) waits for a permit before
    /// [`Error::Timeout`] (default 10 s, more than zero).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// How long a permit granted to a waiter from the line stays provisional (default 250 ms,
    /// at least 1 ms; never more than half the lease): its process claims it with its next
    /// call (a renewal, a touch) for the full lease. A process frozen or killed while it waits
    /// strands a slot for this long, after which the slot goes to the next in line and the
    /// silent process's other waiters are passed over until it is heard from again. Raise it
    /// when processes may be slower than this to answer (a heavily loaded host).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_distributed_limit::{MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("exports")
    ///     .limit(4)
    ///     .claim_window(Duration::from_millis(500))
    ///     .build(MemoryBackend::new())?;
    /// # let _ = sem; Ok::<(), tower_distributed_limit::Error>(())
    /// ```
    pub fn claim_window(mut self, window: Duration) -> Self {
        self.claim = window;
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

    /// Gives the class `priority` a share of the limit: [`Share::reserved`] slots no other
    /// class may take, or [`Share::at_most`] what it may hold at once (call twice for both).
    /// Classes without a share take from the pool the reservations leave. Every process of
    /// the semaphore admits by the shares of the first one that used it (as with the limit).
    ///
    /// The line serves a higher class first with or without shares; while a higher class waits
    /// for the pool, a lower one is admitted only inside its own reservation.
    ///
    /// With a limit in force below the reservations together (an operator's
    /// [`set_limit`](crate::Semaphore::set_limit), an adaptive limit that fell), the reservations are
    /// kept first: the total never passes the limit, and only reserved classes are admitted,
    /// each up to its reservation, until the limit is back above their sum; the others' acquires
    /// are refused at once with an [`Error::Config`] naming their class, not left to wait.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{Ask, MemoryBackend, Priority, Semaphore, Share};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
    /// let sem = Semaphore::builder("gpu")
    ///     .limit(3)
    ///     .class(Priority::CRITICAL, Share::reserved(1))
    ///     .build(MemoryBackend::new())?;
    /// let _two = sem.acquire_many(2).await?;
    /// assert!(sem.try_acquire().await?.is_none()); // the last slot is CRITICAL's
    /// let critical = Ask::new().priority(Priority::CRITICAL);
    /// assert!(sem.try_acquire_with(critical).await?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn class(mut self, priority: Priority, share: Share) -> Self {
        self.classes.set(priority, share);
        self
    }

    /// Each tenant ([`Ask::tenant`](crate::Ask::tenant)) holds at most `share` at once, in
    /// every class together: the global-plus-per-tenant limit in one atomic call, so a request
    /// never holds its tenant's slot while it waits for the global one. A tenant at its cap
    /// holds up no other tenant. Only [`Share::at_most`] applies (tenants are request data,
    /// without bound: none can reserve); requests without a tenant are not capped.
    ///
    /// Whether or not a cap is set, the line serves the tenants of one class in turn: a
    /// tenant's next request waits behind every other tenant's next one, so one tenant's flood
    /// never fills the line.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{Ask, MemoryBackend, Semaphore, Share};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
    /// let sem = Semaphore::builder("api")
    ///     .limit(100)
    ///     .per_tenant(Share::at_most(2))
    ///     .build(MemoryBackend::new())?;
    /// let acme = || Ask::new().tenant("acme");
    /// let _two = (sem.acquire_with(acme()).await?, sem.acquire_with(acme()).await?);
    /// assert!(sem.try_acquire_with(acme()).await?.is_none()); // acme holds its 2
    /// assert!(sem.try_acquire_with(Ask::new().tenant("globex")).await?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn per_tenant(mut self, share: Share) -> Self {
        self.classes.set_tenant(share);
        self
    }

    /// Lets this process take up to `n` free slots ahead of need while nobody waits, and hand
    /// them out to plain acquires (one permit of [`Priority::NORMAL`], no tenant, no rate
    /// limit decided with it) without a round trip. 0, the default, prefetches nothing.
    ///
    /// Each prefetched slot is an ordinary holder in the backend: leased, renewed and fenced
    /// like any other, visible in [`snapshot`](crate::Semaphore::snapshot), so the limit stays exact
    /// across the fleet. Every reply to this process says whether anyone waits; once one says
    /// so, the unused slots go back with the next call (at once, in the background), and none
    /// is taken again until a reply says nobody waits. The price: a free slot may sit unused
    /// in this process until its next call tells it of a waiter in another process; hand-outs
    /// and returns need no call, so a process holding prefetched slots renews them every
    /// 50 ms, whose reply says (20 calls a second, whatever its load).
    ///
    /// A dropped permit goes back to the pool (its slot stays held) unless someone waits or
    /// the pool is full. A handed-out permit's [`id`](crate::Permit::id) and fencing token are
    /// its slot's, issued when the slot was prefetched: unique among slots and above every
    /// token issued before, but a permit handed out later may carry a lower token, and one
    /// slot handed out twice carries the same token twice. Where a resource fences writes by
    /// token, do not prefetch. Its lease is the slot's (renewed while it waited); its hold time
    /// counts from the hand-out. With an [`adaptive`](Self::adaptive) limit, `n` may be at
    /// most its minimum; each hand-out's hold time (and [`mark_overloaded`](crate::Permit::mark_overloaded))
    /// is a sample as a release's is, sent with the next 50 ms check, and a slot given back
    /// idle is none. A [`QuorumBackend`](crate::QuorumBackend) does not tell of waiters:
    /// nothing is prefetched there.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{MemoryBackend, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
    /// let sem = Semaphore::builder("hot").limit(64).prefetch(8).build(MemoryBackend::new())?;
    /// drop(sem.acquire().await?); // the first acquire goes to the backend and fills the pool
    /// let _local = sem.acquire().await?; // later ones, while nobody waits, need no call
    /// # Ok(()) }
    /// ```
    pub fn prefetch(mut self, n: u32) -> Self {
        self.prefetch = n;
        self
    }

    /// The checked settings of [`build`](Self::build) for `backend`, and those of its
    /// in-process fallback when the outage policy limits locally; the errors are `build`'s.
    pub(super) fn settings(self, backend: &impl Backend) -> Result<Checked, Error> {
        if self.name.is_empty() {
            return Err(Error::config(
                "the semaphore name is empty; every process sharing the limit must use the same non-empty name",
            ));
        }
        check_name_len("semaphore", &self.name)?;
        let limit = match (self.limit, self.adaptive) {
            (Some(_), Some(_)) => {
                return Err(Error::config(format!(
                    "semaphore {:?} has both a limit and an adaptive limit; keep one (an \
                     adaptive limit starts at its initial limit)",
                    self.name
                )));
            }
            (None, Some(adaptive)) => {
                adaptive.check(&self.name)?;
                if let Some(why) = backend.cannot_adapt() {
                    return Err(Error::config(format!(
                        "semaphore {:?}: an adaptive limit {why}",
                        self.name
                    )));
                }
                adaptive.initial
            }
            (limit, None) => match limit {
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
            },
        };
        if self.classes.any() {
            // An adaptive limit may fall to its minimum: the shares must fit there too.
            let floor = self.adaptive.map_or(limit, |adaptive| adaptive.min);
            self.classes.check(&self.name, floor)?;
            if let Some(why) = backend.cannot_share() {
                return Err(Error::config(format!(
                    "semaphore {:?}: classes or tenants with shares {why}",
                    self.name
                )));
            }
        }
        if let Some(adaptive) = self.adaptive
            && self.prefetch > adaptive.min
        {
            return Err(Error::config(format!(
                "semaphore {:?}: prefetch {} is above its adaptive limit's minimum {}; prefetch \
                 at most the minimum, so a pool never holds more than the limit may fall to",
                self.name, self.prefetch, adaptive.min
            )));
        }
        if self.prefetch > limit {
            return Err(Error::config(format!(
                "semaphore {:?}: prefetch {} is above its limit {limit}; prefetch at most the \
                 limit (a few slots per process is the point)",
                self.name, self.prefetch
            )));
        }
        if self.lease < Duration::from_millis(1) || self.lease > MAX_LEASE {
            return Err(Error::config(format!(
                "semaphore {:?}: lease {:?} is outside 1 ms ..= 49 days",
                self.name, self.lease
            )));
        }
        if self.claim < Duration::from_millis(1) {
            return Err(Error::config(format!(
                "semaphore {:?}: claim_window {:?} is under 1 ms; no process could claim a \
                 permit from the line in time",
                self.name, self.claim
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
                let settings = Settings {
                    name: self.name.clone(),
                    telemetry: Telemetry::new(self.label.as_deref().unwrap_or(&self.name)),
                    limit: local,
                    adaptive: None,
                    lease: self.lease,
                    acquire_timeout: self.acquire_timeout,
                    max_waiters: self.max_waiters,
                    outage: OutagePolicy::FailClosed,
                    claim: self.claim,
                    classes: Classes::default(),
                    prefetch: 0,
                };
                Some(settings)
            }
        };
        let settings = Settings {
            telemetry: Telemetry::new(self.label.as_deref().unwrap_or(&self.name)),
            name: self.name,
            limit,
            adaptive: self.adaptive,
            lease: self.lease,
            acquire_timeout: self.acquire_timeout,
            max_waiters: self.max_waiters,
            outage: self.outage,
            claim: self.claim,
            classes: self.classes,
            prefetch: self.prefetch,
        };
        Ok(Checked { settings, fallback })
    }

    /// The same settings for another name (per-key semaphores of [`Partitions`]).
    ///
    /// [`Partitions`]: crate::Partitions
    pub(crate) fn named(mut self, name: String) -> Self {
        self.name = name;
        self
    }

    /// Reports metrics under `label` instead of the name, so per-key semaphores do not make a
    /// series each.
    pub(crate) fn metrics_label(mut self, label: String) -> Self {
        self.label = Some(label);
        self
    }

    /// The name these settings are for.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The limit set with [`limit`](Self::limit), if any.
    pub(crate) fn configured_limit(&self) -> Option<u32> {
        self.limit
    }
}

impl SemaphoreBuilder {
    /// The defaults, for the semaphore called `name` ([`Semaphore::builder`](crate::Semaphore::builder)).
    pub(super) fn new(name: impl Into<String>) -> SemaphoreBuilder {
        SemaphoreBuilder {
            name: name.into(),
            limit: None,
            adaptive: None,
            lease: DEFAULT_LEASE,
            acquire_timeout: DEFAULT_ACQUIRE_TIMEOUT,
            max_waiters: DEFAULT_MAX_WAITERS,
            outage: OutagePolicy::FailClosed,
            claim: DEFAULT_CLAIM_WINDOW,
            label: None,
            classes: Classes::default(),
            prefetch: 0,
        }
    }
}
