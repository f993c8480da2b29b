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
use super::limiter::{Acquire, FencingToken};
use super::refusal::{ErrorStyle, Refusal};
use crate::Permit;

/// How a [`Limited`] future ended without a response.
pub(crate) enum Failure<E> {
    /// No permit.
    Refused(Refusal),
    /// The inner service failed.
    Inner(E),
}

pin_project! {
    /// Takes the permit, then calls the inner service with it held: the state machine both
    /// flavours share. Resolves to the response and the permit, for the flavour to keep or drop.
    #[project = LimitedProj]
    pub(crate) enum Limited<S, B>
    where
        S: Service<Request<B>>,
    {
        Acquiring {
            acquire: Acquire,
            // The ready inner service and the request, taken once the permit is held.
            call: Option<(S, Request<B>)>,
            abort_on_lost: bool,
        },
        Calling {
            #[pin]
            future: S::Future,
            permit: Option<Permit>,
            // Resolves if the lease is lost first (only when the layer aborts on it).
            lost: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
        },
        // Aborted: the lease was lost before the response.
        Lost,
    }
}

impl<S, B> Limited<S, B>
where
    S: Service<Request<B>>,
{
    pub(crate) fn new(
        acquire: Acquire,
        ready: S,
        request: Request<B>,
        abort_on_lost: bool,
    ) -> Self {
        Limited::Acquiring {
            acquire,
            call: Some((ready, request)),
            abort_on_lost,
        }
    }
}

impl<S, B> Future for Limited<S, B>
where
    S: Service<Request<B>>,
{
    type Output = Result<(S::Response, Permit), Failure<S::Error>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match self.as_mut().project() {
                LimitedProj::Acquiring {
                    acquire,
                    call,
                    abort_on_lost,
                } => {
                    let permit = ready!(acquire.as_mut().poll(cx)).map_err(Failure::Refused)?;
                    let Some((mut service, mut request)) = call.take() else {
                        polled_after_completion()
                    };
                    request
                        .extensions_mut()
                        .insert(FencingToken(permit.fencing_token()));
                    let lost = abort_on_lost.then(|| Box::pin(permit.lost_signal()) as _);
                    let future = service.call(request);
                    self.set(Limited::Calling {
                        future,
                        permit: Some(permit),
                        lost,
                    });
                }
                LimitedProj::Calling {
                    future,
                    permit,
                    lost,
                } => {
                    let result = match future.poll(cx) {
                        Poll::Ready(result) => result,
                        Poll::Pending => {
                            if let Some(lost) = lost {
                                ready!(lost.as_mut().poll(cx));
                                // Dropping the inner future aborts the request.
                                self.set(Limited::Lost);
                                return Poll::Ready(Err(Failure::Refused(Refusal::Busy(
                                    crate::Error::LeaseLost,
                                ))));
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
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        limited: Limited<S, B>,
        errors: ErrorStyle,
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(crate) fn new(limited: Limited<S, B>, errors: ErrorStyle) -> Self {
        ResponseFuture { limited, errors }
    }
}

impl<S, B> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        Poll::Ready(match ready!(this.limited.poll(cx)) {
            // The permit is dropped, hence released, with the response head.
            Ok((response, _permit)) => Ok(response),
            Err(Failure::Inner(e)) => Err(e.into()),
            Err(Failure::Refused(refusal)) => Err(this.errors.to_box_error(refusal)),
        })
    }
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

pin_project! {
    /// The response future of [`HttpConcurrencyLimit`](super::HttpConcurrencyLimit): answers a
    /// refused request itself and moves the permit into the response body (unless the layer
    /// releases at the response head).
    pub struct HttpResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        limited: Limited<S, B>,
        settings: Arc<HttpSettings>,
    }
}

impl<S, B> HttpResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(crate) fn new(limited: Limited<S, B>, settings: Arc<HttpSettings>) -> Self {
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
            Err(Failure::Refused(refusal)) => Ok(this.settings.reject(refusal)),
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
