//! The data of one model server and the data commands over it, with the
//! semantics of Redis 7.0: strings, hashes and sorted sets, millisecond
//! expiries, `WRONGTYPE`, and the exact error texts a client sees.
//!
//! A key whose expiry time is `when` exists while the server time is at or
//! before `when` and is gone from `when + 1` on (Redis `keyIsExpired`:
//! `now > when`); `PTTL` reads 0 in that last millisecond. `PEXPIRE` and
//! `PEXPIREAT` to a time at or before now delete the key at once, as a
//! primary does. Inside a script, whether a key has expired is decided at
//! the time the script started, while `TIME`, `PTTL` and the base of `SET PX`
//! and `PEXPIRE` read the clock (Redis 7.0; the two differ only in a script
//! that straddles a millisecond boundary).

use std::collections::{BTreeMap, BTreeSet};

use super::Reply;

/// Redis's reply to a command on a key of another type.
pub(crate) const WRONGTYPE: &str =
    "WRONGTYPE Operation against a key holding the wrong kind of value";
const NOT_INTEGER: &str = "ERR value is not an integer or out of range";
const OVERFLOW: &str = "ERR increment or decrement would overflow";
const SYNTAX: &str = "ERR syntax error";
const NOT_FLOAT: &str = "ERR value is not a valid float";
const MIN_MAX: &str = "ERR min or max is not a float";

/// A stored value.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Value {
    /// A string (also a bitmap).
    Str(Vec<u8>),
    /// A hash: field → value.
    Hash(Fields),
    /// A sorted set.
    ZSet(ZSet),
}

impl Value {
    /// The name `TYPE` answers.
    pub(crate) fn type_name(&self) -> &'static str {
        match self {
            Value::Str(_) => "string",
            Value::Hash(_) => "hash",
            Value::ZSet(_) => "zset",
        }
    }
}

/// A score with the total order Redis gives scores (they are never NaN).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Score(f64);

impl Eq for Score {}

impl PartialOrd for Score {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Score {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // -0.0 and 0.0 compare equal, as in Redis.
        self.0
            .partial_cmp(&other.0)
            .unwrap_or(std::cmp::Ordering::Equal)
    }
}

/// A sorted set: members ordered by score, then by member bytes.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ZSet {
    scores: BTreeMap<Vec<u8>, f64>,
    order: BTreeSet<(Score, Vec<u8>)>,
}

impl ZSet {
    /// The member's score.
    pub(crate) fn score(&self, member: &[u8]) -> Option<f64> {
        self.scores.get(member).copied()
    }

    /// Sets a member's score; whether it was new.
    pub(crate) fn insert(&mut self, member: Vec<u8>, score: f64) -> bool {
        let old = self.scores.insert(member.clone(), score);
        if let Some(old) = old {
            self.order.remove(&(Score(old), member.clone()));
        }
        self.order.insert((Score(score), member));
        old.is_none()
    }

    /// Removes a member; whether it was there.
    pub(crate) fn remove(&mut self, member: &[u8]) -> bool {
        match self.scores.remove(member) {
            Some(old) => {
                self.order.remove(&(Score(old), member.to_vec()));
                true
            }
            None => false,
        }
    }

    /// The number of members.
    pub(crate) fn len(&self) -> usize {
        self.scores.len()
    }

    /// Whether it has no member (Redis deletes such a key).
    pub(crate) fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    /// Members with their scores, lowest score first.
    pub(crate) fn iter(&self) -> impl DoubleEndedIterator<Item = (&[u8], f64)> + '_ {
        self.order.iter().map(|(s, m)| (m.as_slice(), s.0))
    }
}

/// A hash's fields in the order they were first set, as a small Redis hash
/// (listpack) keeps them and `HGETALL` returns them. (A hash of more than
/// 128 fields is a hash table in Redis, in no particular order; the model
/// keeps insertion order.)
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Fields(Vec<(Vec<u8>, Vec<u8>)>);

impl Fields {
    /// The field's value.
    pub(crate) fn get(&self, field: &[u8]) -> Option<&Vec<u8>> {
        self.0.iter().find(|(f, _)| f == field).map(|(_, v)| v)
    }

    /// Sets a field (a new one goes last); the old value.
    pub(crate) fn insert(&mut self, field: Vec<u8>, value: Vec<u8>) -> Option<Vec<u8>> {
        match self.0.iter_mut().find(|(f, _)| *f == field) {
            Some((_, v)) => Some(std::mem::replace(v, value)),
            None => {
                self.0.push((field, value));
                None
            }
        }
    }

    /// Removes a field; its value.
    pub(crate) fn remove(&mut self, field: &[u8]) -> Option<Vec<u8>> {
        let i = self.0.iter().position(|(f, _)| f == field)?;
        Some(self.0.remove(i).1)
    }

    /// Whether it has no field (Redis deletes such a key).
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Fields with their values, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&Vec<u8>, &Vec<u8>)> + '_ {
        self.0.iter().map(|(f, v)| (f, v))
    }
}

/// A key's value and its expiry (absolute server milliseconds).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Entry {
    /// What the key holds.
    pub(crate) value: Value,
    /// `PEXPIRETIME`: the key exists while the server time is at or before it.
    pub(crate) expire_at: Option<i64>,
}

