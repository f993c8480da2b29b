//! How the HTTP flavour of both layers answers a refused request: one kind of [`Refusal`] per
//! error, each with its own status, sentence and `x-dlimit-refusal`, in HTTP or gRPC.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use super::body::ResponseBody;
use super::refused::{Policy, Refused};
use super::headers::{REFUSAL_HEADER, insert_concurrency_policy, insert_rate, retry_after_secs};
use crate::Error;

/// The hook's shape: the answer to a refusal, or `None` for the default one.
pub(crate) type OnRefusalFn = dyn Fn(&Error) -> Option<Response<Bytes>> + Send + Sync;

/// The hook set with `on_refusal`.
#[derive(Clone)]
pub(crate) struct OnRefusal(pub(crate) Arc<OnRefusalFn>);

impl std::fmt::Debug for OnRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnRefusal(..)")
    }
}

/// How refusals are answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// An HTTP response: the status, body and headers below.
    Http,
    /// A gRPC trailers-only response (HTTP 200 with `grpc-status`).
    #[cfg(feature = "tonic")]
    Grpc,
}

/// The settings of the HTTP flavour, for both layers; see
/// [`HttpConcurrencyLimitLayer`](super::HttpConcurrencyLimitLayer) and
/// [`DistributedRateLimitLayer::http`](crate::DistributedRateLimitLayer::http).
#[derive(Debug, Clone)]
pub struct HttpSettings {
    pub(crate) answer: Answer,
    /// The refusals `status` and `body` replace the answer of: no permit (full, timeout, too
    /// many waiters) for the concurrency layer, the rate limit for the rate layer.
    pub(crate) customized: fn(Refusal) -> bool,
    /// The status of a customized answer.
    pub(crate) status: Option<StatusCode>,
    /// The body of a customized answer; `None`: each kind's own sentence.
    pub(crate) body: Option<Bytes>,
    /// The `Retry-After` of the layer's own 503 answers.
    pub(crate) retry_after: Option<Duration>,
    pub(crate) hold_until_body_end: bool,
    /// Send the concurrency `RateLimit-Policy` on refusals.
    pub(crate) policy_header: bool,
    /// Send the rate limit's `RateLimit` and `RateLimit-Policy` (on refusals and on allowed
    /// HTTP responses).
    pub(crate) rate_headers: bool,
    pub(crate) on_refusal: Option<OnRefusal>,
}

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings {
            answer: Answer::Http,
            customized: Refusal::no_permit,
            status: None,
            body: None,
            retry_after: Some(Duration::from_secs(1)),
            hold_until_body_end: true,
            policy_header: false,
            rate_headers: true,
            on_refusal: None,
        }
    }
}

/// The kinds of refusal, one per answer: what a client is told, in both layers and every
/// flavour. The sentences are for clients: short, neutral, no advice to operators (that goes
/// to the log, with the error itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    Full,
    Timeout,
    TooManyWaiters,
    Outage,
    RateLimited,
    BadKey,
    LeaseLost,
    Config,
}

impl Refusal {
    pub(crate) fn of(error: &Error) -> Self {
        match error {
            Error::Full => Refusal::Full,
            Error::Timeout { .. } => Refusal::Timeout,
            Error::TooManyWaiters { .. } => Refusal::TooManyWaiters,
            Error::Backend(_) => Refusal::Outage,
            Error::RateLimited { .. } => Refusal::RateLimited,
            Error::BadKey(_) => Refusal::BadKey,
            Error::LeaseLost => Refusal::LeaseLost,
            Error::Config(_) => Refusal::Config,
        }
    }

