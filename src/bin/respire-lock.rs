//! `respire-lock`: `flock(1)` for a fleet.
//!
//! `respire-lock run [OPTIONS] KEY -- CMD [ARGS...]` takes a fenced lease on KEY,
//! runs CMD with the fencing token in `RESPIRE_FENCING_TOKEN`, keeps the lease
//! alive while CMD runs, stops CMD (SIGTERM, then SIGKILL) if the lease is lost,
//! releases the lease when CMD exits or when it is itself told to stop
//! (SIGINT, SIGTERM), and exits with CMD's status.
//!
//! `respire-lock doctor URL` reports what on a deployment weakens the guarantees.

use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, select};
use respire_coordination::{
    CancelToken, Coordinator, Error, FencedGuard, RedlockGroup, RedlockOptions, ReleaseOutcome,
};
use rustix::process::{Pid, Signal};
use signal_hook::consts::{SIGCHLD, SIGINT, SIGTERM};

/// Bad command line.
const EXIT_USAGE: u8 = 64;
/// Redis could not be reached or refused an operation.
const EXIT_UNAVAILABLE: u8 = 69;
/// The command could not be started.
const EXIT_CANNOT_RUN: u8 = 70;
/// The lease is held by someone else and the wait ran out.
const EXIT_NOT_ACQUIRED: u8 = 75;
/// The command was stopped because the lease was lost.
const EXIT_LEASE_LOST: u8 = 76;

const USAGE: &str = "\
usage: respire-lock run [OPTIONS] KEY -- CMD [ARGS...]
       respire-lock doctor [URL]

run: take a fenced lease on KEY, run CMD while holding it, release it after.
  --url URL          the Redis deployment (default: $REDIS_URL; with neither,
                     a throwaway local redis-server is started for the run)
  --redlock URL,URL,URL
                     take a Redlock quorum across these independent servers
                     (an odd number, at least 3) instead; no fencing token
  --wait DURATION    how long to wait for the lease (default: until acquired;
                     0 = one attempt)
  --ttl DURATION     lease time-to-live, renewed at half (default: 30s)
  --kill-after DUR   after SIGTERM on lease loss, SIGKILL this much later
                     (default: 10s)
  --prefix PREFIX    key prefix (default: respire-lock:)
  --node-timeout DUR the longest one Redis command may take (default: 500ms)
  -v, --verbose      report acquisition and release on stderr
  DURATION is a number with ms, s, m or h (a bare number is seconds).

  CMD sees RESPIRE_FENCING_TOKEN (not with --redlock; strictly increasing per KEY: pass it to the
  resource you protect and have it refuse lower tokens) and RESPIRE_LOCK_KEY.

exit status: CMD's status (128+N if it died of signal N), or
  64 usage error, 69 Redis unavailable or refused, 70 CMD could not be started,
  75 not acquired before the wait ran out, 76 CMD stopped: the lease was lost.

doctor: report what on the deployment weakens the guarantees (persistence,
  eviction, replication, ACL rights, client tracking).";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("run") => match RunOptions::parse(&args[1..]) {
            Ok(opts) => run(opts),
            Err(msg) => usage_error(&msg),
        },
        Some("doctor") => doctor(args.get(1).cloned()),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some(other) => usage_error(&format!("unknown command {other:?}")),
        None => usage_error("no command"),
    }
}

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("respire-lock: {msg}\n\n{USAGE}");
    ExitCode::from(EXIT_USAGE)
}

fn fail(code: u8, msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("respire-lock: {msg}");
    ExitCode::from(code)
}

/// Parses `500ms`, `10s`, `2m`, `1h`, or a bare number of seconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("bad duration {text:?} (use e.g. 500ms, 10s, 2m)");
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let value: f64 = number.parse().map_err(|_| bad())?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(bad()),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| bad())
}

struct RunOptions {
    url: Option<String>,
    redlock: Option<String>,
    wait: Option<Duration>,
    ttl: Duration,
    kill_after: Duration,
    prefix: String,
    node_timeout: Duration,
    verbose: bool,
    key: String,
    command: Vec<String>,
}

