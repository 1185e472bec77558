//! The waiter registry and the wait loop shared by every primitive.
//!
//! # Paying for waiting only when waiting
//!
//! A wait's first attempt is the plain one a single attempt makes (what
//! `try_acquire` sends): no subscriber is started or consulted, no queue
//! joined, no key tracked, no expiry hint (`PTTL`) asked for. A wait that
//! finds the key free thus costs what `try_acquire` costs, and so does its
//! release: nothing tracked the key, so the release sends no invalidation
//! and the subscriber thread reads nothing.
//!
//! Only when that attempt is not granted (the key is held, or the attempt
//! failed) does the wait proper begin: it starts the server's subscriber if
//! needed (giving it a moment to connect), registers the waiter, and makes
//! the next attempt at once. That attempt, and every later one, arms client
//! tracking with its own read of the key and carries the expiry hint. So no
//! release is missed: one that lands between the plain attempt and the
//! tracked one is seen by the tracked attempt itself (it gets the lease); one
//! after it sends an invalidation to a waiter already registered.
//!
//! Tracking is `CLIENT TRACKING ON REDIRECT <subscriber> OPTIN`, turned on
//! once per pooled connection; a tracked attempt sends `CLIENT CACHING yes`
//! in the same round trip, right before the command that reads the key (a
//! `Lock`'s `PTTL`, after its `SET`, whose write would clear it and which,
//! as a write, arms nothing itself; the script of the others). In `OPTIN`
//! mode the plain attempts, releases and renewals that later run on a
//! connection that once waited track nothing.
//! Plain tracking (`ON` without `OPTIN`) would make every read on such a
//! connection, the uncontended ones included, cost an invalidation;
//! `NOLOOP` only spares a connection the changes it makes itself, and a
//! release often goes out on another pooled connection; a tracked read
//! after the failed attempt, instead of a whole attempt, costs the same
//! round trip but cannot take a lease freed meanwhile. The price is one
//! round trip more for a wait that finds the key held (it waits anyway).
//! Tracking armed from the first attempt instead made an uncontended wait
//! cost well above the raw `SET NX PX` + compare-and-delete pair; with the
//! plain first attempt it costs about the raw pair (BENCHMARKS.md, section 1,
//! has the figures of the last `scripts/bench-compare` run).
//!
//! Where the ACL denies `CLIENT CACHING` (but allows `CLIENT TRACKING`),
//! connections fall back to tracking every read (logged once): waits are
//! still woken by invalidations, but an uncontended acquire on a connection
//! that once waited then costs one.
//!
//! A waiter registers *before* its tracked attempts, and each such attempt
//! (one script that tries, else reads the key's PTTL) arms tracking on the
//! connection it runs on, so an invalidation sent after the attempt always
//! finds the waiter registered: no wake-up is lost between "it was busy" and
//! "sleep".
//!
//! The server tracks a key for a connection only while that connection is open.
//! When a command connection whose tracking is current closes on our side (a
//! transport failure broke it), every first waiter is woken to re-check and so
//! re-arms on an open connection. A connection the *server* closes (`CLIENT
//! KILL`, its `timeout` setting) is only noticed when next used; until then the
//! PTTL timer bounds the delay, since every lease this crate sets expires.
//!
//! Within one process, waiters on one key form a queue. An invalidation wakes the
//! first only (the first of each *class*: waiters that wait on the same list of
//! keys, such as a reader/writer lease's readers, and its writers, which can be
//! free to go while the others are not); when it leaves the queue (acquired, timed out, cancelled, failed)
//! it wakes the next, which re-arms tracking with its own attempt. Only the first
//! also sleeps on a timer at the PTTL its attempt read, because expiry
//! notifications can come seconds late. So a release wakes one waiter per
//! process, not the herd, and queued waiters get the lock in arrival order.
//!
//! # The hand-off in one process
//!
//! A wait that starts while waiters of its class are already queued on its key
//! in this process joins the queue behind them at once, without its plain
//! first attempt, and makes no attempt until the waiter ahead leaves and passes
//! the turn on (or its deadline comes: then one attempt still goes out). The
//! thread that has just released a key and loops back to acquire it thus
//! queues behind the waiter its release woke, instead of beating it to the
//! server: the woken waiter needs the invalidation's trip through the
//! subscriber thread before it can attempt, the releaser none. The check is a
//! lookup in the registry under the lock that queues the waiter, so the waiter
//! ahead is still queued to pass the turn on; the uncontended path (nobody
//! queued) sends nothing more. Chosen over a back-off of the releaser (a
//! timed guess) and over waking the local waiter straight from the release
//! (the release would have to know the waiters' keys per kind, and the race
//! with the releaser's own next attempt would remain). A single attempt
//! (`try_acquire`) is not a wait and still takes a free lock ahead of the
//! queue. How often the releaser takes the lock back, and how late the next
//! holder gets it against the raw tracking waiter (all of whose waiters
//! race), is measured in BENCHMARKS.md (section 3, `lock-shared`).
//! Watchers (an election's observers) keep their first attempt
//! ([`Order::Race`]).
//!
//! Across processes there is no shared queue: each process's first waiter
//! races the others' on every change, and a process can lose any number of
//! races in a row. What this process can tell is that a key is contended: its
//! last wait on the key had to wait (found it held) before it got it. A wait
//! on such a key (within the last second, and with nobody of its process
//! queued) lets waiters elsewhere go first: it pauses 1 ms before its first
//! attempt, long enough for a waiter in another process woken by the release
//! this thread may just have made to reach the server (the hand-off's p50
//! from the release sent is about half a millisecond on the machine of
//! BENCHMARKS.md). The key stays
//! contended for a second after the last wait on it that had to wait, also
//! through waits granted at once: one such grant only says that no waiter got
//! there within the pause, which on a busy CPU (the releaser, the server and
//! the woken waiters on one CPU) happens often, and a releaser that forgot
//! the key on it took the lock back at once from then on, for most grants
//! with 8 contenders on one CPU. A key that stopped being contended costs a
//! pause per wait for up to a second; the uncontended path costs a lookup.
//!
//! A process none of whose waits on a key found it held cannot tell that the
//! key is contended, and its thread that released the key may take it back:
//! its next wait needs no wake-up, and without a pause its first attempt
//! reached the server first every time (with 8 contenders on one CPU, one
//! process took back every grant for whole turns, a tenth of all grants). So
//! a wait on a key not known to be contended yields the CPU before its first
//! attempt: the threads the release woke on this CPU (subscribers of other
//! processes, then their waiters) run first; one of them gets the key, and
//! this process's next wait finds it held and marks it contended. With no
//! other thread ready to run, the yield is a system call that returns at
//! once. Waiters on other machines gain nothing from it; the race with them
//! is about even (the release's reply and its invalidation travel alike).
//! BENCHMARKS.md (section 3, `lock`) has the releaser's re-acquire share.
//! [`Order::Server`] (a `Lock` with `Fairness::Fifo`) puts the queue on the
//! server instead: the lock is granted to the head of a sorted set of
//! waiters in arrival order, each entry expiring unless its waiter refreshes
//! it, so every waiter of a process is woken by every change and wakes at
//! least once per refresh interval. A holder's renewals change the key, so
//! they wake each process's first waiter for one re-check per renewal.
//!
//! While every pooled connection is busy (a burst of waiters woken at once), a
//! waiter keeps waiting for one rather than failing; nothing has been sent then.
//!
//! A wait rides out infrastructure failures that may pass (timeouts, I/O
//! errors, refused connections, a server loading or failing over): it pauses
//! for a jittered, growing while (10 ms doubling to 1 s) and tries again, until
//! its deadline or cancellation. At the deadline it returns the last error if
//! its last attempt failed (so a deployment that went away is never reported
//! as "held by someone else"), `Ok(None)` if it saw the lock held. Permanent
//! errors (authentication, permissions, bad keys or arguments, a fencing
//! regression) end it at once.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};

