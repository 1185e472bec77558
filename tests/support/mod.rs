//! Real-server test harness shared by the integration tests and the benches.
//!
//! Everything here drives real processes and sockets: [`TestServer`] runs a
//! `redis-server` on a free local port in a throwaway directory,
//! [`TestCluster`] joins six of them into a Redis Cluster, [`TestSentinel`]
//! runs a primary and a replica under three sentinels, [`FaultProxy`] sits
//! between a client and a server to delay, drop or cut traffic, and
//! [`wait_until`] waits for a condition with a deadline instead of sleeping.
//! [`Rng`] is the tests' one seeded generator (its seed printed, replayed
//! with `RESPIRE_TEST_SEED`), beside [`ms`], [`percentile`] and
//! [`coordinator`].
//! `RESPIRE_TEST_SERVER=valkey` runs every one of those processes on
//! `valkey-server` (and `valkey-cli`) instead ([`ServerKind`]).
//!
//! Use it with `mod support;` from a file in `tests/`, or with
//! `#[path = "../tests/support/mod.rs"] mod support;` from a bench.

// Every test binary compiles this whole module but uses only part of it.
#![allow(dead_code)]

mod child;
mod cluster;
mod keyspace;
mod kind;
mod proxy;
mod rng;
mod sentinel;
mod server;
mod tls;

use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

// Each test binary names only the items it needs.
#[allow(unused_imports)]
pub(crate) use child::{ChildProc, block_on_stdin, env};
#[allow(unused_imports)]
pub(crate) use cluster::{
    ClusterView, NodeEntry, SLOTS, SlotMigration, TestCluster, TestClusterBuilder,
};
#[allow(unused_imports)]
pub(crate) use keyspace::{local_instant, members, pttl, server_now, snapshot};
#[allow(unused_imports)]
pub(crate) use kind::{SERVER_VARIABLE, ServerKind};
#[allow(unused_imports)]
pub(crate) use proxy::{FaultProxy, Mode};
#[allow(unused_imports)]
pub(crate) use rng::{Rng, SEED_VARIABLE, ms, percentile};
#[allow(unused_imports)]
pub(crate) use sentinel::{SwitchEvent, SwitchWatcher, TestSentinel, TestSentinelBuilder};
#[allow(unused_imports)]
pub(crate) use server::{TestServer, TestServerBuilder, TlsAuthClients};
#[allow(unused_imports)]
pub(crate) use tls::TlsFiles;

/// The server shared by every test of this binary that injects no faults.
///
/// Started on first use and never dropped; a watchdog kills it as soon as the
/// test process exits. Give each test its own keys with [`unique_prefix`] and
/// start a fresh [`TestServer`] for anything that pauses, kills or reconfigures
/// a server.
pub(crate) fn shared_server() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(TestServer::start)
}

/// The cluster shared by every test of this binary that leaves its slots and
/// roles as they are.
///
/// Started on first use and never dropped; the nodes' watchdogs kill them as
/// soon as the test process exits. Start a fresh [`TestCluster`] for anything
/// that migrates slots, fails nodes over, pauses or kills them.
pub(crate) fn shared_cluster() -> &'static TestCluster {
    static CLUSTER: OnceLock<TestCluster> = OnceLock::new();
    CLUSTER.get_or_init(TestCluster::start)
}

/// The Sentinel deployment shared by every test of this binary that leaves
/// its roles as they are.
///
/// Started on first use and never dropped, like [`shared_cluster`]. Start a
/// fresh [`TestSentinel`] for anything that fails over, pauses or kills a
/// process.
pub(crate) fn shared_sentinel() -> &'static TestSentinel {
    static SENTINEL: OnceLock<TestSentinel> = OnceLock::new();
    SENTINEL.get_or_init(TestSentinel::start)
}

/// A key prefix no other call in this process returns: `t:<test_name>:<n>:`.
pub(crate) fn unique_prefix(test_name: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("t:{test_name}:{n}:")
}

