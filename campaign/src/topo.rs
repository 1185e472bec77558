//! The servers of a run, started by the campaign itself from `tests/support`:
//! every process is killed when the campaign exits.
//!
//! On Sentinel and Cluster every data server also gets three ACL users, so
//! that one link can be cut at a time by switching its user off on one
//! server and closing its connections: the workers reach the data servers
//! as `app`, the sentinels as `sentinel`, the replicas their primary as
//! `replicator`. The default user stays on for the campaign's own
//! connections (the server oracle, the nemesis). The workers reach the
//! sentinels through a proxy each, which cuts the clients' links to the
//! sentinels.
//!
//! A cluster started for the `cut-bus` fault runs its bus through proxies
//! (`TestClusterBuilder::bus_proxies`): every node announces a proxy in
//! front of its bus port, so every bus link *to* node `i` runs through bus
//! proxy `i`, and node `i` sends its own bus traffic from an address of its
//! own, 127.0.0.`2+i` (`bind-source-addr`), so that the other proxies can
//! drop what it sends. Clients reach the nodes directly.

use std::net::{IpAddr, Ipv4Addr};
use std::thread;
use std::time::{Duration, Instant};

use crate::spec::{Connect, Topology};
use crate::support::{
    FaultProxy, ServerKind, TestCluster, TestSentinel, TestServer, TestServerBuilder,
};

/// Debian's libfaketime, which steps a server's wall clock (Valkey only:
/// Debian's `redis-server` cannot start under it).
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// A running deployment and the proxies in front of its servers.
pub(crate) struct Deployment {
    pub(crate) topology: Topology,
    /// The standalone server or the Redlock nodes.
    pub(crate) servers: Vec<TestServer>,
    /// One proxy per entry of `servers`; workers connect through them.
    pub(crate) proxies: Vec<FaultProxy>,
    pub(crate) sentinel: Option<TestSentinel>,
    pub(crate) cluster: Option<TestCluster>,
    /// Sentinel: one proxy per sentinel; workers reach the sentinels
    /// through them.
    pub(crate) sentinel_proxies: Vec<FaultProxy>,
    /// With `--server-clock faketime`: each of `servers`' libfaketime offset
    /// file (`+S`, seconds ahead of the machine's clock).
    pub(crate) clock_files: Vec<std::path::PathBuf>,
}

/// The workers' user on Sentinel and Cluster data servers.
pub(crate) const APP_USER: (&str, &str) = ("app", "app-pw");
/// The campaign's own user (the server oracle's and the nemesis'), which no
/// fault switches off.
pub(crate) const ORACLE_USER: (&str, &str) = ("oracle", "oracle-pw");
const USERS: [&str; 4] = [
    "oracle on >oracle-pw ~* &* +@all",
    "app on >app-pw ~* &* +@all",
    "sentinel on >sentinel-pw ~* &* +@all",
    "replicator on >replicator-pw +psync +replconf +ping",
];

/// A short-lived connection as the campaign's own user, or the default
/// user where it does not exist (a server without the users, one just
/// restarted).
pub(crate) fn admin(server: &TestServer) -> redis::RedisResult<redis::Connection> {
    let open = |url: String| -> redis::RedisResult<redis::Connection> {
        let client = redis::Client::open(url)?;
        let con = client.get_connection_with_timeout(Duration::from_millis(500))?;
        con.set_read_timeout(Some(Duration::from_millis(1000)))?;
        con.set_write_timeout(Some(Duration::from_millis(1000)))?;
        Ok(con)
    };
    open(server.url_for_user(ORACLE_USER.0, ORACLE_USER.1)).or_else(|_| open(server.url()))
}

/// Creates the three users on `server` and makes it reach any primary as
/// `replicator` (a restarted server has lost both: call it again).
pub(crate) fn add_users(server: &TestServer) {
    let Ok(mut con) = admin(server) else { return };
    for user in USERS {
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER");
        for word in user.split(' ') {
            cmd.arg(word);
        }
        let _: redis::RedisResult<()> = cmd.query(&mut con);
    }
    for (name, value) in [
        ("masteruser", "replicator"),
        ("masterauth", "replicator-pw"),
    ] {
        let _: redis::RedisResult<()> = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut con);
    }
}

