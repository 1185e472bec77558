//! Quorum arithmetic for Redlock operations (antirez, "Distributed Locks with
//! Redis"): how node answers add up, when an outcome is decided, and what it is.

/// How one node's answer counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Vote {
    /// The node did what was asked (for a release: the lease is gone from it).
    Yes,
    /// The node answered, and the answer does not count: another holder has
    /// the key ([`Vote::Held`] when it says so), the key is missing, or the
    /// node restarted since it granted.
    No,
    /// The node answered that another owner holds the key.
    Held,
    /// No usable answer: it failed, timed out or was not asked. Its command
    /// may still be applied.
    Unknown,
}

/// The votes counted so far in one fan-out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Tally {
    pub(crate) nodes: usize,
    pub(crate) quorum: usize,
    /// Nodes that did what was asked.
    pub(crate) yes: usize,
    /// Of those, nodes that changed something (a release that deleted the key).
    pub(crate) changed: usize,
    /// Nodes that answered that another owner holds the key.
    pub(crate) held: usize,
    /// Nodes whose answer is unusable.
    pub(crate) unknown: usize,
    /// Nodes not heard from yet.
    pub(crate) outstanding: usize,
}

/// What an acquire attempt amounts to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AcquireVerdict {
    /// A quorum granted.
    Granted,
    /// No quorum, and the nodes that another owner holds are enough on their
    /// own to keep any quorum from forming: contention.
    Contended,
    /// No quorum because nodes failed or did not answer: with them, a quorum
    /// could have formed.
    Failed,
}

/// What an extension amounts to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExtendVerdict {
    /// A quorum confirmed.
    Confirmed,
    /// Enough nodes answered "not held" that no quorum can hold the lock.
    Refused,
    /// No quorum either way: nodes failed or did not answer.
    Unknown,
}

impl Tally {
    /// A fan-out to `targets` of `nodes`, with `prior` yes votes already known
    /// (nodes that confirmed an earlier release of the same lease).
    pub(crate) fn new(nodes: usize, targets: usize) -> Self {
        Tally {
            nodes,
            quorum: nodes / 2 + 1,
            outstanding: targets,
            ..Tally::default()
        }
    }

    pub(crate) fn add(&mut self, vote: Vote, changed: bool) {
        self.outstanding = self.outstanding.saturating_sub(1);
        match vote {
            Vote::Yes => {
                self.yes += 1;
                if changed {
                    self.changed += 1;
                }
            }
            Vote::Held => self.held += 1,
            // An answer that does not count: it only stops being outstanding.
            Vote::No => {}
            Vote::Unknown => self.unknown += 1,
        }
    }

    /// A quorum said yes, or too few nodes are left to make one.
    pub(crate) fn decided(&self) -> bool {
        self.yes >= self.quorum || self.yes + self.outstanding < self.quorum
    }

    pub(crate) fn acquire(&self) -> AcquireVerdict {
        if self.yes >= self.quorum {
            AcquireVerdict::Granted
        } else if self.nodes - self.held < self.quorum {
            AcquireVerdict::Contended
        } else {
            AcquireVerdict::Failed
        }
    }

    pub(crate) fn extend(&self) -> ExtendVerdict {
        if self.yes >= self.quorum {
            ExtendVerdict::Confirmed
        } else if self.yes + self.unknown + self.outstanding < self.quorum {
            ExtendVerdict::Refused
        } else {
            ExtendVerdict::Unknown
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decided_as_soon_as_possible() {
        let mut t = Tally::new(5, 5);
        t.add(Vote::Yes, false);
        t.add(Vote::Yes, false);
        assert!(!t.decided());
        t.add(Vote::Yes, false);
        assert!(t.decided(), "three grants decide, two nodes still out");
        assert_eq!(t.acquire(), AcquireVerdict::Granted);

        let mut t = Tally::new(5, 5);
        t.add(Vote::No, false);
        t.add(Vote::Unknown, false);
        assert!(!t.decided());
        t.add(Vote::No, false);
        assert!(t.decided(), "two nodes left cannot make three");
    }

    #[test]
    fn contention_only_when_holders_alone_block_a_quorum() {
        // One node held, the rest down: the down nodes could have granted.
        let mut t = Tally::new(5, 5);
        t.add(Vote::Held, false);
        for _ in 0..4 {
            t.add(Vote::Unknown, false);
        }
        assert_eq!(t.acquire(), AcquireVerdict::Failed);
        // Three of five held: no quorum was possible.
        let mut t = Tally::new(5, 5);
        for _ in 0..3 {
            t.add(Vote::Held, false);
        }
        t.add(Vote::Unknown, false);
        t.add(Vote::Yes, false);
        assert_eq!(t.acquire(), AcquireVerdict::Contended);
        // Two held and one down of three... two held of three block it.
        let mut t = Tally::new(3, 3);
        t.add(Vote::Held, false);
        t.add(Vote::Held, false);
        t.add(Vote::Unknown, false);
        assert_eq!(t.acquire(), AcquireVerdict::Contended);
        // Two held of five: the other three could have made a quorum.
        let mut t = Tally::new(5, 5);
        t.add(Vote::Held, false);
        t.add(Vote::Held, false);
        for _ in 0..3 {
            t.add(Vote::Unknown, false);
        }
        assert_eq!(t.acquire(), AcquireVerdict::Failed);
    }

    #[test]
    fn extension_verdicts() {
        let mut t = Tally::new(3, 3);
        t.add(Vote::Yes, false);
        t.add(Vote::Unknown, false);
        t.add(Vote::Unknown, false);
        assert_eq!(t.extend(), ExtendVerdict::Unknown);
        let mut t = Tally::new(3, 3);
        t.add(Vote::No, false);
        t.add(Vote::No, false);
        assert_eq!(t.extend(), ExtendVerdict::Refused);
        assert!(t.decided());
        // Confirmed by one, unknown on one, refused by one: the unknown node
        // may have applied it, which makes two of three.
        let mut t = Tally::new(3, 3);
        t.add(Vote::Yes, false);
        t.add(Vote::Unknown, false);
        t.add(Vote::No, false);
        assert_eq!(t.extend(), ExtendVerdict::Unknown);
        // One yes and two unknown of five, two refused: a quorum is possible.
        let mut t = Tally::new(5, 5);
        t.add(Vote::Yes, false);
        t.add(Vote::Unknown, false);
        t.add(Vote::Unknown, false);
        t.add(Vote::No, false);
        t.add(Vote::No, false);
        assert_eq!(t.extend(), ExtendVerdict::Unknown);
    }
}
