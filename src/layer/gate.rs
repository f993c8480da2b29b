//! What a request waits for before the inner service sees it, in both layers, and what it
//! holds meanwhile: a [`Gate`] yields a [`Pass`]. The concurrency layer's gate takes a permit
//! ([`AcquirePermit`](super::acquire::AcquirePermit), its pass a
//! [`PermitPass`](super::pass::PermitPass)); the rate layer's spends its rate
//! ([`CheckRate`](crate::rate::check::CheckRate)). The response futures (`future.rs`) are one
//! state machine over either.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;

use super::answer::HttpSettings;
use super::body::ResponseBody;
use super::refusal::Refused;
use super::token::FencingToken;

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
        fn mark_overloaded(&self);

        /// The HTTP flavor's response: the pass rides in the body, or adds its headers.
        fn respond<B>(
            self,
            response: Response<B>,
            settings: &HttpSettings,
        ) -> Response<ResponseBody<B>>;
    }
}
