//! Permits and rate limits in Redis, shared by every process and machine that uses the same
//! server: the backend and its builder, the one script-call path (`invoke`), and the grant
//! announcements.
//!
//! Five keys per semaphore (holders, meta, the waiting line, its liveness deadlines, grant
//! times), all under the `{name}` hash tag; every operation is one call of
//! `lua/semaphore.lua` (see `semaphore.rs`), invoked by SHA (sent whole on NOSCRIPT). Grants to
//! queued waiters are published on the semaphore's channel; a process's waiters share the
//! backend's one multiplexed RESP3 connection, subscribed to a channel only while someone waits
//! on it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

mod connection;
mod node;
mod rate;
mod semaphore;
mod sentinel;

use self::connection::{Conn, Nodes, Target};
pub(super) use self::node::{Pushes, manager_config};
use super::health::{self, Health, Reconnect};
use redis::{
    Client, Cmd, ConnectionAddr, ErrorKind, IntoConnectionInfo, PushInfo, PushKind, RedisError,
    RedisResult, Script, ServerErrorKind, TlsCertificates, Value,
};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::Error;
use crate::sync::lock;
use crate::waitlist::{Hub, Until, Waitlist};

/// A Lua script, sent by SHA once the server knows it.
struct Lua {
    source: &'static str,
    script: OnceLock<Script>,
}

impl Lua {
    const fn new(source: &'static str) -> Self {
        Lua {
            source,
            script: OnceLock::new(),
        }
    }

    fn sha(&self) -> &str {
        self.script
            .get_or_init(|| Script::new(self.source))
            .get_hash()
    }
}

/// One call of `lua` on `conn`, its keys and arguments written by `args` (told whether this is
/// a repeat), with `WAIT` for `replicas` in the same pipeline; the reply, and how many replicas
/// acknowledged.
///
/// The call goes by SHA, and with the whole source (`EVAL`, which also caches it) when the
/// server does not know the script: routed by key like the call itself, so on a cluster it
/// never waits for the other nodes, as `SCRIPT LOAD` to every node would. A call whose
/// connection dropped is sent once more (the connection manager reconnects on that error, one
/// attempt). A server that is loading its data or busy with a script is asked again after a
/// jittered pause, until `until`.
///
/// A server known to be down is not asked at all: the call fails at once (see `health`), and
/// a call that finds it unreachable marks it down.
async fn invoke(
    lua: &Lua,
    shared: &Arc<Connection>,
    op: &'static str,
    until: Instant,
    replicas: Option<Replicas>,
    args: impl Fn(&mut Cmd, bool),
) -> Result<(Value, Option<i64>), Error> {
    let mut conn = shared.conn()?;
    let result = send(lua, &mut conn, op, until, replicas, args).await;
    if let Err(e) = &result {
        health::failed(shared, e);
    }
    result.map_err(|e| redis_error(e, op, shared.health.label()))
}

/// [`invoke`]'s retries on one connection.
async fn send(
    lua: &Lua,
    conn: &mut Conn,
    op: &'static str,
    until: Instant,
    replicas: Option<Replicas>,
    args: impl Fn(&mut Cmd, bool),
) -> RedisResult<(Value, Option<i64>)> {
    let (mut source, mut repeat, mut dropped_once, mut pushes) = (false, false, false, 0);
    let mut moved_once = false;
    let mut pause = Duration::from_millis(10);
    loop {
        let mut command = if source {
            let mut command = redis::cmd("EVAL");
            command.arg(lua.source);
            command
        } else {
            let mut command = redis::cmd("EVALSHA");
            command.arg(lua.sha());
            command
        };
        args(&mut command, repeat);
        tracing::trace!(target: CALLS, op, repeat, "script call");
        let result = match replicas {
            None => command.query_async(conn).await.map(|reply| (reply, None)),
            Some(Replicas { count, timeout }) => {
                let mut pipe = redis::pipe();
                pipe.add_command(command)
                    .cmd("WAIT")
                    .arg(count)
                    .arg(timeout.as_millis() as u64);
                pipe.query_async::<(Value, i64)>(conn)
                    .await
                    .map(|(reply, acked)| (reply, Some(acked)))
            }
        };
        match result {
            // A push in place of the reply: redis-rs's cluster client can hand back the
            // server's `sunsubscribe` of a moving slot as the answer to a call in flight. The
            // call itself may have run; every operation is safe to send again.
            Ok((Value::Push { .. }, _)) if pushes < 3 => {
                pushes += 1;
                repeat = true;
            }
            // Too few replicas acknowledged: on Sentinel, the master may have been deposed
            // (its replicas follow the new one). If the sentinels name another, ask it.
            Ok((_, Some(acked)))
                if replicas.is_some_and(|r| acked < i64::from(r.count))
                    && !moved_once
                    && conn.master_moved().await =>
            {
                moved_once = true;
                repeat = true;
            }
            Err(e) if !source && e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                source = true;
            }
            Err(e) if e.is_connection_dropped() && !dropped_once => {
                dropped_once = true;
                repeat = true;
            }
            Err(e) if is_transient(&e) && Instant::now() + pause < until => {
                tracing::debug!(op, error = %e, "Redis is loading or busy; asking again");
                tokio::time::sleep(pause.mul_f64(0.5 + fastrand::f64())).await;
                pause = (pause * 2).min(Duration::from_millis(200));
                repeat = true;
            }
            other => return other,
        }
    }
}

