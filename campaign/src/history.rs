//! Reading the workers' JSON-lines histories back.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use serde_json::Value;

/// One grant with what its worker recorded at the end of it.
#[derive(Debug, Clone)]
pub(crate) struct Grant {
    pub(crate) w: u64,
    pub(crate) n: u64,
    pub(crate) key: String,
    /// When the acquire call started.
    pub(crate) a: u64,
    /// When the acquire returned the guard.
    pub(crate) g: u64,
    pub(crate) tok: u64,
    pub(crate) slot: Option<u32>,
    /// `x` exclusive (lock, fenced, writer, redlock), `r` reader, `s` permit.
    pub(crate) mode: char,
    /// The last instant the guard vouched for the lease (read before an
    /// `is_lost()` that answered `false`); `None` if it never did or the
    /// worker did not get to record it.
    pub(crate) v: Option<u64>,
    pub(crate) lost: bool,
    pub(crate) outcome: String,
    /// For a key of a set taken together: the set (its first grant's
    /// number) and how many keys it has.
    pub(crate) set: Option<(u64, u64)>,
    /// A key of the set the returned guard had no lease on.
    pub(crate) missing: bool,
    /// Whether its guard was kept alive at some point (renewals may have
    /// been in flight at any instant of the claim).
    pub(crate) kept: bool,
    /// When the release (or resignation) was called and when it returned;
    /// `None` if the worker did not get to record it.
    pub(crate) rel: Option<(u64, u64)>,
}

impl Grant {
    /// The interval the guard vouched for: `[g, v]`.
    pub(crate) fn claim(&self) -> Option<(u64, u64)> {
        self.v.map(|v| (self.g, v.max(self.g)))
    }

    /// The exclusive group: the key, and the slot for a permit.
    pub(crate) fn group(&self) -> String {
        match self.slot {
            Some(s) => format!("{}:{s}", self.key),
            None => self.key.clone(),
        }
    }
}

/// A resource operation.
#[derive(Debug, Clone)]
pub(crate) struct Op {
    pub(crate) w: u64,
    pub(crate) n: u64,
    pub(crate) write: bool,
    pub(crate) s: u64,
    pub(crate) r: u64,
    pub(crate) res: String,
}

impl Op {
    /// Accepted by the resource (whatever it flagged).
    pub(crate) fn accepted(&self) -> bool {
        self.res == "ok" || self.res.starts_with("ok+")
    }

    /// Accepted with the token of the last operation of another owner.
    pub(crate) fn repeated_token(&self) -> bool {
        self.res.split('+').any(|f| f == "repeated")
    }

    /// An accepted write that found the counter changed since its read.
    pub(crate) fn lost_update(&self) -> bool {
        self.res.split('+').any(|f| f == "lost")
    }
}

/// One leader an `observe()` follower reported.
#[derive(Debug, Clone)]
pub(crate) struct Observed {
    /// The worker whose follower thread it was.
    pub(crate) w: u64,
    pub(crate) key: String,
    /// When the iterator returned it.
    pub(crate) t: u64,
    /// The leader's term; `None`: nobody leads.
    pub(crate) term: Option<u64>,
}

/// What a call that asks the server about a held lease answered.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) w: u64,
    pub(crate) n: u64,
    /// `verify` (`verify_still_held`), `proclaim` or `reset`
    /// (`reset_expiry`, Redlock's `extend`).
    pub(crate) call: String,
    /// When it was called and when it returned.
    pub(crate) s: u64,
    pub(crate) r: u64,
    /// `None`: it returned an error.
    pub(crate) held: Option<bool>,
}

#[derive(Debug, Default)]
pub(crate) struct Histories {
    pub(crate) grants: Vec<Grant>,
    pub(crate) ops: Vec<Op>,
    /// Acquire errors by message (numbers stripped), with counts.
    pub(crate) errors: HashMap<String, u64>,
    pub(crate) attempts: u64,
    pub(crate) busy: u64,
    pub(crate) workers_finished: u64,
    /// When an acquire returned `Error::ReplicationHistoryLost`, in order:
    /// the deployment told a worker that tokens issued before may be issued
    /// again.
    pub(crate) history_lost: Vec<u64>,
    /// What the `observe()` followers reported, per file in order.
    pub(crate) observed: Vec<Observed>,
    /// Errors the followers' iterators returned, by message.
    pub(crate) observe_errors: HashMap<String, u64>,
    /// What `verify`, `proclaim` and `reset` calls answered.
    pub(crate) answers: Vec<Answer>,
    /// `set_capacity` calls, in the order they were made.
    pub(crate) caps: Vec<CapChange>,
    /// Acquires that returned without a lease (the wait ran out, or an
    /// error), with the keys they asked for: the demand no grant met.
    pub(crate) unmet: Vec<Unmet>,
    /// Whether the workers recorded `unmet` (histories written before they
    /// did have none, which says nothing of the demand).
    pub(crate) demand_recorded: bool,
}

/// An acquire of `keys` begun at `a` that returned at `t` without a lease.
#[derive(Debug, Clone)]
pub(crate) struct Unmet {
    pub(crate) keys: Vec<String>,
    pub(crate) a: u64,
    pub(crate) t: u64,
}

