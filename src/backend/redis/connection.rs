//! The one connection a `RedisBackend` talks through: a single node (redis-rs
//! `ConnectionManager`), a Redis Cluster (redis-rs `ClusterConnection`, which routes each
//! script call to the node that owns its hash slot and follows MOVED/ASK and failovers), or the
//! master that Sentinel names (re-resolved when it fails or turns read-only). All speak RESP3
//! and carry the grant announcements as pushes.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Client, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, Pipeline,
    ProtocolVersion, PushInfo, PushKind, RedisConnectionInfo, RedisError, RedisFuture, RedisResult,
    ServerErrorKind, TlsCertificates, Value,
};

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::sync::lock;

/// Where pushes go: grant announcements and lost connections.
pub(in crate::backend) type Pushes = Arc<dyn Fn(PushInfo) + Send + Sync>;

/// Where the backend connects, with the timeouts every call and connection attempt get.
#[derive(Clone)]
pub(super) struct Target {
    pub(super) nodes: Nodes,
    /// `rediss://`.
    pub(super) tls: bool,
    pub(super) call_timeout: Duration,
    pub(super) connect_timeout: Duration,
    /// Root certificates for TLS (`rediss://`), or `None` for the system's.
    pub(super) certificates: Option<TlsCertificates>,
}

#[derive(Debug, Clone)]
pub(super) enum Nodes {
    Single(Box<ConnectionInfo>),
    Cluster(Vec<ConnectionInfo>),
    /// Sentinels, and the name of the master they watch.
    Sentinel(Vec<ConnectionInfo>, String),
}

/// A connection to one node or to a cluster; cheap to clone (clones share it).
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(Arc<Sentineled>),
}

impl Target {
    /// The longest opening a connection may take: one connect attempt (redis-rs bounds it by
    /// the connect timeout, TLS handshake included); through Sentinel, asking the sentinels
    /// first.
    pub(super) fn open_bound(&self) -> Duration {
        match self.nodes {
            Nodes::Sentinel(..) => self.connect_timeout * 3,
            Nodes::Single(_) | Nodes::Cluster(_) => self.connect_timeout,
        }
    }
}

impl Conn {
    /// Connects, sending pushes (announcements, disconnections) to `pushes`.
    pub(super) async fn open(target: Target, pushes: Pushes) -> RedisResult<Conn> {
        match target.nodes {
            Nodes::Single(info) => {
                let info = *info;
                let settings = info
                    .redis_settings()
                    .clone()
                    .set_protocol(ProtocolVersion::RESP3);
                let info = info.set_redis_settings(settings);
                let client = match target.certificates {
                    Some(certificates) => Client::build_with_tls(info, certificates)?,
                    None => Client::open(info)?,
                };
                Ok(Conn::Single(
                    manager(client, &pushes, target.call_timeout, target.connect_timeout).await?,
                ))
            }
            Nodes::Sentinel(ref sentinels, ref master) => Ok(Conn::Sentinel(
                Sentineled::open(sentinels.clone(), master.clone(), &target, pushes).await?,
            )),
            Nodes::Cluster(nodes) => {
                let mut builder = ClusterClientBuilder::new(nodes)
                    .use_protocol(ProtocolVersion::RESP3)
                    .push_sender(move |push| {
                        pushes(push);
                        Ok::<(), std::convert::Infallible>(())
                    })
                    .response_timeout(target.call_timeout)
                    .connection_timeout(target.connect_timeout)
                    .retries(3);
                if let Some(certificates) = target.certificates {
                    builder = builder.certs(certificates);
                }
                Ok(Conn::Cluster(
                    builder.build()?.get_async_connection().await?,
                ))
            }
        }
    }

    /// Through Sentinel, whether the master moved: the sentinels are asked now, and name
    /// another node than the one we talked to. Elsewhere, `false`.
    pub(super) async fn master_moved(&self) -> bool {
        match self {
            Conn::Sentinel(sentinel) => {
                let Ok(before) = sentinel.current() else {
                    return false;
                };
                sentinel.doubt(before.term);
                let _ = sentinel.follow().await;
                sentinel.current().is_ok_and(|now| now.term != before.term)
            }
            Conn::Single(_) | Conn::Cluster(_) => false,
        }
    }

    /// One round trip: the probe's question whether the server answers.
    pub(super) async fn ping(mut self) -> RedisResult<()> {
        redis::cmd("PING").query_async::<()>(&mut self).await
    }

