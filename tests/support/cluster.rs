//! A Redis Cluster of real `redis-server` nodes on loopback: three primaries
//! with one replica each, formed by `redis-cli --cluster create`, with the
//! operations tests need to move slots and fail nodes over the way operators
//! do.
//!
//! Nodes are named by their index in [`TestCluster::nodes`]; which of them
//! are primaries changes with failovers, so every question about roles and
//! slots is asked of the live nodes at the time of the call.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::{self, File};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use respire_coordination::key_slot;

use super::{FaultProxy, ServerKind, TestServer, TestServerBuilder};

/// The number of hash slots.
pub(crate) const SLOTS: u16 = 16384;
/// Primaries in a [`TestCluster`]; each has one replica unless the builder
/// says otherwise.
const PRIMARIES: usize = 3;
/// Default `cluster-node-timeout`: a stopped primary is failed over in about
/// three seconds.
const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long `redis-cli --cluster create` may run.
const CREATE_DEADLINE: Duration = Duration::from_secs(30);
/// How long the nodes may take to agree after a start or a change.
const AGREE_DEADLINE: Duration = Duration::from_secs(30);
/// Connect, read and write timeout of the connections that watch the nodes.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Pause between two looks at the nodes while waiting for them to agree.
const PROBE_INTERVAL: Duration = Duration::from_millis(10);
/// Keys moved by one `MIGRATE`.
const MIGRATE_BATCH: usize = 100;
/// The `MIGRATE` timeout, in milliseconds.
const MIGRATE_TIMEOUT_MS: u64 = 5_000;
const CREATE_LOG_FILE: &str = "cluster-create.log";

/// Options for a [`TestCluster`]; start with [`TestCluster::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `start` is called"]
pub(crate) struct TestClusterBuilder {
    node_timeout: Duration,
    extra_args: Vec<String>,
    replicas: usize,
    /// Extra arguments of one node: (node index, arguments).
    node_args: Vec<(usize, Vec<String>)>,
    bus_proxies: bool,
}

impl TestClusterBuilder {
    /// Sets `cluster-node-timeout` on every node: how long a node may be
    /// unreachable before its replica takes over. Defaults to 2 seconds.
    pub(crate) fn node_timeout(mut self, node_timeout: Duration) -> Self {
        self.node_timeout = node_timeout;
        self
    }

    /// Sets how many replicas each of the three primaries has. Defaults to 1;
    /// 0 gives a cluster of primaries only (a benchmark's fair match for one
    /// standalone server), where failover and takeover are impossible.
    pub(crate) fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// Appends raw `redis-server` arguments (such as `["--hz", "100"]`) to
    /// every node's command line. Defaults to none.
    pub(crate) fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extra_args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Appends raw `redis-server` arguments to node `index`'s command line
    /// only (such as `["--bind-source-addr", "127.0.0.2"]`), after those of
    /// [`TestClusterBuilder::args`]. Node 0 becomes the primary of the
    /// lowest slots. Defaults to none.
    pub(crate) fn node_args<I, S>(mut self, index: usize, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.node_args
            .push((index, args.into_iter().map(Into::into).collect()));
        self
    }

    /// Puts a [`FaultProxy`] in front of every node's cluster bus port, and
    /// has each node announce the proxy's port as its bus port (and
    /// 127.0.0.1 as its address) before the cluster is formed: every bus
    /// link *to* node `i` then runs through [`TestCluster::bus_proxy`]`(i)`,
    /// so blackholing that proxy cuts what the others send node `i`; what
    /// node `i` sends the others runs through their proxies, where
    /// [`FaultProxy::blackhole_from`] its `bind-source-addr` (see
    /// [`TestClusterBuilder::node_args`]) cuts it. Clients reach the nodes
    /// directly. Defaults to off.
    pub(crate) fn bus_proxies(mut self) -> Self {
        self.bus_proxies = true;
        self
    }

