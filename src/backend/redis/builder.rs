//! Making a [`RedisBackend`]: its constructors (one node, Cluster, Sentinel, your own client),
//! the [`RedisBackendBuilder`] options (timeouts, key prefix, TLS roots, `WAIT`), their checks,
//! and opening the connection, at once (`connect`) or by the background probe
//! (`connect_lazy`, through [`Reconnect`]).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

#[cfg(feature = "tls")]
use redis::TlsCertificates;
use redis::{
    Client, ConnectionAddr, ErrorKind, IntoConnectionInfo, PushInfo, PushKind, RedisError,
    RedisResult,
};
use tokio::sync::{mpsc, watch};

use super::announce::{on_push, subscriber};
use super::connection::{Conn, Nodes, Target};
use super::errors::connect_error;
use super::eviction::Eviction;
use super::{Connection, RedisBackend, Replicas, sentinel};
use crate::Error;
use crate::backend::health::{self, Health, Reconnect};
use crate::backend::member::process_tag;
use crate::backend::store::{bounded_name, default_process_name};
use crate::backend::{ConnectOptions, not_a_url};
use crate::sync::lock;
use crate::waitlist::Hub;

/// Default bounds on every Redis call: a hung or vanished server answers with an error, not a
/// hang.

/// Why a `rediss://` URL is refused by a build without TLS.
#[cfg(not(feature = "tls"))]
const NO_TLS: &str = "rediss:// (TLS) needs the tower-distributed-limit feature `tls`, on by \
    default: this build was made without it (default-features = false); add \
    features = [\"tls\"] or use a redis:// URL";

impl RedisBackend {
    /// Connects to the Redis server at `url` (`redis://host:port/db`, or `rediss://` for TLS,
    /// checked against the system's CAs; see
    /// [`add_root_certificate_pem`](RedisBackendBuilder::add_root_certificate_pem) for a private
    /// CA), with the default settings of [`RedisBackend::builder`].
    ///
    /// Once connected, the connection is re-established by itself. Connect inside the runtime
    /// that will use the backend: the connection's driver task runs there, and stops with it.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL; [`Error::Backend`] when the server cannot be
    /// reached now (see [`connect_lazy`](Self::connect_lazy) to start without it).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves drops the connection being opened; nothing is
    /// left behind.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::builder(url).connect().await
    }

    /// Builds a backend for the Redis server at `url` at once, whether the server is up or
    /// not, with the default settings of [`RedisBackend::builder`]; see
    /// [`RedisBackendBuilder::connect_lazy`].
    ///
    /// # Errors
    ///
    /// Only [`Error::Config`]: a malformed URL, or no tokio runtime.
    ///
    /// # Examples
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
    /// connection always speaks RESP3, which carries the grant announcements. The client is
    /// a `redis::Client` of the version this crate is built with: build it with the
    /// re-exported [`redis`](crate::redis) if your own `redis` dependency differs.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves drops the connection being opened; nothing is
    /// left behind.
    pub async fn from_client(client: Client) -> Result<Self, Error> {
        Self::builder(client.get_connection_info().clone())
            .connect()
            .await
    }

    /// Settings for a connection to the server at `info`: a URL, or a redis-rs
    /// `ConnectionInfo` carrying credentials, TLS or a database.
    ///
    /// # Examples
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
    /// # Examples
    ///
    /// ```no_run
    /// use tower_distributed_limit::{RedisBackend, Semaphore};
    ///
    /// # async fn run() -> Result<(), tower_distributed_limit::Error> {
    /// let redis = RedisBackend::connect_cluster(&["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]).await?;
    /// let sem = Semaphore::builder("llm-api").limit(20).build(redis)?;
    /// # let _ = sem; Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL or none; [`Error::Backend`] when no node can be
    /// reached now.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves drops the connections being opened.
    #[cfg(feature = "cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
    pub async fn connect_cluster<U: IntoConnectionInfo + Clone>(urls: &[U]) -> Result<Self, Error> {
        Self::cluster_builder(urls).connect().await
    }

    /// Connects to the master that the Sentinels at `sentinels` watch under `master_name`,
    /// with the default settings of [`RedisBackend::sentinel_builder`].
    ///
    /// The backend never acts on a deposed master:
    /// - it subscribes to a sentinel's `+switch-master` and asks every sentinel every 250 ms
    ///   which node is the master; a master counts as named only when more than half of all
    ///   the sentinels name it (a sentinel not yet told of a failover is outvoted, and one
    ///   ahead of the others waits for them). On a switch it drops the old master's
    ///   connection at once;
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
    /// Why majorities: sentinels learn of a failover one by one, and none goes back to an
    /// older configuration. A process confirmed on the old master by one majority and a
    /// process that moved to the new one on the word of another share a sentinel, which
    /// answered the first before the second; so every word for the old master was given before
    /// anyone reached the new one, and the promotion fence outlasts what was granted on it.
    /// While the sentinels disagree (a second or two of a failover), or fewer than half
    /// answer, no master is confirmed and calls fail after a second (the outage policy
    /// decides).
    ///
    /// With `wait_for_replicas` there is no fence: a grant counts once a replica has it, and
    /// Sentinel promotes the replica that has the most. What remains then is a grant on the
    /// deposed master by a process that has not heard of the failover yet, acknowledged by a
    /// replica the sentinels have not moved to the new master yet (a window of about a
    /// second); asking for as many replicas as there are closes it, at the cost of every
    /// grant failing while one replica is down.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use tower_distributed_limit::RedisBackend;
    ///
    /// # async fn run() -> Result<(), tower_distributed_limit::Error> {
    /// let redis = RedisBackend::connect_sentinel(&["redis://10.0.0.1:26379"], "mymaster").await?;
    /// # let _ = redis; Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] without a sentinel URL or a master name; [`Error::Backend`] when
    /// no majority of the sentinels names one master, or it cannot be reached now.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves drops the connections being opened.
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
    #[cfg(feature = "cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
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
}

