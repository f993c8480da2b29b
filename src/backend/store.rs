//! What every backend implements, and the vocabulary of its calls: one semaphore's [`Store`],
//! the [`Member`]s it holds, how an acquire may treat them ([`Mode`]) and what it found
//! ([`Attempt`]).

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::backend::gcra::{RateDecision, RateKey, Rated};
use crate::snapshot::Snapshot;
use crate::sync::BoxFuture;
use crate::waitlist::{ClockReading, Refresh, Waitlist};
use crate::{Error, Priority};

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

/// One acquisition's identity in a backend: `"<random id>:<weight>:<lease ms>"`, with
/// `:c<level>` after the id for a class other than [`Priority::NORMAL`], then `:t<16 hex>`
/// for a tenant, then `:p` for a slot a prefetching process may keep in its pool, so any
/// process that admits it from the line knows its class, tenant, weight and lease (and an
/// operator which holders are pooled). Equal when the text is.
#[derive(Clone, Debug)]
pub(crate) struct Member {
    pub(crate) text: Arc<str>,
    pub(crate) weight: u32,
    pub(crate) lease: Duration,
    pub(crate) priority: Priority,
    pub(crate) tenant: Option<u64>,
    /// Its slot may go to this process's prefetch pool (`:p` in the text).
    pub(crate) pooled: bool,
}

/// The random id's length: 128 bits in hex.
const ID_LEN: usize = 32;

/// The id's first hex digits: this process's tag (32 random bits drawn once), so a backend can
/// tell which process a member belongs to (Redis announces a grant on that process's channel
/// only). The other 96 bits are drawn per member.
pub(crate) const TAG_LEN: usize = 8;

/// This process's tag, as the first [`TAG_LEN`] hex digits of every member id.
pub(crate) fn process_tag() -> u32 {
    static TAG: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *TAG.get_or_init(|| fastrand::u32(..))
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

impl Member {
    /// A fresh holder of `weight` in [`Priority::NORMAL`].
    #[cfg(test)]
    pub(crate) fn new(weight: u32, lease: Duration) -> Self {
        Self::asking(&crate::Ask::new().weight(weight), lease, false)
    }

    /// A fresh holder id, never reused (this process's tag, then 96 random bits), for `ask`;
    /// `pooled`: its slot may go to this process's prefetch pool.
    pub(crate) fn asking(ask: &crate::Ask, lease: Duration, pooled: bool) -> Self {
        let (weight, priority) = (ask.permits(), ask.class());
        use std::fmt::Write;
        const HEX: &[u8; 16] = b"0123456789abcdef";
        // By hand: `{:032x}` of a u128 is a measurable share of an in-process acquire.
        let tag_bits = 4 * TAG_LEN as u32;
        let id = (u128::from(process_tag()) << (128 - tag_bits)) | (fastrand::u128(..) >> tag_bits);
        let mut text = String::with_capacity(ID_LEN + 16);
        text.extend(
            (0..ID_LEN)
                .rev()
                .map(|digit| HEX[(id >> (4 * digit)) as usize & 0xf] as char),
        );
        // Writing to a String cannot fail.
        if priority != Priority::NORMAL {
            let _ = write!(text, ":c{}", priority.level());
        }
        if let Some(tenant) = ask.tenant_id() {
            let _ = write!(text, ":t{tenant:016x}");
        }
        if pooled {
            text.push_str(":p");
        }
        let _ = write!(text, ":{weight}:{}", lease.as_millis());
        Member {
            text: text.into(),
            weight,
            lease,
            priority,
            tenant: ask.tenant_id(),
            pooled,
        }
    }

    /// A member's text read back (from a backend's snapshot); `None` for a text no process
    /// of this crate writes.
    pub(crate) fn read(text: &str) -> Option<Read<'_>> {
        let (head, _lease) = text.rsplit_once(':')?;
        let (head, weight) = head.rsplit_once(':')?;
        let mut parts = head.split(':');
        let id = parts.next()?;
        let mut read = Read {
            id,
            class: Priority::NORMAL,
            weight: weight.parse().ok()?,
            pooled: false,
        };
        for part in parts {
            if let Some(level) = part.strip_prefix('c') {
                read.class = Priority::new(level.parse().ok()?);
            }
            read.pooled |= part == "p";
        }
        Some(read)
    }

    /// The random id alone.
    pub(crate) fn id(&self) -> &str {
        &self.text[..ID_LEN]
    }
}

/// What a member's text says of it ([`Member::read`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Read<'a> {
    pub(crate) id: &'a str,
    pub(crate) class: Priority,
    pub(crate) weight: u32,
    /// Its slot may sit in a prefetching process's pool.
    pub(crate) pooled: bool,
}

impl PartialEq for Member {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for Member {}

impl Hash for Member {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.text.hash(state);
    }
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
/// prefetch pool, still held. An adaptive limit's samples: `count` holds of `mean` each.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_is_its_hex_id_weight_and_lease() {
        let member = Member::new(3, Duration::from_millis(1500));
        let (id, rest) = member.text.split_at(ID_LEN);
        assert!(
            id.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_eq!(rest, ":3:1500");
        assert_eq!(member.id(), id);
        assert_eq!(id[..TAG_LEN], format!("{:08x}", process_tag()));
        assert_ne!(Member::new(3, Duration::from_millis(1500)), member);
        fn read(text: &str, class: Priority, weight: u32, pooled: bool) -> Option<Read<'_>> {
            Some(Read {
                id: &text[..ID_LEN],
                class,
                weight,
                pooled,
            })
        }
        let batch = crate::Ask::new().weight(2).priority(Priority::BATCH);
        let member = Member::asking(&batch, Duration::from_millis(900), false);
        assert_eq!(&member.text[ID_LEN..], ":c2:2:900");
        assert_eq!(
            Member::read(&member.text),
            read(&member.text, Priority::BATCH, 2, false)
        );
        let plain = Member::new(3, Duration::from_millis(9));
        assert_eq!(
            Member::read(&plain.text),
            read(&plain.text, Priority::NORMAL, 3, false)
        );
        let tenant = crate::Ask::new().priority(Priority::BATCH).tenant("acme");
        let member = Member::asking(&tenant, Duration::from_millis(900), false);
        let hex = format!(":c2:t{:016x}:1:900", tenant.tenant_id().unwrap_or_default());
        assert_eq!(&member.text[ID_LEN..], hex);
        assert_eq!(
            Member::read(&member.text),
            read(&member.text, Priority::BATCH, 1, false)
        );
        let pooled = Member::asking(&crate::Ask::new(), Duration::from_millis(900), true);
        assert_eq!(&pooled.text[ID_LEN..], ":p:1:900");
        assert_eq!(
            Member::read(&pooled.text),
            read(&pooled.text, Priority::NORMAL, 1, true)
        );
        assert_eq!(Member::read("junk"), None);
    }
}
