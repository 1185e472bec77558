//! The single-deployment primitives, and the one lease family every backend
//! shares. The shared lease module: the deployment they all run on
//! (`deployment.rs`), the kinds and the acquire trait each primitive
//! implements (`kind.rs`), the generic handle `Lease<B>` (`acquire.rs`) and
//! guard `LeaseGuard<B>` over a sealed backend — every kind, and Redlock,
//! whose backend is in `redlock/` (`guard.rs`), and the reply helpers below. Then one file per primitive, side by side: `lock.rs`,
//! `fenced.rs`, `rwlease.rs`, `semaphore.rs`, `election.rs`, `fairness.rs`
//! and `multi.rs`; each imports the shared pieces only, never another
//! primitive, except where one is built on another: `election.rs` is a
//! fenced lease with a value (it builds on `fenced.rs`), and `fairness.rs`
//! queues the plain lock of `lock.rs`. `multi.rs` holds several plain or
//! fenced leases as one set (the coordinator hands it the leases).
//! tests/layering.rs checks both rules.

pub(crate) mod acquire;
pub(crate) mod deployment;
pub(crate) mod election;
pub(crate) mod fairness;
pub(crate) mod fenced;
pub(crate) mod guard;
pub(crate) mod kind;
pub(crate) mod lock;
pub(crate) mod multi;
pub(crate) mod rwlease;
pub(crate) mod semaphore;

use std::fmt;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::lease::kind::Granted;
use crate::runtime::renewal::Ops;
use crate::runtime::waiters::Attempt;
use crate::scripts;
use crate::token::{FencingToken, OwnerToken};

/// `EVAL lease_release` by owner prefix: deletes what an unanswered attempt of
/// `owner` may have set on a string lease.
pub(crate) fn string_clean_up(key: &str, owner: &OwnerToken) -> redis::Cmd {
    scripts::LEASE_RELEASE.eval(&[key], &[owner.as_str(), "prefix"])
}

/// Reads a `[0, pttl]` busy reply's PTTL.
pub(crate) fn busy(pttl: i64) -> Option<Duration> {
    u64::try_from(pttl).ok().map(Duration::from_millis)
}

/// A grant of a lease held as the string `owner:token` on `key`, with the
/// token a fenced or write acquire script answered (`{1, token}`).
pub(crate) fn token_grant(
    token: &redis::Value,
    key: &str,
    owner: &str,
    sent: Instant,
) -> Result<Attempt<Granted<FencingToken>>> {
    let token = parse_token(token, "acquire")?;
    Ok(Attempt::Acquired(Granted {
        grant: token,
        ops: Ops::string_value(key, format!("{owner}:{token}")),
        sent,
    }))
}

/// An acquire's reply of a shape no attempt answers.
pub(crate) fn unexpected_acquire(reply: &(impl fmt::Debug + ?Sized)) -> Error {
    Error::UnexpectedReply {
        op: "acquire",
        reply: format!("{reply:?}"),
    }
}

/// Reads a token the scripts return as a string (or, from older scripts, an
/// integer).
pub(crate) fn parse_token(value: &redis::Value, op: &'static str) -> Result<FencingToken> {
    let parsed = match value {
        redis::Value::BulkString(b) => std::str::from_utf8(b).ok().and_then(|s| s.parse().ok()),
        redis::Value::SimpleString(s) => s.parse().ok(),
        redis::Value::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    };
    match parsed {
        Some(t) if t > 0 => Ok(FencingToken(t)),
        _ => Err(Error::UnexpectedReply {
            op,
            reply: format!("fencing token {value:?} is not a positive 64-bit integer"),
        }),
    }
}
