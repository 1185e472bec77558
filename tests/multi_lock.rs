//! Several leases taken all together or not at all (`lock_all`,
//! `fenced_lock_all`), on real servers: bad input, a set found partly held, a
//! failure in the middle of the global order, loss of one member, keep-alive,
//! the clean-up of an unanswered grant, and eight threads in two processes
//! taking random subsets in random orders, checked on the machine's shared
//! monotonic clock, against the keys each call asked for (no partial guard)
//! and on the servers (`RESPIRE_MULTI_SECS`, 3 s by default).
//!
//! `tests/mutants/multi/*.patch` put back defects these tests must catch; each
//! names the test that catches it (`git apply` it, run that test, `git apply
//! -R` it).

mod support;
use support::Rng;
use support::ms;

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::thread;
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{
    CancelToken, Coordinator, Error, Guard, ReleaseOutcome, Replication, key_slot,
};
use support::{
    FaultProxy, Mode, TestServer, calls, coordinator, proxied_replica, script_calls,
    shared_cluster, shared_sentinel, shared_server, unique_prefix, wait_until,
};

const CHILD_ENV: &str = "RESPIRE_MULTI_CHILD";

fn cluster_coordinator(prefix: &str) -> Coordinator {
    cluster_coordinator_with(prefix, ms(500))
}

fn cluster_coordinator_with(prefix: &str, node_timeout: Duration) -> Coordinator {
    let seeds = shared_cluster().seed_urls();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    Coordinator::cluster_builder(&seeds)
        .key_prefix(prefix)
        .node_timeout(node_timeout)
        .build()
        .expect("connect to the cluster")
}

/// Whether `key` exists, asked of the server (or cluster primary) holding it.
fn exists_standalone(key: &str) -> bool {
    shared_server().client().exists(key).unwrap()
}

fn exists_cluster(key: &str) -> bool {
    shared_cluster().client_for_key(key).exists(key).unwrap()
}

// ----- bad input -------------------------------------------------------------

#[test]
fn an_empty_set_and_a_key_given_twice_are_refused_before_anything_is_sent() {
    let prefix = unique_prefix("bad");
    let coord = coordinator(&shared_server().url(), &prefix, ms(500));
    let none: [&str; 0] = [];
    let e = coord.lock_all(&none).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("at least one")),
        "{e}"
    );
    let e = coord.lock_all(&["a", "b", "a"]).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("twice")),
        "{e}"
    );
    let e = coord.lock_all(&["a", ""]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let no_pairs: [(&str, &str); 0] = [];
    let e = coord.fenced_lock_all(&no_pairs).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // A counter shared by two leases, and a lease that is another's counter.
    for pairs in [
        [("{a}l", "{a}f"), ("{a}m", "{a}f")],
        [("{a}l", "{a}f"), ("{a}f", "{a}g")],
    ] {
        let e = coord.fenced_lock_all(&pairs).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("twice")),
            "{e}"
        );
    }
    let e = coord.fenced_lock_all(&[("{a}l", "{b}f")]).unwrap_err();
    assert!(matches!(e, Error::CrossSlot { .. }), "{e}");
    // A TTL the deployment cannot keep.
    let set = coord.lock_all(&["a", "b"]).unwrap();
    let e = set.try_acquire(Duration::ZERO).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = set.try_acquire(ms(400)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let left: Vec<String> = shared_server().client().keys(format!("{prefix}*")).unwrap();
    assert!(left.is_empty(), "bad input changed {left:?}");
}

// ----- all or none on one server ------------------------------------------------

#[test]
fn a_set_partly_held_by_another_is_not_granted_and_nothing_of_it_is_set() {
    let prefix = unique_prefix("partly");
    let coord = coordinator(&shared_server().url(), &prefix, ms(500));
    let mut admin = shared_server().client();
    let keys = ["k1", "k2", "k3", "k4", "k5"];
    let physical = |k: &str| format!("{prefix}{k}");
    let set = coord.lock_all(&keys).unwrap();
    assert!(set.is_one_call());
    // An outsider holds the key in the middle.
    let () = admin.pset_ex(physical("k3"), "outsider", 60_000).unwrap();
    assert!(set.try_acquire(Duration::from_secs(10)).unwrap().is_none());
    assert!(
        set.acquire_timeout(Duration::from_secs(10), ms(300))
            .unwrap()
            .is_none()
    );
    for k in ["k1", "k2", "k4", "k5"] {
        assert!(!exists_standalone(&physical(k)), "{k} was left set");
    }
    let v: String = admin.get(physical("k3")).unwrap();
    assert_eq!(v, "outsider");

    // A key of another type: an error naming it, and nothing set.
    let () = admin.del(physical("k3")).unwrap();
    let () = admin.rpush(physical("k4"), "x").unwrap();
    let e = set.try_acquire(Duration::from_secs(10)).unwrap_err();
    assert!(
        matches!(&e, Error::BadKey { key, .. } if *key == physical("k4")),
        "{e}"
    );
    for k in ["k1", "k2", "k3", "k5"] {
        assert!(!exists_standalone(&physical(k)), "{k} was left set");
    }
    let () = admin.del(physical("k4")).unwrap();

    // Free: every key granted, each holding the same owner.
    let g = set.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    let owners: Vec<String> = keys
        .iter()
        .map(|k| admin.get(physical(k)).unwrap())
        .collect();
    assert!(owners.windows(2).all(|w| w[0] == w[1]), "{owners:?}");
    assert_eq!(
        g.keys().collect::<Vec<_>>(),
        keys.iter().map(|k| physical(k)).collect::<Vec<_>>()
    );
    // A single lock on a member is held off.
    assert!(
        coord
            .lock("k2")
            .unwrap()
            .try_acquire(Duration::from_secs(1))
            .unwrap()
            .is_none()
    );
    let released = g.release();
    assert!(
        released
            .iter()
            .all(|(_, r)| matches!(r, Ok(ReleaseOutcome::Released))),
        "{released:?}"
    );
    for k in keys {
        assert!(!exists_standalone(&physical(k)));
    }
}