    pub(super) async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Conn::Single(conn) => conn.subscribe(channel).await,
            Conn::Cluster(conn) => conn.ssubscribe(channel).await,
            Conn::Sentinel(sentinel) => {
                lock(&sentinel.channels).insert(channel.to_owned());
                sentinel.current()?.conn.subscribe(channel).await
            }
        }
    }

    pub(super) async fn unsubscribe(&mut self, channels: &[String]) -> RedisResult<()> {
        match self {
            Conn::Single(conn) => conn.unsubscribe(channels).await,
            Conn::Cluster(conn) => conn.sunsubscribe(channels).await,
            Conn::Sentinel(sentinel) => {
                {
                    let mut subscribed = lock(&sentinel.channels);
                    for channel in channels {
                        subscribed.remove(channel);
                    }
                }
                sentinel.current()?.conn.unsubscribe(channels).await
            }
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(conn) => conn.req_packed_command(cmd),
            Conn::Cluster(conn) => conn.req_packed_command(cmd),
            Conn::Sentinel(sentinel) => Box::pin(sentinel.call(
                async move |mut master| master.req_packed_command(cmd).await,
                demoted,
            )),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(conn) => conn.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(sentinel) => Box::pin(sentinel.call(
                async move |mut master| master.req_packed_commands(pipeline, offset, count).await,
                |replies: &Vec<Value>| replies.iter().any(demoted),
            )),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(conn) => conn.get_db(),
            Conn::Cluster(conn) => conn.get_db(),
            Conn::Sentinel(sentinel) => sentinel.current().map_or(0, |master| master.conn.get_db()),
        }
    }
}

/// A connection manager for one node, sending its pushes to `pushes`.
pub(in crate::backend) async fn manager(
    client: Client,
    pushes: &Pushes,
    call_timeout: Duration,
    connect_timeout: Duration,
) -> RedisResult<ConnectionManager> {
    ConnectionManager::new_with_config(
        client,
        manager_config(pushes, call_timeout, connect_timeout),
    )
    .await
}

/// How every connection manager of the crate is set up: pushes to `pushes`, subscriptions
/// restored after a reconnect, bounded calls, and a single bounded attempt per reconnect.
pub(in crate::backend) fn manager_config(
    pushes: &Pushes,
    call_timeout: Duration,
    connect_timeout: Duration,
) -> ConnectionManagerConfig {
    let pushes = pushes.clone();
    ConnectionManagerConfig::new()
        .set_push_sender(move |push: PushInfo| {
            pushes(push);
            Ok::<(), std::convert::Infallible>(())
        })
        .set_automatic_resubscription()
        .set_response_timeout(Some(call_timeout))
        .set_connection_timeout(Some(connect_timeout))
        // One attempt per reconnect: while a server is down, the backend's probe retries
        // (`health`), and no call waits behind a series of attempts.
        .set_number_of_retries(0)
}

/// How long the sentinels' word that the master is the one we talk to stays good. A call on
/// an older word (the process was frozen, the watcher could not reach a sentinel, the
/// master's connection dropped) asks them first, so no call goes to a deposed master on the
/// strength of old news. The promotion fence of `lua/semaphore.lua` covers this age.
pub(super) const CONFIRM: Duration = Duration::from_secs(1);

/// How often the watcher asks a sentinel which node is the master.
const HEARTBEAT: Duration = Duration::from_millis(250);

/// The master Sentinel names, followed across failovers.
///
/// A watcher task subscribes to a sentinel's `+switch-master` and asks it every
/// [`HEARTBEAT`] which node is the master; on a switch the old master's connection is dropped
/// at once. A call goes only to a master the sentinels named within [`CONFIRM`]; a reply that
/// finds it demoted (`READONLY`, `MASTERDOWN`), a failure to reach it, or a reply from a
/// master deposed while the call was in flight asks the sentinels again, and the call is
/// reported as a dropped connection so the script-call path sends it once more to the new
/// master.
pub(super) struct Sentineled {
    client: tokio::sync::Mutex<SentinelClient>,
    /// The master's connection, its address and its term (how many masters we followed).
    current: Mutex<Option<Master>>,
    /// When the sentinels last named the current master; `None` once its connection dropped
    /// or a call found it demoted.
    confirmed: Mutex<Option<Instant>>,
    pushes: Pushes,
    call_timeout: Duration,
    connect_timeout: Duration,
    /// Channels subscribed, to subscribe again on a new master.
    channels: Mutex<HashSet<String>>,
    sentinels: Vec<ConnectionInfo>,
    master_name: String,
    certificates: Option<TlsCertificates>,
}

