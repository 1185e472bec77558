//! The holder's own extension (`reset_expiry`) as a sans-I/O state machine:
//! claim the lease (waiting at most a node timeout for an extension already
//! in flight), send, settle the reply. The guard drives it with a blocking
//! call and the simulation with model events; neither decides anything
//! itself.
//!
//! One rule is its own: an answer from a server that was replaced while the
//! extension ran (a confirmation whose claim a switch gave up, or one the
//! transport saw come from a retired server) counts for nothing, so the
//! extension is claimed and sent once more, to the server the key lives on
//! now. Never under the old claim: by then another extension (a keep-alive
//! renewal) may hold the lease's claim, and two extensions of one lease must
//! not overlap. A second switch during that send ends it unconfirmed.

use std::time::{Duration, Instant};

use crate::core::executor::{Claim, ExtendReply, Settled, settle};
use crate::core::lease::{Refusal, Ticket};

/// One `reset_expiry` call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ResetExpiry {
    ttl: Duration,
    /// Until when an extension in flight is waited for.
    wait_until: Instant,
    /// Whether this is the second send, after a stale confirmation.
    again: bool,
}

/// What the driver does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ResetStep {
    /// Send the extension under this claim.
    Send(Ticket),
    /// Another extension of the lease is in flight: wait for its claim to be
    /// freed, until this instant at the latest, then [`ResetExpiry::claim`]
    /// again.
    Wait(Instant),
    /// Finished.
    Done(ResetDone),
}

/// How a `reset_expiry` ended (the answer the caller gets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ResetDone {
    /// Confirmed by the server the key lives on: `true`.
    Held,
    /// Lost (refused, confirmed too late, or lost before): `false`.
    Lost,
    /// Not run (an error reply that changed nothing): whether the lease is
    /// still held, `true` or `false` as its bound says.
    NotRun(bool),
    /// The extension in flight was still unresolved when the wait ended:
    /// nothing sent.
    StillClaimed,
    /// Confirmed twice by servers that were replaced while it ran: not
    /// counted.
    SwitchedTwice,
    /// It ran with an effect that cannot be read; its worst case stands.
    Unreadable,
    /// The primary applied it, but too few replicas acknowledged it: not
    /// counted, its worst case stands.
    Unreplicated,
}

impl ResetExpiry {
    /// A call made at `now` to extend to `ttl`, which waits at most
    /// `node_timeout` for an extension in flight.
    pub(crate) fn new(now: Instant, ttl: Duration, node_timeout: Duration) -> Self {
        ResetExpiry {
            ttl,
            wait_until: now + node_timeout,
            again: false,
        }
    }

    /// The TTL the extension sets (read by the simulation's clients).
    #[cfg(test)]
    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Claims the lease at `now` (the instant the extension is sent).
    pub(crate) fn claim<L: Claim + ?Sized>(&mut self, lease: &L, now: Instant) -> ResetStep {
        match lease.begin_extend(now, self.ttl) {
            Ok(ticket) => ResetStep::Send(ticket),
            Err(Refusal::Lost) => ResetStep::Done(ResetDone::Lost),
            Err(Refusal::Busy) if now < self.wait_until => ResetStep::Wait(self.wait_until),
            Err(Refusal::Busy) => ResetStep::Done(ResetDone::StillClaimed),
        }
    }

    /// The server replied to the extension sent under `ticket`, at `now`.
    pub(crate) fn replied<L: Claim>(
        &mut self,
        lease: &L,
        ticket: Ticket,
        reply: ExtendReply,
        now: Instant,
    ) -> ResetStep {
        ResetStep::Done(match settle(lease, ticket, reply, now) {
            Settled::Held => ResetDone::Held,
            Settled::Lost => ResetDone::Lost,
            Settled::Stale => return self.once_more(lease, now),
            Settled::NotRun => ResetDone::NotRun(!lease.is_lost(now)),
            Settled::Unreadable => ResetDone::Unreadable,
            Settled::Unreplicated => ResetDone::Unreplicated,
        })
    }

    /// The extension sent under `ticket` was answered by a server that had
    /// been replaced meanwhile (the transport saw it retired): whatever it
    /// said counts for nothing, and the command can no longer be applied
    /// anywhere. Its claim is given up, its worst case kept in the bound (as
    /// at a switch), and the extension is claimed and sent once more.
    pub(crate) fn replaced<L: Claim>(
        &mut self,
        lease: &L,
        ticket: Ticket,
        now: Instant,
    ) -> ResetStep {
        lease.fenced(ticket, now);
        self.once_more(lease, now)
    }

