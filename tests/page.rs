//! `dlimit serve` as a real process against a real redis-server: its JSON, its Prometheus
//! text, and its page as headless Chromium renders it (the script's refresh included).
#![cfg(feature = "cli")]

mod support;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tower_distributed_limit::{
    Ask, Error, Permit, Priority, RateLimiter, RedisBackend, Semaphore, Share,
};

use support::Redis;

/// `dlimit serve` on a free port; killed when dropped.
struct Server {
    _child: Child,
    port: u16,
}

impl Server {
    async fn start(redis: &Redis) -> Server {
        Server::start_at(&redis.url).await
    }

    async fn start_at(url: &str) -> Server {
        let port = support::free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_dlimit"))
            .args(["--url", url, "serve", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start dlimit serve");
        support::eventually(
            Duration::from_secs(20),
            "dlimit serve to answer",
            || async {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
            },
        )
        .await;
        Server {
            _child: child,
            port,
        }
    }

    /// One HTTP/1.1 GET: the status and the body.
    async fn get(&self, path: &str) -> (u16, String) {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .unwrap();
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").expect(&answer);
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, body.to_owned())
    }

    /// The page's DOM after 3 s of Chromium's virtual time (the script refreshes every
    /// second), or `None` where Chromium is missing outside CI.
    async fn dom(&self) -> Option<String> {
        let chromium = chromium()?;
        let profile = std::env::temp_dir().join(format!("dlimit-chromium-{}", fastrand::u64(..)));
        let output = Command::new(chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--virtual-time-budget=3000",
                "--dump-dom",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(format!("http://127.0.0.1:{}/", self.port))
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(Duration::from_secs(60), output)
            .await
            .expect("chromium dumps the page in time")
            .expect("chromium runs");
        let _ = std::fs::remove_dir_all(&profile);
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        Some(String::from_utf8(output.stdout).unwrap())
    }
}

/// Chromium's path; outside CI, `None` (with a note) where it is not installed.
fn chromium() -> Option<&'static str> {
    let found = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|path| Path::new(path).exists());
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "chromium is not installed: scripts/test installs it (apt-get install chromium)"
        );
        eprintln!("NOTE: chromium is not installed; the page's browser checks are skipped");
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_json_and_metrics_show_the_fleet_live() {
    let redis = Redis::start().await;
    let llm = Semaphore::builder("llm-api")
        .limit(3)
        .build(redis.backend().await)
        .unwrap();
    let hostile = "<b>\"x\"\nq\\";
    let odd = Semaphore::builder(hostile)
        .limit(2)
        .build(redis.backend().await)
        .unwrap();
    let search = RateLimiter::builder("search")
        .rate(1, Duration::from_secs(10))
        .burst(5)
        .build(redis.backend().await)
        .unwrap();
    assert!(search.check_n(3).await.unwrap().allowed);
    let mut permit = llm.acquire().await.unwrap();
    // Pinned, the semaphore stays listed once nobody holds it.
    llm.set_limit(3).await.unwrap();
    let _odd = odd.acquire().await.unwrap();
    let server = Server::start(&redis).await;
    let process = format!(":{}", std::process::id());

    let (status, body) = server.get("/api/semaphores").await;
    assert_eq!(status, 200, "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    let llm_json = json
        .as_array()
        .unwrap()
        .iter()
        .find(|semaphore| semaphore["name"] == "llm-api")
        .expect(&body);
    assert_eq!(
        (llm_json["used"].as_u64(), llm_json["limit"].as_u64()),
        (Some(1), Some(3))
    );
    assert_eq!(llm_json["holders"][0]["id"], permit.id());
    assert!(
        llm_json["holders"][0]["process"]
            .as_str()
            .unwrap()
            .ends_with(&process)
    );

    let (status, body) = server.get("/api/rate-limiters").await;
    assert_eq!(status, 200, "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json[0]["name"], "search", "{body}");
    // Three spent at one per 10 s: the theoretical arrival time is 30 s ahead.
    let ahead = json[0]["ahead_us"].as_u64().unwrap();
    assert!((25_000_000..=30_000_000).contains(&ahead), "{body}");
    assert!(json[0]["ttl_ms"].as_u64().unwrap() > 20_000, "{body}");

    let (status, metrics) = server.get("/metrics").await;
    assert_eq!(status, 200, "{metrics}");
    for line in [
        "# TYPE dlimit_fleet_semaphore_used gauge",
        "dlimit_fleet_semaphore_used{semaphore=\"llm-api\"} 1",
        "dlimit_fleet_semaphore_limit{semaphore=\"llm-api\"} 3",
        "dlimit_fleet_semaphore_waiting{semaphore=\"llm-api\"} 0",
        "dlimit_fleet_semaphore_holders{semaphore=\"llm-api\"} 1",
        "dlimit_fleet_semaphore_pinned{semaphore=\"llm-api\"} 1",
        "dlimit_fleet_semaphore_used{semaphore=\"<b>\\\"x\\\"\\nq\\\\\"} 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in {metrics}");
    }
    assert!(
        metrics
            .lines()
            .any(|l| l
                .starts_with("dlimit_fleet_rate_limiter_ahead_seconds{rate_limiter=\"search\"} 2")),
        "{metrics}"
    );

    let Some(dom) = server.dom().await else {
        return;
    };
    assert!(
        dom.contains("data-semaphore=\"llm-api\" data-used=\"1\" data-limit=\"3\""),
        "{dom}"
    );
    assert!(dom.contains(&process), "the holder's process: {dom}");
    assert!(dom.contains(permit.id()), "{dom}");
    assert!(
        dom.contains("data-refreshes="),
        "the script refreshed the page: {dom}"
    );
    assert!(
        dom.contains("<svg"),
        "the script drew the sparklines: {dom}"
    );
    assert!(
        dom.contains("&lt;b&gt;\"x\"\\nq\\\\"),
        "the hostile name as text, escaped: {dom}"
    );
    assert!(!dom.contains("<b>\""), "no element from a name: {dom}");
    assert!(dom.contains("operator (pinned)"), "{dom}");

    permit.release().await.unwrap();
    support::wait_until_available(&llm, 3).await;
    let dom = server.dom().await.expect("chromium, as above");
    assert!(
        dom.contains("data-semaphore=\"llm-api\" data-used=\"0\" data-limit=\"3\""),
        "{dom}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_it_serves_and_says_why_every_answer_is_503() {
    let down = format!("redis://127.0.0.1:{}", support::free_port());
    let server = Server::start_at(&down).await;
    for path in [
        "/",
        "/live",
        "/api/semaphores",
        "/api/rate-limiters",
        "/metrics",
    ] {
        let (status, body) = server.get(path).await;
        assert_eq!(status, 503, "{path}: {body}");
        assert!(body.contains("cannot read the keys at"), "{path}: {body}");
    }
    let (_, page) = server.get("/").await;
    assert!(page.contains("Redis unreachable"), "{page}");
}

/// `exports` for the claim window: two slots, one reserved for critical requests, and a
/// grant from the line provisional for 60 s (at most half its 120 s lease), so a page read
/// long after the grant (the screenshot's included) still finds it unclaimed.
fn exports(backend: RedisBackend) -> Semaphore {
    Semaphore::builder("exports")
        .limit(2)
        .class(Priority::CRITICAL, Share::reserved(1))
        .lease(Duration::from_secs(120))
        .claim_window(Duration::from_secs(60))
        .acquire_timeout(Duration::from_secs(120))
        .build(backend)
        .unwrap()
}

/// What [`a_frozen_claim_and_waiting_tenants`] leaves running: the frozen child (thawed and
/// killed when dropped) and the tenants' waiting acquires.
struct Claim {
    child: Child,
    _waiters: Vec<JoinHandle<Result<Permit, Error>>>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id() {
            support::signal(pid, "CONT");
        }
    }
}

/// On `exports`: a child process waits in line, is frozen, and is granted the slot this test
/// held, which stays in its claim window; then two requests of tenant `acme` wait behind it.
async fn a_frozen_claim_and_waiting_tenants(redis: &Redis) -> Claim {
    let sem = exports(redis.backend().await);
    let mut held = sem.acquire().await.unwrap();
    let child = support::spawn_child(redis, "claim-waiter");
    support::eventually(
        Duration::from_secs(20),
        "the child to wait in line",
        || async { redis.queue_len("exports").await == 1 },
    )
    .await;
    support::signal(child.id().unwrap(), "STOP");
    held.release().await.unwrap();
    let claimed = || async {
        let snap = sem.snapshot().await.unwrap();
        snap.holders
            .iter()
            .any(|holder| holder.process == "claim-waiter")
    };
    support::eventually(Duration::from_secs(10), "the frozen child's grant", claimed).await;
    let waiters = (0..2)
        .map(|_| {
            let sem = sem.clone();
            tokio::spawn(async move { sem.acquire_with(Ask::new().tenant("acme")).await })
        })
        .collect();
    support::eventually(
        Duration::from_secs(10),
        "the tenant's requests to wait",
        || async { sem.snapshot().await.unwrap().tenants_waiting.len() == 1 },
    )
    .await;
    Claim {
        child,
        _waiters: waiters,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_classes_tenants_a_claim_window_and_a_rate_limiter_between_its_keys() {
    let redis = Redis::start().await;
    let _claim = a_frozen_claim_and_waiting_tenants(&redis).await;
    // One request at one per 2 s: its key lives 2 s, then the limiter is full and keyless.
    let bursty = RateLimiter::builder("bursty")
        .rate(1, Duration::from_secs(2))
        .build(redis.backend().await)
        .unwrap();
    assert!(bursty.check().await.unwrap().allowed);
    let server = Server::start(&redis).await;
    let (status, live) = server.get("/live").await;
    assert_eq!(status, 200, "{live}");
    assert!(live.contains("data-rate-limiter=\"bursty\""), "{live}");
    tokio::time::sleep(Duration::from_millis(2500)).await;

    let Some(dom) = server.dom().await else {
        return;
    };
    let acme = format!("{:016x}", Ask::new().tenant("acme").get_tenant().unwrap());
    for class in ["critical", "normal"] {
        assert!(
            dom.contains(&format!("data-class=\"{class}\"")),
            "the class breakdown: {dom}"
        );
    }
    assert!(
        dom.contains(&format!("data-tenant=\"{acme}\"")),
        "the waiting tenant, by its Ask::tenant_id: {dom}"
    );
    assert!(dom.contains("Ask::new().tenant(key).get_tenant()"), "{dom}");
    assert!(
        dom.contains("class=\"badge claim\""),
        "the frozen child's grant is marked as in its claim window: {dom}"
    );
    assert!(
        dom.contains("<th title=\"the slot sits in its process"),
        "{dom}"
    );
    assert!(
        dom.contains("data-rate-limiter=\"bursty\""),
        "a limiter seen lately stays listed once its key expired: {dom}"
    );
    assert!(dom.contains(" ago</td>"), "{dom}");
    assert!(
        dom.contains("d=\"M0.0 "),
        "the sparklines start at the left edge, seeded with the value at first sight: {dom}"
    );
}

/// Makes `docs/page.png`, the README's picture of the page: three processes (children of this
/// test) keep a few semaphores busy, one pinned, one full with a line; `exports` has classes,
/// a frozen process's grant in its claim window and a tenant waiting; two rate limiters have
/// spent and a fourth process keeps a third busy under its rate. Run with
/// `cargo test --all-features --test page -- --ignored --exact a_screenshot_for_the_docs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes docs/page.png"]
async fn a_screenshot_for_the_docs() {
    let redis = Redis::start().await;
    let mut children = Vec::new();
    for role in [
        "checkout-7f9c:4121",
        "checkout-2b1d:3977",
        "billing-5d2a:217",
    ] {
        let mut child = support::spawn_child(&redis, role);
        assert_eq!(support::child_says(&mut child).await, "holding");
        children.push(child);
    }
    let mut rate_client = support::spawn_child(&redis, "rate-client");
    assert_eq!(support::child_says(&mut rate_client).await, "holding");
    children.push(rate_client);
    let _claim = a_frozen_claim_and_waiting_tenants(&redis).await;
    let backend = redis.backend().await;
    let db = Semaphore::builder("orders-db")
        .limit(30)
        .build(backend.clone())
        .unwrap();
    db.set_limit(12).await.unwrap();
    let rate = RateLimiter::builder("search")
        .rate(100, Duration::from_secs(60))
        .build(backend)
        .unwrap();
    rate.check_n(60).await.unwrap();
    rate.check_key("acme", 25).await.unwrap();

    let server = Server::start(&redis).await;
    let Some(chromium) = chromium() else {
        return;
    };
    let profile = std::env::temp_dir().join(format!("dlimit-chromium-{}", fastrand::u64(..)));
    let png = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/page.png");
    let status = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1100,1340",
            "--virtual-time-budget=90000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("http://127.0.0.1:{}/", server.port))
        .status()
        .await
        .unwrap();
    let _ = std::fs::remove_dir_all(&profile);
    assert!(status.success());
    drop(children);
}

/// A semaphore's name, its limit, and a weight taken from it.
type Take = (&'static str, u32, u32);

/// One process of [`a_screenshot_for_the_docs`], named by its role: takes its permits, says
/// `holding`, and keeps requests coming and going (so the sparklines move) until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by a_screenshot_for_the_docs"]
async fn child_process() {
    let Some((role, url)) = support::child_role() else {
        return;
    };
    let backend = RedisBackend::builder(url.as_str())
        .process_name(role.as_str())
        .connect()
        .await
        .unwrap();
    match role.as_str() {
        // Waits in `exports`' line until frozen and thawed (see `a_frozen_claim_and_waiting_tenants`).
        "claim-waiter" => {
            let _permit = exports(backend).acquire().await;
            return std::future::pending().await;
        }
        // About 35 requests a second against a limit of 50: under its rate, so its key lives
        // only about 20 ms after each request.
        "rate-client" => {
            let api = RateLimiter::builder("partner-api-calls")
                .rate(50, Duration::from_secs(1))
                .burst(10)
                .build(backend)
                .unwrap();
            println!("DLIMIT holding");
            loop {
                let _ = api.check().await;
                tokio::time::sleep(Duration::from_millis(28)).await;
            }
        }
        _ => {}
    }
    let semaphore = |name: &str, limit| {
        Semaphore::builder(name)
            .limit(limit)
            .build(backend.clone())
            .unwrap()
    };
    // What it holds throughout, and where it comes and goes.
    let (hold, churn): (&[Take], Take) = match role.as_str() {
        "checkout-7f9c:4121" => (
            &[("llm-api", 20, 8), ("llm-api", 20, 3)],
            ("llm-api", 20, 6),
        ),
        "checkout-2b1d:3977" => (
            &[
                ("llm-api", 20, 2),
                ("orders-db", 30, 4),
                ("tenants:acme", 4, 1),
            ],
            ("orders-db", 30, 5),
        ),
        _ => (&[("partner-api", 3, 3)], ("tenants:acme", 4, 2)),
    };
    let mut held = Vec::new();
    for &(name, limit, weight) in hold {
        held.push(semaphore(name, limit).acquire_many(weight).await.unwrap());
    }
    let mut waiters = Vec::new();
    if role.starts_with("billing") {
        for _ in 0..2 {
            let partner = semaphore("partner-api", 3);
            waiters.push(tokio::spawn(async move { partner.acquire().await }));
        }
    }
    println!("DLIMIT holding");
    let (name, limit, most) = churn;
    let sem = semaphore(name, limit);
    loop {
        if let Ok(Some(permit)) = sem.try_acquire_many(fastrand::u32(1..=most)).await {
            tokio::time::sleep(Duration::from_millis(fastrand::u64(5..40))).await;
            drop(permit);
        }
        tokio::time::sleep(Duration::from_millis(fastrand::u64(1..10))).await;
    }
}
