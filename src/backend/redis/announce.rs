//! The grant announcements: pushes from the connection routed to the waitlists they concern
//! ([`on_push`]), and the subscriber task that subscribes a semaphore's channel while someone
//! waits on it ([`subscriber`]). The quorum backend uses both, over every node's connection.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::Duration;

use redis::{PushInfo, PushKind, RedisResult, Value};
use tokio::sync::mpsc;

use super::CALLS;
use super::connection::Conn;
use crate::waitlist::{Hub, Until, Waitlist};

/// How long a channel stays subscribed after its last local waiter left, so a semaphore that
/// is full on and off does not subscribe and unsubscribe on every wait.
const LINGER: Duration = Duration::from_secs(2);

/// Routes a push from the connection: a grant goes to the waiter it names; a lost connection
/// may have swallowed grants, so every waitlist checks its line.
pub(in crate::backend) fn on_push(hub: &Weak<Hub>, push: PushInfo) {
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
pub(in crate::backend) trait Channels: Send + 'static {
    /// Subscribes `channel`; fails only when no connection could.
    fn subscribe(&mut self, channel: &str) -> impl Future<Output = RedisResult<()>> + Send;
    /// Unsubscribes `channels`, all in one command per connection.
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
pub(in crate::backend) async fn subscriber(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_names_its_member_token_and_deadline_in_server_microseconds() {
        assert_eq!(
            parse_grant(b"abc:1:30000 7 1700000000123"),
            Some(("abc:1:30000", 7, Until::Server(1_700_000_000_123_000)))
        );
    }

    #[test]
    fn anything_else_is_not_a_grant() {
        for news in [
            &b""[..],
            b"abc:1:30000",
            b"abc:1:30000 7",
            b"abc:1:30000 seven 1700000000123",
            b"abc:1:30000 7 -1",
            // A deadline whose microseconds overflow.
            b"abc:1:30000 7 18446744073709551615",
            b"\xff 7 1",
        ] {
            assert_eq!(parse_grant(news), None, "{news:?}");
        }
    }
}