    /// Starts the nodes (six by default), forms the cluster and waits until every node has
    /// `cluster_state:ok`, all agree on the slot map and roles, and every
    /// replica is in sync with its primary.
    ///
    /// # Panics
    ///
    /// Panics, with the logs, if a node does not start, `redis-cli` fails,
    /// or the nodes do not agree within 30 seconds.
    pub(crate) fn start(self) -> TestCluster {
        let started = Instant::now();
        let nodes: Vec<TestServer> = thread::scope(|scope| {
            let starting: Vec<_> = (0..PRIMARIES * (1 + self.replicas))
                .map(|index| {
                    let own = self
                        .node_args
                        .iter()
                        .filter(|(i, _)| *i == index)
                        .flat_map(|(_, args)| args.iter().cloned());
                    let builder = TestServerBuilder::default()
                        .cluster_node(self.node_timeout)
                        // A new replica syncs at once instead of waiting for others.
                        .args(["--repl-diskless-sync-delay", "0"])
                        .args(self.extra_args.iter().cloned())
                        .args(own);
                    scope.spawn(move || builder.start())
                })
                .collect();
            starting
                .into_iter()
                .map(|node| node.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        let bus_proxies = if self.bus_proxies {
            nodes.iter().map(announce_bus_proxy).collect()
        } else {
            Vec::new()
        };
        create(&nodes, self.replicas);
        let ids = nodes
            .iter()
            .map(|node| {
                redis::cmd("CLUSTER")
                    .arg("MYID")
                    .query::<String>(&mut node.client())
                    .expect("CLUSTER MYID")
            })
            .collect();
        let mut cluster = TestCluster {
            nodes,
            bus_proxies,
            ids,
            node_timeout: self.node_timeout,
            startup: Duration::ZERO,
        };
        cluster.wait_healthy();
        cluster.startup = started.elapsed();
        cluster
    }
}

/// Starts a proxy in front of `node`'s cluster bus port and has the node
/// announce it (see [`TestClusterBuilder::bus_proxies`]).
fn announce_bus_proxy(node: &TestServer) -> FaultProxy {
    let bus = node.cluster_bus_port().expect("a cluster node");
    let proxy = FaultProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], bus)));
    let mut con = node.client();
    for (name, value) in [
        ("cluster-announce-ip", "127.0.0.1".to_owned()),
        ("cluster-announce-bus-port", proxy.port().to_string()),
    ] {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(&value)
            .query(&mut con)
            .unwrap_or_else(|e| panic!("CONFIG SET {name} {value} on port {}: {e}", node.port()));
    }
    proxy
}

/// Runs `redis-cli --cluster create` (`valkey-cli` for Valkey) over `nodes`:
/// the first three become primaries, the others their replicas (`replicas`
/// each).
fn create(nodes: &[TestServer], replicas: usize) {
    let log_path = nodes[0].dir().join(CREATE_LOG_FILE);
    let log = File::create(&log_path).expect("create the cluster-create log");
    let program = ServerKind::current().cli_program();
    let mut command = Command::new(program);
    command.arg("--cluster").arg("create");
    for node in nodes {
        command.arg(node.addr().to_string());
    }
    let mut child = command
        .arg("--cluster-replicas")
        .arg(replicas.to_string())
        .arg("--cluster-yes")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("clone the log handle"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for redis-cli") {
            break status;
        }
        if started.elapsed() > CREATE_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "redis-cli --cluster create did not finish within {CREATE_DEADLINE:?}:\n{}",
                fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        thread::sleep(PROBE_INTERVAL);
    };
    assert!(
        status.success(),
        "redis-cli --cluster create failed ({status}):\n{}",
        fs::read_to_string(&log_path).unwrap_or_default()
    );
}

/// `redis-server --cluster-enabled yes` nodes on free loopback ports: by
/// default six, three primaries and three replicas, covering all 16384 slots.
///
/// Each node is a [`TestServer`]: dropping the cluster kills every node, and
/// the servers' supervisors kill them when the test process exits even
/// without a drop (as with [`super::shared_cluster`]). Pause, resume, kill
/// or restart a node through [`TestCluster::node`]; [`TestCluster::restart_node`]
/// also waits until it has rejoined.
pub(crate) struct TestCluster {
    nodes: Vec<TestServer>,
    /// One per node with [`TestClusterBuilder::bus_proxies`], else none.
    bus_proxies: Vec<FaultProxy>,
    ids: Vec<String>,
    node_timeout: Duration,
    startup: Duration,
}

impl TestCluster {
    /// Starts a cluster with default options; see [`TestCluster::builder`].
    ///
    /// # Panics
    ///
    /// Panics, with the logs, if the cluster does not form.
    pub(crate) fn start() -> TestCluster {
        TestCluster::builder().start()
    }

    /// Options for a cluster with another node timeout or extra configuration.
    pub(crate) fn builder() -> TestClusterBuilder {
        TestClusterBuilder {
            node_timeout: DEFAULT_NODE_TIMEOUT,
            extra_args: Vec::new(),
            replicas: 1,
            node_args: Vec::new(),
            bus_proxies: false,
        }
    }

    /// How long [`TestClusterBuilder::start`] took, from the first process
    /// to the last agreeing node.
    pub(crate) fn startup_time(&self) -> Duration {
        self.startup
    }

    /// The `cluster-node-timeout` of every node.
    pub(crate) fn node_timeout(&self) -> Duration {
        self.node_timeout
    }

    /// Every node, primaries and replicas alike, in a fixed order.
    pub(crate) fn nodes(&self) -> &[TestServer] {
        &self.nodes
    }