#[derive(Clone)]
struct Master {
    conn: ConnectionManager,
    addr: ConnectionAddr,
    term: u64,
}

impl Sentineled {
    /// Connects to the master the sentinels name, and starts the watcher.
    async fn open(
        sentinels: Vec<ConnectionInfo>,
        master_name: String,
        target: &Target,
        pushes: Pushes,
    ) -> RedisResult<Arc<Sentineled>> {
        let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(
            RedisConnectionInfo::default().set_protocol(ProtocolVersion::RESP3),
        );
        let client = SentinelClient::build(
            sentinels.clone(),
            master_name.clone(),
            Some(node),
            SentinelServerType::Master,
        )?;
        let sentinel = Arc::new(Sentineled {
            client: tokio::sync::Mutex::new(client),
            current: Mutex::new(None),
            confirmed: Mutex::new(None),
            pushes,
            call_timeout: target.call_timeout,
            connect_timeout: target.connect_timeout,
            channels: Mutex::default(),
            sentinels,
            master_name,
            certificates: target.certificates.clone(),
        });
        sentinel.follow().await?;
        tokio::spawn(watch(Arc::downgrade(&sentinel)));
        Ok(sentinel)
    }

    fn current(&self) -> RedisResult<Master> {
        lock(&self.current)
            .clone()
            .ok_or_else(|| RedisError::from((ErrorKind::Client, "no master connection yet")))
    }

    fn fresh(&self) -> bool {
        lock(&self.confirmed).is_some_and(|at| at.elapsed() < CONFIRM)
    }

    /// The sentinels' word on `term`'s master is void (its connection dropped, or it said it
    /// is not the master any more): the next call asks them first.
    fn doubt(&self, term: u64) {
        if lock(&self.current).as_ref().is_some_and(|m| m.term == term) {
            *lock(&self.confirmed) = None;
        }
    }

    /// The sentinels named `addr` just now: the current master's word is renewed, or the
    /// master moved.
    async fn named(self: &Arc<Self>, addr: (String, u16)) -> RedisResult<()> {
        let current = self.current()?;
        if same_node(&current.addr, &addr) {
            *lock(&self.confirmed) = Some(Instant::now());
            return Ok(());
        }
        self.doubt(current.term);
        self.follow().await
    }

    /// A master the sentinels named within [`CONFIRM`], asking them first if need be.
    async fn master(self: &Arc<Self>) -> RedisResult<Master> {
        if !self.fresh() {
            self.follow().await?;
        }
        self.current()
    }

    /// One call on the master: `call` is sent to it, and its reply is kept unless the master
    /// turned out to be gone, demoted or deposed meanwhile.
    async fn call<T, F>(self: &Arc<Self>, call: F, demoted: fn(&T) -> bool) -> RedisResult<T>
    where
        F: AsyncFnOnce(ConnectionManager) -> RedisResult<T>,
    {
        let master = self.master().await?;
        let result = call(master.conn).await;
        let doubtful = match &result {
            Ok(reply) => demoted(reply),
            Err(e) => master_may_have_moved(e),
        };
        if doubtful {
            self.doubt(master.term);
            // The call reports what it found; a master that moved is found by the next one.
            let _ = self.follow().await;
        }
        let term = lock(&self.current).as_ref().map(|m| m.term);
        if term != Some(master.term) {
            return Err(RedisError::from((
                ErrorKind::Io,
                "the Sentinel master changed while the call was in flight; the call goes to \
                 the new master",
            )));
        }
        result
    }

    /// Asks the sentinels for the master, unless their word is fresh (another caller just
    /// asked); when it is not the one we talk to, connects to it (redis-rs checks its `ROLE`),
    /// subscribes the channels again, drops the old master's connection and reports a lost
    /// connection (so waiters check their line and holders renew at once).
    async fn follow(self: &Arc<Self>) -> RedisResult<()> {
        let mut sentinels = self.client.lock().await;
        if self.fresh() {
            return Ok(());
        }
        let resolve = sentinels.async_get_client();
        let client = tokio::time::timeout(self.connect_timeout * 2, resolve)
            .await
            .map_err(|_| {
                RedisError::from((ErrorKind::Io, "the sentinels did not answer in time"))
            })??;
        let asked = Instant::now();
        let addr = client.get_connection_info().addr().clone();
        let current = lock(&self.current).clone();
        if current.as_ref().is_some_and(|m| m.addr == addr) {
            *lock(&self.confirmed) = Some(asked);
            return Ok(());
        }
        let term = current.as_ref().map_or(0, |m| m.term + 1);
        let pushes = self.master_pushes(term);
        let mut conn = manager(client, &pushes, self.call_timeout, self.connect_timeout).await?;
        let channels: Vec<String> = lock(&self.channels).iter().cloned().collect();
        if !channels.is_empty() {
            conn.subscribe(&channels).await?;
        }
        *lock(&self.current) = Some(Master {
            conn,
            addr: addr.clone(),
            term,
        });
        *lock(&self.confirmed) = Some(asked);
        drop(sentinels);
        if current.is_some() {
            tracing::warn!(master = %addr, "Sentinel named a new master; following it");
            (self.pushes)(PushInfo {
                kind: PushKind::Disconnection,
                data: Vec::new(),
            });
        }
        Ok(())
    }

