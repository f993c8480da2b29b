//! The per-request decision, named once: which semaphore a request counts against and what it
//! asks of it ([`Admit`]), with the pieces the layer's builder methods put together.

use super::PartitionKey;
use super::spares::Spares;
use crate::{Ask, Error, Priority, Semaphore};

/// For one request: the semaphore it counts against and what it asks of it. The layer's
/// second type parameter; [`DistributedConcurrencyLimitLayer::new`](super::DistributedConcurrencyLimitLayer::new)
/// admits every request to one [`Semaphore`], [`partitioned`](super::DistributedConcurrencyLimitLayer::partitioned)
/// to its key's ([`Partitions`](super::Partitions)), and
/// [`weight_by`](super::DistributedConcurrencyLimitLayer::weight_by) wraps either in
/// [`Weighted`]. Implement it for a decision of your own (a semaphore per route, say).
///
/// # Errors
///
/// [`Error::BadKey`] for a request whose key is missing or invalid (400 in the HTTP flavor);
/// any other error (a partition that cannot be built) is answered like a failing backend.
///
/// # Examples
///
/// ```
/// use tower_distributed_limit::{Ask, Error, MemoryBackend, Semaphore};
/// use tower_distributed_limit::layer::Admit;
///
/// /// Uploads count against their own semaphore, with a weight per megabyte.
/// struct ByRoute { uploads: Semaphore, pages: Semaphore }
///
/// impl Admit<http::Request<()>> for ByRoute {
///     fn admit(&self, request: &http::Request<()>) -> Result<(Semaphore, Ask), Error> {
///         if request.uri().path().starts_with("/upload") {
///             let megabytes = request.headers().get("content-length")
///                 .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
///                 .map_or(1, |bytes| (bytes >> 20).clamp(1, 8) as u32);
///             Ok((self.uploads.clone(), Ask::new().weight(megabytes)))
///         } else {
///             Ok((self.pages.clone(), Ask::new()))
///         }
///     }
/// }
///
/// let backend = MemoryBackend::new();
/// let routes = ByRoute {
///     uploads: Semaphore::builder("uploads").limit(16).build(backend.clone())?,
///     pages: Semaphore::builder("pages").limit(100).build(backend)?,
/// };
/// let (sem, ask) = routes.admit(&http::Request::builder().uri("/upload").body(()).unwrap())?;
/// assert_eq!((sem.name(), ask.get_weight()), ("uploads", 1));
/// # Ok::<(), Error>(())
/// ```
pub trait Admit<R> {
    /// The semaphore `request` counts against, and what it asks of it.
    fn admit(&self, request: &R) -> Result<(Semaphore, Ask), Error>;

    /// Whether the permit is reserved in `poll_ready`, and where: only [`InPollReady`] does;
    /// the argument keeps this crate's own admissions the only ones that can say so.
    #[doc(hidden)]
    fn reserves(&self, _: sealed::Private) -> Option<&InPollReady> {
        None
    }
}

/// Every request asks one permit of this semaphore.
impl<R> Admit<R> for Semaphore {
    fn admit(&self, _: &R) -> Result<(Semaphore, Ask), Error> {
        Ok((self.clone(), Ask::new()))
    }
}

/// How many permits a request takes: [`Unweighted`] (one each) or a closure over the
/// request, given to [`weight_by`](super::DistributedConcurrencyLimitLayer::weight_by) (and
/// to the rate layer's `weight_by`, as the request's cost).
///
/// # Examples
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

/// Every request weighs one (the rate layer's default cost).
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

/// An admission whose requests weigh what `W` says; made by
/// [`weight_by`](super::DistributedConcurrencyLimitLayer::weight_by).
///
/// ```
/// use tower_distributed_limit::{MemoryBackend, Semaphore};
/// use tower_distributed_limit::layer::{Admit, Weighted};
///
/// let gpu = Semaphore::builder("gpu").limit(20).build(MemoryBackend::new()).unwrap();
/// let weighted = Weighted::new(gpu, |images: &u32| *images);
/// let (_, ask) = weighted.admit(&8).unwrap();
/// assert_eq!(ask.get_weight(), 8);
/// ```
#[derive(Debug, Clone)]
pub struct Weighted<A, W> {
    admit: A,
    weigh: W,
}

impl<A, W> Weighted<A, W> {
    /// `admit`'s decisions, with the weight `weigh` gives each request.
    pub fn new(admit: A, weigh: W) -> Self {
        Weighted { admit, weigh }
    }
}

impl<R, A, W> Admit<R> for Weighted<A, W>
where
    A: Admit<R>,
    W: Weigh<R>,
{
    fn admit(&self, request: &R) -> Result<(Semaphore, Ask), Error> {
        let (semaphore, ask) = self.admit.admit(request)?;
        Ok((semaphore, ask.weight(self.weigh.weigh(request))))
    }
}

/// An admission whose requests are of the class `P` says; made by
/// [`priority_by`](super::DistributedConcurrencyLimitLayer::priority_by).
///
/// ```
/// use tower_distributed_limit::{MemoryBackend, Priority, Semaphore};
/// use tower_distributed_limit::layer::{Admit, Prioritized};
///
/// let gpu = Semaphore::builder("gpu").limit(20).build(MemoryBackend::new()).unwrap();
/// let by_path = Prioritized::new(gpu, |path: &&str| {
///     if path.starts_with("/batch") { Priority::BATCH } else { Priority::CRITICAL }
/// });
/// assert_eq!(by_path.admit(&"/batch/42").unwrap().1.get_priority(), Priority::BATCH);
/// assert_eq!(by_path.admit(&"/chat").unwrap().1.get_priority(), Priority::CRITICAL);
/// ```
#[derive(Debug, Clone)]
pub struct Prioritized<A, P> {
    admit: A,
    priority: P,
}

