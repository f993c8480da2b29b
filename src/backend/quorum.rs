//! One semaphore over several independent Redis masters, holding the limit for ANY limit
//! while a majority of them is healthy.
//!
//! # Why not "a majority said yes"
//!
//! The usual multi-node semaphore adds a holder on each node where fewer than L hold, and
//! counts a majority of yeses as a grant. With 3 nodes and L = 2, holders on {A,B}, {B,C} and
//! {A,C} each won a majority, and 3 hold at once: when each node admits L and a grant needs W
//! nodes, ⌊N·L/W⌋ can hold, safe only when W > N·L/(L+1).
//!
//! # What this backend does instead: L slots, each a Redlock mutex
//!
//! - **What each node stores** (`lua/quorum.lua`): for each of the semaphore's L slots, who owns
//!   it and until when (its own clock), and a per-slot counter for fencing tokens.
//! - **What a grant needs**: a holder of weight w reads which slots each node has free, picks w
//!   slots free on a majority, and takes those same w slots, all or nothing, on every node it
//!   can. It holds them only if it took them on a **majority** of nodes, and only for
//!   `lease − elapsed − drift` (drift = lease·factor + 2 ms, factor 0.01 unless configured),
//!   timed from before it asked. Otherwise it gives back whatever it took, on every node.
//! - **Why the limit holds**: a slot has at most one owner at a time, because two majorities
//!   share a node and a node lets one member own a slot until it expires or is released.
//!   Each holder of weight w owns w distinct slots, so the holders' weights add up to at most L.
//!   The validity bound makes the holder stop believing in its slots before any node lets
//!   them go, if the nodes' clocks drift within the configured factor.
//! - **A node that restarted empty** forgot the slots it had granted. Each node records when
//!   its data began (`born`, set once and never expiring) and abstains from granting for one
//!   lease after that: the slots it forgot expire within a lease everywhere else. Every
//!   process must use the same lease for a semaphore.
//! - **A cold start.** A node cannot tell a first start from a restart, but a take reaches
//!   the whole quorum: when the nodes abstaining from one take are a majority of *all* the
//!   nodes, the client asks every node that did not take again, as a cold start
//!   (`take_cold`). Each records that it took part (`opened`, for this semaphore, until its
//!   data is a lease old), stops abstaining and takes: three new nodes grant the first permit
//!   at once, not a lease later. Why this is sound: call a node *fresh* while its data is
//!   younger than a lease and it took part in no cold start, i.e. it restarted empty or is
//!   new. A node that is not fresh remembers every grant it took part in that may still be
//!   held (a cold start forgets only what came before it). The limit is promised while a
//!   majority of the nodes is healthy, and a fresh node is not healthy yet (it may lack slots
//!   granted before its data began): fresh nodes are then a minority, so no take ever sees a
//!   majority abstain, and every fresh node abstains for its lease, as before. A majority of
//!   fresh nodes is a first start (nothing was granted) or a majority that lost its data at
//!   once, which the promise does not cover; rather than refuse every grant for a lease (what
//!   made a first start refuse), the semaphore then serves at once, and can exceed the limit
//!   only if slots granted before the loss are still held, for at most one lease. Counting *fresh* nodes, not young ones, matters: the
//!   nodes of a cold start are all younger than a lease for a lease, and one of them
//!   restarting then must still abstain alone (`tests/quorum.rs` checks it).
//! - **An abstention that blocks a grant** (the nodes that took and the ones abstaining would
//!   have been a majority; with a node down and one restarted, say) is not a full semaphore,
//!   and is not reported as one: `try_acquire` fails with [`Error::Backend`], naming the
//!   abstaining nodes and for how much longer they abstain; `acquire` waits for them if they
//!   take part again within its acquire timeout, and otherwise fails the same way at once.
//!   The semaphore's `OutagePolicy` decides, as when too few nodes answer.
//! - **A paused or unreachable node** answers late or not at all; it is counted out, and a
//!   grant needs a majority of the others. Fewer than a majority reachable is a backend failure,
//!   decided by the semaphore's `OutagePolicy`.
//! - **Renewal** extends the holder's slots on every node that still has them; it counts only
//!   if a majority did, within the validity bound.
//!
//! # Fencing tokens
//!
//! A grant's token is the largest per-slot counter among the nodes that granted it, written
//! back ("sealed") to those nodes before the permit is handed out. Each later owner of one of
//! its slots takes that slot on a node where the seal happened first, so its token is
//! larger: **tokens strictly increase among the successive holders of each slot**. Holders
//! of different slots may get tokens in either order (on one node they are globally ordered).
//! With limit 1 there is one slot, and fencing works exactly as on one node.
//!
//! # Waiting
//!
//! There is no line across nodes and no FIFO order: a waiter tries again when a node announces
//! that it freed a slot (pub/sub on every node), or when the earliest lease may end, or after
//! a jittered pause. Every try is bounded and costs three round trips (read, take, seal), in
//! parallel on the nodes; a cold start costs a fourth (the second take).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;
use redis::aio::ConnectionManager;
use redis::{Client, IntoConnectionInfo, ProtocolVersion, PushInfo, RedisResult, Script, Value};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::gcra::Rated;
use super::health::{self, Health, Reconnect};
use super::redis::announce::{Channels, on_push, subscriber};
use super::redis::{Pushes, manager_config};
use super::store::{Attempt, Member, Mode, Opened, Store, sealed::Open};
use crate::Error;
use crate::snapshot::{Holder, Snapshot};
use crate::sync::{BoxFuture, lock};
use crate::waitlist::{ClockReading, Hub, KEEPALIVE, Refresh, Status};

