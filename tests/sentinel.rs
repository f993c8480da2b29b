//! Sentinel: a real master, its replica and three sentinels (redis-test's spawner). The backend
//! finds the master through the sentinels, and after a forced failover (`SENTINEL FAILOVER`)
//! it follows the new master with no restart: acquires succeed, waiters are woken, the
//! subscription moved along. A master name the sentinels do not know is a clear error.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis_test::sentinel::RedisSentinelCluster;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::watch;
use tokio::time::Instant;
use tower_distributed_limit::{Error, RedisBackend, RedisBackendBuilder, Semaphore};

use support::eventually;

const MASTER: &str = "master0";

struct Sentinels {
    cluster: RedisSentinelCluster,
    urls: Vec<String>,
}

impl Sentinels {
    async fn start() -> Sentinels {
        Sentinels::with_replicas(1).await
    }

    async fn with_replicas(replicas: u16) -> Sentinels {
        let cluster =
            tokio::task::spawn_blocking(move || RedisSentinelCluster::new(1, replicas, 3))
                .await
                .unwrap();
        let urls = cluster
            .iter_sentinel_servers()
            .map(|server| {
                let (host, port) = server.host_and_port().expect("TCP sentinels");
                format!("redis://{host}:{port}")
            })
            .collect::<Vec<String>>();
        // Every sentinel answering: the backend names a master only on a majority's word.
        for url in &urls {
            eventually(
                Duration::from_secs(20),
                "every sentinel to answer",
                || async {
                    let Ok(client) = redis::Client::open(url.as_str()) else {
                        return false;
                    };
                    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
                        return false;
                    };
                    redis::cmd("PING")
                        .query_async::<String>(&mut conn)
                        .await
                        .is_ok()
                },
            )
            .await;
        }
        Sentinels { cluster, urls }
    }

    /// A connection to a sentinel that answers (on a loaded machine one may be slow to).
    async fn sentinel(&self) -> redis::aio::MultiplexedConnection {
        for attempt in 0..30 {
            let url = &self.urls[attempt % self.urls.len()];
            let client = redis::Client::open(url.as_str()).unwrap();
            if let Ok(conn) = client.get_multiplexed_async_connection().await {
                return conn;
            }
        }
        panic!("no sentinel accepts a connection");
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

    /// Forces a failover and waits until the sentinels name another master. Until they
    /// have seen a replica answer they refuse (NOGOODSLAVE), and while the last failover
    /// still reconfigures its replicas too (INPROG).
    async fn fail_over(&self) {
        let before = self.master_addr().await;
        eventually(
            Duration::from_secs(30),
            "the sentinels to start a failover",
            || async {
                redis::cmd("SENTINEL")
                    .arg("FAILOVER")
                    .arg(MASTER)
                    .exec_async(&mut self.sentinel().await)
                    .await
                    .is_ok()
            },
        )
        .await;
        eventually(
            Duration::from_secs(30),
            "the sentinels to name a new master",
            || async { self.master_addr().await != before },
        )
        .await;
    }

    /// Whether `server` serves as a replica now.
    async fn is_replica(&self, server: usize) -> bool {
        let (host, port) = self.cluster.servers[server].host_and_port().unwrap();
        let client = redis::Client::open(format!("redis://{host}:{port}")).unwrap();
        let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
            return false;
        };
        // A node being reconfigured may drop the connection: not a replica yet, ask again.
        let Ok(role) = redis::cmd("ROLE")
            .query_async::<Vec<redis::Value>>(&mut conn)
            .await
        else {
            return false;
        };
        matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"slave")
    }

    /// Waits until `server` serves as a replica.
    async fn demoted(&self, server: usize) {
        eventually(
            Duration::from_secs(30),
            "the old master to be a replica",
            || self.is_replica(server),
        )
        .await;
    }

    fn backend(&self) -> RedisBackendBuilder {
        RedisBackend::sentinel_builder(&self.urls, MASTER).call_timeout(Duration::from_millis(300))
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

    let old = sentinels.server_at(&sentinels.master_addr().await);
    sentinels.fail_over().await;
    sentinels.demoted(old).await;

    // Acquires find their way to the new master, once it has waited out the promotion
    // fence (a lease and 2 s: grants the old master may have made meanwhile have ended).
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
    // Until the sentinels have seen the thawed replica answer again, they find no replica to
    // promote (NOGOODSLAVE): `fail_over` asks until they start.
    sentinels.fail_over().await;
    // Any call through the backend (here: asking how many permits are free) finds the old
    // master gone, follows the sentinels to the new one, and makes holders renew at once.
    let _ = sem.available_permits().await;
    tokio::time::timeout(Duration::from_secs(10), held.lost())
        .await
        .expect("the holder the new master never saw is lost, long before its lease ends");
    support::signal(sentinels.pid(master), "CONT");
}

/// One hold as its holder saw it, timed on this process's clock.
struct Hold {
    start: Instant,
    /// The end of the interval the holder was told it held (see `tests/soak.rs`'s counting
    /// rule): its release if the permit was not lost by then, else no later than its lease.
    until: Instant,
}

