//! A Sentinel deployment of real processes on loopback: a primary, its
//! replica (or several, [`TestSentinelBuilder::replicas`]) and three
//! sentinels watching them, tuned so that a failover takes one to two
//! seconds.
//!
//! The data servers keep their indexes in [`TestSentinel::servers`] while
//! their roles change; [`TestSentinel::primary`] asks the sentinels which one
//! is the primary now.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::{TestServer, TestServerBuilder};

/// Sentinels in a [`TestSentinel`]; two of them are a quorum and a majority.
const SENTINELS: usize = 3;
const QUORUM: usize = 2;
const DEFAULT_SERVICE: &str = "respire";
/// Default `down-after-milliseconds`: how long the primary may not answer
/// before a sentinel deems it down.
const DEFAULT_DOWN_AFTER: Duration = Duration::from_millis(1_000);
/// Default `failover-timeout`; a failed attempt is retried after twice this.
const DEFAULT_FAILOVER_TIMEOUT: Duration = Duration::from_millis(2_000);
/// How long the deployment may take to form, or to settle after a change.
const SETTLE_DEADLINE: Duration = Duration::from_secs(30);
/// Connect, read and write timeout of the connections that watch the processes.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
const PROBE_INTERVAL: Duration = Duration::from_millis(10);
/// How often a [`SwitchWatcher`] thread looks at its stop flag.
const WATCH_POLL: Duration = Duration::from_millis(50);
const SWITCH_CHANNEL: &str = "+switch-master";

/// Options for a [`TestSentinel`]; start with [`TestSentinel::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `start` is called"]
pub(crate) struct TestSentinelBuilder {
    service: String,
    down_after: Duration,
    failover_timeout: Duration,
    replicas: usize,
    debug: Vec<(String, u64)>,
}

impl TestSentinelBuilder {
    /// The name the sentinels monitor the primary under. Defaults to
    /// `"respire"`.
    pub(crate) fn service(mut self, name: impl Into<String>) -> Self {
        self.service = name.into();
        self
    }

    /// `sentinel down-after-milliseconds`. Defaults to 1 second.
    pub(crate) fn down_after(mut self, down_after: Duration) -> Self {
        self.down_after = down_after;
        self
    }

    /// `sentinel failover-timeout`. Defaults to 2 seconds.
    pub(crate) fn failover_timeout(mut self, failover_timeout: Duration) -> Self {
        self.failover_timeout = failover_timeout;
        self
    }

    /// How many replicas the primary starts with, at least 1. With two or
    /// more, a failover leaves the new primary a replica in sync while the
    /// demoted one waits to be reconfigured. Defaults to 1.
    pub(crate) fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// Sets one of the sentinels' timing parameters with `SENTINEL DEBUG
    /// <param> <value>` on every sentinel once it is up (`publish-period`,
    /// `info-period`, …, in milliseconds). A demoted primary that still
    /// reports itself a primary is reconfigured at the first `INFO` reply
    /// (every `info-period`) at least four `publish-period`s after the switch:
    /// about ten seconds with Sentinel's own values. Defaults to none.
    pub(crate) fn sentinel_debug(mut self, param: impl Into<String>, value: u64) -> Self {
        self.debug.push((param.into(), value));
        self
    }

