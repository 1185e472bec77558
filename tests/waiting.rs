//! Blocking acquisition: waiters woken by client-tracking invalidations and by a
//! timer at the holder's expiry, without polling or lost wake-ups, and the
//! polling fallback when tracking is unavailable.
//!
//! Timing bounds here are deliberately generous (the machine is shared); each
//! test prints the figures it measured.

mod support;
use support::Rng;
use support::coordinator;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use redis::Commands;
use respire_coordination::{CancelToken, Coordinator, Error, ReleaseOutcome};
use support::{
    FaultProxy, TestServer, calls, command_calls, script_calls, shared_server, unique_prefix,
    wait_until,
};

const LONG_TTL: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------
// Observing the server and the log
// ---------------------------------------------------------------------------

/// `INFO stats` total_commands_processed (this `INFO` included).
fn total_commands(admin: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(admin).expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("total_commands_processed")
}

/// Waits until the server has run no acquire script for `quiet` in a row:
/// every waiter has made its attempts and is asleep.
fn wait_for_quiet(admin: &mut redis::Connection, quiet: Duration, within: Duration) {
    let started = Instant::now();
    let mut last = script_calls(admin);
    loop {
        thread::sleep(quiet);
        let now = script_calls(admin);
        if now == last {
            return;
        }
        assert!(
            started.elapsed() < within,
            "waiters still attempting after {within:?}"
        );
        last = now;
    }
}

/// `CLIENT LIST` as one map of fields per connection.
fn client_list(server: &TestServer) -> Vec<HashMap<String, String>> {
    support::client_list(&mut server.client())
}

/// The connections this crate opened (named `respire`, `respire-renewal`,
/// `respire-tracking`), by name.
fn respire_connections(server: &TestServer) -> HashMap<String, usize> {
    let mut by_name = HashMap::new();
    for c in client_list(server) {
        if let Some(name) = c.get("name").filter(|n| n.starts_with("respire")) {
            *by_name.entry(name.clone()).or_insert(0) += 1;
        }
    }
    by_name
}

/// The ids of the invalidation subscribers connected to `server`.
fn subscriber_ids(server: &TestServer) -> Vec<String> {
    client_list(server)
        .into_iter()
        .filter(|c| c.get("name").is_some_and(|n| n == "respire-tracking"))
        .filter_map(|c| c.get("id").cloned())
        .collect()
}

/// Whether some command connection redirects its invalidations to `id`.
fn redirects_to(server: &TestServer, id: &str) -> bool {
    client_list(server).iter().any(|c| {
        c.get("name").is_some_and(|n| n == "respire") && c.get("redir").is_some_and(|r| r == id)
    })
}

/// Captures this binary's log records, so tests can check what was logged.
struct Capture {
    lines: Mutex<Vec<String>>,
}

impl log::Log for Capture {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            let line = format!("{} {}", record.level(), record.args());
            self.lines.lock().unwrap().push(line);
        }
    }

    fn flush(&self) {}
}

static CAPTURE: Capture = Capture {
    lines: Mutex::new(Vec::new()),
};

fn capture_logs() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        log::set_logger(&CAPTURE).expect("no other logger");
        log::set_max_level(log::LevelFilter::Info);
    });
}

/// Logged lines containing every one of `parts`.
fn logged(parts: &[&str]) -> Vec<String> {
    CAPTURE
        .lines
        .lock()
        .unwrap()
        .iter()
        .filter(|l| parts.iter().all(|p| l.contains(p)))
        .cloned()
        .collect()
}

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

/// A short random pause: nothing, a yield, a spin or a sleep of up to `max_us`.
fn jitter(rng: &mut Rng, max_us: u64) {
    match rng.below(4) {
        0 => {}
        1 => thread::yield_now(),
        2 => {
            let until = Instant::now() + Duration::from_micros(rng.below(max_us));
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        }
        _ => thread::sleep(Duration::from_micros(rng.below(max_us))),
    }
}

/// p50, p99 and max of `samples`, in milliseconds.
fn summary(samples: &mut [Duration]) -> String {
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples[i].as_secs_f64() * 1e3
    };
    format!(
        "n={} p50={:.3} ms p99={:.3} ms max={:.3} ms",
        samples.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    )
}

// ---------------------------------------------------------------------------
// Woken by the timer at the holder's expiry
// ---------------------------------------------------------------------------

#[test]
fn a_crashed_holder_is_followed_at_its_expiry_despite_20000_other_ttl_keys() {
    let server = TestServer::builder().arg("--hz").arg("100").start();
    let mut admin = server.client();
    // 20,000 other keys with TTLs between 1 and 600 seconds: the server's
    // expiry notifications for our key come late behind them.
    let (mut rng, _) = Rng::seeded("20000 other keys");
    for chunk in 0..20 {
        let mut pipe = redis::pipe();
        for i in 0..1000 {
            pipe.cmd("SET")
                .arg(format!("filler:{chunk}:{i}"))
                .arg("x")
                .arg("PX")
                .arg(1000 + rng.below(599_000))
                .ignore();
        }
        let () = pipe.query(&mut admin).expect("fill");
    }
    let expires: String = redis::cmd("INFO")
        .arg("keyspace")
        .query(&mut admin)
        .unwrap();
    assert!(expires.contains("expires=20000"), "{expires}");

    let coord = coordinator(&server.url(), "crash:", Duration::from_millis(500));
    let lock = coord.lock("job").unwrap();
    let fenced = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    let ttl = Duration::from_millis(1200);
    let mut lateness = Vec::new();
    for round in 0..6 {
        let fenced_round = round % 2 == 1;
        let key = if fenced_round {
            "crash:{f}:lease"
        } else {
            "crash:job"
        };
        // The holder "crashes": it sets its lease and never releases it.
        let sent = Instant::now();
        let () = redis::cmd("SET")
            .arg(key)
            .arg("crashed-holder")
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .query(&mut admin)
            .unwrap();
        let expiry = sent + ttl;
        let acquired_at = if fenced_round {
            let g = fenced
                .acquire_timeout(Duration::from_secs(10), Duration::from_secs(10))
                .unwrap()
                .expect("acquired after the holder's expiry");
            let at = Instant::now();
            assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
            at
        } else {
            let g = lock
                .acquire(Duration::from_secs(10), &CancelToken::new())
                .unwrap();
            let at = Instant::now();
            assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
            at
        };
        assert!(
            acquired_at >= expiry,
            "acquired {:?} before the holder's lease could have expired",
            expiry - acquired_at
        );
        lateness.push(acquired_at - expiry);
    }
    println!(
        "acquired after a crashed holder's expiry (20,000 other TTL keys, hz 100): {}",
        summary(&mut lateness)
    );
    assert!(
        lateness.iter().all(|l| *l < Duration::from_millis(500)),
        "{lateness:?}"
    );
}

// ---------------------------------------------------------------------------
// Scale: one subscriber and a small pool, however many waiters
// ---------------------------------------------------------------------------

