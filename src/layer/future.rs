//! The response futures of the layer's services.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower::{BoxError, Service};

use super::answer::HttpSettings;
use super::body::ResponseBody;
use super::gate::{Gate, Pass};
use super::gatekeeper::Overloaded;
use super::refusal::Refused;
use super::token::{FencingToken, scoped};
use crate::Error;

pub use super::acquire::AcquirePermit;
pub use crate::rate::check::CheckRate;

/// How a [`Limited`] future ended without a response.
pub(crate) enum Failure<E, P> {
    /// Refused before the inner service saw the request.
    Refused(Refused),
    /// The inner service failed; the pass, for the flavor to judge and drop.
    Inner(E, P),
}

/// The pass of a request the inner service is handling. Dropped before the response (an
/// outer timeout, a client gone), it is marked overloaded: the request was dropped
/// downstream, a congestion signal for an adaptive limit.
struct InFlight<P: Pass>(Option<P>);

impl<P: Pass> InFlight<P> {
    fn take(&mut self) -> Option<P> {
        self.0.take()
    }
}

impl<P: Pass> Drop for InFlight<P> {
    fn drop(&mut self) {
        if let Some(pass) = &self.0 {
            pass.mark_overloaded();
        }
    }
}

/// Hands the token to the request itself, beyond [`FencingToken::current`].
pub(crate) type Stamp<R> = fn(&mut R, FencingToken);

/// Requests of any type carry nothing: the token is [`FencingToken::current`].
pub(crate) fn unstamped<R>(_: &mut R, _: FencingToken) {}

/// HTTP requests carry the token as an extension.
pub(crate) fn extension<B>(request: &mut Request<B>, token: FencingToken) {
    request.extensions_mut().insert(token);
}

pin_project! {
    /// Waits for the gate (a permit, a rate decision), then calls the inner service with its
    /// pass held: the state machine both layers and every flavor share. Resolves to the
    /// response and the pass, for the flavor to keep or drop.
    #[project = LimitedProj]
    pub(crate) enum Limited<S, R, G>
    where
        S: Service<R>,
        G: Gate,
    {
        Waiting {
            gate: G,
            // The ready inner service and the request, taken once the pass is held.
            call: Option<(S, R)>,
            abort_on_lost: bool,
            stamp: Stamp<R>,
        },
        Calling {
            #[pin]
            future: S::Future,
            pass: InFlight<G::Pass>,
            token: Option<FencingToken>,
            // Resolves if the pass is void first (only when the layer aborts on it).
            lost: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
        },
        // Aborted: the lease was lost before the response.
        Lost,
    }
}

impl<S, R, G> Limited<S, R, G>
where
    S: Service<R>,
    G: Gate,
{
    pub(crate) fn new(gate: G, ready: S, request: R, abort_on_lost: bool, stamp: Stamp<R>) -> Self {
        Limited::Waiting {
            gate,
            call: Some((ready, request)),
            abort_on_lost,
            stamp,
        }
    }
}

/// Runs `f` with `token` as [`FencingToken::current`], if there is one.
fn within<T>(token: Option<FencingToken>, f: impl FnOnce() -> T) -> T {
    match token {
        Some(token) => scoped(token, f),
        None => f(),
    }
}

impl<S, R, G> Future for Limited<S, R, G>
where
    S: Service<R>,
    G: Gate,
{
    type Output = Result<(S::Response, G::Pass), Failure<S::Error, G::Pass>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match self.as_mut().project() {
                LimitedProj::Waiting {
                    gate,
                    call,
                    abort_on_lost,
                    stamp,
                } => {
                    let pass = ready!(gate.poll_gate(cx)).map_err(Failure::Refused)?;
                    let Some((mut service, mut request)) = call.take() else {
                        polled_after_completion()
                    };
                    let token = pass.token();
                    if let Some(token) = token {
                        stamp(&mut request, token);
                    }
                    let lost = if *abort_on_lost { pass.lost() } else { None };
                    let future = within(token, || service.call(request));
                    self.set(Limited::Calling {
                        future,
                        pass: InFlight(Some(pass)),
                        token,
                        lost,
                    });
                }
                LimitedProj::Calling {
                    future,
                    pass,
                    token,
                    lost,
                } => {
                    let result = match within(*token, || future.poll(cx)) {
                        Poll::Ready(result) => result,
                        Poll::Pending => {
                            if let Some(lost) = lost {
                                ready!(lost.as_mut().poll(cx));
                                // Dropping the inner future aborts the request.
                                self.set(Limited::Lost);
                                return Poll::Ready(Err(Failure::Refused(Error::LeaseLost.into())));
                            }
                            return Poll::Pending;
                        }
                    };
                    let Some(pass) = pass.take() else {
                        polled_after_completion()
                    };
                    return Poll::Ready(match result {
                        Ok(response) => Ok((response, pass)),
                        Err(e) => Err(Failure::Inner(e, pass)),
                    });
                }
                LimitedProj::Lost => polled_after_completion(),
            }
        }
    }
}

