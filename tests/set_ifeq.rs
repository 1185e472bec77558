//! The extension of a lease held as a string value (a lock's, a fenced
//! lock's) goes without a script on a server with `SET … IFEQ … GET` (Valkey
//! 8.1) and as the extension script elsewhere (Redis 7.0). Both kinds of
//! server run here side by side, whatever `RESPIRE_TEST_SERVER` says, and
//! every check is made on both: the server says which commands ran (`INFO
//! commandstats`) and what they did (`PTTL`, the key's value and type), and
//! each refusal causes the loss the script's reply would have caused.

mod support;
use support::ms;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use respire_coordination::{Coordinator, Error, LossCause, LossEvent, Observer, Replication};
use support::{FaultProxy, Mode, ServerKind, TestServer, unique_prefix, wait_until};

const NODE_TIMEOUT: Duration = Duration::from_millis(100);
const KINDS: [ServerKind; 2] = [ServerKind::Redis, ServerKind::Valkey];

fn start(kind: ServerKind) -> TestServer {
    TestServer::builder().kind(kind).start()
}

/// The losses the library reported: key and cause.
#[derive(Default)]
struct Losses(Mutex<Vec<(String, LossCause)>>);

impl Observer for Losses {
    fn lost(&self, event: &LossEvent<'_>) {
        self.0
            .lock()
            .unwrap()
            .push((event.key.to_owned(), event.cause));
    }
}

impl Losses {
    fn of(&self, key: &str) -> Vec<LossCause> {
        let seen = self.0.lock().unwrap();
        seen.iter()
            .filter(|(k, _)| k == key)
            .map(|(_, c)| *c)
            .collect()
    }
}

fn coordinator(server: &TestServer, losses: Arc<Losses>) -> Coordinator {
    Coordinator::builder(&server.url())
        .key_prefix(&unique_prefix("ifeq"))
        .node_timeout(NODE_TIMEOUT)
        .observer(losses)
        .build()
        .expect("connect")
}

/// How many times the server ran `SET`, and a script (`EVALSHA` and
/// `EVAL`), without error (an `EVALSHA` answered `NOSCRIPT` goes again as
/// `EVAL`; a `SET` refused for want of memory counts as rejected).
fn calls(server: &TestServer) -> (u64, u64) {
    let ran = |command: &str| {
        server_stat(server, command, "calls") - server_stat(server, command, "failed_calls")
    };
    (ran("set"), ran("evalsha") + ran("eval"))
}

fn pttl(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).expect("PTTL")
}

#[test]
fn a_user_extension_takes_the_path_the_server_has() {
    for kind in KINDS {
        let server = start(kind);
        let coord = coordinator(&server, Arc::default());
        let mut outside = server.client();
        let lock = coord.lock("job").unwrap();
        let plain = lock.try_acquire(ms(2_000)).unwrap().expect("free");
        let fenced_lock = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
        let fenced = fenced_lock.try_acquire(ms(2_000)).unwrap().expect("free");
        let (sets, scripts) = calls(&server);
        assert!(plain.reset_expiry(ms(60_000)).unwrap(), "{kind:?}");
        assert!(fenced.reset_expiry(ms(50_000)).unwrap(), "{kind:?}");
        let left = pttl(&mut outside, plain.key());
        assert!((59_000..=60_000).contains(&left), "{kind:?}: PTTL {left}");
        let left = pttl(&mut outside, fenced.key());
        assert!((49_000..=50_000).contains(&left), "{kind:?}: PTTL {left}");
        let (sets_after, scripts_after) = calls(&server);
        let by = (sets_after - sets, scripts_after - scripts);
        match kind {
            ServerKind::Redis => assert_eq!(by, (0, 2), "Redis 7.0: the script"),
            ServerKind::Valkey => assert_eq!(by, (2, 0), "Valkey 8.1: SET IFEQ"),
        }
        assert!(!plain.is_lost() && !fenced.is_lost(), "{kind:?}");
    }
}

#[test]
fn keep_alive_renews_by_the_path_the_server_has() {
    let ttl = ms(600);
    for kind in KINDS {
        let server = start(kind);
        let coord = coordinator(&server, Arc::default());
        let mut outside = server.client();
        let lock = coord.lock("job").unwrap();
        let guard = lock.try_acquire(ttl).unwrap().expect("free");
        let (sets, scripts) = calls(&server);
        let renewals = coord.renewal_stats().renewals;
        let keep = guard.keep_alive().unwrap();
        wait_until(ms(10_000), "three renewals", || {
            coord.renewal_stats().renewals >= renewals + 3
        });
        drop(keep);
        let renewed = coord.renewal_stats().renewals - renewals;
        let left = pttl(&mut outside, guard.key());
        assert!(left > 0, "{kind:?}: the key is held (PTTL {left})");
        assert!(!guard.is_lost(), "{kind:?}");
        let (sets_after, scripts_after) = calls(&server);
        let (by_set, by_script) = (sets_after - sets, scripts_after - scripts);
        match kind {
            // The keep-alive's rights check runs the script once either way.
            ServerKind::Redis => {
                assert_eq!(by_set, 0, "Redis 7.0");
                assert!(by_script > renewed, "Redis 7.0: {by_script} scripts");
            }
            ServerKind::Valkey => {
                assert!(
                    by_set >= renewed,
                    "Valkey 8.1: {by_set} SETs, {renewed} renewals"
                );
                assert_eq!(by_script, 1, "Valkey 8.1: the rights check alone");
            }
        }
    }
}

