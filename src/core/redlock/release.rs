//! The release of one lease across the nodes, over as many calls as it
//! takes.

use crate::core::quorum::{Tally, Vote};
use crate::report::NodeOutcome;

/// What a node's confirmed release found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Found {
    /// The lease, deleted now.
    Deleted,
    /// Nothing: the key was gone.
    Gone,
    /// Another owner's value, left alone.
    Another,
}

/// The release of one lease, over as many calls as it takes: which nodes
/// confirmed (and what they found then), when a call's answers are enough,
/// and what the release amounts to.
#[derive(Clone, Debug)]
pub(crate) struct Release {
    /// Per node, once a release confirmed it: what it found then.
    released: Vec<Option<Found>>,
    quorum: usize,
    /// The result, once a quorum confirmed.
    outcome: Option<bool>,
}

impl Release {
    pub(crate) fn new(nodes: usize) -> Self {
        Release {
            released: vec![None; nodes],
            quorum: nodes / 2 + 1,
            outcome: None,
        }
    }

    /// The result, once a quorum confirmed (for the tests' checks).
    #[cfg(test)]
    pub(crate) fn outcome(&self) -> Option<bool> {
        self.outcome
    }

    /// The nodes this call sends the release to: those that have not
    /// confirmed.
    pub(crate) fn targets(&self) -> Vec<usize> {
        (0..self.released.len())
            .filter(|&i| self.released[i].is_none())
            .collect()
    }

    /// Whether this call's answers so far (`tally`, over the targets) decide
    /// the result, with the confirmations of earlier calls.
    pub(crate) fn is_decided(&self, tally: &Tally) -> bool {
        let yes = self.confirmed() + tally.yes;
        let deleted = self.deleted() + tally.changed;
        let q = self.quorum;
        deleted >= q || (yes >= q && deleted + tally.outstanding < q) || yes + tally.outstanding < q
    }

    /// Node `node` answered.
    pub(crate) fn handle_answer(&mut self, node: usize, vote: Vote, outcome: &NodeOutcome) {
        if vote == Vote::Yes {
            self.released[node] = Some(match outcome {
                NodeOutcome::Granted => Found::Deleted,
                NodeOutcome::HeldByAnother { .. } => Found::Another,
                _ => Found::Gone,
            });
        }
    }

    /// Whether a quorum of the nodes that confirmed found another owner's
    /// value: the lease was taken over.
    pub(crate) fn taken_over(&self) -> bool {
        let others = self.released.iter().filter(|r| **r == Some(Found::Another));
        others.count() >= self.quorum
    }

    /// The call's answers are in: `Ok` with the result (`true`: a quorum
    /// deleted the key) once a quorum confirmed, otherwise `Err` with how
    /// many did.
    pub(crate) fn conclude(&mut self) -> Result<bool, usize> {
        if let Some(outcome) = self.outcome {
            return Ok(outcome);
        }
        let yes = self.confirmed();
        if yes >= self.quorum {
            let outcome = self.deleted() >= self.quorum;
            self.outcome = Some(outcome);
            return Ok(outcome);
        }
        Err(yes)
    }

    /// The nodes that confirmed (for the simulation's checks).
    #[cfg(test)]
    pub(crate) fn confirmed_nodes(&self) -> Vec<usize> {
        (0..self.released.len())
            .filter(|&i| self.released[i].is_some())
            .collect()
    }

    fn confirmed(&self) -> usize {
        self.released.iter().flatten().count()
    }

    fn deleted(&self) -> usize {
        self.released
            .iter()
            .filter(|r| **r == Some(Found::Deleted))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_counts_only_what_confirmed() {
        let mut r = Release::new(3);
        // One call: node 0 deleted the key, node 1 did not answer.
        let mut t = Tally::new(3, 3);
        t.add(Vote::Yes, true);
        t.add(Vote::Unknown, false);
        assert!(!r.is_decided(&t), "node 2 may still make a quorum");
        r.handle_answer(0, Vote::Yes, &NodeOutcome::Granted);
        r.handle_answer(1, Vote::Unknown, &NodeOutcome::TimedOut);
        assert_eq!(r.conclude(), Err(1), "one confirmation is not a quorum");
        assert_eq!(r.targets(), vec![1, 2]);
        // The next call counts node 0's confirmation from the first.
        let mut t = Tally::new(3, 2);
        t.add(Vote::Yes, true);
        assert!(r.is_decided(&t));
        r.handle_answer(2, Vote::Yes, &NodeOutcome::Granted);
        assert_eq!(r.conclude(), Ok(true));
        assert_eq!(r.outcome(), Some(true));
        assert!(!r.taken_over());
    }

    #[test]
    fn a_quorum_that_found_another_owner_took_it_over() {
        let mut r = Release::new(3);
        let another = NodeOutcome::HeldByAnother { remaining: None };
        r.handle_answer(0, Vote::Yes, &another);
        r.handle_answer(1, Vote::Yes, &NodeOutcome::Missing);
        assert_eq!(r.conclude(), Ok(false), "two of three answered: a quorum");
        assert!(!r.taken_over(), "one of three is not a quorum");
        r.handle_answer(2, Vote::Yes, &another);
        assert_eq!(r.conclude(), Ok(false));
        assert!(r.taken_over());
    }

    #[test]
    fn a_release_is_decided_once_no_answer_left_can_change_it() {
        // One call's answers: each vote, and whether that node deleted the key.
        type Answers = [(Vote, bool)];
        let call = |targets: usize, answers: &Answers| {
            let mut t = Tally::new(3, targets);
            for &(vote, deleted) in answers {
                t.add(vote, deleted);
            }
            t
        };
        let (yes, kept, lost) = (
            (Vote::Yes, true),
            (Vote::Yes, false),
            (Vote::Unknown, false),
        );
        let r = Release::new(3);
        assert_eq!(r.outcome(), None);
        let first_calls: [(&Answers, bool, &str); 6] = [
            (&[yes], false, "two more may delete"),
            (&[yes, yes], true, "a quorum deleted"),
            (
                &[yes, kept],
                false,
                "the third may make a quorum that deleted",
            ),
            (
                &[kept, kept],
                true,
                "a quorum confirmed; no quorum can delete",
            ),
            (&[lost, lost], true, "no quorum can confirm"),
            (&[kept, lost], false, "the third may make a quorum"),
        ];
        for (answers, decided, why) in first_calls {
            assert_eq!(r.is_decided(&call(3, answers)), decided, "{why}");
        }
        // A second call, to nodes 1 and 2, after node 0 confirmed.
        let mut deleted_before = Release::new(3);
        deleted_before.handle_answer(0, Vote::Yes, &NodeOutcome::Granted);
        assert!(deleted_before.is_decided(&call(2, &[yes])), "two deleted");
        assert!(
            !deleted_before.is_decided(&call(2, &[lost])),
            "node 2 may make a quorum"
        );
        let mut kept_before = Release::new(3);
        kept_before.handle_answer(0, Vote::Yes, &NodeOutcome::Missing);
        assert!(
            kept_before.is_decided(&call(2, &[kept])),
            "a quorum confirmed; no quorum can delete"
        );
        assert!(
            !kept_before.is_decided(&call(2, &[yes])),
            "node 2 may make a quorum that deleted"
        );
        kept_before.handle_answer(1, Vote::Yes, &NodeOutcome::Missing);
        assert_eq!(
            kept_before.conclude(),
            Ok(false),
            "confirmed, nothing deleted"
        );
        assert_eq!(kept_before.outcome(), Some(false));
    }
}
