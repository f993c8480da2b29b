//! The real script, and `MemoryBackend`, held to the model: seeded random walks of the model
//! replayed through the crate's public API, what both can observe compared after every step.
//!
//! Redis runs under the clock shim pinned (`DLIMIT_CLOCK_PIN_FILE`): its wall clock stands at
//! the model's time, moved only by `Tick`, so fencing tokens (`max(last + 1, server µs)`) are
//! compared with the model's. The client runs background work by real time (the keeper renews
//! at a third of the lease, waiters touch about once a second, a forward jump of the server's
//! clock past 0.5 s makes holders renew at once): the lease is 60 s and the claim window 30 s
//! (see [`CLAIM`]), a walk moves the pinned clock by at most 60 ms and lasts well under 20 s,
//! so no renewal runs, and a touch of a waiter only keeps it in line, which nothing here
//! compares. The walks therefore leave expiry, claims running out, freezes, crashes and
//! restarts to the model's exhaustive checks (and to tests/clock.rs and tests/faults.rs); what
//! they hold the script to is every decision of a call: who is granted, refused, queued (and
//! where), the limit, the tokens. [`LANES`] walks run at once, each lane on a server of its own.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use stateright::Model;
use tokio::task::JoinHandle;
use tower_distributed_limit::{
    Ask, Error, MemoryBackend, Permit, Priority, RedisBackend, Semaphore, Share,
};

use crate::model::{Action, Config, Design, HIGH, Semaphore as Spec, State};
use crate::support::{self, RedisProcess};

const SEQUENCES: u64 = 1_000;
const STEPS: usize = 50;
const LEASE: Duration = Duration::from_secs(60);
/// A waiter maps its grant's deadline (server time) to its own clock by the reading of its
/// queue reply, assuming the two clocks run together; the pinned one stands still, so a grant
/// announced more than a claim window of real time after its waiter queued looks ended, and the
/// client rightly gives it back. Half the lease keeps walks of under 30 s clear of that.
const CLAIM: Duration = Duration::from_secs(30);
/// How long the real side may take to show what the model did at once (a spawned acquire
/// queued, a cancelled waiter's release sent, a grant confirmed).
const SETTLE: Duration = Duration::from_secs(5);

/// The switches a walk explores: 3 processes, limit 3 (pinned to 2 by an operator), weights 1
/// and 2, both classes (the higher reserving 1), two tenants at most 2 each, waiting. A tick
/// is 1 ms; lease and patience are the crate's (60 s, 3 s), the claim window the longest a
/// 60 s lease allows (30 s; see [`CLAIM`]).
pub fn config() -> Config {
    Config {
        procs: 3,
        limit: 3,
        pins: vec![2],
        weights: vec![1, 2],
        lease: 60_000,
        claim: CLAIM.as_millis() as u32,
        patience: 3_000,
        max_time: 61,
        max_members: 250,
        waiting: true,
        freezes: 0,
        crashes: 0,
        restarts: 0,
        classes: true,
        reserve: [1, 0],
        tenants: true,
        tenant_cap: Some(2),
        prefetch: false,
        design: Design::Crate,
        depth: None,
        tick_us: 1_000,
    }
}

/// Reads grant replies and announcements at once, as a live client does (its keeper claims
/// an announced grant later, which changes no holder, line or token: nothing compared).
fn settle(spec: &Spec, mut state: State) -> State {
    loop {
        let due = (0..spec.config.procs).find_map(|p| {
            let proc = &state.procs[usize::from(p)];
            if proc.reply.is_some() {
                return Some(Action::Receive(p));
            }
            // A waiter the line dropped (too heavy for a lowered limit): told so, the client
            // touches at once, finds it gone and asks again, and is told it is too heavy.
            if let Some(w) = &proc.waiting {
                let gone = !state.server.queue.iter().any(|q| q.id == w.id)
                    && !state.server.holders.iter().any(|h| h.id == w.id);
                if gone && proc.announced.is_none() {
                    return Some(Action::Touch(p));
                }
            }
            let announced = proc.announced.map(|(id, _, _)| id);
            (announced.is_some() && announced == proc.waiting.as_ref().map(|w| w.id))
                .then_some(Action::Learn(p))
        });
        match due {
            Some(action) => {
                state = spec
                    .next_state(&state, action)
                    .expect("every action has a next state");
            }
            None => return state,
        }
    }
}

