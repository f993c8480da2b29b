//! Rate limiters in Redis: one key per limiter (or partition), `<prefix>{name}:rate`, under the
//! same hash tag as a semaphore of that name, so both sit on one Cluster node. Every check is
//! one call of `lua/rate.lua` (with `lua/gcra.lua`), by SHA (with the source on `NOSCRIPT`).

use std::sync::Arc;
use std::time::Duration;

use redis::Value;
use tokio::time::Instant;

use super::keys::hash_tag;
use super::script::{Lua, invoke};
use super::{Connection, RedisBackend};
use crate::Error;
use crate::backend::gcra::{
    Gcra, OpenedRate, RateBackend, RateDecision, RateKey, RateStore, sealed::OpenRate,
};
use crate::sync::BoxFuture;

/// One GCRA check, in one script.
static RATE: Lua = Lua::new(concat!(
    include_str!("../lua/gcra.lua"),
    include_str!("../lua/rate.lua")
));

impl RateBackend for RedisBackend {}

impl OpenRate for RedisBackend {
    fn open_rate(&self, name: &str, gcra: Gcra) -> Result<OpenedRate, Error> {
        let store = Arc::new(RedisRate {
            shared: self.shared.clone(),
            prefix: self.prefix.clone(),
            name: name.into(),
            key: rate_key(&self.prefix, name).into(),
            gcra,
        });
        Ok(OpenedRate { store })
    }
}

/// The key of the limiter (or partition) called `name`.
fn rate_key(prefix: &str, name: &str) -> String {
    format!("{prefix}{}:rate", hash_tag(name))
}

struct RedisRate {
    shared: Arc<Connection>,
    prefix: Arc<str>,
    name: Arc<str>,
    /// Shared with the acquires that carry this limiter (`combinable`): no copy per request.
    key: Arc<str>,
    gcra: Gcra,
}

impl RedisRate {
    /// One check (see `invoke`). A rate check may run twice only if the first reply was lost
    /// to a dropped connection: at worst it spends its cost twice.
    async fn call(&self, key: &str, n: u32) -> Result<Value, Error> {
        let until = Instant::now() + self.shared.call_timeout;
        let gcra = &self.gcra;
        invoke(&RATE, &self.shared, "rate", until, None, |command, _| {
            command
                .arg(1)
                .arg(key)
                .arg(gcra.rate)
                .arg(gcra.period_us)
                .arg(gcra.burst)
                .arg(n);
        })
        .await
        .map(|(reply, _)| reply)
    }
}

impl RateStore for RedisRate {
    fn check<'a>(
        &'a self,
        key: Option<&'a str>,
        n: u32,
    ) -> BoxFuture<'a, Result<RateDecision, Error>> {
        Box::pin(async move {
            let reply = match key {
                None => self.call(&self.key, n).await?,
                Some(part) => {
                    let key = rate_key(&self.prefix, &format!("{}:{part}", self.name));
                    self.call(&key, n).await?
                }
            };
            decision(&reply).ok_or_else(|| {
                Error::backend(
                    format!(
                        "the rate script answered {reply:?}, which this version does not \
                         understand; is another program or version using the same key prefix?"
                    ),
                    None,
                )
            })
        })
    }

    fn combinable(&self) -> Option<RateKey> {
        Some(RateKey {
            backend: Arc::as_ptr(&self.shared) as usize,
            key: self.key.clone(),
            gcra: self.gcra,
        })
    }
}

/// `{allowed, remaining, retry µs (-1: none), reset µs}`.
pub(super) fn decision(reply: &Value) -> Option<RateDecision> {
    // Read in place: no copy of the numbers on every check.
    let Value::Array(items) = reply else {
        return None;
    };
    let &[
        Value::Int(allowed),
        Value::Int(remaining),
        Value::Int(retry_us),
        Value::Int(reset_us),
    ] = items.as_slice()
    else {
        return None;
    };
    let micros = |us: i64| Duration::from_micros(u64::try_from(us).unwrap_or(0));
    Some(RateDecision {
        allowed: allowed == 1,
        remaining: u32::try_from(remaining).unwrap_or(0),
        retry_after: (allowed != 1).then(|| micros(retry_us)),
        reset_after: micros(reset_us),
        degraded: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(numbers: &[i64]) -> Value {
        Value::Array(numbers.iter().map(|&n| Value::Int(n)).collect())
    }

    #[test]
    fn a_reply_of_four_numbers_is_a_decision() {
        let d = decision(&ints(&[1, 19, -1, 50_000])).unwrap();
        assert!(d.allowed && !d.degraded);
        assert_eq!(d.remaining, 19);
        assert_eq!(d.retry_after, None);
        assert_eq!(d.reset_after, Duration::from_millis(50));
        let d = decision(&ints(&[0, 0, 1_500, 2_000_000])).unwrap();
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_micros(1_500)));
        assert_eq!(d.reset_after, Duration::from_secs(2));
    }

    #[test]
    fn any_other_reply_is_not() {
        for reply in [
            ints(&[1, 19, -1]),
            ints(&[1, 19, -1, 50_000, 0]),
            Value::Array(vec![
                Value::Int(1),
                Value::Int(19),
                Value::Nil,
                Value::Int(50_000),
            ]),
            Value::Int(1),
            Value::Nil,
        ] {
            assert_eq!(decision(&reply), None, "{reply:?}");
        }
    }
}
