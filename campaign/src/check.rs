//! The checkers. Each reads histories on the shared monotonic clock and the
//! servers' own state, never the library's estimates, and counts violations
//! with a few examples.
//!
//! A grant's *claim* is `[g, v]`: from the instant its acquire returned to
//! the last instant its guard answered `is_lost() == false`. The library
//! promises that a claim lies inside the server's lease, so:
//!
//! - `overlap`: no two claims of one exclusive group intersect (lock, fenced,
//!   writer, Redlock; a permit's slot);
//! - `writer-beside-reader`: no writer claim intersects a reader claim;
//! - `capacity`: never more permit claims at once than the capacity;
//! - `tokens`: of two claims in real-time order the later has the larger
//!   token (for permits, which are concurrent: a permit whose acquire began
//!   after the other's claim ended); a later grant whose acquire began after
//!   an acquire reported `ReplicationHistoryLost` is counted apart, as
//!   `tokens-after-history-lost`, which the model allows;
//! - `server-oracle`: at every server sample inside a claim the server holds
//!   that grant (its token, its slot, a quorum of nodes for Redlock);
//! - `vouched-after-expiry`: a guard whose server was stopped past the lease's
//!   expiry (PTTL read at the stop) stopped vouching before that expiry (one
//!   deployment only: a Redlock lease outlives one node's key);
//! - `resource-lost-updates` / `resource-repeated-token`: from the fenced
//!   resource's own counters, less the operations it flagged for grants
//!   whose acquire began after a reported history loss (counted apart, with
//!   the suffix `-after-history-lost`);
//! - `late-writes`: resource writes accepted inside another grant's claim
//!   (allowed where the resource fences, the Kleppmann pause otherwise);
//! - for sets taken together (`multi`, `lock-all`), each key of a set is a
//!   grant of its own to every checker above, and: `partial-guard`, a guard
//!   returned without a lease on a key asked for; `partial-set`, a server
//!   sample inside the set's claim in which the truth of every key of the
//!   set is known and some key holds the set's grant while another does not
//!   (for `lock-all`, which has no tokens: holds a lease at all).

use std::collections::{BTreeMap, HashMap};

use crate::history::{Grant, Histories};
use crate::nemesis::FaultRecord;
use crate::resource::Tally;
use crate::sampler::Sample;
use crate::spec::Workload;

/// Violations per checker, with up to five examples each.
#[derive(Debug, Default)]
pub(crate) struct Findings {
    pub(crate) counts: BTreeMap<&'static str, u64>,
    pub(crate) examples: BTreeMap<&'static str, Vec<String>>,
    /// Smallest margin (ms) between a stopped server's expiry and the last
    /// vouch of the guard it held, over every such fault.
    pub(crate) min_expiry_margin_ms: Option<f64>,
    /// How many guards held a lease whose server was stopped past its
    /// expiry (the judgments of `vouched-after-expiry`).
    pub(crate) expiry_checks: u64,
    /// How many server samples fell inside some claim (the oracle's reach).
    pub(crate) oracle_checks: u64,
}

impl Findings {
    fn hit(&mut self, name: &'static str, example: impl FnOnce() -> String) {
        let c = self.counts.entry(name).or_default();
        *c += 1;
        let ex = self.examples.entry(name).or_default();
        if ex.len() < 5 {
            ex.push(example());
        }
    }

