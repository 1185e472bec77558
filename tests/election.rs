//! Leader election: one leader at a time, hand-over on resignation, loss of a
//! stopped leader before the server's expiry, the loss signal, the advertised
//! value, the observer's order, and refusals.
//!
//! Oracles are the server's: what its keys hold (read with plain commands),
//! `PEXPIRETIME` with `TIME`, and the term counter.

mod support;
use support::Rng;
use support::coordinator;

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{CancelToken, Coordinator, Error, Leader, ReleaseOutcome};
use rustix::process::{Pid, Signal, kill_process};
use support::{
    ChildProc, TestServer, block_on_stdin, env, server_now, shared_server, snapshot, unique_prefix,
    wait_until,
};

const CHILD_ENV: &str = "RESPIRE_ELECTION_CHILD";
const NODE_TIMEOUT: Duration = Duration::from_millis(200);
const TTL: Duration = Duration::from_secs(2);

#[test]
fn two_contenders_never_lead_at_once_and_terms_rise() {
    let prefix = unique_prefix("two");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let election = coord.election("{two}").unwrap();
    let leading = AtomicBool::new(false);
    let wins = AtomicUsize::new(0);
    let terms = std::sync::Mutex::new(Vec::new());
    thread::scope(|s| {
        for name in ["a", "b"] {
            let (election, leading, wins, terms) = (&election, &leading, &wins, &terms);
            s.spawn(move || {
                for _ in 0..100 {
                    let l = election
                        .campaign_timeout(name, TTL, Duration::from_secs(30))
                        .unwrap()
                        .expect("elected within 30 s");
                    assert!(!leading.swap(true, Ordering::SeqCst), "two leaders at once");
                    // Everyone reads this leader, with its own value.
                    let seen = election.leader().unwrap().expect("a leader");
                    assert_eq!(seen.term, l.term());
                    assert_eq!(seen.value.as_deref(), Some(name));
                    terms.lock().unwrap().push(l.term().get());
                    wins.fetch_add(1, Ordering::SeqCst);
                    leading.store(false, Ordering::SeqCst);
                    assert_eq!(l.resign().unwrap(), ReleaseOutcome::Released);
                }
            });
        }
    });
    assert_eq!(wins.load(Ordering::SeqCst), 200);
    let terms = terms.into_inner().unwrap();
    for pair in terms.windows(2) {
        assert!(pair[0] < pair[1], "term {} after {}", pair[1], pair[0]);
    }
    let counter: u64 = shared_server().client().get(election.term_key()).unwrap();
    assert_eq!(counter, 200);
    assert_eq!(election.leader().unwrap(), None);
}

#[test]
fn resigning_hands_over_to_a_waiting_contender() {
    // A server of its own: its tracking table shows when the contender waits.
    let server = TestServer::start();
    let coord = coordinator(&server.url(), "", NODE_TIMEOUT);
    let election = coord.election("{h}").unwrap();
    let long = Duration::from_secs(60);
    let a = election.try_campaign("a", long).unwrap().expect("free");
    let a_term = a.term();
    assert!(
        election.try_campaign("b", TTL).unwrap().is_none(),
        "a leads"
    );
    let mut c = server.client();
    thread::scope(|s| {
        // b gives up long before a's lease could expire on its own: only the
        // resignation can elect it.
        let waiter = s.spawn(|| election.campaign_timeout("b", TTL, long / 2));
        wait_until(Duration::from_secs(10), "b to wait on the lease", || {
            let info: String = redis::cmd("INFO").arg("stats").query(&mut c).unwrap();
            info.lines()
                .find_map(|l| l.strip_prefix("tracking_total_keys:"))
                .is_some_and(|n| n.trim() != "0")
        });
        assert_eq!(a.resign().unwrap(), ReleaseOutcome::Released);
        let b = waiter
            .join()
            .unwrap()
            .unwrap()
            .expect("b elected after the resignation");
        assert!(b.term() > a_term);
        let seen = election.leader().unwrap().expect("b leads");
        assert_eq!(seen.term, b.term());
        assert_eq!(seen.value.as_deref(), Some("b"));
        // The server's own view.
        let lease: String = c.get(election.lease_key()).unwrap();
        assert!(lease.ends_with(&format!(":{}", b.term())), "{lease}");
        let value: String = c.get(election.value_key()).unwrap();
        assert_eq!(value, format!("{}:b", b.term()));
        drop(b);
    });
}

