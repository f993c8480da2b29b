//! The partitions' bounded map from key to semaphore.

use std::collections::HashMap;
use std::sync::Arc;

use crate::Semaphore;

/// A bounded map with second-chance (CLOCK) eviction: an approximation of least recently used
/// with O(1) hits and amortised O(1) misses.
pub(super) struct KeyCache {
    index: HashMap<Arc<str>, usize>,
    slots: Vec<Slot>,
    hand: usize,
    capacity: usize,
}

struct Slot {
    key: Arc<str>,
    semaphore: Semaphore,
    referenced: bool,
}

impl KeyCache {
    pub(super) fn new(capacity: usize) -> Self {
        KeyCache {
            index: HashMap::new(),
            slots: Vec::new(),
            hand: 0,
            capacity,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    pub(super) fn get(&mut self, key: &str) -> Option<Semaphore> {
        let slot = &mut self.slots[*self.index.get(key)?];
        slot.referenced = true;
        Some(slot.semaphore.clone())
    }

    pub(super) fn insert(&mut self, key: Arc<str>, semaphore: Semaphore) {
        let slot = Slot {
            key: key.clone(),
            semaphore,
            referenced: false,
        };
        if self.slots.len() < self.capacity {
            self.index.insert(key, self.slots.len());
            self.slots.push(slot);
            return;
        }
        // Sweep: spare each recently used slot once, evict the first one that was not.
        // Ends within two turns of the hand, since each spared slot loses its mark.
        loop {
            let current = &mut self.slots[self.hand];
            if current.referenced {
                current.referenced = false;
                self.hand = (self.hand + 1) % self.slots.len();
                continue;
            }
            self.index.remove(&current.key);
            *current = slot;
            self.index.insert(key, self.hand);
            self.hand = (self.hand + 1) % self.slots.len();
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryBackend;

    fn sem(name: &str) -> Semaphore {
        Semaphore::builder(name)
            .limit(1)
            .build(MemoryBackend::new())
            .unwrap()
    }

    #[test]
    fn clock_stays_bounded_and_spares_recent_keys() {
        let mut clock = KeyCache::new(3);
        for key in ["a", "b", "c"] {
            clock.insert(key.into(), sem(key));
        }
        assert!(clock.get("a").is_some()); // a is recently used
        clock.insert("d".into(), sem("d")); // evicts b, the first unmarked slot
        assert_eq!(clock.len(), 3);
        assert!(clock.get("b").is_none());
        assert!(clock.get("a").is_some());
        assert!(clock.get("d").is_some());
        for i in 0..100 {
            let key = format!("k{i}");
            clock.insert(key.as_str().into(), sem(&key));
            assert!(clock.get(&key).is_some());
            assert_eq!(clock.len(), 3);
            assert_eq!(clock.index.len(), 3);
        }
    }
}
