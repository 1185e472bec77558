//! The primitives on a real Sentinel deployment (a primary, a replica, three
//! sentinels): finding the primary, following `+switch-master`, what a
//! failover does to leases granted but never replicated and to fencing
//! tokens, the replication guard, separate credentials for sentinels and
//! data nodes, and time bounds with a sentinel or the primary stopped.
//!
//! Tests that leave roles as they are share one deployment; each that fails
//! over or stops a process starts its own. Run with `--nocapture` to see the
//! measured figures (lines starting with `figure`).

mod support;

use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use respire_coordination::{
    Coordinator, Error, RedlockGroup, RedlockOptions, ReleaseOutcome, Replication,
};
use support::{
    TestSentinel, TestServer, calls, local_instant, server_now, shared_sentinel, unique_prefix,
    wait_until,
};

fn figure(name: &str, value: Duration) {
    println!("figure {name} = {:.1} ms", value.as_secs_f64() * 1000.0);
}

fn urls(deployment: &TestSentinel) -> Vec<String> {
    deployment.sentinel_urls()
}

fn connect(deployment: &TestSentinel) -> Coordinator {
    builder(deployment)
        .build()
        .expect("connect through sentinel")
}

fn builder(deployment: &TestSentinel) -> respire_coordination::CoordinatorBuilder {
    let urls = urls(deployment);
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    Coordinator::sentinel_builder(&urls, deployment.service())
}

/// A fenced lock with keys unique to this call.
fn fenced(coord: &Coordinator, name: &str) -> respire_coordination::FencedLock {
    let tag = format!("{{{}}}", unique_prefix(name));
    coord
        .fenced_lock(&format!("{tag}:lease"), &format!("{tag}:fence"))
        .unwrap()
}

fn role_is_master(server: &TestServer) -> bool {
    let mut con = server.client();
    let role: Vec<redis::Value> = redis::cmd("ROLE").query(&mut con).unwrap_or_default();
    matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master")
}

/// Runs `SENTINEL FAILOVER` and waits until the switch is complete, while
/// `on_promoted` runs as soon as `ROLE` on the other server says `master`
/// (before the sentinels announce it).
fn failover_with(deployment: &TestSentinel, on_promoted: impl FnOnce(&TestServer)) -> Duration {
    let new = deployment.replica();
    thread::scope(|s| {
        let switching = s.spawn(|| deployment.failover());
        wait_until(Duration::from_secs(20), "the replica's promotion", || {
            role_is_master(new)
        });
        on_promoted(new);
        switching.join().unwrap()
    })
}

// ---------------------------------------------------------------------------
// On the shared deployment

#[test]
fn the_primitives_work_through_sentinel() {
    let deployment = shared_sentinel();
    let coord = connect(deployment);
    let primary = deployment.primary();
    assert_eq!(
        coord.primaries(),
        vec![format!("redis://127.0.0.1:{}", primary.port())]
    );
    let lock = fenced(&coord, "basic");
    let g = lock.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    let exists: bool = redis::cmd("EXISTS")
        .arg(g.key())
        .query(&mut primary.client())
        .unwrap();
    assert!(exists);
    assert!(lock.try_acquire(Duration::from_secs(10)).unwrap().is_none());
    assert!(g.verify_still_held().unwrap().is_some());
    let first = g.fencing_token();
    assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
    let g = lock
        .acquire_timeout(Duration::from_secs(10), Duration::from_secs(1))
        .unwrap()
        .unwrap();
    assert!(g.fencing_token() > first);
    // The URL form reaches the same primary.
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
    let other = Coordinator::connect(&url).unwrap();
    assert_eq!(other.primaries(), coord.primaries());
    assert!(
        other
            .fenced_lock(lock.lease_key(), lock.fence_key())
            .unwrap()
            .try_acquire(Duration::from_secs(10))
            .unwrap()
            .is_none()
    );
}

#[test]
fn read_write_leases_and_semaphores_work_through_sentinel() {
    let deployment = shared_sentinel();
    let coord = connect(deployment);
    let tag = format!("{{{}}}", unique_prefix("rwsem"));
    let rw = coord.read_write_lease(&format!("{tag}:rw")).unwrap();
    let r = rw
        .read()
        .try_acquire(Duration::from_secs(10))
        .unwrap()
        .unwrap();
    assert!(
        rw.write()
            .try_acquire(Duration::from_secs(10))
            .unwrap()
            .is_none()
    );
    drop(r);
    let w = rw
        .write()
        .try_acquire(Duration::from_secs(10))
        .unwrap()
        .unwrap();
    assert!(w.verify_still_held().unwrap().is_some());
    drop(w);
    let sem = coord.semaphore(&format!("{tag}:sem"), 1).unwrap();
    let p = sem.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    assert!(sem.try_acquire(Duration::from_secs(10)).unwrap().is_none());
    assert_eq!(sem.available().unwrap(), 0);
    drop(p);
    assert_eq!(sem.set_capacity(2).unwrap(), Some(1));
}

