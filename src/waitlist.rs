//! Waiting in line: this process's waiters on each semaphore, the grants announced to them,
//! and the refresh of the line.
//!
//! The line itself lives in the backend (first come, first served across every process). A
//! waiter registers a [`Ticket`] before its first call, so no announcement can beat it; when
//! the backend admits it, the backend hands the grant to [`Waitlist::grant`] and the waiting
//! task wakes: no extra round trip, no polling. The oldest local waiter has one more duty:
//! every [`KEEPALIVE`], or when a lease is due to end (the earliest end any call of this process
//! was told of: [`Waitlist::check_by`]), it refreshes all local waiters in one
//! [`Refresh::touch`] and collects grants whose announcement was lost. A backend that announces
//! over a subscription (Redis pub/sub) is asked to subscribe while the list has queued waiters,
//! and to stop once it has been idle a while. A backend found down tells its hub
//! ([`Hub::down`]): every queued waiter leaves the line at once with the backend's error, so
//! the outage policy decides them all together rather than one per refresh.
//!
//! This module knows no backend: backends implement [`Refresh`] and hand grants in.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use crate::Error;
use crate::sync::{BoxFuture, lock};

/// How long a queued waiter stays in line without showing it still waits. A process's oldest
/// waiter refreshes all of them every [`KEEPALIVE`]; a crashed process's waiters drop out of
/// the line after this long.
pub(crate) const PATIENCE: Duration = Duration::from_secs(3);
pub(crate) const KEEPALIVE: Duration = Duration::from_secs(1);

/// A reading of the backend's clock: `server_us` (µs) was read no earlier than `local` by
/// this process's clock. It turns a deadline on the backend's clock into a local instant that
/// is never later than the backend's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClockReading {
    pub(crate) local: Instant,
    pub(crate) server_us: u64,
}

impl ClockReading {
    /// The local instant at which the backend's clock has surely not yet passed `server_us`:
    /// the backend read `self.server_us` at or after `self.local`, so it reaches `server_us`
    /// at or after `self.local + (server_us - self.server_us)`.
    fn local_time_of(&self, server_us: u64) -> Instant {
        match server_us.checked_sub(self.server_us) {
            Some(ahead) => self.local + Duration::from_micros(ahead),
            None => self
                .local
                .checked_sub(Duration::from_micros(self.server_us - server_us))
                .unwrap_or(self.local),
        }
    }
}

/// When a grant's lease ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Until {
    /// On the backend's clock (µs), as an announcement says; the waiter converts it with the
    /// [`ClockReading`] of its own call.
    Server(u64),
    /// Already converted to this process's clock.
    Local(Instant),
}

/// A queued member's state, as [`Refresh::touch`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// It holds (and is now claimed for a full lease): `remaining` counts from the backend's
    /// clock read at or after the touch was sent.
    Granted {
        token: u64,
        remaining: Duration,
    },
    Queued,
    /// Neither holding nor waiting: it was dropped from the line (it stopped answering).
    Unknown,
}

/// The one call waiting needs from a backend: keep `members` in line, claim those that were
/// granted, and say each one's state, plus when the earliest lease ends. A backend that is
/// loading or busy is asked again until `until`.
pub(crate) trait Refresh: Send + Sync {
    fn touch<'a>(
        &'a self,
        members: &'a [Arc<str>],
        until: Instant,
    ) -> BoxFuture<'a, Result<(Vec<Status>, Duration), Error>>;

    /// An announced grant counts only once a touch has confirmed it (the backend waits for
    /// replicas to acknowledge grants).
    fn confirms_grants(&self) -> bool {
        false
    }
}

/// How a wait in line ended.
#[derive(Debug)]
pub(crate) enum Wake {
    /// Admitted; the lease ends at `until` by this process's clock (perhaps already).
    Granted { token: u64, until: Instant },
    /// The backend dropped this waiter from its line: ask again.
    Forgotten,
    /// The deadline passed first.
    TimedOut,
}

/// Sends a waitlist that needs a subscription to the backend's subscriber task.
pub(crate) type SubscribeRequests = mpsc::UnboundedSender<Arc<Waitlist>>;

/// Every waitlist of one backend, by the key its announcements carry.
pub(crate) struct Hub {
    lists: Mutex<Lists>,
    subscribe: Option<SubscribeRequests>,
    outage: Outage,
}

