//! Permits in Redis, shared by every process and machine that uses the same server.
//!
//! Four keys per semaphore (holders, meta, the waiting line and its liveness deadlines), all
//! under the `{name}` hash tag; every operation is one call of `lua/semaphore.lua`, invoked by
//! SHA (reloaded on NOSCRIPT). Grants to queued waiters are published on the semaphore's
//! channel; a process's waiters share the backend's one multiplexed RESP3 connection,
//! subscribed to a channel only while someone waits on it. Releases of dropped permits ride
//! along with the semaphore's next call.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

mod connection;
mod rate;

use self::connection::{Conn, Nodes, Target};
pub(super) use self::connection::{Pushes, manager_config};
use redis::{
    Client, Cmd, ConnectionAddr, ErrorKind, IntoConnectionInfo, PushInfo, PushKind, RedisError,
    RedisResult, Script, ServerErrorKind, TlsCertificates, Value,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::gcra::{RateKey, Rated};
use super::store::{Attempt, Member, Mode, Opened, Store, sealed::Open};
use crate::Error;
use crate::snapshot::{Holder, Snapshot};
use crate::sync::{BoxFuture, lock};
use crate::waitlist::{CLAIM, ClockReading, Hub, PATIENCE, Refresh, Status, Until, Waitlist};

/// Every operation on a semaphore, in one script.
static SEMAPHORE: Lua = Lua::new(concat!(
    include_str!("../lua/gcra.lua"),
    include_str!("../lua/semaphore.lua")
));

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
/// connection dropped is sent once more (the connection manager reconnects on that error). A
/// server that is loading its data or busy with a script is asked again after a jittered
/// pause, until `until`.
async fn invoke(
    lua: &Lua,
    conn: &mut Conn,
    op: &'static str,
    until: Instant,
    replicas: Option<Replicas>,
    args: impl Fn(&mut Cmd, bool),
) -> RedisResult<(Value, Option<i64>)> {
    let (mut source, mut repeat, mut dropped_once, mut pushes) = (false, false, false, 0);
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

/// The most members one call renews or refreshes, so a long list never blocks Redis for long.
const BATCH: usize = 1000;

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
    conn: Conn,
    hub: Arc<Hub>,
    call_timeout: Duration,
    /// Ticks on every lost connection, so holders renew (and learn of a server that came back
    /// empty) at once.
    reconnects: Arc<watch::Sender<u64>>,
    /// `wait_for_replicas`: how many replicas must acknowledge a grant, and how long to wait.
    replicas: Option<Replicas>,
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
    /// with the default settings of [`RedisBackend::sentinel_builder`]. A call that cannot
    /// reach the master, or finds it demoted (`READONLY`), asks the Sentinels again and
    /// follows a failover: subscriptions move along, waiters check their line and holders
    /// renew at once (a grant the new master never received is reported lost).
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
    /// timeout.
    pub async fn connect(self) -> Result<RedisBackend, Error> {
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
        if self.replicas.is_some() && matches!(nodes, Nodes::Cluster(_)) {
            return Err(Error::config(
                "wait_for_replicas is not supported on Redis Cluster yet (WAIT would not reach \
                 the node that owns the semaphore); use it with a single master",
            ));
        }
        if tls {
            // rustls needs one crypto provider for the process; ring's, unless the
            // application installed another (then this does nothing).
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let target = Target {
            nodes,
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
        let pushes = Arc::new(move |push: PushInfo| {
            if push.kind == PushKind::Disconnection
                && let Some(ticks) = ticks.upgrade()
            {
                ticks.send_modify(|n| *n += 1);
            }
            on_push(&notify, push);
        });
        let master = match &target.nodes {
            Nodes::Sentinel(_, master) => Some(master.clone()),
            _ => None,
        };
        let conn = Conn::open(target, pushes)
            .await
            .map_err(|e| match &master {
                Some(master) => Error::backend(
                    format!(
                        "cannot reach the master {master:?} through the sentinels ({e}); check the \
                     sentinel URLs, that they monitor a master of that name, and that it is up"
                    ),
                    Some(Box::new(e) as _),
                ),
                None => connect_error(e, tls),
            })?;
        tokio::spawn(subscriber(conn.clone(), requests));
        Ok(RedisBackend {
            shared: Arc::new(Connection {
                conn,
                hub,
                call_timeout: self.call_timeout,
                reconnects,
                replicas: self.replicas,
            }),
            prefix: self.prefix.into(),
        })
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

impl Open for RedisBackend {
    fn open(&self, name: &str, limit: u32) -> Opened {
        let base = format!("{}{}", self.prefix, hash_tag(name));
        let channel = format!("{base}:granted");
        // Grants reach the waitlist through the hub, by channel.
        let waitlist = self.shared.hub.waitlist(&channel);
        let store = Arc::new_cyclic(|me| RedisSemaphore {
            me: me.clone(),
            shared: self.shared.clone(),
            keys: ["holders", "meta", "queue", "alive", "since"].map(|key| format!("{base}:{key}")),
            warned: AtomicBool::new(false),
            limit,
            channel,
            outbox: Mutex::default(),
        });
        Opened { store, waitlist }
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

struct RedisSemaphore {
    me: Weak<RedisSemaphore>,
    /// Keeps the connection and the announcement hub alive as long as the semaphore.
    shared: Arc<Connection>,
    keys: [String; 5],
    channel: String,
    /// The limit this process was built with; the one in force is stored with the semaphore.
    limit: u32,
    /// A warning about the two limits differing was logged.
    warned: AtomicBool,
    outbox: Mutex<Outbox>,
}

/// What this process has not sent yet for the semaphore. Releases ride on the next call, or a
/// flush task sends them. Acquires that arrive while an acquire call is in flight wait for it,
/// then all go in the next call together: a group commit that never waits when nothing is in
/// flight, so one request costs one call however many run at once.
#[derive(Default)]
struct Outbox {
    releases: Vec<Arc<str>>,
    /// A flush task is spawned and has not started yet: later releases wait for it.
    flush_pending: bool,
    /// An acquire call is in flight; whoever sent it passes the queued acquires on when it is
    /// answered (see [`Sending`]).
    sending: bool,
    acquires: Vec<Queued>,
}

/// An acquire waiting for the call in flight.
struct Queued {
    member: Arc<str>,
    mode: Mode,
    rate: Option<Rated>,
    until: Option<Instant>,
    /// Dropped unanswered (no runtime left to send it): the caller sends it itself.
    reply: oneshot::Sender<Result<Attempt, Error>>,
}

impl RedisSemaphore {
    fn outbox(&self) -> MutexGuard<'_, Outbox> {
        lock(&self.outbox)
    }

    /// One call of the script: `op` on this semaphore, releasing `releasing` and whatever
    /// releases are waiting to be sent, with the operation's own arguments after those
    /// (`args` is told whether this is a repeat).
    ///
    /// A call whose connection dropped is sent once more: the connection manager reconnects on
    /// that error, and every operation may run twice (an acquire's repeat rechecks its member
    /// instead of adding it again). A server that is loading its data or busy with a script is
    /// asked again after a jittered pause, until `until` (or the call timeout). With
    /// `wait_for_replicas`, a call that may grant (`confirm`) is pipelined with `WAIT`, and
    /// fails unless enough replicas acknowledged it.
    async fn run(
        &self,
        op: &'static str,
        rate_key: Option<&str>,
        releasing: Option<&Member>,
        until: Option<Instant>,
        args: impl Fn(&mut Cmd, bool),
    ) -> Result<Value, Error> {
        let mut carried = Carried {
            semaphore: self,
            members: std::mem::take(&mut self.outbox().releases),
            settled: false,
        };
        let replicas = self
            .shared
            .replicas
            .filter(|_| matches!(op, "acquire" | "touch" | "renew"));
        let until = until.unwrap_or_else(|| Instant::now() + self.shared.call_timeout);
        let mut conn = self.shared.conn.clone();
        let result = invoke(
            &SEMAPHORE,
            &mut conn,
            op,
            until,
            replicas,
            |command, repeat| {
                command
                    .arg(self.keys.len() + usize::from(rate_key.is_some()))
                    .arg(&self.keys[..]);
                if let Some(key) = rate_key {
                    command.arg(key);
                }
                command
                    .arg(op)
                    .arg(&self.channel)
                    .arg(self.shared.conn.publisher())
                    .arg(self.limit)
                    .arg(PATIENCE.as_millis() as u64)
                    .arg(CLAIM.as_millis() as u64)
                    .arg(carried.members.len() + usize::from(releasing.is_some()));
                if let Some(member) = releasing {
                    command.arg(&*member.text);
                }
                for member in &carried.members {
                    command.arg(&**member);
                }
                args(command, repeat);
            },
        )
        .await;
        carried.settled = true;
        let result = result
            .map_err(|e| redis_error(e, op))
            .and_then(|(reply, acked)| match (self.shared.replicas, acked) {
                (Some(replicas), Some(acked)) if acked < i64::from(replicas.count) => {
                    Err(Error::backend(
                        format!(
                            "only {acked} of {} replicas acknowledged `{op}` within {:?} \
                             (wait_for_replicas), so it does not count; check the replicas' \
                             health and lag, or raise the timeout",
                            replicas.count, replicas.timeout
                        ),
                        None,
                    ))
                }
                _ => Ok(reply),
            });
        if let Err(e) = &result
            && !carried.members.is_empty()
        {
            tracing::warn!(error = %e, count = carried.members.len(), "releases failed: those slots free when their leases end");
        }
        result
    }

    /// Logs once when the limit in force is not the one this process was built with.
    fn note_limit(&self, limit: i64) {
        if limit != i64::from(self.limit) && !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                configured = self.limit,
                in_force = limit,
                channel = %self.channel,
                "this semaphore admits by the limit stored with it, not the one this process was \
                 built with; change it for every process with set_limit (or `dlimit set-limit`)"
            );
        }
    }

    /// Sends the waiting releases, unless another call took them meanwhile or an acquire call
    /// in flight will pass them on.
    async fn flush(&self) {
        {
            let outbox = self.outbox();
            if outbox.releases.is_empty() || outbox.sending {
                return;
            }
        }
        // `run` logs a failure; the leases are the fallback.
        let _ = self.run("release", None, None, None, |_, _| {}).await;
    }

    /// Makes sure a flush task will send the waiting releases, unless one is already due to.
    fn schedule_flush(&self) {
        let Some(me) = self.me.upgrade() else { return };
        if std::mem::replace(&mut me.outbox().flush_pending, true) {
            return;
        }
        // The flag goes down when the task starts, or when it is dropped unstarted (its
        // runtime shut down), so a lost task never stops later releases from being sent.
        let pending = FlushPending(me);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    pending.0.outbox().flush_pending = false;
                    pending.0.flush().await;
                });
            }
            Err(_) => {
                drop(pending);
                tracing::warn!(
                    "permit dropped outside a tokio runtime: it is released with the semaphore's \
                     next call, or frees when its lease ends"
                );
            }
        }
    }

    /// Acquires `member`: sent at once when no acquire call is in flight, otherwise with the
    /// acquires queued behind that call, in the next one.
    async fn acquire_batched(
        &self,
        member: &Member,
        mode: Mode,
        until: Option<Instant>,
        rate: Option<&Rated>,
    ) -> Result<Attempt, Error> {
        loop {
            let waiting = {
                let mut outbox = self.outbox();
                if outbox.sending {
                    let (reply, answer) = oneshot::channel();
                    outbox.acquires.push(Queued {
                        member: member.text.clone(),
                        mode,
                        rate: rate.cloned(),
                        until,
                        reply,
                    });
                    Some(answer)
                } else {
                    outbox.sending = true;
                    None
                }
            };
            match waiting {
                // Answered, or dropped unsent (its sender lost its runtime): then send it here.
                Some(answer) => match answer.await {
                    Ok(attempt) => return attempt,
                    Err(_) => continue,
                },
                None => {
                    let mut sending = Sending::new(self);
                    let limiter = rate.map(|rate| &rate.limiter);
                    let cost = rate.map_or(0, |rate| rate.cost);
                    let attempts = self
                        .acquire_all(&[(&*member.text, mode, cost)], limiter, until)
                        .await;
                    sending.answered = true;
                    return attempts?.pop().ok_or_else(|| {
                        Error::backend("the acquire call answered no member", None)
                    });
                }
            }
        }
    }

    /// Sends the acquires queued behind the call that `sending` was for.
    async fn send_queued(mut sending: Sending<Arc<RedisSemaphore>>) {
        // The oldest queued acquires that go with the same rate limiter (or none), in order.
        let queued: Vec<Queued> = {
            let mut outbox = sending.semaphore.outbox();
            let limiter = |q: &Queued| q.rate.as_ref().map(|rate| rate.limiter.clone());
            let first = outbox.acquires.first().and_then(limiter);
            let take = outbox
                .acquires
                .iter()
                .take(BATCH)
                .take_while(|q| limiter(q) == first)
                .count();
            outbox.acquires.drain(..take).collect()
        };
        let limiter = queued
            .first()
            .and_then(|q| q.rate.as_ref())
            .map(|rate| &rate.limiter);
        let members: Vec<(&str, Mode, u32)> = queued
            .iter()
            .map(|q| {
                (
                    &*q.member,
                    q.mode,
                    q.rate.as_ref().map_or(0, |rate| rate.cost),
                )
            })
            .collect();
        let until = queued.iter().map(|q| q.until).max().flatten();
        let attempts = sending
            .semaphore
            .acquire_all(&members, limiter, until)
            .await;
        sending.answered = true;
        match attempts {
            Ok(attempts) => {
                for (queued, attempt) in queued.into_iter().zip(attempts) {
                    let _ = queued.reply.send(Ok(attempt));
                }
            }
            Err(e) => {
                for queued in queued {
                    let _ = queued.reply.send(Err(Error::backend(e.to_string(), None)));
                }
            }
        }
    }

    /// Called when the acquire call in flight was answered, or given up.
    ///
    /// Answered, a task sends the acquires queued meanwhile (else the waiting releases are
    /// flushed). Given up (its caller was cancelled, or its runtime went away), the queued
    /// callers are told to send their own, so none waits for a call nobody will make.
    fn pass_on(&self, answered: bool) {
        let mut outbox = self.outbox();
        // A caller that gave up needs no answer (its claim releases the member if it was sent).
        outbox.acquires.retain(|queued| !queued.reply.is_closed());
        let next = if outbox.acquires.is_empty() || !answered {
            None
        } else {
            self.me
                .upgrade()
                .zip(tokio::runtime::Handle::try_current().ok())
        };
        match next {
            Some((me, runtime)) => {
                runtime.spawn(Self::send_queued(Sending::new(me)));
            }
            None => {
                outbox.sending = false;
                outbox.acquires.clear();
                let releases = !outbox.releases.is_empty();
                drop(outbox);
                if releases {
                    self.schedule_flush();
                }
            }
        }
    }

    /// One acquire call for `members` (each with its mode, and the cost it spends of `rate`
    /// if granted at once), answered in order.
    async fn acquire_all(
        &self,
        members: &[(&str, Mode, u32)],
        rate: Option<&RateKey>,
        until: Option<Instant>,
    ) -> Result<Vec<Attempt>, Error> {
        let sent = Instant::now();
        let reply = self
            .run(
                "acquire",
                rate.map(|rate| &*rate.key),
                None,
                until,
                |script, repeat| {
                    match rate {
                        Some(rate) => script
                            .arg(rate.gcra.rate)
                            .arg(rate.gcra.period_us)
                            .arg(rate.gcra.burst),
                        None => script.arg(0).arg(0).arg(0),
                    };
                    for &(member, mode, cost) in members {
                        let mode = if repeat && mode == Mode::Join {
                            Mode::Recheck
                        } else {
                            mode
                        };
                        script.arg(member).arg(mode_word(mode)).arg(cost);
                    }
                },
            )
            .await?;
        let answers = match &reply {
            Value::Array(answers) if answers.len() == members.len() => answers,
            _ => return Err(unexpected(&reply)),
        };
        answers
            .iter()
            .map(|answer| self.attempt(answer, sent))
            .collect()
    }

    /// One member's answer to an acquire call sent at `sent`.
    fn attempt(&self, reply: &Value, sent: Instant) -> Result<Attempt, Error> {
        let numbers = integers(reply);
        if let Some(&[first, .., limit]) = numbers.as_deref()
            && first != 3
        {
            self.note_limit(limit);
        }
        match numbers.as_deref() {
            Some(&[3, limit]) => Ok(Attempt::TooHeavy {
                limit: u32::try_from(limit).map_err(|_| unexpected(reply))?,
            }),
            Some(&[1, token, left_us, _]) => Ok(Attempt::Granted {
                token: token_of(token).ok_or_else(|| unexpected(reply))?,
                remaining: micros(left_us).ok_or_else(|| unexpected(reply))?,
            }),
            Some(&[2, retry_ms, now_us, _]) => Ok(Attempt::Queued {
                retry_in: millis(retry_ms),
                clock: ClockReading {
                    local: sent,
                    server_us: u64::try_from(now_us).map_err(|_| unexpected(reply))?,
                },
            }),
            Some(&[0, _, _, _]) => Ok(Attempt::Full),
            Some(&[4, retry_us, _]) => Ok(Attempt::RateLimited {
                retry_after: micros(retry_us).ok_or_else(|| unexpected(reply))?,
            }),
            _ => Err(unexpected(reply)),
        }
    }
}

