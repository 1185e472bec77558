//! Checks that the Cluster and Sentinel topologies in `tests/support` form,
//! move slots, fail over and clean up against the real servers.
//!
//! Run with `--nocapture` to see the measured figures (lines starting with
//! `figure`).

mod support;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use respire_coordination::key_slot;
use support::{
    SLOTS, TestCluster, TestSentinel, shared_cluster, shared_sentinel, unique_prefix, wait_until,
};

/// Set in a copy of this test binary started by a test below, naming what the
/// copy should do.
const CHILD_ENV: &str = "RESPIRE_TOPOLOGY_SELFTEST_CHILD";

/// A cluster for the tests that move slots; each moves a slot of its own.
fn resharding_cluster() -> &'static TestCluster {
    static CLUSTER: OnceLock<TestCluster> = OnceLock::new();
    CLUSTER.get_or_init(TestCluster::start)
}

fn figure(name: &str, value: Duration) {
    println!("figure {name} = {:.0} ms", value.as_secs_f64() * 1000.0);
}

/// A hash tag no other call in this process returns, such as `{t:name:3:}`.
fn unique_tag(test_name: &str) -> String {
    format!("{{{}}}", unique_prefix(test_name))
}

fn set(con: &mut redis::Connection, key: &str, value: &str) {
    let () = redis::cmd("SET").arg(key).arg(value).query(con).unwrap();
}

fn get(con: &mut redis::Connection, key: &str) -> redis::RedisResult<Option<String>> {
    redis::cmd("GET").arg(key).query(con)
}

fn count_keys_in_slot(cluster: &TestCluster, node: usize, slot: u16) -> usize {
    redis::cmd("CLUSTER")
        .arg("COUNTKEYSINSLOT")
        .arg(slot)
        .query(&mut cluster.node(node).client())
        .unwrap()
}

fn role(server: &support::TestServer) -> Vec<redis::Value> {
    redis::cmd("ROLE").query(&mut server.client()).unwrap()
}

fn role_name(server: &support::TestServer) -> String {
    redis::from_redis_value(role(server).swap_remove(0)).unwrap()
}

/// Asserts that `err` is a `MOVED` or `ASK` (`code`) to `node` for `slot`.
#[track_caller]
fn assert_redirect(err: &redis::RedisError, code: &str, slot: u16, node: &support::TestServer) {
    assert_eq!(err.code(), Some(code), "{err:?}");
    let target = node.addr().to_string();
    assert_eq!(
        err.redirect_node(),
        Some((target.as_str(), slot)),
        "{err:?}"
    );
}

/// Whether `pid` has exited (gone, or a zombie nobody has reaped yet).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .unwrap()
            .trim_start()
            .starts_with('Z'),
        Err(_) => true,
    }
}

/// Runs `test` alone in a copy of this binary with [`CHILD_ENV`] set to `role`.
fn run_child(test: &str, role: &str) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, role)
        .output()
        .unwrap()
}

/// The values after `name=` up to the end of each line of `text` that has one.
fn reported<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    let marker = format!("{name}=");
    text.lines()
        .filter_map(|line| Some(&line[line.find(&marker)? + marker.len()..]))
        .collect()
}

