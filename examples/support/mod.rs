//! Shared by the examples: the permits live in Redis when `REDIS_URL` is set (e.g.
//! `REDIS_URL=redis://127.0.0.1:6379`; `rediss://` for TLS, with `REDIS_CA_FILE=ca.crt` for a
//! private CA; a comma-separated list of nodes for a Redis Cluster), in this process otherwise.
#![allow(dead_code)] // each example uses its own part of this module

use tower::BoxError;
use tower_distributed_limit::{MemoryBackend, RedisBackend, Semaphore, SemaphoreBuilder};

/// Builds the semaphore on Redis (`REDIS_URL`) or on the in-process backend.
pub async fn build(settings: SemaphoreBuilder) -> Result<Semaphore, BoxError> {
    Ok(match std::env::var("REDIS_URL") {
        Ok(url) => settings.build(redis(&url).await?)?,
        Err(_) => settings.build(MemoryBackend::new())?,
    })
}

/// Connects to `url` (a cluster when it lists several nodes), trusting the CA in
/// `REDIS_CA_FILE` when it is set.
pub async fn redis(url: &str) -> Result<RedisBackend, BoxError> {
    let nodes: Vec<&str> = url.split(',').map(str::trim).collect();
    let mut builder = if nodes.len() > 1 {
        RedisBackend::cluster_builder(&nodes)
    } else {
        RedisBackend::builder(url)
    };
    if let Ok(path) = std::env::var("REDIS_CA_FILE") {
        let pem =
            std::fs::read(&path).map_err(|e| format!("cannot read REDIS_CA_FILE {path}: {e}"))?;
        builder = builder.add_root_certificate_pem(pem);
    }
    Ok(builder.connect().await?)
}
