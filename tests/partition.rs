//! A lease's bound on a replicated deployment, judged by what a replica holds:
//! under `Replication::Require` an extension counts only once the required
//! replicas acknowledged it, so no guard counts on more than a replica
//! promoted now would hold, whether or not the client ever hears of the
//! promotion. Under `Off` the window is real, and shown as a negative control.
//!
//! The oracle is the replica itself: its `PTTL`, `GET` and `PEXPIRETIME` for
//! the key (a replica answers for a key that expired by its clock as for a
//! missing one), read on a connection of the test's own, against the moment
//! the guard's loss signal fired.
//!
//! Also here, the other faults of the network a client does not see through:
//! an acquire attempt whose request a proxy holds until after the lease a
//! later attempt won was released (the late duplicate sets it again, for
//! nobody: the release's clean-up must delete it), judged by the server's
//! keys; and calls a Sentinel primary left unanswered when it was replaced,
//! whose clean-up must reach the new primary (judged by its keys) and whose
//! fence must not go to the old one (judged by its connections).

mod support;

use std::time::{Duration, Instant};

use respire_coordination::{Coordinator, Error, Replication};
use support::{Mode, TestServer, ms, proxied_replica, unique_prefix, wait_until};

const NODE_TIMEOUT: Duration = Duration::from_millis(100);
const TTL: Duration = Duration::from_millis(1_500);

fn coordinator(primary: &TestServer, prefix: &str, replication: Replication) -> Coordinator {
    Coordinator::builder(&primary.url())
        .key_prefix(prefix)
        .node_timeout(NODE_TIMEOUT)
        .replication(replication)
        .build()
        .expect("connect")
}

/// One replica's acknowledgement, waited for long enough that a loaded
/// machine's replica answers in time when its link is up.
fn require() -> Replication {
    Replication::Require {
        replicas: 1,
        timeout: ms(500),
    }
}

/// Waits until the replica acknowledges the primary's writes (`WAIT` on a
/// write of the test's own answers 1): until it has acknowledged an offset
/// once, the primary streams it nothing and a `WAIT` times out.
fn until_acknowledged(primary: &TestServer) {
    let mut conn = primary.client();
    wait_until(ms(10_000), "the replica to acknowledge a write", || {
        let _: () = redis::cmd("SET")
            .arg("respire-test-ack")
            .arg(1)
            .query(&mut conn)
            .unwrap();
        let acked: i64 = redis::cmd("WAIT").arg(1).arg(500).query(&mut conn).unwrap();
        acked == 1
    });
}

/// The replica's `PTTL` for `key`: −2 once it is gone there.
fn pttl(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).expect("PTTL")
}

/// The replica's `PEXPIRETIME` for `key` (unix ms; negative when missing).
fn expire_time(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PEXPIRETIME")
        .arg(key)
        .query(conn)
        .expect("PEXPIRETIME")
}

/// What a kept-alive guard and the replica said once the replication link was
/// cut: when the guard's loss signal fired and what the replica had left then
/// (its expiry for the key, final since the cut, minus the wall clock at the
/// signal), and whether the replica's copy was seen gone while the guard was
/// still held.
#[derive(Debug)]
struct Watched {
    lost_after: Option<Duration>,
    replica_left_at_loss: Option<i64>,
    replica_gone_while_held: bool,
}

/// Takes a lease through `coord`, keeps it alive until the replica has
/// acknowledged a renewal, runs `cut`, and watches the guard against the
/// replica's copy until the copy is gone (or 10 s).
fn watch(coord: &Coordinator, replica: &TestServer, cut: impl FnOnce()) -> Watched {
    let lock = coord.lock("job").unwrap();
    let guard = lock.try_acquire(TTL).unwrap().expect("free");
    let key = guard.key().to_owned();
    let keep = guard.keep_alive().unwrap();
    // A renewal the replica has: its expiry moved past the grant's.
    let mut on_replica = replica.client();
    let granted = expire_time(&mut on_replica, &key);
    wait_until(ms(5_000), "a renewal on the replica", || {
        expire_time(&mut on_replica, &key) > granted
    });
    assert!(pttl(&mut on_replica, &key) > 0, "the replica has the lease");
    cut();
    let start = Instant::now();
    // The replica hears nothing more: its expiry for the key is final.
    let expiry = expire_time(&mut on_replica, &key);
    let mut watched = Watched {
        lost_after: None,
        replica_left_at_loss: None,
        replica_gone_while_held: false,
    };
    let (_stop, stopped) = crossbeam_channel::bounded::<()>(0);
    std::thread::scope(|s| {
        let loss = s.spawn(|| loss_signal(&guard, start, &stopped));
        while start.elapsed() < ms(10_000) {
            // The replica is read first: a guard seen held after that read was
            // held when the replica answered.
            let left = pttl(&mut on_replica, &key);
            let lost = guard.is_lost();
            if left <= 0 {
                watched.replica_gone_while_held = !lost;
                break;
            }
            std::thread::sleep(ms(2));
        }
        if let Some((after, wall)) = loss.join().unwrap() {
            watched.lost_after = Some(after);
            watched.replica_left_at_loss = Some(expiry - wall);
        }
    });
    drop(keep);
    watched
}

