//! Leader election: three workers campaign for one election, against
//! `REDIS_URL` or, when that is unset, a throwaway local `redis-server`.
//!
//! Each leader keeps its lease alive, advertises where it can be reached,
//! works with its term as the fencing token, and resigns, which wakes the next
//! contender at once. An observer prints every change, "no leader" included,
//! as invalidations wake it.
//!
//! Run: `cargo run --example election`.

use std::time::{Duration, Instant};

use respire_coordination::{CancelToken, Coordinator};

mod common;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _server) = common::url_or_throwaway("REDIS_URL")?;
    println!("using {url}");
    let coord = Coordinator::builder(&url)
        .key_prefix("election-example:")
        .node_timeout(Duration::from_millis(200))
        .build()?;
    let election = coord.election("{scheduler}")?;
    let started = Instant::now();
    let at = move || started.elapsed().as_secs_f64() * 1e3;

    // The observer stops at the first "no leader" after the third term, or
    // after ten seconds.
    let observer = {
        let mut changes = election.observe();
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(10);
            let (mut terms, mut last_term) = (0, None);
            while let Some(change) = changes.next_until(deadline) {
                match change {
                    Ok(Some(leader)) => {
                        if last_term != Some(leader.term) {
                            terms += 1;
                            last_term = Some(leader.term);
                        }
                        println!(
                            "{:>7.1} ms  observer: term {} led by {}",
                            at(),
                            leader.term,
                            leader.value.as_deref().unwrap_or("?")
                        );
                    }
                    Ok(None) => {
                        println!("{:>7.1} ms  observer: no leader", at());
                        if terms >= 3 {
                            return;
                        }
                    }
                    Err(e) => println!("{:>7.1} ms  observer: cannot tell: {e}", at()),
                }
            }
        })
    };

    let cancel = CancelToken::new();
    std::thread::scope(|s| {
        for worker in 1..=3 {
            let (election, cancel) = (&election, &cancel);
            s.spawn(move || -> respire_coordination::Result<()> {
                let address = format!("worker-{worker}:8080");
                let leading = election.campaign(&address, Duration::from_secs(2), cancel)?;
                let renewal = leading.keep_alive()?;
                let term = leading.term();
                println!("{:>7.1} ms  worker {worker} leads with term {term}", at());
                // The leader's work, with the term as its fencing token; stop
                // as soon as the leadership is lost.
                let work_until = Instant::now() + Duration::from_millis(300);
                while Instant::now() < work_until && !leading.is_lost() {
                    std::thread::sleep(Duration::from_millis(50));
                }
                leading.proclaim(&format!("{address} (finishing)"))?;
                drop(renewal);
                let outcome = leading.resign()?;
                println!("{:>7.1} ms  worker {worker} resigned: {outcome:?}", at());
                Ok(())
            });
        }
    });
    observer.join().expect("the observer thread");
    Ok(())
}
