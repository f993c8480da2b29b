//! What one acquisition asks of a semaphore.

use crate::Priority;

/// What a request asks of a semaphore: how many permits, as one holder, its class, and its
/// tenant.
///
/// An [`Admit`](crate::layer::Admit) returns one for each request the layer admits.
///
/// # Examples
///
/// ```
/// use tower_distributed_limit::{Ask, Priority};
///
/// let ask = Ask::new().weight(3).priority(Priority::BATCH).tenant("customer-42");
/// assert_eq!((ask.get_weight(), ask.get_priority()), (3, Priority::BATCH));
/// assert_eq!(ask.get_tenant(), Ask::new().tenant("customer-42").get_tenant());
/// assert_eq!((Ask::new().get_weight(), Ask::new().get_priority()), (1, Priority::NORMAL));
/// assert_eq!(Ask::new().get_tenant(), None);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Ask {
    weight: u32,
    priority: Priority,
    tenant: Option<u64>,
}

impl Default for Ask {
    fn default() -> Self {
        Ask {
            weight: 1,
            priority: Priority::NORMAL,
            tenant: None,
        }
    }
}

impl Ask {
    /// One permit.
    pub fn new() -> Self {
        Ask::default()
    }

    /// `weight` permits, held as one (a batch of 8 images takes 8 slots). A weight of 0 or
    /// above the limit is refused at once, never waited for.
    pub fn weight(self, weight: u32) -> Self {
        Ask { weight, ..self }
    }

    /// Its class: a higher one is served first, inside the share the semaphore gives it
    /// ([`SemaphoreBuilder::class`](crate::SemaphoreBuilder::class)).
    pub fn priority(self, priority: Priority) -> Self {
        Ask { priority, ..self }
    }

    /// Its tenant: inside its class, tenants are served in turn (one tenant's flood waits
    /// behind every other tenant's next request), and each holds at most the semaphore's
    /// per-tenant cap ([`SemaphoreBuilder::per_tenant`](crate::SemaphoreBuilder::per_tenant)).
    ///
    /// `key` is request data and may be anything (empty, 10 KB, NUL bytes, braces): only 64
    /// bits of its SHA-1 travel and are stored, so every process maps one key to one tenant
    /// and no key can reach the backend's key space. Two keys sharing those bits are served as
    /// one tenant: among a million tenants, the chance that any two do is about 3 × 10⁻⁸.
    /// (A [`QuorumBackend`](crate::QuorumBackend) admits tenants in arrival order, without
    /// turns, as it does classes.)
    pub fn tenant(self, key: impl AsRef<[u8]>) -> Self {
        let digest = sha1_smol::Sha1::from(key.as_ref()).digest().bytes();
        let mut head = [0; 8];
        head.copy_from_slice(&digest[..8]);
        Ask {
            tenant: Some(u64::from_be_bytes(head)),
            ..self
        }
    }

    // The getters are named as `std::process::Command`'s are: `get_` + the setter's name,
    // since the setter takes the plain one.

    /// How many permits it asks for ([`weight`](Self::weight)).
    pub fn get_weight(&self) -> u32 {
        self.weight
    }

    /// Its class ([`priority`](Self::priority)).
    pub fn get_priority(&self) -> Priority {
        self.priority
    }

    /// Its tenant as the backend knows it (64 bits of its key's SHA-1), if it has one
    /// ([`tenant`](Self::tenant)).
    pub fn get_tenant(&self) -> Option<u64> {
        self.tenant
    }
}
