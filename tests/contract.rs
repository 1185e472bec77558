//! One contract, three deployments: every case here runs against the fake
//! deployment (`test-util`, `on_the_fake::*`) and against a real server
//! (`on_the_server::*`: `redis-server` 7.0, or `valkey-server` 8.1 with
//! `RESPIRE_TEST_SERVER=valkey`), so that the fake cannot drift from what
//! servers do without a case failing on one side.
//!
//! The cases are behaviour a user's test relies on, seen through the public
//! API and checked on the deployment's own data (`PTTL`, `PEXPIRETIME`,
//! `TIME`, `EXISTS` on a raw connection of the test's): expiries to the
//! millisecond, contention, fencing tokens, semaphore slots, readers and
//! writers, sets of locks, waiters woken by a release (by tracking, and in
//! FIFO order), keep-alive, a lost lease found by a check, an election,
//! a Redlock quorum over three deployments, inspections and raw replies in
//! RESP2 and RESP3, what `INFO` and `ROLE` say, `CLIENT LIST` and a kill by
//! id and address. Time passes for real on both
//! sides (the fake's clock runs with the machine's); each case takes a
//! fraction of a second.
//! `tests/differential.rs` holds the model to `redis-server` command by
//! command; this suite holds the fake to every server by what a user sees.

mod support;
use support::ms;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use respire_coordination::fake::FakeDeployment;
use respire_coordination::{
    ContentionEvent, Coordinator, HeldAs, Observer, PollingEvent, Protocol, RenewalEvent,
};
use respire_coordination::{Fairness, RedlockGroup, RedlockOptions, ReleaseOutcome};
use support::{TestServer, client_list, shared_server, unique_prefix, wait_until};

/// Long enough for a loaded CI machine running many test binaries at once.
const NODE_TIMEOUT: Duration = Duration::from_millis(200);

/// A deployment under contract: its URL, a key prefix of the case's own,
/// and the fake behind it when it is one.
struct Target {
    url: String,
    prefix: String,
    _fake: Option<FakeDeployment>,
}

impl Target {
    fn fake(case: &str) -> Target {
        let fake = FakeDeployment::start().expect("a fake deployment");
        Target {
            url: fake.url().to_owned(),
            prefix: unique_prefix(case),
            _fake: Some(fake),
        }
    }

    fn server(case: &str) -> Target {
        Target {
            url: shared_server().url(),
            prefix: unique_prefix(case),
            _fake: None,
        }
    }

    fn coord_with(&self, observer: Option<Arc<dyn Observer>>) -> Coordinator {
        self.coord_over(Protocol::Resp2, observer)
    }

    fn coord_over(&self, protocol: Protocol, observer: Option<Arc<dyn Observer>>) -> Coordinator {
        let mut builder = Coordinator::builder(&self.url)
            .key_prefix(&self.prefix)
            .protocol(protocol)
            .node_timeout(NODE_TIMEOUT);
        if let Some(observer) = observer {
            builder = builder.observer(observer);
        }
        builder.build().expect("a coordinator")
    }

    fn coord(&self) -> Coordinator {
        self.coord_with(None)
    }

    /// A raw connection: the oracle's.
    fn raw(&self) -> redis::Connection {
        redis::Client::open(self.url.as_str())
            .and_then(|c| c.get_connection())
            .expect("a raw connection")
    }

    /// `n` more deployments of the same kind, independent of this one (for
    /// Redlock): their URLs, and what keeps them running.
    fn others(&self, n: usize) -> (Vec<String>, Vec<Box<dyn std::any::Any>>) {
        let mut urls = Vec::new();
        let mut keep: Vec<Box<dyn std::any::Any>> = Vec::new();
        for _ in 0..n {
            if self._fake.is_some() {
                let fake = FakeDeployment::start().expect("a fake deployment");
                urls.push(fake.url().to_owned());
                keep.push(Box::new(fake));
            } else {
                let server = TestServer::start();
                urls.push(server.url());
                keep.push(Box::new(server));
            }
        }
        (urls, keep)
    }

    /// A key under the case's prefix, as the coordinator names it.
    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }
}

fn pttl(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).expect("PTTL")
}