/// The actions a client can be told to take in `state`.
fn enabled(spec: &Spec, state: &State) -> Vec<Action> {
    let mut enabled = vec![];
    spec.actions(state, &mut enabled);
    enabled.retain(|a| {
        matches!(
            a,
            Action::Tick
                | Action::Pin(_)
                | Action::Unpin
                | Action::Try { .. }
                | Action::Wait { .. }
                | Action::Release { .. }
                | Action::Cancel(_)
        )
    });
    enabled
}

/// A seeded random walk of `steps` actions a client can be told to take.
pub fn walk(spec: &Spec, seed: u64, steps: usize) -> Vec<Action> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut state = spec.init_states().remove(0);
    let mut walk = Vec::with_capacity(steps);
    for _ in 0..steps {
        let enabled = enabled(spec, &state);
        let action = enabled[rng.usize(..enabled.len())];
        state = settle(spec, spec.next_state(&state, action).expect("a next state"));
        walk.push(action);
    }
    walk
}

/// Whether every step of `walk` is one the model allows where it stands (a shrunk walk's
/// releases and cancels must still name a permit or waiter it has).
fn is_walk(spec: &Spec, walk: &[Action]) -> bool {
    let mut state = spec.init_states().remove(0);
    for &action in walk {
        if !enabled(spec, &state).contains(&action) {
            return false;
        }
        state = settle(spec, spec.next_state(&state, action).expect("a next state"));
    }
    true
}

/// Opens one process's semaphore of a given name.
type Opener = Box<dyn Fn(&str) -> Semaphore + Send + Sync>;

/// What both sides show after a step.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    /// Model ids of the holders, each with its weight.
    holders: BTreeSet<(u8, u8)>,
    /// The line: model ids in the order served (heads by class then arrival, then the
    /// parked); `None` where the side shows only how many wait.
    line: Option<Vec<u8>>,
    waiting: usize,
    limit: u32,
}

fn model_seen(state: &State, with_line: bool) -> Seen {
    let mut line: Vec<_> = state.server.queue.iter().collect();
    line.sort_by_key(|w| (w.parked, w.class, w.arrival));
    Seen {
        holders: (state.server.holders.iter())
            .map(|h| (h.id, h.weight))
            .collect(),
        line: with_line.then(|| line.iter().map(|w| w.id).collect()),
        waiting: line.len(),
        limit: u32::from(state.server.limit),
    }
}

/// The side under test.
enum Backend {
    Redis {
        conn: redis::aio::MultiplexedConnection,
        pin: PathBuf,
        base_us: u64,
    },
    Memory,
}

struct Replay {
    backend: Backend,
    name: String,
    sems: Vec<Semaphore>,
    permits: HashMap<u8, Permit>,
    waits: HashMap<u8, (u8, JoinHandle<Result<Permit, Error>>)>,
    /// Holder id (a member's first field) → model id.
    names: HashMap<String, u8>,
    /// Memory: the highest token seen before this step (tokens there are a counter).
    last_token: u64,
}

fn ask(weight: u8, class: u8, tenant: Option<u8>) -> Ask {
    let priority = if class == HIGH {
        Priority::CRITICAL
    } else {
        Priority::NORMAL
    };
    let ask = Ask::new().weight(u32::from(weight)).priority(priority);
    match tenant {
        Some(t) => ask.tenant(format!("tenant-{t}")),
        None => ask,
    }
}

fn id_of(member: &str) -> &str {
    member.split(':').next().unwrap_or(member)
}

/// Polls `condition` until it holds, at most [`SETTLE`]; a short first wait, since most hold
/// within a round trip.
async fn until<F, Fut>(what: &str, mut condition: F) -> Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + SETTLE;
    let mut pause = Duration::from_micros(200);
    loop {
        if condition().await {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!("timed out waiting for {what}"));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}

impl Replay {
    async fn redis_list(&self, key: &str) -> Vec<String> {
        let Backend::Redis { conn, .. } = &self.backend else {
            return vec![];
        };
        redis::cmd("ZRANGE")
            .arg(format!("dlimit:{{{}}}:{key}", self.name))
            .arg(0)
            .arg(-1)
            .query_async(&mut conn.clone())
            .await
            .expect("read a sorted set of the semaphore")
    }

