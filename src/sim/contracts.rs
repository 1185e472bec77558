//! The shipped Lua scripts on the model server, under random schedules of
//! clients and clock, checked against their contracts (each script's opening
//! comment) by a record kept outside the scripts and outside the model's
//! data: what each reply granted, extended or released, at which server time,
//! with which TTL.
//!
//! - Fenced lease (`fenced_acquire`, `lease_extend`, `lease_verify`,
//!   `lease_release`): every reply is the one the contract gives for the
//!   recorded holder; a new grant's token is one above the last one issued;
//!   the key expires exactly when the record says.
//! - Reader/writer lease (the `rw_*` scripts, and the lease scripts on the
//!   writer key): no write grant while another writer or an unexpired reader
//!   is recorded, no read grant while another writer is; write tokens rise;
//!   a reader's epoch is the last write token; an attempt on a free lease
//!   (no recorded writer, no reader, no intent) is granted.
//! - Election (`fenced_acquire` with a value key, `election_proclaim`,
//!   `election_leader`, and the lease scripts): the value key holds the
//!   recorded term and value; a proclamation changes it only for the recorded
//!   holder; a read names the recorded holder's term, and its value only when
//!   the value key belongs to that term.
//! - FIFO lock (`fifo_acquire`, `fifo_withdraw`, `lease_release`): every
//!   reply is the one the contract gives for the recorded holder and queue;
//!   a grant goes only to the head of the recorded queue of live entries, or
//!   to anyone while no entry lives (no waiter that queued is passed over),
//!   and only while no holder is recorded; the lock holds the recorded
//!   holder after every attempt.
//! - Semaphore (the `sem_*` scripts): unexpired recorded permits never
//!   exceed the capacity and hold distinct slots below it; tokens rise; an
//!   attempt with fewer permits than the capacity is granted; status, verify
//!   and extend agree with the record.
//!
//! A change to a shipped script that breaks its contract fails these tests;
//! the differential test (`tests/differential.rs`) keeps the model itself
//! honest against Redis (it runs the same script files on both sides, so it
//! cannot see a change to them).
//!
//! `RESPIRE_SIM_CASES` and `RESPIRE_SIM_SEED` work as for the other
//! schedules.

use std::collections::BTreeMap;

use super::model::{ModelServer, Reply};
use super::{Rng, Stats, run, seeds};
use crate::scripts::{self, Script};

const CASES: u64 = 500;
const STEPS: usize = 80;
const OWNERS: [&str; 3] = ["o0", "o1", "o2"];

fn bulk(s: &str) -> Reply {
    Reply::Bulk(s.as_bytes().to_vec())
}

fn text(r: &Reply) -> Option<String> {
    match r {
        Reply::Bulk(b) => Some(String::from_utf8_lossy(b).into_owned()),
        _ => None,
    }
}

fn call(s: &mut ModelServer, script: &Script, keys: &[&str], args: &[&str]) -> Reply {
    s.evalsha(&script.sha, keys, args)
}

/// The server with every shipped script loaded, its clock at 1,000,000 ms.
fn server(seed: u64) -> ModelServer {
    let mut s = ModelServer::new(seed, 1_000_000);
    for script in [
        &*scripts::FENCED_ACQUIRE,
        &*scripts::LEASE_EXTEND,
        &*scripts::LEASE_VERIFY,
        &*scripts::LEASE_RELEASE,
        &*scripts::RW_READ_ACQUIRE,
        &*scripts::RW_READ_EXTEND,
        &*scripts::RW_READ_VERIFY,
        &*scripts::RW_READ_RELEASE,
        &*scripts::RW_WRITE_ACQUIRE,
        &*scripts::RW_WRITE_WITHDRAW,
        &*scripts::RW_WRITE_CLEAN_UP,
        &*scripts::SEM_ACQUIRE,
        &*scripts::SEM_EXTEND,
        &*scripts::SEM_VERIFY,
        &*scripts::SEM_RELEASE,
        &*scripts::SEM_SET_CAPACITY,
        &*scripts::SEM_STATUS,
        &*scripts::ELECTION_LEADER,
        &*scripts::ELECTION_PROCLAIM,
    ] {
        s.command(&["SCRIPT", "LOAD", script.code]);
    }
    s
}

/// Moves the clock: mostly a few ms, sometimes exactly to an edge the record
/// knows (an expiry, or the millisecond after it).
fn tick(s: &mut ModelServer, rng: &mut Rng, edges: &[i64]) {
    let now = s.now_ms();
    let ahead: Vec<i64> = edges.iter().copied().filter(|&e| e >= now).collect();
    if !ahead.is_empty() && rng.chance(0.3) {
        let edge = ahead[rng.below(ahead.len() as u64) as usize];
        s.advance_to(edge + rng.below(2) as i64);
    } else {
        s.advance_to(now + rng.below(12) as i64);
    }
}