/// Why the backend is down, while it is: shared by a hub and its lists, so a waiter whose
/// first call queued it just as the backend was found down leaves too.
type Outage = Arc<Mutex<Option<Arc<str>>>>;

#[derive(Default)]
struct Lists {
    by_key: HashMap<Arc<str>, Weak<Waitlist>>,
    /// Dead entries are swept when the map reaches this size, which then becomes twice the live
    /// count: amortised O(1) per new key, and never more than twice the live lists.
    sweep_at: usize,
}

impl Hub {
    /// `subscribe` is `None` for a backend that announces in-process and needs no subscription.
    pub(crate) fn new(subscribe: Option<SubscribeRequests>) -> Self {
        Hub {
            lists: Mutex::default(),
            subscribe,
            outage: Outage::default(),
        }
    }

    /// The waitlist for `key`, shared by every semaphore of that key on this backend.
    pub(crate) fn waitlist(&self, key: &str) -> Arc<Waitlist> {
        let mut lists = lock(&self.lists);
        if let Some(list) = lists.by_key.get(key).and_then(Weak::upgrade) {
            return list;
        }
        if lists.by_key.len() >= lists.sweep_at {
            // Forget lists whose semaphores are all gone.
            lists.by_key.retain(|_, list| list.strong_count() > 0);
            lists.sweep_at = (lists.by_key.len() * 2).max(64);
        }
        let key: Arc<str> = key.into();
        let list = Arc::new(Waitlist {
            key: key.clone(),
            subscribe: self.subscribe.clone(),
            outage: self.outage.clone(),
            state: Mutex::new(Line {
                entries: BTreeMap::new(),
                by_member: HashMap::new(),
                next: 0,
                subscription: if self.subscribe.is_some() {
                    Subscription::Off
                } else {
                    Subscription::On
                },
                touch_now: false,
                touch_at: None,
                idle_since: Instant::now(),
            }),
        });
        lists.by_key.insert(key, Arc::downgrade(&list));
        list
    }

    /// The live waitlist for `key`, if any.
    pub(crate) fn get(&self, key: &str) -> Option<Arc<Waitlist>> {
        lock(&self.lists).by_key.get(key).and_then(Weak::upgrade)
    }

    /// Announcements may have been lost (a reconnect): every list checks its waiters.
    pub(crate) fn touch_everyone(&self) {
        for list in self.lists() {
            list.touch_soon();
        }
    }

    /// The backend was found down (`why`: the error its waiters get): every queued waiter
    /// leaves the line now, and so does any that queues until [`Hub::up`]. A grant already
    /// announced to one still counts.
    pub(crate) fn down(&self, why: String) {
        *lock(&self.outage) = Some(why.into());
        for list in self.lists() {
            let mut state = list.state();
            let queued: Vec<Arc<str>> = (state.entries.values())
                .filter(|entry| entry.queued)
                .map(|entry| entry.member.clone())
                .collect();
            for member in queued {
                state.tell(&member, Event::Down);
            }
        }
    }

    /// The backend answers again: waiters stay in line.
    pub(crate) fn up(&self) {
        *lock(&self.outage) = None;
    }

    fn lists(&self) -> Vec<Arc<Waitlist>> {
        (lock(&self.lists).by_key.values())
            .filter_map(Weak::upgrade)
            .collect()
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Subscription {
    Off,
    Pending,
    On,
}

/// The local waiters of one semaphore.
pub struct Waitlist {
    key: Arc<str>,
    subscribe: Option<SubscribeRequests>,
    outage: Outage,
    state: Mutex<Line>,
}

/// The local waiters of one semaphore, in order, and the subscription they need.
struct Line {
    /// By registration order; only `queued` entries wait in the backend's line.
    entries: BTreeMap<u64, Entry>,
    /// Where each member sits in `entries`: a grant finds its waiter without a scan.
    by_member: HashMap<Arc<str>, u64>,
    next: u64,
    subscription: Subscription,
    /// The oldest queued waiter should refresh the line at once (announcements may be lost).
    touch_now: bool,
    /// When the oldest queued waiter refreshes the line next: the earliest lease end any call
    /// was told of since the last refresh, at most a [`KEEPALIVE`] after it.
    touch_at: Option<Instant>,
    idle_since: Instant,
}

struct Entry {
    member: Arc<str>,
    queued: bool,
    event: Option<Event>,
    signal: Arc<Notify>,
}

/// What a waiting task is told.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Event {
    /// The backend admitted this waiter, until its lease ends.
    Granted { token: u64, until: Until },
    /// The backend no longer knows this waiter (it stopped answering in time): ask again.
    Retry,
    /// This waiter is the oldest and should refresh the line.
    Touch,
    /// The backend was found down: leave the line, for the outage policy to decide.
    Down,
}

impl Line {
    fn entry(&mut self, member: &str) -> Option<&mut Entry> {
        let seq = self.by_member.get(member)?;
        self.entries.get_mut(seq)
    }

