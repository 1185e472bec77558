//! A lease's bound on a replicated deployment, judged by what a replica holds:
//! under `Replication::Require` an extension counts only once the required
//! replicas acknowledged it, so no guard counts on more than a replica
//! promoted now would hold, whether or not the client ever hears of the
//! promotion. Under `Off` the window is real, and shown as a negative control.
//!
//! The oracle is the replica itself: its `PTTL` for the key (a replica
//! answers for a key that expired by its clock as for a missing one), read on
//! a connection of the test's own.

mod support;

use std::time::{Duration, Instant};

use respire_coordination::{Coordinator, Error, Replication};
use support::{Mode, TestServer, proxied_replica, unique_prefix, wait_until};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

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

fn require() -> Replication {
    Replication::Require {
        replicas: 1,
        timeout: ms(100),
    }
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
/// cut: when the guard was first seen lost and what the replica had left
/// then, and whether the replica's copy was seen gone while the guard was
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
    let mut watched = Watched {
        lost_after: None,
        replica_left_at_loss: None,
        replica_gone_while_held: false,
    };
    while start.elapsed() < ms(10_000) {
        // The replica is read first: a guard seen held after that read was
        // held when the replica answered.
        let left = pttl(&mut on_replica, &key);
        let lost = guard.is_lost();
        if lost && watched.lost_after.is_none() {
            watched.lost_after = Some(start.elapsed());
            watched.replica_left_at_loss = Some(left);
        }
        if left <= 0 {
            watched.replica_gone_while_held = !lost;
            break;
        }
        std::thread::sleep(ms(2));
    }
    drop(keep);
    watched
}

#[test]
fn under_require_a_renewal_no_replica_acknowledged_never_moves_the_bound_past_the_replica() {
    let primary = TestServer::start();
    let (link, replica) = proxied_replica(&primary);
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
    let prefix = unique_prefix("require_reset");
    let coord = coordinator(&primary, &prefix, require());
    let lock = coord.lock("job").unwrap();
    let guard = lock.try_acquire(TTL).unwrap().expect("free");
    let key = guard.key().to_owned();
    // Acknowledged: it counts.
    assert!(guard.reset_expiry(ms(3_000)).unwrap());
    assert!(guard.remaining_estimate() > TTL);

    link.set_mode(Mode::Blackhole);
    let before = guard.remaining_estimate();
    let err = guard.reset_expiry(ms(6_000)).unwrap_err();
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
    assert!(on_primary > 5_000, "{on_primary}");
    assert!(
        guard.remaining_estimate() <= before,
        "{:?}",
        guard.remaining_estimate()
    );

    // A shorter one not acknowledged: its worst case (the shorter expiry on
    // the primary) bounds the guard all the same.
    let err = guard.reset_expiry(ms(400)).unwrap_err();
    assert!(
        matches!(err, Error::ExtensionNotReplicated { .. }),
        "{err:?}"
    );
    assert!(
        guard.remaining_estimate() <= ms(400),
        "{:?}",
        guard.remaining_estimate()
    );
    let mut on_replica = replica.client();
    assert!(pttl(&mut on_replica, &key) > 0);
}
