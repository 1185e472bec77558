//! The plain `Lock` and the connection layer against real redis-server processes.

mod support;
use support::coordinator;

use std::sync::Barrier;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{Coordinator, Error, MAX_TTL, ReleaseOutcome};
use support::{FaultProxy, Mode, TestServer, shared_server, unique_prefix, wait_until};

/// Every key under `prefix` on `server`.
fn keys_under(server: &TestServer, prefix: &str) -> Vec<String> {
    server.client().keys(format!("{prefix}*")).expect("KEYS")
}

#[test]
fn eight_threads_never_hold_the_lock_together() {
    let prefix = unique_prefix("mutex");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(300));
    let lock = coord.lock("job").unwrap();
    let inside = AtomicUsize::new(0);
    let granted = AtomicUsize::new(0);
    let barrier = Barrier::new(8);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                barrier.wait();
                for _ in 0..500 {
                    if let Some(guard) = lock.try_acquire(Duration::from_secs(10)).unwrap() {
                        assert_eq!(
                            inside.fetch_add(1, Ordering::SeqCst),
                            0,
                            "two holders at once"
                        );
                        granted.fetch_add(1, Ordering::Relaxed);
                        std::thread::yield_now();
                        inside.fetch_sub(1, Ordering::SeqCst);
                        assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
                    }
                }
            });
        }
    });
    let granted = granted.load(Ordering::Relaxed);
    assert!(granted > 0, "nobody ever got the lock");
    assert!(
        granted < 4000,
        "contention never happened: {granted} grants"
    );
    assert!(keys_under(shared_server(), &prefix).is_empty());
}

#[test]
fn contention_is_none_not_an_error() {
    let coord = coordinator(
        &shared_server().url(),
        &unique_prefix("contention"),
        Duration::from_millis(300),
    );
    let lock = coord.lock("job").unwrap();
    let held = lock.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    assert!(lock.try_acquire(Duration::from_secs(10)).unwrap().is_none());
    assert!(
        lock.acquire_timeout(Duration::from_secs(10), Duration::ZERO)
            .unwrap()
            .is_none()
    );
    drop(held);
    assert!(lock.try_acquire(Duration::from_secs(10)).unwrap().is_some());
}

#[test]
fn release_after_expiry_and_takeover_never_touches_the_new_holder() {
    let prefix = unique_prefix("takeover");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(300));
    let key = format!("{prefix}job");
    let lock = coord.lock("job").unwrap();
    let mut admin = shared_server().client();

    // Expired: the key is gone when the first holder releases.
    let first = lock.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    let _: () = admin.pexpire(&key, 1).unwrap();
    wait_until(Duration::from_secs(5), "the lock to expire", || {
        !admin.exists::<_, bool>(&key).unwrap()
    });
    assert_eq!(first.release().unwrap(), ReleaseOutcome::Expired);

    // Taken over: someone else holds it when the first holder releases.
    let first = lock.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    let _: () = admin.pexpire(&key, 1).unwrap();
    wait_until(Duration::from_secs(5), "the lock to expire", || {
        !admin.exists::<_, bool>(&key).unwrap()
    });
    let second = lock.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    assert!(first.verify_still_held().unwrap().is_none());
    assert!(first.is_lost());
    assert!(!first.reset_expiry(Duration::from_secs(10)).unwrap());
    let before: String = admin.get(&key).unwrap();
    assert_eq!(first.release().unwrap(), ReleaseOutcome::TakenOver);
    let after: String = admin.get(&key).unwrap();
    assert_eq!(before, after, "the release changed the new holder's key");
    let remaining = second
        .verify_still_held()
        .unwrap()
        .expect("second holder kept it");
    assert!(remaining > Duration::from_secs(5));
    assert_eq!(second.release().unwrap(), ReleaseOutcome::Released);
}

