//! The choreography of one server's executor, as a sans-I/O state machine:
//! renewal pipelines (of leases the schedule claimed, `core::schedule`)
//! settled, the connections of unanswered commands fenced off by a confirmed
//! kill, and the clean-up after unanswered acquire attempts.
//!
//! After quinn-proto's `Connection`: the runtime's executor thread and the
//! simulation both drive this one object. Methods that start work
//! ([`Executor::fence`], [`Executor::clean_up`]) take the
//! instant they happen at; [`Executor::poll_command`] says what to send next,
//! [`Executor::poll_timeout`] when to look again; the `*_done` methods and
//! [`Executor::renewed`] take what came back. Nothing here reads a clock or
//! touches a socket.
//!
//! The rules it keeps (Kleppmann's "How to do distributed locking" on why a
//! late command must be assumed applied):
//! - a renewal is sent only with the lease's claim (extensions of one lease
//!   never overlap);
//! - a renewal with no reply may still be applied later: its claim is held
//!   until the connection it went out on is killed and the kill confirmed
//!   (`CLIENT KILL` answering 1 or 0: killed, or gone already), or until
//!   the lease no longer needs it (lost, released, or its server replaced);
//! - an acquire attempt with no reply may still grant: its connections are
//!   killed first, and only then is what it may have set deleted by owner;
//!   that stops once whatever it set would have expired anyway.

use std::time::{Duration, Instant};

use crate::core::lease::{Confirmed, Loss, Refusal, Ticket};
use crate::core::timing::{Timing, retry_delay};

/// The pause before a kill or clean-up that failed is tried again (at most
/// a node timeout).
const RETRY: Duration = Duration::from_millis(50);

/// What an extension needs of a lease, whoever drives it (the executor, a
/// holder's own extension, the Redlock renewal thread, the simulation): its
/// claim and the transitions of its core (implemented by the lease cell the
/// guards and the runtime share).
pub(crate) trait Claim {
    /// A stable id, for the renewal schedule.
    fn id(&self) -> u64;
    /// The TTL renewals use.
    fn ttl(&self) -> Duration;
    /// When it is lost unless an extension is confirmed first.
    fn lost_at(&self) -> Instant;
    /// Lost or finished at `now`.
    fn is_lost(&self, now: Instant) -> bool;
    /// Claims the lease for an extension to `ttl` sent at `now`.
    fn begin_extend(&self, now: Instant, ttl: Duration) -> Result<Ticket, Refusal>;
    /// Confirmed at `now`; what that did to the lease.
    fn extended(&self, ticket: Ticket, now: Instant) -> Confirmed;
    /// The server said the lease is gone or someone else's.
    fn refused(&self, ticket: Ticket, now: Instant, loss: Loss);
    /// Not run: no effect.
    fn not_sent(&self, ticket: Ticket, now: Instant);
    /// No reply: the effect is unknown, the claim stays.
    fn unanswered(&self, ticket: Ticket, now: Instant);
    /// The unanswered command can no longer be applied: the claim is freed,
    /// its worst case kept.
    fn fenced(&self, ticket: Ticket, now: Instant);
    /// The unanswered command cannot be fenced off (its connection's id is
    /// unknown): the claim is freed, its worst case kept for good.
    fn unfenceable(&self, ticket: Ticket, now: Instant);
}

impl<T: Claim + ?Sized> Claim for std::sync::Arc<T> {
    fn id(&self) -> u64 {
        (**self).id()
    }
    fn ttl(&self) -> Duration {
        (**self).ttl()
    }
    fn lost_at(&self) -> Instant {
        (**self).lost_at()
    }
    fn is_lost(&self, now: Instant) -> bool {
        (**self).is_lost(now)
    }
    fn begin_extend(&self, now: Instant, ttl: Duration) -> Result<Ticket, Refusal> {
        (**self).begin_extend(now, ttl)
    }
    fn extended(&self, ticket: Ticket, now: Instant) -> Confirmed {
        (**self).extended(ticket, now)
    }
    fn refused(&self, ticket: Ticket, now: Instant, loss: Loss) {
        (**self).refused(ticket, now, loss);
    }
    fn not_sent(&self, ticket: Ticket, now: Instant) {
        (**self).not_sent(ticket, now);
    }
    fn unanswered(&self, ticket: Ticket, now: Instant) {
        (**self).unanswered(ticket, now);
    }
    fn fenced(&self, ticket: Ticket, now: Instant) {
        (**self).fenced(ticket, now);
    }
    fn unfenceable(&self, ticket: Ticket, now: Instant) {
        (**self).unfenceable(ticket, now);
    }
}

