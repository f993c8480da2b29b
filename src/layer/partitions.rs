//! Per-key partitions: one semaphore, with its own limit, per API key, tenant or any other key
//! taken from the request (any request type; header helpers for HTTP).

use std::sync::Arc;

use http::HeaderName;

use super::admit::{Admit, Weighable, sealed};
use super::cache::KeyCache;
use super::key::{HeaderKey, PartitionKey};
use crate::{Ask, Backend, Error, MAX_NAME_LEN, Semaphore, SemaphoreBuilder};

const DEFAULT_CAPACITY: usize = 10_000;
const DEFAULT_MAX_KEY_LEN: usize = 256;

type LimitFn = dyn Fn(&str) -> u32 + Send + Sync;
type BuildFn = dyn Fn(SemaphoreBuilder) -> Result<Semaphore, Error> + Send + Sync;

/// What a partitioned layer does with a request that carries no key.
#[derive(Debug, Clone, Default)]
pub enum WithoutKey {
    /// Refuse it: 400 Bad Request in the HTTP flavor, `INVALID_ARGUMENT` in the gRPC one,
    /// [`Error::BadKey`] otherwise (default).
    #[default]
    Reject,
    /// Count it against this semaphore, shared by every keyless request.
    Shared(Semaphore),
}

/// One semaphore per key: each key (an API key, a tenant id...) gets its own limit, shared by
/// every process. Give it to [`DistributedConcurrencyLimitLayer::partitioned`](super::DistributedConcurrencyLimitLayer::partitioned).
///
/// The semaphore of key `k` is named `"{base name}:{k}"` and is built on first use from the
/// backend given to [`PartitionsBuilder::build`]. This process keeps at most
/// [`capacity`](PartitionsBuilder::capacity) of them, evicting the least recently used
/// (second-chance approximation) past that, so whatever keys clients send, memory stays
/// bounded. Evicting is safe: the permits live in the backend, and a permit in flight keeps its
/// semaphore alive.
///
/// The key comes from the request: [`key_header`](PartitionsBuilder::key_header) for HTTP, or
/// [`key`](PartitionsBuilder::key) with a closure over any request type (a job, an RPC
/// message). The type parameter is that key extractor; the default, [`HeaderKey`], is what
/// `key_header` makes.
///
/// Keys are checked before use: an empty key or one longer than
/// [`max_key_len`](PartitionsBuilder::max_key_len) bytes is refused like a missing one would be
/// under [`WithoutKey::Reject`].
///
/// # Examples
///
/// ```
/// use http::HeaderName;
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Partitions, WithoutKey};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
/// let partitions = Partitions::builder("llm-api")
///     .key_header(HeaderName::from_static("x-api-key"))
///     // 20 at once for premium keys, 5 for the others
///     .limit_by(|key| if key.starts_with("pro-") { 20 } else { 5 })
///     .capacity(50_000)
///     .without_key(WithoutKey::Reject)
///     .build(MemoryBackend::new())?;
/// assert_eq!(partitions.semaphore("pro-42")?.limit(), 20);
/// assert_eq!(partitions.semaphore("free-7")?.name(), "llm-api:free-7");
/// assert!(partitions.semaphore("").is_err());
/// let layer = DistributedConcurrencyLimitLayer::partitioned(partitions).http();
/// # let _ = layer;
/// # Ok(()) }
/// ```
/// Any request type, with a closure:
///
/// ```
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, Error, MemoryBackend, Partitions};
///
/// struct Job { tenant: String }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
/// let partitions = Partitions::builder("jobs")
///     .key(|job: &Job| Some(job.tenant.clone()))
///     .limit(2)
///     .build(MemoryBackend::new())?;
/// let runner = ServiceBuilder::new()
///     .layer(DistributedConcurrencyLimitLayer::partitioned(partitions))
///     .service(service_fn(|job: Job| async move { Ok::<_, tower::BoxError>(job.tenant) }));
/// assert_eq!(runner.clone().oneshot(Job { tenant: "acme".into() }).await?, "acme");
/// let err = runner.oneshot(Job { tenant: String::new() }).await.unwrap_err();
/// assert!(matches!(err.downcast_ref::<Error>(), Some(Error::BadKey(_))));
/// # Ok(()) }
/// ```
pub struct Partitions<K = HeaderKey> {
    inner: Arc<PartitionSet<K>>,
}

impl<K> Clone for Partitions<K> {
    fn clone(&self) -> Self {
        Partitions {
            inner: self.inner.clone(),
        }
    }
}

/// What clones of one `Partitions` share.
struct PartitionSet<K> {
    base: String,
    key: K,
    limit: Box<LimitFn>,
    /// Every key's semaphore is built from these settings, under its own name and limit.
    template: SemaphoreBuilder,
    build: Box<BuildFn>,
    max_key_len: usize,
    without_key: WithoutKey,
    cache: KeyCache,
}

