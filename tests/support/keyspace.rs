//! Reading what the server holds, for tests that check scripts' effects: the
//! server clock, sorted-set members and whole-keyspace snapshots.

use std::time::{Duration, Instant};

use redis::Commands;

/// The server's clock in ms, and the local instant it was read at.
pub(crate) fn server_now(c: &mut redis::Connection) -> (i64, Instant) {
    let before = Instant::now();
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query(c).unwrap();
    let after = Instant::now();
    (secs * 1000 + micros / 1000, before + (after - before) / 2)
}

/// The local instant at which server time `at_ms` comes, from one reading.
pub(crate) fn local_instant(at_ms: i64, (now_ms, now): (i64, Instant)) -> Instant {
    if at_ms >= now_ms {
        now + Duration::from_millis((at_ms - now_ms) as u64)
    } else {
        now - Duration::from_millis((now_ms - at_ms) as u64)
    }
}

/// Members of a sorted set with their scores.
pub(crate) fn members(c: &mut redis::Connection, key: &str) -> Vec<(String, i64)> {
    let v: Vec<(String, f64)> = c.zrange_withscores(key, 0, -1).unwrap();
    v.into_iter().map(|(m, s)| (m, s as i64)).collect()
}

/// Every key under `prefix` with its serialized value and absolute expiry: two
/// equal snapshots mean nothing was changed (member scores included).
pub(crate) fn snapshot(c: &mut redis::Connection, prefix: &str) -> Vec<(String, Vec<u8>, i64)> {
    let mut keys: Vec<String> = c.keys(format!("{prefix}*")).unwrap();
    keys.sort();
    keys.into_iter()
        .map(|k| {
            let dump: Vec<u8> = redis::cmd("DUMP").arg(&k).query(c).unwrap();
            let at: i64 = redis::cmd("PEXPIRETIME").arg(&k).query(c).unwrap();
            (k, dump, at)
        })
        .collect()
}

/// The key's remaining TTL on the server, in ms (−2: gone, −1: no expiry).
pub(crate) fn pttl(c: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(c).expect("PTTL")
}
