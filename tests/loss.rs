//! Keep-alive flags loss before the lease can expire, for every kind of fault:
//! the key deleted, the key overwritten, the server stopped, the network
//! blackholed, replies delayed past the node timeout. 30 trials each.

mod support;

use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{Coordinator, FencedGuard};
use support::{FaultProxy, Mode, TestServer, wait_until};

const TRIALS: usize = 30;
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

    fn inject(&self, fault: Fault, key: &str) {
        match fault {
            Fault::DeleteKey => {
                let _: () = self.server.client().del(key).unwrap();
            }
            Fault::OverwriteKey => {
                let _: () = self
                    .server
                    .client()
                    .pset_ex(key, "someone-else", 10_000)
                    .unwrap();
            }
            Fault::StopServer => self.server.pause(),
            Fault::Blackhole => self.proxy.set_mode(Mode::Blackhole),
            Fault::DelayReplies => self.proxy.set_mode(Mode::Delay(NODE_TIMEOUT * 2)),
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

fn run(fault: Fault) {
    let rig = Rig::new();
    let mut margins = Vec::with_capacity(TRIALS);
    for trial in 0..TRIALS {
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

        rig.inject(fault, guard.key());
        // The local validity: last confirmed renewal's send time + TTL − drift.
        // The server's expiry is later still (it counts from when it received it).
        let expiry = Instant::now() + guard.remaining_estimate();
        let signal = guard
            .lost_signal()
            .recv_deadline(expiry + Duration::from_secs(2));
        let flagged = Instant::now();
        assert!(
            signal.unwrap_err().is_disconnected(),
            "{fault:?} trial {trial}: the loss signal never fired"
        );
        assert!(guard.is_lost(), "{fault:?} trial {trial}");
        assert!(
            flagged < expiry,
            "{fault:?} trial {trial}: loss flagged {:?} after the lease's expiry",
            flagged - expiry
        );
        margins.push(expiry - flagged);
        drop(renewal);
        rig.heal(fault);
        drop(guard);
    }
    margins.sort();
    println!(
        "{fault:?}: {TRIALS} trials, loss flagged before expiry in all; margin min {:?}, median {:?}",
        margins[0],
        margins[TRIALS / 2]
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
