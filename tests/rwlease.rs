//! The reader/writer lease against real redis-server processes: exclusion
//! between 16 threads, writer preference against readers in two processes,
//! reader preference, intents withdrawn and left behind by a killed process,
//! per-reader expiry while others renew, and every refusal.

mod support;
use support::coordinator;
use support::ms;
use support::percentile;

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{
    CancelToken, ContentionEvent, Coordinator, Error, MAX_TTL, Observer, Preference, Primitive,
    ReadWriteLease, ReleaseOutcome,
};
use support::{
    ChildProc, block_on_stdin, env, local_instant, members, server_now, shared_server, snapshot,
    unique_prefix, wait_until,
};

/// Set in a copy of this binary that plays one role for a test.
const CHILD_ENV: &str = "RESPIRE_RW_CHILD";

const NODE_TIMEOUT: Duration = Duration::from_millis(200);

/// The tests that measure time take turns, so they do not measure each other.
fn timed() -> MutexGuard<'static, ()> {
    static TIMED: Mutex<()> = Mutex::new(());
    TIMED.lock().unwrap_or_else(|e| e.into_inner())
}

fn preference(name: &str) -> Preference {
    match name {
        "writer" => Preference::Writer,
        "reader" => Preference::Reader,
        other => panic!("unknown preference {other}"),
    }
}

// ---------------------------------------------------------------------------

#[derive(Default)]
struct Inside {
    readers: u32,
    writer: bool,
    last_token: u64,
    max_readers: u32,
    reads: u64,
    writes: Vec<u64>,
}

