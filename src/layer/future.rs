//! The response futures of the layer's services.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower::{BoxError, Service};

use super::body::ResponseBody;
use super::http::HttpSettings;
use super::limiter::Acquire;
use super::spares::Held;
use super::token::{FencingToken, scoped};
use crate::Error;

/// How a [`Limited`] future ended without a response.
pub(crate) enum Failure<E> {
    /// No permit; `limit` is the picked semaphore's, if one was picked.
    Refused { error: Error, limit: Option<u32> },
    /// The inner service failed.
    Inner(E),
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
    /// Takes the permit, then calls the inner service with it held: the state machine both
    /// flavours share. Resolves to the response and the permit, for the flavour to keep or drop.
    #[project = LimitedProj]
    pub(crate) enum Limited<S, R>
    where
        S: Service<R>,
    {
        Acquiring {
            acquire: Acquire,
            // The ready inner service and the request, taken once the permit is held.
            call: Option<(S, R)>,
            limit: Option<u32>,
            abort_on_lost: bool,
            stamp: Stamp<R>,
        },
        Calling {
            #[pin]
            future: S::Future,
            permit: Option<Held>,
            token: FencingToken,
            // Resolves if the lease is lost first (only when the layer aborts on it).
            lost: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
        },
        // Aborted: the lease was lost before the response.
        Lost,
    }
}

impl<S, R> Limited<S, R>
where
    S: Service<R>,
{
    pub(crate) fn new(
        (acquire, limit): (Acquire, Option<u32>),
        ready: S,
        request: R,
        abort_on_lost: bool,
        stamp: Stamp<R>,
    ) -> Self {
        Limited::Acquiring {
            acquire,
            call: Some((ready, request)),
            limit,
            abort_on_lost,
            stamp,
        }
    }
}

impl<S, R> Future for Limited<S, R>
where
    S: Service<R>,
{
    type Output = Result<(S::Response, Held), Failure<S::Error>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match self.as_mut().project() {
                LimitedProj::Acquiring {
                    acquire,
                    call,
                    limit,
                    abort_on_lost,
                    stamp,
                } => {
                    let permit =
                        ready!(Pin::new(acquire).poll(cx)).map_err(|error| Failure::Refused {
                            error,
                            limit: *limit,
                        })?;
                    let Some((mut service, mut request)) = call.take() else {
                        polled_after_completion()
                    };
                    let token = FencingToken(permit.fencing_token());
                    stamp(&mut request, token);
                    let lost = abort_on_lost.then(|| Box::pin(permit.lost_signal()) as _);
                    let future = scoped(token, || service.call(request));
                    self.set(Limited::Calling {
                        future,
                        permit: Some(permit),
                        token,
                        lost,
                    });
                }
                LimitedProj::Calling {
                    future,
                    permit,
                    token,
                    lost,
                } => {
                    let result = match scoped(*token, || future.poll(cx)) {
                        Poll::Ready(result) => result,
                        Poll::Pending => {
                            if let Some(lost) = lost {
                                ready!(lost.as_mut().poll(cx));
                                // Dropping the inner future aborts the request.
                                self.set(Limited::Lost);
                                return Poll::Ready(Err(Failure::Refused {
                                    error: Error::LeaseLost,
                                    limit: None,
                                }));
                            }
                            return Poll::Pending;
                        }
                    };
                    let Some(permit) = permit.take() else {
                        polled_after_completion()
                    };
                    return Poll::Ready(match result {
                        Ok(response) => Ok((response, permit)),
                        Err(e) => Err(Failure::Inner(e)),
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
    panic!("a DistributedConcurrencyLimit response future was polled after it completed")
}

pin_project! {
    /// The response future of [`DistributedConcurrencyLimit`](super::DistributedConcurrencyLimit):
    /// holds the permit until the inner service's response is ready.
    pub struct ResponseFuture<S, R>
    where
        S: Service<R>,
    {
        #[pin]
        limited: Limited<S, R>,
    }
}

impl<S, R> ResponseFuture<S, R>
where
    S: Service<R>,
{
    pub(crate) fn new(limited: Limited<S, R>) -> Self {
        ResponseFuture { limited }
    }
}

impl<S, R> Future for ResponseFuture<S, R>
where
    S: Service<R>,
    S::Error: Into<BoxError>,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(match ready!(self.project().limited.poll(cx)) {
            // The permit is dropped, hence released, with the response.
            Ok((response, _permit)) => Ok(response),
            Err(Failure::Inner(e)) => Err(e.into()),
            Err(Failure::Refused { error, .. }) => Err(Box::new(error)),
        })
    }
}

impl<S, R> std::fmt::Debug for ResponseFuture<S, R>
where
    S: Service<R>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

pin_project! {
    /// The response future of [`HttpConcurrencyLimit`](super::HttpConcurrencyLimit) (the HTTP
    /// and gRPC flavours): answers a refused request itself and moves the permit into the response body (unless the layer
    /// releases at the response head).
    pub struct HttpResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        limited: Limited<S, Request<B>>,
        settings: Arc<HttpSettings>,
    }
}

impl<S, B> HttpResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(crate) fn new(limited: Limited<S, Request<B>>, settings: Arc<HttpSettings>) -> Self {
        HttpResponseFuture { limited, settings }
    }
}

impl<S, B, ResBody> Future for HttpResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    ResBody: http_body::Body,
    ResBody::Data: From<Bytes>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        Poll::Ready(match ready!(this.limited.poll(cx)) {
            Ok((response, permit)) => {
                let permit = this.settings.hold_until_body_end.then_some(permit);
                Ok(response.map(|body| ResponseBody::new(body, permit)))
            }
            Err(Failure::Inner(e)) => Err(e),
            Err(Failure::Refused { error, limit }) => Ok(this.settings.reject(error, limit)),
        })
    }
}

impl<S, B> std::fmt::Debug for HttpResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpResponseFuture").finish_non_exhaustive()
    }
}
