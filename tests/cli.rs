//! The `respire-lock` command-line tool, run as a real process against real
//! servers.

mod support;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::Coordinator;
use support::{TestServer, shared_server, unique_prefix, wait_until};

const BIN: &str = env!("CARGO_BIN_EXE_respire-lock");

fn respire_lock(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env_remove("REDIS_URL");
    cmd
}

fn run(args: &[&str]) -> Output {
    respire_lock(args).output().expect("respire-lock runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn runs_the_command_with_its_token_and_returns_its_status() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-run");
    let out = run(&[
        "run",
        "--url",
        &url,
        "--prefix",
        &prefix,
        "--ttl",
        "5s",
        "job",
        "--",
        "sh",
        "-c",
        "echo token=$RESPIRE_FENCING_TOKEN key=$RESPIRE_LOCK_KEY; exit 7",
    ]);
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).trim(),
        format!("token=1 key={prefix}{{job}}:lease")
    );
    let out = run(&[
        "run",
        "--url",
        &url,
        "--prefix",
        &prefix,
        "--ttl",
        "5s",
        "job",
        "--",
        "sh",
        "-c",
        "echo $RESPIRE_FENCING_TOKEN",
    ]);
    assert!(out.status.success());
    assert_eq!(text(&out.stdout).trim(), "2");
    // Released after the command: nothing left but the counter.
    let keys: Vec<String> = shared_server().client().keys(format!("{prefix}*")).unwrap();
    assert_eq!(keys, [format!("{prefix}{{job}}:fence")]);
}

#[test]
fn a_held_lease_means_not_acquired() {
    let url = shared_server().url();
    let prefix = unique_prefix("cli-held");
    let coord = Coordinator::builder(&url)
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let lock = coord.fenced_lock("{job}:lease", "{job}:fence").unwrap();
    let held = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();

    let out = run(&[
        "run", "--url", &url, "--prefix", &prefix, "--wait", "0", "job", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("not acquired"));

    let started = Instant::now();
    let out = run(&[
        "run", "--url", &url, "--prefix", &prefix, "--wait", "300ms", "job", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(75));
    assert!(started.elapsed() >= Duration::from_millis(300));

    // A waiting run starts as soon as the holder releases.
    let mut waiting = respire_lock(&[
        "run",
        "--url",
        &url,
        "--prefix",
        &prefix,
        "--wait",
        "20s",
        "job",
        "--",
        "sh",
        "-c",
        "echo $RESPIRE_FENCING_TOKEN",
    ])
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        waiting.try_wait().unwrap().is_none(),
        "it should still be waiting"
    );
    drop(held);
    let out = waiting.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(text(&out.stdout).trim(), "2");
}

#[test]
fn a_lost_lease_stops_the_command() {
    let server = TestServer::start();
    let started = Instant::now();
    let child = respire_lock(&[
        "run",
        "--url",
        &server.url(),
        "--ttl",
        "1s",
        "--node-timeout",
        "100ms",
        "--kill-after",
        "5s",
        "job",
        "--",
        "sleep",
        "30",
    ])
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut admin = server.client();
    wait_until(Duration::from_secs(10), "the lease to be taken", || {
        admin.exists::<_, bool>("respire-lock:{job}:lease").unwrap()
    });
    // Someone else takes the key over (as after an expiry).
    let _: () = admin.set("respire-lock:{job}:lease", "intruder").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(76), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("lost"));
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "sleep 30 was not stopped"
    );
    let value: String = admin.get("respire-lock:{job}:lease").unwrap();
    assert_eq!(value, "intruder", "the new holder's key was touched");
}

#[test]
fn sigterm_stops_the_command_and_releases() {
    let server = TestServer::start();
    let child = respire_lock(&["run", "--url", &server.url(), "job", "--", "sleep", "30"])
        .spawn()
        .unwrap();
    let mut admin = server.client();
    wait_until(Duration::from_secs(10), "the lease to be taken", || {
        admin.exists::<_, bool>("respire-lock:{job}:lease").unwrap()
    });
    let started = Instant::now();
    let pid = rustix::process::Pid::from_child(&child);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let out = child.wait_with_output().unwrap();
    // sleep died of the forwarded SIGTERM: 128 + 15.
    assert_eq!(out.status.code(), Some(143));
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(!admin.exists::<_, bool>("respire-lock:{job}:lease").unwrap());
}

#[test]
fn without_a_url_it_starts_a_throwaway_server() {
    let out = run(&[
        "run",
        "job",
        "--",
        "sh",
        "-c",
        "echo $RESPIRE_FENCING_TOKEN",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "1");
    assert!(text(&out.stderr).contains("throwaway"));
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
    let out = run(&[
        "run",
        "--url",
        &format!("redis://127.0.0.1:{port}"),
        "job",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stderr));
    let out = run(&[
        "run",
        "--url",
        &shared_server().url(),
        "--prefix",
        &unique_prefix("cli-norun"),
        "job",
        "--",
        "/nonexistent/cmd",
    ]);
    assert_eq!(out.status.code(), Some(70), "{}", text(&out.stderr));
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
        .acl_user("user app on >pw ~* &* +@all -client|kill -client|tracking")
        .arg("--maxmemory-policy")
        .arg("allkeys-lru")
        .start();
    let out = run(&["doctor", &evicting.url_for_user("app", "pw")]);
    let report = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(report.contains("FAIL  eviction: allkeys-lru"), "{report}");
    assert!(report.contains("FAIL  acl: CLIENT KILL denied"), "{report}");
    assert!(
        report.contains("FAIL  acl: CLIENT TRACKING denied"),
        "{report}"
    );
}

#[test]
fn redlock_mode_takes_a_quorum_and_releases_it() {
    let servers: Vec<TestServer> = (0..3).map(|_| TestServer::start()).collect();
    let urls: Vec<String> = servers.iter().map(TestServer::url).collect();
    let joined = urls.join(",");
    let child = respire_lock(&[
        "run",
        "--redlock",
        &joined,
        "--ttl",
        "5s",
        "job",
        "--",
        "sh",
        "-c",
        "echo key=$RESPIRE_LOCK_KEY token=${RESPIRE_FENCING_TOKEN:-none}; sleep 1",
    ])
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut admins: Vec<redis::Connection> = servers.iter().map(TestServer::client).collect();
    wait_until(Duration::from_secs(10), "the lock on every node", || {
        admins
            .iter_mut()
            .all(|a| a.exists::<_, bool>("respire-lock:job").unwrap())
    });
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(text(&out.stdout).trim(), "key=respire-lock:job token=none");
    for admin in &mut admins {
        assert!(!admin.exists::<_, bool>("respire-lock:job").unwrap());
    }

    // An even group is refused as a usage error.
    let two = urls[..2].join(",");
    let out = run(&["run", "--redlock", &two, "job", "--", "true"]);
    assert_eq!(out.status.code(), Some(64), "{}", text(&out.stderr));
}
