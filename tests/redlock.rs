//! Redlock groups against real servers, each behind a fault-injecting proxy:
//! quorum under failures, parallel fan-out, evidence, restarts, every refusal,
//! and a safety campaign with a nemesis that kills and restarts nodes.

mod support;
use support::Rng;
use support::coordinator;

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{
    CancelToken, Coordinator, Error, NodeOutcome, RedlockGroup, RedlockGuard, RedlockOptions,
    ReleaseOutcome,
};
use support::{
    ChildProc, FaultProxy, Mode, TestServer, script_calls, shared_server, unique_prefix, wait_until,
};

/// One attempt at `key` on `group` that must be granted.
fn take(group: &RedlockGroup, key: &str, ttl: Duration) -> RedlockGuard {
    group
        .lock(key)
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .expect("free")
}

/// Fresh servers, each behind its own proxy.
struct Nodes {
    servers: Vec<TestServer>,
    proxies: Vec<FaultProxy>,
}

impl Nodes {
    fn start(n: usize) -> Nodes {
        Nodes::start_with(n, false)
    }

    fn start_with(n: usize, append_only: bool) -> Nodes {
        let servers: Vec<TestServer> = (0..n)
            .map(|_| {
                let builder = TestServer::builder();
                if append_only {
                    builder.append_only().start()
                } else {
                    builder.start()
                }
            })
            .collect();
        let proxies = servers
            .iter()
            .map(|s| FaultProxy::start(s.addr()))
            .collect();
        Nodes { servers, proxies }
    }

    fn coordinators(&self, prefix: &str) -> Vec<Coordinator> {
        self.proxies
            .iter()
            .map(|p| coordinator(&p.url(), prefix, Duration::from_millis(500)))
            .collect()
    }

    fn group(&self, prefix: &str, options: RedlockOptions) -> RedlockGroup {
        RedlockGroup::new(self.coordinators(prefix), options).expect("a valid group")
    }

    /// Waits until `groups` watchers are subscribed on every node. A
    /// watcher whose first connection fails counts its node as one that
    /// went away; a test that blackholes a node must let it subscribe first.
    fn watched_by(&self, groups: u64) {
        for (i, s) in self.servers.iter().enumerate() {
            wait_until(
                Duration::from_secs(5),
                &format!("node {i} to be watched"),
                || watchers_on(s) == groups,
            );
        }
    }

    fn get(&self, i: usize, key: &str) -> Option<String> {
        self.servers[i].client().get(key).unwrap()
    }

    /// Puts every node `round_trip` away (half of it each way).
    fn delay_all(&self, round_trip: Duration) {
        for p in &self.proxies {
            p.set_mode(Mode::Delay(round_trip / 2));
        }
    }

    fn urls(&self) -> Vec<String> {
        self.proxies.iter().map(FaultProxy::url).collect()
    }
}

/// Waits (at most 5 s) until every node of three holds `key`.
fn held_everywhere(nodes: &Nodes, key: &str) {
    wait_until(Duration::from_secs(5), "every node to hold the key", || {
        (0..3).all(|i| nodes.get(i, key).is_some())
    });
}

/// Waits (at most 5 s) until no node of three holds `key`.
fn dropped_everywhere(nodes: &Nodes, key: &str) {
    wait_until(Duration::from_secs(5), "every node to drop the key", || {
        (0..3).all(|i| nodes.get(i, key).is_none())
    });
}

fn refs(urls: &[String]) -> Vec<&str> {
    urls.iter().map(String::as_str).collect()
}

/// The median round trip of `PING` on a plain connection to `url`.
fn ping_round_trip(url: &str, samples: usize) -> Duration {
    let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
    let times = (0..samples)
        .map(|_| {
            let t = Instant::now();
            let _: String = redis::cmd("PING").query(&mut conn).unwrap();
            t.elapsed()
        })
        .collect();
    median(times)
}

/// The median time to open a TCP connection to `addr` and get a first answer
/// (`PING`) on it: one node's connect time, the least any client needs to
/// know a connection works.
fn connect_time(addr: std::net::SocketAddr, samples: usize) -> Duration {
    use std::io::{Read, Write};
    let times = (0..samples)
        .map(|_| {
            let t = Instant::now();
            let mut tcp = std::net::TcpStream::connect(addr).unwrap();
            tcp.set_nodelay(true).unwrap();
            tcp.write_all(b"PING\r\n").unwrap();
            let mut pong = [0u8; 7];
            tcp.read_exact(&mut pong).unwrap();
            assert_eq!(&pong, b"+PONG\r\n");
            t.elapsed()
        })
        .collect();
    median(times)
}

/// Acquires and releases `key` `rounds` times, each within a `wait`; returns
/// the median acquire.
fn acquire_median(group: &RedlockGroup, key: &str, rounds: usize, wait: Duration) -> Duration {
    let times = (0..rounds)
        .map(|i| {
            let t = Instant::now();
            let guard = group
                .lock(key)
                .unwrap()
                .acquire_timeout(Duration::from_secs(10), wait)
                .unwrap_or_else(|e| panic!("acquisition {i}: {e}"))
                .unwrap_or_else(|| panic!("acquisition {i} timed out"));
            let took = t.elapsed();
            assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
            took
        })
        .collect();
    median(times)
}

