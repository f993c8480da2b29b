//! The crate's promises, as properties of every reachable state. Each is named as in
//! docs/design.md's "The model" (`#invariant-<name>`), so a failure names the promise broken.

use stateright::Property;

use crate::model::{Belief, Design, Semaphore, State};

/// The name each promise is checked under (BFS discoveries are keyed by it).
pub const LIMIT: &str = "limit";
pub const RESERVATION: &str = "reservation";
pub const TENANT: &str = "tenant";
pub const FENCING: &str = "fencing";
pub const QUIESCENCE: &str = "quiescence";
pub const ORDER: &str = "order";
pub const SERVED: &str = "served";

pub fn all() -> Vec<Property<Semaphore>> {
    vec![
        Property::always(LIMIT, limit),
        Property::always(RESERVATION, reservation),
        Property::always(TENANT, tenant),
        Property::always(FENCING, fencing),
        Property::always(QUIESCENCE, quiescence),
        Property::always(ORDER, order),
        Property::always(SERVED, served),
    ]
}

/// The beliefs the limit speaks of: live, and granted by the server's current incarnation (an
/// empty restart forgets holders, which learn it at their next renewal: docs/operations.md).
fn current<'a>(model: &Semaphore, state: &'a State) -> Vec<&'a Belief> {
    (model.believed(state))
        .filter(|b| b.epoch == state.epoch)
        .collect()
}

/// The limit in force for a set of beliefs: the pinned or configured limit, or a higher one in
/// force when one of them was granted (lowering the limit takes nothing back).
fn in_force(state: &State, beliefs: &[&Belief]) -> u32 {
    let granted_under = beliefs.iter().map(|b| b.limit_at_grant).max().unwrap_or(0);
    u32::from(state.server.limit.max(granted_under))
}

fn weight(beliefs: &[&Belief]) -> u32 {
    beliefs.iter().map(|b| u32::from(b.weight)).sum()
}

/// The weight of the permits processes believe live never exceeds the limit in force.
fn limit(model: &Semaphore, state: &State) -> bool {
    if model.config.design == Design::Redlock {
        return Semaphore::redlock_believers(state) <= usize::from(model.config.limit);
    }
    let beliefs = current(model, state);
    weight(&beliefs) <= in_force(state, &beliefs)
}

/// What a class reserves is never held by another class: the others hold at most the limit
/// less the reservation.
fn reservation(model: &Semaphore, state: &State) -> bool {
    let beliefs = current(model, state);
    let limit = in_force(state, &beliefs);
    [0u8, 1].iter().all(|&class| {
        let reserved = u32::from(model.config.reserved(class));
        let others: Vec<&Belief> = (beliefs.iter().copied())
            .filter(|b| b.class != class)
            .collect();
        reserved == 0 || weight(&others) + reserved <= limit
    })
}

/// A tenant never holds more than its cap.
fn tenant(model: &Semaphore, state: &State) -> bool {
    let Some(cap) = model.config.tenant_cap else {
        return true;
    };
    let beliefs = current(model, state);
    [0u8, 1].iter().all(|&t| {
        let theirs: Vec<&Belief> = (beliefs.iter().copied())
            .filter(|b| b.tenant == Some(t))
            .collect();
        weight(&theirs) <= u32::from(cap)
    })
}

/// Every token issued is above every token issued before it, across empty restarts.
fn fencing(_: &Semaphore, state: &State) -> bool {
    !state.token_regressed
}

/// No slot outlives its process's last call by more than a lease plus the claim window: once
/// every process stops, every slot is free by then.
fn quiescence(model: &Semaphore, state: &State) -> bool {
    let c = &model.config;
    state
        .server
        .holders
        .iter()
        .all(|h| h.deadline <= state.procs[usize::from(h.proc)].last_call + c.lease + c.claim)
}

/// Inside a class, a waiter is never overtaken by a later one of its tenant (or another
/// untenanted one), unless its process was passed over for letting a grant run out.
fn order(_: &Semaphore, state: &State) -> bool {
    !state.overtaken
}

/// Liveness, bounded: after any call, the line has nobody left it could admit. A waiter at the
/// head of its class with room is granted by the next call of any process.
fn served(model: &Semaphore, state: &State) -> bool {
    if !state.settled {
        return true;
    }
    let mut again = state.clone();
    model.serve_again(&mut again);
    again.server.holders.len() == state.server.holders.len()
}