/// Asserts that `key` has at most `ttl` and more than `ttl - slack` left:
/// never more than it was given (an expiry rounded up shows), and not much
/// less (the slack covers the time since it was set).
fn assert_left(conn: &mut redis::Connection, key: &str, ttl: Duration, what: &str) {
    let slack = 250;
    let ttl = ttl.as_millis() as i64;
    let left = pttl(conn, key);
    assert!(
        left <= ttl && left > ttl - slack,
        "{what}: {key} has {left} ms left; it was given {ttl} ms"
    );
}

/// Counts contended attempts, confirmed renewals and falls back to polling.
#[derive(Default)]
struct Counts {
    contended: AtomicUsize,
    renewed: AtomicUsize,
    polling: AtomicUsize,
}

impl Observer for Counts {
    fn contended(&self, _: &ContentionEvent<'_>) {
        self.contended.fetch_add(1, Ordering::SeqCst);
    }
    fn renewed(&self, _: &RenewalEvent<'_>) {
        self.renewed.fetch_add(1, Ordering::SeqCst);
    }
    fn polling(&self, _: &PollingEvent<'_>) {
        self.polling.fetch_add(1, Ordering::SeqCst);
    }
}

// ----- the cases -----

fn grants_expire_to_the_millisecond_of_their_ttl(t: &Target) {
    let coord = t.coord();
    let mut conn = t.raw();
    let plain = coord.lock("plain").unwrap();
    let g = plain.try_acquire(ms(1_730)).unwrap().expect("free");
    assert_left(&mut conn, g.key(), ms(1_730), "plain grant");
    let fenced = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    let f = fenced.try_acquire(ms(1_270)).unwrap().expect("free");
    assert_left(&mut conn, f.key(), ms(1_270), "fenced grant");
    let rw = coord.read_write_lease("{rw}").unwrap();
    let w = rw.write().try_acquire(ms(2_310)).unwrap().expect("free");
    assert_left(&mut conn, w.key(), ms(2_310), "write grant");
}

fn extensions_set_the_time_left_to_the_millisecond(t: &Target) {
    let coord = t.coord();
    let mut conn = t.raw();
    let plain = coord.lock("plain").unwrap();
    let g = plain.try_acquire(ms(1_000)).unwrap().expect("free");
    assert!(g.reset_expiry(ms(2_750)).unwrap());
    assert_left(&mut conn, g.key(), ms(2_750), "plain extension");
    assert!(g.reset_expiry(ms(1_350)).unwrap());
    assert_left(&mut conn, g.key(), ms(1_350), "plain extension shortened");
    let fenced = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    let f = fenced.try_acquire(ms(1_000)).unwrap().expect("free");
    assert!(f.reset_expiry(ms(3_210)).unwrap());
    assert_left(&mut conn, f.key(), ms(3_210), "fenced extension");
}

fn a_lease_left_to_expire_is_lost_and_free_again(t: &Target) {
    let coord = t.coord();
    let mut conn = t.raw();
    let lock = coord.lock("short").unwrap();
    let g = lock.try_acquire(ms(400)).unwrap().expect("free");
    let key = g.key().to_owned();
    wait_until(ms(3_000), "the lease's expiry on the server", || {
        pttl(&mut conn, &key) == -2
    });
    assert!(
        g.is_lost(),
        "the server let the lease go, the guard holds it"
    );
    let again = lock.try_acquire(ms(1_000)).unwrap();
    assert!(again.is_some(), "the expired lease still blocks");
}

fn a_held_lock_is_contended_until_released(t: &Target) {
    let coord = t.coord();
    let other = t.coord();
    let mut conn = t.raw();
    let mine = coord.lock("held").unwrap();
    let theirs = other.lock("held").unwrap();
    let g = mine.try_acquire(ms(5_000)).unwrap().expect("free");
    assert!(theirs.try_acquire(ms(5_000)).unwrap().is_none());
    let key = g.key().to_owned();
    g.release().unwrap();
    let exists: i64 = redis::cmd("EXISTS").arg(&key).query(&mut conn).unwrap();
    assert_eq!(exists, 0, "released, the key stays");
    assert!(theirs.try_acquire(ms(5_000)).unwrap().is_some());
}

