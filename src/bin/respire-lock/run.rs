//! `respire-lock run`: take the lease, run the command's process group under
//! it, stop the group if the lease is lost, release the lease after.
//! `respire-lock elect` is the same supervision under a leadership.

use std::ffi::OsString;
use std::hash::{BuildHasher as _, Hasher as _};
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime};

use clap::ArgMatches;
use clap::parser::ValueSource;
use crossbeam_channel::{Receiver, select};
use nix::sys::signal::SigSet;
use parking_lot::Mutex;
use respire_coordination::{
    CancelToken, Coordinator, Error, Kind, Leadership, Lease, LeaseGuard, MAX_TTL, NodeOutcome,
    RedlockGroup, RedlockGuard, RedlockOptions, ReleaseOutcome,
};
use rustix::process::{Pid, Signal};
use signal_hook::consts::{SIGCHLD, SIGCONT, SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGTSTP};

use crate::args::{EXIT_USAGE, ElectArgs, RunArgs, Usage, Wait, check_run, settle_run};
use crate::endpoint::{self, Tls};
use crate::json::{self, Object};
use crate::losses::{self, Loss};
use crate::supervise::{self, Guardian};
use crate::{EXIT_CANNOT_RUN, EXIT_UNAVAILABLE, say};

/// How often a wait checks that the deployment answers.
const PROBE_EVERY: Duration = Duration::from_secs(5);

/// The signals passed on to the command's group (and that end a wait).
const FORWARDED: [i32; 4] = [SIGHUP, SIGINT, SIGQUIT, SIGTERM];

/// Where the lease is taken.
enum Target {
    Url(String),
    Throwaway,
    Redlock(Vec<String>),
}

/// Picks the deployment: the command line beats the environment; `--url`,
/// `--redlock` and `--throwaway` together on the command line are refused;
/// from the environment, `RESPIRE_LOCK_REDLOCK` beats `REDIS_URL`. Nothing
/// at all is a usage error.
fn target(args: &RunArgs, matches: &ArgMatches, subcommand: &str) -> Result<Target, Usage> {
    let on_command_line = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    let given = ["url", "redlock", "throwaway"]
        .into_iter()
        .filter(|id| {
            on_command_line(id) && (*id != "throwaway" || args.throwaway) && {
                *id != "url" || args.url.is_some()
            }
        })
        .count();
    if given > 1 {
        return Err(Usage::new(
            "--url, --redlock and --throwaway exclude each other",
            Some(subcommand),
        ));
    }
    Ok(match (&args.url, &args.redlock) {
        _ if args.throwaway && on_command_line("throwaway") => Target::Throwaway,
        (Some(url), _) if on_command_line("url") => Target::Url(url.clone()),
        (_, Some(urls)) => Target::Redlock(urls.0.clone()),
        (Some(url), None) => Target::Url(url.clone()),
        (None, None) if args.throwaway => Target::Throwaway,
        (None, None) => {
            return Err(Usage::new(
                "no Redis deployment given: set --url or REDIS_URL (or --redlock; \
                 --throwaway to try the tool on a private server)",
                Some(subcommand),
            ));
        }
    })
}

pub(crate) fn main(args: RunArgs, matches: &ArgMatches) -> ExitCode {
    let args = match settle_run(args, matches, "run") {
        Ok(args) => args,
        Err(usage) => {
            usage.print();
            return ExitCode::from(EXIT_USAGE);
        }
    };
    drive(&args, matches, "run", |run, target| match target {
        Target::Redlock(urls) => run.redlock(&urls),
        Target::Url(url) => run.single(&url),
        Target::Throwaway => run.on_throwaway(|run, url| run.single(url)),
    })
}

