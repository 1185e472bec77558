//! The settings of a Redlock group (the checks that refuse unsound ones are
//! `core::redlock`'s).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::observe::Observer;

/// Settings of a [`RedlockGroup`](crate::RedlockGroup). Build it with struct update syntax:
///
/// ```
/// use std::time::Duration;
/// use respire_coordination::RedlockOptions;
///
/// let options = RedlockOptions {
///     node_timeout: Duration::from_millis(20),
///     ..RedlockOptions::default()
/// };
/// assert_eq!(options.drift_factor, 0.01);
/// ```
#[derive(Clone)]
pub struct RedlockOptions {
    /// The longest one node may take to answer one command; connections are
    /// made outside it, in the background. It must be at least twice every
    /// node's round trip (checked when the group is made:
    /// [`Error::NodeTimeoutTooShort`](crate::Error::NodeTimeoutTooShort)) and
    /// well below every TTL used: a TTL is refused unless the node timeout
    /// plus drift is under half of it. See [Choosing the node
    /// timeout](crate::RedlockGroup#choosing-the-node-timeout). Defaults to
    /// 50 ms, enough for nodes up to 25 ms away.
    pub node_timeout: Duration,
    /// The fraction of each TTL written off for clock-rate differences between
    /// this host and the servers (plus 2 ms). Must be in `0.0..1.0` (and not
    /// NaN). Defaults to 0.01.
    pub drift_factor: f64,
    /// When set, no acquire is sent to a server that started less than this
    /// long ago (from `uptime_in_seconds` in `INFO server`, read on every new
    /// connection, counted as if the server started up to a second later), so
    /// that a node restarted without its data cannot grant a lock that another
    /// client may still hold. Set it above your longest TTL. Without it (or
    /// with a delay shorter than a lock has left), a lock is flagged lost as
    /// soon as a node it needs for its quorum goes away or restarts, since the
    /// node may come back empty and grant it again (see
    /// [Restarts](crate::RedlockGroup#restarts)). Defaults to `None`.
    pub restart_delay: Option<Duration>,
    /// The first pause of the bounded waits between attempts; each pause is
    /// random between half and all of a ceiling that starts here and doubles.
    /// Defaults to 10 ms.
    pub retry_base: Duration,
    /// The largest ceiling of the pauses between attempts. Defaults to 200 ms.
    pub retry_max: Duration,
    /// Told what the group's locks do: acquire calls, grants, contention,
    /// ends of waits, renewals, losses and releases (see [`Observer`]; set
    /// it with [`with_observer`](RedlockOptions::with_observer)). Two options
    /// compare equal only if they share the same observer. Defaults to `None`.
    pub observer: Option<Arc<dyn Observer>>,
}

impl RedlockOptions {
    /// These options with `observer`; see [`observer`](RedlockOptions#structfield.observer).
    #[must_use]
    pub fn with_observer(mut self, observer: Arc<dyn Observer>) -> Self {
        self.observer = Some(observer);
        self
    }
}

impl PartialEq for RedlockOptions {
    fn eq(&self, other: &Self) -> bool {
        let same_observer = match (&self.observer, &other.observer) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        self.node_timeout == other.node_timeout
            && self.drift_factor == other.drift_factor
            && self.restart_delay == other.restart_delay
            && self.retry_base == other.retry_base
            && self.retry_max == other.retry_max
            && same_observer
    }
}

impl fmt::Debug for RedlockOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockOptions")
            .field("node_timeout", &self.node_timeout)
            .field("drift_factor", &self.drift_factor)
            .field("restart_delay", &self.restart_delay)
            .field("retry_base", &self.retry_base)
            .field("retry_max", &self.retry_max)
            .field("observer", &self.observer.is_some())
            .finish()
    }
}

impl Default for RedlockOptions {
    fn default() -> Self {
        RedlockOptions {
            node_timeout: Duration::from_millis(50),
            drift_factor: 0.01,
            restart_delay: None,
            retry_base: Duration::from_millis(10),
            retry_max: Duration::from_millis(200),
            observer: None,
        }
    }
}
