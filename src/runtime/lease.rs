//! One lease as the guard and the runtime share it: the pure `LeaseCore` behind a
//! lock, the loss signal, and the keep-alive count.
//!
//! The lock is never held across I/O or a wait. Every change reads the instant
//! it happens at from the caller (which reads the deployment's clock), and every
//! observation that finds the lease lost records the loss and closes the loss
//! signal before it returns, so `is_lost()` never turns false again and the
//! signal is closed by the time anyone sees `is_lost()` true.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::core::executor::Claim;
use crate::core::lease::{Confirmed, LeaseCore, Loss, Refusal, Ticket, Verdict};
use crate::core::schedule::{Next, Watched};
use crate::observe::{LossCause, Observer, Primitive, Watching};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

struct State {
    core: LeaseCore,
    /// Dropped (closing the signal) when the lease is lost or finished.
    signal: Option<Sender<()>>,
    /// Signals shared with other leases, each emptied (closing it) when this
    /// lease is lost or finished.
    shared: Vec<Arc<SharedSignal>>,
    keepalives: usize,
    warned: bool,
    /// A loss recorded for the observer, reported once the lock is released.
    unreported: Option<(LossCause, String)>,
}

/// The locked state; reports a loss recorded under the lock after unlocking,
/// so that an observer never runs under it.
struct Locked<'a, X> {
    cell: &'a LeaseCell<X>,
    state: Option<MutexGuard<'a, State>>,
}

impl<X> Deref for Locked<'_, X> {
    type Target = State;
    fn deref(&self) -> &State {
        self.state.as_ref().expect("held until dropped")
    }
}

impl<X> DerefMut for Locked<'_, X> {
    fn deref_mut(&mut self) -> &mut State {
        self.state.as_mut().expect("held until dropped")
    }
}

impl<X> Drop for Locked<'_, X> {
    fn drop(&mut self) {
        let loss = self.state.as_mut().and_then(|s| s.unreported.take());
        self.state = None;
        if let (Some((cause, detail)), Some(w)) = (loss, self.cell.watching.get()) {
            w.lost(&self.cell.key, self.cell.id, cause, &detail);
        }
    }
}

/// The sender of a loss signal shared by several leases: whichever of them is
/// lost first takes it out, closing the signal.
pub(crate) type SharedSignal = Mutex<Option<Sender<()>>>;

/// A lease shared by its guard and the runtime; `X` is what the runtime needs
/// to renew it (the commands for one deployment, the node keys of a group).
pub(crate) struct LeaseCell<X> {
    id: u64,
    key: String,
    extra: X,
    state: Mutex<State>,
    claim_freed: Condvar,
    signal: OnceLock<Receiver<()>>,
    watched: AtomicBool,
    /// The observer told of renewals, loss and release, if any.
    watching: OnceLock<Watching>,
}

impl<X> LeaseCell<X> {
    pub(crate) fn new(key: String, extra: X, core: LeaseCore) -> Self {
        LeaseCell {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            key,
            extra,
            state: Mutex::new(State {
                core,
                signal: None,
                shared: Vec::new(),
                keepalives: 0,
                warned: false,
                unreported: None,
            }),
            claim_freed: Condvar::new(),
            signal: OnceLock::new(),
            watched: AtomicBool::new(false),
            watching: OnceLock::new(),
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    pub(crate) fn extra(&self) -> &X {
        &self.extra
    }

    /// Has `observer`, if any, hear of this lease's renewals, loss and release.
    pub(crate) fn observe_with(&self, observer: Option<&Arc<dyn Observer>>, primitive: Primitive) {
        if let Some(observer) = observer {
            let _ = self.watching.set(Watching {
                observer: observer.clone(),
                primitive,
            });
        }
    }

    /// The observer of this lease, if any.
    pub(crate) fn watching(&self) -> Option<&Watching> {
        self.watching.get()
    }

    /// Records a loss the core reports at `now` and closes the signal.
    fn settle(&self, s: &mut State, now: Instant) {
        s.core.observe(now);
        if s.core.is_lost(now) {
            if let Some(loss) = s.core.loss()
                && !s.warned
                && !s.core.is_finished()
            {
                s.warned = true;
                log::warn!("lease {:?} lost: {loss}", self.key);
                if self.watching.get().is_some() {
                    s.unreported = Some((cause_of(loss, s.keepalives), loss.to_string()));
                }
            }
            s.signal.take();
            for shared in s.shared.drain(..) {
                shared.lock().take();
            }
        }
    }

    fn lock(&self, now: Instant) -> Locked<'_, X> {
        let mut s = self.locked();
        self.settle(&mut s, now);
        s
    }

    fn locked(&self) -> Locked<'_, X> {
        Locked {
            cell: self,
            state: Some(self.state.lock()),
        }
    }

