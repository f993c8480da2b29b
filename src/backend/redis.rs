//! Permits in Redis, shared by every process and machine that uses the same server.
//!
//! Four keys per semaphore (holders, meta, the waiting line and its liveness deadlines), all
//! under the `{name}` hash tag; every operation is one call of `lua/semaphore.lua`, invoked by
//! SHA (reloaded on NOSCRIPT). Grants to queued waiters are published on the semaphore's
//! channel; a process's waiters share the backend's one multiplexed RESP3 connection,
//! subscribed to a channel only while someone waits on it. Releases of dropped permits ride
//! along with the semaphore's next call.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{
    Client, ConnectionInfo, IntoConnectionInfo, ProtocolVersion, PushInfo, PushKind, RedisError,
    Script, ScriptInvocation, Value,
};
use tokio::sync::mpsc;

use super::{Attempt, BoxFuture, Handle, Member, PATIENCE, Status, sealed::Open};
use crate::Error;
use crate::waitlist::{Hub, Waitlist};

static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/semaphore.lua")));

/// How long a channel stays subscribed after its last local waiter left, so a semaphore that
/// is full on and off does not subscribe and unsubscribe on every wait.
const LINGER: Duration = Duration::from_secs(2);

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
    /// redis-rs is built with a TLS feature), with the default settings of
    /// [`RedisBackend::builder`].
    ///
    /// Fails with [`Error::Config`] for a malformed URL and [`Error::Backend`] when the server
    /// cannot be reached now; once connected, the connection is re-established by itself.
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
        RedisBackendBuilder {
            info: info.into_connection_info().map_err(|e| {
                Error::config(format!(
                    "not a Redis URL ({e}); expected e.g. redis://127.0.0.1:6379"
                ))
            }),
            call_timeout: CALL_TIMEOUT,
            connect_timeout: CONNECT_TIMEOUT,
            prefix: "dlimit:".into(),
        }
    }

    /// Puts every key and channel of this backend's semaphores under `prefix` (default
    /// `"dlimit:"`), to keep apart applications that share a Redis.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into().into();
        self
    }
}

/// Connection settings for a [`RedisBackend`]; made by [`RedisBackend::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct RedisBackendBuilder {
    info: Result<ConnectionInfo, Error>,
    call_timeout: Duration,
    connect_timeout: Duration,
    prefix: String,
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

    /// Connects. Fails with [`Error::Config`] for a malformed URL or a zero timeout, and with
    /// [`Error::Backend`] when the server cannot be reached now.
    pub async fn connect(self) -> Result<RedisBackend, Error> {
        let info = self.info?;
        if self.call_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::config(
                "Redis call and connect timeouts must be more than zero",
            ));
        }
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
            .set_response_timeout(Some(self.call_timeout))
            .set_connection_timeout(Some(self.connect_timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| redis_error(e, "connect"))?;
        tokio::spawn(subscriber(conn.clone(), requests));
        Ok(RedisBackend {
            shared: Arc::new(Shared { conn, hub }),
            prefix: self.prefix.into(),
        })
    }
}

/// Routes a push from the connection: a grant goes to the waiter it names; a lost connection
/// may have swallowed grants, so every waitlist checks its line.
fn on_push(hub: &Weak<Hub>, push: PushInfo) {
    let Some(hub) = hub.upgrade() else { return };
    match push.kind {
        PushKind::Message => {
            if let [Value::BulkString(channel), Value::BulkString(grant)] = push.data.as_slice() {
                let list = std::str::from_utf8(channel).ok().and_then(|c| hub.get(c));
                if let (Some(list), Some((member, token, lease))) = (list, parse_grant(grant)) {
                    list.grant(member, token, lease);
                }
            }
        }
        PushKind::Disconnection => hub.touch_everyone(),
        _ => {}
    }
}

/// A grant announcement: `"<member> <token> <lease ms>"`.
fn parse_grant(grant: &[u8]) -> Option<(&str, u64, Duration)> {
    let mut parts = std::str::from_utf8(grant).ok()?.split(' ');
    let member = parts.next()?;
    let token = parts.next()?.parse().ok()?;
    let lease = Duration::from_millis(parts.next()?.parse().ok()?);
    Some((member, token, lease))
}

