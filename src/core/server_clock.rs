//! A server's wall clock, watched against the client's monotonic clock.
//!
//! Redis expires keys by its wall clock: an expiry set with `PEXPIRE` is
//! stored as an absolute time, so a server clock stepped forward (an NTP step,
//! a virtual machine resumed, a hand-set date) ends every lease on it early,
//! by as much as the clock gained. The client cannot see the step itself, only
//! two readings of the server's `TIME`, each taken somewhere inside one round
//! trip whose send and reply instants the client knows on its own monotonic
//! clock. Between two readings the client's time passed at least from the
//! first reply to the second send, and at most from the first send to the
//! second reply; when the server's time passed by more than the most, plus
//! the drift the leases already allow for, its clock ran ahead, by at most
//! the server's elapsed time minus the least.
//!
//! A clock stepped back makes expiries come later: nothing to cut.

use std::time::{Duration, Instant};

use crate::core::timing;

/// One reading of a server's `TIME`, taken by a command sent at `sent` whose
/// reply came at `received`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reading {
    /// The server's wall clock, since the Unix epoch.
    pub(crate) server: Duration,
    pub(crate) sent: Instant,
    pub(crate) received: Instant,
}

/// How many earlier readings a new one is compared with: a slow reply makes
/// a poor baseline (its instant is known only within its round trip), so
/// one slow reading must not erase the precise ones before it.
const BASELINES: usize = 4;

/// The last readings of one server's clock.
#[derive(Clone, Debug, Default)]
pub(crate) struct ServerClock {
    last: Vec<Reading>,
}

impl ServerClock {
    /// Takes a new reading; returns how far the server's clock may have run
    /// ahead of the client's since the last one, when that is more than
    /// `drift_factor` (as for a lease's TTL) allows: every expiry the server
    /// set before `reading.received` may come that much earlier.
    ///
    /// The reading is compared with each of the last few: the largest gain
    /// any of them shows counts. After a finding, only the new reading is
    /// kept, so that one step is reported once.
    pub(crate) fn read(&mut self, reading: Reading, drift_factor: f64) -> Option<Duration> {
        let gain = self
            .last
            .iter()
            .filter_map(|last| gained(last, &reading, drift_factor))
            .max();
        if gain.is_some() {
            self.last.clear();
        } else if self.last.len() == BASELINES {
            self.last.remove(0);
        }
        self.last.push(reading);
        gain
    }
}

/// How far the server's clock may have run ahead between `last` and `now`,
/// when that is more than `drift_factor` allows.
fn gained(last: &Reading, now: &Reading, drift_factor: f64) -> Option<Duration> {
    let server = now.server.checked_sub(last.server)?;
    let most = now.received.saturating_duration_since(last.sent);
    let least = now.sent.saturating_duration_since(last.received);
    if server <= most + timing::drift(most, drift_factor) {
        return None;
    }
    Some(server.saturating_sub(least))
}

/// Reads the reply to `TIME`: seconds and microseconds, as two integers or
/// two strings.
pub(crate) fn parse_time(reply: &[String]) -> Option<Duration> {
    match reply {
        [secs, micros] => {
            let secs: u64 = secs.parse().ok()?;
            let micros: u64 = micros.parse().ok()?;
            (micros < 1_000_000).then(|| Duration::from_secs(secs) + Duration::from_micros(micros))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn reading(server_ms: u64, t0: Instant, sent: u64, received: u64) -> Reading {
        Reading {
            server: ms(1_700_000_000_000 + server_ms),
            sent: t0 + ms(sent),
            received: t0 + ms(received),
        }
    }

    #[test]
    fn a_clock_that_keeps_time_gains_nothing() {
        let t0 = Instant::now();
        let mut c = ServerClock::default();
        assert_eq!(c.read(reading(0, t0, 0, 2), 0.01), None);
        // 1 s later on both clocks, within round trips of 2 ms.
        assert_eq!(c.read(reading(1_001, t0, 1_000, 1_002), 0.01), None);
        // Within the drift the leases allow (1 % + 2 ms of 1 002 ms).
        assert_eq!(c.read(reading(2_013, t0, 2_000, 2_002), 0.01), None);
    }

    #[test]
    fn a_step_forward_is_measured_at_its_largest() {
        let t0 = Instant::now();
        let mut c = ServerClock::default();
        c.read(reading(0, t0, 0, 2), 0.01);
        // The server says 11 s passed; the client saw between 998 ms (first
        // reply to second send) and 1 002 ms.
        let gain = c.read(reading(11_000, t0, 1_000, 1_002), 0.01).unwrap();
        assert_eq!(gain, ms(11_000 - 998));
        // The next reading starts from the stepped clock.
        assert_eq!(c.read(reading(12_000, t0, 2_000, 2_002), 0.01), None);
    }

    #[test]
    fn a_slow_reply_does_not_hide_a_step_the_reading_before_it_shows() {
        let t0 = Instant::now();
        let mut c = ServerClock::default();
        // Precise readings up to 124 ms, then one answered 109 ms late.
        c.read(reading(0, t0, 0, 0), 0.05);
        c.read(reading(124, t0, 124, 124), 0.05);
        c.read(reading(233, t0, 124, 233), 0.05);
        // A 96 ms step at 552 ms; read at 587 ms. Against the slow reading
        // alone the server's 450 ms are within 463 ms plus drift; against the
        // precise one before it, 559 ms against 463 ms are not.
        let gain = c.read(reading(587 + 96, t0, 587, 587), 0.05).unwrap();
        assert!(gain >= ms(96), "{gain:?}");
    }

    #[test]
    fn a_step_back_cuts_nothing() {
        let t0 = Instant::now();
        let mut c = ServerClock::default();
        c.read(reading(10_000, t0, 0, 2), 0.01);
        assert_eq!(c.read(reading(1_000, t0, 1_000, 1_002), 0.01), None);
    }

    #[test]
    fn time_replies_parse_or_are_refused() {
        let s = |a: &str, b: &str| vec![a.to_owned(), b.to_owned()];
        assert_eq!(
            parse_time(&s("1700000000", "250000")),
            Some(Duration::from_millis(1_700_000_000_250))
        );
        assert_eq!(parse_time(&s("1700000000", "1000000")), None);
        assert_eq!(parse_time(&s("x", "1")), None);
        assert_eq!(parse_time(&["1".to_owned()]), None);
    }
}
