//! The response body of the HTTP flavor: the inner body with the permit riding along, or the
//! layer's own refusal.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::pass::PermitPass;

pin_project! {
    /// The body of a response from [`HttpConcurrencyLimit`](super::HttpConcurrencyLimit).
    ///
    /// Unless the layer was told to [release at the response head](super::HttpConcurrencyLimitLayer::release_at_head),
    /// it holds the request's permit until the inner body ends, fails or is dropped, so a streamed
    /// response keeps its slot until its last byte.
    ///
    /// # Examples
    ///
    /// ```
    /// use http_body_util::BodyExt;
    /// use tower::{Service, ServiceExt, service_fn};
    /// use tower_distributed_limit::{DistributedConcurrencyLimitLayer, MemoryBackend, Semaphore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let sem = Semaphore::builder("downloads").limit(1).build(MemoryBackend::new())?;
    /// let mut svc = tower::ServiceBuilder::new()
    ///     .layer(DistributedConcurrencyLimitLayer::new(sem.clone()).http())
    ///     .service(service_fn(|_req: http::Request<String>| async {
    ///         Ok::<_, std::convert::Infallible>(http::Response::new(String::from("payload")))
    ///     }));
    /// let response = svc.ready().await?.call(http::Request::new(String::new())).await?;
    /// assert_eq!(sem.available_permits().await?, 0); // the body still holds the permit
    /// let body = response.into_body().collect().await?.to_bytes();
    /// assert_eq!(&body[..], b"payload");
    /// # Ok(()) }
    /// ```
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
            permit: Option<PermitPass>,
        },
        Refusal {
            data: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    /// The inner body; `permit` is dropped (released) when it finishes.
    pub(crate) fn new(body: B, permit: Option<PermitPass>) -> Self {
        ResponseBody {
            kind: Kind::Inner { body, permit },
        }
    }

    /// The layer's own answer to a refused request.
    pub(crate) fn refusal(data: Bytes) -> Self {
        ResponseBody {
            kind: Kind::Refusal {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { mut body, permit } => {
                let frame = ready!(body.as_mut().poll_frame(cx));
                let finished = match &frame {
                    None | Some(Err(_)) => true,
                    // The last frame: release now rather than when the server drops the body.
                    Some(Ok(_)) => body.is_end_stream(),
                };
                if finished {
                    drop(permit.take());
                }
                Poll::Ready(frame)
            }
            KindProj::Refusal { data } => {
                Poll::Ready(data.take().map(|data| Ok(Frame::data(data.into()))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Refusal { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Refusal { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |data| data.len() as u64))
            }
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Inner { permit, .. } => f
                .debug_struct("ResponseBody")
                .field("permit", permit)
                .finish_non_exhaustive(),
            Kind::Refusal { data } => f
                .debug_struct("ResponseBody")
                .field("refusal", data)
                .finish(),
        }
    }
}