    /// Starts the primary, the replicas and the sentinels, and waits until
    /// every replica is in sync and every sentinel sees the primary, the
    /// replicas and the two other sentinels.
    ///
    /// # Panics
    ///
    /// Panics, with the logs, if a process does not start or the deployment
    /// does not form within 30 seconds.
    pub(crate) fn start(self) -> TestSentinel {
        let started = Instant::now();
        let no_sync_delay = ["--repl-diskless-sync-delay", "0"];
        let primary = TestServer::builder().args(no_sync_delay).start();
        let primary_port = primary.port().to_string();
        let replicas: Vec<TestServer> = (0..self.replicas)
            .map(|_| {
                TestServer::builder()
                    .args(no_sync_delay)
                    .args(["--replicaof", "127.0.0.1", &primary_port])
                    .start()
            })
            .collect();
        let config = self.config(primary.port());
        let sentinels: Vec<TestServer> = thread::scope(|scope| {
            let starting: Vec<_> = (0..SENTINELS)
                .map(|_| {
                    let builder = TestServerBuilder::default().sentinel(config.clone());
                    scope.spawn(move || builder.start())
                })
                .collect();
            starting
                .into_iter()
                .map(|s| s.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        for (i, sentinel) in sentinels.iter().enumerate() {
            for (param, value) in &self.debug {
                let () = redis::cmd("SENTINEL")
                    .arg("DEBUG")
                    .arg(param)
                    .arg(value)
                    .query(&mut sentinel.client())
                    .unwrap_or_else(|e| {
                        panic!("SENTINEL DEBUG {param} {value} on sentinel {i}: {e}")
                    });
            }
        }
        let mut deployment = TestSentinel {
            service: self.service,
            servers: std::iter::once(primary).chain(replicas).collect(),
            sentinels,
            startup: Duration::ZERO,
        };
        deployment.wait_settled(0);
        deployment.startup = started.elapsed();
        deployment
    }

    fn config(&self, primary_port: u16) -> String {
        let service = &self.service;
        let mut config = String::new();
        let _ = writeln!(
            config,
            "sentinel monitor {service} 127.0.0.1 {primary_port} {QUORUM}"
        );
        let _ = writeln!(
            config,
            "sentinel down-after-milliseconds {service} {}",
            self.down_after.as_millis()
        );
        let _ = writeln!(
            config,
            "sentinel failover-timeout {service} {}",
            self.failover_timeout.as_millis()
        );
        let _ = writeln!(config, "sentinel parallel-syncs {service} 1");
        config
    }
}

/// A primary and its replicas, one unless [`TestSentinelBuilder::replicas`]
/// says more (`redis-server` on free loopback ports), watched by three
/// sentinels (`redis-server sentinel.conf --sentinel`) with a quorum of
/// two.
///
/// Every process is a [`TestServer`], killed on drop and by its supervisor
/// when the test process exits. Pause, resume, kill or restart any of them
/// through [`TestSentinel::primary`], [`TestSentinel::replica`],
/// [`TestSentinel::server`] and [`TestSentinel::sentinel`]. A restarted data
/// server comes back with its start-time `--replicaof` (none for server 0)
/// and with the data of the RDB file its last full synchronisation as a
/// replica left in its directory (Redis keeps that file although
/// persistence is off), or empty if it never had one; the sentinels
/// reconfigure it.
pub(crate) struct TestSentinel {
    service: String,
    servers: Vec<TestServer>,
    sentinels: Vec<TestServer>,
    startup: Duration,
}

impl TestSentinel {
    /// Starts a deployment with default options; see [`TestSentinel::builder`].
    ///
    /// # Panics
    ///
    /// Panics, with the logs, if the deployment does not form.
    pub(crate) fn start() -> TestSentinel {
        TestSentinel::builder().start()
    }

    /// Options for another service name or other failover timings.
    pub(crate) fn builder() -> TestSentinelBuilder {
        TestSentinelBuilder {
            service: DEFAULT_SERVICE.to_owned(),
            down_after: DEFAULT_DOWN_AFTER,
            failover_timeout: DEFAULT_FAILOVER_TIMEOUT,
            replicas: 1,
            debug: Vec::new(),
        }
    }

    /// How long [`TestSentinelBuilder::start`] took.
    pub(crate) fn startup_time(&self) -> Duration {
        self.startup
    }

    /// The name the sentinels monitor the primary under.
    pub(crate) fn service(&self) -> &str {
        &self.service
    }

    /// The data servers; server 0 started as the primary.
    pub(crate) fn servers(&self) -> &[TestServer] {
        &self.servers
    }

    /// Data server `index` (0 or 1 with one replica).
    pub(crate) fn server(&self, index: usize) -> &TestServer {
        &self.servers[index]
    }

    /// The three sentinels.
    pub(crate) fn sentinels(&self) -> &[TestServer] {
        &self.sentinels
    }

    /// Sentinel `index` (0 to 2).
    pub(crate) fn sentinel(&self, index: usize) -> &TestServer {
        &self.sentinels[index]
    }

    /// `redis://127.0.0.1:PORT` of every sentinel.
    pub(crate) fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(TestServer::url).collect()
    }

    /// The pid of every process: the data servers, then the sentinels.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.servers
            .iter()
            .chain(&self.sentinels)
            .map(TestServer::pid)
            .collect()
    }

    /// What sentinel `index` answers to `SENTINEL GET-MASTER-ADDR-BY-NAME`
    /// for the service; `None` if it knows no such service.
    ///
    /// # Panics
    ///
    /// Panics if the sentinel does not answer.
    pub(crate) fn primary_addr_by(&self, index: usize) -> Option<SocketAddr> {
        let reply: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&self.service)
            .query(&mut self.sentinels[index].client())
            .unwrap_or_else(|e| panic!("GET-MASTER-ADDR-BY-NAME on sentinel {index}: {e}"));
        reply.map(|(ip, port)| addr(&ip, port))
    }

