//! Redlock guards over 3 and 5 model nodes: a holder with a user thread, a
//! renewal schedule and one worker per node, and a contender that takes the
//! lock whenever a quorum lets it.
//!
//! The node workers follow the runtime's rules: one queue per node run in
//! order; a job dequeued past its deadline is not sent (a release is, with a
//! budget of its own); a command that got no reply taints its connection, and
//! the node reconnects in the background: a new connection (one round trip,
//! which may be lost or late, retried after a pause), on which the tainted
//! connection is killed, and the kill confirmed, before anything else goes to
//! that node. While it is not connected, acquires and extensions are answered
//! "unknown" at once, and releases wait (in order) to be sent, each with a
//! budget of its own, once it is.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Net, Queue, Rng, Stats, instant};
use crate::core::lease::{LeaseCore, Loss, Refusal, Ticket};
use crate::core::quorum::{AcquireVerdict, ExtendVerdict, Tally, Vote};
use crate::core::schedule::{Next, Schedule, Watched};
use crate::core::timing::{Timing, retry_delay};
use crate::runtime::lease::LeaseCell;

type ConnId = u64;

struct Entry {
    value: String,
    expire: f64,
}

struct Node {
    rate: f64,
    key: Option<Entry>,
    killed: HashSet<ConnId>,
    last_in: HashMap<ConnId, Duration>,
    last_out: HashMap<ConnId, Duration>,
}

impl Node {
    fn now(&self, t: Duration) -> f64 {
        t.as_nanos() as f64 * self.rate
    }

    fn live(&mut self, t: Duration) -> Option<&Entry> {
        let now = self.now(t);
        if self.key.as_ref().is_some_and(|e| e.expire <= now) {
            self.key = None;
        }
        self.key.as_ref()
    }

