//! Observing locks: the [`Observer`] trait the coordinator and the Redlock
//! group call at each step of an acquire and of a held lease, and the events
//! they pass it.
//!
//! With no observer set nothing here runs: every call site checks an
//! `Option` before it reads a clock or builds an event.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::guard::ReleaseOutcome;
use crate::token::FencingToken;

#[cfg(feature = "metrics")]
mod metrics;
#[cfg(feature = "tracing")]
mod tracing;

#[cfg(feature = "metrics")]
pub use self::metrics::MetricsObserver;
#[cfg(feature = "tracing")]
pub use self::tracing::TracingObserver;

/// Hears what the locks of a [`Coordinator`](crate::Coordinator) or a
/// [`RedlockGroup`](crate::RedlockGroup) do: attempts, grants, contention,
/// waits, renewals, losses, releases, topology changes and the fall-back to
/// polling. Set one with
/// [`CoordinatorBuilder::observer`](crate::CoordinatorBuilder::observer) or
/// [`RedlockOptions::with_observer`](crate::RedlockOptions::with_observer).
///
/// Every method has an empty default body: implement the ones you need. Each
/// takes a borrowed event whose fields may grow (the structs are
/// `#[non_exhaustive]`); copy what you keep.
///
/// # Threads
///
/// Methods are called on the library's threads as events happen: the
/// caller's thread for attempts, grants, contention, wait ends, releases and
/// extensions it makes itself; the renewal and executor threads for
/// keep-alive renewals and most losses; the topology and subscriber threads
/// for topology changes and the polling fall-back. They must not block
/// (queue the work elsewhere if it may), and must not call back into the
/// lock or guard that reports. A method that panics is caught
/// (`catch_unwind`) and logged with `log::error!`; the library carries on as
/// if it had returned (unless the program is built with `panic = "abort"`).
///
/// # Which events, when
///
/// For one acquire call (`try_acquire`, or any wait): one
/// [`attempt`](Observer::attempt), then at most one
/// [`contended`](Observer::contended) (when its first attempt that did not
/// get the lock found it held), then either one
/// [`granted`](Observer::granted) or one [`wait_ended`](Observer::wait_ended).
/// For one held lease: any number of [`renewed`](Observer::renewed), at most
/// one [`lost`](Observer::lost) (when the library first notices the loss: at
/// the loss deadline for a lease with a keep-alive or a loss signal,
/// otherwise at the next call that looks), then one
/// [`released`](Observer::released) (by `release()` or by dropping the
/// guard; a Redlock release that reached no quorum reports again when it is
/// called again). A loss found only by the release itself is reported in its
/// outcome, not as a loss. Only a lease handed to the caller is reported
/// granted: one an acquire got and let go before returning (a grant with too
/// few replica acknowledgements, a fencing token that went back) is not, and
/// neither is its release.
///
/// A set of leases taken all or nothing
/// ([`lock_all`](crate::Coordinator::lock_all),
/// [`fenced_lock_all`](crate::Coordinator::fenced_lock_all)) is reported as
/// its leases: one call of it is one call of each lease, all started
/// together (an `attempt` each, in the order the keys were given), each with
/// at most one `contended`, and all ending together with the call (a
/// `granted` each, or a `wait_ended` each with the one reason). So counts per
/// key mean the same for a set as for a single lease, and every `granted` is
/// followed by that lease's `released`; see [`MultiLease`](crate::MultiLease#observers).
pub trait Observer: Send + Sync {
    /// An acquire call starts.
    fn attempt(&self, event: &AttemptEvent<'_>) {
        let _ = event;
    }

    /// An acquire call got the lease.
    fn granted(&self, event: &GrantEvent<'_>) {
        let _ = event;
    }

    /// An acquire call found the lease held by someone else (once per call).
    fn contended(&self, event: &ContentionEvent<'_>) {
        let _ = event;
    }

    /// An acquire call ended without the lease.
    fn wait_ended(&self, event: &WaitEndEvent<'_>) {
        let _ = event;
    }

    /// An extension of a held lease (a keep-alive renewal or an explicit
    /// one) was confirmed in time.
    fn renewed(&self, event: &RenewalEvent<'_>) {
        let _ = event;
    }