static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/quorum.lua")));

const CALL_TIMEOUT: Duration = Duration::from_secs(1);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const DRIFT_FACTOR: f64 = 0.01;

/// How long the nodes beyond a majority may take to answer once the majority has.
const GRACE: Duration = Duration::from_millis(10);

/// A semaphore store over several independent Redis masters (no replication between them):
/// at most `limit` holders at any instant, for any limit, while a majority of the nodes is
/// healthy and their clocks drift within the configured bound. See the module docs for the
/// design and what `fencing_token` guarantees here.
///
/// # Example
///
/// ```no_run
/// use tower_distributed_limit::{QuorumBackend, Semaphore};
///
/// # async fn run() -> Result<(), tower_distributed_limit::Error> {
/// let quorum = QuorumBackend::connect(&["redis://a:6379", "redis://b:6379", "redis://c:6379"]).await?;
/// let sem = Semaphore::builder("gpu").limit(4).build(quorum)?;   // the same Semaphore API
/// let permit = sem.acquire().await?;
/// # drop(permit); Ok(()) }
/// ```
#[derive(Clone)]
pub struct QuorumBackend {
    shared: Arc<Nodes>,
    prefix: Arc<str>,
}

impl std::fmt::Debug for QuorumBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuorumBackend")
            .field("nodes", &self.shared.nodes.len())
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// What clones of one `QuorumBackend` share.
struct Nodes {
    nodes: Vec<Arc<Node>>,
    hub: Arc<Hub>,
    drift_factor: f64,
    /// Every call to a node, reconnecting included, ends by then: a dead node slows no one.
    call_timeout: Duration,
}

/// Settings for a [`QuorumBackend`]; made by [`QuorumBackend::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct QuorumBackendBuilder {
    urls: Result<Vec<redis::ConnectionInfo>, Error>,
    call_timeout: Duration,
    connect_timeout: Duration,
    drift_factor: f64,
    prefix: String,
}

impl QuorumBackend {
    /// Connects to every master in `urls` (at least 3, independent of each other), with the
    /// default settings of [`QuorumBackend::builder`].
    pub async fn connect<U: IntoConnectionInfo + Clone>(urls: &[U]) -> Result<Self, Error> {
        Self::builder(urls).connect().await
    }

    /// Settings for a quorum of the masters at `urls`.
    ///
    /// # Example
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
            .map_err(|e| {
                Error::config(format!(
                    "not a Redis URL ({e}); expected e.g. redis://127.0.0.1:6379"
                ))
            });
        QuorumBackendBuilder {
            urls: infos,
            call_timeout: CALL_TIMEOUT,
            connect_timeout: CONNECT_TIMEOUT,
            drift_factor: DRIFT_FACTOR,
            prefix: "dlimit:".into(),
        }
    }
}

