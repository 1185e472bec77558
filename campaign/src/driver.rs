//! `campaign run`: starts the servers and the workers, strikes faults on the
//! seeded schedule for the run's duration, then checks the histories and
//! prints one summary (a JSON line, and a text report).

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::check::{self, Findings};
use crate::clock::now_ns;
use crate::history;
use crate::nemesis::{self, Fault, FaultRecord, Nemesis};
use crate::resource;
use crate::rng::Rng;
use crate::sampler::{Sampler, Source};
use crate::spec::{self, Control, Topology, WorkerSpec, Workload};
use crate::support::TestServer;
use crate::topo::Deployment;

pub(crate) const USAGE: &str = "\
campaign run --topology T --workload W [options]
  --topology    standalone | standalone-aof | redlock3 | redlock5 | sentinel | cluster
  --workload    lock | fenced | rw | semaphore | redlock | election | multi |
                lock-all
  --seed N          the schedule's seed (default 1)
  --duration D      campaign time, e.g. 30s or 2m (default 30s)
  --nemesis LIST    mix (default: every fault of the topology), none, or a
                    comma list of: kill kill-majority restart-paused-worker
                    restart-partitioned stop pause-worker delay
                    blackhole drop-requests drop-replies client-kill oom
                    failover kill-primary takeover migrate unreplicated-failover
                    cut-client-sentinel cut-sentinel-primary (Sentinel)
                    cut-primary-replica cut-client-primary (Sentinel, Cluster)
                    cut-bus (Cluster; its bus then runs through proxies)
                    split (Sentinel) pair (two of the row's mix at once)
                    clock-step (--server-clock faketime)
  --control C       a negative control: plain-pause | redlock-restart |
                    sentinel-unreplicated | ignore-loss | restart-no-aof |
                    poll-follower | partial-guard | clock-jump | hoarder (sets the
                    options and the nemesis, and the workload unless given;
                    the checkers must find a violation)
  --workers N       worker processes (default 12; 4 for controls)
  --keys N          keys the workers share (default 6; for controls 2, 3 for
                    partial-guard, and 1 for ignore-loss, restart-no-aof and
                    poll-follower)
  --ttl-ms N        lease TTL (default 600; 2000 for redlock-restart)
  --node-timeout-ms N  (default 100)
  --capacity N      semaphore capacity (default 2)
  --set-capacity LO-HI  semaphores: worker 0 calls set_capacity with a
                    capacity drawn from LO-HI (which holds --capacity) on one
                    key in --set-capacity-pct of its rounds; a worker refused
                    with CapacityMismatch takes the stored capacity. The
                    capacity checker judges against HI. Default: off
  --set-capacity-pct N  (default 5)
  --require-replicas N  Replication::Require on Sentinel (default 1 there; 0 = Off)
  --replicas N      Sentinel: replicas of the primary (default 1; with more
                    replicas than --require-replicas the model lets a failover
                    promote a replica that did not acknowledge a grant)
  --publish-period-ms N, --info-period-ms N
                    Sentinel: SENTINEL DEBUG publish-period / info-period
                    (default Sentinel's, 2000 and 10000); a demoted primary is
                    reconfigured at the first INFO at least 4 publish periods
                    after the switch
  --restart-delay-ms N  Redlock restart_delay (default: the TTL; 0 = None)
  --gap-ms LO-HI    pause between faults (default 300-1500; 200-600 for controls)
  --keep-alive-pct N  grants held past the TTL with keep_alive (default 1; 3
                    for controls, 50 for ignore-loss, restart-no-aof and
                    redlock-restart)
  --expire-pct N    grants (elections: leaderships) that let the lease
                    expire instead of releasing it: the holder vouches every
                    5 ms until is_lost() (default 5; 0 with clock-step, whose
                    steps a lease nobody renews cannot see; for controls 20
                    on the election, 0 otherwise)
  --long-hold-pct N  grants held with a keep-alive for 3-5 TTLs (6-10
                    renewals; default 2; 0 for controls)
  --verify-pct N    grants that call verify_still_held (a leader: proclaim)
                    once while held (default 10; 0 for controls)
  --reset-pct N     grants that call reset_expiry (Redlock: extend) once
                    while held, with a TTL of 0.5-2 TTLs (default 10; 0 for
                    controls)
  --fairness F      the lock workload's Fairness: barging (default) or fifo
  --server-clock C  real (default) or faketime: standalone and Redlock
                    servers run Valkey 8.1 under libfaketime, whose wall
                    clock clock-step moves
  --server-clock-rate R  with faketime: the servers' clocks run R times as
                    fast as real time from their start (default 1; the
                    library's drift allowance covers up to 1.01)
  --clock-step-ms LO-HI  clock-step's steps (default 0.05-0.25 TTLs; 1-2
                    TTLs for the clock-jump control)
  --think-ms N      most time between a grant's fenced read and its write
                    (default 8; 60 for the plain-pause control)
  --liveness-ttls N  after a fault ends (no other under way, none starting
                    for the window), every key must be granted again within
                    N TTLs; the run's last N TTLs (at most a third of it)
                    strike no fault, and it runs on until N TTLs after the
                    last fault ended (default 5; 0, and every negative
                    control but hoarder: not judged, no quiet end)
  --out DIR         histories and summary (default: a temporary directory)
  --json            print only the summary line";

/// A run's options.
#[derive(Debug, Clone)]
pub(crate) struct RunConfig {
    pub(crate) topology: Topology,
    pub(crate) workload: Workload,
    pub(crate) seed: u64,
    pub(crate) duration: Duration,
    pub(crate) nemesis: Vec<Fault>,
    pub(crate) nemesis_arg: String,
    pub(crate) control: Option<Control>,
    pub(crate) workers: u64,
    pub(crate) keys: u64,
    /// Sentinel: how many replicas the primary has.
    pub(crate) replicas: usize,
    /// Sentinel: `SENTINEL DEBUG` parameters.
    pub(crate) sentinel_debug: Vec<(&'static str, u64)>,
    pub(crate) ttl_ms: u64,
    pub(crate) node_timeout_ms: u64,
    pub(crate) capacity: u32,
    pub(crate) require_replicas: Option<u32>,
    pub(crate) restart_delay_ms: Option<u64>,
    pub(crate) gap: (u64, u64),
    pub(crate) think_ms: u64,
    pub(crate) keep_alive_pct: u64,
    pub(crate) long_hold_pct: u64,
    pub(crate) verify_pct: u64,
    pub(crate) reset_pct: u64,
    pub(crate) fifo: bool,
    /// Standalone and Redlock servers run Valkey under libfaketime.
    pub(crate) faketime: bool,
    /// `clock-step`'s range of steps, in milliseconds.
    pub(crate) clock_step_ms: (u64, u64),
    /// With `faketime`: how fast the servers' clocks run (1.0: real time).
    pub(crate) server_clock_rate: f64,
    pub(crate) expire_pct: u64,
    /// `liveness`'s window in TTLs; 0: not judged.
    pub(crate) liveness_ttls: u64,
    /// `--set-capacity LO-HI` and `--set-capacity-pct`.
    pub(crate) set_capacity: Option<(u32, u32, u64)>,
    pub(crate) out: Option<PathBuf>,
    pub(crate) json_only: bool,
    pub(crate) args: Vec<String>,
}

fn duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num.parse().map_err(|_| format!("bad duration {s:?}"))?;
    Ok(match unit {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        _ => return Err(format!("bad duration {s:?}")),
    })
}

pub(crate) fn parse(args: &[String]) -> Result<RunConfig, String> {
    let mut opts: BTreeMap<String, String> = BTreeMap::new();
    let mut json_only = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => json_only = true,
            "-h" | "--help" => return Err(USAGE.to_string()),
            flag if flag.starts_with("--") => {
                let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
                opts.insert(flag[2..].to_string(), v.clone());
            }
            other => return Err(format!("unexpected argument {other:?}\n{USAGE}")),
        }
    }
    let get = |k: &str| opts.get(k).cloned();
    let num = |k: &str, d: u64| -> Result<u64, String> {
        get(k).map_or(Ok(d), |v| {
            v.parse().map_err(|_| format!("--{k}: not a number"))
        })
    };
    let control: Option<Control> = get("control").map(|c| c.parse()).transpose()?;
    let (mut topology, mut workload): (Option<Topology>, Option<Workload>) = (
        get("topology").map(|t| t.parse()).transpose()?,
        get("workload").map(|w| w.parse()).transpose()?,
    );
    let mut nemesis_arg = get("nemesis").unwrap_or_else(|| "mix".into());
    let mut require = None;
    let mut restart_delay_default = true;
    let mut server_clock = get("server-clock");
    match control {
        Some(Control::PlainPause) => {
            topology.get_or_insert(Topology::Standalone { aof: true });
            workload = Some(Workload::Lock);
            nemesis_arg = "pause-worker".into();
        }
        Some(Control::RedlockRestart) => {
            topology.get_or_insert(Topology::Redlock { nodes: 3 });
            workload = Some(Workload::Redlock);
            nemesis_arg = "restart-paused-worker,restart-partitioned".into();
            restart_delay_default = false;
        }
        Some(Control::SentinelUnreplicated) => {
            topology = Some(Topology::Sentinel);
            workload.get_or_insert(Workload::Fenced);
            nemesis_arg = "unreplicated-failover".into();
            require = Some(0);
        }
        Some(Control::RestartNoAof) => {
            topology = Some(Topology::Standalone { aof: false });
            workload.get_or_insert(Workload::Fenced);
            nemesis_arg = "kill".into();
        }
        Some(Control::IgnoreLoss) => {
            topology.get_or_insert(Topology::Standalone { aof: true });
            workload.get_or_insert(Workload::Fenced);
            nemesis_arg = "stop".into();
        }
        Some(Control::PollFollower) => {
            topology = Some(Topology::Standalone { aof: false });
            workload = Some(Workload::Election);
            nemesis_arg = "kill".into();
        }
        Some(Control::ClockJump) => {
            topology.get_or_insert(Topology::Standalone { aof: true });
            workload.get_or_insert(Workload::Fenced);
            nemesis_arg = "clock-step".into();
            server_clock = Some("faketime".to_string());
        }
        Some(Control::Hoarder) => {
            topology.get_or_insert(Topology::Standalone { aof: true });
            // Exclusive leases only: a hoarded reader or permit leaves the
            // key to other readers or permits.
            if !matches!(
                workload.get_or_insert(Workload::Fenced),
                Workload::Lock | Workload::Fenced | Workload::Election
            ) {
                return Err("the hoarder control runs lock, fenced or election".into());
            }
            nemesis_arg = "client-kill".into();
        }
        Some(Control::PartialGuard) => {
            topology.get_or_insert(Topology::Standalone { aof: true });
            if !matches!(
                workload.get_or_insert(Workload::Multi),
                Workload::Multi | Workload::LockAll
            ) {
                return Err("the partial-guard control runs multi or lock-all".into());
            }
            nemesis_arg = "none".into();
        }
        None => {}
    }
    let topology = topology.ok_or_else(|| format!("--topology is required\n{USAGE}"))?;
    let workload = workload.ok_or_else(|| format!("--workload is required\n{USAGE}"))?;
    match (topology, workload) {
        (Topology::Redlock { .. }, Workload::Redlock) => {}
        (Topology::Redlock { .. }, _) | (_, Workload::Redlock) => {
            return Err("the redlock workload runs on redlock3 or redlock5, and only it".into());
        }
        _ => {}
    }
    let nemesis = match nemesis_arg.as_str() {
        "mix" => Fault::mix(topology),
        "none" => Vec::new(),
        list => list
            .split(',')
            .map(|s| s.trim().parse())
            .collect::<Result<Vec<_>, _>>()?,
    };
    let steps = nemesis.contains(&Fault::ClockStep);
    // The restart control's TTL outlasts a majority's restarts on a loaded
    // machine, so that a holder that did not see them still has time left.
    let ttl_ms = num(
        "ttl-ms",
        if control == Some(Control::RedlockRestart) {
            2000
        } else {
            600
        },
    )?;
    let require_replicas = match (
        topology,
        get("require-replicas").or(require.map(|r: u32| r.to_string())),
    ) {
        (Topology::Sentinel, None) => Some(1),
        (Topology::Sentinel, Some(v)) => match v
            .parse::<u32>()
            .map_err(|_| "--require-replicas: not a number")?
        {
            0 => None,
            n => Some(n),
        },
        _ => None,
    };
    let restart_delay_ms = match (topology, get("restart-delay-ms")) {
        (Topology::Redlock { .. }, None) if restart_delay_default => Some(ttl_ms),
        (Topology::Redlock { .. }, Some(v)) => match v
            .parse::<u64>()
            .map_err(|_| "--restart-delay-ms: not a number")?
        {
            0 => None,
            n => Some(n),
        },
        _ => None,
    };
    let replicas = match (topology, get("replicas")) {
        (_, None) => 1,
        (Topology::Sentinel, Some(v)) => match v.parse::<usize>() {
            Ok(n) if n >= 1 => n,
            _ => return Err("--replicas: a number of at least 1".into()),
        },
        (_, Some(_)) => return Err("--replicas is for the sentinel topology".into()),
    };
    if replicas > 1 && nemesis.contains(&Fault::UnreplicatedFailover) {
        return Err(
            "unreplicated-failover pauses the one replica: it runs with --replicas 1".into(),
        );
    }
    let mut sentinel_debug = Vec::new();
    for (option, param) in [
        ("publish-period-ms", "publish-period"),
        ("info-period-ms", "info-period"),
    ] {
        if let Some(v) = get(option) {
            if topology != Topology::Sentinel {
                return Err(format!("--{option} is for the sentinel topology"));
            }
            let ms = v
                .parse::<u64>()
                .ok()
                .filter(|&ms| ms > 0)
                .ok_or_else(|| format!("--{option}: a number of milliseconds above 0"))?;
            sentinel_debug.push((param, ms));
        }
    }
    let capacity = num("capacity", 2)? as u32;
    let set_capacity = match get("set-capacity") {
        None => None,
        Some(_) if workload != Workload::Semaphore => {
            return Err("--set-capacity is for the semaphore workload".into());
        }
        Some(range) => {
            let parsed = range
                .split_once('-')
                .and_then(|(lo, hi)| Some((lo.parse::<u32>().ok()?, hi.parse::<u32>().ok()?)));
            match parsed {
                Some((lo, hi)) if 1 <= lo && lo <= capacity && capacity <= hi && hi <= 10_000 => {
                    Some((lo, hi, num("set-capacity-pct", 5)?))
                }
                _ => {
                    return Err(format!(
                        "--set-capacity LO-HI: 1 <= LO <= --capacity ({capacity}) <= HI <= 10000"
                    ));
                }
            }
        }
    };
    let gap = match get("gap-ms") {
        None if control.is_some() => (200, 600),
        None => (300, 1500),
        Some(g) => {
            let (lo, hi) = g.split_once('-').ok_or("--gap-ms LO-HI")?;
            (
                lo.parse().map_err(|_| "--gap-ms")?,
                hi.parse().map_err(|_| "--gap-ms")?,
            )
        }
    };
    Ok(RunConfig {
        topology,
        workload,
        seed: num("seed", 1)?,
        duration: duration(&get("duration").unwrap_or_else(|| "30s".into()))?,
        nemesis,
        nemesis_arg,
        control,
        workers: num("workers", if control.is_some() { 4 } else { 12 })?.max(1),
        keys: num(
            "keys",
            match control {
                None => 6,
                Some(Control::IgnoreLoss | Control::RestartNoAof | Control::PollFollower) => 1,
                Some(Control::PartialGuard) => 3,
                Some(_) => 2,
            },
        )?
        .max(1),
        replicas,
        sentinel_debug,
        ttl_ms,
        node_timeout_ms: num("node-timeout-ms", 100)?,
        capacity,
        require_replicas,
        restart_delay_ms,
        gap,
        think_ms: num(
            "think-ms",
            if control == Some(Control::PlainPause) {
                60
            } else {
                8
            },
        )?,
        keep_alive_pct: num(
            "keep-alive-pct",
            match control {
                None => 1,
                Some(Control::IgnoreLoss | Control::RestartNoAof | Control::RedlockRestart) => 50,
                Some(_) => 3,
            },
        )?,
        // A lease nobody renews cannot see its server's clock stepped
        // forward (the library reads a server's clock with renewals only):
        // rows with clock steps let no lease expire by default.
        expire_pct: num(
            "expire-pct",
            match control {
                None if steps => 0,
                None => 5,
                Some(_) if workload == Workload::Election => 20,
                Some(_) => 0,
            },
        )?,
        long_hold_pct: num("long-hold-pct", if control.is_some() { 0 } else { 2 })?,
        verify_pct: num("verify-pct", if control.is_some() { 0 } else { 10 })?,
        reset_pct: num("reset-pct", if control.is_some() { 0 } else { 10 })?,
        clock_step_ms: match get("clock-step-ms") {
            None if control == Some(Control::ClockJump) => (ttl_ms, ttl_ms * 2),
            None => (ttl_ms / 20, ttl_ms / 4),
            Some(g) => {
                let (lo, hi) = g.split_once('-').ok_or("--clock-step-ms LO-HI")?;
                (
                    lo.parse().map_err(|_| "--clock-step-ms")?,
                    hi.parse().map_err(|_| "--clock-step-ms")?,
                )
            }
        },
        server_clock_rate: match get("server-clock-rate") {
            None => 1.0,
            Some(_) if server_clock.as_deref() != Some("faketime") => {
                return Err("--server-clock-rate needs --server-clock faketime".into());
            }
            Some(r) => match r.parse::<f64>() {
                Ok(r) if (0.5..=2.0).contains(&r) => r,
                _ => return Err(format!("--server-clock-rate {r:?}: a rate from 0.5 to 2")),
            },
        },
        faketime: match server_clock.as_deref() {
            None | Some("real") => false,
            Some("faketime")
                if matches!(
                    topology,
                    Topology::Standalone { .. } | Topology::Redlock { .. }
                ) =>
            {
                true
            }
            Some("faketime") => {
                return Err("--server-clock faketime is for standalone and Redlock servers".into());
            }
            Some(other) => return Err(format!("--server-clock {other:?}: real or faketime")),
        },
        fifo: match get("fairness").as_deref() {
            None | Some("barging") => false,
            Some("fifo") if workload == Workload::Lock => true,
            Some("fifo") => return Err("--fairness fifo is for the lock workload".into()),
            Some(other) => return Err(format!("--fairness {other:?}: barging or fifo")),
        },
        liveness_ttls: match control {
            None | Some(Control::Hoarder) => num("liveness-ttls", 5)?,
            Some(_) => 0,
        },
        set_capacity,
        out: get("out").map(PathBuf::from),
        json_only,
        args: args.to_vec(),
    })
}

