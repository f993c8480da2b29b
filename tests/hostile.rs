//! Foreign or hostile content in every key and field a semaphore keeps (docs/protocol.md,
//! "Foreign data: what heals, and how fast"): whatever is stored, every call answers within its
//! bound (a correct answer, or an error naming the keys), none loops, none admits above the
//! limit, no script call keeps Redis busy for long (its SLOWLOG), and the semaphore serves
//! correctly again once the foreign data is overwritten or ages out.
//!
//! `DLIMIT_HOSTILE_SEED` replays a run; `DLIMIT_HOSTILE_CASES` sets how many states are tried.

mod support;

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tokio::time::{Instant, timeout};
use tower_distributed_limit::{Error, Permit, RedisBackend, Semaphore};

use support::Redis;

const LIMIT: u32 = 4;
/// Every operation answers within this (the call timeout is 1 s; an acquire waits 100 ms).
const BOUND: Duration = Duration::from_secs(3);
/// What a script call may keep Redis busy for, whatever is stored (server time, SLOWLOG): the
/// bound the calls keep on a quiet machine (`scripts/bench-redis-footprint` measures it; here
/// the calls over it are counted and shown), and the most any call may take here, where the
/// test's own threads and whatever else runs share two cores with Redis (an unbounded call
/// over the thousands of members planted takes tens of ms; a bounded one, stalled by the
/// scheduler, a few).
const CALL_US: u64 = 1_000;
const NOISY_CALL_US: u64 = 25_000;

/// The keys of semaphore `name` (the default prefix).
fn key(name: &str, which: &str) -> String {
    format!("dlimit:{{{name}}}:{which}")
}

/// A plain command; refused (a write to a key another kind left of another type), it is
/// skipped: the foreign state is what it is.
async fn cmd(conn: &mut MultiplexedConnection, args: &[&str]) {
    let mut command = redis::cmd(args[0]);
    for arg in &args[1..] {
        command.arg(*arg);
    }
    let _ = command.query_async::<redis::Value>(conn).await;
}

/// One kind of foreign content, written behind the crate's back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Foreign {
    /// `state` of 72 random bytes (NaN, infinities, negative, huge, fractional doubles).
    StateBytes,
    /// `state` of another length.
    StateLength,
    /// `limit` (and `unpinned`) not a whole number in range, pinned or not.
    Limit,
    /// `v` not a version number.
    Version,
    /// `classes` too long, or shares of no class.
    Classes,
    /// The classes' and tenants' counts, and the adaptive state, not numbers.
    Counts,
    /// Hundreds of fields no version keeps.
    Fields,
    /// Members of no known form in `holders`, and deadlines at ±inf.
    HolderMembers,
    /// Well-formed holders far past their lease, which keep their slots till clamped.
    HolderDeadlines,
    /// More holders than a call counts.
    ManyHolders,
    /// Waiters scored by another layout, of no weight, or with no liveness entry.
    QueueScores,
    /// Thousands of waiters whose processes are gone.
    GoneWaiters,
    /// Garbage in `since`, `procs`, `versions` and `tenants`.
    Sidekeys,
    /// A key of another type.
    WrongType,
    /// Keys deleted.
    Missing,
}

const KINDS: [Foreign; 15] = [
    Foreign::StateBytes,
    Foreign::StateLength,
    Foreign::Limit,
    Foreign::Version,
    Foreign::Classes,
    Foreign::Counts,
    Foreign::Fields,
    Foreign::HolderMembers,
    Foreign::HolderDeadlines,
    Foreign::ManyHolders,
    Foreign::QueueScores,
    Foreign::GoneWaiters,
    Foreign::Sidekeys,
    Foreign::WrongType,
    Foreign::Missing,
];

