//! A worker process: the campaign binary run again as `campaign worker`, so
//! that the nemesis can `SIGSTOP` it like any client process.
//!
//! It loops until its stdin closes: acquire a lease on one of the run's keys
//! → fenced read of the resource → think → fenced write → release, and
//! writes its history as JSON lines, flushed one by one, with times on the
//! shared monotonic clock:
//!
//! - `grant`: `g` when the acquire returned a guard, the token and slot;
//! - `vouch`: nothing separate — `end` carries `v`, the time read just before
//!   the last `is_lost()` that answered `false` (the last instant the guard
//!   vouched for the lease), `lost` and the release outcome;
//! - `op`: each resource operation with its send and reply times;
//! - `err`: every acquire error; `stats` at the end;
//! - `cap` (semaphores with `set_capacity` on): each `set_capacity` call,
//!   its key, the capacity asked for (`cap`), when it was sent (`s`) and
//!   returned (`r`), and `ok` with the capacity stored before (`prev`,
//!   `null` if none) or `ok: false` with the error (the change may or may
//!   not have been stored). A worker whose acquire then fails with
//!   `CapacityMismatch` takes the stored capacity for its next acquires.
//!
//! Some holders (`expire_pct`) let the lease expire instead of releasing it:
//! they hold on without renewing, vouching every 5 ms until `is_lost()` says
//! the lease is gone, then release (a leader: resign), so that the last
//! vouch of such a claim lies within 5 ms of the guard's loss deadline.
//! The election workload campaigns instead of acquiring.
//! Each election worker also runs one `observe()` follower thread per key,
//! which writes `obs` (each leader reported: its term, or none) and
//! `obs-err` lines to `worker-N-observe.jsonl`.
//!
//! The multi-lock workload takes a random non-empty subset of the keys with
//! `fenced_lock_all` and writes one `grant` (and one `end`) per key of the
//! set, each with its own number and token and the set's first number
//! (`set`, `size`); each key's resource is read, then written, under its
//! own token. The `lock-all` workload does the same with `lock_all`,
//! without tokens (the resource gets 0, as for `Lock`).
//!
//! The planted bug of the `hoarder` control: one worker leaks every guard
//! it is granted, its keep-alive running until the process exits; the
//! history has the grant and nothing after it (no vouch, no release).
//!
//! The planted bug of the `partial-guard` control: a worker that takes sets
//! of at least two keys, leaves the last key out of its request, and records
//! the set whole; what the guard says of that key (no token, not among its
//! keys) is recorded as it is, for the `partial-guard` checker.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use respire_coordination::{
    CancelToken, Coordinator, Election, Error, Fairness, FencedLock, FencedMultiGuard, Leadership,
    Lock, MultiLockGuard, ReadLease, RedlockGroup, RedlockGuard, RedlockOptions, ReleaseOutcome,
    Replication, Semaphore, WriteLease,
};
use serde_json::json;

use crate::clock::now_ns;
use crate::resource::{Reply, Resource};
use crate::rng::Rng;
use crate::spec::{Connect, WorkerSpec, Workload};
use crate::topo::APP_USER;

/// The primitive handles for one logical key.
enum Handle {
    Lock(Lock),
    Fenced(FencedLock),
    Rw(ReadLease, WriteLease),
    Semaphore(Semaphore),
    Redlock(String),
    Election(Election),
    /// Sets of the run's keys taken together (`fenced_lock_all`, or
    /// `lock_all` for the `lock-all` workload).
    Multi(Coordinator),
}

/// A held lease of any kind.
enum Held {
    Lock(respire_coordination::LockGuard),
    Fenced(respire_coordination::FencedGuard),
    Read(respire_coordination::ReadGuard),
    Write(respire_coordination::WriteGuard),
    Permit(respire_coordination::Permit),
    Redlock(RedlockGuard),
    Leader(Leadership),
    Multi(FencedMultiGuard),
    MultiPlain(MultiLockGuard),
}