fn ttl(rng: &mut Rng) -> i64 {
    [3, 5, 10, 20, 40, 100][rng.below(6) as usize]
}

fn owner(rng: &mut Rng) -> &'static str {
    OWNERS[rng.below(OWNERS.len() as u64) as usize]
}

// ----- the fenced lease -----

/// The recorded holder: value, token, last millisecond it exists.
#[derive(Clone, Debug)]
struct Holder {
    owner: &'static str,
    token: u64,
    until: i64,
}

impl Holder {
    fn value(&self) -> String {
        format!("{}:{}", self.owner, self.token)
    }
}

/// `lease_extend.lua` by `value` for `ttl` ms: what the script answered and
/// what the contract says (the holder's expiry moves to `ttl` from now when
/// `value` is the holder's).
fn extend(
    s: &mut ModelServer,
    lease: &str,
    holder: &mut Option<Holder>,
    value: &str,
    ttl: i64,
    stats: &mut Stats,
) -> (Reply, Reply) {
    let now = s.now_ms();
    let got = call(
        s,
        &scripts::LEASE_EXTEND,
        &[lease],
        &[value, &ttl.to_string()],
    );
    let want = match holder {
        None => Reply::Int(0),
        Some(h) if h.value() == value => {
            h.until = now + ttl;
            stats.extensions += 1;
            Reply::Int(1)
        }
        Some(_) => Reply::Int(-1),
    };
    (got, want)
}

fn fenced_case(seed: u64) -> Result<Stats, String> {
    let mut rng = Rng::new(seed);
    let mut s = server(seed);
    let (lease, fence) = ("{f}lease", "{f}fence");
    let mut holder: Option<Holder> = None;
    let mut issued = 0u64;
    let mut stats = Stats::default();
    for step in 0..STEPS {
        let edges: Vec<i64> = holder.iter().map(|h| h.until).collect();
        tick(&mut s, &mut rng, &edges);
        let now = s.now_ms();
        if holder.as_ref().is_some_and(|h| now > h.until) {
            holder = None;
        }
        let who = owner(&mut rng);
        // Mostly the holder's own value, sometimes a stale or foreign one.
        let value = match &holder {
            Some(h) if rng.chance(0.6) => h.value(),
            _ => format!("{who}:{}", issued.saturating_sub(rng.below(2))),
        };
        let held_by = |h: &Option<Holder>, v: &str| h.as_ref().is_some_and(|h| h.value() == v);
        let ctx = |what: &str, got: &Reply, want: &Reply| {
            format!("step {step} at {now}: {what}: got {got}, the contract says {want}")
        };
        match rng.below(4) {
            0 => {
                let ttl = ttl(&mut rng);
                let got = call(
                    &mut s,
                    &scripts::FENCED_ACQUIRE,
                    &[lease, fence],
                    &[who, &ttl.to_string()],
                );
                let want = match &mut holder {
                    None => {
                        issued += 1;
                        holder = Some(Holder {
                            owner: who,
                            token: issued,
                            until: now + ttl,
                        });
                        stats.grants += 1;
                        Reply::Array(vec![Reply::Int(1), bulk(&issued.to_string())])
                    }
                    Some(h) if h.owner == who => {
                        h.until = h.until.max(now + ttl);
                        Reply::Array(vec![Reply::Int(1), bulk(&h.token.to_string())])
                    }
                    Some(h) => {
                        stats.takeovers += 1;
                        Reply::Array(vec![Reply::Int(0), Reply::Int(h.until - now)])
                    }
                };
                if got != want {
                    return Err(ctx(&format!("{who} acquires for {ttl} ms"), &got, &want));
                }
            }
            1 => {
                let ttl = ttl(&mut rng);
                let (got, want) = extend(&mut s, lease, &mut holder, &value, ttl, &mut stats);
                if got != want {
                    return Err(ctx(&format!("{value} extends by {ttl} ms"), &got, &want));
                }
            }
            2 => {
                let got = call(&mut s, &scripts::LEASE_VERIFY, &[lease], &[&value]);
                let want = match &holder {
                    None => Reply::Array(vec![Reply::Int(0)]),
                    Some(h) if held_by(&holder, &value) => {
                        Reply::Array(vec![Reply::Int(1), Reply::Int(h.until - now)])
                    }
                    Some(_) => Reply::Array(vec![Reply::Int(-1)]),
                };
                if got != want {
                    return Err(ctx(&format!("{value} verifies"), &got, &want));
                }
            }
            _ => {
                let prefix = rng.chance(0.3);
                let (arg, mode) = if prefix {
                    (format!("{who}:"), "prefix")
                } else {
                    (value.clone(), "exact")
                };
                let got = call(&mut s, &scripts::LEASE_RELEASE, &[lease], &[&arg, mode]);
                let mine = holder.as_ref().map(|h| {
                    if prefix {
                        h.owner == who
                    } else {
                        h.value() == arg
                    }
                });
                let want = match mine {
                    None => Reply::Int(0),
                    Some(true) => {
                        holder = None;
                        Reply::Int(1)
                    }
                    Some(false) => Reply::Int(-1),
                };
                if got != want {
                    return Err(ctx(&format!("{arg} releases ({mode})"), &got, &want));
                }
            }
        }
        let truth = s.expiry(lease);
        let recorded = holder.as_ref().map(|h| h.until);
        if truth != recorded {
            return Err(format!(
                "step {step} at {now}: the lease expires at {truth:?} on the server, \
                 the record says {recorded:?}"
            ));
        }
        stats.checks += 1;
        stats.events += 1;
    }
    Ok(stats)
}