/// Subscribes the channels waiters ask for, in order, and drops those idle for [`LINGER`].
/// Ends when the backend and all its semaphores are gone.
async fn subscriber(
    mut conn: ConnectionManager,
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
    fn open(&self, name: &str, limit: u32) -> Arc<dyn Handle> {
        // All keys share the `{name}` hash tag, so a semaphore lives in one Cluster slot.
        let base = format!("{}{{{}}}", self.prefix, name);
        let channel = format!("{base}:granted");
        Arc::new_cyclic(|me| RedisSemaphore {
            me: me.clone(),
            shared: self.shared.clone(),
            keys: ["holders", "meta", "queue", "alive"].map(|key| format!("{base}:{key}")),
            limit,
            waitlist: self.shared.hub.waitlist(&channel),
            channel,
            unsent: Mutex::new(Vec::new()),
        })
    }
}

struct RedisSemaphore {
    me: Weak<RedisSemaphore>,
    /// Keeps the connection and the announcement hub alive as long as the semaphore.
    shared: Arc<Shared>,
    keys: [String; 4],
    channel: String,
    limit: u32,
    waitlist: Arc<Waitlist>,
    /// Releases not sent yet: the next call carries them, or a flush task sends them.
    unsent: Mutex<Vec<Arc<str>>>,
}

impl RedisSemaphore {
    fn unsent(&self) -> std::sync::MutexGuard<'_, Vec<Arc<str>>> {
        self.unsent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// One call of the script: `op` on this semaphore, releasing `releasing` and whatever
    /// releases are waiting to be sent, with the operation's own arguments after those
    /// (`args` is told whether this is the retry).
    ///
    /// A call whose connection dropped is sent once more: the connection manager reconnects on
    /// that error, and every operation may run twice (an acquire's retry is marked not-first,
    /// so it looks its member up instead of adding it again).
    async fn run(
        &self,
        op: &'static str,
        releasing: Option<&Member>,
        args: impl Fn(&mut ScriptInvocation<'static>, bool),
    ) -> Result<Value, Error> {
        let mut carried = Carried {
            semaphore: self,
            members: std::mem::take(&mut *self.unsent()),
            settled: false,
        };
        let invocation = |retry: bool| {
            let mut invocation = SCRIPT.prepare_invoke();
            for key in &self.keys {
                invocation.key(key);
            }
            invocation
                .arg(op)
                .arg(&self.channel)
                .arg(self.limit)
                .arg(carried.members.len() + usize::from(releasing.is_some()));
            if let Some(member) = releasing {
                invocation.arg(&*member.text);
            }
            for member in &carried.members {
                invocation.arg(&**member);
            }
            args(&mut invocation, retry);
            tracing::trace!(target: CALLS, op, carried = carried.members.len(), retry, "script call");
            invocation
        };
        let mut conn = self.shared.conn.clone();
        let mut result = invocation(false).invoke_async(&mut conn).await;
        if result
            .as_ref()
            .is_err_and(RedisError::is_connection_dropped)
        {
            result = invocation(true).invoke_async(&mut conn).await;
        }
        carried.settled = true;
        let result = result.map_err(|e| redis_error(e, op));
        if let Err(e) = &result
            && !carried.members.is_empty()
        {
            tracing::warn!(error = %e, count = carried.members.len(), "releases failed: those slots free when their leases end");
        }
        result
    }

    /// Sends the waiting releases, if no other call took them meanwhile.
    async fn flush(&self) {
        if self.unsent().is_empty() {
            return;
        }
        // `run` logs a failure; the leases are the fallback.
        let _ = self.run("release", None, |_, _| {}).await;
    }

    fn spawn_flush(&self) {
        let Some(me) = self.me.upgrade() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move { me.flush().await });
            }
            Err(_) => tracing::warn!(
                "permit dropped outside a tokio runtime: it is released with the semaphore's next \
                 call, or frees when its lease ends"
            ),
        }
    }
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
        self.semaphore.unsent().append(&mut self.members);
        self.semaphore.spawn_flush();
    }
}

