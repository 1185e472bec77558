//! Faults caused on purpose, one at a time, on a schedule drawn from the
//! run's seed: which fault, on which server or worker, how long, and the gap
//! before the next. Every fault is healed before the next one starts, and
//! each is recorded with its start and end on the shared monotonic clock.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::str::FromStr;
use std::thread;
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process};

use crate::clock::now_ns;
use crate::rng::Rng;
use crate::spec::Topology;
use crate::support::{Mode, TestServer};
use crate::topo::{self, Deployment};

/// One kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Fault {
    /// `kill -9` of a data server, restarted 0–300 ms later (with the AOF
    /// when the topology has one).
    Kill,
    /// `kill -9` of a majority of the Redlock nodes at once, then restarts.
    KillMajority,
    /// `kill -9` and restart of a majority of the Redlock nodes while a
    /// worker in the middle of a grant (waited for up to 2 s) is stopped
    /// (`SIGSTOP`), resumed
    /// 50–200 ms after the restarts: its restart watchers read the closes
    /// only once it runs again, in a race with its own thread.
    RestartPausedWorker,
    /// `kill -9` and restart of a majority of the Redlock nodes behind
    /// blackholed proxies, struck once a worker is in the middle of a grant
    /// (waited for up to 2 s): the clients see neither the closes nor the
    /// new servers until the proxies reset their connections 50–200 ms
    /// after the restarts.
    RestartPartitioned,
    /// `SIGSTOP` of a data server for 0.2–2 TTLs.
    Stop,
    /// `SIGSTOP` of a worker for 1.5–3 TTLs.
    PauseWorker,
    /// Proxy delays both directions by 5–60 ms for 0.5–2 s.
    Delay,
    /// Proxy forwards nothing for 0.2–2 TTLs, then resets its connections.
    Blackhole,
    /// Proxy drops requests (client → server) for 0.1–1 s.
    DropRequests,
    /// Proxy drops replies (server → client) for 0.1–1 s.
    DropReplies,
    /// 5–20 `CLIENT KILL TYPE normal` on every data server, 20–100 ms apart.
    ClientKill,
    /// `maxmemory 1` (every write refused with OOM) for 0.2–1 s.
    Oom,
    /// `SENTINEL FAILOVER`, or `CLUSTER FAILOVER` on the replica of a key's
    /// primary.
    Failover,
    /// `kill -9` of the Sentinel primary; restarted once the replica is
    /// promoted.
    KillPrimary,
    /// `CLUSTER FAILOVER TAKEOVER` on the replica of a key's primary.
    Takeover,
    /// A key's slot moved to another primary.
    Migrate,
    /// The Sentinel replica's writes paused (`CLIENT PAUSE WRITE`), a few
    /// grants made on the primary alone, then `SENTINEL FAILOVER`: the new
    /// primary never saw them.
    UnreplicatedFailover,
    /// Client ↔ sentinel: every sentinel proxy forwards nothing for 0.5-3 s,
    /// then resets its connections.
    CutClientSentinel,
    /// Sentinel ↔ primary: the `sentinel` user switched off on the primary
    /// (its connections closed) for 0.5-4 s; past the down-after time (1 s)
    /// the sentinels promote the replica while the clients still reach the
    /// old primary.
    CutSentinelPrimary,
    /// Primary ↔ replica: the `replicator` user switched off on the
    /// Sentinel primary or a key's cluster primary for 0.2-2 TTLs.
    CutPrimaryReplica,
    /// Client ↔ primary: the workers' `app` user switched off on the
    /// Sentinel primary or a key's cluster primary (their connections
    /// closed, new ones refused) for 0.2-2 TTLs.
    CutClientPrimary,
    /// The split that hides a switch: client ↔ sentinel and sentinel ↔
    /// primary cut together for 2.5-4 s; the sentinels promote the replica
    /// while the clients, blind to the sentinels, stay on the old primary.
    Split,
    /// Cluster bus ↔ a key's primary: the primary's inbound bus proxy
    /// blackholed and what it sends from its own address dropped by the
    /// other nodes' bus proxies, for 1.5-6 s (the cluster's node timeout is
    /// 2 s): past the node timeout the others fail it over to its replica
    /// while it still serves the clients that reach it, until it sees it
    /// lost the majority. Healed by resetting every bus connection; the
    /// fault ends once the cluster is healthy again (the old primary a
    /// replica if it was replaced). Needs the bus proxies, which a cluster
    /// row with this fault in its mix starts with.
    CutBus,
    /// Two faults of the row's mix at once, the second starting 0-300 ms
    /// after the first.
    Pair,
    /// A server's wall clock stepped forward (libfaketime, `--server-clock
    /// faketime`) by `clock_step_ms` (default 0.05-0.25 TTLs): every key
    /// there expires that much earlier.
    ClockStep,
}

