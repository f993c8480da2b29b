//! Permits in this process only, with the same semantics as Redis: leases, weights, fencing
//! tokens, and one first-come-first-served line.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::gcra::{
    Cells, Gcra, OpenedRate, RateBackend, RateDecision, RateStore, Rated, sealed::OpenRate,
};
use super::store::{
    Attempt, Ending, Member, Mode, Opened, Samples, Store, default_process_name, sealed::Open,
};
use crate::adaptive::Gradient;
use crate::class::{Classes, Room};
use crate::snapshot::{Holder, Snapshot};
use crate::sync::{BoxFuture, lock};
use crate::waitlist::{ClockReading, Hub, KEEPALIVE, Refresh, Status, Until, Waitlist};
use crate::{AdaptiveLimit, Error, Priority};

/// An in-process backend with the same semantics as [`RedisBackend`](crate::RedisBackend):
/// leases expire, weights add up, fencing tokens strictly increase, waiters are served in
/// order. Clones share the permits.
///
/// Use it in development and tests, or as the embedded default of a single instance; use
/// [`RedisBackend`](crate::RedisBackend) to share a limit between processes.
///
/// # Example
///
/// ```
/// use tower_distributed_limit::{MemoryBackend, Semaphore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
/// let backend = MemoryBackend::new();
/// let a = Semaphore::builder("jobs").limit(2).build(backend.clone())?;
/// let b = Semaphore::builder("jobs").limit(2).build(backend)?; // same name, same permits
/// let _p = a.acquire_many(2).await?;
/// assert!(b.try_acquire().await?.is_none());
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct MemoryBackend {
    shared: Arc<InProcess>,
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend").finish_non_exhaustive()
    }
}

/// What clones of one `MemoryBackend` share.
struct InProcess {
    state: Mutex<AllPermits>,
    hub: Hub,
    /// The backend's clock reads µs since this instant.
    epoch: Instant,
    /// The rate limiters' state (see the rate block at the end of this file).
    rates: Mutex<Cells>,
}

impl Default for InProcess {
    fn default() -> Self {
        InProcess {
            state: Mutex::default(),
            hub: Hub::new(None),
            epoch: Instant::now(),
            rates: Mutex::default(),
        }
    }
}

impl InProcess {
    /// `at` on the backend's clock, as announcements carry it.
    fn server_us(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_micros()).unwrap_or(u64::MAX)
    }
}

/// Every semaphore of the backend, under one lock.
#[derive(Default)]
struct AllPermits {
    semaphores: HashMap<Arc<str>, Permits>,
    /// One counter for every semaphore: strictly increasing per semaphore, never reset.
    fence: u64,
    /// Idle semaphores kept for their adaptive limit are swept when the map reaches this size,
    /// which then becomes twice the live count (never more than twice the live ones).
    sweep_at: usize,
}

/// This process's name for its holders, read once.
fn process_name() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(default_process_name)
}

/// One semaphore's holders and line; removed from the map when both are empty (unless an
/// operator set its limit).
struct Permits {
    holders: HashMap<Arc<str>, Holding>,
    used: u32,
    /// The limit every semaphore of this name admits by: the first one's, or the one set.
    limit: u32,
    /// Set by `set_limit`: kept while idle, and no longer adapted.
    pinned: bool,
    /// While pinned, the limit `unset_limit` returns to.
    unpinned: u32,
    /// An adaptive limit's state: `limit` follows it. Kept while idle until `keep_until` (half
    /// a lease past the latest lease, as Redis keeps it), so a pause in traffic does not
    /// reset what was learnt.
    gradient: Option<Gradient>,
    keep_until: Instant,
    /// What each class reserves and may hold (the first semaphore's), and holds now.
    classes: Classes,
    held: [u32; 8],
    /// The line, by class (highest first) then arrival; `queued` finds a member in it (or
    /// parked) without a scan, with its tenant.
    queue: BTreeMap<Place, Member>,
    queued: HashMap<Arc<str>, (Place, Option<u64>)>,
    arrivals: u64,
    /// Tenants are served in turn: only a tenant's head (its oldest waiter of a class) stands
    /// in `queue`; its later waiters are parked here, by arrival, each placed at `PARKED` plus
    /// its rank in `queued`. `heads` has the tenant lines with a head in `queue`.
    parked: HashMap<TenantLine, BTreeMap<u64, Member>>,
    heads: HashSet<TenantLine>,
    /// Under a per-tenant cap, what each tenant holds (only those holding some).
    tenant_held: HashMap<u64, u32>,
    /// After the last settlement, the highest class whose head waits for the pool (a lower
    /// class is admitted only inside its reservation while it waits).
    blocked: Option<u8>,
}