#[test]
fn each_lease_of_a_fenced_set_gets_its_own_increasing_token() {
    let prefix = unique_prefix("fenced");
    let coord = coordinator(&shared_server().url(), &prefix, ms(500));
    let mut admin = shared_server().client();
    let pairs = [("{a}lease", "{a}fence"), ("{b}lease", "{b}fence")];
    let set = coord.fenced_lock_all(&pairs).unwrap();
    // The counter of b starts ahead.
    let () = admin.set(format!("{prefix}{{b}}fence"), 41).unwrap();
    let g = set.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    assert_eq!(g.fencing_token("{a}lease").unwrap().get(), 1);
    assert_eq!(g.fencing_token("{b}lease").unwrap().get(), 42);
    assert!(g.fencing_token("{c}lease").is_none());
    drop(g);
    let g = set.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    let tokens: Vec<u64> = g.fencing_tokens().iter().map(|(_, t)| t.get()).collect();
    assert_eq!(tokens, [2, 43]);
    // The lease keys hold owner:token, as a single fenced lock's do.
    let v: String = admin.get(format!("{prefix}{{b}}lease")).unwrap();
    assert!(v.ends_with(":43"), "{v}");
    assert_eq!(Guard::release(g).unwrap(), ReleaseOutcome::Released);
}

#[test]
fn behind_sentinel_a_set_of_keys_in_many_slots_is_one_call() {
    let prefix = unique_prefix("sentinel");
    let deployment = shared_sentinel();
    let urls = deployment.sentinel_urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let coord = Coordinator::sentinel_builder(&urls, deployment.service())
        .key_prefix(&prefix)
        .node_timeout(ms(500))
        .build()
        .unwrap();
    let set = coord.lock_all(&["{a}x", "{b}y", "{c}z"]).unwrap();
    assert!(set.is_one_call());
    let mut primary = deployment.primary().client();
    let () = primary
        .pset_ex(format!("{prefix}{{b}}y"), "outsider", 60_000)
        .unwrap();
    assert!(set.try_acquire(Duration::from_secs(10)).unwrap().is_none());
    for k in ["{a}x", "{c}z"] {
        assert!(!primary.exists::<_, bool>(format!("{prefix}{k}")).unwrap());
    }
    let () = primary.del(format!("{prefix}{{b}}y")).unwrap();
    let g = set.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    for k in ["{a}x", "{b}y", "{c}z"] {
        assert!(primary.exists::<_, bool>(format!("{prefix}{k}")).unwrap());
    }
    assert_eq!(Guard::release(g).unwrap(), ReleaseOutcome::Released);
}

// ----- a replication guard ------------------------------------------------------

#[test]
fn under_a_replication_guard_a_set_is_one_call_with_one_wait_and_released_whole_when_too_few_replicas_acknowledge()
 {
    let primary = TestServer::start();
    let (link, replica) = proxied_replica(&primary);
    let with = |replication| {
        Coordinator::builder(&primary.url())
            .node_timeout(ms(500))
            .replication(replication)
            .build()
            .unwrap()
    };
    // WAIT's timeout leaves a loaded machine time to acknowledge.
    let require = with(Replication::Require {
        replicas: 1,
        timeout: ms(2_000),
    });
    let pairs = [("{r}a", "{r}fa"), ("{r}b", "{r}fb"), ("{r}c", "{r}fc")];
    let set = require.fenced_lock_all(&pairs).unwrap();
    assert!(set.is_one_call());
    let (mut on_primary, mut on_replica) = (primary.client(), replica.client());
    let ttl = Duration::from_secs(5);

    // Acknowledged: one script call and one WAIT for the whole set (once the
    // server has the script), and the replica holds every lease as the
    // primary does.
    drop(set.try_acquire(ttl).unwrap().expect("free"));
    let before = [
        calls(&mut primary.client(), &["evalsha"]),
        calls(&mut primary.client(), &["wait"]),
    ];
    let g = set.try_acquire(ttl).unwrap().expect("free");
    let after = [
        calls(&mut primary.client(), &["evalsha"]),
        calls(&mut primary.client(), &["wait"]),
    ];
    assert_eq!([after[0] - before[0], after[1] - before[1]], [1, 1]);
    for m in g.members() {
        assert_eq!(m.replicas_acknowledged(), Some(1), "{}", m.key());
    }
    for (lease, _) in pairs {
        let held: String = on_primary.get(lease).unwrap();
        let copy: Option<String> = on_replica.get(lease).unwrap();
        assert_eq!(copy.as_deref(), Some(held.as_str()), "{lease}");
    }
    assert_eq!(Guard::release(g).unwrap(), ReleaseOutcome::Released);

    // The replica's link cut: WAIT answers 0 at its timeout. The set is
    // released whole and the call fails, once or in a wait.
    link.set_mode(Mode::Blackhole);
    let err = set.try_acquire(ttl).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::NotReplicated {
                key,
                acknowledged: 0,
                required: 1,
            } if key == "{r}a"
        ),
        "{err}"
    );
    for (lease, _) in pairs {
        assert!(
            !on_primary.exists::<_, bool>(lease).unwrap(),
            "{lease} left held"
        );
    }
    let err = set
        .acquire_timeout(ttl, Duration::from_secs(5))
        .unwrap_err();
    assert!(matches!(err, Error::NotReplicated { .. }), "{err}");
    for (lease, _) in pairs {
        assert!(
            !on_primary.exists::<_, bool>(lease).unwrap(),
            "{lease} left held"
        );
    }

    // `Report` keeps the set and says that no replica acknowledged it.
    let report = with(Replication::Report { timeout: ms(500) });
    let g = report
        .fenced_lock_all(&pairs)
        .unwrap()
        .try_acquire(ttl)
        .unwrap()
        .expect("free");
    for m in g.members() {
        assert_eq!(m.replicas_acknowledged(), Some(0), "{}", m.key());
        assert!(on_primary.exists::<_, bool>(m.key()).unwrap());
    }
    assert_eq!(Guard::release(g).unwrap(), ReleaseOutcome::Released);
    drop(replica);
}

// ----- a failure in the middle of the global order (cluster) ----------------------

/// Ten keys, each in a slot of its own, spread over the primaries.
fn spread_keys() -> Vec<String> {
    (0..10).map(|i| format!("{{k{i}}}:lease")).collect()
}

