//! The spares every service of one layer shares, for
//! [`acquire_in_poll_ready`](super::DistributedConcurrencyLimitLayer::acquire_in_poll_ready),
//! so that `poll_ready` is ready at once. A permit they lend goes back to them ([`Home`]) when
//! its request's [`PermitPass`](super::acquire::PermitPass) is dropped.
//!
//! On Redis an acquire is a round trip, so a `poll_ready` that starts one returns `Pending`,
//! and `LoadShed` sheds the request although the semaphore has room. So the services one
//! layer makes, and their clones, share a few permits held ahead ([`Spares`]): `poll_ready` takes one, with no round
//! trip, when there is one. They come from two places:
//!
//! - a request's permit goes back to the spares when the request ends, instead of being
//!   released, while the spares are fewer than wanted and the permit is sound (not lost, not
//!   an outage policy's);
//! - a `poll_ready` that found none (and the service itself, when it is made) starts a
//!   background `try_acquire` for each missing spare. It never waits in line, so a spare never
//!   stands in front of a waiter.
//!
//! How many are wanted follows demand: the most permits lent out at once during the last
//! [`KEEP`], never more than half the limit nor [`MOST_SPARES`] (none for a limit of 1). Every
//! [`KEEP`] a sweeper gives back the spares beyond that (all of them after an idle second) and
//! swaps each spare older than [`KEEP`] for a fresh `try_acquire`: the stale one is given back
//! when the fresh one comes, or when none does (another process's waiter won the slot), so
//! no slot stays in this process for much more than a second without going through the
//! backend, and no request is shed for the swap. Dropping the layer and the last of its
//! services gives every spare back.
//!
//! Cancel safety: a background acquire that is dropped (its runtime shut down) drops its
//! claim, which the semaphore releases; one that finishes after the service is gone drops its
//! permit. Background work is spawned only on a tokio runtime that exists: without one a
//! permit is released as usual and no spare is taken ahead.

use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;

use crate::sync::lock;
use crate::{Permit, Semaphore};

/// How long after it was taken a permit may serve further requests or wait as a spare.
const KEEP: Duration = Duration::from_secs(1);
/// The most spares one service holds, whatever its limit.
const MOST_SPARES: u32 = 8;

/// Where a lent permit goes back to, and when it was taken from the backend.
pub(crate) struct Home {
    pool: Weak<SparePool>,
    taken: Instant,
}

impl Home {
    /// `permit`, lent from here, is back: kept as a spare if wanted, else released.
    pub(crate) fn give_back(self, permit: Permit) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give_back(permit, self.taken);
        }
    }
}

/// The spares of one service and its clones; see the [module docs](self).
struct SparePool {
    semaphore: Semaphore,
    /// The most spares wanted at once.
    cap: usize,
    state: Mutex<State>,
}

struct State {
    ready: Vec<Spare>,
    /// Background acquires in flight.
    filling: usize,
    /// Of those, how many replace a spare older than [`KEEP`].
    swaps: usize,
    /// Permits handed to requests (or to a ready service) and not back yet.
    lent: usize,
    /// The most lent at once since the last sweep, counting a request that found none.
    peak: usize,
    /// How many spares are wanted now.
    wanted: usize,
    /// Whether a sweeper task runs.
    sweeping: bool,
    /// Services waiting for their own acquire, to wake when a spare comes.
    waiting: Vec<Waker>,
}

struct Spare {
    permit: Permit,
    taken: Instant,
}

impl SparePool {
    /// Takes a spare, lent to the caller, or registers `waker` for the next one and starts
    /// the background acquires now wanted.
    fn take(self: &Arc<Self>, waker: &Waker) -> Take {
        let mut state = lock(&self.state);
        if let Some(spare) = state.ready.pop() {
            return Take::Spare((spare.permit, self.lend(&mut state, spare.taken)));
        }
        if !state.waiting.iter().any(|w| w.will_wake(waker)) {
            state.waiting.push(waker.clone());
        }
        // The caller's own request is demand too, now and for the sweeper's next count.
        state.peak = state.peak.max(state.lent + 1);
        state.wanted = state.wanted.max(state.lent + 1).min(self.cap);
        let fills = self.fill(&mut state);
        let take = if state.filling > 0 {
            Take::Filling
        } else {
            Take::Empty
        };
        drop(state);
        fills.start();
        take
    }

    /// A permit taken at `taken` lent to a request: where it goes back to.
    fn lend(self: &Arc<Self>, state: &mut State, taken: Instant) -> Home {
        state.lent += 1;
        state.peak = state.peak.max(state.lent);
        Home {
            pool: Arc::downgrade(self),
            taken,
        }
    }

