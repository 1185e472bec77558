//! The fake deployment (`test-util`), used as a user's test would, from the
//! public API: a lease cut short by the fake's clock, a failover to a replica
//! that missed an extension, a grant whose reply never came, a paused fake,
//! replies delayed past the node timeout, a restart without persistence.
//! Each runs in well under a second; each prints its wall time.
//!
//! The oracle is the fake's own data, read on a raw `redis` connection of the
//! test's (`PTTL`, `GET`, `PEXPIRETIME` with `TIME`), never the guard's
//! estimate.

mod support;
use support::ms;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use respire_coordination::fake::FakeDeployment;
use respire_coordination::{Coordinator, Error, LockGuard, Observer, RenewalEvent};
use support::wait_until;

const NODE_TIMEOUT: Duration = Duration::from_millis(100);
/// About the shortest TTL keep-alive takes with that node timeout.
const KEPT_TTL: Duration = Duration::from_millis(450);

fn raw(url: &str) -> redis::Connection {
    redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .expect("a raw connection to the fake")
}

fn pttl(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).expect("PTTL")
}

/// A coordinator on `fake`, told of its events when `observer` is given.
fn coordinator(fake: &FakeDeployment, observer: Option<Arc<Renewals>>) -> Coordinator {
    let mut builder = Coordinator::builder(fake.url()).node_timeout(NODE_TIMEOUT);
    if let Some(observer) = observer {
        builder = builder.observer(observer);
    }
    builder.build().unwrap()
}

/// Confirmed renewals, counted.
#[derive(Default)]
struct Renewals(AtomicUsize);

impl Observer for Renewals {
    fn renewed(&self, _: &RenewalEvent<'_>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Looks at the fake's `PTTL` of `key`, then at `lost`, until `lost` says
/// so: the fake must not have let the key go (`PTTL` 0 is its last
/// millisecond, -2 gone) before the guard was flagged. Returns the `PTTL`
/// read just before the flag was seen.
fn flagged_before_the_fake_lets_go(
    conn: &mut redis::Connection,
    key: &str,
    lost: impl Fn() -> bool,
    what: &str,
) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = pttl(conn, key);
        let flagged = lost();
        assert!(
            left > 0 || flagged,
            "{what}: the fake let the lease go (PTTL {left}) while the guard held it"
        );
        if flagged {
            return left;
        }
        assert!(Instant::now() < deadline, "{what}: never flagged lost");
    }
}

#[test]
fn a_lease_cut_short_by_the_fakes_clock_is_flagged_before_the_fake_lets_it_go() {
    let started = Instant::now();
    let fake = FakeDeployment::start().unwrap();
    let renewals = Arc::new(Renewals::default());
    let coord = coordinator(&fake, Some(renewals.clone()));
    // One lease nobody renews, and a short kept-alive one whose renewals
    // read the fake's TIME.
    let held_lock = coord.lock("held").unwrap();
    let held = held_lock.try_acquire(ms(1_300)).unwrap().expect("free");
    let short_lock = coord.lock("short").unwrap();
    let short = short_lock.try_acquire(KEPT_TTL).unwrap().expect("free");
    let _renewal = short.keep_alive().unwrap();
    wait_until(ms(2_000), "a renewal", || {
        renewals.0.load(Ordering::SeqCst) >= 1
    });
    let mut conn = raw(&fake.primary_url());
    let before = pttl(&mut conn, held.key());
    // The step leaves the lease some 450 ms on the fake: time for the
    // short lease's next renewal (every 225 ms) to read the jump.
    fake.advance_clock(ms(600));
    let after = pttl(&mut conn, held.key());
    assert!(
        after > 0 && after <= before - 600,
        "the step left {after} ms of {before}"
    );
    assert!(!held.is_lost(), "flagged before any renewal read the clock");
    let left =
        flagged_before_the_fake_lets_go(&mut conn, held.key(), || held.is_lost(), "clock step");
    println!(
        "clock step: flagged with {left} ms left on the fake; wall time {:?}",
        started.elapsed()
    );
}

