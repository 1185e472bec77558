//! The Redlock node workers: one thread per node of a `RedlockGroup`, each with
//! its own connection, the transport of that node's machine
//! (`core::redlock::Node`, which the simulation drives too, and whose docs
//! give the rules it keeps: one node's jobs in order, a command without a
//! reply fenced off by killing its connection before anything else is sent
//! there, a late release still sent). A group operation sends one job to every
//! worker and waits for replies only until its outcome is decided; a job
//! still running then is finished (or times out) in the background.
//!
//! Connections are made outside the operations' budgets. Every worker connects
//! when the group is created (all nodes at once), in one round trip after the
//! handshake: `CLIENT SETNAME` + `CLIENT ID` + `CLIENT INFO`, `INFO` (run id,
//! replication id, cluster mode, uptime), `SCRIPT EXISTS` for the two scripts
//! (a script the server lacks goes out as EVAL at once, so every operation is
//! one round trip) and, at creation, a `CLIENT KILL` of an id no client has
//! (the group needs that right). That round trip is the node's measured round
//! trip. When a connection fails, a short-lived connector thread
//! (`respire-conn-N`) makes a new one in the background, with pauses of 25 ms
//! doubling to 1 s between failed tries, and kills the tainted connection
//! from it (`CLIENT KILL ID … ADDR …`); until it is ready, the worker answers
//! acquires and extensions "not connected" at once, and keeps the releases to
//! send once it is. Each node's watcher (`respire-watch-N`) is here too.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};

use super::{Group, RedlockNode};
use crate::clock::Clock;
use crate::conn::{Conn, ConnConfig, Identity};
use crate::core::quorum::Vote;
pub(crate) use crate::core::redlock::NodeSettings;
use crate::core::redlock::ROUND_TRIPS_PER_TIMEOUT;
use crate::core::redlock::{
    self as machine, Action, Answer, Connected, Node, NodeReply, ServerInfo, fences_for,
    parse_info, started_by,
};
use crate::core::redlock::{NodeLease, Op};
use crate::core::timing::{rest_after, try_budget};
use crate::error::{Error, Result};
use crate::lease::lock::{Answer as PlainAnswer, answer, set_command};
use crate::lease::unexpected_acquire;
use crate::report::NodeOutcome;
use crate::scripts::{self, Script};

/// The name node connections carry in `CLIENT LIST`.
pub(crate) const CONN_NAME: &str = "respire-redlock";

/// How many more round-trip samples a node whose setup round trip looked too
/// slow for the node timeout gets, while the group is made, before the
/// fastest of them is taken as its round trip. A busy host (a loaded CI
/// machine, a test's delaying proxy) can slow a few in a row.
const EXTRA_SAMPLES: u32 = 4;

/// One node's answer to one job.
#[derive(Clone, Debug)]
pub(crate) struct Reply {
    pub(crate) node: usize,
    /// The job's tag, echoed.
    pub(crate) tag: u64,
    pub(crate) outcome: NodeOutcome,
    pub(crate) vote: Vote,
    /// From the send to the reply; `None` when nothing was sent.
    pub(crate) latency: Option<Duration>,
    /// The node's failure, when trying again will not cure it (credentials,
    /// permissions, an error reply).
    pub(crate) permanent: Option<Arc<Error>>,
}

/// Where a job's answer goes.
#[derive(Clone)]
pub(crate) enum ReplyTo {
    /// A channel that fan-outs share, told apart by their tags (the renewal
    /// thread's).
    Channel(Sender<Reply>),
    /// One fan-out's answers, for the one thread that waits for them.
    Gather(Arc<Gather>),
}

impl ReplyTo {
    fn deliver(self, reply: Reply) {
        match self {
            ReplyTo::Channel(tx) => {
                let _ = tx.try_send(reply);
            }
            ReplyTo::Gather(gather) => gather.add(reply),
        }
    }
}

/// How many times a thread waiting for a fan-out's answers lets others run
/// before it sleeps: on a CPU shared with the node workers that is often all
/// it takes for an answer to come, without a wake-up call (as
/// `crossbeam-channel`'s receivers do before they block).
const GATHER_YIELDS: u32 = 10;

/// The answers of one fan-out, gathered for the thread that created it: a
/// worker adds its answer and wakes that thread. Answers that come after the
/// thread stopped waiting go with the last handle on it.
///
/// A fan-out allocates this and nothing else to hear its answers (a channel
/// of its own cost several times as much on the calling thread).
pub(crate) struct Gather {
    replies: Mutex<VecDeque<Reply>>,
    waiter: std::thread::Thread,
}