use crate::cancel::{CancelToken, OnCancel};
use crate::clock::Clock;
use crate::conn::Conn;
use crate::core::wait::WaitPolicy;
use crate::error::{Error, Result};
use crate::observe::{self, Observer};
use crate::runtime::backoff::failure_pause;
use crate::token::random_unit;

/// The outcome of one acquire attempt.
pub(crate) enum Attempt<T> {
    /// Granted.
    Acquired(T),
    /// Held by someone else, for at most this long (`None`: no expiry).
    Busy(Option<Duration>),
}

impl<T> Attempt<T> {
    /// What was granted, if anything.
    pub(crate) fn granted(self) -> Option<T> {
        match self {
            Attempt::Acquired(t) => Some(t),
            Attempt::Busy(_) => None,
        }
    }
}

/// Whether invalidations from one server can be relied on right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    /// The subscriber is connecting for the first time.
    Starting,
    /// Subscribed; command connections redirect their invalidations to `redirect`.
    Ready { redirect: u64, generation: u64 },
    /// No subscriber (disconnected or refused): waiters poll.
    Down,
}

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

/// The invalidation subscriber of one server, as its command connections see
/// it: whether it is subscribed, and the id they redirect to.
pub(crate) struct Tracker {
    status: Mutex<Status>,
    status_changed: Condvar,
    denied: AtomicBool,
    /// `CLIENT CACHING` is denied: connections track every key they read.
    every_read: AtomicBool,
    /// The first connection attempt has settled (status left `Starting`).
    settled: AtomicBool,
}

