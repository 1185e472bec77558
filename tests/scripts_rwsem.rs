//! The server-side scripts of the reader/writer lease and the semaphore, run
//! directly against a real server: grants, busy replies and wait hints, writer
//! preference, per-member expiry, fencing tokens as exact strings, idempotent
//! retries, capacity rules, refusals that change nothing, and the client-tracking
//! invalidations that wake waiters.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::{Commands, Value};
use support::{TestServer, server_now, shared_server, snapshot, unique_prefix, wait_until};

// ---------------------------------------------------------------------------
// Running the scripts
// ---------------------------------------------------------------------------

/// A script's source and SHA1.
struct Lua {
    code: &'static str,
    sha: String,
}

macro_rules! lua {
    ($name:literal) => {
        Lua::new(include_str!(concat!("../src/scripts/", $name, ".lua")))
    };
}

impl Lua {
    fn new(code: &'static str) -> Lua {
        Lua {
            code,
            sha: redis::Script::new(code).get_hash().to_owned(),
        }
    }

    /// EVALSHA, and EVAL when the server does not have the script yet.
    fn run(
        &self,
        conn: &mut redis::Connection,
        keys: &[&str],
        args: &[&str],
    ) -> redis::RedisResult<Value> {
        let result = redis::cmd("EVALSHA")
            .arg(&self.sha)
            .arg(keys.len())
            .arg(keys)
            .arg(args)
            .query(conn);
        match result {
            Err(e) if e.code() == Some("NOSCRIPT") => redis::cmd("EVAL")
                .arg(self.code)
                .arg(keys.len())
                .arg(keys)
                .arg(args)
                .query(conn),
            other => other,
        }
    }

    /// Runs the script and panics on an error reply.
    #[track_caller]
    fn ok(&self, conn: &mut redis::Connection, keys: &[&str], args: &[&str]) -> Value {
        self.run(conn, keys, args)
            .unwrap_or_else(|e| panic!("script failed with keys {keys:?} args {args:?}: {e}"))
    }

    /// Runs the script and returns its error reply.
    #[track_caller]
    fn err(&self, conn: &mut redis::Connection, keys: &[&str], args: &[&str]) -> redis::RedisError {
        match self.run(conn, keys, args) {
            Err(e) => e,
            Ok(v) => panic!("expected an error reply for keys {keys:?} args {args:?}, got {v:?}"),
        }
    }
}

struct Scripts {
    read_acquire: Lua,
    read_extend: Lua,
    read_verify: Lua,
    read_release: Lua,
    write_acquire: Lua,
    write_withdraw: Lua,
    write_clean_up: Lua,
    lease_extend: Lua,
    lease_verify: Lua,
    lease_release: Lua,
    sem_acquire: Lua,
    sem_extend: Lua,
    sem_verify: Lua,
    sem_release: Lua,
    sem_set_capacity: Lua,
    sem_status: Lua,
}

fn scripts() -> &'static Scripts {
    static SCRIPTS: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(|| Scripts {
        read_acquire: lua!("rw_read_acquire"),
        read_extend: lua!("rw_read_extend"),
        read_verify: lua!("rw_read_verify"),
        read_release: lua!("rw_read_release"),
        write_acquire: lua!("rw_write_acquire"),
        write_withdraw: lua!("rw_write_withdraw"),
        write_clean_up: lua!("rw_write_clean_up"),
        lease_extend: lua!("lease_extend"),
        lease_verify: lua!("lease_verify"),
        lease_release: lua!("lease_release"),
        sem_acquire: lua!("sem_acquire"),
        sem_extend: lua!("sem_extend"),
        sem_verify: lua!("sem_verify"),
        sem_release: lua!("sem_release"),
        sem_set_capacity: lua!("sem_set_capacity"),
        sem_status: lua!("sem_status"),
    })
}

// ---------------------------------------------------------------------------
// Replies
// ---------------------------------------------------------------------------

/// The reply of a read or write acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Grant {
    /// The write epoch (reader) or the fencing token (writer), as sent: a string.
    Granted(String),
    /// The wait hint in ms.
    Busy(i64),
}

impl Grant {
    #[track_caller]
    fn token(&self) -> &str {
        match self {
            Grant::Granted(t) => t,
            Grant::Busy(h) => panic!("expected a grant, got busy with hint {h}"),
        }
    }

    #[track_caller]
    fn hint(&self) -> i64 {
        match self {
            Grant::Busy(h) => *h,
            Grant::Granted(t) => panic!("expected busy, got a grant with {t}"),
        }
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).expect("utf-8"),
        other => panic!("expected a bulk string (tokens travel as strings), got {other:?}"),
    }
}

#[track_caller]
fn grant(v: Value) -> Grant {
    match v {
        Value::Array(items) => match items.as_slice() {
            [Value::Int(1), token] => Grant::Granted(text(token)),
            [Value::Int(0), Value::Int(hint)] => Grant::Busy(*hint),
            other => panic!("unexpected acquire reply {other:?}"),
        },
        other => panic!("unexpected acquire reply {other:?}"),
    }
}

/// The reply of a semaphore acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PermitReply {
    Granted { slot: i64, token: String },
    Busy(i64),
}

impl PermitReply {
    #[track_caller]
    fn granted(&self) -> (i64, &str) {
        match self {
            PermitReply::Granted { slot, token } => (*slot, token),
            PermitReply::Busy(h) => panic!("expected a permit, got busy with hint {h}"),
        }
    }

    #[track_caller]
    fn hint(&self) -> i64 {
        match self {
            PermitReply::Busy(h) => *h,
            other => panic!("expected busy, got {other:?}"),
        }
    }
}

#[track_caller]
fn permit(v: Value) -> PermitReply {
    match v {
        Value::Array(items) => match items.as_slice() {
            [Value::Int(1), Value::Int(slot), token] => PermitReply::Granted {
                slot: *slot,
                token: text(token),
            },
            [Value::Int(0), Value::Int(hint)] => PermitReply::Busy(*hint),
            other => panic!("unexpected sem_acquire reply {other:?}"),
        },
        other => panic!("unexpected sem_acquire reply {other:?}"),
    }
}

#[track_caller]
fn int(v: Value) -> i64 {
    match v {
        Value::Int(n) => n,
        other => panic!("expected an integer, got {other:?}"),
    }
}

/// `{1, remaining}` → `Some(remaining)`; `{0}` → `None`.
#[track_caller]
fn verified(v: Value) -> Option<i64> {
    match v {
        Value::Array(items) => match items.as_slice() {
            [Value::Int(1), Value::Int(left)] => Some(*left),
            [Value::Int(0)] => None,
            other => panic!("unexpected verify reply {other:?}"),
        },
        other => panic!("unexpected verify reply {other:?}"),
    }
}

/// The decoded reply of `sem_status`.
#[derive(Debug)]
struct Status {
    capacity: i64,
    holders: Vec<(String, i64)>,
}

#[track_caller]
fn status(v: Value) -> Status {
    let Value::Array(items) = v else {
        panic!("unexpected sem_status reply {v:?}")
    };
    let [Value::Int(capacity), Value::Int(count), rest @ ..] = items.as_slice() else {
        panic!("unexpected sem_status reply {items:?}")
    };
    let holders: Vec<(String, i64)> = rest
        .chunks(2)
        .map(|pair| match pair {
            [member, Value::Int(left)] => (text(member), *left),
            other => panic!("unexpected sem_status entry {other:?}"),
        })
        .collect();
    assert_eq!(
        *count as usize,
        holders.len(),
        "count disagrees with the list"
    );
    Status {
        capacity: *capacity,
        holders,
    }
}

/// `owner:slot:token` → (owner, slot, token).
fn parse_member(m: &str) -> (&str, i64, u64) {
    let mut parts = m.rsplitn(3, ':');
    let token = parts.next().unwrap().parse().unwrap();
    let slot = parts.next().unwrap().parse().unwrap();
    (parts.next().unwrap(), slot, token)
}

// ---------------------------------------------------------------------------
// Keys and state
// ---------------------------------------------------------------------------

/// The four keys of one reader/writer lease.
struct RwKeys {
    prefix: String,
    w: String,
    r: String,
    q: String,
    fence: String,
}

impl RwKeys {
    fn new(test: &str) -> RwKeys {
        let prefix = unique_prefix(test);
        let base = format!("{prefix}{{rw}}");
        RwKeys {
            w: format!("{base}:w"),
            r: format!("{base}:r"),
            q: format!("{base}:q"),
            fence: format!("{base}:fence"),
            prefix,
        }
    }

    fn all(&self) -> [&str; 4] {
        [&self.w, &self.r, &self.q, &self.fence]
    }

    fn read(&self, conn: &mut redis::Connection, owner: &str, ttl: u64, pref: &str) -> Grant {
        grant(
            scripts()
                .read_acquire
                .ok(conn, &self.all(), &[owner, &ttl.to_string(), pref]),
        )
    }

    fn write(&self, conn: &mut redis::Connection, owner: &str, ttl: u64, intent: u64) -> Grant {
        grant(scripts().write_acquire.ok(
            conn,
            &self.all(),
            &[owner, &ttl.to_string(), &intent.to_string()],
        ))
    }

    fn release_writer(&self, conn: &mut redis::Connection, owner: &str, token: &str) -> i64 {
        int(scripts()
            .lease_release
            .ok(conn, &[&self.w], &[&format!("{owner}:{token}"), "exact"]))
    }

    fn withdraw(&self, conn: &mut redis::Connection, owner: &str) -> i64 {
        int(scripts().write_withdraw.ok(conn, &[&self.q], &[owner]))
    }

    fn read_extend(&self, conn: &mut redis::Connection, owner: &str, ttl: u64) -> i64 {
        int(scripts()
            .read_extend
            .ok(conn, &[&self.r], &[owner, &ttl.to_string()]))
    }

    fn read_verify(&self, conn: &mut redis::Connection, owner: &str) -> Option<i64> {
        verified(scripts().read_verify.ok(conn, &[&self.r], &[owner]))
    }

    fn read_release(&self, conn: &mut redis::Connection, owner: &str) -> i64 {
        int(scripts().read_release.ok(conn, &[&self.r], &[owner]))
    }
}

/// The three keys of one semaphore.
struct SemKeys {
    prefix: String,
    permits: String,
    meta: String,
    slots: String,
}

impl SemKeys {
    fn new(test: &str) -> SemKeys {
        let prefix = unique_prefix(test);
        let base = format!("{prefix}{{sem}}");
        SemKeys {
            permits: format!("{base}:permits"),
            meta: format!("{base}:meta"),
            slots: format!("{base}:slots"),
            prefix,
        }
    }

    /// Permits, meta, slots: the keys of acquire, extend, release and status.
    fn all(&self) -> [&str; 3] {
        [&self.permits, &self.meta, &self.slots]
    }

    fn acquire(
        &self,
        conn: &mut redis::Connection,
        owner: &str,
        ttl: u64,
        cap: u32,
    ) -> PermitReply {
        permit(scripts().sem_acquire.ok(
            conn,
            &self.all(),
            &[owner, &ttl.to_string(), &cap.to_string()],
        ))
    }

