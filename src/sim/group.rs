//! Redlock guards over 3 and 5 model servers: a holder with a user thread, a
//! renewal schedule and one node machine per server, and a contender that
//! takes the lock whenever a quorum lets it.
//!
//! What runs is the shipped Redlock choreography (`core::redlock`): each
//! client's [`Node`] machine per server (jobs in order, deadline skips,
//! taints, kills before reuse, releases kept for later), the extension's
//! settle and fence ([`Extension`]), the release's count ([`Release`]), the
//! acquire verdict ([`acquired`]), the acquire's round trips and the reading
//! of their replies (`node_acquire`) and the readers of the servers' other
//! replies (`confirm_kill`, `fences_for`). What is written
//! here is what lies outside the process or on the wire: model servers
//! (`src/sim/model`, running the shipped Lua), a network that delays, loses
//! and keeps order per connection only, and the transport of each machine
//! (which command goes on which model connection, the connector's tries).
//!
//! Servers crash (`kill -9`) and start again, with their data (an
//! append-only file) or without it (only with a restart delay longer than
//! any lease, as documented): every connection dies with the process, and
//! each client's node watchers notice after a hop (or, when the close is
//! lost, at their next ping), reconnect after growing pauses and report the
//! new run id. What the group does with that news is the shipped judgement
//! (`core::redlock::Watch`), and the restart delay is the node machine's
//! own refusal to grant on a server that started too recently, from the
//! uptime its connection read (`core::redlock::started_by`).
//!
//! Invariants, besides the bound of the holder's guard against the moment
//! fewer than a quorum of servers still hold it (see `sim/mod.rs`; a server
//! that a crash emptied counts while it is down and for the restart delay
//! after it starts): no two guards are valid at once; a release counted as
//! confirmed on a server never leaves the lease there, and one that reports
//! the lease deleted had it deleted by its own commands on a quorum (the
//! checker's record, taken from the servers before and after).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::model::{ClientId, Injected, ModelServer, Persistence, Reply as Wire, Value, argv};
use super::{Net, Queue, Rng, Stats, instant};
use crate::conn::Identity;
use crate::core::extend::{ResetExpiry, ResetStep};
use crate::core::lease::{LeaseCore, Loss, Ticket};
use crate::core::quorum::Tally;
use crate::core::redlock::{
    Action, Answer, Connected, Extension, Job, Node, NodeLease, NodeReply, NodeSettings, Op,
    QuorumRenewal, Release, Watch, acquired, fences_for, started_by, validity,
};
use crate::core::schedule::{Schedule, Watched};
use crate::core::timing::{Timing, rest_after, try_budget};
use crate::error::Error;
use crate::redlock::{confirm_kill, node_acquire};
use crate::runtime::lease::LeaseCell;
use crate::scripts;

type Cell = LeaseCell<()>;

/// Which fan-out a job's answer goes to; `None` for a clean-up nobody
/// waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FanId(u64);

type Handle = Option<FanId>;

/// The key every lease uses, on every server.
const KEY: &str = "k";

/// One model server and its clock.
struct Server {
    model: ModelServer,
    /// Server milliseconds per true millisecond.
    rate: f64,
    start_ms: i64,
    /// The true time its clock was last moved to.
    at: Duration,
    /// Per connection: when its last request and last reply arrive (order
    /// is kept per connection only).
    last_in: HashMap<ClientId, Duration>,
    last_out: HashMap<ClientId, Duration>,
    /// Bumped at every crash: a connection of an earlier process is dead
    /// even where its id is reused.
    epoch: u32,
    /// While the process is down: until when (true time).
    down_until: Option<Duration>,
    /// The server clock when the running process started (for `INFO`'s
    /// uptime).
    process_start_ms: i64,
    /// What the crashes took: the value the key held, and until when (true
    /// time) no client may take the key there (`None`: until the process
    /// starts again, not yet known). The checker's record.
    crashes: Vec<(String, Option<Duration>)>,
}

impl Server {
    fn sync(&mut self, t: Duration) {
        if t > self.at {
            self.model.elapse(t - self.at);
            self.at = t;
        }
    }

    /// Until when (true time, ns) this server holds the key for `value`,
    /// if it still does at true time `t` (its clock may not have been moved
    /// there: it is moved only when a command reaches it).
    fn holds_until(&self, value: &str, t: Duration) -> Option<f64> {
        let e = self.model.entry(KEY)?;
        if !matches!(&e.value, Value::Str(v) if v.as_slice() == value.as_bytes()) {
            return None;
        }
        // The key exists while the server clock is at or before its expiry.
        let end_ms = (e.expire_at? + 1 - self.start_ms) as f64 / self.rate;
        let end = end_ms * 1e6;
        (end > t.as_nanos() as f64).then_some(end)
    }

    /// Whether the key holds `value` as the server itself sees it at its
    /// clock (moved to a command's arrival by `sync`): the truth a command
    /// run now acts on, to the millisecond the server counts in.
    fn holds_now(&self, value: &str) -> bool {
        matches!(self.model.entry(KEY), Some(e) if matches!(&e.value, Value::Str(v) if v.as_slice() == value.as_bytes()))
    }

    fn run(&mut self, conn: ClientId, argv: &[&str]) -> Option<Wire> {
        self.model.command_from(conn, argv)
    }

    /// Runs a shipped pipeline's commands in turn; their replies as the
    /// connection reads them.
    fn run_pipeline(
        &mut self,
        conn: ClientId,
        pipe: &redis::Pipeline,
    ) -> Option<Vec<redis::Value>> {
        pipe.cmd_iter()
            .map(|cmd| {
                self.model
                    .command_from(conn, &argv(cmd))
                    .map(Wire::into_value)
            })
            .collect()
    }

    /// Until when (true time, ns) the checker counts this server as keeping
    /// others from `value`'s key after a crash took it: while the process
    /// is down and, once it is back, until the restart delay has passed.
    fn shields_until(&self, value: &str, t: Duration) -> Option<f64> {
        self.crashes
            .iter()
            .filter(|(v, _)| v == value)
            .map(|(_, until)| until.map_or(f64::INFINITY, |u| u.as_nanos() as f64))
            .filter(|&end| end > t.as_nanos() as f64)
            .reduce(f64::max)
    }

