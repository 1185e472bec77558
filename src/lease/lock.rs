//! `Lock`: a plain mutex on one key — `SET key owner NX PX ttl GET`, one
//! command that also answers who held the key (before Redis 7.0, and in a
//! wait that found it held, `SET NX PX` pipelined with reads of the key:
//! `GET`, and in the wait `PTTL`, with the read arming client tracking);
//! renew and delete only when the key still holds our owner token. No
//! fencing token: use it where two holders at once would waste work, not
//! corrupt data.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::conn::Conn;
use crate::core::acquire::dated;
use crate::error::{Error, Result};
use crate::lease::acquire::Lease;
use crate::lease::deployment::Deployment;
use crate::lease::guard::LeaseGuard;
use crate::lease::kind::{Acquire, Granted, Plain, Try, WaitKeys};
use crate::lease::{busy, string_clean_up, unexpected_acquire};
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
    /// The server refused `SET` with both `NX` and `GET` (before Redis 7.0):
    /// attempts pipeline a `GET` after `SET NX` instead.
    no_set_get: AtomicBool,
}

impl PlainSpec {
    pub(crate) fn new(key: String) -> Self {
        PlainSpec {
            keys: [key],
            no_set_get: AtomicBool::new(false),
        }
    }

    /// Whether attempts send `SET` with `GET` (until a server refused it).
    pub(crate) fn set_get(&self) -> bool {
        !self.no_set_get.load(Ordering::Relaxed)
    }

    /// An attempt's commands, in one pipeline: `SET NX PX`, with `GET` at
    /// its end when `set_get` (else a `GET` of its own after it); `CLIENT
    /// CACHING yes` right after the `SET` when `track`; `PTTL` last when
    /// `waiting`.
    pub(crate) fn request(
        &self,
        owner: &str,
        ttl_ms: u64,
        set_get: bool,
        track: bool,
        waiting: bool,
    ) -> redis::Pipeline {
        let key = &self.keys[0];
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        pipe.add_command(set_command(key, owner, ttl_ms, set_get));
        if track {
            pipe.cmd("CLIENT").arg("CACHING").arg("yes");
        }
        if !set_get {
            pipe.cmd("GET").arg(key);
        }
        if waiting {
            pipe.cmd("PTTL").arg(key);
        }
        pipe
    }

    /// Reads the replies of a [`request`](PlainSpec::request) sent at
    /// `sent` (`CLIENT CACHING`'s taken out). A grant found already this
    /// owner's (an earlier attempt's, whose reply was lost) dates from
    /// `uncertain_since`, that attempt's send, at the earliest. `None`: the
    /// server refused `SET` with both `NX` and `GET` (before Redis 7.0) and
    /// nothing ran; attempts send the older form from then on.
    pub(crate) fn read(
        &self,
        reply: &[redis::Value],
        set_get: bool,
        owner: &str,
        sent: Instant,
        uncertain_since: Option<Instant>,
    ) -> Option<Result<Attempt<Granted<()>>>> {
        let key = &self.keys[0];
        let granted = |sent| {
            Ok(Attempt::Acquired(Granted {
                grant: (),
                ops: Ops::string_value(key, owner.to_owned()),
                sent,
            }))
        };
        Some(match answer(reply, set_get, owner.as_bytes()) {
            Answer::Set => granted(sent),
            // Set by an earlier attempt of this owner whose reply was lost:
            // its expiry counts from that attempt at the earliest.
            Answer::Mine => granted(dated(uncertain_since, sent)),
            Answer::Held(pttl) => Ok(Attempt::Busy(pttl)),
            Answer::NoSetGet => {
                log::debug!(
                    "the server refuses SET with NX and GET (before Redis 7.0); acquiring \
                     {key:?} with SET NX and GET pipelined"
                );
                self.no_set_get.store(true, Ordering::Relaxed);
                return None;
            }
            Answer::Refused(e) => Err(crate::error::acquire_refused(key, e)),
            Answer::Unexpected => Err(unexpected_acquire(reply)),
        })
    }
}

/// `SET key owner NX PX ttl_ms`, with `GET` at the end when `get`, in a
/// buffer of the size it needs.
pub(crate) fn set_command(key: &str, owner: &str, ttl_ms: u64, get: bool) -> redis::Cmd {
    // The name, the arguments, and at most 20 digits of the TTL.
    let size = "SETNXPXGET".len() + key.len() + owner.len() + 20;
    let mut cmd = redis::Cmd::with_capacity(7, size);
    cmd.arg("SET")
        .arg(key)
        .arg(owner)
        .arg("NX")
        .arg("PX")
        .arg(ttl_ms);
    if get {
        cmd.arg("GET");
    }
    cmd
}

/// Whether `e` is a server's refusal of `SET` with both `NX` and `GET`
/// (Redis before 7.0 answers a syntax error and runs nothing).
fn refuses_nx_with_get(e: &redis::ServerError) -> bool {
    e.code() == "ERR" && e.details().is_some_and(|d| d.contains("syntax error"))
}

