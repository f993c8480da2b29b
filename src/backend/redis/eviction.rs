//! The warning about a server that may evict the crate's keys: with a `maxmemory` set and any
//! policy but `noeviction` (every key of a semaphore has a TTL, so the `volatile-*` policies
//! may take them too), a holder's key can vanish under memory pressure and the limit be
//! exceeded.

use std::sync::{Arc, Mutex};

use redis::Value;

use super::connection::Conn;
use crate::sync::lock;

/// The eviction policy last warned about, shared by the checks in flight.
#[derive(Default)]
pub(super) struct Eviction(Arc<Mutex<Option<String>>>);

impl Eviction {
    /// Asks the server behind `conn` (called `label`) for its memory settings in the
    /// background, and warns, once for each policy seen, when it may evict keys. Asked at
    /// connect and after every reconnect; outside a tokio runtime, not at all.
    pub(super) fn check(&self, conn: &Conn, label: &str) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (mut conn, warned) = (conn.clone(), self.0.clone());
        let label = label.to_owned();
        runtime.spawn(async move {
            let mut info = redis::cmd("INFO");
            info.arg("memory");
            let Ok(info) = info.query_async::<Value>(&mut conn).await else {
                return;
            };
            let risk = eviction_risk(&info);
            let mut warned = lock(&warned);
            if let Some(policy) = risk
                .as_ref()
                .filter(|risk| *warned != Some((*risk).clone()))
            {
                tracing::warn!(
                    backend = %label,
                    policy = %policy,
                    "Redis may evict this crate's keys (maxmemory is set, maxmemory-policy is \
                     {policy}): under memory pressure a holder's key can vanish and more than \
                     the limit run at once; set maxmemory-policy noeviction, or give the \
                     semaphores a Redis of their own"
                );
            }
            *warned = risk;
        });
    }
}

/// The eviction policy in an `INFO memory` reply (one text, or one per node of a Cluster),
/// when some node may evict keys: a `maxmemory` above 0 with a policy other than `noeviction`.
fn eviction_risk(info: &Value) -> Option<String> {
    match info {
        Value::BulkString(text) => {
            let text = String::from_utf8_lossy(text);
            let field = |name: &str| {
                text.lines()
                    .find_map(|line| line.strip_prefix(name))
                    .map(str::trim)
            };
            let bounded = field("maxmemory:").is_some_and(|bytes| bytes != "0");
            let policy = field("maxmemory_policy:")?;
            (bounded && policy != "noeviction").then(|| policy.to_owned())
        }
        Value::VerbatimString { text, .. } => {
            eviction_risk(&Value::BulkString(text.clone().into_bytes()))
        }
        Value::Map(nodes) => nodes.iter().find_map(|(_, info)| eviction_risk(info)),
        Value::Array(nodes) => nodes.iter().find_map(eviction_risk),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(text: &str) -> Value {
        Value::BulkString(text.as_bytes().to_vec())
    }

    #[test]
    fn a_bounded_memory_with_an_evicting_policy_is_a_risk() {
        let risky = "# Memory\r\nmaxmemory:104857600\r\nmaxmemory_policy:volatile-lru\r\n";
        assert_eq!(eviction_risk(&info(risky)), Some("volatile-lru".into()));
        // One node of a Cluster is enough.
        let safe = info("maxmemory:0\r\nmaxmemory_policy:allkeys-lru\r\n");
        let nodes = Value::Map(vec![(info("a:7000"), safe), (info("b:7000"), info(risky))]);
        assert_eq!(eviction_risk(&nodes), Some("volatile-lru".into()));
    }

    #[test]
    fn no_bound_or_noeviction_is_none() {
        for text in [
            "maxmemory:0\r\nmaxmemory_policy:allkeys-lru\r\n",
            "maxmemory:1048576\r\nmaxmemory_policy:noeviction\r\n",
            "maxmemory:1048576\r\n",
            "",
        ] {
            assert_eq!(eviction_risk(&info(text)), None, "{text:?}");
        }
    }
}
