//! The timing rules every lease follows, as pure functions of instants passed in.
//!
//! A lease is granted or extended by a command *sent* at some instant; the
//! server sets its expiry when it runs the command, at that instant or later.
//! So from the client's side the lease is certainly held until
//! `sent + ttl − drift(ttl)`, where the drift allowance covers the server's
//! clock running faster than ours (antirez's Redlock rule: `ttl × factor + 2 ms`,
//! the 2 ms for millisecond rounding). A holder is told it lost the lease one
//! node timeout before that, so that a command it starts just before can still
//! finish while the lease holds.

use std::time::{Duration, Instant};

/// The two settings that turn a send time and a TTL into bounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Timing {
    /// The fraction of each TTL written off for clock-rate differences.
    pub(crate) drift_factor: f64,
    /// The longest one command may take; also the loss margin.
    pub(crate) node_timeout: Duration,
}

impl Timing {
    /// `ttl × factor + 2 ms`.
    pub(crate) fn drift(&self, ttl: Duration) -> Duration {
        drift(ttl, self.drift_factor)
    }

    /// Until when a command sent at `sent` keeps the lease, if it was applied.
    pub(crate) fn valid_until(&self, sent: Instant, ttl: Duration) -> Instant {
        sent.checked_add(ttl)
            .and_then(|end| end.checked_sub(self.drift(ttl)))
            .unwrap_or(sent)
            .max(sent)
    }

    /// When a holder is told the lease is lost, given its validity end.
    pub(crate) fn lost_at(&self, valid_until: Instant, floor: Instant) -> Instant {
        valid_until
            .checked_sub(self.node_timeout)
            .unwrap_or(floor)
            .max(floor)
    }

    /// The shortest TTL keep-alive can work with: the renewal at half the lease
    /// must come before the loss deadline with two node timeouts to spare (one
    /// for the renewal, one for a retry).
    pub(crate) fn min_keepalive_ttl(&self) -> Duration {
        // ttl/2 > drift(ttl) + 2 × node_timeout  ⇔  ttl (1/2 − f) > 2 ms + 2 × node_timeout
        let fixed = Duration::from_millis(2) + self.node_timeout * 2;
        fixed.div_f64((0.5 - self.drift_factor).max(0.01))
    }

    /// Whether a lease of this TTL is usable at all: some time must remain
    /// between the grant and the loss deadline.
    pub(crate) fn usable_ttl(&self, ttl: Duration) -> bool {
        ttl > self.drift(ttl) + self.node_timeout
    }
}

/// `ttl × factor + 2 ms`.
pub(crate) fn drift(ttl: Duration, factor: f64) -> Duration {
    ttl.mul_f64(factor) + Duration::from_millis(2)
}

/// The one back-off of the library: the pause after the `n`-th failure (or
/// busy attempt) in a row, `base × 2^(n−1)` at most `max`, of which `unit`
/// (a random number in `0.0..1.0`; 1.0 for no jitter) keeps between half and
/// all, so that contenders who failed together do not retry together.
pub(crate) fn backoff(n: u32, base: Duration, max: Duration, unit: f64) -> Duration {
    let shift = n.clamp(1, 17) - 1;
    let ceiling = base.saturating_mul(1u32 << shift).min(max);
    ceiling.mul_f64(0.5 + 0.5 * unit.clamp(0.0, 1.0))
}

/// How long a Redlock node's connector pauses after its `failures`-th failed
/// try in a row: 25 ms, doubling, at most 1 s (no jitter: each node has its
/// own connector, and a healed node should be found soon).
pub(crate) fn rest_after(failures: u32) -> Duration {
    backoff(
        failures,
        Duration::from_millis(25),
        Duration::from_secs(1),
        1.0,
    )
}

/// How long reconnect try number `failures + 1` of an outage may take: four
/// node timeouts (at least 100 ms) at first, doubling with each failed try, at
/// most the connect timeout. Short tries notice a healed link soon (a try
/// whose packets were dropped waits out its whole budget); longer ones give a
/// slow link its chance.
pub(crate) fn try_budget(
    failures: u32,
    node_timeout: Duration,
    connect_timeout: Duration,
) -> Duration {
    let first = (node_timeout * 4).max(Duration::from_millis(100));
    first
        .saturating_mul(1u32 << failures.min(16))
        .min(connect_timeout)
}