/// A lease's key deleted, given another value, or given another type: the
/// extension refuses each and the lease is lost with the cause the script's
/// reply names (gone; someone else's; someone else's), changing nothing.
fn outsiders_change(outside: &mut redis::Connection, keys: &[&str; 3]) {
    let _: () = redis::cmd("DEL").arg(keys[0]).query(outside).unwrap();
    let _: () = redis::cmd("SET")
        .arg(keys[1])
        .arg("someone-else")
        .query(outside)
        .unwrap();
    let _: () = redis::cmd("DEL").arg(keys[2]).query(outside).unwrap();
    let _: () = redis::cmd("LPUSH")
        .arg(keys[2])
        .arg("x")
        .query(outside)
        .unwrap();
}

fn unchanged(outside: &mut redis::Connection, keys: &[&str; 3], kind: ServerKind) {
    let exists: i64 = redis::cmd("EXISTS").arg(keys[0]).query(outside).unwrap();
    assert_eq!(exists, 0, "{kind:?}: a gone key is not re-created");
    let value: String = redis::cmd("GET").arg(keys[1]).query(outside).unwrap();
    assert_eq!(value, "someone-else", "{kind:?}");
    assert_eq!(pttl(outside, keys[1]), -1, "{kind:?}: no expiry set");
    let kind_of: String = redis::cmd("TYPE").arg(keys[2]).query(outside).unwrap();
    assert_eq!(kind_of, "list", "{kind:?}");
    assert_eq!(pttl(outside, keys[2]), -1, "{kind:?}: no expiry set");
}

const CAUSES: [LossCause; 3] = [LossCause::Gone, LossCause::TakenOver, LossCause::TakenOver];

#[test]
fn each_refusal_of_a_user_extension_is_the_loss_the_script_names() {
    for kind in KINDS {
        let server = start(kind);
        let losses = Arc::new(Losses::default());
        let coord = coordinator(&server, losses.clone());
        let mut outside = server.client();
        let locks: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|name| coord.lock(name).unwrap())
            .collect();
        let guards: Vec<_> = locks
            .iter()
            .map(|l| l.try_acquire(ms(30_000)).unwrap().expect("free"))
            .collect();
        let keys = [guards[0].key(), guards[1].key(), guards[2].key()];
        outsiders_change(&mut outside, &keys);
        for (guard, cause) in guards.iter().zip(CAUSES) {
            assert!(!guard.reset_expiry(ms(60_000)).unwrap(), "{kind:?}");
            assert!(guard.is_lost(), "{kind:?}");
            assert_eq!(losses.of(guard.key()), [cause], "{kind:?} {}", guard.key());
        }
        unchanged(&mut outside, &keys, kind);
    }
}

#[test]
fn each_refusal_of_a_renewal_is_the_loss_the_script_names() {
    let ttl = ms(600);
    for kind in KINDS {
        let server = start(kind);
        let losses = Arc::new(Losses::default());
        let coord = coordinator(&server, losses.clone());
        let mut outside = server.client();
        let locks: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|name| coord.lock(name).unwrap())
            .collect();
        let guards: Vec<_> = locks
            .iter()
            .map(|l| l.try_acquire(ttl).unwrap().expect("free"))
            .collect();
        let keys = [guards[0].key(), guards[1].key(), guards[2].key()];
        let keeps: Vec<_> = guards.iter().map(|g| g.keep_alive().unwrap()).collect();
        let renewals = coord.renewal_stats().renewals;
        wait_until(ms(10_000), "a renewal of each", || {
            coord.renewal_stats().renewals >= renewals + 3
        });
        outsiders_change(&mut outside, &keys);
        wait_until(ms(10_000), "all three lost", || {
            guards.iter().all(|g| g.is_lost())
        });
        for (guard, cause) in guards.iter().zip(CAUSES) {
            assert_eq!(losses.of(guard.key()), [cause], "{kind:?} {}", guard.key());
        }
        drop(keeps);
        unchanged(&mut outside, &keys, kind);
    }
}

