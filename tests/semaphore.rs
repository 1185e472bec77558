//! The semaphore against real redis-server processes: never more holders than
//! the capacity, slots that never overlap and fence, the capacity stored and
//! agreed, pruned observability, a killed holder's permit freed at its own
//! expiry while others renew, 2,000 kept-alive permits, and every refusal.

mod support;
use support::coordinator;
use support::ms;

use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{Coordinator, Error, MAX_TTL, ReleaseOutcome, Semaphore};
use support::{
    ChildProc, block_on_stdin, env, local_instant, members, server_now, shared_server, snapshot,
    unique_prefix, wait_until,
};

/// Set in a copy of this binary that plays one role for a test.
const CHILD_ENV: &str = "RESPIRE_SEM_CHILD";

const NODE_TIMEOUT: Duration = Duration::from_millis(200);

/// The tests that measure time take turns, so they do not measure each other.
fn timed() -> MutexGuard<'static, ()> {
    static TIMED: Mutex<()> = Mutex::new(());
    TIMED.lock().unwrap_or_else(|e| e.into_inner())
}

/// An independent view of the protected resource: how many hold a permit now,
/// the most at once, and per slot whether it is taken and its highest token.
struct Resource {
    inside: AtomicUsize,
    most: AtomicUsize,
    slots: Vec<Mutex<(bool, u64)>>,
}

impl Resource {
    fn new(capacity: usize) -> Resource {
        Resource {
            inside: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
            slots: (0..capacity).map(|_| Mutex::new((false, 0))).collect(),
        }
    }

    fn enter(&self, slot: u32, token: u64) {
        let n = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        let mut s = self.slots[slot as usize].lock().unwrap();
        assert!(!s.0, "two holders of slot {slot} at once");
        assert!(token > s.1, "slot {slot}: token {token} after {}", s.1);
        *s = (true, token);
    }

    fn leave(&self, slot: u32) {
        self.slots[slot as usize].lock().unwrap().0 = false;
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

#[test]
fn capacity_three_never_admits_a_fourth_and_every_slot_is_fenced() {
    let _timed = timed();
    let prefix = unique_prefix("three");
    let coords = [
        coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT),
        coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT),
    ];
    let sems: Vec<Semaphore> = coords
        .iter()
        .map(|c| c.semaphore("{three}", 3).unwrap())
        .collect();
    let resource = Resource::new(3);
    let grants = AtomicU64::new(0);
    let started = Instant::now();
    thread::scope(|s| {
        for t in 0..16u64 {
            let sem = &sems[(t % 2) as usize];
            let (resource, grants) = (&resource, &grants);
            s.spawn(move || {
                let mut x = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for _ in 0..500 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let p = sem
                        .acquire_timeout(Duration::from_secs(10), Duration::from_secs(60))
                        .unwrap()
                        .expect("a permit within a minute");
                    assert!(p.slot() < 3);
                    resource.enter(p.slot(), p.fencing_token().get());
                    grants.fetch_add(1, Ordering::Relaxed);
                    thread::sleep(Duration::from_micros(x % 2_000));
                    resource.leave(p.slot());
                    assert_eq!(p.release().unwrap(), ReleaseOutcome::Released);
                }
            });
        }
    });
    let most = resource.most.load(Ordering::SeqCst);
    assert_eq!(grants.load(Ordering::Relaxed), 8_000);
    assert_eq!(most, 3, "the checker saw at most {most} holders");
    let mut c = shared_server().client();
    let fence: u64 = c.hget(format!("{prefix}{{three}}:meta"), "fence").unwrap();
    assert_eq!(fence, 8_000, "one token per grant");
    assert!(!c.exists::<_, bool>(sems[0].permits_key()).unwrap());
    println!(
        "capacity 3, 2 coordinators × 8 threads × 500: 8000 grants in {:?}, at most {most} \
         holders at once, per-slot tokens strictly increasing, highest {fence}",
        started.elapsed()
    );
}

