//! The `dlimit` command line as a real process against a real redis-server: list, show (table
//! and JSON), set-limit, unset-limit and release, and what each refuses in an incident (exit 1),
//! with the exit codes `--help` promises.
#![cfg(feature = "cli")]

mod support;

use std::process::Output;
use std::time::Duration;

use tower_distributed_limit::Semaphore;

use support::Redis;

async fn dlimit(redis: &Redis, args: &[&str]) -> Output {
    dlimit_at(&redis.url, args).await
}

async fn dlimit_at(url: &str, args: &[&str]) -> Output {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlimit"))
        .arg("--url")
        .arg(url)
        .args(args)
        .output();
    tokio::time::timeout(Duration::from_secs(20), output)
        .await
        .expect("dlimit answers in time")
        .expect("dlimit runs")
}

/// Its stdout, once it exited 0.
fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).unwrap()
}

/// Its stderr, once it exited with `code`.
fn refused(output: &Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        output.status.code(),
        Some(code),
        "stdout: {}\nstderr: {stderr}",
        String::from_utf8_lossy(&output.stdout)
    );
    stderr
}

fn semaphore(name: &str, limit: u32, backend: tower_distributed_limit::RedisBackend) -> Semaphore {
    Semaphore::builder(name)
        .limit(limit)
        .build(backend)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_sees_and_changes_live_semaphores() {
    let redis = Redis::start().await;
    let llm = semaphore("llm-api", 4, redis.backend().await);
    let odd = semaphore("a}b", 2, redis.backend().await);
    let heavy = llm.acquire_many(3).await.unwrap();
    let _odd = odd.acquire().await.unwrap();

    let list = stdout(&dlimit(&redis, &["list"]).await);
    let row = list
        .lines()
        .find(|l| l.starts_with("llm-api"))
        .expect(&list);
    assert_eq!(
        row.split_whitespace().collect::<Vec<_>>(),
        ["llm-api", "3", "4", "0", "no"]
    );
    assert!(
        list.lines().any(|l| l.starts_with("a}b ")),
        "hostile names come back: {list}"
    );

    let show = stdout(&dlimit(&redis, &["show", "llm-api"]).await);
    assert!(show.contains(heavy.id()), "{show}");
    let process = format!(":{}", std::process::id());
    assert!(show.contains(&process), "the holder's host:pid: {show}");
    let json: serde_json::Value = serde_json::from_str(&stdout(
        &dlimit(&redis, &["show", "llm-api", "--json"]).await,
    ))
    .unwrap();
    assert_eq!(json["limit"], 4);
    assert_eq!(json["used"], 3);
    assert_eq!(json["pinned"], false);
    assert_eq!(json["holders"][0]["id"], heavy.id());
    assert_eq!(json["holders"][0]["weight"], 3);
    assert_eq!(json["holders"][0]["prefetched"], false);
    assert!(
        json["holders"][0]["process"]
            .as_str()
            .unwrap()
            .ends_with(&process)
    );

    stdout(&dlimit(&redis, &["set-limit", "llm-api", "7"]).await);
    assert_eq!(llm.snapshot().await.unwrap().limit, 7);
    assert!(llm.snapshot().await.unwrap().pinned);

    stdout(&dlimit(&redis, &["release", "llm-api", heavy.id(), "--yes"]).await);
    assert_eq!(llm.snapshot().await.unwrap().used, 0);
    let unknown = dlimit(&redis, &["release", "llm-api", "nobody", "--yes"]).await;
    assert!(refused(&unknown, 1).contains("no holder nobody"));
    // The evicted permit learns at its next renewal.
    drop(heavy);
}

/// Slots a process prefetched are marked as its pool's, in `show` and its JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_marks_prefetched_holders() {
    let redis = Redis::start().await;
    let hot = Semaphore::builder("hot")
        .limit(4)
        .prefetch(2)
        .build(redis.backend().await)
        .unwrap();
    let plain = semaphore("hot", 4, redis.backend().await);
    drop(hot.acquire().await.unwrap());
    let _held = plain.acquire().await.unwrap();
    support::eventually(Duration::from_secs(5), "the pool filled", || async {
        hot.snapshot().await.unwrap().used == 3
    })
    .await;
    let show = stdout(&dlimit(&redis, &["show", "hot"]).await);
    assert_eq!(show.matches("prefetched").count(), 2, "{show}");
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&dlimit(&redis, &["show", "hot", "--json"]).await)).unwrap();
    let marks: Vec<_> = json["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|holder| holder["prefetched"].as_bool().unwrap())
        .collect();
    assert_eq!(marks.iter().filter(|&&pooled| pooled).count(), 2, "{json}");
    assert_eq!(marks.len(), 3, "{json}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_of_an_unknown_name_exits_1_and_names_the_close_ones() {
    let redis = Redis::start().await;
    let llm = semaphore("llm-api", 4, redis.backend().await);
    let db = semaphore("orders-db", 4, redis.backend().await);
    let _held = (llm.acquire().await.unwrap(), db.acquire().await.unwrap());

    let typo = refused(&dlimit(&redis, &["show", "llm-apj"]).await, 1);
    assert!(typo.contains("no semaphore llm-apj"), "{typo}");
    assert!(typo.contains("did you mean: llm-api?"), "{typo}");
    assert!(!typo.contains("orders-db"), "only close names: {typo}");

    let far = refused(&dlimit(&redis, &["show", "payments", "--json"]).await, 1);
    assert!(far.contains("`dlimit list` shows every one"), "{far}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_for_a_name_nobody_uses_needs_create() {
    let redis = Redis::start().await;
    let used = semaphore("ghost-api", 2, redis.backend().await);
    let _held = used.acquire().await.unwrap();

    let typo = refused(&dlimit(&redis, &["set-limit", "ghost-apu", "5"]).await, 1);
    assert!(typo.contains("--create"), "{typo}");
    assert!(typo.contains("did you mean: ghost-api?"), "{typo}");
    let meta: bool = redis::cmd("EXISTS")
        .arg("dlimit:{ghost-apu}:meta")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    assert!(!meta, "nothing was created");

    stdout(&dlimit(&redis, &["set-limit", "ghost-apu", "5", "--create"]).await);
    let later = semaphore("ghost-apu", 2, redis.backend().await);
    assert_eq!(later.snapshot().await.unwrap().limit, 5);
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            later
                .try_acquire()
                .await
                .unwrap()
                .expect("the pinned 5, not the configured 2"),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unset_limit_returns_a_pinned_limit_to_the_configured_one() {
    let redis = Redis::start().await;
    let sem = semaphore("reports", 3, redis.backend().await);
    let _first = sem.acquire().await.unwrap();

    stdout(&dlimit(&redis, &["set-limit", "reports", "5"]).await);
    let pinned: serde_json::Value = serde_json::from_str(&stdout(
        &dlimit(&redis, &["show", "reports", "--json"]).await,
    ))
    .unwrap();
    assert_eq!(
        (pinned["limit"].as_u64(), pinned["pinned"].as_bool()),
        (Some(5), Some(true))
    );

    let unset = stdout(&dlimit(&redis, &["unset-limit", "reports"]).await);
    assert!(unset.contains("unpinned"), "{unset}");
    let _second = sem.acquire().await.unwrap();
    let snap = sem.snapshot().await.unwrap();
    assert_eq!((snap.limit, snap.pinned), (3, false));

    let again = stdout(&dlimit(&redis, &["unset-limit", "reports"]).await);
    assert!(again.contains("not pinned"), "{again}");
    let unknown = refused(&dlimit(&redis, &["unset-limit", "report"]).await, 1);
    assert!(unknown.contains("did you mean: reports?"), "{unknown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_json_parses_and_a_hostile_name_is_one_escaped_row() {
    let redis = Redis::start().await;
    let hostile = "evil\n<b>\"x\"\u{1b}[2J";
    let sem = semaphore(hostile, 2, redis.backend().await);
    let plain = semaphore("plain", 2, redis.backend().await);
    let _held = (sem.acquire().await.unwrap(), plain.acquire().await.unwrap());

    let list = stdout(&dlimit(&redis, &["list"]).await);
    let rows: Vec<&str> = list.lines().collect();
    assert_eq!(rows.len(), 3, "a header and one row per name: {list}");
    assert!(
        rows[1].starts_with("evil\\n<b>\"x\"\\u{1b}[2J "),
        "escaped as escape_debug does: {list}"
    );
    assert!(
        !list.contains('\u{1b}'),
        "no control character reaches the terminal"
    );

    let json: serde_json::Value =
        serde_json::from_str(&stdout(&dlimit(&redis, &["list", "--json"]).await)).unwrap();
    let names: Vec<&str> = json
        .as_array()
        .unwrap()
        .iter()
        .map(|semaphore| semaphore["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, [hostile, "plain"], "JSON keeps the name exactly");
    assert_eq!(json[1]["used"], 1);
    assert_eq!(json[1]["limit"], 2);
    assert_eq!(json[1]["holders"].as_array().unwrap().len(), 1);

    let show = stdout(&dlimit(&redis, &["show", hostile]).await);
    assert!(show.starts_with("semaphore evil\\n<b>"), "{show}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_prefix_says_nothing_is_there_and_where_to_look() {
    let redis = Redis::start().await;
    let sem = semaphore("llm-api", 2, redis.backend().await);
    let _held = sem.acquire().await.unwrap();

    let list = dlimit(&redis, &["--prefix", "app:", "list"]).await;
    let stderr = refused(&list, 0);
    assert!(list.stdout.is_empty(), "no table for nothing");
    assert!(
        stderr.contains("no semaphore found under the prefix \"app:\""),
        "{stderr}"
    );
    assert!(stderr.contains("RedisBackend::key_prefix"), "{stderr}");
    assert!(
        stderr.contains("semaphores are kept under \"dlimit:\""),
        "{stderr}"
    );
    let json = dlimit(&redis, &["--prefix", "app:", "list", "--json"]).await;
    assert_eq!(String::from_utf8_lossy(&json.stdout).trim(), "[]");

    let show = refused(
        &dlimit(&redis, &["--prefix", "app:", "show", "llm-api"]).await,
        1,
    );
    assert!(show.contains("nor any other"), "{show}");
    assert!(show.contains("\"dlimit:\""), "{show}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_shows_a_live_holder_and_evicts_it_only_with_yes() {
    let redis = Redis::start().await;
    let sem = semaphore("jobs", 2, redis.backend().await);
    let stuck = sem.acquire_many(2).await.unwrap();

    let asked = dlimit(&redis, &["release", "jobs", stuck.id()]).await;
    let stderr = refused(&asked, 1);
    assert!(stderr.contains("--yes"), "{stderr}");
    let shown = String::from_utf8_lossy(&asked.stdout);
    let row = shown
        .lines()
        .find(|l| l.starts_with(stuck.id()))
        .expect(&shown);
    let process = format!(":{}", std::process::id());
    assert!(row.contains(&process), "the holder's process: {row}");
    assert_eq!(
        row.split_whitespace().nth(2),
        Some("2"),
        "its weight: {row}"
    );
    assert_eq!(
        sem.snapshot().await.unwrap().holders[0].id,
        stuck.id(),
        "kept"
    );

    let evict = stdout(&dlimit(&redis, &["evict", "jobs", stuck.id(), "--yes"]).await);
    assert!(evict.contains("evicted"), "{evict}");
    assert!(sem.snapshot().await.unwrap().holders.is_empty());
    drop(stuck);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_tell_refusal_usage_and_an_unreachable_redis_apart() {
    let help = dlimit_at("redis://127.0.0.1:1", &["--help"]).await;
    let help = stdout(&help);
    assert!(help.contains("Exit codes:"), "{help}");
    for code in ["0  ", "1  ", "2  ", "3  "] {
        assert!(help.contains(code), "{help}");
    }
    refused(&dlimit_at("redis://127.0.0.1:1", &["lsit"]).await, 2);

    let down = format!("redis://127.0.0.1:{}", support::free_port());
    for args in [
        &["list"][..],
        &["show", "x"],
        &["serve", "--listen", "256.0.0.1:1"],
    ] {
        let output = dlimit_at(&down, args).await;
        let code = if args[0] == "serve" { 2 } else { 3 };
        refused(&output, code);
    }
}

/// `show` gives each class's share, use and line, and the tenants waiting most, as stored
/// with the semaphore (the command line was built without the shares).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_tells_the_classes_and_the_tenants_waiting() {
    use tower_distributed_limit::{Ask, Priority, Share};

    let redis = Redis::start().await;
    let gpu = Semaphore::builder("gpu")
        .limit(2)
        .class(Priority::CRITICAL, Share::reserved(1))
        .build(redis.backend().await)
        .unwrap();
    let _held = gpu.acquire().await.unwrap();
    let acme = Ask::new().priority(Priority::BATCH).tenant("acme");
    let waiter = {
        let (gpu, acme) = (gpu.clone(), acme.clone());
        tokio::spawn(async move { gpu.acquire_with(acme).await.map(drop) })
    };
    support::eventually(Duration::from_secs(5), "the waiter in line", || async {
        gpu.snapshot().await.unwrap().waiting == 1
    })
    .await;
    let show = stdout(&dlimit(&redis, &["show", "gpu"]).await);
    assert!(
        show.contains("class critical: 0 used, 0 waiting, 1 reserved"),
        "{show}"
    );
    assert!(show.contains("class batch: 0 used, 1 waiting"), "{show}");
    let tenant = format!("{:016x}", acme.get_tenant().unwrap());
    assert!(
        show.contains(&format!("tenant {tenant}: 1 waiting")),
        "{show}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&dlimit(&redis, &["show", "gpu", "--json"]).await)).unwrap();
    assert_eq!(json["classes"][0]["class"], "critical");
    assert_eq!(json["classes"][0]["reserved"], 1);
    assert_eq!(json["tenants_waiting"][0]["tenant"], tenant);
    waiter.abort();
}
