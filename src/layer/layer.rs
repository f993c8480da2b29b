//! The layer and its builder methods, for every flavor.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use tower::{BoxError, Layer};

use super::admit::{InPollReady, Prioritized, Tenanted, Weighable, Weighted};
use super::flavor::{Accepts, Http, Plain};
use super::gatekeeper::{ANY_ERROR, Gatekeeper};
use super::key::HeaderKey;
use super::partitions::Partitions;
use super::service::DistributedConcurrencyLimit;
use super::spares::Spares;
use crate::{Priority, Semaphore};

/// Caps how many requests are in flight at once across every process that shares the
/// semaphore: each request holds a [`Permit`](crate::Permit) while the inner service handles it.
/// It wraps a service of any request type.
///
/// By default a request waits for a permit up to the semaphore's acquire timeout;
/// [`reject_when_full`](Self::reject_when_full) refuses at once instead.
/// [`weight_by`](Self::weight_by) makes heavier requests take more permits;
/// [`partitioned`](Self::partitioned) gives each key (an API key, a tenant) its own limit;
/// [`acquire_in_poll_ready`](Self::acquire_in_poll_ready) reserves the permit in `poll_ready`
/// for `Buffer`, `balance` and `LoadShed` stacks.
///
/// The type parameters are roles:
/// - `Flavor`, how a refusal reaches the caller: [`Plain`] (errors that downcast to
///   [`Error`](crate::Error); the service's error type is [`tower::BoxError`], whatever the
///   inner one), or [`Http`] from [`http`](Self::http) (503 responses) and `grpc` (feature
///   `tonic`, gRPC statuses), whose services keep the inner service's error type (an axum
///   `Router` stays `Infallible`, so no `HandleErrorLayer` is needed);
/// - `Admission`, the per-request decision ([`Admit`](super::Admit)): which semaphore a
///   request counts against and what it asks of it: a [`Semaphore`], [`Partitions`],
///   [`Weighted`] by [`weight_by`](Self::weight_by), [`InPollReady`] by
///   [`acquire_in_poll_ready`](Self::acquire_in_poll_ready), or your own.
///
/// Every builder method works in any order and on every flavor.
///
/// # Examples
///
/// ```
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, FencingToken, MemoryBackend, Semaphore};
///
/// struct Job { images: u32 }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
/// // In production: RedisBackend::connect("redis://...").await?, shared by every instance.
/// let gpu = Semaphore::builder("gpu").limit(20).build(MemoryBackend::new())?;
/// let runner = ServiceBuilder::new()
///     .layer(DistributedConcurrencyLimitLayer::new(gpu).weight_by(|job: &Job| job.images))
///     .service(service_fn(|job: Job| async move {
///         let token = FencingToken::current().expect("called by the layer");
///         Ok::<_, tower::BoxError>((job.images, token))
///     }));
/// let (images, _token) = runner.oneshot(Job { images: 8 }).await?;
/// assert_eq!(images, 8);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct DistributedConcurrencyLimitLayer<Flavor = Plain, Admission = Semaphore> {
    gatekeeper: Gatekeeper<Admission>,
    flavor: Flavor,
}

/// [`DistributedConcurrencyLimitLayer`] in its HTTP flavor, made by
/// [`http`](DistributedConcurrencyLimitLayer::http): refusals are answered with a response,
/// and the permit lives until the response body ends.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use axum::{Router, routing::get};
/// use http::StatusCode;
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
///
/// let sem = Semaphore::builder("legacy-db")
///     .limit(30)
///     .acquire_timeout(Duration::from_secs(2))
///     .build(MemoryBackend::new())
///     .unwrap();
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(
///         DistributedConcurrencyLimitLayer::new(sem)
///             .http()
///             .status(StatusCode::TOO_MANY_REQUESTS)
///             .body("busy, try again in a few seconds")
///             .retry_after(Some(Duration::from_secs(5)))
///             .reject_when_full(),
///     );
/// # let _ = app;
/// ```
pub type HttpConcurrencyLimitLayer<Admission = Semaphore> =
    DistributedConcurrencyLimitLayer<Http, Admission>;

impl DistributedConcurrencyLimitLayer {
    /// Every request takes one permit of `semaphore`.
    pub fn new(semaphore: Semaphore) -> Self {
        Self::admitting(semaphore)
    }

    /// Every request takes one permit of its key's semaphore; see [`Partitions`].
    ///
    /// ```
    /// use http::HeaderName;
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Partitions};
    ///
    /// let partitions = Partitions::builder("api")
    ///     .key_header(HeaderName::from_static("x-api-key"))
    ///     .limit(5)
    ///     .build(MemoryBackend::new())
    ///     .unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::partitioned(partitions).http();
    /// # let _ = layer;
    /// ```
    pub fn partitioned<X>(
        partitions: Partitions<X>,
    ) -> DistributedConcurrencyLimitLayer<Plain, Partitions<X>> {
        DistributedConcurrencyLimitLayer::admitting(partitions)
    }
}

