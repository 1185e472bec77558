//! Checks that the harness in `tests/support` really starts, breaks and cleans
//! up servers, and that the fault proxy does what each mode promises.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use support::{
    FaultProxy, Mode, TestServer, TlsAuthClients, shared_server, unique_prefix, wait_until,
};

/// Set in a copy of this test binary started by a test below, naming what the
/// copy should do.
const CHILD_ENV: &str = "RESPIRE_SUPPORT_SELFTEST_CHILD";

fn ping(con: &mut redis::Connection) -> redis::RedisResult<String> {
    redis::cmd("PING").query(con)
}

fn connect(url: &str) -> redis::Connection {
    redis::Client::open(url)
        .and_then(|client| client.get_connection_with_timeout(Duration::from_secs(5)))
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// Sends an inline `PING` on a raw socket and returns the first reply line,
/// or `None` if nothing comes within `timeout`.
fn raw_ping(stream: &mut TcpStream, timeout: Duration) -> Option<String> {
    stream.set_read_timeout(Some(timeout)).unwrap();
    stream.write_all(b"PING\r\n").unwrap();
    let mut line = String::new();
    match BufReader::new(stream).read_line(&mut line) {
        Ok(_) => Some(line),
        Err(_) => None,
    }
}

/// Whether `pid` has exited (gone, or a zombie nobody has reaped yet).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .unwrap()
            .trim_start()
            .starts_with('Z'),
        Err(_) => true,
    }
}

/// Runs `test` alone in a copy of this binary with [`CHILD_ENV`] set to `role`.
fn run_child(test: &str, role: &str) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, role)
        .output()
        .unwrap()
}

/// The value after `name=` up to the end of its line in `text`.
fn reported<'a>(text: &'a str, name: &str) -> &'a str {
    let marker = format!("{name}=");
    text.lines()
        .find_map(|line| Some(&line[line.find(&marker)? + marker.len()..]))
        .unwrap_or_else(|| panic!("no {marker} in:\n{text}"))
}

#[test]
fn server_starts_and_answers_ping() {
    let server = TestServer::start();
    let mut con = server.client();
    assert_eq!(ping(&mut con).unwrap(), "PONG");
    assert!(server.is_running());
    assert_eq!(server.addr().port(), server.port());
    assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
    assert!(server.log().contains("Ready to accept connections"));
    let (save, appendonly): (Vec<String>, Vec<String>) = (
        redis::cmd("CONFIG")
            .arg("GET")
            .arg("save")
            .query(&mut con)
            .unwrap(),
        redis::cmd("CONFIG")
            .arg("GET")
            .arg("appendonly")
            .query(&mut con)
            .unwrap(),
    );
    assert_eq!(save, ["save", ""]);
    assert_eq!(appendonly, ["appendonly", "no"]);
    let pid: u32 = redis::cmd("INFO")
        .arg("server")
        .query::<String>(&mut con)
        .unwrap()
        .lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(pid, server.pid());
    // DEBUG is enabled for tests that need DEBUG SLEEP and friends.
    let () = redis::cmd("DEBUG")
        .arg("SLEEP")
        .arg(0)
        .query(&mut con)
        .unwrap();
}

#[test]
fn shared_server_is_one_server_and_prefixes_are_unique() {
    let server = shared_server();
    assert_eq!(server.port(), shared_server().port());
    let (a, b) = (unique_prefix("shared"), unique_prefix("shared"));
    assert_ne!(a, b);
    assert!(a.starts_with("t:shared:"));
    let mut con = server.client();
    let () = redis::cmd("SET")
        .arg(format!("{a}k"))
        .arg("a")
        .query(&mut con)
        .unwrap();
    let missing: Option<String> = redis::cmd("GET")
        .arg(format!("{b}k"))
        .query(&mut con)
        .unwrap();
    assert_eq!(missing, None);
}

#[test]
fn extra_args_reach_the_server() {
    let server = TestServer::builder().args(["--hz", "100"]).start();
    let hz: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("hz")
        .query(&mut server.client())
        .unwrap();
    assert_eq!(hz, ["hz", "100"]);
}

