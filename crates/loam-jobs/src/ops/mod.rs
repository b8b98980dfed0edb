//! The queue operations, each a function over one [`crate::tx::Tx`].

pub mod admin;
pub mod complete;
pub mod enqueue;
pub mod idempotency;
pub mod lease;
pub mod query;
pub mod results;
pub mod schedule;
