//! Permits in Redis, shared by every process and machine that uses the same server.
//!
//! One sorted set and one hash per semaphore, both under the `{name}` hash tag; every operation
//! is one call of `lua/semaphore.lua`, invoked by SHA (reloaded on NOSCRIPT). Releases are
//! published on the semaphore's channel; waiters in a process share the backend's one
//! multiplexed RESP3 connection, subscribed to a channel only while someone waits on it.

use std::sync::{Arc, LazyLock, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{
    Client, ProtocolVersion, PushInfo, PushKind, RedisError, Script, ScriptInvocation, Value,
};
use tokio::sync::mpsc;

use super::{Attempt, BoxFuture, Handle, sealed::Open};
use crate::Error;
use crate::waitlist::{Hub, Waitlist};

static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/semaphore.lua")));

/// How long a channel stays subscribed after its last local waiter left, so a semaphore that
/// is full on and off does not subscribe and unsubscribe on every wait.
const LINGER: Duration = Duration::from_secs(2);

/// Bounds on every Redis call: a hung or vanished server answers with an error, not a hang.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);

/// Semaphores stored in Redis, shared by every process that uses the same server and prefix.
///
/// Cheap to clone: clones share one multiplexed, auto-reconnecting connection (redis-rs
/// `ConnectionManager`, RESP3), which also carries the release notifications waiters sleep on.
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
    shared: Arc<Shared>,
    prefix: Arc<str>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

struct Shared {
    conn: ConnectionManager,
    hub: Arc<Hub>,
}

impl RedisBackend {
    /// Connects to the Redis server at `url` (`redis://host:port/db`, `rediss://` for TLS when
    /// redis-rs is built with a TLS feature).
    ///
    /// Fails with [`Error::Config`] for a malformed URL and [`Error::Backend`] when the server
    /// cannot be reached now; once connected, the connection is re-established by itself.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let client = Client::open(url).map_err(|e| {
            Error::config(format!(
                "{url:?} is not a Redis URL ({e}); expected e.g. redis://127.0.0.1:6379"
            ))
        })?;
        Self::from_client(client).await
    }

    /// Connects with a client you configured yourself (credentials, TLS, database). The
    /// connection always speaks RESP3, which carries the release notifications.
    pub async fn from_client(client: Client) -> Result<Self, Error> {
        let info = client.get_connection_info().clone();
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let client = Client::open(info.set_redis_settings(settings))
            .map_err(|e| Error::config(format!("cannot use this Redis client: {e}")))?;

        let (subscribe, requests) = mpsc::unbounded_channel();
        let hub = Arc::new(Hub::new(Some(subscribe)));
        let notify = Arc::downgrade(&hub);
        let config = ConnectionManagerConfig::new()
            .set_push_sender(move |push: PushInfo| {
                on_push(&notify, push);
                Ok::<(), std::convert::Infallible>(())
            })
            .set_automatic_resubscription()
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_connection_timeout(Some(CONNECTION_TIMEOUT))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| redis_error(e, "connect"))?;
        tokio::spawn(subscriber(conn.clone(), requests));
        Ok(RedisBackend {
            shared: Arc::new(Shared { conn, hub }),
            prefix: "dlimit:".into(),
        })
    }

    /// Puts every key and channel of this backend's semaphores under `prefix` (default
    /// `"dlimit:"`), to keep apart applications that share a Redis.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into().into();
        self
    }
}

/// Routes a push from the connection: a release wakes that semaphore's local waiters; a lost
/// connection may have swallowed releases, so every waiter tries again.
fn on_push(hub: &Weak<Hub>, push: PushInfo) {
    let Some(hub) = hub.upgrade() else { return };
    match push.kind {
        PushKind::Message => {
            if let [Value::BulkString(channel), Value::BulkString(weight)] = push.data.as_slice() {
                let list = std::str::from_utf8(channel).ok().and_then(|c| hub.get(c));
                let weight = std::str::from_utf8(weight)
                    .ok()
                    .and_then(|w| w.parse().ok());
                if let Some(list) = list {
                    list.wake(weight.unwrap_or(1));
                }
            }
        }
        PushKind::Disconnection => hub.wake_everyone(),
        _ => {}
    }
}

