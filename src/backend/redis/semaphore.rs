//! One semaphore in Redis: its keys, every operation as one call of `lua/semaphore/`, and
//! the outbox that lets concurrent operations of this process share calls (releases ride on the
//! next call; acquires that arrive while one is in flight go together in the next: a group
//! commit).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use redis::{Cmd, Value};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use super::keys::{hash_tag, slot_tag};
use super::protocol::{
    FULL, GRANTED, HOLDS, MAX_MEMBERS, MAX_RELEASES, NEWER, QUEUED, RATE_LIMITED, TOO_HEAVY,
    UNKNOWN, WAITS,
};
use super::script::{Lua, invoke};
use super::{Connection, RedisBackend};
use crate::backend::gcra::{RateKey, Rated};
use crate::backend::owed;
use std::fmt::Write;

use crate::RateDecision;
use crate::backend::store::{
    Attempt, Ending, Member, Mode, Opened, Samples, Store, process_tag, sealed::Open,
};
use crate::class::Classes;
use crate::snapshot::{Holder, ProtocolInUse, Snapshot};
use crate::sync::{BoxFuture, lock};
use crate::waitlist::{ClockReading, PATIENCE, Refresh, Status};
use crate::{AdaptiveLimit, Error};

/// Every operation on a semaphore, in one script.
static SEMAPHORE: Lua = Lua::library(concat!(
    include_str!("../lua/gcra.lua"),
    include_str!("../lua/semaphore/protocol.lua"),
    include_str!("../lua/semaphore/args.lua"),
    include_str!("../lua/semaphore/classes.lua"),
    include_str!("../lua/semaphore/tenants.lua"),
    include_str!("../lua/semaphore/fence.lua"),
    include_str!("../lua/semaphore/sweep.lua"),
    include_str!("../lua/semaphore/adapt.lua"),
    include_str!("../lua/semaphore/holders.lua"),
    include_str!("../lua/semaphore/line.lua"),
    include_str!("../lua/semaphore/ops.lua")
));

/// How far ahead of its readings so far the server's clock may read before this process
/// takes it for a step forward (µs): well above a round trip and a busy scheduler's delay.
const STEP_US: i64 = 500_000;

/// How often a process tells a semaphore its name (see `RedisBackendBuilder::process_name`).
const NAME_EVERY: Duration = Duration::from_secs(30);

impl Open for RedisBackend {
    fn open(
        &self,
        name: &str,
        limit: u32,
        adaptive: Option<AdaptiveLimit>,
        classes: &Classes,
        claim: Duration,
    ) -> Opened {
        let store = RedisSemaphore::new(self, name, limit, adaptive, classes, claim);
        // Grants to this process's members are announced on its own channel (see the script),
        // and reach the waitlist through the hub.
        let waitlist = (self.shared.hub).waitlist(&store.waitlist_key());
        Opened { store, waitlist }
    }
}

struct RedisSemaphore {
    me: Weak<RedisSemaphore>,
    /// Keeps the connection and the announcement hub alive as long as the semaphore.
    shared: Arc<Connection>,
    keys: [String; 8],
    /// Through Sentinel: the server's promotion key (one per prefix) and the fence (see
    /// `Connection::promotion_fence`).
    promoted: Option<(String, Duration)>,
    /// Where grants are announced: `<channel>:<process tag>`, the tag being the first hex
    /// digits of the member's id.
    channel: String,
    /// This process's tag, sent with every call: a call is news that the process is alive
    /// (see the silent processes of `lua/semaphore/`).
    tag: String,
    /// When this process's name last went with a call, and its last call (see
    /// [`RedisSemaphore::caller`]).
    named: Mutex<Option<Named>>,
    /// How long a grant to a waiter stays provisional (`SemaphoreBuilder::claim_window`).
    claim: Duration,
    /// The local instant clock readings are counted from, and the smallest offset of the
    /// server's clock from it seen so far (µs), for [`RedisSemaphore::observe`].
    base: Instant,
    clock: Mutex<Option<i64>>,
    /// The limit this process was built with; the one in force is stored with the semaphore.
    limit: u32,
    /// How the script is told the limit: `<limit>`, or `<initial>/<min>/<max>` for an adaptive
    /// one, then `|<classes' shares>` when any (the process that creates the semaphore's state
    /// decides both).
    limit_arg: String,
    adaptive: bool,
    /// A warning about the two limits differing was logged.
    warned: AtomicBool,
    /// The limit in force, as the last reply said (0: none yet).
    in_force: AtomicU32,
    /// Whether anyone waits, as the last reply that tells said (see `Store::crowding`).
    crowded: watch::Sender<bool>,
    outbox: Mutex<Outbox>,
}

/// What this process has not sent yet for the semaphore. Releases ride on the next call, or a
/// flush task sends them. Acquires that arrive while an acquire call is in flight wait for it,
/// then all go in the next call together: a group commit that never waits when nothing is in
/// flight, so one request costs one call however many run at once.
#[derive(Default)]
struct Outbox {
    releases: Vec<Arc<str>>,
    /// On a cluster, releases sent by a call other than an acquire and not answered yet. Every
    /// acquire call sent meanwhile carries them again (releasing twice is harmless): the
    /// cluster client does not keep the order of calls in flight, and a slot this process gave
    /// back must be free for its own later acquires. (One connection keeps the order.)
    unanswered: Vec<Arc<str>>,
    /// A flush task is spawned and has not started yet: later releases wait for it.
    flush_pending: bool,
    /// Releases whose call failed because the server could not be reached: every later call
    /// carries them, and a task sends them once the server answers again, until their leases
    /// would have ended anyway (at most `owed::AT_MOST`). Without this, a slot given back during an
    /// outage stays taken for a whole lease after it.
    owed: Vec<Owed>,
    /// A task waits for the server to answer again, to send `owed`.
    owed_pending: bool,
    /// An acquire call is in flight; whoever sent it passes the queued acquires on when it is
    /// answered (see [`Sending`]).
    sending: bool,
    acquires: Vec<Queued>,
}

/// When this process last told a semaphore its name (from `RedisSemaphore::base`), the count
/// of lost connections then, and when it last called.
#[derive(Clone, Copy)]
struct Named {
    told: Duration,
    epoch: u64,
    last_call: Duration,
}

/// A release that could not be sent, kept until `until` (its member's lease from when its call
/// failed: the longest it may still hold).
struct Owed {
    member: Arc<str>,
    until: Instant,
}

/// An acquire waiting for the call in flight.
struct Queued {
    member: Arc<str>,
    mode: Mode,
    rate: Option<Rated>,
    until: Option<Instant>,
    /// Dropped unanswered (no runtime left to send it): the caller sends it itself.
    reply: oneshot::Sender<Result<Attempt, Error>>,
}

