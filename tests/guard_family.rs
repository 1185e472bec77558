//! One guard API over both backends: the same generic code holds, extends,
//! keeps alive and releases a single-deployment lease and a Redlock lock, and
//! what it reports is judged by the servers' own view of the keys.

mod support;
use support::ms;

use std::time::Duration;

use respire_coordination::{
    Backend, Coordinator, Error, Fencing, Guard, Lease, LeaseGuard, RedlockGroup, RedlockOptions,
    ReleaseOutcome, Verifiable,
};
use support::{TestServer, wait_until};

/// The key's remaining TTL on `server`, in ms (−2: gone).
fn pttl(server: &TestServer, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query(&mut server.client())
        .unwrap()
}

/// What generic code does with any guard: renew in the background, reset
/// the expiry, release. Returns what the release reported and the remaining
/// estimate right after the reset.
fn hold<G: Guard>(guard: G, ttl: Duration) -> (Duration, ReleaseOutcome) {
    let renewal = guard.keep_alive().unwrap();
    assert!(!guard.is_lost());
    assert!(guard.reset_expiry(ttl).unwrap());
    let estimate = guard.remaining_estimate();
    assert!(
        guard.lost_signal().try_recv().is_err(),
        "nothing is sent on a loss signal"
    );
    drop(renewal);
    (estimate, guard.release().unwrap())
}

/// Releases a guard whose lease the servers already dropped.
fn release_lapsed<G: Guard>(guard: G) -> ReleaseOutcome {
    assert!(guard.is_lost());
    assert!(guard.lost_signal().recv().is_err(), "closed once lost");
    guard.release().unwrap()
}

fn token<G: Fencing>(guard: &G) -> u64 {
    guard.fencing_token().get()
}

fn time_left<G: Verifiable>(guard: &G) -> Option<Duration> {
    guard.verify_still_held().unwrap()
}

