//! What the concurrency layer's services share ([`Gatekeeper`]): the admission, how a request
//! waits, the rate it spends, and which inner errors are congestion signals; and the gate it
//! gives each request.

use tower::BoxError;

use super::acquire::AcquirePermit;
use super::admit::{Admit, sealed::Private};
use super::pass::PermitPass;
use super::refusal::{Asked, Refused, RefusedBy};
use crate::{Error, Priority, RateLimiter};

/// What every flavor shares: the admission (which semaphore, what weight) and how a request
/// waits for its permits.
#[derive(Debug, Clone)]
pub(crate) struct Gatekeeper<A> {
    pub(crate) admit: A,
    /// Wait up to the semaphore's acquire timeout (true) or make a single attempt.
    pub(crate) wait: bool,
    /// Abort the inner call when the permit's lease is lost before the response.
    pub(crate) abort_on_lost: bool,
    /// A rate limit decided with each permit, all or nothing (`rate_limit`).
    pub(crate) rate: Option<RateLimiter>,
    /// Requests of this class or higher skip `rate` (`rate_limit_exempt`).
    pub(crate) rate_exempt: Option<Priority>,
    /// The generic flavor's congestion signals: which inner errors mark a permit overloaded.
    pub(crate) overloaded: Overloaded,
}

/// Which inner errors are congestion signals.
pub(crate) type Overloaded = fn(&BoxError) -> bool;

/// The generic flavor's default: every inner error is a congestion signal.
pub(crate) const ANY_ERROR: Overloaded = |_| true;

/// For a pass that has nothing to signal (a rate decision is spent either way).
pub(crate) const NO_SIGNAL: Overloaded = |_| false;

impl<A> Gatekeeper<A> {
    /// The same gatekeeper with another admission.
    pub(crate) fn map<B>(self, admit: impl FnOnce(A) -> B) -> Gatekeeper<B> {
        Gatekeeper {
            admit: admit(self.admit),
            wait: self.wait,
            abort_on_lost: self.abort_on_lost,
            rate: self.rate,
            rate_exempt: self.rate_exempt,
            overloaded: self.overloaded,
        }
    }

    /// The rate limit a request of `class` spends: none for a class at or above the
    /// exemption, so a batch flood that empties the rate cannot refuse it.
    pub(crate) fn rate_for(&self, class: Priority) -> Option<RateLimiter> {
        match self.rate_exempt {
            Some(floor) if class >= floor => None,
            _ => self.rate.clone(),
        }
    }

    /// The gate of `request`: the permit its admission asks for, or, on a layer that reserves
    /// its permit in `poll_ready`, that reservation's outcome.
    pub(crate) fn admit<R>(
        &self,
        request: &R,
        reserved: Option<Result<PermitPass, Refused>>,
    ) -> AcquirePermit
    where
        A: Admit<R>,
    {
        let (semaphore, ask) = match self.admit.admit(request) {
            Ok(admitted) => admitted,
            Err(error) => return AcquirePermit::done(Err(error.into())),
        };
        if self.admit.reserves(Private).is_none() {
            let rate = self.rate_for(ask.get_priority());
            return AcquirePermit::start(semaphore, ask, self.wait, rate);
        }
        AcquirePermit::done(reserved.unwrap_or_else(|| {
            Err(Refused {
                error: Error::config(
                    "call() without a successful poll_ready() on a layer that reserves its \
                     permit in poll_ready; drive the service with ServiceExt::ready first",
                ),
                by: RefusedBy::Semaphore(Asked {
                    limit: semaphore.limit(),
                    class: ask.get_priority(),
                }),
            })
        }))
    }
}