/// A data server's URL as the campaign's own user, which no fault switches
/// off.
fn oracle_url(server: &TestServer) -> String {
    server.url_for_user(crate::topo::ORACLE_USER.0, crate::topo::ORACLE_USER.1)
}

struct Worker {
    child: Child,
    out: PathBuf,
}

pub(crate) fn main(args: &[String]) -> Result<(), String> {
    let cfg = parse(args)?;
    // A fault step that panics (a deployment that would not settle) is
    // recorded as not applied; its message goes there, not to the terminal.
    std::panic::set_hook(Box::new(|_| {}));
    let out = match &cfg.out {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!(
            "campaign-{}-{}-{}-{}",
            cfg.topology,
            cfg.workload,
            cfg.seed,
            std::process::id()
        )),
    };
    fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let say = |msg: &str| {
        if !cfg.json_only {
            eprintln!("campaign: {msg}");
        }
    };
    say(&format!(
        "starting {} for {} ({})",
        cfg.topology,
        cfg.workload,
        out.display()
    ));
    let resource_server = TestServer::start();
    let dep = Deployment::start(
        cfg.topology,
        cfg.replicas,
        &cfg.sentinel_debug,
        cfg.faketime
            .then_some((out.as_path(), cfg.server_clock_rate)),
        cfg.nemesis.contains(&Fault::CutBus),
    );
    let prefix = "camp:".to_string();
    let keys: Vec<String> = (0..cfg.keys).map(|i| format!("k{i}")).collect();
    let physical: Vec<String> = keys
        .iter()
        .map(|k| match cfg.workload {
            Workload::Rw => format!("{prefix}{{{k}}}rw"),
            w => spec::lease_key(w, &prefix, k),
        })
        .collect();

    // The server oracle: every server, the Sentinel primary, each key's
    // cluster primary.
    let source = match cfg.topology {
        Topology::Standalone { .. } | Topology::Redlock { .. } => {
            Source::Servers(dep.servers.iter().map(TestServer::url).collect())
        }
        Topology::Sentinel => {
            let s = dep.sentinel.as_ref().expect("a sentinel deployment");
            Source::Sentinel {
                servers: s.servers().iter().map(oracle_url).collect(),
                sentinels: s.sentinel_urls(),
                service: s.service().to_string(),
            }
        }
        Topology::Cluster => Source::Cluster(
            dep.cluster
                .as_ref()
                .expect("a cluster")
                .nodes()
                .iter()
                .map(oracle_url)
                .collect(),
        ),
    };
    let sampler = Some(Sampler::start(
        source,
        physical.clone(),
        match cfg.workload {
            Workload::Rw => "rw",
            Workload::Semaphore => "zset",
            _ => "str",
        },
    ));

    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut workers = Vec::new();
    for id in 0..cfg.workers {
        let file = out.join(format!("worker-{id}.jsonl"));
        let spec = WorkerSpec {
            id,
            seed: cfg.seed,
            workload: cfg.workload,
            connect: dep.connect(),
            resource: resource_server.url(),
            keys: keys.clone(),
            prefix: prefix.clone(),
            ttl_ms: cfg.ttl_ms,
            node_timeout_ms: cfg.node_timeout_ms,
            require_replicas: cfg.require_replicas,
            restart_delay_ms: cfg.restart_delay_ms,
            capacity: cfg.capacity,
            keep_alive_pct: cfg.keep_alive_pct,
            long_hold_pct: cfg.long_hold_pct,
            verify_pct: cfg.verify_pct,
            reset_pct: cfg.reset_pct,
            fifo: cfg.fifo,
            expire_pct: cfg.expire_pct,
            ignore_loss: cfg.control == Some(Control::IgnoreLoss),
            poll_follower: cfg.control == Some(Control::PollFollower),
            plant_partial: cfg.control == Some(Control::PartialGuard),
            hoard: cfg.control == Some(Control::Hoarder) && id == 0,
            set_capacity: cfg.set_capacity.filter(|_| id == 0),
            think_ms: cfg.think_ms,
            out: file.display().to_string(),
        };
        let stderr =
            fs::File::create(out.join(format!("worker-{id}.log"))).map_err(|e| e.to_string())?;
        let child = Command::new(&exe)
            .arg("worker")
            .env("CAMPAIGN_WORKER", spec.to_json())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("spawn a worker: {e}"))?;
        workers.push(Worker { child, out: file });
    }
    let pids: Vec<u32> = workers.iter().map(|w| w.child.id()).collect();

    // The schedule.
    let mut nemesis = Nemesis {
        kinds: cfg.nemesis.clone(),
        rng: Rng::derive(cfg.seed, 1),
        ttl_ms: cfg.ttl_ms,
        pttl_keys: match cfg.workload {
            Workload::Rw => physical.iter().map(|k| format!("{k}:w")).collect(),
            Workload::Semaphore => Vec::new(),
            _ => physical.clone(),
        },
        slot_keys: keys.iter().map(|k| format!("{{{k}}}")).collect(),
        histories: workers.iter().map(|w| w.out.clone()).collect(),
        clock_step_ms: cfg.clock_step_ms,
    };
    let started = Instant::now();
    let t_start = now_ns();
    let mut faults: Vec<FaultRecord> = Vec::new();
    // Warm up: let every worker connect before the first fault.
    thread::sleep(Duration::from_millis(500));
    // The quiet end `liveness` judges the last fault by.
    let window = Duration::from_millis(cfg.ttl_ms) * cfg.liveness_ttls as u32;
    let quiet_end = window.min(cfg.duration / 3);
    let faults_until = cfg.duration - quiet_end;
    while started.elapsed() < cfg.duration {
        let gap = nemesis.gap(cfg.gap.0, cfg.gap.1);
        let left = cfg.duration.saturating_sub(started.elapsed());
        thread::sleep(gap.min(left));
        if nemesis.kinds.is_empty() || started.elapsed() >= faults_until {
            continue;
        }
        let rec = nemesis.strike(&dep, &pids);
        if !cfg.json_only {
            eprintln!(
                "campaign: {:>7.1} s {} {} {}{}",
                (rec.t0 - t_start) as f64 / 1e9,
                rec.fault.name(),
                rec.target,
                rec.note,
                if rec.applied { "" } else { " (not applied)" }
            );
        }
        faults.push(rec);
    }
    // The last fault may have ended inside the quiet end: stretch it to the
    // whole window (a short row's quiet end is shorter than the window).
    if let Some(last) = faults.iter().map(|r| r.t1).max() {
        let until = last + window.as_nanos() as u64;
        let now = now_ns();
        if cfg.liveness_ttls > 0 && until > now {
            thread::sleep(Duration::from_nanos(until - now) + Duration::from_millis(50));
        }
    }
    nemesis::heal(&dep);
    let t_end = now_ns();

    // Stop the workers: close their stdin; each finishes its grant.
    for w in &mut workers {
        drop(w.child.stdin.take());
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for w in &mut workers {
        loop {
            match w.child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = w.child.kill();
                    let _ = w.child.wait();
                    break;
                }
            }
        }
    }
    let samples = sampler.map(Sampler::finish).unwrap_or_default();
    let mut files: Vec<PathBuf> = workers.iter().map(|w| w.out.clone()).collect();
    if cfg.workload == Workload::Election {
        files.extend(
            workers
                .iter()
                .map(|w| PathBuf::from(crate::worker::observe_file(&w.out.display().to_string()))),
        );
    }
    let hist = history::load(&files);
    let tallies = resource::tally(&mut resource_server.client()).map_err(|e| e.to_string())?;
    let findings = check::check(&check::Inputs {
        workload: cfg.workload,
        // Before any set_capacity (the history has the changes).
        capacity: cfg.capacity,
        hist: &hist,
        samples: &samples,
        keys: &keys,
        faults: &faults,
        tallies: &tallies,
        restart_delay_ns: cfg.restart_delay_ms.map(|ms| ms * 1_000_000),
        ttl_ns: cfg.ttl_ms * 1_000_000,
        liveness_ns: (cfg.liveness_ttls > 0).then_some(cfg.liveness_ttls * cfg.ttl_ms * 1_000_000),
        end_ns: Some(t_end),
        node_timeout_ns: Some(cfg.node_timeout_ms * 1_000_000),
        server_clock_rate: cfg.server_clock_rate,
    });
    let mut summary = summarize(
        &cfg,
        &hist,
        &faults,
        &findings,
        &tallies,
        samples.len(),
        (t_start, t_end),
    );
    if cfg.set_capacity.is_some() {
        summary["capacity_changes"] = json!(capacity_changes(&files));
    }
    fs::write(out.join("summary.json"), format!("{summary}\n")).map_err(|e| e.to_string())?;
    let mut fault_lines = String::new();
    for r in &faults {
        fault_lines.push_str(
            &json!({"fault": r.fault.name(), "target": r.target, "t0": r.t0, "t1": r.t1,
                "applied": r.applied, "note": r.note, "restarted": r.restarted, "landed": r.landed,
                "pttl": r.pttl.iter().map(|p| json!({"key": p.key, "value": p.value, "pttl_ms": p.pttl_ms, "t_b": p.t_b, "t_a": p.t_a})).collect::<Vec<_>>(),
                "reads": r.reads.iter().map(|p| json!({"key": p.key, "value": p.value, "pttl_ms": p.pttl_ms, "t_b": p.t_b, "t_a": p.t_a})).collect::<Vec<_>>()})
            .to_string(),
        );
        fault_lines.push('\n');
    }
    fs::write(out.join("faults.jsonl"), fault_lines).map_err(|e| e.to_string())?;
    let mut sample_lines = String::new();
    for s in &samples {
        sample_lines.push_str(
            &json!({"t_b": s.t_b, "t_a": s.t_a, "nodes": s.nodes, "ttl": s.ttl}).to_string(),
        );
        sample_lines.push('\n');
    }
    fs::write(out.join("samples.jsonl"), sample_lines).map_err(|e| e.to_string())?;
    if !cfg.json_only {
        report_text(&summary, &findings);
    }
    println!("{summary}");
    let _ = std::io::stdout().flush();
    if let Err(e) = dep.keep_logs(&out.join("servers")) {
        eprintln!("campaign: the servers' logs were not kept: {e}");
    }
    drop(dep);
    Ok(())
}