#[test]
fn a_thousand_waiters_on_a_thousand_keys_share_a_few_connections_and_do_not_poll() {
    const WAITERS: usize = 1000;
    let server = TestServer::start();
    let mut admin = server.client();
    // A thousand releases at once go through the pool's few connections one
    // after another, and each may wait for one up to the node timeout: with
    // every other test running beside this one, 500 ms was seen to pass.
    let coord = Coordinator::builder(&server.url())
        .key_prefix("many:")
        .node_timeout(Duration::from_secs(5))
        .build()
        .expect("connect");
    // Held elsewhere for ten minutes: only a release can free them.
    let mut pipe = redis::pipe();
    for i in 0..WAITERS {
        pipe.cmd("SET")
            .arg(format!("many:k{i}"))
            .arg("holder")
            .arg("PX")
            .arg(600_000)
            .ignore();
    }
    let () = pipe.query(&mut admin).unwrap();
    let before = respire_connections(&server);
    let cancel = CancelToken::new();
    let acquired = AtomicUsize::new(0);
    let errors = Mutex::new(Vec::new());
    let last_acquired = Mutex::new(Instant::now());
    let baseline = script_calls(&mut admin);
    thread::scope(|s| {
        for i in 0..WAITERS {
            let lock = coord.lock(&format!("k{i}")).unwrap();
            let (cancel, acquired, errors, last) = (&cancel, &acquired, &errors, &last_acquired);
            thread::Builder::new()
                .stack_size(256 * 1024)
                .spawn_scoped(s, move || match lock.acquire(LONG_TTL, cancel) {
                    Ok(guard) => {
                        *last.lock().unwrap() = Instant::now();
                        acquired.fetch_add(1, Ordering::SeqCst);
                        assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
                    }
                    Err(e) => errors.lock().unwrap().push(e.to_string()),
                })
                .expect("spawn a waiter");
        }
        wait_until(
            Duration::from_secs(60),
            "every waiter's first attempt",
            || {
                !errors.lock().unwrap().is_empty()
                    || script_calls(&mut admin) - baseline >= WAITERS as u64
            },
        );
        wait_for_quiet(
            &mut admin,
            Duration::from_millis(300),
            Duration::from_secs(30),
        );
        assert!(
            errors.lock().unwrap().is_empty(),
            "{:?}",
            errors.lock().unwrap()
        );
        let during = respire_connections(&server);

        // Nobody releases for two seconds: the server should hear next to nothing.
        let window = Duration::from_secs(2);
        let start = total_commands(&mut admin);
        let scripts_start = script_calls(&mut admin);
        thread::sleep(window);
        let scripts_end = script_calls(&mut admin);
        let end = total_commands(&mut admin);
        // Minus this window's own three INFO commands before the last one.
        let heard = end - start - 3;
        println!(
            "{WAITERS} waiters: connections before {before:?}, while waiting {during:?}; \
             {heard} commands ({} acquire attempts) in {window:?} with nobody releasing",
            scripts_end - scripts_start
        );
        assert!(heard < 100, "{heard} commands while nobody released");
        let total: usize = during.values().sum();
        assert!(total <= 10, "{during:?}");
        assert_eq!(during.get("respire-tracking"), Some(&1), "{during:?}");

        // Every holder releases at once: every waiter is woken and acquires.
        let released = Instant::now();
        let mut pipe = redis::pipe();
        for i in 0..WAITERS {
            pipe.cmd("DEL").arg(format!("many:k{i}")).ignore();
        }
        let () = pipe.query(&mut admin).unwrap();
        wait_until(Duration::from_secs(60), "every waiter to acquire", || {
            acquired.load(Ordering::SeqCst) + errors.lock().unwrap().len() == WAITERS
        });
        println!(
            "all {WAITERS} acquired within {:?} of the release",
            *last_acquired.lock().unwrap() - released
        );
    });
    assert!(
        errors.lock().unwrap().is_empty(),
        "{:?}",
        errors.lock().unwrap()
    );
    assert_eq!(acquired.load(Ordering::SeqCst), WAITERS);
    let after = respire_connections(&server);
    println!("connections after: {after:?}");
    assert!(after.values().sum::<usize>() <= 10, "{after:?}");
}

#[test]
fn waiters_wait_for_a_pooled_connection_instead_of_failing() {
    const WAITERS: usize = 10;
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    // One connection, and every round trip on it takes 80 ms: of ten waiters
    // that start together, only three get it within the 250 ms node timeout.
    // (The margin between a round trip and the node timeout is kept wide: a
    // round trip that outlasts it breaks the connection, which is another test.)
    let coord = Coordinator::builder(&proxy.url())
        .key_prefix("burst:")
        .node_timeout(Duration::from_millis(250))
        .pool_size(1)
        .build()
        .unwrap();
    proxy.set_mode(support::Mode::Delay(Duration::from_millis(40)));
    let mut pipe = redis::pipe();
    for i in 0..WAITERS {
        pipe.cmd("SET")
            .arg(format!("burst:k{i}"))
            .arg("holder")
            .arg("PX")
            .arg(600_000)
            .ignore();
    }
    let () = pipe.query(&mut admin).unwrap();
    let baseline = script_calls(&mut admin);
    let outcomes = Mutex::new(Vec::new());
    let start = std::sync::Barrier::new(WAITERS);
    thread::scope(|s| {
        for i in 0..WAITERS {
            let lock = coord.lock(&format!("k{i}")).unwrap();
            let (start, outcomes) = (&start, &outcomes);
            s.spawn(move || {
                start.wait();
                let r = lock.acquire_timeout(LONG_TTL, Duration::from_secs(60));
                // A release takes at most one node timeout in all, a free
                // connection included; with one connection shared by ten, it
                // may find none in time (nothing sent: an error, not "uncertain").
                let r = r.map(|g| {
                    g.map(|g| match g.release() {
                        Ok(outcome) => Ok(outcome),
                        Err(Error::PoolTimeout(_) | Error::Connect { .. }) => {
                            Err("no connection for the release in time")
                        }
                        Err(e) => panic!("release: {e}"),
                    })
                });
                outcomes.lock().unwrap().push(r.map_err(|e| e.to_string()));
            });
        }
        wait_until(
            Duration::from_secs(60),
            "every waiter's first attempt",
            || {
                !outcomes.lock().unwrap().is_empty()
                    || script_calls(&mut admin) - baseline >= WAITERS as u64
            },
        );
        let mut pipe = redis::pipe();
        for i in 0..WAITERS {
            pipe.cmd("DEL").arg(format!("burst:k{i}")).ignore();
        }
        let () = pipe.query(&mut admin).unwrap();
    });
    let outcomes = outcomes.into_inner().unwrap();
    let failed: Vec<_> = outcomes
        .iter()
        .filter(|r| !matches!(r, Ok(Some(_))))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {WAITERS}: {failed:?}",
        failed.len()
    );
}

// ---------------------------------------------------------------------------
// No lost wake-up
// ---------------------------------------------------------------------------

#[test]
fn ten_thousand_release_wait_races_lose_no_wake_up() {
    const PAIRS: usize = 4;
    const RACES: usize = 10_000;
    let prefix = unique_prefix("races");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(500));
    let (_, seed) = Rng::seeded("races");
    let latencies = Mutex::new(Vec::with_capacity(RACES));
    let started = Instant::now();
    thread::scope(|s| {
        for pair in 0..PAIRS {
            let lock = coord.lock(&format!("k{pair}")).unwrap();
            let fenced = coord
                .fenced_lock(&format!("{{f{pair}}}:lease"), &format!("{{f{pair}}}:fence"))
                .unwrap();
            // Rendezvous channels rather than barriers, so that when one side
            // fails the other one stops instead of waiting for ever.
            let (start_tx, start_rx) = mpsc::sync_channel::<()>(0);
            let (done_tx, done_rx) = mpsc::sync_channel::<()>(0);
            let released_at = Mutex::new(Instant::now());
            let latencies = &latencies;
            s.spawn(move || {
                let (lock, fenced, released_at) = (&lock, &fenced, &released_at);
                thread::scope(|s| {
                    // The holder: takes the lock, lets the waiter start, releases
                    // after a random pause.
                    s.spawn(move || {
                        let mut rng = Rng::new(seed ^ ((pair as u64 + 1) * 0x9e37_79b9));
                        for race in 0..RACES / PAIRS {
                            let use_fenced = race % 2 == 1;
                            let lg = (!use_fenced)
                                .then(|| lock.try_acquire(LONG_TTL).unwrap().expect("lock free"));
                            let fg = use_fenced.then(|| {
                                fenced.try_acquire(LONG_TTL).unwrap().expect("lease free")
                            });
                            if start_tx.send(()).is_err() {
                                return;
                            }
                            jitter(&mut rng, 400);
                            *released_at.lock().unwrap() = Instant::now();
                            let outcome = match (lg, fg) {
                                (Some(g), _) => g.release(),
                                (_, Some(g)) => g.release(),
                                _ => unreachable!(),
                            };
                            assert_eq!(outcome.unwrap(), ReleaseOutcome::Released);
                            if done_rx.recv().is_err() {
                                return;
                            }
                        }
                    });
                    // The waiter: starts waiting after a random pause, with one of
                    // the three waiting verbs, and must get the lock once it is free.
                    s.spawn(move || {
                        let mut rng = Rng::new(seed ^ ((pair as u64 + 1) * 0x85eb_ca6b));
                        let cancel = CancelToken::new();
                        let wait = Duration::from_secs(5);
                        for race in 0..RACES / PAIRS {
                            let use_fenced = race % 2 == 1;
                            if start_rx.recv().is_err() {
                                return;
                            }
                            jitter(&mut rng, 400);
                            let verb = rng.below(3);
                            let lost = || -> ! {
                                panic!("race {race} on pair {pair}: lost wake-up (seed {seed:#x})")
                            };
                            let (acquired_at, outcome) = if use_fenced {
                                let g = match verb {
                                    0 => fenced.acquire_timeout(LONG_TTL, wait),
                                    1 => fenced.acquire(LONG_TTL, &cancel).map(Some),
                                    _ => fenced.acquire_deadline(LONG_TTL, Instant::now() + wait),
                                };
                                let g = g.unwrap().unwrap_or_else(|| lost());
                                (Instant::now(), g.release())
                            } else {
                                let g = match verb {
                                    0 => lock.acquire_timeout(LONG_TTL, wait),
                                    1 => lock.acquire(LONG_TTL, &cancel).map(Some),
                                    _ => lock.acquire_deadline(LONG_TTL, Instant::now() + wait),
                                };
                                let g = g.unwrap().unwrap_or_else(|| lost());
                                (Instant::now(), g.release())
                            };
                            let latency =
                                acquired_at.saturating_duration_since(*released_at.lock().unwrap());
                            assert_eq!(outcome.unwrap(), ReleaseOutcome::Released);
                            latencies.lock().unwrap().push(latency);
                            if done_tx.send(()).is_err() {
                                return;
                            }
                        }
                    });
                });
            });
        }
    });
    let mut latencies = latencies.into_inner().unwrap();
    println!(
        "{RACES} release/wait races in {:?}; release sent to the waiter holding the lock: {}",
        started.elapsed(),
        summary(&mut latencies)
    );
    assert_eq!(latencies.len(), RACES);
}

