//! `Coordinator::inspect`: what a deployment holds under one base key, read
//! against a real server and compared with what the primitives took.

mod support;

use std::time::Duration;

use redis::Commands;
use respire_coordination::{
    Coordinator, Error, Fairness, FencingToken, HeldAs, MAX_HOLDER_LEN, Protocol, RedlockGroup,
    RedlockOptions,
};
use support::{TestServer, shared_server, unique_prefix, wait_until};

fn coordinator(prefix: &str) -> Coordinator {
    Coordinator::builder(&shared_server().url())
        .key_prefix(prefix)
        .build()
        .unwrap()
}

const TTL: Duration = Duration::from_secs(20);

#[test]
fn a_free_base_and_an_exclusive_holder() {
    let prefix = unique_prefix("inspect-writer");
    let coord = coordinator(&prefix);
    let free = coord.inspect("{job}").unwrap();
    assert_eq!(free.held_as(), HeldAs::Free);
    assert_eq!(free.base, format!("{prefix}{{job}}"));
    assert_eq!(free.exclusive, None);
    assert_eq!(free.last_write_token, None);
    assert_eq!(free.capacity, None);

    let rw = coord.read_write_lease("{job}").unwrap();
    let writer = rw.write().try_acquire(TTL).unwrap().unwrap();
    let held = coord.inspect("{job}").unwrap();
    assert_eq!(held.held_as(), HeldAs::Exclusive);
    let x = held.exclusive.as_ref().unwrap();
    assert_eq!(x.fencing_token, Some(writer.fencing_token()));
    let left = x.remaining.unwrap();
    assert!(left > Duration::ZERO && left <= TTL, "{left:?}");
    assert_eq!(held.last_write_token, Some(writer.fencing_token()));
    writer.release().unwrap();
    let after = coord.inspect("{job}").unwrap();
    assert_eq!(after.held_as(), HeldAs::Free);
    assert_eq!(after.last_write_token, Some(FencingToken(1)));

    // A value without a token (a plain lock on the same key) is exclusive too.
    let plain = coord
        .lock("{job}:w")
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .unwrap();
    let held = coord.inspect("{job}").unwrap();
    assert_eq!(held.held_as(), HeldAs::Exclusive);
    assert_eq!(held.exclusive.unwrap().fencing_token, None);
    drop(plain);
}

#[test]
fn readers_waiting_writers_and_permits() {
    let prefix = unique_prefix("inspect-shared");
    let coord = coordinator(&prefix);
    let rw = coord.read_write_lease("{job}").unwrap();
    let r1 = rw.read().try_acquire(TTL).unwrap().unwrap();
    let r2 = rw
        .read()
        .try_acquire(Duration::from_secs(5))
        .unwrap()
        .unwrap();
    // A writer that waits leaves an intent.
    assert!(
        rw.write()
            .acquire_timeout(TTL, Duration::from_millis(50))
            .unwrap()
            .is_none()
    );
    let shared = coord.inspect("{job}").unwrap();
    assert_eq!(shared.held_as(), HeldAs::Shared);
    assert_eq!(shared.readers.len(), 2);
    assert!(
        shared.readers[0].remaining <= Duration::from_secs(5),
        "{shared:?}"
    );
    assert_eq!(shared.exclusive, None);
    drop((r1, r2));

    let sem = coord.semaphore("{pool}", 3).unwrap();
    let p1 = sem.try_acquire(TTL).unwrap().unwrap();
    let p2 = sem.try_acquire(TTL).unwrap().unwrap();
    let counted = coord.inspect("{pool}").unwrap();
    assert_eq!(counted.held_as(), HeldAs::Counted);
    assert_eq!(counted.capacity, Some(3));
    let mut slots: Vec<(u32, FencingToken)> = counted
        .permits
        .iter()
        .map(|p| (p.slot, p.fencing_token))
        .collect();
    slots.sort();
    assert_eq!(
        slots,
        [
            (p1.slot(), p1.fencing_token()),
            (p2.slot(), p2.fencing_token())
        ]
    );
    assert_eq!(counted.last_permit_token, Some(p2.fencing_token()));
    drop((p1, p2));
    assert_eq!(coord.inspect("{pool}").unwrap().held_as(), HeldAs::Free);
}