/// How long a channel stays subscribed after its last local waiter left, so a semaphore that
/// is full on and off does not subscribe and unsubscribe on every wait.
const LINGER: Duration = Duration::from_secs(2);

/// The `tracing` target of the one `trace!` event emitted per command sent to Redis, for
/// counting round trips.
const CALLS: &str = "tower_distributed_limit::redis";

/// Default bounds on every Redis call: a hung or vanished server answers with an error, not a
/// hang.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Semaphores stored in Redis, shared by every process that uses the same server and prefix.
///
/// Cheap to clone: clones share one multiplexed, auto-reconnecting connection (redis-rs
/// `ConnectionManager`, RESP3), which also carries the grant announcements waiters sleep on.
///
/// # Example
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
    /// Up or down; the probe reaches the server through [`Reconnect`].
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
    /// The eviction policy last warned about (`check_eviction`).
    eviction: Arc<Mutex<Option<String>>>,
    /// Through Sentinel, the promotion fence every semaphore call carries: after a failover,
    /// the new master grants nothing new for a lease and this long (see `lua/semaphore.lua`),
    /// so the grants the old master made that never reached it, and those it made to
    /// processes that had not heard of the failover, have ended by then. It is the oldest
    /// word of the sentinels a call may act on, plus the call's own time.
    promotion_fence: Option<Duration>,
}

#[derive(Debug, Clone, Copy)]
struct Replicas {
    count: u32,
    timeout: Duration,
}