impl Fault {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::KillMajority => "kill-majority",
            Fault::RestartPausedWorker => "restart-paused-worker",
            Fault::RestartPartitioned => "restart-partitioned",
            Fault::Stop => "stop",
            Fault::PauseWorker => "pause-worker",
            Fault::Delay => "delay",
            Fault::Blackhole => "blackhole",
            Fault::DropRequests => "drop-requests",
            Fault::DropReplies => "drop-replies",
            Fault::ClientKill => "client-kill",
            Fault::Oom => "oom",
            Fault::Failover => "failover",
            Fault::KillPrimary => "kill-primary",
            Fault::Takeover => "takeover",
            Fault::Migrate => "migrate",
            Fault::UnreplicatedFailover => "unreplicated-failover",
            Fault::CutClientSentinel => "cut-client-sentinel",
            Fault::CutSentinelPrimary => "cut-sentinel-primary",
            Fault::CutPrimaryReplica => "cut-primary-replica",
            Fault::CutClientPrimary => "cut-client-primary",
            Fault::Split => "split",
            Fault::Pair => "pair",
            Fault::ClockStep => "clock-step",
            Fault::CutBus => "cut-bus",
        }
    }

    const ALL: [Fault; 25] = [
        Fault::Kill,
        Fault::KillMajority,
        Fault::RestartPausedWorker,
        Fault::RestartPartitioned,
        Fault::Stop,
        Fault::PauseWorker,
        Fault::Delay,
        Fault::Blackhole,
        Fault::DropRequests,
        Fault::DropReplies,
        Fault::ClientKill,
        Fault::Oom,
        Fault::Failover,
        Fault::KillPrimary,
        Fault::Takeover,
        Fault::Migrate,
        Fault::UnreplicatedFailover,
        Fault::CutClientSentinel,
        Fault::CutSentinelPrimary,
        Fault::CutPrimaryReplica,
        Fault::CutClientPrimary,
        Fault::Split,
        Fault::Pair,
        Fault::ClockStep,
        Fault::CutBus,
    ];

    /// The default mix of a topology: every fault it supports.
    pub(crate) fn mix(topology: Topology) -> Vec<Fault> {
        use Fault::*;
        match topology {
            Topology::Standalone { .. } => vec![
                Kill,
                Stop,
                PauseWorker,
                Delay,
                Blackhole,
                DropRequests,
                DropReplies,
                ClientKill,
                Oom,
                Pair,
            ],
            Topology::Redlock { .. } => vec![
                Kill,
                KillMajority,
                Stop,
                PauseWorker,
                Delay,
                Blackhole,
                DropRequests,
                DropReplies,
                ClientKill,
                Oom,
                Pair,
            ],
            Topology::Sentinel => vec![
                Failover,
                KillPrimary,
                Stop,
                PauseWorker,
                ClientKill,
                Oom,
                CutClientSentinel,
                CutSentinelPrimary,
                CutPrimaryReplica,
                CutClientPrimary,
                Split,
                Pair,
            ],
            Topology::Cluster => vec![
                Failover,
                Takeover,
                Migrate,
                Stop,
                PauseWorker,
                ClientKill,
                Oom,
                CutPrimaryReplica,
                CutClientPrimary,
                Pair,
            ],
        }
    }
}

impl FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Fault, String> {
        Fault::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| format!("unknown nemesis {s:?}"))
    }
}