#[test]
fn verify_reset_and_remaining_estimate() {
    let prefix = unique_prefix("verify");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(300));
    let lock = coord.lock("job").unwrap();
    let before = Instant::now();
    let guard = lock.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    let estimate = guard.remaining_estimate();
    assert!(estimate <= Duration::from_secs(10) - before.elapsed().min(Duration::from_secs(10)));
    assert!(estimate > Duration::from_secs(9));
    let server_ttl = guard.verify_still_held().unwrap().unwrap();
    assert!(server_ttl <= Duration::from_secs(10) && server_ttl > Duration::from_secs(9));

    assert!(guard.reset_expiry(Duration::from_secs(60)).unwrap());
    let server_ttl = guard.verify_still_held().unwrap().unwrap();
    assert!(server_ttl > Duration::from_secs(59));
    assert!(guard.remaining_estimate() > Duration::from_secs(58));
    assert!(!guard.is_lost());

    // reset_expiry never re-creates a missing key.
    let key = format!("{prefix}job");
    let _: () = shared_server().client().del(&key).unwrap();
    assert!(!guard.reset_expiry(Duration::from_secs(60)).unwrap());
    assert!(!shared_server().client().exists::<_, bool>(&key).unwrap());
    assert!(guard.is_lost());
    assert_eq!(guard.remaining_estimate(), Duration::ZERO);
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Expired);
}

#[test]
fn dropping_a_guard_releases_and_fires_its_signal() {
    let prefix = unique_prefix("drop");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(300));
    let lock = coord.lock("job").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    let signal = guard.lost_signal().clone();
    assert!(signal.try_recv().unwrap_err().is_empty());
    drop(guard);
    assert!(signal.try_recv().unwrap_err().is_disconnected());
    assert!(keys_under(shared_server(), &prefix).is_empty());
}

#[test]
fn a_lock_found_free_is_taken_with_one_command_and_a_held_one_reported_busy() {
    // A server of its own: only this test's commands are counted.
    let server = TestServer::builder().start();
    let coord = Coordinator::builder(&server.url())
        .key_prefix("one:")
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    let ttl = Duration::from_secs(5);
    // The first call opens the pooled connection; count from the second.
    lock.try_acquire(ttl).unwrap().unwrap().release().unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut server.client())
        .unwrap();
    // Counted before the releases, whose script reads the key too.
    let cancel = respire_coordination::CancelToken::new();
    let mut guards = Vec::new();
    for name in ["a", "b", "c"] {
        let lock = coord.lock(name).unwrap();
        guards.push(lock.try_acquire(ttl).unwrap().unwrap());
    }
    for name in ["d", "e", "f"] {
        // The waiting verb, finding the lock free, makes the same attempt.
        guards.push(coord.lock(name).unwrap().acquire(ttl, &cancel).unwrap());
    }
    assert_eq!(server.command_calls("set"), 6);
    assert_eq!(server.command_calls("get"), 0);
    assert_eq!(server.command_calls("pttl"), 0);
    for guard in guards {
        assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    }
    // Held by another owner: busy, and the holder's key is left alone.
    let _: () = server.client().set("one:job", "someone").unwrap();
    assert!(lock.try_acquire(ttl).unwrap().is_none());
    assert_eq!(
        lock.acquire_timeout(ttl, Duration::ZERO)
            .unwrap()
            .map(|g| g.key().to_owned()),
        None
    );
    let holder: String = server.client().get("one:job").unwrap();
    assert_eq!(holder, "someone");
    let left: i64 = server.client().pttl("one:job").unwrap();
    assert_eq!(left, -1, "the holder's key keeps having no expiry");
}

#[test]
fn bad_input_is_refused_and_touches_nothing() {
    let prefix = unique_prefix("badinput");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(300));
    assert!(matches!(coord.lock(""), Err(Error::InvalidArgument(_))));
    let lock = coord.lock("job").unwrap();
    for ttl in [
        Duration::ZERO,
        MAX_TTL + Duration::from_millis(1),
        Duration::MAX,
        // Not longer than the node timeout plus drift: lost as soon as granted.
        Duration::from_millis(300),
    ] {
        let err = lock.try_acquire(ttl).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{ttl:?}: {err}");
        let err = lock
            .acquire_timeout(ttl, Duration::from_secs(1))
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{ttl:?}: {err}");
    }
    let err = Coordinator::builder(&shared_server().url())
        .key_prefix("app{")
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("hash"), "{err}");
    let err = Coordinator::builder(&shared_server().url())
        .drift_factor(f64::NAN)
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(keys_under(shared_server(), &prefix).is_empty());

    // A key of another type is reported and left alone.
    let key = format!("{prefix}list");
    let _: () = shared_server().client().rpush(&key, "x").unwrap();
    let err = coord
        .lock("list")
        .unwrap()
        .try_acquire(Duration::from_secs(5))
        .unwrap_err();
    assert!(matches!(err, Error::BadKey { .. }), "{err}");
    assert!(err.to_string().contains("list"), "{err}");
    let items: Vec<String> = shared_server().client().lrange(&key, 0, -1).unwrap();
    assert_eq!(items, ["x"]);
}