// ---------------------------------------------------------------------------
// Cancellation and deadlines
// ---------------------------------------------------------------------------

#[test]
fn cancellation_during_a_wait_returns_promptly() {
    const THREADS: usize = 10;
    const ROUNDS: usize = 20;
    let prefix = unique_prefix("cancel");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(500));
    let latencies = Mutex::new(Vec::new());
    thread::scope(|s| {
        for t in 0..THREADS {
            let lock = coord.lock(&format!("k{t}")).unwrap();
            let latencies = &latencies;
            s.spawn(move || {
                let _held = lock.try_acquire(LONG_TTL).unwrap().unwrap();
                let (mut rng, _) = Rng::seeded("cancel while waiting");
                for _ in 0..ROUNDS {
                    let cancel = CancelToken::new();
                    let cancelled_at = Mutex::new(None);
                    thread::scope(|s| {
                        let waiter = s.spawn(|| {
                            let r = lock.acquire(LONG_TTL, &cancel);
                            (r, Instant::now())
                        });
                        thread::sleep(Duration::from_millis(1 + rng.below(30)));
                        *cancelled_at.lock().unwrap() = Some(Instant::now());
                        cancel.cancel();
                        // The holder keeps the lock for LONG_TTL: only the
                        // cancellation ends this wait.
                        wait_until(
                            Duration::from_secs(5),
                            "the cancelled wait to return",
                            || waiter.is_finished(),
                        );
                        let (r, returned) = waiter.join().unwrap();
                        assert!(matches!(r, Err(Error::Cancelled)), "{r:?}");
                        let at = cancelled_at.lock().unwrap().unwrap();
                        latencies.lock().unwrap().push(returned - at);
                    });
                }
            });
        }
    });
    let mut latencies = latencies.into_inner().unwrap();
    let text = summary(&mut latencies);
    println!("cancel() to Err(Cancelled): {text}");
}

#[test]
fn acquire_timeout_returns_promptly_after_its_wait() {
    const THREADS: usize = 10;
    const ROUNDS: usize = 20;
    let prefix = unique_prefix("deadline");
    let coord = coordinator(&shared_server().url(), &prefix, Duration::from_millis(500));
    let overruns = Mutex::new(Vec::new());
    thread::scope(|s| {
        for t in 0..THREADS {
            let lock = coord.lock(&format!("k{t}")).unwrap();
            let overruns = &overruns;
            s.spawn(move || {
                let _held = lock.try_acquire(LONG_TTL).unwrap().unwrap();
                let (mut rng, _) = Rng::seeded("wait overruns");
                for round in 0..ROUNDS {
                    let wait = Duration::from_millis(1 + rng.below(60));
                    let started = Instant::now();
                    let got = if round % 2 == 0 {
                        lock.acquire_timeout(LONG_TTL, wait).unwrap()
                    } else {
                        lock.acquire_deadline(LONG_TTL, started + wait).unwrap()
                    };
                    let took = started.elapsed();
                    assert!(got.is_none(), "the lock is held");
                    assert!(took >= wait, "returned {:?} early", wait - took);
                    overruns.lock().unwrap().push(took - wait);
                }
            });
        }
    });
    let mut overruns = overruns.into_inner().unwrap();
    let text = summary(&mut overruns);
    println!("acquire_timeout overrun past its wait: {text}");
    assert!(
        *overruns.last().unwrap() < Duration::from_millis(250),
        "{text}"
    );
}

#[test]
fn a_zero_wait_is_exactly_one_attempt_and_starts_no_subscriber() {
    let server = TestServer::start();
    let mut admin = server.client();
    let coord = coordinator(&server.url(), "zero:", Duration::from_millis(500));
    let lock = coord.lock("job").unwrap();
    let fenced = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    let _held = lock.try_acquire(LONG_TTL).unwrap().unwrap();
    let _held_fenced = fenced.try_acquire(LONG_TTL).unwrap().unwrap();
    let before = script_calls(&mut admin);
    assert!(
        lock.acquire_timeout(LONG_TTL, Duration::ZERO)
            .unwrap()
            .is_none()
    );
    assert_eq!(script_calls(&mut admin) - before, 1);
    let past = Instant::now() - Duration::from_millis(10);
    assert!(lock.acquire_deadline(LONG_TTL, past).unwrap().is_none());
    assert_eq!(script_calls(&mut admin) - before, 2);
    assert!(
        fenced
            .acquire_timeout(LONG_TTL, Duration::ZERO)
            .unwrap()
            .is_none()
    );
    assert_eq!(script_calls(&mut admin) - before, 3);
    assert!(
        subscriber_ids(&server).is_empty(),
        "{:?}",
        client_list(&server)
    );
    // And a free lock is granted by that one attempt.
    let free = coord.lock("free").unwrap();
    let g = free.acquire_timeout(LONG_TTL, Duration::ZERO).unwrap();
    assert!(g.is_some());
    assert_eq!(script_calls(&mut admin) - before, 4);
}

