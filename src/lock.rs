//! `Lock`: a plain mutex on one key — `SET key owner NX PX ttl` in a script that
//! also reads the key (arming client tracking for waiters), renew and delete only
//! when the key still holds our owner token. No fencing token: use it where two
//! holders at once would waste work, not corrupt data.

use std::fmt;
use std::time::{Duration, Instant};

use crate::acquire::Lease;
use crate::conn::Conn;
use crate::deployment::{Deployment, bad_key};
use crate::error::{Error, Result};
use crate::guard::LeaseGuard;
use crate::kind::{Acquire, Granted, Plain};
use crate::runtime::renewal::Ops;
use crate::runtime::waiters::Attempt;
use crate::scripts;
use crate::token::OwnerToken;

/// A plain mutual-exclusion lock on one key of one deployment. Made by
/// [`Coordinator::lock`](crate::Coordinator::lock); cheap to clone. Its verbs
/// are those of every [`Lease`].
///
/// It gives efficiency, not safety: a holder that pauses past its TTL can still
/// act after someone else got the lock. Where that would corrupt data, use a
/// [`FencedLock`](crate::FencedLock).
pub type Lock = Lease<Plain>;

/// A held [`Lock`]: a [`LeaseGuard`] with every guard method. Dropping it
/// releases the lock (best effort, bounded by the node timeout, never panics).
pub type LockGuard = LeaseGuard<Plain>;

impl Lease<Plain> {
    /// The physical key (with the coordinator's prefix).
    pub fn key(&self) -> &str {
        &self.physical_keys()[0]
    }
}

/// The keys and acquire script of a [`Lock`].
pub(crate) struct PlainSpec {
    keys: [String; 1],
}

impl PlainSpec {
    pub(crate) fn new(key: String) -> Self {
        PlainSpec { keys: [key] }
    }
}

/// `EVAL lease_release` by owner prefix: deletes what an unanswered attempt of
/// `owner` may have set on a string lease.
pub(crate) fn string_clean_up(key: &str, owner: &OwnerToken) -> redis::Cmd {
    scripts::LEASE_RELEASE.eval(&[key], &[owner.as_str(), "prefix"])
}

/// Reads a `[0, pttl]` busy reply's PTTL.
pub(crate) fn busy(pttl: i64) -> Option<Duration> {
    u64::try_from(pttl).ok().map(Duration::from_millis)
}

impl Acquire<()> for PlainSpec {
    fn keys(&self) -> &[String] {
        &self.keys
    }

    fn wait_keys(&self) -> Vec<&str> {
        vec![&self.keys[0]]
    }

    fn attempt(
        &self,
        dep: &Deployment,
        conn: &mut Conn,
        owner: &OwnerToken,
        ttl_ms: u64,
        deadline: Instant,
        _waiting: bool,
    ) -> Result<Attempt<Granted<()>>> {
        let key = &self.keys[0];
        let sent = dep.now();
        let reply: Vec<i64> = conn
            .script(
                &scripts::LOCK_ACQUIRE,
                &[key],
                &[owner.as_str(), &ttl_ms.to_string()],
                "acquire",
                deadline,
            )
            .map_err(|e| bad_key(e, key))?;
        match reply.as_slice() {
            [1] => Ok(Attempt::Acquired(Granted {
                grant: (),
                ops: Ops::string_value(key, owner.as_str().to_owned()),
                sent,
            })),
            [0, pttl] => Ok(Attempt::Busy(busy(*pttl))),
            other => Err(Error::UnexpectedReply {
                op: "acquire",
                reply: format!("{other:?}"),
            }),
        }
    }

    fn clean_up(&self, owner: &OwnerToken) -> redis::Cmd {
        string_clean_up(&self.keys[0], owner)
    }

    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock").field("key", &self.keys[0]).finish()
    }
}
