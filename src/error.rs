//! The crate's one error type.

use std::time::Duration;

/// Everything that can go wrong in this crate.
///
/// Contention is never an error: a lock held by someone else is `Ok(None)` from
/// `try_acquire` and the bounded waits. An `Err` means misuse (bad arguments, keys
/// that cannot work together, missing permissions), an infrastructure failure
/// (connect, authentication, TLS, I/O, timeouts), a server that refused the
/// operation, or cancellation of an unbounded wait.
///
/// A [`Error::Timeout`] or [`Error::Io`] on a command that changes state means the
/// outcome is *unknown*: Redis may have applied it. The crate never reuses the
/// connection such a command was sent on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument was refused before anything was sent to Redis.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// Two keys of one primitive hash to different cluster slots, so no single
    /// script could touch both on a Redis Cluster.
    #[error(
        "keys in different cluster slots: {first:?} is in slot {first_slot}, {second:?} in slot {second_slot}; give them a common hash tag such as {{name}}"
    )]
    CrossSlot {
        /// The first physical key (with the key prefix).
        first: String,
        /// The slot of `first`.
        first_slot: u16,
        /// The second physical key (with the key prefix).
        second: String,
        /// The slot of `second`.
        second_slot: u16,
    },

    /// The connection URL or options could not be understood.
    #[error("invalid connection settings: {0}")]
    Config(String),

    /// No connection could be made to the server (refused, unreachable, or the
    /// connect timeout ran out).
    #[error("cannot connect to {addr}: {detail}")]
    Connect {
        /// The server address, without credentials.
        addr: String,
        /// What failed.
        detail: String,
    },

    /// The server refused the credentials (wrong password, unknown or disabled user).
    #[error("authentication failed at {addr}: {detail}")]
    Auth {
        /// The server address, without credentials.
        addr: String,
        /// The server's reply.
        detail: String,
    },

    /// The TLS handshake failed (certificate not trusted, wrong name, not a TLS port).
    #[error("tls handshake with {addr} failed: {detail}")]
    Tls {
        /// The server address, without credentials.
        addr: String,
        /// What failed.
        detail: String,
    },

    /// The server's ACL does not allow a command the operation needs.
    #[error("permission denied: {0}")]
    Permission(String),

    /// A command got no reply within the node timeout. If it changed state, the
    /// outcome is unknown: it may still be applied. The connection was discarded.
    #[error("no reply within {after:?} to {op}; the outcome is unknown")]
    Timeout {
        /// What was being done.
        op: &'static str,
        /// The timeout that ran out.
        after: Duration,
    },

    /// The connection failed during a command (reset, closed, broken pipe). If the
    /// command changed state, the outcome is unknown. The connection was discarded.
    #[error("connection failed during {op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The underlying error.
        #[source]
        source: redis::RedisError,
    },

    /// The server replied with an error this crate does not interpret.
    #[error("server error during {op}: {source}")]
    Server {
        /// What was being done.
        op: &'static str,
        /// The server's error.
        #[source]
        source: redis::RedisError,
    },

    /// A key exists with a type or content that the primitive cannot use. Nothing
    /// was changed.
    #[error("key {key:?} {problem}; nothing was changed")]
    BadKey {
        /// The physical key.
        key: String,
        /// What is wrong with it.
        problem: String,
    },

    /// The server is older than this crate supports: Redis 7.0 (or a server
    /// compatible with it, such as Valkey, which reports `redis_version` 7.2)
    /// is the minimum, for `SET … NX GET` and `PEXPIRETIME`. Found when the
    /// coordinator is built, before any lease is taken.
    #[error(
        "{server} runs Redis {version}; this crate needs Redis 7.0 or later (SET NX GET, PEXPIRETIME)"
    )]
    ServerTooOld {
        /// The server (no credentials).
        server: String,
        /// The `redis_version` it reported.
        version: String,
    },

    /// A fencing token was issued that is not greater than one this coordinator
    /// already saw for the same counter: the counter's history was lost (failover
    /// to a replica that had not received every increment, a restart without
    /// persistence, eviction, or someone reset it). The lease that came with it was
    /// released again.
    ///
    /// "Already saw" means: received before the attempt that got the token
    /// was sent (the first attempt whose reply was missing, in a wait), so
    /// that replies processed out of order never raise it falsely. The
    /// coordinator remembers, for as long as it lives, the highest token of
    /// each of the last 10,000 fence keys it used; for a send older than a few
    /// node timeouts it compares against a thinned record of that history, so
    /// a token received just before a send made long ago (within about the
    /// send's age) may go unseen.
    #[error(
        "fencing counter {fence_key:?} went back: issued {issued}, but {seen} was already seen; its history was lost"
    )]
    FencingRegression {
        /// The physical fence key.
        fence_key: String,
        /// The token the server just issued.
        issued: u64,
        /// The highest token seen before.
        seen: u64,
    },

    /// A semaphore's stored capacity differs from the one this handle declares:
    /// every participant must declare the same capacity, and only
    /// [`set_capacity`](crate::Lease::set_capacity) changes it. Nothing was changed.
    #[error(
        "semaphore capacity mismatch: {stored} is stored, {requested} was declared; every participant must declare the same capacity (set_capacity changes it); nothing was changed"
    )]
    CapacityMismatch {
        /// The capacity stored beside the permits.
        stored: u32,
        /// The capacity this handle declared.
        requested: u32,
    },

    /// The server's reply did not have the expected shape.
    #[error("unexpected reply to {op}: {reply}")]
    UnexpectedReply {
        /// What was being done.
        op: &'static str,
        /// The reply, as debug text.
        reply: String,
    },

    /// No pooled connection became free within the wait.
    #[error("no connection free in the pool within {0:?}")]
    PoolTimeout(Duration),

    /// A background thread could not be started.
    #[error("cannot start thread {name}: {source}")]
    Thread {
        /// The thread's name.
        name: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The wait was cancelled through its [`CancelToken`](crate::CancelToken).
    #[error("cancelled")]
    Cancelled,

    /// A Redlock operation did not get a quorum of confirmations, for reasons
    /// other than another holder (nodes down, slow or failing). `nodes` says what
    /// each node answered. Commands without a reply may still be applied; the
    /// group cleans up by owner token.
    #[error(
        "quorum not reached: {confirmed} of {} nodes for {op}, {needed} needed ({})",
        nodes.len(),
        crate::report::summarize(nodes)
    )]
    QuorumNotReached {
        /// What was being done: `"acquire"`, `"extend"` or `"release"`.
        op: &'static str,
        /// How many nodes confirmed.
        confirmed: usize,
        /// The quorum: more than half of the nodes.
        needed: usize,
        /// Every node's answer, in the group's order.
        nodes: Vec<crate::report::NodeReport>,
    },

    /// The servers given to a Redlock group are not independent: the same server
    /// twice, a primary and its replica, or nodes of a Redis Cluster.
    #[error("redlock nodes are not independent: {0}")]
    NotIndependent(String),

    /// A Redis Cluster or Sentinel deployment could not be resolved, or changed
    /// under the call: no seed or sentinel answered usefully, the sentinels do
    /// not know the service, a seed is not a cluster node, no node serves a
    /// key's slot, a server that was the primary is not any more, or a
    /// redirection could not be followed within the node timeout. Nothing is
    /// held; once the deployment settles, trying again may succeed.
    #[error("topology: {0}")]
    Topology(String),

    /// The replication guard's `Require` mode: fewer replicas acknowledged a
    /// grant within the timeout than required, so a failover could lose it.
    /// The grant was released again.
    #[error(
        "{key:?} was granted, but only {acknowledged} of the {required} required replica(s) acknowledged it; it was released"
    )]
    NotReplicated {
        /// The physical key that was granted.
        key: String,
        /// How many replicas acknowledged the grant (`WAIT`'s answer).
        acknowledged: u32,
        /// How many were required.
        required: u32,
    },

    /// The replication guard's `Require` mode: the primary extended the lease
    /// (`reset_expiry`), but fewer replicas than required acknowledged the
    /// extension within the timeout, so a replica promoted now may not have
    /// it. It does not count: the guard's bound stays where it was (lowered
    /// to the new expiry if that is shorter), and the lease is still held
    /// until then unless flagged lost.
    #[error(
        "the primary extended {key:?}, but only {acknowledged} of the {required} required replica(s) acknowledged it; the extension does not count"
    )]
    ExtensionNotReplicated {
        /// The physical key of the lease.
        key: String,
        /// How many replicas acknowledged the extension (`WAIT`'s answer).
        acknowledged: u32,
        /// How many were required.
        required: u32,
    },

    /// The replication guard's `Require` mode on a Sentinel deployment: the
    /// primary now serving does not have, in its replication history, the
    /// point at which replicas had acknowledged a grant to this coordinator
    /// (such as a server restarted from an old RDB file and promoted; see
    /// [`Replication`](crate::Replication)). Grants and fencing tokens issued
    /// since that point may be issued again. The grant that found it out was
    /// released, and every later acquire through this coordinator fails the
    /// same way at once, sending nothing: a new `Coordinator` accepts the
    /// history the deployment has now.
    #[error(
        "{key:?} was granted, but the replication history may have been lost: {detail}; it was released, and this coordinator grants nothing more"
    )]
    ReplicationHistoryLost {
        /// The physical key that was granted.
        key: String,
        /// Which primary, and what its history lacks.
        detail: String,
    },

    /// A Redlock group's node timeout is too short for a node: its round trip,
    /// measured when the group connected (the smaller of two samples), is more
    /// than half the node timeout. Raise
    /// [`RedlockOptions::node_timeout`](crate::RedlockOptions::node_timeout) to
    /// `needed` or more, or use nearer nodes.
    #[error(
        "node timeout {node_timeout:?} is too short for {node}: its round trip is {round_trip:?}, and the node timeout must be at least twice that ({needed:?})"
    )]
    NodeTimeoutTooShort {
        /// The node's address, without credentials.
        node: String,
        /// Its measured round trip.
        round_trip: Duration,
        /// The node timeout in the options.
        node_timeout: Duration,
        /// The shortest node timeout the group accepts for that node.
        needed: Duration,
    },
}