impl Tracker {
    pub(crate) fn new() -> Self {
        Tracker {
            status: Mutex::new(Status::Starting),
            status_changed: Condvar::new(),
            denied: AtomicBool::new(false),
            every_read: AtomicBool::new(false),
            settled: AtomicBool::new(false),
        }
    }

    pub(crate) fn set_status(&self, status: Status) {
        *self.status.lock() = status;
        if status != Status::Starting {
            self.settled.store(true, Ordering::Release);
        }
        self.status_changed.notify_all();
    }

    pub(crate) fn status(&self) -> Status {
        if self.denied.load(Ordering::Acquire) {
            return Status::Down;
        }
        *self.status.lock()
    }

    /// Waits (bounded) for the subscriber's first connection attempt to settle.
    pub(crate) fn await_settled(&self, until: Instant) {
        if self.settled.load(Ordering::Acquire) {
            return;
        }
        let mut status = self.status.lock();
        while *status == Status::Starting {
            if self
                .status_changed
                .wait_until(&mut status, until)
                .timed_out()
            {
                return;
            }
        }
    }

    /// Tracking is refused for good on this server (ACL or server): poll.
    pub(crate) fn deny(&self, registry: &Registry, why: &str) {
        self.denied.store(true, Ordering::Release);
        registry.fallback(why);
    }

    /// Whether tracking was refused for good.
    /// The ACL denies `CLIENT CACHING`: from now on command connections
    /// turn on tracking of every key they read (logged once).
    fn track_every_read(&self, registry: &Registry, why: &str) {
        if !self.every_read.swap(true, Ordering::AcqRel) {
            log::warn!(
                "waiters on {} track every key their connections read, since {why}: an \
                 uncontended acquire on a connection that once waited then costs an \
                 invalidation",
                registry.addr
            );
        }
    }

