//! A command left without a reply is fenced off by killing the connection it
//! went out on, and only that one: a restarted server numbers its connections
//! from 1 again, so the id it had may name another client's connection by the
//! time the kill goes out. The clean-up of an unanswered acquire and the fence
//! of an unanswered extension or renewal must leave that connection alone.
//!
//! Each test sends a command through a proxy that drops the server's replies,
//! restarts the server while the reply is still awaited, connects bystanders
//! straight to the server until one gets the id of the connection the command
//! went out on, and only then lets the library reach the server again. The
//! oracle is the server's: its `CLIENT LIST` and the bystander's own `PING`,
//! once the server has answered the library's `CLIENT KILL` (`INFO
//! commandstats`).

mod support;

use std::thread;
use std::time::Duration;

use redis::Commands;
use respire_coordination::Coordinator;
use support::{FaultProxy, Mode, TestServer, wait_until};

/// Long enough for a restart and the bystanders to fit inside one command's
/// wait for its reply.
const NODE_TIMEOUT: Duration = Duration::from_secs(5);
const TTL: Duration = Duration::from_secs(30);

struct Rig {
    server: TestServer,
    proxy: FaultProxy,
    /// Through the proxy, with one pooled connection.
    coord: Coordinator,
}

impl Rig {
    fn new(prefix: &str) -> Rig {
        Rig::with_node_timeout(prefix, NODE_TIMEOUT)
    }

    fn with_node_timeout(prefix: &str, node_timeout: Duration) -> Rig {
        let server = TestServer::start();
        let proxy = FaultProxy::start(server.addr());
        let coord = Coordinator::builder(&proxy.url())
            .key_prefix(prefix)
            .node_timeout(node_timeout)
            .pool_size(1)
            .build()
            .expect("connect through the proxy");
        Rig {
            server,
            proxy,
            coord,
        }
    }

    /// The server's id for the coordinator's one connection named `name`
    /// (`respire`: the pooled one; `respire-renewal`: the executor's).
    fn id_of(&self, name: &str) -> u64 {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(&mut self.server.client())
            .unwrap();
        let ids: Vec<u64> = list
            .lines()
            .filter(|line| field(line, "name") == Some(name))
            .filter_map(|line| field(line, "id")?.parse().ok())
            .collect();
        assert_eq!(
            ids.len(),
            1,
            "one connection named {name} expected:\n{list}"
        );
        ids[0]
    }

    /// Restarts the server while a command's reply is awaited, then connects
    /// straight to it until a bystander gets id `stale`. Panics if the wait
    /// for the reply ended before that (`in_flight` false): then the library
    /// could have reached the new server first.
    fn restart_and_take_id(&self, stale: u64, in_flight: impl Fn() -> bool) -> redis::Connection {
        self.server.restart();
        let bystander = bystander_with_id(&self.server, stale);
        assert!(
            in_flight(),
            "the call returned before the restart and the bystanders were done (within the \
             node timeout of {NODE_TIMEOUT:?}): the test proves nothing"
        );
        bystander
    }
}

/// The value of `name=` in one line of `CLIENT LIST` / `CLIENT INFO`.
fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_ascii_whitespace()
        .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
}

fn client_id(conn: &mut redis::Connection) -> u64 {
    redis::cmd("CLIENT").arg("ID").query(conn).unwrap()
}

/// Connects straight to `server` until a connection gets id `id`, closing
/// those numbered before it. Panics if another client took the id.
fn bystander_with_id(server: &TestServer, id: u64) -> redis::Connection {
    loop {
        let mut conn = server.client();
        let got = client_id(&mut conn);
        assert!(got <= id, "id {id} was given to another client first");
        if got == id {
            return conn;
        }
    }
}