impl<Admission> DistributedConcurrencyLimitLayer<Plain, Admission> {
    /// Every request is admitted as `admission` decides (see [`Admit`](super::Admit)): the
    /// semaphore it counts against and what it asks of it.
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    /// use tower_distributed_limit::layer::Weighted;
    ///
    /// let gpu = Semaphore::builder("gpu").limit(20).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::admitting(Weighted::new(gpu, |n: &u32| *n));
    /// # let _ = layer;
    /// ```
    pub fn admitting(admission: Admission) -> Self {
        DistributedConcurrencyLimitLayer {
            gatekeeper: Gatekeeper {
                admit: admission,
                wait: true,
                abort_on_lost: false,
                rate: None,
                rate_exempt: None,
                overloaded: ANY_ERROR,
            },
            flavor: Plain,
        }
    }

    /// Which errors of the inner service are congestion signals for an
    /// [adaptive limit](crate::SemaphoreBuilder::adaptive) (default: every one). A request
    /// dropped before its response (an outer `tower::timeout`, a caller gone) always is. The
    /// hold time, the limit's latency sample, needs nothing: it is the permit's, from grant to
    /// the response.
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("jobs").limit(4).build(MemoryBackend::new()).unwrap();
    /// // Only timeouts of the inner service's own say the downstream is overloaded.
    /// let layer = DistributedConcurrencyLimitLayer::new(sem)
    ///     .overloaded_on_error(|e| e.is::<tower::timeout::error::Elapsed>());
    /// # let _ = layer;
    /// ```
    pub fn overloaded_on_error(mut self, overloaded: fn(&BoxError) -> bool) -> Self {
        self.gatekeeper.overloaded = overloaded;
        self
    }
}

impl<Flavor, Admission> DistributedConcurrencyLimitLayer<Flavor, Admission> {
    /// Refuse a request at once when no permit is free, instead of waiting up to the
    /// semaphore's acquire timeout. The refusal is an [`Error::Full`](crate::Error::Full)
    /// (503 in the HTTP flavor, `RESOURCE_EXHAUSTED` in the gRPC one).
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("api").limit(8).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(sem).reject_when_full().http();
    /// # let _ = layer;
    /// ```
    pub fn reject_when_full(mut self) -> Self {
        self.gatekeeper.wait = false;
        self
    }

    /// Wait up to the semaphore's acquire timeout for a permit (the default). The timeout
    /// bounds the wait in line only: with a free slot even a 1 ms timeout admits the request.
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("api").limit(8).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(sem).reject_when_full().wait_when_full();
    /// # let _ = layer;
    /// ```
    pub fn wait_when_full(mut self) -> Self {
        self.gatekeeper.wait = true;
        self
    }

    /// Abort a request whose permit's lease is lost before its response is ready: the inner
    /// future is dropped and the request fails with [`Error::LeaseLost`](crate::Error::LeaseLost)
    /// (answered like a refusal in the HTTP flavor). Off by default: leases are
    /// renewed while the request runs, so a lease is only lost when Redis cannot be reached
    /// for a whole lease or the process was paused, and the fencing token already protects a
    /// resource that checks it; turn it on when running past a lost lease is worse than
    /// failing. A streaming response body is not cut once its head was sent.
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("payments").limit(4).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(sem).abort_when_lease_lost();
    /// # let _ = layer;
    /// ```
    pub fn abort_when_lease_lost(mut self) -> Self {
        self.gatekeeper.abort_on_lost = true;
        self
    }

