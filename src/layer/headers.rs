//! The headers both layers send: `x-dlimit-refusal`, `Retry-After`'s seconds, and the IETF
//! httpapi ratelimit-headers draft's `RateLimit` and `RateLimit-Policy`.

use std::time::Duration;

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};

use crate::rate::Decided;

/// `RateLimit`, from the IETF httpapi ratelimit-headers draft.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `RateLimit-Policy`, from the IETF httpapi ratelimit-headers draft.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `x-dlimit-refusal`: which kind of refusal a response the layer made itself is (`full`,
/// `timeout`, `outage`, `rate-limited`, ...), so clients and dashboards tell an outage from a
/// full limit.
pub const REFUSAL_HEADER: HeaderName = HeaderName::from_static("x-dlimit-refusal");

/// `x-dlimit-class`: the class (`critical`, `normal`, `batch`, `level-<n>`) of a request the
/// HTTP flavor refused for want of a permit, so a client or dashboard sees which class was
/// full.
pub const CLASS_HEADER: HeaderName = HeaderName::from_static("x-dlimit-class");

/// Whole seconds, rounded up so a client never comes back before the hint.
pub(crate) fn retry_after_secs(after: Duration) -> u64 {
    after.as_secs() + u64::from(after.subsec_nanos() > 0)
}

/// `RateLimit-Policy: "concurrency";q=<limit>;qu="concurrent-requests"`: the limit of the
/// semaphore a request was refused by.
pub(crate) fn insert_concurrency_policy(headers: &mut HeaderMap, limit: u32) {
    let value = format!("\"concurrency\";q={limit};qu=\"concurrent-requests\"");
    // Digits and ASCII punctuation only: always a valid header value.
    if let Ok(value) = HeaderValue::try_from(value) {
        headers.insert(RATELIMIT_POLICY, value);
    }
}

/// `RateLimit-Policy: "<name>";q=<quota>;w=<window s>` and
/// `RateLimit: "<name>";r=<remaining>;t=<s until retry, or until full again>`.
pub(crate) fn insert_rate(headers: &mut HeaderMap, decided: &Decided) {
    let Decided { limiter, decision } = decided;
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
    fn retry_after_rounds_up() {
        assert_eq!(retry_after_secs(Duration::ZERO), 0);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(2)), 2);
        assert_eq!(retry_after_secs(Duration::from_millis(2500)), 3);
    }

    #[test]
    fn the_concurrency_policy_names_its_unit() {
        let mut headers = HeaderMap::new();
        insert_concurrency_policy(&mut headers, 20);
        assert_eq!(
            headers[RATELIMIT_POLICY],
            "\"concurrency\";q=20;qu=\"concurrent-requests\""
        );
    }

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
