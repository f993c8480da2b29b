//! Settings shared by the criterion benches, so every run stays short on a small machine.

use std::time::Duration;

use criterion::Criterion;
use tokio::runtime::Runtime;

/// About 4 s per benchmark (1 s warm-up, 3 s measured): these are sub-microsecond operations,
/// so 50 samples already give tight intervals.
pub fn criterion() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(50)
}

/// A current-thread runtime, as the crate's hot path runs on one: no cross-thread wake-ups in
/// the figures. The timer is on because `acquire` runs under `tokio::time::timeout`.
pub fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime")
}
