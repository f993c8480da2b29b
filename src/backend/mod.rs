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
pub use self::redis::{RedisBackend, RedisBackendBuilder};

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

    /// Opens the permits of one semaphore name with its limit.
    pub trait Open {
        fn open(&self, name: &str, limit: u32) -> Arc<dyn super::Handle>;
    }
}

/// One acquisition's identity in a backend: `"<random id>:<weight>:<lease ms>"`, so any process
/// that admits it from the queue knows its weight and lease.
#[derive(Clone, Debug)]
pub struct Member {
    pub text: Arc<str>,
    pub weight: u32,
    pub lease: Duration,
}

impl Member {
    /// A fresh holder id, never reused.
    pub fn new(weight: u32, lease: Duration) -> Self {
        Member {
            text: format!("{:032x}:{weight}:{}", fastrand::u128(..), lease.as_millis()).into(),
            weight,
            lease,
        }
    }

    /// The random id alone.
    pub fn id(&self) -> &str {
        self.text.split(':').next().unwrap_or_default()
    }

    /// The lease written into a member's text.
    pub fn lease_of(text: &str) -> Option<Duration> {
        let millis = text.rsplit(':').next()?.parse().ok()?;
        Some(Duration::from_millis(millis))
    }
}

/// What one acquire call found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The holder was added with this fencing token and lease.
    Granted { token: u64, lease: Duration },
    /// The holder waits in the queue; its grant will be announced to the waitlist. The
    /// earliest lease ends in `retry_in`.
    Queued { retry_in: Duration },
    /// No room and not queued (a one-shot attempt).
    Full,
}

/// A queued member's state, as [`Handle::touch`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Granted {
        token: u64,
        lease: Duration,
    },
    Queued,
    /// Neither holding nor waiting: it was dropped from the queue (it stopped answering).
    Unknown,
}

/// The most members one call renews or refreshes, so a long list never blocks Redis for long.
pub const BATCH: usize = 1000;

/// How long a queued waiter stays in line without showing it still waits. A process's oldest
/// waiter refreshes all of them every [`KEEPALIVE`]; a crashed process's waiters drop out of
/// the line after this long.
pub const PATIENCE: Duration = Duration::from_secs(3);
pub const KEEPALIVE: Duration = Duration::from_secs(1);

/// The permits of one semaphore in one backend.
pub trait Handle: Send + Sync + 'static {
    /// Adds `member` as a holder if it fits and nobody waits; otherwise queues it (`queue`) or
    /// answers [`Attempt::Full`]. `first` says the backend cannot know the member yet.
    fn acquire<'a>(
        &'a self,
        member: &'a Member,
        queue: bool,
        first: bool,
    ) -> BoxFuture<'a, Result<Attempt, Error>>;

    /// Removes the holder or waiter (absent is not an error) and admits whoever now fits.
    fn release<'a>(&'a self, member: &'a Member) -> BoxFuture<'a, Result<(), Error>>;

    /// Releases `member` off the caller's path: at once in-process, or with this semaphore's
    /// next call to the backend (a flush task makes sure there is one soon).
    fn release_later(&self, member: Member);

    /// Keeps queued `members` in line and reports each one's state, plus when the earliest
    /// lease ends.
    fn touch<'a>(
        &'a self,
        members: &'a [Arc<str>],
    ) -> BoxFuture<'a, Result<(Vec<Status>, Duration), Error>>;

    /// Extends the leases of `members` that still hold; `None` for those that no longer do
    /// (they are never added back).
    fn renew<'a>(
        &'a self,
        members: &'a [Arc<str>],
    ) -> BoxFuture<'a, Result<Vec<Option<Duration>>, Error>>;

    /// The weight held by live (unexpired) holders.
    fn used(&self) -> BoxFuture<'_, Result<u32, Error>>;

    /// This process's waiters on this semaphore, to which grants are announced.
    fn waitlist(&self) -> &Arc<Waitlist>;
}