/// One injected fault.
#[derive(Debug, Clone)]
pub(crate) struct FaultRecord {
    pub(crate) fault: Fault,
    pub(crate) target: String,
    pub(crate) t0: u64,
    pub(crate) t1: u64,
    /// `false` when the fault could not be caused (a step panicked or the
    /// deployment refused); such faults are counted apart.
    pub(crate) applied: bool,
    pub(crate) note: String,
    /// For a server `SIGSTOP`: each sampled key's value and PTTL read just
    /// before the stop, with the read's send and reply times.
    pub(crate) pttl: Vec<PttlSample>,
    /// The indices of the servers killed and restarted, if any.
    pub(crate) restarted: Vec<usize>,
    /// Reads like `pttl` made for a fault that ended later than the stop
    /// (a stop in a `pair`): what the server held, without the stop's end.
    pub(crate) reads: Vec<PttlSample>,
    /// For a server `SIGSTOP`: an instant by which the stop had certainly
    /// landed (read once the signal was sent), so a command that reached the
    /// server ran before it.
    pub(crate) landed: Option<u64>,
}

/// A key's value and PTTL read on the server just before a fault.
#[derive(Debug, Clone)]
pub(crate) struct PttlSample {
    pub(crate) key: usize,
    pub(crate) value: String,
    pub(crate) pttl_ms: i64,
    pub(crate) t_b: u64,
    pub(crate) t_a: u64,
}

/// The schedule and the means to cause faults.
pub(crate) struct Nemesis {
    pub(crate) kinds: Vec<Fault>,
    pub(crate) rng: Rng,
    pub(crate) ttl_ms: u64,
    /// The physical keys whose PTTL a server stop samples first.
    pub(crate) pttl_keys: Vec<String>,
    /// Cluster only: the logical keys, to aim at their slots' primaries.
    pub(crate) slot_keys: Vec<String>,
    /// The workers' history files, to find one that holds a lease.
    pub(crate) histories: Vec<std::path::PathBuf>,
    /// `clock-step`'s range of steps, in milliseconds.
    pub(crate) clock_step_ms: (u64, u64),
}

/// Whether a worker's history ends inside a grant (its last event is the
/// grant or one of its resource operations).
fn mid_grant(file: &std::path::Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(file) else {
        return false;
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(600)));
    let mut tail = String::new();
    let _ = f.read_to_string(&mut tail);
    let last = tail.lines().last().unwrap_or_default();
    last.contains(r#""ev":"grant""#) || last.contains(r#""ev":"op""#)
}

/// Waits up to 2 s for some worker to be in the middle of a grant, so that
/// a fault aimed at holders finds one.
fn wait_for_holder(histories: &[std::path::PathBuf]) {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !histories.iter().any(|f| mid_grant(f)) && std::time::Instant::now() < deadline {
        sleep_ms(5);
    }
}

fn signal(pid: u32, sig: Signal) {
    if let Some(pid) = Pid::from_raw(pid as i32) {
        let _ = kill_process(pid, sig);
    }
}

fn sleep_ms(ms: u64) {
    thread::sleep(Duration::from_millis(ms));
}

impl Nemesis {
    /// Draws the gap before the next fault.
    pub(crate) fn gap(&mut self, lo_ms: u64, hi_ms: u64) -> Duration {
        Duration::from_millis(self.rng.range(lo_ms, hi_ms))
    }

