//! Regressions for defects a line-by-line review found (each test opens with
//! the letter of the defect it covers): commands whose reply never came,
//! interleaved with other commands on the same lease; bounds that did not
//! hold; leaks; misreports. Real servers, faults caused on purpose.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{CancelToken, Coordinator, Error, ReleaseOutcome};
use support::{
    FaultProxy, Mode, TestServer, coordinator, script_calls, shared_server, unique_prefix,
    wait_until,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The key's remaining TTL on the server (−2: gone).
fn pttl(admin: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(admin).unwrap()
}

/// Polls `lost` and the server every millisecond until the server no longer
/// has the key; returns (when `lost` first held, when the key was gone).
fn race_loss_against_expiry(
    admin: &mut redis::Connection,
    key: &str,
    lost: impl Fn() -> bool,
    within: Duration,
) -> (Option<Instant>, Instant) {
    let started = Instant::now();
    let mut lost_at = None;
    loop {
        if lost_at.is_none() && lost() {
            lost_at = Some(Instant::now());
        }
        if pttl(admin, key) < 0 {
            return (lost_at, Instant::now());
        }
        assert!(started.elapsed() < within, "the key never expired");
        thread::sleep(ms(1));
    }
}

// --- a ---------------------------------------------------------------------

#[test]
fn a_shortening_reset_expiry_without_reply_bounds_the_guard_at_once() {
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let coord = coordinator(&proxy.url(), "a:", ms(200));
    let lock = coord.fenced_lock("{a}:lease", "{a}:fence").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(60)).unwrap().unwrap();
    // The extension script is on the server (else the server refuses it with
    // NOSCRIPT, and nothing is shortened).
    assert!(guard.reset_expiry(Duration::from_secs(60)).unwrap());
    // The shortening reaches the server; its reply never comes back.
    proxy.set_mode(Mode::DropServerToClient);
    let sent = Instant::now();
    let err = guard.reset_expiry(ms(1_500)).unwrap_err();
    assert!(err.is_uncertain(), "{err}");
    proxy.set_mode(Mode::Pass);
    let on_server = pttl(&mut admin, "a:{a}:lease");
    assert!(
        on_server > 0 && on_server <= 1_500,
        "the server shortened it: {on_server}"
    );
    // The guard counts on the shorter expiry from the send, not on 60 s.
    assert!(
        guard.remaining_estimate() <= ms(1_500).saturating_sub(sent.elapsed()),
        "{:?}",
        guard.remaining_estimate()
    );
    let signal = guard.lost_signal().clone();
    let (lost, gone) = race_loss_against_expiry(
        &mut admin,
        "a:{a}:lease",
        || guard.is_lost(),
        Duration::from_secs(10),
    );
    let lost = lost.expect("is_lost() before the server dropped the key");
    println!("a: flagged lost {:?} before the key expired", gone - lost);
    assert!(lost < gone);
    assert!(signal.try_recv().unwrap_err().is_disconnected());
}

/// Without the right to `CLIENT ID`, an extension that got no reply cannot be
/// fenced off: its connection cannot be killed, and it may land at any time.
/// The lease is not pinned until its deadline for that: later extensions are
/// confirmed, and each counts for no longer than the unanswered one's TTL,
/// which is all the server can be trusted to keep once it lands.
#[test]
fn an_extension_whose_connection_cannot_be_killed_caps_the_later_ones() {
    let server = TestServer::builder()
        .acl_user("app on >pw ~* &* +@all -client|id")
        .start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let url = format!("redis://app:pw@127.0.0.1:{}", proxy.port());
    let coord = coordinator(&url, "a3:", ms(300));
    let guard = coord
        .lock("job")
        .unwrap()
        .try_acquire(Duration::from_secs(60))
        .unwrap()
        .unwrap();
    // The extension script is on the server (else the late one is refused
    // with NOSCRIPT and changes nothing).
    assert!(guard.reset_expiry(Duration::from_secs(60)).unwrap());
    // A shortening to 5 s that reaches the server 2 s late, after its reply
    // was given up for lost.
    proxy.set_mode(Mode::Delay(ms(2_000)));
    let err = guard.reset_expiry(Duration::from_secs(5)).unwrap_err();
    assert!(err.is_uncertain(), "{err}");
    proxy.set_mode(Mode::Pass);
    // The claim is free: a 60 s extension is confirmed at once, on a new
    // connection, before the late one lands.
    assert!(guard.reset_expiry(Duration::from_secs(60)).unwrap());
    assert!(pttl(&mut admin, "a3:job") > 55_000);
    wait_until(
        Duration::from_secs(10),
        "the late shortening landed",
        || pttl(&mut admin, "a3:job") <= 5_000,
    );
    // The server keeps it under 5 s now; the guard never counted on more.
    let on_server = ms(pttl(&mut admin, "a3:job") as u64);
    let estimate = guard.remaining_estimate();
    assert!(
        estimate <= on_server,
        "the guard counts on {estimate:?}, the server keeps {on_server:?}"
    );
    assert!(!guard.is_lost());
    let (lost, gone) = race_loss_against_expiry(
        &mut admin,
        "a3:job",
        || guard.is_lost(),
        Duration::from_secs(10),
    );
    let lost = lost.expect("is_lost() before the server dropped the key");
    println!("a3: flagged lost {:?} before the key expired", gone - lost);
    assert!(lost < gone);
}

