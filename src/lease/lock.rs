//! `Lock`: a plain mutex on one key — `SET key owner NX PX ttl` pipelined with
//! reads of the key (`GET`, and in a wait that found it held `PTTL`, with the
//! read arming client tracking); renew and delete only when the key still holds our owner token. No fencing token: use it where two
//! holders at once would waste work, not corrupt data.

use std::fmt;
use std::time::Instant;

use crate::conn::Conn;
use crate::core::acquire::dated;
use crate::error::{Error, Result};
use crate::lease::acquire::Lease;
use crate::lease::deployment::Deployment;
use crate::lease::guard::LeaseGuard;
use crate::lease::kind::{Acquire, Granted, Plain};
use crate::lease::{busy, string_clean_up};
use crate::runtime::renewal::Ops;
use crate::runtime::waiters::Attempt;
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

/// The key and acquire commands of a [`Lock`].
pub(crate) struct PlainSpec {
    keys: [String; 1],
}

impl PlainSpec {
    pub(crate) fn new(key: String) -> Self {
        PlainSpec { keys: [key] }
    }
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
        waiting: bool,
        uncertain_since: Option<Instant>,
    ) -> Result<Attempt<Granted<()>>> {
        // One round trip of plain commands, no script: `SET NX PX` takes the
        // lock if it is free; `GET` tells a grant of this owner's earlier
        // attempt (whose reply was lost) from another holder, and a key of
        // another type (an error, not a lock held by someone else); in a
        // wait that found the lock held, `PTTL` says how long the holder has,
        // and `CLIENT CACHING yes` right before the `GET` (which must follow
        // the `SET`, whose write would clear it) has the read arm client
        // tracking. An earlier attempt that lands late finds the key set and
        // changes nothing: it can never shorten the lock.
        let key = &self.keys[0];
        let track = conn.take_track();
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        pipe.cmd("SET")
            .arg(key)
            .arg(owner.as_str())
            .arg("NX")
            .arg("PX")
            .arg(ttl_ms);
        if track {
            pipe.cmd("CLIENT").arg("CACHING").arg("yes");
        }
        pipe.cmd("GET").arg(key);
        if waiting {
            pipe.cmd("PTTL").arg(key);
        }
        let sent = dep.now();
        let mut reply = conn.pipeline(&pipe, "acquire", deadline)?;
        if track && reply.len() > 1 {
            // `CLIENT CACHING yes` answers `OK` on a connection whose
            // tracking was turned on (and its `CLIENT CACHING` allowed).
            if let redis::Value::ServerError(e) = reply.remove(1) {
                return Err(Error::Server {
                    op: "CLIENT CACHING",
                    source: e.into(),
                });
            }
        }
        let granted = |sent| {
            Ok(Attempt::Acquired(Granted {
                grant: (),
                ops: Ops::string_value(key, owner.as_str().to_owned()),
                sent,
            }))
        };
        let fail = |e: &redis::ServerError| {
            let source = redis::RedisError::from(e.clone());
            Err(if e.code() == "WRONGTYPE" {
                Error::BadKey {
                    key: key.clone(),
                    problem: "holds a value of another type, not a lock".into(),
                }
            } else if crate::error::is_noperm(&source) {
                Error::Permission(format!("acquire: {source}"))
            } else {
                Error::Server {
                    op: "acquire",
                    source,
                }
            })
        };
        match reply.as_slice() {
            [redis::Value::Okay, ..] => granted(sent),
            [redis::Value::ServerError(e), ..] => fail(e),
            [redis::Value::Nil, redis::Value::BulkString(v), ..]
                if v.as_slice() == owner.as_str().as_bytes() =>
            {
                // Set by an earlier attempt of this owner whose reply was
                // lost: its expiry counts from that attempt at the earliest.
                granted(dated(uncertain_since, sent))
            }
            [redis::Value::Nil, redis::Value::ServerError(e), ..]
            | [redis::Value::Nil, _, redis::Value::ServerError(e)] => fail(e),
            [redis::Value::Nil, _, redis::Value::Int(pttl)] => Ok(Attempt::Busy(busy(*pttl))),
            // One attempt (no PTTL asked): held by someone else.
            [
                redis::Value::Nil,
                redis::Value::BulkString(_) | redis::Value::Nil,
            ] => Ok(Attempt::Busy(None)),
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
