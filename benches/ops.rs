//! The cost of single operations against a local `redis-server`, next to the
//! raw round trip of `PING` measured in the same run: `try_acquire` + `release`
//! of a `Lock` and a `FencedLock` (two round trips each), `verify_still_held`
//! (one), and an uncontended `acquire_timeout` + `release` (two, plus the
//! waiter registry); the first three again with the longest holder identity a
//! lease records (`with_holder`), which goes out with every command. Then, on a primary with one replica, the fenced
//! `try_acquire` + `release` with the replication guard `Off` and in `Report`
//! mode (`WAIT` for the replica pipelined after every grant).
//!
//! After criterion's own report, prints each operation's median time per
//! iteration and its ratio to the `PING` round trip.

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{Criterion, black_box};
use respire_coordination::{Coordinator, Replication};

const TTL: Duration = Duration::from_secs(30);

/// Per-sample mean time per iteration, by benchmark name, for the ratios.
static SAMPLES: Mutex<Vec<(&'static str, f64)>> = Mutex::new(Vec::new());

/// Runs `op` as a criterion benchmark named `name`, keeping each sample's mean.
fn bench(c: &mut Criterion, name: &'static str, mut op: impl FnMut()) {
    c.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                op();
            }
            let elapsed = start.elapsed();
            let per_iter = elapsed.as_secs_f64() / iters as f64;
            SAMPLES.lock().unwrap().push((name, per_iter));
            elapsed
        });
    });
}

fn median_us(name: &str) -> Option<f64> {
    let mut v: Vec<f64> = SAMPLES
        .lock()
        .unwrap()
        .iter()
        .filter(|(n, _)| *n == name)
        .map(|(_, t)| *t * 1e6)
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

fn main() {
    let server = support::TestServer::start();
    let mut c = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();

    let mut raw = server.client();
    bench(&mut c, "raw PING round trip", || {
        let pong: String = redis::cmd("PING").query(&mut raw).unwrap();
        black_box(pong);
    });

    let coord = Coordinator::builder(&server.url())
        .key_prefix("bench:")
        .build()
        .unwrap();
    let lock = coord.lock("lock").unwrap();
    bench(&mut c, "Lock try_acquire + release", || {
        let guard = lock.try_acquire(TTL).unwrap().expect("uncontended");
        black_box(guard.release().unwrap());
    });

    let fenced = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    bench(&mut c, "FencedLock try_acquire + release", || {
        let guard = fenced.try_acquire(TTL).unwrap().expect("uncontended");
        black_box(guard.release().unwrap());
    });

    // The longest holder a lease records, in every command's owner value.
    let holder = "h".repeat(respire_coordination::MAX_HOLDER_LEN);
    let named = coord.lock("named").unwrap().with_holder(&holder).unwrap();
    bench(&mut c, "Lock try_acquire + release, holder", || {
        let guard = named.try_acquire(TTL).unwrap().expect("uncontended");
        black_box(guard.release().unwrap());
    });
    let named_fenced = coord
        .fenced_lock("{n}:lease", "{n}:fence")
        .unwrap()
        .with_holder(&holder)
        .unwrap();
    bench(&mut c, "FencedLock try_acquire + release, holder", || {
        let guard = named_fenced.try_acquire(TTL).unwrap().expect("uncontended");
        black_box(guard.release().unwrap());
    });
    let named_held = coord
        .lock("named-held")
        .unwrap()
        .with_holder(&holder)
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .unwrap();
    bench(&mut c, "verify_still_held, holder", || {
        black_box(named_held.verify_still_held().unwrap().expect("still held"));
    });
    drop(named_held);

    let held = coord
        .lock("held")
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .unwrap();
    bench(&mut c, "verify_still_held", || {
        black_box(held.verify_still_held().unwrap().expect("still held"));
    });
    drop(held);

    let waited = coord.lock("waited").unwrap();
    bench(&mut c, "uncontended acquire_timeout + release", || {
        let guard = waited
            .acquire_timeout(TTL, Duration::from_secs(1))
            .unwrap()
            .expect("uncontended");
        black_box(guard.release().unwrap());
    });

    // A primary with one replica, for the replication guard.
    let primary = support::TestServer::start();
    let replica = support::TestServer::builder()
        .args(["--replicaof", "127.0.0.1", &primary.port().to_string()])
        .start();
    support::wait_until(Duration::from_secs(30), "the replica in sync", || {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut replica.client())
            .unwrap_or_default();
        info.contains("master_link_status:up")
    });
    let off = Coordinator::builder(&primary.url())
        .key_prefix("bench:")
        .build()
        .unwrap();
    let off_lock = off.fenced_lock("{r}:lease", "{r}:fence").unwrap();
    bench(&mut c, "replicated: FencedLock, Off", || {
        let guard = off_lock.try_acquire(TTL).unwrap().expect("uncontended");
        black_box(guard.release().unwrap());
    });
    let report = Coordinator::builder(&primary.url())
        .key_prefix("bench:")
        .replication(Replication::Report {
            timeout: Duration::from_millis(100),
        })
        .build()
        .unwrap();
    let report_lock = report.fenced_lock("{r}:lease", "{r}:fence").unwrap();
    bench(&mut c, "replicated: FencedLock, Report", || {
        let guard = report_lock.try_acquire(TTL).unwrap().expect("uncontended");
        assert_eq!(guard.replicas_acknowledged(), Some(1));
        black_box(guard.release().unwrap());
    });

    c.final_summary();

    let Some(rtt) = median_us("raw PING round trip") else {
        return;
    };
    println!("\nmedian per operation, and in raw PING round trips ({rtt:.1} us):");
    for name in [
        "raw PING round trip",
        "Lock try_acquire + release",
        "Lock try_acquire + release, holder",
        "FencedLock try_acquire + release",
        "FencedLock try_acquire + release, holder",
        "verify_still_held",
        "verify_still_held, holder",
        "uncontended acquire_timeout + release",
        "replicated: FencedLock, Off",
        "replicated: FencedLock, Report",
    ] {
        if let Some(t) = median_us(name) {
            println!("  {name:<40} {t:>8.1} us  {:>5.2}x", t / rtt);
        }
    }
    if let (Some(off), Some(report)) = (
        median_us("replicated: FencedLock, Off"),
        median_us("replicated: FencedLock, Report"),
    ) {
        println!("Report / Off on a replicated primary: {:.2}x", report / off);
    }
}
