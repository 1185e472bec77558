//! The server-side scripts of the reader/writer lease, run directly against a
//! real server: grants, busy replies and wait hints, writer preference,
//! per-member expiry, fencing tokens as exact strings, idempotent retries,
//! refusals that change nothing (of the semaphore's arguments too), and the
//! client-tracking invalidations that wake waiters.

mod scripts;
mod support;

use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use redis::Commands;
use scripts::*;
use support::{TestServer, server_now, shared_server, snapshot, wait_until};

// ---------------------------------------------------------------------------
// Reader/writer lease
// ---------------------------------------------------------------------------

#[test]
fn readers_share_a_writer_waits_for_the_last_with_the_latest_expiry_as_hint() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_share");
    assert_eq!(
        k.read(&mut c, "ra", 5_000, "writer"),
        Grant::Granted("0".into())
    );
    assert_eq!(
        k.read(&mut c, "rb", 60_000, "writer"),
        Grant::Granted("0".into())
    );
    let now = server_ms(&mut c);
    let (a, b) = (
        zscore(&mut c, &k.r, "ra").unwrap(),
        zscore(&mut c, &k.r, "rb").unwrap(),
    );
    assert!(
        (now + 1_000..=now + 5_000).contains(&a),
        "ra expires at {a}, now {now}"
    );
    assert!(
        (now + 50_000..=now + 60_000).contains(&b),
        "rb expires at {b}, now {now}"
    );
    assert_eq!(
        pexpiretime(&mut c, &k.r),
        b,
        "the set's own expiry is its highest score"
    );

    // Busy: the hint is when the last reader would be gone by itself.
    let hint = k.write(&mut c, "w1", 10_000, 0).hint();
    assert!((50_000..=60_000).contains(&hint), "hint {hint}");
    assert!(
        !c.exists::<_, bool>(&k.q).unwrap(),
        "intent 0 records no intent"
    );
    assert!(!c.exists::<_, bool>(&k.w).unwrap());
    assert!(
        !c.exists::<_, bool>(&k.fence).unwrap(),
        "no token was drawn"
    );

    let left = k.read_verify(&mut c, "ra").unwrap();
    assert!((1..=5_000).contains(&left), "{left}");
    assert_eq!(k.read_verify(&mut c, "nobody"), None);

    assert_eq!(k.read_release(&mut c, "rb"), 1);
    assert_eq!(k.read_release(&mut c, "rb"), 0, "released twice");
    assert_eq!(
        pexpiretime(&mut c, &k.r),
        a,
        "the set's expiry follows its highest score down"
    );
    assert!(k.write(&mut c, "w1", 10_000, 0).hint() <= 5_000);
    assert_eq!(k.read_release(&mut c, "ra"), 1);
    assert!(
        !c.exists::<_, bool>(&k.r).unwrap(),
        "the last reader out deletes the set"
    );
    assert_eq!(k.write(&mut c, "w1", 10_000, 0), Grant::Granted("1".into()));
}

#[test]
fn a_writer_excludes_readers_and_writers_and_readers_see_its_token() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_excl");
    let token = k.write(&mut c, "w1", 30_000, 0).token().to_owned();
    assert_eq!(token, "1");
    let held: String = c.get(&k.w).unwrap();
    assert_eq!(held, "w1:1");
    let pttl: i64 = c.pttl(&k.w).unwrap();
    assert!((20_000..=30_000).contains(&pttl));

    for pref in ["writer", "reader"] {
        let hint = k.read(&mut c, "r1", 5_000, pref).hint();
        assert!((20_000..=30_000).contains(&hint), "{pref}: hint {hint}");
    }
    let hint = k.write(&mut c, "w2", 5_000, 0).hint();
    assert!((1..=30_000).contains(&hint), "hint {hint}");
    assert!(
        !c.exists::<_, bool>(&k.r).unwrap(),
        "a busy reader left nothing behind"
    );

    // The writer uses the plain lease scripts on B:w.
    assert_eq!(
        int(scripts()
            .lease_extend
            .ok(&mut c, &[&k.w], &["w1:1", "45000"])),
        1
    );
    assert!(verified(scripts().lease_verify.ok(&mut c, &[&k.w], &["w1:1"])).unwrap() > 30_000);
    assert_eq!(k.release_writer(&mut c, "w1", "1"), 1);
    assert_eq!(
        k.read(&mut c, "r1", 5_000, "writer"),
        Grant::Granted("1".into())
    );
}

#[test]
fn write_tokens_strictly_increase_and_each_reader_sees_the_last_one() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_tokens");
    let mut last = 0u64;
    for i in 0..50 {
        let writer = format!("w{i}");
        let token = k.write(&mut c, &writer, 10_000, 1_000).token().to_owned();
        let n: u64 = token.parse().unwrap();
        assert!(n > last, "token {n} after {last}");
        last = n;
        assert_eq!(k.release_writer(&mut c, &writer, &token), 1);
        let reader = format!("r{i}");
        assert_eq!(
            k.read(&mut c, &reader, 10_000, "writer"),
            Grant::Granted(token)
        );
        assert_eq!(k.read_release(&mut c, &reader), 1);
    }
    assert_eq!(last, 50);
    let fence: u64 = c.get(&k.fence).unwrap();
    assert_eq!(fence, 50);
    assert_eq!(
        c.pttl::<_, i64>(&k.fence).unwrap(),
        -1,
        "the counter never expires"
    );
}

