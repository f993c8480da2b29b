//! The concurrency layer's gate: a request waits for its permit ([`AcquirePermit`]) and,
//! admitted, holds it ([`PermitPass`], `pass.rs`) until its response is done.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;

use super::answer::{Answer, HttpSettings};
use super::body::ResponseBody;
use super::gate::{Gate, Pass};
use super::headers::insert_rate;
use super::pass::PermitPass;
use super::refusal::{Asked, Refused, RefusedBy};
use super::token::FencingToken;
use crate::backend::RateDecision;
use crate::rate::Decided;
use crate::{Ask, Error, Permit, RateLimiter, Semaphore};

type Pending = Pin<Box<dyn Future<Output = Result<PermitPass, Refused>> + Send>>;

/// The part of the concurrency layer's response future that takes the request's permit:
/// taken already (a prefetched slot, the permit reserved in `poll_ready`, a refusal before
/// any wait), or on its way.
pub struct AcquirePermit(State);

// Boxing the ready outcome would allocate on the prefetched path, the one that must be cheap;
// the future lives in the response future either way.
#[allow(clippy::large_enum_variant)]
enum State {
    Done(Option<Result<PermitPass, Refused>>),
    Acquiring(Pending),
}

impl AcquirePermit {
    /// An outcome known already.
    pub(crate) fn done(outcome: Result<PermitPass, Refused>) -> Self {
        AcquirePermit(State::Done(Some(outcome)))
    }

    /// Waits for what `ask` asks of `semaphore` (or makes one attempt when `wait` is false),
    /// spending its weight of `rate` too, all or nothing.
    pub(crate) fn start(
        semaphore: Semaphore,
        ask: Ask,
        wait: bool,
        rate: Option<RateLimiter>,
    ) -> Self {
        // A slot this process prefetched needs no wait and no future.
        if let Some(permit) = semaphore.take_prefetched(&ask, rate.is_some()) {
            return AcquirePermit::done(Ok(PermitPass::new(permit, None)));
        }
        let asked = Asked {
            limit: semaphore.limit(),
            class: ask.get_priority(),
        };
        let refused = move |error| Refused {
            error,
            by: RefusedBy::Semaphore(asked),
        };
        AcquirePermit(State::Acquiring(Box::pin(async move {
            // The prefetch was asked above: straight to the store.
            let permit = match rate {
                None if wait => semaphore.acquire_from_store(&ask, None).await,
                None => (semaphore.try_from_store(&ask, None).await)
                    .and_then(|permit| permit.ok_or(Error::Full)),
                Some(rate) => return with_rate(&semaphore, &ask, wait, rate, refused).await,
            };
            permit
                .map(|permit| PermitPass::new(permit, None))
                .map_err(refused)
        })))
    }
}

/// A permit and `weight` of the rate limit, all or nothing: a request refused for concurrency
/// spends no rate, one refused for rate keeps no permit.
///
/// Where the semaphore's backend reaches the limiter in the same call (one Redis node, or the
/// same Cluster slot), a permit granted at once spends the rate in that very call. Otherwise
/// (a grant from the line, the outage policy's permit, different backends) the rate is checked
/// once the permit is held, and a refusal gives the permit back at once.
async fn with_rate(
    semaphore: &Semaphore,
    ask: &Ask,
    wait: bool,
    limiter: RateLimiter,
    refused: impl FnOnce(Error) -> Refused,
) -> Result<PermitPass, Refused> {
    let rate_refused = |limiter, retry_after| Refused {
        error: Error::RateLimited { retry_after },
        by: RefusedBy::Rate(Decided {
            limiter,
            decision: RateDecision::refused(retry_after),
        }),
    };
    let permit = match semaphore.acquire_rated(ask, wait, &limiter).await {
        Ok(permit) => permit,
        Err(Error::RateLimited { retry_after }) => {
            limiter.decided_with_acquire(&RateDecision::refused(retry_after));
            return Err(rate_refused(limiter, retry_after));
        }
        Err(error) => return Err(refused(error)),
    };
    let decision = match permit.rate() {
        Some(decision) => {
            limiter.decided_with_acquire(decision);
            *decision
        }
        None => match limiter.check_n(ask.get_weight()).await {
            Ok(decision) if decision.allowed => decision,
            Ok(decision) => {
                drop(permit);
                let retry_after = decision.retry_after.unwrap_or_default();
                return Err(rate_refused(limiter, retry_after));
            }
            Err(error) => return Err(refused(error)),
        },
    };
    Ok(PermitPass::new(permit, Some(Decided { limiter, decision })))
}

impl std::fmt::Debug for AcquirePermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcquirePermit").finish_non_exhaustive()
    }
}

impl Gate for AcquirePermit {
    type Pass = PermitPass;

    fn poll_gate(&mut self, cx: &mut Context<'_>) -> Poll<Result<PermitPass, Refused>> {
        match &mut self.0 {
            State::Acquiring(pending) => pending.as_mut().poll(cx),
            State::Done(done) => Poll::Ready(done.take().unwrap_or_else(|| {
                Err(Error::config(
                    "a permit was asked for twice; this is a bug in tower-distributed-limit",
                )
                .into())
            })),
        }
    }
}

impl Pass for PermitPass {
    fn token(&self) -> Option<FencingToken> {
        let token = self.permit().map_or(0, Permit::fencing_token);
        Some(FencingToken(token))
    }

    fn lost(&self) -> Option<Pin<Box<dyn Future<Output = ()> + Send>>> {
        let lost = self.permit().map(Permit::lost_signal);
        Some(Box::pin(async move {
            match lost {
                Some(lost) => lost.await,
                None => std::future::pending().await,
            }
        }))
    }

    fn mark_overloaded(&self) {
        if let Some(permit) = self.permit() {
            permit.mark_overloaded();
        }
    }

    fn respond<B>(
        self,
        mut response: Response<B>,
        settings: &HttpSettings,
    ) -> Response<ResponseBody<B>> {
        if settings.rate_headers
            && settings.answer == Answer::Http
            && let Some(decided) = self.rate()
        {
            insert_rate(response.headers_mut(), decided);
        }
        let permit = settings.hold_until_body_end.then_some(self);
        response.map(|body| ResponseBody::new(body, permit))
    }
}
