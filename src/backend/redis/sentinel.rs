//! The master Sentinel names, followed across failovers: a watcher on a sentinel's
//! `+switch-master` and a heartbeat, calls only to a master the sentinels named within a
//! second, and the follow-up of `READONLY`, deposed masters and `WAIT` shortfalls.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, MultiplexedConnection};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, ErrorKind, ProtocolVersion,
    PushInfo, PushKind, RedisConnectionInfo, RedisError, RedisResult, ServerErrorKind,
    TlsCertificates, Value,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::node::{NodeSettings, Pushes, manager};
use crate::sync::lock;

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
pub(super) struct Master {
    pub(super) conn: ConnectionManager,
    addr: ConnectionAddr,
    term: u64,
}

impl Sentineled {
    /// Connects to the master the sentinels name, and starts the watcher.
    pub(super) async fn open(
        sentinels: Vec<ConnectionInfo>,
        master_name: String,
        settings: &NodeSettings,
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
            call_timeout: settings.call_timeout,
            connect_timeout: settings.connect_timeout,
            channels: Mutex::default(),
            sentinels,
            master_name,
            certificates: settings.certificates.clone(),
        });
        sentinel.follow().await?;
        tokio::spawn(watch(Arc::downgrade(&sentinel)));
        Ok(sentinel)
    }

    pub(super) fn current(&self) -> RedisResult<Master> {
        lock(&self.current)
            .clone()
            .ok_or_else(|| RedisError::from((ErrorKind::Client, "no master connection yet")))
    }

    /// Subscribes `channel` on the master, and on every master followed later.
    pub(super) async fn subscribe(&self, channel: &str) -> RedisResult<()> {
        lock(&self.channels).insert(channel.to_owned());
        self.current()?.conn.subscribe(channel).await
    }

    pub(super) async fn unsubscribe(&self, channels: &[String]) -> RedisResult<()> {
        {
            let mut subscribed = lock(&self.channels);
            for channel in channels {
                subscribed.remove(channel);
            }
        }
        self.current()?.conn.unsubscribe(channels).await
    }

    /// Whether the master moved: the sentinels are asked now, and name another node than the
    /// one we talked to.
    pub(super) async fn master_moved(self: &Arc<Self>) -> bool {
        let Ok(before) = self.current() else {
            return false;
        };
        self.doubt(before.term);
        let _ = self.follow().await;
        self.current().is_ok_and(|now| now.term != before.term)
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
    pub(super) async fn call<T, F>(
        self: &Arc<Self>,
        call: F,
        demoted: fn(&T) -> bool,
    ) -> RedisResult<T>
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
pub(super) fn demoted(reply: &Value) -> bool {
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
