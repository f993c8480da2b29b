//! The rate limiter: validated settings, one GCRA check per call, the outage fallback.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::backend::{EXACT, Gcra, RateBackend, RateDecision, RateKey, RateStore};
use crate::outage::{OutageLog, OutagePolicy};
use crate::telemetry::RateTelemetry;
use crate::{Error, MemoryBackend};

/// The longest partition key a check accepts, in bytes.
const MAX_KEY_LEN: usize = 256;

/// A rate limit shared by every process that builds one with the same name on the same
/// backend: `rate` per `period` sustained, at most `burst` at once after a quiet spell, across
/// all of them.
///
/// Each check is one GCRA (generic cell rate algorithm) step in one script call, timed by the
/// Redis server's clock; the state is one key per limiter (and per partition key), which
/// expires when the limiter would be full again. Cheap to clone; clones share everything.
///
/// Stack it with a [`Semaphore`](crate::Semaphore): the rate limit caps how many requests
/// *start* per second, the semaphore how many *run at once*.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_distributed_limit::{MemoryBackend, RateLimiter};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
/// // In production: RedisBackend::connect("redis://...").await?, shared by every instance.
/// let rate = RateLimiter::builder("api")
///     .rate(100, Duration::from_secs(1))  // 100 per second across every process
///     .burst(20)                          // at most 20 at once after a quiet spell
///     .build(MemoryBackend::new())?;
/// let d = rate.check().await?;
/// assert!(d.allowed);
/// assert_eq!(d.remaining, 19);
/// let d = rate.check_n(25).await;          // more than the burst can ever allow
/// assert!(d.is_err());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RateLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    rate: u32,
    period: Duration,
    burst: u32,
    outage: OutagePolicy,
    store: Arc<dyn RateStore>,
    /// The in-process limiter that decides while the backend is down (`Local`).
    fallback: Option<RateLimiter>,
    outage_decisions: AtomicU64,
    outage_log: OutageLog,
    telemetry: RateTelemetry,
}

/// What a rate limiter decided for one request, kept with the limiter for the `RateLimit`
/// headers of its answer.
#[derive(Debug, Clone)]
pub(crate) struct Decided {
    pub(crate) limiter: RateLimiter,
    pub(crate) decision: RateDecision,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let core = &self.inner;
        f.debug_struct("RateLimiter")
            .field("name", &core.name)
            .field("rate", &core.rate)
            .field("period", &core.period)
            .field("burst", &core.burst)
            .field("outage", &core.outage)
            .finish_non_exhaustive()
    }
}

/// Settings for a [`RateLimiter`]; made by [`RateLimiter::builder`].
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_distributed_limit::{Error, MemoryBackend, RateLimiter};
///
/// let err = RateLimiter::builder("api").rate(0, Duration::from_secs(1)).build(MemoryBackend::new());
/// assert!(matches!(err, Err(Error::Config(_))));
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct RateLimiterBuilder {
    name: String,
    rate: Option<(u32, Duration)>,
    burst: Option<u32>,
    outage: OutagePolicy,
}

impl RateLimiterBuilder {
    /// `n` requests (units of cost) per `period`, sustained, across every process (required;
    /// `n` at least 1, `period` at least 1 µs).
    pub fn rate(mut self, n: u32, period: Duration) -> Self {
        self.rate = Some((n, period));
        self
    }

    /// How many may pass at once after a quiet spell (default: the rate's `n`, i.e. a full
    /// period's worth). At least 1; a cost above it is never allowed.
    pub fn burst(mut self, burst: u32) -> Self {
        self.burst = Some(burst);
        self
    }

    /// What to do when the backend cannot be reached, as for a semaphore: refuse with
    /// [`Error::Backend`] (the default), allow everything (a [`RateDecision`] that is
    /// `degraded`), or `Local { limit }`: this process alone allows `limit` per period (at
    /// most `min(burst, limit)` at once), e.g. the rate divided by the number of instances.
    pub fn on_outage(mut self, policy: OutagePolicy) -> Self {
        self.outage = policy;
        self
    }