    /// The oldest queued waiter keeps the timer and refreshes the line. Entries ahead of it
    /// are only those whose first call is still in flight, so this stops early.
    fn duty(&self) -> Option<u64> {
        self.entries
            .iter()
            .find(|(_, entry)| entry.queued)
            .map(|(seq, _)| *seq)
    }

    fn notify_duty(&self) {
        if let Some(entry) = self.duty().and_then(|seq| self.entries.get(&seq)) {
            entry.signal.notify_one();
        }
    }

    /// Gives `member` an event unless it already has a grant waiting.
    fn tell(&mut self, member: &str, event: Event) {
        if let Some(entry) = self.entry(member)
            && !matches!(entry.event, Some(Event::Granted { .. }))
        {
            entry.event = Some(event);
            entry.signal.notify_one();
        }
    }
}

impl Waitlist {
    /// The key this list is registered under (the Redis channel, for the Redis backend).
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    fn state(&self) -> MutexGuard<'_, Line> {
        lock(&self.state)
    }

    /// Registers `member` before its first attempt, so a grant announced right after the
    /// attempt queued it cannot arrive before anyone listens. Refused (with the number waiting)
    /// when `max` callers are already registered.
    pub(crate) fn register(
        self: &Arc<Self>,
        member: Arc<str>,
        max: usize,
    ) -> Result<Ticket, usize> {
        let signal = Arc::new(Notify::new());
        let mut state = self.state();
        if state.entries.len() >= max {
            return Err(state.entries.len());
        }
        let seq = state.next;
        state.next += 1;
        state.by_member.insert(member.clone(), seq);
        state.entries.insert(
            seq,
            Entry {
                member: member.clone(),
                queued: false,
                event: None,
                signal: signal.clone(),
            },
        );
        drop(state);
        Ok(Ticket {
            list: self.clone(),
            seq,
            member,
            signal,
        })
    }

    /// The backend admitted `member` (ignored unless it waits here).
    pub(crate) fn grant(&self, member: &str, token: u64, until: Until) {
        self.state().tell(member, Event::Granted { token, until });
    }

    /// A call learned that a lease ends (and someone may be admitted) at `at`: the oldest
    /// waiter refreshes the line then, unless it was to sooner. Whichever call of this process
    /// learns it, the waiter holding the timer acts on it (a grant left unclaimed by a frozen
    /// process ends while every live process waits for an announcement).
    pub(crate) fn check_by(&self, at: Instant) {
        let mut state = self.state();
        if state.touch_at.is_none_or(|due| at < due) {
            state.touch_at = Some(at);
            state.notify_duty();
        }
    }

    /// Asks the oldest waiter to refresh the line now.
    pub(crate) fn touch_soon(&self) {
        let mut state = self.state();
        state.touch_now = true;
        state.notify_duty();
    }

    /// The subscriber task subscribed (`ok`) or failed to. Grants announced before the
    /// subscription were not heard, so the line is checked either way.
    pub(crate) fn subscribed(&self, ok: bool) {
        self.state().subscription = if ok {
            Subscription::On
        } else {
            Subscription::Off
        };
        self.touch_soon();
    }

    /// Gives the subscription up if nobody has waited for `linger`. The state turns `Off`
    /// before the backend unsubscribes, so a waiter arriving meanwhile asks for a new one.
    pub(crate) fn release_subscription(&self, linger: Duration) -> bool {
        let mut state = self.state();
        let idle = state.duty().is_none() && state.idle_since.elapsed() >= linger;
        if idle && state.subscription == Subscription::On {
            state.subscription = Subscription::Off;
            return true;
        }
        false
    }

    /// What a waiter that leaves the line for an outage ([`Hub::down`]) is told.
    fn outage_error(&self) -> Error {
        let why = lock(&self.outage).clone();
        Error::backend(
            why.as_deref()
                .unwrap_or("the backend was found down while this caller waited in line"),
            None,
        )
    }

