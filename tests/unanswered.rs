//! Commands left without a reply: each is assumed to have had its worst
//! effect until it is fenced off. A shortening `reset_expiry` bounds the guard
//! at once; an extension whose connection cannot be killed caps the later
//! ones; a renewal keeps its claim until its connection is fenced; a wait that
//! ends (or is granted) after an unanswered attempt cleans up what that
//! attempt may still grant; a release that sent nothing is an error and one
//! without a reply is uncertain.
//!
//! A command left without a reply is fenced off by killing the connection it
//! went out on, and only that one: a restarted server numbers its connections
//! from 1 again, so the id it had may name another client's connection by the
//! time the kill goes out. The clean-up of an unanswered acquire and the fence
//! of an unanswered extension or renewal must leave that connection alone.
//!
//! The tests of that identity send a command through a proxy that drops the
//! server's replies,
//! restarts the server while the reply is still awaited, connects bystanders
//! straight to the server until one gets the id of the connection the command
//! went out on, and only then lets the library reach the server again. The
//! oracle is the server's: its `CLIENT LIST` and the bystander's own `PING`,
//! once the server has answered the library's `CLIENT KILL` (`INFO
//! commandstats`).

mod support;

use std::thread;
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{CancelToken, Coordinator, Error, ReleaseOutcome};
use support::{FaultProxy, Mode, TestServer, coordinator, ms, pttl, script_calls, wait_until};

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

/// Polls `lost` and the server every millisecond until the server no longer
/// has the key; returns (when `lost` first held, when the key was gone).
fn race_loss_against_expiry(
    admin: &mut redis::Connection,
    key: &str,
    lost: impl Fn() -> bool,
    within: Duration,
) -> (Option<Instant>, Instant) {
    let started = Instant::now();
    let mut lost_at = None;
    loop {
        if lost_at.is_none() && lost() {
            lost_at = Some(Instant::now());
        }
        if pttl(admin, key) < 0 {
            return (lost_at, Instant::now());
        }
        assert!(started.elapsed() < within, "the key never expired");
        thread::sleep(ms(1));
    }
}

#[test]
fn a_shortening_reset_expiry_without_reply_bounds_the_guard_at_once() {
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let coord = coordinator(&proxy.url(), "a:", ms(200));
    let lock = coord.fenced_lock("{a}:lease", "{a}:fence").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(60)).unwrap().unwrap();
    // The extension script is on the server (else the server refuses it with
    // NOSCRIPT, and nothing is shortened).
    assert!(guard.reset_expiry(Duration::from_secs(60)).unwrap());
    // The shortening reaches the server; its reply never comes back.
    proxy.set_mode(Mode::DropServerToClient);
    let sent = Instant::now();
    let err = guard.reset_expiry(ms(1_500)).unwrap_err();
    assert!(err.is_uncertain(), "{err}");
    proxy.set_mode(Mode::Pass);
    let on_server = pttl(&mut admin, "a:{a}:lease");
    assert!(
        on_server > 0 && on_server <= 1_500,
        "the server shortened it: {on_server}"
    );
    // The guard counts on the shorter expiry from the send, not on 60 s.
    assert!(
        guard.remaining_estimate() <= ms(1_500).saturating_sub(sent.elapsed()),
        "{:?}",
        guard.remaining_estimate()
    );
    let signal = guard.lost_signal().clone();
    let (lost, gone) = race_loss_against_expiry(
        &mut admin,
        "a:{a}:lease",
        || guard.is_lost(),
        Duration::from_secs(10),
    );
    let lost = lost.expect("is_lost() before the server dropped the key");
    println!("a: flagged lost {:?} before the key expired", gone - lost);
    assert!(lost < gone);
    assert!(signal.try_recv().unwrap_err().is_disconnected());
}

