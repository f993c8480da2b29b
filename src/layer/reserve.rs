//! The permit a service reserves in `poll_ready`, for
//! [`acquire_in_poll_ready`](super::DistributedConcurrencyLimitLayer::acquire_in_poll_ready),
//! and the spares the clones of one service share so that `poll_ready` is ready at once.
//!
//! # Spares
//!
//! On Redis an acquire is a round trip, so a `poll_ready` that starts one returns `Pending`,
//! and `LoadShed` sheds the request although the semaphore has room. So the clones of one
//! service share a few permits held ahead ([`Spares`]): `poll_ready` takes one, with no round
//! trip, when there is one. They come from two places:
//!
//! - a request's permit goes back to the spares when the request ends, instead of being
//!   released, while it is younger than [`KEEP`] and the spares are fewer than wanted;
//! - a `poll_ready` that found none (and the service itself, when it is made) starts a
//!   background `try_acquire` for each missing spare. It never waits in line, so a spare never
//!   stands in front of a waiter.
//!
//! How many are wanted follows demand: the most permits lent out at once during the last
//! [`KEEP`], never more than half the limit nor [`MOST_SPARES`] (none for a limit of 1). A
//! spare older than [`KEEP`] is given back (so a permit serves this service for about a
//! second before it goes through the backend again, and an idle service holds nothing after
//! a second or two), and so is every spare when the last clone is dropped.
//!
//! Cancel safety: a background acquire that is dropped (its runtime shut down) drops its
//! claim, which the semaphore releases; one that finishes after the service is gone drops its
//! permit. Background work is spawned only on a tokio runtime that exists: without one a
//! permit is released as usual and no spare is taken ahead.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker, ready};
use std::time::{Duration, Instant};

use sync_wrapper::SyncWrapper;
use tokio::runtime::Handle;

use super::limiter::Acquire;
use crate::sync::lock;
use crate::{Error, Permit, RateLimiter, Semaphore};

/// How long after it was taken a permit may serve further requests or wait as a spare.
const KEEP: Duration = Duration::from_secs(1);
/// The most spares one service holds, whatever its limit.
const MOST_SPARES: u32 = 8;

/// A request's permit. One lent by a service's [`Spares`] goes back to them when dropped, if
/// they still want it; any other is released as usual.
pub(crate) struct Held {
    /// Always `Some` until dropped.
    permit: Option<Permit>,
    home: Option<Home>,
}

/// Where a lent permit goes back to, and when it was taken from the backend.
struct Home {
    pool: Weak<Pool>,
    taken: Instant,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("permit", &self.permit)
            .field("lent", &self.home.is_some())
            .finish()
    }
}

impl From<Permit> for Held {
    fn from(permit: Permit) -> Self {
        Held {
            permit: Some(permit),
            home: None,
        }
    }
}

impl Held {
    /// This service's own permit, lent by `pool` from now on, so it goes back there.
    fn lent_by(mut self, pool: &Arc<Pool>) -> Held {
        match self.permit.take() {
            Some(permit) => pool.lend(&mut lock(&pool.state), permit, Instant::now()),
            None => self,
        }
    }

    pub(crate) fn fencing_token(&self) -> u64 {
        self.permit.as_ref().map_or(0, Permit::fencing_token)
    }

    /// Resolves when the lease is lost.
    pub(crate) fn lost_signal(&self) -> impl Future<Output = ()> + Send + 'static {
        let lost = self.permit.as_ref().map(Permit::lost_signal);
        async move {
            match lost {
                Some(lost) => lost.await,
                None => std::future::pending().await,
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let (Some(permit), Some(home)) = (self.permit.take(), self.home.take()) else {
            return;
        };
        if let Some(pool) = home.pool.upgrade() {
            pool.give_back(permit, home.taken);
        }
    }
}

/// The spares of one service and its clones; see the [module docs](self).
struct Pool {
    semaphore: Semaphore,
    /// The most spares wanted at once.
    cap: usize,
    state: Mutex<State>,
}

struct State {
    ready: Vec<Spare>,
    /// Background acquires in flight.
    filling: usize,
    /// Permits handed to requests (or to a ready service) and not back yet.
    lent: usize,
    /// The most lent at once since the last sweep.
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

impl Pool {
    /// Takes a spare, lent to the caller, or registers `waker` for the next one and starts
    /// the background acquires now wanted.
    fn take(self: &Arc<Self>, waker: &Waker) -> Take {
        let mut state = lock(&self.state);
        if let Some(spare) = state.ready.pop() {
            return Take::Spare(self.lend(&mut state, spare.permit, spare.taken));
        }
        if !state.waiting.iter().any(|w| w.will_wake(waker)) {
            state.waiting.push(waker.clone());
        }
        // The caller's own request is demand too.
        state.wanted = state.wanted.max(state.lent + 1).min(self.cap);
        self.fill(&mut state);
        if state.filling > 0 {
            Take::Filling
        } else {
            Take::Empty
        }
    }