/// Writes `kind` into semaphore `name`'s keys; returns the weight of well-formed holders it
/// added that stay live through the case (they count against the limit).
async fn write(
    conn: &mut MultiplexedConnection,
    name: &str,
    kind: Foreign,
    rng: &mut fastrand::Rng,
) -> u32 {
    let now_ms: u64 = {
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
        s * 1000 + us / 1000
    };
    let meta = key(name, "meta");
    let holders = key(name, "holders");
    let queue = key(name, "queue");
    let alive = key(name, "alive");
    let pick =
        |rng: &mut fastrand::Rng, options: &[&'static str]| options[rng.usize(..options.len())];
    match kind {
        Foreign::StateBytes => {
            let bytes: Vec<u8> = (0..72).map(|_| rng.u8(..)).collect();
            let _ = redis::cmd("HSET")
                .arg(&meta)
                .arg("state")
                .arg(bytes)
                .query_async::<redis::Value>(conn)
                .await;
        }
        Foreign::StateLength => {
            let len = pick(rng, &["0", "8", "71", "73", "200"])
                .parse::<usize>()
                .unwrap();
            let bytes: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
            let _ = redis::cmd("HSET")
                .arg(&meta)
                .arg("state")
                .arg(bytes)
                .query_async::<redis::Value>(conn)
                .await;
        }
        Foreign::Limit => {
            let bad = &[
                "-5",
                "0",
                "1.5",
                "abc",
                "inf",
                "-inf",
                "nan",
                "1e300",
                "99999999999999999999",
                "",
            ];
            let limit = pick(rng, bad);
            let unpinned = pick(rng, bad);
            let pinned = pick(rng, &["1", "0", "yes"]);
            cmd(
                conn,
                &[
                    "HSET", &meta, "limit", limit, "unpinned", unpinned, "pinned", pinned,
                ],
            )
            .await;
        }
        Foreign::Version => {
            let v = pick(rng, &["abc", "-1", "0", "1", "2.5", "1e9x", ""]);
            cmd(conn, &["HSET", &meta, "v", v]).await;
        }
        Foreign::Classes => {
            let long = "4r1,".repeat(2000);
            let classes = [long.as_str(), "9r5,4m-1", "4rX", "xyz", "4r1e300"][rng.usize(..5)];
            cmd(conn, &["HSET", &meta, "classes", classes]).await;
        }
        Foreign::Counts => {
            let bad = &["nan", "inf", "-inf", "-7", "abc", "1e308"];
            for field in [
                "c0",
                "c3",
                "c4",
                "u:0123456789abcdef",
                "a:lim",
                "a:noload",
                "a:sum",
            ] {
                let value = pick(rng, bad);
                cmd(conn, &["HSET", &meta, field, value]).await;
            }
            let adaptive = pick(rng, &["", "9/1", "x/y", "1/2/3"]);
            cmd(conn, &["HSET", &meta, "adaptive", adaptive]).await;
        }
        Foreign::Fields => {
            let n = rng.usize(100..600);
            let mut command = redis::cmd("HSET");
            command.arg(&meta);
            for i in 0..n {
                command.arg(format!("p:{i:x}")).arg(i);
            }
            let _ = command.query_async::<redis::Value>(conn).await;
        }
        Foreign::HolderMembers => {
            for member in [
                "garbage",
                "x:0:0",
                "abcdefgh:-1:100",
                "abcdefgh:c9:1:1000",
                ":::",
                "",
            ] {
                let score = pick(rng, &["+inf", "-inf", "1e300", "-5", "0"]);
                cmd(conn, &["ZADD", &holders, score, member]).await;
            }
        }
        Foreign::HolderDeadlines => {
            // Well-formed, of another process, deadlines far past their 20 s lease: each keeps
            // its slot until a call clamps it (within a second), then for a lease at most.
            let n = rng.u32(1..=LIMIT);
            plant(conn, name, n, 20_000).await;
            return n;
        }
        Foreign::ManyHolders => {
            let n = rng.usize(1_001..3_000);
            let mut command = redis::cmd("ZADD");
            command.arg(&holders);
            for i in 0..n {
                command
                    .arg(now_ms + 10_000)
                    .arg(format!("cafe{i:012x}:1:20000"));
            }
            let _ = command.query_async::<redis::Value>(conn).await;
            return LIMIT;
        }
        Foreign::QueueScores => {
            for i in 0..rng.usize(1..200) {
                let member = match i % 4 {
                    0 => format!("beef{i:012x}:1:2000"),
                    1 => format!("beef{i:012x}:c9:1:2000"),
                    2 => format!("beef{i:012x}:0:2000"),
                    _ => format!("beef{i:012x}:t0123:1:2000"),
                };
                let score = pick(
                    rng,
                    &["0", "1700000000000000", "-1", "1e17", "+inf", "-inf"],
                );
                cmd(conn, &["ZADD", &queue, score, &member]).await;
                if rng.bool() {
                    let deadline = (now_ms + rng.u64(0..20_000)).to_string();
                    cmd(conn, &["ZADD", &alive, &deadline, &member]).await;
                }
            }
        }
        Foreign::GoneWaiters => {
            let n = rng.u64(1_000..5_000);
            // (Scored in rank 0's range, where no plain member's name puts it.)
            plant_gone(conn, name, n, 1_000_000).await;
        }
        Foreign::Sidekeys => {
            cmd(
                conn,
                &[
                    "HSET",
                    &key(name, "since"),
                    "garbage",
                    "nan",
                    "x:1:2",
                    "inf",
                ],
            )
            .await;
            cmd(
                conn,
                &["ZADD", &key(name, "procs"), "1", "x", "+inf", "zz zz"],
            )
            .await;
            cmd(
                conn,
                &[
                    "ZADD",
                    &key(name, "versions"),
                    "1",
                    "x",
                    "2",
                    "abcdefgh 99",
                    "3",
                    "abcdefgh zz",
                ],
            )
            .await;
            cmd(
                conn,
                &[
                    "ZADD",
                    &key(name, "tenants"),
                    "0",
                    "3zzzz#x",
                    "0",
                    "3zzzz|1|y",
                    "0",
                    "|||",
                ],
            )
            .await;
        }
        Foreign::WrongType => {
            let which = pick(
                rng,
                &[
                    "holders", "meta", "queue", "alive", "since", "procs", "tenants", "versions",
                ],
            );
            let k = key(name, which);
            cmd(conn, &["DEL", &k]).await;
            cmd(conn, &["SET", &k, "not of this crate"]).await;
        }
        Foreign::Missing => {
            let which = pick(rng, &["holders", "meta", "queue", "alive", "since"]);
            cmd(conn, &["DEL", &key(name, which)]).await;
        }
    }
    0
}

/// Plants `n` well-formed holders of weight 1 and lease `lease_ms` in semaphore `name`, with
/// deadlines an hour ahead: past their lease, as no process of this crate writes them.
async fn plant(conn: &mut MultiplexedConnection, name: &str, n: u32, lease_ms: u64) {
    let (s, _): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    for i in 0..n {
        let member = format!("feedf00d{i:08x}:1:{lease_ms}");
        let score = ((s + 3_600) * 1000).to_string();
        cmd(conn, &["ZADD", &key(name, "holders"), &score, &member]).await;
    }
}

/// Plants `n` waiters of a process that is gone in semaphore `name`'s line, scored from
/// `first` on, their liveness deadlines passed.
async fn plant_gone(conn: &mut MultiplexedConnection, name: &str, n: u64, first: u64) {
    let (s, _): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    let mut queued = redis::cmd("ZADD");
    let mut live = redis::cmd("ZADD");
    queued.arg(key(name, "queue"));
    live.arg(key(name, "alive"));
    for i in 0..n {
        let member = format!("dead{i:012x}:1:2000");
        queued.arg(first + i).arg(&member);
        live.arg(s * 1000 - 1).arg(&member);
    }
    let _ = queued.query_async::<redis::Value>(conn).await;
    let _ = live.query_async::<redis::Value>(conn).await;
}

/// Whether semaphore `name` has a `holders` key of its type.
async fn holders_exist(conn: &mut MultiplexedConnection, name: &str) -> bool {
    let kind: String = redis::cmd("TYPE")
        .arg(key(name, "holders"))
        .query_async(conn)
        .await
        .unwrap();
    kind == "zset"
}

/// How many script calls Redis logged since the last call of this, how many of them took over
/// [`CALL_US`], and the longest (µs) with what it was.
async fn calls(conn: &mut MultiplexedConnection) -> (usize, usize, u64, String) {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg("-1")
        .query_async(conn)
        .await
        .unwrap();
    cmd(conn, &["SLOWLOG", "RESET"]).await;
    let (mut n, mut over) = (0, 0);
    let mut longest = (0, String::new());
    for entry in entries {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let (Some(redis::Value::Int(us)), Some(redis::Value::Array(args))) =
            (fields.get(2), fields.get(3))
        else {
            continue;
        };
        let words: Vec<String> = args
            .iter()
            .map(|arg| match arg {
                redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                other => format!("{other:?}"),
            })
            .collect();
        let script = matches!(
            words.first().map(|w| w.to_ascii_uppercase()).as_deref(),
            Some("FCALL" | "EVALSHA" | "EVAL")
        );
        if !script {
            continue;
        }
        n += 1;
        over += usize::from(*us as u64 > CALL_US);
        if (*us as u64) > longest.0 {
            // The operation is the first argument after the keys.
            let op = words
                .get(2)
                .and_then(|n| n.parse::<usize>().ok())
                .and_then(|n| words.get(3 + n))
                .cloned()
                .unwrap_or_default();
            longest = (
                *us as u64,
                format!("{op} {:?}", &words[..words.len().min(14)]),
            );
        }
    }
    (n, over, longest.0, longest.1)
}

/// Whether an error is one a foreign state may rightly cause: a key of another type (named),
/// a class share that leaves no room (the request is refused), a newer protocol.
fn acceptable(e: &Error) -> bool {
    let text = e.to_string();
    match e {
        Error::Backend(_) => text.contains("another type") && text.contains(":holders"),
        Error::Config(_) => true,
        Error::Timeout { .. } => true,
        _ => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_stored_state_ends_well() {
    let redis = Redis::start().await;
    // (Generous: a SLOWLOG of a case's thousands of calls is a long reply.)
    let mut conn = redis::Client::open(redis.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection_with_config(
            &redis::AsyncConnectionConfig::new()
                .set_response_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .unwrap();
    cmd(
        &mut conn,
        &["CONFIG", "SET", "slowlog-log-slower-than", "0"],
    )
    .await;
    cmd(&mut conn, &["CONFIG", "SET", "slowlog-max-len", "100000"]).await;
    let seed = std::env::var("DLIMIT_HOSTILE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    let cases: usize = std::env::var("DLIMIT_HOSTILE_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    let mut rng = fastrand::Rng::with_seed(seed);
    let backend = RedisBackend::builder(redis.url.as_str())
        .call_timeout(Duration::from_secs(1))
        .connect()
        .await
        .unwrap();
    let (mut ops, mut errors, mut script_calls, mut slow_calls) = (0usize, 0usize, 0, 0);
    let mut slowest = Duration::ZERO;
    let mut longest = (0u64, String::new(), Foreign::Missing);
    for case in 0..cases {
        let name = format!("h{case}");
        let sem = Semaphore::builder(&name)
            .limit(LIMIT)
            .lease(Duration::from_secs(2))
            .acquire_timeout(Duration::from_millis(100))
            .build(backend.clone())
            .unwrap();
        // A state of this crate's first: holders, perhaps waiters behind them.
        let mut held: Vec<Permit> = Vec::new();
        for _ in 0..rng.u32(0..=LIMIT) {
            if let Ok(Some(permit)) = sem.try_acquire().await {
                held.push(permit);
            }
        }
        // Then one or two kinds of foreign content.
        let mut kinds = vec![KINDS[rng.usize(..KINDS.len())]];
        if rng.bool() {
            kinds.push(KINDS[rng.usize(..KINDS.len())]);
        }
        let mut squatters = 0;
        for &kind in &kinds {
            let before = holders_exist(&mut conn, &name).await;
            squatters += write(&mut conn, &name, kind, &mut rng).await;
            if before && !holders_exist(&mut conn, &name).await {
                // Deleted (or replaced by another type): the server forgot these holders, so
                // no design can count them; each learns it lost its slot at its next renewal
                // (tests/faults.rs). They no longer count here, nor do holders planted before.
                held.clear();
                squatters = 0;
            }
        }
        let context = || format!("case {case} {kinds:?} (seed {seed})");
        // Every operation, at random.
        for _ in 0..10 {
            let started = Instant::now();
            let outcome = timeout(BOUND, async {
                match rng.u8(0..6) {
                    0 => sem
                        .try_acquire()
                        .await
                        .map(|p| p.into_iter().collect::<Vec<_>>()),
                    1 => sem.acquire().await.map(|p| vec![p]),
                    2 => {
                        if let Some(mut permit) = held.pop() {
                            permit.release().await.map(|()| Vec::new())
                        } else {
                            Ok(Vec::new())
                        }
                    }
                    3 => sem.snapshot().await.map(|_| Vec::new()),
                    4 => sem.available_permits().await.map(|_| Vec::new()),
                    _ => {
                        // A burst of acquires cancelled at once.
                        let attempts: Vec<_> = (0..40).map(|_| sem.acquire()).collect();
                        let _ = timeout(
                            Duration::from_millis(20),
                            futures_util::future::join_all(attempts),
                        )
                        .await;
                        Ok(Vec::new())
                    }
                }
            })
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "an operation did not answer within {BOUND:?}: {}",
                    context()
                )
            });
            slowest = slowest.max(started.elapsed());
            ops += 1;
            match outcome {
                Ok(permits) if !permits.is_empty() => {
                    held.extend(permits);
                    // A grant only where there was room: this test's live permits and the
                    // well-formed holders it planted (live for the whole case) within the limit.
                    let mine: u32 = held
                        .iter()
                        .filter(|p| !p.is_lost())
                        .map(|p| p.weight())
                        .sum();
                    assert!(
                        mine + squatters <= LIMIT,
                        "granted with {mine} held beside {squatters} planted: above the limit \
                         of {LIMIT}: {}",
                        context()
                    );
                }
                Ok(_) => {}
                Err(e) => {
                    errors += 1;
                    assert!(acceptable(&e), "{}: {e}", context());
                }
            }
        }
        let (n, over, us, op) = calls(&mut conn).await;
        script_calls += n;
        slow_calls += over;
        if us > longest.0 {
            longest = (us, op, kinds[0]);
        }
        // Overwritten (the keys deleted), the semaphore serves exactly its limit again.
        drop(held);
        for which in [
            "holders", "meta", "queue", "alive", "since", "procs", "tenants", "versions",
        ] {
            cmd(&mut conn, &["DEL", &key(&name, which)]).await;
        }
        // (An acquire of a cancelled burst may still be granted after the delete, by a call
        // in flight then; its release follows within the call timeout.)
        let mut again = Vec::new();
        let settled = Instant::now() + BOUND;
        while again.len() < LIMIT as usize {
            match timeout(BOUND, sem.try_acquire()).await.expect("answered") {
                Ok(Some(permit)) => again.push(permit),
                Ok(None) if Instant::now() < settled => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => panic!(
                    "a slot missing once the keys were overwritten ({} of {LIMIT}): {other:?}: {}",
                    again.len(),
                    context()
                ),
            }
        }
        assert!(
            sem.try_acquire().await.unwrap().is_none(),
            "above the limit once the keys were overwritten: {}",
            context()
        );
        for mut permit in again {
            permit.release().await.unwrap();
        }
        let _ = calls(&mut conn).await;
    }
    println!(
        "hostile: {cases} states tried, {ops} operations ({errors} refused as the state \
         warrants), {script_calls} script calls, {slow_calls} over {CALL_US} µs, the longest \
         {} µs ({} after {:?}), slowest answer {slowest:?}, seed {seed}",
        longest.0, longest.1, longest.2
    );
    assert!(
        longest.0 <= NOISY_CALL_US,
        "script calls kept Redis busy: {slow_calls} of {script_calls} over {CALL_US} µs, the \
         longest {} µs ({} after {:?}; seed {seed})",
        longest.0,
        longest.1,
        longest.2
    );
}

/// Well-formed holders planted far past their lease are clamped to it: their slots come back
/// within a lease and a second, with nothing deleted by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_holders_age_out_within_their_lease() {
    let redis = Redis::start().await;
    let mut conn = redis.conn().await;
    let sem = Semaphore::builder("aged")
        .limit(2)
        .lease(Duration::from_secs(1))
        .build(redis.backend().await)
        .unwrap();
    // A call first, so the semaphore's state exists and is trusted.
    drop(sem.try_acquire().await.unwrap());
    plant(&mut conn, "aged", 2, 1_000).await;
    let started = Instant::now();
    let mut permit = loop {
        if let Some(permit) = sem.try_acquire().await.unwrap() {
            break permit;
        }
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "planted holders kept their slots past a lease and a second"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "the planted holders held no slot"
    );
    permit.release().await.unwrap();
}

/// A semaphore kept by a newer protocol is refused with a configuration error, the outage
/// policy aside, and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_protocol_is_refused_and_nothing_written() {
    let redis = Redis::start().await;
    let mut conn = redis.conn().await;
    let meta = key("newer", "meta");
    cmd(
        &mut conn,
        &["HSET", &meta, "v", "3", "limit", "7", "future", "x"],
    )
    .await;
    let before: Vec<String> = redis::cmd("HGETALL")
        .arg(&meta)
        .query_async(&mut conn)
        .await
        .unwrap();
    let sem = Semaphore::builder("newer")
        .limit(2)
        .on_outage(tower_distributed_limit::OutagePolicy::FailOpen)
        .build(redis.backend().await)
        .unwrap();
    match sem.try_acquire().await {
        Err(Error::Config(message)) => {
            assert!(message.contains("protocol 3"), "{message}");
            assert!(message.contains("upgrade this process"), "{message}");
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
    assert!(matches!(sem.acquire().await, Err(Error::Config(_))));
    assert!(matches!(sem.snapshot().await, Err(Error::Config(_))));
    let after: Vec<String> = redis::cmd("HGETALL")
        .arg(&meta)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(before, after, "the newer protocol's meta was written");
    let dbsize: u64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    assert_eq!(dbsize, 1, "keys beside meta were written");
}

/// A server out of memory (`maxmemory`, nothing to evict) grants nothing new, with an error
/// that says so, while a release still goes through; once memory is freed, acquires are
/// granted again, still as functions (the library is not given up for scripts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_grants_nothing_new_and_takes_releases() {
    let redis = Redis::start().await;
    let mut conn = redis.conn().await;
    let sem = Semaphore::builder("full")
        .limit(3)
        .build(redis.backend().await)
        .unwrap();
    let mut held = sem.acquire().await.unwrap();
    let used: u64 = {
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut conn)
            .await
            .unwrap();
        info.lines()
            .find_map(|line| line.strip_prefix("used_memory:"))
            .and_then(|n| n.trim().parse().ok())
            .unwrap()
    };
    cmd(
        &mut conn,
        &["CONFIG", "SET", "maxmemory-policy", "noeviction"],
    )
    .await;
    cmd(
        &mut conn,
        &[
            "CONFIG",
            "SET",
            "maxmemory",
            &(used + 2_000_000).to_string(),
        ],
    )
    .await;
    cmd(&mut conn, &["SETRANGE", "ballast", "3000000", "x"]).await;
    match sem.try_acquire().await {
        Err(Error::Backend(e)) => {
            let message = e.to_string();
            assert!(message.contains("out of memory"), "{message}");
        }
        other => panic!("expected a refusal of a full server, got {other:?}"),
    }
    held.release()
        .await
        .expect("a release goes through on a full server");
    let holders: u64 = redis::cmd("ZCARD")
        .arg(key("full", "holders"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(holders, 0, "the release was not applied");
    cmd(&mut conn, &["DEL", "ballast"]).await;
    let scripts = support::command_calls_at(&redis.url, "eval").await
        + support::command_calls_at(&redis.url, "evalsha").await;
    let permit = sem.try_acquire().await.unwrap();
    assert!(permit.is_some(), "memory freed, the semaphore grants again");
    let after = support::command_calls_at(&redis.url, "eval").await
        + support::command_calls_at(&redis.url, "evalsha").await;
    assert_eq!(
        scripts, after,
        "the semaphore gave up its function for scripts"
    );
}

/// Work a call leaves for later calls is done by them: 3 000 waiters of a process that died
/// stand ahead of a live one (each call drops at most a budget of them) and a holder releases;
/// the live waiter is granted, and the dead ones leave the line, within a bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_work_a_call_leaves_is_done_by_the_next() {
    let redis = Redis::start().await;
    let mut conn = redis.conn().await;
    let sem = Semaphore::builder("rest")
        .limit(1)
        .acquire_timeout(Duration::from_secs(10))
        .build(redis.backend().await)
        .unwrap();
    let mut held = sem.acquire().await.unwrap();
    // (Scored ahead of any waiter this crate queues now, their liveness passed.)
    let (s, _): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    // Rank 3 (NORMAL) × 2^48, arrivals from 1.
    plant_gone(&mut conn, "rest", 3_000, 3 * (1u64 << 48) + 1).await;
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    support::eventually(Duration::from_secs(5), "the live waiter to queue", || {
        let mut conn = conn.clone();
        async move {
            // (The only liveness deadline ahead of the planted ones.)
            let live: u64 = redis::cmd("ZCOUNT")
                .arg(key("rest", "alive"))
                .arg(s * 1000)
                .arg("+inf")
                .query_async(&mut conn)
                .await
                .unwrap();
            live == 1
        }
    })
    .await;
    let started = Instant::now();
    held.release().await.unwrap();
    let permit = timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the live waiter was granted within 5 s")
        .unwrap()
        .unwrap();
    println!("granted {:?} after the release", started.elapsed());
    support::eventually(
        Duration::from_secs(5),
        "the dead waiters to leave the line",
        || {
            let redis = &redis;
            async move { redis.queue_len("rest").await == 0 }
        },
    )
    .await;
    drop(permit);
}