fn fencing_tokens_rise_with_every_grant(t: &Target) {
    let coord = t.coord();
    let lock = coord.fenced_lock("{t}:lease", "{t}:fence").unwrap();
    let mut last = 0;
    for _ in 0..4 {
        let g = lock.try_acquire(ms(1_000)).unwrap().expect("free");
        let token = g.fencing_token().get();
        assert!(token > last, "token {token} after {last}");
        last = token;
        g.release().unwrap();
    }
    let mut conn = t.raw();
    let counter: u64 = redis::cmd("GET")
        .arg(t.key("{t}:fence"))
        .query(&mut conn)
        .unwrap();
    assert_eq!(counter, last, "the counter holds the last token");
}

fn a_semaphore_admits_its_capacity_in_distinct_slots(t: &Target) {
    let coord = t.coord();
    let sem = coord.semaphore("{sem}", 2).unwrap();
    let a = sem.try_acquire(ms(2_000)).unwrap().expect("a first permit");
    let b = sem
        .try_acquire(ms(2_000))
        .unwrap()
        .expect("a second permit");
    assert_ne!(a.slot(), b.slot());
    assert!(a.slot() < 2 && b.slot() < 2);
    assert!(sem.try_acquire(ms(2_000)).unwrap().is_none(), "a third");
    let freed = a.slot();
    a.release().unwrap();
    let c = sem
        .try_acquire(ms(2_000))
        .unwrap()
        .expect("the freed permit");
    assert_eq!(c.slot(), freed);
    assert!(c.fencing_token().get() > b.fencing_token().get());
}

fn readers_share_and_exclude_a_writer(t: &Target) {
    let coord = t.coord();
    let rw = coord.read_write_lease("{doc}").unwrap();
    let r1 = rw.read().try_acquire(ms(2_000)).unwrap().expect("a reader");
    let r2 = rw
        .read()
        .try_acquire(ms(2_000))
        .unwrap()
        .expect("a second reader");
    assert!(rw.write().try_acquire(ms(2_000)).unwrap().is_none());
    r1.release().unwrap();
    r2.release().unwrap();
    let w = rw
        .write()
        .try_acquire(ms(2_000))
        .unwrap()
        .expect("the writer");
    assert!(rw.read().try_acquire(ms(2_000)).unwrap().is_none());
    let epoch = w.fencing_token().get();
    w.release().unwrap();
    let r3 = rw
        .read()
        .try_acquire(ms(2_000))
        .unwrap()
        .expect("a reader again");
    assert_eq!(
        r3.write_epoch().get(),
        epoch,
        "the reader learns the last write"
    );
}

fn a_set_of_locks_is_taken_all_or_nothing(t: &Target) {
    let coord = t.coord();
    let mut conn = t.raw();
    let one = coord.lock("{set}:b").unwrap();
    let held = one.try_acquire(ms(5_000)).unwrap().expect("free");
    let all = coord.lock_all(&["{set}:a", "{set}:b"]).unwrap();
    assert!(all.try_acquire(ms(5_000)).unwrap().is_none());
    let exists: i64 = redis::cmd("EXISTS")
        .arg(t.key("{set}:a"))
        .query(&mut conn)
        .unwrap();
    assert_eq!(exists, 0, "a refused set leaves none of its keys held");
    held.release().unwrap();
    let both = all.try_acquire(ms(5_000)).unwrap().expect("both free");
    drop(both);
}

fn a_waiter_is_woken_by_the_release(t: &Target) {
    let counts = Arc::new(Counts::default());
    let holder = t.coord();
    let waiter = t.coord_with(Some(counts.clone()));
    let held = holder
        .lock("wake")
        .unwrap()
        .try_acquire(ms(20_000))
        .unwrap()
        .expect("free");
    let lock = waiter.lock("wake").unwrap();
    std::thread::scope(|s| {
        let waiting = s.spawn(|| {
            let got = lock.acquire_timeout(ms(5_000), ms(10_000)).unwrap();
            (got.is_some(), Instant::now())
        });
        wait_until(ms(5_000), "the waiter finds the lock held", || {
            counts.contended.load(Ordering::SeqCst) >= 1
        });
        let released = Instant::now();
        held.release().unwrap();
        let (got, at) = waiting.join().unwrap();
        assert!(got, "the waiter never got the lock");
        let after = at.duration_since(released);
        assert!(
            after < ms(5_000),
            "the waiter got the lock {after:?} after the release"
        );
    });
    assert_eq!(
        counts.polling.load(Ordering::SeqCst),
        0,
        "the waiter polled: invalidations did not work"
    );
}

