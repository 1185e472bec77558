//! 10,000 kept-alive leases on one coordinator for 20 s (ten renewal rounds;
//! `RESPIRE_SCALE_SECS=60` holds them longer): a constant, small number of
//! threads, no lease lost, renewals pipelined. Alone in its test binary so the
//! process's thread count is the crate's and the harness's only.

mod support;

use std::time::{Duration, Instant};

use respire_coordination::Coordinator;
use support::TestServer;

const LEASES: usize = 10_000;
const TTL: Duration = Duration::from_secs(4);
/// How long the leases are held: `RESPIRE_SCALE_SECS`, 20 s by default.
fn hold() -> Duration {
    let secs = std::env::var("RESPIRE_SCALE_SECS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(20);
    Duration::from_secs(secs)
}

/// Names of this process's threads that the crate started.
fn crate_threads() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .filter(|n| n.starts_with("respire-"))
        .collect();
    names.sort();
    names
}

/// User + system CPU time of this process.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    // Fields 14 and 15 of stat(5), counted after the command name.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

#[test]
fn ten_thousand_kept_alive_leases_on_three_threads_at_most() {
    let server = TestServer::start();
    let coord = Coordinator::builder(&server.url())
        .node_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let locks: Vec<_> = (0..LEASES)
        .map(|i| coord.lock(&format!("lease:{i}")).unwrap())
        .collect();
    let guards: Vec<_> = locks
        .iter()
        .map(|l| l.try_acquire(TTL).unwrap().expect("free key"))
        .collect();
    // Nobody keeps a lease alive or watches its signal yet: no thread at all.
    assert_eq!(crate_threads(), Vec::<String>::new());
    let renewals: Vec<_> = guards.iter().map(|g| g.keep_alive().unwrap()).collect();
    // The renewal thread (no I/O) starts with the first keep-alive; the
    // server's executor (one connection) with the first renewal there, a TTL
    // half later. A new thread names itself once it runs: wait for the name.
    support::wait_until(TTL / 4, "the renewal thread and no other", || {
        crate_threads() == ["respire-renewal"]
    });
    support::wait_until(TTL, "the first renewals", || {
        coord.renewal_stats().renewals > 0
    });
    let threads_at_start = crate_threads();
    assert_eq!(threads_at_start, ["respire-io", "respire-renewal"]);
    let stats_at_start = coord.renewal_stats();
    let cpu_at_start = cpu_time();
    let started = Instant::now();

    let mut max_threads = threads_at_start.len();
    let hold = hold();
    while started.elapsed() < hold {
        std::thread::sleep(Duration::from_secs(1));
        let threads = crate_threads();
        max_threads = max_threads.max(threads.len());
        assert!(threads.len() <= 3, "threads: {threads:?}");
        let lost = guards.iter().filter(|g| g.is_lost()).count();
        assert_eq!(lost, 0, "{lost} leases lost after {:?}", started.elapsed());
    }

    let cpu = cpu_time() - cpu_at_start;
    let stats = coord.renewal_stats();
    let round_trips = stats.round_trips - stats_at_start.round_trips;
    let renewed = stats.renewals - stats_at_start.renewals;
    assert_eq!(stats.losses, 0);
    assert_eq!(stats.failures, 0);
    // Every lease renews at half its TTL: at least hold / 2 s − 1 times each.
    let expected = (LEASES as u64) * (hold.as_secs() / (TTL.as_secs() / 2) - 1);
    assert!(
        renewed >= expected,
        "only {renewed} renewals, expected {expected}"
    );
    assert!(
        round_trips * 50 < renewed,
        "renewals are not pipelined: {round_trips} round trips for {renewed} renewals"
    );
    assert_eq!(
        crate_threads(),
        threads_at_start,
        "the crate's threads changed"
    );
    for g in &guards {
        assert!(g.verify_still_held().unwrap().is_some());
    }
    println!(
        "{LEASES} leases for {hold:?}: threads {threads_at_start:?} (max {max_threads}), \
         {renewed} renewals in {round_trips} round trips ({:.0} renewals per round trip), \
         CPU {cpu:?} for the whole test process",
        renewed as f64 / round_trips as f64
    );
    drop(renewals);

    // The first wait starts the invalidation subscriber: three threads in all.
    let waiter = locks[0]
        .acquire_timeout(TTL, Duration::from_millis(20))
        .unwrap();
    assert!(waiter.is_none(), "the lock is still held");
    let threads = crate_threads();
    assert_eq!(
        threads,
        ["respire-io", "respire-renewal", "respire-tracker"]
    );

    // All stop once the coordinator and every guard are gone.
    drop(guards);
    drop(locks);
    drop(coord);
    support::wait_until(
        Duration::from_secs(5),
        "the crate's threads to stop",
        || crate_threads().is_empty(),
    );
}