impl RedisBackend {
    /// Connects to the Redis server at `url` (`redis://host:port/db`, or `rediss://` for TLS,
    /// checked against the system's CAs; see
    /// [`add_root_certificate_pem`](RedisBackendBuilder::add_root_certificate_pem) for a private
    /// CA), with the default settings of [`RedisBackend::builder`].
    ///
    /// Fails with [`Error::Config`] for a malformed URL and [`Error::Backend`] when the server
    /// cannot be reached now; once connected, the connection is re-established by itself.
    /// Connect inside the runtime that will use the backend: the connection's driver task runs
    /// there, and stops with it.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::builder(url).connect().await
    }

    /// Builds a backend for the Redis server at `url` at once, whether the server is up or
    /// not, with the default settings of [`RedisBackend::builder`]; see
    /// [`RedisBackendBuilder::connect_lazy`]. Fails only with [`Error::Config`] (a malformed
    /// URL, or no tokio runtime).
    ///
    /// # Example
    ///
    /// ```
    /// use tower_distributed_limit::{RedisBackend, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let redis = RedisBackend::connect_lazy("redis://127.0.0.1:6379").unwrap();
    /// let sem = Semaphore::builder("api").limit(10).build(redis).unwrap();
    /// # let _ = sem;
    /// # }
    /// ```
    pub fn connect_lazy(url: &str) -> Result<Self, Error> {
        Self::builder(url).connect_lazy()
    }

    /// Connects with a client you configured yourself (credentials, TLS, database). The
    /// connection always speaks RESP3, which carries the grant announcements.
    pub async fn from_client(client: Client) -> Result<Self, Error> {
        Self::builder(client.get_connection_info().clone())
            .connect()
            .await
    }

    /// Settings for a connection to the server at `info`: a URL, or a redis-rs
    /// `ConnectionInfo` carrying credentials, TLS or a database.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_distributed_limit::RedisBackend;
    ///
    /// # async fn run() -> Result<(), tower_distributed_limit::Error> {
    /// let redis = RedisBackend::builder("redis://10.0.0.5:6379")
    ///     .call_timeout(Duration::from_millis(250))   // no Redis call waits longer
    ///     .connect_timeout(Duration::from_millis(500))
    ///     .key_prefix("billing:")
    ///     .connect()
    ///     .await?;
    /// # let _ = redis; Ok(()) }
    /// ```
    pub fn builder(info: impl IntoConnectionInfo) -> RedisBackendBuilder {
        RedisBackendBuilder::new(
            info.into_connection_info()
                .map(|info| Nodes::Single(Box::new(info))),
        )
    }

    /// Connects to a Redis Cluster through any of its nodes (`urls`: one is enough, more
    /// survive one being down), with the default settings of
    /// [`RedisBackend::cluster_builder`].
    ///
    /// Each semaphore's keys sit in the slot of its `{name}` hash tag, so every script call
    /// runs on the node that owns it; grants are announced with sharded pub/sub on that node.
    /// MOVED/ASK redirections and failovers are followed.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use tower_distributed_limit::{RedisBackend, Semaphore};
    ///
    /// # async fn run() -> Result<(), tower_distributed_limit::Error> {
    /// let redis = RedisBackend::connect_cluster(&["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]).await?;
    /// let sem = Semaphore::builder("llm-api").limit(20).build(redis)?;
    /// # let _ = sem; Ok(()) }
    /// ```
    pub async fn connect_cluster<U: IntoConnectionInfo + Clone>(urls: &[U]) -> Result<Self, Error> {
        Self::cluster_builder(urls).connect().await
    }

    /// Connects to the master that the Sentinels at `sentinels` watch under `master_name`,
    /// with the default settings of [`RedisBackend::sentinel_builder`].
    ///
    /// The backend never acts on a deposed master:
    /// - it subscribes to a sentinel's `+switch-master` and asks every sentinel every 250 ms
    ///   which node is the master; of the answers of at least a majority, the one of the
    ///   highest configuration epoch wins (a sentinel that has not heard of a failover yet
    ///   names the deposed master). On a switch it drops the old master's connection at once;
    /// - a call goes only to a master the sentinels named within the last second (a process
    ///   that was frozen, or lost its sentinel, asks them first); a reconnect goes through
    ///   them too;
    /// - a call that cannot reach the master, finds it demoted (`READONLY`, `MASTERDOWN`), or
    ///   whose master was deposed while it was in flight asks the sentinels and is sent again
    ///   to the new master, within the call timeout;
    /// - subscriptions move along, waiters check their line and holders renew at once, so a
    ///   grant the new master never received is reported lost, never re-added;
    /// - without [`wait_for_replicas`](RedisBackendBuilder::wait_for_replicas), a promoted
    ///   master grants nothing new for one lease plus one second plus the call timeout after
    ///   it is first used (the *promotion fence*, decided by the server from its replication
    ///   ids): every grant the old master made that it may lack, or made to a process that
    ///   had not heard of the failover yet, has ended by then. Holders it knows keep renewing;
    ///   waiters queue and are served when the fence ends.
    ///
    /// With `wait_for_replicas` there is no fence: a grant counts once a replica has it, and
    /// Sentinel promotes the replica that has the most. What remains then is a grant on the
    /// deposed master by a process that has not heard of the failover yet, acknowledged by a
    /// replica the sentinels have not moved to the new master yet (a window of about a
    /// second); asking for as many replicas as there are closes it, at the cost of every
    /// grant failing while one replica is down.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use tower_distributed_limit::RedisBackend;
    ///
    /// # async fn run() -> Result<(), tower_distributed_limit::Error> {
    /// let redis = RedisBackend::connect_sentinel(&["redis://10.0.0.1:26379"], "mymaster").await?;
    /// # let _ = redis; Ok(()) }
    /// ```
    pub async fn connect_sentinel<U: IntoConnectionInfo + Clone>(
        sentinels: &[U],
        master_name: &str,
    ) -> Result<Self, Error> {
        Self::sentinel_builder(sentinels, master_name)
            .connect()
            .await
    }

    /// Settings for a connection through Sentinel: the same options as
    /// [`RedisBackend::builder`] (timeouts, key prefix, replicas).
    pub fn sentinel_builder<U: IntoConnectionInfo + Clone>(
        sentinels: &[U],
        master_name: &str,
    ) -> RedisBackendBuilder {
        if sentinels.is_empty() || master_name.is_empty() {
            return RedisBackendBuilder::failed(Error::config(
                "connect_sentinel needs the URL of at least one sentinel and the master's name",
            ));
        }
        let nodes = sentinels
            .iter()
            .map(|url| url.clone().into_connection_info())
            .collect::<Result<Vec<_>, _>>()
            .map(|infos| Nodes::Sentinel(infos, master_name.to_owned()));
        RedisBackendBuilder::new(nodes)
    }

    /// Settings for a connection to a Redis Cluster through `urls`: the same options as
    /// [`RedisBackend::builder`] (timeouts, key prefix, TLS roots).
    pub fn cluster_builder<U: IntoConnectionInfo + Clone>(urls: &[U]) -> RedisBackendBuilder {
        let nodes = urls
            .iter()
            .map(|url| url.clone().into_connection_info())
            .collect::<Result<Vec<_>, _>>()
            .map(Nodes::Cluster);
        let nodes = match nodes {
            Ok(Nodes::Cluster(infos)) if infos.is_empty() => {
                return RedisBackendBuilder::failed(Error::config(
                    "connect_cluster needs the URL of at least one cluster node",
                ));
            }
            other => other,
        };
        RedisBackendBuilder::new(nodes)
    }

    /// Puts every key and channel of this backend's semaphores under `prefix` (default
    /// `"dlimit:"`), to keep apart applications that share a Redis.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into().into();
        self
    }
}