/// Lowers the flush flag when dropped.
struct FlushPending(Arc<RedisSemaphore>);

impl Drop for FlushPending {
    fn drop(&mut self) {
        self.0.outbox().flush_pending = false;
    }
}

/// Held by whoever sends the acquire call in flight (the outbox's `sending`); dropped, it
/// passes the outbox on (see [`RedisSemaphore::pass_on`]).
struct Sending<S: std::ops::Deref<Target = RedisSemaphore>> {
    semaphore: S,
    /// The call was answered (not cancelled, not dropped unstarted).
    answered: bool,
}

impl<S: std::ops::Deref<Target = RedisSemaphore>> Sending<S> {
    fn new(semaphore: S) -> Self {
        Sending {
            semaphore,
            answered: false,
        }
    }
}

impl<S: std::ops::Deref<Target = RedisSemaphore>> Drop for Sending<S> {
    fn drop(&mut self) {
        self.semaphore.pass_on(self.answered);
    }
}

/// A server state that passes by itself: loading its data set after a restart (`LOADING`),
/// running a long script (`BUSY`), a cluster slot moving (`TRYAGAIN`), no master (`MASTERDOWN`).
fn is_transient(e: &RedisError) -> bool {
    matches!(e.retry_method(), redis::RetryMethod::WaitAndRetry) || e.code() == Some("BUSY")
}

