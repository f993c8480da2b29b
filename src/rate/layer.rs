//! The rate-limit layer and its builder methods: one GCRA check per request before the inner
//! service sees it, for any request type, on the concurrency layer's core (flavors, keys,
//! refusal answers and response futures).

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderName;
use tower::Layer;

use super::limiter::RateLimiter;
use super::service::{DistributedRateLimit, Shared};
use crate::layer::refusal::Refusal;
use crate::layer::{Accepts, HeaderKey, Http, Plain, Unkeyed, Unweighted};

/// Caps how many requests *start* per period across every process that shares the
/// [`RateLimiter`]: each request is one GCRA check (one script call) before the inner service
/// sees it. It wraps a service of any request type.
///
/// Flavors, as for [`DistributedConcurrencyLimitLayer`](crate::DistributedConcurrencyLimitLayer):
/// generic ([`Plain`], the default: a refusal is a [`BoxError`](tower::BoxError) that downcasts to
/// [`Error::RateLimited`](crate::Error::RateLimited)), [`http`](Self::http) (429 Too Many Requests with `Retry-After` and
/// the IETF `RateLimit` / `RateLimit-Policy` headers, also on allowed responses), and `grpc`
/// (feature `tonic`: `RESOURCE_EXHAUSTED`): the same flavor types, answers and headers as the
/// concurrency layer's. [`weight_by`](Self::weight_by) sets a request's
/// cost; [`key_by`](Self::key_by) / [`key_header`](Self::key_header) give each key its own
/// rate (nothing is kept per key in this process).
///
/// A failing backend is decided by the limiter's [`OutagePolicy`](crate::OutagePolicy); when
/// it refuses, the generic flavor fails with [`Error::Backend`](crate::Error::Backend) and the HTTP one answers 503.
///
/// To cap both how many start and how many run at once, prefer
/// [`DistributedConcurrencyLimitLayer::rate_limit`](crate::DistributedConcurrencyLimitLayer::rate_limit):
/// all or nothing, and one script call for both on one Redis. Stacked in front of the
/// concurrency layer, this layer spends the rate of requests the concurrency limit then refuses.
///
/// It knows no request classes: every request it sees spends the rate, a critical one as a
/// batch one. To let a class skip the rate, use the concurrency layer's `rate_limit` with
/// [`rate_limit_exempt`](crate::DistributedConcurrencyLimitLayer::rate_limit_exempt).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower::{Service, ServiceExt, service_fn};
/// use tower_distributed_limit::{DistributedRateLimitLayer, Error, MemoryBackend, RateLimiter};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
/// let rate = RateLimiter::builder("jobs").rate(1, Duration::from_secs(60)).build(MemoryBackend::new())?;
/// let mut svc = tower::ServiceBuilder::new()
///     .layer(DistributedRateLimitLayer::new(rate))
///     .service(service_fn(|job: u32| async move { Ok::<_, tower::BoxError>(job * 2) }));
/// assert_eq!(svc.ready().await?.call(21).await?, 42);
/// let err = svc.ready().await?.call(1).await.unwrap_err();
/// assert!(matches!(err.downcast_ref::<Error>(), Some(Error::RateLimited { .. })));
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct DistributedRateLimitLayer<Flavor = Plain, Key = Unkeyed, Cost = Unweighted> {
    shared: Arc<Shared<Flavor, Key, Cost>>,
}

impl<Flavor, Key, Cost> Clone for DistributedRateLimitLayer<Flavor, Key, Cost> {
    fn clone(&self) -> Self {
        DistributedRateLimitLayer {
            shared: self.shared.clone(),
        }
    }
}

impl DistributedRateLimitLayer {
    /// Every request spends 1 of `limiter`.
    pub fn new(limiter: RateLimiter) -> Self {
        DistributedRateLimitLayer {
            shared: Arc::new(Shared {
                limiter,
                key: Unkeyed,
                cost: Unweighted,
                flavor: Plain,
            }),
        }
    }
}