    /// A held lease was found lost.
    fn lost(&self, event: &LossEvent<'_>) {
        let _ = event;
    }

    /// A held lease was released (or its release was tried).
    fn released(&self, event: &ReleaseEvent<'_>) {
        let _ = event;
    }

    /// The servers behind a deployment changed: a Sentinel switch, slots
    /// moving in a cluster.
    fn topology_changed(&self, event: &TopologyEvent<'_>) {
        let _ = event;
    }

    /// Waits on a server stopped being woken by invalidations and poll.
    fn polling(&self, event: &PollingEvent<'_>) {
        let _ = event;
    }

    /// A server's wall clock was found to have run ahead of this process's
    /// monotonic clock: every lease on it was cut by what the server gained
    /// (see the crate docs on server clocks).
    fn server_clock_jumped(&self, event: &ServerClockEvent<'_>) {
        let _ = event;
    }
}

/// Which primitive an event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Primitive {
    /// A [`Lock`](crate::Lock).
    Lock,
    /// A [`FencedLock`](crate::FencedLock) (and an [`Election`](crate::Election)).
    FencedLock,
    /// The read side of a [`ReadWriteLease`](crate::ReadWriteLease).
    Read,
    /// The write side of a [`ReadWriteLease`](crate::ReadWriteLease).
    Write,
    /// A [`Semaphore`](crate::Semaphore) permit.
    Semaphore,
    /// A [`RedlockGroup`](crate::RedlockGroup) lock.
    Redlock,
}

impl Primitive {
    /// A short lowercase name: `lock`, `fenced_lock`, `read`, `write`,
    /// `semaphore`, `redlock`.
    pub fn as_str(self) -> &'static str {
        match self {
            Primitive::Lock => "lock",
            Primitive::FencedLock => "fenced_lock",
            Primitive::Read => "read",
            Primitive::Write => "write",
            Primitive::Semaphore => "semaphore",
            Primitive::Redlock => "redlock",
        }
    }
}

impl fmt::Display for Primitive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Names one held lease for the life of the process, so that its grant,
/// renewals, loss and release can be matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub(crate) u64);

impl LeaseId {
    /// The id as a number.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// An acquire call starts.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct AttemptEvent<'a> {
    /// The physical key (with the coordinator's prefix; a Redlock key as given).
    pub key: &'a str,
    /// Which primitive.
    pub primitive: Primitive,
    /// Whether the call may wait (false for `try_acquire`).
    pub waits: bool,
}

/// An acquire call got the lease.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct GrantEvent<'a> {
    /// The physical key.
    pub key: &'a str,
    /// Which primitive.
    pub primitive: Primitive,
    /// The lease now held.
    pub lease: LeaseId,
    /// Its fencing token, for the primitives that issue one.
    pub token: Option<FencingToken>,
    /// From the start of the call to the grant.
    pub waited: Duration,
}

/// An acquire call found the lease held by someone else.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct ContentionEvent<'a> {
    /// The physical key.
    pub key: &'a str,
    /// Which primitive.
    pub primitive: Primitive,
    /// How long the holder's lease had left on the server, when the reply
    /// said (`Duration::MAX` for a key without expiry); `None` when unknown.
    pub holder_ttl: Option<Duration>,
}

/// Why an acquire call ended without the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WaitEnd {
    /// Its one attempt (`try_acquire`) found the lease held.
    Busy,
    /// The wait's deadline passed.
    TimedOut,
    /// The wait was cancelled.
    Cancelled,
    /// It returned an error.
    Failed,
}

impl WaitEnd {
    /// A short lowercase name: `busy`, `timed_out`, `cancelled`, `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            WaitEnd::Busy => "busy",
            WaitEnd::TimedOut => "timed_out",
            WaitEnd::Cancelled => "cancelled",
            WaitEnd::Failed => "failed",
        }
    }
}

/// An acquire call ended without the lease.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct WaitEndEvent<'a> {
    /// The physical key.
    pub key: &'a str,
    /// Which primitive.
    pub primitive: Primitive,
    /// Why.
    pub reason: WaitEnd,
    /// From the start of the call to its end.
    pub waited: Duration,
}

