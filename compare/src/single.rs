//! Case 1: uncontended acquire + release on one node, one pair after another.

use std::time::{Duration, Instant};

use respire_coordination::{Coordinator, ReleaseOutcome};
use rlock::{AcquireOptions, RenewalMode};

use crate::child::{Ctx, Res, connect, latency, lockstep, micros, runtime, time_each, warm_up};
use crate::plan::{Case, Figures};

const TTL: Duration = Duration::from_secs(30);
/// Compare-and-delete: the release every Redis lock recipe uses.
pub(crate) const COMPARE_AND_DELETE: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";
const FENCED_ACQUIRE: &str = include_str!("../../src/scripts/fenced_acquire.lua");
const LEASE_RELEASE: &str = include_str!("../../src/scripts/lease_release.lua");

/// `SCRIPT LOAD`s `code` on `conn`; its SHA1.
pub(crate) fn load(conn: &mut redis::Connection, code: &str) -> Res<String> {
    Ok(redis::cmd("SCRIPT").arg("LOAD").arg(code).query(conn)?)
}

/// An owner value as long as this crate's (128 bits in hex), different per call.
pub(crate) fn owner(i: u64) -> String {
    format!("{i:032x}")
}

pub(crate) fn run(imp: &str, ctx: &Ctx) -> Res<Figures> {
    let url = ctx.urls[0].as_str();
    let warm = warm_up(ctx.sizes.pairs);
    let n = ctx.sizes.per_block(Case::Single, ctx.sizes.pairs);
    let samples = match imp {
        "raw-pair" => {
            let mut conn = connect(url)?;
            let sha = load(&mut conn, COMPARE_AND_DELETE)?;
            let key = ctx.key("pair");
            let mut i = 0;
            time_each(warm, n, || {
                i += 1;
                let value = owner(i);
                let set: redis::Value = redis::cmd("SET")
                    .arg(&key)
                    .arg(&value)
                    .arg("NX")
                    .arg("PX")
                    .arg(TTL.as_millis() as u64)
                    .query(&mut conn)?;
                if set != redis::Value::Okay {
                    return Err(format!("SET NX answered {set:?}").into());
                }
                let deleted: i64 = redis::cmd("EVALSHA")
                    .arg(&sha)
                    .arg(1)
                    .arg(&key)
                    .arg(&value)
                    .query(&mut conn)?;
                expect(deleted == 1, "compare-and-delete did not delete")
            })?
        }
        "raw-fenced" => {
            let mut conn = connect(url)?;
            let acquire = load(&mut conn, FENCED_ACQUIRE)?;
            let release = load(&mut conn, LEASE_RELEASE)?;
            let (lease, fence) = (ctx.key("{f}:lease"), ctx.key("{f}:fence"));
            let mut i = 0;
            time_each(warm, n, || {
                i += 1;
                let who = owner(i);
                let granted: Vec<i64> = redis::cmd("EVALSHA")
                    .arg(&acquire)
                    .arg(2)
                    .arg(&lease)
                    .arg(&fence)
                    .arg(&who)
                    .arg(TTL.as_millis() as u64)
                    .query(&mut conn)?;
                let [1, token] = granted[..] else {
                    return Err(format!("fenced acquire answered {granted:?}").into());
                };
                let deleted: i64 = redis::cmd("EVALSHA")
                    .arg(&release)
                    .arg(1)
                    .arg(&lease)
                    .arg(format!("{who}:{token}"))
                    .arg("exact")
                    .query(&mut conn)?;
                expect(deleted == 1, "fenced release did not delete")
            })?
        }
        "lock" => {
            let coord = Coordinator::builder(url).key_prefix(&ctx.prefix).build()?;
            let lock = coord.lock("lock")?;
            time_each(warm, n, || {
                let guard = lock.try_acquire(TTL)?.ok_or("Lock was contended")?;
                released(guard.release()?)
            })?
        }
        "fenced" => {
            let coord = Coordinator::builder(url).key_prefix(&ctx.prefix).build()?;
            let lock = coord.fenced_lock("{f}:lease", "{f}:fence")?;
            time_each(warm, n, || {
                let guard = lock.try_acquire(TTL)?.ok_or("FencedLock was contended")?;
                released(guard.release()?)
            })?
        }
        "rlock" | "rlock-default" => {
            let manager = rlock::sync_lock::RLock::new(url)?;
            let options = AcquireOptions::builder()
                .ttl(TTL)
                .renewal_mode(RenewalMode::Disabled)
                .build()?;
            let key = ctx.key("rlock");
            let defaults = imp == "rlock-default";
            let samples = time_each(warm, n, || {
                let guard = if defaults {
                    manager.try_acquire_mutex(&key)?
                } else {
                    manager.try_acquire_mutex_with_options(&key, options.clone())?
                };
                guard.ok_or("rlock was contended")?.release()?;
                Ok(())
            })?;
            manager.shutdown();
            samples
        }
        "rslock" => {
            let rt = runtime()?;
            let manager = rslock::LockManager::new(vec![url]);
            let key = ctx.key("rslock");
            let mut samples = Vec::new();
            // Timed inside the runtime, as an async caller would see it.
            let pairs = |count: usize, samples: &mut Vec<f64>| {
                rt.block_on(async {
                    for _ in 0..count {
                        let start = Instant::now();
                        let lock = manager.lock(key.as_str(), TTL).await?;
                        manager.unlock(&lock).await;
                        samples.push(micros(start.elapsed()));
                    }
                    Res::Ok(())
                })
            };
            pairs(warm, &mut Vec::new())?;
            lockstep(|| pairs(n, &mut samples))?;
            samples
        }
        "redlock" => {
            let manager = redlock::RedLock::new(vec![url]);
            let key = ctx.key("redlock");
            time_each(warm, n, || {
                let lock = manager
                    .lock(key.as_bytes(), TTL.as_millis() as usize)?
                    .ok_or("redlock did not acquire")?;
                manager.unlock(&lock);
                Ok(())
            })?
        }
        other => return Err(format!("no such implementation {other:?}").into()),
    };
    let mut figures = Figures::new();
    latency(&mut figures, "", samples);
    Ok(figures)
}

pub(crate) fn expect(ok: bool, what: &str) -> Res<()> {
    if ok { Ok(()) } else { Err(what.into()) }
}

fn released(outcome: ReleaseOutcome) -> Res<()> {
    expect(
        outcome == ReleaseOutcome::Released,
        "release did not report Released",
    )
}
