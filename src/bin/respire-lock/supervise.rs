//! Processes that cannot outlive the tool, nor its lease: the command (and a
//! throwaway server) start through a small exec step of this same binary that
//! puts them in a process group of their own and asks the kernel for a
//! parent-death signal; a guardian process of this binary, reading a pipe from
//! the tool, kills those groups and removes the throwaway directory when the
//! pipe closes without a word, as when the tool is killed with SIGKILL.
//!
//! The guardian is also the command's dead-man's switch. The tool tells it the
//! lease's loss deadline, on the machine's monotonic clock (which every process
//! shares), each time a renewal moves it. When that deadline passes without a
//! newer one, the guardian stops the command's group (SIGTERM and SIGCONT, then
//! SIGKILL after the grace period) by itself: a tool that is stopped, frozen
//! or starved, whose lease is no longer renewed, cannot keep its command
//! running past the lease. The command cannot start before the guardian knows
//! its group: the exec step stops itself and waits until the tool, having told
//! the guardian, continues it; and it refuses to run the command once the
//! deadline it was given has passed.
//!
//! The exec step and the guardian are this binary run with an internal first
//! argument ([`EXEC`], [`GUARD`]); they are no subcommands of the tool.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::io::{BufRead as _, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, SigmaskHow};
use rustix::process::{Pid, Signal, WaitIdOptions};

/// First argument of the exec step:
/// `respire-lock <EXEC> <parent pid> <deadline> <mask> CMD ARGS…`: the
/// deadline in nanoseconds of the monotonic clock (`-` for none), and the
/// signal numbers to block in the command (comma-separated, `-` for none).
pub(crate) const EXEC: &str = "--respire-lock-internal-exec";
/// First argument of the guardian: `respire-lock <GUARD>`, commands on stdin.
pub(crate) const GUARD: &str = "--respire-lock-internal-guard";

/// Status of the exec step when the command cannot be started, as flock's
/// (`EX_UNAVAILABLE`).
const EXEC_FAILED: u8 = 69;

/// The machine's monotonic clock (`CLOCK_MONOTONIC`), the one clock every
/// process of the machine reads alike, as the time since its origin.
pub(crate) fn monotonic_now() -> Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    Duration::new(
        u64::try_from(now.tv_sec).unwrap_or(0),
        u32::try_from(now.tv_nsec).unwrap_or(0),
    )
}

/// The exec step: asks for SIGKILL when the parent dies, checks the parent is
/// still the one that started it (it may have died before the request) and
/// that the deadline it was given has not passed; with a deadline, stops
/// itself until its parent continues it (see [`handshake`]), and checks the
/// deadline again; then replaces itself with the command. Runs in the process
/// group its parent gave it.
pub(crate) fn exec_main(args: &[OsString]) -> ExitCode {
    let (Some(parent), Some(deadline), Some(mask), Some(program)) =
        (args.first(), args.get(1), args.get(2), args.get(3))
    else {
        return ExitCode::from(EXEC_FAILED);
    };
    // A process starts with the mask of the thread that started it, and the
    // tool's threads block the signals its signal thread takes: the command
    // gets the mask the tool started with instead.
    match mask.to_str().and_then(parse_mask) {
        Some(mask) if mask.thread_set_mask().is_ok() => {}
        _ => return ExitCode::from(EXEC_FAILED),
    }
    let parent: Option<i32> = parent.to_str().and_then(|p| p.parse().ok());
    let deadline = match deadline.to_str() {
        Some("-") => None,
        Some(ns) => match ns.parse::<u64>() {
            Ok(ns) => Some(Duration::from_nanos(ns)),
            Err(_) => return ExitCode::from(EXEC_FAILED),
        },
        None => return ExitCode::from(EXEC_FAILED),
    };
    // Linux and Android only; elsewhere the guardian alone stops the group.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if rustix::process::set_parent_process_death_signal(Some(Signal::KILL)).is_err() {
        return ExitCode::from(EXEC_FAILED);
    }
    let parent_is_there = || {
        let still_there = rustix::process::getppid().map(Pid::as_raw_nonzero);
        parent.is_some() && still_there.map(|p| p.get()) == parent
    };
    let in_time = || deadline.is_none_or(|d| monotonic_now() < d);
    // The tool is already gone, or the lease is: run nothing.
    if !parent_is_there() || !in_time() {
        return ExitCode::from(EXEC_FAILED);
    }
    if deadline.is_some() {
        let me = rustix::process::getpid();
        if rustix::process::kill_process(me, Signal::STOP).is_err()
            || !parent_is_there()
            || !in_time()
        {
            return ExitCode::from(EXEC_FAILED);
        }
    }
    let err = Command::new(program).args(&args[4..]).exec();
    crate::say(&format!("respire-lock: cannot run {program:?}: {err}"));
    ExitCode::from(EXEC_FAILED)
}