#[test]
fn a_stopped_leader_is_lost_before_the_servers_expiry_and_the_next_term_is_higher() {
    const TEST: &str =
        "a_stopped_leader_is_lost_before_the_servers_expiry_and_the_next_term_is_higher";
    if std::env::var(CHILD_ENV).as_deref() == Ok("leader") {
        let url = env("RESPIRE_ELECTION_URL");
        let coord = coordinator(&url, "", NODE_TIMEOUT);
        let election = coord.election("{stop}").unwrap();
        let l = election.try_campaign("stopped", TTL).unwrap().unwrap();
        let _alive = l.keep_alive().unwrap();
        let mut clock = redis::Client::open(url).unwrap().get_connection().unwrap();
        let mut out = std::io::stdout();
        writeln!(out, "@@pid {} {}", std::process::id(), l.term()).unwrap();
        out.flush().unwrap();
        // Each time the bound moves (a confirmed renewal), say where it is on
        // the server's clock, and how many renewals were confirmed so far.
        let mut last_bound = None;
        let mut printed: Option<u64> = None;
        while !l.is_lost() {
            let (now_ms, at) = server_now(&mut clock);
            let bound = at + l.remaining_estimate();
            if last_bound.is_none_or(|b: Instant| bound > b + TTL / 4) {
                last_bound = Some(bound);
                let bound_us = now_ms * 1000 + (bound - at).as_micros() as i64;
                // A bound that moved after the grant's is a confirmed renewal,
                // which the executor counts just after it moves the bound:
                // the count is read once it has caught up (or after a second,
                // as it is, for the parent to judge).
                let counted = Instant::now() + Duration::from_secs(1);
                let renewals = loop {
                    let n = coord.renewal_stats().renewals;
                    if printed.is_none_or(|p| n > p) || Instant::now() >= counted {
                        break n;
                    }
                    thread::sleep(Duration::from_millis(1));
                };
                printed = Some(renewals);
                writeln!(out, "@@bound {bound_us} {renewals}").unwrap();
                out.flush().unwrap();
            }
            thread::sleep(Duration::from_millis(5));
        }
        // Woken up: it knows it is lost before doing anything else, and may
        // not advertise any more.
        let refused = !l.proclaim("after the pause").unwrap();
        writeln!(out, "@@lost {} {refused}", coord.renewal_stats().renewals).unwrap();
        out.flush().unwrap();
        block_on_stdin();
        return;
    }
    let server = TestServer::start();
    let mut child = ChildProc::spawn(
        CHILD_ENV,
        TEST,
        "leader",
        &[("RESPIRE_ELECTION_URL", server.url())],
    );
    let pid_term = child.expect("pid");
    let (pid, term) = pid_term.split_once(' ').unwrap();
    let (pid, term): (i32, u64) = (pid.parse().unwrap(), term.parse().unwrap());
    // The first bound is the grant's; wait for one after a renewal, then stop
    // the leader at once (the next renewal is half a TTL away).
    child.expect("bound");
    let line = child.expect("bound");
    let (bound_us, renewals) = line.split_once(' ').unwrap();
    let (bound_us, renewals): (i64, u64) = (bound_us.parse().unwrap(), renewals.parse().unwrap());
    assert!(renewals >= 1);
    kill_process(Pid::from_raw(pid).unwrap(), Signal::STOP).unwrap();
    let coord = coordinator(&server.url(), "", NODE_TIMEOUT);
    let election = coord.election("{stop}").unwrap();
    let mut c = server.client();
    // After the stop the leader can renew no more; a renewal the server
    // applies now is one the leader never hears of.
    let expiry_ms: i64 = redis::cmd("PEXPIRETIME")
        .arg(election.lease_key())
        .query(&mut c)
        .unwrap();
    assert!(
        bound_us < expiry_ms * 1000,
        "the leader counted on its lease until {bound_us} µs, past the server's expiry at {expiry_ms} ms"
    );
    println!(
        "the stopped leader's bound came {} µs before the server's expiry",
        expiry_ms * 1000 - bound_us
    );
    // A contender wins once the server lets the lease go, with a higher term.
    let next = election
        .campaign_timeout("next", TTL, Duration::from_secs(10))
        .unwrap()
        .expect("elected after the stopped leader's expiry");
    let (now_ms, _) = server_now(&mut c);
    assert!(now_ms >= expiry_ms, "elected before the old lease expired");
    assert!(next.term().get() > term);
    kill_process(Pid::from_raw(pid).unwrap(), Signal::CONT).unwrap();
    let lost = child.expect("lost");
    let (renewals_after, refused) = lost.split_once(' ').unwrap();
    assert_eq!(
        renewals_after.parse::<u64>().unwrap(),
        renewals,
        "a renewal was confirmed after the last bound the leader printed"
    );
    assert_eq!(refused, "true", "a lost leader proclaimed");
    let seen = election.leader().unwrap().expect("next leads");
    assert_eq!(seen.term, next.term());
    assert_eq!(seen.value.as_deref(), Some("next"));
    child.finish();
}

#[test]
fn proclaiming_after_loss_is_refused_and_changes_nothing() {
    let prefix = unique_prefix("proclaim");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let election = coord.election("{p}").unwrap();
    let mut c = shared_server().client();

    // Held: the value changes, the term does not.
    let a = election.try_campaign("a1", TTL).unwrap().unwrap();
    assert!(a.proclaim("a2").unwrap());
    let seen = election.leader().unwrap().unwrap();
    assert_eq!((seen.term, seen.value.as_deref()), (a.term(), Some("a2")));

    // Taken over on the server while the guard still counts on its lease:
    // the script refuses, the guard learns it is lost.
    let _: () = c.del(election.lease_key()).unwrap();
    let b = election
        .try_campaign("b", TTL)
        .unwrap()
        .expect("free again");
    assert!(!a.is_lost());
    let before = snapshot(&mut c, &prefix);
    assert!(!a.proclaim("a3").unwrap(), "proclaimed over another leader");
    assert!(a.is_lost(), "a refused proclamation did not flag the loss");
    assert_eq!(snapshot(&mut c, &prefix), before);
    let seen = election.leader().unwrap().unwrap();
    assert_eq!((seen.term, seen.value.as_deref()), (b.term(), Some("b")));

    // Lost on the local clock: nothing is sent at all.
    let short = Duration::from_millis(500);
    b.resign().unwrap();
    let d = election.try_campaign("d", short).unwrap().unwrap();
    wait_until(Duration::from_secs(5), "the lease to count as lost", || {
        d.is_lost()
    });
    let before = snapshot(&mut c, &prefix);
    assert!(!d.proclaim("d2").unwrap());
    assert_eq!(snapshot(&mut c, &prefix), before);
}

