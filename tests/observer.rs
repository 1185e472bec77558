//! The observer: what it hears of scripted scenarios on real servers, checked
//! against the servers and the test's own clock; a panicking observer; the
//! `metrics` and `tracing` observers.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{
    AttemptEvent, ContentionEvent, Coordinator, FencingToken, GrantEvent, LeaseId, LossCause,
    LossEvent, Observer, PollingEvent, Primitive, RedlockGroup, RedlockOptions, ReleaseEvent,
    ReleaseOutcome, RenewalEvent, TopologyChange, TopologyEvent, WaitEnd, WaitEndEvent, key_slot,
};
use support::{
    TestCluster, TestSentinel, TestServer, coordinator, shared_cluster, shared_server,
    unique_prefix, wait_until,
};

const NODE_TIMEOUT: Duration = Duration::from_millis(200);
const TTL: Duration = Duration::from_secs(2);

/// An event as the recording observer keeps it: what can be compared
/// exactly, the rest beside it.
#[derive(Clone, Debug, PartialEq)]
enum Ev {
    Attempt {
        key: String,
        primitive: Primitive,
        waits: bool,
    },
    Contended {
        key: String,
    },
    Granted {
        key: String,
        lease: LeaseId,
        token: Option<FencingToken>,
    },
    WaitEnded {
        key: String,
        reason: WaitEnd,
    },
    Renewed {
        lease: LeaseId,
    },
    Lost {
        lease: LeaseId,
        cause: LossCause,
    },
    Released {
        lease: LeaseId,
        outcome: Option<ReleaseOutcome>,
    },
    Polling {
        reason: String,
    },
    SlotsMoved {
        slots: usize,
    },
    Switched {
        from: String,
        to: String,
    },
}

/// The fields checked against oracles rather than compared.
#[derive(Clone, Copy, Debug, Default)]
struct Measured {
    /// Wait time of a grant or a wait's end.
    waited: Option<Duration>,
    /// The holder's TTL of a contention.
    holder_ttl: Option<Duration>,
    /// The margin of a renewal.
    margin: Option<Duration>,
}

#[derive(Clone, Debug)]
struct Seen {
    ev: Ev,
    measured: Measured,
    at: Instant,
    thread: ThreadId,
}

#[derive(Default)]
struct Recorder {
    seen: Mutex<Vec<Seen>>,
}

impl Recorder {
    fn push(&self, ev: Ev, measured: Measured) {
        self.seen.lock().unwrap().push(Seen {
            ev,
            measured,
            at: Instant::now(),
            thread: thread::current().id(),
        });
    }