/// Waits for `guard`'s loss signal, until `stop` disconnects or 15 s have
/// passed; then returns how long after `start` it fired, and the wall clock
/// then in unix milliseconds (as `PEXPIRETIME` counts). Timed by a thread of
/// its own, so that a loaded machine's slow look at the servers does not
/// make the loss look later than it was.
fn loss_signal(
    guard: &respire_coordination::LockGuard,
    start: Instant,
    stop: &crossbeam_channel::Receiver<()>,
) -> Option<(Duration, i64)> {
    crossbeam_channel::select! {
        recv(guard.lost_signal()) -> _ => Some((start.elapsed(), unix_ms())),
        recv(stop) -> _ => None,
        default(ms(15_000)) => None,
    }
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

#[test]
fn under_require_a_renewal_no_replica_acknowledged_never_moves_the_bound_past_the_replica() {
    let primary = TestServer::start();
    let (link, replica) = proxied_replica(&primary);
    until_acknowledged(&primary);
    let prefix = unique_prefix("require_renewal");
    let coord = coordinator(&primary, &prefix, require());
    let w = watch(&coord, &replica, || link.set_mode(Mode::Blackhole));
    assert!(!w.replica_gone_while_held, "{w:?}");
    let left = w.replica_left_at_loss.expect("the guard was flagged lost");
    // Flagged with at least the node timeout to spare on the replica.
    assert!(
        left >= NODE_TIMEOUT.as_millis() as i64,
        "the replica had {left} ms left when the guard was flagged: {w:?}"
    );
}

#[test]
fn without_the_replication_guard_the_primary_keeps_the_lease_alive_past_the_replica() {
    // The negative control: the window the docs state for `Off`. The
    // primary confirms every renewal, the replica never sees one, and the
    // guard counts on a lease a promoted replica no longer has.
    let primary = TestServer::start();
    let (link, replica) = proxied_replica(&primary);
    until_acknowledged(&primary);
    let prefix = unique_prefix("off_renewal");
    let coord = coordinator(&primary, &prefix, Replication::Off);
    let lock = coord.lock("job").unwrap();
    let guard = lock.try_acquire(TTL).unwrap().expect("free");
    let key = guard.key().to_owned();
    let keep = guard.keep_alive().unwrap();
    let mut on_replica = replica.client();
    wait_until(ms(5_000), "the replica to have the lease", || {
        pttl(&mut on_replica, &key) > 0
    });
    link.set_mode(Mode::Blackhole);
    wait_until(ms(10_000), "the replica's copy to expire", || {
        pttl(&mut on_replica, &key) <= 0
    });
    assert!(
        !guard.is_lost(),
        "under Off the guard was expected to count on the primary alone"
    );
    drop(keep);
}

#[test]
fn under_require_reset_expiry_that_no_replica_acknowledged_is_an_error_and_counts_for_nothing() {
    let primary = TestServer::start();
    let (link, replica) = proxied_replica(&primary);
    until_acknowledged(&primary);
    let prefix = unique_prefix("require_reset");
    // A node timeout that a loaded machine's round trip after `WAIT`'s own
    // timeout fits in: an answer, not a timeout, is what is judged here.
    let coord = Coordinator::builder(&primary.url())
        .key_prefix(&prefix)
        .node_timeout(ms(1_000))
        .replication(require())
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    let guard = lock.try_acquire(ms(5_000)).unwrap().expect("free");
    let key = guard.key().to_owned();
    // Acknowledged: it counts.
    assert!(guard.reset_expiry(ms(8_000)).unwrap());
    assert!(guard.remaining_estimate() > ms(5_000));

    link.set_mode(Mode::Blackhole);
    let before = guard.remaining_estimate();
    let err = guard.reset_expiry(ms(12_000)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ExtensionNotReplicated {
                acknowledged: 0,
                required: 1,
                ..
            }
        ),
        "{err:?}"
    );
    // The primary has the longer expiry; the guard does not count on it.
    let on_primary: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query(&mut primary.client())
        .unwrap();
    assert!(on_primary > 9_000, "{on_primary}");
    assert!(
        guard.remaining_estimate() <= before,
        "{:?}",
        guard.remaining_estimate()
    );

    // A shorter one not acknowledged: its worst case (the shorter expiry on
    // the primary) bounds the guard all the same.
    let err = guard.reset_expiry(ms(1_500)).unwrap_err();
    assert!(
        matches!(err, Error::ExtensionNotReplicated { .. }),
        "{err:?}"
    );
    assert!(
        guard.remaining_estimate() <= ms(1_500),
        "{:?}",
        guard.remaining_estimate()
    );
    let mut on_replica = replica.client();
    assert!(pttl(&mut on_replica, &key) > 0);
}

