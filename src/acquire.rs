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