#[test]
fn sixteen_threads_of_readers_and_writers_never_overlap_a_writer() {
    let _timed = timed();
    let prefix = unique_prefix("mixed");
    let coords = [
        coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT),
        coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT),
    ];
    let rws: Vec<ReadWriteLease> = coords
        .iter()
        .map(|c| c.read_write_lease("{mixed}").unwrap())
        .collect();
    let inside = Mutex::new(Inside::default());
    let ttl = Duration::from_secs(10);
    let wait = Duration::from_secs(60);
    let started = Instant::now();
    thread::scope(|s| {
        for t in 0..16u64 {
            let rw = &rws[(t % 2) as usize];
            let inside = &inside;
            s.spawn(move || {
                let mut x = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for _ in 0..150 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let hold = Duration::from_micros(x % 2_000);
                    if x % 4 == 0 {
                        let g = rw.write().acquire_timeout(ttl, wait).unwrap().unwrap();
                        {
                            let mut i = inside.lock().unwrap();
                            assert!(!i.writer, "two writers at once");
                            assert_eq!(i.readers, 0, "a writer among readers");
                            let token = g.fencing_token().get();
                            assert!(token > i.last_token, "token {token} after {}", i.last_token);
                            i.last_token = token;
                            i.writer = true;
                            i.writes.push(token);
                        }
                        thread::sleep(hold);
                        inside.lock().unwrap().writer = false;
                        assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
                    } else {
                        let g = rw.read().acquire_timeout(ttl, wait).unwrap().unwrap();
                        {
                            let mut i = inside.lock().unwrap();
                            assert!(!i.writer, "a reader beside a writer");
                            assert_eq!(
                                g.write_epoch().get(),
                                i.last_token,
                                "the write epoch is not the last writer's token"
                            );
                            i.readers += 1;
                            i.reads += 1;
                            i.max_readers = i.max_readers.max(i.readers);
                        }
                        thread::sleep(hold);
                        inside.lock().unwrap().readers -= 1;
                        assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
                    }
                }
            });
        }
    });
    let i = inside.into_inner().unwrap();
    assert_eq!(i.reads + i.writes.len() as u64, 16 * 150);
    assert!(!i.writes.is_empty());
    assert!(i.max_readers >= 2, "readers never overlapped");
    assert!(i.writes.windows(2).all(|w| w[0] < w[1]));
    let fence: u64 = shared_server()
        .client()
        .get(format!("{prefix}{{mixed}}:fence"))
        .unwrap();
    assert_eq!(fence, *i.writes.last().unwrap());
    assert_eq!(fence, i.writes.len() as u64, "a token was skipped");
    println!(
        "16 threads on 2 coordinators: {} reads (up to {} at once), {} writes with tokens \
         1..={fence} in grant order, in {:?}",
        i.reads,
        i.max_readers,
        i.writes.len(),
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------
// Writer preference against overlapping readers in two processes.

const READERS_PER_PROCESS: u64 = 4;
const READ_HOLD: Duration = Duration::from_millis(50);

/// Readers that each hold for 50 ms and come straight back, started
/// `offset_ms + i × 12.5 ms` apart so that together they always hold the lease,
/// until `stop`. Returns how many reads they made.
fn run_readers(
    rw: &ReadWriteLease,
    offset_us: u64,
    stop: &AtomicBool,
    started: &AtomicUsize,
) -> u64 {
    thread::scope(|s| {
        let handles: Vec<_> = (0..READERS_PER_PROCESS)
            .map(|i| {
                let read = rw.read();
                s.spawn(move || {
                    thread::sleep(Duration::from_micros(offset_us + i * 12_500));
                    let mut reads = 0u64;
                    let mut first = true;
                    while !stop.load(Ordering::Relaxed) {
                        let Some(g) = read
                            .acquire_timeout(Duration::from_secs(5), ms(500))
                            .unwrap()
                        else {
                            continue;
                        };
                        if first {
                            started.fetch_add(1, Ordering::SeqCst);
                            first = false;
                        }
                        reads += 1;
                        thread::sleep(READ_HOLD);
                        g.release().unwrap();
                    }
                    reads
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    })
}

/// The child's half of the readers: runs until its stdin closes.
fn readers_child() {
    let coord = coordinator(
        &env("RESPIRE_RW_URL"),
        &env("RESPIRE_RW_PREFIX"),
        NODE_TIMEOUT,
    );
    let rw = coord
        .read_write_lease_with("{starve}", preference(&env("RESPIRE_RW_PREF")))
        .unwrap();
    let stop = AtomicBool::new(false);
    let started = AtomicUsize::new(0);
    let reads = thread::scope(|s| {
        let h = s.spawn(|| run_readers(&rw, 6_250, &stop, &started));
        wait_until(Duration::from_secs(10), "the child's readers", || {
            started.load(Ordering::SeqCst) == READERS_PER_PROCESS as usize
        });
        println!("@@ready");
        std::io::stdout().flush().unwrap();
        block_on_stdin();
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap()
    });
    println!("@@reads {reads}");
}

/// Eight readers, four here and four in a child process, always holding the
/// lease between them; `body` runs with them going and gets the parent's
/// stop flag. Returns what `body` returned.
fn with_readers_in_two_processes<T>(
    test: &str,
    pref: &str,
    body: impl FnOnce(&ReadWriteLease, &dyn Fn()) -> T,
) -> T {
    let prefix = unique_prefix(test);
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let rw = coord
        .read_write_lease_with("{starve}", preference(pref))
        .unwrap();
    let child = Mutex::new(Some(ChildProc::spawn(
        CHILD_ENV,
        test,
        "readers",
        &[
            ("RESPIRE_RW_URL", shared_server().url()),
            ("RESPIRE_RW_PREFIX", prefix.clone()),
            ("RESPIRE_RW_PREF", pref.to_owned()),
        ],
    )));
    child.lock().unwrap().as_mut().unwrap().expect("ready");
    let stop = AtomicBool::new(false);
    let started = AtomicUsize::new(0);
    let readers_key = rw.readers_key().to_owned();
    thread::scope(|s| {
        let readers = s.spawn(|| run_readers(&rw, 0, &stop, &started));
        // A failed check below stops the readers too, so that the test fails
        // instead of joining them forever.
        let _stop_on_failure = SetOnDrop(&stop);
        wait_until(Duration::from_secs(10), "the parent's readers", || {
            started.load(Ordering::SeqCst) == READERS_PER_PROCESS as usize
        });
        // The readers overlap: sampled every millisecond for 300 ms, and at
        // least 100 times however slowly the samples come, the reader set is
        // never empty.
        let mut c = shared_server().client();
        let t = Instant::now();
        let mut samples = 0;
        while t.elapsed() < ms(300) || samples < 100 {
            let n: u64 = c.zcard(&readers_key).unwrap();
            assert!(
                n > 0,
                "no reader held the lease at {:?} (sample {samples})",
                t.elapsed()
            );
            samples += 1;
            thread::sleep(ms(1));
        }
        let stop_all = || {
            stop.store(true, Ordering::Relaxed);
            if let Some(child) = child.lock().unwrap().take() {
                let out = child.finish();
                assert!(out.contains("@@reads "), "{out}");
            }
        };
        let result = body(&rw, &stop_all);
        stop_all();
        let reads = readers.join().unwrap();
        assert!(reads > 0);
        result
    })
}

#[test]
fn a_writer_is_not_starved_by_readers_in_two_processes() {
    const TEST: &str = "a_writer_is_not_starved_by_readers_in_two_processes";
    if std::env::var(CHILD_ENV).as_deref() == Ok("readers") {
        return readers_child();
    }
    let _timed = timed();
    let (mut waits, watched) = with_readers_in_two_processes(TEST, "writer", |rw, _| {
        let mut c = shared_server().client();
        let write = rw.write();
        let done = AtomicBool::new(false);
        thread::scope(|s| {
            let watcher = s.spawn(|| watch_writer_preference(rw, &done));
            let _done = SetOnDrop(&done);
            let mut waits = Vec::new();
            let mut last = 0;
            for trial in 0..100u64 {
                // Each trial starts with readers holding the lease.
                wait_until(Duration::from_secs(5), "readers back in", || {
                    c.zcard::<_, u64>(rw.readers_key()).unwrap() >= 2
                });
                thread::sleep(Duration::from_micros((trial * 7_919) % 20_000));
                let start = Instant::now();
                let g = write
                    .acquire_timeout(Duration::from_secs(5), Duration::from_secs(10))
                    .unwrap()
                    .expect("the writer got in");
                waits.push(start.elapsed());
                assert!(g.fencing_token().get() > last);
                last = g.fencing_token().get();
                thread::sleep(ms(2));
                assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
            }
            done.store(true, Ordering::SeqCst);
            (waits, watcher.join().unwrap())
        })
    });
    waits.sort();
    let (p50, p99, max) = (percentile(&waits, 0.5), percentile(&waits, 0.99), waits[99]);
    println!(
        "writer preference, 8 readers in 2 processes holding {READ_HOLD:?} each: writer wait \
         over 100 trials p50 {p50:?}, p99 {p99:?}, max {max:?}; {watched:?}"
    );
    // Not starved: while a waiting writer's intent stood, no reader was let
    // in; the readers it waited behind left, and it got in (each wait above).
    assert!(
        watched.admitted_past_intent.is_empty(),
        "readers let in past a waiting writer: {:?}",
        watched.admitted_past_intent
    );
    assert!(
        watched.writer_behind_readers > 0,
        "the writer was never seen waiting behind readers: {watched:?}"
    );
    assert!(
        watched.readers_admitted > 0,
        "no reader was seen coming in: {watched:?}"
    );
}

/// Counts the acquire calls of writers that found the lease held.
#[derive(Default)]
struct WriteContentions(AtomicUsize);

impl Observer for WriteContentions {
    fn contended(&self, event: &ContentionEvent<'_>) {
        if event.primitive == Primitive::Write {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// What [`watch_writer_preference`] saw.
#[derive(Debug, Default)]
struct Watched {
    samples: u64,
    /// Samples with a writer's intent recorded while readers held the lease.
    writer_behind_readers: u64,
    /// Readers seen coming in (absent from one sample, present in the next).
    readers_admitted: u64,
    /// Readers that came in between two samples that both held the same
    /// writer intent, with no write granted in between.
    admitted_past_intent: Vec<String>,
}

/// Samples the lease's keys on the server (readers, intents, fence, in one
/// transaction) until `done`: a reader that appears between two samples that
/// both show the same intent and the same fence was let in while a writer
/// waited, which writer preference forbids.
fn watch_writer_preference(rw: &ReadWriteLease, done: &AtomicBool) -> Watched {
    let mut c = shared_server().client();
    let mut w = Watched::default();
    let mut last: Option<(Vec<String>, Vec<String>, Option<u64>)> = None;
    while !done.load(Ordering::SeqCst) {
        let now: (Vec<String>, Vec<String>, Option<u64>) = redis::pipe()
            .atomic()
            .zrange(rw.readers_key(), 0, -1)
            .zrange(rw.intents_key(), 0, -1)
            .get(rw.fence_key())
            .query(&mut c)
            .unwrap();
        w.samples += 1;
        let (readers, intents, fence) = &now;
        if !intents.is_empty() && !readers.is_empty() {
            w.writer_behind_readers += 1;
        }
        if let Some((before, before_intents, before_fence)) = &last {
            let new: Vec<&String> = readers.iter().filter(|r| !before.contains(r)).collect();
            w.readers_admitted += new.len() as u64;
            let same_wait = !intents.is_empty() && intents == before_intents;
            if same_wait && fence == before_fence && !new.is_empty() {
                w.admitted_past_intent
                    .push(format!("{new:?} past intent {intents:?} (fence {fence:?})"));
            }
        }
        last = Some(now);
        thread::sleep(ms(1));
    }
    w
}

/// Sets the flag when dropped: a helper thread that runs until the flag is
/// set stops even when the test panics first.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn with_reader_preference_the_writer_waits_until_the_readers_stop() {
    const TEST: &str = "with_reader_preference_the_writer_waits_until_the_readers_stop";
    if std::env::var(CHILD_ENV).as_deref() == Ok("readers") {
        return readers_child();
    }
    let _timed = timed();
    let (watched, after_stop) = with_readers_in_two_processes(TEST, "reader", |rw, stop_all| {
        let write = rw.write();
        let ttl = Duration::from_secs(5);
        // One more reader holds the lease throughout, so that the reader set
        // is never empty however the overlapping readers are scheduled: a
        // writer that got in would have got in past a reader.
        let anchor = rw
            .read()
            .try_acquire(Duration::from_secs(60))
            .unwrap()
            .expect("readers share the lease");
        // Ten bounded waits while the readers keep coming and going; the
        // server's keys, sampled meanwhile, show them let in while the writer
        // waits, with no intent of the writer's recorded (reader preference
        // records none).
        let done = AtomicBool::new(false);
        let watched = thread::scope(|s| {
            let watcher = s.spawn(|| watch_writer_preference(rw, &done));
            let _done = SetOnDrop(&done);
            for _ in 0..10 {
                let got_in = write.acquire_timeout(ttl, ms(200)).unwrap();
                assert!(got_in.is_none(), "the writer got in past a reader");
            }
            done.store(true, Ordering::SeqCst);
            watcher.join().unwrap()
        });
        // One more wait, while the readers stop: they stop once the writer
        // was told the lease is held, and waits (its coordinator's observer
        // hears of that).
        let contended = Arc::new(WriteContentions::default());
        let observed = Coordinator::builder(&shared_server().url())
            .key_prefix(
                rw.writer_key()
                    .strip_suffix("{starve}:w")
                    .expect("the writer key of {starve}"),
            )
            .node_timeout(NODE_TIMEOUT)
            .observer(contended.clone())
            .build()
            .expect("connect");
        let observed_rw = observed
            .read_write_lease_with("{starve}", Preference::Reader)
            .unwrap();
        assert_eq!(observed_rw.writer_key(), rw.writer_key());
        let write = observed_rw.write();
        thread::scope(|s| {
            let waiting = s.spawn(|| {
                let start = Instant::now();
                let g = write.acquire_timeout(ttl, Duration::from_secs(10)).unwrap();
                (
                    g.expect("the writer got in once the readers stopped"),
                    start,
                    Instant::now(),
                )
            });
            wait_until(
                Duration::from_secs(5),
                "the writer to find the lease held by the readers",
                || contended.0.load(Ordering::SeqCst) > 0,
            );
            let stopping = Instant::now();
            anchor.release().unwrap();
            stop_all();
            let stopped = Instant::now();
            let (_g, start, granted) = waiting.join().unwrap();
            assert!(
                granted >= stopping,
                "the writer got in {:?} after it started, before the readers stopped",
                granted - start
            );
            (watched, (granted - stopping, stopped - stopping))
        })
    });
    println!(
        "reader preference: during 10 waits of 200 ms the writer stayed out and {} readers came \
         in ({} samples, {} with an intent beside readers); the last wait ended {:?} after the \
         readers were told to stop (the child's had all released after {:?})",
        watched.readers_admitted,
        watched.samples,
        watched.writer_behind_readers,
        after_stop.0,
        after_stop.1
    );
    assert_eq!(
        watched.writer_behind_readers, 0,
        "a writer's intent was recorded under reader preference"
    );
    // Each reader comes back about every 50 ms: some 300 in 2 s. Under writer
    // preference (the intents above say so first) some 50 came in, between
    // one wait and the next.
    assert!(
        watched.readers_admitted >= 100,
        "only {} readers came in while the writer waited",
        watched.readers_admitted
    );
}

#[test]
fn a_writer_that_times_out_lets_the_readers_it_held_back_in_at_once() {
    let _timed = timed();
    let prefix = unique_prefix("withdraw");
    let url = shared_server().url();
    let (ca, cb, cc) = (
        coordinator(&url, &prefix, NODE_TIMEOUT),
        coordinator(&url, &prefix, NODE_TIMEOUT),
        coordinator(&url, &prefix, NODE_TIMEOUT),
    );
    let base = "{wd}";
    let r1 = ca
        .read_write_lease(base)
        .unwrap()
        .read()
        .try_acquire(Duration::from_secs(10))
        .unwrap()
        .unwrap();
    let rw_b = cb.read_write_lease(base).unwrap();
    let rw_c = cc.read_write_lease(base).unwrap();
    let mut c = shared_server().client();
    let intents = rw_b.intents_key().to_owned();
    thread::scope(|s| {
        let writer = s.spawn(|| {
            let g = rw_b
                .write()
                .acquire_timeout(Duration::from_secs(10), ms(600))
                .unwrap();
            (g.is_none(), Instant::now())
        });
        wait_until(Duration::from_secs(2), "the writer's intent", || {
            c.zcard::<_, u64>(&intents).unwrap() == 1
        });
        // A new reader is held back by the intent…
        assert!(
            rw_c.read()
                .try_acquire(Duration::from_secs(10))
                .unwrap()
                .is_none()
        );
        let reader = s.spawn(|| {
            let g = rw_c
                .read()
                .acquire_timeout(Duration::from_secs(10), Duration::from_secs(5))
                .unwrap();
            (g.is_some(), Instant::now())
        });
        let (timed_out, writer_done) = writer.join().unwrap();
        assert!(timed_out, "the writer cannot get in past a reader");
        // …and the intent is gone by the time the writer's wait returns.
        assert_eq!(c.zcard::<_, u64>(&intents).unwrap(), 0);
        let (granted, reader_done) = reader.join().unwrap();
        assert!(granted);
        let after = reader_done.saturating_duration_since(writer_done);
        println!(
            "the held-back reader got in {after:?} after the waiting writer timed out (its \
             intent would have lasted 1 s)"
        );
        // Woken by the withdrawal, not held back until the intent's expiry.
        assert!(after < ms(900), "{after:?}");
    });
    drop(r1);
}

#[test]
fn a_cancelled_writer_withdraws_its_intent() {
    let prefix = unique_prefix("cancel");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let rw = coord.read_write_lease("{c}").unwrap();
    let _reader = rw
        .read()
        .try_acquire(Duration::from_secs(10))
        .unwrap()
        .unwrap();
    let cancel = CancelToken::new();
    let mut c = shared_server().client();
    thread::scope(|s| {
        let w = s.spawn(|| rw.write().acquire(Duration::from_secs(10), &cancel));
        wait_until(Duration::from_secs(2), "the intent", || {
            c.zcard::<_, u64>(rw.intents_key()).unwrap() == 1
        });
        cancel.cancel();
        assert!(matches!(w.join().unwrap(), Err(Error::Cancelled)));
    });
    assert_eq!(c.zcard::<_, u64>(rw.intents_key()).unwrap(), 0);
    // A reader gets in at once.
    assert!(
        rw.read()
            .try_acquire(Duration::from_secs(10))
            .unwrap()
            .is_some()
    );
}

/// A waiting writer whose last attempt runs past its deadline on a server that
/// stopped answering writes still returns within its documented bound — the
/// deadline plus one attempt (node timeout, plus the connect timeout) — intent
/// withdrawal included.
#[test]
fn a_waiting_writer_returns_within_its_bound_when_the_server_stops_answering() {
    let _timed = timed();
    let server = support::TestServer::start();
    let node_timeout = ms(1_000);
    let connect_timeout = ms(100);
    let coord = Coordinator::builder(&server.url())
        .node_timeout(node_timeout)
        .connect_timeout(connect_timeout)
        .build()
        .unwrap();
    let rw = coord.read_write_lease("{stop}").unwrap();
    let mut admin = server.client();
    // A reader the writer waits behind, set by hand so that the test can
    // take it away in the same transaction that pauses writes.
    let (now_ms, _) = server_now(&mut admin);
    let _: () = admin
        .zadd(rw.readers_key(), "held-by-hand", now_ms + 60_000)
        .unwrap();
    let wait = ms(1_500);
    thread::scope(|s| {
        let called = Instant::now();
        let writer = s.spawn(|| {
            let r = rw.write().acquire_timeout(Duration::from_secs(10), wait);
            (r.map(|g| g.is_some()), Instant::now())
        });
        wait_until(Duration::from_secs(2), "the writer's intent", || {
            admin.zcard::<_, u64>(rw.intents_key()).unwrap() == 1
        });
        // Half a node timeout before the deadline, the reader leaves (which
        // wakes the writer) and the server stops answering writes: the
        // writer's last attempt runs until half a node timeout past the
        // deadline.
        let deadline = called + wait;
        thread::sleep((deadline - node_timeout / 2).saturating_duration_since(Instant::now()));
        let mut pipe = redis::pipe();
        pipe.atomic()
            .zrem(rw.readers_key(), "held-by-hand")
            .ignore()
            .cmd("CLIENT")
            .arg("PAUSE")
            .arg(10_000)
            .arg("WRITE")
            .ignore();
        let _: () = pipe.query(&mut admin).unwrap();
        // The writes stay paused for 10 s: the wait returns while they are,
        // not once the server answers again.
        wait_until(
            Duration::from_secs(8),
            "the writer's wait to return while writes are paused",
            || writer.is_finished(),
        );
        let (granted, returned) = writer.join().unwrap();
        assert!(
            !matches!(granted, Ok(true)),
            "granted while writes were paused"
        );
        // How close it came to its bound is a figure, not a check.
        let bound = deadline + node_timeout + connect_timeout;
        println!(
            "the writer returned {:?} after its deadline ({granted:?}); bound {:?}, over it by \
             {:?}",
            returned - deadline,
            bound - deadline,
            returned.saturating_duration_since(bound)
        );
    });
    let _: () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query(&mut admin)
        .unwrap();
    // The intent is withdrawn once the server answers again.
    wait_until(Duration::from_secs(3), "the intent to be withdrawn", || {
        admin.zcard::<_, u64>(rw.intents_key()).unwrap() == 0
    });
}

// ---------------------------------------------------------------------------
// kill -9 of a process holding a read lease or a writer intent.

const KILL_TTL: Duration = Duration::from_secs(1);

#[test]
fn a_killed_readers_lease_ends_at_its_own_expiry_while_another_renews() {
    const TEST: &str = "a_killed_readers_lease_ends_at_its_own_expiry_while_another_renews";
    if std::env::var(CHILD_ENV).as_deref() == Ok("hold-read") {
        let coord = coordinator(
            &env("RESPIRE_RW_URL"),
            &env("RESPIRE_RW_PREFIX"),
            NODE_TIMEOUT,
        );
        let rw = coord.read_write_lease("{kill}").unwrap();
        let g = rw.read().try_acquire(KILL_TTL).unwrap().unwrap();
        let _alive = g.keep_alive().unwrap();
        println!("@@held");
        std::io::stdout().flush().unwrap();
        block_on_stdin();
        return;
    }
    let _timed = timed();
    let prefix = unique_prefix("killread");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let rw = coord.read_write_lease("{kill}").unwrap();
    let mut c = shared_server().client();
    let writer_coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let write = writer_coord.read_write_lease("{kill}").unwrap().write();
    thread::scope(|s| {
        let live = rw.read().try_acquire(KILL_TTL).unwrap().unwrap();
        let alive = live.keep_alive().unwrap();
        let ours = members(&mut c, rw.readers_key());
        let mut child = ChildProc::spawn(
            CHILD_ENV,
            TEST,
            "hold-read",
            &[
                ("RESPIRE_RW_URL", shared_server().url()),
                ("RESPIRE_RW_PREFIX", prefix.clone()),
            ],
        );
        child.expect("held");
        let writer = s.spawn(|| {
            let g = write
                .acquire_timeout(Duration::from_secs(5), Duration::from_secs(10))
                .unwrap()
                .expect("the writer got in");
            (Instant::now(), g)
        });
        wait_until(Duration::from_secs(2), "the writer to wait", || {
            c.zcard::<_, u64>(rw.intents_key()).unwrap() == 1
        });
        // Let both readers renew a few times.
        let t = Instant::now();
        while t.elapsed() < ms(1_100) {
            assert!(!live.is_lost());
            thread::sleep(ms(10));
        }
        let killed = child.kill9();
        let clock = server_now(&mut c);
        let theirs = members(&mut c, rw.readers_key())
            .into_iter()
            .find(|m| !ours.iter().any(|o| o.0 == m.0))
            .expect("the killed reader is still in the set");
        let expiry = local_instant(theirs.1, clock);
        // The live reader keeps renewing past the kill, then leaves.
        while killed.elapsed() < ms(300) {
            assert!(!live.is_lost());
            thread::sleep(ms(10));
        }
        drop(alive);
        assert_eq!(live.release().unwrap(), ReleaseOutcome::Released);
        let (granted, _g) = writer.join().unwrap();
        let after_kill = granted - killed;
        println!(
            "kill -9 of a reader (TTL {KILL_TTL:?}) while another renewed: the writer got in \
             {after_kill:?} after the kill, {:?} after the dead reader's expiry",
            granted.saturating_duration_since(expiry)
        );
        // How soon after the expiry it got in is the figure above; that it
        // got in at all is its wait's deadline.
        assert!(
            granted + ms(3) >= expiry,
            "the writer got in {:?} before the dead reader expired",
            expiry - granted
        );
    });
}

#[test]
fn a_killed_waiting_writers_intent_holds_readers_back_until_it_expires() {
    const TEST: &str = "a_killed_waiting_writers_intent_holds_readers_back_until_it_expires";
    if std::env::var(CHILD_ENV).as_deref() == Ok("wait-write") {
        let coord = coordinator(
            &env("RESPIRE_RW_URL"),
            &env("RESPIRE_RW_PREFIX"),
            NODE_TIMEOUT,
        );
        let rw = coord.read_write_lease("{kill}").unwrap();
        println!("@@waiting");
        std::io::stdout().flush().unwrap();
        let g = rw
            .write()
            .acquire_timeout(KILL_TTL, Duration::from_secs(60));
        panic!("the writer was meant to wait until killed: {g:?}");
    }
    let _timed = timed();
    let prefix = unique_prefix("killintent");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let rw = coord.read_write_lease("{kill}").unwrap();
    let mut c = shared_server().client();
    let live = rw.read().try_acquire(KILL_TTL).unwrap().unwrap();
    let _alive = live.keep_alive().unwrap();
    let mut child = ChildProc::spawn(
        CHILD_ENV,
        TEST,
        "wait-write",
        &[
            ("RESPIRE_RW_URL", shared_server().url()),
            ("RESPIRE_RW_PREFIX", prefix.clone()),
        ],
    );
    child.expect("waiting");
    wait_until(Duration::from_secs(5), "the child's intent", || {
        c.zcard::<_, u64>(rw.intents_key()).unwrap() == 1
    });
    // The intent is refreshed while the reader renews and the writer waits.
    let first = members(&mut c, rw.intents_key())[0].1;
    wait_until(Duration::from_secs(3), "a refreshed intent", || {
        members(&mut c, rw.intents_key())[0].1 > first
    });
    let reader_coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let read = reader_coord.read_write_lease("{kill}").unwrap().read();
    assert!(read.try_acquire(KILL_TTL).unwrap().is_none(), "held back");
    thread::scope(|s| {
        let reader = s.spawn(|| {
            let g = read
                .acquire_timeout(KILL_TTL, Duration::from_secs(10))
                .unwrap()
                .expect("the reader got in");
            (Instant::now(), g)
        });
        let killed = child.kill9();
        let clock = server_now(&mut c);
        let intent = members(&mut c, rw.intents_key());
        let expiry = local_instant(intent[0].1, clock);
        let (granted, _g) = reader.join().unwrap();
        assert!(!live.is_lost(), "the live reader kept renewing");
        let after_kill = granted - killed;
        println!(
            "kill -9 of a waiting writer (TTL {KILL_TTL:?}): the held-back reader got in \
             {after_kill:?} after the kill, {:?} after the intent's expiry",
            granted.saturating_duration_since(expiry)
        );
        // How soon after the expiry it got in is the figure above; that it
        // got in at all is its wait's deadline.
        assert!(
            granted + ms(3) >= expiry,
            "the reader got in {:?} before the intent expired",
            expiry - granted
        );
    });
}

// ---------------------------------------------------------------------------

#[test]
fn grants_carry_tokens_and_epochs_and_guards_do_everything_a_guard_does() {
    let prefix = unique_prefix("guards");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let rw = coord.read_write_lease("{g}:doc").unwrap();
    assert_eq!(rw.preference(), Preference::Writer);
    assert_eq!(rw.writer_key(), format!("{prefix}{{g}}:doc:w"));
    assert_eq!(rw.readers_key(), format!("{prefix}{{g}}:doc:r"));
    assert_eq!(rw.intents_key(), format!("{prefix}{{g}}:doc:q"));
    assert_eq!(rw.fence_key(), format!("{prefix}{{g}}:doc:fence"));
    let ttl = Duration::from_secs(5);

    let r = rw.read().try_acquire(ttl).unwrap().unwrap();
    assert_eq!(r.write_epoch().get(), 0, "no writer yet");
    assert_eq!(r.key(), rw.readers_key());
    assert!(rw.write().try_acquire(ttl).unwrap().is_none());
    let left = r.verify_still_held().unwrap().unwrap();
    assert!(left > ms(4_000) && left <= ttl, "{left:?}");
    assert!(r.reset_expiry(Duration::from_secs(30)).unwrap());
    assert!(r.verify_still_held().unwrap().unwrap() > ms(25_000));
    let text = format!("{r:?}");
    assert!(
        text.starts_with("ReadGuard") && text.contains("write_epoch"),
        "{text}"
    );
    assert_eq!(r.release().unwrap(), ReleaseOutcome::Released);
    // No intent from try_acquire: nothing was left behind.
    let mut c = shared_server().client();
    assert!(!c.exists::<_, bool>(rw.intents_key()).unwrap());

    let w = rw.write().try_acquire(ttl).unwrap().unwrap();
    assert_eq!(w.fencing_token().get(), 1);
    assert_eq!(w.key(), rw.writer_key());
    assert!(rw.read().try_acquire(ttl).unwrap().is_none());
    assert!(rw.write().try_acquire(ttl).unwrap().is_none());
    assert!(w.verify_still_held().unwrap().is_some());
    let text = format!("{w:?}");
    assert!(
        text.starts_with("WriteGuard") && text.contains("fencing_token"),
        "{text}"
    );
    drop(w);
    let r = rw.read().try_acquire(ttl).unwrap().unwrap();
    assert_eq!(r.write_epoch().get(), 1, "the last writer's token");
    drop(r);
    let w = rw.write().try_acquire(ttl).unwrap().unwrap();
    assert_eq!(w.fencing_token().get(), 2);
    drop(w);
    assert!(
        c.keys::<_, Vec<String>>(format!("{prefix}*")).unwrap() == vec![rw.fence_key().to_owned()]
    );
    let text = format!("{rw:?} {:?} {:?}", rw.read(), rw.write());
    assert!(
        text.contains("ReadWriteLease")
            && text.contains("ReadLease")
            && text.contains("WriteLease"),
        "{text}"
    );
}

#[test]
fn an_expired_reader_never_comes_back_and_the_others_keep_theirs() {
    let prefix = unique_prefix("expired");
    let coord = Coordinator::builder(&shared_server().url())
        .key_prefix(&prefix)
        .node_timeout(ms(50))
        .build()
        .unwrap();
    let rw = coord.read_write_lease("{e}").unwrap();
    let short = rw.read().try_acquire(ms(300)).unwrap().unwrap();
    let long = rw
        .read()
        .try_acquire(Duration::from_secs(30))
        .unwrap()
        .unwrap();
    let mut c = shared_server().client();
    let short_expiry = members(&mut c, rw.readers_key())
        .iter()
        .map(|m| m.1)
        .min()
        .unwrap();
    wait_until(Duration::from_secs(3), "the short reader's expiry", || {
        server_now(&mut c).0 > short_expiry
    });
    // Still in the set (nobody pruned it), but expired.
    assert_eq!(members(&mut c, rw.readers_key()).len(), 2);
    assert!(
        !short.reset_expiry(Duration::from_secs(30)).unwrap(),
        "it came back"
    );
    assert!(short.is_lost());
    assert_eq!(short.verify_still_held().unwrap(), None);
    assert_eq!(short.release().unwrap(), ReleaseOutcome::Expired);
    assert!(long.verify_still_held().unwrap().is_some());
    assert_eq!(members(&mut c, rw.readers_key()).len(), 1);
}

#[test]
fn reader_preference_lets_readers_past_a_waiting_writer() {
    let prefix = unique_prefix("readerpref");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    let writer_side = coord.read_write_lease("{p}").unwrap();
    let reader_side = coord
        .read_write_lease_with("{p}", Preference::Reader)
        .unwrap();
    assert_eq!(reader_side.preference(), Preference::Reader);
    let _r = reader_side
        .read()
        .try_acquire(Duration::from_secs(10))
        .unwrap()
        .unwrap();
    let mut c = shared_server().client();
    thread::scope(|s| {
        let w = s.spawn(|| {
            writer_side
                .write()
                .acquire_timeout(Duration::from_secs(10), ms(400))
                .unwrap()
        });
        wait_until(Duration::from_secs(2), "the intent", || {
            c.zcard::<_, u64>(writer_side.intents_key()).unwrap() == 1
        });
        // Held back under writer preference, let in under reader preference.
        assert!(
            writer_side
                .read()
                .try_acquire(Duration::from_secs(10))
                .unwrap()
                .is_none()
        );
        assert!(
            reader_side
                .read()
                .try_acquire(Duration::from_secs(10))
                .unwrap()
                .is_some()
        );
        assert!(w.join().unwrap().is_none());
    });
    // A reader-preference writer records no intent.
    let mut c2 = shared_server().client();
    thread::scope(|s| {
        let w = s.spawn(|| {
            reader_side
                .write()
                .acquire_timeout(Duration::from_secs(10), ms(200))
                .unwrap()
        });
        // Sampled for as long as the writer waits, however late it starts.
        let mut samples = 0;
        while !w.is_finished() {
            assert_eq!(c2.zcard::<_, u64>(reader_side.intents_key()).unwrap(), 0);
            samples += 1;
            thread::sleep(ms(5));
        }
        assert!(w.join().unwrap().is_none());
        println!("no intent in {samples} samples while the writer waited");
    });
}

#[test]
fn every_refusal_is_clear_and_changes_nothing() {
    let prefix = unique_prefix("refuse");
    let coord = coordinator(&shared_server().url(), &prefix, NODE_TIMEOUT);
    for base in ["", "doc", "{}doc", "doc{", "}doc{x"] {
        let e = coord.read_write_lease(base).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{base:?}: {e}");
        assert!(
            coord
                .read_write_lease_with(base, Preference::Reader)
                .is_err(),
            "{base:?}"
        );
    }
    let e = coord.read_write_lease("doc").unwrap_err();
    assert!(e.to_string().contains("hash tag"), "{e}");

    // TTLs out of range: nothing is sent.
    let rw = coord.read_write_lease("{ttl}").unwrap();
    for ttl in [Duration::ZERO, NODE_TIMEOUT, MAX_TTL + ms(1), Duration::MAX] {
        for e in [
            rw.read().try_acquire(ttl).unwrap_err(),
            rw.write().try_acquire(ttl).unwrap_err(),
            rw.write().acquire_timeout(ttl, ms(100)).unwrap_err(),
        ] {
            assert!(matches!(e, Error::InvalidArgument(_)), "{ttl:?}: {e}");
        }
    }
    let mut c = shared_server().client();
    assert!(
        c.keys::<_, Vec<String>>(format!("{prefix}*"))
            .unwrap()
            .is_empty()
    );

    // Keys of the wrong type or content: (what, setup on [w, r, q, fence],
    // the key the error must name, words it must contain).
    type Setup = fn(&mut redis::Connection, &[String; 4]);
    let cases: &[(&str, Setup, usize, &str)] = &[
        (
            "writer lease a hash",
            |c, k| c.hset(&k[0], "f", "v").unwrap(),
            0,
            "hash",
        ),
        (
            "reader set a string",
            |c, k| c.set(&k[1], "v").unwrap(),
            1,
            "string",
        ),
        (
            "intent set a list",
            |c, k| c.rpush(&k[2], "v").unwrap(),
            2,
            "list",
        ),
        (
            "fence a hash",
            |c, k| c.hset(&k[3], "f", "v").unwrap(),
            3,
            "hash",
        ),
        (
            "fence with a ttl",
            |c, k| c.set_ex(&k[3], 7, 100).unwrap(),
            3,
            "expiry",
        ),
        (
            "fence not an integer",
            |c, k| c.set(&k[3], "seven").unwrap(),
            3,
            "integer",
        ),
        (
            "fence negative",
            |c, k| c.set(&k[3], "-1").unwrap(),
            3,
            "integer",
        ),
    ];
    for (i, (what, setup, bad, words)) in cases.iter().enumerate() {
        let base = format!("{{bad{i}}}");
        let rw = coord.read_write_lease(&base).unwrap();
        let keys = [
            rw.writer_key().to_owned(),
            rw.readers_key().to_owned(),
            rw.intents_key().to_owned(),
            rw.fence_key().to_owned(),
        ];
        // A live reader and an expired one, so a script that wrote before
        // checking would show (unless the reader set is the bad key).
        if *bad != 1 {
            let now = server_now(&mut c).0;
            let _: () = c
                .zadd_multiple(&keys[1], &[(now - 1_000, "dead"), (now + 60_000, "live")])
                .unwrap();
        }
        setup(&mut c, &keys);
        let scope = format!("{prefix}{base}");
        let before = snapshot(&mut c, &scope);
        let mut errors = vec![
            rw.read().try_acquire(Duration::from_secs(5)).unwrap_err(),
            rw.write().try_acquire(Duration::from_secs(5)).unwrap_err(),
            rw.write()
                .acquire_timeout(Duration::from_secs(5), ms(300))
                .unwrap_err(),
            rw.read()
                .acquire_timeout(Duration::from_secs(5), ms(300))
                .unwrap_err(),
        ];
        if *bad == 0 || *bad == 3 {
            errors.push(
                coord
                    .read_write_lease_with(&base, Preference::Reader)
                    .unwrap()
                    .read()
                    .try_acquire(Duration::from_secs(5))
                    .unwrap_err(),
            );
        }
        for e in errors {
            match &e {
                Error::BadKey { key, problem } => {
                    assert_eq!(key, &keys[*bad], "{what}: {e}");
                    assert!(problem.contains(words), "{what}: {e}");
                    assert!(!problem.contains("KEYS["), "{what}: {e}");
                }
                other => panic!("{what}: expected BadKey, got {other}"),
            }
            assert!(e.to_string().contains("nothing was changed"), "{e}");
        }
        assert_eq!(
            snapshot(&mut c, &scope),
            before,
            "{what}: something changed"
        );
    }
}

#[test]
fn what_an_unanswered_acquire_may_have_set_is_deleted_afterwards() {
    let server = support::TestServer::start();
    let proxy = support::FaultProxy::start(server.addr());
    let coord = Coordinator::builder(&proxy.url())
        .node_timeout(NODE_TIMEOUT)
        .connect_timeout(ms(300))
        .build()
        .unwrap();
    let rw = coord.read_write_lease("{lost}").unwrap();
    let ttl = Duration::from_secs(30);
    // Load the scripts and open the pooled connection.
    drop(rw.read().try_acquire(ttl).unwrap().unwrap());
    drop(rw.write().try_acquire(ttl).unwrap().unwrap());
    let mut c = server.client();

    // A reader and a writer granted on the server, their replies lost.
    for (what, key) in [("reader", rw.readers_key()), ("writer", rw.writer_key())] {
        // A pooled connection opened while replies get through.
        drop(rw.read().try_acquire(ttl).unwrap().unwrap());
        proxy.set_mode(support::Mode::DropServerToClient);
        let e = if what == "reader" {
            rw.read().try_acquire(ttl).unwrap_err()
        } else {
            rw.write().try_acquire(ttl).unwrap_err()
        };
        assert!(e.is_uncertain(), "{what}: {e}");
        assert!(
            c.exists::<_, bool>(key).unwrap(),
            "{what}: granted on the server"
        );
        proxy.set_mode(support::Mode::Pass);
        wait_until(Duration::from_secs(10), "the clean-up", || {
            !c.exists::<_, bool>(key).unwrap()
        });
    }

    // A waiting writer's intent, refreshed by an attempt whose reply was lost
    // (a wait records one once its first attempt found the lease held).
    let reader = rw.read().try_acquire(ttl).unwrap().unwrap();
    assert!(reader.verify_still_held().unwrap().is_some());
    // No deadline: the wait retries what fails until it is cancelled, so the
    // refresh below is neither raced by a timeout nor withdrawn.
    let cancel = CancelToken::new();
    thread::scope(|s| {
        // A failed check below ends the wait too, so that the test fails
        // instead of joining the writer forever.
        let _stop = support::CancelOnDrop(&cancel);
        let writer = s.spawn(|| rw.write().acquire(ttl, &cancel));
        // The writer's intent, and the connection its attempts go out on: the
        // one with tracking on (its invalidations redirected to the
        // subscriber) that has run an attempt, so every reply to it from now
        // on is an attempt's.
        let mut port = None;
        wait_until(Duration::from_secs(10), "the writer's intent", || {
            let tracked: Vec<u16> = support::client_list(&mut c)
                .iter()
                .filter(|f| f.get("redir").is_some_and(|r| r != "-1"))
                .filter(|f| f.get("cmd").is_some_and(|c| c == "evalsha"))
                .filter_map(|f| f.get("addr")?.rsplit_once(':')?.1.parse().ok())
                .collect();
            assert!(tracked.len() <= 1, "one tracked connection: {tracked:?}");
            port = tracked.first().copied();
            port.is_some() && c.zcard::<_, u64>(rw.intents_key()).unwrap() > 0
        });
        let port = port.expect("found above");
        let dropped = proxy
            .server_chunks_dropped_to(port)
            .expect("the tracked connection goes through the proxy");
        // Its next attempt, the intent's refresh, gets no reply (nor do the
        // connections it opens afterwards, so nothing withdraws the intent).
        // The reply of the attempt that recorded the intent may still be on
        // its way now and be lost instead: then that attempt is the
        // unanswered one, and no refresh follows. Either way a reply to that
        // connection is dropped (and the writer closes it once its node
        // timeout passed without one).
        proxy.set_mode(support::Mode::DropServerToClient);
        wait_until(Duration::from_secs(10), "an unanswered attempt", || {
            proxy
                .server_chunks_dropped_to(port)
                .is_none_or(|n| n > dropped)
        });
        cancel.cancel();
        assert!(matches!(writer.join().unwrap(), Err(Error::Cancelled)));
    });
    proxy.set_mode(support::Mode::Pass);
    wait_until(Duration::from_secs(10), "the intent's clean-up", || {
        c.zcard::<_, u64>(rw.intents_key()).unwrap() == 0
    });
    assert!(
        reader.verify_still_held().unwrap().is_some(),
        "the reader stays"
    );
    // The intent may be withdrawn before the unanswered attempts' connections
    // are killed (the withdrawal and the clean-up are separate jobs).
    wait_until(
        Duration::from_secs(10),
        "the unanswered attempts' connections to be killed",
        || coord.renewal_stats().killed_connections >= 3,
    );
}

#[test]
fn a_waiting_writers_intent_is_refreshed_while_readers_hold_longer_than_it_lives() {
    let server = shared_server();
    let prefix = unique_prefix("intent_refresh");
    let coord = coordinator(&server.url(), &prefix, NODE_TIMEOUT);
    let other = coordinator(&server.url(), &prefix, NODE_TIMEOUT);
    let lease = coord.read_write_lease("{i}base").unwrap();
    // A reader whose TTL (6 s) is far longer than a waiting writer's intent
    // (1 s with this node timeout).
    let reader = lease.read().try_acquire(ms(6_000)).unwrap().expect("free");
    let intents = lease.intents_key().to_owned();
    thread::scope(|s| {
        let writer = s.spawn(|| lease.write().acquire_timeout(ms(2_000), ms(10_000)));
        let mut conn = server.client();
        wait_until(ms(5_000), "the writer's intent", || {
            conn.zcard::<_, u64>(&intents).unwrap() == 1
        });
        // For three of the intent's lifetimes, no new reader gets in.
        let readers = other.read_write_lease("{i}base").unwrap();
        let start = Instant::now();
        while start.elapsed() < ms(3_000) {
            let got = readers.read().try_acquire(ms(1_000)).unwrap();
            assert!(
                got.is_none(),
                "a new reader got in {:?} after the writer began to wait",
                start.elapsed()
            );
            thread::sleep(ms(50));
        }
        drop(reader);
        let granted = writer.join().unwrap().unwrap();
        assert!(
            granted.is_some(),
            "the writer was granted once the reader left"
        );
    });
}
