//! A concurrency limit and a rate limit stacked in one `ServiceBuilder`.
//!
//! They bound different things, and an upstream usually has both:
//! - the **concurrency** limit (how many at once) protects capacity that is held for as long as
//!   a request runs: connections, memory, GPU slots. Ten 30-second requests at once can sink a
//!   service that would happily take a thousand 1 ms requests per second.
//! - the **rate** limit (how many per second) protects quotas and budgets counted per request:
//!   "60 requests per minute per API key", however fast each one is.
//!
//! A concurrency cap alone lets fast requests through at any rate; a rate cap alone lets slow
//! requests pile up without bound. Here the concurrency limit is global (shared through the
//! semaphore's backend) while tower's `RateLimitLayer` counts per process; a global GCRA
//! rate-limit layer on the same Redis is on this crate's roadmap.
//!
//! Uses an in-process backend unless `REDIS_URL` is set.

mod support;

use std::time::{Duration, Instant};

use tower::{BoxError, ServiceBuilder, ServiceExt, service_fn};
use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Semaphore};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let sem = support::build(Semaphore::builder("example-llm-api").limit(2)).await?;
    let started = Instant::now();
    let upstream = service_fn(move |req: http::Request<String>| async move {
        tokio::time::sleep(Duration::from_millis(50)).await; // the upstream's work
        Ok::<_, BoxError>(format!(
            "{} done at {:>4} ms",
            req.body(),
            started.elapsed().as_millis()
        ))
    });
    // Outermost first: take a global slot, then queue in a buffer (tower's RateLimit is not
    // Clone, the buffer makes the stack shareable), then wait for the rate: 5 per 200 ms.
    let client = ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(sem))
        .buffer(32)
        .rate_limit(5, Duration::from_millis(200))
        .service(upstream);

    let mut calls = tokio::task::JoinSet::new();
    for i in 0..10 {
        let client = client.clone();
        // Spawned as is: wrapping it in an `async` block trips a compiler limitation
        // (rust-lang/rust#64552) on the BoxError bounds of the stack.
        calls.spawn(client.oneshot(http::Request::new(format!("call {i}"))));
    }
    let mut lines = Vec::new();
    while let Some(call) = calls.join_next().await {
        lines.push(call??);
    }
    lines.sort_by_key(|line| line.split(" done at ").nth(1).map(str::to_owned));
    for line in lines {
        println!("{line}");
    }
    Ok(())
}