    fn member(owner: &str, reply: &PermitReply) -> String {
        let (slot, token) = reply.granted();
        format!("{owner}:{slot}:{token}")
    }

    fn release(&self, conn: &mut redis::Connection, member: &str) -> i64 {
        int(scripts()
            .sem_release
            .ok(conn, &self.all(), &[member, "exact"]))
    }

    fn release_owner(&self, conn: &mut redis::Connection, owner: &str) -> i64 {
        int(scripts()
            .sem_release
            .ok(conn, &self.all(), &[owner, "prefix"]))
    }

    fn extend(&self, conn: &mut redis::Connection, member: &str, ttl: u64) -> i64 {
        int(scripts()
            .sem_extend
            .ok(conn, &self.all(), &[member, &ttl.to_string()]))
    }

    fn verify(&self, conn: &mut redis::Connection, member: &str) -> Option<i64> {
        verified(scripts().sem_verify.ok(conn, &[&self.permits], &[member]))
    }

    fn set_capacity(&self, conn: &mut redis::Connection, cap: u32) -> i64 {
        int(scripts()
            .sem_set_capacity
            .ok(conn, &[&self.meta, &self.permits], &[&cap.to_string()]))
    }

    fn status(&self, conn: &mut redis::Connection) -> Status {
        status(scripts().sem_status.ok(conn, &self.all(), &[]))
    }

    /// The slots the bitmap marks taken, and the holders the hash indexes
    /// (owner → slot:token): both must match the permit set.
    fn check_index(&self, conn: &mut redis::Connection) {
        let members: Vec<String> = conn.zrange(&self.permits, 0, -1).unwrap();
        let mut slots = BTreeSet::new();
        let mut holders = BTreeMap::new();
        for m in &members {
            let (owner, slot, token) = parse_member(m);
            slots.insert(slot);
            holders.insert(format!("holder:{owner}"), format!("{slot}:{token}"));
        }
        let bitmap: Vec<u8> = conn.get(&self.slots).unwrap_or_default();
        let marked: BTreeSet<i64> = (0..bitmap.len() * 8)
            .filter(|i| bitmap[i / 8] & (0x80 >> (i % 8)) != 0)
            .map(|i| i as i64)
            .collect();
        assert_eq!(marked, slots, "the slot bitmap is out of step");
        let fields: BTreeMap<String, String> = conn.hgetall(&self.meta).unwrap();
        let indexed: BTreeMap<String, String> = fields
            .into_iter()
            .filter(|(f, _)| f.starts_with("holder:"))
            .collect();
        assert_eq!(indexed, holders, "the holder index is out of step");
    }
}

/// The server's clock in ms, as the scripts compute it.
fn server_ms(conn: &mut redis::Connection) -> i64 {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    secs * 1000 + micros / 1000
}

fn pexpiretime(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PEXPIRETIME").arg(key).query(conn).unwrap()
}

fn zscore(conn: &mut redis::Connection, key: &str, member: &str) -> Option<i64> {
    let s: Option<f64> = conn.zscore(key, member).unwrap();
    s.map(|s| s as i64)
}

/// A small seeded generator (xorshift64*), so a failing random schedule can be
/// replayed from the seed it prints.
struct Rng(u64);

impl Rng {
    fn seeded() -> (Rng, u64) {
        let seed = std::env::var("RWSEM_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
                    | 1
            });
        (Rng(seed), seed)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

// ---------------------------------------------------------------------------
// Reader/writer lease
// ---------------------------------------------------------------------------

#[test]
fn readers_share_a_writer_waits_for_the_last_with_the_latest_expiry_as_hint() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_share");
    assert_eq!(
        k.read(&mut c, "ra", 5_000, "writer"),
        Grant::Granted("0".into())
    );
    assert_eq!(
        k.read(&mut c, "rb", 60_000, "writer"),
        Grant::Granted("0".into())
    );
    let now = server_ms(&mut c);
    let (a, b) = (
        zscore(&mut c, &k.r, "ra").unwrap(),
        zscore(&mut c, &k.r, "rb").unwrap(),
    );
    assert!(
        (now + 1_000..=now + 5_000).contains(&a),
        "ra expires at {a}, now {now}"
    );
    assert!(
        (now + 50_000..=now + 60_000).contains(&b),
        "rb expires at {b}, now {now}"
    );
    assert_eq!(
        pexpiretime(&mut c, &k.r),
        b,
        "the set's own expiry is its highest score"
    );

    // Busy: the hint is when the last reader would be gone by itself.
    let hint = k.write(&mut c, "w1", 10_000, 0).hint();
    assert!((50_000..=60_000).contains(&hint), "hint {hint}");
    assert!(
        !c.exists::<_, bool>(&k.q).unwrap(),
        "intent 0 records no intent"
    );
    assert!(!c.exists::<_, bool>(&k.w).unwrap());
    assert!(
        !c.exists::<_, bool>(&k.fence).unwrap(),
        "no token was drawn"
    );

    let left = k.read_verify(&mut c, "ra").unwrap();
    assert!((1..=5_000).contains(&left), "{left}");
    assert_eq!(k.read_verify(&mut c, "nobody"), None);

    assert_eq!(k.read_release(&mut c, "rb"), 1);
    assert_eq!(k.read_release(&mut c, "rb"), 0, "released twice");
    assert_eq!(
        pexpiretime(&mut c, &k.r),
        a,
        "the set's expiry follows its highest score down"
    );
    assert!(k.write(&mut c, "w1", 10_000, 0).hint() <= 5_000);
    assert_eq!(k.read_release(&mut c, "ra"), 1);
    assert!(
        !c.exists::<_, bool>(&k.r).unwrap(),
        "the last reader out deletes the set"
    );
    assert_eq!(k.write(&mut c, "w1", 10_000, 0), Grant::Granted("1".into()));
}

#[test]
fn a_writer_excludes_readers_and_writers_and_readers_see_its_token() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_excl");
    let token = k.write(&mut c, "w1", 30_000, 0).token().to_owned();
    assert_eq!(token, "1");
    let held: String = c.get(&k.w).unwrap();
    assert_eq!(held, "w1:1");
    let pttl: i64 = c.pttl(&k.w).unwrap();
    assert!((20_000..=30_000).contains(&pttl));

    for pref in ["writer", "reader"] {
        let hint = k.read(&mut c, "r1", 5_000, pref).hint();
        assert!((20_000..=30_000).contains(&hint), "{pref}: hint {hint}");
    }
    let hint = k.write(&mut c, "w2", 5_000, 0).hint();
    assert!((1..=30_000).contains(&hint), "hint {hint}");
    assert!(
        !c.exists::<_, bool>(&k.r).unwrap(),
        "a busy reader left nothing behind"
    );

    // The writer uses the plain lease scripts on B:w.
    assert_eq!(
        int(scripts()
            .lease_extend
            .ok(&mut c, &[&k.w], &["w1:1", "45000"])),
        1
    );
    assert!(verified(scripts().lease_verify.ok(&mut c, &[&k.w], &["w1:1"])).unwrap() > 30_000);
    assert_eq!(k.release_writer(&mut c, "w1", "1"), 1);
    assert_eq!(
        k.read(&mut c, "r1", 5_000, "writer"),
        Grant::Granted("1".into())
    );
}

#[test]
fn write_tokens_strictly_increase_and_each_reader_sees_the_last_one() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_tokens");
    let mut last = 0u64;
    for i in 0..50 {
        let writer = format!("w{i}");
        let token = k.write(&mut c, &writer, 10_000, 1_000).token().to_owned();
        let n: u64 = token.parse().unwrap();
        assert!(n > last, "token {n} after {last}");
        last = n;
        assert_eq!(k.release_writer(&mut c, &writer, &token), 1);
        let reader = format!("r{i}");
        assert_eq!(
            k.read(&mut c, &reader, 10_000, "writer"),
            Grant::Granted(token)
        );
        assert_eq!(k.read_release(&mut c, &reader), 1);
    }
    assert_eq!(last, 50);
    let fence: u64 = c.get(&k.fence).unwrap();
    assert_eq!(fence, 50);
    assert_eq!(
        c.pttl::<_, i64>(&k.fence).unwrap(),
        -1,
        "the counter never expires"
    );
}

#[test]
fn retries_of_the_same_acquire_get_the_same_grant_with_a_fresh_expiry() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_retry");
    c.set::<_, _, ()>(&k.fence, 41).unwrap();

    let first = k.write(&mut c, "w1", 1_000, 5_000);
    assert_eq!(first, Grant::Granted("42".into()));
    let again = k.write(&mut c, "w1", 60_000, 5_000);
    assert_eq!(again, first, "same token");
    assert_eq!(
        c.get::<_, String>(&k.fence).unwrap(),
        "42",
        "no new increment"
    );
    assert!(c.pttl::<_, i64>(&k.w).unwrap() > 1_000, "expiry set anew");
    assert_eq!(k.release_writer(&mut c, "w1", "42"), 1);

    assert_eq!(
        k.read(&mut c, "r1", 1_000, "writer"),
        Grant::Granted("42".into())
    );
    let before = zscore(&mut c, &k.r, "r1").unwrap();
    // A waiting writer's intent now holds new readers back, but not a retry of
    // a reader that already holds its lease.
    k.write(&mut c, "w2", 10_000, 10_000).hint();
    assert!(k.read(&mut c, "r2", 1_000, "writer").hint() > 0);
    assert_eq!(
        k.read(&mut c, "r1", 60_000, "writer"),
        Grant::Granted("42".into())
    );
    let after = zscore(&mut c, &k.r, "r1").unwrap();
    assert!(
        after > before + 50_000,
        "expiry set anew: {before} → {after}"
    );
    assert_eq!(c.zcard::<_, i64>(&k.r).unwrap(), 1);
    assert_eq!(pexpiretime(&mut c, &k.r), after);
}

