//! What every backend implements, and the vocabulary of its calls: one semaphore's [`Store`],
//! the [`Member`]s it holds, how an acquire may treat them ([`Mode`]) and what it found
//! ([`Attempt`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::Error;
use crate::backend::gcra::{RateDecision, RateKey, Rated};
use crate::snapshot::Snapshot;
use crate::sync::BoxFuture;
use crate::waitlist::{ClockReading, Refresh, Waitlist};

// A member (`member.rs`) is the vocabulary of every call: the backends may name it from here.
pub(crate) use crate::backend::member::{Member, process_tag};

pub(crate) mod sealed {
    /// Opens the permits of one semaphore name with its limit (adapting within `adaptive`'s
    /// bounds when given) and its classes' shares; `claim` is how long a grant to a waiter
    /// stays provisional before its process must claim it (a backend that announces grants to
    /// other processes uses it).
    pub trait Open {
        fn open(
            &self,
            name: &str,
            limit: u32,
            adaptive: Option<crate::AdaptiveLimit>,
            classes: &crate::class::Classes,
            claim: std::time::Duration,
        ) -> super::Opened;

        /// Why this backend cannot adapt a limit, if it cannot.
        fn cannot_adapt(&self) -> Option<&'static str> {
            None
        }

        /// Why this backend cannot give classes shares of the limit, if it cannot.
        fn cannot_share(&self) -> Option<&'static str> {
            None
        }
    }
}

/// One semaphore opened on a backend: its permits, and the waitlist the backend announces its
/// grants to (shared by every semaphore of that name on the backend). Public only in name, so
/// the sealed trait can return it; nothing outside the crate can reach it.
pub struct Opened {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) waitlist: Arc<Waitlist>,
}

/// The longest process name kept (bytes): names are stored beside each semaphore.
const NAME_LEN: usize = 64;

/// This process as holders name it: `host:pid` (the host from the kernel, else `$HOSTNAME`).
pub(crate) fn default_process_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|host| host.trim().to_owned())
        .filter(|host| !host.is_empty())
        .unwrap_or_else(|| "localhost".into());
    bounded_name(format!("{host}:{}", std::process::id()))
}

/// `name` cut to [`NAME_LEN`] bytes, at a character boundary.
pub(crate) fn bounded_name(mut name: String) -> String {
    let mut end = name.len().min(NAME_LEN);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name.truncate(end);
    name
}

/// How a hold ended, for an adaptive limit: how long this process held the permit (from the
/// moment it learnt of the grant to the release: no hand-off delay of the backend's in it),
/// and whether its request was overloaded downstream.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Ending {
    pub(crate) held: Option<Duration>,
    pub(crate) overloaded: bool,
}

/// Holds that ended in this process without a release: their slots went back to its
/// prefetch, still held. An adaptive limit's samples: `count` holds of `mean` each.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Samples {
    pub(crate) count: u32,
    pub(crate) mean: Duration,
    pub(crate) overloaded: bool,
}

/// How an acquire call may treat its member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// One attempt: grant if it fits and nobody waits, else [`Attempt::Full`].
    Once,
    /// Grant, or join the line. The member is new to the backend, so no lookup is needed.
    Join,
    /// The member may already hold or wait (a repeat, or the backend dropped it from the
    /// line): look it up first, then grant or join the line again.
    Recheck,
}

/// What one acquire call found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// The holder was added with this fencing token; its lease ends `remaining` after the
    /// backend's clock read at or after the call was sent. `rate`: the grant also spent the
    /// rate limit decided with it, in the same call, with what that left.
    Granted {
        token: u64,
        remaining: Duration,
        rate: Option<RateDecision>,
    },
    /// The holder waits in the line; its grant will be announced to the waitlist. The
    /// earliest lease ends in `retry_in`; `clock` was read by this very call.
    Queued {
        retry_in: Duration,
        clock: ClockReading,
    },
    /// No room and not queued (a one-shot attempt).
    Full,
    /// The member is heavier than the limit every process admits by now.
    TooHeavy { limit: u32 },
    /// It would have been granted at once, but the rate limit decided with it refused: nothing
    /// was added and nothing spent. The same request fits the rate after `retry_after`.
    RateLimited { retry_after: Duration },
}