    /// A sorted set with its scores, for the report of a divergence.
    async fn redis_list_scores(&self, key: &str) -> Vec<(String, f64)> {
        let Backend::Redis { conn, .. } = &self.backend else {
            return vec![];
        };
        let entries: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(format!("dlimit:{{{}}}:{key}", self.name))
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut conn.clone())
            .await
            .expect("read a sorted set of the semaphore");
        (entries.into_iter())
            .map(|(m, score)| {
                let id = self.names.get(id_of(&m)).map_or(m, |id| format!("#{id}"));
                (id, score)
            })
            .collect()
    }

    async fn seen(&self, spec: &Spec) -> Result<Seen, String> {
        let map = |ids: Vec<String>| -> Result<Vec<u8>, String> {
            (ids.iter())
                .map(|id| {
                    (self.names.get(id_of(id)).copied()).ok_or_else(|| {
                        format!("{id} is not one the model made (known: {:?})", self.names)
                    })
                })
                .collect()
        };
        match &self.backend {
            Backend::Redis { conn, .. } => {
                let holders = self.redis_list("holders").await;
                let weights: Vec<u8> = (holders.iter())
                    .map(|m| {
                        (m.rsplit(':').nth(1))
                            .and_then(|w| w.parse().ok())
                            .unwrap_or(0)
                    })
                    .collect();
                let holders = map(holders)?;
                let line = map(self.redis_list("queue").await)?;
                let limit: Option<u32> = redis::cmd("HGET")
                    .arg(format!("dlimit:{{{}}}:meta", self.name))
                    .arg("limit")
                    .query_async(&mut conn.clone())
                    .await
                    .expect("read meta's limit");
                Ok(Seen {
                    holders: holders.into_iter().zip(weights).collect(),
                    waiting: line.len(),
                    line: Some(line),
                    limit: limit.unwrap_or(u32::from(spec.config.limit)),
                })
            }
            Backend::Memory => {
                let snapshot = self.sems[0].snapshot().await.map_err(|e| e.to_string())?;
                let ids: Vec<String> = snapshot.holders.iter().map(|h| h.id.clone()).collect();
                let weights = snapshot.holders.iter().map(|h| h.weight as u8);
                Ok(Seen {
                    holders: map(ids)?.into_iter().zip(weights).collect(),
                    line: None,
                    waiting: snapshot.waiting as usize,
                    limit: snapshot.limit,
                })
            }
        }
    }

    async fn pin(&self, now: u32) {
        if let Backend::Redis { pin, base_us, .. } = &self.backend {
            // By rename, so the server never reads a file half written.
            let next = pin.with_extension("next");
            std::fs::write(&next, (base_us + u64::from(now) * 1_000).to_string())
                .expect("write the pinned time");
            std::fs::rename(&next, pin).expect("move the pinned time in place");
        }
    }

    /// Waits until the real line holds one member the model does not know yet, and names it.
    async fn name_new_waiter(&mut self, id: u8, target: usize) -> Result<(), String> {
        if matches!(self.backend, Backend::Memory) {
            let this = &*self;
            return until("the waiter in the line", || async {
                (this.sems[0].snapshot().await).is_ok_and(|s| s.waiting as usize == target)
            })
            .await;
        }
        let deadline = tokio::time::Instant::now() + SETTLE;
        loop {
            let line = self.redis_list("queue").await;
            let found = (line.iter())
                .map(|m| id_of(m).to_string())
                .find(|m| !self.names.contains_key(m));
            if let Some(found) = found {
                self.names.insert(found, id);
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err("timed out waiting for a queued waiter in the real line".into());
            }
            tokio::task::yield_now().await;
        }
    }

    /// One model step on the real side.
    async fn apply(&mut self, before: &State, action: Action, after: &State) -> Result<(), String> {
        let new_id = before.next_id;
        let granted = |p: u8, id: u8| {
            after.procs[usize::from(p)]
                .permits
                .iter()
                .any(|b| b.id == id)
        };
        match action {
            Action::Tick => self.pin(after.now).await,
            Action::Pin(limit) => self.sems[0]
                .set_limit(u32::from(limit))
                .await
                .map_err(|e| e.to_string())?,
            Action::Unpin => self.sems[0]
                .unset_limit()
                .await
                .map_err(|e| e.to_string())?,
            Action::Try {
                p,
                weight,
                class,
                tenant,
            } => {
                let got = self.sems[usize::from(p)]
                    .try_acquire_with(ask(weight, class, tenant))
                    .await;
                match (got, granted(p, new_id)) {
                    (Ok(Some(permit)), true) => {
                        self.names.insert(permit.id().to_string(), new_id);
                        self.permits.insert(new_id, permit);
                    }
                    (Ok(None) | Err(Error::Config(_)), false) => {}
                    (got, model) => {
                        return Err(format!(
                            "try_acquire answered {:?}, the model granted: {model}",
                            got.map(|p| p.map(|p| p.id().to_string()))
                        ));
                    }
                }
            }
            Action::Wait {
                p,
                weight,
                class,
                tenant,
            } => {
                let sem = self.sems[usize::from(p)].clone();
                let handle =
                    tokio::spawn(async move { sem.acquire_with(ask(weight, class, tenant)).await });
                let queued = after.server.queue.iter().any(|w| w.id == new_id);
                if queued {
                    self.waits.insert(p, (new_id, handle));
                    self.name_new_waiter(new_id, after.server.queue.len())
                        .await?;
                } else {
                    let got = tokio::time::timeout(SETTLE, handle)
                        .await
                        .map_err(|_| "acquire neither granted nor refused".to_string())?
                        .expect("the acquire task ran");
                    match (got, granted(p, new_id)) {
                        (Ok(permit), true) => {
                            self.names.insert(permit.id().to_string(), new_id);
                            self.permits.insert(new_id, permit);
                        }
                        (Err(Error::Config(_)), false) => {}
                        (got, model) => {
                            return Err(format!(
                                "acquire answered {:?}, the model granted: {model}",
                                got.map(|p| p.id().to_string())
                            ));
                        }
                    }
                }
            }
            Action::Release { id, .. } => {
                let mut permit = self.permits.remove(&id).expect("a permit the replay holds");
                permit.release().await.map_err(|e| e.to_string())?;
            }
            Action::Cancel(p) => {
                let (id, handle) = self.waits.remove(&p).expect("a waiter the replay spawned");
                handle.abort();
                let name = (self.names.iter())
                    .find(|(_, m)| **m == id)
                    .map(|(name, _)| name.clone());
                let target = after.server.queue.len();
                let this = &*self;
                match (&this.backend, name) {
                    (Backend::Redis { .. }, Some(name)) => {
                        until("the cancelled waiter to leave the line", || {
                            let name = name.clone();
                            async move {
                                let line = this.redis_list("queue").await;
                                !line.iter().any(|m| id_of(m) == name)
                            }
                        })
                        .await?;
                    }
                    _ => {
                        until("the cancelled waiter to leave the line", || async {
                            (this.sems[0].snapshot().await)
                                .is_ok_and(|s| s.waiting as usize == target)
                        })
                        .await?;
                    }
                }
            }
            other => return Err(format!("{other:?} is not replayed")),
        }
        self.collect_grants(after).await
    }

    /// The waiters the model granted (and claimed) in this step: their acquires return.
    async fn collect_grants(&mut self, after: &State) -> Result<(), String> {
        let done: Vec<u8> = (self.waits.iter())
            .filter(|(p, (id, _))| {
                after.procs[usize::from(**p)]
                    .permits
                    .iter()
                    .any(|b| b.id == *id)
            })
            .map(|(p, _)| *p)
            .collect();
        for p in done {
            let (id, handle) = self.waits.remove(&p).expect("listed above");
            let permit = tokio::time::timeout(SETTLE, handle)
                .await
                .map_err(|_| format!("the model granted #{id}, the real waiter is not"))?
                .expect("the acquire task ran")
                .map_err(|e| format!("the model granted #{id}, the real acquire failed: {e}"))?;
            self.names.insert(permit.id().to_string(), id);
            self.permits.insert(id, permit);
        }
        let refused: Vec<u8> = (self.waits.iter())
            .filter(|(p, (id, _))| {
                let proc = &after.procs[usize::from(**p)];
                proc.waiting.as_ref().is_none_or(|w| w.id != *id)
                    && !proc.permits.iter().any(|b| b.id == *id)
            })
            .map(|(p, _)| *p)
            .collect();
        for p in refused {
            let (id, handle) = self.waits.remove(&p).expect("listed above");
            let got = tokio::time::timeout(SETTLE, handle)
                .await
                .map_err(|_| format!("the model refused #{id}, the real waiter still waits"))?
                .expect("the acquire task ran");
            if !matches!(got, Err(Error::Config(_))) {
                return Err(format!(
                    "the model refused #{id} as too heavy, the real acquire returned {:?}",
                    got.map(|p| p.id().to_string())
                ));
            }
        }
        for (id, handle) in self.waits.values() {
            if handle.is_finished() {
                return Err(format!("waiter #{id} returned, the model has it waiting"));
            }
        }
        Ok(())
    }

    /// Tokens: distinct, each above every token seen before it; on Redis also at least the
    /// model's (`max(last + 1, server µs)` on the pinned clock). Equal to the model's but for
    /// one race the design allows: a waiter's own touch that claims its grant before the
    /// announcement is read gets a fresh token (and every later token moves up by one).
    fn check_tokens(&mut self, after: &State, fresh: &[u8]) -> Result<(), String> {
        let beliefs: HashMap<u8, u64> = (after.procs.iter())
            .flat_map(|p| p.permits.iter())
            .map(|b| (b.id, b.token))
            .collect();
        let real: BTreeSet<u64> = fresh
            .iter()
            .map(|id| self.permits[id].fencing_token())
            .collect();
        if real.len() != fresh.len() || real.first().is_some_and(|&t| t <= self.last_token) {
            return Err(format!(
                "tokens {real:?} not all above {} and distinct",
                self.last_token
            ));
        }
        if let Backend::Redis { base_us, .. } = &self.backend {
            for id in fresh {
                let (real, model) = (self.permits[id].fencing_token(), beliefs[id] + base_us);
                if real < model {
                    return Err(format!("#{id}'s token {real}, below the model's {model}"));
                }
            }
        }
        self.last_token = real.last().copied().unwrap_or(self.last_token);
        Ok(())
    }
}