    /// Causes one fault drawn from the mix and heals it.
    pub(crate) fn strike(&mut self, dep: &Deployment, workers: &[u32]) -> FaultRecord {
        let fault = *self.rng.pick(&self.kinds);
        let mut record = FaultRecord {
            fault,
            target: String::new(),
            t0: now_ns(),
            t1: 0,
            applied: true,
            note: String::new(),
            pttl: Vec::new(),
            restarted: Vec::new(),
            reads: Vec::new(),
            landed: None,
        };
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            self.cause(fault, dep, workers, &mut record);
        }));
        if let Err(panic) = outcome {
            record.applied = false;
            record.note = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
                .lines()
                .next()
                .unwrap_or_default()
                .to_string();
            // Whatever the step left behind, leave a healthy deployment.
            heal(dep);
        }
        record.t1 = now_ns();
        record
    }

    fn cause(&mut self, fault: Fault, dep: &Deployment, workers: &[u32], rec: &mut FaultRecord) {
        let ttl = self.ttl_ms;
        match fault {
            Fault::Kill => {
                let (i, server) = self.pick_server(dep);
                rec.target = format!("server {i}");
                rec.restarted.push(i);
                rec.t0 = now_ns();
                server.kill();
                sleep_ms(self.rng.range(0, 300));
                server.restart();
            }
            Fault::KillMajority => {
                let idx = self.majority(dep);
                rec.target = format!("servers {idx:?}");
                rec.restarted.clone_from(&idx);
                rec.t0 = now_ns();
                for &i in &idx {
                    dep.servers[i].kill();
                }
                for &i in &idx {
                    dep.servers[i].restart();
                }
            }
            Fault::RestartPausedWorker => {
                let idx = self.majority(dep);
                wait_for_holder(&self.histories);
                let w = self.holding_worker(workers.len());
                let d = self.rng.range(50, 200);
                rec.target = format!("servers {idx:?}, worker {w}");
                rec.restarted.clone_from(&idx);
                rec.t0 = now_ns();
                signal(workers[w], Signal::STOP);
                for &i in &idx {
                    dep.servers[i].kill();
                }
                for &i in &idx {
                    dep.servers[i].restart();
                }
                sleep_ms(d);
                signal(workers[w], Signal::CONT);
                rec.note = format!("worker resumed {d} ms after the restarts");
            }
            Fault::RestartPartitioned => {
                let idx = self.majority(dep);
                let d = self.rng.range(50, 200);
                wait_for_holder(&self.histories);
                rec.target = format!("servers {idx:?}");
                rec.restarted.clone_from(&idx);
                rec.t0 = now_ns();
                for &i in &idx {
                    dep.proxies[i].set_mode(Mode::Blackhole);
                }
                for &i in &idx {
                    dep.servers[i].kill();
                }
                for &i in &idx {
                    dep.servers[i].restart();
                }
                sleep_ms(d);
                for &i in &idx {
                    dep.proxies[i].set_mode(Mode::Pass);
                    dep.proxies[i].reset_all();
                }
                rec.note = format!("proxies reset {d} ms after the restarts");
            }
            Fault::Stop => {
                let (i, server) = self.pick_server(dep);
                rec.target = format!("server {i} ({})", server.port());
                // The server stopped is the one that holds the truth: the
                // standalone server, the Sentinel primary, the key's slot
                // primary (whose other keys' reads fail and are left out).
                rec.pttl = sample_pttl(server, &self.pttl_keys);
                let d = self.rng.range(ttl / 5, ttl * 2);
                rec.t0 = now_ns();
                server.pause();
                rec.landed = Some(now_ns());
                sleep_ms(d);
                server.resume();
                rec.note = format!("{d} ms");
            }
            Fault::PauseWorker => {
                // A worker in the middle of a grant, when one is: the pause
                // then falls between a guard's check and its writes.
                let i = self.holding_worker(workers.len());
                let d = self.rng.range(ttl * 3 / 2, ttl * 3);
                rec.target = format!("worker {i}");
                rec.note = format!("{d} ms");
                rec.t0 = now_ns();
                signal(workers[i], Signal::STOP);
                sleep_ms(d);
                signal(workers[i], Signal::CONT);
            }
            Fault::Delay | Fault::Blackhole | Fault::DropRequests | Fault::DropReplies => {
                let i = self.rng.range(0, dep.proxies.len() as u64 - 1) as usize;
                let proxy = &dep.proxies[i];
                let (mode, d) = match fault {
                    Fault::Delay => (
                        Mode::Delay(Duration::from_millis(self.rng.range(5, 60))),
                        self.rng.range(500, 2000),
                    ),
                    Fault::Blackhole => (Mode::Blackhole, self.rng.range(ttl / 5, ttl * 2)),
                    Fault::DropRequests => (Mode::DropClientToServer, self.rng.range(100, 1000)),
                    _ => (Mode::DropServerToClient, self.rng.range(100, 1000)),
                };
                rec.target = format!("proxy {i}");
                rec.note = format!("{mode:?} for {d} ms");
                rec.t0 = now_ns();
                proxy.set_mode(mode);
                sleep_ms(d);
                proxy.set_mode(Mode::Pass);
                if !matches!(mode, Mode::Delay(_)) {
                    // The byte streams have gaps: make the clients reconnect.
                    proxy.reset_all();
                }
            }
            Fault::ClientKill => {
                let storms = self.rng.range(5, 20);
                rec.target = "every data server".into();
                rec.note = format!("{storms} rounds");
                rec.t0 = now_ns();
                for _ in 0..storms {
                    for server in dep.data_servers() {
                        if let Ok(mut con) = quick_client(server) {
                            let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                                .arg("KILL")
                                .arg("TYPE")
                                .arg("normal")
                                .arg("SKIPME")
                                .arg("yes")
                                .query(&mut con);
                        }
                    }
                    sleep_ms(self.rng.range(20, 100));
                }
            }
            Fault::Oom => {
                let servers = dep.data_servers();
                let d = self.rng.range(200, 1000);
                rec.target = "every data server".into();
                rec.note = format!("{d} ms");
                rec.t0 = now_ns();
                for server in &servers {
                    config_set(server, "maxmemory", "1");
                }
                sleep_ms(d);
                for server in &servers {
                    config_set(server, "maxmemory", "0");
                }
            }
            Fault::Failover => {
                if let Some(s) = &dep.sentinel {
                    rec.target = format!("primary {}", s.primary_index());
                    rec.t0 = now_ns();
                    let took = s.failover();
                    rec.note = format!("switched in {} ms", took.as_millis());
                    // The demoted primary must be reconfigured before the
                    // next failover can find a good replica.
                    s.wait_replicas_of_primary(Duration::from_secs(30));
                    replicas_online(s);
                } else if let Some(c) = &dep.cluster {
                    let key = self.rng.pick(&self.slot_keys).clone();
                    let replica = c.replica_of(c.primary_for_key(&key));
                    rec.target = format!("replica {replica} (key {key})");
                    rec.t0 = now_ns();
                    let took = c.failover(replica);
                    rec.note = format!("{} ms", took.as_millis());
                }
            }
            Fault::Takeover => {
                let c = dep.cluster.as_ref().expect("cluster");
                let key = self.rng.pick(&self.slot_keys).clone();
                let replica = c.replica_of(c.primary_for_key(&key));
                rec.target = format!("replica {replica} (key {key})");
                rec.t0 = now_ns();
                let took = c.force_takeover(replica);
                rec.note = format!("{} ms", took.as_millis());
            }
            Fault::Migrate => {
                let c = dep.cluster.as_ref().expect("cluster");
                let key = self.rng.pick(&self.slot_keys).clone();
                let slot = respire_coordination::key_slot(key.as_bytes());
                let owner = c.primary_for_slot(slot);
                let others: Vec<usize> =
                    c.primaries().into_iter().filter(|&p| p != owner).collect();
                let to = *self.rng.pick(&others);
                rec.target = format!("slot {slot} {owner}→{to}");
                rec.t0 = now_ns();
                c.migrate_slot(slot, to);
            }
            Fault::KillPrimary => {
                let s = dep.sentinel.as_ref().expect("sentinel");
                let old = s.primary_index();
                rec.target = format!("primary {old}");
                rec.t0 = now_ns();
                s.server(old).kill();
                let (new, took) = s.wait_primary_other_than(old, Duration::from_secs(30));
                s.server(old).restart();
                // A restarted server has lost the users and `masteruser`.
                topo::add_users(s.server(old));
                s.wait_replicas_of_primary(Duration::from_secs(30));
                replicas_online(s);
                rec.note = format!("server {new} promoted in {} ms", took.as_millis());
            }
            Fault::CutClientSentinel => {
                assert!(!dep.sentinel_proxies.is_empty(), "no sentinel proxies");
                let d = self.rng.range(500, 3000);
                rec.target = "every sentinel proxy".into();
                rec.note = format!("{d} ms");
                rec.t0 = now_ns();
                for p in &dep.sentinel_proxies {
                    p.set_mode(Mode::Blackhole);
                }
                sleep_ms(d);
                for p in &dep.sentinel_proxies {
                    p.set_mode(Mode::Pass);
                    p.reset_all();
                }
            }
            Fault::CutSentinelPrimary => {
                let s = dep.sentinel.as_ref().expect("sentinel");
                let old = s.primary_index();
                let d = self.rng.range(500, 4000);
                rec.target = format!("sentinels | primary {old}");
                rec.t0 = now_ns();
                cut_sentinels(s.server(old), true);
                sleep_ms(d);
                cut_sentinels(s.server(old), false);
                rec.note = format!("{d} ms; {}", settle_sentinel(s, old));
            }
            Fault::CutPrimaryReplica | Fault::CutClientPrimary => {
                let (i, server) = self.pick_server(dep);
                let user = if fault == Fault::CutPrimaryReplica {
                    "replicator"
                } else {
                    "app"
                };
                let d = self.rng.range(ttl / 5, ttl * 2);
                rec.target = format!("{user} | primary {i}");
                rec.t0 = now_ns();
                assert!(topo::set_user(server, user, false), "ACL SETUSER");
                sleep_ms(d);
                topo::set_user(server, user, true);
                if user == "replicator" {
                    topo::wait_links(&dep.data_servers(), Duration::from_secs(20));
                }
                rec.note = format!("{d} ms");
            }
            Fault::Split => {
                let s = dep.sentinel.as_ref().expect("sentinel");
                let old = s.primary_index();
                let d = self.rng.range(2500, 4000);
                rec.target = format!("clients | sentinels | primary {old}");
                rec.t0 = now_ns();
                for p in &dep.sentinel_proxies {
                    p.set_mode(Mode::Blackhole);
                }
                cut_sentinels(s.server(old), true);
                sleep_ms(d);
                cut_sentinels(s.server(old), false);
                for p in &dep.sentinel_proxies {
                    p.set_mode(Mode::Pass);
                    p.reset_all();
                }
                rec.note = format!("{d} ms; {}", settle_sentinel(s, old));
            }
            Fault::Pair => {
                let singles: Vec<Fault> = self
                    .kinds
                    .iter()
                    .copied()
                    .filter(|f| *f != Fault::Pair)
                    .collect();
                assert!(singles.len() >= 2, "a pair needs two faults in the mix");
                let a = *self.rng.pick(&singles);
                let mut b = *self.rng.pick(&singles);
                // One bus cut at a time: the proxies drop one address.
                if a == Fault::CutBus && b == Fault::CutBus {
                    let rest: Vec<Fault> = singles
                        .iter()
                        .copied()
                        .filter(|f| *f != Fault::CutBus)
                        .collect();
                    b = *self.rng.pick(&rest);
                }
                // A slot migration is never paired with a fault that breaks
                // its own steps (an `oom` target refuses `MIGRATE`, a
                // `client-kill` cuts the harness's connections): the harness
                // would leave the slot half migrated, which no operator
                // leaves, and the cluster then lost a key's state in a row
                // that did so.
                let breaks = |x: Fault, y: Fault| {
                    x == Fault::Migrate && matches!(y, Fault::Oom | Fault::ClientKill)
                };
                if breaks(a, b) || breaks(b, a) {
                    let rest: Vec<Fault> = singles
                        .iter()
                        .copied()
                        .filter(|f| !matches!(f, Fault::Migrate | Fault::Oom | Fault::ClientKill))
                        .collect();
                    if !rest.is_empty() {
                        b = *self.rng.pick(&rest);
                    }
                }
                let lag = self.rng.range(0, 300);
                let mut other = Nemesis {
                    kinds: self.kinds.clone(),
                    rng: Rng::derive(self.rng.next_u64(), 2),
                    ttl_ms: self.ttl_ms,
                    pttl_keys: self.pttl_keys.clone(),
                    slot_keys: self.slot_keys.clone(),
                    histories: self.histories.clone(),
                    clock_step_ms: self.clock_step_ms,
                };
                let mut rec_a = rec.clone();
                let mut rec_b = rec.clone();
                // Named before they run: a step that fails leaves the pair
                // recorded as not applied, with its kinds.
                rec.target = format!("{} + {}", a.name(), b.name());
                rec.t0 = now_ns();
                thread::scope(|scope| {
                    let first = scope.spawn(|| other.cause(a, dep, workers, &mut rec_a));
                    sleep_ms(lag);
                    self.cause(b, dep, workers, &mut rec_b);
                    if let Err(panic) = first.join() {
                        std::panic::resume_unwind(panic);
                    }
                });
                rec.target = format!(
                    "{} {} + {} {}",
                    a.name(),
                    rec_a.target,
                    b.name(),
                    rec_b.target
                );
                rec.note = format!("{} / {} ms later: {}", rec_a.note, lag, rec_b.note);
                // The pair ends after the stop's resume: the stop's reads
                // are kept, but not as a stop's.
                rec.reads = [rec_a.pttl, rec_a.reads, rec_b.pttl, rec_b.reads].concat();
                rec.restarted = rec_a.restarted.into_iter().chain(rec_b.restarted).collect();
            }
            Fault::ClockStep => {
                assert!(
                    !dep.clock_files.is_empty(),
                    "clock-step needs --server-clock faketime"
                );
                let i = self.rng.range(0, dep.clock_files.len() as u64 - 1) as usize;
                let file = &dep.clock_files[i];
                let step = self.rng.range(self.clock_step_ms.0, self.clock_step_ms.1);
                // The offset, then the rate the clock runs at, which must
                // stay: libfaketime applies it from the server's start.
                let text = std::fs::read_to_string(file).unwrap_or_default();
                let mut parts = text.split_whitespace();
                let was: f64 = parts
                    .next()
                    .and_then(|t| t.trim_start_matches('+').parse().ok())
                    .unwrap_or(0.0);
                let rate: String = parts.map(|p| format!(" {p}")).collect();
                let now = was + step as f64 / 1000.0;
                rec.target = format!("server {i}");
                rec.note = format!("+{step} ms (+{now:.3} s in all)");
                rec.t0 = now_ns();
                std::fs::write(file, format!("+{now:.3}{rate}"))
                    .expect("write the faketime offset");
            }
            Fault::CutBus => {
                let c = dep.cluster.as_ref().expect("cluster");
                assert!(
                    !c.bus_proxies().is_empty(),
                    "cut-bus needs the cluster's bus proxies"
                );
                let key = self.rng.pick(&self.slot_keys).clone();
                let i = c.primary_for_key(&key);
                let replica = c.replica_of(i);
                let d = self.rng.range(1500, 6000);
                rec.target = format!("bus | primary {i} (key {key})");
                rec.t0 = now_ns();
                c.bus_proxy(i).set_mode(Mode::Blackhole);
                for (j, p) in c.bus_proxies().iter().enumerate() {
                    if j != i {
                        p.blackhole_from(Some(topo::bus_source(i)));
                    }
                }
                sleep_ms(d);
                mend_bus(dep);
                c.wait_healthy();
                let now = c.primary_for_key(&key);
                rec.note = if now == i {
                    format!("{d} ms; no switch")
                } else if now == replica {
                    format!("{d} ms; replica {now} promoted")
                } else {
                    format!("{d} ms; node {now} serves the key")
                };
            }
            Fault::UnreplicatedFailover => {
                let s = dep.sentinel.as_ref().expect("sentinel");
                rec.target = format!("primary {}", s.primary_index());
                rec.t0 = now_ns();
                // The sentinels reach the replica as `sentinel`: a hello
                // `PUBLISH` held back by the pause would queue the promotion
                // behind it, so it is refused as the harness refuses the
                // default user's.
                let paused = s.replica();
                assert!(
                    topo::acl(paused, &["sentinel", "-publish"]),
                    "ACL SETUSER sentinel -publish"
                );
                let replica = s.pause_replica_writes(Duration::from_secs(10));
                // Grants made now reach the primary alone.
                sleep_ms(self.rng.range(300, 800));
                let took = s.failover();
                s.unpause_replica(replica);
                topo::acl(s.server(replica), &["sentinel", "+publish"]);
                rec.note = format!("switched in {} ms", took.as_millis());
                s.wait_replicas_of_primary(Duration::from_secs(30));
                replicas_online(s);
            }
        }
    }

    /// A majority of the Redlock nodes, drawn at random.
    fn majority(&mut self, dep: &Deployment) -> Vec<usize> {
        let n = dep.servers.len();
        let mut idx: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            idx.swap(i, self.rng.range(0, i as u64) as usize);
        }
        idx.truncate(n / 2 + 1);
        idx
    }

    /// A worker in the middle of a grant, when one is; any worker otherwise.
    fn holding_worker(&mut self, workers: usize) -> usize {
        let holding: Vec<usize> = (0..workers)
            .filter(|&i| self.histories.get(i).is_some_and(|f| mid_grant(f)))
            .collect();
        if holding.is_empty() {
            self.rng.range(0, workers as u64 - 1) as usize
        } else {
            *self.rng.pick(&holding)
        }
    }

    fn pick_server<'a>(&mut self, dep: &'a Deployment) -> (usize, &'a TestServer) {
        if let Some(s) = &dep.sentinel {
            let i = s.primary_index();
            return (i, s.server(i));
        }
        if let Some(c) = &dep.cluster {
            let key = self.rng.pick(&self.slot_keys).clone();
            let i = c.primary_for_key(&key);
            return (i, c.node(i));
        }
        let i = self.rng.range(0, dep.servers.len() as u64 - 1) as usize;
        (i, &dep.servers[i])
    }
}