/// Releases carried by a call. If the call is cancelled before it is answered they go back to
/// be sent again (releasing twice is harmless); if it fails they are dropped with a warning,
/// so a Redis outage cannot turn into a loop of retries.
struct Carried<'a> {
    semaphore: &'a RedisSemaphore,
    members: Vec<Arc<str>>,
    settled: bool,
}

impl Drop for Carried<'_> {
    fn drop(&mut self) {
        if self.settled || self.members.is_empty() {
            return;
        }
        self.semaphore.outbox().releases.append(&mut self.members);
        self.semaphore.schedule_flush();
    }
}

/// The word the script takes for each mode.
fn mode_word(mode: Mode) -> &'static str {
    match mode {
        Mode::Once => "once",
        Mode::Join => "join",
        Mode::Recheck => "recheck",
    }
}

impl Store for RedisSemaphore {
    fn acquire<'a>(
        &'a self,
        member: &'a Member,
        mode: Mode,
        until: Option<Instant>,
        rate: Option<&'a Rated>,
    ) -> BoxFuture<'a, Result<Attempt, Error>> {
        Box::pin(self.acquire_batched(member, mode, until, rate))
    }

    fn combines(&self, rate: &RateKey) -> bool {
        // One call reaches both keys: the same connection, and on a cluster the same slot.
        rate.backend == Arc::as_ptr(&self.shared) as usize
            && (!self.shared.conn.is_cluster() || slot_tag(&rate.key) == slot_tag(&self.keys[0]))
    }

    fn release<'a>(&'a self, member: &'a Member) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            match self
                .run("release", None, Some(member), None, |_, _| {})
                .await?
            {
                Value::Int(_) => Ok(()),
                other => Err(unexpected(&other)),
            }
        })
    }

    fn release_later(&self, member: Member) {
        let mut outbox = self.outbox();
        outbox.releases.push(member.text);
        // An acquire call in flight passes the releases on when it is answered.
        if !outbox.sending {
            drop(outbox);
            self.schedule_flush();
        }
    }

    fn renew<'a>(
        &'a self,
        members: &'a [Member],
    ) -> BoxFuture<'a, Result<Vec<Option<Duration>>, Error>> {
        Box::pin(async move {
            let mut renewed = Vec::with_capacity(members.len());
            // Batches keep each script call short, however many permits this process holds.
            for batch in members.chunks(BATCH) {
                let reply = self
                    .run("renew", None, None, None, |script, _| {
                        for member in batch {
                            script.arg(&*member.text);
                        }
                    })
                    .await?;
                match integers(&reply) {
                    Some(left) if left.len() == batch.len() => {
                        renewed.extend(left.into_iter().map(micros));
                    }
                    _ => return Err(unexpected(&reply)),
                }
            }
            Ok(renewed)
        })
    }

    fn used(&self) -> BoxFuture<'_, Result<u32, Error>> {
        Box::pin(async move {
            match self.run("used", None, None, None, |_, _| {}).await? {
                Value::Int(used) => Ok(u32::try_from(used.max(0)).unwrap_or(u32::MAX)),
                other => Err(unexpected(&other)),
            }
        })
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        Some(self.shared.reconnects.subscribe())
    }

    fn snapshot(&self) -> BoxFuture<'_, Result<Snapshot, Error>> {
        Box::pin(async move {
            let reply = self.run("snapshot", None, None, None, |_, _| {}).await?;
            parse_snapshot(&reply).ok_or_else(|| unexpected(&reply))
        })
    }

    fn set_limit(&self, limit: u32) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            match self
                .run("set_limit", None, None, None, |script, _| {
                    script.arg(limit);
                })
                .await?
            {
                Value::Int(1) => Ok(()),
                other => Err(unexpected(&other)),
            }
        })
    }

    fn evict<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            match self
                .run("evict", None, None, None, |script, _| {
                    script.arg(id);
                })
                .await?
            {
                Value::Int(evicted) => Ok(evicted == 1),
                other => Err(unexpected(&other)),
            }
        })
    }
}