impl RedisSemaphore {
    /// The semaphore `name` on `backend`, built with `limit` (adapting within `adaptive`) and
    /// the claim window `claim`.
    fn new(
        backend: &RedisBackend,
        name: &str,
        limit: u32,
        adaptive: Option<AdaptiveLimit>,
        classes: &Classes,
        claim: Duration,
    ) -> Arc<Self> {
        let mut limit_arg = match adaptive {
            Some(AdaptiveLimit { initial, min, max }) => format!("{initial}/{min}/{max}"),
            None => limit.to_string(),
        };
        if classes.any() {
            limit_arg.push('|');
            limit_arg.push_str(&classes.encode());
        }
        let base = format!("{}{}", backend.prefix, hash_tag(name));
        Arc::new_cyclic(|me| RedisSemaphore {
            me: me.clone(),
            shared: backend.shared.clone(),
            keys: [
                "holders", "meta", "queue", "alive", "since", "procs", "tenants", "versions",
            ]
            .map(|key| format!("{base}:{key}")),
            promoted: (backend.shared.promotion_fence)
                .map(|fence| (format!("{}dlimit-promoted", backend.prefix), fence)),
            warned: AtomicBool::new(false),
            in_force: AtomicU32::new(0),
            crowded: watch::Sender::new(false),
            limit,
            limit_arg,
            adaptive: adaptive.is_some(),
            channel: format!("{base}:granted"),
            tag: format!("{:08x}", process_tag()),
            named: Mutex::new(None),
            claim,
            base: Instant::now(),
            clock: Mutex::new(None),
            outbox: Mutex::default(),
        })
    }

