//! Redlock acquire+release latency on five local servers, each behind a
//! fault-injecting proxy: healthy, one node blackholed, and every node behind a
//! 2 ms delay (beside the `redlock` crate v2), with the raw single-node round
//! trip in the same run; then five nodes 20 ms away (a 10 ms delay each way)
//! with default options: group creation against one node's connect, acquire
//! against one node's round trip, beside the `redlock` crate over the same
//! links, and a far minority (two nodes 200 ms away) with and without a dead
//! node. Prints medians and ratios first, then runs criterion on the fast
//! cases.
//!
//! `cargo bench --bench redlock`; needs `redis-server` on the `PATH`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use criterion::Criterion;
use respire_coordination::{Coordinator, RedlockGroup, RedlockOptions, ReleaseOutcome};
use support::{FaultProxy, Mode, TestServer};

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

    fn delay(&self, round_trip: Duration) {
        for p in &self.proxies {
            p.set_mode(Mode::Delay(round_trip / 2));
        }
    }

    fn connect(&self, options: RedlockOptions) -> RedlockGroup {
        let urls = self.urls();
        let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
        RedlockGroup::connect(&urls, options).expect("group")
    }
}

/// TCP connect and one `PING` on it: the least any client needs to know a
/// connection to `addr` works.
fn tcp_connect(addr: std::net::SocketAddr) {
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.set_nodelay(true).unwrap();
    tcp.write_all(b"PING\r\n").unwrap();
    let mut pong = [0u8; 7];
    tcp.read_exact(&mut pong).unwrap();
}

fn ping(conn: &mut redis::Connection) {
    let _: String = redis::cmd("PING").query(conn).unwrap();
}

/// One acquire (within a 3 s wait) and its release; returns how long the
/// acquire took.
fn group_acquire(group: &RedlockGroup) -> Duration {
    let t = Instant::now();
    let guard = group
        .lock("bench:far")
        .unwrap()
        .acquire_timeout(TTL, Duration::from_secs(3))
        .unwrap()
        .expect("free");
    let took = t.elapsed();
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    took
}

/// One acquire (within a 3 s wait) and release; returns how long both took.
fn group_cycle_timed(group: &RedlockGroup) -> Duration {
    let t = Instant::now();
    let guard = group
        .lock("bench:far")
        .unwrap()
        .acquire_timeout(TTL, Duration::from_secs(3))
        .unwrap()
        .expect("free");
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    t.elapsed()
}

/// The median of `rounds` durations that `op` reports, after `rounds / 5`
/// untimed ones.
fn median_of(rounds: usize, mut op: impl FnMut() -> Duration) -> Duration {
    for _ in 0..rounds / 5 {
        op();
    }
    let mut times: Vec<Duration> = (0..rounds).map(|_| op()).collect();
    times.sort();
    times[times.len() / 2]
}

