//! Redis Cluster: a real 3-master cluster (redis-test's spawner and `redis-cli --cluster
//! create`). Each semaphore lives in its hash slot's node, whichever node a client first
//! connected to; grants reach waiters through sharded pub/sub, with no polling; the limit
//! holds across two OS processes; a cluster URL list that is wrong is a clear error.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis_test::cluster::{RedisCluster, RedisClusterConfiguration};
use tokio::time::Instant;
use tower_distributed_limit::{Error, RedisBackend, Semaphore};

use support::{Redis, child_role, child_says, spawn_child_with};

/// A 3-master cluster, stopped when dropped; `urls[i]` is node `i`.
struct Cluster {
    _cluster: RedisCluster,
    urls: Vec<String>,
}

impl Cluster {
    async fn start() -> Cluster {
        let cluster =
            tokio::task::spawn_blocking(|| RedisCluster::new(RedisClusterConfiguration::default()))
                .await
                .unwrap();
        let urls = cluster
            .iter_servers()
            .map(|server| {
                let (host, port) = server.host_and_port().expect("TCP nodes");
                assert_ne!(port, 6379);
                format!("redis://{host}:{port}")
            })
            .collect();
        Cluster {
            _cluster: cluster,
            urls,
        }
    }

    async fn conn(&self) -> ClusterConnection {
        ClusterClient::new(self.urls.clone())
            .unwrap()
            .get_async_connection()
            .await
            .unwrap()
    }

    /// The node (index into `urls`) that owns `key`'s slot.
    async fn owner(&self, key: &str) -> usize {
        let mut conn = self.conn().await;
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap();
        let ranges: Vec<(u16, u16, (String, u16))> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async::<Vec<redis::Value>>(&mut conn)
            .await
            .unwrap()
            .into_iter()
            .map(|range| redis::from_redis_value(range).unwrap())
            .map(|(start, end, master): (u16, u16, Vec<redis::Value>)| {
                let (host, port): (String, u16) =
                    redis::from_redis_value(redis::Value::Array(master[..2].to_vec())).unwrap();
                (start, end, (host, port))
            })
            .collect();
        let (_, _, (host, port)) = ranges
            .into_iter()
            .find(|(start, end, _)| (*start..=*end).contains(&slot))
            .expect("every slot is served");
        let url = format!("redis://{host}:{port}");
        self.urls
            .iter()
            .position(|u| *u == url)
            .expect("a known node")
    }

    /// One semaphore name per node: `names[i]` lives on node `i`.
    async fn one_name_per_node(&self) -> Vec<String> {
        let mut names: BTreeMap<usize, String> = BTreeMap::new();
        for i in 0.. {
            let name = format!("sem-{i}");
            let owner = self.owner(&format!("dlimit:{{{name}}}:holders")).await;
            names.entry(owner).or_insert(name);
            if names.len() == self.urls.len() {
                break;
            }
        }
        names.into_values().collect()
    }

    /// How many script calls node `node` ran so far.
    async fn script_calls(&self, node: usize) -> u64 {
        support::script_calls_at(&self.urls[node]).await
    }
}

fn semaphore(name: &str, backend: RedisBackend) -> Semaphore {
    Semaphore::builder(name)
        .limit(1)
        .acquire_timeout(Duration::from_secs(5))
        .build(backend)
        .unwrap()
}

