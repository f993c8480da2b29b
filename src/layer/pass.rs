//! What a request admitted by the concurrency layer holds ([`PermitPass`]): its permit, the
//! spares it goes back to if they lent it, and the rate decided with it. How it answers and
//! signals (`Pass`) is beside the gate that makes it, in `acquire.rs`.

use super::spares::{Home, Spares};
use crate::Permit;
use crate::rate::Decided;

/// A request's permit, held while the inner service handles it. One lent by a layer's
/// [`Spares`] goes back to them when dropped, if they still want it; any other is released as
/// usual.
pub struct PermitPass {
    /// Always `Some` until dropped.
    permit: Option<Permit>,
    /// The spares it was lent by.
    home: Option<Home>,
    /// The rate limit decided with it (the layer's `rate_limit`), for the `RateLimit` headers.
    rate: Option<Decided>,
}

impl std::fmt::Debug for PermitPass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PermitPass")
            .field("permit", &self.permit)
            .field("lent", &self.home.is_some())
            .finish()
    }
}

impl PermitPass {
    pub(crate) fn new(permit: Permit, rate: Option<Decided>) -> Self {
        PermitPass {
            permit: Some(permit),
            home: None,
            rate,
        }
    }

    /// A spare, lent by the spares it came from.
    pub(crate) fn lent((permit, home): (Permit, Home)) -> Self {
        PermitPass {
            permit: Some(permit),
            home: Some(home),
            rate: None,
        }
    }

    /// This service's own permit, lent by `spares` from now on, so it goes back there.
    pub(crate) fn lent_by(mut self, spares: &Spares) -> Self {
        if self.home.is_none() {
            self.home = spares.lend();
        }
        self
    }

    pub(crate) fn permit(&self) -> Option<&Permit> {
        self.permit.as_ref()
    }

    /// The rate limit decided with the permit, for the `RateLimit` headers.
    pub(crate) fn rate(&self) -> Option<&Decided> {
        self.rate.as_ref()
    }
}

impl Drop for PermitPass {
    fn drop(&mut self) {
        if let (Some(permit), Some(home)) = (self.permit.take(), self.home.take()) {
            home.give_back(permit);
        }
    }
}