#[test]
fn unknown_services_and_non_sentinels_are_refused() {
    let deployment = shared_sentinel();
    let urls = urls(deployment);
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let err = Coordinator::sentinel(&urls, "no-such-service").unwrap_err();
    assert!(
        matches!(&err, Error::Topology(m) if m.contains("no sentinel knows the service")),
        "{err}"
    );
    let plain = support::shared_server();
    let err = Coordinator::sentinel(&[&plain.url()], "respire").unwrap_err();
    assert!(
        matches!(&err, Error::Topology(m) if m.contains("is not a sentinel")),
        "{err}"
    );
    let dead = TestServer::start();
    let dead_url = dead.url();
    drop(dead);
    // A dead sentinel first: the next one answers.
    let c = Coordinator::sentinel(&[&dead_url, urls[1]], deployment.service()).unwrap();
    assert_eq!(c.primaries().len(), 1);
    let err = Coordinator::sentinel(&[&dead_url], "respire").unwrap_err();
    assert!(
        matches!(&err, Error::Topology(m) if m.contains("refused")),
        "{err}"
    );
}

#[test]
fn replication_report_and_require() {
    let deployment = shared_sentinel();
    let report = builder(deployment)
        .replication(Replication::Report {
            timeout: Duration::from_millis(500),
        })
        .build()
        .unwrap();
    assert_eq!(
        report.replication(),
        Replication::Report {
            timeout: Duration::from_millis(500)
        }
    );
    let g = fenced(&report, "report")
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .unwrap();
    assert_eq!(g.replicas_acknowledged(), Some(1));
    let require_one = builder(deployment)
        .replication(Replication::Require {
            replicas: 1,
            timeout: Duration::from_millis(500),
        })
        .build()
        .unwrap();
    let g = fenced(&require_one, "require1")
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .unwrap();
    assert_eq!(g.replicas_acknowledged(), Some(1));
    // Two replicas cannot acknowledge: there is one.
    let require_two = builder(deployment)
        .replication(Replication::Require {
            replicas: 2,
            timeout: Duration::from_millis(50),
        })
        .build()
        .unwrap();
    let lock = fenced(&require_two, "require2");
    let err = lock.try_acquire(Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::NotReplicated {
                acknowledged: 1,
                required: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(!err.is_retryable());
    // The grant was released again.
    let exists: bool = redis::cmd("EXISTS")
        .arg(lock.lease_key())
        .query(&mut deployment.primary().client())
        .unwrap();
    assert!(!exists);
    // A wait ends with the same error rather than retrying.
    let err = lock
        .acquire_timeout(Duration::from_secs(5), Duration::from_secs(5))
        .unwrap_err();
    assert!(matches!(err, Error::NotReplicated { .. }), "{err}");
}

#[test]
fn redlock_refuses_sentinel_coordinators() {
    let deployment = shared_sentinel();
    let nodes = vec![
        connect(deployment),
        connect(deployment),
        connect(deployment),
    ];
    let err = RedlockGroup::new(nodes, RedlockOptions::default()).unwrap_err();
    assert!(
        matches!(&err, Error::NotIndependent(m) if m.contains("Sentinel")),
        "{err}"
    );
}

#[test]
fn sentinels_and_data_nodes_take_separate_credentials() {
    let primary = TestServer::builder().requirepass("data-pw").start();
    let config = format!(
        "sentinel monitor creds 127.0.0.1 {} 1\nsentinel auth-pass creds data-pw\n",
        primary.port()
    );
    let sentinel = TestServer::builder()
        .sentinel(config)
        .requirepass("sentinel-pw")
        .start();
    let bare = format!("redis://127.0.0.1:{}", sentinel.port());
    let coord = Coordinator::sentinel_builder(&[&bare], "creds")
        .sentinel_password("sentinel-pw")
        .password("data-pw")
        .build()
        .unwrap();
    let g = coord
        .lock("k")
        .unwrap()
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .unwrap();
    assert!(g.verify_still_held().unwrap().is_some());
    drop(g);
    // The sentinel's password in its URL does the same.
    let with_url = format!("redis://:sentinel-pw@127.0.0.1:{}", sentinel.port());
    Coordinator::sentinel_builder(&[&with_url], "creds")
        .password("data-pw")
        .build()
        .unwrap();
    // The data password is not the sentinel's, nor the other way round.
    let err = Coordinator::sentinel_builder(&[&bare], "creds")
        .sentinel_password("data-pw")
        .password("data-pw")
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::Auth { .. }), "{err}");
    let err = Coordinator::sentinel_builder(&[&bare], "creds")
        .sentinel_password("sentinel-pw")
        .password("sentinel-pw")
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::Auth { .. }), "{err}");
    // The URL form: user info is the data nodes'.
    let url = format!(
        "redis+sentinel://:data-pw@127.0.0.1:{}/creds",
        sentinel.port()
    );
    Coordinator::builder(&url)
        .sentinel_password("sentinel-pw")
        .build()
        .unwrap();
}

// ---------------------------------------------------------------------------
// Failover

