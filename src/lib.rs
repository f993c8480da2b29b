//! A concurrency limit shared by every process and machine that uses one Redis.
//!
//! tower's `ConcurrencyLimitLayer` caps requests per process; run ten instances and the cap is
//! ten times what the database, the GPU or the third-party API can take. This crate keeps one
//! count for all of them: a distributed [`Semaphore`] whose permits live in Redis
//! ([`RedisBackend`]) or, for development and single instances, in memory ([`MemoryBackend`]).
//!
//! - **Never above the limit.** One atomic script per acquire; leases are timed by the Redis
//!   server clock, never the client's.
//! - **Nothing leaks.** A dropped [`Permit`] is released in the background; a cancelled
//!   acquire releases what it may have taken; a crashed holder's slot returns after its lease.
//! - **Fair, no polling.** Waiters queue in the backend, first come first served across every
//!   process; a freed slot is handed to the oldest waiter and the grant announced to it.
//! - **Fencing tokens** strictly increase per semaphore, so a resource can refuse a holder
//!   that was paused past its lease.
//!
//! # Examples
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_distributed_limit::{RedisBackend, Semaphore};
//!
//! # async fn run() -> Result<(), tower_distributed_limit::Error> {
//! let redis = RedisBackend::connect("redis://127.0.0.1:6379").await?;
//! let sem = Semaphore::builder("legacy-db")
//!     .limit(30)                                 // across every instance
//!     .lease(Duration::from_secs(30))            // a crashed holder frees its slot after this
//!     .acquire_timeout(Duration::from_secs(10))
//!     .build(redis)?;
//!
//! let permit = sem.acquire().await?;             // waits for a free slot
//! println!("token {}", permit.fencing_token());
//! drop(permit);                                  // released in the background
//! # Ok(()) }
//! ```
//!
//! # Tower layer
//!
//! [`DistributedConcurrencyLimitLayer`] puts the limit in front of any tower service, whatever
//! its request type (a job runner, a database client, an HTTP client or server). On an axum `Router`, [`http`](DistributedConcurrencyLimitLayer::http)
//! answers a request that gets no permit with 503 and `Retry-After` and holds the permit until
//! the response body ends; on a client stack (hyper, tonic) the refusal is an error that
//! downcasts to [`Error`]. The inner service sees the permit's [`FencingToken`], and [`Partitions`]
//! give each key (an API key, a tenant) its own limit. See the [`layer`] module.
//!
//! ```
//! use axum::{Extension, Router, routing::get};
//! use tower_distributed_limit::{DistributedConcurrencyLimitLayer, FencingToken, MemoryBackend, Semaphore};
//!
//! # fn main() -> Result<(), tower_distributed_limit::Error> {
//! let sem = Semaphore::builder("legacy-db").limit(30).build(MemoryBackend::new())?;
//! let app: Router = Router::new()
//!     .route("/", get(|Extension(token): Extension<FencingToken>| async move { token.0.to_string() }))
//!     .layer(DistributedConcurrencyLimitLayer::new(sem).http());
//! # let _ = app;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]
// docs.rs builds with every feature and `--cfg docsrs` (see Cargo.toml): each feature-gated
// item says which feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod adaptive;
mod ask;
mod backend;
mod class;
mod error;
mod keeper;
pub mod layer;
mod lease;
mod name;
mod outage;
mod permit;
pub mod rate;
mod semaphore;
mod snapshot;
mod sync;
mod telemetry;
mod waitlist;

pub use adaptive::AdaptiveLimit;
pub use ask::Ask;
pub use backend::{
    Backend, BackendStatus, MemoryBackend, QuorumBackend, QuorumBackendBuilder, RedisBackend,
    RedisBackendBuilder,
};
pub use backend::{RateBackend, RateDecision};
pub use class::{Priority, Share};
pub use error::{BackendError, Error};
pub use layer::{
    DistributedConcurrencyLimitLayer, FencingToken, HttpConcurrencyLimitLayer, Partitions,
    WithoutKey,
};
pub use name::MAX_NAME_LEN;
pub use outage::OutagePolicy;
pub use permit::Permit;
pub use rate::{DistributedRateLimitLayer, RateLimiter, RateLimiterBuilder};
pub use semaphore::{Semaphore, SemaphoreBuilder};
pub use snapshot::{
    ClassSnapshot, Holder, PROTOCOL_VERSION, ProtocolInUse, Snapshot, TENANTS_SHOWN, TenantWaiting,
};

/// The `http` crate this one is built with, for header names
/// ([`PartitionsBuilder::key_header`](layer::PartitionsBuilder::key_header),
/// [`DistributedRateLimitLayer::key_header`]) and status codes without a dependency of your
/// own: `tower_distributed_limit::http::HeaderName::from_static("x-api-key")`.
pub use http;
/// The `redis` crate this one is built with: [`RedisBackend::from_client`] takes a
/// `redis::Client` of this very version (a `redis` dependency of another major version is
/// another type); build it as `tower_distributed_limit::redis::Client::open(url)?`.
pub use redis;

/// The README's snippets, compiled (and those without `no_run` run) by `cargo test --doc`.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The snippets of `docs/adaptive.md`, compiled by `cargo test --doc`.
#[doc = include_str!("../docs/adaptive.md")]
#[cfg(doctest)]
pub struct AdaptiveDoctests;
