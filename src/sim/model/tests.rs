//! The model on its own: Redis's Lua conversions, the shipped scripts on the
//! model's clock, replication, restarts and injected errors.

use super::*;

const FENCED_ACQUIRE: &str = include_str!("../../scripts/fenced_acquire.lua");
const LEASE_EXTEND: &str = include_str!("../../scripts/lease_extend.lua");

fn bulk(s: &str) -> Reply {
    Reply::Bulk(s.as_bytes().to_vec())
}

fn eval(server: &mut ModelServer, source: &str) -> Reply {
    server.eval::<&str, &str>(source, &[], &[])
}

#[test]
fn lua_values_become_replies_as_in_redis() {
    let mut s = ModelServer::new(1, 1_000);
    assert_eq!(
        eval(&mut s, "return {1, 2.7, -2.7, true, false, 'x', nil, 5}"),
        Reply::Array(vec![
            Reply::Int(1),
            Reply::Int(2),
            Reply::Int(-2),
            Reply::Int(1),
            Reply::Nil,
            bulk("x"),
        ])
    );
    assert_eq!(eval(&mut s, "return 3.99"), Reply::Int(3));
    assert_eq!(eval(&mut s, "return 1/0"), Reply::Int(i64::MIN));
    assert_eq!(eval(&mut s, "return -1/0"), Reply::Int(i64::MIN));
    assert_eq!(
        eval(&mut s, "return {ok='fine'}"),
        Reply::Status("fine".into())
    );
    assert_eq!(
        eval(&mut s, "return redis.status_reply('fine')"),
        Reply::Status("fine".into())
    );
    assert_eq!(
        eval(&mut s, "return redis.error_reply('BADARG foo')"),
        Reply::Error("BADARG foo".into())
    );
    assert_eq!(
        eval(&mut s, "return redis.error_reply('foo')"),
        Reply::Error("ERR foo".into())
    );
    assert_eq!(
        eval(&mut s, "return redis.error_reply('-X foo')"),
        Reply::Error("X foo".into())
    );
    assert_eq!(
        eval(&mut s, "return {err='ybar'}"),
        Reply::Error("ybar".into())
    );
}

#[test]
fn errors_that_end_a_script_name_the_script_and_its_line() {
    let mut s = ModelServer::new(1, 1_000);
    s.command(&["SET", "s", "hello"]);
    let source = "local x = 1\nreturn redis.call('HGET', KEYS[1], 'x')";
    let sha = sha1_hex(source.as_bytes());
    assert_eq!(
        s.eval(source, &["s"], &[] as &[&str]),
        Reply::Error(format!(
            "WRONGTYPE Operation against a key holding the wrong kind of value script: {sha}, on @user_script:2."
        ))
    );
    assert_eq!(
        s.eval(
            "return redis.pcall('HGET', KEYS[1], 'x')",
            &["s"],
            &[] as &[&str]
        ),
        Reply::Error(keyspace::WRONGTYPE.into())
    );
    let source = "x = 5";
    let sha = sha1_hex(source.as_bytes());
    assert_eq!(
        eval(&mut s, source),
        Reply::Error(format!(
            "ERR user_script:1: Attempt to modify a readonly table script: {sha}, on @user_script:1."
        ))
    );
    let source = "local t = nil; return t.x";
    let sha = sha1_hex(source.as_bytes());
    assert_eq!(
        eval(&mut s, source),
        Reply::Error(format!(
            "ERR user_script:1: attempt to index local 't' (a nil value) script: {sha}, on @user_script:1."
        ))
    );
    let source = "return redis.call('GET', true)";
    let sha = sha1_hex(source.as_bytes());
    assert_eq!(
        eval(&mut s, source),
        Reply::Error(format!(
            "ERR Lua redis lib command arguments must be strings or integers script: {sha}, on @user_script:1."
        ))
    );
}

#[test]
fn numbers_reach_commands_printed_with_17_digits() {
    let mut s = ModelServer::new(1, 1_000);
    eval(
        &mut s,
        "redis.call('SET', 'n', 123456789012345678) return 1",
    );
    assert_eq!(s.command(&["GET", "n"]), bulk("1.2345678901234568e+17"));
    eval(&mut s, "redis.call('SET', 'n', 1.5) return 1");
    assert_eq!(s.command(&["GET", "n"]), bulk("1.5"));
}

#[test]
fn a_script_reads_one_server_time() {
    let mut s = ModelServer::new(1, 1_234_567);
    assert_eq!(
        eval(&mut s, "return redis.call('TIME')"),
        Reply::Array(vec![bulk("1234"), bulk("567000")])
    );
}