    fn zero(&mut self, name: &'static str) {
        self.counts.entry(name).or_default();
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn who(g: &Grant) -> String {
    format!(
        "w{}#{} key {} tok {} [{:.3}, {:.3}] ms",
        g.w,
        g.n,
        g.group(),
        g.tok,
        ms(g.g),
        ms(g.v.unwrap_or(g.g))
    )
}

pub(crate) struct Inputs<'a> {
    pub(crate) workload: Workload,
    pub(crate) capacity: u32,
    pub(crate) hist: &'a Histories,
    pub(crate) samples: &'a [Sample],
    /// Logical keys in the sampler's order.
    pub(crate) keys: &'a [String],
    pub(crate) faults: &'a [FaultRecord],
    pub(crate) tallies: &'a [(String, Tally)],
    /// Redlock's `restart_delay`: a node restarted less than this long ago
    /// refuses grants, so it counts as still holding what it held.
    pub(crate) restart_delay_ns: Option<u64>,
}

pub(crate) fn check(inp: &Inputs<'_>) -> Findings {
    let mut f = Findings::default();
    let claims: Vec<&Grant> = inp.hist.grants.iter().filter(|g| g.v.is_some()).collect();
    overlap(&claims, &mut f);
    if inp.workload == Workload::Rw {
        writer_beside_reader(&claims, &mut f);
    }
    if inp.workload == Workload::Semaphore {
        capacity(&claims, inp.capacity, &mut f);
    }
    if matches!(
        inp.workload,
        Workload::Fenced
            | Workload::Rw
            | Workload::Semaphore
            | Workload::Election
            | Workload::Multi
    ) {
        tokens(&claims, inp.hist.first_history_lost(), &mut f);
    }
    if !inp.samples.is_empty() {
        oracle(inp, &claims, &mut f);
    }
    // One Redlock node's expiry is not the lease's: the quorum is, which the
    // oracle checks.
    if inp.workload != Workload::Redlock {
        expiry(inp, &claims, &mut f);
    }
    resource(inp, &claims, &mut f);
    if inp.workload == Workload::Election {
        observed(inp, &mut f);
    }
    if matches!(inp.workload, Workload::Multi | Workload::LockAll) {
        sets(inp, &claims, &mut f);
    }
    f
}

/// `partial-guard` and `partial-set`: a set is held whole or not at all.
fn sets(inp: &Inputs<'_>, claims: &[&Grant], f: &mut Findings) {
    f.zero("partial-guard");
    f.zero("partial-set");
    for g in inp.hist.grants.iter().filter(|g| g.missing) {
        f.hit("partial-guard", || {
            format!("{} returned without a lease on {}", who(g), g.key)
        });
    }
    let mut by_set: HashMap<(u64, u64), Vec<&Grant>> = HashMap::new();
    for g in claims {
        if let Some((set, _)) = g.set {
            by_set.entry((g.w, set)).or_default().push(g);
        }
    }
    for members in by_set.values().filter(|m| m.len() > 1) {
        let Some((a, b)) = members[0].claim() else {
            continue;
        };
        let start = inp.samples.partition_point(|s| s.t_b < a);
        for s in inp.samples[start..].iter().take_while(|s| s.t_b <= b) {
            if s.t_a > b {
                continue;
            }
            let mut held = Vec::new();
            for g in members {
                let Some(k) = inp.keys.iter().position(|k| *k == g.key) else {
                    continue;
                };
                match s.nodes[0][k].as_deref() {
                    Some(v) if inp.workload == Workload::LockAll => held.push(!v.is_empty()),
                    Some(v) => held.push(v.ends_with(&format!(":{}", g.tok))),
                    None => break,
                }
            }
            if held.len() == members.len() && held.contains(&true) && held.contains(&false) {
                f.hit("partial-set", || {
                    format!(
                        "{} and its set: sample [{:.3}, {:.3}] ms held {held:?}",
                        who(members[0]),
                        ms(s.t_b),
                        ms(s.t_a)
                    )
                });
            }
        }
    }
}

/// `observe-regression`: each follower's reported leaders, in the order it
/// reported them, never go back in term (reporting nobody leading is not a
/// term).
fn observed(inp: &Inputs<'_>, f: &mut Findings) {
    f.zero("observe-regression");
    let mut highest: HashMap<(u64, &str), (u64, u64)> = HashMap::new();
    for o in &inp.hist.observed {
        let Some(term) = o.term else { continue };
        let seen = highest.entry((o.w, o.key.as_str())).or_insert((term, o.t));
        if term < seen.0 {
            f.hit("observe-regression", || {
                format!(
                    "w{} observing {} reported term {term} at {:.3} ms after term {} at {:.3} ms",
                    o.w,
                    o.key,
                    ms(o.t),
                    seen.0,
                    ms(seen.1)
                )
            });
        } else {
            *seen = (term, o.t);
        }
    }
}

fn overlap(claims: &[&Grant], f: &mut Findings) {
    f.zero("overlap");
    let mut groups: HashMap<String, Vec<&Grant>> = HashMap::new();
    for g in claims.iter().filter(|g| g.mode != 'r') {
        groups.entry(g.group()).or_default().push(g);
    }
    for list in groups.values_mut() {
        list.sort_by_key(|g| g.g);
        let mut latest: Option<&Grant> = None;
        for g in list.iter() {
            if let Some(prev) = latest
                && g.g <= prev.v.unwrap_or(0)
            {
                f.hit("overlap", || format!("{} and {}", who(prev), who(g)));
            }
            if latest.is_none_or(|p| g.v > p.v) {
                latest = Some(g);
            }
        }
    }
}

fn writer_beside_reader(claims: &[&Grant], f: &mut Findings) {
    f.zero("writer-beside-reader");
    for w in claims.iter().filter(|g| g.mode == 'x') {
        let (wg, wv) = w.claim().unwrap_or_default();
        for r in claims.iter().filter(|g| g.mode == 'r' && g.key == w.key) {
            let (rg, rv) = r.claim().unwrap_or_default();
            if rg <= wv && wg <= rv {
                f.hit("writer-beside-reader", || {
                    format!("{} and reader {}", who(w), who(r))
                });
            }
        }
    }
}

fn capacity(claims: &[&Grant], cap: u32, f: &mut Findings) {
    f.zero("capacity");
    let mut by_key: HashMap<&str, Vec<(u64, i32, &Grant)>> = HashMap::new();
    for g in claims {
        let (a, b) = g.claim().unwrap_or_default();
        let e = by_key.entry(g.key.as_str()).or_default();
        e.push((a, 1, g));
        e.push((b, -1, g));
    }
    for events in by_key.values_mut() {
        // Ends before starts at the same instant: touching is not holding.
        events.sort_by_key(|&(t, d, _)| (t, d));
        let mut held = 0i32;
        for &(_, d, g) in events.iter() {
            held += d;
            if d > 0 && held > cap as i32 {
                f.hit("capacity", || format!("{} made {held} of {cap}", who(g)));
            }
        }
    }
}

/// `lost_at`: when an acquire first reported the replication history lost;
/// a regression in a grant whose acquire began after it is what that error
/// announced.
fn tokens(claims: &[&Grant], lost_at: Option<u64>, f: &mut Findings) {
    f.zero("tokens");
    f.zero("tokens-after-history-lost");
    let mut by_key: HashMap<&str, Vec<&Grant>> = HashMap::new();
    for g in claims.iter().filter(|g| g.mode != 'r') {
        by_key.entry(g.key.as_str()).or_default().push(g);
    }
    for list in by_key.values() {
        let mut by_end: Vec<&Grant> = list.clone();
        by_end.sort_by_key(|g| g.v);
        // An exclusive grant's server grant lies after every claim that
        // ended before its acquire returned; a permit's (permits are
        // concurrent) only after claims that ended before its acquire began.
        let after = |g: &Grant| if g.mode == 's' { g.a } else { g.g };
        let mut by_start: Vec<&Grant> = list.clone();
        by_start.sort_by_key(|g| after(g));
        let mut i = 0;
        let mut best: Option<&Grant> = None;
        for b in by_start {
            while i < by_end.len() && by_end[i].v.unwrap_or(0) < after(b) {
                if best.is_none_or(|x| by_end[i].tok > x.tok) {
                    best = Some(by_end[i]);
                }
                i += 1;
            }
            if let Some(a) = best
                && b.tok <= a.tok
            {
                let name = if lost_at.is_some_and(|t| t <= b.a) {
                    "tokens-after-history-lost"
                } else {
                    "tokens"
                };
                f.hit(name, || format!("{} after {}", who(b), who(a)));
            }
        }
    }
}

/// What the server said about key `k` in a sample, for one claim.
fn holds(inp: &Inputs<'_>, quorum: usize, s: &Sample, k: usize, g: &Grant) -> bool {
    let workload = inp.workload;
    let values: Vec<Option<&str>> = s
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let delayed = inp.restart_delay_ns.is_some_and(|d| {
                inp.faults
                    .iter()
                    .any(|f| f.restarted.contains(&i) && f.t0 <= s.t_a && f.t1 + d >= s.t_b)
            });
            if delayed { None } else { n[k].as_deref() }
        })
        .collect();
    if workload == Workload::Redlock {
        let unknown = values.iter().filter(|v| v.is_none()).count();
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for v in values.iter().flatten().filter(|v| !v.is_empty()) {
            *counts.entry(v).or_default() += 1;
        }
        return counts.values().copied().max().unwrap_or(0) + unknown >= quorum;
    }
    let Some(v) = values[0] else {
        return true;
    };
    let tok = format!(":{}", g.tok);
    match (workload, g.mode) {
        (Workload::Lock | Workload::LockAll, _) => !v.is_empty(),
        (Workload::Fenced | Workload::Election | Workload::Multi, _) => v.ends_with(&tok),
        (Workload::Rw, 'x') => v.split('|').next().is_some_and(|w| w.ends_with(&tok)),
        (Workload::Rw, _) => true, // readers are counted in `oracle`
        (Workload::Semaphore, _) => {
            let member = format!(":{}:{}", g.slot.unwrap_or(0), g.tok);
            v.split(',').any(|m| m.ends_with(&member))
        }
        (Workload::Redlock, _) => unreachable!("handled above"),
    }
}

