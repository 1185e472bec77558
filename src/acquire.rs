//! The acquire verbs every single-deployment primitive shares: one attempt, a
//! bounded wait, and a cancellable wait, with clean-up after an attempt whose
//! reply was lost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cancel::CancelToken;
use crate::conn::Conn;
use crate::coordinator::Shared;
use crate::error::{Error, Result};
use crate::runtime::waiters::{self, Attempt};
use crate::token::OwnerToken;

/// One primitive's acquire script.
pub(crate) trait Acquirer {
    type Guard;
    fn shared(&self) -> &Arc<Shared>;
    /// The key whose changes may free the primitive.
    fn wait_key(&self) -> &str;
    /// Runs the acquire script once for `owner`.
    fn attempt(
        &self,
        conn: &mut Conn,
        owner: &OwnerToken,
        ttl_ms: u64,
    ) -> Result<Attempt<Self::Guard>>;
}

/// How long to wait.
pub(crate) enum Wait<'a> {
    /// Exactly one attempt.
    Once,
    /// Until the deadline (`Ok(None)` after it).
    Until(Instant),
    /// Until acquired or cancelled.
    Cancellable(&'a CancelToken),
    /// Until the deadline (`Ok(None)` after it) or cancellation (`Err`).
    UntilOrCancel(Instant, &'a CancelToken),
}

pub(crate) fn acquire<A: Acquirer>(
    prim: &A,
    ttl: Duration,
    wait: Wait<'_>,
) -> Result<Option<A::Guard>> {
    let shared = prim.shared();
    let ttl_ms = shared.check_ttl(ttl)?;
    if let Wait::Cancellable(cancel) | Wait::UntilOrCancel(_, cancel) = wait
        && cancel.is_cancelled()
    {
        return Err(Error::Cancelled);
    }
    let owner = OwnerToken::new();
    let wait = match wait {
        Wait::Until(deadline) | Wait::UntilOrCancel(deadline, _) if deadline <= Instant::now() => {
            Wait::Once
        }
        other => other,
    };
    let result = match wait {
        Wait::Once => {
            let timeout = shared.node_timeout();
            let once = || {
                shared
                    .pool
                    .get(timeout)
                    .and_then(|mut conn| prim.attempt(&mut conn, &owner, ttl_ms))
            };
            // A connection that failed (a restart, an idle timeout) empties the
            // pool; the attempt is idempotent for this owner, so one more try
            // on a fresh connection is safe.
            let attempt = match once() {
                Err(Error::Io { .. }) => once(),
                other => other,
            };
            attempt.map(|attempt| match attempt {
                Attempt::Acquired(guard) => Some(guard),
                Attempt::Busy(_) => None,
            })
        }
        Wait::Until(deadline) => {
            waiters::wait_for(shared, prim.wait_key(), Some(deadline), None, |c| {
                prim.attempt(c, &owner, ttl_ms)
            })
        }
        Wait::UntilOrCancel(deadline, cancel) => {
            waiters::wait_for(shared, prim.wait_key(), Some(deadline), Some(cancel), |c| {
                prim.attempt(c, &owner, ttl_ms)
            })
        }
        Wait::Cancellable(cancel) => {
            waiters::wait_for(shared, prim.wait_key(), None, Some(cancel), |c| {
                prim.attempt(c, &owner, ttl_ms)
            })
        }
    };
    if let Err(e) = &result
        && e.is_uncertain()
    {
        // The last attempt may have been granted without our hearing of it.
        shared.release_owner(prim.wait_key(), &owner);
    }
    result
}

/// The waiting verbs every single-deployment primitive has (all but
/// `try_acquire`, whose errors differ): `$Guard` is its guard type, `$prim`
/// its type name (for doc links) and `$what` names the thing held.
macro_rules! wait_verbs {
    ($Guard:ty, $prim:literal, $what:literal) => {
        #[doc = concat!(
                    "Waits up to `wait` for the ", $what, ". A zero wait makes exactly one \
             attempt.\n\n\
             Blocks until acquired or the wait runs out; it is woken by invalidations \
             of the key (client tracking) and by a timer at the holder's expiry, and \
             does not poll unless tracking is unavailable. Returns `Ok(None)` when the \
             wait runs out.\n\n\
             # Errors\n\
             As [`try_acquire`](", $prim, "::try_acquire). Transport errors end the wait."
                )]
        pub fn acquire_timeout(
            &self,
            ttl: std::time::Duration,
            wait: std::time::Duration,
        ) -> $crate::Result<Option<$Guard>> {
            self.acquire_deadline(ttl, std::time::Instant::now() + wait)
        }

        #[doc = concat!(
                    "Waits until `deadline` for the ", $what, "; see \
             [`acquire_timeout`](", $prim, "::acquire_timeout). A deadline already \
             past makes exactly one attempt.\n\n\
             # Errors\n\
             As [`try_acquire`](", $prim, "::try_acquire)."
                )]
        pub fn acquire_deadline(
            &self,
            ttl: std::time::Duration,
            deadline: std::time::Instant,
        ) -> $crate::Result<Option<$Guard>> {
            $crate::acquire::acquire(self, ttl, $crate::acquire::Wait::Until(deadline))
        }

        #[doc = concat!(
                    "Waits for the ", $what, " until it is acquired or `cancel` is cancelled.\n\n\
             # Errors\n\
             [`Error::Cancelled`](crate::Error::Cancelled) on cancellation (never \
             turned into \"not acquired\"; a ", $what, " granted to an attempt in \
             flight at that moment is released), otherwise as \
             [`try_acquire`](", $prim, "::try_acquire)."
                )]
        pub fn acquire(
            &self,
            ttl: std::time::Duration,
            cancel: &$crate::CancelToken,
        ) -> $crate::Result<$Guard> {
            $crate::acquire::acquire(self, ttl, $crate::acquire::Wait::Cancellable(cancel))?
                .ok_or($crate::Error::Cancelled)
        }

        #[doc = concat!(
                    "Waits for the ", $what, " until it is acquired, `deadline` passes, or \
             `cancel` is cancelled — a bounded wait that the caller can also abort.\n\n\
             Returns `Ok(None)` when the deadline passes (a deadline already past \
             makes exactly one attempt).\n\n\
             # Errors\n\
             [`Error::Cancelled`](crate::Error::Cancelled) on cancellation, which is \
             never turned into \"not acquired\"; otherwise as \
             [`try_acquire`](", $prim, "::try_acquire)."
                )]
        pub fn acquire_until(
            &self,
            ttl: std::time::Duration,
            deadline: std::time::Instant,
            cancel: &$crate::CancelToken,
        ) -> $crate::Result<Option<$Guard>> {
            $crate::acquire::acquire(
                self,
                ttl,
                $crate::acquire::Wait::UntilOrCancel(deadline, cancel),
            )
        }
    };
}
pub(crate) use wait_verbs;