/// Switches `user` on or off on `server`; off also closes its connections
/// there. The sentinels fall back to the default user when their own is
/// refused, so cutting them off takes both (`default` too, which the
/// campaign's own connections do not use).
pub(crate) fn set_user(server: &TestServer, user: &str, on: bool) -> bool {
    let Ok(mut con) = admin(server) else {
        return false;
    };
    let set: redis::RedisResult<()> = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(user)
        .arg(if on { "on" } else { "off" })
        .query(&mut con);
    if !on {
        let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("USER")
            .arg(user)
            .query(&mut con);
        if user == "replicator" {
            // A link made before the users were: by type.
            let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("replica")
                .query(&mut con);
        }
    }
    set.is_ok()
}

/// `ACL SETUSER` with `rules` on `server`; whether it answered OK.
pub(crate) fn acl(server: &TestServer, rules: &[&str]) -> bool {
    let Ok(mut con) = admin(server) else {
        return false;
    };
    let set: redis::RedisResult<()> = redis::cmd("ACL").arg("SETUSER").arg(rules).query(&mut con);
    set.is_ok()
}

/// Closes every connection of `kind` (`normal`, `pubsub`, `replica`) on
/// `server` but the caller's.
fn kill_type(server: &TestServer, kind: &str) {
    if let Ok(mut con) = admin(server) {
        let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg(kind)
            .arg("SKIPME")
            .arg("yes")
            .query(&mut con);
    }
}

/// The nodes of the campaign's cluster: three primaries with a replica each.
const CLUSTER_NODES: usize = 6;