impl<K> std::fmt::Debug for Partitions<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Partitions")
            .field("base", &self.inner.base)
            .field("max_key_len", &self.inner.max_key_len)
            .field("without_key", &self.inner.without_key)
            .field("cached", &self.cached())
            .finish_non_exhaustive()
    }
}

/// Settings for [`Partitions`]; made by [`Partitions::builder`]. A key extractor and a limit
/// are required.
#[must_use = "a builder does nothing until `build` is called"]
pub struct PartitionsBuilder<K = HeaderKey> {
    base: String,
    key: Option<K>,
    limit: Option<Box<LimitFn>>,
    template: SemaphoreBuilder,
    capacity: usize,
    max_key_len: usize,
    without_key: WithoutKey,
}

impl<K> std::fmt::Debug for PartitionsBuilder<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionsBuilder")
            .field("base", &self.base)
            .field("capacity", &self.capacity)
            .field("max_key_len", &self.max_key_len)
            .finish_non_exhaustive()
    }
}

impl<K> PartitionsBuilder<K> {
    /// Takes the key from the request with a closure over any request type (for an HTTP
    /// request, `|req: &http::Request<Body>| ..`); `None` means the request has no key (see
    /// [`without_key`](Self::without_key)).
    pub fn key<F, R>(self, key: F) -> PartitionsBuilder<F>
    where
        F: Fn(&R) -> Option<String> + Send + Sync + 'static,
    {
        self.with_key(key)
    }

    /// Takes the key of an HTTP request from a header; a missing or non-UTF-8 value means no
    /// key.
    pub fn key_header(self, name: HeaderName) -> PartitionsBuilder<HeaderKey> {
        self.with_key(HeaderKey(name))
    }

    fn with_key<X>(self, key: X) -> PartitionsBuilder<X> {
        PartitionsBuilder {
            base: self.base,
            key: Some(key),
            limit: self.limit,
            template: self.template,
            capacity: self.capacity,
            max_key_len: self.max_key_len,
            without_key: self.without_key,
        }
    }

    /// Every key gets the same limit (default: the template's, see [`Partitions::like`]).
    pub fn limit(self, limit: u32) -> Self {
        self.limit_by(move |_| limit)
    }

    /// Each key's limit, computed when its semaphore is built. A limit of 0 is invalid: that
    /// key's requests are refused as if its backend had failed (and a warning is logged).
    pub fn limit_by<F>(mut self, limit: F) -> Self
    where
        F: Fn(&str) -> u32 + Send + Sync + 'static,
    {
        self.limit = Some(Box::new(limit));
        self
    }

    /// How many keys' semaphores this process keeps (default 10 000, at least 1).
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity;
        self
    }

    /// The longest key accepted, in bytes (default 256, at least 1; with the base name and a
    /// `:`, at most [`MAX_NAME_LEN`](crate::MAX_NAME_LEN)).
    pub fn max_key_len(mut self, max: usize) -> Self {
        self.max_key_len = max;
        self
    }

    /// What to do with a request that has no key (default [`WithoutKey::Reject`]).
    pub fn without_key(mut self, rule: WithoutKey) -> Self {
        self.without_key = rule;
        self
    }

    /// Checks the settings; key semaphores will be built on `backend`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] without a key extractor or a limit (here or in the template), for a
    /// zero capacity or key length,
    /// a base name and key length over [`MAX_NAME_LEN`](crate::MAX_NAME_LEN), or settings
    /// [`SemaphoreBuilder::build`] refuses.
    pub fn build<B: Backend + Clone>(self, backend: B) -> Result<Partitions<K>, Error> {
        let base = self.base;
        let Some(key) = self.key else {
            return Err(Error::Config(format!(
                "partitions {base:?} have no key extractor; call .key(..) or .key_header(..)"
            )));
        };
        let limit = match (self.limit, self.template.configured_limit()) {
            (Some(limit), _) => limit,
            (None, Some(limit)) => Box::new(move |_: &str| limit),
            (None, None) => {
                return Err(Error::Config(format!(
                    "partitions {base:?} have no limit; call .limit(n) or .limit_by(..)"
                )));
            }
        };
        if self.capacity == 0 || self.max_key_len == 0 {
            return Err(Error::Config(format!(
                "partitions {base:?}: capacity and max_key_len must be at least 1"
            )));
        }
        // A key's semaphore is named "<base>:<key>".
        if base.len() + 1 + self.max_key_len > MAX_NAME_LEN {
            return Err(Error::Config(format!(
                "partitions {base:?}: the base name and max_key_len ({}) make semaphore names \
                 of up to {} bytes; names are at most {MAX_NAME_LEN} bytes",
                self.max_key_len,
                base.len() + 1 + self.max_key_len
            )));
        }
        let build: Box<BuildFn> =
            Box::new(move |builder: SemaphoreBuilder| builder.build(backend.clone()));
        let partitions = Partitions {
            inner: Arc::new(PartitionSet {
                base,
                key,
                limit,
                template: self.template,
                build,
                max_key_len: self.max_key_len,
                without_key: self.without_key,
                cache: KeyCache::new(self.capacity),
            }),
        };
        // Let the semaphore builder check the name, lease and timeout now rather than per request.
        (partitions.inner.build)(partitions.settings(partitions.inner.base.clone(), 1))?;
        Ok(partitions)
    }
}