#[test]
fn retries_of_the_same_acquire_get_the_same_grant_with_a_fresh_expiry() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_retry");
    c.set::<_, _, ()>(&k.fence, 41).unwrap();

    let first = k.write(&mut c, "w1", 1_000, 5_000);
    assert_eq!(first, Grant::Granted("42".into()));
    let again = k.write(&mut c, "w1", 60_000, 5_000);
    assert_eq!(again, first, "same token");
    assert_eq!(
        c.get::<_, String>(&k.fence).unwrap(),
        "42",
        "no new increment"
    );
    assert!(c.pttl::<_, i64>(&k.w).unwrap() > 1_000, "expiry set anew");
    assert_eq!(k.release_writer(&mut c, "w1", "42"), 1);

    assert_eq!(
        k.read(&mut c, "r1", 1_000, "writer"),
        Grant::Granted("42".into())
    );
    let before = zscore(&mut c, &k.r, "r1").unwrap();
    // A waiting writer's intent now holds new readers back, but not a retry of
    // a reader that already holds its lease.
    k.write(&mut c, "w2", 10_000, 10_000).hint();
    assert!(k.read(&mut c, "r2", 1_000, "writer").hint() > 0);
    assert_eq!(
        k.read(&mut c, "r1", 60_000, "writer"),
        Grant::Granted("42".into())
    );
    let after = zscore(&mut c, &k.r, "r1").unwrap();
    assert!(
        after > before + 50_000,
        "expiry set anew: {before} → {after}"
    );
    assert_eq!(c.zcard::<_, i64>(&k.r).unwrap(), 1);
    assert_eq!(pexpiretime(&mut c, &k.r), after);
}

#[test]
fn a_late_duplicate_acquire_never_shortens_what_was_granted_or_extended() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_late_dup");

    // The writer: granted with 1 s, extended to 60 s; then the duplicate of the
    // first acquire (1 s) arrives late.
    let token = k.write(&mut c, "w1", 1_000, 0).token().to_owned();
    let value = format!("w1:{token}");
    assert_eq!(
        int(scripts()
            .lease_extend
            .ok(&mut c, &[&k.w], &[&value, "60000"])),
        1
    );
    let before = pexpiretime(&mut c, &k.w);
    assert_eq!(
        k.write(&mut c, "w1", 1_000, 0),
        Grant::Granted(token.clone())
    );
    assert_eq!(
        pexpiretime(&mut c, &k.w),
        before,
        "the writer was shortened"
    );
    assert!(c.pttl::<_, i64>(&k.w).unwrap() > 50_000);
    // A longer duplicate still lengthens it.
    k.write(&mut c, "w1", 120_000, 0).token();
    assert!(pexpiretime(&mut c, &k.w) > before + 50_000);
    assert_eq!(k.release_writer(&mut c, "w1", &token), 1);

    // A reader: the same story with its own score.
    k.read(&mut c, "r1", 1_000, "writer").token();
    assert_eq!(k.read_extend(&mut c, "r1", 60_000), 1);
    let before = zscore(&mut c, &k.r, "r1").unwrap();
    k.read(&mut c, "r1", 1_000, "writer").token();
    assert_eq!(
        zscore(&mut c, &k.r, "r1").unwrap(),
        before,
        "the reader was shortened"
    );
    assert_eq!(pexpiretime(&mut c, &k.r), before);
    k.read(&mut c, "r1", 120_000, "reader").token();
    let longer = zscore(&mut c, &k.r, "r1").unwrap();
    assert!(longer > before + 50_000, "{before} → {longer}");
    assert_eq!(pexpiretime(&mut c, &k.r), longer);

    // A permit.
    let s = SemKeys::new("sem_late_dup");
    let first = s.acquire(&mut c, "p", 1_000, 2);
    let member = SemKeys::member("p", &first);
    assert_eq!(s.extend(&mut c, &member, 60_000), 1);
    let before = zscore(&mut c, &s.permits, &member).unwrap();
    assert_eq!(s.acquire(&mut c, "p", 1_000, 2), first);
    assert_eq!(
        zscore(&mut c, &s.permits, &member).unwrap(),
        before,
        "the permit was shortened"
    );
    assert_eq!(s.acquire(&mut c, "p", 120_000, 2), first);
    let longer = zscore(&mut c, &s.permits, &member).unwrap();
    assert!(longer > before + 50_000, "{before} → {longer}");
    assert_eq!(c.hget::<_, _, String>(&s.meta, "fence").unwrap(), "1");
}