fn oracle(inp: &Inputs<'_>, claims: &[&Grant], f: &mut Findings) {
    f.zero("server-oracle");
    let quorum = inp.samples.first().map_or(1, |s| s.nodes.len() / 2 + 1);
    let mut readers_inside: HashMap<(usize, usize), u64> = HashMap::new();
    for g in claims {
        let Some(k) = inp.keys.iter().position(|k| *k == g.key) else {
            continue;
        };
        let (a, b) = g.claim().unwrap_or_default();
        let start = inp.samples.partition_point(|s| s.t_b < a);
        for (i, s) in inp.samples[start..].iter().enumerate() {
            if s.t_b > b {
                break;
            }
            if s.t_a > b {
                continue;
            }
            f.oracle_checks += 1;
            if inp.workload == Workload::Rw && g.mode == 'r' {
                *readers_inside.entry((start + i, k)).or_default() += 1;
            } else if !holds(inp, quorum, s, k, g) {
                f.hit("server-oracle", || {
                    format!(
                        "{} vouched over sample [{:.3}, {:.3}] ms which read {:?}",
                        who(g),
                        ms(s.t_b),
                        ms(s.t_a),
                        s.nodes.iter().map(|n| n[k].clone()).collect::<Vec<_>>()
                    )
                });
            }
        }
    }
    for ((i, k), n) in readers_inside {
        let s = &inp.samples[i];
        let live: u64 = s.nodes[0][k]
            .as_ref()
            .and_then(|v| v.split('|').nth(1).and_then(|c| c.parse().ok()))
            .unwrap_or(u64::MAX);
        if n > live {
            f.hit("server-oracle", || {
                format!(
                    "{n} reader claims over a sample at {:.3} ms with {live} live readers",
                    ms(s.t_b)
                )
            });
        }
    }
}