/// A place in line: the class's rank (0 for the highest level), then the arrival.
type Place = (u8, u64);

/// A parked waiter's rank in `queued` is this plus its class's.
const PARKED: u8 = 8;

/// One tenant's waiters of one class: the class's rank, and the tenant.
type TenantLine = (u8, u64);

/// The rank of `priority` in line: higher classes first.
fn rank(priority: Priority) -> u8 {
    Priority::MAX - priority.level()
}

struct Holding {
    deadline: Instant,
    weight: u32,
    lease: Duration,
    granted: Instant,
    priority: Priority,
    tenant: Option<u64>,
}

/// A grant made while the lock was held, announced once it is released: member, token and
/// lease deadline.
type Grant = (Arc<str>, u64, Instant);

impl Permits {
    fn new(limit: u32, adaptive: Option<AdaptiveLimit>, classes: Classes) -> Self {
        Permits {
            holders: HashMap::new(),
            used: 0,
            limit,
            pinned: false,
            unpinned: limit,
            gradient: adaptive.map(Gradient::new),
            keep_until: Instant::now(),
            classes,
            held: [0; 8],
            queue: BTreeMap::new(),
            queued: HashMap::new(),
            arrivals: 0,
            parked: HashMap::new(),
            heads: HashSet::new(),
            tenant_held: HashMap::new(),
            blocked: None,
        }
    }

    fn level(priority: Priority) -> usize {
        usize::from(priority.level())
    }

    fn room(&self, member: &Member) -> Room {
        let (priority, weight) = (member.priority, member.weight);
        let tenant = (member.tenant).map(|tenant| self.tenant_held.get(&tenant).map_or(0, |&n| n));
        (self.classes).room(priority, weight, self.used, &self.held, tenant, self.limit)
    }

    /// Whether `member` is admitted now, if it waited with nobody of its class ahead of it.
    fn admits(&self, member: &Member) -> bool {
        let behind_blocked = self
            .blocked
            .is_some_and(|ranked| ranked < rank(member.priority));
        self.room(member) == Room::Fits
            && (!behind_blocked
                || (self.classes).within_reservation(member.priority, member.weight, &self.held))
    }

    /// Whether anyone of `priority`'s class waits.
    fn waits_in(&self, priority: Priority) -> bool {
        let ranked = rank(priority);
        self.queue
            .range((ranked, 0)..=(ranked, u64::MAX))
            .next()
            .is_some()
    }

    fn unhold(&mut self, holding: &Holding) {
        self.used -= holding.weight;
        self.held[Self::level(holding.priority)] -= holding.weight;
        if let Some(tenant) = holding.tenant
            && let Some(held) = self.tenant_held.get_mut(&tenant)
        {
            *held -= holding.weight;
            if *held == 0 {
                self.tenant_held.remove(&tenant);
            }
        }
    }

    /// Puts `member` in line: at the back of its class, or parked behind its tenant's head.
    fn enqueue(&mut self, member: &Member) {
        if self.queued.contains_key(&member.text) {
            return;
        }
        let arrival = self.arrivals;
        self.arrivals += 1;
        let ranked = rank(member.priority);
        if let Some(tenant) = member.tenant {
            let line = (ranked, tenant);
            if !self.heads.insert(line) {
                let parked = self.parked.entry(line).or_default();
                parked.insert(arrival, member.clone());
                let place = (ranked + PARKED, arrival);
                self.queued
                    .insert(member.text.clone(), (place, Some(tenant)));
                return;
            }
        }
        let place = (ranked, arrival);
        self.queued
            .insert(member.text.clone(), (place, member.tenant));
        self.queue.insert(place, member.clone());
    }

