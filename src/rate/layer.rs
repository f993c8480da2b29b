//! The rate-limit layer: one GCRA check per request before the inner service sees it, for any
//! request type; refusals as errors (generic), 429 (HTTP) or `RESOURCE_EXHAUSTED` (gRPC).

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{Request, Response};
use tower::{BoxError, Layer, Service};

use super::limiter::RateLimiter;
use crate::Error;
use crate::backend::RateDecision;
use crate::layer::body::ResponseBody;
use crate::layer::http::{Refusal, retry_after_secs};
use crate::layer::{PartitionKey, Plain, Unweighted, Weigh};
use crate::sync::BoxFuture;

/// `RateLimit`, from the IETF httpapi ratelimit-headers draft.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `RateLimit-Policy`, from the IETF httpapi ratelimit-headers draft.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// Caps how many requests *start* per period across every process that shares the
/// [`RateLimiter`]: each request is one GCRA check (one script call) before the inner service
/// sees it. It wraps a service of any request type.
///
/// Flavours, as for [`DistributedConcurrencyLimitLayer`](crate::DistributedConcurrencyLimitLayer):
/// generic ([`Plain`], the default: a refusal is a [`BoxError`] that downcasts to
/// [`Error::RateLimited`]), [`http`](Self::http) (429 Too Many Requests with `Retry-After` and
/// the IETF `RateLimit` / `RateLimit-Policy` headers, also on allowed responses), and `grpc`
/// (feature `tonic`: `RESOURCE_EXHAUSTED`). [`weight_by`](Self::weight_by) sets a request's
/// cost; [`key_by`](Self::key_by) / [`key_header`](Self::key_header) give each key its own
/// rate (nothing is kept per key in this process).
///
/// A failing backend is decided by the limiter's [`OutagePolicy`](crate::OutagePolicy); when
/// it refuses, the generic flavour fails with [`Error::Backend`] and the HTTP one answers 503.
///
/// To cap both how many start and how many run at once, prefer
/// [`DistributedConcurrencyLimitLayer::rate_limit`](crate::DistributedConcurrencyLimitLayer::rate_limit):
/// all or nothing, and one script call for both on one Redis. Stacked in front of the
/// concurrency layer, this layer spends the rate of requests the concurrency limit then refuses.
///
/// # Example
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
#[derive(Debug, Clone)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct DistributedRateLimitLayer<F = Plain, K = Unkeyed, W = Unweighted> {
    shared: Arc<Shared<F, K, W>>,
}

#[derive(Debug)]
struct Shared<F, K, W> {
    limiter: RateLimiter,
    key: K,
    weigh: W,
    flavour: F,
}

/// Every request counts against the limiter itself (no partition key).
#[derive(Debug, Clone, Copy, Default)]
pub struct Unkeyed;

impl<R> PartitionKey<R> for Unkeyed {
    fn key(&self, _: &R) -> Option<String> {
        None
    }
}

/// A partition key read from a request header; see
/// [`DistributedRateLimitLayer::key_header`]. A request without it counts against the
/// limiter itself.
#[derive(Debug, Clone)]
pub struct RateHeaderKey(HeaderName);

impl<B> PartitionKey<Request<B>> for RateHeaderKey {
    fn key(&self, request: &Request<B>) -> Option<String> {
        Some(request.headers().get(&self.0)?.to_str().ok()?.to_owned())
    }
}

/// The HTTP flavour of the rate layer, made by [`DistributedRateLimitLayer::http`] (or `grpc`).
#[derive(Debug, Clone)]
pub struct RateHttp {
    grpc: bool,
    body: Bytes,
    headers: bool,
}

impl DistributedRateLimitLayer {
    /// Every request spends 1 of `limiter`.
    pub fn new(limiter: RateLimiter) -> Self {
        DistributedRateLimitLayer {
            shared: Arc::new(Shared {
                limiter,
                key: Unkeyed,
                weigh: Unweighted,
                flavour: Plain,
            }),
        }
    }
}

impl<F: Clone, K: Clone, W: Clone> DistributedRateLimitLayer<F, K, W> {
    fn map<F2, K2, W2>(
        self,
        f: impl FnOnce(Shared<F, K, W>) -> Shared<F2, K2, W2>,
    ) -> DistributedRateLimitLayer<F2, K2, W2> {
        let shared = Arc::try_unwrap(self.shared).unwrap_or_else(|shared| Shared {
            limiter: shared.limiter.clone(),
            key: shared.key.clone(),
            weigh: shared.weigh.clone(),
            flavour: shared.flavour.clone(),
        });
        DistributedRateLimitLayer {
            shared: Arc::new(f(shared)),
        }
    }

    /// A request's cost: how much of the rate it spends (1 ..= the burst; a cost of 0 or above
    /// the burst is refused with [`Error::Config`], 500 in the HTTP flavour).
    pub fn weight_by<R, W2>(self, weigh: W2) -> DistributedRateLimitLayer<F, K, W2>
    where
        W2: Weigh<R>,
    {
        self.map(|s| Shared {
            limiter: s.limiter,
            key: s.key,
            weigh,
            flavour: s.flavour,
        })
    }

