//! Who gets a lock next: the hand-off within one process under the default
//! (barging) fairness, and `Fairness::Fifo`'s queue on the server — grants in
//! the order waiters joined it, dead waiters dropping out by themselves, bad
//! input refused.
//!
//! Oracles: the queue's sorted sets and `TIME` on the server, and a
//! recording resource that stamps every grant on the process's monotonic
//! clock.

mod support;

use std::io::Write;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{CancelToken, Error, Fairness, Lock};
use support::{
    ChildProc, TestServer, block_on_stdin, calls, coordinator, env, server_now, shared_server,
    unique_prefix, wait_until,
};

const CHILD_ENV: &str = "RESPIRE_FAIRNESS_CHILD";
const TTL: Duration = Duration::from_secs(30);
const NODE_TIMEOUT: Duration = Duration::from_millis(100);
const ENTRY_TTL: Duration = Duration::from_millis(1000);
const FIFO: Fairness = Fairness::Fifo {
    entry_ttl: ENTRY_TTL,
};

fn fifo_lock(url: &str, prefix: &str) -> Lock {
    coordinator(url, prefix, NODE_TIMEOUT)
        .lock("{fair}")
        .unwrap()
        .with_fairness(FIFO)
        .unwrap()
}

#[test]
fn a_thread_that_released_waits_behind_the_waiter_its_release_woke() {
    let server = shared_server();
    let prefix = unique_prefix("handoff_local");
    let coord = coordinator(&server.url(), &prefix, Duration::from_millis(500));
    let lock = coord.lock("k").unwrap();
    let mut admin = server.client();
    let held = lock.try_acquire(TTL).unwrap().unwrap();
    let grants: Mutex<Vec<(&str, Instant)>> = Mutex::new(Vec::new());
    let cancel = CancelToken::new();
    thread::scope(|s| {
        let sets = calls(&mut admin, &["set"]);
        let waiter = s.spawn(|| {
            let g = lock.acquire(TTL, &cancel).unwrap();
            grants.lock().unwrap().push(("waiter", Instant::now()));
            thread::sleep(Duration::from_millis(20));
            g.release().unwrap();
        });
        // The waiter's plain attempt and its tracked one (made registered):
        // it is queued in this process and its key tracked.
        wait_until(
            Duration::from_secs(10),
            "the waiter's tracked attempt",
            || calls(&mut admin, &["set"]) >= sets + 2,
        );
        held.release().unwrap();
        // At once, as a releaser looping on the lock would.
        let again = lock.acquire(TTL, &cancel).unwrap();
        grants.lock().unwrap().push(("releaser", Instant::now()));
        again.release().unwrap();
        waiter.join().unwrap();
    });
    let grants = grants.into_inner().unwrap();
    println!("grants in order: {grants:?}");
    let order: Vec<&str> = grants.iter().map(|(who, _)| *who).collect();
    assert_eq!(order, ["waiter", "releaser"]);
    assert!(grants[0].1 <= grants[1].1);
}

#[test]
fn fifo_grants_go_in_the_order_waiters_joined_the_queue_and_never_out_of_turn() {
    const WAITERS: usize = 5;
    let server = shared_server();
    let prefix = unique_prefix("fifo_order");
    let url = server.url();
    let holder = fifo_lock(&url, &prefix);
    let queue = format!("{}:queue", holder.key());
    let mut admin = server.client();
    let held = holder.try_acquire(TTL).unwrap().unwrap();
    // Each waiter has its own coordinator, as a process of its own would.
    let locks: Vec<Lock> = (0..WAITERS).map(|_| fifo_lock(&url, &prefix)).collect();
    let joined: Mutex<Vec<(usize, Instant)>> = Mutex::new(Vec::new());
    let granted: Mutex<Vec<(usize, Instant)>> = Mutex::new(Vec::new());
    let mut barged = 0;
    thread::scope(|s| {
        for (i, lock) in locks.iter().enumerate() {
            let granted = &granted;
            s.spawn(move || {
                let g = lock
                    .acquire_timeout(TTL, Duration::from_secs(30))
                    .unwrap()
                    .expect("granted in turn");
                granted.lock().unwrap().push((i, Instant::now()));
                thread::sleep(Duration::from_millis(10));
                g.release().unwrap();
            });
            // One at a time: the next starts once the server's queue holds
            // this one.
            wait_until(Duration::from_secs(10), "the waiter to queue", || {
                admin.zcard::<_, usize>(&queue).unwrap() == i + 1
            });
            joined.lock().unwrap().push((i, Instant::now()));
        }
        held.release().unwrap();
        // A caller that comes while waiters are queued never takes it ahead
        // of them (nor does the one that just released).
        while admin.zcard::<_, usize>(&queue).unwrap() > 0 {
            if let Some(g) = holder.try_acquire(TTL).unwrap() {
                barged += 1;
                g.release().unwrap();
            }
        }
    });
    let joined = joined.into_inner().unwrap();
    let granted = granted.into_inner().unwrap();
    println!("joined: {joined:?}\ngranted: {granted:?}");
    assert_eq!(barged, 0, "grants out of turn");
    let by_join: Vec<usize> = joined.iter().map(|(i, _)| *i).collect();
    let by_grant: Vec<usize> = granted.iter().map(|(i, _)| *i).collect();
    assert_eq!(by_grant, by_join);
    assert!(granted.windows(2).all(|w| w[0].1 <= w[1].1));
    let left: usize = admin.exists(&queue).unwrap();
    assert_eq!(left, 0, "the queue is gone once every waiter was served");
}

