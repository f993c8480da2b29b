//! A concurrency limit shared by every process and machine that uses one Redis.
//!
//! tower's `ConcurrencyLimitLayer` caps requests per process; run ten instances and the cap is
//! ten times what the database, the GPU or the third-party API can take. This crate keeps one
//! count for all of them: a distributed [`Semaphore`] whose permits live in Redis
//! ([`RedisBackend`]) or, for development and single instances, in memory ([`MemoryBackend`]).
//!
//! - **Never above the limit.** One atomic script per acquire; leases are timed by the Redis
//!   server clock, never the client's.
//! - **Nothing leaks.** A dropped [`Permit`] is released in the background; a cancelled
//!   acquire releases what it may have taken; a crashed holder's slot returns after its lease.
//! - **No polling.** Waiters sleep until a release is published, first come first served
//!   within a process.
//! - **Fencing tokens** strictly increase per semaphore, so a resource can refuse a holder
//!   that was paused past its lease.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_distributed_limit::{RedisBackend, Semaphore};
//!
//! # async fn run() -> Result<(), tower_distributed_limit::Error> {
//! let redis = RedisBackend::connect("redis://127.0.0.1:6379").await?;
//! let sem = Semaphore::builder("legacy-db")
//!     .limit(30)                                 // across every instance
//!     .lease(Duration::from_secs(30))            // a crashed holder frees its slot after this
//!     .acquire_timeout(Duration::from_secs(10))
//!     .build(redis)?;
//!
//! let permit = sem.acquire().await?;             // waits for a free slot
//! println!("token {}", permit.fencing_token());
//! drop(permit);                                  // released in the background
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backend;
mod error;
mod permit;
mod semaphore;
mod waitlist;

pub use backend::{Backend, MemoryBackend, RedisBackend};
pub use error::{BackendError, Error};
pub use permit::Permit;
pub use semaphore::{Semaphore, SemaphoreBuilder};
