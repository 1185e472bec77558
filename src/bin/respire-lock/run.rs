//! `respire-lock run`: take the lease, run the command under it, stop the command
//! if the lease is lost, release the lease after.

use std::ffi::OsString;
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime};

use clap::ArgMatches;
use clap::parser::ValueSource;
use crossbeam_channel::{Receiver, select};
use respire_coordination::{
    CancelToken, Coordinator, Error, FencedGuard, MAX_TTL, RedlockGroup, RedlockGuard,
    RedlockOptions, ReleaseOutcome,
};
use rustix::process::{Pid, Signal};
use signal_hook::consts::{SIGCHLD, SIGINT, SIGTERM};

use crate::args::{EXIT_USAGE, RunArgs, Usage, Wait};
use crate::json::{self, Object};
use crate::status::{self, LeaseView};
use crate::{EXIT_CANNOT_RUN, EXIT_LEASE_LOST, EXIT_NOT_ACQUIRED, EXIT_UNAVAILABLE, say};

/// Where the lease is taken.
enum Target {
    Url(String),
    Throwaway,
    Redlock(Vec<String>),
}

/// Picks the deployment: the command line beats the environment; `--url` and
/// `--redlock` together on the command line are refused; from the environment,
/// `RESPIRE_LOCK_REDLOCK` beats `REDIS_URL`.
fn target(args: &RunArgs, matches: &ArgMatches) -> Result<Target, Usage> {
    let on_command_line = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    Ok(match (&args.url, &args.redlock) {
        (Some(_), Some(_)) if on_command_line("url") && on_command_line("redlock") => {
            return Err(Usage::new(
                "--url and --redlock exclude each other",
                Some("run"),
            ));
        }
        (Some(url), Some(_)) if on_command_line("url") => Target::Url(url.clone()),
        (_, Some(urls)) => Target::Redlock(urls.0.clone()),
        (Some(url), None) => Target::Url(url.clone()),
        (None, None) => Target::Throwaway,
    })
}

