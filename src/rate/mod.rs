//! The global rate limit (GCRA), to stack with the concurrency limit: [`RateLimiter`] and
//! [`DistributedRateLimitLayer`], built on the concurrency layer's core ([`crate::layer`]):
//! the same flavours, key extractors, refusal answers and response futures.

mod layer;
mod limiter;
mod service;

pub use self::layer::DistributedRateLimitLayer;
pub use self::limiter::{RateLimiter, RateLimiterBuilder};
pub use self::service::DistributedRateLimit;
/// The `RateLimit` headers, defined once for both layers.
pub use crate::layer::{RATELIMIT, RATELIMIT_POLICY};