    /// Checks the settings and opens the limiter on `backend`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an empty name or one over [`MAX_NAME_LEN`](crate::MAX_NAME_LEN)
    /// bytes, a missing or zero rate, a zero period, a burst of 0, a period × burst too large
    /// to compute exactly (over about 140 years of microseconds), or a local outage limit of
    /// 0. A [`QuorumBackend`](crate::QuorumBackend) is no `RateBackend`: building a limiter
    /// on one does not compile.
    pub fn build(self, backend: impl RateBackend) -> Result<RateLimiter, Error> {
        let name = &self.name;
        if name.is_empty() {
            return Err(Error::config(
                "the rate limiter's name is empty; every process sharing the rate must use the same non-empty name",
            ));
        }
        crate::name::check_name_len("rate limiter", name)?;
        let Some((rate, period)) = self.rate else {
            return Err(Error::config(format!(
                "rate limiter {name:?} has no rate; call .rate(n, period), e.g. .rate(100, Duration::from_secs(1))"
            )));
        };
        if rate == 0 {
            return Err(Error::config(format!(
                "rate limiter {name:?} has a rate of 0 per {period:?}, which admits nobody; use at least 1"
            )));
        }
        let period_us = u64::try_from(period.as_micros()).unwrap_or(u64::MAX);
        if period_us == 0 {
            return Err(Error::config(format!(
                "rate limiter {name:?} has a zero period ({period:?}); use a period of at least 1 µs, e.g. Duration::from_secs(1)"
            )));
        }
        let burst = self.burst.unwrap_or(rate);
        if burst == 0 {
            return Err(Error::config(format!(
                "rate limiter {name:?} has a burst of 0, which admits nobody; use at least 1 (the default is the rate's n)"
            )));
        }
        // The script's largest number is about 2·burst·period_µs + rate: keep it exact.
        let largest = u128::from(burst) * u128::from(period_us) * 2 + u128::from(rate);
        if largest >= u128::from(EXACT) {
            return Err(Error::config(format!(
                "rate limiter {name:?}: a burst of {burst} over a period of {period:?} is too large \
                 to compute exactly; lower the burst or the period"
            )));
        }
        let fallback = match self.outage {
            OutagePolicy::Local { limit: 0 } => {
                return Err(Error::config(format!(
                    "rate limiter {name:?}: a local outage limit of 0 admits nobody; use \
                     OutagePolicy::FailClosed to refuse during outages"
                )));
            }
            OutagePolicy::Local { limit } => Some(
                RateLimiter::builder(name.clone())
                    .rate(limit, period)
                    .burst(burst.min(limit))
                    .build(MemoryBackend::new())?,
            ),
            _ => None,
        };
        let gcra = Gcra {
            rate: u64::from(rate),
            period_us,
            burst: u64::from(burst),
        };
        let store = backend.open_rate(name, gcra)?.store;
        let telemetry = RateTelemetry::new(name);
        Ok(RateLimiter {
            inner: Arc::new(Inner {
                outage_log: OutageLog::new("rate limiter", &self.name, self.outage),
                name: self.name,
                rate,
                period,
                burst,
                outage: self.outage,
                store,
                fallback,
                outage_decisions: AtomicU64::new(0),
                telemetry,
            }),
        })
    }
}

impl RateLimiter {
    /// The limiter as a semaphore's backend may decide it with an acquire, in one call.
    pub(crate) fn combinable(&self) -> Option<RateKey> {
        self.inner.store.combinable()
    }

    /// Starts the settings of the limiter called `name`: every process that uses the same
    /// name on the same backend shares one rate.
    pub fn builder(name: impl Into<String>) -> RateLimiterBuilder {
        RateLimiterBuilder {
            name: name.into(),
            rate: None,
            burst: None,
            outage: OutagePolicy::FailClosed,
        }
    }

    /// The name shared by every process.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// How many per [`period`](Self::period).
    pub fn rate(&self) -> u32 {
        self.inner.rate
    }

    /// The period of the rate.
    pub fn period(&self) -> Duration {
        self.inner.period
    }

    /// How many may pass at once after a quiet spell.
    pub fn burst(&self) -> u32 {
        self.inner.burst
    }

    /// How many checks the [`OutagePolicy`] decided because the backend failed.
    pub fn outage_decisions(&self) -> u64 {
        self.inner.outage_decisions.load(Ordering::Relaxed)
    }

