//! The partitions' bounded map from key to semaphore: `quick_cache`'s concurrent cache
//! (CLOCK-PRO eviction, sharded), so lookups of different keys never wait on one lock. Its
//! default hasher is std's (SipHash, randomly keyed): keys are request data, and a fixed
//! hash would let a client aim every key at one shard.

use quick_cache::sync::Cache;

use crate::{Error, Semaphore};

/// At most `capacity` keys' semaphores; the ones used least recently go first.
pub(super) struct KeyCache(Cache<String, Semaphore>);

impl KeyCache {
    pub(super) fn new(capacity: usize) -> Self {
        KeyCache(Cache::new(capacity))
    }

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    /// The semaphore of `key`, built by `build` if the cache does not hold it (once: callers
    /// asking for the same key meanwhile wait for that build, which never blocks on I/O).
    pub(super) fn get_or_build(
        &self,
        key: &str,
        build: impl FnOnce() -> Result<Semaphore, Error>,
    ) -> Result<Semaphore, Error> {
        self.0.get_or_insert_with(key, build)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryBackend;

    fn sem(name: &str) -> Result<Semaphore, Error> {
        Semaphore::builder(name)
            .limit(1)
            .build(MemoryBackend::new())
    }

    #[test]
    fn stays_bounded_and_keeps_a_key_in_use() {
        let cache = KeyCache::new(64);
        for i in 0..10_000 {
            let key = format!("k{i}");
            assert_eq!(cache.get_or_build(&key, || sem(&key)).unwrap().name(), key);
            // A hot key, asked for between every new one, stays.
            cache.get_or_build("hot", || sem("hot")).unwrap();
            assert!(cache.len() <= 64, "{} keys held", cache.len());
        }
        let mut built = false;
        cache
            .get_or_build("hot", || {
                built = true;
                sem("hot")
            })
            .unwrap();
        assert!(!built, "the hot key was evicted");
    }

    #[test]
    fn a_failed_build_caches_nothing() {
        let cache = KeyCache::new(8);
        let err = cache.get_or_build("zero", || {
            Semaphore::builder("zero").build(MemoryBackend::new())
        });
        assert!(matches!(err, Err(Error::Config(_))));
        assert_eq!(cache.len(), 0);
    }
}