fn tracking_sends_an_invalidation_for_a_key_read_after_caching_yes(t: &Target) {
    let key = t.key("tracked");
    let mut listener = t.raw();
    let id: u64 = redis::cmd("CLIENT").arg("ID").query(&mut listener).unwrap();
    let mut reader = t.raw();
    let (): () = redis::cmd("CLIENT")
        .arg("TRACKING")
        .arg("ON")
        .arg("REDIRECT")
        .arg(id)
        .arg("OPTIN")
        .query(&mut reader)
        .unwrap();
    let (_, value): ((), Option<String>) = redis::pipe()
        .cmd("CLIENT")
        .arg("CACHING")
        .arg("yes")
        .cmd("GET")
        .arg(&key)
        .query(&mut reader)
        .unwrap();
    assert_eq!(value, None);
    let mut pubsub = listener.as_pubsub();
    pubsub.subscribe("__redis__:invalidate").unwrap();
    pubsub.set_read_timeout(Some(ms(2_000))).unwrap();
    let mut writer = t.raw();
    let (): () = redis::cmd("SET")
        .arg(&key)
        .arg("v")
        .query(&mut writer)
        .unwrap();
    let msg = pubsub.get_message().expect("an invalidation");
    assert_eq!(msg.get_channel_name(), "__redis__:invalidate");
    let keys: Vec<String> = msg.get_payload().unwrap();
    assert_eq!(keys, vec![key]);
}

fn keep_alive_holds_a_lease_past_its_ttl(t: &Target) {
    let counts = Arc::new(Counts::default());
    let coord = t.coord_with(Some(counts.clone()));
    let mut conn = t.raw();
    let lock = coord.lock("kept").unwrap();
    // About the shortest TTL keep-alive takes with this node timeout.
    let ttl = ms(900);
    let g = lock.try_acquire(ttl).unwrap().expect("free");
    let _renewal = g.keep_alive().unwrap();
    let started = Instant::now();
    wait_until(ms(5_000), "two renewals", || {
        let left = pttl(&mut conn, g.key());
        assert!(left > 0, "a kept-alive lease ran out on the server");
        counts.renewed.load(Ordering::SeqCst) >= 2
    });
    assert!(
        started.elapsed() > ttl / 2,
        "renewed faster than half the TTL"
    );
    assert!(!g.is_lost());
    assert_left(&mut conn, g.key(), ttl, "after renewals");
}

fn a_check_finds_a_deleted_lease_lost(t: &Target) {
    let coord = t.coord();
    let mut conn = t.raw();
    let lock = coord.fenced_lock("{v}:lease", "{v}:fence").unwrap();
    let g = lock.try_acquire(ms(4_000)).unwrap().expect("free");
    let left = g.verify_still_held().unwrap().expect("held");
    assert!(left <= ms(4_000) && left > ms(3_500), "{left:?}");
    let _: i64 = redis::cmd("DEL").arg(g.key()).query(&mut conn).unwrap();
    assert_eq!(g.verify_still_held().unwrap(), None);
    assert!(g.is_lost());
}

fn expiry_commands_agree_with_the_servers_time(t: &Target) {
    let mut conn = t.raw();
    let key = t.key("raw");
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("v")
        .arg("PX")
        .arg(1_234)
        .query(&mut conn)
        .unwrap();
    let (at, (secs, micros)): (i64, (i64, i64)) = redis::pipe()
        .atomic()
        .cmd("PEXPIRETIME")
        .arg(&key)
        .cmd("TIME")
        .query(&mut conn)
        .unwrap();
    let left = at - (secs * 1_000 + micros / 1_000);
    assert!(left <= 1_234 && left > 1_000, "PEXPIRETIME - TIME = {left}");
    let set: i64 = redis::cmd("PEXPIRE")
        .arg(&key)
        .arg(2_345)
        .query(&mut conn)
        .unwrap();
    assert_eq!(set, 1);
    assert_left(&mut conn, &key, ms(2_345), "PEXPIRE");
    let not_greater: i64 = redis::cmd("PEXPIRE")
        .arg(&key)
        .arg(500)
        .arg("GT")
        .query(&mut conn)
        .unwrap();
    assert_eq!(not_greater, 0);
    assert_left(&mut conn, &key, ms(2_345), "PEXPIRE GT refused");
    let gone: i64 = redis::cmd("PEXPIRE")
        .arg(&key)
        .arg(0)
        .query(&mut conn)
        .unwrap();
    assert_eq!(gone, 1);
    assert_eq!(pttl(&mut conn, &key), -2, "PEXPIRE 0 deletes");
    let missing: i64 = redis::cmd("PEXPIRE")
        .arg(&key)
        .arg(1_000)
        .query(&mut conn)
        .unwrap();
    assert_eq!(missing, 0);
}