    /// The primary address each sentinel reports, in sentinel order; `None`
    /// for a sentinel that is not live, does not answer within a second or
    /// knows no primary.
    pub(crate) fn primary_addrs(&self) -> Vec<Option<SocketAddr>> {
        let mut probe = Probe::new(self);
        (0..SENTINELS).map(|i| probe.primary_addr(i)).collect()
    }

    /// The index of the data server most live sentinels report as the
    /// primary (the lower index on a tie).
    ///
    /// # Panics
    ///
    /// Panics if no live sentinel names one of the data servers.
    pub(crate) fn primary_index(&self) -> usize {
        let mut votes = vec![0_usize; self.servers.len()];
        for addr in self.primary_addrs().into_iter().flatten() {
            if let Some(i) = self.server_at(addr) {
                votes[i] += 1;
            }
        }
        assert!(
            votes.iter().any(|&v| v > 0),
            "no live sentinel names a primary\n{}",
            self.describe()
        );
        // The most votes; the lower index on a tie.
        (0..votes.len())
            .rev()
            .max_by_key(|&i| votes[i])
            .expect("a data server")
    }

    /// The data server the sentinels report as the primary; see
    /// [`TestSentinel::primary_index`].
    pub(crate) fn primary(&self) -> &TestServer {
        &self.servers[self.primary_index()]
    }

    /// The data server that is not [`TestSentinel::primary`] (the first
    /// such with several replicas).
    pub(crate) fn replica(&self) -> &TestServer {
        &self.servers[self.replica_index()]
    }

    /// The index of [`TestSentinel::replica`].
    fn replica_index(&self) -> usize {
        let primary = self.primary_index();
        (0..self.servers.len())
            .find(|&i| i != primary)
            .expect("a replica")
    }

    /// Runs `SENTINEL FAILOVER` on the first live sentinel and waits until
    /// every live sentinel reports another data server as the primary and
    /// `ROLE` on it says `master`. Returns how long that took. The demoted
    /// primary keeps acting as a primary until the sentinels reconfigure
    /// it, about ten seconds later; see [`TestSentinel::wait_replica_of`].
    ///
    /// # Panics
    ///
    /// Panics if no sentinel is live, the sentinel refuses (such as
    /// `NOGOODSLAVE` while the old primary has not been reconfigured yet) or
    /// the switch is not complete within 30 seconds.
    pub(crate) fn failover(&self) -> Duration {
        let old = self.primary_index();
        let sentinel = (0..SENTINELS)
            .find(|&i| is_live(&self.sentinels[i]))
            .expect("a live sentinel");
        let started = Instant::now();
        let () = redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(&self.service)
            .query(&mut self.sentinels[sentinel].client())
            .unwrap_or_else(|e| {
                panic!(
                    "SENTINEL FAILOVER on sentinel {sentinel}: {e}\n{}",
                    self.describe()
                )
            });
        self.wait_primary_other_than(old, SETTLE_DEADLINE);
        started.elapsed()
    }