/// `respire-lock elect`: `run`'s supervision, under a leadership.
pub(crate) fn elect_main(mut args: ElectArgs, matches: &ArgMatches) -> ExitCode {
    args.run = match settle_run(args.run, matches, "elect") {
        Ok(run) => run,
        Err(usage) => {
            usage.print();
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let value = args.value.clone().unwrap_or_else(default_value);
    drive(&args.run, matches, "elect", |run, target| match target {
        Target::Url(url) => run.elect(&url, &value, args.recampaign),
        Target::Throwaway => run.on_throwaway(|run, url| run.elect(url, &value, args.recampaign)),
        // Refused before anything starts.
        Target::Redlock(_) => ExitCode::from(EXIT_USAGE),
    })
}

/// This host's name and this process's id, `host:pid`: what a leader
/// advertises unless told otherwise.
fn default_value() -> String {
    format!("{}:{}", hostname(), std::process::id())
}

/// This host's name (`localhost` when it has none).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Who holds a run's lease: `--holder`, or this host's name, this process's
/// id and the command's program name, `host pid N: program`. Never the
/// command's arguments (they may carry passwords or tokens, and anyone who
/// can read the key reads this) nor anything of the URL. Control characters
/// are replaced and the text cut to what a lease records.
fn holder(args: &RunArgs) -> String {
    if let Some(h) = &args.holder {
        return h.clone();
    }
    let program = std::path::Path::new(&args.command[0])
        .file_name()
        .map_or_else(
            || args.command[0].to_string_lossy(),
            |n| n.to_string_lossy(),
        )
        .into_owned();
    let text = format!("{} pid {}: {program}", hostname(), std::process::id());
    let mut out = String::with_capacity(text.len());
    for c in text.chars().map(|c| if c.is_control() { '?' } else { c }) {
        if out.len() + c.len_utf8() > respire_coordination::MAX_HOLDER_LEN {
            break;
        }
        out.push(c);
    }
    out
}

/// Checks everything before anything is sent, then runs `body` on the
/// deployment with the signal handlers and the guardian in place.
fn drive(
    args: &RunArgs,
    matches: &ArgMatches,
    subcommand: &str,
    body: impl FnOnce(&mut Run<'_>, Target) -> ExitCode,
) -> ExitCode {
    let prepared = (|| {
        let target = target(args, matches, subcommand)?;
        if subcommand == "elect"
            && (matches!(target, Target::Redlock(_)) || args.shared || args.max.is_some())
        {
            return Err(Usage::new(
                "--redlock, --shared and --max do not apply to elect: a leader's term is a \
                 fencing token, which needs the one counter of one deployment (--url)",
                Some(subcommand),
            ));
        }
        if let Target::Redlock(_) = &target
            && let Some(list) = &args.redlock
        {
            list.check(subcommand)?;
        }
        check_run(args, subcommand)?;
        if matches!(target, Target::Redlock(_)) && (args.shared || args.max.is_some()) {
            return Err(Usage::new(
                "--shared and --max need one deployment (--url): a Redlock group has neither mode",
                Some(subcommand),
            ));
        }
        let tls = Tls::read(&args.tls, subcommand)?;
        let events = Events::open(args, subcommand)?;
        Ok((target, tls, events))
    })();
    let (target, tls, events) = match prepared {
        Ok(p) => p,
        Err(usage) => {
            usage.print();
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let report = Reporter {
        events,
        verbose: args.verbose,
        key: args.key.clone(),
    };
    let signals = match signals() {
        Ok(rx) => rx,
        Err(e) => {
            return report.error(
                EXIT_CANNOT_RUN,
                &format!("cannot install signal handlers: {e}"),
            );
        }
    };
    let mut guardian = Guardian::lazy();
    let mut run = Run {
        args,
        report: &report,
        signals: &signals,
        guardian: &mut guardian,
        tls: &tls,
    };
    body(&mut run, target)
}

/// The mode of a single-deployment run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Exclusive,
    Shared,
    Counted(u32),
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Exclusive => "fenced",
            Mode::Shared => "shared",
            Mode::Counted(_) => "counted",
        }
    }
}

/// What a grant gives the command.
struct Grant {
    lease_key: String,
    token: Option<u64>,
    write_epoch: Option<u64>,
    slot: Option<u32>,
}

impl Grant {
    fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![("RESPIRE_LOCK_KEY", self.lease_key.clone())];
        if let Some(t) = self.token {
            env.push(("RESPIRE_FENCING_TOKEN", t.to_string()));
        }
        if let Some(e) = self.write_epoch {
            env.push(("RESPIRE_WRITE_EPOCH", e.to_string()));
        }
        if let Some(s) = self.slot {
            env.push(("RESPIRE_LOCK_SLOT", s.to_string()));
        }
        env
    }
}

/// One run: the options and what it reports to.
struct Run<'a> {
    args: &'a RunArgs,
    report: &'a Reporter,
    signals: &'a Receiver<i32>,
    guardian: &'a mut Guardian,
    tls: &'a Tls,
}

