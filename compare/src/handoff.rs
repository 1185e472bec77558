//! Case 3: hand-off of one key between contenders, each with its own client
//! (coordinator, manager or connection), as threads of one process.
//!
//! Every contender loops until the end of the run: acquire (its library's
//! blocking wait), hold, release, and at once acquire again, so the releaser
//! competes with the waiters it just freed. Grants are ordered by the time
//! they were acquired; for each that went to another contender which was
//! already waiting, the hand-off is the time from the previous holder's
//! release returning (confirmed) to the next holder's acquire returning. A
//! grant that went back to the releaser counts as a re-acquire.

use std::thread;
use std::time::{Duration, Instant};

use respire_coordination::{CancelToken, Coordinator, ReleaseOutcome};
use rlock::{AcquireOptions, RenewalMode};

use crate::child::{Ctx, Res, latency, runtime};
use crate::plan::Figures;
use crate::single::{expect, owner};
use crate::tracking::TrackingWaiter;

const TTL: Duration = Duration::from_secs(10);

/// One grant, on the clock all contenders of the process share.
struct Grant {
    who: usize,
    called: Instant,
    acquired: Instant,
    release_sent: Instant,
    released: Instant,
}

enum Step {
    Acquire,
    Release,
}

/// Acquire, hold, release until `end`; `step` does the library calls.
fn cycles(
    who: usize,
    end: Instant,
    hold: Duration,
    mut step: impl FnMut(Step) -> Res<()>,
) -> Res<Vec<Grant>> {
    let mut grants = Vec::new();
    while Instant::now() < end {
        let called = Instant::now();
        step(Step::Acquire)?;
        let acquired = Instant::now();
        thread::sleep(hold);
        let release_sent = Instant::now();
        step(Step::Release)?;
        grants.push(Grant {
            who,
            called,
            acquired,
            release_sent,
            released: Instant::now(),
        });
    }
    Ok(grants)
}

/// Runs `contend` on one thread per state, all until the same end.
fn threads<S: Send>(
    mut states: Vec<S>,
    run_for: Duration,
    contend: impl Fn(usize, &mut S, Instant) -> Res<Vec<Grant>> + Sync,
) -> Res<(Vec<Grant>, Instant)> {
    let end = Instant::now() + run_for;
    let contend = &contend;
    let results: Vec<Res<Vec<Grant>>> = thread::scope(|s| {
        let handles: Vec<_> = states
            .iter_mut()
            .enumerate()
            .map(|(who, state)| s.spawn(move || contend(who, state, end)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a contender panicked".into()))
            })
            .collect()
    });
    let mut grants = Vec::new();
    for r in results {
        grants.extend(r?);
    }
    Ok((grants, end))
}

pub(crate) fn run(imp: &str, ctx: &Ctx) -> Res<Figures> {
    let url = ctx.urls[0].as_str();
    let n = ctx.sizes.contenders;
    let hold = ctx.sizes.hold;
    let run_for = ctx.sizes.handoff;
    let key = ctx.key("handoff");
    let (grants, end) = match imp {
        "raw-tracking" => {
            let mut states = Vec::new();
            for who in 0..n {
                let mut warm = TrackingWaiter::connect(url, ctx.key(&format!("warm:{who}")), TTL)?;
                warm.acquire("warm")?;
                expect(warm.release("warm")?, "warm-up release")?;
                states.push(TrackingWaiter::connect(url, key.clone(), TTL)?);
            }
            threads(states, run_for, |who, waiter, end| {
                let mut i = 0;
                let mut value = String::new();
                cycles(who, end, hold, |step| match step {
                    Step::Acquire => {
                        i += 1;
                        value = owner((who as u64) << 32 | i);
                        waiter.acquire(&value)
                    }
                    Step::Release => expect(waiter.release(&value)?, "raw release"),
                })
            })?
        }
        "lock" => {
            let mut states = Vec::new();
            for who in 0..n {
                let coord = Coordinator::builder(url).key_prefix(&ctx.prefix).build()?;
                // A wait starts the coordinator's invalidation subscriber.
                let warm = coord.lock(&format!("warm:{who}"))?;
                let guard = warm.acquire_timeout(TTL, Duration::from_secs(5))?;
                guard.ok_or("warm-up was contended")?.release()?;
                let lock = coord.lock("handoff")?;
                states.push((coord, lock));
            }
            threads(states, run_for, |who, (_coord, lock), end| {
                let cancel = CancelToken::new();
                let mut held = None;
                cycles(who, end, hold, |step| match step {
                    Step::Acquire => {
                        held = Some(lock.acquire(TTL, &cancel)?);
                        Ok(())
                    }
                    Step::Release => {
                        let outcome = held.take().ok_or("nothing held")?.release()?;
                        expect(outcome == ReleaseOutcome::Released, "release not Released")
                    }
                })
            })?
        }
        "rlock" => {
            let options = AcquireOptions::builder()
                .ttl(TTL)
                .renewal_mode(RenewalMode::Disabled)
                .build()?;
            let mut states = Vec::new();
            for who in 0..n {
                let manager = rlock::sync_lock::RLock::new(url)?;
                let warm = ctx.key(&format!("warm:{who}"));
                manager
                    .acquire_mutex_with_options(&warm, options.clone())?
                    .release()?;
                states.push(manager);
            }
            threads(states, run_for, |who, manager, end| {
                let mut held = None;
                cycles(who, end, hold, |step| match step {
                    Step::Acquire => {
                        held = Some(manager.acquire_mutex_with_options(&key, options.clone())?);
                        Ok(())
                    }
                    Step::Release => Ok(held.take().ok_or("nothing held")?.release()?),
                })
            })?
        }
        "redlock" => {
            let mut states = Vec::new();
            for who in 0..n {
                let manager = redlock::RedLock::new(vec![url]);
                let warm = ctx.key(&format!("warm:{who}"));
                drop(manager.acquire(warm.as_bytes(), TTL.as_millis() as usize)?);
                states.push(manager);
            }
            threads(states, run_for, |who, manager, end| {
                let manager = &*manager;
                let mut held = None;
                cycles(who, end, hold, |step| {
                    match step {
                        Step::Acquire => {
                            held = Some(manager.acquire(key.as_bytes(), TTL.as_millis() as usize)?)
                        }
                        // Dropping the guard unlocks.
                        Step::Release => held = None,
                    }
                    Ok(())
                })
            })?
        }
        "rslock" => rslock_run(url, ctx, &key)?,
        other => return Err(format!("no such implementation {other:?}").into()),
    };
    Ok(analyze(grants, end))
}

