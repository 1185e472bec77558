//! The `respire-lock` command-line tool, run as a real process against real
//! servers.
//!
//! `tests/mutants/cli/*.patch` put back defects these tests must catch; each
//! names the test that catches it (`git apply` it, run that test, `git apply
//! -R` it).

mod support;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::Coordinator;
use support::{TestServer, shared_server, unique_prefix, wait_until};

/// Scripts the server at `url` has run: a fenced acquire attempt is one.
fn script_calls(url: &str) -> u64 {
    let mut con = redis::Client::open(url).unwrap().get_connection().unwrap();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut con)
        .unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| l.split(['=', ',']).nth(1)?.parse::<u64>().ok())
        .sum()
}

/// Waits until the server has run a script since `before` (the waiting run's
/// first attempt found the key held), then checks the run is still waiting.
fn assert_waiting_after_an_attempt(url: &str, before: u64, waiting: &mut std::process::Child) {
    wait_until(Duration::from_secs(10), "the run's first attempt", || {
        script_calls(url) > before
    });
    assert!(
        waiting.try_wait().unwrap().is_none(),
        "it should still be waiting"
    );
}

const BIN: &str = env!("CARGO_BIN_EXE_respire-lock");

/// Every environment variable `run` reads.
const ENV_VARS: [&str; 28] = [
    "REDIS_URL",
    "RESPIRE_LOCK_REDLOCK",
    "RESPIRE_LOCK_THROWAWAY",
    "RESPIRE_LOCK_NONBLOCK",
    "RESPIRE_LOCK_WAIT",
    "RESPIRE_LOCK_CONFLICT_EXIT_CODE",
    "RESPIRE_LOCK_LOST_EXIT_CODE",
    "RESPIRE_LOCK_EXCLUSIVE",
    "RESPIRE_LOCK_SHARED",
    "RESPIRE_LOCK_MAX",
    "RESPIRE_LOCK_TTL",
    "RESPIRE_LOCK_KILL_AFTER",
    "RESPIRE_LOCK_PREFIX",
    "RESPIRE_LOCK_NODE_TIMEOUT",
    "RESPIRE_LOCK_TLS_CA",
    "RESPIRE_LOCK_TLS_CERT",
    "RESPIRE_LOCK_TLS_KEY",
    "RESPIRE_LOCK_VERBOSE",
    "RESPIRE_LOCK_EVENTS_FD",
    "RESPIRE_LOCK_EVENTS_FILE",
    "RESPIRE_LOCK_HOLDER",
    // Read by the other subcommands only.
    "RESPIRE_LOCK_JSON",
    "RESPIRE_LOCK_DOCTOR_KEY",
    "RESPIRE_LOCK_VALUE",
    "RESPIRE_LOCK_RECAMPAIGN",
    "RESPIRE_LOCK_WATCH",
    "RESPIRE_LOCK_LEASE_KEY",
    "RESPIRE_LOCK_FENCE_KEY",
];

/// The tool with `args`, and none of its environment variables set.
fn respire_lock(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for var in ENV_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// [`respire_lock`] started with SIGTERM ignored, through coreutils'
/// `env --ignore-signal=TERM`.
fn respire_lock_ignoring_term(args: &[&str]) -> Command {
    respire_lock_under_env("--ignore-signal=TERM", args)
}

/// The tool with `args` started through `env` with `flag` (a signal
/// disposition the kernel keeps through exec), and none of its environment
/// variables set.
fn respire_lock_under_env(flag: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new("env");
    cmd.arg(flag).arg(BIN).args(args);
    for var in ENV_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// A path for a run's `--events-file`, unique in this process.
fn events_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "respire-lock-events-{}-{}-{name}.jsonl",
        std::process::id(),
        unique_prefix("ev").trim_end_matches(':').replace(':', "-")
    ))
}

/// The events written to `path` so far.
fn events_in(path: &std::path::Path) -> Vec<serde_json::Value> {
    json_lines(&std::fs::read(path).unwrap_or_default())
}

/// The holder of KEY `job` that `run` takes exclusively, through the library.
fn exclusive_holder(coord: &Coordinator) -> respire_coordination::WriteLease {
    coord.read_write_lease("{job}").unwrap().write()
}

fn run(args: &[&str]) -> Output {
    respire_lock(args).output().expect("respire-lock runs")
}

/// A command line of the tool, an option at a time: `Cli::run(&url,
/// &prefix).ttl("5s").key("job").sh("…").output()` is `respire-lock run --url
/// URL --prefix PREFIX --ttl 5s job -- sh -c …`. The tests of bad input pass
/// their exact words to [`run`] or [`respire_lock`] instead.
struct Cli(Vec<String>);

/// Methods of [`Cli`] for the options that take a value: `ttl("5s")` adds
/// `--ttl 5s`.
macro_rules! options {
    ($($method:ident => $name:literal),* $(,)?) => {
        $(fn $method(self, value: &str) -> Cli {
            self.opt($name, value)
        })*
    };
}

impl Cli {
    /// `respire-lock SUBCOMMAND`.
    fn new(subcommand: &str) -> Cli {
        Cli(vec![subcommand.to_owned()])
    }

    /// `respire-lock run --url URL --prefix PREFIX`.
    fn run(url: &str, prefix: &str) -> Cli {
        Cli::new("run").url(url).prefix(prefix)
    }

    /// Adds `words` as they are.
    fn args(mut self, words: &[&str]) -> Cli {
        self.0.extend(words.iter().map(|word| (*word).to_owned()));
        self
    }

    /// Adds the option `name` with `value`.
    fn opt(self, name: &str, value: &str) -> Cli {
        self.args(&[name, value])
    }

    options! {
        url => "--url",
        redlock => "--redlock",
        prefix => "--prefix",
        ttl => "--ttl",
        wait => "--wait",
        kill_after => "--kill-after",
        node_timeout => "--node-timeout",
        events_fd => "--events-fd",
    }

    /// `--ttl 1s --node-timeout 100ms`: a lease lost within a second once
    /// it is no longer renewed.
    fn short_lease(self) -> Cli {
        self.ttl("1s").node_timeout("100ms")
    }

    fn events_file(self, path: &std::path::Path) -> Cli {
        self.opt("--events-file", path.to_str().unwrap())
    }

    /// Adds the option `name`, which takes no value.
    fn flag(self, name: &str) -> Cli {
        self.args(&[name])
    }

    /// Adds KEY.
    fn key(self, key: &str) -> Cli {
        self.args(&[key])
    }

    /// Adds `-- CMD ARGS…`, the command to run under the lease.
    fn cmd(self, cmd: &[&str]) -> Cli {
        self.args(&["--"]).args(cmd)
    }

    /// Adds `-- sh -c SCRIPT`.
    fn sh(self, script: &str) -> Cli {
        self.cmd(&["sh", "-c", script])
    }

    fn words(&self) -> Vec<&str> {
        self.0.iter().map(String::as_str).collect()
    }

    /// The tool with these arguments, as [`respire_lock`] starts it.
    fn command(&self) -> Command {
        respire_lock(&self.words())
    }

    /// The tool with these arguments, as [`respire_lock_ignoring_term`]
    /// starts it.
    fn command_ignoring_term(&self) -> Command {
        respire_lock_ignoring_term(&self.words())
    }

    /// The tool with these arguments and the default action for the
    /// signals it forwards, whatever this process was started with: a
    /// signal ignored at start stays ignored in the tool, as under `nohup`.
    fn command_with_default_signals(&self) -> Command {
        respire_lock_under_env("--default-signal=HUP,INT,QUIT,TERM", &self.words())
    }

    /// The tool run with these arguments to its end, as by [`run`].
    fn output(&self) -> Output {
        run(&self.words())
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn runs_the_command_with_its_token_and_returns_its_status() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-run");
    let out = Cli::run(&url, &prefix)
        .ttl("5s")
        .key("job")
        .sh("echo token=$RESPIRE_FENCING_TOKEN key=$RESPIRE_LOCK_KEY; exit 7")
        .output();
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).trim(),
        format!("token=1 key={prefix}{{job}}:w")
    );
    let out = Cli::run(&url, &prefix)
        .ttl("5s")
        .key("job")
        .sh("echo $RESPIRE_FENCING_TOKEN")
        .output();
    assert!(out.status.success());
    assert_eq!(text(&out.stdout).trim(), "2");
    // Released after the command: nothing left but the counter.
    let keys: Vec<String> = shared_server().client().keys(format!("{prefix}*")).unwrap();
    assert_eq!(keys, [format!("{prefix}{{job}}:fence")]);
}

#[test]
fn a_held_lease_means_not_acquired() {
    // A server of its own: every script it runs is this test's.
    let server = TestServer::start();
    let url = server.url();
    let prefix = unique_prefix("cli-held");
    let coord = Coordinator::builder(&url)
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let lock = exclusive_holder(&coord);
    let held = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();

    let out = Cli::run(&url, &prefix)
        .wait("0")
        .key("job")
        .cmd(&["true"])
        .output();
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));

    let started = Instant::now();
    let out = Cli::run(&url, &prefix)
        .wait("300ms")
        .key("job")
        .cmd(&["true"])
        .output();
    assert_eq!(out.status.code(), Some(75));
    assert!(started.elapsed() >= Duration::from_millis(300));

    // A waiting run starts as soon as the holder releases.
    let before = script_calls(&url);
    let mut waiting = Cli::run(&url, &prefix)
        .wait("20s")
        .key("job")
        .sh("echo $RESPIRE_FENCING_TOKEN")
        .command()
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    assert_waiting_after_an_attempt(&url, before, &mut waiting);
    drop(held);
    let out = waiting.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(text(&out.stdout).trim(), "2");
}

#[test]
fn a_lost_lease_stops_the_command() {
    let server = TestServer::start();
    let started = Instant::now();
    let child = Cli::new("run")
        .url(&server.url())
        .short_lease()
        .kill_after("5s")
        .key("job")
        .cmd(&["sleep", "30"])
        .command()
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut admin = server.client();
    wait_until(Duration::from_secs(10), "the lease to be taken", || {
        admin.exists::<_, bool>("respire-lock:{job}:w").unwrap()
    });
    // Someone else takes the key over (as after an expiry).
    let _: () = admin.set("respire-lock:{job}:w", "intruder").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(76), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("lost"));
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "sleep 30 was not stopped"
    );
    let value: String = admin.get("respire-lock:{job}:w").unwrap();
    assert_eq!(value, "intruder", "the new holder's key was touched");
}

#[test]
fn sigterm_stops_the_command_and_releases() {
    let server = TestServer::start();
    let events = events_path("sigterm");
    // Signalled once the command runs (its `started` event), which is what
    // this test is about.
    let child = inside_until_signalled(&["--url", &server.url()], &events);
    let mut admin = server.client();
    assert!(admin.exists::<_, bool>("respire-lock:{job}:w").unwrap());
    let started = Instant::now();
    signal(&child, rustix::process::Signal::TERM);
    let out = child.wait_with_output().unwrap();
    // sleep died of the forwarded SIGTERM: 128 + 15.
    assert_eq!(out.status.code(), Some(143));
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(!admin.exists::<_, bool>("respire-lock:{job}:w").unwrap());
    let _ = std::fs::remove_file(&events);
}

/// Signals the run takes (SIGCHLD here, which ends nothing) coming while it
/// waits for replies fail none of its calls: a thread of their own takes
/// them. A handler run by a thread inside a socket read with a timeout would
/// end that read (`EINTR`), and the reply would count as lost. The command
/// starts with no signal blocked.
#[test]
fn signals_arriving_while_replies_are_awaited_fail_nothing() {
    let server = TestServer::start();
    let slow = support::FaultProxy::start(server.addr());
    // Each reply comes 100 ms after the server sent it: every read blocks.
    slow.set_mode(support::Mode::DelayServerToClient(Duration::from_millis(
        100,
    )));
    let url = slow.url();
    for mode in [&[][..], &["--shared"], &["--max", "2"]] {
        // The command says which signals it has blocked: none. (Run as the
        // command itself: a shell may clear its mask when it starts.)
        let mut child = Cli::new("run")
            .url(&url)
            .args(mode)
            .key("job")
            .cmd(&["grep", "^SigBlk:", "/proc/self/status"])
            .command()
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut sent = 0u32;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "{mode:?}: the run did not end");
            signal(&child, rustix::process::Signal::CHILD);
            sent += 1;
            // Paces the signals, a few per reply; not a wait for anything.
            std::thread::sleep(Duration::from_millis(2));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        // The command ran and succeeded, and so did every call of the run.
        assert_eq!(status.code(), Some(0), "{mode:?}, {sent} signals: {err}");
        assert!(sent > 50, "{mode:?}: only {sent} signals were sent");
        assert!(err.is_empty(), "{mode:?}: {err}");
        let mut out = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
        assert_eq!(out, "SigBlk:\t0000000000000000\n", "{mode:?}");
    }
    // Every lease was released: what is left (the fencing counter and such)
    // never expires, and every lease key does.
    let mut admin = server.client();
    let keys: Vec<String> = admin.keys("respire-lock:*").unwrap();
    let leases: Vec<&String> = keys
        .iter()
        .filter(|k| admin.pttl::<_, i64>(k.as_str()).unwrap() != -1)
        .collect();
    assert!(leases.is_empty(), "{leases:?} of {keys:?}");
}

#[test]
fn without_a_url_nothing_starts() {
    let marker = events_path("marker");
    let touch = format!("touch '{}'", marker.display());
    for args in [
        &["run", "job", "--", "sh", "-c", &touch][..],
        &["run", "job", "sh", "-c", &touch],
    ] {
        let out = run(args);
        assert_usage_error(&out, &["--url", "REDIS_URL"], "run --help");
        assert!(!marker.exists(), "the command ran");
    }
    assert_usage_error(
        &run(&["status", "job"]),
        &["--url", "REDIS_URL"],
        "status --help",
    );
}

#[test]
fn errors_have_their_own_exit_codes() {
    let out = run(&["run", "job"]);
    assert_eq!(out.status.code(), Some(64));
    let out = run(&["frobnicate"]);
    assert_eq!(out.status.code(), Some(64));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = Cli::new("run")
        .url(&format!("redis://127.0.0.1:{port}"))
        .key("job")
        .cmd(&["true"])
        .output();
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stderr));
    let out = Cli::run(&shared_server().url(), &unique_prefix("cli-norun"))
        .key("job")
        .cmd(&["/nonexistent/cmd"])
        .output();
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stderr));
}

