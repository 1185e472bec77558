//! The renewal runtime: one thread per `Coordinator`, whatever the number of
//! guards. It keeps a timer heap of leases; kept-alive leases are renewed at half
//! their TTL, and every renewal due at about the same time goes out in one
//! pipeline on the thread's own connection. Every lease, kept alive or not, gets
//! its loss signal fired at its local loss deadline if no renewal was confirmed
//! by then.
//!
//! A renewal that got no reply may still be applied later, so the connection that
//! sent it is killed (`CLIENT KILL ID` from a second connection) before a new one
//! is made. No I/O step takes longer than the node timeout, nor runs past the
//! loss deadline of the leases it is renewing.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::conn::{Conn, ConnConfig};
use crate::coordinator::Shared;
use crate::error::Error;
use crate::lease::LeaseState;
use crate::runtime::clock;
use crate::runtime::timer::{self, Timers};
use crate::scripts;

enum Msg {
    Track(Arc<LeaseState>),
    Reschedule(u64),
    Forget(u64),
}

/// Counters of the renewal runtime, for monitoring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RenewalStats {
    /// Pipelines sent (one round trip each).
    pub round_trips: u64,
    /// Leases renewed and confirmed.
    pub renewals: u64,
    /// Renewal attempts that failed or got no reply (each retried while time remained).
    pub failures: u64,
    /// Leases whose loss the runtime flagged.
    pub losses: u64,
    /// Connections killed after a renewal got no reply.
    pub killed_connections: u64,
}

#[derive(Default)]
struct Counters {
    round_trips: AtomicU64,
    renewals: AtomicU64,
    failures: AtomicU64,
    losses: AtomicU64,
    killed: AtomicU64,
}

/// The handle a coordinator keeps; the thread stops when it is dropped.
pub(crate) struct Renewal {
    tx: Sender<Msg>,
    counters: Arc<Counters>,
}

impl Renewal {
    pub(crate) fn spawn(cfg: Arc<ConnConfig>) -> std::io::Result<Renewal> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let counters = Arc::new(Counters::default());
        let worker = Worker {
            cfg,
            entries: HashMap::new(),
            heap: BinaryHeap::new(),
            conn: None,
            counters: counters.clone(),
            script_loaded: false,
        };
        std::thread::Builder::new()
            .name("respire-renewal".into())
            .spawn(move || timer::run(&rx, worker))?;
        Ok(Renewal { tx, counters })
    }

    pub(crate) fn track(&self, state: Arc<LeaseState>) {
        let _ = self.tx.send(Msg::Track(state));
    }

    pub(crate) fn reschedule(&self, id: u64) {
        let _ = self.tx.send(Msg::Reschedule(id));
    }

    pub(crate) fn forget(&self, id: u64) {
        let _ = self.tx.send(Msg::Forget(id));
    }

    pub(crate) fn stats(&self) -> RenewalStats {
        let c = &self.counters;
        RenewalStats {
            round_trips: c.round_trips.load(Ordering::Relaxed),
            renewals: c.renewals.load(Ordering::Relaxed),
            failures: c.failures.load(Ordering::Relaxed),
            losses: c.losses.load(Ordering::Relaxed),
            killed_connections: c.killed.load(Ordering::Relaxed),
        }
    }
}

/// Renews a lease in the background for as long as it lives.
///
/// Returned by `keep_alive()` on a guard, which it borrows: it always ends before
/// the guard does. While it lives, the coordinator's renewal thread extends the
/// lease at half its TTL (one pipelined round trip for all leases due together),
/// retries a failed renewal while time remains, and flags the guard lost — setting
/// `is_lost()` and closing the loss signal — no later than the local deadline
/// (send time of the last confirmed renewal + TTL − drift − node timeout) when no
/// renewal could be confirmed, or at once when the key was found deleted or owned
/// by someone else.
///
/// Dropping it stops renewal; the lease then runs out at its current expiry
/// unless renewed again. It does not block.
#[must_use = "renewal stops as soon as the KeepAlive is dropped"]
pub struct KeepAlive<'a> {
    shared: Arc<Shared>,
    state: Arc<LeaseState>,
    _guard: PhantomData<&'a ()>,
}

pub(crate) fn start<'a>(shared: &Arc<Shared>, state: &Arc<LeaseState>) -> KeepAlive<'a> {
    state.add_keepalive();
    shared.renewal().reschedule(state.id);
    KeepAlive {
        shared: shared.clone(),
        state: state.clone(),
        _guard: PhantomData,
    }
}

impl KeepAlive<'_> {
    /// Whether the lease is lost (same as the guard's `is_lost()`). Does not block.
    pub fn is_lost(&self) -> bool {
        self.state.is_lost()
    }
}

impl Drop for KeepAlive<'_> {
    fn drop(&mut self) {
        self.state.remove_keepalive();
        self.shared.renewal().reschedule(self.state.id);
    }
}

