//! The renewal schedule: which watched leases are due for a renewal or past
//! their loss deadline, as a pure timer heap driven by the instants passed in.
//!
//! The runtime's renewal thread owns one `Schedule` and does no I/O itself: it
//! hands due renewals to an executor (a connection's worker, or the nodes of a
//! Redlock group) and keeps firing loss deadlines while they run. So a guard's
//! loss signal never waits on a socket.
//!
//! A lease is watched only once someone needs the thread: its holder asked for
//! the loss signal or started a keep-alive. Renewals due together go out as
//! one batch: when one is due, every renewal due within an eighth of its TTL
//! rides along.
//!
//! Every renewal begins here: a due lease is claimed for its extension
//! ([`Watched::claim`]) before it is handed out, so the renewal thread of a
//! deployment and of a Redlock group (and the simulation of each) hand their
//! transports claims, never leases to claim.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use crate::core::executor::Claimed;
use crate::core::lease::Ticket;

/// What the schedule needs to know of a lease.
pub(crate) trait Watched {
    fn id(&self) -> u64;
    /// Looks at the lease at `now`. A lease past its loss deadline records
    /// the loss and fires its signal here.
    fn poll(&self, now: Instant) -> Next;
    /// Claims the lease at `now` for a renewal to its TTL (see
    /// `LeaseCore::begin_extend`): the claim's ticket and the TTL, or `None`
    /// when it cannot be claimed (lost, or the holder's own extension is in
    /// flight, whose end plans the lease again).
    fn claim(&self, now: Instant) -> Option<(Ticket, Duration)>;
}

/// What comes next for a watched lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Lost or released: nothing more to do.
    Gone,
    /// Held: its loss deadline, and when it wants a renewal (`None` when it is
    /// not kept alive or another extension of it is in flight).
    Wait {
        lost_at: Instant,
        renew: Option<(Instant, Duration)>,
    },
}

struct Entry<L> {
    lease: L,
    version: u64,
    at: Instant,
    in_flight: bool,
    retry_at: Option<Instant>,
}

/// The timer heap of watched leases.
pub(crate) struct Schedule<L> {
    entries: HashMap<u64, Entry<L>>,
    heap: BinaryHeap<Reverse<(Instant, u64, u64)>>,
}

impl<L> Default for Schedule<L> {
    fn default() -> Self {
        Schedule {
            entries: HashMap::new(),
            heap: BinaryHeap::new(),
        }
    }
}

impl<L: Watched + Clone> Schedule<L> {
    /// Starts watching a lease (or re-reads one already watched).
    pub(crate) fn watch(&mut self, lease: L, now: Instant) {
        let id = lease.id();
        match self.entries.get_mut(&id) {
            Some(e) => e.lease = lease,
            None => {
                self.entries.insert(
                    id,
                    Entry {
                        lease,
                        version: 0,
                        at: now,
                        in_flight: false,
                        retry_at: None,
                    },
                );
            }
        }
        self.plan(id, now);
    }

    /// Stops watching a lease (released).
    pub(crate) fn forget(&mut self, id: u64) {
        if self.entries.remove(&id).is_some() {
            self.compact();
        }
    }

    /// Something about the lease changed (keep-alive started or stopped, its
    /// deadline moved, a claim was released): plan it again.
    pub(crate) fn touch(&mut self, id: u64, now: Instant) {
        if self.entries.contains_key(&id) {
            self.plan(id, now);
        }
    }

