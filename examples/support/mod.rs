//! Shared by the examples: the permits live in Redis when `REDIS_URL` is set (e.g.
//! `REDIS_URL=redis://127.0.0.1:6379`), in this process otherwise.

use tower::BoxError;
use tower_distributed_limit::{MemoryBackend, RedisBackend, Semaphore, SemaphoreBuilder};

/// Builds the semaphore on Redis (`REDIS_URL`) or on the in-process backend.
pub async fn build(settings: SemaphoreBuilder) -> Result<Semaphore, BoxError> {
    Ok(match std::env::var("REDIS_URL") {
        Ok(url) => settings.build(RedisBackend::connect(&url).await?)?,
        Err(_) => settings.build(MemoryBackend::new())?,
    })
}