impl RunOptions {
    fn parse(args: &[String]) -> Result<RunOptions, String> {
        let mut opts = RunOptions {
            url: None,
            redlock: None,
            wait: None,
            ttl: Duration::from_secs(30),
            kill_after: Duration::from_secs(10),
            prefix: "respire-lock:".into(),
            node_timeout: Duration::from_millis(500),
            verbose: false,
            key: String::new(),
            command: Vec::new(),
        };
        let mut rest = args.iter();
        let mut key = None;
        while let Some(arg) = rest.next() {
            let mut value = |name: &str| {
                rest.next()
                    .cloned()
                    .ok_or_else(|| format!("{name} needs a value"))
            };
            match arg.as_str() {
                "--url" => opts.url = Some(value("--url")?),
                "--redlock" => opts.redlock = Some(value("--redlock")?),
                "--wait" => opts.wait = Some(parse_duration(&value("--wait")?)?),
                "--ttl" => opts.ttl = parse_duration(&value("--ttl")?)?,
                "--kill-after" => opts.kill_after = parse_duration(&value("--kill-after")?)?,
                "--prefix" => opts.prefix = value("--prefix")?,
                "--node-timeout" => opts.node_timeout = parse_duration(&value("--node-timeout")?)?,
                "-v" | "--verbose" => opts.verbose = true,
                "--" => {
                    opts.command = rest.by_ref().cloned().collect();
                    break;
                }
                flag if flag.starts_with('-') => return Err(format!("unknown option {flag}")),
                _ if key.is_none() => key = Some(arg.clone()),
                other => return Err(format!("unexpected {other:?} (put the command after --)")),
            }
        }
        opts.key = key.ok_or("no KEY")?;
        if opts.key.contains(['{', '}']) {
            return Err("KEY may not contain braces: it becomes the keys' hash tag".into());
        }
        if opts.url.is_some() && opts.redlock.is_some() {
            return Err("--url and --redlock exclude each other".into());
        }
        if opts.command.is_empty() {
            return Err("no command (put it after --)".into());
        }
        Ok(opts)
    }
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

fn run(opts: RunOptions) -> ExitCode {
    let signals = match signals() {
        Ok(rx) => rx,
        Err(e) => {
            return fail(
                EXIT_CANNOT_RUN,
                format!("cannot install signal handlers: {e}"),
            );
        }
    };
    let key = opts.key.clone();
    if let Some(urls) = &opts.redlock {
        let urls: Vec<&str> = urls.split(',').map(str::trim).collect();
        let options = RedlockOptions {
            node_timeout: opts.node_timeout,
            ..RedlockOptions::default()
        };
        let group = match RedlockGroup::connect(&urls, options) {
            Ok(g) => g,
            Err(e @ (Error::InvalidArgument(_) | Error::NotIndependent(_))) => {
                return fail(EXIT_USAGE, e);
            }
            Err(e) => return fail(EXIT_UNAVAILABLE, e),
        };
        let name = format!("{}{key}", opts.prefix);
        let (name, ttl) = (&name, opts.ttl);
        let guard = match wait_for_lease(&opts, &signals, |deadline, cancel| match deadline {
            Some(d) if d <= Instant::now() => group.try_acquire(name, ttl),
            Some(d) => group.acquire_until(name, ttl, d, cancel),
            None => group.acquire(name, ttl, cancel).map(Some),
        }) {
            Ok(guard) => guard,
            Err(code) => return code,
        };
        let renewal = match guard.keep_alive() {
            Ok(r) => r,
            Err(e) => return fail(EXIT_UNAVAILABLE, e),
        };
        if opts.verbose {
            eprintln!("respire-lock: acquired {key:?} on a quorum (no fencing token)");
        }
        let env = [("RESPIRE_LOCK_KEY", guard.key().to_owned())];
        let ended = run_child(&opts, &env, guard.lost_signal(), &signals);
        drop(renewal);
        let mut guard = guard;
        match guard.release() {
            Ok(true) if opts.verbose => eprintln!("respire-lock: released {key:?}"),
            Ok(true) => {}
            Ok(false) => eprintln!("respire-lock: {key:?} had already lapsed on some nodes"),
            Err(e) => eprintln!("respire-lock: release of {key:?}: {e}"),
        }
        return finish(ended, &key);
    }

    let mut throwaway = None;
    let url = match opts.url.clone().or_else(|| std::env::var("REDIS_URL").ok()) {
        Some(url) => url,
        None => match ThrowawayServer::start() {
            Ok(server) => {
                eprintln!(
                    "respire-lock: no --url and no REDIS_URL: started a throwaway redis-server at {} \
                     (it only coordinates with processes using that server)",
                    server.url()
                );
                let url = server.url();
                throwaway = Some(server);
                url
            }
            Err(e) => return fail(EXIT_UNAVAILABLE, e),
        },
    };
    let coord = match Coordinator::builder(&url)
        .key_prefix(&opts.prefix)
        .node_timeout(opts.node_timeout)
        .build()
    {
        Ok(c) => c,
        Err(e) => return fail(EXIT_UNAVAILABLE, e),
    };
    let lock = match coord.fenced_lock(&format!("{{{key}}}:lease"), &format!("{{{key}}}:fence")) {
        Ok(l) => l,
        Err(e) => return fail(EXIT_USAGE, e),
    };
    let ttl = opts.ttl;
    let guard = match wait_for_lease(&opts, &signals, |deadline, cancel| match deadline {
        Some(d) if d <= Instant::now() => lock.try_acquire(ttl),
        Some(d) => lock.acquire_until(ttl, d, cancel),
        None => lock.acquire(ttl, cancel).map(Some),
    }) {
        Ok(guard) => guard,
        Err(code) => return code,
    };
    let renewal = match guard.keep_alive() {
        Ok(r) => r,
        Err(e @ Error::InvalidArgument(_)) => return fail(EXIT_USAGE, e),
        Err(e) => return fail(EXIT_UNAVAILABLE, e),
    };
    let token = guard.fencing_token();
    if opts.verbose {
        eprintln!("respire-lock: acquired {key:?} with fencing token {token}");
    }
    let env = [
        ("RESPIRE_FENCING_TOKEN", token.to_string()),
        ("RESPIRE_LOCK_KEY", guard.key().to_owned()),
    ];
    let ended = run_child(&opts, &env, guard.lost_signal(), &signals);
    drop(renewal);
    release_guard(guard, opts.verbose);
    drop(throwaway);
    finish(ended, &key)
}

/// Waits for the lease as `--wait` says; SIGINT / SIGTERM cancel the wait. The
/// `acquire` closure gets the deadline (`None`: wait until acquired) and the
/// cancellation token. On failure, returns the exit code to end with.
fn wait_for_lease<G>(
    opts: &RunOptions,
    signals: &Receiver<i32>,
    acquire: impl FnOnce(Option<Instant>, &CancelToken) -> respire_coordination::Result<Option<G>>,
) -> Result<G, ExitCode> {
    let cancel = CancelToken::new();
    let deadline = opts.wait.map(|w| Instant::now() + w);
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
    let key = &opts.key;
    match result {
        Ok(Some(guard)) => Ok(guard),
        Ok(None) => Err(fail(
            EXIT_NOT_ACQUIRED,
            format!("{key:?} is held elsewhere; not acquired"),
        )),
        Err(Error::Cancelled) => {
            eprintln!("respire-lock: interrupted while waiting for {key:?}");
            Err(ExitCode::from(128 + signal.unwrap_or(SIGINT) as u8))
        }
        Err(e @ Error::InvalidArgument(_)) => Err(fail(EXIT_USAGE, e)),
        Err(e) => Err(fail(EXIT_UNAVAILABLE, e)),
    }
}

/// Starts the command and supervises it until it exits.
fn run_child(
    opts: &RunOptions,
    env: &[(&str, String)],
    lost: &Receiver<()>,
    signals: &Receiver<i32>,
) -> Ended {
    let child = Command::new(&opts.command[0])
        .args(&opts.command[1..])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::inherit())
        .spawn();
    match child {
        Ok(mut child) => supervise(&mut child, lost, signals, opts.kill_after),
        Err(e) => Ended::CannotStart(format!("cannot run {:?}: {e}", opts.command[0])),
    }
}

