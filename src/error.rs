//! The one error type of the crate.

use std::time::Duration;

/// A boxed error from a backend's client library, kept as the [`source`](std::error::Error::source).
type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong while taking or giving back a permit.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_distributed_limit::{Error, MemoryBackend, Semaphore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let sem = Semaphore::builder("db")
///     .limit(1)
///     .acquire_timeout(Duration::from_millis(10))
///     .build(MemoryBackend::new())
///     .unwrap();
/// let _held = sem.acquire().await.unwrap();
/// match sem.acquire().await {
///     Err(Error::Timeout { waited }) => assert!(waited >= Duration::from_millis(10)),
///     other => panic!("expected a timeout, got {other:?}"),
/// }
/// assert!(matches!(sem.acquire_many(2).await, Err(Error::Config(_))));
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The semaphore or the request was set up wrongly (limit 0, empty name, weight above the
    /// limit, a malformed Redis URL...). Retrying does not help: fix the configuration.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// The semaphore was full and the caller asked not to wait (the layer's
    /// `reject_when_full`, or its `acquire_in_poll_ready` with `reject_when_full`).
    /// Retry later, raise the limit, or let requests wait for a permit.
    #[error(
        "the semaphore is full and the request was set not to wait; retry later, raise the \
         limit, or let requests wait (drop reject_when_full)"
    )]
    Full,

    /// The request's partition key is missing or invalid (empty, too long): the client sent a
    /// bad request. Retrying the same request does not help; send a valid key.
    #[error("bad partition key: {0}")]
    BadKey(String),

    /// No permit became free within the acquire timeout.
    #[error(
        "no permit became free within {waited:?}; raise the semaphore's limit or acquire_timeout, \
         or shed load"
    )]
    Timeout {
        /// How long the caller waited.
        waited: Duration,
    },

    /// Too many callers already wait for this semaphore in this process (see
    /// [`SemaphoreBuilder::max_waiters`](crate::SemaphoreBuilder::max_waiters)); refused at once
    /// rather than piling up.
    #[error(
        "{waiting} callers already wait for this semaphore in this process; shed load, or raise \
         max_waiters if the backlog is expected"
    )]
    TooManyWaiters {
        /// How many were waiting.
        waiting: usize,
    },

    /// The permit's lease was lost while the request ran (the backend could not be reached to
    /// renew it, the process was paused past the lease, or the holder was removed), and the
    /// layer was told to abort such requests.
    #[error(
        "the permit's lease was lost while the request ran, so the request was aborted; \
         another holder may have the slot. Check that Redis is reachable and the lease is long \
         enough for pauses"
    )]
    LeaseLost,

    /// The rate limit was reached: the request was refused by a
    /// [`RateLimiter`](crate::RateLimiter) (through
    /// [`DistributedRateLimitLayer`](crate::DistributedRateLimitLayer) or a combined check) and
    /// spent nothing. The same request is allowed after `retry_after`.
    #[error(
        "the rate limit was reached; retry after {retry_after:?}, or raise the limiter's rate or \
         burst"
    )]
    RateLimited {
        /// How long until the same request would be allowed.
        retry_after: Duration,
    },

    /// The backend failed: Redis unreachable or too slow, a script error, or a key of the wrong
    /// type under the key prefix. The message says which and what to do.
    #[error(transparent)]
    Backend(#[from] BackendError),

    /// Redis refused this process's credentials (no password, a wrong one, a disabled user) or
    /// its user's ACL permissions (`NOPERM`): a configuration error, not an outage, so no
    /// [`OutagePolicy`](crate::OutagePolicy) decides the call (`FailOpen` does not admit it).
    /// The message says what to change; retrying does not help until it is changed.
    /// [`RedisBackend::status`](crate::RedisBackend::status) reports it to a readiness probe,
    /// and it is logged at ERROR once.
    #[error(transparent)]
    AccessDenied(BackendError),
}

/// What went wrong in a backend, with the client library's error as its
/// [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct BackendError {
    pub(crate) message: String,
    #[source]
    pub(crate) source: Option<Source>,
}

impl Error {
    pub(crate) fn config(message: impl Into<String>) -> Self {
        Error::Config(message.into())
    }

    pub(crate) fn backend(message: impl Into<String>, source: impl Into<Option<Source>>) -> Self {
        Error::Backend(BackendError {
            message: message.into(),
            source: source.into(),
        })
    }

    pub(crate) fn access_denied(message: impl Into<String>) -> Self {
        Error::AccessDenied(BackendError {
            message: message.into(),
            source: None,
        })
    }
}