fn inspections_read_every_holder_in_either_protocol(t: &Target) {
    for protocol in [Protocol::Resp2, Protocol::Resp3] {
        let coord = t.coord_over(protocol, None);
        let base = format!("{{i{protocol:?}}}");
        let sem = coord.semaphore(&base, 3).unwrap();
        let a = sem.try_acquire(ms(2_000)).unwrap().expect("a permit");
        let b = sem.try_acquire(ms(3_000)).unwrap().expect("a permit");
        let seen = coord.inspect(&base).unwrap();
        assert_eq!(seen.held_as(), HeldAs::Counted, "{protocol:?}");
        assert_eq!(seen.permits.len(), 2, "{protocol:?}");
        assert_eq!(seen.capacity, Some(3), "{protocol:?}");
        assert_eq!(
            seen.last_permit_token.map(|t| t.get()),
            Some(b.fencing_token().get()),
            "{protocol:?}"
        );
        a.release().unwrap();
        b.release().unwrap();
        let rw_base = format!("{{rw{protocol:?}}}");
        let rw = coord.read_write_lease(&rw_base).unwrap();
        let r = rw.read().try_acquire(ms(2_000)).unwrap().expect("a reader");
        let seen = coord.inspect(&rw_base).unwrap();
        assert_eq!(seen.held_as(), HeldAs::Shared, "{protocol:?}");
        assert_eq!(seen.readers.len(), 1, "{protocol:?}");
        assert!(seen.readers[0].remaining <= ms(2_000), "{protocol:?}");
        let left = r.verify_still_held().unwrap().expect("held");
        assert!(
            left <= ms(2_000) && left > ms(1_500),
            "{protocol:?}: {left:?}"
        );
    }
}

fn raw_replies_take_the_shapes_of_the_protocol(t: &Target) {
    use redis::Value;
    let z = t.key("{shape}:z");
    let h = t.key("{shape}:h");
    for resp3 in [false, true] {
        let url = if resp3 {
            format!("{}?protocol=resp3", t.url)
        } else {
            t.url.clone()
        };
        let mut conn = redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection())
            .expect("a raw connection");
        let _: () = redis::pipe()
            .cmd("ZADD")
            .arg(&z)
            .arg(1.5)
            .arg("m")
            .ignore()
            .cmd("HSET")
            .arg(&h)
            .arg("f")
            .arg("v")
            .ignore()
            .query(&mut conn)
            .unwrap();
        let range: Value = redis::cmd("ZRANGE")
            .arg(&z)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query(&mut conn)
            .unwrap();
        let score: Value = redis::cmd("ZSCORE")
            .arg(&z)
            .arg("m")
            .query(&mut conn)
            .unwrap();
        let hash: Value = redis::cmd("HGETALL").arg(&h).query(&mut conn).unwrap();
        let missing: Value = redis::cmd("GET")
            .arg(t.key("none"))
            .query(&mut conn)
            .unwrap();
        let m = || Value::BulkString(b"m".to_vec());
        let (f, v) = (
            Value::BulkString(b"f".to_vec()),
            Value::BulkString(b"v".to_vec()),
        );
        if resp3 {
            assert_eq!(
                range,
                Value::Array(vec![Value::Array(vec![m(), Value::Double(1.5)])])
            );
            assert_eq!(score, Value::Double(1.5));
            assert_eq!(hash, Value::Map(vec![(f, v)]));
        } else {
            let text = Value::BulkString(b"1.5".to_vec());
            assert_eq!(range, Value::Array(vec![m(), text.clone()]));
            assert_eq!(score, text);
            assert_eq!(hash, Value::Array(vec![f, v]));
        }
        assert_eq!(missing, Value::Nil, "resp3: {resp3}");
    }
}

