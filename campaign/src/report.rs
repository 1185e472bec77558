//! `campaign table [--check] [--pairs] FILE...`: the summaries of finished
//! runs (one JSON line each, as `campaign run` prints them) as the markdown
//! table of RELIABILITY.md; with `--check`, fails unless every run kept its
//! promised model (0 violations) and every negative control was detected;
//! with `--pairs`, sums the rows whose whole mix the model promises to
//! survive by topology and primitive instead.

use std::fs;
use std::path::Path;

use serde_json::Value;

use crate::check;
use crate::history;
use crate::nemesis::{FaultRecord, PttlSample};
use crate::resource::Tally;
use crate::sampler::Sample;

/// The rows of one topology and primitive summed, over the rows without a
/// control whose model promises every checker (none allowed to find state
/// lost: `overlap` is not among their allowed checkers).
fn by_pair(rows: &[Value]) {
    let mut sums: Vec<((String, String), [f64; 7])> = Vec::new();
    for r in rows {
        let state_lost = r["allowed"]
            .as_array()
            .is_some_and(|a| a.iter().any(|c| c[0] == "overlap"));
        if r["control"].is_string() || state_lost {
            continue;
        }
        let pair = (
            r["topology"].as_str().unwrap_or_default().to_string(),
            r["workload"].as_str().unwrap_or_default().to_string(),
        );
        let n = |k: &str| r[k].as_f64().unwrap_or_default();
        let add = [
            1.0,
            n("duration_s"),
            n("grants"),
            n("grants_near_faults"),
            n("faults"),
            n("oracle_checks"),
            n("violations"),
        ];
        match sums.iter_mut().find(|(p, _)| *p == pair) {
            Some((_, s)) => s.iter_mut().zip(add).for_each(|(s, a)| *s += a),
            None => sums.push((pair, add)),
        }
    }
    println!(
        "| topology | workload | rows | seconds | grants | grants within 1 s of a fault | faults | server-oracle checks | violations |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for ((topology, workload), s) in &sums {
        println!(
            "| {topology} | {workload} | {} | {:.0} | {} | {} | {} | {} | {} |",
            s[0], s[1], s[2], s[3], s[4], s[5], s[6]
        );
    }
}

pub(crate) fn main(args: &[String]) -> Result<(), String> {
    let check = args.iter().any(|a| a == "--check");
    let pairs = args.iter().any(|a| a == "--pairs");
    let mut rows = Vec::new();
    for file in args.iter().filter(|a| !a.starts_with("--")) {
        let text = fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
        for line in text.lines().filter(|l| l.starts_with('{')) {
            rows.push(serde_json::from_str::<Value>(line).map_err(|e| format!("{file}: {e}"))?);
        }
    }
    if pairs {
        by_pair(&rows);
        return Ok(());
    }
    println!(
        "| topology | workload | nemesis | seconds | grants | grants within 1 s of a fault | guards lost | faults injected | violations of the promised model | negative control: detections | allowed by the model | reproduce |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|");
    let mut failures = Vec::new();
    for r in &rows {
        let faults: Vec<String> = r["faults_by_kind"]
            .as_object()
            .map(|m| m.iter().map(|(k, v)| format!("{k} {v}")).collect())
            .unwrap_or_default();
        let control = match r["control"].as_str() {
            Some(c) => format!("{} ({c})", r["control_detections"]),
            None => "—".into(),
        };
        let nemesis = r["nemesis"].as_str().unwrap_or_default();
        println!(
            "| {} | {} | {} | {:.0} | {} | {} | {} | {} ({}){} | {} | {} | {} | `{}` |",
            r["topology"].as_str().unwrap_or_default(),
            r["workload"].as_str().unwrap_or_default(),
            nemesis,
            r["duration_s"].as_f64().unwrap_or_default(),
            match r["sets"].as_u64() {
                Some(sets) if sets > 0 => format!("{} (keys of {sets} sets)", r["grants"]),
                _ => r["grants"].to_string(),
            },
            r["grants_near_faults"],
            r["grants_lost"],
            r["faults"],
            faults.join(", "),
            match r["faults_not_applied"].as_u64() {
                Some(0) | None => String::new(),
                Some(n) => format!("; {n} not applied"),
            },
            r["violations"],
            control,
            r["allowed_by_model"],
            r["reproduce"].as_str().unwrap_or_default(),
        );
        let name = format!(
            "{} {} {}",
            r["topology"].as_str().unwrap_or_default(),
            r["workload"].as_str().unwrap_or_default(),
            nemesis
        );
        if r["violations"].as_u64() != Some(0) {
            failures.push(format!("{name}: {} violations", r["violations"]));
        }
        if r["control"].is_string() && r["control_detections"].as_u64().unwrap_or(0) == 0 {
            failures.push(format!("{name}: the negative control was not detected"));
        }
        if r["grants"].as_u64().unwrap_or(0) == 0 {
            failures.push(format!("{name}: no grants"));
        }
    }
    if check && !failures.is_empty() {
        return Err(failures.join("\n"));
    }
    Ok(())
}

