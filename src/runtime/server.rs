//! One server of a deployment — the standalone server, the current Sentinel
//! primary, or one cluster primary — with everything the crate keeps per
//! server: its command pool, its invalidation subscriber (client ids are
//! per server, and `CLIENT TRACKING … REDIRECT` resolves them locally) and
//! its executor (`respire-io`, one connection of its own), each started the
//! first time it is needed.
//!
//! The executor sends every renewal due at about the same time as one
//! pipeline. A renewal with no reply may still be applied later, so before the
//! leases it carried may be extended again, the connection it went out on is
//! killed (`CLIENT KILL ID … ADDR …` from a fresh connection to the same
//! server: see [`Identity`]) and the kill confirmed; until then their claims
//! stay taken and they are bounded by the worst case. The same executor
//! fences off the connections of user calls that got no reply (a
//! `reset_expiry`, an acquire), retrying the kill while it matters, deletes
//! what an unanswered acquire may have set once its connection is dead, and
//! re-verifies leases after the deployment's topology changed under them. A
//! renewal comes claimed (the schedule claims every due lease); one answered
//! with `MOVED` gives its claim up and is planned again for the new owner; one
//! answered with `ASK` goes, under the same claim, to the target's executor
//! with `ASKING`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

use crate::clock::Clock;
use crate::conn::cluster::{NodeAddr, Redirect, redirect_of};
use crate::conn::{Conn, ConnConfig, Identity, Pool};
use crate::core::executor::{
    Claim, Command, Executor, ExtendReply, RenewalBatch, Settled, extended_in,
};
use crate::core::lease::{Ticket, Verdict};
use crate::core::server_clock::{self, Reading, ServerClock};
use crate::core::timing::{self, Timing};
use crate::error::{Error, Result};
use crate::runtime::registry::Registry;
use crate::runtime::renewal::{Cell, Claims, Counters, DeploymentRenewal, unsent};
use crate::runtime::tracking::{Tracker, Tracking};

/// The pause before a verification that got no answer is tried again.
const VERIFY_RETRY: Duration = Duration::from_millis(50);

/// What an executor needs of the deployment around it.
pub(crate) trait Directory: Send + Sync {
    /// The deployment's renewal thread.
    fn renewal(&self) -> &DeploymentRenewal;
    /// A `MOVED` reply from a node on `host`: `slot` is served by `addr` now.
    /// Returns that node.
    fn moved(&self, slot: u16, addr: &NodeAddr) -> Option<Arc<Server>>;
    /// The node at `addr` (the target of an `ASK`).
    fn node_at(&self, addr: &NodeAddr) -> Option<Arc<Server>>;
    /// A reply suggests the deployment changed (`READONLY`, a server that is
    /// not the primary): look it up again soon.
    fn suspect(&self);
    /// The node that serves `key` now.
    fn current(&self, key: &str) -> Option<Arc<Server>>;
    /// The clock of `server` (its id) was found, by a reading whose reply
    /// came at `detected`, to have run ahead by up to `gain`: cut every live
    /// lease on it but those in `spared` (extended after the reading), and
    /// tell the observer.
    fn clock_gained(
        &self,
        server: u64,
        addr: &str,
        gain: Duration,
        detected: Instant,
        spared: &[u64],
    );
}

/// Work for a node's executor.
pub(crate) enum ServerJob {
    /// Renew these leases, each claimed by the schedule, in one pipeline
    /// (`asking`: each with `ASKING` before it, for a slot this node is
    /// importing). The executor settles each claim, or gives it up when
    /// nothing was sent.
    Renew { leases: Claims, asking: bool },
    /// Check that these leases are still held here (the deployment changed
    /// under them): a missing one is flagged lost at once, and each one held
    /// is bounded by the time it has left here. Retried until it answers or
    /// the lease is lost.
    Verify {
        leases: Vec<Arc<Cell>>,
        asking: bool,
        hops: u8,
    },
    /// A user call's extension of `lease` got no reply on connection `conn`
    /// of this node (`None`: it is not known): kill it, then release the
    /// claim.
    Fence {
        conn: Option<Identity>,
        lease: Arc<Cell>,
        ticket: Ticket,
    },
    /// Acquire attempts got no reply on connections `conns` of this node:
    /// kill them, then run `cmd` (delete what they may have set, by owner;
    /// `None` when a later attempt was granted and only the late arrival of
    /// the unanswered ones must be stopped), until `give_up_at`.
    Cleanup {
        conns: Vec<Identity>,
        cmd: Option<redis::Cmd>,
        key: String,
        give_up_at: Instant,
        /// How many times it followed a `MOVED` already.
        hops: u8,
    },
    /// The node was retired: close the connection, give up the kills that can
    /// no longer matter and hand the rest to the node that serves the keys now.
    Retire,
}