/// Tasks that acquire, hold for 5-60 ms (or until the permit is lost), and give back, until
/// `stop`; every hold is pushed to `holds`.
fn hammer(
    sem: Semaphore,
    tasks: usize,
    holds: Arc<Mutex<Vec<Hold>>>,
    stop: watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..tasks)
        .map(|_| {
            let (sem, holds, stop) = (sem.clone(), holds.clone(), stop.clone());
            tokio::spawn(async move {
                while !*stop.borrow() {
                    let Ok(permit) = sem.acquire().await else {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    };
                    let start = Instant::now();
                    let promised = start + permit.remaining();
                    if permit.is_lost() {
                        continue;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(fastrand::u64(5..=60))) => {}
                        _ = permit.lost() => {}
                    }
                    let end = Instant::now();
                    let until = if permit.is_lost() {
                        end.min(promised)
                    } else {
                        end
                    };
                    holds.lock().unwrap().push(Hold { start, until });
                }
            })
        })
        .collect()
}

/// The most holds that overlap at any moment.
fn most_at_once(holds: &[Hold]) -> usize {
    let mut events: Vec<(Instant, i32)> = holds
        .iter()
        .filter(|hold| hold.until > hold.start)
        .flat_map(|hold| [(hold.start, 1), (hold.until, -1)])
        .collect();
    // Ends before starts at the same instant (half-open intervals).
    events.sort();
    let (mut now, mut most) = (0, 0);
    for (_, delta) in events {
        now += delta;
        most = most.max(now);
    }
    most as usize
}

