//! The renewal runtime of one deployment: the renewal thread (`respire-renewal`,
//! the pure schedule over real time, no I/O) and its executor (`respire-io`, one
//! connection of its own), both started the first time a guard needs them.
//!
//! The executor sends every renewal due at about the same time as one pipeline.
//! A renewal with no reply may still be applied later, so before the leases it
//! carried may be extended again, the connection it went out on is killed
//! (`CLIENT KILL ID` from a fresh connection) and the kill confirmed; until then
//! their claims stay taken and they are bounded by the worst case. The same
//! executor fences off the connections of user calls that got no reply (a
//! `reset_expiry`, an acquire), retrying the kill while it matters, and deletes
//! what an unanswered acquire may have set once its connection is dead.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

use crate::clock::Clock;
use crate::conn::{Conn, ConnConfig};
use crate::core::lease::{Loss, Refusal, Ticket};
use crate::core::schedule::{Next, Watched};
use crate::core::timing;
use crate::error::Error;
use crate::runtime::lease::LeaseCell;
use crate::runtime::scheduler::{Dispatch, Msg, Scheduler};
use crate::scripts::Script;

/// How a lease is held on the server, for the commands that extend, verify and
/// release it.
#[derive(Clone, Copy)]
pub(crate) enum Shape {
    /// A string key whose value is the owner (`lease_*.lua`).
    StringValue,
    /// A member of a sorted set scored by its expiry (readers, permits).
    #[allow(
        dead_code,
        reason = "the reader/writer lease and the semaphore hold leases this way"
    )]
    Member {
        extend: &'static std::sync::LazyLock<Script>,
        verify: &'static std::sync::LazyLock<Script>,
        release: &'static std::sync::LazyLock<Script>,
    },
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shape::StringValue => f.write_str("StringValue"),
            Shape::Member { extend, .. } => write!(f, "Member({})", extend.name),
        }
    }
}

/// The commands of one lease: its keys, its value or member, and its shape.
#[derive(Clone, Debug)]
pub(crate) struct Ops {
    pub(crate) keys: Vec<String>,
    pub(crate) member: String,
    pub(crate) shape: Shape,
}

impl Ops {
    /// A lease held as a string key whose value is the owner token.
    pub(crate) fn string_value(key: &str, value: String) -> Ops {
        Ops {
            keys: vec![key.to_owned()],
            member: value,
            shape: Shape::StringValue,
        }
    }

    fn keys(&self) -> Vec<&str> {
        self.keys.iter().map(String::as_str).collect()
    }

    pub(crate) fn extend_script(&self) -> &'static Script {
        match self.shape {
            Shape::StringValue => &crate::scripts::LEASE_EXTEND,
            Shape::Member { extend, .. } => extend,
        }
    }

    pub(crate) fn verify_script(&self) -> &'static Script {
        match self.shape {
            Shape::StringValue => &crate::scripts::LEASE_VERIFY,
            Shape::Member { verify, .. } => verify,
        }
    }

    pub(crate) fn release_script(&self) -> &'static Script {
        match self.shape {
            Shape::StringValue => &crate::scripts::LEASE_RELEASE,
            Shape::Member { release, .. } => release,
        }
    }

    /// `(keys, args)` of the extension to `ttl_ms`.
    pub(crate) fn extend_args(&self, ttl_ms: u64) -> (Vec<&str>, Vec<String>) {
        (self.keys(), vec![self.member.clone(), ttl_ms.to_string()])
    }

    pub(crate) fn verify_args(&self) -> (Vec<&str>, Vec<String>) {
        (self.keys(), vec![self.member.clone()])
    }

    /// The keys, borrowed.
    pub(crate) fn key_refs(&self) -> Vec<&str> {
        self.keys()
    }

    /// The release's arguments, borrowed (no allocation on the release path).
    pub(crate) fn release_arg_refs(&self) -> Args<'_> {
        match self.shape {
            Shape::StringValue => Args {
                items: [&self.member, "exact"],
                len: 2,
            },
            Shape::Member { .. } => Args {
                items: [&self.member, ""],
                len: 1,
            },
        }
    }

    pub(crate) fn extend_cmd(&self, ttl_ms: u64) -> redis::Cmd {
        let (keys, args) = self.extend_args(ttl_ms);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.extend_script().evalsha(&keys, &args)
    }

    /// The same extension as `EVAL`, for a server that lost the script.
    pub(crate) fn extend_eval(&self, ttl_ms: u64) -> redis::Cmd {
        let (keys, args) = self.extend_args(ttl_ms);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.extend_script().eval(&keys, &args)
    }
}

