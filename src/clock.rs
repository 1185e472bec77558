//! The clock every lease decision reads, injectable so that the lease logic can
//! be driven by simulated time (ureq's `CurrentTime`).
//!
//! The pure lease core (`crate::core`) never reads a clock: every transition
//! takes the instant it happens at. The runtime and the guards read the
//! monotonic clock through this trait, once per decision.

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