    /// `set_limit <limit>` or `unset_limit`: both answer 1.
    fn pin(&self, op: &'static str, limit: Option<u32>) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            match self
                .run(op, None, None, None, |script, _| {
                    if let Some(limit) = limit {
                        script.arg(limit);
                    }
                })
                .await?
            {
                Value::Int(1) => Ok(()),
                other => Err(unexpected(&other)),
            }
        })
    }

    /// This process's tag, with its name when Redis may not have it: every [`NAME_EVERY`],
    /// after a lost connection, and after a pause in this process's calls of a claim window
    /// or more (the names expire with the holders, at least two thirds of a lease after a
    /// holder's last call, and the claim window is at most half a lease). One more short
    /// argument then, never a call of its own.
    fn caller(&self) -> &str {
        let now = self.base.elapsed();
        let epoch = *self.shared.reconnects.borrow();
        let mut named = lock(&self.named);
        let due = named.is_none_or(|named| {
            // (Another caller may have read a later `now` before taking the lock.)
            named.epoch != epoch
                || now.saturating_sub(named.told) >= NAME_EVERY
                || now.saturating_sub(named.last_call) >= self.claim
        });
        let told = match *named {
            Some(named) if !due => named.told,
            _ => now,
        };
        let last_call = named.map_or(now, |named| named.last_call.max(now));
        *named = Some(Named {
            told,
            epoch,
            last_call,
        });
        if due { &self.shared.process } else { &self.tag }
    }

    fn outbox(&self) -> MutexGuard<'_, Outbox> {
        lock(&self.outbox)
    }

    /// One call of the script: `op` on this semaphore, releasing `releasing` and whatever
    /// releases are waiting to be sent, with the operation's own arguments after those
    /// (`args` is told whether this is a repeat).
    ///
    /// A call whose connection dropped is sent once more: the connection manager reconnects on
    /// that error, and every operation may run twice (an acquire's repeat rechecks its member
    /// instead of adding it again). A server that is loading its data or busy with a script is
    /// asked again after a jittered pause, until `until` (or the call timeout). With
    /// `wait_for_replicas`, a call that may grant (`confirm`) is pipelined with `WAIT`, and
    /// fails unless enough replicas acknowledged it.
    async fn run(
        &self,
        op: &'static str,
        rate_key: Option<&str>,
        releasing: Option<&str>,
        until: Option<Instant>,
        args: impl Fn(&mut Cmd, bool),
    ) -> Result<Value, Error> {
        let (mut carried, echoed) = self.releases_for(op, usize::from(releasing.is_some()));
        let replicas = self
            .shared
            .replicas
            .filter(|_| matches!(op, "acquire" | "touch" | "renew"));
        let until = until.unwrap_or_else(|| Instant::now() + self.shared.call_timeout);
        // Decided once: every attempt of the call carries the same (a first one may be lost).
        let caller = self.caller();
        let result = invoke(
            &SEMAPHORE,
            &self.shared,
            op,
            until,
            replicas,
            |command, repeat| {
                let promoted = self.promoted.as_ref();
                command
                    .arg(
                        self.keys.len()
                            + usize::from(rate_key.is_some())
                            + usize::from(promoted.is_some()),
                    )
                    .arg(&self.keys[..]);
                if let Some(key) = rate_key {
                    command.arg(key);
                }
                if let Some((key, _)) = promoted {
                    command.arg(key);
                }
                command
                    .arg(op)
                    .arg(&self.channel)
                    .arg(self.shared.publisher())
                    .arg(&self.limit_arg)
                    .arg(PATIENCE.as_millis() as u64)
                    .arg(self.claim.as_millis() as u64)
                    .arg(promoted.map_or(0, |(_, fence)| fence.as_millis() as u64))
                    .arg(caller)
                    .arg(carried.len() + echoed.len() + usize::from(releasing.is_some()));
                if let Some(member) = releasing {
                    command.arg(member);
                }
                for member in carried.members().chain(&echoed) {
                    command.arg(&**member);
                }
                args(command, repeat);
            },
        )
        .await;
        carried.settle();
        let result = result.and_then(|(reply, acked)| match (self.shared.replicas, acked) {
            (Some(replicas), Some(acked)) if acked < i64::from(replicas.count) => {
                Err(Error::backend(
                    format!(
                        "only {acked} of {} replicas acknowledged `{op}` within {:?} \
                         (wait_for_replicas), so it does not count; check the replicas' \
                         health and lag, or raise the timeout",
                        replicas.count, replicas.timeout
                    ),
                    None,
                ))
            }
            _ => Ok(reply),
        });
        let result = result.map_err(|e| self.explained(e));
        if let Err(e) = &result
            && carried.len() > 0
        {
            if self.shared.health.is_up() {
                tracing::warn!(error = %e, count = carried.len(), "releases failed: those slots free when their leases end");
            } else {
                // Unreachable: sent again once it answers (releasing twice is harmless).
                carried.owe();
            }
        }
        result
    }

    /// A failed call's error, where the semaphore's keys explain it better: kept by a newer
    /// protocol (the script refused and wrote nothing; a configuration error, so no outage
    /// policy admits past it: this process must be upgraded), or one of them of another type.
    fn explained(&self, e: Error) -> Error {
        let text = e.to_string();
        if text.contains(NEWER) {
            return Error::config(format!("a newer build shares this semaphore: {text}"));
        }
        if text.contains("command not allowed when used memory") {
            // (The script form on a full server, or a grant refused there: see script.rs.)
            return Error::backend(
                format!(
                    "{text}: Redis is out of memory (maxmemory), so no permit is granted until \
                     memory is freed; releases and renewals still go through. Free memory or \
                     raise maxmemory"
                ),
                None,
            );
        }
        match e {
            Error::Backend(mut e) if e.message.contains("holds a value of another type") => {
                let _ = write!(
                    e.message,
                    " (this semaphore's keys: {})",
                    self.keys.join(", ")
                );
                Error::Backend(e)
            }
            e => e,
        }
    }

    /// The releases a call of `op` carries besides `own` of its own: those waiting to be sent
    /// (the call owns them), and on a cluster, for an acquire, also those sent by other calls
    /// and not answered yet (echoed); at most [`MAX_RELEASES`] in all, the oldest first (the
    /// rest wait for the next call, which `pass_on` or `flush` makes).
    fn releases_for(&self, op: &str, own: usize) -> (Carried<'_>, Vec<Arc<str>>) {
        let echo = self.shared.cluster;
        let mut outbox = self.outbox();
        let acquire = op == "acquire";
        // While an acquire call is in flight, only the acquire calls carry releases: a release
        // must never reach the server before its member's acquire, and the acquire calls go
        // one after another (a member still queued is taken out of the queue instead of
        // released; see `release_later`).
        let room = MAX_RELEASES.saturating_sub(own);
        let (members, owed) = if acquire || !outbox.sending {
            if !outbox.owed.is_empty() {
                // (The clock only when something is owed: most calls owe nothing.)
                let now = Instant::now();
                outbox.owed.retain(|owed| owed.until > now);
            }
            let members = take_front(&mut outbox.releases, room);
            let owed = take_front(&mut outbox.owed, room - members.len());
            (members, owed)
        } else {
            (Vec::new(), Vec::new())
        };
        let room = room - members.len() - owed.len();
        let echoed = if echo && acquire {
            outbox.unanswered.iter().take(room).cloned().collect()
        } else {
            Vec::new()
        };
        let carried = Carried {
            semaphore: self,
            members,
            owed,
            unanswered: echo && !acquire,
            settled: false,
        };
        if carried.unanswered {
            // Samples are not releases: counted twice, they would weigh double.
            let releases = carried.members().filter(|member| !member.ends_with(':'));
            outbox.unanswered.extend(releases.cloned());
        }
        (carried, echoed)
    }

    /// A reading of the server's clock (µs) by a call sent at `sent`. The server reads its
    /// clock after the call was sent, so `server - sent` is smallest for the readings nearest
    /// the send; one more than [`STEP_US`] above the smallest seen means the server's clock
    /// jumped ahead (an NTP step forward, which ends leases early there; or this process was
    /// paused mid-call). Then holders renew at once, so they learn of leases that ended early
    /// within a round trip instead of a third of a lease.
    fn observe(&self, sent: Instant, server_us: i64) {
        let local_us = i64::try_from(sent.saturating_duration_since(self.base).as_micros())
            .unwrap_or(i64::MAX);
        let offset = server_us.saturating_sub(local_us);
        let mut clock = lock(&self.clock);
        let jumped = clock.is_some_and(|least| offset > least.saturating_add(STEP_US));
        *clock = Some(match *clock {
            Some(least) if !jumped => least.min(offset),
            _ => offset,
        });
        drop(clock);
        if jumped {
            tracing::debug!(
                "the Redis server's clock reads ahead of this process's by more than before; \
                 holders renew at once"
            );
            self.shared.reconnects.send_modify(|n| *n += 1);
        }
    }

    /// How a release names its member for the script (`lua/semaphore/adapt.lua`): a process
    /// built adaptive puts `@<µs held>:` before it (its own measure of the hold, free of the
    /// hand-off delays of grant announcements and carried releases), and `!` before that
    /// marks an overloaded hold.
    fn released(&self, member: &Arc<str>, ending: Ending) -> Arc<str> {
        let held = ending.held.filter(|_| self.adaptive);
        if held.is_none() && !ending.overloaded {
            return member.clone();
        }
        let mut text = String::with_capacity(member.len() + 16);
        if ending.overloaded {
            text.push('!');
        }
        if let Some(held) = held {
            // Writing to a String cannot fail.
            let _ = write!(text, "@{}:", held.as_micros());
        }
        text.push_str(member);
        text.into()
    }

    /// The key of this process's waitlist for the semaphore in the hub: grants to its members
    /// are announced on its own channel (see the script).
    fn waitlist_key(&self) -> String {
        format!("{}:{}", self.channel, self.tag)
    }

    /// A release's reply to a call sent at `sent`: `{removed, anyone waits, ms until the
    /// earliest lease ends (0 when nobody waits)}`. This process's waiters check the line by
    /// then: a grant the release made to a frozen process ends there unclaimed.
    fn released_reply(&self, reply: &Value, sent: Instant) -> Result<(), Error> {
        match integers(reply).as_deref() {
            Some(&[_, crowded, retry_ms]) => {
                self.note_crowded(crowded);
                if retry_ms > 0
                    && let Some(list) = self.shared.hub.get(&self.waitlist_key())
                {
                    list.check_by(sent + millis(retry_ms));
                }
                Ok(())
            }
            _ => Err(unexpected(reply)),
        }
    }

    /// A reply said whether anyone waits (`1`) or not.
    fn note_crowded(&self, flag: i64) {
        self.crowded.send_if_modified(|crowded| {
            let was = std::mem::replace(crowded, flag == 1);
            was != *crowded
        });
    }

    /// Logs once when the limit in force is not the one this process was built with.
    fn note_limit(&self, limit: i64) {
        if let Ok(limit) = u32::try_from(limit) {
            self.in_force.store(limit, Ordering::Relaxed);
        }
        // An adaptive limit moves; only a fixed one can differ from the one in force.
        if !self.adaptive
            && limit != i64::from(self.limit)
            && !self.warned.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                configured = self.limit,
                in_force = limit,
                channel = %self.channel,
                "this semaphore admits by the limit stored with it, not the one this process was \
                 built with; change it for every process with set_limit (or `dlimit set-limit`)"
            );
        }
    }

    /// Sends the waiting releases, a call per [`MAX_RELEASES`], unless another call took them
    /// meanwhile or an acquire call in flight will pass them on.
    async fn flush(&self) {
        loop {
            {
                let outbox = self.outbox();
                if (outbox.releases.is_empty() && outbox.owed.is_empty()) || outbox.sending {
                    return;
                }
            }
            // `run` logs a failure; the leases are the fallback.
            let sent = Instant::now();
            match self.run("release", None, None, None, |_, _| {}).await {
                Ok(reply) => {
                    let _ = self.released_reply(&reply, sent);
                }
                Err(_) => return,
            }
        }
    }

    /// Makes sure a flush task will send the waiting releases, unless one is already due to.
    fn schedule_flush(&self) {
        let spawned = self.spawn_once(
            |outbox| &mut outbox.flush_pending,
            |mut pending| async move { pending.start().flush().await },
        );
        if !spawned {
            tracing::warn!(
                "permit dropped outside a tokio runtime: it is released with the semaphore's \
                 next call, or frees when its lease ends"
            );
        }
    }

    /// Makes sure a task sends the owed releases once the server answers again (the probe's
    /// reconnection), or forgets them when the last of their leases would have ended anyway.
    /// Without a runtime, the semaphore's next call carries them.
    fn flush_once_answered(&self) {
        // (Subscribed first: a reconnection from here on is seen.)
        let mut ticks = self.shared.reconnects.subscribe();
        self.spawn_once(
            |outbox| &mut outbox.owed_pending,
            |mut pending| async move {
                let semaphore = &pending.semaphore;
                let until = semaphore.outbox().owed.iter().map(|owed| owed.until).max();
                if let Some(until) = until
                    && !semaphore.shared.health.is_up()
                {
                    tokio::select! {
                        _ = ticks.changed() => {}
                        _ = tokio::time::sleep_until(until) => {}
                    }
                }
                pending.start().flush().await;
            },
        );
    }

    /// Spawns `task` on the current runtime unless the outbox's `flag` says one is pending;
    /// the flag goes down when the task starts or is dropped, so a task lost with its runtime
    /// never stops a later one. False only when there is no runtime to spawn on (a semaphore
    /// going away needs no task, and counts as one pending).
    fn spawn_once<F>(
        &self,
        flag: fn(&mut Outbox) -> &mut bool,
        task: impl FnOnce(Pending) -> F,
    ) -> bool
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let Some(semaphore) = self.me.upgrade() else {
            return true;
        };
        if std::mem::replace(flag(&mut semaphore.outbox()), true) {
            return true;
        }
        let pending = Pending {
            semaphore,
            flag,
            started: false,
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(task(pending));
                true
            }
            Err(_) => false,
        }
    }

    /// Acquires `member`: sent at once when no acquire call is in flight, otherwise with the
    /// acquires queued behind that call, in the next one.
    async fn acquire_batched(
        &self,
        member: &Member,
        mode: Mode,
        until: Option<Instant>,
        rate: Option<&Rated>,
    ) -> Result<Attempt, Error> {
        loop {
            let waiting = {
                let mut outbox = self.outbox();
                if outbox.sending {
                    let (reply, answer) = oneshot::channel();
                    outbox.acquires.push(Queued {
                        member: member.text.clone(),
                        mode,
                        rate: rate.cloned(),
                        until,
                        reply,
                    });
                    Some(answer)
                } else {
                    outbox.sending = true;
                    None
                }
            };
            match waiting {
                // Answered, or dropped unsent (its sender lost its runtime): then send it here.
                Some(answer) => match answer.await {
                    Ok(attempt) => return attempt,
                    Err(_) => continue,
                },
                None => {
                    let mut sending = Sending::new(self);
                    let attempts = self.acquire_all(&[(&member.text, mode, rate)], until).await;
                    sending.answered = true;
                    return attempts?.pop().ok_or_else(|| {
                        Error::backend("the acquire call answered no member", None)
                    });
                }
            }
        }
    }

    /// Sends the acquires queued behind the call that `sending` was for.
    async fn send_queued(mut sending: Sending<Arc<RedisSemaphore>>) {
        let queued = next_call(&mut sending.semaphore.outbox().acquires);
        let members: Vec<_> = queued
            .iter()
            .map(|q| (&q.member, q.mode, q.rate.as_ref()))
            .collect();
        let until = queued.iter().map(|q| q.until).max().flatten();
        let attempts = sending.semaphore.acquire_all(&members, until).await;
        sending.answered = true;
        match attempts {
            Ok(attempts) => {
                for (queued, attempt) in queued.into_iter().zip(attempts) {
                    let _ = queued.reply.send(Ok(attempt));
                }
            }
            Err(e) => {
                for queued in queued {
                    let _ = queued.reply.send(Err(Error::backend(e.to_string(), None)));
                }
            }
        }
    }

    /// Called when the acquire call in flight was answered, or given up.
    ///
    /// Answered, a task sends the acquires queued meanwhile (else the waiting releases are
    /// flushed). Given up (its caller was cancelled, or its runtime went away), the queued
    /// callers are told to send their own, so none waits for a call nobody will make.
    fn pass_on(&self, answered: bool) {
        let mut outbox = self.outbox();
        // A caller that gave up needs no answer (its claim releases the member if it was sent).
        outbox.acquires.retain(|queued| !queued.reply.is_closed());
        let next = if outbox.acquires.is_empty() || !answered {
            None
        } else {
            self.me
                .upgrade()
                .zip(tokio::runtime::Handle::try_current().ok())
        };
        match next {
            Some((me, runtime)) => {
                // Not under the lock: a runtime shutting down drops the task at once, and its
                // drop (`Sending`) takes the lock.
                drop(outbox);
                runtime.spawn(Self::send_queued(Sending::new(me)));
            }
            None => {
                outbox.sending = false;
                outbox.acquires.clear();
                let releases = !outbox.releases.is_empty() || !outbox.owed.is_empty();
                drop(outbox);
                if releases {
                    self.schedule_flush();
                }
            }
        }
    }

    /// One acquire call for `members`, each with its mode and the rate it spends if granted at
    /// once (every one the same limiter, or none), answered in order.
    async fn acquire_all(
        &self,
        members: &[(&Arc<str>, Mode, Option<&Rated>)],
        until: Option<Instant>,
    ) -> Result<Vec<Attempt>, Error> {
        let rate = members
            .first()
            .and_then(|(_, _, rate)| *rate)
            .map(|rate| &rate.limiter);
        let sent = Instant::now();
        let reply = self
            .run(
                "acquire",
                rate.map(|rate| &*rate.key),
                None,
                until,
                |script, repeat| {
                    match rate {
                        Some(rate) => script
                            .arg(rate.gcra.rate)
                            .arg(rate.gcra.period_us)
                            .arg(rate.gcra.burst),
                        None => script.arg(0).arg(0).arg(0),
                    };
                    for &(member, mode, rated) in members {
                        let mode = if repeat && mode == Mode::Join {
                            Mode::Recheck
                        } else {
                            mode
                        };
                        let cost = rated.map_or(0, |rated| rated.cost);
                        script.arg(&**member).arg(mode_word(mode)).arg(cost);
                    }
                },
            )
            .await?;
        let answers = match &reply {
            Value::Array(answers) if answers.len() == members.len() => answers,
            _ => return Err(unexpected(&reply)),
        };
        answers
            .iter()
            .map(|answer| self.attempt(answer, sent))
            .collect()
    }

    /// One member's answer to an acquire call sent at `sent`.
    fn attempt(&self, reply: &Value, sent: Instant) -> Result<Attempt, Error> {
        let numbers = integers(reply);
        // Where each answer carries the limit in force (a heavy one's is no news).
        let at = |first| match first {
            GRANTED => Some(4),
            FULL | QUEUED => Some(3),
            RATE_LIMITED => Some(2),
            _ => None,
        };
        if let Some(numbers) = numbers.as_deref()
            && let Some(&limit) = numbers.first().and_then(|&first| numbers.get(at(first)?))
        {
            self.note_limit(limit);
        }
        match numbers.as_deref() {
            Some(&[TOO_HEAVY, limit]) => Ok(Attempt::TooHeavy {
                limit: u32::try_from(limit).map_err(|_| unexpected(reply))?,
            }),
            Some(&[GRANTED, token, left_us, now_us, _, crowded, ref rate @ ..]) => {
                self.observe(sent, now_us);
                self.note_crowded(crowded);
                let rate = match *rate {
                    [] => None,
                    [remaining, reset_us] => Some(RateDecision {
                        allowed: true,
                        remaining: u32::try_from(remaining.max(0)).unwrap_or(u32::MAX),
                        retry_after: None,
                        reset_after: micros(reset_us).ok_or_else(|| unexpected(reply))?,
                        degraded: false,
                    }),
                    _ => return Err(unexpected(reply)),
                };
                Ok(Attempt::Granted {
                    token: token_of(token).ok_or_else(|| unexpected(reply))?,
                    remaining: micros(left_us).ok_or_else(|| unexpected(reply))?,
                    rate,
                })
            }
            Some(&[QUEUED, retry_ms, now_us, _]) => {
                self.observe(sent, now_us);
                self.note_crowded(1);
                Ok(Attempt::Queued {
                    retry_in: millis(retry_ms),
                    clock: ClockReading {
                        local: sent,
                        server_us: u64::try_from(now_us).map_err(|_| unexpected(reply))?,
                    },
                })
            }
            Some(&[FULL, _, now_us, _]) => {
                self.observe(sent, now_us);
                Ok(Attempt::Full)
            }
            Some(&[RATE_LIMITED, retry_us, _]) => Ok(Attempt::RateLimited {
                retry_after: micros(retry_us).ok_or_else(|| unexpected(reply))?,
            }),
            _ => Err(unexpected(reply)),
        }
    }
}