impl QuorumBackendBuilder {
    /// The longest any call to one node may take (default 1 s); a node slower than that is
    /// counted out of that call's majority.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// The longest one connection attempt may take (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
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
        self.prefix = prefix.into();
        self
    }

    /// Connects to every node. Fails with [`Error::Config`] for fewer than 3 URLs, a bad URL,
    /// a zero timeout or a drift factor outside 0..1, and with [`Error::Backend`] when fewer
    /// than a majority of the nodes can be reached. A node that cannot be reached now is
    /// probed in the background and counts again once it answers.
    pub async fn connect(self) -> Result<QuorumBackend, Error> {
        let connect_timeout = self.connect_timeout;
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
                Ok(Err(e)) => health::short(&e),
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
    /// policy decides. Fails only with [`Error::Config`] (including outside a tokio runtime).
    ///
    /// # Example
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
        if self.call_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::config(
                "Redis call and connect timeouts must be more than zero",
            ));
        }
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
        let config = manager_config(&pushes, self.call_timeout, self.connect_timeout);
        let bound = self.connect_timeout + self.call_timeout;
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
                call_timeout: self.call_timeout,
            }),
            prefix: self.prefix.into(),
        })
    }
}

/// One master of the quorum, up or down.
struct Node {
    conn: ConnectionManager,
    health: Health,
    hub: Weak<Hub>,
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
        // A node back may make a majority again: the waiters try now.
        if let Some(hub) = self.hub.upgrade() {
            hub.touch_everyone();
        }
    }
}

/// Subscriptions on every node: a freed slot may be announced by any of them.
struct AllNodes(Vec<ConnectionManager>);

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

impl Open for QuorumBackend {
    fn open(&self, name: &str, limit: u32, _claim: Duration) -> Opened {
        // No hash tag: the nodes are independent masters, not a cluster.
        let base = format!("{}quorum:{name}", self.prefix);
        let channel = format!("{base}:freed");
        let waitlist = self.shared.hub.waitlist(&channel);
        Opened {
            store: Arc::new_cyclic(|me| QuorumSemaphore {
                shared: self.shared.clone(),
                me: me.clone(),
                keys: [
                    format!("{base}:owned"),
                    format!("{base}:owner"),
                    format!("{base}:counter"),
                    format!("{}quorum:born", self.prefix),
                    format!("{base}:limit"),
                    format!("{base}:opened"),
                ],
                channel,
                limit,
                held: Mutex::default(),
            }),
            waitlist,
        }
    }
}

struct QuorumSemaphore {
    shared: Arc<Nodes>,
    me: Weak<QuorumSemaphore>,
    keys: [String; 6],
    channel: String,
    limit: u32,
    /// The slots of each member this process holds (or is taking).
    held: Mutex<HashMap<Arc<str>, Vec<u32>>>,
}

/// One node's answer, or none (failed or too slow).
type Answers = Vec<Option<Value>>;

impl QuorumSemaphore {
    fn majority(&self) -> usize {
        self.shared.nodes.len() / 2 + 1
    }

    /// `op` with `args` on every node at once; each node's answer, `None` where it failed or
    /// was late. Once a majority has answered, the others get [`GRACE`] more: a dead or paused
    /// node costs a try that much, not a call timeout.
    async fn on_all(&self, op: &str, args: &[String]) -> Answers {
        self.on_nodes(op, args, |_| true).await
    }

