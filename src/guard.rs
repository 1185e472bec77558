//! One guard API over every backend, after `lock_api`: a lease held on one
//! deployment ([`LeaseGuard`](crate::LeaseGuard), whatever its kind) and a
//! lock held by a quorum of independent servers
//! ([`RedlockGuard`](crate::RedlockGuard)) are both a [`Guard`], with one verb
//! set; what only some backends can do is a capability trait on top
//! ([`Fencing`], [`Verifiable`]), as `lock_api` adds `RawMutexTimed` to
//! `RawMutex`. Code that only holds a lease and watches for its loss can be
//! written once for both:
//!
//! ```no_run
//! use std::time::Duration;
//! use respire_coordination::{Guard, Result};
//!
//! /// Runs `step` while the lease lasts, then says how it ended.
//! fn run_while_held<G: Guard>(guard: G, mut step: impl FnMut() -> bool) -> Result<()> {
//!     let renewal = guard.keep_alive()?;
//!     while !guard.is_lost() && step() {}
//!     drop(renewal);
//!     println!("{}: {:?}", guard.key().to_owned(), guard.release()?);
//!     Ok(())
//! }
//! # let _ = Duration::ZERO;
//! ```

use std::time::Duration;

use crossbeam_channel::Receiver;

use crate::error::Result;
use crate::token::FencingToken;

/// What a guard's `release` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReleaseOutcome {
    /// The lease was still ours and is now deleted.
    Released,
    /// The key was gone: the lease had expired (or was deleted by someone else).
    Expired,
    /// Someone else holds the key now: the lease expired and was taken over (or the
    /// key was overwritten). Their lease was left alone.
    TakenOver,
    /// The release was sent but got no answer (timeout or connection failure):
    /// it may or may not have happened. The lease ends at its expiry at the latest.
    Uncertain,
}

impl ReleaseOutcome {
    /// What a release script's reply says: 1 deleted while ours, 0 gone
    /// (expired or deleted), anything else someone else's.
    pub(crate) fn of(code: i64) -> ReleaseOutcome {
        match code {
            1 => ReleaseOutcome::Released,
            0 => ReleaseOutcome::Expired,
            _ => ReleaseOutcome::TakenOver,
        }
    }
}

/// A held lease, whichever backend holds it: the verbs every guard of this
/// crate has. Each method's blocking, waking and error behaviour is the
/// backend's; see [`LeaseGuard`](crate::LeaseGuard) and
/// [`RedlockGuard`](crate::RedlockGuard). Implemented by this crate's guards
/// only.
pub trait Guard: sealed::Sealed + Sized {
    /// What [`keep_alive`](Guard::keep_alive) returns: renewal in the
    /// background for as long as it lives (it borrows the guard, so it always
    /// ends first).
    type KeepAlive<'a>
    where
        Self: 'a;

    /// The key (or resource name) the lease is held on. Does not block.
    fn key(&self) -> &str;

    /// Whether the lease must be assumed lost: its loss deadline passed, a
    /// server said it is gone or someone else's, or it was released. Does not
    /// block; once true, stays true.
    fn is_lost(&self) -> bool;

    /// A channel that never carries a message and is disconnected at the
    /// moment the lease is lost (see [`is_lost`](Guard::is_lost)): block on it
    /// with `recv()`, or `select!` it beside other work.
    fn lost_signal(&self) -> &Receiver<()>;

    /// How long the lease can still be assumed held, by the client's own
    /// bound (zero once lost). Does not block.
    fn remaining_estimate(&self) -> Duration;

    /// Gives the lease a new time to live, counted from now. Blocks for one
    /// round trip (per node, in parallel, for a quorum). `Ok(true)` when it
    /// was extended, `Ok(false)` when it was already lost (nothing is
    /// revived); an error when the outcome is unknown, with the worst case
    /// kept in the guard's bound.
    fn reset_expiry(&self, ttl: Duration) -> Result<bool>;

    /// Renews the lease in the background until the returned handle is
    /// dropped; the guard is flagged lost at once when a renewal finds the
    /// lease gone, and at its deadline when none was confirmed in time.
    fn keep_alive(&self) -> Result<Self::KeepAlive<'_>>;

    /// Releases the lease (deleting it only where this guard still holds
    /// it) and reports what the servers found. Blocks for at most the node
    /// timeout. A release whose outcome is unknown is
    /// [`ReleaseOutcome::Uncertain`]: the lease then ends at its expiry at
    /// the latest.
    fn release(self) -> Result<ReleaseOutcome>;
}

/// A guard whose grant carries a fencing token: strictly increasing per
/// counter while the counter's history survives. Send it with every write to
/// the protected resource.
pub trait Fencing: Guard {
    /// The grant's fencing token. Does not block.
    fn fencing_token(&self) -> FencingToken;
}

/// A guard that can ask its server whether the lease is still held.
pub trait Verifiable: Guard {
    /// Asks the server, in one round trip, whether the lease is still held
    /// and for how long: `Ok(Some(remaining))` held (and the guard's bound
    /// lowered to what the server says if that is sooner), `Ok(None)` gone
    /// or someone else's (the guard is then lost); an error when the server
    /// could not be asked.
    fn verify_still_held(&self) -> Result<Option<Duration>>;
}

pub(crate) mod sealed {
    /// Only this crate's guards implement [`Guard`](super::Guard).
    #[allow(
        unreachable_pub,
        reason = "a sealed supertrait: public, but nameable only here"
    )]
    pub trait Sealed {}
}
