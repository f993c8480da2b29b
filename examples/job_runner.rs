//! A job runner that is not HTTP: jobs are plain structs, and the layer caps how many GPU
//! slots they hold at once across every process that runs this (start it twice with the same
//! `REDIS_URL` to see the limit shared). A batch takes as many slots as it has images, and each
//! job sees the fencing token of its permit.
//!
//! Uses an in-process backend unless `REDIS_URL` is set.

mod support;

use std::time::{Duration, Instant};

use tower::{BoxError, ServiceBuilder, ServiceExt, service_fn};
use tower_distributed_limit::{DistributedConcurrencyLimitLayer, FencingToken, Semaphore};

/// One unit of work: a batch of images for the GPUs.
struct Job {
    id: u32,
    images: u32,
}

async fn run(job: Job, token: Option<FencingToken>, started: Instant) -> Result<String, BoxError> {
    tokio::time::sleep(Duration::from_millis(20 * u64::from(job.images))).await;
    Ok(format!(
        "job {:>2} ({} images) done at {:>4} ms with token {:?}",
        job.id,
        job.images,
        started.elapsed().as_millis(),
        token.map(|t| t.0)
    ))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let gpus = support::build(
        Semaphore::builder("example-gpus")
            .limit(4)
            .acquire_timeout(Duration::from_secs(30)),
    )
    .await?;
    let started = Instant::now();
    let runner = ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(gpus).weight_by(|job: &Job| job.images))
        .service(service_fn(move |job: Job| {
            // The token of this job's permit, read while the layer calls the runner.
            run(job, FencingToken::current(), started)
        }));

    let mut jobs = tokio::task::JoinSet::new();
    for id in 0..8 {
        let job = Job {
            id,
            images: 1 + id % 3,
        };
        jobs.spawn(runner.clone().oneshot(job));
    }
    let mut lines = Vec::new();
    while let Some(done) = jobs.join_next().await {
        lines.push(done??);
    }
    lines.sort();
    for line in lines {
        println!("{line}");
    }
    Ok(())
}