#[test]
fn a_renewal_without_reply_keeps_its_claim_until_its_connection_is_fenced() {
    let server = TestServer::start();
    let proxy = FaultProxy::start(server.addr());
    let coord = coordinator(&proxy.url(), "a2:", ms(200));
    let lock = coord.lock("job").unwrap();
    let guard = lock.try_acquire(Duration::from_secs(2)).unwrap().unwrap();
    let _renewal = guard.keep_alive().unwrap();
    wait_until(Duration::from_secs(5), "a confirmed renewal", || {
        coord.renewal_stats().renewals > 0
    });
    // Replies vanish: the next renewal goes unanswered, and so does the kill
    // that would fence it off (it travels the same way).
    proxy.set_mode(Mode::DropServerToClient);
    let failures = coord.renewal_stats().failures;
    wait_until(Duration::from_secs(5), "an unanswered renewal", || {
        coord.renewal_stats().failures > failures
    });
    // The claim is still held: a longer reset cannot be confirmed while the
    // late renewal may still land after it.
    let err = guard.reset_expiry(Duration::from_secs(60)).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    // Never fenced, never renewed: lost at its deadline.
    let signal = guard.lost_signal().clone();
    assert!(signal.recv_timeout(Duration::from_secs(5)).is_err());
    assert!(guard.is_lost());
    proxy.set_mode(Mode::Pass);
}

// --- c ---------------------------------------------------------------------