/// Without the right to `CLIENT ID`, an extension that got no reply cannot be
/// fenced off: its connection cannot be killed, and it may land at any time.
/// The lease is not pinned until its deadline for that: later extensions are
/// confirmed, and each counts for no longer than the unanswered one's TTL,
/// which is all the server can be trusted to keep once it lands.
#[test]
fn an_extension_whose_connection_cannot_be_killed_caps_the_later_ones() {
    let server = TestServer::builder()
        .acl_user("app on >pw ~* &* +@all -client|id")
        .start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let url = format!("redis://app:pw@127.0.0.1:{}", proxy.port());
    let coord = coordinator(&url, "a3:", ms(300));
    let guard = coord
        .lock("job")
        .unwrap()
        .try_acquire(Duration::from_secs(60))
        .unwrap()
        .unwrap();
    // The extension script is on the server (else the late one is refused
    // with NOSCRIPT and changes nothing).
    assert!(guard.reset_expiry(Duration::from_secs(60)).unwrap());
    // A shortening to 5 s that reaches the server 2 s late, after its reply
    // was given up for lost.
    proxy.set_mode(Mode::Delay(ms(2_000)));
    let err = guard.reset_expiry(Duration::from_secs(5)).unwrap_err();
    assert!(err.is_uncertain(), "{err}");
    proxy.set_mode(Mode::Pass);
    // The claim is free: a 60 s extension is confirmed at once, on a new
    // connection, before the late one lands.
    assert!(guard.reset_expiry(Duration::from_secs(60)).unwrap());
    assert!(pttl(&mut admin, "a3:job") > 55_000);
    wait_until(
        Duration::from_secs(10),
        "the late shortening landed",
        || pttl(&mut admin, "a3:job") <= 5_000,
    );
    // The server keeps it under 5 s now; the guard never counted on more.
    let on_server = ms(pttl(&mut admin, "a3:job") as u64);
    let estimate = guard.remaining_estimate();
    assert!(
        estimate <= on_server,
        "the guard counts on {estimate:?}, the server keeps {on_server:?}"
    );
    assert!(!guard.is_lost());
    let (lost, gone) = race_loss_against_expiry(
        &mut admin,
        "a3:job",
        || guard.is_lost(),
        Duration::from_secs(10),
    );
    let lost = lost.expect("is_lost() before the server dropped the key");
    println!("a3: flagged lost {:?} before the key expired", gone - lost);
    assert!(lost < gone);
}

#[test]
fn a_renewal_without_reply_keeps_its_claim_until_its_connection_is_fenced() {
    let server = TestServer::start();
    let proxy = FaultProxy::start(server.addr());
    let coord = coordinator(&proxy.url(), "a2:", ms(200));
    let lock = coord.lock("job").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(2)).unwrap().unwrap();
    let _renewal = guard.keep_alive().unwrap();
    wait_until(Duration::from_secs(5), "a confirmed renewal", || {
        coord.renewal_stats().renewals > 0
    });
    // Replies vanish: the next renewal goes unanswered, and so does the kill
    // that would fence it off (it travels the same way).
    proxy.set_mode(Mode::DropServerToClient);
    let failures = coord.renewal_stats().failures;
    wait_until(Duration::from_secs(5), "an unanswered renewal", || {
        coord.renewal_stats().failures > failures
    });
    // The claim is still held: a longer reset cannot be confirmed while the
    // late renewal may still land after it.
    let err = guard.reset_expiry(Duration::from_secs(60)).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    // Never fenced, never renewed: lost at its deadline.
    let signal = guard.lost_signal().clone();
    assert!(signal.recv_timeout(Duration::from_secs(5)).is_err());
    assert!(guard.is_lost());
    proxy.set_mode(Mode::Pass);
}

#[test]
fn a_wait_that_ends_after_an_unanswered_attempt_cleans_up_its_grant() {
    // A trial needs the waiter to have heard its tracked attempt's reply
    // before replies are dropped; on a busy machine that reply can be dropped
    // too, and the waiter then never sends the grant (its new connections'
    // set-up is never answered). Such a trial still must leave nothing, and
    // counts as not run.
    support::until_a_trial_runs(
        8,
        "the waiter's tracked attempt went unanswered, so it made no grant",
        unanswered_grant_trial,
    );
}

