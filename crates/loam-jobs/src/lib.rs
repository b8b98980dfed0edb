//! Loam Jobs: the queue core.
//!
//! One key layout ([`keys`]) over a small ordered, transactional key-value
//! interface ([`kv`]), so every engine ([`store`]) runs the same queue logic
//! ([`ops`]). [`Jobs`] is the handle callers use; `docs/design.md` explains
//! the layout, group commit, fencing and the sweeps.

pub mod clock;
pub mod config;
pub mod error;
pub mod jobs;
pub mod keys;
pub mod kv;
pub mod model;
pub mod notify;
pub mod ops;
pub mod pending;
pub mod store;
pub mod tx;

pub use clock::{Clock, FollowingClock, ManualClock, SystemClock};
pub use config::{Config, QueueConfig};
pub use error::{BullmqCode, FenceFailure, JobsError, Missing, Precondition, StoreError};
pub use jobs::{Interrupt, Jobs, Pending};
pub use keys::QueueId;
pub use model::*;
pub use ops::enqueue::FlowNode;
pub use ops::schedule::SchedulerSpec;
pub use store::Durability;