/// Cuts (or mends) the sentinels' links to `server`: their user and the
/// default user, which they fall back to, switched off.
fn cut_sentinels(server: &TestServer, cut: bool) {
    for user in ["sentinel", "default"] {
        assert!(topo::set_user(server, user, !cut), "ACL SETUSER {user}");
    }
}

/// Waits up to 30 s until every replica's link to its primary is up again
/// (a demoted primary resynchronising as a replica acknowledges nothing
/// until then): a switch ends when the deployment can acknowledge grants.
fn replicas_online(s: &crate::support::TestSentinel) {
    let servers: Vec<&TestServer> = s.servers().iter().collect();
    topo::wait_links(&servers, Duration::from_secs(30));
}

/// After a cut of the sentinels' links to primary `old`: waits for the
/// deployment to settle (the old primary a replica again if it was
/// replaced), and says what happened.
fn settle_sentinel(s: &crate::support::TestSentinel, old: usize) -> String {
    let now = s.primary_index();
    s.wait_replicas_of_primary(Duration::from_secs(30));
    replicas_online(s);
    if now == old {
        "no switch".into()
    } else {
        format!("server {now} promoted")
    }
}

/// Ends a bus cut: every bus proxy forwards again, from every address, and
/// resets its connections (their byte streams have gaps).
fn mend_bus(dep: &Deployment) {
    let Some(c) = &dep.cluster else { return };
    for p in c.bus_proxies() {
        p.blackhole_from(None);
        p.set_mode(Mode::Pass);
        p.reset_all();
    }
}

