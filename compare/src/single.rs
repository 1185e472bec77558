//! Case 1: uncontended acquire + release on one node, one pair after another.

use std::time::{Duration, Instant};

use respire_coordination::{CancelToken, Coordinator, ReleaseOutcome};
use rlock::{AcquireOptions, RenewalMode};

use crate::child::{
    Ctx, Res, connect, cpu_per_1000, latency, lockstep, micros, runtime, time_each, warm_up,
};
use crate::plan::{Case, Figures};

const TTL: Duration = Duration::from_secs(30);
/// An observer that implements no event: every call is the trait's empty
/// default body.
struct Silent;

impl respire_coordination::Observer for Silent {}

/// Compare-and-delete: the release every Redis lock recipe uses.
pub(crate) const COMPARE_AND_DELETE: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";
const FENCED_ACQUIRE: &str = include_str!("../../src/scripts/fenced_acquire.lua");
const LEASE_RELEASE: &str = include_str!("../../src/scripts/lease_release.lua");
const READ_ACQUIRE: &str = include_str!("../../src/scripts/rw_read_acquire.lua");
const READ_RELEASE: &str = include_str!("../../src/scripts/rw_read_release.lua");
const WRITE_ACQUIRE: &str = include_str!("../../src/scripts/rw_write_acquire.lua");
const SEM_ACQUIRE: &str = include_str!("../../src/scripts/sem_acquire.lua");
const SEM_RELEASE: &str = include_str!("../../src/scripts/sem_release.lua");

/// One raw script pair per operation on one connection: the acquire script
/// with `keys` and `args(owner)`, whose grant must start with 1; then the
/// release script with `release_keys` and `release_arg(owner, grant)` and
/// `exact`, which must answer 1.
struct RawScripts<'a> {
    acquire: &'a str,
    release: &'a str,
    keys: Vec<String>,
    release_keys: Vec<String>,
    args: fn(&str) -> Vec<String>,
    release_arg: fn(&str, &[redis::Value]) -> Res<String>,
}

fn raw_scripts(url: &str, warm: usize, n: usize, raw: RawScripts<'_>) -> Res<Vec<f64>> {
    let mut conn = connect(url)?;
    let acquire = load(&mut conn, raw.acquire)?;
    let release = load(&mut conn, raw.release)?;
    let mut i = 0;
    time_each(warm, n, || {
        i += 1;
        let who = owner(i);
        let granted: Vec<redis::Value> = redis::cmd("EVALSHA")
            .arg(&acquire)
            .arg(raw.keys.len())
            .arg(&raw.keys)
            .arg((raw.args)(&who))
            .query(&mut conn)?;
        if granted.first() != Some(&redis::Value::Int(1)) {
            return Err(format!("acquire answered {granted:?}").into());
        }
        let deleted: i64 = redis::cmd("EVALSHA")
            .arg(&release)
            .arg(raw.release_keys.len())
            .arg(&raw.release_keys)
            .arg((raw.release_arg)(&who, &granted)?)
            .arg("exact")
            .query(&mut conn)?;
        expect(deleted == 1, "release did not delete")
    })
}

/// A grant's token (its second or third element), as text.
fn token_at(grant: &[redis::Value], i: usize) -> Res<String> {
    match grant.get(i) {
        Some(redis::Value::BulkString(b)) => Ok(String::from_utf8(b.clone())?),
        Some(redis::Value::Int(t)) => Ok(t.to_string()),
        other => Err(format!("no token in {other:?}").into()),
    }
}

/// The keys of a reader/writer lease on `base`: writer, readers, intents,
/// fence.
fn rw_keys(ctx: &Ctx, base: &str) -> Vec<String> {
    ["w", "r", "q", "fence"]
        .iter()
        .map(|k| ctx.key(&format!("{base}:{k}")))
        .collect()
}

/// The keys of a semaphore on `base`: permits, meta, slots.
fn sem_keys(ctx: &Ctx, base: &str) -> Vec<String> {
    ["permits", "meta", "slots"]
        .iter()
        .map(|k| ctx.key(&format!("{base}:{k}")))
        .collect()
}