/// The keys of one server (database 0).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Keyspace {
    keys: BTreeMap<Vec<u8>, Entry>,
    /// Keys written (or deleted) since the last [`Keyspace::take_changed`].
    changed: BTreeSet<Vec<u8>>,
    /// A replica never deletes a key because of its expiry: it only hides
    /// it, and waits for the primary's deletion.
    replica: bool,
    /// While a script runs: the time it started, which decides whether a key
    /// has expired (Redis 7.0 keeps it for the whole script), while `TIME`,
    /// `PTTL` and the base of `SET PX` and `PEXPIRE` read the clock passed to
    /// [`Keyspace::exec`].
    script_start: Option<i64>,
    /// `SET` with both `NX` and `GET` is a syntax error, as before Redis 7.0.
    refuses_nx_with_get: bool,
}

/// A command's name and arity (Redis's convention: `n` exactly n arguments
/// with the name, `-n` at least n) and whether it writes.
pub(crate) struct CommandSpec {
    /// Lower-case name.
    pub(crate) name: &'static str,
    /// Redis arity.
    pub(crate) arity: i32,
    /// Whether it may change data (denied on a replica, counted for `WAIT`).
    pub(crate) write: bool,
}

const COMMANDS: &[CommandSpec] = &[
    spec("type", 2, false),
    spec("get", 2, false),
    spec("set", -3, true),
    spec("del", -2, true),
    spec("exists", -2, false),
    spec("incr", 2, true),
    spec("pexpire", -3, true),
    spec("pexpireat", -3, true),
    spec("pexpiretime", 2, false),
    spec("pttl", 2, false),
    spec("time", 1, false),
    spec("hget", 3, false),
    spec("hset", -4, true),
    spec("hdel", -3, true),
    spec("hmget", -3, false),
    spec("hincrby", 4, true),
    spec("hgetall", 2, false),
    spec("zadd", -4, true),
    spec("zrem", -3, true),
    spec("zscore", 3, false),
    spec("zrank", 3, false),
    spec("zcard", 2, false),
    spec("zrange", -4, false),
    spec("zrangebyscore", -4, false),
    spec("zremrangebyscore", 4, true),
    spec("setbit", 4, true),
    spec("getbit", 3, false),
    spec("bitpos", -3, false),
    spec("dbsize", 1, false),
    spec("ping", -1, false),
];

const fn spec(name: &'static str, arity: i32, write: bool) -> CommandSpec {
    CommandSpec { name, arity, write }
}

/// The data command named `name` (any case), if the keyspace implements it.
pub(crate) fn command_spec(name: &[u8]) -> Option<&'static CommandSpec> {
    COMMANDS
        .iter()
        .find(|c| c.name.as_bytes().eq_ignore_ascii_case(name))
}

/// Whether `argc` arguments (with the name) fit an arity.
pub(crate) fn arity_ok(arity: i32, argc: usize) -> bool {
    let argc = argc as i64;
    if arity >= 0 {
        argc == i64::from(arity)
    } else {
        argc >= -i64::from(arity)
    }
}

fn err(text: &str) -> Reply {
    Reply::Error(text.to_owned())
}

fn wrong_args(name: &str) -> Reply {
    Reply::Error(format!(
        "ERR wrong number of arguments for '{name}' command"
    ))
}

/// Redis's strict integer parsing (`string2ll`): an optional `-`, no `+`, no
/// leading zeros, no spaces, within `i64`.
pub(crate) fn parse_i64(bytes: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(bytes).ok()?;
    let digits = text.strip_prefix('-').unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if digits.len() > 1 && digits.starts_with('0') {
        return None;
    }
    if digits == "0" && text.starts_with('-') {
        return None;
    }
    text.parse().ok()
}

/// A float as Redis parses a score (`strtod` of the whole string, no NaN).
fn parse_f64(bytes: &[u8]) -> Option<f64> {
    let text = std::str::from_utf8(bytes).ok()?;
    if text.is_empty() || text.starts_with(char::is_whitespace) {
        return None;
    }
    let value: f64 = text.parse().ok()?;
    (!value.is_nan()).then_some(value)
}

/// A range bound of `ZRANGEBYSCORE`: `(x` is exclusive.
fn parse_bound(bytes: &[u8]) -> Option<(f64, bool)> {
    match bytes.strip_prefix(b"(") {
        Some(rest) => parse_f64(rest).map(|v| (v, true)),
        None => parse_f64(bytes).map(|v| (v, false)),
    }
}

/// C's `%.17g`, which Redis 7.0 uses to print scores (and to pass Lua
/// numbers to commands).
pub(crate) fn format_g17(x: f64) -> String {
    if x.is_nan() {
        return if x.is_sign_negative() { "-nan" } else { "nan" }.to_owned();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0" } else { "0" }.to_owned();
    }
    // A whole number below 2^53 has at most 16 digits: `%.17g` prints it as
    // an integer.
    if x.fract() == 0.0 && x.abs() < 9_007_199_254_740_992.0 {
        return (x as i64).to_string();
    }
    let sci = format!("{x:.16e}");
    let (mantissa, exp) = sci.split_once('e').expect("exponent form");
    let exp: i32 = exp.parse().expect("exponent");
    if !(-4..17).contains(&exp) {
        let mantissa = strip_zeros(mantissa);
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    } else {
        let decimals = usize::try_from(16 - exp).unwrap_or(0);
        strip_zeros(&format!("{x:.decimals$}")).to_owned()
    }
}