#[test]
fn a_failure_in_the_middle_of_the_global_order_leaves_nothing_held() {
    let prefix = unique_prefix("middle");
    let coord = cluster_coordinator(&prefix);
    let keys = spread_keys();
    let physical: Vec<String> = keys.iter().map(|k| format!("{prefix}{k}")).collect();
    let primaries: std::collections::HashSet<usize> = physical
        .iter()
        .map(|k| shared_cluster().primary_for_key(k))
        .collect();
    assert!(primaries.len() >= 2, "the keys are on one primary only");
    let set = coord.lock_all(&keys).unwrap();
    assert!(!set.is_one_call());
    // The key in the middle of the global order (by slot, then bytes).
    let mut order = physical.clone();
    order.sort_by_key(|k| (key_slot(k.as_bytes()), k.clone()));
    let middle = order[order.len() / 2].clone();
    let mut admin = shared_cluster().client_for_key(&middle);
    let () = admin.pset_ex(&middle, "outsider", 60_000).unwrap();
    assert!(set.try_acquire(Duration::from_secs(10)).unwrap().is_none());
    assert!(
        set.acquire_timeout(Duration::from_secs(10), ms(300))
            .unwrap()
            .is_none()
    );
    for k in physical.iter().filter(|k| **k != middle) {
        assert!(!exists_cluster(k), "{k} was left set");
    }
    // A key of another type in the middle: the error, and nothing held.
    let () = admin.del(&middle).unwrap();
    let () = admin.rpush(&middle, "x").unwrap();
    let e = set.try_acquire(Duration::from_secs(10)).unwrap_err();
    assert!(
        matches!(&e, Error::BadKey { key, .. } if *key == middle),
        "{e}"
    );
    for k in physical.iter().filter(|k| **k != middle) {
        assert!(!exists_cluster(k), "{k} was left set");
    }
    let () = admin.del(&middle).unwrap();
    // Free: the whole set, then nothing after its release.
    let g = set.try_acquire(Duration::from_secs(10)).unwrap().unwrap();
    for k in &physical {
        assert!(exists_cluster(k), "{k} not set");
    }
    assert_eq!(Guard::release(g).unwrap(), ReleaseOutcome::Released);
    for k in &physical {
        assert!(!exists_cluster(k), "{k} left set");
    }
    // Keys that share a hash tag go in one call on a cluster too.
    let one_slot = coord.lock_all(&["{t}a", "{t}b", "{t}c"]).unwrap();
    assert!(one_slot.is_one_call());
    drop(
        one_slot
            .try_acquire(Duration::from_secs(10))
            .unwrap()
            .unwrap(),
    );
}

#[test]
fn a_wait_in_the_global_order_that_is_cancelled_leaves_nothing_held() {
    let prefix = unique_prefix("cancel");
    let coord = cluster_coordinator(&prefix);
    let keys = spread_keys();
    let mut order: Vec<String> = keys.iter().map(|k| format!("{prefix}{k}")).collect();
    order.sort_by_key(|k| (key_slot(k.as_bytes()), k.clone()));
    let last = order[order.len() - 1].clone();
    let mut admin = shared_cluster().client_for_key(&last);
    let () = admin.pset_ex(&last, "outsider", 60_000).unwrap();
    let set = coord.lock_all(&keys).unwrap();
    let cancel = CancelToken::new();
    thread::scope(|s| {
        let waiter = s.spawn(|| set.acquire(Duration::from_secs(30), &cancel));
        // Every lease before the last is taken; the wait is on the last.
        wait_until(
            Duration::from_secs(10),
            "the leases before the last",
            || order[..order.len() - 1].iter().all(|k| exists_cluster(k)),
        );
        cancel.cancel();
        let err = waiter.join().unwrap().unwrap_err();
        assert!(matches!(err, Error::Cancelled), "{err}");
    });
    // Released before the call returned.
    for k in order.iter().filter(|k| **k != last) {
        assert!(!exists_cluster(k), "{k} was left set");
    }
    let v: String = admin.get(&last).unwrap();
    assert_eq!(v, "outsider");
}

#[test]
fn a_set_whose_early_lease_ran_out_during_the_wait_is_taken_again_whole() {
    let prefix = unique_prefix("again");
    let seeds = shared_cluster().seed_urls();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let coord = Coordinator::cluster_builder(&seeds)
        .key_prefix(&prefix)
        .node_timeout(ms(100))
        .build()
        .unwrap();
    let keys = spread_keys();
    let mut order: Vec<String> = keys.iter().map(|k| format!("{prefix}{k}")).collect();
    order.sort_by_key(|k| (key_slot(k.as_bytes()), k.clone()));
    let last = order[order.len() - 1].clone();
    // The last lease in the order is held for longer than the set's TTL.
    let mut admin = shared_cluster().client_for_key(&last);
    let () = admin.pset_ex(&last, "outsider", 1_500).unwrap();
    let set = coord.lock_all(&keys).unwrap();
    let g = set
        .acquire_timeout(ms(500), Duration::from_secs(10))
        .unwrap()
        .expect("granted once the outsider's lease ran out");
    // Not a set with members that ran out while the last was waited for.
    assert!(!g.is_lost());
    let values: Vec<Option<String>> = order
        .iter()
        .map(|k| shared_cluster().client_for_key(k).get(k).unwrap())
        .collect();
    // Each lease of the set is held (each by the owner of its own grant:
    // across slots, every lease is taken by its own primitive).
    assert!(
        values
            .iter()
            .all(|v| v.as_deref().is_some_and(|v| v != "outsider")),
        "{values:?}"
    );
    assert!(g.verify_still_held().unwrap().is_some());
    drop(g);
}

#[test]
fn a_kept_alive_set_is_renewed_in_one_pipeline_per_server() {
    let prefix = unique_prefix("pipeline");
    // A coordinator of its own: its renewal counters count this set only.
    let coord = coordinator(&shared_server().url(), &prefix, ms(100));
    let keys = ["a", "b", "c", "d", "e"];
    let g = coord
        .lock_all(&keys)
        .unwrap()
        .try_acquire(ms(1_000))
        .unwrap()
        .unwrap();
    let renewal = g.keep_alive().unwrap();
    wait_until(Duration::from_secs(10), "three renewals of the set", || {
        coord.renewal_stats().renewals >= 3 * keys.len() as u64
    });
    drop(renewal);
    let stats = coord.renewal_stats();
    assert!(!g.is_lost());
    assert_eq!(stats.failures, 0, "{stats:?}");
    // Every round trip renewed the whole set.
    assert_eq!(
        stats.renewals,
        stats.round_trips * keys.len() as u64,
        "{stats:?}"
    );
    drop(g);
}

/// One command a server ran, as its `MONITOR` stream showed it: the client
/// that sent it (`lua` for a command a script ran), the command's name in
/// lowercase, and its first key when it is an `EVALSHA` or `EVAL` (but not
/// the probe with which `keep_alive()` checks its rights, a run of the
/// renewal script for another owner that changes nothing).
#[derive(Clone, Debug, PartialEq)]
struct Ran {
    client: String,
    command: String,
    key: Option<String>,
}