/// A `set_capacity(cap)` call on a semaphore's key, sent at `s`, returned at
/// `r`; `ok: false` for an error (the change may have been stored or not).
#[derive(Debug, Clone)]
pub(crate) struct CapChange {
    pub(crate) key: String,
    pub(crate) s: u64,
    pub(crate) r: u64,
    pub(crate) cap: u32,
    pub(crate) ok: bool,
}

/// The words of `Error::ReplicationHistoryLost`'s message.
const HISTORY_LOST: &str = "the replication history may have been lost";

impl Histories {
    /// The first instant an acquire reported the history lost.
    pub(crate) fn first_history_lost(&self) -> Option<u64> {
        self.history_lost.first().copied()
    }
}

/// The error message with digits replaced, so that like errors group.
fn shape(msg: &str) -> String {
    let mut out = String::new();
    let mut digit = false;
    for c in msg.chars() {
        if c.is_ascii_digit() {
            if !digit {
                out.push('N');
            }
            digit = true;
        } else {
            digit = false;
            out.push(c);
        }
    }
    out.chars().take(120).collect()
}

pub(crate) fn load(files: &[impl AsRef<Path>]) -> Histories {
    let mut h = Histories::default();
    let mut ends: HashMap<(u64, u64), Value> = HashMap::new();
    let mut grants: Vec<Grant> = Vec::new();
    for file in files {
        let Ok(text) = fs::read_to_string(file) else {
            continue;
        };
        for line in text.lines() {
            let Ok(e) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            let u = |k: &str| e[k].as_u64().unwrap_or(0);
            match e["ev"].as_str() {
                Some("grant") => grants.push(Grant {
                    w: u("w"),
                    n: u("n"),
                    key: e["key"].as_str().unwrap_or_default().to_string(),
                    a: u("a"),
                    g: u("g"),
                    tok: u("tok"),
                    slot: e["slot"].as_u64().map(|s| s as u32),
                    mode: e["mode"]
                        .as_str()
                        .and_then(|m| m.chars().next())
                        .unwrap_or('x'),
                    v: None,
                    lost: false,
                    outcome: String::new(),
                    set: e["set"].as_u64().map(|s| (s, u("size"))),
                    missing: e["missing"].as_bool().unwrap_or(false),
                    kept: false,
                    rel: None,
                }),
                Some("end") => {
                    ends.insert((u("w"), u("n")), e.clone());
                }
                Some("op") => h.ops.push(Op {
                    w: u("w"),
                    n: u("n"),
                    write: e["k"].as_str() == Some("w"),
                    s: u("s"),
                    r: u("r"),
                    res: e["res"].as_str().unwrap_or_default().to_string(),
                }),
                Some("busy") => h.unmet.push(unmet(&e)),
                Some("err") => {
                    if e["keys"].is_array() {
                        h.unmet.push(unmet(&e));
                    }
                    let what = e["what"].as_str().unwrap_or_default();
                    if what.contains(HISTORY_LOST) {
                        h.history_lost.push(u("t"));
                    }
                    *h.errors
                        .entry(shape(e["what"].as_str().unwrap_or_default()))
                        .or_default() += 1;
                }
                Some("obs") => h.observed.push(Observed {
                    w: u("w"),
                    key: e["key"].as_str().unwrap_or_default().to_string(),
                    t: u("t"),
                    term: e["term"].as_u64(),
                }),
                Some("answer") => h.answers.push(Answer {
                    w: u("w"),
                    n: u("n"),
                    call: e["call"].as_str().unwrap_or_default().to_string(),
                    s: u("s"),
                    r: u("r"),
                    held: e["held"].as_bool(),
                }),
                Some("cap") => h.caps.push(CapChange {
                    key: e["key"].as_str().unwrap_or_default().to_string(),
                    s: u("s"),
                    r: u("r"),
                    cap: u("cap") as u32,
                    ok: e["ok"].as_bool().unwrap_or(false),
                }),
                Some("obs-err") => {
                    *h.observe_errors
                        .entry(shape(e["what"].as_str().unwrap_or_default()))
                        .or_default() += 1;
                }
                Some("stats") => {
                    h.attempts += u("attempts");
                    h.busy += u("busy");
                    h.workers_finished += 1;
                    h.demand_recorded |= e["demand"].as_bool().unwrap_or(false);
                }
                _ => {}
            }
        }
    }
    for g in &mut grants {
        if let Some(e) = ends.get(&(g.w, g.n)) {
            g.v = e["v"].as_u64();
            g.lost = e["lost"].as_bool().unwrap_or(false);
            g.outcome = e["out"].as_str().unwrap_or_default().to_string();
            g.rel = e["rel"].as_u64().zip(e["t"].as_u64());
            g.kept = e["kept"].as_bool().unwrap_or(false);
        }
    }
    h.grants = grants;
    h.history_lost.sort_unstable();
    h.unmet.sort_by_key(|m| m.a);
    h.caps.sort_by_key(|c| c.s);
    h
}

/// An unmet acquire from its `busy` or `err` event.
fn unmet(e: &Value) -> Unmet {
    Unmet {
        keys: e["keys"]
            .as_array()
            .map(|ks| {
                ks.iter()
                    .filter_map(|k| k.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default(),
        a: e["a"].as_u64().unwrap_or(0),
        t: e["t"].as_u64().unwrap_or(0),
    }
}