fn the_server_says_its_version_role_and_uptime(t: &Target) {
    let mut conn = t.raw();
    let info: String = redis::cmd("INFO").arg("server").query(&mut conn).unwrap();
    let field = |text: &str, name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::to_owned)
    };
    let version = field(&info, "redis_version").expect("redis_version");
    let major: u32 = version.split('.').next().unwrap().parse().unwrap();
    assert!(major >= 7, "redis_version {version}");
    let uptime: u64 = field(&info, "uptime_in_seconds")
        .expect("uptime_in_seconds")
        .parse()
        .unwrap();
    assert!(uptime < 86_400, "uptime {uptime}");
    let replication: String = redis::cmd("INFO")
        .arg("replication")
        .query(&mut conn)
        .unwrap();
    assert_eq!(field(&replication, "role").as_deref(), Some("master"));
    let role: redis::Value = redis::cmd("ROLE").query(&mut conn).unwrap();
    let redis::Value::Array(role) = role else {
        panic!("ROLE answered {role:?}");
    };
    assert_eq!(role[0], redis::Value::BulkString(b"master".to_vec()));
}

fn an_election_has_one_leader_and_its_terms_rise(t: &Target) {
    let one = t.coord();
    let two = t.coord();
    let first = one.election("{vote}").unwrap();
    let second = two.election("{vote}").unwrap();
    let leader = first
        .try_campaign("one", ms(3_000))
        .unwrap()
        .expect("no leader yet");
    assert!(second.try_campaign("two", ms(3_000)).unwrap().is_none());
    let seen = second.leader().unwrap().expect("a leader");
    assert_eq!(seen.value.as_deref(), Some("one"));
    assert_eq!(seen.term.get(), leader.term().get());
    assert!(leader.proclaim("one, again").unwrap());
    let seen = second.leader().unwrap().expect("a leader");
    assert_eq!(seen.value.as_deref(), Some("one, again"));
    let term = leader.term().get();
    leader.resign().unwrap();
    assert!(
        second.leader().unwrap().is_none(),
        "a leader after resigning"
    );
    let next = second
        .try_campaign("two", ms(3_000))
        .unwrap()
        .expect("free after the resignation");
    assert!(next.term().get() > term);
}

fn fifo_waiters_get_the_lock_in_the_order_they_came(t: &Target) {
    let holder = t.coord();
    let fair = |c: &Coordinator| {
        c.lock("{fifo}")
            .unwrap()
            .with_fairness(Fairness::Fifo {
                entry_ttl: ms(2_000),
            })
            .unwrap()
    };
    let queue = format!("{}:queue", t.key("{fifo}"));
    let mut raw = t.raw();
    let held = fair(&holder)
        .try_acquire(ms(10_000))
        .unwrap()
        .expect("free");
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::scope(|s| {
        let mut coords = Vec::new();
        for _ in 0..2 {
            coords.push(t.coord());
        }
        for (i, coord) in coords.iter().enumerate() {
            let tx = tx.clone();
            let lock = fair(coord);
            s.spawn(move || {
                let g = lock
                    .acquire_timeout(ms(5_000), ms(10_000))
                    .unwrap()
                    .expect("granted in turn");
                tx.send(i).unwrap();
                g.release().unwrap();
            });
            // The next waiter comes after this one queued: a wait's first
            // attempt, the one reported contended, does not queue; its next
            // one joins the tail. The queue on the deployment says.
            wait_until(ms(5_000), "the waiter queues", || {
                redis::cmd("ZCARD")
                    .arg(&queue)
                    .query::<usize>(&mut raw)
                    .expect("ZCARD")
                    > i
            });
        }
        held.release().unwrap();
    });
    let order: Vec<usize> = rx.try_iter().collect();
    assert_eq!(order, vec![0, 1], "served out of order");
}