/// Two clients that each know only one node, on semaphores owned by every node: one limit,
/// and a release wakes the waiter through the owner's sharded channel, not a timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_holds_its_semaphores_and_wakes_their_waiters() {
    let cluster = Cluster::start().await;
    let names = cluster.one_name_per_node().await;
    let first = RedisBackend::connect_cluster(&cluster.urls[..1])
        .await
        .unwrap();
    let second = RedisBackend::connect_cluster(&cluster.urls[2..])
        .await
        .unwrap();
    for (node, name) in names.iter().enumerate() {
        let holder = semaphore(name, first.clone());
        let waiter = semaphore(name, second.clone());
        let held = holder.acquire().await.unwrap();
        assert!(
            waiter.try_acquire().await.unwrap().is_none(),
            "{name}: one limit"
        );
        let calls = cluster.script_calls(node).await;
        let waiting = tokio::spawn(async move {
            let permit = waiter.acquire().await;
            (permit, Instant::now())
        });
        // Waiting costs no round trips beyond the line's refresh (once a second).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let during = cluster.script_calls(node).await - calls;
        assert!(
            during <= 4,
            "{name}: {during} script calls while one waiter waited 1.5 s"
        );
        let released = Instant::now();
        drop(held);
        let (permit, woken) = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the waiter is served")
            .unwrap();
        let permit = permit.unwrap();
        // The line's own refresh comes a second apart; the announcement much sooner.
        let after = woken - released;
        assert!(
            after < Duration::from_millis(600),
            "{name}: woken {after:?} after the release"
        );
        drop(permit);
    }
}

/// The child: hammers one semaphore per node, counting holders in the owner's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the other tests"]
async fn child_process() {
    let Some((role, urls)) = child_role() else {
        return;
    };
    assert_eq!(role, "hammer", "unknown role");
    let urls: Vec<&str> = urls.split(',').collect();
    let max = hammer(&urls).await;
    println!("DLIMIT max {max}");
}

/// The semaphores the processes hammer: between them, on every node of a 3-master cluster.
const NAMES: [&str; 6] = ["sem-0", "sem-1", "sem-2", "sem-3", "sem-4", "sem-5"];

