//! The services the layer builds.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::{BoxError, Service};

use super::future::{HttpResponseFuture, Limited, ResponseFuture};
use super::http::HttpSettings;
use super::limiter::Limiter;
use super::refusal::ErrorStyle;

/// Picks the request's semaphore and moves the ready inner service into the future, leaving a
/// fresh clone behind for the next `poll_ready` (tower's `AsyncFilter` pattern).
fn start<S, B>(limiter: &Limiter, inner: &mut S, request: Request<B>) -> Limited<S, B>
where
    S: Service<Request<B>> + Clone,
{
    let (parts, body) = request.into_parts();
    let acquire = limiter.acquire(&parts);
    let request = Request::from_parts(parts, body);
    let fresh = inner.clone();
    let ready = std::mem::replace(inner, fresh);
    Limited::new(acquire, ready, request, limiter.abort_on_lost)
}

/// A service whose requests each hold a permit of a distributed semaphore while the inner
/// service handles them; made by [`DistributedConcurrencyLimitLayer`](super::DistributedConcurrencyLimitLayer).
///
/// Refusals are [`BoxError`]s that downcast to [`Error`](crate::Error): [`Error::Timeout`](crate::Error::Timeout)
/// when no permit came free, [`Error::Backend`](crate::Error::Backend) when the backend failed,
/// [`Error::Config`](crate::Error::Config) for a missing or invalid partition key.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower::{Service, ServiceExt, service_fn};
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Error, MemoryBackend, Semaphore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
/// let sem = Semaphore::builder("api").limit(1).build(MemoryBackend::new())?;
/// let mut svc = tower::ServiceBuilder::new()
///     .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).reject_when_full())
///     .service(service_fn(|_req: http::Request<()>| async { Ok::<_, tower::BoxError>("done") }));
///
/// let _held = sem.acquire().await?; // someone else holds the only permit
/// let err = svc.ready().await?.call(http::Request::new(())).await.unwrap_err();
/// assert!(matches!(err.downcast_ref::<Error>(), Some(Error::Timeout { .. })));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct DistributedConcurrencyLimit<S> {
    inner: S,
    limiter: Limiter,
    errors: ErrorStyle,
}

impl<S> DistributedConcurrencyLimit<S> {
    pub(crate) fn new(inner: S, limiter: Limiter, errors: ErrorStyle) -> Self {
        DistributedConcurrencyLimit {
            inner,
            limiter,
            errors,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B> Service<Request<B>> for DistributedConcurrencyLimit<S>
where
    S: Service<Request<B>> + Clone,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // No permit is reserved here; see the module docs.
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        ResponseFuture::new(start(&self.limiter, &mut self.inner, request), self.errors)
    }
}

/// The HTTP flavour: a refused request is answered by the service itself (503 and
/// `Retry-After` by default) and the permit is held until the response body ends; made by
/// [`HttpConcurrencyLimitLayer`](super::HttpConcurrencyLimitLayer).
///
/// The inner service's errors pass through unchanged, so an axum `Router` keeps its
/// `Infallible` error and needs no `HandleErrorLayer`.
///
/// # Example
///
/// ```
/// use tower::{Service, ServiceExt, service_fn};
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
/// let sem = Semaphore::builder("pages").limit(1).build(MemoryBackend::new())?;
/// let mut svc = tower::ServiceBuilder::new()
///     .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).reject_when_full().http())
///     .service(service_fn(|_req: http::Request<String>| async {
///         Ok::<_, std::convert::Infallible>(http::Response::new(String::from("hello")))
///     }));
///
/// let _held = sem.acquire().await?;
/// let response = svc.ready().await?.call(http::Request::new(String::new())).await?;
/// assert_eq!(response.status(), http::StatusCode::SERVICE_UNAVAILABLE);
/// assert_eq!(response.headers()["retry-after"], "1");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct HttpConcurrencyLimit<S> {
    inner: S,
    limiter: Limiter,
    settings: Arc<HttpSettings>,
}

impl<S> HttpConcurrencyLimit<S> {
    pub(crate) fn new(inner: S, limiter: Limiter, settings: Arc<HttpSettings>) -> Self {
        HttpConcurrencyLimit {
            inner,
            limiter,
            settings,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, ResBody> Service<Request<B>> for HttpConcurrencyLimit<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    ResBody: http_body::Body,
    ResBody::Data: From<bytes::Bytes>,
{
    type Response = Response<super::body::ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = HttpResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // No permit is reserved here; see the module docs.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        HttpResponseFuture::new(
            start(&self.limiter, &mut self.inner, request),
            self.settings.clone(),
        )
    }
}