/// One trial: a waiter whose grant is never heard of, cancelled; the grant
/// is deleted. Whether the waiter made the grant.
fn unanswered_grant_trial() -> bool {
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let coord = coordinator(&proxy.url(), "d:", ms(200));
    let lock = coord.fenced_lock("{d}:lease", "{d}:fence").unwrap();
    let () = admin.pset_ex("d:{d}:lease", "crashed-holder", 800).unwrap();
    let cancel = CancelToken::new();
    let granted = thread::scope(|s| {
        let _stop = support::CancelOnDrop(&cancel);
        let waiter = s.spawn(|| lock.acquire(Duration::from_secs(60), &cancel));
        // Once the waiter waits (it has heard that the lease is held and made
        // its tracked attempt), every reply is dropped: the grant it makes
        // when the holder expires is never heard of.
        wait_until(Duration::from_secs(5), "the waiter to wait", || {
            script_calls(&mut admin) >= 2
        });
        proxy.set_mode(Mode::DropServerToClient);
        let granted = support::true_within(Duration::from_secs(5), || {
            let v: Option<String> = admin.get("d:{d}:lease").unwrap();
            v.is_some_and(|v| v != "crashed-holder")
        });
        // The wait ends with another error: cancellation.
        cancel.cancel();
        let err = waiter.join().unwrap().unwrap_err();
        assert!(matches!(err, Error::Cancelled), "{err}");
        granted
    });
    proxy.set_mode(Mode::Pass);
    // The grant nobody heard of is deleted (after its connections are
    // killed), not left for its 60 s; without one, nothing is left either.
    wait_until(
        Duration::from_secs(5),
        "the unheard grant to be cleaned up",
        || !admin.exists::<_, bool>("d:{d}:lease").unwrap(),
    );
    granted
}

#[test]
fn a_wait_granted_after_an_unanswered_attempt_stops_that_attempt_from_granting_again() {
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let coord = coordinator(&proxy.url(), "ghost:", ms(200));
    let lock = coord.fenced_lock("{g}:lease", "{g}:fence").unwrap();
    // A waiting acquire first, so that the subscriber and a tracked pooled
    // connection are in place.
    let first = lock
        .acquire_timeout(Duration::from_secs(30), Duration::from_secs(5))
        .unwrap()
        .unwrap();
    let before = first.fencing_token().get();
    first.release().unwrap();
    // The bytes of the wait's first attempt reach the server 1.5 s late: it
    // times out (node timeout 200 ms) and is still on its way.
    let delay = ms(1_500);
    let sent = proxy.client_chunks();
    proxy.set_mode(Mode::Delay(delay));
    let started = Instant::now();
    let (guard, in_proxy) = thread::scope(|s| {
        let waiter =
            s.spawn(|| lock.acquire_timeout(Duration::from_secs(30), Duration::from_secs(10)));
        // Once the first attempt is held in the proxy, the next go through.
        wait_until(
            Duration::from_secs(5),
            "the first attempt in the proxy",
            || proxy.client_chunks() > sent,
        );
        proxy.set_mode(Mode::Pass);
        let guard = waiter.join().unwrap().unwrap().expect("granted");
        // What clients sent that the proxy still holds as the grant returns.
        (guard, proxy.client_chunks() - proxy.client_chunks_done())
    });
    println!(
        "ghost: granted {:?} after the wait began",
        started.elapsed()
    );
    assert!(
        in_proxy > 0,
        "granted only after the delayed attempt left the proxy"
    );
    let token = guard.fencing_token().get();
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    // The delayed attempt leaves the proxy once its delay is out (to the
    // server, or to a connection the server closed, if it was fenced off):
    // it must not grant the released owner again.
    wait_until(
        delay + Duration::from_secs(10),
        "the delayed attempt to leave the proxy",
        || proxy.client_chunks_done() == proxy.client_chunks(),
    );
    let held: bool = admin.exists("ghost:{g}:lease").unwrap();
    assert!(!held, "a late attempt granted a lease nobody holds");
    let fence: u64 = admin.get("ghost:{g}:fence").unwrap();
    assert_eq!(
        fence, token,
        "a late attempt drew a token (last seen {before})"
    );
}

#[test]
fn a_release_that_sent_nothing_is_an_error_and_one_without_reply_is_uncertain() {
    let server = TestServer::start();
    let proxy = FaultProxy::start(server.addr());
    let coord = Coordinator::builder(&proxy.url())
        .key_prefix("k:")
        .node_timeout(ms(200))
        .pool_size(1)
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    // Sent, no reply: uncertain (the release script cached first, so that the
    // release is applied, and only its reply lost).
    let g = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
    let g = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    proxy.set_mode(Mode::DropServerToClient);
    assert_eq!(g.release().unwrap(), ReleaseOutcome::Uncertain);
    proxy.set_mode(Mode::Pass);
    // Nothing could be sent (the server is gone): an error.
    let g = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    drop(proxy);
    let err = g.release().unwrap_err();
    assert!(
        matches!(err, Error::Connect { .. } | Error::PoolTimeout(_)),
        "{err}"
    );
}
