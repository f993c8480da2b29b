//! The protocol checked by machine (issue 49): a stateright model of the semaphore at the
//! grain of its script calls (`model.rs`), the crate's promises as invariants
//! (`invariants.rs`), the designs that fail and the shortest traces that show it
//! (`counterexamples.rs`), and the real script and `MemoryBackend` held to the model by
//! replaying random walks of it (`conformance.rs`). docs/design.md's "The model" explains it.

mod check;
mod conformance;
mod counterexamples;
mod invariants;
mod model;
#[path = "../support/mod.rs"]
mod support;
