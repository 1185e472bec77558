//! The server-side scripts of the semaphore, run directly against a real
//! server: permits in the lowest free slot, idempotent retries, capacity
//! rules, per-permit expiry, refusals that change nothing, a random schedule
//! and concurrent holders checked against the capacity, and the
//! client-tracking invalidations that wake waiters.

mod scripts;
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use redis::Commands;
use scripts::*;
use support::{Rng, shared_server, snapshot, wait_until};

// ---------------------------------------------------------------------------
// Semaphore
// ---------------------------------------------------------------------------

#[test]
fn permits_take_the_lowest_free_slot_up_to_the_capacity() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_slots");
    let a = k.acquire(&mut c, "a", 10_000, 3);
    let b = k.acquire(&mut c, "b", 20_000, 3);
    let d = k.acquire(&mut c, "d", 30_000, 3);
    assert_eq!(
        a,
        PermitReply::Granted {
            slot: 0,
            token: "1".into()
        }
    );
    assert_eq!(
        b,
        PermitReply::Granted {
            slot: 1,
            token: "2".into()
        }
    );
    assert_eq!(
        d,
        PermitReply::Granted {
            slot: 2,
            token: "3".into()
        }
    );
    assert_eq!(c.hget::<_, _, String>(&k.meta, "capacity").unwrap(), "3");
    assert_eq!(c.pttl::<_, i64>(&k.meta).unwrap(), -1, "meta never expires");
    assert_eq!(
        pexpiretime(&mut c, &k.permits),
        -1,
        "the permit set has no key expiry: its index must not outlive it"
    );
    k.check_index(&mut c);

    // Full: the hint is when the earliest permit would be gone by itself.
    let hint = k.acquire(&mut c, "e", 10_000, 3).hint();
    assert!((5_000..=10_000).contains(&hint), "hint {hint}");
    assert_eq!(
        c.hget::<_, _, String>(&k.meta, "fence").unwrap(),
        "3",
        "a busy attempt draws no token"
    );

    let st = k.status(&mut c);
    assert_eq!(st.capacity, 3);
    let members: Vec<&str> = st.holders.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(
        members,
        ["a:0:1", "b:1:2", "d:2:3"],
        "soonest to expire first"
    );
    assert!(
        st.holders
            .iter()
            .zip([10_000, 20_000, 30_000])
            .all(|((_, left), ttl)| (ttl - 5_000..=ttl).contains(left)),
        "{st:?}"
    );

    assert_eq!(k.release(&mut c, &SemKeys::member("b", &b)), 1);
    assert_eq!(
        k.release(&mut c, &SemKeys::member("b", &b)),
        0,
        "released twice"
    );
    let e = k.acquire(&mut c, "e", 10_000, 3);
    assert_eq!(
        e,
        PermitReply::Granted {
            slot: 1,
            token: "4".into()
        },
        "the lowest free slot"
    );
    assert_eq!(k.release(&mut c, &SemKeys::member("a", &a)), 1);
    assert_eq!(
        k.acquire(&mut c, "f", 10_000, 3),
        PermitReply::Granted {
            slot: 0,
            token: "5".into()
        }
    );

    k.check_index(&mut c);

    // Release by owner alone, after an acquire whose reply was lost.
    assert_eq!(k.release_owner(&mut c, "f"), 1);
    assert_eq!(k.release_owner(&mut c, "f"), 0);
    assert_eq!(k.status(&mut c).holders.len(), 2);
    k.check_index(&mut c);
    // The last permit out deletes the set and the bitmap; the hash keeps
    // only the capacity and the counter.
    assert_eq!(k.release(&mut c, &SemKeys::member("d", &d)), 1);
    assert_eq!(k.release(&mut c, &SemKeys::member("e", &e)), 1);
    assert!(!c.exists::<_, bool>(&k.permits).unwrap());
    assert!(!c.exists::<_, bool>(&k.slots).unwrap());
    let fields: Vec<String> = c.hkeys(&k.meta).unwrap();
    assert_eq!(fields.len(), 2, "{fields:?}");
}

