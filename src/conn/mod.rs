//! Connecting, timeouts and socket options, and the command pool: the only code
//! that touches sockets.
//!
//! Every command runs with a read and write timeout. A connection on which any
//! command failed at the transport level (timeout, reset, EOF) is dropped, never
//! returned to the pool: a reply that arrives late would otherwise be read as the
//! answer to the next command.
//!
//! `config.rs` holds what opening a connection needs (URL, credentials, TLS,
//! timeouts), `connection.rs` one open connection and how it is opened,
//! `pool.rs` the bounded pool of command connections; `url.rs` parses
//! deployment URLs, `cluster.rs` and `sentinel.rs` read what Cluster and
//! Sentinel replies say.

pub(crate) mod cluster;
mod config;
mod connection;
mod pool;
pub(crate) mod sentinel;
pub(crate) mod url;

pub use self::config::Protocol;
#[cfg(feature = "tls")]
pub(crate) use self::config::TlsMaterial;
pub(crate) use self::config::{ConnConfig, ConnSettings, RoleCheck, TIMEOUTS_ZERO};
pub(crate) use self::connection::Conn;
pub(crate) use self::pool::{Connect, Pool};
pub(crate) use self::url::redact_url;
pub(crate) use crate::identity::Identity;