#[test]
fn the_shipped_fenced_acquire_grants_then_reports_the_holder_until_expiry() {
    let mut s = ModelServer::new(1, 10_000);
    let keys = ["{l}lease", "{l}fence"];
    let grant = s.eval(FENCED_ACQUIRE, &keys, &["a", "100"]);
    assert_eq!(grant, Reply::Array(vec![Reply::Int(1), bulk("1")]));
    assert_eq!(s.expiry("{l}lease"), Some(10_100));
    s.advance_to(10_040);
    assert_eq!(
        s.eval(FENCED_ACQUIRE, &keys, &["b", "100"]),
        Reply::Array(vec![Reply::Int(0), Reply::Int(60)])
    );
    assert_eq!(s.next_expiry(), Some(10_100));
    s.advance_to(10_100);
    assert_eq!(s.pttl("{l}lease"), 0);
    s.advance_to(10_101);
    assert!(!s.exists("{l}lease"));
    assert_eq!(
        s.eval(FENCED_ACQUIRE, &keys, &["b", "100"]),
        Reply::Array(vec![Reply::Int(1), bulk("2")])
    );
    assert_eq!(
        s.eval(LEASE_EXTEND, &["{l}lease"], &["b:2", "500"]),
        Reply::Int(1)
    );
    assert_eq!(s.expiry("{l}lease"), Some(10_601));
}

#[test]
fn a_promoted_replica_lacks_the_unreplicated_tail_and_the_old_primary_still_writes() {
    let mut s = ModelServer::new(7, 0);
    s.add_replica();
    let old_run_id = s.run_id().to_owned();
    s.command(&["SET", "a", "1"]);
    assert_eq!(s.command(&["WAIT", "1", "0"]), Reply::Int(0));
    assert_eq!(s.replicate(usize::MAX), 1);
    assert_eq!(s.command(&["WAIT", "1", "0"]), Reply::Int(1));
    s.command(&["SET", "b", "2"]);
    assert_eq!(s.replication_lag(), 1);
    let mut old = s.promote();
    assert_ne!(s.run_id(), old_run_id);
    assert_eq!(old.run_id(), old_run_id);
    assert!(s.exists("a"));
    assert!(!s.exists("b"), "the tail is lost");
    assert_eq!(old.command(&["SET", "c", "3"]), Reply::Status("OK".into()));
    assert_eq!(
        s.evalsha::<&str, &str>(&sha1_hex(b"return 1"), &[], &[]),
        Reply::Error("NOSCRIPT No matching script. Please use EVAL.".into())
    );
    s.rejoin(old);
    assert_eq!(
        s.replica_entry("a").map(|e| e.value),
        Some(Value::Str(b"1".to_vec()))
    );
    assert_eq!(s.replica_entry("c"), None);
}

#[test]
fn a_replica_applies_absolute_expiries_in_order() {
    let mut s = ModelServer::new(7, 5_000);
    s.add_replica();
    s.command(&["SET", "k", "v", "PX", "100"]);
    s.command(&["PEXPIRE", "k", "300"]);
    assert_eq!(s.replicate(1), 1);
    assert_eq!(s.replica_entry("k").and_then(|e| e.expire_at), Some(5_100));
    s.replicate(1);
    assert_eq!(s.replica_entry("k").and_then(|e| e.expire_at), Some(5_300));
    s.advance_to(5_301);
    assert!(
        s.replica_entry("k").is_some(),
        "a replica waits for the deletion"
    );
    s.replicate(1);
    assert_eq!(s.replica_entry("k"), None);
}

#[test]
fn a_restart_keeps_data_only_with_persistence_and_changes_the_run_id() {
    let mut s = ModelServer::new(3, 0);
    s.command(&["SET", "k", "v"]);
    let first = s.run_id().to_owned();
    let c = s.connect();
    s.restart(Persistence::Aof);
    assert!(s.exists("k"));
    assert_ne!(s.run_id(), first);
    assert_eq!(s.command_from(c, &["PING"]), None, "connections are cut");
    s.restart(Persistence::None);
    assert!(!s.exists("k"));
}

#[test]
fn injected_errors_answer_instead_of_running_the_command() {
    let mut s = ModelServer::new(3, 0);
    s.inject(Injected::Moved {
        slot: 12,
        addr: "127.0.0.1:7001".into(),
    });
    s.inject(Injected::TryAgain);
    assert_eq!(
        s.command(&["SET", "k", "v"]),
        Reply::Error("MOVED 12 127.0.0.1:7001".into())
    );
    assert!(s.command(&["SET", "k", "v"]).is_error());
    assert!(!s.exists("k"));
    let sha = sha1_hex(b"return 1");
    s.command(&["SCRIPT", "LOAD", "return 1"]);
    s.inject_on("evalsha", Injected::NoScript);
    assert_eq!(s.command(&["PING"]), Reply::Status("PONG".into()));
    assert_eq!(
        s.evalsha::<&str, &str>(&sha, &[], &[]),
        Reply::Error("NOSCRIPT No matching script. Please use EVAL.".into())
    );
    assert_eq!(s.evalsha::<&str, &str>(&sha, &[], &[]), Reply::Int(1));
    s.deny("client|kill");
    assert_eq!(
        s.command(&["CLIENT", "KILL", "ID", "5"]),
        Reply::Error("NOPERM this user has no permissions to run the 'client|kill' command".into())
    );
    s.set_role(Role::Replica);
    assert_eq!(
        s.command(&["SET", "k", "v"]),
        Reply::Error("READONLY You can't write against a read only replica.".into())
    );
}