    pub(crate) fn is_denied(&self) -> bool {
        self.denied.load(Ordering::Acquire)
    }
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
    fn register(
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
    fn register_behind(&self, keys: &[&str], cancel: Option<&CancelToken>) -> Option<Waiter<'_>> {
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
    fn note_grant(&self, key: &str, waited: bool) {
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
    fn was_contended(&self, key: &str, recent: Duration) -> bool {
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
struct Waiter<'a> {
    registry: &'a Registry,
    keys: Vec<Vec<u8>>,
    id: u64,
    class: u64,
    rx: Receiver<()>,
    /// Cancellation of the wait sends on `rx` too.
    _on_cancel: Option<OnCancel>,
}

impl Waiter<'_> {
    /// First of its class in line on its first key: it keeps the expiry timer.
    fn is_front(&self) -> bool {
        self.registry.is_front(&self.keys[0], self.id, self.class)
    }

    /// Sleeps until woken (an invalidation of its keys, the waiter ahead
    /// leaving, the wait's cancellation) or until `until`: whether it was
    /// woken. One channel, not a `select!` over several: a thread woken from
    /// a `select!` takes the lock of the channel that woke it to unregister,
    /// which the waking thread (the subscriber) still holds while it wakes
    /// it, so on a busy CPU every wake-up cost two switches and delayed the
    /// attempt it was for.
    fn sleep(&self, until: Option<Instant>) -> bool {
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

/// A random poll interval between 50 and 150 ms.
fn poll_interval() -> Duration {
    Duration::from_millis(50) + Duration::from_millis(100).mul_f64(random_unit())
}

/// Client tracking turned on for one command connection, redirected to the
/// subscriber of `generation`. The server tracks the keys a connection read only
/// while that connection lives, so this is dropped with it: when a connection
/// whose tracking is current closes (a transport failure broke it), every first
/// waiter re-checks, and so re-arms its key on a connection that is open.
pub(crate) struct Armed {
    generation: u64,
    reads: Reads,
    tracker: Weak<Tracker>,
    registry: Weak<Registry>,
}

/// Which reads of a command connection arm invalidations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reads {
    /// None: no subscriber, or tracking refused (waiters poll).
    Untracked,
    /// Those right after `CLIENT CACHING yes` (`OPTIN` mode).
    OnRequest,
    /// Every one (the ACL denies `CLIENT CACHING`).
    All,
}

impl Drop for Armed {
    fn drop(&mut self) {
        if let (Some(tracker), Some(registry)) = (self.tracker.upgrade(), self.registry.upgrade())
            && matches!(tracker.status(), Status::Ready { generation, .. } if generation == self.generation)
        {
            // The server forgot the keys this connection tracked: every first
            // waiter re-checks, and so re-arms on an open connection.
            log::debug!(
                "a tracked connection to {} closed; waiters re-check",
                registry.addr
            );
            registry.wake_all();
        }
    }
}

/// Turns on tracking for this connection, redirected to the current subscriber
/// of its server, in `OPTIN` mode: the connection's commands track no key
/// unless `CLIENT CACHING yes` goes right before them ([`Conn::track_next`]),
/// so the plain attempts and releases that share the pooled connection never
/// cost an invalidation. Where the ACL denies `CLIENT CACHING`, tracking of
/// every read instead. Returns which reads of the connection now arm
/// invalidations.
pub(crate) fn ensure_tracking(
    conn: &mut Conn,
    tracker: &Arc<Tracker>,
    registry: &Arc<Registry>,
    deadline: Instant,
) -> Result<Reads> {
    let Status::Ready {
        redirect,
        generation,
    } = tracker.status()
    else {
        return Ok(Reads::Untracked);
    };
    let armed = conn
        .attachment
        .as_ref()
        .and_then(|a| a.downcast_ref::<Armed>());
    if let Some(armed) = armed.filter(|a| a.generation == generation) {
        return Ok(armed.reads);
    }
    let mut reads = if tracker.every_read.load(Ordering::Acquire) {
        Reads::All
    } else {
        Reads::OnRequest
    };
    let on = |reads| {
        let mut pipe = redis::pipe();
        let cmd = pipe
            .cmd("CLIENT")
            .arg("TRACKING")
            .arg("ON")
            .arg("REDIRECT")
            .arg(redirect);
        if reads == Reads::OnRequest {
            // `CLIENT CACHING yes` is sent here too, so that an ACL that
            // denies it is found now; what it marks is the attempt that
            // follows on this connection, which marks itself anyway.
            cmd.arg("OPTIN");
            pipe.cmd("CLIENT").arg("CACHING").arg("yes");
        }
        pipe
    };
    let error = |v: redis::Value| match v {
        redis::Value::ServerError(e) => Some(redis::RedisError::from(e)),
        _ => None,
    };
    let mut replies = conn
        .pipeline(&on(reads), "CLIENT TRACKING", deadline)?
        .into_iter();
    let mut refusal = replies.next().and_then(error);
    if refusal.is_none()
        && let Some(caching) = replies.next().and_then(error)
    {
        if !crate::error::is_noperm(&caching) {
            return Err(Error::Server {
                op: "CLIENT CACHING",
                source: caching,
            });
        }
        tracker.track_every_read(
            registry,
            &format!("the ACL denies CLIENT CACHING ({caching})"),
        );
        reads = Reads::All;
        refusal = conn
            .pipeline(&on(reads), "CLIENT TRACKING", deadline)?
            .into_iter()
            .next()
            .and_then(error);
    }
    match refusal {
        None => {
            match conn
                .attachment
                .as_mut()
                .and_then(|a| a.downcast_mut::<Armed>())
            {
                // Re-pointed at a new subscriber: the same connection, still open.
                Some(armed) => {
                    armed.generation = generation;
                    armed.reads = reads;
                }
                None => {
                    conn.attachment = Some(Box::new(Armed {
                        generation,
                        reads,
                        tracker: Arc::downgrade(tracker),
                        registry: Arc::downgrade(registry),
                    }));
                }
            }
            Ok(reads)
        }
        Some(e) if crate::error::is_noperm(&e) => {
            tracker.deny(registry, &format!("the ACL denies CLIENT TRACKING ({e})"));
            Ok(Reads::Untracked)
        }
        Some(source) => {
            let why = format!("the server refused CLIENT TRACKING ({source})");
            if source.code() == Some("ERR") && source.to_string().contains("redirect") {
                // The subscriber went away between the status read and this
                // command; it is reconnecting and will wake every waiter.
                log::debug!("{why}");
            } else {
                tracker.deny(registry, &why);
            }
            Ok(Reads::Untracked)
        }
    }
}

/// What a wait does with a failure that may pass (a timeout, an I/O error, a
/// refused connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failures {
    /// Pause and try again until the deadline (acquires).
    RideOut,
    /// End the wait with the error at once (an observer, who must hear that
    /// it can no longer tell what the server holds).
    Report,
}

/// What a wait is for and how long it may take.
pub(crate) struct WaitFor<'a> {
    /// Every key whose change may free it; the first keeps the expiry timer.
    pub(crate) keys: &'a [&'a str],
    /// `None`: no deadline.
    pub(crate) deadline: Option<Instant>,
    pub(crate) cancel: Option<&'a CancelToken>,
    /// The bound on each attempt's commands: the node timeout, plus the
    /// replication guard's `WAIT` where one follows the attempt.
    pub(crate) attempt_timeout: Duration,
    /// How long the subscriber may take to connect before the first attempt.
    pub(crate) settle: Duration,
    /// What a failure that may pass does to the wait.
    pub(crate) failures: Failures,
    /// Who is next: this process's queue, or the server's.
    pub(crate) order: Order,
}

