//! `FencedLock`: a lease plus a persistent counter that issues a strictly
//! increasing fencing token with every grant.
//!
//! A lease alone cannot stop a holder that paused (GC, swap, SIGSTOP) or whose
//! packets were delayed from acting after its lease ended; the protected resource
//! can, by refusing any write whose token is lower than the highest it accepted
//! (Martin Kleppmann, "How to do distributed locking", 2016). The token is only as
//! monotonic as the counter's history: a failover to a replica that missed
//! increments, a restart without persistence, or eviction can issue a token twice.

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

/// A fencing token: strictly greater for every later grant of the same lock, as
/// long as the counter's history survives on the server.
///
/// Pass it with every write to the protected resource, and have the resource
/// atomically refuse a token lower than the highest it has accepted (equal tokens
/// are the same holder writing again).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// The token as a number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// A fenced lock on one deployment. Made by
/// [`Coordinator::fenced_lock`](crate::Coordinator::fenced_lock); cheap to clone.
#[derive(Clone)]
pub struct FencedLock {
    shared: Arc<Shared>,
    lease: String,
    fence: String,
}

impl FencedLock {
    pub(crate) fn new(shared: Arc<Shared>, lease: String, fence: String) -> Self {
        FencedLock {
            shared,
            lease,
            fence,
        }
    }

    /// The physical lease key.
    pub fn lease_key(&self) -> &str {
        &self.lease
    }

    /// The physical fence counter key.
    pub fn fence_key(&self) -> &str {
        &self.fence
    }

    /// One attempt, one round trip: if the lease is free, the script increments
    /// the counter and sets the lease with this holder's owner token and the new
    /// fencing token. Blocks for at most the node timeout.
    ///
    /// Returns `Ok(Some(guard))` when granted, `Ok(None)` when someone else holds
    /// the lease.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad TTL; [`Error::BadKey`] when the lease
    /// key holds another type or the counter has an expiry, another type, or is not
    /// an integer (nothing is changed); [`Error::FencingRegression`] when the token
    /// is not above one this coordinator saw before (the lease is released again);
    /// [`Error::Timeout`] / [`Error::Io`] when the reply was lost (a lease it may
    /// have set is deleted again, best effort; the counter may have advanced).
    pub fn try_acquire(&self, ttl: Duration) -> Result<Option<FencedGuard>> {
        acquire::acquire(self, ttl, Wait::Once)
    }

    acquire::wait_verbs!(FencedGuard, "FencedLock", "lease");
}

impl Acquirer for FencedLock {
    type Guard = FencedGuard;

    fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    fn wait_key(&self) -> &str {
        &self.lease
    }

    fn attempt(
        &self,
        conn: &mut Conn,
        owner: &OwnerToken,
        ttl_ms: u64,
    ) -> Result<Attempt<FencedGuard>> {
        let sent = Instant::now();
        let reply: Vec<i64> = conn
            .script(
                &scripts::FENCED_ACQUIRE,
                &[&self.lease, &self.fence],
                &[owner.as_str(), &ttl_ms.to_string()],
                "acquire",
                self.shared.node_timeout(),
            )
            .map_err(|e| {
                let key = match &e {
                    Error::Server { source, .. } if source.code() == Some("BADFENCE") => {
                        &self.fence
                    }
                    _ => &self.lease,
                };
                self.shared.bad_key(e, key)
            })?;
        match reply.as_slice() {
            [1, token] if *token > 0 => {
                let token = *token as u64;
                let guard = FencedGuard {
                    core: LeaseCore::new(
                        self.shared.clone(),
                        self.lease.clone(),
                        format!("{}:{token}", owner.as_str()),
                        sent,
                        ttl_ms,
                    ),
                    token: FencingToken(token),
                };
                if let Err(e) = self.shared.note_token(&self.fence, token) {
                    drop(guard);
                    return Err(e);
                }
                Ok(Attempt::Acquired(guard))
            }
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

impl fmt::Debug for FencedLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FencedLock")
            .field("lease_key", &self.lease)
            .field("fence_key", &self.fence)
            .finish()
    }
}

/// A held [`FencedLock`] lease and its fencing token. Dropping it releases the
/// lease (best effort, bounded by the node timeout, never panics).
#[must_use = "if unused the lease is released immediately"]
pub struct FencedGuard {
    core: LeaseCore,
    token: FencingToken,
}

impl FencedGuard {
    /// The fencing token of this grant. Send it with every write to the protected
    /// resource.
    pub fn fencing_token(&self) -> FencingToken {
        self.token
    }

    lease_guard_methods!("lease");
}

impl fmt::Debug for FencedGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("FencedGuard");
        self.core.debug_fields(&mut d);
        d.field("fencing_token", &self.token).finish()
    }
}