#[test]
fn cluster_forms_with_three_primaries_covering_every_slot() {
    let cluster = shared_cluster();
    figure("cluster_start", cluster.startup_time());
    assert_eq!(cluster.nodes().len(), 6);
    assert_eq!(
        cluster.seed_urls(),
        cluster
            .nodes()
            .iter()
            .map(|node| format!("redis://127.0.0.1:{}", node.port()))
            .collect::<Vec<_>>()
    );
    let primaries = cluster.primaries();
    let replicas = cluster.replicas();
    assert_eq!(primaries.len(), 3, "{primaries:?}");
    assert_eq!(replicas.len(), 3, "{replicas:?}");
    let replicated: BTreeSet<usize> = primaries.iter().map(|&p| cluster.replica_of(p)).collect();
    assert_eq!(replicated, replicas.iter().copied().collect());

    for (i, node) in cluster.nodes().iter().enumerate() {
        let view = cluster.view(i);
        assert_eq!(view.nodes.len(), 6, "node {i}: {view:?}");
        assert!(view.covers_all_slots(), "node {i}: {view:?}");
        assert_eq!(view.slot_map().len(), 3, "node {i}: {view:?}");
        assert_eq!(view.myself().unwrap().id, cluster.node_id(i));
        let info: String = redis::cmd("CLUSTER")
            .arg("INFO")
            .query(&mut node.client())
            .unwrap();
        for expected in [
            "cluster_state:ok",
            "cluster_slots_assigned:16384",
            "cluster_known_nodes:6",
            "cluster_size:3",
        ] {
            assert!(
                info.lines().any(|line| line == expected),
                "node {i}: {info}"
            );
        }
        let bus: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("cluster-port")
            .query(&mut node.client())
            .unwrap();
        assert_eq!(bus[1], (node.port() + 100).to_string());
        assert_eq!(node.cluster_bus_port(), Some(node.port() + 100));
    }
    let slots: u32 = cluster
        .view(0)
        .slot_map()
        .iter()
        .map(|(start, end, _)| u32::from(end - start) + 1)
        .sum();
    assert_eq!(slots, u32::from(SLOTS));
}

#[test]
fn key_owner_and_its_replica_are_found() {
    let cluster = shared_cluster();
    let tag = unique_tag("owner");
    let key = format!("{tag}k");
    let slot = key_slot(key.as_bytes());
    let owner = cluster.primary_for_key(&key);
    assert_eq!(cluster.primary_for_slot(slot), owner);
    assert_eq!(cluster.primary_for_key(format!("{tag}other")), owner);
    assert!(cluster.primaries().contains(&owner));

    let mut con = cluster.client_for_key(&key);
    set(&mut con, &key, "v");
    for other in cluster.primaries().into_iter().filter(|&p| p != owner) {
        let err = get(&mut cluster.node(other).client(), &key).unwrap_err();
        assert_redirect(&err, "MOVED", slot, cluster.node(owner));
    }

    let replica = cluster.replica_of(owner);
    let role = role(cluster.node(replica));
    assert_eq!(
        redis::from_redis_value::<String>(role[0].clone()).unwrap(),
        "slave"
    );
    assert_eq!(
        redis::from_redis_value::<u16>(role[2].clone()).unwrap(),
        cluster.node(owner).port()
    );
    let acked: i64 = redis::cmd("WAIT").arg(1).arg(5000).query(&mut con).unwrap();
    assert_eq!(acked, 1);
    let mut replica_con = cluster.node(replica).client();
    let () = redis::cmd("READONLY").query(&mut replica_con).unwrap();
    assert_eq!(get(&mut replica_con, &key).unwrap().as_deref(), Some("v"));
}

#[test]
fn full_migration_moves_keys_and_moved_points_to_the_new_owner() {
    let cluster = resharding_cluster();
    let tag = unique_tag("full_migration");
    let keys: Vec<String> = (0..250).map(|i| format!("{tag}{i}")).collect();
    let slot = key_slot(keys[0].as_bytes());
    let source = cluster.primary_for_slot(slot);
    let target = *cluster.primaries().iter().find(|&&p| p != source).unwrap();
    let mut con = cluster.node(source).client();
    for key in &keys {
        set(&mut con, key, key);
    }

    let started = Instant::now();
    cluster.migrate_slot(slot, target);
    figure("migrate_slot_250_keys", started.elapsed());

    assert_eq!(count_keys_in_slot(cluster, source, slot), 0);
    assert_eq!(count_keys_in_slot(cluster, target, slot), keys.len());
    assert_eq!(cluster.primary_for_slot(slot), target);
    for i in 0..cluster.nodes().len() {
        assert_eq!(
            cluster.view(i).owner_of(slot).unwrap().id,
            cluster.node_id(target)
        );
    }
    let err = get(&mut con, &keys[7]).unwrap_err();
    assert_redirect(&err, "MOVED", slot, cluster.node(target));
    let mut target_con = cluster.node(target).client();
    assert_eq!(
        get(&mut target_con, &keys[7]).unwrap(),
        Some(keys[7].clone())
    );
}

