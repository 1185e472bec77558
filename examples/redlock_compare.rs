//! Why a `RedlockGroup` fans out on persistent per-node workers: prints median
//! acquire and acquire+release latencies for five throwaway local servers, each
//! behind a fault-injecting proxy, for
//!
//! - plain sequential calls (one connection per node, one node after another),
//! - scoped threads spawned per operation (`std::thread::scope`, one per node),
//! - `RedlockGroup` (one long-lived worker per node, returns at quorum),
//! - the `redlock` crate (v2, sync API),
//!
//! with healthy nodes, with one node 20 ms slow, with every node behind a
//! 2 ms delay each way, and with every node 20 ms away (10 ms each way, as
//! between zones), beside the raw single-node round trip. The group connects
//! every node when it is made, so no operation pays for a connection.
//!
//! Run with `cargo run --release --example redlock_compare`. Needs
//! `redis-server` on the `PATH`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use respire_coordination::{Coordinator, RedlockGroup, RedlockOptions, ReleaseOutcome};
use support::{FaultProxy, Mode, TestServer};

const RELEASE: &str = include_str!("../src/scripts/lease_release.lua");
const TTL: Duration = Duration::from_secs(10);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let servers: Vec<TestServer> = (0..5).map(|_| TestServer::start()).collect();
    let proxies: Vec<FaultProxy> = servers
        .iter()
        .map(|s| FaultProxy::start(s.addr()))
        .collect();
    println!("5 redis-servers, each behind a fault-injecting proxy; ttl 10 s, node timeout 200 ms");
    let direct: Vec<String> = servers.iter().map(TestServer::url).collect();
    compare("direct loopback, no proxy", &direct, &|| {}, 400)?;
    let urls: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
    let scenarios: [(&str, &dyn Fn(), usize); 4] = [
        ("through proxies, healthy", &|| {}, 400),
        (
            "through proxies, one node 20 ms slow",
            &|| proxies[4].set_mode(Mode::Delay(Duration::from_millis(10))),
            60,
        ),
        (
            "through proxies, every node 2 ms each way",
            &|| {
                for p in &proxies {
                    p.set_mode(Mode::Delay(Duration::from_millis(2)))
                }
            },
            60,
        ),
        (
            "through proxies, every node 20 ms away",
            &|| {
                for p in &proxies {
                    p.set_mode(Mode::Delay(Duration::from_millis(10)))
                }
            },
            20,
        ),
    ];
    for (name, setup, rounds) in scenarios {
        compare(name, &urls, setup, rounds)?;
        for p in &proxies {
            p.set_mode(Mode::Pass);
        }
    }
    Ok(())
}