    /// Runs one job's command on `conn`; `None` if the connection is closed.
    fn apply(
        &mut self,
        conn: ClientId,
        i: usize,
        op: Op,
        lease: &NodeLease,
    ) -> Option<Result<NodeReply, Error>> {
        let (key, value) = (lease.key(i), lease.value());
        Some(match op {
            Op::Acquire { ttl_ms } => {
                // The shipped round trips: `SET NX PX`, then `GET` and `PTTL`
                // only when it found the key set (the second modelled as
                // arriving with the first).
                node_acquire(key, value, ttl_ms, |p| self.run_pipeline(conn, p).ok_or(())).ok()?
            }
            Op::Extend { ttl_ms } => {
                let ttl = ttl_ms.to_string();
                let sha = scripts::LEASE_EXTEND.sha.as_str();
                let reply = self.run(conn, &["EVALSHA", sha, "1", key, value, &ttl])?;
                read_int(reply, "extend").map(NodeReply::Extend)
            }
            Op::Release => {
                let sha = scripts::LEASE_RELEASE.sha.as_str();
                let reply = self.run(conn, &["EVALSHA", sha, "1", key, value, "exact"])?;
                read_int(reply, "release").map(NodeReply::Release)
            }
        })
    }
}

/// A script's integer reply as the connection hands it over: an error reply
/// is the server's error.
fn read_int(reply: Wire, op: &'static str) -> Result<i64, Error> {
    if let Some(n) = reply.as_int() {
        return Ok(n);
    }
    match reply.into_value() {
        redis::Value::ServerError(e) => Err(Error::Server {
            op,
            source: redis::RedisError::from(e),
        }),
        other => Err(Error::UnexpectedReply {
            op: "redlock node",
            reply: format!("{other:?}"),
        }),
    }
}

/// With chance `p`, makes `server` answer the next command on `conn` (run at
/// once) with an error reply instead of running it: `MOVED`, `ASK`,
/// `TRYAGAIN`, `READONLY` or `LOADING` (not `NOSCRIPT`: the model's
/// transport here sends `EVALSHA` without the connection's fallback).
/// Counted in `stats`; draws nothing when `p` is 0, and injects nothing on a
/// closed connection.
fn inject_before(
    server: &mut ModelServer,
    conn: ClientId,
    rng: &mut Rng,
    p: f64,
    stats: &mut Stats,
) {
    if p == 0.0 || !server.is_connected(conn) || !rng.chance(p) {
        return;
    }
    let kind = [0, 1, 2, 3, 5][rng.below(5) as usize];
    let slot = rng.below(16_384) as u16;
    let addr = "10.0.0.9:6379".to_owned();
    server.inject(match kind {
        0 => Injected::Moved { slot, addr },
        1 => Injected::Ask { slot, addr },
        2 => Injected::TryAgain,
        3 => Injected::ReadOnly,
        _ => Injected::Loading,
    });
    stats.injected[kind] += 1;
}

/// One client's transport of one server's node machine.
struct Link {
    node: Node<Handle>,
    /// The model connection the machine uses while it is connected.
    conn: ClientId,
    /// The request out and when it was sent.
    out: Option<(u64, Duration)>,
    /// Failed connect tries in a row.
    failures: u32,
    /// The connector try under way, while not connected.
    trying: Option<u64>,
    /// The server process `conn` belongs to.
    epoch: u32,
}

/// A connector try in progress (the state a `respire-conn-N` thread keeps).
#[derive(Clone, Debug)]
struct Try {
    id: u64,
    c: usize,
    i: usize,
    tainted: Vec<Identity>,
    run_id: Option<Arc<str>>,
    started: Duration,
    /// The try fails if it is not done by then.
    deadline: Duration,
    /// The server process its connection was made to.
    epoch: u32,
    /// That process's `INFO` uptime, whole seconds.
    uptime: u64,
}

enum Purpose {
    Acquire {
        sent: Instant,
        ttl: Duration,
        lease: Arc<NodeLease>,
    },
    Extend {
        cell: Arc<Cell>,
        claimed: Claimed,
    },
    Release {
        lease: Arc<NodeLease>,
        release: Release,
        /// This call's answers while undecided: (node, answer).
        answers: Vec<(usize, Answer)>,
        tries: u32,
    },
}

/// Who extends: the holder's own `extend` (which waits, and settles at its
/// deadline), or the renewal thread (which settles when the answers decide).
enum Claimed {
    User(Extension),
    QuorumRenewal(QuorumRenewal),
}

impl Claimed {
    fn handle_answer(&mut self, answer: &Answer) {
        match self {
            Claimed::User(e) => e.handle_answer(answer.vote, &answer.outcome),
            Claimed::QuorumRenewal(r) => r.handle_answer(answer.vote, &answer.outcome),
        }
    }

    fn is_due(&self) -> bool {
        match self {
            Claimed::User(e) => e.is_due(),
            Claimed::QuorumRenewal(r) => r.is_due(),
        }
    }

    fn is_finished(&self) -> bool {
        match self {
            Claimed::User(e) => e.is_finished(),
            Claimed::QuorumRenewal(r) => r.is_finished(),
        }
    }
}

/// A fan-out in progress.
struct Fan {
    client: usize,
    purpose: Purpose,
    tally: Tally,
    decided: bool,
}