/// A command that cannot be started (not found, not executable) ends the
/// run with 69 (`EX_UNAVAILABLE`, as flock), a status of the tool's own.
#[test]
fn a_command_that_cannot_start_exits_with_69() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-cannot-start");
    let plain = events_path("plain");
    std::fs::write(&plain, b"true\n").unwrap();
    for command in [
        "no-such-command-anywhere",
        "/nonexistent/cmd",
        plain.to_str().unwrap(),
    ] {
        let out = Cli::run(&url, &prefix).key("job").cmd(&[command]).output();
        assert_eq!(
            out.status.code(),
            Some(69),
            "{command}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains("cannot run"),
            "{}",
            text(&out.stderr)
        );
    }
    std::fs::remove_file(&plain).unwrap();
}

#[test]
fn doctor_reports_what_weakens_the_guarantees() {
    let plain = TestServer::start();
    let out = run(&["doctor", &plain.url()]);
    let report = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(
        report.contains("FAIL  persistence: appendonly no"),
        "{report}"
    );
    assert!(
        report.contains("ok    acl: CLIENT KILL allowed"),
        "{report}"
    );
    assert!(
        report.contains("ok    acl: CLIENT INFO allowed"),
        "{report}"
    );
    assert!(
        report.contains("ok    tracking: CLIENT TRACKING OPTIN and CLIENT CACHING supported"),
        "{report}"
    );

    let durable = TestServer::builder()
        .append_only()
        .arg("--maxmemory-policy")
        .arg("noeviction")
        .start();
    let out = run(&["doctor", &durable.url()]);
    let report = text(&out.stdout);
    assert!(out.status.success(), "{report}");
    assert!(
        report.contains("ok    persistence: appendonly yes, appendfsync always"),
        "{report}"
    );
    assert!(report.contains("ok    eviction: noeviction"), "{report}");

    let evicting = TestServer::builder()
        .acl_user("user app on >pw ~* &* +@all -client|kill -client|tracking -client|info")
        .arg("--maxmemory-policy")
        .arg("allkeys-lru")
        .start();
    let out = run(&["doctor", &evicting.url_for_user("app", "pw")]);
    let report = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(report.contains("FAIL  eviction: allkeys-lru"), "{report}");
    assert!(report.contains("FAIL  acl: CLIENT KILL denied"), "{report}");
    assert!(
        report.contains("warn  acl: CLIENT INFO denied: a connection is killed by id alone"),
        "{report}"
    );
    assert!(
        report.contains("FAIL  acl: CLIENT TRACKING denied"),
        "{report}"
    );
    assert!(
        report.contains("warn  tracking: CLIENT TRACKING OPTIN refused"),
        "{report}"
    );

    let no_caching = TestServer::builder()
        .acl_user("user app on >pw ~* &* +@all -client|caching")
        .start();
    let out = run(&["doctor", &no_caching.url_for_user("app", "pw")]);
    let report = text(&out.stdout);
    assert!(
        report.contains("warn  tracking: CLIENT CACHING refused"),
        "{report}"
    );
    assert!(report.contains("track every key they read"), "{report}");
}

#[test]
fn redlock_mode_takes_a_quorum_and_releases_it() {
    let servers: Vec<TestServer> = (0..3).map(|_| TestServer::start()).collect();
    let urls: Vec<String> = servers.iter().map(TestServer::url).collect();
    let joined = urls.join(",");
    let child = Cli::new("run")
        .redlock(&joined)
        .ttl("5s")
        .key("job")
        .sh("echo key=$RESPIRE_LOCK_KEY token=${RESPIRE_FENCING_TOKEN:-none}; sleep 1")
        .command()
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut admins: Vec<redis::Connection> = servers.iter().map(TestServer::client).collect();
    wait_until(Duration::from_secs(10), "the lock on every node", || {
        admins
            .iter_mut()
            .all(|a| a.exists::<_, bool>("respire-lock:{job}:w").unwrap())
    });
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        text(&out.stdout).trim(),
        "key=respire-lock:{job}:w token=none"
    );
    for admin in &mut admins {
        assert!(!admin.exists::<_, bool>("respire-lock:{job}:w").unwrap());
    }

    // An even group is refused as a usage error.
    let two = urls[..2].join(",");
    let out = Cli::new("run")
        .redlock(&two)
        .key("job")
        .cmd(&["true"])
        .output();
    assert_eq!(out.status.code(), Some(64), "{}", text(&out.stderr));

    // A group is made only when every node answers (their independence is
    // checked then); status asks the nodes that answer.
    servers[2].kill();
    let out = run(&["run", "--redlock", &joined, "job", "echo", "ran"]);
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stderr));
    assert!(out.stdout.is_empty());
    let out = run(&["status", "--redlock", &joined, "--json", "job"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["nodes"], 2, "{status}");
    assert_eq!(status["held"], false, "{status}");
}

/// The JSON objects of `--json` output, one per line; panics on anything else.
fn json_lines(bytes: &[u8]) -> Vec<serde_json::Value> {
    text(bytes)
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"))
        })
        .collect()
}

/// The event of that name; panics if there is not exactly one.
fn event<'a>(events: &'a [serde_json::Value], name: &str) -> &'a serde_json::Value {
    let found: Vec<_> = events.iter().filter(|e| e["event"] == name).collect();
    assert_eq!(found.len(), 1, "one {name:?} event in {events:#?}");
    found[0]
}

/// Asserts a usage error: status 64, nothing on stdout, and on stderr exactly
/// one line naming the problem (containing each of `names`) and one hint line.
#[track_caller]
fn assert_usage_error(out: &Output, names: &[&str], hint: &str) {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(lines[0].starts_with("respire-lock: "), "{stderr}");
    for name in names {
        assert!(lines[0].contains(name), "{name:?} not named in {stderr}");
    }
    assert!(lines[1].starts_with("hint: "), "{stderr}");
    assert!(lines[1].contains(hint), "{hint:?} not in {stderr}");
}

#[test]
fn help_and_version_on_every_subcommand() {
    for sub in [
        None,
        Some("run"),
        Some("status"),
        Some("elect"),
        Some("leader"),
        Some("doctor"),
        Some("completions"),
    ] {
        for flag in ["-h", "--help"] {
            let mut args: Vec<&str> = sub.into_iter().collect();
            args.push(flag);
            let out = run(&args);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{args:?}: {}",
                text(&out.stderr)
            );
            let usage = match sub {
                Some(sub) => format!("Usage: respire-lock {sub}"),
                None => "Usage: respire-lock".into(),
            };
            assert!(
                text(&out.stdout).contains(&usage),
                "{args:?}: {}",
                text(&out.stdout)
            );
        }
    }
    // Long help documents the environment, exit codes and JSON fields.
    let help = text(&run(&["run", "--help"]).stdout);
    for var in &ENV_VARS[..20] {
        assert!(help.contains(var), "{var} missing from run --help");
    }
    for word in [
        "75  not acquired",
        "acquired      lease_key, token",
        "released      outcome",
    ] {
        assert!(help.contains(word), "{word:?} missing from run --help");
    }
    let out = run(&["help", "status"]);
    assert!(out.status.success());
    assert!(text(&out.stdout).contains("Usage: respire-lock status"));

    let version = format!("respire-lock {}", env!("CARGO_PKG_VERSION"));
    for args in [&["--version"][..], &["-V"]] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(0));
        assert_eq!(text(&out.stdout).trim(), version);
    }
}

#[test]
fn usage_errors_are_one_line_and_a_hint() {
    let hint = "try 'respire-lock run --help'";
    assert_usage_error(
        &run(&["run", "--bogus", "job", "--", "true"]),
        &["--bogus"],
        hint,
    );
    // A close misspelling gets a suggestion in the hint.
    let out = run(&["run", "--wiat", "1s", "job", "--", "true"]);
    assert_usage_error(&out, &["--wiat"], "'--wait'");
    assert_usage_error(
        &run(&["run", "--ttl", "10parsecs", "job", "--", "true"]),
        &["--ttl", "10parsecs"],
        hint,
    );
    assert_usage_error(
        &run(&["run", "--wait", "soon", "job", "--", "true"]),
        &["--wait", "soon"],
        hint,
    );
    assert_usage_error(
        &run(&["run", "--ttl", "0s", "job", "--", "true"]),
        &["--ttl"],
        hint,
    );
    assert_usage_error(
        &run(&["run", "--ttl", "100y", "job", "--", "true"]),
        &["--ttl", "100y"],
        hint,
    );
    assert_usage_error(&run(&["run", "job"]), &["<CMD>"], hint);
    assert_usage_error(&run(&["run", "{job}", "--", "true"]), &["braces"], hint);
    assert_usage_error(
        &run(&["run", "--prefix", "a{", "job", "--", "true"]),
        &["--prefix"],
        hint,
    );
    assert_usage_error(
        &Cli::new("run")
            .url("redis://a")
            .opt("--redlock", "redis://b,redis://c,redis://d")
            .key("job")
            .cmd(&["true"])
            .output(),
        &["--url", "--redlock"],
        hint,
    );
    assert_usage_error(
        &run(&["frobnicate"]),
        &["frobnicate"],
        "try 'respire-lock --help'",
    );
    assert_usage_error(&run(&[]), &["no command"], "try 'respire-lock --help'");
    assert_usage_error(
        &run(&["status"]),
        &["<KEY>"],
        "try 'respire-lock status --help'",
    );
    assert_usage_error(
        &run(&["status", "job"]),
        &["--url", "REDIS_URL"],
        "status --help",
    );
    assert_usage_error(&run(&["doctor"]), &["REDIS_URL"], "doctor --help");
    assert_usage_error(
        &run(&["completions", "tcsh"]),
        &["tcsh"],
        "try 'respire-lock completions --help'",
    );
    // Values from the environment are checked the same way.
    let out = respire_lock(&["run", "job", "--", "true"])
        .env("RESPIRE_LOCK_TTL", "soon")
        .output()
        .unwrap();
    assert_usage_error(&out, &["soon", "--ttl"], hint);
}

#[test]
fn a_wait_too_long_for_the_clock_waits_forever() {
    // A server of its own: every script it runs is this test's.
    let server = TestServer::start();
    let url = server.url();
    let prefix = unique_prefix("cli-huge-wait");
    // On a free key: acquired at once.
    let out = Cli::run(&url, &prefix)
        .wait("10000000000000000000s")
        .key("job")
        .cmd(&["true"])
        .output();
    assert!(out.status.success(), "{}", text(&out.stderr));

    // On a held key: waits (no panic, no deadline) until the holder releases.
    let coord = Coordinator::builder(&url)
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let lock = exclusive_holder(&coord);
    let held = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    let before = script_calls(&url);
    let mut waiting = Cli::run(&url, &prefix)
        .wait("10000000000000000000s")
        .key("job")
        .sh("echo $RESPIRE_FENCING_TOKEN")
        .command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert_waiting_after_an_attempt(&url, before, &mut waiting);
    drop(held);
    let out = waiting.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "3");
}

#[test]
fn status_reports_holder_token_and_ttl() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-status");
    let status = |json: bool| {
        let out = Cli::new("status")
            .url(&url)
            .prefix(&prefix)
            .args(if json { &["--json"] } else { &[] })
            .key("job")
            .output();
        // 0 when held, 1 when free.
        let free =
            text(&out.stdout).contains(": free") || text(&out.stdout).contains("\"held\":false");
        let code = if free { 1 } else { 0 };
        assert_eq!(out.status.code(), Some(code), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    // Never taken.
    assert_eq!(
        status(false).trim(),
        "job: free (no fencing token issued yet)"
    );
    let free: serde_json::Value = serde_json::from_str(&status(true)).unwrap();
    assert_eq!(free["held"], false);
    assert_eq!(free["token"], serde_json::Value::Null);
    assert_eq!(free["last_token"], serde_json::Value::Null);

    // Held, by the library with the keys `run` uses.
    let coord = Coordinator::builder(&url)
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let lock = exclusive_holder(&coord);
    let guard = lock.try_acquire(Duration::from_secs(20)).unwrap().unwrap();
    let token = guard.fencing_token().get();
    let line = status(false);
    assert!(
        line.starts_with(&format!(
            "job: held exclusive by fencing token {token}, no holder recorded, expires in "
        )),
        "{line}"
    );
    let held: serde_json::Value = serde_json::from_str(&status(true)).unwrap();
    assert_eq!(held["key"], "job");
    assert_eq!(held["base"], format!("{prefix}{{job}}"));
    assert_eq!(held["mode"], "exclusive");
    assert_eq!(held["held"], true);
    assert_eq!(held["token"], token);
    assert_eq!(held["last_token"], token);
    let ttl = held["ttl_ms"].as_u64().unwrap();
    assert!(ttl > 0 && ttl <= 20_000, "{ttl}");

    // Released: free again, and the counter remembers the last token.
    guard.release().unwrap();
    assert_eq!(
        status(false).trim(),
        format!("job: free (last fencing token issued: {token})")
    );
    let free: serde_json::Value = serde_json::from_str(&status(true)).unwrap();
    assert_eq!(free["held"], false);
    assert_eq!(free["ttl_ms"], serde_json::Value::Null);
    assert_eq!(free["last_token"], token);

    // No server there: unavailable.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = Cli::new("status")
        .url(&format!("redis://127.0.0.1:{port}"))
        .key("job")
        .output();
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stderr));
}

