//! `dlimit serve`: the live page at `/` (and its live part at `/live`, which the page's script
//! fetches every second), the same data as JSON at `/api/semaphores` and `/api/rate-limiters`,
//! and the fleet's gauges at `/metrics`. Every request reads Redis afresh; nothing is cached,
//! so two viewers never disagree and a scrape is as fresh as its answer. When Redis cannot be
//! read, each answers 503 with the reason (the page says it in place of its tables). The one
//! thing kept between requests is which rate limiters the page saw lately ([`Sightings`]):
//! a limiter under its rate has a key only briefly, so one read alone would miss it.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;

use crate::Failure;
use crate::fleet::{self, Fleet};
use crate::metrics;
use crate::page::{self, Sightings, View};
use crate::text::terminal;

/// What every request shares.
struct Served {
    fleet: Fleet,
    sightings: Sightings,
}

type Shared = State<Arc<Served>>;

pub async fn serve(fleet: Fleet, listen: SocketAddr) -> Result<(), Failure> {
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| Failure::Refused(format!("cannot listen on {listen}: {e}")))?;
    let bound = listener.local_addr().unwrap_or(listen);
    eprintln!(
        "dlimit: serving the semaphores under {:?} at {} on http://{bound}/",
        terminal(fleet.prefix()),
        fleet.shown_url()
    );
    let app = Router::new()
        .route("/", get(index))
        .route("/live", get(live))
        .route("/api/semaphores", get(semaphores))
        .route("/api/rate-limiters", get(rate_limiters))
        .route("/metrics", get(scrape))
        .with_state(Arc::new(Served {
            fleet,
            sightings: Sightings::default(),
        }));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown())
        .await
        .map_err(|e| Failure::Refused(format!("serving on {bound} failed: {e}")))
}

async fn index(State(served): Shared) -> Response {
    let view = View::read(&served.fleet, &served.sightings).await;
    let status = status(&view);
    let body = page::page(&page::live(&served.fleet, view.as_ref()));
    answer(status, "text/html; charset=utf-8", body)
}

async fn live(State(served): Shared) -> Response {
    let view = View::read(&served.fleet, &served.sightings).await;
    answer(
        status(&view),
        "text/html; charset=utf-8",
        page::live(&served.fleet, view.as_ref()),
    )
}

async fn semaphores(State(served): Shared) -> Response {
    json(served.fleet.semaphores().await.map(|all| {
        all.iter()
            .map(|(name, snap)| fleet::semaphore_json(name, snap))
            .collect()
    }))
}

async fn rate_limiters(State(served): Shared) -> Response {
    json(
        served
            .fleet
            .rate_limiters()
            .await
            .map(|all| all.iter().map(fleet::rate_json).collect()),
    )
}

async fn scrape(State(served): Shared) -> Response {
    match metrics::scrape(&served.fleet).await {
        Ok(text) => answer(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            text,
        ),
        Err(failure) => answer(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain; charset=utf-8",
            failure.message().to_owned(),
        ),
    }
}

fn status<T>(read: &Result<T, Failure>) -> StatusCode {
    match read {
        Ok(_) => StatusCode::OK,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// An array, or `{"error": ...}` with 503.
fn json(read: Result<Vec<serde_json::Value>, Failure>) -> Response {
    let status = status(&read);
    let body = match read {
        Ok(all) => serde_json::Value::Array(all),
        Err(failure) => serde_json::json!({ "error": failure.message() }),
    };
    answer(status, "application/json", body.to_string())
}

/// Never cached: each answer is the fleet at that moment.
fn answer(status: StatusCode, content_type: &'static str, body: String) -> Response {
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// Ctrl-C, or SIGTERM (how a service manager or Kubernetes stops it).
async fn shutdown() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(terminate) => terminate,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}