/// The commands run since `before`, by name (those run at least once).
fn calls_since(
    admin: &mut redis::Connection,
    before: &HashMap<String, u64>,
) -> std::collections::BTreeMap<String, u64> {
    command_calls(admin)
        .into_iter()
        .map(|(name, n)| {
            let since = n - before.get(&name).copied().unwrap_or(0);
            (name, since)
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// Keys the server tracks for client-side caching (`INFO stats`): every one
/// costs an invalidation when it next changes.
fn tracked_keys(admin: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(admin).expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("tracking_total_keys:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("tracking_total_keys")
}

#[test]
fn a_wait_that_finds_the_key_free_costs_what_one_attempt_costs() {
    let server = TestServer::start();
    let mut admin = server.client();
    let coord = Coordinator::builder(&server.url())
        .key_prefix("free:")
        .node_timeout(Duration::from_millis(500))
        .pool_size(1)
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    let fenced = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    let rw = coord.read_write_lease("{rw}").unwrap();
    let sem = coord.semaphore("{sem}", 2).unwrap();
    let cancel = CancelToken::new();
    let tracking = ["client|tracking", "client|caching"];
    let try_pair = |what: &str| match what {
        "lock" => lock.try_acquire(LONG_TTL).unwrap().map(|g| g.release()),
        "fenced" => fenced.try_acquire(LONG_TTL).unwrap().map(|g| g.release()),
        "read" => rw
            .read()
            .try_acquire(LONG_TTL)
            .unwrap()
            .map(|g| g.release()),
        "write" => rw
            .write()
            .try_acquire(LONG_TTL)
            .unwrap()
            .map(|g| g.release()),
        _ => sem.try_acquire(LONG_TTL).unwrap().map(|g| g.release()),
    };
    // The commands (those scripts run included) of a waiting acquire and its
    // release are those of a single attempt and its release; nothing is
    // tracked, so the release invalidates nothing.
    let check = |admin: &mut redis::Connection, what: &str| {
        let before = command_calls(admin);
        assert_eq!(try_pair(what).unwrap().unwrap(), ReleaseOutcome::Released);
        let single = calls_since(admin, &before);
        let before = command_calls(admin);
        let acquired = match what {
            "lock" => lock.acquire(LONG_TTL, &cancel).map(|g| g.release()),
            "fenced" => fenced.acquire(LONG_TTL, &cancel).map(|g| g.release()),
            "read" => rw.read().acquire(LONG_TTL, &cancel).map(|g| g.release()),
            "write" => rw.write().acquire(LONG_TTL, &cancel).map(|g| g.release()),
            _ => sem.acquire(LONG_TTL, &cancel).map(|g| g.release()),
        };
        assert_eq!(acquired.unwrap().unwrap(), ReleaseOutcome::Released);
        assert_eq!(calls_since(admin, &before), single, "{what}");
        assert_eq!(tracked_keys(admin), 0, "{what}");
    };
    // The first use of each script loads it (`EVALSHA`, then `EVAL`).
    for what in ["lock", "fenced", "read", "write", "permit"] {
        let _ = try_pair(what);
    }
    for what in ["lock", "fenced", "read", "write", "permit"] {
        check(&mut admin, what);
    }
    assert_eq!(calls(&mut admin, &tracking), 0);
    assert!(
        subscriber_ids(&server).is_empty(),
        "{:?}",
        client_list(&server)
    );
    // A wait that found the lock held turns tracking on for its connection
    // (the only one in the pool) and has its read tracked...
    let () = admin.set_ex("free:job", "holder", 600).unwrap();
    let released = AtomicBool::new(false);
    thread::scope(|s| {
        let waiter = s.spawn(|| {
            let g = lock.acquire(LONG_TTL, &cancel).unwrap();
            assert!(released.load(Ordering::SeqCst), "granted while held");
            g.release().unwrap()
        });
        wait_until(
            Duration::from_secs(10),
            "the waiter to arm tracking",
            || tracked_keys(&mut admin) == 1,
        );
        released.store(true, Ordering::SeqCst);
        let () = admin.del("free:job").unwrap();
        assert_eq!(waiter.join().unwrap(), ReleaseOutcome::Released);
    });
    assert!(calls(&mut admin, &tracking) >= 1);
    assert_eq!(subscriber_ids(&server).len(), 1);
    // ...and later uncontended waits on that same connection track nothing.
    wait_until(
        Duration::from_secs(10),
        "the grant's read to be invalidated",
        || tracked_keys(&mut admin) == 0,
    );
    for what in ["lock", "fenced", "read", "write", "permit"] {
        check(&mut admin, what);
    }
}

/// A release lands after the server ran a waiter's first (plain) attempt and
/// before the waiter has turned tracking on: its reply is held back by the
/// proxy meanwhile. The waiter must see the release (its next attempt gets the
/// lease) rather than sleep until its deadline; the holder's key has no
/// expiry the waiter knows of, and the wait is long.
fn a_release_before_tracking_is_not_missed(
    what: &str,
    key: &str,
    attempts: &[&str],
    expected: u64,
    acquire: impl FnOnce() -> Option<ReleaseOutcome> + Send,
    proxy: &FaultProxy,
    admin: &mut redis::Connection,
) {
    let () = admin
        .set_ex(key, "someone else", 600)
        .expect("hold the key");
    let before = calls(admin, attempts);
    proxy.set_mode(support::Mode::DelayServerToClient(Duration::from_millis(
        200,
    )));
    thread::scope(|s| {
        let waiter = s.spawn(acquire);
        wait_until(
            Duration::from_secs(10),
            "the server to run the first attempt",
            || calls(admin, attempts) > before,
        );
        let () = admin.del(key).expect("release");
        let acquired = waiter.join().expect("waiter");
        proxy.set_mode(support::Mode::Pass);
        assert_eq!(
            acquired,
            Some(ReleaseOutcome::Released),
            "{what}: the release before tracking was missed"
        );
    });
    // The plain attempt and the tracked one that got the lease (and the
    // release, when it is the same command).
    assert_eq!(calls(admin, attempts) - before, expected, "{what}");
}

#[test]
fn a_release_between_the_first_attempt_and_tracking_wakes_the_waiter() {
    let server = TestServer::start();
    let proxy = FaultProxy::start(server.addr());
    let mut admin = server.client();
    let coord = coordinator(&proxy.url(), "window:", Duration::from_millis(500));
    let lock = coord.lock("job").unwrap();
    let fenced = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    // The subscriber is up (a wait that ran out started it), so a lost
    // release would not be rescued by polling.
    let () = admin.set_ex("window:job", "holder", 600).unwrap();
    assert!(
        lock.acquire_timeout(LONG_TTL, Duration::from_millis(300))
            .unwrap()
            .is_none()
    );
    assert_eq!(subscriber_ids(&server).len(), 1);
    // The release scripts are loaded (`EVALSHA`, then `EVAL`, the first time).
    let () = admin.del("window:job").unwrap();
    lock.try_acquire(LONG_TTL)
        .unwrap()
        .unwrap()
        .release()
        .unwrap();
    fenced
        .try_acquire(LONG_TTL)
        .unwrap()
        .unwrap()
        .release()
        .unwrap();
    let wait = Duration::from_secs(30);
    a_release_before_tracking_is_not_missed(
        "Lock",
        "window:job",
        &["set"],
        2,
        || {
            lock.acquire_timeout(LONG_TTL, wait)
                .unwrap()
                .map(|g| g.release().unwrap())
        },
        &proxy,
        &mut admin,
    );
    a_release_before_tracking_is_not_missed(
        "FencedLock",
        "window:{f}:lease",
        &["evalsha", "eval"],
        3,
        || {
            fenced
                .acquire_timeout(LONG_TTL, wait)
                .unwrap()
                .map(|g| g.release().unwrap())
        },
        &proxy,
        &mut admin,
    );
}

#[test]
fn a_token_cancelled_before_the_call_sends_nothing() {
    let server = TestServer::start();
    let mut admin = server.client();
    let coord = coordinator(&server.url(), "early:", Duration::from_millis(500));
    let lock = coord.lock("job").unwrap();
    let fenced = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    let cancel = CancelToken::new();
    cancel.cancel();
    let before = total_commands(&mut admin);
    assert!(matches!(
        lock.acquire(LONG_TTL, &cancel),
        Err(Error::Cancelled)
    ));
    assert!(matches!(
        fenced.acquire(LONG_TTL, &cancel),
        Err(Error::Cancelled)
    ));
    // Nothing but the first INFO in between.
    assert_eq!(total_commands(&mut admin) - before, 1);
    let keys: Vec<String> = admin.keys("*").unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

// ---------------------------------------------------------------------------
// Faults: transport errors, lost replies, a dropped subscriber, a restart
// ---------------------------------------------------------------------------

#[test]
fn a_killed_server_ends_a_bounded_wait_with_its_error_and_an_unbounded_wait_rides_it_out() {
    let server = TestServer::start();
    let mut admin = server.client();
    let coord = coordinator(&server.url(), "killed:", Duration::from_millis(500));
    let lock = coord.lock("job").unwrap();
    let fenced = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    let () = admin.set_ex("killed:job", "holder", 600).unwrap();
    let () = admin.set_ex("killed:{f}:lease", "holder", 600).unwrap();
    let cancel = CancelToken::new();
    thread::scope(|s| {
        let _stop = support::CancelOnDrop(&cancel);
        let bounded = s.spawn(|| {
            let r = lock.acquire_timeout(LONG_TTL, Duration::from_secs(3));
            (r.map(|g| g.is_some()), Instant::now())
        });
        let unbounded = s.spawn(|| {
            let r = fenced.acquire(LONG_TTL, &cancel);
            (r.map(|g| g.fencing_token().get()), Instant::now())
        });
        wait_until(Duration::from_secs(10), "both waiters to attempt", || {
            script_calls(&mut admin) >= 2
        });
        wait_until(Duration::from_secs(10), "the subscriber", || {
            !subscriber_ids(&server).is_empty()
        });
        let killed = Instant::now();
        server.kill();
        // The bounded wait keeps trying until its deadline, then reports the
        // last failure: never "held by someone else" for a server that is gone.
        let (bounded, b_at) = bounded.join().unwrap();
        let err = bounded.expect_err("the last error, not Ok(None)");
        assert!(
            err.is_retryable() && !matches!(err, Error::Cancelled),
            "{err}"
        );
        println!("bounded wait: {err} after {:?}", b_at - killed);
        assert!(b_at - killed < Duration::from_secs(10));
        // The unbounded one is still waiting; the server comes back without
        // the holder's lease (no persistence), and it acquires.
        assert!(!unbounded.is_finished(), "the unbounded wait gave up");
        server.restart();
        let restarted = Instant::now();
        let (unbounded, u_at) = unbounded.join().unwrap();
        let token = unbounded.expect("the unbounded wait acquires after the restart");
        println!(
            "unbounded wait acquired token {token} {:?} after the restart",
            u_at - restarted
        );
        assert!(u_at - restarted < Duration::from_secs(10));
    });
}

#[test]
fn an_attempt_whose_reply_was_lost_is_recovered_or_cleaned_up() {
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    let coord = Coordinator::builder(&proxy.url())
        .key_prefix("lost:")
        .node_timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    // Load the scripts, so each attempt below is one EVALSHA.
    drop(
        coord
            .lock("warm-up")
            .unwrap()
            .try_acquire(LONG_TTL)
            .unwrap(),
    );
    drop(
        coord
            .fenced_lock("{w}:lease", "{w}:fence")
            .unwrap()
            .try_acquire(LONG_TTL)
            .unwrap(),
    );
    // With the connection reset after the lost reply, the wait retries on a
    // fresh connection and, the acquire script being idempotent for its owner,
    // gets back the very grant it lost. With the connection left hanging, the
    // attempt times out, and the wait does the same on a new connection.
    for (fenced_round, reset) in [(false, true), (true, false), (true, true)] {
        let key = if fenced_round {
            "lost:{f}:lease"
        } else {
            "lost:job"
        };
        // A crashed holder whose lease expires in a moment; the waiter's timer
        // fires then, and its attempt is granted, but the reply never arrives.
        let () = redis::cmd("SET")
            .arg(key)
            .arg("crashed-holder")
            .arg("PX")
            .arg(3000)
            .query(&mut admin)
            .unwrap();
        let baseline = script_calls(&mut admin);
        let fence_before: Option<i64> = admin.get("lost:{f}:fence").unwrap();
        thread::scope(|s| {
            let waiter = thread::Builder::new()
                .name("lost-waiter".to_owned())
                .spawn_scoped(s, || {
                    if fenced_round {
                        let lock = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
                        lock.acquire_timeout(LONG_TTL, Duration::from_secs(20))
                            .map(|g| g.is_some())
                    } else {
                        let lock = coord.lock("job").unwrap();
                        lock.acquire(LONG_TTL, &CancelToken::new()).map(|_| true)
                    }
                })
                .unwrap();
            // Its attempts reached the server, its connection is tracked by
            // the subscriber (which a round's reset made reconnect), and it
            // heard the "busy" reply of the attempt that armed the tracking:
            // its thread, seen after the redirect, no longer reads a socket
            // but sleeps on a futex, until the expiry timer.
            wait_until(
                Duration::from_secs(10),
                "the waiter to hear its tracked attempt's reply",
                || {
                    script_calls(&mut admin) >= baseline + 2
                        && subscriber_ids(&server)
                            .first()
                            .is_some_and(|id| redirects_to(&server, id))
                        && asleep_on_futex("lost-waiter")
                },
            );
            proxy.set_mode(support::Mode::DropServerToClient);
            wait_until(
                Duration::from_secs(10),
                "the waiter's attempt to be granted",
                || {
                    let v: Option<String> = admin.get(key).unwrap();
                    v.is_some_and(|v| v != "crashed-holder")
                },
            );
            if reset {
                // The grant's reply was dropped; now the connection breaks.
                proxy.reset_all();
                proxy.set_mode(support::Mode::Pass);
                let granted = waiter.join().unwrap().expect("the grant is recovered");
                assert!(granted);
            } else {
                // The reply is gone for good but the connection stays open: the
                // attempt times out, a retryable error; the wait tries again on
                // a new connection with the same owner and gets the grant back.
                proxy.set_mode(support::Mode::Pass);
                let granted = waiter.join().unwrap().expect("the grant is recovered");
                assert!(granted);
            }
        });
        // The recovered guard was dropped with the waiter's thread: either way
        // nothing is left behind.
        let left: Option<String> = admin.get(key).unwrap();
        assert_eq!(left, None, "the lost grant was left behind");
        if fenced_round {
            // One increment for the one grant: a retry re-issues the same token.
            let after: Option<i64> = admin.get("lost:{f}:fence").unwrap();
            assert_eq!(after.unwrap_or(0), fence_before.unwrap_or(0) + 1);
        }
    }
}

#[test]
fn waiters_are_woken_after_the_subscriber_connection_is_killed() {
    let server = TestServer::start();
    let mut admin = server.client();
    let coord = coordinator(&server.url(), "kill:", Duration::from_millis(500));
    let lock = coord.lock("job").unwrap();
    let () = admin.set_ex("kill:job", "holder", 600).unwrap();
    thread::scope(|s| {
        let waiter = s.spawn(|| {
            let r = lock.acquire(LONG_TTL, &CancelToken::new());
            (r.map(|g| g.release()), Instant::now())
        });
        wait_until(
            Duration::from_secs(10),
            "a subscriber the waiter uses",
            || {
                subscriber_ids(&server)
                    .first()
                    .is_some_and(|id| redirects_to(&server, id))
            },
        );
        let old = subscriber_ids(&server);
        let killed: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("pubsub")
            .query(&mut admin)
            .unwrap();
        assert_eq!(killed, 1);
        // A new subscriber, and the waiter's connection redirects to it.
        wait_until(
            Duration::from_secs(10),
            "the subscriber to reconnect",
            || {
                subscriber_ids(&server)
                    .first()
                    .is_some_and(|id| !old.contains(id) && redirects_to(&server, id))
            },
        );
        wait_for_quiet(
            &mut admin,
            Duration::from_millis(300),
            Duration::from_secs(10),
        );
        // Tracking again, so no polling.
        let before = script_calls(&mut admin);
        thread::sleep(Duration::from_secs(1));
        let attempts = script_calls(&mut admin) - before;
        println!("{attempts} attempts in 1 s after the subscriber came back");
        assert!(attempts <= 1, "still polling: {attempts} attempts in 1 s");
        let released = Instant::now();
        let () = admin.del("kill:job").unwrap();
        // The holder's key had 600 s left and the wait has no deadline: only
        // the release wakes it.
        wait_until(Duration::from_secs(5), "the waiter to be woken", || {
            waiter.is_finished()
        });
        let (r, at) = waiter.join().unwrap();
        assert_eq!(r.unwrap().unwrap(), ReleaseOutcome::Released);
        println!("woken {:?} after the release", at - released);
    });
}

#[test]
fn a_waiter_whose_tracked_connection_breaks_still_wakes_on_release() {
    let server = TestServer::start();
    let mut admin = server.client();
    let proxy = FaultProxy::start(server.addr());
    // One pooled connection: the waiter's attempts arm tracking on it.
    let coord = Coordinator::builder(&proxy.url())
        .key_prefix("broken:")
        .node_timeout(Duration::from_millis(300))
        .pool_size(1)
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    let other = coord.lock("other").unwrap();
    let () = admin.set_ex("broken:job", "holder", 600).unwrap();
    thread::scope(|s| {
        let waiter = s.spawn(|| {
            let r = lock.acquire_timeout(LONG_TTL, Duration::from_secs(20));
            (r.map(|g| g.map(|g| g.release())), Instant::now())
        });
        wait_until(Duration::from_secs(10), "the waiter to be tracked", || {
            subscriber_ids(&server)
                .first()
                .is_some_and(|id| redirects_to(&server, id))
        });
        wait_for_quiet(
            &mut admin,
            Duration::from_millis(200),
            Duration::from_secs(10),
        );
        let tracked_before: Vec<_> = client_list(&server)
            .into_iter()
            .filter(|c| c.get("name").is_some_and(|n| n == "respire"))
            .filter_map(|c| c.get("id").cloned())
            .collect();
        // Another call on the same connection gets no reply in time, so the
        // connection, and the tracking it carried, is discarded. The proxy
        // stamps that command with a 1 s delay as it reads it; once it has,
        // traffic passes again, so the waiter's re-check that follows is not
        // delayed. The assertion below shows the call did time out.
        let chunks = proxy.client_chunks();
        proxy.set_mode(support::Mode::Delay(Duration::from_secs(1)));
        let timed_out = s.spawn(|| other.try_acquire(LONG_TTL));
        wait_until(
            Duration::from_secs(5),
            "the other call's command to reach the proxy",
            || proxy.client_chunks() > chunks,
        );
        proxy.set_mode(support::Mode::Pass);
        let err = timed_out
            .join()
            .unwrap()
            .expect_err("no reply within the node timeout");
        assert!(err.is_timeout(), "{err}");
        wait_until(
            Duration::from_secs(10),
            "the broken connection to close",
            || {
                !client_list(&server)
                    .iter()
                    .any(|c| c.get("id").is_some_and(|id| tracked_before.contains(id)))
            },
        );
        wait_for_quiet(
            &mut admin,
            Duration::from_millis(200),
            Duration::from_secs(10),
        );
        let released = Instant::now();
        let () = admin.del("broken:job").unwrap();
        // The holder's key had 600 s left and the wait 20 s: woken by the
        // release, not left asleep.
        wait_until(Duration::from_secs(5), "the waiter to be woken", || {
            waiter.is_finished()
        });
        let (r, at) = waiter.join().unwrap();
        let outcome = r.unwrap().expect("woken by the release, not left asleep");
        assert_eq!(outcome.unwrap(), ReleaseOutcome::Released);
        println!(
            "woken {:?} after the release, its first connection gone",
            at - released
        );
    });
}

#[test]
fn waits_use_tracking_again_after_a_server_restart() {
    let server = TestServer::start();
    let mut admin = server.client();
    // One pooled connection: the one that dies with the server.
    let coord = Coordinator::builder(&server.url())
        .key_prefix("restart:")
        .node_timeout(Duration::from_millis(500))
        .pool_size(1)
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    let () = admin.set_ex("restart:job", "holder", 600).unwrap();
    thread::scope(|s| {
        let waiter = s.spawn(|| lock.acquire_timeout(LONG_TTL, Duration::from_secs(30)));
        wait_until(Duration::from_secs(10), "the waiter to be tracked", || {
            subscriber_ids(&server)
                .first()
                .is_some_and(|id| redirects_to(&server, id))
        });
        server.restart();
        // The server went away under the waiter, and came back without the
        // holder's key (no persistence): the wait rides out the outage and
        // acquires, on a new connection, tracked by a new subscriber.
        let guard = waiter
            .join()
            .unwrap()
            .expect("the wait rides out the restart")
            .expect("the holder's key is gone after the restart");
        assert_eq!(guard.release().unwrap(), ReleaseOutcome::Released);
    });
    let mut admin = server.client();
    wait_until(
        Duration::from_secs(10),
        "the subscriber to reconnect",
        || !subscriber_ids(&server).is_empty(),
    );
    let () = admin.set_ex("restart:job", "holder", 600).unwrap();
    thread::scope(|s| {
        let waiter = s.spawn(|| {
            let r = lock.acquire(LONG_TTL, &CancelToken::new());
            (r.map(|g| g.release()), Instant::now())
        });
        wait_until(
            Duration::from_secs(10),
            "the waiter to be tracked again",
            || {
                subscriber_ids(&server)
                    .first()
                    .is_some_and(|id| redirects_to(&server, id))
            },
        );
        wait_for_quiet(
            &mut admin,
            Duration::from_millis(300),
            Duration::from_secs(10),
        );
        let before = script_calls(&mut admin);
        thread::sleep(Duration::from_secs(1));
        let attempts = script_calls(&mut admin) - before;
        assert!(attempts <= 1, "polling: {attempts} attempts in 1 s");
        let released = Instant::now();
        let () = admin.del("restart:job").unwrap();
        // The holder's key had 600 s left and the wait has no deadline: only
        // the release wakes it.
        wait_until(Duration::from_secs(5), "the waiter to be woken", || {
            waiter.is_finished()
        });
        let (r, at) = waiter.join().unwrap();
        assert_eq!(r.unwrap().unwrap(), ReleaseOutcome::Released);
        println!(
            "after a restart: {attempts} attempts in 1 s of waiting; woken {:?} after the release",
            at - released
        );
    });
}

#[test]
fn waits_work_with_resp3_command_connections_across_a_subscriber_drop() {
    let server = TestServer::start();
    let mut admin = server.client();
    let coord = Coordinator::builder(&server.url())
        .key_prefix("resp3:")
        .protocol(respire_coordination::Protocol::Resp3)
        .build()
        .unwrap();
    let lock = coord.lock("job").unwrap();
    let () = admin.set_ex("resp3:job", "holder", 600).unwrap();
    thread::scope(|s| {
        let waiter = s.spawn(|| lock.acquire_timeout(LONG_TTL, Duration::from_secs(20)));
        wait_until(Duration::from_secs(10), "the waiter to be tracked", || {
            subscriber_ids(&server)
                .first()
                .is_some_and(|id| redirects_to(&server, id))
        });
        // The command connection now gets a `tracking-redir-broken` push.
        let old = subscriber_ids(&server);
        let _: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("pubsub")
            .query(&mut admin)
            .unwrap();
        wait_until(
            Duration::from_secs(10),
            "the waiter to be tracked again",
            || {
                subscriber_ids(&server)
                    .first()
                    .is_some_and(|id| !old.contains(id) && redirects_to(&server, id))
            },
        );
        let () = admin.del("resp3:job").unwrap();
        assert!(waiter.join().unwrap().unwrap().is_some());
    });
    // The connection that got the push still works.
    let g = lock.try_acquire(LONG_TTL).unwrap().unwrap();
    assert!(g.verify_still_held().unwrap().is_some());
}

#[test]
fn flushall_wakes_every_waiter() {
    let server = TestServer::start();
    let mut admin = server.client();
    let coord = coordinator(&server.url(), "flush:", Duration::from_millis(500));
    let () = admin.set_ex("flush:a", "holder", 600).unwrap();
    let () = admin.set_ex("flush:b", "holder", 600).unwrap();
    let baseline = script_calls(&mut admin);
    thread::scope(|s| {
        let waiters: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|k| {
                let lock = coord.lock(k).unwrap();
                s.spawn(move || {
                    lock.acquire_timeout(LONG_TTL, Duration::from_secs(20))
                        .map(|g| g.is_some())
                })
            })
            .collect();
        wait_until(Duration::from_secs(10), "both waiters to attempt", || {
            script_calls(&mut admin) - baseline >= 2
        });
        wait_for_quiet(
            &mut admin,
            Duration::from_millis(200),
            Duration::from_secs(10),
        );
        // FLUSHALL invalidates with a null key list rather than naming keys.
        let () = redis::cmd("FLUSHALL").query(&mut admin).unwrap();
        for w in waiters {
            assert!(w.join().unwrap().unwrap());
        }
    });
}

// ---------------------------------------------------------------------------
// The polling fallback
// ---------------------------------------------------------------------------

/// Waits on a held key as `url`'s user, releases it, and checks the waiter got
/// it by polling: a bounded number of attempts per second, with the fallback
/// logged once.
fn check_polling_fallback(server: &TestServer, url: &str, why: &str) {
    capture_logs();
    let mut admin = server.client();
    let prefix = unique_prefix("fallback");
    let coord = coordinator(url, &prefix, Duration::from_millis(500));
    let lock = coord.lock("job").unwrap();
    let fenced = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    let key = format!("{prefix}job");
    let lease = format!("{prefix}{{f}}:lease");
    let () = admin.set_ex(&key, "holder", 600).unwrap();
    let () = admin.set_ex(&lease, "holder", 600).unwrap();
    let baseline = script_calls(&mut admin);
    thread::scope(|s| {
        let plain = s.spawn(|| {
            let r = lock.acquire_timeout(LONG_TTL, Duration::from_secs(20));
            (r.map(|g| g.map(|g| g.release())), Instant::now())
        });
        let fenced = s.spawn(|| {
            let r = fenced.acquire(LONG_TTL, &CancelToken::new());
            (r.map(|g| g.release()), Instant::now())
        });
        wait_until(Duration::from_secs(10), "both waiters to attempt", || {
            script_calls(&mut admin) - baseline >= 2
        });
        let before = script_calls(&mut admin);
        let window = Instant::now();
        thread::sleep(Duration::from_secs(1));
        let attempts = script_calls(&mut admin) - before;
        let per_second = attempts as f64 / window.elapsed().as_secs_f64();
        println!("{why}: two waiters poll at {per_second:.1} attempts/s");
        // Two waiters polling every 50–150 ms: about 13–40 attempts a second.
        assert!(attempts >= 4, "not polling: {attempts} attempts in 1 s");
        assert!(
            attempts <= 80,
            "polling too fast: {attempts} attempts in 1 s"
        );
        let released = Instant::now();
        let () = admin.del(&[&key, &lease]).unwrap();
        let (p, p_at) = plain.join().unwrap();
        let (f, f_at) = fenced.join().unwrap();
        assert_eq!(p.unwrap().unwrap().unwrap(), ReleaseOutcome::Released);
        assert_eq!(f.unwrap().unwrap(), ReleaseOutcome::Released);
        println!(
            "{why}: acquired {:?} and {:?} after the release",
            p_at - released,
            f_at - released
        );
        assert!(p_at - released < Duration::from_secs(2));
        assert!(f_at - released < Duration::from_secs(2));
    });
    let warnings = logged(&["falls back to polling", &server.port().to_string()]);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].starts_with("WARN"), "{warnings:?}");
    assert!(warnings[0].contains(why), "{warnings:?}");
}

#[test]
fn waits_poll_when_the_acl_denies_client_tracking() {
    let server = TestServer::builder()
        .acl_user("user u on >pw ~* &* +@all -client|tracking")
        .start();
    check_polling_fallback(&server, &server.url_for_user("u", "pw"), "CLIENT TRACKING");
}

#[test]
fn waits_poll_when_the_acl_denies_the_invalidation_channel() {
    let server = TestServer::builder()
        .acl_user("user u on >pw ~* resetchannels +@all")
        .start();
    check_polling_fallback(
        &server,
        &server.url_for_user("u", "pw"),
        "__redis__:invalidate",
    );
}

#[test]
fn waits_track_every_read_when_the_acl_denies_client_caching() {
    capture_logs();
    let server = TestServer::builder()
        .acl_user("user u on >pw ~* &* +@all -client|caching")
        .start();
    let mut admin = server.client();
    let prefix = unique_prefix("nocaching");
    let coord = coordinator(
        &server.url_for_user("u", "pw"),
        &prefix,
        Duration::from_millis(500),
    );
    let lock = coord.lock("job").unwrap();
    let fenced = coord.fenced_lock("{f}:lease", "{f}:fence").unwrap();
    let key = format!("{prefix}job");
    let lease = format!("{prefix}{{f}}:lease");
    let () = admin.set_ex(&key, "holder", 600).unwrap();
    let () = admin.set_ex(&lease, "holder", 600).unwrap();
    thread::scope(|s| {
        let plain = s.spawn(|| lock.acquire_timeout(LONG_TTL, Duration::from_secs(30)));
        let fenced = s.spawn(|| fenced.acquire_timeout(LONG_TTL, Duration::from_secs(30)));
        // Both tracked their keys (the fenced script reads its counter too),
        // and then sleep: no polling.
        wait_until(Duration::from_secs(10), "both keys to be tracked", || {
            tracked_keys(&mut admin) >= 3
        });
        wait_for_quiet(
            &mut admin,
            Duration::from_millis(500),
            Duration::from_secs(10),
        );
        let () = admin.del(&[&key, &lease]).unwrap();
        let p = plain
            .join()
            .unwrap()
            .unwrap()
            .expect("the lock after its release");
        let f = fenced
            .join()
            .unwrap()
            .unwrap()
            .expect("the lease after its release");
        assert_eq!(p.release().unwrap(), ReleaseOutcome::Released);
        assert_eq!(f.release().unwrap(), ReleaseOutcome::Released);
    });
    let port = server.port().to_string();
    assert!(logged(&["falls back to polling", &port]).is_empty());
    let warnings = logged(&["track every key", &port]);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("CLIENT CACHING"), "{warnings:?}");
}

// ---------------------------------------------------------------------------
// Hand-off within one process, and the fenced lock
// ---------------------------------------------------------------------------

/// Whether this process's thread named `name` is asleep on a futex
/// (`/proc/self/task/*/stat` state `S`, `wchan` a futex wait).
fn asleep_on_futex(name: &str) -> bool {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| task.ok().map(|t| t.path()))
        .find(|task| {
            std::fs::read_to_string(task.join("comm")).is_ok_and(|comm| comm.trim_end() == name)
        })
        .is_some_and(|task| {
            let stat = std::fs::read_to_string(task.join("stat")).unwrap_or_default();
            // `pid (comm) S …`: the state follows the last parenthesis.
            let state = stat
                .rsplit_once(") ")
                .map(|(_, rest)| rest.starts_with('S'));
            let wchan = std::fs::read_to_string(task.join("wchan")).unwrap_or_default();
            state == Some(true) && wchan.contains("futex")
        })
}