#[test]
fn json_events_of_a_run() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-json");
    let events = events_path("run");
    let file = events.to_str().unwrap();
    let out = Cli::run(&url, &prefix)
        .ttl("5s")
        .events_file(&events)
        .key("job")
        .sh("exit 3")
        .output();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    // stderr stays for people: nothing there without -v.
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    let all = events_in(&events);
    let names: Vec<&str> = all.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(names, ["acquired", "started", "exited", "released"]);
    for e in &all {
        assert_eq!(e["key"], "job");
        let time = e["time"].as_str().unwrap();
        assert!(time.ends_with('Z') && time.contains('T'), "{time}");
    }
    let acquired = event(&all, "acquired");
    assert_eq!(acquired["lease_key"], format!("{prefix}{{job}}:w"));
    assert_eq!(acquired["token"], 1);
    assert_eq!(acquired["ttl_ms"], 5000);
    assert_eq!(acquired["mode"], "fenced");
    let started = event(&all, "started");
    assert!(started["pid"].as_u64().unwrap() > 0);
    assert_eq!(
        started["command"],
        serde_json::json!(["sh", "-c", "exit 3"])
    );
    let exited = event(&all, "exited");
    assert_eq!(exited["code"], 3);
    assert_eq!(exited["signal"], serde_json::Value::Null);
    let released = event(&all, "released");
    assert_eq!(released["outcome"], "released");
    assert_eq!(released["detail"], serde_json::Value::Null);
    std::fs::remove_file(&events).unwrap();

    // Not acquired, and an error, are events too.
    let coord = Coordinator::builder(&url)
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let lock = exclusive_holder(&coord);
    let _held = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    let out = Cli::run(&url, &prefix)
        .wait("0")
        .events_file(&events)
        .key("job")
        .cmd(&["true"])
        .output();
    assert_eq!(out.status.code(), Some(75));
    assert_eq!(event(&events_in(&events), "not_acquired")["exit_code"], 75);
    std::fs::remove_file(&events).unwrap();
    let out = Cli::run(&url, &prefix)
        .events_file(&events)
        .key("other")
        .cmd(&["/nonexistent/cmd"])
        .output();
    assert_eq!(out.status.code(), Some(69));
    let all = events_in(&events);
    let error = event(&all, "error");
    assert_eq!(error["exit_code"], 69);
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/cmd")
    );
    std::fs::remove_file(&events).unwrap();

    // A descriptor the caller opened: the shell opens 3 on a file.
    let script = format!(
        "exec 3>'{file}'; exec {BIN} run --url {url} --prefix '{prefix}' --events-fd 3 fd -- true"
    );
    let out = Command::new("sh").arg("-c").arg(&script).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        event(&events_in(&events), "released")["outcome"],
        "released"
    );
    std::fs::remove_file(&events).unwrap();
    // A descriptor that is not open is a usage error, before anything is sent.
    assert_usage_error(
        &Cli::new("run")
            .url(&url)
            .events_fd("97")
            .key("job")
            .cmd(&["true"])
            .output(),
        &["--events-fd"],
        "run --help",
    );
}

#[test]
fn events_on_standard_output_share_it_with_the_command() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-events-stdout");
    // Standard output is a file the command writes to as well, at the offset
    // they share.
    let path = events_path("stdout");
    let out = std::fs::File::create(&path).unwrap();
    let status = Cli::run(&url, &prefix)
        .events_fd("1")
        .key("job")
        .sh("echo from-the-command")
        .command()
        .stdout(Stdio::from(out))
        .status()
        .expect("respire-lock runs");
    assert_eq!(status.code(), Some(0));
    let written = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let lines: Vec<&str> = written.lines().collect();
    assert!(lines.contains(&"from-the-command"), "{written}");
    let names: Vec<String> = lines
        .iter()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a whole JSON line");
            v["event"].as_str().unwrap_or_default().to_owned()
        })
        .collect();
    assert_eq!(
        names,
        ["acquired", "started", "exited", "released"],
        "{written}"
    );
}

#[test]
fn json_events_of_a_lost_lease_and_kill_after_from_the_environment() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-json-lost");
    let lease_key = format!("{prefix}{{job}}:w");
    let events = events_path("lost");
    // The command ignores SIGTERM, so only the SIGKILL after RESPIRE_LOCK_KILL_AFTER stops it.
    let child = Cli::run(&url, &prefix)
        .short_lease()
        .key("job")
        .sh("trap '' TERM; exec sleep 30")
        .command()
        .env("RESPIRE_LOCK_EVENTS_FILE", &events)
        .env("RESPIRE_LOCK_KILL_AFTER", "300ms")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut admin = shared_server().client();
    wait_until(Duration::from_secs(10), "the lease to be taken", || {
        admin.exists::<_, bool>(&lease_key).unwrap()
    });
    let _: () = admin.set(&lease_key, "intruder").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(76), "{}", text(&out.stderr));
    let all = events_in(&events);
    std::fs::remove_file(&events).unwrap();
    let names: Vec<&str> = all.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["acquired", "started", "lost", "exited", "released", "error"]
    );
    let lost = event(&all, "lost");
    assert_eq!(lost["cause"], "taken_over");
    assert!(
        lost["reason"].as_str().unwrap().contains("another owner"),
        "{lost}"
    );
    // SIGTERM was ignored: SIGKILL (9) ended it.
    let exited = event(&all, "exited");
    assert_eq!(exited["signal"], 9, "{exited}");
    assert_eq!(exited["code"], serde_json::Value::Null);
    assert_eq!(event(&all, "released")["outcome"], "taken_over");
    assert_eq!(event(&all, "error")["exit_code"], 76);
    let value: String = admin.get(&lease_key).unwrap();
    assert_eq!(value, "intruder", "the new holder's key was touched");
}

#[test]
fn completions_bash_is_valid_shell() {
    let out = run(&["completions", "bash"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    assert!(script.contains("respire-lock"), "{script}");
    for word in ["run", "status", "doctor", "--kill-after", "--node-timeout"] {
        assert!(script.contains(word), "{word} not completed");
    }
    let path = std::env::temp_dir().join(format!(
        "respire-lock-completion-{}.bash",
        std::process::id()
    ));
    std::fs::write(&path, &out.stdout).unwrap();
    let check = Command::new("bash").arg("-n").arg(&path).output().unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(check.status.success(), "bash -n: {}", text(&check.stderr));
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let out = run(&["completions", shell]);
        assert!(out.status.success() && !out.stdout.is_empty(), "{shell}");
    }
}

#[test]
fn every_option_from_the_environment() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-env");
    // URL and prefix (strings) and the TTL (a duration) from the environment; the
    // command asks `status`, with the same environment, what the server holds.
    let script = format!("{BIN} status --json job; echo token=$RESPIRE_FENCING_TOKEN");
    let out = respire_lock(&["run", "job", "--", "sh", "-c", &script])
        .env("REDIS_URL", &url)
        .env("RESPIRE_LOCK_PREFIX", &prefix)
        .env("RESPIRE_LOCK_TTL", "7s")
        .env("RESPIRE_LOCK_VERBOSE", "true")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        !text(&out.stderr).contains("throwaway"),
        "REDIS_URL was not used"
    );
    assert!(
        text(&out.stderr).contains("acquired \"job\" with fencing token 1"),
        "{}",
        text(&out.stderr)
    );
    let stdout = text(&out.stdout);
    let mut lines = stdout.lines();
    let status: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!(status["base"], format!("{prefix}{{job}}"));
    assert_eq!(status["token"], 1);
    let ttl = status["ttl_ms"].as_u64().unwrap();
    assert!(
        ttl > 0 && ttl <= 7_000,
        "ttl {ttl} is not from RESPIRE_LOCK_TTL=7s"
    );
    assert_eq!(lines.next(), Some("token=1"));

    // A flag from the environment: RESPIRE_LOCK_VERBOSE (and "0" turns it off).
    let verbose = |value: &str| {
        Cli::run(&url, &prefix)
            .key("job")
            .cmd(&["true"])
            .command()
            .env("RESPIRE_LOCK_VERBOSE", value)
            .output()
            .unwrap()
    };
    let on = verbose("yes");
    assert!(on.status.success());
    assert!(
        text(&on.stderr).contains("acquired \"job\" with fencing token 2"),
        "{}",
        text(&on.stderr)
    );
    let off = verbose("0");
    assert!(off.status.success());
    assert!(off.stderr.is_empty(), "{}", text(&off.stderr));
    assert_usage_error(&verbose("maybe"), &["maybe", "--verbose"], "run --help");

    // The wait from the environment is bounded; the command line beats it.
    let coord = Coordinator::builder(&url)
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let lock = exclusive_holder(&coord);
    let _held = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    let waited = |args: &[&str]| {
        let started = Instant::now();
        let out = Cli::run(&url, &prefix)
            .args(args)
            .key("job")
            .cmd(&["true"])
            .command()
            .env("RESPIRE_LOCK_WAIT", "400ms")
            .output()
            .unwrap();
        (out.status.code(), started.elapsed())
    };
    let (code, elapsed) = waited(&[]);
    assert_eq!(code, Some(75));
    assert!(elapsed >= Duration::from_millis(400), "{elapsed:?}");
    let (code, _) = waited(&["--wait", "0"]);
    assert_eq!(code, Some(75));

    // The node timeout from the environment is checked like the option.
    let out = Cli::new("run")
        .url(&url)
        .key("job")
        .cmd(&["true"])
        .command()
        .env("RESPIRE_LOCK_NODE_TIMEOUT", "0s")
        .output()
        .unwrap();
    assert_usage_error(&out, &["--node-timeout"], "run --help");

    // RESPIRE_LOCK_REDLOCK: an even group is refused; --url on the command line beats it.
    let out = respire_lock(&["run", "job", "--", "true"])
        .env("RESPIRE_LOCK_REDLOCK", format!("{url},{url}"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{}", text(&out.stderr));
    let out = Cli::run(&url, &prefix)
        .wait("0")
        .key("free")
        .cmd(&["true"])
        .command()
        .env("RESPIRE_LOCK_REDLOCK", format!("{url},{url}"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn doctor_reports_a_denied_invalidation_channel() {
    let server = TestServer::builder()
        .acl_user("user app on >pw ~* resetchannels +@all")
        .acl_user("user all on >pw ~* &* +@all")
        .start();
    let out = run(&["doctor", &server.url_for_user("app", "pw")]);
    let report = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(
        report.contains("FAIL  acl: channel __redis__:invalidate denied"),
        "{report}"
    );
    let out = run(&["doctor", "--url", &server.url_for_user("all", "pw")]);
    let report = text(&out.stdout);
    assert!(
        report.contains("ok    acl: channel __redis__:invalidate allowed"),
        "{report}"
    );

    // --json, with the URL from the environment.
    let out = respire_lock(&["doctor", "--json"])
        .env("REDIS_URL", server.url_for_user("app", "pw"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["ok"], false);
    let findings = report["findings"].as_array().unwrap();
    let channel = findings
        .iter()
        .find(|f| {
            f["message"]
                .as_str()
                .unwrap()
                .contains("__redis__:invalidate")
        })
        .unwrap();
    assert_eq!(channel["level"], "fail");
    assert_eq!(channel["check"], "acl");
    assert!(
        findings
            .iter()
            .any(|f| f["check"] == "persistence" && f["level"] == "fail")
    );
}

// ---------------------------------------------------------------------------
// Cluster and Sentinel deployments

fn cluster_url() -> String {
    let hosts: Vec<String> = support::shared_cluster()
        .nodes()
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port()))
        .collect();
    format!("redis+cluster://{}/", hosts.join(","))
}

#[test]
fn run_takes_a_lease_on_a_cluster() {
    let prefix = unique_prefix("cli-cluster");
    let out = Cli::run(&cluster_url(), &prefix)
        .ttl("5s")
        .key("job")
        .sh("echo token=$RESPIRE_FENCING_TOKEN")
        .output();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "token=1");
}

#[test]
fn doctor_reports_every_primary_of_a_cluster() {
    let cluster = support::shared_cluster();
    let out = run(&["doctor", &cluster_url()]);
    let report = text(&out.stdout);
    // Nodes without an append-only file fail the persistence check.
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(
        report.contains("ok    topology: Redis Cluster, 3 primaries"),
        "{report}"
    );
    for primary in cluster.primaries() {
        let port = cluster.node(primary).port();
        for line in [
            format!("FAIL  127.0.0.1:{port}: persistence: appendonly no"),
            format!("warn  127.0.0.1:{port}: replication: 1 replica(s), asynchronous"),
        ] {
            assert!(report.contains(&line), "{line:?} not in\n{report}");
        }
    }
    assert!(
        report.contains("warn  failover: a promoted replica"),
        "{report}"
    );
    assert!(report.contains("acl: CLIENT KILL allowed"), "{report}");
    // A plain URL to one node says how to reach the whole cluster.
    let out = run(&["doctor", &cluster.seed_urls()[0]]);
    let report = text(&out.stdout);
    assert!(report.contains("connect with redis+cluster://"), "{report}");
}

#[test]
fn doctor_reports_a_sentinel_deployment() {
    let deployment = support::shared_sentinel();
    let hosts: Vec<String> = deployment
        .sentinels()
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.port()))
        .collect();
    let url = format!(
        "redis+sentinel://{}/{}",
        hosts.join(","),
        deployment.service()
    );
    let out = run(&["doctor", &url]);
    let report = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{report}");
    for line in [
        "ok    sentinel: 3 of 3 sentinel(s) answer; quorum 2; 1 replica(s)".to_owned(),
        format!(
            "ok    topology: Sentinel service \"{}\", primary 127.0.0.1:{}",
            deployment.service(),
            deployment.primary().port()
        ),
        "warn  primary: replication: 1 replica(s), asynchronous".to_owned(),
        "min-replicas-to-write 0: cut off from its replicas".to_owned(),
        "FAIL  primary: persistence: appendonly no".to_owned(),
        "warn  failover: after a switch the old primary keeps accepting writes".to_owned(),
    ] {
        assert!(report.contains(&line), "{line:?} not in\n{report}");
    }
    let out = run(&[
        "doctor",
        &format!("redis+sentinel://{}/nobody", hosts.join(",")),
    ]);
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains("no sentinel knows the service"),
        "{}",
        text(&out.stderr)
    );
}

// ---------------------------------------------------------------------------
// Supervision, flock's habits, validation, secrets, modes and packaging

/// Whether any process of group `pgid` is alive (zombies do not count).
fn group_alive(pgid: i32) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|entry| {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            return false;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            return false;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        fields.len() > 2 && fields[2] == pgid.to_string() && fields[0] != "Z" && fields[0] != "X"
    })
}

/// The pids of the processes of group `pgid` that are alive.
fn group_members(pgid: i32) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|entry| {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                return false;
            };
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            fields.len() > 2 && fields[2] == pgid.to_string() && fields[0] != "Z"
        })
        .count()
}

/// A run with `args` (the target and mode options) that writes `events` and
/// stays inside, running `sleep 30`, until it is signalled; returned once its
/// command has started.
fn inside_until_signalled(args: &[&str], events: &std::path::Path) -> std::process::Child {
    let child = Cli::new("run")
        .args(args)
        .events_file(events)
        .key("job")
        .cmd(&["sleep", "30"])
        .command()
        .spawn()
        .unwrap();
    started_pid(events);
    child
}

/// Waits until the run writing `events` has started its command; returns the
/// command's pid, which is also its process group.
fn started_pid(events: &std::path::Path) -> i32 {
    wait_until(Duration::from_secs(10), "the command to start", || {
        events_in(events).iter().any(|e| e["event"] == "started")
    });
    event(&events_in(events), "started")["pid"]
        .as_u64()
        .unwrap() as i32
}

