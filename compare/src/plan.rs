//! What is measured: the cases, the implementations in each, which raw
//! baseline each is divided by, and the sizes of a run.

use std::collections::BTreeMap;
use std::time::Duration;

/// One of the five situations the benchmark compares implementations in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Case {
    /// Uncontended acquire + release on one node.
    Single,
    /// Uncontended Redlock acquire + release over five local nodes.
    Redlock,
    /// Hand-off of one key between contenders.
    Handoff,
    /// Redlock over five nodes, each behind a 20 ms round trip.
    Slow,
    /// Commands per second while waiters are blocked on held keys.
    Idle,
}

impl Case {
    pub(crate) const ALL: [Case; 5] = [
        Case::Single,
        Case::Redlock,
        Case::Handoff,
        Case::Slow,
        Case::Idle,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Case::Single => "single",
            Case::Redlock => "redlock",
            Case::Handoff => "handoff",
            Case::Slow => "slow",
            Case::Idle => "idle",
        }
    }

    pub(crate) fn parse(name: &str) -> Option<Case> {
        Case::ALL.into_iter().find(|c| c.name() == name)
    }

    /// The implementations run in this case, baselines first.
    pub(crate) fn impls(self) -> &'static [Impl] {
        match self {
            Case::Single => SINGLE,
            Case::Redlock => REDLOCK,
            Case::Handoff => HANDOFF,
            Case::Slow => SLOW,
            Case::Idle => IDLE,
        }
    }

    pub(crate) fn find(self, name: &str) -> Option<&'static Impl> {
        self.impls().iter().find(|i| i.name == name)
    }
}

/// How the servers and the measured processes share the CPUs. On a small
/// virtual machine the scheduler otherwise puts a process that talks to a
/// local server either on the server's CPU (a round trip of ~8 µs here) or
/// on another (~60 µs: the other CPU has to wake up) and keeps it there for
/// its life, so that two runs of the same code can differ eightfold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Cpus {
    /// Servers and measured processes all pinned to CPU 0: round trips cost
    /// CPU time only, so client-side overhead shows at its largest.
    One,
    /// Servers pinned to the last CPU, measured processes to the others:
    /// every round trip crosses CPUs, as a network hop would.
    Two,
}

impl Cpus {
    /// What the report calls it.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Cpus::One => "servers and client on one CPU",
            Cpus::Two => "servers and client on different CPUs",
        }
    }

    /// `taskset` lists for (servers, measured processes) on a machine with
    /// `cpus` CPUs.
    pub(crate) fn lists(self, cpus: usize) -> (String, String) {
        match self {
            Cpus::Two if cpus >= 2 => {
                let last = cpus - 1;
                let rest = if last == 1 {
                    "0".to_owned()
                } else {
                    format!("0-{}", last - 1)
                };
                (last.to_string(), rest)
            }
            _ => ("0".to_owned(), "0".to_owned()),
        }
    }
}

/// One case under one placement: one section of the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Section {
    pub(crate) case: Case,
    pub(crate) cpus: Cpus,
}

impl Section {
    pub(crate) fn impls(self) -> &'static [Impl] {
        self.case.impls()
    }

    pub(crate) fn find(self, name: &str) -> Option<&'static Impl> {
        self.case.find(name)
    }

    /// The sections a run of `cases` has on a machine with `cpus` CPUs: the
    /// uncontended cases and the hand-off under both placements (one shows
    /// client-side overhead at its largest, the other with cross-CPU round
    /// trips), the others with the servers on their own CPU; everything on
    /// one CPU when there is only one.
    pub(crate) fn all(cases: &[Case], cpus: usize) -> Vec<Section> {
        let mut sections = Vec::new();
        for &case in cases {
            let both = matches!(case, Case::Single | Case::Redlock | Case::Handoff);
            if cpus < 2 {
                sections.push(Section {
                    case,
                    cpus: Cpus::One,
                });
                continue;
            }
            if both {
                sections.push(Section {
                    case,
                    cpus: Cpus::One,
                });
            }
            sections.push(Section {
                case,
                cpus: Cpus::Two,
            });
        }
        sections
    }
}

/// One implementation of one case.
#[derive(Debug)]
pub(crate) struct Impl {
    /// Its name on the child's command line.
    pub(crate) name: &'static str,
    /// What the report calls it (markdown).
    pub(crate) label: &'static str,
    /// The implementation of the same case it is divided by; itself for a
    /// baseline; `None` when no ratio is meaningful.
    pub(crate) baseline: Option<&'static str>,
}

const fn imp(name: &'static str, label: &'static str, baseline: Option<&'static str>) -> Impl {
    Impl {
        name,
        label,
        baseline,
    }
}