/// What the load loop saw: (when the call returned, its token or error).
type Calls = Arc<Mutex<Vec<(Instant, Result<u64, String>)>>>;

#[test]
fn the_coordinator_follows_a_switch_and_the_old_primary_grants_nothing_after() {
    let deployment = TestSentinel::start();
    let coord = connect(&deployment);
    let lock = fenced(&coord, "switch");
    let fence_key = lock.fence_key().to_owned();
    let calls: Calls = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looping = {
        let (lock, calls, stop) = (lock.clone(), calls.clone(), stop.clone());
        thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // A short TTL: a grant the replica received and whose release
                // the old primary ran after the promotion stays on the new
                // primary until it expires, and nobody can be granted the
                // lease there before (with 10 s, the first grant by the new
                // primary could come 9 s after the switch).
                let r = lock.try_acquire(Duration::from_secs(1));
                let now = Instant::now();
                let r = match r {
                    Ok(Some(g)) => {
                        let token = g.fencing_token().get();
                        let _ = g.release();
                        Ok(token)
                    }
                    Ok(None) => Err("held".to_owned()),
                    Err(e) => Err(e.to_string()),
                };
                calls.lock().unwrap().push((now, r));
                thread::sleep(Duration::from_millis(1));
            }
        })
    };
    wait_until(Duration::from_secs(5), "grants before the switch", || {
        calls.lock().unwrap().len() > 20
    });
    let watcher = deployment.watch_switches();
    // Once promoted, and before the sentinels announce it, the new primary's
    // counter jumps: every token it issues is above a million, every token the
    // old primary issues below.
    let took = failover_with(&deployment, |new| {
        let _: i64 = redis::cmd("INCRBY")
            .arg(&fence_key)
            .arg(1_000_000)
            .query(&mut new.client())
            .unwrap();
    });
    figure("SENTINEL FAILOVER until every sentinel agrees", took);
    let events = watcher.wait_for(1, Duration::from_secs(10));
    let switched = events[0].at;
    let granted_by_new = || {
        calls
            .lock()
            .unwrap()
            .iter()
            .any(|(_, r)| matches!(r, Ok(t) if *t > 1_000_000))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !granted_by_new() {
        if Instant::now() > deadline {
            let calls = calls.lock().unwrap();
            let after: Vec<String> = calls
                .iter()
                .filter(|(at, _)| *at >= switched)
                .map(|(at, r)| format!("{:?}: {r:?}", at.saturating_duration_since(switched)))
                .collect();
            panic!(
                "no grant by the new primary 10 s after +switch-master; {} calls since, the \
                 last ones:\n{}",
                after.len(),
                after[after.len().saturating_sub(15)..].join("\n")
            );
        }
        thread::sleep(Duration::from_millis(5));
    }
    // Half a second more of calls after the first grant by the new primary:
    // the window in which a grant by the old primary would show up below.
    thread::sleep(Duration::from_millis(500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    looping.join().unwrap();
    let calls = calls.lock().unwrap().clone();
    let first_new = calls
        .iter()
        .position(|(_, r)| matches!(r, Ok(t) if *t > 1_000_000))
        .unwrap();
    let first_new_at = calls[first_new].0;
    // How soon it followed is a figure; that it followed at all is the wait
    // above, with its deadline.
    figure(
        "first grant by the new primary after +switch-master",
        first_new_at.saturating_duration_since(switched),
    );
    // Nothing granted by the old primary once the new one granted, and no
    // regression was ever seen.
    for (at, r) in &calls[first_new..] {
        match r {
            Ok(t) => assert!(*t > 1_000_000, "the old primary granted {t} at {at:?}"),
            Err(e) => assert!(!e.contains("went back"), "{e}"),
        }
    }
    let errors: Vec<&String> = calls.iter().filter_map(|(_, r)| r.as_ref().err()).collect();
    println!(
        "calls: {}, errors around the switch: {errors:?}",
        calls.len()
    );
}

#[test]
fn a_lease_never_replicated_is_lost_at_the_switch_and_the_counter_regression_is_caught() {
    let deployment = TestSentinel::start();
    let plain = connect(&deployment);
    let guarded = builder(&deployment)
        .replication(Replication::Require {
            replicas: 1,
            timeout: Duration::from_millis(200),
        })
        .build()
        .unwrap();
    let lock = fenced(&plain, "unreplicated");
    let guarded_lock = fenced(&guarded, "guarded");
    // One grant each while the replica follows.
    let t0 = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    let seen = t0.fencing_token().get();
    drop(t0);
    let t0 = guarded_lock
        .try_acquire(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    assert_eq!(t0.replicas_acknowledged(), Some(1));
    drop(t0);
    let replica = deployment.pause_replica_writes(Duration::from_secs(30));
    let g = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    assert_eq!(g.fencing_token().get(), seen + 1);
    let signal = g.lost_signal().clone();
    // The guarded coordinator refuses a grant no replica acknowledged.
    let err = guarded_lock
        .try_acquire(Duration::from_secs(30))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::NotReplicated {
                acknowledged: 0,
                required: 1,
                ..
            }
        ),
        "{err}"
    );
    let watcher = deployment.watch_switches();
    let flagged = Arc::new(Mutex::new(None));
    let waiting = {
        let flagged = flagged.clone();
        thread::spawn(move || {
            let lost = signal.recv_timeout(Duration::from_secs(30));
            *flagged.lock().unwrap() = Some((lost.is_err(), Instant::now()));
        })
    };
    failover_with(&deployment, |_| {});
    // The new primary holds writes back while paused; let them through.
    deployment.unpause_replica(replica);
    let switched = watcher.wait_for(1, Duration::from_secs(10))[0].at;
    waiting.join().unwrap();
    let (closed, at) = flagged.lock().unwrap().expect("watched");
    assert!(closed, "the loss signal did not close");
    assert!(g.is_lost());
    figure(
        "unreplicated lease flagged lost after +switch-master",
        at.saturating_duration_since(switched),
    );
    assert!(
        at < switched + Duration::from_secs(5),
        "flagged {:?} after the switch, not at once",
        at - switched
    );
    // The new primary's counter went back to `seen`: the plain coordinator
    // saw seen + 1 and refuses the repeat.
    let err = lock
        .acquire_timeout(Duration::from_secs(30), Duration::from_secs(5))
        .unwrap_err();
    assert!(
        matches!(err, Error::FencingRegression { issued, seen: s, .. } if issued == seen + 1 && s == seen + 1),
        "{err}"
    );
    // The guarded coordinator never accepted the grant its primary lost: it
    // sees no regression, and refuses again because the new primary has no
    // replica yet (the old one is reconfigured about ten seconds after the
    // switch).
    let err = guarded_lock
        .acquire_timeout(Duration::from_secs(30), Duration::from_secs(5))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::NotReplicated {
                acknowledged: 0,
                required: 1,
                ..
            }
        ),
        "{err}"
    );
    drop(g);
}

