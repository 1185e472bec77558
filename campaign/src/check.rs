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
//! - `loss-margin`: every vouch lies at least one node timeout before the
//!   server's expiry (the guard's loss deadline keeps that margin);
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
use crate::nemesis::{Fault, FaultRecord};
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
    /// Claims of unfenced kinds (`Lock`, `lock_all`, Redlock) whose owner
    /// value the samples told (`server-oracle`'s owner judgment).
    pub(crate) owner_checks: u64,
    /// Release outcomes judged against the samples (`release-outcome`).
    pub(crate) release_checks: u64,
    /// `verify_still_held`, `proclaim` and `reset_expiry` answers judged
    /// against the samples (`held-answers`).
    pub(crate) answer_checks: u64,
    /// Claims judged by `vouched-past-ttl`, and of those the ones whose
    /// claim touched a fault (from its start to two TTLs after its end).
    pub(crate) ttl_checks: u64,
    pub(crate) ttl_checks_near_faults: u64,
    /// Smallest margin (ms) between the server's expiry bound and the last
    /// vouch, over the claims judged near a fault.
    pub(crate) min_ttl_margin_ms: Option<f64>,
    /// Claims judged by `loss-margin`, and the least room (ms) left between
    /// a vouch plus the node timeout and the server's expiry over them.
    pub(crate) margin_checks: u64,
    pub(crate) min_loss_margin_ms: Option<f64>,
    /// (fault, key) pairs judged by `liveness`.
    pub(crate) liveness_checks: u64,
    /// Longest wait (ms) from a fault's end to a key's next grant, over the
    /// pairs judged.
    pub(crate) max_regrant_ms: Option<f64>,
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
    /// The leases' TTL.
    pub(crate) ttl_ns: u64,
    /// `liveness`: how soon after a fault ends every key must be granted
    /// again; `None`: not judged.
    pub(crate) liveness_ns: Option<u64>,
    /// When the run stopped its workers (no grant is expected after it).
    pub(crate) end_ns: Option<u64>,
    /// The library's node timeout, for `loss-margin`; `None`: not judged
    /// (histories recorded before the summary carried it).
    pub(crate) node_timeout_ns: Option<u64>,
    /// How fast the servers' clocks run against the shared monotonic clock
    /// (set by the harness: libfaketime's rate; 1.0 for real clocks). What a
    /// server says is left (`PTTL`) is divided by it.
    pub(crate) server_clock_rate: f64,
}

impl Inputs<'_> {
    /// `left` milliseconds on the servers' clock, in nanoseconds on the
    /// shared clock.
    fn server_ms(&self, left: u64) -> u64 {
        (left as f64 * 1e6 / self.server_clock_rate.max(1e-6)) as u64
    }
}

