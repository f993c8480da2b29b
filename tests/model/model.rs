//! The semaphore's protocol at the grain of its script calls, each one atomic step, for
//! stateright to explore. What one call does mirrors `src/backend/lua/semaphore/` in the
//! order its parts run: expired holders swept (a provisional grant that ran out unclaimed marks
//! its process silent), gone waiters dropped, releases applied, the line served class by class
//! (`line.lua`, `classes.lua`, `tenants.lua`), then the call's own operation (`ops.lua`).
//! Processes hold beliefs: what they would act on, with the local deadline the crate computes.

use std::fmt;

use stateright::{Model, Property};

/// Time in ticks of the model's clock; one tick is `Config::tick_us` of the server's clock.
pub type Time = u32;

/// The design a run checks: the crate's own, or one that fails (each a counterexample).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Design {
    /// This crate: a reply's lease counts from the call's send (`sent + left`), an announced
    /// grant is believed only once a touch of its own claims it.
    Crate,
    /// npm redis-semaphore: the lease counts from when the client got the reply.
    ClientClock,
    /// This crate's bug of turn 2: an announced grant believed for a full lease from when its
    /// process learned of it, though the server holds it only for the claim window.
    LearnTime,
    /// Redlock over a semaphore: each of three nodes keeps its own slot set, a permit is a
    /// majority of nodes that had room (madelson's A/B/C example).
    Redlock,
    /// The reservation rule with its class check dropped: what any class holds counts toward
    /// the slots a class reserves.
    ReservationWithoutClassCheck,
}

/// What a run explores. Every feature is a switch, so tests choose their combinations.
#[derive(Clone, Debug)]
pub struct Config {
    pub procs: u8,
    /// The limit every process is configured with.
    pub limit: u8,
    /// The limits an operator may pin with `set_limit` (none: no operator).
    pub pins: Vec<u8>,
    pub weights: Vec<u8>,
    pub lease: Time,
    /// The claim window: a grant to a waiter is provisional for `min(claim, lease / 2)`.
    pub claim: Time,
    /// How long a waiter stays in line without its process showing it still waits.
    pub patience: Time,
    /// The clock stops here: the bound that keeps the state space finite.
    pub max_time: Time,
    /// At most this many members are ever made (each acquire makes one).
    pub max_members: u8,
    /// Waiting acquires (and so the line, touches, cancels) besides `try_acquire`.
    pub waiting: bool,
    pub freezes: u8,
    pub crashes: u8,
    /// Empty restarts of Redis.
    pub restarts: u8,
    /// Two classes (CRITICAL and NORMAL), each reserving `reserve[class]`.
    pub classes: bool,
    pub reserve: [u8; 2],
    /// Two tenants; with `tenant_cap`, each holds at most that.
    pub tenants: bool,
    pub tenant_cap: Option<u8>,
    /// A prefetch pool of one weight-1 slot per process.
    pub prefetch: bool,
    pub design: Design,
    /// Explore only the states within this many steps of the start (bounded model checking),
    /// where the whole space is too large.
    pub depth: Option<usize>,
    /// Microseconds of the server's clock per tick (fencing tokens read the clock in µs).
    pub tick_us: u64,
}

impl Config {
    /// The configuration CI checks: 3 processes, limit 2, weights 1 and 2, both classes (the
    /// higher reserving 1), a pinned limit, a freeze, a crash and an empty restart.
    pub fn ci() -> Config {
        Config {
            procs: 3,
            limit: 2,
            pins: vec![1],
            weights: vec![1, 2],
            lease: 3,
            claim: 1,
            patience: 2,
            max_time: 4,
            max_members: 4,
            waiting: true,
            freezes: 1,
            crashes: 1,
            restarts: 1,
            classes: true,
            reserve: [1, 0],
            tenants: false,
            tenant_cap: None,
            prefetch: false,
            design: Design::Crate,
            depth: Some(8),
            tick_us: 1_000,
        }
    }

