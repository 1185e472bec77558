//! Case 6: what each operation costs the server. For every uncontended verb
//! of cases 1 and 2, for a user's extension of a held lock and for the
//! renewal of 1,000 kept-alive leases, on Redis 7.0 and on Valkey 8.1: the
//! CPU time of the server processes (every thread, by
//! `/proc/PID/task/*/schedstat`) and the time `INFO commandstats` counts
//! inside commands, per 1,000 operations, beside a raw baseline's. On Valkey
//! the extension also runs as `SET … IFEQ … GET`, the path this crate takes
//! there, beside the script it takes on Redis.
//!
//! The driver starts the servers of each kind, runs each implementation in a
//! child process (the children of cases 1 and 2 for their rows, the ones
//! here for the others) and reads the servers around the child's timed
//! turns only: its set-up and warm-up come before, its report after.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use respire_coordination::Coordinator;

use crate::child::{Ctx, Res, connect, lockstep, warm_up};
use crate::driver::{Launcher, Options, Stepper, pin};
use crate::plan::{Case, Cpus, Figures};
use crate::single::{load, owner};
use crate::stats::median;
use crate::support::{ServerKind, TestServer};

/// The child case name of the implementations defined here.
pub(crate) const CASE: &str = "server-cpu";

const TTL: Duration = Duration::from_secs(30);
/// Leases renewed together, as a keep-alive of that many would.
const LEASES: usize = 1_000;
/// The TTL of the kept-alive leases: renewed at half of it.
const KEEPALIVE_TTL: Duration = Duration::from_millis(1_000);
/// Short enough for [`KEEPALIVE_TTL`] (the default would need 2 s or more).
const KEEPALIVE_NODE_TIMEOUT: Duration = Duration::from_millis(100);
const CHILD_DEADLINE: Duration = Duration::from_secs(300);
const LEASE_EXTEND: &str = include_str!("../../src/scripts/lease_extend.lua");

/// Which group of rows a row belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Group {
    Pairs,
    Redlock,
    Extension,
    Renewal,
}

impl Group {
    const ALL: [Group; 4] = [
        Group::Pairs,
        Group::Redlock,
        Group::Extension,
        Group::Renewal,
    ];

    fn title(self) -> &'static str {
        match self {
            Group::Pairs => "Acquire + release, one node (the rows of case 1), per 1,000 pairs",
            Group::Redlock => {
                "Redlock acquire + release over 5 nodes (the rows of case 2; the five servers \
                 together), per 1,000 pairs"
            }
            Group::Extension => "A held lock extended by its holder, per 1,000 extensions",
            Group::Renewal => "Renewal of 1,000 kept-alive leases, per 1,000 renewals",
        }
    }
}

/// One row: an implementation, the child case that runs it, its baseline.
struct Row {
    group: Group,
    case: &'static str,
    name: &'static str,
    label: &'static str,
    baseline: &'static str,
    /// Runs only on a server with `SET … IFEQ`.
    ifeq: bool,
}