#[test]
fn a_late_duplicate_acquire_never_shortens_what_was_granted_or_extended() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_late_dup");

    // The writer: granted with 1 s, extended to 60 s; then the duplicate of the
    // first acquire (1 s) arrives late.
    let token = k.write(&mut c, "w1", 1_000, 0).token().to_owned();
    let value = format!("w1:{token}");
    assert_eq!(
        int(scripts()
            .lease_extend
            .ok(&mut c, &[&k.w], &[&value, "60000"])),
        1
    );
    let before = pexpiretime(&mut c, &k.w);
    assert_eq!(
        k.write(&mut c, "w1", 1_000, 0),
        Grant::Granted(token.clone())
    );
    assert_eq!(
        pexpiretime(&mut c, &k.w),
        before,
        "the writer was shortened"
    );
    assert!(c.pttl::<_, i64>(&k.w).unwrap() > 50_000);
    // A longer duplicate still lengthens it.
    k.write(&mut c, "w1", 120_000, 0).token();
    assert!(pexpiretime(&mut c, &k.w) > before + 50_000);
    assert_eq!(k.release_writer(&mut c, "w1", &token), 1);

    // A reader: the same story with its own score.
    k.read(&mut c, "r1", 1_000, "writer").token();
    assert_eq!(k.read_extend(&mut c, "r1", 60_000), 1);
    let before = zscore(&mut c, &k.r, "r1").unwrap();
    k.read(&mut c, "r1", 1_000, "writer").token();
    assert_eq!(
        zscore(&mut c, &k.r, "r1").unwrap(),
        before,
        "the reader was shortened"
    );
    assert_eq!(pexpiretime(&mut c, &k.r), before);
    k.read(&mut c, "r1", 120_000, "reader").token();
    let longer = zscore(&mut c, &k.r, "r1").unwrap();
    assert!(longer > before + 50_000, "{before} → {longer}");
    assert_eq!(pexpiretime(&mut c, &k.r), longer);

    // A permit.
    let s = SemKeys::new("sem_late_dup");
    let first = s.acquire(&mut c, "p", 1_000, 2);
    let member = SemKeys::member("p", &first);
    assert_eq!(s.extend(&mut c, &member, 60_000), 1);
    let before = zscore(&mut c, &s.permits, &member).unwrap();
    assert_eq!(s.acquire(&mut c, "p", 1_000, 2), first);
    assert_eq!(
        zscore(&mut c, &s.permits, &member).unwrap(),
        before,
        "the permit was shortened"
    );
    assert_eq!(s.acquire(&mut c, "p", 120_000, 2), first);
    let longer = zscore(&mut c, &s.permits, &member).unwrap();
    assert!(longer > before + 50_000, "{before} → {longer}");
    assert_eq!(c.hget::<_, _, String>(&s.meta, "fence").unwrap(), "1");
}

#[test]
fn a_waiting_writers_intent_holds_back_new_readers_until_it_withdraws() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_intent");
    assert_eq!(
        k.read(&mut c, "r1", 30_000, "writer"),
        Grant::Granted("0".into())
    );
    assert!(k.write(&mut c, "w1", 10_000, 10_000).hint() > 20_000);
    let intent = zscore(&mut c, &k.q, "w1").expect("the intent is recorded");
    let now = server_ms(&mut c);
    assert!((now + 5_000..=now + 10_000).contains(&intent));
    assert_eq!(pexpiretime(&mut c, &k.q), intent);

    // New readers wait (until the intent would expire by itself); the current
    // reader is not revoked and may renew.
    let hint = k.read(&mut c, "r2", 30_000, "writer").hint();
    assert!((5_000..=10_000).contains(&hint), "hint {hint}");
    assert_eq!(k.read_extend(&mut c, "r1", 30_000), 1);
    assert!(k.read_verify(&mut c, "r1").is_some());

    // Reader preference ignores intents.
    assert_eq!(
        k.read(&mut c, "r3", 30_000, "reader"),
        Grant::Granted("0".into())
    );
    assert_eq!(k.read_release(&mut c, "r3"), 1);

    // A second waiting writer: withdrawing one intent is not enough.
    k.write(&mut c, "w2", 10_000, 20_000).hint();
    assert_eq!(
        pexpiretime(&mut c, &k.q),
        zscore(&mut c, &k.q, "w2").unwrap()
    );
    assert_eq!(k.withdraw(&mut c, "w2"), 1);
    assert_eq!(k.withdraw(&mut c, "w2"), 0, "withdrawn twice");
    assert_eq!(
        pexpiretime(&mut c, &k.q),
        intent,
        "the set's expiry follows its highest score down"
    );
    assert!(k.read(&mut c, "r2", 30_000, "writer").hint() > 0);
    assert_eq!(k.withdraw(&mut c, "w1"), 1);
    assert!(
        !c.exists::<_, bool>(&k.q).unwrap(),
        "the last intent out deletes the set"
    );
    assert_eq!(
        k.read(&mut c, "r2", 30_000, "writer"),
        Grant::Granted("0".into())
    );

    // A writer that finally gets in drops its intent.
    assert_eq!(k.read_release(&mut c, "r1"), 1);
    k.write(&mut c, "w1", 10_000, 10_000).hint();
    assert!(zscore(&mut c, &k.q, "w1").is_some());
    assert_eq!(k.read_release(&mut c, "r2"), 1);
    assert_eq!(
        k.write(&mut c, "w1", 10_000, 10_000),
        Grant::Granted("1".into())
    );
    assert!(!c.exists::<_, bool>(&k.q).unwrap());
}

#[test]
fn a_retrying_writer_refreshes_its_intent_only_once_a_quarter_of_it_passed() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_intent_refresh");
    k.read(&mut c, "r1", 30_000, "writer").token();
    k.write(&mut c, "w1", 10_000, 10_000).hint();
    let first = zscore(&mut c, &k.q, "w1").unwrap();
    // At once again: three quarters and more are left, so nothing is written
    // (the readers waiting on the intent set are not woken).
    k.write(&mut c, "w1", 10_000, 10_000).hint();
    assert_eq!(zscore(&mut c, &k.q, "w1").unwrap(), first);
    // A longer intent leaves less than three quarters of it: refreshed.
    k.write(&mut c, "w1", 10_000, 40_000).hint();
    let refreshed = zscore(&mut c, &k.q, "w1").unwrap();
    assert!(refreshed > first + 25_000, "{first} → {refreshed}");
    assert_eq!(pexpiretime(&mut c, &k.q), refreshed);
    // A short intent recorded a while ago (80 ms on the server's clock, more
    // than a quarter of it) is refreshed.
    k.write(&mut c, "w2", 10_000, 200).hint();
    let short = zscore(&mut c, &k.q, "w2").unwrap();
    wait_until(
        Duration::from_secs(5),
        "80 ms to pass on the server",
        || server_now(&mut c).0 >= short - 200 + 80,
    );
    k.write(&mut c, "w2", 10_000, 200).hint();
    assert!(zscore(&mut c, &k.q, "w2").unwrap() > short);
}

#[test]
fn the_writer_clean_up_deletes_only_what_this_owner_set() {
    let mut c = shared_server().client();
    let s = scripts();
    let k = RwKeys::new("rw_write_clean_up");
    let clean = |c: &mut redis::Connection, owner: &str| {
        int(s.write_clean_up.ok(c, &[&k.w, &k.q], &[owner]))
    };
    assert_eq!(clean(&mut c, "nobody"), 0, "nothing there");
    k.read(&mut c, "r1", 30_000, "writer").token();
    k.write(&mut c, "w1", 10_000, 10_000).hint();
    k.write(&mut c, "w2", 10_000, 10_000).hint();
    assert_eq!(clean(&mut c, "w1"), 1, "the intent");
    assert!(zscore(&mut c, &k.q, "w1").is_none());
    assert!(
        zscore(&mut c, &k.q, "w2").is_some(),
        "another writer's intent"
    );
    assert_eq!(k.read_release(&mut c, "r1"), 1);
    let token = k.write(&mut c, "w2", 10_000, 10_000).token().to_owned();
    assert_eq!(clean(&mut c, "w1"), 0, "another writer's lease");
    assert!(c.exists::<_, bool>(&k.w).unwrap());
    assert_eq!(clean(&mut c, "w2"), 1, "its own lease");
    assert!(!c.exists::<_, bool>(&k.w).unwrap());
    assert_eq!(
        c.get::<_, String>(&k.fence).unwrap(),
        token,
        "the counter stays"
    );
    // A reader's release takes the same 'exact' mode as a permit's, and no other.
    k.read(&mut c, "r2", 30_000, "writer").token();
    let e = s.read_release.err(&mut c, &[&k.r], &["r2", "prefix"]);
    assert_eq!(e.code(), Some("BADARG"));
    assert!(zscore(&mut c, &k.r, "r2").is_some());
    assert_eq!(int(s.read_release.ok(&mut c, &[&k.r], &["r2", "exact"])), 1);
}

#[test]
fn an_abandoned_intent_expires_by_itself() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_intent_expiry");
    assert_eq!(
        k.read(&mut c, "r1", 30_000, "writer"),
        Grant::Granted("0".into())
    );
    k.write(&mut c, "crashed", 30_000, 400).hint();
    let hint = k.read(&mut c, "r2", 30_000, "writer").hint();
    assert!((1..=400).contains(&hint), "hint {hint}");
    let start = Instant::now();
    let mut attempts = 0;
    wait_until(Duration::from_secs(5), "the intent to expire", || {
        attempts += 1;
        k.read(&mut c, "r2", 30_000, "writer") == Grant::Granted("0".into())
    });
    println!(
        "reader admitted {:?} after the intent was recorded ({attempts} attempts)",
        start.elapsed()
    );
    assert!(
        !c.exists::<_, bool>(&k.q).unwrap(),
        "the expired intent was pruned"
    );
}

#[test]
fn each_reader_expires_by_its_own_score_and_never_comes_back() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_expiry");
    assert_eq!(
        k.read(&mut c, "short", 100, "writer"),
        Grant::Granted("0".into())
    );
    assert_eq!(
        k.read(&mut c, "long", 60_000, "writer"),
        Grant::Granted("0".into())
    );
    wait_until(Duration::from_secs(5), "the short reader to expire", || {
        k.read_verify(&mut c, "short").is_none()
    });
    // Still in the set until something prunes it; extend removes it instead.
    assert!(zscore(&mut c, &k.r, "short").is_some());
    assert_eq!(k.read_extend(&mut c, "short", 60_000), 0);
    assert_eq!(
        zscore(&mut c, &k.r, "short"),
        None,
        "an expired reader never comes back"
    );
    assert_eq!(k.read_extend(&mut c, "short", 60_000), 0);
    assert!(
        k.read_verify(&mut c, "long").is_some(),
        "the other reader stays"
    );
    assert_eq!(k.read_extend(&mut c, "long", 60_000), 1);

    // A writer is held by the remaining reader only; when it goes, the writer
    // gets in.
    let hint = k.write(&mut c, "w1", 10_000, 0).hint();
    assert!(hint > 50_000, "hint {hint}");
    assert_eq!(k.read_release(&mut c, "long"), 1);
    assert_eq!(k.write(&mut c, "w1", 10_000, 0), Grant::Granted("1".into()));

    // A release of an expired reader reports 0 and removes it.
    assert_eq!(k.release_writer(&mut c, "w1", "1"), 1);
    assert_eq!(
        k.read(&mut c, "brief", 50, "writer"),
        Grant::Granted("1".into())
    );
    wait_until(Duration::from_secs(5), "the brief reader to expire", || {
        k.read_verify(&mut c, "brief").is_none()
    });
    assert_eq!(k.read_release(&mut c, "brief"), 0);
    assert!(!c.exists::<_, bool>(&k.r).unwrap());
}

