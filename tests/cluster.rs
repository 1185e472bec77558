//! The primitives on a real Redis Cluster (three primaries, one replica each):
//! routing by slot, per-primary tracking and renewal, and what happens while
//! slots move and primaries fail over — `MIGRATE`, a forced slot takeover,
//! `TRYAGAIN` while a slot's keys are split, `CLUSTER FAILOVER`, a stopped
//! primary.
//!
//! Tests that leave the cluster as they found it share one; each that moves
//! slots or fails nodes over starts its own. Run with `--nocapture` to see
//! the measured figures (lines starting with `figure`).

mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use respire_coordination::{
    CancelToken, Coordinator, Error, RedlockGroup, RedlockOptions, ReleaseOutcome, key_slot,
};
use support::{
    TestCluster, TestServer, local_instant, server_now, shared_cluster, unique_prefix, wait_until,
};

/// Set in a copy of this test binary started by a test below.
const CHILD_ENV: &str = "RESPIRE_CLUSTER_CHILD";

fn figure(name: &str, value: Duration) {
    println!("figure {name} = {:.1} ms", value.as_secs_f64() * 1000.0);
}

/// Nanoseconds since the Unix epoch: a clock every process on the host shares.
fn wall_ns() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos() as i128
}

/// Captures this binary's log records, so tests can check what was logged.
struct Capture {
    lines: Mutex<Vec<String>>,
}

impl log::Log for Capture {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            let line = format!("{} {}", record.level(), record.args());
            self.lines.lock().unwrap().push(line);
        }
    }

    fn flush(&self) {}
}

static CAPTURE: Capture = Capture {
    lines: Mutex::new(Vec::new()),
};

fn capture_logs() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        log::set_logger(&CAPTURE).expect("no other logger");
        log::set_max_level(log::LevelFilter::Info);
    });
}

/// Logged lines containing `part`.
fn logged(part: &str) -> Vec<String> {
    CAPTURE
        .lines
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains(part))
        .cloned()
        .collect()
}

/// One hash tag per current primary, `(node index, "{…}")`, each made unique
/// by `name`.
fn tags_per_primary(cluster: &TestCluster, name: &str) -> Vec<(usize, String)> {
    let view = cluster.agreed_view();
    let primaries = cluster.primaries();
    let base = unique_prefix(name);
    let mut found: Vec<(usize, String)> = Vec::new();
    for n in 0.. {
        let tag = format!("{{{base}{n}}}");
        let owner = view.owner_of(key_slot(tag.as_bytes())).expect("an owner");
        let index = cluster.index_of_id(&owner.id).expect("a known node");
        if !found.iter().any(|(i, _)| *i == index) {
            found.push((index, tag));
        }
        if found.len() == primaries.len() {
            break;
        }
    }
    found.sort();
    found
}

/// A hash tag whose slot is on primary `primary`.
fn tag_on(cluster: &TestCluster, primary: usize, name: &str) -> String {
    tags_per_primary(cluster, name)
        .into_iter()
        .find(|(i, _)| *i == primary)
        .expect("a tag on every primary")
        .1
}

fn coordinator(cluster: &TestCluster) -> Coordinator {
    let seeds = cluster.seed_urls();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    Coordinator::cluster(&seeds).expect("connect to the cluster")
}

fn builder(cluster: &TestCluster) -> respire_coordination::CoordinatorBuilder {
    let seeds = cluster.seed_urls();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    Coordinator::cluster_builder(&seeds)
}

/// Acquire attempts and releases node `index` has served
/// ([`support::script_calls`]).
fn node_script_calls(cluster: &TestCluster, index: usize) -> u64 {
    support::script_calls(&mut cluster.node(index).client())
}

/// How many subscribers node `index`'s tracking connections send their
/// invalidations to: the processes that armed tracking there (each has one
/// subscriber per server).
fn tracking_processes(cluster: &TestCluster, index: usize) -> usize {
    support::client_list(&mut cluster.node(index).client())
        .into_iter()
        .filter(|c| c.get("flags").is_some_and(|f| f.contains('t')))
        .filter_map(|c| c.get("redir").cloned())
        .collect::<std::collections::HashSet<_>>()
        .len()
}

