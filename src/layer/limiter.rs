//! Which semaphore a request counts against, how many permits it takes, and the future that
//! takes them.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::spares::{Held, Spares};
use crate::{Error, Permit, RateLimiter, Semaphore};

/// Picks the semaphore a request counts against: a [`Semaphore`] for every request, or
/// [`Partitions`](super::Partitions) by the request's key.
///
/// # Example
///
/// ```
/// use tower_distributed_limit::{MemoryBackend, Semaphore};
/// use tower_distributed_limit::layer::Pick;
///
/// let sem = Semaphore::builder("jobs").limit(2).build(MemoryBackend::new()).unwrap();
/// assert_eq!(Pick::<String>::pick(&sem, &"any request".to_owned()).unwrap().name(), "jobs");
/// ```
pub trait Pick<R> {
    /// The request's semaphore. [`Error::BadKey`] for a missing or invalid key; other errors
    /// (a partition that cannot be built) are answered like a failing backend.
    fn pick(&self, request: &R) -> Result<Semaphore, Error>;
}

impl<R> Pick<R> for Semaphore {
    fn pick(&self, _: &R) -> Result<Semaphore, Error> {
        Ok(self.clone())
    }
}

/// How many permits a request takes: [`Unweighted`] (one each) or a closure over the request,
/// set with [`weight_by`](super::DistributedConcurrencyLimitLayer::weight_by).
///
/// # Example
///
/// ```
/// use tower_distributed_limit::layer::{Unweighted, Weigh};
///
/// struct Batch { images: u32 }
/// let by_size = |batch: &Batch| batch.images;
/// assert_eq!(by_size.weigh(&Batch { images: 8 }), 8);
/// assert_eq!(Unweighted.weigh(&Batch { images: 8 }), 1);
/// ```
pub trait Weigh<R> {
    /// The weight of `request`: how many permits it holds, as one holder.
    fn weigh(&self, request: &R) -> u32;
}

impl<R, F> Weigh<R> for F
where
    F: Fn(&R) -> u32,
{
    fn weigh(&self, request: &R) -> u32 {
        self(request)
    }
}

/// Every request takes one permit (the default).
///
/// ```
/// use tower_distributed_limit::layer::{Unweighted, Weigh};
/// assert_eq!(Unweighted.weigh(&"request"), 1);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Unweighted;

impl<R> Weigh<R> for Unweighted {
    fn weigh(&self, _: &R) -> u32 {
        1
    }
}

/// One permit per request, reserved in `poll_ready`; set by
/// [`acquire_in_poll_ready`](super::DistributedConcurrencyLimitLayer::acquire_in_poll_ready).
/// As a type it keeps [`weight_by`](super::DistributedConcurrencyLimitLayer::weight_by) away:
/// a weight needs the request, which `poll_ready` never sees.
///
/// ```
/// use tower_distributed_limit::layer::{InPollReady, Weigh};
/// assert_eq!(InPollReady.weigh(&"request"), 1);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct InPollReady;

impl<R> Weigh<R> for InPollReady {
    fn weigh(&self, _: &R) -> u32 {
        1
    }
}

/// What every flavour shares: where permits come from and how a request waits for them.
#[derive(Debug, Clone)]
pub(crate) struct Limiter<K, W> {
    pub(crate) source: K,
    pub(crate) weigh: W,
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
}

type Pending = Pin<Box<dyn Future<Output = Result<Permit, Error>> + Send>>;

/// The permit of one request: taken already (reserved in `poll_ready`, or refused before any
/// wait), or still to take.
pub(crate) enum Acquire {
    Now(Option<Result<Held, Error>>),
    Later(Pending),
}

impl Acquire {
    /// Waits for `weight` permits of `semaphore`, or makes one attempt when `wait` is false.
    pub(crate) fn start(
        semaphore: Semaphore,
        weight: u32,
        wait: bool,
        rate: Option<RateLimiter>,
    ) -> Self {
        Acquire::Later(Box::pin(async move {
            match rate {
                None if wait => semaphore.acquire_many(weight).await,
                None => semaphore.try_acquire_many(weight).await?.ok_or(Error::Full),
                Some(rate) => with_rate(&semaphore, weight, wait, &rate).await,
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
    weight: u32,
    wait: bool,
    rate: &RateLimiter,
) -> Result<Permit, Error> {
    let permit = semaphore.acquire_rated(weight, wait, rate).await?;
    if permit.rate_spent() {
        return Ok(permit);
    }
    let decision = rate.check_n(weight).await?;
    if decision.allowed {
        return Ok(permit);
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

impl<K, W> Limiter<K, W> {
    /// The permit for `request`: the reservation made in `poll_ready`, or picks its
    /// semaphore and weight now and returns the future that takes them. The limit is the
    /// picked semaphore's, for the refusal's `RateLimit-Policy`.
    pub(crate) fn admit<R>(
        &self,
        request: &R,
        reserved: Option<Result<Held, Error>>,
    ) -> (Acquire, Option<u32>)
    where
        K: Pick<R>,
        W: Weigh<R>,
    {
        if let Some(semaphore) = &self.reserve {
            let reserved = reserved.unwrap_or_else(|| {
                Err(Error::config(
                    "call() without a successful poll_ready() on a layer that reserves its \
                     permit in poll_ready; drive the service with ServiceExt::ready first",
                ))
            });
            return (Acquire::Now(Some(reserved)), Some(semaphore.limit()));
        }
        match self.source.pick(request) {
            Ok(semaphore) => {
                let limit = semaphore.limit();
                let weight = self.weigh.weigh(request);
                let rate = self.rate.clone();
                (
                    Acquire::start(semaphore, weight, self.wait, rate),
                    Some(limit),
                )
            }
            Err(e) => (Acquire::Now(Some(Err(e))), None),
        }
    }
}
