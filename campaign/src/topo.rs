//! The servers of a run, started by the campaign itself from `tests/support`:
//! every process is killed when the campaign exits.

use std::time::Duration;

use crate::spec::{Connect, Topology};
use crate::support::{FaultProxy, TestCluster, TestSentinel, TestServer};

/// A running deployment and the proxies in front of its servers.
pub(crate) struct Deployment {
    pub(crate) topology: Topology,
    /// The standalone server or the Redlock nodes.
    pub(crate) servers: Vec<TestServer>,
    /// One proxy per entry of `servers`; workers connect through them.
    pub(crate) proxies: Vec<FaultProxy>,
    pub(crate) sentinel: Option<TestSentinel>,
    pub(crate) cluster: Option<TestCluster>,
}

impl Deployment {
    /// `replicas` and `sentinel_debug` (`SENTINEL DEBUG` parameters): of the
    /// Sentinel deployment, ignored by other topologies.
    pub(crate) fn start(
        topology: Topology,
        replicas: usize,
        sentinel_debug: &[(&str, u64)],
    ) -> Deployment {
        let mut servers = Vec::new();
        let mut sentinel = None;
        let mut cluster = None;
        match topology {
            Topology::Standalone { aof } => {
                let b = TestServer::builder();
                servers.push(if aof { b.append_only() } else { b }.start());
            }
            Topology::Redlock { nodes } => {
                for _ in 0..nodes {
                    servers.push(TestServer::start());
                }
            }
            Topology::Sentinel => {
                let mut builder = TestSentinel::builder()
                    .down_after(Duration::from_millis(1000))
                    .failover_timeout(Duration::from_millis(3000))
                    .replicas(replicas);
                for &(param, value) in sentinel_debug {
                    builder = builder.sentinel_debug(param, value);
                }
                sentinel = Some(builder.start());
            }
            Topology::Cluster => {
                cluster = Some(
                    TestCluster::builder()
                        .node_timeout(Duration::from_millis(2000))
                        .replicas(1)
                        .start(),
                );
            }
        }
        let proxies = servers
            .iter()
            .map(|s| FaultProxy::start(s.addr()))
            .collect();
        Deployment {
            topology,
            servers,
            proxies,
            sentinel,
            cluster,
        }
    }

    /// How the workers reach it.
    pub(crate) fn connect(&self) -> Connect {
        match self.topology {
            Topology::Standalone { .. } => Connect::Standalone(self.proxies[0].url()),
            Topology::Redlock { .. } => {
                Connect::Redlock(self.proxies.iter().map(FaultProxy::url).collect())
            }
            Topology::Sentinel => {
                let s = self.sentinel.as_ref().expect("sentinel");
                Connect::Sentinel {
                    sentinels: s.sentinel_urls(),
                    service: s.service().to_string(),
                }
            }
            Topology::Cluster => {
                Connect::Cluster(self.cluster.as_ref().expect("cluster").seed_urls())
            }
        }
    }

    /// Every data server (not the sentinels): the targets of `CLIENT KILL`
    /// storms and `maxmemory`.
    pub(crate) fn data_servers(&self) -> Vec<&TestServer> {
        if let Some(s) = &self.sentinel {
            s.servers().iter().collect()
        } else if let Some(c) = &self.cluster {
            c.nodes().iter().collect()
        } else {
            self.servers.iter().collect()
        }
    }
}
