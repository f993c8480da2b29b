//! Where the permits live. The semaphore sees one [`Store`] per semaphore name, plus the
//! [`Waitlist`](crate::waitlist::Waitlist) its grants are announced to, and never knows which
//! backend is behind them.
//!
//! A new backend is one file here: implement `sealed::Open` and `Store` (and `Refresh`, the
//! touch that waiting needs) from `store.rs`, then list it below.

mod gcra;
mod health;
mod member;
mod memory;
mod options;
mod owed;
mod quorum;
mod redis;
mod store;

pub use self::health::BackendStatus;
pub(crate) use self::member::Member;
pub use self::memory::MemoryBackend;
pub(crate) use self::options::{ConnectOptions, not_a_url};
pub use self::quorum::{QuorumBackend, QuorumBackendBuilder};
pub use self::redis::{RedisBackend, RedisBackendBuilder};
pub(crate) use self::store::{Attempt, Ending, Mode, Opened, Samples, Store, sealed};
// The rate limiter's side: see gcra.rs.
pub(crate) use self::gcra::{EXACT, Gcra, RateKey, RateStore, Rated};
pub use self::gcra::{RateBackend, RateDecision};

/// A store of distributed permits: [`RedisBackend`] across processes and machines,
/// [`MemoryBackend`] within one process. Pass one to
/// [`SemaphoreBuilder::build`](crate::SemaphoreBuilder::build).
///
/// The trait is sealed: its methods are the crate's own business, so the backends can evolve
/// without breaking callers.
///
/// # Examples
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
impl Backend for QuorumBackend {}