/// The implementations of this file: (group, name, label, baseline, ifeq).
const OWN: &[(Group, &str, &str, &str, bool)] = &[
    (
        Group::Pairs,
        "raw-setnx-del",
        "raw floor: `SET NX PX` + plain `DEL` (no ownership check on release), one connection",
        "raw-setnx-del",
        false,
    ),
    (
        Group::Extension,
        "raw-extend-pexpire",
        "raw floor: `PEXPIRE` (no ownership check), one connection",
        "raw-extend-pexpire",
        false,
    ),
    (
        Group::Extension,
        "raw-extend-script",
        "raw: this crate's extension script (`lease_extend.lua`) by `EVALSHA`, one connection",
        "raw-extend-pexpire",
        false,
    ),
    (
        Group::Extension,
        "raw-extend-ifeq",
        "raw: `SET key value IFEQ value PX ttl GET`, one connection (Valkey 8.1 only)",
        "raw-extend-pexpire",
        true,
    ),
    (
        Group::Extension,
        "lock-extend",
        "**this crate, `LockGuard::reset_expiry`** (the script on Redis 7.0, `SET … IFEQ` on Valkey 8.1)",
        "raw-extend-pexpire",
        false,
    ),
    (
        Group::Renewal,
        "raw-renew-pexpire",
        "raw floor: `TIME` + 1,000 `PEXPIRE` in one pipeline (no ownership check), back to back",
        "raw-renew-pexpire",
        false,
    ),
    (
        Group::Renewal,
        "raw-renew-script",
        "raw: `TIME` + 1,000 `EVALSHA` of the extension script in one pipeline, back to back",
        "raw-renew-pexpire",
        false,
    ),
    (
        Group::Renewal,
        "raw-renew-ifeq",
        "raw: `TIME` + 1,000 `SET … IFEQ … GET` in one pipeline, back to back (Valkey 8.1 only)",
        "raw-renew-pexpire",
        true,
    ),
    (
        Group::Renewal,
        "keepalive",
        "**this crate, 1,000 `Lock` guards with `keep_alive`** (TTL 1 s, renewed every 0.5 s, node timeout 100 ms; the script on Redis 7.0, `SET … IFEQ` on Valkey 8.1)",
        "raw-renew-pexpire",
        false,
    ),
];

fn rows() -> Vec<Row> {
    let own = |group: Group| {
        OWN.iter()
            .filter(move |r| r.0 == group)
            .map(|&(group, name, label, baseline, ifeq)| Row {
                group,
                case: CASE,
                name,
                label,
                baseline,
                ifeq,
            })
    };
    let mut rows: Vec<Row> = own(Group::Pairs).collect();
    for imp in Case::Single.impls() {
        rows.push(Row {
            group: Group::Pairs,
            case: Case::Single.name(),
            name: imp.name,
            label: imp.label,
            baseline: "raw-setnx-del",
            ifeq: false,
        });
    }
    for imp in Case::Redlock.impls() {
        rows.push(Row {
            group: Group::Redlock,
            case: Case::Redlock.name(),
            name: imp.name,
            label: imp.label,
            baseline: "raw-quorum",
            ifeq: false,
        });
    }
    rows.extend(own(Group::Extension));
    rows.extend(own(Group::Renewal));
    rows
}

/// What the servers did during one child's timed turns.
#[derive(Clone, Copy, Debug, Default)]
struct Measured {
    /// Operations the child did in its turns.
    ops: f64,
    /// CPU time of the server processes, in µs.
    cpu_us: f64,
    /// Time inside scripts (`EVAL`, `EVALSHA`, the commands they call
    /// included; `INFO commandstats`), in µs.
    script_us: f64,
    /// Commands run, those scripts call included.
    calls: f64,
}

impl Measured {
    fn per_1000(self, total: f64) -> Option<f64> {
        (self.ops > 0.0).then(|| total * 1_000.0 / self.ops)
    }
}

/// CPU time used so far by process `pid`, every thread, in nanoseconds.
fn process_cpu_ns(pid: u32) -> Res<u64> {
    let mut total = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let stat = std::fs::read_to_string(task?.path().join("schedstat"))?;
        let ran: u64 = stat
            .split_whitespace()
            .next()
            .ok_or("empty schedstat")?
            .parse()?;
        total += ran;
    }
    Ok(total)
}

/// Microseconds spent in scripts and commands run (those scripts call
/// included), by `INFO commandstats`, the driver's own `INFO` and `CONFIG`
/// left out. (The time of a command a script calls counts both in the
/// script's and in its own entry, so a sum over every entry would count it
/// twice.)
fn command_time(conn: &mut redis::Connection) -> Res<(f64, f64)> {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn)?;
    let (mut usec, mut calls) = (0.0, 0.0);
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        if name == "info" || name.starts_with("config") {
            continue;
        }
        for field in rest.split(',') {
            if let Some(v) = field.strip_prefix("usec=") {
                if name.starts_with("eval") {
                    usec += v.trim().parse::<f64>()?;
                }
            } else if let Some(v) = field.strip_prefix("calls=") {
                calls += v.trim().parse::<f64>()?;
            }
        }
    }
    Ok((usec, calls))
}

