//! `respire-lock run`: take the lease, run the command's process group under
//! it, stop the group if the lease is lost, release the lease after.
//! `respire-lock elect` is the same supervision under a leadership.

mod child;
mod hold;
mod report;
mod signals;
mod throwaway;
mod wait;

use std::process::ExitCode;

use clap::ArgMatches;
use clap::parser::ValueSource;
use crossbeam_channel::Receiver;

use self::report::{Events, Reporter};
use self::signals::signals;
use crate::EXIT_CANNOT_RUN;
use crate::args::{EXIT_USAGE, ElectArgs, RunArgs, Usage, check_run, settle_run};
use crate::endpoint::Tls;
use crate::supervise::Guardian;

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