/// `CLIENT LIST` of the server behind `conn`, as one map of fields per
/// connection.
pub(crate) fn client_list(conn: &mut redis::Connection) -> Vec<HashMap<String, String>> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(conn)
        .expect("CLIENT LIST");
    list.lines()
        .map(|l| {
            l.split_whitespace()
                .filter_map(|f| f.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        })
        .collect()
}

/// How many times the server behind `conn` has run each command, by the name
/// `INFO commandstats` gives it (lowercase; a subcommand as
/// `client|tracking`), `INFO` itself left out.
pub(crate) fn command_calls(conn: &mut redis::Connection) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(conn)
        .expect("INFO commandstats");
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let n = rest
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))?
                .parse()
                .ok()?;
            (name != "info").then(|| (name.to_owned(), n))
        })
        .collect()
}

/// How many times the server behind `conn` has run any of `commands`
/// (names as [`command_calls`] gives them), summed.
pub(crate) fn calls(conn: &mut redis::Connection, commands: &[&str]) -> u64 {
    let all = command_calls(conn);
    commands.iter().filter_map(|c| all.get(*c)).sum()
}

/// Acquire attempts and releases the server behind `conn` has run: a `Lock`
/// attempt is one `SET … NX` (with a `PTTL` in the same round trip when it
/// waits); a fenced attempt, like a release, one `EVALSHA`
/// (`EVAL` the first time).
pub(crate) fn script_calls(conn: &mut redis::Connection) -> u64 {
    calls(conn, &["evalsha", "eval", "set"])
}

/// Cancels `token` when dropped: a test whose waiting thread runs inside
/// `thread::scope` holds one, so that a failed check (a panic) still ends the
/// wait, and the scope reports the failure instead of joining forever.
pub(crate) struct CancelOnDrop<'a>(pub(crate) &'a respire_coordination::CancelToken);

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// Polls `cond` every few milliseconds until it returns `true`.
///
/// # Panics
///
/// Panics with a message naming `what` if `cond` is still `false` after
/// `deadline`.
#[track_caller]
pub(crate) fn wait_until(deadline: Duration, what: &str, cond: impl FnMut() -> bool) {
    if !true_within(deadline, cond) {
        panic!("timed out after {deadline:?} waiting for {what}");
    }
}

/// Polls `cond` every few milliseconds until it returns `true` (then
/// `true`) or `deadline` has passed (then `false`).
pub(crate) fn true_within(deadline: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if start.elapsed() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// Runs `trial` until one returns `true` (it ran: what it needs came about),
/// at most `trials` times; a trial returning `false` did not run, for the
/// reason `not_run` gives, and must have checked what it could. Panics if
/// none ran.
pub(crate) fn until_a_trial_runs(trials: u32, not_run: &str, mut trial: impl FnMut() -> bool) {
    for i in 1..=trials {
        if trial() {
            return;
        }
        eprintln!("trial {i} not run: {not_run}; again");
    }
    panic!("none of {trials} trials ran: {not_run}");
}

/// A replica of `primary` whose replication link runs through a
/// [`FaultProxy`] (cut it to make `WAIT` time out), once the primary lists it
/// online.
pub(crate) fn proxied_replica(primary: &TestServer) -> (FaultProxy, TestServer) {
    let link = FaultProxy::start(primary.addr());
    let replica = TestServer::builder()
        .args(["--replicaof", "127.0.0.1", &link.port().to_string()])
        .start();
    wait_until(Duration::from_secs(10), "the replica to be online", || {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut primary.client())
            .unwrap();
        info.contains("connected_slaves:1") && info.contains("state=online")
    });
    (link, replica)
}

/// A coordinator on `url` with a key prefix and a node timeout of its own.
pub(crate) fn coordinator(
    url: &str,
    prefix: &str,
    node_timeout: Duration,
) -> respire_coordination::Coordinator {
    respire_coordination::Coordinator::builder(url)
        .key_prefix(prefix)
        .node_timeout(node_timeout)
        .build()
        .expect("connect")
}
