//! The machine's shared monotonic clock.
//!
//! `CLOCK_MONOTONIC` is one clock for every process of a machine, so the
//! histories of separate worker processes, the nemesis and the server
//! sampler can be compared instant by instant. `std::time::Instant` reads the
//! same clock on Linux but does not expose its value; this reads it as
//! nanoseconds.

use rustix::time::{ClockId, clock_gettime};

/// Nanoseconds on `CLOCK_MONOTONIC`.
pub(crate) fn now_ns() -> u64 {
    let t = clock_gettime(ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}