const SINGLE: &[Impl] = &[
    imp(
        "raw-pair",
        "raw pair: `SET NX PX` + compare-and-delete `EVALSHA`, one connection",
        Some("raw-pair"),
    ),
    imp(
        "raw-fenced",
        "raw fenced pair: this crate's fenced acquire and release scripts by `EVALSHA`, one connection",
        Some("raw-pair"),
    ),
    imp(
        "raw-read",
        "raw read pair: this crate's read acquire (writer preference) and read release scripts by `EVALSHA`, one connection",
        Some("raw-pair"),
    ),
    imp(
        "raw-write",
        "raw write pair: this crate's write acquire (no intent) and lease release scripts by `EVALSHA`, one connection",
        Some("raw-pair"),
    ),
    imp(
        "raw-permit",
        "raw permit pair: this crate's semaphore acquire (capacity 4) and release scripts by `EVALSHA`, one connection",
        Some("raw-pair"),
    ),
    imp(
        "lock",
        "**this crate, `Lock::try_acquire` + `release`**",
        Some("raw-pair"),
    ),
    imp(
        "lock-wait",
        "**this crate, `Lock::acquire(ttl, &cancel)` + `release`** (the waiting verb, finding the lock free)",
        Some("raw-pair"),
    ),
    imp(
        "lock-observed",
        "**this crate, `Lock::try_acquire` + `release` with an observer** that does nothing (`CoordinatorBuilder::observer`): the cost of the event calls themselves; `lock` is the same without one",
        Some("raw-pair"),
    ),
    imp(
        "fenced",
        "**this crate, `FencedLock::try_acquire` + `release`**",
        Some("raw-fenced"),
    ),
    imp(
        "fenced-wait",
        "**this crate, `FencedLock::acquire(ttl, &cancel)` + `release`**",
        Some("raw-fenced"),
    ),
    imp(
        "read",
        "**this crate, `ReadLease::try_acquire` + `release`**",
        Some("raw-read"),
    ),
    imp(
        "read-wait",
        "**this crate, `ReadLease::acquire(ttl, &cancel)` + `release`**",
        Some("raw-read"),
    ),
    imp(
        "write",
        "**this crate, `WriteLease::try_acquire` + `release`**",
        Some("raw-write"),
    ),
    imp(
        "write-wait",
        "**this crate, `WriteLease::acquire(ttl, &cancel)` + `release`**",
        Some("raw-write"),
    ),
    imp(
        "permit",
        "**this crate, `Semaphore::try_acquire` + `release`** (capacity 4)",
        Some("raw-permit"),
    ),
    imp(
        "permit-wait",
        "**this crate, `Semaphore::acquire(ttl, &cancel)` + `release`** (capacity 4)",
        Some("raw-permit"),
    ),
    imp(
        "rlock",
        "`rlock` 0.2 sync, `try_acquire_mutex_with_options`, renewal disabled",
        Some("raw-pair"),
    ),
    imp(
        "rlock-default",
        "`rlock` 0.2 sync, `try_acquire_mutex`, default options (a renewal thread per guard)",
        Some("raw-pair"),
    ),
    imp(
        "rslock",
        "`rslock` 0.10 on tokio, one node, `lock` + `unlock`",
        Some("raw-pair"),
    ),
    imp(
        "redlock",
        "`redlock` 2 sync, one node, `lock` + `unlock` (a new connection per command)",
        Some("raw-pair"),
    ),
];

const REDLOCK: &[Impl] = &[
    imp(
        "raw-quorum",
        "raw quorum workers: a thread and a connection per node, return at quorum",
        Some("raw-quorum"),
    ),
    imp(
        "group",
        "**this crate, `RedlockGroup`, default options**",
        Some("raw-quorum"),
    ),
    imp(
        "rslock",
        "`rslock` 0.10 on tokio, 5 nodes",
        Some("raw-quorum"),
    ),
    imp(
        "redlock",
        "`redlock` 2 sync, 5 nodes (one after another, a new connection per command)",
        Some("raw-quorum"),
    ),
];

const HANDOFF: &[Impl] = &[
    imp(
        "raw-tracking",
        "raw tracking waiter: `SET NX PX` + `PTTL`, woken by `CLIENT TRACKING` invalidations",
        Some("raw-tracking"),
    ),
    imp(
        "lock",
        "**this crate, `Lock::acquire`** (woken by invalidations), one coordinator per contender (every wake-up goes through Redis, as between processes)",
        Some("raw-tracking"),
    ),
    imp(
        "lock-shared",
        "**this crate, `Lock::acquire`**, one coordinator shared by the contenders (the threads of one process: a release wakes the first local waiter, the releaser's next acquire queues behind it)",
        Some("raw-tracking"),
    ),
    imp(
        "lock-fifo",
        "**this crate, `Lock::acquire` with `Fairness::fifo()`**, one coordinator per contender (a queue on the server)",
        Some("raw-tracking"),
    ),
    imp(
        "rlock",
        "`rlock` 0.2 sync, `acquire_mutex_with_options` (polls every 100 ms), renewal disabled",
        Some("raw-tracking"),
    ),
    imp(
        "rslock",
        "`rslock` 0.10 on tokio, `acquire` (retries 0–200 ms apart)",
        Some("raw-tracking"),
    ),
    imp(
        "redlock",
        "`redlock` 2 sync, `acquire` (retries 0–200 ms apart)",
        Some("raw-tracking"),
    ),
];

