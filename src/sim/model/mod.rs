//! A model Redis server for the simulation: what is outside the process.
//!
//! [`ModelServer`] keeps data with the semantics of Redis 7.0 (strings,
//! hashes, sorted sets, bitmaps, millisecond expiries, `WRONGTYPE`, the error
//! texts a client sees), runs the crate's shipped Lua scripts in an embedded
//! Lua 5.1 interpreter with Redis's conversions (see `lua`), and reads one
//! server clock the simulation sets, steps and runs fast or slow. It also
//! models the deployment around a server: a replica fed by a replication
//! stream that lags, promotion that loses the unreplicated tail, restarts
//! with and without persistence (a new `run_id`), connections that can be
//! killed, and error replies injected on purpose (`MOVED`, `ASK`,
//! `TRYAGAIN`, `READONLY`, `NOSCRIPT`, `LOADING`, `NOPERM`, `OOM`).
//!
//! Driving it (the shipped scripts come from `crate::scripts`):
//!
//! ```text
//! let mut server = ModelServer::new(seed, 1_000_000);       // ids from seed, clock in ms
//! server.command(&["SCRIPT", "LOAD", scripts::FENCED_ACQUIRE.code]);
//! let reply = server.evalsha(&scripts::FENCED_ACQUIRE.sha, &[lease, fence], &[owner, "3000"]);
//! server.set_rate(1.001);                                    // runs 0.1 % fast
//! server.elapse(Duration::from_millis(700));                 // true time passes
//! let truth = server.expiry(lease);                          // for the invariants
//! server.add_replica();
//! server.replicate(1);                                       // the replica lags
//! let old = server.promote();                                // the tail is lost
//! server.inject(Injected::Moved { slot, addr });             // the next command
//! server.restart(Persistence::None);                         // new run_id, no data
//! ```
//!
//! A reply is a [`Reply`] (RESP2); a connection is a [`ClientId`] from
//! [`ModelServer::connect`] when `CLIENT ID`, `CLIENT KILL` or `WAIT` matter.
//! [`ModelServer::fork`] copies a server to try an operation at several
//! instants; [`ModelServer::straddle_next_script`] makes a script's clock
//! tick while it runs, as a real one's can.
//!
//! Nothing here knows the crate's leases: the scripts come in as source text
//! and the commands as argument vectors, so the same files also build inside
//! the differential test (`tests/differential.rs`), which checks this model
//! against a real `redis-server`.

// The model is an API for simulation drivers and the differential test; each
// build that includes it uses only part of it.
#![allow(dead_code)]

mod keyspace;
mod lua;
mod server;

// What drivers name; each build uses part of it.
#[allow(unused_imports)]
pub(crate) use keyspace::{Entry, Fields, Value, ZSet, format_g17};
#[allow(unused_imports)]
pub(crate) use lua::sha1_hex;
#[allow(unused_imports)]
pub(crate) use server::{ClientId, Injected, ModelServer, Persistence, Role};

/// A reply as a RESP2 client receives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// A nil bulk string (or nil array).
    Nil,
    /// An integer.
    Int(i64),
    /// A bulk string.
    Bulk(Vec<u8>),
    /// A simple string such as `OK`.
    Status(String),
    /// An error, without the leading `-` (`"WRONGTYPE Operation …"`).
    Error(String),
    /// An array.
    Array(Vec<Reply>),
}

impl Reply {
    /// The integer, if this is one.
    pub(crate) fn as_int(&self) -> Option<i64> {
        match self {
            Reply::Int(n) => Some(*n),
            _ => None,
        }
    }

    /// Whether this is an error reply.
    pub(crate) fn is_error(&self) -> bool {
        matches!(self, Reply::Error(_))
    }

    /// The reply as the `redis` crate reads it off the wire.
    pub(crate) fn into_value(self) -> redis::Value {
        match self {
            Reply::Nil => redis::Value::Nil,
            Reply::Int(n) => redis::Value::Int(n),
            Reply::Bulk(b) => redis::Value::BulkString(b),
            Reply::Status(s) if s == "OK" => redis::Value::Okay,
            Reply::Status(s) => redis::Value::SimpleString(s),
            Reply::Error(e) => redis::parse_redis_value(format!("-{e}\r\n").as_bytes())
                .expect("an error line the redis crate reads"),
            Reply::Array(items) => {
                redis::Value::Array(items.into_iter().map(Reply::into_value).collect())
            }
        }
    }
}

/// The argument vector of a shipped command.
pub(crate) fn argv(cmd: &redis::Cmd) -> Vec<Vec<u8>> {
    cmd.args_iter()
        .map(|a| match a {
            redis::Arg::Simple(b) => b.to_vec(),
            _ => b"0".to_vec(),
        })
        .collect()
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reply::Nil => write!(f, "(nil)"),
            Reply::Int(n) => write!(f, "(integer) {n}"),
            Reply::Bulk(b) => write!(f, "{:?}", String::from_utf8_lossy(b)),
            Reply::Status(s) => write!(f, "+{s}"),
            Reply::Error(e) => write!(f, "-{e}"),
            Reply::Array(items) => {
                write!(f, "[")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{item}")?;
                }
                write!(f, "]")
            }
        }
    }
}

#[cfg(test)]
mod tests;
