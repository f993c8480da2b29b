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
use super::service::ErrorStyle;
use super::{Acquire, FencingToken, Refusal};
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
        },
        Calling {
            #[pin]
            future: S::Future,
            permit: Option<Permit>,
        },
    }
}

impl<S, B> Limited<S, B>
where
    S: Service<Request<B>>,
{
    pub(crate) fn new(acquire: Acquire, ready: S, request: Request<B>) -> Self {
        Limited::Acquiring {
            acquire,
            call: Some((ready, request)),
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
                LimitedProj::Acquiring { acquire, call } => {
                    let permit = ready!(acquire.as_mut().poll(cx)).map_err(Failure::Refused)?;
                    let Some((mut service, mut request)) = call.take() else {
                        polled_after_completion()
                    };
                    request
                        .extensions_mut()
                        .insert(FencingToken(permit.fencing_token()));
                    let future = service.call(request);
                    self.set(Limited::Calling {
                        future,
                        permit: Some(permit),
                    });
                }
                LimitedProj::Calling { future, permit } => {
                    let result = ready!(future.poll(cx));
                    let Some(permit) = permit.take() else {
                        polled_after_completion()
                    };
                    return Poll::Ready(match result {
                        Ok(response) => Ok((response, permit)),
                        Err(e) => Err(Failure::Inner(e)),
                    });
                }
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
