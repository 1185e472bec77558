//! The state of one held lease, as pure transitions over events and instants.
//!
//! A lease's server-side expiry is set by the last command that touched it: the
//! grant, or an extension (`PEXPIRE`, or a new score for a reader or permit).
//! The client never sees that expiry, only when it sent each command and
//! whether a reply came. `LeaseCore` keeps the bound the client can rely on:
//!
//! - A confirmed command sent at `s` with TTL `t` keeps the lease until
//!   `s + t − drift(t)` (the server ran it at `s` or later).
//! - A command whose reply has not come (yet) may still be applied, at any
//!   moment: if it *shortens* the lease it counts from its send time; if it
//!   *extends* it, it counts for nothing. So the bound is the minimum of the
//!   two, from the moment it is sent.
//! - Extensions of one lease never overlap: [`LeaseCore::begin_extend`] claims
//!   the lease, and the claim is released only when the command's effect is
//!   known (a reply) or it can no longer be applied (nothing was sent, or the
//!   connection it was sent on was killed and the kill confirmed:
//!   [`LeaseCore::fenced`]). A command whose effect stayed unknown keeps
//!   bounding the lease until a later command is confirmed.
//! - A reading of the server can only lower the bound: a verification that
//!   found less time left than counted on, or a server clock found to have
//!   run ahead (its expiries come that much earlier). Such a bound is lifted
//!   only by an extension sent after the reading's reply came, which the
//!   server certainly ran after what was read.
//! - A claim remembers the server its command went to: when the lease moves
//!   to another server, only a claim whose command went elsewhere is given up.
//! - Loss is permanent. The lease is lost when the server says so (the key is
//!   gone or has another owner), when its loss deadline — the bound minus one
//!   node timeout — passes, or when a confirmation arrives only after that
//!   deadline.
//!
//! Nothing here reads a clock or touches a socket; the runtime feeds it events
//! with the instant they happened, and the simulation in `src/sim/` drives it
//! through every interleaving a seed can reach.

use std::fmt;
use std::time::{Duration, Instant};

use crate::core::timing::Timing;

/// One command's send time and the TTL it sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub(crate) sent: Instant,
    pub(crate) ttl: Duration,
}

/// Names one extension, so a late event for an older one is ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Ticket(u64);

#[cfg(test)]
impl Ticket {
    /// A ticket for a test's own lease model.
    pub(crate) fn numbered(n: u64) -> Ticket {
        Ticket(n)
    }
}

/// What a confirmed extension did to the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Confirmed {
    /// It counts: the lease is held until its new bound.
    Held,
    /// The lease is lost (released, lost before, or confirmed after its loss
    /// deadline); the confirmation revives nothing.
    Lost,
    /// Its ticket is stale: the claim was given up (a switch to another
    /// server, or a later event for an older extension). The bound did not
    /// move; whether the lease is still held is for its state to say.
    Stale,
}

/// Why a lease is lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Loss {
    /// The loss deadline passed without a confirmed renewal.
    Deadline,
    /// A confirmation came, but only after the loss deadline.
    LateConfirmation,
    /// The server no longer has the lease (expired, deleted, lost in a restart).
    Gone,
    /// Someone else holds the key.
    TakenOver,
    /// Anything else, described.
    Other(String),
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Loss::Deadline => f.write_str("no renewal was confirmed before the loss deadline"),
            Loss::LateConfirmation => {
                f.write_str("a renewal was confirmed only after the loss deadline")
            }
            Loss::Gone => f.write_str("the lease is gone on the server (expired or deleted)"),
            Loss::TakenOver => f.write_str("another owner holds the key"),
            Loss::Other(why) => f.write_str(why),
        }
    }
}

/// What a verification read (`{1, remaining_ms}`, `{0}`, `{-1}`) found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Held, with this long left on the server (`None`: no expiry).
    Held(Option<Duration>),
    /// Not held any more.
    Lost(Loss),
}

impl Verdict {
    /// Reads a verification script's reply; `None` for any other shape.
    pub(crate) fn of(reply: &[i64]) -> Option<Verdict> {
        match reply {
            [1, left] => Some(Verdict::Held(
                u64::try_from(*left).ok().map(Duration::from_millis),
            )),
            [0] => Some(Verdict::Lost(Loss::Gone)),
            [-1] => Some(Verdict::Lost(Loss::TakenOver)),
            _ => None,
        }
    }