// ----- an asymmetric partition on Sentinel -------------------------------------

const SERVICE: &str = "cut";
const SENTINEL_USER: &str = "user sentinel on >sentinel-pw ~* &* +@all";
const REPLICATION_USER: &str = "user replicator on >replicator-pw +psync +replconf +ping";
/// The clients' user: the default user is off, so a connection whose `AUTH`
/// failed can do nothing (a sentinel's `PING` on it is refused).
const APP_USER: &str = "user app on >app-pw ~* &* +@all";
const DEFAULT_OFF: &str = "user default off";

/// A primary, its replica and three sentinels, where the sentinels and the
/// replica reach the primary as ACL users of their own (`sentinel`,
/// `replicator`): switching those users off on the primary cuts the
/// sentinels' and the replica's links to it, and nothing else.
/// A connection to `server` as the clients' user.
fn app(server: &TestServer) -> redis::Connection {
    redis::Client::open(server.url_for_user("app", "app-pw"))
        .unwrap()
        .get_connection()
        .unwrap()
}

struct Deployment {
    primary: TestServer,
    replica: TestServer,
    sentinels: Vec<TestServer>,
}

impl Deployment {
    fn start() -> Deployment {
        let users = |b: support::TestServerBuilder| {
            b.acl_user(DEFAULT_OFF)
                .acl_user(APP_USER)
                .acl_user(SENTINEL_USER)
                .acl_user(REPLICATION_USER)
        };
        let primary = users(TestServer::builder()).start();
        let replica = users(TestServer::builder())
            .args([
                "--replicaof",
                "127.0.0.1",
                &primary.port().to_string(),
                "--masteruser",
                "replicator",
                "--masterauth",
                "replicator-pw",
            ])
            .start();
        wait_until(ms(10_000), "the replica to be online", || {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut app(&primary))
                .unwrap();
            info.contains("connected_slaves:1") && info.contains("state=online")
        });
        let config = format!(
            "sentinel monitor {SERVICE} 127.0.0.1 {} 2\n\
             sentinel down-after-milliseconds {SERVICE} 500\n\
             sentinel failover-timeout {SERVICE} 2000\n\
             sentinel auth-user {SERVICE} sentinel\n\
             sentinel auth-pass {SERVICE} sentinel-pw\n",
            primary.port()
        );
        let sentinels = start_sentinels(&config, SERVICE);
        Deployment {
            primary,
            replica,
            sentinels,
        }
    }

    /// The primary the sentinels name now.
    fn named_primary(&self) -> Option<u16> {
        let (_, port): (String, u16) = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(SERVICE)
            .query(&mut self.sentinels[0].client())
            .ok()?;
        Some(port)
    }

    /// Cuts the sentinels and the replica off the primary; clients of the
    /// primary stay connected.
    fn cut_primary_off(&self) {
        let mut conn = app(&self.primary);
        for user in ["sentinel", "replicator"] {
            let _: () = redis::cmd("ACL")
                .arg("SETUSER")
                .arg(user)
                .arg("off")
                .query(&mut conn)
                .unwrap();
            let _: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("USER")
                .arg(user)
                .query(&mut conn)
                .unwrap();
        }
    }
}