    /// Only the switches named after it turned on: a base for the feature tests.
    pub fn bare(procs: u8, limit: u8) -> Config {
        Config {
            procs,
            limit,
            pins: vec![],
            weights: vec![1],
            lease: 3,
            claim: 1,
            patience: 2,
            max_time: 6,
            max_members: 4,
            waiting: false,
            freezes: 0,
            crashes: 0,
            restarts: 0,
            classes: false,
            reserve: [0, 0],
            tenants: false,
            tenant_cap: None,
            prefetch: false,
            design: Design::Crate,
            depth: None,
            tick_us: 1_000,
        }
    }

    fn shares(&self) -> bool {
        self.classes || self.tenant_cap.is_some()
    }

    fn class_list(&self) -> &'static [u8] {
        if self.classes { &[HIGH, LOW] } else { &[LOW] }
    }

    fn tenant_list(&self) -> &'static [Option<u8>] {
        if self.tenants {
            &[Some(0), Some(1)]
        } else {
            &[None]
        }
    }

    /// How long a grant to a waiter stays provisional (`line.lua`'s `term`).
    pub fn term(&self) -> Time {
        self.claim.min((self.lease / 2).max(1))
    }

    pub fn reserved(&self, class: u8) -> u8 {
        if self.classes {
            self.reserve[usize::from(class)]
        } else {
            0
        }
    }
}

/// Class 0 is CRITICAL (served first), class 1 NORMAL; a class's index is its rank.
pub const HIGH: u8 = 0;
pub const LOW: u8 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Holder {
    pub id: u8,
    pub proc: u8,
    pub weight: u8,
    pub class: u8,
    pub tenant: Option<u8>,
    pub deadline: Time,
    /// Granted to a waiter and not claimed yet.
    pub provisional: bool,
    pub token: u64,
    pub pooled: bool,
    /// The limit in force when it was granted (lowering the limit takes nothing back).
    pub limit_at_grant: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Waiter {
    pub id: u8,
    pub proc: u8,
    pub weight: u8,
    pub class: u8,
    pub tenant: Option<u8>,
    /// Its place in its class's line (a parked waiter gets a new one when promoted).
    pub arrival: u16,
    /// When it first queued: the order the FIFO invariant judges by.
    pub since: u16,
    /// By when its process must show it still waits.
    pub alive: Time,
    /// A tenant's later waiter, kept out of the line behind its tenant's head.
    pub parked: bool,
}

/// What Redis keeps for one semaphore.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Server {
    pub holders: Vec<Holder>,
    pub queue: Vec<Waiter>,
    pub fence: u64,
    pub limit: u8,
    pub pinned: bool,
    /// Per process: since when it is silent (a grant to it ran out unclaimed).
    pub silent: Vec<Option<Time>>,
}

impl Server {
    fn empty(config: &Config) -> Server {
        Server {
            holders: vec![],
            queue: vec![],
            fence: 0,
            limit: config.limit,
            pinned: false,
            silent: vec![None; usize::from(config.procs)],
        }
    }

    pub fn used(&self) -> u32 {
        self.holders.iter().map(|h| u32::from(h.weight)).sum()
    }

    fn held_by_class(&self, class: u8) -> u32 {
        (self.holders.iter())
            .filter(|h| h.class == class)
            .map(|h| u32::from(h.weight))
            .sum()
    }

