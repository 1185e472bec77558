//! What tells the single-deployment primitives apart: the acquire script, the
//! keys, what a grant carries, and how the lease is held on the server.
//!
//! Every primitive is a [`Lease<K>`](crate::Lease) handle with the same acquire
//! verbs and every grant a [`LeaseGuard<K>`](crate::LeaseGuard) with the same
//! guard API (after `lock_api`'s `Mutex<R, T>`); the kind `K` only adds its own
//! accessors, such as [`LeaseGuard::<Fenced>::fencing_token`](crate::LeaseGuard::fencing_token).

use std::fmt;
use std::time::{Duration, Instant};

use crate::cancel::CancelToken;
use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::lease::deployment::Deployment;
use crate::observe::Primitive;
use crate::runtime::renewal::Ops;
use crate::runtime::waiters::{Attempt, Order};
use crate::token::{FencingToken, OwnerToken};

/// A kind of single-deployment lease. Implemented by the marker types of this
/// crate only ([`Plain`], [`Fenced`], [`Read`], [`Write`], [`Slot`]).
pub trait Kind: sealed::Sealed + Send + Sync + 'static {
    /// What a grant carries beside the lease itself.
    #[doc(hidden)]
    type Grant: Clone + Send + Sync + fmt::Debug + 'static;
    /// The guard's name, for `Debug`.
    #[doc(hidden)]
    const GUARD: &'static str;
    /// The grant's name, for `Debug` (empty: nothing to show).
    #[doc(hidden)]
    const GRANT: &'static str;
    /// The primitive, for observers.
    #[doc(hidden)]
    const PRIMITIVE: Primitive;
    /// The fencing token a grant carries, for observers (a reader's write
    /// epoch is not its own token).
    #[doc(hidden)]
    fn token(grant: &Self::Grant) -> Option<FencingToken>;
}

/// A kind whose every grant carries a fencing token: [`Fenced`], [`Write`]
/// and [`Slot`]. Its guards have
/// [`fencing_token`](crate::LeaseGuard::fencing_token) and implement
/// [`Fencing`](crate::Fencing). Implemented by this crate's marker types only.
pub trait FencedKind: Kind {
    /// The fencing token a grant carries.
    #[doc(hidden)]
    fn fencing_token(grant: &Self::Grant) -> FencingToken;
}

impl FencedKind for Fenced {
    fn fencing_token(grant: &FencingToken) -> FencingToken {
        *grant
    }
}

impl FencedKind for Write {
    fn fencing_token(grant: &FencingToken) -> FencingToken {
        *grant
    }
}

impl FencedKind for Slot {
    fn fencing_token(grant: &(u32, FencingToken)) -> FencingToken {
        grant.1
    }
}

mod sealed {
    #[allow(
        unreachable_pub,
        reason = "a sealed supertrait: public, but nameable only here"
    )]
    pub trait Sealed {}
}

/// The kind of a plain mutex ([`Lock`](crate::Lock)): one key, no fencing.
#[derive(Debug)]
pub enum Plain {}

/// The kind of a fenced lease ([`FencedLock`](crate::FencedLock)): every grant
/// carries a [`FencingToken`].
#[derive(Debug)]
pub enum Fenced {}

/// The kind of a read lease of a [`ReadWriteLease`](crate::ReadWriteLease)
/// ([`ReadLease`](crate::ReadLease)): every grant carries the write epoch, the
/// fencing token of the last writer.
#[derive(Debug)]
pub enum Read {}

/// The kind of the write lease of a [`ReadWriteLease`](crate::ReadWriteLease)
/// ([`WriteLease`](crate::WriteLease)): every grant carries a [`FencingToken`].
#[derive(Debug)]
pub enum Write {}

/// The kind of a [`Semaphore`](crate::Semaphore): every grant (a
/// [`Permit`](crate::Permit)) carries a slot and a [`FencingToken`].
#[derive(Debug)]
pub enum Slot {}

impl sealed::Sealed for Plain {}
impl sealed::Sealed for Fenced {}
impl sealed::Sealed for Read {}
impl sealed::Sealed for Write {}
impl sealed::Sealed for Slot {}

impl Kind for Plain {
    type Grant = ();
    const GUARD: &'static str = "LockGuard";
    const GRANT: &'static str = "";
    const PRIMITIVE: Primitive = Primitive::Lock;
    fn token(_: &Self::Grant) -> Option<FencingToken> {
        None
    }
}

impl Kind for Fenced {
    type Grant = FencingToken;
    const GUARD: &'static str = "FencedGuard";
    const GRANT: &'static str = "fencing_token";
    const PRIMITIVE: Primitive = Primitive::FencedLock;
    fn token(grant: &Self::Grant) -> Option<FencingToken> {
        Some(*grant)
    }
}

impl Kind for Read {
    type Grant = FencingToken;
    const GUARD: &'static str = "ReadGuard";
    const GRANT: &'static str = "write_epoch";
    const PRIMITIVE: Primitive = Primitive::Read;
    fn token(_: &Self::Grant) -> Option<FencingToken> {
        None
    }
}

impl Kind for Write {
    type Grant = FencingToken;
    const GUARD: &'static str = "WriteGuard";
    const GRANT: &'static str = "fencing_token";
    const PRIMITIVE: Primitive = Primitive::Write;
    fn token(grant: &Self::Grant) -> Option<FencingToken> {
        Some(*grant)
    }
}