fn signal(child: &std::process::Child, signal: rustix::process::Signal) {
    rustix::process::kill_process(rustix::process::Pid::from_child(child), signal).unwrap();
}

#[test]
fn throwaway_server_is_removed_even_after_kill_9_of_the_tool() {
    let events = events_path("throwaway");
    let mut child = Cli::new("run")
        .flag("--throwaway")
        .events_file(&events)
        .key("job")
        .sh("sleep 30 & exec sleep 30")
        .command()
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pgid = started_pid(&events);
    let all = events_in(&events);
    let throwaway = event(&all, "throwaway");
    let url = throwaway["url"].as_str().unwrap().to_owned();
    let dir = std::path::PathBuf::from(throwaway["dir"].as_str().unwrap());
    let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    assert!(dir.is_dir(), "{dir:?}");
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    wait_until(Duration::from_secs(5), "sh's two sleeps", || {
        group_members(pgid) == 2
    });

    signal(&child, rustix::process::Signal::KILL);
    child.wait().unwrap();
    wait_until(
        Duration::from_secs(5),
        "the throwaway server, its directory and the command to go",
        || {
            !dir.exists()
                && std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
                && !group_alive(pgid)
        },
    );
    std::fs::remove_file(&events).unwrap();

    // A clean run leaves nothing either.
    let out = run(&["run", "--throwaway", "-v", "job", "--", "true"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    let dir = stderr
        .split(" in ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .unwrap();
    assert!(!std::path::Path::new(dir).exists(), "{stderr}");
}

#[test]
fn a_lost_lease_stops_the_whole_group() {
    let server = TestServer::start();
    let events = events_path("lost-group");
    let child = Cli::new("run")
        .url(&server.url())
        .short_lease()
        .kill_after("1s")
        .events_file(&events)
        .key("job")
        .sh("sleep 30 & sleep 30; echo done")
        .command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pgid = started_pid(&events);
    wait_until(Duration::from_secs(5), "sh and its two sleeps", || {
        group_members(pgid) == 3
    });
    let mut admin = server.client();
    let _: () = admin.set("respire-lock:{job}:w", "intruder").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(76), "{}", text(&out.stderr));
    assert!(!text(&out.stdout).contains("done"));
    wait_until(Duration::from_secs(2), "the whole group to be gone", || {
        !group_alive(pgid)
    });
    std::fs::remove_file(&events).unwrap();

    // The lease-lost status is an option.
    let child = Cli::new("run")
        .url(&server.url())
        .short_lease()
        .opt("--lost-exit-code", "99")
        .events_file(&events)
        .key("other")
        .cmd(&["sleep", "30"])
        .command()
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    started_pid(&events);
    let _: () = admin.set("respire-lock:{other}:w", "intruder").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(99), "{}", text(&out.stderr));
    std::fs::remove_file(&events).unwrap();
}

#[test]
fn hup_int_quit_and_term_go_to_the_group_and_the_lease_is_released() {
    use rustix::process::Signal;
    let server = TestServer::start();
    let mut admin = server.client();
    for (sig, n) in [
        (Signal::HUP, 1),
        (Signal::INT, 2),
        (Signal::QUIT, 3),
        (Signal::TERM, 15),
    ] {
        let events = events_path("signal");
        let child = Cli::new("run")
            .url(&server.url())
            .events_file(&events)
            .kill_after("1s")
            .key("job")
            .sh("sleep 30 & exec sleep 30")
            .command_with_default_signals()
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pgid = started_pid(&events);
        assert!(admin.exists::<_, bool>("respire-lock:{job}:w").unwrap());
        let started = Instant::now();
        signal(&child, sig);
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(128 + n),
            "signal {n}: {}",
            text(&out.stderr)
        );
        assert!(started.elapsed() < Duration::from_secs(5), "signal {n}");
        let all = events_in(&events);
        // The command (the group's leader) died of that very signal.
        assert_eq!(event(&all, "forwarded")["signal"], n);
        assert_eq!(event(&all, "exited")["signal"], n, "{all:?}");
        assert_eq!(event(&all, "released")["outcome"], "released");
        assert!(!admin.exists::<_, bool>("respire-lock:{job}:w").unwrap());
        assert!(!group_alive(pgid), "signal {n}: the group is left");
        std::fs::remove_file(&events).unwrap();
    }
}

#[test]
fn the_command_dies_with_a_killed_tool() {
    let server = TestServer::start();
    let events = events_path("kill9");
    let mut child = Cli::new("run")
        .url(&server.url())
        .events_file(&events)
        .key("job")
        .sh("sleep 30 & exec sleep 30")
        .command()
        .spawn()
        .unwrap();
    let pgid = started_pid(&events);
    wait_until(Duration::from_secs(5), "sh's two sleeps", || {
        group_members(pgid) == 2
    });
    signal(&child, rustix::process::Signal::KILL);
    child.wait().unwrap();
    wait_until(
        Duration::from_secs(1),
        "the command's group to be gone",
        || !group_alive(pgid),
    );
    std::fs::remove_file(&events).unwrap();
}

