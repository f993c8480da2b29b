//! The quorum's nodes: one master each, up or down (`Node`, probed through [`Reconnect`]), and
//! the subscriptions held on all of them at once (`AllNodes`).

use std::sync::Weak;

use futures_util::future::join_all;
use redis::RedisResult;
use redis::aio::ConnectionManager;

use tokio::sync::watch;

use crate::backend::health::{Health, Reconnect};
use crate::backend::redis::announce::Channels;
use crate::waitlist::Hub;

/// One master of the quorum, up or down.
pub(super) struct Node {
    pub(super) conn: ConnectionManager,
    pub(super) health: Health,
    /// Where the waiters are, told when the node answers again.
    pub(super) hub: Weak<Hub>,
    /// Ticks each time the node answers again, for the releases it missed (`owed.rs`).
    pub(super) back: watch::Sender<u64>,
}

impl Reconnect for Node {
    fn health(&self) -> &Health {
        &self.health
    }

    async fn attempt(&self) -> RedisResult<()> {
        redis::cmd("PING")
            .query_async::<()>(&mut self.conn.clone())
            .await
    }

    fn reconnected(&self) {
        self.back.send_modify(|n| *n += 1);
        // A node back may make a majority again: the waiters try now.
        if let Some(hub) = self.hub.upgrade() {
            hub.touch_everyone();
        }
    }
}

/// Subscriptions on every node: a freed slot may be announced by any of them.
pub(super) struct AllNodes(pub(super) Vec<ConnectionManager>);

impl Channels for AllNodes {
    async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        let calls = self.0.iter_mut().map(|node| node.subscribe(channel));
        let results = join_all(calls).await;
        let failed = results.iter().filter(|r| r.is_err()).count();
        match results.into_iter().find_map(Result::err) {
            Some(e) if failed == self.0.len() => Err(e),
            _ => Ok(()),
        }
    }

    async fn unsubscribe(&mut self, channels: &[String]) -> RedisResult<()> {
        let calls = self.0.iter_mut().map(|node| node.unsubscribe(channels));
        join_all(calls).await.into_iter().collect()
    }
}