    /// [`on_all`](Self::on_all), on the nodes whose index `pick` chooses (`None` from the
    /// others).
    async fn on_nodes(&self, op: &str, args: &[String], pick: impl Fn(usize) -> bool) -> Answers {
        let mut calls: FuturesUnordered<_> = self
            .shared
            .nodes
            .iter()
            .enumerate()
            .filter(|&(index, node)| pick(index) && health::gate(node).is_ok())
            .map(|(index, node)| {
                let node = node.clone();
                let mut invocation = SCRIPT.prepare_invoke();
                for key in &self.keys {
                    invocation.key(key);
                }
                invocation.arg(op).arg(&self.channel).arg(self.limit);
                for arg in args {
                    invocation.arg(arg);
                }
                let bound = self.shared.call_timeout;
                async move {
                    tracing::trace!(target: "tower_distributed_limit::redis", op, "quorum call");
                    let mut conn = node.conn.clone();
                    let call = invocation.invoke_async::<Value>(&mut conn);
                    let answer = match tokio::time::timeout(bound, call).await {
                        Ok(Ok(value)) => Some(value),
                        Ok(Err(e)) => {
                            tracing::debug!(op, error = %e, "a quorum node failed");
                            health::failed(&node, &e);
                            None
                        }
                        Err(_) => {
                            health::timed_out(&node, bound);
                            None
                        }
                    };
                    (index, answer)
                }
            })
            .collect();
        let mut answers: Answers = vec![None; self.shared.nodes.len()];
        let mut answered = 0;
        let mut late = None;
        loop {
            let next = match late {
                None => calls.next().await,
                Some(deadline) => match tokio::time::timeout_at(deadline, calls.next()).await {
                    Ok(next) => next,
                    Err(_) => break,
                },
            };
            let Some((index, answer)) = next else { break };
            if answer.is_some() {
                answered += 1;
                if answered == self.majority() {
                    late = Some(Instant::now() + GRACE);
                }
            }
            answers[index] = answer;
        }
        answers
    }

    fn too_few(&self, op: &str, answered: usize) -> Error {
        let down: Vec<&str> = (self.shared.nodes.iter())
            .filter(|node| !node.health.is_up())
            .map(|node| node.health.label())
            .collect();
        let down = match down.len() {
            0 => String::new(),
            _ => format!(
                " ({} down, refused at once until a probe reaches them)",
                down.join(", ")
            ),
        };
        Error::backend(
            format!(
                "only {answered} of {} quorum nodes answered `{op}`{down}; a majority ({}) is \
                 needed. Check the nodes' health",
                self.shared.nodes.len(),
                self.majority()
            ),
            None,
        )
    }

    /// One try at `member`'s slots.
    async fn attempt(&self, member: &Member) -> Result<Try, Error> {
        let lease = member.lease;
        let started = Instant::now();
        let (mut candidates, retry_in) = self.free_slots().await?;
        let weight = member.weight as usize;
        if candidates.len() < weight {
            return Ok(Try::Busy(retry_in));
        }
        fastrand::shuffle(&mut candidates);
        candidates.truncate(weight);
        candidates.sort_unstable();
        lock(&self.held).insert(member.text.clone(), candidates.clone());
        let slots: Vec<String> = candidates.iter().map(u32::to_string).collect();
        let mut args = vec![member.text.to_string(), lease.as_millis().to_string()];
        args.extend(slots.iter().cloned());
        let mut takes = Takes::default();
        takes.count(&self.on_all("take", &args).await);
        if takes.winners.len() < self.majority() && takes.abstaining.len() >= self.majority() {
            // A majority of all the nodes abstain: a cold start (see the module docs). Every
            // node that did not take is asked again, so that every live one takes part.
            let winners = takes.winners.clone();
            let again = self
                .on_nodes("take_cold", &args, |node| !winners.contains(&node))
                .await;
            takes.abstaining.clear();
            takes.count(&again);
        }
        let valid = self.validity(lease, started);
        if takes.winners.len() < self.majority() || valid.is_none() {
            self.give_back(member).await;
            if valid.is_some() && takes.winners.len() + takes.abstaining.len() >= self.majority() {
                return Ok(self.blocked(&takes));
            }
            return Ok(Try::Busy(
                retry_in.min(Duration::from_millis(50 + fastrand::u64(..100))),
            ));
        }
        // Seal the token on the nodes that granted it, so every later owner of these slots
        // gets a larger one.
        let token = takes.token;
        let mut args = vec![member.text.to_string(), token.to_string()];
        args.extend(slots);
        let sealed = self.on_all("seal", &args).await;
        let sealed_winners = (takes.winners.iter())
            .filter(|&&node| sealed[node].as_ref().and_then(integer) == Some(member.weight as i64))
            .count();
        match self.validity(lease, started) {
            Some(valid) if sealed_winners >= self.majority() => {
                Ok(Try::Granted(u64::try_from(token).unwrap_or(0), valid))
            }
            _ => {
                self.give_back(member).await;
                Ok(Try::Busy(retry_in))
            }
        }
    }

