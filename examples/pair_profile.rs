//! Acquire + release in a loop against a local server, for profiling.
use std::time::{Duration, Instant};
fn main() {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "redis://127.0.0.1:47200".into());
    let n: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let coord = respire_coordination::Coordinator::connect(&url).unwrap();
    let lock = coord.lock("profile").unwrap();
    let start = Instant::now();
    for _ in 0..n {
        let g = lock.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
        g.release().unwrap();
    }
    println!("{:?} per pair", start.elapsed() / n as u32);
}