#[test]
fn a_waiting_writers_intent_holds_back_new_readers_until_it_withdraws() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_intent");
    assert_eq!(
        k.read(&mut c, "r1", 30_000, "writer"),
        Grant::Granted("0".into())
    );
    assert!(k.write(&mut c, "w1", 10_000, 10_000).hint() > 20_000);
    let intent = zscore(&mut c, &k.q, "w1").expect("the intent is recorded");
    let now = server_ms(&mut c);
    assert!((now + 5_000..=now + 10_000).contains(&intent));
    assert_eq!(pexpiretime(&mut c, &k.q), intent);

    // New readers wait (until the intent would expire by itself); the current
    // reader is not revoked and may renew.
    let hint = k.read(&mut c, "r2", 30_000, "writer").hint();
    assert!((5_000..=10_000).contains(&hint), "hint {hint}");
    assert_eq!(k.read_extend(&mut c, "r1", 30_000), 1);
    assert!(k.read_verify(&mut c, "r1").is_some());

    // Reader preference ignores intents.
    assert_eq!(
        k.read(&mut c, "r3", 30_000, "reader"),
        Grant::Granted("0".into())
    );
    assert_eq!(k.read_release(&mut c, "r3"), 1);

    // A second waiting writer: withdrawing one intent is not enough.
    k.write(&mut c, "w2", 10_000, 20_000).hint();
    assert_eq!(
        pexpiretime(&mut c, &k.q),
        zscore(&mut c, &k.q, "w2").unwrap()
    );
    assert_eq!(k.withdraw(&mut c, "w2"), 1);
    assert_eq!(k.withdraw(&mut c, "w2"), 0, "withdrawn twice");
    assert_eq!(
        pexpiretime(&mut c, &k.q),
        intent,
        "the set's expiry follows its highest score down"
    );
    assert!(k.read(&mut c, "r2", 30_000, "writer").hint() > 0);
    assert_eq!(k.withdraw(&mut c, "w1"), 1);
    assert!(
        !c.exists::<_, bool>(&k.q).unwrap(),
        "the last intent out deletes the set"
    );
    assert_eq!(
        k.read(&mut c, "r2", 30_000, "writer"),
        Grant::Granted("0".into())
    );

    // A writer that finally gets in drops its intent.
    assert_eq!(k.read_release(&mut c, "r1"), 1);
    k.write(&mut c, "w1", 10_000, 10_000).hint();
    assert!(zscore(&mut c, &k.q, "w1").is_some());
    assert_eq!(k.read_release(&mut c, "r2"), 1);
    assert_eq!(
        k.write(&mut c, "w1", 10_000, 10_000),
        Grant::Granted("1".into())
    );
    assert!(!c.exists::<_, bool>(&k.q).unwrap());
}

#[test]
fn a_retrying_writer_refreshes_its_intent_only_once_a_quarter_of_it_passed() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_intent_refresh");
    k.read(&mut c, "r1", 30_000, "writer").token();
    k.write(&mut c, "w1", 10_000, 10_000).hint();
    let first = zscore(&mut c, &k.q, "w1").unwrap();
    // At once again: three quarters and more are left, so nothing is written
    // (the readers waiting on the intent set are not woken).
    k.write(&mut c, "w1", 10_000, 10_000).hint();
    assert_eq!(zscore(&mut c, &k.q, "w1").unwrap(), first);
    // A longer intent leaves less than three quarters of it: refreshed.
    k.write(&mut c, "w1", 10_000, 40_000).hint();
    let refreshed = zscore(&mut c, &k.q, "w1").unwrap();
    assert!(refreshed > first + 25_000, "{first} → {refreshed}");
    assert_eq!(pexpiretime(&mut c, &k.q), refreshed);
    // A short intent recorded a while ago (80 ms on the server's clock, more
    // than a quarter of it) is refreshed.
    k.write(&mut c, "w2", 10_000, 200).hint();
    let short = zscore(&mut c, &k.q, "w2").unwrap();
    wait_until(
        Duration::from_secs(5),
        "80 ms to pass on the server",
        || server_now(&mut c).0 >= short - 200 + 80,
    );
    k.write(&mut c, "w2", 10_000, 200).hint();
    assert!(zscore(&mut c, &k.q, "w2").unwrap() > short);
}

#[test]
fn the_writer_clean_up_deletes_only_what_this_owner_set() {
    let mut c = shared_server().client();
    let s = scripts();
    let k = RwKeys::new("rw_write_clean_up");
    let clean = |c: &mut redis::Connection, owner: &str| {
        int(s.write_clean_up.ok(c, &[&k.w, &k.q], &[owner]))
    };
    assert_eq!(clean(&mut c, "nobody"), 0, "nothing there");
    k.read(&mut c, "r1", 30_000, "writer").token();
    k.write(&mut c, "w1", 10_000, 10_000).hint();
    k.write(&mut c, "w2", 10_000, 10_000).hint();
    assert_eq!(clean(&mut c, "w1"), 1, "the intent");
    assert!(zscore(&mut c, &k.q, "w1").is_none());
    assert!(
        zscore(&mut c, &k.q, "w2").is_some(),
        "another writer's intent"
    );
    assert_eq!(k.read_release(&mut c, "r1"), 1);
    let token = k.write(&mut c, "w2", 10_000, 10_000).token().to_owned();
    assert_eq!(clean(&mut c, "w1"), 0, "another writer's lease");
    assert!(c.exists::<_, bool>(&k.w).unwrap());
    assert_eq!(clean(&mut c, "w2"), 1, "its own lease");
    assert!(!c.exists::<_, bool>(&k.w).unwrap());
    assert_eq!(
        c.get::<_, String>(&k.fence).unwrap(),
        token,
        "the counter stays"
    );
    // A reader's release takes the same 'exact' mode as a permit's, and no other.
    k.read(&mut c, "r2", 30_000, "writer").token();
    let e = s.read_release.err(&mut c, &[&k.r], &["r2", "prefix"]);
    assert_eq!(e.code(), Some("BADARG"));
    assert!(zscore(&mut c, &k.r, "r2").is_some());
    assert_eq!(int(s.read_release.ok(&mut c, &[&k.r], &["r2", "exact"])), 1);
}