    fn apply(&mut self, op: &Op, t: Duration) -> Answer {
        let now = self.now(t);
        match op {
            Op::Acquire { value, ttl } => match self.live(t) {
                // `SET NX` leaves a key that is set, also this attempt's own.
                Some(e) if e.value == *value => Answer::Yes,
                Some(_) => Answer::Held,
                None => {
                    self.key = Some(Entry {
                        value: value.clone(),
                        expire: now + ttl.as_nanos() as f64,
                    });
                    Answer::Yes
                }
            },
            Op::Extend { value, ttl } => match self.live(t) {
                Some(e) if e.value == *value => {
                    self.key.as_mut().expect("live").expire = now + ttl.as_nanos() as f64;
                    Answer::Yes
                }
                Some(_) => Answer::Held,
                None => Answer::No,
            },
            Op::Release { value } => {
                if self.live(t).is_some_and(|e| e.value == *value) {
                    self.key = None;
                }
                Answer::Yes
            }
            Op::Kill { target } => {
                self.killed.insert(*target);
                Answer::Yes
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Acquire { value: String, ttl: Duration },
    Extend { value: String, ttl: Duration },
    Release { value: String },
    Kill { target: ConnId },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    Yes,
    Held,
    No,
    Unknown,
}

/// Which fan-out a job belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FanId(u64);

struct Job {
    op: Op,
    deadline: Duration,
    fan: Option<FanId>,
    /// How many times a release was sent without a reply.
    resent: u32,
}

/// One node's worker: its queue, connection and tainted connections.
struct Worker {
    queue: VecDeque<Job>,
    conn: ConnId,
    tainted: Vec<ConnId>,
    /// The job whose request is in flight.
    busy: Option<(u64, Job)>,
    /// Whether `conn` is ready for jobs (false while reconnecting).
    connected: bool,
    /// The kill in flight on the reconnect path.
    fencing: Option<u64>,
    /// Failed reconnect tries in a row.
    failures: u32,
    /// Releases waiting for a connection.
    deferred: VecDeque<Job>,
}

enum Purpose {
    Acquire,
    Extend { ticket: Ticket, user: bool },
}

/// A fan-out in progress: its tally, and what it is for.
struct Fan {
    client: usize,
    purpose: Purpose,
    tally: Tally,
    sent: Instant,
    decided: bool,
    verdict: Option<ExtendVerdict>,
    jobs_left: usize,
    ttl: Duration,
    value: String,
}

enum Ev {
    Deliver {
        req: u64,
        node: usize,
        conn: ConnId,
        op: Op,
    },
    Reply {
        req: u64,
        node: usize,
        answer: Answer,
    },
    Timeout {
        req: u64,
        node: usize,
    },
    Decide(FanId),
    UserNext(usize),
    SchedWake,
    /// A reconnect try of client `.0`'s worker for node `.1`.
    Reconnect(usize, usize),
    /// That try's setup round trip came back: a new connection.
    Connected(usize, usize),
}

impl Ev {
    fn name(&self) -> String {
        match self {
            Ev::Deliver { req, node, op, .. } => format!("deliver {req} node {node} {op:?}"),
            Ev::Reply { req, node, answer } => format!("reply {req} node {node} {answer:?}"),
            Ev::Timeout { req, node } => format!("timeout {req} node {node}"),
            Ev::Decide(f) => format!("decide {f:?}"),
            Ev::UserNext(c) => format!("user {c}"),
            Ev::SchedWake => "wake".into(),
            Ev::Reconnect(c, node) => format!("reconnect client {c} node {node}"),
            Ev::Connected(c, node) => format!("connected client {c} node {node}"),
        }
    }
}

struct Held {
    cell: Arc<Cell>,
    value: String,
    keepalive: bool,
    signal: bool,
}

type Cell = LeaseCell<()>;

impl Watched for Arc<Cell> {
    fn id(&self) -> u64 {
        LeaseCell::id(self)
    }
    fn poll(&self, now: Instant) -> Next {
        self.next(now)
    }
}

struct Client {
    /// One worker per node.
    workers: Vec<Worker>,
    held: Option<Held>,
    busy: bool,
    owners: u64,
    claim_wait: Option<(Duration, Duration)>,
    /// Only the holder under test keeps alive and extends.
    full: bool,
}

struct World {
    rng: Rng,
    origin: Instant,
    now: Duration,
    timing: Timing,
    net: Net,
    nodes: Vec<Node>,
    quorum: usize,
    queue: Queue<Ev>,
    clients: Vec<Client>,
    fans: HashMap<FanId, Fan>,
    next_fan: u64,
    next_req: u64,
    next_conn: ConnId,
    /// Requests in flight: request id → (client, node).
    reqs: HashMap<u64, (usize, usize)>,
    sched: Schedule<Arc<Cell>>,
    wake: Option<Duration>,
    /// The renewal in flight for the held lease.
    renewing: Option<FanId>,
    ttls: Vec<Duration>,
    stats: Stats,
    steps_left: u32,
    trace: bool,
}

pub(crate) fn case(seed: u64) -> Result<Stats, String> {
    let mut rng = Rng::new(seed);
    let n = if rng.chance(0.5) { 3 } else { 5 };
    let node_timeout = Duration::from_millis(10 + rng.below(90));
    let drift_factor = [0.0, 0.01, 0.05][rng.below(3) as usize];
    let timing = Timing {
        drift_factor,
        node_timeout,
    };
    let net = Net::random(&mut rng, node_timeout);
    let nodes = (0..n)
        .map(|_| Node {
            rate: 1.0 + drift_factor * (2.0 * rng.unit() - 1.0) * 0.999,
            key: None,
            killed: HashSet::new(),
            last_in: HashMap::new(),
            last_out: HashMap::new(),
        })
        .collect();
    // Redlock refuses a TTL unless node timeout + drift is under half of it.
    let base = (0..)
        .map(|i| node_timeout * 2 + Duration::from_millis(10 + i * 7))
        .find(|t| node_timeout + timing.drift(*t) < *t / 2)
        .expect("some ttl is usable");
    let keepalive = timing.min_keepalive_ttl().max(base) + Duration::from_millis(1);
    let ttls = vec![
        base,
        base * 2,
        keepalive,
        keepalive * 3,
        timing.node_timeout * 200,
    ];
    let mut w = World {
        origin: Instant::now(),
        now: Duration::ZERO,
        timing,
        net,
        nodes,
        quorum: n / 2 + 1,
        queue: Queue::new(),
        clients: Vec::new(),
        fans: HashMap::new(),
        next_fan: 0,
        next_req: 0,
        next_conn: 0,
        reqs: HashMap::new(),
        sched: Schedule::default(),
        wake: None,
        renewing: None,
        ttls,
        stats: Stats::default(),
        steps_left: 30 + rng.below(30) as u32,
        trace: std::env::var_os("RESPIRE_SIM_TRACE").is_some(),
        rng,
    };
    for c in 0..2 {
        let workers = (0..n)
            .map(|_| Worker {
                queue: VecDeque::new(),
                conn: w.conn(),
                tainted: Vec::new(),
                busy: None,
                connected: true,
                fencing: None,
                failures: 0,
                deferred: VecDeque::new(),
            })
            .collect();
        w.clients.push(Client {
            workers,
            held: None,
            busy: false,
            owners: 0,
            claim_wait: None,
            full: c == 0,
        });
        let at = w.rng.micros(0, 5_000);
        w.queue.push(at, Ev::UserNext(c));
    }
    while let Some(t) = w.queue.peek_time() {
        while w.queue.peek_time() == Some(t) {
            let (at, ev) = w.queue.pop().expect("peeked");
            w.now = at;
            w.stats.events += 1;
            if w.stats.events > 1_000_000 {
                return Err(format!("the schedule did not end at {at:?}"));
            }
            if w.trace {
                eprintln!("{at:?} {}", ev.name());
            }
            w.handle(ev)?;
        }
        w.check()?;
        if w.steps_left == 0 && w.clients.iter().all(|c| !c.busy) {
            break;
        }
    }
    Ok(w.stats)
}

impl World {
    fn at(&self) -> Instant {
        instant(self.origin, self.now)
    }

    fn conn(&mut self) -> ConnId {
        self.next_conn += 1;
        self.next_conn
    }

    fn handle(&mut self, ev: Ev) -> Result<(), String> {
        match ev {
            Ev::Deliver {
                req,
                node,
                conn,
                op,
            } => {
                let n = &mut self.nodes[node];
                if n.killed.contains(&conn) {
                    return Ok(());
                }
                let answer = n.apply(&op, self.now);
                let lose = self.net.p_lose_reply;
                if let Some(d) = self.net.hop(&mut self.rng, lose) {
                    let n = &mut self.nodes[node];
                    let last = n.last_out.get(&conn).copied().unwrap_or_default();
                    let at = (self.now + d).max(last);
                    n.last_out.insert(conn, at);
                    self.queue.push(at, Ev::Reply { req, node, answer });
                }
            }
            Ev::Reply { req, node, answer } => {
                if let Some((c, _)) = self.reqs.remove(&req) {
                    self.job_done(c, node, req, answer)?;
                }
            }
            Ev::Timeout { req, node } => {
                if let Some((c, _)) = self.reqs.remove(&req) {
                    self.stats.unanswered += 1;
                    self.job_done(c, node, req, Answer::Unknown)?;
                }
            }
            Ev::Decide(fan) => self.decide(fan, true)?,
            Ev::UserNext(c) => self.user_step(c)?,
            Ev::Reconnect(c, node) => self.try_connect(c, node),
            Ev::Connected(c, node) => {
                let fresh = self.conn();
                self.clients[c].workers[node].conn = fresh;
                self.fence_next(c, node);
            }
            Ev::SchedWake => {
                if self.wake == Some(self.now) {
                    self.wake = None;
                }
                let now = self.at();
                for lease in self.sched.due(now) {
                    self.renew(&lease)?;
                }
                self.arm();
            }
        }
        Ok(())
    }

    fn arm(&mut self) {
        if let Some(at) = self.sched.next_due() {
            let at = at.saturating_duration_since(self.origin).max(self.now);
            if self.wake.is_none_or(|w| at < w) {
                self.wake = Some(at);
                self.queue.push(at, Ev::SchedWake);
            }
        }
    }

    fn touch(&mut self, cell: &Arc<Cell>) {
        if cell.is_watched() {
            let now = self.at();
            self.sched.touch(cell.id(), now);
            self.arm();
        }
    }

    /// Queues `op` on every node of client `c`, as one fan-out.
    fn fan_out(&mut self, c: usize, op: Op, deadline: Duration, fan: Fan) -> FanId {
        let id = FanId(self.next_fan);
        self.next_fan += 1;
        self.fans.insert(id, fan);
        for node in 0..self.nodes.len() {
            self.clients[c].workers[node].queue.push_back(Job {
                op: op.clone(),
                deadline,
                fan: Some(id),
                resent: 0,
            });
            self.kick(c, node);
        }
        self.queue.push(deadline, Ev::Decide(id));
        id
    }

    /// Releases `value` on every node, nobody waiting.
    fn release_everywhere(&mut self, c: usize, value: String) {
        let deadline = self.now + self.timing.node_timeout;
        for node in 0..self.nodes.len() {
            self.clients[c].workers[node].queue.push_back(Job {
                op: Op::Release {
                    value: value.clone(),
                },
                deadline,
                fan: None,
                resent: 0,
            });
            self.kick(c, node);
        }
    }

    fn send(&mut self, c: usize, node: usize, conn: ConnId, op: Op, deadline: Duration) -> u64 {
        let req = self.next_req;
        self.next_req += 1;
        self.reqs.insert(req, (c, node));
        let lose = self.net.p_lose_request;
        if let Some(d) = self.net.hop(&mut self.rng, lose) {
            let n = &mut self.nodes[node];
            let last = n.last_in.get(&conn).copied().unwrap_or_default();
            let at = (self.now + d).max(last);
            n.last_in.insert(conn, at);
            self.queue.push(
                at,
                Ev::Deliver {
                    req,
                    node,
                    conn,
                    op,
                },
            );
        }
        self.queue.push(deadline, Ev::Timeout { req, node });
        req
    }

    /// Starts the node's next job, if it is idle; while it is not connected,
    /// answers jobs at once (keeping releases for later).
    fn kick(&mut self, c: usize, node: usize) {
        loop {
            let w = &mut self.clients[c].workers[node];
            if w.busy.is_some() {
                return;
            }
            let Some(mut job) = w.queue.pop_front() else {
                return;
            };
            let release = matches!(job.op, Op::Release { .. });
            if !w.connected {
                if release {
                    w.deferred.push_back(job);
                } else {
                    self.answer(c, node, &job, Answer::Unknown);
                }
                continue;
            }
            if self.now >= job.deadline {
                if release {
                    job.deadline = self.now + self.timing.node_timeout;
                } else {
                    // Still queued when its time ran out: not sent.
                    self.answer(c, node, &job, Answer::Unknown);
                    continue;
                }
            }
            let w = &self.clients[c].workers[node];
            let (conn, op, deadline) = (w.conn, job.op.clone(), job.deadline);
            let req = self.send(c, node, conn, op, deadline);
            self.clients[c].workers[node].busy = Some((req, job));
            return;
        }
    }

    /// One reconnect try: its setup round trip within four node timeouts,
    /// or a failure and another try after a pause.
    fn try_connect(&mut self, c: usize, node: usize) {
        let budget = self.timing.node_timeout * 4;
        let (lose_out, lose_back) = (self.net.p_lose_request, self.net.p_lose_reply);
        let out = self.net.hop(&mut self.rng, lose_out);
        let back = self.net.hop(&mut self.rng, lose_back);
        match (out, back) {
            (Some(a), Some(b)) if a + b < budget => {
                self.queue.push(self.now + a + b, Ev::Connected(c, node));
            }
            _ => {
                let w = &mut self.clients[c].workers[node];
                w.failures += 1;
                let rest = crate::core::timing::rest_after(w.failures);
                self.queue
                    .push(self.now + budget + rest, Ev::Reconnect(c, node));
            }
        }
    }

    /// On a new connection: kill the next tainted connection from it, or, with
    /// none left, start using it.
    fn fence_next(&mut self, c: usize, node: usize) {
        let w = &mut self.clients[c].workers[node];
        if let Some(&old) = w.tainted.last() {
            let conn = w.conn;
            let deadline = self.now + self.timing.node_timeout * 4;
            let req = self.send(c, node, conn, Op::Kill { target: old }, deadline);
            self.clients[c].workers[node].fencing = Some(req);
            return;
        }
        w.connected = true;
        w.failures = 0;
        // The releases that waited go first, in order, each with a budget of
        // its own.
        let deadline = self.now + self.timing.node_timeout;
        let mut deferred = std::mem::take(&mut w.deferred);
        for job in &mut deferred {
            job.deadline = deadline;
        }
        while let Some(job) = deferred.pop_back() {
            w.queue.push_front(job);
        }
        self.kick(c, node);
    }

    fn job_done(&mut self, c: usize, node: usize, req: u64, answer: Answer) -> Result<(), String> {
        let w = &mut self.clients[c].workers[node];
        if w.fencing == Some(req) {
            w.fencing = None;
            if answer == Answer::Unknown {
                // The kill is not confirmed: another try on another connection.
                w.failures += 1;
                let rest = crate::core::timing::rest_after(w.failures);
                self.queue.push(self.now + rest, Ev::Reconnect(c, node));
            } else {
                w.tainted.pop();
                self.fence_next(c, node);
            }
            return Ok(());
        }
        let Some((busy_req, job)) = w.busy.take() else {
            return Ok(());
        };
        if busy_req != req {
            w.busy = Some((busy_req, job));
            return Ok(());
        }
        if answer == Answer::Unknown {
            // Anything sent on the connection may still apply: it is killed
            // from the next one, made in the background.
            let old = w.conn;
            w.tainted.push(old);
            w.connected = false;
            self.queue.push(self.now, Ev::Reconnect(c, node));
            // A release goes out again after the kill, a few times at most.
            if matches!(job.op, Op::Release { .. }) && job.resent < 3 {
                w.deferred.push_front(Job {
                    op: job.op.clone(),
                    deadline: job.deadline,
                    fan: None,
                    resent: job.resent + 1,
                });
            }
        }
        self.answer(c, node, &job, answer);
        self.kick(c, node);
        Ok(())
    }

    /// A job's answer reaches its fan-out.
    fn answer(&mut self, _c: usize, _node: usize, job: &Job, answer: Answer) {
        let Some(id) = job.fan else {
            return;
        };
        let Some(f) = self.fans.get_mut(&id) else {
            return;
        };
        f.jobs_left -= 1;
        if !f.decided {
            let vote = match (&f.purpose, answer) {
                (_, Answer::Unknown) => Vote::Unknown,
                (_, Answer::Yes) => Vote::Yes,
                (_, Answer::Held) => Vote::Held,
                (_, Answer::No) => Vote::No,
            };
            f.tally.add(vote, answer == Answer::Yes);
        }
        let (decided, left) = (f.tally.decided() || f.tally.outstanding == 0, f.jobs_left);
        if decided {
            let _ = self.decide(id, false);
        }
        if left == 0 {
            self.all_done(id);
        }
    }

    /// Decides a fan-out (when its tally is decided, or at its deadline).
    fn decide(&mut self, id: FanId, at_deadline: bool) -> Result<(), String> {
        let now = self.at();
        let Some(f) = self.fans.get_mut(&id) else {
            return Ok(());
        };
        if f.decided {
            return Ok(());
        }
        if !at_deadline && !f.tally.decided() && f.tally.outstanding > 0 {
            return Ok(());
        }
        f.decided = true;
        let c = f.client;
        let tally = f.tally;
        match f.purpose {
            Purpose::Acquire => {
                let (sent, ttl, value) = (f.sent, f.ttl, f.value.clone());
                self.clients[c].busy = false;
                let core = LeaseCore::granted(self.timing, sent, ttl);
                let validity_left = now < core.valid_until();
                if tally.acquire() == AcquireVerdict::Granted && validity_left {
                    self.stats.grants += 1;
                    if c == 1 && self.clients[0].held.is_some() {
                        self.stats.takeovers += 1;
                    }
                    // The contender's grant while the holder believes it holds
                    // is what the invariant catches.
                    let cell = Arc::new(LeaseCell::new("k".into(), (), core));
                    self.clients[c].held = Some(Held {
                        cell,
                        value,
                        keepalive: false,
                        signal: false,
                    });
                } else {
                    self.release_everywhere(c, value);
                }
                self.think(c);
            }
            Purpose::Extend { ticket, user } => {
                let verdict = tally.extend();
                f.verdict = Some(verdict);
                let Some(held) = &self.clients[c].held else {
                    return Ok(());
                };
                let cell = held.cell.clone();
                match verdict {
                    ExtendVerdict::Confirmed => {
                        cell.extended(ticket, now);
                    }
                    ExtendVerdict::Refused => cell.refused(ticket, now, Loss::Gone),
                    ExtendVerdict::Unknown => cell.unanswered(ticket, now),
                }
                if user {
                    self.clients[c].busy = false;
                    self.think(c);
                } else {
                    self.renewing = None;
                    let retry =
                        (verdict == ExtendVerdict::Unknown).then(|| now + retry_delay(cell.ttl()));
                    self.sched.completed(cell.id(), now, retry);
                }
                self.touch(&cell);
            }
        }
        Ok(())
    }

    /// Every node's share of a fan-out is finished: an extension without a
    /// verdict releases its claim now.
    fn all_done(&mut self, id: FanId) {
        let now = self.at();
        let Some(f) = self.fans.remove(&id) else {
            return;
        };
        if let (Purpose::Extend { ticket, .. }, Some(ExtendVerdict::Unknown)) =
            (&f.purpose, f.verdict)
            && let Some(held) = &self.clients[f.client].held
        {
            let cell = held.cell.clone();
            cell.fenced(*ticket, now);
            self.stats.fences += 1;
            self.touch(&cell);
        }
    }

    fn think(&mut self, c: usize) {
        let pause = self
            .rng
            .micros(0, (self.ttls[0].as_micros() as u64) * 2 / 3);
        self.queue.push(self.now + pause, Ev::UserNext(c));
    }

    fn user_step(&mut self, c: usize) -> Result<(), String> {
        if self.clients[c].busy {
            return Ok(());
        }
        let now = self.at();
        if let Some((since, ttl)) = self.clients[c].claim_wait {
            return self.extend(c, ttl, since);
        }
        let Some(held) = &self.clients[c].held else {
            if self.steps_left == 0 {
                return Ok(());
            }
            self.steps_left -= 1;
            let n = self.clients[c].owners;
            self.clients[c].owners += 1;
            let value = format!("c{c}o{n}");
            let ttl = self.ttls[self.rng.below(self.ttls.len() as u64) as usize];
            self.clients[c].busy = true;
            let deadline = self.now + self.timing.node_timeout;
            let fan = Fan {
                client: c,
                purpose: Purpose::Acquire,
                tally: Tally::new(self.nodes.len(), self.nodes.len()),
                sent: now,
                decided: false,
                verdict: None,
                jobs_left: self.nodes.len(),
                ttl,
                value: value.clone(),
            };
            self.fan_out(c, Op::Acquire { value, ttl }, deadline, fan);
            return Ok(());
        };
        let cell = held.cell.clone();
        if cell.is_lost(now) {
            self.stats.losses += 1;
            return self.release(c);
        }
        if self.steps_left == 0 {
            return self.release(c);
        }
        self.steps_left -= 1;
        if !self.clients[c].full {
            // The contender only holds for a moment.
            return self.release(c);
        }
        match self.rng.below(8) {
            0..=2 => {
                let ttl = self.ttls[self.rng.below(self.ttls.len() as u64) as usize];
                return self.extend(c, ttl, self.now);
            }
            3 => {
                let h = self.clients[c].held.as_mut().expect("held");
                if !h.keepalive && cell.ttl() >= self.timing.min_keepalive_ttl() {
                    h.keepalive = true;
                    cell.add_keepalive();
                    if cell.watch() {
                        self.sched.watch(cell.clone(), now);
                    }
                    self.touch(&cell);
                }
            }
            4 => {
                let h = self.clients[c].held.as_mut().expect("held");
                if h.keepalive {
                    h.keepalive = false;
                    cell.remove_keepalive();
                    self.touch(&cell);
                }
            }
            5 => {
                let _ = cell.signal(now);
                self.clients[c].held.as_mut().expect("held").signal = true;
                if cell.watch() {
                    self.sched.watch(cell.clone(), now);
                }
                self.arm();
            }
            6 => return self.release(c),
            _ => {}
        }
        self.think(c);
        Ok(())
    }

    /// The guard's `extend`: claim (waiting at most a node timeout), fan out.
    fn extend(&mut self, c: usize, ttl: Duration, since: Duration) -> Result<(), String> {
        let now = self.at();
        let Some(held) = &self.clients[c].held else {
            self.clients[c].claim_wait = None;
            return Ok(());
        };
        let (cell, value) = (held.cell.clone(), held.value.clone());
        match cell.begin_extend(now, ttl) {
            Err(Refusal::Lost) => {
                self.clients[c].claim_wait = None;
                self.think(c);
            }
            Err(Refusal::Busy) => {
                if self.now >= since + self.timing.node_timeout {
                    self.clients[c].claim_wait = None;
                    self.think(c);
                } else {
                    self.clients[c].claim_wait = Some((since, ttl));
                    self.queue
                        .push(self.now + Duration::from_millis(1), Ev::UserNext(c));
                }
            }
            Ok(ticket) => {
                self.clients[c].claim_wait = None;
                self.stats.extensions += 1;
                self.touch(&cell);
                self.clients[c].busy = true;
                let valid = cell.valid_until().saturating_duration_since(self.origin);
                let deadline = (self.now + self.timing.node_timeout).min(valid);
                let fan = self.extension(c, ticket, true, ttl, value.clone());
                self.fan_out(c, Op::Extend { value, ttl }, deadline, fan);
            }
        }
        Ok(())
    }

    fn extension(&self, c: usize, ticket: Ticket, user: bool, ttl: Duration, value: String) -> Fan {
        Fan {
            client: c,
            purpose: Purpose::Extend { ticket, user },
            tally: Tally::new(self.nodes.len(), self.nodes.len()),
            sent: self.at(),
            decided: false,
            verdict: None,
            jobs_left: self.nodes.len(),
            ttl,
            value,
        }
    }

    /// The renewal thread's dispatch of one due lease.
    fn renew(&mut self, lease: &Arc<Cell>) -> Result<(), String> {
        let now = self.at();
        let c = 0;
        let Some(held) = &self.clients[c].held else {
            self.sched.completed(lease.id(), now, None);
            return Ok(());
        };
        if !Arc::ptr_eq(&held.cell, lease) {
            self.sched.completed(lease.id(), now, None);
            return Ok(());
        }
        let value = held.value.clone();
        let ttl = lease.ttl();
        match lease.begin_extend(now, ttl) {
            Ok(ticket) => {
                self.stats.extensions += 1;
                let lost_at = lease.lost_at().saturating_duration_since(self.origin);
                let deadline = (self.now + self.timing.node_timeout).min(lost_at);
                let fan = self.extension(c, ticket, false, ttl, value.clone());
                let id = self.fan_out(c, Op::Extend { value, ttl }, deadline, fan);
                self.renewing = Some(id);
            }
            Err(_) => self.sched.completed(lease.id(), now, None),
        }
        Ok(())
    }

    fn release(&mut self, c: usize) -> Result<(), String> {
        let now = self.at();
        let Some(h) = self.clients[c].held.take() else {
            return Ok(());
        };
        h.cell.finish(now);
        self.sched.forget(h.cell.id());
        self.release_everywhere(c, h.value);
        self.think(c);
        Ok(())
    }

    fn check(&mut self) -> Result<(), String> {
        let now = self.at();
        let t = self.now;
        let Some(h) = &self.clients[0].held else {
            return Ok(());
        };
        self.stats.checks += 1;
        let lost = h.cell.peek_lost(now);
        if h.signal && lost && !h.cell.signal_closed() {
            return Err(format!(
                "is_lost() is true at {t:?} but the loss signal is open"
            ));
        }
        if lost {
            return Ok(());
        }
        let value = h.value.clone();
        // Each node's expiry of this holder's value, in client time.
        let mut expiries: Vec<f64> = self
            .nodes
            .iter_mut()
            .filter_map(|n| {
                let rate = n.rate;
                n.live(t)
                    .filter(|e| e.value == value)
                    .map(|e| e.expire / rate)
            })
            .collect();
        let holding = expiries.len();
        // The guard's bound (not only `is_lost()`, a node timeout earlier)
        // must be at or before the moment fewer than a quorum still hold it.
        expiries.sort_by(|a, b| b.total_cmp(a));
        let bound = h.cell.valid_until().duration_since(self.origin).as_nanos() as f64;
        if let Some(&quorum_ends) = expiries.get(self.quorum.saturating_sub(1))
            && bound > quorum_ends + 1.0
        {
            return Err(format!(
                "the guard's bound {:?} is past the moment the quorum's expiry ends, {:?}",
                Duration::from_nanos(bound as u64),
                Duration::from_nanos(quorum_ends as u64)
            ));
        }
        if holding < self.quorum {
            return Err(format!(
                "the guard believes it holds {value} at {t:?} (valid until {:?}), but only \
                 {holding} of {} nodes do",
                h.cell.valid_until().duration_since(self.origin),
                self.nodes.len()
            ));
        }
        Ok(())
    }
}
