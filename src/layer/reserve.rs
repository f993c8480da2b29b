//! The permit a service reserves in `poll_ready`, for
//! [`acquire_in_poll_ready`](super::DistributedConcurrencyLimitLayer::acquire_in_poll_ready):
//! a spare when one is free (see [`spares`](super::spares)), else its own acquire.

use std::task::{Context, Poll, ready};

use sync_wrapper::SyncWrapper;

use super::acquire::AcquirePermit;
use super::gate::Gate;
use super::pass::PermitPass;
use super::refusal::Refused;
use super::spares::{Spares, Take};
use crate::{Ask, RateLimiter, Semaphore};

/// The reservation of one service: nothing, a wait in line, or its outcome, handed to the
/// next `call`. A clone starts with nothing; dropping it drops the permit (back to the
/// spares, or released in the background) or leaves the line.
#[derive(Default)]
pub(crate) struct Reservation {
    /// Waited once for a background acquire of the spares, before starting its own.
    waited: bool,
    pending: Option<SyncWrapper<AcquirePermit>>,
    outcome: Option<Result<PermitPass, Refused>>,
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
            .field("reserved", &self.outcome.as_ref().map(Result::is_ok))
            .finish()
    }
}

impl Reservation {
    /// Ready once the permit is held or refused: a spare of `spares` at once, else this
    /// service's own acquire of `semaphore` (or a spare that comes first). A refusal (the wait
    /// ran out, the backend failed) is kept for `call` rather than returned here: an error
    /// from `poll_ready` means the service is broken for good to `Buffer` and `balance`.
    pub(crate) fn poll_reserve(
        &mut self,
        semaphore: &Semaphore,
        spares: &Spares,
        wait: bool,
        rate: Option<&RateLimiter>,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        if self.outcome.is_some() {
            return Poll::Ready(());
        }
        if let Some(take) = spares.take(cx) {
            match take {
                Take::Spare(spare) => {
                    self.pending = None; // leaves the line, in the background
                    self.waited = false;
                    self.outcome = Some(Ok(PermitPass::lent(spare)));
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
            SyncWrapper::new(AcquirePermit::start(
                semaphore.clone(),
                Ask::new(),
                wait,
                rate.cloned(),
            ))
        });
        let outcome = ready!(pending.get_mut().poll_gate(cx));
        self.pending = None;
        self.waited = false;
        self.outcome = Some(outcome.map(|pass| pass.lent_by(spares)));
        Poll::Ready(())
    }

    /// The outcome for the request being called; `None` if `poll_ready` did not finish first.
    pub(crate) fn take(&mut self) -> Option<Result<PermitPass, Refused>> {
        self.outcome.take()
    }
}