    /// Takes `member` out of the line (or its parking); a head makes way for its tenant's
    /// oldest parked waiter, which joins the line at the back.
    fn unqueue(&mut self, member: &str) -> Option<Member> {
        let (place, tenant) = self.queued.remove(member)?;
        if place.0 >= PARKED {
            let line = (place.0 - PARKED, tenant?);
            let parked = self.parked.get_mut(&line)?;
            let member = parked.remove(&place.1);
            if parked.is_empty() {
                self.parked.remove(&line);
            }
            return member;
        }
        let member = self.queue.remove(&place)?;
        if let Some(tenant) = tenant {
            let line = (place.0, tenant);
            let next = self.parked.get_mut(&line).and_then(BTreeMap::pop_first);
            if self.parked.get(&line).is_some_and(BTreeMap::is_empty) {
                self.parked.remove(&line);
            }
            match next {
                Some((_, next)) => {
                    let place = (line.0, self.arrivals);
                    self.arrivals += 1;
                    self.queued.insert(next.text.clone(), (place, Some(tenant)));
                    self.queue.insert(place, next);
                }
                None => {
                    self.heads.remove(&line);
                }
            }
        }
        Some(member)
    }

    fn hold(&mut self, member: &Member, now: Instant, fence: &mut u64) -> u64 {
        let holding = Holding {
            deadline: now + member.lease,
            weight: member.weight,
            lease: member.lease,
            granted: now,
            priority: member.priority,
            // Counted only under a per-tenant cap.
            tenant: member
                .tenant
                .filter(|_| self.classes.tenant_cap().is_some()),
        };
        if let Some(tenant) = holding.tenant {
            *self.tenant_held.entry(tenant).or_default() += member.weight;
        }
        self.holders.insert(member.text.clone(), holding);
        self.used += member.weight;
        self.held[Self::level(member.priority)] += member.weight;
        self.keep_until = self.keep_until.max(now + member.lease + member.lease / 2);
        *fence += 1;
        *fence
    }

    /// Drops expired holders, then admits waiters: each class in turn, highest first, in
    /// arrival order while its oldest fits. A class whose oldest waits for the pool holds the
    /// lower classes to their reservations; one at its cap holds up nobody else, and a tenant
    /// at its cap is passed over.
    fn settle(&mut self, now: Instant, fence: &mut u64, grants: &mut Vec<Grant>) {
        let expired: Vec<Arc<str>> = (self.holders.iter())
            .filter(|(_, holding)| holding.deadline <= now)
            .map(|(member, _)| member.clone())
            .collect();
        for member in expired {
            if let Some(holding) = self.holders.remove(&member) {
                self.unhold(&holding);
            }
        }
        self.blocked = None;
        let mut from: Place = (0, 0);
        while let Some((&(ranked, _), _)) = self.queue.range(from..).next() {
            let mut cursor = (ranked, 0);
            while let Some((&place, member)) = self.queue.range(cursor..=(ranked, u64::MAX)).next()
            {
                let text = member.text.clone();
                let tenant = member.tenant.is_some();
                if member.weight > self.classes.most(member.priority, tenant, self.limit) {
                    // Heavier than its class (or tenant) may ever hold under the limit now in
                    // force: it would block the line for ever. Dropped, it learns at its next
                    // refresh and is refused.
                    self.unqueue(&text);
                    continue;
                }
                let room = self.room(member);
                if room == Room::TenantCapped {
                    cursor = (ranked, place.1 + 1);
                    continue;
                }
                if !self.admits(member) {
                    if room != Room::Capped {
                        self.blocked = self.blocked.or(Some(ranked));
                    }
                    break;
                }
                let Some(member) = self.unqueue(&text) else {
                    break;
                };
                let token = self.hold(&member, now, fence);
                grants.push((member.text, token, now + member.lease));
            }
            from = (ranked + 1, 0);
        }
    }