impl Held {
    fn is_lost(&self) -> bool {
        match self {
            Held::Lock(g) => g.is_lost(),
            Held::Fenced(g) => g.is_lost(),
            Held::Read(g) => g.is_lost(),
            Held::Write(g) => g.is_lost(),
            Held::Permit(g) => g.is_lost(),
            Held::Redlock(g) => g.is_lost(),
            Held::Leader(g) => g.is_lost(),
            Held::Multi(g) => g.is_lost(),
            Held::MultiPlain(g) => g.is_lost(),
        }
    }

    /// The fencing token of each member key (0 for unfenced kinds; `None`
    /// for a key of the set the guard has no lease on).
    fn tokens(&self, keys: &[&str]) -> Vec<Option<u64>> {
        match self {
            Held::Multi(g) => keys
                .iter()
                .map(|k| g.fencing_token(&format!("{{{k}}}lease")).map(|t| t.get()))
                .collect(),
            Held::MultiPlain(g) => keys
                .iter()
                .map(|k| {
                    let name = format!("{{{k}}}lock");
                    g.keys().any(|held| held.ends_with(&name)).then_some(0)
                })
                .collect(),
            _ => vec![Some(self.token())],
        }
    }

    /// The fencing token of a single grant (0 for unfenced kinds).
    fn token(&self) -> u64 {
        match self {
            Held::Fenced(g) => g.fencing_token().get(),
            Held::Write(g) => g.fencing_token().get(),
            Held::Permit(g) => g.fencing_token().get(),
            Held::Leader(g) => g.term().get(),
            _ => 0,
        }
    }

    fn slot(&self) -> Option<u32> {
        match self {
            Held::Permit(g) => Some(g.slot()),
            _ => None,
        }
    }

