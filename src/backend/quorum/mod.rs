//! One semaphore over several independent Redis masters, holding the limit for ANY limit
//! while a majority of them is healthy.
//!
//! # Why not "a majority said yes"
//!
//! The usual multi-node semaphore adds a holder on each node where fewer than L hold, and
//! counts a majority of yeses as a grant. With 3 nodes and L = 2, holders on {A,B}, {B,C} and
//! {A,C} each won a majority, and 3 hold at once: when each node admits L and a grant needs W
//! nodes, ⌊N·L/W⌋ can hold, safe only when W > N·L/(L+1).
//!
//! # What this backend does instead: L slots, each a Redlock mutex
//!
//! - **What each node stores** (`lua/quorum.lua`): for each of the semaphore's L slots, who owns
//!   it and until when (its own clock), and a per-slot counter for fencing tokens.
//! - **What a grant needs**: a holder of weight w reads which slots each node has free, picks w
//!   slots free on a majority, and takes those same w slots, all or nothing, on every node it
//!   can. It holds them only if it took them on a **majority** of nodes, and only for
//!   `lease − elapsed − drift` (drift = lease·factor + 2 ms, factor 0.01 unless configured),
//!   timed from before it asked. Otherwise it gives back whatever it took, on every node.
//! - **Why the limit holds**: a slot has at most one owner at a time, because two majorities
//!   share a node and a node lets one member own a slot until it expires or is released.
//!   Each holder of weight w owns w distinct slots, so the holders' weights add up to at most L.
//!   The validity bound makes the holder stop believing in its slots before any node lets
//!   them go, if the nodes' clocks drift within the configured factor.
//! - **A node that restarted empty** forgot the slots it had granted. Each node records when
//!   its data began (`born`, set once and never expiring) and abstains from granting for one
//!   lease after that: the slots it forgot expire within a lease everywhere else. Every
//!   process must use the same lease for a semaphore.
//! - **A cold start.** A node cannot tell a first start from a restart, but a take reaches
//!   the whole quorum: when the nodes abstaining from one take are a majority of *all* the
//!   nodes, the client asks every node that did not take again, as a cold start
//!   (`take_cold`). Each records that it took part (`opened`, for this semaphore, until its
//!   data is a lease old), stops abstaining and takes: three new nodes grant the first permit
//!   at once, not a lease later. Why this is sound: call a node *fresh* while its data is
//!   younger than a lease and it took part in no cold start, i.e. it restarted empty or is
//!   new. A node that is not fresh remembers every grant it took part in that may still be
//!   held (a cold start forgets only what came before it). The limit is promised while a
//!   majority of the nodes is healthy, and a fresh node is not healthy yet (it may lack slots
//!   granted before its data began): fresh nodes are then a minority, so no take ever sees a
//!   majority abstain, and every fresh node abstains for its lease, as before. A majority of
//!   fresh nodes is a first start (nothing was granted) or a majority that lost its data at
//!   once, which the promise does not cover; rather than refuse every grant for a lease (what
//!   made a first start refuse), the semaphore then serves at once, and can exceed the limit
//!   only if slots granted before the loss are still held, for at most one lease. Counting *fresh* nodes, not young ones, matters: the
//!   nodes of a cold start are all younger than a lease for a lease, and one of them
//!   restarting then must still abstain alone (`tests/quorum.rs` checks it).
//! - **An abstention that blocks a grant** (the nodes that took and the ones abstaining would
//!   have been a majority; with a node down and one restarted, say) is not a full semaphore,
//!   and is not reported as one: `try_acquire` fails with
//!   [`Error::Backend`](crate::Error::Backend), naming the abstaining nodes and for how much
//!   longer they abstain; `acquire` waits for them if they take part again within its acquire
//!   timeout, and otherwise fails the same way at once.
//!   The semaphore's `OutagePolicy` decides, as when too few nodes answer.
//! - **A paused or unreachable node** answers late or not at all; it is counted out, and a
//!   grant needs a majority of the others. Fewer than a majority reachable is a backend failure,
//!   decided by the semaphore's `OutagePolicy`.
//! - **Renewal** extends the holder's slots on every node that still has them; it counts only
//!   if a majority did, within the validity bound.
//!
//! # Fencing tokens
//!
//! A grant's token is the largest per-slot counter among the nodes that granted it, written
//! back ("sealed") to those nodes before the permit is handed out. Each later owner of one of
//! its slots takes that slot on a node where the seal happened first, so its token is
//! larger: **tokens strictly increase among the successive holders of each slot**. Holders
//! of different slots may get tokens in either order (on one node they are globally ordered).
//! With limit 1 there is one slot, and fencing works exactly as on one node.
//!
//! # Waiting
//!
//! There is no line across nodes and no FIFO order: a waiter tries again when a node announces
//! that it freed a slot (pub/sub on every node), or when the earliest lease may end, or after
//! a jittered pause. Every try is bounded and costs three round trips (read, take, seal), in
//! parallel on the nodes; a cold start costs a fourth (the second take).
//!
//! # Where the code is
//!
//! Beside [`QuorumBackend`] here: `builder.rs` makes it and connects, `node.rs` is one master
//! (and the subscriptions on all of them), `semaphore.rs` one semaphore's keys and its calls
//! to every node at once, `grant.rs` how a grant is won, `store.rs` what the semaphore asks.

use std::sync::Arc;
use std::time::Duration;

mod builder;
mod grant;
mod node;
mod owed;
mod semaphore;
mod store;

pub use self::builder::QuorumBackendBuilder;
use self::node::Node;
use crate::waitlist::Hub;

/// A semaphore store over several independent Redis masters (no replication between them):
/// at most `limit` holders at any instant, for any limit, while a majority of the nodes is
/// healthy and their clocks drift within the configured bound. See the module docs for the
/// design and what `fencing_token` guarantees here.
///
/// # Examples
///
/// ```no_run
/// use tower_distributed_limit::{QuorumBackend, Semaphore};
///
/// # async fn run() -> Result<(), tower_distributed_limit::Error> {
/// let quorum = QuorumBackend::connect(&["redis://a:6379", "redis://b:6379", "redis://c:6379"]).await?;
/// let sem = Semaphore::builder("gpu").limit(4).build(quorum)?;   // the same Semaphore API
/// let permit = sem.acquire().await?;
/// # drop(permit); Ok(()) }
/// ```
///
/// # Rate limits need a `RedisBackend`
///
/// A GCRA over independent masters would not be exact, so a `QuorumBackend` is no
/// [`RateBackend`](crate::RateBackend): a [`RateLimiter`](crate::RateLimiter) on one does not
/// compile. Keep the rate on a [`RedisBackend`](crate::RedisBackend) (one node, a Cluster or
/// Sentinel's master) beside the quorum's semaphore.
///
/// ```compile_fail,E0277
/// use std::time::Duration;
/// use tower_distributed_limit::{QuorumBackend, RateLimiter};
///
/// fn rate(quorum: QuorumBackend) -> RateLimiter {
///     RateLimiter::builder("api").rate(100, Duration::from_secs(1)).build(quorum).unwrap()
/// }
/// ```
#[derive(Clone)]
pub struct QuorumBackend {
    shared: Arc<Nodes>,
    prefix: Arc<str>,
}

impl std::fmt::Debug for QuorumBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuorumBackend")
            .field("nodes", &self.shared.nodes.len())
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// What clones of one `QuorumBackend` share.
struct Nodes {
    nodes: Vec<Arc<Node>>,
    hub: Arc<Hub>,
    drift_factor: f64,
    /// Every call to a node, reconnecting included, ends by then: a dead node slows no one.
    call_timeout: Duration,
}