/// An extension of a held lease was confirmed before its loss deadline.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct RenewalEvent<'a> {
    /// The physical key.
    pub key: &'a str,
    /// Which primitive.
    pub primitive: Primitive,
    /// The lease.
    pub lease: LeaseId,
    /// The TTL it was extended by.
    pub ttl: Duration,
    /// How long the lease was still sure to be held when the confirmation
    /// came: the guard's bound before the extension moved it (the send time
    /// of the grant or last confirmed extension, plus its TTL, minus drift),
    /// minus the moment of confirmation. At most the time the server had
    /// left; a small margin means renewals come too late.
    pub margin: Duration,
}

/// Why a held lease was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LossCause {
    /// Its loss deadline passed and it was not being kept alive.
    Expired,
    /// It was kept alive, but no renewal was confirmed before its loss
    /// deadline (or one was confirmed only after it).
    RenewalUnconfirmed,
    /// The server no longer has it (expired, deleted, lost in a restart or
    /// a failover).
    Gone,
    /// Someone else holds the key.
    TakenOver,
    /// Anything else (a quorum that no longer holds a Redlock lock, a
    /// deadline that could not be watched...): see the event's `detail`.
    Other,
}

impl LossCause {
    /// A short lowercase name: `expired`, `renewal_unconfirmed`, `gone`,
    /// `taken_over`, `other`.
    pub fn as_str(self) -> &'static str {
        match self {
            LossCause::Expired => "expired",
            LossCause::RenewalUnconfirmed => "renewal_unconfirmed",
            LossCause::Gone => "gone",
            LossCause::TakenOver => "taken_over",
            LossCause::Other => "other",
        }
    }
}

/// A held lease was found lost.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct LossEvent<'a> {
    /// The physical key.
    pub key: &'a str,
    /// Which primitive.
    pub primitive: Primitive,
    /// The lease.
    pub lease: LeaseId,
    /// Why, as a kind.
    pub cause: LossCause,
    /// Why, in words (what the library logs).
    pub detail: &'a str,
}

/// A held lease was released, or its release was tried.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct ReleaseEvent<'a> {
    /// The physical key.
    pub key: &'a str,
    /// Which primitive.
    pub primitive: Primitive,
    /// The lease.
    pub lease: LeaseId,
    /// What the release found; `None` when it failed with an error (nothing
    /// could be sent, or the server refused it: the lease ends at its expiry).
    /// A Redlock release reports `Released` when a quorum confirmed it and
    /// `Expired` when a quorum answered but no longer held it.
    pub outcome: Option<ReleaseOutcome>,
}

/// How the servers behind a deployment changed.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum TopologyChange<'a> {
    /// Sentinel named a new primary, and the coordinator moved to it.
    PrimarySwitched {
        /// The old primary's address.
        from: &'a str,
        /// The new one's.
        to: &'a str,
    },
    /// Slots of a cluster changed owner.
    SlotsMoved {
        /// How many.
        slots: usize,
    },
}

/// The servers behind a deployment changed.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct TopologyEvent<'a> {
    /// The deployment, as the coordinator describes it (no credentials).
    pub deployment: &'a str,
    /// What changed.
    pub change: TopologyChange<'a>,
}

/// A server's wall clock ran ahead of this process's monotonic clock between
/// two readings of its `TIME` by more than the drift allowance.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct ServerClockEvent<'a> {
    /// The server (no credentials).
    pub server: &'a str,
    /// How far ahead it may have run since the reading before: every lease
    /// on it had its bound moved this much earlier.
    pub gain: Duration,
    /// How many leases were cut.
    pub leases: usize,
}

/// Waits on a server fell back to polling (every 50–150 ms), because
/// invalidations could not be tracked there. Reported once per coordinator.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct PollingEvent<'a> {
    /// The server or deployment (no credentials).
    pub server: &'a str,
    /// Why tracking could not be used.
    pub reason: &'a str,
}

