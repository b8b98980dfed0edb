//! The Node binding of the Loam Jobs core: BullMQ 6.7's `IQueueBackend`
//! operations over an embedded redb store, for the `@loam/bullmq` package.
//!
//! [`backend::LoamQueue`] is the class JavaScript drives (one per BullMQ
//! backend); [`store`] shares one open core per data dir per process;
//! [`convert`] maps BullMQ's JSON shapes to the core's types and back;
//! [`error`] maps the core's errors to BullMQ's codes and texts; [`promise`]
//! settles the promises of writes from the core's threads.

pub mod backend;
pub mod convert;
pub mod error;
pub mod promise;
pub mod store;

// The addon's own allocations (Node keeps its allocator): see the workspace
// Cargo.toml for why.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
