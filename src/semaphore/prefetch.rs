//! Prefetched permits ([`SemaphoreBuilder::prefetch`](super::SemaphoreBuilder::prefetch)):
//! free slots this process holds ahead of need while nobody waits, each an ordinary holder in
//! the backend (leased, renewed and fenced like any other), handed out and taken back without
//! a round trip, and given back to the backend as soon as a reply says someone waits.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::watch;

use crate::backend::{Ending, Samples, Store};
use crate::permit::{Permit, TakesBack};
use crate::sync::lock;

/// How often a process holding prefetched slots asks the backend whether anyone waits, when
/// nothing else it sends tells it (its hand-outs and returns need no call): what bounds how
/// long a waiter elsewhere waits beside slots prefetched and unused (20 calls a second per
/// process, whatever its load).
const CHECK: Duration = Duration::from_millis(50);

/// One semaphore's prefetched slots in this process.
pub(crate) struct Prefetch {
    /// How many slots this process may hold ahead of need.
    size: usize,
    slots: Mutex<Vec<Permit>>,
    /// Whether anyone waits, as the backend's last reply said.
    crowding: watch::Receiver<bool>,
    /// Asked every [`CHECK`] while slots are prefetched (a renewal of one, which says).
    store: Arc<dyn Store>,
    refilling: AtomicBool,
    /// The task that gives the slots back when someone starts waiting was spawned.
    watching: AtomicBool,
    /// The limit adapts: the holds that end here are its samples.
    adaptive: bool,
    /// The holds that ended here since the last check, for an adaptive limit.
    ended: Mutex<Tally>,
}

/// Holds that ended in the pool (their slots stayed held): an adaptive limit's samples, sent
/// with the next check.
#[derive(Default)]
struct Tally {
    count: u32,
    total: Duration,
    overloaded: bool,
}

impl Prefetch {
    /// Prefetching `size` slots of `store`, told of waiters by `crowding`; `adaptive`: the
    /// holds that end in the pool are samples for the limit.
    pub(super) fn new(
        size: u32,
        store: Arc<dyn Store>,
        crowding: watch::Receiver<bool>,
        adaptive: bool,
    ) -> Arc<Self> {
        Arc::new(Prefetch {
            size: usize::try_from(size).unwrap_or(usize::MAX),
            slots: Mutex::default(),
            crowding,
            store,
            refilling: AtomicBool::new(false),
            watching: AtomicBool::new(false),
            adaptive,
            ended: Mutex::default(),
        })
    }

    fn crowded(&self) -> bool {
        *self.crowding.borrow()
    }

    /// A slot whose lease still holds, if one is left.
    fn take(&self) -> Option<Permit> {
        let mut lost = Vec::new();
        let mut slots = lock(&self.slots);
        let mut found = None;
        while let Some(permit) = slots.pop() {
            if !permit.is_lost() {
                found = Some(permit);
                break;
            }
            lost.push(permit);
        }
        // Permits are dropped outside the lock: a drop may ask the pool to take one back.
        drop(slots);
        drop(lost);
        found
    }

    /// The holds that ended here since the last call, as samples for the backend.
    fn samples(&self) -> Option<Samples> {
        let ended = std::mem::take(&mut *lock(&self.ended));
        (ended.count > 0).then(|| Samples {
            count: ended.count,
            mean: ended.total / ended.count,
            overloaded: ended.overloaded,
        })
    }

    /// Keeps `permit`, on hand, for the next acquire; released instead, returning nowhere, when the
    /// pool is full.
    fn put(&self, mut permit: Permit) {
        permit.on_hand();
        let mut slots = lock(&self.slots);
        if slots.len() < self.size {
            slots.push(permit);
            return;
        }
        drop(slots);
        // Outside the lock, and homeless: its drop releases it.
        permit.forget_return();
    }

    /// Every unused slot back to the backend (released in the background, with the next call).
    fn give_back(&self) {
        let unused = std::mem::take(&mut *lock(&self.slots));
        drop(unused);
    }