    /// Each key (a tenant, an API key) gets the limiter's rate and burst of its own; a request
    /// whose key is `None` counts against the limiter itself. An empty key or one over 256
    /// bytes is refused with [`Error::BadKey`] (400 in the HTTP flavour).
    pub fn key_by<R, K2>(self, key: K2) -> DistributedRateLimitLayer<F, K2, W>
    where
        K2: Fn(&R) -> Option<String>,
    {
        self.map(|s| Shared {
            limiter: s.limiter,
            key,
            weigh: s.weigh,
            flavour: s.flavour,
        })
    }

    /// Each value of the request header `name` gets a rate of its own (see
    /// [`key_by`](Self::key_by)).
    pub fn key_header(self, name: HeaderName) -> DistributedRateLimitLayer<F, RateHeaderKey, W> {
        self.map(|s| Shared {
            limiter: s.limiter,
            key: RateHeaderKey(name),
            weigh: s.weigh,
            flavour: s.flavour,
        })
    }

    /// The HTTP flavour: a refused request is answered 429 Too Many Requests with
    /// `Retry-After` (whole seconds, rounded up) and `RateLimit` / `RateLimit-Policy`
    /// headers; allowed responses carry the two `RateLimit` headers too.
    pub fn http(self) -> DistributedRateLimitLayer<RateHttp, K, W> {
        self.with_flavour(RateHttp {
            grpc: false,
            body: Bytes::from_static(Refusal::RateLimited.sentence().as_bytes()),
            headers: true,
        })
    }

    /// The gRPC flavour (feature `tonic`): a refused request is answered with the status
    /// `RESOURCE_EXHAUSTED` (a bad key `INVALID_ARGUMENT`, a failing backend `UNAVAILABLE`).
    #[cfg(feature = "tonic")]
    pub fn grpc(self) -> DistributedRateLimitLayer<RateHttp, K, W> {
        self.with_flavour(RateHttp {
            grpc: true,
            body: Bytes::new(),
            headers: true,
        })
    }

    fn with_flavour(self, flavour: RateHttp) -> DistributedRateLimitLayer<RateHttp, K, W> {
        self.map(|s| Shared {
            limiter: s.limiter,
            key: s.key,
            weigh: s.weigh,
            flavour,
        })
    }
}

impl<K: Clone, W: Clone> DistributedRateLimitLayer<RateHttp, K, W> {
    /// The body of a 429 answer (default: a one-line explanation).
    pub fn body(self, body: impl Into<Bytes>) -> Self {
        let body = body.into();
        self.map(|mut s| {
            s.flavour.body = body;
            s
        })
    }

    /// Leaves out the `RateLimit` and `RateLimit-Policy` headers (`Retry-After` stays).
    pub fn without_ratelimit_headers(self) -> Self {
        self.map(|mut s| {
            s.flavour.headers = false;
            s
        })
    }
}

impl<S, F, K, W> Layer<S> for DistributedRateLimitLayer<F, K, W> {
    type Service = DistributedRateLimit<S, F, K, W>;