/// How many `CLIENT KILL` calls the server has run since it started.
fn kills_run(admin: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(admin).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_client|kill:calls="))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// Waits until the server has run the library's `CLIENT KILL`, then checks
/// that the bystander's connection `id` survived it.
fn assert_bystander_survives(server: &TestServer, bystander: &mut redis::Connection, id: u64) {
    let mut admin = server.client();
    wait_until(
        Duration::from_secs(20),
        "the library's CLIENT KILL to reach the restarted server",
        || kills_run(&mut admin) >= 1,
    );
    let listed: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("ID")
        .arg(id)
        .query(&mut admin)
        .unwrap();
    assert_eq!(
        field(&listed, "id"),
        Some(id.to_string().as_str()),
        "the bystander's connection {id} was killed"
    );
    let pong: redis::RedisResult<String> = redis::cmd("PING").query(bystander);
    assert_eq!(
        pong.ok().as_deref(),
        Some("PONG"),
        "the bystander lost its connection"
    );
}

#[test]
fn the_clean_up_of_an_unanswered_acquire_spares_the_connection_that_took_its_id_after_a_restart() {
    let rig = Rig::new("acquire:");
    let stale = rig.id_of("respire");
    let lock = rig.coord.lock("job").unwrap();
    rig.proxy.set_mode(Mode::DropServerToClient);
    let mut bystander = thread::scope(|s| {
        let attempt = s.spawn(|| lock.try_acquire(TTL));
        // The attempt ran (its grant is there); only its reply is dropped.
        let mut admin = rig.server.client();
        wait_until(
            Duration::from_secs(4),
            "the attempt to reach the server",
            || admin.exists("acquire:job").unwrap(),
        );
        let bystander = rig.restart_and_take_id(stale, || !attempt.is_finished());
        rig.proxy.set_mode(Mode::Pass);
        let err = attempt
            .join()
            .unwrap()
            .expect_err("an attempt with no reply is an error");
        assert!(err.is_timeout(), "{err}");
        bystander
    });
    assert_bystander_survives(&rig.server, &mut bystander, stale);
}

#[test]
fn the_fence_of_an_unanswered_extension_spares_the_connection_that_took_its_id_after_a_restart() {
    let rig = Rig::new("extend:");
    let lock = rig.coord.lock("job").unwrap();
    let guard = lock.try_acquire(TTL).unwrap().expect("a free key");
    // Loads the extension script: a `NOSCRIPT` reply would be dropped too.
    assert!(guard.reset_expiry(TTL).unwrap());
    let stale = rig.id_of("respire");
    rig.proxy.set_mode(Mode::DropServerToClient);
    let mut bystander = thread::scope(|s| {
        let extension = s.spawn(|| guard.reset_expiry(TTL * 2));
        // The extension ran (the key's TTL grew); only its reply is dropped.
        let mut admin = rig.server.client();
        wait_until(
            Duration::from_secs(4),
            "the extension to reach the server",
            || admin.pttl::<_, i64>("extend:job").unwrap() > TTL.as_millis() as i64,
        );
        let bystander = rig.restart_and_take_id(stale, || !extension.is_finished());
        rig.proxy.set_mode(Mode::Pass);
        let err = extension
            .join()
            .unwrap()
            .expect_err("an extension with no reply is an error");
        assert!(err.is_timeout(), "{err}");
        bystander
    });
    assert_bystander_survives(&rig.server, &mut bystander, stale);
    drop(guard);
}

#[test]
fn the_fence_of_an_unanswered_renewal_spares_the_connection_that_took_its_id_after_a_restart() {
    // Renewed at 6 s; the next renewal, sent at 12 s, is unanswered at 14 s,
    // and its fence runs before the lease's loss deadline at about 15.9 s.
    let node_timeout = Duration::from_secs(2);
    let rig = Rig::with_node_timeout("renew:", node_timeout);
    let lock = rig.coord.lock("job").unwrap();
    let guard = lock
        .try_acquire(Duration::from_secs(12))
        .unwrap()
        .expect("a free key");
    let _renewing = guard.keep_alive().unwrap();
    wait_until(Duration::from_secs(20), "the first renewal", || {
        rig.coord.renewal_stats().renewals >= 1
    });
    let stale = rig.id_of("respire-renewal");
    rig.proxy.set_mode(Mode::DropServerToClient);
    // The next renewal ran (the key's TTL grew back); only its reply is dropped.
    let mut admin = rig.server.client();
    let mut last = i64::MAX;
    wait_until(
        Duration::from_secs(20),
        "the next renewal to reach the server",
        || {
            let pttl: i64 = admin.pttl("renew:job").unwrap();
            let grew = pttl > last.saturating_add(1_000);
            last = pttl;
            grew
        },
    );
    let bystander = rig.restart_and_take_id(stale, || rig.coord.renewal_stats().failures == 0);
    rig.proxy.set_mode(Mode::Pass);
    let mut bystander = bystander;
    assert_bystander_survives(&rig.server, &mut bystander, stale);
}