impl Refresh for RedisSemaphore {
    fn touch<'a>(
        &'a self,
        members: &'a [Arc<str>],
        until: Instant,
    ) -> BoxFuture<'a, Result<(Vec<Status>, Duration), Error>> {
        Box::pin(async move {
            let mut statuses = Vec::with_capacity(members.len());
            let mut retry_in = PATIENCE;
            for batch in members.chunks(BATCH) {
                let reply = self
                    .run("touch", None, None, Some(until), |script, _| {
                        for member in batch {
                            script.arg(&**member);
                        }
                    })
                    .await?;
                let numbers = integers(&reply).ok_or_else(|| unexpected(&reply))?;
                let Some((&retry_ms, rest)) = numbers.split_first() else {
                    return Err(unexpected(&reply));
                };
                if rest.len() != batch.len() * 3 {
                    return Err(unexpected(&reply));
                }
                statuses.extend(rest.chunks_exact(3).map(|status| match *status {
                    [1, token, left_us] => match (token_of(token), micros(left_us)) {
                        (Some(token), Some(remaining)) => Status::Granted { token, remaining },
                        _ => Status::Unknown,
                    },
                    [2, ..] => Status::Queued,
                    _ => Status::Unknown,
                }));
                retry_in = millis(retry_ms);
            }
            Ok((statuses, retry_in))
        })
    }

    fn confirms_grants(&self) -> bool {
        self.shared.replicas.is_some()
    }
}