impl Gather {
    /// For the calling thread, the only one that may wait on it, and room
    /// for `capacity` answers.
    pub(crate) fn new(capacity: usize) -> Arc<Gather> {
        Arc::new(Gather {
            replies: Mutex::new(VecDeque::with_capacity(capacity)),
            waiter: std::thread::current(),
        })
    }

    fn add(&self, reply: Reply) {
        self.replies.lock().push_back(reply);
        self.waiter.unpark();
    }

    /// The next answer, waiting for it until `deadline`; `None` when none
    /// came by then. Only the thread that created it may call this: it parks
    /// that thread (and takes a wake-up left by a late answer of an earlier
    /// fan-out as one that may have come too early, checking again).
    pub(crate) fn next(&self, deadline: Instant, clock: &dyn Clock) -> Option<Reply> {
        let mut yields = 0;
        loop {
            if let Some(reply) = self.replies.lock().pop_front() {
                return Some(reply);
            }
            let now = clock.now();
            if now >= deadline {
                return None;
            }
            if yields < GATHER_YIELDS {
                yields += 1;
                std::thread::yield_now();
            } else {
                std::thread::park_timeout(deadline - now);
            }
        }
    }
}

/// One node's share of a group operation.
pub(crate) struct Job {
    pub(crate) op: Op,
    pub(crate) lease: Arc<NodeLease>,
    /// Not sent after this (but a release is); the command's own timeout ends here.
    pub(crate) deadline: Instant,
    pub(crate) route: Route,
}

/// Where a job's answer goes, and what its end counts down.
#[derive(Clone, Default)]
pub(crate) struct Route {
    /// Where the reply goes; `None` for fire-and-forget clean-up.
    pub(crate) reply: Option<ReplyTo>,
    /// Echoed in the reply, to tell fan-outs sharing one channel apart.
    pub(crate) tag: u64,
    /// Counted down when the job is finished, whatever its outcome.
    pub(crate) done: Option<Arc<Completion>>,
}

