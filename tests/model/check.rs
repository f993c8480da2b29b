//! Exhaustive checks of the crate's design: every reachable state of a configuration, breadth
//! first, against every invariant.

use std::time::{Duration, Instant};

use stateright::{Checker, Model};

use crate::model::{Config, Semaphore};

/// What one exhaustive run explored.
pub struct Explored {
    pub states: usize,
    pub depth: usize,
    pub seconds: f64,
}

/// Explores every state of `config` (BFS, both cores) and fails on any invariant broken,
/// printing the shortest trace to it.
pub fn explore(config: Config) -> Explored {
    let started = Instant::now();
    let depth = config.depth;
    let mut builder = Semaphore::new(config).checker().threads(2);
    if let Some(depth) = depth {
        builder = builder.target_max_depth(depth);
    }
    // A measuring aid: stop after this many states (`MODEL_PROBE=<n>`).
    if let Some(n) = std::env::var("MODEL_PROBE")
        .ok()
        .and_then(|n| n.parse().ok())
    {
        builder = builder.target_state_count(n);
    }
    let checker = builder.timeout(Duration::from_secs(600)).spawn_bfs().join();
    let explored = Explored {
        states: checker.unique_state_count(),
        depth: checker.max_depth(),
        seconds: started.elapsed().as_secs_f64(),
    };
    if let Some((name, path)) = checker.discoveries().into_iter().next() {
        panic!(
            "invariant {name} broken after {} steps:\n{}",
            path.clone().into_actions().len(),
            crate::counterexamples::trace(checker.model(), &path, name)
        );
    }
    assert!(
        checker.is_done() || std::env::var("MODEL_PROBE").is_ok(),
        "the check ran out of time before it explored every state"
    );
    explored
}

fn report(what: &str, explored: &Explored) {
    println!(
        "{what}: {} states explored, max depth {}, {:.1} s",
        explored.states, explored.depth, explored.seconds
    );
}

/// The CI-sized check (3 processes, limit 2, weights 1–2, both classes with a reservation, a
/// pinned limit, waiting, a freeze, a crash and an empty restart): at least 10⁶ states.
#[test]
fn every_invariant_holds_in_every_reachable_state_of_the_ci_configuration() {
    let explored = explore(Config::ci());
    report("ci", &explored);
    assert!(
        explored.states >= 1_000_000,
        "only {} states explored",
        explored.states
    );
}

/// Two tenants under a cap of 1 on a limit of 2, waiting in one class: the cap, the tenants'
/// turns and every other invariant.
#[test]
fn tenants_under_a_cap_keep_every_invariant() {
    let explored = explore(Config {
        waiting: true,
        tenants: true,
        tenant_cap: Some(1),
        weights: vec![1, 2],
        crashes: 1,
        depth: Some(8),
        ..Config::bare(3, 2)
    });
    report("tenants", &explored);
}

/// Prefetch pools beside waiters and a frozen process: pooled slots are holders like any.
#[test]
fn a_prefetch_pool_keeps_every_invariant() {
    let explored = explore(Config {
        waiting: true,
        prefetch: true,
        freezes: 1,
        restarts: 1,
        depth: Some(10),
        ..Config::bare(2, 2)
    });
    report("prefetch", &explored);
}

/// The deeper run `scripts/model-check --deep` makes: the CI configuration to `MODEL_DEPTH`
/// steps (default 9), and classes with tenants to one step less.
#[test]
#[ignore = "minutes and gigabytes: scripts/model-check --deep"]
fn every_invariant_holds_in_the_deep_configuration() {
    let depth = std::env::var("MODEL_DEPTH")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(9);
    let explored = explore(Config {
        depth: Some(depth),
        ..Config::ci()
    });
    report("deep", &explored);
    let explored = explore(classes_with_tenants(depth - 1));
    report("deep classes with tenants", &explored);
}

/// Both classes (the higher reserving 1) and two tenants under a cap of 2 inside them, on a
/// limit of 3, within `depth` steps: a grant to one tenant can turn the head blocking its class
/// into one passed over for its cap.
fn classes_with_tenants(depth: usize) -> Config {
    Config {
        waiting: true,
        classes: true,
        reserve: [1, 0],
        tenants: true,
        tenant_cap: Some(2),
        weights: vec![1, 2],
        depth: Some(depth),
        ..Config::bare(3, 3)
    }
}

#[test]
fn classes_with_tenants_keep_every_invariant() {
    let explored = explore(classes_with_tenants(7));
    report("classes with tenants", &explored);
}
