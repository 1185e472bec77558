//! What a user's own tests can do with the in-process fake deployment
//! (`--features test-util`): no server to install, no real TTL to wait out.
//!
//! 1. The fake's clock jumps forward (a server clock stepped by NTP, a VM
//!    resumed): a kept-alive lease's next renewal reads the server's `TIME`,
//!    and every lease on that server is flagged lost before the fake lets
//!    its key go.
//! 2. A grant's reply never comes: the acquire reports a timeout, and what
//!    the grant may have set is deleted in the background, long before its
//!    TTL.
//!
//! Each step prints the wall time it took.

use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;
use respire_coordination::fake::FakeDeployment;
use respire_coordination::{Coordinator, Error};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fake = FakeDeployment::start()?;
    let coord = Coordinator::builder(fake.url())
        .node_timeout(Duration::from_millis(100))
        .build()?;
    let mut raw = redis::Client::open(fake.url())?.get_connection()?;

    let started = Instant::now();
    // The report's lease, held for 1.3 s without renewals, and a short
    // heartbeat lease kept alive: each renewal reads the server's TIME.
    let report = coord.lock("nightly-report")?;
    let guard = report
        .try_acquire(Duration::from_millis(1_300))?
        .expect("a free lock");
    let heartbeat = coord.lock("heartbeat")?;
    let beat = heartbeat
        .try_acquire(Duration::from_millis(450))?
        .expect("a free lock");
    let renewal = beat.keep_alive()?;
    // Once the heartbeat has renewed, the server's TIME is known.
    let deadline = Instant::now() + Duration::from_secs(2);
    while coord.renewal_stats().renewals == 0 {
        assert!(Instant::now() < deadline, "the heartbeat never renewed");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The server's clock runs 600 ms ahead (NTP, a VM resumed): the report's
    // key has 600 ms less on it than the guard counted on.
    fake.advance_clock(Duration::from_millis(600));
    let flagged = matches!(
        guard.lost_signal().recv_timeout(Duration::from_secs(2)),
        Err(RecvTimeoutError::Disconnected)
    );
    let pttl: i64 = redis::cmd("PTTL").arg(guard.key()).query(&mut raw)?;
    println!(
        "  the server's clock jumped 600 ms: the report's guard flagged lost = {flagged} while \
         the fake still held its key for {pttl} ms ({:?} of wall time)",
        started.elapsed()
    );
    assert!(flagged && pttl > 0, "flagged before the fake let it go");
    drop(renewal);

    let started = Instant::now();
    let other = coord.lock("cron-cleanup")?;
    fake.drop_replies(1);
    match other.try_acquire(Duration::from_secs(30)) {
        Err(e @ Error::Timeout { .. }) => println!("  the grant's reply never came: {e}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    let key = "cron-cleanup";
    let deadline = Instant::now() + Duration::from_secs(5);
    while redis::cmd("EXISTS").arg(key).query::<i64>(&mut raw)? == 1 {
        assert!(
            Instant::now() < deadline,
            "the unanswered grant was never cleaned up"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    println!(
        "  no lease is left of the grant it may have made (TTL 30 s): the fake has no key \
         {key:?} {:?} after the attempt began",
        started.elapsed()
    );
    Ok(())
}
