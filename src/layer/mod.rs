//! The tower layer: one concurrency limit for every instance of a service, shared through the
//! semaphore's backend.
//!
//! [`DistributedConcurrencyLimitLayer`] wraps any tower service that takes `http::Request`s
//! (an axum `Router`, a tonic `Channel`, a hyper-util `Client`). Each request takes a
//! [`Permit`] before the inner service sees it and gives it back when its
//! response is done. Two flavours:
//!
//! - **generic** ([`DistributedConcurrencyLimit`]): a request that gets no permit fails with a
//!   [`tower::BoxError`] that downcasts to [`Error`], so it composes with
//!   `ServiceBuilder`, `HandleErrorLayer`, timeouts and retries. The permit is released when the
//!   response (its head) arrives. With the `tonic` feature, `DistributedConcurrencyLimitLayer::grpc`
//!   turns refusals into `tonic::Status`es instead.
//! - **HTTP** ([`HttpConcurrencyLimit`], from [`http`](DistributedConcurrencyLimitLayer::http)):
//!   a request that gets no permit is answered 503 Service Unavailable with `Retry-After`, and
//!   the permit rides in the response body until its last byte, so one line on an axum `Router`
//!   is enough.
//!
//! # Where the permit is taken
//!
//! The permit is acquired inside the response future, after `call`, and the inner service is
//! called only once it is held; `poll_ready` only forwards to the inner service. Two reasons:
//! a per-key limit ([`Partitions`]) needs the request to pick its semaphore, which `poll_ready`
//! never sees; and a permit reserved in `poll_ready` would have to live in the service, where a
//! ready service that is dropped or cloned without being called could strand it. Here no permit
//! ever lives in a service: dropping the response future (a client went away, a timeout fired)
//! drops the permit, which is released in the background. As in tower's `AsyncFilter`, `call`
//! moves the ready inner service into the future, so the inner readiness (a `Buffer` slot, say)
//! stays reserved while the request waits for its permit.
//!
//! The handler sees the permit's [`FencingToken`] as a request extension.
#![allow(clippy::module_inception)] // `layer::layer`, as in tower's `limit::concurrency`

pub mod body;
pub mod future;
mod http;
mod key;
mod layer;
mod service;

use std::future::Future;
use std::pin::Pin;

use ::http::request::Parts;
use tokio::time::Instant;

use crate::{Error, Permit, Semaphore};

pub use self::key::{Partitions, PartitionsBuilder, WithoutKey};
pub use self::layer::{DistributedConcurrencyLimitLayer, HttpConcurrencyLimitLayer};
pub use self::service::{DistributedConcurrencyLimit, HttpConcurrencyLimit};

/// The fencing token of the permit a request holds, put in the request's extensions by the
/// layer before the inner service is called.
///
/// Tokens strictly increase per semaphore across every process: pass the token along with
/// writes to a resource that remembers the highest one it saw, and it can refuse a holder that
/// was paused past its lease.
///
/// # Example
///
/// ```
/// use axum::{Extension, Router, routing::get};
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, FencingToken, MemoryBackend, Semaphore};
///
/// async fn handler(Extension(FencingToken(token)): Extension<FencingToken>) -> String {
///     format!("writing with token {token}")
/// }
///
/// let sem = Semaphore::builder("db").limit(30).build(MemoryBackend::new()).unwrap();
/// let app: Router = Router::new()
///     .route("/", get(handler))
///     .layer(DistributedConcurrencyLimitLayer::new(sem).http());
/// # let _ = app;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(pub u64);

/// Why a request got no permit.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The semaphore was full until the wait ended, or its backend failed.
    Busy(Error),
    /// The request's partition key was missing or invalid.
    BadKey(Error),
}

impl Refusal {
    pub(crate) fn into_error(self) -> Error {
        match self {
            Refusal::Busy(e) | Refusal::BadKey(e) => e,
        }
    }
}

/// Takes the permit of one request.
pub(crate) type Acquire = Pin<Box<dyn Future<Output = Result<Permit, Refusal>> + Send>>;

/// What both flavours share: which semaphore a request needs and how long to wait for it.
#[derive(Clone)]
pub(crate) struct Limiter {
    source: Source,
    /// Wait up to the semaphore's acquire timeout (true) or make a single attempt.
    wait: bool,
    /// Abort the inner call when the permit's lease is lost before the response.
    abort_on_lost: bool,
}

#[derive(Clone)]
enum Source {
    One(Semaphore),
    Partitioned(Partitions),
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = f.debug_struct("Limiter");
        match &self.source {
            Source::One(sem) => s.field("semaphore", sem),
            Source::Partitioned(p) => s.field("partitions", p),
        };
        s.field("wait", &self.wait)
            .field("abort_on_lost", &self.abort_on_lost)
            .finish()
    }
}

impl Limiter {
    fn new(source: Source) -> Self {
        Limiter {
            source,
            wait: true,
            abort_on_lost: false,
        }
    }

    /// Picks the request's semaphore now and returns the future that takes its permit.
    fn acquire(&self, parts: &Parts) -> Acquire {
        let semaphore = match &self.source {
            Source::One(sem) => Ok(sem.clone()),
            Source::Partitioned(partitions) => partitions.select(parts),
        };
        let wait = self.wait;
        Box::pin(async move {
            let semaphore = semaphore?;
            if wait {
                return semaphore.acquire().await.map_err(Refusal::Busy);
            }
            let started = Instant::now();
            match semaphore.try_acquire().await {
                Ok(Some(permit)) => Ok(permit),
                // Full at once: reported as a wait that ended with nothing, so callers match
                // one error for "no permit" whichever way the layer waits.
                Ok(None) => Err(Refusal::Busy(Error::Timeout {
                    waited: started.elapsed(),
                })),
                Err(e) => Err(Refusal::Busy(e)),
            }
        })
    }
}
