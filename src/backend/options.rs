//! What every Redis connection of the crate is opened with, whichever builder made it
//! ([`RedisBackendBuilder`](super::RedisBackendBuilder),
//! [`QuorumBackendBuilder`](super::QuorumBackendBuilder)): the timeouts and the key prefix,
//! their defaults and their checks, and the message for a URL that is not one.

use std::time::Duration;

use crate::Error;

/// The options both Redis builders share.
#[derive(Debug, Clone)]
pub(crate) struct ConnectOptions {
    /// The longest any one Redis call may take.
    pub(crate) call_timeout: Duration,
    /// The longest one connection attempt may take.
    pub(crate) connect_timeout: Duration,
    /// Put before every key and channel.
    pub(crate) prefix: String,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            call_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
            prefix: "dlimit:".into(),
        }
    }
}

impl ConnectOptions {
    /// Refuses what cannot work: a zero timeout would fail every call.
    pub(crate) fn check(&self) -> Result<(), Error> {
        if self.call_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::config(
                "Redis call and connect timeouts must be more than zero",
            ));
        }
        Ok(())
    }
}

/// A URL redis-rs could not parse, said the same way by every builder.
pub(crate) fn not_a_url(error: impl std::fmt::Display) -> Error {
    Error::config(format!(
        "not a Redis URL ({error}); expected e.g. redis://127.0.0.1:6379"
    ))
}
