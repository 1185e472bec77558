//! The optional replication guard: `WAIT` after every grant.

use std::time::Duration;

/// Whether grants wait for replicas to acknowledge them.
///
/// Redis replicates asynchronously: a grant the primary acknowledged can be
/// lost in a failover to a replica that had not received it, and the new
/// primary can then grant the same lease again, or issue a fencing token
/// again. With `Report` or `Require`, every acquire attempt pipelines `WAIT
/// n timeout` right after its script on the same connection (one round trip;
/// `WAIT` counts the writes of that connection only), and the guard tells how
/// many replicas acknowledged ([`LeaseGuard::replicas_acknowledged`](crate::LeaseGuard::replicas_acknowledged)).
/// An acknowledgement narrows the window but is not consensus: a replica can
/// acknowledge and still not be the one promoted, and `WAIT` says nothing of
/// persistence. Nor is every acknowledgement real: on Redis 7.0 `WAIT` can
/// count a replica just after its full resynchronisation although it is
/// behind, and the nemesis campaign (`RELIABILITY.md`) saw a failover right
/// then issue fencing tokens again under `Require { replicas: 1 }`. A fenced
/// resource that refuses a token not above the last one it accepted still
/// refuses those repeats; one that accepts an equal token does not.
///
/// Each attempt may take up to `timeout` longer (the node timeout plus
/// `timeout` bounds it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Replication {
    /// No `WAIT` (the default): grants are acknowledged by the primary alone.
    #[default]
    Off,
    /// `WAIT` for every replica the primary listed in `ROLE` when the
    /// connection was made, for at most `timeout`; the guard reports how many
    /// acknowledged. Nothing is refused.
    Report {
        /// How long `WAIT` may block, at least 1 ms.
        timeout: Duration,
    },
    /// `WAIT` for `replicas` acknowledgements, for at most `timeout`; a grant
    /// with fewer is released at once and the acquire fails with
    /// [`Error::NotReplicated`](crate::Error::NotReplicated).
    Require {
        /// How many replicas must acknowledge each grant, at least 1.
        replicas: u32,
        /// How long `WAIT` may block, at least 1 ms.
        timeout: Duration,
    },
}

impl Replication {
    /// How long `WAIT` may add to an attempt.
    pub(crate) fn timeout(&self) -> Duration {
        match self {
            Replication::Off => Duration::ZERO,
            Replication::Report { timeout } | Replication::Require { timeout, .. } => *timeout,
        }
    }
}