#[test]
fn fifo_waiters_that_wait_several_entry_lifetimes_keep_their_places() {
    const WAITERS: usize = 3;
    let server = shared_server();
    let prefix = unique_prefix("fifo_long_wait");
    let url = server.url();
    let holder = fifo_lock(&url, &prefix);
    let queue = format!("{}:queue", holder.key());
    let mut admin = server.client();
    let held = holder.try_acquire(TTL).unwrap().unwrap();
    let locks: Vec<Lock> = (0..WAITERS).map(|_| fifo_lock(&url, &prefix)).collect();
    let granted: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    let mut joined: Vec<String> = Vec::new();
    let mut orders_seen = 0;
    thread::scope(|s| {
        for (i, lock) in locks.iter().enumerate() {
            let granted = &granted;
            s.spawn(move || {
                let g = lock
                    .acquire_timeout(TTL, Duration::from_secs(30))
                    .unwrap()
                    .expect("granted in turn");
                granted.lock().unwrap().push(i);
                g.release().unwrap();
            });
            wait_until(Duration::from_secs(10), "the waiter to queue", || {
                admin.zcard::<_, usize>(&queue).unwrap() == i + 1
            });
            let order: Vec<String> = admin.zrange(&queue, 0, -1).unwrap();
            assert_eq!(order[..i], joined[..], "an earlier waiter moved");
            joined.push(order[i].clone());
        }
        // Every entry outlives its lifetime twice over while it waits: each
        // waiter refreshes its own, and none drops out and queues again
        // behind the others. The oracle is the server's queue itself.
        let until = Instant::now() + ENTRY_TTL * 5 / 2;
        while Instant::now() < until {
            let order: Vec<String> = admin.zrange(&queue, 0, -1).unwrap();
            assert_eq!(
                order, joined,
                "the server's queue changed order while waiting"
            );
            orders_seen += 1;
            thread::sleep(Duration::from_millis(10));
        }
        held.release().unwrap();
    });
    println!("the queue read {orders_seen} times in join order");
    assert_eq!(*granted.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
}

#[test]
fn a_fifo_wait_that_gives_up_leaves_the_queue_at_once() {
    let server = shared_server();
    let prefix = unique_prefix("fifo_give_up");
    let url = server.url();
    let holder = fifo_lock(&url, &prefix);
    let queue = format!("{}:queue", holder.key());
    let mut admin = server.client();
    let _held = holder.try_acquire(TTL).unwrap().unwrap();
    let waiter = fifo_lock(&url, &prefix);
    let cancel = CancelToken::new();
    thread::scope(|s| {
        let w = s.spawn(|| waiter.acquire(TTL, &cancel));
        wait_until(Duration::from_secs(10), "the waiter to queue", || {
            admin.zcard::<_, usize>(&queue).unwrap() == 1
        });
        cancel.cancel();
        assert!(matches!(w.join().unwrap(), Err(Error::Cancelled)));
    });
    let left: usize = admin.zcard(&queue).unwrap();
    assert_eq!(left, 0);
    let timed_out = waiter
        .acquire_timeout(TTL, Duration::from_millis(300))
        .unwrap();
    assert!(timed_out.is_none());
    let left: usize = admin.zcard(&queue).unwrap();
    assert_eq!(left, 0);
}

#[test]
fn a_killed_fifo_waiter_holds_up_the_queue_no_longer_than_its_entry_ttl() {
    const TEST: &str = "a_killed_fifo_waiter_holds_up_the_queue_no_longer_than_its_entry_ttl";
    if std::env::var(CHILD_ENV).as_deref() == Ok("waiter") {
        let lock = fifo_lock(
            &env("RESPIRE_FAIRNESS_URL"),
            &env("RESPIRE_FAIRNESS_PREFIX"),
        );
        let mut out = std::io::stdout();
        writeln!(out, "@@waiting").unwrap();
        out.flush().unwrap();
        let got = lock.acquire_timeout(TTL, Duration::from_secs(60));
        writeln!(out, "@@ended {:?}", got.map(|g| g.is_some())).unwrap();
        block_on_stdin();
        return;
    }
    let server = TestServer::start();
    let url = server.url();
    let prefix = unique_prefix("fifo_killed");
    let holder = fifo_lock(&url, &prefix);
    let queue = format!("{}:queue", holder.key());
    let expiries = format!("{}:queue:expiry", holder.key());
    let mut admin = server.client();
    let held = holder.try_acquire(TTL).unwrap().unwrap();
    let mut child = ChildProc::spawn(
        CHILD_ENV,
        TEST,
        "waiter",
        &[
            ("RESPIRE_FAIRNESS_URL", url.clone()),
            ("RESPIRE_FAIRNESS_PREFIX", prefix.clone()),
        ],
    );
    child.expect("waiting");
    wait_until(Duration::from_secs(10), "the child to queue", || {
        admin.zcard::<_, usize>(&queue).unwrap() == 1
    });
    let dead: String = admin.zrange::<_, Vec<String>>(&queue, 0, 0).unwrap()[0].clone();
    let next = fifo_lock(&url, &prefix);
    let cancel = CancelToken::new();
    let (granted_at_ms, dead_expiry_ms) = thread::scope(|s| {
        let waiter = s.spawn(|| {
            let g = next.acquire(TTL, &cancel).unwrap();
            let (now_ms, _) = server_now(&mut server.client());
            g.release().unwrap();
            now_ms
        });
        wait_until(
            Duration::from_secs(10),
            "the second waiter to queue",
            || admin.zcard::<_, usize>(&queue).unwrap() == 2,
        );
        child.kill9();
        // Its last refresh: the entry's expiry, on the server's clock.
        let dead_expiry_ms: i64 = admin.zscore(&expiries, &dead).unwrap();
        held.release().unwrap();
        (waiter.join().unwrap(), dead_expiry_ms)
    });
    println!(
        "granted {} ms after the killed waiter's entry expired",
        granted_at_ms - dead_expiry_ms
    );
    // The dead head kept its turn until its entry expired, and no longer
    // than that plus an entry lifetime (the next waiter's refresh timer).
    assert!(granted_at_ms >= dead_expiry_ms);
    assert!(granted_at_ms <= dead_expiry_ms + 2 * ENTRY_TTL.as_millis() as i64);
    let gone: Option<i64> = admin.zscore(&expiries, &dead).unwrap();
    assert_eq!(gone, None);
}

#[test]
fn fifo_refuses_bad_input_and_changes_nothing() {
    let server = shared_server();
    let prefix = unique_prefix("fifo_bad");
    let url = server.url();
    let coord = coordinator(&url, &prefix, NODE_TIMEOUT);
    let mut admin = server.client();

    // No hash tag: the queue could not share the lock's slot.
    let e = coord
        .lock("plain")
        .unwrap()
        .with_fairness(FIFO)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("hash tag"), "{e}");

    // An entry that could expire before its waiter refreshes it.
    let e = coord
        .lock("{k}")
        .unwrap()
        .with_fairness(Fairness::Fifo {
            entry_ttl: NODE_TIMEOUT * 3,
        })
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("three node timeouts"), "{e}");

    // A queue key of another type: a clear error, nothing changed.
    let lock = coord.lock("{k}").unwrap().with_fairness(FIFO).unwrap();
    assert_eq!(lock.fairness(), FIFO);
    let queue = format!("{}:queue", lock.key());
    let _: () = admin.set(&queue, "not a queue").unwrap();
    let before = support::snapshot(&mut admin, &prefix);
    let e = lock.try_acquire(TTL).unwrap_err();
    assert!(matches!(e, Error::BadKey { .. }), "{e}");
    assert!(e.to_string().contains(&queue), "{e}");
    assert_eq!(support::snapshot(&mut admin, &prefix), before);

    // Barging again is the plain lock.
    let plain = lock.with_fairness(Fairness::Barging).unwrap();
    assert_eq!(plain.fairness(), Fairness::Barging);
}

#[test]
fn a_fifo_queue_whose_expiry_set_was_lost_moves_again_once_its_dead_head_lapses() {
    let url = shared_server().url();
    let prefix = unique_prefix("fifo_heal");
    let lock = fifo_lock(&url, &prefix);
    let key = lock.key().to_owned();
    // What a crashed head leaves once the expiry set is gone (evicted,
    // deleted by hand): its place in the order, and no expiry entry.
    let mut conn = shared_server().client();
    let _: () = redis::cmd("ZADD")
        .arg(format!("{key}:queue"))
        .arg(1)
        .arg("crashed-waiter")
        .query(&mut conn)
        .unwrap();
    let started = Instant::now();
    let guard = lock
        .acquire_timeout(Duration::from_secs(5), ENTRY_TTL * 4)
        .unwrap();
    assert!(guard.is_some(), "the queue never moved past its dead head");
    // It waited for the dead head's new entry to lapse: one lifetime.
    assert!(started.elapsed() >= ENTRY_TTL - Duration::from_millis(50));
}