    /// Also cap how many requests *start* per period: each request needs a permit and its
    /// weight of `rate`, all or nothing. A request refused for concurrency spends no rate; one
    /// refused for rate keeps no permit and gets [`Error::RateLimited`](crate::Error::RateLimited)
    /// (429 with `Retry-After` in the HTTP flavor, `RESOURCE_EXHAUSTED` in the gRPC one).
    ///
    /// When the semaphore and the limiter live on the same [`RedisBackend`](crate::RedisBackend)
    /// (one node, Sentinel's master, or the same Cluster slot: give both the same name), a
    /// request that gets its permit at once is decided in **one** script call. A request that
    /// waited in line, or one whose limiter is elsewhere, spends its rate in a second call
    /// once its permit is granted, and gives the permit back if the rate refuses. Stacking
    /// [`DistributedRateLimitLayer`](crate::DistributedRateLimitLayer) in front works too, but
    /// spends rate on requests the concurrency limit then refuses.
    ///
    /// Every class spends the same rate ([`priority_by`](Self::priority_by) orders the
    /// semaphore's line, not the rate); [`rate_limit_exempt`](Self::rate_limit_exempt) lets
    /// the high classes skip it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Error, MemoryBackend, RateLimiter, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
    /// // In production: one RedisBackend::connect("redis://...").await? for both.
    /// let backend = MemoryBackend::new();
    /// let sem = Semaphore::builder("search").limit(10).build(backend.clone())?;
    /// let rate = RateLimiter::builder("search")
    ///     .rate(1, Duration::from_secs(60))
    ///     .burst(1)
    ///     .build(backend)?;
    /// let svc = ServiceBuilder::new()
    ///     .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).rate_limit(rate))
    ///     .service(service_fn(|q: &'static str| async move { Ok::<_, tower::BoxError>(q) }));
    /// assert_eq!(svc.clone().oneshot("first").await?, "first");
    /// let err = svc.oneshot("second").await.unwrap_err();
    /// assert!(matches!(err.downcast_ref::<Error>(), Some(Error::RateLimited { .. })));
    /// assert_eq!(sem.available_permits().await?, 10); // the refused request kept no permit
    /// # Ok(()) }
    /// ```
    pub fn rate_limit(mut self, rate: crate::RateLimiter) -> Self {
        self.gatekeeper.rate = Some(rate);
        self
    }

    /// Requests of class `class` or higher (as [`priority_by`](Self::priority_by) sets it)
    /// skip the [`rate_limit`](Self::rate_limit): they take their permit, served first in
    /// line, and spend no rate, so a batch flood that empties the rate refuses batch requests
    /// only. Without it, classes order the semaphore's line but not the rate: every class
    /// spends the same rate, and a critical request arriving once the flood spent it gets 429.
    /// Under [`acquire_in_poll_ready`](Self::acquire_in_poll_ready) every request is of
    /// [`Priority::NORMAL`].
    ///
    /// An exempt request still counts nowhere against the rate, so the rate caps the other
    /// classes only; bound the exempt ones with the semaphore's shares
    /// ([`SemaphoreBuilder::class`](crate::SemaphoreBuilder::class)).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Error, MemoryBackend, Priority, RateLimiter, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
    /// let backend = MemoryBackend::new();
    /// let sem = Semaphore::builder("search").limit(10).build(backend.clone())?;
    /// let rate = RateLimiter::builder("search").rate(1, Duration::from_secs(60)).build(backend)?;
    /// let svc = ServiceBuilder::new()
    ///     .layer(DistributedConcurrencyLimitLayer::new(sem)
    ///         .priority_by(|path: &&str| {
    ///             if path.starts_with("/batch") { Priority::BATCH } else { Priority::CRITICAL }
    ///         })
    ///         .rate_limit(rate)
    ///         .rate_limit_exempt(Priority::CRITICAL))
    ///     .service(service_fn(|path: &'static str| async move { Ok::<_, tower::BoxError>(path) }));
    /// assert_eq!(svc.clone().oneshot("/batch/1").await?, "/batch/1"); // spends the rate
    /// let err = svc.clone().oneshot("/batch/2").await.unwrap_err();
    /// assert!(matches!(err.downcast_ref::<Error>(), Some(Error::RateLimited { .. })));
    /// assert_eq!(svc.oneshot("/chat").await?, "/chat"); // exempt
    /// # Ok(()) }
    /// ```
    pub fn rate_limit_exempt(mut self, class: Priority) -> Self {
        self.gatekeeper.rate_exempt = Some(class);
        self
    }

