//! What a run is: topology, workload, nemesis mix, negative control, and the
//! options passed on to each worker process.

use std::fmt;
use std::str::FromStr;

use serde_json::{Value, json};

/// The deployment the primitives run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Topology {
    /// One server; `aof`: `appendonly yes`, `appendfsync always`.
    Standalone { aof: bool },
    /// Independent servers for `RedlockGroup`, without persistence.
    Redlock { nodes: usize },
    /// Primary + replica (or several: `campaign run --replicas`) + 3
    /// sentinels.
    Sentinel,
    /// 3 primaries with a replica each.
    Cluster,
}

impl FromStr for Topology {
    type Err = String;
    fn from_str(s: &str) -> Result<Topology, String> {
        Ok(match s {
            "standalone" => Topology::Standalone { aof: false },
            "standalone-aof" => Topology::Standalone { aof: true },
            "redlock3" => Topology::Redlock { nodes: 3 },
            "redlock5" => Topology::Redlock { nodes: 5 },
            "sentinel" => Topology::Sentinel,
            "cluster" => Topology::Cluster,
            _ => {
                return Err(format!(
                    "unknown topology {s:?} (standalone, standalone-aof, redlock3, redlock5, sentinel, cluster)"
                ));
            }
        })
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Topology::Standalone { aof: false } => f.write_str("standalone"),
            Topology::Standalone { aof: true } => f.write_str("standalone-aof"),
            Topology::Redlock { nodes } => write!(f, "redlock{nodes}"),
            Topology::Sentinel => f.write_str("sentinel"),
            Topology::Cluster => f.write_str("cluster"),
        }
    }
}

/// The primitive the workers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Workload {
    Lock,
    Fenced,
    Rw,
    Semaphore,
    Redlock,
    /// `Election`: campaign, lead, resign or let the lease expire; every
    /// worker also follows the leader with `observe()`.
    Election,
    /// `fenced_lock_all`: each grant a random non-empty subset of the keys,
    /// taken together; one history grant per key of the set.
    Multi,
    /// `lock_all`: as `Multi`, without fencing tokens (the resource gets 0).
    LockAll,
}

impl FromStr for Workload {
    type Err = String;
    fn from_str(s: &str) -> Result<Workload, String> {
        Ok(match s {
            "lock" => Workload::Lock,
            "fenced" => Workload::Fenced,
            "rw" => Workload::Rw,
            "semaphore" => Workload::Semaphore,
            "redlock" => Workload::Redlock,
            "election" => Workload::Election,
            "multi" => Workload::Multi,
            "lock-all" => Workload::LockAll,
            _ => {
                return Err(format!(
                    "unknown workload {s:?} (lock, fenced, rw, semaphore, redlock, election, multi, lock-all)"
                ));
            }
        })
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Workload::Lock => "lock",
            Workload::Fenced => "fenced",
            Workload::Rw => "rw",
            Workload::Semaphore => "semaphore",
            Workload::Redlock => "redlock",
            Workload::Election => "election",
            Workload::Multi => "multi",
            Workload::LockAll => "lock-all",
        })
    }
}

/// A configuration whose documented model allows a violation, run to show
/// that the checkers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Control {
    /// A plain `Lock`, workers paused longer than the TTL between the read
    /// and the write of the resource.
    PlainPause,
    /// Redlock without persistence and without `restart_delay`, a majority
    /// of nodes killed and restarted at once.
    RedlockRestart,
    /// Sentinel with `Replication::Off`, the replica's writes paused, then a
    /// failover that loses the grants it never received.
    SentinelUnreplicated,
    /// Workers that ignore `is_lost()` and vouch for their whole hold (a
    /// planted bug in the client, standing in for a library whose loss
    /// signal never fires), servers stopped longer than the TTL.
    IgnoreLoss,
    /// A standalone server without persistence killed and restarted while
    /// guards are kept alive: it forgets every lease and the fence counter.
    RestartNoAof,
    /// Elections on a standalone server without persistence, killed and
    /// restarted (terms start again from 1), followed by a planted client
    /// bug: followers that poll `leader()` and report what it reads,
    /// without `observe()`'s refusal to go back in term.
    PollFollower,
    /// Sets taken together (`multi` or `lock-all`) with a planted client
    /// bug: workers that leave the last key of each set out of the request
    /// but record the set whole, as if the guard held it.
    PartialGuard,
    /// A standalone server's wall clock (Valkey under libfaketime) stepped
    /// forward by 1-2 TTLs: its keys expire at once, before any renewal
    /// pipeline can read the step.
    ClockJump,
    /// A planted client bug: one worker leaks every guard it is granted
    /// with its keep-alive running (never released, never vouched for in
    /// the history), so each key it takes is never granted again.
    Hoarder,
}