impl RedisBackendBuilder {
    fn new(nodes: Result<Nodes, RedisError>) -> Self {
        RedisBackendBuilder {
            nodes: nodes.map_err(|e| {
                Error::config(format!(
                    "not a Redis URL ({e}); expected e.g. redis://127.0.0.1:6379"
                ))
            }),
            call_timeout: CALL_TIMEOUT,
            connect_timeout: CONNECT_TIMEOUT,
            prefix: "dlimit:".into(),
            root_certificates: Vec::new(),
            replicas: None,
        }
    }

    /// A builder whose `connect` fails with `error`.
    fn failed(error: Error) -> Self {
        let mut builder = RedisBackendBuilder::new(Ok(Nodes::Cluster(Vec::new())));
        builder.nodes = Err(error);
        builder
    }
}

/// Connection settings for a [`RedisBackend`]; made by [`RedisBackend::builder`] or
/// [`RedisBackend::cluster_builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct RedisBackendBuilder {
    nodes: Result<Nodes, Error>,
    call_timeout: Duration,
    connect_timeout: Duration,
    prefix: String,
    /// PEM certificates of the CAs to trust for `rediss://`, instead of the system's.
    root_certificates: Vec<u8>,
    replicas: Option<Replicas>,
}

impl RedisBackendBuilder {
    /// The longest any one Redis call may take before it fails with [`Error::Backend`]
    /// (default 1 s): a hung or paused server costs a request at most this (a call whose
    /// connection dropped is sent once more).
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// The longest one connection attempt may take (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// See [`RedisBackend::key_prefix`].
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Trusts the CA whose certificate `pem` holds (PEM text, e.g. the contents of `ca.crt`)
    /// for a `rediss://` URL, instead of the system's CAs: for a private CA or a self-signed
    /// server. May be called more than once; a PEM may hold several certificates.
    ///
    /// The crate calls no `CryptoProvider::install_default` of its own, but redis-rs builds
    /// its TLS configuration from the process default, and rustls sets that to ring by itself
    /// at the first `rediss://` connection attempt. An application that uses another
    /// provider (aws-lc-rs) installs it before the backend first connects.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use tower_distributed_limit::RedisBackend;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let ca = std::fs::read("/etc/redis/tls/ca.crt")?;
    /// let redis = RedisBackend::builder("rediss://cache.internal:6380")
    ///     .add_root_certificate_pem(ca)
    ///     .connect()
    ///     .await?;
    /// # let _ = redis; Ok(()) }
    /// ```
    pub fn add_root_certificate_pem(mut self, pem: impl AsRef<[u8]>) -> Self {
        self.root_certificates.extend_from_slice(pem.as_ref());
        self.root_certificates.push(b'\n');
        self
    }

    /// A grant counts only once `count` replicas acknowledged it (Redis `WAIT`, sent in the same
    /// pipeline as the script, so no extra round trip): an acquire, a renewal or a claim that
    /// is not acknowledged within `timeout` fails as [`Error::Backend`] (and the acquire's
    /// outage policy decides), and an acquired slot is given back. A waiter whose grant is
    /// announced confirms it the same way before its `acquire` returns.
    ///
    /// This protects against a failover that loses the last grants (the promoted replica never
    /// saw them, so it would admit others above the limit). It is not consensus: replication
    /// stays asynchronous, and an acknowledged write can still be lost if every replica that
    /// saw it fails too. `WAIT` holds this process's connection until the replicas answer, so
    /// keep `timeout` short (tens of milliseconds).
    ///
    /// On a Cluster, `WAIT` goes to the node that owns the semaphore's slot, with its script
    /// call. Through Sentinel, too few acknowledgements also mean the master may have been
    /// deposed (its replicas follow the new one): the sentinels are asked, and the call goes
    /// once more to the master they name.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_distributed_limit::RedisBackend;
    ///
    /// # async fn run() -> Result<(), tower_distributed_limit::Error> {
    /// let redis = RedisBackend::builder("redis://primary.internal:6379")
    ///     .wait_for_replicas(1, Duration::from_millis(50))
    ///     .connect()
    ///     .await?;
    /// # let _ = redis; Ok(()) }
    /// ```
    pub fn wait_for_replicas(mut self, count: u32, timeout: Duration) -> Self {
        self.replicas = Some(Replicas { count, timeout });
        self
    }

    /// Connects. Fails with [`Error::Config`] for a malformed URL, a zero timeout, or root
    /// certificates for a plain `redis://` URL, and with [`Error::Backend`] when the server
    /// cannot be reached now (or its TLS certificate is not trusted) within the connect
    /// timeout. To start whether Redis is up or not, use
    /// [`connect_lazy`](Self::connect_lazy).
    pub async fn connect(self) -> Result<RedisBackend, Error> {
        let backend = self.build()?;
        let shared = &backend.shared;
        let bound = shared.target.open_bound();
        let opened = tokio::time::timeout(
            bound,
            Conn::open(shared.target.clone(), shared.pushes.clone()),
        )
        .await
        .unwrap_or_else(|_| {
            Err(RedisError::from((
                ErrorKind::Io,
                "no answer within the connect timeout",
                format!("{bound:?}"),
            )))
        });
        match opened {
            Ok(conn) => {
                shared.opened(conn);
                shared.health.started();
                Ok(backend)
            }
            Err(e) => Err(connect_error(e, &shared.target, shared.health.label())),
        }
    }

