//! Hand-off latency between processes: how long after a holder releases a
//! fenced lock does a waiter in another process hold it?
//!
//! The program starts a throwaway `redis-server` (or uses `REDIS_URL`) and runs
//! itself as four child processes. Each child does `ROUNDS` cycles of
//! `acquire` (blocking, woken by invalidations) → hold for 1 ms → `release` →
//! 2 ms outside the lock, stamping every grant and release on the wall clock,
//! which all processes on the host share. The parent orders the grants and
//! reports, for each grant that followed another process's release, the time
//! from sending the release to holding the lock, next to the raw round trip of
//! `PING` measured in the same run on one connection.
//!
//! Without `REDIS_URL` it runs in the same run against a throwaway standalone
//! server, then against a throwaway Redis Cluster of three primaries through a
//! `redis+cluster://` coordinator, and prints the cluster's median and p99 as
//! ratios to the standalone ones. The cluster runs twice: with primaries only,
//! the match for one standalone server without a replica; then with one
//! replica per primary, next to a standalone coordinator on the node that owns
//! the slot, which tells the routing's cost apart from what a cluster node
//! with a replica costs (its replication stream, on the same cores).
//!
//! `cargo bench --bench handoff` runs 4 × 200 acquisitions per deployment;
//! without `--bench` (as under `cargo test --benches`) it runs 4 × 10.
//! `HANDOFF_ROUNDS` and `HANDOFF_PROCESSES` override the counts;
//! `HANDOFF_TOPOLOGY=standalone` or `cluster` runs only one of them.

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use respire_coordination::{CancelToken, Coordinator};

const CHILD_ENV: &str = "RESPIRE_HANDOFF_CHILD";
const HOLD: Duration = Duration::from_millis(1);
const PAUSE: Duration = Duration::from_millis(2);
const PINGS: usize = 10_000;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn main() -> Result<()> {
    if let Ok(index) = std::env::var(CHILD_ENV) {
        return child(&index);
    }
    let full = std::env::args().any(|a| a == "--bench");
    let rounds: usize = match std::env::var("HANDOFF_ROUNDS") {
        Ok(n) => n.parse()?,
        Err(_) if full => 200,
        Err(_) => 10,
    };
    let processes: usize = match std::env::var("HANDOFF_PROCESSES") {
        Ok(n) => n.parse()?,
        Err(_) => 4,
    };
    if processes < 2 || rounds == 0 {
        return Err("need at least 2 processes and 1 round".into());
    }
    if let Ok(url) = std::env::var("REDIS_URL") {
        parent("given", &url, &url, processes, rounds)?;
        return Ok(());
    }
    let only = std::env::var("HANDOFF_TOPOLOGY").unwrap_or_default();
    let mut standalone = None;
    if only.is_empty() || only == "standalone" {
        let server = support::TestServer::start();
        standalone = Some(parent(
            "standalone",
            &server.url(),
            &server.url(),
            processes,
            rounds,
        )?);
    }
    if only.is_empty() || only == "cluster" {
        for replicas in [0, 1] {
            let cluster = support::TestCluster::builder().replicas(replicas).start();
            let hosts: Vec<String> = cluster
                .nodes()
                .iter()
                .map(|n| format!("127.0.0.1:{}", n.port()))
                .collect();
            let url = format!("redis+cluster://{}/", hosts.join(","));
            // The raw round trip to the primary that holds the lock's slot.
            let owner = cluster.node(cluster.primary_for_key("handoff:{job}:lease"));
            let primaries = cluster.primaries().len();
            let direct = if replicas > 0 {
                Some(parent(
                    "standalone coordinator on the cluster node that owns the slot",
                    &owner.url(),
                    &owner.url(),
                    processes,
                    rounds,
                )?)
            } else {
                None
            };
            let stats = parent(
                &format!("cluster of {primaries} primaries, {replicas} replica(s) each"),
                &url,
                &owner.url(),
                processes,
                rounds,
            )?;
            if let Some(direct) = direct {
                println!(
                    "cluster ({replicas} replica each) / standalone coordinator on the same \
                     node: median {:.2}x, p99 {:.2}x",
                    stats.median / direct.median,
                    stats.p99 / direct.p99
                );
            }
            if let Some(base) = standalone {
                println!(
                    "cluster ({replicas} replica(s) each) / standalone (same run): median \
                     {:.2}x, p99 {:.2}x",
                    stats.median / base.median,
                    stats.p99 / base.p99
                );
            }
        }
    }
    Ok(())
}

/// One deployment's hand-off figures, in microseconds.
#[derive(Clone, Copy)]
struct Stats {
    median: f64,
    p99: f64,
}

/// Nanoseconds since the Unix epoch: a clock every process on the host shares.
fn wall_ns() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos() as i128
}