#[test]
fn wrong_password_and_unknown_user_are_auth_errors() {
    let server = TestServer::builder().requirepass("s3cret").start();
    let url = format!("redis://127.0.0.1:{}", server.port());
    Coordinator::builder(&url)
        .password("s3cret")
        .build()
        .unwrap();

    let err = Coordinator::builder(&url)
        .password("wrong")
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::Auth { .. }), "{err}");
    assert!(
        !err.to_string().contains("wrong"),
        "the password leaked: {err}"
    );
    let err = Coordinator::connect(&format!(
        "redis://nobody:s3cret@127.0.0.1:{}",
        server.port()
    ))
    .unwrap_err();
    assert!(matches!(err, Error::Auth { .. }), "{err}");
    // No password at all against a server that wants one.
    let err = Coordinator::connect(&url)
        .and_then(|c| c.lock("k")?.try_acquire(Duration::from_secs(5)).map(|_| ()))
        .unwrap_err();
    assert!(matches!(err, Error::Auth { .. }), "{err}");
}

#[test]
fn debug_output_never_shows_the_password() {
    let server = TestServer::builder().requirepass("hunter2").start();
    let url = format!("redis://:hunter2@127.0.0.1:{}", server.port());
    let builder = Coordinator::builder(&url).password("hunter2");
    assert!(!format!("{builder:?}").contains("hunter2"));
    let coord = builder.build().unwrap();
    let text = format!("{coord:?}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains(&server.port().to_string()), "{text}");
}

#[test]
fn a_server_that_is_down_fails_fast_with_a_connect_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = Instant::now();
    let err = Coordinator::builder(&format!("redis://127.0.0.1:{port}"))
        .connect_timeout(Duration::from_millis(500))
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err}");
    assert!(err.is_retryable());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_paused_server_fails_within_the_node_timeout_and_the_connection_is_replaced() {
    let server = TestServer::start();
    let node_timeout = Duration::from_millis(200);
    let coord = Coordinator::builder(&server.url())
        .node_timeout(node_timeout)
        .pool_size(1)
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    let ids_before = respire_client_ids(&server);
    assert_eq!(ids_before.len(), 1, "one pooled connection: {ids_before:?}");

    server.pause();
    let started = Instant::now();
    let err = guard.verify_still_held().unwrap_err();
    let took = started.elapsed();
    assert!(err.is_timeout() && err.is_uncertain(), "{err}");
    assert!(took >= node_timeout && took < node_timeout * 4, "{took:?}");
    let started = Instant::now();
    let err = coord
        .lock("other")
        .unwrap()
        .try_acquire(Duration::from_secs(30))
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    server.resume();

    // The next command runs on a new connection and gets its own reply, not the
    // late reply to the command that timed out.
    assert!(guard.verify_still_held().unwrap().is_some());
    let other = coord
        .lock("fresh")
        .unwrap()
        .try_acquire(Duration::from_secs(30))
        .unwrap();
    assert!(other.is_some());
    wait_until(
        Duration::from_secs(5),
        "the timed-out connection to close",
        || {
            let ids = respire_client_ids(&server);
            !ids.iter().any(|id| ids_before.contains(id))
        },
    );
}

/// The ids of the connections the crate's pool opened (by library name).
fn respire_client_ids(server: &TestServer) -> Vec<u64> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut server.client())
        .unwrap();
    list.lines()
        .filter(|l| l.contains(" name=respire "))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|f| f.strip_prefix("id="))
                .and_then(|id| id.parse().ok())
        })
        .collect()
}