    /// Node `index`.
    ///
    /// # Panics
    ///
    /// Panics if there is no such node.
    pub(crate) fn node(&self, index: usize) -> &TestServer {
        &self.nodes[index]
    }

    /// The proxy every bus link to node `index` runs through.
    ///
    /// # Panics
    ///
    /// Panics unless the cluster was started with
    /// [`TestClusterBuilder::bus_proxies`].
    pub(crate) fn bus_proxy(&self, index: usize) -> &FaultProxy {
        assert!(
            !self.bus_proxies.is_empty(),
            "the cluster was started without bus proxies"
        );
        &self.bus_proxies[index]
    }

    /// Every node's bus proxy, in node order (none without
    /// [`TestClusterBuilder::bus_proxies`]).
    pub(crate) fn bus_proxies(&self) -> &[FaultProxy] {
        &self.bus_proxies
    }

    /// The cluster node id (`CLUSTER MYID`) of node `index`.
    pub(crate) fn node_id(&self, index: usize) -> &str {
        &self.ids[index]
    }

    /// The index of the node with this cluster node id.
    pub(crate) fn index_of_id(&self, id: &str) -> Option<usize> {
        self.ids.iter().position(|known| known == id)
    }

    /// The index of the node listening on this port of 127.0.0.1.
    pub(crate) fn index_of_port(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|node| node.port() == port)
    }

    /// `redis://127.0.0.1:PORT` of every node: seeds for a cluster client.
    pub(crate) fn seed_urls(&self) -> Vec<String> {
        self.nodes.iter().map(TestServer::url).collect()
    }

    /// The pid of every node's current (or last) process.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.nodes.iter().map(TestServer::pid).collect()
    }

    /// Whether node `index` runs and is not paused, so it can answer.
    pub(crate) fn is_live(&self, index: usize) -> bool {
        let node = &self.nodes[index];
        node.is_running() && !node.is_paused()
    }

    /// Node `index`'s own view of the cluster (`CLUSTER NODES`).
    ///
    /// # Panics
    ///
    /// Panics if the node does not answer.
    pub(crate) fn view(&self, index: usize) -> ClusterView {
        let text: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query(&mut self.nodes[index].client())
            .unwrap_or_else(|e| panic!("CLUSTER NODES on node {index}: {e}"));
        ClusterView::parse(&text)
    }

    /// The view every live node holds, once they all hold the same slot map
    /// and roles.
    ///
    /// # Panics
    ///
    /// Panics if the live nodes do not agree within 30 seconds.
    pub(crate) fn agreed_view(&self) -> ClusterView {
        let mut probe = Probe::new(self);
        let mut agreed = None;
        self.wait(
            AGREE_DEADLINE,
            "the live nodes to agree on the slot map",
            |_| {
                agreed = probe.agreed_view();
                agreed.is_some()
            },
        );
        agreed.expect("an agreed view")
    }

    /// The current primaries, in index order.
    pub(crate) fn primaries(&self) -> Vec<usize> {
        let view = self.agreed_view();
        (0..self.nodes.len())
            .filter(|&i| {
                view.node(&self.ids[i])
                    .is_some_and(|entry| entry.is_primary() && !entry.slots.is_empty())
            })
            .collect()
    }

    /// The current replicas, in index order.
    pub(crate) fn replicas(&self) -> Vec<usize> {
        let view = self.agreed_view();
        (0..self.nodes.len())
            .filter(|&i| {
                view.node(&self.ids[i])
                    .is_some_and(|entry| !entry.is_primary())
            })
            .collect()
    }

    /// The primary that owns `slot`, as all live nodes agree.
    ///
    /// # Panics
    ///
    /// Panics if `slot` is out of range or nobody owns it.
    pub(crate) fn primary_for_slot(&self, slot: u16) -> usize {
        assert!(slot < SLOTS, "slot {slot} is out of range");
        let view = self.agreed_view();
        let owner = view
            .owner_of(slot)
            .unwrap_or_else(|| panic!("no node owns slot {slot}"));
        self.index_of(&owner.id)
    }

    /// The primary that owns `key`'s slot (CRC16 of its hash tag, if any).
    pub(crate) fn primary_for_key(&self, key: impl AsRef<[u8]>) -> usize {
        self.primary_for_slot(key_slot(key.as_ref()))
    }

    /// A replica of primary `primary`.
    ///
    /// # Panics
    ///
    /// Panics if `primary` has no replica.
    pub(crate) fn replica_of(&self, primary: usize) -> usize {
        let view = self.agreed_view();
        let id = &self.ids[primary];
        let replica = view
            .nodes
            .iter()
            .find(|entry| entry.primary_id.as_deref() == Some(id.as_str()))
            .unwrap_or_else(|| panic!("node {primary} has no replica"));
        self.index_of(&replica.id)
    }

    /// A new connection (10 second timeouts) to the primary that owns `key`.
    pub(crate) fn client_for_key(&self, key: impl AsRef<[u8]>) -> redis::Connection {
        self.nodes[self.primary_for_key(key)].client()
    }

    /// Waits until every node is live, says `cluster_state:ok`, knows all the
    /// nodes with none failing, agrees with the others on slots and roles,
    /// three primaries cover all slots, and every replica's link is up.
    ///
    /// # Panics
    ///
    /// Panics if that is not so within 30 seconds.
    pub(crate) fn wait_healthy(&self) {
        let mut probe = Probe::new(self);
        self.wait(AGREE_DEADLINE, "a healthy cluster", |cluster| {
            if !(0..cluster.nodes.len()).all(|i| cluster.is_live(i)) {
                return false;
            }
            let Some(view) = probe.agreed_view() else {
                return false;
            };
            let primaries = view
                .nodes
                .iter()
                .filter(|entry| entry.is_primary() && !entry.slots.is_empty())
                .count();
            view.nodes.len() == cluster.nodes.len()
                && view.covers_all_slots()
                && primaries == PRIMARIES
                && view
                    .nodes
                    .iter()
                    .all(|entry| entry.connected && !entry.is_failing())
                && (0..cluster.nodes.len()).all(|i| probe.state_ok(i))
                && view
                    .nodes
                    .iter()
                    .filter(|entry| !entry.is_primary())
                    .all(|entry| probe.replica_link_up(cluster.index_of(&entry.id)))
        });
    }

    /// Waits until every live node sees node `index` as a primary that owns
    /// slots and `ROLE` on it says `master`, and returns how long that took.
    ///
    /// # Panics
    ///
    /// Panics if that is not so within `deadline`.
    pub(crate) fn wait_primary_seen_by_all(&self, index: usize, deadline: Duration) -> Duration {
        let started = Instant::now();
        let mut probe = Probe::new(self);
        let id = self.ids[index].clone();
        self.wait(
            deadline,
            &format!("node {index} to be seen as a primary by all"),
            |cluster| {
                probe.role(index).as_deref() == Some("master")
                    && (0..cluster.nodes.len())
                        .filter(|&i| cluster.is_live(i))
                        .all(|i| {
                            probe.view(i).is_some_and(|view| {
                                view.node(&id).is_some_and(|entry| {
                                    entry.is_primary()
                                        && !entry.slots.is_empty()
                                        && !entry.is_failing()
                                })
                            })
                        })
            },
        );
        started.elapsed()
    }

    /// Moves `slot` with its keys to primary `to` the way `redis-cli --cluster
    /// reshard` does: `SETSLOT IMPORTING` on `to`, `SETSLOT MIGRATING` on the
    /// owner, `MIGRATE` of the keys in batches, then `SETSLOT NODE` on `to`,
    /// the old owner and the other primaries. Returns once every live node
    /// sees `to` as the owner.
    ///
    /// # Panics
    ///
    /// Panics if `to` is not a primary, already owns `slot`, or a step fails.
    pub(crate) fn migrate_slot(&self, slot: u16, to: usize) {
        self.begin_migration(slot, to).finish();
    }

    /// Starts moving `slot` to primary `to` and moves half of its keys (at
    /// least one), leaving the slot `MIGRATING` on its owner and `IMPORTING`
    /// on `to`: a command for a moved key gets `ASK`, one for several keys
    /// split between the two nodes gets `TRYAGAIN`. Finish with
    /// [`SlotMigration::finish`].
    ///
    /// # Panics
    ///
    /// Panics if the slot holds fewer than two keys, or as
    /// [`TestCluster::migrate_slot`] does.
    pub(crate) fn migrate_slot_half(&self, slot: u16, to: usize) -> SlotMigration<'_> {
        let migration = self.begin_migration(slot, to);
        let keys = migration.keys_on_source();
        assert!(
            keys >= 2,
            "slot {slot} holds {keys} keys; splitting it needs at least two"
        );
        migration.move_keys(keys / 2);
        migration
    }

    /// Marks `slot` `IMPORTING` on primary `to` and `MIGRATING` on its owner,
    /// moving no keys yet; see [`SlotMigration`].
    ///
    /// # Panics
    ///
    /// Panics if `to` is not a primary, already owns `slot`, or a node refuses.
    pub(crate) fn begin_migration(&self, slot: u16, to: usize) -> SlotMigration<'_> {
        let source = self.primary_for_slot(slot);
        assert_ne!(source, to, "node {to} already owns slot {slot}");
        assert!(self.primaries().contains(&to), "node {to} is not a primary");
        self.admin(to, |con| {
            setslot(slot, "IMPORTING", &self.ids[source]).query::<()>(con)
        });
        self.admin(source, |con| {
            setslot(slot, "MIGRATING", &self.ids[to]).query::<()>(con)
        });
        SlotMigration {
            cluster: self,
            slot,
            source,
            target: to,
        }
    }

    /// Gives `slot` to primary `to` without moving its keys, as an operator
    /// forcing ownership does: `CLUSTER SETSLOT slot NODE to` and `CLUSTER
    /// BUMPEPOCH` on `to` only. The old owner learns of it by gossip and
    /// deletes the keys it held in the slot (without sending tracking
    /// invalidations on 7.0). Returns once every live node sees `to` as the
    /// owner and the old owner holds no keys in the slot.
    ///
    /// # Panics
    ///
    /// Panics if `to` is not a primary or already owns `slot`, or if that
    /// state is not reached within 30 seconds.
    pub(crate) fn reassign_slot(&self, slot: u16, to: usize) {
        let source = self.primary_for_slot(slot);
        assert_ne!(source, to, "node {to} already owns slot {slot}");
        assert!(self.primaries().contains(&to), "node {to} is not a primary");
        self.admin(to, |con| {
            setslot(slot, "NODE", &self.ids[to]).query::<()>(con)?;
            redis::cmd("CLUSTER").arg("BUMPEPOCH").query::<String>(con)
        });
        let mut probe = Probe::new(self);
        self.wait(
            AGREE_DEADLINE,
            &format!("slot {slot} to pass to node {to} and its keys to leave node {source}"),
            |cluster| {
                probe.all_see_owner(slot, &cluster.ids[to])
                    && probe.query::<usize>(
                        source,
                        redis::cmd("CLUSTER").arg("COUNTKEYSINSLOT").arg(slot),
                    ) == Some(0)
            },
        );
    }

    /// Promotes replica `replica` with `CLUSTER FAILOVER TAKEOVER`: at once,
    /// without the primary's consent or the other primaries' votes. Returns
    /// how long it took until every live node saw it as a primary.
    ///
    /// # Panics
    ///
    /// Panics if `replica` is not a replica, or the takeover is not seen by
    /// every live node within 30 seconds.
    pub(crate) fn force_takeover(&self, replica: usize) -> Duration {
        self.replica_failover(replica, Some("TAKEOVER"))
    }

    /// Forces the replica of `slot`'s owner to take over (see
    /// [`TestCluster::force_takeover`]) and returns that replica's index.
    pub(crate) fn force_takeover_slot(&self, slot: u16) -> usize {
        let replica = self.replica_of(self.primary_for_slot(slot));
        self.force_takeover(replica);
        replica
    }

    /// Runs a manual `CLUSTER FAILOVER` on replica `replica`: the primary stops
    /// clients, the replica catches up and takes over. Returns how long it
    /// took until the roles had swapped (`ROLE` on both) and every live node
    /// saw the replica as the primary.
    ///
    /// # Panics
    ///
    /// Panics if `replica` is not a replica, its primary is not live, or
    /// the roles have not swapped within 30 seconds.
    pub(crate) fn failover(&self, replica: usize) -> Duration {
        self.replica_failover(replica, None)
    }

    fn replica_failover(&self, replica: usize, option: Option<&str>) -> Duration {
        let view = self.agreed_view();
        let entry = view
            .node(&self.ids[replica])
            .unwrap_or_else(|| panic!("node {replica} is unknown to the cluster"));
        let old_primary = match (&entry.primary_id, entry.is_primary()) {
            (Some(primary), false) => self.index_of(primary),
            _ => panic!("node {replica} is not a replica"),
        };
        let started = Instant::now();
        self.admin(replica, |con| {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("FAILOVER");
            if let Some(option) = option {
                cmd.arg(option);
            }
            cmd.query::<()>(con)
        });
        self.wait_primary_seen_by_all(replica, AGREE_DEADLINE);
        if self.is_live(old_primary) {
            let mut probe = Probe::new(self);
            self.wait(
                AGREE_DEADLINE,
                &format!("node {old_primary} to become a replica"),
                |_| probe.role(old_primary).as_deref() == Some("slave"),
            );
        }
        started.elapsed()
    }

    /// Restarts node `index` (see [`TestServer::restart`]) and waits until it
    /// says `cluster_state:ok` and agrees with the other live nodes. A node
    /// without an append-only file comes back empty, and a primary that was
    /// not failed over meanwhile comes back owning its slots.
    ///
    /// # Panics
    ///
    /// Panics if the node does not restart or rejoin within 30 seconds.
    pub(crate) fn restart_node(&self, index: usize) {
        self.nodes[index].restart();
        let mut probe = Probe::new(self);
        self.wait(AGREE_DEADLINE, &format!("node {index} to rejoin"), |_| {
            probe.state_ok(index) && probe.agreed_view().is_some()
        });
    }

    fn index_of(&self, id: &str) -> usize {
        self.index_of_id(id)
            .unwrap_or_else(|| panic!("node id {id} is not one of this cluster's nodes"))
    }

    /// Runs `f` on a new connection to node `index`, panicking with the node's
    /// log if it fails.
    fn admin<T>(
        &self,
        index: usize,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> T {
        let node = &self.nodes[index];
        f(&mut node.client()).unwrap_or_else(|e| {
            panic!(
                "command on node {index} (port {}) failed: {e}\n{}",
                node.port(),
                tail(&node.log())
            )
        })
    }

    /// Waits for `cond` with a deadline, printing every live node's view if
    /// it never holds.
    #[track_caller]
    fn wait(&self, deadline: Duration, what: &str, mut cond: impl FnMut(&TestCluster) -> bool) {
        let started = Instant::now();
        loop {
            if cond(self) {
                return;
            }
            if started.elapsed() >= deadline {
                panic!(
                    "timed out after {deadline:?} waiting for {what}\n{}",
                    self.describe()
                );
            }
            thread::sleep(PROBE_INTERVAL);
        }
    }

    /// Every node's port, state and `CLUSTER NODES`, for failure messages.
    fn describe(&self) -> String {
        let mut text = String::new();
        let mut probe = Probe::new(self);
        for (i, node) in self.nodes.iter().enumerate() {
            let state = if !node.is_running() {
                "killed"
            } else if node.is_paused() {
                "paused"
            } else {
                "live"
            };
            let _ = writeln!(text, "--- node {i} port {} ({state}) ---", node.port());
            if self.is_live(i) {
                let nodes: Option<String> = probe.query(i, redis::cmd("CLUSTER").arg("NODES"));
                let _ = writeln!(text, "{}", nodes.unwrap_or_else(|| "no answer".into()));
            }
        }
        text
    }
}