/// Undoes whatever a failed step may have left: resumes every server,
/// resets the proxies, switches the users back on, lifts `maxmemory`.
pub(crate) fn heal(dep: &Deployment) {
    if dep
        .cluster
        .as_ref()
        .is_some_and(|c| !c.bus_proxies().is_empty())
    {
        mend_bus(dep);
    }
    for proxy in &dep.sentinel_proxies {
        proxy.set_mode(Mode::Pass);
    }
    if dep.sentinel.is_some() || dep.cluster.is_some() {
        for server in dep.data_servers() {
            for user in ["default", "app", "sentinel", "replicator"] {
                topo::set_user(server, user, true);
            }
        }
    }
    for server in dep.data_servers() {
        signal(server.pid(), Signal::CONT);
    }
    for proxy in &dep.proxies {
        proxy.set_mode(Mode::Pass);
    }
    for server in dep.data_servers() {
        config_set(server, "maxmemory", "0");
    }
}

fn quick_client(server: &TestServer) -> redis::RedisResult<redis::Connection> {
    topo::admin(server)
}

fn config_set(server: &TestServer, name: &str, value: &str) {
    if let Ok(mut con) = quick_client(server) {
        let _: redis::RedisResult<()> = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut con);
    }
}

/// Each key's value and PTTL, read in one script on a direct connection.
fn sample_pttl(server: &TestServer, keys: &[String]) -> Vec<PttlSample> {
    let Ok(mut con) = quick_client(server) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let t_b = now_ns();
        let reply: redis::RedisResult<(String, i64)> = redis::Script::new(
            "return {redis.call('GET', KEYS[1]) or '', redis.call('PTTL', KEYS[1])}",
        )
        .key(key)
        .invoke(&mut con);
        let t_a = now_ns();
        if let Ok((value, pttl_ms)) = reply
            && pttl_ms > 0
        {
            out.push(PttlSample {
                key: i,
                value,
                pttl_ms,
                t_b,
                t_a,
            });
        }
    }
    out
}
