//! One semaphore in Redis ([`RedisSemaphore`]): its keys and what this process knows of it
//! (the limit in force, whether anyone waits, the server's clock, when it last told its
//! name), every operation as one call of `lua/semaphore/` (`run`), and the `Store` and
//! `Refresh` impls that tie the parts beside it together: `args.rs` writes the calls,
//! `reply.rs` reads their replies, `outbox.rs` decides which call carries what.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use redis::{Cmd, Value};
use tokio::sync::watch;
use tokio::time::Instant;

use super::args::{self, Head, KEYS};
use super::keys::{hash_tag, slot_tag};
use super::outbox::{self, Calls, Outbox};
use super::protocol::MAX_MEMBERS;
use super::reply::{self, News};
use super::script::{Lua, invoke};
use super::{Connection, RedisBackend};
use crate::backend::gcra::{RateKey, Rated};
use crate::backend::store::{
    Attempt, Ending, Member, Mode, Opened, Samples, Store, process_tag, sealed::Open,
};
use crate::class::Classes;
use crate::snapshot::Snapshot;
use crate::sync::{BoxFuture, lock};
use crate::waitlist::{PATIENCE, Refresh, Status};
use crate::{AdaptiveLimit, Error};

/// Every operation on a semaphore, in one library: `lua/gcra.lua`, then the parts of
/// `lua/semaphore/` in the order each takes names from the ones before it.
static SEMAPHORE: Lua = Lua::library(concat!(
    include_str!("../lua/gcra.lua"),
    include_str!("../lua/semaphore/protocol.lua"),
    include_str!("../lua/semaphore/values.lua"),
    include_str!("../lua/semaphore/args.lua"),
    include_str!("../lua/semaphore/members.lua"),
    include_str!("../lua/semaphore/meta.lua"),
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
    /// How the script is told the limit (`args::limit_arg`).
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

/// When this process last told a semaphore its name (from `RedisSemaphore::base`), the count
/// of lost connections then, and when it last called.
#[derive(Clone, Copy)]
struct Named {
    told: Duration,
    epoch: u64,
    last_call: Duration,
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
        let base = format!("{}{}", backend.prefix, hash_tag(name));
        Arc::new_cyclic(|me| RedisSemaphore {
            me: me.clone(),
            shared: backend.shared.clone(),
            keys: KEYS.map(|key| format!("{base}:{key}")),
            promoted: (backend.shared.promotion_fence)
                .map(|fence| (format!("{}dlimit-promoted", backend.prefix), fence)),
            warned: AtomicBool::new(false),
            in_force: AtomicU32::new(0),
            crowded: watch::Sender::new(false),
            limit,
            limit_arg: args::limit_arg(limit, adaptive, classes),
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
            let reply = self
                .run(op, None, None, None, |script, _| {
                    if let Some(limit) = limit {
                        script.arg(limit);
                    }
                })
                .await?;
            reply::done(&reply)
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
        let (mut carried, echoed) =
            outbox::releases_for(self, op, usize::from(releasing.is_some()));
        let replicas = self
            .shared
            .replicas
            .filter(|_| matches!(op, "acquire" | "touch" | "renew"));
        let until = until.unwrap_or_else(|| Instant::now() + self.shared.call_timeout);
        // Decided once: every attempt of the call carries the same (a first one may be lost).
        let head = Head {
            keys: &self.keys,
            rate_key,
            promoted: self.promoted.as_ref(),
            op,
            channel: &self.channel,
            publisher: self.shared.publisher(),
            limit: &self.limit_arg,
            claim: self.claim,
            caller: self.caller(),
        };
        let result = invoke(
            &SEMAPHORE,
            &self.shared,
            op,
            until,
            replicas,
            |command, repeat| {
                let releases = releasing
                    .into_iter()
                    .chain(carried.members().chain(&echoed).map(|member| &**member));
                let count = carried.len() + echoed.len() + usize::from(releasing.is_some());
                head.write(command, count, releases);
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
        let result = result.map_err(|e| reply::explained(e, &self.keys));
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

    /// What a reply to a call sent at `sent` told of the semaphore, taken in: the limit in
    /// force, the server's clock, whether anyone waits.
    fn heed(&self, news: News, sent: Instant) {
        if let Some(limit) = news.limit {
            self.note_limit(limit);
        }
        if let Some(now_us) = news.now_us {
            self.observe(sent, now_us);
        }
        if let Some(crowded) = news.crowded {
            self.note_crowded(crowded);
        }
    }

    /// The key of this process's waitlist for the semaphore in the hub: grants to its members
    /// are announced on its own channel (see the script).
    fn waitlist_key(&self) -> String {
        format!("{}:{}", self.channel, self.tag)
    }

    /// A release's reply to a call sent at `sent`. This process's waiters check the line by
    /// the time it says: a grant the release made to a frozen process ends there unclaimed.
    fn released_reply(&self, reply: &Value, sent: Instant) -> Result<(), Error> {
        let released = reply::released(reply)?;
        self.note_crowded(released.crowded);
        if let Some(check_in) = released.check_in
            && let Some(list) = self.shared.hub.get(&self.waitlist_key())
        {
            list.check_by(sent + check_in);
        }
        Ok(())
    }

    /// A reply said whether anyone waits.
    fn note_crowded(&self, flag: bool) {
        self.crowded.send_if_modified(|crowded| {
            let was = std::mem::replace(crowded, flag);
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

    /// One acquire call for `members` (see [`Calls::acquire_call`]).
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
                        script.arg(&**member).arg(args::mode_word(mode)).arg(cost);
                    }
                },
            )
            .await?;
        reply::answers(&reply, members.len())?
            .iter()
            .map(|answer| {
                let (news, attempt) = reply::attempt(answer, sent);
                self.heed(news, sent);
                attempt
            })
            .collect()
    }
}

impl Calls for RedisSemaphore {
    fn outbox(&self) -> MutexGuard<'_, Outbox> {
        lock(&self.outbox)
    }

    fn shared(&self) -> &Connection {
        &self.shared
    }

    fn me(&self) -> Option<Arc<Self>> {
        self.me.upgrade()
    }

    async fn release_call(&self) -> Result<(), Error> {
        let sent = Instant::now();
        let reply = self.run("release", None, None, None, |_, _| {}).await?;
        let _ = self.released_reply(&reply, sent);
        Ok(())
    }

    fn acquire_call(
        &self,
        members: &[(&Arc<str>, Mode, Option<&Rated>)],
        until: Option<Instant>,
    ) -> impl Future<Output = Result<Vec<Attempt>, Error>> + Send {
        self.acquire_all(members, until)
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
        Box::pin(outbox::acquire_batched(self, member, mode, until, rate))
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
            let text = args::released(&member.text, ending, self.adaptive);
            let sent = Instant::now();
            let reply = self.run("release", None, Some(&text), None, |_, _| {});
            self.released_reply(&reply.await?, sent)
        })
    }

    fn release_later(&self, member: Member, ending: Ending) {
        outbox::release_later(self, &member.text, || {
            args::released(&member.text, ending, self.adaptive)
        });
    }

    fn sampled(&self, samples: Samples) {
        if self.adaptive {
            outbox::push_samples(self, args::sampled(samples));
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
                let (news, left) = reply::renewed(&reply, batch.len())?;
                self.heed(news, sent);
                renewed.extend(left);
            }
            Ok(renewed)
        })
    }

    fn used(&self) -> BoxFuture<'_, Result<u32, Error>> {
        Box::pin(async move {
            // `{used, the limit in force}`: `available_permits` counts by the latter.
            let sent = Instant::now();
            let reply = self.run("used", None, None, None, |_, _| {}).await?;
            let (news, used) = reply::used(&reply)?;
            self.heed(news, sent);
            Ok(used)
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
            reply::snapshot(&reply)
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
            let reply = self
                .run("evict", None, None, None, |script, _| {
                    script.arg(id);
                })
                .await?;
            reply::evicted(&reply)
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
                let (batch_statuses, retry) = reply::touched(&reply, batch.len())?;
                statuses.extend(batch_statuses);
                // (The soonest any batch asks for.)
                retry_in = retry_in.min(retry);
            }
            Ok((statuses, retry_in))
        })
    }

    fn confirms_grants(&self) -> bool {
        self.shared.replicas.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::redis::outbox::{Carried, acquire_batched, pass_on, releases_for};

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
            async move { acquire_batched(&*semaphore, &member, Mode::Join, None, None).await },
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
        pass_on(&*semaphore, true);
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
        pass_on(&*semaphore, false);
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
        pass_on(&*semaphore, true);
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
        pass_on(&*semaphore, true);
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
            semaphore: &*semaphore,
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
        let (mut flush, echoed) = releases_for(&*semaphore, "release", 0);
        assert_eq!(
            (flush.members.clone(), echoed),
            (vec![member.text.clone()], vec![])
        );
        let (acquire, echoed) = releases_for(&*semaphore, "acquire", 0);
        assert!(acquire.members.is_empty());
        assert_eq!(echoed, std::slice::from_ref(&member.text));
        drop(acquire);
        flush.settle();
        drop(flush);
        let (_, echoed) = releases_for(&*semaphore, "acquire", 0);
        assert!(echoed.is_empty(), "answered, it is no longer carried");

        // A call dropped unanswered gives its releases back to be sent, and stops echoing them.
        let other = Member::new(2, LEASE);
        semaphore.outbox().releases.push(other.text.clone());
        drop(releases_for(&*semaphore, "used", 0));
        let outbox = semaphore.outbox();
        assert!(outbox.unanswered.is_empty());
        assert_eq!(outbox.releases, [other.text]);
    }

    #[tokio::test]
    async fn one_connection_keeps_the_order_so_nothing_is_echoed() {
        let semaphore = unreachable();
        semaphore.release_later(Member::new(1, LEASE), Ending::default());
        let (_flush, _) = releases_for(&*semaphore, "release", 0);
        let (_, echoed) = releases_for(&*semaphore, "acquire", 0);
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
}