    /// A permit back from a request (or a ready service dropped without a call).
    fn give_back(self: &Arc<Self>, permit: Permit, taken: Instant) {
        let mut state = lock(&self.state);
        state.lent = state.lent.saturating_sub(1);
        let kept = self.keep(&mut state, permit, taken);
        // Replaced by a fresh one when demand is still there.
        let fills = if kept.is_some() {
            self.fill(&mut state)
        } else {
            Fills::default()
        };
        drop(state);
        drop(kept); // released in the background, outside the lock
        fills.start();
    }

    /// Keeps `permit` as a spare if it is wanted, fresh and sound; otherwise returns it. Only
    /// the spares ready count: a permit back while a background acquire is still on its way
    /// stays (that one is given back when it comes, if not wanted then), or a request arriving
    /// meanwhile would find none ready and be shed.
    fn keep(self: &Arc<Self>, state: &mut State, permit: Permit, taken: Instant) -> Option<Permit> {
        let wanted = state.ready.len() < state.wanted;
        let sound = !permit.is_lost() && !permit.is_degraded();
        if !(wanted && sound && self.sweep(state)) {
            return Some(permit);
        }
        state.ready.push(Spare { permit, taken });
        wake_all(state);
        None
    }

    /// Counts in the background acquires the wanted spares still lack, to start once the
    /// lock is released.
    fn fill(self: &Arc<Self>, state: &mut State) -> Fills {
        let mut fills = Fills::default();
        while state.spares() < state.wanted && self.add_fill(state, false, &mut fills) {}
        fills
    }

    /// One background `try_acquire`, counted now and started by `fills`; `swap`: for a spare
    /// older than [`KEEP`]. False without a runtime.
    fn add_fill(self: &Arc<Self>, state: &mut State, swap: bool, fills: &mut Fills) -> bool {
        let Ok(runtime) = Handle::try_current() else {
            return false;
        };
        state.filling += 1;
        state.swaps += usize::from(swap);
        let filling = Filling {
            pool: Arc::downgrade(self),
            swap,
            settled: false,
        };
        fills.0.push((runtime, self.semaphore.clone(), filling));
        true
    }

    /// Makes sure a sweeper runs while spares are held; false without a runtime to run it.
    fn sweep(self: &Arc<Self>, state: &mut State) -> bool {
        if state.sweeping {
            return true;
        }
        let Ok(runtime) = Handle::try_current() else {
            return false;
        };
        state.sweeping = true;
        runtime.spawn(sweeper(Arc::downgrade(self)));
        true
    }

    /// Sets how many spares are wanted from the last period's peak, gives back those beyond
    /// (the oldest first), and swaps each one older than [`KEEP`] for a fresh one: a spare
    /// serves for about a second, then its slot goes through the backend again, where another
    /// process's waiter may win it. False once nothing is left to sweep.
    fn sweep_once(self: &Arc<Self>) -> bool {
        let mut state = lock(&self.state);
        state.wanted = state.peak.min(self.cap);
        state.peak = state.lent;
        let mut beyond = Vec::new();
        while state.ready.len() > state.wanted {
            beyond.extend(state.take_oldest(Duration::ZERO));
        }
        let stale = state
            .ready
            .iter()
            .filter(|spare| spare.taken.elapsed() >= KEEP)
            .count();
        let mut fills = self.fill(&mut state);
        for _ in state.swaps..stale {
            if !self.add_fill(&mut state, true, &mut fills) {
                break;
            }
        }
        state.sweeping = !state.ready.is_empty() || state.filling > 0;
        let more = state.sweeping;
        drop(state);
        drop(beyond);
        fills.start();
        more
    }
}

impl State {
    /// The spares held or on their way, not counting those only replacing a stale one.
    fn spares(&self) -> usize {
        (self.ready.len() + self.filling).saturating_sub(self.swaps)
    }

    /// The oldest spare at least `age` old.
    fn take_oldest(&mut self, age: Duration) -> Option<Spare> {
        let (oldest, _) = self
            .ready
            .iter()
            .enumerate()
            .filter(|(_, spare)| spare.taken.elapsed() >= age)
            .min_by_key(|(_, spare)| spare.taken)?;
        Some(self.ready.swap_remove(oldest))
    }

    /// One background acquire ended: counted, and the stale spare it was to replace taken out.
    fn filled(&mut self, swap: bool) -> Option<Spare> {
        self.filling = self.filling.saturating_sub(1);
        if !swap {
            return None;
        }
        self.swaps = self.swaps.saturating_sub(1);
        self.take_oldest(KEEP)
    }
}