/// A `MONITOR` connection to one server.
fn monitor(server: &TestServer) -> redis::Connection {
    let mut c = server.client();
    c.send_packed_command(&redis::cmd("MONITOR").get_packed_command())
        .unwrap();
    assert_eq!(
        c.recv_response().unwrap(),
        redis::Value::Okay,
        "MONITOR refused"
    );
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c
}

/// Reads `monitor`'s stream up to the `ECHO` of `marker` (sent after it was
/// opened), and returns what the server ran before it.
fn monitored_until(monitor: &mut redis::Connection, marker: &str) -> Vec<Ran> {
    let mut ran = Vec::new();
    loop {
        let line = match monitor.recv_response().expect("the MONITOR stream") {
            redis::Value::SimpleString(s) => s,
            other => panic!("a MONITOR line: {other:?}"),
        };
        // `<time> [<db> <client>] "<word>" "<word>" …`
        let (Some(open), Some(close)) = (line.find('['), line.find(']')) else {
            panic!("a MONITOR line: {line}");
        };
        let client = line[open + 1..close]
            .split_once(' ')
            .map_or("", |(_, c)| c)
            .to_owned();
        let words: Vec<&str> = line[close + 1..]
            .split_whitespace()
            .map(|w| w.trim_matches('"'))
            .collect();
        let command = words.first().map_or(String::new(), |w| w.to_lowercase());
        if command == "echo" && words.get(1) == Some(&marker) {
            return ran;
        }
        let key = (matches!(command.as_str(), "evalsha" | "eval")
            && !words.contains(&"respire-keepalive-probe"))
        .then(|| words.get(3).map(|k| (*k).to_owned()))
        .flatten();
        ran.push(Ran {
            client,
            command,
            key,
        });
    }
}

/// Checks, for each server, that the renewals of a set's keys (`EVALSHA` or
/// `EVAL` of one of `keys`) arrived together: in runs of consecutive commands
/// of one client, with no other command of any client between them, each run
/// renewing every key of the set on that server (`keys[i]` for server `i`)
/// exactly once and no key of another server. A run ends at another command,
/// another client's renewal, or a key it already renewed (the next round,
/// with nothing between). A script's own commands (client `lua`) are not
/// counted. Returns the number of runs on each server.
fn check_renewal_runs(
    ran: &[Vec<Ran>],
    keys: &[std::collections::BTreeSet<String>],
) -> Result<Vec<usize>, String> {
    let all: std::collections::BTreeSet<&String> = keys.iter().flatten().collect();
    let mut runs = Vec::new();
    for (server, (ran, mine)) in ran.iter().zip(keys).enumerate() {
        let mut count = 0;
        let mut run: Vec<&Ran> = Vec::new();
        let mut close = |run: &mut Vec<&Ran>| -> Result<(), String> {
            if run.is_empty() {
                return Ok(());
            }
            let mut got: Vec<&str> = run.iter().filter_map(|r| r.key.as_deref()).collect();
            got.sort_unstable();
            let want: Vec<&str> = mine.iter().map(String::as_str).collect();
            if got != want {
                return Err(format!(
                    "server {server}: renewals {got:?} arrived together, not the set's keys \
                     there {want:?}"
                ));
            }
            count += 1;
            run.clear();
            Ok(())
        };
        for r in ran.iter().filter(|r| r.client != "lua") {
            let renewal = r.key.as_ref().filter(|k| all.contains(k));
            match renewal {
                Some(key) if !mine.contains(key) => {
                    return Err(format!("server {server} ran a renewal of {key}"));
                }
                Some(_) => {
                    if run.first().is_some_and(|first| first.client != r.client)
                        || run.iter().any(|q| q.key == r.key)
                    {
                        close(&mut run)?;
                    }
                    run.push(r);
                }
                None => close(&mut run)?,
            }
        }
        close(&mut run)?;
        runs.push(count);
    }
    Ok(runs)
}

/// Checks the rounds of renewal (`runs`: each server's, from
/// [`check_renewal_runs`]): every server saw as many as the others (one fewer
/// where the last round was cut off when the keep-alive stopped), and the
/// library's round trips are one per server per round (as many as the
/// servers' runs; up to one more per server for a round that was in flight
/// when the servers were last read). Pipelines sent back to back with nothing
/// between read as one run, so a round split into several shows here, as
/// more round trips than runs.
fn check_rounds(runs: &[usize], round_trips: u64) -> Result<(), String> {
    let (least, most) = (
        runs.iter().min().copied().unwrap_or(0),
        runs.iter().max().copied().unwrap_or(0),
    );
    if most > least + 1 {
        return Err(format!("rounds per server {runs:?}"));
    }
    let total: u64 = runs.iter().map(|&r| r as u64).sum();
    if round_trips < total || round_trips > total + runs.len() as u64 {
        return Err(format!(
            "{round_trips} round trips for {total} rounds of renewal the servers saw ({runs:?} \
             per server)"
        ));
    }
    Ok(())
}

#[test]
fn the_renewal_run_checkers_find_split_mixed_and_misrouted_rounds() {
    let ran = |client: &str, key: Option<&str>| Ran {
        client: client.into(),
        command: if key.is_some() { "evalsha" } else { "get" }.into(),
        key: key.map(Into::into),
    };
    let keys: Vec<std::collections::BTreeSet<String>> = vec![
        ["a".to_owned()].into(),
        ["b".to_owned(), "c".to_owned()].into(),
    ];
    // Rounds apart, or back to back with nothing between.
    let good = vec![
        vec![
            ran("x:1", Some("a")),
            ran("y:9", None),
            ran("x:1", Some("a")),
            ran("x:1", Some("a")),
        ],
        vec![
            ran("x:2", Some("c")),
            ran("lua", None),
            ran("x:2", Some("b")),
            ran("y:9", None),
            ran("x:2", Some("b")),
            ran("x:2", Some("c")),
            ran("x:2", Some("c")),
            ran("x:2", Some("b")),
        ],
    ];
    assert_eq!(check_renewal_runs(&good, &keys), Ok(vec![3, 3]));
    // A round on server 1 sent as two round trips, another client's command
    // between them.
    let mut split = good.clone();
    split[1].insert(1, ran("y:9", None));
    assert!(
        check_renewal_runs(&split, &keys)
            .unwrap_err()
            .contains("arrived together")
    );
    // Two connections, one key each.
    let mut mixed = good.clone();
    mixed[1][2].client = "x:3".into();
    assert!(check_renewal_runs(&mixed, &keys).is_err());
    // A round that renews a key twice and another not at all, and a key on
    // the wrong server.
    let mut twice = good.clone();
    twice[1][0].key = Some("b".into());
    assert!(check_renewal_runs(&twice, &keys).is_err());
    let mut misrouted = good.clone();
    misrouted[0].push(ran("x:1", Some("b")));
    assert!(check_renewal_runs(&misrouted, &keys).is_err());

    assert!(check_rounds(&[4, 4, 3], 11).is_ok());
    assert!(check_rounds(&[4, 4, 4], 15).is_ok());
    // A pipeline per key (six keys, three servers): twice the round trips.
    assert!(check_rounds(&[4, 4, 4], 24).is_err());
    // A server left out of rounds.
    assert!(check_rounds(&[4, 4, 2], 10).is_err());
    // Fewer round trips than the servers saw pipelines.
    assert!(check_rounds(&[4, 4, 4], 11).is_err());
}