impl std::fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCluster")
            .field(
                "ports",
                &self.nodes.iter().map(TestServer::port).collect::<Vec<_>>(),
            )
            .field("node_timeout", &self.node_timeout)
            .finish_non_exhaustive()
    }
}

/// A slot being moved by [`TestCluster::begin_migration`] or
/// [`TestCluster::migrate_slot_half`]: `MIGRATING` on the source,
/// `IMPORTING` on the target, its keys split between them until
/// [`SlotMigration::finish`]. Dropping it unfinished leaves the slot so.
#[derive(Debug)]
#[must_use = "the slot stays split between two nodes until `finish` is called"]
pub(crate) struct SlotMigration<'a> {
    cluster: &'a TestCluster,
    slot: u16,
    source: usize,
    target: usize,
}

impl SlotMigration<'_> {
    /// The slot being moved.
    pub(crate) fn slot(&self) -> u16 {
        self.slot
    }

    /// The node that owned the slot.
    pub(crate) fn source(&self) -> usize {
        self.source
    }

    /// The node the slot moves to.
    pub(crate) fn target(&self) -> usize {
        self.target
    }

    /// How many of the slot's keys are still on the source.
    pub(crate) fn keys_on_source(&self) -> usize {
        self.cluster.admin(self.source, |con| {
            redis::cmd("CLUSTER")
                .arg("COUNTKEYSINSLOT")
                .arg(self.slot)
                .query(con)
        })
    }

    /// Moves up to `limit` keys of the slot from the source to the target with
    /// `MIGRATE`, in batches, and returns how many it moved.
    pub(crate) fn move_keys(&self, limit: usize) -> usize {
        let target = self.cluster.node(self.target);
        let mut moved = 0;
        while moved < limit {
            let batch = MIGRATE_BATCH.min(limit - moved);
            let keys: Vec<Vec<u8>> = self.cluster.admin(self.source, |con| {
                redis::cmd("CLUSTER")
                    .arg("GETKEYSINSLOT")
                    .arg(self.slot)
                    .arg(batch)
                    .query(con)
            });
            if keys.is_empty() {
                break;
            }
            self.cluster.admin(self.source, |con| {
                redis::cmd("MIGRATE")
                    .arg("127.0.0.1")
                    .arg(target.port())
                    .arg("")
                    .arg(0)
                    .arg(MIGRATE_TIMEOUT_MS)
                    .arg("KEYS")
                    .arg(&keys)
                    .query::<String>(con)
            });
            moved += keys.len();
        }
        moved
    }

    /// Moves the remaining keys, assigns the slot to the target with `CLUSTER
    /// SETSLOT NODE` on the target, the source and every other live primary,
    /// and waits until every live node sees the target as the owner.
    ///
    /// # Panics
    ///
    /// Panics if a step fails or the nodes do not agree within 30 seconds.
    pub(crate) fn finish(self) {
        let cluster = self.cluster;
        while self.move_keys(usize::MAX) > 0 {}
        let target_id = &cluster.ids[self.target];
        let mut order = vec![self.target, self.source];
        order.extend(
            cluster
                .primaries()
                .into_iter()
                .filter(|&i| i != self.target && i != self.source && cluster.is_live(i)),
        );
        for node in order {
            cluster.admin(node, |con| {
                setslot(self.slot, "NODE", target_id).query::<()>(con)
            });
        }
        let mut probe = Probe::new(cluster);
        cluster.wait(
            AGREE_DEADLINE,
            &format!(
                "every node to see node {} own slot {}",
                self.target, self.slot
            ),
            |_| probe.all_see_owner(self.slot, target_id),
        );
    }
}