#[test]
fn a_retried_acquire_gets_the_same_permit_with_a_fresh_expiry_and_no_new_token() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_retry");
    let first = k.acquire(&mut c, "p", 1_000, 2);
    let member = SemKeys::member("p", &first);
    let before = zscore(&mut c, &k.permits, &member).unwrap();
    k.acquire(&mut c, "q", 1_000, 2).granted();
    // Full now, but the retry is a holder's.
    assert_eq!(k.acquire(&mut c, "p", 60_000, 2), first);
    let after = zscore(&mut c, &k.permits, &member).unwrap();
    assert!(after > before + 50_000, "{before} → {after}");
    assert_eq!(c.hget::<_, _, String>(&k.meta, "fence").unwrap(), "2");
    assert_eq!(k.status(&mut c).holders.len(), 2);
    k.check_index(&mut c);
}

#[test]
fn a_different_capacity_is_refused_and_nothing_changes() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_mismatch");
    k.acquire(&mut c, "a", 60_000, 3).granted();
    let now = server_ms(&mut c);
    c.zadd::<_, _, _, ()>(&k.permits, "dead:1:0", now - 1_000)
        .unwrap();
    let before = snapshot(&mut c, &k.prefix);
    for (requested, msg) in [
        ("4", "CAPMISMATCH 3 4"),
        ("1", "CAPMISMATCH 3 1"),
        ("10000", "CAPMISMATCH 3 10000"),
    ] {
        let e = scripts()
            .sem_acquire
            .err(&mut c, &k.all(), &["b", "10000", requested]);
        assert_eq!(e.code(), Some("CAPMISMATCH"), "{e}");
        assert_eq!(
            format!(
                "{} {}",
                e.code().unwrap(),
                e.detail().unwrap().split(" script:").next().unwrap()
            ),
            msg
        );
        assert_eq!(
            snapshot(&mut c, &k.prefix),
            before,
            "{requested} changed something"
        );
    }
    // The idempotent retry of a holder is refused too when it disagrees.
    let e = scripts()
        .sem_acquire
        .err(&mut c, &k.all(), &["a", "10000", "4"]);
    assert_eq!(e.code(), Some("CAPMISMATCH"));
    assert_eq!(snapshot(&mut c, &k.prefix), before);
}

#[test]
fn lowering_the_capacity_drains_and_raising_it_admits_at_once() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_drain");
    assert_eq!(k.set_capacity(&mut c, 3), -1, "nothing stored before");
    let held: Vec<String> = ["a", "b", "d"]
        .iter()
        .zip([10_000, 20_000, 30_000])
        .map(|(o, ttl)| SemKeys::member(o, &k.acquire(&mut c, o, ttl, 3)))
        .collect();
    assert_eq!(k.set_capacity(&mut c, 1), 3);
    assert_eq!(k.status(&mut c).capacity, 1);
    assert_eq!(k.status(&mut c).holders.len(), 3, "no permit is revoked");
    // Three must go before one is free: the hint is the third expiry.
    let hint = k.acquire(&mut c, "e", 10_000, 1).hint();
    assert!((20_000..=30_000).contains(&hint), "hint {hint}");
    assert_eq!(
        k.extend(&mut c, &held[2], 30_000),
        1,
        "holders keep renewing"
    );
    assert_eq!(k.release(&mut c, &held[0]), 1);
    assert!(k.acquire(&mut c, "e", 10_000, 1).hint() > 0);
    assert_eq!(k.release(&mut c, &held[1]), 1);
    assert!(
        k.acquire(&mut c, "e", 10_000, 1).hint() > 0,
        "1 holder, capacity 1"
    );
    assert_eq!(k.release(&mut c, &held[2]), 1);
    assert_eq!(
        k.acquire(&mut c, "e", 10_000, 1),
        PermitReply::Granted {
            slot: 0,
            token: "4".into()
        }
    );

    // Raising it admits more at once; slots above the old capacity are used.
    assert_eq!(k.set_capacity(&mut c, 1), 1);
    assert_eq!(k.set_capacity(&mut c, 3), 1);
    assert_eq!(k.acquire(&mut c, "f", 10_000, 3).granted().0, 1);
    assert_eq!(k.acquire(&mut c, "g", 10_000, 3).granted().0, 2);
    assert!(k.acquire(&mut c, "h", 10_000, 3).hint() > 0);
    k.check_index(&mut c);
}