#[test]
fn a_least_privilege_acl_user_can_do_everything() {
    let server = TestServer::builder()
        .acl_user(
            "user locker on >pw resetkeys ~app:* resetchannels &__redis__:invalidate -@all \
             +ping +hello +auth +select +client|id +client|kill +client|tracking +client|caching \
             +client|setname +subscribe +script|load +eval +evalsha +type +get +set +pttl +pexpire +del +incr",
        )
        .start();
    let coord = Coordinator::builder(&server.url_for_user("locker", "pw"))
        .key_prefix("app:")
        .node_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(2)).unwrap().unwrap();
    let renewal = guard.keep_alive().unwrap();
    assert!(guard.verify_still_held().unwrap().is_some());
    assert!(guard.reset_expiry(Duration::from_secs(2)).unwrap());
    drop(renewal);
    // A waiter is woken by the release (tracking works for this user).
    std::thread::scope(|s| {
        let waiter =
            s.spawn(|| lock.acquire_timeout(Duration::from_secs(2), Duration::from_secs(10)));
        wait_until(Duration::from_secs(5), "the waiter to register", || {
            tracking_clients(&server) > 0
        });
        assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
        let next = waiter.join().unwrap().unwrap();
        assert!(next.is_some());
    });
    let fenced = coord.fenced_lock("{r}:lease", "{r}:fence").unwrap();
    let g = fenced.try_acquire(Duration::from_secs(2)).unwrap().unwrap();
    assert_eq!(g.fencing_token().get(), 1);
    // And a key outside the user's pattern is refused with a permission error.
    let outside = Coordinator::builder(&server.url_for_user("locker", "pw"))
        .key_prefix("other:")
        .build()
        .unwrap();
    let err = outside
        .lock("job")
        .unwrap()
        .try_acquire(Duration::from_secs(2))
        .unwrap_err();
    assert!(matches!(err, Error::Permission(_)), "{err}");
}

fn tracking_clients(server: &TestServer) -> usize {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut server.client())
        .unwrap();
    list.lines().filter(|l| l.contains("flags=t")).count()
}

#[cfg(feature = "tls")]
mod tls {
    use super::*;
    use support::TlsAuthClients;

    #[test]
    fn tls_with_client_certificate_works_end_to_end() {
        let server = TestServer::builder().tls(TlsAuthClients::Yes).start();
        let files = server.tls().unwrap();
        let coord = Coordinator::builder(&server.url())
            .tls_ca_pem(files.ca_cert_pem())
            .tls_client_cert_pem(files.client_cert_pem(), files.client_key_pem())
            .build()
            .unwrap();
        let lock = coord.fenced_lock("{t}:lease", "{t}:fence").unwrap();
        let guard = lock.try_acquire(Duration::from_secs(5)).unwrap().unwrap();
        assert_eq!(guard.fencing_token().get(), 1);
        assert!(guard.verify_still_held().unwrap().is_some());
        assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);

        // Without the client certificate the server refuses the handshake.
        let err = Coordinator::builder(&server.url())
            .tls_ca_pem(files.ca_cert_pem())
            .connect_timeout(Duration::from_secs(1))
            .build()
            .unwrap_err();
        assert!(
            matches!(err, Error::Tls { .. } | Error::Connect { .. }),
            "{err}"
        );
        // Without the CA the server's certificate is not trusted.
        let err = Coordinator::builder(&server.url())
            .tls_client_cert_pem(files.client_cert_pem(), files.client_key_pem())
            .connect_timeout(Duration::from_secs(1))
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::Tls { .. }), "{err}");
    }

    #[test]
    fn tls_to_a_plain_port_fails_within_the_connect_timeout() {
        let server = shared_server();
        let started = Instant::now();
        let err = Coordinator::builder(&format!("rediss://127.0.0.1:{}", server.port()))
            .connect_timeout(Duration::from_millis(500))
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::Tls { .. }), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
}

#[test]
fn unix_sockets_and_database_numbers_work() {
    let socket = std::env::temp_dir().join(format!("respire-{}.sock", std::process::id()));
    let server = TestServer::builder()
        .arg("--unixsocket")
        .arg(socket.display().to_string())
        .start();
    let coord = Coordinator::connect(&format!("unix://{}?db=3", socket.display())).unwrap();
    let guard = coord
        .lock("job")
        .unwrap()
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .unwrap();
    let mut admin = server.client();
    let _: () = redis::cmd("SELECT").arg(3).query(&mut admin).unwrap();
    assert!(
        admin.exists::<_, bool>("job").unwrap(),
        "the lock is in database 3"
    );
    drop(guard);
    assert!(!admin.exists::<_, bool>("job").unwrap());

    let coord = Coordinator::builder(&format!("redis://127.0.0.1:{}/2", server.port()))
        .build()
        .unwrap();
    let guard = coord
        .lock("job2")
        .unwrap()
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .unwrap();
    let _: () = redis::cmd("SELECT").arg(2).query(&mut admin).unwrap();
    assert!(
        admin.exists::<_, bool>("job2").unwrap(),
        "the lock is in database 2"
    );
    assert!(format!("{coord:?}").contains("/2"));
    drop(guard);
    let _ = std::fs::remove_file(&socket);
}

