//! A fencing counter that went back — a server restarted without persistence —
//! is refused for every primitive that hands out tokens (fenced locks, write
//! leases, permits), whether the grant came from one attempt or from a wait
//! that spanned the restart. The oracle is the server: its counter after the
//! restart, and the lease key, which the refused grant must not leave behind.

mod support;
use support::{coordinator, ms};

use std::thread;
use std::time::Duration;

use respire_coordination::{Coordinator, Error, FencingToken};
use support::{TestServer, unique_prefix};

const TTL: Duration = Duration::from_millis(3_000);

/// One primitive's acquire: `acquire_timeout` (one attempt with `wait`
/// zero), returning the token of what it got after keeping the guard for
/// `hold`, and calling `granted` as soon as it has it.
type Acquire =
    fn(&Coordinator, Duration, Duration, &dyn Fn()) -> Result<Option<FencingToken>, Error>;

fn fenced(
    coord: &Coordinator,
    wait: Duration,
    hold: Duration,
    granted: &dyn Fn(),
) -> Result<Option<FencingToken>, Error> {
    let lock = coord.fenced_lock("{t}lease", "{t}fence")?;
    let guard = lock.acquire_timeout(TTL, wait)?;
    let token = guard.as_ref().map(|g| g.fencing_token());
    granted();
    thread::sleep(hold);
    Ok(token)
}

fn write(
    coord: &Coordinator,
    wait: Duration,
    hold: Duration,
    granted: &dyn Fn(),
) -> Result<Option<FencingToken>, Error> {
    let lease = coord.read_write_lease("{t}rw")?;
    let guard = lease.write().acquire_timeout(TTL, wait)?;
    let token = guard.as_ref().map(|g| g.fencing_token());
    granted();
    thread::sleep(hold);
    Ok(token)
}

fn permit(
    coord: &Coordinator,
    wait: Duration,
    hold: Duration,
    granted: &dyn Fn(),
) -> Result<Option<FencingToken>, Error> {
    let semaphore = coord.semaphore("{t}sem", 1)?;
    let permit = semaphore.acquire_timeout(TTL, wait)?;
    let token = permit.as_ref().map(|p| p.fencing_token());
    granted();
    thread::sleep(hold);
    Ok(token)
}

fn keys(server: &TestServer) -> Vec<String> {
    redis::cmd("KEYS")
        .arg("*")
        .query(&mut server.client())
        .unwrap()
}

/// Two grants (tokens 1 and 2), a restart that loses the counter, one more
/// attempt: refused, and nothing of it left on the server.
fn refused_after_a_restart(acquire: Acquire, name: &str) {
    let server = TestServer::start();
    let coord = coordinator(&server.url(), &unique_prefix(name), ms(100));
    for expected in [1, 2] {
        let token = acquire(&coord, Duration::ZERO, Duration::ZERO, &|| {}).unwrap();
        assert_eq!(token.map(FencingToken::get), Some(expected), "{name}");
    }
    server.restart();
    let err = acquire(&coord, Duration::ZERO, Duration::ZERO, &|| {}).unwrap_err();
    assert!(
        matches!(
            err,
            Error::FencingRegression {
                issued: 1,
                seen: 2,
                ..
            }
        ),
        "{name}: {err:?}"
    );
    // The counter the server issued 1 from; the lease itself released.
    let left = keys(&server);
    assert!(
        left.iter()
            .all(|k| k.contains("fence") || k.ends_with(":meta")),
        "{name}: left {left:?}"
    );
}

#[test]
fn a_fenced_lock_refuses_a_token_that_went_back() {
    refused_after_a_restart(fenced, "regress_fenced");
}

#[test]
fn a_write_lease_refuses_a_token_that_went_back() {
    refused_after_a_restart(write, "regress_write");
}

#[test]
fn a_permit_refuses_a_token_that_went_back() {
    refused_after_a_restart(permit, "regress_permit");
}

/// One thread holds token 6 while another of the same coordinator waits; the
/// server goes down for a second and comes back empty: the wait must not end
/// with token 1.
fn refused_after_a_wait_across_a_restart(acquire: Acquire, name: &str) {
    let server = TestServer::start();
    let coord = coordinator(&server.url(), &unique_prefix(name), ms(100));
    for _ in 0..5 {
        acquire(&coord, Duration::ZERO, Duration::ZERO, &|| {})
            .unwrap()
            .expect("free");
    }
    let ended = thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let holder_coord = coord.clone();
        let holder = s.spawn(move || {
            acquire(&holder_coord, Duration::ZERO, ms(1_500), &|| {
                tx.send(()).unwrap()
            })
        });
        rx.recv_timeout(ms(5_000)).expect("the holder's grant");
        // The waiter's first attempt reaches the server (and finds it held).
        let mut conn = server.client();
        let scripts = support::calls(&mut conn, &["evalsha", "eval"]);
        let waiter = s.spawn(|| acquire(&coord, ms(10_000), Duration::ZERO, &|| {}));
        support::wait_until(ms(5_000), "the waiter's first attempt", || {
            support::calls(&mut conn, &["evalsha", "eval"]) > scripts
        });
        // Down for a second: the fault itself, not a wait for anything.
        server.kill();
        thread::sleep(ms(1_000));
        server.restart();
        assert_eq!(
            holder.join().unwrap().unwrap().map(FencingToken::get),
            Some(6),
            "{name}"
        );
        waiter.join().unwrap()
    });
    match ended {
        Err(Error::FencingRegression { issued, seen, .. }) => {
            assert_eq!((issued, seen), (1, 6), "{name}");
        }
        other => panic!("{name}: the wait ended with {other:?}"),
    }
}

#[test]
fn a_fenced_lock_wait_across_a_restart_refuses_the_token_that_went_back() {
    refused_after_a_wait_across_a_restart(fenced, "regress_wait_fenced");
}

#[test]
fn a_write_lease_wait_across_a_restart_refuses_the_token_that_went_back() {
    refused_after_a_wait_across_a_restart(write, "regress_wait_write");
}

#[test]
fn a_permit_wait_across_a_restart_refuses_the_token_that_went_back() {
    refused_after_a_wait_across_a_restart(permit, "regress_wait_permit");
}
