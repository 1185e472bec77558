//! The driver: starts five `redis-server`s and five delaying proxies, runs
//! every implementation of every case in a child process per round, and
//! renders the report.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use crate::child::Res;
use crate::plan::{Case, Cpus, Figures, Impl, Section, Sizes};
use crate::report;
use crate::support::{FaultProxy, Mode, TestServer};

/// Each proxy delays 10 ms each way: a 20 ms round trip.
const LINK_DELAY: Duration = Duration::from_millis(10);
/// A child (or a pair in lockstep) still running after this long is killed
/// and counted as failed.
const CHILD_DEADLINE: Duration = Duration::from_secs(300);

const USAGE: &str = "usage: respire-compare [--quick] [--rounds N] [--cases LIST] \
[--pairs N] [--redlock-pairs N] [--redlock-node-timeout-ms N] [--contenders N] [--handoff-ms N] [--hold-ms N] \
[--slow-attempts N] [--waiters N] [--idle-ms N] [--blocks N] [--impls LIST] [--markdown PATH]";

/// What the command line asks for.
pub(crate) struct Options {
    pub(crate) sizes: Sizes,
    pub(crate) quick: bool,
    pub(crate) cases: Vec<Case>,
    /// Run case 6, the server's CPU per operation (`server_cpu`).
    pub(crate) server_cpu: bool,
    /// Only these implementations (each still paired with its baseline);
    /// `None`: all.
    impls: Option<Vec<String>>,
    markdown: Option<PathBuf>,
}

/// Pins every thread of process `pid` to the CPUs in `list`.
pub(crate) fn pin(pid: u32, list: &str) -> Res<()> {
    let status = Command::new("taskset")
        .arg("-a")
        .arg("-pc")
        .arg(list)
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run taskset: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("taskset -a -pc {list} {pid} failed: {status}").into())
    }
}

/// Starts children pinned to some CPUs.
pub(crate) struct Launcher {
    pub(crate) exe: PathBuf,
    pub(crate) cpus: String,
}

impl Launcher {
    fn command(&self, args: &[String]) -> Command {
        let mut cmd = Command::new("taskset");
        cmd.arg("-c").arg(&self.cpus).arg(&self.exe).args(args);
        cmd
    }
}

fn parse(args: &[String]) -> Result<Options, String> {
    let quick = args.iter().any(|a| a == "--quick");
    let mut options = Options {
        sizes: if quick { Sizes::quick() } else { Sizes::full() },
        quick,
        cases: Case::ALL.to_vec(),
        server_cpu: true,
        impls: None,
        markdown: None,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let Some(name) = arg.strip_prefix("--") else {
            return Err(format!("unexpected argument {arg:?}\n{USAGE}"));
        };
        if name == "quick" {
            continue;
        }
        if name == "help" {
            return Err(USAGE.into());
        }
        let value = it
            .next()
            .ok_or_else(|| format!("--{name} needs a value\n{USAGE}"))?;
        match name {
            "markdown" => options.markdown = Some(PathBuf::from(value)),
            "cases" => {
                options.server_cpu = value.split(',').any(|c| c == crate::server_cpu::CASE);
                options.cases = value
                    .split(',')
                    .filter(|c| *c != crate::server_cpu::CASE)
                    .map(|c| Case::parse(c).ok_or_else(|| format!("unknown case {c:?}")))
                    .collect::<Result<_, _>>()?;
                options.cases.sort();
                options.cases.dedup();
            }
            "impls" => {
                let known = |name: &str| Case::ALL.iter().any(|c| c.find(name).is_some());
                if let Some(unknown) = value.split(',').find(|i| !known(i)) {
                    return Err(format!("unknown implementation {unknown:?}\n{USAGE}"));
                }
                options.impls = Some(value.split(',').map(str::to_owned).collect());
            }
            _ => options.sizes.set(name, value)?,
        }
    }
    Ok(options)
}

/// What one child run gave.
#[derive(Debug, Default)]
pub(crate) struct Run {
    /// The round it ran in (from 0).
    pub(crate) round: usize,
    pub(crate) figures: Option<Figures>,
    pub(crate) notes: Vec<String>,
    pub(crate) error: Option<String>,
    pub(crate) secs: f64,
    /// The run of the baseline it was paired with (an index into the
    /// baseline's runs), for an implementation that is not its own baseline.
    pub(crate) baseline_run: Option<usize>,
}