/// Connection settings for a [`RedisBackend`]; made by [`RedisBackend::builder`] or
/// [`RedisBackend::cluster_builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct RedisBackendBuilder {
    nodes: Result<Nodes, Error>,
    options: ConnectOptions,
    /// PEM certificates of the CAs to trust for `rediss://`, instead of the system's.
    root_certificates: Vec<u8>,
    replicas: Option<Replicas>,
    process_name: Option<String>,
}

impl RedisBackendBuilder {
    /// Default settings for `nodes`, or a builder whose `connect` fails for a malformed URL.
    fn new(nodes: Result<Nodes, RedisError>) -> Self {
        Self::with(nodes.map_err(|e| {
            // redis-rs refuses `rediss://` itself when built without TLS: say which feature.
            #[cfg(not(feature = "tls"))]
            if e.kind() == ErrorKind::InvalidClientConfig && e.to_string().contains("TLS") {
                return Error::config(NO_TLS);
            }
            not_a_url(e)
        }))
    }

    /// Default settings for `nodes`, or a builder whose `connect` fails with its error.
    fn with(nodes: Result<Nodes, Error>) -> Self {
        RedisBackendBuilder {
            nodes,
            options: ConnectOptions::default(),
            root_certificates: Vec::new(),
            replicas: None,
            process_name: None,
        }
    }

    /// A builder whose `connect` fails with `error`.
    fn failed(error: Error) -> Self {
        Self::with(Err(error))
    }
}

