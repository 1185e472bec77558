//! A reader/writer lease with writer preference, against `REDIS_URL` or, when
//! that is unset, a throwaway local `redis-server` started for the run.
//!
//! Three readers keep overlapping, so the lease is never free of readers. A
//! writer that arrives records its intent: new readers are held back, the
//! current ones finish, and the writer gets in (with a fencing token) without
//! waiting for the readers to stop. Readers then see its token as their write
//! epoch.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use respire_coordination::Coordinator;

mod common;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _server) = common::url_or_throwaway("REDIS_URL")?;
    println!("using {url}");
    let coord = Coordinator::builder(&url)
        .key_prefix("read-write-example:")
        .node_timeout(Duration::from_millis(200))
        .build()?;
    let rw = coord.read_write_lease("{catalog}")?;
    let ttl = Duration::from_secs(5);
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let ms = || started.elapsed().as_secs_f64() * 1e3;

    std::thread::scope(|s| -> respire_coordination::Result<()> {
        for reader in 1..=3u64 {
            let (read, stop) = (rw.read(), &stop);
            s.spawn(move || -> respire_coordination::Result<()> {
                std::thread::sleep(Duration::from_millis(reader * 40));
                let mut epoch = None;
                while !stop.load(Ordering::Relaxed) {
                    let Some(guard) = read.acquire_timeout(ttl, Duration::from_secs(5))? else {
                        continue;
                    };
                    if epoch != Some(guard.write_epoch()) {
                        epoch = Some(guard.write_epoch());
                        println!(
                            "{:>6.1} ms  reader {reader} reads at write epoch {}",
                            ms(),
                            guard.write_epoch()
                        );
                    }
                    std::thread::sleep(Duration::from_millis(120));
                }
                Ok(())
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        for _ in 0..2 {
            let asked = Instant::now();
            let write = rw
                .write()
                .acquire_timeout(ttl, Duration::from_secs(5))?
                .expect("the writer is not starved");
            println!(
                "{:>6.1} ms  the writer got in after {:.1} ms, with fencing token {}, while \
                 readers kept coming",
                ms(),
                asked.elapsed().as_secs_f64() * 1e3,
                write.fencing_token()
            );
            std::thread::sleep(Duration::from_millis(50));
            write.release()?;
            std::thread::sleep(Duration::from_millis(400));
        }
        stop.store(true, Ordering::Relaxed);
        Ok(())
    })?;
    Ok(())
}
