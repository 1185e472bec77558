//! The threads of a single deployment and what they share: the renewal
//! thread (`renewal.rs`, over the scheduler of `scheduler.rs`, which a
//! Redlock group's renewal thread in `redlock/guard.rs` runs too), the
//! per-server executors (`server.rs`) and invalidation subscribers, with the
//! turning on of tracking on command connections (`tracking.rs`), the topology followers of Cluster and Sentinel
//! deployments (`topology/`), the waiters (`waiters.rs`), and the lease state
//! they share with the guards (`lease.rs`). The Redlock node workers live
//! beside the rest of Redlock, in `redlock/worker.rs`. Everything here drives
//! the pure core (`crate::core`) with the deployment's clock and real
//! connections.

pub(crate) mod backoff;
pub(crate) mod lease;
pub(crate) mod registry;
pub(crate) mod renewal;
pub(crate) mod scheduler;
pub(crate) mod server;
pub(crate) mod topology;
pub(crate) mod tracking;
pub(crate) mod waiters;