#[test]
fn the_reader_set_is_pruned_by_a_writers_attempt_and_vanishes_by_itself() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_prune");
    for i in 0..4 {
        k.read(&mut c, &format!("r{i}"), 60 + i * 20, "writer")
            .token();
    }
    k.read(&mut c, "keep", 60_000, "writer").token();
    wait_until(
        Duration::from_secs(5),
        "the short readers to expire",
        || k.read_verify(&mut c, "r3").is_none(),
    );
    assert_eq!(
        c.zcard::<_, i64>(&k.r).unwrap(),
        5,
        "expired members wait for a prune"
    );
    assert!(k.write(&mut c, "w1", 10_000, 0).hint() > 50_000);
    let left: Vec<String> = c.zrange(&k.r, 0, -1).unwrap();
    assert_eq!(left, ["keep"], "the busy writer pruned the expired readers");

    // Readers that all stop renewing: the set's own expiry removes it, with
    // no script run.
    assert_eq!(k.read_extend(&mut c, "keep", 100), 1);
    assert!(pexpiretime(&mut c, &k.r) <= server_ms(&mut c) + 100);
    wait_until(Duration::from_secs(10), "the reader set to expire", || {
        !c.exists::<_, bool>(&k.r).unwrap()
    });
    assert_eq!(k.write(&mut c, "w1", 10_000, 0), Grant::Granted("1".into()));
}

#[test]
fn tokens_at_and_above_ten_to_the_fourteen_and_near_the_maximum_are_exact_strings() {
    let mut c = shared_server().client();
    for (start, want) in [
        ("99999999999999", "100000000000000"),
        ("9007199254740993", "9007199254740994"),
        ("9223372036854775806", "9223372036854775807"),
    ] {
        let k = RwKeys::new("rw_big");
        c.set::<_, _, ()>(&k.fence, start).unwrap();
        assert_eq!(
            k.read(&mut c, "r0", 10_000, "writer"),
            Grant::Granted(start.into())
        );
        assert_eq!(k.read_release(&mut c, "r0"), 1);
        assert_eq!(
            k.write(&mut c, "w1", 10_000, 0),
            Grant::Granted(want.into())
        );
        assert_eq!(c.get::<_, String>(&k.w).unwrap(), format!("w1:{want}"));
        assert_eq!(c.get::<_, String>(&k.fence).unwrap(), want);
        assert_eq!(
            k.write(&mut c, "w1", 10_000, 0),
            Grant::Granted(want.into()),
            "retry"
        );
        assert_eq!(k.release_writer(&mut c, "w1", want), 1);
        assert_eq!(
            k.read(&mut c, "r1", 10_000, "writer"),
            Grant::Granted(want.into())
        );
        assert_eq!(k.read_release(&mut c, "r1"), 1);
    }

    for (start, want) in [
        ("99999999999999", "100000000000000"),
        ("9007199254740993", "9007199254740994"),
        ("9223372036854775806", "9223372036854775807"),
    ] {
        let k = SemKeys::new("sem_big");
        c.hset::<_, _, _, ()>(&k.meta, "fence", start).unwrap();
        let got = k.acquire(&mut c, "p1", 10_000, 2);
        assert_eq!(
            got,
            PermitReply::Granted {
                slot: 0,
                token: want.into()
            }
        );
        assert_eq!(k.acquire(&mut c, "p1", 10_000, 2), got, "retry");
        let member = SemKeys::member("p1", &got);
        assert_eq!(member, format!("p1:0:{want}"));
        assert!(k.verify(&mut c, &member).is_some());
        assert_eq!(c.hget::<_, _, String>(&k.meta, "fence").unwrap(), want);
    }
}

#[test]
fn a_counter_at_its_maximum_refuses_a_new_token_and_changes_nothing() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_max");
    c.set::<_, _, ()>(&k.fence, "9223372036854775807").unwrap();
    let now = server_ms(&mut c);
    c.zadd::<_, _, _, ()>(&k.r, "dead", now - 1_000).unwrap();
    let before = snapshot(&mut c, &k.prefix);
    let e = scripts()
        .write_acquire
        .err(&mut c, &k.all(), &["w1", "10000", "1000"]);
    assert_eq!(e.code(), Some("BADFENCE"), "{e}");
    assert!(
        e.detail().unwrap().starts_with("KEYS[4] is at its maximum"),
        "{e}"
    );
    assert_eq!(snapshot(&mut c, &k.prefix), before);
    // A retry of the holder of the last token needs no new one.
    c.set::<_, _, ()>(&k.w, "w0:9223372036854775807").unwrap();
    assert_eq!(
        k.write(&mut c, "w0", 10_000, 0),
        Grant::Granted("9223372036854775807".into())
    );
    let e = scripts()
        .write_acquire
        .err(&mut c, &k.all(), &["w1", "10000", "1000"]);
    assert_eq!(e.code(), Some("BADFENCE"), "{e}");
    c.del::<_, ()>(&k.w).unwrap();
    // Readers only read the counter.
    assert_eq!(
        k.read(&mut c, "r1", 10_000, "writer"),
        Grant::Granted("9223372036854775807".into())
    );

    let s = SemKeys::new("sem_max");
    c.hset::<_, _, _, ()>(&s.meta, "fence", "9223372036854775807")
        .unwrap();
    let before = snapshot(&mut c, &s.prefix);
    let e = scripts()
        .sem_acquire
        .err(&mut c, &s.all(), &["p1", "10000", "3"]);
    assert_eq!(e.code(), Some("BADFENCE"), "{e}");
    assert_eq!(snapshot(&mut c, &s.prefix), before);
    let now = server_ms(&mut c);
    // A holder of the last token, as an acquire leaves it: the member, its
    // index entry and its slot bit.
    c.zadd::<_, _, _, ()>(&s.permits, "p0:1:9223372036854775807", now + 60_000)
        .unwrap();
    c.hset::<_, _, _, ()>(&s.meta, "holder:p0", "1:9223372036854775807")
        .unwrap();
    c.setbit::<_, ()>(&s.slots, 1, true).unwrap();
    assert_eq!(
        s.acquire(&mut c, "p0", 10_000, 3),
        PermitReply::Granted {
            slot: 1,
            token: "9223372036854775807".into()
        },
        "a retry of the holder of the last token needs no new one"
    );
    let e = scripts()
        .sem_acquire
        .err(&mut c, &s.all(), &["p1", "10000", "3"]);
    assert_eq!(e.code(), Some("BADFENCE"), "{e}");
}

/// Puts a bad key in place, given the keys of one primitive.
type Setup = Box<dyn Fn(&mut redis::Connection, &[&str])>;

/// One refusal case: the bad key to put in place, the error expected, and
/// the scripts (by name) that must refuse it.
struct Refusal {
    what: String,
    setup: Setup,
    code: &'static str,
    /// A part of the error's detail.
    detail: &'static str,
    scripts: &'static [&'static str],
}

impl Refusal {
    fn new(
        what: impl Into<String>,
        setup: impl Fn(&mut redis::Connection, &[&str]) + 'static,
        (code, detail): (&'static str, &'static str),
        scripts: &'static [&'static str],
    ) -> Refusal {
        Refusal {
            what: what.into(),
            setup: Box::new(setup),
            code,
            detail,
            scripts,
        }
    }
}

/// One script run: its name, the script, which of the primitive's keys it
/// takes (by index) and its arguments.
struct Run {
    name: &'static str,
    script: &'static Lua,
    keys: &'static [usize],
    args: &'static [&'static str],
}

/// For every case and every script it names: a fresh set of keys in the
/// baseline state, the bad key, then the script must give the error and leave
/// every key exactly as it was.
fn refuse_each(
    c: &mut redis::Connection,
    test: &str,
    baseline: fn(&mut redis::Connection, &[&str]),
    key_names: fn(&str) -> Vec<String>,
    runs: &[Run],
    cases: &[Refusal],
) {
    for case in cases {
        let mut ran = 0;
        for run in runs.iter().filter(|r| case.scripts.contains(&r.name)) {
            let prefix = unique_prefix(test);
            let names = key_names(&prefix);
            let all: Vec<&str> = names.iter().map(String::as_str).collect();
            baseline(c, &all);
            (case.setup)(c, &all);
            let keys: Vec<&str> = run.keys.iter().map(|&i| all[i]).collect();
            let before = snapshot(c, &prefix);
            assert!(!before.is_empty());
            let e = run.script.err(c, &keys, run.args);
            let ctx = format!("{}: {}: {e}", case.what, run.name);
            assert_eq!(e.code(), Some(case.code), "{ctx}");
            let detail = e.detail().unwrap_or_default();
            assert!(
                detail.starts_with("KEYS[") && detail.contains(case.detail),
                "{ctx}"
            );
            assert_eq!(snapshot(c, &prefix), before, "{ctx}: something changed");
            ran += 1;
        }
        assert_eq!(
            ran,
            case.scripts.len(),
            "{}: a script name matched no run",
            case.what
        );
    }
}