const SLOW: &[Impl] = &[
    imp(
        "raw-quorum",
        "raw quorum workers, 200 ms node timeout",
        Some("raw-quorum"),
    ),
    imp(
        "group-default",
        "**this crate, `RedlockGroup`, `RedlockOptions::default()`** (50 ms node timeout)",
        Some("raw-quorum"),
    ),
    imp(
        "group-200ms",
        "**this crate, `RedlockGroup`, `node_timeout` 200 ms**",
        Some("raw-quorum"),
    ),
    imp(
        "rslock",
        "`rslock` 0.10 on tokio, 5 nodes, one `lock` call",
        Some("raw-quorum"),
    ),
    imp(
        "redlock",
        "`redlock` 2 sync, 5 nodes, one `lock` call (one node after another, a new connection per command, each with a `CLIENT SETINFO` round trip)",
        Some("raw-quorum"),
    ),
];

const IDLE: &[Impl] = &[
    imp(
        "lock",
        "**this crate, `Lock::acquire`**, one coordinator",
        None,
    ),
    imp(
        "rlock",
        "`rlock` 0.2 sync, `acquire_mutex_with_options`, renewal disabled, one manager",
        None,
    ),
    imp(
        "rslock",
        "`rslock` 0.10 on tokio, `acquire`, one lock manager",
        None,
    ),
];

/// `RedlockOptions::default()`'s node timeout.
const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(50);

/// The sizes of a run, passed to every child as `name=value` arguments.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Sizes {
    /// Alternations: every implementation of every case runs once per round.
    pub(crate) rounds: usize,
    /// How many turns an implementation and its baseline take, in lockstep,
    /// within one round (fewer in the hand-off; see [`Sizes::blocks_for`]).
    pub(crate) blocks: usize,
    /// Acquire + release pairs per child, single node.
    pub(crate) pairs: usize,
    /// Acquire + release pairs per child, Redlock over 5 local nodes.
    pub(crate) redlock_pairs: usize,
    /// The node timeout of the group and of the raw quorum workers over the
    /// 5 local nodes (`RedlockOptions::default()`'s; longer for a run under
    /// an instruction counter, whose round trips are slower).
    pub(crate) redlock_node_timeout: Duration,
    /// Contenders for the hand-off.
    pub(crate) contenders: usize,
    /// How long each hand-off child runs.
    pub(crate) handoff: Duration,
    /// How long a holder holds the key in the hand-off.
    pub(crate) hold: Duration,
    /// Acquire attempts per child over the 20 ms links.
    pub(crate) slow_attempts: usize,
    /// Blocked waiters for the idle count.
    pub(crate) waiters: usize,
    /// The window over which idle commands are counted.
    pub(crate) idle_window: Duration,
}

impl Sizes {
    pub(crate) fn full() -> Sizes {
        Sizes {
            rounds: 5,
            blocks: 20,
            pairs: 5_000,
            redlock_pairs: 2_000,
            redlock_node_timeout: DEFAULT_NODE_TIMEOUT,
            contenders: 8,
            handoff: Duration::from_secs(2),
            hold: Duration::from_millis(1),
            slow_attempts: 20,
            waiters: 1_000,
            idle_window: Duration::from_secs(3),
        }
    }

    pub(crate) fn quick() -> Sizes {
        Sizes {
            rounds: 2,
            blocks: 5,
            pairs: 500,
            redlock_pairs: 200,
            redlock_node_timeout: DEFAULT_NODE_TIMEOUT,
            contenders: 8,
            handoff: Duration::from_millis(500),
            hold: Duration::from_millis(1),
            slow_attempts: 4,
            waiters: 200,
            idle_window: Duration::from_secs(1),
        }
    }

    /// Every size as `(name, value)`; durations in milliseconds.
    pub(crate) fn to_pairs(&self) -> Vec<(&'static str, String)> {
        let ms = |d: Duration| d.as_millis().to_string();
        vec![
            ("rounds", self.rounds.to_string()),
            ("blocks", self.blocks.to_string()),
            ("pairs", self.pairs.to_string()),
            ("redlock-pairs", self.redlock_pairs.to_string()),
            ("redlock-node-timeout-ms", ms(self.redlock_node_timeout)),
            ("contenders", self.contenders.to_string()),
            ("handoff-ms", ms(self.handoff)),
            ("hold-ms", ms(self.hold)),
            ("slow-attempts", self.slow_attempts.to_string()),
            ("waiters", self.waiters.to_string()),
            ("idle-ms", ms(self.idle_window)),
        ]
    }