#[test]
fn c_loss_signals_close_on_time_while_the_executor_is_blocked_on_a_socket() {
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

// --- d ---------------------------------------------------------------------

#[test]
fn d_a_wait_that_ends_after_an_unanswered_attempt_cleans_up_its_grant() {
    // A trial needs the waiter to have heard its tracked attempt's reply
    // before replies are dropped; on a busy machine that reply can be dropped
    // too, and the waiter then never sends the grant (its new connections'
    // set-up is never answered). Such a trial still must leave nothing, and
    // counts as not run.
    support::until_a_trial_runs(
        8,
        "the waiter's tracked attempt went unanswered, so it made no grant",
        unanswered_grant_trial,
    );
}

/// One trial: a waiter whose grant is never heard of, cancelled; the grant
/// is deleted. Whether the waiter made the grant.
fn unanswered_grant_trial() -> bool {
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let coord = coordinator(&proxy.url(), "d:", ms(200));
    let lock = coord.fenced_lock("{d}:lease", "{d}:fence").unwrap();
    let () = admin.pset_ex("d:{d}:lease", "crashed-holder", 800).unwrap();
    let cancel = CancelToken::new();
    let granted = thread::scope(|s| {
        let _stop = support::CancelOnDrop(&cancel);
        let waiter = s.spawn(|| lock.acquire(Duration::from_secs(60), &cancel));
        // Once the waiter waits (it has heard that the lease is held and made
        // its tracked attempt), every reply is dropped: the grant it makes
        // when the holder expires is never heard of.
        wait_until(Duration::from_secs(5), "the waiter to wait", || {
            script_calls(&mut admin) >= 2
        });
        proxy.set_mode(Mode::DropServerToClient);
        let granted = support::true_within(Duration::from_secs(5), || {
            let v: Option<String> = admin.get("d:{d}:lease").unwrap();
            v.is_some_and(|v| v != "crashed-holder")
        });
        // The wait ends with another error: cancellation.
        cancel.cancel();
        let err = waiter.join().unwrap().unwrap_err();
        assert!(matches!(err, Error::Cancelled), "{err}");
        granted
    });
    proxy.set_mode(Mode::Pass);
    // The grant nobody heard of is deleted (after its connections are
    // killed), not left for its 60 s; without one, nothing is left either.
    wait_until(
        Duration::from_secs(5),
        "the unheard grant to be cleaned up",
        || !admin.exists::<_, bool>("d:{d}:lease").unwrap(),
    );
    granted
}

#[test]
fn a_wait_granted_after_an_unanswered_attempt_stops_that_attempt_from_granting_again() {
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let coord = coordinator(&proxy.url(), "ghost:", ms(200));
    let lock = coord.fenced_lock("{g}:lease", "{g}:fence").unwrap();
    // A waiting acquire first, so that the subscriber and a tracked pooled
    // connection are in place.
    let first = lock
        .acquire_timeout(Duration::from_secs(30), Duration::from_secs(5))
        .unwrap()
        .unwrap();
    let before = first.fencing_token().get();
    first.release().unwrap();
    // The bytes of the wait's first attempt reach the server 1.5 s late: it
    // times out (node timeout 200 ms) and is still on its way.
    let delay = ms(1_500);
    let sent = proxy.client_chunks();
    proxy.set_mode(Mode::Delay(delay));
    let started = Instant::now();
    let (guard, in_proxy) = thread::scope(|s| {
        let waiter =
            s.spawn(|| lock.acquire_timeout(Duration::from_secs(30), Duration::from_secs(10)));
        // Once the first attempt is held in the proxy, the next go through.
        wait_until(
            Duration::from_secs(5),
            "the first attempt in the proxy",
            || proxy.client_chunks() > sent,
        );
        proxy.set_mode(Mode::Pass);
        let guard = waiter.join().unwrap().unwrap().expect("granted");
        // What clients sent that the proxy still holds as the grant returns.
        (guard, proxy.client_chunks() - proxy.client_chunks_done())
    });
    println!(
        "ghost: granted {:?} after the wait began",
        started.elapsed()
    );
    assert!(
        in_proxy > 0,
        "granted only after the delayed attempt left the proxy"
    );
    let token = guard.fencing_token().get();
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    // The delayed attempt leaves the proxy once its delay is out (to the
    // server, or to a connection the server closed, if it was fenced off):
    // it must not grant the released owner again.
    wait_until(
        delay + Duration::from_secs(10),
        "the delayed attempt to leave the proxy",
        || proxy.client_chunks_done() == proxy.client_chunks(),
    );
    let held: bool = admin.exists("ghost:{g}:lease").unwrap();
    assert!(!held, "a late attempt granted a lease nobody holds");
    let fence: u64 = admin.get("ghost:{g}:fence").unwrap();
    assert_eq!(
        fence, token,
        "a late attempt drew a token (last seen {before})"
    );
}

// --- f ---------------------------------------------------------------------

#[test]
fn f_leases_sharing_one_fence_counter_never_see_a_false_regression() {
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

// --- g ---------------------------------------------------------------------

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
fn g_keep_alive_works_without_the_script_command() {
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
fn g_keep_alive_refuses_up_front_what_the_renewals_would_be_denied() {
    let (_server, _coord, guard) = held_by_user_denied("-client|kill");
    let err = guard.keep_alive().unwrap_err();
    assert!(matches!(err, Error::Permission(_)), "{err}");
}

// --- h ---------------------------------------------------------------------

#[test]
fn h_waiting_forever_spelled_duration_max_works() {
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

// --- i ---------------------------------------------------------------------

#[test]
fn i_every_bound_holds_on_a_freshly_restarted_server() {
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

// --- j ---------------------------------------------------------------------

#[test]
fn j_tokens_past_10_to_the_14_work_end_to_end() {
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

// --- k ---------------------------------------------------------------------

#[test]
fn k_a_release_that_sent_nothing_is_an_error_and_one_without_reply_is_uncertain() {
    let server = TestServer::start();
    let proxy = FaultProxy::start(server.addr());
    let coord = Coordinator::builder(&proxy.url())
        .key_prefix("k:")
        .node_timeout(ms(200))
        .pool_size(1)
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    // Sent, no reply: uncertain (the release script cached first, so that the
    // release is applied, and only its reply lost).
    let g = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
    let g = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    proxy.set_mode(Mode::DropServerToClient);
    assert_eq!(g.release().unwrap(), ReleaseOutcome::Uncertain);
    proxy.set_mode(Mode::Pass);
    // Nothing could be sent (the server is gone): an error.
    let g = lock.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    drop(proxy);
    let err = g.release().unwrap_err();
    assert!(
        matches!(err, Error::Connect { .. } | Error::PoolTimeout(_)),
        "{err}"
    );
}

// --- the pipeline bound ----------------------------------------------------

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
fn c_redlock_loss_signals_close_on_time_while_an_extension_hangs_on_the_nodes() {
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
        .try_acquire("kept", Duration::from_secs(5))
        .unwrap()
        .unwrap();
    let _renewal = kept.keep_alive().unwrap();
    // ...and a short one whose deadline falls inside that hang: lost at
    // 2.31 s − drift − 1 s ≈ 1.29 s after its send, ~2.95 s.
    thread::sleep(ms(1_660));
    let sent = Instant::now();
    let short = group.try_acquire("short", ms(2_310)).unwrap().unwrap();
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
fn k_a_command_a_script_may_not_run_is_a_permission_error() {
    let (_server, _coord, guard) = held_by_user_denied("-pexpire");
    // The extension script calls PEXPIRE, which this user may not run.
    let err = guard.reset_expiry(Duration::from_secs(30)).unwrap_err();
    assert!(matches!(err, Error::Permission(_)), "{err}");
    assert!(!guard.is_lost());
}