    /// Applies it to a lease whose verification was sent at `sent` and
    /// answered at `received`.
    pub(crate) fn apply(self, core: &mut LeaseCore, sent: Instant, received: Instant) {
        match self {
            Verdict::Held(left) => core.verified(sent, left, received),
            Verdict::Lost(loss) => {
                core.mark_lost(loss);
            }
        }
    }
}

/// Why an extension could not begin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Another extension of this lease is in flight or unresolved.
    Busy,
    /// The lease is lost or finished.
    Lost,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pending {
    ticket: Ticket,
    stamp: Stamp,
    /// The server the command went to (see [`LeaseCore::dispatched`]).
    server: Option<u64>,
}

/// A bound learned from a reading of the server, lifted only by an extension
/// sent at or after `lifted_by`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    until: Instant,
    lifted_by: Instant,
}

/// The client's knowledge of one lease.
#[derive(Clone, Debug)]
pub(crate) struct LeaseCore {
    timing: Timing,
    /// The first send: nothing is earlier.
    origin: Instant,
    /// The last command known to be applied (the grant or a confirmed extension).
    base: Stamp,
    /// A bound left by earlier commands whose effect stayed unknown.
    floor: Option<Instant>,
    /// The shortest TTL of an extension that got no reply and could not be
    /// fenced off: it may still be applied at any later time, after any later
    /// extension, so no confirmed extension counts for longer than this.
    cap: Option<Duration>,
    /// A bound from a verification or a server clock that ran ahead.
    held: Option<Held>,
    pending: Option<Pending>,
    lost: Option<Loss>,
    finished: bool,
    tickets: u64,
}

impl LeaseCore {
    /// A lease granted by a command sent at `sent` with `ttl`.
    pub(crate) fn granted(timing: Timing, sent: Instant, ttl: Duration) -> Self {
        LeaseCore {
            timing,
            origin: sent,
            base: Stamp { sent, ttl },
            floor: None,
            cap: None,
            held: None,
            pending: None,
            lost: None,
            finished: false,
            tickets: 0,
        }
    }

    /// The drift allowance it was granted with.
    pub(crate) fn drift_factor(&self) -> f64 {
        self.timing.drift_factor
    }

    /// The TTL of the last confirmed command: what renewals use.
    pub(crate) fn ttl(&self) -> Duration {
        self.base.ttl
    }

    /// Until when the lease is certainly held (if not lost).
    pub(crate) fn valid_until(&self) -> Instant {
        let t = &self.timing;
        let mut until = t.valid_until(self.base.sent, self.base.ttl);
        if let Some(floor) = self.floor {
            until = until.min(floor);
        }
        if let Some(held) = &self.held {
            until = until.min(held.until);
        }
        if let Some(p) = &self.pending {
            until = until.min(t.valid_until(p.stamp.sent, p.stamp.ttl));
        }
        until
    }

    /// When the holder is told the lease is lost: one node timeout before
    /// [`valid_until`](LeaseCore::valid_until).
    pub(crate) fn lost_at(&self) -> Instant {
        self.timing.lost_at(self.valid_until(), self.origin)
    }

    /// When a kept-alive lease should next be renewed: at half its TTL, and
    /// always with a node timeout to spare before the loss deadline.
    pub(crate) fn renew_at(&self) -> Instant {
        let half = self.base.sent + self.base.ttl / 2;
        let spare = self
            .lost_at()
            .checked_sub(self.timing.node_timeout)
            .unwrap_or(self.origin);
        half.min(spare)
    }

    /// Whether the lease counts as lost at `now`, without recording anything.
    pub(crate) fn is_lost(&self, now: Instant) -> bool {
        self.finished || self.lost.is_some() || now >= self.lost_at()
    }

    /// Why it was lost, once recorded.
    pub(crate) fn loss(&self) -> Option<&Loss> {
        self.lost.as_ref()
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.finished
    }

    /// Records a loss by deadline if `now` is past it; true if this call did.
    pub(crate) fn observe(&mut self, now: Instant) -> bool {
        if self.lost.is_none() && !self.finished && now >= self.lost_at() {
            self.lost = Some(Loss::Deadline);
            return true;
        }
        false
    }