/// Runs a closure once every job of one fan-out is finished, and its decider
/// has had its say (it holds one count of its own).
pub(crate) struct Completion {
    remaining: AtomicUsize,
    then: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl Completion {
    /// For `jobs` jobs plus the decider.
    pub(crate) fn new(jobs: usize) -> Arc<Completion> {
        Arc::new(Completion {
            remaining: AtomicUsize::new(jobs + 1),
            then: Mutex::new(None),
        })
    }

    /// Sets what runs at the end (the decider calls this, then [`Completion::finish`]).
    pub(crate) fn then(&self, f: impl FnOnce() + Send + 'static) {
        *self.then.lock() = Some(Box::new(f));
    }

    /// One job, or the decider, is finished.
    pub(crate) fn finish(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1
            && let Some(f) = self.then.lock().take()
        {
            f();
        }
    }
}

/// What a node's first connection found, for the group's checks.
#[derive(Clone, Debug)]
pub(crate) struct Hello {
    pub(crate) info: ServerInfo,
    /// The smallest of the setup round trip and, while the smallest so far
    /// was more than half the node timeout, up to [`EXTRA_SAMPLES`] more samples.
    pub(crate) round_trip: Duration,
}

/// The handle on one worker thread; the thread finishes the queued jobs and
/// stops when the handle is dropped.
pub(crate) struct NodeWorker {
    tx: Sender<Job>,
    progress: Arc<Progress>,
    pub(crate) addr: String,
    /// The node as the worker last saw it.
    status: Arc<Mutex<RedlockNode>>,
    /// Disconnects when the thread ends.
    ended: Receiver<()>,
    thread: std::thread::ThreadId,
}

/// How many jobs were queued on a worker, and how many it has taken up: a
/// job is taken up once its command was sent and answered (or timed out), or
/// it was answered without one, or kept for the next connection (a release
/// while the node reconnects).
#[derive(Default)]
struct Progress {
    queued: AtomicU64,
    taken: Mutex<u64>,
    changed: Condvar,
}

impl Progress {
    fn took(&self, jobs: u64) {
        *self.taken.lock() += jobs;
        self.changed.notify_all();
    }
}

/// Waits until every worker has taken up the jobs queued on it before this
/// call, or until `deadline`; a worker's own thread does not wait for itself.
pub(crate) fn flush(workers: &[NodeWorker], deadline: Instant) {
    let me = std::thread::current().id();
    let targets: Vec<u64> = workers
        .iter()
        .map(|w| w.progress.queued.load(Ordering::Acquire))
        .collect();
    for (w, target) in workers.iter().zip(targets) {
        if w.thread == me {
            continue;
        }
        let mut taken = w.progress.taken.lock();
        while *taken < target {
            if w.progress
                .changed
                .wait_until(&mut taken, deadline)
                .timed_out()
            {
                return;
            }
        }
    }
}

/// Stops the workers after the jobs already queued (releases of dropped
/// guards), waiting for them until `deadline`; a worker dropping its own group
/// is not waited for.
pub(crate) fn stop(workers: Vec<NodeWorker>, deadline: Instant) {
    let me = std::thread::current().id();
    let waits: Vec<(Receiver<()>, std::thread::ThreadId)> =
        workers.into_iter().map(|w| (w.ended, w.thread)).collect();
    for (ended, thread) in waits {
        if thread != me {
            let _ = ended.recv_deadline(deadline);
        }
    }
}

impl NodeWorker {
    /// Starts the worker of node `index`, whose keys have `prefix`. It
    /// connects at once (bounded by the connect timeout) and says how that
    /// went on `hello`; a worker that could not connect ends there.
    pub(crate) fn spawn(
        index: usize,
        cfg: Arc<ConnConfig>,
        prefix: String,
        settings: NodeSettings,
        hello: Sender<(usize, Result<Hello>)>,
    ) -> std::io::Result<NodeWorker> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let addr = cfg.addr.to_string();
        let status = Arc::new(Mutex::new(RedlockNode {
            addr: addr.clone(),
            key_prefix: prefix,
            round_trip: None,
            connected: false,
            last_error: None,
        }));
        let worker_status = status.clone();
        let progress = Arc::new(Progress::default());
        let worker_progress = progress.clone();
        let (end_tx, ended) = crossbeam_channel::bounded::<()>(0);
        let handle = std::thread::Builder::new()
            .name(format!("respire-node-{index}"))
            .spawn(move || {
                let _end = end_tx;
                let nt = settings.timing.node_timeout;
                let first = match open_node(&cfg, cfg.connect_timeout, &[], None, true, nt) {
                    Ok(first) => first,
                    Err(e) => {
                        let _ = hello.send((index, Err(e)));
                        return;
                    }
                };
                let greeting = Hello {
                    info: first.info.clone(),
                    round_trip: first.round_trip,
                };
                let node = Node::new(index, cfg.addr.to_string(), settings, first.connected());
                let mut worker = Worker {
                    index,
                    cfg,
                    settings,
                    rx,
                    node,
                    conn: None,
                    connector: None,
                    status: worker_status,
                    progress: worker_progress,
                };
                worker.adopt_conn(first);
                if hello.send((index, Ok(greeting))).is_err() {
                    return;
                }
                worker.serve();
            })?;
        Ok(NodeWorker {
            tx,
            progress,
            addr,
            status,
            ended,
            thread: handle.thread().id(),
        })
    }

    /// The node as its worker last saw it.
    pub(crate) fn status(&self) -> RedlockNode {
        self.status.lock().clone()
    }

    /// Queues a job. If the thread is gone (it never panics, so only at
    /// shutdown), the reply says so.
    pub(crate) fn send(&self, index: usize, job: Job) {
        self.progress.queued.fetch_add(1, Ordering::AcqRel);
        if let Err(e) = self.tx.send(job) {
            self.progress.took(1);
            let job = e.into_inner();
            let stopped = NodeOutcome::Failed("the node's worker thread stopped".into());
            let handle = Handle {
                route: job.route,
                started: job.deadline,
            };
            handle.answer(
                index,
                Answer::of(stopped, Vote::Unknown, false),
                job.deadline,
            );
        }
    }
}

/// A connection made by [`open_node`].
struct NodeConn {
    conn: Conn,
    info: ServerInfo,
    round_trip: Duration,
    started_by: Option<Instant>,
}

impl NodeConn {
    /// What the node's machine needs to know of it.
    fn connected(&self) -> Connected {
        Connected {
            id: self.conn.identity().cloned(),
            run_id: self.info.run_id.as_deref().map(Arc::from),
            started_by: self.started_by,
            round_trip: self.round_trip,
        }
    }
}

