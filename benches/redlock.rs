//! Redlock acquire+release latency on five local servers, each behind a
//! fault-injecting proxy: healthy, one node blackholed, and every node behind a
//! 2 ms delay (beside the `redlock` crate v2), with the raw single-node round
//! trip in the same run. Prints medians and ratios first, then runs criterion.
//!
//! `cargo bench --bench redlock`; needs `redis-server` on the `PATH`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use criterion::Criterion;
use respire_coordination::{Coordinator, RedlockGroup, RedlockOptions};
use support::{FaultProxy, Mode, TestServer};

const ACQUIRE: &str = include_str!("../src/scripts/lock_acquire.lua");
const RELEASE: &str = include_str!("../src/scripts/lease_release.lua");
const TTL: Duration = Duration::from_secs(10);

/// Five servers and one set of proxies in front of them.
struct Nodes {
    proxies: Vec<FaultProxy>,
}

impl Nodes {
    fn new(servers: &[TestServer]) -> Nodes {
        Nodes {
            proxies: servers
                .iter()
                .map(|s| FaultProxy::start(s.addr()))
                .collect(),
        }
    }

    fn group(&self) -> RedlockGroup {
        let nodes = self
            .proxies
            .iter()
            .map(|p| Coordinator::connect(&p.url()).expect("connect"))
            .collect();
        let options = RedlockOptions {
            node_timeout: Duration::from_millis(200),
            ..RedlockOptions::default()
        };
        RedlockGroup::new(nodes, options).expect("group")
    }

    fn urls(&self) -> Vec<String> {
        self.proxies.iter().map(FaultProxy::url).collect()
    }
}

/// One raw acquire+release on a plain connection: the floor for one node.
fn raw_cycle(conn: &mut redis::Connection, acquire: &redis::Script, release: &redis::Script) {
    let _: Vec<i64> = acquire
        .key("bench:raw")
        .arg("me")
        .arg(10_000)
        .invoke(conn)
        .unwrap();
    let _: i64 = release
        .key("bench:raw")
        .arg("me")
        .arg("exact")
        .invoke(conn)
        .unwrap();
}

fn group_cycle(group: &RedlockGroup) {
    let mut guard = group
        .try_acquire("bench:group", TTL)
        .unwrap()
        .expect("free");
    assert!(guard.release().unwrap());
}

fn crate_cycle(rl: &redlock::RedLock) {
    let lock = rl.lock(b"bench:crate", 10_000).unwrap().expect("free");
    rl.unlock(&lock);
}

/// The median of `rounds` timed calls, after `rounds / 5` untimed ones.
fn median(rounds: usize, mut op: impl FnMut()) -> Duration {
    for _ in 0..rounds / 5 {
        op();
    }
    let mut times: Vec<Duration> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            op();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn main() {
    let servers: Vec<TestServer> = (0..5).map(|_| TestServer::start()).collect();
    let healthy = Nodes::new(&servers);
    let delayed = Nodes::new(&servers);
    let blackholed = Nodes::new(&servers);
    let (healthy_group, delayed_group, blackholed_group) =
        (healthy.group(), delayed.group(), blackholed.group());
    for p in &delayed.proxies {
        p.set_mode(Mode::Delay(Duration::from_millis(2)));
    }
    blackholed.proxies[4].set_mode(Mode::Blackhole);
    let crate_delayed = redlock::RedLock::new(delayed.urls());
    let (acquire, release) = (redis::Script::new(ACQUIRE), redis::Script::new(RELEASE));
    let connect = |url: &str| redis::Client::open(url).unwrap().get_connection().unwrap();
    let mut raw = connect(&healthy.proxies[0].url());
    let mut raw_delayed = connect(&delayed.proxies[0].url());

    println!("medians of acquire+release (taken first, before criterion):");
    let raw_m = median(400, || raw_cycle(&mut raw, &acquire, &release));
    let healthy_m = median(400, || group_cycle(&healthy_group));
    let blackholed_m = median(400, || group_cycle(&blackholed_group));
    let raw_delayed_m = median(40, || raw_cycle(&mut raw_delayed, &acquire, &release));
    let delayed_m = median(40, || group_cycle(&delayed_group));
    let crate_m = median(20, || crate_cycle(&crate_delayed));
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!("  raw single node                     {raw_m:>10.3?}");
    println!(
        "  5 nodes healthy                     {healthy_m:>10.3?}  ({:.2}x raw)",
        ratio(healthy_m, raw_m)
    );
    println!(
        "  5 nodes, 1 blackholed               {blackholed_m:>10.3?}  ({:.2}x healthy)",
        ratio(blackholed_m, healthy_m)
    );
    println!("  raw single node, 2 ms delay         {raw_delayed_m:>10.3?}");
    println!(
        "  5 nodes, 2 ms delay                 {delayed_m:>10.3?}  ({:.2}x raw delayed)",
        ratio(delayed_m, raw_delayed_m)
    );
    println!(
        "  redlock crate, 5 nodes, 2 ms delay  {crate_m:>10.3?}  ({:.2}x raw delayed, {:.2}x ours)",
        ratio(crate_m, raw_delayed_m),
        ratio(crate_m, delayed_m)
    );

    let mut c = Criterion::default()
        .configure_from_args()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    {
        let mut g = c.benchmark_group("acquire+release");
        g.bench_function("raw single node", |b| {
            b.iter(|| raw_cycle(&mut raw, &acquire, &release))
        });
        g.bench_function("5 nodes healthy", |b| {
            b.iter(|| group_cycle(&healthy_group))
        });
        g.bench_function("5 nodes, 1 blackholed", |b| {
            b.iter(|| group_cycle(&blackholed_group))
        });
        g.bench_function("raw single node, 2 ms delay", |b| {
            b.iter(|| raw_cycle(&mut raw_delayed, &acquire, &release))
        });
        g.bench_function("5 nodes, 2 ms delay", |b| {
            b.iter(|| group_cycle(&delayed_group))
        });
        g.sample_size(10);
        g.bench_function("redlock crate, 5 nodes, 2 ms delay", |b| {
            b.iter(|| crate_cycle(&crate_delayed))
        });
        g.finish();
    }
}