#[test]
fn every_wrong_key_of_the_reader_writer_lease_is_refused_and_nothing_changes() {
    const ACQUIRES: &[&str] = &["read_w", "read_r", "write", "write_try"];
    let s = scripts();
    // A valid state with expired members: a script that wrote before checking
    // would prune them, and the snapshot would show it.
    fn baseline(c: &mut redis::Connection, k: &[&str]) {
        let now = server_ms(c);
        let _: () = c
            .zadd_multiple(k[1], &[(now - 1_000, "dead"), (now + 60_000, "live")])
            .unwrap();
        let _: () = c
            .zadd_multiple(k[2], &[(now - 1_000, "deadw"), (now + 60_000, "livew")])
            .unwrap();
        let _: () = c.set(k[3], 7).unwrap();
    }
    fn names(p: &str) -> Vec<String> {
        ["w", "r", "q", "fence"]
            .iter()
            .map(|s| format!("{p}{{rw}}:{s}"))
            .collect()
    }
    fn replace(i: usize, kind: &'static str) -> impl Fn(&mut redis::Connection, &[&str]) {
        move |c, k| {
            let _: () = c.del(k[i]).unwrap();
            match kind {
                "hash" => c.hset::<_, _, _, ()>(k[i], "f", "v").unwrap(),
                "string" => c.set::<_, _, ()>(k[i], "v").unwrap(),
                "list" => c.rpush::<_, _, ()>(k[i], "v").unwrap(),
                "zset" => c.zadd::<_, _, _, ()>(k[i], "m", 1).unwrap(),
                _ => unreachable!(),
            }
        }
    }
    let runs = [
        Run {
            name: "read_w",
            script: &s.read_acquire,
            keys: &[0, 1, 2, 3],
            args: &["o", "1000", "writer"],
        },
        Run {
            name: "read_r",
            script: &s.read_acquire,
            keys: &[0, 1, 2, 3],
            args: &["o", "1000", "reader"],
        },
        Run {
            name: "write",
            script: &s.write_acquire,
            keys: &[0, 1, 2, 3],
            args: &["o", "1000", "500"],
        },
        Run {
            name: "write_try",
            script: &s.write_acquire,
            keys: &[0, 1, 2, 3],
            args: &["o", "1000", "0"],
        },
        Run {
            name: "read_extend",
            script: &s.read_extend,
            keys: &[1],
            args: &["live", "1000"],
        },
        Run {
            name: "read_verify",
            script: &s.read_verify,
            keys: &[1],
            args: &["live"],
        },
        Run {
            name: "read_release",
            script: &s.read_release,
            keys: &[1],
            args: &["live"],
        },
        Run {
            name: "withdraw",
            script: &s.write_withdraw,
            keys: &[2],
            args: &["livew"],
        },
        Run {
            name: "write_clean_up",
            script: &s.write_clean_up,
            keys: &[0, 2],
            args: &["livew"],
        },
    ];
    let own_ops: &[&str] = &["read_extend", "read_verify", "read_release"];
    let mut cases = vec![
        Refusal::new(
            "writer lease is a hash",
            replace(0, "hash"),
            ("BADKEY", "KEYS[1] holds a hash"),
            ACQUIRES,
        ),
        Refusal::new(
            "writer lease is a zset",
            replace(0, "zset"),
            ("BADKEY", "KEYS[1] holds a zset"),
            ACQUIRES,
        ),
        Refusal::new(
            "reader set is a string",
            replace(1, "string"),
            ("BADKEY", "KEYS[2] holds a string"),
            ACQUIRES,
        ),
        Refusal::new(
            "reader set is a list",
            replace(1, "list"),
            ("BADKEY", "KEYS[1] holds a list"),
            own_ops,
        ),
        Refusal::new(
            "intent set is a hash",
            replace(2, "hash"),
            ("BADKEY", "KEYS[3] holds a hash"),
            ACQUIRES,
        ),
        Refusal::new(
            "intent set is a string",
            replace(2, "string"),
            ("BADKEY", "KEYS[1] holds a string"),
            &["withdraw"],
        ),
        Refusal::new(
            "writer lease is a list",
            replace(0, "list"),
            ("BADKEY", "KEYS[1] holds a list"),
            &["write_clean_up"],
        ),
        Refusal::new(
            "intent set is a hash",
            replace(2, "hash"),
            ("BADKEY", "KEYS[2] holds a hash"),
            &["write_clean_up"],
        ),
        Refusal::new(
            "fence is a hash",
            replace(3, "hash"),
            ("BADFENCE", "KEYS[4] holds a hash"),
            ACQUIRES,
        ),
        Refusal::new(
            "fence has a TTL",
            |c, k| c.pexpire::<_, ()>(k[3], 60_000).unwrap(),
            ("BADFENCE", "KEYS[4] has an expiry"),
            ACQUIRES,
        ),
    ];
    for v in [
        "abc",
        "-1",
        "1.5",
        "01",
        "",
        "9223372036854775808",
        "99999999999999999999",
    ] {
        cases.push(Refusal::new(
            format!("fence {v:?}"),
            move |c, k| c.set::<_, _, ()>(k[3], v).unwrap(),
            ("BADFENCE", "KEYS[4] is not a non-negative integer"),
            ACQUIRES,
        ));
    }
    refuse_each(
        &mut shared_server().client(),
        "rw_refuse",
        baseline,
        names,
        &runs,
        &cases,
    );
}

#[test]
fn bad_arguments_are_refused_and_nothing_changes() {
    let mut c = shared_server().client();
    let s = scripts();
    let k = RwKeys::new("rw_badarg");
    let now = server_ms(&mut c);
    c.zadd::<_, _, _, ()>(&k.r, "dead", now - 1_000).unwrap();
    c.zadd::<_, _, _, ()>(&k.q, "deadw", now - 1_000).unwrap();
    let sem = SemKeys::new("sem_badarg");
    c.zadd::<_, _, _, ()>(&sem.permits, "dead:0:1", now - 1_000)
        .unwrap();
    c.hset::<_, _, _, ()>(&sem.meta, "capacity", 3).unwrap();
    let rw_keys = k.all();
    let sem_keys = [sem.permits.as_str(), sem.meta.as_str()];
    let cases: &[(&Lua, &[&str], &[&str])] = &[
        (&s.read_acquire, &rw_keys, &["o", "0", "writer"]),
        (&s.read_acquire, &rw_keys, &["o", "-5", "writer"]),
        (&s.read_acquire, &rw_keys, &["o", "1.5", "writer"]),
        (&s.read_acquire, &rw_keys, &["o", "abc", "writer"]),
        (&s.read_acquire, &rw_keys, &["o", "", "writer"]),
        (
            &s.read_acquire,
            &rw_keys,
            &["o", "99999999999999", "writer"],
        ),
        (&s.read_acquire, &rw_keys, &["o", "1000", "both"]),
        (&s.read_acquire, &rw_keys, &["o", "1000"]),
        (&s.read_acquire, &rw_keys, &["", "1000", "writer"]),
        (&s.read_acquire, &rw_keys, &["a:b", "1000", "writer"]),
        (&s.write_acquire, &rw_keys, &["o", "1000", "-1"]),
        (&s.write_acquire, &rw_keys, &["o", "1000", "x"]),
        (&s.write_acquire, &rw_keys, &["o", "0", "0"]),
        (&s.write_acquire, &rw_keys, &["a:b", "1000", "0"]),
        (&s.write_withdraw, &[&k.q], &[""]),
        (&s.read_extend, &[&k.r], &["dead", "0"]),
        (&s.read_release, &[&k.r], &[""]),
        (&s.sem_acquire, &sem_keys, &["o", "1000", "0"]),
        (&s.sem_acquire, &sem_keys, &["o", "1000", "10001"]),
        (&s.sem_acquire, &sem_keys, &["o", "1000", "abc"]),
        (&s.sem_acquire, &sem_keys, &["o", "1000", "3.0"]),
        (&s.sem_acquire, &sem_keys, &["o", "1000", "-3"]),
        (&s.sem_acquire, &sem_keys, &["o", "0", "3"]),
        (&s.sem_acquire, &sem_keys, &["a:b", "1000", "3"]),
        (&s.sem_extend, &[&sem.permits], &["dead:0:1", "x"]),
        (&s.sem_release, &[&sem.permits], &["dead:0:1", "all"]),
        (&s.sem_release, &[&sem.permits], &["dead:0", "prefix"]),
        (&s.sem_set_capacity, &[&sem.meta, &sem.permits], &["0"]),
        (&s.sem_set_capacity, &[&sem.meta, &sem.permits], &["10001"]),
        (&s.sem_set_capacity, &[&sem.meta, &sem.permits], &["two"]),
    ];
    for (script, keys, args) in cases {
        let before = (snapshot(&mut c, &k.prefix), snapshot(&mut c, &sem.prefix));
        let e = script.err(&mut c, keys, args);
        assert_eq!(e.code(), Some("BADARG"), "{args:?}: {e}");
        assert_eq!(
            (snapshot(&mut c, &k.prefix), snapshot(&mut c, &sem.prefix)),
            before,
            "{args:?} changed something"
        );
    }
}

// ---------------------------------------------------------------------------
// Semaphore
// ---------------------------------------------------------------------------

#[test]
fn permits_take_the_lowest_free_slot_up_to_the_capacity() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_slots");
    let a = k.acquire(&mut c, "a", 10_000, 3);
    let b = k.acquire(&mut c, "b", 20_000, 3);
    let d = k.acquire(&mut c, "d", 30_000, 3);
    assert_eq!(
        a,
        PermitReply::Granted {
            slot: 0,
            token: "1".into()
        }
    );
    assert_eq!(
        b,
        PermitReply::Granted {
            slot: 1,
            token: "2".into()
        }
    );
    assert_eq!(
        d,
        PermitReply::Granted {
            slot: 2,
            token: "3".into()
        }
    );
    assert_eq!(c.hget::<_, _, String>(&k.meta, "capacity").unwrap(), "3");
    assert_eq!(c.pttl::<_, i64>(&k.meta).unwrap(), -1, "meta never expires");
    assert_eq!(
        pexpiretime(&mut c, &k.permits),
        -1,
        "the permit set has no key expiry: its index must not outlive it"
    );
    k.check_index(&mut c);

    // Full: the hint is when the earliest permit would be gone by itself.
    let hint = k.acquire(&mut c, "e", 10_000, 3).hint();
    assert!((5_000..=10_000).contains(&hint), "hint {hint}");
    assert_eq!(
        c.hget::<_, _, String>(&k.meta, "fence").unwrap(),
        "3",
        "a busy attempt draws no token"
    );

    let st = k.status(&mut c);
    assert_eq!(st.capacity, 3);
    let members: Vec<&str> = st.holders.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(
        members,
        ["a:0:1", "b:1:2", "d:2:3"],
        "soonest to expire first"
    );
    assert!(
        st.holders
            .iter()
            .zip([10_000, 20_000, 30_000])
            .all(|((_, left), ttl)| (ttl - 5_000..=ttl).contains(left)),
        "{st:?}"
    );

    assert_eq!(k.release(&mut c, &SemKeys::member("b", &b)), 1);
    assert_eq!(
        k.release(&mut c, &SemKeys::member("b", &b)),
        0,
        "released twice"
    );
    let e = k.acquire(&mut c, "e", 10_000, 3);
    assert_eq!(
        e,
        PermitReply::Granted {
            slot: 1,
            token: "4".into()
        },
        "the lowest free slot"
    );
    assert_eq!(k.release(&mut c, &SemKeys::member("a", &a)), 1);
    assert_eq!(
        k.acquire(&mut c, "f", 10_000, 3),
        PermitReply::Granted {
            slot: 0,
            token: "5".into()
        }
    );

    k.check_index(&mut c);

    // Release by owner alone, after an acquire whose reply was lost.
    assert_eq!(k.release_owner(&mut c, "f"), 1);
    assert_eq!(k.release_owner(&mut c, "f"), 0);
    assert_eq!(k.status(&mut c).holders.len(), 2);
    k.check_index(&mut c);
    // The last permit out deletes the set and the bitmap; the hash keeps
    // only the capacity and the counter.
    assert_eq!(k.release(&mut c, &SemKeys::member("d", &d)), 1);
    assert_eq!(k.release(&mut c, &SemKeys::member("e", &e)), 1);
    assert!(!c.exists::<_, bool>(&k.permits).unwrap());
    assert!(!c.exists::<_, bool>(&k.slots).unwrap());
    let fields: Vec<String> = c.hkeys(&k.meta).unwrap();
    assert_eq!(fields.len(), 2, "{fields:?}");
}

#[test]
fn a_retried_acquire_gets_the_same_permit_with_a_fresh_expiry_and_no_new_token() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_retry");
    let first = k.acquire(&mut c, "p", 1_000, 2);
    let member = SemKeys::member("p", &first);
    let before = zscore(&mut c, &k.permits, &member).unwrap();
    k.acquire(&mut c, "q", 1_000, 2).granted();
    // Full now, but the retry is a holder's.
    assert_eq!(k.acquire(&mut c, "p", 60_000, 2), first);
    let after = zscore(&mut c, &k.permits, &member).unwrap();
    assert!(after > before + 50_000, "{before} → {after}");
    assert_eq!(c.hget::<_, _, String>(&k.meta, "fence").unwrap(), "2");
    assert_eq!(k.status(&mut c).holders.len(), 2);
    k.check_index(&mut c);
}