/// What a connector says after each try: the new connection, or why the try
/// failed.
type Tried = Result<Box<NodeConn>>;

/// The connector thread at work; it stops when this is dropped.
struct Connector {
    rx: Receiver<Tried>,
    _stop: Sender<()>,
}

/// How a job is answered: where its reply goes, and when it was taken up.
struct Handle {
    route: Route,
    started: Instant,
}

impl Handle {
    /// Answers the job as node `node`, at `now`.
    fn answer(self, node: usize, answer: Answer, now: Instant) {
        if let Some(reply) = self.route.reply {
            reply.deliver(Reply {
                node,
                tag: self.route.tag,
                outcome: answer.outcome,
                vote: answer.vote,
                latency: answer
                    .sent
                    .then(|| now.saturating_duration_since(self.started)),
                permanent: answer.permanent,
            });
        }
        if let Some(done) = self.route.done {
            done.finish();
        }
    }
}

/// The worker thread: the transport of one [`Node`] machine, which decides
/// what is sent, answered, kept and fenced off.
struct Worker {
    index: usize,
    cfg: Arc<ConnConfig>,
    settings: NodeSettings,
    rx: Receiver<Job>,
    node: Node<Handle>,
    /// The connection the machine uses, while it has one.
    conn: Option<Conn>,
    /// Making a new connection, while the machine has none.
    connector: Option<Connector>,
    status: Arc<Mutex<RedlockNode>>,
    progress: Arc<Progress>,
}

impl Worker {
    fn serve(&mut self) {
        let jobs = self.rx.clone();
        // After the handle is dropped, the jobs already queued (releases from
        // dropped guards) still run; then `recv` fails and the loop ends.
        loop {
            let Some(tried) = self.connector.as_ref().map(|c| c.rx.clone()) else {
                // Connected, or not trying: a plain receive, the cheapest wait.
                match jobs.recv() {
                    Ok(job) => self.handle(job),
                    Err(_) => break,
                }
                continue;
            };
            crossbeam_channel::select! {
                recv(jobs) -> job => {
                    let Ok(job) = job else { break };
                    // A connection that is ready serves the job.
                    while let Ok(t) = tried.try_recv() {
                        self.tried(t);
                    }
                    self.handle(job);
                }
                recv(tried) -> t => match t {
                    Ok(t) => self.tried(t),
                    Err(_) => {
                        self.connector = None;
                        self.node.handle_connector_gone("the connector stopped".into());
                    }
                },
            }
        }
        self.last_releases();
    }

    /// Before the thread ends: releases still waiting for a connection get
    /// one more connect timeout.
    fn last_releases(&mut self) {
        let until = self.cfg.clock.now() + self.cfg.connect_timeout;
        while !self.node.is_connected() && self.node.deferred() > 0 {
            let Some(rx) = self.connector.as_ref().map(|c| c.rx.clone()) else {
                break;
            };
            match rx.recv_deadline(until) {
                Ok(t) => self.tried(t),
                Err(_) => break,
            }
        }
        if self.node.deferred() > 0 {
            log::warn!(
                "redlock node {}: {} releases not sent before the group stopped ({}); those \
                 leases end at their expiry",
                self.cfg.addr,
                self.node.deferred(),
                self.node.why()
            );
        }
    }

    fn handle(&mut self, job: Job) {
        let now = self.cfg.clock.now();
        let handle = Handle {
            route: job.route,
            started: now,
        };
        self.node
            .handle_job(machine::Job::new(job.op, job.lease, job.deadline, handle));
        self.drive_from(now);
        self.progress.took(1);
    }

    /// Does what the machine asks until it waits for something, with the
    /// clock read at `now`, and read again after each step that can take time (a command, an answer, which may let
    /// the waiting thread run first, a connector's start): the machine's own
    /// steps take next to none.
    fn drive_from(&mut self, mut now: Instant) {
        while let Some(action) = self.node.poll(now) {
            match action {
                Action::Respond { handle, answer } => {
                    handle.answer(self.index, answer, now);
                    now = self.cfg.clock.now();
                }
                Action::Connect { tainted, run_id } => {
                    self.start_connector(tainted, run_id);
                    now = self.cfg.clock.now();
                }
                Action::Send {
                    op,
                    lease,
                    deadline,
                } => {
                    let sent = now;
                    let result = self.run_command(op, &lease, deadline);
                    now = self.cfg.clock.now();
                    let broken = self.conn.as_ref().is_none_or(Conn::is_broken);
                    self.node.handle_result(result, broken, now - sent);
                    if !self.node.is_connected() && self.conn.take().is_some() {
                        let mut status = self.status.lock();
                        status.connected = false;
                        status.last_error = Some(self.node.why().to_owned());
                    }
                }
            }
        }
    }