/// What one extension's reply said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExtendReply {
    /// Applied: the lease has its new expiry.
    Extended,
    /// The key is gone.
    Gone,
    /// Someone else holds the key.
    TakenOver,
    /// An error reply, a redirection included: the script did not run, so it
    /// changed nothing; try again.
    NotRun,
    /// It ran, but with an effect that cannot be read: the worst of it stands.
    Unreadable,
    /// The primary applied it, but fewer replicas than the replication guard
    /// requires acknowledged it (`WAIT`), so a replica promoted now may not
    /// have it: it counts as if unanswered, its worst case stands (a
    /// shortening bounds the lease from its send time, an extension counts
    /// for nothing). Its reply came, so nothing of it can arrive later and
    /// there is nothing to fence.
    Unreplicated,
}

impl ExtendReply {
    /// The extension script's integer reply: 1 extended, 0 gone, −1 (any
    /// other) someone else's.
    pub(crate) fn of(code: i64) -> ExtendReply {
        match code {
            1 => ExtendReply::Extended,
            0 => ExtendReply::Gone,
            -1 => ExtendReply::TakenOver,
            _ => ExtendReply::Unreadable,
        }
    }
}

/// How one lease's extension ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settled {
    /// Confirmed in time.
    Held,
    /// Lost: refused, or confirmed only after the loss deadline.
    Lost,
    /// Confirmed by a server whose word no longer counts: the claim had been
    /// given up (the deployment switched to another server while it ran), so
    /// the bound did not move. Send it again on the server the key lives on
    /// now.
    Stale,
    /// Not run; nothing changed.
    NotRun,
    /// Applied by the primary but not acknowledged by enough replicas: the
    /// bound did not move (its worst case stands); try again.
    Unreplicated,
    /// Ran with an effect that cannot be read (its worst case stands).
    Unreadable,
}

/// Applies one extension's reply to the lease that was claimed for it: the
/// one settlement every transport uses, the holder's `reset_expiry` and the
/// executor's renewals alike.
pub(crate) fn settle<L: Claim>(
    lease: &L,
    ticket: Ticket,
    reply: ExtendReply,
    now: Instant,
) -> Settled {
    match reply {
        ExtendReply::Extended => match lease.extended(ticket, now) {
            Confirmed::Held => Settled::Held,
            Confirmed::Lost => Settled::Lost,
            Confirmed::Stale => Settled::Stale,
        },
        ExtendReply::Gone => {
            lease.refused(ticket, now, Loss::Gone);
            Settled::Lost
        }
        ExtendReply::TakenOver => {
            lease.refused(ticket, now, Loss::TakenOver);
            Settled::Lost
        }
        ExtendReply::NotRun => {
            lease.not_sent(ticket, now);
            Settled::NotRun
        }
        ExtendReply::Unreadable => {
            // It ran: nothing more can arrive, so there is nothing to fence.
            lease.unanswered(ticket, now);
            lease.fenced(ticket, now);
            Settled::Unreadable
        }
        ExtendReply::Unreplicated => {
            lease.unanswered(ticket, now);
            lease.fenced(ticket, now);
            Settled::Unreplicated
        }
    }
}

/// The leases a renewal pipeline extended (settled [`Settled::Held`]): each
/// ran after the server's `TIME` that opens the pipeline, so its new expiry is
/// on the clock that reading saw, and a clock cut the reading finds spares it.
pub(crate) fn extended_in<L: Claim>(settled: &[(L, Settled, Option<Instant>)]) -> Vec<u64> {
    settled
        .iter()
        .filter(|(_, outcome, _)| *outcome == Settled::Held)
        .map(|(lease, _, _)| lease.id())
        .collect()
}

