//! The fenced lock: tokens, the counter's durability, and every refusal.

mod support;
use support::coordinator;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{Coordinator, Error, ReleaseOutcome, Replication};
use support::{Mode, TestServer, proxied_replica, shared_server, unique_prefix};

#[test]
fn tokens_strictly_increase_across_eight_threads() {
    let prefix = unique_prefix("tokens");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(300));
    let lock = coord.fenced_lock("{job}:lease", "{job}:fence").unwrap();
    // Pushed while holding the lease, so the order is the order of grants.
    let grants = Mutex::new(Vec::with_capacity(4000));
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..500 {
                    let guard = lock
                        .acquire_timeout(Duration::from_secs(10), Duration::from_secs(60))
                        .unwrap()
                        .expect("granted within a minute");
                    grants.lock().unwrap().push(guard.fencing_token().get());
                    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
                }
            });
        }
    });
    let grants = grants.into_inner().unwrap();
    assert_eq!(grants.len(), 4000);
    for pair in grants.windows(2) {
        assert!(
            pair[0] < pair[1],
            "token {} came after {}",
            pair[1],
            pair[0]
        );
    }
    assert_eq!(grants[0], 1);
    assert_eq!(
        *grants.last().unwrap(),
        4000,
        "a token was skipped or repeated"
    );
    let counter: u64 = shared_server()
        .client()
        .get(format!("{prefix}{{job}}:fence"))
        .unwrap();
    assert_eq!(counter, 4000);
}

#[test]
fn the_counter_survives_kill_and_restart_with_appendfsync_always() {
    let server = TestServer::builder().append_only().start();
    let coord = coordinator(&server.url(), "", Duration::from_millis(300));
    let lock = coord.fenced_lock("{j}:lease", "{j}:fence").unwrap();
    let mut last = 0;
    for _ in 0..5 {
        let g = lock.try_acquire(Duration::from_secs(5)).unwrap().unwrap();
        last = g.fencing_token().get();
        g.release().unwrap();
    }
    assert_eq!(last, 5);
    server.kill();
    server.restart();
    let coord = coordinator(&server.url(), "", Duration::from_millis(300));
    let lock = coord.fenced_lock("{j}:lease", "{j}:fence").unwrap();
    let g = lock.try_acquire(Duration::from_secs(5)).unwrap().unwrap();
    assert_eq!(g.fencing_token().get(), 6);
}

#[test]
fn a_counter_that_went_back_is_reported_and_its_lease_released() {
    let prefix = unique_prefix("regress");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(300));
    let lock = coord.fenced_lock("{j}:lease", "{j}:fence").unwrap();
    for _ in 0..3 {
        drop(lock.try_acquire(Duration::from_secs(5)).unwrap().unwrap());
    }
    // Simulates lost history (a failover to a replica that missed increments).
    let fence = format!("{prefix}{{j}}:fence");
    let _: () = shared_server().client().set(&fence, 1).unwrap();
    let err = lock.try_acquire(Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::FencingRegression {
                issued: 2,
                seen: 3,
                ..
            }
        ),
        "{err}"
    );
    let lease = format!("{prefix}{{j}}:lease");
    assert!(!shared_server().client().exists::<_, bool>(&lease).unwrap());
    // Another coordinator has no history to compare with.
    let fresh = coordinator(&shared_server().url(), &prefix, Duration::from_millis(300));
    let g = fresh
        .fenced_lock("{j}:lease", "{j}:fence")
        .unwrap()
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .unwrap();
    assert_eq!(g.fencing_token().get(), 3);
}

/// Snapshot of a key: type, value (if a string), TTL.
fn snapshot(key: &str) -> (String, Option<String>, i64) {
    let mut c = shared_server().client();
    let kind: String = redis::cmd("TYPE").arg(key).query(&mut c).unwrap();
    let value: Option<String> = if kind == "string" {
        c.get(key).unwrap()
    } else {
        None
    };
    let ttl: i64 = c.pttl(key).unwrap();
    (kind, value, ttl)
}