    /// Waits until every live sentinel reports the same data server, not
    /// `old`, as the primary and `ROLE` on it says `master`; returns its
    /// index and how long that took.
    ///
    /// # Panics
    ///
    /// Panics if that is not so within `deadline`.
    pub(crate) fn wait_primary_other_than(
        &self,
        old: usize,
        deadline: Duration,
    ) -> (usize, Duration) {
        let started = Instant::now();
        let mut probe = Probe::new(self);
        let mut new = old;
        self.wait(
            deadline,
            &format!("a server other than {old} to be the primary"),
            || {
                let named: Vec<Option<SocketAddr>> = (0..SENTINELS)
                    .filter(|&i| is_live(&self.sentinels[i]))
                    .map(|i| probe.primary_addr(i))
                    .collect();
                let Some(Some(first)) = named.first().copied() else {
                    return false;
                };
                let Some(index) = self.server_at(first) else {
                    return false;
                };
                new = index;
                index != old
                    && named.iter().all(|&a| a == Some(first))
                    && probe.role(&self.servers[index]).as_deref() == Some("master")
            },
        );
        (new, started.elapsed())
    }

    /// Waits until every live sentinel reports data server `index` as the
    /// primary and `ROLE` on it says `master`, and returns how long that took.
    ///
    /// # Panics
    ///
    /// Panics if that is not so within `deadline`.
    pub(crate) fn wait_primary(&self, index: usize, deadline: Duration) -> Duration {
        let started = Instant::now();
        let expected = self.servers[index].addr();
        let mut probe = Probe::new(self);
        self.wait(
            deadline,
            &format!("server {index} to be the primary"),
            || {
                probe.role(&self.servers[index]).as_deref() == Some("master")
                    && (0..SENTINELS)
                        .filter(|&i| is_live(&self.sentinels[i]))
                        .all(|i| probe.primary_addr(i) == Some(expected))
            },
        );
        started.elapsed()
    }

    /// Waits until `ROLE` on data server `index` says it replicates the
    /// primary (the other server: with one replica only; see
    /// [`TestSentinel::wait_replicas_of_primary`] for more) with its link
    /// connected, and the primary has heard the replica acknowledge an
    /// offset (until then the primary streams it nothing, and a `WAIT` can
    /// time out); returns how long that took. After a failover the sentinels
    /// reconfigure the old primary only after it has reported itself a
    /// primary for a while.
    ///
    /// # Panics
    ///
    /// Panics if that is not so within `deadline`.
    pub(crate) fn wait_replica_of(&self, index: usize, deadline: Duration) -> Duration {
        let started = Instant::now();
        let primary_port = self.servers[1 - index].port();
        let mut probe = Probe::new(self);
        self.wait(
            deadline,
            &format!("server {index} to replicate port {primary_port}"),
            || {
                probe.role_reply(&self.servers[index]).is_some_and(|role| {
                    role.len() >= 4
                        && text(&role[0]) == "slave"
                        && redis::from_redis_value_ref::<u16>(&role[2]).ok() == Some(primary_port)
                        && text(&role[3]) == "connected"
                }) && probe.acknowledged_by(&self.servers[1 - index], self.servers[index].port())
            },
        );
        started.elapsed()
    }

    /// Waits until every live sentinel lists data server `index` among the
    /// replicas of the primary as one a failover can select: a live link, no
    /// down flag, an `INFO` less than 5 seconds old in which it reported the
    /// role `role` (`"slave"`, or `"master"` for a server restarted without
    /// `--replicaof` that the sentinels have not reconfigured yet: Sentinel
    /// selects it all the same), and no replication link down. Returns how
    /// long that took.
    ///
    /// # Panics
    ///
    /// Panics if that is not so within `deadline`.
    pub(crate) fn wait_selectable(&self, index: usize, role: &str, deadline: Duration) -> Duration {
        let started = Instant::now();
        let port = self.servers[index].port().to_string();
        let mut probe = Probe::new(self);
        self.wait(
            deadline,
            &format!("the sentinels to see server {index} selectable, reporting the role {role}"),
            || {
                (0..SENTINELS)
                    .filter(|&i| is_live(&self.sentinels[i]))
                    .all(|i| {
                        probe.replica_fields(i).is_some_and(|replicas| {
                            replicas.iter().any(|fields| {
                                let field = |name: &str| fields.get(name).map(String::as_str);
                                field("port") == Some(port.as_str())
                                    && field("flags") == Some("slave")
                                    && field("role-reported") == Some(role)
                                    && field("master-link-down-time") == Some("0")
                                    && field("info-refresh")
                                        .and_then(|ms| ms.parse::<u64>().ok())
                                        .is_some_and(|ms| ms < 5_000)
                            })
                        })
                    })
            },
        );
        started.elapsed()
    }