#[test]
fn the_same_code_holds_a_single_deployment_lease_and_a_redlock_lock() {
    let servers: Vec<TestServer> = (0..3).map(|_| TestServer::start()).collect();
    let coords: Vec<Coordinator> = servers
        .iter()
        .map(|s| {
            Coordinator::builder(&s.url())
                .node_timeout(ms(300))
                .build()
                .unwrap()
        })
        .collect();

    // One deployment.
    let lock = coords[0].fenced_lock("{f}:lease", "{f}:fence").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    assert!(token(&guard) >= 1);
    let held = time_left(&guard).expect("held");
    assert!(held <= Duration::from_secs(30));
    let (estimate, outcome) = hold(guard, Duration::from_secs(5));
    assert_eq!(outcome, ReleaseOutcome::Released);
    assert!(estimate <= Duration::from_secs(5), "{estimate:?}");
    assert_eq!(pttl(&servers[0], "{f}:lease"), -2, "deleted on the server");

    // A quorum of three.
    let group = RedlockGroup::new(coords.clone(), RedlockOptions::default()).unwrap();
    let guard = group
        .lock("job")
        .unwrap()
        .try_acquire(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    let (estimate, outcome) = hold(guard, Duration::from_secs(5));
    assert_eq!(outcome, ReleaseOutcome::Released);
    assert!(estimate <= Duration::from_secs(5), "{estimate:?}");
    // Decided by a quorum; the last node gets it in the background.
    let gone = servers.iter().filter(|s| pttl(s, "job") == -2).count();
    assert!(gone >= 2, "deleted on a quorum: {gone}");
    wait_until(Duration::from_secs(5), "deleted on every node", || {
        servers.iter().all(|s| pttl(s, "job") == -2)
    });

    // Lapsed before the release, on both backends.
    let guard = lock.try_acquire(ms(800)).unwrap().unwrap();
    wait_until(
        Duration::from_secs(5),
        "the lease expired on the server",
        || pttl(&servers[0], "{f}:lease") == -2,
    );
    assert_eq!(release_lapsed(guard), ReleaseOutcome::Expired);
    let guard = group
        .lock("job")
        .unwrap()
        .try_acquire(ms(800))
        .unwrap()
        .unwrap();
    wait_until(
        Duration::from_secs(5),
        "the lock expired on every node",
        || servers.iter().all(|s| pttl(s, "job") == -2),
    );
    assert_eq!(release_lapsed(guard), ReleaseOutcome::Expired);
}

#[test]
fn every_grant_with_a_token_is_fencing() {
    let server = TestServer::start();
    let coord = Coordinator::connect(&server.url()).unwrap();
    let ttl = Duration::from_secs(30);
    let fenced = coord.fenced_lock("{g}:lease", "{g}:fence").unwrap();
    let rw = coord.read_write_lease("{g2}").unwrap();
    let sem = coord.semaphore("{g3}", 2).unwrap();
    let a = fenced.try_acquire(ttl).unwrap().unwrap();
    let w = rw.write().try_acquire(ttl).unwrap().unwrap();
    let p = sem.try_acquire(ttl).unwrap().unwrap();
    // Through the trait, the same tokens the kinds' own methods give.
    assert_eq!(token(&a), a.fencing_token().get());
    assert_eq!(token(&w), w.fencing_token().get());
    assert_eq!(token(&p), p.fencing_token().get());
    // Each from its own counter: the first grant of each.
    assert_eq!((token(&a), token(&w), token(&p)), (1, 1, 1));
}

/// Three independent servers and a coordinator on each.
fn three_servers() -> (Vec<TestServer>, Vec<Coordinator>) {
    let servers: Vec<TestServer> = (0..3).map(|_| TestServer::start()).collect();
    let coords = servers
        .iter()
        .map(|s| Coordinator::connect(&s.url()).unwrap())
        .collect();
    (servers, coords)
}

/// What generic code does with any lease handle: one attempt, then a bounded
/// wait behind the first grant, which must run out with nothing.
fn take_twice<B: Backend>(lease: &Lease<B>, ttl: Duration) -> LeaseGuard<B> {
    let first = lease.try_acquire(ttl).unwrap().expect("free");
    assert!(
        lease.acquire_timeout(ttl, ms(300)).unwrap().is_none(),
        "held by the first grant"
    );
    first
}

#[test]
fn the_same_code_takes_a_lease_on_one_deployment_and_on_a_quorum() {
    let (servers, coords) = three_servers();
    let ttl = Duration::from_secs(30);

    let lock = coords[0].lock("{h}").unwrap().with_holder("one").unwrap();
    let guard = take_twice(&lock, ttl);
    assert!(pttl(&servers[0], "{h}") > 20_000, "held on the server");
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    assert_eq!(pttl(&servers[0], "{h}"), -2);

    let group = RedlockGroup::new(coords.clone(), RedlockOptions::default()).unwrap();
    let lock = group.lock("quorum").unwrap().with_holder("many").unwrap();
    assert_eq!(lock.holder(), Some("many"));
    let guard = take_twice(&lock, ttl);
    let held = servers
        .iter()
        .filter(|s| pttl(s, "quorum") > 20_000)
        .count();
    assert!(held >= 2, "held on a quorum: {held}");
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    wait_until(Duration::from_secs(5), "deleted on every node", || {
        servers.iter().all(|s| pttl(s, "quorum") == -2)
    });
    assert!(matches!(group.lock(""), Err(Error::InvalidArgument(_))));
}

/// With everything of the crate in scope (its `Guard` trait too), a Redlock
/// guard's `release` is the one every guard has: it takes the guard and says
/// what it found.
mod glob_import {
    use respire_coordination::*;

    use super::{ms, pttl, three_servers};

    #[test]
    fn release_is_the_same_verb_with_the_whole_crate_in_scope() {
        let (servers, coords) = three_servers();
        let group = RedlockGroup::new(coords, RedlockOptions::default()).unwrap();
        let guard: RedlockGuard = group
            .lock("glob")
            .unwrap()
            .try_acquire(ms(30_000))
            .unwrap()
            .unwrap();
        let outcome: Result<ReleaseOutcome> = guard.release();
        assert_eq!(outcome.unwrap(), ReleaseOutcome::Released);
        let gone = servers.iter().filter(|s| pttl(s, "glob") == -2).count();
        assert!(gone >= 2, "deleted on a quorum: {gone}");
    }
}