#[test]
fn reset_expiry_and_keep_alive_take_turns() {
    let prefix = unique_prefix("turns");
    let coord = Coordinator::builder(&shared_server().url())
        .key_prefix(&prefix)
        .node_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    let guard = lock
        .try_acquire(Duration::from_millis(600))
        .unwrap()
        .unwrap();
    let renewal = guard.keep_alive().unwrap();
    let until = Instant::now() + Duration::from_secs(2);
    let mut resets = 0;
    while Instant::now() < until {
        assert!(guard.reset_expiry(Duration::from_millis(600)).unwrap());
        resets += 1;
        // The local estimate never runs ahead of the server's expiry.
        let estimate = guard.remaining_estimate();
        let server = guard.verify_still_held().unwrap().expect("held");
        assert!(
            guard.remaining_estimate() <= server + Duration::from_millis(2),
            "estimate {estimate:?} beyond the server's {server:?}"
        );
    }
    assert!(resets > 10);
    // Each reset pushes the next renewal back by half a TTL; once they stop,
    // keep-alive takes over again.
    let before = coord.renewal_stats().renewals;
    wait_until(Duration::from_secs(3), "keep-alive to renew again", || {
        coord.renewal_stats().renewals > before
    });
    assert!(!guard.is_lost());
    drop(renewal);
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
}

#[test]
fn a_kept_alive_lease_rides_out_a_server_that_refuses_connections_for_a_while() {
    // Every write reaches the disk before its reply: the restarted server
    // holds the lease with the expiry its last renewal set.
    let server = TestServer::builder().append_only().start();
    let coord = Coordinator::builder(&server.url())
        .node_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let ttl = Duration::from_secs(2);
    let guard = coord
        .lock("down")
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .unwrap();
    let renewal = guard.keep_alive().unwrap();
    // Down before the first renewal, which opens the renewals' connection:
    // that connection cannot be made, nothing is sent, the renewal's claim is
    // given up, and the lease is renewed again once the server is back.
    let failed = coord.renewal_stats().failures;
    // Every expiry set before this is past within a TTL of it.
    let killed = Instant::now();
    server.kill();
    wait_until(
        Duration::from_secs(3),
        "a renewal that found no server",
        || coord.renewal_stats().failures > failed,
    );
    server.restart();
    let renewed = coord.renewal_stats().renewals;
    wait_until(
        Duration::from_secs(5),
        "a TTL, and two renewals since",
        || killed.elapsed() > ttl && coord.renewal_stats().renewals >= renewed + 2,
    );
    assert!(!guard.is_lost());
    let pttl: i64 = server.client().pttl(guard.key()).unwrap();
    assert!(pttl > 0, "renewed on the restarted server: PTTL {pttl}");
    drop(renewal);
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
}

#[test]
fn after_a_restart_stale_pooled_connections_are_replaced_without_errors() {
    let server = TestServer::start();
    let coord = Coordinator::builder(&server.url())
        .pool_size(4)
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    // Fill the pool with idle connections.
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..50 {
                    drop(lock.try_acquire(Duration::from_secs(5)).unwrap());
                }
            });
        }
    });
    server.kill();
    server.restart();
    let mut errors = 0;
    let mut held = None;
    for _ in 0..4 {
        match lock.try_acquire(Duration::from_secs(5)) {
            Ok(guard) => {
                held = Some(guard.expect("the restarted server has no lock"));
                break;
            }
            Err(e) => {
                assert!(e.is_retryable(), "{e}");
                errors += 1;
            }
        }
    }
    assert!(held.is_some());
    assert_eq!(errors, 0, "stale pooled connections surfaced as errors");
    assert!(
        lock.try_acquire(Duration::from_secs(5)).unwrap().is_none(),
        "held now"
    );
}