    /// How long the lease can still be assumed held.
    pub(crate) fn remaining(&self, now: Instant) -> Duration {
        if self.finished || self.lost.is_some() {
            return Duration::ZERO;
        }
        self.valid_until().saturating_duration_since(now)
    }

    /// Whether an extension is in flight or unresolved.
    pub(crate) fn is_claimed(&self) -> bool {
        self.pending.is_some()
    }

    /// Claims the lease for an extension to `ttl` sent at `now`. From now until
    /// its outcome is known, the lease is bounded by it if it shortens.
    pub(crate) fn begin_extend(&mut self, now: Instant, ttl: Duration) -> Result<Ticket, Refusal> {
        self.observe(now);
        if self.finished || self.lost.is_some() {
            return Err(Refusal::Lost);
        }
        if self.pending.is_some() {
            return Err(Refusal::Busy);
        }
        self.tickets += 1;
        let ticket = Ticket(self.tickets);
        self.pending = Some(Pending {
            ticket,
            stamp: Stamp { sent: now, ttl },
            server: None,
        });
        Ok(ticket)
    }

    /// The extension claimed with `ticket` goes to `server` now (an id the
    /// transport gives each server). Returns `false` when that claim was
    /// given up meanwhile (the lease moved to another server): then it must
    /// not be sent.
    pub(crate) fn dispatched(&mut self, ticket: Ticket, server: u64) -> bool {
        match &mut self.pending {
            Some(p) if p.ticket == ticket => {
                p.server = Some(server);
                true
            }
            _ => false,
        }
    }

    fn take(&mut self, ticket: Ticket) -> Option<Pending> {
        match self.pending {
            Some(p) if p.ticket == ticket => self.pending.take(),
            _ => None,
        }
    }

    /// The server confirmed the extension at `now`. Returns what that did: a
    /// confirmation after the loss deadline does not revive the lease, and
    /// one whose claim was given up moves nothing.
    pub(crate) fn extended(&mut self, ticket: Ticket, now: Instant) -> Confirmed {
        let deadline = self.lost_at();
        let Some(p) = self.take(ticket) else {
            return Confirmed::Stale;
        };
        if self.finished || self.lost.is_some() {
            return Confirmed::Lost;
        }
        if now >= deadline {
            self.lost = Some(Loss::LateConfirmation);
            return Confirmed::Lost;
        }
        self.base = Stamp {
            sent: p.stamp.sent,
            ttl: self.cap.map_or(p.stamp.ttl, |cap| cap.min(p.stamp.ttl)),
        };
        self.floor = None;
        if self.held.is_some_and(|h| p.stamp.sent >= h.lifted_by) {
            self.held = None;
        }
        self.observe(now);
        if self.is_lost(now) {
            Confirmed::Lost
        } else {
            Confirmed::Held
        }
    }

    /// The server answered that the lease is gone or someone else's.
    pub(crate) fn refused(&mut self, ticket: Ticket, loss: Loss) {
        if self.take(ticket).is_some() && self.lost.is_none() && !self.finished {
            self.lost = Some(loss);
        }
    }

    /// Nothing was sent (no connection, refused before writing): no effect.
    pub(crate) fn not_sent(&mut self, ticket: Ticket) {
        self.take(ticket);
    }

    /// No reply came. The command may still be applied, so nothing changes:
    /// the claim stays, with the command's worst case, until
    /// [`fenced`](LeaseCore::fenced) or
    /// [`unfenceable`](LeaseCore::unfenceable) says what became of it.
    pub(crate) fn unanswered(&mut self, _ticket: Ticket) {}

    /// The unanswered command can no longer be applied (its connection was
    /// killed and the kill confirmed). Its possible effect keeps bounding the
    /// lease until a later extension is confirmed; the claim is released.
    pub(crate) fn fenced(&mut self, ticket: Ticket) {
        if let Some(p) = self.take(ticket) {
            let until = self.timing.valid_until(p.stamp.sent, p.stamp.ttl);
            self.floor = Some(self.floor.map_or(until, |f| f.min(until)));
        }
    }