    /// `x` exclusive, `r` reader, `s` permit.
    fn mode(&self) -> &'static str {
        match self {
            Held::Read(_) => "r",
            Held::Permit(_) => "s",
            _ => "x",
        }
    }

    /// `verify_still_held()`: whether the server held the lease (an
    /// error's message when it failed); `None` for Redlock, which has none.
    fn verify(&self) -> Option<Result<bool, String>> {
        let held = match self {
            Held::Lock(g) => g.verify_still_held(),
            Held::Fenced(g) => g.verify_still_held(),
            Held::Read(g) => g.verify_still_held(),
            Held::Write(g) => g.verify_still_held(),
            Held::Permit(g) => g.verify_still_held(),
            Held::Leader(g) => g.verify_still_held(),
            Held::Multi(g) => g.verify_still_held(),
            Held::MultiPlain(g) => g.verify_still_held(),
            Held::Redlock(_) => return None,
        };
        Some(held.map(|h| h.is_some()).map_err(|e| e.to_string()))
    }

    /// `reset_expiry(ttl)`: whether the server confirmed the new expiry.
    fn reset(&self, ttl: Duration) -> Result<bool, String> {
        match self {
            Held::Lock(g) => g.reset_expiry(ttl),
            Held::Fenced(g) => g.reset_expiry(ttl),
            Held::Read(g) => g.reset_expiry(ttl),
            Held::Write(g) => g.reset_expiry(ttl),
            Held::Permit(g) => g.reset_expiry(ttl),
            Held::Leader(g) => g.reset_expiry(ttl),
            Held::Multi(g) => g.reset_expiry(ttl),
            Held::MultiPlain(g) => g.reset_expiry(ttl),
            Held::Redlock(g) => g.reset_expiry(ttl),
        }
        .map_err(|e| e.to_string())
    }

    /// `proclaim(value)` of a leadership: whether the server set it; `None`
    /// for other kinds.
    fn proclaim(&self, value: &str) -> Option<Result<bool, String>> {
        match self {
            Held::Leader(g) => Some(g.proclaim(value).map_err(|e| e.to_string())),
            _ => None,
        }
    }

    /// Holds a keep-alive for `f`'s duration when `keep` is set.
    fn with_keep_alive<T>(&self, keep: bool, f: impl FnOnce() -> T) -> (T, bool) {
        if !keep {
            return (f(), false);
        }
        match self {
            Held::Redlock(g) => match g.keep_alive() {
                Ok(k) => {
                    let out = f();
                    drop(k);
                    (out, true)
                }
                Err(_) => (f(), false),
            },
            Held::Lock(g) => keep_lease(g.keep_alive().ok(), f),
            Held::Fenced(g) => keep_lease(g.keep_alive().ok(), f),
            Held::Read(g) => keep_lease(g.keep_alive().ok(), f),
            Held::Write(g) => keep_lease(g.keep_alive().ok(), f),
            Held::Permit(g) => keep_lease(g.keep_alive().ok(), f),
            Held::Leader(g) => keep_lease(g.keep_alive().ok(), f),
            Held::Multi(g) => keep_lease(g.keep_alive().ok(), f),
            Held::MultiPlain(g) => keep_lease(g.keep_alive().ok(), f),
        }
    }

    /// The planted bug of the `hoarder` control: leaks the guard with its
    /// keep-alive running, so the lease is renewed until the worker ends and
    /// never released. Returns the keep-alive (kept by the caller), or
    /// `None` for kinds without one here (sets, Redlock) or when it could
    /// not start: the leaked lease then expires at its TTL.
    fn hoard(self) -> Option<Box<dyn std::any::Any>> {
        let held: &'static Held = Box::leak(Box::new(self));
        fn boxed<K: 'static>(k: respire_coordination::Result<K>) -> Option<Box<dyn std::any::Any>> {
            k.ok().map(|k| Box::new(k) as Box<dyn std::any::Any>)
        }
        match held {
            Held::Lock(g) => boxed(g.keep_alive()),
            Held::Fenced(g) => boxed(g.keep_alive()),
            Held::Read(g) => boxed(g.keep_alive()),
            Held::Write(g) => boxed(g.keep_alive()),
            Held::Permit(g) => boxed(g.keep_alive()),
            Held::Leader(g) => boxed(g.keep_alive()),
            _ => None,
        }
    }

    fn release(self) -> String {
        let outcome = match self {
            Held::Lock(g) => g.release(),
            Held::Fenced(g) => g.release(),
            Held::Read(g) => g.release(),
            Held::Write(g) => g.release(),
            Held::Permit(g) => g.release(),
            Held::Leader(g) => g.resign(),
            Held::Multi(g) => return set_outcome(g.release()),
            Held::MultiPlain(g) => return set_outcome(g.release()),
            Held::Redlock(g) => g.release(),
        };
        outcome_label(outcome)
    }
}

fn set_outcome(outcomes: Vec<(String, respire_coordination::Result<ReleaseOutcome>)>) -> String {
    outcomes
        .into_iter()
        .map(|(_, outcome)| outcome_label(outcome))
        .collect::<Vec<_>>()
        .join(",")
}

fn outcome_label(outcome: respire_coordination::Result<ReleaseOutcome>) -> String {
    match outcome {
        Ok(ReleaseOutcome::Released) => "Released".into(),
        Ok(ReleaseOutcome::Expired) => "Expired".into(),
        Ok(ReleaseOutcome::TakenOver) => "TakenOver".into(),
        Ok(ReleaseOutcome::Uncertain) => "Uncertain".into(),
        Ok(other) => format!("{other:?}"),
        Err(e) => format!("error: {e}"),
    }
}

fn keep_lease<K, T>(keep: Option<K>, f: impl FnOnce() -> T) -> (T, bool) {
    let kept = keep.is_some();
    let out = f();
    drop(keep);
    (out, kept)
}

/// The JSON-lines history file, one flushed line per event.
struct History(BufWriter<File>);