/// Every run by case and implementation name, in the order they ran.
pub(crate) type Results = BTreeMap<(Section, &'static str), Vec<Run>>;

/// The runs of one round of one case, in order: each implementation right
/// next to its baseline (the pair's order flipping from one pair and round
/// to the next), so that each ratio divides two runs taken a moment apart;
/// the pairs in an order rotated by one place each round. A case without
/// baselines runs each implementation once, in a rotated order. Only the
/// implementations `chosen` names run (all when `None`), each with its
/// baseline.
fn schedule(
    case: Case,
    round: usize,
    chosen: Option<&[String]>,
) -> Vec<(&'static Impl, Option<&'static Impl>)> {
    let wanted = |i: &Impl| chosen.is_none_or(|c| c.iter().any(|n| n == i.name));
    let paired: Vec<&'static Impl> = case
        .impls()
        .iter()
        .filter(|i| i.baseline.is_some_and(|b| b != i.name) && wanted(i))
        .collect();
    if paired.is_empty()
        && case
            .impls()
            .iter()
            .any(|i| i.baseline.is_some_and(|b| b != i.name))
    {
        return Vec::new();
    }
    let mut order = if paired.is_empty() {
        case.impls()
            .iter()
            .filter(|i| wanted(i))
            .map(|i| (i, None))
            .collect::<Vec<_>>()
    } else {
        paired
            .into_iter()
            .map(|i| (i, i.baseline.and_then(|b| case.find(b))))
            .collect()
    };
    if order.is_empty() {
        return order;
    }
    let turn = round % order.len();
    order.rotate_left(turn);
    order
}

/// Facts about the run the report states.
pub(crate) struct RunInfo {
    pub(crate) wall: Duration,
    pub(crate) redis_version: String,
    pub(crate) cpus: usize,
}

pub(crate) fn main(args: &[String]) -> Res<()> {
    let options = parse(args)?;
    let cpus = thread::available_parallelism().map_or(1, |n| n.get());
    let mut markdown = if options.cases.is_empty() {
        String::new()
    } else {
        cases(&options, cpus)?
    };
    if options.server_cpu {
        if !markdown.is_empty() {
            markdown.push('\n');
        }
        markdown.push_str(&crate::server_cpu::run(
            &options,
            &std::env::current_exe()?,
            cpus,
        )?);
    }
    match &options.markdown {
        Some(path) => std::fs::write(path, markdown)?,
        None => print!("{markdown}"),
    }
    Ok(())
}

/// Runs cases 1 to 5 and renders their report.
fn cases(options: &Options, cpus: usize) -> Res<String> {
    let started = Instant::now();
    let servers: Vec<TestServer> = (0..5).map(|_| TestServer::start()).collect();
    let proxies: Vec<FaultProxy> = servers
        .iter()
        .map(|s| {
            let proxy = FaultProxy::start(s.addr());
            proxy.set_mode(Mode::Delay(LINK_DELAY));
            proxy
        })
        .collect();
    let urls: Vec<String> = servers.iter().map(TestServer::url).collect();
    let slow_urls: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
    let mut admin: Vec<redis::Connection> = servers.iter().map(TestServer::client).collect();
    let info: String = redis::cmd("INFO").arg("server").query(&mut admin[0])?;
    let redis_version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("unknown")
        .trim()
        .to_owned();
    let mut exe = Launcher {
        exe: std::env::current_exe()?,
        cpus: "0".to_owned(),
    };
    let sizes = &options.sizes;
    eprintln!(
        "5 redis-servers {redis_version} on {}; proxies with {LINK_DELAY:?} each way on {}",
        urls.join(","),
        slow_urls.join(",")
    );
    let mut results = Results::new();
    let child_args = |case: Case, imp: &Impl, prefix: String| {
        let mut args = vec![
            "child".to_owned(),
            case.name().to_owned(),
            imp.name.to_owned(),
            format!("urls={}", urls.join(",")),
            format!("slow-urls={}", slow_urls.join(",")),
            format!("prefix={prefix}"),
        ];
        args.extend(
            sizes
                .to_pairs()
                .into_iter()
                .map(|(k, v)| format!("{k}={v}")),
        );
        args
    };
    let record = |results: &mut Results, sec: Section, imp: &'static Impl, run: Run| {
        eprintln!(
            "round {}/{} {:<8} {:<3} {:<14} {:>6.1} s  {}",
            run.round + 1,
            sizes.rounds,
            sec.case.name(),
            match sec.cpus {
                Cpus::One => "1",
                Cpus::Two => "2",
            },
            imp.name,
            run.secs,
            match (&run.figures, &run.error) {
                (_, Some(e)) => format!("FAILED: {e}"),
                (Some(f), None) => summary(f),
                (None, None) => "no result".into(),
            }
        );
        let runs = results.entry((sec, imp.name)).or_default();
        runs.push(run);
        runs.len() - 1
    };
    let sections = Section::all(&options.cases, cpus);
    for round in 0..sizes.rounds {
        for &sec in &sections {
            let case = sec.case;
            let (server_cpus, child_cpus) = sec.cpus.lists(cpus);
            for server in &servers {
                pin(server.pid(), &server_cpus)?;
            }
            exe.cpus = child_cpus;
            for (k, (imp, baseline)) in schedule(case, round, options.impls.as_deref())
                .into_iter()
                .enumerate()
            {
                for conn in &mut admin {
                    redis::cmd("FLUSHALL").query::<()>(conn)?;
                }
                let prefix = |imp: &Impl| format!("r{round}:{k}:{}:", imp.name);
                let Some(baseline) = baseline else {
                    let mut run =
                        Stepper::spawn(&exe, &child_args(case, imp, prefix(imp))).finish();
                    run.round = round;
                    record(&mut results, sec, imp, run);
                    continue;
                };
                let (mut base, mut own) = lockstep_pair(
                    &exe,
                    &child_args(case, baseline, prefix(baseline)),
                    &child_args(case, imp, prefix(imp)),
                    sizes.blocks_for(case),
                    (round + k) % 2 == 0,
                );
                (base.round, own.round) = (round, round);
                let base = record(&mut results, sec, baseline, base);
                own.baseline_run = Some(base);
                record(&mut results, sec, imp, own);
            }
        }
    }
    for conn in &mut admin {
        redis::cmd("FLUSHALL").query::<()>(conn)?;
    }
    drop(proxies);
    drop(servers);
    let info = RunInfo {
        wall: started.elapsed(),
        redis_version,
        cpus,
    };
    let markdown = report::render(options, &results, &info);
    eprintln!("done in {:.0} s", info.wall.as_secs_f64());
    Ok(markdown)
}