    /// The HTTP flavor: the layer answers a refused request itself, the permit is held until
    /// the response body ends, and the handler also finds the
    /// [`FencingToken`](super::FencingToken) in the request's extensions. Callable before or
    /// after any other builder method; on a `grpc` layer it switches back to HTTP answers,
    /// keeping the settings.
    ///
    /// Each kind of refusal has its own answer: a plain-text sentence for the client (no
    /// advice to operators: that is logged), and the header `x-dlimit-refusal` naming the kind,
    /// so clients and dashboards tell an outage from a full limit:
    ///
    /// | refusal | status | `x-dlimit-refusal` | `Retry-After` |
    /// |---|---|---|---|
    /// | [`Error::Full`](crate::Error::Full) (with [`reject_when_full`](Self::reject_when_full)) | 503 | `full` | [`retry_after`](DistributedConcurrencyLimitLayer::retry_after), 1 s |
    /// | [`Error::Timeout`](crate::Error::Timeout): no slot came free within the acquire timeout | 503 | `timeout` | the same |
    /// | [`Error::TooManyWaiters`](crate::Error::TooManyWaiters) | 503 | `too-many-waiters` | the same |
    /// | [`Error::Backend`](crate::Error::Backend): the backend failed and its outage policy refused (fail closed) | 503 | `outage` | the same |
    /// | [`Error::RateLimited`](crate::Error::RateLimited) (with [`rate_limit`](Self::rate_limit)) | 429 | `rate-limited` | the limiter's time |
    /// | [`Error::LeaseLost`](crate::Error::LeaseLost) (with [`abort_when_lease_lost`](Self::abort_when_lease_lost)) | 503 | `lease-lost` | the same as `full` |
    /// | [`Error::BadKey`](crate::Error::BadKey): a missing or invalid partition key | 400 | `bad-key` | none |
    /// | [`Error::Config`](crate::Error::Config): a weight of 0 or above the limit | 500 | `config` | none |
    ///
    /// [`status`](DistributedConcurrencyLimitLayer::status) and [`body`](DistributedConcurrencyLimitLayer::body)
    /// change the first three (no permit); [`on_refusal`](DistributedConcurrencyLimitLayer::on_refusal)
    /// builds any answer itself.
    ///
    /// ```
    /// use tower::{ServiceExt, service_fn};
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
    /// let sem = Semaphore::builder("pages").limit(1).build(MemoryBackend::new())?;
    /// let svc = tower::ServiceBuilder::new()
    ///     .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).http().reject_when_full())
    ///     .service(service_fn(|_: http::Request<()>| async {
    ///         Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    ///     }));
    /// let _held = sem.acquire().await?;
    /// let response = svc.oneshot(http::Request::new(())).await?;
    /// assert_eq!(response.status(), 503);
    /// assert_eq!(response.headers()["x-dlimit-refusal"], "full");
    /// # Ok(()) }
    /// ```
    pub fn http(self) -> DistributedConcurrencyLimitLayer<Http, Admission>
    where
        Flavor: Into<Http>,
    {
        let mut flavor: Http = self.flavor.into();
        flavor.settings_mut().answer = super::answer::Answer::Http;
        DistributedConcurrencyLimitLayer {
            gatekeeper: self.gatekeeper,
            flavor,
        }
    }

