//! How long a name may be: the one rule the semaphore, the rate limiter and the partitions
//! share.

use crate::Error;

/// The longest name of a semaphore or rate limiter, in bytes: a name is part of every key it
/// keeps in Redis, so none grows without bound.
///
/// # Examples
///
/// ```
/// use tower_distributed_limit::{MAX_NAME_LEN, MemoryBackend, Semaphore};
///
/// let long = "x".repeat(MAX_NAME_LEN + 1);
/// assert!(Semaphore::builder(long).limit(1).build(MemoryBackend::new()).is_err());
/// ```
pub const MAX_NAME_LEN: usize = 1024;

/// [`Error::Config`] for a `what` (semaphore, rate limiter) named over [`MAX_NAME_LEN`].
pub(crate) fn check_name_len(what: &str, name: &str) -> Result<(), Error> {
    if name.len() > MAX_NAME_LEN {
        return Err(Error::config(format!(
            "the {what} name is {} bytes; names are at most {MAX_NAME_LEN} bytes (a name is \
             part of every key it keeps in Redis)",
            name.len()
        )));
    }
    Ok(())
}