/// Runs every contender against the nodes at `urls` after `setup`.
fn compare(
    name: &str,
    urls: &[String],
    setup: &dyn Fn(),
    rounds: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let url_refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let options = RedlockOptions {
        node_timeout: Duration::from_millis(200),
        ..RedlockOptions::default()
    };
    let group = RedlockGroup::connect(&url_refs, options)?;
    let mut conns = urls
        .iter()
        .map(|u| redis::Client::open(u.as_str())?.get_connection())
        .collect::<Result<Vec<_>, _>>()?;
    let release = redis::Script::new(RELEASE);
    let single = Coordinator::connect(&urls[0])?.lock("compare:single")?;
    let crate_redlock = redlock::RedLock::new(urls.to_vec());

    setup();
    {
        println!("\n== {name} ({rounds} rounds, medians) ==");
        let raw = time(rounds, || {
            let t = Instant::now();
            let _: Option<String> = redis::cmd("SET")
                .arg("compare:raw")
                .arg("me")
                .arg("NX")
                .arg("PX")
                .arg(10_000)
                .query(&mut conns[0])
                .unwrap();
            let a = t.elapsed();
            let _: i64 = release
                .key("compare:raw")
                .arg("me")
                .arg("exact")
                .invoke(&mut conns[0])
                .unwrap();
            (a, t.elapsed())
        });
        report("raw single-node round trip", raw, raw);
        let lock = time(rounds, || {
            let t = Instant::now();
            let g = single.try_acquire(TTL).unwrap().unwrap();
            let a = t.elapsed();
            g.release().unwrap();
            (a, t.elapsed())
        });
        report("one node, Lock::try_acquire", lock, raw);
        let sequential = time(rounds, || {
            let t = Instant::now();
            for c in conns.iter_mut() {
                let _: Option<String> = redis::cmd("SET")
                    .arg("compare:seq")
                    .arg("me")
                    .arg("NX")
                    .arg("PX")
                    .arg(10_000)
                    .query(c)
                    .unwrap();
            }
            let a = t.elapsed();
            for c in conns.iter_mut() {
                let _: i64 = release
                    .key("compare:seq")
                    .arg("me")
                    .arg("exact")
                    .invoke(c)
                    .unwrap();
            }
            (a, t.elapsed())
        });
        report("5 nodes, sequential calls", sequential, raw);
        let scoped = time(rounds, || {
            let t = Instant::now();
            std::thread::scope(|s| {
                for c in conns.iter_mut() {
                    s.spawn(move || {
                        let _: Option<String> = redis::cmd("SET")
                            .arg("compare:scoped")
                            .arg("me")
                            .arg("NX")
                            .arg("PX")
                            .arg(10_000)
                            .query(c)
                            .unwrap();
                    });
                }
            });
            let a = t.elapsed();
            std::thread::scope(|s| {
                for c in conns.iter_mut() {
                    let release = &release;
                    s.spawn(move || {
                        let _: i64 = release
                            .key("compare:scoped")
                            .arg("me")
                            .arg("exact")
                            .invoke(c)
                            .unwrap();
                    });
                }
            });
            (a, t.elapsed())
        });
        report("5 nodes, scoped threads per operation", scoped, raw);
        let ours = time(rounds, || {
            let t = Instant::now();
            let g = group
                .lock("compare:group")
                .unwrap()
                .try_acquire(TTL)
                .unwrap()
                .unwrap();
            let a = t.elapsed();
            assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
            (a, t.elapsed())
        });
        report("5 nodes, RedlockGroup (per-node workers)", ours, raw);
        let theirs = time(rounds.min(100), || {
            let t = Instant::now();
            let lock = crate_redlock
                .lock(b"compare:crate", 10_000)
                .unwrap()
                .expect("free");
            let a = t.elapsed();
            crate_redlock.unlock(&lock);
            (a, t.elapsed())
        });
        report("5 nodes, redlock crate v2", theirs, raw);
        println!(
            "  RedlockGroup vs sequential: {:.2}x faster acquire, vs scoped threads {:.2}x, \
             vs redlock crate {:.2}x",
            ratio(sequential.0, ours.0),
            ratio(scoped.0, ours.0),
            ratio(theirs.0, ours.0),
        );
    }
    Ok(())
}

/// Median acquire and acquire+release times over `rounds`, after a warm-up.
fn time(rounds: usize, mut op: impl FnMut() -> (Duration, Duration)) -> (Duration, Duration) {
    for _ in 0..rounds / 10 + 1 {
        op();
    }
    let (mut a, mut b): (Vec<_>, Vec<_>) = (0..rounds).map(|_| op()).unzip();
    a.sort();
    b.sort();
    (a[a.len() / 2], b[b.len() / 2])
}

fn report(name: &str, (acquire, cycle): (Duration, Duration), raw: (Duration, Duration)) {
    println!(
        "  {name:<42} acquire {acquire:>11.3?} ({:>5.2}x raw)   acquire+release {cycle:>11.3?} \
         ({:>5.2}x raw)",
        ratio(acquire, raw.0),
        ratio(cycle, raw.1)
    );
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}