#[test]
fn an_abandoned_intent_expires_by_itself() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_intent_expiry");
    assert_eq!(
        k.read(&mut c, "r1", 30_000, "writer"),
        Grant::Granted("0".into())
    );
    k.write(&mut c, "crashed", 30_000, 400).hint();
    let hint = k.read(&mut c, "r2", 30_000, "writer").hint();
    assert!((1..=400).contains(&hint), "hint {hint}");
    let start = Instant::now();
    let mut attempts = 0;
    wait_until(Duration::from_secs(5), "the intent to expire", || {
        attempts += 1;
        k.read(&mut c, "r2", 30_000, "writer") == Grant::Granted("0".into())
    });
    println!(
        "reader admitted {:?} after the intent was recorded ({attempts} attempts)",
        start.elapsed()
    );
    assert!(
        !c.exists::<_, bool>(&k.q).unwrap(),
        "the expired intent was pruned"
    );
}

#[test]
fn each_reader_expires_by_its_own_score_and_never_comes_back() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_expiry");
    assert_eq!(
        k.read(&mut c, "short", 100, "writer"),
        Grant::Granted("0".into())
    );
    assert_eq!(
        k.read(&mut c, "long", 60_000, "writer"),
        Grant::Granted("0".into())
    );
    wait_until(Duration::from_secs(5), "the short reader to expire", || {
        k.read_verify(&mut c, "short").is_none()
    });
    // Still in the set until something prunes it; extend removes it instead.
    assert!(zscore(&mut c, &k.r, "short").is_some());
    assert_eq!(k.read_extend(&mut c, "short", 60_000), 0);
    assert_eq!(
        zscore(&mut c, &k.r, "short"),
        None,
        "an expired reader never comes back"
    );
    assert_eq!(k.read_extend(&mut c, "short", 60_000), 0);
    assert!(
        k.read_verify(&mut c, "long").is_some(),
        "the other reader stays"
    );
    assert_eq!(k.read_extend(&mut c, "long", 60_000), 1);

    // A writer is held by the remaining reader only; when it goes, the writer
    // gets in.
    let hint = k.write(&mut c, "w1", 10_000, 0).hint();
    assert!(hint > 50_000, "hint {hint}");
    assert_eq!(k.read_release(&mut c, "long"), 1);
    assert_eq!(k.write(&mut c, "w1", 10_000, 0), Grant::Granted("1".into()));

    // A release of an expired reader reports 0 and removes it.
    assert_eq!(k.release_writer(&mut c, "w1", "1"), 1);
    assert_eq!(
        k.read(&mut c, "brief", 50, "writer"),
        Grant::Granted("1".into())
    );
    wait_until(Duration::from_secs(5), "the brief reader to expire", || {
        k.read_verify(&mut c, "brief").is_none()
    });
    assert_eq!(k.read_release(&mut c, "brief"), 0);
    assert!(!c.exists::<_, bool>(&k.r).unwrap());
}

#[test]
fn the_reader_set_is_pruned_by_a_writers_attempt_and_vanishes_by_itself() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_prune");
    for i in 0..4 {
        k.read(&mut c, &format!("r{i}"), 60 + i * 20, "writer")
            .token();
    }
    k.read(&mut c, "keep", 60_000, "writer").token();
    wait_until(
        Duration::from_secs(5),
        "the short readers to expire",
        || k.read_verify(&mut c, "r3").is_none(),
    );
    assert_eq!(
        c.zcard::<_, i64>(&k.r).unwrap(),
        5,
        "expired members wait for a prune"
    );
    assert!(k.write(&mut c, "w1", 10_000, 0).hint() > 50_000);
    let left: Vec<String> = c.zrange(&k.r, 0, -1).unwrap();
    assert_eq!(left, ["keep"], "the busy writer pruned the expired readers");

    // Readers that all stop renewing: the set's own expiry removes it, with
    // no script run.
    assert_eq!(k.read_extend(&mut c, "keep", 100), 1);
    assert!(pexpiretime(&mut c, &k.r) <= server_ms(&mut c) + 100);
    wait_until(Duration::from_secs(10), "the reader set to expire", || {
        !c.exists::<_, bool>(&k.r).unwrap()
    });
    assert_eq!(k.write(&mut c, "w1", 10_000, 0), Grant::Granted("1".into()));
}

