//! Which semaphore a request counts against, and the future that takes its permit.

use std::future::Future;
use std::pin::Pin;

use http::request::Parts;
use tokio::time::Instant;

use super::key::Partitions;
use super::refusal::Refusal;
use crate::{Error, Permit, Semaphore};

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

/// Takes the permit of one request.
pub(crate) type Acquire = Pin<Box<dyn Future<Output = Result<Permit, Refusal>> + Send>>;

/// What both flavours share: which semaphore a request needs and how long to wait for it.
#[derive(Clone)]
pub(crate) struct Limiter {
    source: Source,
    /// Wait up to the semaphore's acquire timeout (true) or make a single attempt.
    pub(crate) wait: bool,
    /// Abort the inner call when the permit's lease is lost before the response.
    pub(crate) abort_on_lost: bool,
}

#[derive(Clone)]
pub(crate) enum Source {
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
    pub(crate) fn new(source: Source) -> Self {
        Limiter {
            source,
            wait: true,
            abort_on_lost: false,
        }
    }

    /// Picks the request's semaphore now and returns the future that takes its permit.
    pub(crate) fn acquire(&self, parts: &Parts) -> Acquire {
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