    fn len(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// Events from index `from` on.
    fn since(&self, from: usize) -> Vec<Seen> {
        self.seen.lock().unwrap()[from..].to_vec()
    }

    fn has(&self, from: usize, f: impl Fn(&Ev) -> bool) -> bool {
        self.since(from).iter().any(|s| f(&s.ev))
    }
}

impl Observer for Recorder {
    fn attempt(&self, e: &AttemptEvent<'_>) {
        let ev = Ev::Attempt {
            key: e.key.to_owned(),
            primitive: e.primitive,
            waits: e.waits,
        };
        self.push(ev, Measured::default());
    }
    fn contended(&self, e: &ContentionEvent<'_>) {
        let measured = Measured {
            holder_ttl: e.holder_ttl,
            ..Measured::default()
        };
        self.push(
            Ev::Contended {
                key: e.key.to_owned(),
            },
            measured,
        );
    }
    fn granted(&self, e: &GrantEvent<'_>) {
        let ev = Ev::Granted {
            key: e.key.to_owned(),
            lease: e.lease,
            token: e.token,
        };
        let measured = Measured {
            waited: Some(e.waited),
            ..Measured::default()
        };
        self.push(ev, measured);
    }
    fn wait_ended(&self, e: &WaitEndEvent<'_>) {
        let ev = Ev::WaitEnded {
            key: e.key.to_owned(),
            reason: e.reason,
        };
        let measured = Measured {
            waited: Some(e.waited),
            ..Measured::default()
        };
        self.push(ev, measured);
    }
    fn renewed(&self, e: &RenewalEvent<'_>) {
        let measured = Measured {
            margin: Some(e.margin),
            ..Measured::default()
        };
        self.push(Ev::Renewed { lease: e.lease }, measured);
    }
    fn lost(&self, e: &LossEvent<'_>) {
        let ev = Ev::Lost {
            lease: e.lease,
            cause: e.cause,
        };
        self.push(ev, Measured::default());
    }
    fn released(&self, e: &ReleaseEvent<'_>) {
        let ev = Ev::Released {
            lease: e.lease,
            outcome: e.outcome,
        };
        self.push(ev, Measured::default());
    }
    fn polling(&self, e: &PollingEvent<'_>) {
        let ev = Ev::Polling {
            reason: e.reason.to_owned(),
        };
        self.push(ev, Measured::default());
    }
    fn topology_changed(&self, e: &TopologyEvent<'_>) {
        let ev = match e.change {
            TopologyChange::SlotsMoved { slots } => Ev::SlotsMoved { slots },
            TopologyChange::PrimarySwitched { from, to } => Ev::Switched {
                from: from.to_owned(),
                to: to.to_owned(),
            },
            _ => return,
        };
        self.push(ev, Measured::default());
    }
}

fn observed(server: &TestServer, prefix: &str, observer: Arc<dyn Observer>) -> Coordinator {
    Coordinator::builder(&server.url())
        .key_prefix(prefix)
        .node_timeout(NODE_TIMEOUT)
        .observer(observer)
        .build()
        .expect("connect to the shared server")
}

fn evs(seen: &[Seen]) -> Vec<Ev> {
    seen.iter().map(|s| s.ev.clone()).collect()
}

fn lease_of(seen: &Seen) -> LeaseId {
    match seen.ev {
        Ev::Granted { lease, .. } => lease,
        ref other => panic!("not a grant: {other:?}"),
    }
}

/// The drift the coordinator writes off a TTL (the default factor 0.01, plus
/// 2 ms).
fn drift(ttl: Duration) -> Duration {
    ttl.mul_f64(0.01) + Duration::from_millis(2)
}

#[test]
fn a_scripted_scenario_reports_every_event_once_in_order() {
    let recorder = Arc::new(Recorder::default());
    let prefix = unique_prefix("observer-scenario");
    let coord = observed(shared_server(), &prefix, recorder.clone());
    let lock = coord.fenced_lock("{job}lease", "{job}fence").unwrap();
    let key = format!("{prefix}{{job}}lease");
    let attempt = |waits| Ev::Attempt {
        key: key.clone(),
        primitive: Primitive::FencedLock,
        waits,
    };
    let mut outside = shared_server().client();
    let main = thread::current().id();

    // 1. Uncontended: an attempt and a grant with its token.
    let before = Instant::now();
    let first = lock.try_acquire(TTL).unwrap().expect("free");
    let took = before.elapsed();
    let seen = recorder.since(0);
    let l1 = lease_of(&seen[1]);
    assert_eq!(
        evs(&seen),
        [
            attempt(false),
            Ev::Granted {
                key: key.clone(),
                lease: l1,
                token: Some(first.fencing_token()),
            }
        ]
    );
    assert!(seen[1].measured.waited.unwrap() <= took);
    assert!(seen.iter().all(|s| s.thread == main));

    // 2. A wait that finds it held, and is granted after the release.
    let mark = recorder.len();
    let first_token = first.fencing_token();
    let first_granted = Instant::now() - took;
    let (second, waiter) = thread::scope(|s| {
        let waiter = s.spawn(|| {
            let g = lock.acquire_timeout(TTL, Duration::from_secs(20)).unwrap();
            (
                g.expect("granted after the release"),
                thread::current().id(),
            )
        });
        wait_until(Duration::from_secs(10), "the contention", || {
            recorder.has(mark, |e| matches!(e, Ev::Contended { .. }))
        });
        let pttl: i64 = outside.pttl(&key).unwrap();
        let released_at = Instant::now();
        assert_eq!(first.release().unwrap(), ReleaseOutcome::Released);
        let (g, id) = waiter.join().unwrap();
        ((g, released_at, pttl), id)
    });
    let (second, released_at, pttl_at_release) = second;
    let mut seen = recorder.since(mark);
    // The release is reported when its call returns, on this thread; the
    // waiter its release woke may be granted, and report it, before this
    // thread runs again (on a busy machine it often is). Those two events
    // come in either order; every other order is fixed.
    if seen.len() == 4 && matches!(seen[2].ev, Ev::Granted { .. }) {
        seen.swap(2, 3);
    }
    let l2 = lease_of(&seen[3]);
    assert_ne!(l1, l2);
    assert_eq!(
        evs(&seen),
        [
            attempt(true),
            Ev::Contended { key: key.clone() },
            Ev::Released {
                lease: l1,
                outcome: Some(ReleaseOutcome::Released)
            },
            Ev::Granted {
                key: key.clone(),
                lease: l2,
                token: Some(second.fencing_token()),
            },
        ]
    );
    assert!(second.fencing_token() > first_token);
    // The waiter's events on its thread, the release on this one.
    let threads: Vec<_> = seen.iter().map(|s| s.thread == waiter).collect();
    assert_eq!(threads, [true, true, false, true]);
    // The holder's TTL the contention saw: at most the TTL, and no less than
    // what the server had left when it was read after the contention.
    let holder_ttl = seen[1].measured.holder_ttl.expect("the script reports it");
    assert!(holder_ttl <= TTL);
    assert!(holder_ttl + Duration::from_millis(1) >= Duration::from_millis(pttl_at_release as u64));
    assert!(holder_ttl + first_granted.elapsed() >= TTL - Duration::from_millis(1));
    // Granted no earlier than the release, after waiting since before the
    // contention.
    let granted_at = seen[3].at;
    assert!(granted_at >= released_at);
    assert!(seen[3].measured.waited.unwrap() >= released_at - seen[1].at);

    // 3. A wait that runs out.
    let mark = recorder.len();
    let wait = Duration::from_millis(300);
    let before = Instant::now();
    assert!(lock.acquire_timeout(TTL, wait).unwrap().is_none());
    let took = before.elapsed();
    let seen = recorder.since(mark);
    assert_eq!(
        evs(&seen),
        [
            attempt(true),
            Ev::Contended { key: key.clone() },
            Ev::WaitEnded {
                key: key.clone(),
                reason: WaitEnd::TimedOut
            },
        ]
    );
    // From just after the call started until its deadline at least.
    let waited = seen[2].measured.waited.unwrap();
    assert!(waited <= took, "{waited:?} of {took:?}");
    assert!(waited + (seen[1].at - before) >= wait, "{waited:?}");

    // 4. A keep-alive renewal, then an explicit one checked against the
    // server's PTTL read just before it.
    let mark = recorder.len();
    let keep_alive = second.keep_alive().unwrap();
    wait_until(Duration::from_secs(10), "a keep-alive renewal", || {
        recorder.has(mark, |e| matches!(e, Ev::Renewed { .. }))
    });
    drop(keep_alive);
    let seen = recorder.since(mark);
    assert_eq!(evs(&seen), [Ev::Renewed { lease: l2 }]);
    assert_ne!(seen[0].thread, main);
    let margin = seen[0].measured.margin.unwrap();
    // Sure to be held until at most the grant's reply plus the TTL.
    assert!(margin > Duration::ZERO);
    assert!(seen[0].at + margin <= granted_at + TTL);

    let mark = recorder.len();
    let read_sent = Instant::now();
    let pttl: i64 = outside.pttl(&key).unwrap();
    assert!(second.reset_expiry(TTL).unwrap());
    let confirmed_by = Instant::now();
    let seen = recorder.since(mark);
    assert_eq!(evs(&seen), [Ev::Renewed { lease: l2 }]);
    let margin = seen[0].measured.margin.unwrap();
    let pttl = Duration::from_millis(pttl as u64);
    assert!(
        margin <= pttl + Duration::from_millis(1),
        "margin {margin:?} above the server's {pttl:?}"
    );
    let slack = drift(TTL) + NODE_TIMEOUT + (confirmed_by - read_sent) + Duration::from_millis(1);
    assert!(
        margin + slack >= pttl,
        "margin {margin:?} too far below the server's {pttl:?}"
    );

    // 5. A loss caused on purpose: an outsider deletes the key.
    let mark = recorder.len();
    let _: () = outside.del(&key).unwrap();
    assert_eq!(second.verify_still_held().unwrap(), None);
    assert!(second.is_lost());
    assert!(second.is_lost());
    // 6. The release finds it gone.
    assert_eq!(second.release().unwrap(), ReleaseOutcome::Expired);
    let seen = recorder.since(mark);
    assert_eq!(
        evs(&seen),
        [
            Ev::Lost {
                lease: l2,
                cause: LossCause::Gone
            },
            Ev::Released {
                lease: l2,
                outcome: Some(ReleaseOutcome::Expired)
            },
        ]
    );
}

/// The start of one call of a set: an attempt for each key, in order.
fn attempts(keys: &[String], primitive: Primitive, waits: bool) -> Vec<Ev> {
    let attempt = |key: &String| Ev::Attempt {
        key: key.clone(),
        primitive,
        waits,
    };
    keys.iter().map(attempt).collect()
}

/// The end of one call of a set that got nothing: a wait end for each key.
fn wait_ends(keys: &[String], reason: WaitEnd) -> Vec<Ev> {
    let end = |key: &String| Ev::WaitEnded {
        key: key.clone(),
        reason,
    };
    keys.iter().map(end).collect()
}

#[test]
fn a_set_taken_in_one_call_reports_each_lease_once_in_order() {
    let recorder = Arc::new(Recorder::default());
    let prefix = unique_prefix("observer-set");
    let coord = observed(shared_server(), &prefix, recorder.clone());
    let pairs = [("{s}a", "{s}fa"), ("{s}b", "{s}fb"), ("{s}c", "{s}fc")];
    let set = coord.fenced_lock_all(&pairs).unwrap();
    assert!(set.is_one_call());
    let keys: Vec<String> = pairs.iter().map(|(l, _)| format!("{prefix}{l}")).collect();
    let fences: Vec<String> = pairs.iter().map(|(_, f)| format!("{prefix}{f}")).collect();
    let outsider = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let other = outsider.fenced_lock("{s}b", "{s}fb").unwrap();
    let mut server = shared_server().client();
    let main = thread::current().id();

    // 1. One attempt that finds the second lease held: each lease's call
    // starts, the second is found held, all end busy, and nothing was set.
    let holder = other.try_acquire(TTL).unwrap().expect("free");
    assert!(set.try_acquire(TTL).unwrap().is_none());
    let pttl: i64 = server.pttl(&keys[1]).unwrap();
    let seen = recorder.since(0);
    let mut want = attempts(&keys, Primitive::FencedLock, false);
    want.push(Ev::Contended {
        key: keys[1].clone(),
    });
    want.extend(wait_ends(&keys, WaitEnd::Busy));
    assert_eq!(evs(&seen), want);
    assert!(seen.iter().all(|s| s.thread == main));
    let holder_ttl = seen[3].measured.holder_ttl.expect("the script reports it");
    assert!(holder_ttl <= TTL);
    assert!(holder_ttl + Duration::from_millis(1) >= Duration::from_millis(pttl as u64));
    for key in [&keys[0], &keys[2]] {
        assert!(!server.exists::<_, bool>(key).unwrap(), "{key} was set");
    }

    // 2. A wait granted once the holder lets go: each lease's call is found
    // held once (the second) and granted, with its own lease and token.
    let mark = recorder.len();
    let (guard, released_at, called) = thread::scope(|s| {
        let waiter = s.spawn(|| {
            let called = Instant::now();
            let g = set.acquire_timeout(TTL, Duration::from_secs(20)).unwrap();
            (g.expect("granted after the release"), called)
        });
        wait_until(Duration::from_secs(10), "the contention", || {
            recorder.has(mark, |e| matches!(e, Ev::Contended { .. }))
        });
        let released_at = Instant::now();
        assert_eq!(holder.release().unwrap(), ReleaseOutcome::Released);
        let (g, called) = waiter.join().unwrap();
        (g, released_at, called)
    });
    let returned = Instant::now();
    let seen = recorder.since(mark);
    let tokens: Vec<FencingToken> = guard.fencing_tokens().iter().map(|(_, t)| *t).collect();
    let leases: Vec<LeaseId> = seen[4..].iter().map(lease_of).collect();
    let mut want = attempts(&keys, Primitive::FencedLock, true);
    want.push(Ev::Contended {
        key: keys[1].clone(),
    });
    for ((key, lease), token) in keys.iter().zip(&leases).zip(&tokens) {
        want.push(Ev::Granted {
            key: key.clone(),
            lease: *lease,
            token: Some(*token),
        });
    }
    assert_eq!(evs(&seen), want);
    let mut distinct = leases.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "{leases:?}");
    // The tokens the grants named are the servers' counters.
    for (fence, token) in fences.iter().zip(&tokens) {
        let counter: u64 = server.get(fence).unwrap();
        assert_eq!(counter, token.get(), "{fence}");
    }
    // Every lease waited the whole call: from before the contention to after
    // the release, and no longer than the call took.
    for grant in &seen[4..] {
        let waited = grant.measured.waited.unwrap();
        assert!(waited >= released_at - seen[3].at, "{waited:?}");
        assert!(waited <= returned - called, "{waited:?}");
    }
    let granted_at = seen[4].at;

