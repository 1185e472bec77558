//! What makes a sound Redlock group, checked before anything is sent to it:
//! an odd number of at least 3 nodes, a drift factor and node timeout that
//! can bound a lease, a node timeout of at least [`ROUND_TRIPS_PER_TIMEOUT`]
//! round trips of the slowest node and well below every TTL, and nodes that
//! do not fail together, as their `INFO` tells.

use std::time::Duration;

use super::node::ROUND_TRIPS_PER_TIMEOUT;
use crate::core::timing::Timing;
use crate::error::{Error, Result};
use crate::keys;

/// Refuses a node count or timing that cannot make a sound group.
pub(crate) fn check_group(nodes: usize, timing: &Timing) -> Result<()> {
    if nodes < 3 {
        return Err(Error::InvalidArgument(format!(
            "a redlock group needs at least 3 nodes, got {nodes}: with fewer, one failure \
             stops it or one node decides alone"
        )));
    }
    if nodes.is_multiple_of(2) {
        return Err(Error::InvalidArgument(format!(
            "a redlock group needs an odd number of nodes, got {nodes}: its quorum of {} \
             tolerates no more failures than {} nodes do",
            nodes / 2 + 1,
            nodes - 1
        )));
    }
    let f = timing.drift_factor;
    if f.is_nan() || !(0.0..1.0).contains(&f) {
        return Err(Error::InvalidArgument(format!(
            "drift factor {f} must be at least 0 and below 1"
        )));
    }
    if timing.node_timeout.is_zero() {
        return Err(Error::InvalidArgument("node timeout is zero".into()));
    }
    Ok(())
}

/// Refuses a TTL the node timeout is not well below: a worst-case attempt
/// (one that waits out the node timeout) must keep at least half the lease.
pub(crate) fn check_ttl(ttl: Duration, timing: &Timing) -> Result<u64> {
    let ms = keys::ttl_ms(ttl)?;
    let ttl = Duration::from_millis(ms);
    let drift = timing.drift(ttl);
    if timing.node_timeout + drift >= ttl / 2 {
        return Err(Error::InvalidArgument(format!(
            "node timeout {:?} is not well below ttl {ttl:?}: node timeout plus drift \
             ({drift:?}) must be under half the ttl, so that an attempt that waits out a \
             slow node keeps most of its validity",
            timing.node_timeout
        )));
    }
    Ok(ms)
}

/// Refuses a node timeout below [`ROUND_TRIPS_PER_TIMEOUT`] round trips of
/// the slowest node.
pub(crate) fn check_round_trips<'a>(
    round_trips: impl Iterator<Item = (&'a str, Duration)>,
    node_timeout: Duration,
) -> Result<()> {
    let Some((node, round_trip)) = round_trips.max_by_key(|(_, rtt)| *rtt) else {
        return Ok(());
    };
    let needed = round_trip * ROUND_TRIPS_PER_TIMEOUT;
    if node_timeout < needed {
        // Whole milliseconds, rounded up, for a setting that can be copied.
        let needed = Duration::from_millis(needed.as_nanos().div_ceil(1_000_000) as u64);
        return Err(Error::NodeTimeoutTooShort {
            node: node.to_owned(),
            round_trip,
            node_timeout,
            needed,
        });
    }
    Ok(())
}

/// What `INFO` says about a server.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ServerInfo {
    pub(crate) run_id: Option<String>,
    pub(crate) uptime: Option<Duration>,
    pub(crate) replid: Option<String>,
    pub(crate) cluster: bool,
}

/// Reads the fields the group needs from an `INFO` reply.
pub(crate) fn parse_info(info: &str) -> ServerInfo {
    let mut out = ServerInfo::default();
    for line in info.lines() {
        let Some((name, value)) = line.trim().split_once(':') else {
            continue;
        };
        match name {
            "run_id" => out.run_id = Some(value.to_owned()),
            "uptime_in_seconds" => out.uptime = value.parse().ok().map(Duration::from_secs),
            "master_replid" => out.replid = Some(value.to_owned()),
            "cluster_enabled" => out.cluster = value == "1",
            _ => {}
        }
    }
    out
}

/// Refuses nodes that would fail together: one server twice, one replication
/// history twice, or a cluster node.
pub(crate) fn check_independent(infos: &[(String, ServerInfo)]) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_info_fields() {
        let info = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\n\
                    uptime_in_seconds:42\r\n# Replication\r\nrole:master\r\n\
                    master_replid:def456\r\n# Cluster\r\ncluster_enabled:1\r\n";
        let parsed = parse_info(info);
        assert_eq!(parsed.run_id.as_deref(), Some("abc123"));
        assert_eq!(parsed.uptime, Some(Duration::from_secs(42)));
        assert_eq!(parsed.replid.as_deref(), Some("def456"));
        assert!(parsed.cluster);
        assert!(!parse_info("cluster_enabled:0\r\n").cluster);
    }
}