#[test]
fn waiters_in_one_process_acquire_in_arrival_order() {
    const WAITERS: usize = 12;
    let server = TestServer::start();
    let mut admin = server.client();
    let coord = coordinator(&server.url(), "fifo:", Duration::from_millis(500));
    let lock = coord.lock("job").unwrap();
    let holder = lock.try_acquire(LONG_TTL).unwrap().unwrap();
    let order = Mutex::new(Vec::new());
    let inside = AtomicBool::new(false);
    thread::scope(|s| {
        for i in 0..WAITERS {
            let baseline = script_calls(&mut admin);
            let (lock, order, inside) = (&lock, &order, &inside);
            let name = format!("waiter-{i}");
            thread::Builder::new()
                .name(name.clone())
                .spawn_scoped(s, move || {
                    let g = lock.acquire(LONG_TTL, &CancelToken::new()).unwrap();
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders");
                    order.lock().unwrap().push(i);
                    inside.store(false, Ordering::SeqCst);
                    assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
                })
                .unwrap();
            if i == 0 {
                // Arrival: the waiter found the lock held and joined the
                // queue, which it does before its second attempt reaches the
                // server.
                wait_until(Duration::from_secs(10), "the waiter to arrive", || {
                    script_calls(&mut admin) > baseline + 1
                });
            } else {
                // A waiter that comes while others of its process are queued
                // joins behind them without a command: it has arrived when
                // its thread sleeps on a futex (its wake-up channel).
                wait_until(Duration::from_secs(10), "the waiter to arrive", || {
                    asleep_on_futex(&name)
                });
                assert_eq!(script_calls(&mut admin), baseline, "no attempt made");
            }
        }
        wait_for_quiet(
            &mut admin,
            Duration::from_millis(200),
            Duration::from_secs(10),
        );
        let before = script_calls(&mut admin);
        assert_eq!(holder.release().unwrap(), ReleaseOutcome::Released);
        wait_until(Duration::from_secs(20), "every waiter to acquire", || {
            order.lock().unwrap().len() == WAITERS
        });
        // Woken one at a time: per waiter, the attempt that takes the lock, a
        // re-check when the one before it leaves the queue, and at most one
        // more for the invalidation that the previous holder's own grant sent.
        // A herd would make every remaining waiter attempt on every release
        // (12 + 11 + … + 1 = 78 attempts and more).
        let attempts = script_calls(&mut admin) - before;
        println!("{WAITERS} waiters took {attempts} attempts to hand the lock along");
        assert!(attempts <= 3 * WAITERS as u64, "{attempts} attempts");
    });
    let order = order.into_inner().unwrap();
    assert_eq!(order, (0..WAITERS).collect::<Vec<_>>());
}

