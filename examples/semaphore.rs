//! A semaphore of two permits shared by five workers, against `REDIS_URL` or,
//! when that is unset, a throwaway local `redis-server` started for the run.
//!
//! Each worker waits for a permit (woken by invalidations, not polling), works
//! in its slot with its fencing token, and releases it; no more than two hold a
//! permit at once. A participant that declares another capacity is refused.

use std::time::{Duration, Instant};

use respire_coordination::{Coordinator, Error};

mod common;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _server) = common::url_or_throwaway("REDIS_URL")?;
    println!("using {url}");
    let coord = Coordinator::builder(&url)
        .key_prefix("semaphore-example:")
        .node_timeout(Duration::from_millis(200))
        .build()?;
    let exports = coord.semaphore("{exports}", 2)?;
    let started = Instant::now();
    let ms = || started.elapsed().as_secs_f64() * 1e3;

    std::thread::scope(|s| {
        for worker in 1..=5 {
            let exports = &exports;
            s.spawn(move || -> respire_coordination::Result<()> {
                let permit = exports
                    .acquire_timeout(Duration::from_secs(5), Duration::from_secs(10))?
                    .expect("a permit within 10 s");
                println!(
                    "{:>6.1} ms  worker {worker} holds slot {} with fencing token {} ({} free)",
                    ms(),
                    permit.slot(),
                    permit.fencing_token(),
                    exports.available()?
                );
                std::thread::sleep(Duration::from_millis(300));
                permit.release()?;
                Ok(())
            });
        }
    });

    // Every participant must declare the same capacity.
    match coord
        .semaphore("{exports}", 3)?
        .try_acquire(Duration::from_secs(5))
    {
        Err(e @ Error::CapacityMismatch { .. }) => println!("a participant declaring 3: {e}"),
        other => println!("unexpected: {other:?}"),
    }
    println!("holders now: {:?}", exports.holders()?);
    Ok(())
}