    /// The executor finished a renewal of the lease; `retry_at` is set when it
    /// failed and should be tried again then.
    pub(crate) fn completed(&mut self, id: u64, now: Instant, retry_at: Option<Instant>) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.in_flight = false;
            e.retry_at = retry_at;
            self.plan(id, now);
        }
    }

    #[cfg(test)]
    fn is_watched(&self, id: u64) -> bool {
        self.entries.contains_key(&id)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    /// Heap slots, live and stale (for the memory test).
    #[cfg(test)]
    fn heap_len(&self) -> usize {
        self.heap.len()
    }

    /// When the earliest timer is due.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Handles every timer due at `now`: fires loss deadlines (through
    /// [`Watched::poll`]) and returns the renewals to send now, each lease
    /// claimed for its extension and marked in flight. Whoever takes a claim
    /// settles it, or gives it up when nothing was sent, and then reports the
    /// renewal [`completed`](Schedule::completed).
    pub(crate) fn due(&mut self, now: Instant) -> Vec<Claimed<L>> {
        let mut batch: Vec<Claimed<L>> = Vec::new();
        let mut replan: Vec<u64> = Vec::new();
        let mut window: Option<Instant> = None;
        while let Some(&Reverse((at, id, version))) = self.heap.peek() {
            let horizon = window.unwrap_or(now).max(now);
            if at > horizon {
                break;
            }
            self.heap.pop();
            let Some(e) = self.entries.get_mut(&id) else {
                continue;
            };
            if e.version != version {
                continue;
            }
            match e.lease.poll(now) {
                Next::Gone => {
                    self.entries.remove(&id);
                }
                Next::Wait { lost_at, renew } => {
                    let retry_ok = e.retry_at.is_none_or(|r| r <= horizon);
                    if let Some((renew_at, slack)) = renew
                        && !e.in_flight
                        && retry_ok
                        && renew_at <= horizon
                        && lost_at > now
                        // Due (or due soon enough to ride along). One that
                        // cannot be claimed is planned again below, as its
                        // state says.
                        && let Some((ticket, ttl)) = e.lease.claim(now)
                    {
                        e.in_flight = true;
                        e.retry_at = None;
                        batch.push((e.lease.clone(), ticket, ttl));
                        if window.is_none() {
                            window = Some(now + slack);
                        }
                    }
                    // Planned again once the heap holds only what is left,
                    // so that nothing is popped twice in one pass.
                    replan.push(id);
                }
            }
        }
        for id in replan {
            self.plan(id, now);
        }
        batch
    }

    /// Pushes the entry's next event: its loss deadline, and its renewal when
    /// one is wanted and not in flight.
    fn plan(&mut self, id: u64, now: Instant) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        let next = e.lease.poll(now);
        let Next::Wait { lost_at, renew } = next else {
            self.entries.remove(&id);
            return;
        };
        let mut at = lost_at;
        if let Some((renew_at, _)) = renew
            && !e.in_flight
        {
            let renew_at = e.retry_at.map_or(renew_at, |r| r.max(renew_at));
            at = at.min(renew_at);
        }
        // A timer in the past fires at once, and only once.
        at = at.max(now);
        e.version += 1;
        e.at = at;
        self.heap.push(Reverse((at, id, e.version)));
        self.compact();
    }

    /// Rebuilds the heap when stale slots outnumber live ones, so that memory
    /// follows the number of watched leases, not the number ever watched.
    fn compact(&mut self) {
        if self.heap.len() > 64 && self.heap.len() > 2 * self.entries.len() {
            self.heap = self
                .entries
                .iter()
                .map(|(&id, e)| Reverse((e.at, id, e.version)))
                .collect();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[derive(Debug)]
    struct Model {
        id: u64,
        lost_at: Instant,
        renew_at: Option<Instant>,
        fired: bool,
        gone: bool,
        /// Whether a renewal can claim it (no extension of it in flight).
        free: bool,
        claims: u64,
    }

    #[derive(Clone, Debug)]
    struct M(Rc<RefCell<Model>>);

    impl Watched for M {
        fn id(&self) -> u64 {
            self.0.borrow().id
        }
        fn poll(&self, now: Instant) -> Next {
            let mut m = self.0.borrow_mut();
            if m.gone {
                return Next::Gone;
            }
            if now >= m.lost_at {
                m.fired = true;
                return Next::Gone;
            }
            Next::Wait {
                lost_at: m.lost_at,
                renew: m.renew_at.map(|r| (r, ms(100))),
            }
        }
        fn claim(&self, _: Instant) -> Option<(Ticket, Duration)> {
            let mut m = self.0.borrow_mut();
            m.claims += 1;
            m.free.then(|| (Ticket::numbered(m.claims), ms(1_000)))
        }
    }

    fn model(id: u64, lost_at: Instant, renew_at: Option<Instant>) -> M {
        M(Rc::new(RefCell::new(Model {
            id,
            lost_at,
            renew_at,
            fired: false,
            gone: false,
            free: true,
            claims: 0,
        })))
    }

    #[test]
    fn loss_deadlines_fire_while_a_renewal_is_in_flight() {
        let t0 = Instant::now();
        let mut s = Schedule::default();
        let a = model(1, t0 + ms(1_000), Some(t0 + ms(500)));
        let b = model(2, t0 + ms(700), None);
        s.watch(a.clone(), t0);
        s.watch(b.clone(), t0);
        assert_eq!(s.next_due(), Some(t0 + ms(500)));
        let batch = s.due(t0 + ms(500));
        assert_eq!(batch.len(), 1);
        // a is in flight; b's deadline still comes.
        assert_eq!(s.next_due(), Some(t0 + ms(700)));
        assert!(s.due(t0 + ms(700)).is_empty());
        assert!(b.0.borrow().fired);
        assert!(!s.is_watched(2));
        // a's deadline is still watched while in flight.
        assert_eq!(s.next_due(), Some(t0 + ms(1_000)));
    }

    #[test]
    fn renewals_due_soon_ride_along() {
        let t0 = Instant::now();
        let mut s = Schedule::default();
        let a = model(1, t0 + ms(10_000), Some(t0 + ms(500)));
        let b = model(2, t0 + ms(10_000), Some(t0 + ms(550)));
        let c = model(3, t0 + ms(10_000), Some(t0 + ms(900)));
        for m in [&a, &b, &c] {
            s.watch(m.clone(), t0);
        }
        let batch = s.due(t0 + ms(500));
        let ids: Vec<u64> = batch.iter().map(|(m, _, _)| m.id()).collect();
        assert_eq!(ids, vec![1, 2]);
        assert_eq!(s.next_due(), Some(t0 + ms(900)));
    }

    #[test]
    fn a_due_lease_is_handed_out_claimed_and_one_that_cannot_be_claimed_is_not() {
        let t0 = Instant::now();
        let mut s = Schedule::default();
        let a = model(1, t0 + ms(10_000), Some(t0 + ms(500)));
        let b = model(2, t0 + ms(10_000), Some(t0 + ms(500)));
        b.0.borrow_mut().free = false;
        s.watch(a.clone(), t0);
        s.watch(b.clone(), t0);
        let batch = s.due(t0 + ms(500));
        assert_eq!(batch.len(), 1);
        let (lease, ticket, ttl) = &batch[0];
        assert_eq!(
            (lease.id(), *ticket, *ttl),
            (1, Ticket::numbered(1), ms(1_000))
        );
        assert_eq!(b.0.borrow().claims, 1);
        // Not in flight: tried again at its next timer, and handed out once
        // it can be claimed.
        assert_eq!(s.next_due(), Some(t0 + ms(500)));
        b.0.borrow_mut().free = true;
        let again = s.due(t0 + ms(500));
        assert_eq!(
            again.iter().map(|(m, _, _)| m.id()).collect::<Vec<_>>(),
            vec![2]
        );
        assert_eq!(s.next_due(), Some(t0 + ms(10_000)));
    }

    #[test]
    fn a_failed_renewal_is_retried_at_its_time() {
        let t0 = Instant::now();
        let mut s = Schedule::default();
        let a = model(1, t0 + ms(10_000), Some(t0 + ms(500)));
        s.watch(a.clone(), t0);
        assert_eq!(s.due(t0 + ms(500)).len(), 1);
        s.completed(1, t0 + ms(600), Some(t0 + ms(650)));
        assert_eq!(s.next_due(), Some(t0 + ms(650)));
        assert!(s.due(t0 + ms(640)).is_empty());
        assert_eq!(s.due(t0 + ms(650)).len(), 1);
    }

    #[test]
    fn forgotten_leases_do_not_keep_heap_slots() {
        let t0 = Instant::now();
        let mut s = Schedule::default();
        for id in 0..100_000 {
            s.watch(model(id, t0 + ms(3_600_000), None), t0);
            s.forget(id);
        }
        assert_eq!(s.len(), 0);
        assert!(s.heap_len() <= 65, "{}", s.heap_len());
    }

    #[test]
    fn replanned_leases_do_not_keep_heap_slots() {
        // Every touch pushes a new slot and leaves the old one stale; the
        // heap is rebuilt before stale slots outnumber live ones.
        let t0 = Instant::now();
        let mut s = Schedule::default();
        let leases: Vec<M> = (0..100)
            .map(|id| model(id, t0 + ms(3_600_000), Some(t0 + ms(1_800_000))))
            .collect();
        for l in &leases {
            s.watch(l.clone(), t0);
        }
        let mut most = 0;
        for round in 0..1_000 {
            for id in 0..100 {
                s.touch(id, t0 + ms(round));
                most = most.max(s.heap_len());
            }
        }
        assert_eq!(s.len(), 100);
        assert!(most <= 2 * 100 + 1, "{most}");
    }

    #[test]
    fn gone_leases_are_dropped() {
        let t0 = Instant::now();
        let mut s = Schedule::default();
        let a = model(1, t0 + ms(1_000), None);
        s.watch(a.clone(), t0);
        a.0.borrow_mut().gone = true;
        s.touch(1, t0);
        assert!(!s.is_watched(1));
        assert!(!a.0.borrow().fired);
    }
}
