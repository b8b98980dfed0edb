//! loam.jobs.v1, generated at build time from `proto/loam/jobs/v1/`: the
//! buffa messages, the `JobsService` trait with its `JobsServiceServer`
//! dispatcher, and the `JobsServiceClient`.

#![allow(
    clippy::all,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::allow_attributes_without_reason,
    clippy::undocumented_unsafe_blocks,
    missing_docs,
    reason = "generated code"
)]

connectrpc::include_generated!();
