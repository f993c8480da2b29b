//! QuorumBackend on 3 independent redis-servers: the Semaphore API, the limit across OS
//! processes (counted by an observer on a fourth server), nodes killed, restarted empty and
//! paused mid-run, two nodes down, and the naive "majority said yes" design, run on the same
//! schedule as a reference, exceeding the limit where the slot design does not.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tower_distributed_limit::{Error, QuorumBackend, Semaphore, SemaphoreBuilder};

use support::{Redis, child_role, child_says, long_lived, signal, spawn_child_with};

/// One second leases: a node restarted empty abstains for a lease, and tests stay short.
fn semaphore(name: &str, limit: u32) -> SemaphoreBuilder {
    Semaphore::builder(name)
        .limit(limit)
        .lease(Duration::from_secs(1))
        .acquire_timeout(Duration::from_secs(10))
}

async fn quorum(urls: &[String]) -> QuorumBackend {
    QuorumBackend::builder(urls)
        .call_timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap()
}

async fn three_nodes() -> (Vec<Redis>, Vec<String>) {
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(Redis::start().await);
    }
    let urls = nodes.iter().map(|node| node.url.clone()).collect();
    (nodes, urls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_semaphore_api_works_on_a_quorum() {
    let (_nodes, urls) = three_nodes().await;
    let sem = semaphore("api", 3).build(quorum(&urls).await).unwrap();
    // Three fresh nodes are a cold start: the first grant comes at once.
    let two = sem.acquire_many(2).await.unwrap();
    assert_eq!(two.weight(), 2);
    assert_eq!(sem.available_permits().await.unwrap(), 1);
    assert!(
        sem.try_acquire_many(2).await.unwrap().is_none(),
        "only one slot is free"
    );
    let one = sem.try_acquire().await.unwrap().expect("one slot is free");
    assert!(sem.try_acquire().await.unwrap().is_none());
    drop(two);
    let again = sem.acquire_many(2).await.unwrap();
    // A held permit is renewed past its lease.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!again.is_lost() && !one.is_lost());
    assert!(
        sem.try_acquire().await.unwrap().is_none(),
        "renewed slots stay held"
    );
    // A snapshot sees the holders on a majority; a set limit counts on every process.
    let snap = sem.snapshot().await.unwrap();
    assert_eq!((snap.limit, snap.used, snap.holders.len()), (3, 3, 2));
    assert!(
        snap.holders
            .iter()
            .any(|h| h.id == again.id() && h.weight == 2)
    );
    drop((one, again));
    assert!(!snap.pinned);
    sem.set_limit(1).await.unwrap();
    let snap = sem.snapshot().await.unwrap();
    assert_eq!((snap.limit, snap.pinned), (1, true));
    let only = sem.acquire().await.unwrap();
    assert!(
        sem.try_acquire().await.unwrap().is_none(),
        "one slot under the set limit"
    );
    drop(only);
    // Unpinned, each process admits by its configured limit again.
    sem.unset_limit().await.unwrap();
    let snap = sem.snapshot().await.unwrap();
    assert_eq!((snap.limit, snap.pinned), (3, false));

    // Limit 1: one slot, fencing tokens strictly increase from holder to holder.
    let mutex = semaphore("mutex", 1).build(quorum(&urls).await).unwrap();
    let mut last = 0;
    for _ in 0..5 {
        let mut permit = mutex.acquire().await.unwrap();
        assert!(permit.fencing_token() > last);
        last = permit.fencing_token();
        permit.release().await.unwrap();
    }
}

/// The child: hammers semaphore `name` with limit `limit` for `secs`, counting holders on an
/// observer server; says the largest count and how many it acquired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of the other tests"]
async fn child_process() {
    let Some((role, urls)) = child_role() else {
        return;
    };
    let mut parts = role.split(':');
    assert_eq!(parts.next(), Some("hammer"), "unknown role {role}");
    let limit: u32 = parts.next().unwrap().parse().unwrap();
    let secs: u64 = parts.next().unwrap().parse().unwrap();
    let (observer, nodes) = urls.split_once('|').unwrap();
    let nodes: Vec<String> = nodes.split(',').map(str::to_owned).collect();
    let (max, acquired) = hammer(observer, &nodes, limit, Duration::from_secs(secs)).await;
    println!("DLIMIT max {max} acquired {acquired}");
}

/// 6 tasks hold `limit`'s semaphore for 5–20 ms at a time until `run` passes; each hold is
/// counted with INCR/DECR on the observer. The largest count seen, and the holds.
async fn hammer(observer: &str, nodes: &[String], limit: u32, run: Duration) -> (i64, u64) {
    // A 3 s lease: a loaded machine's pauses do not expire a hold that is still counted.
    let sem = semaphore(&format!("hammer-{limit}"), limit)
        .lease(Duration::from_secs(3))
        .acquire_timeout(Duration::from_secs(3))
        .build(quorum(nodes).await)
        .unwrap();
    let conn = redis::Client::open(observer)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let key = format!("holders-{limit}");
    let (max, acquired) = (Arc::new(AtomicI64::new(0)), Arc::new(AtomicU64::new(0)));
    let end = Instant::now() + run;
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let (sem, mut conn, key) = (sem.clone(), conn.clone(), key.clone());
            let (max, acquired) = (max.clone(), acquired.clone());
            tokio::spawn(async move {
                while Instant::now() < end {
                    let permit = match sem.acquire().await {
                        Ok(permit) => permit,
                        // Nodes down or quarantined for a while: try again.
                        Err(Error::Timeout { .. } | Error::Backend(_)) => continue,
                        Err(e) => panic!("{e}"),
                    };
                    let now: i64 = redis::cmd("INCR")
                        .arg(&key)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    max.fetch_max(now, Ordering::SeqCst);
                    acquired.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(5 + fastrand::u64(..15))).await;
                    let _: i64 = redis::cmd("DECR")
                        .arg(&key)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    drop(permit);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    (max.load(Ordering::SeqCst), acquired.load(Ordering::SeqCst))
}

fn parse_report(said: &str) -> (i64, u64) {
    let mut words = said.split(' ');
    assert_eq!(words.next(), Some("max"));
    let max = words.next().unwrap().parse().unwrap();
    assert_eq!(words.next(), Some("acquired"));
    (max, words.next().unwrap().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_holds_across_processes_for_limits_2_and_5() {
    let (nodes, urls) = three_nodes().await;
    long_lived(&nodes).await;
    let observer = Redis::start().await;
    for limit in [2, 5] {
        let spec = format!("{}|{}", observer.url, urls.join(","));
        let mut children: Vec<_> = (0..2)
            .map(|_| spawn_child_with(&format!("hammer:{limit}:4"), &spec))
            .collect();
        let (ours, _) = hammer(&observer.url, &urls, limit, Duration::from_secs(4)).await;
        let mut max = ours;
        for child in &mut children {
            let (theirs, acquired) = parse_report(&child_says(child).await);
            assert!(acquired > 0);
            max = max.max(theirs);
        }
        assert!(max <= i64::from(limit), "limit {limit}: {max} held at once");
        assert!(max >= 2, "limit {limit}: the holders never overlapped");
    }
}

/// Mid-run: one node killed and restarted empty, then another paused. Never above the limit,
/// and work goes on once a majority is healthy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_restarted_empty_and_paused_nodes_never_break_the_limit() {
    let (mut nodes, urls) = three_nodes().await;
    long_lived(&nodes).await;
    let observer = Redis::start().await;
    let spec = format!("{}|{}", observer.url, urls.join(","));
    let mut children: Vec<_> = (0..2)
        .map(|_| spawn_child_with("hammer:2:9", &spec))
        .collect();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    nodes[0].kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    nodes[0].restart().await; // empty: it abstains for a lease
    tokio::time::sleep(Duration::from_millis(1500)).await;
    signal(nodes[1].pid(), "STOP");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    signal(nodes[1].pid(), "CONT");
    let late = Instant::now();
    let mut max = 0;
    for child in &mut children {
        let (theirs, acquired) = parse_report(&child_says(child).await);
        assert!(acquired > 0);
        max = max.max(theirs);
    }
    assert!(max <= 2, "{max} held at once");
    // Work went on after the faults: the children ran until 9 s, about 3 s past them.
    assert!(late.elapsed() >= Duration::from_secs(1));
    let key_after: i64 = redis::cmd("GET")
        .arg("holders-2")
        .query_async(&mut observer.conn().await)
        .await
        .unwrap();
    assert_eq!(key_after, 0, "every hold was counted out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_down_is_a_backend_failure_within_the_timeout() {
    let (mut nodes, urls) = three_nodes().await;
    let sem = semaphore("down", 2).build(quorum(&urls).await).unwrap();
    drop(sem.acquire().await.unwrap()); // a cold start: every node took part
    nodes[0].kill();
    nodes[1].kill();
    let started = Instant::now();
    assert!(matches!(sem.acquire().await, Err(Error::Backend(_))));
    assert!(matches!(sem.try_acquire().await, Err(Error::Backend(_))));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(sem.outage_decisions() >= 2);
}

#[tokio::test]
async fn bad_quorum_settings_are_config_errors() {
    let two = ["redis://127.0.0.1:1", "redis://127.0.0.1:2"];
    assert!(matches!(
        QuorumBackend::connect(&two).await,
        Err(Error::Config(_))
    ));
    let three = [
        "redis://127.0.0.1:1",
        "redis://127.0.0.1:2",
        "redis://127.0.0.1:3",
    ];
    let err = QuorumBackend::builder(&three)
        .clock_drift_factor(1.5)
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    let err = QuorumBackend::builder(&three)
        .connect_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err:?}");
}

/// The naive design, as a reference: on each node "if fewer than L hold, add me", and a
/// majority of yeses is a grant.
async fn naive_acquire(nodes: &[&Redis], limit: u32, member: &str) -> usize {
    let script = redis::Script::new(
        "if redis.call('SCARD', KEYS[1]) < tonumber(ARGV[1]) then \
           redis.call('SADD', KEYS[1], ARGV[2]) return 1 end return 0",
    );
    let mut yes = 0;
    for node in nodes {
        let got: i64 = script
            .key("naive")
            .arg(limit)
            .arg(member)
            .invoke_async(&mut node.conn().await)
            .await
            .unwrap();
        yes += got as usize;
    }
    yes
}

/// Three clients that each reach a different two of the three nodes, limit 2. The naive
/// design grants all three (each won a majority); the slot design grants two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_naive_majority_design_exceeds_the_limit_and_slots_do_not() {
    let (nodes, urls) = three_nodes().await;
    long_lived(&nodes).await;
    let pairs = [(0, 1), (1, 2), (0, 2)];

    let mut naive_holders = 0;
    for (i, (a, b)) in pairs.into_iter().enumerate() {
        let yes = naive_acquire(&[&nodes[a], &nodes[b]], 2, &format!("client-{i}")).await;
        if yes >= 2 {
            naive_holders += 1;
        }
    }
    assert_eq!(
        naive_holders, 3,
        "the naive design admits three holders on a limit of 2"
    );

    // The same schedule with QuorumBackend: each client is configured with all three nodes
    // but one of them unreachable to it (a closed port in its place).
    let closed = format!("redis://127.0.0.1:{}", support::free_port());
    let mut holders = Vec::new();
    for (a, b) in pairs {
        let reach = [urls[a].clone(), urls[b].clone(), closed.clone()];
        // A lease far longer than the test: no slot can come back by expiry.
        let sem = semaphore("slots", 2)
            .lease(Duration::from_secs(60))
            .acquire_timeout(Duration::from_secs(3))
            .build(quorum(&reach).await)
            .unwrap();
        match sem.acquire().await {
            Ok(permit) => holders.push(permit),
            Err(e) => assert!(matches!(e, Error::Timeout { .. }), "{e}"),
        }
    }
    assert_eq!(
        holders.len(),
        2,
        "the slot design never admits more than the limit"
    );
}

/// How many slots of semaphore `name` node `node` holds (default key prefix).
async fn owned_on(node: &Redis, name: &str) -> u64 {
    redis::cmd("ZCARD")
        .arg(format!("dlimit:quorum:{name}:owned"))
        .query_async(&mut node.conn().await)
        .await
        .unwrap()
}

/// The node's clock, in ms.
async fn clock_ms(node: &Redis) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME")
        .query_async(&mut node.conn().await)
        .await
        .unwrap();
    secs * 1000 + micros / 1000
}

/// When the node's data began (its `born`, ms on its clock).
async fn born_on(node: &Redis) -> u64 {
    redis::cmd("GET")
        .arg("dlimit:quorum:born")
        .query_async(&mut node.conn().await)
        .await
        .unwrap()
}

/// Waits until `node`'s clock reads `ms`.
async fn until_clock(node: &Redis, ms: u64) {
    let now = clock_ms(node).await;
    tokio::time::sleep(Duration::from_millis(ms.saturating_sub(now))).await;
}

/// Three new nodes are a cold start, not three restarts (issue 21): with a 30 s lease the first
/// permit comes at once instead of a lease later, and the limit holds from the first grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_nodes_are_a_cold_start_and_grant_at_once() {
    let (_nodes, urls) = three_nodes().await;
    let sem = semaphore("cold", 2)
        .lease(Duration::from_secs(30))
        .acquire_timeout(Duration::from_secs(5))
        .build(quorum(&urls).await)
        .unwrap();
    let started = Instant::now();
    let first = sem.acquire().await.unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "the first grant took {took:?}"
    );
    let second = sem
        .try_acquire()
        .await
        .unwrap()
        .expect("a second slot is free");
    assert!(sem.try_acquire().await.unwrap().is_none(), "limit 2");
    drop((first, second));
}