    /// Sets one size from its name; `Err` names what is wrong.
    pub(crate) fn set(&mut self, name: &str, value: &str) -> Result<(), String> {
        let count = || -> Result<usize, String> {
            match value.parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!(
                    "{name} needs a positive whole number, not {value:?}"
                )),
            }
        };
        let ms = || count().map(|n| Duration::from_millis(n as u64));
        match name {
            "rounds" => self.rounds = count()?,
            "blocks" => self.blocks = count()?,
            "pairs" => self.pairs = count()?,
            "redlock-pairs" => self.redlock_pairs = count()?,
            "redlock-node-timeout-ms" => self.redlock_node_timeout = ms()?,
            "contenders" => {
                self.contenders = count()?;
                if self.contenders < 2 {
                    return Err("contenders must be at least 2".into());
                }
            }
            "handoff-ms" => self.handoff = ms()?,
            "hold-ms" => self.hold = ms()?,
            "slow-attempts" => self.slow_attempts = count()?,
            "waiters" => self.waiters = count()?,
            "idle-ms" => self.idle_window = ms()?,
            _ => return Err(format!("unknown size {name:?}")),
        }
        Ok(())
    }
}

/// The shortest turn of the hand-off: shorter ones would cut the pollers'
/// waits (up to 200 ms) into pieces.
const MIN_HANDOFF_TURN: Duration = Duration::from_millis(200);

impl Sizes {
    /// How many turns `case` takes per run: `blocks`, except that a hand-off
    /// turn is at least 200 ms.
    pub(crate) fn blocks_for(&self, case: Case) -> usize {
        match case {
            Case::Handoff => {
                let most = (self.handoff.as_millis() / MIN_HANDOFF_TURN.as_millis()) as usize;
                self.blocks.min(most).max(1)
            }
            _ => self.blocks,
        }
    }

    /// How many of `total` operations each of `case`'s turns does.
    pub(crate) fn per_block(&self, case: Case, total: usize) -> usize {
        total.div_ceil(self.blocks_for(case))
    }
}

/// What one child measured: named figures.
pub(crate) type Figures = BTreeMap<String, f64>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_trip_through_arguments() {
        let mut sizes = Sizes::quick();
        let full = Sizes::full();
        for (name, value) in full.to_pairs() {
            sizes.set(name, &value).unwrap();
        }
        assert_eq!(sizes, full);
    }

    #[test]
    fn hand_off_turns_are_long_enough() {
        let mut sizes = Sizes::full();
        assert_eq!(sizes.blocks_for(Case::Single), 20);
        assert_eq!(sizes.blocks_for(Case::Handoff), 10);
        sizes.handoff = Duration::from_millis(100);
        assert_eq!(sizes.blocks_for(Case::Handoff), 1);
        assert_eq!(sizes.per_block(Case::Single, 5_001), 251);
    }

    #[test]
    fn placements() {
        assert_eq!(Cpus::Two.lists(2), ("1".to_owned(), "0".to_owned()));
        assert_eq!(Cpus::Two.lists(4), ("3".to_owned(), "0-2".to_owned()));
        assert_eq!(Cpus::Two.lists(1), ("0".to_owned(), "0".to_owned()));
        assert_eq!(Cpus::One.lists(4), ("0".to_owned(), "0".to_owned()));
        let two = Section::all(&Case::ALL, 2);
        assert_eq!(two.len(), 8);
        assert!(two.contains(&Section {
            case: Case::Handoff,
            cpus: Cpus::One
        }));
        assert!(two.contains(&Section {
            case: Case::Single,
            cpus: Cpus::One
        }));
        assert!(!two.contains(&Section {
            case: Case::Idle,
            cpus: Cpus::One
        }));
        assert!(
            Section::all(&Case::ALL, 1)
                .iter()
                .all(|s| s.cpus == Cpus::One)
        );
    }

    #[test]
    fn bad_sizes_are_refused() {
        let mut sizes = Sizes::full();
        assert!(sizes.set("rounds", "0").is_err());
        assert!(sizes.set("rounds", "x").is_err());
        assert!(sizes.set("contenders", "1").is_err());
        assert!(sizes.set("nonsense", "1").is_err());
    }

    #[test]
    fn every_baseline_is_an_implementation_of_its_case() {
        for case in Case::ALL {
            for i in case.impls() {
                if let Some(b) = i.baseline {
                    assert!(case.find(b).is_some(), "{} -> {b}", i.name);
                }
            }
        }
    }
}
