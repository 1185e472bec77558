//! The renewal thread of a `RedlockGroup`, shared by all its guards: one timer
//! heap, whatever the number of guards. It fires every guard's loss signal at
//! its local loss deadline (validity end minus the node timeout) unless an
//! extension was confirmed by then, and for guards with a keep-alive it extends
//! the lease at half its TTL, retrying a failed extension while time remains.
//!
//! It follows the same timing rules as the single-deployment renewal thread
//! (`clock::renew_at`, `clock::retry_delay`); the extension itself is a group
//! operation, so one renewal blocks this thread for at most the node timeout.
//! It holds guards weakly: a dropped guard is forgotten.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Weak;
use std::time::Instant;

use crossbeam_channel::Sender;

use crate::lease::LeaseState;
use crate::runtime::clock;
use crate::runtime::timer::{self, Timers};

/// What one renewal attempt found.
pub(crate) enum Renewed {
    /// A quorum confirmed the extension; the lease state holds the new validity.
    Yes,
    /// The lease is gone (the attempt flagged it lost).
    Lost,
    /// No quorum this time; worth retrying while time remains.
    Failed,
}

/// A lease the thread can watch and renew.
pub(crate) trait Renewable: Send + Sync {
    fn state(&self) -> &LeaseState;
    /// One extension by the lease's TTL; blocks for at most the node timeout.
    fn renew(&self) -> Renewed;
}

enum Msg {
    Track(u64, Weak<dyn Renewable>),
    Reschedule(u64),
    Forget(u64),
}

/// The group's handle; the thread stops when it is dropped.
pub(crate) struct GroupRenewal {
    tx: Sender<Msg>,
}

impl GroupRenewal {
    pub(crate) fn spawn() -> std::io::Result<GroupRenewal> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let worker = Worker {
            entries: HashMap::new(),
            heap: BinaryHeap::new(),
        };
        std::thread::Builder::new()
            .name("respire-redlock".into())
            .spawn(move || timer::run(&rx, worker))?;
        Ok(GroupRenewal { tx })
    }

    pub(crate) fn track(&self, id: u64, lease: Weak<dyn Renewable>) {
        let _ = self.tx.send(Msg::Track(id, lease));
    }

    pub(crate) fn reschedule(&self, id: u64) {
        let _ = self.tx.send(Msg::Reschedule(id));
    }

    pub(crate) fn forget(&self, id: u64) {
        let _ = self.tx.send(Msg::Forget(id));
    }
}

struct Entry {
    lease: Weak<dyn Renewable>,
    next_try: Instant,
    version: u64,
}

struct Worker {
    entries: HashMap<u64, Entry>,
    heap: BinaryHeap<Reverse<(Instant, u64, u64)>>,
}

impl Timers for Worker {
    type Msg = Msg;

    fn next_due(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _, _))| *at)
    }

    fn handle(&mut self, msg: Msg) {
        self.handle_msg(msg);
    }

    fn process_due(&mut self) {
        self.run_due();
    }
}

impl Worker {
    fn handle_msg(&mut self, msg: Msg) {
        match msg {
            Msg::Track(id, lease) => {
                let Some(next_try) = lease
                    .upgrade()
                    .map(|l| clock::renew_at(l.state().sent(), l.state().ttl()))
                else {
                    return;
                };
                self.entries.insert(
                    id,
                    Entry {
                        lease,
                        next_try,
                        version: 0,
                    },
                );
                self.schedule(id);
            }
            Msg::Reschedule(id) => {
                let next = self
                    .entries
                    .get(&id)
                    .and_then(|e| e.lease.upgrade())
                    .map(|l| clock::renew_at(l.state().sent(), l.state().ttl()));
                if let (Some(next), Some(e)) = (next, self.entries.get_mut(&id)) {
                    e.next_try = next;
                    self.schedule(id);
                }
            }
            Msg::Forget(id) => {
                self.entries.remove(&id);
            }
        }
    }

    /// Pushes the entry's next event (renewal or loss deadline) on the heap.
    fn schedule(&mut self, id: u64) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        let Some(lease) = e.lease.upgrade() else {
            self.entries.remove(&id);
            return;
        };
        e.version += 1;
        let state = lease.state();
        let at = if state.keepalive_count() > 0 {
            e.next_try.min(state.lost_at())
        } else {
            state.lost_at()
        };
        self.heap.push(Reverse((at, id, e.version)));
    }

    fn run_due(&mut self) {
        loop {
            let now = Instant::now();
            let Some(&Reverse((at, id, version))) = self.heap.peek() else {
                return;
            };
            if at > now {
                return;
            }
            self.heap.pop();
            let Some(e) = self.entries.get(&id) else {
                continue;
            };
            if e.version != version {
                continue;
            }
            let Some(lease) = e.lease.upgrade() else {
                self.entries.remove(&id);
                continue;
            };
            let next_try = e.next_try;
            let state = lease.state();
            if state.is_done() || state.flagged_lost() {
                self.entries.remove(&id);
                continue;
            }
            if now >= state.lost_at() {
                state.mark_lost(if state.keepalive_count() > 0 {
                    "no extension reached a quorum before the loss deadline"
                } else {
                    "its validity ran out without keep-alive"
                });
                self.entries.remove(&id);
                continue;
            }
            if state.keepalive_count() == 0 || next_try > now {
                self.schedule(id);
                continue;
            }
            match lease.renew() {
                Renewed::Yes => {
                    let next = clock::renew_at(state.sent(), state.ttl());
                    if let Some(e) = self.entries.get_mut(&id) {
                        e.next_try = next;
                    }
                    self.schedule(id);
                }
                Renewed::Lost => {
                    self.entries.remove(&id);
                }
                Renewed::Failed => {
                    let next = Instant::now() + clock::retry_delay(state.ttl());
                    if let Some(e) = self.entries.get_mut(&id) {
                        e.next_try = next;
                    }
                    self.schedule(id);
                }
            }
        }
    }
}