#[test]
fn client_kill_closes_a_connection_by_id() {
    let mut s = ModelServer::new(3, 0);
    let a = s.connect();
    let b = s.connect();
    assert_eq!(
        s.command_from(a, &["CLIENT", "ID"]),
        Some(Reply::Int(a as i64))
    );
    let kill = [
        "CLIENT".to_owned(),
        "KILL".into(),
        "ID".into(),
        b.to_string(),
        "SKIPME".into(),
        "yes".into(),
    ];
    assert_eq!(s.command_from(a, &kill), Some(Reply::Int(1)));
    assert!(!s.is_connected(b));
    assert_eq!(s.command_from(a, &kill), Some(Reply::Int(0)));
}

#[test]
fn the_clock_runs_at_its_rate_in_whole_milliseconds() {
    let mut s = ModelServer::new(3, 1_000);
    s.set_rate(1.5);
    s.elapse(std::time::Duration::from_millis(3));
    assert_eq!(s.now_ms(), 1_004);
    s.elapse(std::time::Duration::from_millis(1));
    assert_eq!(s.now_ms(), 1_006);
    s.step_clock(-500);
    assert_eq!(s.now_ms(), 506);
}

#[test]
fn a_straddling_script_reads_a_later_clock_but_decides_expiry_at_its_start() {
    // What Redis 7.0 does when the clock ticks during a script: the key set
    // to expire at 1_000 is still there for EXISTS, while TIME, PTTL and the
    // base of PX read 1_001.
    let mut s = ModelServer::new(1, 1_000);
    s.command(&["SET", "k", "v", "PXAT", "1000"]);
    s.straddle_next_script(1, 1);
    let source = "local t = redis.call('TIME')
        return {t[2], redis.call('TIME')[2], redis.call('EXISTS', 'k'), redis.call('PTTL', 'k'),
          redis.call('SET', 'j', 'v', 'PX', 10).ok}";
    assert_eq!(
        eval(&mut s, source),
        Reply::Array(vec![
            bulk("0"),
            bulk("1000"),
            Reply::Int(1),
            Reply::Int(0),
            bulk("OK")
        ])
    );
    assert_eq!(s.last_script_calls(), 5);
    assert_eq!(s.now_ms(), 1_001);
    assert_eq!(s.expiry("j"), Some(1_011));
    assert!(!s.exists("k"));
}

#[test]
fn writes_deletions_and_expiries_are_invalidations() {
    let mut s = ModelServer::new(3, 0);
    s.command(&["SET", "a", "1", "PX", "5"]);
    s.command(&["GET", "a"]);
    s.command(&["SET", "b", "2"]);
    assert_eq!(s.take_invalidated(), vec![b"a".to_vec(), b"b".to_vec()]);
    s.advance_to(6);
    assert_eq!(s.take_invalidated(), vec![b"a".to_vec()]);
    assert!(s.take_invalidated().is_empty());
}

#[test]
fn a_replica_refuses_a_script_at_its_first_write() {
    let mut s = ModelServer::new(3, 0);
    s.set_role(Role::Replica);
    let source = "local v = redis.call('GET', KEYS[1])\nredis.call('SET', KEYS[1], 'x')\nreturn v";
    let sha = sha1_hex(source.as_bytes());
    assert_eq!(
        s.eval(source, &["k"], &[] as &[&str]),
        Reply::Error(format!(
            "READONLY You can't write against a read only replica. script: {sha}, on @user_script:2."
        ))
    );
    s.set_role(Role::Primary);
    s.set_oom(true);
    assert_eq!(
        s.command(&["SET", "k", "v"]),
        Reply::Error("OOM command not allowed when used memory > 'maxmemory'.".into())
    );
    s.set_oom(false);
    s.set_loading(true);
    assert_eq!(
        s.command(&["GET", "k"]),
        Reply::Error("LOADING Redis is loading the dataset in memory".into())
    );
}

#[test]
fn a_fork_is_independent_of_its_origin() {
    let mut s = ModelServer::new(3, 0);
    s.command(&["SET", "k", "1"]);
    let mut f = s.fork();
    f.command(&["SET", "k", "2"]);
    f.advance_to(50);
    assert_eq!(s.command(&["GET", "k"]), bulk("1"));
    assert_eq!(s.now_ms(), 0);
    assert_eq!(f.command(&["GET", "k"]), bulk("2"));
}
