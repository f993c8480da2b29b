//! The waiters of one process on one semaphore: first come, first served, woken by releases.
//!
//! A backend tells a [`Waitlist`] when permits were freed ([`Waitlist::wake`]); the list wakes as
//! many waiters, oldest first, as the freed weight covers. Only the oldest waiter also keeps a
//! timer (the earliest lease deadline, or a back-off in case a notification was lost), so a long
//! queue does not poll. A backend that learns about releases over a subscription (Redis pub/sub)
//! is asked to subscribe while the list has waiters, and to stop once it has been idle a while.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

/// Sends a waitlist that needs a subscription to the backend's subscriber task.
pub(crate) type SubscribeRequests = mpsc::UnboundedSender<Arc<Waitlist>>;

/// Every waitlist of one backend, by the key the backend's notifications carry.
pub(crate) struct Hub {
    lists: Mutex<HashMap<Arc<str>, Weak<Waitlist>>>,
    subscribe: Option<SubscribeRequests>,
}

impl Hub {
    /// `subscribe` is `None` for a backend that notifies in-process and needs no subscription.
    pub(crate) fn new(subscribe: Option<SubscribeRequests>) -> Self {
        Hub {
            lists: Mutex::new(HashMap::new()),
            subscribe,
        }
    }

    /// The waitlist for `key`, shared by every semaphore of that key on this backend.
    pub(crate) fn waitlist(&self, key: &str) -> Arc<Waitlist> {
        let mut lists = lock(&self.lists);
        if let Some(list) = lists.get(key).and_then(Weak::upgrade) {
            return list;
        }
        // Forget lists whose semaphores are all gone, so the map stays as small as the live set.
        lists.retain(|_, list| list.strong_count() > 0);
        let key: Arc<str> = key.into();
        let list = Arc::new(Waitlist {
            key: key.clone(),
            subscribe: self.subscribe.clone(),
            state: Mutex::new(State {
                queue: VecDeque::new(),
                next_id: 0,
                missed: 0,
                subscription: if self.subscribe.is_some() {
                    Subscription::Off
                } else {
                    Subscription::On
                },
                idle_since: Instant::now(),
            }),
        });
        lists.insert(key, Arc::downgrade(&list));
        list
    }

    /// The live waitlist for `key`, if any.
    pub(crate) fn get(&self, key: &str) -> Option<Arc<Waitlist>> {
        lock(&self.lists).get(key).and_then(Weak::upgrade)
    }

    /// Wakes every waiter of every list: notifications may have been lost (a reconnect).
    pub(crate) fn wake_everyone(&self) {
        let lists: Vec<_> = lock(&self.lists)
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for list in lists {
            list.wake_all();
        }
    }
}

/// Locks a mutex whose holders never panic while holding it; a poisoned lock is still usable
/// because every critical section leaves the state consistent.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
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
    state: Mutex<State>,
}

struct State {
    queue: VecDeque<Entry>,
    next_id: u64,
    /// Counts notifications that found nobody left to wake: a waiter whose attempt raced one
    /// of them retries at once instead of sleeping through a free permit.
    missed: u64,
    subscription: Subscription,
    idle_since: Instant,
}

struct Entry {
    id: u64,
    weight: u32,
    notified: bool,
    signal: Arc<Notify>,
}

/// Why [`Ticket::wait`] returned.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Wake {
    /// A release notification chose this waiter.
    Released,
    /// The oldest waiter's timer ran out (a lease may have expired, or a notification was lost).
    Timer,
}

impl State {
    /// Marks waiters notified, oldest first, until `weight` permits are accounted for.
    fn wake(&mut self, weight: u32) {
        let mut left = i64::from(weight);
        for entry in self.queue.iter_mut().filter(|entry| !entry.notified) {
            if left <= 0 {
                return;
            }
            entry.notified = true;
            entry.signal.notify_one();
            left -= i64::from(entry.weight);
        }
        if left > 0 {
            self.missed += 1;
        }
    }

    fn position(&self, id: u64) -> Option<usize> {
        self.queue.iter().position(|entry| entry.id == id)
    }
}

impl Waitlist {
    /// The key this list is registered under (the Redis channel, for the Redis backend).
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// True when nobody in this process waits: a new caller may try straight away.
    pub(crate) fn is_empty(&self) -> bool {
        self.state().queue.is_empty()
    }

    /// A snapshot to take before an attempt, for [`Waitlist::join`] and [`Ticket::rearm`].
    pub(crate) fn missed(&self) -> u64 {
        self.state().missed
    }

    /// `weight` permits were freed.
    pub(crate) fn wake(&self, weight: u32) {
        self.state().wake(weight);
    }