fn show(walk: &[Action], upto: usize) -> String {
    let mut text = String::new();
    for (i, action) in walk.iter().take(upto + 1).enumerate() {
        let _ = writeln!(text, "{:>4}. {action:?}", i + 1);
    }
    text
}

/// Where a replay first diverged from the model (the step's index), and what both showed.
struct Divergence {
    step: usize,
    report: String,
}

/// Replays `walk` on fresh semaphores; the first divergence, with the steps up to it.
async fn replay(
    spec: &Spec,
    backend: Backend,
    backends: &[Opener],
    name: String,
    walk: &[Action],
) -> Result<(), Divergence> {
    let mut replay = Replay {
        sems: backends.iter().map(|open| open(&name)).collect(),
        backend,
        name,
        permits: HashMap::new(),
        waits: HashMap::new(),
        names: HashMap::new(),
        last_token: 0,
    };
    let with_line = matches!(replay.backend, Backend::Redis { .. });
    let mut state = spec.init_states().remove(0);
    replay.pin(state.now).await;
    let mut outcome = Ok(());
    for (i, &action) in walk.iter().enumerate() {
        let after = settle(spec, spec.next_state(&state, action).expect("a next state"));
        let step = async {
            replay.apply(&state, action, &after).await?;
            let fresh: Vec<u8> = (replay.permits.keys().copied())
                .filter(|id| {
                    !state
                        .procs
                        .iter()
                        .any(|p| p.permits.iter().any(|b| b.id == *id))
                })
                .collect();
            replay.check_tokens(&after, &fresh)?;
            let real = replay.seen(spec).await?;
            let model = model_seen(&after, with_line);
            if real != model {
                let scores = replay.redis_list_scores("queue").await;
                return Err(format!(
                    "observed {real:?}\n  the model {model:?}\n  the real line {scores:?}"
                ));
            }
            Ok(())
        };
        if let Err(mut why) = step.await {
            // What the real side holds after the step (on Redis; nothing on Memory).
            let _ = write!(
                why,
                "\n  the real line after {:?}\n  the real holders after {:?}",
                replay.redis_list_scores("queue").await,
                replay.redis_list_scores("holders").await
            );
            for (p, (id, handle)) in replay.waits.drain() {
                if handle.is_finished() {
                    let got = handle.await.expect("the acquire task ran");
                    let _ = write!(
                        why,
                        "; p{p}'s waiter #{id} returned {:?}",
                        got.map(|p| p.id().to_string())
                    );
                }
            }
            let report = format!(
                "diverged at step {} ({why}); the steps:\n{}  the model before: {}\n  after: {}\n                   line after: {:?}",
                i + 1,
                show(walk, i),
                crate::model::Summary(&state),
                crate::model::Summary(&after),
                after.server.queue,
            );
            outcome = Err(Divergence { step: i, report });
            break;
        }
        state = after;
    }
    for (_, (_, handle)) in replay.waits.drain() {
        handle.abort();
    }
    for (_, mut permit) in replay.permits.drain() {
        let _ = permit.release().await;
    }
    outcome
}