    fn layer(&self, inner: S) -> Self::Service {
        DistributedRateLimit {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service made by [`DistributedRateLimitLayer`]: one rate check per request, then the
/// inner service (the ready one, moved into the response future, as tower's `AsyncFilter`
/// does).
#[derive(Debug)]
pub struct DistributedRateLimit<S, F = Plain, K = Unkeyed, W = Unweighted> {
    inner: S,
    shared: Arc<Shared<F, K, W>>,
}

impl<S: Clone, F, K, W> Clone for DistributedRateLimit<S, F, K, W> {
    fn clone(&self) -> Self {
        DistributedRateLimit {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S, F, K, W> DistributedRateLimit<S, F, K, W> {
    /// The request's key and cost, and the ready inner service (a clone takes its place).
    fn take<R>(&mut self, request: &R) -> (Option<String>, u32, S)
    where
        S: Clone,
        K: PartitionKey<R>,
        W: Weigh<R>,
    {
        let key = self.shared.key.key(request);
        let cost = self.shared.weigh.weigh(request);
        let clone = self.inner.clone();
        (key, cost, std::mem::replace(&mut self.inner, clone))
    }
}

/// One check against the limiter, or the key's partition.
async fn check(
    limiter: &RateLimiter,
    key: Option<String>,
    cost: u32,
) -> Result<RateDecision, Error> {
    match key {
        None => limiter.check_n(cost).await,
        Some(key) => limiter.check_key(&key, cost).await,
    }
}

impl<S, R, K, W> Service<R> for DistributedRateLimit<S, Plain, K, W>
where
    S: Service<R> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    R: Send + 'static,
    K: PartitionKey<R> + Send + Sync + 'static,
    W: Weigh<R> + Send + Sync + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<S::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let (key, cost, mut inner) = self.take(&request);
        let limiter = self.shared.limiter.clone();
        Box::pin(async move {
            let decision = check(&limiter, key, cost).await?;
            if !decision.allowed {
                let retry_after = decision.retry_after.unwrap_or_default();
                tracing::debug!(
                    limiter = limiter.name(),
                    ?retry_after,
                    "request refused: rate limit"
                );
                return Err(Error::RateLimited { retry_after }.into());
            }
            inner.call(request).await.map_err(Into::into)
        })
    }
}

impl<S, B, RB, K, W> Service<Request<B>> for DistributedRateLimit<S, RateHttp, K, W>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    B: Send + 'static,
    RB: Send + 'static,
    K: PartitionKey<Request<B>> + Send + Sync + 'static,
    W: Weigh<Request<B>> + Send + Sync + 'static,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let (key, cost, mut inner) = self.take(&request);
        let shared = self.shared.clone();
        Box::pin(async move {
            let limiter = &shared.limiter;
            let flavour = &shared.flavour;
            let decision = match check(limiter, key, cost).await {
                Ok(decision) => decision,
                Err(error) => return Ok(flavour.refuse(limiter, error, None)),
            };
            if !decision.allowed {
                let retry_after = decision.retry_after.unwrap_or_default();
                tracing::debug!(
                    limiter = limiter.name(),
                    ?retry_after,
                    "request refused: rate limit"
                );
                return Ok(flavour.refuse(
                    limiter,
                    Error::RateLimited { retry_after },
                    Some(&decision),
                ));
            }
            let mut response = inner
                .call(request)
                .await?
                .map(|body| ResponseBody::new(body, None));
            if flavour.headers && !flavour.grpc {
                insert_headers(response.headers_mut(), limiter, &decision);
            }
            Ok(response)
        })
    }
}

impl RateHttp {
    fn refuse<B>(
        &self,
        limiter: &RateLimiter,
        error: Error,
        decision: Option<&RateDecision>,
    ) -> Response<ResponseBody<B>> {
        if let Error::Backend(_) = &error {
            tracing::warn!(%error, "request refused: the rate limiter's backend failed (fail closed)");
        }
        let refusal = Refusal::of(&error);
        #[cfg(feature = "tonic")]
        if self.grpc {
            return crate::layer::grpc::response(&error).map(ResponseBody::refusal);
        }
        // The configured body is the 429's; an outage is worth a retry a second later.
        let body = (refusal == Refusal::RateLimited).then(|| self.body.clone());
        let mut response = refusal
            .answer(&error, None, body, Some(Duration::from_secs(1)))
            .map(ResponseBody::refusal);
        let headers = response.headers_mut();
        if let Some(decision) = decision.filter(|_| self.headers) {
            insert_headers(headers, limiter, decision);
        }
        response
    }
}

/// `RateLimit-Policy: "<name>";q=<quota>;w=<window s>` and
/// `RateLimit: "<name>";r=<remaining>;t=<s until retry, or until full again>`.
fn insert_headers(headers: &mut http::HeaderMap, limiter: &RateLimiter, decision: &RateDecision) {
    let name = policy_name(limiter.name());
    let (quota, window) = quota_window(limiter.rate(), limiter.period());
    let t = retry_after_secs(decision.retry_after.unwrap_or(decision.reset_after));
    let policy = format!("\"{name}\";q={quota};w={window}");
    let state = format!("\"{name}\";r={};t={t}", decision.remaining);
    if let (Ok(policy), Ok(state)) = (HeaderValue::try_from(policy), HeaderValue::try_from(state)) {
        headers.insert(RATELIMIT_POLICY, policy);
        headers.insert(RATELIMIT, state);
    }
}

/// The name as a structured-field string: printable ASCII, `"` and `\` escaped; anything else
/// becomes `_`.
fn policy_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out
}

/// The quota per window in whole seconds, as the draft's `q` and `w`: the rate as is when the
/// period is whole seconds, else the rate per second (rounded down, at least 1) with `w=1`.
fn quota_window(rate: u32, period: Duration) -> (u64, u64) {
    if period.subsec_nanos() == 0 && period.as_secs() > 0 {
        return (u64::from(rate), period.as_secs());
    }
    let per_second = (u128::from(rate) * 1_000_000_000 / period.as_nanos().max(1)).max(1);
    (u64::try_from(per_second).unwrap_or(u64::MAX), 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quota_and_window() {
        assert_eq!(quota_window(100, Duration::from_secs(1)), (100, 1));
        assert_eq!(quota_window(60, Duration::from_secs(60)), (60, 60));
        assert_eq!(quota_window(5, Duration::from_millis(200)), (25, 1));
        assert_eq!(quota_window(1, Duration::from_secs(90) / 60), (1, 1));
    }

    #[test]
    fn names_are_escaped() {
        assert_eq!(policy_name("a\"b\\c é"), "a\\\"b\\\\c _");
    }
}
