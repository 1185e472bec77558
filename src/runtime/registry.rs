//! The waiter registry: a deployment's waiters by key, each key's queue, and
//! the wake-ups — an invalidation wakes the first waiter of each class on its
//! key, a waiter that leaves the front of a queue wakes the next. The waits
//! that register here, and why they queue as they do, are described in
//! `waiters.rs`.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use crate::cancel::{CancelToken, OnCancel};
use crate::clock::Clock;
use crate::observe::{self, Observer};

/// How long after a wait on a key had to wait its next wait in this process
/// still yields first.
pub(super) const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// One waiter in the queue of one key.
struct Entry {
    id: u64,
    /// Waiters with the same class wait on the same keys; a wake-up of a key
    /// goes to the first waiter of each class in its queue.
    class: u64,
    tx: Sender<()>,
}

/// The waiters on one key, first in line first.
type Queue = VecDeque<Entry>;

/// The wake-up senders of the first waiter of each class in `queue`, added to
/// `to`.
fn firsts(queue: &Queue, to: &mut Vec<Sender<()>>) {
    let mut classes: Vec<u64> = Vec::new();
    for e in queue {
        if !classes.contains(&e.class) {
            classes.push(e.class);
            to.push(e.tx.clone());
        }
    }
}

/// Wakes the waiters behind `senders`, after the registry's lock is let go:
/// a woken waiter that preempts the waking thread finds nothing held.
fn wake(senders: Vec<Sender<()>>) {
    for tx in senders {
        let _ = tx.try_send(());
    }
}

/// The class of a waiter on `keys`: the same for every waiter on the same keys.
fn class_of(keys: &[&str]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    keys.len().hash(&mut h);
    for key in keys {
        key.as_bytes().hash(&mut h);
    }
    h.finish()
}

/// Waiters by key, for a whole deployment: every server's invalidation
/// subscriber wakes them (a key lives on one server at a time).
pub(crate) struct Registry {
    /// The deployment, for log messages.
    addr: String,
    queues: Mutex<HashMap<Vec<u8>, Queue>>,
    warned: AtomicBool,
    next_id: AtomicU64,
    /// Told of the fall-back to polling, and of topology changes.
    observer: Option<Arc<dyn Observer>>,
    /// Keys a wait in this process had to wait for (it found the key held),
    /// with when the last such wait was granted: someone else, maybe in
    /// another process, wants them too.
    contended: Mutex<HashMap<Vec<u8>, Instant>>,
    /// The deployment's clock, which every wait reads.
    clock: Arc<dyn Clock>,
}

impl Registry {
    pub(crate) fn new(addr: String, clock: Arc<dyn Clock>) -> Self {
        Registry {
            addr,
            queues: Mutex::new(HashMap::new()),
            warned: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            observer: None,
            contended: Mutex::new(HashMap::new()),
            clock,
        }
    }

    /// The deployment, for log messages.
    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    /// The instant now, by the deployment's clock.
    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The same registry, telling `observer` what it logs once.
    pub(crate) fn observed_by(self, observer: Option<Arc<dyn Observer>>) -> Self {
        Registry { observer, ..self }
    }

    /// The deployment's observer, if any.
    pub(crate) fn observer(&self) -> Option<&Arc<dyn Observer>> {
        self.observer.as_ref()
    }

    /// Logs, once per coordinator, that waiters poll because of `why`.
    pub(crate) fn fallback(&self, why: &str) {
        if !self.warned.swap(true, Ordering::AcqRel) {
            log::warn!(
                "waiting on {} falls back to polling every 50–150 ms: {why} \
                 (logged once per coordinator)",
                self.addr
            );
            observe::polling(self.observer(), &self.addr, why);
        }
    }

