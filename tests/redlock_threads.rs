//! What a Redlock group runs: exactly one worker thread and one connection per
//! node, one watcher thread and its idle connection per node, one renewal
//! thread once a guard needs it, and nothing left of the connector threads
//! that make new connections after a failure. Alone in its
//! test binary, so that the process's threads are the group's.

mod support;

use std::time::Duration;

use respire_coordination::{Coordinator, NodeOutcome, RedlockGroup, RedlockOptions};
use support::{FaultProxy, TestServer, wait_until};

/// This process's threads whose name starts with `prefix` (`/proc/self/task`).
fn threads(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end().starts_with(prefix))
        .count()
}

/// The server's client connections other than the one asking: (all, those
/// named `respire-redlock`, those named `respire-redlock-watch`).
fn connections(server: &TestServer) -> (usize, usize, usize) {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut server.client())
        .unwrap();
    let lines: Vec<&str> = list
        .lines()
        .filter(|l| !l.contains("cmd=client|list"))
        .collect();
    let named = lines
        .iter()
        .filter(|l| l.contains(" name=respire-redlock "))
        .count();
    let watching = lines
        .iter()
        .filter(|l| l.contains(" name=respire-redlock-watch "))
        .count();
    (lines.len(), named, watching)
}

#[test]
fn a_group_of_five_runs_five_workers_five_watchers_ten_connections_and_one_renewal_thread() {
    let servers: Vec<TestServer> = (0..5).map(|_| TestServer::start()).collect();
    let proxies: Vec<FaultProxy> = servers
        .iter()
        .map(|s| FaultProxy::start(s.addr()))
        .collect();
    let urls: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let one_each = |what: &str| {
        wait_until(Duration::from_secs(5), what, || {
            servers.iter().all(|s| connections(s) == (2, 1, 1))
        })
    };

    let group = RedlockGroup::connect(&urls, RedlockOptions::default()).unwrap();
    assert_eq!(threads("respire-node-"), 5);
    wait_until(Duration::from_secs(5), "a watcher per node", || {
        threads("respire-watch-") == 5
    });
    assert_eq!(threads("respire-redlock"), 0, "started on first need");
    assert_eq!(threads("respire-conn"), 0);
    one_each("one connection and one watcher per server");

    let guard = group
        .lock("job")
        .unwrap()
        .try_acquire(Duration::from_secs(10))
        .unwrap()
        .unwrap();
    assert_eq!(threads("respire-redlock"), 0, "a guard alone needs none");
    let keep = guard.keep_alive().unwrap();
    let _signal = guard.lost_signal();
    assert_eq!(threads("respire-node-"), 5);
    // A new thread takes its name once it runs.
    wait_until(Duration::from_secs(5), "the renewal thread", || {
        threads("respire-redlock") == 1
    });
    let second = group
        .lock("other")
        .unwrap()
        .try_acquire(Duration::from_secs(10))
        .unwrap()
        .unwrap();
    let _keep_second = second.keep_alive().unwrap();
    assert_eq!(threads("respire-redlock"), 1, "one per group");
    for (i, s) in servers.iter().enumerate() {
        assert_eq!(connections(s), (2, 1, 1), "server {i}");
    }
    eprintln!(
        "group of 5: {} worker threads, {} renewal thread, connections per server: {:?}",
        threads("respire-node-"),
        threads("respire-redlock"),
        servers.iter().map(connections).collect::<Vec<_>>()
    );

    // A node whose connection breaks gets a new one from a connector thread
    // that then ends: back to the same counts.
    proxies[1].reset_all();
    wait_until(
        Duration::from_secs(5),
        "node 1 to lose its connection",
        || {
            group
                .attempt("probe", Duration::from_secs(10))
                .is_ok_and(|a| a.nodes()[1].outcome != NodeOutcome::Granted)
        },
    );
    wait_until(Duration::from_secs(10), "node 1 to reconnect", || {
        group.nodes()[1].connected && threads("respire-conn") == 0
    });
    one_each("one connection and one watcher per server after the reconnect");
    assert_eq!(threads("respire-node-"), 5);
    assert_eq!(threads("respire-redlock"), 1);
    drop(_keep_second);
    drop(second);
    drop(keep);
    drop(guard);
    drop(group);
    wait_until(
        Duration::from_secs(5),
        "the group's threads to stop",
        || {
            threads("respire-node-") == 0
                && threads("respire-redlock") == 0
                && threads("respire-watch-") == 0
        },
    );

    // Made from coordinators, the group uses their settings only: once the
    // coordinators are gone, one connection and one watcher per server again.
    let coordinators = urls
        .iter()
        .map(|u| Coordinator::builder(u).key_prefix("app:").build().unwrap())
        .collect();
    let group = RedlockGroup::new(coordinators, RedlockOptions::default()).unwrap();
    assert_eq!(threads("respire-node-"), 5);
    assert_eq!(threads("respire-renewal"), 0);
    one_each("one connection and one watcher per server for a group made from coordinators");
    assert!(group.nodes().iter().all(|n| n.key_prefix == "app:"));
}
