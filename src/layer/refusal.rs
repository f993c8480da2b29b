//! Why a request got no permit, and how each flavour reports it: the crate's error (boxed for
//! tower) or, with the `tonic` feature, a gRPC status.

#[cfg(feature = "tonic")]
use std::sync::Arc;

use tower::BoxError;

use crate::Error;

/// Why a request got no permit.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The semaphore was full until the wait ended, or its backend failed.
    Busy(Error),
    /// The request's partition key was missing or invalid.
    BadKey(Error),
}

impl Refusal {
    pub(crate) fn into_error(self) -> Error {
        match self {
            Refusal::Busy(e) | Refusal::BadKey(e) => e,
        }
    }
}

/// How the generic flavour reports a refusal.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ErrorStyle {
    /// The crate's [`Error`](crate::Error), boxed.
    Error,
    /// A `tonic::Status` whose source is the crate's error.
    #[cfg(feature = "tonic")]
    Status,
}

impl ErrorStyle {
    pub(crate) fn to_box_error(self, refusal: Refusal) -> BoxError {
        match self {
            ErrorStyle::Error => Box::new(refusal.into_error()),
            #[cfg(feature = "tonic")]
            ErrorStyle::Status => Box::new(status(refusal)),
        }
    }
}

/// A full semaphore is `RESOURCE_EXHAUSTED`; a failing backend `UNAVAILABLE` (both worth a
/// retry later); a bad partition key `INVALID_ARGUMENT`.
#[cfg(feature = "tonic")]
fn status(refusal: Refusal) -> tonic::Status {
    use tonic::{Code, Status};

    let code = match &refusal {
        Refusal::BadKey(_) => Code::InvalidArgument,
        Refusal::Busy(crate::Error::Timeout { .. }) => Code::ResourceExhausted,
        Refusal::Busy(_) => Code::Unavailable,
    };
    let error = refusal.into_error();
    let mut status = Status::new(code, error.to_string());
    status.set_source(Arc::new(error));
    status
}
