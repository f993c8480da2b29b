//! How the HTTP flavour answers a request that got no permit.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use super::body::ResponseBody;
use crate::Error;

const DEFAULT_BODY: &str = "the service is at its concurrency limit; retry later\n";
const BAD_KEY_BODY: &str = "the request's partition key is missing or invalid\n";
const RATE_LIMITED_BODY: &str = "rate limit reached; retry after the time in Retry-After\n";

/// `RateLimit-Policy`, from the IETF httpapi ratelimit-headers draft.
pub(crate) const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// How refusals are answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// An HTTP response: the status, body and headers below.
    Http,
    /// A gRPC trailers-only response (HTTP 200 with `grpc-status`).
    #[cfg(feature = "tonic")]
    Grpc,
}

/// The settings of the HTTP flavour; see [`HttpConcurrencyLimitLayer`](super::HttpConcurrencyLimitLayer).
#[derive(Debug, Clone)]
pub(crate) struct HttpSettings {
    pub(crate) answer: Answer,
    pub(crate) status: StatusCode,
    pub(crate) body: Bytes,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) hold_until_body_end: bool,
    /// Send `RateLimit-Policy` on refusals.
    pub(crate) policy_header: bool,
}

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings {
            answer: Answer::Http,
            status: StatusCode::SERVICE_UNAVAILABLE,
            body: Bytes::from_static(DEFAULT_BODY.as_bytes()),
            retry_after: Some(Duration::from_secs(1)),
            hold_until_body_end: true,
            policy_header: false,
        }
    }
}

impl HttpSettings {
    /// The answer to a refused request; `limit` is the picked semaphore's, if one was picked.
    pub(crate) fn reject<B>(&self, error: Error, limit: Option<u32>) -> Response<ResponseBody<B>> {
        log(&error);
        let mut response = match self.answer {
            Answer::Http => self.http(&error),
            #[cfg(feature = "tonic")]
            Answer::Grpc => super::grpc::response(error),
        };
        if let Some(limit) = limit.filter(|_| self.policy_header) {
            response
                .headers_mut()
                .insert(RATELIMIT_POLICY, policy(limit));
        }
        response
    }

    /// A full semaphore, a failing backend and a weight above the limit get the configured
    /// answer (fail closed); a missing or invalid partition key is the client's fault: 400.
    fn http<B>(&self, error: &Error) -> Response<ResponseBody<B>> {
        let (status, body, retry_after) = match error {
            Error::BadKey(_) => (
                StatusCode::BAD_REQUEST,
                Bytes::from_static(BAD_KEY_BODY.as_bytes()),
                None,
            ),
            Error::RateLimited { retry_after } => (
                StatusCode::TOO_MANY_REQUESTS,
                Bytes::from_static(RATE_LIMITED_BODY.as_bytes()),
                Some(*retry_after),
            ),
            _ => (self.status, self.body.clone(), self.retry_after),
        };
        let mut response = Response::new(ResponseBody::refusal(body));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        if let Some(after) = retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        response
    }
}

/// `"concurrency";q=<limit>;qu="concurrent-requests"`.
fn policy(limit: u32) -> HeaderValue {
    let value = format!("\"concurrency\";q={limit};qu=\"concurrent-requests\"");
    // Digits and ASCII punctuation only: always a valid header value.
    HeaderValue::try_from(value).unwrap_or_else(|_| HeaderValue::from_static("\"concurrency\""))
}

/// Whole seconds, rounded up so a client never comes back before the hint.
pub(crate) fn retry_after_secs(after: Duration) -> u64 {
    after.as_secs() + u64::from(after.subsec_nanos() > 0)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up() {
        assert_eq!(retry_after_secs(Duration::ZERO), 0);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(2)), 2);
        assert_eq!(retry_after_secs(Duration::from_millis(2500)), 3);
    }

    #[test]
    fn the_policy_names_its_unit() {
        assert_eq!(
            policy(20),
            "\"concurrency\";q=20;qu=\"concurrent-requests\""
        );
    }
}