impl Handle for RedisSemaphore {
    fn acquire<'a>(
        &'a self,
        member: &'a Member,
        queue: bool,
        first: bool,
    ) -> BoxFuture<'a, Result<Attempt, Error>> {
        Box::pin(async move {
            let reply = self
                .run("acquire", None, |script, retry| {
                    script
                        .arg(&*member.text)
                        .arg(PATIENCE.as_millis() as u64)
                        .arg(u8::from(queue))
                        .arg(u8::from(first && !retry));
                })
                .await?;
            match integers(&reply).as_deref() {
                Some(&[1, token, lease]) => granted(token, lease).ok_or_else(|| unexpected(&reply)),
                Some(&[2, retry_ms]) => Ok(Attempt::Queued {
                    retry_in: millis(retry_ms),
                }),
                Some(&[0, _]) => Ok(Attempt::Full),
                _ => Err(unexpected(&reply)),
            }
        })
    }

    fn release<'a>(&'a self, member: &'a Member) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            match self.run("release", Some(member), |_, _| {}).await? {
                Value::Int(_) => Ok(()),
                other => Err(unexpected(&other)),
            }
        })
    }

    fn release_later(&self, member: Member) {
        let first = {
            let mut unsent = self.unsent();
            unsent.push(member.text);
            unsent.len() == 1
        };
        if first {
            self.spawn_flush();
        }
    }

    fn touch<'a>(
        &'a self,
        members: &'a [Arc<str>],
    ) -> BoxFuture<'a, Result<(Vec<Status>, Duration), Error>> {
        Box::pin(async move {
            let reply = self
                .run("touch", None, |script, _| {
                    script.arg(PATIENCE.as_millis() as u64);
                    for member in members {
                        script.arg(&**member);
                    }
                })
                .await?;
            let numbers = integers(&reply).ok_or_else(|| unexpected(&reply))?;
            let Some((&retry_ms, rest)) = numbers.split_first() else {
                return Err(unexpected(&reply));
            };
            if rest.len() != members.len() * 3 {
                return Err(unexpected(&reply));
            }
            let statuses = rest
                .chunks_exact(3)
                .map(|status| match *status {
                    [1, token, lease] => match granted(token, lease) {
                        Some(Attempt::Granted { token, lease }) => Status::Granted { token, lease },
                        _ => Status::Unknown,
                    },
                    [2, ..] => Status::Queued,
                    _ => Status::Unknown,
                })
                .collect();
            Ok((statuses, millis(retry_ms)))
        })
    }

    fn renew<'a>(
        &'a self,
        members: &'a [Arc<str>],
    ) -> BoxFuture<'a, Result<Vec<Option<Duration>>, Error>> {
        Box::pin(async move {
            let reply = self
                .run("renew", None, |script, _| {
                    for member in members {
                        script.arg(&**member);
                    }
                })
                .await?;
            match integers(&reply) {
                Some(leases) if leases.len() == members.len() => Ok(leases
                    .into_iter()
                    .map(|ms| u64::try_from(ms).ok().filter(|&ms| ms > 0))
                    .map(|ms| ms.map(Duration::from_millis))
                    .collect()),
                _ => Err(unexpected(&reply)),
            }
        })
    }

    fn used(&self) -> BoxFuture<'_, Result<u32, Error>> {
        Box::pin(async move {
            match self.run("used", None, |_, _| {}).await? {
                Value::Int(used) => Ok(u32::try_from(used.max(0)).unwrap_or(u32::MAX)),
                other => Err(unexpected(&other)),
            }
        })
    }

    fn waitlist(&self) -> &Arc<Waitlist> {
        &self.waitlist
    }
}

fn granted(token: i64, lease_ms: i64) -> Option<Attempt> {
    Some(Attempt::Granted {
        token: u64::try_from(token).ok().filter(|&token| token > 0)?,
        lease: Duration::from_millis(u64::try_from(lease_ms).ok()?),
    })
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