#[test]
fn a_different_capacity_is_refused_and_nothing_changes() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_mismatch");
    k.acquire(&mut c, "a", 60_000, 3).granted();
    let now = server_ms(&mut c);
    c.zadd::<_, _, _, ()>(&k.permits, "dead:1:0", now - 1_000)
        .unwrap();
    let before = snapshot(&mut c, &k.prefix);
    for (requested, msg) in [
        ("4", "CAPMISMATCH 3 4"),
        ("1", "CAPMISMATCH 3 1"),
        ("10000", "CAPMISMATCH 3 10000"),
    ] {
        let e = scripts()
            .sem_acquire
            .err(&mut c, &k.all(), &["b", "10000", requested]);
        assert_eq!(e.code(), Some("CAPMISMATCH"), "{e}");
        assert_eq!(
            format!(
                "{} {}",
                e.code().unwrap(),
                e.detail().unwrap().split(" script:").next().unwrap()
            ),
            msg
        );
        assert_eq!(
            snapshot(&mut c, &k.prefix),
            before,
            "{requested} changed something"
        );
    }
    // The idempotent retry of a holder is refused too when it disagrees.
    let e = scripts()
        .sem_acquire
        .err(&mut c, &k.all(), &["a", "10000", "4"]);
    assert_eq!(e.code(), Some("CAPMISMATCH"));
    assert_eq!(snapshot(&mut c, &k.prefix), before);
}

#[test]
fn lowering_the_capacity_drains_and_raising_it_admits_at_once() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_drain");
    assert_eq!(k.set_capacity(&mut c, 3), -1, "nothing stored before");
    let held: Vec<String> = ["a", "b", "d"]
        .iter()
        .zip([10_000, 20_000, 30_000])
        .map(|(o, ttl)| SemKeys::member(o, &k.acquire(&mut c, o, ttl, 3)))
        .collect();
    assert_eq!(k.set_capacity(&mut c, 1), 3);
    assert_eq!(k.status(&mut c).capacity, 1);
    assert_eq!(k.status(&mut c).holders.len(), 3, "no permit is revoked");
    // Three must go before one is free: the hint is the third expiry.
    let hint = k.acquire(&mut c, "e", 10_000, 1).hint();
    assert!((20_000..=30_000).contains(&hint), "hint {hint}");
    assert_eq!(
        k.extend(&mut c, &held[2], 30_000),
        1,
        "holders keep renewing"
    );
    assert_eq!(k.release(&mut c, &held[0]), 1);
    assert!(k.acquire(&mut c, "e", 10_000, 1).hint() > 0);
    assert_eq!(k.release(&mut c, &held[1]), 1);
    assert!(
        k.acquire(&mut c, "e", 10_000, 1).hint() > 0,
        "1 holder, capacity 1"
    );
    assert_eq!(k.release(&mut c, &held[2]), 1);
    assert_eq!(
        k.acquire(&mut c, "e", 10_000, 1),
        PermitReply::Granted {
            slot: 0,
            token: "4".into()
        }
    );

    // Raising it admits more at once; slots above the old capacity are used.
    assert_eq!(k.set_capacity(&mut c, 1), 1);
    assert_eq!(k.set_capacity(&mut c, 3), 1);
    assert_eq!(k.acquire(&mut c, "f", 10_000, 3).granted().0, 1);
    assert_eq!(k.acquire(&mut c, "g", 10_000, 3).granted().0, 2);
    assert!(k.acquire(&mut c, "h", 10_000, 3).hint() > 0);
    k.check_index(&mut c);
}

#[test]
fn an_expired_permit_never_comes_back_and_frees_its_slot() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_expiry");
    let short = SemKeys::member("s", &k.acquire(&mut c, "s", 400, 2));
    let long = SemKeys::member("l", &k.acquire(&mut c, "l", 60_000, 2));
    assert_eq!(short, "s:0:1");
    assert!(k.acquire(&mut c, "x", 10_000, 2).hint() <= 400);
    wait_until(Duration::from_secs(5), "the short permit to expire", || {
        k.verify(&mut c, &short).is_none()
    });
    assert_eq!(k.extend(&mut c, &short, 60_000), 0);
    assert_eq!(
        zscore(&mut c, &k.permits, &short),
        None,
        "removed, not renewed"
    );
    assert_eq!(k.extend(&mut c, &short, 60_000), 0);
    assert!(k.verify(&mut c, &long).is_some());
    assert_eq!(k.extend(&mut c, &long, 60_000), 1);
    k.check_index(&mut c);
    assert_eq!(
        k.acquire(&mut c, "x", 10_000, 2),
        PermitReply::Granted {
            slot: 0,
            token: "3".into()
        }
    );
    k.check_index(&mut c);
}

#[test]
fn status_and_release_prune_expired_permits() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_status");
    assert_eq!(k.status(&mut c).capacity, -1);
    assert!(k.status(&mut c).holders.is_empty());
    let brief = SemKeys::member("b", &k.acquire(&mut c, "b", 50, 3));
    let other = SemKeys::member("o", &k.acquire(&mut c, "o", 60, 3));
    let long = SemKeys::member("l", &k.acquire(&mut c, "l", 60_000, 3));
    wait_until(
        Duration::from_secs(5),
        "the brief permits to expire",
        || k.verify(&mut c, &brief).is_none() && k.verify(&mut c, &other).is_none(),
    );
    assert_eq!(
        c.zcard::<_, i64>(&k.permits).unwrap(),
        3,
        "expired members wait for a prune"
    );
    assert_eq!(
        k.release(&mut c, &brief),
        0,
        "expired: not a release of a live permit"
    );
    assert_eq!(
        c.zcard::<_, i64>(&k.permits).unwrap(),
        1,
        "release pruned the other expired permit"
    );
    k.check_index(&mut c);
    let st = k.status(&mut c);
    assert_eq!((st.capacity, st.holders.len()), (3, 1));
    assert_eq!(st.holders[0].0, long);
    k.check_index(&mut c);
}

#[test]
fn every_wrong_key_of_the_semaphore_is_refused_and_nothing_changes() {
    const META_USERS: &[&str] = &["acquire", "retry", "set_capacity", "status"];
    const META_TYPE_USERS: &[&str] = &[
        "acquire",
        "retry",
        "set_capacity",
        "status",
        "extend",
        "release",
        "release_prefix",
    ];
    let mut c = shared_server().client();
    let s = scripts();
    fn baseline(c: &mut redis::Connection, k: &[&str]) {
        let now = server_ms(c);
        let _: () = c
            .zadd_multiple(
                k[0],
                &[(now - 1_000, "dead:0:1"), (now + 60_000, "live:1:2")],
            )
            .unwrap();
        let _: () = c
            .hset_multiple(
                k[1],
                &[("capacity", "3"), ("fence", "2"), ("holder:live", "1:2")],
            )
            .unwrap();
        let _: () = c.setbit(k[2], 1, true).unwrap();
    }
    fn names(p: &str) -> Vec<String> {
        ["permits", "meta", "slots"]
            .iter()
            .map(|s| format!("{p}{{sem}}:{s}"))
            .collect()
    }
    fn field(name: &'static str, value: &'static str) -> impl Fn(&mut redis::Connection, &[&str]) {
        move |c, k| c.hset::<_, _, _, ()>(k[1], name, value).unwrap()
    }
    let runs = [
        Run {
            name: "acquire",
            script: &s.sem_acquire,
            keys: &[0, 1, 2],
            args: &["o", "1000", "3"],
        },
        Run {
            name: "retry",
            script: &s.sem_acquire,
            keys: &[0, 1, 2],
            args: &["live", "1000", "3"],
        },
        Run {
            name: "set_capacity",
            script: &s.sem_set_capacity,
            keys: &[1, 0],
            args: &["5"],
        },
        Run {
            name: "status",
            script: &s.sem_status,
            keys: &[0, 1, 2],
            args: &[],
        },
        Run {
            name: "extend",
            script: &s.sem_extend,
            keys: &[0, 1, 2],
            args: &["live:1:2", "1000"],
        },
        Run {
            name: "verify",
            script: &s.sem_verify,
            keys: &[0],
            args: &["live:1:2"],
        },
        Run {
            name: "release",
            script: &s.sem_release,
            keys: &[0, 1, 2],
            args: &["live:1:2", "exact"],
        },
        Run {
            name: "release_prefix",
            script: &s.sem_release,
            keys: &[0, 1, 2],
            args: &["live", "prefix"],
        },
    ];
    let not_integer = (
        "BADFENCE",
        "has a fence field that is not a non-negative integer",
    );
    let bad_capacity = (
        "BADKEY",
        "has a capacity field that is not a positive integer",
    );
    let cases = [
        Refusal::new(
            "permits is a string",
            |c, k| {
                let _: () = c.del(k[0]).unwrap();
                let _: () = c.set(k[0], "x").unwrap();
            },
            ("BADKEY", "holds a string, not a sorted set of permits"),
            &[
                "acquire",
                "retry",
                "set_capacity",
                "status",
                "extend",
                "verify",
                "release",
                "release_prefix",
            ],
        ),
        Refusal::new(
            "meta is a string",
            |c, k| {
                let _: () = c.del(k[1]).unwrap();
                let _: () = c.set(k[1], "3").unwrap();
            },
            ("BADKEY", "holds a string, not a semaphore hash"),
            META_TYPE_USERS,
        ),
        Refusal::new(
            "meta is a zset",
            |c, k| {
                let _: () = c.del(k[1]).unwrap();
                let _: () = c.zadd(k[1], "capacity", 3).unwrap();
            },
            ("BADKEY", "holds a zset, not a semaphore hash"),
            META_TYPE_USERS,
        ),
        Refusal::new(
            "slots is a hash",
            |c, k| {
                let _: () = c.del(k[2]).unwrap();
                let _: () = c.hset(k[2], "f", "v").unwrap();
            },
            ("BADKEY", "KEYS[3] holds a hash, not a slot bitmap"),
            &[
                "acquire",
                "retry",
                "status",
                "extend",
                "release",
                "release_prefix",
            ],
        ),
        Refusal::new(
            "meta has a TTL",
            |c, k| c.pexpire::<_, ()>(k[1], 60_000).unwrap(),
            ("BADFENCE", "has an expiry"),
            META_USERS,
        ),
        Refusal::new(
            "capacity is a word",
            field("capacity", "three"),
            bad_capacity,
            META_USERS,
        ),
        Refusal::new(
            "capacity is 0",
            field("capacity", "0"),
            bad_capacity,
            META_USERS,
        ),
        Refusal::new(
            "capacity is negative",
            field("capacity", "-3"),
            bad_capacity,
            META_USERS,
        ),
        Refusal::new(
            "fence is a word",
            field("fence", "abc"),
            not_integer,
            META_USERS,
        ),
        Refusal::new(
            "fence is negative",
            field("fence", "-1"),
            not_integer,
            META_USERS,
        ),
        Refusal::new(
            "fence is fractional",
            field("fence", "1.5"),
            not_integer,
            META_USERS,
        ),
        Refusal::new(
            "fence is empty",
            field("fence", ""),
            not_integer,
            META_USERS,
        ),
        Refusal::new(
            "fence is beyond i64",
            field("fence", "9223372036854775808"),
            not_integer,
            META_USERS,
        ),
    ];
    refuse_each(&mut c, "sem_refuse", baseline, names, &runs, &cases);
    // The key named in the error is the script's own KEYS index.
    let k = SemKeys::new("sem_refuse_index");
    c.set::<_, _, ()>(&k.meta, "x").unwrap();
    let e = s.sem_acquire.err(&mut c, &k.all(), &["o", "1000", "3"]);
    assert!(e.detail().unwrap().starts_with("KEYS[2] "), "{e}");
    let e = s
        .sem_set_capacity
        .err(&mut c, &[&k.meta, &k.permits], &["3"]);
    assert!(e.detail().unwrap().starts_with("KEYS[1] "), "{e}");
}