/// Five fresh nodes 20 ms away, with default options, beside the `redlock`
/// crate; then two of them 200 ms away, and one dead.
fn distant() {
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    let servers: Vec<TestServer> = (0..5).map(|_| TestServer::start()).collect();
    let far = Nodes::new(&servers);
    far.delay(Duration::from_millis(20));
    let release = redis::Script::new(RELEASE);
    let one_connect = median(10, || tcp_connect(far.proxies[0].addr()));
    let mut raw = redis::Client::open(far.proxies[0].url())
        .unwrap()
        .get_connection()
        .unwrap();
    let one_round_trip = median(20, || ping(&mut raw));
    let raw_cycle_m = median(10, || raw_cycle(&mut raw, &release));
    let created = median_of(5, || {
        let t = Instant::now();
        let group = far.connect(RedlockOptions::default());
        let took = t.elapsed();
        drop(group);
        took
    });
    let group = far.connect(RedlockOptions::default());
    let acquire_m = median_of(20, || group_acquire(&group));
    let cycle_m = median_of(20, || group_cycle_timed(&group));
    let rl = redlock::RedLock::new(far.urls());
    let crate_acquire = median_of(10, || {
        let t = Instant::now();
        let lock = rl.lock(b"bench:far-crate", 10_000).unwrap().expect("free");
        let took = t.elapsed();
        rl.unlock(&lock);
        took
    });
    let crate_cycle = median(10, || crate_cycle_on(&rl, b"bench:far-crate"));
    println!("five nodes 20 ms away, default options:");
    println!("  one node: connect + first answer      {one_connect:>10.3?}");
    println!("  one node: round trip (PING)           {one_round_trip:>10.3?}");
    println!("  one node: raw acquire+release         {raw_cycle_m:>10.3?}");
    println!(
        "  group creation                        {created:>10.3?}  ({:.2}x one node's connect)",
        ratio(created, one_connect)
    );
    println!(
        "  acquire                               {acquire_m:>10.3?}  ({:.2}x one round trip)",
        ratio(acquire_m, one_round_trip)
    );
    println!(
        "  acquire+release                       {cycle_m:>10.3?}  ({:.2}x raw acquire+release)",
        ratio(cycle_m, raw_cycle_m)
    );
    println!(
        "  redlock crate acquire                 {crate_acquire:>10.3?}  ({:.2}x one round trip, \
         {:.2}x ours)",
        ratio(crate_acquire, one_round_trip),
        ratio(crate_acquire, acquire_m)
    );
    println!(
        "  redlock crate acquire+release         {crate_cycle:>10.3?}  ({:.2}x ours)",
        ratio(crate_cycle, cycle_m)
    );
    drop(group);

    // A node timeout long enough for nodes 200 ms away.
    let group = far.connect(RedlockOptions {
        node_timeout: Duration::from_millis(500),
        ..RedlockOptions::default()
    });
    let healthy = median_of(10, || group_acquire(&group));
    for p in &far.proxies[3..] {
        p.set_mode(Mode::Delay(Duration::from_millis(100)));
    }
    let mut raw_far = redis::Client::open(far.proxies[3].url())
        .unwrap()
        .get_connection()
        .unwrap();
    let far_round_trip = median(3, || ping(&mut raw_far));
    let two_far = median_of(10, || group_acquire(&group));
    servers[2].kill();
    let two_far_one_dead = median_of(10, || group_acquire(&group));
    far.proxies[3].set_mode(Mode::Delay(Duration::from_millis(10)));
    let one_far_one_dead = median_of(10, || group_acquire(&group));
    println!("five nodes 20 ms away, node timeout 500 ms, acquire:");
    println!("  healthy                               {healthy:>10.3?}");
    println!(
        "  2 of 5 nodes 200 ms away              {two_far:>10.3?}  ({:.2}x healthy)",
        ratio(two_far, healthy)
    );
    println!(
        "  1 of 5 nodes 200 ms away, 1 dead      {one_far_one_dead:>10.3?}  ({:.2}x healthy)",
        ratio(one_far_one_dead, healthy)
    );
    println!(
        "  2 of 5 nodes 200 ms away, 1 dead      {two_far_one_dead:>10.3?}  ({:.2}x healthy; the \
         quorum needs a far node: {:.2}x its round trip {far_round_trip:.3?})",
        ratio(two_far_one_dead, healthy),
        ratio(two_far_one_dead, far_round_trip)
    );
}

/// One raw acquire+release on a plain connection: the floor for one node.
fn raw_cycle(conn: &mut redis::Connection, release: &redis::Script) {
    let _: Option<String> = redis::cmd("SET")
        .arg("bench:raw")
        .arg("me")
        .arg("NX")
        .arg("PX")
        .arg(10_000)
        .query(conn)
        .unwrap();
    let _: i64 = release
        .key("bench:raw")
        .arg("me")
        .arg("exact")
        .invoke(conn)
        .unwrap();
}

fn group_cycle(group: &RedlockGroup) {
    let guard = group
        .lock("bench:group")
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .expect("free");
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
}

fn crate_cycle(rl: &redlock::RedLock) {
    crate_cycle_on(rl, b"bench:crate");
}

fn crate_cycle_on(rl: &redlock::RedLock, key: &[u8]) {
    let lock = rl.lock(key, 10_000).unwrap().expect("free");
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
    let release = redis::Script::new(RELEASE);
    let connect = |url: &str| redis::Client::open(url).unwrap().get_connection().unwrap();
    let mut raw = connect(&healthy.proxies[0].url());
    let mut raw_delayed = connect(&delayed.proxies[0].url());

    println!("medians of acquire+release (taken first, before criterion):");
    let raw_m = median(400, || raw_cycle(&mut raw, &release));
    let healthy_m = median(400, || group_cycle(&healthy_group));
    let blackholed_m = median(400, || group_cycle(&blackholed_group));
    let raw_delayed_m = median(40, || raw_cycle(&mut raw_delayed, &release));
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
    distant();

    let mut c = Criterion::default()
        .configure_from_args()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    {
        let mut g = c.benchmark_group("acquire+release");
        g.bench_function("raw single node", |b| {
            b.iter(|| raw_cycle(&mut raw, &release))
        });
        g.bench_function("5 nodes healthy", |b| {
            b.iter(|| group_cycle(&healthy_group))
        });
        g.bench_function("5 nodes, 1 blackholed", |b| {
            b.iter(|| group_cycle(&blackholed_group))
        });
        g.bench_function("raw single node, 2 ms delay", |b| {
            b.iter(|| raw_cycle(&mut raw_delayed, &release))
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
