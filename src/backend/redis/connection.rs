//! The one connection a `RedisBackend` talks through: a single node (redis-rs
//! `ConnectionManager`) or a Redis Cluster (redis-rs `ClusterConnection`, which routes each
//! script call to the node that owns its hash slot and follows MOVED/ASK and failovers). Both
//! speak RESP3 and carry the grant announcements as pushes.

use std::time::Duration;

use redis::aio::{AsyncPushSender, ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{
    Client, Cmd, ConnectionInfo, Pipeline, ProtocolVersion, RedisFuture, RedisResult,
    TlsCertificates, Value,
};

/// Where the backend connects, with the timeouts every call and connection attempt get.
pub(super) struct Target {
    pub(super) nodes: Nodes,
    pub(super) call_timeout: Duration,
    pub(super) connect_timeout: Duration,
    /// Root certificates for TLS (`rediss://`), or `None` for the system's.
    pub(super) certificates: Option<TlsCertificates>,
}

#[derive(Debug)]
pub(super) enum Nodes {
    Single(Box<ConnectionInfo>),
    Cluster(Vec<ConnectionInfo>),
}

/// A connection to one node or to a cluster; cheap to clone (clones share it).
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Conn {
    /// Connects, sending pushes (announcements, disconnections) to `pushes`.
    pub(super) async fn open(target: Target, pushes: impl AsyncPushSender) -> RedisResult<Conn> {
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
                let config = ConnectionManagerConfig::new()
                    .set_push_sender(pushes)
                    .set_automatic_resubscription()
                    .set_response_timeout(Some(target.call_timeout))
                    .set_connection_timeout(Some(target.connect_timeout))
                    .set_number_of_retries(2)
                    .set_max_delay(Duration::from_millis(500));
                Ok(Conn::Single(
                    ConnectionManager::new_with_config(client, config).await?,
                ))
            }
            Nodes::Cluster(nodes) => {
                let mut builder = ClusterClientBuilder::new(nodes)
                    .use_protocol(ProtocolVersion::RESP3)
                    .push_sender(pushes)
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

    /// The command that announces a grant: on a cluster, sharded pub/sub (`SPUBLISH`), which
    /// routes by slot like the keys, so a grant travels only to the node that owns the
    /// semaphore instead of being broadcast to every node.
    pub(super) fn publisher(&self) -> &'static str {
        match self {
            Conn::Single(_) => "PUBLISH",
            Conn::Cluster(_) => "SPUBLISH",
        }
    }

    pub(super) async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Conn::Single(conn) => conn.subscribe(channel).await,
            Conn::Cluster(conn) => conn.ssubscribe(channel).await,
        }
    }

    pub(super) async fn unsubscribe(&mut self, channels: &[String]) -> RedisResult<()> {
        match self {
            Conn::Single(conn) => conn.unsubscribe(channels).await,
            Conn::Cluster(conn) => conn.sunsubscribe(channels).await,
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(conn) => conn.req_packed_command(cmd),
            Conn::Cluster(conn) => conn.req_packed_command(cmd),
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
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(conn) => conn.get_db(),
            Conn::Cluster(conn) => conn.get_db(),
        }
    }
}