    /// `permit`, taken at `taken`, lent to a request.
    fn lend(self: &Arc<Self>, state: &mut State, permit: Permit, taken: Instant) -> Held {
        state.lent += 1;
        state.peak = state.peak.max(state.lent);
        Held {
            permit: Some(permit),
            home: Some(Home {
                pool: Arc::downgrade(self),
                taken,
            }),
        }
    }

    /// A permit back from a request (or a ready service dropped without a call).
    fn give_back(self: &Arc<Self>, permit: Permit, taken: Instant) {
        let mut state = lock(&self.state);
        state.lent = state.lent.saturating_sub(1);
        let kept = self.keep(&mut state, permit, taken);
        if kept.is_some() {
            // Replaced by a fresh one when demand is still there.
            self.fill(&mut state);
        }
        drop(state);
        drop(kept); // released in the background, outside the lock
    }

    /// Keeps `permit` as a spare if it is wanted, fresh and sound; otherwise returns it.
    fn keep(self: &Arc<Self>, state: &mut State, permit: Permit, taken: Instant) -> Option<Permit> {
        let wanted = state.ready.len() + state.filling < state.wanted;
        let sound = !permit.is_lost() && !permit.is_degraded() && taken.elapsed() < KEEP;
        if !(wanted && sound && self.sweep(state)) {
            return Some(permit);
        }
        state.ready.push(Spare { permit, taken });
        wake_all(state);
        None
    }