/// The acquires that go in the next call: the oldest queued that go with the same rate limiter
/// (or none), at most [`MAX_MEMBERS`], in order.
fn next_call(acquires: &mut Vec<Queued>) -> Vec<Queued> {
    fn limiter(q: &Queued) -> Option<&RateKey> {
        q.rate.as_ref().map(|rate| &rate.limiter)
    }
    let first = acquires.first().and_then(limiter);
    let take = (acquires.iter())
        .take(MAX_MEMBERS)
        .take_while(|q| limiter(q) == first)
        .count();
    acquires.drain(..take).collect()
}

/// A task spawned by [`RedisSemaphore::spawn_once`]: lowers its flag when it starts its work,
/// or when dropped before that.
struct Pending {
    semaphore: Arc<RedisSemaphore>,
    flag: fn(&mut Outbox) -> &mut bool,
    started: bool,
}

impl Pending {
    /// The task starts its work: a later one may be spawned from now on.
    fn start(&mut self) -> &RedisSemaphore {
        self.started = true;
        *(self.flag)(&mut self.semaphore.outbox()) = false;
        &self.semaphore
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.started {
            *(self.flag)(&mut self.semaphore.outbox()) = false;
        }
    }
}

/// Held by whoever sends the acquire call in flight (the outbox's `sending`); dropped, it
/// passes the outbox on (see [`RedisSemaphore::pass_on`]).
struct Sending<S: std::ops::Deref<Target = RedisSemaphore>> {
    semaphore: S,
    /// The call was answered (not cancelled, not dropped unstarted).
    answered: bool,
}

