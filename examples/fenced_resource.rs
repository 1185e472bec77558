//! Fencing in action: a protected resource that refuses stale writers.
//!
//! The resource is a second Redis whose write script checks the fencing token
//! atomically with the write: it refuses a token lower than the highest it has
//! accepted (equal tokens are the same holder writing again). Each cycle plays
//! Martin Kleppmann's scenario: holder A takes the lease and pauses past its
//! expiry, B takes the lease and writes with a higher token, then A wakes up and
//! writes as if it still held the lease. The lease alone cannot stop A; the
//! resource does.
//!
//! Run: `cargo run --example fenced_resource [CYCLES]`. With `LOCK_URL` and
//! `STORE_URL` unset, two throwaway local servers are started.

#![allow(
    dead_code,
    reason = "tests include this file as a module and use part of it"
)]

use std::time::Duration;

use respire_coordination::{Coordinator, FencingToken};

mod common;

/// Writes to the resource only with a token at least as high as any accepted.
const FENCED_WRITE: &str = r"
-- KEYS[1] highest accepted token, KEYS[2] the data
-- ARGV[1] token, ARGV[2] value
-- returns 1 written, 0 refused (stale token)
local highest = tonumber(redis.call('GET', KEYS[1]) or '0')
local token = tonumber(ARGV[1])
if token < highest then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[2])
return 1
";

/// The protected resource: a list of writes guarded by the highest token seen.
pub(crate) struct FencedStore {
    conn: redis::Connection,
    script: redis::Script,
    name: String,
}

impl FencedStore {
    /// Connects to the resource's own Redis.
    pub(crate) fn open(url: &str, name: &str) -> redis::RedisResult<Self> {
        Ok(FencedStore {
            conn: redis::Client::open(url)?.get_connection()?,
            script: redis::Script::new(FENCED_WRITE),
            name: name.to_owned(),
        })
    }

    /// Appends `value` if `token` is not stale; returns whether it was written.
    pub(crate) fn write(&mut self, token: FencingToken, value: &str) -> redis::RedisResult<bool> {
        let written: i64 = self
            .script
            .key(format!("{}:highest", self.name))
            .key(format!("{}:data", self.name))
            .arg(token.get())
            .arg(value)
            .invoke(&mut self.conn)?;
        Ok(written == 1)
    }
}

/// What the cycles saw.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Report {
    /// Writes by the holder of the current lease that the resource accepted.
    pub(crate) current_accepted: usize,
    /// Late writes by a paused former holder that the resource refused.
    pub(crate) stale_refused: usize,
    /// Late writes by a paused former holder that the resource accepted: must be 0.
    pub(crate) stale_accepted: usize,
    /// Times the paused holder's guard already said it was lost when it woke.
    pub(crate) stale_holder_saw_loss: usize,
}

/// Runs `cycles` rounds of the paused-holder scenario.
pub(crate) fn run_cycles(
    lock_url: &str,
    store_url: &str,
    cycles: usize,
) -> Result<Report, Box<dyn std::error::Error>> {
    let ttl = Duration::from_millis(150);
    let coord = Coordinator::builder(lock_url)
        .key_prefix("fenced-resource:")
        .node_timeout(Duration::from_millis(50))
        .build()?;
    let lock = coord.fenced_lock("{report}:lease", "{report}:fence")?;
    let mut store = FencedStore::open(store_url, "report")?;
    let mut report = Report::default();
    for cycle in 0..cycles {
        // A takes the lease and writes while it holds it.
        let a = lock
            .acquire_timeout(ttl, Duration::from_secs(5))?
            .ok_or("A did not get the lease")?;
        let a_token = a.fencing_token();
        if store.write(a_token, &format!("cycle {cycle}: A while holding"))? {
            report.current_accepted += 1;
        }
        // A pauses (no renewal). B waits for the lease: it is woken when A's
        // lease expires on the server, not by sleeping.
        let b = lock
            .acquire_timeout(ttl, Duration::from_secs(5))?
            .ok_or("B did not get the lease after A's expired")?;
        assert!(b.fencing_token() > a_token);
        if store.write(b.fencing_token(), &format!("cycle {cycle}: B"))? {
            report.current_accepted += 1;
        }
        // A wakes up and writes as if it still held the lease.
        if a.is_lost() {
            report.stale_holder_saw_loss += 1;
        }
        if store.write(a_token, &format!("cycle {cycle}: A after its pause"))? {
            report.stale_accepted += 1;
        } else {
            report.stale_refused += 1;
        }
        drop(a);
        b.release()?;
    }
    Ok(report)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cycles = std::env::args()
        .nth(1)
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(5);
    let (lock_url, _lock_server) = common::url_or_throwaway("LOCK_URL")?;
    let (store_url, _store_server) = common::url_or_throwaway("STORE_URL")?;
    println!("lock on {lock_url}, protected resource on {store_url}");
    let report = run_cycles(&lock_url, &store_url, cycles)?;
    println!("{cycles} cycles: {report:?}");
    if report.stale_accepted > 0 {
        return Err("the resource accepted a stale write".into());
    }
    println!("every late write by a paused holder was refused by the resource");
    Ok(())
}