/// The server's name and version (`valkey 8.1.8`, `redis 7.0.15`).
fn version(conn: &mut redis::Connection) -> Res<String> {
    let info: String = redis::cmd("INFO").arg("server").query(conn)?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
    };
    Ok(match field("valkey_version:") {
        Some(v) => format!("Valkey {v}"),
        None => format!(
            "Redis {}",
            field("redis_version:").unwrap_or_else(|| "unknown".into())
        ),
    })
}

/// One kind of server: its version, its idle CPU and every run.
struct KindRuns {
    version: String,
    idle_us_per_s: f64,
    /// Per row, in the order of [`rows`]: one measurement per round
    /// (`None`: failed or not run).
    runs: Vec<Vec<Option<Measured>>>,
    errors: Vec<String>,
}

/// Runs the case and returns its section of the report.
pub(crate) fn run(options: &Options, exe: &Path, cpus: usize) -> Res<String> {
    let started = Instant::now();
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let sizes = &options.sizes;
    let placement = if cpus >= 2 { Cpus::Two } else { Cpus::One };
    let (server_cpus, child_cpus) = placement.lists(cpus);
    let launcher = Launcher {
        exe: exe.to_owned(),
        cpus: child_cpus,
    };
    let rows = rows();
    let mut kinds = Vec::new();
    for kind in [ServerKind::Redis, ServerKind::Valkey] {
        let servers: Vec<TestServer> = (0..5)
            .map(|_| TestServer::builder().kind(kind).start())
            .collect();
        for server in &servers {
            pin(server.pid(), &server_cpus)?;
        }
        let mut admin: Vec<redis::Connection> = servers.iter().map(TestServer::client).collect();
        let version = version(&mut admin[0])?;
        let urls: Vec<String> = servers.iter().map(TestServer::url).collect();
        let idle_start = process_cpu_ns(servers[0].pid())?;
        std::thread::sleep(Duration::from_secs(1));
        let idle_us_per_s = (process_cpu_ns(servers[0].pid())? - idle_start) as f64 / 1e3;
        eprintln!("server CPU: {version}, idle {idle_us_per_s:.0} µs/s");
        let mut runs: Vec<Vec<Option<Measured>>> = rows.iter().map(|_| Vec::new()).collect();
        let mut errors = Vec::new();
        for round in 0..sizes.rounds {
            let mut order: Vec<usize> = (0..rows.len()).collect();
            order.rotate_left(round % rows.len());
            for i in order {
                let row = &rows[i];
                if row.ifeq && kind != ServerKind::Valkey {
                    runs[i].push(None);
                    continue;
                }
                for conn in &mut admin {
                    redis::cmd("FLUSHALL").query::<()>(conn)?;
                }
                let nodes = if row.group == Group::Redlock { 5 } else { 1 };
                let measured = measure(
                    &launcher,
                    row,
                    &urls,
                    &servers[..nodes],
                    &mut admin[..nodes],
                    options,
                    format!("s{round}:{}:", row.name),
                );
                match measured {
                    Ok(m) => {
                        eprintln!(
                            "server CPU: round {}/{} {:<8} {:<20} {:>9.0} µs per 1,000 ({:.0} ops)",
                            round + 1,
                            sizes.rounds,
                            kind.name(),
                            row.name,
                            m.per_1000(m.cpu_us).unwrap_or(0.0),
                            m.ops
                        );
                        runs[i].push(Some(m));
                    }
                    Err(e) => {
                        eprintln!("server CPU: {} {} FAILED: {e}", kind.name(), row.name);
                        errors.push(format!("{} `{}`: {e}", version, row.name));
                        runs[i].push(None);
                    }
                }
            }
        }
        kinds.push(KindRuns {
            version,
            idle_us_per_s,
            runs,
            errors,
        });
    }
    let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    Ok(render(
        &rows,
        &kinds,
        options,
        placement,
        started.elapsed(),
        (&load_before, &load_after),
    ))
}

