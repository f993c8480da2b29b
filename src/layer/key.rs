//! Where a request's key comes from: [`PartitionKey`], with [`HeaderKey`] for HTTP and
//! [`Unkeyed`] for none, shared by the partitioned concurrency layer and the rate layer.

use http::HeaderName;

/// The key of an HTTP request: a header's value, made by
/// [`PartitionsBuilder::key_header`](super::PartitionsBuilder::key_header). A missing or non-UTF-8 value means no key.
///
/// ```
/// use http::HeaderName;
/// use tower_distributed_limit::{MemoryBackend, Partitions};
///
/// let partitions = Partitions::builder("api")
///     .key_header(HeaderName::from_static("x-api-key"))
///     .limit(5)
///     .build(MemoryBackend::new())
///     .unwrap();
/// # let _ = partitions;
/// ```
#[derive(Debug, Clone)]
pub struct HeaderKey(pub(crate) HeaderName);

/// Reads a partition key from a request of type `R`: [`HeaderKey`] for HTTP requests, or any
/// `Fn(&R) -> Option<String>`. `None` means the request has no key.
///
/// ```
/// use tower_distributed_limit::layer::PartitionKey;
///
/// struct Job { tenant: Option<String> }
/// let by_tenant = |job: &Job| job.tenant.clone();
/// assert_eq!(by_tenant.key(&Job { tenant: Some("acme".into()) }).as_deref(), Some("acme"));
/// ```
pub trait PartitionKey<R> {
    /// The request's key, if it has one.
    fn key(&self, request: &R) -> Option<String>;
}

impl<R, F> PartitionKey<R> for F
where
    F: Fn(&R) -> Option<String>,
{
    fn key(&self, request: &R) -> Option<String> {
        self(request)
    }
}

impl<B> PartitionKey<http::Request<B>> for HeaderKey {
    fn key(&self, request: &http::Request<B>) -> Option<String> {
        let value = request.headers().get(&self.0)?.to_str().ok()?;
        Some(value.to_owned())
    }
}

/// No key: every request counts against the limiter itself (the rate layer's default).
///
/// ```
/// use tower_distributed_limit::layer::{PartitionKey, Unkeyed};
/// assert_eq!(PartitionKey::<&str>::key(&Unkeyed, &"request"), None);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Unkeyed;

impl<R> PartitionKey<R> for Unkeyed {
    fn key(&self, _: &R) -> Option<String> {
        None
    }
}