/// What happened once the client holding a kept-alive lease was left on the
/// old primary's side: whether the new primary let the key go (or gave it to
/// another) while the guard was still held, whether a client on the other
/// side was granted the key, and what the promoted replica had left when the
/// guard's loss signal fired (its expiry for the key, final since the cut,
/// minus the wall clock then).
#[derive(Debug)]
struct Split {
    promoted: bool,
    other_granted: bool,
    let_go_while_held: bool,
    replica_left_at_loss: Option<i64>,
}

fn split(replication: Replication) -> Split {
    let d = Deployment::start();
    let prefix = unique_prefix("sentinel_split");
    // The client on the primary's side reaches the sentinels through proxies
    // that the split blackholes; the other client reaches them directly.
    let links: Vec<support::FaultProxy> = d
        .sentinels
        .iter()
        .map(|s| support::FaultProxy::start(s.addr()))
        .collect();
    let urls: Vec<String> = links.iter().map(|l| l.url()).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let near = Coordinator::sentinel_builder(&urls, SERVICE)
        .username("app")
        .password("app-pw")
        .key_prefix(&prefix)
        .node_timeout(NODE_TIMEOUT)
        .replication(replication)
        .build()
        .unwrap();
    let direct: Vec<String> = d.sentinels.iter().map(TestServer::url).collect();
    let direct: Vec<&str> = direct.iter().map(String::as_str).collect();
    let far = Coordinator::sentinel_builder(&direct, SERVICE)
        .username("app")
        .password("app-pw")
        .key_prefix(&prefix)
        .node_timeout(NODE_TIMEOUT)
        .build()
        .unwrap();

    let lock = near.lock("job").unwrap();
    let guard = lock.try_acquire(TTL).unwrap().expect("free");
    let keep = guard.keep_alive().unwrap();
    let key = guard.key().to_owned();
    let mut on_replica = app(&d.replica);
    let owner: String = redis::cmd("GET")
        .arg(&key)
        .query(&mut app(&d.primary))
        .unwrap();
    let granted = expire_time(&mut on_replica, &key);
    wait_until(ms(5_000), "a renewal on the replica", || {
        expire_time(&mut on_replica, &key) > granted
    });

    for link in &links {
        link.set_mode(Mode::Blackhole);
    }
    d.cut_primary_off();
    let cut = Instant::now();
    // The replica hears nothing more from the primary: its expiry for the
    // key is final.
    let expiry = expire_time(&mut on_replica, &key);
    // The other side asks once the sentinels have promoted the replica.
    let far_lock = far.lock("job").unwrap();
    let mut far_lock = Some(far_lock);
    let mut other = None;

    let mut result = Split {
        promoted: false,
        other_granted: false,
        let_go_while_held: false,
        replica_left_at_loss: None,
    };
    let (stop, stopped) = crossbeam_channel::bounded::<()>(0);
    std::thread::scope(|s| {
        let loss = s.spawn(|| loss_signal(&guard, cut, &stopped));
        while cut.elapsed() < ms(20_000) {
            // The promoted replica is read first: a guard seen held after that
            // read was held when it answered.
            // The promotion closes the replica's client connections: read again
            // on a new one.
            let read = |conn: &mut redis::Connection| -> redis::RedisResult<Option<String>> {
                redis::cmd("GET").arg(&key).query(conn)
            };
            let held_there = match read(&mut on_replica) {
                Ok(r) => r,
                Err(_) => {
                    on_replica = app(&d.replica);
                    read(&mut on_replica).unwrap()
                }
            };
            let lost = guard.is_lost();
            if held_there.as_deref() != Some(owner.as_str()) && !lost {
                result.let_go_while_held = true;
            }
            result.promoted |= d.named_primary() == Some(d.replica.port());
            if result.promoted
                && let Some(lock) = far_lock.take()
            {
                other = Some(std::thread::spawn(move || {
                    lock.acquire_timeout(TTL, ms(12_000))
                }));
            }
            if other.as_ref().is_some_and(|o| o.is_finished()) {
                break;
            }
            std::thread::sleep(ms(5));
        }
        drop(stop);
        if let Some((_, wall)) = loss.join().unwrap() {
            result.replica_left_at_loss = Some(expiry - wall);
        }
    });
    let outcome = other.map(|o| o.join().unwrap());
    result.other_granted = matches!(outcome, Some(Ok(Some(_))));
    if !result.promoted || !result.other_granted {
        eprintln!(
            "the other side's acquire: {outcome:?}\n{}",
            d.sentinels[0].log()
        );
    }
    drop(keep);
    result
}

