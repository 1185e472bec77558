//! Keep-alive flags loss before the lease can expire, for every kind of fault:
//! the key deleted, the key overwritten, the server stopped, the network
//! blackholed, replies delayed past the node timeout. 20 trials each
//! (`RESPIRE_LOSS_TRIALS=n` for more).
//!
//! The oracle is the server's: the lease's `PEXPIRETIME` read at the fault
//! together with the server's `TIME`, converted to the local monotonic clock.
//! Nothing the library estimates enters the verdict.

mod support;

use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{Coordinator, FencedGuard};
use support::{FaultProxy, Mode, TestServer, wait_until};

/// Trials per fault: `RESPIRE_LOSS_TRIALS`, 20 by default.
fn trials() -> usize {
    std::env::var("RESPIRE_LOSS_TRIALS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(20)
}
const TTL: Duration = Duration::from_millis(800);
const NODE_TIMEOUT: Duration = Duration::from_millis(100);

#[derive(Clone, Copy, Debug)]
enum Fault {
    DeleteKey,
    OverwriteKey,
    StopServer,
    Blackhole,
    DelayReplies,
}

struct Rig {
    server: TestServer,
    proxy: FaultProxy,
}

impl Rig {
    fn new() -> Rig {
        let server = TestServer::start();
        let proxy = FaultProxy::start(server.addr());
        Rig { server, proxy }
    }

    /// Injects `fault` and returns when the lease could end on the server at
    /// the latest as things stood at the fault, on the local clock; `None`
    /// when the key was already gone (the server is then not stopped). Read
    /// on a connection straight to the server, never through the proxy.
    fn inject(&self, fault: Fault, key: &str) -> Option<Instant> {
        let mut admin = self.server.client();
        match fault {
            // The read and the fault in one transaction: nothing comes between.
            Fault::DeleteKey => {
                expiry_at_fault(&mut admin, key, Some(redis::cmd("DEL").arg(key).clone()))
            }
            Fault::OverwriteKey => expiry_at_fault(
                &mut admin,
                key,
                Some(
                    redis::cmd("SET")
                        .arg(key)
                        .arg("someone-else")
                        .arg("PX")
                        .arg(10_000)
                        .clone(),
                ),
            ),
            // Read just before the stop: a renewal confirmed in between
            // would move the real expiry past this one, which can only make
            // the check fail, never pass.
            Fault::StopServer => {
                let expiry = expiry_at_fault(&mut admin, key, None)?;
                self.server.pause();
                Some(expiry)
            }
            // Read just after the cut: a renewal the server applies later is
            // one whose reply the client never gets, so it cannot count.
            Fault::Blackhole => {
                self.proxy.set_mode(Mode::Blackhole);
                expiry_at_fault(&mut admin, key, None)
            }
            Fault::DelayReplies => {
                self.proxy.set_mode(Mode::Delay(NODE_TIMEOUT * 2));
                expiry_at_fault(&mut admin, key, None)
            }
        }
    }

    fn heal(&self, fault: Fault) {
        match fault {
            Fault::StopServer => self.server.resume(),
            Fault::Blackhole | Fault::DelayReplies => {
                self.proxy.set_mode(Mode::Pass);
                self.proxy.reset_all();
            }
            Fault::DeleteKey | Fault::OverwriteKey => {}
        }
    }
}

/// Waits until keep-alive confirms a renewal, so that none is in flight when the
/// fault is injected and the last confirmed send time is known to the guard.
fn wait_for_a_renewal(guard: &FencedGuard) {
    // The local validity end moves forward by about half a TTL on each renewal.
    let valid_until = || Instant::now() + guard.remaining_estimate();
    let first = valid_until();
    wait_until(Duration::from_secs(5), "a confirmed renewal", || {
        valid_until() > first + TTL / 4
    });
}

/// The lease's expiry on the server (`PEXPIRETIME`) as a local instant,
/// converted with the server's `TIME` read in the same transaction, in which
/// `fault` (if any) runs right after the reads; `None` when the key is gone.
fn expiry_at_fault(
    c: &mut redis::Connection,
    key: &str,
    fault: Option<redis::Cmd>,
) -> Option<Instant> {
    let mut pipe = redis::pipe();
    pipe.atomic();
    pipe.cmd("PEXPIRETIME").arg(key).cmd("TIME");
    if let Some(cmd) = fault {
        pipe.add_command(cmd).ignore();
    }
    let before = Instant::now();
    let (at_ms, (secs, micros)): (i64, (i64, i64)) = pipe.query(c).unwrap();
    let after = Instant::now();
    if at_ms == -2 {
        return None;
    }
    assert!(at_ms > 0, "{key:?} has no expiry at the fault ({at_ms})");
    // Microseconds, so that the server's clock is not rounded down a whole
    // millisecond; the reply's local instant is the middle of the round trip.
    let now_us = secs * 1_000_000 + micros;
    let read_at = before + (after - before) / 2;
    let left_us = at_ms * 1_000 - now_us;
    Some(if left_us >= 0 {
        read_at + Duration::from_micros(left_us as u64)
    } else {
        read_at - Duration::from_micros(left_us.unsigned_abs())
    })
}

/// The check: loss must be observed strictly before the server's expiry.
/// `Ok` holds the margin; `Err` says how late it was.
fn flagged_before(flagged: Instant, expiry: Instant) -> Result<Duration, String> {
    if flagged < expiry {
        Ok(expiry - flagged)
    } else {
        Err(format!(
            "loss flagged {:?} after the lease's expiry on the server",
            flagged - expiry
        ))
    }
}

fn run(fault: Fault) {
    let rig = Rig::new();
    let trials = trials();
    let mut margins = Vec::with_capacity(trials);
    let mut expired_first = 0;
    for trial in 0..trials {
        // A fresh coordinator per trial, so no connection spoiled by the last
        // fault is reused.
        let coord = Coordinator::builder(&rig.proxy.url())
            .node_timeout(NODE_TIMEOUT)
            .connect_timeout(Duration::from_millis(500))
            .build()
            .unwrap();
        let lock = coord
            .fenced_lock(
                &format!("{{t{trial}}}:lease"),
                &format!("{{t{trial}}}:fence"),
            )
            .unwrap();
        let guard = lock.try_acquire(TTL).unwrap().expect("free key");
        let renewal = guard.keep_alive().unwrap();
        wait_for_a_renewal(&guard);

        let Some(expiry) = rig.inject(fault, guard.key()) else {
            // The lease ended before the fault (renewals that timed out on a
            // loaded machine): by the server's word it is gone, so the guard
            // must say so already. The fault was not injected.
            assert!(
                guard.is_lost(),
                "{fault:?} trial {trial}: expired, not lost"
            );
            if !matches!(fault, Fault::StopServer) {
                rig.heal(fault);
            }
            expired_first += 1;
            continue;
        };
        let signal = guard
            .lost_signal()
            .recv_deadline(expiry + Duration::from_secs(2));
        let flagged = Instant::now();
        assert!(
            signal.unwrap_err().is_disconnected(),
            "{fault:?} trial {trial}: the loss signal never fired"
        );
        assert!(guard.is_lost(), "{fault:?} trial {trial}");
        match flagged_before(flagged, expiry) {
            Ok(margin) => margins.push(margin),
            Err(late) => panic!("{fault:?} trial {trial}: {late}"),
        }
        drop(renewal);
        rig.heal(fault);
        drop(guard);
    }
    assert!(
        expired_first * 2 < trials,
        "{fault:?}: {expired_first} of {trials} leases ended before the fault"
    );
    margins.sort();
    println!(
        "{fault:?}: {} trials, loss flagged before expiry in all ({expired_first} more ended before \
         the fault); margin min {:?}, median {:?}",
        margins.len(),
        margins[0],
        margins[margins.len() / 2]
    );
}

#[test]
fn loss_is_flagged_before_expiry_when_the_key_is_deleted() {
    run(Fault::DeleteKey);
}

#[test]
fn loss_is_flagged_before_expiry_when_the_key_is_overwritten() {
    run(Fault::OverwriteKey);
}

#[test]
fn loss_is_flagged_before_expiry_when_the_server_is_stopped() {
    run(Fault::StopServer);
}

#[test]
fn loss_is_flagged_before_expiry_when_the_network_blackholes() {
    run(Fault::Blackhole);
}

#[test]
fn loss_is_flagged_before_expiry_when_replies_are_delayed() {
    run(Fault::DelayReplies);
}

/// The negative control of the check above: a loss seen only once the key is
/// gone from the server, and instants at and just after the server's expiry,
/// are all reported as late.
#[test]
fn the_check_reports_a_loss_flagged_at_or_after_the_servers_expiry() {
    let rig = Rig::new();
    let coord = Coordinator::builder(&rig.server.url())
        .node_timeout(NODE_TIMEOUT)
        .build()
        .unwrap();
    let lock = coord.fenced_lock("{late}:lease", "{late}:fence").unwrap();
    let guard = lock.try_acquire(TTL).unwrap().expect("free key");
    let mut admin = rig.server.client();
    let expiry = expiry_at_fault(&mut admin, guard.key(), None).expect("just granted");
    assert!(flagged_before(expiry - Duration::from_millis(1), expiry).is_ok());
    assert!(flagged_before(expiry, expiry).is_err());
    assert!(flagged_before(expiry + Duration::from_millis(1), expiry).is_err());
    // A watcher that learns of the loss only from the server, when the key is
    // gone: always too late.
    let key = guard.key().to_owned();
    let mut gone = None;
    wait_until(TTL * 2, "the lease to expire on the server", || {
        let exists: bool = admin.exists(&key).unwrap();
        if !exists {
            gone = Some(Instant::now());
        }
        !exists
    });
    let late = flagged_before(gone.unwrap(), expiry).unwrap_err();
    assert!(late.contains("after the lease's expiry"), "{late}");
}

#[test]
fn an_unanswered_renewal_kills_its_connection() {
    let rig = Rig::new();
    let coord = Coordinator::builder(&rig.server.url())
        .node_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let lock = coord.fenced_lock("{k}:lease", "{k}:fence").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(1)).unwrap().unwrap();
    let renewal = guard.keep_alive().unwrap();
    wait_for_a_renewal(&guard);
    // CLIENT PAUSE WRITE holds the renewal script (it writes) but lets the
    // CLIENT KILL from the second connection through.
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(2_000)
        .arg("WRITE")
        .query(&mut rig.server.client())
        .unwrap();
    wait_until(
        Duration::from_secs(3),
        "the renewal connection to be killed",
        || coord.renewal_stats().killed_connections > 0,
    );
    assert!(
        guard
            .lost_signal()
            .recv_timeout(Duration::from_secs(3))
            .is_err()
    );
    assert!(guard.is_lost());
    let _: () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query(&mut rig.server.client())
        .unwrap();
    drop(renewal);
    // The renewal queued on the killed connection was never applied: the
    // lease runs out at the expiry of the last confirmed renewal.
    let key = guard.key().to_owned();
    drop(guard);
    let mut admin = rig.server.client();
    wait_until(Duration::from_secs(3), "the lease to be gone", || {
        !admin.exists::<_, bool>(&key).unwrap()
    });
}