    // 3. Keep-alive renews every lease, each reported once, within what its
    // grant's reply left; an explicit extension's margins are at most what
    // the server had left.
    let mark = recorder.len();
    let keep_alive = guard.keep_alive().unwrap();
    let renewed = |from| {
        let mut got: Vec<LeaseId> = recorder
            .since(from)
            .iter()
            .filter_map(|s| match s.ev {
                Ev::Renewed { lease } => Some(lease),
                _ => None,
            })
            .collect();
        got.sort();
        got
    };
    wait_until(Duration::from_secs(10), "a renewal of each lease", || {
        renewed(mark).len() >= 3
    });
    drop(keep_alive);
    assert_eq!(renewed(mark), distinct);
    for s in recorder.since(mark) {
        assert_ne!(s.thread, main);
        let margin = s.measured.margin.unwrap();
        assert!(margin > Duration::ZERO);
        assert!(s.at + margin <= granted_at + TTL);
    }
    let mark = recorder.len();
    let pttls: Vec<Duration> = keys
        .iter()
        .map(|k| Duration::from_millis(server.pttl::<_, i64>(k).unwrap() as u64))
        .collect();
    assert!(guard.reset_expiry(TTL).unwrap());
    let seen = recorder.since(mark);
    assert_eq!(
        evs(&seen),
        leases
            .iter()
            .map(|l| Ev::Renewed { lease: *l })
            .collect::<Vec<_>>()
    );
    for (s, pttl) in seen.iter().zip(&pttls) {
        let margin = s.measured.margin.unwrap();
        assert!(
            margin <= *pttl + Duration::from_millis(1),
            "margin {margin:?} above the server's {pttl:?}"
        );
    }