    /// Like [`connect`](Self::connect), but returns at once, whether Redis is up or not: the
    /// backend starts down (every call fails at once with [`Error::Backend`], so each
    /// semaphore's [`OutagePolicy`](crate::OutagePolicy) decides) and comes up by itself as
    /// soon as a background probe reaches the server. A service built this way starts during
    /// a Redis outage instead of crash-looping.
    ///
    /// Fails only with [`Error::Config`]: a malformed URL or option, or no tokio runtime to
    /// run the probe on (call it inside one).
    ///
    /// # Example
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_distributed_limit::{OutagePolicy, RedisBackend, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// // Nothing listens here: the backend is built anyway, and the policy decides.
    /// let redis = RedisBackend::builder("redis://127.0.0.1:1")
    ///     .connect_timeout(Duration::from_millis(100))
    ///     .connect_lazy()
    ///     .unwrap();
    /// let sem = Semaphore::builder("api")
    ///     .limit(10)
    ///     .on_outage(OutagePolicy::Local { limit: 2 })
    ///     .build(redis)
    ///     .unwrap();
    /// let permit = sem.acquire().await.unwrap();
    /// assert!(permit.is_degraded());
    /// # }
    /// ```
    pub fn connect_lazy(self) -> Result<RedisBackend, Error> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::config(
                "connect_lazy needs a tokio runtime to reconnect on: call it inside one",
            ));
        }
        let backend = self.build()?;
        health::start(&backend.shared);
        Ok(backend)
    }

    /// The backend these settings describe, down until its server is reached.
    fn build(self) -> Result<RedisBackend, Error> {
        let nodes = self.nodes?;
        if self.call_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::config(
                "Redis call and connect timeouts must be more than zero",
            ));
        }
        if let Some(Replicas { count, timeout }) = self.replicas
            && (count == 0 || timeout < Duration::from_millis(1))
        {
            return Err(Error::config(format!(
                "wait_for_replicas({count}, {timeout:?}): ask for at least 1 replica and a timeout \
                 of at least 1 ms (a zero WAIT timeout would block for ever)"
            )));
        }
        let infos = match &nodes {
            Nodes::Single(info) => std::slice::from_ref(&**info),
            Nodes::Cluster(infos) | Nodes::Sentinel(infos, _) => &infos[..],
        };
        let tls = infos
            .iter()
            .filter(|info| matches!(info.addr(), ConnectionAddr::TcpTls { .. }))
            .count();
        if tls != 0 && tls != infos.len() {
            return Err(Error::config(
                "the cluster's URLs mix redis:// and rediss://; use one scheme for every node",
            ));
        }
        let tls = tls != 0;
        if !self.root_certificates.is_empty() && !tls {
            return Err(Error::config(
                "add_root_certificate_pem applies to TLS connections: use a rediss:// URL",
            ));
        }
        let label = match &nodes {
            Nodes::Single(info) => info.addr().to_string(),
            Nodes::Cluster(infos) => format!("{} (cluster)", infos[0].addr()),
            Nodes::Sentinel(_, master) => format!("master {master:?} (via the sentinels)"),
        };
        let cluster = matches!(nodes, Nodes::Cluster(_));
        // Without WAIT only: with it, a grant counts once a replica has it (and Sentinel
        // promotes the replica that has the most), and a deposed master soon has no replica
        // left to acknowledge one.
        let promotion_fence = (matches!(nodes, Nodes::Sentinel(..)) && self.replicas.is_none())
            .then_some(sentinel::CONFIRM + self.call_timeout);
        let target = Target {
            nodes,
            tls,
            call_timeout: self.call_timeout,
            connect_timeout: self.connect_timeout,
            certificates: (!self.root_certificates.is_empty()).then_some(TlsCertificates {
                client_tls: None,
                root_cert: Some(self.root_certificates),
            }),
        };

        let (subscribe, requests) = mpsc::unbounded_channel();
        let hub = Arc::new(Hub::new(Some(subscribe)));
        let reconnects = Arc::new(watch::Sender::new(0));
        let notify = Arc::downgrade(&hub);
        let ticks = Arc::downgrade(&reconnects);
        let health = Health::new(label, target.open_bound() + self.call_timeout);
        let kick = health.kicker();
        let pushes = Arc::new(move |push: PushInfo| {
            if push.kind == PushKind::Disconnection {
                if let Some(ticks) = ticks.upgrade() {
                    ticks.send_modify(|n| *n += 1);
                }
                // A new connection (Sentinel named a new master): a probe waiting out its
                // back-off tries at once.
                kick.notify_one();
            }
            on_push(&notify, push);
        });
        Ok(RedisBackend {
            shared: Arc::new(Connection {
                conn: OnceLock::new(),
                health,
                target,
                pushes,
                requests: Mutex::new(Some(requests)),
                cluster,
                hub,
                call_timeout: self.call_timeout,
                reconnects,
                replicas: self.replicas,
                promotion_fence,
                eviction: Arc::default(),
            }),
            prefix: self.prefix.into(),
        })
    }
}