/// Background acquires counted under the pool's lock and started after it is released: a
/// runtime shutting down drops a task spawned on it at once, and a [`Filling`]'s drop takes
/// the lock.
#[derive(Default)]
struct Fills(Vec<(Handle, Semaphore, Filling)>);

impl Fills {
    fn start(self) {
        for (runtime, semaphore, filling) in self.0 {
            runtime.spawn(async move {
                let permit = semaphore.try_acquire().await.ok().flatten();
                filling.settle(permit, Instant::now());
            });
        }
    }
}

/// Wakes the services waiting for a spare: one came, or a background acquire ended without.
fn wake_all(state: &mut State) {
    for waker in state.waiting.drain(..) {
        waker.wake();
    }
}

/// What a service found in the spares.
pub(crate) enum Take {
    /// One, lent to it.
    Spare((Permit, Home)),
    /// None, but a background acquire is under way.
    Filling,
    /// None.
    Empty,
}

/// Every [`KEEP`], while its pool lives and holds spares.
async fn sweeper(pool: Weak<SparePool>) {
    loop {
        tokio::time::sleep(KEEP).await;
        match pool.upgrade() {
            Some(pool) if pool.sweep_once() => {}
            _ => return,
        }
    }
}

/// One background acquire, counted in `filling` until it settles or is dropped.
struct Filling {
    pool: Weak<SparePool>,
    swap: bool,
    settled: bool,
}

impl Filling {
    /// Counts the acquire done and keeps its permit as a spare if still wanted. A swap gives
    /// the stale spare back either way: without a fresh one, its slot goes to whoever wins it.
    fn settle(mut self, permit: Option<Permit>, taken: Instant) {
        self.settled = true;
        let Some(pool) = self.pool.upgrade() else {
            return; // the service is gone: the permit is released
        };
        let mut state = lock(&pool.state);
        let stale = state.filled(self.swap);
        let unwanted = permit.and_then(|permit| pool.keep(&mut state, permit, taken));
        // Kept or not (none came, or a degraded one during an outage), the services waiting
        // for it go on: each to its own acquire.
        wake_all(&mut state);
        drop(state);
        drop((stale, unwanted));
    }
}

/// A background acquire dropped before it settled (its runtime shut down).
impl Drop for Filling {
    fn drop(&mut self) {
        if let (false, Some(pool)) = (self.settled, self.pool.upgrade()) {
            let mut state = lock(&pool.state);
            let stale = state.filled(self.swap);
            wake_all(&mut state);
            drop(state);
            drop(stale);
        }
    }
}

/// The spares shared by every service one layer makes (and their clones), or none for a limit
/// of 1. Made with the layer, not with each service: axum wraps each endpoint of a `Router`
/// (every method of every route, and the fallback) in a service of its own, and a pool per
/// service would hold a slot ahead for each of them.
#[derive(Clone, Default)]
pub(crate) struct Spares(Option<Arc<SparePool>>);

impl std::fmt::Debug for Spares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Spares").field(&self.0.is_some()).finish()
    }
}

impl Spares {
    /// The spares of a layer reserving permits of `semaphore`; none are taken until
    /// [`warm`](Self::warm).
    pub(crate) fn new(semaphore: &Semaphore) -> Self {
        let cap = (semaphore.limit() / 2).min(MOST_SPARES) as usize;
        if cap == 0 {
            return Spares(None);
        }
        Spares(Some(Arc::new(SparePool {
            semaphore: semaphore.clone(),
            cap,
            state: Mutex::new(State {
                ready: Vec::new(),
                filling: 0,
                swaps: 0,
                lent: 0,
                peak: 0,
                wanted: 1,
                sweeping: false,
                waiting: Vec::new(),
            }),
        })))
    }

    /// A new service uses these spares: the first is taken now (on a runtime) unless one is
    /// held or on its way, so its first request need not be shed.
    pub(crate) fn warm(&self) {
        if let Some(pool) = &self.0 {
            let fills = pool.fill(&mut lock(&pool.state));
            fills.start();
        }
    }

    /// A spare, lent to the caller; otherwise `cx` is woken when one comes or a background
    /// acquire ends. `None` without spares.
    pub(crate) fn take(&self, cx: &Context<'_>) -> Option<Take> {
        Some(self.0.as_ref()?.take(cx.waker()))
    }

    /// A permit the service took itself, lent by the spares from now on: where it goes back
    /// to. `None` without spares.
    pub(crate) fn lend(&self) -> Option<Home> {
        let pool = self.0.as_ref()?;
        Some(pool.lend(&mut lock(&pool.state), Instant::now()))
    }
}
