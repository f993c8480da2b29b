//! Where the permits live. The semaphore sees one [`Handle`] per semaphore name and never knows
//! which backend is behind it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::Error;
use crate::waitlist::Waitlist;

mod memory;
mod redis;

pub use self::memory::MemoryBackend;
pub use self::redis::RedisBackend;

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A store of distributed permits: [`RedisBackend`] across processes and machines,
/// [`MemoryBackend`] within one process. Pass one to
/// [`SemaphoreBuilder::build`](crate::SemaphoreBuilder::build).
///
/// The trait is sealed: its methods are the crate's own business, so the backends can evolve
/// without breaking callers.
///
/// # Example
///
/// ```
/// use tower_distributed_limit::{Backend, MemoryBackend, Semaphore};
///
/// fn gpu_jobs(backend: impl Backend) -> Semaphore {
///     Semaphore::builder("gpu-jobs").limit(20).build(backend).expect("valid settings")
/// }
/// assert_eq!(gpu_jobs(MemoryBackend::new()).limit(), 20);
/// ```
pub trait Backend: sealed::Open + Send + Sync + 'static {}

impl Backend for MemoryBackend {}
impl Backend for RedisBackend {}

pub(crate) mod sealed {
    use std::sync::Arc;

    /// Opens the permits of one semaphore name.
    pub trait Open {
        fn open(&self, name: &str) -> Arc<dyn super::Handle>;
    }
}

/// What one acquire attempt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The holder was added with this fencing token and lease.
    Granted { token: u64, lease: Duration },
    /// No room; the earliest lease ends in `retry_in`.
    Full { retry_in: Duration },
}

/// The permits of one semaphore name in one backend.
pub trait Handle: Send + Sync + 'static {
    /// Adds the holder `member` (`"<id>:<weight>"`) if `weight` more permits fit under `limit`.
    fn acquire<'a>(
        &'a self,
        member: &'a str,
        weight: u32,
        limit: u32,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Attempt, Error>>;

    /// Removes the holder and wakes waiters; removing an absent holder is not an error.
    fn release<'a>(&'a self, member: &'a str) -> BoxFuture<'a, Result<(), Error>>;

    /// The weight held by live (unexpired) holders.
    fn used(&self) -> BoxFuture<'_, Result<u32, Error>>;

    /// This process's waiters on this semaphore.
    fn waitlist(&self) -> &Arc<Waitlist>;
}
