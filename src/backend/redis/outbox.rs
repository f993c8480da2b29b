//! What one semaphore of this process has not sent yet, and how it goes ([`Outbox`]): releases
//! ride on the next call or a flush task sends them; acquires that arrive while one is in
//! flight go together in the next call (a group commit: `acquire_batched`, `pass_on`); the
//! releases a call carries (`releases_for`, [`Carried`]) go back to be sent again if it is
//! dropped, and are owed when the server cannot be reached (`owe`, sent once it answers). It
//! reaches its semaphore only through [`Calls`], which `semaphore.rs` implements, so the
//! sending order lives here and the calls themselves there.

use std::ops::Deref;
use std::sync::{Arc, MutexGuard};

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::Connection;
use super::args::lease_of;
use super::protocol::{MAX_MEMBERS, MAX_RELEASES};
use crate::Error;
use crate::backend::gcra::{RateKey, Rated};
use crate::backend::owed;
use crate::backend::store::{Attempt, Member, Mode};

/// What this process has not sent yet for the semaphore. Releases ride on the next call, or a
/// flush task sends them. Acquires that arrive while an acquire call is in flight wait for it,
/// then all go in the next call together: a group commit that never waits when nothing is in
/// flight, so one request costs one call however many run at once.
#[derive(Default)]
pub(super) struct Outbox {
    pub(super) releases: Vec<Arc<str>>,
    /// On a cluster, releases sent by a call other than an acquire and not answered yet. Every
    /// acquire call sent meanwhile carries them again (releasing twice is harmless): the
    /// cluster client does not keep the order of calls in flight, and a slot this process gave
    /// back must be free for its own later acquires. (One connection keeps the order.)
    pub(super) unanswered: Vec<Arc<str>>,
    /// A flush task is spawned and has not started yet: later releases wait for it.
    pub(super) flush_pending: bool,
    /// Releases whose call failed because the server could not be reached: every later call
    /// carries them, and a task sends them once the server answers again, until their leases
    /// would have ended anyway (at most `owed::AT_MOST`). Without this, a slot given back during an
    /// outage stays taken for a whole lease after it.
    pub(super) owed: Vec<OwedRelease>,
    /// A task waits for the server to answer again, to send `owed`.
    pub(super) owed_pending: bool,
    /// An acquire call is in flight; whoever sent it passes the queued acquires on when it is
    /// answered (see [`Sending`]).
    pub(super) sending: bool,
    pub(super) acquires: Vec<Queued>,
}

/// A release that could not be sent, kept until `until` (its member's lease from when its call
/// failed: the longest it may still hold).
pub(super) struct OwedRelease {
    pub(super) member: Arc<str>,
    pub(super) until: Instant,
}

/// An acquire waiting for the call in flight.
pub(super) struct Queued {
    pub(super) member: Arc<str>,
    pub(super) mode: Mode,
    pub(super) rate: Option<Rated>,
    pub(super) until: Option<Instant>,
    /// Dropped unanswered (no runtime left to send it): the caller sends it itself.
    pub(super) reply: oneshot::Sender<Result<Attempt, Error>>,
}

/// What the outbox needs of the semaphore it belongs to: the outbox itself, the connection
/// (whether it is a Cluster, up, reconnected), the semaphore as an `Arc` for the tasks it
/// spawns, and the two calls it makes.
pub(super) trait Calls: Sized + Send + Sync + 'static {
    fn outbox(&self) -> MutexGuard<'_, Outbox>;

    fn shared(&self) -> &Connection;

    /// The semaphore, unless it is going away.
    fn me(&self) -> Option<Arc<Self>>;

    /// One `release` call that carries the waiting releases; an error if the call failed (a
    /// reply not understood is no failure: the releases went).
    fn release_call(&self) -> impl Future<Output = Result<(), Error>> + Send;

    /// One acquire call for `members`, each with its mode and the rate it spends if granted at
    /// once (every one the same limiter, or none), answered in order.
    fn acquire_call(
        &self,
        members: &[(&Arc<str>, Mode, Option<&Rated>)],
        until: Option<Instant>,
    ) -> impl Future<Output = Result<Vec<Attempt>, Error>> + Send;
}

/// Gives `member` back, `release` naming it for the script: taken out of the queue if it is
/// still queued behind the call in flight, else carried by the next call. (Never sent, a
/// queued member needs no release; released instead, the release could reach the server
/// first, carried by another call, and the acquire after it: a slot held for a whole lease
/// by nobody.)
pub(super) fn release_later(
    semaphore: &impl Calls,
    member: &Arc<str>,
    release: impl FnOnce() -> Arc<str>,
) {
    let mut outbox = semaphore.outbox();
    let queued = outbox.acquires.len();
    outbox.acquires.retain(|q| q.member != *member);
    if outbox.acquires.len() < queued {
        return;
    }
    push(semaphore, outbox, release());
}

