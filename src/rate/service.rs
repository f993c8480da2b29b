//! The service the rate layer builds: one rate check per request, then the inner service
//! (the ready one, moved into the response future, as tower's `AsyncFilter` does).

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::{BoxError, Service};

use super::check::CheckRate;
use super::limiter::RateLimiter;
use crate::layer::future::{HttpResponseFuture, Limited, ResponseFuture, Stamp, unstamped};
use crate::layer::gatekeeper::NO_SIGNAL;
use crate::layer::{Http, PartitionKey, Plain, Unkeyed, Unweighted, Weigh};

/// What a layer and its services share: the limiter, where a request's key comes from, what
/// it costs, and the flavor.
#[derive(Debug, Clone)]
pub(super) struct Shared<Flavor, Key, Cost> {
    pub(super) limiter: RateLimiter,
    pub(super) key: Key,
    pub(super) cost: Cost,
    pub(super) flavor: Flavor,
}

/// The service made by [`DistributedRateLimitLayer`](super::DistributedRateLimitLayer): one
/// rate check per request, then the inner service.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower::{Layer, Service, ServiceExt, service_fn};
/// use tower_distributed_limit::{DistributedRateLimitLayer, MemoryBackend, RateLimiter};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
/// let rate = RateLimiter::builder("jobs").rate(5, Duration::from_secs(1)).build(MemoryBackend::new())?;
/// let mut svc = DistributedRateLimitLayer::new(rate)
///     .layer(service_fn(|job: u32| async move { Ok::<_, tower::BoxError>(job) }));
/// assert_eq!(svc.ready().await?.call(7).await?, 7);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct DistributedRateLimit<S, Flavor = Plain, Key = Unkeyed, Cost = Unweighted> {
    inner: S,
    shared: Arc<Shared<Flavor, Key, Cost>>,
}

impl<S: Clone, Flavor, Key, Cost> Clone for DistributedRateLimit<S, Flavor, Key, Cost> {
    fn clone(&self) -> Self {
        DistributedRateLimit {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S, Flavor, Key, Cost> DistributedRateLimit<S, Flavor, Key, Cost> {
    pub(super) fn new(inner: S, shared: Arc<Shared<Flavor, Key, Cost>>) -> Self {
        DistributedRateLimit { inner, shared }
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

    /// Starts the request's check (against the limiter, or its key's partition) and moves the
    /// ready inner service into the future, leaving a clone behind.
    fn start<R>(&mut self, request: R, stamp: Stamp<R>) -> Limited<S, R, CheckRate>
    where
        S: Service<R> + Clone,
        Key: PartitionKey<R>,
        Cost: Weigh<R>,
    {
        let key = self.shared.key.key(&request);
        let cost = self.shared.cost.weigh(&request);
        let limiter = self.shared.limiter.clone();
        let check = Box::pin(async move {
            let decision = match key {
                None => limiter.check_n(cost).await,
                Some(key) => limiter.check_key(&key, cost).await,
            };
            (limiter, decision)
        });
        let gate = CheckRate::new(check);
        let fresh = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, fresh);
        Limited::new(gate, ready, request, false, stamp)
    }
}

impl<S, R, Key, Cost> Service<R> for DistributedRateLimit<S, Plain, Key, Cost>
where
    S: Service<R> + Clone,
    S::Error: Into<BoxError>,
    Key: PartitionKey<R>,
    Cost: Weigh<R>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S, R, CheckRate>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: R) -> Self::Future {
        ResponseFuture::new(self.start(request, unstamped), NO_SIGNAL)
    }
}

impl<S, B, ResBody, Key, Cost> Service<Request<B>> for DistributedRateLimit<S, Http, Key, Cost>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    ResBody: http_body::Body,
    ResBody::Data: From<bytes::Bytes>,
    Key: PartitionKey<Request<B>>,
    Cost: Weigh<Request<B>>,
{
    type Response = Response<crate::layer::body::ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = HttpResponseFuture<S, B, CheckRate>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let settings = self.shared.flavor.settings.clone();
        HttpResponseFuture::new(self.start(request, unstamped), settings)
    }
}