#[test]
fn on_sentinel_a_partition_that_hides_the_switch_ends_the_guard_before_the_new_primary_lets_go_under_require()
 {
    let s = split(require());
    assert!(s.promoted, "the sentinels promoted the replica: {s:?}");
    assert!(s.other_granted, "the other side was granted the key: {s:?}");
    assert!(!s.let_go_while_held, "{s:?}");
    let left = s.replica_left_at_loss.expect("flagged lost");
    assert!(left >= NODE_TIMEOUT.as_millis() as i64, "{s:?}");
}

#[test]
fn on_sentinel_a_partition_that_hides_the_switch_leaves_two_holders_without_the_replication_guard()
{
    // The negative control: the window the docs state for `Off`.
    let s = split(Replication::Off);
    assert!(s.promoted, "the sentinels promoted the replica: {s:?}");
    assert!(s.other_granted, "the other side was granted the key: {s:?}");
    assert!(s.let_go_while_held, "{s:?}");
}

// ----- a late duplicate of an unanswered acquire attempt ------------------------

/// A coordinator on a server behind a proxy, with one pooled connection and
/// its executor's connection open (a kept-alive leadership renewed once, and
/// the scripts of the election and the lock's release loaded), so that the
/// test can hold what one of them sends.
struct LateRig {
    server: TestServer,
    proxy: support::FaultProxy,
    coord: Coordinator,
}

/// Long enough that a kill the executor sent into a blackholed connection
/// is still awaited when the test has released and delivered the held
/// attempt; the lease's TTL is far longer than what the test waits for.
const LATE_NODE_TIMEOUT: Duration = Duration::from_millis(500);
const LATE_TTL: Duration = Duration::from_secs(30);

impl LateRig {
    fn start(prefix: &str) -> LateRig {
        let server = TestServer::start();
        let proxy = support::FaultProxy::start(server.addr());
        let coord = Coordinator::builder(&proxy.url())
            .key_prefix(prefix)
            .node_timeout(LATE_NODE_TIMEOUT)
            .pool_size(1)
            .build()
            .expect("connect through the proxy");
        let warm = coord.election("{warm}").unwrap();
        let leadership = warm
            .try_campaign("warm", ms(2_500))
            .unwrap()
            .expect("nobody leads");
        let keep = leadership.keep_alive().unwrap();
        wait_until(ms(10_000), "a renewal on the executor's connection", || {
            coord.renewal_stats().renewals >= 1
        });
        drop(keep);
        assert_eq!(
            leadership.resign().unwrap(),
            respire_coordination::ReleaseOutcome::Released
        );
        let lock = coord.lock("warm").unwrap();
        let guard = lock.try_acquire(ms(2_500)).unwrap().expect("free");
        guard.release().unwrap();
        LateRig {
            server,
            proxy,
            coord,
        }
    }

    /// The port of the one connection named `name` (its `CLIENT LIST`
    /// address): `respire` is the pooled one, `respire-renewal` the
    /// executor's.
    fn port_of(&self, name: &str) -> u16 {
        let list = support::client_list(&mut self.server.client());
        let ports: Vec<u16> = list
            .iter()
            .filter(|c| c.get("name").map(String::as_str) == Some(name))
            .filter_map(|c| c.get("addr")?.rsplit(':').next()?.parse().ok())
            .collect();
        assert_eq!(ports.len(), 1, "one connection named {name}: {list:?}");
        ports[0]
    }

    fn exists(&self, key: &str) -> bool {
        redis::cmd("EXISTS")
            .arg(key)
            .query::<i64>(&mut self.server.client())
            .unwrap()
            == 1
    }