impl FromStr for Control {
    type Err = String;
    fn from_str(s: &str) -> Result<Control, String> {
        Ok(match s {
            "plain-pause" => Control::PlainPause,
            "redlock-restart" => Control::RedlockRestart,
            "sentinel-unreplicated" => Control::SentinelUnreplicated,
            "ignore-loss" => Control::IgnoreLoss,
            "restart-no-aof" => Control::RestartNoAof,
            "poll-follower" => Control::PollFollower,
            "partial-guard" => Control::PartialGuard,
            "clock-jump" => Control::ClockJump,
            "hoarder" => Control::Hoarder,
            _ => {
                return Err(format!(
                    "unknown control {s:?} (plain-pause, redlock-restart, sentinel-unreplicated, ignore-loss, restart-no-aof, poll-follower, partial-guard, clock-jump, hoarder)"
                ));
            }
        })
    }
}

impl fmt::Display for Control {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Control::PlainPause => "plain-pause",
            Control::RedlockRestart => "redlock-restart",
            Control::SentinelUnreplicated => "sentinel-unreplicated",
            Control::IgnoreLoss => "ignore-loss",
            Control::RestartNoAof => "restart-no-aof",
            Control::PollFollower => "poll-follower",
            Control::PartialGuard => "partial-guard",
            Control::ClockJump => "clock-jump",
            Control::Hoarder => "hoarder",
        })
    }
}

/// How a worker reaches the deployment.
#[derive(Debug, Clone)]
pub(crate) enum Connect {
    Standalone(String),
    Sentinel {
        sentinels: Vec<String>,
        service: String,
    },
    Cluster(Vec<String>),
    Redlock(Vec<String>),
}

/// Everything one worker process needs, passed as JSON in `CAMPAIGN_WORKER`.
#[derive(Debug, Clone)]
pub(crate) struct WorkerSpec {
    pub(crate) id: u64,
    pub(crate) seed: u64,
    pub(crate) workload: Workload,
    pub(crate) connect: Connect,
    pub(crate) resource: String,
    pub(crate) keys: Vec<String>,
    pub(crate) prefix: String,
    pub(crate) ttl_ms: u64,
    pub(crate) node_timeout_ms: u64,
    /// `None`: `Replication::Off`; `Some(n)`: `Require { replicas: n }`.
    pub(crate) require_replicas: Option<u32>,
    pub(crate) restart_delay_ms: Option<u64>,
    pub(crate) capacity: u32,
    pub(crate) keep_alive_pct: u64,
    /// Percentage of grants held with a keep-alive for 3-5 TTLs.
    pub(crate) long_hold_pct: u64,
    /// Percentage of grants that call `verify_still_held` (a leader:
    /// `proclaim`) once while held.
    pub(crate) verify_pct: u64,
    /// Percentage of grants that call `reset_expiry` (Redlock: `extend`)
    /// once while held, with a TTL of 0.5-2 times the lease's.
    pub(crate) reset_pct: u64,
    /// `Lock` handles with `Fairness::Fifo`.
    pub(crate) fifo: bool,
    /// Milliseconds between the fenced read and the write, at most.
    pub(crate) think_ms: u64,
    /// Percentage of leaderships that let the lease expire instead of
    /// resigning.
    pub(crate) expire_pct: u64,
    /// The planted bug of [`Control::IgnoreLoss`].
    pub(crate) ignore_loss: bool,
    /// The planted bug of [`Control::PollFollower`].
    pub(crate) poll_follower: bool,
    /// The planted bug of [`Control::PartialGuard`].
    pub(crate) plant_partial: bool,
    /// The planted bug of [`Control::Hoarder`] (one worker only).
    pub(crate) hoard: bool,
    /// Semaphores: the capacities `set_capacity` draws from (inclusive),
    /// and the percentage of this worker's rounds that call it once per
    /// key before acquiring; `None`: never.
    pub(crate) set_capacity: Option<(u32, u32, u64)>,
    pub(crate) out: String,
}