fn options(node_timeout_ms: u64) -> RedlockOptions {
    RedlockOptions {
        node_timeout: Duration::from_millis(node_timeout_ms),
        ..RedlockOptions::default()
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn invalid(result: Result<RedlockGroup, Error>) -> String {
    match result {
        Err(e @ Error::InvalidArgument(_)) => e.to_string(),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

fn not_independent(result: Result<RedlockGroup, Error>) -> String {
    match result {
        Err(e @ Error::NotIndependent(_)) => e.to_string(),
        other => panic!("expected NotIndependent, got {other:?}"),
    }
}

// ---------------------------------------------------------------- refusals

#[test]
fn refuses_fewer_than_three_or_an_even_number_of_nodes() {
    let url = shared_server().url();
    for n in [0, 1, 2] {
        let nodes = (0..n)
            .map(|_| coordinator(&url, "", Duration::from_millis(500)))
            .collect();
        let e = invalid(RedlockGroup::new(nodes, RedlockOptions::default()));
        assert!(e.contains("at least 3 nodes"), "{e}");
    }
    for n in [4, 6] {
        let nodes = (0..n)
            .map(|_| coordinator(&url, "", Duration::from_millis(500)))
            .collect();
        let e = invalid(RedlockGroup::new(nodes, RedlockOptions::default()));
        assert!(e.contains("odd number of nodes"), "{e}");
    }
}

#[test]
fn refuses_bad_drift_factors_and_a_zero_node_timeout() {
    let url = shared_server().url();
    for drift in [-0.01, f64::NAN, 1.0, 1.5, f64::INFINITY] {
        let nodes = (0..3)
            .map(|_| coordinator(&url, "", Duration::from_millis(500)))
            .collect();
        let options = RedlockOptions {
            drift_factor: drift,
            ..RedlockOptions::default()
        };
        let e = invalid(RedlockGroup::new(nodes, options));
        assert!(e.contains("drift factor"), "{e}");
    }
    let nodes = (0..3)
        .map(|_| coordinator(&url, "", Duration::from_millis(500)))
        .collect();
    let e = invalid(RedlockGroup::new(nodes, options(0)));
    assert!(e.contains("node timeout is zero"), "{e}");
}

#[test]
fn refuses_the_same_server_twice() {
    let nodes = Nodes::start(2);
    // The same server, once directly and once through its proxy.
    let coords = vec![
        coordinator(&nodes.proxies[0].url(), "", Duration::from_millis(500)),
        coordinator(&nodes.servers[0].url(), "", Duration::from_millis(500)),
        coordinator(&nodes.proxies[1].url(), "", Duration::from_millis(500)),
    ];
    let e = not_independent(RedlockGroup::new(coords, RedlockOptions::default()));
    assert!(e.contains("are the same server (run id"), "{e}");
}

#[test]
fn refuses_a_primary_and_its_replica() {
    let primary = TestServer::start();
    let other = TestServer::start();
    let replica = TestServer::builder()
        .args(["--replicaof", "127.0.0.1", &primary.port().to_string()])
        .start();
    wait_until(Duration::from_secs(10), "the replica to sync", || {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut replica.client())
            .unwrap();
        info.contains("master_link_status:up")
    });
    let coords = vec![
        coordinator(&primary.url(), "", Duration::from_millis(500)),
        coordinator(&other.url(), "", Duration::from_millis(500)),
        coordinator(&replica.url(), "", Duration::from_millis(500)),
    ];
    let e = not_independent(RedlockGroup::new(coords, RedlockOptions::default()));
    assert!(e.contains("share replication id"), "{e}");
}

#[test]
fn refuses_cluster_nodes() {
    let a = TestServer::start();
    let b = TestServer::start();
    let clustered = TestServer::builder()
        .args(["--cluster-enabled", "yes"])
        .start();
    let coords = vec![
        coordinator(&a.url(), "", Duration::from_millis(500)),
        coordinator(&clustered.url(), "", Duration::from_millis(500)),
        coordinator(&b.url(), "", Duration::from_millis(500)),
    ];
    let e = not_independent(RedlockGroup::new(coords, RedlockOptions::default()));
    assert!(e.contains("Redis Cluster mode"), "{e}");
}

#[test]
fn refuses_a_node_timeout_not_well_below_the_ttl() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("ttl-refusal");
    let group = nodes.group(&prefix, options(200));
    for ttl in [300, 400] {
        match group
            .lock("job")
            .unwrap()
            .try_acquire(Duration::from_millis(ttl))
        {
            Err(Error::InvalidArgument(e)) => {
                assert!(e.contains("is not well below ttl"), "{e}")
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }
    assert!(matches!(
        group.lock("job").unwrap().try_acquire(Duration::ZERO),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(group.lock(""), Err(Error::InvalidArgument(_))));
    for i in 0..3 {
        assert_eq!(nodes.get(i, &format!("{prefix}job")), None, "nothing sent");
    }
    // Well below: accepted.
    let guard = group
        .lock("job")
        .unwrap()
        .try_acquire(Duration::from_millis(500))
        .unwrap();
    assert!(guard.is_some());
}

// ---------------------------------------------------------------- basics

#[test]
fn acquire_contend_extend_release() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("basics");
    let group = nodes.group(&prefix, options(200));
    let key = format!("{prefix}job");
    let ttl = Duration::from_secs(10);

    let attempt = group.attempt("job", ttl).unwrap();
    assert!(attempt.is_acquired());
    assert_eq!(attempt.quorum(), 2);
    assert!(attempt.granted() >= 2);
    assert!(attempt.validity() > Duration::from_millis(9_800));
    assert!(attempt.validity() <= ttl - Duration::from_millis(102));
    let guard = attempt.into_guard().unwrap();
    assert!(!guard.is_lost());
    assert!(guard.remaining_estimate() > Duration::from_millis(9_800));
    held_everywhere(&nodes, &key);

    // Contention is Ok(None), and the loser's grants are cleaned up.
    assert!(
        group
            .lock("job")
            .unwrap()
            .try_acquire(ttl)
            .unwrap()
            .is_none()
    );
    let other = group.attempt("job", ttl).unwrap();
    assert!(other.is_contended());
    // Decided as soon as two nodes said "held": the third may be abandoned.
    let held = other
        .nodes()
        .iter()
        .filter(|n| matches!(n.outcome, NodeOutcome::HeldByAnother { remaining: Some(_) }))
        .count();
    assert!(held >= 2, "{other:?}");
    assert!(other.nodes().iter().all(|n| matches!(
        n.outcome,
        NodeOutcome::HeldByAnother { .. } | NodeOutcome::Abandoned
    )));

    assert!(guard.reset_expiry(Duration::from_secs(30)).unwrap());
    assert!(guard.remaining_estimate() > Duration::from_secs(29));
    // Decided at a quorum: the third node's extension may land a little later.
    wait_until(
        Duration::from_secs(5),
        "every node's expiry to move",
        || {
            (0..3).all(|i| {
                let pttl: i64 = nodes.servers[i].client().pttl(&key).unwrap();
                pttl > 20_000
            })
        },
    );

    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    // Decided at a quorum: the third node's release may land a little later.
    dropped_everywhere(&nodes, &key);

    // Dropping releases too.
    let guard = take(&group, "job", ttl);
    drop(guard);
    dropped_everywhere(&nodes, &key);
}

#[test]
fn a_failed_attempt_is_released_on_every_node() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("failed");
    let group = nodes.group(&prefix, options(200));
    let key = format!("{prefix}job");
    // Another owner holds two of three nodes.
    for i in [1, 2] {
        let _: () = nodes.servers[i].client().set(&key, "someone-else").unwrap();
    }
    let attempt = group.attempt("job", Duration::from_secs(10)).unwrap();
    assert!(!attempt.is_acquired());
    assert!(attempt.is_contended());
    // Contention if node 2 answered first, else two nodes unavailable.
    match attempt.into_result() {
        Ok(None) | Err(Error::QuorumNotReached { .. }) => {}
        other => panic!("expected no lock, got {other:?}"),
    }
    wait_until(
        Duration::from_secs(5),
        "the lone grant to be released",
        || nodes.get(0, &key).is_none(),
    );
    for i in [1, 2] {
        assert_eq!(nodes.get(i, &key).as_deref(), Some("someone-else"));
    }
}

#[test]
fn a_key_of_another_type_on_a_majority_is_a_bad_key_error() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("badkey");
    let group = nodes.group(&prefix, options(200));
    let key = format!("{prefix}job");
    for i in [1, 2] {
        let _: () = nodes.servers[i].client().hset(&key, "f", "v").unwrap();
    }
    match group
        .lock("job")
        .unwrap()
        .try_acquire(Duration::from_secs(10))
    {
        Err(Error::BadKey { key: k, .. }) => assert_eq!(k, key),
        other => panic!("expected BadKey, got {other:?}"),
    }
    // The hashes are untouched; the grant on the one free node is released.
    for i in [1, 2] {
        let v: Option<String> = nodes.servers[i].client().hget(&key, "f").unwrap();
        assert_eq!(v.as_deref(), Some("v"));
    }
    wait_until(
        Duration::from_secs(5),
        "the lone grant to be released",
        || nodes.get(0, &key).is_none(),
    );
}

#[test]
fn extend_needs_a_quorum_and_never_recreates_the_key() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("extend");
    let group = nodes.group(&prefix, options(200));
    let key = format!("{prefix}job");
    let guard = take(&group, "job", Duration::from_secs(10));
    held_everywhere(&nodes, &key);
    let _: () = nodes.servers[0].client().del(&key).unwrap();
    assert!(
        guard.reset_expiry(Duration::from_secs(10)).unwrap(),
        "2 of 3 still hold it"
    );
    let _: () = nodes.servers[1].client().del(&key).unwrap();
    assert!(!guard.reset_expiry(Duration::from_secs(10)).unwrap());
    assert!(guard.is_lost());
    assert_eq!(guard.remaining_estimate(), Duration::ZERO);
    let evidence = guard.last_evidence();
    assert_eq!(evidence[0].outcome, NodeOutcome::Missing);
    assert_eq!(nodes.get(0, &key), None, "extend re-created the key");
    assert_eq!(nodes.get(1, &key), None, "extend re-created the key");
}

#[test]
fn a_release_without_a_quorum_is_uncertain_and_the_nodes_send_it_on_their_own() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("release-retry");
    let group = nodes.group(&prefix, options(200));
    let key = format!("{prefix}job");
    let guard = take(&group, "job", Duration::from_secs(30));
    held_everywhere(&nodes, &key);
    nodes.watched_by(1);
    nodes.proxies[0].set_mode(Mode::Blackhole);
    nodes.proxies[1].set_mode(Mode::Blackhole);
    // One node of three confirmed: the release may or may not have happened
    // on the other two, as far as anyone can tell.
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Uncertain);
    assert_eq!(nodes.get(2, &key), None);

    // The two nodes reconnect in the background, kill the connections whose
    // release got no reply, and send the release again on their own.
    nodes.proxies[0].set_mode(Mode::Pass);
    nodes.proxies[1].set_mode(Mode::Pass);
    wait_until(
        Duration::from_secs(10),
        "every node to drop the key",
        || nodes.get(0, &key).is_none() && nodes.get(1, &key).is_none(),
    );
}

#[test]
fn bounded_waits_poll_and_cancel() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("waits");
    let group = nodes.group(&prefix, options(100));
    let ttl = Duration::from_secs(10);
    let holder = take(&group, "job", ttl);

    let started = Instant::now();
    assert!(
        group
            .lock("job")
            .unwrap()
            .acquire_timeout(ttl, Duration::from_millis(300))
            .unwrap()
            .is_none()
    );
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");

    // A waiter gets the lock once the holder releases it.
    thread::scope(|s| {
        let attempts = || script_calls(&mut nodes.servers[0].client());
        let before = attempts();
        let waiter = s.spawn(|| {
            group
                .lock("job")
                .unwrap()
                .acquire_timeout(ttl, Duration::from_secs(10))
                .unwrap()
        });
        // The release comes after the waiter's first attempt was refused.
        wait_until(Duration::from_secs(5), "the waiter's attempt", || {
            attempts() > before
        });
        assert_eq!(holder.release().unwrap(), ReleaseOutcome::Released);
        let got = waiter.join().unwrap();
        assert!(got.is_some(), "the waiter got the lock after the release");
        // Cancellation wakes an unbounded wait.
        let cancel = CancelToken::new();
        let waiter = {
            let (group, cancel) = (&group, cancel.clone());
            s.spawn(move || group.lock("job").unwrap().acquire(ttl, &cancel))
        };
        let before = attempts();
        wait_until(Duration::from_secs(5), "the waiter's attempt", || {
            attempts() > before
        });
        let cancelled_at = Instant::now();
        cancel.cancel();
        assert!(matches!(waiter.join().unwrap(), Err(Error::Cancelled)));
        let took = cancelled_at.elapsed();
        assert!(took < Duration::from_secs(2), "{took:?}");
        drop(got);
    });
}

// ---------------------------------------------------------------- faults

/// Timing tests and the safety campaigns take this so that none of them runs
/// beside another and skews its figures.
static EXCLUSIVE: Mutex<()> = Mutex::new(());

fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    EXCLUSIVE.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn five_nodes_survive_two_kills_and_fail_fast_on_three() {
    let _x = exclusive();
    let nodes = Nodes::start(5);
    let prefix = unique_prefix("kills");
    // Dead nodes answer at once (their connections are refused): an
    // operation that waited for them instead would wait this long.
    let node_timeout = Duration::from_secs(5);
    let group = nodes.group(&prefix, options(5_000));
    let ttl = Duration::from_secs(30);
    drop(take(&group, "warm", ttl));

    nodes.servers[0].kill();
    nodes.servers[1].kill();
    let started = Instant::now();
    let guard = group
        .lock("a")
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .expect("three of five nodes grant");
    let took = started.elapsed();
    eprintln!("5 nodes, 2 killed: acquired in {took:?}");
    assert!(took < node_timeout / 2, "{took:?}");
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);

    nodes.servers[2].kill();
    let started = Instant::now();
    let err = group.lock("b").unwrap().try_acquire(ttl).unwrap_err();
    let took = started.elapsed();
    eprintln!("5 nodes, 3 killed: failed in {took:?}: {err}");
    assert!(took < node_timeout / 2, "failing took {took:?}");
    let Error::QuorumNotReached {
        op,
        confirmed,
        needed,
        nodes: evidence,
    } = &err
    else {
        panic!("expected QuorumNotReached, got {err:?}");
    };
    // Decided as soon as three nodes failed: the other two may be abandoned.
    assert_eq!((*op, *needed), ("acquire", 3));
    assert!(*confirmed <= 2);
    assert_eq!(evidence.len(), 5);
    for (i, report) in evidence.iter().enumerate() {
        assert_eq!(report.node, nodes.proxies[i].url(), "node {i} named");
        assert!(err.to_string().contains(&nodes.proxies[i].url()));
        if i < 3 {
            assert!(
                matches!(
                    report.outcome,
                    NodeOutcome::Failed(_) | NodeOutcome::NotConnected(_) | NodeOutcome::TimedOut
                ),
                "killed node {i}: {report:?}"
            );
        } else {
            assert!(
                matches!(
                    report.outcome,
                    NodeOutcome::Granted | NodeOutcome::Abandoned
                ),
                "node {i}: {report:?}"
            );
        }
    }
    assert!(err.is_retryable());
    // The two grants of the failed attempt are released.
    let key = format!("{prefix}b");
    wait_until(
        Duration::from_secs(5),
        "the failed attempt's release",
        || nodes.get(3, &key).is_none() && nodes.get(4, &key).is_none(),
    );
}

#[test]
fn one_blackholed_node_of_five_does_not_slow_acquire() {
    let _x = exclusive();
    let nodes = Nodes::start(5);
    let prefix = unique_prefix("blackhole");
    // A node timeout far longer than the whole run: an operation that waited
    // for the blackholed node, even once, would wait all of it.
    let group = nodes.group(&prefix, options(30_000));
    let ttl = Duration::from_secs(120);
    let stop = AtomicBool::new(false);
    let run = |label: &str| {
        let mut acquire = Vec::new();
        let mut release = Vec::new();
        for _ in 0..300 {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            let t = Instant::now();
            let guard = group
                .lock("job")
                .unwrap()
                .try_acquire(ttl)
                .unwrap()
                .expect("free");
            acquire.push(t.elapsed());
            let t = Instant::now();
            assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
            release.push(t.elapsed());
        }
        let max = *acquire.iter().max().unwrap();
        let (acquire, release) = (median(acquire), median(release));
        eprintln!("{label}: acquire median {acquire:?} (max {max:?}), release median {release:?}");
    };
    run("warm-up");
    run("5 healthy nodes");
    nodes.proxies[4].set_mode(Mode::Blackhole);
    // The blackholed node never answers: 300 acquires and releases end only
    // if each is decided by the other four, without waiting for it.
    let done = AtomicBool::new(false);
    thread::scope(|s| {
        s.spawn(|| {
            run("1 of 5 blackholed");
            done.store(true, Ordering::SeqCst);
        });
        let finished =
            support::true_within(Duration::from_secs(20), || done.load(Ordering::SeqCst));
        stop.store(true, Ordering::SeqCst);
        assert!(
            finished,
            "300 acquires and releases with one node blackholed did not end within 20 s \
             (one that waited for that node would wait its 30 s node timeout)"
        );
    });
    // The blackholed node's queue (every acquire and release sent there)
    // ends with its connection, so that the group's drop does not wait for it.
    nodes.proxies[4].reset_all();
}

#[test]
fn dropping_a_guard_waits_at_most_the_node_timeout_for_a_blackholed_majority() {
    let _x = exclusive();
    let nodes = Nodes::start(5);
    let prefix = unique_prefix("blackhole-drop");
    let node_timeout = Duration::from_millis(500);
    let group = nodes.group(&prefix, options(500));
    let guard = take(&group, "drop", Duration::from_secs(10));
    for p in &nodes.proxies[1..4] {
        p.set_mode(Mode::Blackhole);
    }
    let t = Instant::now();
    drop(guard);
    let took = t.elapsed();
    eprintln!("drop with 3 of 5 blackholed: {took:?}");
    // The documented bound, against what a drop that waited for the
    // blackholed nodes one after another, or twice, would take.
    assert!(took < node_timeout * 2, "{took:?}");
    for p in &nodes.proxies[1..4] {
        p.reset_all();
    }
}

#[test]
fn fan_out_is_parallel_behind_2ms_delays() {
    let _x = exclusive();
    let nodes = Nodes::start(5);
    for p in &nodes.proxies {
        p.set_mode(Mode::Delay(Duration::from_millis(2)));
    }
    let prefix = unique_prefix("delay");
    let group = nodes.group(&prefix, options(200));
    let single = coordinator(&nodes.proxies[0].url(), &prefix, Duration::from_millis(500))
        .lock("single")
        .unwrap();
    let ttl = Duration::from_secs(10);
    let (mut ours, mut one) = (Vec::new(), Vec::new());
    for i in 0..60 {
        let t = Instant::now();
        let guard = single.try_acquire(ttl).unwrap().unwrap();
        let took = t.elapsed();
        guard.release().unwrap();
        let t = Instant::now();
        let g = take(&group, "job", ttl);
        let took_group = t.elapsed();
        assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
        if i >= 10 {
            one.push(took);
            ours.push(took_group);
        }
    }
    let (ours, one) = (median(ours), median(one));
    let ratio = ours.as_secs_f64() / one.as_secs_f64();
    // A figure, not a check (a serial fan-out would be about 5 times one
    // node's); the check is below.
    eprintln!("behind 2 ms delays: 5-node acquire {ours:?}, one node's {one:?}, ratio {ratio:.2}");
    // No node's reply comes back: a fan-out that waited for one node before
    // sending to the next would reach one node within the node timeout.
    // Every node gets the acquire.
    // A group of its own, connected and idle: nothing of the loop above is
    // still in flight on its nodes.
    let idle = nodes.group(&prefix, options(200));
    for p in &nodes.proxies {
        p.set_mode(Mode::DropServerToClient);
    }
    let key = format!("{prefix}unanswered");
    let attempt = idle.attempt("unanswered", ttl).unwrap();
    assert!(!attempt.is_acquired(), "{:?}", attempt.nodes());
    // Decided once three timed out (no quorum of 3 is left then), or at the
    // deadline: the others timed out too, or were abandoned if their
    // workers' timeouts came in a moment later.
    assert!(
        attempt
            .nodes()
            .iter()
            .all(|n| matches!(n.outcome, NodeOutcome::TimedOut | NodeOutcome::Abandoned)),
        "sent to every node, answered by none: {:?}",
        attempt.nodes()
    );
    assert!(
        attempt
            .nodes()
            .iter()
            .filter(|n| n.outcome == NodeOutcome::TimedOut)
            .count()
            >= 3,
        "{:?}",
        attempt.nodes()
    );
    wait_until(
        Duration::from_secs(5),
        "every node to get the acquire",
        || (0..nodes.servers.len()).all(|i| nodes.get(i, &key).is_some()),
    );
}

/// Three nodes, the third `one_way` away once every worker is connected (a
/// node timeout of 1 s); the group and the key `job` under its prefix.
fn with_a_slow_third_node(name: &str, one_way: Duration) -> (Nodes, RedlockGroup, String) {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix(name);
    let group = nodes.group(&prefix, options(1000));
    drop(
        group
            .lock("warm")
            .unwrap()
            .try_acquire(Duration::from_secs(10))
            .unwrap(),
    );
    nodes.proxies[2].set_mode(Mode::Delay(one_way));
    (nodes, group, format!("{prefix}job"))
}

#[test]
fn a_late_grant_from_a_slow_node_is_released_by_owner_token() {
    let _x = exclusive();
    let (nodes, group, key) = with_a_slow_third_node("late", Duration::from_millis(150));
    let attempt = group.attempt("job", Duration::from_secs(10)).unwrap();
    eprintln!(
        "one node 300 ms slow: acquired in {:?}: {:?}",
        attempt.elapsed(),
        attempt.nodes()
    );
    assert!(attempt.is_acquired());
    assert_eq!(attempt.nodes()[2].outcome, NodeOutcome::Abandoned);
    let guard = attempt.into_guard().unwrap();
    wait_until(Duration::from_secs(5), "the late grant to land", || {
        nodes.get(2, &key).is_some()
    });
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    wait_until(
        Duration::from_secs(5),
        "the late grant to be released",
        || nodes.get(2, &key).is_none(),
    );
}

#[test]
fn an_extension_on_every_node_says_what_the_slow_one_holds() {
    let _x = exclusive();
    let (nodes, group, key) = with_a_slow_third_node("hear-all", Duration::from_millis(100));
    let guard = group
        .lock("job")
        .unwrap()
        .try_acquire(Duration::from_secs(10))
        .unwrap()
        .expect("a free key");
    let heard = || -> Vec<NodeOutcome> {
        let ttl = Duration::from_secs(10);
        assert!(
            guard.extend_on_every_node(ttl).unwrap(),
            "a quorum holds it"
        );
        guard
            .last_evidence()
            .into_iter()
            .map(|n| n.outcome)
            .collect()
    };
    // The slow node's late grant is confirmed like the others'.
    let outcomes = heard();
    assert!(
        outcomes.iter().all(|o| *o == NodeOutcome::Granted),
        "{outcomes:?}"
    );
    // Another owner's value there now: the quorum still holds the lock, and
    // the slow node's answer says it does not.
    let () = nodes.servers[2].client().set(&key, "another").unwrap();
    let outcomes = heard();
    assert_eq!(outcomes[..2], [NodeOutcome::Granted, NodeOutcome::Granted]);
    assert!(
        matches!(
            outcomes[2],
            NodeOutcome::HeldByAnother { .. } | NodeOutcome::Missing
        ),
        "{outcomes:?}"
    );
    assert_eq!(nodes.get(2, &key).as_deref(), Some("another"));
}

