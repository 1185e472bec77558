//! Refusing Redlock nodes that would fail together.

use super::worker::ServerInfo;
use crate::error::{Error, Result};

/// Refuses nodes that would fail together: one server twice, one replication
/// history twice, or a cluster node.
pub(super) fn check_independent(infos: &[(String, ServerInfo)]) -> Result<()> {
    for (addr, info) in infos {
        if info.cluster {
            return Err(Error::NotIndependent(format!(
                "{addr} runs in Redis Cluster mode; use standalone servers that fail \
                 independently (cluster nodes share failover and slot ownership)"
            )));
        }
    }
    for (i, (a, ia)) in infos.iter().enumerate() {
        for (b, ib) in &infos[i + 1..] {
            if ia.run_id.is_some() && ia.run_id == ib.run_id {
                return Err(Error::NotIndependent(format!(
                    "{a} and {b} are the same server (run id {})",
                    ia.run_id.as_deref().unwrap_or_default()
                )));
            }
            if ia.replid.is_some() && ia.replid == ib.replid {
                return Err(Error::NotIndependent(format!(
                    "{a} and {b} share replication id {}: one replicates the other, or both \
                     replicate one primary",
                    ia.replid.as_deref().unwrap_or_default()
                )));
            }
        }
    }
    Ok(())
}