/// The workers' `set_capacity` calls (their `cap` lines), by outcome and
/// capacity asked for: `{"ok": {"1": n, ...}, "failed": {...}}`.
fn capacity_changes(files: &[PathBuf]) -> serde_json::Value {
    let mut ok: BTreeMap<u64, u64> = BTreeMap::new();
    let mut failed: BTreeMap<u64, u64> = BTreeMap::new();
    for file in files {
        let text = fs::read_to_string(file).unwrap_or_default();
        for line in text.lines() {
            let Ok(e) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if e["ev"].as_str() != Some("cap") {
                continue;
            }
            let cap = e["cap"].as_u64().unwrap_or(0);
            let into = if e["ok"].as_bool() == Some(true) {
                &mut ok
            } else {
                &mut failed
            };
            *into.entry(cap).or_default() += 1;
        }
    }
    json!({"ok": ok, "failed": failed})
}

/// Which checkers the documented model leaves free to fire in this run, and
/// why; every other checker must find 0.
pub(crate) fn allowed(cfg: &RunConfig) -> Vec<(&'static str, &'static str)> {
    let mut out = Vec::new();
    let has = |f: Fault| cfg.nemesis.contains(&f);
    let state_lost = |why: &'static str, out: &mut Vec<(&'static str, &'static str)>| {
        for c in [
            "overlap",
            "tokens",
            "server-oracle",
            "capacity",
            "writer-beside-reader",
            "resource-repeated-token",
            "resource-lost-updates",
            "late-writes",
            "vouched-after-expiry",
            "vouched-past-ttl",
            "loss-margin",
            "release-outcome",
            "partial-set",
        ] {
            out.push((c, why));
        }
    };
    for c in [
        "tokens-after-history-lost",
        "resource-repeated-token-after-history-lost",
        "resource-lost-updates-after-history-lost",
    ] {
        out.push((
            c,
            "an acquire reported the replication history lost: tokens issued before may be issued again after it",
        ));
    }
    if cfg.control == Some(Control::PollFollower) {
        out.push((
            "observe-regression",
            "a planted client bug: followers poll leader() without observe()'s guard",
        ));
    }
    if cfg.control == Some(Control::Hoarder) {
        out.push((
            "liveness",
            "a planted client bug: a worker leaks every guard it is granted with its keep-alive running",
        ));
    }
    if cfg.control == Some(Control::IgnoreLoss) {
        state_lost(
            "a planted client bug: workers that ignore is_lost() vouch past their loss",
            &mut out,
        );
        return out;
    }
    if cfg.control == Some(Control::ClockJump) {
        state_lost(
            "a server clock stepped forward by more than a lease has left ends it on the server before any renewal can see the step",
            &mut out,
        );
        return out;
    }
    if cfg.control == Some(Control::PartialGuard) {
        let why = "a planted client bug: workers record the last key of a set they did not ask for";
        state_lost(why, &mut out);
        out.push(("partial-guard", why));
        return out;
    }
    let unfenced = matches!(
        cfg.workload,
        Workload::Lock | Workload::Redlock | Workload::LockAll
    );
    if unfenced && has(Fault::PauseWorker) {
        out.push((
            "resource-lost-updates",
            "no fencing: a paused holder writes after its lease expired",
        ));
        out.push((
            "late-writes",
            "no fencing: a paused holder writes after its lease expired",
        ));
    }
    if !unfenced {
        out.push(("late-writes", "fencing orders writes at the resource; a paused holder's write may land before the next holder's first"));
    }
    match cfg.topology {
        Topology::Standalone { aof: false } if has(Fault::Kill) => state_lost(
            "a restart without persistence forgets every lease and the fence counter",
            &mut out,
        ),
        Topology::Redlock { .. }
            if cfg.restart_delay_ms.is_none()
                && (has(Fault::Kill)
                    || has(Fault::KillMajority)
                    || has(Fault::RestartPausedWorker)
                    || has(Fault::RestartPartitioned)) =>
        {
            state_lost(
                "Redlock nodes restarted without persistence and without restart_delay",
                &mut out,
            )
        }
        Topology::Sentinel
            if cfg.require_replicas.is_none()
                && (has(Fault::Failover)
                    || has(Fault::KillPrimary)
                    || has(Fault::UnreplicatedFailover)) =>
        {
            state_lost(
                "a failover with Replication::Off loses grants not yet replicated",
                &mut out,
            )
        }
        Topology::Sentinel
            if cfg
                .require_replicas
                .is_some_and(|r| (r as usize) < cfg.replicas)
                && (has(Fault::Failover) || has(Fault::KillPrimary)) =>
        {
            state_lost(
                "fewer acknowledgements required than replicas: a failover can promote a replica that did not acknowledge a grant (Replication's rustdoc)",
                &mut out,
            )
        }
        Topology::Cluster if has(Fault::Takeover) || has(Fault::Kill) => state_lost(
            "a forced takeover loses writes not yet replicated",
            &mut out,
        ),
        _ => {}
    }
    out
}

