//! Whether an acquire attempt's answers give the lock: a quorum granted,
//! and validity left of the TTL after the attempt and the clock drift.

use std::time::Duration;

use crate::core::quorum::{AcquireVerdict, Tally};
use crate::core::timing::drift;

/// `ttl − elapsed − (ttl × drift + 2 ms)`, or zero.
pub(crate) fn validity(ttl: Duration, elapsed: Duration, drift_factor: f64) -> Duration {
    ttl.saturating_sub(elapsed + drift(ttl, drift_factor))
}

/// Whether an acquire attempt's answers give the lock: a quorum granted and
/// `validity` is left of the TTL.
pub(crate) fn acquired(tally: &Tally, validity: Duration) -> bool {
    tally.acquire() == AcquireVerdict::Granted && !validity.is_zero()
}

#[cfg(test)]
mod tests {
    use crate::core::quorum::Vote;

    use super::*;

    #[test]
    fn an_acquire_needs_a_quorum_and_validity_left() {
        let mut t = Tally::new(3, 3);
        t.add(Vote::Yes, true);
        t.add(Vote::Yes, true);
        assert!(acquired(&t, Duration::from_millis(1)));
        assert!(!acquired(&t, Duration::ZERO), "the attempt used up the TTL");
        let mut t = Tally::new(3, 3);
        t.add(Vote::Yes, true);
        t.add(Vote::Unknown, false);
        t.add(Vote::Unknown, false);
        assert!(!acquired(&t, Duration::from_secs(1)));
    }

    #[test]
    fn validity_is_what_is_left_of_the_ttl_after_the_attempt_and_the_drift() {
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        assert_eq!(validity(s(10), s(1), 0.01), s(10) - s(1) - ms(102));
        assert_eq!(validity(s(1), s(2), 0.01), Duration::ZERO);
    }
}
