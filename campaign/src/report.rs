//! `campaign table [--check] FILE...`: the summaries of finished runs (one
//! JSON line each, as `campaign run` prints them) as the markdown table of
//! RELIABILITY.md; with `--check`, fails unless every run kept its promised
//! model (0 violations) and every negative control was detected.

use std::fs;

use serde_json::Value;

pub(crate) fn main(args: &[String]) -> Result<(), String> {
    let check = args.iter().any(|a| a == "--check");
    let mut rows = Vec::new();
    for file in args.iter().filter(|a| *a != "--check") {
        let text = fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
        for line in text.lines().filter(|l| l.starts_with('{')) {
            rows.push(serde_json::from_str::<Value>(line).map_err(|e| format!("{file}: {e}"))?);
        }
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
            r["grants"],
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