/// How long after a wait on a key had to wait its next wait in this process
/// still yields first.
const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// How long a wait on a key found contended lately lets waiters elsewhere go
/// first, before its first attempt.
const YIELD: Duration = Duration::from_millis(1);

/// Who a wait lets go first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Order {
    /// This process's queue, which every wait enters only after its first
    /// attempt (a watcher, whose attempts read and never take).
    Race,
    /// This process's queue (see the module docs): a wait that starts while
    /// waiters of this process are queued on its key queues behind them
    /// without an attempt of its own, so a thread that has just released
    /// the key does not take it back from the waiter its release woke; and a
    /// wait on a key found contended lately pauses before its first attempt,
    /// for the waiters of other processes (any other wait yields the CPU
    /// first).
    Local,
    /// A queue on the server whose entries expire unless their waiter
    /// refreshes them: every waiter attempts (and so refreshes its entry) at
    /// least once per `refresh`, and every change of the keys wakes every
    /// waiter of the process, since the server, not arrival here, says who
    /// is next.
    Server { refresh: Duration },
}

/// How a wait ended.
pub(crate) struct Waited<T, U> {
    pub(crate) result: Result<Option<T>>,
    /// The connections of attempts that got no reply and may have been
    /// granted.
    pub(crate) uncertain: Vec<U>,
}