#[test]
fn a_kept_alive_set_across_cluster_primaries_is_renewed_in_one_pipeline_per_primary() {
    let prefix = unique_prefix("pipeline-cluster");
    let cluster = shared_cluster();
    // 1, 2 and 3 keys on the three primaries, each key in a slot of its own.
    let primaries = cluster.primaries();
    assert_eq!(primaries.len(), 3, "{primaries:?}");
    let mut keys: Vec<String> = Vec::new();
    let mut on: Vec<std::collections::BTreeSet<String>> = vec![Default::default(); 3];
    for i in 0.. {
        if on.iter().enumerate().all(|(n, ks)| ks.len() == n + 1) {
            break;
        }
        let key = format!("{{d{i}}}");
        let physical = format!("{prefix}{key}");
        let n = primaries
            .iter()
            .position(|&p| p == cluster.primary_for_key(&physical))
            .expect("a primary owns the slot");
        if on[n].len() < n + 1 {
            on[n].insert(physical);
            keys.push(key);
        }
    }
    // A first set on the same keys, kept alive for one round: the renewal
    // script is then loaded on each primary, so no round below is sent twice
    // (once answered NOSCRIPT).
    {
        let warm = cluster_coordinator_with(&prefix, ms(100));
        let g = warm
            .lock_all(&keys)
            .unwrap()
            .try_acquire(ms(1_000))
            .unwrap()
            .unwrap();
        let renewal = g.keep_alive().unwrap();
        wait_until(Duration::from_secs(10), "one round of renewals", || {
            warm.renewal_stats().renewals >= keys.len() as u64
        });
        drop(renewal);
    }
    // A coordinator of its own: its renewal counters count this set only.
    let coord = cluster_coordinator_with(&prefix, ms(100));
    let set = coord.lock_all(&keys).unwrap();
    assert!(!set.is_one_call());
    let g = set.try_acquire(ms(1_000)).unwrap().unwrap();
    // Watched from the grant on: what the servers run of the set's keys from
    // now until the keep-alive stops is its renewals.
    let mut monitors: Vec<redis::Connection> = primaries
        .iter()
        .map(|&p| monitor(cluster.node(p)))
        .collect();
    let renewal = g.keep_alive().unwrap();
    wait_until(Duration::from_secs(20), "four rounds of renewals", || {
        coord.renewal_stats().renewals >= 4 * keys.len() as u64
    });
    drop(renewal);
    assert!(!g.is_lost());
    // What each primary ran, up to a marker sent after the keep-alive
    // stopped.
    let marker = format!("{prefix}end");
    let ran: Vec<Vec<Ran>> = primaries
        .iter()
        .zip(&mut monitors)
        .map(|(&p, m)| {
            let _: String = redis::cmd("ECHO")
                .arg(&marker)
                .query(&mut cluster.node(p).client())
                .unwrap();
            monitored_until(m, &marker)
        })
        .collect();
    let stats = coord.renewal_stats();
    let runs = check_renewal_runs(&ran, &on).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "keys per primary {:?}: rounds of renewal each primary saw {runs:?}; the library counted \
         {} round trips and {} renewals",
        on.iter().map(|k| k.len()).collect::<Vec<_>>(),
        stats.round_trips,
        stats.renewals
    );
    assert!(runs.iter().all(|&r| r >= 3), "{runs:?}");
    check_rounds(&runs, stats.round_trips).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stats.failures, 0, "{stats:?}");
    drop(g);
}

// ----- loss, keep-alive, release outcomes -------------------------------------

#[test]
fn the_set_is_lost_when_any_member_is_and_release_reports_each() {
    let prefix = unique_prefix("lost");
    let coord = coordinator(&shared_server().url(), &prefix, ms(100));
    let mut admin = shared_server().client();
    let set = coord.lock_all(&["a", "b", "c"]).unwrap();
    let g = set.try_acquire(ms(1_000)).unwrap().unwrap();
    let signal = g.lost_signal().clone();
    let renewal = g.keep_alive().unwrap();
    // Longer than the TTL: only the renewals keep the set.
    thread::sleep(ms(1_500));
    assert!(!g.is_lost());
    for k in ["a", "b", "c"] {
        let left: i64 = admin.pttl(format!("{prefix}{k}")).unwrap();
        assert!(left > 0, "{k}: pttl {left}");
    }
    // Someone else takes b: its next renewal finds it so, and the set is lost.
    let () = admin
        .pset_ex(format!("{prefix}b"), "someone-else", 60_000)
        .unwrap();
    assert!(
        signal.recv_timeout(Duration::from_secs(5)).is_err(),
        "the set's signal did not close"
    );
    assert!(g.is_lost());
    assert!(renewal.is_lost());
    drop(renewal);
    let () = admin.del(format!("{prefix}c")).unwrap();
    let outcomes: Vec<(String, ReleaseOutcome)> = g
        .release()
        .into_iter()
        .map(|(k, r)| (k, r.unwrap()))
        .collect();
    assert_eq!(
        outcomes,
        [
            (format!("{prefix}a"), ReleaseOutcome::Released),
            (format!("{prefix}b"), ReleaseOutcome::TakenOver),
            (format!("{prefix}c"), ReleaseOutcome::Expired),
        ]
    );
    let v: String = admin.get(format!("{prefix}b")).unwrap();
    assert_eq!(v, "someone-else");
}