/// Up to two borrowed script arguments.
pub(crate) struct Args<'a> {
    items: [&'a str; 2],
    len: usize,
}

impl<'a> Args<'a> {
    pub(crate) fn as_slice(&self) -> &[&'a str] {
        &self.items[..self.len]
    }
}

/// A single-deployment lease.
pub(crate) type Cell = LeaseCell<Ops>;

impl Watched for Arc<Cell> {
    fn id(&self) -> u64 {
        LeaseCell::id(self)
    }

    fn poll(&self, now: Instant) -> Next {
        self.next(now)
    }
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
    /// Connections fenced off after a command on them got no reply: killed, or
    /// confirmed closed already (`CLIENT KILL ID` found them gone), so that
    /// nothing sent on them can still be applied.
    pub killed_connections: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    round_trips: AtomicU64,
    renewals: AtomicU64,
    failures: AtomicU64,
    losses: AtomicU64,
    killed: AtomicU64,
}

/// Work for the executor.
pub(crate) enum Job {
    /// Renew these leases by their TTL, in one pipeline.
    Renew(Vec<Arc<Cell>>),
    /// A user call's extension of `lease` got no reply on connection `conn`:
    /// kill it, then release the claim.
    Fence {
        conn: Option<u64>,
        lease: Arc<Cell>,
        ticket: Ticket,
    },
    /// Acquire attempts got no reply on connections `conns`: kill them, then
    /// run `cmd` (delete what they may have set, by owner), until `give_up_at`.
    Cleanup {
        conns: Vec<u64>,
        cmd: redis::Cmd,
        key: String,
        give_up_at: Instant,
    },
}

/// Which renewals a reply from the executor completed.
pub(crate) struct Completed(Vec<(u64, Option<Instant>)>);

/// The renewal thread's dispatcher: hands batches to the executor.
struct ToExecutor {
    jobs: Sender<Job>,
}

impl Dispatch for ToExecutor {
    type Lease = Arc<Cell>;
    type Reply = Completed;

    fn dispatch(&mut self, batch: Vec<Arc<Cell>>, _now: Instant) -> Vec<(u64, Option<Instant>)> {
        let _ = self.jobs.send(Job::Renew(batch));
        Vec::new()
    }

    fn on_reply(&mut self, reply: Completed, _now: Instant) -> Vec<(u64, Option<Instant>)> {
        reply.0
    }
}

/// The renewal thread and executor of one deployment, started on first use.
pub(crate) struct Runtime {
    cfg: Arc<ConnConfig>,
    clock: Arc<dyn Clock>,
    counters: Arc<Counters>,
    executor: OnceLock<Sender<Job>>,
    scheduler: OnceLock<Scheduler<Arc<Cell>, Completed>>,
    start: Mutex<()>,
    this: Weak<Runtime>,
}