impl History {
    fn emit(&mut self, value: serde_json::Value) {
        let _ = writeln!(self.0, "{value}");
        let _ = self.0.flush();
    }
}

pub(crate) fn main() -> Result<(), String> {
    let spec_text =
        std::env::var("CAMPAIGN_WORKER").map_err(|_| "CAMPAIGN_WORKER is not set".to_string())?;
    let spec = WorkerSpec::from_json(&spec_text)?;
    let file = File::create(&spec.out).map_err(|e| format!("{}: {e}", spec.out))?;
    let mut history = History(BufWriter::new(file));

    // The driver closes our stdin to end the run.
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let mut buf = [0u8; 64];
            while let Ok(n) = std::io::stdin().read(&mut buf) {
                if n == 0 {
                    break;
                }
            }
            stop.store(true, Ordering::SeqCst);
        });
    }

    let mut rng = Rng::derive(spec.seed, 1000 + spec.id);
    let value = format!("w{}", spec.id);
    let (mut handles, group, coord) = loop {
        match connect(&spec) {
            Ok(h) => break h,
            Err(e) => {
                history.emit(json!({"ev": "err", "w": spec.id, "t": now_ns(), "what": format!("connect: {e}")}));
                if stop.load(Ordering::SeqCst) {
                    return Ok(());
                }
                thread::sleep(Duration::from_millis(200));
            }
        }
    };
    let cancel = CancelToken::new();
    let mut followers = Vec::new();
    if spec.workload == Workload::Election {
        let path = observe_file(&spec.out);
        let file = File::create(&path).map_err(|e| format!("{path}: {e}"))?;
        let out = Arc::new(std::sync::Mutex::new(History(BufWriter::new(file))));
        for (h, key) in handles.iter().zip(&spec.keys) {
            let Handle::Election(election) = h else {
                continue;
            };
            let (election, key, cancel, out) = (
                election.clone(),
                key.clone(),
                cancel.clone(),
                Arc::clone(&out),
            );
            let (worker, poll) = (spec.id, spec.poll_follower);
            followers.push(thread::spawn(move || {
                follow(worker, &key, &election, poll, &cancel, &out);
            }));
        }
    }
    let mut resource = Resource::new(&spec.resource);
    let ttl = Duration::from_millis(spec.ttl_ms);
    let wait = ttl * 2;
    let (mut attempts, mut busy, mut errors, mut n) = (0u64, 0u64, 0u64, 0u64);
    // The hoarder's leaked guards' keep-alives, and the keys it holds so.
    let mut hoard: Vec<Box<dyn std::any::Any>> = Vec::new();
    let mut hoarded: Vec<usize> = Vec::new();

    while !stop.load(Ordering::SeqCst) {
        if let Some((lo, hi, pct)) = spec.set_capacity
            && rng.chance(pct)
        {
            let kc = rng.range(0, handles.len() as u64 - 1) as usize;
            let cap = rng.range(u64::from(lo), u64::from(hi)) as u32;
            if let Handle::Semaphore(sem) = &handles[kc] {
                let s = now_ns();
                let answer = sem.set_capacity(cap);
                let r = now_ns();
                let mut line = json!({"ev": "cap", "w": spec.id, "key": spec.keys[kc],
                    "s": s, "r": r, "cap": cap});
                match answer {
                    Ok(prev) => {
                        line["ok"] = json!(true);
                        line["prev"] = json!(prev);
                    }
                    Err(e) => {
                        line["ok"] = json!(false);
                        line["what"] = json!(e.to_string());
                    }
                }
                history.emit(line);
            }
        }
        if spec.hoard && hoarded.len() == handles.len() {
            thread::sleep(Duration::from_millis(50));
            continue;
        }
        let ki = rng.range(0, handles.len() as u64 - 1) as usize;
        if hoarded.contains(&ki) {
            continue;
        }
        let write_mode = rng.chance(30);
        // The keys of the grant: one, or for sets a random non-empty subset.
        let set: Vec<usize> = match &handles[ki] {
            Handle::Multi(_) => {
                let mut set: Vec<usize> = (0..spec.keys.len()).filter(|_| rng.chance(50)).collect();
                if set.is_empty() {
                    set.push(ki);
                }
                if spec.plant_partial && set.len() == 1 && spec.keys.len() > 1 {
                    set.push((set[0] + 1) % spec.keys.len());
                    set.sort_unstable();
                }
                set
            }
            _ => vec![ki],
        };
        let names: Vec<&str> = set.iter().map(|&k| spec.keys[k].as_str()).collect();
        // The keys asked for: all of them, but for the planted bug.
        let asked = if spec.plant_partial && names.len() > 1 {
            &names[..names.len() - 1]
        } else {
            &names[..]
        };
        attempts += 1;
        let a = now_ns();
        let got: respire_coordination::Result<Option<Held>> = match &handles[ki] {
            Handle::Lock(l) => l.acquire_timeout(ttl, wait).map(|g| g.map(Held::Lock)),
            Handle::Fenced(l) => l.acquire_timeout(ttl, wait).map(|g| g.map(Held::Fenced)),
            Handle::Rw(r, w) => {
                if write_mode {
                    w.acquire_timeout(ttl, wait).map(|g| g.map(Held::Write))
                } else {
                    r.acquire_timeout(ttl, wait).map(|g| g.map(Held::Read))
                }
            }
            Handle::Semaphore(s) => s.acquire_timeout(ttl, wait).map(|g| g.map(Held::Permit)),
            Handle::Redlock(key) => group
                .as_ref()
                .expect("a redlock group")
                .lock(key)
                .and_then(|lock| lock.acquire_timeout(ttl, wait))
                .map(|g| g.map(Held::Redlock)),
            Handle::Election(e) => e
                .campaign_timeout(&value, ttl, wait)
                .map(|g| g.map(Held::Leader)),
            Handle::Multi(coord) if spec.workload == Workload::LockAll => {
                let keys: Vec<String> = asked.iter().map(|k| format!("{{{k}}}lock")).collect();
                coord
                    .lock_all(&keys)
                    .and_then(|m| m.acquire_timeout(ttl, wait))
                    .map(|g| g.map(Held::MultiPlain))
            }
            Handle::Multi(coord) => {
                let pairs: Vec<(String, String)> = asked
                    .iter()
                    .map(|k| (format!("{{{k}}}lease"), format!("{{{k}}}fence")))
                    .collect();
                coord
                    .fenced_lock_all(&pairs)
                    .and_then(|m| m.acquire_timeout(ttl, wait))
                    .map(|g| g.map(Held::Multi))
            }
        };
        // A semaphore whose capacity another worker changed: this worker
        // takes the stored capacity, as a participant told of the change.
        if let (Err(Error::CapacityMismatch { stored, .. }), Some(coord)) = (&got, &coord) {
            let name = format!("{{{}}}sem", spec.keys[ki]);
            if let Ok(sem) = coord.semaphore(&name, *stored) {
                handles[ki] = Handle::Semaphore(sem);
            }
        }
        let got = got.map_err(|e| e.to_string());
        let held = match got {
            Ok(Some(h)) => h,
            Ok(None) => {
                busy += 1;
                // The demand `liveness` judges: keys asked for and not
                // granted, with when the wait began and ended.
                history.emit(
                    json!({"ev": "busy", "w": spec.id, "keys": asked, "a": a, "t": now_ns()}),
                );
                continue;
            }
            Err(e) => {
                errors += 1;
                history.emit(json!({"ev": "err", "w": spec.id, "keys": asked, "a": a, "t": now_ns(), "what": e}));
                thread::sleep(Duration::from_millis(rng.range(5, 30)));
                continue;
            }
        };
        let g = now_ns();
        // One grant in the history per key of the set, each with its own
        // number; a set's grants share `set` (the first one's number).
        let tokens = held.tokens(&names);
        let slot = held.slot();
        let first = n + 1;
        let members: Vec<(u64, &str, u64, String)> = names
            .iter()
            .zip(&tokens)
            .map(|(key, tok)| {
                n += 1;
                let res_key = match slot {
                    Some(s) => format!("res:{key}:{s}"),
                    None => format!("res:{key}"),
                };
                (n, *key, tok.unwrap_or(0), res_key)
            })
            .collect();
        for ((m, key, tok, _), granted) in members.iter().zip(&tokens) {
            let mut line = json!({"ev": "grant", "w": spec.id, "n": m, "key": key, "a": a,
                "g": g, "tok": tok, "slot": slot, "mode": held.mode()});
            if members.len() > 1 || matches!(held, Held::Multi(_) | Held::MultiPlain(_)) {
                line["set"] = json!(first);
                line["size"] = json!(members.len());
                line["missing"] = json!(granted.is_none());
            }
            history.emit(line);
        }
        if spec.hoard {
            if let Some(keep) = held.hoard() {
                hoard.push(keep);
                hoarded.push(ki);
            }
            continue;
        }

        // A long hold: kept alive for 3-5 TTLs, renewed 6-10 times.
        let long = rng.chance(spec.long_hold_pct);
        let keep = long || rng.chance(spec.keep_alive_pct);
        let steps = if long {
            rng.range(9, 15)
        } else if keep {
            rng.range(3, 4)
        } else {
            rng.range(1, 2)
        };
        // Which step asks the server (`verify_still_held`, a leader's
        // `proclaim`) and which resets the expiry, if any.
        let verify_at = rng.chance(spec.verify_pct).then(|| rng.range(0, steps - 1));
        let reset_at = rng.chance(spec.reset_pct).then(|| rng.range(0, steps - 1));
        let reset_ttl = Duration::from_millis(rng.range(spec.ttl_ms / 2, spec.ttl_ms * 2));
        let think = if keep {
            Duration::from_millis(spec.ttl_ms / 3)
        } else {
            Duration::from_millis(rng.range(1, spec.think_ms.max(1)))
        };
        let mut v: Option<u64> = None;
        let mut lost = false;
        let ((), kept) = held.with_keep_alive(keep, || {
            for step in 0..steps {
                if verify_at == Some(step) {
                    let s = now_ns();
                    let answer = held
                        .proclaim(&format!("w{}:{first}", spec.id))
                        .map(|a| ("proclaim", a))
                        .or_else(|| held.verify().map(|a| ("verify", a)));
                    let r = now_ns();
                    if let Some((what, answer)) = answer {
                        emit_answer(&mut history, spec.id, &members, what, (s, r), answer);
                    }
                }
                if reset_at == Some(step) {
                    let s = now_ns();
                    let answer = held.reset(reset_ttl);
                    let r = now_ns();
                    emit_answer(&mut history, spec.id, &members, "reset", (s, r), answer);
                }
                let t = now_ns();
                if held.is_lost() && !spec.ignore_loss {
                    lost = true;
                    return;
                }
                v = Some(t);
                if held.mode() == "r" {
                    thread::sleep(think);
                    continue;
                }
                // A fenced read of each key's resource, the think, then a
                // fenced write of each value read plus one.
                let mut reads = Vec::with_capacity(members.len());
                for (m, _, tok, res_key) in &members {
                    let owner = format!("w{}:{m}", spec.id);
                    let s = now_ns();
                    let read = resource.op(res_key, *tok, &owner, None);
                    let r = now_ns();
                    history.emit(
                        json!({"ev": "op", "w": spec.id, "n": m, "rk": res_key, "k": "r",
                        "s": s, "r": r, "res": read.label()}),
                    );
                    reads.push(read);
                }
                thread::sleep(think);
                for ((m, _, tok, res_key), read) in members.iter().zip(reads) {
                    if let Reply::Accepted { value, .. } = read {
                        let owner = format!("w{}:{m}", spec.id);
                        let s = now_ns();
                        let wrote = resource.op(res_key, *tok, &owner, Some(value));
                        let r = now_ns();
                        history.emit(json!({"ev": "op", "w": spec.id, "n": m, "rk": res_key,
                            "k": "w", "s": s, "r": r, "res": wrote.label()}));
                    }
                }
            }
        });
        if !lost {
            let t = now_ns();
            if held.is_lost() && !spec.ignore_loss {
                lost = true;
            } else {
                v = Some(t);
            }
        }
        // A holder that lets its lease expire: it keeps vouching until the
        // guard says the lease is gone (at most two TTLs), then releases.
        if !lost && rng.chance(spec.expire_pct) {
            let until = now_ns() + 2 * spec.ttl_ms * 1_000_000;
            loop {
                let t = now_ns();
                if t > until {
                    break;
                }
                if held.is_lost() && !spec.ignore_loss {
                    lost = true;
                    break;
                }
                v = Some(t);
                thread::sleep(Duration::from_millis(5));
            }
        }
        let rel = now_ns();
        let outcome = held.release();
        let t = now_ns();
        for (m, ..) in &members {
            history.emit(
                json!({"ev": "end", "w": spec.id, "n": m, "v": v, "lost": lost,
                "kept": kept, "rel": rel, "out": outcome, "t": t}),
            );
        }
    }
    history.emit(
        json!({"ev": "stats", "w": spec.id, "attempts": attempts, "busy": busy,
        "errors": errors, "grants": n, "demand": true}),
    );
    drop(hoard);
    cancel.cancel();
    for f in followers {
        let _ = f.join();
    }
    drop(group);
    Ok(())
}

