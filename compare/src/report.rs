//! Turns the runs into markdown: per case a table of medians over rounds of
//! per-round ratios to the raw baseline (paired), the absolute figures, and
//! every round's figure.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::driver::{Options, Results, Run, RunInfo};
use crate::plan::{Case, Impl, Section};
use crate::stats::median;

fn runs<'a>(results: &'a Results, case: Section, name: &str) -> &'a [Run] {
    results
        .iter()
        .find(|((c, n), _)| *c == case && *n == name)
        .map_or(&[], |(_, runs)| runs.as_slice())
}

/// The implementations of `case` that ran (all of them unless `--impls`
/// chose some), in the case's order.
fn measured(results: &Results, case: Section) -> impl Iterator<Item = &'static Impl> + '_ {
    case.impls()
        .iter()
        .filter(move |i| !runs(results, case, i.name).is_empty())
}

fn value(run: &Run, metric: &str) -> Option<f64> {
    run.figures.as_ref().and_then(|f| f.get(metric).copied())
}

/// `metric` of every run of `name` (`None` where it failed or has none).
fn values(results: &Results, case: Section, name: &str, metric: &str) -> Vec<Option<f64>> {
    runs(results, case, name)
        .iter()
        .map(|r| value(r, metric))
        .collect()
}

/// Per run of `imp`: `metric` divided by that of the baseline run it was
/// paired with (1 for a baseline's own runs).
fn ratios(results: &Results, case: Section, imp: &Impl, metric: &str) -> Vec<Option<f64>> {
    let Some(baseline) = imp.baseline else {
        return Vec::new();
    };
    let base_runs = runs(results, case, baseline);
    runs(results, case, imp.name)
        .iter()
        .map(|run| {
            let v = value(run, metric)?;
            let b = if baseline == imp.name {
                v
            } else {
                value(base_runs.get(run.baseline_run?)?, metric)?
            };
            // A ratio of signed figures (a hand-off can end before the
            // releaser's call returns) would mislead.
            (v > 0.0 && b > 0.0).then(|| v / b)
        })
        .collect()
}

fn med(v: &[Option<f64>]) -> Option<f64> {
    median(&v.iter().flatten().copied().collect::<Vec<_>>())
}

fn ratio(v: Option<f64>) -> String {
    v.map_or("—".into(), |v| format!("{v:.2}"))
}