/// Samples to send, as a release with no member: carried by the next call.
pub(super) fn push_samples(semaphore: &impl Calls, text: Arc<str>) {
    push(semaphore, semaphore.outbox(), text);
}

/// Puts `text` with the releases to send; a flush task sends it unless an acquire call in
/// flight passes the releases on when it is answered.
fn push(semaphore: &impl Calls, mut outbox: MutexGuard<'_, Outbox>, text: Arc<str>) {
    outbox.releases.push(text);
    if !outbox.sending {
        drop(outbox);
        schedule_flush(semaphore);
    }
}

/// The releases a call of `op` carries besides `own` of its own: those waiting to be sent
/// (the call owns them), and on a cluster, for an acquire, also those sent by other calls
/// and not answered yet (echoed); at most [`MAX_RELEASES`] in all, the oldest first (the
/// rest wait for the next call, which `pass_on` or `flush` makes).
pub(super) fn releases_for<'a, S: Calls>(
    semaphore: &'a S,
    op: &str,
    own: usize,
) -> (Carried<'a, S>, Vec<Arc<str>>) {
    let echo = semaphore.shared().cluster;
    let mut outbox = semaphore.outbox();
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
        semaphore,
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

/// Sends the waiting releases, a call per [`MAX_RELEASES`], unless another call took them
/// meanwhile or an acquire call in flight will pass them on.
async fn flush(semaphore: &impl Calls) {
    loop {
        {
            let outbox = semaphore.outbox();
            if (outbox.releases.is_empty() && outbox.owed.is_empty()) || outbox.sending {
                return;
            }
        }
        // The call logs a failure; the leases are the fallback.
        if semaphore.release_call().await.is_err() {
            return;
        }
    }
}

/// Makes sure a flush task will send the waiting releases, unless one is already due to.
fn schedule_flush(semaphore: &impl Calls) {
    let spawned = spawn_once(
        semaphore,
        |outbox| &mut outbox.flush_pending,
        |mut pending| async move { flush(pending.start()).await },
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
fn flush_once_answered(semaphore: &impl Calls) {
    // (Subscribed first: a reconnection from here on is seen.)
    let mut ticks = semaphore.shared().reconnects.subscribe();
    spawn_once(
        semaphore,
        |outbox| &mut outbox.owed_pending,
        |mut pending| async move {
            let semaphore = &pending.semaphore;
            let until = semaphore.outbox().owed.iter().map(|owed| owed.until).max();
            if let Some(until) = until
                && !semaphore.shared().health.is_up()
            {
                tokio::select! {
                    _ = ticks.changed() => {}
                    _ = tokio::time::sleep_until(until) => {}
                }
            }
            flush(pending.start()).await;
        },
    );
}

/// Spawns `task` on the current runtime unless the outbox's `flag` says one is pending;
/// the flag goes down when the task starts or is dropped, so a task lost with its runtime
/// never stops a later one. False only when there is no runtime to spawn on (a semaphore
/// going away needs no task, and counts as one pending).
fn spawn_once<S: Calls, F>(
    semaphore: &S,
    flag: fn(&mut Outbox) -> &mut bool,
    task: impl FnOnce(Pending<S>) -> F,
) -> bool
where
    F: Future<Output = ()> + Send + 'static,
{
    let Some(semaphore) = semaphore.me() else {
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
pub(super) async fn acquire_batched<S: Calls>(
    semaphore: &S,
    member: &Member,
    mode: Mode,
    until: Option<Instant>,
    rate: Option<&Rated>,
) -> Result<Attempt, Error> {
    loop {
        let waiting = {
            let mut outbox = semaphore.outbox();
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
                let mut sending = Sending::new(semaphore);
                let attempts = semaphore
                    .acquire_call(&[(&member.text, mode, rate)], until)
                    .await;
                sending.answered = true;
                return attempts?
                    .pop()
                    .ok_or_else(|| Error::backend("the acquire call answered no member", None));
            }
        }
    }
}

/// Sends the acquires queued behind the call that `sending` was for.
async fn send_queued<S: Calls>(mut sending: Sending<Arc<S>>) {
    let queued = next_call(&mut sending.semaphore.outbox().acquires);
    let members: Vec<_> = queued
        .iter()
        .map(|q| (&q.member, q.mode, q.rate.as_ref()))
        .collect();
    let until = queued.iter().map(|q| q.until).max().flatten();
    let attempts = sending.semaphore.acquire_call(&members, until).await;
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
pub(super) fn pass_on<S: Calls>(semaphore: &S, answered: bool) {
    let mut outbox = semaphore.outbox();
    // A caller that gave up needs no answer (its claim releases the member if it was sent).
    outbox.acquires.retain(|queued| !queued.reply.is_closed());
    let next = if outbox.acquires.is_empty() || !answered {
        None
    } else {
        semaphore
            .me()
            .zip(tokio::runtime::Handle::try_current().ok())
    };
    match next {
        Some((me, runtime)) => {
            // Not under the lock: a runtime shutting down drops the task at once, and its
            // drop (`Sending`) takes the lock.
            drop(outbox);
            runtime.spawn(send_queued(Sending::new(me)));
        }
        None => {
            outbox.sending = false;
            outbox.acquires.clear();
            let releases = !outbox.releases.is_empty() || !outbox.owed.is_empty();
            drop(outbox);
            if releases {
                schedule_flush(semaphore);
            }
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

/// A task spawned by [`spawn_once`]: lowers its flag when it starts its work, or when dropped
/// before that.
struct Pending<S: Calls> {
    semaphore: Arc<S>,
    flag: fn(&mut Outbox) -> &mut bool,
    started: bool,
}

impl<S: Calls> Pending<S> {
    /// The task starts its work: a later one may be spawned from now on.
    fn start(&mut self) -> &S {
        self.started = true;
        *(self.flag)(&mut self.semaphore.outbox()) = false;
        &self.semaphore
    }
}

impl<S: Calls> Drop for Pending<S> {
    fn drop(&mut self) {
        if !self.started {
            *(self.flag)(&mut self.semaphore.outbox()) = false;
        }
    }
}

/// Held by whoever sends the acquire call in flight (the outbox's `sending`); dropped, it
/// passes the outbox on (see [`pass_on`]).
struct Sending<D: Deref<Target: Calls>> {
    semaphore: D,
    /// The call was answered (not cancelled, not dropped unstarted).
    answered: bool,
}

impl<D: Deref<Target: Calls>> Sending<D> {
    fn new(semaphore: D) -> Self {
        Sending {
            semaphore,
            answered: false,
        }
    }
}

impl<D: Deref<Target: Calls>> Drop for Sending<D> {
    fn drop(&mut self) {
        pass_on(&*self.semaphore, self.answered);
    }
}

/// Releases carried by a call. If the call is cancelled before it is answered they go back to
/// be sent again (releasing twice is harmless). If it fails because the server cannot be
/// reached they are owed (see `Outbox::owed`): sent with later calls and once the server
/// answers again, never retried on their own while it is down; any other failure drops them
/// with a warning.
pub(super) struct Carried<'a, S: Calls> {
    pub(super) semaphore: &'a S,
    pub(super) members: Vec<Arc<str>>,
    /// OwedRelease by earlier calls that failed.
    pub(super) owed: Vec<OwedRelease>,
    /// The members are in the outbox's `unanswered` until this call is answered or dropped.
    pub(super) unanswered: bool,
    pub(super) settled: bool,
}

impl<S: Calls> Carried<'_, S> {
    pub(super) fn len(&self) -> usize {
        self.members.len() + self.owed.len()
    }

    pub(super) fn members(&self) -> impl Iterator<Item = &Arc<str>> {
        self.members
            .iter()
            .chain(self.owed.iter().map(|owed| &owed.member))
    }

    /// The call was answered (or failed): its members leave `unanswered`.
    pub(super) fn settle(&mut self) {
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
    pub(super) fn owe(&mut self) {
        let now = Instant::now();
        let mut outbox = self.semaphore.outbox();
        let owed = &mut outbox.owed;
        owed.retain(|owed| owed.until > now);
        owed.extend(self.owed.drain(..).filter(|owed| owed.until > now));
        owed.extend(self.members.drain(..).filter_map(|member| {
            let lease = lease_of(&member)?;
            Some(OwedRelease {
                member,
                until: now + lease,
            })
        }));
        owed::bound(owed);
        drop(outbox);
        flush_once_answered(self.semaphore);
    }
}

impl<S: Calls> Drop for Carried<'_, S> {
    fn drop(&mut self) {
        if self.settled || self.len() == 0 {
            return;
        }
        self.forget();
        let mut outbox = self.semaphore.outbox();
        outbox.releases.append(&mut self.members);
        outbox.owed.append(&mut self.owed);
        drop(outbox);
        schedule_flush(self.semaphore);
    }
}

/// The first `n` of `list` (all when it holds fewer), taken out of it in order.
fn take_front<T>(list: &mut Vec<T>, n: usize) -> Vec<T> {
    if list.len() <= n {
        std::mem::take(list)
    } else {
        list.drain(..n).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gcra::Gcra;
    use std::time::Duration;

    const LEASE: Duration = Duration::from_secs(30);

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