/// One `answer` line per key of the grant: what a call that asks the server
/// about the lease (`verify`, `proclaim`, `reset`) answered, sent at `s`
/// and returned at `r`; `held` is `null` for an error.
fn emit_answer(
    history: &mut History,
    w: u64,
    members: &[(u64, &str, u64, String)],
    what: &str,
    (s, r): (u64, u64),
    answer: Result<bool, String>,
) {
    for (m, ..) in members {
        let mut line = json!({"ev": "answer", "w": w, "n": m, "call": what, "s": s, "r": r});
        match &answer {
            Ok(held) => line["held"] = json!(held),
            Err(e) => line["what"] = json!(e),
        }
        history.emit(line);
    }
}

/// Where an election worker's `observe()` followers write.
pub(crate) fn observe_file(worker_file: &str) -> String {
    match worker_file.strip_suffix(".jsonl") {
        Some(base) => format!("{base}-observe.jsonl"),
        None => format!("{worker_file}-observe"),
    }
}

/// One `observe()` follower: records every leader it is told of, and every
/// error, until `cancel`. With `poll` (the planted bug of the
/// `poll-follower` control) it reads `leader()` every 10 ms instead and
/// reports each change it reads.
fn follow(
    worker: u64,
    key: &str,
    election: &Election,
    poll: bool,
    cancel: &CancelToken,
    out: &std::sync::Mutex<History>,
) {
    let mut changes = election.observe().cancel_on(cancel.clone());
    let mut polled = None;
    while !cancel.is_cancelled() {
        let next = if poll {
            thread::sleep(Duration::from_millis(10));
            match election.leader() {
                Ok(leader) if polled.as_ref() == Some(&leader) => None,
                Ok(leader) => {
                    polled = Some(leader.clone());
                    Some(Ok(leader))
                }
                Err(e) => Some(Err(e)),
            }
        } else {
            changes.next_until(std::time::Instant::now() + Duration::from_millis(200))
        };
        let t = now_ns();
        let line = match next {
            None => continue,
            Some(Ok(leader)) => json!({"ev": "obs", "w": worker, "key": key, "t": t,
                "term": leader.as_ref().map(|l| l.term.get()),
                "value": leader.and_then(|l| l.value)}),
            Some(Err(e)) => {
                json!({"ev": "obs-err", "w": worker, "key": key, "t": t, "what": e.to_string()})
            }
        };
        out.lock().unwrap_or_else(|e| e.into_inner()).emit(line);
    }
}