/// Runs `row`'s child and reads `servers` around its timed turns.
fn measure(
    launcher: &Launcher,
    row: &Row,
    urls: &[String],
    servers: &[TestServer],
    admin: &mut [redis::Connection],
    options: &Options,
    prefix: String,
) -> Res<Measured> {
    let sizes = &options.sizes;
    let mut args = vec![
        "child".to_owned(),
        row.case.to_owned(),
        row.name.to_owned(),
        format!("urls={}", urls.join(",")),
        format!("slow-urls={}", urls.join(",")),
        format!("prefix={prefix}"),
    ];
    args.extend(
        sizes
            .to_pairs()
            .into_iter()
            .map(|(k, v)| format!("{k}={v}")),
    );
    let deadline = Instant::now() + CHILD_DEADLINE;
    let mut child = Stepper::spawn(launcher, &args);
    child.expect("READY", deadline);
    for conn in admin.iter_mut() {
        redis::cmd("CONFIG").arg("RESETSTAT").query::<()>(conn)?;
    }
    let cpu = |servers: &[TestServer]| -> Res<u64> {
        servers.iter().map(|s| process_cpu_ns(s.pid())).sum()
    };
    let before = cpu(servers)?;
    for _ in 0..sizes.blocks {
        if child.send("GO") {
            child.expect("DONE", deadline);
        }
    }
    let after = cpu(servers)?;
    let (mut script_us, mut calls) = (0.0, 0.0);
    for conn in admin.iter_mut() {
        let (u, c) = command_time(conn)?;
        script_us += u;
        calls += c;
    }
    child.send("END");
    let run = child.finish();
    if let Some(e) = run.error {
        return Err(e.into());
    }
    let ops = run
        .figures
        .as_ref()
        .and_then(|f| f.get("n").copied())
        .ok_or("no count of operations")?;
    Ok(Measured {
        ops,
        cpu_us: after.saturating_sub(before) as f64 / 1e3,
        script_us,
        calls,
    })
}

/// Medians over rounds: CPU per 1,000, its ratio to the baseline's run of
/// the same round, time in commands per 1,000, commands per operation.
struct Summary {
    cpu: Option<f64>,
    ratio: Option<f64>,
    in_scripts: Option<f64>,
    commands: Option<f64>,
}

fn summarize(kind: &KindRuns, rows: &[Row], i: usize) -> Summary {
    let row = &rows[i];
    let own = kind.runs[i].as_slice();
    let base = rows
        .iter()
        .position(|r| r.group == row.group && r.name == row.baseline)
        .map_or(&[][..], |b| kind.runs[b].as_slice());
    let med = |v: Vec<Option<f64>>| median(&v.into_iter().flatten().collect::<Vec<_>>());
    Summary {
        cpu: med(own
            .iter()
            .map(|m| m.and_then(|m| m.per_1000(m.cpu_us)))
            .collect()),
        ratio: med(own
            .iter()
            .zip(base)
            .map(|(m, b)| {
                let m = m.and_then(|m| m.per_1000(m.cpu_us))?;
                let b = b.and_then(|b| b.per_1000(b.cpu_us))?;
                (m > 0.0 && b > 0.0).then(|| m / b)
            })
            .collect()),
        in_scripts: med(own
            .iter()
            .map(|m| m.and_then(|m| m.per_1000(m.script_us)))
            .collect()),
        commands: med(own
            .iter()
            .map(|m| m.and_then(|m| (m.ops > 0.0).then(|| m.calls / m.ops)))
            .collect()),
    }
}

