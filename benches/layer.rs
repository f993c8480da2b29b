//! What `DistributedConcurrencyLimitLayer` adds to a request: the same `service_fn` served bare,
//! behind the generic layer and behind its `.http()` flavor, with `weight_by` and
//! `acquire_in_poll_ready`, and a service of a request type that is not HTTP (`u64` jobs), all on
//! `MemoryBackend`, beside tower's per-process `ConcurrencyLimitLayer` for scale; partitioned
//! jobs whose keys hit the partitions' cache or miss it (more keys than its capacity), and
//! the rate layer (generic and HTTP) with a rate it never reaches. The
//! difference between `bare` and a layered line is the layer's cost per request (taking and
//! giving back a permit, the boxed acquire future, the moved inner service).
//!
//! Every variant reads the response body to its end, as a server would: the HTTP flavor holds
//! the permit until then. The limit is 1, so a permit that was not given back stalls the bench
//! instead of going unnoticed.

use std::convert::Infallible;
use std::fmt::Debug;
use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{
    BenchmarkGroup, Criterion, criterion_group, criterion_main, measurement::WallTime,
};
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tokio::runtime::Runtime;
use tower::{Layer, Service, ServiceExt, service_fn};
use tower_distributed_limit::{
    DistributedConcurrencyLimitLayer, DistributedRateLimitLayer, MemoryBackend, Partitions,
    RateLimiter, Semaphore,
};

mod common;

async fn hello(_request: Request<()>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"hello"))))
}

/// Serves `iters` requests with one service: a manual loop (`iter_custom`) so the service is
/// cloned once per sample rather than once per request.
async fn serve<S, B>(mut service: S, iters: u64) -> Duration
where
    S: Service<Request<()>, Response = Response<B>>,
    S::Error: Debug,
    B: Body,
    B::Error: Debug,
{
    let started = Instant::now();
    for _ in 0..iters {
        let response = service
            .ready()
            .await
            .expect("always ready")
            .call(Request::new(()))
            .await
            .expect("the only permit was given back");
        black_box(response.into_body().collect().await.expect("a full body"));
    }
    started.elapsed()
}

fn bench<S, B>(group: &mut BenchmarkGroup<'_, WallTime>, rt: &Runtime, name: &str, service: S)
where
    S: Service<Request<()>, Response = Response<B>> + Clone,
    S::Error: Debug,
    B: Body,
    B::Error: Debug,
{
    group.bench_function(name, |b| {
        b.to_async(rt)
            .iter_custom(|iters| serve(service.clone(), iters));
    });
}

/// Serves `iters` jobs (not HTTP requests) with one service.
async fn run_jobs<S>(mut service: S, iters: u64) -> Duration
where
    S: Service<u64>,
    S::Error: Debug,
{
    let started = Instant::now();
    for job in 0..iters {
        let done = service
            .ready()
            .await
            .expect("always ready")
            .call(job)
            .await
            .expect("the only permit was given back");
        black_box(done);
    }
    started.elapsed()
}

fn layer_overhead(c: &mut Criterion) {
    let rt = common::runtime();
    let layer = DistributedConcurrencyLimitLayer::new(
        Semaphore::builder("bench")
            .limit(1)
            .build(MemoryBackend::new())
            .expect("valid settings"),
    );
    let mut group = c.benchmark_group("layer");
    bench(&mut group, &rt, "bare", service_fn(hello));
    // tower's own per-process limit, for scale: its permit is a tokio semaphore's.
    bench(
        &mut group,
        &rt,
        "tower_concurrency_limit",
        tower::limit::ConcurrencyLimitLayer::new(1).layer(service_fn(hello)),
    );
    bench(&mut group, &rt, "generic", layer.layer(service_fn(hello)));
    bench(
        &mut group,
        &rt,
        "http",
        layer.clone().http().layer(service_fn(hello)),
    );
    // The same on a semaphore that prefetches its slot: acquire and release never reach the
    // backend (the cost of the layer and the pool alone).
    let prefetched = Semaphore::builder("bench-prefetched")
        .limit(1)
        .prefetch(1)
        .build(MemoryBackend::new())
        .expect("valid settings");
    bench(
        &mut group,
        &rt,
        "http_prefetched",
        DistributedConcurrencyLimitLayer::new(prefetched)
            .http()
            .layer(service_fn(hello)),
    );
    bench(
        &mut group,
        &rt,
        "weight_by",
        layer
            .clone()
            .weight_by(|_: &Request<()>| 1)
            .layer(service_fn(hello)),
    );
    bench(
        &mut group,
        &rt,
        "acquire_in_poll_ready",
        layer
            .clone()
            .acquire_in_poll_ready()
            .layer(service_fn(hello)),
    );
    let job = |job: u64| async move { Ok::<_, Infallible>(job) };
    group.bench_function("any_type_bare", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| run_jobs(service_fn(job), iters));
    });
    let jobs = layer.layer(service_fn(job));
    group.bench_function("any_type", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| run_jobs(jobs.clone(), iters));
    });
    let partitioned = |keys: u64, capacity: usize| {
        let partitions = Partitions::builder("bench-keys")
            .key(move |job: &u64| Some((job % keys).to_string()))
            .limit(1)
            .capacity(capacity)
            .build(MemoryBackend::new())
            .expect("valid settings");
        DistributedConcurrencyLimitLayer::partitioned(partitions).layer(service_fn(job))
    };
    // 8 keys, all cached.
    let hits = partitioned(8, 10_000);
    group.bench_function("partitioned_hits", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| run_jobs(hits.clone(), iters));
    });
    // 4 096 keys in turn through a cache of 1 024: every request a miss, and an eviction.
    let misses = partitioned(4096, 1024);
    group.bench_function("partitioned_misses", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| run_jobs(misses.clone(), iters));
    });
    let rate = RateLimiter::builder("bench-rate")
        .rate(1_000_000_000, Duration::from_secs(1))
        .build(MemoryBackend::new())
        .expect("valid settings");
    let rated = DistributedRateLimitLayer::new(rate.clone()).layer(service_fn(job));
    group.bench_function("rate_generic", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| run_jobs(rated.clone(), iters));
    });
    bench(
        &mut group,
        &rt,
        "rate_http",
        DistributedRateLimitLayer::new(rate)
            .http()
            .layer(service_fn(hello)),
    );
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::criterion();
    targets = layer_overhead
}
criterion_main!(benches);