#[test]
fn the_capacity_is_stored_and_a_disagreeing_participant_changes_nothing() {
    let prefix = unique_prefix("agree");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let three = coord.semaphore("{a}", 3).unwrap();
    assert_eq!(three.capacity(), 3);
    assert_eq!(three.available().unwrap(), 3, "nothing stored yet");
    let p = three.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    let mut c = shared_server().client();
    let stored: u32 = c.hget(three.meta_key(), "capacity").unwrap();
    assert_eq!(stored, 3);

    let five = coord.semaphore("{a}", 5).unwrap();
    let before = snapshot(&mut c, &prefix);
    for e in [
        five.try_acquire(Duration::from_secs(10)).unwrap_err(),
        five.acquire_timeout(Duration::from_secs(10), ms(300))
            .unwrap_err(),
        five.available().unwrap_err(),
    ] {
        assert!(
            matches!(
                e,
                Error::CapacityMismatch {
                    stored: 3,
                    requested: 5
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("nothing was changed"), "{e}");
    }
    assert_eq!(snapshot(&mut c, &prefix), before, "something changed");
    // Observing does not need to agree.
    assert_eq!(five.holders().unwrap().len(), 1);

    // set_capacity changes it on purpose; the handle that did it follows.
    let sem = five.clone();
    assert_eq!(sem.set_capacity(5).unwrap(), Some(3));
    assert_eq!(five.capacity(), 5, "clones share the declared capacity");
    assert_eq!(five.available().unwrap(), 4);
    assert!(matches!(
        three.try_acquire(Duration::from_secs(10)),
        Err(Error::CapacityMismatch {
            stored: 5,
            requested: 3
        })
    ));
    drop(p);
    let fresh = coord.semaphore("{fresh}", 2).unwrap();
    assert_eq!(fresh.set_capacity(4).unwrap(), None, "none was stored");
    for bad in [0, Semaphore::MAX_CAPACITY + 1] {
        assert!(matches!(
            fresh.set_capacity(bad),
            Err(Error::InvalidArgument(_))
        ));
    }
    assert_eq!(fresh.capacity(), 4);
}

/// Connections with client tracking on: a waiter's, once its first attempt ran.
fn tracking_clients(server: &support::TestServer) -> usize {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut server.client())
        .unwrap();
    list.lines().filter(|l| l.contains("flags=t")).count()
}

#[test]
fn lowering_the_capacity_drains_and_raising_it_wakes_a_waiter() {
    let _timed = timed();
    // A server of its own, so that its tracked connections are the waiter's.
    let server = support::TestServer::start();
    let coord = coordinator(&server.url(), "", NODE_TIMEOUT);
    let sem = coord.semaphore("{r}", 2).unwrap();
    let ttl = Duration::from_secs(10);
    let a = sem.try_acquire(ttl).unwrap().unwrap();
    let b = sem.try_acquire(ttl).unwrap().unwrap();
    assert_eq!((a.slot(), b.slot()), (0, 1));
    // Lowered to 1: both stay (never revoked), nobody new gets in.
    assert_eq!(sem.set_capacity(1).unwrap(), Some(2));
    assert!(a.verify_still_held().unwrap().is_some());
    assert!(b.verify_still_held().unwrap().is_some());
    assert!(sem.try_acquire(ttl).unwrap().is_none());
    assert_eq!(sem.available().unwrap(), 0);
    drop(a);
    assert!(sem.try_acquire(ttl).unwrap().is_none(), "still draining");
    drop(b);
    let c1 = sem.try_acquire(ttl).unwrap().unwrap();
    assert_eq!(c1.slot(), 0);
    // Raised while someone waits: the waiter is woken by the change.
    thread::scope(|s| {
        let waiter = s.spawn(|| {
            let p = sem.acquire_timeout(ttl, Duration::from_secs(5)).unwrap();
            (p, Instant::now())
        });
        wait_until(Duration::from_secs(5), "the waiter's first attempt", || {
            tracking_clients(&server) > 0
        });
        let raised = Instant::now();
        assert_eq!(sem.set_capacity(3).unwrap(), Some(1));
        let (p, at) = waiter.join().unwrap();
        let p = p.expect("admitted once the capacity was raised");
        assert_eq!(p.slot(), 1);
        let after = at - raised;
        // Reported, not asserted: a time is not a test's oracle.
        println!("a waiter got in {after:?} after the capacity was raised");
    });
}

#[test]
fn available_and_holders_are_pruned_not_stale() {
    let prefix = unique_prefix("observe");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let sem = coord.semaphore("{o}", 4).unwrap();
    let p = sem.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    let mut c = shared_server().client();
    // A crashed holder's permit that has expired, never pruned so far.
    let now = server_now(&mut c).0;
    let _: () = c
        .zadd(sem.permits_key(), "deadbeef:1:999", now - 1_000)
        .unwrap();
    assert_eq!(c.zcard::<_, u64>(sem.permits_key()).unwrap(), 2);
    let holders = sem.holders().unwrap();
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert_eq!(holders[0].slot, p.slot());
    assert_eq!(holders[0].fencing_token, p.fencing_token());
    assert!(holders[0].remaining > Duration::from_secs(25));
    assert_eq!(sem.available().unwrap(), 3);
    assert_eq!(c.zcard::<_, u64>(sem.permits_key()).unwrap(), 1, "pruned");
    let q = sem.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    assert_eq!(q.slot(), 1, "the expired permit's slot is free");
    assert_eq!(sem.available().unwrap(), 2);
    let text = format!("{q:?} {sem:?}");
    assert!(
        text.contains("Permit") && text.contains("slot_and_fencing_token"),
        "{text}"
    );
    assert!(
        text.contains("Semaphore") && text.contains("capacity: 4"),
        "{text}"
    );
}

#[test]
fn an_expired_permit_never_comes_back() {
    let prefix = unique_prefix("expired");
    let coord = Coordinator::builder(&shared_server().url())
        .key_prefix(&prefix)
        .node_timeout(ms(50))
        .build()
        .unwrap();
    let sem = coord.semaphore("{e}", 2).unwrap();
    let short = sem.try_acquire(ms(300)).unwrap().unwrap();
    let long = sem.try_acquire(Duration::from_secs(30)).unwrap().unwrap();
    let mut c = shared_server().client();
    let expiry = members(&mut c, sem.permits_key())
        .iter()
        .map(|m| m.1)
        .min()
        .unwrap();
    wait_until(Duration::from_secs(3), "the short permit's expiry", || {
        server_now(&mut c).0 > expiry
    });
    assert!(
        !short.reset_expiry(Duration::from_secs(30)).unwrap(),
        "it came back"
    );
    assert!(short.is_lost());
    assert_eq!(short.verify_still_held().unwrap(), None);
    assert_eq!(short.release().unwrap(), ReleaseOutcome::Expired);
    assert!(long.verify_still_held().unwrap().is_some());
    assert_eq!(sem.holders().unwrap().len(), 1);
}

#[test]
fn a_killed_holders_permit_is_freed_at_its_own_expiry_while_another_renews() {
    const TEST: &str = "a_killed_holders_permit_is_freed_at_its_own_expiry_while_another_renews";
    const TTL: Duration = Duration::from_secs(1);
    if std::env::var(CHILD_ENV).as_deref() == Ok("hold") {
        let coord = coordinator(
            &env("RESPIRE_SEM_URL"),
            &env("RESPIRE_SEM_PREFIX"),
            NODE_TIMEOUT,
        );
        let sem = coord.semaphore("{kill}", 2).unwrap();
        let p = sem.try_acquire(TTL).unwrap().unwrap();
        let _alive = p.keep_alive().unwrap();
        println!("@@held {}", p.slot());
        std::io::stdout().flush().unwrap();
        block_on_stdin();
        return;
    }
    let _timed = timed();
    let prefix = unique_prefix("kill");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let sem = coord.semaphore("{kill}", 2).unwrap();
    let waiter_coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let waiting = waiter_coord.semaphore("{kill}", 2).unwrap();
    let mut c = shared_server().client();
    let live = sem.try_acquire(TTL).unwrap().unwrap();
    let _alive = live.keep_alive().unwrap();
    let ours = members(&mut c, sem.permits_key());
    let mut child = ChildProc::spawn(
        CHILD_ENV,
        TEST,
        "hold",
        &[
            ("RESPIRE_SEM_URL", shared_server().url()),
            ("RESPIRE_SEM_PREFIX", prefix.clone()),
        ],
    );
    let slot: u32 = child.expect("held").parse().unwrap();
    assert!(waiting.try_acquire(TTL).unwrap().is_none(), "full");
    thread::scope(|s| {
        let waiter = s.spawn(|| {
            let p = waiting
                .acquire_timeout(TTL, Duration::from_secs(10))
                .unwrap()
                .expect("the waiter got in");
            (Instant::now(), p)
        });
        // Both holders renew a few times.
        let t = Instant::now();
        while t.elapsed() < ms(1_100) {
            assert!(!live.is_lost());
            thread::sleep(ms(10));
        }
        let killed = child.kill9();
        let clock = server_now(&mut c);
        let theirs = members(&mut c, sem.permits_key())
            .into_iter()
            .find(|m| !ours.iter().any(|o| o.0 == m.0))
            .expect("the killed holder's permit is still there");
        let expiry = local_instant(theirs.1, clock);
        let (granted, p) = waiter.join().unwrap();
        assert!(!live.is_lost(), "the other holder kept renewing");
        assert_eq!(p.slot(), slot, "the dead holder's slot");
        let after_kill = granted - killed;
        println!(
            "kill -9 of a permit holder (TTL {TTL:?}) while another renewed: the waiter got in \
             {after_kill:?} after the kill, {:?} after the dead permit's expiry",
            granted.saturating_duration_since(expiry)
        );
        // How soon after the expiry it got in is the figure above; that it
        // got in at all is its wait's deadline.
        assert!(
            granted + ms(3) >= expiry,
            "the waiter got in {:?} before the dead permit expired",
            expiry - granted
        );
    });
}

#[test]
fn one_thread_keeps_two_thousand_permits_alive_for_twenty_seconds() {
    const PERMITS: u32 = 2_000;
    const TTL: Duration = Duration::from_secs(4);
    const HOLD: Duration = Duration::from_secs(20);
    let prefix = unique_prefix("many");
    let coord = Coordinator::builder(&shared_server().url())
        .key_prefix(&prefix)
        .build()
        .unwrap();
    let sem = coord.semaphore("{many}", PERMITS).unwrap();
    let acquiring = Instant::now();
    let permits: Vec<_> = (0..PERMITS)
        .map(|_| sem.try_acquire(TTL).unwrap().expect("a free permit"))
        .collect();
    let acquired_in = acquiring.elapsed();
    assert!(sem.try_acquire(TTL).unwrap().is_none(), "full");
    let mut slots: Vec<u32> = permits.iter().map(|p| p.slot()).collect();
    slots.sort_unstable();
    assert!(slots.iter().copied().eq(0..PERMITS), "every slot once");
    let renewals: Vec<_> = permits.iter().map(|p| p.keep_alive().unwrap()).collect();
    let at_start = coord.renewal_stats();
    let started = Instant::now();
    while started.elapsed() < HOLD {
        thread::sleep(Duration::from_secs(1));
        let lost = permits.iter().filter(|p| p.is_lost()).count();
        assert_eq!(lost, 0, "{lost} permits lost after {:?}", started.elapsed());
    }
    let stats = coord.renewal_stats();
    let renewed = stats.renewals - at_start.renewals;
    let round_trips = stats.round_trips - at_start.round_trips;
    assert_eq!(stats.losses, 0);
    assert_eq!(stats.failures, 0);
    let expected = u64::from(PERMITS) * (HOLD.as_secs() / (TTL.as_secs() / 2) - 1);
    assert!(
        renewed >= expected,
        "only {renewed} renewals, expected {expected}"
    );
    assert!(
        round_trips * 50 < renewed,
        "{round_trips} round trips for {renewed} renewals"
    );
    assert_eq!(sem.holders().unwrap().len(), PERMITS as usize);
    assert_eq!(sem.available().unwrap(), 0);
    println!(
        "{PERMITS} permits acquired one by one in {acquired_in:?}, kept alive by one thread \
         for {HOLD:?}: {renewed} renewals in {round_trips} round trips ({:.0} per round \
         trip), none lost",
        renewed as f64 / round_trips as f64
    );
    drop(renewals);
    drop(permits);
    assert_eq!(sem.available().unwrap(), PERMITS);
}

#[test]
fn every_refusal_is_clear_and_changes_nothing() {
    let prefix = unique_prefix("refuse");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    for cap in [0, Semaphore::MAX_CAPACITY + 1, u32::MAX] {
        let e = coord.semaphore("{s}", cap).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{cap}: {e}");
        assert!(e.to_string().contains("capacity"), "{e}");
    }
    assert!(coord.semaphore("{s}", Semaphore::MAX_CAPACITY).is_ok());
    for base in ["", "jobs", "{}jobs", "jobs{", "}jobs{x"] {
        let e = coord.semaphore(base, 3).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{base:?}: {e}");
    }
    let sem = coord.semaphore("{ttl}", 3).unwrap();
    for ttl in [Duration::ZERO, NODE_TIMEOUT, MAX_TTL + ms(1), Duration::MAX] {
        for e in [
            sem.try_acquire(ttl).unwrap_err(),
            sem.acquire_timeout(ttl, ms(100)).unwrap_err(),
        ] {
            assert!(matches!(e, Error::InvalidArgument(_)), "{ttl:?}: {e}");
        }
    }
    let mut c = shared_server().client();
    assert!(
        c.keys::<_, Vec<String>>(format!("{prefix}*"))
            .unwrap()
            .is_empty()
    );

    // (what, setup on [permits, meta, slots], the key the error must name, a word)
    type Setup = fn(&mut redis::Connection, &[String; 3]);
    let cases: &[(&str, Setup, usize, &str)] = &[
        (
            "permits a string",
            |c, k| c.set(&k[0], "v").unwrap(),
            0,
            "string",
        ),
        (
            "permits a hash",
            |c, k| c.hset(&k[0], "f", "v").unwrap(),
            0,
            "hash",
        ),
        (
            "meta a string",
            |c, k| c.set(&k[1], "v").unwrap(),
            1,
            "string",
        ),
        (
            "meta a zset",
            |c, k| c.zadd(&k[1], "m", 1).unwrap(),
            1,
            "zset",
        ),
        (
            "meta with a ttl",
            |c, k| {
                c.hset::<_, _, _, ()>(&k[1], "capacity", 3).unwrap();
                c.expire::<_, ()>(&k[1], 100).unwrap();
            },
            1,
            "expiry",
        ),
        (
            "fence not an integer",
            |c, k| {
                c.hset_multiple(&k[1], &[("capacity", "3"), ("fence", "x")])
                    .unwrap()
            },
            1,
            "integer",
        ),
        (
            "fence negative",
            |c, k| {
                c.hset_multiple(&k[1], &[("capacity", "3"), ("fence", "-2")])
                    .unwrap()
            },
            1,
            "integer",
        ),
        (
            "slots a list",
            |c, k| c.rpush(&k[2], "v").unwrap(),
            2,
            "list",
        ),
        (
            "slots a hash",
            |c, k| c.hset(&k[2], "f", "v").unwrap(),
            2,
            "hash",
        ),
        (
            "capacity not an integer",
            |c, k| c.hset(&k[1], "capacity", "three").unwrap(),
            1,
            "capacity",
        ),
    ];
    for (i, (what, setup, bad, word)) in cases.iter().enumerate() {
        let base = format!("{{bad{i}}}");
        let sem = coord.semaphore(&base, 3).unwrap();
        let keys = [
            sem.permits_key().to_owned(),
            sem.meta_key().to_owned(),
            sem.slots_key().to_owned(),
        ];
        if *bad != 0 {
            // An expired permit: a script that wrote before checking would prune it.
            let now = server_now(&mut c).0;
            let _: () = c.zadd(&keys[0], "dead:0:1", now - 1_000).unwrap();
        }
        setup(&mut c, &keys);
        let scope = format!("{prefix}{base}");
        let before = snapshot(&mut c, &scope);
        let mut errors = vec![
            sem.try_acquire(Duration::from_secs(5)).unwrap_err(),
            sem.acquire_timeout(Duration::from_secs(5), ms(300))
                .unwrap_err(),
            sem.available().unwrap_err(),
            sem.holders().unwrap_err(),
        ];
        // Setting the capacity touches only the hash (and checks the permits).
        if *bad != 2 {
            errors.push(sem.set_capacity(4).unwrap_err());
        }
        for e in errors {
            match &e {
                Error::BadKey { key, problem } => {
                    assert_eq!(key, &keys[*bad], "{what}: {e}");
                    assert!(problem.contains(word), "{what}: {e}");
                    assert!(!problem.contains("KEYS["), "{what}: {e}");
                }
                other => panic!("{what}: expected BadKey, got {other}"),
            }
        }
        assert_eq!(
            snapshot(&mut c, &scope),
            before,
            "{what}: something changed"
        );
    }
}

/// The commands the reader/writer lease and the semaphore add to the ACL
/// minimum of the locks (README, "Connecting").
const RW_SEM_COMMANDS: &str = "+time +exists +zadd +zrem +zscore +zcard +zrange +zrangebyscore \
     +zremrangebyscore +pexpireat +pexpiretime +hget +hmget +hset +hdel +hincrby +setbit +bitpos";

#[test]
fn a_least_privilege_acl_user_can_use_both_primitives() {
    let server = support::TestServer::builder()
        .acl_user(format!(
            "user sharer on >pw resetkeys ~app:* resetchannels &__redis__:invalidate -@all \
             +ping +hello +auth +select +client|id +client|kill +client|tracking \
             +client|caching +client|setname +subscribe +eval +evalsha +type +get +set +pttl +pexpire +del \
             +incr {RW_SEM_COMMANDS}"
        ))
        .start();
    let coord = Coordinator::builder(&server.url_for_user("sharer", "pw"))
        .key_prefix("app:")
        .node_timeout(NODE_TIMEOUT)
        .build()
        .unwrap();
    let ttl = Duration::from_secs(2);
    let sem = coord.semaphore("{s}", 1).unwrap();
    let p = sem.try_acquire(ttl).unwrap().unwrap();
    let renewal = p.keep_alive().unwrap();
    assert!(p.verify_still_held().unwrap().is_some());
    assert!(p.reset_expiry(ttl).unwrap());
    assert_eq!(sem.available().unwrap(), 0);
    assert_eq!(sem.holders().unwrap().len(), 1);
    drop(renewal);
    thread::scope(|s| {
        let waiter = s.spawn(|| sem.acquire_timeout(ttl, Duration::from_secs(10)));
        wait_until(Duration::from_secs(5), "the waiter to register", || {
            tracking_clients(&server) > 0
        });
        assert_eq!(p.release().unwrap(), ReleaseOutcome::Released);
        assert!(waiter.join().unwrap().unwrap().is_some());
    });
    assert_eq!(sem.set_capacity(2).unwrap(), Some(1));

    let rw = coord.read_write_lease("{rw}").unwrap();
    let r = rw.read().try_acquire(ttl).unwrap().unwrap();
    let renewal = r.keep_alive().unwrap();
    assert!(r.verify_still_held().unwrap().is_some());
    drop(renewal);
    thread::scope(|s| {
        // Times out behind the reader: records, then withdraws, its intent.
        let w = s.spawn(|| rw.write().acquire_timeout(ttl, ms(300)));
        assert!(w.join().unwrap().unwrap().is_none());
    });
    assert_eq!(r.release().unwrap(), ReleaseOutcome::Released);
    let w = rw.write().try_acquire(ttl).unwrap().unwrap();
    let renewal = w.keep_alive().unwrap();
    assert_eq!(w.fencing_token().get(), 1);
    drop(renewal);
    assert_eq!(w.release().unwrap(), ReleaseOutcome::Released);
}

#[test]
fn a_permit_whose_grant_got_no_reply_is_released_afterwards() {
    let server = support::TestServer::start();
    let proxy = support::FaultProxy::start(server.addr());
    let coord = Coordinator::builder(&proxy.url())
        .node_timeout(NODE_TIMEOUT)
        .connect_timeout(ms(300))
        .build()
        .unwrap();
    let sem = coord.semaphore("{lost}", 2).unwrap();
    let ttl = Duration::from_secs(30);
    drop(sem.try_acquire(ttl).unwrap().unwrap());
    let mut c = server.client();
    proxy.set_mode(support::Mode::DropServerToClient);
    let e = sem.try_acquire(ttl).unwrap_err();
    assert!(e.is_uncertain(), "{e}");
    assert_eq!(c.zcard::<_, u64>(sem.permits_key()).unwrap(), 1, "granted");
    proxy.set_mode(support::Mode::Pass);
    wait_until(Duration::from_secs(10), "the clean-up", || {
        !c.exists::<_, bool>(sem.permits_key()).unwrap()
    });
    // Its index entry and slot went with it: both permits are free.
    assert_eq!(sem.available().unwrap(), 2);
    let a = sem.try_acquire(ttl).unwrap().unwrap();
    assert_eq!(a.slot(), 0);
    let fields: Vec<String> = c.hkeys(sem.meta_key()).unwrap();
    assert_eq!(
        fields.len(),
        3,
        "capacity, fence and one holder: {fields:?}"
    );
}
