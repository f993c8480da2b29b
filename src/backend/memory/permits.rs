//! One semaphore's permits in this process, as a plain state machine: the holders and their
//! leases, the line (class by class, highest first, then by arrival; each tenant's later
//! waiters parked behind its head, so tenants are served in turn), the classes' shares (by
//! [`Classes`]) and an adaptive limit's samples (by [`Gradient`]).
//!
//! Nothing here reads a clock, locks, sleeps or talks to anyone: every method that depends on
//! time is told `now`, and the grants a settlement makes are handed back for the caller to
//! announce. (`Instant` is tokio's so that a test's paused clock reaches the backend; it is
//! only ever compared and added to here.)

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::adaptive::Gradient;
use crate::backend::member::Member;
use crate::backend::store::{Attempt, Ending, Mode, Samples};
use crate::class::{Classes, Room};
use crate::snapshot::{Holder, Snapshot};
use crate::waitlist::Status;
use crate::{AdaptiveLimit, Priority};

/// One semaphore's holders and line; dropped by the backend when it is
/// [`forgettable`](Permits::forgettable).
pub(super) struct Permits {
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
    /// The backend's clock: an adaptive limit's samples are timed in ms since this instant.
    epoch: Instant,
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
    /// After the last settlement, by rank, the classes whose oldest waiter (not passed over
    /// for its tenant's cap) still waits: a newcomer of one queues behind it.
    waiting: [bool; 8],
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

/// A grant made by a settlement, to be announced by the caller: member, token and lease
/// deadline.
pub(super) type Grant = (Arc<str>, u64, Instant);

impl Permits {
    /// An empty semaphore admitting by `limit` (adapting within `adaptive` when given), its
    /// classes sharing it as `classes` says; `epoch` is the backend's clock, `now` the time.
    pub(super) fn new(
        limit: u32,
        adaptive: Option<AdaptiveLimit>,
        classes: Classes,
        epoch: Instant,
        now: Instant,
    ) -> Self {
        Permits {
            holders: HashMap::new(),
            used: 0,
            limit,
            pinned: false,
            unpinned: limit,
            gradient: adaptive.map(Gradient::new),
            keep_until: now,
            epoch,
            classes,
            held: [0; 8],
            queue: BTreeMap::new(),
            queued: HashMap::new(),
            arrivals: 0,
            parked: HashMap::new(),
            heads: HashSet::new(),
            tenant_held: HashMap::new(),
            blocked: None,
            waiting: [false; 8],
        }
    }

    /// The limit in force.
    pub(super) fn limit(&self) -> u32 {
        self.limit
    }

    /// The weight held.
    pub(super) fn used(&self) -> u32 {
        self.used
    }