#[test]
fn nonblock_on_a_held_key_exits_with_the_conflict_code_quietly() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-nonblock");
    let coord = Coordinator::builder(&url)
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let _held = exclusive_holder(&coord)
        .try_acquire(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    let attempt = |extra: &[&str]| {
        Cli::run(&url, &prefix)
            .args(extra)
            .key("job")
            .cmd(&["echo", "ran"])
            .output()
    };
    let out = attempt(&["-n"]);
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));
    assert!(out.stderr.is_empty() && out.stdout.is_empty());
    let out = attempt(&["--nonblock", "-E", "9"]);
    assert_eq!(out.status.code(), Some(9));
    assert!(out.stderr.is_empty());
    let out = attempt(&["-n", "--conflict-exit-code", "1", "-v"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("\"job\" is held elsewhere; not acquired"),
        "{}",
        text(&out.stderr)
    );
    let out = Cli::run(&url, &prefix)
        .key("job")
        .cmd(&["true"])
        .command()
        .env("RESPIRE_LOCK_NONBLOCK", "1")
        .env("RESPIRE_LOCK_CONFLICT_EXIT_CODE", "3")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let started = Instant::now();
    let out = attempt(&["-w", "300ms"]);
    assert_eq!(out.status.code(), Some(75));
    assert!(started.elapsed() >= Duration::from_millis(300));
    // The command without `--`; its own options stay its own.
    let out = run(&[
        "run",
        "--url",
        &url,
        "--prefix",
        &prefix,
        "free",
        "sh",
        "-c",
        "echo $0 $1",
        "-v",
        "--wait",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "-v --wait");
    assert!(out.stderr.is_empty());
}

#[test]
fn every_rule_is_checked_before_anything_is_sent() {
    // Nothing listens there: a usage error, not "unavailable", shows that
    // nothing was sent.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nowhere = format!("redis://127.0.0.1:{port}");
    let hint = "run --help";
    let usage = |args: &[&str], names: &[&str]| {
        let mut all = vec!["run", "--url", &nowhere];
        all.extend_from_slice(args);
        all.extend_from_slice(&["job", "--", "true"]);
        assert_usage_error(&run(&all), names, hint);
    };
    usage(&["--ttl", "2s"], &["--ttl 2s", "at least 2s 45ms"]);
    usage(
        &["--ttl", "500ms", "--node-timeout", "200ms"],
        &["--node-timeout 200ms", "at least 821ms"],
    );
    usage(&["--shared", "--max", "2"], &["--shared", "--max"]);
    usage(&["--max", "0"], &["--max"]);
    usage(&["--max", "10001"], &["--max"]);
    usage(&["-n", "--wait", "1s"], &["--wait"]);
    usage(&["-E", "256"], &["--conflict-exit-code"]);
    usage(&["--lost-exit-code", "256"], &["--lost-exit-code"]);
    usage(&["--tls-cert", "/nonexistent"], &["--tls-key"]);
    let out = run(&[
        "run",
        "--redlock",
        &format!("{nowhere},{nowhere},{nowhere}"),
        "--shared",
        "job",
        "--",
        "true",
    ]);
    assert_usage_error(&out, &["--shared", "Redlock"], hint);
    // The minimum is in the help too.
    let help = text(&run(&["run", "--help"]).stdout);
    assert!(help.contains("2.045s"), "{help}");
    // A TTL just above it is accepted.
    let url = shared_server().url();
    let out = Cli::run(&url, &unique_prefix("cli-minttl"))
        .ttl("2046ms")
        .key("job")
        .cmd(&["true"])
        .output();
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn no_output_ever_holds_a_password() {
    const SECRET: &str = "hunter2Sekret";
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let live = shared_server().port();
    let forms = [
        format!("redis://u:{SECRET}@127.0.0.1:99999"),
        format!("redis://u:{SECRET}%zz@127.0.0.1:{live}"),
        format!("redis://u:{SECRET}%4@127.0.0.1:{live}"),
        format!("rediss://u:{SECRET}%@127.0.0.1:{closed}"),
        format!("redis://u:{SECRET}@[::1:{closed}"),
        format!("redis://u:{SECRET}@127.0.0.1:{closed}"),
        format!("redis://u:{SECRET}@127.0.0.1:{live}"),
        format!("redis://:{SECRET}@127.0.0.1:{live}/x"),
        format!("redis+cluster://u:{SECRET}%zz@127.0.0.1:{closed},127.0.0.1:1"),
        format!("redis+cluster://u:{SECRET}@127.0.0.1:x"),
        format!("redis+cluster://u:{SECRET}@127.0.0.1,,127.0.0.2"),
        format!("redis+cluster://u:{SECRET}@127.0.0.1:{closed}/3"),
        format!("redis+cluster://u:{SECRET}@127.0.0.1:{live}"),
        format!("rediss+cluster://u:{SECRET}@[::1"),
        format!("redis+sentinel://u:{SECRET}%zz@127.0.0.1:{closed}/svc"),
        format!("redis+sentinel://u:{SECRET}@127.0.0.1:{closed}"),
        format!("redis+sentinel://u:{SECRET}@127.0.0.1:{closed}/svc/x"),
        format!("redis+sentinel://u:{SECRET}@127.0.0.1:{closed}/svc?a=b"),
        format!("redis+sentinel://u:{SECRET}@127.0.0.1:{closed}/svc"),
        format!("ftp://u:{SECRET}@127.0.0.1"),
        format!("u:{SECRET}@127.0.0.1"),
        format!("unix://u:{SECRET}@"),
    ];
    let events = events_path("secrets");
    let file = events.to_str().unwrap();
    let mut checked = 0;
    for url in &forms {
        let list = format!("{url},{url},{url}");
        let runs: [Vec<&str>; 7] = [
            vec![
                "run",
                "--url",
                url,
                "-v",
                "--events-file",
                file,
                "job",
                "true",
            ],
            vec![
                "run",
                "--redlock",
                &list,
                "-v",
                "--events-file",
                file,
                "job",
                "true",
            ],
            vec!["status", "--url", url, "job"],
            vec!["status", "--json", "--redlock", &list, "job"],
            vec!["doctor", url],
            vec!["doctor", "--json", "--key", "job", url],
            vec!["run", "--url", url, "--ttl", "1s", "job", "true"],
        ];
        for args in &runs {
            let out = respire_lock(args)
                .env("RESPIRE_LOCK_NODE_TIMEOUT", "200ms")
                .output()
                .unwrap();
            let all = format!(
                "{}{}{}",
                text(&out.stdout),
                text(&out.stderr),
                std::fs::read_to_string(&events).unwrap_or_default()
            );
            assert!(!out.status.success(), "{args:?} succeeded: {all}");
            assert!(
                !all.contains(SECRET),
                "{args:?} printed the password:\n{all}"
            );
            assert!(!all.is_empty(), "{args:?} said nothing");
            let _ = std::fs::remove_file(&events);
            checked += 1;
        }
    }
    assert_eq!(checked, forms.len() * 7);
}

/// A lease lost between its grant and the start of the command ends the run
/// as any loss does (76, a `lost` event saying the command was not started),
/// and the command never runs. The tool is held up there on purpose: its
/// events go to a pipe this test filled, so its first event, `acquired`
/// (written after the grant, before the command starts), blocks until the
/// test reads the pipe.
#[test]
fn a_lease_lost_before_the_command_starts_ends_with_76_and_runs_nothing() {
    use std::io::{Read as _, Write as _};
    let server = shared_server();
    let url = server.url();
    let prefix = unique_prefix("cli-lost-before-start");
    let marker = std::env::temp_dir().join(format!(
        "respire-lock-ran-{}-{}",
        std::process::id(),
        prefix.replace(':', "-")
    ));
    let (mut reader, mut writer) = std::io::pipe().unwrap();
    rustix::io::ioctl_fionbio(&writer, true).unwrap();
    let chunk = [b'#'; 4096];
    let mut filled = 0;
    loop {
        match writer.write(&chunk) {
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("filling the pipe: {e}"),
        }
    }
    rustix::io::ioctl_fionbio(&writer, false).unwrap();
    let ttl = Duration::from_secs(3);
    // Started with SIGTERM ignored (as under `nohup`): the tool leaves it
    // ignored, and the kernel keeps it ignored in every process the tool
    // starts, across fork and exec. The SIGTERM the guardian and the tool
    // send the group of a lost lease is then discarded, and only the SIGKILL
    // a long --kill-after later could stop a command started in spite of the
    // deadline before it leaves its marker. Without this, that SIGTERM often
    // ends the exec step before it could start the command at all, and a
    // tool that starts commands after the loss deadline would go unseen.
    let child = Cli::run(&url, &prefix)
        .ttl("3s")
        .kill_after("60s")
        .events_fd("1")
        .key("job")
        .cmd(&["touch", marker.to_str().unwrap()])
        .command_ignoring_term()
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Granted: the server holds the writer's key.
    let key = format!("{prefix}{{job}}:w");
    wait_until(Duration::from_secs(10), "the grant", || {
        server.client().exists::<_, bool>(&key).unwrap()
    });
    // Lost: with the key deleted, no renewal is confirmed from now on, so
    // the loss deadline the tool holds (counted from a grant or renewal
    // sent before this moment, less drift and a node timeout) is less than
    // one TTL away. Waiting for that bound on the monotonic clock, rather
    // than for a sign from the tool, which cannot give one while blocked.
    let deleted = Instant::now();
    let _: () = server.client().del(&key).unwrap();
    wait_until(Duration::from_secs(10), "one TTL after the delete", || {
        deleted.elapsed() > ttl
    });
    let drain = std::thread::spawn(move || {
        let mut all = Vec::new();
        reader.read_to_end(&mut all).unwrap();
        all
    });
    let out = child.wait_with_output().unwrap();
    let stdout = drain.join().unwrap();
    let events = json_lines(&stdout[filled..]);
    assert_eq!(out.status.code(), Some(76), "{}", text(&out.stderr));
    assert!(
        !marker.exists(),
        "the command ran after its lease was lost: {}",
        text(&out.stderr)
    );
    let names: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(names[0], "acquired", "{names:?}");
    assert!(!names.contains(&"started"), "{names:?}");
    // The key was deleted: the renewal found it gone (or, had no renewal
    // been sent in time, the deadline passed).
    let lost = event(&events, "lost");
    assert!(
        ["gone", "expired", "renewal_unconfirmed"].contains(&lost["cause"].as_str().unwrap()),
        "{lost}"
    );
    let stderr = text(&out.stderr);
    assert!(stderr.contains("the command was not started"), "{stderr}");
    assert!(
        stderr.contains("lost before the command could start"),
        "{}",
        text(&out.stderr)
    );
}

/// The holder `run` records by default: this host's name, the tool's pid
/// and the command's program name.
fn default_holder(tool_pid: u32, program: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    format!("{} pid {tool_pid}: {program}", host.trim())
}

#[test]
fn run_records_who_holds_the_lease_and_never_a_secret() {
    const SECRET: &str = "hunter2Holder";
    let server = shared_server();
    let user = unique_prefix("holder-user").replace(':', "");
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(&user)
        .arg("on")
        .arg(format!(">{SECRET}"))
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .query(&mut server.client())
        .unwrap();
    let url = format!("redis://{user}:{SECRET}@127.0.0.1:{}", server.port());
    let prefix = unique_prefix("cli-holder");
    let events = events_path("holder");
    // The default: host, the tool's pid and the program, not its arguments.
    let script = format!("sleep 30 # {SECRET}");
    let mut child = Cli::run(&url, &prefix)
        .events_file(&events)
        .key("job")
        .cmd(&["/bin/sh", "-c", &script])
        .command()
        .spawn()
        .unwrap();
    started_pid(&events);
    let holder = default_holder(child.id(), "sh");
    let raw: String = server.client().get(format!("{prefix}{{job}}:w")).unwrap();
    assert!(!raw.contains(SECRET), "{raw}");
    assert!(
        raw.ends_with(&format!("@{}:1", holder.replace(':', "%3A"))),
        "{raw}"
    );
    let status = |extra: &[&str]| {
        let out = Cli::new("status")
            .url(&url)
            .prefix(&prefix)
            .args(extra)
            .key("job")
            .output();
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let line = status(&[]);
    assert!(line.contains(&format!("holder {holder:?}")), "{line}");
    assert!(!line.contains(SECRET), "{line}");
    let json: serde_json::Value = serde_json::from_str(&status(&["--json"])).unwrap();
    assert_eq!(json["holder"], holder, "{json}");
    let owner = json["holders"][0]["owner"].as_str().unwrap();
    assert!(owner.len() == 32 && owner.bytes().all(|b| b.is_ascii_hexdigit()));
    signal(&child, rustix::process::Signal::TERM);
    child.wait().unwrap();
    std::fs::remove_file(&events).unwrap();

    // --holder, and RESPIRE_LOCK_HOLDER, as given; the line beats the
    // environment.
    let given = "deploy #7: blue, 100%";
    let probe = format!("{BIN} status --json --prefix {prefix} job");
    for (flag, env) in [
        (Some(given), None),
        (None, Some(given)),
        (Some(given), Some("env")),
    ] {
        let mut cli = Cli::run(&url, &prefix).flag("--shared");
        if let Some(h) = flag {
            cli = cli.opt("--holder", h);
        }
        let mut cmd = cli.key("job").sh(&probe).command();
        cmd.env("REDIS_URL", &url);
        if let Some(h) = env {
            cmd.env("RESPIRE_LOCK_HOLDER", h);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["mode"], "shared", "{json}");
        assert_eq!(json["holders"][0]["holder"], given, "{json}");
    }

    // A holder the library would refuse stops the run before anything is
    // sent: no fence counter is made.
    let fresh = unique_prefix("cli-holder-bad");
    let long = "h".repeat(respire_coordination::MAX_HOLDER_LEN + 1);
    for bad in ["line\nbreak", "", long.as_str()] {
        let out = run(&[
            "run", "--url", &url, "--prefix", &fresh, "--holder", bad, "job", "true",
        ]);
        assert_usage_error(&out, &["--holder"], "run");
        let out = respire_lock(&["run", "--prefix", &fresh, "job", "true"])
            .env("REDIS_URL", &url)
            .env("RESPIRE_LOCK_HOLDER", bad)
            .output()
            .unwrap();
        assert_usage_error(&out, &["RESPIRE_LOCK_HOLDER"], "run");
    }
    let fence: bool = server
        .client()
        .exists(format!("{fresh}{{job}}:fence"))
        .unwrap();
    assert!(!fence, "a run with a bad holder sent its acquire");
    // elect advertises --value, and refuses --holder.
    let out = run(&["elect", "--url", &url, "--holder", "x", "job", "true"]);
    assert_usage_error(&out, &["--holder", "--value"], "elect");
    let _: () = redis::cmd("ACL")
        .arg("DELUSER")
        .arg(&user)
        .query(&mut server.client())
        .unwrap();
}

/// `sh -c` text that records entering and leaving in `log`, one line each.
fn recording(log: &std::path::Path, mode: &str) -> String {
    let log = log.display();
    format!("echo \"in {mode} $$\" >> '{log}'; sleep 0.02; echo \"out {mode} $$\" >> '{log}'")
}

#[test]
fn fenced_redlock_shared_and_counted_runs_on_one_key_never_overlap_wrongly() {
    let servers: Vec<TestServer> = (0..3).map(|_| TestServer::start()).collect();
    let single = servers[0].url();
    let redlock: String = servers
        .iter()
        .map(TestServer::url)
        .collect::<Vec<_>>()
        .join(",");
    let log = events_path("inside");
    const WORKERS: usize = 8;
    const RUNS: usize = 26;
    std::thread::scope(|s| {
        for worker in 0..WORKERS {
            let (single, redlock, log) = (&single, &redlock, &log);
            s.spawn(move || {
                for i in 0..RUNS {
                    let mode = ["fenced", "redlock", "shared", "counted"][(worker + i) % 4];
                    let cli = Cli::new("run").wait("2m").ttl("5s");
                    let cli = match mode {
                        "redlock" => cli.redlock(redlock),
                        "shared" => cli.url(single).flag("--shared"),
                        "counted" => cli.url(single).opt("--max", "2"),
                        _ => cli.url(single),
                    };
                    let out = cli.key("job").sh(&recording(log, mode)).output();
                    assert!(out.status.success(), "{mode}: {}", text(&out.stderr));
                }
            });
        }
    });
    // The checker: replays who was inside, in the order they wrote.
    let record = std::fs::read_to_string(&log).unwrap();
    std::fs::remove_file(&log).unwrap();
    let (entered, most_shared) = check_inside(&record).unwrap();
    assert_eq!(
        entered.values().sum::<usize>(),
        WORKERS * RUNS,
        "{entered:?}"
    );
    for mode in ["fenced", "redlock", "shared", "counted"] {
        assert!(entered[mode] >= 40, "{entered:?}");
    }
    eprintln!("entered {entered:?}; at most {most_shared} shared runs at once");
}

/// Replays a record of `in MODE pid` / `out MODE pid` lines: an exclusive run
/// (fenced or redlock) alone, shared runs only beside each other, at most two
/// counted runs. Returns how many runs of each mode entered and the most
/// shared runs inside at once, or the first line that broke a rule.
fn check_inside(record: &str) -> Result<(std::collections::HashMap<&str, usize>, usize), String> {
    let mut inside: std::collections::HashMap<&str, usize> = Default::default();
    let mut entered: std::collections::HashMap<&str, usize> = Default::default();
    let mut most_shared = 0;
    for line in record.lines() {
        let mut words = line.split(' ');
        let (what, mode) = (words.next().unwrap(), words.next().unwrap());
        let count = |inside: &std::collections::HashMap<&str, usize>, m: &str| {
            inside.get(m).copied().unwrap_or(0)
        };
        if what == "out" {
            *inside
                .get_mut(mode)
                .ok_or(format!("{line}: never entered"))? -= 1;
            continue;
        }
        let others: usize = ["fenced", "redlock", "shared", "counted"]
            .iter()
            .filter(|m| **m != mode)
            .map(|m| count(&inside, m))
            .sum();
        if others > 0 {
            return Err(format!("{line}: entered beside {inside:?}"));
        }
        let same = count(&inside, mode);
        match mode {
            "fenced" | "redlock" if same > 0 => return Err(format!("{line}: two {mode} runs")),
            "counted" if same >= 2 => return Err(format!("{line}: a third counted run")),
            _ => {}
        }
        *inside.entry(mode).or_default() += 1;
        *entered.entry(mode).or_default() += 1;
        most_shared = most_shared.max(count(&inside, "shared"));
    }
    if inside.values().any(|n| *n != 0) {
        return Err(format!("still inside at the end: {inside:?}"));
    }
    Ok((entered, most_shared))
}

#[test]
fn the_checker_of_who_is_inside_finds_every_wrong_overlap() {
    let ok = "in shared 1\nin shared 2\nout shared 1\nout shared 2\n\
              in counted 3\nin counted 4\nout counted 3\nout counted 4\n\
              in fenced 5\nout fenced 5\nin redlock 6\nout redlock 6\n";
    let (entered, most_shared) = check_inside(ok).unwrap();
    assert_eq!(entered.values().sum::<usize>(), 6);
    assert_eq!(most_shared, 2);
    for bad in [
        "in fenced 1\nin redlock 2\nout redlock 2\nout fenced 1\n",
        "in redlock 1\nin redlock 2\nout redlock 2\nout redlock 1\n",
        "in shared 1\nin fenced 2\nout fenced 2\nout shared 1\n",
        "in counted 1\nin shared 2\nout shared 2\nout counted 1\n",
        "in counted 1\nin counted 2\nin counted 3\n",
        "in fenced 1\n",
    ] {
        assert!(check_inside(bad).is_err(), "{bad:?} passed");
    }
}

#[test]
fn status_shows_what_run_holds_on_every_deployment() {
    let cluster = cluster_url();
    let sentinel = {
        let deployment = support::shared_sentinel();
        let hosts: Vec<String> = deployment
            .sentinels()
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        format!(
            "redis+sentinel://{}/{}",
            hosts.join(","),
            deployment.service()
        )
    };
    let servers: Vec<TestServer> = (0..3).map(|_| TestServer::start()).collect();
    let redlock = servers
        .iter()
        .map(TestServer::url)
        .collect::<Vec<_>>()
        .join(",");
    let standalone = shared_server().url();
    for (flag, url, mode) in [
        ("--url", &standalone, "exclusive"),
        ("--url", &cluster, "exclusive"),
        ("--url", &sentinel, "exclusive"),
        ("--redlock", &redlock, "redlock"),
    ] {
        let prefix = unique_prefix("cli-status-all");
        let events = events_path("status");
        let mut child = inside_until_signalled(&[flag, url, "--prefix", &prefix], &events);
        let token = event(&events_in(&events), "acquired")["token"].clone();
        let json_status = Cli::new("status")
            .opt(flag, url)
            .prefix(&prefix)
            .flag("--json")
            .key("job");
        let out = json_status.output();
        assert!(out.status.success(), "{url}: {}", text(&out.stderr));
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(status["held"], true, "{url}: {status}");
        assert_eq!(status["mode"], mode, "{url}: {status}");
        assert_eq!(status["token"], token, "{url}: {status}");
        // Who holds it: this host, the tool's pid, the command's program.
        let holder = default_holder(child.id(), "sleep");
        assert_eq!(status["holder"], holder, "{url}: {status}");
        assert_eq!(status["holders"][0]["holder"], holder, "{url}: {status}");
        assert_eq!(status["holders"][0]["mode"], mode, "{url}: {status}");
        assert!(status["ttl_ms"].as_u64().unwrap() > 0, "{status}");
        if flag == "--redlock" {
            assert_eq!(status["held_on"], 3, "{status}");
        }
        let line = Cli::new("status").opt(flag, url).prefix(&prefix).key("job");
        let line = text(&line.output().stdout);
        assert!(line.starts_with("job: held "), "{url}: {line}");
        assert!(
            line.contains(&format!("holder {holder:?}")),
            "{url}: {line}"
        );
        signal(&child, rustix::process::Signal::TERM);
        assert_eq!(child.wait().unwrap().code(), Some(128 + 15));
        let out = json_status.output();
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(status["held"], false, "{url}: {status}");
        std::fs::remove_file(&events).unwrap();
    }
    // Shared and counted holders, as run takes them.
    let prefix = unique_prefix("cli-status-modes");
    for (mode_args, mode) in [(&["--shared"][..], "shared"), (&["--max", "3"], "counted")] {
        let events = events_path("status-mode");
        let mut child = Cli::run(&standalone, &prefix)
            .args(mode_args)
            .events_file(&events)
            .key("job")
            .cmd(&["sleep", "30"])
            .command()
            .spawn()
            .unwrap();
        started_pid(&events);
        let out = Cli::new("status")
            .url(&standalone)
            .prefix(&prefix)
            .flag("--json")
            .key("job")
            .output();
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(status["mode"], mode, "{status}");
        let holders = status["holders"].as_array().unwrap();
        assert_eq!(holders.len(), 1, "{status}");
        assert_eq!(holders[0]["mode"], mode, "{status}");
        assert_eq!(holders[0]["holder"], default_holder(child.id(), "sleep"));
        if mode == "shared" {
            assert_eq!(status["readers"], 1, "{status}");
        } else {
            assert_eq!(status["permits"].as_array().unwrap().len(), 1, "{status}");
            assert_eq!(status["capacity"], 3, "{status}");
        }
        signal(&child, rustix::process::Signal::TERM);
        child.wait().unwrap();
        std::fs::remove_file(&events).unwrap();
    }
}

#[test]
fn doctor_checks_the_rights_on_a_key_and_says_unknown_when_it_cannot_read() {
    let server = TestServer::builder()
        .acl_user("user app on >pw ~other:* &* +@all")
        .acl_user("user blind on >pw ~* &* +@all -info -config")
        .start();
    let out = run(&["doctor", "--key", "job", &server.url_for_user("app", "pw")]);
    let report = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(
        report.contains("FAIL  key: reading respire-lock:{job}:* denied"),
        "{report}"
    );
    // Without --key, a probe name under the prefix.
    let out = run(&["doctor", &server.url_for_user("app", "pw")]);
    let report = text(&out.stdout);
    assert!(
        report.contains("FAIL  key: reading respire-lock:{doctor-probe}:* denied"),
        "{report}"
    );
    let out = run(&[
        "doctor",
        "--prefix",
        "other:",
        &server.url_for_user("app", "pw"),
    ]);
    let report = text(&out.stdout);
    assert!(
        report.contains("ok    key: other:{doctor-probe}:* can be read and written"),
        "{report}"
    );
    let out = run(&[
        "doctor",
        "--key",
        "job",
        &server.url_for_user("blind", "pw"),
    ]);
    let report = text(&out.stdout);
    for line in [
        "warn  version: unknown",
        "warn  persistence: unknown",
        "warn  eviction: unknown",
        "warn  replication: unknown",
        "ok    key: respire-lock:{job}:* can be read and written",
    ] {
        assert!(report.contains(line), "{line:?} not in\n{report}");
    }
    assert!(!report.contains("no client tracking"), "{report}");
    // The help lists every check id the findings use.
    let help = text(&run(&["doctor", "--help"]).stdout);
    for id in [
        "version",
        "persistence",
        "eviction",
        "replication",
        "cluster",
        "topology",
        "sentinel",
        "failover",
        "acl",
        "key",
    ] {
        assert!(
            help.contains(&format!("  {id} ")),
            "{id} not in doctor --help"
        );
    }
}

#[test]
fn the_library_builds_without_clap_by_default() {
    let tree = |features: &[&str]| {
        let out = Command::new(env!("CARGO"))
            .args(["tree", "--offline", "-e", "normal", "--prefix", "none"])
            .args(features)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let default = tree(&[]);
    assert!(default.contains("redis v"), "{default}");
    for dep in ["clap", "clap_complete", "humantime", "signal-hook"] {
        assert!(
            !default.lines().any(|l| l.starts_with(&format!("{dep} v"))),
            "{dep} in the default build:\n{default}"
        );
    }
    assert!(
        tree(&["--features", "cli"])
            .lines()
            .any(|l| l.starts_with("clap v"))
    );
}

#[test]
fn tls_options_reach_a_server_that_wants_client_certificates() {
    let server = TestServer::builder()
        .tls(support::TlsAuthClients::Yes)
        .start();
    let files = server.tls().unwrap();
    let path = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let (ca, cert, key) = (
        path(&files.ca_cert),
        path(&files.client_cert),
        path(&files.client_key),
    );
    let url = server.url();
    assert!(url.starts_with("rediss://"), "{url}");
    let out = Cli::new("run")
        .url(&url)
        .opt("--tls-ca", &ca)
        .opt("--tls-cert", &cert)
        .opt("--tls-key", &key)
        .key("job")
        .sh("echo $RESPIRE_FENCING_TOKEN")
        .output();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "1");
    // The same from the environment, for status.
    let out = Cli::new("status")
        .url(&url)
        .key("job")
        .command()
        .env("RESPIRE_LOCK_TLS_CA", &ca)
        .env("RESPIRE_LOCK_TLS_CERT", &cert)
        .env("RESPIRE_LOCK_TLS_KEY", &key)
        .output()
        .unwrap();
    // Free: status 1.
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).trim(),
        "job: free (last fencing token issued: 1)"
    );
    // Without the client certificate the server refuses the run.
    let out = Cli::new("run")
        .url(&url)
        .opt("--tls-ca", &ca)
        .key("job")
        .cmd(&["true"])
        .output();
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stderr));
    // A file that cannot be read is a usage error.
    assert_usage_error(
        &run(&[
            "run",
            "--url",
            &url,
            "--tls-ca",
            "/nonexistent.pem",
            "job",
            "true",
        ]),
        &["--tls-ca", "/nonexistent.pem"],
        "run --help",
    );
}