    /// Sends one command and reads its reply off the wire.
    fn run_command(&mut self, op: Op, lease: &NodeLease, deadline: Instant) -> Result<NodeReply> {
        let key = lease.key(self.index);
        let value = lease.value();
        let Some(conn) = self.conn.as_mut() else {
            return Err(Error::UnexpectedReply {
                op: "redlock node",
                reply: "no connection to send on".into(),
            });
        };
        match op {
            // Both round trips within the same deadline.
            Op::Acquire { ttl_ms } => node_acquire(key, value, ttl_ms, |p| {
                conn.pipeline(p, "acquire", deadline)
            })?,
            Op::Extend { ttl_ms } => conn
                .script(
                    &scripts::LEASE_EXTEND,
                    &[key],
                    &[value, &ttl_ms.to_string()],
                    "extend",
                    deadline,
                )
                .map(NodeReply::Extend),
            Op::Release => conn
                .script(
                    &scripts::LEASE_RELEASE,
                    &[key],
                    &[value, "exact"],
                    "release",
                    deadline,
                )
                .map(NodeReply::Release),
        }
    }

    fn start_connector(&mut self, tainted: Vec<Identity>, run_id: Option<Arc<str>>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        let cfg = self.cfg.clone();
        let nt = self.settings.timing.node_timeout;
        let spawned = std::thread::Builder::new()
            .name(format!("respire-conn-{}", self.index))
            .spawn(move || reconnect(&cfg, &tainted, run_id.as_deref(), nt, &tx, &stop_rx));
        match spawned {
            Ok(_) => {
                self.connector = Some(Connector { rx, _stop: stop_tx });
            }
            Err(e) => {
                // Tried again with the next job.
                log::warn!(
                    "redlock node {}: cannot start its connector thread: {e}",
                    self.cfg.addr
                );
                self.node
                    .handle_connector_gone(format!("cannot start the connector thread: {e}"));
            }
        }
    }

    /// A connector's news.
    fn tried(&mut self, tried: Tried) {
        match tried {
            Ok(node) => {
                self.connector = None;
                self.adopt(*node);
                self.drive_from(self.cfg.clock.now());
            }
            Err(e) => {
                log::debug!("redlock node {}: reconnect failed: {e}", self.cfg.addr);
                self.node.handle_connect_failed(&e);
                self.status.lock().last_error = Some(self.node.why().to_owned());
            }
        }
    }

    /// Starts using a new connection.
    fn adopt(&mut self, node: NodeConn) {
        self.node
            .handle_connected(node.connected(), self.cfg.clock.now());
        self.adopt_conn(node);
    }

    fn adopt_conn(&mut self, node: NodeConn) {
        let mut status = self.status.lock();
        status.connected = true;
        status.round_trip = Some(node.round_trip);
        status.last_error = None;
        drop(status);
        self.conn = Some(node.conn);
    }
}

/// An acquire's round trips, each sent by `run`, and what they answered:
/// `SET NX PX`, plain commands and no script, all an uncontended attempt
/// sends (on one CPU, the server's work for two more commands on every node
/// showed in every attempt); only when it found the key set, a second round
/// trip asks `GET` (a key of another type is an error, not a holder) and
/// `PTTL` (how long the holder has). Every attempt has its own owner value, so
/// a late duplicate finds the key set and changes nothing. The replies are
/// read as a plain lock's attempt in its older form is; the outer `Err` is
/// `run`'s own.
pub(crate) fn node_acquire<E>(
    key: &str,
    value: &str,
    ttl_ms: u64,
    mut run: impl FnMut(&redis::Pipeline) -> Result<Vec<redis::Value>, E>,
) -> Result<Result<NodeReply>, E> {
    let mut set = redis::pipe();
    set.ignore_errors();
    set.add_command(set_command(key, value, ttl_ms, false));
    let mut reply = run(&set)?;
    if matches!(reply[..], [redis::Value::Nil]) {
        let mut read = redis::pipe();
        read.ignore_errors();
        read.cmd("GET").arg(key).cmd("PTTL").arg(key);
        reply.extend(run(&read)?);
    }
    Ok(match answer(&reply, false, value.as_bytes()) {
        PlainAnswer::Set | PlainAnswer::Mine => Ok(NodeReply::Acquired),
        PlainAnswer::Held(remaining) => Ok(NodeReply::Held { remaining }),
        PlainAnswer::Refused(e) => Err(crate::error::acquire_refused(key, e)),
        PlainAnswer::NoSetGet | PlainAnswer::Unexpected => Err(unexpected_acquire(&reply)),
    })
}