impl Run<'_> {
    fn single(&mut self, url: &str) -> ExitCode {
        let args = self.args;
        let coord = match endpoint::connect(url, &args.keys, self.tls) {
            Ok(c) => c,
            Err(e) if endpoint::is_usage(&e) => {
                return self.report.error(EXIT_USAGE, &e.to_string());
            }
            Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
        };
        let base = endpoint::base(&args.key);
        let mode = match (args.shared, args.max) {
            (true, _) => Mode::Shared,
            (false, Some(n)) => Mode::Counted(n),
            (false, None) => Mode::Exclusive,
        };
        // Every lease of the run records who holds it.
        let who = holder(args);
        let code = match mode {
            Mode::Exclusive | Mode::Shared => {
                let rw = match coord.read_write_lease(&base) {
                    Ok(rw) => rw,
                    Err(e) => return self.report.error(EXIT_USAGE, &e.to_string()),
                };
                if mode == Mode::Exclusive {
                    let lease = match rw.write().with_holder(&who) {
                        Ok(l) => l,
                        Err(e) => return self.report.error(EXIT_USAGE, &e.to_string()),
                    };
                    self.hold(&coord, mode, &lease, |g| Grant {
                        lease_key: g.key().to_owned(),
                        token: Some(g.fencing_token().get()),
                        write_epoch: None,
                        slot: None,
                    })
                } else {
                    let lease = match rw.read().with_holder(&who) {
                        Ok(l) => l,
                        Err(e) => return self.report.error(EXIT_USAGE, &e.to_string()),
                    };
                    self.hold(&coord, mode, &lease, |g| Grant {
                        lease_key: g.key().to_owned(),
                        token: None,
                        write_epoch: Some(g.write_epoch().get()),
                        slot: None,
                    })
                }
            }
            Mode::Counted(n) => {
                let sem = match coord.semaphore(&base, n).and_then(|s| s.with_holder(&who)) {
                    Ok(s) => s,
                    Err(e) => return self.report.error(EXIT_USAGE, &e.to_string()),
                };
                self.hold(&coord, mode, &sem, |g| Grant {
                    lease_key: g.key().to_owned(),
                    token: Some(g.fencing_token().get()),
                    write_epoch: None,
                    slot: Some(g.slot()),
                })
            }
        };
        drop(coord);
        code
    }

    /// Takes `lease`, runs the command under it, releases it.
    fn hold<K: Kind>(
        &mut self,
        coord: &Coordinator,
        mode: Mode,
        lease: &Lease<K>,
        grant: impl Fn(&LeaseGuard<K>) -> Grant,
    ) -> ExitCode {
        let (ttl, base) = (self.args.ttl, endpoint::base(&self.args.key));
        let guard = match self.acquire(
            |deadline, cancel| match deadline {
                Some(d) if d <= Instant::now() => lease.try_acquire(ttl),
                Some(d) => lease.acquire_until(ttl, d, cancel),
                None => lease.acquire(ttl, cancel).map(Some),
            },
            |_| other_mode(coord, &base, mode),
            |g| drop(g.release()),
            || coord.inspect(&base).map(drop).map_err(|e| e.to_string()),
        ) {
            Ok(guard) => guard,
            Err(code) => return code,
        };
        let renewal = match guard.keep_alive() {
            Ok(r) => r,
            Err(e @ Error::InvalidArgument(_)) => {
                return self.report.error(EXIT_USAGE, &e.to_string());
            }
            Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
        };
        let grant = grant(&guard);
        self.report.acquired(&grant, mode.name(), ttl);
        let why_lost = library_loss;
        let held = Held {
            lost: guard.lost_signal(),
            remaining: &|| guard.remaining_estimate(),
            is_lost: &|| guard.is_lost(),
            why_lost: &why_lost,
        };
        let ended = self.run_child(&grant.env(), &held);
        drop(renewal);
        let (outcome, detail) = release_words(guard.release());
        self.report.released(outcome, detail.as_deref());
        self.finish(ended)
    }

    /// Starts a throwaway server, runs `body` on it, stops it.
    fn on_throwaway(&mut self, body: impl FnOnce(&mut Self, &str) -> ExitCode) -> ExitCode {
        let server = match ThrowawayServer::start(self.guardian) {
            Ok(server) => server,
            Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e),
        };
        self.report.throwaway(&server.url(), &server.dir);
        let code = body(self, &server.url());
        server.stop(self.guardian);
        code
    }

    /// Campaigns for NAME, runs the command while leader, resigns after;
    /// with `recampaign`, a lost leadership means campaigning again.
    fn elect(&mut self, url: &str, value: &str, recampaign: bool) -> ExitCode {
        let args = self.args;
        let coord = match endpoint::connect(url, &args.keys, self.tls) {
            Ok(c) => c,
            Err(e) if endpoint::is_usage(&e) => {
                return self.report.error(EXIT_USAGE, &e.to_string());
            }
            Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
        };
        let election = match coord.election(&endpoint::base(&args.key)) {
            Ok(e) => e,
            Err(e) => return self.report.error(EXIT_USAGE, &e.to_string()),
        };
        let ttl = args.ttl;
        loop {
            let leadership = match self.acquire(
                |deadline, cancel| match deadline {
                    Some(d) if d <= Instant::now() => election.try_campaign(value, ttl),
                    Some(d) => election.campaign_until(value, ttl, d, cancel),
                    None => election.campaign(value, ttl, cancel).map(Some),
                },
                |_| Ok(None),
                |l: Leadership| drop(l.resign()),
                || election.leader().map(drop).map_err(|e| e.to_string()),
            ) {
                Ok(l) => l,
                Err(code) => return code,
            };
            let renewal = match leadership.keep_alive() {
                Ok(r) => r,
                Err(e @ Error::InvalidArgument(_)) => {
                    return self.report.error(EXIT_USAGE, &e.to_string());
                }
                Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
            };
            let term = leadership.term();
            let grant = Grant {
                lease_key: election.lease_key().to_owned(),
                token: Some(term.get()),
                write_epoch: None,
                slot: None,
            };
            self.report.acquired(&grant, "leader", ttl);
            let mut env = grant.env();
            env.push(("RESPIRE_LEADER_TERM", term.to_string()));
            env.push(("RESPIRE_LEADER_VALUE", value.to_owned()));
            let why_lost = library_loss;
            let held = Held {
                lost: leadership.lost_signal(),
                remaining: &|| leadership.remaining_estimate(),
                is_lost: &|| leadership.is_lost(),
                why_lost: &why_lost,
            };
            let ended = self.run_child(&env, &held);
            drop(renewal);
            let (outcome, detail) = release_words(leadership.resign());
            self.report.released(outcome, detail.as_deref());
            match ended {
                Ended::LeaseLost(_) | Ended::LostBeforeStart if recampaign => {
                    self.report.recampaign()
                }
                ended => return self.finish(ended),
            }
        }
    }

    fn redlock(&mut self, urls: &[String]) -> ExitCode {
        let args = self.args;
        let options = RedlockOptions {
            node_timeout: args.keys.node_timeout,
            ..RedlockOptions::default()
        }
        .with_observer(losses::observer());
        // One coordinator per node: the group's settings, and the inspection
        // of what other modes hold there. A group is made only when every
        // node answers (their independence is checked then).
        let mut nodes = Vec::new();
        for url in urls {
            match endpoint::connect(url, &args.keys, self.tls) {
                Ok(c) => nodes.push(c),
                Err(e) if endpoint::is_usage(&e) => {
                    return self.report.error(EXIT_USAGE, &e.to_string());
                }
                Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
            }
        }
        let group = match RedlockGroup::new(nodes.clone(), options)
            .and_then(|g| g.with_holder(&holder(args)))
        {
            Ok(g) => g,
            Err(e) if endpoint::is_usage(&e) => {
                return self.report.error(EXIT_USAGE, &e.to_string());
            }
            Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
        };
        let name = endpoint::redlock_key(&args.key);
        let base = endpoint::base(&args.key);
        let (name, ttl) = (&name, args.ttl);
        let guard = match self.acquire(
            |deadline, cancel| match deadline {
                Some(d) if d <= Instant::now() => group.try_acquire(name, ttl),
                Some(d) => group.acquire_until(name, ttl, d, cancel),
                None => group.acquire(name, ttl, cancel).map(Some),
            },
            |g: &RedlockGuard| {
                // An exclusive run of one deployment can use any node, so the
                // group must hold the key on every node it reaches, not only
                // on a quorum. An acquire returns at a quorum; this extension
                // hears every node and says which ones hold it.
                let _ = g.extend_on_every_node(ttl);
                let evidence = g.last_evidence();
                for (i, n) in evidence.iter().enumerate() {
                    match &n.outcome {
                        // The node confirmed the extension: it holds this
                        // run's value.
                        NodeOutcome::Granted | NodeOutcome::Uncounted(_) => {}
                        NodeOutcome::HeldByAnother { .. } | NodeOutcome::Missing => {
                            return Ok(Some(format!(
                                "exclusive on {} (a fenced run there, or another Redlock run)",
                                n.node
                            )));
                        }
                        // No answer. What the node holds cannot tell this
                        // run's value from another Redlock run's, about to be
                        // deleted there: a node that answers an inspection
                        // counts as held, one that refuses connections runs
                        // no server.
                        _ => match nodes.get(i).map(|c| c.inspect(&base)) {
                            Some(Ok(_)) => {
                                return Ok(Some(format!(
                                    "unknown: {} did not confirm this run's grant ({})",
                                    n.node, n.outcome
                                )));
                            }
                            Some(Err(e)) => {
                                if let Some(why) = unread(&n.node, &e) {
                                    return Ok(Some(why));
                                }
                            }
                            None => {}
                        },
                    }
                }
                // What shared and counted runs hold on any reachable node.
                for (i, node) in nodes.iter().enumerate() {
                    match node.inspect(&base) {
                        Ok(ins) => {
                            if let Some(other) = describe_others(&ins, true) {
                                return Ok(Some(other));
                            }
                        }
                        Err(e) => {
                            let name = evidence
                                .get(i)
                                .map_or_else(|| format!("node {}", i + 1), |n| n.node.clone());
                            if let Some(why) = unread(&name, &e) {
                                return Ok(Some(why));
                            }
                        }
                    }
                }
                Ok(None)
            },
            |mut g: RedlockGuard| drop(g.release()),
            || {
                let answering = nodes.iter().filter(|n| n.inspect(&base).is_ok()).count();
                if answering * 2 > nodes.len() {
                    Ok(())
                } else {
                    Err(format!(
                        "{answering} of {} nodes answer, no quorum",
                        nodes.len()
                    ))
                }
            },
        ) {
            Ok(guard) => guard,
            Err(code) => return code,
        };
        let renewal = match guard.keep_alive() {
            Ok(r) => r,
            Err(e @ Error::InvalidArgument(_)) => {
                return self.report.error(EXIT_USAGE, &e.to_string());
            }
            Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
        };
        let grant = Grant {
            lease_key: format!("{}{}", args.keys.prefix, endpoint::redlock_key(&args.key)),
            token: None,
            write_epoch: None,
            slot: None,
        };
        self.report.acquired(&grant, "redlock", ttl);
        let why_lost = || redlock_loss(&guard);
        let held = Held {
            lost: guard.lost_signal(),
            remaining: &|| guard.remaining_estimate(),
            is_lost: &|| guard.is_lost(),
            why_lost: &why_lost,
        };
        let ended = self.run_child(&grant.env(), &held);
        drop(renewal);
        let mut guard = guard;
        match guard.release() {
            Ok(true) => self.report.released("released", None),
            Ok(false) => self.report.released(
                "lapsed",
                Some("it had already expired or been taken over on some nodes"),
            ),
            Err(e) => self.report.released("failed", Some(&e.to_string())),
        }
        self.finish(ended)
    }

    /// Waits for the lease as `--wait` / `-n` say; HUP, INT, QUIT and TERM
    /// cancel the wait. A grant that finds KEY held in another mode is given
    /// back, and the wait goes on after a short pause. On failure, returns the
    /// exit code to end with.
    fn acquire<G>(
        &self,
        mut attempt: impl FnMut(
            Option<Instant>,
            &CancelToken,
        ) -> respire_coordination::Result<Option<G>>,
        mut conflict: impl FnMut(&G) -> respire_coordination::Result<Option<String>>,
        mut give_back: impl FnMut(G),
        probe: impl Fn() -> Result<(), String> + Sync,
    ) -> Result<G, ExitCode> {
        let (args, report) = (self.args, self.report);
        // A loss reported from now on is this lease's.
        losses::forget();
        let cancel = CancelToken::new();
        let wait = if args.nonblock {
            Wait::For(Duration::ZERO)
        } else {
            args.wait
        };
        let deadline = deadline(wait, Instant::now());
        let signals = self.signals;
        let (result, signal) = std::thread::scope(|s| {
            let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
            let cancel = &cancel;
            // A wait rides out a deployment that does not answer; say so
            // rather than wait in silence, and say when it answers again.
            let probe = &probe;
            let probe_done = done_rx.clone();
            s.spawn(move || {
                let mut silent = false;
                loop {
                    select! {
                        recv(probe_done) -> _ => return,
                        recv(crossbeam_channel::after(PROBE_EVERY)) -> _ => {}
                    }
                    match probe() {
                        Err(why) if !silent => {
                            silent = true;
                            report.unreachable(&why);
                        }
                        Ok(()) if silent => {
                            silent = false;
                            report.reachable();
                        }
                        _ => {}
                    }
                }
            });
            let watcher = s.spawn(move || {
                loop {
                    select! {
                        recv(signals) -> sig => match sig {
                            Ok(sig) if FORWARDED.contains(&sig) => {
                                cancel.cancel();
                                return Some(sig);
                            }
                            Err(_) => {
                                cancel.cancel();
                                return None;
                            }
                            Ok(_) => {}
                        },
                        recv(done_rx) -> _ => return None,
                    }
                }
            });
            let result = loop {
                let guard = match attempt(deadline, cancel) {
                    Ok(Some(g)) => g,
                    other => break other.map(|_| None).map_err(|e| (e, None)),
                };
                match conflict(&guard) {
                    Ok(None) => break Ok(Some(guard)),
                    Ok(Some(other)) => {
                        give_back(guard);
                        let now = Instant::now();
                        if deadline.is_some_and(|d| d <= now) {
                            break Err((Error::Cancelled, Some(other)));
                        }
                        let pause = backoff().min(
                            deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(now)),
                        );
                        select! {
                            recv(cancel.receiver()) -> _ => break Err((Error::Cancelled, None)),
                            recv(crossbeam_channel::after(pause)) -> _ => {}
                        }
                    }
                    Err(e) => {
                        give_back(guard);
                        break Err((e, None));
                    }
                }
            };
            drop(done_tx);
            (result, watcher.join().unwrap_or(None))
        });
        match result {
            // A signal that came while the grant was being checked: the
            // command never starts.
            Ok(Some(guard)) if signal.is_some() => {
                give_back(guard);
                Err(report.interrupted(signal.unwrap_or(SIGINT)))
            }
            Ok(Some(guard)) => Ok(guard),
            Ok(None) => Err(report.not_acquired(args.conflict_exit_code, None)),
            Err((Error::Cancelled, Some(other))) => {
                Err(report.not_acquired(args.conflict_exit_code, Some(&other)))
            }
            Err((Error::Cancelled, None)) => Err(report.interrupted(signal.unwrap_or(SIGINT))),
            Err((e, _)) if endpoint::is_usage(&e) => Err(report.error(EXIT_USAGE, &e.to_string())),
            Err((e, _)) => Err(report.error(EXIT_UNAVAILABLE, &e.to_string())),
        }
    }

    /// Starts the command in its own process group and supervises it until it
    /// and its group are gone. The guardian stops the group when the loss
    /// deadline of `held` passes, even if this process cannot.
    fn run_child(&mut self, env: &[(&str, String)], held: &Held<'_>) -> Ended {
        let args = self.args;
        let program = &args.command[0];
        if let Err(why) = supervise::resolve(program) {
            return Ended::CannotStart(why);
        }
        if let Err(e) = self.guardian.ensure_started() {
            return Ended::CannotStart(format!("cannot start the guardian: {e}"));
        }
        let deadline = self.loss_deadline(held);
        let child =
            supervise::command(program, &args.command[1..], Some(deadline)).and_then(|mut cmd| {
                cmd.envs(env.iter().map(|(k, v)| (k, v)))
                    .stdin(Stdio::inherit())
                    .spawn()
            });
        let mut child = match child {
            Ok(child) => child,
            Err(e) => return Ended::CannotStart(format!("cannot run {program:?}: {e}")),
        };
        let pgid = child.id() as i32;
        // The command runs only once the guardian holds its deadline.
        let started = self
            .guardian
            .guard_group(pgid, deadline, args.kill_after)
            .map_err(|e| format!("cannot reach the guardian: {e}"))
            .and_then(|()| {
                supervise::handshake(&child).map_err(|e| format!("cannot start {program:?}: {e}"))
            });
        match started {
            Ok(true) => {}
            Ok(false) | Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                supervise::stop_group(pgid, Duration::ZERO);
                self.guardian.forget_group(pgid);
                return match started {
                    Err(why) => Ended::CannotStart(why),
                    // The exec step found the deadline passed (this process
                    // was held up between the grant and the start).
                    _ if (held.is_lost)() => {
                        self.report
                            .lost(&(held.why_lost)(), "the command was not started");
                        Ended::LostBeforeStart
                    }
                    _ => Ended::CannotStart(format!("cannot start {program:?}")),
                };
            }
        }
        supervise::set_current_group(pgid);
        self.report.started(child.id(), &args.command);
        let ended = self.supervise(&mut child, pgid, deadline, held);
        if let Ended::Exited(status) | Ended::LeaseLost(status) = &ended {
            self.report.exited(*status);
        }
        // Whatever is left of the group goes before the lease does.
        supervise::stop_group(pgid, args.kill_after);
        supervise::set_current_group(0);
        self.guardian.forget_group(pgid);
        ended
    }

    /// The lease's loss deadline on the machine's monotonic clock: its
    /// `remaining` estimate less one node timeout (the library's loss
    /// deadline), counted from a reading of the clock taken before the
    /// estimate, so never later than the library's own.
    fn loss_deadline(&self, held: &Held<'_>) -> Duration {
        let before = supervise::monotonic_now();
        before + (held.remaining)().saturating_sub(self.args.keys.node_timeout)
    }

    /// Waits for the command, passing signals on to its group, telling the
    /// guardian each new loss deadline, and stopping the group if the lease
    /// is lost.
    fn supervise(
        &mut self,
        child: &mut Child,
        pgid: i32,
        mut told: Duration,
        held: &Held<'_>,
    ) -> Ended {
        let mut kill_at: Option<Instant> = None;
        let mut lease_lost = false;
        loop {
            match child.try_wait() {
                Ok(Some(status)) if lease_lost => return Ended::LeaseLost(status),
                Ok(Some(status)) => {
                    // A command that ended once the lease was gone (the
                    // guardian stopped it while this process could not) ends
                    // as any loss does.
                    if (held.is_lost)() {
                        self.report.lost(
                            &(held.why_lost)(),
                            "the command ended after the loss deadline, stopped by the \
                             guardian if it was still running then",
                        );
                        return Ended::LeaseLost(status);
                    }
                    return Ended::Exited(status);
                }
                Ok(None) => {}
                Err(e) => return Ended::WaitFailed(e),
            }
            if kill_at.is_some_and(|at| Instant::now() >= at) {
                supervise::signal_group(pgid, Signal::KILL);
            }
            // A guardian that died is replaced, told this group's deadline.
            let _ = self.guardian.keep_running();
            if !lease_lost {
                // Told again when a renewal moved it (not for the jitter of
                // the clock readings that compute it).
                let deadline = self.loss_deadline(held);
                if deadline.abs_diff(told) > Duration::from_millis(1) {
                    self.guardian.deadline(pgid, deadline);
                    told = deadline;
                }
            }
            // SIGCHLD wakes this promptly, and a confirmed renewal; the
            // timeout covers a coalesced signal, the SIGKILL deadline, and a
            // deadline moved without a renewal (a verify that shortened it).
            let tick = crossbeam_channel::after(Duration::from_millis(100));
            let lost = if lease_lost {
                crossbeam_channel::never()
            } else {
                held.lost.clone()
            };
            select! {
                recv(lost) -> _ => {
                    lease_lost = true;
                    supervise::signal_group(pgid, Signal::TERM);
                    supervise::signal_group(pgid, Signal::CONT);
                    kill_at = Some(Instant::now() + self.args.kill_after);
                    // Stop first, explain after: the explanation asks Redis.
                    self.report.lost(&(held.why_lost)(), "stopping the command");
                }
                recv(self.signals) -> sig => {
                    if let Ok(sig) = sig
                        && FORWARDED.contains(&sig)
                        && let Some(signal) = Signal::from_named_raw(sig)
                    {
                        supervise::signal_group(pgid, signal);
                        self.report.forwarded(sig);
                    }
                }
                // A confirmed renewal moved the deadline: tell the guardian
                // at once, at the top of the loop.
                recv(losses::renewals()) -> _ => {}
                recv(tick) -> _ => {}
            }
        }
    }

    fn finish(&self, ended: Ended) -> ExitCode {
        let report = self.report;
        match ended {
            Ended::Exited(status) => ExitCode::from(status_code(status)),
            Ended::LeaseLost(_) => report.error(
                self.args.lost_exit_code,
                &format!(
                    "the lease on {:?} was lost; the command was stopped",
                    report.key
                ),
            ),
            Ended::LostBeforeStart => report.error(
                self.args.lost_exit_code,
                &format!(
                    "the lease on {:?} was lost before the command could start",
                    report.key
                ),
            ),
            Ended::CannotStart(msg) => report.error(EXIT_UNAVAILABLE, &msg),
            Ended::WaitFailed(e) => report.error(
                EXIT_CANNOT_RUN,
                &format!("waiting for the command failed: {e}"),
            ),
        }
    }
}