/// The signal mask the tool started with, kept by [`block_signals`] for the
/// processes it starts.
static STARTED_WITH: OnceLock<SigSet> = OnceLock::new();

/// Blocks `signals` in the calling thread, and so in every thread it starts
/// after, keeping the mask it had for the commands the tool starts (see
/// [`command`]).
pub(crate) fn block_signals(signals: &SigSet) -> nix::Result<()> {
    let started_with = signals.thread_swap_mask(SigmaskHow::SIG_BLOCK)?;
    let _ = STARTED_WITH.get_or_init(|| started_with);
    Ok(())
}

/// `mask` as the exec step's argument: its signal numbers, comma-separated,
/// or `-` when empty.
fn mask_arg(mask: &SigSet) -> String {
    let numbers: Vec<String> = mask.iter().map(|s| (s as i32).to_string()).collect();
    if numbers.is_empty() {
        "-".into()
    } else {
        numbers.join(",")
    }
}

/// The exec step's mask argument (see [`mask_arg`]) as a set.
fn parse_mask(arg: &str) -> Option<SigSet> {
    let mut mask = SigSet::empty();
    if arg != "-" {
        for number in arg.split(',') {
            mask.add(nix::sys::signal::Signal::try_from(number.parse::<i32>().ok()?).ok()?);
        }
    }
    Some(mask)
}

/// Waits until the exec step `child`, started with a deadline, has stopped
/// itself, then continues it: call once the guardian knows its group. Returns
/// `false` when it ended instead (it refused to run the command).
pub(crate) fn handshake(child: &Child) -> std::io::Result<bool> {
    let pid = Pid::from_child(child);
    let status = rustix::process::waitid(
        rustix::process::WaitId::Pid(pid),
        WaitIdOptions::STOPPED | WaitIdOptions::EXITED | WaitIdOptions::NOWAIT,
    )?;
    if !status.is_some_and(|s| s.stopped()) {
        return Ok(false);
    }
    rustix::process::kill_process(pid, Signal::CONT)?;
    Ok(true)
}

/// The process group of the command being supervised (0: none), which a
/// SIGTSTP to the tool stops and a SIGCONT continues.
static CURRENT_GROUP: AtomicI32 = AtomicI32::new(0);

/// Names `pgid` as the group of the command being supervised (0: none).
pub(crate) fn set_current_group(pgid: i32) {
    CURRENT_GROUP.store(pgid, Ordering::SeqCst);
}

/// What the tool does on SIGTSTP (a terminal's Ctrl-Z, which does not reach
/// the command's own process group): stops the command's group with SIGSTOP,
/// then itself.
pub(crate) fn stop_all() {
    let pgid = CURRENT_GROUP.load(Ordering::SeqCst);
    if pgid > 1 {
        signal_group(pgid, Signal::STOP);
    }
    let _ = rustix::process::kill_process(rustix::process::getpid(), Signal::STOP);
}

/// What the tool does on SIGCONT: continues the command's group.
pub(crate) fn continue_all() {
    let pgid = CURRENT_GROUP.load(Ordering::SeqCst);
    if pgid > 1 {
        signal_group(pgid, Signal::CONT);
    }
}

/// Whether `signal` was ignored when this process started (as under `nohup`),
/// from the `SigIgn` mask of `/proc/self/status`; `false` where that cannot
/// be read. Call before installing any handler.
pub(crate) fn ignored_at_start(signal: i32) -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok());
    match (mask, u32::try_from(signal)) {
        (Some(mask), Ok(n)) if (1..=64).contains(&n) => mask & (1 << (n - 1)) != 0,
        _ => false,
    }
}