#[test]
fn the_set_runs_out_with_its_earliest_member() {
    let prefix = unique_prefix("estimate");
    let coord = coordinator(&shared_server().url(), &prefix, ms(100));
    let set = coord.lock_all(&["a", "b"]).unwrap();
    let g = set.try_acquire(ms(2_000)).unwrap().unwrap();
    assert!(g.reset_expiry(ms(10_000)).unwrap());
    // One member shortened alone: the set's estimate is the least.
    assert!(g.members()[1].reset_expiry(ms(800)).unwrap());
    let left = g.remaining_estimate();
    assert!(left <= ms(800), "{left:?}");
    let signal = g.lost_signal().clone();
    assert!(signal.recv_timeout(Duration::from_secs(5)).is_err());
    assert!(g.is_lost());
    let mut admin = shared_server().client();
    wait_until(Duration::from_secs(5), "b to expire on the server", || {
        !admin.exists::<_, bool>(format!("{prefix}b")).unwrap()
    });
    assert!(admin.exists::<_, bool>(format!("{prefix}a")).unwrap());
    assert_eq!(g.verify_still_held().unwrap(), None);
}

// ----- an unanswered grant ------------------------------------------------------

#[test]
fn a_wait_that_ends_after_an_unanswered_grant_cleans_up_every_key() {
    // A trial needs the waiter to have heard its tracked attempt's reply
    // before replies are dropped; on a busy machine that reply can be dropped
    // too, and the waiter then never sends the grant (its new connections'
    // set-up is never answered). Such a trial still must leave nothing, and
    // counts as not run.
    support::until_a_trial_runs(
        8,
        "the waiter's tracked attempt went unanswered, so it made no grant",
        unanswered_grant_trial,
    );
}

/// One trial: a waiter whose grant is never heard of, cancelled; every key
/// of that grant is deleted. Whether the waiter made the grant.
fn unanswered_grant_trial() -> bool {
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let coord = coordinator(&proxy.url(), "u:", ms(200));
    let set = coord
        .fenced_lock_all(&[("{a}l", "{a}f"), ("{b}l", "{b}f"), ("{c}l", "{c}f")])
        .unwrap();
    let () = admin.pset_ex("u:{b}l", "crashed-holder", 800).unwrap();
    let cancel = CancelToken::new();
    let granted = thread::scope(|s| {
        let _stop = support::CancelOnDrop(&cancel);
        let waiter = s.spawn(|| set.acquire(Duration::from_secs(60), &cancel));
        // Once the waiter waits (it has heard that the set is held and made
        // its tracked attempt), every reply is dropped: the grant it makes
        // when the holder expires is never heard of.
        wait_until(Duration::from_secs(5), "the waiter to wait", || {
            script_calls(&mut admin) >= 2
        });
        proxy.set_mode(Mode::DropServerToClient);
        let granted = support::true_within(Duration::from_secs(5), || {
            let v: Option<String> = admin.get("u:{b}l").unwrap();
            v.is_some_and(|v| v != "crashed-holder")
        });
        cancel.cancel();
        let err = waiter.join().unwrap().unwrap_err();
        assert!(matches!(err, Error::Cancelled), "{err}");
        granted
    });
    proxy.set_mode(Mode::Pass);
    // The grant nobody heard of is deleted, every key of it, not left for
    // its 60 s (and without one, nothing is left either).
    wait_until(
        Duration::from_secs(5),
        "the unheard grant to be cleaned up",
        || {
            ["u:{a}l", "u:{b}l", "u:{c}l"]
                .iter()
                .all(|k| !admin.exists::<_, bool>(*k).unwrap())
        },
    );
    granted
}

#[test]
fn a_single_attempt_whose_reply_is_lost_is_assumed_granted_and_cleaned_up() {
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let coord = coordinator(&proxy.url(), "once:", ms(200));
    let set = coord.lock_all(&["a", "b", "c"]).unwrap();
    // A first grant and release open the pooled connection.
    drop(set.try_acquire(Duration::from_secs(60)).unwrap().unwrap());
    proxy.set_mode(Mode::DropServerToClient);
    let e = set.try_acquire(Duration::from_secs(60)).unwrap_err();
    assert!(e.is_timeout() || matches!(e, Error::Io { .. }), "{e}");
    // The script ran: the set was granted to nobody who knows it.
    let held: Vec<bool> = ["once:a", "once:b", "once:c"]
        .iter()
        .map(|k| admin.exists(*k).unwrap())
        .collect();
    assert_eq!(held, [true, true, true]);
    proxy.set_mode(Mode::Pass);
    wait_until(
        Duration::from_secs(5),
        "the unheard grant to be cleaned up",
        || {
            ["once:a", "once:b", "once:c"]
                .iter()
                .all(|k| !admin.exists::<_, bool>(*k).unwrap())
        },
    );
}

// ----- eight threads in two processes -------------------------------------------

/// Nanoseconds on `CLOCK_MONOTONIC`: one clock for every process of the
/// machine, so intervals recorded by different processes compare.
fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// One hold of one key as a thread recorded it: taken after the grant
/// returned, ended before the thread checked the set was not lost.
#[derive(Clone, Debug, PartialEq)]
struct Hold {
    who: String,
    token: u64,
    from: u64,
    to: u64,
}

/// Checks the holds of each key: ordered by start, each ends before the next
/// begins (touching counts as overlapping) and tokens strictly increase.
fn check_holds(holds: &BTreeMap<String, Vec<Hold>>) -> Result<(), String> {
    for (key, holds) in holds {
        let mut holds = holds.clone();
        holds.sort_by_key(|h| h.from);
        for pair in holds.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if a.to >= b.from {
                return Err(format!(
                    "{key} held by {} (token {}) and {} (token {}) at once, for {} µs",
                    a.who,
                    a.token,
                    b.who,
                    b.token,
                    (a.to.min(b.to) - b.from) / 1000
                ));
            }
            if b.token <= a.token {
                return Err(format!(
                    "{key}: token {} granted after token {}",
                    b.token, a.token
                ));
            }
        }
    }
    Ok(())
}

#[test]
fn the_hold_checker_finds_overlaps_and_tokens_that_go_back() {
    let hold = |who: &str, token, from, to| Hold {
        who: who.into(),
        token,
        from,
        to,
    };
    let mut ok = BTreeMap::new();
    ok.insert("k".into(), vec![hold("a", 1, 10, 20), hold("b", 2, 21, 30)]);
    ok.insert("j".into(), vec![hold("a", 5, 10, 20)]);
    assert!(check_holds(&ok).is_ok());
    let mut overlap = BTreeMap::new();
    overlap.insert("k".into(), vec![hold("b", 2, 15, 30), hold("a", 1, 10, 20)]);
    assert!(check_holds(&overlap).unwrap_err().contains("at once"));
    let mut touching = BTreeMap::new();
    touching.insert("k".into(), vec![hold("a", 1, 10, 20), hold("b", 2, 20, 30)]);
    assert!(check_holds(&touching).is_err());
    let mut back = BTreeMap::new();
    back.insert("k".into(), vec![hold("a", 3, 10, 20), hold("b", 2, 21, 30)]);
    assert!(check_holds(&back).unwrap_err().contains("after token"));
}

