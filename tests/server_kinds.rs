//! What differs between the servers the suite runs on — Redis 7.0 (the
//! default) and Valkey 8.1 (`RESPIRE_TEST_SERVER=valkey`) — each difference
//! checked as a fact on whichever server this run uses, and where the library
//! depends on it, the library's behaviour checked to be the same on both.

mod support;

use std::time::Duration;

use respire_coordination::{Coordinator, Error, key_slot};
use support::{ServerKind, TestCluster, TestSentinel, TestServer, shared_server, unique_prefix};

/// The value of `field` in `INFO section`, if the server reports it.
fn info_field(conn: &mut redis::Connection, section: &str, field: &str) -> Option<String> {
    let info: String = redis::cmd("INFO").arg(section).query(conn).expect("INFO");
    let prefix = format!("{field}:");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .map(|v| v.trim().to_owned())
}

/// The `HELLO` reply's field `name`, as text.
fn hello_field(conn: &mut redis::Connection, name: &str) -> String {
    let reply: Vec<redis::Value> = redis::cmd("HELLO").arg(2).query(conn).expect("HELLO 2");
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        redis::Value::Int(n) => n.to_string(),
        other => format!("{other:?}"),
    };
    reply
        .chunks(2)
        .find(|pair| text(&pair[0]) == name)
        .map(|pair| text(&pair[1]))
        .unwrap_or_else(|| panic!("HELLO has no field {name}"))
}

#[test]
fn info_and_hello_name_the_server_and_its_version() {
    let mut conn = shared_server().client();
    let redis_version = info_field(&mut conn, "server", "redis_version");
    let valkey_version = info_field(&mut conn, "server", "valkey_version");
    let server_name = info_field(&mut conn, "server", "server_name");
    match ServerKind::current() {
        ServerKind::Redis => {
            let version = redis_version.expect("redis_version");
            assert!(version.starts_with("7.0."), "redis_version:{version}");
            assert_eq!(valkey_version, None);
            assert_eq!(server_name, None);
            assert_eq!(hello_field(&mut conn, "server"), "redis");
            assert_eq!(hello_field(&mut conn, "version"), version);
        }
        ServerKind::Valkey => {
            // Valkey reports a fixed Redis version for clients that look for
            // features by it, and its own beside it: a check of `redis_version`
            // alone takes Valkey 8.1 for Redis 7.2.
            assert_eq!(redis_version.as_deref(), Some("7.2.4"));
            assert_eq!(valkey_version.as_deref(), Some("8.1.8"));
            assert_eq!(server_name.as_deref(), Some("valkey"));
            assert_eq!(hello_field(&mut conn, "server"), "valkey");
            assert_eq!(hello_field(&mut conn, "version"), "8.1.8");
        }
    }
}

#[test]
fn set_ifeq_compares_and_sets_on_valkey_only() {
    let mut conn = shared_server().client();
    let key = format!("{}k", unique_prefix("ifeq"));
    let set_ifeq = |conn: &mut redis::Connection, value: &str, expected: &str| {
        redis::cmd("SET")
            .arg(&key)
            .arg(value)
            .arg("IFEQ")
            .arg(expected)
            .arg("PX")
            .arg(60_000)
            .query::<Option<String>>(conn)
    };
    let get = |conn: &mut redis::Connection| -> Option<String> {
        redis::cmd("GET").arg(&key).query(conn).expect("GET")
    };
    let pttl = |conn: &mut redis::Connection| -> i64 {
        redis::cmd("PTTL").arg(&key).query(conn).expect("PTTL")
    };
    match ServerKind::current() {
        ServerKind::Redis => {
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg("a")
                .query(&mut conn)
                .unwrap();
            let err = set_ifeq(&mut conn, "b", "a").unwrap_err();
            assert_eq!(err.code(), Some("ERR"), "{err}");
            assert!(err.to_string().contains("syntax error"), "{err}");
            assert_eq!(get(&mut conn).as_deref(), Some("a"));
            assert_eq!(pttl(&mut conn), -1);
        }
        ServerKind::Valkey => {
            // No key: nothing set, none created.
            assert_eq!(set_ifeq(&mut conn, "b", "a").unwrap(), None);
            assert_eq!(get(&mut conn), None);
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg("a")
                .query(&mut conn)
                .unwrap();
            // Another value: refused, the key as it was.
            assert_eq!(set_ifeq(&mut conn, "b", "other").unwrap(), None);
            assert_eq!(get(&mut conn).as_deref(), Some("a"));
            assert_eq!(pttl(&mut conn), -1);
            // The value it holds: replaced, with the new expiry.
            assert_eq!(
                set_ifeq(&mut conn, "b", "a").unwrap().as_deref(),
                Some("OK")
            );
            assert_eq!(get(&mut conn).as_deref(), Some("b"));
            let ttl = pttl(&mut conn);
            assert!((59_000..=60_000).contains(&ttl), "PTTL {ttl}");
            // With GET, one reply tells the three cases of an extension apart:
            // the key's own value (extended), another value (refused), none
            // (gone, not created); a key of another type is an error.
            let extend = |conn: &mut redis::Connection, key: &str, value: &str| {
                redis::cmd("SET")
                    .arg(key)
                    .arg(value)
                    .arg("IFEQ")
                    .arg(value)
                    .arg("PX")
                    .arg(30_000)
                    .arg("GET")
                    .query::<Option<String>>(conn)
            };
            assert_eq!(extend(&mut conn, &key, "b").unwrap().as_deref(), Some("b"));
            let ttl = pttl(&mut conn);
            assert!((29_000..=30_000).contains(&ttl), "PTTL {ttl}");
            assert_eq!(extend(&mut conn, &key, "c").unwrap().as_deref(), Some("b"));
            assert_eq!(get(&mut conn).as_deref(), Some("b"));
            let gone = format!("{key}:gone");
            assert_eq!(extend(&mut conn, &gone, "c").unwrap(), None);
            let exists: i64 = redis::cmd("EXISTS").arg(&gone).query(&mut conn).unwrap();
            assert_eq!(exists, 0);
            let list = format!("{key}:list");
            let _: i64 = redis::cmd("LPUSH")
                .arg(&list)
                .arg("x")
                .query(&mut conn)
                .unwrap();
            let err = extend(&mut conn, &list, "c").unwrap_err();
            assert_eq!(err.code(), Some("WRONGTYPE"), "{err}");
        }
    }
}