    /// Lost at `now` (permanently, once true).
    pub(crate) fn is_lost(&self, now: Instant) -> bool {
        self.lock(now).core.is_lost(now)
    }

    pub(crate) fn remaining(&self, now: Instant) -> Duration {
        self.lock(now).core.remaining(now)
    }

    pub(crate) fn ttl(&self) -> Duration {
        self.state.lock().core.ttl()
    }

    pub(crate) fn lost_at(&self) -> Instant {
        self.state.lock().core.lost_at()
    }

    /// See [`LeaseCore::drift_factor`].
    pub(crate) fn drift_factor(&self) -> f64 {
        self.state.lock().core.drift_factor()
    }

    pub(crate) fn valid_until(&self) -> Instant {
        self.state.lock().core.valid_until()
    }

    /// The loss signal: a channel that never delivers and disconnects on loss
    /// or finish. Made on first use.
    pub(crate) fn signal(&self, now: Instant) -> &Receiver<()> {
        self.signal.get_or_init(|| {
            let (tx, rx) = crossbeam_channel::bounded(0);
            let mut s = self.lock(now);
            if !s.core.is_lost(now) {
                s.signal = Some(tx);
            }
            rx
        })
    }

    /// Has `shared` emptied when this lease is lost or finished, or at once
    /// if it is already.
    pub(crate) fn close_on_loss(&self, shared: &Arc<SharedSignal>, now: Instant) {
        let mut s = self.lock(now);
        if s.core.is_lost(now) {
            shared.lock().take();
        } else {
            s.shared.push(shared.clone());
        }
    }

    /// Marks the lease watched by the renewal thread; true the first time.
    pub(crate) fn watch(&self) -> bool {
        !self.watched.swap(true, Ordering::AcqRel)
    }

    pub(crate) fn is_watched(&self) -> bool {
        self.watched.load(Ordering::Acquire)
    }

    pub(crate) fn add_keepalive(&self) {
        self.state.lock().keepalives += 1;
    }

    pub(crate) fn remove_keepalive(&self) {
        let mut s = self.state.lock();
        s.keepalives = s.keepalives.saturating_sub(1);
    }

    /// Claims the lease for an extension sent at `now` (see
    /// [`LeaseCore::begin_extend`]).
    pub(crate) fn begin_extend(&self, now: Instant, ttl: Duration) -> Result<Ticket, Refusal> {
        let mut s = self.lock(now);
        let r = s.core.begin_extend(now, ttl);
        self.settle(&mut s, now);
        r
    }

    /// Claims the lease at `now` for a renewal by its TTL (the schedule's
    /// [`Watched::claim`]).
    pub(crate) fn claim_renewal(&self, now: Instant) -> Option<(Ticket, Duration)> {
        let ttl = self.ttl();
        self.begin_extend(now, ttl).ok().map(|ticket| (ticket, ttl))
    }

    /// Waits until no extension of this lease is claimed, or `until`; true if free.
    pub(crate) fn wait_unclaimed(&self, until: Instant) -> bool {
        let mut s = self.state.lock();
        while s.core.is_claimed() {
            if self.claim_freed.wait_until(&mut s, until).timed_out() {
                return !s.core.is_claimed();
            }
        }
        true
    }

    fn change(&self, now: Instant, f: impl FnOnce(&mut LeaseCore)) {
        let mut s = self.locked();
        let claimed = s.core.is_claimed();
        f(&mut s.core);
        self.settle(&mut s, now);
        if claimed && !s.core.is_claimed() {
            self.claim_freed.notify_all();
        }
    }