// ----- the election -----

fn election_case(seed: u64) -> Result<Stats, String> {
    let mut rng = Rng::new(seed);
    let mut s = server(seed);
    let (lease, fence, value_key) = ("{e}leader", "{e}term", "{e}value");
    let values = ["v", "", "a:b"];
    let mut holder: Option<Holder> = None;
    // What the value key holds: the term that wrote it, and the value.
    let mut advertised: Option<(u64, String)> = None;
    let mut issued = 0u64;
    let mut stats = Stats::default();
    for step in 0..STEPS {
        let edges: Vec<i64> = holder.iter().map(|h| h.until).collect();
        tick(&mut s, &mut rng, &edges);
        let now = s.now_ms();
        if holder.as_ref().is_some_and(|h| now > h.until) {
            holder = None;
        }
        let who = owner(&mut rng);
        let said = values[rng.below(values.len() as u64) as usize];
        // Mostly the holder's own value, sometimes a stale or foreign one.
        let mine = match &holder {
            Some(h) if rng.chance(0.6) => h.value(),
            _ => format!("{who}:{}", issued.saturating_sub(rng.below(2))),
        };
        let ctx = |what: &str, got: &Reply, want: &Reply| {
            format!("step {step} at {now}: {what}: got {got}, the contract says {want}")
        };
        match rng.below(5) {
            0 => {
                let ttl = ttl(&mut rng);
                // Sometimes a plain fenced lock on the same keys, which
                // leaves the value key alone.
                let advertises = rng.chance(0.8);
                let got = if advertises {
                    call(
                        &mut s,
                        &scripts::FENCED_ACQUIRE,
                        &[lease, fence, value_key],
                        &[who, &ttl.to_string(), said],
                    )
                } else {
                    call(
                        &mut s,
                        &scripts::FENCED_ACQUIRE,
                        &[lease, fence],
                        &[who, &ttl.to_string()],
                    )
                };
                let want = match &mut holder {
                    None => {
                        issued += 1;
                        holder = Some(Holder {
                            owner: who,
                            token: issued,
                            until: now + ttl,
                        });
                        if advertises {
                            advertised = Some((issued, said.to_owned()));
                        }
                        stats.grants += 1;
                        Reply::Array(vec![Reply::Int(1), bulk(&issued.to_string())])
                    }
                    Some(h) if h.owner == who => {
                        h.until = h.until.max(now + ttl);
                        if advertises {
                            advertised = Some((h.token, said.to_owned()));
                        }
                        Reply::Array(vec![Reply::Int(1), bulk(&h.token.to_string())])
                    }
                    Some(h) => {
                        stats.takeovers += 1;
                        Reply::Array(vec![Reply::Int(0), Reply::Int(h.until - now)])
                    }
                };
                if got != want {
                    return Err(ctx(&format!("{who} campaigns for {ttl} ms"), &got, &want));
                }
            }
            1 => {
                let ttl = ttl(&mut rng);
                let (got, want) = extend(&mut s, lease, &mut holder, &mine, ttl, &mut stats);
                if got != want {
                    return Err(ctx(&format!("{mine} extends by {ttl} ms"), &got, &want));
                }
            }
            2 => {
                let term = mine.rsplit(':').next().unwrap_or_default().to_owned();
                let got = call(
                    &mut s,
                    &scripts::ELECTION_PROCLAIM,
                    &[lease, value_key],
                    &[&mine, &term, said],
                );
                let want = match &holder {
                    None => Reply::Array(vec![Reply::Int(0)]),
                    Some(h) if h.value() == mine => {
                        advertised = Some((h.token, said.to_owned()));
                        Reply::Array(vec![Reply::Int(1), Reply::Int(h.until - now)])
                    }
                    Some(_) => {
                        stats.losses += 1;
                        Reply::Array(vec![Reply::Int(-1)])
                    }
                };
                if got != want {
                    return Err(ctx(&format!("{mine} proclaims {said:?}"), &got, &want));
                }
            }
            3 => {
                let got = call(&mut s, &scripts::ELECTION_LEADER, &[lease, value_key], &[]);
                let want = match &holder {
                    None => Reply::Array(vec![Reply::Int(0)]),
                    Some(h) => Reply::Array(vec![
                        Reply::Int(1),
                        bulk(&h.token.to_string()),
                        match &advertised {
                            Some((term, v)) if *term == h.token => bulk(v),
                            _ => Reply::Nil,
                        },
                        Reply::Int(h.until - now),
                    ]),
                };
                if got != want {
                    return Err(ctx("the leader is read", &got, &want));
                }
                stats.checks += 1;
            }
            _ => {
                let got = call(&mut s, &scripts::LEASE_RELEASE, &[lease], &[&mine, "exact"]);
                let want = match &holder {
                    None => Reply::Int(0),
                    Some(h) if h.value() == mine => {
                        holder = None;
                        Reply::Int(1)
                    }
                    Some(_) => Reply::Int(-1),
                };
                if got != want {
                    return Err(ctx(&format!("{mine} resigns"), &got, &want));
                }
            }
        }
        let truth = s.expiry(lease);
        let recorded = holder.as_ref().map(|h| h.until);
        if truth != recorded {
            return Err(format!(
                "step {step} at {now}: the lease expires at {truth:?} on the server, \
                 the record says {recorded:?}"
            ));
        }
        let stored = s.command(&["GET", value_key]);
        let want = advertised
            .as_ref()
            .map_or(Reply::Nil, |(term, v)| bulk(&format!("{term}:{v}")));
        if stored != want {
            return Err(format!(
                "step {step} at {now}: the value key holds {stored}, the record says {want}"
            ));
        }
        stats.checks += 1;
        stats.events += 1;
    }
    Ok(stats)
}