#[test]
fn an_expired_permit_never_comes_back_and_frees_its_slot() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_expiry");
    let short = SemKeys::member("s", &k.acquire(&mut c, "s", 400, 2));
    let long = SemKeys::member("l", &k.acquire(&mut c, "l", 60_000, 2));
    assert_eq!(short, "s:0:1");
    assert!(k.acquire(&mut c, "x", 10_000, 2).hint() <= 400);
    wait_until(Duration::from_secs(5), "the short permit to expire", || {
        k.verify(&mut c, &short).is_none()
    });
    assert_eq!(k.extend(&mut c, &short, 60_000), 0);
    assert_eq!(
        zscore(&mut c, &k.permits, &short),
        None,
        "removed, not renewed"
    );
    assert_eq!(k.extend(&mut c, &short, 60_000), 0);
    assert!(k.verify(&mut c, &long).is_some());
    assert_eq!(k.extend(&mut c, &long, 60_000), 1);
    k.check_index(&mut c);
    assert_eq!(
        k.acquire(&mut c, "x", 10_000, 2),
        PermitReply::Granted {
            slot: 0,
            token: "3".into()
        }
    );
    k.check_index(&mut c);
}

#[test]
fn status_and_release_prune_expired_permits() {
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_status");
    assert_eq!(k.status(&mut c).capacity, -1);
    assert!(k.status(&mut c).holders.is_empty());
    let brief = SemKeys::member("b", &k.acquire(&mut c, "b", 50, 3));
    let other = SemKeys::member("o", &k.acquire(&mut c, "o", 60, 3));
    let long = SemKeys::member("l", &k.acquire(&mut c, "l", 60_000, 3));
    wait_until(
        Duration::from_secs(5),
        "the brief permits to expire",
        || k.verify(&mut c, &brief).is_none() && k.verify(&mut c, &other).is_none(),
    );
    assert_eq!(
        c.zcard::<_, i64>(&k.permits).unwrap(),
        3,
        "expired members wait for a prune"
    );
    assert_eq!(
        k.release(&mut c, &brief),
        0,
        "expired: not a release of a live permit"
    );
    assert_eq!(
        c.zcard::<_, i64>(&k.permits).unwrap(),
        1,
        "release pruned the other expired permit"
    );
    k.check_index(&mut c);
    let st = k.status(&mut c);
    assert_eq!((st.capacity, st.holders.len()), (3, 1));
    assert_eq!(st.holders[0].0, long);
    k.check_index(&mut c);
}