/// A release outcome's name for the observers of the features:
/// `released`, `expired`, `taken_over`, `uncertain`, or `failed` for none.
#[cfg(any(feature = "tracing", feature = "metrics"))]
fn release_name(outcome: Option<ReleaseOutcome>) -> &'static str {
    match outcome {
        Some(ReleaseOutcome::Released) => "released",
        Some(ReleaseOutcome::Expired) => "expired",
        Some(ReleaseOutcome::TakenOver) => "taken_over",
        Some(ReleaseOutcome::Uncertain) => "uncertain",
        None => "failed",
    }
}

/// Calls `f` on `observer`, catching and logging a panic.
fn call(observer: &dyn Observer, what: &'static str, f: impl FnOnce(&dyn Observer)) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| f(observer))) {
        let message = panic
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("a non-string payload");
        log::error!("an observer panicked in `{what}` (ignored): {message}");
    }
}

/// How an acquire call ended.
enum Ended {
    Granted(LeaseId, Option<FencingToken>),
    NotGranted(WaitEnd),
}

impl Ended {
    /// Reads an acquire call's result; `once` when it made one attempt.
    fn of<G>(
        result: &Result<Option<G>, Error>,
        once: bool,
        grant: impl FnOnce(&G) -> (LeaseId, Option<FencingToken>),
    ) -> Ended {
        match result {
            Ok(Some(g)) => {
                let (lease, token) = grant(g);
                Ended::Granted(lease, token)
            }
            Ok(None) if once => Ended::NotGranted(WaitEnd::Busy),
            Ok(None) => Ended::NotGranted(WaitEnd::TimedOut),
            Err(Error::Cancelled) => Ended::NotGranted(WaitEnd::Cancelled),
            Err(_) => Ended::NotGranted(WaitEnd::Failed),
        }
    }
}

/// One acquire call as an observer sees it; made only when one is set.
pub(crate) struct Acquiring<'a> {
    observer: &'a dyn Observer,
    key: &'a str,
    primitive: Primitive,
    started: Instant,
    contended: bool,
}

impl<'a> Acquiring<'a> {
    /// Reports the attempt to `observer` and starts the call's clock at `now`.
    pub(crate) fn start(
        observer: &'a Arc<dyn Observer>,
        key: &'a str,
        primitive: Primitive,
        waits: bool,
        now: Instant,
    ) -> Acquiring<'a> {
        let event = AttemptEvent {
            key,
            primitive,
            waits,
        };
        call(&**observer, "attempt", |o| o.attempt(&event));
        Acquiring {
            observer: &**observer,
            key,
            primitive,
            started: now,
            contended: false,
        }
    }

    /// An attempt found the lease held (`holder_ttl`: `None` for no expiry);
    /// reported the first time only.
    #[inline]
    pub(crate) fn busy(this: &mut Option<Acquiring<'_>>, holder_ttl: Option<Option<Duration>>) {
        let Some(this) = this else { return };
        if std::mem::replace(&mut this.contended, true) {
            return;
        }
        let event = ContentionEvent {
            key: this.key,
            primitive: this.primitive,
            holder_ttl: holder_ttl.map(|t| t.unwrap_or(Duration::MAX)),
        };
        call(this.observer, "contended", |o| o.contended(&event));
    }

    /// Reports how the call ended at `now`, from its result (`once`: a
    /// single attempt); `grant` names a grant's lease and its fencing token.
    #[inline]
    pub(crate) fn finish<G>(
        this: Option<Acquiring<'_>>,
        result: &Result<Option<G>, Error>,
        once: bool,
        now: Instant,
        grant: impl FnOnce(&G) -> (LeaseId, Option<FencingToken>),
    ) {
        let Some(this) = this else { return };
        let waited = now.saturating_duration_since(this.started);
        match Ended::of(result, once, grant) {
            Ended::Granted(lease, token) => {
                let event = GrantEvent {
                    key: this.key,
                    primitive: this.primitive,
                    lease,
                    token,
                    waited,
                };
                call(this.observer, "granted", |o| o.granted(&event));
            }
            Ended::NotGranted(reason) => {
                let event = WaitEndEvent {
                    key: this.key,
                    primitive: this.primitive,
                    reason,
                    waited,
                };
                call(this.observer, "wait_ended", |o| o.wait_ended(&event));
            }
        }
    }
}

/// An observer and the primitive of the lease it watches, kept by the lease.
pub(crate) struct Watching {
    pub(crate) observer: Arc<dyn Observer>,
    pub(crate) primitive: Primitive,
}