    /// Queues a waiter on every key whose change may free what it waits for.
    /// A waiter `on_its_own` is a class of its own: every change of its keys
    /// wakes it, whoever else waits.
    pub(super) fn register(
        &self,
        keys: &[&str],
        on_its_own: bool,
        cancel: Option<&CancelToken>,
    ) -> Waiter<'_> {
        self.enqueue(keys, on_its_own, false, cancel)
            .expect("an unconditional registration")
    }

    /// Queues a waiter behind the waiters of its class already queued on its
    /// first key, if there are any (checked and queued at once, so the waiter
    /// ahead is still there to pass the turn on); `None` when there are none.
    pub(super) fn register_behind(
        &self,
        keys: &[&str],
        cancel: Option<&CancelToken>,
    ) -> Option<Waiter<'_>> {
        // Nobody queued on any key (the uncontended path): no class to work
        // out, no key to look up. A waiter that queues meanwhile queued after
        // this check, as it would have after the one in `enqueue`.
        if self.queues.lock().is_empty() {
            return None;
        }
        self.enqueue(keys, false, true, cancel)
    }

    fn enqueue(
        &self,
        names: &[&str],
        on_its_own: bool,
        behind: bool,
        cancel: Option<&CancelToken>,
    ) -> Option<Waiter<'_>> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let class = if on_its_own {
            id.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        } else {
            class_of(names)
        };
        let (tx, rx);
        let keys: Vec<Vec<u8>>;
        {
            let mut queues = self.queues.lock();
            // Nothing is allocated for a wait that finds nobody to queue
            // behind (the uncontended path).
            if behind
                && !queues
                    .get(names[0].as_bytes())
                    .is_some_and(|q| q.iter().any(|e| e.class == class))
            {
                return None;
            }
            (tx, rx) = crossbeam_channel::bounded(1);
            keys = names.iter().map(|k| k.as_bytes().to_vec()).collect();
            for key in &keys {
                queues.entry(key.clone()).or_default().push_back(Entry {
                    id,
                    class,
                    tx: tx.clone(),
                });
            }
        }
        let _on_cancel = cancel.map(|c| c.wake_on_cancel(tx));
        Some(Waiter {
            registry: self,
            keys,
            id,
            class,
            rx,
            _on_cancel,
        })
    }

    /// A wait on `key` ended: granted after it had to wait (`waited`), or at
    /// once. A grant at once does not make the key uncontended: the pause
    /// before it may have been too short for the waiters a release woke
    /// (their threads had not run yet), and a releaser that forgot the key
    /// would take it back at once from then on, every time. The key is
    /// forgotten [`CONTENDED_FOR`] after its last grant that waited.
    pub(super) fn note_grant(&self, key: &str, waited: bool) {
        let mut contended = self.contended.lock();
        if waited {
            contended.insert(key.as_bytes().to_vec(), self.now());
        } else if !contended.is_empty()
            && contended
                .get(key.as_bytes())
                .is_some_and(|&at| self.now().saturating_duration_since(at) >= CONTENDED_FOR)
        {
            contended.remove(key.as_bytes());
        }
    }

    /// Whether the last wait on `key` that got it had to wait, within `recent`.
    pub(super) fn was_contended(&self, key: &str, recent: Duration) -> bool {
        let contended = self.contended.lock();
        !contended.is_empty()
            && contended
                .get(key.as_bytes())
                .is_some_and(|&at| self.now().saturating_duration_since(at) < recent)
    }

    /// An invalidation for `key`: wake the first waiter of each class on it.
    pub(crate) fn wake_key(&self, key: &[u8]) {
        let mut senders = Vec::new();
        if let Some(queue) = self.queues.lock().get(key) {
            firsts(queue, &mut senders);
        }
        wake(senders);
    }

    /// Every key may have changed (reconnect, FLUSHALL, a new primary): wake
    /// every first waiter.
    pub(crate) fn wake_all(&self) {
        self.wake_where(|_| true);
    }

    /// Wakes the first waiter (of each class) of every key `changed` says
    /// may have changed (the keys of slots that moved to another server).
    pub(crate) fn wake_where(&self, changed: impl Fn(&[u8]) -> bool) {
        let mut senders = Vec::new();
        for (key, queue) in self.queues.lock().iter() {
            if changed(key) {
                firsts(queue, &mut senders);
            }
        }
        wake(senders);
    }

    /// Whether waiter `id` is the first of its class on `key`.
    fn is_front(&self, key: &[u8], id: u64, class: u64) -> bool {
        self.queues
            .lock()
            .get(key)
            .and_then(|q| q.iter().find(|e| e.class == class))
            .is_some_and(|e| e.id == id)
    }

    /// How many waiters are registered (all keys).
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.queues.lock().values().map(VecDeque::len).sum()
    }
}