impl<S: std::ops::Deref<Target = RedisSemaphore>> Sending<S> {
    fn new(semaphore: S) -> Self {
        Sending {
            semaphore,
            answered: false,
        }
    }
}

impl<S: std::ops::Deref<Target = RedisSemaphore>> Drop for Sending<S> {
    fn drop(&mut self) {
        self.semaphore.pass_on(self.answered);
    }
}

/// Releases carried by a call. If the call is cancelled before it is answered they go back to
/// be sent again (releasing twice is harmless). If it fails because the server cannot be
/// reached they are owed (see `Outbox::owed`): sent with later calls and once the server
/// answers again, never retried on their own while it is down; any other failure drops them
/// with a warning.
struct Carried<'a> {
    semaphore: &'a RedisSemaphore,
    members: Vec<Arc<str>>,
    /// Owed by earlier calls that failed.
    owed: Vec<Owed>,
    /// The members are in the outbox's `unanswered` until this call is answered or dropped.
    unanswered: bool,
    settled: bool,
}

impl Carried<'_> {
    fn len(&self) -> usize {
        self.members.len() + self.owed.len()
    }

    fn members(&self) -> impl Iterator<Item = &Arc<str>> {
        self.members
            .iter()
            .chain(self.owed.iter().map(|owed| &owed.member))
    }

    /// The call was answered (or failed): its members leave `unanswered`.
    fn settle(&mut self) {
        self.settled = true;
        self.forget();
    }

    fn forget(&self) {
        if self.unanswered && self.len() > 0 {
            (self.semaphore.outbox().unanswered)
                .retain(|m| !self.members().any(|c| Arc::ptr_eq(c, m)));
        }
    }

    /// The call failed, the server unreachable: each member is owed for as long as its lease
    /// (a sample, which has none, is dropped), and a task sends them once the server answers.
    fn owe(&mut self) {
        let now = Instant::now();
        let mut outbox = self.semaphore.outbox();
        let owed = &mut outbox.owed;
        owed.retain(|owed| owed.until > now);
        owed.extend(self.owed.drain(..).filter(|owed| owed.until > now));
        owed.extend(self.members.drain(..).filter_map(|member| {
            let lease = lease_of(&member)?;
            Some(Owed {
                member,
                until: now + lease,
            })
        }));
        owed::bound(owed);
        drop(outbox);
        self.semaphore.flush_once_answered();
    }
}

impl Drop for Carried<'_> {
    fn drop(&mut self) {
        if self.settled || self.len() == 0 {
            return;
        }
        self.forget();
        let mut outbox = self.semaphore.outbox();
        outbox.releases.append(&mut self.members);
        outbox.owed.append(&mut self.owed);
        drop(outbox);
        self.semaphore.schedule_flush();
    }
}

/// The lease a member's text ends with (`...:<lease ms>`), after any marks a release puts
/// before it; none for a sample (`@<µs>*<n>:`).
fn lease_of(text: &str) -> Option<Duration> {
    let (_, lease) = text.rsplit_once(':')?;
    lease.parse().ok().map(Duration::from_millis)
}

/// The first `n` of `list` (all when it holds fewer), taken out of it in order.
fn take_front<T>(list: &mut Vec<T>, n: usize) -> Vec<T> {
    if list.len() <= n {
        std::mem::take(list)
    } else {
        list.drain(..n).collect()
    }
}

/// The word the script takes for each mode.
fn mode_word(mode: Mode) -> &'static str {
    match mode {
        Mode::Once => "once",
        Mode::Join => "join",
        Mode::Recheck => "recheck",
    }
}