pub(crate) fn check(inp: &Inputs<'_>) -> Findings {
    let mut f = Findings::default();
    let claims: Vec<&Grant> = inp.hist.grants.iter().filter(|g| g.v.is_some()).collect();
    overlap(&claims, &mut f);
    if inp.workload == Workload::Rw {
        writer_beside_reader(&claims, &mut f);
    }
    if inp.workload == Workload::Semaphore {
        capacity(inp, &claims, &mut f);
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
    let mut owned = HashMap::new();
    if !inp.samples.is_empty() {
        oracle(inp, &claims, &mut f);
        if matches!(
            inp.workload,
            Workload::Lock | Workload::LockAll | Workload::Redlock
        ) {
            owned = owners(inp, &claims, &mut f);
        }
        releases(inp, &owned, &mut f);
        answers(inp, &owned, &mut f);
        past_ttl(inp, &claims, &owned, &mut f);
    }
    if inp.liveness_ns.is_some() {
        liveness(inp, &mut f);
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

/// The largest capacity that can be in force on `key` at some instant of
/// `[a, b]`: the run's capacity before the first `set_capacity` of the key;
/// while a change is under way, the old capacities and the new one; after a
/// change that answered, its capacity only; after one that failed, the old
/// ones and its own (it may or may not have been stored).
fn capacity_within(inp: &Inputs<'_>, key: &str, (a, b): (u64, u64)) -> u32 {
    let mut possible = inp.capacity;
    let mut largest = 0;
    let mut from = 0;
    for c in inp.hist.caps.iter().filter(|c| c.key == key) {
        // [from, c.s): `possible`; [c.s, c.r]: with c's too.
        if from <= b && a < c.s {
            largest = largest.max(possible);
        }
        let during = possible.max(c.cap);
        if c.s <= b && a <= c.r {
            largest = largest.max(during);
        }
        possible = if c.ok { c.cap } else { during };
        from = c.r;
    }
    if from <= b {
        largest = largest.max(possible);
    }
    largest
}

/// `capacity`: never more permit claims at once than a capacity that can be
/// in force. Two rules, each sound under `set_capacity`'s model (a lowered
/// capacity revokes no permit, and a grant is decided by the capacity stored
/// when its acquire runs on the server):
/// - at every claim's start, the claims held then are at most the largest
///   capacity any of them was granted under (the last of them to be granted
///   on the server saw every other);
/// - a grant, with every claim granted before its acquire began and still
///   vouched for after it returned (so on the server while its acquire ran),
///   is at most the capacity that can be in force during its acquire — which
///   sees a lowered capacity ignored while permits granted before the change
///   are still held.
fn capacity(inp: &Inputs<'_>, claims: &[&Grant], f: &mut Findings) {
    f.zero("capacity");
    let allowed = |g: &Grant| capacity_within(inp, &g.key, (g.a, g.g));
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
        let mut held: Vec<&Grant> = Vec::new();
        for &(_, d, g) in events.iter() {
            if d < 0 {
                if let Some(i) = held.iter().position(|h| std::ptr::eq(*h, g)) {
                    held.swap_remove(i);
                }
                continue;
            }
            held.push(g);
            let cap = held.iter().map(|h| allowed(h)).max().unwrap_or(0);
            if held.len() > cap as usize {
                f.hit("capacity", || {
                    format!("{} made {} of {cap}", who(g), held.len())
                });
            }
        }
    }
    for g in claims {
        let before = claims
            .iter()
            .filter(|x| {
                x.key == g.key
                    && !std::ptr::eq(**x, *g)
                    && x.g < g.a
                    && x.claim().is_some_and(|(_, v)| v > g.g)
            })
            .count();
        let cap = allowed(g);
        if before + 1 > cap as usize {
            f.hit("capacity", || {
                format!(
                    "{} granted beside {before} permits held since before its acquire, capacity at most {cap}",
                    who(g)
                )
            });
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

/// Whether a command that moves the lease's expiry may have been in flight at
/// any instant of `g`'s claim: a renewal of a kept-alive guard, or a
/// `reset_expiry` (Redlock: `extend`). Such a command sent before a read of
/// the key may run after it, so the read bounds nothing, until a later read
/// shows the key — which a stopped server gives none of. Such a command
/// started before the stop landed, so for these claims a stop bounds the
/// lease by its landing instant plus the longest TTL the command can set
/// ([`renew_ttl`]), and a stop whose landing was not recorded (older
/// histories, stops inside a `pair`) bounds nothing.
fn renewable(inp: &Inputs<'_>, g: &Grant) -> bool {
    g.kept || resets(inp, g)
}

fn resets(inp: &Inputs<'_>, g: &Grant) -> bool {
    inp.hist
        .answers
        .iter()
        .any(|a| a.w == g.w && a.n == g.n && a.call == "reset")
}

/// The longest TTL a command of `g`'s guard can set: the lease's, or twice
/// it after a `reset_expiry` (the workers reset to 0.5–2 TTLs).
fn renew_ttl(inp: &Inputs<'_>, g: &Grant) -> u64 {
    if resets(inp, g) {
        2 * inp.ttl_ns
    } else {
        inp.ttl_ns
    }
}

fn expiry(inp: &Inputs<'_>, claims: &[&Grant], f: &mut Findings) {
    f.zero("vouched-after-expiry");
    for fault in inp.faults.iter().filter(|r| !r.pttl.is_empty()) {
        for p in &fault.pttl {
            let expiry = p.t_a + inp.server_ms(p.pttl_ms as u64);
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
            let expiry = if renewable(inp, g) {
                match fault.landed {
                    Some(landed) => expiry.max(landed + renew_ttl(inp, g)),
                    None => continue,
                }
            } else {
                expiry
            };
            if fault.t1 <= expiry {
                continue; // resumed before the lease could expire there
            }
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

/// A grant's owner: the set it belongs to (one owner value for all its
/// keys), or the grant alone.
fn identity(g: &Grant) -> (u64, u64) {
    (g.w, g.set.map_or(g.n, |(s, _)| s))
}

/// Each column's value of key `k` in a sample; a Redlock node restarted less
/// than `restart_delay` ago counts as unknown (it refuses grants, so it
/// counts as still holding what it held).
fn column_values<'s>(inp: &Inputs<'_>, s: &'s Sample, k: usize) -> Vec<Option<&'s str>> {
    s.nodes
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
        .collect()
}

/// The values a sample shows holding key `k`: every non-empty value on a
/// quorum of columns, unknown columns counting for any; `None` when too many
/// columns are unknown for the sample to tell.
fn candidates<'s>(values: &[Option<&'s str>], quorum: usize) -> Option<Vec<&'s str>> {
    let unknown = values.iter().filter(|v| v.is_none()).count();
    if unknown >= quorum {
        return None;
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for v in values.iter().flatten().filter(|v| !v.is_empty()) {
        *counts.entry(v).or_default() += 1;
    }
    Some(
        counts
            .into_iter()
            .filter(|(_, c)| c + unknown >= quorum)
            .map(|(v, _)| v)
            .collect(),
    )
}

/// The samples whose reads lie inside `[a, b]`.
fn inside(samples: &[Sample], a: u64, b: u64) -> impl Iterator<Item = &Sample> {
    let start = samples.partition_point(|s| s.t_b < a);
    samples[start..]
        .iter()
        .take_while(move |s| s.t_b <= b)
        .filter(move |s| s.t_a <= b)
}

/// `server-oracle` for the kinds without tokens (`Lock`, `lock_all`,
/// Redlock): *which* owner holds the key. The library does not show a
/// guard's owner value (128 random bits drawn for each acquire), so each
/// claim's value is told from the samples inside it: the value held there
/// (on a quorum for Redlock) must be one value throughout the claim, must
/// not have been on the server before the claim's acquire began, and must
/// be no other guard's. Returns each grant's value, where told.
fn owners(inp: &Inputs<'_>, claims: &[&Grant], f: &mut Findings) -> HashMap<(u64, u64), String> {
    let quorum = inp.samples.first().map_or(1, |s| s.nodes.len() / 2 + 1);
    let mut first_seen: HashMap<(usize, &str), u64> = HashMap::new();
    for s in inp.samples {
        for n in &s.nodes {
            for (k, v) in n.iter().enumerate() {
                if let Some(v) = v.as_deref().filter(|v| !v.is_empty()) {
                    first_seen.entry((k, v)).or_insert(s.t_a);
                }
            }
        }
    }
    let mut owned = HashMap::new();
    let mut holders: BTreeMap<(usize, &str), Vec<&Grant>> = BTreeMap::new();
    'claims: for g in claims {
        let Some(k) = inp.keys.iter().position(|k| *k == g.key) else {
            continue;
        };
        let (a, b) = g.claim().unwrap_or_default();
        let mut told: Option<(Vec<&str>, u64)> = None;
        for s in inside(inp.samples, a, b) {
            let Some(c) = candidates(&column_values(inp, s, k), quorum) else {
                continue;
            };
            if c.is_empty() {
                continue; // nobody holds it there: `holds` judges that
            }
            told = Some(match told {
                None => (c, s.t_b),
                Some((prev, at)) => {
                    let both: Vec<&str> = prev.iter().copied().filter(|v| c.contains(v)).collect();
                    if both.is_empty() {
                        f.hit("server-oracle", || {
                            format!(
                                "{} vouched while the server held {prev:?} at {:.3} ms and then {c:?} at {:.3} ms: another owner's",
                                who(g),
                                ms(at),
                                ms(s.t_b)
                            )
                        });
                        continue 'claims;
                    }
                    (both, at)
                }
            });
        }
        let Some((c, _)) = told else { continue };
        let [v] = c.as_slice() else { continue };
        f.owner_checks += 1;
        if let Some(&seen) = first_seen.get(&(k, *v))
            && seen < g.a
        {
            f.hit("server-oracle", || {
                format!(
                    "{} vouched for value {v}, on the server at {:.3} ms, before its acquire began at {:.3} ms: another owner's",
                    who(g),
                    ms(seen),
                    ms(g.a)
                )
            });
        }
        holders.entry((k, *v)).or_default().push(g);
        owned.insert((g.w, g.n), (*v).to_string());
    }
    for ((_, v), gs) in holders {
        let first = gs[0];
        if let Some(other) = gs.iter().find(|g| identity(g) != identity(first)) {
            f.hit("server-oracle", || {
                format!(
                    "{} and {} both vouched while the server held {v}: one of them is not its owner",
                    who(first),
                    who(other)
                )
            });
        }
    }
    owned
}

/// Whether value `v` of a sample is grant `g`'s lease: by its token (its
/// slot and token for a permit, the writer's part for a read/write lease),
/// by its told owner value for the kinds without tokens; `None` where the
/// history cannot tell (readers, which are counted, not named; an owner
/// value the samples did not tell; Redlock, judged on a quorum).
fn ours(inp: &Inputs<'_>, owned: &HashMap<(u64, u64), String>, g: &Grant, v: &str) -> Option<bool> {
    let tok = format!(":{}", g.tok);
    match (inp.workload, g.mode) {
        (Workload::Redlock, _) | (_, 'r') => None,
        (Workload::Lock | Workload::LockAll, _) => owned.get(&(g.w, g.n)).map(|o| v == o),
        (Workload::Rw, _) => Some(v.split('|').next().is_some_and(|w| w.ends_with(&tok))),
        (Workload::Semaphore, _) => {
            let member = format!(":{}:{}", g.slot.unwrap_or(0), g.tok);
            Some(v.split(',').any(|m| m.ends_with(&member)))
        }
        _ => Some(v.ends_with(&tok)),
    }
}

/// Faults that can move a key's truth to another server, which may lack a
/// delete the old one applied (a release, an expiry is not replicated in
/// time): after one, a lease's value can come back.
const SWITCHES: [Fault; 7] = [
    Fault::Failover,
    Fault::KillPrimary,
    Fault::Takeover,
    Fault::UnreplicatedFailover,
    Fault::CutSentinelPrimary,
    Fault::Split,
    Fault::Migrate,
];

/// How long after a cut of the sentinels' links heals they may still
/// switch the primary.
const SWITCH_SLACK_NS: u64 = 5_000_000_000;

/// Whether a fault that can switch a key's server overlaps `[from, to]`
/// (with the slack after it).
fn switch_between(inp: &Inputs<'_>, from: u64, to: u64) -> bool {
    inp.faults.iter().any(|f| {
        let switches = SWITCHES.contains(&f.fault)
            || (f.fault == Fault::Pair && SWITCHES.iter().any(|s| f.target.contains(s.name())));
        switches && f.t0 <= to && f.t1 + SWITCH_SLACK_NS >= from
    })
}

/// A grant's release outcome, one label for the whole set (`None` when its
/// keys answered differently, or nothing was recorded).
fn outcome(g: &Grant) -> Option<&str> {
    let mut parts = g.outcome.split(',');
    let first = parts.next().filter(|p| !p.is_empty())?;
    parts.all(|p| p == first).then_some(first)
}

/// `release-outcome`: what a release (or resignation) answered, against the
/// samples. A lease's value is its own (a token or an owner value drawn for
/// it), so once gone from the server it never comes back:
///
/// - after a release that answered `Released`, `Expired`, `TakenOver` or
///   `NotHeld` returned, no sample holds the grant's lease — unless a fault
///   that can move the key to another server (a failover, a takeover, a
///   migration, a cut of the sentinels' links) came between, with 5 s of
///   slack after it: a replica promoted before the delete reached it holds
///   the lease again until its expiry, which the model allows (a release is
///   not replicated before it answers);
/// - a release that answered `Released` found the lease there, so no sample
///   between the grant and the release call shows the key without it
///   (again unless a switch came between: a client on the old side of a
///   split releases on the server it still takes for the primary).
fn releases(inp: &Inputs<'_>, owned: &HashMap<(u64, u64), String>, f: &mut Findings) {
    f.zero("release-outcome");
    for g in &inp.hist.grants {
        let (Some(out), Some((rel, done))) = (outcome(g), g.rel) else {
            continue;
        };
        if !matches!(out, "Released" | "Expired" | "TakenOver" | "NotHeld") {
            continue;
        }
        let Some(k) = inp.keys.iter().position(|k| *k == g.key) else {
            continue;
        };
        let mut judged = false;
        let start = inp.samples.partition_point(|s| s.t_b < g.g);
        for s in &inp.samples[start..] {
            let Some(v) = s.nodes[0][k].as_deref() else {
                continue;
            };
            let Some(mine) = ours(inp, owned, g, v) else {
                break;
            };
            judged = true;
            if s.t_b > done && mine && !switch_between(inp, rel, s.t_a) {
                f.hit("release-outcome", || {
                    format!(
                        "{} released ({out}) at {:.3} ms, yet the server held it at {:.3} ms",
                        who(g),
                        ms(done),
                        ms(s.t_b)
                    )
                });
                break;
            }
            if out == "Released" && s.t_a <= rel && !mine && !switch_between(inp, s.t_b, rel) {
                f.hit("release-outcome", || {
                    format!(
                        "{} released (Released) at {:.3} ms, yet the server held {v:?} without it at {:.3} ms",
                        who(g),
                        ms(rel),
                        ms(s.t_b)
                    )
                });
                break;
            }
        }
        if judged {
            f.release_checks += 1;
        }
    }
}

/// `held-answers`: what `verify_still_held`, `proclaim` and `reset_expiry`
/// answered, against the samples. A lease's value never comes back once
/// gone, so:
///
/// - an answer that the lease is held (any of the three) means the server
///   held it at some instant of the call: no sample read after the grant
///   and before the call shows the key without it;
///
/// each unless a fault that can switch the key's server came between (see
/// `releases`).
/// - `verify_still_held` answering that it is not held means the server did
///   not hold it at some instant of the call: no sample read after the call
///   returned shows it. (A `false` from `reset_expiry` or `proclaim` may be
///   the guard's own loss deadline, with the lease still on the server.)
fn answers(inp: &Inputs<'_>, owned: &HashMap<(u64, u64), String>, f: &mut Findings) {
    f.zero("held-answers");
    let grant_of: HashMap<(u64, u64), &Grant> =
        inp.hist.grants.iter().map(|g| ((g.w, g.n), g)).collect();
    for a in &inp.hist.answers {
        let (Some(held), Some(g)) = (a.held, grant_of.get(&(a.w, a.n))) else {
            continue;
        };
        let Some(k) = inp.keys.iter().position(|k| *k == g.key) else {
            continue;
        };
        let start = inp.samples.partition_point(|s| s.t_b < g.g);
        let mut judged = false;
        for s in &inp.samples[start..] {
            let Some(v) = s.nodes[0][k].as_deref() else {
                continue;
            };
            let Some(mine) = ours(inp, owned, g, v) else {
                break;
            };
            if held && s.t_a < a.s {
                judged = true;
                if !mine && !switch_between(inp, s.t_b, a.r) {
                    f.hit("held-answers", || {
                        format!(
                            "{} {} answered held over [{:.3}, {:.3}] ms, yet the server held {v:?} without it at {:.3} ms",
                            who(g),
                            a.call,
                            ms(a.s),
                            ms(a.r),
                            ms(s.t_b)
                        )
                    });
                    break;
                }
            } else if !held && a.call == "verify" && s.t_b > a.r {
                judged = true;
                if mine && !switch_between(inp, a.s, s.t_a) {
                    f.hit("held-answers", || {
                        format!(
                            "{} verify answered not held over [{:.3}, {:.3}] ms, yet the server held it at {:.3} ms",
                            who(g),
                            ms(a.s),
                            ms(a.r),
                            ms(s.t_b)
                        )
                    });
                }
                break;
            } else if s.t_b > a.r {
                break;
            }
        }
        if judged {
            f.answer_checks += 1;
        }
    }
}

/// What is left (ms) of grant `g`'s lease in one column of a sample, when
/// the column shows it (`i64::MAX`: no expiry); readers: of the latest
/// live reader's, since readers are not named.
fn left_in(
    inp: &Inputs<'_>,
    owned: &HashMap<(u64, u64), String>,
    g: &Grant,
    s: &Sample,
    col: usize,
    k: usize,
) -> Option<i64> {
    let v = s.nodes.get(col)?.get(k)?.as_deref()?;
    let t = s.ttl.get(col)?.get(k)?.as_deref()?;
    let parse = |t: &str| -> Option<i64> {
        match t.parse::<i64>().ok()? {
            -1 => Some(i64::MAX),
            n if n < 0 => None,
            n => Some(n),
        }
    };
    match (inp.workload, g.mode) {
        (Workload::Rw, 'r') => {
            let live: u64 = v.split('|').nth(1)?.parse().ok()?;
            if live == 0 {
                return None;
            }
            parse(t.split('|').nth(1)?)
        }
        (Workload::Rw, _) if ours(inp, owned, g, v)? => parse(t.split('|').next()?),
        (Workload::Semaphore, _) => {
            let member = format!(":{}:{}", g.slot.unwrap_or(0), g.tok);
            let i = v.split(',').position(|m| m.ends_with(&member))?;
            parse(t.split(',').nth(i)?)
        }
        (Workload::Redlock, _) => {
            (owned.get(&(g.w, g.n)).map(String::as_str) == Some(v)).then_some(())?;
            parse(t)
        }
        (Workload::Rw, _) => None,
        _ => ours(inp, owned, g, v)?.then(|| parse(t))?,
    }
}

/// The latest instant a sample shows grant `g`'s lease alive to on the
/// server's clock: the read's reply time plus what was left (on a quorum of
/// nodes for Redlock, an unknown node counting as holding forever).
fn sample_bound(
    inp: &Inputs<'_>,
    owned: &HashMap<(u64, u64), String>,
    g: &Grant,
    s: &Sample,
    k: usize,
    quorum: usize,
) -> Option<u64> {
    let at = |left: i64| {
        if left == i64::MAX {
            u64::MAX
        } else {
            s.t_a.saturating_add(inp.server_ms(left as u64))
        }
    };
    if inp.workload != Workload::Redlock {
        return left_in(inp, owned, g, s, 0, k).map(at);
    }
    let values = column_values(inp, s, k);
    let mut ends: Vec<u64> = (0..s.nodes.len())
        .filter_map(|c| match values[c] {
            None => Some(u64::MAX),
            Some(_) => left_in(inp, owned, g, s, c, k).map(at),
        })
        .collect();
    ends.sort_unstable_by(|a, b| b.cmp(a));
    ends.get(quorum - 1).copied()
}

/// `vouched-past-ttl`: every claim of every primitive (permits and readers
/// included), judged against the server's own expiry. Each sample read after
/// the grant that shows the lease also reads what is left of it on the
/// server's clock, so the lease ends by the read's reply time plus that; the
/// latest such end over every sample (later renewals move it) bounds the
/// lease, and the guard must not vouch past it. A claim whose release
/// answered `Released` is left out: the release found the lease there, past
/// the last vouch (`release-outcome` judges that answer). Readers, which are
/// not named, are bounded by the latest live reader of any owner.
fn past_ttl(
    inp: &Inputs<'_>,
    claims: &[&Grant],
    owned: &HashMap<(u64, u64), String>,
    f: &mut Findings,
) {
    f.zero("vouched-past-ttl");
    if inp.node_timeout_ns.is_some() {
        f.zero("loss-margin");
    }
    let quorum = inp.samples.first().map_or(1, |s| s.nodes.len() / 2 + 1);
    for g in claims {
        let Some(k) = inp.keys.iter().position(|k| *k == g.key) else {
            continue;
        };
        let v = g.v.unwrap_or(g.g);
        let start = inp.samples.partition_point(|s| s.t_b < g.g);
        // The nemesis's own reads before a stop count too: a renewal between
        // the oracle's last sample and the stop shows there only. Each bound
        // comes with the instant of its read.
        // Once per claim: both scan the claim's answers.
        let renew = renewable(inp, g).then(|| renew_ttl(inp, g));
        let before_stops = inp
            .faults
            .iter()
            .flat_map(|r| {
                let landed = match renew {
                    Some(ttl) => r.landed.map(|l| l + ttl),
                    None => Some(0),
                };
                r.pttl
                    .iter()
                    .chain(&r.reads)
                    .filter_map(move |p| landed.map(|l| (p, l)))
            })
            .filter(|(p, _)| {
                p.key == k
                    && p.t_b >= g.g
                    && p.pttl_ms > 0
                    && inp.workload != Workload::Redlock
                    && ours(inp, owned, g, &p.value) == Some(true)
            })
            .map(|(p, landed)| ((p.t_a + inp.server_ms(p.pttl_ms as u64)).max(landed), p.t_b));
        let Some((bound, read_at)) = inp.samples[start..]
            .iter()
            .filter_map(|s| sample_bound(inp, owned, g, s, k, quorum).map(|b| (b, s.t_b)))
            .chain(before_stops)
            .max()
        else {
            continue;
        };
        // Every claim keeps the margin, released ones too: a holder that
        // let its lease run to the loss deadline finds it still there and
        // releases it, which ends it early, not late.
        loss_margin(inp, g, k, (bound, read_at), f);
        if outcome(g) == Some("Released") {
            continue;
        }
        f.ttl_checks += 1;
        // PTTL is whole milliseconds. A renewal after the bound's read that
        // no later sample saw (the key's server unknown to the oracle, not
        // stopped) may have moved the expiry: then nothing is judged.
        let past = v > bound.saturating_add(1_000_000);
        // A vouch past the bound is judged (and its margin counted) only
        // where no renewal can have moved the bound unseen.
        let judged = !past || seen_through(inp, g, k, read_at, bound, v);
        if past && judged {
            f.hit("vouched-past-ttl", || {
                format!(
                    "{} vouched {:.3} ms past the server's expiry at {:.3} ms",
                    who(g),
                    ms(v - bound),
                    ms(bound)
                )
            });
        }
        let near = inp
            .faults
            .iter()
            .any(|r| r.t0 <= v.saturating_add(2 * inp.ttl_ns) && g.g <= r.t1);
        if near && judged && bound != u64::MAX {
            f.ttl_checks_near_faults += 1;
            let margin = (bound as f64 - v as f64) / 1e6;
            f.min_ttl_margin_ms = Some(f.min_ttl_margin_ms.map_or(margin, |m: f64| m.min(margin)));
        }
    }
}

/// `loss-margin`: a guard is told it lost its lease one node timeout before
/// the lease's validity ends (the send of its last confirmed command plus
/// the TTL less the drift allowance), so that a command started at its last
/// vouch can finish while the server still holds the lease. Whenever the
/// server's clock runs no faster than the drift allowance covers, the
/// server's expiry is at least a node timeout after every vouch: a vouch
/// later than the server's expiry bound less the node timeout is a bound
/// overstated (by a mutant that adds even a few tens of milliseconds to it,
/// which `vouched-past-ttl` cannot see inside the margin). Judged where the
/// oracle saw the key from the bound's read until a sample after the bound,
/// so that no renewal moved the expiry unseen; released claims too (a
/// release ends the lease early, never late); not for claims across a
/// `clock-step` (a server clock stepped forward ends a lease early, which
/// only kept-alive leases can notice), nor without a node timeout on record.
fn loss_margin(
    inp: &Inputs<'_>,
    g: &Grant,
    k: usize,
    (bound, read_at): (u64, u64),
    f: &mut Findings,
) {
    let Some(node_timeout) = inp.node_timeout_ns else {
        return;
    };
    let v = g.v.unwrap_or(g.g);
    if bound == u64::MAX || stepped(inp, g.a, v) {
        return;
    }
    // The samples are in the order they were read.
    let first_after = inp.samples.partition_point(|s| s.t_b <= bound);
    let Some(after) = inp.samples.get(first_after).map(|s| s.t_b) else {
        return;
    };
    if !seen_through(inp, g, k, read_at, bound, after.max(v)) {
        return;
    }
    f.margin_checks += 1;
    // PTTL is whole milliseconds: the expiry may be up to 1 ms past the bound.
    let room = bound.saturating_add(1_000_000) as f64 - (v + node_timeout) as f64;
    f.min_loss_margin_ms = Some(
        f.min_loss_margin_ms
            .map_or(room / 1e6, |m: f64| m.min(room / 1e6)),
    );
    if room < 0.0 {
        f.hit("loss-margin", || {
            format!(
                "{} vouched {:.3} ms before the server's expiry at {:.3} ms, less than the node timeout of {:.3} ms",
                who(g),
                ms(bound.saturating_sub(v)),
                ms(bound),
                ms(node_timeout)
            )
        });
    }
}

/// Whether a server clock was stepped between `from` and `to`.
fn stepped(inp: &Inputs<'_>, from: u64, to: u64) -> bool {
    inp.faults.iter().any(|r| {
        (r.fault == Fault::ClockStep || (r.fault == Fault::Pair && r.target.contains("clock-step")))
            && r.t0 <= to
            && from <= r.t1
    })
}

/// Whether the oracle saw key `k` from a bound's read (`read_at`) to a vouch
/// at `v` well enough that no renewal can have moved the bound unseen: every
/// sample read between them knew the key or fell while a server was
/// stopped after the nemesis read the key there (no renewal lands on a
/// stopped server; for a claim with a renewal possibly in flight, see
/// [`renewable`], no stop counts), and a sample read after the bound knew
/// the key or `v` fell inside such a stop. A renewal lands only
/// while the lease is alive (before the bound), so a known sample after it
/// would show the later expiry.
fn seen_through(inp: &Inputs<'_>, g: &Grant, k: usize, read_at: u64, bound: u64, v: u64) -> bool {
    if inp.workload == Workload::Redlock {
        return true; // an unknown node already counts as holding forever
    }
    // A stopped server takes no renewal — from the moment it stopped, which
    // is after the fault's recorded start: a renewal may land between the
    // last sample and the stop, unseen unless the nemesis read the key just
    // before it (it reads no semaphore's key).
    let renewable = renewable(inp, g);
    let stopped = |t: u64| {
        inp.faults.iter().any(|f| {
            (!renewable || f.landed.is_some_and(|l| l <= t))
                && (f.fault == Fault::Stop || (f.fault == Fault::Pair && f.target.contains("stop")))
                && f.t0 <= t
                && t <= f.t1
                && f.pttl.iter().chain(&f.reads).any(|p| p.key == k)
        })
    };
    // The samples are in the order they were read.
    let from = inp.samples.partition_point(|s| s.t_b <= read_at);
    let to = inp.samples.partition_point(|s| s.t_b <= v);
    let between = inp.samples[from..to.max(from)].iter();
    let mut after_bound = stopped(v);
    for s in between {
        let known = s
            .nodes
            .first()
            .and_then(|n| n.get(k))
            .is_some_and(Option::is_some);
        if !known && !stopped(s.t_b) {
            return false;
        }
        // For a claim that may be renewed, a sample read once the release
        // was called does not show a renewal sent before it: the release
        // may have deleted the key in between.
        let before_release = !renewable || g.rel.is_none_or(|(called, _)| s.t_a <= called);
        after_bound |= known && s.t_b >= bound && before_release;
    }
    after_bound
}

/// `liveness`: after a fault ends, with no other fault under way and none
/// starting for the window, every key is granted again within the window
/// (`liveness_ns`, a stated number of TTLs) — or vouched for by one holder
/// from the fault's end through the whole window —, unless the run stopped
/// first or an acquire had reported the replication history lost by the
/// window's end (the coordinator that saw it grants nothing more).
fn liveness(inp: &Inputs<'_>, f: &mut Findings) {
    f.zero("liveness");
    let (Some(window), Some(end)) = (inp.liveness_ns, inp.end_ns) else {
        return;
    };
    // Each key's grants: when each returned, and when its acquire began.
    let mut by_key: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
    for g in &inp.hist.grants {
        by_key.entry(g.key.as_str()).or_default().push((g.g, g.a));
    }
    // Whether a worker asked for `key` in the window and was not answered
    // with a lease in it: a wait still under way one TTL after the key was
    // free that ended without a lease, or an acquire begun in the window
    // and granted after it. A key nobody asked for is not granted, and
    // says nothing of liveness. Histories that did not record unmet
    // acquires count every key as asked for.
    let asked = |key: &str, from: u64, to: u64, next: Option<(u64, u64)>| {
        !inp.hist.demand_recorded || next.is_some_and(|(_, a)| a <= to) || {
            // `unmet` is in the order the acquires began.
            let begun = inp.hist.unmet.partition_point(|m| m.a <= to);
            inp.hist.unmet[..begun]
                .iter()
                .any(|m| m.t >= from.saturating_add(inp.ttl_ns) && m.keys.iter().any(|k| k == key))
        }
    };
    // A holder granted before the fault ended and still vouching after it
    // kept the key in use: the window starts when the last such holder let
    // go (its release returned, or its last vouch if it never released).
    let free_from = |key: &str, heal: u64| {
        inp.hist
            .grants
            .iter()
            .filter(|g| g.key == key && g.g <= heal && g.v.is_some_and(|v| v >= heal))
            .map(|g| {
                let v = g.v.unwrap_or(g.g);
                g.rel.map_or(v, |(_, returned)| returned.max(v))
            })
            .max()
            .unwrap_or(heal)
            .max(heal)
    };
    // A holder that vouched through the whole window kept the key in use.
    let held_through = |key: &str, from: u64, to: u64| {
        inp.hist
            .grants
            .iter()
            .any(|g| g.key == key && g.g <= from && g.v.is_some_and(|v| v >= to))
    };
    for times in by_key.values_mut() {
        times.sort_unstable();
    }
    for fault in inp.faults {
        let heal = fault.t1;
        let busy = inp.faults.iter().any(|o| o.t0 <= heal && heal < o.t1);
        let quiet_until = inp
            .faults
            .iter()
            .filter(|o| o.t0 > heal)
            .map(|o| o.t0)
            .min()
            .unwrap_or(end)
            .min(end);
        // An acquire that reported the replication history lost ends its
        // coordinator's grants for good (`Replication`'s rustdoc): nothing
        // is promised after it.
        let history_lost = inp
            .hist
            .first_history_lost()
            .is_some_and(|t| t <= heal.saturating_add(window));
        if busy || history_lost || quiet_until < heal.saturating_add(window) {
            continue;
        }
        for key in inp.keys {
            f.liveness_checks += 1;
            if held_through(key, heal, heal + window) {
                continue;
            }
            let from = free_from(key, heal);
            if quiet_until < from.saturating_add(window) {
                f.liveness_checks -= 1;
                continue; // held into the next fault or the row's end
            }
            let next = by_key.get(key.as_str()).and_then(|t| {
                let i = t.partition_point(|&(g, _)| g < heal);
                t.get(i).copied()
            });
            match next {
                Some((g, _)) if g <= from + window => {
                    let wait = ms(g.saturating_sub(from));
                    f.max_regrant_ms = Some(f.max_regrant_ms.map_or(wait, |m: f64| m.max(wait)));
                }
                _ if !asked(key, from, from + window, next) => {
                    f.liveness_checks -= 1; // nobody asked for it
                }
                _ => f.hit("liveness", || {
                    format!(
                        "key {key}: no grant within {:.0} ms after {} on {} ended at {:.3} ms and the key was free from {:.3} ms (next: {})",
                        ms(window),
                        fault.fault.name(),
                        fault.target,
                        ms(heal),
                        ms(from),
                        next.map_or("none".into(), |(g, _)| format!("{:.3} ms", ms(g)))
                    )
                }),
            }
        }
    }
}

/// Each checker on made-up histories: one it must accept and one it must
/// reject. Times are in milliseconds on the shared clock.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{Answer, CapChange, Histories, Observed, Op};
    use crate::nemesis::PttlSample;

    const MS: u64 = 1_000_000;

    /// A grant of worker `w`, number `n` on `key`: acquire began at `a`,
    /// returned at `g`, last vouched at `v`, released `Released` at `v + 1`.
    fn grant(w: u64, n: u64, key: &str, tok: u64, (a, g, v): (u64, u64, u64)) -> Grant {
        Grant {
            w,
            n,
            key: key.into(),
            a: a * MS,
            g: g * MS,
            tok,
            slot: None,
            mode: 'x',
            v: Some(v * MS),
            lost: false,
            outcome: "Released".into(),
            set: None,
            missing: false,
            kept: false,
            rel: Some(((v + 1) * MS, (v + 2) * MS)),
        }
    }

    fn with(g: Grant, f: impl FnOnce(&mut Grant)) -> Grant {
        let mut g = g;
        f(&mut g);
        g
    }

    /// One sample read over `[t, t + 1]` ms: per column, per key, a value and
    /// what was left of it.
    fn sample(t: u64, columns: &[&[(Option<&str>, Option<&str>)]]) -> Sample {
        Sample {
            t_b: t * MS,
            t_a: (t + 1) * MS,
            nodes: columns
                .iter()
                .map(|c| c.iter().map(|(v, _)| v.map(String::from)).collect())
                .collect(),
            ttl: columns
                .iter()
                .map(|c| c.iter().map(|(_, t)| t.map(String::from)).collect())
                .collect(),
        }
    }

    /// A one-column sample of one key.
    fn one(t: u64, value: &str, left: &str) -> Sample {
        sample(t, &[&[(Some(value), Some(left))]])
    }

    fn fault(t0: u64, t1: u64) -> FaultRecord {
        FaultRecord {
            fault: Fault::Stop,
            target: "server 0".into(),
            t0: t0 * MS,
            t1: t1 * MS,
            applied: true,
            note: String::new(),
            pttl: Vec::new(),
            restarted: Vec::new(),
            reads: Vec::new(),
            landed: None,
        }
    }

    fn with_kind(mut f: FaultRecord, kind: Fault) -> FaultRecord {
        f.fault = kind;
        f
    }

    struct Case {
        workload: Workload,
        capacity: u32,
        hist: Histories,
        samples: Vec<Sample>,
        keys: Vec<String>,
        faults: Vec<FaultRecord>,
        tallies: Vec<(String, Tally)>,
        liveness_ms: Option<u64>,
        end_ms: Option<u64>,
        node_timeout_ms: Option<u64>,
        server_clock_rate: f64,
    }

    fn case(workload: Workload, grants: Vec<Grant>, samples: Vec<Sample>) -> Case {
        Case {
            workload,
            capacity: 2,
            hist: Histories {
                grants,
                ..Histories::default()
            },
            samples,
            keys: vec!["k0".into()],
            faults: Vec::new(),
            tallies: Vec::new(),
            liveness_ms: None,
            end_ms: None,
            node_timeout_ms: None,
            server_clock_rate: 1.0,
        }
    }

    impl Case {
        fn run(&self) -> Findings {
            check(&Inputs {
                workload: self.workload,
                capacity: self.capacity,
                hist: &self.hist,
                samples: &self.samples,
                keys: &self.keys,
                faults: &self.faults,
                tallies: &self.tallies,
                restart_delay_ns: None,
                ttl_ns: 600 * MS,
                liveness_ns: self.liveness_ms.map(|ms| ms * MS),
                end_ns: self.end_ms.map(|ms| ms * MS),
                node_timeout_ns: self.node_timeout_ms.map(|ms| ms * MS),
                server_clock_rate: self.server_clock_rate,
            })
        }

        /// The count of one checker, which must have run.
        fn count(&self, name: &str) -> u64 {
            let f = self.run();
            *f.counts
                .get(name)
                .unwrap_or_else(|| panic!("{name} did not run: {:?}", f.counts))
        }
    }

    #[test]
    fn overlap_rejects_two_exclusive_claims_at_once() {
        let a = grant(0, 1, "k0", 1, (0, 1, 10));
        let apart = grant(1, 1, "k0", 2, (5, 11, 20));
        assert_eq!(
            case(Workload::Fenced, vec![a.clone(), apart], vec![]).count("overlap"),
            0
        );
        let inside = grant(1, 1, "k0", 2, (5, 9, 20));
        assert_eq!(
            case(Workload::Fenced, vec![a, inside], vec![]).count("overlap"),
            1
        );
    }

    #[test]
    fn writer_beside_reader_rejects_a_writer_inside_a_reader() {
        let reader = with(grant(0, 1, "k0", 0, (0, 1, 10)), |g| g.mode = 'r');
        let other_reader = with(grant(2, 1, "k0", 0, (0, 2, 12)), |g| g.mode = 'r');
        let after = grant(1, 1, "k0", 3, (5, 13, 20));
        let c = case(
            Workload::Rw,
            vec![reader.clone(), other_reader, after],
            vec![],
        );
        assert_eq!(c.count("writer-beside-reader"), 0);
        let writer = grant(1, 1, "k0", 3, (5, 8, 20));
        let c = case(Workload::Rw, vec![reader, writer], vec![]);
        assert_eq!(c.count("writer-beside-reader"), 1);
    }

    #[test]
    fn capacity_rejects_a_third_permit_of_two() {
        let permit = |w, slot, tok, t| {
            with(grant(w, 1, "k0", tok, t), |g| {
                g.mode = 's';
                g.slot = Some(slot);
            })
        };
        let two = vec![permit(0, 0, 1, (0, 1, 10)), permit(1, 1, 2, (0, 2, 10))];
        assert_eq!(
            case(Workload::Semaphore, two.clone(), vec![]).count("capacity"),
            0
        );
        let mut three = two;
        three.push(permit(2, 0, 3, (0, 3, 10)));
        assert_eq!(
            case(Workload::Semaphore, three, vec![]).count("capacity"),
            1
        );
    }

    #[test]
    fn tokens_rejects_a_later_claim_with_a_smaller_token() {
        let first = grant(0, 1, "k0", 5, (0, 1, 10));
        let later = grant(1, 1, "k0", 6, (11, 12, 20));
        let c = case(Workload::Fenced, vec![first.clone(), later], vec![]);
        assert_eq!(c.count("tokens"), 0);
        let regressed = grant(1, 1, "k0", 4, (11, 12, 20));
        let mut c = case(Workload::Fenced, vec![first, regressed], vec![]);
        assert_eq!(c.count("tokens"), 1);
        // After an acquire reported the history lost, it is counted apart.
        c.hist.history_lost = vec![10 * MS];
        assert_eq!(c.count("tokens"), 0);
        assert_eq!(c.count("tokens-after-history-lost"), 1);
    }

    #[test]
    fn server_oracle_rejects_a_claim_over_another_token() {
        let g = grant(0, 1, "k0", 7, (0, 1, 30));
        let mine = vec![one(5, "abc:7", "500"), one(20, "abc:7", "480")];
        assert_eq!(
            case(Workload::Fenced, vec![g.clone()], mine).count("server-oracle"),
            0
        );
        let other = vec![one(5, "abc:7", "500"), one(20, "def:8", "480")];
        assert_eq!(
            case(Workload::Fenced, vec![g], other).count("server-oracle"),
            1
        );
    }

    #[test]
    fn server_oracle_tells_which_owner_holds_a_plain_lock() {
        let g = grant(0, 1, "k0", 0, (10, 11, 30));
        // The same value throughout, first read after the acquire began.
        let c = case(
            Workload::Lock,
            vec![g.clone()],
            vec![
                one(2, "", "-2"),
                one(15, "aaa", "500"),
                one(25, "aaa", "490"),
            ],
        );
        assert_eq!(c.count("server-oracle"), 0);
        assert_eq!(c.run().owner_checks, 1);
        // Another owner's value inside the claim.
        let c = case(
            Workload::Lock,
            vec![g.clone()],
            vec![one(15, "aaa", "500"), one(25, "bbb", "600")],
        );
        assert_eq!(c.count("server-oracle"), 1);
        // A value the server held before the acquire began.
        let c = case(
            Workload::Lock,
            vec![g.clone()],
            vec![one(2, "aaa", "580"), one(15, "aaa", "500")],
        );
        assert_eq!(c.count("server-oracle"), 1);
        // Two guards vouching for one value: the second's is older than its
        // acquire, and the value is two guards'.
        let other = grant(1, 1, "k0", 0, (31, 32, 50));
        let c = case(
            Workload::Lock,
            vec![g, other],
            vec![one(15, "aaa", "500"), one(40, "aaa", "400")],
        );
        assert_eq!(c.count("server-oracle"), 2);
    }

    #[test]
    fn server_oracle_tells_which_owner_holds_a_redlock_quorum() {
        let g = grant(0, 1, "k0", 0, (10, 11, 30));
        let node = |v: &'static str| (Some(v), Some("500"));
        let quorum_of = |v| sample(20, &[&[node(v)], &[node(v)], &[node("zzz")]]);
        let c = case(
            Workload::Redlock,
            vec![g.clone()],
            vec![
                sample(15, &[&[node("aaa")], &[node("aaa")], &[node("")]]),
                quorum_of("aaa"),
            ],
        );
        assert_eq!(c.count("server-oracle"), 0);
        let c = case(
            Workload::Redlock,
            vec![g],
            vec![
                sample(15, &[&[node("aaa")], &[node("aaa")], &[node("")]]),
                quorum_of("bbb"),
            ],
        );
        assert_eq!(c.count("server-oracle"), 1);
    }

    #[test]
    fn release_outcome_rejects_a_lease_held_after_its_release() {
        // Released at 31 ms, returned at 32 ms.
        let g = grant(0, 1, "k0", 7, (0, 1, 30));
        let gone = vec![one(20, "x:7", "500"), one(40, "", "-2")];
        let c = case(Workload::Fenced, vec![g.clone()], gone);
        assert_eq!(c.count("release-outcome"), 0);
        assert_eq!(c.run().release_checks, 1);
        let still = vec![one(20, "x:7", "500"), one(40, "x:7", "480")];
        assert_eq!(
            case(Workload::Fenced, vec![g.clone()], still).count("release-outcome"),
            1
        );
        // A failover between the release and the sample: a replica that
        // missed the delete may hold the lease again.
        let mut c = case(
            Workload::Fenced,
            vec![g.clone()],
            vec![one(20, "x:7", "500"), one(40, "x:7", "480")],
        );
        c.faults = vec![with_kind(fault(33, 36), Fault::Failover)];
        assert_eq!(c.count("release-outcome"), 0);
        // `Released`, but the lease was gone before the release was called.
        let early = vec![one(20, "", "-2"), one(40, "", "-2")];
        assert_eq!(
            case(Workload::Fenced, vec![g.clone()], early).count("release-outcome"),
            1
        );
        // `Expired` with the lease gone is what the samples show.
        let expired = with(g, |g| g.outcome = "Expired".into());
        let early = vec![one(20, "", "-2"), one(40, "", "-2")];
        assert_eq!(
            case(Workload::Fenced, vec![expired], early).count("release-outcome"),
            0
        );
    }

    #[test]
    fn vouched_past_ttl_rejects_a_vouch_after_the_servers_expiry() {
        // Lost, not released: its lease ran out at 5 + 1 + 100 = 106 ms.
        let lost = |v| {
            with(grant(0, 1, "k0", 7, (0, 1, v)), |g| {
                g.outcome = "Expired".into();
            })
        };
        let samples = vec![one(5, "x:7", "100"), one(120, "", "-2"), one(200, "", "-2")];
        let c = case(Workload::Fenced, vec![lost(100)], samples.clone());
        assert_eq!(c.count("vouched-past-ttl"), 0);
        assert_eq!(c.run().ttl_checks, 1);
        let c = case(Workload::Fenced, vec![lost(150)], samples);
        assert_eq!(c.count("vouched-past-ttl"), 1);
        // The oracle blind after the read (the key's server unknown, not
        // stopped): a renewal may have gone unseen, nothing is judged.
        let blind = vec![
            sample(5, &[&[(Some("x:7"), Some("100"))]]),
            sample(60, &[&[(None, None)]]),
            one(120, "", "-2"),
        ];
        let c = case(Workload::Fenced, vec![lost(150)], blind);
        assert_eq!(c.count("vouched-past-ttl"), 0);
        // A later renewal seen by a later sample moves the bound.
        let renewed = vec![one(5, "x:7", "100"), one(90, "x:7", "600")];
        let c = case(Workload::Fenced, vec![lost(150)], renewed);
        assert_eq!(c.count("vouched-past-ttl"), 0);
        // So does one the nemesis read just before it stopped the server.
        let mut c = case(
            Workload::Fenced,
            vec![lost(150)],
            vec![one(5, "x:7", "100")],
        );
        let mut stop = fault(60, 400);
        stop.pttl = vec![PttlSample {
            key: 0,
            value: "x:7".into(),
            pttl_ms: 590,
            t_b: 59 * MS,
            t_a: 60 * MS,
        }];
        c.faults = vec![stop];
        assert_eq!(c.count("vouched-past-ttl"), 0);
        // A stop from 100 ms with the oracle blind inside it: judged when
        // the nemesis read the key just before the stop, not otherwise (a
        // renewal may have landed between the last sample and the stop).
        let inside = vec![
            one(5, "x:7", "100"),
            sample(110, &[&[(None, None)]]),
            sample(140, &[&[(None, None)]]),
        ];
        let stop_at_100 = |read: bool| {
            let mut stop = fault(100, 400);
            if read {
                stop.pttl = vec![PttlSample {
                    key: 0,
                    value: "x:7".into(),
                    pttl_ms: 5,
                    t_b: 99 * MS,
                    t_a: 100 * MS,
                }];
            }
            stop
        };
        let mut c = case(Workload::Fenced, vec![lost(150)], inside);
        c.faults = vec![stop_at_100(true)];
        assert_eq!(c.count("vouched-past-ttl"), 1);
        c.faults = vec![stop_at_100(false)];
        assert_eq!(c.count("vouched-past-ttl"), 0);
        // A kept-alive guard: a renewal sent before the read may have run
        // after it, before the stop landed; the stop judges nothing.
        c.faults = vec![stop_at_100(true)];
        c.hist.grants[0].kept = true;
        assert_eq!(c.count("vouched-past-ttl"), 0);
        // With the instant the stop landed, such a renewal ran before it:
        // the lease ends by then plus a TTL (600 ms), and a vouch after that
        // inside the stop is judged.
        let mut longer = stop_at_100(true);
        longer.t1 = 1_000 * MS;
        longer.landed = Some(101 * MS);
        c.faults = vec![longer];
        assert_eq!(c.count("vouched-past-ttl"), 0);
        c.hist.grants[0].v = Some(900 * MS);
        assert_eq!(c.count("vouched-past-ttl"), 1);
    }

    #[test]
    fn loss_margin_rejects_a_vouch_within_a_node_timeout_of_the_servers_expiry() {
        // Lost, not released: its lease ran out by 5 + 1 + 100 = 106 ms on
        // the server; with a node timeout of 30 ms the guard must stop
        // vouching by 76 ms (77 with the PTTL's rounding).
        let lost = |v| {
            with(grant(0, 1, "k0", 7, (0, 1, v)), |g| {
                g.outcome = "Expired".into();
            })
        };
        let samples = vec![one(5, "x:7", "100"), one(120, "", "-2"), one(200, "", "-2")];
        let judged = |v, samples: Vec<Sample>| {
            let mut c = case(Workload::Fenced, vec![lost(v)], samples);
            c.node_timeout_ms = Some(30);
            c
        };
        let c = judged(75, samples.clone());
        assert_eq!(c.count("loss-margin"), 0);
        assert_eq!(c.run().margin_checks, 1);
        // 80 ms: inside the margin, not past the expiry.
        let c = judged(80, samples.clone());
        assert_eq!(c.count("loss-margin"), 1);
        assert_eq!(c.count("vouched-past-ttl"), 0);
        // A server clock running 10 % fast: its 100 ms left are 91 ms here.
        let mut c = judged(70, samples.clone());
        assert_eq!(c.count("loss-margin"), 0);
        c.server_clock_rate = 1.1;
        assert_eq!(c.count("loss-margin"), 1);
        // A holder that ran to its loss deadline and then released the
        // lease, still there: judged the same.
        let released = with(lost(80), |g| g.outcome = "Released".into());
        let mut c = case(Workload::Fenced, vec![released], samples.clone());
        c.node_timeout_ms = Some(30);
        assert_eq!(c.count("loss-margin"), 1);
        assert_eq!(c.count("vouched-past-ttl"), 0);
        // The same, kept alive and released at 81 ms, before any sample
        // after the expiry was read: a renewal sent between the read at 5 ms
        // and the release may have moved the expiry, and the release deleted
        // the key before the oracle saw it. Not judged.
        let kept = with(lost(80), |g| {
            g.outcome = "Released".into();
            g.kept = true;
            g.rel = Some((81 * MS, 82 * MS));
        });
        let mut c = case(Workload::Fenced, vec![kept], samples.clone());
        c.node_timeout_ms = Some(30);
        assert_eq!(c.count("loss-margin"), 0);
        assert_eq!(c.run().margin_checks, 0);
        // No node timeout on record (an old history): not judged.
        let mut c = judged(80, samples.clone());
        c.node_timeout_ms = None;
        assert!(!c.run().counts.contains_key("loss-margin"));
        // A clock step during the claim: not judged.
        let mut c = judged(80, samples.clone());
        c.faults = vec![with_kind(fault(50, 51), Fault::ClockStep)];
        assert_eq!(c.count("loss-margin"), 0);
        // A renewal seen by a later sample moves the bound.
        let renewed = vec![
            one(5, "x:7", "100"),
            one(60, "x:7", "600"),
            one(700, "", "-2"),
        ];
        assert_eq!(judged(80, renewed).count("loss-margin"), 0);
        // The oracle blind between the read and the expiry: not judged.
        let blind = vec![
            one(5, "x:7", "100"),
            sample(60, &[&[(None, None)]]),
            one(120, "", "-2"),
        ];
        let c = judged(80, blind);
        assert_eq!(c.count("loss-margin"), 0);
        assert_eq!(c.run().margin_checks, 0);
    }

    #[test]
    fn capacity_rejects_a_grant_past_a_lowered_capacity_and_allows_a_raised_one() {
        let permit = |n, slot, (a, g, v)| {
            with(grant(0, n, "k0", n, (a, g, v)), |g| {
                g.mode = 's';
                g.slot = Some(slot);
            })
        };
        let change = |s, cap, ok| CapChange {
            key: "k0".into(),
            s: s * MS,
            r: (s + 1) * MS,
            cap,
            ok,
        };
        // Capacity 3: two permits held through 100 ms, a third granted at 31.
        let grants = vec![
            permit(1, 0, (5, 10, 100)),
            permit(2, 1, (6, 12, 100)),
            permit(3, 2, (30, 31, 40)),
        ];
        let mut c = case(Workload::Semaphore, grants.clone(), Vec::new());
        c.capacity = 3;
        assert_eq!(c.count("capacity"), 0);
        // Lowered to 2 at 20 ms: the two held keep their permits, the
        // third must not be granted.
        c.hist.caps = vec![change(20, 2, true)];
        assert_eq!(c.count("capacity"), 1);
        // A change that failed may not have been stored.
        c.hist.caps = vec![change(20, 2, false)];
        assert_eq!(c.count("capacity"), 0);
        // Lowered while the third acquire ran: the old capacity may apply.
        c.hist.caps = vec![change(30, 2, true)];
        assert_eq!(c.count("capacity"), 0);
        // Capacity 2 raised to 3 before the third acquire: allowed; not
        // raised: the third is one too many.
        let mut c = case(Workload::Semaphore, grants, Vec::new());
        c.capacity = 2;
        c.hist.caps = vec![change(20, 3, true)];
        assert_eq!(c.count("capacity"), 0);
        c.hist.caps.clear();
        assert!(c.count("capacity") >= 1);
    }

    #[test]
    fn vouched_past_ttl_judges_permits_and_readers() {
        let permit = with(grant(0, 1, "k0", 7, (0, 1, 150)), |g| {
            g.mode = 's';
            g.slot = Some(1);
            g.outcome = "Expired".into();
        });
        let held = vec![one(5, "a:0:6,b:1:7", "900,100"), one(120, "a:0:6", "785")];
        let c = case(Workload::Semaphore, vec![permit.clone()], held);
        assert_eq!(c.count("vouched-past-ttl"), 1);
        let longer = vec![one(5, "a:0:6,b:1:7", "100,900")];
        assert_eq!(
            case(Workload::Semaphore, vec![permit], longer).count("vouched-past-ttl"),
            0
        );
        let reader = with(grant(0, 1, "k0", 0, (0, 1, 150)), |g| {
            g.mode = 'r';
            g.outcome = "Expired".into();
        });
        let live = vec![one(5, "|2", "-2|100"), one(120, "|0", "-2|-2")];
        assert_eq!(
            case(Workload::Rw, vec![reader], live).count("vouched-past-ttl"),
            1
        );
    }

    #[test]
    fn vouched_after_expiry_rejects_a_vouch_past_a_stopped_servers_expiry() {
        let g = grant(0, 1, "k0", 7, (0, 1, 500));
        let mut c = case(Workload::Fenced, vec![g], vec![one(700, "", "-2")]);
        let mut stop = fault(100, 600);
        stop.pttl = vec![PttlSample {
            key: 0,
            value: "x:7".into(),
            pttl_ms: 200,
            t_b: 99 * MS,
            t_a: 100 * MS,
        }];
        c.faults = vec![stop.clone()];
        assert_eq!(c.count("vouched-after-expiry"), 1);
        // Kept alive, or with a `reset_expiry`: a command sent before the
        // read may have run after it, before the stop landed.
        c.hist.grants[0].kept = true;
        assert_eq!(c.count("vouched-after-expiry"), 0);
        // With the stop's landing instant: bounded by it plus a TTL.
        let mut landed = stop.clone();
        landed.landed = Some(100 * MS);
        landed.t1 = 1_000 * MS;
        c.faults = vec![landed];
        c.samples = vec![one(1_100, "", "-2")];
        assert_eq!(c.count("vouched-after-expiry"), 0);
        c.hist.grants[0].v = Some(750 * MS);
        assert_eq!(c.count("vouched-after-expiry"), 1);
        c.samples = vec![one(700, "", "-2")];
        c.hist.grants[0].v = Some(500 * MS);
        c.faults = vec![stop.clone()];
        c.hist.grants[0].kept = false;
        c.hist.answers = vec![Answer {
            w: 0,
            n: 1,
            call: "reset".into(),
            s: 90 * MS,
            r: 95 * MS,
            held: Some(true),
        }];
        assert_eq!(c.count("vouched-after-expiry"), 0);
        c.hist.answers.clear();
        stop.pttl[0].pttl_ms = 450;
        c.faults = vec![stop];
        assert_eq!(c.count("vouched-after-expiry"), 0);
    }

    #[test]
    fn liveness_rejects_a_key_not_granted_again_after_the_fault() {
        let before = grant(0, 1, "k0", 1, (0, 1, 10));
        let soon = grant(0, 2, "k0", 2, (150, 200, 210));
        let mut c = case(Workload::Fenced, vec![before.clone(), soon], vec![]);
        c.faults = vec![fault(20, 100)];
        c.liveness_ms = Some(1000);
        c.end_ms = Some(5000);
        assert_eq!(c.count("liveness"), 0);
        assert_eq!(c.run().liveness_checks, 1);
        let late = grant(0, 2, "k0", 2, (150, 1200, 1210));
        c.hist.grants = vec![before, late];
        assert_eq!(c.count("liveness"), 1);
        // An acquire reported the replication history lost: not judged.
        c.hist.history_lost = vec![500 * MS];
        assert_eq!(c.count("liveness"), 0);
        c.hist.history_lost = Vec::new();
        // The run stopped before the window closed: not judged.
        c.end_ms = Some(900);
        assert_eq!(c.count("liveness"), 0);
        assert_eq!(c.run().liveness_checks, 0);
    }

    #[test]
    fn liveness_counts_from_the_release_of_a_holder_across_the_fault() {
        // Held across the fault's end until 600 ms (released at 601), then
        // granted at 1500: within 1000 ms of the key being free.
        let across = with(grant(0, 1, "k0", 1, (0, 1, 600)), |g| {
            g.rel = Some((600 * MS, 601 * MS))
        });
        let next = grant(0, 2, "k0", 2, (1400, 1500, 1510));
        let mut c = case(Workload::Fenced, vec![across.clone(), next], vec![]);
        c.faults = vec![fault(20, 100)];
        c.liveness_ms = Some(1000);
        c.end_ms = Some(5000);
        assert_eq!(c.count("liveness"), 0);
        // Granted only at 1700: more than 1000 ms after the key was free.
        let late = grant(0, 2, "k0", 2, (1400, 1700, 1710));
        c.hist.grants = vec![across, late];
        assert_eq!(c.count("liveness"), 1);
    }

    #[test]
    fn liveness_judges_only_keys_asked_for_where_the_demand_is_recorded() {
        use crate::history::Unmet;
        let before = grant(0, 1, "k0", 1, (0, 1, 10));
        let mut c = case(Workload::Fenced, vec![before.clone()], vec![]);
        c.faults = vec![fault(20, 100)];
        c.liveness_ms = Some(1000);
        c.end_ms = Some(5000);
        // Never granted again: a finding where the demand is unknown...
        assert_eq!(c.count("liveness"), 1);
        // ...and none where the workers recorded that nobody asked.
        c.hist.demand_recorded = true;
        assert_eq!(c.count("liveness"), 0);
        assert_eq!(c.run().liveness_checks, 0);
        // A wait for the key that ran out while it was free: a finding.
        let wait = |a: u64, t: u64, key: &str| Unmet {
            keys: vec![key.into()],
            a: a * MS,
            t: t * MS,
        };
        c.hist.unmet = vec![wait(300, 1500, "k0")];
        assert_eq!(c.count("liveness"), 1);
        // One for another key, or one that ended before a TTL of the key
        // being free had passed, is no demand for this key in the window.
        c.hist.unmet = vec![wait(50, 120, "k0"), wait(300, 1500, "k1")];
        assert_eq!(c.count("liveness"), 0);
        // An acquire begun in the window and granted after it: a finding.
        c.hist.unmet = Vec::new();
        c.hist.grants = vec![before, grant(0, 2, "k0", 2, (900, 1300, 1310))];
        assert_eq!(c.count("liveness"), 1);
    }

    #[test]
    fn liveness_accepts_a_key_held_through_the_window() {
        let through = grant(0, 1, "k0", 1, (0, 1, 1500));
        let mut c = case(Workload::Fenced, vec![through], vec![]);
        c.faults = vec![fault(20, 100)];
        c.liveness_ms = Some(1000);
        c.end_ms = Some(5000);
        assert_eq!(c.count("liveness"), 0);
        c.hist.grants[0].v = Some(1000 * MS);
        assert_eq!(c.count("liveness"), 1);
    }

    #[test]
    fn held_answers_reject_answers_the_samples_contradict() {
        use crate::history::Answer;
        let g = grant(0, 1, "k0", 7, (0, 1, 100));
        let answer = |call: &str, s, held| Answer {
            w: 0,
            n: 1,
            call: call.into(),
            s: s * MS,
            r: (s + 2) * MS,
            held: Some(held),
        };
        let samples = vec![one(10, "x:7", "500"), one(50, "", "-2"), one(90, "", "-2")];
        let mut c = case(Workload::Fenced, vec![g], samples);
        c.hist.answers = vec![answer("verify", 20, true), answer("verify", 60, false)];
        assert_eq!(c.count("held-answers"), 0);
        assert_eq!(c.run().answer_checks, 2);
        // Held, after a sample showed the lease gone.
        c.hist.answers = vec![answer("reset", 60, true)];
        assert_eq!(c.count("held-answers"), 1);
        // Not held, before a sample showed it there.
        c.hist.answers = vec![answer("verify", 5, false)];
        assert_eq!(c.count("held-answers"), 1);
        // A `false` from reset may be the guard's own deadline.
        c.hist.answers = vec![answer("reset", 5, false)];
        assert_eq!(c.count("held-answers"), 0);
    }

    #[test]
    fn partial_checkers_reject_a_set_held_in_part() {
        let member =
            |n, key: &str, tok| with(grant(0, n, key, tok, (0, 1, 30)), |g| g.set = Some((1, 2)));
        let set = vec![member(1, "k0", 3), member(2, "k1", 4)];
        let both = sample(
            10,
            &[&[(Some("a:3"), Some("500")), (Some("a:4"), Some("500"))]],
        );
        let half = sample(10, &[&[(Some("a:3"), Some("500")), (Some(""), Some("-2"))]]);
        let mut c = case(Workload::Multi, set.clone(), vec![both]);
        c.keys = vec!["k0".into(), "k1".into()];
        assert_eq!(c.count("partial-set"), 0);
        assert_eq!(c.count("partial-guard"), 0);
        c.samples = vec![half];
        assert_eq!(c.count("partial-set"), 1);
        c.hist.grants[1].missing = true;
        assert_eq!(c.count("partial-guard"), 1);
    }

    #[test]
    fn observe_regression_rejects_a_follower_going_back_in_term() {
        let obs = |t, term| Observed {
            w: 0,
            key: "k0".into(),
            t: t * MS,
            term,
        };
        let mut c = case(Workload::Election, vec![], vec![]);
        c.hist.observed = vec![obs(1, Some(3)), obs(2, None), obs(3, Some(4))];
        assert_eq!(c.count("observe-regression"), 0);
        c.hist.observed.push(obs(4, Some(2)));
        assert_eq!(c.count("observe-regression"), 1);
    }

    #[test]
    fn resource_checkers_reject_flagged_operations_and_late_writes() {
        let a = grant(0, 1, "k0", 0, (0, 1, 10));
        let b = grant(1, 1, "k0", 0, (11, 12, 20));
        let write = |w, s, r| Op {
            w,
            n: 1,
            write: true,
            s: s * MS,
            r: r * MS,
            res: "ok".into(),
        };
        let mut c = case(Workload::Lock, vec![a, b], vec![]);
        c.hist.ops = vec![write(0, 5, 6), write(1, 15, 16)];
        assert_eq!(c.count("late-writes"), 0);
        assert_eq!(c.count("resource-lost-updates"), 0);
        // A's write landed inside B's claim.
        c.hist.ops.push(write(0, 14, 15));
        assert_eq!(c.count("late-writes"), 1);
        c.tallies = vec![(
            "res:k0".into(),
            Tally {
                accepted: 3,
                refused: 0,
                lost: 1,
                repeated: 1,
            },
        )];
        assert_eq!(c.count("resource-lost-updates"), 1);
        assert_eq!(c.count("resource-repeated-token"), 1);
    }
}
