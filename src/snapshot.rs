//! A semaphore as an operator sees it: [`Semaphore::snapshot`](crate::Semaphore::snapshot).

use std::time::Duration;

use crate::Priority;
use crate::backend::Member;
use crate::class::Classes;

/// A semaphore now, across every process: the limit every process admits by, the weight held,
/// how many wait, and every holder.
///
/// # Examples
///
/// ```
/// use tower_distributed_limit::{MemoryBackend, Semaphore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_distributed_limit::Error> {
/// let sem = Semaphore::builder("reports").limit(3).build(MemoryBackend::new())?;
/// let permit = sem.acquire_many(2).await?;
/// let snap = sem.snapshot().await?;
/// assert_eq!((snap.limit, snap.used, snap.waiting), (3, 2, 0));
/// assert_eq!(snap.holders[0].id, permit.id());
/// assert_eq!(snap.holders[0].weight, 2);
/// assert_eq!(snap.classes[0].used, 2); // NORMAL, the only class that holds
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Snapshot {
    /// The limit every process admits by now (see [`Semaphore::set_limit`](crate::Semaphore::set_limit)).
    pub limit: u32,
    /// The weight of the live holders.
    pub used: u32,
    /// How many wait in line, across every process.
    pub waiting: u32,
    /// The limit was set by an operator ([`Semaphore::set_limit`](crate::Semaphore::set_limit))
    /// and stays until [`unset_limit`](crate::Semaphore::unset_limit).
    pub pinned: bool,
    /// The live holders, longest-held first: every one, or on Redis the first 100 to end (a
    /// bounded read; `used` counts them all).
    pub holders: Vec<Holder>,
    /// Each class that has a share, holds or waits, highest first (see
    /// [`SemaphoreBuilder::class`](crate::SemaphoreBuilder::class)).
    pub classes: Vec<ClassSnapshot>,
    /// The tenants with the most waiters, most first: at most [`TENANTS_SHOWN`], counted on
    /// Redis among the first 1 000 tenant waiters (bounded, whatever the line holds). Empty on
    /// a quorum, which does not serve tenants in turn.
    pub tenants_waiting: Vec<TenantWaiting>,
    /// On Redis, how many of the processes that used the semaphore within the last hour speak
    /// each protocol version, lowest first (builds before the version was told count as 1):
    /// during a rolling deploy, two. Empty on the other backends.
    pub protocols: Vec<ProtocolInUse>,
}

/// The version of the protocol this build speaks to Redis (the layout of a semaphore's keys,
/// its members and its calls: docs/protocol.md). A build serves a semaphore beside processes
/// of its own version and the one before, and refuses one kept by a newer version.
pub const PROTOCOL_VERSION: u32 = 2;

/// The processes of one protocol version, in a [`Snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProtocolInUse {
    /// The version ([`PROTOCOL_VERSION`] is this build's).
    pub version: u32,
    /// How many processes speak it.
    pub processes: u32,
}

impl ProtocolInUse {
    /// Whether a process of this build serves beside processes of this version: its own
    /// version, or the one before.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_distributed_limit::{PROTOCOL_VERSION, ProtocolInUse};
    ///
    /// assert!(ProtocolInUse::new(PROTOCOL_VERSION, 3).is_supported());
    /// assert!(ProtocolInUse::new(PROTOCOL_VERSION - 1, 1).is_supported());
    /// assert!(!ProtocolInUse::new(PROTOCOL_VERSION + 1, 1).is_supported());
    /// ```
    pub fn is_supported(&self) -> bool {
        self.version + 1 >= PROTOCOL_VERSION && self.version <= PROTOCOL_VERSION
    }

    /// `processes` processes of protocol `version`.
    pub fn new(version: u32, processes: u32) -> Self {
        ProtocolInUse { version, processes }
    }
}

/// How many tenants a [`Snapshot`] names at most.
pub const TENANTS_SHOWN: usize = 16;

