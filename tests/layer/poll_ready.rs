//! Reserving in `poll_ready`: shedding when full, the reservation in the service, and
//! `LoadShed` over Redis with its spares.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_in_poll_ready_sheds_when_full_instead_of_queueing() {
    let sem = semaphore("shed", 1, MemoryBackend::new());
    let (inner, mut starts) = stuck();
    let svc = ServiceBuilder::new()
        .load_shed()
        .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).acquire_in_poll_ready())
        .service(inner);
    let first = tokio::spawn(svc.clone().oneshot(Request::new(())));
    bounded("the first call", starts.recv()).await.unwrap();
    assert_eq!(available(&sem).await, 0);
    for _ in 0..3 {
        let err = bounded("a shed request", svc.clone().oneshot(Request::new(())))
            .await
            .unwrap_err();
        assert!(err.is::<tower::load_shed::error::Overloaded>(), "{err}");
    }
    assert!(
        starts.try_recv().is_err(),
        "nothing queued behind the limit"
    );
    first.abort();
    wait_available(&sem, 1).await;
    let second = tokio::spawn(svc.clone().oneshot(Request::new(())));
    bounded("a call once free", starts.recv()).await.unwrap();
    second.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_in_poll_ready_holds_its_reservation_in_the_service() {
    let redis = Redis::start().await;
    let sem = Semaphore::builder("reserve")
        .limit(1)
        .lease(Duration::from_secs(1))
        .acquire_timeout(BOUND)
        .build(redis.backend().await)
        .unwrap();
    let probe = Probe::new();
    let mut svc = runner(
        DistributedConcurrencyLimitLayer::new(sem.clone()).acquire_in_poll_ready(),
        &probe,
    );
    bounded("readiness", svc.ready()).await.unwrap();
    assert_eq!(available(&sem).await, 0, "ready means a permit is reserved");
    let clone = svc.clone();
    // Renewed like any other permit while it waits for its call.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        available(&sem).await,
        0,
        "the reservation outlived its 1 s lease"
    );
    drop(clone); // a clone carries nothing, so dropping it releases nothing
    assert_eq!(available(&sem).await, 0);
    // A ready service dropped without a call gives its permit back.
    drop(svc);
    wait_available(&sem, 1).await;

    // Under a Buffer: one job runs, the buffer holds the rest until the permit is back.
    let buffered = tower::buffer::Buffer::new(
        runner(
            DistributedConcurrencyLimitLayer::new(sem.clone()).acquire_in_poll_ready(),
            &probe,
        ),
        8,
    );
    let mut jobs = tokio::task::JoinSet::new();
    for _ in 0..4 {
        jobs.spawn(buffered.clone().oneshot(job("acme", 1)));
    }
    wait_until("one job to run", || probe.active() == 1).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(probe.started(), 1);
    probe.open();
    let mut tokens = Vec::new();
    while let Some(token) = bounded("every job", jobs.join_next()).await {
        tokens.push(token.unwrap().unwrap());
    }
    assert_eq!(tokens.len(), 4);
    assert_eq!(probe.max(), 1);
}

/// `load_shed` over `acquire_in_poll_ready`, over a service that answers at once.
fn shedding(
    sem: &Semaphore,
) -> impl Service<u32, Response = u32, Error = BoxError, Future: Send> + Clone + Send + 'static {
    ServiceBuilder::new()
        .load_shed()
        .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).acquire_in_poll_ready())
        .service(tower::service_fn(
            |n: u32| async move { Ok::<_, BoxError>(n) },
        ))
}