#[test]
fn extend_does_not_count_a_node_that_restarted() {
    let nodes = Nodes::start_with(3, true);
    let prefix = unique_prefix("restart-extend");
    let group = nodes.group(&prefix, options(200));
    let key = format!("{prefix}job");
    let ttl = Duration::from_secs(30);
    let guard = take(&group, "job", ttl);
    held_everywhere(&nodes, &key);
    // Node 1 loses the key: nodes 0 and 2 must both count from now on.
    let _: () = nodes.servers[1].client().del(&key).unwrap();
    assert!(
        guard.reset_expiry(ttl).unwrap(),
        "nodes 0 and 2 still hold it"
    );

    // With appendfsync always the key survives node 0's restart, but a node
    // that restarted may as well have lost it: it no longer counts.
    nodes.servers[0].restart();
    assert!(nodes.get(0, &key).is_some(), "the key was persisted");
    match guard.reset_expiry(ttl) {
        Ok(held) => assert!(!held, "one unrestarted holder is no quorum"),
        // The restart closed node 0's idle connection, which the extension
        // found first, or the node's watcher had already reported the
        // restart; the node reconnects in the background.
        Err(Error::QuorumNotReached {
            nodes: evidence, ..
        }) => {
            assert!(
                matches!(&evidence[0].outcome, NodeOutcome::Failed(_))
                    || matches!(&evidence[0].outcome, NodeOutcome::NotSent(why) if why.contains("restarted")),
                "{evidence:?}"
            );
            wait_until(Duration::from_secs(5), "node 0 to reconnect", || {
                group.nodes()[0].connected
            });
            assert!(
                !guard.reset_expiry(ttl).unwrap(),
                "one unrestarted holder is no quorum"
            );
        }
        Err(e) => panic!("expected a refusal, got {e:?}"),
    }
    assert!(guard.is_lost());
    let evidence = guard.last_evidence();
    eprintln!("extend after a restart: {evidence:?}");
    // Not counted, or not even asked once its watcher reported the restart.
    assert!(
        matches!(&evidence[0].outcome, NodeOutcome::Uncounted(why) | NodeOutcome::NotSent(why) if why.contains("restarted")),
        "{evidence:?}"
    );
    assert_eq!(evidence[1].outcome, NodeOutcome::Missing);
    // Decided once nodes 0 and 1 refused: node 2 may not have answered yet.
    assert!(matches!(
        evidence[2].outcome,
        NodeOutcome::Granted | NodeOutcome::Abandoned
    ));
}

#[test]
fn restart_delay_keeps_a_node_that_lost_its_data_out() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("restart-delay");
    let group = nodes.group(&prefix, options(200));
    let key = format!("{prefix}job");
    let ttl = Duration::from_secs(30);
    let first = take(&group, "job", ttl);
    held_everywhere(&nodes, &key);
    let delay = Duration::from_secs(2);
    wait_until(Duration::from_secs(10), "node 2 to be up for 2 s", || {
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query(&mut nodes.servers[2].client())
            .unwrap();
        info.lines()
            .filter_map(|l| l.trim().strip_prefix("uptime_in_seconds:"))
            .any(|secs| secs.parse::<u64>().unwrap() >= 2)
    });
    // Two nodes restart without persistence: they forget the lock.
    nodes.servers[0].restart();
    nodes.servers[1].restart();
    assert_eq!(nodes.get(0, &key), None);

    // With the restart delay, they take no new lock yet.
    let careful = nodes.group(
        &prefix,
        RedlockOptions {
            restart_delay: Some(delay),
            ..options(200)
        },
    );
    let attempt = careful.attempt("job", ttl).unwrap();
    eprintln!("with restart delay: {:?}", attempt.nodes());
    assert!(!attempt.is_acquired());
    // Decided once two nodes refused: the third may be abandoned.
    let kept_out = attempt
        .nodes()
        .iter()
        .filter(
            |n| matches!(&n.outcome, NodeOutcome::NotSent(why) if why.contains("restart delay")),
        )
        .count();
    assert!(kept_out >= 1, "{:?}", attempt.nodes());
    for n in &attempt.nodes()[..2] {
        assert!(
            matches!(&n.outcome, NodeOutcome::NotSent(_) | NodeOutcome::Abandoned),
            "{:?}",
            attempt.nodes()
        );
    }
    // Contention if node 2 answered first, else two nodes unavailable.
    match attempt.into_result() {
        Ok(None) | Err(Error::QuorumNotReached { .. }) => {}
        other => panic!("expected no lock, got {other:?}"),
    }

    // Without it, a second holder gets a majority: the failure the rule
    // prevents. The first holder was told as the nodes went away. (The wait
    // rides out the connections the restarts closed.)
    assert!(
        first.is_lost(),
        "two of the three nodes that granted it went away"
    );
    let second = group
        .lock("job")
        .unwrap()
        .acquire_timeout(ttl, Duration::from_secs(5))
        .unwrap();
    assert!(second.is_some());
}

/// How many connections named `name` node `i`'s server lists.
fn clients_named(nodes: &Nodes, i: usize, name: &str) -> usize {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut nodes.servers[i].client())
        .unwrap();
    list.lines()
        .filter(|l| l.contains(&format!(" name={name} ")))
        .count()
}

#[test]
fn a_lock_is_lost_as_soon_as_a_node_it_needs_goes_away_without_its_data() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("restart-loss");
    let key = format!("{prefix}job");
    let ttl = Duration::from_secs(30);
    let group = nodes.group(&prefix, options(200));
    let other = nodes.group(&prefix, options(200));
    // Node 2 is taken, so the first holder has exactly a quorum: 0 and 1.
    let _: () = nodes.servers[2]
        .client()
        .pset_ex(&key, "someone-else", 60_000)
        .unwrap();
    let first = group
        .lock("job")
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .expect("nodes 0 and 1");
    // The attempt returned at the quorum; node 2's `SET NX` may still be on
    // its way, and would take the key once it is deleted. Node 2's worker
    // sends `PTTL` only after its `SET NX` found the key held: one call shows
    // the lock was refused there.
    wait_until(Duration::from_secs(5), "node 2 to refuse the lock", || {
        nodes.servers[2].command_calls("pttl") >= 1
    });
    let _: () = nodes.servers[2].client().del(&key).unwrap();
    // Both groups' watchers, subscribed (a watcher subscribes once it has
    // read the node's run id, and only from then on reports it gone): the
    // first holder's must be watching to hear the node go away.
    wait_until(Duration::from_secs(5), "node 0 to be watched", || {
        watchers_on(&nodes.servers[0]) == 2
    });
    assert!(!first.is_lost());
    // Node 0 goes away without persistence: when it comes back it will have
    // forgotten the lock, and with node 2 it is a quorum for anyone. While it
    // is down only its watcher's news can flag the lock: wait for that
    // before starting it again, so the flag cannot come from the new run id.
    nodes.servers[0].kill();
    let killed = Instant::now();
    wait_until(
        Duration::from_secs(5),
        "the first holder to be told",
        || first.is_lost(),
    );
    eprintln!("flagged lost {:?} after the kill", killed.elapsed());
    assert!(!nodes.servers[0].is_running());
    nodes.servers[0].restart();
    assert_eq!(nodes.get(0, &key), None);
    let second = other
        .lock("job")
        .unwrap()
        .acquire_timeout(ttl, Duration::from_secs(5))
        .unwrap();
    assert!(second.is_some(), "nodes 0 and 2 make a quorum");
    assert!(first.is_lost());
    assert!(first.reset_expiry(ttl).is_ok_and(|held| !held));
}

/// How many group watchers are subscribed on `server` (a watcher subscribes
/// once it has read the node's run id, and only from then on reports it gone).
fn watchers_on(server: &TestServer) -> u64 {
    let (_, subscribed): (String, u64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg("respire-redlock-watch")
        .query(&mut server.client())
        .unwrap();
    subscribed
}

#[test]
fn a_node_whose_watcher_never_reached_it_stops_counting_when_another_goes_away() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("unwatched");
    let key = format!("{prefix}job");
    let ttl = Duration::from_secs(30);
    // Node 2's proxy forwards two more connections: the coordinator's, made
    // first, and the group's worker's, made before the watchers start. Its
    // watcher's connection is held without an answer, so it can never see
    // the server go away or come back without its data.
    nodes.proxies[2].admit_only(2);
    let group = nodes.group(&prefix, options(200));
    let first = group
        .lock("job")
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .expect("all three nodes");
    // The attempt returned at the quorum, perhaps before node 2's grant.
    wait_until(
        Duration::from_secs(5),
        "node 2 to grant the lock too",
        || nodes.get(2, &key).is_some(),
    );
    wait_until(Duration::from_secs(5), "node 0 to be watched", || {
        watchers_on(&nodes.servers[0]) == 1
    });
    // The watcher's second try: its first connection ran out of time (the
    // connect timeout, 2 s). The lock still stands on nodes 0 and 1.
    wait_until(
        Duration::from_secs(10),
        "node 2's watcher to try again",
        || nodes.proxies[2].turned_away() >= 2,
    );
    assert!(!first.is_lost(), "nodes 0 and 1 are watched and up");
    // Node 0 goes away. Nodes 1 and 2 hold the key, but node 2 may have
    // restarted without it unseen: without a restart delay, only node 1 can
    // be counted on, fewer than the quorum of 2.
    nodes.servers[0].kill();
    let killed = Instant::now();
    wait_until(Duration::from_secs(5), "the holder to be told", || {
        first.is_lost()
    });
    eprintln!("flagged lost {:?} after the kill", killed.elapsed());
}