    fn once_more<L: Claim>(&mut self, lease: &L, now: Instant) -> ResetStep {
        if self.again {
            return ResetStep::Done(ResetDone::SwitchedTwice);
        }
        self.again = true;
        self.claim(lease, now)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use parking_lot::Mutex;

    use super::*;
    use crate::core::executor::tests::L;
    use crate::core::lease::LeaseCore;
    use crate::core::timing::Timing;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn lease(t0: Instant, ttl_ms: u64) -> L {
        let timing = Timing {
            drift_factor: 0.0,
            node_timeout: ms(100),
        };
        L(Arc::new(Mutex::new(LeaseCore::granted(
            timing,
            t0,
            ms(ttl_ms),
        ))))
    }

    fn sent(step: ResetStep) -> Ticket {
        match step {
            ResetStep::Send(t) => t,
            other => panic!("expected a send, got {other:?}"),
        }
    }

    #[test]
    fn a_confirmation_moves_the_bound_and_a_refusal_loses() {
        let t0 = Instant::now();
        let l = lease(t0, 1_000);
        let mut r = ResetExpiry::new(t0, ms(5_000), ms(100));
        let t = sent(r.claim(&l, t0));
        let step = r.replied(&l, t, ExtendReply::Extended, t0 + ms(2));
        assert_eq!(step, ResetStep::Done(ResetDone::Held));
        assert_eq!(l.0.lock().valid_until(), t0 + ms(4_998));
        let mut r = ResetExpiry::new(t0, ms(5_000), ms(100));
        let t = sent(r.claim(&l, t0 + ms(10)));
        let step = r.replied(&l, t, ExtendReply::Gone, t0 + ms(12));
        assert_eq!(step, ResetStep::Done(ResetDone::Lost));
        assert!(l.is_lost(t0 + ms(12)));
        // Lost: nothing more is sent.
        let mut r = ResetExpiry::new(t0, ms(5_000), ms(100));
        assert_eq!(r.claim(&l, t0 + ms(20)), ResetStep::Done(ResetDone::Lost));
    }

    #[test]
    fn an_extension_in_flight_is_waited_for_a_node_timeout_at_most() {
        let t0 = Instant::now();
        let l = lease(t0, 1_000);
        let renewal = l.begin_extend(t0, ms(1_000)).unwrap();
        let mut r = ResetExpiry::new(t0 + ms(10), ms(5_000), ms(100));
        assert_eq!(r.claim(&l, t0 + ms(10)), ResetStep::Wait(t0 + ms(110)));
        assert_eq!(r.claim(&l, t0 + ms(109)), ResetStep::Wait(t0 + ms(110)));
        assert_eq!(
            r.claim(&l, t0 + ms(110)),
            ResetStep::Done(ResetDone::StillClaimed)
        );
        // Freed in time: sent.
        let mut r = ResetExpiry::new(t0 + ms(10), ms(5_000), ms(100));
        assert_eq!(r.claim(&l, t0 + ms(10)), ResetStep::Wait(t0 + ms(110)));
        l.not_sent(renewal, t0 + ms(50));
        sent(r.claim(&l, t0 + ms(50)));
    }

    #[test]
    fn a_confirmation_a_switch_made_stale_is_sent_once_more_with_a_claim_of_its_own() {
        let t0 = Instant::now();
        let l = lease(t0, 1_000);
        let mut r = ResetExpiry::new(t0, ms(30_000), ms(100));
        let first = sent(r.claim(&l, t0 + ms(10)));
        // The deployment switched while it ran: the claim is given up.
        assert!(l.0.lock().switched(None));
        let second = sent(r.replied(&l, first, ExtendReply::Extended, t0 + ms(20)));
        assert_ne!(first, second);
        assert_eq!(
            l.0.lock().valid_until(),
            t0 + ms(998),
            "the stale one moved nothing"
        );
        let step = r.replied(&l, second, ExtendReply::Extended, t0 + ms(30));
        assert_eq!(step, ResetStep::Done(ResetDone::Held));
        assert_eq!(l.0.lock().valid_until(), t0 + ms(20 + 29_998));
        // Twice: not counted.
        let l = lease(t0, 1_000);
        let mut r = ResetExpiry::new(t0, ms(30_000), ms(100));
        let first = sent(r.claim(&l, t0 + ms(10)));
        assert!(l.0.lock().switched(None));
        let second = sent(r.replied(&l, first, ExtendReply::Extended, t0 + ms(20)));
        assert!(l.0.lock().switched(None));
        let step = r.replied(&l, second, ExtendReply::Extended, t0 + ms(30));
        assert_eq!(step, ResetStep::Done(ResetDone::SwitchedTwice));
        assert_eq!(l.0.lock().valid_until(), t0 + ms(998));
    }

    #[test]
    fn an_answer_from_a_replaced_server_gives_up_the_claim_and_goes_again() {
        let t0 = Instant::now();
        let l = lease(t0, 1_000);
        // A shortening, answered by a server retired meanwhile: the switch
        // has not reached the lease yet, so the claim is still this one's.
        let mut r = ResetExpiry::new(t0, ms(300), ms(100));
        let first = sent(r.claim(&l, t0 + ms(10)));
        let second = sent(r.replaced(&l, first, t0 + ms(20)));
        assert_ne!(first, second);
        // Its worst case stays until a later extension is confirmed.
        assert_eq!(l.0.lock().valid_until(), t0 + ms(10 + 298));
        let step = r.replied(&l, second, ExtendReply::Extended, t0 + ms(30));
        assert_eq!(step, ResetStep::Done(ResetDone::Held));
        assert_eq!(l.0.lock().valid_until(), t0 + ms(20 + 298));
        // The switch came first and a renewal took the claim: the answer
        // frees nothing of the renewal's, and the second send waits for it.
        let l = lease(t0, 1_000);
        let mut r = ResetExpiry::new(t0, ms(300), ms(100));
        let first = sent(r.claim(&l, t0 + ms(10)));
        assert!(l.0.lock().switched(None));
        let renewal = l.begin_extend(t0 + ms(12), ms(1_000)).unwrap();
        assert_eq!(
            r.replaced(&l, first, t0 + ms(20)),
            ResetStep::Wait(t0 + ms(100))
        );
        assert!(l.0.lock().is_claimed(), "the renewal's claim stands");
        assert_eq!(
            l.extended(renewal, t0 + ms(22)),
            crate::core::lease::Confirmed::Held
        );
        sent(r.claim(&l, t0 + ms(22)));
        // Twice: not counted.
        let l = lease(t0, 1_000);
        let mut r = ResetExpiry::new(t0, ms(300), ms(100));
        let first = sent(r.claim(&l, t0 + ms(10)));
        let second = sent(r.replaced(&l, first, t0 + ms(20)));
        assert_eq!(
            r.replaced(&l, second, t0 + ms(30)),
            ResetStep::Done(ResetDone::SwitchedTwice)
        );
    }

    #[test]
    fn an_error_reply_changes_nothing_and_an_unreadable_one_keeps_its_worst_case() {
        let t0 = Instant::now();
        let l = lease(t0, 1_000);
        let mut r = ResetExpiry::new(t0, ms(5_000), ms(100));
        let t = sent(r.claim(&l, t0 + ms(10)));
        let step = r.replied(&l, t, ExtendReply::NotRun, t0 + ms(12));
        assert_eq!(step, ResetStep::Done(ResetDone::NotRun(true)));
        assert!(!l.0.lock().is_claimed());
        // Shorter, unreadable: the shorter bound stands.
        let mut r = ResetExpiry::new(t0, ms(300), ms(100));
        let t = sent(r.claim(&l, t0 + ms(20)));
        let step = r.replied(&l, t, ExtendReply::Unreadable, t0 + ms(22));
        assert_eq!(step, ResetStep::Done(ResetDone::Unreadable));
        assert_eq!(l.0.lock().valid_until(), t0 + ms(20 + 298));
        // Past its bound, an error reply answers false.
        let mut r = ResetExpiry::new(t0, ms(5_000), ms(100));
        let late = t0 + ms(990);
        let t = sent(r.claim(&l, t0 + ms(200)));
        assert_eq!(
            r.replied(&l, t, ExtendReply::NotRun, late),
            ResetStep::Done(ResetDone::NotRun(false))
        );
    }
}
