//! A semaphore as an operator sees it: [`Semaphore::snapshot`](crate::Semaphore::snapshot).

use std::time::Duration;

/// A semaphore now, across every process: the limit every process admits by, the weight held,
/// how many wait, and every holder.
///
/// # Example
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
    /// Every live holder, longest-held first.
    pub holders: Vec<Holder>,
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
    pub class: crate::Priority,
}