fn builder(name: &str, spec: &Spec) -> tower_distributed_limit::SemaphoreBuilder {
    let c = &spec.config;
    Semaphore::builder(name)
        .limit(u32::from(c.limit))
        .lease(LEASE)
        .claim_window(CLAIM)
        .acquire_timeout(Duration::from_secs(600))
        .class(Priority::CRITICAL, Share::reserved(u32::from(c.reserve[0])))
        .per_tenant(Share::at_most(u32::from(
            c.tenant_cap.expect("the walks cap tenants"),
        )))
}

/// The seeds replayed: `MODEL_CONFORMANCE_SEQUENCES` of them (1 000 unless set) from
/// `MODEL_CONFORMANCE_FROM` (0 unless set), to replay one walk that diverged.
fn seeds() -> std::ops::Range<u64> {
    let var = |name: &str| std::env::var(name).ok().and_then(|n| n.parse().ok());
    let from = var("MODEL_CONFORMANCE_FROM").unwrap_or(0);
    from..from + var("MODEL_CONFORMANCE_SEQUENCES").unwrap_or(SEQUENCES)
}

/// Walks replayed at once, each lane with semaphores (and on Redis a server and clock) of its
/// own: a walk's time is mostly round trips and the clients' wake-ups, which lanes overlap.
/// (Before a dropped waiter was told at once, it learnt at its next touch, a second on, and
/// the replays took over a minute each.)
const LANES: usize = 8;