/// The expiry of `key` on `server` as a local instant, from the server's own
/// `PEXPIRETIME` and `TIME`; `None` when the key is gone or has no expiry.
fn expiry_on(server: &TestServer, key: &str) -> Option<Instant> {
    let mut con = server.client();
    let at: i64 = redis::cmd("PEXPIRETIME").arg(key).query(&mut con).unwrap();
    (at > 0).then(|| local_instant(at, server_now(&mut con)))
}

#[test]
fn an_extension_the_new_primary_never_got_bounds_the_lease_after_a_failover() {
    let deployment = TestSentinel::start();
    let coord = connect(&deployment);
    let lock = fenced(&coord, "unreplicated-extension");
    let g = lock.try_acquire(Duration::from_secs(6)).unwrap().unwrap();
    let key = g.key().to_owned();
    let replica = deployment.replica();
    wait_until(Duration::from_secs(5), "the grant on the replica", || {
        expiry_on(replica, &key).is_some()
    });
    // The replica stops applying the stream: the extension stays on the old
    // primary alone.
    let paused = deployment.pause_replica_writes(Duration::from_secs(30));
    assert!(g.reset_expiry(Duration::from_secs(60)).unwrap());
    assert!(g.remaining_estimate() > Duration::from_secs(50));
    let signal = g.lost_signal().clone();
    let flagged = thread::spawn(move || {
        let closed = signal
            .recv_timeout(Duration::from_secs(30))
            .is_err_and(|e| e.is_disconnected());
        (closed, Instant::now())
    });
    failover_with(&deployment, |_| {});
    deployment.unpause_replica(paused);
    // The oracle: the new primary's own expiry of the key, the grant's.
    let new_primary = &deployment.servers()[paused];
    let ends = expiry_on(new_primary, &key).expect("the new primary holds the grant");
    assert!(
        ends < Instant::now() + Duration::from_secs(6),
        "the new primary has the extension after all"
    );
    let (closed, at) = flagged.join().unwrap();
    assert!(closed, "the loss signal never closed");
    assert!(g.is_lost());
    assert!(
        at <= ends,
        "flagged lost {:?} after the new primary's expiry",
        at - ends
    );
    figure(
        "lease flagged lost before the new primary's expiry, by",
        ends.saturating_duration_since(at),
    );
}

