//! Reading what the nodes of a Redlock group hold at one key.

use std::time::{Duration, Instant};

use super::RedlockGroup;
use crate::conn::ConnConfig;
use crate::coordinator::inspect::{ExclusiveHolder, holder, readable};
use crate::error::{Error, Result};

/// What the nodes of a [`RedlockGroup`] hold at one key, as read by
/// [`RedlockGroup::inspect`].
#[derive(Debug)]
#[non_exhaustive]
pub struct RedlockInspection {
    /// Each node's answer, in the group's order.
    pub nodes: Vec<NodeInspection>,
    /// How many nodes must agree: more than half of all of them.
    pub quorum: usize,
    /// When the reads were started, on this process's monotonic clock.
    pub read_at: Instant,
}

/// What one node of a group holds at the key (with the node's prefix).
#[derive(Debug)]
#[non_exhaustive]
pub struct NodeInspection {
    /// The node's address, without credentials.
    pub addr: String,
    /// The holder of the key on this node (`None`: free), with its owner id,
    /// its holder's identity where it records one and its `PTTL`; or why the
    /// node could not be read.
    pub holder: Result<Option<ExclusiveHolder>>,
}

impl RedlockInspection {
    /// The holder of the lock: the owner found on a quorum of nodes, as the
    /// first of those nodes shows it; `None` when no owner holds a quorum
    /// (free, expired on too many nodes, or nodes that could not be read).
    pub fn holder(&self) -> Option<&ExclusiveHolder> {
        let held: Vec<&ExclusiveHolder> = self
            .nodes
            .iter()
            .filter_map(|n| n.holder.as_ref().ok()?.as_ref())
            .collect();
        held.iter()
            .find(|h| self.held_on(&h.owner) >= self.quorum)
            .copied()
    }

    /// On how many nodes `owner` holds the key.
    pub fn held_on(&self, owner: &str) -> usize {
        self.nodes
            .iter()
            .filter(|n| matches!(&n.holder, Ok(Some(h)) if h.owner == owner))
            .count()
    }
}

impl RedlockGroup {
    /// Reads, without changing anything, what every node holds at `key`
    /// (each node's prefix applied): the holder on each node, with its owner
    /// id, its holder's identity where it records one
    /// ([`with_holder`](RedlockGroup::with_holder)) and its time left from
    /// the node's `PTTL`; [`RedlockInspection::holder`] is the owner a
    /// quorum of nodes hold.
    ///
    /// Opens one short-lived connection per node, all at once (the nodes'
    /// workers keep theirs for locks), each bounded by its connect timeout,
    /// then sends `GET` and `PTTL` in one round trip bounded by the node
    /// timeout; blocks until every node answered or failed. A node that
    /// cannot be read gives its error in its [`NodeInspection`], not the
    /// call's. What it reports may change as soon as it returns: it is for
    /// reports and checks, never a reason to skip an acquire.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty key (nothing sent);
    /// [`Error::Thread`] when a thread to read a node cannot be started.
    pub fn inspect(&self, key: &str) -> Result<RedlockInspection> {
        let g = &self.inner;
        let keys = g.physical_keys(key, "inspected redlock key")?;
        let node_timeout = g.timing.node_timeout;
        let read_at = g.now();
        let nodes = std::thread::scope(|scope| {
            let mut reads = Vec::with_capacity(g.workers.len());
            for ((cfg, physical), worker) in g.configs.iter().zip(keys).zip(&g.workers) {
                let read = std::thread::Builder::new()
                    .name("respire-inspect".into())
                    .spawn_scoped(scope, move || read_node(cfg, &physical, node_timeout))
                    .map_err(|source| Error::Thread {
                        name: "respire-inspect",
                        source,
                    })?;
                reads.push((worker.addr.clone(), read));
            }
            Ok::<_, Error>(
                reads
                    .into_iter()
                    .map(|(addr, read)| NodeInspection {
                        addr,
                        holder: read.join().unwrap_or_else(|_| {
                            Err(Error::UnexpectedReply {
                                op: "inspect",
                                reply: "the reading thread panicked".into(),
                            })
                        }),
                    })
                    .collect::<Vec<_>>(),
            )
        })?;
        Ok(RedlockInspection {
            nodes,
            quorum: g.quorum,
            read_at,
        })
    }
}

/// The holder of `key` on one node, on a connection of its own.
fn read_node(
    cfg: &ConnConfig,
    key: &str,
    node_timeout: Duration,
) -> Result<Option<ExclusiveHolder>> {
    let mut conn = cfg.connect(cfg.connect_timeout, "respire-redlock-inspect")?;
    let mut pipe = redis::pipe();
    pipe.cmd("GET").arg(key).cmd("PTTL").arg(key);
    let replies = conn.pipeline(&pipe, "inspect", cfg.clock.now() + node_timeout)?;
    for value in &replies {
        readable(value, key)?;
    }
    match replies.as_slice() {
        [value, pttl] => holder(value, pttl, key),
        other => Err(Error::UnexpectedReply {
            op: "inspect",
            reply: format!("{other:?}"),
        }),
    }
}
