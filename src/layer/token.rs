//! The fencing token a request holds, and how the inner service reads it.

tokio::task_local! {
    /// The token of the permit whose request is being called or polled.
    static CURRENT: FencingToken;
}

/// The fencing token of the permit a request holds.
///
/// Tokens strictly increase per semaphore across every process: pass the token along with
/// writes to a resource that remembers the highest one it saw, and it can refuse a holder that
/// was paused past its lease.
///
/// How the inner service sees it:
///
/// - **any request type**: [`FencingToken::current`] while the inner service's `call` runs
///   and while its response future is polled (the layer polls it), as a task-local value.
///   Work on other tasks does not see it (a task the service spawns, or a `Buffer`'s worker
///   between the layer and the service): read it in `call` and pass it along.
/// - **HTTP and gRPC flavors** (`.http()`, `.grpc()`): also a request extension, so an axum
///   handler takes it as an extractor: `Extension<FencingToken>` always, and `FencingToken`
///   itself with this crate's **`axum` feature** (`features = ["axum"]`). Without the
///   feature, a handler taking `FencingToken` fails to compile with axum's opaque
///   "`Handler<_, _>` is not implemented"; enable the feature or use `Extension`.
///
/// # Examples
///
/// ```
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, FencingToken, MemoryBackend, Semaphore};
///
/// struct Job { id: u32 }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower::BoxError> {
/// let sem = Semaphore::builder("jobs").limit(4).build(MemoryBackend::new())?;
/// let runner = ServiceBuilder::new()
///     .layer(DistributedConcurrencyLimitLayer::new(sem))
///     .service(service_fn(|job: Job| async move {
///         let token = FencingToken::current().expect("inside the layer");
///         Ok::<_, tower::BoxError>((job.id, token))
///     }));
/// let (id, FencingToken(token)) = runner.oneshot(Job { id: 7 }).await?;
/// assert_eq!(id, 7);
/// assert!(token > 0);
/// assert_eq!(FencingToken::current(), None); // outside a limited call
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// The token of the request the layer is calling or polling now: `Some` inside the inner
    /// service's `call` and its response future, `None` elsewhere.
    ///
    /// ```
    /// use tower_distributed_limit::FencingToken;
    /// assert_eq!(FencingToken::current(), None);
    /// ```
    pub fn current() -> Option<FencingToken> {
        CURRENT.try_with(|token| *token).ok()
    }
}

/// Runs `f` with `token` as [`FencingToken::current`].
pub(crate) fn scoped<T>(token: FencingToken, f: impl FnOnce() -> T) -> T {
    CURRENT.sync_scope(token, f)
}