    /// The value of `x-dlimit-refusal`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Refusal::Full => "full",
            Refusal::Timeout => "timeout",
            Refusal::TooManyWaiters => "too-many-waiters",
            Refusal::Outage => "outage",
            Refusal::RateLimited => "rate-limited",
            Refusal::BadKey => "bad-key",
            Refusal::LeaseLost => "lease-lost",
            Refusal::Config => "config",
        }
    }

    /// What the client is told: the body of an HTTP answer, the message of a gRPC one.
    pub(crate) fn sentence(self) -> &'static str {
        match self {
            Refusal::Full => "the service is at its concurrency limit; retry later\n",
            Refusal::Timeout => "no slot became free in time; retry later\n",
            Refusal::TooManyWaiters => "too many requests are waiting; retry later\n",
            Refusal::Outage => "the limit's backend is unavailable; retry later\n",
            Refusal::RateLimited => "the rate limit was reached; retry later\n",
            Refusal::BadKey => "the request's partition key is missing or invalid\n",
            Refusal::LeaseLost => "the request was interrupted; retry later\n",
            Refusal::Config => "the service cannot admit this request\n",
        }
    }

    /// No permit was free: the concurrency layer's answer that `status` and `body` configure.
    pub(crate) fn no_permit(self) -> bool {
        matches!(
            self,
            Refusal::Full | Refusal::Timeout | Refusal::TooManyWaiters
        )
    }

    /// The default status of an HTTP answer.
    fn status(self) -> StatusCode {
        match self {
            Refusal::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            Refusal::BadKey => StatusCode::BAD_REQUEST,
            Refusal::Config => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// `Retry-After`: the rate limit's own time; `hint` for what retrying later cures; none
    /// where retrying the same request does not help.
    fn retry_after(self, error: &Error, hint: Option<Duration>) -> Option<Duration> {
        match (self, error) {
            (_, Error::RateLimited { retry_after }) => Some(*retry_after),
            (Refusal::BadKey | Refusal::Config, _) => None,
            _ => hint,
        }
    }

    /// The plain-text answer, with `x-dlimit-refusal`: `status` and `body` replace the
    /// default ones when given.
    pub(crate) fn answer(
        self,
        error: &Error,
        status: Option<StatusCode>,
        body: Option<Bytes>,
        retry_hint: Option<Duration>,
    ) -> Response<Bytes> {
        let body = body.unwrap_or_else(|| Bytes::from_static(self.sentence().as_bytes()));
        let mut response = Response::new(body);
        *response.status_mut() = status.unwrap_or_else(|| self.status());
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        headers.insert(REFUSAL_HEADER, HeaderValue::from_static(self.name()));
        if let Some(after) = self.retry_after(error, retry_hint) {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        response
    }
}

impl HttpSettings {
    /// The answer to a refused request, with the `RateLimit` headers its policy asks for.
    pub(crate) fn reject<B>(&self, refused: Refused) -> Response<ResponseBody<B>> {
        let Refused { error, policy } = refused;
        log(&error);
        let hooked = self.on_refusal.as_ref().and_then(|hook| (hook.0)(&error));
        let mut response = match (hooked, self.answer) {
            (Some(response), _) => response,
            (None, Answer::Http) => self.http(&error),
            #[cfg(feature = "tonic")]
            (None, Answer::Grpc) => super::grpc::response(&error),
        }
        .map(ResponseBody::refusal);
        let headers = response.headers_mut();
        match policy {
            Policy::Concurrency(limit) if self.policy_header => {
                insert_concurrency_policy(headers, limit)
            }
            Policy::Rate(limiter, decision) if self.rate_headers && self.answer == Answer::Http => {
                insert_rate(headers, &limiter, &decision)
            }
            _ => {}
        }
        response
    }

    /// Each kind of refusal gets its own answer; `status` and `body` replace those of the
    /// customized ones, `retry_after` is the hint of every 503.
    fn http(&self, error: &Error) -> Response<Bytes> {
        let refusal = Refusal::of(error);
        let customized = (self.customized)(refusal);
        refusal.answer(
            error,
            self.status.filter(|_| customized),
            self.body.clone().filter(|_| customized),
            self.retry_after,
        )
    }
}

fn log(error: &Error) {
    match error {
        Error::Backend(_) => {
            tracing::warn!(%error, "request refused: the limit's backend failed (fail closed)")
        }
        Error::BadKey(_) => tracing::debug!(%error, "request refused: bad partition key"),
        _ => tracing::debug!(%error, "request refused: no permit"),
    }
}
