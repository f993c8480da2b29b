//! Making a [`QuorumBackend`]: [`QuorumBackendBuilder`]'s options and checks, one lazy
//! connection per node, the subscriber over all of them, and the first round of pings.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use redis::aio::ConnectionManager;
use redis::{Client, IntoConnectionInfo, ProtocolVersion, PushInfo, RedisResult};
use tokio::sync::mpsc;

use super::node::{AllNodes, Node};
use super::{Nodes, QuorumBackend};
use crate::Error;
use crate::backend::health::{self, Health, Reconnect};
use crate::backend::redis::announce::{on_push, subscriber};
use crate::backend::redis::short;
use crate::backend::redis::{Pushes, manager_config};
use crate::backend::{ConnectOptions, not_a_url};
use crate::waitlist::Hub;

const DRIFT_FACTOR: f64 = 0.01;

/// Settings for a [`QuorumBackend`]; made by [`QuorumBackend::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct QuorumBackendBuilder {
    urls: Result<Vec<redis::ConnectionInfo>, Error>,
    options: ConnectOptions,
    drift_factor: f64,
}

impl QuorumBackend {
    /// Connects to every master in `urls` (at least 3, independent of each other), with the
    /// default settings of [`QuorumBackend::builder`].
    ///
    /// # Errors
    ///
    /// As [`QuorumBackendBuilder::connect`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves drops the connections being opened.
    pub async fn connect<U: IntoConnectionInfo + Clone>(urls: &[U]) -> Result<Self, Error> {
        Self::builder(urls).connect().await
    }

    /// Settings for a quorum of the masters at `urls`.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_distributed_limit::QuorumBackend;
    ///
    /// # async fn run() -> Result<(), tower_distributed_limit::Error> {
    /// let quorum = QuorumBackend::builder(&["redis://a:6379", "redis://b:6379", "redis://c:6379"])
    ///     .call_timeout(Duration::from_millis(200))
    ///     .clock_drift_factor(0.01)
    ///     .key_prefix("jobs:")
    ///     .connect()
    ///     .await?;
    /// # let _ = quorum; Ok(()) }
    /// ```
    pub fn builder<U: IntoConnectionInfo + Clone>(urls: &[U]) -> QuorumBackendBuilder {
        let infos = urls
            .iter()
            .map(|url| url.clone().into_connection_info())
            .collect::<Result<Vec<_>, _>>()
            .map_err(not_a_url);
        QuorumBackendBuilder {
            urls: infos,
            options: ConnectOptions::default(),
            drift_factor: DRIFT_FACTOR,
        }
    }
}

