//! A concurrency limit and a rate limit on one layer, decided together.
//!
//! They bound different things, and an upstream usually has both:
//! - the **concurrency** limit (how many at once) protects capacity that is held for as long as
//!   a request runs: connections, memory, GPU slots. Ten 30-second requests at once can sink a
//!   service that would happily take a thousand 1 ms requests per second.
//! - the **rate** limit (how many per second) protects quotas and budgets counted per request:
//!   "60 requests per minute per API key", however fast each one is.
//!
//! A concurrency cap alone lets fast requests through at any rate; a rate cap alone lets slow
//! requests pile up without bound. Both limits here are global: the semaphore and the
//! `RateLimiter` live on the same backend, so ten instances together still start at most 5
//! calls per 200 ms and run at most 2 at once (tower's `RateLimitLayer` would count per
//! process: ten pods, ten times the rate).
//!
//! `DistributedConcurrencyLimitLayer::new(sem).rate_limit(rate)` gives each call a slot *and*
//! its share of the rate, or neither: a call refused for rate holds no slot, and one refused for
//! concurrency spends no rate. With both on the same Redis backend, a call that gets its slot at
//! once is decided in one script call. (`DistributedRateLimitLayer` stacked outside the
//! concurrency layer works too, for the rate alone or a limiter elsewhere.)
//!
//! Uses an in-process backend unless `REDIS_URL` is set.

mod support;

use std::time::{Duration, Instant};

use tower::{BoxError, ServiceBuilder, ServiceExt, service_fn};
use tower_distributed_limit::{
    DistributedConcurrencyLimitLayer, Error, MemoryBackend, RateLimiter, Semaphore,
};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // One backend for both, so the two limits are decided in the same call.
    let sem = Semaphore::builder("example-llm-api").limit(2);
    let rate = RateLimiter::builder("example-llm-api").rate(5, Duration::from_millis(200));
    let (sem, rate) = match std::env::var("REDIS_URL") {
        Ok(url) => {
            let redis = support::redis(&url).await?;
            (sem.build(redis.clone())?, rate.build(redis)?)
        }
        Err(_) => {
            let memory = MemoryBackend::new();
            (sem.build(memory.clone())?, rate.build(memory)?)
        }
    };
    let started = Instant::now();
    let upstream = service_fn(move |req: http::Request<String>| async move {
        tokio::time::sleep(Duration::from_millis(50)).await; // the upstream's work
        Ok::<_, BoxError>(format!(
            "{} done at {:>4} ms",
            req.body(),
            started.elapsed().as_millis()
        ))
    });
    // A global slot and the global rate, all or nothing. A caller refused for rate waits the
    // `retry_after` it was told.
    let client = ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(sem).rate_limit(rate))
        .service(upstream);

    // Joined in this task rather than spawned: spawning trips a compiler limitation
    // (rust-lang/rust#64552) on the BoxError bounds of the stack.
    let calls = (0..10).map(|i| {
        let client = client.clone();
        async move {
            loop {
                let request = http::Request::new(format!("call {i}"));
                match client.clone().oneshot(request).await {
                    Err(e) => match e.downcast_ref::<Error>() {
                        Some(Error::RateLimited { retry_after }) => {
                            tokio::time::sleep(*retry_after).await
                        }
                        _ => return Err(e),
                    },
                    done => return done,
                }
            }
        }
    });
    let mut lines = futures_util::future::try_join_all(calls).await?;
    lines.sort_by_key(|line| line.split(" done at ").nth(1).map(str::to_owned));
    for line in lines {
        println!("{line}");
    }
    Ok(())
}