fn strip_zeros(text: &str) -> &str {
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.')
    } else {
        text
    }
}

fn bulk(bytes: &[u8]) -> Reply {
    Reply::Bulk(bytes.to_vec())
}

fn int(n: impl TryInto<i64>) -> Reply {
    Reply::Int(n.try_into().unwrap_or(i64::MAX))
}

fn score_reply(score: f64) -> Reply {
    Reply::Bulk(format_g17(score).into_bytes())
}

impl Keyspace {
    /// An empty keyspace; `replica` keeps expired keys (hidden) until the
    /// primary deletes them.
    pub(crate) fn new(replica: bool) -> Self {
        Keyspace {
            replica,
            ..Keyspace::default()
        }
    }

    /// Answers `SET` with both `NX` and `GET` with a syntax error and runs
    /// nothing, as Redis before 7.0 does.
    pub(crate) fn refuse_nx_with_get(&mut self) {
        self.refuses_nx_with_get = true;
    }

    /// Makes this a primary's keyspace (expired keys are deleted from now
    /// on) or a replica's.
    pub(crate) fn set_replica(&mut self, replica: bool) {
        self.replica = replica;
    }

    /// The live entry of `key` at `now`, without deleting anything.
    pub(crate) fn peek(&self, key: &[u8], now: i64) -> Option<&Entry> {
        self.keys
            .get(key)
            .filter(|e| e.expire_at.is_none_or(|when| now <= when))
    }