    fn unused(&self) -> usize {
        lock(&self.slots).len()
    }
}

impl TakesBack for Prefetch {
    /// Nobody waits (`put` checks the room).
    fn wants_back(&self) -> bool {
        !self.crowded()
    }

    fn learns(&self) -> bool {
        self.adaptive
    }

    /// The hold is a sample for the next check; the permit goes back as
    /// [`put`](Prefetch::put) says.
    fn returned(&self, permit: Permit, ending: Option<Ending>) {
        if let Some(Ending {
            held: Some(held),
            overloaded,
        }) = ending
        {
            let mut ended = lock(&self.ended);
            ended.count = ended.count.saturating_add(1);
            ended.total = ended.total.saturating_add(held);
            ended.overloaded |= overloaded;
        }
        self.put(permit);
    }
}

/// Where a pool takes its slots from: the semaphore, `wanted` plain permits at once (one
/// backend call, the acquires going together), each only if it is free.
pub(super) trait Source: Clone + Send + Sync + 'static {
    fn take(&self, wanted: usize) -> impl Future<Output = Vec<Permit>> + Send;
}

impl Prefetch {
    /// A prefetched permit, handed out (its hold counts from now), while nobody waits; once
    /// someone does, every unused slot goes back instead.
    pub(super) fn hand_out(&self) -> Option<Permit> {
        if self.crowded() {
            self.give_back();
            return None;
        }
        Some(self.take()?.handed_out())
    }

    /// Once the pool is less than half full, takes free slots from `source` until it is full,
    /// in one backend call on a task of its own, while nobody waits; gives them back if a
    /// reply said someone waits meanwhile. (At half full a pool of two would refill at each
    /// hand-out, and give a slot back at each return.)
    pub(super) fn refill(self: &Arc<Self>, source: &impl Source) {
        if self.crowded() || self.unused() * 2 >= self.size {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.refilling.swap(true, Ordering::AcqRel) {
            return;
        }
        if !self.watching.swap(true, Ordering::AcqRel) {
            runtime.spawn(watch_for_waiters(
                Arc::downgrade(self),
                self.crowding.clone(),
            ));
        }
        let (source, pool) = (source.clone(), self.clone());
        runtime.spawn(async move {
            let wanted = pool.size.saturating_sub(pool.unused());
            for permit in source.take(wanted).await {
                pool.put(permit.returning_to(Arc::<Prefetch>::downgrade(&pool)));
            }
            if pool.crowded() {
                pool.give_back();
            }
            pool.refilling.store(false, Ordering::Release);
        });
    }
}

/// While the pool lives: gives it back each time a reply says someone started waiting, and
/// every [`CHECK`] renews one of the slots it holds (the keeper renews them all on its own
/// schedule), whose reply says whether anyone waits, and passes on the holds that ended in
/// the pool since the last check (an adaptive limit's samples).
async fn watch_for_waiters(pool: Weak<Prefetch>, mut crowding: watch::Receiver<bool>) {
    let mut check = tokio::time::interval(CHECK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            changed = crowding.changed() => {
                if changed.is_err() {
                    return;
                }
                if *crowding.borrow_and_update() {
                    let Some(pool) = pool.upgrade() else { return };
                    pool.give_back();
                }
            }
            _ = check.tick() => {
                let Some(pool) = pool.upgrade() else { return };
                // Sent with the renewal below (or a call of its own, on an idle pool).
                if let Some(samples) = pool.samples() {
                    pool.store.sampled(samples);
                }
                let members: Vec<_> = lock(&pool.slots)
                    .first()
                    .map(|permit| permit.member().clone())
                    .into_iter()
                    .collect();
                let store = pool.store.clone();
                // Not holding the pool while the call is out: it may be dropped meanwhile.
                drop(pool);
                if !members.is_empty() {
                    // A failure is the keeper's to notice; the check only listens.
                    let _ = store.renew(&members).await;
                }
            }
        }
    }
}
