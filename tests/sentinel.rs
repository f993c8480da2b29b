//! Sentinel: a real master, its replica and three sentinels (redis-test's spawner). The backend
//! finds the master through the sentinels, and after a forced failover (`SENTINEL FAILOVER`)
//! it follows the new master with no restart: acquires succeed, waiters are woken, the
//! subscription moved along. A master name the sentinels do not know is a clear error.

mod support;

use std::time::Duration;

use redis_test::sentinel::RedisSentinelCluster;
use tokio::time::Instant;
use tower_distributed_limit::{Error, RedisBackend, Semaphore};

use support::eventually;

const MASTER: &str = "master0";

struct Sentinels {
    cluster: RedisSentinelCluster,
    urls: Vec<String>,
}

impl Sentinels {
    async fn start() -> Sentinels {
        let cluster = tokio::task::spawn_blocking(|| RedisSentinelCluster::new(1, 1, 3))
            .await
            .unwrap();
        let urls = cluster
            .iter_sentinel_servers()
            .map(|server| {
                let (host, port) = server.host_and_port().expect("TCP sentinels");
                format!("redis://{host}:{port}")
            })
            .collect();
        Sentinels { cluster, urls }
    }

    async fn sentinel(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.urls[0].as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// The data server (index into the cluster's servers) at `addr` (host, port).
    fn server_at(&self, addr: &[String]) -> usize {
        let port: u16 = addr[1].parse().unwrap();
        self.cluster
            .servers
            .iter()
            .position(|server| server.host_and_port().map(|(_, p)| p) == Some(port))
            .expect("a known server")
    }

    /// Closes the master's connections to its replicas.
    async fn cut_off_replicas(&self, master: usize) {
        let (host, port) = self.cluster.servers[master].host_and_port().unwrap();
        let mut conn = redis::Client::open(format!("redis://{host}:{port}"))
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("replica")
            .exec_async(&mut conn)
            .await
            .unwrap();
    }

    fn other_than(&self, server: usize) -> usize {
        (0..self.cluster.servers.len())
            .find(|&other| other != server)
            .unwrap()
    }

    fn pid(&self, server: usize) -> u32 {
        self.cluster.servers[server].process.id()
    }

    async fn master_addr(&self) -> Vec<String> {
        redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(MASTER)
            .query_async(&mut self.sentinel().await)
            .await
            .unwrap()
    }
}

fn semaphore(backend: RedisBackend) -> Semaphore {
    Semaphore::builder("watched")
        .limit(1)
        .lease(Duration::from_secs(5))
        .acquire_timeout(Duration::from_secs(10))
        .build(backend)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_failover_is_followed_without_a_restart() {
    let sentinels = Sentinels::start().await;
    let backend = RedisBackend::connect_sentinel(&sentinels.urls, MASTER)
        .await
        .unwrap();
    let sem = semaphore(backend.clone());
    let other = semaphore(backend);
    // Subscribed on the first master: a waiter is woken there.
    let held = sem.acquire().await.unwrap();
    let waiter = tokio::spawn(async move { other.acquire().await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(held);
    let permit = waiter.await.unwrap().unwrap();
    drop(permit);

    let before = sentinels.master_addr().await;
    redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(MASTER)
        .exec_async(&mut sentinels.sentinel().await)
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the sentinels to name a new master",
        || async { sentinels.master_addr().await != before },
    )
    .await;

    // The old master is now a replica (or still promoting its successor): acquires find
    // their way to the new master within the acquire timeout.
    let permit = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match sem.acquire().await {
                Ok(permit) => return permit,
                Err(Error::Backend(_)) => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(e) => panic!("{e}"),
            }
        }
    })
    .await
    .expect("an acquire succeeds on the new master");
    // And the announcement reaches a waiter through the subscription on the new master.
    let sem2 = sem.clone();
    let waiter = tokio::spawn(async move {
        let permit = sem2.acquire().await;
        (permit, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let released = Instant::now();
    drop(permit);
    let (permit, woken) = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter is served")
        .unwrap();
    assert!(!permit.unwrap().is_lost());
    let after = woken - released;
    assert!(
        after < Duration::from_millis(600),
        "woken {after:?} after the release"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_master_name_is_a_clear_error() {
    let sentinels = Sentinels::start().await;
    let started = Instant::now();
    let err = RedisBackend::sentinel_builder(&sentinels.urls, "no-such-master")
        .connect_timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(err, Error::Backend(_)), "{err:?}");
    assert!(err.to_string().contains("no-such-master"), "{err}");
    let none: [&str; 0] = [];
    assert!(matches!(
        RedisBackend::connect_sentinel(&none, MASTER).await,
        Err(Error::Config(_))
    ));
}

/// A grant the replica never received (it was frozen), then a forced failover to it: the new
/// master does not know the holder, and the holder is told it lost its permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_lost_in_a_failover_is_reported_lost() {
    let sentinels = Sentinels::start().await;
    let backend = RedisBackend::sentinel_builder(&sentinels.urls, MASTER)
        .call_timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    let sem = Semaphore::builder("unseen")
        .limit(1)
        .lease(Duration::from_secs(60))
        .acquire_timeout(Duration::from_secs(10))
        .build(backend)
        .unwrap();
    sem.acquire().await.unwrap().release().await.unwrap(); // the script is loaded
    let master = sentinels.server_at(&sentinels.master_addr().await);
    let replica = sentinels.other_than(master);
    // The replica, frozen, is cut off (so not even the kernel's socket buffer carries the
    // grant to it); the grant then goes to the master alone.
    support::signal(sentinels.pid(replica), "STOP");
    sentinels.cut_off_replicas(master).await;
    let held = sem.acquire().await.unwrap();
    support::signal(sentinels.pid(master), "STOP");
    support::signal(sentinels.pid(replica), "CONT");
    let before = sentinels.master_addr().await;
    // Until the sentinels have seen the thawed replica answer again, they find no replica to
    // promote (NOGOODSLAVE).
    eventually(
        Duration::from_secs(20),
        "the sentinels to start a failover",
        || async {
            redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(MASTER)
                .exec_async(&mut sentinels.sentinel().await)
                .await
                .is_ok()
        },
    )
    .await;
    eventually(
        Duration::from_secs(30),
        "the sentinels to name a new master",
        || async { sentinels.master_addr().await != before },
    )
    .await;
    // Any call through the backend (here: asking how many permits are free) finds the old
    // master gone, follows the sentinels to the new one, and makes holders renew at once.
    let _ = sem.available_permits().await;
    tokio::time::timeout(Duration::from_secs(10), held.lost())
        .await
        .expect("the holder the new master never saw is lost, long before its lease ends");
    support::signal(sentinels.pid(master), "CONT");
}