/// How many `code` error replies node `index` has sent (`INFO errorstats`).
fn error_count(cluster: &TestCluster, index: usize, code: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("errorstats")
        .query(&mut cluster.node(index).client())
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("errorstat_{code}:count=")))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------
// On the shared cluster

#[test]
fn every_primitive_works_on_every_primary() {
    let cluster = shared_cluster();
    let coord = coordinator(cluster);
    assert_eq!(coord.primaries().len(), 3, "{:?}", coord.primaries());
    for (primary, tag) in tags_per_primary(cluster, "every") {
        let lock = coord.lock(&format!("{tag}:lock")).unwrap();
        let guard = lock.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
        // The key is on the primary that owns its slot, nowhere else.
        let mut node = cluster.node(primary).client();
        let exists: bool = redis::cmd("EXISTS")
            .arg(guard.key())
            .query(&mut node)
            .unwrap();
        assert!(exists, "{} not on node {primary}", guard.key());
        assert!(lock.try_acquire(Duration::from_secs(10)).unwrap().is_none());
        assert!(guard.verify_still_held().unwrap().is_some());
        assert!(guard.reset_expiry(Duration::from_secs(20)).unwrap());
        assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);

        let fenced = coord
            .fenced_lock(&format!("{tag}:lease"), &format!("{tag}:fence"))
            .unwrap();
        let mut last = 0;
        for _ in 0..3 {
            let g = fenced
                .try_acquire(Duration::from_secs(10))
                .unwrap()
                .unwrap();
            assert!(g.fencing_token().get() > last);
            last = g.fencing_token().get();
            assert_eq!(g.replicas_acknowledged(), None);
            g.release().unwrap();
        }
    }
}

#[test]
fn read_write_leases_and_semaphores_work_on_every_primary() {
    let cluster = shared_cluster();
    let coord = coordinator(cluster);
    let other = coordinator(cluster);
    for (primary, tag) in tags_per_primary(cluster, "rwsem") {
        let rw = coord.read_write_lease(&format!("{tag}:rw")).unwrap();
        let r1 = rw
            .read()
            .try_acquire(Duration::from_secs(10))
            .unwrap()
            .unwrap();
        let r2 = other
            .read_write_lease(&format!("{tag}:rw"))
            .unwrap()
            .read()
            .try_acquire(Duration::from_secs(10))
            .unwrap()
            .unwrap();
        assert!(
            rw.write()
                .try_acquire(Duration::from_secs(10))
                .unwrap()
                .is_none()
        );
        drop((r1, r2));
        let w = rw
            .write()
            .try_acquire(Duration::from_secs(10))
            .unwrap()
            .unwrap();
        let token = w.fencing_token();
        drop(w);
        let r = rw
            .read()
            .try_acquire(Duration::from_secs(10))
            .unwrap()
            .unwrap();
        assert_eq!(r.write_epoch(), token);
        // The keys are on the slot's primary.
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{tag}*"))
            .query(&mut cluster.node(primary).client())
            .unwrap();
        assert!(!keys.is_empty(), "no keys of {tag} on node {primary}");
        drop(r);

        let sem = coord.semaphore(&format!("{tag}:sem"), 2).unwrap();
        let p1 = sem.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
        let p2 = sem.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
        assert_ne!(p1.slot(), p2.slot());
        assert!(p2.fencing_token() > p1.fencing_token());
        assert!(sem.try_acquire(Duration::from_secs(10)).unwrap().is_none());
        assert_eq!(sem.available().unwrap(), 0);
        assert_eq!(sem.holders().unwrap().len(), 2);
        drop(p1);
        assert_eq!(sem.available().unwrap(), 1);
        drop(p2);
    }
}

