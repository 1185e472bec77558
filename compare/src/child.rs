//! The child side: one implementation of one case, in a process of its own.
//!
//! The driver runs `respire-compare child CASE IMPL name=value...`. A child
//! that is compared with a baseline runs in lockstep with the baseline's
//! child: after its set-up and warm-up it prints `READY`, then runs one turn
//! (a block of its measurement) for each `GO` line on stdin, printing `DONE`
//! after each, and stops at `END`; the driver hands turns to the two in
//! alternation, so both are measured over the same stretches of time, never
//! at once. Then the child prints one line `RESULT name=value ...`.

use std::error::Error;
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::plan::{Case, Figures, Sizes};
use crate::stats::quantile;
use crate::{handoff, idle, quorum_cases, server_cpu, single};

pub(crate) type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// What a child is told: where the servers are, its key prefix and the sizes.
pub(crate) struct Ctx {
    /// The five servers, directly.
    pub(crate) urls: Vec<String>,
    /// The same five servers, each behind a proxy that delays 10 ms each way.
    pub(crate) slow_urls: Vec<String>,
    /// A prefix no other child uses.
    pub(crate) prefix: String,
    pub(crate) sizes: Sizes,
}

impl Ctx {
    /// `prefix` + `name`.
    pub(crate) fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }
}

/// Runs the child named by `args` (after `child`) and prints its result.
pub(crate) fn main(args: &[String]) -> Res<()> {
    let [case, imp, rest @ ..] = args else {
        return Err("usage: respire-compare child CASE IMPL name=value...".into());
    };
    // `None`: an implementation of the server CPU case (`server_cpu`).
    let case = match Case::parse(case) {
        Some(case) if case.find(imp).is_none() => {
            return Err(format!("case {} has no implementation {imp:?}", case.name()).into());
        }
        Some(case) => Some(case),
        None if case == server_cpu::CASE => None,
        None => return Err(format!("unknown case {case:?}").into()),
    };
    let mut ctx = Ctx {
        urls: Vec::new(),
        slow_urls: Vec::new(),
        prefix: String::new(),
        sizes: Sizes::full(),
    };
    for arg in rest {
        let (name, value) = arg
            .split_once('=')
            .ok_or_else(|| format!("expected name=value, got {arg:?}"))?;
        match name {
            "urls" => ctx.urls = value.split(',').map(str::to_owned).collect(),
            "slow-urls" => ctx.slow_urls = value.split(',').map(str::to_owned).collect(),
            "prefix" => ctx.prefix = value.to_owned(),
            _ => ctx.sizes.set(name, value)?,
        }
    }
    if ctx.urls.len() != 5 || ctx.slow_urls.len() != 5 || ctx.prefix.is_empty() {
        return Err("a child needs urls=5 URLs, slow-urls=5 URLs and a prefix".into());
    }
    let figures = match case {
        Some(Case::Single) => single::run(imp, &ctx)?,
        Some(Case::Redlock) => quorum_cases::run_local(imp, &ctx)?,
        Some(Case::Handoff) => handoff::run(imp, &ctx)?,
        Some(Case::Slow) => quorum_cases::run_slow(imp, &ctx)?,
        Some(Case::Idle) => idle::run(imp, &ctx)?,
        None => server_cpu::child(imp, &ctx)?,
    };
    let line: Vec<String> = figures.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("RESULT {}", line.join(" "));
    Ok(())
}

/// A plain connection with 10 s timeouts, so that a broken server fails the
/// child instead of hanging it.
pub(crate) fn connect(url: &str) -> Res<redis::Connection> {
    let timeout = Duration::from_secs(10);
    let conn = redis::Client::open(url)?.get_connection_with_timeout(timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))?;
    Ok(conn)
}

/// A tokio runtime as `#[tokio::main]` makes one: multi-threaded, one worker
/// per core, timers and I/O on.
pub(crate) fn runtime() -> Res<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// CPU time (user + system, every thread) this process has used so far, by
/// `getrusage(RUSAGE_SELF)`.
fn cpu_used() -> Res<Duration> {
    use nix::sys::resource::{UsageWho, getrusage};
    let usage = getrusage(UsageWho::RUSAGE_SELF)?;
    let time = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec().max(0) as u64)
            + Duration::from_micros(t.tv_usec().max(0) as u64)
    };
    Ok(time(usage.user_time()) + time(usage.system_time()))
}

/// Nanoseconds of CPU time used during turns (see [`turns_cpu`]).
static TURNS_CPU_NS: AtomicU64 = AtomicU64::new(0);

/// The CPU time this process used during its timed turns so far: set-up,
/// warm-up and the waits between turns left out.
pub(crate) fn turns_cpu() -> Duration {
    Duration::from_nanos(TURNS_CPU_NS.load(Ordering::Relaxed))
}

/// Client CPU per 1,000 operations, in microseconds, from the CPU time of
/// the turns that did `ops` operations.
pub(crate) fn cpu_per_1000(figures: &mut Figures, ops: usize) {
    if ops > 0 {
        figures.insert("cpu".into(), micros(turns_cpu()) * 1_000.0 / ops as f64);
    }
}

/// Prints `READY`, then runs `turn` once per `GO` on stdin (printing `DONE`
/// after each) until `END`; adds the CPU time of each turn to [`turns_cpu`].
pub(crate) fn lockstep(mut turn: impl FnMut() -> Res<()>) -> Res<()> {
    let say = |word: &str| -> Res<()> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{word}")?;
        Ok(out.flush()?)
    };
    say("READY")?;
    let mut line = String::new();
    loop {
        line.clear();
        if std::io::stdin().lock().read_line(&mut line)? == 0 {
            return Err("stdin closed before END".into());
        }
        match line.trim() {
            "GO" => {
                let before = cpu_used()?;
                turn()?;
                let used = cpu_used()?.saturating_sub(before);
                TURNS_CPU_NS.fetch_add(used.as_nanos() as u64, Ordering::Relaxed);
                say("DONE")?;
            }
            "END" => return Ok(()),
            other => return Err(format!("unexpected line {other:?} on stdin").into()),
        }
    }
}

/// Runs `op` `warm` times untimed, then `per_turn` times timed in each turn;
/// microseconds each.
pub(crate) fn time_each(
    warm: usize,
    per_turn: usize,
    mut op: impl FnMut() -> Res<()>,
) -> Res<Vec<f64>> {
    for _ in 0..warm {
        op()?;
    }
    let mut samples = Vec::new();
    lockstep(|| {
        for _ in 0..per_turn {
            let start = Instant::now();
            op()?;
            samples.push(micros(start.elapsed()));
        }
        Ok(())
    })?;
    Ok(samples)
}

pub(crate) fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// `p50`, `p99` (microseconds) and `n` of `samples`, under `prefix`.
pub(crate) fn latency(figures: &mut Figures, prefix: &str, mut samples: Vec<f64>) {
    figures.insert(format!("{prefix}n"), samples.len() as f64);
    if let Some(p50) = quantile(&mut samples, 0.5) {
        figures.insert(format!("{prefix}p50"), p50);
    }
    if let Some(p99) = quantile(&mut samples, 0.99) {
        figures.insert(format!("{prefix}p99"), p99);
    }
}

/// The untimed warm-up before `n` timed operations.
pub(crate) fn warm_up(n: usize) -> usize {
    (n / 10).max(20)
}