/// What a release found, as the `released` event's outcome and detail.
fn release_words(
    released: respire_coordination::Result<ReleaseOutcome>,
) -> (&'static str, Option<String>) {
    match released {
        Ok(ReleaseOutcome::Released) => ("released", None),
        Ok(ReleaseOutcome::Expired) => ("expired", Some("the lease had expired before".into())),
        Ok(ReleaseOutcome::TakenOver) => (
            "taken_over",
            Some("another holder had the key; it was left alone".into()),
        ),
        Ok(ReleaseOutcome::Uncertain) => (
            "uncertain",
            Some("no reply; the lease ends at its expiry at the latest".into()),
        ),
        Ok(other) => ("uncertain", Some(format!("{other:?}"))),
        Err(e) => ("failed", Some(e.to_string())),
    }
}

/// A pause of 20–220 ms before trying again after a conflict with another
/// mode, different in every process so that two modes do not keep meeting.
fn backoff() -> Duration {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    Duration::from_millis(20 + h.finish() % 200)
}

/// What holds KEY in another mode than `mode`, if anything.
fn other_mode(
    coord: &Coordinator,
    base: &str,
    mode: Mode,
) -> respire_coordination::Result<Option<String>> {
    let ins = coord.inspect(base)?;
    Ok(match mode {
        Mode::Exclusive | Mode::Shared => (!ins.permits.is_empty())
            .then(|| format!("counted (--max), {} permit(s)", ins.permits.len())),
        Mode::Counted(_) => describe_others(&ins, false),
    })
}

