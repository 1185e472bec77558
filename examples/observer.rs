//! Observing locks: an observer that counts and prints what two workers'
//! locks do, against `REDIS_URL` or, when that is unset, a throwaway local
//! `redis-server`.
//!
//! One worker holds a fenced lock with a keep-alive while the other waits
//! for it; the observer sees the attempts, the contention, the renewals with
//! their margin, the release and the grant that follows, and prints the wait
//! each grant cost. With the `metrics` or `tracing` feature, the crate's
//! `MetricsObserver` and `TracingObserver` do the same through those crates.
//!
//! Run: `cargo run --example observer`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use respire_coordination::{
    AttemptEvent, ContentionEvent, Coordinator, GrantEvent, LossEvent, Observer, ReleaseEvent,
    RenewalEvent, WaitEndEvent,
};

mod common;

/// Prints every event and counts grants and contention. It never blocks: a
/// line to stdout and an atomic add.
#[derive(Default)]
struct Printer {
    grants: AtomicU64,
    contended: AtomicU64,
}

impl Observer for Printer {
    fn attempt(&self, e: &AttemptEvent<'_>) {
        println!("attempt     {} ({})", e.key, e.primitive);
    }
    fn contended(&self, e: &ContentionEvent<'_>) {
        self.contended.fetch_add(1, Ordering::Relaxed);
        println!("contended   {} (holder has {:?} left)", e.key, e.holder_ttl);
    }
    fn granted(&self, e: &GrantEvent<'_>) {
        self.grants.fetch_add(1, Ordering::Relaxed);
        let token = e.token.map(|t| t.get());
        println!("granted     {} token {token:?} after {:?}", e.key, e.waited);
    }
    fn wait_ended(&self, e: &WaitEndEvent<'_>) {
        println!(
            "not granted {} ({:?} after {:?})",
            e.key, e.reason, e.waited
        );
    }
    fn renewed(&self, e: &RenewalEvent<'_>) {
        println!("renewed     {} with {:?} to spare", e.key, e.margin);
    }
    fn lost(&self, e: &LossEvent<'_>) {
        println!("lost        {} ({:?}: {})", e.key, e.cause, e.detail);
    }
    fn released(&self, e: &ReleaseEvent<'_>) {
        println!("released    {} ({:?})", e.key, e.outcome);
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _server) = common::url_or_throwaway("REDIS_URL")?;
    println!("using {url}");
    let printer = Arc::new(Printer::default());
    let coord = Coordinator::builder(&url)
        .key_prefix("observer-example:")
        .node_timeout(Duration::from_millis(200))
        .observer(printer.clone())
        .build()?;
    let lock = coord.fenced_lock("{report}lease", "{report}fence")?;
    let ttl = Duration::from_secs(2);

    let holder = lock.try_acquire(ttl)?.ok_or("the lock is held elsewhere")?;
    std::thread::scope(|s| -> Result<(), respire_coordination::Error> {
        let waiter = s.spawn(|| lock.acquire_timeout(ttl, Duration::from_secs(10)));
        {
            // Two renewals at half the TTL, then the release wakes the waiter.
            let _renewal = holder.keep_alive()?;
            std::thread::sleep(Duration::from_millis(2_200));
        }
        holder.release()?;
        if let Some(next) = waiter.join().expect("the waiter panicked")? {
            next.release()?;
        }
        Ok(())
    })?;
    println!(
        "{} grants, {} contended acquire calls",
        printer.grants.load(Ordering::Relaxed),
        printer.contended.load(Ordering::Relaxed)
    );
    Ok(())
}