/// A node restarted empty while the two others are healthy abstains for a lease, even within
/// the nodes' first lease (all three younger than a lease): the two others took part in the
/// cold start, so only one abstains, which is no cold start. Meanwhile the limit holds, and a
/// refusal that the abstention causes says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_empty_while_two_are_healthy_abstains_for_a_lease() {
    let (mut nodes, urls) = three_nodes().await;
    let lease = Duration::from_secs(2);
    let sem = semaphore("restart", 1)
        .lease(lease)
        .build(quorum(&urls).await)
        .unwrap();
    let started = Instant::now();
    sem.acquire().await.unwrap().release().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "a cold start"
    );

    // A holder that reaches nodes 0 and 1 only (a closed port in place of node 2): only they
    // know its slot.
    let closed = format!("redis://127.0.0.1:{}", support::free_port());
    let partial = semaphore("restart", 1)
        .lease(lease)
        .build(quorum(&[urls[0].clone(), urls[1].clone(), closed]).await)
        .unwrap();
    let mut held = partial.acquire().await.unwrap();
    assert_eq!(owned_on(&nodes[2], "restart").await, 0);

    // Node 0 forgets it. Taking the slot on nodes 0 and 2 would make two holders.
    nodes[0].kill();
    nodes[0].restart().await;
    let sem = semaphore("restart", 1)
        .lease(lease)
        .build(quorum(&urls).await)
        .unwrap();
    match sem.try_acquire().await {
        Err(Error::Backend(e)) => {
            let text = e.to_string();
            assert!(text.contains("abstain"), "{text}");
            assert!(!text.contains("raise the semaphore's limit"), "{text}");
        }
        Ok(Some(_)) => panic!("two holders on a limit of 1"),
        other => panic!("expected the abstention to be reported, got {other:?}"),
    }
    assert_eq!(owned_on(&nodes[0], "restart").await, 0);
    let born = born_on(&nodes[0]).await;

    // Once the holder is gone, nodes 1 and 2 grant; node 0 takes no part for a lease.
    held.release().await.unwrap();
    let lease_ms = lease.as_millis() as u64;
    let mut permit = sem.acquire().await.unwrap();
    assert_eq!(owned_on(&nodes[0], "restart").await, 0);
    permit.release().await.unwrap();
    until_clock(&nodes[0], born + lease_ms - 300).await;
    let mut permit = sem.acquire().await.unwrap();
    assert_eq!(
        owned_on(&nodes[0], "restart").await,
        0,
        "node 0 abstains for a whole lease"
    );
    permit.release().await.unwrap();

    // A lease after its first take, node 0 takes part again.
    until_clock(&nodes[0], born + lease_ms).await;
    let _permit = sem.acquire().await.unwrap();
    support::eventually(Duration::from_secs(2), "node 0 to take part", || async {
        owned_on(&nodes[0], "restart").await == 1
    })
    .await;
}

