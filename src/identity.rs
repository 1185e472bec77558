//! What a server knows of one of its connections: the data a kill needs. It
//! sits below the connections and the core alike, since both name
//! connections by it.

use std::sync::Arc;

/// What the server knows of one of its connections, enough to kill that one
/// and no other: its id (`CLIENT ID`) and, from Redis 6.2 on, the address the
/// server sees it come from (`addr=` of `CLIENT INFO`).
///
/// A server numbers its connections from 1 each time it starts, so after a
/// restart the id alone may name another client's connection; a kill of
/// [`Identity::kill_cmd`] must match the address too. Without it (a server
/// older than 6.2, or an ACL that denies `CLIENT INFO`) the kill goes by id
/// alone, as it did before, with that risk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    id: u64,
    addr: Option<Arc<str>>,
}

impl Identity {
    /// The connection with id `id`, at the address `CLIENT INFO` replied
    /// (when it replied with one for the same id).
    pub(crate) fn of(id: u64, info: Option<&redis::Value>) -> Identity {
        let text = info.and_then(crate::reply::text);
        let field = |name: &str| {
            text?
                .split_ascii_whitespace()
                .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
        };
        let same = field("id").and_then(|v| v.parse::<u64>().ok()) == Some(id);
        let addr = field("addr").filter(|a| same && !a.is_empty());
        if addr.is_none() {
            log::debug!(
                "no address for connection {id} (CLIENT INFO answered {info:?}): a kill of \
                 it goes by id alone"
            );
        }
        Identity {
            id,
            addr: addr.map(Arc::from),
        }
    }

    /// A connection known by its id alone (no address to match), as the
    /// simulation's model servers name theirs.
    #[cfg(test)]
    pub(crate) fn by_id(id: u64) -> Identity {
        Identity { id, addr: None }
    }

    /// A connection no server has (id `i64::MAX`, which a server never hands
    /// out): killing it checks the right to `CLIENT KILL` (allowed: it
    /// answers 0; denied: `NOPERM`) and closes nothing.
    pub(crate) fn nobody() -> Identity {
        Identity {
            id: i64::MAX.unsigned_abs(),
            addr: None,
        }
    }

    /// The server's id for the connection.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// `CLIENT KILL ID id ADDR addr SKIPME yes` (without `ADDR` when the
    /// address is unknown): it answers how many connections it closed, 1 or
    /// 0. Both filters must match, so a connection that took the id after a
    /// restart, from another address, is left alone.
    pub(crate) fn kill_cmd(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("CLIENT");
        cmd.arg("KILL").arg("ID").arg(self.id);
        if let Some(addr) = &self.addr {
            cmd.arg("ADDR").arg(&**addr);
        }
        cmd.arg("SKIPME").arg("yes");
        cmd
    }
}