    /// One request of cost 1: allowed (and spent) or refused with the time to wait.
    ///
    /// # Errors
    ///
    /// As [`check_n`](Self::check_n).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves may or may not have spent the cost (the check
    /// may have reached the backend); nothing else is held.
    pub async fn check(&self) -> Result<RateDecision, Error> {
        self.check_n(1).await
    }

    /// One request of cost `n`, all or nothing: a refused request spends nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a cost of 0 or above the burst (it could never pass);
    /// [`Error::Backend`] when the backend failed and the limiter's [`OutagePolicy`] refuses. A
    /// refused request is `Ok` with `allowed: false`, not an error.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves may or may not have spent the cost (the check
    /// may have reached the backend); nothing else is held.
    pub async fn check_n(&self, n: u32) -> Result<RateDecision, Error> {
        self.decide(None, n).await
    }

    /// Like [`check_n`](Self::check_n), against the partition `key` (an API key, a tenant): each
    /// key gets the limiter's rate and burst of its own, in its own backend key (in Redis,
    /// `{name:key}`, which expires when full again; in memory, swept likewise). Nothing is kept
    /// per key in this process.
    ///
    /// # Errors
    ///
    /// [`Error::BadKey`] for an empty key or one over 256 bytes; otherwise as
    /// [`check_n`](Self::check_n).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves may or may not have spent the cost (the check
    /// may have reached the backend); nothing else is held.
    pub async fn check_key(&self, key: &str, n: u32) -> Result<RateDecision, Error> {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(Error::BadKey(format!(
                "a partition key of {} bytes for rate limiter {:?}; keys must be 1 ..= {MAX_KEY_LEN} bytes",
                key.len(),
                self.inner.name
            )));
        }
        self.decide(Some(key), n).await
    }

    async fn decide(&self, key: Option<&str>, n: u32) -> Result<RateDecision, Error> {
        let core = &self.inner;
        if n == 0 || n > core.burst {
            return Err(Error::config(format!(
                "a cost of {n} for rate limiter {:?}: the cost must be 1 ..= its burst {} (a \
                 larger one could never pass)",
                core.name, core.burst
            )));
        }
        let decision = match core.store.check(key, n).await {
            Err(error @ Error::Backend(_)) => self.on_outage(error, key, n).await,
            other => {
                if other.is_ok() {
                    core.outage_log.answered();
                }
                other
            }
        };
        match &decision {
            Ok(decision) => core.telemetry.decided(decision, key.is_some()),
            Err(Error::Backend(_) | Error::AccessDenied(_)) => core.telemetry.backend_error(),
            Err(_) => {}
        }
        decision
    }

    /// Reports a decision a semaphore's backend took with an acquire, in the same call.
    pub(crate) fn decided_with_acquire(&self, decision: &RateDecision) {
        self.inner.telemetry.decided(decision, false);
    }

    async fn on_outage(
        &self,
        error: Error,
        key: Option<&str>,
        n: u32,
    ) -> Result<RateDecision, Error> {
        let core = &self.inner;
        core.outage_decisions.fetch_add(1, Ordering::Relaxed);
        let admitted = match (&core.outage, &core.fallback) {
            (OutagePolicy::FailOpen, _) => true,
            (OutagePolicy::Local { .. }, Some(local)) => n <= local.burst(),
            _ => false,
        };
        core.outage_log.decided(&error, admitted);
        let decision = match (&core.outage, &core.fallback) {
            (OutagePolicy::FailOpen, _) => RateDecision {
                allowed: true,
                remaining: core.burst,
                retry_after: None,
                reset_after: Duration::ZERO,
                degraded: true,
            },
            (OutagePolicy::Local { .. }, Some(local)) if n <= local.burst() => {
                let decision = local.inner.store.check(key, n).await?;
                RateDecision {
                    degraded: true,
                    ..decision
                }
            }
            (OutagePolicy::Local { .. }, Some(_)) => {
                // Heavier than the local burst: never allowed locally.
                return Err(error);
            }
            _ => return Err(error),
        };
        Ok(decision)
    }
}
