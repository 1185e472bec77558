//! A seeded, deterministic simulation of the lease core against model Redis
//! servers and a model network, in the manner of FoundationDB's and
//! TigerBeetle's simulators: every interleaving a seed reaches is replayed
//! exactly by that seed.
//!
//! What runs is the crate's own core — `LeaseCore` (through `LeaseCell`, with
//! its loss signal), the executor machine (`core::executor`: renewal claims
//! and their settlement, fences by confirmed kill, clean-ups, retirement at a
//! switch), the verification verdicts, the renewal `Schedule`, the quorum
//! `Tally` and the `FenceBook`; for Redlock, the node machines, the
//! extension's settle, the release's count, the acquire verdict, the restart
//! delay and the judgement of live leases on the watchers' news of a
//! restart (`core::redlock`); for single deployments, the acquire's bookkeeping
//! (`core::acquire`), each primitive's attempt as it goes on the wire and the
//! reading of its reply, the holder's own extension (`core::extend`: claim,
//! wait for an extension in flight, settle, once more after a replaced
//! server's answer) and the release's reading. Every server is a model
//! server (`model`) running the shipped Lua and commands: plain, fenced,
//! semaphore and reader/writer leases, sets of leases taken all or nothing,
//! and Redlock's scripts. What is still
//! written here rather than run from the runtime: the I/O around them (which
//! request goes on which connection, the Redlock connector's tries, the
//! fan-outs' waits), the acquire attempts' retry loop, and what the
//! transport does with a reply from a primary the process has retired (it
//! runs the call once more on the new one: for an extension the
//! guard then sends nothing and hands the answer to its machine as a replaced
//! server's, which is what the model does; any other such call is counted
//! here as unanswered, the worst case).
//! Around it: model servers (keys with an owner and an expiry on a server
//! clock that runs fast or slow within the drift factor, a fence counter, for
//! single deployments a replica fed by a lagging stream that is promoted at a
//! random instant, losing the unreplicated tail, while the old primary keeps
//! serving the connections made to it until each process learns of the
//! switch, which it goes through in the runtime's steps, each an event of its
//! own that others interleave with: the new primary published (new sends,
//! renewals included, go there, through a new executor), the old one retired
//! (its executor's machine frees the claims it held for kills once its last
//! request is answered), then `switched` with the new primary's id on every
//! live lease and a verification there; every extension is dispatched to the
//! id of the server it goes to, and not sent when its claim was given up
//! meanwhile; a primary's wall clock that jumps forward, read by `TIME` at
//! the head of every renewal pipeline and judged by the shipped
//! `ServerClock`, whose finding cuts the process's leases with
//! `clock_gained`; for Redlock, crashes and restarts with and without the
//! data) and a model network (delays, lost requests, lost replies, replies
//! arriving after the client gave up, order kept per connection only, killed
//! connections). In the single-deployment schedules of
//! `single_deployment_error_replies`, the server also answers attempts,
//! extensions and releases at random points with the error replies a
//! deployment sends instead of running a command (`MOVED`, `ASK`,
//! `TRYAGAIN`, `READONLY`, `NOSCRIPT`, `LOADING`), read as the shipped code
//! reads them (see `single::errors_case`), and every fault heals at a random
//! instant after the last one; in those of `redlock_error_replies`, the
//! nodes do so too (all but `NOSCRIPT`, see `group::errors_case`).

//! What runs only as scripts (`contracts`), not as the shipped code around
//! them: a FIFO lock (`Fairness::Fifo`), an election and a set of leases
//! taken in order (`MultiLease`'s `in_order`). The FIFO attempt
//! (`FifoSpec::attempt`) sends its script and reads its reply in one call on
//! a live connection, with no request and reading of its own to run here,
//! and its wait is the runtime's (`Order::Server`); the election's campaign
//! and observation, and `in_order`, are loops over a deployment's
//! connections and guards. Running them here would mean a second copy of
//! that code, so their scripts are checked against their contracts instead
//! (`fifo_acquire` and `fifo_withdraw`: nobody who queued is passed over, no
//! two holders; the election's: each term one above the last, so terms never
//! go back), and the leases of an in-order set are each a single lease's
//! acquire, which the single-deployment schedules run.

