//! Memory does not grow with completed leases. Alone in its test binary, so
//! that the resident set it measures is its own work's and the harness's only
//! (beside other tests in one process, their allocations land in its window).

mod support;
use support::ms;

use std::time::Duration;

use respire_coordination::ReleaseOutcome;
use support::{coordinator, shared_server, unique_prefix};

/// Resident set size of this process.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn e_memory_does_not_grow_with_completed_leases() {
    let cycles: usize = std::env::var("RESPIRE_MEMORY_CYCLES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(30_000);
    let prefix = unique_prefix("e");
    let coord = coordinator(&shared_server().url(), &prefix, ms(500));
    let lock = coord.lock("job").unwrap();
    let hour = Duration::from_secs(3_600);
    let cycle = |i: usize| {
        if i.is_multiple_of(2) {
            let g = lock.try_acquire(hour).unwrap().unwrap();
            // Watched by the renewal thread: an entry in its timer heap.
            let _ = g.lost_signal();
            assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
        } else {
            // A fence counter of its own each time: the fence book is bounded.
            let f = coord
                .fenced_lock(&format!("{{f{i}}}:lease"), &format!("{{f{i}}}:fence"))
                .unwrap();
            let g = f.try_acquire(hour).unwrap().unwrap();
            assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
        }
    };
    // Past the fence book's 10,000 remembered keys (every other cycle has a
    // counter of its own), so what follows must not grow at all.
    let warm = (cycles * 3 / 4).max(22_000.min(cycles));
    for i in 0..warm {
        cycle(i);
    }
    let before = rss();
    for i in warm..cycles {
        cycle(i);
    }
    let after = rss();
    let growth = after as i64 - before as i64;
    println!(
        "e: RSS {:.1} MiB after {warm} cycles, {:.1} MiB after {cycles}: {:+} KiB",
        before as f64 / 1048576.0,
        after as f64 / 1048576.0,
        growth / 1024
    );
    assert!(
        growth < 1_500_000,
        "RSS grew by {growth} bytes over {} cycles",
        cycles - warm
    );
}