/// `{limit, used, waiting, now ms, then per holder: member, deadline ms, granted ms}`.
fn parse_snapshot(reply: &Value) -> Option<Snapshot> {
    let Value::Array(items) = reply else {
        return None;
    };
    let int = |value: &Value| -> Option<i64> {
        match value {
            Value::Int(n) => Some(*n),
            Value::BulkString(text) => std::str::from_utf8(text).ok()?.parse().ok(),
            _ => None,
        }
    };
    let (head, rest) = items.split_at_checked(4)?;
    let count = |value: &Value| u32::try_from(int(value)?.max(0)).ok();
    let now = int(&head[3])?;
    let millis = |ms: i64| Duration::from_millis(u64::try_from(ms.max(0)).unwrap_or(0));
    let holders = rest
        .chunks_exact(3)
        .map(|holder| {
            let Value::BulkString(member) = &holder[0] else {
                return None;
            };
            let member = std::str::from_utf8(member).ok()?;
            let mut parts = member.split(':');
            let id = parts.next()?.to_owned();
            let weight = parts.next()?.parse().ok()?;
            let (deadline, granted) = (int(&holder[1])?, int(&holder[2])?);
            Some(Holder {
                id,
                weight,
                held_for: if granted > 0 {
                    millis(now - granted)
                } else {
                    Duration::ZERO
                },
                lease_remaining: millis(deadline - now),
            })
        })
        .collect::<Option<Vec<_>>>()?;
    let mut holders = holders;
    holders.sort_by_key(|holder| std::cmp::Reverse(holder.held_for));
    Some(Snapshot {
        limit: count(&head[0])?,
        used: count(&head[1])?,
        waiting: count(&head[2])?,
        holders,
    })
}

