//! The pause between reconnect tries of the Redlock node workers
//! (`redlock/worker.rs`), on its own so that the simulation, which models
//! those workers, reads the same schedule.

use std::time::Duration;

/// How long a connector pauses after its `failures`-th failed try in a row:
/// 25 ms, doubling, at most 1 s.
pub(crate) fn rest_after(failures: u32) -> Duration {
    let shift = failures.clamp(1, 7) - 1;
    (Duration::from_millis(25) * (1u32 << shift)).min(Duration::from_secs(1))
}
