//! The permit a service reserves in `poll_ready`, for
//! [`acquire_in_poll_ready`](super::DistributedConcurrencyLimitLayer::acquire_in_poll_ready):
//! a spare when one is free (see [`spares`](super::spares)), else its own acquire.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use sync_wrapper::SyncWrapper;

use super::limiter::Acquire;
use super::spares::{Held, Spares, Take};
use crate::{Ask, Error, RateLimiter, Semaphore};

/// The reservation of one service: nothing, a wait in line, or its outcome, handed to the
/// next `call`. A clone starts with nothing but shares the spares; dropping it drops the
/// permit (back to the spares, or released in the background) or leaves the line.
#[derive(Default)]
pub(crate) struct Reservation {
    spares: Spares,
    /// Waited once for a background acquire of the spares, before starting its own.
    waited: bool,
    pending: Option<SyncWrapper<Acquire>>,
    outcome: Option<Result<Held, Error>>,
}

impl Clone for Reservation {
    fn clone(&self) -> Self {
        Reservation::new(self.spares.clone())
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("spares", &self.spares.is_some())
            .field("waiting", &self.pending.is_some())
            .field("reserved", &self.outcome.as_ref().map(Result::is_ok))
            .finish()
    }
}

impl Reservation {
    pub(crate) fn new(spares: Spares) -> Self {
        Reservation {
            spares,
            waited: false,
            pending: None,
            outcome: None,
        }
    }

    /// Ready once the permit is held or refused: a spare at once, else this service's own
    /// acquire (or a spare that comes first). A refusal (the wait ran out, the backend
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
        if let Some(take) = self.spares.take(cx) {
            match take {
                Take::Spare(spare) => {
                    self.pending = None; // leaves the line, in the background
                    self.waited = false;
                    self.outcome = Some(Ok(spare));
                    return Poll::Ready(());
                }
                // Its own acquire would take a slot too, and be dropped by a `LoadShed`:
                // wait for the spare first (woken either way), then for its own.
                Take::Filling if self.pending.is_none() && !self.waited => {
                    self.waited = true;
                    return Poll::Pending;
                }
                Take::Filling | Take::Empty => {}
            }
        }
        let pending = self.pending.get_or_insert_with(|| {
            SyncWrapper::new(Acquire::start(
                semaphore.clone(),
                Ask::new(),
                wait,
                rate.cloned(),
            ))
        });
        let outcome = ready!(Pin::new(pending.get_mut()).poll(cx));
        self.pending = None;
        self.waited = false;
        self.outcome = Some(outcome.map(|held| self.spares.lend(held)));
        Poll::Ready(())
    }

    /// The outcome for the request being called; `None` if `poll_ready` did not finish first.
    pub(crate) fn take(&mut self) -> Option<Result<Held, Error>> {
        self.outcome.take()
    }
}