#[test]
fn a_wait_says_when_redis_stops_answering_and_when_it_answers_again() {
    let server = TestServer::start();
    let url = server.url();
    let coord = Coordinator::builder(&url)
        .key_prefix("respire-lock:")
        .build()
        .unwrap();
    let held = exclusive_holder(&coord)
        .try_acquire(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    let events = events_path("unreachable");
    let before = script_calls(&url);
    let mut waiting = Cli::new("run")
        .url(&url)
        .events_file(&events)
        .key("job")
        .cmd(&["true"])
        .command()
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert_waiting_after_an_attempt(&url, before, &mut waiting);
    server.kill();
    let has = |name: &str| events_in(&events).iter().any(|e| e["event"] == name);
    wait_until(Duration::from_secs(15), "the unreachable event", || {
        has("unreachable")
    });
    assert!(waiting.try_wait().unwrap().is_none(), "it still waits");
    // Back, without the old lease (no persistence): the wait ends.
    server.restart();
    let out = waiting.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("still waiting for \"job\", but Redis does not answer"),
        "{stderr}"
    );
    let names: Vec<String> = events_in(&events)
        .iter()
        .map(|e| e["event"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names[0], "unreachable", "{names:?}");
    assert!(names.contains(&"acquired".to_owned()), "{names:?}");
    std::fs::remove_file(&events).unwrap();
    drop(held);
}

/// A running tool that is killed if the test ends without waiting for it (a
/// failed assertion): an `elect --recampaign` or a `leader --watch` would
/// otherwise outlive the test.
struct KillOnDrop(Option<std::process::Child>);

impl KillOnDrop {
    fn into_inner(mut self) -> std::process::Child {
        self.0.take().expect("still held")
    }
}

impl std::ops::Deref for KillOnDrop {
    type Target = std::process::Child;

    fn deref(&self) -> &std::process::Child {
        self.0.as_ref().expect("still held")
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        self.0.as_mut().expect("still held")
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn elect_runs_the_command_while_leader_and_leader_reports_it() {
    let server = TestServer::start();
    let url = server.url();
    let events = events_path("elect");
    // The command says it has printed by creating `printed`: the test signals
    // it only after, so the line is in the pipe whatever the scheduling.
    let printed = events_path("elect-printed");
    let script = format!(
        "echo term=$RESPIRE_LEADER_TERM token=$RESPIRE_FENCING_TOKEN value=$RESPIRE_LEADER_VALUE; \
         : > '{}'; exec sleep 30",
        printed.display()
    );
    let leading = Cli::new("elect")
        .url(&url)
        .ttl("3s")
        .opt("--value", "10.0.0.1:80")
        .events_file(&events)
        .key("jobs")
        .sh(&script)
        .command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(|c| KillOnDrop(Some(c)))
        .unwrap();
    let pgid = started_pid(&events);
    let acquired = event(&events_in(&events), "acquired").clone();
    assert_eq!(acquired["mode"], "leader");
    assert_eq!(acquired["token"], 1);
    assert_eq!(acquired["lease_key"], "respire-lock:{jobs}:leader");

    // `leader`, in text and JSON, reads what the server holds.
    let out = Cli::new("leader").url(&url).key("jobs").output();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "jobs: led by \"10.0.0.1:80\" (term 1)\n");
    let out = Cli::new("leader")
        .url(&url)
        .flag("--json")
        .key("jobs")
        .output();
    let json = json_lines(&out.stdout);
    assert_eq!(
        json,
        vec![
            serde_json::json!({"name": "jobs", "leader": true, "term": 1, "value": "10.0.0.1:80"})
        ]
    );
    let mut admin = server.client();
    let value: String = admin.get("respire-lock:{jobs}:value").unwrap();
    assert_eq!(value, "1:10.0.0.1:80");

    // A second contender that will not wait is not elected.
    let out = Cli::new("elect")
        .url(&url)
        .flag("-n")
        .key("jobs")
        .cmd(&["true"])
        .output();
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));

    // SIGTERM goes to the command's group; the leadership is resigned after.
    wait_until(Duration::from_secs(10), "the command to print", || {
        printed.exists()
    });
    signal(&leading, rustix::process::Signal::TERM);
    let out = leading.into_inner().wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(128 + 15), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "term=1 token=1 value=10.0.0.1:80\n");
    assert!(!group_alive(pgid));
    assert_eq!(
        event(&events_in(&events), "released")["outcome"],
        "released"
    );
    let out = Cli::new("leader")
        .url(&url)
        .flag("--json")
        .key("jobs")
        .output();
    assert_eq!(
        json_lines(&out.stdout),
        vec![serde_json::json!({"name": "jobs", "leader": false, "term": null, "value": null})]
    );
    std::fs::remove_file(&events).unwrap();
    std::fs::remove_file(&printed).unwrap();
}

#[test]
fn elect_stops_the_command_on_loss_and_recampaigns_with_a_higher_term() {
    let server = TestServer::start();
    let url = server.url();
    let events = events_path("recampaign");
    let terms = events_path("recampaign-terms");
    let child = Cli::new("elect")
        .url(&url)
        .short_lease()
        .kill_after("1s")
        .flag("--recampaign")
        .events_file(&events)
        .key("jobs")
        .sh(&format!(
            "echo $RESPIRE_LEADER_TERM >> {}; exec sleep 30",
            terms.display()
        ))
        .command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(|c| KillOnDrop(Some(c)))
        .unwrap();
    let first = started_pid(&events);
    // Another contender takes over on the server: the lease is deleted and
    // it campaigns through the library.
    let coord = Coordinator::connect(&url).unwrap();
    let election = coord.election("respire-lock:{jobs}").unwrap();
    let mut admin = server.client();
    let _: () = admin.del("respire-lock:{jobs}:leader").unwrap();
    let other = election
        .try_campaign("other", Duration::from_secs(60))
        .unwrap()
        .expect("free after the delete");
    assert_eq!(other.term().get(), 2);
    wait_until(
        Duration::from_secs(10),
        "the first command to be stopped",
        || !group_alive(first),
    );
    wait_until(Duration::from_secs(10), "a new campaign", || {
        events_in(&events)
            .iter()
            .any(|e| e["event"] == "recampaign")
    });
    let evs = events_in(&events);
    // Taken over, or (when a renewal found the key deleted before the other
    // contender got in) gone.
    let cause = event(&evs, "lost")["cause"].clone();
    assert!(cause == "taken_over" || cause == "gone", "{cause}");
    assert_eq!(event(&evs, "recampaign")["event"], "recampaign");
    // It campaigns again, and leads once the other resigns.
    assert_eq!(
        other.resign().unwrap(),
        respire_coordination::ReleaseOutcome::Released
    );
    wait_until(
        Duration::from_secs(10),
        "the command to start again",
        || {
            events_in(&events)
                .iter()
                .filter(|e| e["event"] == "started")
                .count()
                == 2
        },
    );
    let evs = events_in(&events);
    let acquired: Vec<_> = evs
        .iter()
        .filter(|e| e["event"] == "acquired")
        .map(|e| e["token"].as_u64().unwrap())
        .collect();
    assert_eq!(acquired, vec![1, 3]);
    wait_until(Duration::from_secs(5), "the second command's term", || {
        std::fs::read_to_string(&terms).unwrap_or_default() == "1\n3\n"
    });
    let seen = election.leader().unwrap().expect("the tool leads again");
    assert_eq!(seen.term.get(), 3);
    signal(&child, rustix::process::Signal::TERM);
    let out = child.into_inner().wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(128 + 15), "{}", text(&out.stderr));
    std::fs::remove_file(&events).unwrap();
    std::fs::remove_file(&terms).unwrap();
}

#[test]
fn leader_watch_follows_every_change() {
    let server = TestServer::start();
    let url = server.url();
    let mut watch = Cli::new("leader")
        .url(&url)
        .flag("--watch")
        .flag("--json")
        .key("jobs")
        .command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(|c| KillOnDrop(Some(c)))
        .unwrap();
    let mut lines = std::io::BufReader::new(watch.stdout.take().unwrap());
    let mut next = || {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut lines, &mut line).unwrap();
        serde_json::from_str::<serde_json::Value>(&line)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"))
    };
    let nobody = serde_json::json!({"name": "jobs", "leader": false, "term": null, "value": null});
    assert_eq!(next(), nobody);
    let coord = Coordinator::connect(&url).unwrap();
    let election = coord.election("respire-lock:{jobs}").unwrap();
    let a = election
        .try_campaign("a", Duration::from_secs(60))
        .unwrap()
        .unwrap();
    assert_eq!(
        next(),
        serde_json::json!({"name": "jobs", "leader": true, "term": 1, "value": "a"})
    );
    assert!(a.proclaim("a2").unwrap());
    assert_eq!(
        next(),
        serde_json::json!({"name": "jobs", "leader": true, "term": 1, "value": "a2"})
    );
    a.resign().unwrap();
    assert_eq!(next(), nobody);
    // The server goes away: an error, not the last state.
    server.kill();
    let error = next();
    assert_eq!(error["name"], "jobs");
    assert!(error["error"].as_str().is_some(), "{error}");
    drop(watch);
}

#[test]
fn elect_and_leader_refuse_bad_input_before_sending_anything() {
    let url = shared_server().url();
    let out = run(&["elect", "--url", &url, "--shared", "jobs", "--", "true"]);
    assert_usage_error(&out, &["--shared"], "respire-lock elect --help");
    let out = run(&[
        "elect",
        "--redlock",
        "redis://a,redis://b,redis://c",
        "jobs",
        "--",
        "true",
    ]);
    assert_usage_error(&out, &["--redlock"], "respire-lock elect --help");
    let out = run(&["elect", "--url", &url, "--ttl", "1s", "jobs", "--", "true"]);
    assert_usage_error(&out, &["--ttl"], "respire-lock elect --help");
    let out = run(&["elect", "--url", &url, "", "--", "true"]);
    assert_eq!(out.status.code(), Some(64), "{}", text(&out.stderr));
    let out = run(&["leader", "jobs"]);
    assert_usage_error(&out, &["--url"], "respire-lock leader --help");
    let out = run(&["leader", "--url", &url, ""]);
    assert_eq!(out.status.code(), Some(64), "{}", text(&out.stderr));
}