/// `campaign check DIR`: the checkers again over a finished run's saved
/// histories, faults, server samples and summary; prints the counts and
/// examples.
/// A fault's recorded reads of the keys.
fn reads(v: &Value) -> Vec<PttlSample> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|p| PttlSample {
            key: p["key"].as_u64().unwrap_or(0) as usize,
            value: p["value"].as_str().unwrap_or_default().to_string(),
            pttl_ms: p["pttl_ms"].as_i64().unwrap_or(0),
            t_b: p["t_b"].as_u64().unwrap_or(0),
            t_a: p["t_a"].as_u64().unwrap_or(0),
        })
        .collect()
}

pub(crate) fn recheck(args: &[String]) -> Result<(), String> {
    let dir = Path::new(
        args.iter()
            .find(|a| !a.starts_with("--"))
            .ok_or("campaign check DIR [--summary]")?,
    );
    let read = |name: &str| fs::read_to_string(dir.join(name)).unwrap_or_default();
    let summary: Value = serde_json::from_str(read("summary.json").trim())
        .map_err(|e| format!("summary.json: {e}"))?;
    let workload = summary["workload"].as_str().unwrap_or_default().parse()?;
    let mut files: Vec<_> = fs::read_dir(dir)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "jsonl")
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("worker-"))
        })
        .collect();
    files.sort();
    let hist = history::load(&files);
    let lines = |name: &str| -> Vec<Value> {
        read(name)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let samples: Vec<Sample> = lines("samples.jsonl")
        .iter()
        .map(|v| Sample {
            t_b: v["t_b"].as_u64().unwrap_or(0),
            t_a: v["t_a"].as_u64().unwrap_or(0),
            nodes: serde_json::from_value(v["nodes"].clone()).unwrap_or_default(),
            ttl: serde_json::from_value(v["ttl"].clone()).unwrap_or_default(),
        })
        .collect();
    let faults: Vec<FaultRecord> = lines("faults.jsonl")
        .iter()
        .map(|v| FaultRecord {
            fault: v["fault"]
                .as_str()
                .unwrap_or_default()
                .parse()
                .unwrap_or(crate::nemesis::Fault::Kill),
            target: v["target"].as_str().unwrap_or_default().to_string(),
            t0: v["t0"].as_u64().unwrap_or(0),
            t1: v["t1"].as_u64().unwrap_or(0),
            applied: v["applied"].as_bool().unwrap_or(false),
            note: String::new(),
            pttl: reads(&v["pttl"]),
            reads: reads(&v["reads"]),
            restarted: serde_json::from_value(v["restarted"].clone()).unwrap_or_default(),
            landed: v["landed"].as_u64(),
        })
        .collect();
    let tallies: Vec<(String, Tally)> = summary["tallies"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            let n = |i: usize| t[i].as_u64().unwrap_or(0);
            (
                t[0].as_str().unwrap_or_default().to_string(),
                Tally {
                    accepted: n(1),
                    refused: n(2),
                    lost: n(3),
                    repeated: n(4),
                },
            )
        })
        .collect();
    let keys: Vec<String> = (0..summary["keys"].as_u64().unwrap_or(2))
        .map(|i| format!("k{i}"))
        .collect();
    let f = check::check(&check::Inputs {
        workload,
        // Before any set_capacity (the history has the changes).
        capacity: summary["capacity"].as_u64().unwrap_or(2) as u32,
        hist: &hist,
        samples: &samples,
        keys: &keys,
        faults: &faults,
        tallies: &tallies,
        restart_delay_ns: summary["restart_delay_ms"]
            .as_u64()
            .map(|ms| ms * 1_000_000),
        ttl_ns: summary["ttl_ms"].as_u64().unwrap_or(600) * 1_000_000,
        liveness_ns: summary["liveness_ms"]
            .as_u64()
            .filter(|&ms| ms > 0)
            .map(|ms| ms * 1_000_000),
        end_ns: summary["t_end_ns"].as_u64(),
        node_timeout_ns: summary["node_timeout_ms"].as_u64().map(|ms| ms * 1_000_000),
        server_clock_rate: summary["server_clock_rate"].as_f64().unwrap_or(1.0),
    });
    println!(
        "{} grants, {} samples, {} faults, {} oracle checks, {} owner checks, {} release checks, {} answer checks, {} ttl checks ({} near faults, min margin {:?} ms), {} loss-margin checks (least room {:?} ms), {} liveness checks (longest wait {:?} ms)",
        hist.grants.len(),
        samples.len(),
        faults.len(),
        f.oracle_checks,
        f.owner_checks,
        f.release_checks,
        f.answer_checks,
        f.ttl_checks,
        f.ttl_checks_near_faults,
        f.min_ttl_margin_ms,
        f.margin_checks,
        f.min_loss_margin_ms,
        f.liveness_checks,
        f.max_regrant_ms
    );
    // The checkers the run's model left free to fire, as its summary
    // recorded them.
    let allowed: Vec<&str> = summary["allowed"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a[0].as_str())
        .collect();
    let mut violations = 0;
    for (name, n) in &f.counts {
        let free = allowed.contains(name);
        if !free {
            violations += n;
        }
        println!(
            "{name:<40} {n}{}",
            if free { " (allowed by the model)" } else { "" }
        );
        for ex in f.examples.get(name).into_iter().flatten() {
            println!("    {ex}");
        }
    }
    println!("violations of the promised model: {violations}");
    if args.iter().any(|a| a == "--summary") {
        // The row's summary line again, with these checkers' findings, for
        // `campaign table`.
        let mut s = summary.clone();
        let allowed_hits: u64 = f
            .counts
            .iter()
            .filter(|(name, _)| allowed.contains(name))
            .map(|(_, n)| n)
            .sum();
        s["checks"] = serde_json::json!(f.counts);
        s["examples"] = serde_json::json!(f.examples);
        s["violations"] = serde_json::json!(violations);
        s["allowed_by_model"] = serde_json::json!(allowed_hits);
        if let Some(control) = summary["control"]
            .as_str()
            .and_then(|c| c.parse::<crate::spec::Control>().ok())
        {
            let detections: u64 = crate::driver::control_checkers(control)
                .iter()
                .map(|c| f.counts.get(c).copied().unwrap_or(0))
                .sum();
            s["control_detections"] = serde_json::json!(detections);
        }
        s["oracle_checks"] = serde_json::json!(f.oracle_checks);
        s["owner_checks"] = serde_json::json!(f.owner_checks);
        s["release_checks"] = serde_json::json!(f.release_checks);
        s["answer_checks"] = serde_json::json!(f.answer_checks);
        s["ttl_checks"] = serde_json::json!(f.ttl_checks);
        s["ttl_checks_near_faults"] = serde_json::json!(f.ttl_checks_near_faults);
        s["min_ttl_margin_ms"] = serde_json::json!(f.min_ttl_margin_ms);
        s["margin_checks"] = serde_json::json!(f.margin_checks);
        s["min_loss_margin_ms"] = serde_json::json!(f.min_loss_margin_ms);
        s["liveness_checks"] = serde_json::json!(f.liveness_checks);
        s["max_regrant_ms"] = serde_json::json!(f.max_regrant_ms);
        s["expiry_checks"] = serde_json::json!(f.expiry_checks);
        s["min_expiry_margin_ms"] = serde_json::json!(f.min_expiry_margin_ms);
        eprintln!("{s}");
    }
    match summary["control"].as_str() {
        Some(control) => {
            println!("negative control {control}: violations are what it shows");
            Ok(())
        }
        None if violations > 0 => Err(format!("{violations} violations")),
        None => Ok(()),
    }
}