fn a_redlock_quorum_grants_and_releases_on_every_node(t: &Target) {
    let (mut urls, _keep) = t.others(2);
    urls.insert(0, t.url.clone());
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    // A group checks every node's round trip against its node timeout when
    // it is made: room for a loaded machine.
    let options = || RedlockOptions {
        node_timeout: ms(500),
        ..RedlockOptions::default()
    };
    let group = RedlockGroup::connect(&urls, options()).unwrap();
    let other = RedlockGroup::connect(&urls, options()).unwrap();
    let key = t.key("redlock");
    let ttl = ms(3_000);
    let guard = group
        .lock(&key)
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .expect("free");
    let mut conns: Vec<redis::Connection> = urls
        .iter()
        .map(|u| redis::Client::open(*u).unwrap().get_connection().unwrap())
        .collect();
    for conn in &mut conns {
        assert_left(conn, &key, ttl, "a node's grant");
    }
    assert!(
        other
            .lock(&key)
            .unwrap()
            .try_acquire(ttl)
            .unwrap()
            .is_none()
    );
    assert!(guard.reset_expiry(ms(4_500)).unwrap());
    // The extension returns once a quorum answered, as the release does.
    wait_until(ms(2_000), "the extension on every node", || {
        conns.iter_mut().all(|conn| pttl(conn, &key) > 3_000)
    });
    for conn in &mut conns {
        assert_left(conn, &key, ms(4_500), "a node's extension");
    }
    assert_eq!(
        guard.release().unwrap(),
        ReleaseOutcome::Released,
        "a quorum still held it"
    );
    // The release returns once a quorum answered; the last node's answer
    // may still be on its way.
    wait_until(ms(2_000), "the key gone from every node", || {
        conns.iter_mut().all(|conn| pttl(conn, &key) == -2)
    });
    assert!(
        other
            .lock(&key)
            .unwrap()
            .try_acquire(ttl)
            .unwrap()
            .is_some()
    );
}

fn a_connection_is_killed_by_its_id_and_address_only(t: &Target) {
    let mut victim = t.raw();
    let name = format!("victim-{}", t.prefix.replace(':', "-"));
    let (): () = redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg(&name)
        .query(&mut victim)
        .unwrap();
    let id: u64 = redis::cmd("CLIENT").arg("ID").query(&mut victim).unwrap();
    let mut killer = t.raw();
    let listed = client_list(&mut killer);
    let entry = listed
        .iter()
        .find(|c| c.get("id").map(String::as_str) == Some(id.to_string().as_str()))
        .expect("the connection is listed by its id");
    assert_eq!(entry.get("name"), Some(&name));
    let addr = entry.get("addr").expect("an address").clone();
    let kill = |conn: &mut redis::Connection, addr: &str| -> i64 {
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .arg("ADDR")
            .arg(addr)
            .arg("SKIPME")
            .arg("yes")
            .query(conn)
            .unwrap()
    };
    assert_eq!(
        kill(&mut killer, "127.0.0.1:1"),
        0,
        "killed at another address"
    );
    let alive: String = redis::cmd("PING").query(&mut victim).unwrap();
    assert_eq!(alive, "PONG");
    assert_eq!(kill(&mut killer, &addr), 1);
    let after: redis::RedisResult<String> = redis::cmd("PING").query(&mut victim);
    assert!(after.is_err(), "a killed connection answered {after:?}");
}

/// Each case once on the fake and once on the real server.
macro_rules! contract {
    ($($case:ident),* $(,)?) => {
        mod on_the_fake {
            $(
                #[test]
                fn $case() {
                    super::$case(&super::Target::fake(stringify!($case)));
                }
            )*
        }
        mod on_the_server {
            $(
                #[test]
                fn $case() {
                    super::$case(&super::Target::server(stringify!($case)));
                }
            )*
        }
    };
}

contract!(
    grants_expire_to_the_millisecond_of_their_ttl,
    extensions_set_the_time_left_to_the_millisecond,
    a_lease_left_to_expire_is_lost_and_free_again,
    a_held_lock_is_contended_until_released,
    fencing_tokens_rise_with_every_grant,
    a_semaphore_admits_its_capacity_in_distinct_slots,
    readers_share_and_exclude_a_writer,
    a_set_of_locks_is_taken_all_or_nothing,
    a_waiter_is_woken_by_the_release,
    keep_alive_holds_a_lease_past_its_ttl,
    a_check_finds_a_deleted_lease_lost,
    expiry_commands_agree_with_the_servers_time,
    inspections_read_every_holder_in_either_protocol,
    raw_replies_take_the_shapes_of_the_protocol,
    tracking_sends_an_invalidation_for_a_key_read_after_caching_yes,
    the_server_says_its_version_role_and_uptime,
    an_election_has_one_leader_and_its_terms_rise,
    fifo_waiters_get_the_lock_in_the_order_they_came,
    a_redlock_quorum_grants_and_releases_on_every_node,
    a_connection_is_killed_by_its_id_and_address_only,
);