/// Microseconds (or milliseconds) without false precision.
fn num(v: Option<f64>) -> String {
    match v {
        None => "—".into(),
        Some(v) if v.abs() >= 100.0 => format!("{v:.0}"),
        Some(v) if v.abs() >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
}

fn percent(v: Option<f64>) -> String {
    v.map_or("—".into(), |v| format!("{:.0} %", v * 100.0))
}

fn baseline_label(imp: &Impl) -> String {
    match imp.baseline {
        Some(b) if b == imp.name => " (the baseline)".into(),
        Some(b) => format!(" (ratios to `{b}`)"),
        None => String::new(),
    }
}

/// A table of every round's `metric`: the ratio to the baseline run it was
/// paired with, then its value and that run's in `unit`; with no unit, a
/// share in percent. A baseline's own cell is the median of its runs that
/// round.
fn rounds_table(out: &mut String, results: &Results, case: Section, metric: &str, unit: &str) {
    let rounds = measured(results, case)
        .flat_map(|i| runs(results, case, i.name))
        .map(|r| r.round + 1)
        .max()
        .unwrap_or(0);
    let _ = write!(out, "\n| implementation |");
    for r in 1..=rounds {
        let _ = write!(out, " round {r} |");
    }
    let _ = write!(out, "\n|---|");
    for _ in 0..rounds {
        let _ = write!(out, "---|");
    }
    out.push('\n');
    for imp in measured(results, case) {
        let all = runs(results, case, imp.name);
        let rats = ratios(results, case, imp, metric);
        let _ = write!(out, "| `{}` |", imp.name);
        for round in 0..rounds {
            let mine: Vec<usize> = (0..all.len()).filter(|&i| all[i].round == round).collect();
            let failed = !mine.is_empty() && mine.iter().all(|&i| all[i].error.is_some());
            let v = med(&mine
                .iter()
                .map(|&i| value(&all[i], metric))
                .collect::<Vec<_>>());
            let r = med(&mine
                .iter()
                .map(|&i| rats.get(i).copied().flatten())
                .collect::<Vec<_>>());
            // The baseline run next to this round's run, for its value.
            let base = imp
                .baseline
                .filter(|b| *b != imp.name)
                .zip(mine.iter().find(|&&i| all[i].baseline_run.is_some()))
                .and_then(|(b, &i)| runs(results, case, b).get(all[i].baseline_run?))
                .and_then(|run| value(run, metric));
            let cell = match v {
                None if failed => "failed".to_owned(),
                None => "—".to_owned(),
                Some(v) if unit.is_empty() => percent(Some(v)),
                Some(v) => match (r, base) {
                    (Some(r), Some(b)) => {
                        format!("{r:.2} ({} vs {} {unit})", num(Some(v)), num(Some(b)))
                    }
                    (None, Some(b)) => format!("{} vs {} {unit}", num(Some(v)), num(Some(b))),
                    _ => format!("{} {unit}", num(Some(v))),
                },
            };
            let _ = write!(out, " {cell} |");
        }
        out.push('\n');
    }
}

/// How many distinct notes per implementation the report shows.
const NOTES_SHOWN: usize = 2;
/// Notes are cut to this many characters.
const NOTE_CHARS: usize = 400;

/// Lists failed runs and the first distinct notes children printed.
fn problems(out: &mut String, results: &Results, case: Section) {
    let mut lines = Vec::new();
    for imp in measured(results, case) {
        let mut notes: Vec<&str> = Vec::new();
        let mut more = 0;
        for run in runs(results, case, imp.name) {
            if let Some(e) = &run.error {
                lines.push(format!(
                    "- `{}`, round {}: failed: {e}",
                    imp.name,
                    run.round + 1
                ));
            }
            for note in &run.notes {
                if notes.contains(&note.as_str()) {
                    continue;
                }
                if notes.len() < NOTES_SHOWN {
                    notes.push(note);
                } else {
                    more += 1;
                }
            }
        }
        for note in notes {
            let cut: String = note.chars().take(NOTE_CHARS).collect();
            let ellipsis = if cut.len() < note.len() { " …" } else { "" };
            lines.push(format!("- `{}` reported: {cut}{ellipsis}", imp.name));
        }
        if more > 0 {
            lines.push(format!(
                "- `{}`: {more} more distinct messages of this kind",
                imp.name
            ));
        }
    }
    if !lines.is_empty() {
        out.push_str("\nErrors and notes from the runs:\n\n");
        for line in lines {
            out.push_str(&line);
            out.push('\n');
        }
    }
}

fn implementations(out: &mut String, results: &Results, case: Section) {
    out.push_str("\nImplementations:\n\n");
    for imp in measured(results, case) {
        let _ = writeln!(
            out,
            "- `{}`: {}{}",
            imp.name,
            imp.label,
            baseline_label(imp)
        );
    }
}

/// The table for cases measured as latency pairs (1 and 2).
fn latency_case(out: &mut String, results: &Results, case: Section, acquire_column: bool) {
    out.push_str(
        "\n| implementation | p50 × baseline | p99 × baseline | p50 µs | p99 µs \
         | CPU × baseline | CPU µs per 1,000 |",
    );
    out.push_str(if acquire_column {
        " acquire p50 µs |\n|---|---|---|---|---|---|---|---|\n"
    } else {
        "\n|---|---|---|---|---|---|---|\n"
    });
    for imp in measured(results, case) {
        let _ = write!(
            out,
            "| `{}` | {} | {} | {} | {} | {} | {} |",
            imp.name,
            ratio(med(&ratios(results, case, imp, "p50"))),
            ratio(med(&ratios(results, case, imp, "p99"))),
            num(med(&values(results, case, imp.name, "p50"))),
            num(med(&values(results, case, imp.name, "p99"))),
            ratio(med(&ratios(results, case, imp, "cpu"))),
            num(med(&values(results, case, imp.name, "cpu"))),
        );
        if acquire_column {
            let _ = write!(
                out,
                " {} |",
                num(med(&values(results, case, imp.name, "acquire_p50")))
            );
        }
        out.push('\n');
    }
    implementations(out, results, case);
    out.push_str(
        "\nEvery round's p50: × the baseline run next to it (its p50 vs the baseline's, in \
         µs); a baseline's own cell is the median of its runs that round.\n",
    );
    rounds_table(out, results, case, "p50", "µs");
    out.push_str(
        "\nEvery round's client CPU per 1,000 pairs (user + system time of the measuring \
         process during its timed turns, by `getrusage`): × the baseline run next to it \
         (its figure vs the baseline's, in µs).\n",
    );
    rounds_table(out, results, case, "cpu", "µs");
    problems(out, results, case);
}

fn handoff_case(out: &mut String, results: &Results, case: Section) {
    out.push_str(
        "\n| implementation | p50 × baseline | p99 × baseline | p50 µs | p99 µs \
         | from release sent: p50 × baseline | p99 × baseline | p50 µs | p99 µs \
         | release call p50 µs | hand-offs measured per round | releaser re-acquired \
         | grants per round |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut overlaps = 0.0;
    for imp in measured(results, case) {
        let m = |metric: &str| med(&values(results, case, imp.name, metric));
        let r = |metric: &str| ratio(med(&ratios(results, case, imp, metric)));
        overlaps += values(results, case, imp.name, "overlaps")
            .iter()
            .flatten()
            .sum::<f64>();
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            imp.name,
            r("p50"),
            r("p99"),
            num(m("p50")),
            num(m("p99")),
            r("sent_p50"),
            r("sent_p99"),
            num(m("sent_p50")),
            num(m("sent_p99")),
            num(m("release_p50")),
            num(m("n")),
            percent(m("reacquired")),
            num(m("grants")),
        );
    }
    let _ = writeln!(
        out,
        "\nA negative time means the next holder's acquire returned before the releaser's \
         release call did (the releaser's thread had not run yet); no ratio is shown where \
         either figure is not positive. The release call's own time (from sending the \
         release to the call returning, over the same hand-offs) says how much of the time \
         from release sent the figure from release confirmed leaves out: a releaser whose \
         call returns later makes that figure smaller without the waiter being any faster. Where the releaser re-acquired nearly every grant, \
         the few hand-offs are those where a waiter's retry happened to come just after a \
         release: their times say nothing of how long the waiters waited (until the turn \
         ended, mostly). Grants acquired before the previous holder had sent its release \
         (mutual exclusion broken, by the shared clock): {overlaps} in all runs."
    );
    implementations(out, results, case);
    out.push_str(
        "\nEvery round's hand-off p50 from release confirmed (× the baseline run next to it; \
         its figure vs the baseline's, in µs):\n",
    );
    rounds_table(out, results, case, "p50", "µs");
    out.push_str("\nEvery round's hand-off p99 from release confirmed (the same way):\n");
    rounds_table(out, results, case, "p99", "µs");
    out.push_str("\nEvery round's share of grants that went back to the releaser:\n");
    rounds_table(out, results, case, "reacquired", "");
    problems(out, results, case);
}

fn slow_case(out: &mut String, results: &Results, case: Section) {
    out.push_str(
        "\n| implementation | acquired | acquire p50 × baseline | acquire p50 ms \
         | failed attempt p50 ms |\n|---|---|---|---|---|\n",
    );
    for imp in measured(results, case) {
        let sum = |metric: &str| -> f64 {
            values(results, case, imp.name, metric)
                .iter()
                .flatten()
                .sum()
        };
        let (ok, attempts) = (sum("ok"), sum("attempts"));
        let acquired = if attempts > 0.0 {
            format!("{ok:.0} of {attempts:.0} ({:.0} %)", 100.0 * ok / attempts)
        } else {
            "—".into()
        };
        let _ = writeln!(
            out,
            "| `{}` | {acquired} | {} | {} | {} |",
            imp.name,
            ratio(med(&ratios(results, case, imp, "acquire_ms_p50"))),
            num(med(&values(results, case, imp.name, "acquire_ms_p50"))),
            num(med(&values(results, case, imp.name, "failed_ms_p50"))),
        );
    }
    implementations(out, results, case);
    out.push_str(
        "\nEvery round's acquire p50 over the attempts that acquired (× the baseline run next \
         to it; its figure vs the baseline's, in ms):\n",
    );
    rounds_table(out, results, case, "acquire_ms_p50", "ms");
    out.push_str("\nEvery round's success rate:\n");
    rounds_table(out, results, case, "success", "");
    problems(out, results, case);
}

fn idle_case(out: &mut String, results: &Results, case: Section) {
    out.push_str(
        "\n| implementation | commands per s | per waiter per s | busiest commands (per s) \
         | a freed key's waiter held it after (ms) |\n|---|---|---|---|---|\n",
    );
    for imp in measured(results, case) {
        let mut per_command: BTreeMap<String, Vec<Option<f64>>> = BTreeMap::new();
        for run in runs(results, case, imp.name) {
            if let Some(f) = &run.figures {
                for (k, v) in f {
                    if let Some(name) = k.strip_prefix("cmd.") {
                        per_command
                            .entry(name.to_owned())
                            .or_default()
                            .push(Some(*v));
                    }
                }
            }
        }
        let mut busiest: Vec<(String, f64)> = per_command
            .into_iter()
            .filter_map(|(k, v)| med(&v).map(|m| (k, m)))
            .collect();
        busiest.sort_by(|a, b| b.1.total_cmp(&a.1));
        let busiest: Vec<String> = busiest
            .iter()
            .take(4)
            .map(|(k, v)| format!("{k} {}", num(Some(*v))))
            .collect();
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} |",
            imp.name,
            num(med(&values(results, case, imp.name, "per_s"))),
            num(med(&values(results, case, imp.name, "per_waiter_s"))),
            if busiest.is_empty() {
                "none".to_owned()
            } else {
                busiest.join(", ")
            },
            num(med(&values(results, case, imp.name, "wake_ms"))),
        );
    }
    implementations(out, results, case);
    out.push_str("\nEvery round's commands per second:\n");
    rounds_table(out, results, case, "per_s", "/s");
    problems(out, results, case);
}