    fn held_by_tenant(&self, tenant: u8) -> u32 {
        (self.holders.iter())
            .filter(|h| h.tenant == Some(tenant))
            .map(|h| u32::from(h.weight))
            .sum()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Run {
    Running,
    /// Time passes, it does not act (a GC pause, SIGSTOP).
    Frozen,
    Crashed,
}

/// A permit as its process believes it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Belief {
    pub id: u8,
    pub weight: u8,
    pub class: u8,
    pub tenant: Option<u8>,
    pub token: u64,
    /// The local deadline the process computed.
    pub deadline: Time,
    /// A renewal found it gone.
    pub lost: bool,
    /// The server's incarnation that granted it (bumped by an empty restart).
    pub epoch: u8,
    /// The limit in force when it was granted.
    pub limit_at_grant: u8,
    pub pooled: bool,
}

/// A waiting acquire, as its process knows it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Waiting {
    pub id: u8,
    pub weight: u8,
    pub class: u8,
    pub tenant: Option<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Proc {
    pub run: Run,
    pub permits: Vec<Belief>,
    pub waiting: Option<Waiting>,
    /// A grant reply not read yet: the belief it makes, its deadline still as the server
    /// timed it (`sent + left`).
    pub reply: Option<Belief>,
    /// A grant announced to it: member, token, deadline on the server's clock.
    pub announced: Option<(u8, u64, Time)>,
    pub last_call: Time,
    /// Redlock: the nodes whose slot it holds.
    pub nodes: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub now: Time,
    pub epoch: u8,
    pub server: Server,
    pub procs: Vec<Proc>,
    pub next_id: u8,
    pub freezes_left: u8,
    pub crashes_left: u8,
    pub restarts_left: u8,
    /// The highest token issued so far (any incarnation).
    pub max_token: u64,
    /// History: a token was issued not above an earlier one.
    pub token_regressed: bool,
    /// History: a grant overtook an earlier waiter of its class and tenant.
    pub overtaken: bool,
    /// The last step was a script call (the line has run since anything changed).
    pub settled: bool,
    /// Redlock: per node, the processes holding one of its slots.
    pub nodes: Vec<Vec<u8>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The server's clock advances one tick (processes' clocks with it).
    Tick,
    /// An operator pins the limit (`set_limit`), or unpins it (`unset_limit`).
    Pin(u8),
    Unpin,
    /// Redis restarts empty.
    Restart,
    /// `try_acquire_with`: granted at once or refused.
    Try {
        p: u8,
        weight: u8,
        class: u8,
        tenant: Option<u8>,
    },
    /// `acquire_with`: granted at once, or queued.
    Wait {
        p: u8,
        weight: u8,
        class: u8,
        tenant: Option<u8>,
    },
    /// The process reads a grant reply.
    Receive(u8),
    /// The keeper renews every permit of the process.
    Renew(u8),
    Release {
        p: u8,
        id: u8,
    },
    /// The waiting acquire is dropped (its member released).
    Cancel(u8),
    /// The waiter's touch: keeps it in line, or claims its grant.
    Touch(u8),
    /// A grant announcement reaches the process.
    Learn(u8),
    Freeze(u8),
    Thaw(u8),
    Crash(u8),
    /// The prefetch pool takes a weight-1 slot while nobody waits.
    Prefetch(u8),
    /// The pool gives its slot back: someone waits.
    GiveBack(u8),
    /// Redlock: take a slot on one node.
    Take {
        p: u8,
        node: u8,
    },
}

/// The checked model: a configuration.
#[derive(Clone, Debug)]
pub struct Semaphore {
    pub config: Config,
}

/// What the line and the acquire of one call decided, for the operation after it.
struct Served {
    waits_in: [bool; 2],
    blocked: Option<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Room {
    Fits,
    Tenant,
    Full,
}

impl Semaphore {
    pub fn new(config: Config) -> Semaphore {
        Semaphore { config }
    }

    fn most(&self, s: &Server, class: u8, tenant: Option<u8>) -> u32 {
        let c = &self.config;
        if !c.shares() {
            return u32::from(s.limit);
        }
        let others: u32 = (c.class_list().iter())
            .filter(|&&o| o != class)
            .map(|&o| u32::from(c.reserved(o)))
            .sum();
        let mut most = u32::from(s.limit).saturating_sub(others);
        if let (Some(_), Some(cap)) = (tenant, c.tenant_cap) {
            most = most.min(u32::from(cap));
        }
        most
    }

    fn room(&self, s: &Server, class: u8, weight: u8, tenant: Option<u8>) -> Room {
        let c = &self.config;
        let weight = u32::from(weight);
        if !c.shares() {
            return if s.used() + weight > u32::from(s.limit) {
                Room::Full
            } else {
                Room::Fits
            };
        }
        if let (Some(t), Some(cap)) = (tenant, c.tenant_cap)
            && s.held_by_tenant(t) + weight > u32::from(cap)
        {
            return Room::Tenant;
        }
        let kept: u32 = (c.class_list().iter())
            .filter(|&&o| o != class)
            .map(|&o| {
                let held = if c.design == Design::ReservationWithoutClassCheck {
                    s.used()
                } else {
                    s.held_by_class(o)
                };
                u32::from(c.reserved(o)).saturating_sub(held)
            })
            .sum();
        if s.used() + weight + kept > u32::from(s.limit) {
            Room::Full
        } else {
            Room::Fits
        }
    }