pub(crate) fn main(args: RunArgs, matches: &ArgMatches) -> ExitCode {
    let target = match target(&args, matches) {
        Ok(t) => t,
        Err(usage) => {
            usage.print();
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let report = Reporter {
        json: args.json,
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
    match target {
        Target::Redlock(urls) => run_redlock(&args, &report, &signals, &urls),
        Target::Url(url) => run_fenced(&args, &report, &signals, &url),
        Target::Throwaway => {
            let server = match ThrowawayServer::start() {
                Ok(server) => server,
                Err(e) => return report.error(EXIT_UNAVAILABLE, &e),
            };
            report.throwaway(&server.url());
            let code = run_fenced(&args, &report, &signals, &server.url());
            drop(server);
            code
        }
    }
}

fn run_fenced(args: &RunArgs, report: &Reporter, signals: &Receiver<i32>, url: &str) -> ExitCode {
    let key = &args.key;
    let coord = match Coordinator::builder(url)
        .key_prefix(&args.keys.prefix)
        .node_timeout(args.keys.node_timeout)
        .build()
    {
        Ok(c) => c,
        Err(e) => return report.error(EXIT_UNAVAILABLE, &e.to_string()),
    };
    let (lease_key, fence_key) = status::fenced_keys(key);
    let lock = match coord.fenced_lock(&lease_key, &fence_key) {
        Ok(l) => l,
        Err(e) => return report.error(EXIT_USAGE, &e.to_string()),
    };
    let ttl = args.ttl;
    let guard = match wait_for_lease(args, report, signals, |deadline, cancel| match deadline {
        Some(d) if d <= Instant::now() => lock.try_acquire(ttl),
        Some(d) => lock.acquire_until(ttl, d, cancel),
        None => lock.acquire(ttl, cancel).map(Some),
    }) {
        Ok(guard) => guard,
        Err(code) => return code,
    };
    let renewal = match guard.keep_alive() {
        Ok(r) => r,
        Err(e @ Error::InvalidArgument(_)) => return report.error(EXIT_USAGE, &e.to_string()),
        Err(e) => return report.error(EXIT_UNAVAILABLE, &e.to_string()),
    };
    let token = guard.fencing_token();
    report.acquired(guard.key(), Some(token.get()), ttl);
    let env = [
        ("RESPIRE_FENCING_TOKEN", token.to_string()),
        ("RESPIRE_LOCK_KEY", guard.key().to_owned()),
    ];
    let physical_key = guard.key().to_owned();
    let node_timeout = args.keys.node_timeout;
    let why_lost = || fenced_loss_cause(url, &physical_key, token.get(), node_timeout);
    let ended = run_child(args, report, &env, guard.lost_signal(), signals, &why_lost);
    drop(renewal);
    release_fenced(guard, report);
    drop(coord);
    finish(ended, report)
}

fn run_redlock(
    args: &RunArgs,
    report: &Reporter,
    signals: &Receiver<i32>,
    urls: &[String],
) -> ExitCode {
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let options = RedlockOptions {
        node_timeout: args.keys.node_timeout,
        ..RedlockOptions::default()
    };
    let group = match RedlockGroup::connect(&urls, options) {
        Ok(g) => g,
        Err(
            e @ (Error::InvalidArgument(_)
            | Error::NotIndependent(_)
            | Error::NodeTimeoutTooShort { .. }),
        ) => {
            return report.error(EXIT_USAGE, &e.to_string());
        }
        Err(e) => return report.error(EXIT_UNAVAILABLE, &e.to_string()),
    };
    let name = format!("{}{}", args.keys.prefix, args.key);
    let (name, ttl) = (&name, args.ttl);
    let guard = match wait_for_lease(args, report, signals, |deadline, cancel| match deadline {
        Some(d) if d <= Instant::now() => group.try_acquire(name, ttl),
        Some(d) => group.acquire_until(name, ttl, d, cancel),
        None => group.acquire(name, ttl, cancel).map(Some),
    }) {
        Ok(guard) => guard,
        Err(code) => return code,
    };
    let renewal = match guard.keep_alive() {
        Ok(r) => r,
        Err(e @ Error::InvalidArgument(_)) => return report.error(EXIT_USAGE, &e.to_string()),
        Err(e) => return report.error(EXIT_UNAVAILABLE, &e.to_string()),
    };
    report.acquired(guard.key(), None, ttl);
    let env = [("RESPIRE_LOCK_KEY", guard.key().to_owned())];
    let why_lost = || redlock_loss_cause(&guard);
    let ended = run_child(args, report, &env, guard.lost_signal(), signals, &why_lost);
    drop(renewal);
    release_redlock(guard, report);
    finish(ended, report)
}

/// Signals for this process, delivered on a channel.
fn signals() -> std::io::Result<Receiver<i32>> {
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGCHLD])?;
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::Builder::new()
        .name("respire-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                if tx.send(signal).is_err() {
                    return;
                }
            }
        })?;
    Ok(rx)
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

/// Waits for the lease as `--wait` says; SIGINT / SIGTERM cancel the wait. The
/// `acquire` closure gets the deadline (`None`: wait until acquired) and the
/// cancellation token. On failure, returns the exit code to end with.
fn wait_for_lease<G>(
    args: &RunArgs,
    report: &Reporter,
    signals: &Receiver<i32>,
    acquire: impl FnOnce(Option<Instant>, &CancelToken) -> respire_coordination::Result<Option<G>>,
) -> Result<G, ExitCode> {
    let cancel = CancelToken::new();
    let deadline = deadline(args.wait, Instant::now());
    let (result, signal) = std::thread::scope(|s| {
        let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
        let cancel = &cancel;
        let watcher = s.spawn(move || {
            loop {
                select! {
                    recv(signals) -> sig => match sig {
                        Ok(SIGINT | SIGTERM) | Err(_) => {
                            cancel.cancel();
                            return sig.ok();
                        }
                        Ok(_) => {}
                    },
                    recv(done_rx) -> _ => return None,
                }
            }
        });
        let result = acquire(deadline, cancel);
        drop(done_tx);
        (result, watcher.join().unwrap_or(None))
    });
    match result {
        Ok(Some(guard)) => Ok(guard),
        Ok(None) => Err(report.not_acquired()),
        Err(Error::Cancelled) => Err(report.interrupted(signal.unwrap_or(SIGINT))),
        Err(e @ Error::InvalidArgument(_)) => Err(report.error(EXIT_USAGE, &e.to_string())),
        Err(e) => Err(report.error(EXIT_UNAVAILABLE, &e.to_string())),
    }
}