/// One lane's side under test: its processes' semaphores and, on Redis, its server (pinned
/// clock) and a plain connection to read it.
struct Lane {
    openers: Vec<Opener>,
    redis: Option<(RedisProcess, redis::aio::MultiplexedConnection, PathBuf)>,
}

impl Lane {
    fn memory(spec: &Spec, memory: &MemoryBackend) -> Lane {
        let openers = (0..spec.config.procs)
            .map(|_| {
                let (memory, spec) = (memory.clone(), spec.clone());
                Box::new(move |name: &str| {
                    builder(name, &spec)
                        .build(memory.clone())
                        .expect("a valid semaphore")
                }) as Opener
            })
            .collect();
        Lane {
            openers,
            redis: None,
        }
    }

    /// A redis-server whose wall clock reads what the walk writes (the shim's pin mode; empty
    /// until the first walk pins it, so the server starts on the real clock).
    async fn redis(spec: &Spec) -> Lane {
        let (server, pin) = support::redis_with_clock("DLIMIT_CLOCK_PIN_FILE", "").await;
        let url = format!("redis://127.0.0.1:{}", server.port);
        let mut openers: Vec<Opener> = vec![];
        for _ in 0..spec.config.procs {
            let backend = RedisBackend::connect(&url).await.expect("connect");
            let spec = spec.clone();
            openers.push(Box::new(move |name: &str| {
                builder(name, &spec)
                    .build(backend.clone())
                    .expect("a valid semaphore")
            }));
        }
        let conn = redis::Client::open(url.as_str())
            .expect("a URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a plain connection");
        Lane {
            openers,
            redis: Some((server, conn, pin)),
        }
    }

    /// The side for a walk whose pinned clock starts at `base_us` (on Redis).
    fn backend(&self, base_us: u64) -> Backend {
        match &self.redis {
            Some((_, conn, pin)) => Backend::Redis {
                conn: conn.clone(),
                pin: pin.clone(),
                base_us,
            },
            None => Backend::Memory,
        }
    }

