//! Cases 2 and 4: Redlock over five nodes, local (uncontended acquire +
//! release pairs) and behind 20 ms round trips (single acquire attempts,
//! counted as they succeed or fail).

use std::sync::Arc;
use std::time::{Duration, Instant};

use respire_coordination::{RedlockGroup, RedlockOptions, ReleaseOutcome};

use crate::child::{Ctx, Res, latency, lockstep, micros, runtime, warm_up};
use crate::plan::{Case, Figures};
use crate::quorum::QuorumWorkers;
use crate::single::{expect, owner};

const TTL: Duration = Duration::from_secs(10);
const TTL_MS: u64 = 10_000;
/// Untimed attempts over the slow links before the timed ones (connections,
/// script loads).
const SLOW_WARM_UP: usize = 2;

/// Times `per_turn` pairs a turn after `warm` untimed ones; `op` (given a
/// number no other call gets) returns how long its acquire took.
/// Microseconds: (pairs, acquires).
fn time_pairs(
    warm: usize,
    per_turn: usize,
    mut op: impl FnMut(u64) -> Res<Duration>,
) -> Res<(Vec<f64>, Vec<f64>)> {
    let mut i = 0;
    for _ in 0..warm {
        i += 1;
        op(i)?;
    }
    let (mut pairs, mut acquires) = (Vec::new(), Vec::new());
    lockstep(|| {
        for _ in 0..per_turn {
            i += 1;
            let start = Instant::now();
            let acquired = op(i)?;
            pairs.push(micros(start.elapsed()));
            acquires.push(micros(acquired));
        }
        Ok(())
    })?;
    Ok((pairs, acquires))
}

fn group(urls: &[String], options: RedlockOptions) -> Res<RedlockGroup> {
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    Ok(RedlockGroup::connect(&refs, options)?)
}

/// Case 2: acquire + release pairs over the five local servers.
pub(crate) fn run_local(imp: &str, ctx: &Ctx) -> Res<Figures> {
    let urls = &ctx.urls;
    let warm = warm_up(ctx.sizes.redlock_pairs);
    let n = ctx.sizes.per_block(Case::Redlock, ctx.sizes.redlock_pairs);
    let (pairs, acquires) = match imp {
        "raw-quorum" => {
            let mut workers = QuorumWorkers::start(urls, ctx.sizes.redlock_node_timeout)?;
            let key: Arc<str> = ctx.key("raw").into();
            time_pairs(warm, n, |i| {
                let value: Arc<str> = owner(i).into();
                let start = Instant::now();
                expect(
                    workers.acquire(&key, &value, TTL_MS),
                    "raw quorum not reached",
                )?;
                let acquired = start.elapsed();
                expect(workers.release(&key, &value), "raw release not confirmed")?;
                Ok(acquired)
            })?
        }
        "group" => {
            let options = RedlockOptions {
                node_timeout: ctx.sizes.redlock_node_timeout,
                ..RedlockOptions::default()
            };
            let group = group(urls, options)?;
            let lock = group.lock(&ctx.key("group"))?;
            time_pairs(warm, n, |_| {
                let start = Instant::now();
                let guard = lock.try_acquire(TTL)?.ok_or("group was contended")?;
                let acquired = start.elapsed();
                expect(
                    guard.release()? == ReleaseOutcome::Released,
                    "group release found the lock gone",
                )?;
                Ok(acquired)
            })?
        }
        "rslock" => {
            let rt = runtime()?;
            let manager = rslock::LockManager::new(urls.clone());
            let key = ctx.key("rslock");
            let (mut pairs, mut acquires) = (Vec::new(), Vec::new());
            // Timed inside the runtime, as an async caller would see it.
            let run = |count: usize, pairs: &mut Vec<f64>, acquires: &mut Vec<f64>| {
                rt.block_on(async {
                    for _ in 0..count {
                        let start = Instant::now();
                        let lock = manager.lock(key.as_str(), TTL).await?;
                        let acquired = start.elapsed();
                        manager.unlock(&lock).await;
                        pairs.push(micros(start.elapsed()));
                        acquires.push(micros(acquired));
                    }
                    Res::Ok(())
                })
            };
            run(warm, &mut Vec::new(), &mut Vec::new())?;
            lockstep(|| run(n, &mut pairs, &mut acquires))?;
            (pairs, acquires)
        }
        "redlock" => {
            let manager = redlock::RedLock::new(urls.clone());
            let key = ctx.key("redlock");
            time_pairs(warm, n, |_| {
                let start = Instant::now();
                let lock = manager
                    .lock(key.as_bytes(), TTL_MS as usize)?
                    .ok_or("redlock did not acquire")?;
                let acquired = start.elapsed();
                manager.unlock(&lock);
                Ok(acquired)
            })?
        }
        other => return Err(format!("no such implementation {other:?}").into()),
    };
    let mut figures = Figures::new();
    crate::child::cpu_per_1000(&mut figures, pairs.len());
    latency(&mut figures, "", pairs);
    latency(&mut figures, "acquire_", acquires);
    Ok(figures)
}