    /// Runs `acquire` while what the pooled connection sends is held (its
    /// first attempt gets no reply, a later one on a new connection is
    /// granted) and the executor's connection is blackholed (the kill of the
    /// unanswered attempt's connection waits for its reply), releases the
    /// lease at once with `release`, then delivers the held attempt: the late
    /// duplicate sets the lease again, for nobody. Checks the server's keys:
    /// none after the release, the late one once delivered, and none again
    /// once the clean-up of the release had its time.
    fn quick_release_after_a_late_attempt<G>(
        &self,
        acquire: impl FnOnce(&Coordinator) -> (G, String),
        release: impl FnOnce(G) -> respire_coordination::ReleaseOutcome,
    ) {
        let pooled = self.port_of("respire");
        let executor = self.port_of("respire-renewal");
        assert!(
            self.proxy
                .set_connection_mode(pooled, Some(Mode::HoldClientToServer))
        );
        assert!(
            self.proxy
                .set_connection_mode(executor, Some(Mode::Blackhole))
        );
        let (guard, key) = acquire(&self.coord);
        assert!(
            self.proxy.client_chunks_held_from(pooled) > Some(0),
            "the first attempt is held in the proxy"
        );
        assert_eq!(
            release(guard),
            respire_coordination::ReleaseOutcome::Released
        );
        assert!(!self.exists(&key), "the release deleted the lease");
        // The late duplicate arrives.
        assert!(self.proxy.set_connection_mode(pooled, None));
        wait_until(
            ms(2_000),
            "the held attempt to set the lease again after the release",
            || self.exists(&key),
        );
        // Far within the TTL: gone because it was deleted.
        wait_until(
            ms(5_000),
            "the lease the late attempt set to be deleted",
            || !self.exists(&key),
        );
        assert!(!self.exists(&key));
    }
}

#[test]
fn a_quick_release_after_an_unanswered_attempt_leaves_no_lease_behind() {
    let rig = LateRig::start(&unique_prefix("late_release"));
    rig.quick_release_after_a_late_attempt(
        |coord| {
            let lock = coord.lock("job").unwrap();
            let guard = lock
                .acquire_timeout(LATE_TTL, ms(10_000))
                .unwrap()
                .expect("granted to a later attempt");
            let key = guard.key().to_owned();
            (guard, key)
        },
        |guard| guard.release().unwrap(),
    );
}

#[test]
fn a_quick_resign_after_an_unanswered_campaign_attempt_leaves_no_leader_behind() {
    let rig = LateRig::start(&unique_prefix("late_resign"));
    rig.quick_release_after_a_late_attempt(
        |coord| {
            let election = coord.election("{office}").unwrap();
            let key = election.lease_key().to_owned();
            let leadership = election
                .campaign_timeout("me", LATE_TTL, ms(10_000))
                .unwrap()
                .expect("elected by a later attempt");
            (leadership, key)
        },
        |leadership| leadership.resign().unwrap(),
    );
}

// ----- a clean-up after the primary was replaced --------------------------------

/// A primary and its replica behind proxies, watched by three sentinels that
/// reach each of them through its proxy: the sentinels name the proxies'
/// addresses, so every client connection to a data server runs through a
/// proxy where one connection can be given a mode of its own.
struct ProxiedSentinel {
    primary: TestServer,
    replica: TestServer,
    to_primary: support::FaultProxy,
    to_replica: support::FaultProxy,
    sentinels: Vec<TestServer>,
}

const PROXIED_SERVICE: &str = "proxied";