#[test]
fn keep_alive_extends_and_flags_loss_before_validity_ends() {
    let _x = exclusive();
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("keepalive");
    let group = nodes.group(&prefix, options(50));
    let ttl = Duration::from_millis(600);
    let guard = take(&group, "job", ttl);
    assert!(matches!(
        take(&group, "short", Duration::from_millis(150)).keep_alive(),
        Err(Error::InvalidArgument(_))
    ));
    let keep = guard.keep_alive().unwrap();
    let held_since = Instant::now();
    wait_until(
        Duration::from_secs(10),
        "three TTLs to pass while held",
        || {
            assert!(!guard.is_lost(), "lost while all nodes answer");
            held_since.elapsed() > ttl * 3
        },
    );
    assert!(guard.remaining_estimate() > Duration::ZERO);

    // A majority stops answering: loss is flagged before validity ends.
    nodes.proxies[0].set_mode(Mode::Blackhole);
    nodes.proxies[1].set_mode(Mode::Blackhole);
    let mut valid_until = Instant::now() + guard.remaining_estimate();
    let lost_at = loop {
        match guard.lost_signal().recv_timeout(Duration::from_millis(1)) {
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                let estimate = guard.remaining_estimate();
                if !estimate.is_zero() {
                    valid_until = valid_until.max(Instant::now() + estimate);
                }
                assert!(held_since.elapsed() < Duration::from_secs(10), "never lost");
            }
            _ => break Instant::now(),
        }
    };
    assert!(guard.is_lost() && keep.is_lost());
    let margin = valid_until.saturating_duration_since(lost_at);
    eprintln!("keep-alive flagged loss {margin:?} before the validity ended");
    assert!(lost_at < valid_until, "loss flagged after validity ended");
}

/// When `key` expires on `server`, on this machine's monotonic clock, from
/// the server's own `PEXPIRETIME` and `TIME` (taken as read at the instant
/// before they were asked for, so never later than the truth); `None` when
/// the server has no such key.
fn server_expiry(server: &TestServer, key: &str) -> Option<Instant> {
    let mut c = server.client();
    let asked = Instant::now();
    let (at_ms, (secs, micros)): (i64, (i64, i64)) = redis::pipe()
        .cmd("PEXPIRETIME")
        .arg(key)
        .cmd("TIME")
        .query(&mut c)
        .unwrap();
    if at_ms < 0 {
        return None;
    }
    let left_us = at_ms * 1_000 - (secs * 1_000_000 + micros);
    Some(if left_us >= 0 {
        asked + Duration::from_micros(left_us as u64)
    } else {
        asked - Duration::from_micros(left_us.unsigned_abs())
    })
}

/// When fewer than a quorum of `nodes` still hold `key`, by the servers'
/// clocks (see [`server_expiry`]); `None` if fewer than a quorum hold it now.
fn quorum_expiry(nodes: &Nodes, key: &str) -> Option<Instant> {
    let mut ends: Vec<Instant> = nodes
        .servers
        .iter()
        .filter_map(|s| server_expiry(s, key))
        .collect();
    ends.sort_unstable_by(|a, b| b.cmp(a));
    ends.get(nodes.servers.len() / 2).copied()
}

#[test]
fn loss_is_flagged_before_a_quorum_of_servers_expires_the_lock() {
    let _x = exclusive();
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("loss-oracle");
    let group = nodes.group(&prefix, options(50));
    let key = format!("{prefix}job");
    let ttl = Duration::from_millis(800);
    let guard = group
        .lock("job")
        .unwrap()
        .acquire_timeout(ttl, Duration::from_secs(5))
        .unwrap()
        .expect("nobody else holds it");
    let keep = guard.keep_alive().unwrap();
    let lost = guard.lost_signal().clone();
    let held_since = Instant::now();
    wait_until(
        Duration::from_secs(10),
        "two TTLs to pass while held",
        || {
            assert!(!guard.is_lost(), "lost while all nodes answer");
            held_since.elapsed() > ttl * 2
        },
    );
    // The renewals stop reaching a majority: the lock must be flagged lost
    // before the servers' own clocks end it on a quorum.
    nodes.proxies[0].set_mode(Mode::Blackhole);
    nodes.proxies[1].set_mode(Mode::Blackhole);
    let cut = Instant::now();
    match lost.recv_timeout(ttl * 4) {
        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {}
        other => panic!("not flagged lost {:?} after the cut: {other:?}", ttl * 4),
    }
    let lost_at = Instant::now();
    assert!(guard.is_lost() && keep.is_lost());
    // Read after the loss: whatever reached the servers before the cut is in.
    let ends = quorum_expiry(&nodes, &key).unwrap_or_else(|| {
        panic!(
            "the servers no longer hold it on a quorum {:?} after the cut, when the guard \
             was flagged lost {:?} after it",
            cut.elapsed(),
            lost_at - cut
        )
    });
    eprintln!(
        "flagged lost {:?} after the cut, {:?} before a quorum of servers expire it",
        lost_at - cut,
        ends.saturating_duration_since(lost_at)
    );
    assert!(
        lost_at < ends,
        "flagged lost {:?} after a quorum of servers expired the lock",
        lost_at - ends
    );
    drop(keep);
    nodes.proxies[0].set_mode(Mode::Pass);
    nodes.proxies[1].set_mode(Mode::Pass);
}

#[test]
fn a_lock_granted_over_slow_links_is_bounded_from_the_send_of_its_attempt() {
    let _x = exclusive();
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("slow-grant");
    let group = nodes.group(&prefix, options(600));
    let key = format!("{prefix}job");
    let ttl = Duration::from_secs(3);
    // Every request reaches its server 150 ms late and every reply comes
    // back 150 ms late: the servers start the TTL half a round trip after
    // the attempt went out, and the reply comes a whole one after.
    for proxy in &nodes.proxies {
        proxy.set_mode(Mode::Delay(Duration::from_millis(150)));
    }
    let guard = group
        .lock("job")
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .expect("nobody holds it");
    let looked = Instant::now();
    let believed_until = looked + guard.remaining_estimate();
    for proxy in &nodes.proxies {
        proxy.set_mode(Mode::Pass);
    }
    // Read directly from the servers, by their clocks (see `server_expiry`).
    let ends = quorum_expiry(&nodes, &key).expect("held on a quorum");
    eprintln!(
        "the guard's bound is {:?} before a quorum of servers expire the lock",
        ends.saturating_duration_since(believed_until)
    );
    assert!(
        believed_until <= ends,
        "the guard counts on the lock {:?} past a quorum of servers' expiry",
        believed_until - ends
    );
}

#[test]
fn release_reports_whether_a_quorum_still_held_the_lock() {
    let _x = exclusive();
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("release-outcome");
    let group = nodes.group(&prefix, options(200));
    let key = format!("{prefix}job");
    let ttl = Duration::from_secs(30);

    // Held on every node but one: still deleted on a quorum.
    let guard = take(&group, "job", ttl);
    held_everywhere(&nodes, &key);
    let _: () = nodes.servers[0].client().del(&key).unwrap();
    assert_eq!(
        guard.release().unwrap(),
        ReleaseOutcome::Released,
        "two of three still held it"
    );
    dropped_everywhere(&nodes, &key);

    // Gone from two nodes before the release: it had lapsed.
    let guard = take(&group, "job", ttl);
    held_everywhere(&nodes, &key);
    for i in [0, 1] {
        let _: () = nodes.servers[i].client().del(&key).unwrap();
    }
    assert_eq!(
        guard.release().unwrap(),
        ReleaseOutcome::Expired,
        "a release that deleted it on one node of three reports it lapsed"
    );
    dropped_everywhere(&nodes, &key);

    // Another owner's on two nodes: theirs stays, and the release says so.
    let guard = take(&group, "job", ttl);
    held_everywhere(&nodes, &key);
    for i in [0, 1] {
        let _: () = nodes.servers[i].client().set(&key, "someone-else").unwrap();
    }
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::TakenOver);
    for i in [0, 1] {
        assert_eq!(nodes.get(i, &key).as_deref(), Some("someone-else"));
    }
    wait_until(Duration::from_secs(5), "node 2 to drop the key", || {
        nodes.get(2, &key).is_none()
    });

    // Two nodes reconnecting after an extension they did not answer: their
    // releases wait for the kills, and nothing is counted before its reply.
    for i in [0, 1] {
        let _: () = nodes.servers[i].client().del(&key).unwrap();
    }
    let guard = take(&group, "job", ttl);
    held_everywhere(&nodes, &key);
    nodes.watched_by(1);
    nodes.proxies[0].set_mode(Mode::Blackhole);
    nodes.proxies[1].set_mode(Mode::Blackhole);
    assert!(matches!(
        guard.reset_expiry(ttl),
        Err(Error::QuorumNotReached { .. })
    ));
    // Only node 2 can confirm (if it answers in time): no quorum.
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Uncertain);
    assert_eq!(nodes.get(0, &key).is_some(), nodes.get(1, &key).is_some());
    nodes.proxies[0].set_mode(Mode::Pass);
    nodes.proxies[1].set_mode(Mode::Pass);
    // The kept releases delete it on every node.
    dropped_everywhere(&nodes, &key);
}

