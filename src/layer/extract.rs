//! `FencingToken` as an axum extractor (feature `axum`).

use axum::extract::FromRequestParts;
use http::StatusCode;
use http::request::Parts;

use super::token::FencingToken;

/// The token the layer's HTTP flavor put in the request. Without the layer (a route outside
/// it, or the generic flavor), the request is answered 500 with a sentence saying so.
///
/// ```
/// use axum::{Router, routing::get};
/// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, FencingToken, MemoryBackend, Semaphore};
///
/// async fn handler(FencingToken(token): FencingToken) -> String {
///     format!("writing with token {token}")
/// }
///
/// let sem = Semaphore::builder("db").limit(30).build(MemoryBackend::new()).unwrap();
/// let app: Router = Router::new()
///     .route("/", get(handler))
///     .layer(DistributedConcurrencyLimitLayer::new(sem).http());
/// # let _ = app;
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl<S: Sync> FromRequestParts<S> for FencingToken {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<FencingToken>().copied().ok_or((
            StatusCode::INTERNAL_SERVER_ERROR,
            "no FencingToken: put this route behind DistributedConcurrencyLimitLayer::http()\n",
        ))
    }
}