impl fmt::Debug for KeepAlive<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeepAlive")
            .field("key", &self.state.key)
            .field("lost", &self.state.is_lost())
            .finish()
    }
}

struct Entry {
    state: Arc<LeaseState>,
    next_try: Instant,
    version: u64,
}

struct Worker {
    cfg: Arc<ConnConfig>,
    entries: HashMap<u64, Entry>,
    heap: BinaryHeap<Reverse<(Instant, u64, u64)>>,
    conn: Option<(Conn, u64)>,
    counters: Arc<Counters>,
    script_loaded: bool,
}

impl Timers for Worker {
    type Msg = Msg;

    fn next_due(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _, _))| *at)
    }

    fn handle(&mut self, msg: Msg) {
        self.handle_msg(msg);
    }

    fn process_due(&mut self) {
        self.run_due();
    }
}

impl Worker {
    fn handle_msg(&mut self, msg: Msg) {
        match msg {
            Msg::Track(state) => {
                let id = state.id;
                let next_try = clock::renew_at(state.sent(), state.ttl());
                self.entries.insert(
                    id,
                    Entry {
                        state,
                        next_try,
                        version: 0,
                    },
                );
                self.schedule(id);
            }
            Msg::Reschedule(id) => {
                if let Some(e) = self.entries.get_mut(&id) {
                    e.next_try = clock::renew_at(e.state.sent(), e.state.ttl());
                    self.schedule(id);
                }
            }
            Msg::Forget(id) => {
                self.entries.remove(&id);
            }
        }
    }

