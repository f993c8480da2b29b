//! What the concurrency layer's services share (the admission and how a request waits), and
//! the future that takes a request's permit.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tower::BoxError;

use super::admit::Admit;
use super::spares::{Held, Spares};
use crate::backend::RateDecision;
use crate::{Ask, Error, Permit, Priority, RateLimiter, Semaphore};

/// What every flavour shares: the admission (which semaphore, what weight) and how a request
/// waits for its permits.
#[derive(Debug, Clone)]
pub(crate) struct Limiter<A> {
    pub(crate) admit: A,
    /// Wait up to the semaphore's acquire timeout (true) or make a single attempt.
    pub(crate) wait: bool,
    /// Abort the inner call when the permit's lease is lost before the response.
    pub(crate) abort_on_lost: bool,
    /// The semaphore whose permit is reserved in `poll_ready`, if the layer does so.
    pub(crate) reserve: Option<Semaphore>,
    /// With `reserve`: the permits held ahead for every service the layer makes.
    pub(crate) spares: Spares,
    /// A rate limit decided with each permit, all or nothing (`rate_limit`).
    pub(crate) rate: Option<RateLimiter>,
    /// Requests of this class or higher skip `rate` (`rate_limit_exempt`).
    pub(crate) rate_exempt: Option<Priority>,
    /// The generic flavour's congestion signals: which inner errors mark a permit overloaded.
    pub(crate) overloaded: Overloaded,
}

/// Which inner errors are congestion signals.
pub(crate) type Overloaded = fn(&BoxError) -> bool;

/// The generic flavour's default: every inner error is a congestion signal.
pub(crate) const ANY_ERROR: Overloaded = |_| true;

/// For a pass that has nothing to signal (a rate decision is spent either way).
pub(crate) const NO_SIGNAL: Overloaded = |_| false;

type Pending = Pin<Box<dyn Future<Output = Result<Permit, Error>> + Send>>;

/// The permit of one request: taken already (reserved in `poll_ready`, or refused before any
/// wait), or still to take.
pub(crate) enum Acquire {
    Now(Option<Result<Held, Error>>),
    Later(Pending),
}

impl Acquire {
    /// Waits for what `ask` asks of `semaphore`, or makes one attempt when `wait` is false.
    pub(crate) fn start(
        semaphore: Semaphore,
        ask: Ask,
        wait: bool,
        rate: Option<RateLimiter>,
    ) -> Self {
        // A slot this process prefetched needs no wait and no future.
        if let Some(permit) = semaphore.take_prefetched(&ask, rate.is_some()) {
            return Acquire::Now(Some(Ok(Held::from(permit))));
        }
        Acquire::Later(Box::pin(async move {
            match rate {
                None if wait => semaphore.acquire_with(ask).await,
                None => semaphore.try_acquire_with(ask).await?.ok_or(Error::Full),
                Some(rate) => with_rate(&semaphore, &ask, wait, &rate).await,
            }
        }))
    }
}

/// A permit and `weight` of the rate limit, all or nothing: a request refused for concurrency
/// spends no rate, one refused for rate keeps no permit.
///
/// Where the semaphore's backend reaches the limiter in the same call (one Redis node, or the
/// same Cluster slot), a permit granted at once spends the rate in that very call. Otherwise
/// (a grant from the line, the outage policy's permit, different backends) the rate is checked
/// once the permit is held, and a refusal gives the permit back at once.
async fn with_rate(
    semaphore: &Semaphore,
    ask: &Ask,
    wait: bool,
    rate: &RateLimiter,
) -> Result<Permit, Error> {
    let permit = match semaphore.acquire_rated(ask, wait, rate).await {
        Err(Error::RateLimited { retry_after }) => {
            rate.decided_with_acquire(&RateDecision::refused(retry_after));
            return Err(Error::RateLimited { retry_after });
        }
        other => other?,
    };
    if let Some(decision) = permit.rate() {
        rate.decided_with_acquire(decision);
        return Ok(permit);
    }
    let decision = rate.check_n(ask.permits()).await?;
    if decision.allowed {
        return Ok(permit.with_rate(decision));
    }
    drop(permit);
    Err(Error::RateLimited {
        retry_after: decision.retry_after.unwrap_or_default(),
    })
}

impl Future for Acquire {
    type Output = Result<Held, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut *self {
            Acquire::Later(pending) => pending.as_mut().poll(cx).map_ok(Held::from),
            Acquire::Now(done) => Poll::Ready(done.take().unwrap_or_else(|| {
                Err(Error::config(
                    "a permit was asked for twice; this is a bug in tower-distributed-limit",
                ))
            })),
        }
    }
}

impl<A> Limiter<A> {
    /// The same limiter with another admission.
    pub(crate) fn map<B>(self, admit: impl FnOnce(A) -> B) -> Limiter<B> {
        Limiter {
            admit: admit(self.admit),
            wait: self.wait,
            abort_on_lost: self.abort_on_lost,
            reserve: self.reserve,
            spares: self.spares,
            rate: self.rate,
            rate_exempt: self.rate_exempt,
            overloaded: self.overloaded,
        }
    }

    /// The rate limit a request of `class` spends: none for a class at or above the
    /// exemption, so a batch flood that empties the rate cannot refuse it.
    pub(crate) fn rate_for(&self, class: Priority) -> Option<RateLimiter> {
        match self.rate_exempt {
            Some(floor) if class >= floor => None,
            _ => self.rate.clone(),
        }
    }

    /// The permit for `request`: the reservation made in `poll_ready`, or the future that
    /// takes what the admission asks for. The limit is the admitted semaphore's, for the
    /// refusal's `RateLimit-Policy`, with the class asked for, for its `x-dlimit-class`; the
    /// rate limiter is the one the request spends (none when its class is exempt).
    pub(crate) fn admit<R>(
        &self,
        request: &R,
        reserved: Option<Result<Held, Error>>,
    ) -> (Acquire, Option<(u32, Priority)>, Option<RateLimiter>)
    where
        A: Admit<R>,
    {
        if let Some(semaphore) = &self.reserve {
            let reserved = reserved.unwrap_or_else(|| {
                Err(Error::config(
                    "call() without a successful poll_ready() on a layer that reserves its \
                     permit in poll_ready; drive the service with ServiceExt::ready first",
                ))
            });
            let asked = (semaphore.limit(), Priority::NORMAL);
            let rate = self.rate_for(Priority::NORMAL);
            return (Acquire::Now(Some(reserved)), Some(asked), rate);
        }
        match self.admit.admit(request) {
            Ok((semaphore, ask)) => {
                let asked = (semaphore.limit(), ask.class());
                let rate = self.rate_for(ask.class());
                let acquire = Acquire::start(semaphore, ask, self.wait, rate.clone());
                (acquire, Some(asked), rate)
            }
            Err(e) => (Acquire::Now(Some(Err(e))), None, None),
        }
    }
}