#[test]
fn a_kept_alive_lease_rides_out_a_failover_that_left_its_renewal_unanswered() {
    let deployment = TestSentinel::builder()
        .down_after(Duration::from_secs(1))
        .start();
    let coord = builder(&deployment)
        .node_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let lock = fenced(&coord, "unanswered-renewal");
    let ttl = Duration::from_secs(12);
    let granted = Instant::now();
    let g = lock.try_acquire(ttl).unwrap().unwrap();
    let key = g.key().to_owned();
    wait_until(Duration::from_secs(5), "the grant on the replica", || {
        expiry_on(deployment.replica(), &key).is_some()
    });
    let renewal = g.keep_alive().unwrap();
    // The first renewal, at half the TTL, opens the executor's connection.
    wait_until(ttl, "a first renewal", || {
        coord.renewal_stats().renewals > 0
    });
    let old_primary = deployment.primary_index();
    let new_primary = 1 - old_primary;
    let watcher = deployment.watch_switches();
    // The primary stops half a second before the next renewal: that renewal
    // goes unanswered, and so does every kill of its connection.
    thread::sleep(
        (granted + ttl - Duration::from_millis(500)).saturating_duration_since(Instant::now()),
    );
    deployment.primary().pause();
    let failures = coord.renewal_stats().failures;
    wait_until(Duration::from_secs(5), "an unanswered renewal", || {
        coord.renewal_stats().failures > failures
    });
    let switched = watcher.wait_for(1, Duration::from_secs(20))[0].at;
    figure(
        "+switch-master after the grant",
        switched.saturating_duration_since(granted),
    );
    // The lease outlived the unanswered renewal until the switch; had the
    // failover come after its loss deadline, there would be nothing to tell.
    assert!(!g.is_lost(), "the failover came too late to tell");
    // Its claim is freed by the switch: renewals go on at the new primary.
    let renewed = coord.renewal_stats().renewals;
    wait_until(
        Duration::from_secs(10),
        "a renewal on the new primary",
        || coord.renewal_stats().renewals > renewed,
    );
    assert!(!g.is_lost());
    let left = expiry_on(&deployment.servers()[new_primary], &key)
        .expect("the new primary holds the lease")
        .saturating_duration_since(Instant::now());
    assert!(left > ttl / 2, "renewed on the new primary: {left:?} left");
    drop(renewal);
    deployment.servers()[old_primary].resume();
}

/// A deployment whose sentinels never fail over on their own (a minute of
/// `down-after-milliseconds`): a test asks for each failover, or stops the
/// primary without one.
fn failing_over_on_request() -> TestSentinel {
    TestSentinel::builder()
        .down_after(Duration::from_secs(60))
        .start()
}

/// Every grant acknowledged by the one replica, waiting two seconds: a
/// replica that has just synchronised acknowledges within its once-a-second
/// `REPLCONF ACK`, and the tests that use it are about history, not about how
/// fast a `WAIT` is answered.
fn require_the_replica() -> Replication {
    Replication::Require {
        replicas: 1,
        timeout: Duration::from_secs(2),
    }
}

#[test]
fn calls_keep_their_bounds_with_a_sentinel_or_the_primary_stopped() {
    // No failover while the primary is stopped on purpose.
    let deployment = failing_over_on_request();
    let nt = Duration::from_millis(200);
    let ct = Duration::from_millis(300);
    let slack = Duration::from_millis(300);
    let make = || builder(&deployment).node_timeout(nt).connect_timeout(ct);

    // A stopped sentinel first in the list: building tries it (connect
    // timeout), then the next.
    deployment.sentinel(0).pause();
    let started = Instant::now();
    let coord = make().build().unwrap();
    let took = started.elapsed();
    figure("build with the first sentinel stopped", took);
    assert!(took < (ct + nt) + ct + slack, "{took:?}");
    let lock = fenced(&coord, "bounds");
    for _ in 0..20 {
        let started = Instant::now();
        let g = lock.try_acquire(Duration::from_secs(5)).unwrap().unwrap();
        assert!(started.elapsed() < nt + ct + slack);
        let started = Instant::now();
        g.release().unwrap();
        assert!(started.elapsed() < nt + slack);
    }
    deployment.sentinel(0).resume();

    // The primary stopped: every call ends within its bound, with an error.
    // Short, so that it is gone soon after the primary resumes, whatever its
    // unanswered release did.
    let held = lock.try_acquire(Duration::from_secs(2)).unwrap().unwrap();
    deployment.primary().pause();
    let started = Instant::now();
    let err = lock.try_acquire(Duration::from_secs(5)).unwrap_err();
    let took = started.elapsed();
    figure("try_acquire with the primary stopped", took);
    assert!(err.is_retryable(), "{err}");
    assert!(took < nt + ct + slack, "{took:?}");
    let started = Instant::now();
    let r = lock.acquire_timeout(Duration::from_secs(5), Duration::from_millis(500));
    let took = started.elapsed();
    figure("acquire_timeout(500 ms) with the primary stopped", took);
    assert!(r.is_err(), "{r:?}");
    assert!(
        took < Duration::from_millis(500) + nt + ct + slack,
        "{took:?}"
    );
    let started = Instant::now();
    assert!(held.verify_still_held().is_err());
    assert!(started.elapsed() < nt + ct + slack);
    let started = Instant::now();
    let outcome = held.release();
    let took = started.elapsed();
    figure("release with the primary stopped", took);
    assert!(took < nt + slack, "{took:?}");
    assert!(
        matches!(outcome, Ok(ReleaseOutcome::Uncertain) | Err(_)),
        "{outcome:?}"
    );
    // Building a new coordinator names the primary, which does not answer.
    let started = Instant::now();
    let err = make().build().unwrap_err();
    let took = started.elapsed();
    assert!(took < (ct + nt) + ct + slack, "{took:?}: {err}");
    deployment.primary().resume();
    let g = lock
        .acquire_timeout(Duration::from_secs(5), Duration::from_secs(10))
        .unwrap()
        .unwrap();
    drop(g);
}