impl RedisBackendBuilder {
    /// The longest any one Redis call may take before it fails with [`Error::Backend`]
    /// (default 1 s): a hung or paused server costs a request at most this (a call whose
    /// connection dropped is sent once more).
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.options.call_timeout = timeout;
        self
    }

    /// The longest one connection attempt may take (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.options.connect_timeout = timeout;
        self
    }

    /// How this process's holders are named in [`Semaphore::snapshot`](crate::Semaphore::snapshot)
    /// ([`Holder::process`](crate::Holder::process)), the `dlimit` command line and its page:
    /// default `host:pid`. Kept to 64 bytes. The name rides on a semaphore's calls every 30 s,
    /// after a lost connection and after a pause in the process's calls (no call of its own),
    /// and Redis keeps it beside the semaphore while it is used.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), tower_distributed_limit::Error> {
    /// use tower_distributed_limit::RedisBackend;
    ///
    /// let backend = RedisBackend::builder("redis://127.0.0.1:6379")
    ///     .process_name(format!("checkout-7f9c/{}", std::process::id()))
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn process_name(mut self, name: impl Into<String>) -> Self {
        self.process_name = Some(name.into());
        self
    }

    /// See [`RedisBackend::key_prefix`].
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.options.prefix = prefix.into();
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
    /// # Examples
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
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
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
    /// # Examples
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

    /// Connects. To start whether Redis is up or not, use
    /// [`connect_lazy`](Self::connect_lazy).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL, a zero timeout, or root certificates for a plain
    /// `redis://` URL; [`Error::Backend`] when the server cannot be reached now (or its TLS
    /// certificate is not trusted) within the connect timeout.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves drops the connection being opened; nothing is
    /// left behind.
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
    /// # Errors
    ///
    /// Only [`Error::Config`]: a malformed URL or option, or no tokio runtime to run the probe
    /// on (call it inside one).
    ///
    /// # Examples
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
        self.options.check()?;
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
            #[cfg(feature = "cluster")]
            Nodes::Cluster(infos) => &infos[..],
            Nodes::Sentinel(infos, _) => &infos[..],
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
        // A `ConnectionInfo` made by hand can ask for TLS that this build cannot speak.
        #[cfg(not(feature = "tls"))]
        if tls {
            return Err(Error::config(NO_TLS));
        }
        if !self.root_certificates.is_empty() && !tls {
            return Err(Error::config(
                "add_root_certificate_pem applies to TLS connections: use a rediss:// URL",
            ));
        }
        let label = match &nodes {
            Nodes::Single(info) => info.addr().to_string(),
            #[cfg(feature = "cluster")]
            Nodes::Cluster(infos) => format!("{} (cluster)", infos[0].addr()),
            Nodes::Sentinel(_, master) => format!("master {master:?} (via the sentinels)"),
        };
        #[cfg(feature = "cluster")]
        let cluster = matches!(nodes, Nodes::Cluster(_));
        #[cfg(not(feature = "cluster"))]
        let cluster = false;
        // Without WAIT only: with it, a grant counts once a replica has it (and Sentinel
        // promotes the replica that has the most), and a deposed master soon has no replica
        // left to acknowledge one.
        let promotion_fence = (matches!(nodes, Nodes::Sentinel(..)) && self.replicas.is_none())
            .then_some(sentinel::CONFIRM + self.options.call_timeout);
        let target = Target {
            nodes,
            tls,
            call_timeout: self.options.call_timeout,
            connect_timeout: self.options.connect_timeout,
            #[cfg(feature = "tls")]
            certificates: (!self.root_certificates.is_empty()).then_some(TlsCertificates {
                client_tls: None,
                root_cert: Some(self.root_certificates),
            }),
            #[cfg(not(feature = "tls"))]
            certificates: None,
        };

        let (subscribe, requests) = mpsc::unbounded_channel();
        let hub = Arc::new(Hub::new(Some(subscribe)));
        let reconnects = Arc::new(watch::Sender::new(0));
        let notify = Arc::downgrade(&hub);
        let ticks = Arc::downgrade(&reconnects);
        let health = Health::new(label, target.open_bound() + self.options.call_timeout);
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
                call_timeout: self.options.call_timeout,
                reconnects,
                replicas: self.replicas,
                promotion_fence,
                eviction: Eviction::default(),
                functions_refused: AtomicBool::new(false),
                process: format!(
                    "{:08x} {}",
                    process_tag(),
                    self.process_name
                        .map_or_else(default_process_name, bounded_name)
                )
                .into(),
            }),
            prefix: self.options.prefix.into(),
        })
    }
}

impl Connection {
    /// The first connection is open: keep it and start the subscriber on it.
    fn opened(&self, conn: Conn) {
        let conn = self.conn.get_or_init(|| conn);
        if let Some(requests) = lock(&self.requests).take() {
            tokio::spawn(subscriber(conn.clone(), requests));
        }
        self.check_eviction();
    }

    /// Warns when the server may evict the crate's keys (see `eviction.rs`).
    fn check_eviction(&self) {
        if let Some(conn) = self.conn.get() {
            self.eviction.check(conn, self.health.label());
        }
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
        self.hub.up();
        // As after a lost connection: holders renew and waiters check their line at once.
        (self.pushes)(PushInfo {
            kind: PushKind::Disconnection,
            data: Vec::new(),
        });
        self.check_eviction();
    }

    fn went_down(&self, why: String) {
        self.hub.down(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Built without TLS, a `rediss://` URL fails at `connect` with a configuration error that
    /// names the feature, before any connection is tried.
    #[cfg(not(feature = "tls"))]
    #[tokio::test]
    async fn without_the_tls_feature_a_rediss_url_is_a_config_error_naming_it() {
        let outcome = RedisBackend::builder("rediss://127.0.0.1:6380")
            .connect()
            .await;
        let Err(Error::Config(message)) = outcome else {
            panic!("expected a configuration error, got {outcome:?}");
        };
        assert!(message.contains("feature `tls`"), "{message}");
    }

    /// Built with TLS, the same URL is a TLS connection that fails to connect, not a
    /// configuration error.
    #[cfg(feature = "tls")]
    #[tokio::test]
    async fn with_the_tls_feature_a_rediss_url_is_accepted() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map(|addr| addr.port())
            .unwrap();
        let outcome = RedisBackend::builder(format!("rediss://127.0.0.1:{port}").as_str())
            .connect_timeout(Duration::from_millis(200))
            .connect()
            .await;
        assert!(matches!(outcome, Err(Error::Backend(_))), "{outcome:?}");
    }
}