// ----- the reader/writer lease -----

fn rw_case(seed: u64) -> Result<Stats, String> {
    let mut rng = Rng::new(seed);
    let mut s = server(seed);
    let keys = ["{rw}w", "{rw}r", "{rw}q", "{rw}fence"];
    let [w, r, q, _] = keys;
    let mut writer: Option<Holder> = None;
    // Reader owner → the last millisecond it holds (the script prunes a
    // reader whose expiry score is at or before now).
    let mut readers: BTreeMap<&str, i64> = BTreeMap::new();
    let mut intents = false;
    let mut last_write = 0u64;
    let mut stats = Stats::default();
    for step in 0..STEPS {
        let mut edges: Vec<i64> = writer.iter().map(|h| h.until).collect();
        edges.extend(readers.values().map(|&u| u + 1));
        tick(&mut s, &mut rng, &edges);
        let now = s.now_ms();
        if writer.as_ref().is_some_and(|h| now > h.until) {
            writer = None;
        }
        readers.retain(|_, until| *until >= now);
        let who = owner(&mut rng);
        let ctx = |what: String, got: &Reply| format!("step {step} at {now}: {what}: got {got}");
        match rng.below(6) {
            0 => {
                let ttl = ttl(&mut rng);
                let pref = if rng.chance(0.5) { "writer" } else { "reader" };
                let got = call(
                    &mut s,
                    &scripts::RW_READ_ACQUIRE,
                    &keys,
                    &[who, &ttl.to_string(), pref],
                );
                let what = format!("reader {who} acquires for {ttl} ms ({pref} preference)");
                match &got {
                    Reply::Array(v) if v.first() == Some(&Reply::Int(1)) => {
                        if writer.is_some() {
                            return Err(ctx(format!("{what} while {writer:?} writes"), &got));
                        }
                        if v.get(1) != Some(&bulk(&last_write.to_string())) {
                            return Err(ctx(format!("{what}: epoch is not {last_write}"), &got));
                        }
                        let until = readers.entry(who).or_insert(0);
                        *until = (*until).max(now + ttl - 1);
                        stats.grants += 1;
                    }
                    Reply::Array(v) if v.first() == Some(&Reply::Int(0)) => {
                        let free = writer.is_none() && (pref == "reader" || !intents);
                        if free {
                            return Err(ctx(format!("{what} on a free lease is refused"), &got));
                        }
                        stats.takeovers += 1;
                    }
                    _ => return Err(ctx(what, &got)),
                }
            }
            1 => {
                let ttl = ttl(&mut rng);
                let intent = if rng.chance(0.5) { 0 } else { 30 };
                let got = call(
                    &mut s,
                    &scripts::RW_WRITE_ACQUIRE,
                    &keys,
                    &[who, &ttl.to_string(), &intent.to_string()],
                );
                let what = format!("writer {who} acquires for {ttl} ms");
                match &got {
                    Reply::Array(v) if v.first() == Some(&Reply::Int(1)) => {
                        let token: u64 = v
                            .get(1)
                            .and_then(text)
                            .and_then(|t| t.parse().ok())
                            .unwrap_or(0);
                        let again = writer.as_ref().is_some_and(|h| h.owner == who);
                        if writer.is_some() && !again {
                            return Err(ctx(format!("{what} while {writer:?} writes"), &got));
                        }
                        if !readers.is_empty() {
                            return Err(ctx(
                                format!("{what} while readers {readers:?} hold"),
                                &got,
                            ));
                        }
                        if again {
                            let h = writer.as_mut().expect("a writer");
                            if token != h.token {
                                return Err(ctx(
                                    format!("{what}: a repeat gives another token"),
                                    &got,
                                ));
                            }
                            h.until = h.until.max(now + ttl);
                        } else {
                            if token != last_write + 1 {
                                return Err(ctx(
                                    format!("{what}: token not {}", last_write + 1),
                                    &got,
                                ));
                            }
                            last_write = token;
                            writer = Some(Holder {
                                owner: who,
                                token,
                                until: now + ttl,
                            });
                            stats.grants += 1;
                        }
                    }
                    Reply::Array(v) if v.first() == Some(&Reply::Int(0)) => {
                        if writer.is_none() && readers.is_empty() {
                            return Err(ctx(format!("{what} on a free lease is refused"), &got));
                        }
                        intents |= intent > 0;
                        stats.takeovers += 1;
                    }
                    _ => return Err(ctx(what, &got)),
                }
            }
            2 => {
                // The writer's own lease operations, on its value.
                let Some(h) = writer.clone() else { continue };
                let value = h.value();
                let ttl = ttl(&mut rng);
                if rng.chance(0.5) {
                    let got = call(
                        &mut s,
                        &scripts::LEASE_EXTEND,
                        &[w],
                        &[&value, &ttl.to_string()],
                    );
                    if got != Reply::Int(1) {
                        return Err(ctx(format!("writer {value} extends"), &got));
                    }
                    writer.as_mut().expect("a writer").until = now + ttl;
                    stats.extensions += 1;
                } else {
                    let got = call(&mut s, &scripts::LEASE_RELEASE, &[w], &[&value, "exact"]);
                    if got != Reply::Int(1) {
                        return Err(ctx(format!("writer {value} releases"), &got));
                    }
                    writer = None;
                }
            }
            3 => {
                let ttl = ttl(&mut rng);
                let got = call(
                    &mut s,
                    &scripts::RW_READ_EXTEND,
                    &[r],
                    &[who, &ttl.to_string()],
                );
                let want = Reply::Int(i64::from(readers.contains_key(who)));
                if got != want {
                    return Err(ctx(
                        format!("reader {who} extends, held: {}", want == Reply::Int(1)),
                        &got,
                    ));
                }
                if let Some(until) = readers.get_mut(who) {
                    *until = now + ttl - 1;
                    stats.extensions += 1;
                }
            }
            4 => {
                let got = call(&mut s, &scripts::RW_READ_VERIFY, &[r], &[who]);
                let want = match readers.get(who) {
                    Some(until) => Reply::Array(vec![Reply::Int(1), Reply::Int(until + 1 - now)]),
                    None => Reply::Array(vec![Reply::Int(0)]),
                };
                if got != want {
                    return Err(ctx(format!("reader {who} verifies, want {want}"), &got));
                }
                let got = call(&mut s, &scripts::RW_READ_RELEASE, &[r], &[who, "exact"]);
                let want = Reply::Int(i64::from(readers.remove(who).is_some()));
                if got != want {
                    return Err(ctx(format!("reader {who} releases, want {want}"), &got));
                }
            }
            _ => {
                // A waiting writer stops waiting, or cleans up after itself.
                let got = if rng.chance(0.5) {
                    call(&mut s, &scripts::RW_WRITE_WITHDRAW, &[q], &[who])
                } else {
                    let got = call(&mut s, &scripts::RW_WRITE_CLEAN_UP, &[w, q], &[who]);
                    if writer.as_ref().is_some_and(|h| h.owner == who) {
                        writer = None;
                    }
                    got
                };
                if got.is_error() {
                    return Err(ctx(format!("{who} withdraws"), &got));
                }
                if !s.exists(q) {
                    intents = false;
                }
            }
        }
        if !s.exists(q) {
            intents = false;
        }
        let truth = s.expiry(w);
        let recorded = writer.as_ref().map(|h| h.until);
        if truth != recorded {
            return Err(format!(
                "step {step} at {now}: the writer lease expires at {truth:?} on the server, \
                 the record says {recorded:?}"
            ));
        }
        stats.checks += 1;
        stats.events += 1;
    }
    Ok(stats)
}