#[test]
fn every_wrong_key_of_the_semaphore_is_refused_and_nothing_changes() {
    const META_USERS: &[&str] = &["acquire", "retry", "set_capacity", "status"];
    const META_TYPE_USERS: &[&str] = &[
        "acquire",
        "retry",
        "set_capacity",
        "status",
        "extend",
        "release",
        "release_prefix",
    ];
    let mut c = shared_server().client();
    let s = scripts();
    fn baseline(c: &mut redis::Connection, k: &[&str]) {
        let now = server_ms(c);
        let _: () = c
            .zadd_multiple(
                k[0],
                &[(now - 1_000, "dead:0:1"), (now + 60_000, "live:1:2")],
            )
            .unwrap();
        let _: () = c
            .hset_multiple(
                k[1],
                &[("capacity", "3"), ("fence", "2"), ("holder:live", "1:2")],
            )
            .unwrap();
        let _: () = c.setbit(k[2], 1, true).unwrap();
    }
    fn names(p: &str) -> Vec<String> {
        ["permits", "meta", "slots"]
            .iter()
            .map(|s| format!("{p}{{sem}}:{s}"))
            .collect()
    }
    fn field(name: &'static str, value: &'static str) -> impl Fn(&mut redis::Connection, &[&str]) {
        move |c, k| c.hset::<_, _, _, ()>(k[1], name, value).unwrap()
    }
    let runs = [
        Run {
            name: "acquire",
            script: &s.sem_acquire,
            keys: &[0, 1, 2],
            args: &["o", "1000", "3"],
        },
        Run {
            name: "retry",
            script: &s.sem_acquire,
            keys: &[0, 1, 2],
            args: &["live", "1000", "3"],
        },
        Run {
            name: "set_capacity",
            script: &s.sem_set_capacity,
            keys: &[1, 0],
            args: &["5"],
        },
        Run {
            name: "status",
            script: &s.sem_status,
            keys: &[0, 1, 2],
            args: &[],
        },
        Run {
            name: "extend",
            script: &s.sem_extend,
            keys: &[0, 1, 2],
            args: &["live:1:2", "1000"],
        },
        Run {
            name: "verify",
            script: &s.sem_verify,
            keys: &[0],
            args: &["live:1:2"],
        },
        Run {
            name: "release",
            script: &s.sem_release,
            keys: &[0, 1, 2],
            args: &["live:1:2", "exact"],
        },
        Run {
            name: "release_prefix",
            script: &s.sem_release,
            keys: &[0, 1, 2],
            args: &["live", "prefix"],
        },
    ];
    let not_integer = (
        "BADFENCE",
        "has a fence field that is not a non-negative integer",
    );
    let bad_capacity = (
        "BADKEY",
        "has a capacity field that is not a positive integer",
    );
    let cases = [
        Refusal::new(
            "permits is a string",
            |c, k| {
                let _: () = c.del(k[0]).unwrap();
                let _: () = c.set(k[0], "x").unwrap();
            },
            ("BADKEY", "holds a string, not a sorted set of permits"),
            &[
                "acquire",
                "retry",
                "set_capacity",
                "status",
                "extend",
                "verify",
                "release",
                "release_prefix",
            ],
        ),
        Refusal::new(
            "meta is a string",
            |c, k| {
                let _: () = c.del(k[1]).unwrap();
                let _: () = c.set(k[1], "3").unwrap();
            },
            ("BADKEY", "holds a string, not a semaphore hash"),
            META_TYPE_USERS,
        ),
        Refusal::new(
            "meta is a zset",
            |c, k| {
                let _: () = c.del(k[1]).unwrap();
                let _: () = c.zadd(k[1], "capacity", 3).unwrap();
            },
            ("BADKEY", "holds a zset, not a semaphore hash"),
            META_TYPE_USERS,
        ),
        Refusal::new(
            "slots is a hash",
            |c, k| {
                let _: () = c.del(k[2]).unwrap();
                let _: () = c.hset(k[2], "f", "v").unwrap();
            },
            ("BADKEY", "KEYS[3] holds a hash, not a slot bitmap"),
            &[
                "acquire",
                "retry",
                "status",
                "extend",
                "release",
                "release_prefix",
            ],
        ),
        Refusal::new(
            "meta has a TTL",
            |c, k| c.pexpire::<_, ()>(k[1], 60_000).unwrap(),
            ("BADFENCE", "has an expiry"),
            META_USERS,
        ),
        Refusal::new(
            "capacity is a word",
            field("capacity", "three"),
            bad_capacity,
            META_USERS,
        ),
        Refusal::new(
            "capacity is 0",
            field("capacity", "0"),
            bad_capacity,
            META_USERS,
        ),
        Refusal::new(
            "capacity is negative",
            field("capacity", "-3"),
            bad_capacity,
            META_USERS,
        ),
        Refusal::new(
            "fence is a word",
            field("fence", "abc"),
            not_integer,
            META_USERS,
        ),
        Refusal::new(
            "fence is negative",
            field("fence", "-1"),
            not_integer,
            META_USERS,
        ),
        Refusal::new(
            "fence is fractional",
            field("fence", "1.5"),
            not_integer,
            META_USERS,
        ),
        Refusal::new(
            "fence is empty",
            field("fence", ""),
            not_integer,
            META_USERS,
        ),
        Refusal::new(
            "fence is beyond i64",
            field("fence", "9223372036854775808"),
            not_integer,
            META_USERS,
        ),
    ];
    refuse_each(&mut c, "sem_refuse", baseline, names, &runs, &cases);
    // The key named in the error is the script's own KEYS index.
    let k = SemKeys::new("sem_refuse_index");
    c.set::<_, _, ()>(&k.meta, "x").unwrap();
    let e = s.sem_acquire.err(&mut c, &k.all(), &["o", "1000", "3"]);
    assert!(e.detail().unwrap().starts_with("KEYS[2] "), "{e}");
    let e = s
        .sem_set_capacity
        .err(&mut c, &[&k.meta, &k.permits], &["3"]);
    assert!(e.detail().unwrap().starts_with("KEYS[1] "), "{e}");
}

