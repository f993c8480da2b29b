//! The one connection a `RedisBackend` talks through: a single node (redis-rs
//! `ConnectionManager`), a Redis Cluster (redis-rs `ClusterConnection`, which routes each
//! script call to the node that owns its hash slot and follows MOVED/ASK and failovers), or the
//! master that Sentinel names (re-resolved when it fails or turns read-only). All speak RESP3
//! and carry the grant announcements as pushes.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    Client, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, Pipeline, ProtocolVersion, PushInfo,
    PushKind, RedisConnectionInfo, RedisError, RedisFuture, RedisResult, ServerErrorKind,
    TlsCertificates, Value,
};

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
            Nodes::Sentinel(sentinels, master) => {
                let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(
                    RedisConnectionInfo::default().set_protocol(ProtocolVersion::RESP3),
                );
                let client = SentinelClient::build(
                    sentinels,
                    master,
                    Some(node),
                    SentinelServerType::Master,
                )?;
                let sentinel = Sentineled {
                    client: tokio::sync::Mutex::new(client),
                    current: Mutex::new(None),
                    pushes,
                    call_timeout: target.call_timeout,
                    connect_timeout: target.connect_timeout,
                    channels: Mutex::default(),
                };
                sentinel.follow().await?;
                Ok(Conn::Sentinel(Arc::new(sentinel)))
            }
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
                let mut master = sentinel.current()?;
                master.subscribe(channel).await
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
                let mut master = sentinel.current()?;
                master.unsubscribe(channels).await
            }
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(conn) => conn.req_packed_command(cmd),
            Conn::Cluster(conn) => conn.req_packed_command(cmd),
            Conn::Sentinel(sentinel) => Box::pin(async move {
                let result = sentinel.current()?.req_packed_command(cmd).await;
                match sentinel.after(result).await? {
                    Outcome::Done(value) => Ok(value),
                    Outcome::Again(mut master) => master.req_packed_command(cmd).await,
                }
            }),
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
            Conn::Sentinel(sentinel) => Box::pin(async move {
                let result = sentinel
                    .current()?
                    .req_packed_commands(pipeline, offset, count)
                    .await;
                match sentinel.after(result).await? {
                    Outcome::Done(values) => Ok(values),
                    Outcome::Again(mut master) => {
                        master.req_packed_commands(pipeline, offset, count).await
                    }
                }
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(conn) => conn.get_db(),
            Conn::Cluster(conn) => conn.get_db(),
            Conn::Sentinel(sentinel) => sentinel.current().map_or(0, |conn| conn.get_db()),
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

/// The master Sentinel names, followed across failovers: a call that fails to reach it, or
/// finds it demoted (`READONLY`), asks the sentinels again, and moves to the new master.
pub(super) struct Sentineled {
    client: tokio::sync::Mutex<SentinelClient>,
    /// The master's connection, and its address.
    current: Mutex<Option<(ConnectionManager, ConnectionAddr)>>,
    pushes: Pushes,
    call_timeout: Duration,
    connect_timeout: Duration,
    /// Channels subscribed, to subscribe again on a new master.
    channels: Mutex<HashSet<String>>,
}

/// What a failed call on the Sentinel's master leads to.
enum Outcome<T> {
    Done(T),
    /// The master moved: send the call again there.
    Again(ConnectionManager),
}

impl Sentineled {
    fn current(&self) -> RedisResult<ConnectionManager> {
        lock(&self.current)
            .as_ref()
            .map(|(conn, _)| conn.clone())
            .ok_or_else(|| RedisError::from((ErrorKind::Client, "no master connection yet")))
    }

    /// `result` of a call on the current master: kept, unless it says the master is gone or
    /// demoted and the sentinels name another.
    async fn after<T>(&self, result: RedisResult<T>) -> RedisResult<Outcome<T>> {
        match result {
            Err(e) if master_may_have_moved(&e) => match self.follow().await {
                Ok(Some(master)) => Ok(Outcome::Again(master)),
                _ => Err(e),
            },
            other => other.map(Outcome::Done),
        }
    }

    /// Asks the sentinels for the master; when it is not the one we talk to, connects to it,
    /// subscribes the channels again and reports a lost connection (so waiters check their
    /// line and holders renew at once). The new master's connection, if it changed.
    async fn follow(&self) -> RedisResult<Option<ConnectionManager>> {
        let mut sentinels = self.client.lock().await;
        let resolve = sentinels.async_get_client();
        let client = tokio::time::timeout(self.connect_timeout * 2, resolve)
            .await
            .map_err(|_| {
                RedisError::from((ErrorKind::Io, "the sentinels did not answer in time"))
            })??;
        let addr = client.get_connection_info().addr().clone();
        let same = lock(&self.current)
            .as_ref()
            .is_some_and(|(_, current)| *current == addr);
        if same {
            return Ok(None);
        }
        let mut master = manager(
            client,
            &self.pushes,
            self.call_timeout,
            self.connect_timeout,
        )
        .await?;
        let channels: Vec<String> = lock(&self.channels).iter().cloned().collect();
        if !channels.is_empty() {
            master.subscribe(&channels).await?;
        }
        let moved = lock(&self.current)
            .replace((master.clone(), addr.clone()))
            .is_some();
        drop(sentinels);
        if moved {
            tracing::warn!(master = %addr, "Sentinel named a new master; following it");
            (self.pushes)(PushInfo {
                kind: PushKind::Disconnection,
                data: Vec::new(),
            });
        }
        Ok(Some(master))
    }
}

/// An error after which the master may be another node now.
fn master_may_have_moved(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
}