impl Kind for Slot {
    type Grant = (u32, FencingToken);
    const GUARD: &'static str = "Permit";
    const GRANT: &'static str = "slot_and_fencing_token";
    const PRIMITIVE: Primitive = Primitive::Semaphore;
    fn token(grant: &Self::Grant) -> Option<FencingToken> {
        Some(grant.1)
    }
}

/// How long an acquire may wait.
#[derive(Clone, Copy)]
pub(crate) enum Wait<'a> {
    /// Exactly one attempt.
    Once,
    /// Until acquired, the deadline (`None`: none) or cancellation.
    Until(Option<Instant>, Option<&'a CancelToken>),
}

impl Wait<'_> {
    /// A wait of `wait` from `now`, without cancellation; one too long for
    /// the clock (`Duration::MAX`) has no deadline.
    pub(crate) fn within(now: Instant, wait: Duration) -> Self {
        Wait::Until(now.checked_add(wait), None)
    }
}

impl<'a> Wait<'a> {
    /// The wait as it starts at `now`: `Cancelled` if its token already is,
    /// and one attempt if its deadline has already passed.
    pub(crate) fn starting(self, now: Instant) -> Result<Wait<'a>> {
        match self {
            Wait::Until(_, Some(cancel)) if cancel.is_cancelled() => Err(Error::Cancelled),
            Wait::Until(Some(deadline), _) if deadline <= now => Ok(Wait::Once),
            other => Ok(other),
        }
    }
}

/// One grant, as an attempt returns it.
pub(crate) struct Granted<G> {
    pub(crate) grant: G,
    /// The commands that extend, verify and release it.
    pub(crate) ops: Ops,
    /// When the granting command was sent.
    pub(crate) sent: Instant,
}

/// The keys a wait watches: one or two, kept without an allocation (every
/// waiting acquire names them, held or not).
pub(crate) struct WaitKeys<'a> {
    keys: [&'a str; 2],
    len: usize,
}

impl<'a> WaitKeys<'a> {
    pub(crate) fn one(key: &'a str) -> Self {
        WaitKeys {
            keys: [key, ""],
            len: 1,
        }
    }

    pub(crate) fn two(first: &'a str, second: &'a str) -> Self {
        WaitKeys {
            keys: [first, second],
            len: 2,
        }
    }
}

impl<'a> std::ops::Deref for WaitKeys<'a> {
    type Target = [&'a str];

    fn deref(&self) -> &[&'a str] {
        &self.keys[..self.len]
    }
}

/// Checks the fencing token of `grant`, which `spec` made, against its
/// counter's history (see [`Acquire::counter`]): a token not above one
/// already seen is [`Error::FencingRegression`], and the caller releases the
/// grant.
pub(crate) fn check_token<K: Kind>(
    dep: &Deployment,
    spec: &dyn Acquire<K::Grant>,
    grant: &K::Grant,
    sent: Instant,
    received: Instant,
) -> Result<()> {
    match (spec.counter(), K::token(grant)) {
        (Some(counter), Some(token)) => dep.note_token(counter, token.get(), sent, received),
        _ => Ok(()),
    }
}

/// One attempt's context: whose it is, its TTL and deadline, and when it
/// goes out.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Try<'a> {
    /// The owner the attempt sets.
    pub(crate) owner: &'a OwnerToken,
    pub(crate) ttl_ms: u64,
    /// When its reply must have come.
    pub(crate) deadline: Instant,
    /// When it goes out, read before it is sent: a grant's expiry counts from
    /// it.
    pub(crate) sent: Instant,
    /// Whether it is made inside a wait (a writer then records its intent).
    pub(crate) waiting: bool,
    /// When the owner's first attempt that got no reply went out: a grant
    /// found already in place (that attempt's, or a later one's, whose reply
    /// was lost) dates from then at the earliest.
    pub(crate) uncertain_since: Option<Instant>,
}

/// One primitive's acquire logic and keys, behind a [`Lease<K>`](crate::Lease).
pub(crate) trait Acquire<G>: Send + Sync {
    /// The physical keys, in the primitive's order.
    fn keys(&self) -> &[String];
    /// Every key whose change may free it; the first holds the lease.
    fn wait_keys(&self) -> WaitKeys<'_>;
    /// Runs the acquire script once, as `t` says (see [`Try`]).
    fn attempt(&self, dep: &Deployment, conn: &mut Conn, t: Try<'_>)
    -> Result<Attempt<Granted<G>>>;
    /// The counter whose history a grant's fencing token is checked against
    /// once its reply arrived (see [`check_token`]); `None` when grants are
    /// not checked, and only then is the time a reply arrived not read.
    fn counter(&self) -> Option<&str> {
        None
    }
    /// The command that deletes whatever an unanswered attempt of `owner` set.
    fn clean_up(&self, owner: &OwnerToken) -> redis::Cmd;
    /// A wait of `owner` ended without the lease (a writer withdraws its
    /// intent). Returns by `by`; what is not done by then goes on in the
    /// background.
    fn stopped_waiting(&self, _dep: &Deployment, _owner: &OwnerToken, _by: Instant) {}
    /// Who its waits let go first (see [`Order`]).
    fn order(&self) -> Order {
        Order::Local
    }
    /// The type's name and fields, for `Debug`.
    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result;
    /// The spec itself, for the methods of one kind of [`Lease<K>`](crate::Lease)
    /// that need more than its keys (a semaphore's capacity).
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}
