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
use std::time::Instant;

use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::lease::acquire::Lease;
use crate::lease::deployment::{Deployment, bad_key, bad_key_in};
use crate::lease::guard::LeaseGuard;
use crate::lease::kind::{Acquire, Fenced, Granted, Try, WaitKeys};
use crate::lease::{busy, string_clean_up, token_grant, unexpected_acquire};
use crate::runtime::waiters::Attempt;
use crate::scripts::{self, Script};
use crate::token::{FencingToken, OwnerToken};

/// A fenced lock on one deployment. Made by
/// [`Coordinator::fenced_lock`](crate::Coordinator::fenced_lock); cheap to
/// clone. Its verbs are those of every [`Lease`].
pub type FencedLock = Lease<Fenced>;

/// A held [`FencedLock`] lease and its fencing token
/// ([`fencing_token`](LeaseGuard::fencing_token)): a [`LeaseGuard`] with every
/// guard method. Dropping it releases the lease (best effort, bounded by the
/// node timeout, never panics).
pub type FencedGuard = LeaseGuard<Fenced>;

impl Lease<Fenced> {
    /// The physical lease key.
    pub fn lease_key(&self) -> &str {
        &self.physical_keys()[0]
    }

    /// The physical fence counter key.
    pub fn fence_key(&self) -> &str {
        &self.physical_keys()[1]
    }
}

/// The keys and acquire script of a [`FencedLock`].
pub(crate) struct FencedSpec {
    /// Lease, fence, and the value key when there is one.
    keys: Vec<String>,
    /// The value every grant writes to the value key (with its token).
    value: Option<String>,
}

impl FencedSpec {
    pub(crate) fn new(lease: String, fence: String) -> Self {
        FencedSpec {
            keys: vec![lease, fence],
            value: None,
        }
    }

    /// A fenced lease whose every grant also sets `value_key` to
    /// `token:value`, in the same script call.
    pub(crate) fn advertising(
        lease: String,
        fence: String,
        value_key: String,
        value: String,
    ) -> Self {
        FencedSpec {
            keys: vec![lease, fence, value_key],
            value: Some(value),
        }
    }

    /// Calls `send` with an attempt's script, keys and arguments for `owner`
    /// at `ttl` milliseconds: lease, fence and the value key when there is
    /// one; owner, TTL and the value when there is one (on the stack, no
    /// vector per attempt).
    pub(crate) fn request<R>(
        &self,
        owner: &str,
        ttl: &str,
        send: impl FnOnce(&'static Script, &[&str], &[&str]) -> R,
    ) -> R {
        let key_slots = [
            self.keys[0].as_str(),
            self.keys[1].as_str(),
            self.keys.get(2).map_or("", String::as_str),
        ];
        let arg_slots = [owner, ttl, self.value.as_deref().unwrap_or_default()];
        send(
            &scripts::FENCED_ACQUIRE,
            &key_slots[..self.keys.len()],
            &arg_slots[..2 + usize::from(self.value.is_some())],
        )
    }

    /// The error of a refused attempt over `keys`, named by the key it is
    /// about: a fence counter at its largest value or not a counter, the
    /// value key (`BADKEY` names it by index), else the lease key.
    fn refused(&self, e: Error, keys: &[&str]) -> Error {
        let (lease, fence) = (&self.keys[0], &self.keys[1]);
        let key = match &e {
            Error::Server { source, .. }
                if source.code() == Some("BADFENCE") || source.to_string().contains("overflow") =>
            {
                fence
            }
            _ => lease,
        };
        match e {
            Error::Server { source, .. } if source.to_string().contains("overflow") => {
                Error::BadKey {
                    key: key.clone(),
                    problem: "is at the largest value a counter can hold; no further fencing \
                              token can be issued"
                        .into(),
                }
            }
            e if key == lease => bad_key_in(e, keys),
            e => bad_key(e, key),
        }
    }

    /// Reads the script's reply to an attempt of `owner` sent at `sent`:
    /// `{1, token}` granted, `{0, pttl}` held.
    pub(crate) fn read(
        &self,
        reply: &[redis::Value],
        owner: &str,
        sent: Instant,
    ) -> Result<Attempt<Granted<FencingToken>>> {
        match reply {
            [redis::Value::Int(1), token] => token_grant(token, &self.keys[0], owner, sent),
            [redis::Value::Int(0), redis::Value::Int(pttl)] => Ok(Attempt::Busy(busy(*pttl))),
            other => Err(unexpected_acquire(other)),
        }
    }
}

impl Acquire<FencingToken> for FencedSpec {
    fn keys(&self) -> &[String] {
        &self.keys
    }

    fn wait_keys(&self) -> WaitKeys<'_> {
        WaitKeys::one(&self.keys[0])
    }

    fn attempt(
        &self,
        _dep: &Deployment,
        conn: &mut Conn,
        t: Try<'_>,
    ) -> Result<Attempt<Granted<FencingToken>>> {
        let ttl = t.ttl_ms.to_string();
        let reply: Vec<redis::Value> =
            self.request(t.owner.as_str(), &ttl, |script, keys, args| {
                conn.script(script, keys, args, "acquire", t.deadline)
                    .map_err(|e| self.refused(e, keys))
            })?;
        self.read(&reply, t.owner.as_str(), t.sent)
    }

    fn counter(&self) -> Option<&str> {
        Some(&self.keys[1])
    }

    fn clean_up(&self, owner: &OwnerToken) -> redis::Cmd {
        string_clean_up(&self.keys[0], owner)
    }

    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FencedLock")
            .field("lease_key", &self.keys[0])
            .field("fence_key", &self.keys[1])
            .finish()
    }
}