//! Invariants, checked after every instant:
//! - the bound of every guard not yet lost (`valid_until`, not only
//!   `is_lost()`, which comes a node timeout earlier) is at or before the
//!   server's real expiry of its lease (for Redlock: the moment fewer than a
//!   quorum of nodes still hold it), in client time; both change only at
//!   events, so this covers every instant, each expiry included. After a
//!   promotion, a lease is exempt until its process verified it on the new
//!   primary: until it learns of the switch, no client can know (counted as
//!   `exposed`). After a jump of its server's clock, likewise until its
//!   process read that server's `TIME` before and after the jump (the
//!   shipped reading must then have found it), or an extension of the lease
//!   sent after the jump was confirmed;
//! - for Redlock, no two guards are valid at once (a server a crash emptied
//!   counts as holding the lease while it is down and for the restart delay);
//! - a lease the server no longer holds for its owner (expired, deleted,
//!   someone else's) is already `is_lost()` for its guard;
//! - a watched guard's loss signal is closed once `is_lost()` is true;
//! - no fencing token reaches two owners while the counter is intact
//!   (checked against the checker's own record of tokens handed out), and a
//!   token not above one received before its attempt was sent is refused,
//!   while no other token is;
//! - liveness: on a calm schedule (nothing lost, nothing slow, no fault) a
//!   lease kept alive at a TTL keep-alive accepts is never lost;
//! - liveness after faults: in the schedules with injected error replies,
//!   once the last fault healed, every key is granted again within three of
//!   the schedule's longest TTL while its users ask for it
//!   (`single::REGRANT_TTLS` says why three);
//! - for single deployments, what an observer of every lease hears (the
//!   shipped calls where renewals are confirmed and losses settled): a loss
//!   reported at most once, never after the release, and by the end of the
//!   instant a watched lease is lost; a renewal's margin never past what the
//!   server had left when the extension was sent (`single/heard.rs`).
//!
//! `RESPIRE_SIM_CASES=n` sets the number of schedules per test (default
//! 60,000 single-deployment, 16,000 single-deployment ones each with a
//! failover or a clock jump or both, 3,000 single-deployment ones with
//! injected error replies, 40,000 Redlock, 1,000 Redlock ones with injected
//! error replies and 3,000 lease-set ones,
//! every command a script or command run on a model server); `RESPIRE_SIM_SEED=s` replays one,
//! `RESPIRE_SIM_BASE=b` starts the seeds elsewhere (for long runs in chunks),
//! and `RESPIRE_SIM_TRACE=1` prints its events. A failure prints its seed.

// Built for the fake deployment too; everything else here is the test-only
// simulation around it.
pub(crate) mod model;

#[cfg(test)]
mod contracts;
#[cfg(test)]
mod group;
#[cfg(test)]
mod single;

#[cfg(test)]
use std::cmp::Reverse;
#[cfg(test)]
use std::collections::BinaryHeap;
#[cfg(test)]
use std::time::{Duration, Instant};

#[cfg(test)]
/// splitmix64: small, fast, and the same everywhere.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

#[cfg(test)]
impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(crate) fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Uniform in `lo..=hi` microseconds.
    pub(crate) fn micros(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_micros(lo + self.below(hi.saturating_sub(lo) + 1))
    }
}

#[cfg(test)]
/// Events in time order; ties in the order they were pushed.
pub(crate) struct Queue<E> {
    heap: BinaryHeap<Reverse<(Duration, u64)>>,
    events: Vec<Option<E>>,
    seq: u64,
}

#[cfg(test)]
impl<E> Queue<E> {
    pub(crate) fn new() -> Self {
        Queue {
            heap: BinaryHeap::new(),
            events: Vec::new(),
            seq: 0,
        }
    }

    pub(crate) fn push(&mut self, at: Duration, e: E) {
        self.heap.push(Reverse((at, self.seq)));
        self.events.push(Some(e));
        self.seq += 1;
    }