/// Why a Redlock run backs off from `node`, whose keys it could not read
/// (`err`): anything may be held there, so the run takes it as held. `None`
/// for a node that refused the connection: no server runs there, and a
/// Redlock run holds every node it reaches.
fn unread(node: &str, err: &Error) -> Option<String> {
    let refused = matches!(err, Error::Connect { .. }) && !err.is_timeout();
    (!refused).then(|| format!("unknown: {node} did not say what it holds ({err})"))
}

/// The exclusive holder (unless `skip_exclusive`) or the readers of an
/// inspection, and with `skip_exclusive` its permits too, as a mode.
fn describe_others(ins: &respire_coordination::Inspection, skip_exclusive: bool) -> Option<String> {
    if !skip_exclusive && let Some(x) = &ins.exclusive {
        return Some(match x.fencing_token {
            Some(t) => format!("exclusive (fenced, token {t})"),
            None => "exclusive (--redlock)".into(),
        });
    }
    if !ins.readers.is_empty() {
        return Some(format!(
            "shared (--shared), {} holder(s)",
            ins.readers.len()
        ));
    }
    if skip_exclusive && !ins.permits.is_empty() {
        return Some(format!("counted (--max), {} permit(s)", ins.permits.len()));
    }
    None
}

/// Signals for this process, delivered on a channel.
///
/// They are blocked in the calling thread, and so in every thread started
/// after (the library's among them), and taken by a thread of their own. A
/// handler run by a thread inside a library call would fail that call: Linux
/// does not restart a socket read with a timeout after a handler, whatever
/// `SA_RESTART` says, and the library takes a reply it could not read as
/// missing. Call this before anything starts a thread; the command starts
/// through [`supervise::command`], which gives it the mask the tool started
/// with.
///
/// A signal ignored when the tool started (as under `nohup`) is left ignored,
/// as flock leaves it, and the command inherits it ignored. SIGTSTP stops the
/// command's group, then the tool; SIGCONT continues the group (see
/// [`supervise::stop_all`]); neither reaches the channel's receivers.
fn signals() -> std::io::Result<Receiver<i32>> {
    let mut wanted: Vec<i32> = [&FORWARDED[..], &[SIGTSTP, SIGCONT]]
        .concat()
        .into_iter()
        .filter(|s| !supervise::ignored_at_start(*s))
        .collect();
    wanted.push(SIGCHLD);
    let mut mask = SigSet::empty();
    for &signal in &wanted {
        mask.add(nix::sys::signal::Signal::try_from(signal)?);
    }
    supervise::block_signals(&mask)?;
    let mut signals = signal_hook::iterator::Signals::new(wanted)?;
    let (tx, rx) = crossbeam_channel::unbounded();
    let (unblocked_tx, unblocked) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name("respire-signals".into())
        .spawn(move || {
            // Signals that came before are pending, and delivered here now.
            let unblocked = mask.thread_unblock();
            let failed = unblocked.is_err();
            let _ = unblocked_tx.send(unblocked);
            if failed {
                return;
            }
            for signal in signals.forever() {
                match signal {
                    SIGTSTP => supervise::stop_all(),
                    SIGCONT => supervise::continue_all(),
                    _ => {
                        if tx.send(signal).is_err() {
                            return;
                        }
                    }
                }
            }
        })?;
    match unblocked.recv() {
        Ok(Ok(())) => Ok(rx),
        Ok(Err(errno)) => Err(errno.into()),
        Err(_) => Err(std::io::Error::other("the signal thread ended at once")),
    }
}