    fn admits(
        &self,
        s: &Server,
        class: u8,
        weight: u8,
        tenant: Option<u8>,
        blocked: Option<u8>,
    ) -> bool {
        if self.room(s, class, weight, tenant) != Room::Fits {
            return false;
        }
        match blocked {
            Some(rank) if rank < class => {
                let reserved = u32::from(self.config.reserved(class));
                reserved > 0 && s.held_by_class(class) + u32::from(weight) <= reserved
            }
            _ => true,
        }
    }

    fn silent(&self, state: &State, proc: u8) -> bool {
        state.server.silent[usize::from(proc)]
            .is_some_and(|since| state.now < since + self.config.patience)
    }

    /// A fencing token: `max(last + 1, server µs)`; records any regression.
    fn token(&self, state: &mut State) -> u64 {
        let token = (state.server.fence + 1).max(u64::from(state.now) * self.config.tick_us);
        state.server.fence = token;
        if token <= state.max_token {
            state.token_regressed = true;
        }
        state.max_token = state.max_token.max(token);
        token
    }

    /// Records an overtaking: `member` granted while an earlier waiter of its class and
    /// tenant, of a process not passed over, still waits.
    fn check_order(&self, state: &mut State, id: u8, class: u8, tenant: Option<u8>, since: u16) {
        let overtaken = state.server.queue.iter().any(|w| {
            w.id != id
                && w.class == class
                && w.tenant == tenant
                && w.since < since
                && !self.silent(state, w.proc)
        });
        state.overtaken |= overtaken;
    }

    fn next_arrival(s: &Server) -> u16 {
        s.queue.iter().map(|w| w.arrival + 1).max().unwrap_or(0)
    }

    fn next_since(s: &Server) -> u16 {
        s.queue.iter().map(|w| w.since + 1).max().unwrap_or(0)
    }

    /// Takes a waiter out of the line; its tenant's oldest parked waiter (of its class) then
    /// joins the line at the back (`tenants.lua`'s `promote`).
    fn unqueue(&self, state: &mut State, id: u8) -> Option<Waiter> {
        let at = state.server.queue.iter().position(|w| w.id == id)?;
        let gone = state.server.queue.remove(at);
        if let (Some(t), false) = (gone.tenant, gone.parked) {
            let now = state.now;
            loop {
                let next = (state.server.queue.iter().enumerate())
                    .filter(|(_, w)| w.parked && w.tenant == Some(t) && w.class == gone.class)
                    .min_by_key(|(_, w)| w.arrival)
                    .map(|(at, _)| at);
                let Some(next) = next else { break };
                if state.server.queue[next].alive > now {
                    let arrival = Self::next_arrival(&state.server);
                    let promoted = &mut state.server.queue[next];
                    promoted.parked = false;
                    promoted.arrival = arrival;
                    break;
                }
                state.server.queue.remove(next);
            }
        }
        Some(gone)
    }

    /// Serves the line, class by class (`line.lua`'s `step_line`).
    fn serve(&self, state: &mut State) -> Served {
        let c = &self.config;
        let mut served = Served {
            waits_in: [false; 2],
            blocked: None,
        };
        for &class in c.class_list() {
            let mut passed: Vec<u8> = vec![];
            loop {
                let head = (state.server.queue.iter())
                    .filter(|w| w.class == class && !w.parked && !passed.contains(&w.id))
                    .filter(|w| !self.silent(state, w.proc))
                    .min_by_key(|w| w.arrival)
                    .cloned();
                let Some(w) = head else { break };
                if u32::from(w.weight) > self.most(&state.server, class, w.tenant) {
                    self.unqueue(state, w.id);
                    continue;
                }
                let fit = self.room(&state.server, class, w.weight, w.tenant);
                if fit == Room::Tenant {
                    passed.push(w.id);
                    continue;
                }
                if !self.admits(&state.server, class, w.weight, w.tenant, served.blocked) {
                    served.waits_in[usize::from(class)] = true;
                    served.blocked = served.blocked.or(Some(class));
                    break;
                }
                self.check_order(state, w.id, class, w.tenant, w.since);
                self.unqueue(state, w.id);
                let token = self.token(state);
                let deadline = state.now + c.term();
                state.server.holders.push(Holder {
                    id: w.id,
                    proc: w.proc,
                    weight: w.weight,
                    class,
                    tenant: w.tenant,
                    deadline,
                    provisional: true,
                    token,
                    pooled: false,
                    limit_at_grant: state.server.limit,
                });
                state.procs[usize::from(w.proc)].announced = Some((w.id, token, deadline));
            }
            if served.blocked.is_some() && !c.shares() {
                break;
            }
        }
        served
    }