    /// The grant that abstaining nodes blocked: when enough of them take part again for a
    /// majority, and the error that says so, naming them.
    fn blocked(&self, takes: &Takes) -> Try {
        let nodes = &self.shared.nodes;
        let mut abstaining = takes.abstaining.clone();
        abstaining.sort_unstable_by_key(|&(_, left)| left);
        let needed = self.majority() - takes.winners.len();
        let ends_in = abstaining[needed - 1].1 + Duration::from_millis(1);
        let which: Vec<String> = (abstaining.iter())
            .map(|&(node, left)| format!("{} (for another {left:.1?})", nodes[node].health.label()))
            .collect();
        let silent: Vec<&str> = (0..nodes.len())
            .filter(|node| !takes.answered.contains(node))
            .map(|node| nodes[node].health.label())
            .collect();
        let silent = match silent.len() {
            0 => String::new(),
            _ => format!("; {} did not answer", silent.join(", ")),
        };
        let error = Error::backend(
            format!(
                "only {} of {} quorum nodes may grant now and a majority ({}) is needed: {} \
                 abstain{} after a restart (a node whose data is younger than a lease may have \
                 forgotten slots it granted, so it takes part again once its data is a lease \
                 old){silent}. This is not a full semaphore: wait for the restarted nodes, or \
                 bring the other nodes back",
                takes.winners.len(),
                nodes.len(),
                self.majority(),
                which.join(", "),
                if abstaining.len() == 1 { "s" } else { "" },
            ),
            None,
        );
        Try::Blocked { ends_in, error }
    }

    /// The slots free on a majority of the nodes, and when the earliest lease may end.
    async fn free_slots(&self) -> Result<(Vec<u32>, Duration), Error> {
        let free = self.on_all("free", &[]).await;
        let answered = free.iter().flatten().count();
        if answered < self.majority() {
            return Err(self.too_few("free", answered));
        }
        let mut counts: HashMap<i64, usize> = HashMap::new();
        let mut retry_in = KEEPALIVE;
        for answer in free.iter().flatten() {
            let Some((first, slots)) = integers(answer).and_then(|values| {
                let (first, slots) = values.split_first()?;
                Some((*first, slots.to_vec()))
            }) else {
                continue;
            };
            if first > 0 {
                retry_in = retry_in.min(Duration::from_millis(first.unsigned_abs()));
            }
            for slot in slots {
                *counts.entry(slot).or_default() += 1;
            }
        }
        let candidates = counts
            .into_iter()
            .filter(|(_, count)| *count >= self.majority())
            .filter_map(|(slot, _)| u32::try_from(slot).ok())
            .collect();
        Ok((candidates, retry_in))
    }

    /// How long a grant asked for at `started` may still be believed.
    fn validity(&self, lease: Duration, started: Instant) -> Option<Duration> {
        let drift = lease.mul_f64(self.shared.drift_factor) + Duration::from_millis(2);
        lease
            .checked_sub(started.elapsed())?
            .checked_sub(drift)
            .filter(|valid| !valid.is_zero())
    }

    /// Releases `member`'s slots on every node.
    async fn give_back(&self, member: &Member) {
        let Some(slots) = lock(&self.held).remove(&member.text) else {
            return;
        };
        let mut args = vec![member.text.to_string()];
        args.extend(slots.iter().map(u32::to_string));
        self.on_all("release", &args).await;
    }
}

/// How one try went.
enum Try {
    /// The token, and how long the grant may be believed.
    Granted(u64, Duration),
    /// No set of slots is free on a majority now (or the try was too slow): try again in.
    Busy(Duration),
    /// Nodes abstaining after a restart kept the grant from a majority; enough of them take
    /// part again in `ends_in`. Not a full semaphore: `error` says what it is.
    Blocked { ends_in: Duration, error: Error },
}

/// The answers to `take` (and `take_cold`), by node.
#[derive(Default)]
struct Takes {
    /// The nodes that took every slot.
    winners: Vec<usize>,
    /// The nodes that abstain, and for how much longer.
    abstaining: Vec<(usize, Duration)>,
    /// The nodes that answered at all.
    answered: Vec<usize>,
    /// The largest counter among the winners.
    token: i64,
}

