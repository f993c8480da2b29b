//! Releases a server missed while it could not be reached, kept to be sent once it answers
//! (`redis/outbox.rs`, `quorum/owed.rs`): each until its member's lease would have ended,
//! and at most [`AT_MOST`] a semaphore, as a process's waiters are bounded (`max_waiters`).

/// The most releases kept for servers that cannot be reached, per semaphore.
pub(crate) const AT_MOST: usize = 10_000;

/// Drops the oldest of `owed` (kept in the order they were owed) beyond [`AT_MOST`], with a
/// warning: their slots free when their leases end.
pub(crate) fn bound<T>(owed: &mut Vec<T>) {
    let excess = owed.len().saturating_sub(AT_MOST);
    if excess > 0 {
        owed.drain(..excess);
        tracing::warn!(
            dropped = excess,
            "more releases wait for an unreachable Redis than are kept: the oldest free when \
             their leases end"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_go_beyond_the_bound() {
        let mut owed: Vec<usize> = (0..AT_MOST + 3).collect();
        bound(&mut owed);
        assert_eq!(owed.len(), AT_MOST);
        assert_eq!(owed[0], 3);
        bound(&mut owed);
        assert_eq!(owed.len(), AT_MOST, "within the bound nothing goes");
    }
}
