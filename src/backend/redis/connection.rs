//! The one connection a `RedisBackend` talks through: a single node (redis-rs
//! `ConnectionManager`), a Redis Cluster (redis-rs `ClusterConnection`, which routes each
//! script call to the node that owns its hash slot and follows MOVED/ASK and failovers), or the
//! master that Sentinel names (re-resolved when it fails or turns read-only). All speak RESP3
//! and carry the grant announcements as pushes.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
#[cfg(feature = "cluster")]
use redis::cluster::ClusterClientBuilder;
#[cfg(feature = "cluster")]
use redis::cluster_async::ClusterConnection;
#[cfg(feature = "cluster")]
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, ConnectionInfo, Pipeline, ProtocolVersion, RedisFuture, RedisResult, Value};

use super::node::{Certificates, NodeSettings, Pushes, client, manager};
use super::sentinel::{Sentineled, demoted};

/// Where the backend connects, with the timeouts every call and connection attempt get.
#[derive(Clone)]
pub(super) struct Target {
    pub(super) nodes: Nodes,
    /// `rediss://`.
    pub(super) tls: bool,
    pub(super) call_timeout: Duration,
    pub(super) connect_timeout: Duration,
    /// Root certificates for TLS (`rediss://`), or `None` for the system's.
    pub(super) certificates: Option<Certificates>,
}

#[derive(Debug, Clone)]
pub(super) enum Nodes {
    Single(Box<ConnectionInfo>),
    #[cfg(feature = "cluster")]
    Cluster(Vec<ConnectionInfo>),
    /// Sentinels, and the name of the master they watch.
    Sentinel(Vec<ConnectionInfo>, String),
}

/// A connection to one node or to a cluster; cheap to clone (clones share it).
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    #[cfg(feature = "cluster")]
    Cluster(ClusterConnection),
    Sentinel(Arc<Sentineled>),
}

impl Target {
    /// How a connection to one node of this target is set up.
    pub(super) fn node(&self) -> NodeSettings {
        NodeSettings {
            call_timeout: self.call_timeout,
            connect_timeout: self.connect_timeout,
            certificates: self.certificates.clone(),
        }
    }

    /// The longest opening a connection may take: one connect attempt (redis-rs bounds it by
    /// the connect timeout, TLS handshake included); through Sentinel, asking the sentinels
    /// first.
    pub(super) fn open_bound(&self) -> Duration {
        match self.nodes {
            Nodes::Sentinel(..) => self.connect_timeout * 3,
            Nodes::Single(_) => self.connect_timeout,
            #[cfg(feature = "cluster")]
            Nodes::Cluster(_) => self.connect_timeout,
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
                let client = client(info, target.certificates)?;
                Ok(Conn::Single(
                    manager(client, &pushes, target.call_timeout, target.connect_timeout).await?,
                ))
            }
            Nodes::Sentinel(ref sentinels, ref master) => Ok(Conn::Sentinel(
                Sentineled::open(sentinels.clone(), master.clone(), &target.node(), pushes).await?,
            )),
            #[cfg(feature = "cluster")]
            Nodes::Cluster(nodes) => {
                let builder = ClusterClientBuilder::new(nodes)
                    .use_protocol(ProtocolVersion::RESP3)
                    .push_sender(move |push| {
                        pushes(push);
                        Ok::<(), std::convert::Infallible>(())
                    })
                    .response_timeout(target.call_timeout)
                    .connection_timeout(target.connect_timeout)
                    .retries(3);
                #[cfg(feature = "tls")]
                let builder = match target.certificates {
                    Some(certificates) => builder.certs(certificates),
                    None => builder,
                };
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
            Conn::Sentinel(sentinel) => sentinel.master_moved().await,
            Conn::Single(_) => false,
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) => false,
        }
    }

    /// One round trip: the probe's question whether the server answers.
    /// Loads the function library `text` where `key` lives: on a cluster, on that key's
    /// master only (as a call by key goes), not on every node.
    // The key routes the load on a cluster only.
    #[cfg_attr(not(feature = "cluster"), allow(unused_variables))]
    pub(super) async fn load_library(&mut self, text: &str, key: &[u8]) -> RedisResult<()> {
        let mut load = redis::cmd("FUNCTION");
        load.arg("LOAD").arg("REPLACE").arg(text);
        match self {
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => {
                let node = Route::with_key(key, SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(node));
                conn.route_command(load, routing).await.map(drop)
            }
            Conn::Single(_) | Conn::Sentinel(_) => load.query_async::<()>(self).await,
        }
    }

    pub(super) async fn ping(mut self) -> RedisResult<()> {
        redis::cmd("PING").query_async::<()>(&mut self).await
    }

    pub(super) async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Conn::Single(conn) => conn.subscribe(channel).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => conn.ssubscribe(channel).await,
            Conn::Sentinel(sentinel) => sentinel.subscribe(channel).await,
        }
    }

    pub(super) async fn unsubscribe(&mut self, channels: &[String]) -> RedisResult<()> {
        match self {
            Conn::Single(conn) => conn.unsubscribe(channels).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => conn.sunsubscribe(channels).await,
            Conn::Sentinel(sentinel) => sentinel.unsubscribe(channels).await,
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(conn) => conn.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
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
            #[cfg(feature = "cluster")]
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
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => conn.get_db(),
            Conn::Sentinel(sentinel) => sentinel.current().map_or(0, |master| master.conn.get_db()),
        }
    }
}