    /// Whether anyone stands in line (a parked waiter has a head in it).
    pub(super) fn crowded(&self) -> bool {
        !self.queue.is_empty()
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

    /// Whether `priority`'s class has a waiter that holds up its newcomers: one passed over
    /// because its tenant holds all it may holds up nobody.
    fn waits_in(&self, priority: Priority) -> bool {
        self.waiting[usize::from(rank(priority))]
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

    /// Drops expired holders (a lease is over at its deadline), then admits waiters: each
    /// class in turn, highest first, in arrival order while its oldest fits. A class whose
    /// oldest waits for the pool holds the lower classes to their reservations; one at its cap
    /// holds up nobody else, and a tenant at its cap is passed over. Each grant is pushed on
    /// `grants`, its token drawn from `fence`. True if it dropped a waiter (see below).
    pub(super) fn settle(
        &mut self,
        now: Instant,
        fence: &mut u64,
        grants: &mut Vec<Grant>,
    ) -> bool {
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
        self.waiting = [false; 8];
        let mut dropped = false;
        let mut from: Place = (0, 0);
        while let Some((&(ranked, _), _)) = self.queue.range(from..).next() {
            let mut cursor = (ranked, 0);
            while let Some((&place, member)) = self.queue.range(cursor..=(ranked, u64::MAX)).next()
            {
                let text = member.text.clone();
                let tenant = member.tenant.is_some();
                if member.weight > self.classes.most(member.priority, tenant, self.limit) {
                    // Heavier than its class (or tenant) may ever hold under the limit now in
                    // force: it would block the line for ever. Dropped; the caller has its
                    // process check its line at once, so it learns and is refused.
                    self.unqueue(&text);
                    dropped = true;
                    continue;
                }
                let room = self.room(member);
                if room == Room::TenantCapped {
                    cursor = (ranked, place.1 + 1);
                    continue;
                }
                if !self.admits(member) {
                    self.waiting[usize::from(ranked)] = true;
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
        dropped
    }

    /// Nothing held, nothing waiting, and nothing to remember: no limit set by an operator, no
    /// adaptive limit learnt recently.
    pub(super) fn forgettable(&self, now: Instant) -> bool {
        self.holders.is_empty()
            && self.queue.is_empty()
            && !self.pinned
            && (self.gradient.is_none() || now >= self.keep_until)
    }

    /// Grants `member` if it fits and nobody of its class waits, else answers as `mode` says:
    /// `Full`, or `None` once it stands in line (`Recheck` first finds a holder and claims it
    /// afresh). A member heavier than its class may ever hold is refused (`TooHeavy`).
    pub(super) fn acquire(
        &mut self,
        member: &Member,
        mode: Mode,
        now: Instant,
        fence: &mut u64,
    ) -> Option<Attempt> {
        if mode == Mode::Recheck
            && let Status::Granted { token, remaining } = self.status(&member.text, now, fence)
        {
            return Some(Attempt::Granted {
                token,
                remaining,
                rate: None,
            });
        }
        let tenant = member.tenant.is_some();
        let most = self.classes.most(member.priority, tenant, self.limit);
        if member.weight > most {
            return Some(Attempt::TooHeavy { limit: most });
        }
        // A head of its tenant in its class waits (passed over for the tenant's cap): the
        // newcomer waits behind it.
        let behind_own_head = (member.tenant)
            .is_some_and(|tenant| self.heads.contains(&(rank(member.priority), tenant)));
        if !self.waits_in(member.priority) && !behind_own_head && self.admits(member) {
            let token = self.hold(member, now, fence);
            return Some(Attempt::Granted {
                token,
                remaining: member.lease,
                rate: None,
            });
        }
        if mode == Mode::Once {
            return Some(Attempt::Full);
        }
        self.enqueue(member);
        None
    }

    /// Removes `member`, holder or waiter (absent: nothing happens). A hold's end is an
    /// adaptive limit's sample: timed from its grant here, except for a prefetched slot, handed out
    /// after its grant (its process's measure, if any: a slot released idle from its pool ends
    /// no hold).
    pub(super) fn release(&mut self, member: &Member, ending: Ending, now: Instant) {
        if let Some(holding) = self.holders.remove(&member.text) {
            let held = if member.prefetched {
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
                self.learn(now, samples);
            }
            self.unhold(&holding);
        } else {
            self.unqueue(&member.text);
        }
    }

    /// Teaches an adaptive limit that is not pinned `samples`, ending at `now`.
    pub(super) fn learn(&mut self, now: Instant, samples: Samples) {
        if let Some(gradient) = self.gradient.as_mut().filter(|_| !self.pinned) {
            let now_ms = now.saturating_duration_since(self.epoch).as_millis() as u64;
            self.limit = gradient.samples(
                now_ms,
                samples.count,
                samples.mean.as_secs_f64() * 1e3,
                self.used,
                samples.overloaded,
            );
        }
    }

    /// Pushes a holder's deadline to a full lease from now; `None` if it no longer holds (an
    /// expired holder is never added back).
    pub(super) fn extend(&mut self, member: &str, now: Instant) -> Option<Duration> {
        let holding = self.holders.get_mut(member)?;
        holding.deadline = holding.deadline.max(now + holding.lease);
        Some(holding.deadline.saturating_duration_since(now))
    }

    /// When the earliest lease ends, from `now`; `fallback` when nothing is held.
    pub(super) fn retry_in(&self, now: Instant, fallback: Duration) -> Duration {
        self.holders
            .values()
            .map(|holding| holding.deadline.saturating_duration_since(now))
            .min()
            .unwrap_or(fallback)
    }

    /// A holder is claimed for a full lease (its process is alive), with a fresh token.
    pub(super) fn status(&mut self, member: &str, now: Instant, fence: &mut u64) -> Status {
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

    /// Removes the holder whose id is `id`; whether it held.
    pub(super) fn evict(&mut self, id: &str) -> bool {
        let member = self
            .holders
            .keys()
            .find(|member| member.split(':').next() == Some(id))
            .cloned();
        let holding = member.and_then(|member| self.holders.remove(&member));
        if let Some(holding) = &holding {
            self.unhold(holding);
        }
        holding.is_some()
    }

    /// An operator's limit: kept while idle, never adapted, until `unset_limit`.
    pub(super) fn set_limit(&mut self, limit: u32) {
        if !self.pinned {
            self.unpinned = self.limit;
        }
        self.limit = limit;
        self.pinned = true;
    }

    /// The limit in force before `set_limit` is back.
    pub(super) fn unset_limit(&mut self) {
        if self.pinned {
            self.limit = self.unpinned;
            self.pinned = false;
        }
    }

    /// The semaphore now, its holders (longest-held first) all named `process`.
    pub(super) fn snapshot(&self, now: Instant, process: &str) -> Snapshot {
        let mut holders: Vec<(Instant, Holder)> = self
            .holders
            .iter()
            .filter_map(|(member, holding)| {
                let holder = Holder::of(
                    member,
                    now.saturating_duration_since(holding.granted),
                    holding.deadline.saturating_duration_since(now),
                    process.to_owned(),
                )?;
                Some((holding.granted, holder))
            })
            .collect();
        holders.sort_by_key(|(granted, _)| *granted);
        let mut waiting = [0u32; 8];
        let mut tenants: HashMap<u64, u32> = HashMap::new();
        for &((ranked, _), tenant) in self.queued.values() {
            // (A parked waiter's rank is `PARKED`, 8, above its class's.)
            let level = usize::from(Priority::MAX - ranked % PARKED);
            waiting[level] += 1;
            if let Some(tenant) = tenant {
                *tenants.entry(tenant).or_default() += 1;
            }
        }
        let mut snapshot = Snapshot {
            limit: self.limit,
            used: self.used,
            waiting: u32::try_from(self.queued.len()).unwrap_or(u32::MAX),
            pinned: self.pinned,
            holders: holders.into_iter().map(|(_, holder)| holder).collect(),
            classes: Vec::new(),
            tenants_waiting: Vec::new(),
            protocols: Vec::new(),
        };
        snapshot.complete(&self.classes, snapshot.weights(), waiting, tenants);
        snapshot
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Ask, Share};

    const LEASE: Duration = Duration::from_secs(10);

    fn member(ask: Ask) -> Member {
        Member::asking(&ask, LEASE, false)
    }

    /// The texts of `members`, as grants name them.
    fn texts(members: &[&Member]) -> Vec<Arc<str>> {
        members.iter().map(|member| member.text.clone()).collect()
    }

    fn weighing(weight: u32) -> Member {
        member(Ask::new().weight(weight))
    }

    /// A semaphore and the fencing counter, called as the backend calls them: a settlement
    /// before and after each operation, at a time the test sets.
    struct Machine {
        permits: Permits,
        fence: u64,
        now: Instant,
    }

    impl Machine {
        fn new(limit: u32, classes: Classes) -> Self {
            let now = Instant::now();
            Machine {
                permits: Permits::new(limit, None, classes, now, now),
                fence: 0,
                now,
            }
        }

        /// Runs `op` at `now` between two settlements; the members granted from the line.
        fn call<R>(
            &mut self,
            op: impl FnOnce(&mut Permits, Instant, &mut u64) -> R,
        ) -> (R, Vec<Arc<str>>) {
            let mut grants = Vec::new();
            self.permits.settle(self.now, &mut self.fence, &mut grants);
            let result = op(&mut self.permits, self.now, &mut self.fence);
            self.permits.settle(self.now, &mut self.fence, &mut grants);
            (
                result,
                grants.into_iter().map(|(member, _, _)| member).collect(),
            )
        }

        fn acquire(&mut self, member: &Member, mode: Mode) -> Option<Attempt> {
            self.call(|permits, now, fence| permits.acquire(member, mode, now, fence))
                .0
        }

        fn release(&mut self, member: &Member) -> Vec<Arc<str>> {
            let ending = Ending::default();
            self.call(|permits, now, _| permits.release(member, ending, now))
                .1
        }

        fn status(&mut self, member: &Member) -> Status {
            self.call(|permits, now, fence| permits.status(&member.text, now, fence))
                .0
        }

        fn granted(&mut self, member: &Member) -> bool {
            matches!(
                self.acquire(member, Mode::Join),
                Some(Attempt::Granted { .. })
            )
        }
    }

    #[test]
    fn a_member_that_fits_is_granted_with_a_fresh_token() {
        let mut machine = Machine::new(2, Classes::default());
        let (a, b) = (weighing(1), weighing(1));
        assert_eq!(
            machine.acquire(&a, Mode::Join),
            Some(Attempt::Granted {
                token: 1,
                remaining: LEASE,
                rate: None
            })
        );
        assert_eq!(
            machine.acquire(&b, Mode::Once),
            Some(Attempt::Granted {
                token: 2,
                remaining: LEASE,
                rate: None
            })
        );
        assert_eq!(machine.permits.used(), 2);
        assert!(!machine.permits.crowded());
    }

    #[test]
    fn a_member_that_does_not_fit_queues_or_is_told_full() {
        let mut machine = Machine::new(1, Classes::default());
        let (a, b, c) = (weighing(1), weighing(1), weighing(1));
        assert!(machine.granted(&a));
        assert_eq!(machine.acquire(&b, Mode::Once), Some(Attempt::Full));
        assert_eq!(machine.status(&b), Status::Unknown);
        assert_eq!(machine.acquire(&c, Mode::Join), None);
        assert_eq!(machine.status(&c), Status::Queued);
        assert!(machine.permits.crowded());
        assert_eq!(machine.permits.snapshot(machine.now, "here").waiting, 1);
    }

    #[test]
    fn a_class_is_served_in_arrival_order() {
        let mut machine = Machine::new(3, Classes::default());
        let (a, b, c) = (weighing(2), weighing(2), weighing(1));
        assert!(machine.granted(&a));
        assert_eq!(machine.acquire(&b, Mode::Join), None);
        // `c` would fit, but `b` came first.
        assert_eq!(machine.acquire(&c, Mode::Join), None);
        assert_eq!(
            machine.acquire(&weighing(1), Mode::Once),
            Some(Attempt::Full)
        );
        assert_eq!(machine.release(&a), texts(&[&b, &c]));
        assert_eq!(machine.permits.used(), 3);
        assert!(!machine.permits.crowded());
    }

    #[test]
    fn a_higher_class_is_served_first() {
        let mut machine = Machine::new(1, Classes::default());
        let a = weighing(1);
        let normal = weighing(1);
        let batch = member(Ask::new().priority(Priority::BATCH));
        let critical = member(Ask::new().priority(Priority::CRITICAL));
        assert!(machine.granted(&a));
        for waiter in [&batch, &normal, &critical] {
            assert_eq!(machine.acquire(waiter, Mode::Join), None);
        }
        assert_eq!(machine.release(&a), texts(&[&critical]));
        assert_eq!(machine.release(&critical), texts(&[&normal]));
        assert_eq!(machine.release(&normal), texts(&[&batch]));
    }

    #[test]
    fn a_reservation_is_kept_for_its_class() {
        let mut classes = Classes::default();
        classes.set(Priority::CRITICAL, Share::reserved(1));
        let mut machine = Machine::new(3, classes);
        assert!(machine.granted(&weighing(1)));
        assert!(machine.granted(&weighing(1)));
        // One permit is free, but it is the critical class's.
        assert_eq!(
            machine.acquire(&weighing(1), Mode::Once),
            Some(Attempt::Full)
        );
        assert_eq!(
            machine.acquire(&weighing(3), Mode::Join),
            Some(Attempt::TooHeavy { limit: 2 })
        );
        let critical = member(Ask::new().priority(Priority::CRITICAL));
        assert!(machine.granted(&critical));
        assert_eq!(machine.permits.used(), 3);
    }

    #[test]
    fn a_tenant_at_its_cap_waits_and_holds_up_nobody() {
        let mut classes = Classes::default();
        classes.set_tenant(Share::at_most(1));
        let mut machine = Machine::new(5, classes);
        let (a, b) = (
            member(Ask::new().tenant("acme")),
            member(Ask::new().tenant("acme")),
        );
        let other = member(Ask::new().tenant("other"));
        assert!(machine.granted(&a));
        assert_eq!(machine.acquire(&b, Mode::Join), None);
        // `b`, passed over for its tenant's cap, holds up no newcomer of its class: `other`
        // is granted at once, even by a try (as the script decides it).
        assert!(matches!(
            machine.acquire(&other, Mode::Once),
            Some(Attempt::Granted { .. })
        ));
        assert_eq!(machine.status(&b), Status::Queued);
        assert_eq!(machine.release(&a), texts(&[&b]));
        let snapshot = machine.permits.snapshot(machine.now, "here");
        assert_eq!((snapshot.used, snapshot.waiting), (2, 0));
    }

    #[test]
    fn a_lease_frees_its_permits_at_its_deadline_and_not_before() {
        let mut machine = Machine::new(1, Classes::default());
        let (a, b) = (weighing(1), weighing(1));
        let start = machine.now;
        assert!(machine.granted(&a));
        assert_eq!(machine.acquire(&b, Mode::Join), None);
        machine.now = start + LEASE - Duration::from_nanos(1);
        assert_eq!(machine.call(|_, _, _| ()).1, Vec::<Arc<str>>::new());
        assert_eq!(machine.permits.used(), 1);
        assert_eq!(
            machine.permits.retry_in(machine.now, LEASE),
            Duration::from_nanos(1)
        );
        machine.now = start + LEASE;
        assert_eq!(machine.call(|_, _, _| ()).1, texts(&[&b]));
        assert_eq!(machine.status(&a), Status::Unknown);
        assert_eq!(machine.permits.used(), 1);
    }

    #[test]
    fn a_release_is_idempotent() {
        let mut machine = Machine::new(1, Classes::default());
        let (a, b) = (weighing(1), weighing(1));
        assert!(machine.granted(&a));
        assert_eq!(machine.acquire(&b, Mode::Join), None);
        assert_eq!(machine.release(&a), texts(&[&b]));
        assert_eq!(machine.release(&a), Vec::<Arc<str>>::new());
        assert_eq!(machine.permits.used(), 1);
        assert!(matches!(machine.status(&b), Status::Granted { .. }));
        machine.release(&b);
        machine.release(&b);
        assert_eq!(machine.permits.used(), 0);
        assert!(machine.permits.forgettable(machine.now));
    }

    #[test]
    fn a_renewal_extends_a_holder_and_never_brings_back_an_expired_one() {
        let mut machine = Machine::new(1, Classes::default());
        let a = weighing(1);
        let start = machine.now;
        assert!(machine.granted(&a));
        machine.now = start + LEASE / 2;
        let renewed = machine
            .call(|permits, now, _| permits.extend(&a.text, now))
            .0;
        assert_eq!(renewed, Some(LEASE));
        machine.now = start + LEASE;
        assert_eq!(machine.call(|permits, _, _| permits.used()).0, 1);
        machine.now = start + LEASE / 2 + LEASE;
        let renewed = machine
            .call(|permits, now, _| permits.extend(&a.text, now))
            .0;
        assert_eq!(renewed, None);
        assert_eq!(machine.permits.used(), 0);
        assert_eq!(machine.status(&a), Status::Unknown);
    }

    #[test]
    fn weights_add_up_to_the_limit() {
        let mut machine = Machine::new(5, Classes::default());
        let (a, b, c) = (weighing(3), weighing(3), weighing(2));
        assert_eq!(
            machine.acquire(&weighing(6), Mode::Join),
            Some(Attempt::TooHeavy { limit: 5 })
        );
        assert!(machine.granted(&a));
        assert_eq!(machine.acquire(&b, Mode::Join), None);
        assert_eq!(machine.acquire(&c, Mode::Join), None);
        assert_eq!(machine.release(&a), texts(&[&b, &c]));
        assert_eq!(machine.permits.used(), 5);
        let snapshot = machine.permits.snapshot(machine.now, "here");
        let weights: Vec<u32> = snapshot
            .holders
            .iter()
            .map(|holder| holder.weight)
            .collect();
        assert_eq!(weights.iter().sum::<u32>(), 5);
        assert!(
            snapshot
                .holders
                .iter()
                .all(|holder| holder.process == "here")
        );
    }
}
