//! Permits and rate limits in Redis, shared by every process and machine that uses the same
//! server: [`RedisBackend`] and what its clones share, one concern per file beside it.
//!
//! Eight keys per semaphore (holders, meta, the waiting line, its liveness deadlines, grant
//! times, the processes' names, the tenants' index, the processes' protocol versions), all
//! under the `{name}` hash tag (`keys.rs`), laid out as docs/protocol.md states (its numbers in
//! `protocol.rs`); every operation is one bounded call of `lua/semaphore/` (see
//! `semaphore.rs`: written by `args.rs`, read by `reply.rs`, grouped by `outbox.rs`), a
//! function on Redis 7 or a script by SHA (sent whole on NOSCRIPT), through `script.rs`.
//! Grants to queued waiters are published on the semaphore's channel; a process's waiters
//! share the backend's one multiplexed RESP3 connection, subscribed to a channel only while
//! someone waits on it (`announce.rs`). `builder.rs` makes the backend and opens its
//! connection, `errors.rs` says what a failure means, and `eviction.rs` warns of a
//! server that may evict the keys.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::{mpsc, watch};

pub(super) mod announce;
mod args;
mod builder;
mod connection;
mod errors;
mod eviction;
mod keys;
mod node;
mod outbox;
mod protocol;
mod rate;
mod reply;
mod script;
mod semaphore;
mod sentinel;

pub use self::builder::RedisBackendBuilder;
use self::connection::{Conn, Target};
pub(super) use self::errors::{access_problem, short};
use self::eviction::Eviction;
pub(super) use self::node::{Pushes, manager_config};
use super::health::{self, Health};

use crate::waitlist::{Hub, Waitlist};
use crate::{BackendStatus, Error};

/// The `tracing` target of the one `trace!` event emitted per command sent to Redis, for
/// counting round trips.
pub(super) const CALLS: &str = "tower_distributed_limit::redis";

/// Semaphores stored in Redis, shared by every process that uses the same server and prefix.
///
/// Cheap to clone: clones share one multiplexed, auto-reconnecting connection (redis-rs
/// `ConnectionManager`, RESP3), which also carries the grant announcements waiters sleep on.
///
/// # Examples
///
/// ```no_run
/// use tower_distributed_limit::{RedisBackend, Semaphore};
///
/// # async fn run() -> Result<(), tower_distributed_limit::Error> {
/// let redis = RedisBackend::connect("redis://127.0.0.1:6379").await?.key_prefix("myapp:");
/// let sem = Semaphore::builder("legacy-db").limit(30).build(redis)?;
/// let permit = sem.acquire().await?;
/// // ... at most 30 of these run at once, across every instance ...
/// drop(permit);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    shared: Arc<Connection>,
    prefix: Arc<str>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// What clones of one `RedisBackend` share: the connection and what rides on it.
struct Connection {
    /// Set once the server was first reached (at once by `connect`, by the probe after
    /// `connect_lazy`); the connection re-establishes itself after that.
    conn: OnceLock<Conn>,
    /// Up or down; the probe reaches the server through [`Reconnect`](health::Reconnect).
    health: Health,
    /// What `conn` is opened from, kept for a lazy start.
    target: Target,
    pushes: Pushes,
    /// The subscriber's requests, until it starts with the connection.
    requests: Mutex<Option<mpsc::UnboundedReceiver<Arc<Waitlist>>>>,
    /// Keys live on several nodes (Redis Cluster): a call reaches only those of one slot.
    cluster: bool,
    hub: Arc<Hub>,
    call_timeout: Duration,
    /// Ticks on every lost connection, so holders renew (and learn of a server that came back
    /// empty) at once.
    reconnects: Arc<watch::Sender<u64>>,
    /// `wait_for_replicas`: how many replicas must acknowledge a grant, and how long to wait.
    replicas: Option<Replicas>,
    /// The eviction policy last warned about.
    eviction: Eviction,
    /// Through Sentinel, the promotion fence every semaphore call carries: after a failover,
    /// the new master grants nothing new for a lease and this long (see `lua/semaphore/`),
    /// so the grants the old master made that never reached it, and those it made to
    /// processes that had not heard of the failover, have ended by then. It is the oldest
    /// word of the sentinels a call may act on, plus the call's own time.
    promotion_fence: Option<Duration>,
    /// This process's tag and name, `"<tag> <name>"`, told with a call now and then (see
    /// `RedisBackendBuilder::process_name`).
    process: Arc<str>,
    /// The server (Redis before 7) or the user's ACL has no functions: the semaphore's calls
    /// go as scripts (see `script::invoke`).
    functions_refused: AtomicBool,
}

/// `wait_for_replicas`: a grant counts once `count` replicas acknowledged it within `timeout`.
#[derive(Debug, Clone, Copy)]
struct Replicas {
    count: u32,
    timeout: Duration,
}

impl RedisBackend {
    /// Whether the server answers, is down (the outage policy decides), or refuses this
    /// process's credentials or permissions (a configuration error): for a readiness probe.
    pub fn status(&self) -> BackendStatus {
        self.shared.health.status()
    }

    /// Puts every key and channel of this backend's semaphores under `prefix` (default
    /// `"dlimit:"`), to keep apart applications that share a Redis.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into().into();
        self
    }
}

impl Connection {
    /// The connection, if the server is up; refused at once otherwise.
    fn conn(self: &Arc<Self>) -> Result<Conn, Error> {
        health::refuse_while_down(self)?;
        self.conn
            .get()
            .cloned()
            .ok_or_else(|| Error::backend("Redis was not reached yet", None))
    }

    /// The command that announces a grant: on a cluster, sharded pub/sub (`SPUBLISH`), which
    /// routes by slot like the keys, so a grant travels only to the node that owns the
    /// semaphore instead of being broadcast to every node.
    fn publisher(&self) -> &'static str {
        if self.cluster { "SPUBLISH" } else { "PUBLISH" }
    }
}
