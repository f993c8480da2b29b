//! Small synchronisation helpers shared by the crate's files.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks a mutex whose critical sections never panic midway, so a poisoned lock is still
/// consistent and usable.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A boxed future that can cross threads, as the backends return.
pub(crate) type BoxFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
