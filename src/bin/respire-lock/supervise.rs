//! Processes that cannot outlive the tool: the command (and a throwaway
//! server) start through a small exec step of this same binary that puts them
//! in a process group of their own and asks the kernel for a parent-death
//! signal; a guardian process of this binary, reading a pipe from the tool,
//! kills those groups and removes the throwaway directory when the pipe closes
//! without a word, as when the tool is killed with SIGKILL.
//!
//! The exec step and the guardian are this binary run with an internal first
//! argument ([`EXEC`], [`GUARD`]); they are no subcommands of the tool.

use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::io::{BufRead as _, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, SigmaskHow};

use rustix::process::{Pid, Signal};

/// First argument of the exec step: `respire-lock <EXEC> <parent pid> CMD ARGS…`.
pub(crate) const EXEC: &str = "--respire-lock-internal-exec";
/// First argument of the guardian: `respire-lock <GUARD>`, commands on stdin.
pub(crate) const GUARD: &str = "--respire-lock-internal-guard";

/// The exec step: asks for SIGKILL when the parent dies, checks the parent is
/// still the one that started it (it may have died before the request), then
/// replaces itself with the command. Runs in the process group its parent
/// gave it.
pub(crate) fn exec_main(args: &[OsString]) -> ExitCode {
    let (Some(parent), Some(program)) = (args.first(), args.get(1)) else {
        return ExitCode::from(crate::EXIT_CANNOT_RUN);
    };
    let parent: Option<i32> = parent.to_str().and_then(|p| p.parse().ok());
    // Linux and Android only; elsewhere the guardian alone stops the group.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if rustix::process::set_parent_process_death_signal(Some(Signal::KILL)).is_err() {
        return ExitCode::from(crate::EXIT_CANNOT_RUN);
    }
    let still_there = rustix::process::getppid().map(Pid::as_raw_nonzero);
    if parent.is_none() || still_there.map(|p| p.get()) != parent {
        // The tool is already gone: run nothing.
        return ExitCode::from(crate::EXIT_CANNOT_RUN);
    }
    let err = Command::new(program).args(&args[2..]).exec();
    crate::say(&format!("respire-lock: cannot run {program:?}: {err}"));
    ExitCode::from(127)
}

/// The signal mask the tool started with, kept by [`block_signals`] for the
/// processes it starts.
static STARTED_WITH: OnceLock<SigSet> = OnceLock::new();

/// Blocks `signals` in the calling thread, and so in every thread it starts
/// after, keeping the mask it had for the processes the tool starts (see
/// [`spawn`]).
pub(crate) fn block_signals(signals: &SigSet) -> nix::Result<()> {
    let started_with = signals.thread_swap_mask(SigmaskHow::SIG_BLOCK)?;
    let _ = STARTED_WITH.get_or_init(|| started_with);
    Ok(())
}

/// Starts `cmd` with the signal mask the tool started with. A child inherits
/// the mask of the thread that starts it, and the tool's threads block the
/// signals its signal thread takes: a command started with them blocked
/// would never hear the SIGTERM passed on to it. The calling thread has the
/// started-with mask while it starts the child; a signal it takes meanwhile
/// interrupts no library call.
pub(crate) fn spawn(cmd: &mut Command) -> std::io::Result<Child> {
    let Some(started_with) = STARTED_WITH.get() else {
        return cmd.spawn();
    };
    let blocked = started_with.thread_swap_mask(SigmaskHow::SIG_SETMASK)?;
    let child = cmd.spawn();
    if let Err(errno) = blocked.thread_set_mask() {
        // Not a state to go on in: this thread would take signals inside
        // library calls.
        if let Ok(mut child) = child {
            let _ = child.kill();
            let _ = child.wait();
        }
        return Err(errno.into());
    }
    child
}

/// A command line for `program` with `args`, started through the exec step
/// in a new process group.
pub(crate) fn command(program: &OsStr, args: &[OsString]) -> std::io::Result<Command> {
    let me = std::env::current_exe()?;
    let mut cmd = Command::new(me);
    cmd.arg(EXEC)
        .arg(std::process::id().to_string())
        .arg(program)
        .args(args)
        .process_group(0);
    Ok(cmd)
}

/// Finds `program` as `execvp` would: a path with a `/` as given, otherwise
/// the first executable file of that name in `PATH`.
pub(crate) fn resolve(program: &OsStr) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt as _;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.is_empty() {
        return Err("the command is empty".into());
    }
    if program.as_encoded_bytes().contains(&b'/') {
        let path = PathBuf::from(program);
        return if executable(&path) {
            Ok(path)
        } else {
            Err(format!("cannot run {program:?}: no such executable file"))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| executable(p))
        .ok_or_else(|| format!("cannot run {program:?}: not found in PATH"))
}