impl Takes {
    fn count(&mut self, answers: &Answers) {
        for (node, answer) in answers.iter().enumerate() {
            let Some(values) = answer.as_ref().and_then(integers) else {
                continue;
            };
            if !self.answered.contains(&node) {
                self.answered.push(node);
            }
            match values.split_first() {
                Some((1, counters)) => {
                    self.winners.push(node);
                    self.token = self.token.max(counters.iter().copied().max().unwrap_or(0));
                }
                Some((2, [left, ..])) => {
                    let left = Duration::from_millis(left.max(&0).unsigned_abs());
                    self.abstaining.push((node, left));
                }
                _ => {}
            }
        }
    }
}

fn integers(value: &Value) -> Option<Vec<i64>> {
    match value {
        Value::Array(items) => items.iter().map(integer).collect(),
        _ => None,
    }
}

fn integer(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        _ => None,
    }
}

impl Store for QuorumSemaphore {
    fn acquire<'a>(
        &'a self,
        member: &'a Member,
        mode: Mode,
        until: Option<Instant>,
        // Never given: this store combines with no rate limiter (`Store::combines`).
        _rate: Option<&'a Rated>,
    ) -> BoxFuture<'a, Result<Attempt, Error>> {
        Box::pin(async move {
            let sent = Instant::now();
            // No grant is ever announced with a server time: any reading will do.
            let clock = ClockReading {
                local: sent,
                server_us: 0,
            };
            match self.attempt(member).await? {
                Try::Granted(token, remaining) => Ok(Attempt::Granted { token, remaining }),
                // An abstention that ends within the wait is waited for; any other is reported.
                Try::Blocked { ends_in, error } => match until {
                    Some(until) if mode != Mode::Once && Instant::now() + ends_in < until => {
                        Ok(Attempt::Queued {
                            retry_in: ends_in,
                            clock,
                        })
                    }
                    _ => Err(error),
                },
                Try::Busy(_) if mode == Mode::Once => Ok(Attempt::Full),
                Try::Busy(retry_in) => Ok(Attempt::Queued { retry_in, clock }),
            }
        })
    }

    fn release<'a>(&'a self, member: &'a Member) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            self.give_back(member).await;
            Ok(())
        })
    }

    fn release_later(&self, member: Member) {
        let (Some(me), Ok(runtime)) = (self.me.upgrade(), tokio::runtime::Handle::try_current())
        else {
            tracing::warn!(
                "permit dropped outside a tokio runtime: its slots free when its lease ends"
            );
            return;
        };
        runtime.spawn(async move { me.give_back(&member).await });
    }

    fn renew<'a>(
        &'a self,
        members: &'a [Member],
    ) -> BoxFuture<'a, Result<Vec<Option<Duration>>, Error>> {
        Box::pin(async move {
            let mut renewed = Vec::with_capacity(members.len());
            for member in members {
                let Some(slots) = lock(&self.held).get(&member.text).cloned() else {
                    renewed.push(None);
                    continue;
                };
                let started = Instant::now();
                let mut args = vec![
                    member.text.to_string(),
                    member.lease.as_millis().to_string(),
                ];
                args.extend(slots.iter().map(u32::to_string));
                let answers = self.on_all("renew", &args).await;
                let answered = answers.iter().flatten().count();
                if answered < self.majority() {
                    return Err(self.too_few("renew", answered));
                }
                let kept = answers
                    .iter()
                    .filter(|answer| answer.as_ref().and_then(integer) == Some(slots.len() as i64))
                    .count();
                renewed.push(if kept >= self.majority() {
                    self.validity(member.lease, started)
                } else {
                    None
                });
            }
            Ok(renewed)
        })
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        None
    }

    /// Holders are the members that own slots on a majority of the nodes; there is no line,
    /// and grant times are not kept (`held_for` is zero).
    fn snapshot(&self) -> BoxFuture<'_, Result<Snapshot, Error>> {
        Box::pin(async move {
            let answers = self.on_all("snapshot", &[]).await;
            let answered: Vec<&Value> = answers.iter().flatten().collect();
            if answered.len() < self.majority() {
                return Err(self.too_few("snapshot", answered.len()));
            }
            let mut limits = Vec::new();
            // (slot, member) -> on how many nodes, and the least time left.
            let mut seen: HashMap<(i64, String), (usize, i64)> = HashMap::new();
            for answer in answered {
                let Value::Array(items) = answer else {
                    continue;
                };
                let Some((limit, rest)) = items.split_first() else {
                    continue;
                };
                limits.extend(integer(limit));
                for held in rest.chunks_exact(3) {
                    if let (Value::Int(slot), Value::BulkString(member), Value::Int(left)) =
                        (&held[0], &held[1], &held[2])
                    {
                        let member = String::from_utf8_lossy(member).into_owned();
                        let entry = seen.entry((*slot, member)).or_insert((0, i64::MAX));
                        entry.0 += 1;
                        entry.1 = entry.1.min(*left);
                    }
                }
            }
            let mut holders: HashMap<String, (u32, i64)> = HashMap::new();
            for ((_, member), (nodes, left)) in seen {
                if nodes >= self.majority() {
                    let holder = holders.entry(member).or_insert((0, i64::MAX));
                    holder.0 += 1;
                    holder.1 = holder.1.min(left);
                }
            }
            limits.sort_unstable();
            let limit = limits.get(limits.len() / 2).copied().unwrap_or(0);
            let holders: Vec<Holder> = holders
                .into_iter()
                .map(|(member, (weight, left))| Holder {
                    id: member.split(':').next().unwrap_or_default().to_owned(),
                    weight,
                    held_for: Duration::ZERO,
                    lease_remaining: Duration::from_millis(left.max(0).unsigned_abs()),
                })
                .collect();
            Ok(Snapshot {
                limit: u32::try_from(limit.max(0)).unwrap_or(u32::MAX),
                used: holders.iter().map(|holder| holder.weight).sum(),
                waiting: 0,
                holders,
            })
        })
    }

    fn evict<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let answers = self.on_all("evict", &[id.to_owned()]).await;
            let answered = answers.iter().flatten().count();
            if answered < self.majority() {
                return Err(self.too_few("evict", answered));
            }
            Ok(answers
                .iter()
                .flatten()
                .any(|answer| integer(answer).is_some_and(|n| n > 0)))
        })
    }

    /// Stored on every node; it counts once a majority has it.
    fn set_limit(&self, limit: u32) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            let answers = self.on_all("set_limit", &[limit.to_string()]).await;
            let stored = answers.iter().flatten().count();
            if stored < self.majority() {
                return Err(self.too_few("set_limit", stored));
            }
            Ok(())
        })
    }

    fn used(&self) -> BoxFuture<'_, Result<u32, Error>> {
        Box::pin(async move {
            let answers = self.on_all("used", &[]).await;
            let mut used: Vec<i64> = answers.iter().flatten().filter_map(integer).collect();
            if used.len() < self.majority() {
                return Err(self.too_few("used", used.len()));
            }
            // The median of the answers: a minority of nodes cannot sway it.
            used.sort_unstable();
            Ok(u32::try_from(used[used.len() / 2].max(0)).unwrap_or(u32::MAX))
        })
    }
}

