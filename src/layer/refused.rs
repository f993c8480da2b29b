//! A request refused before the inner service saw it, in either layer, and the limit behind
//! the refusal (for the `RateLimit` headers of an HTTP answer).

use crate::backend::RateDecision;
use crate::{Error, Priority, RateLimiter};

/// A request refused before the inner service saw it, and what its answer reports of the
/// limit that refused it.
pub struct Refused {
    pub(crate) error: Error,
    pub(crate) policy: Policy,
}

/// The limit behind a refusal, for the `RateLimit` headers of an HTTP answer.
pub enum Policy {
    None,
    /// The limit of the semaphore the request was refused by, and the request's class.
    Concurrency(u32, Priority),
    /// The rate limiter and its decision.
    Rate(RateLimiter, RateDecision),
}

impl From<Error> for Refused {
    fn from(error: Error) -> Self {
        Refused {
            error,
            policy: Policy::None,
        }
    }
}
