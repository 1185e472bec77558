//! `respire-lock`: `flock(1)` for a fleet.
//!
//! - `respire-lock run [OPTIONS] KEY [--] CMD [ARGS...]` takes a lease on KEY
//!   (exclusive and fenced, `--shared`, `--max N`, or a Redlock quorum), runs CMD
//!   in a process group of its own with the fencing token in
//!   `RESPIRE_FENCING_TOKEN`, keeps the lease alive while CMD runs, passes HUP,
//!   INT, QUIT and TERM on to the group (and stops and continues it with the
//!   tool on TSTP and CONT), stops the group (SIGTERM, then SIGKILL) if the
//!   lease is lost, releases the lease once the group is gone, and exits with
//!   CMD's status. A guardian process stops the group at the lease's loss
//!   deadline even when the tool itself is stopped or frozen (see
//!   `supervise`).
//! - `respire-lock status KEY` reports who holds KEY, in which mode, by which
//!   token and for how long.
//! - `respire-lock elect NAME CMD [ARGS...]` campaigns to lead the election
//!   NAME and runs CMD, supervised as by `run`, while leader; with
//!   `--recampaign` it campaigns again after a loss.
//! - `respire-lock leader NAME` prints who leads NAME (`--watch` follows it).
//! - `respire-lock doctor URL` reports what on a deployment weakens the
//!   guarantees.
//! - `respire-lock completions SHELL` prints a shell completion script.
//! - `respire-lock man [SUBCOMMAND]` prints a manual page.
//!
//! Every option can also come from an environment variable; `--help` on each
//! subcommand lists them.

mod args;
mod doctor;
mod endpoint;
mod json;
mod leader;
mod losses;
mod man;
mod run;
mod status;
mod supervise;

use std::ffi::OsString;
use std::io::Write as _;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

use args::{Cli, Command, EXIT_USAGE, Usage};

/// Redis could not be reached or refused an operation.
const EXIT_UNAVAILABLE: u8 = 69;
/// The command could not be started.
const EXIT_CANNOT_RUN: u8 = 70;

fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    // The exec step and the guardian (see `supervise`) are this binary too.
    match argv.get(1).and_then(|a| a.to_str()) {
        Some(supervise::EXEC) => return supervise::exec_main(&argv[2..]),
        Some(supervise::GUARD) => return supervise::guard_main(),
        _ => {}
    }
    let parsed = Cli::command()
        .try_get_matches_from(&argv)
        .and_then(|matches| Cli::from_arg_matches(&matches).map(|cli| (cli, matches)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => return clap_error(&e, &argv),
    };
    match cli.command {
        Command::Run(args) => {
            let sub = matches
                .subcommand_matches("run")
                .expect("the run subcommand was parsed");
            run::main(args, sub)
        }
        Command::Status(args) => {
            let sub = matches
                .subcommand_matches("status")
                .expect("the status subcommand was parsed");
            status::main(args, sub)
        }
        Command::Elect(args) => {
            let sub = matches
                .subcommand_matches("elect")
                .expect("the elect subcommand was parsed");
            run::elect_main(args, sub)
        }
        Command::Leader(args) => leader::main(args),
        Command::Doctor(args) => {
            let sub = matches
                .subcommand_matches("doctor")
                .expect("the doctor subcommand was parsed");
            doctor::main(args, sub)
        }
        Command::Man { subcommand } => {
            let mut out = std::io::stdout().lock();
            match man::render(subcommand.as_deref(), &mut out).and_then(|()| out.flush()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(_) => ExitCode::from(EXIT_CANNOT_RUN),
            }
        }
        Command::Completions { shell } => {
            let mut out = std::io::stdout().lock();
            clap_complete::generate(shell, &mut Cli::command(), "respire-lock", &mut out);
            match out.flush() {
                Ok(()) => ExitCode::SUCCESS,
                Err(_) => ExitCode::from(EXIT_CANNOT_RUN),
            }
        }
    }
}

/// Help and version go to stdout with status 0; every other parse error is a
/// usage error: one line naming the problem, one line with a hint, status 64.
fn clap_error(err: &clap::Error, argv: &[OsString]) -> ExitCode {
    use clap::error::ErrorKind;
    match err.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = err.print();
            ExitCode::SUCCESS
        }
        _ => {
            Usage::from_clap(err, argv).print();
            ExitCode::from(EXIT_USAGE)
        }
    }
}

/// Writes lines to stderr, passwords scrubbed; a closed stderr is not worth
/// a panic.
fn say(text: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{}", scrub(text));
}

/// Writes lines to stdout (the report of `status` and `doctor`), passwords
/// scrubbed; a closed pipe is not worth a panic.
fn show(text: &str) {
    let _ = writeln!(std::io::stdout().lock(), "{}", scrub(text));
}

/// `text` with the user info of every URL in it (`scheme://user:password@`)
/// replaced: the password by `***`, or all of it when there is no user name.
/// The last line of defence: messages are built from redacted URLs already.
pub(crate) fn scrub(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        out.push_str(&rest[..i + 3]);
        rest = &rest[i + 3..];
        let end = rest
            .find(|c: char| c.is_whitespace() || matches!(c, '\'' | '"' | ',' | '`'))
            .unwrap_or(rest.len());
        let token = &rest[..end];
        if let Some(at) = token.rfind('@') {
            match token[..at].split_once(':') {
                Some((user, _)) => {
                    out.push_str(user);
                    out.push_str(":***");
                }
                None => out.push_str("***"),
            }
            out.push_str(&token[at..]);
        } else {
            out.push_str(token);
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}