    // 4. The third lease deleted: found gone by a verification, reported
    // lost alone; 5. the release reports each lease's outcome, in order.
    let mark = recorder.len();
    let _: () = server.del(&keys[2]).unwrap();
    assert_eq!(guard.verify_still_held().unwrap(), None);
    assert!(guard.is_lost());
    let outcomes: Vec<ReleaseOutcome> = guard
        .release()
        .into_iter()
        .map(|(_, r)| r.unwrap())
        .collect();
    use ReleaseOutcome::{Expired, Released};
    assert_eq!(outcomes, [Released, Released, Expired]);
    let mut want = vec![Ev::Lost {
        lease: leases[2],
        cause: LossCause::Gone,
    }];
    for (lease, outcome) in leases.iter().zip(outcomes) {
        want.push(Ev::Released {
            lease: *lease,
            outcome: Some(outcome),
        });
    }
    assert_eq!(evs(&recorder.since(mark)), want);
}

#[test]
fn a_set_taken_in_the_global_order_reports_only_what_the_caller_got() {
    let recorder = Arc::new(Recorder::default());
    let prefix = unique_prefix("observer-set-order");
    let cluster = shared_cluster();
    let seeds = cluster.seed_urls();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let build = |observer: Option<Arc<dyn Observer>>| {
        let builder = Coordinator::cluster_builder(&seeds)
            .key_prefix(&prefix)
            .node_timeout(Duration::from_millis(500));
        match observer {
            Some(o) => builder.observer(o),
            None => builder,
        }
        .build()
        .expect("connect to the cluster")
    };
    let coord = build(Some(recorder.clone()));
    let names = ["alpha", "bravo", "charlie"];
    let keys: Vec<String> = names.iter().map(|n| format!("{prefix}{n}")).collect();
    let slots: Vec<u16> = keys.iter().map(|k| key_slot(k.as_bytes())).collect();
    let mut order: Vec<usize> = (0..3).collect();
    order.sort_by_key(|i| (slots[*i], keys[*i].clone()));
    let set = coord.lock_all(&names).unwrap();
    assert!(!set.is_one_call(), "slots {slots:?}");
    // Someone else holds the second lease of the global order: the first is
    // taken and let go inside the call.
    let outsider = build(None);
    let holder = outsider
        .lock(names[order[1]])
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .expect("free");
    assert!(set.try_acquire(TTL).unwrap().is_none());
    let mut want = attempts(&keys, Primitive::Lock, false);
    want.push(Ev::Contended {
        key: keys[order[1]].clone(),
    });
    want.extend(wait_ends(&keys, WaitEnd::Busy));
    assert_eq!(evs(&recorder.since(0)), want);
    for i in [order[0], order[2]] {
        let held: bool = cluster.client_for_key(&keys[i]).exists(&keys[i]).unwrap();
        assert!(!held, "{} is still held", keys[i]);
    }

    // Free again: one grant per lease in the order given, one release each.
    assert_eq!(holder.release().unwrap(), ReleaseOutcome::Released);
    let mark = recorder.len();
    let guard = set.try_acquire(TTL).unwrap().expect("free");
    let seen = recorder.since(mark);
    let leases: Vec<LeaseId> = seen[3..].iter().map(lease_of).collect();
    let mut want = attempts(&keys, Primitive::Lock, false);
    for (key, lease) in keys.iter().zip(&leases) {
        want.push(Ev::Granted {
            key: key.clone(),
            lease: *lease,
            token: None,
        });
    }
    assert_eq!(evs(&seen), want);
    let mark = recorder.len();
    for (_, outcome) in guard.release() {
        assert_eq!(outcome.unwrap(), ReleaseOutcome::Released);
    }
    let released: Vec<Ev> = leases
        .iter()
        .map(|l| Ev::Released {
            lease: *l,
            outcome: Some(ReleaseOutcome::Released),
        })
        .collect();
    assert_eq!(evs(&recorder.since(mark)), released);
}

#[test]
fn a_lease_left_to_expire_is_reported_lost_at_its_deadline() {
    let recorder = Arc::new(Recorder::default());
    let prefix = unique_prefix("observer-expiry");
    let coord = observed(shared_server(), &prefix, recorder.clone());
    let lock = coord.lock("job").unwrap();
    let ttl = Duration::from_millis(600);
    let guard = lock.try_acquire(ttl).unwrap().expect("free");
    let mark = recorder.len();
    let signal = guard.lost_signal().clone();
    assert!(
        signal
            .recv_timeout(Duration::from_secs(10))
            .unwrap_err()
            .is_disconnected()
    );
    // The renewal thread reports it as it closes the signal.
    wait_until(Duration::from_secs(5), "the loss event", || {
        recorder.has(mark, |e| matches!(e, Ev::Lost { .. }))
    });
    let seen = recorder.since(mark);
    assert!(matches!(
        seen[..],
        [Seen {
            ev: Ev::Lost {
                cause: LossCause::Expired,
                ..
            },
            ..
        }]
    ));
    let outcome = guard.release().unwrap();
    let seen = recorder.since(mark);
    assert_eq!(seen.len(), 2);
    assert!(matches!(seen[1].ev, Ev::Released { outcome: Some(o), .. } if o == outcome));
}

#[test]
fn a_try_acquire_that_finds_the_lock_held_reports_contention_and_busy() {
    let recorder = Arc::new(Recorder::default());
    let prefix = unique_prefix("observer-busy");
    let coord = observed(shared_server(), &prefix, recorder.clone());
    let semaphore = coord.semaphore("{pool}", 1).unwrap();
    let permit = semaphore.try_acquire(TTL).unwrap().expect("free");
    let mark = recorder.len();
    assert!(semaphore.try_acquire(TTL).unwrap().is_none());
    let seen = recorder.since(mark);
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(matches!(
        &seen[0].ev,
        Ev::Attempt {
            primitive: Primitive::Semaphore,
            waits: false,
            ..
        }
    ));
    assert!(matches!(&seen[1].ev, Ev::Contended { .. }));
    assert!(matches!(
        &seen[2].ev,
        Ev::WaitEnded {
            reason: WaitEnd::Busy,
            ..
        }
    ));
    // The permit's own grant named its token.
    let all = recorder.since(0);
    assert!(matches!(all[1].ev, Ev::Granted { token: Some(t), .. } if t == permit.fencing_token()));
    assert!(matches!(&all[0].ev, Ev::Attempt { key, .. } if key.starts_with(&prefix)));
}