/// Two forced failovers while processes hold and acquire: some started before the first
/// (connected to the old master, which stays writable until the sentinels reconfigure it), one
/// after it (connected to the new master at once). Never more holders than the limit across
/// old and new master, and the old processes are served by the new master afterwards.
async fn failovers_never_double_the_limit(wait: bool) {
    let sentinels = Sentinels::with_replicas(2).await;
    let limit = 2;
    let semaphore = |backend| {
        Semaphore::builder("failing-over")
            .limit(limit)
            .lease(Duration::from_millis(1500))
            .acquire_timeout(Duration::from_secs(10))
            .build(backend)
            .unwrap()
    };
    let backend = || async {
        let builder = sentinels.backend();
        let builder = if wait {
            builder.wait_for_replicas(1, Duration::from_millis(100))
        } else {
            builder
        };
        builder.connect().await.unwrap()
    };
    let holds = Arc::new(Mutex::new(Vec::new()));
    let (stop, stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    for _ in 0..2 {
        tasks.extend(hammer(
            semaphore(backend().await),
            3,
            holds.clone(),
            stopped.clone(),
        ));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    for round in 0..2 {
        sentinels.fail_over().await;
        if round == 0 {
            tasks.extend(hammer(
                semaphore(backend().await),
                3,
                holds.clone(),
                stopped.clone(),
            ));
        }
        // Past the promotion fence (lease 1.5 s + 1.3 s): the new master serves.
        tokio::time::sleep(Duration::from_secs(7)).await;
    }
    let served_before = holds.lock().unwrap().len();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.send(true).unwrap();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("the tasks stop")
            .unwrap();
    }
    let holds = holds.lock().unwrap();
    let most = most_at_once(&holds);
    assert!(
        most <= limit as usize,
        "{most} holders at once (limit {limit}) across old and new master"
    );
    assert!(
        holds.len() > served_before,
        "the new master serves after the failovers ({} holds in all)",
        holds.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failovers_never_double_the_limit_without_wait() {
    failovers_never_double_the_limit(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failovers_never_double_the_limit_with_wait() {
    failovers_never_double_the_limit(true).await;
}

/// The child of `a_process_frozen_across_a_failover_wakes_on_the_new_master`: connects, says
/// `ready`, and on each line of stdin tries to acquire for 1 s and says what happened (`held`,
/// `full`, or `error`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the other tests"]
async fn child_process() {
    let Some((role, urls)) = support::child_role() else {
        return;
    };
    assert_eq!(role, "frozen", "unknown role");
    let urls: Vec<&str> = urls.split(',').collect();
    let backend = RedisBackend::sentinel_builder(&urls, MASTER)
        .call_timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let sem = Semaphore::builder("frozen")
        .limit(1)
        .lease(Duration::from_millis(1500))
        .acquire_timeout(Duration::from_secs(1))
        .build(backend)
        .unwrap();
    // A round trip on the first master: the script is loaded, the connection in use.
    drop(sem.acquire().await.unwrap());
    println!("DLIMIT ready");
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(_)) = lines.next_line().await {
        match sem.acquire().await {
            Ok(mut permit) => {
                println!("DLIMIT held {}", permit.fencing_token());
                permit.release().await.unwrap();
            }
            Err(Error::Timeout { .. }) => println!("DLIMIT full"),
            Err(e) => println!("DLIMIT error {e}"),
        }
    }
}

/// A process frozen while its master is deposed wakes up still connected to the old master,
/// which is still writable for a while (it was frozen too, so not reconfigured yet). It must not be granted there: its first call asks the
/// sentinels (their word is older than a second), moves to the new master, and finds the only
/// slot taken there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_frozen_across_a_failover_wakes_on_the_new_master() {
    let sentinels = Sentinels::with_replicas(2).await;
    let mut child = support::spawn_child_with("frozen", &sentinels.urls.join(","));
    assert_eq!(support::child_says(&mut child).await, "ready");
    let pid = child.id().unwrap();
    support::signal(pid, "STOP");
    // The old master is frozen through the failover, so the sentinels cannot reconfigure it
    // yet: thawed, it still takes writes, as a master cut off by a partition would.
    let old = sentinels.server_at(&sentinels.master_addr().await);
    support::signal(sentinels.pid(old), "STOP");
    sentinels.fail_over().await;
    // The only slot, taken on the new master (once its promotion fence has passed). Until
    // every sentinel has learnt of the switch, one may still name the frozen master.
    let started = Instant::now();
    let backend = loop {
        match sentinels.backend().connect().await {
            Ok(backend) => break backend,
            Err(e) if started.elapsed() < Duration::from_secs(20) => eprintln!("{e}"),
            Err(e) => panic!("{e}"),
        }
    };
    let sem = Semaphore::builder("frozen")
        .limit(1)
        .lease(Duration::from_millis(1500))
        .acquire_timeout(Duration::from_secs(15))
        .build(backend)
        .unwrap();
    let held = sem.acquire().await.unwrap();
    support::signal(sentinels.pid(old), "CONT");
    support::signal(pid, "CONT");
    let stdin = child.stdin.as_mut().unwrap();
    stdin.write_all(b"acquire\n").await.unwrap();
    let said = support::child_says(&mut child).await;
    assert_eq!(
        said,
        "full",
        "the woken process must find the slot taken on the new master (old master still \
         writable: {})",
        !sentinels.is_replica(old).await
    );
    assert!(!held.is_lost());
    drop(held);
    // Served by the new master once the slot is free.
    let mut said = String::new();
    for _ in 0..10 {
        let stdin = child.stdin.as_mut().unwrap();
        stdin.write_all(b"acquire\n").await.unwrap();
        said = support::child_says(&mut child).await;
        if said.starts_with("held") {
            return;
        }
    }
    panic!("the woken process is not served by the new master: {said}");
}

/// A sentinel of its own (`redis-server --sentinel`) that watches `MASTER` at `port` and
/// knows nothing else: no other sentinel and no replica ever reach it, so it names that node
/// for as long as it runs. Killed when dropped.
struct LoneSentinel {
    _child: tokio::process::Child,
    url: String,
    dir: std::path::PathBuf,
}

impl LoneSentinel {
    async fn naming(port: u16) -> LoneSentinel {
        let dir = std::env::temp_dir().join(format!("dlimit-sentinel-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let own = support::free_port();
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {own}\nbind 127.0.0.1\ndir {}\nsentinel monitor {MASTER} 127.0.0.1 {port} 1\n",
                dir.display()
            ),
        )
        .unwrap();
        let child = tokio::process::Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start a sentinel");
        let url = format!("redis://127.0.0.1:{own}");
        let lone = LoneSentinel {
            _child: child,
            url,
            dir,
        };
        eventually(
            Duration::from_secs(10),
            "the lone sentinel to answer",
            || async { lone.named().await == Some(port) },
        )
        .await;
        lone
    }

    /// The port of the master it names.
    async fn named(&self) -> Option<u16> {
        let client = redis::Client::open(self.url.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(MASTER)
            .query_async(&mut conn)
            .await
            .ok()?;
        addr.map(|(_, port)| port)
    }
}

impl Drop for LoneSentinel {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One sentinel names another writable node as the master (it has not heard of a failover
/// yet, or it is misconfigured) and it is asked first: it is outvoted. Nothing is written to
/// that node, at connect or on any later call (the heartbeat asks every sentinel again), and
/// the limit is the one the master the others name keeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_that_names_another_master_is_outvoted() {
    let sentinels = Sentinels::start().await;
    let stray = support::Redis::start().await;
    let port = stray.url.rsplit(':').next().unwrap().parse().unwrap();
    let lone = LoneSentinel::naming(port).await;
    let mut urls = vec![lone.url.clone()];
    urls.extend(sentinels.urls.iter().cloned());
    let backend = RedisBackend::sentinel_builder(&urls, MASTER)
        .call_timeout(Duration::from_millis(300))
        .connect()
        .await
        .expect("three of four sentinels name the master");
    let sem = semaphore(backend);
    let first = sem.acquire().await.unwrap();
    // Past a few heartbeats, every one of which heard the lone sentinel name the stray node.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let second = sem.try_acquire().await;
    assert!(
        matches!(second, Ok(None)),
        "the slot is taken on the master: {second:?}"
    );
    drop(first);
    sem.acquire().await.unwrap().release().await.unwrap();
    assert_eq!(
        lone.named().await,
        Some(port),
        "still naming the stray node"
    );
    assert_eq!(
        stray.dbsize().await,
        0,
        "nothing was written to the stray node"
    );
}