#[test]
fn every_refusal_changes_nothing() {
    let prefix = unique_prefix("refusals");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(300));
    let mut admin = shared_server().client();

    // Keys in different cluster slots.
    let err = coord.fenced_lock("a:lease", "b:fence").unwrap_err();
    match &err {
        Error::CrossSlot {
            first_slot,
            second_slot,
            ..
        } => assert_ne!(first_slot, second_slot),
        other => panic!("expected CrossSlot, got {other}"),
    }
    assert!(matches!(
        coord.fenced_lock("", "{x}f"),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        coord.fenced_lock("{x}l", ""),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        coord.fenced_lock("{x}k", "{x}k"),
        Err(Error::InvalidArgument(_))
    ));

    // (what, how to break the keys, a word the error must name)
    type Setup = Box<dyn Fn(&mut redis::Connection, &str, &str)>;
    let cases: Vec<(&str, Setup, &str)> = vec![
        (
            "counter with a ttl",
            Box::new(|c, _, fence| {
                let _: () = c.set_ex(fence, 7, 100).unwrap();
            }),
            "expiry",
        ),
        (
            "counter not an integer",
            Box::new(|c, _, fence| {
                let _: () = c.set(fence, "seven").unwrap();
            }),
            "integer",
        ),
        (
            "counter negative",
            Box::new(|c, _, fence| {
                let _: () = c.set(fence, "-3").unwrap();
            }),
            "integer",
        ),
        (
            "counter of another type",
            Box::new(|c, _, fence| {
                let _: () = c.rpush(fence, "x").unwrap();
            }),
            "list",
        ),
        (
            "lease of another type",
            Box::new(|c, lease, _| {
                let _: () = c.hset(lease, "f", "v").unwrap();
            }),
            "hash",
        ),
    ];
    for (i, (what, setup, expect)) in cases.into_iter().enumerate() {
        let lease_name = format!("{{c{i}}}:lease");
        let fence_name = format!("{{c{i}}}:fence");
        let lease = format!("{prefix}{lease_name}");
        let fence = format!("{prefix}{fence_name}");
        setup(&mut admin, &lease, &fence);
        let before = (snapshot(&lease), snapshot(&fence));
        let lock = coord.fenced_lock(&lease_name, &fence_name).unwrap();
        let err = lock.try_acquire(Duration::from_secs(5)).unwrap_err();
        assert!(matches!(err, Error::BadKey { .. }), "{what}: {err}");
        assert!(err.to_string().contains(expect), "{what}: {err}");
        let err = lock
            .acquire_timeout(Duration::from_secs(5), Duration::from_secs(1))
            .unwrap_err();
        assert!(
            matches!(err, Error::BadKey { .. }),
            "{what} (waiting): {err}"
        );
        let after = (snapshot(&lease), snapshot(&fence));
        assert_eq!(before.0.0, after.0.0, "{what}: lease type changed");
        assert_eq!(before.0.1, after.0.1, "{what}: lease changed");
        assert_eq!(before.1.0, after.1.0, "{what}: counter type changed");
        assert_eq!(before.1.1, after.1.1, "{what}: counter changed");
        assert_eq!(
            before.1.2 == -1,
            after.1.2 == -1,
            "{what}: counter expiry changed"
        );
    }
}

#[test]
fn keep_alive_without_client_kill_rights_is_a_permission_error() {
    let server = TestServer::builder()
        .acl_user("user nokill on >pw ~* &* +@all -client|kill")
        .start();
    let coord = Coordinator::builder(&server.url_for_user("nokill", "pw"))
        .node_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let lock = coord.fenced_lock("{p}:lease", "{p}:fence").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(5)).unwrap().unwrap();
    let ttl_before: i64 = server.client().pttl("{p}:lease").unwrap();
    let err = guard.keep_alive().unwrap_err();
    assert!(matches!(err, Error::Permission(_)), "{err}");
    assert!(err.to_string().contains("CLIENT KILL"), "{err}");
    let value: String = server.client().get("{p}:lease").unwrap();
    assert!(value.ends_with(":1"));
    let ttl_after: i64 = server.client().pttl("{p}:lease").unwrap();
    assert!(ttl_after <= ttl_before, "the lease was extended");
    let counter: u64 = server.client().get("{p}:fence").unwrap();
    assert_eq!(counter, 1);
}

#[test]
fn the_fencing_token_is_copy_ord_and_display() {
    let prefix = unique_prefix("token");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(300));
    let lock = coord.fenced_lock("{t}:lease", "{t}:fence").unwrap();
    let a = lock.try_acquire(Duration::from_secs(5)).unwrap().unwrap();
    let ta = a.fencing_token();
    drop(a);
    let b = lock.try_acquire(Duration::from_secs(5)).unwrap().unwrap();
    let tb = b.fencing_token();
    assert!(tb > ta);
    assert_eq!(format!("{ta}"), "1");
    assert_eq!(tb.get(), 2);
    let text = format!("{b:?}");
    assert!(
        text.contains("fencing_token") && text.contains("lease"),
        "{text}"
    );
}

/// A grant whose `WAIT` blocked for its whole timeout (the replica's link cut)
/// is still checked against the tokens received before it was sent: a counter
/// that went back meanwhile is refused.
#[test]
fn a_counter_that_went_back_is_refused_after_a_grant_that_waited_for_replicas() {
    let primary = TestServer::start();
    let (link, replica) = proxied_replica(&primary);
    let wait = Duration::from_secs(1);
    let coord = Coordinator::builder(&primary.url())
        .node_timeout(Duration::from_millis(100))
        .replication(Replication::Report { timeout: wait })
        .build()
        .unwrap();
    let lock = coord.fenced_lock("{w}:lease", "{w}:fence").unwrap();
    let mut admin = primary.client();
    let _: () = admin.set("{w}:fence", 219).unwrap();
    let first = lock
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .expect("free");
    assert_eq!(first.fencing_token().get(), 220);
    assert_eq!(first.replicas_acknowledged(), Some(1));
    assert_eq!(first.release().unwrap(), ReleaseOutcome::Released);
    // The counter's history is lost (as in a failover to a replica behind).
    let _: () = admin.set("{w}:fence", 19).unwrap();
    link.set_mode(Mode::Blackhole);
    let sent = Instant::now();
    let second = lock.try_acquire(Duration::from_secs(5));
    assert!(
        sent.elapsed() >= wait,
        "WAIT did not block: {:?}",
        sent.elapsed()
    );
    match second {
        Err(Error::FencingRegression { issued, seen, .. }) => {
            assert_eq!((issued, seen), (20, 220));
        }
        other => panic!("token 20 after 220 was not refused: {other:?}"),
    }
    drop(replica);
}