#[test]
fn tokens_at_and_above_ten_to_the_fourteen_and_near_the_maximum_are_exact_strings() {
    let mut c = shared_server().client();
    for (start, want) in [
        ("99999999999999", "100000000000000"),
        ("9007199254740993", "9007199254740994"),
        ("9223372036854775806", "9223372036854775807"),
    ] {
        let k = RwKeys::new("rw_big");
        c.set::<_, _, ()>(&k.fence, start).unwrap();
        assert_eq!(
            k.read(&mut c, "r0", 10_000, "writer"),
            Grant::Granted(start.into())
        );
        assert_eq!(k.read_release(&mut c, "r0"), 1);
        assert_eq!(
            k.write(&mut c, "w1", 10_000, 0),
            Grant::Granted(want.into())
        );
        assert_eq!(c.get::<_, String>(&k.w).unwrap(), format!("w1:{want}"));
        assert_eq!(c.get::<_, String>(&k.fence).unwrap(), want);
        assert_eq!(
            k.write(&mut c, "w1", 10_000, 0),
            Grant::Granted(want.into()),
            "retry"
        );
        assert_eq!(k.release_writer(&mut c, "w1", want), 1);
        assert_eq!(
            k.read(&mut c, "r1", 10_000, "writer"),
            Grant::Granted(want.into())
        );
        assert_eq!(k.read_release(&mut c, "r1"), 1);
    }

    for (start, want) in [
        ("99999999999999", "100000000000000"),
        ("9007199254740993", "9007199254740994"),
        ("9223372036854775806", "9223372036854775807"),
    ] {
        let k = SemKeys::new("sem_big");
        c.hset::<_, _, _, ()>(&k.meta, "fence", start).unwrap();
        let got = k.acquire(&mut c, "p1", 10_000, 2);
        assert_eq!(
            got,
            PermitReply::Granted {
                slot: 0,
                token: want.into()
            }
        );
        assert_eq!(k.acquire(&mut c, "p1", 10_000, 2), got, "retry");
        let member = SemKeys::member("p1", &got);
        assert_eq!(member, format!("p1:0:{want}"));
        assert!(k.verify(&mut c, &member).is_some());
        assert_eq!(c.hget::<_, _, String>(&k.meta, "fence").unwrap(), want);
    }
}

#[test]
fn a_counter_at_its_maximum_refuses_a_new_token_and_changes_nothing() {
    let mut c = shared_server().client();
    let k = RwKeys::new("rw_max");
    c.set::<_, _, ()>(&k.fence, "9223372036854775807").unwrap();
    let now = server_ms(&mut c);
    c.zadd::<_, _, _, ()>(&k.r, "dead", now - 1_000).unwrap();
    let before = snapshot(&mut c, &k.prefix);
    let e = scripts()
        .write_acquire
        .err(&mut c, &k.all(), &["w1", "10000", "1000"]);
    assert_eq!(e.code(), Some("BADFENCE"), "{e}");
    assert!(
        e.detail().unwrap().starts_with("KEYS[4] is at its maximum"),
        "{e}"
    );
    assert_eq!(snapshot(&mut c, &k.prefix), before);
    // A retry of the holder of the last token needs no new one.
    c.set::<_, _, ()>(&k.w, "w0:9223372036854775807").unwrap();
    assert_eq!(
        k.write(&mut c, "w0", 10_000, 0),
        Grant::Granted("9223372036854775807".into())
    );
    let e = scripts()
        .write_acquire
        .err(&mut c, &k.all(), &["w1", "10000", "1000"]);
    assert_eq!(e.code(), Some("BADFENCE"), "{e}");
    c.del::<_, ()>(&k.w).unwrap();
    // Readers only read the counter.
    assert_eq!(
        k.read(&mut c, "r1", 10_000, "writer"),
        Grant::Granted("9223372036854775807".into())
    );

    let s = SemKeys::new("sem_max");
    c.hset::<_, _, _, ()>(&s.meta, "fence", "9223372036854775807")
        .unwrap();
    let before = snapshot(&mut c, &s.prefix);
    let e = scripts()
        .sem_acquire
        .err(&mut c, &s.all(), &["p1", "10000", "3"]);
    assert_eq!(e.code(), Some("BADFENCE"), "{e}");
    assert_eq!(snapshot(&mut c, &s.prefix), before);
    let now = server_ms(&mut c);
    // A holder of the last token, as an acquire leaves it: the member, its
    // index entry and its slot bit.
    c.zadd::<_, _, _, ()>(&s.permits, "p0:1:9223372036854775807", now + 60_000)
        .unwrap();
    c.hset::<_, _, _, ()>(&s.meta, "holder:p0", "1:9223372036854775807")
        .unwrap();
    c.setbit::<_, ()>(&s.slots, 1, true).unwrap();
    assert_eq!(
        s.acquire(&mut c, "p0", 10_000, 3),
        PermitReply::Granted {
            slot: 1,
            token: "9223372036854775807".into()
        },
        "a retry of the holder of the last token needs no new one"
    );
    let e = scripts()
        .sem_acquire
        .err(&mut c, &s.all(), &["p1", "10000", "3"]);
    assert_eq!(e.code(), Some("BADFENCE"), "{e}");
}

