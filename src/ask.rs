//! What one acquisition asks of a semaphore.

/// What a request asks of a semaphore: how many permits, as one holder (more to come: a class
/// and a tenant).
///
/// An [`Admit`](crate::layer::Admit) returns one for each request the layer admits.
///
/// # Example
///
/// ```
/// use tower_distributed_limit::Ask;
///
/// let ask = Ask::new().weight(3);
/// assert_eq!(ask.permits(), 3);
/// assert_eq!(Ask::new().permits(), 1);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Ask {
    weight: u32,
}

impl Default for Ask {
    fn default() -> Self {
        Ask { weight: 1 }
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
        Ask { weight }
    }

    /// How many permits it asks for.
    pub fn permits(&self) -> u32 {
        self.weight
    }
}