// ----- the semaphore -----

fn sem_case(seed: u64) -> Result<Stats, String> {
    let mut rng = Rng::new(seed);
    let mut s = server(seed);
    let keys = ["{s}permits", "{s}meta", "{s}slots"];
    let capacity = 1 + rng.below(3) as usize;
    let cap = capacity.to_string();
    // Member owner:slot:token → the last millisecond it holds.
    let mut permits: BTreeMap<String, i64> = BTreeMap::new();
    let mut last_token = 0u64;
    // Permits that expired: an extension must not bring one back.
    let mut gone: Vec<String> = Vec::new();
    let mut stats = Stats::default();
    for step in 0..STEPS {
        let edges: Vec<i64> = permits.values().map(|&u| u + 1).collect();
        tick(&mut s, &mut rng, &edges);
        let now = s.now_ms();
        gone.extend(
            permits
                .iter()
                .filter(|(_, u)| **u < now)
                .map(|(m, _)| m.clone()),
        );
        permits.retain(|_, until| *until >= now);
        let who = owner(&mut rng);
        let ctx = |what: String, got: &Reply| format!("step {step} at {now}: {what}: got {got}");
        let mine = permits
            .keys()
            .find(|m| m.starts_with(&format!("{who}:")))
            .cloned();
        match rng.below(5) {
            0 | 1 => {
                let ttl = ttl(&mut rng);
                let got = call(
                    &mut s,
                    &scripts::SEM_ACQUIRE,
                    &keys,
                    &[who, &ttl.to_string(), &cap],
                );
                let what = format!("{who} acquires for {ttl} ms (capacity {capacity})");
                match &got {
                    Reply::Array(v) if v.first() == Some(&Reply::Int(1)) => {
                        let (Some(slot), Some(token)) = (
                            v.get(1).and_then(Reply::as_int),
                            v.get(2).and_then(text).and_then(|t| t.parse::<u64>().ok()),
                        ) else {
                            return Err(ctx(what, &got));
                        };
                        let member = format!("{who}:{slot}:{token}");
                        match &mine {
                            Some(m) if *m != member => {
                                return Err(ctx(
                                    format!("{what}: a repeat gives another permit than {m}"),
                                    &got,
                                ));
                            }
                            Some(_) => {
                                let until = permits.get_mut(&member).expect("held");
                                *until = (*until).max(now + ttl - 1);
                            }
                            None => {
                                if permits.len() >= capacity {
                                    return Err(ctx(format!("{what} beyond {permits:?}"), &got));
                                }
                                let taken = permits
                                    .keys()
                                    .any(|m| m.split(':').nth(1) == Some(&slot.to_string()));
                                if taken || slot < 0 || slot as usize >= capacity {
                                    return Err(ctx(
                                        format!("{what}: slot {slot} not free in {permits:?}"),
                                        &got,
                                    ));
                                }
                                if token != last_token + 1 {
                                    return Err(ctx(
                                        format!("{what}: token not {}", last_token + 1),
                                        &got,
                                    ));
                                }
                                last_token = token;
                                permits.insert(member, now + ttl - 1);
                                stats.grants += 1;
                            }
                        }
                    }
                    Reply::Array(v) if v.first() == Some(&Reply::Int(0)) => {
                        if mine.is_some() || permits.len() < capacity {
                            return Err(ctx(format!("{what} refused with {permits:?}"), &got));
                        }
                        stats.takeovers += 1;
                    }
                    _ => return Err(ctx(what, &got)),
                }
            }
            2 if !gone.is_empty() && rng.chance(0.3) => {
                let member = gone.swap_remove(rng.below(gone.len() as u64) as usize);
                let got = call(&mut s, &scripts::SEM_EXTEND, &keys, &[&member, "100"]);
                if got != Reply::Int(0) {
                    return Err(ctx(format!("{member} extends after it expired"), &got));
                }
            }
            2 => {
                let Some(member) = mine.clone().or_else(|| permits.keys().next().cloned()) else {
                    continue;
                };
                let ttl = ttl(&mut rng);
                let got = call(
                    &mut s,
                    &scripts::SEM_EXTEND,
                    &keys,
                    &[&member, &ttl.to_string()],
                );
                if got != Reply::Int(1) {
                    return Err(ctx(format!("{member} extends"), &got));
                }
                permits.insert(member, now + ttl - 1);
                stats.extensions += 1;
            }
            3 => {
                let member = mine
                    .clone()
                    .unwrap_or_else(|| format!("{who}:0:{last_token}"));
                let got = call(&mut s, &scripts::SEM_VERIFY, &keys[..1], &[&member]);
                let want = match permits.get(&member) {
                    Some(until) => Reply::Array(vec![Reply::Int(1), Reply::Int(until + 1 - now)]),
                    None => Reply::Array(vec![Reply::Int(0)]),
                };
                if got != want {
                    return Err(ctx(format!("{member} verifies, want {want}"), &got));
                }
                let got = call(&mut s, &scripts::SEM_RELEASE, &keys, &[&member, "exact"]);
                let want = Reply::Int(i64::from(permits.remove(&member).is_some()));
                if got != want {
                    return Err(ctx(format!("{member} releases, want {want}"), &got));
                }
            }
            _ => {
                let got = call(&mut s, &scripts::SEM_STATUS, &keys, &[] as &[&str]);
                let count = match &got {
                    Reply::Array(v) => v.get(1).and_then(Reply::as_int),
                    _ => None,
                };
                if count != Some(permits.len() as i64) {
                    return Err(ctx(format!("status with {permits:?}"), &got));
                }
            }
        }
        stats.checks += 1;
        stats.events += 1;
    }
    Ok(stats)
}

