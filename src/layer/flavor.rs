//! The flavors of the layer: how a refusal reaches the caller. They are the first type
//! parameter of [`DistributedConcurrencyLimitLayer`](super::DistributedConcurrencyLimitLayer)
//! and its service, so every builder method works in any order.

use std::sync::Arc;

use super::answer::HttpSettings;

/// The generic flavor (the default), for a service of any request type: a refusal is a
/// [`tower::BoxError`] that downcasts to [`Error`](crate::Error), and the permit is released
/// when the inner service's response is ready.
///
/// ```
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
/// use tower_distributed_limit::layer::Plain;
///
/// let sem = Semaphore::builder("jobs").limit(2).build(MemoryBackend::new()).unwrap();
/// let layer: DistributedConcurrencyLimitLayer<Plain> = DistributedConcurrencyLimitLayer::new(sem);
/// # let _ = layer;
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain;

/// The HTTP flavor, made by [`http`](super::DistributedConcurrencyLimitLayer::http) (or
/// `grpc` with the `tonic` feature): a refusal is answered with a response (503 with
/// `Retry-After` by default; a gRPC status for `grpc`), the permit rides in the response body
/// until its last byte, and the fencing token is also a request extension.
///
/// ```
/// use tower_distributed_limit::{HttpConcurrencyLimitLayer, DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
///
/// let sem = Semaphore::builder("pages").limit(2).build(MemoryBackend::new()).unwrap();
/// let layer: HttpConcurrencyLimitLayer = DistributedConcurrencyLimitLayer::new(sem).http();
/// # let _ = layer;
/// ```
#[derive(Debug, Clone, Default)]
pub struct Http {
    pub(crate) settings: Arc<HttpSettings>,
}

impl Http {
    /// The settings, to change on a layer being built.
    pub(crate) fn settings_mut(&mut self) -> &mut HttpSettings {
        Arc::make_mut(&mut self.settings)
    }
}

/// A generic layer made HTTP starts from the default HTTP settings.
impl From<Plain> for Http {
    fn from(Plain: Plain) -> Self {
        Http::default()
    }
}

/// The requests a flavor's services take: any type for [`Plain`], an
/// [`http::Request`] for [`Http`]. A bound of the builder methods that take a closure over the
/// request (`weight_by`, `priority_by`, `tenant_by`, the rate layer's `key_by`), so that on an
/// HTTP layer the closure's argument needs no type: `.http().priority_by(|req| ..)` reads it as
/// `&http::Request<_>`. Sealed: implemented by this crate's flavors only.
///
/// ```
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Priority, Semaphore};
///
/// let sem = Semaphore::builder("pages").limit(8).build(MemoryBackend::new()).unwrap();
/// let app: axum::Router = axum::Router::new()
///     .route("/", axum::routing::get(|| async { "hello" }))
///     .layer(DistributedConcurrencyLimitLayer::new(sem).http().priority_by(|req| {
///         if req.uri().path().starts_with("/batch") { Priority::BATCH } else { Priority::NORMAL }
///     }));
/// # let _ = app;
/// ```
pub trait Accepts<R>: sealed::Sealed {}

impl<R> Accepts<R> for Plain {}

impl<B> Accepts<http::Request<B>> for Http {}

mod sealed {
    /// Only this crate's flavors are [`Accepts`](super::Accepts).
    pub trait Sealed {}
    impl Sealed for super::Plain {}
    impl Sealed for super::Http {}
}