#[test]
fn a_waiter_queued_behind_another_of_its_process_returns_at_once_when_cancelled() {
    // A server of its own: its command counts are this test's.
    let server = TestServer::start();
    let mut admin = server.client();
    let coord = coordinator(&server.url(), "behind:", Duration::from_millis(500));
    // The coordinator's subscriber first, connected before the waits: a wait
    // that joined before it was subscribed would poll, and one that was
    // queued when it subscribed is woken to check again — attempts that are
    // neither waiter's doing.
    let warm = coord.lock("warm").unwrap();
    let _warm = warm.try_acquire(LONG_TTL).unwrap().unwrap();
    assert!(
        warm.acquire_timeout(LONG_TTL, Duration::from_millis(50))
            .unwrap()
            .is_none()
    );
    wait_until(
        Duration::from_secs(10),
        "the subscriber to subscribe",
        || {
            client_list(&server).iter().any(|c| {
                c.get("name").is_some_and(|n| n == "respire-tracking")
                    && c.get("sub").is_some_and(|n| n == "1")
            })
        },
    );
    let lock = coord.lock("job").unwrap();
    let holder = lock.try_acquire(LONG_TTL).unwrap().unwrap();
    let (first_cancel, second_cancel) = (CancelToken::new(), CancelToken::new());
    thread::scope(|s| {
        // A failed check ends both waits, so the scope can report it.
        let _ends_the_first = support::CancelOnDrop(&first_cancel);
        let _ends_the_second = support::CancelOnDrop(&second_cancel);
        let baseline = script_calls(&mut admin);
        let first = s.spawn(|| lock.acquire(LONG_TTL, &first_cancel));
        wait_until(Duration::from_secs(10), "the first waiter to queue", || {
            script_calls(&mut admin) > baseline + 1
        });
        let before = script_calls(&mut admin);
        let second = thread::Builder::new()
            .name("second-waiter".into())
            .spawn_scoped(s, || {
                let r = lock.acquire(LONG_TTL, &second_cancel);
                (r, Instant::now())
            })
            .unwrap();
        // Behind the first without a command, asleep until its turn: the
        // holder keeps the lock for LONG_TTL and the first never leaves, so
        // only the cancellation can end this wait.
        wait_until(
            Duration::from_secs(10),
            "the second waiter to queue",
            || asleep_on_futex("second-waiter"),
        );
        assert_eq!(script_calls(&mut admin), before, "no attempt made");
        let cancelled_at = Instant::now();
        second_cancel.cancel();
        wait_until(
            Duration::from_secs(5),
            "the cancelled wait to return",
            || second.is_finished(),
        );
        let (r, returned) = second.join().unwrap();
        assert!(matches!(r, Err(Error::Cancelled)), "{r:?}");
        println!(
            "cancel() to Err(Cancelled), queued behind another waiter: {:?}",
            returned - cancelled_at
        );
        // Leaving from behind passes no turn on: the first still waits, and
        // it is the one the release hands the lock to.
        assert!(!first.is_finished());
        assert_eq!(script_calls(&mut admin), before, "no attempt made");
        assert_eq!(holder.release().unwrap(), ReleaseOutcome::Released);
        let g = first.join().unwrap().unwrap();
        assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
    });
}

