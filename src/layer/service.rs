//! The service the layer builds, one per flavor: pick the semaphore (or take the permit
//! reserved in `poll_ready`), move the ready inner service into the future.

use std::task::{Context, Poll, ready};

use http::{Request, Response};
use tower::{BoxError, Service};

use super::acquire::AcquirePermit;
use super::admit::{Admit, sealed::Private};
use super::flavor::{Http, Plain};
use super::future::{HttpResponseFuture, Limited, ResponseFuture, Stamp, extension, unstamped};
use super::gatekeeper::Gatekeeper;
use super::reserve::Reservation;
use super::spares::Spares;
use crate::{Priority, Semaphore};

/// A service whose requests each hold permits of a distributed semaphore while the inner
/// service handles them; made by [`DistributedConcurrencyLimitLayer`](super::DistributedConcurrencyLimitLayer).
///
/// The type parameters are the layer's: the `Flavor` ([`Plain`] or [`Http`]) and the
/// `Admission` ([`Admit`]: a [`Semaphore`], [`Partitions`](super::Partitions), ...).
///
/// In the generic flavor, refusals are [`BoxError`]s that downcast to
/// [`Error`](crate::Error): [`Error::Full`](crate::Error::Full) when the layer does not wait,
/// [`Error::Timeout`](crate::Error::Timeout) when a wait ran out,
/// [`Error::Backend`](crate::Error::Backend) when the backend failed,
/// [`Error::BadKey`](crate::Error::BadKey) for a missing or invalid partition key,
/// [`Error::Config`](crate::Error::Config) for a weight of 0 or above the limit.
///
/// # Examples
///
/// ```
/// use tower::{Service, ServiceExt, service_fn};
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Error, MemoryBackend, Semaphore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
/// let sem = Semaphore::builder("api").limit(1).build(MemoryBackend::new())?;
/// let mut svc = tower::ServiceBuilder::new()
///     .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).reject_when_full())
///     .service(service_fn(|_job: u32| async { Ok::<_, tower::BoxError>("done") }));
///
/// let _held = sem.acquire().await?; // someone else holds the only permit
/// let err = svc.ready().await?.call(7).await.unwrap_err();
/// assert!(matches!(err.downcast_ref::<Error>(), Some(Error::Full)));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct DistributedConcurrencyLimit<S, Flavor = Plain, Admission = Semaphore> {
    inner: S,
    gatekeeper: Gatekeeper<Admission>,
    flavor: Flavor,
    reservation: Reservation,
}

/// The HTTP flavor of [`DistributedConcurrencyLimit`]: a refused request is answered by the
/// service itself (503 and `Retry-After` by default, a gRPC status for `grpc`) and the permit
/// is held until the response body ends; made by
/// [`HttpConcurrencyLimitLayer`](super::HttpConcurrencyLimitLayer).
///
/// The inner service's errors pass through unchanged, so an axum `Router` keeps its
/// `Infallible` error and needs no `HandleErrorLayer`.
///
/// # Examples
///
/// ```
/// use tower::{Service, ServiceExt, service_fn};
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
/// let sem = Semaphore::builder("pages").limit(1).build(MemoryBackend::new())?;
/// let mut svc = tower::ServiceBuilder::new()
///     .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).http().reject_when_full())
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
pub type HttpConcurrencyLimit<S, Admission = Semaphore> =
    DistributedConcurrencyLimit<S, Http, Admission>;

impl<S, Flavor, Admission> DistributedConcurrencyLimit<S, Flavor, Admission> {
    pub(crate) fn new(inner: S, gatekeeper: Gatekeeper<Admission>, flavor: Flavor) -> Self {
        DistributedConcurrencyLimit {
            inner,
            gatekeeper,
            flavor,
            reservation: Reservation::default(),
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

    /// Unwraps the inner service (a permit reserved in `poll_ready` is released).
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// Reserves the permit first when the layer does so, then forwards to the inner service.
    /// Otherwise no permit is taken here; see the [module docs](super).
    fn poll_ready_with<R>(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>>
    where
        S: Service<R>,
        Admission: Admit<R>,
    {
        let gatekeeper = &self.gatekeeper;
        if let Some(reserve) = gatekeeper.admit.reserves(Private) {
            let rate = gatekeeper.rate_for(Priority::NORMAL);
            // No spares with a rate limit: a spare would spend rate for a request that may
            // never come.
            let none = Spares::default();
            let spares = if rate.is_none() {
                &reserve.spares
            } else {
                &none
            };
            ready!(self.reservation.poll_reserve(
                &reserve.semaphore,
                spares,
                gatekeeper.wait,
                rate.as_ref(),
                cx
            ));
        }
        self.inner.poll_ready(cx)
    }

    /// Admits the request and moves the ready inner service into the future, leaving a
    /// fresh clone behind for the next `poll_ready` (tower's `AsyncFilter` pattern).
    fn start<R>(&mut self, request: R, stamp: Stamp<R>) -> Limited<S, R, AcquirePermit>
    where
        S: Service<R> + Clone,
        Admission: Admit<R>,
    {
        let gate = self.gatekeeper.admit(&request, self.reservation.take());
        let fresh = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, fresh);
        Limited::new(gate, ready, request, self.gatekeeper.abort_on_lost, stamp)
    }
}

impl<S, R, Admission> Service<R> for DistributedConcurrencyLimit<S, Plain, Admission>
where
    S: Service<R> + Clone,
    S::Error: Into<BoxError>,
    Admission: Admit<R>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S, R>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.poll_ready_with(cx).map_err(Into::into)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let overloaded = self.gatekeeper.overloaded;
        ResponseFuture::new(self.start(request, unstamped), overloaded)
    }
}

impl<S, B, ResBody, Admission> Service<Request<B>>
    for DistributedConcurrencyLimit<S, Http, Admission>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    ResBody: http_body::Body,
    ResBody::Data: From<bytes::Bytes>,
    Admission: Admit<Request<B>>,
{
    type Response = Response<super::body::ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = HttpResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.poll_ready_with(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let settings = self.flavor.settings.clone();
        HttpResponseFuture::new(self.start(request, extension), settings)
    }
}
