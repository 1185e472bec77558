//! `respire-lock leader`: who leads an election, once or as it changes,
//! through the library's `Election::leader` and `Election::observe`.

use std::io::Write as _;
use std::process::ExitCode;

use respire_coordination::Leader;

use crate::args::{EXIT_USAGE, LeaderArgs, Usage};
use crate::endpoint::{self, Tls};
use crate::json::Object;
use crate::{EXIT_UNAVAILABLE, say};

pub(crate) fn main(args: LeaderArgs) -> ExitCode {
    let tls = match Tls::read(&args.tls, "leader") {
        Ok(t) => t,
        Err(usage) => {
            usage.print();
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let Some(url) = &args.url else {
        Usage::new(
            "leader needs a Redis deployment to ask: give --url or set REDIS_URL",
            Some("leader"),
        )
        .print();
        return ExitCode::from(EXIT_USAGE);
    };
    let failed = |e: respire_coordination::Error| {
        say(&format!("respire-lock: {e}"));
        ExitCode::from(if endpoint::is_usage(&e) {
            EXIT_USAGE
        } else {
            EXIT_UNAVAILABLE
        })
    };
    let election = match endpoint::connect(url, &args.keys, &tls)
        .and_then(|c| c.election(&endpoint::base(&args.name)))
    {
        Ok(e) => e,
        Err(e) => return failed(e),
    };
    if !args.watch {
        return match election.leader() {
            Ok(leader) => {
                let _ = print(&args, leader.as_ref());
                ExitCode::SUCCESS
            }
            Err(e) => failed(e),
        };
    }
    // Ends when a signal ends the process, or when a line cannot be written
    // (the reader of stdout went away).
    for change in election.observe() {
        let written = match change {
            Ok(leader) => print(&args, leader.as_ref()),
            Err(e) => {
                say(&format!(
                    "respire-lock: cannot tell who leads {:?}: {e}",
                    args.name
                ));
                !args.json
                    || line(
                        &Object::new()
                            .str("name", &args.name)
                            .str("error", &e.to_string())
                            .finish(),
                    )
            }
        };
        if !written {
            break;
        }
    }
    ExitCode::SUCCESS
}

/// Writes one line on stdout, scrubbed of passwords as everything the tool
/// prints; whether it could.
fn line(text: &str) -> bool {
    writeln!(std::io::stdout().lock(), "{}", crate::scrub(text)).is_ok()
}

/// One state, as a line of text or a JSON object; whether it was written.
fn print(args: &LeaderArgs, leader: Option<&Leader>) -> bool {
    if args.json {
        return line(
            &Object::new()
                .str("name", &args.name)
                .bool("leader", leader.is_some())
                .opt_num("term", leader.map(|l| l.term.get()))
                .opt_str("value", leader.and_then(|l| l.value.as_deref()))
                .finish(),
        );
    }
    line(&match leader {
        None => format!("{}: no leader", args.name),
        Some(l) => match &l.value {
            Some(value) => format!("{}: led by {value:?} (term {})", args.name, l.term),
            None => format!("{}: led with term {} (no value)", args.name, l.term),
        },
    })
}
