//! Case 5: what blocked waiters cost the server while nothing changes.
//!
//! Holds one key per waiter (far past the window), starts one waiter per
//! key, waits until every waiter has made its first attempt and a settling
//! pause has passed, then counts the commands Redis ran over a window
//! (`INFO commandstats` before and after; `INFO` itself left out; commands
//! run inside scripts count, as Redis counts them). A waiter whose acquire
//! returned (with an error, or acquired) before the window ended is counted:
//! a run in which any did fails. After the window one key is deleted, and
//! the time until its waiter holds it is reported: proof that the waiters
//! were waiting, not stuck.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use respire_coordination::{CancelToken, Coordinator};
use rlock::{AcquireOptions, RenewalMode};

use crate::child::{Ctx, Res, connect, runtime};
use crate::plan::Figures;

/// How long the held keys live: far past any window.
const HELD_MS: u64 = 600_000;
const WAITER_TTL: Duration = Duration::from_secs(10);
const SETTLE: Duration = Duration::from_millis(500);
const START_DEADLINE: Duration = Duration::from_secs(60);
/// How long the waiter of a deleted key may take to hold it.
const WAKE_DEADLINE: Duration = Duration::from_secs(10);

/// Calls per command since the server started, `INFO` left out.
fn command_calls(conn: &mut redis::Connection) -> Res<BTreeMap<String, u64>> {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn)?;
    let mut calls = BTreeMap::new();
    for line in info.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, stats)) = rest.split_once(':') else {
            continue;
        };
        let count = stats
            .split(',')
            .find_map(|kv| kv.strip_prefix("calls="))
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("no calls in {line:?}"))?;
        if name != "info" {
            calls.insert(name.to_owned(), count);
        }
    }
    Ok(calls)
}

/// Attempts so far: the commands an acquire attempt starts with.
fn attempts(calls: &BTreeMap<String, u64>) -> u64 {
    ["evalsha", "eval", "set"]
        .iter()
        .map(|c| calls.get(*c).copied().unwrap_or(0))
        .sum()
}

fn wait_for(what: &str, mut cond: impl FnMut() -> Res<bool>) -> Res<()> {
    let start = Instant::now();
    while !cond()? {
        if start.elapsed() > START_DEADLINE {
            return Err(format!("timed out waiting for {what}").into());
        }
        thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

pub(crate) fn run(imp: &str, ctx: &Ctx) -> Res<Figures> {
    let url = ctx.urls[0].as_str();
    let waiters = ctx.sizes.waiters;
    let mut admin = connect(url)?;
    let keys: Vec<String> = (0..waiters)
        .map(|i| ctx.key(&format!("held:{i}")))
        .collect();
    let mut hold = redis::pipe();
    for key in &keys {
        hold.cmd("SET")
            .arg(key)
            .arg("holder")
            .arg("PX")
            .arg(HELD_MS)
            .ignore();
    }
    hold.query::<()>(&mut admin)?;
    let before = attempts(&command_calls(&mut admin)?);
    let first = keys[0].clone();
    let entered = Arc::new(AtomicUsize::new(0));
    let returned = Arc::new(AtomicUsize::new(0));
    match imp {
        "lock" => {
            let coord = Coordinator::connect(url)?;
            for key in keys {
                let lock = coord.lock(&key)?;
                let (entered, returned) = (entered.clone(), returned.clone());
                thread::Builder::new().spawn(move || {
                    let cancel = CancelToken::new();
                    entered.fetch_add(1, Ordering::SeqCst);
                    let result = lock.acquire(WAITER_TTL, &cancel);
                    returned.fetch_add(1, Ordering::SeqCst);
                    if let Err(e) = result {
                        eprintln!("a waiter stopped: {e}");
                    }
                })?;
            }
        }
        "rlock" => {
            let manager = rlock::sync_lock::RLock::new(url)?;
            let options = AcquireOptions::builder()
                .ttl(WAITER_TTL)
                .renewal_mode(RenewalMode::Disabled)
                .build()?;
            for key in keys {
                let (manager, options) = (manager.clone(), options.clone());
                let (entered, returned) = (entered.clone(), returned.clone());
                thread::Builder::new().spawn(move || {
                    entered.fetch_add(1, Ordering::SeqCst);
                    let result = manager.acquire_mutex_with_options(&key, options);
                    returned.fetch_add(1, Ordering::SeqCst);
                    if let Err(e) = result {
                        eprintln!("a waiter stopped: {e}");
                    }
                })?;
            }
        }
        "rslock" => {
            // Never dropped: the process exits with its waiters still blocked.
            let rt: &'static tokio::runtime::Runtime = Box::leak(Box::new(runtime()?));
            let manager = rslock::LockManager::new(vec![url]);
            for key in keys {
                let (manager, entered) = (manager.clone(), entered.clone());
                let returned = returned.clone();
                rt.spawn(async move {
                    entered.fetch_add(1, Ordering::SeqCst);
                    let result = manager.acquire(key.as_str(), WAITER_TTL).await;
                    returned.fetch_add(1, Ordering::SeqCst);
                    if let Err(e) = result {
                        eprintln!("a waiter stopped: {e}");
                    }
                });
            }
        }
        other => return Err(format!("no such implementation {other:?}").into()),
    }
    wait_for("every waiter to start", || {
        Ok(entered.load(Ordering::SeqCst) == waiters)
    })?;
    // A `Lock` wait sleeps after its second attempt (the first is the plain
    // one; the second, made once it found the key held, arms tracking).
    let per_waiter = if imp == "lock" { 2 } else { 1 };
    wait_for("every waiter's first attempts", || {
        Ok(attempts(&command_calls(&mut admin)?) >= before + (per_waiter * waiters) as u64)
    })?;
    thread::sleep(SETTLE);
    let start_calls = command_calls(&mut admin)?;
    let start = Instant::now();
    thread::sleep(ctx.sizes.idle_window);
    let end_calls = command_calls(&mut admin)?;
    let secs = start.elapsed().as_secs_f64();
    let stopped = returned.load(Ordering::SeqCst);
    if stopped > 0 {
        return Err(
            format!("{stopped} of {waiters} waiters stopped waiting before the end").into(),
        );
    }
    let deleted = Instant::now();
    redis::cmd("DEL").arg(&first).query::<()>(&mut admin)?;
    while returned.load(Ordering::SeqCst) == 0 {
        if deleted.elapsed() > WAKE_DEADLINE {
            return Err(format!(
                "the waiter of a deleted key did not acquire it within {WAKE_DEADLINE:?}"
            )
            .into());
        }
        thread::sleep(Duration::from_micros(200));
    }
    let woke = deleted.elapsed();
    let mut figures = Figures::new();
    let mut total = 0;
    for (name, calls) in &end_calls {
        let delta = calls - start_calls.get(name).copied().unwrap_or(0);
        if delta > 0 {
            figures.insert(format!("cmd.{name}"), delta as f64 / secs);
        }
        total += delta;
    }
    figures.insert("waiters".into(), waiters as f64);
    figures.insert("wake_ms".into(), woke.as_secs_f64() * 1e3);
    figures.insert("per_s".into(), total as f64 / secs);
    figures.insert("per_waiter_s".into(), total as f64 / secs / waiters as f64);
    Ok(figures)
}