fn expiry(inp: &Inputs<'_>, claims: &[&Grant], f: &mut Findings) {
    f.zero("vouched-after-expiry");
    for fault in inp.faults.iter().filter(|r| !r.pttl.is_empty()) {
        for p in &fault.pttl {
            let expiry = p.t_a + p.pttl_ms as u64 * 1_000_000;
            if fault.t1 <= expiry {
                continue; // resumed before the lease could expire there
            }
            let key = &inp.keys[p.key];
            // The claim that held the sampled value.
            let holder = claims.iter().find(|g| {
                g.key == *key
                    && g.g <= p.t_b
                    && g.v.unwrap_or(0) >= p.t_a
                    && (g.tok == 0 || p.value.ends_with(&format!(":{}", g.tok)))
            });
            let Some(g) = holder else { continue };
            let v = g.v.unwrap_or(0);
            f.expiry_checks += 1;
            let margin = (expiry as f64 - v as f64) / 1e6;
            f.min_expiry_margin_ms = Some(
                f.min_expiry_margin_ms
                    .map_or(margin, |m: f64| m.min(margin)),
            );
            // Still the same value after the resume: extended in the moment
            // between the read and the stop, so the read PTTL was not the
            // expiry.
            let after = inp.samples.iter().find(|s| s.t_b > fault.t1);
            let extended = after.is_some_and(|s| {
                s.nodes
                    .iter()
                    .any(|v| v[p.key].as_deref() == Some(p.value.as_str()) && !p.value.is_empty())
            });
            if v > expiry && !extended {
                f.hit("vouched-after-expiry", || {
                    format!(
                        "{} past the expiry at {:.3} ms ({} stopped)",
                        who(g),
                        ms(expiry),
                        fault.target
                    )
                });
            }
        }
    }
}