/// One server and the crate's pool, subscriber and executor for it.
pub(crate) struct Server {
    pub(crate) cfg: Arc<ConnConfig>,
    pub(crate) pool: Pool,
    /// The server's host, for redirections that name none.
    pub(crate) host: String,
    dir: Weak<dyn Directory>,
    clock: Arc<dyn Clock>,
    /// The deployment's timing; its node timeout bounds every command here.
    timing: Timing,
    counters: Arc<Counters>,
    registry: Arc<Registry>,
    io: OnceLock<Sender<ServerJob>>,
    tracking: OnceLock<Tracking>,
    start: Mutex<()>,
    retired: Arc<AtomicBool>,
}

impl Server {
    pub(crate) fn new(
        cfg: Arc<ConnConfig>,
        pool_size: usize,
        dir: Weak<dyn Directory>,
        clock: Arc<dyn Clock>,
        timing: Timing,
        counters: Arc<Counters>,
        registry: Arc<Registry>,
    ) -> Server {
        let host = cfg.host_port().map(|(h, _)| h).unwrap_or_default();
        Server {
            pool: Pool::new(cfg.clone(), pool_size),
            cfg,
            host,
            dir,
            clock,
            timing,
            counters,
            registry,
            io: OnceLock::new(),
            tracking: OnceLock::new(),
            start: Mutex::new(()),
            retired: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The server's address, for messages.
    pub(crate) fn addr(&self) -> &str {
        &self.cfg.addr
    }

    /// This server's invalidation subscriber, started on first use.
    pub(crate) fn tracker(&self) -> Result<Arc<Tracker>> {
        if let Some(t) = self.tracking.get() {
            return Ok(t.tracker.clone());
        }
        let _start = self.start.lock();
        if let Some(t) = self.tracking.get() {
            return Ok(t.tracker.clone());
        }
        let t = Tracking::spawn(
            self.cfg.clone(),
            self.timing.node_timeout,
            self.registry.clone(),
        )
        .map_err(|source| Error::Thread {
            name: "respire-tracker",
            source,
        })?;
        Ok(self.tracking.get_or_init(|| t).tracker.clone())
    }

    /// Whether this server's subscriber was started (waiters have used it).
    pub(crate) fn tracking_started(&self) -> bool {
        self.tracking.get().is_some()
    }

    fn executor(&self) -> Result<&Sender<ServerJob>> {
        if let Some(tx) = self.io.get() {
            return Ok(tx);
        }
        let _start = self.start.lock();
        if let Some(tx) = self.io.get() {
            return Ok(tx);
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let worker = ExecutorThread {
            cfg: self.cfg.clone(),
            host: self.host.clone(),
            clock: self.clock.clone(),
            timing: self.timing,
            counters: self.counters.clone(),
            dir: self.dir.clone(),
            retired: self.retired.clone(),
            conn: None,
            machine: Executor::new(self.timing),
            verifies: Vec::new(),
            server_clock: ServerClock::default(),
        };
        std::thread::Builder::new()
            .name("respire-io".into())
            .spawn(move || worker.run(&rx))
            .map_err(|source| Error::Thread {
                name: "respire-io",
                source,
            })?;
        Ok(self.io.get_or_init(|| tx))
    }

    /// Queues work for this node's executor (starting it if needed); false
    /// when it cannot be started.
    pub(crate) fn submit(&self, job: ServerJob) -> bool {
        self.hand(job).is_none()
    }

    /// Hands renewals the schedule claimed to the executor (`asking`: see
    /// [`ServerJob::Renew`]); gives them back when it cannot take them.
    pub(crate) fn submit_renewal(&self, leases: Claims, asking: bool) -> Option<Claims> {
        match self.hand(ServerJob::Renew { leases, asking }) {
            Some(ServerJob::Renew { leases, .. }) => Some(leases),
            _ => None,
        }
    }

    /// Sends `job` to the executor; gives it back when the executor cannot
    /// take it.
    fn hand(&self, job: ServerJob) -> Option<ServerJob> {
        match self.executor() {
            Ok(tx) => tx.send(job).err().map(|e| e.into_inner()),
            Err(e) => {
                log::warn!("cannot start the executor for {}: {e}", self.cfg.addr);
                Some(job)
            }
        }
    }

    /// The server stopped being the deployment's primary (or a cluster
    /// primary): its pooled connections are closed and no more are made, and
    /// its executor closes its own connection, so nothing this server says
    /// moves a lease's bound any more.
    pub(crate) fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        self.pool.close();
        if let Some(tx) = self.io.get() {
            let _ = tx.send(ServerJob::Retire);
        }
    }

    /// Whether [`Server::retire`] was called.
    pub(crate) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.cfg.addr)
            .field("retired", &self.is_retired())
            .finish_non_exhaustive()
    }
}

/// What the transport runs for a clean-up: a delete by owner, or nothing
/// (only the unanswered attempts' connections are killed).
type CleanUpCmd = (Option<redis::Cmd>, String, u8);

struct PendingVerify {
    leases: Vec<Arc<Cell>>,
    asking: bool,
    retry_at: Instant,
}