/// `maxmemory` reached under `noeviction`: `SET` is refused with `OOM`, the
/// script's `PEXPIRE` is not, so the extension still happens, as the script.
#[test]
fn refused_for_want_of_memory_the_extension_goes_as_the_script() {
    let ttl = ms(600);
    for kind in KINDS {
        let server = start(kind);
        let coord = coordinator(&server, Arc::default());
        let mut outside = server.client();
        let lock = coord.lock("job").unwrap();
        let guard = lock.try_acquire(ttl).unwrap().expect("free");
        let kept = coord.lock("kept").unwrap();
        let kept = kept.try_acquire(ttl).unwrap().expect("free");
        for (name, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1")] {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .query(&mut outside)
                .unwrap();
        }
        let refused = redis::cmd("SET")
            .arg("respire-test-oom")
            .arg(1)
            .query::<()>(&mut outside)
            .unwrap_err();
        assert_eq!(refused.code(), Some("OOM"), "{kind:?}: {refused}");
        let (_, scripts) = calls(&server);
        assert!(guard.reset_expiry(ms(60_000)).unwrap(), "{kind:?}");
        let left = pttl(&mut outside, guard.key());
        assert!((59_000..=60_000).contains(&left), "{kind:?}: PTTL {left}");
        let (_, scripts_after) = calls(&server);
        assert_eq!(scripts_after - scripts, 1, "{kind:?}: the script ran");
        let renewals = coord.renewal_stats().renewals;
        let keep = kept.keep_alive().unwrap();
        wait_until(ms(10_000), "three renewals under OOM", || {
            coord.renewal_stats().renewals >= renewals + 3
        });
        drop(keep);
        assert!(!kept.is_lost(), "{kind:?}");
        let left = pttl(&mut outside, kept.key());
        assert!(left > 0, "{kind:?}: PTTL {left}");
        if kind == ServerKind::Valkey {
            let set = server_stat(&server, "set", "rejected_calls");
            assert!(set >= 4, "{kind:?}: {set} SETs refused for want of memory");
        }
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg("0")
            .query(&mut outside)
            .unwrap();
    }
}

/// A field of `cmdstat_command` in `INFO commandstats` (0 when absent).
fn server_stat(server: &TestServer, command: &str, field: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut server.client())
        .unwrap();
    let prefix = format!("cmdstat_{command}:");
    let field = format!("{field}=");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').find_map(|f| f.strip_prefix(field.as_str())))
        .map_or(0, |n| n.trim().parse().unwrap())
}

/// How long `Replication::Require` waits for the replica's acknowledgement
/// in the test below: long enough for a loaded machine.
const REPLICA_WAIT: Duration = Duration::from_secs(2);

/// Under `Replication::Require`, `WAIT` follows the `SET` as it follows the
/// script: the extension counts once the replica has it (its `PTTL` says
/// so), and not while the replication link is cut.
#[test]
fn under_require_the_set_counts_once_a_replica_has_it() {
    for kind in KINDS {
        let primary = start(kind);
        let link = FaultProxy::start(primary.addr());
        let replica = TestServer::builder()
            .kind(kind)
            .args(["--replicaof", "127.0.0.1", &link.port().to_string()])
            .start();
        let mut on_primary = primary.client();
        wait_until(ms(10_000), "the replica to acknowledge a write", || {
            let _: () = redis::cmd("SET")
                .arg("respire-test-ack")
                .arg(1)
                .query(&mut on_primary)
                .unwrap();
            let acked: i64 = redis::cmd("WAIT")
                .arg(1)
                .arg(500)
                .query(&mut on_primary)
                .unwrap();
            acked == 1
        });
        let coord = Coordinator::builder(&primary.url())
            .key_prefix(&unique_prefix("ifeq"))
            .node_timeout(NODE_TIMEOUT)
            .replication(Replication::Require {
                replicas: 1,
                timeout: REPLICA_WAIT,
            })
            .build()
            .expect("connect");
        let lock = coord.lock("job").unwrap();
        let guard = lock.try_acquire(ms(5_000)).unwrap().expect("free");
        let (sets, scripts) = calls(&primary);
        assert!(guard.reset_expiry(ms(60_000)).unwrap(), "{kind:?}");
        let left = pttl(&mut replica.client(), guard.key());
        assert!(
            (59_000..=60_000).contains(&left),
            "{kind:?}: replica PTTL {left}"
        );
        link.set_mode(Mode::Blackhole);
        match guard.reset_expiry(ms(50_000)) {
            Err(Error::ExtensionNotReplicated {
                acknowledged,
                required,
                ..
            }) => assert_eq!((acknowledged, required), (0, 1), "{kind:?}"),
            other => panic!("{kind:?}: {other:?}"),
        }
        // Set on the primary before the `WAIT` that timed out.
        let left = pttl(&mut on_primary, guard.key());
        let floor = 50_000 - REPLICA_WAIT.as_millis() as i64 - 1_000;
        assert!(
            (floor..=50_000).contains(&left),
            "{kind:?}: primary PTTL {left}"
        );
        let (sets_after, scripts_after) = calls(&primary);
        let by = (sets_after - sets, scripts_after - scripts);
        match kind {
            ServerKind::Redis => assert_eq!(by, (0, 2), "Redis 7.0: the script"),
            ServerKind::Valkey => assert_eq!(by, (2, 0), "Valkey 8.1: SET IFEQ"),
        }
        link.set_mode(Mode::Pass);
    }
}
