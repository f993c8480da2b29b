//! The tower layer over real HTTP on loopback, against a real redis-server where it matters,
//! one file per feature (as tower's tests are): the HTTP flavour (`http.rs`), any request type
//! and the generic flavour (`generic.rs`), partitions (`partitions.rs`), gRPC (`grpc.rs`) and
//! reserving in `poll_ready` (`poll_ready.rs`). The fixtures they share are here.

#[path = "../support/mod.rs"]
mod support;

mod generic;
mod grpc;
mod http;
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