    /// Serves the line once more as the next call would, with no time passed (the `served`
    /// invariant: nothing is left to admit).
    pub fn serve_again(&self, state: &mut State) {
        self.serve(state);
    }

    /// The start of every script call: sweep, releases, the line.
    fn call(&self, state: &mut State, caller: Option<u8>, releases: &[u8]) -> Served {
        let now = state.now;
        let mut kept = vec![];
        for h in std::mem::take(&mut state.server.holders) {
            if h.deadline > now {
                kept.push(h);
            } else if h.provisional {
                state.server.silent[usize::from(h.proc)] = Some(now);
            }
        }
        state.server.holders = kept;
        let gone: Vec<u8> = (state.server.queue.iter())
            .filter(|w| w.alive <= now)
            .map(|w| w.id)
            .collect();
        for id in gone {
            self.unqueue(state, id);
        }
        if let Some(p) = caller {
            state.server.silent[usize::from(p)] = None;
            state.procs[usize::from(p)].last_call = now;
        }
        for &id in releases {
            state.server.holders.retain(|h| h.id != id);
            self.unqueue(state, id);
        }
        self.serve(state)
    }

    /// An acquire's own decision, after the line (`ops.lua`): granted, queued, or refused.
    fn acquire(&self, state: &mut State, p: u8, member: Waiting, join: bool, pooled: bool) {
        let served = self.call(state, Some(p), &[]);
        let Waiting {
            id,
            weight,
            class,
            tenant,
        } = member;
        if u32::from(weight) > self.most(&state.server, class, tenant) {
            return;
        }
        // A head of its tenant in its class passed over for the tenant's cap: the newcomer
        // waits behind it (`line.lua`'s `behind_own_head`), unless its process is passed over
        // as silent.
        let behind_own_head = tenant.is_some()
            && (state.server.queue.iter()).any(|w| {
                !w.parked && w.class == class && w.tenant == tenant && !self.silent(state, w.proc)
            });
        if !served.waits_in[usize::from(class)]
            && !behind_own_head
            && self.admits(&state.server, class, weight, tenant, served.blocked)
        {
            self.check_order(state, id, class, tenant, u16::MAX);
            let token = self.token(state);
            let deadline = state.now + self.config.lease;
            state.server.holders.push(Holder {
                id,
                proc: p,
                weight,
                class,
                tenant,
                deadline,
                provisional: false,
                token,
                pooled,
                limit_at_grant: state.server.limit,
            });
            state.procs[usize::from(p)].reply = Some(Belief {
                id,
                weight,
                class,
                tenant,
                token,
                deadline,
                lost: false,
                epoch: state.epoch,
                limit_at_grant: state.server.limit,
                pooled,
            });
            // The grant may leave a head that held up a class passed over for its tenant's
            // cap, with room behind it: the line is served again (`ops.lua` does only when that
            // tenant's head held up a class, the one case it can admit anyone more).
            if tenant.is_some()
                && self.config.tenant_cap.is_some()
                && !state.server.queue.is_empty()
            {
                self.serve(state);
            }
        } else if join {
            let standing = tenant.is_some()
                && state
                    .server
                    .queue
                    .iter()
                    .any(|w| !w.parked && w.class == class && w.tenant == tenant);
            let waiter = Waiter {
                id,
                proc: p,
                weight,
                class,
                tenant,
                arrival: Self::next_arrival(&state.server),
                since: Self::next_since(&state.server),
                alive: state.now + self.config.patience,
                parked: standing,
            };
            state.server.queue.push(waiter);
            state.procs[usize::from(p)].waiting = Some(member);
        }
    }