    /// Nothing held, nothing waiting, and nothing to remember: no limit set by an operator, no
    /// adaptive limit learnt recently.
    fn forgettable(&self, now: Instant) -> bool {
        self.holders.is_empty()
            && self.queue.is_empty()
            && !self.pinned
            && (self.gradient.is_none() || now >= self.keep_until)
    }

    /// Pushes a holder's deadline to a full lease from now; `None` if it no longer holds.
    fn extend(&mut self, member: &str, now: Instant) -> Option<Duration> {
        let holding = self.holders.get_mut(member)?;
        holding.deadline = holding.deadline.max(now + holding.lease);
        Some(holding.deadline.saturating_duration_since(now))
    }

    fn retry_in(&self, now: Instant, fallback: Duration) -> Duration {
        self.holders
            .values()
            .map(|holding| holding.deadline.saturating_duration_since(now))
            .min()
            .unwrap_or(fallback)
    }

    /// A holder is claimed for a full lease (its process is alive), with a fresh token.
    fn status(&mut self, member: &str, now: Instant, fence: &mut u64) -> Status {
        if let Some(remaining) = self.extend(member, now) {
            *fence += 1;
            return Status::Granted {
                token: *fence,
                remaining,
            };
        }
        if self.queued.contains_key(member) {
            return Status::Queued;
        }
        Status::Unknown
    }
}

impl MemoryBackend {
    /// A new, empty backend.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Open for MemoryBackend {
    fn open(
        &self,
        name: &str,
        limit: u32,
        adaptive: Option<AdaptiveLimit>,
        classes: &Classes,
        _claim: Duration,
    ) -> Opened {
        let waitlist = self.shared.hub.waitlist(name);
        Opened {
            store: Arc::new(MemorySemaphore {
                shared: self.shared.clone(),
                name: name.into(),
                limit,
                adaptive,
                classes: *classes,
                in_force: AtomicU32::new(limit),
                crowded: watch::Sender::new(false),
                waitlist: waitlist.clone(),
            }),
            waitlist,
        }
    }
}

struct MemorySemaphore {
    shared: Arc<InProcess>,
    name: Arc<str>,
    limit: u32,
    adaptive: Option<AdaptiveLimit>,
    classes: Classes,
    /// The limit in force after this semaphore's last call (for `limit_in_force`, without
    /// taking the backend's lock).
    in_force: AtomicU32,
    /// Whether anyone waited after this semaphore's last call (see `Store::crowding`).
    crowded: watch::Sender<bool>,
    waitlist: Arc<Waitlist>,
}

impl MemorySemaphore {
    fn state(&self) -> MutexGuard<'_, AllPermits> {
        lock(&self.shared.state)
    }

    /// Runs `op` on this semaphore between two settlements, then announces the grants made.
    fn with<R>(&self, op: impl FnOnce(&mut Permits, Instant, &mut u64) -> R) -> R {
        let now = Instant::now();
        let mut grants = Vec::new();
        let result = {
            let mut guard = self.state();
            let AllPermits {
                semaphores,
                fence,
                sweep_at,
            } = &mut *guard;
            if !semaphores.contains_key(&self.name) && semaphores.len() >= *sweep_at {
                semaphores.retain(|_, permits| !permits.forgettable(now));
                *sweep_at = (semaphores.len() * 2).max(64);
            }
            let permits = semaphores
                .entry(self.name.clone())
                .or_insert_with(|| Permits::new(self.limit, self.adaptive, self.classes));
            permits.settle(now, fence, &mut grants);
            let result = op(permits, now, fence);
            permits.settle(now, fence, &mut grants);
            self.in_force.store(permits.limit, Ordering::Relaxed);
            let crowded = !permits.queue.is_empty();
            self.crowded
                .send_if_modified(|was| std::mem::replace(was, crowded) != crowded);
            if permits.forgettable(now) {
                semaphores.remove(&self.name);
            }
            result
        };
        for (member, token, deadline) in grants {
            let until = Until::Server(self.shared.server_us(deadline));
            self.waitlist.grant(&member, token, until);
        }
        result
    }

    /// Teaches an adaptive limit that is not pinned `samples`, ending at `now`.
    fn learn(&self, permits: &mut Permits, now: Instant, samples: Samples) {
        if let Some(gradient) = permits.gradient.as_mut().filter(|_| !permits.pinned) {
            let now_ms = now.saturating_duration_since(self.shared.epoch).as_millis() as u64;
            permits.limit = gradient.samples(
                now_ms,
                samples.count,
                samples.mean.as_secs_f64() * 1e3,
                permits.used,
                samples.overloaded,
            );
        }
    }
}