/// The deadline of a wait: `None` to wait until acquired, also for a wait too
/// long for the monotonic clock (or longer than any lease, [`MAX_TTL`]).
fn deadline(wait: Wait, now: Instant) -> Option<Instant> {
    match wait {
        Wait::Forever => None,
        Wait::For(wait) if wait > MAX_TTL => None,
        Wait::For(wait) => now.checked_add(wait),
    }
}

/// The loss of the lease the command runs under, as the library reported
/// it (see [`losses`]).
fn library_loss() -> Loss {
    losses::first(Duration::from_secs(1)).unwrap_or_else(|| Loss {
        cause: "other",
        reason: "the library reported no cause within a second of the loss".into(),
    })
}

/// A Redlock loss in the library's words, with what each node last said.
fn redlock_loss(guard: &RedlockGuard) -> Loss {
    let mut loss = library_loss();
    let nodes: Vec<String> = guard
        .last_evidence()
        .iter()
        .map(|n| format!("{}: {}", n.node, n.outcome))
        .collect();
    loss.reason = format!("{} (nodes: {})", loss.reason, nodes.join("; "));
    loss
}

/// The lease a command runs under, as its supervision reads it.
struct Held<'a> {
    /// Disconnects at the loss deadline.
    lost: &'a Receiver<()>,
    /// The lease's `remaining_estimate`.
    remaining: &'a dyn Fn() -> Duration,
    /// The lease's `is_lost`.
    is_lost: &'a dyn Fn() -> bool,
    /// Why it was lost, once it is.
    why_lost: &'a dyn Fn() -> Loss,
}