/// How long a subscriber thread (a server's invalidations, a sentinel's
/// switches) pauses before its `failures`-th reconnect in a row: 50 ms,
/// doubling, at most 2 s (no jitter: each server has its own).
pub(crate) fn resubscribe_after(failures: u32) -> Duration {
    backoff(
        failures,
        Duration::from_millis(50),
        Duration::from_secs(2),
        1.0,
    )
}

/// How long to wait before retrying a renewal that failed.
pub(crate) fn retry_delay(ttl: Duration) -> Duration {
    (ttl / 20).clamp(Duration::from_millis(5), Duration::from_millis(250))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    const T: Timing = Timing {
        drift_factor: 0.01,
        node_timeout: Duration::from_millis(500),
    };

    #[test]
    fn validity_counts_from_the_send() {
        let sent = Instant::now();
        let v = T.valid_until(sent, ms(10_000));
        assert_eq!(v, sent + ms(10_000 - 102));
        assert_eq!(T.lost_at(v, sent), sent + ms(10_000 - 102 - 500));
    }

    #[test]
    fn validity_never_precedes_the_send() {
        let sent = Instant::now();
        let v = T.valid_until(sent, ms(3));
        assert!(v >= sent);
        assert_eq!(T.lost_at(v, sent), sent);
        assert!(!T.usable_ttl(ms(500)));
        assert!(T.usable_ttl(ms(600)));
    }

    #[test]
    fn renewal_at_half_leaves_two_node_timeouts() {
        for node_timeout in [ms(10), ms(200), ms(500), ms(2_000)] {
            for drift_factor in [0.0, 0.01, 0.1] {
                let t = Timing {
                    drift_factor,
                    node_timeout,
                };
                let min = t.min_keepalive_ttl();
                let sent = Instant::now();
                let lost_at = t.lost_at(t.valid_until(sent, min), sent);
                assert!(sent + min / 2 + node_timeout <= lost_at, "{t:?}");
            }
        }
    }

    #[test]
    fn a_ttl_that_leaves_no_time_before_the_loss_deadline_is_unusable() {
        // No drift: the loss deadline is ttl − 2 ms − 500 ms after the grant.
        let t = Timing {
            drift_factor: 0.0,
            node_timeout: ms(500),
        };
        assert!(!t.usable_ttl(ms(502)), "lost at the grant");
        assert!(t.usable_ttl(ms(503)));
    }

    #[test]
    fn a_redlock_connector_rests_25_ms_doubling_to_a_second() {
        let rests: Vec<Duration> = (0..=9).map(rest_after).collect();
        let expected = [25, 25, 50, 100, 200, 400, 800, 1_000, 1_000, 1_000].map(ms);
        assert_eq!(rests, expected);
    }

    #[test]
    fn reconnect_tries_grow_to_the_connect_timeout() {
        let ms = Duration::from_millis;
        let connect = ms(2000);
        assert_eq!(try_budget(0, ms(50), connect), ms(200));
        assert_eq!(try_budget(1, ms(50), connect), ms(400));
        assert_eq!(try_budget(3, ms(50), connect), ms(1600));
        assert_eq!(try_budget(4, ms(50), connect), connect);
        assert_eq!(try_budget(u32::MAX, ms(50), connect), connect);
        assert_eq!(try_budget(0, ms(5), connect), ms(100));
        assert_eq!(try_budget(0, ms(50), ms(150)), ms(150));
    }

    #[test]
    fn a_subscriber_waits_50_ms_doubling_to_2_s_before_reconnecting() {
        let pauses: Vec<Duration> = (1..=8).map(resubscribe_after).collect();
        let expected = [50, 100, 200, 400, 800, 1_600, 2_000, 2_000].map(ms);
        assert_eq!(pauses, expected);
    }

    #[test]
    fn retry_delay_is_bounded() {
        assert_eq!(retry_delay(ms(40)), ms(5));
        assert_eq!(retry_delay(ms(2_000)), ms(100));
        assert_eq!(retry_delay(ms(60_000)), ms(250));
    }

    #[test]
    fn huge_durations_mean_never() {
        let now = Instant::now();
        // A huge TTL saturates instead of panicking.
        let v = T.valid_until(now, Duration::MAX);
        assert!(v >= now);
    }
}