    /// The members waiting in the backend's line, for one refresh.
    fn queued_members(&self) -> Vec<Arc<str>> {
        self.state()
            .entries
            .values()
            .filter(|entry| entry.queued)
            .map(|entry| entry.member.clone())
            .collect()
    }

    /// Applies what a refresh sent at `sent` found: grants to deliver, forgotten waiters to
    /// retry.
    fn apply(&self, members: &[Arc<str>], statuses: &[Status], sent: Instant) {
        let mut state = self.state();
        for (member, status) in members.iter().zip(statuses) {
            match *status {
                Status::Granted { token, remaining } => {
                    let until = Until::Local(sent + remaining);
                    state.tell(member, Event::Granted { token, until })
                }
                Status::Unknown => state.tell(member, Event::Retry),
                Status::Queued => {}
            }
        }
    }

    fn request_subscription(self: &Arc<Self>, state: &mut Line) {
        if state.subscription != Subscription::Off {
            return;
        }
        if let Some(subscribe) = &self.subscribe {
            // A closed channel means the backend is shutting down; the refresh timer still works.
            if subscribe.send(self.clone()).is_ok() {
                state.subscription = Subscription::Pending;
            }
        }
    }
}

/// A registered waiter. Dropping it leaves the local list (the caller releases the member in
/// the backend).
pub(crate) struct Ticket {
    list: Arc<Waitlist>,
    seq: u64,
    member: Arc<str>,
    signal: Arc<Notify>,
}

impl Ticket {
    /// Waits in line after the call that queued this waiter answered, with that call's clock
    /// reading and the time until the earliest lease ends (`refresh`). While this is the
    /// oldest queued waiter it also refreshes the whole line through `line`.
    pub(crate) async fn wait_in_line(
        &self,
        line: &dyn Refresh,
        clock: ClockReading,
        refresh: Duration,
        deadline: Instant,
    ) -> Result<Wake, Error> {
        self.list.check_by(clock.local + refresh.min(KEEPALIVE));
        self.queued();
        loop {
            let event = tokio::time::timeout_at(deadline, self.next());
            let Ok(event) = event.await else {
                return Ok(Wake::TimedOut);
            };
            match event {
                Event::Granted { token, until } => {
                    let until = match until {
                        Until::Server(_) if line.confirms_grants() => {
                            return self.confirm(line, deadline).await;
                        }
                        Until::Server(us) => clock.local_time_of(us),
                        Until::Local(until) => until,
                    };
                    return Ok(Wake::Granted { token, until });
                }
                Event::Retry => return Ok(Wake::Forgotten),
                Event::Down => return Err(self.list.outage_error()),
                Event::Touch => {
                    let members = self.list.queued_members();
                    let sent = Instant::now();
                    let touch = tokio::time::timeout_at(deadline, line.touch(&members, deadline));
                    let Ok(touched) = touch.await else {
                        return Ok(Wake::TimedOut);
                    };
                    let (statuses, retry_in) = touched?;
                    self.list.apply(&members, &statuses, sent);
                    self.list.check_by(sent + retry_in.min(KEEPALIVE));
                }
            }
        }
    }

    /// Claims an announced grant with a touch of its own, which the backend confirms (e.g.
    /// replicas acknowledged it) before it counts.
    async fn confirm(&self, line: &dyn Refresh, deadline: Instant) -> Result<Wake, Error> {
        let member = std::slice::from_ref(&self.member);
        let sent = Instant::now();
        let Ok(touched) = tokio::time::timeout_at(deadline, line.touch(member, deadline)).await
        else {
            return Ok(Wake::TimedOut);
        };
        Ok(match touched?.0.first() {
            Some(&Status::Granted { token, remaining }) => Wake::Granted {
                token,
                until: sent + remaining,
            },
            _ => Wake::Forgotten,
        })
    }

    /// The attempt queued this waiter in the backend: listen for its grant (or leave at once
    /// when the backend was found down meanwhile).
    fn queued(&self) {
        let down = lock(&self.list.outage).is_some();
        let mut state = self.list.state();
        if let Some(entry) = state.entries.get_mut(&self.seq) {
            entry.queued = true;
        }
        if down {
            state.tell(&self.member, Event::Down);
        }
        self.list.request_subscription(&mut state);
    }