fn setslot(slot: u16, subcommand: &str, node_id: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("CLUSTER");
    cmd.arg("SETSLOT").arg(slot).arg(subcommand).arg(node_id);
    cmd
}

/// One node's view of the cluster, parsed from `CLUSTER NODES`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClusterView {
    /// Every node the viewer knows, itself included.
    pub(crate) nodes: Vec<NodeEntry>,
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeEntry {
    /// The node id.
    pub(crate) id: String,
    /// The client port.
    pub(crate) port: u16,
    /// Flags such as `myself`, `master`, `slave`, `fail?`, `fail`.
    pub(crate) flags: Vec<String>,
    /// For a replica, the id of its primary.
    pub(crate) primary_id: Option<String>,
    /// Whether the viewer's bus link to the node is connected.
    pub(crate) connected: bool,
    /// Owned slot ranges, inclusive; migration markers are left out.
    pub(crate) slots: Vec<(u16, u16)>,
}

impl NodeEntry {
    /// Whether the node is flagged `master`.
    pub(crate) fn is_primary(&self) -> bool {
        self.has_flag("master")
    }

    /// Whether the node is flagged as failing, unreachable or still being met.
    pub(crate) fn is_failing(&self) -> bool {
        ["fail", "fail?", "handshake", "noaddr"]
            .iter()
            .any(|flag| self.has_flag(flag))
    }

    fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }
}

impl ClusterView {
    /// Parses the text of `CLUSTER NODES`.
    ///
    /// # Panics
    ///
    /// Panics on a line it cannot read.
    pub(crate) fn parse(text: &str) -> ClusterView {
        let nodes = text
            .lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                assert!(fields.len() >= 8, "bad CLUSTER NODES line: {line}");
                let addr = fields[1].split('@').next().unwrap_or_default();
                let port = addr
                    .rsplit(':')
                    .next()
                    .and_then(|port| port.parse().ok())
                    .unwrap_or_else(|| panic!("bad address in CLUSTER NODES line: {line}"));
                let slots = fields[8..]
                    .iter()
                    .filter(|range| !range.starts_with('['))
                    .map(|range| {
                        let parse = |n: &str| -> u16 {
                            n.parse()
                                .unwrap_or_else(|_| panic!("bad slot range {range} in: {line}"))
                        };
                        match range.split_once('-') {
                            Some((start, end)) => (parse(start), parse(end)),
                            None => (parse(range), parse(range)),
                        }
                    })
                    .collect();
                NodeEntry {
                    id: fields[0].to_owned(),
                    port,
                    flags: fields[2].split(',').map(str::to_owned).collect(),
                    primary_id: (fields[3] != "-").then(|| fields[3].to_owned()),
                    connected: fields[7] == "connected",
                    slots,
                }
            })
            .collect();
        ClusterView { nodes }
    }

    /// The entry for node `id`.
    pub(crate) fn node(&self, id: &str) -> Option<&NodeEntry> {
        self.nodes.iter().find(|entry| entry.id == id)
    }

    /// The viewer's own entry.
    pub(crate) fn myself(&self) -> Option<&NodeEntry> {
        self.nodes.iter().find(|entry| entry.has_flag("myself"))
    }

    /// The node that owns `slot`, if any.
    pub(crate) fn owner_of(&self, slot: u16) -> Option<&NodeEntry> {
        self.nodes.iter().find(|entry| {
            entry
                .slots
                .iter()
                .any(|&(start, end)| (start..=end).contains(&slot))
        })
    }

    /// Slot ranges and the id of their owner, sorted by first slot, adjacent
    /// ranges of one owner merged.
    pub(crate) fn slot_map(&self) -> Vec<(u16, u16, String)> {
        let mut ranges: Vec<(u16, u16, String)> = self
            .nodes
            .iter()
            .flat_map(|entry| {
                entry
                    .slots
                    .iter()
                    .map(move |&(start, end)| (start, end, entry.id.clone()))
            })
            .collect();
        ranges.sort();
        let mut merged: Vec<(u16, u16, String)> = Vec::new();
        for (start, end, owner) in ranges {
            match merged.last_mut() {
                Some(last) if last.2 == owner && u32::from(last.1) + 1 == u32::from(start) => {
                    last.1 = end;
                }
                _ => merged.push((start, end, owner)),
            }
        }
        merged
    }

    /// Whether every slot has exactly one owner.
    pub(crate) fn covers_all_slots(&self) -> bool {
        let mut next: u32 = 0;
        for (start, end, _) in self.slot_map() {
            if u32::from(start) != next {
                return false;
            }
            next = u32::from(end) + 1;
        }
        next == u32::from(SLOTS)
    }

    /// What all nodes must agree on: the slot map and each node's role and primary.
    fn consensus(&self) -> Consensus {
        Consensus {
            slots: self.slot_map(),
            roles: self
                .nodes
                .iter()
                .map(|entry| {
                    let role = (entry.is_primary(), entry.primary_id.clone());
                    (entry.id.clone(), role)
                })
                .collect(),
        }
    }
}

