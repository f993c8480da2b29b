//! The tower layer: one concurrency limit for every instance of a service, shared through the
//! semaphore's backend.
//!
//! [`DistributedConcurrencyLimitLayer`] wraps any tower service that takes `http::Request`s
//! (an axum `Router`, a tonic `Channel`, a hyper-util `Client`). Each request takes a
//! [`Permit`] before the inner service sees it and gives it back when its
//! response is done. Two flavours:
//!
//! - **generic** ([`DistributedConcurrencyLimit`]): a request that gets no permit fails with a
//!   [`tower::BoxError`] that downcasts to [`Error`], so it composes with
//!   `ServiceBuilder`, `HandleErrorLayer`, timeouts and retries. The permit is released when the
//!   response (its head) arrives. With the `tonic` feature, `DistributedConcurrencyLimitLayer::grpc`
//!   turns refusals into `tonic::Status`es instead.
//! - **HTTP** ([`HttpConcurrencyLimit`], from [`http`](DistributedConcurrencyLimitLayer::http)):
//!   a request that gets no permit is answered 503 Service Unavailable with `Retry-After`, and
//!   the permit rides in the response body until its last byte, so one line on an axum `Router`
//!   is enough.
//!
//! # Where the permit is taken
//!
//! The permit is acquired inside the response future, after `call`, and the inner service is
//! called only once it is held; `poll_ready` only forwards to the inner service. Two reasons:
//! a per-key limit ([`Partitions`]) needs the request to pick its semaphore, which `poll_ready`
//! never sees; and a permit reserved in `poll_ready` would have to live in the service, where a
//! ready service that is dropped or cloned without being called could strand it. Here no permit
//! ever lives in a service: dropping the response future (a client went away, a timeout fired)
//! drops the permit, which is released in the background. As in tower's `AsyncFilter`, `call`
//! moves the ready inner service into the future, so the inner readiness (a `Buffer` slot, say)
//! stays reserved while the request waits for its permit.
//!
//! The handler sees the permit's [`FencingToken`] as a request extension.
#![allow(clippy::module_inception)] // `layer::layer`, as in tower's `limit::concurrency`

pub mod body;
pub mod future;
mod http;
mod key;
mod layer;
mod limiter;
mod refusal;
mod service;

pub use self::key::{Partitions, PartitionsBuilder, WithoutKey};
pub use self::layer::{DistributedConcurrencyLimitLayer, HttpConcurrencyLimitLayer};
pub use self::limiter::FencingToken;
pub use self::service::{DistributedConcurrencyLimit, HttpConcurrencyLimit};