#[test]
fn a_killed_pooled_connection_is_replaced_without_an_error() {
    let server = TestServer::start();
    let coord = Coordinator::builder(&server.url())
        .pool_size(1)
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    drop(lock.try_acquire(Duration::from_secs(5)).unwrap().unwrap());
    let ids = respire_client_ids(&server);
    assert_eq!(ids.len(), 1);
    // As the server's idle `timeout` or an operator would.
    let _: () = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(ids[0])
        .query(&mut server.client())
        .unwrap();
    let guard = lock.try_acquire(Duration::from_secs(5)).unwrap();
    assert!(guard.is_some());
    let waited = coord
        .lock("other")
        .unwrap()
        .acquire_timeout(Duration::from_secs(5), Duration::from_secs(1))
        .unwrap();
    assert!(waited.is_some());
}

#[test]
fn the_fenced_acquire_script_is_idempotent_for_one_owner() {
    let mut admin = shared_server().client();
    let prefix = unique_prefix("idempotent");
    let fenced = redis::Script::new(include_str!("../src/scripts/fenced_acquire.lua"));
    let (lease, fence) = (
        format!("{prefix}{{f}}:lease"),
        format!("{prefix}{{f}}:fence"),
    );
    for _ in 0..2 {
        let reply: Vec<i64> = fenced
            .key(&lease)
            .key(&fence)
            .arg("owner-a")
            .arg(5000)
            .invoke(&mut admin)
            .unwrap();
        assert_eq!(reply, [1, 1], "the same grant, not a new token");
    }
    let counter: i64 = admin.get(&fence).unwrap();
    assert_eq!(counter, 1);
    let reply: Vec<i64> = fenced
        .key(&lease)
        .key(&fence)
        .arg("owner-b")
        .arg(5000)
        .invoke(&mut admin)
        .unwrap();
    assert_eq!(reply[0], 0);
    // A prefix of an owner is not that owner.
    let reply: Vec<i64> = fenced
        .key(&lease)
        .key(&fence)
        .arg("owner")
        .arg(5000)
        .invoke(&mut admin)
        .unwrap();
    assert_eq!(reply[0], 0);
}

/// The replicas a sentinel knows for `service`: (port, flags, link status).
fn sentinel_replicas(sentinel: &TestServer, service: &str) -> Vec<(String, String, String)> {
    let replicas: Vec<Vec<String>> = redis::cmd("SENTINEL")
        .arg("REPLICAS")
        .arg(service)
        .query(&mut sentinel.client())
        .unwrap();
    replicas
        .into_iter()
        .map(|fields| {
            let get = |name: &str| {
                fields
                    .chunks(2)
                    .find(|kv| kv[0] == name)
                    .map(|kv| kv[1].clone())
                    .unwrap_or_default()
            };
            (get("port"), get("flags"), get("master-link-status"))
        })
        .collect()
}