/// What the server answered to a plain attempt, `CLIENT CACHING`'s reply
/// taken out.
#[derive(Debug, PartialEq)]
pub(crate) enum Answer<'a> {
    /// Free: set now.
    Set,
    /// Already this owner's: set by an earlier attempt whose reply was lost.
    Mine,
    /// Held by someone else, for this long if a `PTTL` asked (and the key
    /// had an expiry).
    Held(Option<Duration>),
    /// `SET` with both `NX` and `GET` refused (before Redis 7.0): nothing ran.
    NoSetGet,
    /// An error reply: a key of another type, a denied command, ….
    Refused(&'a redis::ServerError),
    /// A reply of another shape.
    Unexpected,
}

/// Reads a plain attempt's replies: `[SET NX PX GET]` or `[SET NX PX, GET]`
/// (`set_get` false, before Redis 7.0), each with a `PTTL` after it in a
/// wait. `SET … GET` answers what the key held (nil: it was free and is set
/// now); a plain `SET NX` answers `OK` (set) or nil (not set), and the `GET`
/// after it whose value it is now.
pub(crate) fn answer<'a>(reply: &'a [redis::Value], set_get: bool, owner: &[u8]) -> Answer<'a> {
    use redis::Value::{BulkString, Int, Nil, Okay, ServerError};
    let held = |pttl: &'a [redis::Value]| match pttl {
        [] => Answer::Held(None),
        [Int(pttl)] => Answer::Held(busy(*pttl)),
        [ServerError(e)] => Answer::Refused(e),
        _ => Answer::Unexpected,
    };
    if set_get {
        return match reply {
            [Nil, ..] => Answer::Set,
            [BulkString(v), ..] if v.as_slice() == owner => Answer::Mine,
            [BulkString(_), pttl @ ..] => held(pttl),
            [ServerError(e), ..] if refuses_nx_with_get(e) => Answer::NoSetGet,
            [ServerError(e), ..] => Answer::Refused(e),
            _ => Answer::Unexpected,
        };
    }
    match reply {
        [Okay, ..] => Answer::Set,
        [ServerError(e), ..] | [Nil, ServerError(e), ..] => Answer::Refused(e),
        [Nil, BulkString(v), ..] if v.as_slice() == owner => Answer::Mine,
        // Nil: the holder's key expired between the `SET` and the `GET`.
        [Nil, BulkString(_) | Nil, pttl @ ..] => held(pttl),
        _ => Answer::Unexpected,
    }
}