    pub(crate) fn peek_time(&self) -> Option<Duration> {
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    pub(crate) fn pop(&mut self) -> Option<(Duration, E)> {
        let Reverse((at, seq)) = self.heap.pop()?;
        let e = self.events[seq as usize]
            .take()
            .expect("each event is popped once");
        Some((at, e))
    }
}

#[cfg(test)]
/// A model network's behaviour for one case.
#[derive(Clone, Debug)]
pub(crate) struct Net {
    /// One-way delay, microseconds.
    pub(crate) delay: (u64, u64),
    /// Chance a message is slow: delayed up to `slow` (past the node timeout).
    pub(crate) p_slow: f64,
    pub(crate) slow: Duration,
    pub(crate) p_lose_request: f64,
    pub(crate) p_lose_reply: f64,
}

#[cfg(test)]
impl Net {
    pub(crate) fn random(rng: &mut Rng, node_timeout: Duration) -> Net {
        let calm = rng.chance(0.3);
        let scale = if calm { 0.0 } else { 1.0 };
        Net {
            delay: (50, 100 + rng.below(3_000)),
            p_slow: scale * rng.unit() * 0.08,
            slow: node_timeout * 3,
            p_lose_request: scale * rng.unit() * 0.05,
            p_lose_reply: scale * rng.unit() * 0.05,
        }
    }

    /// Nothing lost, nothing slow.
    pub(crate) fn is_calm(&self) -> bool {
        self.p_slow == 0.0 && self.p_lose_request == 0.0 && self.p_lose_reply == 0.0
    }

    /// `None`: lost. Otherwise the one-way delay.
    pub(crate) fn hop(&self, rng: &mut Rng, lose: f64) -> Option<Duration> {
        if rng.chance(lose) {
            return None;
        }
        if rng.chance(self.p_slow) {
            let slow = self.slow.as_micros() as u64;
            return Some(rng.micros(self.delay.1, slow));
        }
        Some(rng.micros(self.delay.0, self.delay.1))
    }
}

#[cfg(test)]
/// How many schedules a test runs, and which seeds.
pub(crate) fn seeds(default_cases: u64, salt: u64) -> Vec<u64> {
    if let Ok(seed) = std::env::var("RESPIRE_SIM_SEED") {
        let seed = seed.trim();
        let parsed = seed
            .strip_prefix("0x")
            .map_or_else(|| seed.parse(), |hex| u64::from_str_radix(hex, 16));
        return vec![parsed.expect("RESPIRE_SIM_SEED is a number (decimal or 0x hex)")];
    }
    let cases = std::env::var("RESPIRE_SIM_CASES")
        .ok()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(default_cases);
    let base = std::env::var("RESPIRE_SIM_BASE")
        .ok()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0x5eed_0000_0000u64);
    (0..cases)
        .map(|i| base.wrapping_add(i).wrapping_mul(0x100_0000_01b3) ^ salt)
        .collect()
}

