//! The rate limit's vocabulary and arithmetic: a GCRA (generic cell rate algorithm) whose state
//! is one theoretical arrival time (TAT) per limiter, what a backend implements to keep it
//! ([`RateStore`], opened by `sealed::OpenRate`), and the [`RateDecision`] a check answers.
//!
//! # Exact integer arithmetic
//!
//! One unit of cost is emitted every `T = period / rate`. `T` is rarely a whole number of
//! microseconds (1 s / 3), so a TAT is kept as whole microseconds plus a remainder in
//! `1 / rate` µs: `tat = us + rem / rate`, `0 <= rem < rate`. Every comparison is made in those
//! `1 / rate` µs units *relative to now*, so no product grows with the clock: the largest value
//! is about `burst · period_µs`, which the builder keeps below 2^53, where Lua's doubles (and
//! `i128` here) are exact. `lua/gcra.lua` runs the very same steps on the Redis server's clock.

use std::sync::Arc;
use std::time::Duration;

use crate::Error;
use crate::sync::BoxFuture;

/// The largest integer a Lua number (a double) holds exactly.
pub(crate) const EXACT: u64 = 1 << 53;

pub(crate) mod sealed {
    /// Opens the rate limiter called `name` (its state under the `{name}` hash tag).
    pub trait OpenRate {
        fn open_rate(
            &self,
            name: &str,
            gcra: super::Gcra,
        ) -> Result<super::OpenedRate, crate::Error>;
    }
}

/// A store of rate limiters: [`RedisBackend`](crate::RedisBackend) across processes (one
/// node, a Cluster or Sentinel's master), [`MemoryBackend`](crate::MemoryBackend) within one
/// process. Pass one to [`RateLimiterBuilder::build`](crate::RateLimiterBuilder::build).
/// [`QuorumBackend`](crate::QuorumBackend) does not implement it (a GCRA over independent
/// masters would not be exact), so a limiter on one does not compile.
///
/// Sealed, like [`Backend`](crate::Backend).
pub trait RateBackend: sealed::OpenRate + Send + Sync + 'static {}

/// What one rate check decided.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_distributed_limit::{MemoryBackend, RateLimiter};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
/// let rate = RateLimiter::builder("api").rate(10, Duration::from_secs(1)).burst(2).build(MemoryBackend::new())?;
/// let d = rate.check().await?;
/// assert!(d.allowed && d.remaining == 1 && d.retry_after.is_none());
/// rate.check().await?;
/// let refused = rate.check().await?;
/// assert!(!refused.allowed);
/// assert!(refused.retry_after.unwrap() <= Duration::from_millis(100));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RateDecision {
    /// The request may go ahead (its cost was spent); `false`: nothing was spent.
    pub allowed: bool,
    /// How many more requests of cost 1 would be allowed right now.
    pub remaining: u32,
    /// Refused: how long until the same request would be allowed. `None` when allowed.
    pub retry_after: Option<Duration>,
    /// How long until the limiter is full again (the whole burst available), if nothing else
    /// arrives meanwhile.
    pub reset_after: Duration,
    /// Decided by the outage policy, not by the backend (which could not be reached).
    pub degraded: bool,
}

impl RateDecision {
    /// A refusal that asks to wait `retry_after` (and spent nothing).
    pub(crate) fn refused(retry_after: Duration) -> Self {
        RateDecision {
            allowed: false,
            remaining: 0,
            retry_after: Some(retry_after),
            reset_after: retry_after,
            degraded: false,
        }
    }
}

/// A validated rate: `rate` per `period_us`, at most `burst` at once. Public only in name, so
/// the sealed trait can take it; nothing outside the crate can reach it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    pub(crate) rate: u64,
    pub(crate) period_us: u64,
    pub(crate) burst: u64,
}

/// A TAT: `us + rem / rate` microseconds on the backend's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Tat {
    pub(crate) us: u64,
    pub(crate) rem: u64,
}

impl Gcra {
    /// Decides a request of cost `n` at `now_us`, given the stored TAT: the decision, and the
    /// TAT to store when it is allowed. The steps of `lua/gcra.lua`, in `i128`.
    pub(crate) fn decide(&self, stored: Option<Tat>, now_us: u64, n: u64) -> (RateDecision, Tat) {
        let (rate, period, burst) = (
            i128::from(self.rate),
            i128::from(self.period_us),
            i128::from(self.burst),
        );
        let now = i128::from(now_us);
        // A TAT in the past is now: the limiter is full.
        let (base_us, base_rem) = match stored {
            Some(tat) if i128::from(tat.us) >= now => (i128::from(tat.us), i128::from(tat.rem)),
            _ => (now, 0),
        };
        let n = i128::from(n);
        // new = base + n·T, T = period / rate = t_us + t_rem / rate.
        let rem = base_rem + n * (period % rate);
        let new_us = base_us + n * (period / rate) + rem / rate;
        let new_rem = rem % rate;
        // Everything below in 1/rate µs, relative to now.
        let tolerance = burst * period;
        let new_ahead = (new_us - now) * rate + new_rem;
        let allowed = new_ahead <= tolerance;
        let ahead = if allowed {
            new_ahead
        } else {
            (base_us - now) * rate + base_rem
        };
        let remaining = ((tolerance - ahead).max(0) / period).min(i128::from(u32::MAX));
        let retry_after = (!allowed).then(|| micros_up(new_ahead - tolerance, rate));
        let decision = RateDecision {
            allowed,
            remaining: remaining as u32,
            retry_after,
            reset_after: micros_up(ahead, rate),
            degraded: false,
        };
        let tat = Tat {
            us: new_us as u64,
            rem: new_rem as u64,
        };
        (decision, tat)
    }
}

