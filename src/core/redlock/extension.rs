//! The extension of a lease across the nodes: its verdict applied to the
//! lease's bounds once, and its claim freed once every node's share is
//! finished; the renewal thread's extension built on it.

use std::time::{Duration, Instant};

use crate::core::executor::Claim;
use crate::core::lease::{Loss, Ticket};
use crate::core::quorum::{ExtendVerdict, Tally, Vote};
use crate::core::timing::retry_delay;
use crate::report::NodeOutcome;

/// One extension of a lease across the nodes: the answers counted as they
/// come, one verdict applied to the lease once it is decided (or at the
/// deadline), and the claim of an extension without a verdict freed once
/// every node's share is finished, from when each node runs a later
/// extension after this one or not at all.
#[derive(Debug)]
pub(crate) struct Extension {
    ticket: Ticket,
    tally: Tally,
    verdict: Option<ExtendVerdict>,
}

impl Extension {
    /// An extension claimed with `ticket`, sent to `targets` of `nodes`.
    pub(crate) fn new(ticket: Ticket, nodes: usize, targets: usize) -> Self {
        Extension {
            ticket,
            tally: Tally::new(nodes, targets),
            verdict: None,
        }
    }

    /// An extension claimed with `ticket` whose answers were counted in
    /// `tally`.
    pub(crate) fn counted(ticket: Ticket, tally: Tally) -> Self {
        Extension {
            ticket,
            tally,
            verdict: None,
        }
    }

    /// One node's answer.
    pub(crate) fn handle_answer(&mut self, vote: Vote, outcome: &NodeOutcome) {
        self.tally.add(vote, *outcome == NodeOutcome::Granted);
    }

    /// Whether the answers decide the verdict (a quorum, too few left, or
    /// every node answered) and it is not settled yet.
    pub(crate) fn is_due(&self) -> bool {
        self.verdict.is_none() && (self.tally.decided() || self.tally.outstanding == 0)
    }

    /// Every node's share is finished.
    pub(crate) fn is_finished(&self) -> bool {
        self.tally.outstanding == 0
    }

    /// Applies the verdict the answers so far reach to `lease` at `now` (at
    /// the decision, or at the deadline), once; `refusal` says why a refused
    /// one is lost.
    pub(crate) fn settle(
        &mut self,
        lease: &impl Claim,
        now: Instant,
        refusal: impl FnOnce() -> String,
    ) -> ExtendVerdict {
        if let Some(verdict) = self.verdict {
            return verdict;
        }
        let verdict = self.tally.extend();
        match verdict {
            ExtendVerdict::Confirmed => {
                lease.extended(self.ticket, now);
            }
            ExtendVerdict::Refused => lease.refused(self.ticket, now, Loss::Other(refusal())),
            ExtendVerdict::Unknown => lease.unanswered(self.ticket, now),
        }
        self.verdict = Some(verdict);
        verdict
    }

    /// Every node's share is finished at `now`: an extension without a
    /// verdict frees its claim. Returns whether it did.
    pub(crate) fn finish(&self, lease: &impl Claim, now: Instant) -> bool {
        let fence = self.verdict == Some(ExtendVerdict::Unknown);
        if fence {
            lease.fenced(self.ticket, now);
        }
        fence
    }
}

/// The renewal thread's extension of one lease by its TTL: claimed like any
/// extension, bounded by a node timeout (or the loss deadline, if sooner),
/// settled when its answers decide (it has no deadline of its own: every
/// node's job answers by its own), and planned again: as usual after a
/// verdict, after a retry delay when it reached none, and once more when
/// every node's share is finished and its claim freed.
#[derive(Debug)]
pub(crate) struct QuorumRenewal {
    extension: Extension,
    retry: Duration,
}

impl QuorumRenewal {
    /// The renewal of `lease` to `ttl` the schedule claimed at `now` with
    /// `ticket`, sent to every one of `nodes`: the renewal and its deadline.
    pub(crate) fn new(
        lease: &impl Claim,
        (ticket, ttl): (Ticket, Duration),
        now: Instant,
        node_timeout: Duration,
        nodes: usize,
    ) -> (QuorumRenewal, Instant) {
        let deadline = (now + node_timeout).min(lease.lost_at());
        let renewal = QuorumRenewal {
            extension: Extension::new(ticket, nodes, nodes),
            retry: retry_delay(ttl),
        };
        (renewal, deadline)
    }

