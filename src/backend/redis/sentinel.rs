//! The master Sentinel names, followed across failovers: every sentinel is asked, and a
//! master counts as named only when a majority of them name it, so a sentinel that has not
//! heard of a failover yet never sends a call back to the deposed master, and no two
//! processes act on two masters at once for longer than the promotion fence covers.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::aio::{ConnectionManager, MultiplexedConnection};
use redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo,
    ProtocolVersion, PushInfo, PushKind, RedisConnectionInfo, RedisError, RedisResult, Role,
    ServerErrorKind, Value,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::node::{Certificates, NodeSettings, Pushes, client, manager};
use crate::sync::lock;

/// How long the sentinels' word that the master is the one we talk to stays good. A call on
/// an older word (the process was frozen, the watcher could not reach the sentinels, the
/// master's connection dropped) asks them first, so no call goes to a deposed master on the
/// strength of old news. The promotion fence of `lua/semaphore/fence.lua` covers this age.
pub(super) const CONFIRM: Duration = Duration::from_secs(1);

/// How much longer the sentinels that have not answered yet are awaited once a majority has:
/// the one that ran a failover answers as fast as the others, unless it is down or paused.
const STRAGGLERS: Duration = Duration::from_millis(100);

/// How often the watcher asks the sentinels which node is the master.
const HEARTBEAT: Duration = Duration::from_millis(250);

/// The master Sentinel names, followed across failovers.
///
/// A watcher task subscribes to a sentinel's `+switch-master` and asks the sentinels every
/// [`HEARTBEAT`] which node is the master; on a switch the old master's connection is dropped
/// at once. A call goes only to a master the sentinels named within [`CONFIRM`]; a reply that
/// finds it demoted (`READONLY`, `MASTERDOWN`), a failure to reach it, or a reply from a
/// master deposed while the call was in flight asks the sentinels again, and the call is
/// reported as a dropped connection so the script-call path sends it once more to the new
/// master.
///
/// Asking the sentinels means asking every one of them at once and taking the master that
/// more than half of all of them name. The sentinel that ran a failover knows of it first and
/// the others learn within a couple of seconds, so the first answer to come back may name the
/// deposed master; and a sentinel never goes back to an older configuration. So when one
/// process is confirmed on the old master by a majority and another moves to the new one on
/// the word of a majority, a sentinel in both majorities answered the first before the
/// second: every word for the old master was given before anyone reached the new one, whose
/// promotion fence (a lease + [`CONFIRM`] + the call timeout from the first call it sees)
/// outlasts the grants made on that word.
pub(super) struct Sentineled {
    /// One connection per sentinel (opened on first use, dropped when it fails); the lock
    /// makes one caller at a time ask them.
    oracles: tokio::sync::Mutex<Vec<Option<MultiplexedConnection>>>,
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
    certificates: Option<Certificates>,
}

#[derive(Clone)]
pub(super) struct Master {
    pub(super) conn: ConnectionManager,
    addr: (String, u16),
    term: u64,
}

/// What one sentinel says of the master: where it is, and whether the sentinels agree it is
/// down.
#[derive(Debug, PartialEq)]
struct Word {
    addr: (String, u16),
    down: bool,
}