impl Error {
    /// True for a timeout: a command without a reply, a connect that ran out of
    /// time, or a pool that stayed exhausted.
    pub fn is_timeout(&self) -> bool {
        match self {
            Error::Timeout { .. } | Error::PoolTimeout(_) => true,
            Error::Connect { detail, .. } => detail.contains("timed out"),
            _ => false,
        }
    }

    /// True when trying the same call again later may succeed: timeouts, I/O and
    /// connect failures, a Redlock quorum not reached, a topology being
    /// resolved or changing, and server replies that say the server is busy,
    /// loading, failing over or moving a slot. Misuse, permissions, bad keys,
    /// a missing replica acknowledgement and cancellation are not.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Timeout { .. }
            | Error::Io { .. }
            | Error::Connect { .. }
            | Error::PoolTimeout(_)
            | Error::QuorumNotReached { .. }
            | Error::Topology(_) => true,
            Error::Server { source, .. } => matches!(
                source.code(),
                Some(
                    "BUSY"
                        | "LOADING"
                        | "TRYAGAIN"
                        | "MASTERDOWN"
                        | "CLUSTERDOWN"
                        | "READONLY"
                        | "MOVED"
                        | "ASK"
                )
            ),
            _ => false,
        }
    }

    /// True when the operation may have been applied on the server even though no
    /// confirmation arrived ([`Error::Timeout`] and [`Error::Io`]).
    pub fn is_uncertain(&self) -> bool {
        matches!(self, Error::Timeout { .. } | Error::Io { .. })
    }

    /// A copy of an error that trying again will not cure (credentials, TLS,
    /// permissions, settings, an error reply), so that one node's answer can
    /// be reported again as the error of a whole operation; `None` for the
    /// others.
    pub(crate) fn duplicate_permanent(&self) -> Option<Error> {
        if self.is_retryable() {
            return None;
        }
        Some(match self {
            Error::Auth { addr, detail } => Error::Auth {
                addr: addr.clone(),
                detail: detail.clone(),
            },
            Error::Tls { addr, detail } => Error::Tls {
                addr: addr.clone(),
                detail: detail.clone(),
            },
            Error::Permission(why) => Error::Permission(why.clone()),
            Error::Config(why) => Error::Config(why.clone()),
            Error::BadKey { key, problem } => Error::BadKey {
                key: key.clone(),
                problem: problem.clone(),
            },
            Error::Server { op, source } => Error::Server {
                op,
                source: source.clone(),
            },
            Error::UnexpectedReply { op, reply } => Error::UnexpectedReply {
                op,
                reply: reply.clone(),
            },
            _ => return None,
        })
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error of a lock acquire's error reply: a key of another type is
/// [`Error::BadKey`], a denied command [`Error::Permission`], anything else
/// [`Error::Server`].
pub(crate) fn acquire_refused(key: &str, e: &redis::ServerError) -> Error {
    let source = redis::RedisError::from(e.clone());
    if e.code() == "WRONGTYPE" {
        Error::BadKey {
            key: key.to_owned(),
            problem: "holds a value of another type, not a lock".into(),
        }
    } else if is_noperm(&source) {
        Error::Permission(format!("acquire: {source}"))
    } else {
        Error::Server {
            op: "acquire",
            source,
        }
    }
}

/// Whether a server error reply means "permission denied": `NOPERM`, or the
/// `ERR` a script gets when its user may not run a command or touch a key
/// (Redis: "The user executing the script can't …"; Valkey: "ACL failure in
/// script: …").
pub(crate) fn is_noperm(err: &redis::RedisError) -> bool {
    match err.code() {
        Some("NOPERM") => true,
        Some("ERR") => err.detail().is_some_and(|d| {
            d.contains("user executing the script can't run")
                || d.contains("user executing the script can't access")
                || d.starts_with("ACL failure in script:")
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{NodeOutcome, NodeReport, summarize};

    #[test]
    fn summaries_name_every_node() {
        let nodes = vec![
            NodeReport {
                node: "redis://a:1".into(),
                outcome: NodeOutcome::Granted,
                latency: None,
            },
            NodeReport {
                node: "redis://b:2".into(),
                outcome: NodeOutcome::Failed("refused".into()),
                latency: None,
            },
        ];
        assert_eq!(
            summarize(&nodes),
            "redis://a:1: granted; redis://b:2: failed: refused"
        );
        let e = Error::QuorumNotReached {
            op: "acquire",
            confirmed: 1,
            needed: 2,
            nodes,
        };
        assert!(
            e.to_string()
                .starts_with("quorum not reached: 1 of 2 nodes for acquire, 2 needed"),
            "{e}"
        );
    }
}