    /// The gRPC flavor, for tonic servers and clients: a refused request is answered with a
    /// gRPC status in a trailers-only response (HTTP 200, `grpc-status`, `grpc-message`,
    /// `x-dlimit-refusal`): `RESOURCE_EXHAUSTED` when no permit came free (full, timeout, too
    /// many waiters) or the rate limit was reached, each with its own message; `UNAVAILABLE`
    /// when the backend failed; `INVALID_ARGUMENT` for a bad partition key or a request heavier
    /// than the limit; `ABORTED` for a lost lease. Messages are the same short sentences as
    /// the HTTP bodies, never the error's advice to operators. A tonic server sends it as is; a
    /// tonic client reads it as the `Status` its call returns. Otherwise like
    /// [`http`](Self::http): the permit is held until the response body ends (a streaming RPC
    /// keeps its slot), and [`on_refusal`](DistributedConcurrencyLimitLayer::on_refusal) replaces
    /// the answer.
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("grpc-upstream").limit(8).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(sem).grpc().reject_when_full();
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "tonic")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
    pub fn grpc(self) -> DistributedConcurrencyLimitLayer<Http, Admission>
    where
        Flavor: Into<Http>,
    {
        let mut layer = self.http();
        layer.flavor.settings_mut().answer = super::answer::Answer::Grpc;
        layer
    }
}

impl<Flavor, Admission: Weighable> DistributedConcurrencyLimitLayer<Flavor, Admission> {
    /// A request takes `weight(&request)` permits, as one holder (a batch of 8 images takes 8
    /// slots of a GPU limited to 20). A weight of 0 or above the limit is refused at once,
    /// never waited for: [`Error::Config`](crate::Error::Config) in the generic flavor, 500
    /// in the HTTP one, `INVALID_ARGUMENT` in the gRPC one.
    ///
    /// Not available with [`acquire_in_poll_ready`](Self::acquire_in_poll_ready): `poll_ready`
    /// does not see the request.
    ///
    /// ```
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Error, MemoryBackend, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
    /// let gpu = Semaphore::builder("gpu").limit(20).build(MemoryBackend::new())?;
    /// let svc = ServiceBuilder::new()
    ///     .layer(DistributedConcurrencyLimitLayer::new(gpu).weight_by(|images: &u32| *images))
    ///     .service(service_fn(|images: u32| async move { Ok::<_, tower::BoxError>(images) }));
    /// assert_eq!(svc.clone().oneshot(8).await?, 8);
    /// let err = svc.oneshot(21).await.unwrap_err(); // heavier than the whole limit
    /// assert!(matches!(err.downcast_ref::<Error>(), Some(Error::Config(_))));
    /// # Ok(()) }
    /// ```
    pub fn weight_by<G, R>(
        self,
        weight: G,
    ) -> DistributedConcurrencyLimitLayer<Flavor, Weighted<Admission, G>>
    where
        Flavor: Accepts<R>,
        G: Fn(&R) -> u32,
    {
        DistributedConcurrencyLimitLayer {
            gatekeeper: self.gatekeeper.map(|admit| Weighted::new(admit, weight)),
            flavor: self.flavor,
        }
    }
}