#[test]
fn a_failover_to_a_replica_that_missed_an_extension_is_flagged() {
    let started = Instant::now();
    let fake = FakeDeployment::start_sentinel("jobs").unwrap();
    let coord = Coordinator::builder(fake.url())
        .node_timeout(NODE_TIMEOUT)
        .topology_refresh(ms(100))
        .build()
        .unwrap();
    let lock = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    let guard = lock.try_acquire(ms(700)).unwrap().expect("free");
    // The replica stops applying writes: the extension reaches the primary
    // alone.
    fake.hold_replication();
    assert!(guard.reset_expiry(ms(10_000)).unwrap());
    assert!(fake.replication_lag() > 0, "the extension is not held back");
    assert!(guard.remaining_estimate() > ms(9_000));
    fake.fail_over();
    let mut conn = raw(&fake.primary_url());
    let left = pttl(&mut conn, guard.key());
    assert!(
        left > 0 && left <= 700,
        "the new primary has {left} ms of the lease: it did not miss the extension"
    );
    let left =
        flagged_before_the_fake_lets_go(&mut conn, guard.key(), || guard.is_lost(), "failover");
    println!(
        "failover: flagged with {left} ms left on the new primary; wall time {:?}",
        started.elapsed()
    );
}

#[test]
fn a_grant_whose_reply_was_dropped_leaves_no_lease_behind() {
    let started = Instant::now();
    let fake = FakeDeployment::start().unwrap();
    let coord = coordinator(&fake, None);
    let lock = coord.fenced_lock("{d}:lease", "{d}:fence").unwrap();
    let mut conn = raw(&fake.primary_url());
    let key = format!("{}{{d}}:lease", coord.key_prefix());
    let fence = format!("{}{{d}}:fence", coord.key_prefix());
    // A first grant and release: the fake has the scripts, so the attempt
    // below runs its grant rather than being told NOSCRIPT.
    let first = lock.try_acquire(ms(1_000)).unwrap().expect("free");
    first.release().unwrap();
    fake.drop_replies(1);
    let attempt = lock.try_acquire(ms(30_000));
    assert!(
        !matches!(attempt, Ok(Some(_))),
        "granted without a reply: {attempt:?}"
    );
    // The script ran: the counter moved; the lease it granted is deleted by
    // the clean-up, long before its 30 s would end it.
    let token: Option<u64> = redis::cmd("GET").arg(&fence).query(&mut conn).unwrap();
    assert_eq!(token, Some(2), "the grant never ran on the fake");
    wait_until(ms(2_000), "the unanswered grant cleaned up", || {
        pttl(&mut conn, &key) == -2
    });
    // And the key is free to the next holder.
    let next = lock.try_acquire(ms(1_000)).unwrap().expect("free again");
    assert!(next.fencing_token().get() > 2);
    println!(
        "dropped reply: {attempt:?}, cleaned up; wall time {:?}",
        started.elapsed()
    );
}

/// The lease's expiry on the fake as a local instant, from its
/// `PEXPIRETIME` and `TIME` read together; a millisecond early, as the fake's
/// `TIME` is whole milliseconds.
fn expiry_instant(conn: &mut redis::Connection, key: &str) -> Instant {
    let before = Instant::now();
    let (at, (secs, micros)): (i64, (i64, i64)) = redis::pipe()
        .atomic()
        .cmd("PEXPIRETIME")
        .arg(key)
        .cmd("TIME")
        .query(conn)
        .unwrap();
    assert!(at > 0, "{key} has no expiry ({at})");
    let left = at - (secs * 1_000 + micros / 1_000) - 1;
    before + ms(left.max(0) as u64)
}

/// A kept-alive lease of `KEPT_TTL` on `fake`, after its first confirmed
/// renewal, with the fake's expiry of it.
fn kept_alive_lease(fake: &FakeDeployment, test: impl FnOnce(&LockGuard, &mut redis::Connection)) {
    let renewals = Arc::new(Renewals::default());
    let coord = coordinator(fake, Some(renewals.clone()));
    let lock = coord.lock("kept").unwrap();
    let guard = lock.try_acquire(KEPT_TTL).unwrap().expect("free");
    let _renewal = guard.keep_alive().unwrap();
    wait_until(ms(2_000), "a renewal", || {
        renewals.0.load(Ordering::SeqCst) >= 1
    });
    let mut conn = raw(&fake.primary_url());
    test(&guard, &mut conn);
}

/// Waits for `guard`'s loss signal and checks that it came before `expiry`.
fn flagged_before(guard: &LockGuard, expiry: Instant, what: &str) -> Duration {
    let closed = guard
        .lost_signal()
        .recv_deadline(expiry + Duration::from_secs(2))
        .is_err_and(|e| e.is_disconnected());
    let flagged = Instant::now();
    assert!(closed, "{what}: the loss signal never closed");
    assert!(guard.is_lost());
    assert!(
        flagged < expiry,
        "{what}: flagged {:?} after the fake's expiry",
        flagged - expiry
    );
    expiry - flagged
}