impl Connection {
    /// The connection, if the server is up; refused at once otherwise.
    fn conn(self: &Arc<Self>) -> Result<Conn, Error> {
        health::gate(self)?;
        self.conn
            .get()
            .cloned()
            .ok_or_else(|| Error::backend("Redis was not reached yet", None))
    }

    /// The first connection is open: keep it and start the subscriber on it.
    fn opened(&self, conn: Conn) {
        let conn = self.conn.get_or_init(|| conn);
        if let Some(requests) = lock(&self.requests).take() {
            tokio::spawn(subscriber(conn.clone(), requests));
        }
        self.check_eviction();
    }

    /// Warns, once for each policy seen, when the server may evict the crate's keys: with a
    /// `maxmemory` set and any policy but `noeviction` (every key of a semaphore has a TTL, so
    /// the `volatile-*` policies may take them too), a holder's key can vanish under memory
    /// pressure and the limit be exceeded. Asked at connect and after every reconnect.
    fn check_eviction(&self) {
        let (Some(conn), Ok(runtime)) = (self.conn.get(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let (mut conn, warned) = (conn.clone(), self.eviction.clone());
        let label = self.health.label().to_owned();
        runtime.spawn(async move {
            let mut info = redis::cmd("INFO");
            info.arg("memory");
            let Ok(info) = info.query_async::<Value>(&mut conn).await else {
                return;
            };
            let risk = eviction_risk(&info);
            let mut warned = lock(&warned);
            if let Some(policy) = risk
                .as_ref()
                .filter(|risk| *warned != Some((*risk).clone()))
            {
                tracing::warn!(
                    backend = %label,
                    policy = %policy,
                    "Redis may evict this crate's keys (maxmemory is set, maxmemory-policy is \
                     {policy}): under memory pressure a holder's key can vanish and more than \
                     the limit run at once; set maxmemory-policy noeviction, or give the \
                     semaphores a Redis of their own"
                );
            }
            *warned = risk;
        });
    }

    /// The command that announces a grant: on a cluster, sharded pub/sub (`SPUBLISH`), which
    /// routes by slot like the keys, so a grant travels only to the node that owns the
    /// semaphore instead of being broadcast to every node.
    fn publisher(&self) -> &'static str {
        if self.cluster { "SPUBLISH" } else { "PUBLISH" }
    }
}

impl Reconnect for Connection {
    fn health(&self) -> &Health {
        &self.health
    }

    async fn attempt(&self) -> RedisResult<()> {
        match self.conn.get() {
            Some(conn) => conn.clone().ping().await,
            None => {
                let conn = Conn::open(self.target.clone(), self.pushes.clone()).await?;
                self.opened(conn);
                Ok(())
            }
        }
    }

    fn reconnected(&self) {
        // As after a lost connection: holders renew and waiters check their line at once.
        (self.pushes)(PushInfo {
            kind: PushKind::Disconnection,
            data: Vec::new(),
        });
        self.check_eviction();
    }
}

/// The eviction policy in an `INFO memory` reply (one text, or one per node of a Cluster),
/// when some node may evict keys: a `maxmemory` above 0 with a policy other than `noeviction`.
fn eviction_risk(info: &Value) -> Option<String> {
    match info {
        Value::BulkString(text) => {
            let text = String::from_utf8_lossy(text);
            let field = |name: &str| {
                text.lines()
                    .find_map(|line| line.strip_prefix(name))
                    .map(str::trim)
            };
            let bounded = field("maxmemory:").is_some_and(|bytes| bytes != "0");
            let policy = field("maxmemory_policy:")?;
            (bounded && policy != "noeviction").then(|| policy.to_owned())
        }
        Value::VerbatimString { text, .. } => {
            eviction_risk(&Value::BulkString(text.clone().into_bytes()))
        }
        Value::Map(nodes) => nodes.iter().find_map(|(_, info)| eviction_risk(info)),
        Value::Array(nodes) => nodes.iter().find_map(eviction_risk),
        _ => None,
    }
}

/// Routes a push from the connection: a grant goes to the waiter it names; a lost connection
/// may have swallowed grants, so every waitlist checks its line.
pub(super) fn on_push(hub: &Weak<Hub>, push: PushInfo) {
    let Some(hub) = hub.upgrade() else { return };
    match push.kind {
        PushKind::Message | PushKind::SMessage => {
            if let [Value::BulkString(channel), Value::BulkString(news)] = push.data.as_slice() {
                let Some(list) = std::str::from_utf8(channel).ok().and_then(|c| hub.get(c)) else {
                    return;
                };
                match parse_grant(news) {
                    Some((member, token, until)) => list.grant(member, token, until),
                    // Not a grant (a quorum node freed a slot): the waiters check again.
                    None => list.touch_soon(),
                }
            }
        }
        PushKind::Disconnection => hub.touch_everyone(),
        // The server dropped a sharded subscription (its slot moved): the waiters check their
        // line, and the next one to queue subscribes again.
        PushKind::SUnsubscribe => {
            if let Some(Value::BulkString(channel)) = push.data.first()
                && let Some(list) = std::str::from_utf8(channel).ok().and_then(|c| hub.get(c))
            {
                list.subscribed(false);
            }
        }
        _ => {}
    }
}

/// A grant announcement: `"<member> <token> <deadline ms on the server's clock>"`.
fn parse_grant(grant: &[u8]) -> Option<(&str, u64, Until)> {
    let mut parts = std::str::from_utf8(grant).ok()?.split(' ');
    let member = parts.next()?;
    let token = parts.next()?.parse().ok()?;
    let deadline_ms: u64 = parts.next()?.parse().ok()?;
    Some((member, token, Until::Server(deadline_ms.checked_mul(1000)?)))
}

/// Whatever carries a backend's subscriptions: one connection, or one per node.
pub(super) trait Channels: Send + 'static {
    fn subscribe(&mut self, channel: &str) -> impl Future<Output = RedisResult<()>> + Send;
    fn unsubscribe(&mut self, channels: &[String]) -> impl Future<Output = RedisResult<()>> + Send;
}