/// One target: `name`'s median per-round ratio of `metric` in `sec` (or
/// its median share, for a share), against `bound`.
fn target(
    out: &mut String,
    results: &Results,
    (sec, name, metric): (Section, &str, &str),
    what: &str,
    bound: f64,
) {
    let Some(imp) = sec.find(name) else { return };
    if runs(results, sec, name).is_empty() {
        return;
    }
    let share = metric == "reacquired";
    let measured = if share {
        med(&values(results, sec, name, metric))
    } else {
        med(&ratios(results, sec, imp, metric))
    };
    let verdict = match measured {
        Some(m) if m <= bound => "met",
        Some(_) => "not met",
        None => "not measured",
    };
    let shown = if share {
        percent(measured)
    } else {
        ratio(measured)
    };
    let _ = writeln!(
        out,
        "| {what} ({}) | {shown} | {verdict} |",
        sec.cpus.label()
    );
}

pub(crate) fn render(options: &Options, results: &Results, info: &RunInfo) -> String {
    let s = &options.sizes;
    let mut out = String::new();
    let _ = write!(
        out,
        "## How the figures were taken\n\n\
         - {} rounds{}. In each round every implementation of every case ran once, in a process \
         of its own, paired with a run of its raw baseline in another process: both set up, \
         then took {} turns each (the hand-off {}), one process at a time, in the order \
         ABBA…, so that both were measured over the same stretches of time and never at once. \
         The pairs ran in an order rotated by one place each round; a baseline thus ran once \
         for each implementation compared with it.\n\
         - Placement, so that no run depends on where the scheduler happens to put it (on \
         this kind of machine a process that talks to a local server lands either on the \
         server's CPU or on another, and stays there, which can change a round trip \
         eightfold): each section says whether the servers and the measured processes were \
         pinned to one CPU together (round trips cost CPU time only: client-side overhead at \
         its largest) or to different CPUs (every round trip crosses CPUs, as a network hop \
         would; a measured process's own threads share its CPUs). {} CPUs here.\n\
         - Five `redis-server` {} on loopback, started by the program (no persistence), the same \
         for every implementation; `FLUSHALL` before each pair. Case 4 reaches them through five \
         proxies in the driver that delay every byte 10 ms each way (a 20 ms round trip).\n\
         - A ratio is a figure divided by that of the baseline run paired with it; the tables \
         show the median of those per-round ratios and the median over all \
         runs of the absolute figure. A dash marks a figure not measured, or a ratio of \
         figures that are not both positive.\n\
         - Sizes: {} pairs per run (case 1), {} (case 2), each after a tenth as many untimed; \
         {} contenders for {} ms holding {} ms (case 3); {} attempts per run after 2 untimed \
         (case 4); {} waiters counted over {} ms (case 5).\n\
         - Wall time of the run: {:.0} s.\n",
        s.rounds,
        if options.quick { " (`--quick`)" } else { "" },
        s.blocks,
        s.blocks_for(Case::Handoff),
        info.cpus,
        info.redis_version,
        s.pairs,
        s.redlock_pairs,
        s.contenders,
        s.handoff.as_millis(),
        s.hold.as_millis(),
        s.slow_attempts,
        s.waiters,
        s.idle_window.as_millis(),
        info.wall.as_secs_f64(),
    );
    let sections = Section::all(&options.cases, info.cpus);
    out.push_str("\n## Targets\n\n| target | measured | |\n|---|---|---|\n");
    let targets: [(Case, &str, &str, &str, f64); 22] = [
        (
            Case::Single,
            "lock",
            "p50",
            "`Lock::try_acquire` + release p50 ≤ 1.05× the raw pair",
            1.05,
        ),
        (
            Case::Single,
            "lock-wait",
            "p50",
            "`Lock::acquire` + release p50 ≤ 1.05× the raw pair",
            1.05,
        ),
        (
            Case::Single,
            "fenced",
            "p50",
            "`FencedLock::try_acquire` + release p50 ≤ 1.05× the raw fenced pair",
            1.05,
        ),
        (
            Case::Single,
            "fenced-wait",
            "p50",
            "`FencedLock::acquire` + release p50 ≤ 1.05× the raw fenced pair",
            1.05,
        ),
        (
            Case::Single,
            "read-wait",
            "p50",
            "`ReadLease::acquire` + release p50 ≤ 1.05× the raw read pair",
            1.05,
        ),
        (
            Case::Single,
            "write-wait",
            "p50",
            "`WriteLease::acquire` + release p50 ≤ 1.05× the raw write pair",
            1.05,
        ),
        (
            Case::Single,
            "permit-wait",
            "p50",
            "`Semaphore::acquire` + release p50 ≤ 1.05× the raw permit pair",
            1.05,
        ),
        (
            Case::Single,
            "lock",
            "cpu",
            "`Lock::try_acquire` + release client CPU ≤ 1.2× the raw pair's",
            1.2,
        ),
        (
            Case::Single,
            "lock-wait",
            "cpu",
            "`Lock::acquire` + release client CPU ≤ 1.2× the raw pair's",
            1.2,
        ),
        (
            Case::Single,
            "fenced",
            "cpu",
            "`FencedLock::try_acquire` + release client CPU ≤ 1.2× the raw fenced pair's",
            1.2,
        ),
        (
            Case::Single,
            "fenced-wait",
            "cpu",
            "`FencedLock::acquire` + release client CPU ≤ 1.2× the raw fenced pair's",
            1.2,
        ),
        (
            Case::Single,
            "read-wait",
            "cpu",
            "`ReadLease::acquire` + release client CPU ≤ 1.2× the raw read pair's",
            1.2,
        ),
        (
            Case::Single,
            "write-wait",
            "cpu",
            "`WriteLease::acquire` + release client CPU ≤ 1.2× the raw write pair's",
            1.2,
        ),
        (
            Case::Single,
            "permit-wait",
            "cpu",
            "`Semaphore::acquire` + release client CPU ≤ 1.2× the raw permit pair's",
            1.2,
        ),
        (
            Case::Redlock,
            "group",
            "p50",
            "`RedlockGroup` over 5 local nodes p50 ≤ 1.05× the raw quorum workers",
            1.05,
        ),
        (
            Case::Handoff,
            "lock",
            "p99",
            "hand-off p99 ≤ 1.2× the raw tracking waiter, a coordinator per contender",
            1.2,
        ),
        (
            Case::Handoff,
            "lock",
            "sent_p99",
            "hand-off p99 from the release sent ≤ 1.2× the raw tracking waiter's, a coordinator per contender",
            1.2,
        ),
        (
            Case::Handoff,
            "lock",
            "reacquired",
            "the releaser re-acquires ≤ 1 % of grants, a coordinator per contender (as between processes)",
            0.01,
        ),
        (
            Case::Handoff,
            "lock-shared",
            "p99",
            "hand-off p99 ≤ 1.2× the raw tracking waiter, one coordinator (one process)",
            1.2,
        ),
        (
            Case::Handoff,
            "lock-shared",
            "sent_p99",
            "hand-off p99 from the release sent ≤ 1.2× the raw tracking waiter's, one coordinator (one process)",
            1.2,
        ),
        (
            Case::Handoff,
            "lock-shared",
            "reacquired",
            "the releaser re-acquires ≤ 1 % of grants, one coordinator (one process)",
            0.01,
        ),
        (
            Case::Handoff,
            "lock-fifo",
            "reacquired",
            "`Fairness::Fifo`: 0 % of grants out of turn (back to the releaser while others queued)",
            0.0,
        ),
    ];
    for (case, name, metric, what, bound) in targets {
        for &sec in sections.iter().filter(|sec| sec.case == case) {
            target(&mut out, results, (sec, name, metric), what, bound);
        }
    }
    for &case in &sections {
        let cpus = case.cpus.label();
        match case.case {
            Case::Single => {
                let _ = writeln!(
                    out,
                    "\n## 1. Uncontended, one node ({cpus})\n\n\
                     {} acquire + release pairs per run on one key, one after another; p50 and \
                     p99 of the pair's time.",
                    s.pairs
                );
                latency_case(&mut out, results, case, false);
            }
            Case::Redlock => {
                let _ = writeln!(
                    out,
                    "\n## 2. Uncontended Redlock, 5 local nodes ({cpus})\n\n\
                     {} acquire + release pairs per run on one key over the five servers \
                     directly; p50 and p99 of the pair's time, and the acquire's p50.",
                    s.redlock_pairs
                );
                latency_case(&mut out, results, case, true);
            }
            Case::Handoff => {
                let _ = writeln!(
                    out,
                    "\n## 3. Hand-off between {} contenders ({cpus})\n\n\
                     One key on one server; {} contenders, each a thread with its own client \
                     (coordinator, manager or connections) in one process, so that every wake-up \
                     goes through Redis as it would between processes while all grants are \
                     stamped on one clock. In each of {} turns of {} ms, each contender loops: \
                     its library's blocking acquire, hold {} ms, release, and at once acquire \
                     again (grants after the turn's end, taken while the others leave, are left \
                     out). A hand-off is the time from the releaser's release returning to the \
                     next holder's acquire returning, for a grant that went to a contender \
                     already waiting; a grant that went back to the releaser counts as \
                     re-acquired. How often that happens, and how late the woken waiters run, \
                     depends on where the threads run and how busy the machine is.",
                    s.contenders,
                    s.contenders,
                    s.blocks_for(Case::Handoff),
                    (s.handoff / s.blocks_for(Case::Handoff) as u32).as_millis(),
                    s.hold.as_millis()
                );
                handoff_case(&mut out, results, case);
            }
            Case::Slow => {
                let _ = writeln!(
                    out,
                    "\n## 4. Redlock over 20 ms links ({cpus})\n\n\
                     Five nodes, each behind a proxy that delays 10 ms each way. {} single \
                     acquire calls per run, each on a fresh key (released when acquired); the \
                     acquire's p50 over the calls that acquired, the share that did, and how \
                     long failed calls took.",
                    s.slow_attempts
                );
                slow_case(&mut out, results, case);
            }
            Case::Idle => {
                let _ = writeln!(
                    out,
                    "\n## 5. Idle cost of {} blocked waiters ({cpus})\n\n\
                     One held key per waiter (held for 10 minutes), one waiter each, all in one \
                     process; once every waiter has made the attempts before its sleep and 500 ms have \
                     passed, the commands Redis ran over {} ms (`INFO commandstats`, `INFO` left \
                     out; commands run inside scripts count as Redis counts them). A waiter woken \
                     only by changes costs nothing here, so there is no ratio: the floor is 0. \
                     A run fails if any waiter stopped waiting; after the window one held key \
                     is deleted and the time until its waiter holds it is shown.",
                    s.waiters,
                    s.idle_window.as_millis()
                );
                idle_case(&mut out, results, case);
            }
        }
    }
    out
}