impl Store for MemorySemaphore {
    fn acquire<'a>(
        &'a self,
        member: &'a Member,
        mode: Mode,
        _until: Option<Instant>,
        // Never given: this store combines with no rate limiter (`Store::combines`).
        _rate: Option<&'a Rated>,
    ) -> BoxFuture<'a, Result<Attempt, Error>> {
        let attempt = self.with(|permits, now, fence| {
            if mode == Mode::Recheck
                && let Status::Granted { token, remaining } =
                    permits.status(&member.text, now, fence)
            {
                return Attempt::Granted {
                    token,
                    remaining,
                    rate: None,
                };
            }
            let tenant = member.tenant.is_some();
            let most = permits.classes.most(member.priority, tenant, permits.limit);
            if member.weight > most {
                return Attempt::TooHeavy { limit: most };
            }
            if !permits.waits_in(member.priority) && permits.admits(member) {
                let token = permits.hold(member, now, fence);
                return Attempt::Granted {
                    token,
                    remaining: member.lease,
                    rate: None,
                };
            }
            if mode == Mode::Once {
                return Attempt::Full;
            }
            permits.enqueue(member);
            Attempt::Queued {
                retry_in: permits.retry_in(now, member.lease),
                clock: ClockReading {
                    local: now,
                    server_us: self.shared.server_us(now),
                },
            }
        });
        Box::pin(async move { Ok(attempt) })
    }

    fn release<'a>(
        &'a self,
        member: &'a Member,
        ending: Ending,
    ) -> BoxFuture<'a, Result<(), Error>> {
        self.release_later(member.clone(), ending);
        Box::pin(async { Ok(()) })
    }

    // In process there is no hand-off: the store's own grant time is the sample's start,
    // except for a pooled slot, handed out after its grant (its process's measure, if any: a
    // slot released idle from its pool ends no hold).
    fn release_later(&self, member: Member, ending: Ending) {
        self.with(|permits, now, _| {
            if let Some(holding) = permits.holders.remove(&member.text) {
                let held = if member.pooled {
                    ending.held
                } else {
                    Some(now.saturating_duration_since(holding.granted))
                };
                if let Some(held) = held {
                    let samples = Samples {
                        count: 1,
                        mean: held,
                        overloaded: ending.overloaded,
                    };
                    self.learn(permits, now, samples);
                }
                permits.unhold(&holding);
            } else {
                permits.unqueue(&member.text);
            }
        });
    }

    fn sampled(&self, samples: Samples) {
        self.with(|permits, now, _| self.learn(permits, now, samples));
    }

    fn renew<'a>(
        &'a self,
        members: &'a [Member],
    ) -> BoxFuture<'a, Result<Vec<Option<Duration>>, Error>> {
        let renewed = self.with(|permits, now, _| {
            members
                .iter()
                .map(|member| permits.extend(&member.text, now))
                .collect()
        });
        Box::pin(async move { Ok(renewed) })
    }

    fn used(&self) -> BoxFuture<'_, Result<u32, Error>> {
        let used = self.with(|permits, _, _| permits.used);
        Box::pin(async move { Ok(used) })
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        None
    }

    fn crowding(&self) -> Option<watch::Receiver<bool>> {
        Some(self.crowded.subscribe())
    }

    fn snapshot(&self) -> BoxFuture<'_, Result<Snapshot, Error>> {
        let snapshot = self.with(|permits, now, _| {
            let mut holders: Vec<(Instant, Holder)> = permits
                .holders
                .iter()
                .filter_map(|(member, holding)| {
                    let holder = Holder::of(
                        member,
                        now.saturating_duration_since(holding.granted),
                        holding.deadline.saturating_duration_since(now),
                        process_name().to_owned(),
                    )?;
                    Some((holding.granted, holder))
                })
                .collect();
            holders.sort_by_key(|(granted, _)| *granted);
            let mut waiting = [0u32; 8];
            let mut tenants: HashMap<u64, u32> = HashMap::new();
            for &((ranked, _), tenant) in permits.queued.values() {
                // (A parked waiter's rank is `PARKED`, 8, above its class's.)
                let level = usize::from(Priority::MAX - ranked % PARKED);
                waiting[level] += 1;
                if let Some(tenant) = tenant {
                    *tenants.entry(tenant).or_default() += 1;
                }
            }
            let mut snapshot = Snapshot {
                limit: permits.limit,
                used: permits.used,
                waiting: u32::try_from(permits.queued.len()).unwrap_or(u32::MAX),
                pinned: permits.pinned,
                holders: holders.into_iter().map(|(_, holder)| holder).collect(),
                classes: Vec::new(),
                tenants_waiting: Vec::new(),
                protocols: Vec::new(),
            };
            snapshot.complete(&permits.classes, snapshot.weights(), waiting, tenants);
            snapshot
        });
        Box::pin(async move { Ok(snapshot) })
    }

    fn evict<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, Error>> {
        let evicted = self.with(|permits, _, _| {
            let member = permits
                .holders
                .keys()
                .find(|member| member.split(':').next() == Some(id))
                .cloned();
            let holding = member.and_then(|member| permits.holders.remove(&member));
            if let Some(holding) = &holding {
                permits.unhold(holding);
            }
            holding.is_some()
        });
        Box::pin(async move { Ok(evicted) })
    }

    fn limit_in_force(&self) -> Option<u32> {
        Some(self.in_force.load(Ordering::Relaxed))
    }

    fn set_limit(&self, limit: u32) -> BoxFuture<'_, Result<(), Error>> {
        self.with(|permits, _, _| {
            if !permits.pinned {
                permits.unpinned = permits.limit;
            }
            permits.limit = limit;
            permits.pinned = true;
        });
        Box::pin(async { Ok(()) })
    }

    fn unset_limit(&self) -> BoxFuture<'_, Result<(), Error>> {
        self.with(|permits, _, _| {
            if permits.pinned {
                permits.limit = permits.unpinned;
                permits.pinned = false;
            }
        });
        Box::pin(async { Ok(()) })
    }
}