impl<Flavor, Admission: Weighable> DistributedConcurrencyLimitLayer<Flavor, Admission> {
    /// A request is of the class `priority(&request)`: the line serves a higher class first,
    /// inside the share the semaphore gives it
    /// ([`SemaphoreBuilder::class`](crate::SemaphoreBuilder::class)). Composes with
    /// [`weight_by`](Self::weight_by), partitions and [`rate_limit`](Self::rate_limit). The
    /// class orders the line only: every class spends the same rate unless
    /// [`rate_limit_exempt`](Self::rate_limit_exempt) exempts it.
    ///
    /// Not available with [`acquire_in_poll_ready`](Self::acquire_in_poll_ready): `poll_ready`
    /// does not see the request.
    ///
    /// ```
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Priority, Semaphore, Share};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
    /// let gpu = Semaphore::builder("gpu")
    ///     .limit(20)
    ///     .class(Priority::CRITICAL, Share::reserved(5))
    ///     .build(MemoryBackend::new())?;
    /// let svc = ServiceBuilder::new()
    ///     .layer(DistributedConcurrencyLimitLayer::new(gpu).priority_by(|path: &String| {
    ///         if path.starts_with("/batch") { Priority::BATCH } else { Priority::CRITICAL }
    ///     }))
    ///     .service(service_fn(|path: String| async move { Ok::<_, tower::BoxError>(path.len()) }));
    /// assert_eq!(svc.oneshot("/chat".to_owned()).await?, 5);
    /// # Ok(()) }
    /// ```
    pub fn priority_by<P, R>(
        self,
        priority: P,
    ) -> DistributedConcurrencyLimitLayer<Flavor, Prioritized<Admission, P>>
    where
        Flavor: Accepts<R>,
        P: Fn(&R) -> Priority,
    {
        DistributedConcurrencyLimitLayer {
            gatekeeper: self
                .gatekeeper
                .map(|admit| Prioritized::new(admit, priority)),
            flavor: self.flavor,
        }
    }

    /// A request belongs to the tenant `tenant(&request)` (`None`: no tenant): inside its
    /// class, tenants are served in turn, each inside the semaphore's per-tenant cap
    /// ([`SemaphoreBuilder::per_tenant`](crate::SemaphoreBuilder::per_tenant)), in the same
    /// call that takes the permit. Composes with [`priority_by`](Self::priority_by),
    /// [`weight_by`](Self::weight_by), partitions and [`rate_limit`](Self::rate_limit); see
    /// [`tenant_header`](Self::tenant_header) for HTTP.
    ///
    /// ```
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore, Share};
    ///
    /// struct Job { customer: String }
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
    /// let workers = Semaphore::builder("workers")
    ///     .limit(20)
    ///     .per_tenant(Share::at_most(5))
    ///     .build(MemoryBackend::new())?;
    /// let svc = ServiceBuilder::new()
    ///     .layer(DistributedConcurrencyLimitLayer::new(workers)
    ///         .tenant_by(|job: &Job| Some(job.customer.clone())))
    ///     .service(service_fn(|job: Job| async move { Ok::<_, tower::BoxError>(job.customer.len()) }));
    /// assert_eq!(svc.oneshot(Job { customer: "acme".into() }).await?, 4);
    /// # Ok(()) }
    /// ```
    pub fn tenant_by<K, R>(
        self,
        tenant: K,
    ) -> DistributedConcurrencyLimitLayer<Flavor, Tenanted<Admission, K>>
    where
        Flavor: Accepts<R>,
        K: Fn(&R) -> Option<String>,
    {
        DistributedConcurrencyLimitLayer {
            gatekeeper: self.gatekeeper.map(|admit| Tenanted::new(admit, tenant)),
            flavor: self.flavor,
        }
    }

    /// An HTTP request's tenant is the value of its header `name` (a missing or non-UTF-8
    /// value: no tenant), as with [`tenant_by`](Self::tenant_by).
    ///
    /// ```
    /// use http::HeaderName;
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore, Share};
    ///
    /// let api = Semaphore::builder("api")
    ///     .limit(64)
    ///     .per_tenant(Share::at_most(8))
    ///     .build(MemoryBackend::new())
    ///     .unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(api)
    ///     .http()
    ///     .tenant_header(HeaderName::from_static("x-tenant"));
    /// # let _ = layer;
    /// ```
    pub fn tenant_header(
        self,
        name: http::HeaderName,
    ) -> DistributedConcurrencyLimitLayer<Flavor, Tenanted<Admission, HeaderKey>> {
        DistributedConcurrencyLimitLayer {
            gatekeeper: self
                .gatekeeper
                .map(|admit| Tenanted::new(admit, HeaderKey(name))),
            flavor: self.flavor,
        }
    }
}

