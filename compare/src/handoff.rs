//! Case 3: hand-off of one key between contenders, each with its own client
//! (coordinator, manager or connection), as threads of one process.
//!
//! In each turn every contender loops until the turn's end: acquire (its
//! library's blocking wait), hold, release, and at once acquire again, so
//! the releaser competes with the waiters it just freed. Grants are ordered by the time
//! they were acquired; for each that went to another contender which was
//! already waiting, the hand-off is the time from the previous holder's
//! release returning (confirmed) to the next holder's acquire returning. A
//! grant that went back to the releaser counts as a re-acquire.

use std::thread;
use std::time::{Duration, Instant};

use respire_coordination::{CancelToken, Coordinator, Fairness, ReleaseOutcome};
use rlock::{AcquireOptions, RenewalMode};

use crate::child::{Ctx, Res, latency, lockstep, runtime};
use crate::plan::{Case, Figures};
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

/// One turn: `contend` on one thread per state, all until the same end.
fn threads<S: Send>(
    states: &mut [S],
    run_for: Duration,
    contend: &(impl Fn(usize, &mut S, Instant) -> Res<Vec<Grant>> + Sync),
) -> Res<(Vec<Grant>, Instant)> {
    let end = Instant::now() + run_for;
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

/// How long one turn runs.
fn turn_length(ctx: &Ctx) -> Duration {
    ctx.sizes.handoff / ctx.sizes.blocks_for(Case::Handoff) as u32
}

/// Runs a turn of `contend` over `states` for every turn the driver gives.
fn turns<S: Send>(
    ctx: &Ctx,
    mut states: Vec<S>,
    contend: impl Fn(usize, &mut S, Instant) -> Res<Vec<Grant>> + Sync,
) -> Res<Tally> {
    let mut tally = Tally::default();
    lockstep(|| {
        let (grants, end) = threads(&mut states, turn_length(ctx), &contend)?;
        tally.add(grants, end);
        Ok(())
    })?;
    Ok(tally)
}

pub(crate) fn run(imp: &str, ctx: &Ctx) -> Res<Figures> {
    let url = ctx.urls[0].as_str();
    let n = ctx.sizes.contenders;
    let hold = ctx.sizes.hold;
    let key = ctx.key("handoff");
    let tally = match imp {
        "raw-tracking" => {
            let mut states = Vec::new();
            for _ in 0..n {
                // One after another, so each warm-up finds the key free.
                let mut waiter = TrackingWaiter::connect(url, key.clone(), TTL)?;
                waiter.acquire("warm")?;
                expect(waiter.release("warm")?, "warm-up release")?;
                states.push(waiter);
            }
            turns(ctx, states, |who, waiter, end| {
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
        "lock" => lock_run(ctx, url, Clients::Own, Fairness::Barging)?,
        "lock-shared" => lock_run(ctx, url, Clients::Shared, Fairness::Barging)?,
        "lock-fifo" => lock_run(ctx, url, Clients::Own, Fairness::fifo())?,
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
            turns(ctx, states, |who, manager, end| {
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
            turns(ctx, states, |who, manager, end| {
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
    Ok(tally.figures())
}

/// Whether the contenders share one coordinator.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Clients {
    /// One coordinator each: every wake-up goes through Redis, as between
    /// processes.
    Own,
    /// One coordinator for all: the threads of one process, whose waiters
    /// queue in it.
    Shared,
}

/// This crate's contenders: `Lock::acquire`, hold, `release`.
fn lock_run(ctx: &Ctx, url: &str, clients: Clients, fairness: Fairness) -> Res<Tally> {
    let n = ctx.sizes.contenders;
    let hold = ctx.sizes.hold;
    let mut states = Vec::new();
    let mut shared: Option<Coordinator> = None;
    for who in 0..n {
        let coord = match (&shared, clients) {
            (Some(coord), Clients::Shared) => coord.clone(),
            _ => {
                let coord = Coordinator::builder(url).key_prefix(&ctx.prefix).build()?;
                // A wait that finds its key held starts the coordinator's
                // invalidation subscriber (one that finds it free does not).
                let warm = coord.lock(&format!("warm:{who}"))?;
                let guard = warm.try_acquire(TTL)?.ok_or("warm-up was contended")?;
                let waited = warm.acquire_timeout(TTL, Duration::from_millis(200))?;
                expect(waited.is_none(), "warm-up wait acquired a held lock")?;
                guard.release()?;
                shared = Some(coord.clone());
                coord
            }
        };
        // A first-in-first-out lock keeps its queue in the key's slot.
        let lock = coord.lock("{handoff}")?.with_fairness(fairness)?;
        states.push((coord, lock));
    }
    turns(ctx, states, |who, (_coord, lock), end| {
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
    })
}

/// rslock's contenders: one lock manager each, as tasks of one runtime.
fn rslock_run(url: &str, ctx: &Ctx, key: &str) -> Res<Tally> {
    let rt = runtime()?;
    let hold = ctx.sizes.hold;
    let mut managers = rt.block_on(async {
        let mut managers = Vec::new();
        for who in 0..ctx.sizes.contenders {
            let manager = rslock::LockManager::new(vec![url]);
            let warm = ctx.key(&format!("warm:{who}"));
            manager.acquire(warm.as_str(), TTL).await?.release().await;
            managers.push(manager);
        }
        Res::Ok(managers)
    })?;
    let mut tally = Tally::default();
    lockstep(|| {
        let end = Instant::now() + turn_length(ctx);
        let (grants, back) = rt.block_on(async {
            let tasks: Vec<_> = managers
                .drain(..)
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
                        Res::Ok((manager, grants))
                    })
                })
                .collect();
            let (mut grants, mut back) = (Vec::new(), Vec::new());
            for task in tasks {
                let (manager, mine) = task.await??;
                back.push(manager);
                grants.extend(mine);
            }
            Res::Ok((grants, back))
        })?;
        managers = back;
        tally.add(grants, end);
        Ok(())
    })?;
    Ok(tally)
}

/// Signed microseconds from `from` to `to`.
fn signed_micros(from: Instant, to: Instant) -> f64 {
    if to >= from {
        (to - from).as_secs_f64() * 1e6
    } else {
        -(from - to).as_secs_f64() * 1e6
    }
}

/// What the turns of one run add up to.
#[derive(Default)]
struct Tally {
    /// Release confirmed → next holder, microseconds (signed).
    handoffs: Vec<f64>,
    /// Release sent → next holder, microseconds.
    from_sent: Vec<f64>,
    /// Release sent → release returned, for the same hand-offs: how long the
    /// releaser's own call took (microseconds).
    release_calls: Vec<f64>,
    grants: usize,
    successions: usize,
    reacquired: usize,
    overlaps: usize,
    late_callers: usize,
    turns: usize,
}

impl Tally {
    /// Adds one turn's grants (those acquired after `end`, taken while the
    /// others were leaving, left out).
    fn add(&mut self, mut grants: Vec<Grant>, end: Instant) {
        grants.retain(|g| g.acquired <= end);
        grants.sort_by_key(|g| g.acquired);
        self.turns += 1;
        self.grants += grants.len();
        self.successions += grants.len().saturating_sub(1);
        for pair in grants.windows(2) {
            let (prev, next) = (&pair[0], &pair[1]);
            if next.acquired < prev.release_sent {
                self.overlaps += 1;
            }
            if next.who == prev.who {
                self.reacquired += 1;
            } else if next.called < prev.release_sent {
                self.handoffs
                    .push(signed_micros(prev.released, next.acquired));
                self.from_sent
                    .push(signed_micros(prev.release_sent, next.acquired));
                self.release_calls
                    .push(signed_micros(prev.release_sent, prev.released));
            } else {
                self.late_callers += 1;
            }
        }
    }

    fn figures(self) -> Figures {
        let mut figures = Figures::new();
        figures.insert("grants".into(), self.grants as f64);
        figures.insert("turns".into(), self.turns as f64);
        figures.insert("overlaps".into(), self.overlaps as f64);
        figures.insert("late_callers".into(), self.late_callers as f64);
        if self.successions > 0 {
            figures.insert(
                "reacquired".into(),
                self.reacquired as f64 / self.successions as f64,
            );
        }
        latency(&mut figures, "", self.handoffs);
        latency(&mut figures, "sent_", self.from_sent);
        latency(&mut figures, "release_", self.release_calls);
        figures
    }
}