#[test]
fn waits_that_cannot_track_report_the_fall_back_to_polling_once() {
    let server = TestServer::builder()
        .acl_user("user u on >pw ~* &* +@all -client|tracking")
        .start();
    let recorder = Arc::new(Recorder::default());
    let coord = Coordinator::builder(&server.url_for_user("u", "pw"))
        .node_timeout(NODE_TIMEOUT)
        .observer(recorder.clone())
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    let _: () = server.client().set_ex("job", "someone", 600).unwrap();
    for _ in 0..2 {
        let wait = Duration::from_millis(300);
        assert!(lock.acquire_timeout(TTL, wait).unwrap().is_none());
    }
    let polling: Vec<Ev> = evs(&recorder.since(0))
        .into_iter()
        .filter(|e| matches!(e, Ev::Polling { .. }))
        .collect();
    assert_eq!(polling.len(), 1, "{polling:?}");
    assert!(matches!(&polling[0], Ev::Polling { reason } if reason.contains("CLIENT TRACKING")));
}

#[test]
fn a_slot_moved_in_a_cluster_is_reported() {
    let cluster = TestCluster::start();
    let recorder = Arc::new(Recorder::default());
    let seeds = cluster.seed_urls();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let coord = Coordinator::cluster_builder(&seeds)
        .node_timeout(NODE_TIMEOUT)
        .observer(recorder.clone())
        .build()
        .unwrap();
    let key = "{moving}job";
    let guard = coord.lock(key).unwrap().try_acquire(TTL).unwrap().unwrap();
    let from = cluster.primary_for_key(key);
    let to = *cluster
        .primaries()
        .iter()
        .find(|p| **p != from)
        .expect("another primary");
    let mark = recorder.len();
    cluster.migrate_slot(key_slot(key.as_bytes()), to);
    // The next command on the key meets MOVED and refreshes the map.
    assert!(guard.verify_still_held().unwrap().is_some());
    wait_until(Duration::from_secs(10), "the slot move", || {
        recorder.has(mark, |e| matches!(e, Ev::SlotsMoved { .. }))
    });
    let moved: Vec<Ev> = evs(&recorder.since(mark))
        .into_iter()
        .filter(|e| matches!(e, Ev::SlotsMoved { .. }))
        .collect();
    assert_eq!(moved, [Ev::SlotsMoved { slots: 1 }]);
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
}

#[test]
fn a_sentinel_switch_is_reported_with_both_primaries() {
    let deployment = TestSentinel::start();
    let recorder = Arc::new(Recorder::default());
    let sentinels = deployment.sentinel_urls();
    let sentinels: Vec<&str> = sentinels.iter().map(String::as_str).collect();
    let coord = Coordinator::sentinel_builder(&sentinels, deployment.service())
        .node_timeout(NODE_TIMEOUT)
        .observer(recorder.clone())
        .build()
        .unwrap();
    let guard = coord
        .lock("job")
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .unwrap();
    let old = deployment.primary().port();
    let mark = recorder.len();
    deployment.failover();
    let new = deployment.primary().port();
    assert_ne!(old, new);
    wait_until(Duration::from_secs(20), "the switch", || {
        recorder.has(mark, |e| matches!(e, Ev::Switched { .. }))
    });
    let switched: Vec<Ev> = evs(&recorder.since(mark))
        .into_iter()
        .filter(|e| matches!(e, Ev::Switched { .. }))
        .collect();
    assert_eq!(switched.len(), 1, "{switched:?}");
    let Ev::Switched { from, to } = &switched[0] else {
        unreachable!()
    };
    assert!(from.ends_with(&format!(":{old}")), "{from}");
    assert!(to.ends_with(&format!(":{new}")), "{to}");
    drop(guard);
}

/// Panics in every method it implements.
struct Panicking(AtomicUsize);

impl Observer for Panicking {
    fn attempt(&self, _: &AttemptEvent<'_>) {
        self.0.fetch_add(1, Ordering::SeqCst);
        panic!("an observer bug");
    }
    fn granted(&self, _: &GrantEvent<'_>) {
        self.0.fetch_add(1, Ordering::SeqCst);
        panic!("an observer bug");
    }
    fn renewed(&self, _: &RenewalEvent<'_>) {
        self.0.fetch_add(1, Ordering::SeqCst);
        panic!("an observer bug");
    }
    fn lost(&self, _: &LossEvent<'_>) {
        self.0.fetch_add(1, Ordering::SeqCst);
        panic!("an observer bug");
    }
    fn released(&self, _: &ReleaseEvent<'_>) {
        self.0.fetch_add(1, Ordering::SeqCst);
        panic!("an observer bug");
    }
}

#[test]
fn a_panicking_observer_does_not_break_the_lock() {
    let observer = Arc::new(Panicking(AtomicUsize::new(0)));
    let prefix = unique_prefix("observer-panics");
    let coord = observed(shared_server(), &prefix, observer.clone());
    let lock = coord.fenced_lock("{p}lease", "{p}fence").unwrap();
    let key = format!("{prefix}{{p}}lease");
    let guard = lock.try_acquire(TTL).unwrap().expect("free");
    assert!(lock.try_acquire(TTL).unwrap().is_none());
    let calls = observer.0.load(Ordering::SeqCst);
    assert_eq!(calls, 3, "attempt, granted, attempt");
    // The renewal thread survives a panic in its callback and keeps renewing.
    let keep_alive = guard.keep_alive().unwrap();
    wait_until(Duration::from_secs(10), "two renewals", || {
        observer.0.load(Ordering::SeqCst) >= calls + 2
    });
    drop(keep_alive);
    assert!(!guard.is_lost());
    let mut outside = shared_server().client();
    let pttl: i64 = outside.pttl(&key).unwrap();
    assert!(pttl > 0);
    let next = guard.fencing_token();
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    let again = lock.try_acquire(TTL).unwrap().expect("free again");
    assert!(again.fencing_token() > next);
}