impl WorkerSpec {
    pub(crate) fn to_json(&self) -> String {
        let (kind, urls, service) = match &self.connect {
            Connect::Standalone(url) => ("standalone", vec![url.clone()], String::new()),
            Connect::Sentinel { sentinels, service } => {
                ("sentinel", sentinels.clone(), service.clone())
            }
            Connect::Cluster(urls) => ("cluster", urls.clone(), String::new()),
            Connect::Redlock(urls) => ("redlock", urls.clone(), String::new()),
        };
        json!({
            "id": self.id, "seed": self.seed, "workload": self.workload.to_string(),
            "kind": kind, "urls": urls, "service": service, "resource": self.resource,
            "keys": self.keys, "prefix": self.prefix, "ttl_ms": self.ttl_ms,
            "node_timeout_ms": self.node_timeout_ms, "require_replicas": self.require_replicas,
            "restart_delay_ms": self.restart_delay_ms, "capacity": self.capacity,
            "keep_alive_pct": self.keep_alive_pct, "long_hold_pct": self.long_hold_pct,
            "verify_pct": self.verify_pct, "reset_pct": self.reset_pct, "fifo": self.fifo,
            "think_ms": self.think_ms, "out": self.out,
            "expire_pct": self.expire_pct,
            "ignore_loss": self.ignore_loss, "poll_follower": self.poll_follower,
            "plant_partial": self.plant_partial, "hoard": self.hoard,
            "set_capacity": self.set_capacity.map(|(lo, hi, pct)| [u64::from(lo), u64::from(hi), pct]),
        })
        .to_string()
    }

    pub(crate) fn from_json(text: &str) -> Result<WorkerSpec, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
        let n = |k: &str| v[k].as_u64().unwrap_or_default();
        let list = |k: &str| -> Vec<String> {
            v[k].as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default()
        };
        let urls = list("urls");
        let connect = match v["kind"].as_str() {
            Some("standalone") => Connect::Standalone(urls.first().cloned().unwrap_or_default()),
            Some("sentinel") => Connect::Sentinel {
                sentinels: urls,
                service: s("service"),
            },
            Some("cluster") => Connect::Cluster(urls),
            Some("redlock") => Connect::Redlock(urls),
            other => return Err(format!("bad worker kind {other:?}")),
        };
        Ok(WorkerSpec {
            id: n("id"),
            seed: n("seed"),
            workload: s("workload").parse()?,
            connect,
            resource: s("resource"),
            keys: list("keys"),
            prefix: s("prefix"),
            ttl_ms: n("ttl_ms"),
            node_timeout_ms: n("node_timeout_ms"),
            require_replicas: v["require_replicas"].as_u64().map(|x| x as u32),
            restart_delay_ms: v["restart_delay_ms"].as_u64(),
            capacity: n("capacity") as u32,
            keep_alive_pct: n("keep_alive_pct"),
            long_hold_pct: n("long_hold_pct"),
            verify_pct: n("verify_pct"),
            reset_pct: n("reset_pct"),
            fifo: v["fifo"].as_bool().unwrap_or(false),
            think_ms: n("think_ms"),
            expire_pct: n("expire_pct"),
            ignore_loss: v["ignore_loss"].as_bool().unwrap_or(false),
            poll_follower: v["poll_follower"].as_bool().unwrap_or(false),
            plant_partial: v["plant_partial"].as_bool().unwrap_or(false),
            hoard: v["hoard"].as_bool().unwrap_or(false),
            set_capacity: v["set_capacity"]
                .as_array()
                .and_then(|a| match a.as_slice() {
                    [lo, hi, pct] => {
                        Some((lo.as_u64()? as u32, hi.as_u64()? as u32, pct.as_u64()?))
                    }
                    _ => None,
                }),
            out: s("out"),
        })
    }
}

/// Physical key names for a logical key `k` (the key prefix included), as the
/// library lays them out (DESIGN §3); the sampler reads these.
pub(crate) fn lease_key(workload: Workload, prefix: &str, k: &str) -> String {
    match workload {
        Workload::Lock | Workload::Redlock | Workload::LockAll => format!("{prefix}{{{k}}}lock"),
        Workload::Fenced | Workload::Multi => format!("{prefix}{{{k}}}lease"),
        Workload::Rw => format!("{prefix}{{{k}}}rw:w"),
        Workload::Semaphore => format!("{prefix}{{{k}}}sem:permits"),
        Workload::Election => format!("{prefix}{}:leader", election_name(k)),
    }
}

/// The election a worker campaigns in for logical key `k`.
pub(crate) fn election_name(k: &str) -> String {
    format!("{{{k}}}election")
}