#[test]
fn elect_without_recampaign_ends_with_the_lost_status_when_leadership_is_lost() {
    let server = TestServer::start();
    let events = events_path("elect-lost");
    let child = Cli::new("elect")
        .url(&server.url())
        .short_lease()
        .kill_after("1s")
        .events_file(&events)
        .key("jobs")
        .sh("sleep 30 & sleep 30; echo done")
        .command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(|c| KillOnDrop(Some(c)))
        .unwrap();
    let pgid = started_pid(&events);
    wait_until(Duration::from_secs(5), "sh and its two sleeps", || {
        group_members(pgid) == 3
    });
    let mut admin = server.client();
    let _: () = admin
        .set("respire-lock:{jobs}:leader", "intruder:99")
        .unwrap();
    let out = child.into_inner().wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(76), "{}", text(&out.stderr));
    assert!(!text(&out.stdout).contains("done"));
    wait_until(Duration::from_secs(2), "the whole group to be gone", || {
        !group_alive(pgid)
    });
    let evs = events_in(&events);
    assert_eq!(event(&evs, "lost")["cause"], "taken_over");
    assert_eq!(event(&evs, "released")["outcome"], "taken_over");
    assert!(evs.iter().all(|e| e["event"] != "recampaign"));
    std::fs::remove_file(&events).unwrap();
}

/// A Redlock run whose grant on the first node comes after the quorum's:
/// that node (60 ms away, the others local) holds `planted` under the run's
/// key, or nothing. Returns the run's exit code and stderr.
fn redlock_run_beside_a_slow_node(planted: Option<&str>) -> (Option<i32>, String) {
    let servers: Vec<TestServer> = (0..3).map(|_| TestServer::start()).collect();
    let slow = support::FaultProxy::start(servers[0].addr());
    slow.set_mode(support::Mode::Delay(Duration::from_millis(60)));
    if let Some(value) = planted {
        let () = servers[0]
            .client()
            .set_options(
                "respire-lock:{job}:w",
                value,
                redis::SetOptions::default().with_expiration(redis::SetExpiry::PX(30_000)),
            )
            .unwrap();
    }
    let nodes = [slow.url(), servers[1].url(), servers[2].url()].join(",");
    let out = Cli::new("run")
        .args(&["-n", "-v"])
        .node_timeout("1s")
        .ttl("5s")
        .redlock(&nodes)
        .key("job")
        .cmd(&["true"])
        .output();
    (out.status.code(), text(&out.stderr))
}

#[test]
fn a_redlock_run_needs_its_own_value_on_every_node_it_reaches() {
    // Another Redlock run's value (no fencing token), still on the slow node:
    // deleted there a moment later, it would leave that node to a counted or
    // shared run while this one runs. The quorum of the two local nodes is
    // not enough.
    let (code, err) = redlock_run_beside_a_slow_node(Some("another-run"));
    assert_eq!(code, Some(75), "{err}");
    assert!(err.contains("exclusive on"), "{err}");
    // With nothing there, the slow node grants late, and the run goes ahead.
    let (code, err) = redlock_run_beside_a_slow_node(None);
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn a_redlock_run_takes_a_node_that_cannot_say_what_it_holds_as_held() {
    let servers: Vec<TestServer> = (0..3).map(|_| TestServer::start()).collect();
    // On the first node, a user that may take and renew the key but not read
    // the other modes' keys, which is what a Redlock run checks after its
    // grant.
    let () = redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "limited",
            "on",
            ">limited-secret",
            "~*",
            "&*",
            "+@all",
        ])
        .arg(&["-zrange", "-hmget"])
        .query(&mut servers[0].client())
        .unwrap();
    let limited = format!("redis://limited:limited-secret@{}", servers[0].addr());
    // A counted run on the first node, inside until it is stopped.
    let events = events_path("unreadable");
    let mut counted = inside_until_signalled(&["--url", &servers[0].url(), "--max", "2"], &events);
    let nodes = [limited, servers[1].url(), servers[2].url()].join(",");
    let out = run(&["run", "-n", "-v", "--redlock", &nodes, "job", "true"]);
    signal(&counted, rustix::process::Signal::TERM);
    assert_eq!(counted.wait().unwrap().code(), Some(128 + 15));
    std::fs::remove_file(&events).unwrap();
    let err = text(&out.stderr);
    // The run did not start beside the counted one: the node it could not
    // read counts as held.
    assert_eq!(out.status.code(), Some(75), "{err}");
    assert!(err.contains("did not say what it holds"), "{err}");
    assert!(!err.contains("limited-secret"), "{err}");
}

// ---------------------------------------------------------------------------
// The dead-man's switch, inherited signals

/// The machine's monotonic clock, which every process reads alike, in
/// nanoseconds.
fn monotonic_ns() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// Set in a copy of this test binary that a run starts as its command: the
/// file it appends its readings of the monotonic clock to.
const RECORD_ENV: &str = "RESPIRE_CLI_RECORD";
/// With [`RECORD_ENV`]: `loop` appends a reading every 2 ms until killed,
/// `once` appends one and exits.
const RECORD_MODE_ENV: &str = "RESPIRE_CLI_RECORD_MODE";