/// Whether `signal` has disconnected (the leadership it belongs to is lost),
/// without waiting.
fn fired(signal: &crossbeam_channel::Receiver<()>) -> bool {
    matches!(
        signal.try_recv(),
        Err(crossbeam_channel::TryRecvError::Disconnected)
    )
}

#[test]
fn lost_signal_fires_when_the_lease_is_deleted_or_taken_on_the_server_and_not_while_held() {
    // A coordinator of its own: its renewal counters count these leases only.
    let prefix = unique_prefix("signal");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let election = coord.election("{sig}").unwrap();
    let mut c = shared_server().client();
    let short = Duration::from_secs(1);

    // Held and kept alive: for three renewals (a renewal at half the TTL, so
    // more than a TTL past the grant) the signal stays open, and the server
    // still holds this term's lease.
    let a = election.try_campaign("a", short).unwrap().expect("free");
    let signal = a.lost_signal().clone();
    let granted = Instant::now();
    let renewal = a.keep_alive().unwrap();
    wait_until(Duration::from_secs(10), "three renewals", || {
        assert!(!fired(&signal), "the signal fired while the lease was held");
        coord.renewal_stats().renewals >= 3
    });
    // Past the grant's TTL: only the renewals kept the lease on the server.
    assert!(granted.elapsed() > short, "three renewals within one TTL");
    assert!(!fired(&signal), "the signal fired while the lease was held");
    assert!(!a.is_lost());
    let lease: String = c.get(election.lease_key()).unwrap();
    assert!(lease.ends_with(&format!(":{}", a.term())), "{lease}");
    assert_eq!(coord.renewal_stats().losses, 0);

    // Deleted on the server: the next renewal finds it gone and the signal
    // fires (a renewal's finding, counted as a loss, not the loss deadline).
    let _: () = c.del(election.lease_key()).unwrap();
    assert!(
        matches!(
            signal.recv_timeout(Duration::from_secs(10)),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected)
        ),
        "the signal did not fire after the lease was deleted"
    );
    assert!(a.is_lost());
    // The check of the held phase above sees this fired signal.
    assert!(fired(&signal));
    assert_eq!(coord.renewal_stats().losses, 1);
    drop(renewal);
    drop(a);

    // Taken: another contender wins on the server (its own coordinator, so
    // the counters above stay this one's), and the kept-alive leadership
    // finds at its next renewal that the lease is not its own.
    let b = election.try_campaign("b", short).unwrap().expect("free");
    let signal = b.lost_signal().clone();
    let renewal = b.keep_alive().unwrap();
    let renewed = coord.renewal_stats().renewals;
    wait_until(Duration::from_secs(10), "a renewal of b", || {
        coord.renewal_stats().renewals > renewed
    });
    assert!(!fired(&signal), "the signal fired while the lease was held");
    let other = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let other = other.election("{sig}").unwrap();
    let _: () = c.del(election.lease_key()).unwrap();
    let taker = other
        .try_campaign("taker", Duration::from_secs(60))
        .unwrap()
        .expect("free after the delete");
    assert!(taker.term() > b.term());
    assert!(
        matches!(
            signal.recv_timeout(Duration::from_secs(10)),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected)
        ),
        "the signal did not fire after the lease was taken"
    );
    assert!(b.is_lost());
    assert_eq!(coord.renewal_stats().losses, 2);
    // The taker's lease is untouched by the loser.
    let lease: String = c.get(election.lease_key()).unwrap();
    assert!(lease.ends_with(&format!(":{}", taker.term())), "{lease}");
    drop(renewal);
    assert_eq!(b.resign().unwrap(), ReleaseOutcome::TakenOver);
    drop(taker);
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let prefix = unique_prefix("bad");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    for name in ["", "no-tag", "{}"] {
        match coord.election(name) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("election name"), "{msg}"),
            other => panic!("{name:?}: {other:?}"),
        }
    }
    let election = coord.election("{bad}").unwrap();
    let mut c = shared_server().client();
    for ttl in [Duration::ZERO, NODE_TIMEOUT] {
        match election.try_campaign("v", ttl) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("ttl"), "{msg}"),
            other => panic!("{ttl:?}: {other:?}"),
        }
    }
    let cancel = CancelToken::new();
    assert!(matches!(
        election.campaign("v", Duration::ZERO, &cancel),
        Err(Error::InvalidArgument(_))
    ));
    assert!(snapshot(&mut c, &prefix).is_empty(), "something was sent");
    // A value key of another type: refused by the script, nothing changed,
    // and the error names that key.
    let _: () = c.hset(election.value_key(), "f", "v").unwrap();
    let before = snapshot(&mut c, &prefix);
    match election.try_campaign("v", TTL) {
        Err(Error::BadKey { key, problem }) => {
            assert_eq!(key, election.value_key());
            assert!(problem.contains("hash"), "{problem}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(snapshot(&mut c, &prefix), before);
    // A lease key that is no leader's lease: `leader()` says so.
    let _: () = c.del(election.value_key()).unwrap();
    let _: () = c.set(election.lease_key(), "not-a-lease").unwrap();
    assert!(matches!(election.leader(), Err(Error::BadKey { .. })));
}

#[test]
fn an_expired_lease_reads_as_no_leader() {
    let prefix = unique_prefix("expired");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let election = coord.election("{x}").unwrap();
    assert_eq!(election.leader().unwrap(), None);
    let l = election
        .try_campaign("x", Duration::from_millis(400))
        .unwrap()
        .unwrap();
    assert_eq!(election.leader().unwrap().unwrap().term, l.term());
    let mut c = shared_server().client();
    wait_until(
        Duration::from_secs(5),
        "the server to expire the lease",
        || {
            let pttl: i64 = c.pttl(election.lease_key()).unwrap();
            pttl == -2
        },
    );
    // The value key is still there, but belongs to no live term.
    let value: Option<String> = c.get(election.value_key()).unwrap();
    assert_eq!(value.as_deref(), Some("1:x"));
    assert_eq!(election.leader().unwrap(), None);
    drop(l);
}

/// Collects what an observer yields, in a thread, on a channel.
fn spawn_observer(
    election: respire_coordination::Election,
    cancel: CancelToken,
) -> (
    crossbeam_channel::Receiver<respire_coordination::Result<Option<Leader>>>,
    thread::JoinHandle<()>,
) {
    let (tx, rx) = crossbeam_channel::unbounded();
    let handle = thread::spawn(move || {
        for item in election.observe().cancel_on(cancel) {
            if tx.send(item).is_err() {
                return;
            }
        }
    });
    (rx, handle)
}

fn next(
    rx: &crossbeam_channel::Receiver<respire_coordination::Result<Option<Leader>>>,
) -> respire_coordination::Result<Option<Leader>> {
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the observer reported within 10 s")
}

#[test]
fn observe_reports_each_change_in_order_and_never_a_lower_term() {
    let prefix = unique_prefix("observe");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let election = coord.election("{o}").unwrap();
    let cancel = CancelToken::new();
    let (rx, handle) = spawn_observer(election.clone(), cancel.clone());
    let long = Duration::from_secs(60);
    let value = |r: respire_coordination::Result<Option<Leader>>| {
        r.unwrap().map(|l| (l.term.get(), l.value.unwrap()))
    };
    assert_eq!(value(next(&rx)), None, "first: nobody leads");
    let a = election.try_campaign("a", long).unwrap().unwrap();
    assert_eq!(value(next(&rx)), Some((1, "a".into())));
    assert!(a.proclaim("a2").unwrap());
    assert_eq!(value(next(&rx)), Some((1, "a2".into())));
    a.resign().unwrap();
    assert_eq!(value(next(&rx)), None);
    let b = election.try_campaign("b", long).unwrap().unwrap();
    assert_eq!(value(next(&rx)), Some((2, "b".into())));
    // A leader whose lease simply runs out (no delete): the expiry is seen
    // (by the invalidation, or at the latest by the timer at its PTTL).
    drop(b);
    assert_eq!(value(next(&rx)), None);
    let c3 = election
        .try_campaign("c", Duration::from_millis(600))
        .unwrap()
        .unwrap();
    assert_eq!(value(next(&rx)), Some((3, "c".into())));
    // Not released: the server expires it.
    assert_eq!(value(next(&rx)), None);
    assert_eq!(c3.resign().unwrap(), ReleaseOutcome::Expired);

    // The counter's history is lost (as after a restart without
    // persistence): a term below one reported is an error, once, never a
    // leader.
    let mut c = shared_server().client();
    let _: () = c.set(election.term_key(), 0).unwrap();
    let elsewhere = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let low = elsewhere
        .election("{o}")
        .unwrap()
        .try_campaign("low", long)
        .unwrap()
        .unwrap();
    assert_eq!(low.term().get(), 1);
    match next(&rx) {
        Err(Error::FencingRegression { issued, seen, .. }) => assert_eq!((issued, seen), (1, 3)),
        other => panic!("{other:?}"),
    }
    low.resign().unwrap();
    assert_eq!(value(next(&rx)), None);
    // A later term still below the highest reported is refused too: the
    // regression does not lower the bar.
    let lower = elsewhere
        .election("{o}")
        .unwrap()
        .try_campaign("lower", long)
        .unwrap()
        .unwrap();
    assert_eq!(lower.term().get(), 2);
    match next(&rx) {
        Err(Error::FencingRegression { issued, seen, .. }) => assert_eq!((issued, seen), (2, 3)),
        other => panic!("{other:?}"),
    }
    lower.resign().unwrap();
    assert_eq!(value(next(&rx)), None);
    let _: () = c.set(election.term_key(), 10).unwrap();
    let high = elsewhere
        .election("{o}")
        .unwrap()
        .try_campaign("high", long)
        .unwrap()
        .unwrap();
    assert_eq!(value(next(&rx)), Some((11, "high".into())));
    cancel.cancel();
    handle.join().unwrap();
    assert!(rx.try_recv().is_err(), "nothing after the cancellation");
    drop(high);
}

#[test]
fn observing_a_server_that_went_away_reports_an_error_not_the_last_leader() {
    let server = TestServer::start();
    let coord = coordinator(&server.url(), "", NODE_TIMEOUT);
    let election = coord.election("{down}").unwrap();
    let l = election.try_campaign("up", TTL).unwrap().unwrap();
    let cancel = CancelToken::new();
    let (rx, handle) = spawn_observer(election.clone(), cancel.clone());
    assert_eq!(next(&rx).unwrap().map(|l| l.term), Some(l.term()));
    server.kill();
    match next(&rx) {
        Err(e) => assert!(e.is_retryable(), "{e:?}"),
        Ok(state) => panic!("reported {state:?} from a server that is gone"),
    }
    server.restart();
    // Back, empty (no persistence): nobody leads.
    loop {
        match next(&rx) {
            Err(_) => continue,
            Ok(state) => {
                assert_eq!(state, None);
                break;
            }
        }
    }
    cancel.cancel();
    handle.join().unwrap();
    drop(l);
}

// ----- five processes under kill -9, SIGSTOP and resignations -----

/// Nanoseconds on `CLOCK_MONOTONIC`: one clock for every process of the
/// machine, so intervals recorded by different processes compare.
fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// One leadership as its process recorded it: every instant at which it
/// had checked that it was not lost (taken before the check) and acted as
/// leader.
#[derive(Clone, Debug)]
struct Reign {
    term: u64,
    pid: u32,
    first: u64,
    last: u64,
}

/// Folds `(pid, term, instant)` claims into one reign per term and checks
/// them: one process per term, and, ordered by their first claim, terms
/// strictly increase and each reign's last claim comes before the next one's
/// first. Returns the reigns in order.
fn check_reigns(claims: &[(u32, u64, u64)]) -> Result<Vec<Reign>, String> {
    let mut by_term: std::collections::BTreeMap<u64, Reign> = Default::default();
    for &(pid, term, at) in claims {
        let reign = by_term.entry(term).or_insert(Reign {
            term,
            pid,
            first: at,
            last: at,
        });
        if reign.pid != pid {
            return Err(format!("term {term} claimed by {} and {pid}", reign.pid));
        }
        reign.first = reign.first.min(at);
        reign.last = reign.last.max(at);
    }
    let mut reigns: Vec<Reign> = by_term.into_values().collect();
    reigns.sort_by_key(|r| r.first);
    for pair in reigns.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if b.term <= a.term {
            return Err(format!("term {} began after term {}", b.term, a.term));
        }
        if a.last >= b.first {
            return Err(format!(
                "term {} (pid {}) acted {} µs after term {} (pid {}) began",
                a.term,
                a.pid,
                (a.last - b.first) / 1000,
                b.term,
                b.pid
            ));
        }
    }
    Ok(reigns)
}

#[test]
fn the_reign_checker_finds_overlaps_inversions_and_shared_terms() {
    let ok = [(1, 1, 10), (1, 1, 20), (2, 2, 21), (2, 2, 30), (3, 4, 40)];
    assert_eq!(check_reigns(&ok).unwrap().len(), 3);
    // Term 1 acts after term 2 began.
    let overlap = [(1, 1, 10), (2, 2, 15), (1, 1, 20)];
    assert!(check_reigns(&overlap).unwrap_err().contains("acted"));
    // Touching is overlapping too.
    let touching = [(1, 1, 10), (1, 1, 15), (2, 2, 15)];
    assert!(check_reigns(&touching).is_err());
    // A later reign with a lower term.
    let inverted = [(1, 5, 10), (2, 4, 20)];
    assert!(check_reigns(&inverted).unwrap_err().contains("began after"));
    // One term, two processes.
    let shared = [(1, 3, 10), (2, 3, 20)];
    assert!(check_reigns(&shared).unwrap_err().contains("claimed by"));
}

/// The contender processes, killed (SIGKILL; a stopped one too) when the
/// test ends, however it ends.
struct Contenders(Vec<std::process::Child>);

impl Drop for Contenders {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn five_processes_under_kills_and_stops_never_lead_at_once() {
    const TEST: &str = "five_processes_under_kills_and_stops_never_lead_at_once";
    const CHAOS_TTL: Duration = Duration::from_secs(1);
    const CHAOS_NODE_TIMEOUT: Duration = Duration::from_millis(100);
    if std::env::var(CHILD_ENV).as_deref() == Ok("contender") {
        let coord = Coordinator::builder(&env("RESPIRE_ELECTION_URL"))
            .node_timeout(CHAOS_NODE_TIMEOUT)
            .build()
            .unwrap();
        let election = coord.election("{chaos}").unwrap();
        let pid = std::process::id();
        let mut rng = Rng::new(u64::from(pid) << 32 | mono_ns() & 0xffff_ffff);
        let never = CancelToken::new();
        let mut out = std::io::stdout();
        // The negative control: a leader that never looks whether it lost.
        let heedless = std::env::var("RESPIRE_ELECTION_HEEDLESS").is_ok();
        let value = pid.to_string();
        loop {
            // The call that wins and its return bracket the server's grant.
            let won = if rng.below(2) == 0 {
                // Waits inside campaign(): a wide bracket.
                let sent = mono_ns();
                election
                    .campaign(&value, CHAOS_TTL, &never)
                    .map(|l| (l, sent, "wait"))
            } else {
                // Waits with observe() until nobody leads, then makes one
                // attempt: a bracket of one script call.
                loop {
                    let mut changes = election.observe();
                    while !matches!(changes.next(), Some(Ok(None))) {}
                    let sent = mono_ns();
                    match election.try_campaign(&value, CHAOS_TTL) {
                        Ok(Some(l)) => break Ok((l, sent, "once")),
                        Ok(None) => {}
                        Err(e) => break Err(e),
                    }
                }
            };
            let (l, sent, how) = match won {
                Ok(won) => won,
                Err(e) => {
                    writeln!(out, "@@error {e}").unwrap();
                    thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let term = l.term().get();
            writeln!(out, "@@granted {term} {sent} {} {how}", mono_ns()).unwrap();
            let renewal = l.keep_alive().unwrap();
            let hold = Duration::from_millis(50 + rng.below(1500));
            let until = Instant::now() + hold;
            loop {
                let at = mono_ns();
                if l.is_lost() && !heedless {
                    writeln!(out, "@@end {term} lost").unwrap();
                    break;
                }
                writeln!(out, "@@claim {term} {at}").unwrap();
                if Instant::now() >= until {
                    writeln!(out, "@@end {term} resigned").unwrap();
                    break;
                }
                thread::sleep(Duration::from_millis(2));
            }
            drop(renewal);
            drop(l.resign());
            thread::sleep(Duration::from_millis(rng.below(50)));
        }
    }
    let seconds: u64 = std::env::var("RESPIRE_ELECTION_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    println!("{seconds} s (RESPIRE_ELECTION_SECS)");
    // RESPIRE_ELECTION_HEEDLESS=1 (passed on to the contenders) runs the
    // negative control: leaders that act without checking for loss, which
    // this test must catch.
    let (mut rng, seed) = Rng::seeded("election campaign");
    let server = TestServer::start();
    let url = server.url();

    // Every line of every contender, with its pid.
    let (lines_tx, lines_rx) = crossbeam_channel::unbounded::<(u32, String)>();
    let spawn = |lines_tx: &crossbeam_channel::Sender<(u32, String)>| {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "contender")
            .env("RESPIRE_ELECTION_URL", &url)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        let stdout = child.stdout.take().unwrap();
        let tx = lines_tx.clone();
        thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send((pid, line)).is_err() {
                    return;
                }
            }
        });
        child
    };
    let mut children = Contenders((0..5).map(|_| spawn(&lines_tx)).collect());

    // The observer, in this process: what it reported and when.
    let coord = coordinator(&url, "", NODE_TIMEOUT);
    let election = coord.election("{chaos}").unwrap();
    let stop = CancelToken::new();
    let observed = {
        let changes = election.observe().cancel_on(stop.clone());
        thread::spawn(move || {
            changes
                .map(|c| (mono_ns(), c.map(|l| l.map(|l| l.term.get()))))
                .collect::<Vec<_>>()
        })
    };

    let (mut kills, mut stops) = (0, 0);
    let end = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < end {
        thread::sleep(Duration::from_millis(200 + rng.below(600)));
        let i = rng.below(children.0.len() as u64) as usize;
        if rng.below(2) == 0 {
            children.0[i].kill().unwrap();
            children.0[i].wait().unwrap();
            children.0[i] = spawn(&lines_tx);
            kills += 1;
        } else {
            let pid = Pid::from_raw(children.0[i].id() as i32).unwrap();
            kill_process(pid, Signal::STOP).unwrap();
            thread::sleep(CHAOS_TTL + Duration::from_millis(rng.below(1000)));
            kill_process(pid, Signal::CONT).unwrap();
            stops += 1;
        }
    }
    drop(children);
    drop(lines_tx);
    stop.cancel();
    let observed = observed.join().unwrap();

    let (mut claims, mut ends, mut errors) = (Vec::new(), 0, 0);
    let mut granted = std::collections::HashMap::new();
    for (pid, line) in lines_rx.iter() {
        let Some(at) = line.find("@@") else { continue };
        let words: Vec<&str> = line[at + 2..].split_whitespace().collect();
        match words.as_slice() {
            ["claim", term, t] => {
                // A line cut short by kill -9 does not parse and is no claim.
                if let (Ok(term), Ok(t)) = (term.parse::<u64>(), t.parse::<u64>()) {
                    claims.push((pid, term, t));
                }
            }
            ["granted", term, sent, returned, how @ ("wait" | "once")] => {
                if let (Ok(term), Ok(sent), Ok(returned)) = (
                    term.parse::<u64>(),
                    sent.parse::<u64>(),
                    returned.parse::<u64>(),
                ) {
                    granted.insert(term, (sent, returned, *how == "once"));
                }
            }
            ["end", ..] => ends += 1,
            ["error", ..] => errors += 1,
            _ => {}
        }
    }
    let reigns = check_reigns(&claims).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    assert!(reigns.len() >= 5, "only {} leaderships", reigns.len());

    // The observer never went back, and saw leaders the processes had.
    let mut highest = 0;
    let mut first_seen = std::collections::BTreeMap::new();
    for (at, change) in &observed {
        match change {
            Ok(Some(term)) => {
                assert!(*term >= highest, "observed term {term} after {highest}");
                highest = *term;
                first_seen.entry(*term).or_insert(*at);
            }
            Ok(None) => {}
            Err(e) => panic!("the observer failed on a healthy server: {e}"),
        }
    }
    // How long after the grant the observer reported each term, bracketed:
    // the server granted it after the winning call was made and before it
    // returned, so the delay from the call is at least the true one and the
    // delay from the return at most (negative when the observer heard of it
    // before the leader did). Terms won by one attempt (`once`) have a
    // bracket of one script call; terms won inside campaign()'s wait, one as
    // wide as the wait.
    let mut figures: [[Vec<i64>; 3]; 2] = Default::default();
    for (term, at) in &first_seen {
        if let Some(&(sent, returned, once)) = granted.get(term) {
            let [from_sent, from_returned, calls] = &mut figures[usize::from(once)];
            from_sent.push(*at as i64 - sent as i64);
            from_returned.push(*at as i64 - returned as i64);
            calls.push(returned as i64 - sent as i64);
        }
    }
    let seen = observed
        .iter()
        .filter(|(_, c)| matches!(c, Ok(Some(_))))
        .count();
    println!(
        "{} leaderships ({kills} kill -9, {stops} SIGSTOP past the TTL, {ends} ended, {errors} \
         campaign errors); no overlap, terms strictly increasing; the observer reported {seen} \
         leaders ({} terms), never going back",
        reigns.len(),
        first_seen.len(),
    );
    for (how, [from_sent, from_returned, calls]) in
        ["won inside campaign()'s wait", "won by one try_campaign()"]
            .iter()
            .zip(&mut figures)
    {
        println!(
            "observer's delay for {} terms {how}, median / p90: from the winning call {} / {} \
             µs, from its return {} / {} µs (the grant lies between; the calls took {} / {} µs)",
            from_sent.len(),
            percentile_us(from_sent, 50),
            percentile_us(from_sent, 90),
            percentile_us(from_returned, 50),
            percentile_us(from_returned, 90),
            percentile_us(calls, 50),
            percentile_us(calls, 90),
        );
    }
    assert!(seen >= 1, "the observer reported no leader");
    // Every change: each reign the processes recorded is compared with the
    // terms observed. One that lasted at least a second must have been
    // reported; a shorter one may come and go between two reads.
    let observed_terms: std::collections::BTreeSet<u64> = first_seen.keys().copied().collect();
    let (reported, long) = check_observed(&reigns, &observed_terms, LONG_REIGN)
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    println!(
        "the observer reported {reported} of {} reigns, and all {long} that lasted {LONG_REIGN:?} \
         or more",
        reigns.len()
    );
}

/// A reign at least this long (from its first claim to its last) must have
/// been reported by `observe()`.
const LONG_REIGN: Duration = Duration::from_secs(1);

/// The `p`th percentile (nearest rank) of `values`, in µs (0 for none).
fn percentile_us(values: &mut [i64], p: usize) -> i64 {
    if values.is_empty() {
        return 0;
    }
    values.sort_unstable();
    support::percentile(values, p as f64 / 100.0) / 1000
}

/// Compares the reigns the processes recorded with the terms the observer
/// reported: every reign that lasted `long` or more (first claim to last)
/// must be among them. Returns how many reigns were reported, and how many
/// lasted `long` or more.
fn check_observed(
    reigns: &[Reign],
    observed: &std::collections::BTreeSet<u64>,
    long: Duration,
) -> Result<(usize, usize), String> {
    let long_ns = long.as_nanos() as u64;
    let reported = reigns.iter().filter(|r| observed.contains(&r.term)).count();
    let long: Vec<&Reign> = reigns
        .iter()
        .filter(|r| r.last - r.first >= long_ns)
        .collect();
    let missed: Vec<String> = long
        .iter()
        .filter(|r| !observed.contains(&r.term))
        .map(|r| {
            format!(
                "term {} (pid {}, {} ms)",
                r.term,
                r.pid,
                (r.last - r.first) / 1_000_000
            )
        })
        .collect();
    if !missed.is_empty() {
        return Err(format!("the observer never reported {}", missed.join(", ")));
    }
    Ok((reported, long.len()))
}

#[test]
fn the_observed_checker_finds_a_long_reign_never_reported() {
    let reign = |term, first, last| Reign {
        term,
        pid: 7,
        first,
        last,
    };
    let s = 1_000_000_000;
    let reigns = [
        reign(1, 0, 2 * s),
        reign(2, 2 * s + 1, 2 * s + 5),
        reign(3, 3 * s, 4 * s),
    ];
    let all: std::collections::BTreeSet<u64> = [1, 2, 3].into();
    assert_eq!(
        check_observed(&reigns, &all, Duration::from_secs(1)),
        Ok((3, 2))
    );
    // A short reign missed is allowed.
    let short_missed: std::collections::BTreeSet<u64> = [1, 3].into();
    assert_eq!(
        check_observed(&reigns, &short_missed, Duration::from_secs(1)),
        Ok((2, 2))
    );
    // A reign of exactly a second, missed.
    let long_missed: std::collections::BTreeSet<u64> = [1, 2].into();
    let e = check_observed(&reigns, &long_missed, Duration::from_secs(1)).unwrap_err();
    assert!(e.contains("term 3"), "{e}");
}

#[test]
fn an_election_on_a_cluster_campaigns_reads_and_observes_on_the_slots_primary() {
    let cluster = support::shared_cluster();
    let seeds = cluster.seed_urls();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let prefix = unique_prefix("cluster");
    let coord = Coordinator::cluster_builder(&seeds)
        .key_prefix(&prefix)
        .node_timeout(NODE_TIMEOUT)
        .build()
        .unwrap();
    // Names in different slots, so more than one primary is used.
    let names = ["{alpha}", "{beta}", "{gamma}"];
    let primaries: std::collections::HashSet<usize> = names
        .iter()
        .map(|n| cluster.primary_for_key(format!("{prefix}{n}:leader")))
        .collect();
    assert!(primaries.len() >= 2, "the names share a primary");
    for name in names {
        let election = coord.election(name).unwrap();
        let cancel = CancelToken::new();
        let (rx, handle) = spawn_observer(election.clone(), cancel.clone());
        assert_eq!(next(&rx).unwrap(), None);
        let a = election.try_campaign("a", TTL).unwrap().unwrap();
        assert!(election.try_campaign("b", TTL).unwrap().is_none());
        let seen = next(&rx).unwrap().expect("a leads");
        assert_eq!((seen.term, seen.value.as_deref()), (a.term(), Some("a")));
        assert!(a.proclaim("a2").unwrap());
        assert_eq!(next(&rx).unwrap().unwrap().value.as_deref(), Some("a2"));
        assert_eq!(election.leader().unwrap().unwrap().term, a.term());
        // On the primary that owns the name's slot.
        let value: String = cluster
            .client_for_key(election.value_key())
            .get(election.value_key())
            .unwrap();
        assert_eq!(value, format!("{}:a2", a.term()));
        a.resign().unwrap();
        assert_eq!(next(&rx).unwrap(), None);
        cancel.cancel();
        handle.join().unwrap();
    }
}

#[test]
fn observe_polls_where_tracking_is_denied_and_still_sees_every_change() {
    let server = TestServer::builder()
        .acl_user("user u on >pw ~* &* +@all -client|tracking")
        .start();
    let coord = coordinator(&server.url_for_user("u", "pw"), "", NODE_TIMEOUT);
    let election = coord.election("{poll}").unwrap();
    let cancel = CancelToken::new();
    let (rx, handle) = spawn_observer(election.clone(), cancel.clone());
    assert_eq!(next(&rx).unwrap(), None);
    // Changes made elsewhere (no tracking here, no invalidation to wake it).
    let other = coordinator(&server.url(), "", NODE_TIMEOUT);
    let elsewhere = other.election("{poll}").unwrap();
    let a = elsewhere
        .try_campaign("a", Duration::from_secs(60))
        .unwrap()
        .unwrap();
    assert_eq!(next(&rx).unwrap().map(|l| l.term), Some(a.term()));
    assert!(a.proclaim("a2").unwrap());
    assert_eq!(
        next(&rx).unwrap().and_then(|l| l.value),
        Some("a2".to_owned())
    );
    a.resign().unwrap();
    assert_eq!(next(&rx).unwrap(), None);
    cancel.cancel();
    handle.join().unwrap();
    // It polled: tracking was never turned on for the denied user.
    let mut c = server.client();
    let info: String = redis::cmd("INFO").arg("stats").query(&mut c).unwrap();
    let tracked = info
        .lines()
        .find_map(|l| l.strip_prefix("tracking_total_keys:"))
        .map(|n| n.trim().to_owned());
    assert_eq!(tracked.as_deref(), Some("0"));
}

#[test]
fn a_resign_that_could_not_be_sent_is_sent_again_once_the_server_answers() {
    let server = TestServer::builder().append_only().start();
    let prefix = unique_prefix("resign_later");
    let coord = coordinator(&server.url(), &prefix, NODE_TIMEOUT);
    let election = coord.election("{later}").unwrap();
    let ttl = Duration::from_secs(30);
    let leadership = election
        .try_campaign("me", ttl)
        .unwrap()
        .expect("no leader yet");
    // The server goes down; the resign cannot reach it.
    server.kill();
    let err = leadership.resign().unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    // Back with its data (the append-only file): the old leader is there,
    // until the resign sent in the background reaches it, long before the
    // lease's TTL.
    server.restart();
    let started = Instant::now();
    let watcher = coordinator(&server.url(), &prefix, NODE_TIMEOUT);
    let watched = watcher.election("{later}").unwrap();
    wait_until(
        Duration::from_secs(10),
        "the resigned leader to be gone",
        || watched.leader().is_ok_and(|l| l.is_none()),
    );
    assert!(started.elapsed() < ttl / 2);
}