#[test]
fn half_migration_makes_two_key_scripts_try_again_until_finished() {
    const SCRIPT: &str = "return {redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])}";
    let cluster = resharding_cluster();
    let tag = unique_tag("half_migration");
    let keys: Vec<String> = (0..10).map(|i| format!("{tag}{i}")).collect();
    let slot = key_slot(keys[0].as_bytes());
    let source = cluster.primary_for_slot(slot);
    let target = *cluster.primaries().iter().find(|&&p| p != source).unwrap();
    let mut con = cluster.node(source).client();
    for key in &keys {
        set(&mut con, key, key);
    }

    let migration = cluster.migrate_slot_half(slot, target);
    assert_eq!(
        (migration.slot(), migration.source(), migration.target()),
        (slot, source, target)
    );
    assert_eq!(migration.keys_on_source(), 5);
    assert_eq!(count_keys_in_slot(cluster, target, slot), 5);
    // A key the source no longer has is answered with ASK, so list what it has.
    let on_source: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(keys.len())
        .query(&mut con)
        .unwrap();
    assert_eq!(on_source.len(), 5);
    let kept = on_source[0].clone();
    let moved = keys
        .iter()
        .find(|key| !on_source.contains(key))
        .unwrap()
        .clone();
    let eval = |con: &mut redis::Connection| -> redis::RedisResult<Vec<String>> {
        redis::cmd("EVAL")
            .arg(SCRIPT)
            .arg(2)
            .arg(&kept)
            .arg(&moved)
            .query(con)
    };

    let err = eval(&mut con).unwrap_err();
    assert_eq!(err.code(), Some("TRYAGAIN"), "{err:?}");
    let err = get(&mut con, &moved).unwrap_err();
    assert_redirect(&err, "ASK", slot, cluster.node(target));
    let mut target_con = cluster.node(target).client();
    let () = redis::cmd("ASKING").query(&mut target_con).unwrap();
    assert_eq!(get(&mut target_con, &moved).unwrap(), Some(moved.clone()));

    migration.finish();
    assert_eq!(count_keys_in_slot(cluster, source, slot), 0);
    assert_eq!(count_keys_in_slot(cluster, target, slot), keys.len());
    let err = eval(&mut con).unwrap_err();
    assert_redirect(&err, "MOVED", slot, cluster.node(target));
    assert_eq!(eval(&mut target_con).unwrap(), [kept, moved]);
}

#[test]
fn manual_failover_swaps_roles_and_dropping_the_cluster_kills_every_node() {
    let cluster = TestCluster::start();
    let key = format!("{}k", unique_tag("manual_failover"));
    let primary = cluster.primary_for_key(&key);
    let replica = cluster.replica_of(primary);
    let mut con = cluster.node(primary).client();
    set(&mut con, &key, "before");

    let took = cluster.failover(replica);
    figure("cluster_manual_failover", took);
    assert_eq!(role_name(cluster.node(replica)), "master");
    assert_eq!(role_name(cluster.node(primary)), "slave");
    assert!(cluster.primaries().contains(&replica));
    assert!(!cluster.primaries().contains(&primary));
    assert_eq!(cluster.replica_of(replica), primary);
    assert_eq!(cluster.primary_for_key(&key), replica);
    assert_eq!(
        get(&mut cluster.node(replica).client(), &key)
            .unwrap()
            .as_deref(),
        Some("before")
    );
    cluster.wait_healthy();

    let pids = cluster.pids();
    let dirs: Vec<PathBuf> = cluster.nodes().iter().map(|n| n.dir().to_owned()).collect();
    drop(cluster);
    for pid in pids {
        assert!(exited(pid), "node pid {pid} still runs");
    }
    for dir in dirs {
        assert!(!dir.exists(), "{} is left", dir.display());
    }
}

