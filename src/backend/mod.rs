//! Where the permits live. The semaphore sees one [`Handle`] per semaphore name and never knows
//! which backend is behind it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::Error;
use crate::waitlist::Waitlist;
pub use crate::waitlist::{Status, Until};

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

/// How an acquire call may treat its member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One attempt: grant if it fits and nobody waits, else [`Attempt::Full`].
    Once,
    /// Grant, or join the line. The member is new to the backend, so no lookup is needed.
    Join,
    /// The member may already hold or wait (a retry, or the backend dropped it from the line):
    /// look it up first, then grant or join the line again.
    Recheck,
}

impl Mode {
    /// The word the Redis script takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Once => "once",
            Mode::Join => "join",
            Mode::Recheck => "recheck",
        }
    }
}

/// A reading of the backend's clock: `server_us` (µs) was read no earlier than `local` by
/// this process's clock. It turns a deadline on the backend's clock into a local instant that
/// is never later than the backend's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockReading {
    pub local: Instant,
    pub server_us: u64,
}

impl ClockReading {
    /// The local instant at which the backend's clock has surely not yet passed `server_us`:
    /// the backend read `self.server_us` at or after `self.local`, so it reaches `server_us`
    /// at or after `self.local + (server_us - self.server_us)`.
    pub fn local_time_of(&self, server_us: u64) -> Instant {
        match server_us.checked_sub(self.server_us) {
            Some(ahead) => self.local + Duration::from_micros(ahead),
            None => self
                .local
                .checked_sub(Duration::from_micros(self.server_us - server_us))
                .unwrap_or(self.local),
        }
    }
}

/// What one acquire call found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The holder was added with this fencing token; its lease ends `remaining` after the
    /// backend's clock read at or after the call was sent.
    Granted { token: u64, remaining: Duration },
    /// The holder waits in the line; its grant will be announced to the waitlist. The
    /// earliest lease ends in `retry_in`; `clock` was read by this very call.
    Queued {
        retry_in: Duration,
        clock: ClockReading,
    },
    /// No room and not queued (a one-shot attempt).
    Full,
}

/// The most members one call renews or refreshes, so a long list never blocks Redis for long.
pub const BATCH: usize = 1000;

/// How long a queued waiter stays in line without showing it still waits. A process's oldest
/// waiter refreshes all of them every [`KEEPALIVE`]; a crashed process's waiters drop out of
/// the line after this long.
pub const PATIENCE: Duration = Duration::from_secs(3);
pub const KEEPALIVE: Duration = Duration::from_secs(1);

/// A grant to a waiter in the line is provisional: it lasts at most this long (and at most half
/// its lease) until the waiter's process claims it by touching or renewing it, so a process
/// that died or froze while waiting strands its slots for this long, not for a whole lease.
pub const CLAIM: Duration = Duration::from_secs(3);

/// The permits of one semaphore in one backend.
pub trait Handle: Send + Sync + 'static {
    /// Adds `member` as a holder if it fits and nobody waits; otherwise queues it or
    /// answers [`Attempt::Full`], as `mode` says. A backend that is loading or busy is asked
    /// again until `until` (or its call timeout when `None`).
    fn acquire<'a>(
        &'a self,
        member: &'a Member,
        mode: Mode,
        until: Option<Instant>,
    ) -> BoxFuture<'a, Result<Attempt, Error>>;

    /// Removes the holder or waiter (absent is not an error) and admits whoever now fits.
    fn release<'a>(&'a self, member: &'a Member) -> BoxFuture<'a, Result<(), Error>>;

    /// Releases `member` off the caller's path: at once in-process, or with this semaphore's
    /// next call to the backend (a flush task makes sure there is one soon).
    fn release_later(&self, member: Member);

    /// Keeps queued `members` in line, claims those that were granted, and reports each one's
    /// state, plus when the earliest lease ends.
    fn touch<'a>(
        &'a self,
        members: &'a [Arc<str>],
        until: Instant,
    ) -> BoxFuture<'a, Result<(Vec<Status>, Duration), Error>>;

    /// Extends the leases of `members` that still hold to a full lease; for each, the time left
    /// (from the backend's clock read at or after the call was sent), or `None` for those that
    /// no longer hold (they are never added back).
    fn renew<'a>(
        &'a self,
        members: &'a [Arc<str>],
    ) -> BoxFuture<'a, Result<Vec<Option<Duration>>, Error>>;

    /// Ticks each time the connection to the backend was lost: holders renew at once, so a
    /// backend that came back empty is noticed within a round trip. `None` for a backend that
    /// cannot lose its state.
    fn reconnects(&self) -> Option<watch::Receiver<u64>>;

    /// The weight held by live (unexpired) holders.
    fn used(&self) -> BoxFuture<'_, Result<u32, Error>>;

    /// This process's waiters on this semaphore, to which grants are announced.
    fn waitlist(&self) -> &Arc<Waitlist>;
}