/// The connector thread: tries to connect until it succeeds or the worker is
/// gone, pausing between failed tries.
fn reconnect(
    cfg: &ConnConfig,
    tainted: &[Identity],
    run_id: Option<&str>,
    node_timeout: Duration,
    tx: &Sender<Tried>,
    stop: &Receiver<()>,
) {
    let mut failures = 0u32;
    loop {
        let budget = try_budget(failures, node_timeout, cfg.connect_timeout);
        match open_node(cfg, budget, tainted, run_id, false, node_timeout) {
            Ok(node) => {
                let _ = tx.send(Ok(Box::new(node)));
                return;
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                if tx.send(Err(e)).is_err() {
                    return;
                }
                crossbeam_channel::select! {
                    recv(stop) -> _ => return,
                    recv(crossbeam_channel::after(rest_after(failures))) -> _ => {}
                }
            }
        }
    }
}

/// The scripts a node runs, checked with `SCRIPT EXISTS` on every connection.
fn node_scripts() -> [&'static Script; 2] {
    [&scripts::LEASE_EXTEND, &scripts::LEASE_RELEASE]
}

/// Connects to a node within `budget` (at most its connect timeout): one round trip for the
/// setup (see the module docs), then, only when `tainted` connections need
/// fencing off on the same server, one for their kills, and, only when the
/// first round trip was more than half the node timeout and the group is
/// being made (`creating`), up to [`EXTRA_SAMPLES`] more samples. `creating` also checks the
/// right to `CLIENT KILL`.
fn open_node(
    cfg: &ConnConfig,
    budget: Duration,
    tainted: &[Identity],
    run_id: Option<&str>,
    creating: bool,
    node_timeout: Duration,
) -> Result<NodeConn> {
    let addr = &cfg.addr;
    let mut extra = vec![redis::cmd("INFO")];
    let mut exists = redis::cmd("SCRIPT");
    exists.arg("EXISTS");
    for script in node_scripts() {
        exists.arg(&script.sha);
    }
    extra.push(exists);
    if creating {
        extra.push(Identity::nobody().kill_cmd());
    }
    let asked = cfg.clock.now();
    let budget = budget.min(cfg.connect_timeout);
    let deadline = asked + budget;
    let opened = cfg.connect_with(budget, CONN_NAME, &extra)?;
    let mut conn = opened.conn;
    if conn.id().is_none() {
        let why = opened.id_error.unwrap_or_default();
        let fix = "a redlock node needs CLIENT ID and CLIENT KILL to fence off commands that \
                   got no reply";
        return Err(if why.starts_with("NOPERM") {
            Error::Permission(format!("{addr}: CLIENT ID is denied ({why}); {fix}"))
        } else {
            Error::UnexpectedReply {
                op: "CLIENT ID",
                reply: format!("{why} ({fix})"),
            }
        });
    }
    let mut replies = opened.replies.into_iter();
    let info = match replies.next() {
        Some(v) => match crate::reply::text(&v) {
            Some(text) => parse_info(text),
            None => {
                let needs = "a redlock group needs it to check that its nodes are independent \
                             and to notice restarts";
                return Err(refused(addr, "INFO", "INFO", needs, v));
            }
        },
        None => ServerInfo::default(),
    };
    match replies.next() {
        Some(redis::Value::Array(flags)) => {
            for (script, flag) in node_scripts().into_iter().zip(flags) {
                if matches!(flag, redis::Value::Int(0)) {
                    conn.lacks_script(script);
                }
            }
        }
        other => {
            log::debug!("{addr}: SCRIPT EXISTS answered {other:?}; scripts go out as EVALSHA first")
        }
    }
    if creating {
        confirm_kill(
            addr,
            "CLIENT KILL (checking the right to fence)",
            replies.next(),
        )?;
    }
    let fences = fences_for(tainted, run_id, info.run_id.as_deref());
    if fences.len() < tainted.len() {
        // A new process: the old one's connections died with it, and its
        // client ids mean nothing here.
        log::debug!("{addr}: the server restarted; nothing to fence off");
    }
    if !fences.is_empty() {
        let mut pipe = redis::pipe();
        for target in fences {
            pipe.add_command(target.kill_cmd());
        }
        let op = "CLIENT KILL (fencing off an unanswered command)";
        for reply in conn.pipeline(&pipe, op, deadline)? {
            confirm_kill(addr, op, Some(reply))?;
        }
    }
    let mut round_trip = opened.round_trip;
    // A sample can be unlucky (a retransmit, a busy host): take a few more
    // before refusing the link, and keep the fastest.
    for _ in 0..EXTRA_SAMPLES {
        if !creating || round_trip * ROUND_TRIPS_PER_TIMEOUT <= node_timeout {
            break;
        }
        let t = cfg.clock.now();
        let _: i64 = conn.query(
            redis::cmd("CLIENT").arg("ID"),
            "CLIENT ID (another round-trip sample)",
            deadline,
        )?;
        round_trip = round_trip.min(cfg.clock.now().saturating_duration_since(t));
    }
    let started_by = started_by(asked, info.uptime);
    Ok(NodeConn {
        conn,
        info,
        round_trip,
        started_by,
    })
}