#[test]
fn append_only_server_keeps_writes_across_kill_and_restart() {
    let server = TestServer::builder().append_only().start();
    let mut con = server.client();
    let fsync: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("appendfsync")
        .query(&mut con)
        .unwrap();
    assert_eq!(fsync, ["appendfsync", "always"]);
    let () = redis::cmd("SET")
        .arg("fence")
        .arg(41)
        .query(&mut con)
        .unwrap();
    let old_pid = server.pid();

    server.kill();
    assert!(!server.is_running());
    assert!(ping(&mut con).is_err());
    assert!(TcpStream::connect(server.addr()).is_err());

    server.restart();
    assert!(server.is_running());
    assert_ne!(server.pid(), old_pid);
    let value: Option<i64> = redis::cmd("GET")
        .arg("fence")
        .query(&mut server.client())
        .unwrap();
    assert_eq!(value, Some(41));
}

#[test]
fn restart_without_append_only_loses_everything() {
    let server = TestServer::start();
    let () = redis::cmd("SET")
        .arg("fence")
        .arg(41)
        .query(&mut server.client())
        .unwrap();
    server.restart();
    let value: Option<i64> = redis::cmd("GET")
        .arg("fence")
        .query(&mut server.client())
        .unwrap();
    assert_eq!(value, None);
}

#[test]
fn pause_stops_replies_until_resume() {
    let server = TestServer::start();
    let mut con = server.client();
    con.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    assert_eq!(ping(&mut con).unwrap(), "PONG");

    server.pause();
    assert!(server.is_paused() && server.is_running());
    let started = Instant::now();
    let err = ping(&mut con).unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert!(started.elapsed() >= Duration::from_millis(200));
    // The kernel still accepts connections for a stopped server.
    let mut raw = TcpStream::connect(server.addr()).unwrap();
    assert_eq!(raw_ping(&mut raw, Duration::from_millis(200)), None);

    server.resume();
    assert!(!server.is_paused());
    // The timed-out connection may still receive the late reply; use a new one.
    assert_eq!(ping(&mut server.client()).unwrap(), "PONG");
}

#[test]
fn drop_kills_the_server_and_removes_its_directory() {
    let server = TestServer::builder().append_only().start();
    server.pause();
    let (pid, dir) = (server.pid(), server.dir().to_owned());
    assert!(dir.join("redis.log").exists());
    drop(server);
    assert!(!Path::new(&format!("/proc/{pid}")).exists());
    assert!(!dir.exists());
}

#[test]
fn requirepass_is_required_and_in_the_url() {
    let server = TestServer::builder().requirepass("s3 cret").start();
    assert_eq!(
        server.url(),
        format!("redis://:s3%20cret@127.0.0.1:{}", server.port())
    );
    let mut raw = TcpStream::connect(server.addr()).unwrap();
    let reply = raw_ping(&mut raw, Duration::from_secs(5)).unwrap();
    assert!(reply.starts_with("-NOAUTH"), "{reply}");
    assert_eq!(ping(&mut server.client()).unwrap(), "PONG");
}

#[test]
fn acl_user_is_refused_a_forbidden_command() {
    let server = TestServer::builder()
        .requirepass("admin")
        .acl_user("user app on >pw ~* &* +@all -client|kill")
        .acl_user("reader on >pw ~* +@read")
        .start();
    let mut app = connect(&server.url_for_user("app", "pw"));
    let whoami: String = redis::cmd("ACL").arg("WHOAMI").query(&mut app).unwrap();
    assert_eq!(whoami, "app");
    let () = redis::cmd("SET").arg("k").arg("v").query(&mut app).unwrap();
    let err = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(1_000_000)
        .query::<()>(&mut app)
        .unwrap_err();
    assert_eq!(err.code(), Some("NOPERM"), "{err:?}");

    let mut reader = connect(&server.url_for_user("reader", "pw"));
    let value: String = redis::cmd("GET").arg("k").query(&mut reader).unwrap();
    assert_eq!(value, "v");
    let err = redis::cmd("DEL")
        .arg("k")
        .query::<i64>(&mut reader)
        .unwrap_err();
    assert_eq!(err.code(), Some("NOPERM"), "{err:?}");

    // The default user keeps every right, behind the password.
    let mut raw = TcpStream::connect(server.addr()).unwrap();
    let reply = raw_ping(&mut raw, Duration::from_secs(5)).unwrap();
    assert!(reply.starts_with("-NOAUTH"), "{reply}");
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("USER")
        .arg("reader")
        .query(&mut server.client())
        .unwrap();
    assert_eq!(killed, 1);
}