    /// One node's answer.
    pub(crate) fn handle_answer(&mut self, vote: Vote, outcome: &NodeOutcome) {
        self.extension.handle_answer(vote, outcome);
    }

    /// See [`Extension::is_due`].
    pub(crate) fn is_due(&self) -> bool {
        self.extension.is_due()
    }

    /// See [`Extension::is_finished`].
    pub(crate) fn is_finished(&self) -> bool {
        self.extension.is_finished()
    }

    /// Settles it (see [`Extension::settle`]): the verdict, and when to try
    /// again if it reached none.
    pub(crate) fn settle(
        &mut self,
        lease: &impl Claim,
        now: Instant,
        refusal: impl FnOnce() -> String,
    ) -> (ExtendVerdict, Option<Instant>) {
        let verdict = self.extension.settle(lease, now, refusal);
        let retry = (verdict == ExtendVerdict::Unknown).then(|| now + self.retry);
        (verdict, retry)
    }

    /// Every node's share is finished (see [`Extension::finish`]): when to
    /// try again, if it freed a claim.
    pub(crate) fn finish(&self, lease: &impl Claim, now: Instant) -> Option<Instant> {
        self.extension.finish(lease, now).then(|| now + self.retry)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use parking_lot::Mutex;

    use crate::core::executor::tests::L;
    use crate::core::lease::{Confirmed, Refusal};
    use crate::core::timing::drift;

    use super::*;

    /// What an extension did to a lease's bounds, in order.
    #[derive(Default)]
    struct Seen(std::cell::RefCell<Vec<&'static str>>);

    /// Only the transitions an extension's verdict makes are recorded; the
    /// rest are never called on it.
    impl Claim for Seen {
        fn id(&self) -> u64 {
            unreachable!()
        }
        fn ttl(&self) -> Duration {
            unreachable!()
        }
        fn lost_at(&self) -> Instant {
            unreachable!()
        }
        fn is_lost(&self, _: Instant) -> bool {
            unreachable!()
        }
        fn begin_extend(&self, _: Instant, _: Duration) -> Result<Ticket, Refusal> {
            unreachable!()
        }
        fn not_sent(&self, _: Ticket, _: Instant) {
            unreachable!()
        }
        fn unfenceable(&self, _: Ticket, _: Instant) {
            unreachable!()
        }
        fn extended(&self, _: Ticket, _: Instant) -> Confirmed {
            self.0.borrow_mut().push("extended");
            Confirmed::Held
        }
        fn refused(&self, _: Ticket, _: Instant, _: Loss) {
            self.0.borrow_mut().push("refused");
        }
        fn unanswered(&self, _: Ticket, _: Instant) {
            self.0.borrow_mut().push("unanswered");
        }
        fn fenced(&self, _: Ticket, _: Instant) {
            self.0.borrow_mut().push("fenced");
        }
    }

    fn ticket(now: Instant) -> Ticket {
        let timing = crate::core::timing::Timing {
            drift_factor: 0.01,
            node_timeout: Duration::from_millis(50),
        };
        let ttl = Duration::from_secs(10);
        let mut core = crate::core::lease::LeaseCore::granted(timing, now, ttl);
        core.begin_extend(now, ttl).expect("a claim")
    }

    #[test]
    fn an_extension_settles_once_and_frees_its_claim_only_without_a_verdict() {
        let now = Instant::now();
        let granted = NodeOutcome::Granted;
        let timed_out = NodeOutcome::TimedOut;
        // Three of five confirm: decided before the last two answer.
        let seen = Seen::default();
        let mut e = Extension::new(ticket(now), 5, 5);
        for _ in 0..3 {
            assert!(!e.is_due());
            e.handle_answer(Vote::Yes, &granted);
        }
        assert!(e.is_due() && !e.is_finished());
        assert_eq!(e.settle(&seen, now, String::new), ExtendVerdict::Confirmed);
        assert!(!e.is_due(), "settled once");
        e.handle_answer(Vote::Unknown, &timed_out);
        e.handle_answer(Vote::Unknown, &timed_out);
        assert!(e.is_finished());
        assert!(
            !e.finish(&seen, now),
            "a confirmed extension has no claim to free"
        );
        assert_eq!(*seen.0.borrow(), ["extended"]);

        // Two of three unanswered: no verdict, the worst case stands until
        // every node's share is finished.
        let seen = Seen::default();
        let mut e = Extension::new(ticket(now), 3, 3);
        e.handle_answer(Vote::Yes, &granted);
        e.handle_answer(Vote::Unknown, &timed_out);
        assert!(!e.is_due(), "the third node may still make a quorum");
        assert_eq!(e.settle(&seen, now, String::new), ExtendVerdict::Unknown);
        e.handle_answer(Vote::Unknown, &timed_out);
        assert_eq!(e.settle(&seen, now, String::new), ExtendVerdict::Unknown);
        assert!(e.finish(&seen, now));
        assert_eq!(*seen.0.borrow(), ["unanswered", "fenced"]);

        // Two of three refuse: lost.
        let seen = Seen::default();
        let mut e = Extension::new(ticket(now), 3, 3);
        e.handle_answer(Vote::No, &NodeOutcome::Missing);
        e.handle_answer(Vote::Held, &NodeOutcome::HeldByAnother { remaining: None });
        assert!(e.is_due());
        assert_eq!(
            e.settle(&seen, now, || "gone".into()),
            ExtendVerdict::Refused
        );
        assert_eq!(*seen.0.borrow(), ["refused"]);
    }

    #[test]
    fn a_renewal_waits_a_node_timeout_settles_at_a_quorum_and_is_planned_again_without_one() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        let ttl = s(10);
        let timing = crate::core::timing::Timing {
            drift_factor: 0.01,
            node_timeout: ms(50),
        };
        let held = L(Arc::new(Mutex::new(
            crate::core::lease::LeaseCore::granted(timing, t0, ttl),
        )));
        let granted = NodeOutcome::Granted;
        let timed_out = NodeOutcome::TimedOut;
        // Claimed as the schedule claims a due lease, then sent to 3 nodes.
        let begin = |now: Instant| {
            let ticket = held.begin_extend(now, ttl).expect("a claim");
            QuorumRenewal::new(&held, (ticket, ttl), now, ms(50), 3)
        };

        let now = t0 + s(5);
        let (mut r, deadline) = begin(now);
        assert_eq!(deadline, now + ms(50));
        assert!(!r.is_due() && !r.is_finished());
        r.handle_answer(Vote::Yes, &granted);
        assert!(!r.is_due());
        r.handle_answer(Vote::Yes, &granted);
        assert!(r.is_due() && !r.is_finished());
        assert_eq!(
            r.settle(&held, now + ms(2), String::new),
            (ExtendVerdict::Confirmed, None)
        );
        assert_eq!(
            held.0.lock().valid_until(),
            now + ttl - drift(ttl, 0.01),
            "the bound moved"
        );
        r.handle_answer(Vote::Unknown, &timed_out);
        assert!(r.is_finished());
        assert_eq!(r.finish(&held, now + ms(3)), None);

        let now = t0 + s(6);
        let (mut r, _) = begin(now);
        r.handle_answer(Vote::Yes, &granted);
        r.handle_answer(Vote::Unknown, &timed_out);
        assert!(!r.is_due(), "the third node may still make a quorum");
        r.handle_answer(Vote::Unknown, &timed_out);
        assert!(r.is_due() && r.is_finished());
        let settled = now + ms(50);
        assert_eq!(
            r.settle(&held, settled, String::new),
            (ExtendVerdict::Unknown, Some(settled + retry_delay(ttl)))
        );
        assert!(held.0.lock().is_claimed(), "the worst case stands");
        let finished = now + ms(60);
        assert_eq!(r.finish(&held, finished), Some(finished + retry_delay(ttl)));
        assert!(!held.0.lock().is_claimed());

        // Close to the loss deadline, that is the renewal's deadline.
        let late = held.0.lock().lost_at() - ms(10);
        let (_, deadline) = begin(late);
        assert!(deadline < late + ms(50));
        assert_eq!(deadline, held.0.lock().lost_at());
    }
}