impl Channels for Conn {
    fn subscribe(&mut self, channel: &str) -> impl Future<Output = RedisResult<()>> + Send {
        Conn::subscribe(self, channel)
    }

    fn unsubscribe(&mut self, channels: &[String]) -> impl Future<Output = RedisResult<()>> + Send {
        Conn::unsubscribe(self, channels)
    }
}

/// Subscribes the channels waiters ask for, in order, and drops those idle for [`LINGER`].
/// Ends when the backend and all its semaphores are gone.
pub(super) async fn subscriber(
    mut conn: impl Channels,
    mut requests: mpsc::UnboundedReceiver<Arc<Waitlist>>,
) {
    let mut subscribed: HashMap<String, Weak<Waitlist>> = HashMap::new();
    let mut sweep = tokio::time::interval(LINGER);
    loop {
        tokio::select! {
            request = requests.recv() => {
                let Some(list) = request else { return };
                tracing::trace!(target: CALLS, op = "subscribe", "pub/sub call");
                let result = conn.subscribe(list.key()).await;
                match &result {
                    Err(e) => tracing::warn!(channel = list.key(), error = %e,
                        "cannot subscribe to grant announcements; waiters rely on their refresh every second"),
                    Ok(()) => {
                        subscribed.insert(list.key().to_owned(), Arc::downgrade(&list));
                    }
                }
                list.subscribed(result.is_ok());
            }
            _ = sweep.tick() => {
                let mut idle = Vec::new();
                subscribed.retain(|channel, list| {
                    let keep = list.upgrade().is_some_and(|list| !list.release_subscription(LINGER));
                    if !keep {
                        idle.push(channel.clone());
                    }
                    keep
                });
                if idle.is_empty() {
                    continue;
                }
                tracing::trace!(target: CALLS, op = "unsubscribe", "pub/sub call");
                if let Err(e) = conn.unsubscribe(&idle).await {
                    tracing::debug!(error = %e, "unsubscribe failed; the channel stays subscribed until it is asked for again");
                }
            }
        }
    }
}

/// The part of `key` Redis Cluster hashes to pick its slot: the first `{...}` if not empty,
/// else the whole key.
fn slot_tag(key: &str) -> &str {
    key.find('{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.find('}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(key)
}

/// `{name}`: a hash tag that keeps every key of the semaphore in one Cluster slot, whatever the
/// name. `%`, `{` and `}` are percent-encoded, so no name can end the tag early (`}` first would
/// make it empty, and Redis would hash each key whole) or share keys with another name.
fn hash_tag(name: &str) -> String {
    let mut tag = String::with_capacity(name.len() + 2);
    tag.push('{');
    for c in name.chars() {
        match c {
            '%' => tag.push_str("%25"),
            '{' => tag.push_str("%7B"),
            '}' => tag.push_str("%7D"),
            c => tag.push(c),
        }
    }
    tag.push('}');
    tag
}

/// A server state that passes by itself: loading its data set after a restart (`LOADING`),
/// running a long script (`BUSY`), a cluster slot moving (`TRYAGAIN`), no master (`MASTERDOWN`).
fn is_transient(e: &RedisError) -> bool {
    matches!(e.retry_method(), redis::RetryMethod::WaitAndRetry)
        || e.code() == Some("BUSY")
        // A replica, or a master demoted meanwhile: through Sentinel, the next attempt asks
        // the sentinels for the master first.
        || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
}