/// `units` of 1/rate µs as a duration, rounded up to the microsecond.
fn micros_up(units: i128, rate: i128) -> Duration {
    let us = (units.max(0) + rate - 1) / rate;
    Duration::from_micros(u64::try_from(us).unwrap_or(u64::MAX))
}

/// A rate limiter a store may decide in the same call as an acquire (see
/// [`Store::combines`](super::Store::combines)): which backend connection holds it, its key
/// there and its rate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RateKey {
    /// The backend's identity (its shared connection's address): a store only combines with a
    /// limiter on the very same connection.
    pub(crate) backend: usize,
    pub(crate) key: Arc<str>,
    pub(crate) gcra: Gcra,
}

/// A rate limit to spend `cost` of, only if the acquire it goes with is granted at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rated {
    pub(crate) limiter: RateKey,
    pub(crate) cost: u32,
}

/// One rate limiter opened on a backend. Public only in name, like [`Gcra`].
pub struct OpenedRate {
    pub(crate) store: Arc<dyn RateStore>,
}

/// One rate limiter (or one partition of it) in one backend.
pub(crate) trait RateStore: Send + Sync + 'static {
    /// Spends `n` if it fits now (all or nothing), for the limiter's partition `key` (`None`:
    /// the limiter itself).
    fn check<'a>(
        &'a self,
        key: Option<&'a str>,
        n: u32,
    ) -> BoxFuture<'a, Result<RateDecision, Error>>;

    /// The limiter itself (not a partition) as a semaphore's store may decide it in the same
    /// call as an acquire; `None` where no store can.
    fn combinable(&self) -> Option<RateKey> {
        None
    }
}

/// The rate limiters of one in-process backend: name → TAT. Entries whose TAT passed are
/// full limiters and are swept, so nothing is left behind.
#[derive(Default)]
pub(crate) struct Cells {
    tats: std::collections::HashMap<Arc<str>, Tat>,
    /// The size after the last sweep: the next one runs when it has doubled.
    swept: usize,
}

impl Cells {
    /// Decides for `name` at `now_us`, storing the new TAT when allowed.
    pub(crate) fn check(&mut self, name: &str, gcra: &Gcra, now_us: u64, n: u64) -> RateDecision {
        let stored = self.tats.get(name).copied();
        let (decision, tat) = gcra.decide(stored, now_us, n);
        if decision.allowed {
            match self.tats.get_mut(name) {
                Some(slot) => *slot = tat,
                None => {
                    self.tats.insert(name.into(), tat);
                }
            }
        }
        if self.tats.len() > (2 * self.swept).max(64) {
            self.tats.retain(|_, tat| tat.us >= now_us);
            self.swept = self.tats.len();
        }
        decision
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gcra(rate: u64, period_ms: u64, burst: u64) -> Gcra {
        Gcra {
            rate,
            period_us: period_ms * 1000,
            burst,
        }
    }

    #[test]
    fn a_burst_then_one_per_interval() {
        let g = gcra(10, 1000, 3);
        let mut tat = None;
        for left in [2, 1, 0] {
            let (d, t) = g.decide(tat, 0, 1);
            assert!(d.allowed);
            assert_eq!(d.remaining, left);
            tat = Some(t);
        }
        let (d, _) = g.decide(tat, 0, 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_millis(100)));
        assert_eq!(d.reset_after, Duration::from_millis(300));
        let (d, _) = g.decide(tat, 100_000, 1);
        assert!(d.allowed);
    }

    #[test]
    fn thirds_of_a_second_add_up_exactly() {
        // 3 per second: T = 333 333.33 µs, never rounded. Three million requests at once (the
        // burst allows them) push the TAT exactly 1 000 000 s ahead: no drift.
        let g = gcra(3, 1000, 3_000_000);
        let mut tat = None;
        for _ in 0..3_000_000u64 {
            let (d, t) = g.decide(tat, 0, 1);
            assert!(d.allowed);
            tat = Some(t);
        }
        assert_eq!(
            tat,
            Some(Tat {
                us: 1_000_000_000_000,
                rem: 0
            })
        );
        let (d, _) = g.decide(tat, 0, 1);
        assert!(!d.allowed && d.remaining == 0);
        assert_eq!(d.retry_after, Some(Duration::from_micros(333_334)));
        // One emission interval later exactly one fits again.
        let (d, _) = g.decide(tat, 333_334, 1);
        assert!(d.allowed && d.remaining == 0);
    }