    /// Subscribes to `+switch-master` on every live sentinel and records each
    /// message from then on; see [`SwitchWatcher`].
    ///
    /// # Panics
    ///
    /// Panics if a subscription cannot be made within 5 seconds.
    pub(crate) fn watch_switches(&self) -> SwitchWatcher {
        SwitchWatcher::start(self)
    }

    /// Waits until `ROLE` on every data server but the primary the sentinels
    /// name says it replicates that primary with its link connected, and
    /// returns how long that took. After a failover the sentinels reconfigure
    /// a demoted primary only after it has reported itself a primary for a
    /// while.
    ///
    /// # Panics
    ///
    /// Panics if that is not so within `deadline`.
    pub(crate) fn wait_replicas_of_primary(&self, deadline: Duration) -> Duration {
        let started = Instant::now();
        let mut probe = Probe::new(self);
        self.wait(
            deadline,
            "every other server to replicate the primary",
            || {
                let named = (0..SENTINELS)
                    .filter(|&i| is_live(&self.sentinels[i]))
                    .find_map(|i| probe.primary_addr(i));
                let Some(primary) = named.and_then(|a| self.server_at(a)) else {
                    return false;
                };
                let primary_port = self.servers[primary].port();
                (0..self.servers.len()).filter(|&i| i != primary).all(|i| {
                    probe.role_reply(&self.servers[i]).is_some_and(|role| {
                        role.len() >= 4
                            && text(&role[0]) == "slave"
                            && redis::from_redis_value_ref::<u16>(&role[2]).ok()
                                == Some(primary_port)
                            && text(&role[3]) == "connected"
                    })
                })
            },
        );
        started.elapsed()
    }

    /// Runs `CLIENT PAUSE <for> WRITE` on the current replica: it keeps
    /// answering reads but holds back every write, including the ones its
    /// primary replicates to it, until the pause ends or
    /// [`TestSentinel::unpause_replica`]. Returns the replica's index.
    ///
    /// `PUBLISH` is refused on the replica meanwhile (`ACL SETUSER default
    /// -publish`): a pause holds it back too, and a sentinel's periodic hello
    /// held back on its command link would queue the promotion behind it, so
    /// a failover during the pause would time out. Refused, the hello fails at
    /// once (the ACL check comes before the pause) and the link stays free.
    pub(crate) fn pause_replica_writes(&self, duration: Duration) -> usize {
        let index = self.replica_index();
        let mut con = self.servers[index].client();
        let () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("default")
            .arg("-publish")
            .query(&mut con)
            .expect("ACL SETUSER default -publish on the replica");
        let () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(duration.as_millis() as u64)
            .arg("WRITE")
            .query(&mut con)
            .expect("CLIENT PAUSE WRITE on the replica");
        index
    }

    /// Ends a [`TestSentinel::pause_replica_writes`] with `CLIENT UNPAUSE` on
    /// data server `index`, and lets it take `PUBLISH` again.
    pub(crate) fn unpause_replica(&self, index: usize) {
        let mut con = self.servers[index].client();
        let () = redis::cmd("CLIENT")
            .arg("UNPAUSE")
            .query(&mut con)
            .expect("CLIENT UNPAUSE");
        let () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("default")
            .arg("+publish")
            .query(&mut con)
            .expect("ACL SETUSER default +publish");
    }