#[test]
fn a_random_schedule_never_exceeds_the_capacity_and_fences_every_slot() {
    const CAPACITY: u32 = 3;
    const STEPS: usize = 400;
    let (mut rng, seed) = Rng::seeded();
    println!("seed {seed} (replay with RWSEM_SEED={seed})");
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_random");

    struct Held {
        owner: String,
        member: String,
        slot: i64,
        token: u64,
        short: bool,
    }
    let mut held: Vec<Held> = Vec::new();
    let mut last_token = 0u64;
    let mut last_per_slot: BTreeMap<i64, u64> = BTreeMap::new();
    let (mut grants, mut busy, mut expiries, mut max_seen) = (0, 0, 0, 0);

    for step in 0..STEPS {
        let before = k.status(&mut c);
        let live_before: BTreeSet<i64> = before
            .holders
            .iter()
            .map(|(m, _)| parse_member(m).1)
            .collect();
        let ctx = format!("seed {seed} step {step}");
        match rng.below(100) {
            0..=54 => {
                let owner = format!("o{step}");
                let short = rng.below(2) == 0;
                let ttl = if short { 30 + rng.below(60) } else { 60_000 };
                match k.acquire(&mut c, &owner, ttl, CAPACITY) {
                    PermitReply::Granted { slot, token } => {
                        grants += 1;
                        let token: u64 = token.parse().unwrap();
                        assert!(
                            token > last_token,
                            "{ctx}: token {token} after {last_token}"
                        );
                        last_token = token;
                        let prev = last_per_slot.insert(slot, token).unwrap_or(0);
                        assert!(
                            token > prev,
                            "{ctx}: slot {slot} token {token} after {prev}"
                        );
                        let lowest_free = (0..).find(|s| !live_before.contains(s)).unwrap();
                        assert!(
                            slot <= lowest_free,
                            "{ctx}: slot {slot}, lowest free was {lowest_free}"
                        );
                        assert!((0..CAPACITY as i64).contains(&slot), "{ctx}: slot {slot}");
                        held.push(Held {
                            member: format!("{owner}:{slot}:{token}"),
                            owner,
                            slot,
                            token,
                            short,
                        });
                    }
                    PermitReply::Busy(hint) => {
                        busy += 1;
                        // Permits only expire between the status and the attempt.
                        assert!(
                            before.holders.len() >= CAPACITY as usize,
                            "{ctx}: busy with {before:?}"
                        );
                        assert!(hint > 0, "{ctx}: hint {hint}");
                    }
                }
            }
            55..=74 if !held.is_empty() => {
                let i = rng.below(held.len() as u64) as usize;
                let h = held.swap_remove(i);
                let r = k.release(&mut c, &h.member);
                assert!(
                    r == 1 || h.short,
                    "{ctx}: a long permit was gone at release"
                );
            }
            75..=84 if !held.is_empty() => {
                // A retry of a holder's acquire: same permit, no new token.
                let i = rng.below(held.len() as u64) as usize;
                let h = &held[i];
                let fence: String = c.hget(&k.meta, "fence").unwrap();
                let ttl = if h.short { 30 + rng.below(60) } else { 60_000 };
                match k.acquire(&mut c, &h.owner, ttl, CAPACITY) {
                    PermitReply::Granted { slot, token } => {
                        if token != h.token.to_string() {
                            // Only an expired short permit can be replaced.
                            assert!(h.short, "{ctx}: a long permit's retry got a new token");
                            let token: u64 = token.parse().unwrap();
                            assert!(token > last_token);
                            last_token = token;
                            let prev = last_per_slot.insert(slot, token).unwrap_or(0);
                            assert!(token > prev);
                            let h = &mut held[i];
                            h.slot = slot;
                            h.token = token;
                            h.member = format!("{}:{slot}:{token}", h.owner);
                        } else {
                            assert_eq!(slot, h.slot, "{ctx}");
                            assert_eq!(
                                c.hget::<_, _, String>(&k.meta, "fence").unwrap(),
                                fence,
                                "{ctx}: a retry drew a token"
                            );
                        }
                    }
                    PermitReply::Busy(_) => {
                        assert!(h.short, "{ctx}: a long permit's retry was refused")
                    }
                }
            }
            _ => {
                // Wait for the shortest live permit to expire.
                if let Some(h) = held.iter().find(|h| h.short) {
                    let member = h.member.clone();
                    wait_until(Duration::from_secs(5), "a short permit to expire", || {
                        k.verify(&mut c, &member).is_none()
                    });
                    expiries += 1;
                }
            }
        }
        let after = k.status(&mut c);
        let slots: Vec<i64> = after
            .holders
            .iter()
            .map(|(m, _)| parse_member(m).1)
            .collect();
        let distinct: BTreeSet<i64> = slots.iter().copied().collect();
        assert!(after.holders.len() <= CAPACITY as usize, "{ctx}: {after:?}");
        assert_eq!(
            distinct.len(),
            slots.len(),
            "{ctx}: a slot held twice: {after:?}"
        );
        max_seen = max_seen.max(after.holders.len());
        // Every live permit is one the model holds; every long one is live.
        for (m, _) in &after.holders {
            assert!(
                held.iter().any(|h| &h.member == m),
                "{ctx}: unknown permit {m}"
            );
        }
        held.retain(|h| {
            after.holders.iter().any(|(m, _)| m == &h.member) || {
                assert!(h.short, "{ctx}: long permit {} vanished", h.member);
                false
            }
        });
    }
    println!(
        "{grants} grants, {busy} busy, {expiries} waits for an expiry, at most {max_seen} holders"
    );
    assert_eq!(
        max_seen, CAPACITY as usize,
        "the schedule reached the capacity"
    );
    assert!(
        busy > 0 && expiries > 0,
        "the schedule exercised contention and expiry"
    );
}

#[test]
fn concurrent_permit_holders_never_exceed_the_capacity_or_share_a_slot() {
    const THREADS: usize = 6;
    const EACH: usize = 120;
    let server = shared_server();
    let k = SemKeys::new("sem_concurrent");
    let inside = Mutex::new([false; 3]);
    let max_inside = Mutex::new(0usize);
    let tokens = Mutex::new(Vec::new());
    thread::scope(|s| {
        for t in 0..THREADS {
            let (k, inside, max_inside, tokens) = (&k, &inside, &max_inside, &tokens);
            s.spawn(move || {
                let mut c = server.client();
                for i in 0..EACH {
                    let owner = format!("t{t}n{i}");
                    let (slot, token) = loop {
                        match k.acquire(&mut c, &owner, 10_000, 3) {
                            PermitReply::Granted { slot, token } => break (slot, token),
                            // A poll interval: this test checks exclusion, not waiting.
                            PermitReply::Busy(_) => thread::sleep(Duration::from_micros(300)),
                        }
                    };
                    {
                        let mut slots = inside.lock().unwrap();
                        assert!(!slots[slot as usize], "slot {slot} held twice");
                        slots[slot as usize] = true;
                        let n = slots.iter().filter(|b| **b).count();
                        let mut m = max_inside.lock().unwrap();
                        *m = (*m).max(n);
                        tokens
                            .lock()
                            .unwrap()
                            .push((slot, token.parse::<u64>().unwrap()));
                    }
                    thread::sleep(Duration::from_micros(500 * (i as u64 % 4)));
                    inside.lock().unwrap()[slot as usize] = false;
                    assert_eq!(k.release(&mut c, &format!("{owner}:{slot}:{token}")), 1);
                }
            });
        }
    });
    let tokens = tokens.into_inner().unwrap();
    assert_eq!(tokens.len(), THREADS * EACH);
    let mut per_slot: BTreeMap<i64, u64> = BTreeMap::new();
    for (slot, token) in &tokens {
        let prev = per_slot.insert(*slot, *token).unwrap_or(0);
        assert!(*token > prev, "slot {slot}: token {token} after {prev}");
    }
    let max_inside = max_inside.into_inner().unwrap();
    println!(
        "{} permits, at most {max_inside} at once, per slot: {per_slot:?}",
        tokens.len()
    );
    assert!(max_inside <= 3);
}

#[test]
fn concurrent_readers_and_writers_never_overlap_a_writer() {
    const THREADS: usize = 6;
    const EACH: usize = 100;
    let server = shared_server();
    let k = RwKeys::new("rw_concurrent");
    // (readers inside, writer inside, last write token)
    let state = Mutex::new((0usize, false, 0u64));
    let max_readers = Mutex::new(0usize);
    thread::scope(|s| {
        for t in 0..THREADS {
            let (k, state, max_readers) = (&k, &state, &max_readers);
            s.spawn(move || {
                let mut c = server.client();
                for i in 0..EACH {
                    let owner = format!("t{t}n{i}");
                    if (t + i) % 4 == 0 {
                        let token = loop {
                            match k.write(&mut c, &owner, 10_000, 2_000) {
                                Grant::Granted(token) => break token.parse::<u64>().unwrap(),
                                Grant::Busy(_) => thread::sleep(Duration::from_micros(300)),
                            }
                        };
                        {
                            let mut st = state.lock().unwrap();
                            assert!(!st.1 && st.0 == 0, "writer {token} overlaps {st:?}");
                            assert!(token > st.2, "token {token} after {}", st.2);
                            *st = (0, true, token);
                        }
                        thread::sleep(Duration::from_micros(300));
                        state.lock().unwrap().1 = false;
                        assert_eq!(k.release_writer(&mut c, &owner, &token.to_string()), 1);
                    } else {
                        let epoch = loop {
                            match k.read(&mut c, &owner, 10_000, "writer") {
                                Grant::Granted(epoch) => break epoch.parse::<u64>().unwrap(),
                                Grant::Busy(_) => thread::sleep(Duration::from_micros(300)),
                            }
                        };
                        {
                            let mut st = state.lock().unwrap();
                            assert!(!st.1, "reader overlaps a writer");
                            assert_eq!(epoch, st.2, "the reader's epoch is the last write token");
                            st.0 += 1;
                            let mut m = max_readers.lock().unwrap();
                            *m = (*m).max(st.0);
                        }
                        thread::sleep(Duration::from_micros(500));
                        state.lock().unwrap().0 -= 1;
                        assert_eq!(k.read_release(&mut c, &owner), 1);
                    }
                }
            });
        }
    });
    let st = state.into_inner().unwrap();
    println!(
        "last write token {}, at most {} readers at once",
        st.2,
        max_readers.into_inner().unwrap()
    );
    assert_eq!(
        st.2,
        (0..THREADS)
            .map(|t| (0..EACH).filter(|i| (t + i) % 4 == 0).count() as u64)
            .sum::<u64>()
    );
}

