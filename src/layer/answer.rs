//! How the HTTP flavor of both layers answers a refused request: one kind of [`Refusal`] per
//! error, each with its own status, sentence and `x-dlimit-refusal`, in HTTP or gRPC.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};

use super::body::ResponseBody;
use super::headers::{CLASS_HEADER, insert_concurrency_policy, insert_rate};
use super::refusal::{Asked, Refusal, Refused, RefusedBy};
use crate::{Error, Priority};

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

/// The settings of the HTTP flavor, for both layers; see
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
    /// Which answers of the inner service are congestion signals for an adaptive limit.
    pub(crate) overloaded: fn(StatusCode) -> bool,
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
            overloaded: server_error,
        }
    }
}

/// A 5xx answer: the default congestion signal of the HTTP flavor.
fn server_error(status: StatusCode) -> bool {
    status.is_server_error()
}

impl HttpSettings {
    /// The answer to a refused request, with the `RateLimit` headers its policy asks for.
    pub(crate) fn reject<B>(&self, refused: Refused) -> Response<ResponseBody<B>> {
        let Refused { error, by } = refused;
        let class = match by {
            RefusedBy::Semaphore(Asked { class, .. }) if Refusal::of(&error).no_permit() => {
                Some(class)
            }
            _ => None,
        };
        log(&error, class);
        let hooked = self.on_refusal.as_ref().and_then(|hook| (hook.0)(&error));
        let mut response = match (hooked, self.answer) {
            (Some(response), _) => response,
            (None, Answer::Http) => self.http(&error),
            #[cfg(feature = "tonic")]
            (None, Answer::Grpc) => super::grpc::response(&error),
        }
        .map(ResponseBody::refusal);
        let headers = response.headers_mut();
        match by {
            RefusedBy::Semaphore(Asked { limit, .. }) if self.policy_header => {
                insert_concurrency_policy(headers, limit)
            }
            RefusedBy::Rate(decided) if self.rate_headers && self.answer == Answer::Http => {
                insert_rate(headers, &decided)
            }
            _ => {}
        }
        // `critical`, `level-3`...: always a valid header value.
        let class = class.filter(|_| self.answer == Answer::Http);
        if let Some(value) = class.and_then(|class| HeaderValue::try_from(class.to_string()).ok()) {
            headers.insert(CLASS_HEADER, value);
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

fn log(error: &Error, class: Option<Priority>) {
    match error {
        // The limiter's outage log tells the outage at WARN, once.
        Error::Backend(_) | Error::AccessDenied(_) => {
            tracing::debug!(%error, "request refused: the limit's backend failed (fail closed)")
        }
        Error::BadKey(_) => tracing::debug!(%error, "request refused: bad partition key"),
        _ => {
            tracing::debug!(%error, class = class.map(tracing::field::display), "request refused: no permit")
        }
    }
}