/// How the command's supervision ended.
enum Ended {
    Exited(ExitStatus),
    /// The lease was lost; the command was stopped and ended with this status.
    LeaseLost(ExitStatus),
    /// The lease was lost before the command could start; it never ran.
    LostBeforeStart,
    CannotStart(String),
    WaitFailed(std::io::Error),
}

fn status_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => 128u8.wrapping_add(signal as u8),
        (None, None) => EXIT_CANNOT_RUN,
    }
}

/// Where JSON events go: a file descriptor or a file given on the command
/// line, or nowhere.
struct Events(Option<Mutex<Box<dyn std::io::Write + Send>>>);

impl Events {
    fn open(args: &RunArgs, subcommand: &str) -> Result<Events, Usage> {
        let usage = |what: String| Usage::new(what, Some(subcommand));
        let some = |w: Box<dyn std::io::Write + Send>| Events(Some(Mutex::new(w)));
        if let Some(fd) = args.events_fd {
            return match fd {
                // The tool's own standard streams are written as they are,
                // at the offset every other writer of them shares.
                1 => Ok(some(Box::new(std::io::stdout()))),
                2 => Ok(some(Box::new(std::io::stderr()))),
                // Any other descriptor is opened again through /dev/fd, which
                // needs no unsafe code and leaves the caller's descriptor as
                // it is; in append mode, so a file is written at its end.
                _ => {
                    let path = format!("/dev/fd/{fd}");
                    std::fs::OpenOptions::new()
                        .append(true)
                        .open(&path)
                        .map(|f| some(Box::new(f)))
                        .map_err(|e| {
                            usage(format!("--events-fd {fd}: not an open descriptor ({e})"))
                        })
                }
            };
        }
        if let Some(path) = &args.events_file {
            return std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map(|f| some(Box::new(f)))
                .map_err(|e| usage(format!("--events-file {}: {e}", path.display())));
        }
        Ok(Events(None))
    }
}

/// Reports the events of one run: sentences for people on stderr, and with
/// `--events-fd` / `--events-file` one JSON object per event there.
struct Reporter {
    events: Events,
    verbose: bool,
    key: String,
}

impl Reporter {
    /// Reports one event: `fields` adds the event's own JSON fields; `text` is
    /// the sentence printed on stderr (`None`: nothing).
    fn emit(&self, event: &str, fields: impl FnOnce(Object) -> Object, text: Option<String>) {
        if let Some(file) = &self.events.0 {
            let time = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
            let obj = Object::new()
                .str("event", event)
                .str("time", &time)
                .str("key", &self.key);
            let line = fields(obj).finish();
            let _ = writeln!(file.lock(), "{}", crate::scrub(&line));
        }
        if let Some(text) = text {
            say(&format!("respire-lock: {text}"));
        }
    }

    fn throwaway(&self, url: &str, dir: &std::path::Path) {
        self.emit(
            "throwaway",
            |o| o.str("url", url).str("dir", &dir.display().to_string()),
            Some(format!(
                "--throwaway: started a private redis-server at {url} in {} \
                 (it coordinates with nothing else)",
                dir.display()
            )),
        );
    }

    fn acquired(&self, grant: &Grant, mode: &str, ttl: Duration) {
        let text = match (grant.token, grant.slot, grant.write_epoch) {
            (Some(t), Some(slot), _) => {
                format!("acquired {:?}: permit {slot}, fencing token {t}", self.key)
            }
            (Some(t), None, _) => format!("acquired {:?} with fencing token {t}", self.key),
            (None, _, Some(e)) => format!("acquired {:?} shared (write epoch {e})", self.key),
            (None, _, None) => format!("acquired {:?} on a quorum (no fencing token)", self.key),
        };
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.emit(
            "acquired",
            |o| {
                o.str("lease_key", &grant.lease_key)
                    .opt_num("token", grant.token)
                    .num("ttl_ms", ttl_ms)
                    .str("mode", mode)
                    .opt_num("slot", grant.slot)
                    .opt_num("write_epoch", grant.write_epoch)
            },
            self.verbose.then_some(text),
        );
    }

    fn started(&self, pid: u32, command: &[OsString]) {
        let words: Vec<String> = command
            .iter()
            .map(|w| w.to_string_lossy().into_owned())
            .collect();
        self.emit(
            "started",
            |o| {
                o.num("pid", pid).raw(
                    "command",
                    &json::array(words.iter().map(|w| json::string(w))),
                )
            },
            self.verbose
                .then(|| format!("started {:?} (pid {pid})", words.join(" "))),
        );
    }