    /// Waits for this waiter's next event. While it is the oldest queued waiter it also gets
    /// [`Event::Touch`] when the line's refresh is due, or at once when it needs checking.
    async fn next(&self) -> Event {
        loop {
            let timer = {
                let mut state = self.list.state();
                let Some(entry) = state.entries.get_mut(&self.seq) else {
                    // Not registered cannot happen while the ticket lives; asking again is safe.
                    return Event::Retry;
                };
                if let Some(event) = entry.event.take() {
                    return event;
                }
                if state.duty() != Some(self.seq) {
                    None
                } else if state.touch_now || state.touch_at.is_some_and(|at| at <= Instant::now()) {
                    // The refresh's answer sets the next time.
                    state.touch_now = false;
                    state.touch_at = None;
                    return Event::Touch;
                } else {
                    Some(
                        *state
                            .touch_at
                            .get_or_insert_with(|| Instant::now() + KEEPALIVE),
                    )
                }
            };
            match timer {
                Some(timer) => tokio::select! {
                    _ = self.signal.notified() => {}
                    _ = tokio::time::sleep_until(timer) => {}
                },
                None => self.signal.notified().await,
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.list.state();
        let was_duty = state.duty() == Some(self.seq);
        if state.entries.remove(&self.seq).is_none() {
            return;
        }
        state.by_member.remove(&self.member);
        if was_duty {
            // The next oldest waiter takes over the timer.
            state.notify_duty();
        }
        if state.duty().is_none() {
            // Nobody waits: the next waiter's own call says when to refresh.
            state.idle_since = Instant::now();
            state.touch_at = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend's line as a refresh sees it: each member's state (queued unless set), and
    /// every touch it was sent.
    #[derive(Default)]
    struct Backend {
        states: Mutex<HashMap<Arc<str>, Status>>,
        touches: Mutex<Vec<Vec<Arc<str>>>>,
        confirms: bool,
    }

    impl Backend {
        fn set(&self, member: &Arc<str>, status: Status) {
            lock(&self.states).insert(member.clone(), status);
        }

        fn touches(&self) -> Vec<Vec<Arc<str>>> {
            lock(&self.touches).clone()
        }
    }

    impl Refresh for Backend {
        fn touch<'a>(
            &'a self,
            members: &'a [Arc<str>],
            _until: Instant,
        ) -> BoxFuture<'a, Result<(Vec<Status>, Duration), Error>> {
            lock(&self.touches).push(members.to_vec());
            let states = lock(&self.states);
            let statuses = (members.iter())
                .map(|m| states.get(m).copied().unwrap_or(Status::Queued))
                .collect();
            Box::pin(std::future::ready(Ok((statuses, Duration::from_secs(60)))))
        }

        fn confirms_grants(&self) -> bool {
            self.confirms
        }
    }

    const FAR: Duration = Duration::from_secs(3600);

    fn reading() -> ClockReading {
        ClockReading {
            local: Instant::now(),
            server_us: 1_000_000,
        }
    }

    /// `member` registered on `list` and waiting in line on `backend`, as a task.
    fn wait(
        list: &Arc<Waitlist>,
        backend: &Arc<Backend>,
        member: &Arc<str>,
        deadline: Instant,
    ) -> tokio::task::JoinHandle<Result<Wake, Error>> {
        let ticket = list.register(member.clone(), 10).expect("room");
        let backend = backend.clone();
        tokio::spawn(async move {
            ticket
                .wait_in_line(&*backend, reading(), FAR, deadline)
                .await
        })
    }

    /// Lets the spawned tasks run (paused time does not move while they are busy).
    async fn run_tasks() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    fn member(name: &str) -> Arc<str> {
        name.into()
    }

    /// Waiters `a` then `b` in a fresh line, nothing due (the hub keeps the line).
    async fn two_in_line() -> (
        Hub,
        Arc<Backend>,
        Arc<Waitlist>,
        [Arc<str>; 2],
        [tokio::task::JoinHandle<Result<Wake, Error>>; 2],
    ) {
        let (hub, backend) = (Hub::new(None), Arc::new(Backend::default()));
        let list = hub.waitlist("sem");
        let (a, b) = (member("a"), member("b"));
        let first = wait(&list, &backend, &a, Instant::now() + FAR);
        let second = wait(&list, &backend, &b, Instant::now() + FAR);
        run_tasks().await;
        (hub, backend, list, [a, b], [first, second])
    }

    #[tokio::test(start_paused = true)]
    async fn an_announced_grant_wakes_its_waiter_with_no_call() {
        let (hub, backend) = (Hub::new(None), Arc::new(Backend::default()));
        let list = hub.waitlist("sem");
        let a = member("a");
        let clock = reading();
        let waiter = wait(&list, &backend, &a, Instant::now() + FAR);
        run_tasks().await;
        list.grant(&a, 7, Until::Server(clock.server_us + 2_000_000));
        let Ok(Wake::Granted { token, until }) = waiter.await.unwrap() else {
            panic!("granted")
        };
        assert_eq!(token, 7);
        // The lease ends 2 s after the server's reading, so no later than 2 s after it locally.
        assert_eq!(until, clock.local + Duration::from_secs(2));
        assert!(backend.touches().is_empty(), "no refresh was needed");
    }

    #[tokio::test(start_paused = true)]
    async fn the_oldest_waiter_alone_refreshes_the_line_every_keepalive() {
        let (_hub, backend, _list, [a, b], [first, second]) = two_in_line().await;
        tokio::time::sleep(KEEPALIVE * 3 + KEEPALIVE / 2).await;
        // One touch per keepalive, each for the whole line.
        assert_eq!(backend.touches(), vec![vec![a.clone(), b.clone()]; 3]);

        // The oldest leaves: the next one takes over the timer, for the line left.
        first.abort();
        run_tasks().await;
        tokio::time::sleep(KEEPALIVE).await;
        assert_eq!(backend.touches().last(), Some(&vec![b.clone()]));
        assert_eq!(backend.touches().len(), 4);
        second.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_end_any_call_learns_of_moves_the_refresh() {
        let (_hub, backend, list, [a, b], [first, second]) = two_in_line().await;
        // Another call of this process (a release) learns that a lease ends in 200 ms: the
        // oldest waiter refreshes the line then, not a keepalive after it queued.
        list.check_by(Instant::now() + Duration::from_millis(200));
        // A later end changes nothing.
        list.check_by(Instant::now() + Duration::from_millis(500));
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(backend.touches(), vec![vec![a.clone(), b.clone()]]);
        // The refresh's answer (60 s) sets the next one, at most a keepalive later.
        tokio::time::sleep(KEEPALIVE).await;
        assert_eq!(backend.touches().len(), 2);
        first.abort();
        second.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_refresh_delivers_grants_whose_announcement_was_lost() {
        let (hub, backend) = (Hub::new(None), Arc::new(Backend::default()));
        let list = hub.waitlist("sem");
        let (a, b, c) = (member("a"), member("b"), member("c"));
        let first = wait(&list, &backend, &a, Instant::now() + FAR);
        let second = wait(&list, &backend, &b, Instant::now() + FAR);
        let third = wait(&list, &backend, &c, Instant::now() + FAR);
        run_tasks().await;
        let remaining = Duration::from_secs(2);
        backend.set(
            &b,
            Status::Granted {
                token: 3,
                remaining,
            },
        );
        backend.set(&c, Status::Unknown);
        // Announcements may have been lost (a reconnect): the line is checked at once.
        let before = Instant::now();
        list.touch_soon();
        let Ok(Wake::Granted { token: 3, until }) = second.await.unwrap() else {
            panic!("granted by the refresh")
        };
        assert_eq!(until, before + remaining);
        // A waiter the backend forgot is told to ask again; the rest keep waiting.
        assert!(matches!(third.await.unwrap(), Ok(Wake::Forgotten)));
        assert_eq!(backend.touches().len(), 1);
        assert!(!first.is_finished());
        first.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_ends_a_wait_with_no_call() {
        let (hub, backend) = (Hub::new(None), Arc::new(Backend::default()));
        let list = hub.waitlist("sem");
        let start = Instant::now();
        let waiter = wait(&list, &backend, &member("a"), start + KEEPALIVE / 2);
        assert!(matches!(waiter.await.unwrap(), Ok(Wake::TimedOut)));
        assert_eq!(Instant::now(), start + KEEPALIVE / 2);
        assert!(backend.touches().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_that_needs_confirming_counts_once_a_touch_confirms_it() {
        let hub = Hub::new(None);
        let backend = Arc::new(Backend {
            confirms: true,
            ..Backend::default()
        });
        let list = hub.waitlist("sem");
        let (a, b) = (member("a"), member("b"));
        let first = wait(&list, &backend, &a, Instant::now() + FAR);
        let second = wait(&list, &backend, &b, Instant::now() + FAR);
        run_tasks().await;
        let remaining = Duration::from_secs(1);
        backend.set(
            &a,
            Status::Granted {
                token: 9,
                remaining,
            },
        );
        list.grant(&a, 9, Until::Server(0));
        list.grant(&b, 10, Until::Server(0));
        assert!(matches!(
            first.await.unwrap(),
            Ok(Wake::Granted { token: 9, .. })
        ));
        // The backend does not confirm b's announcement (its replicas never acknowledged it).
        assert!(matches!(second.await.unwrap(), Ok(Wake::Forgotten)));
        assert_eq!(backend.touches(), [vec![a], vec![b]]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_backend_found_down_sends_every_queued_waiter_away_at_once() {
        let (hub, backend, list, [a, _], [first, second]) = two_in_line().await;
        // A grant announced before the outage still counts.
        list.grant(&a, 4, Until::Local(Instant::now() + FAR));
        hub.down("Redis went down".into());
        assert!(matches!(
            first.await.unwrap(),
            Ok(Wake::Granted { token: 4, .. })
        ));
        let Err(e) = second.await.unwrap() else {
            panic!("the waiter left the line")
        };
        assert_eq!(e.to_string(), "Redis went down");
        // A waiter whose first call queued it just as the backend was found down leaves too.
        let late = wait(&list, &backend, &member("c"), Instant::now() + FAR);
        assert!(late.await.unwrap().is_err());
        assert!(list.state().entries.is_empty(), "every ticket left");
        // Back up: waiters stay in line again.
        hub.up();
        let after = wait(&list, &backend, &member("d"), Instant::now() + FAR);
        run_tasks().await;
        assert!(!after.is_finished());
        assert!(backend.touches().is_empty(), "no call was needed");
        after.abort();
    }

    #[tokio::test]
    async fn the_line_refuses_beyond_its_bound_and_frees_a_place_on_drop() {
        let list = Hub::new(None).waitlist("sem");
        let first = list.register(member("a"), 2).unwrap();
        let _second = list.register(member("b"), 2).unwrap();
        assert_eq!(list.register(member("c"), 2).err(), Some(2));
        drop(first);
        assert!(list.register(member("c"), 2).is_ok());
    }

    #[tokio::test]
    async fn a_subscription_is_asked_for_once_and_given_up_when_idle() {
        let (requests, mut asked) = mpsc::unbounded_channel();
        let hub = Hub::new(Some(requests));
        let list = hub.waitlist("sem");
        let backend = Arc::new(Backend::default());
        let (a, b) = (member("a"), member("b"));
        let first = wait(&list, &backend, &a, Instant::now() + FAR);
        let second = wait(&list, &backend, &b, Instant::now() + FAR);
        let subscribing = asked.recv().await.unwrap();
        assert_eq!(subscribing.key(), "sem");
        run_tasks().await;
        assert!(asked.try_recv().is_err(), "one request for the line");
        list.subscribed(true);
        assert!(!list.release_subscription(Duration::ZERO), "waiters remain");
        first.abort();
        second.abort();
        let _ = (first.await, second.await);
        assert!(list.release_subscription(Duration::ZERO));
        assert!(!list.release_subscription(Duration::ZERO), "already off");
    }

    #[tokio::test]
    async fn the_hub_forgets_lists_nobody_holds() {
        let hub = Hub::new(None);
        let kept = hub.waitlist("kept");
        for i in 0..10_000 {
            drop(hub.waitlist(&format!("gone-{i}")));
        }
        let lists = lock(&hub.lists).by_key.len();
        assert!(lists <= 128, "{lists} lists kept for 1 live one");
        assert!(Arc::ptr_eq(&hub.get("kept").unwrap(), &kept));
        assert!(hub.get("gone-0").is_none());
    }

    #[test]
    fn a_server_deadline_is_never_placed_later_than_the_server_reaches_it() {
        let local = Instant::now();
        let clock = ClockReading {
            local,
            server_us: 5_000_000,
        };
        assert_eq!(
            clock.local_time_of(6_000_000),
            local + Duration::from_secs(1)
        );
        assert_eq!(clock.local_time_of(5_000_000), local);
        // Already past by the server's clock: at or before the reading.
        assert!(clock.local_time_of(4_000_000) <= local);
        assert!(clock.local_time_of(0) <= local);
    }
}