/// Checks that a guard holds exactly the leases asked for: `asked` as given
/// to `fenced_lock_all`, `held` as the guard's `fencing_tokens()` named them
/// (physical keys, with `prefix`). Nothing missing, nothing extra, nothing
/// twice; the order does not matter.
fn check_whole(prefix: &str, asked: &[&str], held: &[&str]) -> Result<(), String> {
    let mut want: Vec<String> = asked.iter().map(|k| format!("{prefix}{k}")).collect();
    let mut got: Vec<String> = held.iter().map(|k| (*k).to_owned()).collect();
    want.sort();
    got.sort();
    if want != got {
        return Err(format!(
            "a partial guard: asked for {want:?}, the guard holds {got:?}"
        ));
    }
    Ok(())
}

#[test]
fn the_whole_set_checker_finds_partial_guards() {
    let asked = ["{k1}:lease", "{k4}:lease", "{k7}:lease"];
    // In another order than asked: whole.
    assert!(
        check_whole(
            "p:",
            &asked,
            &["p:{k7}:lease", "p:{k1}:lease", "p:{k4}:lease"]
        )
        .is_ok()
    );
    // A member missing: the partial guard the set must never return.
    let missing = check_whole("p:", &asked, &["p:{k1}:lease", "p:{k7}:lease"]);
    assert!(missing.unwrap_err().contains("partial"));
    // A key not asked for, a key twice, a key without its prefix.
    for held in [
        &[
            "p:{k1}:lease",
            "p:{k4}:lease",
            "p:{k7}:lease",
            "p:{k2}:lease",
        ][..],
        &["p:{k1}:lease", "p:{k4}:lease", "p:{k4}:lease"][..],
        &["p:{k1}:lease", "p:{k4}:lease", "{k7}:lease"][..],
    ] {
        assert!(check_whole("p:", &asked, held).is_err(), "{held:?}");
    }
}

const THREADS_PER_PROCESS: usize = 4;
const KEYS: usize = 10;
/// Longer than any wait: a set left waiting on a lease another waiter holds
/// (the deadlock of taking keys in the order given) cannot be undone by that
/// lease running out, and shows as a wait that ran out.
const HOLD_TTL: Duration = Duration::from_secs(30);
const WAIT: Duration = Duration::from_secs(10);

/// A child: four threads, each taking random subsets of the ten keys in
/// random orders until the end, printing `@@hold <lost> <from> <to>
/// <asked,…> <key>=<token>…` for every grant (the lease keys asked for, as
/// given, then each lease the guard holds with its token) and `@@done
/// <grants> <not granted> <longest wait in µs>` at the end.
fn run_child(coord: &Coordinator, seconds: u64) {
    let end = Instant::now() + Duration::from_secs(seconds);
    let out = std::sync::Mutex::new(std::io::stdout());
    thread::scope(|s| {
        for t in 0..THREADS_PER_PROCESS {
            let out = &out;
            s.spawn(move || {
                let mut rng = Rng::new(mono_ns() ^ (t as u64 + 1) << 40);
                let (mut grants, mut missed, mut longest) = (0u64, 0u64, 0u64);
                while Instant::now() < end {
                    let mut keys: Vec<usize> = (0..KEYS).collect();
                    for i in (1..keys.len()).rev() {
                        keys.swap(i, rng.below(i as u64 + 1) as usize);
                    }
                    keys.truncate(1 + rng.below(4) as usize);
                    let pairs: Vec<(String, String)> = keys
                        .iter()
                        .map(|k| (format!("{{k{k}}}:lease"), format!("{{k{k}}}:fence")))
                        .collect();
                    let set = coord.fenced_lock_all(&pairs).unwrap();
                    let asked = Instant::now();
                    match set.acquire_timeout(HOLD_TTL, WAIT) {
                        Ok(Some(g)) => {
                            longest = longest.max(asked.elapsed().as_micros() as u64);
                            let from = mono_ns();
                            // The work: a few milliseconds with the keys.
                            let busy = Instant::now() + ms(rng.below(5));
                            while Instant::now() < busy {
                                std::hint::spin_loop();
                            }
                            let to = mono_ns();
                            let lost = g.is_lost();
                            let tokens: Vec<String> = g
                                .fencing_tokens()
                                .iter()
                                .map(|(k, t)| format!("{k}={t}"))
                                .collect();
                            let asked: Vec<&str> =
                                pairs.iter().map(|(lease, _)| lease.as_str()).collect();
                            writeln!(
                                out.lock().unwrap(),
                                "@@hold {lost} {from} {to} {} {}",
                                asked.join(","),
                                tokens.join(" ")
                            )
                            .unwrap();
                            drop(g);
                            grants += 1;
                        }
                        Ok(None) => missed += 1,
                        Err(e) => {
                            writeln!(out.lock().unwrap(), "@@error {e}").unwrap();
                            missed += 1;
                        }
                    }
                }
                writeln!(out.lock().unwrap(), "@@done {grants} {missed} {longest}").unwrap();
            });
        }
    });
}