/// Times `pair` (acquire + release of one primitive of this crate); `wait`
/// names the waiting verb (`acquire` with a cancel token) rather than
/// `try_acquire`.
fn ours<G>(
    warm: usize,
    n: usize,
    wait: bool,
    try_acquire: impl Fn() -> respire_coordination::Result<Option<G>>,
    acquire: impl Fn(&CancelToken) -> respire_coordination::Result<G>,
    release: impl Fn(G) -> respire_coordination::Result<ReleaseOutcome>,
) -> Res<Vec<f64>> {
    let cancel = CancelToken::new();
    time_each(warm, n, || {
        let guard = if wait {
            acquire(&cancel)?
        } else {
            try_acquire()?.ok_or("contended")?
        };
        released(release(guard)?)
    })
}

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
        "raw-read" => raw_scripts(
            url,
            warm,
            n,
            RawScripts {
                acquire: READ_ACQUIRE,
                release: READ_RELEASE,
                keys: rw_keys(ctx, "{rw}"),
                release_keys: vec![rw_keys(ctx, "{rw}")[1].clone()],
                args: |who| vec![who.into(), TTL.as_millis().to_string(), "writer".into()],
                release_arg: |who, _| Ok(who.into()),
            },
        )?,
        "raw-write" => raw_scripts(
            url,
            warm,
            n,
            RawScripts {
                acquire: WRITE_ACQUIRE,
                release: LEASE_RELEASE,
                keys: rw_keys(ctx, "{rw}"),
                release_keys: vec![rw_keys(ctx, "{rw}")[0].clone()],
                args: |who| vec![who.into(), TTL.as_millis().to_string(), "0".into()],
                release_arg: |who, grant| Ok(format!("{who}:{}", token_at(grant, 1)?)),
            },
        )?,
        "raw-permit" => raw_scripts(
            url,
            warm,
            n,
            RawScripts {
                acquire: SEM_ACQUIRE,
                release: SEM_RELEASE,
                keys: sem_keys(ctx, "{sem}"),
                release_keys: sem_keys(ctx, "{sem}"),
                args: |who| vec![who.into(), TTL.as_millis().to_string(), "4".into()],
                release_arg: |who, grant| {
                    let slot = token_at(grant, 1)?;
                    Ok(format!("{who}:{slot}:{}", token_at(grant, 2)?))
                },
            },
        )?,
        "lock" | "lock-wait" | "lock-observed" => {
            let mut builder = Coordinator::builder(url).key_prefix(&ctx.prefix);
            if imp == "lock-observed" {
                builder = builder.observer(std::sync::Arc::new(Silent));
            }
            let coord = builder.build()?;
            let lock = coord.lock("lock")?;
            ours(
                warm,
                n,
                imp.ends_with("-wait"),
                || lock.try_acquire(TTL),
                |cancel| lock.acquire(TTL, cancel),
                |g| g.release(),
            )?
        }
        "fenced" | "fenced-wait" => {
            let coord = Coordinator::builder(url).key_prefix(&ctx.prefix).build()?;
            let lock = coord.fenced_lock("{f}:lease", "{f}:fence")?;
            ours(
                warm,
                n,
                imp.ends_with("-wait"),
                || lock.try_acquire(TTL),
                |cancel| lock.acquire(TTL, cancel),
                |g| g.release(),
            )?
        }
        "read" | "read-wait" => {
            let coord = Coordinator::builder(url).key_prefix(&ctx.prefix).build()?;
            let read = coord.read_write_lease("{rw}")?.read();
            ours(
                warm,
                n,
                imp.ends_with("-wait"),
                || read.try_acquire(TTL),
                |cancel| read.acquire(TTL, cancel),
                |g| g.release(),
            )?
        }
        "write" | "write-wait" => {
            let coord = Coordinator::builder(url).key_prefix(&ctx.prefix).build()?;
            let write = coord.read_write_lease("{rw}")?.write();
            ours(
                warm,
                n,
                imp.ends_with("-wait"),
                || write.try_acquire(TTL),
                |cancel| write.acquire(TTL, cancel),
                |g| g.release(),
            )?
        }
        "permit" | "permit-wait" => {
            let coord = Coordinator::builder(url).key_prefix(&ctx.prefix).build()?;
            let sem = coord.semaphore("{sem}", 4)?;
            ours(
                warm,
                n,
                imp.ends_with("-wait"),
                || sem.try_acquire(TTL),
                |cancel| sem.acquire(TTL, cancel),
                |g| g.release(),
            )?
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
    cpu_per_1000(&mut figures, samples.len());
    latency(&mut figures, "", samples);
    Ok(figures)
}

pub(crate) fn expect(ok: bool, what: &str) -> Res<()> {
    if ok { Ok(()) } else { Err(what.into()) }
}

fn released(outcome: ReleaseOutcome) -> Res<()> {
    match outcome {
        ReleaseOutcome::Released => Ok(()),
        other => Err(format!("release reported {other:?}, not Released").into()),
    }
}
