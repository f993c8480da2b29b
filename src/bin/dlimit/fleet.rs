//! The fleet as this tool reads it from Redis: the semaphores (found with `SCAN`, read with
//! `Semaphore::snapshot`) and the rate limiters (found with `SCAN`, their GCRA state read with
//! `GET` and `PTTL`: they have no snapshot of their own), and the JSON every command and the
//! server print them as.

use std::collections::HashSet;
use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt, stream};
use redis::Value;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tower_distributed_limit::{
    PROTOCOL_VERSION, RedisBackend, RedisBackendBuilder, Semaphore, Snapshot,
};

use crate::failure::Failure;

/// `RedisBackend`'s default key prefix.
pub const DEFAULT_PREFIX: &str = "dlimit:";

/// Asked for by this tool, the limit is a placeholder: a semaphore with no limit stored reports
/// it back (nobody uses the name, or its keys were lost), so it means "no such semaphore".
const NO_LIMIT: u32 = u32::MAX;

/// How long any one call to Redis may take before the command reports it unreachable.
const TIMEOUT: Duration = Duration::from_secs(2);

/// How many snapshots are asked for at once when reading every semaphore.
const IN_FLIGHT: usize = 16;

/// Keys asked for per `SCAN` step, and so per pipeline of rate limiter reads.
const SCAN_COUNT: usize = 1000;

/// One Redis deployment under one key prefix.
pub struct Fleet {
    backend: RedisBackend,
    /// Each node given in `--url`: on a Cluster, SCAN sees one node's keys.
    nodes: Vec<Node>,
    prefix: String,
}

struct Node {
    /// The URL without its password, for messages and the page.
    shown: String,
    conn: ConnectionManager,
}

/// A rate limiter (or one key of a partitioned one, `name:key`) as Redis holds it.
pub struct RateState {
    pub name: String,
    /// How far its theoretical arrival time is ahead of the server's clock: the time it takes
    /// to be full again; zero when it is full (nothing spent lately).
    pub ahead: Duration,
    /// When its key expires (when it would be full again), `None` without an expiry.
    pub ttl: Option<Duration>,
}