/// The handles for the run's keys, the Redlock group, and the coordinator
/// (every topology but Redlock).
type Connected = (Vec<Handle>, Option<RedlockGroup>, Option<Coordinator>);

fn connect(spec: &WorkerSpec) -> Result<Connected, String> {
    let node_timeout = Duration::from_millis(spec.node_timeout_ms);
    let replication = match spec.require_replicas {
        None => Replication::Off,
        Some(replicas) => Replication::Require {
            replicas,
            timeout: node_timeout,
        },
    };
    let build = |b: respire_coordination::CoordinatorBuilder| {
        b.key_prefix(&spec.prefix)
            .node_timeout(node_timeout)
            .connect_timeout(Duration::from_secs(1))
            .replication(replication)
            .build()
            .map_err(|e| e.to_string())
    };
    if let Connect::Redlock(urls) = &spec.connect {
        let nodes = urls
            .iter()
            .map(|u| build(Coordinator::builder(u)))
            .collect::<Result<Vec<_>, _>>()?;
        let options = RedlockOptions {
            node_timeout,
            restart_delay: spec.restart_delay_ms.map(Duration::from_millis),
            ..RedlockOptions::default()
        };
        let group = RedlockGroup::new(nodes, options).map_err(|e| e.to_string())?;
        let handles = spec
            .keys
            .iter()
            .map(|k| Handle::Redlock(format!("{{{k}}}lock")))
            .collect();
        return Ok((handles, Some(group), None));
    }
    let coord = match &spec.connect {
        Connect::Standalone(url) => build(Coordinator::builder(url))?,
        Connect::Sentinel { sentinels, service } => {
            let urls: Vec<&str> = sentinels.iter().map(String::as_str).collect();
            build(
                Coordinator::sentinel_builder(&urls, service)
                    .username(APP_USER.0)
                    .password(APP_USER.1),
            )?
        }
        Connect::Cluster(seeds) => {
            let urls: Vec<&str> = seeds.iter().map(String::as_str).collect();
            build(
                Coordinator::cluster_builder(&urls)
                    .username(APP_USER.0)
                    .password(APP_USER.1),
            )?
        }
        Connect::Redlock(_) => unreachable!("handled above"),
    };
    let mut handles = Vec::new();
    for k in &spec.keys {
        let h = match spec.workload {
            Workload::Lock | Workload::Redlock if spec.fifo => coord
                .lock(&format!("{{{k}}}lock"))
                .and_then(|l| l.with_fairness(Fairness::fifo()))
                .map(Handle::Lock),
            Workload::Lock | Workload::Redlock => {
                coord.lock(&format!("{{{k}}}lock")).map(Handle::Lock)
            }
            Workload::Fenced => coord
                .fenced_lock(&format!("{{{k}}}lease"), &format!("{{{k}}}fence"))
                .map(Handle::Fenced),
            Workload::Rw => coord
                .read_write_lease(&format!("{{{k}}}rw"))
                .map(|rw| Handle::Rw(rw.read(), rw.write())),
            Workload::Semaphore => coord
                .semaphore(&format!("{{{k}}}sem"), spec.capacity)
                .map(Handle::Semaphore),
            Workload::Election => coord
                .election(&crate::spec::election_name(k))
                .map(Handle::Election),
            Workload::Multi | Workload::LockAll => Ok(Handle::Multi(coord.clone())),
        }
        .map_err(|e| e.to_string())?;
        handles.push(h);
    }
    Ok((handles, None, Some(coord)))
}