#[test]
fn every_wrong_key_of_the_reader_writer_lease_is_refused_and_nothing_changes() {
    const ACQUIRES: &[&str] = &["read_w", "read_r", "write", "write_try"];
    let s = scripts();
    // A valid state with expired members: a script that wrote before checking
    // would prune them, and the snapshot would show it.
    fn baseline(c: &mut redis::Connection, k: &[&str]) {
        let now = server_ms(c);
        let _: () = c
            .zadd_multiple(k[1], &[(now - 1_000, "dead"), (now + 60_000, "live")])
            .unwrap();
        let _: () = c
            .zadd_multiple(k[2], &[(now - 1_000, "deadw"), (now + 60_000, "livew")])
            .unwrap();
        let _: () = c.set(k[3], 7).unwrap();
    }
    fn names(p: &str) -> Vec<String> {
        ["w", "r", "q", "fence"]
            .iter()
            .map(|s| format!("{p}{{rw}}:{s}"))
            .collect()
    }
    fn replace(i: usize, kind: &'static str) -> impl Fn(&mut redis::Connection, &[&str]) {
        move |c, k| {
            let _: () = c.del(k[i]).unwrap();
            match kind {
                "hash" => c.hset::<_, _, _, ()>(k[i], "f", "v").unwrap(),
                "string" => c.set::<_, _, ()>(k[i], "v").unwrap(),
                "list" => c.rpush::<_, _, ()>(k[i], "v").unwrap(),
                "zset" => c.zadd::<_, _, _, ()>(k[i], "m", 1).unwrap(),
                _ => unreachable!(),
            }
        }
    }
    let runs = [
        Run {
            name: "read_w",
            script: &s.read_acquire,
            keys: &[0, 1, 2, 3],
            args: &["o", "1000", "writer"],
        },
        Run {
            name: "read_r",
            script: &s.read_acquire,
            keys: &[0, 1, 2, 3],
            args: &["o", "1000", "reader"],
        },
        Run {
            name: "write",
            script: &s.write_acquire,
            keys: &[0, 1, 2, 3],
            args: &["o", "1000", "500"],
        },
        Run {
            name: "write_try",
            script: &s.write_acquire,
            keys: &[0, 1, 2, 3],
            args: &["o", "1000", "0"],
        },
        Run {
            name: "read_extend",
            script: &s.read_extend,
            keys: &[1],
            args: &["live", "1000"],
        },
        Run {
            name: "read_verify",
            script: &s.read_verify,
            keys: &[1],
            args: &["live"],
        },
        Run {
            name: "read_release",
            script: &s.read_release,
            keys: &[1],
            args: &["live"],
        },
        Run {
            name: "withdraw",
            script: &s.write_withdraw,
            keys: &[2],
            args: &["livew"],
        },
        Run {
            name: "write_clean_up",
            script: &s.write_clean_up,
            keys: &[0, 2],
            args: &["livew"],
        },
    ];
    let own_ops: &[&str] = &["read_extend", "read_verify", "read_release"];
    let mut cases = vec![
        Refusal::new(
            "writer lease is a hash",
            replace(0, "hash"),
            ("BADKEY", "KEYS[1] holds a hash"),
            ACQUIRES,
        ),
        Refusal::new(
            "writer lease is a zset",
            replace(0, "zset"),
            ("BADKEY", "KEYS[1] holds a zset"),
            ACQUIRES,
        ),
        Refusal::new(
            "reader set is a string",
            replace(1, "string"),
            ("BADKEY", "KEYS[2] holds a string"),
            ACQUIRES,
        ),
        Refusal::new(
            "reader set is a list",
            replace(1, "list"),
            ("BADKEY", "KEYS[1] holds a list"),
            own_ops,
        ),
        Refusal::new(
            "intent set is a hash",
            replace(2, "hash"),
            ("BADKEY", "KEYS[3] holds a hash"),
            ACQUIRES,
        ),
        Refusal::new(
            "intent set is a string",
            replace(2, "string"),
            ("BADKEY", "KEYS[1] holds a string"),
            &["withdraw"],
        ),
        Refusal::new(
            "writer lease is a list",
            replace(0, "list"),
            ("BADKEY", "KEYS[1] holds a list"),
            &["write_clean_up"],
        ),
        Refusal::new(
            "intent set is a hash",
            replace(2, "hash"),
            ("BADKEY", "KEYS[2] holds a hash"),
            &["write_clean_up"],
        ),
        Refusal::new(
            "fence is a hash",
            replace(3, "hash"),
            ("BADFENCE", "KEYS[4] holds a hash"),
            ACQUIRES,
        ),
        Refusal::new(
            "fence has a TTL",
            |c, k| c.pexpire::<_, ()>(k[3], 60_000).unwrap(),
            ("BADFENCE", "KEYS[4] has an expiry"),
            ACQUIRES,
        ),
    ];
    for v in [
        "abc",
        "-1",
        "1.5",
        "01",
        "",
        "9223372036854775808",
        "99999999999999999999",
    ] {
        cases.push(Refusal::new(
            format!("fence {v:?}"),
            move |c, k| c.set::<_, _, ()>(k[3], v).unwrap(),
            ("BADFENCE", "KEYS[4] is not a non-negative integer"),
            ACQUIRES,
        ));
    }
    refuse_each(
        &mut shared_server().client(),
        "rw_refuse",
        baseline,
        names,
        &runs,
        &cases,
    );
}

