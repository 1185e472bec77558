//! A server whose wall clock is stepped forward: Redis (and Valkey) expire
//! keys by the wall clock, so every lease on it ends early by the step. The
//! coordinator reads the server's `TIME` with every renewal pipeline, finds
//! the clock ran ahead of its own monotonic clock, and cuts every lease on the
//! server by what the server gained, before the server lets one go.
//!
//! The server's clock is stepped with libfaketime (Debian `faketime`), which
//! cannot run under Debian's `redis-server` (its jemalloc and libfaketime call
//! each other while starting); the Valkey 8.1 binary that `scripts/install-deps`
//! fetches runs under it, so these servers are Valkey whatever
//! `RESPIRE_TEST_SERVER` says.
//!
//! The oracle is the server's own `PTTL` for the key, read on a connection of
//! the test's own before each look at the guard.

mod support;
use support::ms;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use respire_coordination::{Coordinator, Observer, ServerClockEvent};
use support::{ServerKind, TestServer, calls, unique_prefix, wait_until};

const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
const NODE_TIMEOUT: Duration = Duration::from_millis(100);
/// The step: more than the long lease has left on the server, less than its TTL.
const STEP_SECS: u64 = 10;

/// A Valkey server whose wall clock is `rc`'s offset ("+0", "+10", …), read
/// by libfaketime at every clock call.
fn stepped_server(rc: &Path) -> TestServer {
    assert!(
        Path::new(LIBFAKETIME).exists(),
        "{LIBFAKETIME} is missing: scripts/install-deps installs Debian's faketime"
    );
    std::fs::write(rc, "+0").unwrap();
    TestServer::builder()
        .kind(ServerKind::Valkey)
        .env("LD_PRELOAD", LIBFAKETIME)
        .env("FAKETIME_TIMESTAMP_FILE", rc.display().to_string())
        .env("FAKETIME_NO_CACHE", "1")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .start()
}

/// The clock jumps the coordinator reported.
#[derive(Default)]
struct Jumps(Mutex<Vec<(Instant, Duration, usize)>>);

impl Observer for Jumps {
    fn server_clock_jumped(&self, event: &ServerClockEvent<'_>) {
        self.0
            .lock()
            .unwrap()
            .push((Instant::now(), event.gain, event.leases));
    }
}

fn pttl(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).expect("PTTL")
}

fn server_time(conn: &mut redis::Connection) -> u64 {
    let (secs, _): (u64, u64) = redis::cmd("TIME").query(conn).expect("TIME");
    secs
}

#[test]
fn a_server_clock_stepped_forward_flags_the_lease_before_the_server_lets_it_go() {
    let dir = std::env::temp_dir().join(format!("respire-faketime-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rc: PathBuf = dir.join("faketimerc");
    let server = stepped_server(&rc);
    let jumps = Arc::new(Jumps::default());
    let coord = Coordinator::builder(&server.url())
        .key_prefix(&unique_prefix("clock_step"))
        .node_timeout(NODE_TIMEOUT)
        .observer(jumps.clone())
        .build()
        .unwrap();
    // Two leases of 12 s, one kept alive (renewed at 6 s) and one not, and a
    // short one whose renewals (every half second) read the server's clock.
    let lock = coord.lock("held").unwrap();
    let held = lock.try_acquire(ms(12_000)).unwrap().expect("free");
    let lock = coord.lock("kept").unwrap();
    let kept = lock.try_acquire(ms(12_000)).unwrap().expect("free");
    let _kept_renewal = kept.keep_alive().unwrap();
    let lock = coord.lock("short").unwrap();
    let short = lock.try_acquire(ms(1_000)).unwrap().expect("free");
    let _short_renewal = short.keep_alive().unwrap();
    let mut conn = server.client();
    // Two readings of the clock before the step.
    wait_until(ms(5_000), "two renewal pipelines", || {
        calls(&mut conn, &["time"]) >= 2
    });
    let before = server_time(&mut conn);
    std::fs::write(&rc, format!("+{STEP_SECS}")).unwrap();
    let stepped = Instant::now();
    assert!(
        server_time(&mut conn) >= before + STEP_SECS,
        "the clock stepped"
    );
    let left_after_step = pttl(&mut conn, held.key());
    assert!(
        left_after_step > 0 && left_after_step < 3_000,
        "the lease has {left_after_step} ms left on the stepped server"
    );

    // The lease nobody renews: flagged lost before the server lets it go.
    // The kept-alive one: once the step is found, never counted on for
    // longer than the server has it (the time between the reads counted
    // against the guard).
    let mut flagged: Option<(Duration, i64)> = None;
    loop {
        let read = Instant::now();
        let left = pttl(&mut conn, held.key());
        let kept_left = pttl(&mut conn, kept.key());
        let lost = held.is_lost();
        let kept_counted = kept.remaining_estimate() + read.elapsed();
        if lost && flagged.is_none() {
            flagged = Some((stepped.elapsed(), left));
        }
        assert!(
            left > 0 || lost,
            "the server let the lease go {:?} after the step while the guard held it",
            stepped.elapsed()
        );
        // No client can know before it reads the clock again: from the
        // report on (one renewal of the short lease after the step).
        let reported = jumps.0.lock().unwrap().first().is_some_and(|j| j.0 <= read);
        assert!(
            !reported || kept_counted <= ms(kept_left.max(0) as u64 + 1),
            "the kept-alive guard counted on {kept_counted:?}, the server had {kept_left} ms"
        );
        if left <= 0 {
            break;
        }
        assert!(stepped.elapsed() < ms(10_000), "the lease never expired");
        std::thread::sleep(ms(2));
    }
    let (after, left) = flagged.expect("flagged lost");
    assert!(
        left > 0,
        "flagged {after:?} after the step, {left} ms before the server's expiry"
    );
    // Cut, the kept-alive lease was renewed early, on the server's new clock.
    assert!(!kept.is_lost(), "the kept-alive lease was renewed in time");
    assert!(pttl(&mut conn, kept.key()) > 0);
    let jumps = jumps.0.lock().unwrap();
    let (at, gain, leases) = *jumps.first().expect("the observer was told");
    assert!(gain >= Duration::from_secs(STEP_SECS) - ms(50), "{gain:?}");
    assert!(leases >= 1, "{leases}");
    assert!(at >= stepped, "reported before the step");
    // Found by the next renewal of the short lease (every half second).
    assert!(
        at - stepped < ms(1_000),
        "found {:?} after the step",
        at - stepped
    );
    let _ = std::fs::remove_dir_all(&dir);
}