/// Two children of four threads each on `url` (`cluster` = comma-separated
/// seeds); checks the holds on the shared clock, progress, and the servers.
fn eight_threads_in_two_processes(test: &str, url: &str, cluster: bool, prefix: &str) {
    let seconds: u64 = std::env::var("RESPIRE_MULTI_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    println!("{seconds} s (RESPIRE_MULTI_SECS)");
    let (lines_tx, lines_rx) = crossbeam_channel::unbounded::<(u32, String)>();
    let mut children: Vec<std::process::Child> = (0..2)
        .map(|_| {
            let mut child = std::process::Command::new(std::env::current_exe().unwrap())
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, if cluster { "cluster" } else { "standalone" })
                .env("RESPIRE_MULTI_URL", url)
                .env("RESPIRE_MULTI_PREFIX", prefix)
                .env("RESPIRE_MULTI_SECS", seconds.to_string())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::inherit())
                .spawn()
                .unwrap();
            let pid = child.id();
            let stdout = child.stdout.take().unwrap();
            let tx = lines_tx.clone();
            thread::spawn(move || {
                use std::io::BufRead as _;
                for line in std::io::BufReader::new(stdout).lines() {
                    let Ok(line) = line else { return };
                    if tx.send((pid, line)).is_err() {
                        return;
                    }
                }
            });
            child
        })
        .collect();
    drop(lines_tx);
    // No deadlock: both children finish within their time plus the longest
    // wait one attempt may take and a margin.
    let deadline = Instant::now() + Duration::from_secs(seconds + 40);
    let mut holds: BTreeMap<String, Vec<Hold>> = BTreeMap::new();
    let (mut done, mut lost, mut errors) = (Vec::new(), 0, Vec::new());
    let (mut guards, mut partial) = (0u64, Vec::new());
    loop {
        match lines_rx.recv_deadline(deadline) {
            Ok((pid, line)) => {
                let Some(at) = line.find("@@") else { continue };
                let words: Vec<&str> = line[at + 2..].split_whitespace().collect();
                match words.as_slice() {
                    ["hold", was_lost, from, to, asked, members @ ..] => {
                        // Every guard returned, lost or not, holds the whole
                        // set asked for.
                        guards += 1;
                        let asked: Vec<&str> = asked.split(',').collect();
                        let held: Vec<&str> = members
                            .iter()
                            .map(|m| m.rsplit_once('=').map_or(*m, |(k, _)| k))
                            .collect();
                        if let Err(e) = check_whole(prefix, &asked, &held) {
                            partial.push(format!("pid {pid}: {e}"));
                        }
                        if *was_lost == "true" {
                            lost += 1;
                            continue;
                        }
                        for m in members {
                            let (key, token) = m.rsplit_once('=').unwrap();
                            holds.entry(key.to_owned()).or_default().push(Hold {
                                who: pid.to_string(),
                                token: token.parse().unwrap(),
                                from: from.parse().unwrap(),
                                to: to.parse().unwrap(),
                            });
                        }
                    }
                    ["done", grants, missed, longest] => done.push((
                        pid,
                        grants.parse::<u64>().unwrap(),
                        missed.parse::<u64>().unwrap(),
                        longest.parse::<u64>().unwrap(),
                    )),
                    ["error", ..] => errors.push(line[at..].to_owned()),
                    _ => {}
                }
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                panic!("the children did not finish in time: a deadlock? done so far: {done:?}");
            }
        }
    }
    for c in &mut children {
        assert!(c.wait().unwrap().success());
    }
    check_holds(&holds).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        partial.is_empty(),
        "{} of {guards} guards were partial, the first: {:?}",
        partial.len(),
        &partial[..partial.len().min(3)]
    );
    let grants: u64 = done.iter().map(|d| d.1).sum();
    // Every grant was recorded, and checked whole.
    assert_eq!(guards, grants, "grants counted and grants recorded differ");
    let missed: u64 = done.iter().map(|d| d.2).sum();
    let longest = done.iter().map(|d| d.3).max().unwrap_or(0);
    let per_key: Vec<usize> = holds.values().map(Vec::len).collect();
    println!(
        "{grants} sets granted, each holding exactly the keys asked for; {missed} waits ran out \
         or failed, {lost} found lost, longest wait {} ms; holds per key {per_key:?}",
        longest / 1000
    );
    assert!(
        errors.is_empty(),
        "errors on a healthy deployment: {errors:?}"
    );
    // No deadlock: no wait ran out.
    assert_eq!(missed, 0, "waits ran out on a healthy deployment");
    assert_eq!(lost, 0, "sets lost on a healthy deployment");
    // Every thread made progress.
    assert_eq!(done.len(), 2 * THREADS_PER_PROCESS, "{done:?}");
    assert!(
        done.iter().all(|d| d.1 > 0),
        "a thread never got a set: {done:?}"
    );
    assert_eq!(holds.len(), KEYS);
    // Nothing is left held, and each counter issued at least every token seen.
    for k in 0..KEYS {
        let lease = format!("{prefix}{{k{k}}}:lease");
        let fence = format!("{prefix}{{k{k}}}:fence");
        let mut c = if cluster {
            shared_cluster().client_for_key(&lease)
        } else {
            redis::Client::open(url).unwrap().get_connection().unwrap()
        };
        assert!(!c.exists::<_, bool>(&lease).unwrap(), "{lease} left held");
        let issued: u64 = c.get(&fence).unwrap();
        let seen = holds[&lease].iter().map(|h| h.token).max().unwrap();
        assert!(issued >= seen, "{fence}: {issued} < {seen}");
    }
}

fn child_main() {
    let url = std::env::var("RESPIRE_MULTI_URL").unwrap();
    let prefix = std::env::var("RESPIRE_MULTI_PREFIX").unwrap();
    let seconds: u64 = std::env::var("RESPIRE_MULTI_SECS")
        .unwrap()
        .parse()
        .unwrap();
    let coord = if std::env::var(CHILD_ENV).as_deref() == Ok("cluster") {
        let seeds: Vec<&str> = url.split(',').collect();
        Coordinator::cluster_builder(&seeds)
            .key_prefix(&prefix)
            .node_timeout(ms(500))
            .build()
            .unwrap()
    } else {
        coordinator(&url, &prefix, ms(500))
    };
    run_child(&coord, seconds);
}

#[test]
fn eight_threads_in_two_processes_never_share_a_key_on_one_server() {
    if std::env::var(CHILD_ENV).is_ok() {
        return child_main();
    }
    let server = TestServer::start();
    eight_threads_in_two_processes(
        "eight_threads_in_two_processes_never_share_a_key_on_one_server",
        &server.url(),
        false,
        "eight:",
    );
}

#[test]
fn eight_threads_in_two_processes_never_share_a_key_on_a_cluster() {
    if std::env::var(CHILD_ENV).is_ok() {
        return child_main();
    }
    let prefix = unique_prefix("eight");
    // The ten keys are spread over the primaries (a slot each).
    let primaries: HashMap<usize, usize> = (0..KEYS).fold(HashMap::new(), |mut m, k| {
        let key = format!("{prefix}{{k{k}}}:lease");
        *m.entry(shared_cluster().primary_for_key(&key)).or_default() += 1;
        m
    });
    assert_eq!(primaries.len(), 3, "keys per primary: {primaries:?}");
    eight_threads_in_two_processes(
        "eight_threads_in_two_processes_never_share_a_key_on_a_cluster",
        &shared_cluster().seed_urls().join(","),
        true,
        &prefix,
    );
}
