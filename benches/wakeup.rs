//! Wake-up after release: how long after a holder releases does a waiter that
//! was already blocked hold the primitive? For the fenced lock, a semaphore of
//! one permit, and a reader/writer lease in its three hand-offs (writer to
//! reader, last reader to writer, writer to writer), all in one run beside the
//! raw `PING` round trip measured on one connection in the same run.
//!
//! The holder and the waiter use two coordinators (two pools, two invalidation
//! subscribers) in one process and stamp one monotonic clock. Each round: the
//! holder takes the primitive, the waiter starts a blocking acquire, and 5 ms
//! later (its first, busy attempt takes a fraction of that) the holder releases;
//! the figure is the time from just before the release was sent (and from its
//! confirmation) to the waiter's acquire returning. The wake-up path is the
//! release's invalidation push to the waiter's subscriber, then one acquire
//! round trip.
//!
//! The program starts a throwaway `redis-server` (or uses `REDIS_URL`).
//! `cargo bench --bench wakeup` runs 300 rounds per primitive; without
//! `--bench` (as under `cargo test --benches`) it runs 20. `WAKEUP_ROUNDS`
//! overrides the count.

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use respire_coordination::Coordinator;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const TTL: Duration = Duration::from_secs(10);
const WAIT: Duration = Duration::from_secs(10);
const GAP: Duration = Duration::from_millis(5);

fn main() -> Result<()> {
    let full = std::env::args().any(|a| a == "--bench");
    let rounds: usize = match std::env::var("WAKEUP_ROUNDS") {
        Ok(n) => n.parse()?,
        Err(_) if full => 300,
        Err(_) => 20,
    };
    let (url, _server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => {
            let server = support::TestServer::start();
            (server.url(), Some(server))
        }
    };
    let build = || {
        Coordinator::builder(&url)
            .key_prefix("wakeup:")
            .node_timeout(Duration::from_millis(500))
            .build()
    };
    let (holder, waiter) = (build()?, build()?);

    let rtt_before = ping_rtt_us(&url)?;
    let mut rows = Vec::new();

    let (hl, wl) = (
        holder.fenced_lock("{lock}:lease", "{lock}:fence")?,
        waiter.fenced_lock("{lock}:lease", "{lock}:fence")?,
    );
    rows.push((
        "FencedLock: release → next holder",
        measure(
            rounds,
            || hl.try_acquire(TTL).map(|g| g.expect("free")),
            |g| g.release().map(drop),
            || wl.acquire_timeout(TTL, WAIT).map(|g| g.expect("woken")),
        )?,
    ));

    let (hs, ws) = (holder.semaphore("{sem}", 1)?, waiter.semaphore("{sem}", 1)?);
    rows.push((
        "Semaphore (1 permit): release → next holder",
        measure(
            rounds,
            || hs.try_acquire(TTL).map(|g| g.expect("free")),
            |g| g.release().map(drop),
            || ws.acquire_timeout(TTL, WAIT).map(|g| g.expect("woken")),
        )?,
    ));

    let (hrw, wrw) = (
        holder.read_write_lease("{rw}")?,
        waiter.read_write_lease("{rw}")?,
    );
    rows.push((
        "ReadWriteLease: writer's release → waiting reader",
        measure(
            rounds,
            || hrw.write().try_acquire(TTL).map(|g| g.expect("free")),
            |g| g.release().map(drop),
            || {
                wrw.read()
                    .acquire_timeout(TTL, WAIT)
                    .map(|g| g.expect("woken"))
            },
        )?,
    ));
    rows.push((
        "ReadWriteLease: last reader's release → waiting writer",
        measure(
            rounds,
            || hrw.read().try_acquire(TTL).map(|g| g.expect("free")),
            |g| g.release().map(drop),
            || {
                wrw.write()
                    .acquire_timeout(TTL, WAIT)
                    .map(|g| g.expect("woken"))
            },
        )?,
    ));
    rows.push((
        "ReadWriteLease: writer's release → waiting writer",
        measure(
            rounds,
            || hrw.write().try_acquire(TTL).map(|g| g.expect("free")),
            |g| g.release().map(drop),
            || {
                wrw.write()
                    .acquire_timeout(TTL, WAIT)
                    .map(|g| g.expect("woken"))
            },
        )?,
    ));

    let rtt_after = ping_rtt_us(&url)?;
    let rtt = (rtt_before + rtt_after) / 2.0;
    println!(
        "wake-up after release, {rounds} rounds each; raw PING round trip {rtt:.0} µs \
         (median; {rtt_before:.0} before, {rtt_after:.0} after)"
    );
    println!(
        "{:<56} {:>10} {:>8} {:>10} {:>10} {:>12}",
        "", "median µs", "in RTTs", "p99 µs", "from conf.", "≤ 3 RTT+1ms"
    );
    let mut all_within = true;
    for (name, mut samples) in rows {
        let mut sent: Vec<f64> = samples.iter().map(|s| s.0).collect();
        let mut confirmed: Vec<f64> = samples.drain(..).map(|s| s.1).collect();
        let med = percentile(&mut sent, 0.5);
        let p99 = percentile(&mut sent, 0.99);
        let med_conf = percentile(&mut confirmed, 0.5);
        let within = med <= 3.0 * rtt + 1_000.0;
        all_within &= within;
        println!(
            "{name:<56} {med:>10.0} {:>8.1} {p99:>10.0} {med_conf:>10.0} {:>12}",
            med / rtt,
            if within { "yes" } else { "NO" }
        );
    }
    if !all_within {
        println!("some median wake-ups took longer than 3 round trips + 1 ms on this run");
    }
    Ok(())
}