/// The command of a run that records its liveness: this test binary, running
/// `test` alone as a recorder into `log`.
fn recorder(run: &mut Command, test: &str, log: &std::path::Path, mode: &str) {
    run.args([
        "--",
        std::env::current_exe().unwrap().to_str().unwrap(),
        test,
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(RECORD_ENV, log)
    .env(RECORD_MODE_ENV, mode);
}

/// In a recorder: appends readings of the monotonic clock to its file.
fn record_liveness() {
    use std::io::Write as _;
    let path = std::env::var_os(RECORD_ENV).unwrap();
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    let once = std::env::var(RECORD_MODE_ENV).as_deref() == Ok("once");
    loop {
        writeln!(file, "{}", monotonic_ns()).unwrap();
        if once {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The readings a recorder appended to `log`.
fn readings(log: &std::path::Path) -> Vec<u64> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect()
}

/// One round of [`a_stopped_tool_cannot_keep_its_command_past_the_lease`]:
/// returns `Err` with what went wrong when the second command started while
/// the first was still alive.
fn stopped_supervisor_round(url: &str, key: &str) -> Result<(), String> {
    const TEST: &str = "a_stopped_tool_cannot_keep_its_command_past_the_lease";
    let first_log = events_path(&format!("{key}-first"));
    let second_log = events_path(&format!("{key}-second"));
    let mut first = Cli::new("run")
        .url(url)
        .ttl("3s")
        .kill_after("1s")
        .key(key)
        .command();
    recorder(&mut first, TEST, &first_log, "loop");
    let first = KillOnDrop(Some(
        first
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    wait_until(
        Duration::from_secs(10),
        "the first command to record",
        || !readings(&first_log).is_empty(),
    );
    let mut second = Cli::new("run").url(url).wait("30s").key(key).command();
    recorder(&mut second, TEST, &second_log, "once");
    let second = KillOnDrop(Some(
        second
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    // The second run waits: its writer intent is on the server.
    let mut admin = redis::Client::open(url).unwrap().get_connection().unwrap();
    let intents = format!("respire-lock:{{{key}}}:q");
    wait_until(Duration::from_secs(10), "the second run to wait", || {
        admin.zcard::<_, u64>(&intents).unwrap() > 0
    });
    let stopped_at = monotonic_ns();
    signal(&first, rustix::process::Signal::STOP);
    let out = second.into_inner().wait_with_output().unwrap();
    if out.status.code() != Some(0) {
        return Err(format!("the second run: {out:?}"));
    }
    let second_started = *readings(&second_log).first().ok_or("no second start")?;
    signal(&first, rustix::process::Signal::CONT);
    let first_out = first.into_inner().wait_with_output().unwrap();
    let first_readings = readings(&first_log);
    let last_alive = *first_readings.last().unwrap();
    let _ = std::fs::remove_file(&first_log);
    let _ = std::fs::remove_file(&second_log);
    if last_alive >= second_started {
        return Err(format!(
            "the first command was alive {} ms after the second started",
            (last_alive - second_started) / 1_000_000
        ));
    }
    // Not vacuous: the first command ran on after its tool was stopped.
    if last_alive <= stopped_at {
        return Err("the first command ended before its tool was stopped".into());
    }
    if first_out.status.code() != Some(76) {
        return Err(format!("the first run: {first_out:?}"));
    }
    Ok(())
}

/// A stopped `respire-lock` (SIGSTOP, a debugger) renews nothing; its
/// guardian stops the command at the lease's loss deadline, so a run waiting
/// for the key never starts its command while the first one is alive, as
/// both commands record on the shared monotonic clock. 20 rounds, 10 at a
/// time. `tests/mutants/cli/a-no-dead-mans-switch.patch` turns the switch off.
#[test]
fn a_stopped_tool_cannot_keep_its_command_past_the_lease() {
    if std::env::var_os(RECORD_ENV).is_some() {
        return record_liveness();
    }
    let server = TestServer::start();
    let url = server.url();
    let failures: Vec<String> = (0..2)
        .flat_map(|wave| {
            std::thread::scope(|s| {
                let rounds: Vec<_> = (0..10)
                    .map(|i| {
                        let url = &url;
                        s.spawn(move || stopped_supervisor_round(url, &format!("dms{wave}-{i}")))
                    })
                    .collect();
                rounds
                    .into_iter()
                    .filter_map(|r| r.join().unwrap().err())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of 20 rounds: {failures:#?}",
        failures.len()
    );
}

/// The state letter of process `pid` (`R`, `S`, `T` for stopped...), from
/// `/proc`.
fn process_state(pid: i32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next())
        .unwrap_or('?')
}

/// Ctrl-Z reaches only the terminal's foreground group, the tool's, not the
/// command's group of its own: SIGTSTP to the tool stops the command's group
/// too, and SIGCONT continues it.
#[test]
fn sigtstp_stops_the_command_with_the_tool_and_sigcont_resumes_both() {
    let server = TestServer::start();
    let events = events_path("tstp");
    let tool = KillOnDrop(Some(inside_until_signalled(
        &["--url", &server.url()],
        &events,
    )));
    let command = started_pid(&events);
    let tool_pid = tool.id() as i32;
    signal(&tool, rustix::process::Signal::TSTP);
    wait_until(
        Duration::from_secs(5),
        "the tool and its command stopped",
        || process_state(tool_pid) == 'T' && process_state(command) == 'T',
    );
    signal(&tool, rustix::process::Signal::CONT);
    wait_until(
        Duration::from_secs(5),
        "the tool and its command running again",
        || process_state(tool_pid) != 'T' && process_state(command) != 'T',
    );
    signal(&tool, rustix::process::Signal::TERM);
    let out = tool.into_inner().wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(128 + 15));
    assert!(!group_alive(command));
    std::fs::remove_file(&events).unwrap();
}

/// `nohup respire-lock run ...`: a SIGHUP ignored when the tool started stays
/// ignored, by the tool and by its command, as with flock.
#[test]
fn signals_ignored_at_start_stay_ignored_by_the_tool_and_its_command() {
    let server = TestServer::start();
    let events = events_path("nohup");
    let go = events_path("nohup-go");
    let script = format!(
        "while [ ! -e '{}' ]; do sleep 0.02; done; echo survived",
        go.display()
    );
    let mut nohup = Command::new("nohup");
    nohup.args([
        BIN,
        "run",
        "--url",
        &server.url(),
        "--events-file",
        events.to_str().unwrap(),
        "job",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    for var in ENV_VARS {
        nohup.env_remove(var);
    }
    let tool = KillOnDrop(Some(
        nohup
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let command = started_pid(&events);
    // A hang-up for the tool, and for the command's group: a command that
    // does not ignore it dies of it before it can see `go`.
    signal(&tool, rustix::process::Signal::HUP);
    rustix::process::kill_process_group(
        rustix::process::Pid::from_raw(command).unwrap(),
        rustix::process::Signal::HUP,
    )
    .unwrap();
    std::fs::write(&go, "").unwrap();
    let out = tool.into_inner().wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "survived\n");
    assert!(
        events_in(&events).iter().all(|e| e["event"] != "forwarded"),
        "{:?}",
        events_in(&events)
    );
    std::fs::remove_file(&events).unwrap();
    std::fs::remove_file(&go).unwrap();
}

// ---------------------------------------------------------------------------
// flock's habits: -E 0, -s, -x/-e, quiet conflicts, the environment

/// `flock -n -E 0`, the cron idiom: a conflict is a silent success, and the
/// command does not run; whatever mode holds the key, a conflict prints
/// nothing without -v.
#[test]
fn a_conflict_in_any_mode_is_quiet_and_e_0_makes_it_a_success() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-e0");
    let coord = Coordinator::builder(&url)
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let attempt = |key: &str, extra: &[&str]| {
        Cli::run(&url, &prefix)
            .args(extra)
            .key(key)
            .cmd(&["echo", "ran"])
            .output()
    };
    let ttl = Duration::from_secs(30);
    let _exclusive = coord
        .read_write_lease("{fenced}")
        .unwrap()
        .write()
        .try_acquire(ttl)
        .unwrap()
        .unwrap();
    let _shared = coord
        .read_write_lease("{shared}")
        .unwrap()
        .read()
        .try_acquire(ttl)
        .unwrap()
        .unwrap();
    let _counted = coord
        .semaphore("{counted}", 1)
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .unwrap();
    for (key, modes) in [
        ("fenced", &[&[][..], &["--shared"], &["--max", "1"]][..]),
        ("shared", &[&[][..], &["--max", "1"]]),
        ("counted", &[&[][..], &["--shared"], &["--max", "1"]]),
    ] {
        for mode in modes {
            let mut extra = vec!["-n", "-E", "0"];
            extra.extend_from_slice(mode);
            let out = attempt(key, &extra);
            assert_eq!(out.status.code(), Some(0), "{key} {mode:?}: {out:?}");
            assert!(
                out.stdout.is_empty() && out.stderr.is_empty(),
                "{key} {mode:?}: {out:?}"
            );
            let mut extra = vec!["-n"];
            extra.extend_from_slice(mode);
            let out = attempt(key, &extra);
            assert_eq!(out.status.code(), Some(75), "{key} {mode:?}: {out:?}");
            assert!(out.stderr.is_empty(), "{key} {mode:?}: {out:?}");
        }
    }
    // -v says which mode holds it.
    let out = attempt("counted", &["-n", "-v"]);
    assert!(
        text(&out.stderr).contains("held in another mode: counted"),
        "{out:?}"
    );
}

/// flock's mode flags: -s is --shared, -x and -e are the exclusive default;
/// two modes on the command line are refused.
#[test]
fn s_x_and_e_choose_the_mode_as_with_flock() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-sxe");
    let mode_of = |flag: &str| {
        let events = events_path("sxe");
        let out = Cli::run(&url, &prefix)
            .flag(flag)
            .events_file(&events)
            .key("job")
            .cmd(&["true"])
            .output();
        assert!(out.status.success(), "{flag}: {out:?}");
        let mode = event(&events_in(&events), "acquired")["mode"].clone();
        std::fs::remove_file(&events).unwrap();
        mode
    };
    assert_eq!(mode_of("-s"), "shared");
    assert_eq!(mode_of("-x"), "fenced");
    assert_eq!(mode_of("-e"), "fenced");
    assert_eq!(mode_of("--exclusive"), "fenced");
    for pair in [["-x", "-s"], ["-e", "--max=2"], ["-s", "--max=2"]] {
        let mut args = vec!["run", "--url", &url, "--prefix", &prefix];
        args.extend_from_slice(&pair);
        args.extend_from_slice(&["job", "true"]);
        let out = run(&args);
        assert_eq!(out.status.code(), Some(64), "{pair:?}: {out:?}");
        assert!(
            text(&out.stderr).contains("exclude each other"),
            "{pair:?}: {out:?}"
        );
    }
}

/// An option from the environment never conflicts with one on the command
/// line: the command line wins. Two from the environment alone are refused,
/// naming their variables.
#[test]
fn the_command_line_wins_over_the_environment_without_a_conflict() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-envwins");
    let coord = Coordinator::builder(&url)
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let _held = exclusive_holder(&coord)
        .try_acquire(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    let with_env = |env: &[(&str, &str)], extra: &[&str], key: &str| {
        let events = events_path("envwins");
        let mut cmd = Cli::run(&url, &prefix)
            .args(extra)
            .events_file(&events)
            .key(key)
            .cmd(&["true"])
            .command();
        for (k, v) in env {
            cmd.env(k, v);
        }
        let started = Instant::now();
        let out = cmd.output().unwrap();
        let all = events_in(&events);
        let _ = std::fs::remove_file(&events);
        (out, started.elapsed(), all)
    };
    // -n on the line, a wait in the environment: one attempt.
    let (out, took, _) = with_env(&[("RESPIRE_LOCK_WAIT", "5m")], &["-n"], "job");
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    // --wait on the line, -n in the environment: the wait.
    let (out, took, _) = with_env(&[("RESPIRE_LOCK_NONBLOCK", "1")], &["-w", "300ms"], "job");
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert!(took >= Duration::from_millis(300), "{took:?}");
    // --max on the line, --shared in the environment: counted.
    let (out, _, all) = with_env(&[("RESPIRE_LOCK_SHARED", "1")], &["--max", "2"], "free");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(event(&all, "acquired")["mode"], "counted");
    // -x on the line, --max in the environment: exclusive.
    let (out, _, all) = with_env(&[("RESPIRE_LOCK_MAX", "2")], &["-x"], "free2");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(event(&all, "acquired")["mode"], "fenced");
    // Both from the environment: refused, naming the variables.
    let (out, _, _) = with_env(
        &[("RESPIRE_LOCK_SHARED", "1"), ("RESPIRE_LOCK_MAX", "2")],
        &[],
        "free",
    );
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("RESPIRE_LOCK_SHARED") && stderr.contains("RESPIRE_LOCK_MAX"),
        "{stderr}"
    );
}

/// `status` exits 0 when KEY is held, 1 when free, 69 when Redis cannot be
/// asked; with --json, stdout always holds one object, an error object too.
#[test]
fn status_exit_codes_tell_held_from_free_from_error() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-status-codes");
    let status = |url: &str, json: bool| {
        Cli::new("status")
            .url(url)
            .prefix(&prefix)
            .args(if json { &["--json"] } else { &[] })
            .key("job")
            .output()
    };
    let out = status(&url, false);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let out = status(&url, true);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(json_lines(&out.stdout)[0]["held"], false);
    let coord = Coordinator::builder(&url)
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let held = exclusive_holder(&coord)
        .try_acquire(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    let out = status(&url, false);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    drop(held);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nobody = format!("redis://user:secret@127.0.0.1:{port}");
    let out = status(&nobody, true);
    assert_eq!(out.status.code(), Some(69), "{out:?}");
    let json = json_lines(&out.stdout);
    assert_eq!(json.len(), 1, "{out:?}");
    assert_eq!(json[0]["key"], "job");
    assert_eq!(json[0]["exit_code"], 69);
    assert!(json[0]["error"].as_str().is_some_and(|e| !e.is_empty()));
    assert!(!text(&out.stdout).contains("secret") && !text(&out.stderr).contains("secret"));
    // A usage error too.
    let out = respire_lock(&["status", "--json", "job"]).output().unwrap();
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    assert_eq!(json_lines(&out.stdout)[0]["exit_code"], 64);
}

/// `doctor` takes its URL one way: URL and --url together are refused
/// (without showing either); either beats REDIS_URL.
#[test]
fn doctor_takes_its_url_one_way() {
    let url = shared_server().url();
    let out = run(&["doctor", "--url", &url, "redis://user:secret@127.0.0.1:1"]);
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    assert!(text(&out.stderr).contains("not both"), "{out:?}");
    assert!(!text(&out.stderr).contains("secret"));
    let out = respire_lock(&["doctor", "--json", &url])
        .env("REDIS_URL", "redis://127.0.0.1:1")
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(69), "{out:?}");
    assert_ne!(out.status.code(), Some(64), "{out:?}");
    assert!(json_lines(&out.stdout)[0]["findings"].is_array(), "{out:?}");
}

/// The `lost` event names the library's cause (its `LossCause` and detail,
/// heard through an observer), not a guess made by reading the keys after:
/// a deleted key is `gone`, a server that stops answering leaves the renewal
/// `renewal_unconfirmed`.
#[test]
fn a_lost_event_gives_the_librarys_cause() {
    let server = TestServer::start();
    let url = server.url();
    let lost_event = |key: &str, fault: &dyn Fn()| {
        let events = events_path("cause");
        let child = Cli::new("run")
            .url(&url)
            .short_lease()
            .kill_after("100ms")
            .events_file(&events)
            .key(key)
            .cmd(&["sleep", "30"])
            .command()
            .stderr(Stdio::piped())
            .spawn()
            .map(|c| KillOnDrop(Some(c)))
            .unwrap();
        started_pid(&events);
        fault();
        let out = child.into_inner().wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(76), "{}", text(&out.stderr));
        let lost = event(&events_in(&events), "lost").clone();
        std::fs::remove_file(&events).unwrap();
        lost
    };
    let lost = lost_event("deleted", &|| {
        let _: () = server.client().del("respire-lock:{deleted}:w").unwrap();
    });
    assert_eq!(lost["cause"], "gone", "{lost}");
    let lost = lost_event("paused", &|| {
        let _: () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(1500)
            .arg("ALL")
            .query(&mut server.client())
            .unwrap();
    });
    assert_eq!(lost["cause"], "renewal_unconfirmed", "{lost}");
    assert!(
        lost["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{lost}"
    );
}

/// `respire-lock man` prints manual pages made from the same clap
/// definitions as `--help`: the tool's and one per subcommand, each valid
/// roff (groff finds nothing to warn about, where it is installed).
#[test]
fn man_pages_come_from_the_command_line_definitions() {
    for page in [
        "",
        "run",
        "status",
        "elect",
        "leader",
        "doctor",
        "completions",
        "man",
    ] {
        let args: Vec<&str> = ["man", page]
            .into_iter()
            .filter(|a| !a.is_empty())
            .collect();
        let out = run(&args);
        assert_eq!(out.status.code(), Some(0), "{page}: {}", text(&out.stderr));
        let roff = text(&out.stdout);
        let title = if page.is_empty() {
            "respire-lock".to_owned()
        } else {
            format!("respire-lock-{page}")
        };
        assert!(roff.contains(&format!(".TH {title} 1 ")), "{page}: {roff}");
        if let Ok(mut groff) = Command::new("groff")
            .args(["-man", "-Tascii", "-ww", "-z"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
        {
            use std::io::Write as _;
            groff
                .stdin
                .take()
                .unwrap()
                .write_all(roff.as_bytes())
                .unwrap();
            let checked = groff.wait_with_output().unwrap();
            assert!(
                checked.stderr.is_empty(),
                "{page}: {}",
                text(&checked.stderr)
            );
        }
    }
    let run_page = text(&run(&["man", "run"]).stdout);
    for said in [
        "RESPIRE_LOCK_KILL_AFTER",
        "\\-\\-conflict\\-exit\\-code",
        "DETAILS",
        "Exit status",
    ] {
        assert!(run_page.contains(said), "{said}: {run_page}");
    }
    let out = run(&["man", "frobnicate"]);
    assert_eq!(out.status.code(), Some(64));
}

/// The README says how to install, the MSRV `Cargo.toml` declares, the
/// minimum server `doctor` checks, where the reliability figures are, and
/// every variable the tool reads.
#[test]
fn the_readme_states_install_msrv_minimum_server_and_every_variable() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let msrv = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .unwrap()
        .trim_matches('"');
    let doctor_help = text(&run(&["doctor", "--help"]).stdout);
    assert!(doctor_help.contains("Redis 7.0 or later"), "{doctor_help}");
    for said in [
        "cargo add respire-coordination",
        "cargo install respire-coordination --features cli",
        &format!("Rust {msrv} or later"),
        "Redis 7.0 or later",
        "valkey_version",
        "(RELIABILITY.md)",
        "respire-lock man",
    ] {
        assert!(readme.contains(said), "the README does not say {said:?}");
    }
    for var in ENV_VARS {
        assert!(readme.contains(var), "the README does not name {var}");
    }
}

/// The other side of the switch: a run that renews its lease in time is
/// never stopped by its guardian, even with the shortest TTL its node
/// timeout allows (the guardian hears every new deadline as the renewal
/// that moved it is confirmed).
#[test]
fn a_run_that_keeps_its_lease_is_never_stopped_by_its_guardian() {
    let server = TestServer::start();
    let events = events_path("healthy");
    let out = Cli::new("run")
        .url(&server.url())
        .ttl("450ms")
        .node_timeout("100ms")
        .events_file(&events)
        .key("job")
        .cmd(&["sleep", "3"])
        .output();
    let all = events_in(&events);
    std::fs::remove_file(&events).unwrap();
    assert_eq!(out.status.code(), Some(0), "{}: {all:?}", text(&out.stderr));
    assert!(all.iter().all(|e| e["event"] != "lost"), "{all:?}");
    assert_eq!(event(&all, "exited")["code"], 0);
}

/// The guardians among the children of process `parent` (this binary run
/// with its internal guardian argument).
fn guardians_of(parent: u32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let (_, rest) = stat.rsplit_once(')')?;
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let alive = fields.first().is_some_and(|s| *s != "Z" && *s != "X");
            let ppid: u32 = fields.get(1)?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let guard = cmdline
                .split(|b| *b == 0)
                .any(|arg| arg == b"--respire-lock-internal-guard");
            (alive && ppid == parent && guard).then_some(pid)
        })
        .collect()
}

/// A guardian that dies (kill -9) is replaced, told the command's deadline:
/// the tool stopped after that still cannot keep its command past the lease.
#[test]
fn a_killed_guardian_is_replaced_and_still_stops_the_command() {
    let server = TestServer::start();
    let events = events_path("guardian-killed");
    let tool = KillOnDrop(Some(inside_until_signalled(
        &["--url", &server.url(), "--ttl", "3s", "--kill-after", "1s"],
        &events,
    )));
    let command = started_pid(&events);
    let first = guardians_of(tool.id());
    assert_eq!(first.len(), 1, "{first:?}");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(first[0]).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    wait_until(Duration::from_secs(5), "a new guardian", || {
        let now = guardians_of(tool.id());
        now.len() == 1 && now[0] != first[0]
    });
    assert!(group_alive(command), "the command died with its guardian");
    signal(&tool, rustix::process::Signal::STOP);
    wait_until(
        Duration::from_secs(8),
        "the new guardian to stop the command",
        || !group_alive(command),
    );
    signal(&tool, rustix::process::Signal::CONT);
    let out = tool.into_inner().wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(76));
    std::fs::remove_file(&events).unwrap();
}

/// `status --lease` reads a lease a program made with the library on keys
/// of its own choosing: a `FencedLock` as the crate's docs make one (with
/// `--fence`, the last token issued) and a plain `Lock`.
#[test]
fn status_reads_a_lease_the_library_made_on_any_keys() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-lease");
    let coord = Coordinator::builder(&url)
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let (lease, fence) = ("{reports:daily}:lease", "{reports:daily}:fence");
    let status = |extra: &[&str]| {
        Cli::new("status")
            .url(&url)
            .prefix(&prefix)
            .args(extra)
            .output()
    };
    let out = status(&["--lease", lease, "--fence", fence]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let guard = coord
        .fenced_lock(lease, fence)
        .unwrap()
        .try_acquire(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    let out = status(&["--json", "--lease", lease, "--fence", fence]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let json = &json_lines(&out.stdout)[0];
    assert_eq!(json["key"], lease);
    assert_eq!(json["mode"], "exclusive");
    assert_eq!(json["token"], guard.fencing_token().get());
    assert_eq!(json["last_token"], guard.fencing_token().get());
    let out = status(&["--lease", lease]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(
        text(&out.stdout).starts_with(&format!(
            "{lease}: held exclusive by fencing token {}",
            guard.fencing_token()
        )),
        "{out:?}"
    );
    drop(guard);
    let _plain = coord
        .lock("nightly")
        .unwrap()
        .try_acquire(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    let out = status(&["--lease", "nightly"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(
        text(&out.stdout).contains("without a fencing token"),
        "{out:?}"
    );
    // KEY and --lease together, or --fence without --lease: refused.
    let out = status(&["--lease", lease, "job"]);
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    let out = status(&["--fence", fence, "job"]);
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    // KEY on the command line beats --lease from the environment.
    let out = Cli::new("status")
        .url(&url)
        .prefix(&prefix)
        .key("job")
        .command()
        .env("RESPIRE_LOCK_LEASE_KEY", "nightly")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(text(&out.stdout).starts_with("job: free"), "{out:?}");
}

#[test]
fn doctor_reports_whether_a_primary_refuses_writes_without_its_replicas() {
    let primary = TestServer::start();
    let (_link, _replica) = support::proxied_replica(&primary);
    let report = text(&run(&["doctor", &primary.url()]).stdout);
    assert!(report.contains("min-replicas-to-write 0"), "{report}");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("min-replicas-to-write")
        .arg(1)
        .arg("min-replicas-max-lag")
        .arg(5)
        .query(&mut primary.client())
        .unwrap();
    let report = text(&run(&["doctor", &primary.url()]).stdout);
    assert!(
        report.contains("min-replicas-to-write 1 with min-replicas-max-lag 5"),
        "{report}"
    );
}
