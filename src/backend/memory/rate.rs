//! Rate limiters in this process (issue 13): the same exact GCRA as `lua/gcra.lua`
//! ([`Gcra`], its state in `Cells`), on the backend's clock, one lock for every limiter of a
//! [`MemoryBackend`].

use std::sync::Arc;

use tokio::time::Instant;

use super::{InProcess, MemoryBackend};
use crate::Error;
use crate::backend::gcra::{
    Gcra, OpenedRate, RateBackend, RateDecision, RateStore, sealed::OpenRate,
};
use crate::sync::{BoxFuture, lock};

impl RateBackend for MemoryBackend {}

impl OpenRate for MemoryBackend {
    fn open_rate(&self, name: &str, gcra: Gcra) -> Result<OpenedRate, Error> {
        let store = Arc::new(MemoryRate {
            shared: self.shared.clone(),
            name: name.into(),
            gcra,
        });
        Ok(OpenedRate { store })
    }
}

struct MemoryRate {
    shared: Arc<InProcess>,
    name: Arc<str>,
    gcra: Gcra,
}

impl RateStore for MemoryRate {
    fn check<'a>(
        &'a self,
        key: Option<&'a str>,
        n: u32,
    ) -> BoxFuture<'a, Result<RateDecision, Error>> {
        let now = self.shared.server_us(Instant::now());
        let mut cells = lock(&self.shared.rates);
        let decision = match key {
            None => cells.check(&self.name, &self.gcra, now, u64::from(n)),
            Some(part) => {
                let name = format!("{}:{part}", self.name);
                cells.check(&name, &self.gcra, now, u64::from(n))
            }
        };
        drop(cells);
        Box::pin(async move { Ok(decision) })
    }
}
