//! Acquire + release on `MemoryBackend`: the crate's own cost per permit, with no network.
//!
//! The semaphore has a limit of 1, so an iteration that failed to give its permit back makes
//! the next one fail (`try_acquire`) or time out (`acquire`) instead of measuring nonsense.

use criterion::{Criterion, criterion_group, criterion_main};
use tower_distributed_limit::{MemoryBackend, Semaphore};

mod common;

fn acquire_release(c: &mut Criterion) {
    let rt = common::runtime();
    let sem = Semaphore::builder("bench")
        .limit(1)
        .build(MemoryBackend::new())
        .expect("valid settings");
    let sem = &sem;
    let mut group = c.benchmark_group("memory");
    group.bench_function("try_acquire + drop", |b| {
        b.to_async(&rt).iter(move || async move {
            let permit = sem.try_acquire().await.expect("memory never fails");
            drop(permit.expect("the only permit was given back"));
        });
    });
    group.bench_function("acquire + release", |b| {
        b.to_async(&rt).iter(move || async move {
            let mut permit = sem.acquire().await.expect("the only permit was given back");
            permit.release().await.expect("memory never fails");
        });
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::criterion();
    targets = acquire_release
}
criterion_main!(benches);
