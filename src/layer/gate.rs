//! What a request waits for before the inner service sees it, in both layers: a permit (the
//! concurrency layer's [`AcquirePermit`]) or a rate decision (the rate layer's [`CheckRate`]).
//! The response futures (`future.rs`) are one state machine over either.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;

use super::body::ResponseBody;
use super::headers::insert_rate;
use super::http::{Answer, HttpSettings};
use super::limiter::Acquire;
use super::refused::{Policy, Refused};
use super::spares::Held;
use super::token::FencingToken;
use crate::backend::RateDecision;
use crate::{Error, Priority, RateLimiter};

pub(crate) use sealed::{Gate, Pass};

mod sealed {
    use super::*;

    /// Waits for the request's pass, or its refusal.
    pub trait Gate: Unpin {
        /// What the request holds while the inner service handles it.
        type Pass: Pass;

        fn poll_gate(&mut self, cx: &mut Context<'_>) -> Poll<Result<Self::Pass, Refused>>;
    }

    /// What a request admitted by a [`Gate`] holds while the inner service handles it.
    pub trait Pass: Sized {
        /// The fencing token the inner call runs with, if any.
        fn token(&self) -> Option<FencingToken>;

        /// Resolves if the pass is void before the response (a permit's lease lost).
        fn lost(&self) -> Option<Pin<Box<dyn Future<Output = ()> + Send>>>;

        /// The request failed or was dropped downstream: an adaptive limit's congestion
        /// signal, sent when the pass is given back.
        fn overloaded(&self);

        /// The HTTP flavour's response: the pass rides in the body, or adds its headers.
        fn respond<B>(
            self,
            response: Response<B>,
            settings: &HttpSettings,
        ) -> Response<ResponseBody<B>>;
    }
}

/// The part of the concurrency layer's response future that takes the request's permit.
pub struct AcquirePermit {
    acquire: Acquire,
    /// The picked semaphore's limit, for the refusal's `RateLimit-Policy`, and the class
    /// asked for.
    limit: Option<(u32, Priority)>,
    /// The rate limit decided with the permit (`rate_limit`), for the `RateLimit` headers.
    rate: Option<RateLimiter>,
}

impl AcquirePermit {
    pub(crate) fn new(
        acquire: Acquire,
        limit: Option<(u32, Priority)>,
        rate: Option<RateLimiter>,
    ) -> Self {
        AcquirePermit {
            acquire,
            limit,
            rate,
        }
    }
}

impl std::fmt::Debug for AcquirePermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcquirePermit").finish_non_exhaustive()
    }
}

impl Gate for AcquirePermit {
    type Pass = Held;

    fn poll_gate(&mut self, cx: &mut Context<'_>) -> Poll<Result<Held, Refused>> {
        let held = std::task::ready!(Pin::new(&mut self.acquire).poll(cx));
        Poll::Ready(match (held, &self.rate) {
            // Its answer carries the headers of the rate decided with it.
            (Ok(held), Some(limiter)) => Ok(held.rated_by(limiter.clone())),
            (Ok(held), None) => Ok(held),
            (Err(error), rate) => {
                let policy = match (&error, rate) {
                    (Error::RateLimited { retry_after }, Some(limiter)) => {
                        Policy::Rate(limiter.clone(), RateDecision::refused(*retry_after))
                    }
                    _ => (self.limit).map_or(Policy::None, |(limit, class)| {
                        Policy::Concurrency(limit, class)
                    }),
                };
                Err(Refused { error, policy })
            }
        })
    }
}

impl Pass for Held {
    fn token(&self) -> Option<FencingToken> {
        Some(FencingToken(self.fencing_token()))
    }

    fn lost(&self) -> Option<Pin<Box<dyn Future<Output = ()> + Send>>> {
        Some(Box::pin(self.lost_signal()))
    }

    fn overloaded(&self) {
        Held::overloaded(self);
    }

    fn respond<B>(
        self,
        mut response: Response<B>,
        settings: &HttpSettings,
    ) -> Response<ResponseBody<B>> {
        if settings.rate_headers
            && settings.answer == Answer::Http
            && let Some((limiter, decision)) = self.rate()
        {
            insert_rate(response.headers_mut(), limiter, decision);
        }
        let permit = settings.hold_until_body_end.then_some(self);
        response.map(|body| ResponseBody::new(body, permit))
    }
}

/// A rate check under way: it hands back its limiter with the decision, for the headers.
type Check = Pin<Box<dyn Future<Output = (RateLimiter, Result<RateDecision, Error>)> + Send>>;

/// The part of the rate layer's response future that spends the request's rate.
pub struct CheckRate {
    check: Check,
}

impl CheckRate {
    pub(crate) fn new(check: Check) -> Self {
        CheckRate { check }
    }
}

impl std::fmt::Debug for CheckRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckRate").finish_non_exhaustive()
    }
}

/// A request the rate limit let through: its decision, for the `RateLimit` headers.
pub struct Spent {
    limiter: RateLimiter,
    decision: RateDecision,
}

impl Gate for CheckRate {
    type Pass = Spent;

    fn poll_gate(&mut self, cx: &mut Context<'_>) -> Poll<Result<Spent, Refused>> {
        let (limiter, decision) = std::task::ready!(self.check.as_mut().poll(cx));
        let decision = decision?;
        Poll::Ready(if decision.allowed {
            Ok(Spent { limiter, decision })
        } else {
            tracing::debug!(
                limiter = limiter.name(),
                retry_after = ?decision.retry_after,
                "request refused: rate limit"
            );
            Err(Refused {
                error: Error::RateLimited {
                    retry_after: decision.retry_after.unwrap_or_default(),
                },
                policy: Policy::Rate(limiter, decision),
            })
        })
    }
}

impl Pass for Spent {
    fn token(&self) -> Option<FencingToken> {
        None
    }

    fn lost(&self) -> Option<Pin<Box<dyn Future<Output = ()> + Send>>> {
        None
    }

    // A rate decision is spent either way.
    fn overloaded(&self) {}

    fn respond<B>(
        self,
        mut response: Response<B>,
        settings: &HttpSettings,
    ) -> Response<ResponseBody<B>> {
        if settings.rate_headers && settings.answer == Answer::Http {
            insert_rate(response.headers_mut(), &self.limiter, &self.decision);
        }
        response.map(|body| ResponseBody::new(body, None))
    }
}
