//! `Lock` acquire + release in a loop, for profiling (`perf record`), against
//! `REDIS_URL` or, when that is unset, a throwaway local `redis-server`.
//! The first argument sets the number of pairs (default 20,000).

use std::time::{Duration, Instant};

mod common;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _server) = common::url_or_throwaway("REDIS_URL")?;
    let n: u32 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let coord = respire_coordination::Coordinator::connect(&url)?;
    let lock = coord.lock("profile")?;
    let start = Instant::now();
    for _ in 0..n {
        let g = lock
            .try_acquire(Duration::from_secs(10))?
            .expect("nobody else uses the key");
        g.release()?;
    }
    println!("{:?} per pair", start.elapsed() / n.max(1));
    Ok(())
}
