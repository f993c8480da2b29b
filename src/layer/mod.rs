//! The tower layers' shared core and the concurrency layer: one concurrency limit for every
//! instance of a service, shared through the semaphore's backend.
//!
//! Both layers, this one and the rate layer ([`rate`](crate::rate)), are one middleware core
//! with two policies, as tower's `limit::{concurrency, rate}` are: the same flavors
//! ([`Plain`], [`Http`]), refusal answers and headers, key extractors ([`PartitionKey`],
//! [`HeaderKey`]), weights ([`Weigh`]) and response futures ([`future`]). What differs is what
//! a request waits for: a permit here (decided per request by an [`Admit`]), its rate there.
//!
//! [`DistributedConcurrencyLimitLayer`] wraps any tower service, whatever its request type (a
//! job runner, a database client, an axum `Router`, a tonic `Channel`). Each request takes
//! [`Permit`](crate::Permit)s before the inner service sees it and gives them back when its
//! response is done. Flavors, chosen by builder methods in any order:
//!
//! - **generic** ([`Plain`], the default): a request that gets no permit fails with a
//!   [`tower::BoxError`] that downcasts to [`Error`](crate::Error), so it composes with
//!   `ServiceBuilder`, `HandleErrorLayer`, timeouts and retries. The permit is released when the
//!   response arrives. The inner service reads the token with [`FencingToken::current`].
//! - **HTTP** ([`Http`], from [`http`](DistributedConcurrencyLimitLayer::http)): a refused
//!   request is answered by the layer (503 with `Retry-After` when no permit is free, another
//!   503 body for an outage, 429, 400...; `x-dlimit-refusal` names the kind), the permit rides in
//!   the response body until its last byte, and the token is also a request extension, so one
//!   line on an axum `Router` is enough.
//! - **gRPC** (`grpc`, feature `tonic`): the HTTP flavor answering with gRPC statuses, for
//!   tonic servers and clients.
//!
//! Requests take one permit each unless [`weight_by`](DistributedConcurrencyLimitLayer::weight_by)
//! says more; [`Partitions`] give each key its own semaphore.
//!
//! # Where the permit is taken
//!
//! By default the permit is acquired inside the response future, after `call`, and the inner
//! service is called only once it is held; `poll_ready` only forwards to the inner service. Two
//! reasons: a per-key limit or a weight needs the request, which `poll_ready` never sees; and no
//! permit ever lives in a service, so an idle or cloned service holds nothing: dropping the
//! response future (a client went away, a timeout fired) drops the permit, which is released in
//! the background. As in tower's `AsyncFilter`, `call` moves the ready inner service into the
//! future, so the inner readiness (a `Buffer` slot, say) stays reserved while the request waits
//! for its permit. This suits servers: hyper and axum call `poll_ready` once per request.
//!
//! Stacks that read readiness as capacity (`Buffer`, p2c `balance`, `LoadShed`) need the
//! other way, [`acquire_in_poll_ready`](DistributedConcurrencyLimitLayer::acquire_in_poll_ready):
//! the permit is reserved in `poll_ready`, as tower's `ConcurrencyLimit` does, so a full
//! semaphore makes the service not ready. The services such a layer makes share a few permits
//! held ahead, so a semaphore with room makes it ready at once, even on Redis.
//!
//! # Recipe: a global limit and a per-tenant limit
//!
//! Stack two layers, the per-tenant one outside: a request takes its tenant's slot first and
//! then waits for a global one, so a tenant's flood can hold at most its own cap of requests
//! waiting for global slots, and never the whole line. (Global first would let one tenant's
//! requests take every global slot and then wait for their tenant's.)
//!
//! ```
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//! use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Partitions, Semaphore};
//!
//! struct Job { tenant: String }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
//! let backend = MemoryBackend::new(); // in production, one RedisBackend for both
//! let global = Semaphore::builder("gpu").limit(100).build(backend.clone())?;
//! let per_tenant = Partitions::builder("gpu-tenant")
//!     .key(|job: &Job| Some(job.tenant.clone()))
//!     .limit(10)
//!     .build(backend)?;
//! let runner = ServiceBuilder::new()
//!     .layer(DistributedConcurrencyLimitLayer::partitioned(per_tenant))
//!     .layer(DistributedConcurrencyLimitLayer::new(global))
//!     .service(service_fn(|job: Job| async move { Ok::<_, tower::BoxError>(job.tenant) }));
//! assert_eq!(runner.oneshot(Job { tenant: "acme".into() }).await?, "acme");
//! # Ok(()) }
//! ```
#![allow(clippy::module_inception)] // `layer::layer`, as in tower's `limit::concurrency`

mod acquire;
mod admit;
pub(crate) mod answer;
pub mod body;
mod cache;
#[cfg(feature = "axum")]
mod extract;
mod flavor;
pub mod future;
pub(crate) mod gate;
pub(crate) mod gatekeeper;
#[cfg(feature = "tonic")]
pub(crate) mod grpc;
pub(crate) mod headers;
mod key;
mod layer;
mod partitions;
mod pass;
pub(crate) mod refusal;
mod reserve;
mod service;
mod spares;
pub(crate) mod token;

pub use self::admit::{
    Admit, InPollReady, Prioritized, Tenanted, Unweighted, Weigh, Weighable, Weighted,
};
pub use self::flavor::{Accepts, Http, Plain};
pub use self::headers::{CLASS_HEADER, RATELIMIT, RATELIMIT_POLICY, REFUSAL_HEADER};
pub use self::key::{HeaderKey, PartitionKey, Unkeyed};
pub use self::layer::{DistributedConcurrencyLimitLayer, HttpConcurrencyLimitLayer};
pub use self::partitions::{Partitions, PartitionsBuilder, WithoutKey};
pub use self::service::{DistributedConcurrencyLimit, HttpConcurrencyLimit};
pub use self::token::FencingToken;
