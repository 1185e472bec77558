//! `Lock`: a plain mutex on one key — `SET key owner NX PX ttl`, renew and delete
//! only when the key still holds our owner token. No fencing token: use it where
//! two holders at once would waste work, not corrupt data.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::acquire::{self, Acquirer, Wait};
use crate::conn::Conn;
use crate::coordinator::Shared;
use crate::error::{Error, Result};
use crate::lease::{LeaseCore, lease_guard_methods};
use crate::runtime::waiters::Attempt;
use crate::scripts;
use crate::token::OwnerToken;

/// A plain mutual-exclusion lock on one key of one deployment. Made by
/// [`Coordinator::lock`](crate::Coordinator::lock); cheap to clone.
///
/// It gives efficiency, not safety: a holder that pauses past its TTL can still
/// act after someone else got the lock. Where that would corrupt data, use a
/// [`FencedLock`](crate::FencedLock).
#[derive(Clone)]
pub struct Lock {
    shared: Arc<Shared>,
    key: String,
}

impl Lock {
    pub(crate) fn new(shared: Arc<Shared>, key: String) -> Self {
        Lock { shared, key }
    }

    /// The physical key (with the coordinator's prefix).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// One attempt, one round trip. Blocks for at most the node timeout.
    ///
    /// Returns `Ok(Some(guard))` when granted, `Ok(None)` when someone else holds
    /// the lock.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero TTL, one above [`MAX_TTL`](crate::MAX_TTL)
    /// or one not longer than the node timeout plus drift; [`Error::BadKey`] when
    /// the key holds a non-string value; [`Error::Timeout`] / [`Error::Io`] when the
    /// reply was lost (a lock it may have set is deleted again, best effort);
    /// other transport and server errors as they come.
    pub fn try_acquire(&self, ttl: Duration) -> Result<Option<LockGuard>> {
        acquire::acquire(self, ttl, Wait::Once)
    }

    acquire::wait_verbs!(LockGuard, "Lock", "lock");
}

impl Acquirer for Lock {
    type Guard = LockGuard;

    fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    fn wait_key(&self) -> &str {
        &self.key
    }

    fn attempt(
        &self,
        conn: &mut Conn,
        owner: &OwnerToken,
        ttl_ms: u64,
    ) -> Result<Attempt<LockGuard>> {
        let sent = Instant::now();
        let reply: Vec<i64> = conn
            .script(
                &scripts::LOCK_ACQUIRE,
                &[&self.key],
                &[owner.as_str(), &ttl_ms.to_string()],
                "acquire",
                self.shared.node_timeout(),
            )
            .map_err(|e| self.shared.bad_key(e, &self.key))?;
        match reply.as_slice() {
            [1] => Ok(Attempt::Acquired(LockGuard {
                core: LeaseCore::new(
                    self.shared.clone(),
                    self.key.clone(),
                    owner.as_str().to_owned(),
                    sent,
                    ttl_ms,
                ),
            })),
            [0, pttl] => Ok(Attempt::Busy(
                u64::try_from(*pttl).ok().map(Duration::from_millis),
            )),
            other => Err(Error::UnexpectedReply {
                op: "acquire",
                reply: format!("{other:?}"),
            }),
        }
    }
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock").field("key", &self.key).finish()
    }
}

/// A held [`Lock`]. Dropping it releases the lock (best effort, bounded by the
/// node timeout, never panics); [`release`](LockGuard::release) does the same
/// and reports what happened.
#[must_use = "if unused the lock is released immediately"]
pub struct LockGuard {
    core: LeaseCore,
}

impl LockGuard {
    lease_guard_methods!("lock");
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("LockGuard");
        self.core.debug_fields(&mut d);
        d.finish()
    }
}