#[test]
fn a_paused_fake_flags_a_kept_alive_lease_before_its_expiry() {
    let started = Instant::now();
    let fake = FakeDeployment::start().unwrap();
    kept_alive_lease(&fake, |guard, conn| {
        // Read before the pause: a renewal confirmed in between can only move
        // the real expiry later, which makes the check stricter.
        let expiry = expiry_instant(conn, guard.key());
        fake.pause();
        let margin = flagged_before(guard, expiry, "pause");
        fake.resume();
        wait_until(ms(2_000), "the fake lets the lease go", || {
            pttl(conn, guard.key()) == -2
        });
        println!(
            "pause: flagged {margin:?} before the fake's expiry; wall time {:?}",
            started.elapsed()
        );
    });
}

#[test]
fn replies_delayed_past_the_node_timeout_flag_the_lease_before_its_expiry() {
    let started = Instant::now();
    let fake = FakeDeployment::start().unwrap();
    kept_alive_lease(&fake, |guard, conn| {
        fake.delay_replies(usize::MAX, NODE_TIMEOUT * 2);
        // Read after the delay is in place: a renewal the fake runs later is
        // one whose reply comes too late to count.
        let expiry = expiry_instant(conn, guard.key());
        let margin = flagged_before(guard, expiry, "delayed replies");
        fake.delay_replies(0, Duration::ZERO);
        println!(
            "delayed replies: flagged {margin:?} before the fake's expiry; wall time {:?}",
            started.elapsed()
        );
    });
}

#[test]
fn a_restart_without_persistence_loses_the_lease_and_its_tokens() {
    let started = Instant::now();
    let fake = FakeDeployment::start().unwrap();
    let coord = coordinator(&fake, None);
    let lock = coord.fenced_lock("{r}:lease", "{r}:fence").unwrap();
    for _ in 0..3 {
        lock.try_acquire(ms(1_000))
            .unwrap()
            .expect("free")
            .release()
            .unwrap();
    }
    let guard = lock.try_acquire(KEPT_TTL).unwrap().expect("free");
    let _renewal = guard.keep_alive().unwrap();
    let run_id = fake.run_id();
    fake.restart();
    assert_ne!(fake.run_id(), run_id, "a restart changes the run_id");
    let mut conn = raw(&fake.primary_url());
    assert_eq!(pttl(&mut conn, guard.key()), -2, "the data survived");
    let closed = guard
        .lost_signal()
        .recv_timeout(ms(2_000))
        .is_err_and(|e| e.is_disconnected());
    assert!(
        closed && guard.is_lost(),
        "the renewal found the key, or none ran"
    );
    // The counter went back to nothing: the next grant's token (1) is not
    // above the 4 this coordinator saw, and is refused.
    let again = lock.try_acquire(ms(1_000));
    assert!(
        matches!(again, Err(Error::FencingRegression { .. })),
        "a token that went back was handed out: {again:?}"
    );
    println!("restart: wall time {:?}", started.elapsed());
}

#[test]
fn a_standalone_failover_to_a_replica_without_the_grant_is_flagged_at_the_next_renewal() {
    let started = Instant::now();
    let fake = FakeDeployment::start().unwrap();
    let coord = coordinator(&fake, None);
    let lock = coord.lock("unreplicated").unwrap();
    // The grant reaches the primary alone.
    fake.hold_replication();
    let guard = lock.try_acquire(KEPT_TTL).unwrap().expect("free");
    let _renewal = guard.keep_alive().unwrap();
    assert!(fake.replication_lag() > 0, "the grant is not held back");
    let run_id = fake.run_id();
    fake.fail_over();
    assert_ne!(fake.run_id(), run_id, "the replica took over");
    let mut conn = raw(&fake.primary_url());
    assert_eq!(
        pttl(&mut conn, guard.key()),
        -2,
        "the replica had the grant"
    );
    let closed = guard
        .lost_signal()
        .recv_timeout(ms(2_000))
        .is_err_and(|e| e.is_disconnected());
    assert!(closed && guard.is_lost(), "the lease outlived its key");
    // The key is free on the new primary.
    assert!(lock.try_acquire(KEPT_TTL).unwrap().is_some());
    println!("standalone failover: wall time {:?}", started.elapsed());
}