impl Acquire<()> for PlainSpec {
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
    ) -> Result<Attempt<Granted<()>>> {
        // One round trip of plain commands, no script: `SET NX PX GET`
        // (Redis 7.0 on). It takes the lock if it is free and answers what
        // the key held before, which tells a grant of this owner's earlier
        // attempt (whose reply was lost) from another holder, and a key of
        // another type (an error, not a lock held by someone else) from both.
        // An attempt that does not wait is that one command. In a wait that
        // found the lock held, `PTTL` follows it, which says how long the
        // holder has and, being a read (a write, `SET` with `GET` too, does
        // not), arms client tracking of the key; `CLIENT CACHING yes` goes
        // right before it (after the `SET`, whose write would clear it). A
        // server that refuses `NX` with `GET` (before 7.0) gets `SET NX PX`
        // and a `GET` of its own instead, from then on, the `GET` then being
        // the read `CLIENT CACHING yes` goes before. An earlier attempt that
        // lands late finds the key set and changes nothing: it can never
        // shorten the lock.
        let track = conn.take_track();
        let set_get = self.set_get();
        let pipe = self.request(t.owner.as_str(), t.ttl_ms, set_get, track, t.waiting);
        let mut reply = conn.pipeline(&pipe, "acquire", t.deadline)?;
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
        match self.read(&reply, set_get, t.owner.as_str(), t.sent, t.uncertain_since) {
            Some(read) => read,
            None => {
                // Refused before it ran: nothing was set. Sent again at once
                // in the older form.
                if track {
                    conn.track_next();
                }
                self.attempt(_dep, conn, t)
            }
        }
    }

    fn clean_up(&self, owner: &OwnerToken) -> redis::Cmd {
        string_clean_up(&self.keys[0], owner)
    }

    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock").field("key", &self.keys[0]).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server_error(reply: &str) -> redis::ServerError {
        match redis::parse_redis_value(reply.as_bytes()).unwrap() {
            redis::Value::ServerError(e) => e,
            other => panic!("not an error reply: {other:?}"),
        }
    }

    #[test]
    fn only_a_syntax_error_is_a_refusal_of_nx_with_get() {
        // What Redis 6.2 and earlier answer to `SET k v NX PX 1 GET`.
        assert!(refuses_nx_with_get(&server_error("-ERR syntax error\r\n")));
        for other in [
            "-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
            "-NOPERM this user has no permissions to run the 'set' command\r\n",
            "-ERR value is not an integer or out of range\r\n",
            "-READONLY You can't write against a read only replica.\r\n",
        ] {
            assert!(!refuses_nx_with_get(&server_error(other)), "{other}");
        }
    }

    #[test]
    fn every_shape_of_a_plain_attempts_reply_is_read() {
        use redis::Value::{BulkString, Int, Nil, Okay, ServerError};
        let owner = b"me".as_slice();
        let bulk = |v: &str| BulkString(v.as_bytes().to_vec());
        let error = |text: &str| ServerError(server_error(text));
        let wrong_type = server_error("-WRONGTYPE Operation against a key\r\n");
        let read = |reply: &[redis::Value], set_get| format!("{:?}", answer(reply, set_get, owner));
        let expect = |a: Answer<'_>| format!("{a:?}");
        let held = |ms| expect(Answer::Held(Some(Duration::from_millis(ms))));
        // `SET NX PX GET` (Redis 7.0 on), alone or with the wait's `PTTL`.
        for (reply, want) in [
            (vec![Nil], expect(Answer::Set)),
            (vec![Nil, Int(-2)], expect(Answer::Set)),
            (vec![bulk("me")], expect(Answer::Mine)),
            (vec![bulk("me"), Int(900)], expect(Answer::Mine)),
            (vec![bulk("other")], expect(Answer::Held(None))),
            (vec![bulk("other"), Int(1_500)], held(1_500)),
            // No expiry on the holder's key, or gone since: no hint.
            (vec![bulk("other"), Int(-1)], expect(Answer::Held(None))),
            (vec![bulk("other"), Int(-2)], expect(Answer::Held(None))),
            (
                vec![error("-ERR syntax error\r\n"), Int(-2)],
                expect(Answer::NoSetGet),
            ),
            (
                vec![error("-WRONGTYPE Operation against a key\r\n")],
                expect(Answer::Refused(&wrong_type)),
            ),
            (
                vec![
                    bulk("other"),
                    error("-WRONGTYPE Operation against a key\r\n"),
                ],
                expect(Answer::Refused(&wrong_type)),
            ),
            (vec![], expect(Answer::Unexpected)),
            (vec![Okay], expect(Answer::Unexpected)),
            (
                vec![bulk("other"), Int(1), Int(1)],
                expect(Answer::Unexpected),
            ),
            (vec![bulk("other"), Nil], expect(Answer::Unexpected)),
        ] {
            assert_eq!(read(&reply, true), want, "SET … GET: {reply:?}");
        }
        // `SET NX PX` and `GET` (before 7.0), alone or with the `PTTL`.
        for (reply, want) in [
            (vec![Okay, bulk("me")], expect(Answer::Set)),
            (vec![Okay, bulk("me"), Int(30_000)], expect(Answer::Set)),
            (vec![Nil, bulk("me")], expect(Answer::Mine)),
            (vec![Nil, bulk("other")], expect(Answer::Held(None))),
            (vec![Nil, bulk("other"), Int(250)], held(250)),
            // The holder's key expired between the `SET` and the `GET`.
            (vec![Nil, Nil, Int(-2)], expect(Answer::Held(None))),
            (
                vec![error("-WRONGTYPE Operation against a key\r\n"), Nil],
                expect(Answer::Refused(&wrong_type)),
            ),
            (
                vec![Nil, error("-WRONGTYPE Operation against a key\r\n")],
                expect(Answer::Refused(&wrong_type)),
            ),
            (
                vec![
                    Nil,
                    bulk("other"),
                    error("-WRONGTYPE Operation against a key\r\n"),
                ],
                expect(Answer::Refused(&wrong_type)),
            ),
            // The `GET` reply missing, or a `SET` reply of another kind.
            (vec![Nil], expect(Answer::Unexpected)),
            (vec![Int(1), bulk("me")], expect(Answer::Unexpected)),
        ] {
            assert_eq!(read(&reply, false), want, "SET NX, GET: {reply:?}");
        }
    }

    #[test]
    fn the_plain_attempt_is_one_set_with_get() {
        let args = |cmd: &redis::Cmd| -> Vec<String> {
            cmd.args_iter()
                .map(|a| match a {
                    redis::Arg::Simple(b) => String::from_utf8(b.to_vec()).unwrap(),
                    other => panic!("not a plain argument: {other:?}"),
                })
                .collect()
        };
        let owner = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            args(&set_command("app:job", owner, 30_000, true)),
            ["SET", "app:job", owner, "NX", "PX", "30000", "GET"]
        );
        assert_eq!(
            args(&set_command("app:job", owner, u64::MAX, false)),
            ["SET", "app:job", owner, "NX", "PX", &u64::MAX.to_string()]
        );
    }
}