enum Ev {
    Deliver {
        req: u64,
        c: usize,
        i: usize,
        conn: ClientId,
        epoch: u32,
        op: Op,
        lease: Arc<NodeLease>,
    },
    Reply {
        req: u64,
        c: usize,
        i: usize,
        reply: Result<NodeReply, Error>,
    },
    Timeout {
        req: u64,
        c: usize,
        i: usize,
    },
    Decide(FanId),
    UserNext(usize),
    SchedWake,
    /// A connector try starts.
    Reconnect(Try),
    /// Its setup request reaches the server.
    Setup(Try, Duration),
    /// Its setup reply is back: a new connection to `run_id`.
    Opened(Try, ClientId, String),
    /// Its kills reach the server.
    Kill(Try, ClientId, Vec<Identity>, Option<Duration>),
    /// Their replies are back.
    Killed(Try, ClientId, Vec<Wire>),
    /// The try ran out of time.
    TryFailed(Try),
    /// Server `i`'s process is killed (`kill -9`), with or without its data.
    Crash(usize, Persistence),
    /// It starts again.
    Start(usize),
    /// Client `c`'s watcher of server `i` lost it (`None`) or reached it
    /// again, running as the run id given.
    Watched(usize, usize, Option<String>),
}

impl Ev {
    fn name(&self) -> String {
        match self {
            Ev::Deliver { req, c, i, op, .. } => {
                format!("deliver {req} client {c} node {i} {op:?}")
            }
            Ev::Reply { req, c, i, reply } => format!("reply {req} client {c} node {i} {reply:?}"),
            Ev::Timeout { req, c, i } => format!("timeout {req} client {c} node {i}"),
            Ev::Decide(f) => format!("decide {f:?}"),
            Ev::UserNext(c) => format!("user {c}"),
            Ev::SchedWake => "wake".into(),
            Ev::Reconnect(t) => format!("reconnect client {} node {} {:?}", t.c, t.i, t.tainted),
            Ev::Setup(t, _) => format!("setup client {} node {}", t.c, t.i),
            Ev::Opened(t, conn, ..) => format!("opened client {} node {} conn {conn}", t.c, t.i),
            Ev::Kill(t, conn, ids, _) => {
                format!("kill client {} node {} from {conn}: {ids:?}", t.c, t.i)
            }
            Ev::Killed(t, conn, r) => {
                format!("killed client {} node {} from {conn}: {r:?}", t.c, t.i)
            }
            Ev::TryFailed(t) => format!("connect failed client {} node {}", t.c, t.i),
            Ev::Crash(i, p) => format!("crash node {i} {p:?}"),
            Ev::Start(i) => format!("start node {i}"),
            Ev::Watched(c, i, run) => format!("watcher client {c} node {i}: {run:?}"),
        }
    }
}

struct Held {
    cell: Arc<Cell>,
    lease: Arc<NodeLease>,
    keepalive: bool,
    signal: bool,
}

struct Client {
    links: Vec<Link>,
    held: Option<Held>,
    busy: bool,
    owners: u64,
    claim_wait: Option<ResetExpiry>,
    /// Only the holder under test keeps alive and extends.
    full: bool,
    /// What this client's node watchers know.
    watch: Watch,
}

struct World {
    rng: Rng,
    origin: Instant,
    now: Duration,
    timing: Timing,
    net: Net,
    servers: Vec<Server>,
    quorum: usize,
    queue: Queue<Ev>,
    clients: Vec<Client>,
    fans: HashMap<FanId, Fan>,
    next_fan: u64,
    next_req: u64,
    sched: Schedule<Arc<Cell>>,
    wake: Option<Duration>,
    /// Links whose machine may have something to do.
    dirty: Vec<(usize, usize)>,
    /// The checker's own record: per owner value, the servers where one of
    /// its releases deleted the key.
    deleted: HashMap<String, HashSet<usize>>,
    ttls: Vec<Duration>,
    restart_delay: Option<Duration>,
    stats: Stats,
    steps_left: u32,
    trace: bool,
    /// The chance that a node answers a command with an error reply instead
    /// of running it, and the draws for it, apart from the schedule's own.
    inject: f64,
    inject_rng: Rng,
}

pub(crate) fn case(seed: u64) -> Result<Stats, String> {
    run_case(seed, false)
}

/// A schedule whose nodes answer acquires, extensions and releases at
/// random points with error replies (`MOVED`, `ASK`, `TRYAGAIN`,
/// `READONLY`, `LOADING`), handed to the node machine as the connection
/// hands them over: the acquire's replies to the shipped reader, a script's
/// error as the server's error.
pub(crate) fn errors_case(seed: u64) -> Result<Stats, String> {
    run_case(seed, true)
}