    /// A touch of the process's waiter (`line.lua`'s `status`): a grant is claimed for a full
    /// lease with a fresh token; a waiter still in line is kept; one the server forgot joins
    /// again (the client's `recheck`).
    fn touch(&self, state: &mut State, p: u8) {
        let Some(member) = state.procs[usize::from(p)].waiting.clone() else {
            return;
        };
        let held_before = state.server.holders.iter().any(|h| h.id == member.id);
        self.call(state, Some(p), &[]);
        let now = state.now;
        let lease = self.config.lease;
        if let Some(at) = state.server.holders.iter().position(|h| h.id == member.id) {
            // Granted by this very call: its token stands; claimed later: a fresh one.
            let token = if held_before {
                self.token(state)
            } else {
                state.server.holders[at].token
            };
            let holder = &mut state.server.holders[at];
            holder.deadline = now + lease;
            holder.provisional = false;
            holder.token = token;
            let limit = holder.limit_at_grant;
            let epoch = state.epoch;
            let proc = &mut state.procs[usize::from(p)];
            proc.waiting = None;
            proc.announced = None;
            proc.permits.push(Belief {
                id: member.id,
                weight: member.weight,
                class: member.class,
                tenant: member.tenant,
                token,
                deadline: now + lease,
                lost: false,
                epoch,
                limit_at_grant: limit,
                pooled: false,
            });
        } else if let Some(w) = state.server.queue.iter_mut().find(|w| w.id == member.id) {
            w.alive = now + self.config.patience;
        } else {
            state.procs[usize::from(p)].waiting = None;
            state.procs[usize::from(p)].announced = None;
            self.acquire(state, p, member, true, false);
        }
    }

    fn renew(&self, state: &mut State, p: u8) {
        self.call(state, Some(p), &[]);
        let now = state.now;
        let lease = self.config.lease;
        let ids: Vec<u8> = (state.procs[usize::from(p)].permits.iter())
            .map(|b| b.id)
            .collect();
        for id in ids {
            let held = state.server.holders.iter_mut().find(|h| h.id == id);
            let belief = (state.procs[usize::from(p)].permits.iter_mut())
                .find(|b| b.id == id)
                .expect("the id came from this list");
            match held {
                Some(holder) => {
                    holder.deadline = now + lease;
                    holder.provisional = false;
                    belief.deadline = now + lease;
                }
                None => belief.lost = true,
            }
        }
    }

    fn new_member(state: &mut State, weight: u8, class: u8, tenant: Option<u8>) -> Waiting {
        let id = state.next_id;
        state.next_id += 1;
        Waiting {
            id,
            weight,
            class,
            tenant,
        }
    }

    /// Whether a belief counts: live by its local deadline, not found lost, its process alive.
    pub fn believed<'a>(&self, state: &'a State) -> impl Iterator<Item = &'a Belief> + 'a {
        let now = state.now;
        (state.procs.iter())
            .filter(|p| p.run != Run::Crashed)
            .flat_map(|p| p.permits.iter())
            .filter(move |b| !b.lost && b.deadline > now)
    }

    /// Redlock: a process believes a permit once it holds a majority of the nodes.
    pub fn redlock_believers(state: &State) -> usize {
        state.procs.iter().filter(|p| p.nodes.len() >= 2).count()
    }

