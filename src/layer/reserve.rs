//! The permit a service reserves in `poll_ready`, for
//! [`acquire_in_poll_ready`](super::DistributedConcurrencyLimitLayer::acquire_in_poll_ready).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use sync_wrapper::SyncWrapper;

use super::limiter::Acquire;
use crate::{Error, Permit, RateLimiter, Semaphore};

/// The reservation of one service: nothing, a wait in line, or its outcome, handed to the
/// next `call`. A clone starts with nothing; dropping it drops the permit or leaves the line,
/// and either is released in the background.
#[derive(Default)]
pub(crate) struct Reservation {
    pending: Option<SyncWrapper<Acquire>>,
    outcome: Option<Result<Permit, Error>>,
}

impl Clone for Reservation {
    fn clone(&self) -> Self {
        Reservation::default()
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("waiting", &self.pending.is_some())
            .field("outcome", &self.outcome)
            .finish()
    }
}

impl Reservation {
    /// Ready once the permit is held or refused. A refusal (the wait ran out, the backend
    /// failed) is kept for `call` rather than returned here: an error from `poll_ready` means
    /// the service is broken for good to `Buffer` and `balance`.
    pub(crate) fn poll_reserve(
        &mut self,
        semaphore: &Semaphore,
        wait: bool,
        rate: Option<&RateLimiter>,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        if self.outcome.is_some() {
            return Poll::Ready(());
        }
        let pending = self.pending.get_or_insert_with(|| {
            SyncWrapper::new(Acquire::start(semaphore.clone(), 1, wait, rate.cloned()))
        });
        let outcome = ready!(Pin::new(pending.get_mut()).poll(cx));
        self.pending = None;
        self.outcome = Some(outcome);
        Poll::Ready(())
    }

    /// The outcome for the request being called; `None` if `poll_ready` did not finish first.
    pub(crate) fn take(&mut self) -> Option<Result<Permit, Error>> {
        self.outcome.take()
    }
}