    /// Wakes every waiter once.
    pub(crate) fn wake_all(&self) {
        let mut state = self.state();
        for entry in state.queue.iter_mut() {
            entry.notified = true;
            entry.signal.notify_one();
        }
        state.missed += 1;
    }

    /// The subscriber task finished subscribing (`ok`) or failed to. Either way every waiter
    /// tries again: releases before the subscription were not seen.
    pub(crate) fn subscribed(&self, ok: bool) {
        self.state().subscription = if ok {
            Subscription::On
        } else {
            Subscription::Off
        };
        self.wake_all();
    }

    /// Gives the subscription up if nobody has waited for `linger`. The state turns `Off`
    /// before the backend unsubscribes, so a waiter arriving meanwhile asks for a new one.
    pub(crate) fn release_subscription(&self, linger: Duration) -> bool {
        let mut state = self.state();
        let idle = state.queue.is_empty() && state.idle_since.elapsed() >= linger;
        if idle && state.subscription == Subscription::On {
            state.subscription = Subscription::Off;
            return true;
        }
        false
    }

    fn request_subscription(self: &Arc<Self>, state: &mut State) {
        if state.subscription != Subscription::Off {
            return;
        }
        if let Some(subscribe) = &self.subscribe {
            // A closed channel means the backend is shutting down; the timers still work.
            if subscribe.send(self.clone()).is_ok() {
                state.subscription = Subscription::Pending;
            }
        }
    }

    /// Queues a waiter of `weight` at the back. `seen` is the [`Waitlist::missed`] snapshot
    /// taken before the attempt that found the semaphore full, if there was one: if a release
    /// went unclaimed since, the new waiter starts out notified and tries again at once.
    pub(crate) fn join(self: &Arc<Self>, weight: u32, seen: Option<u64>) -> Ticket {
        let signal = Arc::new(Notify::new());
        let mut state = self.state();
        let id = state.next_id;
        state.next_id += 1;
        let notified = seen.is_some_and(|seen| seen != state.missed);
        state.queue.push_back(Entry {
            id,
            weight,
            notified,
            signal: signal.clone(),
        });
        self.request_subscription(&mut state);
        drop(state);
        Ticket {
            list: self.clone(),
            id,
            signal,
        }
    }
}

/// A place in a [`Waitlist`]. Dropping it leaves the queue and hands an unused notification on.
pub(crate) struct Ticket {
    list: Arc<Waitlist>,
    id: u64,
    signal: Arc<Notify>,
}

impl Ticket {
    /// Waits until a release notifies this waiter, or, while it is the oldest waiter, until
    /// `retry` has passed.
    pub(crate) async fn wait(&self, retry: Duration) -> Wake {
        let timer = Instant::now() + retry;
        loop {
            let head = {
                let state = self.list.state();
                match state.position(self.id) {
                    Some(index) if state.queue[index].notified => return Wake::Released,
                    Some(index) => index == 0,
                    // Not queued cannot happen while the ticket lives; treat it as a wake-up.
                    None => return Wake::Released,
                }
            };
            if head {
                tokio::select! {
                    _ = self.signal.notified() => {}
                    _ = tokio::time::sleep_until(timer) => return Wake::Timer,
                }
            } else {
                self.signal.notified().await;
            }
        }
    }

    /// The attempt after a wake-up found the semaphore full: wait for the next release, unless
    /// one went unclaimed since `seen` (then stay notified and try again at once).
    pub(crate) fn rearm(&self, seen: u64) {
        let mut state = self.list.state();
        let missed = state.missed;
        if let Some(index) = state.position(self.id) {
            state.queue[index].notified = missed != seen;
        }
        // A failed subscription is asked for again by the waiters that still need it.
        self.list.request_subscription(&mut state);
    }

    /// The waiter got its permit. A grant found by the timer means permits freed without a
    /// notification (an expired lease): the next waiter is worth a try as well.
    pub(crate) fn granted(self, how: Wake) {
        self.leave(Some(how));
    }

    /// Leaves the queue, granted (`Some`) or giving up (`None`).
    fn leave(&self, granted: Option<Wake>) {
        let mut state = self.list.state();
        let Some(index) = state.position(self.id) else {
            return;
        };
        let Some(entry) = state.queue.remove(index) else {
            return;
        };
        let wake_next = match granted {
            Some(how) => how == Wake::Timer,
            // A notification this waiter will not use belongs to the next one.
            None => entry.notified,
        };
        if wake_next {
            state.wake(entry.weight);
        }
        match state.queue.front() {
            // The new oldest waiter starts its timer.
            Some(head) if index == 0 => head.signal.notify_one(),
            Some(_) => {}
            None => state.idle_since = Instant::now(),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // After `granted` the entry is gone and this is a no-op.
        self.leave(None);
    }
}