#[test]
fn stopped_primary_is_failed_over_automatically_and_nodes_restart() {
    let cluster = TestCluster::builder()
        .node_timeout(Duration::from_millis(2000))
        .start();
    let primary = cluster.primaries()[1];
    let replica = cluster.replica_of(primary);

    cluster.node(primary).pause();
    let took = cluster.wait_primary_seen_by_all(replica, Duration::from_secs(30));
    figure("cluster_failover_after_sigstop", took);
    // A node is only suspected after the node timeout.
    assert!(took >= cluster.node_timeout(), "{took:?}");
    assert!(cluster.primaries().contains(&replica));

    cluster.node(primary).resume();
    cluster.wait_healthy();
    assert_eq!(role_name(cluster.node(primary)), "slave");
    assert_eq!(cluster.replica_of(replica), primary);

    // A killed replica restarts with its node id and rejoins.
    let other_replica = cluster
        .replicas()
        .into_iter()
        .find(|&r| r != primary)
        .unwrap();
    let old_pid = cluster.node(other_replica).pid();
    cluster.node(other_replica).kill();
    assert!(!cluster.is_live(other_replica));
    cluster.restart_node(other_replica);
    assert_ne!(cluster.node(other_replica).pid(), old_pid);
    cluster.wait_healthy();
    assert_eq!(
        cluster.view(other_replica).myself().unwrap().id,
        cluster.node_id(other_replica)
    );
}

#[test]
fn forced_takeover_and_slot_reassignment_move_ownership() {
    let cluster = TestCluster::start();
    let tag = unique_tag("takeover");
    let key = format!("{tag}k");
    let slot = key_slot(key.as_bytes());
    let old_primary = cluster.primary_for_slot(slot);
    set(&mut cluster.node(old_primary).client(), &key, "v");
    // Wait until the replica has the key itself. (`WAIT 1` is not enough: right
    // after a replica's diskless full sync it answered 1 while the replica's
    // offset was still below the write, and the takeover then lost the key.)
    let replica = cluster.replica_of(old_primary);
    let mut on_replica = cluster.node(replica).client();
    let () = redis::cmd("READONLY").query(&mut on_replica).unwrap();
    wait_until(
        Duration::from_secs(10),
        "the replica to have the key",
        || get(&mut on_replica, &key).unwrap().as_deref() == Some("v"),
    );

    let started = Instant::now();
    let new_primary = cluster.force_takeover_slot(slot);
    assert_eq!(new_primary, replica);
    figure("cluster_takeover", started.elapsed());
    assert_ne!(new_primary, old_primary);
    assert_eq!(cluster.primary_for_slot(slot), new_primary);
    assert_eq!(role_name(cluster.node(old_primary)), "slave");
    let mut on_new = cluster.node(new_primary).client();
    let found = get(&mut on_new, &key).unwrap();
    if found.as_deref() != Some("v") {
        let replication: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut on_new)
            .unwrap_or_default();
        let nodes: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query(&mut on_new)
            .unwrap_or_default();
        panic!(
            "the new primary {new_primary} has {found:?} for {key}\n{replication}\n{nodes}\n\
             --- its log ---\n{}",
            cluster.node(new_primary).log()
        );
    }

    // Ownership forced onto another primary: the keys stay behind and are dropped.
    let other_tag = (0..100)
        .map(|_| format!("{{{}}}", unique_prefix("reassign")))
        .find(|t| cluster.primary_for_key(t) != new_primary)
        .expect("a hash tag on another primary");
    let other_slot = key_slot(other_tag.as_bytes());
    let source = cluster.primary_for_slot(other_slot);
    let mut source_con = cluster.node(source).client();
    for i in 0..3 {
        set(&mut source_con, &format!("{other_tag}{i}"), "v");
    }
    let started = Instant::now();
    cluster.reassign_slot(other_slot, new_primary);
    figure("cluster_reassign_slot", started.elapsed());
    assert_eq!(cluster.primary_for_slot(other_slot), new_primary);
    assert_eq!(count_keys_in_slot(&cluster, source, other_slot), 0);
    assert_eq!(count_keys_in_slot(&cluster, new_primary, other_slot), 0);
    cluster.wait_healthy();
}