#[test]
fn bad_arguments_are_refused_and_nothing_changes() {
    let mut c = shared_server().client();
    let s = scripts();
    let k = RwKeys::new("rw_badarg");
    let now = server_ms(&mut c);
    c.zadd::<_, _, _, ()>(&k.r, "dead", now - 1_000).unwrap();
    c.zadd::<_, _, _, ()>(&k.q, "deadw", now - 1_000).unwrap();
    let sem = SemKeys::new("sem_badarg");
    c.zadd::<_, _, _, ()>(&sem.permits, "dead:0:1", now - 1_000)
        .unwrap();
    c.hset::<_, _, _, ()>(&sem.meta, "capacity", 3).unwrap();
    let rw_keys = k.all();
    let sem_keys = [sem.permits.as_str(), sem.meta.as_str()];
    let cases: &[(&Lua, &[&str], &[&str])] = &[
        (&s.read_acquire, &rw_keys, &["o", "0", "writer"]),
        (&s.read_acquire, &rw_keys, &["o", "-5", "writer"]),
        (&s.read_acquire, &rw_keys, &["o", "1.5", "writer"]),
        (&s.read_acquire, &rw_keys, &["o", "abc", "writer"]),
        (&s.read_acquire, &rw_keys, &["o", "", "writer"]),
        (
            &s.read_acquire,
            &rw_keys,
            &["o", "99999999999999", "writer"],
        ),
        (&s.read_acquire, &rw_keys, &["o", "1000", "both"]),
        (&s.read_acquire, &rw_keys, &["o", "1000"]),
        (&s.read_acquire, &rw_keys, &["", "1000", "writer"]),
        (&s.read_acquire, &rw_keys, &["a:b", "1000", "writer"]),
        (&s.write_acquire, &rw_keys, &["o", "1000", "-1"]),
        (&s.write_acquire, &rw_keys, &["o", "1000", "x"]),
        (&s.write_acquire, &rw_keys, &["o", "0", "0"]),
        (&s.write_acquire, &rw_keys, &["a:b", "1000", "0"]),
        (&s.write_withdraw, &[&k.q], &[""]),
        (&s.read_extend, &[&k.r], &["dead", "0"]),
        (&s.read_release, &[&k.r], &[""]),
        (&s.sem_acquire, &sem_keys, &["o", "1000", "0"]),
        (&s.sem_acquire, &sem_keys, &["o", "1000", "10001"]),
        (&s.sem_acquire, &sem_keys, &["o", "1000", "abc"]),
        (&s.sem_acquire, &sem_keys, &["o", "1000", "3.0"]),
        (&s.sem_acquire, &sem_keys, &["o", "1000", "-3"]),
        (&s.sem_acquire, &sem_keys, &["o", "0", "3"]),
        (&s.sem_acquire, &sem_keys, &["a:b", "1000", "3"]),
        (&s.sem_extend, &[&sem.permits], &["dead:0:1", "x"]),
        (&s.sem_release, &[&sem.permits], &["dead:0:1", "all"]),
        (&s.sem_release, &[&sem.permits], &["dead:0", "prefix"]),
        (&s.sem_set_capacity, &[&sem.meta, &sem.permits], &["0"]),
        (&s.sem_set_capacity, &[&sem.meta, &sem.permits], &["10001"]),
        (&s.sem_set_capacity, &[&sem.meta, &sem.permits], &["two"]),
    ];
    for (script, keys, args) in cases {
        let before = (snapshot(&mut c, &k.prefix), snapshot(&mut c, &sem.prefix));
        let e = script.err(&mut c, keys, args);
        assert_eq!(e.code(), Some("BADARG"), "{args:?}: {e}");
        assert_eq!(
            (snapshot(&mut c, &k.prefix), snapshot(&mut c, &sem.prefix)),
            before,
            "{args:?} changed something"
        );
    }
}

#[test]
fn concurrent_readers_and_writers_never_overlap_a_writer() {
    const THREADS: usize = 6;
    const EACH: usize = 100;
    let server = shared_server();
    let k = RwKeys::new("rw_concurrent");
    // (readers inside, writer inside, last write token)
    let state = Mutex::new((0usize, false, 0u64));
    let max_readers = Mutex::new(0usize);
    thread::scope(|s| {
        for t in 0..THREADS {
            let (k, state, max_readers) = (&k, &state, &max_readers);
            s.spawn(move || {
                let mut c = server.client();
                for i in 0..EACH {
                    let owner = format!("t{t}n{i}");
                    if (t + i) % 4 == 0 {
                        let token = loop {
                            match k.write(&mut c, &owner, 10_000, 2_000) {
                                Grant::Granted(token) => break token.parse::<u64>().unwrap(),
                                Grant::Busy(_) => thread::sleep(Duration::from_micros(300)),
                            }
                        };
                        {
                            let mut st = state.lock().unwrap();
                            assert!(!st.1 && st.0 == 0, "writer {token} overlaps {st:?}");
                            assert!(token > st.2, "token {token} after {}", st.2);
                            *st = (0, true, token);
                        }
                        thread::sleep(Duration::from_micros(300));
                        state.lock().unwrap().1 = false;
                        assert_eq!(k.release_writer(&mut c, &owner, &token.to_string()), 1);
                    } else {
                        let epoch = loop {
                            match k.read(&mut c, &owner, 10_000, "writer") {
                                Grant::Granted(epoch) => break epoch.parse::<u64>().unwrap(),
                                Grant::Busy(_) => thread::sleep(Duration::from_micros(300)),
                            }
                        };
                        {
                            let mut st = state.lock().unwrap();
                            assert!(!st.1, "reader overlaps a writer");
                            assert_eq!(epoch, st.2, "the reader's epoch is the last write token");
                            st.0 += 1;
                            let mut m = max_readers.lock().unwrap();
                            *m = (*m).max(st.0);
                        }
                        thread::sleep(Duration::from_micros(500));
                        state.lock().unwrap().0 -= 1;
                        assert_eq!(k.read_release(&mut c, &owner), 1);
                    }
                }
            });
        }
    });
    let st = state.into_inner().unwrap();
    println!(
        "last write token {}, at most {} readers at once",
        st.2,
        max_readers.into_inner().unwrap()
    );
    assert_eq!(
        st.2,
        (0..THREADS)
            .map(|t| (0..EACH).filter(|i| (t + i) % 4 == 0).count() as u64)
            .sum::<u64>()
    );
}