/// The checkers a negative control is meant to trip: it is detected when
/// one of them finds at least one violation.
pub(crate) fn control_checkers(c: Control) -> &'static [&'static str] {
    match c {
        Control::PlainPause => &["resource-lost-updates", "late-writes"],
        Control::RedlockRestart => &["overlap", "server-oracle"],
        Control::SentinelUnreplicated => &[
            "overlap",
            "tokens",
            "capacity",
            "writer-beside-reader",
            "resource-repeated-token",
            "resource-lost-updates",
        ],
        Control::IgnoreLoss => &[
            "vouched-after-expiry",
            "vouched-past-ttl",
            "loss-margin",
            "overlap",
            "server-oracle",
            "partial-set",
        ],
        Control::RestartNoAof => &[
            "overlap",
            "tokens",
            "capacity",
            "writer-beside-reader",
            "server-oracle",
        ],
        Control::PollFollower => &["observe-regression"],
        Control::PartialGuard => &["partial-guard"],
        Control::Hoarder => &["liveness"],
        Control::ClockJump => &[
            "vouched-past-ttl",
            "overlap",
            "server-oracle",
            "vouched-after-expiry",
        ],
    }
}

fn summarize(
    cfg: &RunConfig,
    hist: &history::Histories,
    faults: &[FaultRecord],
    f: &Findings,
    tallies: &[(String, resource::Tally)],
    samples: usize,
    (t_start, t_end): (u64, u64),
) -> serde_json::Value {
    let elapsed_ns = t_end - t_start;
    let mut by_fault: BTreeMap<&str, u64> = BTreeMap::new();
    let mut not_applied = 0;
    for r in faults {
        if r.applied {
            *by_fault.entry(r.fault.name()).or_default() += 1;
        } else {
            not_applied += 1;
        }
    }
    let allowed = allowed(cfg);
    let mut violations = 0;
    let mut allowed_hits = 0;
    for (name, n) in &f.counts {
        if allowed.iter().any(|(c, _)| c == name) {
            allowed_hits += n;
        } else {
            violations += n;
        }
    }
    let control_detected = cfg.control.map(|c| {
        control_checkers(c)
            .iter()
            .map(|c| f.counts.get(c).copied().unwrap_or(0))
            .sum::<u64>()
    });
    let lost_grants = hist.grants.iter().filter(|g| g.lost).count();
    // Sets taken together: one guard each, one grant per key of the set.
    let sets = hist
        .grants
        .iter()
        .filter_map(|g| g.set.map(|(set, _)| (g.w, set)))
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let claims = hist.grants.iter().filter(|g| g.v.is_some()).count();
    let faulted_grants = hist
        .grants
        .iter()
        .filter(|g| {
            let end = g.v.unwrap_or(g.g);
            faults
                .iter()
                .any(|r| r.applied && r.t0 <= end + 1_000_000_000 && g.a <= r.t1 + 1_000_000_000)
        })
        .count();
    let sum = |pick: fn(&resource::Tally) -> u64| tallies.iter().map(|(_, t)| pick(t)).sum::<u64>();
    let mut errors: Vec<(&String, &u64)> = hist.errors.iter().collect();
    errors.sort_by(|a, b| b.1.cmp(a.1));
    let args: Vec<&str> = cfg
        .args
        .iter()
        .map(String::as_str)
        .filter(|a| *a != "--json")
        .collect();
    let reproduce = format!("scripts/campaign run {}", args.join(" "));
    let mut summary = json!({
        "topology": cfg.topology.to_string(),
        "workload": cfg.workload.to_string(),
        "nemesis": cfg.nemesis_arg,
        "control": cfg.control.map(|c| c.to_string()),
        "control_detections": control_detected,
        "seed": cfg.seed,
        "capacity": cfg.capacity,
        "keys": cfg.keys,
        "tallies": tallies.iter().map(|(k, t)| json!([k, t.accepted, t.refused, t.lost, t.repeated])).collect::<Vec<_>>(),
        "duration_s": elapsed_ns as f64 / 1e9,
        "workers": cfg.workers,
        "ttl_ms": cfg.ttl_ms,
        "require_replicas": cfg.require_replicas,
        "restart_delay_ms": cfg.restart_delay_ms,
        "attempts": hist.attempts,
        "busy": hist.busy,
        "grants": hist.grants.len(),
        "grants_vouched": claims,
        "grants_near_faults": faulted_grants,
        "grants_lost": lost_grants,
        "errors": hist.errors.values().sum::<u64>(),
        "top_errors": errors.iter().take(5).map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
        "faults": faults.iter().filter(|r| r.applied).count(),
        "faults_by_kind": by_fault,
        "faults_not_applied": not_applied,
        "resource_accepted": sum(|t| t.accepted),
        "resource_refused_stale": sum(|t| t.refused),
        "server_samples": samples,
        "oracle_checks": f.oracle_checks,
        "min_expiry_margin_ms": f.min_expiry_margin_ms,
        "checks": f.counts,
        "violations": violations,
        "allowed_by_model": allowed_hits,
        "allowed": allowed.iter().map(|(c, why)| json!([c, why])).collect::<Vec<_>>(),
        "examples": f.examples,
        "workers_finished": hist.workers_finished,
        "observed": hist.observed.len(),
        "observe_errors": hist.observe_errors.values().sum::<u64>(),
        "acquires_history_lost": hist.history_lost.len(),
        "reproduce": reproduce,
    });
    summary["sets"] = json!(sets);
    if let Some((lo, hi, pct)) = cfg.set_capacity {
        summary["set_capacity"] = json!([lo, hi, pct]);
    }
    if cfg.topology == Topology::Sentinel {
        summary["replicas"] = json!(cfg.replicas);
        summary["sentinel_debug"] = json!(cfg.sentinel_debug);
    }
    summary["expiry_checks"] = json!(f.expiry_checks);
    summary["owner_checks"] = json!(f.owner_checks);
    summary["release_checks"] = json!(f.release_checks);
    summary["answer_checks"] = json!(f.answer_checks);
    let mut calls: BTreeMap<String, u64> = BTreeMap::new();
    for a in &hist.answers {
        let label = match a.held {
            Some(true) => "held",
            Some(false) => "not held",
            None => "error",
        };
        *calls.entry(format!("{} {label}", a.call)).or_default() += 1;
    }
    summary["answers"] = json!(calls);
    summary["ttl_checks"] = json!(f.ttl_checks);
    summary["ttl_checks_near_faults"] = json!(f.ttl_checks_near_faults);
    summary["min_ttl_margin_ms"] = json!(f.min_ttl_margin_ms);
    summary["node_timeout_ms"] = json!(cfg.node_timeout_ms);
    summary["server_clock_rate"] = json!(cfg.server_clock_rate);
    summary["margin_checks"] = json!(f.margin_checks);
    summary["min_loss_margin_ms"] = json!(f.min_loss_margin_ms);
    summary["liveness_ms"] = json!(cfg.liveness_ttls * cfg.ttl_ms);
    summary["liveness_checks"] = json!(f.liveness_checks);
    summary["max_regrant_ms"] = json!(f.max_regrant_ms);
    summary["t_end_ns"] = json!(t_end);
    summary
}