fn render(
    rows: &[Row],
    kinds: &[KindRuns],
    options: &Options,
    placement: Cpus,
    wall: Duration,
    (load_before, load_after): (&str, &str),
) -> String {
    let sizes = &options.sizes;
    let load = |s: &str| s.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
    let num = |v: Option<f64>| v.map_or("—".into(), |v| format!("{v:.0}"));
    let two = |v: Option<f64>| v.map_or("—".into(), |v| format!("{v:.2}"));
    let mut md = String::new();
    let _ = writeln!(md, "## 6. Server CPU per operation ({})", placement.label());
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "What each operation costs the server, on {}. For each row, one child process ran \
         the operation as in its case ({} pairs or extensions per run, {} Redlock pairs, \
         {} renewal pipelines of {LEASES} leases, {} turns of 1,000 keep-alive renewals), \
         and the driver read the servers around the child's timed turns only: **server CPU** \
         is the CPU time of the server processes (all threads, `/proc/PID/task/*/schedstat`; \
         reading and writing sockets included), **in scripts** the time `INFO commandstats` \
         counts inside `EVAL` and `EVALSHA` (the commands a script calls included; \
         `CONFIG RESETSTAT` before). Both per 1,000 operations, medians over {} rounds; \
         **×** is the median per-round ratio of server CPU to the baseline's run in the \
         same round; **commands** the commands run per operation, those a script calls \
         included (`INFO commandstats`). \
         `FLUSHALL` before each run; the keys of the Redlock rows are spread over five \
         servers, whose CPU is summed.",
        kinds
            .iter()
            .map(|k| k.version.as_str())
            .collect::<Vec<_>>()
            .join(" and "),
        sizes.pairs,
        sizes.redlock_pairs,
        sizes.blocks,
        sizes.blocks,
        sizes.rounds,
    );
    let _ = writeln!(md);
    let _ = writeln!(md, "| | |");
    let _ = writeln!(md, "|---|---|");
    let _ = writeln!(md, "| date (UTC) | {} |", utc_now());
    let _ = writeln!(
        md,
        "| load average (1, 5, 15 min) before / after | {} / {} (the machine is shared with \
         other builds) |",
        load(load_before),
        load(load_after)
    );
    for k in kinds {
        let _ = writeln!(
            md,
            "| {} idle | {:.0} µs of CPU per second (its periodic tasks): negligible beside \
             back-to-back operations, but about {:.0} µs per 1,000 renewals of the paced \
             `keepalive` row (1,000 renewals take {:.1} s), which includes it |",
            k.version,
            k.idle_us_per_s,
            k.idle_us_per_s * KEEPALIVE_TTL.as_secs_f64() / 2.0,
            KEEPALIVE_TTL.as_secs_f64() / 2.0,
        );
    }
    let _ = writeln!(
        md,
        "| wall time of this case | {:.0} s |",
        wall.as_secs_f64()
    );
    let _ = writeln!(md);
    for group in Group::ALL {
        let _ = writeln!(md, "{}:", group.title());
        let _ = writeln!(md);
        let mut head = String::from("| implementation |");
        let mut rule = String::from("|---|");
        for k in kinds {
            let _ = write!(
                head,
                " {v} server CPU µs | {v} × | {v} in scripts µs | {v} commands |",
                v = k.version
            );
            rule.push_str("---|---|---|---|");
        }
        let _ = writeln!(md, "{head}");
        let _ = writeln!(md, "{rule}");
        for (i, row) in rows.iter().enumerate().filter(|(_, r)| r.group == group) {
            let mut line = format!("| `{}` |", row.name);
            for k in kinds {
                let s = summarize(k, rows, i);
                let _ = write!(
                    line,
                    " {} | {} | {} | {} |",
                    num(s.cpu),
                    two(s.ratio),
                    num(s.in_scripts),
                    two(s.commands)
                );
            }
            let _ = writeln!(md, "{line}");
        }
        let _ = writeln!(md);
    }
    let _ = writeln!(md, "Implementations (× is to the baseline named):");
    let _ = writeln!(md);
    for row in rows {
        let base = if row.baseline == row.name {
            " (a baseline)".to_owned()
        } else {
            format!(" (× to `{}`)", row.baseline)
        };
        let group = if row.group == Group::Redlock {
            " (5 nodes)"
        } else {
            ""
        };
        let _ = writeln!(md, "- `{}`{group}: {}{base}", row.name, row.label);
    }
    let errors: Vec<&String> = kinds.iter().flat_map(|k| &k.errors).collect();
    if !errors.is_empty() {
        let _ = writeln!(md);
        let _ = writeln!(md, "Runs that failed:");
        let _ = writeln!(md);
        for e in errors {
            let _ = writeln!(md, "- {e}");
        }
    }
    md
}