/// The headline figures of a run, for the progress line.
fn summary(f: &Figures) -> String {
    [
        "p50",
        "p99",
        "reacquired",
        "success",
        "acquire_ms_p50",
        "per_s",
    ]
    .iter()
    .filter_map(|k| f.get(*k).map(|v| format!("{k}={v:.2}")))
    .collect::<Vec<_>>()
    .join(" ")
}

/// Runs a baseline's child and an implementation's child in lockstep: both
/// set up (one after the other), then take `turns` turns each, one child at a
/// time, `baseline_first` deciding who starts; the order flips every turn
/// (ABBA…) so that a drift in the machine's speed hits both alike. A child
/// that fails drops out; the other finishes its turns.
fn lockstep_pair(
    exe: &Launcher,
    baseline: &[String],
    own: &[String],
    turns: usize,
    baseline_first: bool,
) -> (Run, Run) {
    let deadline = Instant::now() + CHILD_DEADLINE;
    let mut b = Stepper::spawn(exe, baseline);
    b.expect("READY", deadline);
    let mut x = Stepper::spawn(exe, own);
    x.expect("READY", deadline);
    for turn in 0..turns {
        let order = if (turn % 2 == 0) == baseline_first {
            [&mut b, &mut x]
        } else {
            [&mut x, &mut b]
        };
        for child in order {
            if child.send("GO") {
                child.expect("DONE", deadline);
            }
        }
    }
    for child in [&mut b, &mut x] {
        child.send("END");
    }
    (b.finish(), x.finish())
}

/// A running child: its stdin, its stdout lines as they come, its stderr.
pub(crate) struct Stepper {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Option<thread::JoinHandle<String>>,
    run: Run,
    started: Instant,
}