struct ExecutorThread {
    cfg: Arc<ConnConfig>,
    host: String,
    clock: Arc<dyn Clock>,
    /// The deployment's timing; its node timeout bounds every command here.
    timing: Timing,
    counters: Arc<Counters>,
    dir: Weak<dyn Directory>,
    retired: Arc<AtomicBool>,
    conn: Option<Conn>,
    /// The choreography: claims, fences, clean-ups.
    machine: Executor<Arc<Cell>, CleanUpCmd, Identity>,
    verifies: Vec<PendingVerify>,
    /// The last reading of the server's clock.
    server_clock: ServerClock,
}

/// The redirection an error reply in a pipeline carries.
fn redirection(value: &redis::Value, host: &str) -> Option<Redirect> {
    match value {
        redis::Value::ServerError(e) => redirect_of(e.code(), e.details(), host),
        _ => None,
    }
}

fn is_code(value: &redis::Value, code: &str) -> bool {
    matches!(value, redis::Value::ServerError(e) if e.code() == code)
}

impl ExecutorThread {
    fn run(mut self, rx: &Receiver<ServerJob>) {
        loop {
            let next = self
                .machine
                .poll_timeout()
                .into_iter()
                .chain(self.verifies.iter().map(|v| v.retry_at))
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

    fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    fn handle(&mut self, job: ServerJob) {
        // Sent here after the server was retired (a call that got no reply
        // from it while it was being replaced): what was to be killed or
        // deleted here can no longer reach the server the keys live on now.
        if self.is_retired() {
            self.handle_retired(job);
            return;
        }
        match job {
            ServerJob::Retire => self.retire(),
            ServerJob::Renew { leases, asking } => self.renew(leases, asking),
            ServerJob::Verify {
                leases,
                asking,
                hops,
            } => self.verify(leases, asking, hops),
            ServerJob::Fence {
                conn,
                lease,
                ticket,
            } => self.machine.fence(conn, lease, ticket, self.clock.now()),
            ServerJob::Cleanup {
                conns,
                cmd,
                key,
                give_up_at,
                hops,
            } => {
                let now = self.clock.now();
                self.machine
                    .clean_up(conns, (cmd, key, hops), give_up_at, now);
            }
        }
    }

    /// The server is not the one the keys live on any more: what it would
    /// confirm no longer counts, and a command left unanswered on it can no
    /// longer reach the server the leases live on now (its writes are
    /// discarded when it rejoins as a replica, and a migrated key is not here
    /// any more). So each claim held for a kill here is freed with its worst
    /// case kept in the bound, clean-ups and verifications go to the node that
    /// serves their keys now, and the connection is closed.
    fn retire(&mut self) {
        self.conn = None;
        let now = self.clock.now();
        let dir = self.dir.upgrade();
        let (freed, cleanups) = self.machine.retire(now);
        if let Some(dir) = &dir {
            for lease in &freed {
                dir.renewal().touch(lease);
            }
        }
        let Some(dir) = dir else {
            self.verifies.clear();
            return;
        };
        for c in cleanups {
            let (cmd, key, hops) = c.payload;
            if cmd.is_none() {
                continue;
            }
            match dir.current(&key) {
                Some(node) if !node.is_retired() => {
                    node.submit(ServerJob::Cleanup {
                        conns: Vec::new(),
                        cmd,
                        key,
                        give_up_at: c.give_up_at,
                        hops,
                    });
                }
                _ => log::warn!("no current server for {key:?}: a clean-up there is dropped"),
            }
        }
        let verifies: Vec<Arc<Cell>> = std::mem::take(&mut self.verifies)
            .into_iter()
            .flat_map(|v| v.leases)
            .collect();
        self.hand_over(verifies, now);
    }

    /// A job that arrived after the server was retired. A fence is not
    /// needed any more (the retired server's writes are discarded when it
    /// rejoins as a replica, and a moved key is not on it): the claim is freed
    /// with its worst case kept, as at the retirement. A clean-up's delete by
    /// owner goes to the server that holds the key now; a verification too.
    fn handle_retired(&mut self, job: ServerJob) {
        let now = self.clock.now();
        let dir = self.dir.upgrade();
        match job {
            ServerJob::Retire => self.retire(),
            ServerJob::Renew { leases, .. } => self.renew(leases, false),
            ServerJob::Verify { leases, .. } => self.hand_over(leases, now),
            ServerJob::Fence { lease, ticket, .. } => {
                lease.fenced(ticket, now);
                if let Some(dir) = &dir {
                    dir.renewal().touch(&lease);
                }
            }
            ServerJob::Cleanup {
                cmd: Some(cmd),
                key,
                give_up_at,
                hops,
                ..
            } => match dir.as_ref().and_then(|d| d.current(&key)) {
                Some(node) if !node.is_retired() => {
                    node.submit(ServerJob::Cleanup {
                        conns: Vec::new(),
                        cmd: Some(cmd),
                        key,
                        give_up_at,
                        hops,
                    });
                }
                _ => log::warn!("no current server for {key:?}: a clean-up there is dropped"),
            },
            // Only the late arrival of unanswered attempts was to be stopped:
            // the retired server's writes no longer count.
            ServerJob::Cleanup { cmd: None, .. } => {}
        }
    }

    /// Sends leases to be verified on the nodes that serve their keys now;
    /// those with no node yet are retried here later.
    fn hand_over(&mut self, leases: Vec<Arc<Cell>>, now: Instant) {
        let dir = self.dir.upgrade();
        let mut stay = Vec::new();
        let mut by_node: Vec<(Arc<Server>, Vec<Arc<Cell>>)> = Vec::new();
        for lease in leases {
            match dir.as_ref().and_then(|d| d.current(lease.key())) {
                Some(node) if !node.is_retired() => {
                    match by_node.iter_mut().find(|(n, _)| Arc::ptr_eq(n, &node)) {
                        Some((_, list)) => list.push(lease),
                        None => by_node.push((node, vec![lease])),
                    }
                }
                _ => stay.push(lease),
            }
        }
        for (node, leases) in by_node {
            node.submit(ServerJob::Verify {
                leases,
                asking: false,
                hops: 0,
            });
        }
        if !stay.is_empty() {
            self.verifies.push(PendingVerify {
                leases: stay,
                asking: false,
                retry_at: now + VERIFY_RETRY.min(self.timing.node_timeout),
            });
        }
    }

    /// A connection for the executor's own commands, made within `deadline`.
    fn ensure_conn(&mut self, deadline: Instant) -> Result<&mut Conn> {
        if self.conn.as_ref().is_some_and(Conn::is_broken) {
            self.conn = None;
        }
        if self.conn.is_none() {
            let budget = deadline.saturating_duration_since(self.clock.now());
            match self.cfg.connect(budget, "respire-renewal") {
                Ok(conn) => self.conn = Some(conn),
                Err(e) => {
                    if matches!(e, Error::Topology(_))
                        && let Some(dir) = self.dir.upgrade()
                    {
                        dir.suspect();
                    }
                    return Err(e);
                }
            }
        }
        Ok(self.conn.as_mut().expect("connected above"))
    }

    /// Runs `cmds` as one pipeline (each after `ASKING` when `asking`) and
    /// returns their replies in order.
    fn send(
        &mut self,
        cmds: &[redis::Cmd],
        asking: bool,
        op: &'static str,
        deadline: Instant,
    ) -> Result<Vec<redis::Value>> {
        let mut pipe = redis::pipe();
        for cmd in cmds {
            if asking {
                pipe.cmd("ASKING");
            }
            pipe.add_command(cmd.clone());
        }
        Counters::add(&self.counters.round_trips, 1);
        let conn = self.conn.as_mut().expect("connected by the caller");
        let values = conn.pipeline(&pipe, op, deadline)?;
        Ok(if asking {
            values.into_iter().skip(1).step_by(2).collect()
        } else {
            values
        })
    }

    /// Takes the server's `TIME`, read by a pipeline sent at `sent` and
    /// answered at `received`, as a reading of its clock; when the clock ran
    /// ahead of this process's since the last reading by more than `drift`
    /// allows, every live lease on this server but those in `spared` is cut
    /// by what it gained. Redis expires keys by its wall clock, so a clock
    /// stepped forward ends them that much early.
    fn read_clock(
        &mut self,
        time: &redis::Value,
        sent: Instant,
        received: Instant,
        drift: f64,
        spared: &[u64],
    ) {
        let Some(server) = redis::from_redis_value_ref::<Vec<String>>(time)
            .ok()
            .and_then(|t| server_clock::parse_time(&t))
        else {
            log::debug!("unexpected TIME reply from {}: {time:?}", self.cfg.addr);
            return;
        };
        let reading = Reading {
            server,
            sent,
            received,
        };
        if let Some(gain) = self.server_clock.read(reading, drift)
            && let Some(dir) = self.dir.upgrade()
        {
            dir.clock_gained(self.cfg.server_id(), &self.cfg.addr, gain, received, spared);
        }
    }

    /// Has the next pipeline on the executor's connection followed by `WAIT`
    /// for `acks` (replicas, timeout), when the replication guard asks for it.
    fn arm_wait(&mut self, acks: Option<(u32, Duration)>) {
        if let (Some((replicas, timeout)), Some(conn)) = (acks, self.conn.as_mut()) {
            conn.wait_after_next(replicas, timeout, false);
        }
    }

    /// How many replicas acknowledged the last pipeline (`None` when no
    /// `WAIT` was asked for; 0 when it got no answer).
    fn take_acked(&mut self, acks: Option<(u32, Duration)>) -> Option<u32> {
        let conn = self.conn.as_mut()?;
        let waited = conn.take_waited();
        acks.map(|_| waited.unwrap_or(0))
    }

    /// Kills connection `target` from the executor's connection; Ok once the
    /// server answered that no such connection is open any more.
    ///
    /// It answers 1 (killed now) or 0 (no connection with that id and address
    /// is open), and both rule out that the command left unanswered on
    /// `target` runs later. A server process never reuses an id, so 0 means
    /// the connection was closed before (killed, or cut by either side), or
    /// it belonged to an earlier process of a server that restarted since:
    /// that process's unread commands went with it, and no later process can
    /// run them. What the unanswered command may have done before is not
    /// ruled out, and need not be: its worst effect is assumed already (it
    /// stays in the lease's bound, and a clean-up still deletes by owner after
    /// the kill). A kill that gets no reply is assumed to have killed nothing,
    /// and is tried again.
    ///
    /// The address filter spares the connection of another client that a
    /// restarted server gave the same id; without an address (servers older
    /// than 6.2, or `CLIENT INFO` denied) the kill goes by id alone, and may
    /// close that connection instead.
    fn kill(&mut self, target: &Identity, deadline: Instant) -> Result<()> {
        let conn = self.ensure_conn(deadline)?;
        let r: Result<i64> = conn.query(&target.kill_cmd(), "CLIENT KILL", deadline);

        if r.as_ref().is_err_and(|e| e.is_uncertain()) {
            self.conn = None;
        }
        r.map(|_| Counters::add(&self.counters.killed, 1))
    }

    fn renew(&mut self, batch: Claims, asking: bool) {
        let now = self.clock.now();
        let nt = self.timing.node_timeout;
        let mut done = Vec::with_capacity(batch.len());
        // Queued before the node was retired: plan them again, for the node
        // that serves them now.
        if self.is_retired() {
            let again = Some(now + Duration::from_millis(2));
            self.report(unsent(batch, now, |_| again));
            return;
        }
        // Every step shares one deadline: a node timeout, and never past the
        // earliest loss deadline in the batch (a later reply would not count).
        // Under the replication guard's `Require`, `WAIT` follows the
        // pipeline, and may block for its own timeout.
        let acks = self.cfg.extension_acks;
        let wait = acks.map_or(Duration::ZERO, |(_, timeout)| timeout);
        let earliest = batch
            .iter()
            .map(|(l, _, _)| l.lost_at())
            .min()
            .unwrap_or(now);
        let deadline = (now + nt + wait)
            .min(earliest)
            .max(now + Duration::from_millis(1));
        if let Err(e) = self.ensure_conn(deadline) {
            log::warn!("renewal connection to {} failed: {e}", self.cfg.addr);
            Counters::add(&self.counters.failures, batch.len() as u64);
            let now = self.clock.now();
            done.extend(unsent(batch, now, |l| Some(self.retry_at(l))));
            self.report(done);
            return;
        }
        let mut renewal = RenewalBatch { items: batch };
        // A claim the deployment gave up meanwhile (the key's server changed)
        // is not sent here: the lease is planned again, for its server now.
        let server = self.cfg.server_id();
        renewal.items.retain(|(lease, ticket, _)| {
            let sent = lease.dispatched(*ticket, server);
            if !sent {
                done.push((lease.id(), Some(now + Duration::from_millis(2))));
            }
            sent
        });
        if renewal.items.is_empty() {
            self.report(done);
            return;
        }
        // The server's `TIME` first: the renewals after it run on the clock
        // it reads (see `read_clock`). A server with `SET … IFEQ` extends a
        // lease held as a string value without the script (`by_set`).
        let ifeq = self.conn.as_ref().is_some_and(Conn::has_set_ifeq);
        let mut by_set = Vec::with_capacity(renewal.items.len());
        let cmds: Vec<redis::Cmd> = std::iter::once(redis::cmd("TIME"))
            .chain(renewal.items.iter().map(|(lease, _, ttl)| {
                let set = ifeq
                    .then(|| lease.extra().set_ifeq_cmd(ttl_ms(*ttl)))
                    .flatten();
                by_set.push(set.is_some());
                set.unwrap_or_else(|| lease.extra().extend_cmd(ttl_ms(*ttl)))
            }))
            .collect();
        let conn_id = self.conn.as_ref().and_then(Conn::identity).cloned();
        // How many replicas acknowledged each renewal's write (`None`: no
        // `WAIT` was asked for).
        let mut acked: Vec<Option<u32>> = vec![None; renewal.items.len()];
        self.arm_wait(acks);
        let sent_at = self.clock.now();
        let mut reply = self.send(&cmds, asking, "renew", deadline);
        let received_at = self.clock.now();
        let server_time = match &mut reply {
            Ok(values) if !values.is_empty() => Some(values.remove(0)),
            _ => None,
        };
        let first = self.take_acked(acks);
        acked.iter_mut().for_each(|a| *a = first);
        // A server that lost the script (restarted, SCRIPT FLUSH) gets it with
        // EVAL for those leases, in the time left; so does one that refused
        // `SET` for want of memory (the script's `PEXPIRE` is allowed then).
        if let Ok(values) = &mut reply {
            let missing: Vec<usize> = values
                .iter()
                .enumerate()
                .filter(|(i, v)| is_code(v, "NOSCRIPT") || (by_set[*i] && is_code(v, "OOM")))
                .map(|(i, _)| i)
                .collect();
            if !missing.is_empty() {
                let again: Vec<redis::Cmd> = missing
                    .iter()
                    .map(|&i| {
                        let (lease, _, ttl) = &renewal.items[i];
                        lease.extra().extend_eval(ttl_ms(*ttl))
                    })
                    .collect();
                self.arm_wait(acks);
                let sent = self.send(&again, asking, "renew", deadline);
                let second = self.take_acked(acks);
                match sent {
                    Ok(evals) => {
                        for (i, v) in missing.into_iter().zip(evals) {
                            values[i] = v;
                            acked[i] = second;
                            by_set[i] = false;
                        }
                    }
                    Err(e) => reply = Err(e),
                }
            }
        }
        // What `SET … IFEQ … GET` answered, read as the script's reply.
        if let Ok(values) = &mut reply {
            for ((value, (lease, _, _)), _) in values
                .iter_mut()
                .zip(&renewal.items)
                .zip(&by_set)
                .filter(|(_, set)| **set)
            {
                if let Some(code) = lease.extra().set_ifeq_code(value) {
                    *value = redis::Value::Int(code);
                }
            }
        }
        let now = self.clock.now();
        // Retired while the pipeline was out: what the old server says no
        // longer counts, and what it did not apply never reaches the new one.
        // The leases are planned again, for the server that holds them now.
        if self.is_retired() {
            self.conn = None;
            let len = renewal.items.len();
            done.extend(
                self.machine
                    .renewed(
                        renewal,
                        std::iter::repeat_n(ExtendReply::Unreadable, len),
                        now,
                    )
                    .into_iter()
                    .map(|(lease, _, _)| (lease.id(), Some(now + Duration::from_millis(2)))),
            );
            self.report(done);
            return;
        }
        match reply {
            Ok(all) => {
                // Answered with `ASK` (the key was migrated): not run here,
                // and sent, under the same claim, to the target.
                let mut forward: Vec<(NodeAddr, Claims)> = Vec::new();
                let mut values = Vec::with_capacity(all.len());
                let mut replies = Vec::with_capacity(all.len());
                let items = std::mem::take(&mut renewal.items);
                for ((item, value), acked) in items.into_iter().zip(all).zip(&acked) {
                    if let (Some(Redirect::Ask { addr }), false) =
                        (redirection(&value, &self.host), asking)
                    {
                        match forward.iter_mut().find(|(a, _)| *a == addr) {
                            Some((_, leases)) => leases.push(item),
                            None => forward.push((addr, vec![item])),
                        }
                        continue;
                    }
                    renewal.items.push(item);
                    replies.push(match &value {
                        // Applied by the primary, but a replica promoted now
                        // may not have it: it does not count.
                        redis::Value::Int(1)
                            if acks.is_some_and(|(n, _)| acked.unwrap_or(0) < n) =>
                        {
                            ExtendReply::Unreplicated
                        }
                        redis::Value::Int(n) => ExtendReply::of(*n),
                        // An error reply (a refusal, a server busy, loading,
                        // read-only, migrating or redirected): not run.
                        _ => ExtendReply::NotRun,
                    });
                    values.push(value);
                }
                let settled = self.machine.renewed(renewal, replies, now);
                let spared = extended_in(&settled);
                let drift = settled.first().map(|(l, _, _)| l.drift_factor());
                if let (Some(time), Some(drift)) = (&server_time, drift) {
                    self.read_clock(time, sent_at, received_at, drift, &spared);
                }
                for ((lease, outcome, retry), value) in settled.into_iter().zip(&values) {
                    match (outcome, redirection(value, &self.host)) {
                        // The slot is served elsewhere now: the map is updated
                        // and the renewal planned again at once.
                        (_, Some(Redirect::Moved { slot, addr })) => {
                            if let Some(dir) = self.dir.upgrade() {
                                dir.moved(slot, &addr);
                            }
                            done.push((lease.id(), Some(now + Duration::from_millis(2))));
                        }
                        (Settled::Held, _) => {
                            Counters::add(&self.counters.renewals, 1);
                            done.push((lease.id(), None));
                        }
                        (Settled::Lost, _) => {
                            Counters::add(&self.counters.losses, 1);
                            done.push((lease.id(), None));
                        }
                        // Confirmed by a server the lease no longer lives on
                        // (a switch while it ran): it counts for nothing, and
                        // the schedule plans the next renewal from the bound.
                        (Settled::Stale, _) => done.push((lease.id(), None)),
                        (Settled::Unreplicated, _) => {
                            log::warn!(
                                "a renewal of {:?} was not acknowledged by the replicas the \
                                 replication guard requires: it does not count",
                                lease.key()
                            );
                            Counters::add(&self.counters.failures, 1);
                            done.push((lease.id(), retry.or(Some(self.retry_at(&lease)))));
                        }
                        (Settled::NotRun | Settled::Unreadable, _) => {
                            log::warn!("unexpected renewal reply for {:?}: {value:?}", lease.key());
                            if is_code(value, "READONLY")
                                && let Some(dir) = self.dir.upgrade()
                            {
                                dir.suspect();
                            }
                            Counters::add(&self.counters.failures, 1);
                            done.push((lease.id(), retry.or(Some(self.retry_at(&lease)))));
                        }
                    }
                }
                self.forward_asking(forward, &mut done);
            }
            Err(e) => {
                log::warn!(
                    "renewing {} lease(s) on {} failed: {e}",
                    renewal.items.len(),
                    self.cfg.addr
                );
                Counters::add(&self.counters.failures, renewal.items.len() as u64);
                self.conn = None;
                done.extend(self.machine.renewal_unanswered(renewal, conn_id, now));
                // Fence at once, so the leases can be renewed again in time.
                self.retry_pending();
            }
        }
        self.report(done);
    }

    /// Hands renewals answered with `ASK` to the executors of their targets,
    /// claims and all; those report them. Any that cannot be handed over give
    /// up their claims and are retried.
    fn forward_asking(
        &self,
        forward: Vec<(NodeAddr, Claims)>,
        done: &mut Vec<(u64, Option<Instant>)>,
    ) {
        let dir = self.dir.upgrade();
        for (addr, leases) in forward {
            let refused = match dir.as_ref().and_then(|d| d.node_at(&addr)) {
                Some(node) => node.submit_renewal(leases, true),
                None => Some(leases),
            };
            if let Some(leases) = refused {
                let now = self.clock.now();
                done.extend(unsent(leases, now, |l| Some(self.retry_at(l))));
            }
        }
    }

    /// Checks leases after the deployment changed under them: gone or taken
    /// over here ⇒ lost now; held ⇒ bounded by the time left here (a new
    /// primary may have the expiry of an older grant or extension than the
    /// guard counts on). No reply ⇒ tried again until the leases are lost.
    fn verify(&mut self, leases: Vec<Arc<Cell>>, asking: bool, hops: u8) {
        let now = self.clock.now();
        let leases: Vec<Arc<Cell>> = leases
            .into_iter()
            .filter(|l| !l.is_finished() && !l.is_lost(now))
            .collect();
        if leases.is_empty() {
            return;
        }
        if self.is_retired() {
            self.hand_over(leases, now);
            return;
        }
        let deadline = now + self.timing.node_timeout;
        if let Err(e) = self.ensure_conn(deadline) {
            log::debug!(
                "cannot re-verify {} lease(s) on {}: {e}; retrying",
                leases.len(),
                self.cfg.addr
            );
            self.verify_later(leases, asking);
            return;
        }
        let sent = self.clock.now();
        let cmds: Vec<redis::Cmd> = leases.iter().map(|l| l.extra().verify_cmd(false)).collect();
        let mut values = match self.send(&cmds, asking, "verify", deadline) {
            Ok(values) => values,
            Err(e) => {
                log::debug!(
                    "re-verifying leases on {} failed: {e}; retrying",
                    self.cfg.addr
                );
                if e.is_uncertain() {
                    self.conn = None;
                }
                self.verify_later(leases, asking);
                return;
            }
        };
        let missing: Vec<usize> = (0..values.len())
            .filter(|&i| is_code(&values[i], "NOSCRIPT"))
            .collect();
        if !missing.is_empty() {
            let again: Vec<redis::Cmd> = missing
                .iter()
                .map(|&i| leases[i].extra().verify_cmd(true))
                .collect();
            if let Ok(evals) = self.send(&again, asking, "verify", deadline) {
                for (i, v) in missing.into_iter().zip(evals) {
                    values[i] = v;
                }
            }
        }
        let now = self.clock.now();
        let dir = self.dir.upgrade();
        let mut elsewhere: Vec<(Arc<Server>, bool, Vec<Arc<Cell>>)> = Vec::new();
        let mut again = Vec::new();
        for (lease, value) in leases.into_iter().zip(values) {
            let redirect = redirection(&value, &self.host);
            if redirect.is_some() {
                let target = match (&redirect, &dir) {
                    (Some(Redirect::Moved { slot, addr }), Some(dir)) => {
                        dir.moved(*slot, addr).map(|n| (n, false))
                    }
                    (Some(Redirect::Ask { addr }), Some(dir)) => {
                        dir.node_at(addr).map(|n| (n, true))
                    }
                    _ => None,
                };
                match target {
                    // Followed a few hops at once; past that (a map still
                    // settling) the lease is verified again after a pause.
                    Some((node, ask)) if hops < 2 => {
                        match elsewhere
                            .iter_mut()
                            .find(|(n, a, _)| Arc::ptr_eq(n, &node) && *a == ask)
                        {
                            Some((_, _, list)) => list.push(lease),
                            None => elsewhere.push((node, ask, vec![lease])),
                        }
                    }
                    _ => again.push(lease),
                }
                continue;
            }
            let verdict = match &value {
                redis::Value::Array(items) => {
                    let ints: Option<Vec<i64>> = items
                        .iter()
                        .map(|v| match v {
                            redis::Value::Int(n) => Some(*n),
                            _ => None,
                        })
                        .collect();
                    ints.as_deref().and_then(Verdict::of)
                }
                _ => None,
            };
            match verdict {
                Some(verdict) => {
                    let gone = matches!(verdict, Verdict::Lost(_));
                    if !lease.verified(verdict, sent, now) {
                        if gone {
                            log::warn!(
                                "lease {:?} is not held on {} after the deployment changed",
                                lease.key(),
                                self.cfg.addr
                            );
                        }
                        Counters::add(&self.counters.losses, 1);
                    }
                    if let Some(dir) = &dir {
                        dir.renewal().touch(&lease);
                    }
                }
                None => {
                    log::debug!(
                        "unexpected verification reply for {:?} on {}: {value:?}; retrying",
                        lease.key(),
                        self.cfg.addr
                    );
                    if is_code(&value, "READONLY")
                        && let Some(dir) = &dir
                    {
                        dir.suspect();
                    }
                    again.push(lease);
                }
            }
        }
        for (node, asking, leases) in elsewhere {
            node.submit(ServerJob::Verify {
                leases,
                asking,
                hops: hops + 1,
            });
        }
        if !again.is_empty() {
            self.verify_later(again, false);
        }
    }

    /// Plans another verification of `leases` here after a pause.
    fn verify_later(&mut self, leases: Vec<Arc<Cell>>, asking: bool) {
        self.verifies.push(PendingVerify {
            leases,
            asking,
            retry_at: self.clock.now() + VERIFY_RETRY.min(self.timing.node_timeout),
        });
    }

    fn retry_at(&self, lease: &Cell) -> Instant {
        self.clock.now() + timing::retry_delay(lease.ttl())
    }

    fn report(&self, done: Vec<(u64, Option<Instant>)>) {
        if let Some(dir) = self.dir.upgrade() {
            dir.renewal().completed(done);
        }
    }

    /// Retries the kills, clean-ups and verifications that are due.
    fn retry_pending(&mut self) {
        let now = self.clock.now();
        let nt = self.timing.node_timeout;
        let (due, later): (Vec<PendingVerify>, Vec<PendingVerify>) =
            std::mem::take(&mut self.verifies)
                .into_iter()
                .partition(|v| v.retry_at <= now);
        self.verifies = later;
        for v in due {
            self.verify(v.leases, v.asking, 0);
        }
        loop {
            let now = self.clock.now();
            let deadline = now + nt;
            let command = match self.machine.poll_command(now) {
                None => return,
                Some(Command::Kill(target)) => Step::Kill(target),
                Some(Command::CleanUp((cmd, key, _))) => Step::CleanUp(cmd.clone(), key.clone()),
            };
            match command {
                Step::Kill(target) => {
                    let killed = self.kill(&target, deadline);
                    if let Err(e) = &killed {
                        log::warn!(
                            "could not kill connection {} on {} after a command on it got \
                             no reply: {e}; retrying",
                            target.id(),
                            self.cfg.addr
                        );
                    }
                    let freed = self.machine.kill_done(killed.is_ok(), self.clock.now());
                    if let Some(dir) = self.dir.upgrade() {
                        for lease in &freed {
                            dir.renewal().touch(lease);
                        }
                    }
                }
                Step::CleanUp(cmd, key) => {
                    let result = match &cmd {
                        Some(cmd) => self
                            .ensure_conn(deadline)
                            .and_then(|conn| conn.query::<redis::Value>(cmd, "clean-up", deadline)),
                        None => Ok(redis::Value::Nil),
                    };
                    let now = self.clock.now();
                    match result {
                        Ok(v) => {
                            log::debug!("clean-up on {key:?} ran: {v:?}");
                            self.machine.clean_up_done(true, now);
                        }
                        Err(e) => {
                            // The key's slot is served elsewhere now: clean up
                            // there (the connections here are dead already).
                            if let Some(Redirect::Moved { slot, addr }) =
                                crate::conn::cluster::redirect(&e, &self.host)
                                && let Some(node) =
                                    self.dir.upgrade().and_then(|d| d.moved(slot, &addr))
                                && let Some(c) = self.machine.clean_up_moved()
                            {
                                let (cmd, key, hops) = c.payload;
                                node.submit(ServerJob::Cleanup {
                                    conns: Vec::new(),
                                    cmd,
                                    key,
                                    give_up_at: c.give_up_at,
                                    hops: hops + 1,
                                });
                                continue;
                            }
                            log::debug!("clean-up of {key:?} failed ({e}); retrying");
                            self.machine.clean_up_done(false, now);
                        }
                    }
                }
            }
        }
    }
}

/// A command of the machine, owned, so the executor can run it.
enum Step {
    Kill(Identity),
    CleanUp(Option<redis::Cmd>, String),
}

/// A TTL as whole milliseconds for a script argument (at least 1).
fn ttl_ms(ttl: Duration) -> u64 {
    crate::keys::ttl_ms(ttl).unwrap_or(1)
}