    /// Waits until every replica is in sync with data server `primary` and
    /// every sentinel reports it as the primary, knows every replica healthy
    /// and the two other sentinels.
    fn wait_settled(&self, primary: usize) {
        let expected = self.servers[primary].addr();
        let replicas = (self.servers.len() - 1).to_string();
        let mut probe = Probe::new(self);
        self.wait(SETTLE_DEADLINE, "the sentinel deployment to form", || {
            (0..self.servers.len())
                .filter(|&i| i != primary)
                .all(|i| probe.replica_link_up(&self.servers[i]))
                && (0..SENTINELS).all(|i| {
                    probe.primary_addr(i) == Some(expected)
                        && probe.master_fields(i).is_some_and(|fields| {
                            fields.get("flags").map(String::as_str) == Some("master")
                                && fields.get("num-slaves") == Some(&replicas)
                                && fields.get("num-other-sentinels").map(String::as_str)
                                    == Some("2")
                        })
                })
        });
    }

    fn server_at(&self, addr: SocketAddr) -> Option<usize> {
        self.servers.iter().position(|server| server.addr() == addr)
    }

    #[track_caller]
    fn wait(&self, deadline: Duration, what: &str, mut cond: impl FnMut() -> bool) {
        let started = Instant::now();
        loop {
            if cond() {
                return;
            }
            if started.elapsed() >= deadline {
                let logs: String = self
                    .sentinels
                    .iter()
                    .enumerate()
                    .map(|(i, s)| format!("--- sentinel {i} log ---\n{}\n", s.log()))
                    .collect();
                panic!(
                    "timed out after {deadline:?} waiting for {what}\n{}{logs}",
                    self.describe()
                );
            }
            thread::sleep(PROBE_INTERVAL);
        }
    }

    /// Each process's port, state and view, for failure messages.
    fn describe(&self) -> String {
        let mut text_out = String::new();
        let mut probe = Probe::new(self);
        for (i, server) in self.servers.iter().enumerate() {
            let role = probe.role_reply(server).map(|role| format!("{role:?}"));
            let _ = writeln!(
                text_out,
                "server {i} port {} ({}): ROLE {}",
                server.port(),
                state(server),
                role.unwrap_or_else(|| "no answer".into())
            );
        }
        for (i, sentinel) in self.sentinels.iter().enumerate() {
            let _ = writeln!(
                text_out,
                "sentinel {i} port {} ({}): primary {:?}, {:?}",
                sentinel.port(),
                state(sentinel),
                probe.primary_addr(i),
                probe.master_fields(i)
            );
        }
        text_out
    }
}

impl std::fmt::Debug for TestSentinel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestSentinel")
            .field("service", &self.service)
            .field(
                "servers",
                &self
                    .servers
                    .iter()
                    .map(TestServer::port)
                    .collect::<Vec<_>>(),
            )
            .field(
                "sentinels",
                &self
                    .sentinels
                    .iter()
                    .map(TestServer::port)
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

/// One `+switch-master` message: `<service> <old ip> <old port> <new ip> <new port>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SwitchEvent {
    /// The index of the sentinel that published it.
    pub(crate) sentinel: usize,
    /// When the watcher received it.
    pub(crate) at: Instant,
    /// The service name.
    pub(crate) service: String,
    /// The primary before the switch.
    pub(crate) old: SocketAddr,
    /// The primary after the switch.
    pub(crate) new: SocketAddr,
}