    /// Starts the background acquires the wanted spares still lack.
    fn fill(self: &Arc<Self>, state: &mut State) {
        let Ok(runtime) = Handle::try_current() else {
            return;
        };
        while state.ready.len() + state.filling < state.wanted {
            state.filling += 1;
            let filling = Filling {
                pool: Arc::downgrade(self),
                settled: false,
            };
            let semaphore = self.semaphore.clone();
            runtime.spawn(async move {
                let permit = semaphore.try_acquire().await.ok().flatten();
                filling.settle(permit, Instant::now());
            });
        }
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

    /// Gives back spares older than [`KEEP`] and sets how many are wanted from the last
    /// period's peak. False once nothing is left to sweep.
    fn sweep_once(self: &Arc<Self>) -> bool {
        let mut state = lock(&self.state);
        state.wanted = state.peak.min(self.cap);
        state.peak = state.lent;
        let (stale, fresh) = std::mem::take(&mut state.ready)
            .into_iter()
            .partition(|spare: &Spare| spare.taken.elapsed() >= KEEP);
        state.ready = fresh;
        self.fill(&mut state);
        state.sweeping = !state.ready.is_empty() || state.filling > 0;
        let more = state.sweeping;
        drop(state);
        drop::<Vec<Spare>>(stale);
        more
    }
}

/// Wakes the services waiting for a spare: one came, or a background acquire ended without.
fn wake_all(state: &mut State) {
    for waker in state.waiting.drain(..) {
        waker.wake();
    }
}

/// What a service found in the spares.
enum Take {
    /// One, lent to it.
    Spare(Held),
    /// None, but a background acquire is under way.
    Filling,
    /// None.
    Empty,
}

/// Every [`KEEP`], while its pool lives and holds spares.
async fn sweeper(pool: Weak<Pool>) {
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
    pool: Weak<Pool>,
    settled: bool,
}

impl Filling {
    /// Counts the acquire done and keeps its permit as a spare if still wanted.
    fn settle(mut self, permit: Option<Permit>, taken: Instant) {
        self.settled = true;
        let Some(pool) = self.pool.upgrade() else {
            return; // the service is gone: the permit is released
        };
        let mut state = lock(&pool.state);
        state.filling = state.filling.saturating_sub(1);
        let unwanted = match permit {
            Some(permit) => pool.keep(&mut state, permit, taken),
            None => {
                wake_all(&mut state);
                None
            }
        };
        drop(state);
        drop(unwanted);
    }
}

/// A background acquire dropped before it settled (its runtime shut down).
impl Drop for Filling {
    fn drop(&mut self) {
        if let (false, Some(pool)) = (self.settled, self.pool.upgrade()) {
            let mut state = lock(&pool.state);
            state.filling = state.filling.saturating_sub(1);
            wake_all(&mut state);
        }
    }
}

/// The spares shared by the clones of one service; none for a limit of 1 or with a rate limit
/// (a spare would spend rate for a request that may never come).
#[derive(Clone, Default)]
pub(crate) struct Spares(Option<Arc<Pool>>);

impl Spares {
    /// The spares of a new service reserving permits of `semaphore`, taking the first at once
    /// (on a runtime).
    pub(crate) fn new(semaphore: &Semaphore, rate: Option<&RateLimiter>) -> Self {
        let cap = (semaphore.limit() / 2).min(MOST_SPARES) as usize;
        if cap == 0 || rate.is_some() {
            return Spares(None);
        }
        let pool = Arc::new(Pool {
            semaphore: semaphore.clone(),
            cap,
            state: Mutex::new(State {
                ready: Vec::new(),
                filling: 0,
                lent: 0,
                peak: 0,
                wanted: 1,
                sweeping: false,
                waiting: Vec::new(),
            }),
        });
        pool.fill(&mut lock(&pool.state));
        Spares(Some(pool))
    }
}

/// The reservation of one service: nothing, a wait in line, or its outcome, handed to the
/// next `call`. A clone starts with nothing but shares the spares; dropping it drops the
/// permit (back to the spares, or released in the background) or leaves the line.
#[derive(Default)]
pub(crate) struct Reservation {
    spares: Spares,
    /// Waited once for a background acquire of the spares, before starting its own.
    waited: bool,
    pending: Option<SyncWrapper<Acquire>>,
    outcome: Option<Result<Held, Error>>,
}

impl Clone for Reservation {
    fn clone(&self) -> Self {
        Reservation::new(self.spares.clone())
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("spares", &self.spares.0.is_some())
            .field("waiting", &self.pending.is_some())
            .field("reserved", &self.outcome.as_ref().map(Result::is_ok))
            .finish()
    }
}

impl Reservation {
    pub(crate) fn new(spares: Spares) -> Self {
        Reservation {
            spares,
            waited: false,
            pending: None,
            outcome: None,
        }
    }

    /// Ready once the permit is held or refused: a spare at once, else this service's own
    /// acquire (or a spare that comes first). A refusal (the wait ran out, the backend
    /// failed) is kept for `call` rather than returned here: an error from `poll_ready` means
    /// the service is broken for good to `Buffer` and `balance`.
    pub(crate) fn poll_reserve(
        &mut self,
        semaphore: &Semaphore,
        wait: bool,
        rate: Option<&RateLimiter>,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        if self.outcome.is_some() {
            return Poll::Ready(());
        }
        if let Some(pool) = &self.spares.0 {
            match pool.take(cx.waker()) {
                Take::Spare(spare) => {
                    self.pending = None; // leaves the line, in the background
                    self.waited = false;
                    self.outcome = Some(Ok(spare));
                    return Poll::Ready(());
                }
                // Its own acquire would take a slot too, and be dropped by a `LoadShed`:
                // wait for the spare first (woken either way), then for its own.
                Take::Filling if self.pending.is_none() && !self.waited => {
                    self.waited = true;
                    return Poll::Pending;
                }
                Take::Filling | Take::Empty => {}
            }
        }
        let pending = self.pending.get_or_insert_with(|| {
            SyncWrapper::new(Acquire::start(semaphore.clone(), 1, wait, rate.cloned()))
        });
        let outcome = ready!(Pin::new(pending.get_mut()).poll(cx));
        self.pending = None;
        self.waited = false;
        self.outcome = Some(outcome.map(|held| match &self.spares.0 {
            Some(pool) => held.lent_by(pool),
            None => held,
        }));
        Poll::Ready(())
    }

    /// The outcome for the request being called; `None` if `poll_ready` did not finish first.
    pub(crate) fn take(&mut self) -> Option<Result<Held, Error>> {
        self.outcome.take()
    }
}