/// The date and time now, UTC, as `date -u` gives it.
fn utc_now() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or_else(|| "unknown".into(), |s| s.trim().to_owned())
}

/// The child side of the implementations defined here.
pub(crate) fn child(imp: &str, ctx: &Ctx) -> Res<Figures> {
    let url = ctx.urls[0].as_str();
    let blocks = ctx.sizes.blocks;
    let n = ctx.sizes.pairs.div_ceil(blocks);
    let warm = warm_up(ctx.sizes.pairs);
    let key = ctx.key("lease");
    let ttl_ms = TTL.as_millis() as u64;
    let ops: usize;
    // `op` repeated `warm` times, then `n` times in each turn.
    let repeat = |op: &mut dyn FnMut() -> Res<()>, per_turn: usize| -> Res<usize> {
        for _ in 0..warm.min(per_turn.max(1) * 2) {
            op()?;
        }
        let mut done = 0;
        lockstep(|| {
            for _ in 0..per_turn {
                op()?;
                done += 1;
            }
            Ok(())
        })?;
        Ok(done)
    };
    match imp {
        "raw-setnx-del" => {
            let mut conn = connect(url)?;
            let mut i = 0;
            ops = repeat(
                &mut || {
                    i += 1;
                    let set: redis::Value = redis::cmd("SET")
                        .arg(&key)
                        .arg(owner(i))
                        .arg("NX")
                        .arg("PX")
                        .arg(ttl_ms)
                        .query(&mut conn)?;
                    if set != redis::Value::Okay {
                        return Err(format!("SET NX answered {set:?}").into());
                    }
                    let deleted: i64 = redis::cmd("DEL").arg(&key).query(&mut conn)?;
                    crate::single::expect(deleted == 1, "DEL did not delete")
                },
                n,
            )?;
        }
        "raw-extend-pexpire" | "raw-extend-script" | "raw-extend-ifeq" => {
            let mut conn = connect(url)?;
            let value = owner(1);
            redis::cmd("SET")
                .arg(&key)
                .arg(&value)
                .arg("PX")
                .arg(ttl_ms)
                .query::<()>(&mut conn)?;
            let sha = load(&mut conn, LEASE_EXTEND)?;
            let cmd = extension(imp, &key, &value, &sha, ttl_ms);
            ops = repeat(
                &mut || {
                    let reply: redis::Value = cmd.query(&mut conn)?;
                    extended(imp, &reply, &value)
                },
                n,
            )?;
        }
        "lock-extend" => {
            let coord = Coordinator::builder(url).key_prefix(&ctx.prefix).build()?;
            let lock = coord.lock("lock")?;
            let guard = lock.try_acquire(TTL)?.ok_or("contended")?;
            ops = repeat(
                &mut || {
                    crate::single::expect(guard.reset_expiry(TTL)?, "the extension found it lost")
                },
                n,
            )?;
        }
        "raw-renew-pexpire" | "raw-renew-script" | "raw-renew-ifeq" => {
            let mut conn = connect(url)?;
            let sha = load(&mut conn, LEASE_EXTEND)?;
            let leases: Vec<(String, String)> = (0..LEASES)
                .map(|i| (ctx.key(&format!("lease:{i}")), owner(i as u64)))
                .collect();
            let mut grant = redis::pipe();
            for (key, value) in &leases {
                grant.cmd("SET").arg(key).arg(value).arg("PX").arg(ttl_ms);
            }
            grant.query::<()>(&mut conn)?;
            let mut pipe = redis::pipe();
            pipe.cmd("TIME");
            for (key, value) in &leases {
                pipe.add_command(extension(imp, key, value, &sha, ttl_ms));
            }
            let renewed = repeat(
                &mut || {
                    let replies: Vec<redis::Value> = pipe.query(&mut conn)?;
                    for (reply, (_, value)) in replies[1..].iter().zip(&leases) {
                        extended(imp, reply, value)?;
                    }
                    Ok(())
                },
                1,
            )?;
            ops = renewed * LEASES;
        }
        "keepalive" => {
            let coord = Coordinator::builder(url)
                .key_prefix(&ctx.prefix)
                .node_timeout(KEEPALIVE_NODE_TIMEOUT)
                .build()?;
            let locks = (0..LEASES)
                .map(|i| coord.lock(&format!("k{i}")))
                .collect::<Result<Vec<_>, _>>()?;
            let guards = locks
                .iter()
                .map(|l| l.try_acquire(KEEPALIVE_TTL)?.ok_or("contended".into()))
                .collect::<Res<Vec<_>>>()?;
            let keeps = guards
                .iter()
                .map(|g| g.keep_alive())
                .collect::<Result<Vec<_>, _>>()?;
            let renewals = || coord.renewal_stats().renewals;
            let until = |target: u64| -> Res<()> {
                let deadline = Instant::now() + KEEPALIVE_TTL * 10;
                while renewals() < target {
                    if Instant::now() > deadline {
                        return Err("renewals stopped".into());
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(())
            };
            // One full cycle before the timed turns.
            until(renewals() + LEASES as u64)?;
            let mut first = None;
            let mut last = 0;
            lockstep(|| {
                let start = *first.get_or_insert_with(renewals);
                until(renewals().max(start) + LEASES as u64)?;
                last = renewals();
                Ok(())
            })?;
            if guards.iter().any(|g| g.is_lost()) {
                return Err("a kept-alive lease was lost".into());
            }
            drop(keeps);
            ops = last.saturating_sub(first.unwrap_or(last)) as usize;
        }
        other => return Err(format!("no such implementation {other:?}").into()),
    }
    let mut figures = Figures::new();
    figures.insert("n".into(), ops as f64);
    Ok(figures)
}

/// The extension of `key` holding `value` as `imp` sends it.
fn extension(imp: &str, key: &str, value: &str, sha: &str, ttl_ms: u64) -> redis::Cmd {
    if imp.ends_with("pexpire") {
        let mut cmd = redis::cmd("PEXPIRE");
        cmd.arg(key).arg(ttl_ms);
        cmd
    } else if imp.ends_with("ifeq") {
        let mut cmd = redis::cmd("SET");
        cmd.arg(key)
            .arg(value)
            .arg("IFEQ")
            .arg(value)
            .arg("PX")
            .arg(ttl_ms)
            .arg("GET");
        cmd
    } else {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(sha).arg(1).arg(key).arg(value).arg(ttl_ms);
        cmd
    }
}

/// Whether `reply` to [`extension`] says it extended.
fn extended(imp: &str, reply: &redis::Value, value: &str) -> Res<()> {
    let ok = if imp.ends_with("ifeq") {
        matches!(reply, redis::Value::BulkString(b) if *b == value.as_bytes())
    } else {
        *reply == redis::Value::Int(1)
    };
    crate::single::expect(ok, "the extension did not extend")
        .map_err(|e| format!("{e}: {reply:?}").into())
}