    /// The unanswered command cannot be fenced off (its connection's id is
    /// unknown, so it cannot be killed): it may be applied at any later time.
    /// The claim is released all the same, so that the lease can be extended
    /// again, and its worst case is kept for good: until a later extension is
    /// confirmed it bounds the lease as in [`fenced`](LeaseCore::fenced), and
    /// after that no extension counts for longer than its TTL (applied after
    /// a later extension sent at `t`, it leaves the lease at least `t + ttl`).
    pub(crate) fn unfenceable(&mut self, ticket: Ticket) {
        if let Some(p) = self.pending
            && p.ticket == ticket
        {
            self.fenced(ticket);
            self.cap = Some(self.cap.map_or(p.stamp.ttl, |c| c.min(p.stamp.ttl)));
        }
    }

    /// A read sent at `sent` found the lease held with `remaining` left on the
    /// server (`None`: no expiry). The server ran the read at `sent` or later,
    /// so the lease ends no earlier than `sent + remaining − drift(remaining)`;
    /// the bound becomes at most that until a later extension is confirmed.
    ///
    /// This is what a topology change needs: a new primary may hold the lease
    /// with the expiry of an older grant or extension than the one the guard
    /// counts on (extensions replicate asynchronously), and only the server's
    /// own remaining time says how long it really has.
    ///
    /// Only an extension sent at or after `received` (when the read's reply
    /// came) lifts that bound: one sent before may have run before the read,
    /// and its late confirmation says nothing the read did not.
    pub(crate) fn verified(
        &mut self,
        sent: Instant,
        remaining: Option<Duration>,
        received: Instant,
    ) {
        if let Some(remaining) = remaining {
            self.hold(self.timing.valid_until(sent, remaining), received);
        }
    }

    /// The server's clock was found, by a reading whose reply came at
    /// `detected`, to have run ahead of the client's by up to `gain`: every
    /// expiry it set before then comes that much earlier, so the bound moves
    /// `gain` earlier, until an extension sent at or after `detected` (set on
    /// the server's new clock) is confirmed.
    pub(crate) fn clock_gained(&mut self, gain: Duration, detected: Instant) {
        let until = self
            .valid_until()
            .checked_sub(gain)
            .unwrap_or(self.origin)
            .max(self.origin);
        self.hold(until, detected);
    }

    fn hold(&mut self, until: Instant, lifted_by: Instant) {
        self.held = Some(match self.held {
            Some(h) => Held {
                until: h.until.min(until),
                lifted_by: h.lifted_by.max(lifted_by),
            },
            None => Held { until, lifted_by },
        });
    }

    /// The server the lease lives on changed (a failover, a slot that moved)
    /// to `current` (`None`: not known yet): nothing another server says
    /// about an extension counts any more, and an extension sent to one can
    /// no longer reach the lease. A claimed extension whose command went to
    /// another server, or was not sent yet, is given up: its worst case (a
    /// shortening counted from its send time) stays in the bound until a
    /// later extension is confirmed, and its ticket goes stale, so a late
    /// confirmation is ignored and a send not made yet is not made
    /// ([`dispatched`](LeaseCore::dispatched) refuses it). A claim whose
    /// command went to `current` stays: its answer counts, and until it comes
    /// no other extension may overlap it. Returns whether a claim was given
    /// up.
    pub(crate) fn switched(&mut self, current: Option<u64>) -> bool {
        let keep = self
            .pending
            .is_some_and(|p| p.server.is_some() && p.server == current);
        if keep {
            return false;
        }
        match self.pending.take() {
            Some(p) => {
                let until = self.timing.valid_until(p.stamp.sent, p.stamp.ttl);
                self.floor = Some(self.floor.map_or(until, |f| f.min(until)));
                true
            }
            None => false,
        }
    }

    /// Records a loss (the server said so, or a background failure).
    pub(crate) fn mark_lost(&mut self, loss: Loss) -> bool {
        if self.lost.is_none() && !self.finished {
            self.lost = Some(loss);
            return true;
        }
        false
    }