impl Sentineled {
    /// Connects to the master the sentinels name, and starts the watcher.
    pub(super) async fn open(
        sentinels: Vec<ConnectionInfo>,
        master_name: String,
        settings: &NodeSettings,
        pushes: Pushes,
    ) -> RedisResult<Arc<Sentineled>> {
        let sentinel = Arc::new(Sentineled {
            oracles: tokio::sync::Mutex::new(vec![None; sentinels.len()]),
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
    /// asked).
    async fn follow(self: &Arc<Self>) -> RedisResult<()> {
        self.ask(false).await
    }

    /// Asks the sentinels for the master (unless `renew` is false and their word is fresh);
    /// when it is not the one we talk to, connects to it, checks its `ROLE`, subscribes the
    /// channels again, drops the old master's connection and reports a lost connection (so
    /// waiters check their line and holders renew at once).
    async fn ask(self: &Arc<Self>, renew: bool) -> RedisResult<()> {
        let mut oracles = self.oracles.lock().await;
        if !renew && self.fresh() {
            return Ok(());
        }
        let asked = Instant::now();
        let addr = self.word(&mut oracles).await?;
        let current = lock(&self.current).clone();
        if current.as_ref().is_some_and(|m| m.addr == addr) {
            *lock(&self.confirmed) = Some(asked);
            return Ok(());
        }
        let term = current.as_ref().map_or(0, |m| m.term + 1);
        let mut conn = self.connect(&addr, term).await?;
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
        drop(oracles);
        if current.is_some() {
            tracing::warn!(master = %format!("{}:{}", addr.0, addr.1),
                "Sentinel named a new master; following it");
            (self.pushes)(PushInfo {
                kind: PushKind::Disconnection,
                data: Vec::new(),
            });
        }
        Ok(())
    }

    /// Every sentinel asked at once: the master a majority of them name. The answers are
    /// awaited within the connect timeout twice over; once a majority has named one master,
    /// the others get [`STRAGGLERS`] more (their answers are only logged), so a sentinel that
    /// is down or paused slows no beat and no call by more.
    async fn word(
        &self,
        oracles: &mut [Option<MultiplexedConnection>],
    ) -> RedisResult<(String, u16)> {
        let asked = oracles.len();
        let mut asks: FuturesUnordered<_> = oracles
            .iter_mut()
            .zip(&self.sentinels)
            .map(|(cached, info)| async move {
                let answer = async {
                    let conn = match cached {
                        Some(conn) => conn,
                        None => cached.insert(self.oracle(info.clone()).await?),
                    };
                    let mut ask = redis::cmd("SENTINEL");
                    ask.arg("MASTER").arg(&self.master_name);
                    ask.query_async::<HashMap<String, String>>(conn).await
                }
                .await;
                if answer
                    .as_ref()
                    .is_err_and(|e| !matches!(e.kind(), ErrorKind::Server(_)))
                {
                    *cached = None;
                }
                answer
            })
            .collect();
        let mut answers = Vec::with_capacity(asked);
        let mut until = Instant::now() + self.connect_timeout * 2;
        while let Ok(Some(answer)) = tokio::time::timeout_at(until, asks.next()).await {
            answers.push(answer);
            if decide(&answers, asked).is_ok() {
                until = until.min(Instant::now() + STRAGGLERS);
            }
        }
        drop(asks);
        answers.resize_with(asked, || {
            Err(RedisError::from((
                ErrorKind::Io,
                "a sentinel did not answer in time",
            )))
        });
        decide(&answers, asked)
    }

    /// A connection to one sentinel.
    async fn oracle(&self, info: ConnectionInfo) -> RedisResult<MultiplexedConnection> {
        let client = client(info, self.certificates.clone())?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.call_timeout));
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    /// A connection to the master the sentinels named at `addr`, once it says it is one.
    async fn connect(
        self: &Arc<Self>,
        addr: &(String, u16),
        term: u64,
    ) -> RedisResult<ConnectionManager> {
        let info = ConnectionAddr::Tcp(addr.0.clone(), addr.1)
            .into_connection_info()?
            .set_redis_settings(
                RedisConnectionInfo::default().set_protocol(ProtocolVersion::RESP3),
            );
        let client = Client::open(info)?;
        let pushes = self.master_pushes(term);
        let mut conn = manager(client, &pushes, self.call_timeout, self.connect_timeout).await?;
        match redis::cmd("ROLE").query_async::<Role>(&mut conn).await? {
            Role::Primary { .. } => Ok(conn),
            _ => Err(RedisError::from((
                ErrorKind::Io,
                "the node the sentinels name as the master is not one (yet)",
            ))),
        }
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

/// Of the answers of `asked` sentinels, the master more than half of all of them name (the
/// silent ones count against it). A master they agree is down (`o_down`) is no master to
/// call.
fn decide(
    answers: &[RedisResult<HashMap<String, String>>],
    asked: usize,
) -> RedisResult<(String, u16)> {
    let words: Vec<Word> = answers
        .iter()
        .filter_map(|answer| answer.as_ref().ok().and_then(word))
        .collect();
    let named = |addr: &(String, u16)| words.iter().filter(|w| &w.addr == addr).count();
    let Some(majority) = words.iter().find(|w| named(&w.addr) * 2 > asked) else {
        let why = match answers.iter().find_map(|answer| answer.as_ref().err()) {
            Some(e) => format!("; {e}"),
            None if words.len() * 2 > asked => "; they name different masters (a failover \
                 is under way)"
                .to_owned(),
            None => String::new(),
        };
        return Err(RedisError::from((
            ErrorKind::Io,
            "no majority of the sentinels names one master",
            format!("{} of {asked} answered{why}", words.len()),
        )));
    };
    if words.iter().any(|w| w.addr == majority.addr && w.down) {
        return Err(RedisError::from((
            ErrorKind::Io,
            "the sentinels agree the master is down; a failover is under way",
        )));
    }
    Ok(majority.addr.clone())
}

/// One sentinel's `SENTINEL MASTER` answer, read.
fn word(answer: &HashMap<String, String>) -> Option<Word> {
    let port = answer.get("port")?.parse().ok()?;
    Some(Word {
        addr: (answer.get("ip")?.clone(), port),
        down: answer.get("flags")?.contains("o_down"),
    })
}

/// The watcher: subscribed to one sentinel's `+switch-master` at a time, it asks the
/// sentinels every [`HEARTBEAT`] and on every switch which node is the master, until the
/// `Sentineled` is gone.
async fn watch(me: Weak<Sentineled>) {
    let mut next = 0;
    loop {
        let Some(sentinel) = me.upgrade() else { return };
        let info = sentinel.sentinels[next % sentinel.sentinels.len()].clone();
        next += 1;
        let (switches, mut heard) = mpsc::unbounded_channel();
        // Kept for its subscription; without one, the beats go on and the next sentinel is
        // tried after one.
        let subscribed = watcher(&sentinel, info, switches).await.ok();
        drop(sentinel);
        let mut beat = tokio::time::interval(HEARTBEAT);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let lost = tokio::select! {
                _ = beat.tick() => subscribed.is_none(),
                heard = heard.recv() => heard.is_none_or(|lost| lost),
            };
            let Some(sentinel) = me.upgrade() else { return };
            // A failed ask or move is retried by the next call or beat.
            let _ = sentinel.ask(true).await;
            if lost {
                break;
            }
        }
    }
}

/// A RESP3 connection to one sentinel, subscribed to `+switch-master`: a switch of our master
/// sends `false` to `switches`, the connection's loss `true`.
async fn watcher(
    sentinel: &Sentineled,
    info: ConnectionInfo,
    switches: mpsc::UnboundedSender<bool>,
) -> RedisResult<MultiplexedConnection> {
    let settings = info
        .redis_settings()
        .clone()
        .set_protocol(ProtocolVersion::RESP3);
    let info = info.set_redis_settings(settings);
    let client = client(info, sentinel.certificates.clone())?;
    let prefix = format!("{} ", sentinel.master_name);
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(sentinel.connect_timeout))
        .set_response_timeout(Some(sentinel.call_timeout))
        .set_push_sender(move |push: PushInfo| {
            let ours = matches!(push.data.as_slice(), [_, Value::BulkString(news)]
                if news.starts_with(prefix.as_bytes()));
            if push.kind == PushKind::Disconnection {
                let _ = switches.send(true);
            } else if ours {
                let _ = switches.send(false);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(port: &str, flags: &str) -> RedisResult<HashMap<String, String>> {
        Ok(HashMap::from([
            ("ip".to_owned(), "10.0.0.1".to_owned()),
            ("port".to_owned(), port.to_owned()),
            ("flags".to_owned(), flags.to_owned()),
        ]))
    }

    fn silent() -> RedisResult<HashMap<String, String>> {
        Err(RedisError::from((ErrorKind::Io, "refused")))
    }

    #[test]
    fn the_master_is_the_one_a_majority_names() {
        let answers = [
            answer("2", "master"),
            answer("1", "master"),
            answer("2", "master"),
        ];
        assert_eq!(decide(&answers, 3).unwrap(), ("10.0.0.1".to_owned(), 2));
    }

    #[test]
    fn one_sentinel_ahead_or_behind_names_no_master_alone() {
        // The sentinel that ran a failover names the new master; the other two have not heard
        // of it yet: the old one still has a majority.
        let answers = [
            answer("2", "master"),
            answer("1", "master"),
            answer("1", "master"),
        ];
        assert_eq!(decide(&answers, 3).unwrap().1, 1);
        // One heard, one not, one silent: no majority for either.
        let answers = [answer("2", "master"), answer("1", "master"), silent()];
        let err = decide(&answers, 3).unwrap_err();
        assert!(err.to_string().contains("2 of 3 answered"), "{err}");
        // Two that agree decide before the third answers.
        let answers = [answer("2", "master"), answer("2", "master")];
        assert_eq!(decide(&answers, 3).unwrap().1, 2);
    }

    #[test]
    fn a_minority_cannot_name_the_master() {
        let answers = [answer("1", "master"), silent(), silent()];
        let err = decide(&answers, 3).unwrap_err();
        assert!(err.to_string().contains("1 of 3 answered"), "{err}");
        // Half is not a majority.
        let answers = [
            answer("1", "master"),
            answer("1", "master"),
            silent(),
            silent(),
        ];
        assert!(decide(&answers, 4).is_err());
    }

    #[test]
    fn a_master_agreed_down_is_no_master() {
        let answers = [answer("1", "master,s_down,o_down")];
        assert!(
            decide(&answers, 1)
                .unwrap_err()
                .to_string()
                .contains("down")
        );
    }

    #[test]
    fn an_answer_without_an_address_does_not_count() {
        let answers = [answer("x", "master"), answer("1", "master")];
        assert!(decide(&answers, 2).is_err());
        assert!(decide(&answers, 1).is_ok());
    }
}