    /// The extension was confirmed at `now`; what that did to the lease
    /// (see [`LeaseCore::extended`]).
    pub(crate) fn extended(&self, ticket: Ticket, now: Instant) -> Confirmed {
        let mut confirmed = Confirmed::Stale;
        let mut margin = Duration::ZERO;
        self.change(now, |c| {
            margin = c.valid_until().saturating_duration_since(now);
            confirmed = c.extended(ticket, now);
        });
        if confirmed == Confirmed::Held
            && let Some(w) = self.watching.get()
        {
            w.renewed(&self.key, self.id, self.ttl(), margin);
        }
        confirmed
    }

    pub(crate) fn refused(&self, ticket: Ticket, now: Instant, loss: Loss) {
        self.change(now, |c| c.refused(ticket, loss));
    }

    pub(crate) fn not_sent(&self, ticket: Ticket, now: Instant) {
        self.change(now, |c| c.not_sent(ticket));
    }

    pub(crate) fn unanswered(&self, ticket: Ticket, now: Instant) {
        self.change(now, |c| c.unanswered(ticket));
    }

    pub(crate) fn fenced(&self, ticket: Ticket, now: Instant) {
        self.change(now, |c| c.fenced(ticket));
    }

    /// See [`LeaseCore::unfenceable`].
    pub(crate) fn unfenceable(&self, ticket: Ticket, now: Instant) {
        self.change(now, |c| c.unfenceable(ticket));
    }

    /// Applies what a verification sent at `sent` found (see
    /// [`LeaseCore::verified`]); whether the lease is still held.
    pub(crate) fn verified(&self, verdict: Verdict, sent: Instant, now: Instant) -> bool {
        let mut held = false;
        self.change(now, |c| {
            verdict.apply(c, sent, now);
            held = !c.is_lost(now);
        });
        held
    }

    /// The server the lease lives on changed, to the server `current` (see
    /// [`LeaseCore::switched`]).
    pub(crate) fn switched(&self, now: Instant, current: Option<u64>) {
        self.change(now, |c| {
            c.switched(current);
        });
    }

    /// See [`LeaseCore::dispatched`]: whether the extension claimed with
    /// `ticket` may go to `server`.
    pub(crate) fn dispatched(&self, ticket: Ticket, server: u64) -> bool {
        self.locked().core.dispatched(ticket, server)
    }

    /// See [`LeaseCore::clock_gained`].
    pub(crate) fn clock_gained(&self, gain: Duration, detected: Instant) {
        self.change(detected, |c| c.clock_gained(gain, detected));
    }

    pub(crate) fn mark_lost(&self, now: Instant, loss: Loss) {
        self.change(now, |c| {
            c.mark_lost(loss);
        });
    }

    /// The holder let go: lost from now on, without a warning; the signal closes.
    pub(crate) fn finish(&self, now: Instant) {
        self.change(now, LeaseCore::finish);
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.state.lock().core.is_finished()
    }

    /// What the renewal schedule should do next with this lease.
    pub(crate) fn next(&self, now: Instant) -> Next {
        let s = self.lock(now);
        if s.core.is_lost(now) {
            return Next::Gone;
        }
        let renew = (s.keepalives > 0 && !s.core.is_claimed())
            .then(|| (s.core.renew_at(), s.core.ttl() / 8));
        Next::Wait {
            lost_at: s.core.lost_at(),
            renew,
        }
    }
}

/// How a loss is told to observers: a deadline is an expiry for a lease no
/// keep-alive renews, and a renewal not confirmed for one it does.
fn cause_of(loss: &Loss, keepalives: usize) -> LossCause {
    match loss {
        Loss::Deadline if keepalives == 0 => LossCause::Expired,
        Loss::Deadline | Loss::LateConfirmation => LossCause::RenewalUnconfirmed,
        Loss::Gone => LossCause::Gone,
        Loss::TakenOver => LossCause::TakenOver,
        Loss::Other(_) => LossCause::Other,
    }
}

#[cfg(test)]
impl<X> LeaseCell<X> {
    /// Whether the lease counts as lost at `now`, recording nothing.
    pub(crate) fn peek_lost(&self, now: Instant) -> bool {
        self.state.lock().core.is_lost(now)
    }