    /// Every live key with its entry at `now`, in key order.
    pub(crate) fn entries(&self, now: i64) -> impl Iterator<Item = (&[u8], &Entry)> + '_ {
        self.keys
            .iter()
            .filter(move |(_, e)| e.expire_at.is_none_or(|when| now <= when))
            .map(|(k, e)| (k.as_slice(), e))
    }

    /// Sets a key's whole entry (or deletes it), as a replication stream or
    /// a test fixture would.
    pub(crate) fn put(&mut self, key: &[u8], entry: Option<Entry>) {
        match entry {
            Some(entry) => self.keys.insert(key.to_vec(), entry),
            None => self.keys.remove(key),
        };
        self.changed.insert(key.to_vec());
    }

    /// The keys changed since the last call, each with its entry now
    /// (`None`: deleted), in key order.
    pub(crate) fn take_changed(&mut self) -> Vec<(Vec<u8>, Option<Entry>)> {
        let changed = std::mem::take(&mut self.changed);
        changed
            .into_iter()
            .map(|k| {
                let entry = self.keys.get(&k).cloned();
                (k, entry)
            })
            .collect()
    }

    /// Deletes every key whose expiry is before `now` (active expiry); a
    /// replica's keyspace keeps them.
    pub(crate) fn expire_all(&mut self, now: i64) {
        if self.replica {
            return;
        }
        let expired: Vec<Vec<u8>> = self
            .keys
            .iter()
            .filter(|(_, e)| e.expire_at.is_some_and(|when| now > when))
            .map(|(k, _)| k.clone())
            .collect();
        for key in expired {
            self.keys.remove(&key);
            self.changed.insert(key);
        }
    }

    /// The entry of `key` at `now`; an expired one is deleted first (lazy
    /// expiry) on a primary and hidden on a replica.
    fn live(&mut self, key: &[u8], now: i64) -> Option<&mut Entry> {
        let now = self.script_start.unwrap_or(now);
        let expired = self
            .keys
            .get(key)
            .is_some_and(|e| e.expire_at.is_some_and(|when| now > when));
        if expired {
            if self.replica {
                return None;
            }
            self.keys.remove(key);
            self.changed.insert(key.to_vec());
        }
        self.keys.get_mut(key)
    }

    fn remove(&mut self, key: &[u8], now: i64) -> bool {
        if self.live(key, now).is_some() {
            self.keys.remove(key);
            self.changed.insert(key.to_vec());
            true
        } else {
            false
        }
    }

    fn insert(&mut self, key: &[u8], entry: Entry) {
        self.keys.insert(key.to_vec(), entry);
        self.changed.insert(key.to_vec());
    }

    fn touch(&mut self, key: &[u8]) {
        self.changed.insert(key.to_vec());
    }

    /// Sets (or with `None` clears) the start time of the running script:
    /// expiry decisions use it instead of the clock.
    pub(crate) fn set_script_start(&mut self, start: Option<i64>) {
        self.script_start = start;
    }

    /// Runs one data command at server time `now`; `None` if the keyspace
    /// does not implement it. The arity must have been checked.
    pub(crate) fn exec(&mut self, now: i64, argv: &[Vec<u8>]) -> Option<Reply> {
        let spec = command_spec(&argv[0])?;
        let a = &argv[1..];
        Some(match spec.name {
            "type" => Reply::Status(
                self.live(&a[0], now)
                    .map_or("none", |e| e.value.type_name())
                    .to_owned(),
            ),
            "get" => match self.live(&a[0], now) {
                None => Reply::Nil,
                Some(Entry {
                    value: Value::Str(s),
                    ..
                }) => bulk(s),
                Some(_) => err(WRONGTYPE),
            },
            "set" => self.set(now, a),
            "del" => int(a.iter().filter(|k| self.remove(k, now)).count()),
            "exists" => int(a.iter().filter(|k| self.live(k, now).is_some()).count()),
            "incr" => self.incr(now, &a[0]),
            "pexpire" => self.expire(now, a, "pexpire", false),
            "pexpireat" => self.expire(now, a, "pexpireat", true),
            "pexpiretime" => match self.live(&a[0], now) {
                None => Reply::Int(-2),
                Some(e) => Reply::Int(e.expire_at.unwrap_or(-1)),
            },
            "pttl" => match self.live(&a[0], now) {
                None => Reply::Int(-2),
                Some(e) => Reply::Int(e.expire_at.map_or(-1, |when| (when - now).max(0))),
            },
            "time" => {
                let now = now.max(0);
                Reply::Array(vec![
                    bulk((now / 1000).to_string().as_bytes()),
                    bulk(((now % 1000) * 1000).to_string().as_bytes()),
                ])
            }
            "hget" => match self.hash(now, &a[0]) {
                Err(e) => e,
                Ok(h) => h.and_then(|h| h.get(&a[1])).map_or(Reply::Nil, |v| bulk(v)),
            },
            "hmget" => match self.hash(now, &a[0]) {
                Err(e) => e,
                Ok(h) => Reply::Array(
                    a[1..]
                        .iter()
                        .map(|f| h.and_then(|h| h.get(f)).map_or(Reply::Nil, |v| bulk(v)))
                        .collect(),
                ),
            },
            "hgetall" => match self.hash(now, &a[0]) {
                Err(e) => e,
                Ok(h) => Reply::Array(
                    h.into_iter()
                        .flat_map(Fields::iter)
                        .flat_map(|(f, v)| [bulk(f), bulk(v)])
                        .collect(),
                ),
            },
            "hset" => self.hset(now, a),
            "hdel" => self.hdel(now, a),
            "hincrby" => self.hincrby(now, a),
            "zadd" => self.zadd(now, a),
            "zrem" => self.zrem(now, a),
            "zscore" => match self.zset(now, &a[0]) {
                Err(e) => e,
                Ok(z) => z
                    .and_then(|z| z.score(&a[1]))
                    .map_or(Reply::Nil, score_reply),
            },
            "zrank" => match self.zset(now, &a[0]) {
                Err(e) => e,
                Ok(z) => z
                    .and_then(|z| z.iter().position(|(m, _)| m == a[1].as_slice()))
                    .map_or(Reply::Nil, |rank| int(rank as i64)),
            },
            "zcard" => match self.zset(now, &a[0]) {
                Err(e) => e,
                Ok(z) => int(z.map_or(0, ZSet::len)),
            },
            "zrange" => self.zrange(now, a),
            "zrangebyscore" => self.zrangebyscore(now, a),
            "zremrangebyscore" => self.zremrangebyscore(now, a),
            "setbit" => self.setbit(now, a),
            "getbit" => self.getbit(now, a),
            "bitpos" => self.bitpos(now, a),
            "dbsize" => int(self.entries(now).count()),
            "ping" => match a.first() {
                None => Reply::Status("PONG".to_owned()),
                Some(m) if a.len() == 1 => bulk(m),
                Some(_) => wrong_args("ping"),
            },
            _ => return None,
        })
    }

    fn hash(&mut self, now: i64, key: &[u8]) -> Result<Option<&Fields>, Reply> {
        match self.live(key, now) {
            None => Ok(None),
            Some(Entry {
                value: Value::Hash(h),
                ..
            }) => Ok(Some(h)),
            Some(_) => Err(err(WRONGTYPE)),
        }
    }

    fn zset(&mut self, now: i64, key: &[u8]) -> Result<Option<&ZSet>, Reply> {
        match self.live(key, now) {
            None => Ok(None),
            Some(Entry {
                value: Value::ZSet(z),
                ..
            }) => Ok(Some(z)),
            Some(_) => Err(err(WRONGTYPE)),
        }
    }

    fn set(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        let (key, value) = (&a[0], &a[1]);
        let (mut nx, mut xx, mut get, mut keep_ttl) = (false, false, false, false);
        let mut expire: Option<i64> = None;
        let mut i = 2;
        while i < a.len() {
            let opt = String::from_utf8_lossy(&a[i]).to_ascii_uppercase();
            let next = a.get(i + 1);
            match opt.as_str() {
                "NX" if !xx => nx = true,
                "XX" if !nx => xx = true,
                "GET" => get = true,
                "KEEPTTL" if expire.is_none() => keep_ttl = true,
                "EX" | "PX" | "EXAT" | "PXAT"
                    if expire.is_none() && !keep_ttl && next.is_some() =>
                {
                    let Some(n) = next.and_then(|n| parse_i64(n)) else {
                        return err(NOT_INTEGER);
                    };
                    let seconds = opt == "EX" || opt == "EXAT";
                    if n <= 0 || (seconds && n > i64::MAX / 1000) {
                        return err("ERR invalid expire time in 'set' command");
                    }
                    let ms = if seconds { n * 1000 } else { n };
                    let at = if opt.ends_with("AT") {
                        Some(ms)
                    } else {
                        ms.checked_add(now)
                    };
                    let Some(at) = at else {
                        return err("ERR invalid expire time in 'set' command");
                    };
                    expire = Some(at);
                    i += 1;
                }
                _ => return err(SYNTAX),
            }
            i += 1;
        }
        if nx && get && self.refuses_nx_with_get {
            return err(SYNTAX);
        }
        let old = match self.live(key, now) {
            None => None,
            Some(Entry {
                value: Value::Str(s),
                expire_at,
            }) => Some((s.clone(), *expire_at)),
            Some(_) if get => return err(WRONGTYPE),
            Some(e) => Some((Vec::new(), e.expire_at)),
        };
        let exists = old.is_some();
        let old_reply =
            |old: Option<(Vec<u8>, Option<i64>)>| old.map_or(Reply::Nil, |(s, _)| Reply::Bulk(s));
        if (nx && exists) || (xx && !exists) {
            return if get { old_reply(old) } else { Reply::Nil };
        }
        let expire_at = if keep_ttl {
            old.as_ref().and_then(|(_, e)| *e)
        } else {
            expire
        };
        self.insert(
            key,
            Entry {
                value: Value::Str(value.clone()),
                expire_at,
            },
        );
        // Unlike PEXPIREAT, SET with a time already passed keeps the key
        // until a lookup finds it expired (Redis 7.0).
        if get {
            old_reply(old)
        } else {
            Reply::Status("OK".to_owned())
        }
    }

    fn incr(&mut self, now: i64, key: &[u8]) -> Reply {
        let (current, expire_at) = match self.live(key, now) {
            None => (0, None),
            Some(Entry {
                value: Value::Str(s),
                expire_at,
            }) => match parse_i64(s) {
                Some(n) => (n, *expire_at),
                None => return err(NOT_INTEGER),
            },
            Some(_) => return err(WRONGTYPE),
        };
        let Some(next) = current.checked_add(1) else {
            return err(OVERFLOW);
        };
        self.insert(
            key,
            Entry {
                value: Value::Str(next.to_string().into_bytes()),
                expire_at,
            },
        );
        Reply::Int(next)
    }

    fn expire(&mut self, now: i64, a: &[Vec<u8>], name: &str, absolute: bool) -> Reply {
        let Some(n) = parse_i64(&a[1]) else {
            return err(NOT_INTEGER);
        };
        let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
        for opt in &a[2..] {
            match String::from_utf8_lossy(opt).to_ascii_uppercase().as_str() {
                "NX" => nx = true,
                "XX" => xx = true,
                "GT" => gt = true,
                "LT" => lt = true,
                other => return Reply::Error(format!("ERR Unsupported option {other}")),
            }
        }
        if nx && (xx || gt || lt) {
            return err("ERR NX and XX, GT or LT options at the same time are not compatible");
        }
        if gt && lt {
            return err("ERR GT and LT options at the same time are not compatible");
        }
        let when = if absolute {
            Some(n)
        } else {
            n.checked_add(now)
        };
        let Some(when) = when else {
            return Reply::Error(format!("ERR invalid expire time in '{name}' command"));
        };
        let replica = self.replica;
        let Some(entry) = self.live(&a[0], now) else {
            return Reply::Int(0);
        };
        let current = entry.expire_at;
        let refuse = match current {
            None => xx || gt,
            Some(cur) => nx || (gt && when <= cur) || (lt && when >= cur),
        };
        if refuse {
            return Reply::Int(0);
        }
        if when <= now && !replica {
            self.keys.remove(a[0].as_slice());
        } else {
            entry.expire_at = Some(when);
        }
        self.touch(&a[0]);
        Reply::Int(1)
    }

    fn hash_mut(
        &mut self,
        now: i64,
        key: &[u8],
        create: bool,
    ) -> Result<Option<&mut Fields>, Reply> {
        let exists = match self.live(key, now) {
            None => false,
            Some(Entry {
                value: Value::Hash(_),
                ..
            }) => true,
            Some(_) => return Err(err(WRONGTYPE)),
        };
        if !exists {
            if !create {
                return Ok(None);
            }
            self.insert(
                key,
                Entry {
                    value: Value::Hash(Fields::default()),
                    expire_at: None,
                },
            );
        }
        match self.keys.get_mut(key) {
            Some(Entry {
                value: Value::Hash(h),
                ..
            }) => Ok(Some(h)),
            _ => unreachable!("a hash was just found or created"),
        }
    }

    fn hset(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        if a.len().is_multiple_of(2) {
            return wrong_args("hset");
        }
        match self.hash_mut(now, &a[0], true) {
            Err(e) => e,
            Ok(h) => {
                let h = h.expect("created");
                let added = a[1..]
                    .chunks(2)
                    .filter(|pair| h.insert(pair[0].clone(), pair[1].clone()).is_none())
                    .count();
                self.touch(&a[0]);
                int(added)
            }
        }
    }

    fn hdel(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        let removed;
        let empty;
        match self.hash_mut(now, &a[0], false) {
            Err(e) => return e,
            Ok(None) => return Reply::Int(0),
            Ok(Some(h)) => {
                removed = a[1..]
                    .iter()
                    .filter(|f| h.remove(f.as_slice()).is_some())
                    .count();
                empty = h.is_empty();
            }
        }
        if empty {
            self.keys.remove(a[0].as_slice());
        }
        if removed > 0 {
            self.touch(&a[0]);
        }
        int(removed)
    }

    fn hincrby(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        let Some(by) = parse_i64(&a[2]) else {
            return err(NOT_INTEGER);
        };
        // Redis checks the field before it creates the key.
        if let Ok(Some(h)) = self.hash(now, &a[0])
            && let Some(v) = h.get(&a[1])
            && parse_i64(v).is_none()
        {
            return err("ERR hash value is not an integer");
        }
        match self.hash_mut(now, &a[0], true) {
            Err(e) => e,
            Ok(h) => {
                let h = h.expect("created");
                let current = h.get(&a[1]).and_then(|v| parse_i64(v)).unwrap_or(0);
                let Some(next) = current.checked_add(by) else {
                    return err(OVERFLOW);
                };
                h.insert(a[1].clone(), next.to_string().into_bytes());
                self.touch(&a[0]);
                Reply::Int(next)
            }
        }
    }

    fn zset_mut(&mut self, now: i64, key: &[u8], create: bool) -> Result<Option<&mut ZSet>, Reply> {
        let exists = match self.live(key, now) {
            None => false,
            Some(Entry {
                value: Value::ZSet(_),
                ..
            }) => true,
            Some(_) => return Err(err(WRONGTYPE)),
        };
        if !exists {
            if !create {
                return Ok(None);
            }
            self.insert(
                key,
                Entry {
                    value: Value::ZSet(ZSet::default()),
                    expire_at: None,
                },
            );
        }
        match self.keys.get_mut(key) {
            Some(Entry {
                value: Value::ZSet(z),
                ..
            }) => Ok(Some(z)),
            _ => unreachable!("a sorted set was just found or created"),
        }
    }

    /// Deletes a sorted set left empty (Redis never keeps an empty one).
    fn drop_if_empty(&mut self, key: &[u8]) {
        if let Some(Entry {
            value: Value::ZSet(z),
            ..
        }) = self.keys.get(key)
            && z.is_empty()
        {
            self.keys.remove(key);
            self.touch(key);
        }
    }

    fn zadd(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        let (mut nx, mut xx, mut gt, mut lt, mut ch) = (false, false, false, false, false);
        let mut i = 1;
        while i < a.len() {
            match String::from_utf8_lossy(&a[i]).to_ascii_uppercase().as_str() {
                "NX" => nx = true,
                "XX" => xx = true,
                "GT" => gt = true,
                "LT" => lt = true,
                "CH" => ch = true,
                _ => break,
            }
            i += 1;
        }
        let pairs = &a[i..];
        if pairs.is_empty() || !pairs.len().is_multiple_of(2) {
            return err(SYNTAX);
        }
        if nx && xx {
            return err("ERR XX and NX options at the same time are not compatible");
        }
        if (nx && (gt || lt)) || (gt && lt) {
            return err("ERR GT, LT, and/or NX options at the same time are not compatible");
        }
        let mut scores = Vec::new();
        for pair in pairs.chunks(2) {
            match parse_f64(&pair[0]) {
                Some(s) => scores.push((s, pair[1].clone())),
                None => return err(NOT_FLOAT),
            }
        }
        let z = match self.zset_mut(now, &a[0], !xx) {
            Err(e) => return e,
            Ok(None) => return Reply::Int(0),
            Ok(Some(z)) => z,
        };
        let (mut added, mut changed) = (0, 0);
        for (score, member) in scores {
            match z.score(&member) {
                Some(old) => {
                    if nx || (gt && score <= old) || (lt && score >= old) || score == old {
                        continue;
                    }
                    z.insert(member, score);
                    changed += 1;
                }
                None => {
                    if xx {
                        continue;
                    }
                    z.insert(member, score);
                    added += 1;
                }
            }
        }
        if added + changed > 0 {
            self.touch(&a[0]);
        }
        self.drop_if_empty(&a[0]);
        Reply::Int(if ch { added + changed } else { added })
    }

    fn zrem(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        let removed = match self.zset_mut(now, &a[0], false) {
            Err(e) => return e,
            Ok(None) => return Reply::Int(0),
            Ok(Some(z)) => a[1..].iter().filter(|m| z.remove(m)).count(),
        };
        if removed > 0 {
            self.touch(&a[0]);
            self.drop_if_empty(&a[0]);
        }
        int(removed)
    }

    fn zrange(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        let (Some(start), Some(stop)) = (parse_i64(&a[1]), parse_i64(&a[2])) else {
            return err(NOT_INTEGER);
        };
        let mut with_scores = false;
        for opt in &a[3..] {
            match String::from_utf8_lossy(opt).to_ascii_uppercase().as_str() {
                "WITHSCORES" => with_scores = true,
                _ => return err(SYNTAX),
            }
        }
        let z = match self.zset(now, &a[0]) {
            Err(e) => return e,
            Ok(None) => return Reply::Array(Vec::new()),
            Ok(Some(z)) => z,
        };
        let len = z.len() as i64;
        let start = if start < 0 {
            (len + start).max(0)
        } else {
            start
        };
        let stop = if stop < 0 {
            len + stop
        } else {
            stop.min(len - 1)
        };
        if start > stop || start >= len {
            return Reply::Array(Vec::new());
        }
        let picked = z
            .iter()
            .skip(start as usize)
            .take((stop - start + 1) as usize);
        Reply::Array(members_reply(picked, with_scores))
    }

    fn zrangebyscore(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        let (Some(min), Some(max)) = (parse_bound(&a[1]), parse_bound(&a[2])) else {
            return err(MIN_MAX);
        };
        let mut with_scores = false;
        let mut limit: Option<(i64, i64)> = None;
        let mut i = 3;
        while i < a.len() {
            match String::from_utf8_lossy(&a[i]).to_ascii_uppercase().as_str() {
                "WITHSCORES" => with_scores = true,
                "LIMIT" if i + 2 < a.len() => {
                    let (Some(off), Some(count)) = (parse_i64(&a[i + 1]), parse_i64(&a[i + 2]))
                    else {
                        return err(NOT_INTEGER);
                    };
                    limit = Some((off, count));
                    i += 2;
                }
                _ => return err(SYNTAX),
            }
            i += 1;
        }
        let z = match self.zset(now, &a[0]) {
            Err(e) => return e,
            Ok(None) => return Reply::Array(Vec::new()),
            Ok(Some(z)) => z,
        };
        let in_range = z.iter().filter(|(_, s)| in_bounds(*s, min, max));
        let picked: Vec<(&[u8], f64)> = match limit {
            Some((off, _)) if off < 0 => Vec::new(),
            Some((off, count)) => {
                let count = if count < 0 {
                    usize::MAX
                } else {
                    count as usize
                };
                in_range.skip(off as usize).take(count).collect()
            }
            None => in_range.collect(),
        };
        Reply::Array(members_reply(picked.into_iter(), with_scores))
    }

    fn zremrangebyscore(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        let (Some(min), Some(max)) = (parse_bound(&a[1]), parse_bound(&a[2])) else {
            return err(MIN_MAX);
        };
        let z = match self.zset_mut(now, &a[0], false) {
            Err(e) => return e,
            Ok(None) => return Reply::Int(0),
            Ok(Some(z)) => z,
        };
        let doomed: Vec<Vec<u8>> = z
            .iter()
            .filter(|(_, s)| in_bounds(*s, min, max))
            .map(|(m, _)| m.to_vec())
            .collect();
        for m in &doomed {
            z.remove(m);
        }
        if !doomed.is_empty() {
            self.touch(&a[0]);
            self.drop_if_empty(&a[0]);
        }
        int(doomed.len())
    }

    fn string_mut(&mut self, now: i64, key: &[u8]) -> Result<&mut Vec<u8>, Reply> {
        let exists = match self.live(key, now) {
            None => false,
            Some(Entry {
                value: Value::Str(_),
                ..
            }) => true,
            Some(_) => return Err(err(WRONGTYPE)),
        };
        if !exists {
            self.insert(
                key,
                Entry {
                    value: Value::Str(Vec::new()),
                    expire_at: None,
                },
            );
        }
        self.touch(key);
        match self.keys.get_mut(key) {
            Some(Entry {
                value: Value::Str(s),
                ..
            }) => Ok(s),
            _ => unreachable!("a string was just found or created"),
        }
    }

    fn setbit(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        let offset = match parse_i64(&a[1]) {
            Some(n) if (0..1 << 32).contains(&n) => n as usize,
            _ => return err("ERR bit offset is not an integer or out of range"),
        };
        let bit = match a[2].as_slice() {
            b"0" => 0,
            b"1" => 1,
            _ => return err("ERR bit is not an integer or out of range"),
        };
        let s = match self.string_mut(now, &a[0]) {
            Err(e) => return e,
            Ok(s) => s,
        };
        let byte = offset / 8;
        let mask = 0x80u8 >> (offset % 8);
        if s.len() <= byte {
            s.resize(byte + 1, 0);
        }
        let old = s[byte] & mask != 0;
        if bit == 1 {
            s[byte] |= mask;
        } else {
            s[byte] &= !mask;
        }
        Reply::Int(i64::from(old))
    }

    fn getbit(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        let offset = match parse_i64(&a[1]) {
            Some(n) if (0..1 << 32).contains(&n) => n as usize,
            _ => return err("ERR bit offset is not an integer or out of range"),
        };
        match self.live(&a[0], now) {
            None => Reply::Int(0),
            Some(Entry {
                value: Value::Str(s),
                ..
            }) => Reply::Int(i64::from(
                s.get(offset / 8)
                    .is_some_and(|b| b & (0x80 >> (offset % 8)) != 0),
            )),
            Some(_) => err(WRONGTYPE),
        }
    }

    fn bitpos(&mut self, now: i64, a: &[Vec<u8>]) -> Reply {
        let bit = match a[1].as_slice() {
            b"0" => false,
            b"1" => true,
            _ => return err("ERR The bit argument must be 1 or 0."),
        };
        if a.len() > 2 {
            // Ranges are not used by the crate's scripts.
            return err("ERR the model server supports BITPOS key bit only");
        }
        match self.live(&a[0], now) {
            None => Reply::Int(if bit { -1 } else { 0 }),
            Some(Entry {
                value: Value::Str(s),
                ..
            }) => {
                if s.is_empty() {
                    return Reply::Int(-1);
                }
                let found = s.iter().enumerate().find_map(|(i, byte)| {
                    let b = if bit { *byte } else { !*byte };
                    (b != 0).then(|| i * 8 + b.leading_zeros() as usize)
                });
                match found {
                    Some(pos) => int(pos),
                    // No clear bit: the first one past the end (no end given).
                    None if !bit => int(s.len() * 8),
                    None => Reply::Int(-1),
                }
            }
            Some(_) => err(WRONGTYPE),
        }
    }
}