    /// The holder let go (release or drop): the lease counts as lost from now on.
    pub(crate) fn finish(&mut self) {
        self.finished = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_loss_says_why() {
        let said = |l: Loss| l.to_string();
        assert!(said(Loss::Deadline).contains("loss deadline"));
        assert!(said(Loss::LateConfirmation).contains("only after"));
        assert!(said(Loss::Gone).contains("gone on the server"));
        assert!(said(Loss::TakenOver).contains("another owner"));
        assert_eq!(
            said(Loss::Other("node 2 restarted".into())),
            "node 2 restarted"
        );
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    const T: Timing = Timing {
        drift_factor: 0.0,
        node_timeout: Duration::from_millis(100),
    };

    // drift = 2 ms with factor 0.
    fn core(t0: Instant, ttl: u64) -> LeaseCore {
        LeaseCore::granted(T, t0, ms(ttl))
    }

    #[test]
    fn a_finished_or_lost_lease_has_nothing_left() {
        let t0 = Instant::now();
        let mut c = core(t0, 1_000);
        assert!(!c.is_finished());
        assert_eq!(c.remaining(t0 + ms(100)), ms(898));
        assert_eq!(c.remaining(t0 + ms(2_000)), Duration::ZERO);
        c.finish();
        assert!(c.is_finished());
        assert_eq!(c.remaining(t0 + ms(100)), Duration::ZERO);
        let mut lost = core(t0, 1_000);
        assert!(lost.mark_lost(Loss::Gone));
        assert_eq!(lost.remaining(t0 + ms(100)), Duration::ZERO);
    }

    #[test]
    fn a_confirmation_after_the_release_revives_nothing() {
        let t0 = Instant::now();
        let mut c = core(t0, 1_000);
        let ticket = c.begin_extend(t0 + ms(100), ms(5_000)).expect("claimed");
        c.finish();
        assert_eq!(c.extended(ticket, t0 + ms(110)), Confirmed::Lost);
        assert_eq!(c.valid_until(), t0 + ms(998), "the bound did not move");
        assert_eq!(c.remaining(t0 + ms(110)), Duration::ZERO);
    }

    #[test]
    fn a_refusal_counts_only_for_the_extension_in_flight() {
        let t0 = Instant::now();
        let mut c = core(t0, 1_000);
        let first = c.begin_extend(t0 + ms(100), ms(1_000)).expect("claimed");
        assert_eq!(c.extended(first, t0 + ms(110)), Confirmed::Held);
        // A late duplicate of an answered extension's refusal: nothing.
        c.refused(first, Loss::Gone);
        assert!(!c.is_lost(t0 + ms(120)));
        let second = c.begin_extend(t0 + ms(200), ms(1_000)).expect("claimed");
        c.refused(second, Loss::TakenOver);
        assert_eq!(c.loss(), Some(&Loss::TakenOver));
        // A refusal that comes after the release marks nothing.
        let mut done = core(t0, 1_000);
        let t = done.begin_extend(t0 + ms(100), ms(1_000)).expect("claimed");
        done.finish();
        done.refused(t, Loss::Gone);
        assert_eq!(done.loss(), None, "a released lease is not lost");
    }

    #[test]
    fn a_grant_holds_until_its_send_plus_ttl_minus_drift() {
        let t0 = Instant::now();
        let c = core(t0, 1_000);
        assert_eq!(c.valid_until(), t0 + ms(998));
        assert_eq!(c.lost_at(), t0 + ms(898));
        assert!(!c.is_lost(t0 + ms(897)));
        assert!(c.is_lost(t0 + ms(898)));
    }

    #[test]
    fn an_unanswered_shortening_counts_from_its_send() {
        let t0 = Instant::now();
        let mut c = core(t0, 60_000);
        let t = c.begin_extend(t0 + ms(10), ms(1_500)).unwrap();
        // In flight: already bounded by the shorter TTL.
        assert_eq!(c.valid_until(), t0 + ms(10 + 1_498));
        c.unanswered(t);
        assert_eq!(c.valid_until(), t0 + ms(10 + 1_498));
        assert!(c.is_lost(t0 + ms(10 + 1_398)));
        // Fenced: still bounded, but the claim is free again.
        c.fenced(t);
        assert!(!c.is_claimed());
        assert_eq!(c.valid_until(), t0 + ms(10 + 1_498));
        // A later confirmed extension supersedes it.
        let t2 = c.begin_extend(t0 + ms(20), ms(60_000)).unwrap();
        assert_eq!(c.extended(t2, t0 + ms(21)), Confirmed::Held);
        assert_eq!(c.valid_until(), t0 + ms(20 + 59_998));
    }

    #[test]
    fn an_unanswered_extension_counts_for_nothing() {
        let t0 = Instant::now();
        let mut c = core(t0, 1_000);
        let t = c.begin_extend(t0 + ms(500), ms(60_000)).unwrap();
        c.unanswered(t);
        assert_eq!(c.valid_until(), t0 + ms(998));
        c.fenced(t);
        assert_eq!(c.valid_until(), t0 + ms(998));
    }

    #[test]
    fn an_extension_that_cannot_be_fenced_off_caps_every_later_one() {
        let t0 = Instant::now();
        let mut c = core(t0, 60_000);
        let t = c.begin_extend(t0 + ms(10), ms(1_500)).unwrap();
        c.unanswered(t);
        c.unfenceable(t);
        // The claim is free again, the shortening still counts from its send.
        assert!(!c.is_claimed());
        assert_eq!(c.valid_until(), t0 + ms(10 + 1_498));
        // It may still land after this one: 60 s count for 1.5 s from its send.
        let t2 = c.begin_extend(t0 + ms(20), ms(60_000)).unwrap();
        assert_eq!(c.extended(t2, t0 + ms(21)), Confirmed::Held);
        assert_eq!(c.valid_until(), t0 + ms(20 + 1_498));
        assert_eq!(c.ttl(), ms(1_500));
        // A stale ticket changes nothing.
        c.unfenceable(t);
        assert_eq!(c.valid_until(), t0 + ms(20 + 1_498));
    }

    #[test]
    fn extensions_never_overlap_until_the_first_is_resolved() {
        let t0 = Instant::now();
        let mut c = core(t0, 10_000);
        let t = c.begin_extend(t0, ms(5_000)).unwrap();
        assert_eq!(c.begin_extend(t0, ms(5_000)), Err(Refusal::Busy));
        c.unanswered(t);
        assert_eq!(c.begin_extend(t0, ms(5_000)), Err(Refusal::Busy));
        c.fenced(t);
        assert!(c.begin_extend(t0, ms(5_000)).is_ok());
    }

    #[test]
    fn a_confirmation_after_the_deadline_does_not_revive() {
        let t0 = Instant::now();
        let mut c = core(t0, 1_000);
        let t = c.begin_extend(t0 + ms(800), ms(1_000)).unwrap();
        assert_eq!(c.extended(t, t0 + ms(898)), Confirmed::Lost);
        assert_eq!(c.loss(), Some(&Loss::LateConfirmation));
        assert!(c.is_lost(t0 + ms(899)));
        assert_eq!(c.begin_extend(t0 + ms(900), ms(1_000)), Err(Refusal::Lost));
    }

    #[test]
    fn loss_is_permanent() {
        let t0 = Instant::now();
        let mut c = core(t0, 1_000);
        assert!(c.observe(t0 + ms(900)));
        assert!(!c.observe(t0 + ms(901)));
        assert_eq!(c.begin_extend(t0 + ms(900), ms(1_000)), Err(Refusal::Lost));
        assert_eq!(c.remaining(t0 + ms(900)), Duration::ZERO);
    }

    #[test]
    fn a_refusal_loses_the_lease() {
        let t0 = Instant::now();
        let mut c = core(t0, 1_000);
        let t = c.begin_extend(t0, ms(1_000)).unwrap();
        c.refused(t, Loss::TakenOver);
        assert!(c.is_lost(t0));
        assert_eq!(c.loss(), Some(&Loss::TakenOver));
    }

    #[test]
    fn nothing_sent_has_no_effect() {
        let t0 = Instant::now();
        let mut c = core(t0, 10_000);
        let t = c.begin_extend(t0, ms(1_000)).unwrap();
        c.not_sent(t);
        assert_eq!(c.valid_until(), t0 + ms(9_998));
        assert!(!c.is_claimed());
    }

    #[test]
    fn stale_tickets_are_ignored() {
        let t0 = Instant::now();
        let mut c = core(t0, 10_000);
        let t1 = c.begin_extend(t0, ms(1_000)).unwrap();
        c.not_sent(t1);
        let t2 = c.begin_extend(t0, ms(20_000)).unwrap();
        // A late event for the first extension changes nothing.
        c.fenced(t1);
        assert_eq!(c.extended(t1, t0 + ms(1)), Confirmed::Stale);
        assert!(c.is_claimed());
        assert_eq!(c.extended(t2, t0 + ms(1)), Confirmed::Held);
        assert_eq!(c.valid_until(), t0 + ms(19_998));
    }

    #[test]
    fn renewal_comes_at_half_or_a_node_timeout_before_loss() {
        let t0 = Instant::now();
        let c = core(t0, 10_000);
        assert_eq!(c.renew_at(), t0 + ms(5_000));
        let mut c = core(t0, 10_000);
        let t = c.begin_extend(t0, ms(1_000)).unwrap();
        c.unanswered(t);
        c.fenced(t);
        // lost_at = 998 − 100; renew a node timeout before that.
        assert_eq!(c.renew_at(), t0 + ms(798));
    }

    #[test]
    fn a_verify_bounds_the_lease_by_what_the_server_has_left() {
        let t0 = Instant::now();
        let mut c = core(t0, 30_000);
        // The new primary has 2 s left, read by a verify sent at 1 s.
        c.verified(t0 + ms(1_000), Some(ms(2_000)), t0 + ms(1_001));
        assert_eq!(c.valid_until(), t0 + ms(1_000 + 1_998));
        assert!(c.is_lost(t0 + ms(2_898)));
        // A later read cannot lift the bound.
        let mut c = core(t0, 30_000);
        c.verified(t0 + ms(1_000), Some(ms(2_000)), t0 + ms(1_001));
        c.verified(t0 + ms(1_500), Some(ms(20_000)), t0 + ms(1_501));
        assert_eq!(c.valid_until(), t0 + ms(2_998));
        // A confirmed extension on the new server does.
        let t = c.begin_extend(t0 + ms(1_600), ms(30_000)).unwrap();
        assert_eq!(c.extended(t, t0 + ms(1_601)), Confirmed::Held);
        assert_eq!(c.valid_until(), t0 + ms(1_600 + 29_998));
        // No expiry on the server: nothing learned about an end.
        let mut c = core(t0, 30_000);
        c.verified(t0 + ms(1_000), None, t0 + ms(1_001));
        assert_eq!(c.valid_until(), t0 + ms(29_998));
    }

    #[test]
    fn a_switch_frees_the_claim_and_ignores_the_old_server() {
        let t0 = Instant::now();
        let mut c = core(t0, 10_000);
        // An extension to the old primary, unanswered: the claim is held.
        let t = c.begin_extend(t0 + ms(100), ms(4_000)).unwrap();
        c.unanswered(t);
        assert!(c.is_claimed());
        assert!(c.switched(None));
        assert!(!c.is_claimed());
        // Its worst case stays in the bound.
        assert_eq!(c.valid_until(), t0 + ms(100 + 3_998));
        // A confirmation from the old server, late, moves nothing.
        assert_eq!(c.extended(t, t0 + ms(200)), Confirmed::Stale);
        assert_eq!(c.valid_until(), t0 + ms(100 + 3_998));
        // In flight and confirmed by the old server after the switch: ignored.
        let mut c = core(t0, 10_000);
        let t = c.begin_extend(t0 + ms(100), ms(60_000)).unwrap();
        assert!(c.switched(None));
        assert_eq!(c.extended(t, t0 + ms(200)), Confirmed::Stale);
        assert_eq!(c.valid_until(), t0 + ms(9_998));
        // Nothing claimed: nothing to give up.
        assert!(!c.switched(None));
    }

    #[test]
    fn a_switch_keeps_a_claim_whose_command_went_to_the_server_the_key_is_on_now() {
        let t0 = Instant::now();
        let (old, new) = (1, 2);
        // A renewal dispatched to the new primary before the switch is
        // applied: its claim stays, and its confirmation counts.
        let mut c = core(t0, 10_000);
        let t = c.begin_extend(t0 + ms(100), ms(10_000)).unwrap();
        assert!(c.dispatched(t, new));
        assert!(!c.switched(Some(new)));
        assert!(c.is_claimed());
        // So no other extension can overlap it.
        assert_eq!(c.begin_extend(t0 + ms(150), ms(400)), Err(Refusal::Busy));
        assert_eq!(c.extended(t, t0 + ms(200)), Confirmed::Held);
        assert_eq!(c.valid_until(), t0 + ms(100 + 9_998));
        // One that went to the old primary is given up.
        let mut c = core(t0, 10_000);
        let t = c.begin_extend(t0 + ms(100), ms(10_000)).unwrap();
        assert!(c.dispatched(t, old));
        assert!(c.switched(Some(new)));
        assert_eq!(c.extended(t, t0 + ms(200)), Confirmed::Stale);
        // One claimed but not sent yet is given up, and then not sent.
        let mut c = core(t0, 10_000);
        let t = c.begin_extend(t0 + ms(100), ms(10_000)).unwrap();
        assert!(c.switched(Some(new)));
        assert!(!c.dispatched(t, new));
        // Redirected (MOVED) before any answer: the claim follows its command.
        let mut c = core(t0, 10_000);
        let t = c.begin_extend(t0 + ms(100), ms(10_000)).unwrap();
        assert!(c.dispatched(t, old));
        assert!(c.dispatched(t, new));
        assert!(!c.switched(Some(new)));
    }

    #[test]
    fn a_verify_is_lifted_only_by_an_extension_sent_after_its_reply() {
        let t0 = Instant::now();
        let mut c = core(t0, 10_000);
        // An extension in flight; a verify sent after it reads 2 s left.
        let t = c.begin_extend(t0 + ms(100), ms(10_000)).unwrap();
        c.verified(t0 + ms(150), Some(ms(2_000)), t0 + ms(160));
        assert_eq!(c.valid_until(), t0 + ms(150 + 1_998));
        // The extension's late confirmation does not undo what the verify
        // read: the server may have run it before the verify.
        assert_eq!(c.extended(t, t0 + ms(170)), Confirmed::Held);
        assert_eq!(c.valid_until(), t0 + ms(150 + 1_998));
        // One sent after the verify's reply does.
        let t = c.begin_extend(t0 + ms(200), ms(10_000)).unwrap();
        assert_eq!(c.extended(t, t0 + ms(210)), Confirmed::Held);
        assert_eq!(c.valid_until(), t0 + ms(200 + 9_998));
    }

    #[test]
    fn a_server_clock_that_ran_ahead_cuts_the_bound_until_a_later_extension() {
        let t0 = Instant::now();
        let mut c = core(t0, 12_000);
        assert_eq!(c.valid_until(), t0 + ms(11_998));
        // Found 1 s in to have gained 10 s.
        c.clock_gained(ms(10_000), t0 + ms(1_000));
        assert_eq!(c.valid_until(), t0 + ms(1_998));
        assert!(c.is_lost(t0 + ms(1_898)));
        // An extension sent before the finding (it may have run on the old
        // clock) lifts nothing.
        let mut c = core(t0, 12_000);
        let t = c.begin_extend(t0 + ms(900), ms(12_000)).unwrap();
        c.clock_gained(ms(10_000), t0 + ms(1_000));
        assert_eq!(c.extended(t, t0 + ms(1_001)), Confirmed::Held);
        assert_eq!(c.valid_until(), t0 + ms(1_998));
        // One sent after it was set on the new clock.
        let t = c.begin_extend(t0 + ms(1_100), ms(12_000)).unwrap();
        assert_eq!(c.extended(t, t0 + ms(1_101)), Confirmed::Held);
        assert_eq!(c.valid_until(), t0 + ms(1_100 + 11_998));
        // A gain larger than the whole lease: lost at once.
        let mut c = core(t0, 1_000);
        c.clock_gained(ms(10_000), t0 + ms(100));
        assert!(c.is_lost(t0 + ms(100)));
    }

    #[test]
    fn finishing_counts_as_lost_without_a_loss() {
        let t0 = Instant::now();
        let mut c = core(t0, 10_000);
        c.finish();
        assert!(c.is_lost(t0));
        assert!(c.loss().is_none());
        assert!(!c.mark_lost(Loss::Gone));
    }
}