#[test]
fn waitaof_exists_on_valkey_only() {
    let mut conn = shared_server().client();
    let reply = redis::cmd("WAITAOF")
        .arg(0)
        .arg(0)
        .arg(100)
        .query::<Vec<i64>>(&mut conn);
    match ServerKind::current() {
        ServerKind::Redis => {
            let err = reply.unwrap_err();
            assert!(err.to_string().contains("unknown command"), "{err}");
        }
        // No append-only file and no replica: nothing acknowledged.
        ServerKind::Valkey => assert_eq!(reply.unwrap(), vec![0, 0]),
    }
}

/// A server with the user `app` (password `pw`) allowed the keys `app*`
/// only, every command but `PEXPIRE`.
fn server_with_a_restricted_user() -> TestServer {
    TestServer::builder()
        .acl_user("app on >pw ~app* &* +@all -pexpire")
        .start()
}

#[test]
fn a_script_denied_a_key_is_refused_alike_and_is_a_permission_error_on_both() {
    let server = server_with_a_restricted_user();
    let mut app = server
        .redis_client_for(&server.url_for_user("app", "pw"))
        .get_connection()
        .unwrap();
    // The facts: a key passed as a script's key is checked before the script
    // runs, `NOPERM` on both servers, worded differently...
    let err = redis::cmd("EVAL")
        .arg("return redis.call('GET', KEYS[1])")
        .arg(1)
        .arg("other")
        .query::<Option<String>>(&mut app)
        .unwrap_err();
    assert_eq!(err.code(), Some("NOPERM"), "{err}");
    // ...while a key the script names itself fails inside the script, as an
    // `ERR` whose words differ by server.
    let err = redis::cmd("EVAL")
        .arg("return redis.call('GET', 'other')")
        .arg(0)
        .query::<Option<String>>(&mut app)
        .unwrap_err();
    assert_eq!(err.code(), Some("ERR"), "{err}");
    let expected = match ServerKind::current() {
        ServerKind::Redis => "The user executing the script can't access at least one of the keys",
        ServerKind::Valkey => "ACL failure in script: No permissions to access a key",
    };
    assert!(err.to_string().contains(expected), "{err}");
    // The library: a fenced acquire (a script) on keys outside the pattern is
    // a permission error, and nothing is written.
    let coord = Coordinator::builder(&server.url_for_user("app", "pw"))
        .key_prefix("other:")
        .build()
        .unwrap();
    let err = coord
        .fenced_lock("{f}:lease", "{f}:fence")
        .unwrap()
        .try_acquire(Duration::from_secs(5))
        .unwrap_err();
    assert!(matches!(err, Error::Permission(_)), "{err}");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query(&mut server.client())
        .unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

#[test]
fn a_script_denied_a_command_words_it_by_server_and_is_a_permission_error_on_both() {
    let server = server_with_a_restricted_user();
    let mut app = server
        .redis_client_for(&server.url_for_user("app", "pw"))
        .get_connection()
        .unwrap();
    let err = redis::cmd("EVAL")
        .arg("return redis.call('PEXPIRE', KEYS[1], 1000)")
        .arg(1)
        .arg("app:k")
        .query::<i64>(&mut app)
        .unwrap_err();
    assert_eq!(err.code(), Some("ERR"), "{err}");
    let expected = match ServerKind::current() {
        ServerKind::Redis => "The user executing the script can't run this command",
        ServerKind::Valkey => {
            "ACL failure in script: User app has no permissions to run the 'pexpire' command"
        }
    };
    assert!(err.to_string().contains(expected), "{err}");
    // The library: on Redis a fenced lease's extension is a script calling
    // PEXPIRE, so it is a permission error and the lease keeps the expiry it
    // had; on Valkey 8.1 it is `SET … IFEQ`, which this user may run.
    let coord = Coordinator::builder(&server.url_for_user("app", "pw"))
        .key_prefix("app:")
        .build()
        .unwrap();
    let guard = coord
        .fenced_lock("{f}:lease", "{f}:fence")
        .unwrap()
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .unwrap();
    let extended = guard.reset_expiry(Duration::from_secs(60));
    let pttl: i64 = redis::cmd("PTTL")
        .arg("app:{f}:lease")
        .query(&mut server.client())
        .unwrap();
    match ServerKind::current() {
        ServerKind::Redis => {
            let err = extended.unwrap_err();
            assert!(matches!(err, Error::Permission(_)), "{err}");
            assert!((0..=5_000).contains(&pttl), "PTTL {pttl}");
        }
        ServerKind::Valkey => {
            assert!(extended.unwrap(), "SET IFEQ extended the lease");
            assert!(pttl > 55_000, "PTTL {pttl}");
        }
    }
}

#[test]
fn a_set_whose_expiry_is_the_current_millisecond_is_kept_by_redis_and_deleted_by_valkey() {
    let mut conn = shared_server().client();
    let prefix = unique_prefix("pxat");
    // Inside a script the server decides expiries at the script's start, so
    // the millisecond `TIME` gives is "now" for every command in it (unless
    // the script straddles a millisecond boundary: then tried again).
    let script = "local t = redis.call('TIME') \
        local now = t[1] * 1000 + math.floor(t[2] / 1000) \
        local set = redis.call('SET', KEYS[1], 'v', 'PXAT', now) \
        redis.call('SET', KEYS[2], 'v') \
        local pexpireat = redis.call('PEXPIREAT', KEYS[2], now) \
        local after = redis.call('TIME') \
        local same = (after[1] * 1000 + math.floor(after[2] / 1000)) == now \
        return {same and 1 or 0, set.ok, redis.call('EXISTS', KEYS[1]), \
            redis.call('PTTL', KEYS[1]), pexpireat, redis.call('EXISTS', KEYS[2])}";
    let mut reply = None;
    for attempt in 0.. {
        assert!(attempt < 100, "no script ran within one millisecond");
        let got: (i64, String, i64, i64, i64, i64) = redis::cmd("EVAL")
            .arg(script)
            .arg(2)
            .arg(format!("{prefix}{attempt}:set"))
            .arg(format!("{prefix}{attempt}:pexpireat"))
            .query(&mut conn)
            .unwrap();
        if got.0 == 1 {
            reply = Some(got);
            break;
        }
    }
    let (_, set, set_exists, set_pttl, pexpireat, pexpireat_exists) = reply.unwrap();
    assert_eq!(set, "OK");
    // PEXPIREAT at the current millisecond deletes the key on both...
    assert_eq!((pexpireat, pexpireat_exists), (1, 0));
    match ServerKind::current() {
        // ...while Redis 7.0 keeps a key SET with it until that millisecond
        // has passed...
        ServerKind::Redis => assert_eq!((set_exists, set_pttl), (1, 0)),
        // ...and Valkey 8.1 deletes it as it deletes the other.
        ServerKind::Valkey => assert_eq!((set_exists, set_pttl), (0, -2)),
    }
}

#[test]
fn an_unknown_command_in_a_script_is_worded_by_server() {
    let mut conn = shared_server().client();
    let err = redis::cmd("EVAL")
        .arg("return redis.call('NOSUCH')")
        .arg(0)
        .query::<i64>(&mut conn)
        .unwrap_err();
    assert_eq!(err.code(), Some("ERR"), "{err}");
    let expected = match ServerKind::current() {
        ServerKind::Redis => "Unknown Redis command called from script",
        ServerKind::Valkey => "Unknown command called from script",
    };
    assert!(err.to_string().contains(expected), "{err}");
}

#[test]
fn scripts_see_the_compatible_version_and_valkey_adds_the_server_global() {
    let mut conn = shared_server().client();
    let version: String = redis::cmd("EVAL")
        .arg("return redis.REDIS_VERSION")
        .arg(0)
        .query(&mut conn)
        .unwrap();
    let server_call = redis::cmd("EVAL")
        .arg("return server.call('PING')")
        .arg(0)
        .query::<String>(&mut conn);
    match ServerKind::current() {
        ServerKind::Redis => {
            assert!(version.starts_with("7.0."), "{version}");
            let err = server_call.unwrap_err();
            assert!(
                err.to_string()
                    .contains("nonexistent global variable 'server'"),
                "{err}"
            );
        }
        ServerKind::Valkey => {
            assert_eq!(version, "7.2.4");
            assert_eq!(server_call.unwrap(), "PONG");
        }
    }
}

#[test]
fn sentinel_names_the_primary_by_the_command_the_library_sends_on_both() {
    let deployment = TestSentinel::start();
    let primary = deployment.primary();
    let mut sentinel = deployment.sentinel(0).client();
    // What the library asks: the same answer on both.
    let addr: (String, String) = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(deployment.service())
        .query(&mut sentinel)
        .unwrap();
    assert_eq!(addr, ("127.0.0.1".to_owned(), primary.port().to_string()));
    // Roles keep the old words on Valkey too.
    let role = |server: &TestServer| -> String {
        let reply: Vec<redis::Value> = redis::cmd("ROLE").query(&mut server.client()).unwrap();
        match &reply[0] {
            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            other => panic!("ROLE answered {other:?}"),
        }
    };
    assert_eq!(role(primary), "master");
    assert_eq!(role(deployment.replica()), "slave");
    // Valkey adds the new name beside the old one.
    let by_new_name = redis::cmd("SENTINEL")
        .arg("GET-PRIMARY-ADDR-BY-NAME")
        .arg(deployment.service())
        .query::<(String, String)>(&mut sentinel);
    match ServerKind::current() {
        ServerKind::Redis => {
            let err = by_new_name.unwrap_err();
            assert_eq!(err.code(), Some("ERR"), "{err}");
        }
        ServerKind::Valkey => assert_eq!(by_new_name.unwrap(), addr),
    }
}

#[test]
fn keys_a_node_drops_with_a_slot_it_lost_are_invalidated_by_valkey_only() {
    let cluster = TestCluster::start();
    // Two keys on one primary, in different slots: one whose slot is taken
    // away, one to show that the invalidation channel works.
    let moved = "{moved}k".to_owned();
    let source = cluster.primary_for_key(&moved);
    let control = (0..1000)
        .map(|i| format!("{{control{i}}}k"))
        .find(|k| {
            cluster.primary_for_key(k) == source
                && key_slot(k.as_bytes()) != key_slot(moved.as_bytes())
        })
        .expect("a second key on that primary");
    let to = *cluster
        .primaries()
        .iter()
        .find(|&&p| p != source)
        .expect("another primary");
    let node = cluster.node(source);
    let mut admin = node.client();
    for key in [&moved, &control] {
        let () = redis::cmd("SET")
            .arg(key)
            .arg("v")
            .query(&mut admin)
            .unwrap();
    }
    // A subscriber, and a connection tracking both keys into it.
    let mut subscriber = node.client();
    let id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query(&mut subscriber)
        .unwrap();
    let mut pubsub = subscriber.as_pubsub();
    pubsub.subscribe("__redis__:invalidate").unwrap();
    pubsub
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut tracker = node.client();
    let () = redis::cmd("CLIENT")
        .arg("TRACKING")
        .arg("ON")
        .arg("REDIRECT")
        .arg(id)
        .query(&mut tracker)
        .unwrap();
    for key in [&moved, &control] {
        let _: String = redis::cmd("GET").arg(key).query(&mut tracker).unwrap();
    }
    // The slot is given to another primary: the source drops its keys.
    cluster.reassign_slot(key_slot(moved.as_bytes()), to);
    // Then a write the source surely reports: every invalidation of the drop
    // comes before it on the subscriber's connection.
    let () = redis::cmd("SET")
        .arg(&control)
        .arg("w")
        .query(&mut admin)
        .unwrap();
    let mut invalidated = Vec::new();
    while !invalidated.contains(&control) {
        let message = pubsub.get_message().expect("an invalidation within 10 s");
        let keys: Option<Vec<String>> = message.get_payload().unwrap();
        invalidated.extend(keys.unwrap_or_default());
    }
    let dropped_reported = invalidated.contains(&moved);
    match ServerKind::current() {
        ServerKind::Redis => assert!(!dropped_reported, "{invalidated:?}"),
        ServerKind::Valkey => assert!(dropped_reported, "{invalidated:?}"),
    }
}