// ---------------------------------------------------------------------------
// Client tracking: a busy attempt arms invalidations for what could free it
// ---------------------------------------------------------------------------
//
// Seen on 7.0.15: each read-only command a script runs makes the caller track
// every key the EVAL declares, and a write to a key inside the script ends the
// caller's tracking of that key (and sends the caller an invalidation of it)
// until the next read-only command. So a busy path must end with a read after
// its last write; the scripts also read each key that could free the attempt
// after their last write to it, which servers that track only the keys a
// command reads need.

/// A RESP2 connection subscribed to the invalidation channel, as the library's
/// subscriber thread uses, and a command connection redirected to it.
struct Tracker {
    sub: redis::Connection,
    tracked: redis::Connection,
    admin: redis::Connection,
    marker: String,
}

impl Tracker {
    fn new(server: &TestServer, prefix: &str) -> Tracker {
        let mut sub = server.client();
        let id: i64 = redis::cmd("CLIENT").arg("ID").query(&mut sub).unwrap();
        let mut tracked = server.client();
        let _: () = redis::cmd("CLIENT")
            .arg("TRACKING")
            .arg("ON")
            .arg("REDIRECT")
            .arg(id)
            .query(&mut tracked)
            .unwrap();
        Tracker {
            sub,
            tracked,
            admin: server.client(),
            marker: format!("{prefix}marker"),
        }
    }
}

/// Keys named by the invalidations that arrive on `ps` until one names `stop`.
fn keys_until(ps: &mut redis::PubSub<'_>, stop: &str, deadline: Duration) -> Vec<String> {
    let start = Instant::now();
    let mut seen = Vec::new();
    loop {
        assert!(
            start.elapsed() < deadline,
            "no invalidation for {stop} within {deadline:?}; saw {seen:?}"
        );
        match ps.get_message() {
            Ok(msg) => {
                if msg.get_channel_name() != "__redis__:invalidate" {
                    continue;
                }
                let keys = match msg.get_payload::<Value>().unwrap() {
                    Value::Array(keys) => keys,
                    other => panic!("unexpected invalidation payload {other:?}"),
                };
                for key in keys {
                    let key = text(&key);
                    if key == stop {
                        return seen;
                    }
                    seen.push(key);
                }
            }
            Err(e) if e.is_timeout() => continue,
            Err(e) => panic!("subscriber failed: {e}"),
        }
    }
}

/// Runs `busy` on the tracked connection, then makes sure every invalidation it
/// caused itself has been received (a marker key read after it and changed by
/// another connection arrives after them), then runs `free` on another
/// connection and waits for an invalidation of `key`. Returns the keys the busy
/// attempt invalidated itself (its own writes, such as pruning).
fn busy_then_woken(
    t: &mut Tracker,
    busy: impl FnOnce(&mut redis::Connection),
    free: impl FnOnce(&mut redis::Connection),
    key: &str,
) -> Vec<String> {
    let mut ps = t.sub.as_pubsub();
    ps.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    ps.subscribe("__redis__:invalidate").unwrap();
    busy(&mut t.tracked);
    let _: Option<String> = t.tracked.get(&t.marker).unwrap();
    let _: () = t.admin.incr(&t.marker, 1).unwrap();
    let own = keys_until(&mut ps, &t.marker, Duration::from_secs(10));
    free(&mut t.admin);
    let others = keys_until(&mut ps, key, Duration::from_secs(10));
    assert!(
        !others.iter().any(|k| k == key),
        "unexpected keys before {key}: {others:?}"
    );
    own
}

#[test]
fn a_reader_held_back_is_woken_by_the_writers_release_and_by_the_withdraw() {
    let server = shared_server();
    let k = RwKeys::new("track_reader");
    let mut t = Tracker::new(server, &k.prefix);

    // Held back by a writer: its release wakes the reader.
    let token = k.write(&mut t.admin, "w1", 60_000, 0).token().to_owned();
    busy_then_woken(
        &mut t,
        |c| assert!(k.read(c, "r1", 10_000, "writer").hint() > 0),
        |c| assert_eq!(k.release_writer(c, "w1", &token), 1),
        &k.w,
    );

    // Held back by an intent, with an expired intent beside it: the attempt
    // prunes (a write, which ends tracking) and must read the set again.
    k.read(&mut t.admin, "holder", 60_000, "writer").token();
    k.write(&mut t.admin, "w2", 60_000, 60_000).hint();
    let now = server_ms(&mut t.admin);
    t.admin
        .zadd::<_, _, _, ()>(&k.q, "crashed", now - 1_000)
        .unwrap();
    let own = busy_then_woken(
        &mut t,
        |c| assert!(k.read(c, "r1", 10_000, "writer").hint() > 0),
        |c| assert_eq!(k.withdraw(c, "w2"), 1),
        &k.q,
    );
    assert!(
        own.contains(&k.q),
        "the attempt pruned the intents: {own:?}"
    );
    assert_eq!(
        k.read(&mut t.admin, "r1", 10_000, "writer"),
        Grant::Granted("1".into())
    );
}

#[test]
fn a_writer_held_back_is_woken_by_the_last_reader_and_by_the_other_writer() {
    let server = shared_server();
    let k = RwKeys::new("track_writer");
    let mut t = Tracker::new(server, &k.prefix);

    k.read(&mut t.admin, "r1", 60_000, "writer").token();
    let now = server_ms(&mut t.admin);
    t.admin
        .zadd::<_, _, _, ()>(&k.r, "crashed", now - 1_000)
        .unwrap();
    let own = busy_then_woken(
        &mut t,
        |c| assert!(k.write(c, "w1", 10_000, 5_000).hint() > 0),
        |c| assert_eq!(k.read_release(c, "r1"), 1),
        &k.r,
    );
    assert!(
        own.contains(&k.r),
        "the attempt pruned the readers: {own:?}"
    );

    let token = k.write(&mut t.admin, "w2", 60_000, 0).token().to_owned();
    busy_then_woken(
        &mut t,
        |c| assert!(k.write(c, "w1", 10_000, 5_000).hint() > 0),
        |c| assert_eq!(k.release_writer(c, "w2", &token), 1),
        &k.w,
    );
    assert_eq!(
        k.write(&mut t.admin, "w1", 10_000, 0),
        Grant::Granted("2".into())
    );
}

#[test]
fn a_full_semaphore_wakes_its_waiter_on_a_release_and_on_a_raised_capacity() {
    let server = shared_server();
    let k = SemKeys::new("track_sem");
    let mut t = Tracker::new(server, &k.prefix);
    let a = SemKeys::member("a", &k.acquire(&mut t.admin, "a", 60_000, 2));
    k.acquire(&mut t.admin, "b", 60_000, 2).granted();
    let now = server_ms(&mut t.admin);
    t.admin
        .zadd::<_, _, _, ()>(&k.permits, "crashed:5:0", now - 1_000)
        .unwrap();
    let own = busy_then_woken(
        &mut t,
        |c| assert!(k.acquire(c, "w", 10_000, 2).hint() > 0),
        |c| assert_eq!(k.release(c, &a), 1),
        &k.permits,
    );
    assert!(
        own.contains(&k.permits),
        "the attempt pruned the permits: {own:?}"
    );

    k.acquire(&mut t.admin, "a", 60_000, 2).granted();
    busy_then_woken(
        &mut t,
        |c| assert!(k.acquire(c, "w", 10_000, 2).hint() > 0),
        |c| assert_eq!(k.set_capacity(c, 3), 2),
        &k.meta,
    );
    assert_eq!(k.acquire(&mut t.admin, "w", 10_000, 3).granted().0, 2);

    // Permits with no stored capacity: the busy attempt stores it (a write) and
    // must read it again to be woken when it is raised.
    let k = SemKeys::new("track_sem_nocap");
    let now = server_ms(&mut t.admin);
    t.admin
        .zadd_multiple::<_, _, _, ()>(
            &k.permits,
            &[(now + 60_000, "x:0:1"), (now + 60_000, "y:1:2")],
        )
        .unwrap();
    let own = busy_then_woken(
        &mut t,
        |c| assert!(k.acquire(c, "w", 10_000, 2).hint() > 0),
        |c| assert_eq!(k.set_capacity(c, 3), 2),
        &k.meta,
    );
    assert!(
        own.contains(&k.meta),
        "the attempt stored the capacity: {own:?}"
    );
}

#[test]
fn sets_that_expire_by_themselves_wake_their_waiters() {
    // A fresh server: few keys with a TTL, so the server's expiry cycle finds
    // the sets promptly.
    let server = TestServer::start();
    let k = RwKeys::new("track_expiry");
    let mut t = Tracker::new(&server, &k.prefix);

    // An intent nobody withdraws: the intent set's own expiry wakes the reader.
    k.read(&mut t.admin, "holder", 60_000, "writer").token();
    k.write(&mut t.admin, "crashed", 60_000, 500).hint();
    let start = Instant::now();
    busy_then_woken(
        &mut t,
        |c| assert!(k.read(c, "r1", 10_000, "writer").hint() <= 500),
        |_| {},
        &k.q,
    );
    println!(
        "intent set expired and invalidated {:?} after it was written",
        start.elapsed()
    );
    assert!(!t.admin.exists::<_, bool>(&k.q).unwrap());
    assert_eq!(
        k.read(&mut t.admin, "r1", 10_000, "writer"),
        Grant::Granted("0".into())
    );

    // Readers that stop renewing: the reader set's own expiry wakes the writer.
    assert_eq!(k.read_extend(&mut t.admin, "holder", 500), 1);
    assert_eq!(k.read_extend(&mut t.admin, "r1", 400), 1);
    let start = Instant::now();
    busy_then_woken(
        &mut t,
        |c| assert!(k.write(c, "w1", 10_000, 0).hint() <= 500),
        |_| {},
        &k.r,
    );
    println!(
        "reader set expired and invalidated {:?} after the last renewal",
        start.elapsed()
    );
    assert_eq!(
        k.write(&mut t.admin, "w1", 10_000, 0),
        Grant::Granted("1".into())
    );
}