fn report_text(s: &serde_json::Value, f: &Findings) {
    eprintln!(
        "campaign: {} {} nemesis={} seed={}: {} grants ({} near faults, {} lost), {} faults, {} errors",
        s["topology"],
        s["workload"],
        s["nemesis"],
        s["seed"],
        s["grants"],
        s["grants_near_faults"],
        s["grants_lost"],
        s["faults"],
        s["errors"]
    );
    for (name, n) in &f.counts {
        eprintln!("campaign:   {name:<24} {n}");
        for ex in f.examples.get(name).into_iter().flatten() {
            eprintln!("campaign:       {ex}");
        }
    }
    eprintln!(
        "campaign: violations of the promised model: {}; allowed by the model: {}",
        s["violations"], s["allowed_by_model"]
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn set_capacity_needs_a_semaphore_and_a_range_that_holds_the_capacity() {
        let cfg = parse(&args(
            "--topology standalone --workload semaphore --set-capacity 1-3",
        ))
        .expect("a valid row");
        assert_eq!(cfg.set_capacity, Some((1, 3, 5)));
        assert_eq!(
            parse(&args("--topology standalone --workload semaphore")).map(|c| c.set_capacity),
            Ok(None)
        );
        for bad in [
            "--topology standalone --workload fenced --set-capacity 1-3",
            "--topology standalone --workload semaphore --set-capacity 3-4",
            "--topology standalone --workload semaphore --set-capacity 0-2",
            "--topology standalone --workload semaphore --set-capacity 2",
        ] {
            assert!(parse(&args(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_hoarder_control_is_judged_by_liveness() {
        let cfg = parse(&args("--control hoarder")).expect("a valid row");
        assert_eq!(cfg.liveness_ttls, 5);
        assert_eq!(cfg.workload, Workload::Fenced);
        for other in ["multi", "semaphore", "rw"] {
            assert!(parse(&args(&format!("--control hoarder --workload {other}"))).is_err());
        }
        let other = parse(&args("--control plain-pause")).expect("a valid row");
        assert_eq!(other.liveness_ttls, 0);
    }

    #[test]
    fn cut_bus_is_a_nemesis_of_its_own() {
        let cfg = parse(&args(
            "--topology cluster --workload fenced --nemesis cut-bus,pair",
        ))
        .expect("a valid row");
        assert_eq!(cfg.nemesis, vec![Fault::CutBus, Fault::Pair]);
        assert!(!Fault::mix(Topology::Cluster).contains(&Fault::CutBus));
    }
}