/// A `CLIENT KILL` reply: a count, or the error that refused it.
pub(crate) fn confirm_kill(
    addr: &str,
    op: &'static str,
    reply: Option<redis::Value>,
) -> Result<()> {
    match reply {
        Some(redis::Value::Int(_)) => Ok(()),
        Some(e @ redis::Value::ServerError(_)) => Err(refused(
            addr,
            op,
            "CLIENT KILL",
            "a redlock node needs it to fence off commands that got no reply",
            e,
        )),
        other => Err(Error::UnexpectedReply {
            op,
            reply: format!("{other:?}"),
        }),
    }
}

/// The error of a reply `op` did not expect: `command` denied (what the
/// group `needs` it for said), another error reply, or a reply of another
/// kind.
fn refused(addr: &str, op: &'static str, command: &str, needs: &str, reply: redis::Value) -> Error {
    match reply {
        redis::Value::ServerError(e) if e.code() == "NOPERM" => Error::Permission(format!(
            "{addr}: {command} is denied ({}); {needs}",
            e.details().unwrap_or_default()
        )),
        redis::Value::ServerError(e) => Error::Server {
            op,
            source: redis::RedisError::from(e),
        },
        other => Error::UnexpectedReply {
            op,
            reply: format!("{other:?}"),
        },
    }
}

/// The channel a watcher subscribes to; nothing is published there.
const WATCH_CHANNEL: &str = "respire-redlock-watch";

/// How long a watcher blocks in one read before it checks whether to stop.
const WATCH_READ: Duration = Duration::from_millis(250);

/// How long a watcher's connection may stay silent before it is pinged.
const WATCH_PING_EVERY: Duration = Duration::from_secs(5);

/// What a node's watcher learns about its server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum NodeEvent {
    /// The server closed the watcher's connection, or it failed, or the
    /// watcher's first connection could not be made: the server may have
    /// stopped, and may come back without its data.
    Down,
    /// The watcher is connected to the server running as `run_id`.
    Up { run_id: Arc<str> },
}

/// The handle on a watcher thread (`respire-watch-N`): it holds an idle
/// subscribed connection to its node, so that the moment the server goes away
/// (the connection closes) is known without any command in flight, and reads
/// the run id of every server it connects to. It stops when this is dropped.
pub(crate) struct NodeWatcher {
    _stop: Sender<()>,
}

impl NodeWatcher {
    /// Starts the watcher of node `index`, which reports to `group` while
    /// it lives and waits at most `node_timeout` for each of its commands.
    pub(crate) fn spawn(
        index: usize,
        cfg: Arc<ConnConfig>,
        node_timeout: Duration,
        group: Weak<Group>,
    ) -> std::io::Result<NodeWatcher> {
        let (stop_tx, stop) = crossbeam_channel::bounded::<()>(0);
        let on = move |i, event| {
            if let Some(group) = group.upgrade() {
                group.node_event(i, event);
            }
        };
        std::thread::Builder::new()
            .name(format!("respire-watch-{index}"))
            .spawn(move || watch(index, &cfg, node_timeout, &on, &stop))?;
        Ok(NodeWatcher { _stop: stop_tx })
    }
}