/// One node down and one restarted empty leave one node that may grant: the abstention
/// blocks every grant for a lease. That is reported as what it is (which node abstains, for
/// how long), never as a full semaphore, and a wait that outlasts it gets the permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abstention_that_blocks_a_grant_is_reported_as_such() {
    let (mut nodes, urls) = three_nodes().await;
    long_lived(&nodes).await;
    nodes[2].kill();
    nodes[1].kill();
    nodes[1].restart().await;
    let lease = Duration::from_secs(2);
    let sem = semaphore("blocked", 2)
        .lease(lease)
        .acquire_timeout(Duration::from_millis(300))
        .build(quorum(&urls).await)
        .unwrap();
    let restarted = urls[1].trim_start_matches("redis://");
    let reported = |error: Error| {
        let text = error.to_string();
        assert!(matches!(error, Error::Backend(_)), "{error:?}");
        assert!(text.contains("abstain"), "{text}");
        assert!(text.contains("restart"), "{text}");
        assert!(text.contains(restarted), "names the node: {text}");
        assert!(text.contains("for another"), "says until when: {text}");
        assert!(!text.contains("raise the semaphore's limit"), "{text}");
    };
    reported(sem.try_acquire().await.expect_err("no majority may grant"));
    let started = Instant::now();
    reported(sem.acquire().await.expect_err("no majority may grant"));
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "an abstention longer than the acquire timeout is reported at once: {:?}",
        started.elapsed()
    );
    assert!(sem.outage_decisions() >= 2);

    // A wait that outlasts the abstention gets the permit when it ends.
    let born = born_on(&nodes[1]).await;
    let patient = semaphore("blocked", 2)
        .lease(lease)
        .acquire_timeout(Duration::from_secs(5))
        .build(quorum(&urls).await)
        .unwrap();
    let _permit = patient.acquire().await.unwrap();
    assert!(clock_ms(&nodes[1]).await >= born + lease.as_millis() as u64);
    assert_eq!(owned_on(&nodes[1], "blocked").await, 1);
}