/// One registered waiter; leaving a queue wakes the next one in it.
pub(crate) struct Waiter<'a> {
    registry: &'a Registry,
    keys: Vec<Vec<u8>>,
    id: u64,
    class: u64,
    pub(super) rx: Receiver<()>,
    /// Cancellation of the wait sends on `rx` too.
    _on_cancel: Option<OnCancel>,
}

impl Waiter<'_> {
    /// First of its class in line on its first key: it keeps the expiry timer.
    pub(super) fn is_front(&self) -> bool {
        self.registry.is_front(&self.keys[0], self.id, self.class)
    }

    /// Sleeps until woken (an invalidation of its keys, the waiter ahead
    /// leaving, the wait's cancellation) or until `until`: whether it was
    /// woken. One channel, not a `select!` over several: a thread woken from
    /// a `select!` takes the lock of the channel that woke it to unregister,
    /// which the waking thread (the subscriber) still holds while it wakes
    /// it, so on a busy CPU each wake-up would cost two switches and delay
    /// the attempt it is for.
    pub(super) fn sleep(&self, until: Option<Instant>) -> bool {
        match until {
            Some(at) => self.rx.recv_deadline(at).is_ok(),
            None => self.rx.recv().is_ok(),
        }
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        let mut next_up = Vec::new();
        let mut queues = self.registry.queues.lock();
        for key in &self.keys {
            if let Some(queue) = queues.get_mut(key) {
                let was_front = queue
                    .iter()
                    .find(|e| e.class == self.class)
                    .is_some_and(|e| e.id == self.id);
                queue.retain(|e| e.id != self.id);
                if queue.is_empty() {
                    queues.remove(key);
                } else if was_front && let Some(next) = queue.iter().find(|e| e.class == self.class)
                {
                    next_up.push(next.tx.clone());
                }
            }
        }
        drop(queues);
        wake(next_up);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalidation_wakes_only_the_first_and_leaving_passes_it_on() {
        let reg = Registry::new("redis://test".into(), crate::clock::system());
        let a = reg.register(&["k"], false, None);
        let b = reg.register(&["k"], false, None);
        let other = reg.register(&["j"], false, None);
        reg.wake_key(b"k");
        assert!(a.rx.try_recv().is_ok());
        assert!(b.rx.try_recv().is_err());
        assert!(other.rx.try_recv().is_err());
        assert!(a.is_front());
        drop(a);
        // The next waiter is woken to re-check and re-arm.
        assert!(b.rx.try_recv().is_ok());
        assert!(b.is_front());
        assert_eq!(reg.waiting(), 2);
        drop(b);
        drop(other);
        assert_eq!(reg.waiting(), 0);
        assert!(reg.queues.lock().is_empty());
    }

    #[test]
    fn a_key_stays_contended_through_grants_at_once_for_a_second_after_one_that_waited() {
        let reg = Registry::new("redis://test".into(), crate::clock::system());
        assert!(!reg.was_contended("k", CONTENDED_FOR));
        reg.note_grant("k", true);
        assert!(reg.was_contended("k", CONTENDED_FOR));
        assert!(!reg.was_contended("j", CONTENDED_FOR));
        // Only lately.
        assert!(!reg.was_contended("k", Duration::ZERO));
        // A grant at once (nobody got there during the pause) is no sign that
        // the waiters are gone: the key stays contended.
        reg.note_grant("k", false);
        reg.note_grant("k", false);
        assert!(reg.was_contended("k", CONTENDED_FOR));
        // A grant at once a second after the last one that waited forgets it.
        let long_ago = Instant::now()
            .checked_sub(CONTENDED_FOR)
            .expect("a monotonic clock past its first second");
        reg.contended.lock().insert(b"k".to_vec(), long_ago);
        assert!(!reg.was_contended("k", CONTENDED_FOR));
        reg.note_grant("k", false);
        assert!(reg.contended.lock().is_empty());
        // A grant at once of a key never contended records nothing.
        reg.note_grant("j", false);
        assert!(reg.contended.lock().is_empty());
    }

    #[test]
    fn a_wait_queues_behind_waiters_of_its_class_only() {
        let reg = Registry::new("redis://test".into(), crate::clock::system());
        assert!(reg.register_behind(&["k"], None).is_none());
        let a = reg.register(&["k"], false, None);
        // A writer-like class on the same first key does not queue behind it.
        assert!(reg.register_behind(&["k", "r"], None).is_none());
        let b = reg.register_behind(&["k"], None).expect("queued behind a");
        assert!(!b.is_front());
        drop(a);
        assert!(b.rx.try_recv().is_ok());
        assert!(b.is_front());
        // Waiters on their own (a server-side queue) are no one's class.
        let own = reg.register(&["q"], true, None);
        assert!(reg.register_behind(&["q"], None).is_none());
        drop((b, own));
        assert!(reg.queues.lock().is_empty());
    }

    #[test]
    fn cancellation_wakes_a_sleeping_waiter_on_its_own_channel() {
        let reg = Registry::new("redis://test".into(), crate::clock::system());
        let cancel = CancelToken::new();
        let a = reg.register(&["k"], false, Some(&cancel));
        let far = Instant::now() + Duration::from_secs(30);
        std::thread::scope(|s| {
            let sleeper = s.spawn(|| {
                let woken = a.sleep(Some(far));
                (woken, Instant::now())
            });
            cancel.cancel();
            let (woken, at) = sleeper.join().unwrap();
            assert!(woken, "woken by the cancellation, not the timer");
            assert!(at < far);
        });
        // Unregistered with the waiter: a later cancellation sends nowhere.
        drop(a);
        assert!(cancel.inner_wakers_is_empty());
        // A waiter registered after the cancellation is not woken by it: the
        // wait sees `is_cancelled` before it sleeps.
        let b = reg.register(&["k"], false, Some(&cancel));
        assert!(b.rx.try_recv().is_err());
        assert!(cancel.is_cancelled());
    }

    #[test]
    fn a_pending_wake_is_kept_until_the_waiter_looks() {
        let reg = Registry::new("redis://test".into(), crate::clock::system());
        let a = reg.register(&["k"], false, None);
        reg.wake_key(b"k");
        reg.wake_key(b"k");
        assert!(a.rx.try_recv().is_ok());
        assert!(a.rx.try_recv().is_err());
    }

    #[test]
    fn leaving_from_the_middle_does_not_wake_anyone() {
        let reg = Registry::new("redis://test".into(), crate::clock::system());
        let a = reg.register(&["k"], false, None);
        let b = reg.register(&["k"], false, None);
        let c = reg.register(&["k"], false, None);
        drop(b);
        assert!(a.rx.try_recv().is_err());
        assert!(c.rx.try_recv().is_err());
        reg.wake_all();
        assert!(a.rx.try_recv().is_ok());
        assert!(c.rx.try_recv().is_err());
    }

    #[test]
    fn a_slot_change_wakes_only_the_keys_it_names() {
        let reg = Registry::new("redis://test".into(), crate::clock::system());
        let a = reg.register(&["{a}k"], false, None);
        let b = reg.register(&["{b}k"], false, None);
        reg.wake_where(|key| key.starts_with(b"{a}"));
        assert!(a.rx.try_recv().is_ok());
        assert!(b.rx.try_recv().is_err());
    }

    #[test]
    fn waiters_on_other_keys_queue_apart_on_the_key_they_share() {
        let reg = Registry::new("redis://test".into(), crate::clock::system());
        // Readers wait on [w, q], writers on [w, r]: both on w.
        let r1 = reg.register(&["w", "q"], false, None);
        let w1 = reg.register(&["w", "r"], false, None);
        let r2 = reg.register(&["w", "q"], false, None);
        let w2 = reg.register(&["w", "r"], false, None);
        assert!(r1.is_front() && w1.is_front());
        assert!(!r2.is_front() && !w2.is_front());
        // A change of w wakes the first of each class, not the second reader.
        reg.wake_key(b"w");
        assert!(r1.rx.try_recv().is_ok());
        assert!(w1.rx.try_recv().is_ok());
        assert!(r2.rx.try_recv().is_err());
        assert!(w2.rx.try_recv().is_err());
        // A change of r concerns the writers only.
        reg.wake_key(b"r");
        assert!(w1.rx.try_recv().is_ok());
        assert!(r1.rx.try_recv().is_err());
        // The first writer leaving passes the turn to the next writer only.
        drop(w1);
        assert!(w2.rx.try_recv().is_ok());
        assert!(w2.is_front());
        assert!(r2.rx.try_recv().is_err());
        drop(r1);
        assert!(r2.rx.try_recv().is_ok());
        drop((r2, w2));
        assert!(reg.queues.lock().is_empty());
    }
}