#[test]
fn tls_server_serves_only_tls_with_generated_certificates() {
    let server = TestServer::builder().tls(TlsAuthClients::Yes).start();
    assert_eq!(
        server.url(),
        format!("rediss://127.0.0.1:{}", server.port())
    );
    let files = server.tls().unwrap();
    let verify = Command::new("openssl")
        .arg("verify")
        .arg("-CAfile")
        .arg(&files.ca_cert)
        .arg(&files.server_cert)
        .arg(&files.client_cert)
        .output()
        .unwrap();
    assert!(verify.status.success(), "{verify:?}");
    assert!(
        files
            .client_key_pem()
            .starts_with(b"-----BEGIN PRIVATE KEY-----")
    );
    // A plain client gets no reply: the server wanted a TLS handshake.
    let mut raw = TcpStream::connect(server.addr()).unwrap();
    let reply = raw_ping(&mut raw, Duration::from_secs(5));
    assert!(
        !reply.is_some_and(|line| line.starts_with('+')),
        "a plain reply"
    );
}

#[cfg(feature = "tls")]
#[test]
fn tls_server_accepts_the_client_certificate() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server = TestServer::builder().tls(TlsAuthClients::Yes).start();
    let mut con = server.client();
    assert_eq!(ping(&mut con).unwrap(), "PONG");
    let files = server.tls().unwrap();

    let without_cert = redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(files.ca_cert_pem()),
    };
    let refused = redis::Client::build_with_tls(server.url(), without_cert)
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(5))
        .and_then(|mut con| ping(&mut con));
    assert!(refused.is_err(), "{refused:?}");

    let optional = TestServer::builder().tls(TlsAuthClients::Optional).start();
    let without_cert = redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(optional.tls().unwrap().ca_cert_pem()),
    };
    let mut anonymous = redis::Client::build_with_tls(optional.url(), without_cert)
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(5))
        .unwrap();
    assert_eq!(ping(&mut anonymous).unwrap(), "PONG");
}

#[test]
fn proxy_pass_forwards_both_ways() {
    let server = shared_server();
    let proxy = FaultProxy::start(server.addr());
    assert_eq!(proxy.upstream(), server.addr());
    assert_eq!(proxy.connection_count(), 0);
    let mut con = connect(&proxy.url());
    let key = format!("{}k", unique_prefix("proxy_pass"));
    let () = redis::cmd("SET")
        .arg(&key)
        .arg("v")
        .query(&mut con)
        .unwrap();
    let value: String = redis::cmd("GET")
        .arg(&key)
        .query(&mut server.client())
        .unwrap();
    assert_eq!(value, "v");
    assert_eq!(proxy.connection_count(), 1);
    drop(con);
    wait_until(
        Duration::from_secs(5),
        "the proxied connection to close",
        || proxy.connection_count() == 0,
    );
}

#[test]
fn proxy_admits_only_the_connections_it_was_told_to() {
    let proxy = FaultProxy::start(shared_server().addr());
    let reply = |s: &mut TcpStream| raw_ping(s, Duration::from_millis(300));
    // Served (answered) before the limit is set.
    let mut open = TcpStream::connect(proxy.addr()).unwrap();
    assert_eq!(reply(&mut open).as_deref(), Some("+PONG\r\n"));
    proxy.admit_only(1);
    let mut admitted = TcpStream::connect(proxy.addr()).unwrap();
    assert_eq!(reply(&mut admitted).as_deref(), Some("+PONG\r\n"));
    let mut held = TcpStream::connect(proxy.addr()).unwrap();
    assert_eq!(
        reply(&mut held),
        None,
        "a connection past the limit is held"
    );
    assert_eq!(proxy.turned_away(), 1);
    // Connections open before the limit are not affected.
    assert_eq!(reply(&mut open).as_deref(), Some("+PONG\r\n"));
}