#[test]
fn a_redlock_scenario_reports_every_event_once_in_order() {
    let servers: Vec<TestServer> = (0..3).map(|_| TestServer::start()).collect();
    let urls: Vec<String> = servers.iter().map(TestServer::url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let recorder = Arc::new(Recorder::default());
    let options = RedlockOptions {
        node_timeout: Duration::from_millis(100),
        ..RedlockOptions::default()
    }
    .with_observer(recorder.clone());
    let group = RedlockGroup::connect(&urls, options).unwrap();
    let key = "observed";
    let attempt = |waits| Ev::Attempt {
        key: key.to_owned(),
        primitive: Primitive::Redlock,
        waits,
    };
    let guard = group
        .lock(key)
        .unwrap()
        .try_acquire(TTL)
        .unwrap()
        .expect("free");
    assert!(group.lock(key).unwrap().try_acquire(TTL).unwrap().is_none());
    let wait = Duration::from_millis(200);
    let before = Instant::now();
    assert!(
        group
            .lock(key)
            .unwrap()
            .acquire_timeout(TTL, wait)
            .unwrap()
            .is_none()
    );
    let read_sent = Instant::now();
    let pttls: Vec<i64> = servers
        .iter()
        .map(|s| s.client().pttl(key).unwrap())
        .collect();
    assert!(guard.reset_expiry(TTL).unwrap());
    let confirmed_by = Instant::now();
    assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    let seen = recorder.since(0);
    let lease = lease_of(&seen[1]);
    assert_eq!(
        evs(&seen),
        [
            attempt(false),
            Ev::Granted {
                key: key.to_owned(),
                lease,
                token: None
            },
            attempt(false),
            Ev::Contended {
                key: key.to_owned()
            },
            Ev::WaitEnded {
                key: key.to_owned(),
                reason: WaitEnd::Busy
            },
            attempt(true),
            Ev::Contended {
                key: key.to_owned()
            },
            Ev::WaitEnded {
                key: key.to_owned(),
                reason: WaitEnd::TimedOut
            },
            Ev::Renewed { lease },
            Ev::Released {
                lease,
                outcome: Some(ReleaseOutcome::Released)
            },
        ]
    );
    assert_eq!(seen[4].measured.holder_ttl, None);
    assert!(seen[7].measured.waited.unwrap() + (seen[6].at - before) >= wait);
    // The margin: at most what the quorum's servers had left when read just
    // before the extension.
    let margin = seen[8].measured.margin.unwrap();
    assert!(
        pttls.iter().all(|p| *p > 0),
        "every node granted: {pttls:?}"
    );
    let least = Duration::from_millis(*pttls.iter().min().unwrap() as u64);
    assert!(
        margin <= least + Duration::from_millis(1),
        "{margin:?} {pttls:?}"
    );
    // The grant's round trip is under the node timeout.
    let slack = drift(TTL) + Duration::from_millis(100) + (confirmed_by - read_sent);
    assert!(margin + slack >= least, "{margin:?} {pttls:?}");
}

#[cfg(feature = "metrics")]
mod metrics_observer {
    use super::*;
    use metrics::{
        Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
        SharedString, Unit,
    };
    use respire_coordination::MetricsObserver;

    /// One value recorded: metric name, sorted labels, value.
    type Value = (String, Vec<(String, String)>, f64);

    /// Every value recorded.
    #[derive(Default)]
    struct Values(Mutex<Vec<Value>>);

    struct Handle(Arc<Values>, Key);

    impl Handle {
        fn record(&self, value: f64) {
            let mut labels: Vec<(String, String)> = self
                .1
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            let name = self.1.name().to_owned();
            self.0.0.lock().unwrap().push((name, labels, value));
        }
    }

    impl CounterFn for Handle {
        fn increment(&self, value: u64) {
            self.record(value as f64);
        }
        fn absolute(&self, value: u64) {
            self.record(value as f64);
        }
    }

    impl HistogramFn for Handle {
        fn record(&self, value: f64) {
            Handle::record(self, value);
        }
    }

    struct InTest(Arc<Values>);

    impl Recorder for InTest {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(Arc::new(Handle(self.0.clone(), key.clone())))
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::from_arc(Arc::new(Handle(self.0.clone(), key.clone())))
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut v: Vec<_> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn the_metrics_observer_counts_with_the_key_label_the_user_chose() {
        let values = Arc::new(Values::default());
        let recorder = InTest(values.clone());
        let prefix = unique_prefix("observer-metrics");
        // Keys label by their hash tag only.
        let observer = MetricsObserver::new().with_key_label(|key| {
            let open = key.find('{')?;
            let close = key[open..].find('}')?;
            Some(key[open + 1..open + close].to_owned())
        });
        let coord = observed(shared_server(), &prefix, Arc::new(observer));
        let lock = coord.fenced_lock("{orders}lease", "{orders}fence").unwrap();
        let plain = coord.lock("untagged").unwrap();
        let key = format!("{prefix}{{orders}}lease");
        let mut outside = shared_server().client();
        metrics::with_local_recorder(&recorder, || {
            let guard = lock.try_acquire(TTL).unwrap().expect("free");
            assert!(lock.try_acquire(TTL).unwrap().is_none());
            assert!(guard.reset_expiry(TTL).unwrap());
            let _: () = outside.del(&key).unwrap();
            assert_eq!(guard.verify_still_held().unwrap(), None);
            assert_eq!(guard.release().unwrap(), ReleaseOutcome::Expired);
            drop(plain.try_acquire(TTL).unwrap().expect("free"));
        });
        let got = values.0.lock().unwrap().clone();
        let count = |name: &str, with: &[(&str, &str)]| -> f64 {
            got.iter()
                .filter(|(n, l, _)| n == name && *l == labels(with))
                .map(|(_, _, v)| v)
                .sum()
        };
        let tagged = [("primitive", "fenced_lock"), ("key", "orders")];
        assert_eq!(count("respire_acquire_attempts_total", &tagged), 2.0);
        assert_eq!(count("respire_acquire_grants_total", &tagged), 1.0);
        assert_eq!(count("respire_acquire_contended_total", &tagged), 1.0);
        let busy = [tagged[0], tagged[1], ("reason", "busy")];
        assert_eq!(count("respire_acquire_not_granted_total", &busy), 1.0);
        assert_eq!(count("respire_lease_renewals_total", &tagged), 1.0);
        let gone = [tagged[0], tagged[1], ("cause", "gone")];
        assert_eq!(count("respire_lease_losses_total", &gone), 1.0);
        let expired = [tagged[0], tagged[1], ("outcome", "expired")];
        assert_eq!(count("respire_lease_releases_total", &expired), 1.0);
        // A key the label function gives no label to has none.
        let untagged = [("primitive", "lock")];
        assert_eq!(count("respire_acquire_grants_total", &untagged), 1.0);
        let released = [untagged[0], ("outcome", "released")];
        assert_eq!(count("respire_lease_releases_total", &released), 1.0);
        // Histograms: the waits and the renewal margin, in seconds.
        let margins: Vec<f64> = got
            .iter()
            .filter(|(n, _, _)| n == "respire_lease_renewal_margin_seconds")
            .map(|(_, _, v)| *v)
            .collect();
        assert_eq!(margins.len(), 1);
        assert!(margins[0] > 0.0 && margins[0] <= TTL.as_secs_f64());
        let waits = got
            .iter()
            .filter(|(n, _, _)| n == "respire_acquire_wait_seconds")
            .count();
        assert_eq!(waits, 3, "two grants and one busy end");
    }

    #[test]
    fn the_metrics_observer_counts_a_set_per_lease_and_its_contention_on_the_held_key() {
        let values = Arc::new(Values::default());
        let recorder = InTest(values.clone());
        let prefix = unique_prefix("observer-metrics-set");
        let observer = MetricsObserver::new().with_key_label(|key| {
            let open = key.find('{')?;
            let close = key[open..].find('}')?;
            Some(key[open + close + 1..].to_owned())
        });
        let coord = observed(shared_server(), &prefix, Arc::new(observer));
        let set = coord.lock_all(&["{m}a", "{m}b"]).unwrap();
        let outsider = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
        let holder = outsider
            .lock("{m}b")
            .unwrap()
            .try_acquire(TTL)
            .unwrap()
            .expect("free");
        metrics::with_local_recorder(&recorder, || {
            assert!(set.try_acquire(TTL).unwrap().is_none());
            holder.release().unwrap();
            let guard = set.try_acquire(TTL).unwrap().expect("free");
            for (_, outcome) in guard.release() {
                assert_eq!(outcome.unwrap(), ReleaseOutcome::Released);
            }
        });
        let got = values.0.lock().unwrap().clone();
        let count = |name: &str, with: &[(&str, &str)]| -> f64 {
            got.iter()
                .filter(|(n, l, _)| n == name && *l == labels(with))
                .map(|(_, _, v)| v)
                .sum()
        };
        for key in ["a", "b"] {
            let lease = [("primitive", "lock"), ("key", key)];
            assert_eq!(count("respire_acquire_attempts_total", &lease), 2.0);
            assert_eq!(count("respire_acquire_grants_total", &lease), 1.0);
            let busy = [lease[0], lease[1], ("reason", "busy")];
            assert_eq!(count("respire_acquire_not_granted_total", &busy), 1.0);
            let released = [lease[0], lease[1], ("outcome", "released")];
            assert_eq!(count("respire_lease_releases_total", &released), 1.0);
            let contended = count("respire_acquire_contended_total", &lease);
            assert_eq!(contended, if key == "b" { 1.0 } else { 0.0 }, "{key}");
        }
        let waits = got
            .iter()
            .filter(|(n, _, _)| n == "respire_acquire_wait_seconds")
            .count();
        assert_eq!(waits, 4, "each lease's end of each call");
    }

    #[test]
    fn without_a_key_label_function_no_metric_has_a_key_label() {
        let values = Arc::new(Values::default());
        let recorder = InTest(values.clone());
        let prefix = unique_prefix("observer-metrics-nokey");
        let coord = observed(shared_server(), &prefix, Arc::new(MetricsObserver::new()));
        let lock = coord.lock("job").unwrap();
        metrics::with_local_recorder(&recorder, || {
            let guard = lock.try_acquire(TTL).unwrap().expect("free");
            assert!(lock.try_acquire(TTL).unwrap().is_none());
            guard.release().unwrap();
        });
        let got = values.0.lock().unwrap().clone();
        assert_eq!(got.len(), 8, "{got:?}");
        assert!(
            got.iter()
                .all(|(_, l, _)| l.iter().all(|(k, _)| k != "key"))
        );
    }
}

#[cfg(feature = "tracing")]
mod tracing_observer {
    use super::*;
    use respire_coordination::TracingObserver;
    use std::collections::HashMap;
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata, Subscriber};

    /// A subscriber that records spans (name, fields, parent, follows-from,
    /// closed) and events (message, parent span), on every thread.
    #[derive(Default)]
    struct Spans {
        state: Mutex<State>,
    }

    #[derive(Default)]
    struct State {
        next: u64,
        spans: HashMap<u64, SpanRec>,
        events: Vec<(String, Option<u64>, String)>,
        stack: HashMap<ThreadId, Vec<u64>>,
    }

    #[derive(Clone, Debug, Default)]
    struct SpanRec {
        name: String,
        fields: HashMap<String, String>,
        follows: Vec<u64>,
        refs: usize,
    }

    struct Fields<'a>(&'a mut HashMap<String, String>);

    impl tracing::field::Visit for Fields<'_> {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            self.0.insert(field.name().to_owned(), format!("{value:?}"));
        }
        fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
            self.0.insert(field.name().to_owned(), value.to_owned());
        }
    }

    impl Subscriber for Spans {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, attrs: &Attributes<'_>) -> Id {
            let mut s = self.state.lock().unwrap();
            s.next += 1;
            let id = s.next;
            let mut rec = SpanRec {
                name: attrs.metadata().name().to_owned(),
                refs: 1,
                ..SpanRec::default()
            };
            attrs.record(&mut Fields(&mut rec.fields));
            s.spans.insert(id, rec);
            Id::from_u64(id)
        }
        fn record(&self, span: &Id, values: &Record<'_>) {
            let mut s = self.state.lock().unwrap();
            if let Some(rec) = s.spans.get_mut(&span.into_u64()) {
                values.record(&mut Fields(&mut rec.fields));
            }
        }
        fn record_follows_from(&self, span: &Id, follows: &Id) {
            let mut s = self.state.lock().unwrap();
            if let Some(rec) = s.spans.get_mut(&span.into_u64()) {
                rec.follows.push(follows.into_u64());
            }
        }
        fn event(&self, event: &Event<'_>) {
            let mut s = self.state.lock().unwrap();
            let mut fields = HashMap::new();
            event.record(&mut Fields(&mut fields));
            let parent = match event.parent() {
                Some(id) => Some(id.into_u64()),
                None if event.is_contextual() => s
                    .stack
                    .get(&thread::current().id())
                    .and_then(|st| st.last().copied()),
                None => None,
            };
            let message = fields.remove("message").unwrap_or_default();
            let detail = format!("{fields:?}");
            s.events.push((message, parent, detail));
        }
        fn enter(&self, span: &Id) {
            let mut s = self.state.lock().unwrap();
            s.stack
                .entry(thread::current().id())
                .or_default()
                .push(span.into_u64());
        }
        fn exit(&self, span: &Id) {
            let mut s = self.state.lock().unwrap();
            let stack = s.stack.entry(thread::current().id()).or_default();
            if let Some(at) = stack.iter().rposition(|id| *id == span.into_u64()) {
                stack.remove(at);
            }
        }
        fn clone_span(&self, span: &Id) -> Id {
            let mut s = self.state.lock().unwrap();
            if let Some(rec) = s.spans.get_mut(&span.into_u64()) {
                rec.refs += 1;
            }
            span.clone()
        }
        fn try_close(&self, span: Id) -> bool {
            let mut s = self.state.lock().unwrap();
            match s.spans.get_mut(&span.into_u64()) {
                Some(rec) => {
                    rec.refs -= 1;
                    rec.refs == 0
                }
                None => false,
            }
        }
    }

    #[test]
    fn the_tracing_observer_makes_a_span_per_acquire_and_per_held_lease() {
        let spans = Arc::new(Spans::default());
        let prefix = unique_prefix("observer-tracing");
        let coord = observed(shared_server(), &prefix, Arc::new(TracingObserver::new()));
        let lock = coord.fenced_lock("{t}lease", "{t}fence").unwrap();
        let key = format!("{prefix}{{t}}lease");
        let mut outside = shared_server().client();
        let token = tracing::subscriber::with_default(spans.clone(), || {
            let guard = lock.try_acquire(TTL).unwrap().expect("free");
            assert!(lock.try_acquire(TTL).unwrap().is_none());
            assert!(guard.reset_expiry(TTL).unwrap());
            let _: () = outside.del(&key).unwrap();
            assert_eq!(guard.verify_still_held().unwrap(), None);
            let token = guard.fencing_token();
            assert_eq!(guard.release().unwrap(), ReleaseOutcome::Expired);
            token
        });
        let s = spans.state.lock().unwrap();
        let mut acquires: Vec<(&u64, &SpanRec)> = s
            .spans
            .iter()
            .filter(|(_, r)| r.name == "respire.acquire")
            .collect();
        acquires.sort_by_key(|(id, _)| **id);
        let outcomes: Vec<&str> = acquires
            .iter()
            .map(|(_, r)| r.fields.get("outcome").map_or("", String::as_str))
            .collect();
        assert_eq!(outcomes, ["granted", "busy"]);
        assert!(
            acquires
                .iter()
                .all(|(_, r)| r.fields["key"] == key && r.refs == 0)
        );
        let leases: Vec<(&u64, &SpanRec)> = s
            .spans
            .iter()
            .filter(|(_, r)| r.name == "respire.lease")
            .collect();
        assert_eq!(leases.len(), 1);
        let (lease_id, lease) = leases[0];
        assert_eq!(lease.fields["token"], token.get().to_string());
        assert_eq!(lease.follows, [*acquires[0].0]);
        assert_eq!(lease.refs, 0, "closed at the release");
        let in_lease: Vec<&str> = s
            .events
            .iter()
            .filter(|(_, parent, _)| *parent == Some(*lease_id))
            .map(|(m, _, _)| m.as_str())
            .collect();
        assert_eq!(in_lease, ["renewed", "lease lost", "released"]);
        let contention: Vec<_> = s
            .events
            .iter()
            .filter(|(m, _, _)| m == "held by another owner")
            .collect();
        assert_eq!(contention.len(), 1);
        assert_eq!(
            contention[0].1,
            Some(*acquires[1].0),
            "inside the busy acquire"
        );
    }

    #[test]
    fn the_tracing_observer_makes_a_span_per_lease_of_a_set_each_closed_by_its_key() {
        let spans = Arc::new(Spans::default());
        let prefix = unique_prefix("observer-tracing-set");
        let coord = observed(shared_server(), &prefix, Arc::new(TracingObserver::new()));
        let set = coord
            .fenced_lock_all(&[("{t}a", "{t}fa"), ("{t}b", "{t}fb")])
            .unwrap();
        let keys = [format!("{prefix}{{t}}a"), format!("{prefix}{{t}}b")];
        let tokens = tracing::subscriber::with_default(spans.clone(), || {
            let guard = set.try_acquire(TTL).unwrap().expect("free");
            let tokens: Vec<u64> = guard
                .fencing_tokens()
                .iter()
                .map(|(_, t)| t.get())
                .collect();
            for (_, outcome) in guard.release() {
                assert_eq!(outcome.unwrap(), ReleaseOutcome::Released);
            }
            tokens
        });
        let s = spans.state.lock().unwrap();
        let named = |name: &str| -> Vec<(u64, SpanRec)> {
            let mut v: Vec<(u64, SpanRec)> = s
                .spans
                .iter()
                .filter(|(_, r)| r.name == name)
                .map(|(id, r)| (*id, r.clone()))
                .collect();
            v.sort_by_key(|(id, _)| *id);
            v
        };
        // One acquire span per key, in the order given, each granted and
        // closed.
        let acquires = named("respire.acquire");
        let acquire_keys: Vec<&str> = acquires
            .iter()
            .map(|(_, r)| r.fields["key"].as_str())
            .collect();
        assert_eq!(acquire_keys, [keys[0].as_str(), keys[1].as_str()]);
        for (_, r) in &acquires {
            assert_eq!(r.fields["outcome"], "granted");
            assert_eq!(r.refs, 0);
        }
        // One lease span per key, following from the acquire span of the
        // same key, with that key's token and its release in it.
        let leases = named("respire.lease");
        assert_eq!(leases.len(), 2);
        for (id, lease) in &leases {
            let i = keys
                .iter()
                .position(|k| *k == lease.fields["key"])
                .expect("a key of the set");
            assert_eq!(lease.follows, [acquires[i].0], "{lease:?}");
            assert_eq!(lease.fields["token"], tokens[i].to_string());
            assert_eq!(lease.refs, 0, "closed at the release");
            let in_lease: Vec<&str> = s
                .events
                .iter()
                .filter(|(_, parent, _)| *parent == Some(*id))
                .map(|(m, _, _)| m.as_str())
                .collect();
            assert_eq!(in_lease, ["released"]);
        }
    }
}