/// One class in a [`Snapshot`]: its share of the limit, what it holds and how many of it wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClassSnapshot {
    /// The class.
    pub class: Priority,
    /// The permits only it may take ([`Share::reserved`](crate::Share::reserved); 0: none).
    pub reserved: u32,
    /// The most it may hold ([`Share::at_most`](crate::Share::at_most)), if capped.
    pub at_most: Option<u32>,
    /// The weight its holders hold.
    pub used: u32,
    /// How many of it wait in line, across every process (0 on a quorum, which does not tell).
    pub waiting: u32,
}

/// A tenant with waiters, in a [`Snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TenantWaiting {
    /// The tenant, as [`Ask::tenant_id`](crate::Ask::tenant_id) names it (its key is never
    /// stored).
    pub tenant: u64,
    /// How many of its requests wait, in every class.
    pub waiting: u32,
}

impl Snapshot {
    /// The weight the listed holders hold, per class level: the backends that list every
    /// holder count each class's weight with it.
    pub(crate) fn weights(&self) -> [u32; 8] {
        let mut used = [0u32; 8];
        for holder in &self.holders {
            let level = usize::from(holder.class.level());
            used[level] = used[level].saturating_add(holder.weight);
        }
        used
    }

    /// Completes a backend's snapshot: each class's share (from `classes`), beside the weight
    /// held (`used[level]`, see [`Snapshot::weights`]) and the waiting counts the backend found
    /// (`waiting[level]`), and the busiest of the tenants' waiting counts (`tenants`).
    pub(crate) fn complete(
        &mut self,
        classes: &Classes,
        used: [u32; 8],
        waiting: [u32; 8],
        tenants: impl IntoIterator<Item = (u64, u32)>,
    ) {
        self.classes = (0..=Priority::MAX)
            .rev()
            .map(Priority::new)
            .map(|class| {
                let level = usize::from(class.level());
                ClassSnapshot {
                    class,
                    reserved: classes.reserved(class),
                    at_most: classes.at_most(class),
                    used: used[level],
                    waiting: waiting[level],
                }
            })
            .filter(|class| {
                class.reserved > 0 || class.at_most.is_some() || class.used > 0 || class.waiting > 0
            })
            .collect();
        let mut tenants: Vec<TenantWaiting> = tenants
            .into_iter()
            .filter(|&(_, waiting)| waiting > 0)
            .map(|(tenant, waiting)| TenantWaiting { tenant, waiting })
            .collect();
        tenants.sort_by_key(|tenant| (std::cmp::Reverse(tenant.waiting), tenant.tenant));
        tenants.truncate(TENANTS_SHOWN);
        self.tenants_waiting = tenants;
    }
}

/// One holder in a [`Snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// Its [`Permit::id`](crate::Permit::id).
    pub id: String,
    /// How many permits it holds.
    pub weight: u32,
    /// How long since it was granted (zero where the backend does not track it: the quorum).
    pub held_for: Duration,
    /// How long until its lease ends unless renewed.
    pub lease_remaining: Duration,
    /// The process that holds it: `host:pid`, or the name it was given
    /// ([`RedisBackendBuilder::process_name`](crate::RedisBackendBuilder::process_name)).
    /// Empty where it is not known: on a quorum, and on Redis for a process that has not told
    /// its name since Redis lost it (it tells again with its first call on a new connection,
    /// else within 30 s).
    pub process: String,
    /// Its class ([`Priority::NORMAL`](crate::Priority::NORMAL) unless it asked for another).
    pub class: Priority,
    /// Its slot belongs to its process's prefetch
    /// ([`SemaphoreBuilder::prefetch`](crate::SemaphoreBuilder::prefetch)): held ahead of
    /// need, on hand there or handed out to a request, and given back once anyone waits.
    pub prefetched: bool,
}

impl Holder {
    /// The holder whose member text is `member` (its id, weight, class and pool read from the
    /// text); `None` for a text no process of this crate writes.
    pub(crate) fn of(
        member: &str,
        held_for: Duration,
        lease_remaining: Duration,
        process: String,
    ) -> Option<Holder> {
        let read = Member::read(member)?;
        Some(Holder {
            id: read.id.to_owned(),
            weight: read.weight,
            held_for,
            lease_remaining,
            process,
            class: read.class,
            prefetched: read.prefetched,
        })
    }
}