impl Runtime {
    pub(crate) fn new(cfg: Arc<ConnConfig>, clock: Arc<dyn Clock>) -> Arc<Runtime> {
        Arc::new_cyclic(|this| Runtime {
            cfg,
            clock,
            counters: Arc::default(),
            executor: OnceLock::new(),
            scheduler: OnceLock::new(),
            start: Mutex::new(()),
            this: this.clone(),
        })
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

    fn executor(&self) -> Result<&Sender<Job>, Error> {
        if let Some(tx) = self.executor.get() {
            return Ok(tx);
        }
        let _start = self.start.lock();
        if let Some(tx) = self.executor.get() {
            return Ok(tx);
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let worker = Executor {
            cfg: self.cfg.clone(),
            clock: self.clock.clone(),
            counters: self.counters.clone(),
            runtime: self.this.clone(),
            conn: None,
            fences: Vec::new(),
            cleanups: Vec::new(),
        };
        std::thread::Builder::new()
            .name("respire-io".into())
            .spawn(move || worker.run(&rx))
            .map_err(|source| Error::Thread {
                name: "respire-io",
                source,
            })?;
        Ok(self.executor.get_or_init(|| tx))
    }

    fn scheduler(&self) -> Result<&Scheduler<Arc<Cell>, Completed>, Error> {
        if let Some(s) = self.scheduler.get() {
            return Ok(s);
        }
        let jobs = self.executor()?.clone();
        let _start = self.start.lock();
        if let Some(s) = self.scheduler.get() {
            return Ok(s);
        }
        let s = Scheduler::spawn("respire-renewal", self.clock.clone(), |_replies| {
            ToExecutor { jobs }
        })
        .map_err(|source| Error::Thread {
            name: "respire-renewal",
            source,
        })?;
        Ok(self.scheduler.get_or_init(|| s))
    }

    /// Has the renewal thread watch `lease` (its loss signal, its keep-alive).
    pub(crate) fn watch(&self, lease: &Arc<Cell>) -> Result<(), Error> {
        if lease.watch() {
            self.scheduler()?.send(Msg::Watch(lease.clone()));
        }
        Ok(())
    }

    /// A watched lease changed.
    pub(crate) fn touch(&self, lease: &Cell) {
        if lease.is_watched()
            && let Some(s) = self.scheduler.get()
        {
            s.send(Msg::Touch(lease.id()));
        }
    }

    /// A watched lease was released.
    pub(crate) fn forget(&self, lease: &Cell) {
        if lease.is_watched()
            && let Some(s) = self.scheduler.get()
        {
            s.send(Msg::Forget(lease.id()));
        }
    }

    /// Queues work for the executor (starting it if needed).
    pub(crate) fn submit(&self, job: Job) {
        match self.executor() {
            Ok(tx) => {
                let _ = tx.send(job);
            }
            Err(e) => log::warn!("cannot start the executor for {}: {e}", self.cfg.addr),
        }
    }

    fn completed(&self, done: Vec<(u64, Option<Instant>)>) {
        if let Some(s) = self.scheduler.get()
            && !done.is_empty()
        {
            s.send(Msg::Reply(Completed(done)));
        }
    }
}

struct PendingFence {
    conn: u64,
    leases: Vec<(Arc<Cell>, Ticket)>,
    retry_at: Instant,
}

struct PendingCleanup {
    conns: Vec<u64>,
    cmd: redis::Cmd,
    key: String,
    give_up_at: Instant,
    retry_at: Instant,
}

struct Executor {
    cfg: Arc<ConnConfig>,
    clock: Arc<dyn Clock>,
    counters: Arc<Counters>,
    runtime: Weak<Runtime>,
    conn: Option<Conn>,
    fences: Vec<PendingFence>,
    cleanups: Vec<PendingCleanup>,
}

impl Executor {
    fn run(mut self, rx: &Receiver<Job>) {
        loop {
            let next = self
                .fences
                .iter()
                .map(|f| f.retry_at)
                .chain(self.cleanups.iter().map(|c| c.retry_at))
                .min();
            let job = match next {
                Some(at) => rx.recv_timeout(at.saturating_duration_since(self.clock.now())),
                None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            match job {
                Ok(job) => self.handle(job),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            self.retry_pending();
        }
    }

    fn handle(&mut self, job: Job) {
        match job {
            Job::Renew(batch) => self.renew(batch),
            Job::Fence {
                conn,
                lease,
                ticket,
            } => match conn {
                Some(conn) => {
                    let now = self.clock.now();
                    self.fences.push(PendingFence {
                        conn,
                        leases: vec![(lease, ticket)],
                        retry_at: now,
                    });
                }
                None => log::warn!(
                    "cannot fence off an unanswered extension of {:?}: its connection's id is \
                     unknown (CLIENT ID denied); it stays bounded by its worst case",
                    lease.key()
                ),
            },
            Job::Cleanup {
                conns,
                cmd,
                key,
                give_up_at,
            } => {
                let now = self.clock.now();
                self.cleanups.push(PendingCleanup {
                    conns,
                    cmd,
                    key,
                    give_up_at,
                    retry_at: now,
                });
            }
        }
    }

    /// A connection for the executor's own commands, made within `deadline`.
    fn ensure_conn(&mut self, deadline: Instant) -> Result<&mut Conn, Error> {
        if self.conn.as_ref().is_some_and(Conn::is_broken) {
            self.conn = None;
        }
        if self.conn.is_none() {
            let budget = deadline.saturating_duration_since(self.clock.now());
            self.conn = Some(self.cfg.connect(budget, "respire-renewal")?);
        }
        Ok(self.conn.as_mut().expect("connected above"))
    }

    /// Kills connection `id` from the executor's connection; Ok once the
    /// server confirmed it no longer exists.
    fn kill(&mut self, id: u64, deadline: Instant) -> Result<(), Error> {
        let conn = self.ensure_conn(deadline)?;
        let cmd = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .arg("SKIPME")
            .arg("yes")
            .clone();
        // 1: killed now; 0: no such connection any more (ids are never reused).
        let r: Result<i64, Error> = conn.query(&cmd, "CLIENT KILL", deadline);

        if r.as_ref().is_err_and(|e| e.is_uncertain()) {
            self.conn = None;
        }
        r.map(|_| {
            self.counters.killed.fetch_add(1, Ordering::Relaxed);
        })
    }

    fn renew(&mut self, batch: Vec<Arc<Cell>>) {
        let now = self.clock.now();
        let nt = self.cfg.node_timeout;
        let mut done = Vec::with_capacity(batch.len());
        // Every step shares one deadline: a node timeout, and never past the
        // earliest loss deadline in the batch (a later reply would not count).
        let earliest = batch.iter().map(|l| l.lost_at()).min().unwrap_or(now);
        let deadline = (now + nt).min(earliest).max(now + Duration::from_millis(1));
        if let Err(e) = self.ensure_conn(deadline) {
            log::warn!("renewal connection to {} failed: {e}", self.cfg.addr);
            self.counters
                .failures
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            for lease in &batch {
                done.push((lease.id(), Some(self.retry_at(lease))));
            }
            self.report(done);
            return;
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        let mut sent = Vec::with_capacity(batch.len());
        let send_at = self.clock.now();
        for lease in batch {
            let ttl = lease.ttl();
            match lease.begin_extend(send_at, ttl) {
                Ok(ticket) => {
                    let ttl_ms = crate::keys::ttl_ms(ttl).unwrap_or(1);
                    pipe.add_command(lease.extra().extend_cmd(ttl_ms));
                    sent.push((lease, ticket));
                }
                // Another extension (the holder's reset_expiry) is in flight;
                // its end plans this lease again.
                Err(Refusal::Busy) => done.push((lease.id(), None)),
                Err(Refusal::Lost) => done.push((lease.id(), None)),
            }
        }
        if sent.is_empty() {
            self.report(done);
            return;
        }
        self.counters.round_trips.fetch_add(1, Ordering::Relaxed);
        let conn = self.conn.as_mut().expect("connected above");
        let conn_id = conn.id();
        let mut reply = conn.pipeline(&pipe, "renew", deadline);
        // A server that lost the script (restarted, SCRIPT FLUSH) gets it with
        // EVAL for those leases, in the time left.
        if let Ok(values) = &mut reply {
            let missing: Vec<usize> = values
                .iter()
                .enumerate()
                .filter(
                    |(_, v)| matches!(v, redis::Value::ServerError(e) if e.code() == "NOSCRIPT"),
                )
                .map(|(i, _)| i)
                .collect();
            if !missing.is_empty() {
                let mut again = redis::pipe();
                again.ignore_errors();
                for &i in &missing {
                    let lease = &sent[i].0;
                    let ttl_ms = crate::keys::ttl_ms(lease.ttl()).unwrap_or(1);
                    again.add_command(lease.extra().extend_eval(ttl_ms));
                }
                self.counters.round_trips.fetch_add(1, Ordering::Relaxed);
                match conn.pipeline(&again, "renew", deadline) {
                    Ok(evals) => {
                        for (i, v) in missing.into_iter().zip(evals) {
                            values[i] = v;
                        }
                    }
                    Err(e) => reply = Err(e),
                }
            }
        }
        let now = self.clock.now();
        match reply {
            Ok(values) => {
                for ((lease, ticket), value) in sent.into_iter().zip(values) {
                    let retry = self.settle(&lease, ticket, value, now);
                    done.push((lease.id(), retry));
                }
            }
            Err(e) => {
                log::warn!(
                    "renewing {} lease(s) on {} failed: {e}",
                    sent.len(),
                    self.cfg.addr
                );
                self.counters
                    .failures
                    .fetch_add(sent.len() as u64, Ordering::Relaxed);
                self.conn = None;
                for (lease, ticket) in &sent {
                    lease.unanswered(*ticket, now);
                    done.push((lease.id(), Some(self.retry_at(lease))));
                }
                match conn_id {
                    Some(id) => self.fences.push(PendingFence {
                        conn: id,
                        leases: sent,
                        retry_at: now,
                    }),
                    None => log::warn!(
                        "cannot fence off renewals that got no reply: the connection's id \
                         is unknown"
                    ),
                }
                // Fence at once, so the leases can be renewed again in time.
                self.retry_pending();
            }
        }
        self.report(done);
    }

    /// Applies one renewal reply; returns when to retry if it failed.
    fn settle(
        &self,
        lease: &Arc<Cell>,
        ticket: Ticket,
        value: redis::Value,
        now: Instant,
    ) -> Option<Instant> {
        match value {
            redis::Value::Int(1) => {
                if lease.extended(ticket, now) {
                    self.counters.renewals.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.counters.losses.fetch_add(1, Ordering::Relaxed);
                }
                None
            }
            redis::Value::Int(n) => {
                lease.refused(
                    ticket,
                    now,
                    if n == 0 { Loss::Gone } else { Loss::TakenOver },
                );
                self.counters.losses.fetch_add(1, Ordering::Relaxed);
                None
            }
            // An error reply (a refusal, a server busy or loading): the
            // script did not change the lease.
            other => {
                log::warn!("unexpected renewal reply for {:?}: {other:?}", lease.key());
                lease.not_sent(ticket, now);
                self.counters.failures.fetch_add(1, Ordering::Relaxed);
                Some(self.retry_at(lease))
            }
        }
    }

    fn retry_at(&self, lease: &Cell) -> Instant {
        self.clock.now() + timing::retry_delay(lease.ttl())
    }

    fn report(&self, done: Vec<(u64, Option<Instant>)>) {
        if let Some(rt) = self.runtime.upgrade() {
            rt.completed(done);
        }
    }

    /// Retries the kills and clean-ups that are due.
    fn retry_pending(&mut self) {
        let now = self.clock.now();
        let nt = self.cfg.node_timeout;
        let fences = std::mem::take(&mut self.fences);
        for mut f in fences {
            // Leases lost or released meanwhile no longer need their claim.
            f.leases.retain(|(l, _)| !l.is_lost(now));
            if f.leases.is_empty() {
                continue;
            }
            if f.retry_at > now {
                self.fences.push(f);
                continue;
            }
            let deadline = self.clock.now() + nt;
            match self.kill(f.conn, deadline) {
                Ok(()) => {
                    let now = self.clock.now();
                    let rt = self.runtime.upgrade();
                    for (lease, ticket) in f.leases {
                        lease.fenced(ticket, now);
                        if let Some(rt) = &rt {
                            rt.touch(&lease);
                        }
                    }
                }
                Err(e) => {
                    log::warn!(
                        "could not kill connection {} after a command on it got no reply: {e}; \
                         retrying",
                        f.conn
                    );
                    f.retry_at = self.clock.now() + Duration::from_millis(50).min(nt);
                    self.fences.push(f);
                }
            }
        }
        let cleanups = std::mem::take(&mut self.cleanups);
        for mut c in cleanups {
            let now = self.clock.now();
            if now >= c.give_up_at {
                log::warn!(
                    "gave up cleaning up after an unanswered acquire of {:?}; if it was \
                     granted, it has expired by now",
                    c.key
                );
                continue;
            }
            if c.retry_at > now {
                self.cleanups.push(c);
                continue;
            }
            let deadline = (now + nt).min(c.give_up_at);
            let mut killed = Ok(());
            while let Some(&id) = c.conns.last() {
                match self.kill(id, deadline) {
                    Ok(()) => {
                        c.conns.pop();
                    }
                    Err(e) => {
                        killed = Err(e);
                        break;
                    }
                }
            }
            let result = killed.and_then(|()| {
                let conn = self.ensure_conn(deadline)?;
                conn.query::<redis::Value>(&c.cmd, "clean-up", deadline)
            });
            match result {
                Ok(v) => log::debug!(
                    "cleaned up after an unanswered acquire of {:?}: {v:?}",
                    c.key
                ),
                Err(e) => {
                    log::debug!("clean-up of {:?} failed ({e}); retrying", c.key);
                    c.retry_at = self.clock.now() + Duration::from_millis(50).min(nt);
                    self.cleanups.push(c);
                }
            }
        }
    }
}