    fn actions_of(&self, state: &State, p: u8, actions: &mut Vec<Action>) {
        let c = &self.config;
        let proc = &state.procs[usize::from(p)];
        match proc.run {
            Run::Crashed => return,
            Run::Frozen => {
                actions.push(Action::Thaw(p));
                return;
            }
            Run::Running => {}
        }
        if c.design == Design::Redlock {
            if proc.nodes.len() < 2 {
                for node in 0..3u8 {
                    let room = state.nodes[usize::from(node)].len() < usize::from(c.limit);
                    if room && !proc.nodes.contains(&node) {
                        actions.push(Action::Take { p, node });
                    }
                }
            }
            return;
        }
        if c.freezes > 0 && state.freezes_left > 0 {
            actions.push(Action::Freeze(p));
        }
        if c.crashes > 0 && state.crashes_left > 0 {
            actions.push(Action::Crash(p));
        }
        if proc.reply.is_some() {
            // The process reads its reply before its next call.
            actions.push(Action::Receive(p));
            return;
        }
        let members_left = state.next_id < c.max_members;
        for &weight in &c.weights {
            for &class in c.class_list() {
                for &tenant in c.tenant_list() {
                    if members_left {
                        actions.push(Action::Try {
                            p,
                            weight,
                            class,
                            tenant,
                        });
                    }
                    if members_left && c.waiting && proc.waiting.is_none() {
                        actions.push(Action::Wait {
                            p,
                            weight,
                            class,
                            tenant,
                        });
                    }
                }
            }
        }
        if !proc.permits.is_empty() {
            actions.push(Action::Renew(p));
        }
        for b in &proc.permits {
            actions.push(Action::Release { p, id: b.id });
        }
        if proc.waiting.is_some() {
            actions.push(Action::Cancel(p));
            actions.push(Action::Touch(p));
        }
        let announced = proc.announced.map(|(id, _, _)| id);
        if announced.is_some() && announced == proc.waiting.as_ref().map(|w| w.id) {
            actions.push(Action::Learn(p));
        }
        if c.prefetch {
            let pooled = proc.permits.iter().any(|b| b.pooled);
            if !pooled && members_left && state.server.queue.is_empty() {
                actions.push(Action::Prefetch(p));
            }
            if pooled && !state.server.queue.is_empty() {
                actions.push(Action::GiveBack(p));
            }
        }
    }
}