#[test]
fn an_extension_without_a_quorum_bounds_the_lock_by_its_worst_case() {
    let _x = exclusive();
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("extend-worst");
    let group = nodes.group(&prefix, options(100));
    let key = format!("{prefix}job");
    let guard = take(&group, "job", Duration::from_secs(10));
    held_everywhere(&nodes, &key);
    nodes.watched_by(1);
    nodes.proxies[0].set_mode(Mode::Blackhole);
    nodes.proxies[1].set_mode(Mode::Blackhole);

    // A longer TTL that only one node confirmed counts for nothing.
    // Read so that `bound` is at or after the guard's bound, `believed`
    // at or before it.
    let left = guard.remaining_estimate();
    let bound = Instant::now() + left;
    match guard.reset_expiry(Duration::from_secs(60)) {
        Err(Error::QuorumNotReached { confirmed, .. }) => assert!(confirmed <= 1),
        other => panic!("expected QuorumNotReached, got {other:?}"),
    }
    assert!(!guard.is_lost());
    let believed = Instant::now() + guard.remaining_estimate();
    assert!(
        believed <= bound,
        "an extension one node of three confirmed moved the bound"
    );
    wait_until(Duration::from_secs(5), "node 2 to apply it", || {
        let pttl: i64 = nodes.servers[2].client().pttl(&key).unwrap();
        pttl > 30_000
    });
    let ends = quorum_expiry(&nodes, &key).expect("a quorum holds it");
    assert!(
        Instant::now() + guard.remaining_estimate() <= ends,
        "the guard's bound is past the quorum's expiry"
    );

    // A shorter one bounds the lock from its send, confirmed or not.
    match guard.reset_expiry(Duration::from_secs(2)) {
        Err(Error::QuorumNotReached { .. }) => {}
        other => panic!("expected QuorumNotReached, got {other:?}"),
    }
    assert!(
        guard.remaining_estimate() <= Duration::from_secs(2),
        "a shorter extension without a verdict left a longer belief: {:?}",
        guard.remaining_estimate()
    );
    nodes.proxies[0].set_mode(Mode::Pass);
    nodes.proxies[1].set_mode(Mode::Pass);
}

// ---------------------------------------------------------------- distances

#[test]
fn a_group_tries_every_node_at_once() {
    let nodes = Nodes::start(5);
    // Every proxy holds its connections open without a byte forwarded: each
    // node's connect waits out the connect timeout (2 s).
    for p in &nodes.proxies {
        p.admit_only(0);
    }
    let urls = nodes.urls();
    std::thread::scope(|s| {
        let made = s.spawn(|| RedlockGroup::connect(&refs(&urls), RedlockOptions::default()));
        // Tried one after another, the second node would be tried only once
        // the first had timed out.
        wait_until(
            Duration::from_secs(1),
            "every node to be tried while the others are held",
            || nodes.proxies.iter().all(|p| p.turned_away() >= 1),
        );
        let made = made.join().expect("connect does not panic");
        assert!(made.is_err(), "no node answered");
    });
}

#[test]
fn five_nodes_20ms_away_work_with_default_options() {
    let _x = exclusive();
    let nodes = Nodes::start(5);
    nodes.delay_all(Duration::from_millis(20));
    let one_round_trip = ping_round_trip(&nodes.proxies[0].url(), 10);
    let one_connect = connect_time(nodes.proxies[0].addr(), 5);
    let urls = nodes.urls();
    let t = Instant::now();
    let group = RedlockGroup::connect(&refs(&urls), RedlockOptions::default()).unwrap();
    let created = t.elapsed();
    for node in group.nodes() {
        assert!(node.connected, "{node:?}");
        let rtt = node.round_trip.expect("measured");
        assert!(rtt >= Duration::from_millis(20), "{node:?}");
    }
    // Two connections a node, as documented: the worker's, and the
    // watcher's, which connects on a thread of its own.
    let connections = || -> Vec<usize> {
        nodes
            .proxies
            .iter()
            .map(FaultProxy::connection_count)
            .collect()
    };
    wait_until(
        Duration::from_secs(5),
        "every node's worker and watcher connected",
        || connections() == [2; 5],
    );
    let p50 = acquire_median(&group, "job", 10, Duration::from_secs(3));
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    eprintln!(
        "5 nodes 20 ms away, default options: created in {created:?} ({:.2}x one node's \
         connect {one_connect:?}); acquire p50 {p50:?} ({:.2}x one round trip {one_round_trip:?})",
        ratio(created, one_connect),
        ratio(p50, one_round_trip)
    );
    // That the nodes are connected at once, not one after another, is
    // `a_group_tries_every_node_at_once`'s check; the time is a figure.
    // One round trip an acquire: no connect inside it, no script sent again
    // after a NOSCRIPT.
    assert_eq!(
        connections(),
        [2; 5],
        "connections opened during the acquires"
    );
    for server in &nodes.servers {
        let errors: String = redis::cmd("INFO")
            .arg("errorstats")
            .query(&mut server.client())
            .unwrap();
        assert!(!errors.contains("errorstat_NOSCRIPT"), "{errors}");
    }
}

#[test]
fn five_nodes_50ms_away_need_the_documented_node_timeout() {
    let _x = exclusive();
    let nodes = Nodes::start(5);
    nodes.delay_all(Duration::from_millis(50));
    let urls = nodes.urls();
    let t = Instant::now();
    let refused = RedlockGroup::connect(&refs(&urls), RedlockOptions::default());
    let took = t.elapsed();
    let e = refused.expect_err("a node timeout too short for the links");
    match &e {
        Error::NodeTimeoutTooShort {
            node,
            round_trip,
            node_timeout,
            needed,
        } => {
            assert!(urls.contains(node), "{e}");
            assert!(*round_trip >= Duration::from_millis(50), "{e}");
            assert_eq!(*node_timeout, Duration::from_millis(50));
            assert!(*needed >= *round_trip * 2, "{e}");
            assert!(!e.is_retryable());
        }
        other => panic!("expected NodeTimeoutTooShort, got {other:?}"),
    }
    eprintln!("5 nodes 50 ms away, default options: refused in {took:?}: {e}");
    let message = e.to_string();
    assert!(message.contains("round trip is"), "{message}");

    // With the documented setting (at least twice the round trip):
    let options = RedlockOptions {
        node_timeout: Duration::from_millis(150),
        ..RedlockOptions::default()
    };
    let group = RedlockGroup::connect(&refs(&urls), options).unwrap();
    let p50 = acquire_median(&group, "job", 5, Duration::from_secs(3));
    eprintln!("5 nodes 50 ms away, node timeout 150 ms: acquire p50 {p50:?}");
    // Every acquire was granted at its first attempt: one `SET` per node
    // each, none timed out and sent again.
    for (i, server) in nodes.servers.iter().enumerate() {
        assert_eq!(server.command_calls("set"), 5, "node {i}");
    }
}

#[test]
fn a_far_minority_and_a_dead_node_cost_only_what_the_quorum_needs() {
    let _x = exclusive();
    let nodes = Nodes::start(5);
    nodes.delay_all(Duration::from_millis(20));
    let options = RedlockOptions {
        node_timeout: Duration::from_millis(500),
        ..RedlockOptions::default()
    };
    let group = RedlockGroup::connect(&refs(&nodes.urls()), options).unwrap();
    let wait = Duration::from_secs(3);
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    let healthy = acquire_median(&group, "job", 10, wait);
    eprintln!("5 nodes 20 ms away: acquire p50 {healthy:?}");

    // Two nodes 200 ms away: the three near ones make the quorum.
    for p in &nodes.proxies[3..] {
        p.set_mode(Mode::Delay(Duration::from_millis(100)));
    }
    let far_round_trip = ping_round_trip(&nodes.proxies[3].url(), 3);
    let two_far = acquire_median(&group, "job", 10, wait);
    eprintln!(
        "2 of 5 nodes 200 ms away: acquire p50 {two_far:?} ({:.2}x healthy)",
        ratio(two_far, healthy)
    );
    // The quorum did not wait for a far node: a far round trip is 200 ms,
    // the near quorum's about a tenth of that.
    assert!(
        two_far < far_round_trip / 2,
        "{two_far:?} with far nodes {far_round_trip:?} away"
    );

    // And a near one dead: the quorum needs a far node, and nothing more.
    nodes.servers[2].kill();
    let two_far_one_dead = acquire_median(&group, "job", 10, wait);
    eprintln!(
        "2 of 5 nodes 200 ms away, 1 dead: acquire p50 {two_far_one_dead:?} ({:.2}x a far \
         node's round trip {far_round_trip:?})",
        ratio(two_far_one_dead, far_round_trip)
    );
    assert!(
        two_far_one_dead < far_round_trip.mul_f64(1.6),
        "{two_far_one_dead:?}"
    );
    let evidence = group.attempt("probe", Duration::from_secs(10)).unwrap();
    assert!(
        matches!(evidence.nodes()[2].outcome, NodeOutcome::NotConnected(_)),
        "{:?}",
        evidence.nodes()
    );
    drop(evidence);

    // One far, one dead: the near three make it again.
    nodes.proxies[3].set_mode(Mode::Delay(Duration::from_millis(10)));
    let one_far_one_dead = acquire_median(&group, "job", 10, wait);
    eprintln!(
        "1 of 5 nodes 200 ms away, 1 dead: acquire p50 {one_far_one_dead:?} ({:.2}x healthy)",
        ratio(one_far_one_dead, healthy)
    );
    assert!(
        one_far_one_dead < far_round_trip / 2,
        "{one_far_one_dead:?} with a far node {far_round_trip:?} away"
    );
}

