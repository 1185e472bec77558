//! The one jittered back-off: what every doubling pause of the library is
//! drawn from (a wait's pause after a failure, a Redlock wait's after every
//! attempt not granted, `respire-lock`'s after a conflict), public for retry
//! loops of the caller's own. The arithmetic is `core::timing::backoff`; the
//! jitter is drawn here.

use std::time::Duration;

use crate::core::timing::backoff;
use crate::token::random_unit;

/// A jittered exponential back-off: the pause after the `n`-th failure in a
/// row is random between half and all of `base × 2^(n−1)`, at most `max`, so
/// that callers who failed together do not try again together. The waits of
/// this library pause by it between failed attempts (10 ms to 1 s), and a
/// [`RedlockGroup`](crate::RedlockGroup) between its tries
/// ([`RedlockOptions::retry_base`](crate::RedlockOptions::retry_base) to
/// [`retry_max`](crate::RedlockOptions::retry_max)); it is here for retry
/// loops of the caller's own.
///
/// It computes pauses and never sleeps or blocks.
///
/// ```
/// use std::time::Duration;
/// use respire_coordination::Backoff;
///
/// let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(80));
/// let first = backoff.next_pause();
/// assert!(first >= Duration::from_millis(5) && first < Duration::from_millis(10));
/// for _ in 0..10 {
///     assert!(backoff.next_pause() < Duration::from_millis(80));
/// }
/// backoff.reset();
/// assert!(backoff.next_pause() < Duration::from_millis(10));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    /// Pauses handed out since the last reset.
    failures: u32,
}

impl Backoff {
    /// Pauses from half to all of `base`, doubling with each failure, at
    /// most `max`.
    pub const fn new(base: Duration, max: Duration) -> Backoff {
        Backoff {
            base,
            max,
            failures: 0,
        }
    }

    /// The pause after one more failure in a row.
    pub fn next_pause(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.pause_after(self.failures)
    }

    /// Starts over: the next pause is the first one again (after a success).
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// The pause after the `n`-th failure in a row (from 1), drawn anew on
    /// each call.
    pub(crate) fn pause_after(&self, n: u32) -> Duration {
        backoff(n, self.base, self.max, random_unit())
    }
}

/// The pause after the `n`-th failure in a row of a wait: random between half
/// and all of 10 ms × 2^(n−1), at most 1 s.
pub(crate) fn failure_pause(n: u32) -> Duration {
    WAIT_BACKOFF.pause_after(n)
}

/// The back-off of [`failure_pause`].
const WAIT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(1));

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn pauses_are_jittered_and_bounded() {
        let (base, max) = (ms(10), ms(200));
        assert_eq!(backoff(1, base, max, 0.0), ms(5));
        assert_eq!(backoff(1, base, max, 1.0), ms(10));
        assert_eq!(backoff(3, base, max, 0.0), ms(20));
        assert_eq!(backoff(30, base, max, 1.0), ms(200));
        let backoff = Backoff::new(base, max);
        let seen: std::collections::HashSet<_> = (0..100).map(|_| backoff.pause_after(2)).collect();
        assert!(seen.len() > 10);
        assert!(seen.iter().all(|d| *d >= ms(10) && *d <= ms(20)));
    }
}