/// One timed attempt over the slow links.
struct Attempt {
    took: Duration,
    ok: bool,
}

/// Runs `attempt` (given a fresh key each time) `SLOW_WARM_UP` times untimed,
/// then a share of the timed attempts in each turn. An attempt returns how long its acquire took when it
/// acquired (and then releases what it got), `None` when it did not; a
/// failed attempt is timed from the call to its return. The first few
/// distinct errors are printed as notes.
fn attempts(
    ctx: &Ctx,
    mut attempt: impl FnMut(&str) -> Res<Option<Duration>>,
) -> Res<Vec<Attempt>> {
    let per_turn = ctx.sizes.per_block(Case::Slow, ctx.sizes.slow_attempts);
    let mut notes: Vec<String> = Vec::new();
    let mut out = Vec::new();
    let mut i = 0;
    let mut one = |timed: bool, out: &mut Vec<Attempt>| {
        i += 1;
        let key = ctx.key(&format!("slow:{i}"));
        let start = Instant::now();
        let result = attempt(&key);
        let failed_after = start.elapsed();
        let outcome = match result {
            Ok(Some(took)) => Attempt { took, ok: true },
            Ok(None) => Attempt {
                took: failed_after,
                ok: false,
            },
            Err(e) => {
                let e = e.to_string();
                if notes.len() < 3 && !notes.contains(&e) {
                    println!("NOTE {}", e.replace('\n', " "));
                    notes.push(e);
                }
                Attempt {
                    took: failed_after,
                    ok: false,
                }
            }
        };
        if timed {
            out.push(outcome);
        }
    };
    for _ in 0..SLOW_WARM_UP {
        one(false, &mut out);
    }
    lockstep(|| {
        for _ in 0..per_turn {
            one(true, &mut out);
        }
        Ok(())
    })?;
    Ok(out)
}

/// Case 4: single attempts over five nodes, each 20 ms away.
pub(crate) fn run_slow(imp: &str, ctx: &Ctx) -> Res<Figures> {
    let urls = &ctx.slow_urls;
    let runs = match imp {
        "raw-quorum" => {
            let mut workers = QuorumWorkers::start(urls, Duration::from_millis(200))?;
            let mut i = 0;
            attempts(ctx, |key| {
                i += 1;
                let (key, value): (Arc<str>, Arc<str>) = (key.into(), owner(i).into());
                let start = Instant::now();
                if !workers.acquire(&key, &value, TTL_MS) {
                    return Ok(None);
                }
                let took = start.elapsed();
                workers.release(&key, &value);
                Ok(Some(took))
            })
        }
        "group-default" | "group-200ms" => {
            let options = if imp == "group-default" {
                RedlockOptions::default()
            } else {
                RedlockOptions {
                    node_timeout: Duration::from_millis(200),
                    ..RedlockOptions::default()
                }
            };
            let group = group(urls, options)?;
            attempts(ctx, |key| {
                let start = Instant::now();
                let guard = group.lock(key)?.try_acquire(TTL)?.ok_or("contended")?;
                let took = start.elapsed();
                let _ = guard.release();
                Ok(Some(took))
            })
        }
        "rslock" => {
            let rt = runtime()?;
            let manager = rslock::LockManager::new(urls.clone());
            attempts(ctx, |key| {
                rt.block_on(async {
                    let start = Instant::now();
                    let lock = manager.lock(key, TTL).await?;
                    let took = start.elapsed();
                    manager.unlock(&lock).await;
                    Res::Ok(Some(took))
                })
            })
        }
        "redlock" => {
            let manager = redlock::RedLock::new(urls.clone());
            attempts(ctx, |key| {
                let start = Instant::now();
                let Some(lock) = manager.lock(key.as_bytes(), TTL_MS as usize)? else {
                    return Ok(None);
                };
                let took = start.elapsed();
                manager.unlock(&lock);
                Ok(Some(took))
            })
        }
        other => return Err(format!("no such implementation {other:?}").into()),
    }?;
    let ms = |a: &Attempt| a.took.as_secs_f64() * 1e3;
    let (ok, failed): (Vec<&Attempt>, Vec<&Attempt>) = runs.iter().partition(|a| a.ok);
    let mut figures = Figures::new();
    figures.insert("attempts".into(), runs.len() as f64);
    figures.insert("ok".into(), ok.len() as f64);
    figures.insert("success".into(), ok.len() as f64 / runs.len() as f64);
    let mut ok_ms: Vec<f64> = ok.iter().map(|a| ms(a)).collect();
    let mut failed_ms: Vec<f64> = failed.iter().map(|a| ms(a)).collect();
    let mut all_ms: Vec<f64> = runs.iter().map(ms).collect();
    for (name, samples) in [
        ("acquire_ms_p50", &mut ok_ms),
        ("failed_ms_p50", &mut failed_ms),
        ("attempt_ms_p50", &mut all_ms),
    ] {
        if let Some(p50) = crate::stats::quantile(samples, 0.5) {
            figures.insert(name.into(), p50);
        }
    }
    Ok(figures)
}
