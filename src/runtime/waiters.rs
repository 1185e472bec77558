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

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cancel::CancelToken;
use crate::conn::Conn;
use crate::core::wait::WaitPolicy;
use crate::error::{Error, Result};
use crate::runtime::backoff::failure_pause;
use crate::runtime::registry::{CONTENDED_FOR, Registry, Waiter};
use crate::runtime::tracking::{Reads, Tracker, ensure_tracking};
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

/// A random poll interval between 50 and 150 ms.
fn poll_interval() -> Duration {
    Duration::from_millis(50) + Duration::from_millis(100).mul_f64(random_unit())
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
    fn poll_interval_is_jittered_within_bounds() {
        let seen: std::collections::HashSet<_> = (0..200).map(|_| poll_interval()).collect();
        assert!(seen.len() > 10);
        assert!(
            seen.iter()
                .all(|d| *d >= Duration::from_millis(50) && *d < Duration::from_millis(150))
        );
    }
}