#[test]
fn a_cluster_url_and_seed_lists_reach_the_same_cluster() {
    let cluster = shared_cluster();
    let hosts: Vec<String> = cluster.nodes()[..2]
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port()))
        .collect();
    let coord = Coordinator::connect(&format!("redis+cluster://{}/", hosts.join(","))).unwrap();
    let tag = tag_on(cluster, cluster.primaries()[2], "url");
    let guard = coord
        .lock(&format!("{tag}:k"))
        .unwrap()
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .unwrap();
    // The other coordinator sees it held.
    let other = coordinator(cluster);
    assert!(
        other
            .lock(&format!("{tag}:k"))
            .unwrap()
            .try_acquire(Duration::from_secs(5))
            .unwrap()
            .is_none()
    );
    drop(guard);
    // A dead seed first: the next one answers.
    let dead = TestServer::start();
    let dead_url = dead.url();
    drop(dead);
    let live = cluster.seed_urls();
    let c = Coordinator::cluster(&[&dead_url, &live[0]]).unwrap();
    assert_eq!(c.primaries().len(), 3);
}

#[test]
fn waits_are_woken_by_invalidations_on_every_primary() {
    capture_logs();
    let cluster = shared_cluster();
    let holder = coordinator(cluster);
    let waiter = coordinator(cluster);
    for (primary, tag) in tags_per_primary(cluster, "wake") {
        let key = format!("{tag}:lock");
        let guard = holder
            .lock(&key)
            .unwrap()
            .try_acquire(Duration::from_secs(30))
            .unwrap()
            .unwrap();
        let lock = waiter.lock(&key).unwrap();
        let before = node_script_calls(cluster, primary);
        let waiting = thread::spawn(move || {
            let got = lock
                .acquire_timeout(Duration::from_secs(30), Duration::from_secs(20))
                .unwrap()
                .expect("acquired once released");
            (Instant::now(), got)
        });
        // The waiter's first attempt found it held.
        wait_until(
            Duration::from_secs(10),
            "the waiter's first attempt",
            || node_script_calls(cluster, primary) > before,
        );
        let released = Instant::now();
        guard.release().unwrap();
        let (acquired, got) = waiting.join().unwrap();
        let after = acquired - released;
        figure(&format!("cluster wake-up on node {primary}"), after);
        // An invalidation, not the 30 s expiry timer nor polling.
        assert!(after < Duration::from_secs(5), "woken after {after:?}");
        drop(got);
    }
    assert!(
        logged("falls back to polling").is_empty(),
        "{:?}",
        logged("polling")
    );
}

#[test]
fn keep_alive_renews_leases_on_every_primary() {
    let cluster = shared_cluster();
    let coord = builder(cluster)
        .node_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let ttl = Duration::from_millis(600);
    let guards: Vec<_> = tags_per_primary(cluster, "renew")
        .into_iter()
        .map(|(_, tag)| {
            coord
                .fenced_lock(&format!("{tag}:lease"), &format!("{tag}:fence"))
                .unwrap()
                .try_acquire(ttl)
                .unwrap()
                .unwrap()
        })
        .collect();
    let renewals: Vec<_> = guards.iter().map(|g| g.keep_alive().unwrap()).collect();
    let start = coord.renewal_stats().renewals;
    // Four TTLs: every lease needs several renewals to survive.
    let until = Instant::now() + ttl * 4;
    while Instant::now() < until {
        assert!(guards.iter().all(|g| !g.is_lost()));
        thread::sleep(Duration::from_millis(20));
    }
    assert!(coord.renewal_stats().renewals >= start + 3 * 6);
    for g in &guards {
        assert!(g.verify_still_held().unwrap().is_some());
    }
    drop(renewals);
}

#[test]
fn replication_report_counts_the_replica_of_each_primary() {
    let cluster = shared_cluster();
    let coord = builder(cluster)
        .replication(respire_coordination::Replication::Report {
            timeout: Duration::from_millis(500),
        })
        .build()
        .unwrap();
    for (_, tag) in tags_per_primary(cluster, "report") {
        let g = coord
            .fenced_lock(&format!("{tag}:lease"), &format!("{tag}:fence"))
            .unwrap()
            .try_acquire(Duration::from_secs(5))
            .unwrap()
            .unwrap();
        assert_eq!(g.replicas_acknowledged(), Some(1));
    }
}