impl<Flavor> DistributedConcurrencyLimitLayer<Flavor, Semaphore> {
    /// Reserve the permit in `poll_ready` and hand it to the request in `call`, as tower's
    /// `ConcurrencyLimit` does: a service is not ready while the semaphore is full, so
    /// `LoadShed` sheds, `Buffer` stops draining and p2c `balance` picks another endpoint.
    ///
    /// The default (the permit taken in the response future) is right for servers: hyper and
    /// axum call `poll_ready` per request anyway, and no permit ever sits in an idle service.
    /// Here a ready service holds a permit until it is called: a clone starts without one, and
    /// a ready service dropped without a call gives its own back; a reserved permit is renewed
    /// like any other. A wait that runs out, or a failing backend, makes the service ready
    /// and fails the next call (an error from `poll_ready` would break a `Buffer` for good).
    ///
    /// **Spares.** On Redis an acquire is a round trip, so a `poll_ready` that had to start
    /// one would be `Pending` and `LoadShed` would shed a request the semaphore has room for.
    /// So every service this layer makes (each endpoint of an axum `Router`, and every clone)
    /// shares a few permits held ahead: a request's permit goes back to them when it ends, and
    /// a `poll_ready` that finds none starts a background `try_acquire` (never a wait in line)
    /// for the next; each second a spare older than a second is swapped for a fresh
    /// `try_acquire`. The layer's first service takes the first spare at once. As many are kept as were lent out at once
    /// during the last second, at most half the limit and 8; none for a limit of 1 or with
    /// [`rate_limit`](Self::rate_limit) (a spare would spend rate for a request that may never
    /// come): there, on Redis, a service behind `LoadShed` is ready only once its own acquire
    /// has come back, so a server that polls a fresh clone per request sheds them. The
    /// trade-off: spares count against the global limit, so a busy service holds up
    /// to that many slots more than it uses, and for up to a second another process's waiter
    /// does not get a slot this one keeps; an idle service gives its spares back within about
    /// two seconds (the first request after that may be shed), and they all go back once the
    /// layer and its services are dropped.
    /// Requests served one after another by one permit see the same fencing token. Background
    /// work needs a tokio runtime and is skipped without one; a background acquire dropped
    /// with its runtime, or finished after the service is gone, releases what it took.
    ///
    /// One semaphore only: a partition or a weight needs the request, which `poll_ready` does
    /// not see, so `partitioned(..).acquire_in_poll_ready()` and `weight_by` with it do not
    /// compile.
    ///
    /// ```
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
    /// let sem = Semaphore::builder("upstream").limit(1).build(MemoryBackend::new())?;
    /// let svc = ServiceBuilder::new()
    ///     .load_shed()
    ///     .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).acquire_in_poll_ready())
    ///     .service(service_fn(|n: u32| async move { Ok::<_, tower::BoxError>(n) }));
    /// assert_eq!(svc.clone().oneshot(1).await?, 1);
    /// let _held = sem.acquire().await?; // full now: shed at once, not queued
    /// let err = svc.oneshot(2).await.unwrap_err();
    /// assert!(err.is::<tower::load_shed::error::Overloaded>());
    /// # Ok(()) }
    /// ```
    pub fn acquire_in_poll_ready(self) -> DistributedConcurrencyLimitLayer<Flavor, InPollReady> {
        let gatekeeper = self.gatekeeper.map(|semaphore| {
            let spares = Spares::new(&semaphore);
            // The first spare is taken now (on a runtime), so the first request need not be
            // shed.
            spares.warm();
            InPollReady { semaphore, spares }
        });
        DistributedConcurrencyLimitLayer {
            gatekeeper,
            flavor: self.flavor,
        }
    }
}

impl<Admission> DistributedConcurrencyLimitLayer<Http, Admission> {
    /// The status of a request that got no permit: [`Error::Full`](crate::Error::Full),
    /// [`Error::Timeout`](crate::Error::Timeout) and
    /// [`Error::TooManyWaiters`](crate::Error::TooManyWaiters) (default 503 Service
    /// Unavailable). Other refusals keep their own status (see [`http`](DistributedConcurrencyLimitLayer::http)):
    /// an outage stays a 503 with its own body, so it is never mistaken for a full limit.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("api").limit(8).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(sem).http().status(StatusCode::TOO_MANY_REQUESTS);
    /// # let _ = layer;
    /// ```
    pub fn status(mut self, status: StatusCode) -> Self {
        self.flavor.settings_mut().status = Some(status);
        self
    }

