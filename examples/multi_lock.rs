//! Several leases all or nothing: four workers move money between accounts,
//! each transfer taking the fenced leases of both of its accounts, against
//! `REDIS_URL` or, when that is unset, a throwaway local `redis-server`.
//!
//! Half the workers name the accounts in one order and half in the other —
//! the pattern that deadlocks a lock that takes its keys in the order given
//! (Redisson's `MultiLock`). Here a set on one server is granted by one script
//! call, all or none, so nobody ever holds one account and waits for the
//! other. Then an outsider holds one account, and a set that includes it is
//! not granted and leaves nothing of itself behind.
//!
//! Run: `cargo run --example multi_lock`.

use std::time::{Duration, Instant};

use respire_coordination::{Coordinator, Guard};

mod common;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _server) = common::url_or_throwaway("REDIS_URL")?;
    println!("using {url}");
    let coord = Coordinator::builder(&url)
        .key_prefix("multi-example:")
        .node_timeout(Duration::from_millis(200))
        .build()?;
    let account = |name: &str| (format!("{{{name}}}:lease"), format!("{{{name}}}:fence"));
    let started = Instant::now();
    let at = move || started.elapsed().as_secs_f64() * 1e3;

    std::thread::scope(|s| {
        for worker in 0..4 {
            let coord = &coord;
            s.spawn(move || -> respire_coordination::Result<()> {
                // Workers 0 and 2 move from alice to bob, 1 and 3 from bob to
                // alice: opposite orders.
                let (from, to) = if worker % 2 == 0 {
                    ("alice", "bob")
                } else {
                    ("bob", "alice")
                };
                let transfer = coord.fenced_lock_all(&[account(from), account(to)])?;
                for _ in 0..3 {
                    let held = transfer
                        .acquire_timeout(Duration::from_secs(5), Duration::from_secs(10))?
                        .expect("granted within the wait");
                    let tokens: Vec<String> = held
                        .fencing_tokens()
                        .iter()
                        .map(|(key, token)| format!("{key} #{token}"))
                        .collect();
                    println!(
                        "{:>7.1} ms  worker {worker}: {from} -> {to} holding {}",
                        at(),
                        tokens.join(", ")
                    );
                    // The transfer, with each account's token sent along to
                    // its store; stop if the set was lost.
                    std::thread::sleep(Duration::from_millis(20));
                    assert!(!held.is_lost(), "the set was lost mid-transfer");
                    Guard::release(held)?;
                }
                Ok(())
            });
        }
    });

    // An outsider holds carol: a set of alice, carol and dave is not granted,
    // and neither alice nor dave is left held.
    let carol = coord.lock("{carol}:lease")?;
    let outsider = carol
        .try_acquire(Duration::from_secs(5))?
        .expect("carol is free");
    let set = coord.fenced_lock_all(&[account("alice"), account("carol"), account("dave")])?;
    let got = set.acquire_timeout(Duration::from_secs(5), Duration::from_millis(300))?;
    println!(
        "{:>7.1} ms  alice + carol + dave while carol is held: {}",
        at(),
        if got.is_some() {
            "granted?!"
        } else {
            "not granted"
        }
    );
    let alice_free = coord
        .lock("{alice}:lease")?
        .try_acquire(Duration::from_secs(5))?
        .is_some();
    println!(
        "{:>7.1} ms  alice afterwards: {}",
        at(),
        if alice_free { "free" } else { "held?!" }
    );
    drop(outsider);
    let all = set
        .try_acquire(Duration::from_secs(5))?
        .expect("free once carol is released");
    for (key, outcome) in all.release() {
        println!("{:>7.1} ms  released {key}: {:?}", at(), outcome?);
    }
    Ok(())
}