/// The watcher thread: connects, reports the run id, waits on the idle
/// connection until it fails (reported as [`NodeEvent::Down`]), and connects
/// again, pausing between failed tries; until the group is gone.
///
/// A first session that fails before the watcher ever reached the server is
/// reported as [`NodeEvent::Down`] too: the group's workers reached the server
/// before the watcher started, and it may have gone away (to come back
/// without its data) before the watcher could see it go. Until a session
/// reaches it, the node then counts as a node that went away.
fn watch(
    index: usize,
    cfg: &ConnConfig,
    node_timeout: Duration,
    on: &dyn Fn(usize, NodeEvent),
    stop: &Receiver<()>,
) {
    let mut failures = 0u32;
    let mut up = false;
    loop {
        let session = watch_session(index, cfg, node_timeout, on, stop, &mut up);
        match session {
            Ok(()) => return,
            Err(e) => {
                // `failures` is 0 only at the first session's end (every
                // failure counts one below): news even when that session
                // never reached the server. A refused subscription is not
                // news about the server: the watcher stops below.
                let first = failures == 0 && !matches!(e, Error::Permission(_));
                if up || first {
                    up = false;
                    failures = 0;
                    log::debug!("redlock node {}: watcher lost the server: {e}", cfg.addr);
                    on(index, NodeEvent::Down);
                }
                if matches!(e, Error::Permission(_)) {
                    log::warn!(
                        "redlock node {}: cannot watch for restarts ({e}); a restart is noticed \
                         only by the next command sent there",
                        cfg.addr
                    );
                    return;
                }
                failures = failures.saturating_add(1);
            }
        }
        if let Err(crossbeam_channel::RecvTimeoutError::Disconnected) =
            stop.recv_timeout(rest_after(failures))
        {
            return;
        }
    }
}

/// One watcher connection: `Ok` when the group is gone, `Err` when the
/// connection could not be made or failed.
fn watch_session(
    index: usize,
    cfg: &ConnConfig,
    node_timeout: Duration,
    on: &dyn Fn(usize, NodeEvent),
    stop: &Receiver<()>,
    up: &mut bool,
) -> Result<()> {
    let mut conn = cfg.connect_pubsub(cfg.connect_timeout, "respire-redlock-watch")?;
    let deadline = cfg.clock.now() + node_timeout;
    let info: String = conn.query(redis::cmd("INFO").arg("server"), "INFO", deadline)?;
    let mut subscriber = conn.subscribe(WATCH_CHANNEL, node_timeout, WATCH_READ)?;
    match parse_info(&info).run_id {
        Some(run_id) => {
            *up = true;
            on(
                index,
                NodeEvent::Up {
                    run_id: Arc::from(run_id),
                },
            );
        }
        None => log::debug!("redlock node {}: INFO names no run id", cfg.addr),
    }
    let stopped = || {
        matches!(
            stop.try_recv(),
            Err(crossbeam_channel::TryRecvError::Disconnected)
        )
    };
    subscriber.listen(WATCH_PING_EVERY, &stopped, &mut |_| true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(node: usize) -> Reply {
        Reply {
            node,
            tag: 0,
            outcome: NodeOutcome::Granted,
            vote: Vote::Yes,
            latency: None,
            permanent: None,
        }
    }

    #[test]
    fn a_gather_hands_over_answers_in_order_and_a_late_one_wakes_nobody_wrongly() {
        let ms = Duration::from_millis;
        let gather = Gather::new(2);
        let to = ReplyTo::Gather(gather.clone());
        std::thread::scope(|s| {
            s.spawn(|| {
                to.clone().deliver(reply(1));
                to.clone().deliver(reply(0));
            });
        });
        let far = Instant::now() + Duration::from_secs(5);
        assert_eq!(
            gather.next(far, &crate::clock::Monotonic).map(|r| r.node),
            Some(1)
        );
        assert_eq!(
            gather.next(far, &crate::clock::Monotonic).map(|r| r.node),
            Some(0)
        );
        assert!(
            gather
                .next(Instant::now(), &crate::clock::Monotonic)
                .is_none(),
            "nothing more came"
        );
        // A late answer to the first gather leaves a wake-up behind: the
        // next gather of this thread takes it for what it is and waits on.
        to.deliver(reply(2));
        let next = Gather::new(1);
        let asked = Instant::now();
        assert!(
            next.next(asked + ms(30), &crate::clock::Monotonic)
                .is_none()
        );
        assert!(
            asked.elapsed() >= ms(30),
            "woken early with nothing to read"
        );
    }
}
