//! What the script tests of the reader/writer lease (tests/scripts_rwlease.rs)
//! and the semaphore (tests/scripts_semaphore.rs) share: the shipped scripts
//! loaded and run directly, their replies read, the keys of each primitive,
//! the refusal table, and a client-tracking subscriber that shows which keys
//! a busy attempt armed.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use redis::{Commands, Value};

use crate::support::{TestServer, snapshot, unique_prefix};
// ---------------------------------------------------------------------------
// Running the scripts
// ---------------------------------------------------------------------------

/// A script's source and SHA1.
pub(crate) struct Lua {
    pub(crate) code: &'static str,
    pub(crate) sha: String,
}

macro_rules! lua {
    ($name:literal) => {
        Lua::new(include_str!(concat!("../../src/scripts/", $name, ".lua")))
    };
}

impl Lua {
    pub(crate) fn new(code: &'static str) -> Lua {
        Lua {
            code,
            sha: redis::Script::new(code).get_hash().to_owned(),
        }
    }

    /// EVALSHA, and EVAL when the server does not have the script yet.
    pub(crate) fn run(
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
    pub(crate) fn ok(&self, conn: &mut redis::Connection, keys: &[&str], args: &[&str]) -> Value {
        self.run(conn, keys, args)
            .unwrap_or_else(|e| panic!("script failed with keys {keys:?} args {args:?}: {e}"))
    }

    /// Runs the script and returns its error reply.
    #[track_caller]
    pub(crate) fn err(
        &self,
        conn: &mut redis::Connection,
        keys: &[&str],
        args: &[&str],
    ) -> redis::RedisError {
        match self.run(conn, keys, args) {
            Err(e) => e,
            Ok(v) => panic!("expected an error reply for keys {keys:?} args {args:?}, got {v:?}"),
        }
    }
}

pub(crate) struct Scripts {
    pub(crate) read_acquire: Lua,
    pub(crate) read_extend: Lua,
    pub(crate) read_verify: Lua,
    pub(crate) read_release: Lua,
    pub(crate) write_acquire: Lua,
    pub(crate) write_withdraw: Lua,
    pub(crate) write_clean_up: Lua,
    pub(crate) lease_extend: Lua,
    pub(crate) lease_verify: Lua,
    pub(crate) lease_release: Lua,
    pub(crate) sem_acquire: Lua,
    pub(crate) sem_extend: Lua,
    pub(crate) sem_verify: Lua,
    pub(crate) sem_release: Lua,
    pub(crate) sem_set_capacity: Lua,
    pub(crate) sem_status: Lua,
}

pub(crate) fn scripts() -> &'static Scripts {
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
pub(crate) enum Grant {
    /// The write epoch (reader) or the fencing token (writer), as sent: a string.
    Granted(String),
    /// The wait hint in ms.
    Busy(i64),
}

impl Grant {
    #[track_caller]
    pub(crate) fn token(&self) -> &str {
        match self {
            Grant::Granted(t) => t,
            Grant::Busy(h) => panic!("expected a grant, got busy with hint {h}"),
        }
    }

    #[track_caller]
    pub(crate) fn hint(&self) -> i64 {
        match self {
            Grant::Busy(h) => *h,
            Grant::Granted(t) => panic!("expected busy, got a grant with {t}"),
        }
    }
}

pub(crate) fn text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).expect("utf-8"),
        other => panic!("expected a bulk string (tokens travel as strings), got {other:?}"),
    }
}