/// `rounds` hand-offs: `hold` takes the primitive, a waiter thread blocks in
/// `wait`, and `release` lets it go. Returns, per round, the µs from just
/// before the release was sent and from its confirmation to the waiter holding.
fn measure<H, W: Send>(
    rounds: usize,
    hold: impl Fn() -> respire_coordination::Result<H>,
    release: impl Fn(H) -> respire_coordination::Result<()>,
    wait: impl Fn() -> respire_coordination::Result<W> + Sync,
) -> Result<Vec<(f64, f64)>> {
    // Round 0 is not timed: connections, scripts and subscribers warm up.
    let mut samples = Vec::with_capacity(rounds);
    std::thread::scope(|s| -> Result<()> {
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (got_tx, got_rx) = mpsc::channel::<Instant>();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let wait = &wait;
        let waiter = s.spawn(move || -> respire_coordination::Result<()> {
            for () in go_rx {
                let g = wait()?;
                let _ = got_tx.send(Instant::now());
                drop(g);
                let _ = done_tx.send(());
            }
            Ok(())
        });
        for round in 0..=rounds {
            let h = hold()?;
            go_tx.send(())?;
            std::thread::sleep(GAP);
            let sent = Instant::now();
            release(h)?;
            let confirmed = Instant::now();
            let got = got_rx.recv()?;
            if round > 0 {
                let us = |from: Instant| got.saturating_duration_since(from).as_secs_f64() * 1e6;
                samples.push((us(sent), us(confirmed)));
            }
            // The waiter releases before the next round takes the primitive.
            done_rx.recv()?;
        }
        drop(go_tx);
        waiter.join().expect("waiter thread")?;
        Ok(())
    })?;
    Ok(samples)
}

fn percentile(samples: &mut [f64], q: f64) -> f64 {
    samples.sort_by(f64::total_cmp);
    let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
    samples[i]
}

/// Median `PING` round trip in microseconds, on one connection.
fn ping_rtt_us(url: &str) -> Result<f64> {
    let mut conn = redis::Client::open(url)?.get_connection()?;
    for _ in 0..1000 {
        redis::cmd("PING").query::<String>(&mut conn)?;
    }
    let mut samples = Vec::with_capacity(10_000);
    for _ in 0..10_000 {
        let start = Instant::now();
        redis::cmd("PING").query::<String>(&mut conn)?;
        samples.push(start.elapsed().as_secs_f64() * 1e6);
    }
    Ok(percentile(&mut samples, 0.5))
}