/// Why a lease was lost: a stable word for programs and a sentence for people.
struct LossCause {
    cause: &'static str,
    reason: String,
}

/// Reads the lease key once after a loss to say what happened to it.
fn fenced_loss_cause(url: &str, lease_key: &str, token: u64, timeout: Duration) -> LossCause {
    match status::read_lease(url, lease_key, None, timeout) {
        Ok(LeaseView { value: None, .. }) => LossCause {
            cause: "expired",
            reason: "the lease key is gone: it expired or was deleted".into(),
        },
        Ok(view) if view.token() == Some(token) => LossCause {
            cause: "deadline",
            reason: "no renewal was confirmed before the local loss deadline \
                     (the server still had the lease)"
                .into(),
        },
        Ok(view) => LossCause {
            cause: "taken_over",
            reason: match view.token() {
                Some(other) => format!("another holder has the key, with fencing token {other}"),
                None => "the key holds another owner's value".into(),
            },
        },
        Err(e) => LossCause {
            cause: "unreachable",
            reason: format!("no renewal was confirmed before the local loss deadline ({e})"),
        },
    }
}

fn redlock_loss_cause(guard: &RedlockGuard) -> LossCause {
    let nodes: Vec<String> = guard
        .last_evidence()
        .iter()
        .map(|n| format!("{}: {}", n.node, n.outcome))
        .collect();
    LossCause {
        cause: "quorum",
        reason: format!(
            "the lock could not be kept on a quorum of nodes ({})",
            nodes.join("; ")
        ),
    }
}

/// How the command's supervision ended.
enum Ended {
    Exited(ExitStatus),
    /// The lease was lost; the command was stopped and ended with this status.
    LeaseLost(ExitStatus),
    CannotStart(String),
    WaitFailed(std::io::Error),
}

/// Starts the command and supervises it until it exits.
fn run_child(
    args: &RunArgs,
    report: &Reporter,
    env: &[(&str, String)],
    lost: &Receiver<()>,
    signals: &Receiver<i32>,
    why_lost: &dyn Fn() -> LossCause,
) -> Ended {
    let program = &args.command[0];
    let child = Command::new(program)
        .args(&args.command[1..])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::inherit())
        .spawn();
    match child {
        Ok(mut child) => {
            report.started(child.id(), &args.command);
            let ended = supervise(&mut child, report, lost, signals, args.kill_after, why_lost);
            if let Ended::Exited(status) | Ended::LeaseLost(status) = &ended {
                report.exited(*status);
            }
            ended
        }
        Err(e) => Ended::CannotStart(format!("cannot run {program:?}: {e}")),
    }
}

/// Waits for the child, stopping it if the lease is lost or we are told to stop.
fn supervise(
    child: &mut Child,
    report: &Reporter,
    lost_signal: &Receiver<()>,
    signals: &Receiver<i32>,
    kill_after: Duration,
    why_lost: &dyn Fn() -> LossCause,
) -> Ended {
    let pid = Pid::from_child(child);
    let mut stopping_since: Option<Instant> = None;
    let mut lease_lost = false;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if lease_lost => return Ended::LeaseLost(status),
            Ok(Some(status)) => return Ended::Exited(status),
            Ok(None) => {}
            Err(e) => return Ended::WaitFailed(e),
        }
        if let Some(since) = stopping_since
            && since.elapsed() >= kill_after
        {
            let _ = rustix::process::kill_process(pid, Signal::KILL);
        }
        // SIGCHLD wakes this promptly; the timeout covers a coalesced signal
        // and the SIGKILL deadline.
        let tick = crossbeam_channel::after(Duration::from_millis(250));
        let lost = if lease_lost {
            crossbeam_channel::never()
        } else {
            lost_signal.clone()
        };
        select! {
            recv(lost) -> _ => {
                lease_lost = true;
                let _ = rustix::process::kill_process(pid, Signal::TERM);
                stopping_since.get_or_insert_with(Instant::now);
                // Stop first, explain after: the explanation asks Redis.
                report.lost(&why_lost());
            }
            recv(signals) -> sig => {
                if let Ok(SIGINT | SIGTERM) = sig {
                    // Pass it on; a second one kills.
                    if stopping_since.is_some() {
                        let _ = rustix::process::kill_process(pid, Signal::KILL);
                    } else {
                        let _ = rustix::process::kill_process(pid, Signal::TERM);
                        stopping_since = Some(Instant::now());
                    }
                }
            }
            recv(tick) -> _ => {}
        }
    }
}