    #[test]
    fn cost_above_what_is_left_spends_nothing() {
        let g = gcra(100, 1000, 10);
        let (d, t) = g.decide(None, 5, 8);
        assert!(d.allowed && d.remaining == 2);
        let (d, _) = g.decide(Some(t), 5, 3);
        assert!(!d.allowed && d.remaining == 2);
        assert_eq!(d.retry_after, Some(Duration::from_millis(10)));
    }

    #[test]
    fn a_tat_in_the_past_is_a_full_limiter() {
        let g = gcra(10, 1000, 3);
        let long_ago = Some(Tat { us: 50, rem: 7 });
        assert_eq!(
            g.decide(long_ago, 1_000_000, 2),
            g.decide(None, 1_000_000, 2)
        );
        let (d, tat) = g.decide(long_ago, 1_000_000, 2);
        assert!(d.allowed && d.remaining == 1);
        // Counted from now, not from the old TAT: two intervals of 100 ms.
        assert_eq!(
            tat,
            Tat {
                us: 1_200_000,
                rem: 0
            }
        );
        assert_eq!(d.reset_after, Duration::from_millis(200));
    }

    #[test]
    fn the_burst_comes_back_one_interval_at_a_time() {
        // 10 per second: one back every 100 ms, none before.
        let g = gcra(10, 1000, 3);
        let (_, empty) = g.decide(None, 0, 3);
        let (d, _) = g.decide(Some(empty), 99_999, 1);
        assert!(!d.allowed && d.remaining == 0);
        assert_eq!(d.retry_after, Some(Duration::from_micros(1)));
        let (d, _) = g.decide(Some(empty), 100_000, 1);
        assert!(d.allowed && d.remaining == 0);
        // Half an interval more brings no second one.
        let (d, _) = g.decide(Some(empty), 150_000, 1);
        assert!(d.allowed && d.remaining == 0);
        let (d, _) = g.decide(Some(empty), 200_000, 1);
        assert!(d.allowed && d.remaining == 1);
    }

    #[test]
    fn a_cost_above_the_burst_never_fits() {
        let g = gcra(10, 1000, 3);
        for now in [0, 1_000_000, 1 << 40] {
            let (d, _) = g.decide(None, now, 4);
            assert!(!d.allowed, "at {now}");
            // Nothing was spent: the limiter is still full.
            assert_eq!((d.remaining, d.reset_after), (3, Duration::ZERO));
        }
    }

    #[test]
    fn fractions_of_a_microsecond_round_up() {
        // 3 per second, burst 2: one request puts the TAT 333 333⅓ µs ahead.
        let g = gcra(3, 1000, 2);
        let (d, tat) = g.decide(None, 0, 1);
        assert_eq!(
            tat,
            Tat {
                us: 333_333,
                rem: 1
            }
        );
        assert_eq!(d.reset_after, Duration::from_micros(333_334));
        let (_, tat) = g.decide(Some(tat), 0, 1);
        assert_eq!(
            tat,
            Tat {
                us: 666_666,
                rem: 2
            }
        );
        let (d, _) = g.decide(Some(tat), 0, 1);
        assert!(!d.allowed);
        // A third of a microsecond still to wait is a whole one.
        assert_eq!(d.retry_after, Some(Duration::from_micros(333_334)));
        assert_eq!(d.reset_after, Duration::from_micros(666_667));
    }

    #[test]
    fn cells_store_only_what_was_allowed() {
        let (g, mut cells) = (gcra(10, 1000, 3), Cells::default());
        assert!(!cells.check("api", &g, 0, 4).allowed);
        assert!(cells.tats.is_empty());
        assert!(cells.check("api", &g, 0, 3).allowed);
        assert_eq!(
            cells.tats["api"],
            Tat {
                us: 300_000,
                rem: 0
            }
        );
        assert!(!cells.check("api", &g, 0, 1).allowed);
        assert_eq!(
            cells.tats["api"],
            Tat {
                us: 300_000,
                rem: 0
            }
        );
    }

    #[test]
    fn cells_sweep_the_full_limiters_once_they_doubled() {
        let (g, mut cells) = (gcra(10, 1000, 3), Cells::default());
        // The first 64 limiters are never swept; the 65th sweeps, and every TAT is ahead.
        for i in 0..65 {
            cells.check(&format!("old-{i}"), &g, 0, 1);
        }
        assert_eq!((cells.tats.len(), cells.swept), (65, 65));
        // A second later every old TAT passed; nothing is swept until the size doubles.
        for i in 0..65 {
            cells.check(&format!("new-{i}"), &g, 1_000_000, 1);
        }
        assert_eq!(cells.tats.len(), 130);
        cells.check("new-65", &g, 1_000_000, 1);
        assert_eq!((cells.tats.len(), cells.swept), (66, 66));
        assert!(cells.tats.keys().all(|name| name.starts_with("new-")));
    }
}
