//! How the gRPC flavour answers a request that got no permit: a trailers-only response whose
//! `grpc-status` a tonic client reads as a `Status`, and a tonic server sends as is.

use bytes::Bytes;
use http::Response;
use tonic::{Code, Status};

use super::body::ResponseBody;
use crate::Error;

/// A full semaphore or a spent rate limit is `RESOURCE_EXHAUSTED`; a bad partition key or a request heavier than the
/// limit `INVALID_ARGUMENT`; a lost lease `ABORTED`; a failing backend `UNAVAILABLE` (worth a
/// retry later).
pub(crate) fn code(error: &Error) -> Code {
    match error {
        Error::Full
        | Error::Timeout { .. }
        | Error::TooManyWaiters { .. }
        | Error::RateLimited { .. } => Code::ResourceExhausted,
        Error::BadKey(_) | Error::Config(_) => Code::InvalidArgument,
        Error::LeaseLost => Code::Aborted,
        _ => Code::Unavailable,
    }
}

/// HTTP 200, `content-type: application/grpc`, `grpc-status` and `grpc-message`, no body.
pub(crate) fn response<B>(error: Error) -> Response<ResponseBody<B>> {
    Status::new(code(&error), error.to_string())
        .into_http::<()>()
        .map(|()| ResponseBody::refusal(Bytes::new()))
}
