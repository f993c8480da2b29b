//! The layers: the generic one and its HTTP flavour.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use tower::Layer;

use super::http::HttpSettings;
use super::key::Partitions;
use super::limiter::{Limiter, Source};
use super::refusal::ErrorStyle;
use super::service::{DistributedConcurrencyLimit, HttpConcurrencyLimit};
use crate::Semaphore;

/// Caps how many requests are in flight at once across every process that shares the
/// semaphore: each request holds a [`Permit`](crate::Permit) while the inner service handles it.
///
/// By default a request waits for a permit up to the semaphore's acquire timeout;
/// [`reject_when_full`](Self::reject_when_full) refuses at once instead. Refusals are errors
/// that downcast to [`Error`](crate::Error); [`http`](Self::http) turns them into 503 responses
/// for HTTP servers, and `grpc` (feature `tonic`) into `tonic::Status`es.
/// [`partitioned`](Self::partitioned) gives each key (an API key, a tenant) its own limit.
///
/// # Example
///
/// ```
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, FencingToken, MemoryBackend, Semaphore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
/// // In production: RedisBackend::connect("redis://...").await?, shared by every instance.
/// let sem = Semaphore::builder("llm-api").limit(20).build(MemoryBackend::new())?;
/// let client = ServiceBuilder::new()
///     .layer(DistributedConcurrencyLimitLayer::new(sem))
///     .service(service_fn(|req: http::Request<()>| async move {
///         let token = req.extensions().get::<FencingToken>().copied();
///         Ok::<_, tower::BoxError>(token)
///     }));
/// let token = client.oneshot(http::Request::new(())).await?;
/// assert!(token.is_some());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct DistributedConcurrencyLimitLayer {
    limiter: Limiter,
    errors: ErrorStyle,
}

impl DistributedConcurrencyLimitLayer {
    /// Every request takes one permit of `semaphore`.
    pub fn new(semaphore: Semaphore) -> Self {
        Self::with_source(Source::One(semaphore))
    }

    /// Every request takes one permit of its key's semaphore; see [`Partitions`].
    pub fn partitioned(partitions: Partitions) -> Self {
        Self::with_source(Source::Partitioned(partitions))
    }

    fn with_source(source: Source) -> Self {
        DistributedConcurrencyLimitLayer {
            limiter: Limiter::new(source),
            errors: ErrorStyle::Error,
        }
    }

    /// Refuse a request at once when no permit is free, instead of waiting up to the
    /// semaphore's acquire timeout. The refusal is an [`Error::Timeout`](crate::Error::Timeout)
    /// whose `waited` is the length of the single attempt.
    pub fn reject_when_full(mut self) -> Self {
        self.limiter.wait = false;
        self
    }

    /// Wait up to the semaphore's acquire timeout for a permit (the default).
    pub fn wait_when_full(mut self) -> Self {
        self.limiter.wait = true;
        self
    }

    /// Abort a request whose permit's lease is lost before its response is ready: the inner
    /// future is dropped and the request fails with [`Error::LeaseLost`](crate::Error::LeaseLost)
    /// (answered like a refusal in [`http`](Self::http) mode). Off by default: leases are
    /// renewed while the request runs, so a lease is only lost when Redis cannot be reached
    /// for a whole lease or the process was paused, and the fencing token already protects a
    /// resource that checks it; turn it on when running past a lost lease is worse than
    /// failing. A streaming response body is not cut once its head was sent.
    pub fn abort_when_lease_lost(mut self) -> Self {
        self.limiter.abort_on_lost = true;
        self
    }

    /// Refusals become `tonic::Status`es: `RESOURCE_EXHAUSTED` when no permit came free,
    /// `UNAVAILABLE` when the backend failed, `INVALID_ARGUMENT` for a bad partition key. The
    /// crate's [`Error`](crate::Error) is the status's
    /// [`source`](std::error::Error::source). Use it on a tonic client stack, where tonic looks
    /// for a `Status` in the error and reports anything else as `UNKNOWN`.
    ///
    /// ```
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// let sem = Semaphore::builder("grpc-upstream").limit(8).build(MemoryBackend::new()).unwrap();
    /// let layer = DistributedConcurrencyLimitLayer::new(sem).grpc();
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "tonic")]
    pub fn grpc(mut self) -> Self {
        self.errors = ErrorStyle::Status;
        self
    }

    /// The HTTP flavour: a refused request is answered 503 Service Unavailable with
    /// `Retry-After: 1`, and the permit is held until the response body ends. A failing backend
    /// gets the same answer (fail closed); a missing or invalid partition key gets 400.
    pub fn http(self) -> HttpConcurrencyLimitLayer {
        HttpConcurrencyLimitLayer {
            limiter: self.limiter,
            settings: Arc::new(HttpSettings::default()),
        }
    }
}

impl<S> Layer<S> for DistributedConcurrencyLimitLayer {
    type Service = DistributedConcurrencyLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DistributedConcurrencyLimit::new(inner, self.limiter.clone(), self.errors)
    }
}

/// [`DistributedConcurrencyLimitLayer`] for HTTP servers: refusals are answered with a
/// response, and the permit lives until the response body ends. Made by
/// [`DistributedConcurrencyLimitLayer::http`].
///
/// # Example
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
///             .retry_after(Some(Duration::from_secs(5))),
///     );
/// # let _ = app;
/// ```
#[derive(Debug, Clone)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct HttpConcurrencyLimitLayer {
    limiter: Limiter,
    settings: Arc<HttpSettings>,
}

impl HttpConcurrencyLimitLayer {
    /// The status of a refused request (default 503 Service Unavailable).
    pub fn status(mut self, status: StatusCode) -> Self {
        Arc::make_mut(&mut self.settings).status = status;
        self
    }

    /// The body of a refused request (default: a short plain-text sentence).
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        Arc::make_mut(&mut self.settings).body = body.into();
        self
    }

    /// The `Retry-After` of a refused request, in whole seconds rounded up (default 1 s);
    /// `None` sends none.
    pub fn retry_after(mut self, after: Option<Duration>) -> Self {
        Arc::make_mut(&mut self.settings).retry_after = after;
        self
    }

    /// Release the permit as soon as the response head is ready instead of when its body ends.
    /// Right when the body is cheap to produce and a slow client should not hold a slot.
    pub fn release_at_head(mut self) -> Self {
        Arc::make_mut(&mut self.settings).hold_until_body_end = false;
        self
    }
}

impl<S> Layer<S> for HttpConcurrencyLimitLayer {
    type Service = HttpConcurrencyLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        HttpConcurrencyLimit::new(inner, self.limiter.clone(), self.settings.clone())
    }
}