/// The fence counter stored on `server`, read straight from it.
fn counter_on(server: &TestServer, fence: &str) -> Option<u64> {
    redis::cmd("GET")
        .arg(fence)
        .query(&mut server.client())
        .unwrap()
}

/// What the nemesis campaign found under `Require { replicas: 1 }`: a primary
/// killed and restarted without persistence comes back holding the data of
/// the RDB file its last full synchronisation as a replica left on disk,
/// Sentinel promotes it in the next failover (it does not look at the role a
/// replica reports; in the campaign the sentinels did so on their own, after
/// deeming the new primary down), and resynchronises the other server from
/// it: grants that replica had acknowledged are gone everywhere, and their
/// fencing tokens are issued again. A coordinator that saw a grant
/// acknowledged refuses every grant on that history.
///
/// Every failover here is asked for with `SENTINEL FAILOVER`, each after the
/// roles it starts from are seen on the servers and the sentinels: with a
/// minute of `down-after-milliseconds` the sentinels never fail over on their
/// own, so which server is promoted, and when, is the scenario's choice
/// however slow the machine (with one second, a new primary slow to answer
/// was deemed down and the restarted server promoted a step early).
#[test]
fn a_primary_restarted_from_an_old_sync_file_and_promoted_is_refused_as_a_lost_history() {
    let deployment = failing_over_on_request();
    let require = require_the_replica();
    let a = builder(&deployment).replication(require).build().unwrap();
    let b = builder(&deployment).replication(require).build().unwrap();
    let tag = format!("{{{}}}", unique_prefix("old-sync-file"));
    let (lease, fence) = (format!("{tag}:lease"), format!("{tag}:fence"));
    let lock_a = a.fenced_lock(&lease, &fence).unwrap();
    let lock_b = b.fenced_lock(&lease, &fence).unwrap();
    let other_b = fenced(&b, "old-sync-file-other");
    let ttl = Duration::from_secs(30);
    let wait = Duration::from_secs(15);
    let grant = |lock: &respire_coordination::FencedLock| {
        let guard = lock.acquire_timeout(ttl, wait).unwrap().expect("granted");
        assert_eq!(guard.replicas_acknowledged(), Some(1));
        guard.fencing_token().get()
    };
    let first = grant(&lock_a);

    // The primary, server 0, killed and restarted once server 1 is promoted:
    // it has no RDB file yet and comes back empty; the sentinels make it a
    // replica, and its full synchronisation leaves one in its directory.
    deployment.wait_selectable(1, "slave", Duration::from_secs(30));
    deployment.server(0).kill();
    deployment.failover();
    deployment.server(0).restart();
    deployment.wait_replica_of(0, Duration::from_secs(30));
    assert_eq!(counter_on(deployment.server(0), &fence), Some(first));

    // Grants server 0 acknowledges, in its memory only; then it is the
    // primary again, and server 1 acknowledges more.
    let mut last = first;
    for _ in 0..3 {
        last = grant(&lock_a);
    }
    grant(&other_b);
    deployment.wait_selectable(0, "slave", Duration::from_secs(30));
    deployment.failover();
    deployment.wait_replica_of(1, Duration::from_secs(30));
    for _ in 0..3 {
        last = grant(&lock_a);
    }
    grant(&other_b);

    // Server 0 killed again: server 1, promoted, holds every acknowledged
    // grant. B follows it without alarm (the promoted replica's history
    // contains them); no replica acknowledges yet.
    deployment.wait_selectable(1, "slave", Duration::from_secs(30));
    deployment.server(0).kill();
    deployment.failover();
    assert_eq!(counter_on(deployment.server(1), &fence), Some(last));
    let err = other_b.acquire_timeout(ttl, wait).unwrap_err();
    assert!(matches!(err, Error::NotReplicated { .. }), "{err}");

    // Restarted, server 0 is a primary again (no `--replicaof`) holding
    // what its RDB file held; a failover now selects it, and server 1
    // resynchronises from it.
    deployment.server(0).restart();
    assert_eq!(counter_on(deployment.server(0), &fence), Some(first));
    deployment.wait_selectable(0, "master", Duration::from_secs(30));
    deployment.failover();
    deployment.wait_replica_of(1, Duration::from_secs(30));
    assert_eq!(counter_on(deployment.server(1), &fence), Some(first));

    // B never saw a token of this lock; without the history check it would
    // get `first + 1` again, acknowledged by server 1.
    match lock_b.acquire_timeout(ttl, wait) {
        Err(Error::ReplicationHistoryLost { key, detail }) => {
            assert_eq!(key, lease);
            assert!(
                detail.contains(&deployment.server(0).port().to_string()),
                "{detail}"
            );
        }
        Ok(Some(guard)) => panic!(
            "token {} issued again (tokens up to {last} were acknowledged), {:?} replica(s) acknowledged",
            guard.fencing_token().get(),
            guard.replicas_acknowledged()
        ),
        other => panic!("{other:?}"),
    }
    let err = lock_a.acquire_timeout(ttl, wait).unwrap_err();
    assert!(matches!(err, Error::ReplicationHistoryLost { .. }), "{err}");
    let err = other_b.acquire_timeout(ttl, wait).unwrap_err();
    assert!(matches!(err, Error::ReplicationHistoryLost { .. }), "{err}");
}