#[test]
fn sentinel_deployment_forms_and_names_the_primary() {
    let deployment = shared_sentinel();
    figure("sentinel_start", deployment.startup_time());
    assert_eq!(deployment.service(), "respire");
    assert_eq!(deployment.sentinel_urls().len(), 3);
    let primary = deployment.server(0);
    for i in 0..3 {
        assert_eq!(deployment.primary_addr_by(i), Some(primary.addr()));
    }
    assert_eq!(deployment.primary_addrs(), vec![Some(primary.addr()); 3]);
    assert_eq!(deployment.primary().port(), primary.port());
    assert_eq!(deployment.replica().port(), deployment.server(1).port());

    let unknown: Option<Vec<String>> = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg("no-such-service")
        .query(&mut deployment.sentinel(0).client())
        .unwrap();
    assert_eq!(unknown, None);
    let role = role(primary);
    assert_eq!(
        redis::from_redis_value::<String>(role[0].clone()).unwrap(),
        "master"
    );
    let replicas: Vec<Vec<String>> = redis::from_redis_value(role[2].clone()).unwrap();
    assert_eq!(replicas.len(), 1);
    assert_eq!(replicas[0][1], deployment.server(1).port().to_string());
    assert_eq!(role_name(deployment.server(1)), "slave");
    let sentinel_role: (String, Vec<String>) = redis::cmd("ROLE")
        .query(&mut deployment.sentinel(1).client())
        .unwrap();
    assert_eq!(
        sentinel_role,
        ("sentinel".to_owned(), vec!["respire".to_owned()])
    );
}

#[test]
fn client_pause_write_on_the_replica_holds_back_replication() {
    let deployment = shared_sentinel();
    let key = format!("{}k", unique_prefix("pause_replica"));
    let replica = deployment.pause_replica_writes(Duration::from_secs(10));
    assert_eq!(replica, 1);
    let mut con = deployment.primary().client();
    set(&mut con, &key, "v");
    let acked: i64 = redis::cmd("WAIT").arg(1).arg(200).query(&mut con).unwrap();
    assert_eq!(acked, 0);
    let mut replica_con = deployment.server(replica).client();
    assert_eq!(get(&mut replica_con, &key).unwrap(), None);

    deployment.unpause_replica(replica);
    let acked: i64 = redis::cmd("WAIT").arg(1).arg(5000).query(&mut con).unwrap();
    assert_eq!(acked, 1);
    assert_eq!(get(&mut replica_con, &key).unwrap().as_deref(), Some("v"));
}