/// The part of a [`ClusterView`] every node must hold alike.
#[derive(Debug, PartialEq, Eq)]
struct Consensus {
    slots: Vec<(u16, u16, String)>,
    /// Node id → (is a primary, id of its primary).
    roles: BTreeMap<String, (bool, Option<String>)>,
}

/// Reused connections to the nodes of a cluster, for polling them cheaply.
/// A node that is not live or does not answer is skipped.
struct Probe<'a> {
    cluster: &'a TestCluster,
    connections: Vec<Option<redis::Connection>>,
}

impl<'a> Probe<'a> {
    fn new(cluster: &'a TestCluster) -> Probe<'a> {
        Probe {
            cluster,
            connections: (0..cluster.nodes.len()).map(|_| None).collect(),
        }
    }

    /// Runs `cmd` on node `index`; `None` if the node is not live or fails.
    fn query<T: redis::FromRedisValue>(&mut self, index: usize, cmd: &redis::Cmd) -> Option<T> {
        if !self.cluster.is_live(index) {
            self.connections[index] = None;
            return None;
        }
        if self.connections[index].is_none() {
            let node = &self.cluster.nodes[index];
            let con = node
                .redis_client()
                .get_connection_with_timeout(PROBE_TIMEOUT)
                .ok()?;
            con.set_read_timeout(Some(PROBE_TIMEOUT)).ok()?;
            con.set_write_timeout(Some(PROBE_TIMEOUT)).ok()?;
            self.connections[index] = Some(con);
        }
        let con = self.connections[index].as_mut()?;
        match cmd.query(con) {
            Ok(value) => Some(value),
            Err(_) => {
                // A timed-out reply may still arrive: never reuse the connection.
                self.connections[index] = None;
                None
            }
        }
    }

    fn view(&mut self, index: usize) -> Option<ClusterView> {
        let text: String = self.query(index, redis::cmd("CLUSTER").arg("NODES"))?;
        Some(ClusterView::parse(&text))
    }

    /// The view of the first live node, if every live node answers with the
    /// same slot map and roles.
    fn agreed_view(&mut self) -> Option<ClusterView> {
        let mut agreed: Option<ClusterView> = None;
        let mut any = false;
        for i in 0..self.cluster.nodes.len() {
            if !self.cluster.is_live(i) {
                continue;
            }
            any = true;
            let view = self.view(i)?;
            match &agreed {
                None => agreed = Some(view),
                Some(first) if first.consensus() == view.consensus() => {}
                Some(_) => return None,
            }
        }
        assert!(any, "no node of the cluster is live");
        agreed
    }

    fn all_see_owner(&mut self, slot: u16, owner_id: &str) -> bool {
        (0..self.cluster.nodes.len())
            .filter(|&i| self.cluster.is_live(i))
            .all(|i| {
                self.view(i).is_some_and(|view| {
                    view.owner_of(slot)
                        .is_some_and(|owner| owner.id == owner_id)
                })
            })
    }

    fn state_ok(&mut self, index: usize) -> bool {
        self.query::<String>(index, redis::cmd("CLUSTER").arg("INFO"))
            .is_some_and(|info| info.lines().any(|line| line.trim() == "cluster_state:ok"))
    }

    fn replica_link_up(&mut self, index: usize) -> bool {
        self.query::<String>(index, redis::cmd("INFO").arg("replication"))
            .is_some_and(|info| {
                info.lines()
                    .any(|line| line.trim() == "master_link_status:up")
            })
    }

    /// The first element of `ROLE`: `master` or `slave`.
    fn role(&mut self, index: usize) -> Option<String> {
        let role: Vec<redis::Value> = self.query(index, &redis::cmd("ROLE"))?;
        redis::from_redis_value(role.into_iter().next()?).ok()
    }
}

/// The last lines of a log, for failure messages.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