impl Partitions {
    /// Starts the settings of partitions whose semaphores are named `"{base_name}:{key}"`,
    /// with a semaphore's default settings; [`like`](Self::like) sets any of them.
    pub fn builder(base_name: impl Into<String>) -> PartitionsBuilder {
        Self::like(Semaphore::builder(base_name))
    }

    /// Starts the settings of partitions whose key semaphores are built as `template`
    /// describes (its lease, timeouts, outage policy, classes, tenants, prefetch...), each
    /// named `"{template's name}:{key}"`, with its limit unless
    /// [`limit`](PartitionsBuilder::limit) or [`limit_by`](PartitionsBuilder::limit_by) sets
    /// another.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_distributed_limit::{MemoryBackend, OutagePolicy, Partitions, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
    /// let per_tenant = Partitions::like(
    ///     Semaphore::builder("jobs")
    ///         .limit(4)
    ///         .lease(Duration::from_secs(60))
    ///         .on_outage(OutagePolicy::Local { limit: 1 }),
    /// )
    /// .key(|job: &String| Some(job.clone()))
    /// .build(MemoryBackend::new())?;
    /// let acme = per_tenant.semaphore("acme")?;
    /// assert_eq!((acme.name(), acme.limit(), acme.lease()), ("jobs:acme", 4, Duration::from_secs(60)));
    /// # Ok(()) }
    /// ```
    pub fn like(template: SemaphoreBuilder) -> PartitionsBuilder {
        let base = template.name().to_owned();
        PartitionsBuilder {
            template: template.metrics_label(base.clone()),
            base,
            key: None,
            limit: None,
            capacity: DEFAULT_CAPACITY,
            max_key_len: DEFAULT_MAX_KEY_LEN,
            without_key: WithoutKey::Reject,
        }
    }
}

impl<K> Partitions<K> {
    /// The semaphore of `key`, built now if this process does not hold it.
    ///
    /// # Errors
    ///
    /// [`Error::BadKey`] for an empty or too long key; [`Error::Config`] when the limit for this
    /// key is 0.
    pub fn semaphore(&self, key: &str) -> Result<Semaphore, Error> {
        self.check(key)?;
        self.lookup(key)
    }

    fn check(&self, key: &str) -> Result<(), Error> {
        if key.is_empty() || key.len() > self.inner.max_key_len {
            return Err(Error::BadKey(format!(
                "a partition key of {} bytes for {:?}; keys must be 1 ..= {} bytes",
                key.len(),
                self.inner.base,
                self.inner.max_key_len
            )));
        }
        Ok(())
    }

    fn lookup(&self, key: &str) -> Result<Semaphore, Error> {
        let inner = &self.inner;
        inner.cache.get_or_build(key, || {
            let limit = (inner.limit)(key);
            (inner.build)(self.settings(format!("{}:{key}", inner.base), limit))
        })
    }

    /// How many keys' semaphores this process holds now (never more than the capacity).
    pub fn cached(&self) -> usize {
        self.inner.cache.len()
    }

    fn settings(&self, name: String, limit: u32) -> SemaphoreBuilder {
        self.inner.template.clone().named(name).limit(limit)
    }
}

impl<K> sealed::Sealed for Partitions<K> {}
impl<K> Weighable for Partitions<K> {}

/// A request asks one permit of its key's semaphore.
impl<K, R> Admit<R> for Partitions<K>
where
    K: PartitionKey<R>,
{
    fn admit(&self, request: &R) -> Result<(Semaphore, Ask), Error> {
        let semaphore = match self.inner.key.key(request) {
            Some(key) => {
                self.check(&key)?;
                self.lookup(&key).inspect_err(|e| {
                    tracing::warn!(error = %e, "cannot build a partition's semaphore");
                })
            }
            None => match &self.inner.without_key {
                WithoutKey::Shared(sem) => Ok(sem.clone()),
                WithoutKey::Reject => Err(Error::BadKey(format!(
                    "the request carries no partition key for {:?}; send one, or use \
                     WithoutKey::Shared for keyless requests",
                    self.inner.base
                ))),
            },
        }?;
        Ok((semaphore, Ask::new()))
    }
}