impl Watching {
    pub(crate) fn renewed(&self, key: &str, lease: u64, ttl: Duration, margin: Duration) {
        let event = RenewalEvent {
            key,
            primitive: self.primitive,
            lease: LeaseId(lease),
            ttl,
            margin,
        };
        call(&*self.observer, "renewed", |o| o.renewed(&event));
    }

    pub(crate) fn lost(&self, key: &str, lease: u64, cause: LossCause, detail: &str) {
        let event = LossEvent {
            key,
            primitive: self.primitive,
            lease: LeaseId(lease),
            cause,
            detail,
        };
        call(&*self.observer, "lost", |o| o.lost(&event));
    }

    pub(crate) fn released(&self, key: &str, lease: u64, outcome: Option<ReleaseOutcome>) {
        let event = ReleaseEvent {
            key,
            primitive: self.primitive,
            lease: LeaseId(lease),
            outcome,
        };
        call(&*self.observer, "released", |o| o.released(&event));
    }
}

/// Reports a topology change, formatting the addresses only when observed.
pub(crate) fn switched(
    observer: Option<&Arc<dyn Observer>>,
    deployment: &str,
    from: &dyn fmt::Display,
    to: &dyn fmt::Display,
) {
    let Some(observer) = observer else { return };
    let (from, to) = (from.to_string(), to.to_string());
    let event = TopologyEvent {
        deployment,
        change: TopologyChange::PrimarySwitched {
            from: &from,
            to: &to,
        },
    };
    call(&**observer, "topology_changed", |o| {
        o.topology_changed(&event)
    });
}

/// Reports slots that changed owner.
pub(crate) fn slots_moved(observer: Option<&Arc<dyn Observer>>, deployment: &str, slots: usize) {
    let Some(observer) = observer else { return };
    let event = TopologyEvent {
        deployment,
        change: TopologyChange::SlotsMoved { slots },
    };
    call(&**observer, "topology_changed", |o| {
        o.topology_changed(&event)
    });
}

/// Reports a server clock that ran ahead.
pub(crate) fn server_clock_jumped(
    observer: Option<&Arc<dyn Observer>>,
    server: &str,
    gain: Duration,
    leases: usize,
) {
    let Some(observer) = observer else { return };
    let event = ServerClockEvent {
        server,
        gain,
        leases,
    };
    call(&**observer, "server_clock_jumped", |o| {
        o.server_clock_jumped(&event)
    });
}

/// Reports the fall-back to polling.
pub(crate) fn polling(observer: Option<&Arc<dyn Observer>>, server: &str, reason: &str) {
    let Some(observer) = observer else { return };
    let event = PollingEvent { server, reason };
    call(&**observer, "polling", |o| o.polling(&event));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Panics(AtomicUsize);

    impl Observer for Panics {
        fn attempt(&self, _: &AttemptEvent<'_>) {
            self.0.fetch_add(1, Ordering::Relaxed);
            panic!("observer bug");
        }
    }

    #[test]
    fn a_panicking_observer_is_caught_and_the_call_goes_on() {
        let panics = Arc::new(Panics(AtomicUsize::new(0)));
        let observer: Arc<dyn Observer> = panics.clone();
        let _started = Acquiring::start(&observer, "k", Primitive::Lock, false, Instant::now());
        assert_eq!(panics.0.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn results_map_to_how_the_call_ended() {
        let grant = |_: &()| (LeaseId(7), None);
        type Case = (Result<Option<()>, Error>, bool, &'static str);
        let cases: [Case; 5] = [
            (Ok(Some(())), true, "granted"),
            (Ok(None), true, "busy"),
            (Ok(None), false, "timed_out"),
            (Err(Error::Cancelled), false, "cancelled"),
            (Err(Error::InvalidArgument("x".into())), false, "failed"),
        ];
        for (result, once, want) in cases {
            let got = match Ended::of(&result, once, grant) {
                Ended::Granted(LeaseId(7), None) => "granted",
                Ended::Granted(..) => "wrong grant",
                Ended::NotGranted(reason) => reason.as_str(),
            };
            assert_eq!(got, want);
        }
    }
}