impl Store for RedisSemaphore {
    fn acquire<'a>(
        &'a self,
        member: &'a Member,
        mode: Mode,
        until: Option<Instant>,
        rate: Option<&'a Rated>,
    ) -> BoxFuture<'a, Result<Attempt, Error>> {
        Box::pin(self.acquire_batched(member, mode, until, rate))
    }

    fn limit_in_force(&self) -> Option<u32> {
        Some(self.in_force.load(Ordering::Relaxed)).filter(|&limit| limit > 0)
    }

    fn combines(&self, rate: &RateKey) -> bool {
        // One call reaches both keys: the same connection, and on a cluster the same slot.
        rate.backend == Arc::as_ptr(&self.shared) as usize
            && (!self.shared.cluster || slot_tag(&rate.key) == slot_tag(&self.keys[0]))
    }

    fn release<'a>(
        &'a self,
        member: &'a Member,
        ending: Ending,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            let text = self.released(&member.text, ending);
            let sent = Instant::now();
            let reply = self.run("release", None, Some(&text), None, |_, _| {});
            self.released_reply(&reply.await?, sent)
        })
    }

    fn release_later(&self, member: Member, ending: Ending) {
        let mut outbox = self.outbox();
        // Still queued behind the call in flight: never sent, so it is only taken out of the
        // queue. Released instead, the release could reach the server first (carried by
        // another call) and the acquire after it: a slot held for a whole lease by nobody.
        let queued = outbox.acquires.len();
        outbox.acquires.retain(|q| q.member != member.text);
        if outbox.acquires.len() < queued {
            return;
        }
        outbox.releases.push(self.released(&member.text, ending));
        // An acquire call in flight passes the releases on when it is answered.
        if !outbox.sending {
            drop(outbox);
            self.schedule_flush();
        }
    }

    // As a release with no member: `[!]@<µs mean>*<count>:` (lua/semaphore/holders.lua).
    fn sampled(&self, samples: Samples) {
        if !self.adaptive {
            return;
        }
        let mut text = String::with_capacity(24);
        if samples.overloaded {
            text.push('!');
        }
        // Writing to a String cannot fail.
        let _ = write!(text, "@{}*{}:", samples.mean.as_micros(), samples.count);
        let mut outbox = self.outbox();
        outbox.releases.push(text.into());
        if !outbox.sending {
            drop(outbox);
            self.schedule_flush();
        }
    }

    fn renew<'a>(
        &'a self,
        members: &'a [Member],
    ) -> BoxFuture<'a, Result<Vec<Option<Duration>>, Error>> {
        Box::pin(async move {
            let mut renewed = Vec::with_capacity(members.len());
            // Batches keep each script call short, however many permits this process holds.
            for batch in members.chunks(MAX_MEMBERS) {
                let sent = Instant::now();
                let reply = self
                    .run("renew", None, None, None, |script, _| {
                        for member in batch {
                            script.arg(&*member.text);
                        }
                    })
                    .await?;
                match integers(&reply).as_deref() {
                    Some([now_us, crowded, left @ ..]) if left.len() == batch.len() => {
                        self.observe(sent, *now_us);
                        self.note_crowded(*crowded);
                        renewed.extend(left.iter().copied().map(micros));
                    }
                    _ => return Err(unexpected(&reply)),
                }
            }
            Ok(renewed)
        })
    }

    fn used(&self) -> BoxFuture<'_, Result<u32, Error>> {
        Box::pin(async move {
            // `{used, the limit in force}`: `available_permits` counts by the latter.
            let reply = self.run("used", None, None, None, |_, _| {}).await?;
            match integers(&reply).as_deref() {
                Some(&[used, limit]) => {
                    self.note_limit(limit);
                    Ok(u32::try_from(used.max(0)).unwrap_or(u32::MAX))
                }
                _ => Err(unexpected(&reply)),
            }
        })
    }

    fn crowding(&self) -> Option<watch::Receiver<bool>> {
        Some(self.crowded.subscribe())
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        Some(self.shared.reconnects.subscribe())
    }

    fn snapshot(&self) -> BoxFuture<'_, Result<Snapshot, Error>> {
        Box::pin(async move {
            let reply = self.run("snapshot", None, None, None, |_, _| {}).await?;
            parse_snapshot(&reply).ok_or_else(|| unexpected(&reply))
        })
    }

    fn set_limit(&self, limit: u32) -> BoxFuture<'_, Result<(), Error>> {
        self.pin("set_limit", Some(limit))
    }

    fn unset_limit(&self) -> BoxFuture<'_, Result<(), Error>> {
        self.pin("unset_limit", None)
    }

    fn evict<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            match self
                .run("evict", None, None, None, |script, _| {
                    script.arg(id);
                })
                .await?
            {
                Value::Int(evicted) => Ok(evicted == 1),
                other => Err(unexpected(&other)),
            }
        })
    }
}

impl Refresh for RedisSemaphore {
    fn touch<'a>(
        &'a self,
        members: &'a [Arc<str>],
        until: Instant,
    ) -> BoxFuture<'a, Result<(Vec<Status>, Duration), Error>> {
        Box::pin(async move {
            let mut statuses = Vec::with_capacity(members.len());
            let mut retry_in = PATIENCE;
            for batch in members.chunks(MAX_MEMBERS) {
                let reply = self
                    .run("touch", None, None, Some(until), |script, _| {
                        for member in batch {
                            script.arg(&**member);
                        }
                    })
                    .await?;
                let numbers = integers(&reply).ok_or_else(|| unexpected(&reply))?;
                let Some((&retry_ms, rest)) = numbers.split_first() else {
                    return Err(unexpected(&reply));
                };
                if rest.len() != batch.len() * 3 {
                    return Err(unexpected(&reply));
                }
                for status in rest.chunks_exact(3) {
                    statuses.push(match *status {
                        [HOLDS, token, left_us] => match (token_of(token), micros(left_us)) {
                            (Some(token), Some(remaining)) => Status::Granted { token, remaining },
                            _ => Status::Unknown,
                        },
                        [WAITS, ..] => Status::Queued,
                        [UNKNOWN, ..] => Status::Unknown,
                        _ => return Err(unexpected(&reply)),
                    });
                }
                // (The soonest any batch asks for.)
                retry_in = retry_in.min(millis(retry_ms));
            }
            Ok((statuses, retry_in))
        })
    }

    fn confirms_grants(&self) -> bool {
        self.shared.replicas.is_some()
    }
}

/// `{limit, used, waiting, now ms, pinned, waiting per level ("<n0>,...,<n7>"), tenants'
/// waiting ("<hex>:<n>,..."), the shares in force, then per holder: member, deadline ms,
/// granted ms, process name}`.
fn parse_snapshot(reply: &Value) -> Option<Snapshot> {
    let Value::Array(items) = reply else {
        return None;
    };
    let int = |value: &Value| -> Option<i64> {
        match value {
            Value::Int(n) => Some(*n),
            Value::BulkString(text) => std::str::from_utf8(text).ok()?.parse().ok(),
            _ => None,
        }
    };
    let (head, rest) = items.split_at_checked(10)?;
    let per_level = |value: &Value| -> Option<[u32; 8]> {
        let mut counts = [0u32; 8];
        for (level, n) in text(value)?.split(',').enumerate().take(8) {
            counts[level] = n.parse().ok()?;
        }
        Some(counts)
    };
    let waiting = per_level(&head[5])?;
    let weights = per_level(&head[9])?;
    let tenants = text(&head[6])?
        .split(',')
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let (tenant, n) = entry.split_once(':')?;
            Some((u64::from_str_radix(tenant, 16).ok()?, n.parse().ok()?))
        })
        .collect::<Option<Vec<_>>>()?;
    let count = |value: &Value| u32::try_from(int(value)?.max(0)).ok();
    let now = int(&head[3])?;
    let millis = |ms: i64| Duration::from_millis(u64::try_from(ms.max(0)).unwrap_or(0));
    let mut holders = rest
        .chunks_exact(4)
        .map(|holder| {
            let Value::BulkString(member) = &holder[0] else {
                return None;
            };
            let member = std::str::from_utf8(member).ok()?;
            let (deadline, granted) = (int(&holder[1])?, int(&holder[2])?);
            let Value::BulkString(process) = &holder[3] else {
                return None;
            };
            let held_for = if granted > 0 {
                millis(now - granted)
            } else {
                Duration::ZERO
            };
            let process = String::from_utf8_lossy(process).into_owned();
            Holder::of(member, held_for, millis(deadline - now), process)
        })
        .collect::<Option<Vec<_>>>()?;
    holders.sort_by_key(|holder| std::cmp::Reverse(holder.held_for));
    let mut snapshot = Snapshot {
        limit: count(&head[0])?,
        used: count(&head[1])?,
        waiting: count(&head[2])?,
        pinned: int(&head[4])? == 1,
        holders,
        classes: Vec::new(),
        tenants_waiting: Vec::new(),
        protocols: text(&head[8])?
            .split(',')
            .filter(|entry| !entry.is_empty())
            .map(|entry| {
                let (version, n) = entry.split_once(':')?;
                Some(ProtocolInUse::new(version.parse().ok()?, n.parse().ok()?))
            })
            .collect::<Option<Vec<_>>>()?,
    };
    snapshot.complete(&Classes::decode(text(&head[7])?), weights, waiting, tenants);
    Some(snapshot)
}