#[test]
fn redlock_refuses_cluster_coordinators() {
    let cluster = shared_cluster();
    let nodes = vec![
        coordinator(cluster),
        coordinator(cluster),
        coordinator(cluster),
    ];
    let err = RedlockGroup::new(nodes, RedlockOptions::default()).unwrap_err();
    assert!(
        matches!(&err, Error::NotIndependent(m) if m.contains("Cluster")),
        "{err}"
    );
    // So are plain coordinators on cluster nodes.
    let urls = cluster.seed_urls();
    let urls: Vec<&str> = urls[..3].iter().map(String::as_str).collect();
    let err = RedlockGroup::connect(&urls, RedlockOptions::default()).unwrap_err();
    assert!(matches!(err, Error::NotIndependent(_)), "{err}");
}

#[test]
fn seeds_that_are_not_a_cluster_are_refused() {
    let server = support::shared_server();
    let err = Coordinator::cluster(&[&server.url()]).unwrap_err();
    assert!(
        matches!(&err, Error::Topology(m) if m.contains("not a Redis Cluster node")),
        "{err}"
    );
    let dead = TestServer::start();
    let url = dead.url();
    drop(dead);
    let err = Coordinator::cluster(&[&url]).unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err}");
    let cluster = shared_cluster();
    let url = cluster.seed_urls()[0].replace("redis://", "redis://nobody:wrong@");
    let err = Coordinator::cluster(&[&url]).unwrap_err();
    assert!(matches!(err, Error::Auth { .. }), "{err}");
}

// ---------------------------------------------------------------------------
// Slots that move