/// 6 tasks × 15 rounds on every node's semaphore (limit 2), each hold counted with INCR/DECR
/// on a key in the semaphore's slot; the largest count seen.
async fn hammer(urls: &[&str]) -> i64 {
    let backend = RedisBackend::connect_cluster(urls).await.unwrap();
    let conn = ClusterClient::new(urls.to_vec())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    let max = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for name in NAMES {
        let sem = Semaphore::builder(name)
            .limit(2)
            .acquire_timeout(Duration::from_secs(20))
            .build(backend.clone())
            .unwrap();
        for _ in 0..6 {
            let (sem, mut conn, max) = (sem.clone(), conn.clone(), max.clone());
            let counter = format!("obs:{{{name}}}");
            tasks.push(tokio::spawn(async move {
                for _ in 0..15 {
                    let permit = sem.acquire().await.unwrap();
                    let now: i64 = redis::cmd("INCR")
                        .arg(&counter)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    max.fetch_max(now as usize, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    let _: i64 = redis::cmd("DECR")
                        .arg(&counter)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    drop(permit);
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    max.load(Ordering::SeqCst) as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_holds_across_two_processes_on_every_node() {
    let cluster = Cluster::start().await;
    let mut owners = std::collections::BTreeSet::new();
    for name in NAMES {
        owners.insert(cluster.owner(&format!("dlimit:{{{name}}}:holders")).await);
    }
    assert_eq!(owners.len(), 3, "the hammered semaphores span every node");
    let urls = cluster.urls.join(",");
    let mut child = spawn_child_with("hammer", &urls);
    let urls: Vec<&str> = cluster.urls.iter().map(String::as_str).collect();
    let ours = hammer(&urls).await;
    let theirs: i64 = child_says(&mut child)
        .await
        .strip_prefix("max ")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        ours <= 2 && theirs <= 2,
        "above the limit: {ours} / {theirs}"
    );
    assert!(ours.max(theirs) == 2, "the holders never overlapped");
    assert!(child.wait().await.unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_cluster_urls_are_clear_errors_within_the_connect_timeout() {
    let bound = Duration::from_secs(10);
    // Nothing listens there.
    let started = Instant::now();
    let err = RedisBackend::cluster_builder(&["redis://127.0.0.1:1"])
        .connect_timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err:?}");
    assert!(started.elapsed() < bound, "{:?}", started.elapsed());
    // A plain, non-cluster server.
    let plain = Redis::start().await;
    let started = Instant::now();
    let err = RedisBackend::cluster_builder(&[plain.url.as_str()])
        .connect_timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err:?}");
    assert!(err.to_string().contains("cluster"), "{err}");
    assert!(started.elapsed() < bound, "{:?}", started.elapsed());
    // No URL at all, or a mix of TLS and plain nodes.
    let none: [&str; 0] = [];
    let err = RedisBackend::connect_cluster(&none).await.unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    let err = RedisBackend::connect_cluster(&["redis://127.0.0.1:1", "rediss://127.0.0.1:2"])
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
}

/// A 3-master cluster with a replica each, for failovers.
struct ReplicatedCluster {
    cluster: RedisCluster,
    urls: Vec<String>,
}

impl ReplicatedCluster {
    async fn start() -> ReplicatedCluster {
        let cluster = tokio::task::spawn_blocking(|| {
            RedisCluster::new(RedisClusterConfiguration::single_replica_config())
        })
        .await
        .unwrap();
        let urls = cluster
            .iter_servers()
            .map(|server| {
                let (host, port) = server.host_and_port().expect("TCP nodes");
                format!("redis://{host}:{port}")
            })
            .collect();
        ReplicatedCluster { cluster, urls }
    }

    async fn node(&self, index: usize) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.urls[index].as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// The master that owns `key`, and its replica (indexes into `urls`).
    async fn master_and_replica_of(&self, key: &str) -> (usize, usize) {
        let mut master = None;
        for index in 0..self.urls.len() {
            let mut node = self.node(index).await;
            let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut node).await.unwrap();
            let is_master = matches!(&role[0], redis::Value::BulkString(r) if r == b"master");
            let slot: u16 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(key)
                .query_async(&mut node)
                .await
                .unwrap();
            let nodes: String = redis::cmd("CLUSTER")
                .arg("NODES")
                .query_async(&mut node)
                .await
                .unwrap();
            let myself = nodes.lines().find(|line| line.contains("myself")).unwrap();
            let serves = myself.split(' ').skip(8).any(|range| {
                let mut bounds = range
                    .split('-')
                    .map(|b| b.parse::<u16>().unwrap_or(u16::MAX));
                let start = bounds.next().unwrap_or(u16::MAX);
                let end = bounds.next().unwrap_or(start);
                (start..=end).contains(&slot)
            });
            if is_master && serves {
                master = Some((index, myself.split(' ').next().unwrap().to_owned()));
            }
        }
        let (master, id) = master.expect("a master owns the slot");
        for index in 0..self.urls.len() {
            let mut node = self.node(index).await;
            let nodes: String = redis::cmd("CLUSTER")
                .arg("NODES")
                .query_async(&mut node)
                .await
                .unwrap();
            let myself = nodes.lines().find(|line| line.contains("myself")).unwrap();
            if myself.split(' ').nth(3) == Some(id.as_str()) {
                return (master, index);
            }
        }
        panic!("the master has no replica");
    }

    /// Makes `replica` take over, and waits until it serves as master.
    async fn fail_over(&self, replica: usize, takeover: bool) {
        let mut node = self.node(replica).await;
        let mut command = redis::cmd("CLUSTER");
        command.arg("FAILOVER");
        if takeover {
            command.arg("TAKEOVER");
        }
        command.exec_async(&mut node).await.unwrap();
        support::eventually(Duration::from_secs(20), "the replica to be master", || {
            let mut node = node.clone();
            async move {
                let role: Vec<redis::Value> =
                    redis::cmd("ROLE").query_async(&mut node).await.unwrap();
                matches!(&role[0], redis::Value::BulkString(r) if r == b"master")
            }
        })
        .await;
    }

    fn pid(&self, index: usize) -> u32 {
        self.cluster.servers[index].process.id()
    }
}

/// A planned failover of the node that owns a semaphore: the replicated holder keeps its
/// permit, the limit holds, and the waiter is served afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_keeps_replicated_permits_and_waiters() {
    let cluster = ReplicatedCluster::start().await;
    let (_, replica) = cluster
        .master_and_replica_of("dlimit:{moving}:holders")
        .await;
    let backend = RedisBackend::connect_cluster(&cluster.urls).await.unwrap();
    let sem = Semaphore::builder("moving")
        .limit(1)
        .lease(Duration::from_secs(2))
        .acquire_timeout(Duration::from_secs(60))
        .build(backend.clone())
        .unwrap();
    let held = sem.acquire().await.unwrap();
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    cluster.fail_over(replica, false).await;
    // Longer than the lease: only renewals on the new master keep the permit.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !held.is_lost(),
        "the replicated permit survived the failover"
    );
    if waiter.is_finished() {
        let early = waiter.await.unwrap();
        panic!("the waiter finished during the failover: {early:?}");
    }
    drop(held);
    let permit = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter is served after the failover")
        .unwrap()
        .unwrap();
    assert!(!permit.is_lost());
}

/// A grant the replica never saw (it was frozen and cut off), then the master dies and the
/// replica takes over: the new master does not know the holder, and its next renewal reports it
/// lost (long before its 60 s lease would end) instead of adding it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_lost_in_a_failover_is_reported_lost() {
    let cluster = ReplicatedCluster::start().await;
    let (master, replica) = cluster
        .master_and_replica_of("dlimit:{unseen}:holders")
        .await;
    let backend = RedisBackend::connect_cluster(&cluster.urls).await.unwrap();
    let sem = Semaphore::builder("unseen")
        .limit(1)
        .lease(Duration::from_secs(60))
        .build(backend)
        .unwrap();
    sem.acquire().await.unwrap().release().await.unwrap(); // the script is loaded
    // The replica, frozen, is cut off (so not even the kernel's socket buffer carries the
    // grant to it); the grant then goes to the master alone.
    support::signal(cluster.pid(replica), "STOP");
    redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .exec_async(&mut cluster.node(master).await)
        .await
        .unwrap();
    let held = sem.acquire().await.unwrap();
    // The master dies with the grant (a frozen master would leave redis-rs's cluster client
    // waiting on it: it refreshes its slot map on connection errors, not on timeouts).
    support::signal(cluster.pid(master), "KILL");
    support::signal(cluster.pid(replica), "CONT");
    cluster.fail_over(replica, true).await;
    // The next call through the backend follows the slot to the new master, and the holder's
    // renewal there finds it unknown: lost, long before its 60 s lease would end.
    let _ = sem.available_permits().await;
    tokio::time::timeout(Duration::from_secs(25), held.lost())
        .await
        .expect("the holder the new master never saw is lost");
    // The new master serves the semaphore.
    let again = tokio::time::timeout(Duration::from_secs(10), sem.acquire())
        .await
        .expect("bounded")
        .expect("the new master grants");
    drop(again);
}

/// `rate_limit` on a cluster: a limiter named like its semaphore shares its slot, so a request
/// is decided in one script call on the owning node; a limiter in another slot (on another
/// node) is never sent with the acquire (that would be a CROSSSLOT error) but checked after
/// it, all or nothing all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_is_one_call_in_one_slot_and_two_across_nodes() {
    use tower::{ServiceExt, service_fn};
    use tower_distributed_limit::{DistributedConcurrencyLimitLayer, RateLimiter};
    let cluster = Cluster::start().await;
    let names = cluster.one_name_per_node().await;
    let backend = RedisBackend::connect_cluster(&cluster.urls).await.unwrap();
    for (rate_name, calls_per_request) in [(&names[0], 1), (&names[1], 2)] {
        let sem = semaphore(&names[0], backend.clone());
        let rate = RateLimiter::builder(rate_name)
            .rate(3, Duration::from_secs(3600))
            .build(backend.clone())
            .unwrap();
        // Both scripts known to their nodes, so every call below is one script call.
        assert!(rate.check().await.unwrap().allowed);
        drop(sem.try_acquire().await.unwrap());
        sem.available_permits().await.unwrap();
        let entered = Arc::new(tokio::sync::Notify::new());
        let finish = Arc::new(tokio::sync::Notify::new());
        let svc = tower::Layer::layer(
            &DistributedConcurrencyLimitLayer::new(sem.clone())
                .rate_limit(rate)
                .reject_when_full(),
            service_fn({
                let (entered, finish) = (entered.clone(), finish.clone());
                move |()| {
                    let (entered, finish) = (entered.clone(), finish.clone());
                    async move {
                        entered.notify_one();
                        finish.notified().await;
                        Ok::<_, tower::BoxError>(())
                    }
                }
            }),
        );
        let calls = || async {
            let mut total = 0;
            for node in 0..cluster.urls.len() {
                total += cluster.script_calls(node).await;
            }
            total
        };
        // Starts a request and returns once the service runs it (bounded; a request that ends
        // first is a failure, shown with its result). Its task is handed back, to be awaited
        // once the test lets the service finish.
        #[allow(clippy::async_yields_async)]
        let start = || async {
            let mut request = tokio::spawn(svc.clone().oneshot(()));
            tokio::select! {
                () = entered.notified() => {}
                done = &mut request => panic!("limiter {rate_name}: the request ended first: {done:?}"),
                () = tokio::time::sleep(Duration::from_secs(10)) => panic!("the service never ran"),
            }
            request
        };
        let before = calls().await;
        let request = start().await;
        assert_eq!(
            calls().await - before,
            calls_per_request,
            "limiter {rate_name}: script calls before the service ran"
        );
        finish.notify_one();
        request.await.unwrap().unwrap();
        let second = start().await;
        finish.notify_one();
        second.await.unwrap().unwrap();
        // The second request's permit goes back in the background: until it has, a third
        // request would find the semaphore full before the rate refused it.
        support::wait_until_available(&sem, 1).await;
        let refused = svc.clone().oneshot(()).await.unwrap_err();
        assert!(
            matches!(
                refused.downcast_ref::<Error>(),
                Some(Error::RateLimited { .. })
            ),
            "limiter {rate_name}: {refused}"
        );
        support::wait_until_available(&sem, 1).await;
    }
}

/// `wait_for_replicas` on a cluster: `WAIT` goes in the same pipeline as the script call, to
/// the node that owns the semaphore's slot, so a grant counts once that node's replica has it,
/// and fails while the replica cannot acknowledge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_replicas_asks_the_node_that_owns_the_semaphore() {
    let cluster = ReplicatedCluster::start().await;
    let (_, replica) = cluster
        .master_and_replica_of("dlimit:{acked}:holders")
        .await;
    let backend = RedisBackend::cluster_builder(&cluster.urls)
        .wait_for_replicas(1, Duration::from_millis(200))
        .connect()
        .await
        .expect("wait_for_replicas is accepted on a cluster");
    let sem = Semaphore::builder("acked")
        .limit(1)
        .lease(Duration::from_secs(5))
        .build(backend)
        .unwrap();
    sem.acquire()
        .await
        .expect("granted once the owner's replica acknowledged")
        .release()
        .await
        .unwrap();
    support::signal(cluster.pid(replica), "STOP");
    let err = sem.acquire().await.expect_err("no replica acknowledges");
    support::signal(cluster.pid(replica), "CONT");
    assert!(
        err.to_string().contains("0 of 1 replicas acknowledged"),
        "{err}"
    );
    // The refused grant was given back: the slot is free again once the replica answers.
    let permit = tokio::time::timeout(Duration::from_secs(10), sem.acquire())
        .await
        .expect("bounded")
        .expect("granted again with the replica back");
    assert!(!permit.is_lost());
}