impl ProxiedSentinel {
    fn start() -> ProxiedSentinel {
        let no_sync_delay = ["--repl-diskless-sync-delay", "0"];
        let primary = TestServer::builder().args(no_sync_delay).start();
        let replica = TestServer::builder().args(no_sync_delay).start();
        let to_primary = support::FaultProxy::start(primary.addr());
        let to_replica = support::FaultProxy::start(replica.addr());
        // Each announces its proxy as its address as a replica.
        for (server, proxy) in [(&primary, &to_primary), (&replica, &to_replica)] {
            let mut conn = server.client();
            for (name, value) in [
                ("replica-announce-ip", "127.0.0.1".to_owned()),
                ("replica-announce-port", proxy.port().to_string()),
            ] {
                let () = redis::cmd("CONFIG")
                    .arg("SET")
                    .arg(name)
                    .arg(value)
                    .query(&mut conn)
                    .unwrap();
            }
        }
        // Through the primary's proxy, as the sentinels name it.
        let () = redis::cmd("REPLICAOF")
            .arg("127.0.0.1")
            .arg(to_primary.port())
            .query(&mut replica.client())
            .unwrap();
        let listed = format!("port={}", to_replica.port());
        wait_until(ms(10_000), "the replica to be online", || {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut primary.client())
                .unwrap();
            info.contains(&listed) && info.contains("state=online")
        });
        let config = format!(
            "sentinel monitor {PROXIED_SERVICE} 127.0.0.1 {} 2\n\
             sentinel down-after-milliseconds {PROXIED_SERVICE} 1000\n\
             sentinel failover-timeout {PROXIED_SERVICE} 2000\n",
            to_primary.port()
        );
        let sentinels = start_sentinels(&config, PROXIED_SERVICE);
        ProxiedSentinel {
            primary,
            replica,
            to_primary,
            to_replica,
            sentinels,
        }
    }

    fn urls(&self) -> Vec<String> {
        self.sentinels.iter().map(TestServer::url).collect()
    }

    /// The port every sentinel names as the primary's, once they agree.
    fn named_primary(&self) -> Option<u16> {
        let ports: Vec<Option<u16>> = self
            .sentinels
            .iter()
            .map(|s| {
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(PROXIED_SERVICE)
                    .query::<(String, u16)>(&mut s.client())
                    .ok()
                    .map(|(_, port)| port)
            })
            .collect();
        ports[0].filter(|_| ports.iter().all(|p| *p == ports[0]))
    }
}

/// The ports of the connections to `server` named `name` (their `CLIENT
/// LIST` addresses).
fn ports_named(server: &TestServer, name: &str) -> Vec<u16> {
    support::client_list(&mut server.client())
        .iter()
        .filter(|c| c.get("name").map(String::as_str) == Some(name))
        .filter_map(|c| c.get("addr")?.rsplit(':').next()?.parse().ok())
        .collect()
}

/// The port of the one connection to `server` named `name`.
fn port_named(server: &TestServer, name: &str) -> u16 {
    let ports = ports_named(server, name);
    assert_eq!(ports.len(), 1, "one connection named {name}: {ports:?}");
    ports[0]
}