/// What a [`Route`] runs on a connection: it gets the server's subscriber
/// when the attempt is to arm tracking.
pub(crate) type OnTracked<'a, T> =
    dyn FnMut(Option<&Arc<Tracker>>, &mut Conn, Instant) -> Result<T> + 'a;

/// How a wait reaches the server that holds its key: routing, redirections,
/// and that server's invalidation subscriber.
pub(crate) trait Route {
    /// Where an attempt that got no reply went (server and connection id).
    type Uncertain;
    /// The subscriber of the server that holds `key` now, started if needed.
    fn tracker(&self, key: &str) -> Result<Arc<Tracker>>;
    /// The deployment's waiters.
    fn registry(&self) -> &Arc<Registry>;
    /// Runs `f` on a connection to the server that holds `key`, following
    /// redirections, within `deadline` (plus the connect timeout when it
    /// opens a connection). When `track`, `f` gets that server's subscriber
    /// (started if needed); otherwise the subscriber is not touched.
    fn attempt<T>(
        &self,
        key: &str,
        deadline: Instant,
        track: bool,
        f: &mut OnTracked<'_, T>,
    ) -> (Result<T>, Option<Self::Uncertain>);
}

/// Waits for an acquire to succeed: re-attempts when woken by an invalidation of
/// one of the keys, by the expiry timer, or by polling when tracking is
/// unavailable; rides out retryable failures (see the module docs). Returns
/// `Ok(None)` when the deadline passes after a busy attempt, `Err(Cancelled)`
/// on cancellation, the last error when the deadline passes after a failed
/// one, and any permanent error at once.
///
/// `attempt` runs one acquire on the connection, finishing by the deadline it
/// is given; its flag is false for the first attempt, which must be the plain
/// one a single attempt makes, and true for every later one (the wait proper,
/// once the first was not granted).
pub(crate) fn wait_for<R: Route, T>(
    route: &R,
    w: &WaitFor<'_>,
    mut attempt: impl FnMut(&mut Conn, Instant, bool) -> Result<Attempt<T>>,
) -> Waited<T, R::Uncertain> {
    let mut uncertain = Vec::new();
    let result = wait_loop(route, w, &mut uncertain, &mut attempt);
    Waited { result, uncertain }
}

/// Joins the queue of a wait whose first attempt was not granted, after
/// giving a subscriber started now a moment to connect (so that the next
/// attempt arms tracking instead of polling once).
fn join<'r, R: Route>(route: &'r R, w: &WaitFor<'_>) -> Waiter<'r> {
    let settle = route.registry().now() + w.settle;
    if let Ok(tracker) = route.tracker(w.keys[0]) {
        tracker.await_settled(w.deadline.map_or(settle, |d| d.min(settle)));
    }
    route
        .registry()
        .register(w.keys, matches!(w.order, Order::Server { .. }), w.cancel)
}