/// A copy of this binary started by [`waiters_follow_a_migrated_slot`]: ten
/// waiters on one lock, each taking it once and releasing it at once.
/// Prints `calling` when they start, then `grant <acquired ns> <release ns>`
/// per grant and `fallbacks <n>` at the end.
#[test]
#[ignore = "run by waiters_follow_a_migrated_slot in a child process"]
fn child_waiters() {
    let seeds = std::env::var(CHILD_ENV).expect("started by waiters_follow_a_migrated_slot");
    capture_logs();
    let seeds: Vec<&str> = seeds.split(',').collect();
    let key = std::env::var("RESPIRE_CLUSTER_KEY").unwrap();
    let coord = Coordinator::cluster(&seeds).unwrap();
    let lock = coord.lock(&key).unwrap();
    let cancel = CancelToken::new();
    let start = Arc::new(Barrier::new(10));
    let out = Arc::new(Mutex::new(std::io::stdout()));
    writeln!(out.lock().unwrap(), "calling").unwrap();
    let threads: Vec<_> = (0..10)
        .map(|_| {
            let (lock, cancel, start, out) =
                (lock.clone(), cancel.clone(), start.clone(), out.clone());
            thread::spawn(move || {
                start.wait();
                let guard = lock.acquire(Duration::from_secs(30), &cancel).unwrap();
                let acquired = wall_ns();
                let release = wall_ns();
                guard.release().unwrap();
                writeln!(out.lock().unwrap(), "grant {acquired} {release}").unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let fallbacks = logged("falls back to polling").len();
    writeln!(out.lock().unwrap(), "fallbacks {fallbacks}").unwrap();
}

/// Child processes killed when the test ends, also when it fails: a waiter
/// left behind would hold the harness's output pipe open.
struct Reap(Vec<std::process::Child>);

impl Drop for Reap {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn waiters_follow_a_migrated_slot() {
    let cluster = TestCluster::start();
    let [a, b, ..] = cluster.primaries()[..] else {
        panic!("three primaries");
    };
    let tag = tag_on(&cluster, a, "migrate");
    let key = format!("{tag}:job");
    let slot = key_slot(key.as_bytes());
    let holder = coordinator(&cluster);
    let guard = holder
        .lock(&key)
        .unwrap()
        .try_acquire(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    assert_eq!(tracking_processes(&cluster, a), 0);
    let exe = std::env::current_exe().unwrap();
    let mut children = Reap(
        (0..2)
            .map(|_| {
                Command::new(&exe)
                    .args([
                        "--exact",
                        "child_waiters",
                        "--ignored",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env(CHILD_ENV, cluster.seed_urls().join(","))
                    .env("RESPIRE_CLUSTER_KEY", &key)
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect(),
    );
    let lines: Arc<Mutex<Vec<String>>> = Arc::default();
    let readers: Vec<_> = children
        .0
        .iter_mut()
        .map(|c| {
            let out = BufReader::new(c.stdout.take().unwrap());
            let lines = lines.clone();
            thread::spawn(move || {
                for line in out.lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(line);
                }
            })
        })
        .collect();
    // Each process's first waiter made its tracked attempt on the old owner:
    // a connection there tracks keys for that process's subscriber. (The
    // others of a process queue behind their first and send nothing.)
    wait_until(Duration::from_secs(20), "both processes waiting", || {
        tracking_processes(&cluster, a) >= 2
    });
    let on_b = node_script_calls(&cluster, b);
    let moved = Instant::now();
    cluster.migrate_slot(slot, b);
    figure("migrate_slot", moved.elapsed());
    // Each process's first waiter re-checked on the new owner (woken by the
    // source's invalidation or by the slot-map change), arming tracking there.
    wait_until(
        Duration::from_secs(10),
        "re-checks on the new owner",
        || node_script_calls(&cluster, b) >= on_b + 2,
    );
    let released = wall_ns();
    guard.release().unwrap();
    for c in &mut children.0 {
        assert!(c.wait().unwrap().success());
    }
    for r in readers {
        r.join().unwrap();
    }
    let lines = lines.lock().unwrap().clone();
    let mut grants: Vec<(i128, i128)> = lines
        .iter()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.first() == Some(&"grant")).then(|| (f[1].parse().unwrap(), f[2].parse().unwrap()))
        })
        .collect();
    assert_eq!(grants.len(), 20, "{lines:?}");
    let fallbacks: usize = lines
        .iter()
        .filter_map(|l| l.strip_prefix("fallbacks "))
        .map(|n| n.parse::<usize>().unwrap())
        .sum();
    assert_eq!(fallbacks, 0, "a waiter fell back to polling");
    grants.sort();
    let mut previous_release = released;
    let mut gaps = Vec::new();
    for (acquired, release) in &grants {
        assert!(*acquired >= previous_release, "overlapping grants");
        gaps.push(Duration::from_nanos((acquired - previous_release) as u64));
        previous_release = *release;
    }
    gaps.sort();
    figure("migrated hand-off median", gaps[gaps.len() / 2]);
    figure("migrated hand-off max", *gaps.last().unwrap());
    // Woken by invalidations from the new owner: far from the 30 s expiry
    // timer, and no poll ran.
    assert!(
        *gaps.last().unwrap() < Duration::from_secs(5),
        "hand-offs {gaps:?}"
    );
}

#[test]
fn a_forced_slot_takeover_flags_the_holder_and_wakes_the_waiter() {
    let cluster = TestCluster::start();
    let [a, b, ..] = cluster.primaries()[..] else {
        panic!("three primaries");
    };
    let refresh = Duration::from_millis(200);
    let coord = builder(&cluster).topology_refresh(refresh).build().unwrap();
    let tag = tag_on(&cluster, a, "takeover");
    let key = format!("{tag}:job");
    let slot = key_slot(key.as_bytes());
    let lock = coord.lock(&key).unwrap();
    let ttl = Duration::from_secs(30);
    let guard = lock.try_acquire(ttl).unwrap().unwrap();
    let loss_deadline = Instant::now() + guard.remaining_estimate();
    let signal = guard.lost_signal().clone();
    let before = node_script_calls(&cluster, a);
    // A second coordinator, with the default 1 s refresh.
    let waiter_lock = coordinator(&cluster).lock(&key).unwrap();
    let waiter = thread::spawn(move || {
        let g = waiter_lock
            .acquire_timeout(ttl, Duration::from_secs(25))
            .unwrap()
            .expect("acquired on the new owner");
        (Instant::now(), g)
    });
    wait_until(
        Duration::from_secs(10),
        "the waiter's first attempt",
        || node_script_calls(&cluster, a) > before,
    );
    let watcher = thread::spawn(move || {
        let lost = signal.recv_timeout(Duration::from_secs(20));
        (lost.unwrap_err().is_disconnected(), Instant::now())
    });
    let started = Instant::now();
    cluster.reassign_slot(slot, b);
    let agreed = Instant::now();
    let (closed, flagged) = watcher.join().unwrap();
    assert!(closed, "the loss signal never closed");
    assert!(guard.is_lost());
    assert!(flagged < loss_deadline);
    let (woken, g) = waiter.join().unwrap();
    figure(
        "takeover: every node agreed, after the start",
        agreed - started,
    );
    figure(
        "takeover: holder flagged lost, after the start",
        flagged - started,
    );
    figure(
        "takeover: waiter acquired, after the start",
        woken - started,
    );
    if woken > agreed {
        figure(
            "takeover: waiter acquired, after every node agreed",
            woken - agreed,
        );
    }
    // The new owner is the only place the waiter's lease can be.
    let exists: bool = redis::cmd("EXISTS")
        .arg(g.key())
        .query(&mut cluster.node(b).client())
        .unwrap();
    assert!(exists);
    // Well before the 30 s expiry: a refresh (200 ms) after the change
    // reached the node it reads, plus a round trip.
    assert!(woken - started < Duration::from_secs(10));
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::TakenOver);
}

#[test]
fn a_fenced_acquire_rides_out_a_split_slot() {
    let cluster = TestCluster::start();
    let [a, b, ..] = cluster.primaries()[..] else {
        panic!("three primaries");
    };
    let coord = coordinator(&cluster);
    let tag = tag_on(&cluster, a, "split");
    let lock = coord
        .fenced_lock(&format!("{tag}:lease"), &format!("{tag}:fence"))
        .unwrap();
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let g = lock.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
        tokens.push(g.fencing_token().get());
    }
    // Two more keys in the slot, so that it can be split.
    let mut node = cluster.node(a).client();
    for i in 0..2 {
        let () = redis::cmd("SET")
            .arg(format!("{tag}:filler{i}"))
            .arg("x")
            .query(&mut node)
            .unwrap();
    }
    let slot = key_slot(tag.as_bytes());
    let migration = cluster.migrate_slot_half(slot, b);
    let tryagain = error_count(&cluster, a, "TRYAGAIN") + error_count(&cluster, b, "TRYAGAIN");
    let waiting = {
        let lock = lock.clone();
        thread::spawn(move || {
            lock.acquire_timeout(Duration::from_secs(10), Duration::from_secs(20))
                .map(|g| g.map(|g| g.fencing_token().get()))
        })
    };
    // The acquire is answered TRYAGAIN while the keys are split.
    wait_until(Duration::from_secs(10), "a TRYAGAIN", || {
        error_count(&cluster, a, "TRYAGAIN") + error_count(&cluster, b, "TRYAGAIN") > tryagain
    });
    let finished = Instant::now();
    migration.finish();
    let token = waiting
        .join()
        .unwrap()
        .expect("no error surfaced")
        .expect("acquired after the move");
    figure(
        "split slot: acquired after the move began to finish",
        finished.elapsed(),
    );
    tokens.push(token);
    let g = lock.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    tokens.push(g.fencing_token().get());
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
    let exists: bool = redis::cmd("EXISTS")
        .arg(g.key())
        .query(&mut cluster.node(b).client())
        .unwrap();
    assert!(exists, "the lease is on the new owner");
}

#[test]
fn a_kept_alive_lease_is_renewed_through_ask_while_its_slot_migrates() {
    let cluster = TestCluster::start();
    let [a, b, ..] = cluster.primaries()[..] else {
        panic!("three primaries");
    };
    let coord = builder(&cluster)
        .node_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let tag = tag_on(&cluster, a, "ask");
    let ttl = Duration::from_millis(600);
    let guard = coord
        .lock(&format!("{tag}:lease"))
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .unwrap();
    let renewal = guard.keep_alive().unwrap();
    // The key moves to b while the slot stays a's (MIGRATING on a, IMPORTING
    // on b): each renewal sent to a is answered `ASK`, and only the same
    // renewal sent on to b with `ASKING` keeps the key alive there.
    let migration = cluster.begin_migration(key_slot(tag.as_bytes()), b);
    assert_eq!(migration.move_keys(usize::MAX), 1);
    let moved = Instant::now();
    let asks = error_count(&cluster, a, "ASK");
    // Two TTLs after the move, and three renewals answered `ASK` by then: a
    // key no renewal reached on b is gone.
    wait_until(Duration::from_secs(10), "two TTLs and three ASKs", || {
        moved.elapsed() > ttl * 2 && error_count(&cluster, a, "ASK") >= asks + 3
    });
    let mut node_b = cluster.node(b).client();
    let (_, pttl): ((), i64) = redis::pipe()
        .cmd("ASKING")
        .cmd("PTTL")
        .arg(guard.key())
        .query(&mut node_b)
        .unwrap();
    assert!(pttl > 0, "renewed on b: PTTL {pttl}");
    assert!(!guard.is_lost());
    migration.finish();
    drop(renewal);
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
}

// ---------------------------------------------------------------------------
// Failover

#[test]
fn a_kept_alive_lease_survives_a_manual_failover() {
    let cluster = TestCluster::start();
    let primary = cluster.primaries()[0];
    let replica = cluster.replica_of(primary);
    let coord = coordinator(&cluster);
    let tag = tag_on(&cluster, primary, "failover");
    let lock = coord
        .fenced_lock(&format!("{tag}:lease"), &format!("{tag}:fence"))
        .unwrap();
    let ttl = Duration::from_secs(10);
    let guard = lock.try_acquire(ttl).unwrap().unwrap();
    let renewal = guard.keep_alive().unwrap();
    let signal = guard.lost_signal().clone();
    let took = cluster.failover(replica);
    figure("CLUSTER FAILOVER until seen by all", took);
    // A renewal after the failover, answered by the new primary (the old one
    // answers MOVED).
    let renewed = coord.renewal_stats().renewals;
    wait_until(
        Duration::from_secs(12),
        "a renewal after the failover",
        || coord.renewal_stats().renewals > renewed,
    );
    assert!(signal.try_recv().unwrap_err().is_empty(), "flagged lost");
    assert!(!guard.is_lost());
    let pttl: i64 = redis::cmd("PTTL")
        .arg(guard.key())
        .query(&mut cluster.node(replica).client())
        .unwrap();
    assert!(pttl > 5_000, "renewed on the new primary: pttl {pttl}");
    assert!(guard.verify_still_held().unwrap().is_some());
    drop(renewal);
    // The next grant's token is above the last.
    let last = guard.fencing_token().get();
    drop(guard);
    let g = lock.try_acquire(ttl).unwrap().unwrap();
    assert!(g.fencing_token().get() > last);
}

/// The expiry of `key` on cluster node `index` as a local instant, from the
/// node's own `PEXPIRETIME` and `TIME` (read with `READONLY` on a replica);
/// `None` when the key is gone there or has no expiry.
fn expiry_on(cluster: &TestCluster, index: usize, key: &str) -> Option<Instant> {
    let mut con = cluster.node(index).client();
    let () = redis::cmd("READONLY").query(&mut con).unwrap();
    let at: i64 = redis::cmd("PEXPIRETIME").arg(key).query(&mut con).unwrap();
    (at > 0).then(|| local_instant(at, server_now(&mut con)))
}

#[test]
fn an_extension_the_replica_never_got_bounds_the_lease_after_a_takeover() {
    let cluster = TestCluster::start();
    let primary = cluster.primaries()[0];
    let replica = cluster.replica_of(primary);
    let coord = builder(&cluster)
        .topology_refresh(Duration::from_millis(200))
        .build()
        .unwrap();
    let tag = tag_on(&cluster, primary, "unreplicated-extension");
    let lock = coord
        .fenced_lock(&format!("{tag}:lease"), &format!("{tag}:fence"))
        .unwrap();
    let guard = lock.try_acquire(Duration::from_secs(6)).unwrap().unwrap();
    let key = guard.key().to_owned();
    wait_until(Duration::from_secs(5), "the grant on the replica", || {
        expiry_on(&cluster, replica, &key).is_some()
    });
    // The replica stops applying the stream: the extension stays on the
    // primary alone.
    let mut paused = cluster.node(replica).client();
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(30_000)
        .arg("WRITE")
        .query(&mut paused)
        .unwrap();
    assert!(guard.reset_expiry(Duration::from_secs(60)).unwrap());
    assert!(guard.remaining_estimate() > Duration::from_secs(50));
    let signal = guard.lost_signal().clone();
    let flagged = thread::spawn(move || {
        let closed = signal
            .recv_timeout(Duration::from_secs(30))
            .is_err_and(|e| e.is_disconnected());
        (closed, Instant::now())
    });
    cluster.force_takeover(replica);
    let () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query(&mut paused)
        .unwrap();
    // The oracle: the new primary's own expiry of the key, the grant's.
    let ends = expiry_on(&cluster, replica, &key).expect("the new primary holds the grant");
    assert!(
        ends < Instant::now() + Duration::from_secs(6),
        "the new primary has the extension after all"
    );
    let (closed, at) = flagged.join().unwrap();
    assert!(closed, "the loss signal never closed");
    assert!(guard.is_lost());
    assert!(
        at <= ends,
        "flagged lost {:?} after the new primary's expiry",
        at - ends
    );
    figure(
        "takeover: lease flagged lost before the new primary's expiry, by",
        ends.saturating_duration_since(at),
    );
}

#[test]
fn a_stopped_primary_loses_its_leases_in_time_and_delays_no_other() {
    let cluster = TestCluster::builder()
        .node_timeout(Duration::from_secs(30))
        .start();
    let primaries = cluster.primaries();
    let (stopped, other) = (primaries[1], primaries[2]);
    let coord = builder(&cluster)
        .node_timeout(Duration::from_millis(100))
        .connect_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let ttl = Duration::from_secs(1);
    let acquire = |primary: usize, name: &str| {
        let tag = tag_on(&cluster, primary, name);
        coord
            .fenced_lock(&format!("{tag}:lease"), &format!("{tag}:fence"))
            .unwrap()
            .try_acquire(ttl)
            .unwrap()
            .unwrap()
    };
    let doomed = acquire(stopped, "stopped");
    let kept = acquire(other, "kept");
    let _renew_doomed = doomed.keep_alive().unwrap();
    let _renew_kept = kept.keep_alive().unwrap();
    let signal = doomed.lost_signal().clone();
    let renewed = coord.renewal_stats().renewals;
    wait_until(Duration::from_secs(5), "renewals of both", || {
        coord.renewal_stats().renewals >= renewed + 2
    });
    cluster.node(stopped).pause();
    let expiry = Instant::now() + doomed.remaining_estimate();
    let lost = signal.recv_deadline(expiry + Duration::from_secs(2));
    let flagged = Instant::now();
    assert!(lost.unwrap_err().is_disconnected());
    assert!(
        flagged < expiry,
        "flagged {:?} after expiry",
        flagged - expiry
    );
    figure(
        "stopped primary: loss flagged before expiry by",
        expiry - flagged,
    );
    // Meanwhile the lease on another primary kept being renewed.
    let until = Instant::now() + ttl * 2;
    while Instant::now() < until {
        assert!(
            !kept.is_lost(),
            "a stopped primary delayed another's renewal"
        );
        thread::sleep(Duration::from_millis(20));
    }
    cluster.node(stopped).resume();
    assert!(kept.verify_still_held().unwrap().is_some());
}