impl QuorumBackendBuilder {
    /// The longest any call to one node may take (default 1 s); a node slower than that is
    /// counted out of that call's majority.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.options.call_timeout = timeout;
        self
    }

    /// The longest one connection attempt may take (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.options.connect_timeout = timeout;
        self
    }

    /// How far the nodes' and this process's clocks may drift apart, as a share of the lease
    /// (default 0.01, plus 2 ms): a grant is believed for `lease − elapsed − drift`.
    pub fn clock_drift_factor(mut self, factor: f64) -> Self {
        self.drift_factor = factor;
        self
    }

    /// Puts every key and channel under `prefix` (default `"dlimit:"`).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.options.prefix = prefix.into();
        self
    }

    /// Connects to every node. A node that cannot be reached now is probed in the background
    /// and counts again once it answers.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for fewer than 3 URLs, a bad URL, a zero timeout or a drift factor
    /// outside 0..1; [`Error::Backend`] when fewer than a majority of the nodes can be reached.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves drops the connections being opened.
    pub async fn connect(self) -> Result<QuorumBackend, Error> {
        let connect_timeout = self.options.connect_timeout;
        let backend = self.build()?;
        let nodes = &backend.shared.nodes;
        let pings = nodes.iter().map(|node| {
            let ping = node.attempt();
            async move { tokio::time::timeout(connect_timeout, ping).await }
        });
        let mut errors = Vec::new();
        for (node, result) in nodes.iter().zip(join_all(pings).await) {
            let error = match result {
                Ok(Ok(())) => {
                    node.health.started();
                    continue;
                }
                Ok(Err(e)) => short(&e),
                Err(_) => "no answer within the connect timeout".into(),
            };
            errors.push(format!("{}: {error}", node.health.label()));
            health::start(node);
        }
        let total = nodes.len();
        if total - errors.len() <= total / 2 {
            return Err(Error::backend(
                format!(
                    "only {} of {total} quorum nodes could be reached ({}); a majority is needed \
                     (connect_lazy starts without them)",
                    total - errors.len(),
                    errors.join("; ")
                ),
                None,
            ));
        }
        if !errors.is_empty() {
            tracing::warn!(errors = %errors.join("; "), "some quorum nodes are unreachable now; they count again once they answer");
        }
        Ok(backend)
    }

    /// Like [`connect`](Self::connect), but returns at once, whether the nodes are up or not:
    /// each node starts down and comes up by itself when a background probe reaches it; until
    /// a majority is up, every call fails at once with [`Error::Backend`] and the outage
    /// policy decides.
    ///
    /// # Errors
    ///
    /// Only [`Error::Config`], as for [`connect`](Self::connect), and outside a tokio runtime.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::QuorumBackend;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let quorum = QuorumBackend::builder(&["redis://127.0.0.1:1", "redis://127.0.0.1:2", "redis://127.0.0.1:3"])
    ///     .connect_lazy()
    ///     .unwrap();
    /// # let _ = quorum;
    /// # }
    /// ```
    pub fn connect_lazy(self) -> Result<QuorumBackend, Error> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::config(
                "connect_lazy needs a tokio runtime to reconnect on: call it inside one",
            ));
        }
        let backend = self.build()?;
        for node in &backend.shared.nodes {
            health::start(node);
        }
        Ok(backend)
    }

    /// The backend, every node down until it is reached.
    fn build(self) -> Result<QuorumBackend, Error> {
        let urls = self.urls?;
        if urls.len() < 3 {
            return Err(Error::config(format!(
                "a quorum needs at least 3 independent masters, got {}; with fewer, use \
                 RedisBackend",
                urls.len()
            )));
        }
        self.options.check()?;
        if !(0.0..1.0).contains(&self.drift_factor) {
            return Err(Error::config(format!(
                "clock drift factor {} is outside 0 ..= 1",
                self.drift_factor
            )));
        }
        let (subscribe, requests) = mpsc::unbounded_channel();
        let hub = Arc::new(Hub::new(Some(subscribe)));
        let notify = Arc::downgrade(&hub);
        let pushes: Pushes = Arc::new(move |push: PushInfo| on_push(&notify, push));
        // Every node is kept, reachable now or not: a majority counts all of them, and a node
        // that comes back is used again.
        let config = manager_config(
            &pushes,
            self.options.call_timeout,
            self.options.connect_timeout,
        );
        let bound = self.options.connect_timeout + self.options.call_timeout;
        let nodes = urls
            .into_iter()
            .map(|info| {
                let label = info.addr().to_string();
                let settings = info
                    .redis_settings()
                    .clone()
                    .set_protocol(ProtocolVersion::RESP3);
                let client = Client::open(info.set_redis_settings(settings))?;
                Ok(Arc::new(Node {
                    conn: ConnectionManager::new_lazy_with_config(client, config.clone())?,
                    health: Health::new(label, bound),
                    hub: Arc::downgrade(&hub),
                    back: tokio::sync::watch::Sender::new(0),
                }))
            })
            .collect::<RedisResult<Vec<_>>>()
            .map_err(|e| Error::config(format!("cannot use these Redis URLs: {e}")))?;
        let conns = nodes.iter().map(|node| node.conn.clone()).collect();
        tokio::spawn(subscriber(AllNodes(conns), requests));
        Ok(QuorumBackend {
            shared: Arc::new(Nodes {
                nodes,
                hub,
                drift_factor: self.drift_factor,
                call_timeout: self.options.call_timeout,
            }),
            prefix: self.options.prefix.into(),
        })
    }
}