/// Counts the primary switches the coordinator reports.
#[derive(Default)]
struct Switches(std::sync::atomic::AtomicUsize);

impl respire_coordination::Observer for Switches {
    fn topology_changed(&self, event: &respire_coordination::TopologyEvent<'_>) {
        if matches!(
            event.change,
            respire_coordination::TopologyChange::PrimarySwitched { .. }
        ) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// The local ports of this process's TCP connections to `port`, from its open
/// sockets (`/proc/self/fd`) and the kernel's table (`/proc/net/tcp`).
fn our_ports_to(port: u16) -> Vec<u16> {
    let inodes: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    tcp_rows()
        .into_iter()
        .filter(|r| r.remote == port && inodes.contains(&r.inode))
        .map(|r| r.local)
        .collect()
}

struct TcpRow {
    local: u16,
    remote: u16,
    rx_queue: u64,
    inode: String,
}

fn tcp_rows() -> Vec<TcpRow> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next().unwrap(), 16).unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let rx = f.get(4)?.split(':').nth(1)?;
            Some(TcpRow {
                local: port(f[1]),
                remote: port(f[2]),
                rx_queue: u64::from_str_radix(rx, 16).ok()?,
                inode: f.get(9)?.to_string(),
            })
        })
        .collect()
}

/// Bytes this process sent to the server on `port` that wait unread in the
/// server's sockets (the server is stopped).
fn unread_by(port: u16) -> u64 {
    let ours = our_ports_to(port);
    tcp_rows()
        .into_iter()
        .filter(|r| r.local == port && ours.contains(&r.remote))
        .map(|r| r.rx_queue)
        .sum()
}

/// A coordinator for the late-answer scenarios, with the primary switches it
/// followed counted: its node timeout is long enough for a reply to come
/// back from the old primary after the whole failover.
fn late_answers(deployment: &TestSentinel) -> (Coordinator, Arc<Switches>) {
    let switches = Arc::new(Switches::default());
    let coord = builder(deployment)
        .node_timeout(Duration::from_secs(8))
        .observer(switches.clone())
        .build()
        .unwrap();
    (coord, switches)
}

/// The late answer: `extend` runs while the primary is stopped (`SIGSTOP`),
/// its command waiting unread in the primary's socket; Sentinel fails over;
/// once the coordinator has followed the switch and `before_resume` has
/// returned (given the new primary), the old primary resumes. Still a primary
/// in its own eyes, it runs the command and answers, before any sentinel can
/// make it a replica. Returns what `extend` returned and the new primary.
fn answered_by_the_old_primary_after_a_failover<'d>(
    deployment: &'d TestSentinel,
    switches: &Switches,
    extend: impl FnOnce() -> respire_coordination::Result<bool> + Send,
    before_resume: impl FnOnce(&TestServer),
) -> (respire_coordination::Result<bool>, &'d TestServer) {
    let old = deployment.primary_index();
    let old_port = deployment.servers()[old].port();
    let new_primary = &deployment.servers()[1 - old];
    let scripts = || calls(&mut deployment.servers()[old].client(), &["evalsha"]);
    let before = scripts();
    deployment.servers()[old].pause();
    let answered = thread::scope(|s| {
        let extending = s.spawn(extend);
        wait_until(
            Duration::from_secs(5),
            "the extension to reach the stopped primary",
            || unread_by(old_port) > 0,
        );
        failover_with(deployment, |_| {});
        wait_until(
            Duration::from_secs(10),
            "the coordinator to follow the switch",
            || switches.0.load(std::sync::atomic::Ordering::SeqCst) > 0,
        );
        before_resume(new_primary);
        deployment.servers()[old].resume();
        extending.join().unwrap()
    });
    assert!(
        scripts() > before,
        "the old primary never ran the extension: the scenario did not happen"
    );
    (answered, new_primary)
}