#[test]
fn mixed_holders_expired_entries_and_bad_keys() {
    let prefix = unique_prefix("inspect-mixed");
    let coord = coordinator(&prefix);
    let mut admin = shared_server().client();
    // Written outside one layout: a permit beside an exclusive holder.
    let _w = coord
        .read_write_lease("{job}")
        .unwrap()
        .write()
        .try_acquire(TTL)
        .unwrap()
        .unwrap();
    let _p = coord
        .semaphore("{job}", 2)
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .unwrap();
    assert_eq!(coord.inspect("{job}").unwrap().held_as(), HeldAs::Mixed);

    // An expired reader still in the set is not counted.
    let readers = format!("{prefix}{{old}}:r");
    let _: () = admin.zadd(&readers, "gone", 1_000).unwrap();
    let old = coord.inspect("{old}").unwrap();
    assert_eq!(old.held_as(), HeldAs::Free);
    assert!(
        admin.exists::<_, bool>(&readers).unwrap(),
        "inspect changed nothing"
    );

    // A key of another type is named.
    let _: () = admin.set(format!("{prefix}{{bad}}:r"), "x").unwrap();
    let err = coord.inspect("{bad}").unwrap_err();
    assert!(
        matches!(&err, Error::BadKey { key, .. } if key.ends_with("{bad}:r")),
        "{err}"
    );
    // A base without a hash tag is refused before anything is sent.
    assert!(matches!(
        coord.inspect("job"),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn the_same_over_resp3() {
    let prefix = unique_prefix("inspect-resp3");
    let coord = Coordinator::builder(&shared_server().url())
        .key_prefix(&prefix)
        .protocol(Protocol::Resp3)
        .build()
        .unwrap();
    let rw = coord.read_write_lease("{job}").unwrap();
    let _r = rw.read().try_acquire(TTL).unwrap().unwrap();
    let shared = coord.inspect("{job}").unwrap();
    assert_eq!(shared.held_as(), HeldAs::Shared);
    assert_eq!(shared.readers.len(), 1);
    let sem = coord.semaphore("{pool}", 2).unwrap();
    let p = sem.try_acquire(TTL).unwrap().unwrap();
    let counted = coord.inspect("{pool}").unwrap();
    assert_eq!(counted.permits.len(), 1);
    assert_eq!(counted.permits[0].fencing_token, p.fencing_token());
}

#[test]
fn a_lease_on_keys_of_the_callers_choosing() {
    let prefix = unique_prefix("inspect-lease");
    let coord = coordinator(&prefix);
    let (lease, fence) = ("{reports:daily}:lease", "{reports:daily}:fence");
    let free = coord.inspect_lease(lease, Some(fence)).unwrap();
    assert_eq!(free.held_as(), HeldAs::Free);
    assert_eq!(free.base, format!("{prefix}{lease}"));
    assert_eq!(free.last_write_token, None);

    // A fenced lock made as the crate's docs show.
    let fenced = coord.fenced_lock(lease, fence).unwrap();
    let guard = fenced.try_acquire(TTL).unwrap().unwrap();
    let held = coord.inspect_lease(lease, Some(fence)).unwrap();
    assert_eq!(held.held_as(), HeldAs::Exclusive);
    let x = held.exclusive.as_ref().unwrap();
    assert_eq!(x.fencing_token, Some(guard.fencing_token()));
    let pttl: i64 = shared_server()
        .client()
        .pttl(format!("{prefix}{lease}"))
        .unwrap();
    let left = x.remaining.unwrap();
    assert!(
        left <= TTL && left.as_millis() as i64 >= pttl - 1_000,
        "{left:?} {pttl}"
    );
    assert_eq!(held.last_write_token, Some(guard.fencing_token()));
    // Without the fence key: the holder, no counter.
    let held = coord.inspect_lease(lease, None).unwrap();
    assert_eq!(
        held.exclusive.unwrap().fencing_token,
        Some(guard.fencing_token())
    );
    assert_eq!(held.last_write_token, None);
    guard.release().unwrap();
    let after = coord.inspect_lease(lease, Some(fence)).unwrap();
    assert_eq!(after.exclusive, None);
    assert_eq!(after.last_write_token, Some(FencingToken(1)));

    // A plain lock: held, no token.
    let plain = coord.lock("nightly").unwrap();
    let guard = plain.try_acquire(TTL).unwrap().unwrap();
    let held = coord.inspect_lease("nightly", None).unwrap();
    assert_eq!(held.held_as(), HeldAs::Exclusive);
    assert_eq!(held.exclusive.as_ref().unwrap().fencing_token, None);
    drop(guard);

    // Bad input and bad keys.
    assert!(matches!(
        coord.inspect_lease("{a}:lease", Some("{b}:fence")),
        Err(Error::CrossSlot { .. })
    ));
    assert!(matches!(
        coord.inspect_lease("", None),
        Err(Error::InvalidArgument(_))
    ));
    let _: () = shared_server()
        .client()
        .rpush(format!("{prefix}a-list"), "x")
        .unwrap();
    assert!(matches!(
        coord.inspect_lease("a-list", None),
        Err(Error::BadKey { .. })
    ));
}

/// The server's own view of a key's time left: `PTTL`, in ms.
fn server_pttl(key: &str) -> i64 {
    shared_server().client().pttl(key).unwrap()
}

/// The server's own view of a sorted set member's time left: its score
/// (the expiry, ms) less the server's `TIME`.
fn server_left(key: &str, member: &str) -> i64 {
    let mut admin = shared_server().client();
    let score: f64 = admin.zscore(key, member).unwrap();
    let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut admin).unwrap();
    score as i64 - (s * 1000 + us / 1000)
}

/// `left` is what the server said at about the same moment, `pttl` ms: not
/// more, and less by no more than the round trips between the two reads.
fn close_to(left: Duration, pttl: i64) {
    let left = left.as_millis() as i64;
    assert!(
        left <= pttl + 1_000 && left >= pttl - 1_000 && pttl > 0,
        "inspected {left} ms, the server says {pttl} ms"
    );
}

#[test]
fn every_kind_of_lease_shows_who_holds_it() {
    let prefix = unique_prefix("inspect-holder");
    let coord = coordinator(&prefix);
    let hex = |owner: &str| owner.len() == 32 && owner.bytes().all(|b| b.is_ascii_hexdigit());

    // A plain lock: no token, the holder as given (`:` and `%` included).
    let lock = coord
        .lock("nightly")
        .unwrap()
        .with_holder("host-a pid 42: 100% busy")
        .unwrap();
    assert_eq!(lock.holder(), Some("host-a pid 42: 100% busy"));
    let guard = lock.try_acquire(TTL).unwrap().unwrap();
    let x = coord
        .inspect_lease("nightly", None)
        .unwrap()
        .exclusive
        .unwrap();
    assert_eq!(x.fencing_token, None);
    assert_eq!(x.holder.as_deref(), Some("host-a pid 42: 100% busy"));
    assert!(hex(&x.owner), "{x:?}");
    close_to(
        x.remaining.unwrap(),
        server_pttl(&format!("{prefix}nightly")),
    );
    // The value on the server: the owner, `@` and the holder escaped.
    let raw: String = shared_server()
        .client()
        .get(format!("{prefix}nightly"))
        .unwrap();
    assert_eq!(raw, format!("{}@host-a pid 42%3A 100%25 busy", x.owner));
    drop(guard);

    // A fenced lock: the token and the holder.
    let fenced = coord
        .fenced_lock("{r}:lease", "{r}:fence")
        .unwrap()
        .with_holder("fenced one")
        .unwrap();
    let guard = fenced.try_acquire(TTL).unwrap().unwrap();
    let x = coord
        .inspect_lease("{r}:lease", Some("{r}:fence"))
        .unwrap()
        .exclusive
        .unwrap();
    assert_eq!(x.fencing_token, Some(guard.fencing_token()));
    assert_eq!(x.holder.as_deref(), Some("fenced one"));
    guard.release().unwrap();

    // A writer, then readers, each with its own holder.
    let rw = coord.read_write_lease("{job}").unwrap();
    let writer = rw.write().with_holder("writer w").unwrap();
    let w = writer.try_acquire(TTL).unwrap().unwrap();
    let held = coord.inspect("{job}").unwrap();
    let x = held.exclusive.unwrap();
    assert_eq!(x.fencing_token, Some(w.fencing_token()));
    assert_eq!(x.holder.as_deref(), Some("writer w"));
    close_to(
        x.remaining.unwrap(),
        server_pttl(&format!("{prefix}{{job}}:w")),
    );
    w.release().unwrap();
    let r1 = rw
        .read()
        .with_holder("reader 1")
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .unwrap();
    let r2 = rw.read().try_acquire(TTL).unwrap().unwrap();
    let shared = coord.inspect("{job}").unwrap();
    assert_eq!(shared.held_as(), HeldAs::Shared);
    let mut names: Vec<Option<&str>> = shared.readers.iter().map(|r| r.holder.as_deref()).collect();
    names.sort();
    assert_eq!(names, [None, Some("reader 1")]);
    for r in &shared.readers {
        let member = match &r.holder {
            Some(h) => format!("{}@{}", r.owner, h.replace(':', "%3A")),
            None => r.owner.clone(),
        };
        close_to(
            r.remaining,
            server_left(&format!("{prefix}{{job}}:r"), &member),
        );
    }
    drop((r1, r2));

    // Permits: the holder beside slot and token, in `holders()` too.
    let sem = coord.semaphore("{pool}", 2).unwrap();
    let named = sem.clone().with_holder("permit p").unwrap();
    let p = named.try_acquire(TTL).unwrap().unwrap();
    let counted = coord.inspect("{pool}").unwrap();
    assert_eq!(counted.permits.len(), 1);
    let permit = &counted.permits[0];
    assert_eq!(
        (permit.slot, permit.fencing_token, permit.holder.as_deref()),
        (p.slot(), p.fencing_token(), Some("permit p"))
    );
    assert!(hex(&permit.owner));
    let member = format!(
        "{}@permit p:{}:{}",
        permit.owner,
        p.slot(),
        p.fencing_token()
    );
    close_to(
        permit.remaining,
        server_left(&format!("{prefix}{{pool}}:permits"), &member),
    );
    let listed = sem.holders().unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].slot, &listed[0].owner, &listed[0].holder),
        (permit.slot, &permit.owner, &permit.holder)
    );
    drop(p);

    // A first-in-first-out lock keeps the holder it was given.
    let fifo = coord
        .lock("{fifo}")
        .unwrap()
        .with_holder("queued one")
        .unwrap()
        .with_fairness(Fairness::fifo())
        .unwrap();
    assert_eq!(fifo.holder(), Some("queued one"));
    let guard = fifo.try_acquire(TTL).unwrap().unwrap();
    let x = coord
        .inspect_lease("{fifo}", None)
        .unwrap()
        .exclusive
        .unwrap();
    assert_eq!(x.holder.as_deref(), Some("queued one"));
    drop(guard);

    // Without a holder: none recorded, and the owner value is the bare id.
    let guard = coord
        .lock("bare")
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .unwrap();
    let x = coord
        .inspect_lease("bare", None)
        .unwrap()
        .exclusive
        .unwrap();
    assert_eq!(x.holder, None);
    assert!(hex(&x.owner));
    drop(guard);
}

