//! Runs this crate, the Redis lock crates users pick (`rlock`, `rslock`, the
//! `redlock` crate) and raw baselines side by side, in one run, against
//! local `redis-server`s it starts itself, and writes the figures as
//! markdown: every figure as a ratio to its raw baseline from the same round.
//!
//! ```text
//! respire-compare [--quick] [--rounds N] [--cases single,redlock,handoff,slow,idle,server-cpu]
//!                 [--pairs N] [--redlock-pairs N] [--redlock-node-timeout-ms N]
//!                 [--contenders N] [--handoff-ms N] [--hold-ms N]
//!                 [--slow-attempts N] [--waiters N] [--idle-ms N]
//!                 [--blocks N] [--impls LIST] [--markdown PATH]
//! ```
//!
//! Each implementation's measurement runs in a child process of its own (the
//! program runs itself as `respire-compare child CASE IMPL ...`), so that the
//! threads of one never compete with another's; rounds alternate every
//! implementation of every case, in an order rotated each round, so that
//! machine noise hits all alike. `scripts/bench-compare` builds it, runs it
//! and writes `BENCHMARKS.md`.

#![forbid(unsafe_code)]

#[path = "../../tests/support/mod.rs"]
mod support;

mod child;
mod driver;
mod handoff;
mod idle;
mod plan;
mod quorum;
mod quorum_cases;
mod report;
mod server_cpu;
mod single;
mod stats;
mod tracking;

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("child") => child::main(&args[1..]),
        _ => driver::main(&args),
    };
    let _ = std::io::stdout().flush();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("respire-compare: {e}");
            ExitCode::FAILURE
        }
    }
}
