//! Monotonic time for leases, and the pure timing rules the runtime follows.
//!
//! Every deadline is computed from an `Instant` passed in, never read inside, so
//! the rules are unit-tested with made-up instants and no sleeping.

use std::sync::LazyLock;
use std::time::{Duration, Instant};

static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

/// Nanoseconds since the process epoch, for storing an `Instant` in an atomic.
pub(crate) fn to_ns(t: Instant) -> u64 {
    t.saturating_duration_since(*EPOCH).as_nanos() as u64
}

/// The inverse of [`to_ns`].
pub(crate) fn from_ns(ns: u64) -> Instant {
    *EPOCH + Duration::from_nanos(ns)
}

/// How much of a lease is written off for the difference between the client's
/// and the server's clock rates: `ttl × factor + 2 ms` (antirez's Redlock rule).
pub(crate) fn drift(ttl: Duration, factor: f64) -> Duration {
    ttl.mul_f64(factor) + Duration::from_millis(2)
}

/// The local view of one confirmed lease grant or renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Validity {
    /// Until when the lease is assumed held: send time + ttl − drift.
    pub(crate) valid_until: Instant,
    /// When the holder is told the lease is lost if no renewal was confirmed:
    /// `valid_until − node_timeout`, so that a command started just before still
    /// finishes before the lease can expire.
    pub(crate) lost_at: Instant,
}

impl Validity {
    /// The validity of a grant or renewal *sent* at `sent` (not received: the
    /// server may have set the expiry at any point after the send).
    pub(crate) fn from_send(
        sent: Instant,
        ttl: Duration,
        drift_factor: f64,
        node_timeout: Duration,
    ) -> Self {
        let valid_until = (sent + ttl)
            .checked_sub(drift(ttl, drift_factor))
            .unwrap_or(sent)
            .max(sent);
        let lost_at = valid_until
            .checked_sub(node_timeout)
            .unwrap_or(sent)
            .max(sent);
        Validity {
            valid_until,
            lost_at,
        }
    }
}

/// When a kept-alive lease confirmed at `sent` is next renewed: half the lease.
pub(crate) fn renew_at(sent: Instant, ttl: Duration) -> Instant {
    sent + ttl / 2
}

/// How long to wait before retrying a renewal that failed.
pub(crate) fn retry_delay(ttl: Duration) -> Duration {
    (ttl / 20).clamp(Duration::from_millis(5), Duration::from_millis(250))
}

/// The shortest TTL that keep-alive can work with: the renewal at half the lease
/// must come before the loss deadline, with room for a retry.
pub(crate) fn min_keepalive_ttl(drift_factor: f64, node_timeout: Duration) -> Duration {
    // ttl/2 > drift(ttl) + 2 × node_timeout  ⇔  ttl (1/2 − f) > 2 ms + 2 × node_timeout
    let fixed = Duration::from_millis(2) + node_timeout * 2;
    fixed.div_f64((0.5 - drift_factor).max(0.01))
}

/// Whether a lease of this TTL is usable at all: some time must remain between the
/// grant and the loss deadline.
pub(crate) fn usable_ttl(ttl: Duration, drift_factor: f64, node_timeout: Duration) -> bool {
    ttl > drift(ttl, drift_factor) + node_timeout
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn validity_counts_from_the_send() {
        let sent = Instant::now();
        let v = Validity::from_send(sent, ms(10_000), 0.01, ms(500));
        assert_eq!(v.valid_until, sent + ms(10_000 - 102));
        assert_eq!(v.lost_at, sent + ms(10_000 - 102 - 500));
    }

    #[test]
    fn validity_never_precedes_the_send() {
        let sent = Instant::now();
        let v = Validity::from_send(sent, ms(3), 0.01, ms(500));
        assert_eq!(v.lost_at, sent);
        assert!(v.valid_until >= sent);
        assert!(!usable_ttl(ms(500), 0.01, ms(500)));
        assert!(usable_ttl(ms(600), 0.01, ms(500)));
    }

    #[test]
    fn renewal_comes_before_loss_for_keepalive_ttls() {
        for node_timeout in [ms(10), ms(200), ms(500), ms(2_000)] {
            for factor in [0.0, 0.01, 0.1] {
                let min = min_keepalive_ttl(factor, node_timeout);
                let sent = Instant::now();
                let v = Validity::from_send(sent, min, factor, node_timeout);
                let renew = renew_at(sent, min);
                // A full node timeout fits between the renewal and the loss deadline.
                assert!(
                    renew + node_timeout <= v.lost_at,
                    "{node_timeout:?} {factor}"
                );
            }
        }
    }

    #[test]
    fn retry_delay_is_bounded() {
        assert_eq!(retry_delay(ms(40)), ms(5));
        assert_eq!(retry_delay(ms(2_000)), ms(100));
        assert_eq!(retry_delay(ms(60_000)), ms(250));
    }

    #[test]
    fn ns_round_trip() {
        let t = Instant::now() + ms(1234);
        let back = from_ns(to_ns(t));
        assert!(back <= t && t - back < Duration::from_micros(1));
    }
}