#[test]
fn a_random_schedule_never_exceeds_the_capacity_and_fences_every_slot() {
    const CAPACITY: u32 = 3;
    const STEPS: usize = 400;
    let (mut rng, seed) = Rng::seeded("semaphore random schedule");
    let mut c = shared_server().client();
    let k = SemKeys::new("sem_random");

    struct Held {
        owner: String,
        member: String,
        slot: i64,
        token: u64,
        short: bool,
    }
    let mut held: Vec<Held> = Vec::new();
    let mut last_token = 0u64;
    let mut last_per_slot: BTreeMap<i64, u64> = BTreeMap::new();
    let (mut grants, mut busy, mut expiries, mut max_seen) = (0, 0, 0, 0);

    for step in 0..STEPS {
        let before = k.status(&mut c);
        let live_before: BTreeSet<i64> = before
            .holders
            .iter()
            .map(|(m, _)| parse_member(m).1)
            .collect();
        let ctx = format!("seed {seed} step {step}");
        match rng.below(100) {
            0..=54 => {
                let owner = format!("o{step}");
                let short = rng.below(2) == 0;
                let ttl = if short { 30 + rng.below(60) } else { 60_000 };
                match k.acquire(&mut c, &owner, ttl, CAPACITY) {
                    PermitReply::Granted { slot, token } => {
                        grants += 1;
                        let token: u64 = token.parse().unwrap();
                        assert!(
                            token > last_token,
                            "{ctx}: token {token} after {last_token}"
                        );
                        last_token = token;
                        let prev = last_per_slot.insert(slot, token).unwrap_or(0);
                        assert!(
                            token > prev,
                            "{ctx}: slot {slot} token {token} after {prev}"
                        );
                        let lowest_free = (0..).find(|s| !live_before.contains(s)).unwrap();
                        assert!(
                            slot <= lowest_free,
                            "{ctx}: slot {slot}, lowest free was {lowest_free}"
                        );
                        assert!((0..CAPACITY as i64).contains(&slot), "{ctx}: slot {slot}");
                        held.push(Held {
                            member: format!("{owner}:{slot}:{token}"),
                            owner,
                            slot,
                            token,
                            short,
                        });
                    }
                    PermitReply::Busy(hint) => {
                        busy += 1;
                        // Permits only expire between the status and the attempt.
                        assert!(
                            before.holders.len() >= CAPACITY as usize,
                            "{ctx}: busy with {before:?}"
                        );
                        assert!(hint > 0, "{ctx}: hint {hint}");
                    }
                }
            }
            55..=74 if !held.is_empty() => {
                let i = rng.below(held.len() as u64) as usize;
                let h = held.swap_remove(i);
                let r = k.release(&mut c, &h.member);
                assert!(
                    r == 1 || h.short,
                    "{ctx}: a long permit was gone at release"
                );
            }
            75..=84 if !held.is_empty() => {
                // A retry of a holder's acquire: same permit, no new token.
                let i = rng.below(held.len() as u64) as usize;
                let h = &held[i];
                let fence: String = c.hget(&k.meta, "fence").unwrap();
                let ttl = if h.short { 30 + rng.below(60) } else { 60_000 };
                match k.acquire(&mut c, &h.owner, ttl, CAPACITY) {
                    PermitReply::Granted { slot, token } => {
                        if token != h.token.to_string() {
                            // Only an expired short permit can be replaced.
                            assert!(h.short, "{ctx}: a long permit's retry got a new token");
                            let token: u64 = token.parse().unwrap();
                            assert!(token > last_token);
                            last_token = token;
                            let prev = last_per_slot.insert(slot, token).unwrap_or(0);
                            assert!(token > prev);
                            let h = &mut held[i];
                            h.slot = slot;
                            h.token = token;
                            h.member = format!("{}:{slot}:{token}", h.owner);
                        } else {
                            assert_eq!(slot, h.slot, "{ctx}");
                            assert_eq!(
                                c.hget::<_, _, String>(&k.meta, "fence").unwrap(),
                                fence,
                                "{ctx}: a retry drew a token"
                            );
                        }
                    }
                    PermitReply::Busy(_) => {
                        assert!(h.short, "{ctx}: a long permit's retry was refused")
                    }
                }
            }
            _ => {
                // Wait for the shortest live permit to expire.
                if let Some(h) = held.iter().find(|h| h.short) {
                    let member = h.member.clone();
                    wait_until(Duration::from_secs(5), "a short permit to expire", || {
                        k.verify(&mut c, &member).is_none()
                    });
                    expiries += 1;
                }
            }
        }
        let after = k.status(&mut c);
        let slots: Vec<i64> = after
            .holders
            .iter()
            .map(|(m, _)| parse_member(m).1)
            .collect();
        let distinct: BTreeSet<i64> = slots.iter().copied().collect();
        assert!(after.holders.len() <= CAPACITY as usize, "{ctx}: {after:?}");
        assert_eq!(
            distinct.len(),
            slots.len(),
            "{ctx}: a slot held twice: {after:?}"
        );
        max_seen = max_seen.max(after.holders.len());
        // Every live permit is one the model holds; every long one is live.
        for (m, _) in &after.holders {
            assert!(
                held.iter().any(|h| &h.member == m),
                "{ctx}: unknown permit {m}"
            );
        }
        held.retain(|h| {
            after.holders.iter().any(|(m, _)| m == &h.member) || {
                assert!(h.short, "{ctx}: long permit {} vanished", h.member);
                false
            }
        });
    }
    println!(
        "{grants} grants, {busy} busy, {expiries} waits for an expiry, at most {max_seen} holders"
    );
    assert_eq!(
        max_seen, CAPACITY as usize,
        "the schedule reached the capacity"
    );
    assert!(
        busy > 0 && expiries > 0,
        "the schedule exercised contention and expiry"
    );
}