fn in_bounds(score: f64, min: (f64, bool), max: (f64, bool)) -> bool {
    let above = if min.1 { score > min.0 } else { score >= min.0 };
    let below = if max.1 { score < max.0 } else { score <= max.0 };
    above && below
}

fn members_reply<'a>(
    members: impl Iterator<Item = (&'a [u8], f64)>,
    with_scores: bool,
) -> Vec<Reply> {
    let mut out = Vec::new();
    for (m, s) in members {
        out.push(bulk(m));
        if with_scores {
            out.push(score_reply(s));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(ks: &mut Keyspace, now: i64, argv: &[&str]) -> Reply {
        let argv: Vec<Vec<u8>> = argv.iter().map(|a| a.as_bytes().to_vec()).collect();
        ks.exec(now, &argv).expect("a data command")
    }

    #[test]
    fn formats_scores_as_c_does_with_17_significant_digits() {
        assert_eq!(format_g17(1.5), "1.5");
        assert_eq!(format_g17(0.1), "0.10000000000000001");
        assert_eq!(format_g17(1e20), "1e+20");
        assert_eq!(format_g17(1e15 + 0.5), "1000000000000000.5");
        assert_eq!(format_g17(123456789012345678.0), "1.2345678901234568e+17");
        assert_eq!(format_g17(1_700_000_000_123.0), "1700000000123");
        assert_eq!(format_g17(-0.0), "-0");
        assert_eq!(format_g17(0.0001), "0.0001");
        assert_eq!(format_g17(0.00001), "1.0000000000000001e-05");
    }

    #[test]
    fn a_key_exists_through_its_expiry_millisecond_and_is_gone_after() {
        let mut ks = Keyspace::new(false);
        assert_eq!(
            run(&mut ks, 1000, &["SET", "k", "v", "PX", "10"]),
            Reply::Status("OK".into())
        );
        assert_eq!(run(&mut ks, 1010, &["PTTL", "k"]), Reply::Int(0));
        assert_eq!(
            run(&mut ks, 1010, &["GET", "k"]),
            Reply::Bulk(b"v".to_vec())
        );
        assert_eq!(run(&mut ks, 1011, &["GET", "k"]), Reply::Nil);
        assert_eq!(run(&mut ks, 1011, &["PEXPIRETIME", "k"]), Reply::Int(-2));
    }

    #[test]
    fn set_with_nx_and_get_answers_what_was_there_or_before_7_0_a_syntax_error() {
        let mut ks = Keyspace::new(false);
        let set = ["SET", "k", "me", "NX", "PX", "100", "GET"];
        assert_eq!(run(&mut ks, 1000, &set), Reply::Nil);
        assert_eq!(run(&mut ks, 1001, &set), Reply::Bulk(b"me".to_vec()));
        let mut old = Keyspace::new(false);
        old.refuse_nx_with_get();
        assert_eq!(run(&mut old, 1000, &set), Reply::Error(SYNTAX.into()));
        assert_eq!(run(&mut old, 1000, &["GET", "k"]), Reply::Nil);
        assert_eq!(
            run(&mut old, 1000, &["SET", "k", "me", "PX", "100", "GET"]),
            Reply::Nil
        );
    }

    #[test]
    fn strict_integers_as_redis_parses_them() {
        assert_eq!(parse_i64(b"12"), Some(12));
        assert_eq!(parse_i64(b"-12"), Some(-12));
        for bad in ["", "+1", "01", "-0", " 1", "1.0", "99999999999999999999"] {
            assert_eq!(parse_i64(bad.as_bytes()), None, "{bad:?}");
        }
    }

    #[test]
    fn wrongtype_on_a_key_of_another_type() {
        let mut ks = Keyspace::new(false);
        run(&mut ks, 0, &["ZADD", "z", "1", "a"]);
        assert_eq!(
            run(&mut ks, 0, &["GET", "z"]),
            Reply::Error(WRONGTYPE.into())
        );
        assert_eq!(
            run(&mut ks, 0, &["HGET", "z", "f"]),
            Reply::Error(WRONGTYPE.into())
        );
        assert_eq!(
            run(&mut ks, 0, &["INCR", "z"]),
            Reply::Error(WRONGTYPE.into())
        );
        assert_eq!(
            run(&mut ks, 0, &["TYPE", "z"]),
            Reply::Status("zset".into())
        );
    }

    #[test]
    fn bitmaps_count_bits_from_the_high_end_of_each_byte() {
        let mut ks = Keyspace::new(false);
        assert_eq!(run(&mut ks, 0, &["BITPOS", "b", "0"]), Reply::Int(0));
        assert_eq!(run(&mut ks, 0, &["BITPOS", "b", "1"]), Reply::Int(-1));
        run(&mut ks, 0, &["SETBIT", "b", "3", "1"]);
        assert_eq!(run(&mut ks, 0, &["GET", "b"]), Reply::Bulk(vec![0x10]));
        assert_eq!(run(&mut ks, 0, &["BITPOS", "b", "1"]), Reply::Int(3));
        for i in 0..8 {
            run(&mut ks, 0, &["SETBIT", "b", &i.to_string(), "1"]);
        }
        assert_eq!(run(&mut ks, 0, &["BITPOS", "b", "0"]), Reply::Int(8));
    }
}