/// Shares need one store that sees every class's and tenant's holders: a quorum refuses them
/// when the semaphore is built, and admits classes and tenants without shares (in arrival
/// order, as documented).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_refuses_shares_and_admits_classes_and_tenants() {
    use tower_distributed_limit::{Ask, Priority, Share};

    let (_nodes, urls) = three_nodes().await;
    let backend = quorum(&urls).await;
    let reserved = semaphore("shares", 3)
        .class(Priority::CRITICAL, Share::reserved(1))
        .build(backend.clone());
    assert!(matches!(reserved, Err(Error::Config(m)) if m.contains("quorum")));
    let per_tenant = semaphore("shares", 3)
        .per_tenant(Share::at_most(1))
        .build(backend.clone());
    assert!(matches!(per_tenant, Err(Error::Config(m)) if m.contains("tenants")));
    let sem = semaphore("plain", 3).build(backend).unwrap();
    let ask = Ask::new().priority(Priority::BATCH).tenant("acme");
    let permit = sem
        .try_acquire_with(ask)
        .await
        .unwrap()
        .expect("a free slot");
    assert_eq!(
        sem.snapshot().await.unwrap().holders[0].class,
        Priority::BATCH
    );
    drop(permit);
}

/// A node down when a permit is given back, that comes back with its data (restarted from its
/// AOF), gets the release it missed once it answers: it does not keep the slot for the rest of
/// the lease, so when another node fails the two left still grant it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_a_down_node_missed_is_sent_once_it_is_back() {
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(
            support::RedisProcess::start(|port, _| {
                [
                    "--port",
                    &port.to_string(),
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "always",
                ]
                .map(String::from)
                .to_vec()
            })
            .await,
        );
    }
    let urls: Vec<String> = (nodes.iter())
        .map(|node| format!("redis://127.0.0.1:{}", node.port))
        .collect();
    for url in &urls {
        // (Served for long: a node restarted with its data takes part at once.)
        let mut conn = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let _: () = redis::cmd("SET")
            .arg("dlimit:quorum:born")
            .arg(0)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let sem = Semaphore::builder("missed")
        .limit(1)
        .lease(Duration::from_secs(60))
        .acquire_timeout(Duration::from_secs(5))
        .build(quorum(&urls).await)
        .unwrap();
    let mut permit = sem.acquire().await.unwrap();
    nodes[2].kill_for_restart().await;
    permit.release().await.unwrap();
    nodes[2].start_again().await;
    let node_2 = redis::Client::open(urls[2].as_str()).unwrap();
    support::eventually(
        Duration::from_secs(5),
        "node 2 given the release",
        || async {
            let mut conn = node_2.get_multiplexed_async_connection().await.unwrap();
            let owned: u64 = redis::cmd("ZCARD")
                .arg("dlimit:quorum:missed:owned")
                .query_async(&mut conn)
                .await
                .unwrap();
            owned == 0
        },
    )
    .await;
    // Node 0 fails: nodes 1 and 2 must grant, node 2 with the slot it had kept.
    signal(nodes[0].pid(), "STOP");
    let started = Instant::now();
    let again = sem.acquire().await;
    signal(nodes[0].pid(), "CONT");
    assert!(
        again.is_ok(),
        "node 2 kept the slot given back while it was down: {again:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}
