//! The renewal thread of one deployment (`respire-renewal`: the pure schedule
//! over real time, no I/O), started the first time a guard needs it, and what
//! it knows of a lease: its commands ([`Ops`]) and the runtime's counters.
//!
//! Due renewals go to the executor of the server that holds each lease now
//! (`runtime::node`; one per server, so a slow server delays nobody else's
//! renewals), which sends every renewal due at about the same time as one
//! pipeline and reports back here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use crate::clock::Clock;
use crate::core::executor::{Claim, Claimed};
use crate::runtime::lease::LeaseCell;
use crate::runtime::scheduler::{Dispatch, RenewalThread};
use crate::scripts::Script;

/// How a lease is held on the server, for the commands that extend, verify and
/// release it.
#[derive(Clone, Copy)]
pub(crate) enum Shape {
    /// A string key whose value is the owner (`lease_*.lua`).
    StringValue,
    /// A member of a sorted set scored by its expiry (readers, permits). Extend
    /// takes `(member, ttl_ms)`, verify `(member)`, release `(member, 'exact')`.
    Member {
        extend: &'static std::sync::LazyLock<Script>,
        verify: &'static std::sync::LazyLock<Script>,
        release: &'static std::sync::LazyLock<Script>,
    },
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shape::StringValue => f.write_str("StringValue"),
            Shape::Member { extend, .. } => write!(f, "Member({})", extend.name),
        }
    }
}

/// The commands of one lease: its keys, its value or member, and its shape.
#[derive(Clone, Debug)]
pub(crate) struct Ops {
    pub(crate) keys: Vec<String>,
    pub(crate) member: String,
    pub(crate) shape: Shape,
}

impl Ops {
    /// A lease held as a string key whose value is the owner token.
    pub(crate) fn string_value(key: &str, value: String) -> Ops {
        Ops {
            keys: vec![key.to_owned()],
            member: value,
            shape: Shape::StringValue,
        }
    }

    /// A lease held as `member` of the sorted set `keys[0]`, scored by its
    /// expiry; the scripts take every key in `keys`.
    pub(crate) fn member(
        keys: Vec<String>,
        member: String,
        extend: &'static std::sync::LazyLock<Script>,
        verify: &'static std::sync::LazyLock<Script>,
        release: &'static std::sync::LazyLock<Script>,
    ) -> Ops {
        Ops {
            keys,
            member,
            shape: Shape::Member {
                extend,
                verify,
                release,
            },
        }
    }

    fn keys(&self) -> Vec<&str> {
        self.keys.iter().map(String::as_str).collect()
    }