/// The `Future` contract lets a completed future panic when polled again; tower's own futures
/// do the same.
fn polled_after_completion() -> ! {
    panic!("a tower-distributed-limit response future was polled after it completed")
}

pin_project! {
    /// The response future of the generic flavor of both layers
    /// ([`DistributedConcurrencyLimit`](super::DistributedConcurrencyLimit),
    /// [`DistributedRateLimit`](crate::rate::DistributedRateLimit)): holds the permit until
    /// the inner service's response is ready; a refusal is a [`BoxError`] that downcasts to
    /// [`Error`].
    pub struct ResponseFuture<S, R, G = AcquirePermit>
    where
        S: Service<R>,
        G: Gate,
    {
        #[pin]
        limited: Limited<S, R, G>,
        overloaded: Overloaded,
    }
}

impl<S, R, G> ResponseFuture<S, R, G>
where
    S: Service<R>,
    G: Gate,
{
    /// `overloaded` says which inner errors are congestion signals.
    pub(crate) fn new(limited: Limited<S, R, G>, overloaded: Overloaded) -> Self {
        ResponseFuture {
            limited,
            overloaded,
        }
    }
}

impl<S, R, G> Future for ResponseFuture<S, R, G>
where
    S: Service<R>,
    S::Error: Into<BoxError>,
    G: Gate,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        Poll::Ready(match ready!(this.limited.poll(cx)) {
            // The permit is dropped, hence released, with the response.
            Ok((response, _pass)) => Ok(response),
            Err(Failure::Inner(e, pass)) => {
                let e = e.into();
                if (this.overloaded)(&e) {
                    pass.mark_overloaded();
                }
                Err(e)
            }
            Err(Failure::Refused(refused)) => Err(Box::new(refused.error)),
        })
    }
}

impl<S, R, G> std::fmt::Debug for ResponseFuture<S, R, G>
where
    S: Service<R>,
    G: Gate,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

pin_project! {
    /// The response future of the HTTP and gRPC flavors of both layers: answers a refused
    /// request itself; the concurrency layer's permit rides in the response body (unless the
    /// layer releases at the response head), the rate layer's decision in its headers.
    pub struct HttpResponseFuture<S, B, G = AcquirePermit>
    where
        S: Service<Request<B>>,
        G: Gate,
    {
        #[pin]
        limited: Limited<S, Request<B>, G>,
        settings: Arc<HttpSettings>,
    }
}

impl<S, B, G> HttpResponseFuture<S, B, G>
where
    S: Service<Request<B>>,
    G: Gate,
{
    pub(crate) fn new(limited: Limited<S, Request<B>, G>, settings: Arc<HttpSettings>) -> Self {
        HttpResponseFuture { limited, settings }
    }
}

impl<S, B, ResBody, G> Future for HttpResponseFuture<S, B, G>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    ResBody: http_body::Body,
    ResBody::Data: From<Bytes>,
    G: Gate,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        Poll::Ready(match ready!(this.limited.poll(cx)) {
            Ok((response, pass)) => {
                if (this.settings.overloaded)(response.status()) {
                    pass.mark_overloaded();
                }
                Ok(pass.respond(response, this.settings))
            }
            // No answer at all: the request failed downstream.
            Err(Failure::Inner(e, pass)) => {
                pass.mark_overloaded();
                Err(e)
            }
            Err(Failure::Refused(refused)) => Ok(this.settings.reject(refused)),
        })
    }
}

impl<S, B, G> std::fmt::Debug for HttpResponseFuture<S, B, G>
where
    S: Service<Request<B>>,
    G: Gate,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpResponseFuture").finish_non_exhaustive()
    }
}