fn wait_loop<R: Route, T>(
    route: &R,
    w: &WaitFor<'_>,
    uncertain: &mut Vec<R::Uncertain>,
    attempt: &mut impl FnMut(&mut Conn, Instant, bool) -> Result<Attempt<T>>,
) -> Result<Option<T>> {
    let registry = route.registry();
    // Registered once the first attempt was not granted (held, or failed);
    // until then the wait is the plain attempt a single attempt makes: no
    // subscriber, no queue, no tracked read, no expiry hint.
    //
    // A wait that starts while waiters of this process are queued on its key
    // joins the queue behind them at once and makes no attempt until its
    // turn comes (the waiter ahead leaves and passes it on) or the deadline
    // does: a thread that has just released the key would otherwise take it
    // back before the waiter its release woke could (the hand-off in one
    // process). The check costs a lookup in the registry, no round trip.
    let mut waiter: Option<Waiter<'_>> = match w.order {
        Order::Local => registry.register_behind(w.keys, w.cancel),
        Order::Race | Order::Server { .. } => None,
    };
    let mut behind = waiter.is_some();
    let never = crossbeam_channel::never();
    let cancelled = w.cancel.map_or(&never, |c| c.receiver());
    let is_cancelled = || w.cancel.is_some_and(CancelToken::is_cancelled);
    let mut policy: WaitPolicy<Error> = WaitPolicy::new(w.deadline);
    if !behind && w.order == Order::Local {
        if registry.was_contended(w.keys[0], CONTENDED_FOR)
            && w.deadline.is_none_or(|d| registry.now() + YIELD < d)
        {
            // The last wait on this key in this process had to wait: waiters
            // elsewhere may be on their way to it now (this thread may have
            // just released it). They are let go first for a moment.
            if cancelled
                .recv_timeout(YIELD)
                .is_err_and(|e| e.is_disconnected())
            {
                return Err(Error::Cancelled);
            }
        } else {
            // Not known to be contended, which a process cannot tell before
            // one of its waits on the key found it held: the threads a
            // release by this thread woke on this CPU (subscribers of other
            // processes and the waiters they wake) run before this attempt
            // goes out, rather than after it took the key back.
            std::thread::yield_now();
        }
    }
    loop {
        if is_cancelled() {
            return Err(Error::Cancelled);
        }
        if std::mem::take(&mut behind)
            && let Some(waiter) = &waiter
        {
            // Behind this process's earlier waiters: the turn comes when the
            // one ahead leaves; at the deadline one attempt still goes out
            // (the wait never ends without one).
            waiter.sleep(w.deadline);
            continue;
        }
        let waiting = waiter.is_some();
        let started = registry.now();
        let (outcome, lost) = route.attempt(
            w.keys[0],
            started + w.attempt_timeout,
            waiting,
            &mut |tracker, conn, deadline| {
                let reads = match tracker {
                    Some(tracker) => ensure_tracking(conn, tracker, registry, deadline)?,
                    None => Reads::Untracked,
                };
                let tracked = match reads {
                    Reads::Untracked => false,
                    Reads::All => true,
                    // `ASKING` would clear `CLIENT CACHING yes`: an attempt
                    // redirected to a slot being imported polls once instead.
                    Reads::OnRequest if conn.is_asking() => false,
                    Reads::OnRequest => {
                        conn.track_next();
                        true
                    }
                };
                let a = attempt(conn, deadline, waiting);
                // Not left for a later command on the pooled connection.
                conn.take_track();
                a.map(|a| (a, tracked))
            },
        );
        if let Some(lost) = lost {
            uncertain.push(lost);
        }
        let (pttl, tracked) = match outcome {
            // Cancelled while the attempt was in flight: the caller asked to
            // stop, so what it got is released (by dropping it).
            Ok((Attempt::Acquired(_), _)) if is_cancelled() => return Err(Error::Cancelled),
            Ok((Attempt::Acquired(t), _)) => {
                if w.order == Order::Local {
                    registry.note_grant(w.keys[0], waiting);
                }
                return Ok(Some(t));
            }
            Ok((Attempt::Busy(_), _)) if !waiting => {
                policy.busy();
                if policy.past(registry.now()) {
                    return policy.end();
                }
                // Held: from now on the wait pays for waiting. The next
                // attempt goes out at once, registered, and arms tracking
                // with its own read of the key: a release before that attempt
                // is seen by it, one after it sends an invalidation to a
                // registered waiter. No release is missed.
                waiter = Some(join(route, w));
                continue;
            }
            Ok((Attempt::Busy(pttl), tracked)) => {
                policy.busy();
                (pttl, tracked)
            }
            // Every pooled connection is busy with other calls (a burst of
            // waiters woken at once): nothing was sent, so keep waiting for
            // one while the wait lasts; at its end the last verdict stands.
            Err(Error::PoolTimeout(after)) => {
                if !policy.past(registry.now()) {
                    continue;
                }
                if !policy.has_verdict() {
                    return Err(Error::PoolTimeout(after));
                }
                return policy.end();
            }
            Err(e) if e.is_retryable() && w.failures == Failures::Report => return Err(e),
            Err(e) if e.is_retryable() => {
                let message = e.to_string();
                let dead_conn = matches!(e, Error::Io { .. });
                if policy.failed(e) {
                    log::warn!(
                        "waiting on {:?}: {message}; retrying until the wait ends",
                        w.keys[0]
                    );
                } else {
                    log::debug!("waiting on {:?}: {message}; retrying", w.keys[0]);
                }
                // A dead pooled connection (restart, idle timeout, kill):
                // attempts are idempotent for their owner, so the first retry
                // goes out at once on a fresh connection.
                let failures = policy.failures();
                let pause = if failures == 1 && dead_conn {
                    Duration::ZERO
                } else {
                    failure_pause(failures)
                };
                if policy.past(registry.now()) {
                    return policy.end();
                }
                if waiter.is_none() {
                    // Not granted: the wait proper begins, as when held.
                    waiter = Some(join(route, w));
                }
                let wake = policy.wake_at(registry.now(), pause);
                if cancelled
                    .recv_deadline(wake)
                    .is_err_and(|e| e.is_disconnected())
                {
                    return Err(Error::Cancelled);
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        let waiter = waiter
            .as_ref()
            .expect("a tracked attempt is made registered");
        let now = registry.now();
        if policy.past(now) {
            return policy.end();
        }
        let mut wake_at = w.deadline;
        if let Order::Server { refresh } = w.order {
            let at = now + refresh;
            wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
        }
        if waiter.is_front() {
            if let Some(pttl) = pttl {
                let at = now.checked_add(pttl + Duration::from_millis(1));
                if let Some(at) = at {
                    wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
                }
            }
            if !tracked {
                let at = now + poll_interval();
                wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
            }
        }
        // Woken by an invalidation, the waiter ahead leaving, cancellation
        // (checked at the top of the loop) or the timer.
        if !waiter.sleep(wake_at) && policy.past(registry.now()) {
            return policy.end();
        }
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
    fn closing_a_connection_with_current_tracking_wakes_every_first_waiter() {
        let reg = Arc::new(Registry::new("redis://test".into(), crate::clock::system()));
        let tracker = Arc::new(Tracker::new());
        tracker.set_status(Status::Ready {
            redirect: 7,
            generation: 2,
        });
        let a = reg.register(&["k"], false, None);
        let b = reg.register(&["k"], false, None);
        let other = reg.register(&["j"], false, None);
        let armed = |generation| Armed {
            generation,
            reads: Reads::OnRequest,
            tracker: Arc::downgrade(&tracker),
            registry: Arc::downgrade(&reg),
        };
        // Tracking that went to an earlier subscriber was re-armed already.
        drop(armed(1));
        assert!(a.rx.try_recv().is_err());
        assert!(other.rx.try_recv().is_err());
        drop(armed(2));
        assert!(a.rx.try_recv().is_ok());
        assert!(b.rx.try_recv().is_err());
        assert!(other.rx.try_recv().is_ok());
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

    #[test]
    fn poll_interval_is_jittered_within_bounds() {
        let seen: std::collections::HashSet<_> = (0..200).map(|_| poll_interval()).collect();
        assert!(seen.len() > 10);
        assert!(
            seen.iter()
                .all(|d| *d >= Duration::from_millis(50) && *d < Duration::from_millis(150))
        );
    }
}
