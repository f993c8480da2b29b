//! A request refused before the inner service saw it, in either layer ([`Refused`]), the
//! limit behind the refusal ([`RefusedBy`], for the `RateLimit` headers and `x-dlimit-class`
//! of an HTTP answer), and the kinds of refusal both layers answer ([`Refusal`]), each with its
//! own status, client-facing sentence, `x-dlimit-refusal` and `Retry-After` in HTTP; the gRPC
//! answer maps them to codes.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use super::headers::{REFUSAL_HEADER, retry_after_secs};
use crate::rate::Decided;
use crate::{Error, Priority};

/// A request refused before the inner service saw it, and what its answer reports of the
/// limit that refused it.
pub struct Refused {
    pub(crate) error: Error,
    pub(crate) by: RefusedBy,
}

/// The limit behind a refusal.
pub(crate) enum RefusedBy {
    /// None to report (a bad key, a lease lost).
    Nothing,
    /// The semaphore the request asked of.
    Semaphore(Asked),
    /// The rate limiter, and what it decided.
    Rate(Decided),
}

/// What a request asked of its semaphore: that semaphore's limit (for `RateLimit-Policy`)
/// and the request's class (for `x-dlimit-class`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asked {
    pub(crate) limit: u32,
    pub(crate) class: Priority,
}

impl From<Error> for Refused {
    fn from(error: Error) -> Self {
        Refused {
            error,
            by: RefusedBy::Nothing,
        }
    }
}

/// The kinds of refusal, one per answer: what a client is told, in both layers and every
/// flavor. The sentences are for clients: short, neutral, no advice to operators (that goes
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
            // Unavailable to the client either way; the operator has the ERROR and the status.
            Error::Backend(_) | Error::AccessDenied(_) => Refusal::Outage,
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