/// A fencing token: positive.
fn token_of(token: i64) -> Option<u64> {
    u64::try_from(token).ok().filter(|&token| token > 0)
}

/// Time left of a lease: positive.
fn micros(us: i64) -> Option<Duration> {
    u64::try_from(us)
        .ok()
        .filter(|&us| us > 0)
        .map(Duration::from_micros)
}

fn millis(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0).max(1))
}

fn integers(reply: &Value) -> Option<Vec<i64>> {
    match reply {
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::Int(n) => Some(*n),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

fn unexpected(reply: &Value) -> Error {
    Error::backend(
        format!(
            "the semaphore script answered {reply:?}, which this version does not understand; \
             is another program or version using the same key prefix?"
        ),
        None,
    )
}

/// A first connection that failed, with what to check; over TLS, the handshake is the usual
/// suspect.
fn connect_error(e: RedisError, tls: bool) -> Error {
    if !tls {
        return redis_error(e, "connect");
    }
    let hint = if e.to_string().contains("certificate") {
        "the server's TLS certificate is not trusted: add the CA that signed it with \
         RedisBackendBuilder::add_root_certificate_pem, and check the host name it was issued for"
    } else {
        "check that the server is up and speaks TLS on this port (a plain-TCP port never \
         answers the TLS handshake, so it times out)"
    };
    Error::backend(
        format!("cannot open a TLS connection to Redis ({e}); {hint}"),
        Some(Box::new(e) as _),
    )
}

/// Says what a Redis failure means for the caller and what to do about it.
fn redis_error(e: RedisError, what: &str) -> Error {
    let message = if e.is_timeout() {
        format!(
            "Redis did not answer `{what}` in time ({e}); it may be overloaded, paused or \
             unreachable. The call is bounded; retry later"
        )
    } else if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
        format!(
            "cannot reach Redis for `{what}` ({e}); check that the server is up and the URL is \
             right. The connection is re-established by itself"
        )
    } else if e.code() == Some("WRONGTYPE") {
        format!(
            "a key of this semaphore holds a value of another type ({e}); something else writes \
             under the key prefix: choose another RedisBackend::key_prefix or delete the key"
        )
    } else {
        format!("Redis rejected the semaphore's `{what}` script ({e})")
    };
    Error::backend(message, Some(Box::new(e) as _))
}