    pub(crate) fn extend_script(&self) -> &'static Script {
        match self.shape {
            Shape::StringValue => &crate::scripts::LEASE_EXTEND,
            Shape::Member { extend, .. } => extend,
        }
    }

    pub(crate) fn verify_script(&self) -> &'static Script {
        match self.shape {
            Shape::StringValue => &crate::scripts::LEASE_VERIFY,
            Shape::Member { verify, .. } => verify,
        }
    }

    pub(crate) fn release_script(&self) -> &'static Script {
        match self.shape {
            Shape::StringValue => &crate::scripts::LEASE_RELEASE,
            Shape::Member { release, .. } => release,
        }
    }

    /// `(keys, args)` of the extension to `ttl_ms`.
    pub(crate) fn extend_args(&self, ttl_ms: u64) -> (Vec<&str>, Vec<String>) {
        (self.keys(), vec![self.member.clone(), ttl_ms.to_string()])
    }

    pub(crate) fn verify_args(&self) -> (Vec<&str>, Vec<String>) {
        (self.keys(), vec![self.member.clone()])
    }

    /// The keys, borrowed.
    pub(crate) fn key_refs(&self) -> Vec<&str> {
        self.keys()
    }

    /// The release's arguments, borrowed (no allocation on the release path).
    pub(crate) fn release_arg_refs(&self) -> Args<'_> {
        match self.shape {
            // Every shape releases its exact value (rw_read_release and
            // sem_release take the mode too).
            Shape::StringValue | Shape::Member { .. } => Args {
                items: [&self.member, "exact"],
                len: 2,
            },
        }
    }

    pub(crate) fn extend_cmd(&self, ttl_ms: u64) -> redis::Cmd {
        let (keys, args) = self.extend_args(ttl_ms);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.extend_script().evalsha(&keys, &args)
    }

    /// The extension without a script, for a server that has `SET … IFEQ`
    /// ([`Conn::has_set_ifeq`](crate::conn::Conn::has_set_ifeq)): `SET key
    /// value IFEQ value PX ttl GET` sets the value the key holds, and the
    /// expiry, only if the key holds this lease's value, and never creates
    /// it; `GET` returns what the key held, which tells apart the outcomes
    /// the script's reply names ([`Ops::set_ifeq_code`]). Only a lease held as
    /// a string value has one (`None` for another shape).
    ///
    /// One difference from the script: `SET` is refused with `OOM` on a
    /// server at its `maxmemory` under `noeviction`, where the script's
    /// `PEXPIRE` is not; a refused one goes again as the script.
    pub(crate) fn set_ifeq_cmd(&self, ttl_ms: u64) -> Option<redis::Cmd> {
        match self.shape {
            Shape::StringValue => {
                let mut cmd = redis::cmd("SET");
                cmd.arg(&self.keys[0])
                    .arg(&self.member)
                    .arg("IFEQ")
                    .arg(&self.member)
                    .arg("PX")
                    .arg(ttl_ms)
                    .arg("GET");
                Some(cmd)
            }
            Shape::Member { .. } => None,
        }
    }

    /// The reply to [`Ops::set_ifeq_cmd`] as the extension script's code: 1
    /// extended (the key held this lease's value), 0 gone (it held nothing),
    /// −1 someone else's (another value, or a key of another type:
    /// `WRONGTYPE`), and 2, unreadable, for any other reply that is not an
    /// error. `None` for any other error reply: it did not run.
    pub(crate) fn set_ifeq_code(&self, reply: &redis::Value) -> Option<i64> {
        match reply {
            redis::Value::Nil => Some(0),
            redis::Value::BulkString(held) if *held == self.member.as_bytes() => Some(1),
            redis::Value::BulkString(_) => Some(-1),
            redis::Value::ServerError(e) if e.code() == "WRONGTYPE" => Some(-1),
            redis::Value::ServerError(_) => None,
            _ => Some(2),
        }
    }

    /// The same extension as `EVAL`, for a server that lost the script.
    pub(crate) fn extend_eval(&self, ttl_ms: u64) -> redis::Cmd {
        let (keys, args) = self.extend_args(ttl_ms);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.extend_script().eval(&keys, &args)
    }

    /// The verification (`EVALSHA`; `EVAL` when `eval`).
    pub(crate) fn verify_cmd(&self, eval: bool) -> redis::Cmd {
        let (keys, args) = self.verify_args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        if eval {
            self.verify_script().eval(&keys, &args)
        } else {
            self.verify_script().evalsha(&keys, &args)
        }
    }
}

/// Up to two borrowed script arguments.
pub(crate) struct Args<'a> {
    items: [&'a str; 2],
    len: usize,
}

impl<'a> Args<'a> {
    pub(crate) fn as_slice(&self) -> &[&'a str] {
        &self.items[..self.len]
    }
}

/// A single-deployment lease.
pub(crate) type Cell = LeaseCell<Ops>;

/// Single-deployment leases the schedule claimed for a renewal.
pub(crate) type Claims = Vec<Claimed<Arc<Cell>>>;

/// Counters of the renewal runtime, for monitoring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RenewalStats {
    /// Pipelines sent (one round trip each).
    pub round_trips: u64,
    /// Leases renewed and confirmed.
    pub renewals: u64,
    /// Renewal attempts that failed or got no reply (each retried while time remained).
    pub failures: u64,
    /// Leases whose loss the runtime flagged.
    pub losses: u64,
    /// Connections fenced off after a command on them got no reply: killed, or
    /// confirmed closed already (`CLIENT KILL ID` found them gone), so that
    /// nothing sent on them can still be applied.
    pub killed_connections: u64,
}

/// The runtime's counters, shared by the renewal thread and every executor.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) round_trips: AtomicU64,
    pub(crate) renewals: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) losses: AtomicU64,
    pub(crate) killed: AtomicU64,
}