impl Model for Semaphore {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let c = &self.config;
        let proc = Proc {
            run: Run::Running,
            permits: vec![],
            waiting: None,
            reply: None,
            announced: None,
            last_call: 1,
            nodes: vec![],
        };
        vec![State {
            now: 1,
            epoch: 0,
            server: Server::empty(c),
            procs: vec![proc; usize::from(c.procs)],
            next_id: 0,
            freezes_left: c.freezes,
            crashes_left: c.crashes,
            restarts_left: c.restarts,
            max_token: 0,
            token_regressed: false,
            overtaken: false,
            settled: true,
            nodes: vec![vec![]; 3],
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        let c = &self.config;
        if state.now < c.max_time {
            actions.push(Action::Tick);
        }
        for &pin in &c.pins {
            if !(state.server.pinned && state.server.limit == pin) {
                actions.push(Action::Pin(pin));
            }
        }
        if state.server.pinned {
            actions.push(Action::Unpin);
        }
        if state.restarts_left > 0 && state.now < c.max_time {
            actions.push(Action::Restart);
        }
        for p in 0..c.procs {
            self.actions_of(state, p, actions);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let c = &self.config;
        let mut state = last.clone();
        state.settled = true;
        match action {
            Action::Tick => {
                state.now += 1;
                state.settled = false;
            }
            Action::Pin(limit) => {
                state.server.limit = limit;
                state.server.pinned = true;
                self.call(&mut state, None, &[]);
            }
            Action::Unpin => {
                state.server.limit = c.limit;
                state.server.pinned = false;
                self.call(&mut state, None, &[]);
            }
            Action::Restart => {
                // Restarting takes time: the server's clock reads later when it is back.
                state.now += 1;
                state.epoch += 1;
                state.server = Server::empty(c);
                state.restarts_left -= 1;
                for proc in &mut state.procs {
                    proc.announced = None;
                }
                state.settled = false;
            }
            Action::Try {
                p,
                weight,
                class,
                tenant,
            } => {
                let member = Self::new_member(&mut state, weight, class, tenant);
                self.acquire(&mut state, p, member, false, false);
            }
            Action::Wait {
                p,
                weight,
                class,
                tenant,
            } => {
                let member = Self::new_member(&mut state, weight, class, tenant);
                self.acquire(&mut state, p, member, true, false);
            }
            Action::Prefetch(p) => {
                let member = Self::new_member(&mut state, 1, LOW, None);
                self.acquire(&mut state, p, member, false, true);
            }
            Action::Receive(p) => {
                let now = state.now;
                let proc = &mut state.procs[usize::from(p)];
                let mut belief = proc.reply.take().expect("Receive is offered with a reply");
                if c.design == Design::ClientClock {
                    belief.deadline = now + c.lease;
                }
                proc.permits.push(belief);
                state.settled = last.settled;
            }
            Action::Renew(p) => self.renew(&mut state, p),
            Action::Release { p, id } => {
                state.procs[usize::from(p)].permits.retain(|b| b.id != id);
                self.call(&mut state, Some(p), &[id]);
            }
            Action::GiveBack(p) => {
                let pooled: Vec<u8> = (state.procs[usize::from(p)].permits.iter())
                    .filter(|b| b.pooled)
                    .map(|b| b.id)
                    .collect();
                state.procs[usize::from(p)].permits.retain(|b| !b.pooled);
                self.call(&mut state, Some(p), &pooled);
            }
            Action::Cancel(p) => {
                let waiting = state.procs[usize::from(p)].waiting.take();
                state.procs[usize::from(p)].announced = None;
                let id = waiting
                    .map(|w| w.id)
                    .expect("Cancel is offered with a waiter");
                self.call(&mut state, Some(p), &[id]);
            }
            Action::Touch(p) => self.touch(&mut state, p),
            Action::Learn(p) => {
                let now = state.now;
                // The limit its grant was made under (lowering the limit takes nothing back).
                let limit = (state.server.holders.iter())
                    .find(|h| Some(h.id) == state.procs[usize::from(p)].announced.map(|a| a.0))
                    .map_or(state.server.limit, |h| h.limit_at_grant);
                let epoch = state.epoch;
                let proc = &mut state.procs[usize::from(p)];
                let (id, token, until) = proc.announced.take().expect("Learn is offered announced");
                let waiting = proc
                    .waiting
                    .take()
                    .expect("an announced grant was waited for");
                // The crate believes the announced deadline (the provisional term, on the clock
                // reading of its queueing call) until its keeper claims it; the bug of turn 2
                // believed a full lease from the moment it learned.
                let deadline = if c.design == Design::LearnTime {
                    now + c.lease
                } else {
                    until
                };
                proc.permits.push(Belief {
                    id,
                    weight: waiting.weight,
                    class: waiting.class,
                    tenant: waiting.tenant,
                    token,
                    deadline,
                    lost: false,
                    epoch,
                    limit_at_grant: limit,
                    pooled: false,
                });
                state.settled = last.settled;
            }
            Action::Freeze(p) => {
                state.procs[usize::from(p)].run = Run::Frozen;
                state.freezes_left -= 1;
                state.settled = last.settled;
            }
            Action::Thaw(p) => {
                state.procs[usize::from(p)].run = Run::Running;
                state.settled = last.settled;
            }
            Action::Crash(p) => {
                state.procs[usize::from(p)].run = Run::Crashed;
                state.crashes_left -= 1;
                state.settled = last.settled;
            }
            Action::Take { p, node } => {
                state.nodes[usize::from(node)].push(p);
                state.procs[usize::from(p)].nodes.push(node);
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        crate::invariants::all()
    }

    fn format_action(&self, action: &Action) -> String {
        format!("{action:?}")
    }

    fn format_step(&self, last: &State, action: Action) -> Option<String> {
        self.next_state(last, action)
            .map(|s| format!("{}", Summary(&s)))
    }
}

/// One line per state for printed traces: the clock, the holders, the line, the beliefs.
pub struct Summary<'a>(pub &'a State);

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        write!(f, "t={} limit={} holders=[", s.now, s.server.limit)?;
        for h in &s.server.holders {
            let kind = if h.provisional { "?" } else { "" };
            write!(
                f,
                " #{}{kind} p{} w{} c{} until {} tok {};",
                h.id, h.proc, h.weight, h.class, h.deadline, h.token
            )?;
        }
        write!(f, " ] line=[")?;
        for w in &s.server.queue {
            write!(f, " #{} p{} w{} c{};", w.id, w.proc, w.weight, w.class)?;
        }
        write!(f, " ] believed=[")?;
        for (p, proc) in s.procs.iter().enumerate() {
            for b in &proc.permits {
                write!(
                    f,
                    " p{p}:#{} w{} until {}{}{};",
                    b.id,
                    b.weight,
                    b.deadline,
                    if b.lost { " lost" } else { "" },
                    match proc.run {
                        Run::Crashed => " crashed",
                        Run::Frozen => " frozen",
                        Run::Running => "",
                    }
                )?;
            }
            if proc.nodes.len() >= 2 {
                write!(f, " p{p}: nodes {:?};", proc.nodes)?;
            }
        }
        write!(f, " ]")
    }
}