fn resource(inp: &Inputs<'_>, claims: &[&Grant], f: &mut Findings) {
    f.zero("resource-lost-updates");
    f.zero("resource-repeated-token");
    f.zero("late-writes");
    let grant_of: HashMap<(u64, u64), &Grant> =
        inp.hist.grants.iter().map(|g| ((g.w, g.n), g)).collect();
    // What the resource flagged in operations of grants whose acquire began
    // after a reported history loss: allowed, and counted apart.
    let (mut lost_after, mut repeated_after) = (0, 0);
    if let Some(lost_at) = inp.hist.first_history_lost() {
        f.zero("resource-lost-updates-after-history-lost");
        f.zero("resource-repeated-token-after-history-lost");
        for op in &inp.hist.ops {
            if grant_of.get(&(op.w, op.n)).is_some_and(|g| lost_at <= g.a) {
                lost_after += u64::from(op.lost_update());
                repeated_after += u64::from(op.repeated_token());
            }
        }
        f.counts
            .insert("resource-lost-updates-after-history-lost", lost_after);
        f.counts
            .insert("resource-repeated-token-after-history-lost", repeated_after);
    }
    let (lost, repeated) = inp
        .tallies
        .iter()
        .fold((0, 0), |(l, r), (_, t)| (l + t.lost, r + t.repeated));
    f.counts
        .insert("resource-lost-updates", lost.saturating_sub(lost_after));
    f.counts.insert(
        "resource-repeated-token",
        repeated.saturating_sub(repeated_after),
    );
    // Accepted writes inside another grant's claim on the same group.
    let mut by_group: HashMap<String, Vec<&Grant>> = HashMap::new();
    for g in claims.iter().filter(|g| g.mode != 'r') {
        by_group.entry(g.group()).or_default().push(g);
    }
    for op in inp.hist.ops.iter().filter(|o| o.write && o.accepted()) {
        let Some(mine) = grant_of.get(&(op.w, op.n)) else {
            continue;
        };
        let Some(list) = by_group.get(&mine.group()) else {
            continue;
        };
        if let Some(other) = list
            .iter()
            .find(|g| (g.w, g.n) != (op.w, op.n) && g.g <= op.s && g.v.unwrap_or(0) >= op.r)
        {
            f.hit("late-writes", || {
                format!(
                    "write of {} at [{:.3}, {:.3}] ms inside {}",
                    who(mine),
                    ms(op.s),
                    ms(op.r),
                    who(other)
                )
            });
        }
    }
}
