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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn independence_is_checked() {
        let info = |run: &str, repl: &str| ServerInfo {
            run_id: Some(run.into()),
            uptime: None,
            replid: Some(repl.into()),
            cluster: false,
        };
        let ok = vec![
            ("a".to_owned(), info("1", "x")),
            ("b".to_owned(), info("2", "y")),
            ("c".to_owned(), info("3", "z")),
        ];
        assert!(check_independent(&ok).is_ok());
        let mut same = ok.clone();
        same[2].1.run_id = Some("1".into());
        let e = check_independent(&same).unwrap_err().to_string();
        assert!(e.contains("a and c are the same server"), "{e}");
        let mut replica = ok.clone();
        replica[1].1.replid = Some("z".into());
        let e = check_independent(&replica).unwrap_err().to_string();
        assert!(e.contains("share replication id"), "{e}");
        let mut cluster = ok;
        cluster[0].1.cluster = true;
        let e = check_independent(&cluster).unwrap_err().to_string();
        assert!(e.contains("Cluster"), "{e}");
    }
}