#[test]
fn an_extension_the_old_primary_confirms_after_the_switch_is_run_again_on_the_new_one() {
    let deployment = TestSentinel::start();
    let (coord, switches) = late_answers(&deployment);
    let lock = fenced(&coord, "late-confirmation");
    let g = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    let key = g.key().to_owned();
    wait_until(Duration::from_secs(5), "the grant on the replica", || {
        expiry_on(deployment.replica(), &key).is_some()
    });
    let (extended, new_primary) = answered_by_the_old_primary_after_a_failover(
        &deployment,
        &switches,
        || g.reset_expiry(Duration::from_secs(60)),
        |_| {},
    );
    // The oracle: the new primary's own expiry of the key, against the
    // bound the guard counts on.
    let estimate = g.remaining_estimate();
    let left = expiry_on(new_primary, &key)
        .expect("the new primary holds the lease")
        .saturating_duration_since(Instant::now());
    println!("extended: {extended:?}, estimate {estimate:?}, the new primary's expiry in {left:?}");
    assert!(
        estimate <= left + Duration::from_millis(5),
        "the guard counts on {estimate:?} while the new primary expires the key in {left:?}"
    );
    // Confirmed means confirmed by the server that serves the key now: the
    // old primary's word is worth nothing once it was replaced.
    assert!(extended.unwrap(), "the extension was refused");
    assert!(
        left > Duration::from_secs(50),
        "reset_expiry said confirmed, but the new primary expires the key in {left:?}"
    );
    // And the guard counts on what the new primary confirmed (the grant's
    // 30 s alone would leave less than that).
    assert!(
        estimate > Duration::from_secs(45),
        "confirmed on the new primary, but the guard counts on only {estimate:?}"
    );
    assert!(!g.is_lost());
}

#[test]
fn a_shortening_the_old_primary_confirms_after_a_renewal_on_the_new_one_never_outlives_the_bound() {
    let deployment = TestSentinel::start();
    let (coord, switches) = late_answers(&deployment);
    let lock = fenced(&coord, "late-shortening");
    let g = lock.try_acquire(Duration::from_secs(60)).unwrap().unwrap();
    let _keep = g.keep_alive().unwrap();
    let key = g.key().to_owned();
    let mut granted = None;
    wait_until(Duration::from_secs(5), "the grant on the replica", || {
        granted = expiry_on(deployment.replica(), &key);
        granted.is_some()
    });
    let granted = granted.unwrap();
    let (shortened, new_primary) = answered_by_the_old_primary_after_a_failover(
        &deployment,
        &switches,
        || g.reset_expiry(Duration::from_secs(20)),
        |new_primary| {
            // The switch gave up the shortening's claim and kept its worst
            // case in the bound, so keep-alive renews on the new primary
            // soon: the new primary's expiry moves past the grant's. Only
            // then does the old primary apply the shortening and confirm it.
            wait_until(
                Duration::from_secs(15),
                "a keep-alive renewal on the new primary",
                || {
                    expiry_on(new_primary, &key)
                        .is_some_and(|at| at > granted + Duration::from_millis(500))
                },
            );
        },
    );
    // The oracle: the new primary's own expiry of the key, against the
    // bound the guard counts on.
    let estimate = g.remaining_estimate();
    let left = expiry_on(new_primary, &key)
        .expect("the new primary holds the lease")
        .saturating_duration_since(Instant::now());
    println!("shortened: {shortened:?}, the new primary's expiry in {left:?}");
    assert!(
        estimate <= left + Duration::from_millis(5),
        "the guard counts on {estimate:?} while the new primary expires the key in {left:?}"
    );
    // The shortening went once more, with a claim of its own, to the new
    // primary: confirmed there, and the guard counts on it.
    assert!(shortened.unwrap(), "the shortening was refused");
    assert!(
        left <= Duration::from_secs(20),
        "confirmed, but the new primary expires the key in {left:?}"
    );
    assert!(!g.is_lost());
}

/// A coordinator idle through two switches: it made a grant the replica
/// acknowledged on server 0, then made no call while server 1 was promoted
/// and server 0 promoted back. Every promotion kept the grant (server 0 holds
/// its counter throughout), so the next grant must be made — the history is
/// not lost, though server 0 now names only its own new replication id and
/// server 1's, never the one the grant was acknowledged under. (Before the
/// coordinator read each new primary's history at the switch, it refused
/// every grant from then on.)
#[test]
fn an_idle_coordinator_keeps_its_history_through_two_switches() {
    let deployment = failing_over_on_request();
    let require = require_the_replica();
    let idle = builder(&deployment).replication(require).build().unwrap();
    let tag = format!("{{{}}}", unique_prefix("two-switches"));
    let (lease, fence) = (format!("{tag}:lease"), format!("{tag}:fence"));
    let lock = idle.fenced_lock(&lease, &fence).unwrap();
    let ttl = Duration::from_secs(30);
    let wait = Duration::from_secs(15);
    let first = {
        let guard = lock.acquire_timeout(ttl, wait).unwrap().expect("granted");
        assert_eq!(guard.replicas_acknowledged(), Some(1));
        let token = guard.fencing_token().get();
        guard.release().unwrap();
        token
    };

    deployment.wait_selectable(1, "slave", Duration::from_secs(30));
    deployment.failover();
    deployment.wait_replica_of(0, Duration::from_secs(30));
    deployment.wait_selectable(0, "slave", Duration::from_secs(30));
    deployment.failover();
    deployment.wait_replica_of(1, Duration::from_secs(30));
    assert_eq!(deployment.primary_index(), 0);
    assert_eq!(counter_on(deployment.server(0), &fence), Some(first));

    let guard = lock
        .acquire_timeout(ttl, wait)
        .unwrap_or_else(|e| panic!("the grant after two unwatched switches: {e}"))
        .expect("granted");
    assert!(guard.fencing_token().get() > first);
}