/// A lease claimed for a renewal (by the schedule, `core::schedule`), with
/// the ticket of its claim and the TTL the renewal sets.
pub(crate) type Claimed<L> = (L, Ticket, Duration);

/// Renewals sent as one pipeline, waiting for their replies.
#[derive(Debug)]
pub(crate) struct RenewalBatch<L> {
    /// Each lease with the ticket of its claim and the TTL sent.
    pub(crate) items: Vec<Claimed<L>>,
}

/// A lease the renewal schedule must plan again: at the instant given, or
/// (`None`) as its state says.
pub(crate) type Done = (u64, Option<Instant>);

/// The next command to send; `K` names a connection to kill (what the
/// server knows of it: its id, and its address where known).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Command<'a, C, K> {
    /// Kill this connection on this server (`CLIENT KILL`).
    Kill(K),
    /// Run this clean-up (every connection of its attempts is dead).
    CleanUp(&'a C),
}

struct Fence<L, K> {
    conn: K,
    leases: Vec<(L, Ticket)>,
    retry_at: Instant,
}

/// Clean-up after unanswered acquire attempts (or a withdrawal sent in the
/// background, with no connection to kill); `C` is what the transport
/// runs (a command, or nothing when a later attempt was granted).
pub(crate) struct CleanUp<C, K> {
    /// Connections of the attempts, still to be killed.
    pub(crate) conns: Vec<K>,
    pub(crate) payload: C,
    pub(crate) give_up_at: Instant,
    retry_at: Instant,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum InFlight<K> {
    /// A kill for the first due fence with this connection.
    FenceKill(K),
    /// A kill for the first clean-up's last connection.
    CleanUpKill,
    /// The first clean-up's command.
    CleanUp,
}

/// One server's executor state; `K` names a connection to kill.
pub(crate) struct Executor<L, C, K> {
    /// The deployment's timing; its node timeout bounds a retry's pause.
    timing: Timing,
    fences: Vec<Fence<L, K>>,
    cleanups: Vec<CleanUp<C, K>>,
    in_flight: Option<InFlight<K>>,
}

impl<L: Claim + Clone, C, K: Clone + PartialEq> Executor<L, C, K> {
    pub(crate) fn new(timing: Timing) -> Self {
        Executor {
            timing,
            fences: Vec::new(),
            cleanups: Vec::new(),
            in_flight: None,
        }
    }

    // --- Getters --------------------------------------------------------