/// rslock's contenders: one lock manager each, as tasks of one runtime.
fn rslock_run(url: &str, ctx: &Ctx, key: &str) -> Res<(Vec<Grant>, Instant)> {
    let rt = runtime()?;
    let hold = ctx.sizes.hold;
    rt.block_on(async {
        let mut managers = Vec::new();
        for who in 0..ctx.sizes.contenders {
            let manager = rslock::LockManager::new(vec![url]);
            let warm = ctx.key(&format!("warm:{who}"));
            manager.acquire(warm.as_str(), TTL).await?.release().await;
            managers.push(manager);
        }
        let end = Instant::now() + ctx.sizes.handoff;
        let tasks: Vec<_> = managers
            .into_iter()
            .enumerate()
            .map(|(who, manager)| {
                let key = key.to_owned();
                tokio::spawn(async move {
                    let mut grants = Vec::new();
                    while Instant::now() < end {
                        let called = Instant::now();
                        let guard = manager.acquire(key.as_str(), TTL).await?;
                        let acquired = Instant::now();
                        tokio::time::sleep(hold).await;
                        let release_sent = Instant::now();
                        guard.release().await;
                        grants.push(Grant {
                            who,
                            called,
                            acquired,
                            release_sent,
                            released: Instant::now(),
                        });
                    }
                    Res::Ok(grants)
                })
            })
            .collect();
        let mut grants = Vec::new();
        for task in tasks {
            grants.extend(task.await??);
        }
        Res::Ok((grants, end))
    })
}

/// Signed microseconds from `from` to `to`.
fn signed_micros(from: Instant, to: Instant) -> f64 {
    if to >= from {
        (to - from).as_secs_f64() * 1e6
    } else {
        -(from - to).as_secs_f64() * 1e6
    }
}

fn analyze(mut grants: Vec<Grant>, end: Instant) -> Figures {
    // Grants after the end were taken while the others were leaving.
    grants.retain(|g| g.acquired <= end);
    grants.sort_by_key(|g| g.acquired);
    let (mut handoffs, mut from_sent) = (Vec::new(), Vec::new());
    let (mut reacquired, mut overlaps, mut late_callers) = (0, 0, 0);
    for pair in grants.windows(2) {
        let (prev, next) = (&pair[0], &pair[1]);
        if next.acquired < prev.release_sent {
            overlaps += 1;
        }
        if next.who == prev.who {
            reacquired += 1;
        } else if next.called < prev.release_sent {
            handoffs.push(signed_micros(prev.released, next.acquired));
            from_sent.push(signed_micros(prev.release_sent, next.acquired));
        } else {
            late_callers += 1;
        }
    }
    let successions = grants.len().saturating_sub(1);
    let mut figures = Figures::new();
    figures.insert("grants".into(), grants.len() as f64);
    figures.insert("overlaps".into(), f64::from(overlaps));
    figures.insert("late_callers".into(), f64::from(late_callers));
    if successions > 0 {
        figures.insert(
            "reacquired".into(),
            f64::from(reacquired) / successions as f64,
        );
    }
    latency(&mut figures, "", handoffs);
    latency(&mut figures, "sent_", from_sent);
    figures
}
