//! The rate layer's gate and pass: a request waits for its rate check ([`CheckRate`]) and,
//! let through, holds the decision ([`RatePass`]) for the `RateLimit` headers of its answer.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;

use super::Decided;
use super::limiter::RateLimiter;
use crate::Error;
use crate::backend::RateDecision;
use crate::layer::answer::{Answer, HttpSettings};
use crate::layer::body::ResponseBody;
use crate::layer::gate::{Gate, Pass};
use crate::layer::headers::insert_rate;
use crate::layer::refusal::{Refused, RefusedBy};
use crate::layer::token::FencingToken;

/// A rate check under way: it hands back its limiter with the decision, for the headers.
pub(crate) type Check =
    Pin<Box<dyn Future<Output = (RateLimiter, Result<RateDecision, Error>)> + Send>>;

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
pub struct RatePass(Decided);

impl Gate for CheckRate {
    type Pass = RatePass;

    fn poll_gate(&mut self, cx: &mut Context<'_>) -> Poll<Result<RatePass, Refused>> {
        let (limiter, decision) = std::task::ready!(self.check.as_mut().poll(cx));
        let decision = decision?;
        Poll::Ready(if decision.allowed {
            Ok(RatePass(Decided { limiter, decision }))
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
                by: RefusedBy::Rate(Decided { limiter, decision }),
            })
        })
    }
}

impl Pass for RatePass {
    fn token(&self) -> Option<FencingToken> {
        None
    }

    fn lost(&self) -> Option<Pin<Box<dyn Future<Output = ()> + Send>>> {
        None
    }

    // A rate decision is spent either way.
    fn mark_overloaded(&self) {}

    fn respond<B>(
        self,
        mut response: Response<B>,
        settings: &HttpSettings,
    ) -> Response<ResponseBody<B>> {
        if settings.rate_headers && settings.answer == Answer::Http {
            insert_rate(response.headers_mut(), &self.0);
        }
        response.map(|body| ResponseBody::new(body, None))
    }
}
