//! The tower layer over real HTTP on loopback, against a real redis-server where it matters,
//! one file per feature (as tower's tests are): the HTTP flavor (`http_flavor.rs`), any request type
//! and the generic flavor (`generic.rs`), partitions (`partitions.rs`), gRPC (`grpc.rs`) and
//! reserving in `poll_ready` (`poll_ready.rs`). The fixtures they share are here.

#[path = "../support/mod.rs"]
mod support;

mod generic;
#[cfg(feature = "tonic")]
mod grpc;
mod http_flavor;
mod partitions;
mod poll_ready;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Extension;
use axum::routing::get;
use axum::{Router, http::StatusCode};
use bytes::Bytes;
use http::{HeaderName, Request, Response};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};
use tower_distributed_limit::{
    Backend, DistributedConcurrencyLimitLayer, Error, FencingToken, MemoryBackend, Partitions,
    Semaphore, WithoutKey,
};

use support::{Redis, eventually};

/// The bound on every wait in these tests.
const BOUND: Duration = Duration::from_secs(10);

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

async fn bounded<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(BOUND, future)
        .await
        .unwrap_or_else(|_| panic!("timed out after {BOUND:?} waiting for {what}"))
}

async fn get_from(
    client: &HttpClient,
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
) -> Response<Incoming> {
    let mut request = Request::get(format!("http://{addr}{path}"));
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    bounded(
        "a response",
        client.request(request.body(Empty::new()).unwrap()),
    )
    .await
    .unwrap()
}

async fn text(response: Response<Incoming>) -> String {
    let body = bounded("a body", response.into_body().collect()).await;
    String::from_utf8(body.unwrap().to_bytes().to_vec()).unwrap()
}

fn semaphore(name: &str, limit: u32, backend: impl Backend) -> Semaphore {
    Semaphore::builder(name)
        .limit(limit)
        .acquire_timeout(BOUND)
        .build(backend)
        .unwrap()
}

/// Counts handlers running at once and holds them until the gate opens.
#[derive(Clone)]
struct Probe {
    active: Arc<AtomicUsize>,
    max: Arc<AtomicUsize>,
    started: Arc<AtomicUsize>,
    gate: Arc<watch::Sender<bool>>,
}

struct Active(Arc<AtomicUsize>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Probe {
    fn new() -> Self {
        Probe {
            active: Arc::default(),
            max: Arc::default(),
            started: Arc::default(),
            gate: Arc::new(watch::channel(false).0),
        }
    }

    async fn hold(&self) {
        let now = self.active.fetch_add(1, Ordering::SeqCst) + 1;
        let _active = Active(self.active.clone());
        self.max.fetch_max(now, Ordering::SeqCst);
        self.started.fetch_add(1, Ordering::SeqCst);
        let mut gate = self.gate.subscribe();
        bounded("the gate to open", gate.wait_for(|open| *open))
            .await
            .unwrap();
    }

    fn open(&self) {
        self.gate.send_replace(true);
    }

    fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    fn max(&self) -> usize {
        self.max.load(Ordering::SeqCst)
    }

    fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }

    /// A router whose `/` holds in this probe and answers with the request's fencing token.
    fn router(&self) -> Router {
        let probe = self.clone();
        Router::new().route(
            "/",
            get(
                move |Extension(FencingToken(token)): Extension<FencingToken>| async move {
                    probe.hold().await;
                    token.to_string()
                },
            ),
        )
    }
}

async fn wait_until(what: &str, condition: impl Fn() -> bool) {
    eventually(BOUND, what, || {
        let holds = condition();
        async move { holds }
    })
    .await;
}

async fn available(sem: &Semaphore) -> u32 {
    sem.available_permits().await.unwrap()
}

async fn wait_available(sem: &Semaphore, expected: u32) {
    eventually(
        BOUND,
        &format!("{expected} free permits of {}", sem.name()),
        || async { available(sem).await == expected },
    )
    .await;
}

/// What a client may read in a refusal: short sentences, nothing meant for operators.
fn assert_neutral(body: &str) {
    for advice in [
        "reject_when_full",
        "redis",
        "raise",
        "limit's lease",
        "max_waiters",
        "drop ",
    ] {
        assert!(
            !body.to_lowercase().contains(advice),
            "{body:?} carries internal advice ({advice:?})"
        );
    }
}

/// The status, `x-dlimit-refusal` and body of one refusal, checked for neutrality.
async fn refusal(response: Response<Incoming>) -> (StatusCode, String, String) {
    let status = response.status();
    let kind = response
        .headers()
        .get("x-dlimit-refusal")
        .map(|kind| kind.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = text(response).await;
    assert_neutral(&body);
    (status, kind, body)
}

/// A service that signals when it is called and then never answers.
#[derive(Clone)]
struct Stuck(mpsc::UnboundedSender<()>);

impl Service<Request<()>> for Stuck {
    type Response = Response<String>;
    type Error = Infallible;
    type Future = std::future::Pending<Result<Response<String>, Infallible>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<()>) -> Self::Future {
        let _ = self.0.send(());
        std::future::pending()
    }
}

fn stuck() -> (Stuck, mpsc::UnboundedReceiver<()>) {
    let (started, starts) = mpsc::unbounded_channel();
    (Stuck(started), starts)
}

/// A request that is not HTTP: a job for a runner.
#[derive(Clone)]
struct Job {
    tenant: String,
    gpus: u32,
}

fn job(tenant: &str, gpus: u32) -> Job {
    Job {
        tenant: tenant.to_owned(),
        gpus,
    }
}

/// Runs jobs: holds in the probe, answers with the token it ran under.
#[derive(Clone)]
struct Runner(Probe);

impl Service<Job> for Runner {
    type Response = u64;
    type Error = BoxError;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<u64, BoxError>> + Send>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Job) -> Self::Future {
        let probe = self.0.clone();
        // Read while the layer calls: the token of this job's permit.
        let token = FencingToken::current();
        Box::pin(async move {
            probe.hold().await;
            // Still there while the layer polls the job's future.
            assert_eq!(FencingToken::current(), token);
            Ok(token.ok_or("no fencing token")?.0)
        })
    }
}

/// A job runner behind `layer`.
fn runner<L: tower::Layer<Runner>>(layer: L, probe: &Probe) -> L::Service {
    layer.layer(Runner(probe.clone()))
}

fn api_key_partitions(backend: impl Backend + Clone, capacity: usize) -> Partitions {
    Partitions::like(Semaphore::builder("tenants").acquire_timeout(BOUND))
        .key_header(HeaderName::from_static("x-api-key"))
        .limit_by(|key| if key.starts_with("pro-") { 2 } else { 1 })
        .max_key_len(16)
        .capacity(capacity)
        .build(backend)
        .unwrap()
}