#[test]
fn sentinel_failover_switches_the_primary_and_publishes_switch_master() {
    let deployment = TestSentinel::builder().service("orders").start();
    figure("sentinel_start_fresh", deployment.startup_time());
    let (old, new) = (deployment.server(0).addr(), deployment.server(1).addr());
    let watcher = deployment.watch_switches();
    // A write the replica never applies is gone after the switch.
    let key = format!("{}k", unique_prefix("switch"));
    deployment.pause_replica_writes(Duration::from_secs(30));
    let mut con = deployment.primary().client();
    set(&mut con, &key, "lost");
    let acked: i64 = redis::cmd("WAIT").arg(1).arg(100).query(&mut con).unwrap();
    assert_eq!(acked, 0);
    // A sentinel's periodic hello (every 2 s) reached the paused replica: it is
    // refused there, so it cannot hold the sentinel's link, and the promotion
    // after it, back until the pause ends.
    let mut replica_con = deployment.server(1).client();
    wait_until(
        Duration::from_secs(10),
        "a hello refused on the replica",
        || {
            let info: String = redis::cmd("INFO")
                .arg("errorstats")
                .query(&mut replica_con)
                .unwrap();
            info.contains("errorstat_NOPERM:")
        },
    );

    let started = Instant::now();
    let took = deployment.failover();
    figure("sentinel_failover", took);
    let events = watcher.wait_for(3, Duration::from_secs(10));
    figure("sentinel_first_switch_master", events[0].at - started);
    assert_eq!(events.len(), 3, "{events:?}");
    let sentinels: BTreeSet<usize> = events.iter().map(|e| e.sentinel).collect();
    assert_eq!(sentinels, BTreeSet::from([0, 1, 2]));
    for event in &events {
        assert_eq!(
            (event.service.as_str(), event.old, event.new),
            ("orders", old, new)
        );
    }
    assert_eq!(deployment.primary_index(), 1);
    assert_eq!(deployment.primary_addrs(), vec![Some(new); 3]);
    assert_eq!(role_name(deployment.server(1)), "master");
    let mut new_con = deployment.server(1).client();
    assert_eq!(get(&mut new_con, &key).unwrap(), None);
    deployment.unpause_replica(1);
    drop(watcher);
}

#[test]
fn stopped_primary_is_failed_over_by_the_sentinels() {
    let deployment = TestSentinel::start();
    // Two of three sentinels are still a quorum and a majority.
    deployment.sentinel(2).pause();
    let watcher = deployment.watch_switches();
    deployment.primary().pause();
    let took = deployment.wait_primary(1, Duration::from_secs(30));
    figure("sentinel_failover_after_sigstop", took);
    let events = watcher.wait_for(2, Duration::from_secs(10));
    assert!(
        events.iter().all(|e| e.new == deployment.server(1).addr()),
        "{events:?}"
    );
    assert_eq!(deployment.primary_index(), 1);

    deployment.sentinel(2).resume();
    deployment.wait_primary(1, Duration::from_secs(30));
    assert_eq!(
        deployment.primary_addr_by(2),
        Some(deployment.server(1).addr())
    );
    deployment.sentinel(0).kill();
    assert_eq!(deployment.primary_addrs()[0], None);
    deployment.sentinel(0).restart();
    deployment.wait_primary(1, Duration::from_secs(30));
    assert_eq!(
        deployment.primary_addr_by(0),
        Some(deployment.server(1).addr())
    );
    deployment.server(0).resume();
    assert!(!deployment.server(0).is_paused());
}

#[test]
fn topologies_are_killed_when_the_test_process_exits() {
    const TEST: &str = "topologies_are_killed_when_the_test_process_exits";
    if std::env::var(CHILD_ENV).as_deref() == Ok("exit") {
        // Shared topologies are never dropped: only the watchdogs can end them.
        let pids = shared_cluster()
            .pids()
            .into_iter()
            .chain(shared_sentinel().pids());
        for pid in pids {
            println!("pid={pid}");
        }
        for node in shared_cluster()
            .nodes()
            .iter()
            .chain(shared_sentinel().servers())
            .chain(shared_sentinel().sentinels())
        {
            println!("dir={}", node.dir().display());
        }
        return;
    }
    let output = run_child(TEST, "exit");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    let pids: Vec<u32> = reported(&stdout, "pid")
        .into_iter()
        .map(|pid| pid.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 6 + 5, "{stdout}");
    let dirs: Vec<PathBuf> = reported(&stdout, "dir")
        .into_iter()
        .map(PathBuf::from)
        .collect();
    assert_eq!(dirs.len(), 11, "{stdout}");
    wait_until(
        Duration::from_secs(10),
        "every orphaned process to die",
        || pids.iter().all(|&pid| exited(pid)),
    );
    wait_until(Duration::from_secs(10), "their directories to go", || {
        dirs.iter().all(|dir| !dir.exists())
    });
}