impl<Flavor: Clone, Key: Clone, Cost: Clone> DistributedRateLimitLayer<Flavor, Key, Cost> {
    /// The same layer with one part changed (the others cloned if a service shares them).
    fn map<F2, K2, C2>(
        self,
        f: impl FnOnce(Shared<Flavor, Key, Cost>) -> Shared<F2, K2, C2>,
    ) -> DistributedRateLimitLayer<F2, K2, C2> {
        let shared = Arc::unwrap_or_clone(self.shared);
        DistributedRateLimitLayer {
            shared: Arc::new(f(shared)),
        }
    }

    /// A request's cost: how much of the rate it spends (1 ..= the burst; a cost of 0 or above
    /// the burst is refused with [`Error::Config`](crate::Error::Config), 500 in the HTTP
    /// flavor). The same closure as the concurrency layer's
    /// [`weight_by`](crate::DistributedConcurrencyLimitLayer::weight_by).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_distributed_limit::{DistributedRateLimitLayer, MemoryBackend, RateLimiter};
    ///
    /// let rate = RateLimiter::builder("tokens").rate(1000, Duration::from_secs(1)).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedRateLimitLayer::new(rate).weight_by(|prompt: &String| prompt.len().min(1000) as u32);
    /// # let _ = layer;
    /// ```
    pub fn weight_by<R, G>(self, cost: G) -> DistributedRateLimitLayer<Flavor, Key, G>
    where
        Flavor: Accepts<R>,
        G: Fn(&R) -> u32,
    {
        self.map(|s| Shared {
            limiter: s.limiter,
            key: s.key,
            cost,
            flavor: s.flavor,
        })
    }

    /// Each key (a tenant, an API key) gets the limiter's rate and burst of its own; a request
    /// whose key is `None` counts against the limiter itself. An empty key or one over 256
    /// bytes is refused with [`Error::BadKey`](crate::Error::BadKey) (400 in the HTTP flavor).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_distributed_limit::{DistributedRateLimitLayer, MemoryBackend, RateLimiter};
    ///
    /// struct Job { tenant: String }
    /// let rate = RateLimiter::builder("jobs").rate(10, Duration::from_secs(1)).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedRateLimitLayer::new(rate).key_by(|job: &Job| Some(job.tenant.clone()));
    /// # let _ = layer;
    /// ```
    pub fn key_by<R, K2>(self, key: K2) -> DistributedRateLimitLayer<Flavor, K2, Cost>
    where
        Flavor: Accepts<R>,
        K2: Fn(&R) -> Option<String>,
    {
        self.map(|s| Shared {
            limiter: s.limiter,
            key,
            cost: s.cost,
            flavor: s.flavor,
        })
    }

    /// Each value of the request header `name` gets a rate of its own (see
    /// [`key_by`](Self::key_by)); the same [`HeaderKey`] as the partitions'.
    ///
    /// ```
    /// use std::time::Duration;
    /// use http::HeaderName;
    /// use tower_distributed_limit::{DistributedRateLimitLayer, MemoryBackend, RateLimiter};
    ///
    /// let rate = RateLimiter::builder("api").rate(10, Duration::from_secs(1)).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedRateLimitLayer::new(rate).key_header(HeaderName::from_static("x-api-key")).http();
    /// # let _ = layer;
    /// ```
    pub fn key_header(
        self,
        name: HeaderName,
    ) -> DistributedRateLimitLayer<Flavor, HeaderKey, Cost> {
        self.map(|s| Shared {
            limiter: s.limiter,
            key: HeaderKey(name),
            cost: s.cost,
            flavor: s.flavor,
        })
    }