fn finish(ended: Ended, report: &Reporter) -> ExitCode {
    match ended {
        Ended::Exited(status) => ExitCode::from(status_code(status)),
        Ended::LeaseLost(_) => report.error(
            EXIT_LEASE_LOST,
            &format!(
                "the lease on {:?} was lost; the command was stopped",
                report.key
            ),
        ),
        Ended::CannotStart(msg) => report.error(EXIT_CANNOT_RUN, &msg),
        Ended::WaitFailed(e) => report.error(
            EXIT_CANNOT_RUN,
            &format!("waiting for the command failed: {e}"),
        ),
    }
}

fn release_fenced(guard: FencedGuard, report: &Reporter) {
    let (outcome, detail) = match guard.release() {
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
    };
    report.released(outcome, detail.as_deref());
}

fn release_redlock(mut guard: RedlockGuard, report: &Reporter) {
    match guard.release() {
        Ok(true) => report.released("released", None),
        Ok(false) => report.released(
            "lapsed",
            Some("it had already expired or been taken over on some nodes"),
        ),
        Err(e) => report.released("failed", Some(&e.to_string())),
    }
}

fn status_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => 128u8.wrapping_add(signal as u8),
        (None, None) => EXIT_CANNOT_RUN,
    }
}

/// Reports the events of one run on stderr: sentences for people, or with
/// `--json` one JSON object per event.
struct Reporter {
    json: bool,
    verbose: bool,
    key: String,
}

impl Reporter {
    /// Prints one event: `fields` adds the event's own JSON fields; `text` is
    /// the sentence printed without `--json` (`None`: nothing).
    fn emit(&self, event: &str, fields: impl FnOnce(Object) -> Object, text: Option<String>) {
        if self.json {
            let time = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
            let obj = Object::new()
                .str("event", event)
                .str("time", &time)
                .str("key", &self.key);
            say(&fields(obj).finish());
        } else if let Some(text) = text {
            say(&format!("respire-lock: {text}"));
        }
    }

    fn throwaway(&self, url: &str) {
        self.emit(
            "throwaway",
            |o| o.str("url", url),
            Some(format!(
                "no --url and no REDIS_URL: started a throwaway redis-server at {url} \
                 (it only coordinates with processes using that server)"
            )),
        );
    }

    fn acquired(&self, lease_key: &str, token: Option<u64>, ttl: Duration) {
        let text = match token {
            Some(t) => format!("acquired {:?} with fencing token {t}", self.key),
            None => format!("acquired {:?} on a quorum (no fencing token)", self.key),
        };
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.emit(
            "acquired",
            |o| {
                o.str("lease_key", lease_key)
                    .opt_num("token", token)
                    .num("ttl_ms", ttl_ms)
                    .str("mode", if token.is_some() { "fenced" } else { "redlock" })
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

    fn lost(&self, cause: &LossCause) {
        self.emit(
            "lost",
            |o| o.str("cause", cause.cause).str("reason", &cause.reason),
            Some(format!(
                "the lease was lost ({}); stopping the command",
                cause.reason
            )),
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

    fn not_acquired(&self) -> ExitCode {
        self.emit(
            "not_acquired",
            |o| o.num("exit_code", EXIT_NOT_ACQUIRED),
            Some(format!("{:?} is held elsewhere; not acquired", self.key)),
        );
        ExitCode::from(EXIT_NOT_ACQUIRED)
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

/// A `redis-server` on a free loopback port for one run, killed on drop.
struct ThrowawayServer {
    child: Child,
    port: u16,
    dir: std::path::PathBuf,
}

impl ThrowawayServer {
    fn start() -> Result<ThrowawayServer, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("cannot find a free port: {e}"))?
            .port();
        let dir = std::env::temp_dir().join(format!("respire-lock-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {dir:?}: {e}"))?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("no --url or REDIS_URL, and cannot start redis-server: {e}"))?;
        let server = ThrowawayServer { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err("the throwaway redis-server did not start within 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for ThrowawayServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
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
}
