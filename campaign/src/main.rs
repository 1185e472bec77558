//! The nemesis campaign (DESIGN §11): every primitive of
//! `respire-coordination` on real `redis-server`s of every topology under a
//! seeded mix of faults, with histories recorded on the machine's shared
//! monotonic clock and checked by oracles outside the library.
//!
//! ```text
//! campaign run --topology T --workload W [--seed N] [--duration D] [--nemesis LIST] ...
//! campaign table [--check] [--pairs] SUMMARY...  (RELIABILITY.md's tables; --check: fail on a violation)
//! campaign check DIR                    (the checkers again over a saved run)
//! campaign gaps DIR                     (grants and errors around each fault of a saved run)
//! campaign worker          (internal: one worker process, spec in CAMPAIGN_WORKER)
//! ```
//!
//! `scripts/campaign` builds it and runs the rows of RELIABILITY.md.

#![forbid(unsafe_code)]

#[path = "../../tests/support/mod.rs"]
mod support;

mod check;
mod clock;
mod driver;
mod history;
mod nemesis;
mod report;
mod resource;
mod rng;
mod sampler;
mod spec;
mod topo;
mod worker;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("worker") => worker::main(),
        Some("run") => driver::main(&args[1..]),
        Some("table") => report::main(&args[1..]),
        Some("check") => report::recheck(&args[1..]),
        Some("gaps") => report::gaps(&args[1..]),
        _ => Err(driver::USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("campaign: {e}");
            ExitCode::FAILURE
        }
    }
}