/// Subscribes the channels waiters ask for, in order, and drops those idle for [`LINGER`].
/// Ends when the backend and all its semaphores are gone.
async fn subscriber(
    mut conn: ConnectionManager,
    mut requests: mpsc::UnboundedReceiver<Arc<Waitlist>>,
) {
    let mut subscribed: Vec<(String, Weak<Waitlist>)> = Vec::new();
    let mut sweep = tokio::time::interval(LINGER);
    loop {
        tokio::select! {
            request = requests.recv() => {
                let Some(list) = request else { return };
                let result = conn.subscribe(list.key()).await;
                if let Err(e) = &result {
                    tracing::warn!(channel = list.key(), error = %e, "cannot subscribe to release notifications; waiters fall back to timers");
                } else if !subscribed.iter().any(|(channel, _)| channel == list.key()) {
                    subscribed.push((list.key().to_owned(), Arc::downgrade(&list)));
                }
                list.subscribed(result.is_ok());
            }
            _ = sweep.tick() => {
                let mut idle = Vec::new();
                subscribed.retain(|(channel, list)| {
                    let keep = list.upgrade().is_some_and(|list| !list.release_subscription(LINGER));
                    if !keep {
                        idle.push(channel.clone());
                    }
                    keep
                });
                if !idle.is_empty()
                    && let Err(e) = conn.unsubscribe(&idle).await
                {
                    tracing::debug!(error = %e, "unsubscribe failed; the channel stays subscribed until it is asked for again");
                }
            }
        }
    }
}

impl Open for RedisBackend {
    fn open(&self, name: &str) -> Arc<dyn Handle> {
        // All keys share the `{name}` hash tag, so a semaphore lives in one Cluster slot.
        let base = format!("{}{{{}}}", self.prefix, name);
        let channel = format!("{base}:released");
        Arc::new(RedisSemaphore {
            shared: self.shared.clone(),
            holders: format!("{base}:holders"),
            meta: format!("{base}:meta"),
            waitlist: self.shared.hub.waitlist(&channel),
            channel,
        })
    }
}

struct RedisSemaphore {
    /// Keeps the connection and the notification hub alive as long as the semaphore.
    shared: Arc<Shared>,
    holders: String,
    meta: String,
    channel: String,
    waitlist: Arc<Waitlist>,
}

impl RedisSemaphore {
    /// A call of the script for operation `op` on this semaphore's keys; add its arguments.
    fn script(&self, op: &str) -> ScriptInvocation<'static> {
        let mut invocation = SCRIPT.key(&self.holders);
        invocation.key(&self.meta).arg(op);
        invocation
    }

    async fn run(&self, invocation: &ScriptInvocation<'_>, op: &str) -> Result<Value, Error> {
        invocation
            .invoke_async(&mut self.shared.conn.clone())
            .await
            .map_err(|e| redis_error(e, op))
    }
}

impl Handle for RedisSemaphore {
    fn acquire<'a>(
        &'a self,
        member: &'a str,
        weight: u32,
        limit: u32,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Attempt, Error>> {
        Box::pin(async move {
            let lease_ms = lease.as_millis() as u64;
            let mut script = self.script("acquire");
            script.arg(member).arg(weight).arg(limit).arg(lease_ms);
            let reply = self.run(&script, "acquire").await?;
            match integers(&reply).as_deref() {
                Some([1, token, lease_ms]) if *token > 0 && *lease_ms > 0 => Ok(Attempt::Granted {
                    token: *token as u64,
                    lease: Duration::from_millis(*lease_ms as u64),
                }),
                Some([0, wait_ms]) => Ok(Attempt::Full {
                    retry_in: Duration::from_millis((*wait_ms).max(1) as u64),
                }),
                _ => Err(unexpected(&reply)),
            }
        })
    }

    fn release<'a>(&'a self, member: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            let mut script = self.script("release");
            script.arg(member).arg(&self.channel);
            let reply = self.run(&script, "release").await?;
            match reply {
                Value::Int(0 | 1) => Ok(()),
                other => Err(unexpected(&other)),
            }
        })
    }

    fn used(&self) -> BoxFuture<'_, Result<u32, Error>> {
        Box::pin(async move {
            match self.run(&self.script("used"), "used").await? {
                Value::Int(used) => Ok(u32::try_from(used.max(0)).unwrap_or(u32::MAX)),
                other => Err(unexpected(&other)),
            }
        })
    }

    fn waitlist(&self) -> &Arc<Waitlist> {
        &self.waitlist
    }
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