impl Fleet {
    /// Connects to the nodes in `url` (comma-separated for a Cluster). `lazy`: return at once
    /// and let each call find Redis (for `serve`, which must come up before Redis does);
    /// otherwise an unreachable Redis fails here.
    pub async fn connect(url: &str, prefix: &str, lazy: bool) -> Result<Fleet, Failure> {
        let urls: Vec<&str> = url.split(',').map(str::trim).collect();
        let builder = if urls.len() > 1 {
            cluster(&urls)?
        } else {
            RedisBackend::builder(url)
        }
        .key_prefix(prefix)
        .call_timeout(TIMEOUT)
        .connect_timeout(TIMEOUT);
        let backend = if lazy {
            builder.connect_lazy()?
        } else {
            builder.connect().await?
        };
        let nodes = urls
            .iter()
            .map(|url| Node::open(url))
            .collect::<Result<_, _>>()?;
        Ok(Fleet {
            backend,
            nodes,
            prefix: prefix.to_owned(),
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The nodes as `--url` named them, passwords left out.
    pub fn shown_url(&self) -> String {
        let shown: Vec<&str> = self.nodes.iter().map(|node| node.shown.as_str()).collect();
        shown.join(",")
    }

    /// A handle on semaphore `name` for reading and operating it; it never acquires.
    pub fn semaphore(&self, name: &str) -> Result<Semaphore, Failure> {
        Ok(Semaphore::builder(name)
            .limit(NO_LIMIT)
            .build(self.backend.clone())?)
    }

    /// The semaphore now, or `None` when nobody uses it and no limit is pinned for it.
    pub async fn snapshot(&self, name: &str) -> Result<Option<Snapshot>, Failure> {
        let snap = self.semaphore(name)?.snapshot().await?;
        let unknown =
            snap.limit == NO_LIMIT && snap.holders.is_empty() && snap.waiting == 0 && !snap.pinned;
        Ok((!unknown).then_some(snap))
    }

    /// Every semaphore's name under the prefix: each has a `meta` key while it is used or has
    /// a limit pinned.
    pub async fn names(&self) -> Result<Vec<String>, Failure> {
        let mut names = Vec::new();
        for node in &self.nodes {
            let keys = node
                .scan(&format!("{}{{*}}:meta", glob(&self.prefix)))
                .await?;
            names.extend(
                keys.iter()
                    .filter_map(|key| name_of(key, &self.prefix, ":meta")),
            );
        }
        names.sort();
        names.dedup();
        Ok(names)
    }

    /// Every semaphore under the prefix with its snapshot, by name (those that went idle
    /// between the scan and their snapshot are left out).
    pub async fn semaphores(&self) -> Result<Vec<(String, Snapshot)>, Failure> {
        let read: Vec<(String, Option<Snapshot>)> = stream::iter(self.names().await?)
            .map(|name| async move {
                let snap = self.snapshot(&name).await?;
                Ok::<_, Failure>((name, snap))
            })
            .buffered(IN_FLIGHT)
            .try_collect()
            .await?;
        Ok(read
            .into_iter()
            .filter_map(|(name, snap)| Some((name, snap?)))
            .collect())
    }

    /// Every rate limiter key under the prefix, by name, read against its own node's clock.
    pub async fn rate_limiters(&self) -> Result<Vec<RateState>, Failure> {
        let mut limiters = Vec::new();
        for node in &self.nodes {
            let keys = node
                .scan(&format!("{}{{*}}:rate", glob(&self.prefix)))
                .await?;
            for batch in keys.chunks(SCAN_COUNT) {
                limiters.extend(node.rate_states(batch, &self.prefix).await?);
            }
        }
        limiters.sort_by(|a, b| a.name.cmp(&b.name));
        limiters.dedup_by(|a, b| a.name == b.name);
        Ok(limiters)
    }

    /// The ids of the holders of `names` whose grant is still provisional: granted from the
    /// line, in its claim window until its process claims it with its next call. The snapshot
    /// does not say it; the holders' sorted set does (a provisional score has a `.5` fraction,
    /// see `lua/semaphore/holders.lua`). Best effort, for the page's note: a node that does not
    /// hold a semaphore's keys (a Cluster) answers an error, which is skipped.
    pub async fn provisional(&self, names: &[&str]) -> Result<HashSet<String>, Failure> {
        let mut ids = HashSet::new();
        if names.is_empty() {
            return Ok(ids);
        }
        for node in &self.nodes {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for name in names {
                pipe.cmd("ZRANGE")
                    .arg(format!("{}{{{}}}:holders", self.prefix, tag_of(name)))
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES");
            }
            let replies: Vec<Value> = pipe
                .query_async(&mut node.conn.clone())
                .await
                .map_err(|e| node.unreachable(e))?;
            for reply in &replies {
                let Ok(pairs) = redis::from_redis_value_ref::<Vec<(String, String)>>(reply) else {
                    continue;
                };
                ids.extend(
                    pairs
                        .into_iter()
                        .filter(|(_, score)| score.contains('.'))
                        .filter_map(|(member, _)| Some(member.split(':').next()?.to_owned())),
                );
            }
        }
        Ok(ids)
    }

    /// The other key prefixes semaphores are kept under on these nodes: what a wrong
    /// `--prefix` should have been.
    async fn other_prefixes(&self) -> Result<Vec<String>, Failure> {
        let mut prefixes = Vec::new();
        for node in &self.nodes {
            for key in node.scan("*{*}:meta").await? {
                // A tag never holds a brace (they are percent-encoded): it opens at the last.
                if let Some(open) = key.rfind('{') {
                    prefixes.push(key[..open].to_owned());
                }
            }
        }
        prefixes.sort();
        prefixes.dedup();
        prefixes.retain(|prefix| *prefix != self.prefix);
        Ok(prefixes)
    }

    /// What to check when SCAN finds no semaphore under the prefix, which is then likely
    /// wrong: the prefix the services use, and the ones semaphores are kept under here.
    pub async fn prefix_hint(&self) -> Result<String, Failure> {
        let mut message = format!(
            "--prefix must be the services' RedisBackend::key_prefix ({DEFAULT_PREFIX:?} unless \
             they set one)"
        );
        let others = self.other_prefixes().await?;
        if !others.is_empty() {
            let others: Vec<String> = others.iter().map(|p| format!("{p:?}")).collect();
            message = format!("{message}; semaphores are kept under {}", others.join(", "));
        }
        Ok(message)
    }
}

/// The backend's settings for the Cluster at `urls`.
#[cfg(feature = "cluster")]
fn cluster(urls: &[&str]) -> Result<RedisBackendBuilder, Failure> {
    Ok(RedisBackend::cluster_builder(urls))
}

/// A build without the `cluster` feature cannot talk to a Cluster: say so rather than try
/// the first node alone.
#[cfg(not(feature = "cluster"))]
fn cluster(_: &[&str]) -> Result<RedisBackendBuilder, Failure> {
    Err(Failure::Refused(
        "--url lists several nodes (a Redis Cluster), but this dlimit was built without the \
         `cluster` feature"
            .into(),
    ))
}

impl Node {
    fn open(url: &str) -> Result<Node, Failure> {
        let shown = redact(url);
        let client = redis::Client::open(url)
            .map_err(|e| Failure::Refused(format!("{shown} is not a Redis URL: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(TIMEOUT))
            .set_response_timeout(Some(TIMEOUT))
            .set_number_of_retries(1);
        let conn = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|e| Failure::Refused(format!("cannot use {shown}: {e}")))?;
        Ok(Node { shown, conn })
    }

    fn unreachable(&self, e: redis::RedisError) -> Failure {
        Failure::Unreachable(format!("cannot read the keys at {}: {e}", self.shown))
    }

    /// Every key matching `pattern` on this node, with SCAN (never KEYS, which blocks Redis).
    async fn scan(&self, pattern: &str) -> Result<Vec<String>, Failure> {
        let mut conn = self.conn.clone();
        let mut cursor = 0u64;
        let mut keys = Vec::new();
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .query_async(&mut conn)
                .await
                .map_err(|e| self.unreachable(e))?;
            keys.extend(batch);
            if next == 0 {
                return Ok(keys);
            }
            cursor = next;
        }
    }

    /// The GCRA state of each rate limiter key: one pipeline of the server's `TIME`, then
    /// `GET` and `PTTL` per key. A key that is gone by then, or holds something other than a
    /// GCRA state (another program under the prefix), is left out.
    async fn rate_states(&self, keys: &[String], prefix: &str) -> Result<Vec<RateState>, Failure> {
        let mut pipe = redis::pipe();
        pipe.ignore_errors().cmd("TIME");
        for key in keys {
            pipe.cmd("GET").arg(key).cmd("PTTL").arg(key);
        }
        let replies: Vec<Value> = pipe
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.unreachable(e))?;
        let malformed =
            || Failure::Unreachable(format!("{} answered TIME with no clock", self.shown));
        let (time, per_key) = replies.split_first().ok_or_else(malformed)?;
        let now_us = server_micros(time).ok_or_else(malformed)?;
        Ok(keys
            .iter()
            .zip(per_key.chunks_exact(2))
            .filter_map(|(key, replies)| {
                let (tat_us, _) = gcra_state(&replies[0])?;
                let ttl_ms: i64 = redis::from_redis_value_ref(&replies[1]).ok()?;
                Some(RateState {
                    name: name_of(key, prefix, ":rate")?,
                    ahead: Duration::from_micros(tat_us.saturating_sub(now_us)),
                    ttl: u64::try_from(ttl_ms).ok().map(Duration::from_millis),
                })
            })
            .collect())
    }
}

/// `TIME`'s `[seconds, microseconds]` in microseconds.
fn server_micros(time: &Value) -> Option<u64> {
    let (secs, micros): (u64, u64) = redis::from_redis_value_ref(time).ok()?;
    Some(secs * 1_000_000 + micros)
}

/// A rate limiter's value, `"<TAT µs> <remainder>"` (see `lua/gcra.lua`).
fn gcra_state(value: &Value) -> Option<(u64, u64)> {
    let text: String = redis::from_redis_value_ref(value).ok()?;
    let (us, rem) = text.split_once(' ')?;
    Some((us.parse().ok()?, rem.parse().ok()?))
}

/// The name in `{prefix}{<tag>}{suffix}`, undoing the tag's percent-encoding of `%`, `{` and
/// `}` (`%25` last, so an encoded `%7B` in a name stays as typed).
fn name_of(key: &str, prefix: &str, suffix: &str) -> Option<String> {
    let tag = key
        .strip_prefix(prefix)?
        .strip_prefix('{')?
        .strip_suffix(suffix)?
        .strip_suffix('}')?;
    Some(
        tag.replace("%7B", "{")
            .replace("%7D", "}")
            .replace("%25", "%"),
    )
}

/// The hash tag of `name`, as the crate writes it: `%`, `{` and `}` percent-encoded (the
/// inverse of [`name_of`]).
fn tag_of(name: &str) -> String {
    name.replace('%', "%25")
        .replace('{', "%7B")
        .replace('}', "%7D")
}

/// `prefix` as a SCAN pattern that matches it literally.
fn glob(prefix: &str) -> String {
    let mut pattern = String::with_capacity(prefix.len());
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern
}

/// `url` with its password (if any) replaced by `***`.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    match rest[..at].split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***{}", &rest[at..]),
        None => url.to_owned(),
    }
}

/// The limit in force, `None` where none is stored (a semaphore whose keys were lost while
/// it had holders).
pub fn limit(snap: &Snapshot) -> Option<u32> {
    (snap.limit != NO_LIMIT).then_some(snap.limit)
}

/// A semaphore as `show --json`, `list --json` and `/api/semaphores` print it.
pub fn semaphore_json(name: &str, snap: &Snapshot) -> serde_json::Value {
    let holders: Vec<serde_json::Value> = snap
        .holders
        .iter()
        .map(|holder| {
            serde_json::json!({
                "id": holder.id,
                "process": holder.process,
                "weight": holder.weight,
                "held_for_ms": holder.held_for.as_millis() as u64,
                "lease_remaining_ms": holder.lease_remaining.as_millis() as u64,
                "prefetched": holder.prefetched,
            })
        })
        .collect();
    let classes: Vec<serde_json::Value> = (snap.classes.iter())
        .map(|class| {
            serde_json::json!({
                "class": class.class.to_string(),
                "reserved": class.reserved,
                "at_most": class.at_most,
                "used": class.used,
                "waiting": class.waiting,
            })
        })
        .collect();
    let tenants: Vec<serde_json::Value> = (snap.tenants_waiting.iter())
        .map(|tenant| {
            serde_json::json!({
                "tenant": format!("{:016x}", tenant.tenant),
                "waiting": tenant.waiting,
            })
        })
        .collect();
    let protocols: Vec<serde_json::Value> = (snap.protocols.iter())
        .map(|protocol| {
            serde_json::json!({
                "version": protocol.version,
                "processes": protocol.processes,
                "supported": protocol.is_supported(),
            })
        })
        .collect();
    serde_json::json!({
        "name": name,
        "limit": limit(snap),
        "pinned": snap.pinned,
        "used": snap.used,
        "waiting": snap.waiting,
        "holders": holders,
        "classes": classes,
        "tenants_waiting": tenants,
        "protocols": protocols,
    })
}

/// The protocol versions active on a semaphore, as `show` and the page name them ("2 (3
/// processes), 1 (1 process)"), and a warning when a version this build does not serve
/// beside its own is among them (`None` when none is).
pub fn protocols(snap: &Snapshot) -> (String, Option<String>) {
    let text = (snap.protocols.iter().rev())
        .map(|p| {
            let s = if p.processes == 1 { "" } else { "es" };
            format!("{} ({} process{s})", p.version, p.processes)
        })
        .collect::<Vec<_>>()
        .join(", ");
    let unsupported: Vec<String> = (snap.protocols.iter())
        .filter(|p| !p.is_supported())
        .map(|p| p.version.to_string())
        .collect();
    let warning = (!unsupported.is_empty()).then(|| {
        format!(
            "protocol {} is not served beside this build's ({PROTOCOL_VERSION}) or the one \
             before it: upgrade those processes, or this tool (docs/operations.md, Upgrading)",
            unsupported.join(", ")
        )
    });
    (text, warning)
}

/// A rate limiter as `/api/rate-limiters` prints it.
pub fn rate_json(rate: &RateState) -> serde_json::Value {
    serde_json::json!({
        "name": rate.name,
        "ahead_us": rate.ahead.as_micros() as u64,
        "ttl_ms": rate.ttl.map(|ttl| ttl.as_millis() as u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_back_from_their_keys() {
        assert_eq!(
            name_of("dlimit:{a%7Db%25}:meta", "dlimit:", ":meta").as_deref(),
            Some("a}b%")
        );
        assert_eq!(
            name_of("dlimit:{api:acme}:rate", "dlimit:", ":rate").as_deref(),
            Some("api:acme")
        );
        assert_eq!(name_of("other:{api}:meta", "dlimit:", ":meta"), None);
        let tagged = format!("dlimit:{{{}}}:meta", tag_of("a}b%{"));
        assert_eq!(
            name_of(&tagged, "dlimit:", ":meta").as_deref(),
            Some("a}b%{")
        );
    }

    #[test]
    fn a_prefix_is_matched_literally_and_passwords_are_never_shown() {
        assert_eq!(glob("app*[1]:"), "app\\*\\[1\\]:");
        assert_eq!(
            redact("redis://:hunter2@10.0.0.5:6379/0"),
            "redis://:***@10.0.0.5:6379/0"
        );
        assert_eq!(
            redact("rediss://ops:pw@cache:6380"),
            "rediss://ops:***@cache:6380"
        );
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
    }
}
