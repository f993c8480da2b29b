//! How the gRPC flavor answers a refused request: a trailers-only response whose
//! `grpc-status` a tonic client reads as a `Status`, and a tonic server sends as is.

use bytes::Bytes;
use http::{HeaderValue, Response};
use tonic::{Code, Status};

use super::headers::REFUSAL_HEADER;
use super::refusal::Refusal;
use crate::Error;

/// No permit or no rate left is `RESOURCE_EXHAUSTED`; a failing backend `UNAVAILABLE` (worth a
/// retry later); a bad partition key or a request heavier than the limit `INVALID_ARGUMENT`; a
/// lost lease `ABORTED`.
fn code(refusal: Refusal) -> Code {
    match refusal {
        Refusal::Full | Refusal::Timeout | Refusal::TooManyWaiters | Refusal::RateLimited => {
            Code::ResourceExhausted
        }
        Refusal::Outage => Code::Unavailable,
        Refusal::BadKey | Refusal::Config => Code::InvalidArgument,
        Refusal::LeaseLost => Code::Aborted,
    }
}

/// HTTP 200, `content-type: application/grpc`, `grpc-status`, `grpc-message` (the refusal's
/// client-facing sentence, never the error's advice to operators) and `x-dlimit-refusal`, no
/// body.
pub(crate) fn response(error: &Error) -> Response<Bytes> {
    let refusal = Refusal::of(error);
    let mut response = Status::new(code(refusal), refusal.sentence().trim_end())
        .into_http::<()>()
        .map(|()| Bytes::new());
    response
        .headers_mut()
        .insert(REFUSAL_HEADER, HeaderValue::from_static(refusal.name()));
    response
}