/// Whether any process of group `pgid` is alive (zombies do not count), from
/// `/proc`; without `/proc`, whether the group can be signalled at all.
pub(crate) fn group_alive(pgid: i32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Pid::from_raw(pgid)
            .is_some_and(|pid| rustix::process::test_kill_process_group(pid).is_ok());
    };
    entries.flatten().any(|entry| {
        let name = entry.file_name();
        if !name.as_encoded_bytes().iter().all(u8::is_ascii_digit) {
            return false;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            return false;
        };
        // "pid (comm) state ppid pgrp …": comm may hold anything, so read
        // after its last ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            return false;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("Z");
        let pgrp = fields.nth(1).and_then(|p| p.parse::<i32>().ok());
        pgrp == Some(pgid) && state != "Z" && state != "X"
    })
}

/// Signals every process of group `pgid`.
pub(crate) fn signal_group(pgid: i32, signal: Signal) {
    if let Some(pid) = Pid::from_raw(pgid) {
        let _ = rustix::process::kill_process_group(pid, signal);
    }
}

/// Waits until group `pgid` has no live process, or `within` has passed;
/// returns whether it is gone.
pub(crate) fn wait_group_gone(pgid: i32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if !group_alive(pgid) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Stops what is left of group `pgid`: SIGTERM, then SIGKILL after
/// `kill_after`; returns once it is gone (or a second after the SIGKILL).
pub(crate) fn stop_group(pgid: i32, kill_after: Duration) {
    if !group_alive(pgid) {
        return;
    }
    signal_group(pgid, Signal::TERM);
    if !wait_group_gone(pgid, kill_after) {
        signal_group(pgid, Signal::KILL);
        wait_group_gone(pgid, Duration::from_secs(1));
    }
}

/// The tool's side of the guardian: a pipe to it, once it is started.
pub(crate) struct Guardian {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
}

impl Guardian {
    /// A guardian that starts when first needed: a run that never starts a
    /// process (a conflict, a usage error) costs no process.
    pub(crate) fn lazy() -> Guardian {
        Guardian {
            child: None,
            stdin: None,
        }
    }

    /// Starts the guardian, if not yet, in a process group of its own (so
    /// that the terminal's signals do not reach it).
    pub(crate) fn ensure_started(&mut self) -> std::io::Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let mut child = spawn(
            Command::new(std::env::current_exe()?)
                .arg(GUARD)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0),
        )?;
        self.stdin = child.stdin.take();
        self.child = Some(child);
        Ok(())
    }

    fn tell(&mut self, line: &str) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "{line}").and_then(|()| stdin.flush());
        }
    }

    /// Kill group `pgid` if the tool dies.
    pub(crate) fn watch_group(&mut self, pgid: i32) {
        self.tell(&format!("group {pgid}"));
    }

    /// Group `pgid` is gone: forget it.
    pub(crate) fn forget_group(&mut self, pgid: i32) {
        self.tell(&format!("forget {pgid}"));
    }

    /// Remove `dir` if the tool dies (after the groups are gone).
    pub(crate) fn watch_dir(&mut self, dir: &Path) {
        if let Some(dir) = dir.to_str().filter(|d| !d.contains('\n')) {
            self.tell(&format!("dir {dir}"));
        }
    }

    /// `dir` was removed: forget it.
    pub(crate) fn forget_dir(&mut self, dir: &Path) {
        if let Some(dir) = dir.to_str() {
            self.tell(&format!("forget-dir {dir}"));
        }
    }
}

impl Drop for Guardian {
    fn drop(&mut self) {
        // A clean end: the guardian has nothing left to do and exits.
        drop(self.stdin.take());
        if let Some(child) = self.child.as_mut() {
            let _ = child.wait();
        }
    }
}

/// The guardian: keeps the groups and directories it is told of; when its
/// input ends, kills those groups and removes those directories.
pub(crate) fn guard_main() -> ExitCode {
    let mut groups = BTreeSet::new();
    let mut dirs: Vec<PathBuf> = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        match line.split_once(' ') {
            Some(("group", pgid)) => {
                groups.extend(pgid.parse::<i32>().ok().filter(|p| *p > 1));
            }
            Some(("forget", pgid)) => {
                if let Ok(pgid) = pgid.parse::<i32>() {
                    groups.remove(&pgid);
                }
            }
            Some(("dir", dir)) => dirs.push(PathBuf::from(dir)),
            Some(("forget-dir", dir)) => dirs.retain(|d| d != Path::new(dir)),
            _ => {}
        }
    }
    for pgid in &groups {
        signal_group(*pgid, Signal::KILL);
    }
    for pgid in &groups {
        wait_group_gone(*pgid, Duration::from_secs(2));
    }
    for dir in &dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
    ExitCode::SUCCESS
}