#[test]
fn fenced_lock_waiters_are_woken_by_release_and_get_higher_tokens() {
    // A server of its own: its command counts are this test's.
    let server = TestServer::start();
    let mut admin = server.client();
    let coord = coordinator(&server.url(), "fencedwait:", Duration::from_millis(500));
    let lock = coord.fenced_lock("{j}:lease", "{j}:fence").unwrap();
    let first = lock.try_acquire(LONG_TTL).unwrap().unwrap();
    let tokens = Mutex::new(vec![first.fencing_token().get()]);
    let cancel = CancelToken::new();
    let woken = AtomicU64::new(0);
    thread::scope(|s| {
        let _stop = support::CancelOnDrop(&cancel);
        let mut waiters = Vec::new();
        for verb in 0..3 {
            let baseline = script_calls(&mut admin);
            let (lock, tokens, cancel, woken) = (&lock, &tokens, &cancel, &woken);
            let name = format!("fenced-waiter-{verb}");
            let waiter = thread::Builder::new()
                .name(name.clone())
                .spawn_scoped(s, move || {
                    let g = match verb {
                        0 => lock.acquire(LONG_TTL, cancel).unwrap(),
                        1 => lock
                            .acquire_timeout(LONG_TTL, Duration::from_secs(20))
                            .unwrap()
                            .unwrap(),
                        _ => lock
                            .acquire_deadline(LONG_TTL, Instant::now() + Duration::from_secs(20))
                            .unwrap()
                            .unwrap(),
                    };
                    tokens.lock().unwrap().push(g.fencing_token().get());
                    woken.fetch_add(1, Ordering::SeqCst);
                    assert_eq!(g.release().unwrap(), ReleaseOutcome::Released);
                })
                .unwrap();
            waiters.push(waiter);
            // Each waits before the release: the first once its attempts
            // were refused, its connection is tracked by the subscriber, and,
            // seen after that, it sleeps on a futex (its wake-up channel); a
            // later one once it sleeps there, whether it queued behind the
            // first without a command or made attempts of its own.
            wait_until(Duration::from_secs(10), "the waiter to wait", || {
                let mut first_tracked = || {
                    script_calls(&mut admin) >= baseline + 2
                        && subscriber_ids(&server)
                            .first()
                            .is_some_and(|id| redirects_to(&server, id))
                };
                (verb > 0 || first_tracked()) && asleep_on_futex(&name)
            });
        }
        assert_eq!(woken.load(Ordering::SeqCst), 0, "acquired while held");
        assert_eq!(first.release().unwrap(), ReleaseOutcome::Released);
        for waiter in waiters {
            waiter.join().unwrap();
        }
    });
    let tokens = tokens.into_inner().unwrap();
    assert_eq!(tokens.len(), 4);
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}

#[test]
fn a_coordinator_that_waited_stops_its_subscriber_quietly_when_dropped() {
    capture_logs();
    let server = TestServer::start();
    let coord = coordinator(&server.url(), "quiet:", Duration::from_millis(500));
    let lock = coord.lock("job").unwrap();
    let held = lock.try_acquire(LONG_TTL).unwrap().unwrap();
    thread::scope(|s| {
        let waiter = s.spawn(|| lock.acquire_timeout(LONG_TTL, Duration::from_secs(20)));
        wait_until(Duration::from_secs(10), "the waiter to be tracked", || {
            subscriber_ids(&server)
                .first()
                .is_some_and(|id| redirects_to(&server, id))
        });
        drop(held);
        assert!(waiter.join().unwrap().unwrap().is_some());
    });
    drop(lock);
    drop(coord);
    wait_until(Duration::from_secs(10), "the subscriber to stop", || {
        subscriber_ids(&server).is_empty()
    });
    let warnings = logged(&["WARN", &server.port().to_string()]);
    assert!(warnings.is_empty(), "{warnings:?}");
}