#[test]
fn a_reader_held_back_is_woken_by_the_writers_release_and_by_the_withdraw() {
    let server = shared_server();
    let k = RwKeys::new("track_reader");
    let mut t = Tracker::new(server, &k.prefix);

    // Held back by a writer: its release wakes the reader.
    let token = k.write(&mut t.admin, "w1", 60_000, 0).token().to_owned();
    busy_then_woken(
        &mut t,
        |c| assert!(k.read(c, "r1", 10_000, "writer").hint() > 0),
        |c| assert_eq!(k.release_writer(c, "w1", &token), 1),
        &k.w,
    );

    // Held back by an intent, with an expired intent beside it: the attempt
    // prunes (a write, which ends tracking) and must read the set again.
    k.read(&mut t.admin, "holder", 60_000, "writer").token();
    k.write(&mut t.admin, "w2", 60_000, 60_000).hint();
    let now = server_ms(&mut t.admin);
    t.admin
        .zadd::<_, _, _, ()>(&k.q, "crashed", now - 1_000)
        .unwrap();
    let own = busy_then_woken(
        &mut t,
        |c| assert!(k.read(c, "r1", 10_000, "writer").hint() > 0),
        |c| assert_eq!(k.withdraw(c, "w2"), 1),
        &k.q,
    );
    assert!(
        own.contains(&k.q),
        "the attempt pruned the intents: {own:?}"
    );
    assert_eq!(
        k.read(&mut t.admin, "r1", 10_000, "writer"),
        Grant::Granted("1".into())
    );
}

#[test]
fn a_writer_held_back_is_woken_by_the_last_reader_and_by_the_other_writer() {
    let server = shared_server();
    let k = RwKeys::new("track_writer");
    let mut t = Tracker::new(server, &k.prefix);

    k.read(&mut t.admin, "r1", 60_000, "writer").token();
    let now = server_ms(&mut t.admin);
    t.admin
        .zadd::<_, _, _, ()>(&k.r, "crashed", now - 1_000)
        .unwrap();
    let own = busy_then_woken(
        &mut t,
        |c| assert!(k.write(c, "w1", 10_000, 5_000).hint() > 0),
        |c| assert_eq!(k.read_release(c, "r1"), 1),
        &k.r,
    );
    assert!(
        own.contains(&k.r),
        "the attempt pruned the readers: {own:?}"
    );

    let token = k.write(&mut t.admin, "w2", 60_000, 0).token().to_owned();
    busy_then_woken(
        &mut t,
        |c| assert!(k.write(c, "w1", 10_000, 5_000).hint() > 0),
        |c| assert_eq!(k.release_writer(c, "w2", &token), 1),
        &k.w,
    );
    assert_eq!(
        k.write(&mut t.admin, "w1", 10_000, 0),
        Grant::Granted("2".into())
    );
}

#[test]
fn sets_that_expire_by_themselves_wake_their_waiters() {
    // A fresh server: few keys with a TTL, so the server's expiry cycle finds
    // the sets promptly.
    let server = TestServer::start();
    let k = RwKeys::new("track_expiry");
    let mut t = Tracker::new(&server, &k.prefix);

    // An intent nobody withdraws: the intent set's own expiry wakes the reader.
    k.read(&mut t.admin, "holder", 60_000, "writer").token();
    k.write(&mut t.admin, "crashed", 60_000, 500).hint();
    let start = Instant::now();
    busy_then_woken(
        &mut t,
        |c| assert!(k.read(c, "r1", 10_000, "writer").hint() <= 500),
        |_| {},
        &k.q,
    );
    println!(
        "intent set expired and invalidated {:?} after it was written",
        start.elapsed()
    );
    assert!(!t.admin.exists::<_, bool>(&k.q).unwrap());
    assert_eq!(
        k.read(&mut t.admin, "r1", 10_000, "writer"),
        Grant::Granted("0".into())
    );

    // Readers that stop renewing: the reader set's own expiry wakes the writer.
    assert_eq!(k.read_extend(&mut t.admin, "holder", 500), 1);
    assert_eq!(k.read_extend(&mut t.admin, "r1", 400), 1);
    let start = Instant::now();
    busy_then_woken(
        &mut t,
        |c| assert!(k.write(c, "w1", 10_000, 0).hint() <= 500),
        |_| {},
        &k.r,
    );
    println!(
        "reader set expired and invalidated {:?} after the last renewal",
        start.elapsed()
    );
    assert_eq!(
        k.write(&mut t.admin, "w1", 10_000, 0),
        Grant::Granted("1".into())
    );
}