#[cfg(test)]
/// Runs `case` for every seed on all cores; panics with the first failing seed.
pub(crate) fn run(name: &str, seeds: Vec<u64>, case: fn(u64) -> Result<Stats, String>) -> Stats {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(seeds.len().max(1));
    let chunks: Vec<&[u64]> = seeds.chunks(seeds.len().div_ceil(threads).max(1)).collect();
    let results: Vec<Result<Stats, (u64, String)>> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .iter()
            .map(|chunk| {
                s.spawn(move || {
                    let mut total = Stats::default();
                    for &seed in *chunk {
                        match case(seed) {
                            Ok(stats) => total.add(&stats),
                            Err(why) => return Err((seed, why)),
                        }
                    }
                    Ok(total)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no panic"))
            .collect()
    });
    let mut total = Stats::default();
    for r in results {
        match r {
            Ok(stats) => total.add(&stats),
            Err((seed, why)) => panic!(
                "{name}: invariant violated with seed {seed:#x}: {why}\n\
                 replay with RESPIRE_SIM_SEED={seed:#x} cargo test --lib {name}"
            ),
        }
    }
    total.cases = seeds.len() as u64;
    eprintln!("{name}: {total:?}");
    total
}

#[cfg(test)]
/// What the schedules did, so a test can show they reached the interesting states.
#[derive(Clone, Debug, Default)]
pub(crate) struct Stats {
    pub(crate) cases: u64,
    pub(crate) events: u64,
    pub(crate) grants: u64,
    pub(crate) extensions: u64,
    pub(crate) unanswered: u64,
    pub(crate) fences: u64,
    pub(crate) losses: u64,
    pub(crate) takeovers: u64,
    pub(crate) regressions: u64,
    pub(crate) checks: u64,
    /// Promotions of a replica that lost the unreplicated tail.
    pub(crate) failovers: u64,
    /// Server processes killed and started again.
    pub(crate) restarts: u64,
    /// Checks skipped for a lease between a promotion and its verification
    /// on the new primary, where the model allows a wrong bound.
    pub(crate) exposed: u64,
    /// Extensions confirmed by a server that had been switched away from,
    /// sent again on the new one.
    pub(crate) reset_reruns: u64,
    /// Grants an attempt found already in place for its owner (an earlier
    /// attempt's whose reply was lost).
    pub(crate) repeated: u64,
    /// Attempts a server before Redis 7.0 refused (`SET` with `NX` and
    /// `GET`), sent again in the older form.
    pub(crate) older_set: u64,
    /// Renewals sent to a new primary after it was published and before
    /// the switch was applied to the leases.
    pub(crate) interleaved: u64,
    /// Extensions not sent because their claim was given up meanwhile.
    pub(crate) undispatched: u64,
    /// Forward jumps of a server's clock.
    pub(crate) clock_steps: u64,
    /// Readings of a server's clock that found it ran ahead and cut leases.
    pub(crate) clock_cuts: u64,
    /// Error replies the model servers gave instead of running a command,
    /// by kind: `MOVED`, `ASK`, `TRYAGAIN`, `READONLY`, `NOSCRIPT`,
    /// `LOADING` (see [`INJECTED_KINDS`]).
    pub(crate) injected: [u64; 6],
    /// Keys granted again after the faults of their schedule healed.
    pub(crate) regranted: u64,
}

#[cfg(test)]
/// The error replies the schedules inject, in the order of
/// [`Stats::injected`].
pub(crate) const INJECTED_KINDS: [&str; 6] = [
    "MOVED", "ASK", "TRYAGAIN", "READONLY", "NOSCRIPT", "LOADING",
];

#[cfg(test)]
impl Stats {
    fn add(&mut self, o: &Stats) {
        self.events += o.events;
        self.grants += o.grants;
        self.extensions += o.extensions;
        self.unanswered += o.unanswered;
        self.fences += o.fences;
        self.losses += o.losses;
        self.takeovers += o.takeovers;
        self.regressions += o.regressions;
        self.checks += o.checks;
        self.failovers += o.failovers;
        self.restarts += o.restarts;
        self.exposed += o.exposed;
        self.reset_reruns += o.reset_reruns;
        self.repeated += o.repeated;
        self.older_set += o.older_set;
        self.interleaved += o.interleaved;
        self.undispatched += o.undispatched;
        self.clock_steps += o.clock_steps;
        self.clock_cuts += o.clock_cuts;
        self.regranted += o.regranted;
        for (n, o) in self.injected.iter_mut().zip(o.injected) {
            *n += o;
        }
    }
}

#[cfg(test)]
/// The instant `at` after the simulation's start.
pub(crate) fn instant(origin: Instant, at: Duration) -> Instant {
    origin + at
}

#[cfg(test)]
/// The default number of schedules of each test in `cargo test`: 119,000 in
/// all, within the test suite's time budget (every command of each runs the
/// shipped Lua on a model server; a Redlock schedule, on three to five).
const SINGLE_CASES: u64 = 60_000;
#[cfg(test)]
const REDLOCK_CASES: u64 = 40_000;
#[cfg(test)]
/// Schedules of sets of leases taken all or nothing.
const SETS_CASES: u64 = 3_000;
#[cfg(test)]
/// Schedules each with a failover or a server clock step, or both.
const FAULTS_CASES: u64 = 16_000;
#[cfg(test)]
/// Single-deployment schedules whose server answers with injected error
/// replies, half of them with a failover or a clock step too.
const ERRORS_CASES: u64 = 3_000;
#[cfg(test)]
/// Redlock schedules whose nodes answer with injected error replies.
const REDLOCK_ERRORS_CASES: u64 = 1_000;

#[test]
fn redlock_leases() {
    let stats = run("redlock_leases", seeds(REDLOCK_CASES, 2), group::case);
    if stats.cases >= 1_000 {
        assert!(stats.grants > stats.cases, "{stats:?}");
        assert!(stats.unanswered > 0 && stats.fences > 0, "{stats:?}");
        assert!(stats.losses > 0 && stats.takeovers > 0, "{stats:?}");
        assert!(stats.restarts > 0, "{stats:?}");
    }
}

#[test]
fn single_deployment_lease_sets() {
    let stats = run(
        "single_deployment_lease_sets",
        seeds(SETS_CASES, 3),
        single::sets_case,
    );
    if stats.cases >= 1_000 {
        assert!(stats.grants > stats.cases, "{stats:?}");
        assert!(stats.unanswered > 0 && stats.checks > 0, "{stats:?}");
    }
}

#[test]
fn single_deployment_leases() {
    let stats = run(
        "single_deployment_leases",
        seeds(SINGLE_CASES, 1),
        single::case,
    );
    if stats.cases >= 1_000 {
        // The schedules reached the states that matter.
        assert!(stats.grants > stats.cases, "{stats:?}");
        assert!(stats.unanswered > 0 && stats.fences > 0, "{stats:?}");
        assert!(stats.losses > 0 && stats.regressions > 0, "{stats:?}");
        assert!(stats.failovers > 0 && stats.exposed > 0, "{stats:?}");
        assert!(stats.repeated > 0 && stats.older_set > 0, "{stats:?}");
    }
}

/// Seeds that once found a defect, run on every build.
#[test]
fn single_deployment_switches_and_clock_steps_found_before() {
    // A slow `TIME` reply hid a clock step when a reading was compared with
    // the one before it only.
    run(
        "single_deployment_switches_and_clock_steps_found_before",
        vec![0x5c13_0e0c_8174_60ce],
        single::faults_case,
    );
}

#[test]
fn single_deployment_switches_and_clock_steps() {
    let stats = run(
        "single_deployment_switches_and_clock_steps",
        seeds(FAULTS_CASES, 4),
        single::faults_case,
    );
    if stats.cases >= 1_000 {
        // Renewals reached a new primary between its publication and the
        // switch's application, extensions whose claim a switch gave up
        // were not sent, and clock jumps were found.
        assert!(stats.failovers > 0 && stats.interleaved > 0, "{stats:?}");
        assert!(stats.undispatched > 0, "{stats:?}");
        assert!(stats.clock_steps > 0 && stats.clock_cuts > 0, "{stats:?}");
    }
}

#[test]
fn single_deployment_error_replies() {
    let stats = run(
        "single_deployment_error_replies",
        seeds(ERRORS_CASES, 5),
        single::errors_case,
    );
    if stats.cases >= 1_000 {
        // Every kind of error reply was injected, and the schedules still
        // granted, renewed and lost leases around them.
        for (kind, n) in INJECTED_KINDS.iter().zip(stats.injected) {
            assert!(n > 0, "no {kind} injected: {stats:?}");
        }
        assert!(stats.grants > stats.cases && stats.losses > 0, "{stats:?}");
        assert!(stats.failovers > 0 && stats.clock_steps > 0, "{stats:?}");
        // Both keys of every schedule were granted again after its faults
        // healed (a schedule that did not fails on its own).
        assert_eq!(stats.regranted, 2 * stats.cases, "{stats:?}");
    }
}

#[test]
fn redlock_error_replies() {
    let stats = run(
        "redlock_error_replies",
        seeds(REDLOCK_ERRORS_CASES, 6),
        group::errors_case,
    );
    if stats.cases >= 1_000 {
        // Every kind but `NOSCRIPT` (see `group::errors_case`) was injected,
        // and leases were still granted, lost and taken over around them.
        for (kind, n) in INJECTED_KINDS.iter().zip(stats.injected) {
            assert!(
                n > 0 || *kind == "NOSCRIPT",
                "no {kind} injected: {stats:?}"
            );
        }
        assert!(stats.grants > stats.cases && stats.losses > 0, "{stats:?}");
        assert!(stats.takeovers > 0 && stats.restarts > 0, "{stats:?}");
    }
}