/// A reply's bulk string as text.
fn text(value: &Value) -> Option<&str> {
    match value {
        Value::BulkString(text) => std::str::from_utf8(text).ok(),
        _ => None,
    }
}

/// A fencing token: positive.
fn token_of(token: i64) -> Option<u64> {
    u64::try_from(token).ok().filter(|&token| token > 0)
}

/// Time left of a lease: positive.
fn micros(us: i64) -> Option<Duration> {
    u64::try_from(us)
        .ok()
        .filter(|&us| us > 0)
        .map(Duration::from_micros)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gcra::Gcra;

    const LEASE: Duration = Duration::from_secs(30);

    /// The script form (Redis without functions) inlines each part's `step_*` where it
    /// stands: `run` must call them in the order of the parts, and every one must go.
    #[test]
    fn the_script_form_runs_the_steps_in_the_order_run_calls_them() {
        let (library, script) = SEMAPHORE.texts();
        let defined: Vec<&str> = library
            .lines()
            .filter_map(|line| {
                line.strip_prefix("local function step_")?
                    .strip_suffix("()")
            })
            .collect();
        let ended = library.lines().filter(|l| l.starts_with("end -- step_"));
        assert_eq!(ended.count(), defined.len());
        let run = library
            .split_once("local function run(keys, argv)\n")
            .and_then(|(_, rest)| rest.split_once("end -- run\n"))
            .map(|(body, _)| body)
            .expect("the library's run");
        let called: Vec<&str> = run
            .lines()
            .filter_map(|line| line.split_once("step_")?.1.split_once("()"))
            .map(|(name, _)| name)
            .collect();
        assert_eq!(defined, called);
        assert_eq!(defined.len(), 11, "{defined:?}");
        assert!(!script.contains("function step_") && !script.contains("end -- step_"));
        assert!(!script.contains("local function run("));
        assert_eq!(script.matches("local KEYS, ARGV = KEYS, ARGV\n").count(), 1);
        assert!(script.ends_with("\nreturn reply\n"));
    }

    /// A semaphore on a server never reached: every call fails at once (nothing listens on
    /// port 1), so what the outbox does is all there is to see.
    fn unreachable() -> Arc<RedisSemaphore> {
        let backend = RedisBackend::builder("redis://127.0.0.1:1")
            .connect_lazy()
            .unwrap();
        RedisSemaphore::new(
            &backend,
            "outbox",
            5,
            None,
            &Classes::default(),
            Duration::from_secs(1),
        )
    }

    /// Lets the spawned tasks run until `done` holds.
    async fn settle(done: impl Fn() -> bool) {
        for _ in 0..1000 {
            if done() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the outbox never got there");
    }

    fn acquire(
        semaphore: &Arc<RedisSemaphore>,
        member: &Member,
    ) -> tokio::task::JoinHandle<Result<Attempt, Error>> {
        let (semaphore, member) = (semaphore.clone(), member.clone());
        tokio::spawn(
            async move { (semaphore.acquire_batched(&member, Mode::Join, None, None)).await },
        )
    }

    /// What an acquire was answered, which must come soon.
    async fn answer(
        waiter: tokio::task::JoinHandle<Result<Attempt, Error>>,
    ) -> Result<Attempt, Error> {
        let answer = tokio::time::timeout(Duration::from_secs(5), waiter).await;
        answer.expect("the acquire is answered").unwrap()
    }

    fn queued(semaphore: &RedisSemaphore) -> Vec<Arc<str>> {
        let outbox = semaphore.outbox();
        outbox.acquires.iter().map(|q| q.member.clone()).collect()
    }

    #[tokio::test]
    async fn acquires_that_arrive_during_a_call_wait_for_it_then_go_in_the_next() {
        let semaphore = unreachable();
        semaphore.outbox().sending = true;
        let (a, b) = (Member::new(1, LEASE), Member::new(2, LEASE));
        let (first, second) = (acquire(&semaphore, &a), acquire(&semaphore, &b));
        settle(|| queued(&semaphore).len() == 2).await;
        assert_eq!(queued(&semaphore), [a.text, b.text]);
        assert!(!first.is_finished() && !second.is_finished());

        // The call in flight is answered: the queued ones go next, and are answered by it.
        semaphore.pass_on(true);
        for waiter in [first, second] {
            assert!(matches!(answer(waiter).await, Err(Error::Backend(_))));
        }
        settle(|| !semaphore.outbox().sending).await;
        assert!(queued(&semaphore).is_empty());
    }

    #[tokio::test]
    async fn a_call_given_up_leaves_each_queued_acquire_to_send_its_own() {
        let semaphore = unreachable();
        semaphore.outbox().sending = true;
        let waiter = acquire(&semaphore, &Member::new(1, LEASE));
        settle(|| queued(&semaphore).len() == 1).await;
        semaphore.pass_on(false);
        // Not left waiting for a call nobody makes: it sent its own (and Redis is down).
        assert!(matches!(answer(waiter).await, Err(Error::Backend(_))));
        settle(|| !semaphore.outbox().sending).await;
    }

    #[tokio::test]
    async fn an_acquire_whose_caller_gave_up_is_not_sent() {
        let semaphore = unreachable();
        semaphore.outbox().sending = true;
        let waiter = acquire(&semaphore, &Member::new(1, LEASE));
        settle(|| queued(&semaphore).len() == 1).await;
        waiter.abort();
        assert!(waiter.await.unwrap_err().is_cancelled());
        semaphore.pass_on(true);
        // Nothing is left to send, so no call follows.
        let outbox = semaphore.outbox();
        assert!(outbox.acquires.is_empty() && !outbox.sending);
    }

    #[tokio::test]
    async fn a_queued_acquire_given_up_is_taken_out_of_the_queue_not_released() {
        let semaphore = unreachable();
        semaphore.outbox().sending = true;
        let member = Member::new(1, LEASE);
        let waiter = acquire(&semaphore, &member);
        settle(|| queued(&semaphore).len() == 1).await;
        waiter.abort();
        assert!(waiter.await.unwrap_err().is_cancelled());
        // The caller's claim gives the member back: it was never sent, so no release is kept
        // for a call that could reach the server before the acquire would.
        semaphore.release_later(member, Ending::default());
        let outbox = semaphore.outbox();
        assert!(outbox.acquires.is_empty() && outbox.releases.is_empty());
    }

    #[tokio::test]
    async fn other_calls_leave_the_releases_to_the_acquire_call_in_flight() {
        let semaphore = unreachable();
        semaphore.outbox().sending = true;
        let member = Member::new(1, LEASE);
        semaphore.release_later(member.clone(), Ending::default());
        // A read while the acquire call is in flight carries nothing (and fails: Redis is
        // down); the release waits for the acquire chain.
        assert!(
            semaphore
                .run("used", None, None, None, |_, _| {})
                .await
                .is_err()
        );
        assert_eq!(semaphore.outbox().releases, [member.text]);
    }

    #[tokio::test]
    async fn releases_wait_for_the_acquire_call_in_flight_then_are_flushed() {
        let semaphore = unreachable();
        semaphore.outbox().sending = true;
        let member = Member::new(1, LEASE);
        semaphore.release_later(member.clone(), Ending::default());
        {
            let outbox = semaphore.outbox();
            assert_eq!(outbox.releases, [member.text]);
            assert!(!outbox.flush_pending, "the call in flight carries it on");
        }
        semaphore.pass_on(true);
        assert!(semaphore.outbox().flush_pending);
        // The flush fails (Redis is down) and drops the release: its lease frees the slot.
        settle(|| {
            let outbox = semaphore.outbox();
            outbox.releases.is_empty() && !outbox.flush_pending
        })
        .await;
    }

    #[tokio::test]
    async fn releases_of_a_call_never_answered_go_back_to_be_sent_again() {
        let semaphore = unreachable();
        let member = Member::new(1, LEASE);
        drop(Carried {
            semaphore: &semaphore,
            members: vec![member.text.clone()],
            owed: Vec::new(),
            unanswered: false,
            settled: false,
        });
        {
            let outbox = semaphore.outbox();
            assert_eq!(outbox.releases, std::slice::from_ref(&member.text));
            assert!(outbox.flush_pending);
        }
        // Sent again once; that call fails (the server cannot be reached), so the release is
        // owed: kept for the server's return, not retried meanwhile.
        settle(|| semaphore.outbox().owed_pending).await;
        let outbox = semaphore.outbox();
        assert!(outbox.releases.is_empty() && !outbox.flush_pending);
        let owed: Vec<_> = outbox.owed.iter().map(|owed| &owed.member).collect();
        assert_eq!(owed, [&member.text]);
        let until = outbox.owed[0].until;
        assert!(until > Instant::now() && until <= Instant::now() + LEASE);
    }

    #[test]
    fn an_owed_release_is_kept_for_its_lease_and_a_sample_not_at_all() {
        assert_eq!(lease_of("ab12:3:30000"), Some(Duration::from_secs(30)));
        assert_eq!(
            lease_of("!@1500:ab12:c2:p:1:2000"),
            Some(Duration::from_secs(2))
        );
        assert_eq!(lease_of("@1500*3:"), None);
        assert_eq!(lease_of("no-lease"), None);
    }

    #[cfg(feature = "cluster")]
    #[tokio::test]
    async fn on_a_cluster_an_acquire_sent_while_a_release_is_unanswered_carries_it_too() {
        let backend = RedisBackend::cluster_builder(&["redis://127.0.0.1:1"])
            .connect_lazy()
            .unwrap();
        let semaphore = RedisSemaphore::new(
            &backend,
            "outbox",
            5,
            None,
            &Classes::default(),
            Duration::from_secs(1),
        );
        let member = Member::new(1, LEASE);
        semaphore.release_later(member.clone(), Ending::default());
        // A flush (or a read) takes the release and sends it; until it is answered, every
        // acquire call also carries it, whichever of the two the server sees first.
        let (mut flush, echoed) = semaphore.releases_for("release", 0);
        assert_eq!(
            (flush.members.clone(), echoed),
            (vec![member.text.clone()], vec![])
        );
        let (acquire, echoed) = semaphore.releases_for("acquire", 0);
        assert!(acquire.members.is_empty());
        assert_eq!(echoed, std::slice::from_ref(&member.text));
        drop(acquire);
        flush.settle();
        drop(flush);
        let (_, echoed) = semaphore.releases_for("acquire", 0);
        assert!(echoed.is_empty(), "answered, it is no longer carried");

        // A call dropped unanswered gives its releases back to be sent, and stops echoing them.
        let other = Member::new(2, LEASE);
        semaphore.outbox().releases.push(other.text.clone());
        drop(semaphore.releases_for("used", 0));
        let outbox = semaphore.outbox();
        assert!(outbox.unanswered.is_empty());
        assert_eq!(outbox.releases, [other.text]);
    }

    #[test]
    fn an_adaptive_release_carries_its_hold_and_its_congestion_signal() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _entered = runtime.enter();
        let backend = RedisBackend::builder("redis://127.0.0.1:1")
            .connect_lazy()
            .unwrap();
        let bounds = Some(AdaptiveLimit::new());
        let adaptive = RedisSemaphore::new(
            &backend,
            "a",
            20,
            bounds,
            &Classes::default(),
            Duration::from_secs(1),
        );
        let fixed = unreachable();
        let member: Arc<str> = "m".into();
        let ending = |held_ms, overloaded| Ending {
            held: Some(Duration::from_micros(held_ms)),
            overloaded,
        };
        assert_eq!(&*adaptive.released(&member, ending(1500, false)), "@1500:m");
        assert_eq!(&*adaptive.released(&member, ending(7, true)), "!@7:m");
        assert_eq!(&*adaptive.released(&member, Ending::default()), "m");
        // A fixed limit's process sends no hold time (the script times it, if the limit adapts).
        assert_eq!(&*fixed.released(&member, ending(1500, false)), "m");
        assert_eq!(&*fixed.released(&member, ending(1500, true)), "!m");
    }

    #[tokio::test]
    async fn one_connection_keeps_the_order_so_nothing_is_echoed() {
        let semaphore = unreachable();
        semaphore.release_later(Member::new(1, LEASE), Ending::default());
        let (_flush, _) = semaphore.releases_for("release", 0);
        let (_, echoed) = semaphore.releases_for("acquire", 0);
        assert!(echoed.is_empty());
    }

    #[test]
    fn a_flush_that_could_not_start_does_not_hold_up_later_ones() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let semaphore = runtime.block_on(async { unreachable() });
        let (a, b) = (Member::new(1, LEASE), Member::new(2, LEASE));
        // Outside a runtime, no task can be spawned: the release waits for the next call.
        semaphore.release_later(a.clone(), Ending::default());
        {
            let outbox = semaphore.outbox();
            assert_eq!(outbox.releases, [a.text]);
            assert!(!outbox.flush_pending);
        }
        runtime.block_on(async {
            semaphore.release_later(b, Ending::default());
            assert!(semaphore.outbox().flush_pending);
            settle(|| semaphore.outbox().releases.is_empty()).await;
        });
    }

    #[test]
    fn a_call_takes_the_oldest_acquires_of_one_rate_limiter() {
        let rated = |key: &str| Rated {
            limiter: RateKey {
                backend: 1,
                key: key.into(),
                gcra: Gcra {
                    rate: 10,
                    period_us: 1_000_000,
                    burst: 10,
                },
            },
            cost: 1,
        };
        let queue = |rates: Vec<Option<Rated>>| -> Vec<Queued> {
            (rates.into_iter())
                .map(|rate| Queued {
                    member: Member::new(1, LEASE).text,
                    mode: Mode::Join,
                    rate,
                    until: None,
                    reply: oneshot::channel().0,
                })
                .collect()
        };
        let mut acquires = queue(vec![
            None,
            None,
            Some(rated("x")),
            Some(rated("x")),
            Some(rated("y")),
            None,
        ]);
        let order: Vec<Arc<str>> = acquires.iter().map(|q| q.member.clone()).collect();
        let mut calls = Vec::new();
        while !acquires.is_empty() {
            calls.push(next_call(&mut acquires));
        }
        let sizes: Vec<usize> = calls.iter().map(Vec::len).collect();
        assert_eq!(sizes, [2, 2, 1, 1]);
        let sent: Vec<Arc<str>> = calls.into_iter().flatten().map(|q| q.member).collect();
        assert_eq!(sent, order, "in the order they arrived");

        // However many wait, one call carries at most MAX_MEMBERS.
        let mut acquires = queue((0..MAX_MEMBERS + 1).map(|_| None).collect());
        assert_eq!(next_call(&mut acquires).len(), MAX_MEMBERS);
        assert_eq!(acquires.len(), 1);
    }
}