/// A proxy that has served many connections keeps no handle of their
/// finished threads: an unjoined finished thread keeps its stack mapped, and
/// thousands of them leave no mapping for a new thread.
#[test]
fn proxy_lets_go_of_the_threads_of_closed_connections() {
    let proxy = FaultProxy::start(shared_server().addr());
    let serve_one = || {
        let mut stream = TcpStream::connect(proxy.addr()).unwrap();
        let reply = raw_ping(&mut stream, Duration::from_secs(5));
        assert_eq!(reply.as_deref(), Some("+PONG\r\n"));
    };
    for _ in 0..200 {
        serve_one();
    }
    // The threads of closed connections finish on their own; each new
    // connection lets go of those that have.
    wait_until(
        Duration::from_secs(30),
        "the proxy to keep only the threads of open connections",
        || {
            serve_one();
            proxy.kept_threads() <= 4 * (proxy.connection_count() + 1)
        },
    );
}

#[test]
fn proxy_delay_delays_each_direction_without_limiting_throughput() {
    // A server of its own: its count of PINGs is this test's.
    let server = TestServer::start();
    let pings = || server.command_calls("ping");
    let proxy = FaultProxy::start(server.addr());
    let mut con = connect(&proxy.url());
    let delay = Duration::from_millis(500);
    proxy.set_mode(Mode::Delay(delay));
    assert_eq!(proxy.mode(), Mode::Delay(delay));

    // Nothing has arrived on `stream` yet (it is left blocking, with a read
    // timeout, as it was).
    let nothing_to_read = |stream: &TcpStream| {
        stream.set_nonblocking(true).unwrap();
        let peeked = stream.peek(&mut [0; 1]);
        stream.set_nonblocking(false).unwrap();
        matches!(peeked, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    };

    // A new connection through the proxy, and the replies to `n` PINGs on it.
    let connect_raw = || {
        let stream = TcpStream::connect(proxy.addr()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        stream
    };
    let read_pongs = |mut stream: &TcpStream, n: usize| {
        let mut replies = vec![0; 7 * n];
        stream.read_exact(&mut replies).unwrap();
        assert_eq!(replies, "+PONG\r\n".repeat(n).as_bytes());
    };

    // One command, each way in turn: held in the proxy while the server has
    // not run it, then run while its reply is held.
    let mut raw = connect_raw();
    let (chunks, before) = (proxy.client_chunks(), pings());
    raw.write_all(b"PING\r\n").unwrap();
    wait_until(Duration::from_secs(5), "the PING in the proxy", || {
        proxy.client_chunks() > chunks
    });
    assert_eq!(
        pings(),
        before,
        "the server ran it before its delay was out"
    );
    assert!(proxy.client_chunks_done() < proxy.client_chunks());
    wait_until(Duration::from_secs(5), "the server to run the PING", || {
        pings() > before
    });
    assert!(
        nothing_to_read(&raw),
        "the reply came back before its delay was out"
    );
    read_pongs(&raw, 1);

    // Ten commands written 5 ms apart are all in flight together: the server
    // runs the tenth before the first reply is back (one at a time, the
    // tenth would leave the proxy after ten delays).
    let mut raw = connect_raw();
    let before = pings();
    for _ in 0..10 {
        raw.write_all(b"PING\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    wait_until(Duration::from_secs(5), "the server to run all ten", || {
        pings() >= before + 10
    });
    assert!(
        nothing_to_read(&raw),
        "a reply came back before the server had run all ten"
    );
    read_pongs(&raw, 10);

    // Back to Pass: a new command goes through at once, while one sent just
    // before is still waiting out its delay (it leaves at its original time).
    let mut held = connect_raw();
    let chunks = proxy.client_chunks();
    held.write_all(b"PING\r\n").unwrap();
    wait_until(Duration::from_secs(5), "the PING in the proxy", || {
        proxy.client_chunks() > chunks
    });
    proxy.set_mode(Mode::Pass);
    // On a connection opened before the switch.
    assert_eq!(ping(&mut con).unwrap(), "PONG");
    wait_until(
        Duration::from_secs(5),
        "all but the delayed PING to leave the proxy",
        || proxy.client_chunks_done() + 1 == proxy.client_chunks(),
    );
    assert!(
        nothing_to_read(&held),
        "the delayed PING left the proxy at the switch, not at its time"
    );
    read_pongs(&held, 1);
}

#[test]
fn proxy_blackhole_forwards_nothing_until_pass() {
    let proxy = FaultProxy::start(shared_server().addr());
    let mut con = connect(&proxy.url());
    con.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    assert_eq!(ping(&mut con).unwrap(), "PONG");

    proxy.set_mode(Mode::Blackhole);
    let started = Instant::now();
    let err = ping(&mut con).unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert!(started.elapsed() >= Duration::from_millis(200));
    // New connections are accepted and held, but get nothing.
    let mut raw = TcpStream::connect(proxy.addr()).unwrap();
    assert_eq!(raw_ping(&mut raw, Duration::from_millis(200)), None);
    wait_until(Duration::from_secs(5), "two held connections", || {
        proxy.connection_count() == 2
    });

    proxy.set_mode(Mode::Pass);
    assert_eq!(ping(&mut connect(&proxy.url())).unwrap(), "PONG");
}

#[test]
fn proxy_blackhole_holds_connections_when_upstream_is_down() {
    let server = TestServer::start();
    let proxy = FaultProxy::start(server.addr());
    server.kill();
    // Without a server the proxy closes new connections at once...
    let mut refused = TcpStream::connect(proxy.addr()).unwrap();
    let started = Instant::now();
    let reply = raw_ping(&mut refused, Duration::from_secs(5));
    assert!(matches!(reply.as_deref(), None | Some("")), "{reply:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(proxy.connection_count(), 0);

    // ...except in blackhole mode, which holds them.

    proxy.set_mode(Mode::Blackhole);
    let mut held = TcpStream::connect(proxy.addr()).unwrap();
    assert_eq!(raw_ping(&mut held, Duration::from_millis(200)), None);
    assert_eq!(proxy.connection_count(), 1);
}

#[test]
fn proxy_drop_client_to_server_loses_commands() {
    let server = shared_server();
    let proxy = FaultProxy::start(server.addr());
    let mut con = connect(&proxy.url());
    con.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let key = format!("{}k", unique_prefix("drop_c2s"));

    proxy.set_mode(Mode::DropClientToServer);
    let err = redis::cmd("SET")
        .arg(&key)
        .arg("v")
        .query::<()>(&mut con)
        .unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    let exists: bool = redis::cmd("EXISTS")
        .arg(&key)
        .query(&mut server.client())
        .unwrap();
    assert!(!exists, "the command reached the server");
}

#[test]
fn proxy_holds_one_connection_and_counts_what_it_holds_apart() {
    let server = shared_server();
    let proxy = FaultProxy::start(server.addr());
    let prefix = unique_prefix("hold_one");
    // Two connections through the proxy, told apart on the server by name.
    let open = |name: &str| {
        let mut con = connect(&proxy.url());
        let () = redis::cmd("CLIENT")
            .arg("SETNAME")
            .arg(format!("{prefix}{name}"))
            .query(&mut con)
            .unwrap();
        con
    };
    let (held, mut other) = (open("held"), open("other"));
    let port_of = |name: &str| -> u16 {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(&mut server.client())
            .unwrap();
        let line = list
            .lines()
            .find(|l| l.contains(&format!(" name={prefix}{name} ")))
            .expect("the connection is listed");
        let addr = line
            .split(' ')
            .find_map(|f| f.strip_prefix("addr="))
            .unwrap();
        addr.rsplit(':').next().unwrap().parse().unwrap()
    };
    let (held_port, other_port) = (port_of("held"), port_of("other"));
    assert_eq!(proxy.client_chunks_held_from(held_port), Some(0));
    assert_eq!(proxy.client_chunks_held_from(1), None, "no such connection");
    assert!(proxy.set_connection_mode(held_port, Some(Mode::HoldClientToServer)));
    assert!(!proxy.set_connection_mode(1, Some(Mode::Pass)));

    let key = format!("{prefix}k");
    let mut held = held;
    let set = std::thread::spawn(move || {
        let r = redis::cmd("SET").arg(&key).arg("v").query::<()>(&mut held);
        (r, held)
    });
    wait_until(Duration::from_secs(5), "the SET to be held", || {
        proxy.client_chunks_held_from(held_port) == Some(1)
    });
    // The other connection passes, and its bytes are not counted as held.
    assert_eq!(ping(&mut other).unwrap(), "PONG");
    assert_eq!(proxy.client_chunks_held_from(other_port), Some(0));
    let exists = |key: &str| -> bool {
        redis::cmd("EXISTS")
            .arg(key)
            .query(&mut server.client())
            .unwrap()
    };
    assert!(!exists(&format!("{prefix}k")), "the held SET ran");

    assert!(proxy.set_connection_mode(held_port, None));
    let (r, _held) = set.join().unwrap();
    r.unwrap();
    assert!(exists(&format!("{prefix}k")));
    assert_eq!(proxy.client_chunks_held_from(held_port), Some(0));
}

#[test]
fn proxy_drop_server_to_client_loses_replies() {
    let server = shared_server();
    let proxy = FaultProxy::start(server.addr());
    let mut con = connect(&proxy.url());
    con.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let key = format!("{}k", unique_prefix("drop_s2c"));

    proxy.set_mode(Mode::DropServerToClient);
    let err = redis::cmd("SET")
        .arg(&key)
        .arg("v")
        .query::<()>(&mut con)
        .unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    let mut admin = server.client();
    wait_until(
        Duration::from_secs(5),
        "the command to reach the server",
        || redis::cmd("EXISTS").arg(&key).query(&mut admin).unwrap(),
    );
}

#[test]
fn proxy_reset_all_drops_current_connections() {
    let proxy = FaultProxy::start(shared_server().addr());
    let mut con = connect(&proxy.url());
    con.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(ping(&mut con).unwrap(), "PONG");
    let mut raw = TcpStream::connect(proxy.addr()).unwrap();
    assert_eq!(
        raw_ping(&mut raw, Duration::from_secs(5)).unwrap(),
        "+PONG\r\n"
    );

    proxy.reset_all();
    let err = ping(&mut con).unwrap_err();
    assert!(!err.is_timeout(), "{err:?}");
    let mut buf = [0; 1];
    let reset = raw.read(&mut buf).unwrap_err();
    assert_eq!(reset.kind(), std::io::ErrorKind::ConnectionReset);
    wait_until(Duration::from_secs(5), "no open connections", || {
        proxy.connection_count() == 0
    });
    assert_eq!(ping(&mut connect(&proxy.url())).unwrap(), "PONG");
}

#[test]
fn dropping_the_proxy_closes_its_connections() {
    let proxy = FaultProxy::start(shared_server().addr());
    proxy.set_mode(Mode::Delay(Duration::from_millis(30)));
    let mut raw = TcpStream::connect(proxy.addr()).unwrap();
    assert_eq!(
        raw_ping(&mut raw, Duration::from_secs(5)).unwrap(),
        "+PONG\r\n"
    );
    drop(proxy);
    let mut buf = [0; 1];
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(matches!(raw.read(&mut buf), Ok(0) | Err(_)));
}

#[test]
#[should_panic(expected = "timed out after 50ms waiting for the impossible")]
fn wait_until_panics_at_the_deadline() {
    wait_until(Duration::from_millis(50), "the impossible", || false);
}

#[test]
fn watchdog_kills_the_server_when_the_test_process_exits() {
    const TEST: &str = "watchdog_kills_the_server_when_the_test_process_exits";
    if std::env::var(CHILD_ENV).as_deref() == Ok("exit") {
        // The shared server is never dropped: only the watchdog can end it.
        let server = shared_server();
        println!("pid={}", server.pid());
        println!("dir={}", server.dir().display());
        return;
    }
    let output = run_child(TEST, "exit");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    let pid: u32 = reported(&stdout, "pid").parse().unwrap();
    let dir = PathBuf::from(reported(&stdout, "dir"));
    wait_until(Duration::from_secs(5), "the orphaned server to die", || {
        exited(pid)
    });
    wait_until(Duration::from_secs(5), "its directory to go", || {
        !dir.exists()
    });
}

#[test]
fn a_failing_test_prints_the_server_log() {
    const TEST: &str = "a_failing_test_prints_the_server_log";
    if std::env::var(CHILD_ENV).as_deref() == Ok("panic") {
        let _server = TestServer::start();
        panic!("deliberate failure");
    }
    let output = run_child(TEST, "panic");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("deliberate failure"), "{stderr}");
    assert!(stderr.contains("log lines ---"), "{stderr}");
    assert!(stderr.contains("Ready to accept connections"), "{stderr}");
}
