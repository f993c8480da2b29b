//! The global rate limit (GCRA), to stack with the concurrency limit: [`RateLimiter`] and
//! [`DistributedRateLimitLayer`].

mod layer;
mod limiter;

pub use self::layer::{
    DistributedRateLimit, DistributedRateLimitLayer, RATELIMIT, RATELIMIT_POLICY, RateHeaderKey,
    RateHttp, Unkeyed,
};
pub use self::limiter::{RateLimiter, RateLimiterBuilder};