    /// When [`poll_command`](Executor::poll_command) may have something new
    /// (a kill or clean-up to retry), if anything waits.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        if self.in_flight.is_some() {
            return None;
        }
        // Clean-ups run in order: only the first one's retry matters.
        self.fences
            .iter()
            .map(|f| f.retry_at)
            .chain(self.cleanups.first().map(|c| c.retry_at))
            .min()
    }

    /// Whether kills or clean-ups wait.
    #[cfg(test)]
    pub(crate) fn is_idle(&self) -> bool {
        self.fences.is_empty() && self.cleanups.is_empty()
    }

    // --- Events ---------------------------------------------------------

    /// The replies to `renewal`, in order (one per lease; a missing one
    /// counts as not run). Returns each lease with when to try again:
    /// `None` when settled, soon for one not run.
    pub(crate) fn renewed(
        &mut self,
        renewal: RenewalBatch<L>,
        replies: impl IntoIterator<Item = ExtendReply>,
        now: Instant,
    ) -> Vec<(L, Settled, Option<Instant>)> {
        let mut replies = replies.into_iter();
        renewal
            .items
            .into_iter()
            .map(|(lease, ticket, ttl)| {
                let reply = replies.next().unwrap_or(ExtendReply::NotRun);
                let settled = settle(&lease, ticket, reply, now);
                let retry = matches!(settled, Settled::NotRun | Settled::Unreplicated)
                    .then(|| now + retry_delay(ttl));
                (lease, settled, retry)
            })
            .collect()
    }

    /// No reply came to `renewal`, sent on connection `conn` (`None`: its id
    /// is unknown). Every lease keeps its claim until the connection is
    /// fenced off (or, when it cannot be, gives it up with its worst case kept
    /// for good); each is tried again after a pause. Returns those leases.
    pub(crate) fn renewal_unanswered(
        &mut self,
        renewal: RenewalBatch<L>,
        conn: Option<K>,
        now: Instant,
    ) -> Vec<Done> {
        let mut done = Vec::with_capacity(renewal.items.len());
        let mut claims = Vec::with_capacity(renewal.items.len());
        for (lease, ticket, ttl) in renewal.items {
            lease.unanswered(ticket, now);
            done.push((lease.id(), Some(now + retry_delay(ttl))));
            claims.push((lease, ticket));
        }
        self.fence_all(conn, claims, now);
        done
    }

    /// An extension of `lease` (the holder's own) got no reply on connection
    /// `conn`: kill it, then free the claim.
    /// `conn: None`: its id is unknown, so it cannot be killed; the claim is
    /// freed at once with its worst case kept for good.
    pub(crate) fn fence(&mut self, conn: Option<K>, lease: L, ticket: Ticket, now: Instant) {
        self.fence_all(conn, vec![(lease, ticket)], now);
    }

    fn fence_all(&mut self, conn: Option<K>, leases: Vec<(L, Ticket)>, now: Instant) {
        match conn {
            Some(conn) => self.fences.push(Fence {
                conn,
                leases,
                retry_at: now,
            }),
            None => {
                log::warn!(
                    "cannot fence off {} extension(s) that got no reply: the connection's id is \
                     unknown (CLIENT ID denied); each lease counts no extension for longer than \
                     the TTL of the one left unanswered",
                    leases.len()
                );
                for (lease, ticket) in leases {
                    lease.unfenceable(ticket, now);
                }
            }
        }
    }

    /// Acquire attempts got no reply on `conns`: kill them, then hand out
    /// `payload` to run, until `give_up_at`.
    pub(crate) fn clean_up(
        &mut self,
        conns: Vec<K>,
        payload: C,
        give_up_at: Instant,
        now: Instant,
    ) {
        self.cleanups.push(CleanUp {
            conns,
            payload,
            give_up_at,
            retry_at: now,
        });
    }

    /// The server was replaced (a failover, or it serves none of these keys
    /// any more): a command left on it can no longer reach where the leases
    /// live, so every claim held for a kill is freed with its worst case kept
    /// (see [`Claim::fenced`]). Returns the leases whose claims were freed and
    /// the clean-ups, for the server that serves their keys now.
    pub(crate) fn retire(&mut self, now: Instant) -> (Vec<L>, Vec<CleanUp<C, K>>) {
        self.in_flight = None;
        let mut freed = Vec::new();
        for f in std::mem::take(&mut self.fences) {
            for (lease, ticket) in f.leases {
                lease.fenced(ticket, now);
                freed.push(lease);
            }
        }
        (freed, std::mem::take(&mut self.cleanups))
    }

    // --- Commands -------------------------------------------------------

    /// The next kill or clean-up that is due at `now`, if nothing is in
    /// flight: fences first (leases wait on them), then clean-ups in order.
    /// Leases that no longer need their claim, and clean-ups past their
    /// give-up instant, are dropped here.
    pub(crate) fn poll_command(&mut self, now: Instant) -> Option<Command<'_, C, K>> {
        if self.in_flight.is_some() {
            return None;
        }
        for f in &mut self.fences {
            f.leases.retain(|(l, _)| !l.is_lost(now));
        }
        self.fences.retain(|f| !f.leases.is_empty());
        if let Some(f) = self.fences.iter().find(|f| f.retry_at <= now) {
            self.in_flight = Some(InFlight::FenceKill(f.conn.clone()));
            return Some(Command::Kill(f.conn.clone()));
        }
        self.cleanups.retain(|c| {
            let keep = now < c.give_up_at;
            if !keep {
                log::warn!("gave up a clean-up: whatever it was to delete has expired by now");
            }
            keep
        });
        let c = self.cleanups.first()?;
        if c.retry_at > now {
            return None;
        }
        match c.conns.last() {
            Some(conn) => {
                self.in_flight = Some(InFlight::CleanUpKill);
                Some(Command::Kill(conn.clone()))
            }
            None => {
                self.in_flight = Some(InFlight::CleanUp);
                Some(Command::CleanUp(&self.cleanups[0].payload))
            }
        }
    }

    /// The kill handed out last was confirmed (`true`: the server answered
    /// that no such connection is open any more, whether the kill closed it
    /// or it was gone already) or failed. Returns the leases whose claims
    /// were freed by it.
    pub(crate) fn kill_done(&mut self, confirmed: bool, now: Instant) -> Vec<L> {
        let retry_at = now + RETRY.min(self.timing.node_timeout);
        match self.in_flight.take() {
            Some(InFlight::FenceKill(conn)) => {
                let Some(i) = self.fences.iter().position(|f| f.conn == conn) else {
                    return Vec::new();
                };
                if !confirmed {
                    self.fences[i].retry_at = retry_at;
                    return Vec::new();
                }
                // Every claim waiting on this connection is free now.
                let mut freed = Vec::new();
                let mut j = 0;
                while j < self.fences.len() {
                    if self.fences[j].conn == conn {
                        for (lease, ticket) in self.fences.remove(j).leases {
                            lease.fenced(ticket, now);
                            freed.push(lease);
                        }
                    } else {
                        j += 1;
                    }
                }
                freed
            }
            Some(InFlight::CleanUpKill) => {
                if let Some(c) = self.cleanups.first_mut() {
                    if confirmed {
                        c.conns.pop();
                    } else {
                        c.retry_at = retry_at;
                    }
                }
                Vec::new()
            }
            other => {
                self.in_flight = other;
                Vec::new()
            }
        }
    }

    /// The clean-up handed out last ran (`true`), or failed and is tried
    /// again after a pause.
    pub(crate) fn clean_up_done(&mut self, ran: bool, now: Instant) {
        if self.in_flight != Some(InFlight::CleanUp) {
            return;
        }
        self.in_flight = None;
        if ran {
            if !self.cleanups.is_empty() {
                self.cleanups.remove(0);
            }
        } else if let Some(c) = self.cleanups.first_mut() {
            c.retry_at = now + RETRY.min(self.timing.node_timeout);
        }
    }

    /// The clean-up handed out last must run elsewhere (its key's slot moved):
    /// it is taken out and returned.
    pub(crate) fn clean_up_moved(&mut self) -> Option<CleanUp<C, K>> {
        if self.in_flight != Some(InFlight::CleanUp) || self.cleanups.is_empty() {
            return None;
        }
        self.in_flight = None;
        Some(self.cleanups.remove(0))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::core::lease::LeaseCore;
    use parking_lot::Mutex;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    const T: Timing = Timing {
        drift_factor: 0.0,
        node_timeout: Duration::from_millis(100),
    };

    /// A lease core behind a lock, as the cell the guard shares (also the
    /// lease of `core::extend`'s tests).
    #[derive(Clone)]
    pub(crate) struct L(pub(crate) Arc<Mutex<LeaseCore>>);

    impl Claim for L {
        fn id(&self) -> u64 {
            1
        }
        fn ttl(&self) -> Duration {
            self.0.lock().ttl()
        }
        fn lost_at(&self) -> Instant {
            self.0.lock().lost_at()
        }
        fn is_lost(&self, now: Instant) -> bool {
            self.0.lock().is_lost(now)
        }
        fn begin_extend(&self, now: Instant, ttl: Duration) -> Result<Ticket, Refusal> {
            self.0.lock().begin_extend(now, ttl)
        }
        fn extended(&self, ticket: Ticket, now: Instant) -> Confirmed {
            self.0.lock().extended(ticket, now)
        }
        fn refused(&self, ticket: Ticket, _: Instant, loss: Loss) {
            self.0.lock().refused(ticket, loss)
        }
        fn not_sent(&self, ticket: Ticket, _: Instant) {
            self.0.lock().not_sent(ticket)
        }
        fn unanswered(&self, ticket: Ticket, _: Instant) {
            self.0.lock().unanswered(ticket)
        }
        fn fenced(&self, ticket: Ticket, _: Instant) {
            self.0.lock().fenced(ticket)
        }
        fn unfenceable(&self, ticket: Ticket, _: Instant) {
            self.0.lock().unfenceable(ticket)
        }
    }

    fn lease(t0: Instant) -> L {
        L(Arc::new(Mutex::new(LeaseCore::granted(T, t0, ms(10_000)))))
    }

    /// Each lease claimed at `now` for a renewal by its TTL, as the
    /// schedule hands them out.
    fn claimed(leases: &[&L], now: Instant) -> RenewalBatch<L> {
        let items = leases
            .iter()
            .map(|l| {
                let ticket = l.begin_extend(now, l.ttl()).expect("a claim");
                ((*l).clone(), ticket, l.ttl())
            })
            .collect();
        RenewalBatch { items }
    }

    #[test]
    fn an_unanswered_renewal_keeps_its_claim_until_the_kill_is_confirmed() {
        let t0 = Instant::now();
        let l = lease(t0);
        let mut ex: Executor<L, (), u64> = Executor::new(T);
        let renewal = claimed(&[&l], t0);
        let again = ex.renewal_unanswered(renewal, Some(7), t0 + ms(100));
        assert_eq!(
            again,
            [(1, Some(t0 + ms(100) + retry_delay(ms(10_000))))],
            "tried again after a pause"
        );
        assert!(l.0.lock().is_claimed());
        assert_eq!(ex.poll_command(t0 + ms(100)), Some(Command::Kill(7)));
        // Nothing else while the kill is out.
        assert_eq!(ex.poll_command(t0 + ms(100)), None);
        assert!(ex.kill_done(false, t0 + ms(200)).is_empty());
        assert!(l.0.lock().is_claimed());
        assert_eq!(ex.poll_command(t0 + ms(200)), None);
        assert_eq!(ex.poll_timeout(), Some(t0 + ms(250)));
        assert_eq!(ex.poll_command(t0 + ms(250)), Some(Command::Kill(7)));
        assert_eq!(ex.kill_done(true, t0 + ms(260)).len(), 1);
        assert!(!l.0.lock().is_claimed());
        assert!(ex.is_idle());
    }

    #[test]
    fn a_renewal_settles_each_lease_by_its_reply() {
        let t0 = Instant::now();
        let (a, b, c) = (lease(t0), lease(t0), lease(t0));
        let mut ex: Executor<L, (), u64> = Executor::new(T);
        let renewal = claimed(&[&a, &b, &c], t0 + ms(10));
        let out = ex.renewed(
            renewal,
            [
                ExtendReply::Extended,
                ExtendReply::Gone,
                ExtendReply::NotRun,
            ],
            t0 + ms(11),
        );
        let settled: Vec<Settled> = out.iter().map(|(_, s, _)| *s).collect();
        assert_eq!(settled, [Settled::Held, Settled::Lost, Settled::NotRun]);
        let retries: Vec<Option<Instant>> = out.iter().map(|(_, _, r)| *r).collect();
        assert_eq!(
            retries,
            [None, None, Some(t0 + ms(11) + retry_delay(ms(10_000)))],
            "only the one not run is tried again, after a pause"
        );
        assert_eq!(a.0.lock().valid_until(), t0 + ms(10 + 9_998));
        assert!(b.0.lock().is_lost(t0 + ms(11)));
        assert!(!c.0.lock().is_claimed());
    }

    #[test]
    fn a_clean_up_runs_only_after_every_connection_is_killed() {
        let t0 = Instant::now();
        let mut ex: Executor<L, &str, u64> = Executor::new(T);
        ex.clean_up(vec![1, 2], "del", t0 + ms(1_000), t0);
        assert_eq!(ex.poll_command(t0), Some(Command::Kill(2)));
        ex.kill_done(true, t0);
        assert_eq!(ex.poll_command(t0), Some(Command::Kill(1)));
        ex.kill_done(true, t0);
        assert_eq!(ex.poll_command(t0), Some(Command::CleanUp(&"del")));
        ex.clean_up_done(false, t0);
        assert_eq!(ex.poll_command(t0), None);
        assert_eq!(ex.poll_command(t0 + ms(50)), Some(Command::CleanUp(&"del")));
        ex.clean_up_done(true, t0 + ms(50));
        assert!(ex.is_idle());
        // Past its give-up instant a clean-up is dropped.
        ex.clean_up(vec![3], "del", t0 + ms(1_000), t0);
        assert_eq!(ex.poll_command(t0 + ms(1_000)), None);
        assert!(ex.is_idle());
    }

    #[test]
    fn a_clean_up_whose_slot_moved_is_handed_out_only_while_it_runs() {
        let t0 = Instant::now();
        let mut ex: Executor<L, &str, u64> = Executor::new(T);
        ex.clean_up(vec![], "del", t0 + ms(1_000), t0);
        // Not running: nothing to hand over.
        assert!(ex.clean_up_moved().is_none());
        assert_eq!(ex.poll_command(t0), Some(Command::CleanUp(&"del")));
        let moved = ex.clean_up_moved().expect("the running clean-up");
        assert_eq!(moved.payload, "del");
        assert!(ex.is_idle());
        assert!(ex.clean_up_moved().is_none());
        // A kill in flight is not a clean-up to hand over.
        ex.clean_up(vec![4], "del", t0 + ms(1_000), t0);
        assert_eq!(ex.poll_command(t0), Some(Command::Kill(4)));
        assert!(ex.clean_up_moved().is_none());
    }

    #[test]
    fn retiring_frees_the_claims_with_their_worst_case_kept() {
        let t0 = Instant::now();
        let l = lease(t0);
        let mut ex: Executor<L, (), u64> = Executor::new(T);
        let ticket = l.begin_extend(t0 + ms(10), ms(2_000)).unwrap();
        l.unanswered(ticket, t0 + ms(110));
        ex.fence(Some(9), l.clone(), ticket, t0 + ms(110));
        let (freed, cleanups) = ex.retire(t0 + ms(120));
        assert_eq!(freed.len(), 1);
        assert!(cleanups.is_empty());
        assert!(!l.0.lock().is_claimed());
        assert_eq!(l.0.lock().valid_until(), t0 + ms(10 + 1_998));
        assert!(ex.is_idle());
    }
    #[test]
    fn an_extension_reply_is_read_by_its_code() {
        assert_eq!(ExtendReply::of(1), ExtendReply::Extended);
        assert_eq!(ExtendReply::of(0), ExtendReply::Gone);
        assert_eq!(ExtendReply::of(-1), ExtendReply::TakenOver);
        assert_eq!(ExtendReply::of(2), ExtendReply::Unreadable);
    }

    #[test]
    fn a_confirmed_kill_frees_every_claim_on_its_connection_and_no_other() {
        let t0 = Instant::now();
        let (a, b, c) = (lease(t0), lease(t0), lease(t0));
        let mut ex: Executor<L, (), u64> = Executor::new(T);
        for (l, conn) in [(&b, 8), (&a, 7), (&c, 7)] {
            let ticket = l.begin_extend(t0, ms(10_000)).unwrap();
            l.unanswered(ticket, t0 + ms(100));
            ex.fence(Some(conn), l.clone(), ticket, t0 + ms(100));
        }
        assert_eq!(ex.poll_command(t0 + ms(100)), Some(Command::Kill(8)));
        assert_eq!(ex.kill_done(true, t0 + ms(101)).len(), 1);
        assert!(!b.0.lock().is_claimed());
        assert!(a.0.lock().is_claimed() && c.0.lock().is_claimed());
        assert_eq!(ex.poll_command(t0 + ms(101)), Some(Command::Kill(7)));
        assert_eq!(ex.kill_done(true, t0 + ms(102)).len(), 2);
        assert!(!a.0.lock().is_claimed() && !c.0.lock().is_claimed());
        assert!(ex.is_idle());
    }
}
