//! One Redlock acquire attempt and the evidence it returns.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::Group;
use super::guard::RedlockGuard;
use crate::core::quorum::AcquireVerdict;
use crate::core::redlock::{NodeLease, Op, acquired, validity};
use crate::error::{Error, Result};
use crate::report::{NodeOutcome, NodeReport};
use crate::token::{HolderTag, OwnerToken};

/// Who reads the nodes' answers of an attempt that got the lock.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Evidence {
    /// The attempt and its guard (each has its own copy).
    Both,
    /// The guard alone: the attempt is turned into its result at once.
    Guard,
}

impl Group {
    pub(super) fn attempt(
        this: &Arc<Group>,
        key: &str,
        ttl: Duration,
        evidence: Evidence,
        holder: Option<&HolderTag>,
    ) -> Result<RedlockAttempt> {
        let ttl_ms = this.check_ttl(ttl)?;
        let keys = this.physical_keys(key, "redlock key")?;
        let owner = OwnerToken::held_by(holder);
        let lease = Arc::new(NodeLease::new(keys, owner.as_str().to_owned()));
        let targets = this.all();
        let sent = this.now();
        let deadline = sent + this.timing.node_timeout;
        let (replies, tally) = this.fan_out(
            Op::Acquire { ttl_ms },
            &lease,
            &targets,
            deadline,
            None,
            |t| t.decided(),
        );
        let elapsed = this.now().saturating_duration_since(sent);
        // Failures that trying again will not cure, on enough nodes that no
        // quorum can form without them: the attempt's error is theirs.
        let permanent: Vec<&Arc<Error>> = replies
            .iter()
            .flatten()
            .filter_map(|r| r.permanent.as_ref())
            .collect();
        let permanent = (this.len() - permanent.len() < this.quorum)
            .then(|| permanent.first().and_then(|e| e.duplicate_permanent()))
            .flatten();
        let heard = this.answers(replies, &targets, deadline, &NodeOutcome::Abandoned);
        let ttl = Duration::from_millis(ttl_ms);
        let validity = validity(ttl, elapsed, this.timing.drift_factor);
        let verdict = tally.acquire();
        let granted = verdict == AcquireVerdict::Granted;
        let (guard, nodes) = if acquired(&tally, validity) {
            let nodes = match evidence {
                Evidence::Both => this.named(&heard),
                Evidence::Guard => Vec::new(),
            };
            let guard = RedlockGuard::granted(this, key, lease, sent, ttl, heard);
            (Some(guard), nodes)
        } else {
            this.clean_up(&lease);
            (None, this.named(&heard))
        };
        Ok(RedlockAttempt {
            guard,
            nodes,
            elapsed,
            validity: if granted { validity } else { Duration::ZERO },
            quorum: this.quorum,
            granted: tally.yes,
            verdict,
            permanent,
        })
    }
}

/// The result of one [`RedlockGroup::attempt`](crate::RedlockGroup::attempt): the guard if a quorum granted,
/// and what every node answered.
#[must_use = "if unused, an acquired lock is released immediately"]
pub struct RedlockAttempt {
    guard: Option<RedlockGuard>,
    nodes: Vec<NodeReport>,
    elapsed: Duration,
    validity: Duration,
    quorum: usize,
    granted: usize,
    verdict: AcquireVerdict,
    /// What keeps a quorum out of reach for good, when nodes failed that way.
    permanent: Option<Error>,
}

impl RedlockAttempt {
    /// Whether the lock was acquired.
    pub fn is_acquired(&self) -> bool {
        self.guard.is_some()
    }

    /// Whether any node reported another holder.
    pub fn is_contended(&self) -> bool {
        self.nodes
            .iter()
            .any(|n| matches!(n.outcome, NodeOutcome::HeldByAnother { .. }))
    }

    /// The guard, when acquired.
    pub fn guard(&self) -> Option<&RedlockGuard> {
        self.guard.as_ref()
    }

    /// Takes the guard out, when acquired.
    pub fn into_guard(self) -> Option<RedlockGuard> {
        self.guard
    }

    /// Every node's answer, in the group's order.
    pub fn nodes(&self) -> &[NodeReport] {
        &self.nodes
    }

    /// How many nodes granted before the outcome was decided.
    pub fn granted(&self) -> usize {
        self.granted
    }

    /// How many nodes had to grant.
    pub fn quorum(&self) -> usize {
        self.quorum
    }

    /// From the first send to the decision, on the local monotonic clock.
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }

    /// `ttl − elapsed − (ttl × drift + 2 ms)` at the decision; zero when no
    /// quorum granted.
    pub fn validity(&self) -> Duration {
        self.validity
    }

    /// What [`try_acquire`](crate::Lease::try_acquire) of the group's lock
    /// returns for this attempt: the guard,
    /// `None` on contention (the nodes another owner holds are enough on their
    /// own to keep a quorum from forming), or the error that kept a quorum
    /// from forming (nodes down, slow or failing, even when some node also
    /// reported another holder).
    ///
    /// # Errors
    /// As [`try_acquire`](crate::Lease#redlock).
    pub fn into_result(self) -> Result<Option<RedlockGuard>> {
        if self.guard.is_some() {
            return Ok(self.guard);
        }
        if self.verdict == AcquireVerdict::Contended {
            return Ok(None);
        }
        if let Some(e) = self.permanent {
            return Err(e);
        }
        if self.granted >= self.quorum {
            return Err(Error::Timeout {
                op: "acquire (the attempt used up the lease's validity)",
                after: self.elapsed,
            });
        }
        Err(Error::QuorumNotReached {
            op: "acquire",
            confirmed: self.granted,
            needed: self.quorum,
            nodes: self.nodes,
        })
    }
}

impl fmt::Debug for RedlockAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockAttempt")
            .field("acquired", &self.is_acquired())
            .field("granted", &self.granted)
            .field("quorum", &self.quorum)
            .field("elapsed", &self.elapsed)
            .field("validity", &self.validity)
            .field("nodes", &self.nodes)
            .finish()
    }
}
