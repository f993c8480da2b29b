//! The `dlimit` command line against a real redis-server: list, show (table and JSON),
//! set-limit and release.
#![cfg(feature = "cli")]

mod support;

use std::process::Output;
use std::time::Duration;

use tower_distributed_limit::Semaphore;

use support::Redis;

async fn dlimit(redis: &Redis, args: &[&str]) -> Output {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlimit"))
        .arg("--url")
        .arg(&redis.url)
        .args(args)
        .output();
    tokio::time::timeout(Duration::from_secs(20), output)
        .await
        .expect("dlimit answers in time")
        .expect("dlimit runs")
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_sees_and_changes_live_semaphores() {
    let redis = Redis::start().await;
    let llm = Semaphore::builder("llm-api")
        .limit(4)
        .build(redis.backend().await)
        .unwrap();
    let odd = Semaphore::builder("a}b")
        .limit(2)
        .build(redis.backend().await)
        .unwrap();
    let heavy = llm.acquire_many(3).await.unwrap();
    let _odd = odd.acquire().await.unwrap();

    let list = stdout(&dlimit(&redis, &["list"]).await);
    let row = list
        .lines()
        .find(|l| l.starts_with("llm-api"))
        .expect(&list);
    assert_eq!(
        row.split_whitespace().collect::<Vec<_>>(),
        ["llm-api", "3", "4", "0"]
    );
    assert!(
        list.lines().any(|l| l.starts_with("a}b ")),
        "hostile names come back: {list}"
    );

    let show = stdout(&dlimit(&redis, &["show", "llm-api"]).await);
    assert!(show.contains(heavy.id()), "{show}");
    let json: serde_json::Value = serde_json::from_str(&stdout(
        &dlimit(&redis, &["show", "llm-api", "--json"]).await,
    ))
    .unwrap();
    assert_eq!(json["limit"], 4);
    assert_eq!(json["used"], 3);
    assert_eq!(json["holders"][0]["id"], heavy.id());
    assert_eq!(json["holders"][0]["weight"], 3);

    stdout(&dlimit(&redis, &["set-limit", "llm-api", "7"]).await);
    assert_eq!(llm.snapshot().await.unwrap().limit, 7);

    stdout(&dlimit(&redis, &["release", "llm-api", heavy.id()]).await);
    assert_eq!(llm.snapshot().await.unwrap().used, 0);
    let unknown = dlimit(&redis, &["release", "llm-api", "nobody"]).await;
    assert!(!unknown.status.success());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no holder nobody"));
    // The evicted permit learns at its next renewal.
    drop(heavy);
}