impl Refresh for QuorumSemaphore {
    /// There is no line across the nodes. The oldest local waiters, as many as slots are free
    /// on a majority, are told to try again; the others keep waiting, so a freed slot does not
    /// set every waiter of the process trying at once.
    fn touch<'a>(
        &'a self,
        members: &'a [Arc<str>],
        _until: Instant,
    ) -> BoxFuture<'a, Result<(Vec<Status>, Duration), Error>> {
        Box::pin(async move {
            let (free, retry_in) = self.free_slots().await?;
            let statuses = (0..members.len())
                .map(|i| {
                    if i < free.len() {
                        Status::Unknown
                    } else {
                        Status::Queued
                    }
                })
                .collect();
            Ok((statuses, retry_in))
        })
    }
}

// ---- Rate limiters (issue 13): not on a quorum yet. ----

impl super::gcra::RateBackend for QuorumBackend {}

impl super::gcra::sealed::OpenRate for QuorumBackend {
    fn open_rate(
        &self,
        name: &str,
        _: super::gcra::Gcra,
    ) -> Result<super::gcra::OpenedRate, Error> {
        Err(Error::config(format!(
            "rate limiter {name:?}: rate limiting is not supported on a QuorumBackend yet (a GCRA \
             over independent masters is not exact); use a RedisBackend (one node, Cluster or \
             Sentinel) for the rate limit, next to the quorum's semaphore"
        )))
    }
}