    /// Whether the loss signal was made and is closed.
    pub(crate) fn signal_closed(&self) -> bool {
        self.signal.get().is_some() && self.state.lock().signal.is_none()
    }
}

/// What carries a lease's cell: the cell itself, or a lease of another
/// backend around one (a Redlock lease). The renewal thread watches it, and
/// a [`LiveLeases`] tells whether it is finished, through its cell.
pub(crate) trait HasCell {
    /// What the cell carries besides the lease's state.
    type Extra;
    /// The lease's cell.
    fn cell(&self) -> &LeaseCell<Self::Extra>;
}

impl<X> HasCell for LeaseCell<X> {
    type Extra = X;
    fn cell(&self) -> &LeaseCell<X> {
        self
    }
}

impl<T: HasCell> HasCell for Arc<T> {
    type Extra = T::Extra;
    fn cell(&self) -> &LeaseCell<T::Extra> {
        (**self).cell()
    }
}

impl<T: HasCell> Watched for Arc<T> {
    fn id(&self) -> u64 {
        self.cell().id()
    }

    fn poll(&self, now: Instant) -> Next {
        self.cell().next(now)
    }

    fn claim(&self, now: Instant) -> Option<(Ticket, Duration)> {
        self.cell().claim_renewal(now)
    }
}

impl<X> Claim for LeaseCell<X> {
    fn id(&self) -> u64 {
        LeaseCell::id(self)
    }
    fn ttl(&self) -> Duration {
        LeaseCell::ttl(self)
    }
    fn lost_at(&self) -> Instant {
        LeaseCell::lost_at(self)
    }
    fn is_lost(&self, now: Instant) -> bool {
        LeaseCell::is_lost(self, now)
    }
    fn begin_extend(&self, now: Instant, ttl: Duration) -> Result<Ticket, Refusal> {
        LeaseCell::begin_extend(self, now, ttl)
    }
    fn extended(&self, ticket: Ticket, now: Instant) -> Confirmed {
        LeaseCell::extended(self, ticket, now)
    }
    fn refused(&self, ticket: Ticket, now: Instant, loss: Loss) {
        LeaseCell::refused(self, ticket, now, loss)
    }
    fn not_sent(&self, ticket: Ticket, now: Instant) {
        LeaseCell::not_sent(self, ticket, now)
    }
    fn unanswered(&self, ticket: Ticket, now: Instant) {
        LeaseCell::unanswered(self, ticket, now)
    }
    fn fenced(&self, ticket: Ticket, now: Instant) {
        LeaseCell::fenced(self, ticket, now)
    }
    fn unfenceable(&self, ticket: Ticket, now: Instant) {
        LeaseCell::unfenceable(self, ticket, now)
    }
}

/// What every lease cell answers, whatever it carries for its backend: what
/// the one guard family reads and changes.
pub(crate) trait LeaseView: Claim + Send + Sync {
    fn key(&self) -> &str;
    fn remaining(&self, now: Instant) -> Duration;
    fn signal(&self, now: Instant) -> &Receiver<()>;
    fn mark_lost(&self, now: Instant, loss: Loss);
    fn wait_unclaimed(&self, until: Instant) -> bool;
    fn add_keepalive(&self);
    fn remove_keepalive(&self);
    fn is_finished(&self) -> bool;
}

impl<X: Send + Sync> LeaseView for LeaseCell<X> {
    fn key(&self) -> &str {
        LeaseCell::key(self)
    }
    fn remaining(&self, now: Instant) -> Duration {
        LeaseCell::remaining(self, now)
    }
    fn signal(&self, now: Instant) -> &Receiver<()> {
        LeaseCell::signal(self, now)
    }
    fn mark_lost(&self, now: Instant, loss: Loss) {
        LeaseCell::mark_lost(self, now, loss);
    }
    fn wait_unclaimed(&self, until: Instant) -> bool {
        LeaseCell::wait_unclaimed(self, until)
    }
    fn add_keepalive(&self) {
        LeaseCell::add_keepalive(self);
    }
    fn remove_keepalive(&self) {
        LeaseCell::remove_keepalive(self);
    }
    fn is_finished(&self) -> bool {
        LeaseCell::is_finished(self)
    }
}