impl Refresh for MemorySemaphore {
    fn touch<'a>(
        &'a self,
        members: &'a [Arc<str>],
        _until: Instant,
    ) -> BoxFuture<'a, Result<(Vec<Status>, Duration), Error>> {
        let found = self.with(|permits, now, fence| {
            let statuses = members
                .iter()
                .map(|member| permits.status(member, now, fence))
                .collect();
            (statuses, permits.retry_in(now, KEEPALIVE))
        });
        Box::pin(async move { Ok(found) })
    }
}

// ---- Rate limiters (issue 13): the same GCRA as `lua/gcra.lua`, on this backend's clock. ----

impl RateBackend for MemoryBackend {}

impl OpenRate for MemoryBackend {
    fn open_rate(&self, name: &str, gcra: Gcra) -> Result<OpenedRate, Error> {
        let store = Arc::new(MemoryRate {
            shared: self.shared.clone(),
            name: name.into(),
            gcra,
        });
        Ok(OpenedRate { store })
    }
}

struct MemoryRate {
    shared: Arc<InProcess>,
    name: Arc<str>,
    gcra: Gcra,
}

impl RateStore for MemoryRate {
    fn check<'a>(
        &'a self,
        key: Option<&'a str>,
        n: u32,
    ) -> BoxFuture<'a, Result<RateDecision, Error>> {
        let now = self.shared.server_us(Instant::now());
        let mut cells = lock(&self.shared.rates);
        let decision = match key {
            None => cells.check(&self.name, &self.gcra, now, u64::from(n)),
            Some(part) => {
                let name = format!("{}:{part}", self.name);
                cells.check(&name, &self.gcra, now, u64::from(n))
            }
        };
        drop(cells);
        Box::pin(async move { Ok(decision) })
    }
}