    /// The body of a request that got no permit (full, timeout, too many waiters), the same
    /// for the three. By default each has its own short plain-text sentence; other refusals
    /// always keep theirs.
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("api").limit(8).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(sem).http().body("busy");
    /// # let _ = layer;
    /// ```
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.flavor.settings_mut().body = Some(body.into());
        self
    }

    /// The `Retry-After` of the layer's own 503 answers (no permit, an outage, a lost lease),
    /// in whole seconds rounded up (default 1 s); `None` sends none. A rate-limited request
    /// always gets the limiter's own time; a bad key or a bad weight gets none.
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("api").limit(8).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(sem).http().retry_after(None);
    /// # let _ = layer;
    /// ```
    pub fn retry_after(mut self, after: Option<Duration>) -> Self {
        self.flavor.settings_mut().retry_after = after;
        self
    }

    /// Release the permit as soon as the response head is ready instead of when its body ends.
    /// Right when the body is cheap to produce and a slow client should not hold a slot.
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("api").limit(8).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(sem).http().release_at_head();
    /// # let _ = layer;
    /// ```
    pub fn release_at_head(mut self) -> Self {
        self.flavor.settings_mut().hold_until_body_end = false;
        self
    }

    /// Which answers of the inner service are congestion signals for an
    /// [adaptive limit](crate::SemaphoreBuilder::adaptive) (default: any 5xx). An inner error
    /// (no answer at all) and a request dropped before its answer (an outer `tower::timeout`,
    /// a client gone) always are.
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    /// use tower_distributed_limit::http::StatusCode;
    ///
    /// let sem = Semaphore::builder("api").limit(8).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(sem)
    ///     .http()
    ///     .overloaded_on_status(|status| {
    ///         status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::GATEWAY_TIMEOUT
    ///     });
    /// # let _ = layer;
    /// ```
    pub fn overloaded_on_status(mut self, overloaded: fn(StatusCode) -> bool) -> Self {
        self.flavor.settings_mut().overloaded = overloaded;
        self
    }

    /// Send `RateLimit-Policy: "concurrency";q=<limit>;qu="concurrent-requests"` (IETF httpapi
    /// ratelimit-headers draft) on refusals, with the limit of the semaphore the request was
    /// refused by. Off by default.
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("api").limit(8).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(sem).http().ratelimit_policy_header();
    /// # let _ = layer;
    /// ```
    pub fn ratelimit_policy_header(mut self) -> Self {
        self.flavor.settings_mut().policy_header = true;
        self
    }

    /// Builds the answer to every refusal: `hook` gets the [`Error`](crate::Error) and returns
    /// the response to send, or `None` for the layer's own (see
    /// [`http`](DistributedConcurrencyLimitLayer::http)). Its response is sent as is (plus
    /// `RateLimit-Policy` if asked for), in the HTTP and the gRPC flavor alike. The error's
    /// `Display` carries advice for operators; build client-facing text from its variant.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower::{ServiceExt, service_fn};
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Error, MemoryBackend, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
    /// let sem = Semaphore::builder("api").limit(1).build(MemoryBackend::new())?;
    /// let layer = DistributedConcurrencyLimitLayer::new(sem.clone())
    ///     .http()
    ///     .reject_when_full()
    ///     .on_refusal(|error: &Error| {
    ///         let code = match error {
    ///             Error::Full | Error::Timeout { .. } => "busy",
    ///             _ => return None, // the default answer
    ///         };
    ///         let body = Bytes::from(format!("{{\"error\":\"{code}\"}}"));
    ///         http::Response::builder()
    ///             .status(429)
    ///             .header("content-type", "application/json")
    ///             .body(body)
    ///             .ok()
    ///     });
    /// let svc = tower::ServiceBuilder::new()
    ///     .layer(layer)
    ///     .service(service_fn(|_: http::Request<()>| async {
    ///         Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    ///     }));
    /// let _held = sem.acquire().await?;
    /// let response = svc.oneshot(http::Request::new(())).await?;
    /// assert_eq!(response.status(), 429);
    /// assert_eq!(response.headers()["content-type"], "application/json");
    /// # Ok(()) }
    /// ```
    pub fn on_refusal<H>(mut self, hook: H) -> Self
    where
        H: Fn(&crate::Error) -> Option<http::Response<Bytes>> + Send + Sync + 'static,
    {
        self.flavor.settings_mut().on_refusal = Some(super::answer::OnRefusal(Arc::new(hook)));
        self
    }
}

impl<S, Flavor, Admission> Layer<S> for DistributedConcurrencyLimitLayer<Flavor, Admission>
where
    Flavor: Clone,
    Admission: Clone,
{
    type Service = DistributedConcurrencyLimit<S, Flavor, Admission>;

    fn layer(&self, inner: S) -> Self::Service {
        DistributedConcurrencyLimit::new(inner, self.gatekeeper.clone(), self.flavor.clone())
    }
}