fn finish(ended: Ended, key: &str) -> ExitCode {
    match ended {
        Ended::Exited(status) => ExitCode::from(status_code(status)),
        Ended::LeaseLost => fail(
            EXIT_LEASE_LOST,
            format!("the lease on {key:?} was lost; the command was stopped"),
        ),
        Ended::CannotStart(msg) => fail(EXIT_CANNOT_RUN, msg),
        Ended::WaitFailed(e) => fail(
            EXIT_CANNOT_RUN,
            format!("waiting for the command failed: {e}"),
        ),
    }
}

enum Ended {
    Exited(ExitStatus),
    LeaseLost,
    CannotStart(String),
    WaitFailed(std::io::Error),
}

/// Waits for the child, stopping it if the lease is lost or we are told to stop.
fn supervise(
    child: &mut Child,
    lost_signal: &Receiver<()>,
    signals: &Receiver<i32>,
    kill_after: Duration,
) -> Ended {
    let pid = Pid::from_child(child);
    let mut stopping_since: Option<Instant> = None;
    let mut lease_lost = false;
    loop {
        match child.try_wait() {
            Ok(Some(_)) if lease_lost => return Ended::LeaseLost,
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
                eprintln!("respire-lock: the lease was lost; stopping the command");
                lease_lost = true;
                let _ = rustix::process::kill_process(pid, Signal::TERM);
                stopping_since.get_or_insert_with(Instant::now);
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

fn release_guard(guard: FencedGuard, verbose: bool) {
    let key = guard.key().to_owned();
    match guard.release() {
        Ok(ReleaseOutcome::Released) if verbose => eprintln!("respire-lock: released {key:?}"),
        Ok(ReleaseOutcome::Released) => {}
        Ok(outcome) => eprintln!("respire-lock: release of {key:?}: {outcome:?}"),
        Err(e) => eprintln!("respire-lock: release of {key:?} failed: {e}"),
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

/// What `doctor` found about one aspect of the deployment.
enum Finding {
    Ok(String),
    Warn(String),
    Fail(String),
}

fn doctor(url: Option<String>) -> ExitCode {
    let Some(url) = url.or_else(|| std::env::var("REDIS_URL").ok()) else {
        return usage_error("doctor needs a URL (or REDIS_URL)");
    };
    let findings = match diagnose(&url) {
        Ok(f) => f,
        Err(e) => return fail(EXIT_UNAVAILABLE, e),
    };
    let mut failed = false;
    for finding in findings {
        match finding {
            Finding::Ok(m) => println!("ok    {m}"),
            Finding::Warn(m) => println!("warn  {m}"),
            Finding::Fail(m) => {
                failed = true;
                println!("FAIL  {m}");
            }
        }
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn diagnose(url: &str) -> Result<Vec<Finding>, Box<dyn std::error::Error>> {
    // Checks that the library can connect at all (auth, TLS) first.
    Coordinator::builder(url).build()?;
    let client = redis::Client::open(url)?;
    let timeout = Duration::from_secs(2);
    let mut conn = client.get_connection_with_timeout(timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    let mut out = Vec::new();
    let info = |conn: &mut redis::Connection, section: &str| -> String {
        redis::cmd("INFO")
            .arg(section)
            .query(conn)
            .unwrap_or_default()
    };
    let field = |text: &str, name: &str| -> Option<String> {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.trim().to_owned())
    };
    let config = |conn: &mut redis::Connection, name: &str| -> Option<String> {
        let pair: Vec<String> = redis::cmd("CONFIG").arg("GET").arg(name).query(conn).ok()?;
        pair.get(1).cloned()
    };

    let server = info(&mut conn, "server");
    let version = field(&server, "redis_version").unwrap_or_else(|| "unknown".into());
    let major: u32 = version
        .split('.')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if major >= 6 {
        out.push(Finding::Ok(format!(
            "redis {version}: client tracking and RESP3 supported"
        )));
    } else {
        out.push(Finding::Warn(format!(
            "redis {version}: no client tracking; waiters will poll"
        )));
    }

    match (
        config(&mut conn, "appendonly"),
        config(&mut conn, "appendfsync"),
    ) {
        (Some(aof), Some(fsync)) if aof == "yes" && fsync == "always" => out.push(Finding::Ok(
            "persistence: appendonly yes, appendfsync always: the fence counter survives a crash"
                .into(),
        )),
        (Some(aof), Some(fsync)) if aof == "yes" => out.push(Finding::Warn(format!(
            "persistence: appendfsync {fsync}: a crash can lose the last fence increments, \
             and tokens can then repeat; use appendfsync always"
        ))),
        (Some(_), _) => out.push(Finding::Fail(
            "persistence: appendonly no: a restart loses the fence counter (tokens repeat) \
             and every lease"
                .into(),
        )),
        _ => out.push(Finding::Warn(
            "persistence: cannot read CONFIG (ACL?); check appendonly yes / appendfsync always"
                .into(),
        )),
    }

    match config(&mut conn, "maxmemory-policy") {
        Some(p) if p == "noeviction" => out.push(Finding::Ok(
            "eviction: noeviction: keys are never evicted".into(),
        )),
        Some(p) if p.starts_with("allkeys") => out.push(Finding::Fail(format!(
            "eviction: {p} can evict the fence counter (tokens then restart) and leases"
        ))),
        Some(p) => out.push(Finding::Warn(format!(
            "eviction: {p} can evict leases (they carry expiries) before they expire"
        ))),
        None => out.push(Finding::Warn(
            "eviction: cannot read maxmemory-policy (ACL?)".into(),
        )),
    }

    let replication = info(&mut conn, "replication");
    match field(&replication, "role").as_deref() {
        Some("master") => {
            let replicas: u32 = field(&replication, "connected_slaves")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            if replicas > 0 {
                out.push(Finding::Warn(format!(
                    "replication: {replicas} replica(s), asynchronous: a failover can lose \
                     grants and fence increments (two holders, repeated tokens)"
                )));
            } else {
                out.push(Finding::Ok("replication: standalone primary".into()));
            }
        }
        Some(role) => out.push(Finding::Fail(format!(
            "replication: this server is a {role}: locks must be taken on the primary"
        ))),
        None => out.push(Finding::Warn(
            "replication: cannot read INFO replication".into(),
        )),
    }
    if field(&info(&mut conn, "cluster"), "cluster_enabled").as_deref() == Some("1") {
        out.push(Finding::Warn(
            "cluster mode: this tool's keys share the hash tag {KEY}; the library's single-node \
             connections do not follow MOVED redirects"
                .into(),
        ));
    }

    // ACL rights, each tried harmlessly on its own connection.
    let rights: [(&str, &[&str]); 4] = [
        ("CLIENT ID", &["CLIENT", "ID"]),
        (
            "CLIENT KILL",
            &["CLIENT", "KILL", "ID", "9223372036854775807"],
        ),
        ("EVAL", &["EVAL", "return 1", "0"]),
        ("CLIENT TRACKING", &["CLIENT", "TRACKING", "OFF"]),
    ];
    for (what, args) in rights {
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        match cmd.query::<redis::Value>(&mut conn) {
            Err(e) if e.code() == Some("NOPERM") => out.push(Finding::Fail(format!(
                "acl: {what} denied: {}",
                match what {
                    "CLIENT TRACKING" => "waiters fall back to polling",
                    "EVAL" => "no primitive works",
                    _ => "keep-alive cannot run",
                }
            ))),
            _ => out.push(Finding::Ok(format!("acl: {what} allowed"))),
        }
    }
    let mut sub = client.get_connection_with_timeout(timeout)?;
    sub.set_read_timeout(Some(timeout))?;
    match sub.as_pubsub().subscribe("__redis__:invalidate") {
        Err(e) if e.code() == Some("NOPERM") => out.push(Finding::Fail(
            "acl: channel __redis__:invalidate denied: waiters fall back to polling".into(),
        )),
        Err(e) => out.push(Finding::Warn(format!(
            "subscribe to __redis__:invalidate: {e}"
        ))),
        Ok(()) => out.push(Finding::Ok(
            "acl: channel __redis__:invalidate allowed".into(),
        )),
    }
    Ok(out)
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

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn run_options() {
        let o = RunOptions::parse(&args(&[
            "--wait", "0", "--ttl", "5s", "job", "--", "echo", "-n", "x",
        ]))
        .unwrap();
        assert_eq!(o.wait, Some(Duration::ZERO));
        assert_eq!(o.ttl, Duration::from_secs(5));
        assert_eq!(o.key, "job");
        assert_eq!(o.command, ["echo", "-n", "x"]);
        assert!(RunOptions::parse(&args(&["job"])).is_err());
        assert!(RunOptions::parse(&args(&["--", "echo"])).is_err());
        assert!(RunOptions::parse(&args(&["{job}", "--", "echo"])).is_err());
        assert!(RunOptions::parse(&args(&["--bogus", "job", "--", "echo"])).is_err());
        assert!(RunOptions::parse(&args(&["job", "extra", "--", "echo"])).is_err());
    }
}