#[track_caller]
pub(crate) fn grant(v: Value) -> Grant {
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
pub(crate) enum PermitReply {
    Granted { slot: i64, token: String },
    Busy(i64),
}

impl PermitReply {
    #[track_caller]
    pub(crate) fn granted(&self) -> (i64, &str) {
        match self {
            PermitReply::Granted { slot, token } => (*slot, token),
            PermitReply::Busy(h) => panic!("expected a permit, got busy with hint {h}"),
        }
    }

    #[track_caller]
    pub(crate) fn hint(&self) -> i64 {
        match self {
            PermitReply::Busy(h) => *h,
            other => panic!("expected busy, got {other:?}"),
        }
    }
}

#[track_caller]
pub(crate) fn permit(v: Value) -> PermitReply {
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
pub(crate) fn int(v: Value) -> i64 {
    match v {
        Value::Int(n) => n,
        other => panic!("expected an integer, got {other:?}"),
    }
}

/// `{1, remaining}` → `Some(remaining)`; `{0}` → `None`.
#[track_caller]
pub(crate) fn verified(v: Value) -> Option<i64> {
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
pub(crate) struct Status {
    pub(crate) capacity: i64,
    pub(crate) holders: Vec<(String, i64)>,
}

#[track_caller]
pub(crate) fn status(v: Value) -> Status {
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
pub(crate) fn parse_member(m: &str) -> (&str, i64, u64) {
    let mut parts = m.rsplitn(3, ':');
    let token = parts.next().unwrap().parse().unwrap();
    let slot = parts.next().unwrap().parse().unwrap();
    (parts.next().unwrap(), slot, token)
}

// ---------------------------------------------------------------------------
// Keys and state
// ---------------------------------------------------------------------------

/// The four keys of one reader/writer lease.
pub(crate) struct RwKeys {
    pub(crate) prefix: String,
    pub(crate) w: String,
    pub(crate) r: String,
    pub(crate) q: String,
    pub(crate) fence: String,
}

impl RwKeys {
    pub(crate) fn new(test: &str) -> RwKeys {
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

    pub(crate) fn all(&self) -> [&str; 4] {
        [&self.w, &self.r, &self.q, &self.fence]
    }

    pub(crate) fn read(
        &self,
        conn: &mut redis::Connection,
        owner: &str,
        ttl: u64,
        pref: &str,
    ) -> Grant {
        grant(
            scripts()
                .read_acquire
                .ok(conn, &self.all(), &[owner, &ttl.to_string(), pref]),
        )
    }

    pub(crate) fn write(
        &self,
        conn: &mut redis::Connection,
        owner: &str,
        ttl: u64,
        intent: u64,
    ) -> Grant {
        grant(scripts().write_acquire.ok(
            conn,
            &self.all(),
            &[owner, &ttl.to_string(), &intent.to_string()],
        ))
    }

    pub(crate) fn release_writer(
        &self,
        conn: &mut redis::Connection,
        owner: &str,
        token: &str,
    ) -> i64 {
        int(scripts()
            .lease_release
            .ok(conn, &[&self.w], &[&format!("{owner}:{token}"), "exact"]))
    }

    pub(crate) fn withdraw(&self, conn: &mut redis::Connection, owner: &str) -> i64 {
        int(scripts().write_withdraw.ok(conn, &[&self.q], &[owner]))
    }

    pub(crate) fn read_extend(&self, conn: &mut redis::Connection, owner: &str, ttl: u64) -> i64 {
        int(scripts()
            .read_extend
            .ok(conn, &[&self.r], &[owner, &ttl.to_string()]))
    }

    pub(crate) fn read_verify(&self, conn: &mut redis::Connection, owner: &str) -> Option<i64> {
        verified(scripts().read_verify.ok(conn, &[&self.r], &[owner]))
    }

    pub(crate) fn read_release(&self, conn: &mut redis::Connection, owner: &str) -> i64 {
        int(scripts().read_release.ok(conn, &[&self.r], &[owner]))
    }
}

/// The three keys of one semaphore.
pub(crate) struct SemKeys {
    pub(crate) prefix: String,
    pub(crate) permits: String,
    pub(crate) meta: String,
    pub(crate) slots: String,
}

impl SemKeys {
    pub(crate) fn new(test: &str) -> SemKeys {
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
    pub(crate) fn all(&self) -> [&str; 3] {
        [&self.permits, &self.meta, &self.slots]
    }

    pub(crate) fn acquire(
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

    pub(crate) fn member(owner: &str, reply: &PermitReply) -> String {
        let (slot, token) = reply.granted();
        format!("{owner}:{slot}:{token}")
    }

    pub(crate) fn release(&self, conn: &mut redis::Connection, member: &str) -> i64 {
        int(scripts()
            .sem_release
            .ok(conn, &self.all(), &[member, "exact"]))
    }

    pub(crate) fn release_owner(&self, conn: &mut redis::Connection, owner: &str) -> i64 {
        int(scripts()
            .sem_release
            .ok(conn, &self.all(), &[owner, "prefix"]))
    }

    pub(crate) fn extend(&self, conn: &mut redis::Connection, member: &str, ttl: u64) -> i64 {
        int(scripts()
            .sem_extend
            .ok(conn, &self.all(), &[member, &ttl.to_string()]))
    }

    pub(crate) fn verify(&self, conn: &mut redis::Connection, member: &str) -> Option<i64> {
        verified(scripts().sem_verify.ok(conn, &[&self.permits], &[member]))
    }

    pub(crate) fn set_capacity(&self, conn: &mut redis::Connection, cap: u32) -> i64 {
        int(scripts()
            .sem_set_capacity
            .ok(conn, &[&self.meta, &self.permits], &[&cap.to_string()]))
    }

    pub(crate) fn status(&self, conn: &mut redis::Connection) -> Status {
        status(scripts().sem_status.ok(conn, &self.all(), &[]))
    }

    /// The slots the bitmap marks taken, and the holders the hash indexes
    /// (owner → slot:token): both must match the permit set.
    pub(crate) fn check_index(&self, conn: &mut redis::Connection) {
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
pub(crate) fn server_ms(conn: &mut redis::Connection) -> i64 {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    secs * 1000 + micros / 1000
}

pub(crate) fn pexpiretime(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PEXPIRETIME").arg(key).query(conn).unwrap()
}

pub(crate) fn zscore(conn: &mut redis::Connection, key: &str, member: &str) -> Option<i64> {
    let s: Option<f64> = conn.zscore(key, member).unwrap();
    s.map(|s| s as i64)
}

/// Puts a bad key in place, given the keys of one primitive.
pub(crate) type Setup = Box<dyn Fn(&mut redis::Connection, &[&str])>;

/// One refusal case: the bad key to put in place, the error expected, and
/// the scripts (by name) that must refuse it.
pub(crate) struct Refusal {
    pub(crate) what: String,
    pub(crate) setup: Setup,
    pub(crate) code: &'static str,
    /// A part of the error's detail.
    pub(crate) detail: &'static str,
    pub(crate) scripts: &'static [&'static str],
}

impl Refusal {
    pub(crate) fn new(
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
pub(crate) struct Run {
    pub(crate) name: &'static str,
    pub(crate) script: &'static Lua,
    pub(crate) keys: &'static [usize],
    pub(crate) args: &'static [&'static str],
}

/// For every case and every script it names: a fresh set of keys in the
/// baseline state, the bad key, then the script must give the error and leave
/// every key exactly as it was.
pub(crate) fn refuse_each(
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
pub(crate) struct Tracker {
    pub(crate) sub: redis::Connection,
    pub(crate) tracked: redis::Connection,
    pub(crate) admin: redis::Connection,
    pub(crate) marker: String,
}

impl Tracker {
    pub(crate) fn new(server: &TestServer, prefix: &str) -> Tracker {
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
pub(crate) fn keys_until(
    ps: &mut redis::PubSub<'_>,
    stop: &str,
    deadline: Duration,
) -> Vec<String> {
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
pub(crate) fn busy_then_woken(
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