/// Records `+switch-master` messages from every sentinel that was live when
/// it started, one thread and one RESP2 subscriber connection (with a short
/// read timeout) per sentinel. A thread ends when its sentinel closes the
/// connection (killed or restarted); dropping the watcher stops the others.
pub(crate) struct SwitchWatcher {
    events: Arc<Mutex<Vec<SwitchEvent>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl SwitchWatcher {
    fn start(deployment: &TestSentinel) -> SwitchWatcher {
        let events = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel();
        let mut threads = Vec::new();
        for (index, sentinel) in deployment.sentinels.iter().enumerate() {
            if !is_live(sentinel) {
                continue;
            }
            let client = sentinel.redis_client();
            let (events, stop, ready) = (events.clone(), stop.clone(), ready_tx.clone());
            let thread = thread::Builder::new()
                .name(format!("switch-watch-{index}"))
                .spawn(move || watch(index, &client, &events, &stop, &ready))
                .expect("spawn a switch watcher thread");
            threads.push(thread);
        }
        drop(ready_tx);
        for _ in 0..threads.len() {
            match ready_rx.recv_timeout(Duration::from_secs(5)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panic!("cannot subscribe to {SWITCH_CHANNEL}: {e}"),
                Err(e) => panic!("a switch watcher did not subscribe in time: {e}"),
            }
        }
        SwitchWatcher {
            events,
            stop,
            threads,
        }
    }

    /// Every message received so far, in arrival order.
    pub(crate) fn events(&self) -> Vec<SwitchEvent> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until at least `count` messages have arrived and returns all of
    /// them.
    ///
    /// # Panics
    ///
    /// Panics if fewer have arrived by `deadline`.
    #[track_caller]
    pub(crate) fn wait_for(&self, count: usize, deadline: Duration) -> Vec<SwitchEvent> {
        super::wait_until(
            deadline,
            &format!("{count} {SWITCH_CHANNEL} messages"),
            || self.events.lock().unwrap_or_else(|e| e.into_inner()).len() >= count,
        );
        self.events()
    }
}

impl Drop for SwitchWatcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for SwitchWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwitchWatcher")
            .field("events", &self.events())
            .finish_non_exhaustive()
    }
}

/// The body of a [`SwitchWatcher`] thread for sentinel `index`.
fn watch(
    index: usize,
    client: &redis::Client,
    events: &Mutex<Vec<SwitchEvent>>,
    stop: &AtomicBool,
    ready: &mpsc::Sender<redis::RedisResult<()>>,
) {
    let subscribe = || -> redis::RedisResult<redis::Connection> {
        let con = client.get_connection_with_timeout(PROBE_TIMEOUT)?;
        con.set_write_timeout(Some(PROBE_TIMEOUT))?;
        con.set_read_timeout(Some(PROBE_TIMEOUT))?;
        Ok(con)
    };
    let mut con = match subscribe() {
        Ok(con) => con,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut pubsub = con.as_pubsub();
    if let Err(e) = pubsub.subscribe(SWITCH_CHANNEL) {
        let _ = ready.send(Err(e));
        return;
    }
    if pubsub.set_read_timeout(Some(WATCH_POLL)).is_err() {
        return;
    }
    let _ = ready.send(Ok(()));
    while !stop.load(Ordering::Relaxed) {
        match pubsub.get_message() {
            Ok(message) => {
                let at = Instant::now();
                let Ok(payload) = message.get_payload::<String>() else {
                    continue;
                };
                if let Some(event) = parse_switch(index, at, &payload) {
                    events.lock().unwrap_or_else(|e| e.into_inner()).push(event);
                }
            }
            Err(e) if e.is_timeout() => {}
            Err(_) => return,
        }
    }
}

/// Parses a `+switch-master` payload.
fn parse_switch(sentinel: usize, at: Instant, payload: &str) -> Option<SwitchEvent> {
    let fields: Vec<&str> = payload.split_whitespace().collect();
    let [service, old_ip, old_port, new_ip, new_port] = fields[..] else {
        return None;
    };
    Some(SwitchEvent {
        sentinel,
        at,
        service: service.to_owned(),
        old: addr(old_ip, old_port.parse().ok()?),
        new: addr(new_ip, new_port.parse().ok()?),
    })
}

fn addr(ip: &str, port: u16) -> SocketAddr {
    let ip: Ipv4Addr = ip
        .parse()
        .unwrap_or_else(|_| panic!("not an IPv4 address: {ip}"));
    SocketAddr::from((ip, port))
}

fn is_live(server: &TestServer) -> bool {
    server.is_running() && !server.is_paused()
}

fn state(server: &TestServer) -> &'static str {
    if !server.is_running() {
        "killed"
    } else if server.is_paused() {
        "paused"
    } else {
        "live"
    }
}