/// `campaign gaps DIR`: where a finished run's time went around its faults.
/// For each fault applied: how long it lasted, how long after its start the
/// first grant came, and the grants and acquire errors (by message) while
/// it lasted; then, per kind of fault, the seconds spent inside such faults
/// and the grants a second there, against the rest of the run.
pub(crate) fn gaps(args: &[String]) -> Result<(), String> {
    let dir = Path::new(args.first().ok_or("campaign gaps DIR")?);
    let mut grants: Vec<u64> = Vec::new();
    let mut errors: Vec<(u64, String)> = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if !(name.starts_with("worker-") && name.ends_with(".jsonl")) || name.contains("observe") {
            continue;
        }
        let text = fs::read_to_string(&path).map_err(|e| e.to_string())?;
        for e in text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        {
            match e["ev"].as_str() {
                // One grant per acquire: a set's first key.
                Some("grant") if e["set"].as_u64().is_none_or(|s| Some(s) == e["n"].as_u64()) => {
                    grants.push(e["g"].as_u64().unwrap_or(0));
                }
                Some("err") => errors.push((
                    e["t"].as_u64().unwrap_or(0),
                    error_kind(e["what"].as_str().unwrap_or_default()),
                )),
                _ => {}
            }
        }
    }
    grants.sort_unstable();
    let faults: Vec<Value> = fs::read_to_string(dir.join("faults.jsonl"))
        .map_err(|e| format!("faults.jsonl: {e}"))?
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|f| f["applied"].as_bool() == Some(true))
        .collect();
    let summary: Value = serde_json::from_str(
        fs::read_to_string(dir.join("summary.json"))
            .map_err(|e| format!("summary.json: {e}"))?
            .trim(),
    )
    .map_err(|e| format!("summary.json: {e}"))?;
    let inside =
        |a: u64, b: u64| grants.partition_point(|&g| g <= b) - grants.partition_point(|&g| g < a);
    println!(
        "| fault | s | first grant after its start (ms) | grants during it | errors during it |"
    );
    println!("|---|---:|---:|---:|---|");
    let mut kinds: Vec<(String, f64, usize, usize)> = Vec::new();
    let (mut fault_s, mut fault_grants) = (0.0, 0);
    for f in &faults {
        let kind = f["fault"].as_str().unwrap_or_default().to_string();
        let (t0, t1) = (f["t0"].as_u64().unwrap_or(0), f["t1"].as_u64().unwrap_or(0));
        let secs = t1.saturating_sub(t0) as f64 / 1e9;
        let next = grants.get(grants.partition_point(|&g| g < t0));
        let during = inside(t0, t1);
        let mut by_what: Vec<(String, usize)> = Vec::new();
        for (_, what) in errors.iter().filter(|(t, _)| (t0..=t1).contains(t)) {
            match by_what.iter_mut().find(|(w, _)| w == what) {
                Some((_, n)) => *n += 1,
                None => by_what.push((what.clone(), 1)),
            }
        }
        by_what.sort_by_key(|b| std::cmp::Reverse(b.1));
        let what: Vec<String> = by_what
            .iter()
            .take(2)
            .map(|(w, n)| format!("{n} {w}"))
            .collect();
        println!(
            "| {kind} | {secs:.1} | {} | {during} | {} |",
            next.map_or("—".into(), |g| format!("{:.0}", (g - t0) as f64 / 1e6)),
            what.join("; ")
        );
        match kinds.iter_mut().find(|(k, ..)| *k == kind) {
            Some((_, s, n, g)) => {
                *s += secs;
                *n += 1;
                *g += during;
            }
            None => kinds.push((kind, secs, 1, during)),
        }
        fault_s += secs;
        fault_grants += during;
    }
    let span = summary["duration_s"].as_f64().unwrap_or_default();
    println!();
    println!("| inside | faults | s | grants | grants/s |");
    println!("|---|---:|---:|---:|---:|");
    for (kind, s, n, g) in &kinds {
        println!(
            "| {kind} | {n} | {s:.1} | {g} | {:.1} |",
            *g as f64 / s.max(1e-9)
        );
    }
    let rest = span - fault_s;
    let rest_grants = grants.len() - fault_grants;
    println!(
        "| no fault | — | {rest:.1} | {rest_grants} | {:.1} |",
        rest_grants as f64 / rest.max(1e-9)
    );
    Ok(())
}

/// An acquire error's message without its quoted key names and its numbers,
/// up to its first colon.
fn error_kind(msg: &str) -> String {
    let unquoted: String = msg.split('"').step_by(2).collect::<Vec<_>>().join("K");
    let head = unquoted.split(':').next().unwrap_or_default();
    let mut out = String::new();
    for c in head.chars() {
        if !c.is_ascii_digit() {
            out.push(c);
        } else if !out.ends_with('N') {
            out.push('N');
        }
    }
    out.trim().to_string()
}
