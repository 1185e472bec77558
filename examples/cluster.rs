//! A fenced lease on a throwaway Redis Cluster (three primaries, one replica
//! each, started on loopback for the run) while the cluster changes under it.
//!
//! A waiter on a second coordinator blocks on the lease (woken by
//! invalidations, not polling) while the lease's slot is migrated to another
//! primary; the holder still holds it there, and the waiter gets it moments
//! after the release. Then a kept-alive lease rides out a manual
//! `CLUSTER FAILOVER` of its primary: its renewals follow the slot to the
//! promoted replica, it is never flagged lost, and the next grant's fencing
//! token is above it.

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::thread;
use std::time::{Duration, Instant};

use respire_coordination::{Coordinator, key_slot};
use support::TestCluster;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let cluster = TestCluster::start();
    let seeds = cluster.seed_urls();
    println!(
        "a cluster of {} primaries and {} replicas is up after {:.1} s",
        cluster.primaries().len(),
        cluster.replicas().len(),
        started.elapsed().as_secs_f64()
    );
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let holder = Coordinator::cluster(&seeds)?;
    let waiter = Coordinator::cluster(&seeds)?;
    let (lease_key, fence_key) = ("{report}:lease", "{report}:fence");
    let slot = key_slot(lease_key.as_bytes());
    let ttl = Duration::from_secs(10);

    // 1. A waiter blocks while the slot moves to another primary.
    let lock = holder.fenced_lock(lease_key, fence_key)?;
    let guard = lock.try_acquire(ttl)?.expect("a free lease");
    let from = cluster.primary_for_slot(slot);
    println!(
        "holder: token {} on node {from} (slot {slot})",
        guard.fencing_token()
    );
    let waiting_lock = waiter.fenced_lock(lease_key, fence_key)?;
    let before = script_calls(&cluster, from);
    let waiting = thread::spawn(move || {
        let got = waiting_lock.acquire_timeout(ttl, Duration::from_secs(20));
        (Instant::now(), got)
    });
    // The waiter's first attempt found the lease held on the old owner.
    let deadline = Instant::now() + Duration::from_secs(10);
    while script_calls(&cluster, from) == before {
        if Instant::now() > deadline {
            return Err("the waiter made no attempt within 10 s".into());
        }
        thread::sleep(Duration::from_millis(5));
    }
    let to = cluster
        .primaries()
        .into_iter()
        .find(|&p| p != from)
        .expect("another primary");
    let moving = Instant::now();
    cluster.migrate_slot(slot, to);
    println!(
        "slot {slot} migrated from node {from} to node {to} in {:.1} ms",
        moving.elapsed().as_secs_f64() * 1e3
    );
    let still = guard.verify_still_held()?;
    println!(
        "holder: still held on node {to}: {}",
        still.map_or("no".to_owned(), |left| format!("yes, {left:?} left"))
    );
    let released = Instant::now();
    guard.release()?;
    let (acquired, got) = waiting.join().expect("the waiter thread");
    let got = got?.expect("acquired after the release");
    println!(
        "waiter: token {} on node {to}, {:.2} ms after the release",
        got.fencing_token(),
        (acquired - released).as_secs_f64() * 1e3
    );
    let last = got.fencing_token();
    got.release()?;

    // 2. A kept-alive lease through a manual failover of its primary.
    let guard = lock.try_acquire(Duration::from_secs(3))?.expect("free");
    let renewal = guard.keep_alive()?;
    let replica = cluster.replica_of(to);
    println!(
        "holder: token {} (above {last}), kept alive with a 3 s TTL; CLUSTER FAILOVER on \
         node {replica}, the replica of node {to}",
        guard.fencing_token()
    );
    let took = cluster.failover(replica);
    println!(
        "failover: node {replica} is the primary, seen by every node after {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    let renewals = holder.renewal_stats().renewals;
    let deadline = Instant::now() + Duration::from_secs(5);
    while holder.renewal_stats().renewals == renewals && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    println!(
        "holder: renewed since the failover: {}; lost: {}; still held: {}",
        holder.renewal_stats().renewals > renewals,
        guard.is_lost(),
        guard.verify_still_held()?.is_some()
    );
    let before = guard.fencing_token();
    drop(renewal);
    guard.release()?;
    let next = lock.try_acquire(ttl)?.expect("free");
    println!(
        "next grant: token {} on node {replica} (above {before})",
        next.fencing_token()
    );
    next.release()?;
    Ok(())
}

/// The scripts node `index` has run (a fenced attempt is one).
fn script_calls(cluster: &TestCluster, index: usize) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut cluster.node(index).client())
        .unwrap_or_default();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| l.split(['=', ',']).nth(1)?.parse::<u64>().ok())
        .sum()
}
