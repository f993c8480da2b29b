//! The global rate limit (issue 13), one file per feature as in `tests/layer/`: `RateLimiter`
//! itself on both backends, against a real redis-server and across OS processes
//! (`limiter.rs`), the standalone rate layer, generic and over real TCP (`layer.rs`), and the
//! combined check on the concurrency layer, `rate_limit` (`combined.rs`). The fixtures they
//! share are here, and so is `child_process`: `support::spawn_child` runs this binary again
//! with `--exact child_process`, which names a test at the crate's root.

#[path = "../support/mod.rs"]
#[macro_use]
mod support;

mod combined;
mod layer;
mod limiter;

use std::time::Duration;

use redis::AsyncCommands;
use tokio::io::AsyncBufReadExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::{Service, ServiceExt, service_fn};
use tower_distributed_limit::{
    DistributedConcurrencyLimitLayer, DistributedRateLimitLayer, Error, MemoryBackend,
    OutagePolicy, RateBackend, RateLimiter, RedisBackend, Semaphore,
};

use support::{Redis, child_role, child_says, spawn_child};

fn limiter(
    name: &str,
    rate: u32,
    period: Duration,
    burst: u32,
    backend: impl RateBackend,
) -> RateLimiter {
    RateLimiter::builder(name)
        .rate(rate, period)
        .burst(burst)
        .build(backend)
        .unwrap()
}

const RATE: u32 = 200;
const BURST: u32 = 20;
const SECS: f64 = 3.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the other tests"]
async fn child_process() {
    let Some((role, url)) = child_role() else {
        return;
    };
    assert_eq!(role, "hammer");
    let backend = RedisBackend::connect(&url).await.unwrap();
    let rate = limiter("shared", RATE, Duration::from_secs(1), BURST, backend);
    let mut counter = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    rate.check_key("warm-up", 1).await.unwrap();
    println!("DLIMIT ready");
    let mut line = String::new();
    tokio::io::BufReader::new(tokio::io::stdin())
        .read_line(&mut line)
        .await
        .unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs_f64(SECS);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let rate = rate.clone();
        let mut counter = counter.clone();
        tasks.spawn(async move {
            let mut admitted = 0u64;
            while tokio::time::Instant::now() < until {
                let d = rate.check().await.unwrap();
                if d.allowed {
                    admitted += 1;
                    let _: i64 = counter.incr("admitted", 1).await.unwrap();
                } else {
                    let nap = d
                        .retry_after
                        .unwrap()
                        .min(until - tokio::time::Instant::now().min(until));
                    tokio::time::sleep(nap.min(Duration::from_millis(2))).await;
                }
            }
            admitted
        });
    }
    let mut admitted = 0;
    while let Some(n) = tasks.join_next().await {
        admitted += n.unwrap();
    }
    let _: () = redis::cmd("PING").query_async(&mut counter).await.unwrap();
    println!("DLIMIT {admitted}");
}