    /// Pushes the entry's next event (renewal or loss deadline) on the heap.
    fn schedule(&mut self, id: u64) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.version += 1;
            let lost_at = e.state.lost_at();
            let at = if e.state.keepalive_count() > 0 {
                e.next_try.min(lost_at)
            } else {
                lost_at
            };
            self.heap.push(Reverse((at, id, e.version)));
        }
    }

    fn run_due(&mut self) {
        let now = Instant::now();
        let mut batch = Vec::new();
        let mut again = Vec::new();
        while let Some(&Reverse((at, id, version))) = self.heap.peek() {
            if at > now {
                break;
            }
            self.heap.pop();
            let Some(e) = self.entries.get(&id) else {
                continue;
            };
            if e.version != version {
                continue;
            }
            if e.state.is_done() || e.state.flagged_lost() {
                self.entries.remove(&id);
                continue;
            }
            if now >= e.state.lost_at() {
                let why = if e.state.keepalive_count() > 0 {
                    "no renewal was confirmed before the loss deadline"
                } else {
                    "its time ran out without keep-alive"
                };
                e.state.mark_lost(why);
                self.counters.losses.fetch_add(1, Ordering::Relaxed);
                self.entries.remove(&id);
                continue;
            }
            if e.state.keepalive_count() > 0 && e.next_try <= now {
                batch.push(id);
            } else {
                again.push(id);
            }
        }
        // Renewals due soon ride along with this pipeline.
        while !batch.is_empty() {
            let Some(&Reverse((_, id, version))) = self.heap.peek() else {
                break;
            };
            let Some(e) = self.entries.get(&id) else {
                self.heap.pop();
                continue;
            };
            if e.version != version {
                self.heap.pop();
                continue;
            }
            let due_soon = e.state.keepalive_count() > 0
                && e.next_try <= now + e.state.ttl() / 8
                && e.state.lost_at() > now;
            if !due_soon {
                break;
            }
            self.heap.pop();
            batch.push(id);
        }
        for id in again {
            self.schedule(id);
        }
        // A lease whose holder is running reset_expiry right now is retried
        // in a moment rather than extended twice at once.
        let mut claimed = Vec::with_capacity(batch.len());
        let mut states = Vec::with_capacity(batch.len());
        for id in batch {
            let state = self.entries[&id].state.clone();
            if state.try_begin_extend() {
                claimed.push(id);
                states.push(state);
            } else {
                self.retry(id, Duration::from_millis(1));
            }
        }
        if !claimed.is_empty() {
            self.renew(&claimed);
        }
        for state in states {
            state.end_extend();
        }
    }

    /// Makes sure the renewal connection is up, finishing by `deadline`.
    fn ensure_conn(&mut self, deadline: Instant) -> Result<(), Error> {
        if self.conn.as_ref().is_some_and(|(c, _)| !c.is_broken()) {
            return Ok(());
        }
        self.conn = None;
        let mut conn = self.cfg.connect(left(deadline), "respire-renewal")?;
        let id = conn.client_id(left(deadline))?;
        conn.query::<String>(&scripts::LEASE_EXTEND.load(), "SCRIPT LOAD", left(deadline))?;
        self.script_loaded = true;
        self.conn = Some((conn, id));
        Ok(())
    }

    fn renew(&mut self, batch: &[u64]) {
        let now = Instant::now();
        let earliest_loss = batch
            .iter()
            .filter_map(|id| self.entries.get(id))
            .map(|e| e.state.lost_at())
            .min()
            .unwrap_or(now);
        // Every I/O step of this renewal shares one deadline: at most a node
        // timeout, and never past the loss deadline of a lease in the batch, so
        // that losses are flagged on time.
        let deadline = (now + self.cfg.node_timeout).min(earliest_loss);
        if let Err(e) = self.ensure_conn(deadline) {
            log::warn!("renewal connection to {} failed: {e}", self.cfg.addr);
            self.fail_all(batch);
            return;
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        let mut ttls = Vec::with_capacity(batch.len());
        for id in batch {
            let e = &self.entries[id];
            let ttl_ms = e.state.ttl_ms();
            ttls.push(ttl_ms);
            pipe.add_command(
                scripts::LEASE_EXTEND
                    .evalsha(&[&e.state.key], &[&e.state.value, &ttl_ms.to_string()]),
            );
        }
        let (conn, conn_id) = self.conn.as_mut().expect("connected above");
        let conn_id = *conn_id;
        let sent = Instant::now();
        self.counters.round_trips.fetch_add(1, Ordering::Relaxed);
        let reply = conn.pipeline(&pipe, "renew", left(deadline));
        match reply {
            Ok(values) => {
                let mut reload = false;
                for ((id, value), ttl_ms) in batch.iter().zip(values).zip(ttls) {
                    match value {
                        redis::Value::Int(1) => {
                            let e = self.entries.get_mut(id).expect("in batch");
                            e.state.confirm(sent, ttl_ms);
                            e.next_try = clock::renew_at(sent, Duration::from_millis(ttl_ms));
                            self.counters.renewals.fetch_add(1, Ordering::Relaxed);
                            self.schedule(*id);
                        }
                        redis::Value::Int(n) => {
                            let e = self.entries.remove(id).expect("in batch");
                            e.state.mark_lost(if n == 0 {
                                "renewal found the key gone (expired or deleted)"
                            } else {
                                "renewal found another owner holding the key"
                            });
                            self.counters.losses.fetch_add(1, Ordering::Relaxed);
                        }
                        redis::Value::ServerError(err) if err.code() == "NOSCRIPT" => {
                            reload = true;
                            self.retry(*id, Duration::ZERO);
                        }
                        other => {
                            log::warn!("unexpected renewal reply for lease {id}: {other:?}");
                            self.retry(*id, retry_of(&self.entries, *id));
                        }
                    }
                }
                if reload {
                    self.script_loaded = false;
                    if let Some((conn, _)) = self.conn.as_mut()
                        && conn
                            .query::<String>(
                                &scripts::LEASE_EXTEND.load(),
                                "SCRIPT LOAD",
                                left(deadline),
                            )
                            .is_ok()
                    {
                        self.script_loaded = true;
                    }
                }
            }
            Err(e) => {
                log::warn!(
                    "renewing {} lease(s) on {} failed: {e}",
                    batch.len(),
                    self.cfg.addr
                );
                let (conn, _) = self.conn.take().expect("connected above");
                if e.is_uncertain() {
                    self.kill(conn, conn_id, earliest_loss);
                }
                self.fail_all(batch);
            }
        }
    }

    /// Kills the connection a renewal got no reply on, from a fresh connection, so
    /// the server does not apply the renewal after we stopped counting on it.
    fn kill(&mut self, conn: Conn, conn_id: u64, earliest_loss: Instant) {
        drop(conn);
        let budget = (self.cfg.node_timeout / 2)
            .min(earliest_loss.saturating_duration_since(Instant::now()))
            .max(Duration::from_millis(1));
        let result = self
            .cfg
            .connect(budget, "respire-renewal-kill")
            .and_then(|mut killer| {
                killer.query::<i64>(
                    redis::cmd("CLIENT").arg("KILL").arg("ID").arg(conn_id),
                    "CLIENT KILL",
                    budget,
                )
            });
        match result {
            Ok(_) => {
                self.counters.killed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => log::warn!("could not kill renewal connection {conn_id}: {e}"),
        }
    }

    fn retry(&mut self, id: u64, delay: Duration) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.next_try = Instant::now() + delay;
            self.schedule(id);
        }
    }

    fn fail_all(&mut self, batch: &[u64]) {
        self.counters
            .failures
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        for id in batch {
            let delay = retry_of(&self.entries, *id);
            self.retry(*id, delay);
        }
    }
}

/// The time left until `deadline` (at least 1 ms, the smallest socket timeout).
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn retry_of(entries: &HashMap<u64, Entry>, id: u64) -> Duration {
    entries
        .get(&id)
        .map(|e| clock::retry_delay(e.state.ttl()))
        .unwrap_or_default()
}