/// A command line for `program` with `args`, started through the exec step
/// in a new process group, with the signal mask the tool started with. With
/// a `deadline` (on [`monotonic_now`]'s clock),
/// the exec step runs nothing once it has passed, and waits for
/// [`handshake`] before it runs the command.
pub(crate) fn command(
    program: &OsStr,
    args: &[OsString],
    deadline: Option<Duration>,
) -> std::io::Result<Command> {
    let me = std::env::current_exe()?;
    let mut cmd = Command::new(me);
    let deadline = deadline.map_or_else(|| "-".to_owned(), |d| d.as_nanos().to_string());
    let mask = STARTED_WITH.get().map_or_else(|| "-".to_owned(), mask_arg);
    cmd.arg(EXEC)
        .arg(std::process::id().to_string())
        .arg(deadline)
        .arg(mask)
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

/// Stops what is left of group `pgid`: SIGTERM (and SIGCONT, so that a
/// stopped process hears it), then SIGKILL after `kill_after`; returns once it
/// is gone (or a second after the SIGKILL).
pub(crate) fn stop_group(pgid: i32, kill_after: Duration) {
    if !group_alive(pgid) {
        return;
    }
    signal_group(pgid, Signal::TERM);
    signal_group(pgid, Signal::CONT);
    if !wait_group_gone(pgid, kill_after) {
        signal_group(pgid, Signal::KILL);
        wait_group_gone(pgid, Duration::from_secs(1));
    }
}

/// The tool's side of the guardian: a pipe to it, once it is started, and
/// what it was told, so that a guardian that died (killed by someone, by the
/// kernel's OOM killer) is replaced by one told the same.
pub(crate) struct Guardian {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    /// The groups it watches, with the deadline and grace period of those it
    /// guards.
    groups: BTreeMap<i32, Option<(Duration, Duration)>>,
    /// The directories it removes if the tool dies.
    dirs: Vec<String>,
}

impl Guardian {
    /// A guardian that starts when first needed: a run that never starts a
    /// process (a conflict, a usage error) costs no process.
    pub(crate) fn lazy() -> Guardian {
        Guardian {
            child: None,
            stdin: None,
            groups: BTreeMap::new(),
            dirs: Vec::new(),
        }
    }

    /// Starts the guardian, if not yet, in a process group of its own (so
    /// that the terminal's signals do not reach it).
    pub(crate) fn ensure_started(&mut self) -> std::io::Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let mut child = Command::new(std::env::current_exe()?)
            .arg(GUARD)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()?;
        self.stdin = child.stdin.take();
        self.child = Some(child);
        Ok(())
    }

    /// Replaces a guardian that is no longer running by a new one told all
    /// the current one was; does nothing while it runs (or before it was
    /// first started).
    pub(crate) fn keep_running(&mut self) -> std::io::Result<()> {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(_)) | Err(_)) => self.replace(),
            _ => Ok(()),
        }
    }

    /// Starts a new guardian in place of the current one and tells it every
    /// group and directory.
    fn replace(&mut self) -> std::io::Result<()> {
        // Killed before its pipe closes: a guardian that reads the end of
        // its input kills every group it watches.
        if let Some(mut old) = self.child.take() {
            let _ = old.kill();
            let _ = old.wait();
        }
        drop(self.stdin.take());
        self.ensure_started()?;
        let mut lines: Vec<String> = self
            .groups
            .iter()
            .map(|(pgid, guarded)| match guarded {
                Some((deadline, grace)) => {
                    format!("guard {pgid} {} {}", deadline.as_nanos(), grace.as_nanos())
                }
                None => format!("group {pgid}"),
            })
            .collect();
        lines.extend(self.dirs.iter().map(|dir| format!("dir {dir}")));
        for line in lines {
            self.write(&line)?;
        }
        Ok(())
    }

    fn write(&mut self, line: &str) -> std::io::Result<()> {
        match self.stdin.as_mut() {
            Some(stdin) => writeln!(stdin, "{line}").and_then(|()| stdin.flush()),
            None => Err(std::io::Error::other("the guardian is not running")),
        }
    }

    /// Tells the guardian `line`, after the state it reflects was recorded;
    /// a guardian that cannot hear it is replaced (the new one is told the
    /// whole state).
    fn tell(&mut self, line: &str) -> std::io::Result<()> {
        if self.child.is_none() {
            return Err(std::io::Error::other("the guardian is not running"));
        }
        match self.write(line) {
            Ok(()) => Ok(()),
            Err(_) => self.replace(),
        }
    }

    /// Kill group `pgid` if the tool dies.
    pub(crate) fn watch_group(&mut self, pgid: i32) {
        self.groups.insert(pgid, None);
        let _ = self.tell(&format!("group {pgid}"));
    }

    /// Kill group `pgid` if the tool dies, and stop it (SIGTERM, then
    /// SIGKILL after `grace`) once `deadline` (on [`monotonic_now`]'s clock)
    /// passes without a newer one. An error means the guardian did not hear
    /// it: the group is not guarded.
    pub(crate) fn guard_group(
        &mut self,
        pgid: i32,
        deadline: Duration,
        grace: Duration,
    ) -> std::io::Result<()> {
        self.groups.insert(pgid, Some((deadline, grace)));
        self.tell(&format!(
            "guard {pgid} {} {}",
            deadline.as_nanos(),
            grace.as_nanos()
        ))
    }

    /// The loss deadline of group `pgid`'s lease moved to `deadline`.
    pub(crate) fn deadline(&mut self, pgid: i32, deadline: Duration) {
        if let Some(Some((told, _))) = self.groups.get_mut(&pgid) {
            *told = deadline;
        }
        let _ = self.tell(&format!("deadline {pgid} {}", deadline.as_nanos()));
    }

    /// Group `pgid` is gone: forget it.
    pub(crate) fn forget_group(&mut self, pgid: i32) {
        self.groups.remove(&pgid);
        let _ = self.tell(&format!("forget {pgid}"));
    }

    /// Remove `dir` if the tool dies (after the groups are gone).
    pub(crate) fn watch_dir(&mut self, dir: &Path) {
        if let Some(dir) = dir.to_str().filter(|d| !d.contains('\n')) {
            self.dirs.push(dir.to_owned());
            let _ = self.tell(&format!("dir {dir}"));
        }
    }

    /// `dir` was removed: forget it.
    pub(crate) fn forget_dir(&mut self, dir: &Path) {
        if let Some(dir) = dir.to_str() {
            self.dirs.retain(|d| d != dir);
            let _ = self.tell(&format!("forget-dir {dir}"));
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

/// A group the guardian watches.
#[derive(Default)]
struct Watched {
    /// When to stop it (SIGTERM), on [`monotonic_now`]'s clock.
    deadline: Option<Duration>,
    /// How long after the SIGTERM the SIGKILL comes.
    grace: Duration,
    /// When the SIGKILL is due, once the SIGTERM went.
    kill_at: Option<Duration>,
}

/// Parses a count of nanoseconds.
fn nanos(text: &str) -> Option<Duration> {
    text.parse::<u64>().ok().map(Duration::from_nanos)
}

/// The guardian: keeps the groups and directories it is told of; stops a
/// group whose deadline passes; when its input ends, kills those groups and
/// removes those directories.
pub(crate) fn guard_main() -> ExitCode {
    let (tx, lines) = crossbeam_channel::unbounded::<String>();
    // The pipe is read on a thread of its own, so that a deadline is kept
    // however the tool writes (or stops writing).
    let reader = std::thread::Builder::new()
        .name("respire-guard-input".into())
        .spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    if reader.is_err() {
        return ExitCode::FAILURE;
    }
    let mut groups: BTreeMap<i32, Watched> = BTreeMap::new();
    let mut dirs: Vec<PathBuf> = Vec::new();
    loop {
        let now = monotonic_now();
        for (pgid, w) in groups.iter_mut() {
            if w.kill_at.is_some_and(|at| at <= now) {
                w.kill_at = None;
                if group_alive(*pgid) {
                    signal_group(*pgid, Signal::KILL);
                }
            }
            if w.deadline.is_some_and(|d| d <= now) {
                w.deadline = None;
                signal_group(*pgid, Signal::TERM);
                signal_group(*pgid, Signal::CONT);
                w.kill_at = Some(now + w.grace);
            }
        }
        let next = groups
            .values()
            .flat_map(|w| [w.deadline, w.kill_at])
            .flatten()
            .min();
        let line = match next {
            Some(at) => match lines.recv_timeout(at.saturating_sub(now)) {
                Ok(line) => line,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => continue,
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            },
            None => match lines.recv() {
                Ok(line) => line,
                Err(_) => break,
            },
        };
        let mut words = line.splitn(4, ' ');
        match (words.next(), words.next(), words.next(), words.next()) {
            (Some("group"), Some(pgid), None, None) => {
                if let Some(pgid) = pgid.parse::<i32>().ok().filter(|p| *p > 1) {
                    groups.entry(pgid).or_default();
                }
            }
            (Some("guard"), Some(pgid), Some(deadline), Some(grace)) => {
                if let (Some(pgid), Some(deadline), Some(grace)) = (
                    pgid.parse::<i32>().ok().filter(|p| *p > 1),
                    nanos(deadline),
                    nanos(grace),
                ) {
                    groups.insert(
                        pgid,
                        Watched {
                            deadline: Some(deadline),
                            grace,
                            kill_at: None,
                        },
                    );
                }
            }
            (Some("deadline"), Some(pgid), Some(deadline), None) => {
                let watched = pgid.parse::<i32>().ok().and_then(|p| groups.get_mut(&p));
                // A group already stopped stays stopped: its lease is lost.
                if let (Some(w), Some(deadline)) = (watched, nanos(deadline))
                    && w.deadline.is_some()
                {
                    w.deadline = Some(deadline);
                }
            }
            (Some("forget"), Some(pgid), None, None) => {
                if let Ok(pgid) = pgid.parse::<i32>() {
                    groups.remove(&pgid);
                }
            }
            (Some("dir"), Some(_), ..) => {
                if let Some((_, dir)) = line.split_once(' ') {
                    dirs.push(PathBuf::from(dir));
                }
            }
            (Some("forget-dir"), Some(_), ..) => {
                if let Some((_, dir)) = line.split_once(' ') {
                    dirs.retain(|d| d != Path::new(dir));
                }
            }
            _ => {}
        }
    }
    for pgid in groups.keys() {
        signal_group(*pgid, Signal::KILL);
    }
    for pgid in groups.keys() {
        wait_group_gone(*pgid, Duration::from_secs(2));
    }
    for dir in &dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
    ExitCode::SUCCESS
}