#[test]
fn a_wait_rides_out_every_node_unreachable_for_a_second() {
    let _x = exclusive();
    let nodes = Nodes::start(5);
    nodes.delay_all(Duration::from_millis(20));
    // 20 ms links: a node timeout of 200 ms keeps the group's check of the
    // round trip (at most half the node timeout) clear of a loaded machine.
    let group = RedlockGroup::connect(&refs(&nodes.urls()), options(200)).unwrap();
    for p in &nodes.proxies {
        p.set_mode(Mode::Blackhole);
    }
    let outage = Duration::from_secs(1);
    let (got, took) = thread::scope(|s| {
        // The fault schedule: every node unreachable for the first second.
        s.spawn(|| {
            thread::sleep(outage);
            nodes.delay_all(Duration::from_millis(20));
        });
        let t = Instant::now();
        let got = group
            .lock("job")
            .unwrap()
            .acquire_timeout(Duration::from_secs(10), Duration::from_secs(3));
        (got, t.elapsed())
    });
    eprintln!("every node unreachable for 1 s of a 3 s wait: {took:?}: {got:?}");
    let guard = got.unwrap().expect("acquired once the nodes were back");
    assert!(took >= outage, "{took:?}");
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
}

#[test]
fn a_wrong_password_is_reported_at_once() {
    let _x = exclusive();
    // Making a group: node 0 wants a password the URL gets wrong, and node 2
    // does not answer at all (its connect would take the connect timeout).
    let nodes = Nodes::start(3);
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("right")
        .query(&mut nodes.servers[0].client())
        .unwrap();
    nodes.proxies[2].set_mode(Mode::Blackhole);
    let mut urls = nodes.urls();
    urls[0] = format!("redis://:wrong@127.0.0.1:{}", nodes.proxies[0].port());
    let t = Instant::now();
    let result = RedlockGroup::connect(&refs(&urls), RedlockOptions::default());
    let took = t.elapsed();
    eprintln!("creation with a wrong password: {took:?}: {result:?}");
    match result {
        Err(Error::Auth { addr, .. }) => assert_eq!(addr, nodes.proxies[0].url()),
        other => panic!("expected Auth, got {other:?}"),
    }
    assert!(took < Duration::from_secs(1), "{took:?}");

    // A running group whose majority now wants a password: the wait ends
    // with Auth at once rather than polling until its deadline.
    let nodes = Nodes::start(5);
    let group = RedlockGroup::connect(&refs(&nodes.urls()), RedlockOptions::default()).unwrap();
    drop(
        group
            .lock("warm")
            .unwrap()
            .try_acquire(Duration::from_secs(10))
            .unwrap(),
    );
    for i in 0..3 {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("requirepass")
            .arg("new")
            .query(&mut nodes.servers[i].client())
            .unwrap();
        nodes.proxies[i].reset_all();
    }
    let t = Instant::now();
    let result = group
        .lock("job")
        .unwrap()
        .acquire_timeout(Duration::from_secs(10), Duration::from_secs(3));
    let took = t.elapsed();
    eprintln!("a wait after 3 of 5 nodes changed their password: {took:?}: {result:?}");
    assert!(matches!(result, Err(Error::Auth { .. })), "{result:?}");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

// ---------------------------------------------------------------- regressions

#[test]
fn one_holder_with_the_rest_down_is_an_error_not_contention() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("held-and-down");
    let group = nodes.group(&prefix, options(200));
    let key = format!("{prefix}job");
    let _: () = nodes.servers[0].client().set(&key, "someone-else").unwrap();
    // Nodes 1 and 2 stop answering: node 0's "held" comes first, and the
    // outcome waits for them to time out.
    nodes.proxies[1].set_mode(Mode::Blackhole);
    nodes.proxies[2].set_mode(Mode::Blackhole);
    let ttl = Duration::from_secs(10);
    match group.lock("job").unwrap().try_acquire(ttl) {
        Err(Error::QuorumNotReached {
            nodes: evidence, ..
        }) => {
            eprintln!("held by another on 1 of 3, 2 down: {evidence:?}");
            assert!(
                matches!(evidence[0].outcome, NodeOutcome::HeldByAnother { .. }),
                "{evidence:?}"
            );
            // Decided once one of them timed out (no quorum is left then):
            // the other timed out too, or was abandoned if its worker's
            // timeout came in a moment later.
            let timed_out = evidence[1..]
                .iter()
                .filter(|r| r.outcome == NodeOutcome::TimedOut)
                .count();
            assert!(timed_out >= 1, "{evidence:?}");
            assert!(
                evidence[1..]
                    .iter()
                    .all(|r| matches!(r.outcome, NodeOutcome::TimedOut | NodeOutcome::Abandoned)),
                "{evidence:?}"
            );
        }
        other => panic!("expected QuorumNotReached, got {other:?}"),
    }
    // Again with the two known to be down (not connected, answered at once).
    match group.lock("job").unwrap().try_acquire(ttl) {
        Err(Error::QuorumNotReached {
            nodes: evidence, ..
        }) => {
            eprintln!("again: {evidence:?}");
            assert!(
                matches!(
                    evidence[0].outcome,
                    NodeOutcome::HeldByAnother { .. } | NodeOutcome::Abandoned
                ),
                "{evidence:?}"
            );
            // Decided once two nodes answered: the third may be abandoned.
            let not_connected = evidence[1..]
                .iter()
                .filter(|r| matches!(r.outcome, NodeOutcome::NotConnected(_)))
                .count();
            assert!(not_connected >= 1, "{evidence:?}");
            assert!(
                evidence[1..].iter().all(|r| matches!(
                    r.outcome,
                    NodeOutcome::NotConnected(_) | NodeOutcome::Abandoned
                )),
                "{evidence:?}"
            );
        }
        other => panic!("expected QuorumNotReached, got {other:?}"),
    }
    // A wait that runs out that way reports the error, not "held".
    let result = group
        .lock("job")
        .unwrap()
        .acquire_timeout(ttl, Duration::from_millis(300));
    assert!(
        matches!(result, Err(Error::QuorumNotReached { .. })),
        "{result:?}"
    );
}

#[test]
fn a_release_after_an_unanswered_acquire_leaves_no_late_grant() {
    let _x = exclusive();
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("unanswered");
    let group = nodes.group(&prefix, options(100));
    let key = format!("{prefix}job");
    // Node 2's acquire reaches it 150 ms late and is answered 300 ms after
    // it was sent: long after its node timeout.
    nodes.proxies[2].set_mode(Mode::Delay(Duration::from_millis(150)));
    let attempt = group.attempt("job", Duration::from_secs(30)).unwrap();
    assert!(attempt.is_acquired(), "{attempt:?}");
    let guard = attempt.into_guard().unwrap();
    wait_until(Duration::from_secs(5), "the late grant to land", || {
        nodes.get(2, &key).is_some()
    });
    // Nodes 0 and 1 make the quorum. Node 2 is reconnecting (its acquire's
    // connection must be killed first): its release waits for that, whatever
    // its deadline.
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    let t = Instant::now();
    wait_until(
        Duration::from_secs(10),
        "the late grant to be released",
        || nodes.get(2, &key).is_none(),
    );
    eprintln!(
        "late grant released {:?} after the release returned",
        t.elapsed()
    );
}

#[test]
fn a_short_extend_racing_the_keep_alive_never_leaves_a_longer_belief() {
    let _x = exclusive();
    let nodes = Nodes::start(5);
    let prefix = unique_prefix("extend-race");
    let group = nodes.group(&prefix, options(400));
    let key = format!("{prefix}job");
    // Every reply reaches the client 75 ms after the server applied the
    // command: a renewal seen on a server is still in flight for the client.
    nodes.delay_all(Duration::from_millis(150));
    let mut direct: Vec<redis::Connection> = nodes.servers.iter().map(|s| s.client()).collect();
    let mut pttls = || -> Vec<i64> { direct.iter_mut().map(|c| c.pttl(&key).unwrap()).collect() };
    let (long, short) = (Duration::from_secs(4), Duration::from_secs(2));
    let guard = take(&group, "job", long);
    let _keep = guard.keep_alive().unwrap();
    let mut last = pttls();
    wait_until(
        Duration::from_secs(10),
        "the keep-alive's renewal to land on a node",
        || {
            let now = pttls();
            let landed = now.iter().zip(&last).any(|(n, l)| *n > *l + 500);
            last = now;
            landed
        },
    );
    let t = Instant::now();
    assert!(guard.reset_expiry(short).unwrap());
    let took = t.elapsed();
    // For the next 1.5 s (the renewal's reply arrives in it): at least a
    // majority holds whatever the guard believes. PTTLs are read first, so
    // a correct estimate read after them can only be smaller.
    let mut samples = 0;
    let mut worst = i64::MAX;
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        let mut held = pttls();
        held.sort_unstable_by(|a, b| b.cmp(a));
        let majority = held[2];
        let believed = guard.remaining_estimate().as_millis() as i64;
        assert!(
            believed <= majority + 1,
            "the guard believes {believed} ms, a majority holds {majority} ms ({held:?})"
        );
        worst = worst.min(majority - believed);
        samples += 1;
        thread::sleep(Duration::from_millis(5));
    }
    eprintln!(
        "extend(2 s) during a 4 s renewal: took {took:?} (it waited for the renewal); \
         {samples} samples, smallest margin {worst} ms"
    );
    assert!(samples > 50);
    let held = pttls();
    assert!(
        held.iter().filter(|p| **p <= 2_000).count() >= 3,
        "the short extension was overtaken: {held:?}"
    );
}

// ---------------------------------------------------------------- safety

/// What one safety campaign saw.
#[derive(Debug)]
#[allow(dead_code, reason = "the counts are reported through Debug")]
struct Campaign {
    acquisitions: usize,
    overlaps: usize,
    contended: u64,
    failed: u64,
    restarts: u64,
}

