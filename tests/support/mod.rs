//! Test fixtures: a real redis-server per test on a free loopback port, and bounded waits.
#![allow(dead_code)] // each test crate uses its own part of this module

use std::future::Future;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis_test::server::RedisServer;
use tower_distributed_limit::RedisBackend;

/// A private redis-server, killed when dropped.
pub struct Redis {
    server: RedisServer,
    pub url: String,
}

impl Redis {
    /// Starts redis-server on a free port (never 6379) and waits until it answers PING.
    pub async fn start() -> Redis {
        let server = RedisServer::new();
        let (host, port) = server.host_and_port().expect("a TCP server");
        assert_ne!(port, 6379, "tests never use the default port");
        let url = format!("redis://{host}:{port}");
        let redis = Redis { server, url };
        eventually(
            Duration::from_secs(10),
            "redis-server to answer PING",
            || async {
                let Ok(client) = redis::Client::open(redis.url.as_str()) else {
                    return false;
                };
                match client.get_multiplexed_async_connection().await {
                    Ok(mut conn) => redis::cmd("PING")
                        .query_async::<String>(&mut conn)
                        .await
                        .is_ok(),
                    Err(_) => false,
                }
            },
        )
        .await;
        redis
    }

    pub async fn backend(&self) -> RedisBackend {
        RedisBackend::connect(&self.url)
            .await
            .expect("connect to the test redis")
    }

    /// A plain connection for checking what the crate wrote.
    pub async fn conn(&self) -> MultiplexedConnection {
        redis::Client::open(self.url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    pub async fn dbsize(&self) -> u64 {
        redis::cmd("DBSIZE")
            .query_async(&mut self.conn().await)
            .await
            .unwrap()
    }

    /// How many times Redis ran EVALSHA so far (INFO commandstats).
    pub async fn evalsha_calls(&self) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut self.conn().await)
            .await
            .unwrap();
        info.lines()
            .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |calls| calls.parse().unwrap())
    }

    pub fn kill(&mut self) {
        self.server.stop();
    }
}

/// Polls `condition` every 10 ms until it holds; panics naming `what` after `limit`.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if condition().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
