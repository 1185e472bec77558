//! A fenced lock shared by four workers, against `REDIS_URL` or, when that is
//! unset, a throwaway local `redis-server` started for the run.
//!
//! Each worker waits for the lease (woken by invalidations, not polling), keeps it
//! alive while it works, writes with its fencing token, and releases it.

use std::time::{Duration, Instant};

use respire_coordination::{CancelToken, Coordinator};

mod common;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _server) = common::url_or_throwaway("REDIS_URL")?;
    println!("using {url}");
    let coord = Coordinator::builder(&url)
        .key_prefix("quickstart:")
        .node_timeout(Duration::from_millis(200))
        .build()?;
    let lock = coord.fenced_lock("{reports:daily}:lease", "{reports:daily}:fence")?;
    let cancel = CancelToken::new();
    let started = Instant::now();

    std::thread::scope(|s| {
        for worker in 1..=4 {
            let (lock, cancel) = (&lock, &cancel);
            s.spawn(move || -> respire_coordination::Result<()> {
                let guard = lock.acquire(Duration::from_secs(2), cancel)?;
                let renewal = guard.keep_alive()?;
                let token = guard.fencing_token();
                println!(
                    "{:>6.1} ms  worker {worker} holds the lease with fencing token {token}",
                    started.elapsed().as_secs_f64() * 1e3
                );
                // The protected work: stop as soon as the lease is lost.
                let work_until = Instant::now() + Duration::from_millis(1_500);
                while Instant::now() < work_until && !guard.is_lost() {
                    std::thread::sleep(Duration::from_millis(50));
                }
                drop(renewal);
                let outcome = guard.release()?;
                println!(
                    "{:>6.1} ms  worker {worker} released: {outcome:?}",
                    started.elapsed().as_secs_f64() * 1e3
                );
                Ok(())
            });
        }
    });
    println!("renewals: {:?}", coord.renewal_stats());
    Ok(())
}