    /// The HTTP flavor: a refused request is answered 429 Too Many Requests with
    /// `Retry-After` (whole seconds, rounded up) and `RateLimit` / `RateLimit-Policy`
    /// headers; allowed responses carry the two `RateLimit` headers too. A failing backend
    /// whose outage policy refuses is answered 503 (`x-dlimit-refusal: outage`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{ServiceExt, service_fn};
    /// use tower_distributed_limit::{DistributedRateLimitLayer, MemoryBackend, RateLimiter};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
    /// let rate = RateLimiter::builder("pages").rate(1, Duration::from_secs(60)).build(MemoryBackend::new())?;
    /// let svc = tower::ServiceBuilder::new()
    ///     .layer(DistributedRateLimitLayer::new(rate).http())
    ///     .service(service_fn(|_: http::Request<()>| async {
    ///         Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    ///     }));
    /// let allowed = svc.clone().oneshot(http::Request::new(())).await?;
    /// assert_eq!(allowed.headers()["ratelimit"], "\"pages\";r=0;t=60");
    /// let refused = svc.oneshot(http::Request::new(())).await?;
    /// assert_eq!(refused.status(), 429);
    /// assert_eq!(refused.headers()["x-dlimit-refusal"], "rate-limited");
    /// # Ok(()) }
    /// ```
    pub fn http(self) -> DistributedRateLimitLayer<Http, Key, Cost>
    where
        Flavor: Into<Http>,
    {
        self.map(|s| {
            let mut flavor: Http = s.flavor.into();
            let settings = flavor.settings_mut();
            settings.answer = crate::layer::answer::Answer::Http;
            settings.customized = |refusal| refusal == Refusal::RateLimited;
            Shared {
                limiter: s.limiter,
                key: s.key,
                cost: s.cost,
                flavor,
            }
        })
    }

    /// The gRPC flavor (feature `tonic`): a refused request is answered with the status
    /// `RESOURCE_EXHAUSTED` (a bad key `INVALID_ARGUMENT`, a failing backend `UNAVAILABLE`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_distributed_limit::{DistributedRateLimitLayer, MemoryBackend, RateLimiter};
    ///
    /// let rate = RateLimiter::builder("rpc").rate(100, Duration::from_secs(1)).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedRateLimitLayer::new(rate).grpc();
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "tonic")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
    pub fn grpc(self) -> DistributedRateLimitLayer<Http, Key, Cost>
    where
        Flavor: Into<Http>,
    {
        self.http().map(|mut s| {
            s.flavor.settings_mut().answer = crate::layer::answer::Answer::Grpc;
            s
        })
    }
}

impl<Key: Clone, Cost: Clone> DistributedRateLimitLayer<Http, Key, Cost> {
    /// The body of a 429 answer (default: a one-line explanation).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_distributed_limit::{DistributedRateLimitLayer, MemoryBackend, RateLimiter};
    ///
    /// let rate = RateLimiter::builder("api").rate(10, Duration::from_secs(1)).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedRateLimitLayer::new(rate).http().body("slow down");
    /// # let _ = layer;
    /// ```
    pub fn body(self, body: impl Into<Bytes>) -> Self {
        let body = body.into();
        self.map(|mut s| {
            s.flavor.settings_mut().body = Some(body);
            s
        })
    }

    /// Leaves out the `RateLimit` and `RateLimit-Policy` headers (`Retry-After` stays).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_distributed_limit::{DistributedRateLimitLayer, MemoryBackend, RateLimiter};
    ///
    /// let rate = RateLimiter::builder("api").rate(10, Duration::from_secs(1)).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedRateLimitLayer::new(rate).http().without_ratelimit_headers();
    /// # let _ = layer;
    /// ```
    pub fn without_ratelimit_headers(self) -> Self {
        self.map(|mut s| {
            s.flavor.settings_mut().rate_headers = false;
            s
        })
    }
}

impl<S, Flavor, Key, Cost> Layer<S> for DistributedRateLimitLayer<Flavor, Key, Cost> {
    type Service = DistributedRateLimit<S, Flavor, Key, Cost>;

    fn layer(&self, inner: S) -> Self::Service {
        DistributedRateLimit::new(inner, self.shared.clone())
    }
}
