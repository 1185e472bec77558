//! Bounds and rights at the edges: loss signals that close on time while a
//! socket or a node hangs, a whole renewal batch bounded by one node timeout,
//! every bound on a freshly restarted server, fence counters shared by leases,
//! waits spelled `Duration::MAX`, tokens past 10^14, and what the ACL denies
//! (keep-alive without `SCRIPT`, a script's commands). Real servers, faults
//! caused on purpose; commands left without a reply are in tests/unanswered.rs.

mod support;
use support::ms;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{Coordinator, Error, ReleaseOutcome};
use support::{
    FaultProxy, Mode, TestServer, coordinator, pttl, script_calls, shared_server, unique_prefix,
    wait_until,
};

#[test]
fn loss_signals_close_on_time_while_the_executor_is_blocked_on_a_socket() {
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let nt = ms(1_000);
    let coord = coordinator(&proxy.url(), "c:", nt);
    // A kept-alive lease whose renewal will hang on a blackholed connection...
    let kept = coord
        .lock("kept")
        .unwrap()
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .unwrap();
    let _renewal = kept.keep_alive().unwrap();
    // ...and a short lease, not kept alive, whose deadline falls while the
    // executor is stuck: its signal must not wait for the socket. The
    // renewal of `kept` is due 2.5 s after its grant (half its TTL) and
    // blocks the executor (connecting, as it renews for the first time) for
    // a node timeout, to ~3.5 s; `short` is lost at 1.73 s − drift − 1 s ≈
    // 711 ms after its send, ~2.95 s.
    thread::sleep(ms(2_240));
    let sent = Instant::now();
    let short = coord
        .lock("short")
        .unwrap()
        .try_acquire(ms(1_730))
        .unwrap()
        .unwrap();
    let signal = short.lost_signal().clone();
    let before = coord.renewal_stats();
    let chunks = proxy.client_chunks();
    proxy.set_mode(Mode::Blackhole);
    // The executor is stuck once the renewal's bytes are in the blackhole;
    // the short lease must still be held then, or nothing is tested.
    wait_until(
        Duration::from_secs(5),
        "the renewal to go into the blackhole",
        || proxy.client_chunks() > chunks,
    );
    assert!(
        signal.try_recv().is_err_and(|e| e.is_empty()),
        "the short lease was lost before the executor got stuck"
    );
    assert!(signal.recv_timeout(Duration::from_secs(5)).is_err());
    let closed = sent.elapsed();
    let after = coord.renewal_stats();
    let on_server = pttl(&mut admin, "c:short");
    let deadline = ms(1_730) - ms(17 + 2) - nt;
    println!(
        "c: signal closed {closed:?} after the send; deadline {deadline:?}; the server kept \
         the key {on_server} ms more"
    );
    // The executor was still stuck on the renewal when the signal closed: it
    // had neither confirmed it nor given up on it.
    assert_eq!(
        (after.renewals, after.failures),
        (before.renewals, before.failures),
        "the signal closed only once the executor was done with the stuck renewal"
    );
    // Not before its deadline (load only makes the signal later)...
    assert!(
        closed >= deadline.saturating_sub(ms(5)),
        "early: {closed:?}"
    );
    // ...and before the server let the key go.
    assert!(
        on_server > 0,
        "the server dropped the key first: {on_server}"
    );
    proxy.set_mode(Mode::Pass);
}

