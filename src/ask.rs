//! What one acquisition asks of a semaphore.

use crate::Priority;

/// What a request asks of a semaphore: how many permits, as one holder, and its class.
///
/// An [`Admit`](crate::layer::Admit) returns one for each request the layer admits.
///
/// # Example
///
/// ```
/// use tower_distributed_limit::{Ask, Priority};
///
/// let ask = Ask::new().weight(3).priority(Priority::BATCH);
/// assert_eq!((ask.permits(), ask.class()), (3, Priority::BATCH));
/// assert_eq!((Ask::new().permits(), Ask::new().class()), (1, Priority::NORMAL));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Ask {
    weight: u32,
    priority: Priority,
}

impl Default for Ask {
    fn default() -> Self {
        Ask {
            weight: 1,
            priority: Priority::NORMAL,
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

    /// Its class.
    pub fn class(&self) -> Priority {
        self.priority
    }

    /// How many permits it asks for.
    pub fn permits(&self) -> u32 {
        self.weight
    }
}