impl Stepper {
    pub(crate) fn spawn(exe: &Launcher, args: &[String]) -> Stepper {
        let started = Instant::now();
        let (tx, lines) = crossbeam_channel::unbounded();
        let mut stepper = Stepper {
            child: None,
            stdin: None,
            lines,
            stderr: None,
            run: Run::default(),
            started,
        };
        let spawned = exe
            .command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                stepper.run.error = Some(format!("cannot start the child: {e}"));
                return stepper;
            }
        };
        let stdout = child.stdout.take().expect("piped stdout");
        let mut stderr = child.stderr.take().expect("piped stderr");
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        stepper.stderr = Some(thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        }));
        stepper.stdin = child.stdin.take();
        stepper.child = Some(child);
        stepper
    }

    fn alive(&self) -> bool {
        self.child.is_some() && self.run.error.is_none()
    }

    fn fail(&mut self, why: String) {
        if self.run.error.is_none() {
            self.run.error = Some(why);
        }
    }

    /// Keeps what a `RESULT` or `NOTE` line says.
    fn take(&mut self, line: &str) {
        if let Some(rest) = line.strip_prefix("RESULT ") {
            let mut figures = Figures::new();
            for kv in rest.split_whitespace() {
                if let Some((k, v)) = kv.split_once('=')
                    && let Ok(v) = v.parse()
                {
                    figures.insert(k.to_owned(), v);
                }
            }
            self.run.figures = Some(figures);
        } else if let Some(note) = line.strip_prefix("NOTE ") {
            self.run.notes.push(note.to_owned());
        }
    }

    /// Writes `word` to the child's stdin; whether it could.
    pub(crate) fn send(&mut self, word: &str) -> bool {
        if !self.alive() {
            return false;
        }
        let sent = self.stdin.as_mut().is_some_and(|stdin| {
            writeln!(stdin, "{word}")
                .and_then(|()| stdin.flush())
                .is_ok()
        });
        if !sent {
            self.fail(format!("could not send {word}"));
        }
        sent
    }

    /// Reads lines until `word`; marks the child failed if it ends first or
    /// `deadline` passes.
    pub(crate) fn expect(&mut self, word: &str, deadline: Instant) {
        while self.alive() {
            match self.lines.recv_deadline(deadline) {
                Ok(line) if line == word => return,
                Ok(line) => self.take(&line),
                Err(RecvTimeoutError::Timeout) => self.fail(format!("no {word} by the deadline")),
                Err(RecvTimeoutError::Disconnected) => self.fail(format!("ended before {word}")),
            }
        }
    }

    /// Waits for the child to end (killing it at the deadline) and returns
    /// what it gave.
    pub(crate) fn finish(mut self) -> Run {
        let deadline = self.started + CHILD_DEADLINE;
        drop(self.stdin.take());
        if let Some(mut child) = self.child.take() {
            loop {
                match self.lines.recv_deadline(deadline) {
                    Ok(line) => self.take(&line),
                    Err(RecvTimeoutError::Disconnected) => break,
                    Err(RecvTimeoutError::Timeout) => {
                        let _ = child.kill();
                        self.fail(format!("killed after {CHILD_DEADLINE:?}"));
                        break;
                    }
                }
            }
            match child.wait() {
                Ok(status) if status.success() => {
                    if self.run.figures.is_none() {
                        self.fail("no RESULT line".into());
                    }
                }
                Ok(status) => self.fail(status.to_string()),
                Err(e) => self.fail(format!("cannot wait for the child: {e}")),
            }
        }
        let stderr = self
            .stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        if let Some(e) = self.run.error.take() {
            let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            self.run.error = Some(format!("{e}: {}", tail.join(" / ")));
            self.run.figures = None;
        }
        self.run.secs = self.started.elapsed().as_secs_f64();
        self.run
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn quick_then_overrides() {
        let o = parse(&args("--rounds 3 --quick --cases idle,single")).unwrap();
        assert!(o.quick);
        assert_eq!(o.sizes.rounds, 3);
        assert_eq!(o.sizes.pairs, Sizes::quick().pairs);
        assert_eq!(o.cases, vec![Case::Single, Case::Idle]);
        assert!(!o.server_cpu);
        let o = parse(&args("--cases server-cpu")).unwrap();
        assert!(o.cases.is_empty());
        assert!(o.server_cpu);
        assert!(parse(&args("")).unwrap().server_cpu);
    }

    #[test]
    fn every_implementation_runs_next_to_its_baseline_every_round() {
        for case in Case::ALL {
            for round in 0..3 {
                let runs = schedule(case, round, None);
                for imp in case.impls() {
                    let own = imp.baseline.is_some_and(|b| b != imp.name);
                    let alone = imp.baseline.is_none();
                    let count = runs.iter().filter(|(i, _)| i.name == imp.name).count();
                    if own || alone {
                        assert_eq!(count, 1, "{} {}", case.name(), imp.name);
                    }
                }
                for (imp, base) in &runs {
                    assert_eq!(
                        base.map(|b| b.name),
                        imp.baseline.filter(|b| *b != imp.name)
                    );
                }
            }
        }
    }

    #[test]
    fn chosen_implementations_run_next_to_their_baselines_alone() {
        let chosen = ["lock".to_owned(), "lock-shared".to_owned()];
        let runs = schedule(Case::Handoff, 1, Some(&chosen));
        let mut names: Vec<_> = runs
            .iter()
            .map(|(i, b)| (i.name, b.map(|b| b.name)))
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                ("lock", Some("raw-tracking")),
                ("lock-shared", Some("raw-tracking"))
            ]
        );
        // A case none of whose implementations was chosen does not run.
        assert!(schedule(Case::Redlock, 0, Some(&chosen)).is_empty());
        assert!(parse(&args("--impls lock,nope")).is_err());
        let o = parse(&args("--impls lock,lock-shared")).unwrap();
        assert_eq!(o.impls.as_deref(), Some(&chosen[..]));
    }

    #[test]
    fn bad_arguments_are_refused() {
        assert!(parse(&args("--rounds")).is_err());
        assert!(parse(&args("--rounds 0")).is_err());
        assert!(parse(&args("--cases nope")).is_err());
        assert!(parse(&args("stray")).is_err());
        assert!(parse(&args("--frobs 2")).is_err());
    }
}
