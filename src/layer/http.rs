//! How the HTTP flavour answers a request that got no permit.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use super::body::ResponseBody;
use super::refusal::Refusal;
use crate::Error;

const DEFAULT_BODY: &str = "the service is at its concurrency limit; retry later\n";
const BAD_KEY_BODY: &str = "the request's partition key is missing or invalid\n";

/// The settings of the HTTP flavour; see [`HttpConcurrencyLimitLayer`](super::HttpConcurrencyLimitLayer).
#[derive(Debug, Clone)]
pub(crate) struct HttpSettings {
    pub(crate) status: StatusCode,
    pub(crate) body: Bytes,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) hold_until_body_end: bool,
}

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings {
            status: StatusCode::SERVICE_UNAVAILABLE,
            body: Bytes::from_static(DEFAULT_BODY.as_bytes()),
            retry_after: Some(Duration::from_secs(1)),
            hold_until_body_end: true,
        }
    }
}

impl HttpSettings {
    /// The answer to a refused request. A full semaphore and a failing backend get the same
    /// answer (fail closed); a missing or invalid partition key is the client's fault: 400.
    pub(crate) fn reject<B>(&self, refusal: Refusal) -> Response<ResponseBody<B>> {
        let (status, body, retry_after) = match refusal {
            Refusal::Busy(error) => {
                log(&error);
                (self.status, self.body.clone(), self.retry_after)
            }
            Refusal::BadKey(error) => {
                tracing::debug!(%error, "request refused: bad partition key");
                (
                    StatusCode::BAD_REQUEST,
                    Bytes::from_static(BAD_KEY_BODY.as_bytes()),
                    None,
                )
            }
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

/// Whole seconds, rounded up so a client never comes back before the hint.
fn retry_after_secs(after: Duration) -> u64 {
    after.as_secs() + u64::from(after.subsec_nanos() > 0)
}

fn log(error: &Error) {
    match error {
        Error::Backend(_) => {
            tracing::warn!(%error, "request refused: the limit's backend failed (fail closed)")
        }
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
}
