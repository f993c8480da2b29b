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

/// Connects to `url` (a cluster when it lists several nodes, with the `cluster` feature),
/// trusting the CA in `REDIS_CA_FILE` when it is set (with the `tls` feature).
pub async fn redis(url: &str) -> Result<RedisBackend, BoxError> {
    let nodes: Vec<&str> = url.split(',').map(str::trim).collect();
    #[cfg(feature = "cluster")]
    let builder = if nodes.len() > 1 {
        RedisBackend::cluster_builder(&nodes)
    } else {
        RedisBackend::builder(url)
    };
    #[cfg(not(feature = "cluster"))]
    let builder = match nodes.len() {
        1 => RedisBackend::builder(url),
        _ => return Err("a list of Cluster nodes needs the `cluster` feature".into()),
    };
    #[cfg(feature = "tls")]
    let builder = match std::env::var("REDIS_CA_FILE") {
        Ok(path) => builder.add_root_certificate_pem(
            std::fs::read(&path).map_err(|e| format!("cannot read REDIS_CA_FILE {path}: {e}"))?,
        ),
        Err(_) => builder,
    };
    Ok(builder.connect().await?)
}