#[test]
fn a_bad_holder_is_refused_and_changes_nothing() {
    let prefix = unique_prefix("inspect-bad-holder");
    let coord = coordinator(&prefix);
    let long = "x".repeat(MAX_HOLDER_LEN + 1);
    for bad in ["", "line\nbreak", "tab\there", "bell\u{7}", long.as_str()] {
        let err = coord.lock("k").unwrap().with_holder(bad).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{bad:?}: {err}");
        assert!(respire_coordination::check_holder(bad).is_err());
    }
    // The longest accepted, every byte of it kept.
    let longest = "é".repeat(MAX_HOLDER_LEN / 2);
    let guard = coord
        .lock("k")
        .unwrap()
        .with_holder(&longest)
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .unwrap();
    let x = coord.inspect_lease("k", None).unwrap().exclusive.unwrap();
    assert_eq!(x.holder.as_deref(), Some(longest.as_str()));
    drop(guard);
    let keys: Vec<String> = shared_server().client().keys(format!("{prefix}*")).unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

#[test]
fn a_redlock_lock_shows_its_holder_on_every_node() {
    let servers = [
        TestServer::start(),
        TestServer::start(),
        TestServer::start(),
    ];
    let urls: Vec<String> = servers.iter().map(TestServer::url).collect();
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let group = RedlockGroup::connect(&refs, RedlockOptions::default()).unwrap();
    let bad = group.clone().with_holder("a\nb").unwrap_err();
    assert!(matches!(bad, Error::InvalidArgument(_)), "{bad}");
    let named = group.with_holder("redlock host pid 7").unwrap();
    assert_eq!(named.holder(), Some("redlock host pid 7"));
    let guard = named
        .lock("invoices")
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .unwrap();
    // The grant returns once a quorum has answered; the last node's
    // `SET` may still be on its way.
    for s in &servers {
        let node = Coordinator::connect(&s.url()).unwrap();
        wait_until(Duration::from_secs(5), "the lock on every node", || {
            node.inspect_lease("invoices", None)
                .unwrap()
                .exclusive
                .is_some()
        });
    }
    let mut owners = Vec::new();
    for s in &servers {
        let node = Coordinator::connect(&s.url()).unwrap();
        let x = node
            .inspect_lease("invoices", None)
            .unwrap()
            .exclusive
            .unwrap();
        assert_eq!(x.fencing_token, None);
        assert_eq!(x.holder.as_deref(), Some("redlock host pid 7"));
        let pttl: i64 = s.client().pttl("invoices").unwrap();
        close_to(x.remaining.unwrap(), pttl);
        owners.push(x.owner);
    }
    owners.dedup();
    assert_eq!(owners.len(), 1, "one owner on every node: {owners:?}");
    // The group's own reading: every node, and the owner of a quorum.
    let seen = named.inspect("invoices").unwrap();
    assert_eq!(seen.quorum, 2);
    assert_eq!(seen.nodes.len(), 3);
    let x = seen.holder().unwrap();
    assert_eq!(x.owner, owners[0]);
    assert_eq!(x.holder.as_deref(), Some("redlock host pid 7"));
    assert_eq!(seen.held_on(&x.owner), 3);
    for (node, s) in seen.nodes.iter().zip(&servers) {
        assert!(
            node.addr.ends_with(&format!("127.0.0.1:{}", s.port())),
            "{}",
            node.addr
        );
        let pttl: i64 = s.client().pttl("invoices").unwrap();
        close_to(
            node.holder
                .as_ref()
                .unwrap()
                .as_ref()
                .unwrap()
                .remaining
                .unwrap(),
            pttl,
        );
    }
    // One node gone: its error in its place, the lock still held on two.
    servers[2].kill();
    let seen = named.inspect("invoices").unwrap();
    assert!(seen.nodes[2].holder.is_err(), "{seen:?}");
    assert_eq!(seen.holder().map(|h| &h.owner), Some(&owners[0]));
    assert_eq!(seen.held_on(&owners[0]), 2);
    // Another owner on one of the two: no owner holds a quorum.
    let _: () = servers[1]
        .client()
        .set_options(
            "invoices",
            "someone-else",
            redis::SetOptions::default().with_expiration(redis::SetExpiry::PX(20_000)),
        )
        .unwrap();
    let seen = named.inspect("invoices").unwrap();
    assert_eq!(seen.holder(), None, "{seen:?}");
    assert_eq!(seen.held_on("someone-else"), 1);
    assert!(matches!(named.inspect(""), Err(Error::InvalidArgument(_))));
    drop(guard);
}
