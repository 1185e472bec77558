//! `Coordinator::inspect`: what a deployment holds under one base key, read
//! against a real server and compared with what the primitives took.

mod support;

use std::time::Duration;

use redis::Commands;
use respire_coordination::{Coordinator, Error, FencingToken, HeldAs, Protocol};
use support::{shared_server, unique_prefix};

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
    assert!(shared.readers[0] <= Duration::from_secs(5), "{shared:?}");
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