    /// Replays `walk` under `name`, its clock from `base_us`.
    async fn replay(
        &self,
        spec: &Spec,
        base_us: u64,
        name: String,
        walk: &[Action],
    ) -> Result<(), Divergence> {
        replay(spec, self.backend(base_us), &self.openers, name, walk).await
    }

    /// A shorter walk that diverges too, and its report: steps dropped one at a time while
    /// what is left is still a walk of the model and still diverges, until no single step can
    /// go (a local minimum, as a property-testing shrinker finds; at most `MAX_SHRINKS`
    /// replays). Each replay's clock starts 10 s after the last one's, from `base_us`.
    async fn shrink(
        &self,
        spec: &Spec,
        base_us: u64,
        name: &str,
        walk: &[Action],
        first: Divergence,
    ) -> (usize, String) {
        const MAX_SHRINKS: u64 = 400;
        let mut walk = walk[..=first.step].to_vec();
        let mut report = first.report;
        let mut tries = 0;
        let mut shrunk = true;
        while shrunk && tries < MAX_SHRINKS {
            shrunk = false;
            let mut i = walk.len();
            while i > 0 && tries < MAX_SHRINKS {
                i -= 1;
                let mut shorter = walk.clone();
                shorter.remove(i);
                if shorter.is_empty() || !is_walk(spec, &shorter) {
                    continue;
                }
                tries += 1;
                let base = base_us + tries * 10_000_000;
                let attempt = format!("{name}-shrunk-{tries}");
                if let Err(found) = self.replay(spec, base, attempt, &shorter).await {
                    shorter.truncate(found.step + 1);
                    i = i.min(shorter.len());
                    (walk, report, shrunk) = (shorter, found.report, true);
                }
            }
        }
        (walk.len(), report)
    }
}

/// Replays every seed over `lanes` (seed `i` on lane `i % lanes`); panics with the first
/// divergence found, its walk shown up to the step that diverged.
async fn replay_seeds(side: &'static str, spec: Spec, lanes: Vec<Lane>) {
    let start_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_micros() as u64;
    let started = Instant::now();
    let seeds = seeds();
    let count = lanes.len();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, lane) in lanes.into_iter().enumerate() {
        let (spec, seeds) = (spec.clone(), seeds.clone());
        tasks.spawn(async move {
            let end = seeds.end;
            let mut slowest = Duration::ZERO;
            for seed in seeds.skip(i).step_by(count) {
                let walk = walk(&spec, seed, STEPS);
                let began = Instant::now();
                // Each walk's clock starts 10 s after the previous seed's, above the real time.
                let base_us = start_us + seed * 10_000_000;
                let name = format!("walk-{seed}");
                if let Err(found) = lane.replay(&spec, base_us, name.clone(), &walk).await {
                    let step = found.step + 1;
                    // Past every seed's clock, for the shrinking replays.
                    let base_us = start_us + (end + 1) * 10_000_000;
                    let (steps, report) = lane.shrink(&spec, base_us, &name, &walk, found).await;
                    return Err(format!(
                        "{side}, seed {seed}: diverged at step {step}; shrunk to {steps} steps: \
                         {report}"
                    ));
                }
                slowest = slowest.max(began.elapsed());
            }
            Ok::<_, String>(slowest)
        });
    }
    let mut slowest = Duration::ZERO;
    while let Some(done) = tasks.join_next().await {
        match done.expect("a lane ran to its end") {
            Ok(lane) => slowest = slowest.max(lane),
            Err(why) => panic!("{why}"),
        }
    }
    // A walk must stay well within the claim window (see `CLAIM`).
    println!(
        "conformance on {side}: {} walks x {STEPS} steps in {:.1} s (slowest walk {:.1} s)",
        seeds.end - seeds.start,
        started.elapsed().as_secs_f64(),
        slowest.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_script_decides_every_step_of_a_thousand_walks_as_the_model_does() {
    let spec = Spec::new(config());
    let mut lanes = vec![];
    for _ in 0..LANES {
        lanes.push(Lane::redis(&spec).await);
    }
    replay_seeds("Redis", spec, lanes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_backend_decides_every_step_of_a_thousand_walks_as_the_model_does() {
    let spec = Spec::new(config());
    let memory = MemoryBackend::new();
    let lanes = (0..LANES).map(|_| Lane::memory(&spec, &memory)).collect();
    replay_seeds("MemoryBackend", spec, lanes).await;
}