/// A grant whose reply came from a primary that was failed over during the
/// call is run again on the new primary. If the first grant reached the new
/// primary (and could not be deleted there), the attempt finds it in place:
/// its expiry counts from the first send, so the guard's bound must too.
#[test]
fn a_grant_found_in_place_after_a_failover_counts_from_the_first_send() {
    let no_sync_delay = ["--repl-diskless-sync-delay", "0"];
    let primary = TestServer::builder().args(no_sync_delay).start();
    let replica = TestServer::builder()
        .args(no_sync_delay)
        .args(["--replicaof", "127.0.0.1", &primary.port().to_string()])
        .start();
    // The sentinel, and so every client, reaches the primary through a proxy
    // that can hold its replies back; the replica is reached directly.
    let front = FaultProxy::start(primary.addr());
    let sentinel = TestServer::builder()
        .sentinel(format!(
            "sentinel monitor svc 127.0.0.1 {} 1\n\
             sentinel down-after-milliseconds svc 60000\n\
             sentinel failover-timeout svc 2000\n",
            front.port()
        ))
        .start();
    let replica_port = replica.port().to_string();
    wait_until(
        Duration::from_secs(30),
        "the sentinel to find the replica",
        || {
            sentinel_replicas(&sentinel, "svc")
                .iter()
                .any(|(port, flags, link)| {
                    *port == replica_port && flags == "slave" && link == "ok"
                })
        },
    );
    // The new primary runs the acquire's plain commands but refuses scripts,
    // so the first grant, once discarded, cannot be released there.
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("-eval")
        .arg("-evalsha")
        .query(&mut replica.client())
        .unwrap();
    let node_timeout = Duration::from_secs(8);
    let coord = Coordinator::sentinel_builder(&[&sentinel.url()], "svc")
        .node_timeout(node_timeout)
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    // A pooled connection to the primary, made before its replies are held.
    lock.try_acquire(Duration::from_secs(30))
        .unwrap()
        .expect("free")
        .release()
        .unwrap();
    let reply_delay = Duration::from_secs(4);
    front.set_mode(Mode::DelayServerToClient(reply_delay));
    let ttl = Duration::from_secs(30);
    let (guard, sent, switched) = std::thread::scope(|s| {
        let sent = Instant::now();
        let acquiring = s.spawn(|| lock.try_acquire(ttl));
        let mut on_replica = replica.client();
        wait_until(
            Duration::from_secs(3),
            "the grant to reach the replica",
            || on_replica.exists(lock.key()).unwrap(),
        );
        let _: () = redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg("svc")
            .query(&mut sentinel.client())
            .unwrap();
        wait_until(
            Duration::from_secs(10),
            "the coordinator to follow the failover",
            || {
                coord
                    .primaries()
                    .iter()
                    .any(|p| p.ends_with(&format!(":{replica_port}")))
            },
        );
        let switched = Instant::now();
        (acquiring.join().unwrap(), sent, switched)
    });
    assert!(
        switched < sent + reply_delay,
        "the failover came {:?} after the send, after the first reply",
        switched - sent
    );
    let guard = guard.unwrap().expect("granted on the new primary");
    // The oracle: the key's expiry on the new primary, on the local clock.
    let mut admin = replica.client();
    let mut pipe = redis::pipe();
    pipe.atomic().cmd("PEXPIRETIME").arg(lock.key()).cmd("TIME");
    let before = Instant::now();
    let (at_ms, (secs, micros)): (i64, (i64, i64)) = pipe.query(&mut admin).unwrap();
    let read_at = before + before.elapsed() / 2;
    let left_us = at_ms * 1_000 - (secs * 1_000_000 + micros);
    assert!(left_us > 0, "the key has no expiry left ({at_ms})");
    let expiry = read_at + Duration::from_micros(left_us as u64);
    // The library's bound, the thing under test.
    let bound = Instant::now() + guard.remaining_estimate();
    assert!(
        bound <= expiry,
        "the guard counts on the lease {:?} past its expiry on the new primary",
        bound - expiry
    );
    assert!(!guard.is_lost());
    println!(
        "bound {:?} before the new primary's expiry ({:?} after the first send)",
        expiry - bound,
        expiry - sent
    );
}

#[test]
fn a_verify_that_finds_less_time_left_bounds_the_guard_and_its_loss_signal() {
    // A server holding the lease with less time than the guard counts on
    // (as a promoted replica that missed an extension does): the verify
    // moves the guard's bound to what the server has, and the loss signal
    // closes before the server lets the key go.
    let prefix = unique_prefix("verify_bounds");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(300));
    let lock = coord.lock("job").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    let signal = guard.lost_signal().clone();
    let mut admin = shared_server().client();
    let _: () = admin.pexpire(guard.key(), 2_000).unwrap();
    let left = guard.verify_still_held().unwrap().expect("held");
    assert!(left <= Duration::from_millis(2_000), "{left:?}");
    assert!(
        guard.remaining_estimate() <= Duration::from_millis(2_000),
        "{:?}",
        guard.remaining_estimate()
    );
    // The signal closes (nothing is ever sent on it) within the time the
    // server had left, and the server still has the key then.
    let closed = signal.recv_timeout(Duration::from_secs(5));
    assert_eq!(
        closed,
        Err(crossbeam_channel::RecvTimeoutError::Disconnected),
        "the loss signal closed"
    );
    let server_left: i64 = admin.pttl(guard.key()).unwrap();
    assert!(
        server_left > 0,
        "flagged with {server_left} ms left on the server"
    );
    assert!(guard.is_lost());
}

#[test]
fn a_verify_after_a_restart_answers_on_a_fresh_connection() {
    // The pooled connection died with the server; the key survived in the
    // append-only file. The verify is idempotent, so it runs again on a new
    // connection instead of failing.
    let server = TestServer::builder().append_only().start();
    let coord = Coordinator::builder(&server.url())
        .key_prefix(&unique_prefix("verify_restart"))
        .node_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    server.restart();
    let left = guard.verify_still_held().unwrap().expect("still held");
    assert!(left > Duration::from_secs(25), "{left:?}");
    assert!(!guard.is_lost());
}