#[test]
fn concurrent_permit_holders_never_exceed_the_capacity_or_share_a_slot() {
    const THREADS: usize = 6;
    const EACH: usize = 120;
    let server = shared_server();
    let k = SemKeys::new("sem_concurrent");
    let inside = Mutex::new([false; 3]);
    let max_inside = Mutex::new(0usize);
    let tokens = Mutex::new(Vec::new());
    thread::scope(|s| {
        for t in 0..THREADS {
            let (k, inside, max_inside, tokens) = (&k, &inside, &max_inside, &tokens);
            s.spawn(move || {
                let mut c = server.client();
                for i in 0..EACH {
                    let owner = format!("t{t}n{i}");
                    let (slot, token) = loop {
                        match k.acquire(&mut c, &owner, 10_000, 3) {
                            PermitReply::Granted { slot, token } => break (slot, token),
                            // A poll interval: this test checks exclusion, not waiting.
                            PermitReply::Busy(_) => thread::sleep(Duration::from_micros(300)),
                        }
                    };
                    {
                        let mut slots = inside.lock().unwrap();
                        assert!(!slots[slot as usize], "slot {slot} held twice");
                        slots[slot as usize] = true;
                        let n = slots.iter().filter(|b| **b).count();
                        let mut m = max_inside.lock().unwrap();
                        *m = (*m).max(n);
                        tokens
                            .lock()
                            .unwrap()
                            .push((slot, token.parse::<u64>().unwrap()));
                    }
                    thread::sleep(Duration::from_micros(500 * (i as u64 % 4)));
                    inside.lock().unwrap()[slot as usize] = false;
                    assert_eq!(k.release(&mut c, &format!("{owner}:{slot}:{token}")), 1);
                }
            });
        }
    });
    let tokens = tokens.into_inner().unwrap();
    assert_eq!(tokens.len(), THREADS * EACH);
    let mut per_slot: BTreeMap<i64, u64> = BTreeMap::new();
    for (slot, token) in &tokens {
        let prev = per_slot.insert(*slot, *token).unwrap_or(0);
        assert!(*token > prev, "slot {slot}: token {token} after {prev}");
    }
    let max_inside = max_inside.into_inner().unwrap();
    println!(
        "{} permits, at most {max_inside} at once, per slot: {per_slot:?}",
        tokens.len()
    );
    assert!(max_inside <= 3);
}