/// Live leases, by weak reference, to judge again when something happens to
/// their servers (a topology change, a server clock that ran ahead, a Redlock
/// node that went away or restarted); the finished ones are pruned each time
/// the list has doubled.
pub(crate) struct LiveLeases<T> {
    inner: Mutex<Live<T>>,
}

struct Live<T> {
    leases: Vec<Weak<T>>,
    prune_at: usize,
}

impl<T: HasCell> LiveLeases<T> {
    pub(crate) fn new() -> Self {
        LiveLeases {
            inner: Mutex::new(Live {
                leases: Vec::new(),
                prune_at: 64,
            }),
        }
    }

    /// Remembers a new lease.
    pub(crate) fn register(&self, lease: &Arc<T>) {
        let mut live = self.inner.lock();
        if live.leases.len() >= live.prune_at {
            live.leases
                .retain(|w| w.upgrade().is_some_and(|l| !l.cell().is_finished()));
            live.prune_at = (live.leases.len() * 2).max(64);
        }
        live.leases.push(Arc::downgrade(lease));
    }

    /// The live leases (not finished) that `keep` selects.
    pub(crate) fn live_where(&self, keep: impl Fn(&T) -> bool) -> Vec<Arc<T>> {
        self.inner
            .lock()
            .leases
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|l| !l.cell().is_finished() && keep(l))
            .collect()
    }
}

impl<X> std::fmt::Debug for LeaseCell<X> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseCell")
            .field("id", &self.id)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::timing::Timing;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn cell(t0: Instant) -> LeaseCell<()> {
        let timing = Timing {
            drift_factor: 0.0,
            node_timeout: ms(100),
        };
        LeaseCell::new("k".into(), (), LeaseCore::granted(timing, t0, ms(1_000)))
    }

    #[test]
    fn the_signal_is_closed_once_is_lost_is_seen_true() {
        let t0 = Instant::now();
        let c = cell(t0);
        let rx = c.signal(t0).clone();
        assert!(rx.try_recv().unwrap_err().is_empty());
        assert!(c.is_lost(t0 + ms(898)));
        assert!(rx.try_recv().unwrap_err().is_disconnected());
        // Permanent, even if a confirmation arrives.
        assert_eq!(c.begin_extend(t0 + ms(10), ms(1_000)), Err(Refusal::Lost));
        assert!(c.is_lost(t0 + ms(10)));
    }

    #[test]
    fn a_shared_signal_closes_when_the_first_of_its_leases_is_lost() {
        let t0 = Instant::now();
        let (early, late) = (cell(t0), cell(t0 + ms(500)));
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        let shared = Arc::new(Mutex::new(Some(tx)));
        early.close_on_loss(&shared, t0);
        late.close_on_loss(&shared, t0);
        assert!(!late.is_lost(t0 + ms(898)));
        assert!(rx.try_recv().unwrap_err().is_empty());
        assert!(early.is_lost(t0 + ms(898)));
        assert!(rx.try_recv().unwrap_err().is_disconnected());
        // A lease lost already closes a signal joined later at once.
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        early.close_on_loss(&Arc::new(Mutex::new(Some(tx))), t0 + ms(898));
        assert!(rx.try_recv().unwrap_err().is_disconnected());
    }

    #[test]
    fn a_signal_asked_for_after_the_loss_is_closed_at_once() {
        let t0 = Instant::now();
        let c = cell(t0);
        assert!(c.is_lost(t0 + ms(900)));
        assert!(
            c.signal(t0 + ms(900))
                .try_recv()
                .unwrap_err()
                .is_disconnected()
        );
    }

    #[test]
    fn waiting_for_a_claim_wakes_when_it_is_released() {
        let t0 = Instant::now();
        let c = std::sync::Arc::new(cell(t0));
        let ticket = c.begin_extend(t0, ms(1_000)).unwrap();
        let c2 = c.clone();
        let waiter =
            std::thread::spawn(move || c2.wait_unclaimed(Instant::now() + Duration::from_secs(10)));
        c.not_sent(ticket, t0);
        assert!(waiter.join().unwrap());
    }
}