/// A first connection that failed: what failed, and what to check.
fn connect_error(e: RedisError, target: &Target, label: &str) -> Error {
    let text = health::short(&e);
    // Only where the message leaves the Redis text out is the error kept as the source: its
    // own chain repeats the text.
    let mut source = None;
    let message = if let Nodes::Sentinel(_, master) = &target.nodes {
        format!(
            "cannot reach the master {master:?} through the sentinels ({text}); check the \
             sentinel URLs, that they monitor a master of that name, and that it is up"
        )
    } else if let Some(problem) = access_problem(&e) {
        format!("cannot connect to Redis at {label}: {problem}")
    } else if target.tls && text.contains("certificate") {
        format!(
            "cannot open a TLS connection to Redis at {label}: the server's certificate is not \
             trusted ({text}); add the CA that signed it with \
             RedisBackendBuilder::add_root_certificate_pem, and check the host name it was \
             issued for"
        )
    } else if target.tls {
        format!(
            "cannot open a TLS connection to Redis at {label} ({text}); check that the server \
             is up and speaks TLS on this port (a plain-TCP port never answers the handshake)"
        )
    } else if e.is_connection_refusal() {
        source = Some(Box::new(e) as _);
        format!(
            "cannot connect to Redis at {label}: connection refused; check that the server is \
             up and the URL's host and port are right (connect_lazy starts without it)"
        )
    } else {
        format!(
            "cannot connect to Redis at {label} ({text}); check that the server is up and \
             reachable (connect_lazy starts without it)"
        )
    };
    Error::backend(message, source)
}

/// Credentials or permissions the server refused, in words that say what to change.
fn access_problem(e: &RedisError) -> Option<&'static str> {
    let code = e.code();
    if e.kind() == ErrorKind::AuthenticationFailed || matches!(code, Some("NOAUTH" | "WRONGPASS")) {
        Some(
            "authentication failed (no password, or a wrong one); put the credentials in the \
             URL (redis://:password@host:port, or redis://user:password@host:port with ACLs) or \
             in the ConnectionInfo given to the builder",
        )
    } else if e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) {
        Some(
            "the Redis user lacks a permission (ACL NOPERM); allow it EVAL, EVALSHA, PUBLISH, \
             SUBSCRIBE, WAIT and PING (SPUBLISH/SSUBSCRIBE on a Cluster) on the keys and \
             channels under the key prefix",
        )
    } else {
        None
    }
}

/// Says what a Redis failure of `what` on the server `label` means and what to do; the
/// Redis error stays the [`source`](std::error::Error::source) where the message leaves its
/// text out, so no text is repeated down the chain.
fn redis_error(e: RedisError, what: &str, label: &str) -> Error {
    let message = if let Some(problem) = access_problem(&e) {
        // The server's words add nothing here, and its error's chain repeats them.
        return Error::backend(
            format!("Redis at {label} refused `{what}`: {problem}"),
            None,
        );
    } else if e.is_timeout() {
        format!(
            "Redis at {label} did not answer `{what}` within the call timeout; it may be \
             overloaded, paused or unreachable. Calls fail at once until it answers again"
        )
    } else if e.is_connection_refusal() {
        format!(
            "Redis at {label} refused the connection for `{what}`; check that the server is up. \
             The connection is re-established by itself once it is"
        )
    } else if e.is_io_error() || e.is_connection_dropped() {
        format!(
            "lost the connection to Redis at {label} during `{what}`; it is re-established by \
             itself once the server answers"
        )
    } else if e.code() == Some("WRONGTYPE") {
        "a key of this semaphore holds a value of another type; something else writes under \
         the key prefix: choose another RedisBackend::key_prefix or delete the key"
            .to_owned()
    } else {
        return Error::backend(
            format!("Redis at {label} rejected `{what}`: {}", health::short(&e)),
            None,
        );
    };
    Error::backend(message, Some(Box::new(e) as _))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_tags_follow_redis_cluster_rules() {
        assert_eq!(slot_tag("dlimit:{api}:holders"), "api");
        assert_eq!(slot_tag("dlimit:{api}:rate"), slot_tag("dlimit:{api}:meta"));
        // The first `{` and the first `}` after it; an empty tag hashes the whole key.
        assert_eq!(slot_tag("a{b}c{d}"), "b");
        assert_eq!(slot_tag("x{}y{z}"), "x{}y{z}");
        assert_eq!(slot_tag("no-braces"), "no-braces");
        assert_eq!(slot_tag("open{only"), "open{only");
        // A prefix with braces of its own decides the slot, as Redis would.
        assert_eq!(slot_tag("app{1}:{api}:rate"), "1");
        // Names are encoded, so a hostile name cannot end the tag early.
        assert_eq!(slot_tag(&format!("dlimit:{}:rate", hash_tag("}x"))), "%7Dx");
    }
}