impl<A, P> Prioritized<A, P> {
    /// `admit`'s decisions, in the class `priority` gives each request.
    pub fn new(admit: A, priority: P) -> Self {
        Prioritized { admit, priority }
    }
}

impl<R, A, P> Admit<R> for Prioritized<A, P>
where
    A: Admit<R>,
    P: Fn(&R) -> Priority,
{
    fn admit(&self, request: &R) -> Result<(Semaphore, Ask), Error> {
        let (semaphore, ask) = self.admit.admit(request)?;
        Ok((semaphore, ask.priority((self.priority)(request))))
    }
}

/// An admission whose requests belong to the tenant `K` reads from each (a header's value,
/// any `Fn(&R) -> Option<String>`); made by
/// [`tenant_by`](super::DistributedConcurrencyLimitLayer::tenant_by) and
/// [`tenant_header`](super::DistributedConcurrencyLimitLayer::tenant_header). A request
/// without one has no tenant.
///
/// ```
/// use tower_distributed_limit::{Ask, MemoryBackend, Semaphore};
/// use tower_distributed_limit::layer::{Admit, Tenanted};
///
/// struct Job { customer: Option<String> }
/// let jobs = Semaphore::builder("jobs").limit(20).build(MemoryBackend::new()).unwrap();
/// let by_customer = Tenanted::new(jobs, |job: &Job| job.customer.clone());
/// let ask = by_customer.admit(&Job { customer: Some("acme".into()) }).unwrap().1;
/// assert_eq!(ask.get_tenant(), Ask::new().tenant("acme").get_tenant());
/// assert_eq!(by_customer.admit(&Job { customer: None }).unwrap().1.get_tenant(), None);
/// ```
#[derive(Debug, Clone)]
pub struct Tenanted<A, K> {
    admit: A,
    tenant: K,
}

impl<A, K> Tenanted<A, K> {
    /// `admit`'s decisions, for the tenant `tenant` reads from each request.
    pub fn new(admit: A, tenant: K) -> Self {
        Tenanted { admit, tenant }
    }
}

impl<R, A, K> Admit<R> for Tenanted<A, K>
where
    A: Admit<R>,
    K: PartitionKey<R>,
{
    fn admit(&self, request: &R) -> Result<(Semaphore, Ask), Error> {
        let (semaphore, ask) = self.admit.admit(request)?;
        Ok(match self.tenant.key(request) {
            Some(tenant) => (semaphore, ask.tenant(tenant)),
            None => (semaphore, ask),
        })
    }
}

/// One permit of this semaphore per request, reserved in `poll_ready`; made by
/// [`acquire_in_poll_ready`](super::DistributedConcurrencyLimitLayer::acquire_in_poll_ready).
/// As a type it keeps [`weight_by`](super::DistributedConcurrencyLimitLayer::weight_by) away:
/// a weight needs the request, which `poll_ready` never sees.
///
/// ```
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
/// use tower_distributed_limit::layer::{InPollReady, Plain};
///
/// let sem = Semaphore::builder("upstream").limit(4).build(MemoryBackend::new()).unwrap();
/// let layer: DistributedConcurrencyLimitLayer<Plain, InPollReady> =
///     DistributedConcurrencyLimitLayer::new(sem).acquire_in_poll_ready();
/// # let _ = layer;
/// ```
#[derive(Debug, Clone)]
pub struct InPollReady {
    pub(crate) semaphore: Semaphore,
    /// The permits held ahead for every service the layer makes.
    pub(crate) spares: Spares,
}

impl<R> Admit<R> for InPollReady {
    fn admit(&self, _: &R) -> Result<(Semaphore, Ask), Error> {
        Ok((self.semaphore.clone(), Ask::new()))
    }

    fn reserves(&self, _: sealed::Private) -> Option<&InPollReady> {
        Some(self)
    }
}

/// The admissions [`weight_by`](super::DistributedConcurrencyLimitLayer::weight_by) can wrap:
/// all but [`InPollReady`].
pub trait Weighable: sealed::Sealed {}

impl Weighable for Semaphore {}
impl<A, W> Weighable for Weighted<A, W> {}
impl<A, P> Weighable for Prioritized<A, P> {}
impl<A, K> Weighable for Tenanted<A, K> {}

pub(super) mod sealed {
    /// Only this crate's admissions are [`Weighable`](super::Weighable).
    pub trait Sealed {}

    /// Only this crate can call or override [`Admit::reserves`](super::Admit::reserves).
    #[derive(Debug, Clone, Copy)]
    pub struct Private;
    impl Sealed for crate::Semaphore {}
    impl<A, W> Sealed for super::Weighted<A, W> {}
    impl<A, P> Sealed for super::Prioritized<A, P> {}
    impl<A, K> Sealed for super::Tenanted<A, K> {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryBackend;

    fn semaphore() -> Semaphore {
        Semaphore::builder("admit")
            .limit(10)
            .build(MemoryBackend::new())
            .unwrap()
    }

    #[test]
    fn a_semaphore_admits_one_permit_of_itself() {
        let (sem, ask) = Admit::<()>::admit(&semaphore(), &()).unwrap();
        assert_eq!((sem.name(), ask.get_weight()), ("admit", 1));
    }

    #[test]
    fn weighted_sets_the_weight_and_keeps_the_semaphore() {
        let weighted = Weighted::new(semaphore(), |n: &u32| n * 2);
        let (sem, ask) = weighted.admit(&4).unwrap();
        assert_eq!((sem.name(), ask.get_weight()), ("admit", 8));
        // The outer weight wins over an inner one.
        let twice = Weighted::new(weighted, |_: &u32| 3);
        assert_eq!(twice.admit(&4).unwrap().1.get_weight(), 3);
    }
}
