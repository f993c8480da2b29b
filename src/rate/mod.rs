//! The global rate limit (GCRA), to stack with the concurrency limit: [`RateLimiter`] and
//! [`DistributedRateLimitLayer`], built on the concurrency layer's core ([`crate::layer`]):
//! the same flavors, key extractors, refusal answers and response futures.

pub(crate) mod check;
mod layer;
mod limiter;
mod service;

pub use self::layer::DistributedRateLimitLayer;
pub(crate) use self::limiter::Decided;
pub use self::limiter::{RateLimiter, RateLimiterBuilder};
pub use self::service::DistributedRateLimit;