    /// The lease was lost; `after` says what became of the command.
    fn lost(&self, cause: &Loss, after: &str) {
        self.emit(
            "lost",
            |o| o.str("cause", cause.cause).str("reason", &cause.reason),
            Some(format!("the lease was lost ({}); {after}", cause.reason)),
        );
    }

    fn recampaign(&self) {
        self.emit(
            "recampaign",
            |o| o,
            Some(format!(
                "campaigning again for {:?} (--recampaign)",
                self.key
            )),
        );
    }

    fn unreachable(&self, why: &str) {
        self.emit(
            "unreachable",
            |o| o.str("message", why),
            Some(format!(
                "still waiting for {:?}, but Redis does not answer: {why}",
                self.key
            )),
        );
    }

    fn reachable(&self) {
        self.emit(
            "reachable",
            |o| o,
            Some(format!(
                "Redis answers again; still waiting for {:?}",
                self.key
            )),
        );
    }

    fn forwarded(&self, signal: i32) {
        self.emit(
            "forwarded",
            |o| o.num("signal", signal),
            self.verbose
                .then(|| format!("passed signal {signal} on to the command's group")),
        );
    }

    fn exited(&self, status: ExitStatus) {
        use std::os::unix::process::ExitStatusExt;
        self.emit(
            "exited",
            |o| {
                o.opt_num("code", status.code())
                    .opt_num("signal", status.signal())
            },
            self.verbose.then(|| format!("the command ended: {status}")),
        );
    }

    fn released(&self, outcome: &str, detail: Option<&str>) {
        let text = match detail {
            None => self.verbose.then(|| format!("released {:?}", self.key)),
            Some(detail) => Some(format!("release of {:?}: {outcome}: {detail}", self.key)),
        };
        self.emit(
            "released",
            |o| o.str("outcome", outcome).opt_str("detail", detail),
            text,
        );
    }

    /// Held elsewhere, in whatever mode: quiet without `-v`, as flock (a cron
    /// job's conflict mails nobody); `-v` names the holder's mode.
    fn not_acquired(&self, code: u8, other_mode: Option<&str>) -> ExitCode {
        let text = self.verbose.then(|| match other_mode {
            Some(other) => format!(
                "{:?} is held in another mode: {other}; not acquired",
                self.key
            ),
            None => format!("{:?} is held elsewhere; not acquired", self.key),
        });
        self.emit(
            "not_acquired",
            |o| o.num("exit_code", code).opt_str("held_as", other_mode),
            text,
        );
        ExitCode::from(code)
    }

    fn interrupted(&self, signal: i32) -> ExitCode {
        self.emit(
            "interrupted",
            |o| o.num("signal", signal),
            Some(format!("interrupted while waiting for {:?}", self.key)),
        );
        ExitCode::from(128u8.wrapping_add(signal as u8))
    }

    fn error(&self, exit_code: u8, message: &str) -> ExitCode {
        self.emit(
            "error",
            |o| o.num("exit_code", exit_code).str("message", message),
            Some(message.to_owned()),
        );
        ExitCode::from(exit_code)
    }
}

/// A `redis-server` on a free loopback port for one run, in a process group
/// of its own that the guardian kills (and whose directory it removes) if the
/// tool dies.
struct ThrowawayServer {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl ThrowawayServer {
    fn start(guardian: &mut Guardian) -> Result<ThrowawayServer, String> {
        let program = supervise::resolve("redis-server".as_ref())
            .map_err(|e| format!("--throwaway needs redis-server: {e}"))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("cannot find a free port: {e}"))?
            .port();
        guardian
            .ensure_started()
            .map_err(|e| format!("cannot start the guardian: {e}"))?;
        let dir = std::env::temp_dir().join(format!("respire-lock-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {dir:?}: {e}"))?;
        guardian.watch_dir(&dir);
        let args: Vec<OsString> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
        ]
        .iter()
        .map(OsString::from)
        .chain([dir.clone().into_os_string()])
        .collect();
        let child = supervise::command(program.as_os_str(), &args, None)
            .and_then(|mut cmd| {
                cmd.stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
            })
            .map_err(|e| format!("cannot start redis-server: {e}"))?;
        guardian.watch_group(child.id() as i32);
        let mut server = ThrowawayServer { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline || matches!(server.child.try_wait(), Ok(Some(_))) {
                server.stop(guardian);
                return Err("the throwaway redis-server did not start within 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn stop(mut self, guardian: &mut Guardian) {
        let pgid = self.child.id() as i32;
        if let Some(pid) = Pid::from_raw(pgid) {
            let _ = rustix::process::kill_process_group(pid, Signal::KILL);
        }
        let _ = self.child.wait();
        supervise::wait_group_gone(pgid, Duration::from_secs(1));
        guardian.forget_group(pgid);
        let _ = std::fs::remove_dir_all(&self.dir);
        guardian.forget_dir(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_too_long_for_the_clock_have_no_deadline() {
        let now = Instant::now();
        assert_eq!(deadline(Wait::Forever, now), None);
        assert_eq!(deadline(Wait::For(Duration::ZERO), now), Some(now));
        assert_eq!(
            deadline(Wait::For(Duration::from_secs(5)), now),
            Some(now + Duration::from_secs(5))
        );
        assert_eq!(
            deadline(Wait::For(MAX_TTL + Duration::from_secs(1)), now),
            None
        );
        assert_eq!(
            deadline(
                Wait::For(Duration::from_secs(10_000_000_000_000_000_000)),
                now
            ),
            None
        );
        assert_eq!(deadline(Wait::For(Duration::MAX), now), None);
    }

    #[test]
    fn backoff_is_bounded() {
        for _ in 0..100 {
            let b = backoff();
            assert!(b >= Duration::from_millis(20) && b < Duration::from_millis(220));
        }
    }
}