fn run_case(seed: u64, inject: bool) -> Result<Stats, String> {
    let mut rng = Rng::new(seed);
    let n = if rng.chance(0.5) { 3 } else { 5 };
    let node_timeout = Duration::from_millis(10 + rng.below(90));
    let drift_factor = [0.0, 0.01, 0.05][rng.below(3) as usize];
    let timing = Timing {
        drift_factor,
        node_timeout,
    };
    let net = Net::random(&mut rng, node_timeout);
    let mut servers: Vec<Server> = (0..n)
        .map(|_| {
            let start_ms = 1_000_000 + rng.below(1_000_000) as i64;
            let mut model = ModelServer::new(rng.next_u64(), start_ms);
            let rate = 1.0 + drift_factor * (2.0 * rng.unit() - 1.0) * 0.999;
            model.set_rate(rate);
            for script in [&scripts::LEASE_EXTEND, &scripts::LEASE_RELEASE] {
                model.command(&["SCRIPT", "LOAD", script.code]);
            }
            Server {
                model,
                rate,
                start_ms,
                at: Duration::ZERO,
                last_in: HashMap::new(),
                last_out: HashMap::new(),
                epoch: 0,
                down_until: None,
                process_start_ms: start_ms - 1_000_000,
                crashes: Vec::new(),
            }
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
    // Crashes come from a generator of their own, so that a schedule
    // without them is the one the seed gave before they existed.
    let mut crashes = Rng::new(seed ^ 0x00c7_a5e5);
    // Without a restart delay a server may crash only with its data (an
    // append-only file): coming back empty, it could grant the lock again
    // at once, which the documented model allows. With one longer than any
    // lease, it may come back empty.
    let longest = *ttls.iter().max().expect("ttls");
    let restart_delay = crashes.chance(0.6).then(|| {
        longest.mul_f64(1.0 + 4.0 * drift_factor) + node_timeout * 2 + Duration::from_secs(1)
    });
    let settings = NodeSettings {
        timing,
        restart_delay,
    };
    let round_trip = Duration::from_micros(net.delay.0 + net.delay.1);
    let clients = (0..2)
        .map(|c| {
            let links = servers
                .iter_mut()
                .enumerate()
                .map(|(i, s)| {
                    let conn = s.model.connect();
                    let first = Connected {
                        id: Some(Identity::by_id(conn)),
                        run_id: Some(Arc::from(s.model.run_id())),
                        started_by: None,
                        round_trip,
                    };
                    Link {
                        node: Node::new(i, format!("node {i}"), settings, first),
                        conn,
                        out: None,
                        failures: 0,
                        trying: None,
                        epoch: 0,
                    }
                })
                .collect();
            Client {
                links,
                held: None,
                busy: false,
                owners: 0,
                claim_wait: None,
                full: c == 0,
                watch: Watch::new(n),
            }
        })
        .collect();
    let mut w = World {
        origin: Instant::now(),
        now: Duration::ZERO,
        timing,
        net,
        servers,
        quorum: n / 2 + 1,
        queue: Queue::new(),
        clients,
        fans: HashMap::new(),
        next_fan: 0,
        next_req: 0,
        sched: Schedule::default(),
        wake: None,
        dirty: Vec::new(),
        deleted: HashMap::new(),
        ttls,
        restart_delay,
        stats: Stats::default(),
        steps_left: 30 + rng.below(30) as u32,
        trace: std::env::var_os("RESPIRE_SIM_TRACE").is_some(),
        rng,
        inject: 0.0,
        inject_rng: Rng::new(seed ^ 0x1e77_0e55),
    };
    if inject {
        w.inject = 0.01 + w.inject_rng.unit() * 0.15;
    }
    for c in 0..2 {
        let at = w.rng.micros(0, 5_000);
        w.queue.push(at, Ev::UserNext(c));
    }
    if crashes.chance(0.4) {
        let within = (w.ttls[0].as_micros() as u64) * 30;
        let persistence = |crashes: &mut Rng| {
            if restart_delay.is_some() && crashes.chance(0.7) {
                Persistence::None
            } else {
                Persistence::Aof
            }
        };
        let mut at = Vec::new();
        if crashes.chance(0.5) {
            // A majority at about the same time (a rack's power).
            let t = crashes.micros(0, within);
            let first = crashes.below(n as u64) as usize;
            for k in 0..w.quorum {
                let spread = crashes.micros(0, node_timeout.as_micros() as u64);
                at.push((t + spread, (first + k) % n, persistence(&mut crashes)));
            }
        } else {
            for _ in 0..1 + crashes.below(3) {
                let i = crashes.below(n as u64) as usize;
                let p = persistence(&mut crashes);
                at.push((crashes.micros(0, within), i, p));
            }
        }
        for (t, i, p) in at {
            w.queue.push(t, Ev::Crash(i, p));
        }
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
            w.drive()?;
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

    fn handle(&mut self, ev: Ev) -> Result<(), String> {
        match ev {
            Ev::Deliver {
                req,
                c,
                i,
                conn,
                epoch,
                op,
                lease,
            } => {
                if epoch == self.servers[i].epoch {
                    self.deliver(req, c, i, conn, op, &lease);
                }
            }
            Ev::Reply { req, c, i, reply } => {
                let link = &mut self.clients[c].links[i];
                if let Some((out, sent)) = link.out
                    && out == req
                {
                    link.out = None;
                    link.node.handle_result(reply, false, self.now - sent);
                    self.dirty.push((c, i));
                }
            }
            Ev::Timeout { req, c, i } => {
                let link = &mut self.clients[c].links[i];
                if let Some((out, sent)) = link.out
                    && out == req
                {
                    link.out = None;
                    self.stats.unanswered += 1;
                    let after = self.now - sent;
                    let e = Error::Timeout {
                        op: "redlock node",
                        after,
                    };
                    link.node.handle_result(Err(e), true, after);
                    self.dirty.push((c, i));
                }
            }
            Ev::Decide(fan) => self.decide(fan)?,
            Ev::UserNext(c) => self.user_step(c)?,
            Ev::Reconnect(t) => self.try_connect(t),
            Ev::Setup(mut t, back) => {
                let s = &mut self.servers[t.i];
                if s.down_until.is_some() {
                    // Refused: the try fails at its deadline.
                    return Ok(());
                }
                s.sync(self.now);
                t.epoch = s.epoch;
                // `INFO`'s uptime_in_seconds: whole seconds of the server's clock.
                t.uptime = ((s.model.now_ms() - s.process_start_ms).max(0) / 1_000) as u64;
                let conn = s.model.connect();
                let run_id = s.model.run_id().to_owned();
                let at = self.now + back;
                if at < t.deadline {
                    self.queue.push(at, Ev::Opened(t, conn, run_id));
                }
            }
            Ev::Opened(t, conn, run_id) => {
                let fences = fences_for(&t.tainted, t.run_id.as_deref(), Some(&run_id)).to_vec();
                if fences.is_empty() {
                    self.connected(&t, conn, &run_id);
                } else {
                    // One round trip for the kills, within the try's budget.
                    let lose = (self.net.p_lose_request, self.net.p_lose_reply);
                    let out = self.net.hop(&mut self.rng, lose.0);
                    let back = self.net.hop(&mut self.rng, lose.1);
                    if let Some(out) = out {
                        let s = &mut self.servers[t.i];
                        let last = s.last_in.get(&conn).copied().unwrap_or_default();
                        let at = (self.now + out).max(last);
                        s.last_in.insert(conn, at);
                        self.queue.push(at, Ev::Kill(t, conn, fences, back));
                    }
                }
            }
            Ev::Kill(t, conn, ids, back) => {
                if self.servers[t.i].epoch != t.epoch {
                    return Ok(());
                }
                // A restarted server numbers its connections from 1 again: a
                // kill must never reach another client's connection.
                for id in &ids {
                    let owner = self.clients.iter().position(|c| {
                        let l = &c.links[t.i];
                        l.epoch == t.epoch && l.conn == id.id()
                    });
                    if let Some(other) = owner.filter(|&o| o != t.c)
                        && self.servers[t.i].model.is_connected(id.id())
                    {
                        return Err(format!(
                            "client {} kills connection {} on node {}, client {other}'s",
                            t.c,
                            id.id(),
                            t.i
                        ));
                    }
                }
                let s = &mut self.servers[t.i];
                s.sync(self.now);
                let replies: Option<Vec<Wire>> = ids
                    .iter()
                    .map(|id| {
                        s.run(
                            conn,
                            &[
                                "CLIENT",
                                "KILL",
                                "ID",
                                &id.id().to_string(),
                                "SKIPME",
                                "yes",
                            ],
                        )
                    })
                    .collect();
                if let (Some(replies), Some(back)) = (replies, back) {
                    let at = self.now + back;
                    if at < t.deadline {
                        self.queue.push(at, Ev::Killed(t, conn, replies));
                    }
                }
            }
            Ev::Killed(t, conn, replies) => {
                let op = "CLIENT KILL (fencing off an unanswered command)";
                let confirmed = replies
                    .into_iter()
                    .all(|r| confirm_kill("model", op, Some(r.into_value())).is_ok());
                if confirmed {
                    let run_id = self.servers[t.i].model.run_id().to_owned();
                    self.connected(&t, conn, &run_id);
                } else {
                    self.try_failed(t);
                }
            }
            Ev::TryFailed(t) => {
                if self.clients[t.c].links[t.i].trying == Some(t.id) {
                    self.try_failed(t);
                }
            }
            Ev::Crash(i, persistence) => self.crash(i, persistence),
            Ev::Start(i) => self.start(i),
            Ev::Watched(c, i, run_id) => self.watched(c, i, run_id.as_deref()),
            Ev::SchedWake => {
                if self.wake == Some(self.now) {
                    self.wake = None;
                }
                let now = self.at();
                for (lease, ticket, ttl) in self.sched.due(now) {
                    self.renew(&lease, (ticket, ttl));
                }
                self.arm();
            }
        }
        Ok(())
    }

    fn deliver(&mut self, req: u64, c: usize, i: usize, conn: ClientId, op: Op, lease: &NodeLease) {
        let (value, t) = (lease.value(), self.now);
        let s = &mut self.servers[i];
        s.sync(t);
        // Judged by the server's own clock, not the true-time bound of
        // `holds_until`: in a key's last millisecond the server still has it,
        // and a release then deletes it.
        let held = s.holds_now(value);
        inject_before(
            &mut s.model,
            conn,
            &mut self.inject_rng,
            self.inject,
            &mut self.stats,
        );
        let Some(reply) = s.apply(conn, i, op, lease) else {
            // A killed connection: the command never runs.
            return;
        };
        if op == Op::Release && held && !s.holds_now(value) {
            self.deleted.entry(value.to_owned()).or_default().insert(i);
        }
        let lose = self.net.p_lose_reply;
        if let Some(d) = self.net.hop(&mut self.rng, lose) {
            let s = &mut self.servers[i];
            let last = s.last_out.get(&conn).copied().unwrap_or_default();
            let at = (self.now + d).max(last);
            s.last_out.insert(conn, at);
            self.queue.push(at, Ev::Reply { req, c, i, reply });
        }
    }

    /// Runs every machine that may have something to do, until none has.
    fn drive(&mut self) -> Result<(), String> {
        while let Some((c, i)) = self.dirty.pop() {
            loop {
                let now = self.at();
                let Some(action) = self.clients[c].links[i].node.poll(now) else {
                    break;
                };
                match action {
                    Action::Respond { handle, answer } => {
                        if let Some(fan) = handle {
                            self.answered(fan, i, answer)?;
                        }
                    }
                    Action::Send {
                        op,
                        lease,
                        deadline,
                    } => self.send(c, i, op, lease, deadline),
                    Action::Connect { tainted, run_id } => {
                        let t = Try {
                            id: 0,
                            c,
                            i,
                            tainted,
                            run_id,
                            started: self.now,
                            deadline: self.now,
                            epoch: 0,
                            uptime: 0,
                        };
                        self.queue.push(self.now, Ev::Reconnect(t));
                    }
                }
            }
        }
        Ok(())
    }

    fn send(&mut self, c: usize, i: usize, op: Op, lease: Arc<NodeLease>, deadline: Instant) {
        let req = self.next_req;
        self.next_req += 1;
        let link = &mut self.clients[c].links[i];
        link.out = Some((req, self.now));
        let (conn, epoch) = (link.conn, link.epoch);
        let lose = self.net.p_lose_request;
        if let Some(d) = self.net.hop(&mut self.rng, lose) {
            let s = &mut self.servers[i];
            let last = s.last_in.get(&conn).copied().unwrap_or_default();
            let at = (self.now + d).max(last);
            s.last_in.insert(conn, at);
            self.queue.push(
                at,
                Ev::Deliver {
                    req,
                    c,
                    i,
                    conn,
                    epoch,
                    op,
                    lease,
                },
            );
        }
        let deadline = deadline.saturating_duration_since(self.origin);
        self.queue
            .push(deadline.max(self.now), Ev::Timeout { req, c, i });
    }

    /// One connector try: the setup round trip (and the kills') within its
    /// budget, or a failure and another try after a pause.
    fn try_connect(&mut self, mut t: Try) {
        t.id = self.next_req;
        self.next_req += 1;
        let link = &mut self.clients[t.c].links[t.i];
        link.trying = Some(t.id);
        let budget = try_budget(
            link.failures,
            self.timing.node_timeout,
            self.timing.node_timeout * 40,
        );
        t.started = self.now;
        t.deadline = self.now + budget;
        self.queue.push(t.deadline, Ev::TryFailed(t.clone()));
        let lose = (self.net.p_lose_request, self.net.p_lose_reply);
        let out = self.net.hop(&mut self.rng, lose.0);
        let back = self.net.hop(&mut self.rng, lose.1);
        if let (Some(out), Some(back)) = (out, back) {
            self.queue.push(self.now + out, Ev::Setup(t, back));
        }
    }

    fn try_failed(&mut self, t: Try) {
        let link = &mut self.clients[t.c].links[t.i];
        link.trying = None;
        link.failures += 1;
        let e = Error::Timeout {
            op: "connect",
            after: self.now - t.started,
        };
        link.node.handle_connect_failed(&e);
        let rest = rest_after(link.failures);
        let again = Try {
            started: self.now + rest,
            ..t
        };
        self.queue.push(self.now + rest, Ev::Reconnect(again));
    }

    fn connected(&mut self, t: &Try, conn: ClientId, run_id: &str) {
        let now = self.at();
        let asked = instant(self.origin, t.started);
        let link = &mut self.clients[t.c].links[t.i];
        let s = &self.servers[t.i];
        if link.trying != Some(t.id) || s.epoch != t.epoch || !s.model.is_connected(conn) {
            return;
        }
        link.trying = None;
        let connected = Connected {
            id: Some(Identity::by_id(conn)),
            run_id: Some(Arc::from(run_id)),
            started_by: started_by(asked, Some(Duration::from_secs(t.uptime))),
            round_trip: self.now - t.started,
        };
        link.node.handle_connected(connected, now);
        link.conn = conn;
        link.epoch = t.epoch;
        link.failures = 0;
        self.dirty.push((t.c, t.i));
    }

    /// `kill -9` of server `i`: every connection dies with the process (and,
    /// without persistence, the data); each client's watcher notices after
    /// one hop.
    fn crash(&mut self, i: usize, persistence: Persistence) {
        let t = self.now;
        let s = &mut self.servers[i];
        if s.down_until.is_some() {
            return;
        }
        s.sync(t);
        let held = match s.model.entry(KEY).map(|e| &e.value) {
            Some(Value::Str(v)) => Some(String::from_utf8_lossy(v).into_owned()),
            _ => None,
        };
        if let (Some(value), Persistence::None) = (held, persistence) {
            s.crashes.push((value, None));
        }
        s.model.restart(persistence);
        s.epoch += 1;
        s.last_in.clear();
        s.last_out.clear();
        let downtime = self
            .rng
            .micros(0, self.timing.node_timeout.as_micros() as u64 * 20);
        s.down_until = Some(t + downtime);
        self.stats.restarts += 1;
        self.queue.push(t + downtime, Ev::Start(i));
        // Each watcher notices the closed connection after one hop (or, if
        // the close is lost on the way, when its ping of the silent
        // connection goes unanswered: within 5 s and a node timeout), then
        // tries to connect again after pauses that grow (`rest_after`); the
        // first try after the start reports the new run id.
        let run_id = s.model.run_id().to_owned();
        let nt = self.timing.node_timeout;
        for c in 0..self.clients.len() {
            let unseen = self.rng.chance(self.net.p_lose_reply);
            let ping = self.rng.micros(0, 5_000_000) + nt;
            let mut hop = || self.net.hop(&mut self.rng, 0.0).expect("not lost");
            let noticed = if unseen { t + ping } else { t + hop() };
            let mut tried = noticed;
            let mut failures = 0;
            while tried < t + downtime {
                failures += 1;
                tried += rest_after(failures);
            }
            let up = tried + hop() + hop();
            self.queue.push(noticed, Ev::Watched(c, i, None));
            self.queue.push(up, Ev::Watched(c, i, Some(run_id.clone())));
        }
    }

    /// Server `i`'s process starts again.
    fn start(&mut self, i: usize) {
        let t = self.now;
        let delay = self.restart_delay.unwrap_or_default();
        let s = &mut self.servers[i];
        s.sync(t);
        s.down_until = None;
        s.process_start_ms = s.model.now_ms();
        for (_, until) in &mut s.crashes {
            until.get_or_insert(t + delay);
        }
    }

    /// What client `c`'s group does with its watcher's news of node `i`:
    /// its live lease is judged again, and lost if too few nodes can still
    /// be counted on.
    fn watched(&mut self, c: usize, i: usize, run_id: Option<&str>) {
        let now = self.at();
        let quorum = self.quorum;
        let restart_delay = self.restart_delay;
        let client = &mut self.clients[c];
        let live: Vec<(Arc<Cell>, Arc<NodeLease>)> = client
            .held
            .iter()
            .filter(|h| !h.cell.is_finished())
            .map(|h| (h.cell.clone(), h.lease.clone()))
            .collect();
        match run_id {
            None => client.watch.went_away(i, now),
            Some(run_id) => {
                if client
                    .watch
                    .came_back(i, run_id, live.iter().map(|(_, l)| &**l))
                    == 0
                {
                    return;
                }
            }
        }
        let short: Vec<Arc<Cell>> = live
            .into_iter()
            .filter(|(cell, lease)| {
                client
                    .watch
                    .judge(lease, cell.lost_at(), restart_delay, quorum)
                    .is_err()
            })
            .map(|(cell, _)| cell)
            .collect();
        for cell in short {
            if !cell.is_lost(now) {
                cell.mark_lost(now, Loss::Other("too few nodes can be counted on".into()));
                self.touch(&cell);
            }
        }
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

    /// Queues `op` on every listed node of client `c`, as one fan-out
    /// (`None`: nobody waits).
    fn fan_out(
        &mut self,
        c: usize,
        op: Op,
        lease: &Arc<NodeLease>,
        targets: &[usize],
        deadline: Instant,
        fan: Option<Fan>,
    ) {
        let id = fan.map(|f| {
            let id = FanId(self.next_fan);
            self.next_fan += 1;
            self.fans.insert(id, f);
            let at = deadline
                .saturating_duration_since(self.origin)
                .max(self.now);
            self.queue.push(at, Ev::Decide(id));
            id
        });
        for &i in targets {
            let job = Job::new(op, lease.clone(), deadline, id);
            self.clients[c].links[i].node.handle_job(job);
            self.dirty.push((c, i));
        }
    }

    fn all(&self) -> Vec<usize> {
        (0..self.servers.len()).collect()
    }

    /// A job's answer reaches its fan-out.
    fn answered(&mut self, id: FanId, node: usize, answer: Answer) -> Result<(), String> {
        let now = self.at();
        let Some(f) = self.fans.get_mut(&id) else {
            return Ok(());
        };
        let due = match &mut f.purpose {
            Purpose::Acquire { .. } => {
                if !f.decided {
                    f.tally.add(
                        answer.vote,
                        answer.outcome == crate::report::NodeOutcome::Granted,
                    );
                }
                !f.decided && (f.tally.decided() || f.tally.outstanding == 0)
            }
            Purpose::Release {
                release, answers, ..
            } => {
                if !f.decided {
                    f.tally.add(
                        answer.vote,
                        answer.outcome == crate::report::NodeOutcome::Granted,
                    );
                    answers.push((node, answer));
                }
                !f.decided && (release.is_decided(&f.tally) || f.tally.outstanding == 0)
            }
            Purpose::Extend { claimed, .. } => {
                claimed.handle_answer(&answer);
                if claimed.is_finished() {
                    let mut f = self.fans.remove(&id).expect("present");
                    let Purpose::Extend { cell, claimed } = &mut f.purpose else {
                        unreachable!("an extension")
                    };
                    let cell = cell.clone();
                    if !f.decided {
                        self.settled(f.client, &cell, claimed);
                    }
                    // Every node's share is finished: later extensions run after it.
                    let fenced = match claimed {
                        Claimed::User(e) => e.finish(&*cell, now),
                        Claimed::QuorumRenewal(r) => r
                            .finish(&*cell, now)
                            .map(|retry| {
                                self.sched.completed(cell.id(), now, Some(retry));
                            })
                            .is_some(),
                    };
                    if fenced {
                        self.stats.fences += 1;
                        self.touch(&cell);
                    }
                    return Ok(());
                }
                claimed.is_due()
            }
        };
        if due {
            self.decide(id)?;
        }
        Ok(())
    }

    /// Applies an extension's verdict (the holder's `extend` returns, or
    /// the renewal is done).
    fn settled(&mut self, c: usize, cell: &Arc<Cell>, claimed: &mut Claimed) {
        let now = self.at();
        let refusal = || "no quorum holds it any more".to_owned();
        match claimed {
            Claimed::User(e) => {
                e.settle(&**cell, now, refusal);
                self.clients[c].busy = false;
                self.think(c);
            }
            Claimed::QuorumRenewal(r) => {
                let (_, retry) = r.settle(&**cell, now, refusal);
                self.sched.completed(cell.id(), now, retry);
            }
        }
        self.touch(cell);
    }

    /// Decides a fan-out: its answers decided it, or its deadline came (a
    /// renewal has none: it waits for its answers).
    fn decide(&mut self, id: FanId) -> Result<(), String> {
        let now = self.at();
        let Some(f) = self.fans.get_mut(&id) else {
            return Ok(());
        };
        if f.decided {
            return Ok(());
        }
        let c = f.client;
        match &mut f.purpose {
            Purpose::Acquire { sent, ttl, lease } => {
                f.decided = true;
                let (sent, ttl, lease, tally) = (*sent, *ttl, lease.clone(), f.tally);
                self.fans.remove(&id);
                self.clients[c].busy = false;
                let elapsed = now - sent;
                if acquired(&tally, validity(ttl, elapsed, self.timing.drift_factor)) {
                    self.stats.grants += 1;
                    if c == 1 && self.clients[0].held.is_some() {
                        self.stats.takeovers += 1;
                    }
                    let core = LeaseCore::granted(self.timing, sent, ttl);
                    let cell = Arc::new(LeaseCell::new(KEY.into(), (), core));
                    self.clients[c].held = Some(Held {
                        cell,
                        lease,
                        keepalive: false,
                        signal: false,
                    });
                } else {
                    let deadline = now + self.timing.node_timeout;
                    let all = self.all();
                    self.fan_out(c, Op::Release, &lease, &all, deadline, None);
                }
                self.think(c);
            }
            Purpose::Extend { claimed, .. } => {
                if matches!(claimed, Claimed::QuorumRenewal(_)) && !claimed.is_due() {
                    // A renewal waits for its answers.
                    return Ok(());
                }
                f.decided = true;
                let mut f = self.fans.remove(&id).expect("present");
                let Purpose::Extend { claimed, cell } = &mut f.purpose else {
                    unreachable!("an extension")
                };
                let cell = cell.clone();
                self.settled(c, &cell, claimed);
                self.fans.insert(id, f);
            }
            Purpose::Release {
                lease,
                release,
                answers,
                tries,
            } => {
                f.decided = true;
                for (node, answer) in answers.drain(..) {
                    release.handle_answer(node, answer.vote, &answer.outcome);
                }
                let (lease, mut release, tries) = (lease.clone(), release.clone(), *tries);
                self.fans.remove(&id);
                match release.conclude() {
                    Ok(deleted) => {
                        self.check_release(&lease, &release, deleted)?;
                        self.clients[c].busy = false;
                        self.think(c);
                    }
                    Err(_) if tries < 3 => {
                        // The user calls `release` again.
                        self.release_call(c, lease, release, tries + 1);
                    }
                    Err(_) => {
                        self.clients[c].busy = false;
                        self.think(c);
                    }
                }
            }
        }
        Ok(())
    }

    /// What a release that reached a quorum reports must be true of the
    /// servers: none it counts as confirmed still holds the lease, and if it
    /// reports the lease deleted, its commands deleted it on a quorum.
    fn check_release(
        &self,
        lease: &NodeLease,
        release: &Release,
        deleted: bool,
    ) -> Result<(), String> {
        let value = lease.value();
        for i in release.confirmed_nodes() {
            if let Some(until) = self.servers[i].holds_until(value, self.now) {
                return Err(format!(
                    "the release of {value} counts node {i} as confirmed at {:?}, but it holds \
                     the lease until {:?}",
                    self.now,
                    Duration::from_nanos(until as u64)
                ));
            }
        }
        let by_us = self.deleted.get(value).map_or(0, HashSet::len);
        if deleted && by_us < self.quorum {
            return Err(format!(
                "the release of {value} reports it deleted on a quorum at {:?}, but its \
                 commands deleted it on {by_us} nodes",
                self.now
            ));
        }
        Ok(())
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
        if let Some(reset) = self.clients[c].claim_wait.take() {
            self.extend(c, reset);
            return Ok(());
        }
        let Some(held) = &self.clients[c].held else {
            if self.steps_left == 0 {
                return Ok(());
            }
            self.steps_left -= 1;
            let n = self.clients[c].owners;
            self.clients[c].owners += 1;
            let value = format!("c{c}o{n}");
            let lease = Arc::new(NodeLease::new(vec![KEY.into(); self.servers.len()], value));
            let ttl = self.ttls[self.rng.below(self.ttls.len() as u64) as usize];
            self.clients[c].busy = true;
            let deadline = now + self.timing.node_timeout;
            let nodes = self.servers.len();
            let fan = Fan {
                client: c,
                purpose: Purpose::Acquire {
                    sent: now,
                    ttl,
                    lease: lease.clone(),
                },
                tally: Tally::new(nodes, nodes),
                decided: false,
            };
            let ttl_ms = ttl.as_millis() as u64;
            let all = self.all();
            self.fan_out(c, Op::Acquire { ttl_ms }, &lease, &all, deadline, Some(fan));
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
                let reset = ResetExpiry::new(now, ttl, self.timing.node_timeout);
                self.extend(c, reset);
                return Ok(());
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

    /// The guard's `reset_expiry`: claim (waiting at most a node timeout, as
    /// `core::extend` says), fan out.
    fn extend(&mut self, c: usize, mut reset: ResetExpiry) {
        let now = self.at();
        let ttl = reset.ttl();
        let Some(held) = &self.clients[c].held else {
            return;
        };
        let (cell, lease) = (held.cell.clone(), held.lease.clone());
        match reset.claim(&cell, now) {
            ResetStep::Done(_) => self.think(c),
            ResetStep::Wait(_) => {
                self.clients[c].claim_wait = Some(reset);
                self.queue
                    .push(self.now + Duration::from_millis(1), Ev::UserNext(c));
            }
            ResetStep::Send(ticket) => {
                self.stats.extensions += 1;
                self.touch(&cell);
                self.clients[c].busy = true;
                let deadline = (now + self.timing.node_timeout).min(cell.valid_until());
                let nodes = self.servers.len();
                let claimed = Claimed::User(Extension::new(ticket, nodes, nodes));
                self.extend_everywhere(c, ttl, claimed, &cell, &lease, deadline);
            }
        }
    }

    /// Sends an extension to `ttl` to every node.
    fn extend_everywhere(
        &mut self,
        c: usize,
        ttl: Duration,
        claimed: Claimed,
        cell: &Arc<Cell>,
        lease: &Arc<NodeLease>,
        deadline: Instant,
    ) {
        let nodes = self.servers.len();
        let fan = Fan {
            client: c,
            purpose: Purpose::Extend {
                cell: cell.clone(),
                claimed,
            },
            tally: Tally::new(nodes, nodes),
            decided: false,
        };
        let ttl_ms = ttl.as_millis() as u64;
        let all = self.all();
        self.fan_out(c, Op::Extend { ttl_ms }, lease, &all, deadline, Some(fan));
    }

    /// The renewal thread's dispatch of one lease the schedule claimed.
    fn renew(&mut self, cell: &Arc<Cell>, (ticket, ttl): (Ticket, Duration)) {
        let now = self.at();
        let c = 0;
        let lease = match &self.clients[c].held {
            Some(held) if Arc::ptr_eq(&held.cell, cell) => held.lease.clone(),
            _ => {
                cell.not_sent(ticket, now);
                self.sched.completed(cell.id(), now, None);
                return;
            }
        };
        let nodes = self.servers.len();
        let nt = self.timing.node_timeout;
        let (renewal, deadline) = QuorumRenewal::new(&**cell, (ticket, ttl), now, nt, nodes);
        self.stats.extensions += 1;
        let claimed = Claimed::QuorumRenewal(renewal);
        self.extend_everywhere(c, ttl, claimed, cell, &lease, deadline);
    }

    /// The guard's `release`: flagged finished, then sent to every node.
    fn release(&mut self, c: usize) -> Result<(), String> {
        let now = self.at();
        let Some(h) = self.clients[c].held.take() else {
            return Ok(());
        };
        h.cell.finish(now);
        self.sched.forget(h.cell.id());
        self.clients[c].busy = true;
        let release = Release::new(self.servers.len());
        self.release_call(c, h.lease, release, 0);
        Ok(())
    }

    /// One call of `release`: to the nodes that have not confirmed.
    fn release_call(&mut self, c: usize, lease: Arc<NodeLease>, release: Release, tries: u32) {
        let deadline = self.at() + self.timing.node_timeout;
        let targets = release.targets();
        let fan = Fan {
            client: c,
            purpose: Purpose::Release {
                lease: lease.clone(),
                release,
                answers: Vec::new(),
                tries,
            },
            tally: Tally::new(self.servers.len(), targets.len()),
            decided: false,
        };
        self.fan_out(c, Op::Release, &lease, &targets, deadline, Some(fan));
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
        let value = h.lease.value();
        if let Some(other) = &self.clients[1].held
            && !other.cell.is_finished()
            && !other.cell.peek_lost(now)
        {
            return Err(format!(
                "two guards hold the lock at {t:?}: {value} (valid until {:?}) and {} (valid \
                 until {:?})",
                h.cell.valid_until().duration_since(self.origin),
                other.lease.value(),
                other.cell.valid_until().duration_since(self.origin)
            ));
        }
        // Each server's expiry of this holder's value, in true time.
        // A server a crash took the key from keeps others from it while it
        // is down and then for the restart delay.
        let mut expiries: Vec<f64> = self
            .servers
            .iter()
            .filter_map(|s| s.holds_until(value, t).or(s.shields_until(value, t)))
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
                self.servers.len()
            ));
        }
        Ok(())
    }
}