    /// The pushes of term `term`'s master: as every connection's, and a lost connection voids
    /// the sentinels' word (it reconnects to the same address; the next call asks them first).
    fn master_pushes(self: &Arc<Self>, term: u64) -> Pushes {
        let me = Arc::downgrade(self);
        Arc::new(move |push: PushInfo| {
            let Some(me) = me.upgrade() else { return };
            if push.kind == PushKind::Disconnection {
                me.doubt(term);
            }
            (me.pushes)(push);
        })
    }
}

/// Whether `addr` is the node the sentinels named as `(host, port)`.
fn same_node(addr: &ConnectionAddr, (host, port): &(String, u16)) -> bool {
    match addr {
        ConnectionAddr::Tcp(h, p)
        | ConnectionAddr::TcpTls {
            host: h, port: p, ..
        } => h == host && p == port,
        _ => false,
    }
}

/// The watcher: one sentinel at a time, subscribed to `+switch-master` and asked every
/// [`HEARTBEAT`] which node is the master, until the `Sentineled` is gone.
async fn watch(me: Weak<Sentineled>) {
    let mut next = 0;
    loop {
        let Some(sentinel) = me.upgrade() else { return };
        let info = sentinel.sentinels[next % sentinel.sentinels.len()].clone();
        next += 1;
        let (switches, mut heard) = mpsc::unbounded_channel();
        let watcher = watcher(&sentinel, info, switches).await;
        drop(sentinel);
        let Ok(mut conn) = watcher else {
            tokio::time::sleep(HEARTBEAT).await;
            continue;
        };
        let mut beat = tokio::time::interval(HEARTBEAT);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = beat.tick() => {}
                switched = heard.recv() => if switched.is_none() { break },
            }
            let Some(sentinel) = me.upgrade() else { return };
            let mut ask = redis::cmd("SENTINEL");
            ask.arg("get-master-addr-by-name")
                .arg(&sentinel.master_name);
            let ask = ask.query_async::<Option<(String, u16)>>(&mut conn);
            let answer = tokio::time::timeout(sentinel.call_timeout, ask).await;
            let Ok(Ok(Some(addr))) = answer else { break };
            // A failed move is retried by the next call or beat.
            let _ = sentinel.named(addr).await;
        }
    }
}

/// A RESP3 connection to one sentinel, subscribed to `+switch-master`; a switch of our master
/// is sent to `switches`.
async fn watcher(
    sentinel: &Sentineled,
    info: ConnectionInfo,
    switches: mpsc::UnboundedSender<()>,
) -> RedisResult<MultiplexedConnection> {
    let settings = info
        .redis_settings()
        .clone()
        .set_protocol(ProtocolVersion::RESP3);
    let info = info.set_redis_settings(settings);
    let client = match sentinel.certificates.clone() {
        Some(certificates) => Client::build_with_tls(info, certificates)?,
        None => Client::open(info)?,
    };
    let prefix = format!("{} ", sentinel.master_name);
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(sentinel.connect_timeout))
        .set_response_timeout(Some(sentinel.call_timeout))
        .set_push_sender(move |push: PushInfo| {
            let ours = matches!(push.data.as_slice(), [_, Value::BulkString(news)]
                if news.starts_with(prefix.as_bytes()));
            if push.kind == PushKind::Disconnection || ours {
                let _ = switches.send(());
            }
            Ok::<(), std::convert::Infallible>(())
        });
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    conn.subscribe("+switch-master").await?;
    Ok(conn)
}

/// A reply that says the node is no longer a writable master. redis-rs hands a server error
/// to a call as a value (`Value::ServerError`) and turns it into an error later.
fn demoted(reply: &Value) -> bool {
    matches!(reply, Value::ServerError(e)
        if matches!(e.kind(), Some(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)))
}

/// An error after which the master may be another node now.
fn master_may_have_moved(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        )
}