/// Four threads, each with its own group (as four processes would have),
/// contend for one lock on five nodes while a nemesis kills and restarts
/// random nodes. Every holder records its validity window on the local
/// monotonic clock, from the acquire's return to the earlier of its release
/// and its validity end (moved by a confirmed extension). Returns how many
/// windows overlapped.
fn campaign(append_only: bool, run_for: Duration) -> Campaign {
    let nodes = Nodes::start_with(5, append_only);
    let prefix = unique_prefix("campaign");
    let ttl = Duration::from_secs(1);
    let hold = Duration::from_millis(300);
    let windows = Mutex::new(Vec::<(usize, Instant, Instant)>::new());
    let (contended, failed, restarts) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let stop = AtomicBool::new(false);
    let groups: Vec<RedlockGroup> = (0..4).map(|_| nodes.group(&prefix, options(50))).collect();
    thread::scope(|s| {
        for (id, group) in groups.iter().enumerate() {
            let (windows, contended, failed, stop) = (&windows, &contended, &failed, &stop);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let guard = match group.lock("resource").unwrap().acquire_timeout(ttl, hold) {
                        Ok(Some(guard)) => guard,
                        Ok(None) => {
                            contended.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        Err(_) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            thread::sleep(Duration::from_millis(10));
                            continue;
                        }
                    };
                    let start = Instant::now();
                    let mut valid_until = start + guard.remaining_estimate();
                    thread::sleep(hold);
                    if let Ok(true) = guard.reset_expiry(ttl) {
                        valid_until = valid_until.max(Instant::now() + guard.remaining_estimate());
                    }
                    thread::sleep(hold);
                    let end = Instant::now().min(valid_until);
                    windows.lock().unwrap().push((id, start, end));
                    let _ = guard.release();
                }
            });
        }
        let (nodes, stop, restarts) = (&nodes, &stop, &restarts);
        s.spawn(move || {
            let (mut rng, _) = Rng::seeded("redlock nemesis");
            let started = Instant::now();
            while started.elapsed() < run_for {
                let i = rng.below(5) as usize;
                nodes.servers[i].kill();
                thread::sleep(Duration::from_millis(rng.below(20)));
                nodes.servers[i].restart();
                restarts.fetch_add(1, Ordering::Relaxed);
                thread::sleep(Duration::from_millis(rng.below(50)));
            }
            stop.store(true, Ordering::Relaxed);
        });
    });
    let mut windows = windows.into_inner().unwrap();
    windows.sort_by_key(|w| w.1);
    let mut overlaps = 0;
    for (i, a) in windows.iter().enumerate() {
        for b in &windows[i + 1..] {
            if b.1 >= a.2 {
                break;
            }
            overlaps += 1;
            eprintln!(
                "overlap: holder {} from +{:?} to +{:?}, holder {} from +{:?}",
                a.0,
                a.1 - windows[0].1,
                a.2 - windows[0].1,
                b.0,
                b.1 - windows[0].1
            );
        }
    }
    Campaign {
        acquisitions: windows.len(),
        overlaps,
        contended: contended.into_inner(),
        failed: failed.into_inner(),
        restarts: restarts.into_inner(),
    }
}

/// How long a safety campaign runs: `default` seconds times
/// `RESPIRE_REDLOCK_CAMPAIGN_SCALE` (a number, 1 unless set; 10 for a long
/// local run).
fn campaign_length(default: u64) -> Duration {
    let scale = std::env::var("RESPIRE_REDLOCK_CAMPAIGN_SCALE")
        .ok()
        .map(|s| {
            s.trim()
                .parse::<f64>()
                .ok()
                .filter(|f| f.is_finite() && *f > 0.0)
                .unwrap_or_else(|| panic!("RESPIRE_REDLOCK_CAMPAIGN_SCALE={s:?} is not a number"))
        })
        .unwrap_or(1.0);
    Duration::from_secs(default).mul_f64(scale)
}

#[test]
fn safety_campaign_with_appendfsync_always_finds_no_overlap() {
    let _x = exclusive();
    let run_for = campaign_length(30);
    let result = campaign(true, run_for);
    eprintln!("appendfsync always, {run_for:?}: {result:?}");
    let secs = run_for.as_secs_f64();
    assert!(result.restarts as f64 >= 1.5 * secs, "{result:?}");
    assert!(result.acquisitions as f64 >= 0.5 * secs, "{result:?}");
    assert_eq!(result.overlaps, 0, "{result:?}");
}

#[test]
fn the_checker_finds_overlaps_when_restarts_lose_data() {
    let _x = exclusive();
    let run_for = campaign_length(20);
    let result = campaign(false, run_for);
    eprintln!("no persistence, {run_for:?}: {result:?}");
    assert!(result.overlaps > 0, "the checker found nothing: {result:?}");
}

#[test]
fn a_node_that_goes_away_loses_a_lock_unless_the_restart_delay_outlasts_it() {
    let nodes = Nodes::start(3);
    let prefix = unique_prefix("went-away");
    let ttl = Duration::from_secs(3);
    let delay = Duration::from_secs(4);
    // The delay holds back acquires on servers younger than it (counted a
    // second younger than their whole seconds of uptime).
    wait_until(
        Duration::from_secs(10),
        "the nodes to be up for 5 s",
        || {
            nodes.servers.iter().all(|server| {
                let info: String = redis::cmd("INFO")
                    .arg("server")
                    .query(&mut server.client())
                    .unwrap();
                info.lines()
                    .filter_map(|l| l.trim().strip_prefix("uptime_in_seconds:"))
                    .any(|secs| secs.parse::<u64>().unwrap() >= 5)
            })
        },
    );
    let plain = nodes.group(&prefix, options(200));
    let careful = nodes.group(
        &prefix,
        RedlockOptions {
            restart_delay: Some(delay),
            ..options(200)
        },
    );
    // Node 2 is taken, so each lock has exactly a quorum: nodes 0 and 1.
    for key in ["plain", "careful"] {
        let _: () = nodes.servers[2]
            .client()
            .pset_ex(format!("{prefix}{key}"), "someone-else", 60_000)
            .unwrap();
    }
    let plain_guard = plain
        .lock("plain")
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .expect("0 and 1");
    let careful_guard = careful
        .lock("careful")
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .expect("0 and 1");
    let watched = || clients_named(&nodes, 0, "respire-redlock-watch") == 2;
    wait_until(
        Duration::from_secs(5),
        "both groups to watch node 0",
        watched,
    );
    // Node 0 closes every connection (it does not restart): either could be
    // a restart that lost the key, until its watcher connects again.
    nodes.proxies[0].reset_all();
    wait_until(
        Duration::from_secs(2),
        "the lock without a restart delay to be lost",
        || plain_guard.is_lost(),
    );
    wait_until(
        Duration::from_secs(5),
        "both groups to watch node 0 again",
        watched,
    );
    // A restarted node 0 could not have granted anything before the careful
    // lock's deadline, and it came back as the same server.
    assert!(!careful_guard.is_lost());
    assert!(careful_guard.remaining_estimate() > ttl / 2);
}

const CHILD_ENV: &str = "RESPIRE_REDLOCK_CHILD";

/// Stalls the thread that reports the first renewal, for good: the group's
/// renewal thread, holding the lease it renewed (as a thread the system does
/// not schedule for a while does).
struct StallRenewals(Mutex<Option<std::sync::mpsc::Sender<()>>>);

impl respire_coordination::Observer for StallRenewals {
    fn renewed(&self, _: &respire_coordination::RenewalEvent<'_>) {
        if let Some(stalled) = self.0.lock().unwrap().take() {
            let _ = stalled.send(());
            loop {
                thread::park();
            }
        }
    }
}

#[test]
fn a_program_that_ends_after_dropping_its_group_leaves_no_key_behind() {
    const TEST: &str = "a_program_that_ends_after_dropping_its_group_leaves_no_key_behind";
    const KEY: &str = "{ends}";
    if std::env::var(CHILD_ENV).as_deref() == Ok("ends") {
        // A group whose renewal thread stalls after the first renewal, still
        // holding the lease: the program's drop of the group is then not the
        // group's last reference.
        let (stalled, renewal_stalled) = std::sync::mpsc::channel();
        let urls = support::env("RESPIRE_REDLOCK_URLS");
        let coordinators = urls
            .split(',')
            .map(|url| coordinator(url, "ends:", Duration::from_millis(500)))
            .collect();
        let options = options(1000).with_observer(std::sync::Arc::new(StallRenewals(Mutex::new(
            Some(stalled),
        ))));
        let group = RedlockGroup::new(coordinators, options).unwrap();
        let guard = group
            .lock(KEY)
            .unwrap()
            .try_acquire(Duration::from_secs(5))
            .unwrap()
            .expect("granted");
        let renewing = guard.keep_alive().unwrap();
        renewal_stalled
            .recv_timeout(Duration::from_secs(10))
            .expect("a renewal within 10 s");
        drop(renewing);
        // Returns at the quorum of the two near nodes; the far node's
        // release waits behind the renewal still on its way there.
        assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
        drop(group);
        // The test returns, and the process ends.
        return;
    }
    let nodes = Nodes::start(3);
    // 100 ms each way to the third node.
    nodes.proxies[2].set_mode(Mode::Delay(Duration::from_millis(100)));
    let child = ChildProc::spawn(
        CHILD_ENV,
        TEST,
        "ends",
        &[("RESPIRE_REDLOCK_URLS", nodes.urls().join(","))],
    );
    child.finish();
    // Whatever the ended program sent has reached the far node once the
    // proxy closed its connections.
    wait_until(
        Duration::from_secs(5),
        "the ended program's connections to close",
        || nodes.proxies[2].connection_count() == 0,
    );
    // The far node was granted the lock (and renewed it): the check below
    // is of a release, not of a grant that never came.
    assert_eq!(nodes.servers[2].command_calls("set"), 1);
    for i in 0..3 {
        assert_eq!(
            nodes.get(i, &format!("ends:{KEY}")),
            None,
            "node {i} still holds the lock of a program that released it and ended"
        );
    }
}