impl Counters {
    pub(crate) fn stats(&self) -> RenewalStats {
        RenewalStats {
            round_trips: self.round_trips.load(Ordering::Relaxed),
            renewals: self.renewals.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            losses: self.losses.load(Ordering::Relaxed),
            killed_connections: self.killed.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Which renewals an executor's reply completed: (lease id, when to retry).
pub(crate) struct Completed(pub(crate) Vec<(u64, Option<Instant>)>);

/// Where due renewals go: the executors of the servers that hold the leases.
pub(crate) trait Lanes: Send + Sync {
    /// Hands `batch` to the executor of each lease's server; must not block
    /// on I/O. Returns the renewals it could not hand to anyone (lease id,
    /// when to retry); the others complete through [`DeploymentRenewal::completed`].
    fn dispatch(&self, batch: Claims) -> Vec<(u64, Option<Instant>)>;
}

/// Renewals that could not be sent: each claim is given up at `now` (the
/// command never left), and each lease planned again when `retry` says
/// (`None`: as its state says).
pub(crate) fn unsent(
    batch: Claims,
    now: Instant,
    retry: impl Fn(&Cell) -> Option<Instant>,
) -> Vec<(u64, Option<Instant>)> {
    batch
        .into_iter()
        .map(|(lease, ticket, _)| {
            lease.not_sent(ticket, now);
            (lease.id(), retry(&lease))
        })
        .collect()
}

/// The renewal thread's dispatcher: hands batches to the lanes.
pub(crate) struct ToLanes {
    lanes: Weak<dyn Lanes>,
}

impl Dispatch for ToLanes {
    type Lease = Arc<Cell>;
    type Reply = Completed;

    fn dispatch(&mut self, batch: Claims, now: Instant) -> Vec<(u64, Option<Instant>)> {
        match self.lanes.upgrade() {
            Some(lanes) => lanes.dispatch(batch),
            // The deployment is going away: nothing more will be renewed.
            None => unsent(batch, now, |_| None),
        }
    }

    fn on_reply(&mut self, reply: Completed, _now: Instant) -> Vec<(u64, Option<Instant>)> {
        reply.0
    }
}

/// The renewal thread of one deployment, started on first use.
pub(crate) type DeploymentRenewal = RenewalThread<ToLanes>;

/// The renewal thread of the deployment whose servers `lanes` reaches, not
/// started yet.
pub(crate) fn renewal(clock: Arc<dyn Clock>, lanes: Weak<dyn Lanes>) -> DeploymentRenewal {
    RenewalThread::new("respire-renewal", clock, move || ToLanes {
        lanes: lanes.clone(),
    })
}

impl DeploymentRenewal {
    /// An executor finished renewals: (lease id, when to retry).
    pub(crate) fn completed(&self, done: Vec<(u64, Option<Instant>)>) {
        if !done.is_empty() {
            self.reply(Completed(done));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_ifeq_reply_reads_as_the_extension_scripts() {
        let ops = Ops::string_value("k", "owner:1".into());
        let bulk = |s: &str| redis::Value::BulkString(s.as_bytes().to_vec());
        let error = |line: &[u8]| redis::parse_redis_value(line).unwrap();
        assert_eq!(ops.set_ifeq_code(&bulk("owner:1")), Some(1));
        assert_eq!(ops.set_ifeq_code(&redis::Value::Nil), Some(0));
        assert_eq!(ops.set_ifeq_code(&bulk("owner:2")), Some(-1));
        assert_eq!(ops.set_ifeq_code(&bulk("owner:1x")), Some(-1));
        let wrong_type = error(b"-WRONGTYPE Operation against a key holding the wrong kind\r\n");
        assert_eq!(ops.set_ifeq_code(&wrong_type), Some(-1));
        assert_eq!(ops.set_ifeq_code(&redis::Value::Okay), Some(2));
        assert_eq!(ops.set_ifeq_code(&redis::Value::Int(1)), Some(2));
        for refused in [
            &b"-OOM command not allowed\r\n"[..],
            b"-MOVED 3999 127.0.0.1:7001\r\n",
            b"-READONLY You can't write against a read only replica.\r\n",
        ] {
            assert_eq!(ops.set_ifeq_code(&error(refused)), None);
        }
        let words: Vec<String> = ops
            .set_ifeq_cmd(1_500)
            .unwrap()
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => String::from_utf8_lossy(b).into_owned(),
                _ => String::new(),
            })
            .collect();
        assert_eq!(
            words,
            [
                "SET", "k", "owner:1", "IFEQ", "owner:1", "PX", "1500", "GET"
            ]
        );
    }
}