/// Waits up to 10 s until every node's bus links to the others come from
/// its own address, through the others' proxies: a cut of its address
/// reaches them all.
///
/// # Panics
///
/// Panics if they do not within 10 s.
fn wait_bus_links(c: &TestCluster) {
    let linked = || {
        (0..c.nodes().len()).all(|i| {
            c.bus_proxies()
                .iter()
                .enumerate()
                .all(|(j, p)| i == j || p.connections_from(bus_source(i)) >= 1)
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !linked() {
        assert!(
            Instant::now() < deadline,
            "the cluster's bus links do not come from the nodes' own addresses"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// Whether every replica among `servers` has its link to its primary up.
fn links_up(servers: &[&TestServer]) -> bool {
    servers.iter().all(|s| {
        let Ok(mut con) = admin(s) else { return false };
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut con)
            .unwrap_or_default();
        info.contains("role:master") || info.contains("master_link_status:up")
    })
}

/// Waits up to `within` for every replica link to be up again.
pub(crate) fn wait_links(servers: &[&TestServer], within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if links_up(servers) {
            return true;
        }
        thread::sleep(Duration::from_millis(50));
    }
    false
}

/// The users on every data server, then every link made again with them:
/// the replicas' (as `replicator`) and the sentinels' (as `sentinel`).
fn users_everywhere(dep: &Deployment) {
    let servers = dep.data_servers();
    for s in &servers {
        add_users(s);
    }
    if let Some(sent) = &dep.sentinel {
        for s in sent.sentinels() {
            if let Ok(mut con) = admin(s) {
                for (option, value) in [("auth-user", "sentinel"), ("auth-pass", "sentinel-pw")] {
                    let _: redis::RedisResult<()> = redis::cmd("SENTINEL")
                        .arg("SET")
                        .arg(sent.service())
                        .arg(option)
                        .arg(value)
                        .query(&mut con);
                }
            }
        }
    }
    for s in &servers {
        kill_type(s, "replica");
        if dep.sentinel.is_some() {
            kill_type(s, "normal");
            kill_type(s, "pubsub");
        }
    }
    assert!(
        wait_links(&servers, Duration::from_secs(20)),
        "the replicas did not come back as replicator"
    );
}

/// The address cluster node `index` sends its bus traffic from when the
/// bus runs through proxies.
pub(crate) fn bus_source(index: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2 + index as u8))
}

impl Deployment {
    /// Writes every server's log (across its restarts) into `dir`: the
    /// standalone or Redlock servers as `server-N.log`, Sentinel's data
    /// servers and sentinels as `data-N.log` and `sentinel-N.log`, the
    /// cluster's nodes as `node-N.log` — so that a row's archive also tells
    /// what the servers did.
    pub(crate) fn keep_logs(&self, dir: &std::path::Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut groups: Vec<(&str, &[TestServer])> = vec![("server", &self.servers)];
        if let Some(s) = &self.sentinel {
            groups.push(("data", s.servers()));
            groups.push(("sentinel", s.sentinels()));
        }
        if let Some(c) = &self.cluster {
            groups.push(("node", c.nodes()));
        }
        for (name, servers) in groups {
            for (i, server) in servers.iter().enumerate() {
                std::fs::write(dir.join(format!("{name}-{i}.log")), server.log())?;
            }
        }
        Ok(())
    }

    /// `replicas` and `sentinel_debug` (`SENTINEL DEBUG` parameters): of the
    /// Sentinel deployment, ignored by other topologies. `bus_proxies`: a
    /// cluster's bus through proxies (the `cut-bus` fault), ignored by
    /// other topologies.
    /// `clocks`: a directory for libfaketime offset files, one per
    /// standalone or Redlock server, which then run Valkey under
    /// libfaketime, and the rate their clocks run at from their start
    /// (1.0: real time; written after the offset, as libfaketime reads it).
    pub(crate) fn start(
        topology: Topology,
        replicas: usize,
        sentinel_debug: &[(&str, u64)],
        clocks: Option<(&std::path::Path, f64)>,
        bus_proxies: bool,
    ) -> Deployment {
        let mut servers = Vec::new();
        let mut sentinel = None;
        let mut cluster = None;
        let mut clock_files = Vec::new();
        let mut builder = || -> TestServerBuilder {
            let b = TestServer::builder();
            let Some((dir, rate)) = clocks else { return b };
            assert!(
                std::path::Path::new(LIBFAKETIME).exists(),
                "{LIBFAKETIME} is missing: install Debian's faketime"
            );
            let rc = dir.join(format!("faketime-{}", clock_files.len()));
            let rate = if rate == 1.0 {
                String::new()
            } else {
                format!(" x{rate}")
            };
            std::fs::write(&rc, format!("+0{rate}")).expect("write a faketime offset file");
            let b = b
                .kind(ServerKind::Valkey)
                .env("LD_PRELOAD", LIBFAKETIME)
                .env("FAKETIME_TIMESTAMP_FILE", rc.display().to_string())
                .env("FAKETIME_NO_CACHE", "1")
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
            clock_files.push(rc);
            b
        };
        match topology {
            Topology::Standalone { aof } => {
                let b = builder();
                servers.push(if aof { b.append_only() } else { b }.start());
            }
            Topology::Redlock { nodes } => {
                for _ in 0..nodes {
                    servers.push(builder().start());
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
                let mut builder = TestCluster::builder()
                    .node_timeout(Duration::from_millis(2000))
                    .replicas(1);
                if bus_proxies {
                    // Links from 127.0.0.2 and up are not "local" to
                    // protected mode, which would refuse the replicas'.
                    builder = builder.bus_proxies().args(["--protected-mode", "no"]);
                    for i in 0..CLUSTER_NODES {
                        builder = builder.node_args(
                            i,
                            ["--bind-source-addr".to_string(), bus_source(i).to_string()],
                        );
                    }
                }
                let c = builder.start();
                if bus_proxies {
                    wait_bus_links(&c);
                }
                cluster = Some(c);
            }
        }
        let proxies = servers
            .iter()
            .map(|s| FaultProxy::start(s.addr()))
            .collect();
        let sentinel_proxies = sentinel
            .as_ref()
            .map(|s| {
                s.sentinels()
                    .iter()
                    .map(|s| FaultProxy::start(s.addr()))
                    .collect()
            })
            .unwrap_or_default();
        let dep = Deployment {
            topology,
            servers,
            proxies,
            sentinel,
            cluster,
            sentinel_proxies,
            clock_files,
        };
        if dep.sentinel.is_some() || dep.cluster.is_some() {
            users_everywhere(&dep);
        }
        dep
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
                    sentinels: self.sentinel_proxies.iter().map(FaultProxy::url).collect(),
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
