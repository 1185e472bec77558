//! The code that starts threads, but for the Redlock node workers (beside the
//! rest of Redlock, in `redlock/worker.rs`): the renewal thread, the
//! per-server executors and invalidation subscribers, the topology followers
//! of Cluster and Sentinel deployments, the Redlock renewal thread (per
//! `RedlockGroup`), and the lease state they share with the guards. Everything here drives the pure core
//! (`crate::core`) with real time and real connections.

pub(crate) mod lease;
pub(crate) mod node;
pub(crate) mod renewal;
pub(crate) mod scheduler;
pub(crate) mod topology;
pub(crate) mod tracking;
pub(crate) mod waiters;