// ----- the FIFO lock -----

/// A waiter in the record of a FIFO lock's queue (kept in arrival order):
/// owner, and the server time from which its entry is dead.
#[derive(Clone, Debug)]
struct Queued {
    owner: &'static str,
    until: i64,
}

/// `fifo_acquire.lua` and `fifo_withdraw.lua`, with `lease_release.lua` by
/// the holder, against a record of the holder and of the queue: every reply
/// is the one the contract gives for the record; a grant goes only to a
/// caller that heads the record's queue of live entries, or to any caller
/// when no live entry is queued (FIFO order among the waiters that queued),
/// and only while no holder is recorded (no two holders).
fn fifo_case(seed: u64) -> Result<Stats, String> {
    const FIFO_OWNERS: [&str; 4] = ["o0", "o1", "o2", "o3"];
    let mut rng = Rng::new(seed);
    let mut s = server(seed);
    for script in [&*scripts::FIFO_ACQUIRE, &*scripts::FIFO_WITHDRAW] {
        s.command(&["SCRIPT", "LOAD", script.code]);
    }
    let keys = ["{f}lock", "{f}q", "{f}qe"];
    let entry_ms = [5, 20, 60][rng.below(3) as usize];
    // The holder and the last millisecond it holds the lock.
    let mut holder: Option<(&'static str, i64)> = None;
    let mut queue: Vec<Queued> = Vec::new();
    let mut stats = Stats::default();
    for step in 0..STEPS {
        let mut edges: Vec<i64> = holder.iter().map(|h| h.1).collect();
        edges.extend(queue.iter().map(|q| q.until));
        tick(&mut s, &mut rng, &edges);
        let now = s.now_ms();
        if holder.is_some_and(|(_, until)| now > until) {
            holder = None;
        }
        let who = FIFO_OWNERS[rng.below(FIFO_OWNERS.len() as u64) as usize];
        let record = format!("holder {holder:?}, queue {queue:?}");
        let ctx = |what: &str, got: &Reply, want: &Reply| {
            format!(
                "step {step} at {now}: {what}: got {got}, the contract says {want} (the \
                 record before: {record})"
            )
        };
        match rng.below(6) {
            0..=3 => {
                let ttl = ttl(&mut rng);
                let entry = if rng.chance(0.8) { entry_ms } else { 0 };
                let got = call(
                    &mut s,
                    &scripts::FIFO_ACQUIRE,
                    &keys,
                    &[who, &ttl.to_string(), &entry.to_string()],
                );
                // Entries whose expiry is at or before now are gone.
                queue.retain(|q| q.until > now);
                let place = queue.iter().position(|q| q.owner == who);
                let want = match holder {
                    Some((h, _)) if h == who => Reply::Array(vec![Reply::Int(1)]),
                    // Only the head of the live queue, or anyone when it is
                    // empty: nobody who queued is passed over.
                    None if place == Some(0) || place.is_none() && queue.is_empty() => {
                        if place.is_some() {
                            queue.remove(0);
                            stats.repeated += u64::from(!queue.is_empty());
                        }
                        holder = Some((who, now + ttl));
                        stats.grants += 1;
                        Reply::Array(vec![Reply::Int(1)])
                    }
                    _ => {
                        stats.takeovers += 1;
                        let mut place = place;
                        if entry > 0 {
                            match place {
                                Some(p) => queue[p].until = now + entry,
                                None => {
                                    queue.push(Queued {
                                        owner: who,
                                        until: now + entry,
                                    });
                                    place = Some(queue.len() - 1);
                                }
                            }
                        }
                        let mut wait = holder.map_or(-1, |(_, until)| until - now);
                        if let Some(head) = queue.first()
                            && head.owner != who
                        {
                            let left = (head.until - now).max(0);
                            if wait < 0 || left < wait {
                                wait = left;
                            }
                        }
                        let place = place.map_or(0, |p| p as i64 + 1);
                        Reply::Array(vec![Reply::Int(0), Reply::Int(wait), Reply::Int(place)])
                    }
                };
                if got != want {
                    return Err(ctx(
                        &format!("{who} tries for {ttl} ms, entry {entry} ms"),
                        &got,
                        &want,
                    ));
                }
                // No two holders: the server's lock is the recorded holder's.
                let held = s.command(&["GET", keys[0]]);
                let want = holder.map_or(Reply::Nil, |(h, _)| bulk(h));
                if held != want {
                    return Err(ctx("the lock after the attempt", &held, &want));
                }
            }
            4 => {
                let got = call(&mut s, &scripts::FIFO_WITHDRAW, &keys[1..], &[who]);
                // A dead entry is pruned by the next attempt, or goes with
                // the sets' own expiry once no entry lives: until then it is
                // taken out, and counted, like a live one.
                let mine = queue.iter().find(|q| q.owner == who).map(|q| q.until > now);
                queue.retain(|q| q.owner != who);
                let want = Reply::Int(i64::from(mine.is_some()));
                let dead_gone = mine == Some(false) && got == Reply::Int(0);
                if got != want && !dead_gone {
                    return Err(ctx(&format!("{who} leaves the queue"), &got, &want));
                }
            }
            _ => {
                let got = call(&mut s, &scripts::LEASE_RELEASE, &keys[..1], &[who, "exact"]);
                let want = match holder {
                    None => Reply::Int(0),
                    Some((h, _)) if h == who => {
                        holder = None;
                        stats.losses += 1;
                        Reply::Int(1)
                    }
                    Some(_) => Reply::Int(-1),
                };
                if got != want {
                    return Err(ctx(&format!("{who} releases"), &got, &want));
                }
            }
        }
        stats.checks += 1;
        stats.events += 1;
    }
    Ok(stats)
}

#[test]
fn shipped_fenced_lease_scripts_keep_their_contract() {
    let stats = run(
        "shipped_fenced_lease_scripts",
        seeds(CASES, 11),
        fenced_case,
    );
    if stats.cases >= 100 {
        assert!(
            stats.grants > stats.cases && stats.takeovers > 0,
            "{stats:?}"
        );
    }
}

#[test]
fn shipped_election_scripts_keep_their_contract() {
    let stats = run("shipped_election_scripts", seeds(CASES, 14), election_case);
    if stats.cases >= 100 {
        assert!(
            stats.grants > stats.cases && stats.takeovers > 0 && stats.losses > 0,
            "{stats:?}"
        );
    }
}

#[test]
fn shipped_read_write_lease_scripts_keep_their_contract() {
    let stats = run(
        "shipped_read_write_lease_scripts",
        seeds(CASES, 12),
        rw_case,
    );
    if stats.cases >= 100 {
        assert!(
            stats.grants > stats.cases && stats.takeovers > 0,
            "{stats:?}"
        );
    }
}

#[test]
fn shipped_semaphore_scripts_keep_their_contract() {
    let stats = run("shipped_semaphore_scripts", seeds(CASES, 13), sem_case);
    if stats.cases >= 100 {
        assert!(
            stats.grants > stats.cases && stats.takeovers > 0,
            "{stats:?}"
        );
    }
}

#[test]
fn shipped_fifo_lock_scripts_keep_their_contract() {
    let stats = run("shipped_fifo_lock_scripts", seeds(CASES, 15), fifo_case);
    if stats.cases >= 100 {
        // Waiters queued, and heads of a queue with others behind them were
        // granted in turn.
        assert!(
            stats.grants > stats.cases && stats.takeovers > 0 && stats.repeated > 0,
            "{stats:?}"
        );
    }
}
