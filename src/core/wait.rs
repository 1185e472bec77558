//! The policy a wait follows between its attempts, as a record of them with
//! instants passed in: a busy attempt (the key is held) ends a run of
//! failures, a failure that may pass is remembered (and the first of the
//! wait is the one to warn of), and a wait that reaches its deadline ends
//! with its last failure, or with nothing acquired after a busy attempt. A
//! pause never runs past the deadline.
//!
//! The waiters of a single deployment and a Redlock group's waits follow it;
//! each chooses how long to pause from its counts with the one back-off,
//! [`crate::core::timing::backoff`]: the waiters after failures only (a held
//! key is waited for by its invalidation), a Redlock group after every
//! attempt not granted.

use std::time::{Duration, Instant};

/// What a wait has seen of its attempts so far; `E` is a failure.
#[derive(Debug)]
pub(crate) struct WaitPolicy<E> {
    /// `None`: no deadline.
    deadline: Option<Instant>,
    /// Attempts not granted.
    tries: u32,
    /// Failures since the last busy attempt.
    failures: u32,
    /// The failure of the last attempt, unless a busy one came after it.
    last_error: Option<E>,
    /// Whether an attempt found the key held.
    found_held: bool,
    /// Whether a failure was seen (and warned of) already.
    warned: bool,
}

impl<E> WaitPolicy<E> {
    pub(crate) fn new(deadline: Option<Instant>) -> Self {
        WaitPolicy {
            deadline,
            tries: 0,
            failures: 0,
            last_error: None,
            found_held: false,
            warned: false,
        }
    }

    /// Whether the wait's deadline has passed at `now`.
    pub(crate) fn past(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| now >= d)
    }

    /// An attempt found the key held: the run of failures ends, and so does
    /// the last failure's claim to be the wait's result.
    pub(crate) fn busy(&mut self) {
        self.tries = self.tries.saturating_add(1);
        self.failures = 0;
        self.last_error = None;
        self.found_held = true;
    }

    /// An attempt failed in a way that may pass. Returns whether it is the
    /// wait's first such failure (the one to warn of).
    pub(crate) fn failed(&mut self, e: E) -> bool {
        self.tries = self.tries.saturating_add(1);
        self.failures = self.failures.saturating_add(1);
        self.last_error = Some(e);
        !std::mem::replace(&mut self.warned, true)
    }

    /// Attempts not granted so far.
    pub(crate) fn tries(&self) -> u32 {
        self.tries
    }

    /// Failures since the last busy attempt.
    pub(crate) fn failures(&self) -> u32 {
        self.failures
    }

    /// Whether the wait has a result of its own to end with: an attempt
    /// found the key held, or the last one failed.
    pub(crate) fn has_verdict(&self) -> bool {
        self.found_held || self.last_error.is_some()
    }

    /// The result of a wait that ends now without a grant: the last
    /// failure, or nothing acquired.
    pub(crate) fn end<T>(&mut self) -> Result<Option<T>, E> {
        match self.last_error.take() {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    /// When a pause of `pause` begun at `now` ends: at the deadline at the
    /// latest.
    pub(crate) fn wake_at(&self, now: Instant, pause: Duration) -> Instant {
        let wake = now + pause;
        self.deadline.map_or(wake, |d| d.min(wake))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_wait_ends_with_its_last_failure_unless_a_busy_attempt_came_after() {
        let t0 = Instant::now();
        let mut w: WaitPolicy<&str> = WaitPolicy::new(Some(t0 + ms(100)));
        assert!(!w.has_verdict());
        assert!(w.failed("refused"), "the first failure is warned of");
        assert!(!w.failed("timed out"), "only the first");
        assert_eq!((w.tries(), w.failures()), (2, 2));
        assert!(w.has_verdict());
        w.busy();
        assert_eq!((w.tries(), w.failures()), (3, 0));
        assert!(w.has_verdict());
        assert_eq!(w.end::<()>(), Ok(None));
        w.failed("reset");
        assert_eq!(w.end::<()>(), Err("reset"));
    }

    #[test]
    fn a_pause_ends_at_the_deadline_at_the_latest() {
        let t0 = Instant::now();
        let w: WaitPolicy<()> = WaitPolicy::new(Some(t0 + ms(100)));
        assert!(!w.past(t0 + ms(99)));
        assert!(w.past(t0 + ms(100)));
        assert_eq!(w.wake_at(t0, ms(30)), t0 + ms(30));
        assert_eq!(w.wake_at(t0 + ms(90), ms(30)), t0 + ms(100));
        let forever: WaitPolicy<()> = WaitPolicy::new(None);
        assert!(!forever.past(t0 + ms(1_000_000)));
        assert_eq!(forever.wake_at(t0, ms(30)), t0 + ms(30));
    }
}
