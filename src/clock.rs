//! The clock every part of the library reads, injectable so that the lease
//! logic can be driven by simulated time (ureq's `CurrentTime`).
//!
//! The pure lease core (`crate::core`) never reads a clock: every transition
//! takes the instant it happens at. Everything else — connections and their
//! deadlines, the waiters, the topology threads, the guards, the Redlock
//! workers — reads the deployment's clock through this trait, which the
//! coordinator builder hands to every part it makes; tests/layering.rs fails
//! on a direct `Instant::now` or `.elapsed()` anywhere else in the library
//! (test code and the simulation, whose model servers keep simulated time,
//! aside; the `respire-lock` binary times its own child). What blocks
//! in the operating system (a socket timeout, a channel's timer) still waits
//! in real time for the span computed from this clock.

use std::sync::Arc;
use std::time::Instant;

/// A monotonic clock.
pub(crate) trait Clock: Send + Sync {
    /// The current instant; never goes back.
    fn now(&self) -> Instant;
}

/// The operating system's monotonic clock.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Monotonic;

impl Clock for Monotonic {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// The clock a deployment uses unless told otherwise.
pub(crate) fn system() -> Arc<dyn Clock> {
    Arc::new(Monotonic)
}

#[cfg(test)]
pub(crate) mod manual {
    use super::Clock;
    use parking_lot::Mutex;
    use std::time::{Duration, Instant};

    /// A clock that moves only when told to.
    #[derive(Debug)]
    pub(crate) struct ManualClock {
        now: Mutex<Instant>,
    }

    impl ManualClock {
        pub(crate) fn new() -> Self {
            ManualClock {
                now: Mutex::new(Instant::now()),
            }
        }

        pub(crate) fn advance(&self, by: Duration) {
            *self.now.lock() += by;
        }
    }

    impl Clock for ManualClock {
        fn now(&self) -> Instant {
            *self.now.lock()
        }
    }
}