/// The permits of one semaphore in one backend.
pub(crate) trait Store: Refresh + Send + Sync + 'static {
    /// Adds `member` as a holder if it fits and nobody waits; otherwise queues it or
    /// answers [`Attempt::Full`], as `mode` says. A backend that is loading or busy is asked
    /// again until `until` (or its call timeout when `None`).
    ///
    /// With `rate` (only ever one this store [`combines`](Self::combines) with), a member that
    /// fits at once is granted only if the rate limit allows its cost, spent in the same call;
    /// a queued member spends nothing.
    fn acquire<'a>(
        &'a self,
        member: &'a Member,
        mode: Mode,
        until: Option<Instant>,
        rate: Option<&'a Rated>,
    ) -> BoxFuture<'a, Result<Attempt, Error>>;

    /// Whether [`acquire`](Self::acquire) can decide the rate limiter `rate` in the same call:
    /// it lives in the same backend, where one atomic call reaches both.
    fn combines(&self, rate: &RateKey) -> bool {
        let _ = rate;
        false
    }

    /// Removes the holder or waiter (absent is not an error) and admits whoever now fits. A
    /// holder's hold is an adaptive limit's sample, as `ending` tells it.
    fn release<'a>(
        &'a self,
        member: &'a Member,
        ending: Ending,
    ) -> BoxFuture<'a, Result<(), Error>>;

    /// Releases `member` off the caller's path: at once in-process, or with this semaphore's
    /// next call to the backend (a flush task makes sure there is one soon).
    fn release_later(&self, member: Member, ending: Ending);

    /// Teaches an adaptive limit `samples` (nothing for a fixed limit): at once in-process, or
    /// with this semaphore's next call to the backend, as releases go.
    fn sampled(&self, samples: Samples) {
        let _ = samples;
    }

    /// Extends the leases of `members` that still hold to a full lease; for each, the time left
    /// (from the backend's clock read at or after the call was sent), or `None` for those that
    /// no longer hold (they are never added back).
    fn renew<'a>(
        &'a self,
        members: &'a [Member],
    ) -> BoxFuture<'a, Result<Vec<Option<Duration>>, Error>>;

    /// Ticks each time the connection to the backend was lost: holders renew at once, so a
    /// backend that came back empty is noticed within a round trip. `None` for a backend that
    /// cannot lose its state.
    fn reconnects(&self) -> Option<watch::Receiver<u64>>;

    /// Whether anyone waits in line, as the backend's last reply to this process said, kept
    /// in a watch so a process holding prefetched slots gives them back at once; `None` for a
    /// backend that does not tell (nothing is prefetched there).
    fn crowding(&self) -> Option<watch::Receiver<bool>> {
        None
    }

    /// The weight held by live (unexpired) holders.
    fn used(&self) -> BoxFuture<'_, Result<u32, Error>>;

    /// The semaphore now: its limit in force, used weight, waiters and holders.
    fn snapshot(&self) -> BoxFuture<'_, Result<Snapshot, Error>>;

    /// The limit in force as this process last learnt it (from its last reply), if the
    /// backend tells; for the `dlimit_limit` gauge.
    fn limit_in_force(&self) -> Option<u32> {
        None
    }

    /// Makes `limit` the limit every process admits by, from now on.
    fn set_limit(&self, limit: u32) -> BoxFuture<'_, Result<(), Error>>;

    /// Drops an operator's limit: the limit in force before it is back (see
    /// `Semaphore::unset_limit`).
    fn unset_limit(&self) -> BoxFuture<'_, Result<(), Error>>;

    /// Removes the holder whose id is `id` (an operator's decision); whether it held.
    fn evict<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, Error>>;
}