/// One child: waits for "go" on stdin, then acquires and releases `rounds`
/// times, printing `grant <called> <acquired> <release sent> <release
/// confirmed> <token>` for each.
fn child(index: &str) -> Result<()> {
    let url = std::env::var("REDIS_URL")?;
    let rounds: usize = std::env::var("HANDOFF_ROUNDS")?.parse()?;
    let coord = Coordinator::builder(&url).key_prefix("handoff:").build()?;
    let lock = coord.fenced_lock("{job}:lease", "{job}:fence")?;
    let cancel = CancelToken::new();
    // Start the invalidation subscriber (a wait does, and waits for it to
    // connect) before the clock starts.
    drop(lock.acquire_timeout(Duration::from_secs(10), Duration::from_secs(5))?);
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready {index}")?;
    out.flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let mut grants = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let called = wall_ns();
        let guard = lock.acquire(Duration::from_secs(10), &cancel)?;
        let acquired = wall_ns();
        let token = guard.fencing_token().get();
        std::thread::sleep(HOLD);
        let release_sent = wall_ns();
        guard.release()?;
        let release_done = wall_ns();
        grants.push((called, acquired, release_sent, release_done, token));
        std::thread::sleep(PAUSE);
    }
    for (called, acquired, sent, done, token) in grants {
        writeln!(out, "grant {called} {acquired} {sent} {done} {token}")?;
    }
    Ok(())
}

/// The median of `samples` (sorted in place).
fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
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
    let mut samples = Vec::with_capacity(PINGS);
    for _ in 0..PINGS {
        let start = Instant::now();
        redis::cmd("PING").query::<String>(&mut conn)?;
        samples.push(start.elapsed().as_secs_f64() * 1e6);
    }
    Ok(median(&mut samples))
}

struct Grant {
    process: usize,
    called: i128,
    acquired: i128,
    release_sent: i128,
    release_done: i128,
    token: u64,
}

fn parent(what: &str, url: &str, ping_url: &str, processes: usize, rounds: usize) -> Result<Stats> {
    let exe = std::env::current_exe()?;
    let rtt_before = ping_rtt_us(ping_url)?;
    let mut children: Vec<Child> = (0..processes)
        .map(|i| {
            Command::new(&exe)
                .env(CHILD_ENV, i.to_string())
                .env("REDIS_URL", url)
                .env("HANDOFF_ROUNDS", rounds.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
        })
        .collect::<std::io::Result<_>>()?;
    let mut readers: Vec<_> = children
        .iter_mut()
        .map(|c| BufReader::new(c.stdout.take().expect("piped stdout")))
        .collect();
    for reader in &mut readers {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if !line.starts_with("ready") {
            return Err(format!("child did not start: {line:?}").into());
        }
    }
    let started = Instant::now();
    for child in &mut children {
        writeln!(child.stdin.as_mut().expect("piped stdin"), "go")?;
    }
    let mut grants = Vec::new();
    for (process, reader) in readers.into_iter().enumerate() {
        for line in reader.lines() {
            let line = line?;
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.first() != Some(&"grant") || f.len() != 6 {
                return Err(format!("unexpected line {line:?}").into());
            }
            grants.push(Grant {
                process,
                called: f[1].parse()?,
                acquired: f[2].parse()?,
                release_sent: f[3].parse()?,
                release_done: f[4].parse()?,
                token: f[5].parse()?,
            });
        }
    }
    for mut child in children {
        let status = child.wait()?;
        if !status.success() {
            return Err(format!("a child failed: {status}").into());
        }
    }
    let took = started.elapsed();
    let rtt_after = ping_rtt_us(ping_url)?;

    grants.sort_by_key(|g| g.acquired);
    if grants.len() != processes * rounds {
        return Err(format!("{} grants, expected {}", grants.len(), processes * rounds).into());
    }
    let mut from_send = Vec::new();
    let mut from_confirm = Vec::new();
    let (mut same_process, mut not_waiting) = (0, 0);
    for pair in grants.windows(2) {
        let (prev, next) = (&pair[0], &pair[1]);
        if next.token <= prev.token || next.acquired < prev.release_sent {
            return Err("grants overlap or tokens went back".into());
        }
        if next.process == prev.process {
            same_process += 1;
            continue;
        }
        // Only a waiter that was already blocked when the release went out
        // measures the hand-off; a later caller would measure its own pause.
        if next.called >= prev.release_sent {
            not_waiting += 1;
            continue;
        }
        from_send.push((next.acquired - prev.release_sent) as f64 / 1e3);
        from_confirm.push((next.acquired - prev.release_done) as f64 / 1e3);
    }
    let rtt = (rtt_before + rtt_after) / 2.0;
    let med = median(&mut from_send);
    let p99 = percentile(&mut from_send, 0.99);
    let med_confirm = median(&mut from_confirm);
    let p99_confirm = percentile(&mut from_confirm, 0.99);
    let mut per_process = vec![0usize; processes];
    for g in &grants {
        per_process[g.process] += 1;
    }
    println!(
        "hand-off latency ({what}): {processes} processes x {rounds} acquisitions of one fenced lock"
    );
    println!(
        "  {} grants in {:.2} s; {} hand-offs to a waiting process ({not_waiting} grants to a process \
         that called after the release, {same_process} to the releasing process, not counted)",
        grants.len(),
        took.as_secs_f64(),
        from_send.len()
    );
    println!("  grants per process: {per_process:?}");
    println!(
        "  raw PING round trip (median of {PINGS}, one connection): {rtt_before:.1} us before, {rtt_after:.1} us after"
    );
    println!(
        "  release sent -> next process holds it:      median {med:.1} us, p99 {p99:.1} us ({:.2}x the round trip)",
        med / rtt
    );
    println!(
        "  release confirmed -> next process holds it: median {med_confirm:.1} us, p99 {p99_confirm:.1} us ({:.2}x)",
        med_confirm / rtt
    );
    Ok(Stats { median: med, p99 })
}