#[test]
fn the_fence_and_the_clean_up_of_calls_the_replaced_primary_left_unanswered_go_to_the_new_primary()
{
    // An extension and then an acquire attempt that the primary ran and
    // replicated but whose replies were lost are still awaited when the
    // sentinels replace the primary and the client switches: both end
    // unanswered after the switch. The attempt's clean-up (delete by owner)
    // must reach the new primary, which holds what the attempt set; the
    // extension's fence is moot once the old primary is retired (the switch
    // gave its claim up, its worst case stays in the bound), so nothing is
    // sent to the old primary for it.
    let d = ProxiedSentinel::start();
    let prefix = unique_prefix("retired_clean_up");
    let urls = d.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    // Long enough for the failover and the switch to fit inside the wait
    // for the replies.
    let node_timeout = ms(6_000);
    let coord = Coordinator::sentinel_builder(&urls, PROXIED_SERVICE)
        .key_prefix(&prefix)
        .node_timeout(node_timeout)
        .pool_size(2)
        .build()
        .unwrap();
    let held = coord.lock("held").unwrap();
    let guard = held.try_acquire(LATE_TTL).unwrap().expect("free");
    // Loads the extension script: a `NOSCRIPT` reply would be dropped too.
    assert!(guard.reset_expiry(LATE_TTL).unwrap());
    let lock = coord.lock("job").unwrap();
    // A second pooled connection: opened by a grant and its release while
    // the first one's extension is held in the proxy.
    let first = port_named(&d.primary, "respire");
    assert!(
        d.to_primary
            .set_connection_mode(first, Some(Mode::HoldClientToServer))
    );
    std::thread::scope(|s| {
        let extension = s.spawn(|| guard.reset_expiry(LATE_TTL));
        // Held on that connection (the sentinels' connections pass the same
        // proxy: bytes of theirs on their way say nothing of it). Only the
        // extension can send there now; the attempt below must find that
        // connection busy, or it would be held behind it.
        wait_until(ms(5_000), "the extension to be held", || {
            d.to_primary.client_chunks_held_from(first) > Some(0)
        });
        lock.try_acquire(LATE_TTL)
            .unwrap()
            .expect("free")
            .release()
            .unwrap();
        assert!(d.to_primary.set_connection_mode(first, None));
        assert!(extension.join().unwrap().unwrap());
    });
    let pooled = ports_named(&d.primary, "respire");
    assert_eq!(pooled.len(), 2, "two pooled connections");
    for &port in &pooled {
        assert!(
            d.to_primary
                .set_connection_mode(port, Some(Mode::DropServerToClient))
        );
    }
    let key = format!("{prefix}job");
    let held_key = guard.key().to_owned();
    let mut on_replica = d.replica.client();
    let new_primary = format!("redis://127.0.0.1:{}", d.to_replica.port());
    std::thread::scope(|s| {
        let before = expire_time(&mut on_replica, &held_key);
        let extension = s.spawn(|| {
            let r = guard.reset_expiry(LATE_TTL * 2);
            (r, Instant::now())
        });
        wait_until(ms(5_000), "the extension to reach the replica", || {
            expire_time(&mut on_replica, &held_key) > before
        });
        let attempt = s.spawn(|| {
            let r = lock.try_acquire(LATE_TTL);
            (r.map(|g| g.is_some()), Instant::now())
        });
        wait_until(ms(5_000), "the attempt to reach the replica", || {
            redis::cmd("EXISTS")
                .arg(&key)
                .query::<i64>(&mut on_replica)
                .unwrap()
                == 1
        });
        let () = redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(PROXIED_SERVICE)
            .query(&mut d.sentinels[0].client())
            .unwrap();
        let seen = support::true_within(ms(10_000), || coord.primaries() == [new_primary.clone()]);
        assert!(
            seen,
            "the client did not switch to {new_primary}: it names {:?}, the sentinels {:?}\n{}",
            coord.primaries(),
            d.named_primary(),
            d.sentinels[0].log()
        );
        let switched = Instant::now();
        assert_eq!(d.named_primary(), Some(d.to_replica.port()));
        let (extended, extension_ended) = extension.join().unwrap();
        let (attempted, attempt_ended) = attempt.join().unwrap();
        for (call, result, ended) in [
            ("extension", extended.map(|_| ()), extension_ended),
            ("attempt", attempted.map(|_| ()), attempt_ended),
        ] {
            let err = result.expect_err("a call without a reply is an error");
            assert!(err.is_timeout(), "{call}: {err}");
            assert!(
                ended > switched,
                "the {call} ended before the switch: the test proves nothing"
            );
        }
    });
    // What the attempt set is on the new primary until the clean-up deletes
    // it; far within its TTL, gone because it was deleted.
    let mut on_new = d.replica.client();
    wait_until(
        ms(5_000),
        "the clean-up to delete the attempt's lease on the new primary",
        || {
            redis::cmd("EXISTS")
                .arg(&key)
                .query::<i64>(&mut on_new)
                .unwrap_or(1)
                == 0
        },
    );
    // The retired primary's jobs were handled in the order they came, the
    // fence first: by now a kill sent to the old primary would have opened
    // the executor's connection there.
    assert_eq!(
        ports_named(&d.primary, "respire-renewal"),
        Vec::<u16>::new(),
        "a job for the retired primary was sent to it"
    );
}

/// Three sentinels started with `config`, once each knows the other two and
/// the replica of `service`.
fn start_sentinels(config: &str, service: &str) -> Vec<TestServer> {
    let sentinels: Vec<TestServer> = (0..3)
        .map(|_| TestServer::builder().sentinel(config.to_owned()).start())
        .collect();
    for s in &sentinels {
        wait_until(
            ms(15_000),
            "each sentinel to know the others and the replica",
            || {
                let fields: Vec<String> = redis::cmd("SENTINEL")
                    .arg("MASTER")
                    .arg(service)
                    .query(&mut s.client())
                    .unwrap_or_default();
                let field = |name: &str| {
                    fields
                        .iter()
                        .position(|f| f == name)
                        .and_then(|i| fields.get(i + 1))
                        .and_then(|v| v.parse::<u32>().ok())
                };
                field("num-slaves") == Some(1) && field("num-other-sentinels") == Some(2)
            },
        );
    }
    sentinels
}