fn text(value: &redis::Value) -> String {
    redis::from_redis_value_ref(value).unwrap_or_default()
}

/// Reused connections to the processes of a deployment; a process that is not
/// live or does not answer is skipped.
struct Probe<'a> {
    deployment: &'a TestSentinel,
    connections: HashMap<u16, redis::Connection>,
}

impl<'a> Probe<'a> {
    fn new(deployment: &'a TestSentinel) -> Probe<'a> {
        Probe {
            deployment,
            connections: HashMap::new(),
        }
    }

    fn query<T: redis::FromRedisValue>(
        &mut self,
        server: &TestServer,
        cmd: &redis::Cmd,
    ) -> Option<T> {
        let port = server.port();
        if !is_live(server) {
            self.connections.remove(&port);
            return None;
        }
        let con = match self.connections.entry(port) {
            Entry::Occupied(entry) => entry.into_mut(),
            Entry::Vacant(entry) => {
                let con = server
                    .redis_client()
                    .get_connection_with_timeout(PROBE_TIMEOUT)
                    .ok()?;
                con.set_read_timeout(Some(PROBE_TIMEOUT)).ok()?;
                con.set_write_timeout(Some(PROBE_TIMEOUT)).ok()?;
                entry.insert(con)
            }
        };
        match cmd.query(con) {
            Ok(value) => Some(value),
            Err(_) => {
                // A timed-out reply may still arrive: never reuse the connection.
                self.connections.remove(&port);
                None
            }
        }
    }

    fn primary_addr(&mut self, sentinel: usize) -> Option<SocketAddr> {
        let deployment = self.deployment;
        let reply: Option<(String, u16)> = self.query(
            &deployment.sentinels[sentinel],
            redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(&deployment.service),
        )?;
        reply.map(|(ip, port)| addr(&ip, port))
    }

    /// `SENTINEL MASTER <service>` as field → value.
    fn master_fields(&mut self, sentinel: usize) -> Option<HashMap<String, String>> {
        let deployment = self.deployment;
        self.query(
            &deployment.sentinels[sentinel],
            redis::cmd("SENTINEL")
                .arg("MASTER")
                .arg(&deployment.service),
        )
    }

    /// `SENTINEL REPLICAS <service>`: each replica's fields as field → value.
    fn replica_fields(&mut self, sentinel: usize) -> Option<Vec<HashMap<String, String>>> {
        let deployment = self.deployment;
        self.query(
            &deployment.sentinels[sentinel],
            redis::cmd("SENTINEL")
                .arg("REPLICAS")
                .arg(&deployment.service),
        )
    }

    fn role_reply(&mut self, server: &TestServer) -> Option<Vec<redis::Value>> {
        self.query(server, &redis::cmd("ROLE"))
    }

    fn role(&mut self, server: &TestServer) -> Option<String> {
        self.role_reply(server)
            .and_then(|role| role.first().map(text))
    }

    /// Whether `primary` lists the replica on `port` online with an
    /// acknowledged offset: after a full synchronisation, the primary starts
    /// streaming to a replica at its first acknowledgement.
    fn acknowledged_by(&mut self, primary: &TestServer, port: u16) -> bool {
        let port = format!("port={port}");
        self.query::<String>(primary, redis::cmd("INFO").arg("replication"))
            .is_some_and(|info| {
                info.lines().any(|line| {
                    let fields: Vec<&str> = line.trim().split(',').collect();
                    line.starts_with("slave")
                        && fields.contains(&port.as_str())
                        && fields.contains(&"state=online")
                        && fields.iter().any(|f| {
                            f.strip_prefix("offset=")
                                .and_then(|o| o.parse::<u64>().ok())
                                .is_some_and(|o| o > 0)
                        })
                })
            })
    }

    fn replica_link_up(&mut self, server: &TestServer) -> bool {
        self.query::<String>(server, redis::cmd("INFO").arg("replication"))
            .is_some_and(|info| {
                info.lines()
                    .any(|line| line.trim() == "master_link_status:up")
            })
    }
}