#[test]
fn leases_sharing_one_fence_counter_never_see_a_false_regression() {
    let prefix = unique_prefix("f");
    let coord = coordinator(&shared_server().url(), &prefix, ms(500));
    let one = coord.fenced_lock("{r}:one", "{r}:fence").unwrap();
    let two = coord.fenced_lock("{r}:two", "{r}:fence").unwrap();
    let grants = AtomicUsize::new(0);
    thread::scope(|s| {
        for t in 0..8u32 {
            let lock = if t.is_multiple_of(2) { &one } else { &two };
            let grants = &grants;
            s.spawn(move || {
                for _ in 0..300 {
                    match lock.try_acquire(Duration::from_secs(10)) {
                        Ok(Some(g)) => {
                            grants.fetch_add(1, Ordering::Relaxed);
                            drop(g);
                        }
                        Ok(None) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            });
        }
    });
    let grants = grants.into_inner();
    println!("f: {grants} grants from one shared counter, no regression reported");
    assert!(grants > 300);
}

/// A 30 s lock held by an ACL user who may run everything but `denied`, on a
/// server of its own (with the coordinator that holds it).
fn held_by_user_denied(denied: &str) -> (TestServer, Coordinator, respire_coordination::LockGuard) {
    let server = TestServer::builder()
        .acl_user(format!("app on >pw ~* &* +@all {denied}"))
        .start();
    let coord = Coordinator::builder(&server.url_for_user("app", "pw"))
        .build()
        .unwrap();
    let guard = coord
        .lock("job")
        .unwrap()
        .try_acquire(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    (server, coord, guard)
}

#[test]
fn keep_alive_works_without_the_script_command() {
    let server = TestServer::builder()
        .acl_user("app on >pw ~* &* +@all -script")
        .start();
    let coord = Coordinator::builder(&server.url_for_user("app", "pw"))
        .node_timeout(ms(200))
        .build()
        .unwrap();
    // A restart-like empty script cache on the renewal connection's first use.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.client())
        .unwrap();
    let guard = coord
        .lock("job")
        .unwrap()
        .try_acquire(ms(1_000))
        .unwrap()
        .unwrap();
    let _renewal = guard.keep_alive().unwrap();
    wait_until(Duration::from_secs(10), "three confirmed renewals", || {
        coord.renewal_stats().renewals >= 3
    });
    assert!(!guard.is_lost());
    assert_eq!(coord.renewal_stats().losses, 0);
}

#[test]
fn keep_alive_refuses_up_front_what_the_renewals_would_be_denied() {
    let (_server, _coord, guard) = held_by_user_denied("-client|kill");
    let err = guard.keep_alive().unwrap_err();
    assert!(matches!(err, Error::Permission(_)), "{err}");
}

#[test]
fn waiting_forever_spelled_duration_max_works() {
    let server = TestServer::start();
    let mut admin = server.client();
    let coord = coordinator(&server.url(), "h:", ms(500));
    let lock = coord.lock("job").unwrap();
    let free = lock
        .acquire_timeout(Duration::from_secs(10), Duration::MAX)
        .unwrap();
    assert!(free.is_some());
    thread::scope(|s| {
        let before = script_calls(&mut admin);
        let waiter = s.spawn(|| lock.acquire_timeout(Duration::from_secs(10), Duration::MAX));
        // The release comes once the waiter waits: it has heard that the lock
        // is held and made its tracked attempt.
        wait_until(Duration::from_secs(5), "the waiter to wait", || {
            script_calls(&mut admin) >= before + 2
        });
        drop(free);
        assert!(waiter.join().unwrap().unwrap().is_some());
    });
    // A deadline at the far end of what an Instant holds is the same.
    let far = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
    assert!(
        lock.acquire_deadline(Duration::from_secs(10), far)
            .unwrap()
            .is_some()
    );
}

#[test]
fn every_bound_holds_on_a_freshly_restarted_server() {
    // Persistence keeps the lease and the counter across the restarts; the
    // script cache and the pooled connections are lost every time.
    let server = TestServer::builder().append_only().start();
    let proxy = FaultProxy::start(server.addr());
    let nt = ms(400);
    let connect = ms(1_000);
    let coord = Coordinator::builder(&proxy.url())
        .key_prefix("i:")
        .node_timeout(nt)
        .connect_timeout(connect)
        .build()
        .unwrap();
    let lock = coord.fenced_lock("{i}:lease", "{i}:fence").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    // Every verb works on a restarted server (NOSCRIPT, then EVAL; a dead
    // pooled connection, then a fresh one where that is safe).
    server.restart();
    assert!(guard.verify_still_held().unwrap().is_some());
    server.restart();
    assert!(lock.try_acquire(Duration::from_secs(30)).unwrap().is_none());
    server.restart();
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    server.restart();
    let guard = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    // With 300 ms round trips, EVALSHA, NOSCRIPT, then EVAL would take 600 ms:
    // each bound holds anyway.
    server.restart();
    proxy.set_mode(Mode::Delay(ms(150)));
    let timed = |what: &str, bound: Duration, f: &dyn Fn() -> String| {
        let started = Instant::now();
        let outcome = f();
        let took = started.elapsed();
        println!("i: {what} on a restarted server, 300 ms round trips: {took:?}: {outcome}");
        assert!(took < bound, "{what}: {took:?}, bound {bound:?}");
    };
    // One attempt: a node timeout for its commands, plus the connect timeout
    // for the connection it has to open.
    timed("try_acquire", nt + connect + ms(50), &|| {
        format!(
            "{:?}",
            lock.try_acquire(Duration::from_secs(30))
                .map(|g| g.is_some())
        )
    });
    server.restart();
    timed("verify_still_held", nt + connect + ms(50), &|| {
        format!("{:?}", guard.verify_still_held())
    });
    server.restart();
    timed("reset_expiry", nt + connect + ms(50), &|| {
        format!("{:?}", guard.reset_expiry(Duration::from_secs(30)))
    });
    server.restart();
    // Release: at most one node timeout in all, a connect included.
    let started = Instant::now();
    let outcome = guard.release();
    let took = started.elapsed();
    println!("i: release on a restarted server, 300 ms round trips: {took:?}: {outcome:?}");
    assert!(took < nt + ms(50), "{took:?}");
    proxy.set_mode(Mode::Pass);
}

#[test]
fn tokens_past_10_to_the_14_work_end_to_end() {
    let prefix = unique_prefix("j");
    let coord = coordinator(&shared_server().url(), &prefix, ms(200));
    let mut admin = shared_server().client();
    let lock = coord.fenced_lock("{j}:lease", "{j}:fence").unwrap();
    let () = admin
        .set(format!("{prefix}{{j}}:fence"), "99999999999999")
        .unwrap();
    let g = lock.try_acquire(ms(1_000)).unwrap().unwrap();
    assert_eq!(g.fencing_token().get(), 100_000_000_000_000);
    assert!(g.verify_still_held().unwrap().is_some());
    assert!(g.reset_expiry(ms(1_000)).unwrap());
    {
        let _renewal = g.keep_alive().unwrap();
        let before = coord.renewal_stats().renewals;
        wait_until(Duration::from_secs(5), "a renewal", || {
            coord.renewal_stats().renewals > before
        });
        assert!(!g.is_lost());
    }
    assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
    // Past 2^53, where a Lua number loses digits.
    let () = admin
        .set(format!("{prefix}{{j}}:fence"), "9007199254740993")
        .unwrap();
    let g = lock.try_acquire(ms(1_000)).unwrap().unwrap();
    assert_eq!(g.fencing_token().get(), 9_007_199_254_740_994);
    assert!(g.verify_still_held().unwrap().is_some());
    drop(g);
    // The last token a counter can hold, then a clear error, nothing changed.
    let () = admin
        .set(format!("{prefix}{{j}}:fence"), "9223372036854775806")
        .unwrap();
    let g = lock.try_acquire(ms(1_000)).unwrap().unwrap();
    assert_eq!(g.fencing_token().get(), i64::MAX as u64);
    drop(g);
    let err = lock.try_acquire(ms(1_000)).unwrap_err();
    assert!(matches!(err, Error::BadKey { .. }), "{err}");
    let v: String = admin.get(format!("{prefix}{{j}}:fence")).unwrap();
    assert_eq!(v, "9223372036854775807");
    assert!(
        !admin
            .exists::<_, bool>(format!("{prefix}{{j}}:lease"))
            .unwrap()
    );
}

#[test]
fn a_stalled_server_fails_a_whole_renewal_batch_within_one_node_timeout() {
    let server = TestServer::start();
    let nt = ms(300);
    let coord = coordinator(&server.url(), "batch:", nt);
    let guards: Vec<_> = (0..200)
        .map(|i| {
            coord
                .lock(&format!("l{i}"))
                .unwrap()
                .try_acquire(Duration::from_secs(3))
                .unwrap()
                .unwrap()
        })
        .collect();
    let renewals: Vec<_> = guards.iter().map(|g| g.keep_alive().unwrap()).collect();
    wait_until(Duration::from_secs(5), "a pipelined renewal", || {
        coord.renewal_stats().renewals >= 200
    });
    server.pause();
    let paused = Instant::now();
    // The next batch hangs on the stalled server; the executor must give up
    // on all of it after one node timeout, not one per command.
    wait_until(Duration::from_secs(10), "the batch to fail", || {
        coord.renewal_stats().failures >= 200
    });
    let took = paused.elapsed();
    println!("batch of 200 failed {took:?} after the pause");
    // Due within ~1.5 s of the pause, then at most a node timeout.
    assert!(took < Duration::from_millis(1_500) + nt * 3, "{took:?}");
    server.resume();
    drop(renewals);
}

#[test]
fn redlock_loss_signals_close_on_time_while_an_extension_hangs_on_the_nodes() {
    use respire_coordination::{RedlockGroup, RedlockOptions};
    let servers: Vec<TestServer> = (0..3).map(|_| TestServer::start()).collect();
    let proxies: Vec<FaultProxy> = servers
        .iter()
        .map(|s| FaultProxy::start(s.addr()))
        .collect();
    let urls: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let nt = ms(1_000);
    let group = RedlockGroup::connect(
        &urls,
        RedlockOptions {
            node_timeout: nt,
            ..RedlockOptions::default()
        },
    )
    .unwrap();
    // A kept-alive lock whose extension, due 2.5 s after its grant (half its
    // TTL), will hang for a node timeout on blackholed nodes, to ~3.5 s...
    let kept = group
        .lock("kept")
        .unwrap()
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .unwrap();
    let _renewal = kept.keep_alive().unwrap();
    // ...and a short one whose deadline falls inside that hang: lost at
    // 2.31 s − drift − 1 s ≈ 1.29 s after its send, ~2.95 s.
    thread::sleep(ms(1_660));
    let sent = Instant::now();
    let short = group
        .lock("short")
        .unwrap()
        .try_acquire(ms(2_310))
        .unwrap()
        .unwrap();
    let signal = short.lost_signal().clone();
    let key = short.key().to_owned();
    thread::sleep(ms(450));
    let chunks = || proxies.iter().map(FaultProxy::client_chunks).sum::<u64>();
    let connections = || {
        proxies
            .iter()
            .map(FaultProxy::connection_count)
            .sum::<usize>()
    };
    let before = chunks();
    for p in &proxies {
        p.set_mode(Mode::Blackhole);
    }
    // The extension is stuck once its bytes are in every node's blackhole;
    // the short lock must still be held then, or nothing is tested.
    wait_until(
        Duration::from_secs(5),
        "the extension to go into the blackholes",
        || chunks() >= before + 3,
    );
    let (stuck_chunks, stuck_connections) = (chunks(), connections());
    assert!(
        signal.try_recv().is_err_and(|e| e.is_empty()),
        "the short lock was lost before the extension got stuck"
    );
    assert!(signal.recv_timeout(Duration::from_secs(5)).is_err());
    let closed = sent.elapsed();
    let disconnected: Vec<String> = group
        .nodes()
        .into_iter()
        .filter(|n| !n.connected)
        .map(|n| n.addr)
        .collect();
    let (now_chunks, now_connections) = (chunks(), connections());
    let on_nodes: Vec<i64> = servers
        .iter()
        .map(|s| pttl(&mut s.client(), &key))
        .collect();
    let deadline = ms(2_310) - ms(23 + 2) - nt;
    println!(
        "c (redlock): signal closed {closed:?} after the send; deadline {deadline:?}; the \
         nodes kept the key {on_nodes:?} ms more"
    );
    // The extension was still stuck when the signal closed: no node's worker
    // had given up on it (a worker that does drops its connection, before it
    // answers, then reconnects and fences the stuck one off from the new).
    assert!(
        disconnected.is_empty(),
        "the signal closed only once the workers had given up on the stuck extension: \
         {disconnected:?}"
    );
    assert_eq!(
        (now_chunks, now_connections),
        (stuck_chunks, stuck_connections),
        "the signal closed only once the workers were done with the stuck extension"
    );
    // Not before its deadline (load only makes the signal later)...
    assert!(
        closed >= deadline.saturating_sub(ms(5)),
        "early: {closed:?}"
    );
    // ...and before a majority of the nodes let the key go.
    assert!(
        on_nodes.iter().filter(|p| **p > 0).count() >= 2,
        "the nodes dropped the key first: {on_nodes:?}"
    );
    for p in &proxies {
        p.set_mode(Mode::Pass);
    }
}

#[test]
fn a_command_a_script_may_not_run_is_a_permission_error() {
    let (_server, _coord, guard) = held_by_user_denied("-pexpire");
    // The extension script calls PEXPIRE, which this user may not run.
    let err = guard.reset_expiry(Duration::from_secs(30)).unwrap_err();
    assert!(matches!(err, Error::Permission(_)), "{err}");
    assert!(!guard.is_lost());
}