#[test]
fn a_full_semaphore_wakes_its_waiter_on_a_release_and_on_a_raised_capacity() {
    let server = shared_server();
    let k = SemKeys::new("track_sem");
    let mut t = Tracker::new(server, &k.prefix);
    let a = SemKeys::member("a", &k.acquire(&mut t.admin, "a", 60_000, 2));
    k.acquire(&mut t.admin, "b", 60_000, 2).granted();
    let now = server_ms(&mut t.admin);
    t.admin
        .zadd::<_, _, _, ()>(&k.permits, "crashed:5:0", now - 1_000)
        .unwrap();
    let own = busy_then_woken(
        &mut t,
        |c| assert!(k.acquire(c, "w", 10_000, 2).hint() > 0),
        |c| assert_eq!(k.release(c, &a), 1),
        &k.permits,
    );
    assert!(
        own.contains(&k.permits),
        "the attempt pruned the permits: {own:?}"
    );

    k.acquire(&mut t.admin, "a", 60_000, 2).granted();
    busy_then_woken(
        &mut t,
        |c| assert!(k.acquire(c, "w", 10_000, 2).hint() > 0),
        |c| assert_eq!(k.set_capacity(c, 3), 2),
        &k.meta,
    );
    assert_eq!(k.acquire(&mut t.admin, "w", 10_000, 3).granted().0, 2);

    // Permits with no stored capacity: the busy attempt stores it (a write) and
    // must read it again to be woken when it is raised.
    let k = SemKeys::new("track_sem_nocap");
    let now = server_ms(&mut t.admin);
    t.admin
        .zadd_multiple::<_, _, _, ()>(
            &k.permits,
            &[(now + 60_000, "x:0:1"), (now + 60_000, "y:1:2")],
        )
        .unwrap();
    let own = busy_then_woken(
        &mut t,
        |c| assert!(k.acquire(c, "w", 10_000, 2).hint() > 0),
        |c| assert_eq!(k.set_capacity(c, 3), 2),
        &k.meta,
    );
    assert!(
        own.contains(&k.meta),
        "the attempt stored the capacity: {own:?}"
    );
}