/// Sends `count` requests one at a time, each as `oneshot` on a clone (as a server does);
/// returns how many were shed.
async fn shed_of<S>(svc: &S, count: u32) -> u32
where
    S: Service<u32, Response = u32, Error = BoxError> + Clone,
{
    let mut shed = 0;
    for n in 0..count {
        // A request arrives over a socket: the task yields between two. A shed answer is
        // ready at once, so without this two loops would hold both worker threads and starve
        // the tasks that take spares (and Redis's replies) until they finished.
        tokio::task::yield_now().await;
        match bounded("a request", svc.clone().oneshot(n)).await {
            Ok(answer) => assert_eq!(answer, n),
            Err(err) if err.is::<tower::load_shed::error::Overloaded>() => shed += 1,
            Err(err) => panic!("{err}"),
        }
    }
    shed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_shed_over_acquire_in_poll_ready_sheds_nothing_while_redis_has_room() {
    let redis = Redis::start().await;
    let sem = semaphore("room", 4, redis.backend().await);
    // A server: one client sending one request after another.
    let shed = http_shed_of(&sem, 1, 50).await;
    eprintln!("one client, 50 requests over HTTP: {shed} of 50 shed");
    assert_eq!(shed, 0);
    // Idle, the server's spares go back.
    wait_available(&sem, 4).await;

    // One service, one poll_ready per call, as LoadShed itself drives its inner service,
    // once its first spare is in (taken in the background when it was made).
    let svc = shedding(&sem);
    eventually(BOUND, "the first spare", || async {
        shed_of(&svc, 1).await == 0
    })
    .await;
    let mut one = svc.clone();
    let mut shed = 0;
    for n in 0..50 {
        bounded("readiness", std::future::poll_fn(|cx| one.poll_ready(cx)))
            .await
            .unwrap();
        if bounded("a request", one.call(n)).await.is_err() {
            shed += 1;
        }
    }
    eprintln!("one at a time, poll_ready then call: {shed} of 50 shed");
    assert_eq!(shed, 0);
    assert!(available(&sem).await >= 2, "spares stay few");

    // Idle, the spares go back while the service lives; dropped, it holds nothing.
    wait_available(&sem, 4).await;
    assert_eq!(
        shed_of(&svc, 1).await,
        1,
        "the first request after an idle spell"
    );
    drop((one, svc));
    wait_available(&sem, 4).await;
}

/// `clients` clients, each sending `count` requests one after another over its own
/// connection to an axum server whose routes sit behind `load_shed` over
/// `acquire_in_poll_ready` (as `wrk -c<clients>` would): how many were shed (503 from the
/// `HandleErrorLayer`).
async fn http_shed_of(sem: &Semaphore, clients: usize, count: usize) -> usize {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        ServiceBuilder::new()
            .layer(axum::error_handling::HandleErrorLayer::new(
                |e: BoxError| async move {
                    assert!(e.is::<tower::load_shed::error::Overloaded>(), "{e}");
                    StatusCode::SERVICE_UNAVAILABLE
                },
            ))
            .load_shed()
            .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).acquire_in_poll_ready()),
    );
    let addr = serve(app).await;
    // One spare for the whole router, whose every endpoint (GET, HEAD, the fallback) is a
    // service of its own: not one each, which would hold most of the limit while idle.
    wait_available(sem, sem.limit() - 1).await;
    let loops: Vec<_> = (0..clients)
        .map(|_| {
            let client = client();
            tokio::spawn(async move {
                let mut shed = 0;
                for _ in 0..count {
                    let response = get_from(&client, addr, "/", None).await;
                    match response.status() {
                        StatusCode::OK => {}
                        StatusCode::SERVICE_UNAVAILABLE => shed += 1,
                        other => panic!("unexpected {other}"),
                    }
                    text(response).await;
                }
                shed
            })
        })
        .collect();
    let mut shed = 0;
    for one in loops {
        shed += bounded("a client", one).await.unwrap();
    }
    shed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_shed_over_acquire_in_poll_ready_sheds_little_under_concurrent_load() {
    let redis = Redis::start().await;
    let sem = semaphore("busy-room", 4, redis.backend().await);
    // Long enough that, as in a `wrk -c2` run, the spares' warm-up (a few requests shed
    // while the second spare is taken) is not all that is measured.
    let shed = http_shed_of(&sem, 2, 1000).await;
    eprintln!("two clients of 1000 requests over HTTP, limit 4: {shed} of 2000 shed");
    assert!(shed <= 100, "{shed} of 2000 shed (more than 5 %)");
    // The spares go back once the service is idle.
    wait_available(&sem, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_shed_over_acquire_in_poll_ready_sheds_when_redis_is_full() {
    let redis = Redis::start().await;
    for limit in [1, 4] {
        let sem = semaphore(&format!("full-{limit}"), limit, redis.backend().await);
        let held = sem.acquire_many(limit).await.unwrap();
        let svc = shedding(&sem);
        assert_eq!(shed_of(&svc, 20).await, 20, "limit {limit}: full sheds");
        drop(held);
        // Free again: served, by spares taken once the slots are back. A limit of 1 keeps
        // no spare (it would hold the whole limit), so a fresh service behind LoadShed on
        // Redis is never ready at its first poll: not asked of it here.
        if limit > 1 {
            eventually(BOUND, "a request served", || async {
                shed_of(&svc, 1).await == 0
            })
            .await;
        }
    }
}

/// A runtime shut down while requests hold lent, degraded permits finishes shutting down:
/// each permit given back then asks for a background acquire, on a runtime that drops a task
/// spawned on it at once (and a background acquire's drop takes the spares' lock, so none is
/// spawned while it is held).
#[test]
fn a_runtime_shut_down_while_spares_are_lent_does_not_hang() {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // Redis is down and the policy admits: each permit is degraded, so a spare is never
        // kept, and one given back is replaced by a background acquire.
        runtime.block_on(three_calls_under_fail_open_while_redis_is_down());
        drop(runtime);
        done.send(()).unwrap();
    });
    finished
        .recv_timeout(Duration::from_secs(10))
        .expect("the runtime shut down within 10 s");
}

/// During a Redis outage under `FailOpen`, a layer reserving in `poll_ready` admits: its spares
/// never keep a degraded permit, and a service waiting for one goes on to its own acquire
/// (it was never woken, and no request ever started).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_admits_in_poll_ready_while_redis_is_down() {
    three_calls_under_fail_open_while_redis_is_down().await;
}

/// Three calls through a layer reserving in `poll_ready`, on a semaphore whose Redis is down
/// under `FailOpen`, each started (and stuck) before the next.
async fn three_calls_under_fail_open_while_redis_is_down() {
    let dead = format!("redis://127.0.0.1:{}", support::free_port());
    let sem = Semaphore::builder("outage")
        .limit(8)
        .on_outage(tower_distributed_limit::OutagePolicy::FailOpen)
        .build(tower_distributed_limit::RedisBackend::connect_lazy(dead.as_str()).unwrap())
        .unwrap();
    let (inner, mut starts) = stuck();
    let svc = ServiceBuilder::new()
        .layer(DistributedConcurrencyLimitLayer::new(sem).acquire_in_poll_ready())
        .service(inner);
    for _ in 0..3 {
        tokio::spawn(svc.clone().oneshot(Request::new(())));
        bounded("a call admitted under FailOpen", starts.recv())
            .await
            .unwrap();
    }
}
