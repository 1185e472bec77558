//! Single-deployment leases: two processes, three user threads, two lease keys
//! sharing one fence counter, each process with its renewal schedule and
//! executor, against one model server (`sim::model`, running the shipped
//! scripts and commands; with a lagging replica and a promotion in some
//! schedules, which each process goes through in the runtime's steps, and a
//! forward jump of the primary's clock in others). Each acquire attempt sends
//! what the primitive's shipped attempt sends (a `Lock`'s `SET … GET`, with
//! the wait's `PTTL` once an attempt found the lock held; the scripts with
//! their arguments; on a server before Redis 7.0, the older form) and its
//! replies are read by the primitive's shipped reader; the checker holds
//! that reading against the server's data (granted exactly when the owner
//! holds the lease after the command, counted from the right send).
//!
//! Sets of leases taken all or nothing (`sets_case`): three clients take
//! random subsets of four plain or fenced leases in random orders with the
//! shipped `multi_acquire`, on a server whose clock runs fast or slow; replies
//! are lost, attempts arrive late, and an acquire that gives up kills its
//! connections and deletes by owner with the shipped `multi_clean_up`. No key
//! is ever held by two owners whose bounds have not run out.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::model::{ClientId, Entry, Injected, ModelServer, Reply, Value, argv};
use super::{INJECTED_KINDS, Net, Queue, Rng, Stats, instant};
use crate::core::acquire::{Attempts, CleanUp, dated};
use crate::core::executor::{
    Claimed, Command, Executor as Machine, ExtendReply, RenewalBatch, Settled,
};
use crate::core::extend::{ResetDone, ResetExpiry, ResetStep};
use crate::core::fences::FenceBook;
use crate::core::lease::{LeaseCore, Ticket, Verdict};
use crate::core::schedule::{Schedule, Watched};
use crate::core::server_clock::{self, Reading, ServerClock};
use crate::core::timing::Timing;
use crate::guard::ReleaseOutcome;
use crate::lease::fenced::FencedSpec;
use crate::lease::kind::{Acquire, Granted};
use crate::lease::lock::PlainSpec;
use crate::lease::multi::{SetReply, fenced_value, read_set};
use crate::lease::parse_token;
use crate::lease::rwlease::{Preference, ReadSpec, WriteSpec};
use crate::lease::semaphore::SemSpec;
use crate::runtime::lease::LeaseCell;
use crate::runtime::renewal::{Ops, Shape};
use crate::runtime::waiters::Attempt;
use crate::scripts;
use crate::token::OwnerToken;

mod heard;

type ConnId = u64;

/// What a model lease knows of itself.
struct Meta {
    key: usize,
    value: String,
}

type Cell = LeaseCell<Meta>;

/// The fence counter both lease keys share.
const FENCE: &str = "fence";

/// How a key is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyKind {
    /// A plain `Lock`: `SET NX PX GET`, no token.
    Plain,
    /// A fenced lease: the shipped script, a token from [`FENCE`].
    Fenced,
    /// A semaphore of this capacity: a permit is a member of the permit set
    /// with a slot and a token from the meta hash.
    Permits(u32),
    /// A reader/writer lease, with writer preference or not. An owner ending
    /// in `r` reads (a member of the reader set, no token), one ending in `w`
    /// writes (the writer key, `owner:token`, a token from its own counter).
    Rw { writers_first: bool },
}

/// Lease keys 0 and 1 on the model server, each with the keys beside it: a
/// semaphore's meta hash and slot bitmap, a reader/writer lease's reader set,
/// intents and counter. Named once: the checker reads them at every instant.
const NAMES: [[&str; 6]; 2] = [
    ["k0", "k0:meta", "k0:slots", "k0:r", "k0:q", "k0:fence"],
    ["k1", "k1:meta", "k1:slots", "k1:r", "k1:q", "k1:fence"],
];

/// A lease key's name on the model server (a semaphore's permit set).
fn key_name(key: usize) -> &'static str {
    NAMES[key][0]
}

/// A semaphore's permit set, meta hash and slot bitmap.
fn sem_keys(key: usize) -> [&'static str; 3] {
    let n = &NAMES[key];
    [n[0], n[1], n[2]]
}

/// A reader/writer lease's writer key, reader set, intents and counter.
fn rw_keys(key: usize) -> [&'static str; 4] {
    let n = &NAMES[key];
    [n[0], n[3], n[4], n[5]]
}

/// The shipped acquire of a key: what an attempt sends and how its reply is
/// read, made over the model server's key names.
enum Spec {
    Plain(PlainSpec),
    Fenced(FencedSpec),
    Rw(ReadSpec, WriteSpec),
    Permits(SemSpec, u32),
}

/// What a shipped reader made of an attempt's reply: the token (0: none),
/// the value or member held, and when the lease counts from.
type Read = Attempt<(u64, String, Instant)>;

impl Spec {
    fn new(kind: KeyKind, key: usize, timing: Timing) -> Spec {
        match kind {
            KeyKind::Plain => Spec::Plain(PlainSpec::new(key_name(key).to_owned())),
            KeyKind::Fenced => {
                Spec::Fenced(FencedSpec::new(key_name(key).to_owned(), FENCE.to_owned()))
            }
            KeyKind::Rw { writers_first } => {
                let keys = rw_keys(key).map(str::to_owned);
                let preference = if writers_first {
                    Preference::Writer
                } else {
                    Preference::Reader
                };
                Spec::Rw(
                    ReadSpec::new(keys.clone(), preference),
                    WriteSpec::new(keys, preference, timing),
                )
            }
            KeyKind::Permits(capacity) => Spec::Permits(
                SemSpec::from_keys(sem_keys(key).map(str::to_owned), capacity),
                capacity,
            ),
        }
    }

    /// The commands of one attempt of `owner` (inside a wait when
    /// `waiting`), in order: a plain lock's `SET … GET` when `set_get`, else
    /// `SET NX PX` and `GET`. No connection tracks keys.
    fn request(&self, owner: &str, ttl_ms: u64, waiting: bool, set_get: bool) -> Vec<redis::Cmd> {
        let ttl = ttl_ms.to_string();
        let evalsha = |script: &'static scripts::Script, keys: &[&str], args: &[&str]| {
            vec![script.evalsha(keys, args)]
        };
        match self {
            Spec::Plain(spec) => spec
                .request(owner, ttl_ms, set_get, false, waiting)
                .cmd_iter()
                .cloned()
                .collect(),
            Spec::Fenced(spec) => spec.request(owner, &ttl, evalsha),
            Spec::Rw(read, _) if owner.ends_with('r') => read.request(owner, &ttl, evalsha),
            Spec::Rw(_, write) => {
                write.request(owner, &ttl, write.intent(ttl_ms, waiting), evalsha)
            }
            Spec::Permits(spec, capacity) => spec.request(owner, &ttl, *capacity, evalsha),
        }
    }

    /// The shipped clean-up after unanswered attempts of `owner`.
    fn clean_up(&self, owner: &OwnerToken) -> redis::Cmd {
        match self {
            Spec::Plain(spec) => spec.clean_up(owner),
            Spec::Fenced(spec) => spec.clean_up(owner),
            Spec::Rw(read, _) if owner.as_str().ends_with('r') => read.clean_up(owner),
            Spec::Rw(_, write) => write.clean_up(owner),
            Spec::Permits(spec, _) => spec.clean_up(owner),
        }
    }

    /// Reads the replies to a [`request`](Spec::request) sent at `sent`, as
    /// the shipped attempt does; `since` is when the owner's first
    /// unanswered attempt went out. `None`: the server refused `SET` with
    /// `NX` and `GET`, and the attempt goes again in the older form.
    #[allow(clippy::too_many_arguments, reason = "one attempt's whole context")]
    fn read(
        &self,
        reply: &[redis::Value],
        owner: &str,
        ttl_ms: u64,
        waiting: bool,
        set_get: bool,
        sent: Instant,
        since: Option<Instant>,
    ) -> Result<Option<Read>, String> {
        fn took<G>(
            read: crate::error::Result<Attempt<Granted<G>>>,
            token: impl Fn(&G) -> u64,
        ) -> Result<Option<Read>, String> {
            Ok(Some(
                match read.map_err(|e| format!("acquire reply: {e}"))? {
                    Attempt::Acquired(g) => {
                        Attempt::Acquired((token(&g.grant), g.ops.member.clone(), g.sent))
                    }
                    Attempt::Busy(hint) => Attempt::Busy(hint),
                },
            ))
        }
        // A script's reply is one array, which the connection hands over as
        // its items.
        let reply = match (self, reply) {
            (Spec::Plain(_), reply) => reply,
            (_, [redis::Value::Array(items)]) => items.as_slice(),
            (_, other) => return Err(format!("a script's reply that is not one array: {other:?}")),
        };
        match self {
            Spec::Plain(spec) => match spec.read(reply, set_get, owner, sent, since) {
                Some(read) => took(read, |()| 0),
                None => Ok(None),
            },
            Spec::Fenced(spec) => took(spec.read(reply, owner, sent), |t| t.get()),
            // A reader holds no token (its grant is the write epoch it
            // joined).
            Spec::Rw(read, _) if owner.ends_with('r') => took(read.read(reply, owner, sent), |_| 0),
            Spec::Rw(_, write) => took(
                write.read(reply, owner, sent, write.intent(ttl_ms, waiting)),
                |t| t.get(),
            ),
            Spec::Permits(spec, _) => took(spec.read(reply, owner, sent), |(_, t)| t.get()),
        }
    }
}

/// The shipped extension, verification and release commands of a lease held
/// as `value` on `key`.
fn ops(kind: KeyKind, key: usize, value: &str) -> Ops {
    match kind {
        KeyKind::Rw { .. } if !value.contains(':') => Ops::member(
            vec![rw_keys(key)[1].to_owned()],
            value.to_owned(),
            &scripts::RW_READ_EXTEND,
            &scripts::RW_READ_VERIFY,
            &scripts::RW_READ_RELEASE,
        ),
        KeyKind::Plain | KeyKind::Fenced | KeyKind::Rw { .. } => {
            Ops::string_value(key_name(key), value.to_owned())
        }
        KeyKind::Permits(_) => Ops::member(
            sem_keys(key).map(str::to_owned).to_vec(),
            value.to_owned(),
            &scripts::SEM_EXTEND,
            &scripts::SEM_VERIFY,
            &scripts::SEM_RELEASE,
        ),
    }
}

/// Runs a shipped command on `client`, as the connection does: `EVALSHA`,
/// then `EVAL` when the server lost the script. `None`: the connection is
/// closed.
fn run_on(server: &mut ModelServer, client: ClientId, cmd: &redis::Cmd) -> Option<Reply> {
    let mut argv = argv(cmd);
    let reply = server.command_from(client, &argv)?;
    match &reply {
        Reply::Error(e) if e.starts_with("NOSCRIPT") => {
            let sha = String::from_utf8_lossy(&argv[1]).into_owned();
            let script = [
                &*scripts::FENCED_ACQUIRE,
                &*scripts::LEASE_EXTEND,
                &*scripts::LEASE_VERIFY,
                &*scripts::LEASE_RELEASE,
                &*scripts::SEM_ACQUIRE,
                &*scripts::SEM_EXTEND,
                &*scripts::SEM_VERIFY,
                &*scripts::SEM_RELEASE,
                &*scripts::RW_READ_ACQUIRE,
                &*scripts::RW_READ_EXTEND,
                &*scripts::RW_READ_VERIFY,
                &*scripts::RW_READ_RELEASE,
                &*scripts::RW_WRITE_ACQUIRE,
                &*scripts::RW_WRITE_CLEAN_UP,
                &*scripts::MULTI_ACQUIRE,
                &*scripts::MULTI_CLEAN_UP,
            ]
            .into_iter()
            .find(|s| s.sha == sha)?;
            argv[0] = b"EVAL".to_vec();
            argv[1] = script.code.as_bytes().to_vec();
            server.command_from(client, &argv)
        }
        _ => Some(reply),
    }
}

/// With chance `p`, makes `server` answer the next command, `cmd` (run at
/// once), with an error reply instead of running it: one of
/// [`INJECTED_KINDS`], `NOSCRIPT` only for `EVALSHA`. Counted in `stats`.
/// Draws nothing when `p` is 0.
fn inject_before(
    server: &mut ModelServer,
    rng: &mut Rng,
    p: f64,
    cmd: &redis::Cmd,
    stats: &mut Stats,
) {
    if p == 0.0 || !rng.chance(p) {
        return;
    }
    let evalsha = argv(cmd)
        .first()
        .is_some_and(|a| a.eq_ignore_ascii_case(b"EVALSHA"));
    let kind = match evalsha {
        true => rng.below(6) as usize,
        false => [0, 1, 2, 3, 5][rng.below(5) as usize],
    };
    let slot = rng.below(16_384) as u16;
    server.inject(match kind {
        0 => Injected::Moved {
            slot,
            addr: "10.0.0.9:6379".to_owned(),
        },
        1 => Injected::Ask {
            slot,
            addr: "10.0.0.9:6379".to_owned(),
        },
        2 => Injected::TryAgain,
        3 => Injected::ReadOnly,
        4 => Injected::NoScript,
        _ => Injected::Loading,
    });
    debug_assert_eq!(INJECTED_KINDS.len(), stats.injected.len());
    stats.injected[kind] += 1;
}

/// A string key's value, if it holds one.
fn string_at(server: &ModelServer, key: &str) -> Option<String> {
    match server.entry(key).map(|e| &e.value) {
        Some(Value::Str(v)) => Some(String::from_utf8_lossy(v).into_owned()),
        _ => None,
    }
}

/// A hash field, if the key is a hash holding it.
fn field_at(server: &ModelServer, key: &str, field: &str) -> Option<String> {
    match server.entry(key).map(|e| &e.value) {
        Some(Value::Hash(h)) => h
            .get(field.as_bytes())
            .map(|v| String::from_utf8_lossy(v).into_owned()),
        _ => None,
    }
}

/// The counters on `server`: the fence counter, key 0's semaphore's and its
/// reader/writer lease's.
fn counters(server: &ModelServer) -> [u64; 3] {
    let n = |v: Option<&[u8]>| {
        v.map_or(0, |v| {
            std::str::from_utf8(v)
                .ok()
                .and_then(|v| v.parse().ok())
                .expect("a counter")
        })
    };
    let string = |key: &str| match server.entry(key).map(|e| &e.value) {
        Some(Value::Str(v)) => Some(v.as_slice()),
        _ => None,
    };
    let field = match server.entry(sem_keys(0)[1]).map(|e| &e.value) {
        Some(Value::Hash(h)) => h.get(b"fence".as_slice()).map(Vec::as_slice),
        _ => None,
    };
    [n(string(FENCE)), n(field), n(string(rw_keys(0)[3]))]
}

/// The unexpired members of a sorted set scored by expiry (a semaphore's
/// permits, a lease's readers): member and score.
fn permits(server: &ModelServer, key: usize) -> Vec<(String, f64)> {
    members(server, key_name(key))
}

fn members(server: &ModelServer, set: &str) -> Vec<(String, f64)> {
    match server.entry(set).map(|e| &e.value) {
        Some(Value::ZSet(z)) => z
            .iter()
            .map(|(m, score)| (String::from_utf8_lossy(m).into_owned(), score))
            .filter(|(_, score)| *score > server.now_ms() as f64)
            .collect(),
        _ => Vec::new(),
    }
}

#[derive(Clone, Debug)]
enum Req {
    /// One attempt: the shipped attempt's commands for the key's kind.
    Acquire {
        key: usize,
        owner: String,
        ttl_ms: u64,
        waiting: bool,
        /// A plain lock's `SET` carries `GET`.
        set_get: bool,
    },
    /// The shipped extension of each lease, in one pipeline; the
    /// executor's renewal pipeline reads the server's `TIME` first.
    Extend {
        items: Vec<(usize, String, u64)>,
        time: bool,
    },
    Verify {
        key: usize,
        value: String,
    },
    Release {
        key: usize,
        value: String,
    },
    /// The shipped clean-up after unanswered attempts of `owner`.
    ReleasePrefix {
        key: usize,
        owner: String,
    },
    Kill {
        target: ConnId,
    },
}

#[derive(Clone, Debug)]
enum Resp {
    /// An attempt's replies, and what the server's data showed: whether the
    /// owner held the lease before it ran, and whether after.
    Attempt {
        reply: Vec<redis::Value>,
        existed: bool,
        holds: bool,
        set_get: bool,
    },
    Ints(Vec<i64>),
    /// Each extension's reply (`None`: an error reply, the script did not
    /// run).
    Extended(Vec<Option<i64>>),
    /// A renewal pipeline's replies: the server's `TIME` (read when the
    /// pipeline ran, at `read_at` true time), then each extension's.
    Renewed {
        time: Vec<String>,
        read_at: Duration,
        ints: Vec<Option<i64>>,
    },
    /// An error reply instead of running the command.
    Refused,
    /// A release's reply, and the outcome the server's data called for.
    Released {
        code: i64,
        expected: ReleaseOutcome,
    },
    Done,
}

/// What a request was for, on the client side.
enum Purpose {
    Acquire,
    /// The guard's extension under `ticket`.
    Reset {
        ticket: Ticket,
        reset: ResetExpiry,
    },
    Verify,
    Release,
    Renew {
        renewal: RenewalBatch<Arc<Cell>>,
    },
    ExecVerify {
        cell: Arc<Cell>,
    },
    Kill,
    CleanupRelease,
}

struct Pending {
    who: Who,
    purpose: Purpose,
    sent: Instant,
    conn: ConnId,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Who {
    User(usize),
    /// Process `p`'s executor of the primary of this generation.
    Exec(usize, u32),
}

enum Ev {
    Deliver {
        id: u64,
        conn: ConnId,
        req: Req,
    },
    Reply {
        id: u64,
        resp: Resp,
    },
    Timeout {
        id: u64,
    },
    UserNext(usize),
    SchedWake(usize),
    ExecNext(usize),
    CounterBack,
    /// The replica takes over.
    Promote,
    /// `n` more writes of generation `generation`'s stream reach its replica.
    Replicate {
        generation: u32,
        n: usize,
    },
    /// Process `p` publishes the new primary: new sends go to it.
    Publish(usize),
    /// Process `p` retires the old primary: its executor's claims held for
    /// kills are freed, and nothing it says counts any more.
    Retire(usize),
    /// Process `p` applies the switch to every live lease (the claims whose
    /// command went elsewhere are given up) and verifies them on the new
    /// primary.
    Switched(usize),
    /// User `u` sends the extension it claimed (after connecting, or being
    /// descheduled, since the claim).
    ResetSend {
        u: usize,
        ticket: Ticket,
        reset: ResetExpiry,
    },
    /// The current primary's wall clock jumps forward by this many ms.
    ClockStep(i64),
    /// Someone deletes the key (an operator, an eviction).
    Delete(usize),
    /// The last fault is over: no message is lost or slow from now on and
    /// no error reply is injected, and every key must be granted again
    /// within [`REGRANT_TTLS`] of the schedule's longest TTL.
    Heal,
}

impl Ev {
    fn name(&self) -> String {
        match self {
            Ev::Deliver { id, req, .. } => format!("deliver {id} {req:?}"),
            Ev::Reply { id, resp } => format!("reply {id} {resp:?}"),
            Ev::Timeout { id } => format!("timeout {id}"),
            Ev::UserNext(u) => format!("user {u}"),
            Ev::SchedWake(p) => format!("wake {p}"),
            Ev::ExecNext(p) => format!("exec {p}"),
            Ev::CounterBack => "counter back".into(),
            Ev::Promote => "promote".into(),
            Ev::Replicate { generation, n } => format!("replicate {n} of {generation}"),
            Ev::Publish(p) => format!("publish {p}"),
            Ev::Retire(p) => format!("retire {p}"),
            Ev::Switched(p) => format!("switched {p}"),
            Ev::ResetSend { u, ticket, .. } => format!("reset send {u} {ticket:?}"),
            Ev::ClockStep(ms) => format!("clock step {ms} ms"),
            Ev::Delete(key) => format!("delete {key}"),
            Ev::Heal => "heal".into(),
        }
    }
}

struct Guard {
    cell: Arc<Cell>,
    value: String,
    key: usize,
    keepalive: bool,
    signal: bool,
    /// Granted or confirmed by a primary that was replaced, and not yet
    /// verified on the new one: the model allows its bound to be wrong.
    exposed: bool,
    /// When its key was deleted, while no reply to a command sent after that
    /// came: until then it cannot know.
    deleted: Option<Instant>,
    /// A check found it lost: loss is permanent.
    seen_lost: bool,
    /// Its server's clock jumped forward since its bound was set, and its
    /// process has not read that server's clock both before and after the
    /// jump (nor has an extension sent after it been confirmed): until then
    /// the client cannot know.
    stepped: bool,
    /// Kept alive since a moment with time enough to renew.
    renewable: bool,
}

/// A user thread's acquire in progress: its owner, its attempts (the shipped
/// bookkeeping), how many attempts are left.
struct Acquiring {
    owner: String,
    ttl: Duration,
    attempts: Attempts<ConnId>,
    /// The checker's own record of the connections whose attempt got no
    /// reply: each must be killed when the acquire ends.
    lost: Vec<ConnId>,
    tries: u32,
    /// An attempt found the lease held (or got no reply): the next ones
    /// are a wait's.
    waiting: bool,
}

struct User {
    proc: usize,
    key: usize,
    conn: ConnId,
    busy: bool,
    guard: Option<Guard>,
    acquiring: Option<Acquiring>,
    owners: u64,
    /// A reset_expiry waiting for an extension in flight to free the claim.
    claim_wait: Option<ResetExpiry>,
}

enum Job {
    /// Renew these leases, each claimed by the schedule.
    Renew(Vec<Claimed<Arc<Cell>>>),
    /// Verify a lease on the new primary after a switch.
    Verify(Arc<Cell>),
    /// `None`: the connection's id is unknown (`CLIENT ID` denied).
    Fence(Option<ConnId>, Arc<Cell>, Ticket),
    /// Kill these connections, then delete by owner (`None`: only kill).
    Cleanup(Vec<ConnId>, usize, Option<String>, Duration),
}

/// A process's executor of one server: the shipped machine, driven over one
/// model connection, one request at a time, with its job queue and the
/// last reading of its server's clock.
struct Exec {
    /// The generation of the primary it talks to.
    server: u32,
    conn: ConnId,
    busy: bool,
    /// Its server was retired: nothing it says counts any more.
    retired: bool,
    queue: VecDeque<Job>,
    /// Clean-ups carry the key and the owner to delete by.
    machine: Machine<Arc<Cell>, (usize, Option<String>), ConnId>,
    /// The shipped reading of the server's clock.
    clock: ServerClock,
    /// When (true time) the server ran the last `TIME` fed to `clock`.
    last_read: Option<Duration>,
}

impl Proc {
    /// Its executor of the primary of `generation`, if it has one.
    fn exec_of(&mut self, generation: u32) -> Option<&mut Exec> {
        if self.exec.server == generation {
            return Some(&mut self.exec);
        }
        self.old.as_mut().filter(|e| e.server == generation)
    }
}

impl Exec {
    fn new(server: u32, conn: ConnId, timing: Timing) -> Exec {
        Exec {
            server,
            conn,
            busy: false,
            retired: false,
            queue: VecDeque::new(),
            machine: Machine::new(timing),
            clock: ServerClock::default(),
            last_read: None,
        }
    }
}

/// The id the transport gives the primary of `generation`.
fn server_id(generation: u32) -> u64 {
    u64::from(generation) + 1
}

struct Proc {
    fences: FenceBook,
    /// Tokens accepted, by counter, with when their reply came.
    accepted: Vec<(usize, u64, Instant)>,
    sched: Schedule<Arc<Cell>>,
    wake: Option<Duration>,
    /// The primary this process knows (its connections go there).
    generation: u32,
    /// Whether its connections know their ids (an ACL may deny `CLIENT
    /// ID`): without them nothing unanswered can be fenced off.
    ids: bool,
    /// The executor of the primary it knows.
    exec: Exec,
    /// The executor of the primary it switched away from, until that one is
    /// retired and its last request answered.
    old: Option<Exec>,
    /// Generations below this are retired: their answers do not count.
    live_from: u32,
    /// Between publishing a new primary and applying the switch to the leases.
    switching: bool,
    /// Its executor read the primary's clock before and after its last jump.
    seen_step: bool,
}

struct World {
    rng: Rng,
    origin: Instant,
    now: Duration,
    timing: Timing,
    net: Net,
    /// The current primary (with a replica, in some schedules).
    server: ModelServer,
    /// The primary before the last promotion: it still serves the
    /// connections made to it, and what it does there is never replicated.
    old: Option<ModelServer>,
    generation: u32,
    /// The primary generation each connection was made to.
    conn_gen: HashMap<ConnId, u32>,
    /// Each connection's id on the server it leads to.
    clients: HashMap<ConnId, ClientId>,
    /// Per connection, the last delivery and the last reply (order is kept
    /// per connection only).
    last_in: HashMap<ConnId, Duration>,
    last_out: HashMap<ConnId, Duration>,
    /// How long a write takes to reach the replica, and how many writes of
    /// the stream a pending `Replicate` event already covers.
    lag: Duration,
    streamed: usize,
    /// How each key is held.
    kinds: [KeyKind; 2],
    /// The shipped acquire of each key.
    specs: [Spec; 2],
    /// Whether each key's last lease ended by a release or a deletion (not
    /// by expiry), for the takeover count.
    ended: [bool; 2],
    /// Whether a counter ever went back (a promotion that lost increments,
    /// a fault): tokens may then repeat.
    went_back: bool,
    /// Owners whose clean-up ran, by primary generation: no attempt of
    /// theirs may grant there after it.
    cleaned: HashSet<(u32, String)>,
    queue: Queue<Ev>,
    procs: Vec<Proc>,
    users: Vec<User>,
    pending: HashMap<u64, Pending>,
    next_id: u64,
    next_conn: ConnId,
    ttls: Vec<Duration>,
    stats: Stats,
    steps_left: u32,
    trace: bool,
    /// Every fencing token a user was handed, with its owner: the checker's
    /// own record, not the model server's counter.
    delivered: HashMap<(usize, u64), String>,
    /// When each key was last deleted by a fault.
    deleted_at: [Option<Instant>; 2],
    /// No loss, no slow message, no fault: every kept-alive lease must live.
    calm: bool,
    /// What an observer of every lease heard.
    hearing: Arc<heard::Hearing>,
    /// When the primary's clock last jumped forward, and that primary's
    /// generation.
    stepped: Option<(Duration, u32)>,
    /// The chance that a server answers an attempt, an extension or a
    /// release with an error reply instead of running it (see
    /// [`World::inject_before`]), and the draws for it, apart from the
    /// schedule's own so that a schedule without injected errors is the
    /// same schedule as before they existed.
    inject: f64,
    inject_rng: Rng,
    /// When the faults healed ([`Ev::Heal`]), and for each key, that time
    /// while the key has not been granted since.
    healed: Option<Duration>,
    wanted: [Option<Duration>; 2],
}

/// After the last fault of a schedule heals (no more lost or slow messages,
/// injected error replies, failovers, clock jumps, counter or key losses),
/// every key is granted again within this many of the schedule's longest
/// TTL, while its users keep asking for it (holders release it and ask
/// again): a lease set or extended before the heal, by a command whose reply
/// was lost, has expired by one TTL after its command arrived (a slow message
/// arrives within three node timeouts), and a waiting attempt that finds the
/// key held sleeps for the time left it had (the shipped wait's hint). Two
/// TTLs of slack on top of that one cover a switch that completes after the
/// heal and a server clock that runs slow within the drift factor.
const REGRANT_TTLS: u32 = 3;

/// Lease keys 0 and 1 share one fence counter. Users 0 (process 0) and 2
/// (process 1) contend for key 0; user 1 (process 0) holds key 1.
const USERS: [(usize, usize); 3] = [(0, 0), (0, 1), (1, 0)];

pub(crate) fn case(seed: u64) -> Result<Stats, String> {
    run_case(seed, false, false)
}

/// A schedule with a failover (its switch in separate steps that other
/// events interleave with) or a forward jump of the primary's clock, or both.
pub(crate) fn faults_case(seed: u64) -> Result<Stats, String> {
    run_case(seed, true, false)
}

/// A schedule, with a failover or a clock jump in every other one, whose
/// server answers attempts, extensions and releases at random points with
/// the error replies a deployment sends instead of running a command
/// (`MOVED`, `ASK`, `TRYAGAIN`, `READONLY`, `NOSCRIPT`, `LOADING`). Each is
/// read as the shipped code reads it: `NOSCRIPT` is followed by `EVAL` (the
/// connection's fallback); any other error reply to an attempt is a failed
/// attempt that changed nothing (the shipped `Error::is_retryable` must call
/// it retryable; the wait tries again), to a renewal's extension the
/// executor machine's `NotRun`, to the guard's extension the cell's
/// `not_sent`, and a release answered so is left to expire (the runtime
/// sends it again in the background, which is not modelled).
pub(crate) fn errors_case(seed: u64) -> Result<Stats, String> {
    run_case(seed, seed & 1 == 1, true)
}

fn run_case(seed: u64, faulty: bool, inject: bool) -> Result<Stats, String> {
    let mut rng = Rng::new(seed);
    let node_timeout = Duration::from_millis(10 + rng.below(190));
    let drift_factor = [0.0, 0.01, 0.05][rng.below(3) as usize];
    let timing = Timing {
        drift_factor,
        node_timeout,
    };
    let net = Net::random(&mut rng, node_timeout);
    // The server's clock runs fast or slow within the drift factor.
    let rate = 1.0 + drift_factor * (2.0 * rng.unit() - 1.0) * 0.999;
    let usable = (0..)
        .map(|i| node_timeout + Duration::from_millis(5 + i * 7))
        .find(|t| timing.usable_ttl(*t))
        .expect("some ttl is usable");
    let keepalive = timing.min_keepalive_ttl() + Duration::from_millis(1);
    // From barely usable to a few hundred node timeouts, where the drift
    // allowance is larger than the node timeout.
    let mut ttls = vec![
        usable,
        usable * 2,
        keepalive,
        keepalive * 2,
        keepalive * 4,
        node_timeout * 60,
        node_timeout * 240,
    ];
    // Whole milliseconds, as the shipped code sends them.
    for t in &mut ttls {
        *t = Duration::from_millis(t.as_nanos().div_ceil(1_000_000) as u64);
    }
    ttls.retain(|t| timing.usable_ttl(*t));
    // Drawn in this order: a seed replays the same schedule.
    let server = ModelServer::new(seed, 1_700_000_000_000 + rng.below(1 << 30) as i64);
    let lag = Duration::from_micros(rng.below(node_timeout.as_micros() as u64 * 3));
    let kinds = [
        [
            KeyKind::Plain,
            KeyKind::Fenced,
            KeyKind::Permits(1),
            KeyKind::Permits(2),
            KeyKind::Rw {
                writers_first: true,
            },
            KeyKind::Rw {
                writers_first: false,
            },
        ][rng.below(6) as usize],
        KeyKind::Fenced,
    ];
    let specs = [0, 1].map(|key| Spec::new(kinds[key], key, timing));
    let mut w = World {
        origin: Instant::now(),
        now: Duration::ZERO,
        timing,
        net,
        server,
        old: None,
        generation: 0,
        clients: HashMap::new(),
        last_in: HashMap::new(),
        last_out: HashMap::new(),
        lag,
        streamed: 0,
        kinds,
        specs,
        ended: [true, true],
        went_back: false,
        cleaned: HashSet::new(),
        conn_gen: HashMap::new(),
        queue: Queue::new(),
        procs: Vec::new(),
        users: Vec::new(),
        pending: HashMap::new(),
        next_id: 0,
        next_conn: 0,
        ttls,
        hearing: Arc::default(),
        stats: Stats::default(),
        steps_left: 40 + rng.below(40) as u32,
        delivered: HashMap::new(),
        deleted_at: [None; 2],
        calm: false,
        trace: std::env::var_os("RESPIRE_SIM_TRACE").is_some(),
        stepped: None,
        rng,
        inject: 0.0,
        inject_rng: Rng::new(seed ^ 0x1e77_0e55),
        healed: None,
        wanted: [None; 2],
    };
    // When the last fault is due (each push below keeps it).
    let mut last_fault = Duration::ZERO;
    let mut faults = false;
    w.server.set_rate(rate);
    if w.rng.chance(0.5) {
        // A server before Redis 7.0: a plain lock's attempts fall back to
        // `SET NX PX` and a `GET` after the first refusal.
        w.server.refuse_nx_with_get();
    }
    let start = w.rng.below(3) * 99_999_999_999_998;
    if start > 0 {
        w.server.put(
            FENCE,
            Some(Entry {
                value: Value::Str(start.to_string().into_bytes()),
                expire_at: None,
            }),
        );
    }
    // With `faulty`, a failover or a clock step at least, often both.
    let (promote, step) = if faulty {
        match w.rng.below(3) {
            0 => (true, false),
            1 => (false, true),
            _ => (true, true),
        }
    } else {
        (w.rng.chance(0.3), false)
    };
    // Faults come within the first seconds; in a faulty schedule, while
    // its users are still busy (a few of the shortest TTLs).
    let within = match faulty {
        true => 1_000 + w.ttls[0].as_micros() as u64 * 6,
        false => 3_000_000,
    };
    if faulty {
        // Messages that are overtaken: an extension in flight across a
        // switch's steps, or across a clock jump.
        w.net.p_slow = w.net.p_slow.max(0.04);
    }
    if promote {
        w.server.add_replica();
        let at = w.rng.micros(1_000, within);
        w.queue.push(at, Ev::Promote);
        last_fault = last_fault.max(at);
        faults = true;
    }
    if step {
        // By less than most leases have left, or by more than any has.
        let ttl = w.ttls[w.rng.below(w.ttls.len() as u64) as usize];
        let by = ttl.mul_f64([0.3, 0.6, 1.5][w.rng.below(3) as usize]);
        let at = w.rng.micros(1_000, within);
        w.queue
            .push(at, Ev::ClockStep(by.as_millis().max(1) as i64));
        last_fault = last_fault.max(at);
        faults = true;
    }
    for _ in 0..2 {
        let conn = w.conn_at(0);
        w.procs.push(Proc {
            fences: FenceBook::new(node_timeout * 4, 100),
            accepted: Vec::new(),
            sched: Schedule::default(),
            wake: None,
            generation: 0,
            ids: w.rng.below(6) != 0,
            exec: Exec::new(0, conn, timing),
            old: None,
            live_from: 0,
            switching: false,
            seen_step: false,
        });
    }
    for (i, &(proc, key)) in USERS.iter().enumerate() {
        let conn = w.conn_at(0);
        w.users.push(User {
            proc,
            key,
            conn,
            busy: false,
            guard: None,
            acquiring: None,
            owners: 0,
            claim_wait: None,
        });
        let at = w.rng.micros(0, 2_000);
        w.queue.push(at, Ev::UserNext(i));
    }
    if w.rng.chance(0.1) {
        let at = w.rng.micros(1_000, 3_000_000);
        w.queue.push(at, Ev::CounterBack);
        last_fault = last_fault.max(at);
        faults = true;
    }
    if w.rng.chance(0.2) {
        let at = w.rng.micros(1_000, 3_000_000);
        let key = w.rng.below(2) as usize;
        w.queue.push(at, Ev::Delete(key));
        last_fault = last_fault.max(at);
        faults = true;
    }
    if inject {
        // From a few error replies in a schedule to one command in six,
        // until every fault heals.
        w.inject = 0.01 + w.inject_rng.unit() * 0.15;
        faults = true;
        let at = last_fault.max(w.inject_rng.micros(1_000, 3_000_000));
        let heal = at + w.inject_rng.micros(0, 200_000);
        w.queue.push(heal, Ev::Heal);
    }
    w.calm = w.net.is_calm() && !faults;
    while let Some(t) = w.queue.peek_time() {
        // Every event at this instant, then the invariants.
        while w.queue.peek_time() == Some(t) {
            let (at, ev) = w.queue.pop().expect("peeked");
            w.advance(at);
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
        if w.steps_left == 0
            && w.users.iter().all(|u| !u.busy)
            && w.wanted.iter().all(Option::is_none)
            && (!inject || w.healed.is_some())
        {
            break;
        }
        if w.now > Duration::from_secs(600) || w.stats.events > 1_000_000 {
            return Err(format!(
                "the schedule did not end: {:?} simulated, {} events",
                w.now, w.stats.events
            ));
        }
    }
    if let (Some(healed), Some(key)) = (w.healed, w.wanted.iter().position(Option::is_some)) {
        return Err(format!(
            "the schedule ended at {:?} without granting key {key} after the faults healed \
             at {healed:?}",
            w.now
        ));
    }
    Ok(w.stats)
}

impl World {
    fn at(&self) -> Instant {
        instant(self.origin, self.now)
    }

    /// Lets time pass on the servers' clocks up to `at`.
    fn advance(&mut self, at: Duration) {
        let by = at.saturating_sub(self.now);
        self.server.elapse(by);
        if let Some(old) = &mut self.old {
            old.elapse(by);
        }
        self.now = at;
    }

    /// A new connection to the primary of generation `generation`.
    fn conn_at(&mut self, generation: u32) -> ConnId {
        self.next_conn += 1;
        self.conn_gen.insert(self.next_conn, generation);
        let server = if generation == self.generation {
            Some(&mut self.server)
        } else {
            self.old.as_mut()
        };
        if let Some(server) = server {
            let client = server.connect();
            self.clients.insert(self.next_conn, client);
        }
        self.next_conn
    }

    /// A new connection of process `p`, to the primary it knows.
    fn conn_for(&mut self, p: usize) -> ConnId {
        self.conn_at(self.procs[p].generation)
    }

    /// The server a connection leads to.
    fn server_of(&mut self, conn: ConnId) -> Option<&mut ModelServer> {
        if self.conn_gen.get(&conn) == Some(&self.generation) {
            Some(&mut self.server)
        } else {
            self.old.as_mut()
        }
    }

    /// Sends `req` on `conn` for `who`; arranges delivery, reply and timeout.
    fn send(&mut self, who: Who, conn: ConnId, req: Req, purpose: Purpose) {
        let id = self.next_id;
        self.next_id += 1;
        let sent = self.at();
        if self.trace {
            eprintln!("  send {id} by {who:?} on conn {conn}: {req:?}");
        }
        self.hear_sent(&req);
        self.pending.insert(
            id,
            Pending {
                who,
                purpose,
                sent,
                conn,
            },
        );
        let lose = self.net.p_lose_request;
        if let Some(d) = self.net.hop(&mut self.rng, lose) {
            let now = self.now;
            if self.server_of(conn).is_some() {
                let last = self.last_in.get(&conn).copied().unwrap_or_default();
                let at = (now + d).max(last);
                self.last_in.insert(conn, at);
                self.queue.push(at, Ev::Deliver { id, conn, req });
            }
        }
        let deadline = self.now + self.timing.node_timeout;
        self.queue.push(deadline, Ev::Timeout { id });
    }

    /// Runs `req` on the server `conn` leads to, as the shipped code sends
    /// it; `None` if the connection was closed (killed).
    fn deliver(&mut self, conn: ConnId, req: &Req) -> Result<Option<Resp>, String> {
        let generation = self.conn_gen[&conn];
        let Some(&client) = self.clients.get(&conn) else {
            return Ok(None);
        };
        let kinds = self.kinds;
        let target = match req {
            Req::Kill { target } => (self.conn_gen.get(target) == Some(&generation))
                .then(|| self.clients.get(target).copied())
                .flatten(),
            _ => None,
        };
        let server = if generation == self.generation {
            &mut self.server
        } else {
            match self.old.as_mut() {
                Some(old) => old,
                None => return Ok(None),
            }
        };
        if !server.is_connected(client) {
            return Ok(None);
        }
        let int = |r: Reply| r.as_int().ok_or_else(|| format!("not an integer: {r:?}"));
        let resp = match req {
            Req::Acquire {
                key,
                owner,
                ttl_ms,
                waiting,
                set_get,
            } => {
                let kind = kinds[*key];
                let reads = matches!(kind, KeyKind::Rw { .. }) && owner.ends_with('r');
                // The oracle: whether the owner holds the lease, from the data.
                let holds = |server: &ModelServer| match kind {
                    KeyKind::Permits(_) => {
                        field_at(server, sem_keys(*key)[1], &format!("holder:{owner}")).is_some()
                    }
                    KeyKind::Rw { .. } if reads => members(server, rw_keys(*key)[1])
                        .iter()
                        .any(|(m, _)| m == owner),
                    _ => string_at(server, key_name(*key))
                        .is_some_and(|v| v == *owner || v.starts_with(&format!("{owner}:"))),
                };
                let mine = holds(server);
                let mut reply = Vec::new();
                let cmds = self.specs[*key].request(owner, *ttl_ms, *waiting, *set_get);
                if let Some(first) = cmds.first() {
                    let rng = &mut self.inject_rng;
                    inject_before(server, rng, self.inject, first, &mut self.stats);
                }
                for cmd in cmds {
                    reply.push(run_on(server, client, &cmd).ok_or("closed")?.into_value());
                }
                let holds = holds(server);
                if holds && !mine {
                    if self.cleaned.contains(&(generation, owner.clone())) {
                        return Err(format!(
                            "an attempt of {owner} granted after its clean-up ran: the \
                             clean-up was overtaken"
                        ));
                    }
                    if !std::mem::replace(&mut self.ended[*key], false) {
                        self.stats.takeovers += 1;
                    }
                }
                Resp::Attempt {
                    reply,
                    existed: mine,
                    holds,
                    set_get: *set_get,
                }
            }
            Req::Extend { items, time } => {
                let clock = match time {
                    true => match server.command_from(client, &["TIME"]) {
                        Some(Reply::Array(parts)) => parts
                            .into_iter()
                            .map(|p| match p {
                                Reply::Bulk(b) => Ok(String::from_utf8_lossy(&b).into_owned()),
                                other => Err(format!("TIME answered {other:?}")),
                            })
                            .collect::<Result<Vec<_>, _>>()
                            .map(Some)?,
                        other => return Err(format!("TIME answered {other:?}")),
                    },
                    false => None,
                };
                let mut out = Vec::with_capacity(items.len());
                for (key, value, ttl_ms) in items {
                    let cmd = ops(kinds[*key], *key, value).extend_cmd(*ttl_ms);
                    let rng = &mut self.inject_rng;
                    inject_before(server, rng, self.inject, &cmd, &mut self.stats);
                    out.push(match run_on(server, client, &cmd).ok_or("closed")? {
                        // An error reply: the script did not run.
                        Reply::Error(_) => None,
                        other => Some(int(other)?),
                    });
                }
                match clock {
                    Some(time) => Resp::Renewed {
                        time,
                        read_at: self.now,
                        ints: out,
                    },
                    None => Resp::Extended(out),
                }
            }
            Req::Verify { key, value } => {
                match run_on(
                    server,
                    client,
                    &ops(kinds[*key], *key, value).verify_cmd(false),
                ) {
                    Some(Reply::Array(a)) => {
                        Resp::Ints(a.into_iter().map(int).collect::<Result<_, _>>()?)
                    }
                    other => return Err(format!("verify reply {other:?}")),
                }
            }
            Req::Release { key, value } => {
                let ops = ops(kinds[*key], *key, value);
                let cmd = ops
                    .release_script()
                    .evalsha(&ops.key_refs(), ops.release_arg_refs().as_slice());
                // What the release must report, from the server's data.
                let expected = match ops.shape {
                    Shape::Member { .. } => {
                        if members(server, &ops.keys[0])
                            .iter()
                            .any(|(m, _)| m == value)
                        {
                            ReleaseOutcome::Released
                        } else {
                            ReleaseOutcome::Expired
                        }
                    }
                    Shape::StringValue => match server.entry(&ops.keys[0]) {
                        None => ReleaseOutcome::Expired,
                        Some(_) if string_at(server, &ops.keys[0]).as_ref() == Some(value) => {
                            ReleaseOutcome::Released
                        }
                        Some(_) => ReleaseOutcome::TakenOver,
                    },
                };
                let had = server.exists(key_name(*key));
                let rng = &mut self.inject_rng;
                inject_before(server, rng, self.inject, &cmd, &mut self.stats);
                let code = match run_on(server, client, &cmd).ok_or("closed")? {
                    Reply::Error(e) => {
                        if had != server.exists(key_name(*key)) {
                            return Err(format!("a release answered {e:?} changed the lease"));
                        }
                        return Ok(Some(Resp::Refused));
                    }
                    other => int(other)?,
                };
                if had && !server.exists(key_name(*key)) {
                    self.ended[*key] = true;
                }
                Resp::Released { code, expected }
            }
            Req::ReleasePrefix { key, owner } => {
                let owner_token = OwnerToken::from_raw(owner.clone());
                let cmd = self.specs[*key].clean_up(&owner_token);
                let had = server.exists(key_name(*key));
                run_on(server, client, &cmd);
                if had && !server.exists(key_name(*key)) {
                    self.ended[*key] = true;
                }
                self.cleaned.insert((generation, owner.clone()));
                Resp::Done
            }
            Req::Kill { .. } => {
                if let Some(target) = target {
                    server.kill_client(target);
                }
                Resp::Done
            }
        };
        Ok(Some(resp))
    }

    fn handle(&mut self, ev: Ev) -> Result<(), String> {
        match ev {
            Ev::Deliver { id, conn, req } => {
                let now = self.now;
                let hop = self.net.hop(&mut self.rng, self.net.p_lose_reply);
                let current = self.conn_gen.get(&conn) == Some(&self.generation);
                let drawn = self.server_of(conn).map(|s| counters(s));
                let Some(resp) = self.deliver(conn, &req)? else {
                    return Ok(());
                };
                let drew = self.server_of(conn).map(|s| counters(s)) != drawn;
                if let Some(d) = hop {
                    let last = self.last_out.get(&conn).copied().unwrap_or_default();
                    let at = (now + d).max(last);
                    self.last_out.insert(conn, at);
                    self.queue.push(at, Ev::Reply { id, resp });
                }
                // A token drawn on a replaced primary is lost with it: its
                // successor's counter is behind what clients saw.
                if drew && !current {
                    self.went_back = true;
                }
                // What the command wrote reaches the replica after the lag.
                let stream = self.server.replication_lag();
                if current && stream > self.streamed {
                    let n = stream - self.streamed;
                    self.streamed = stream;
                    let generation = self.generation;
                    self.queue
                        .push(now + self.lag, Ev::Replicate { generation, n });
                }
            }
            Ev::Replicate { generation, n } => {
                if generation == self.generation {
                    self.server.replicate(n);
                    self.streamed = self.streamed.saturating_sub(n);
                }
            }
            Ev::Reply { id, resp } => {
                // A reply after the client gave up is read by nobody.
                if let Some(p) = self.pending.remove(&id) {
                    let proc = match p.who {
                        Who::User(u) => self.users[u].proc,
                        Who::Exec(proc, _) => proc,
                    };
                    let current = !self.retired_for(proc, p.conn);
                    // An extension answered by a primary the process retired
                    // meanwhile: the shipped transport runs the call once
                    // more, and the guard's second run sends nothing and hands
                    // the answer to its machine as from a replaced server.
                    if !current
                        && let (Who::User(u), Purpose::Reset { ticket, reset }, Resp::Extended(_)) =
                            (p.who, &p.purpose, &resp)
                        && let Some(g) = &self.users[u].guard
                    {
                        let cell = g.cell.clone();
                        self.users[u].busy = false;
                        self.stats.reset_reruns += 1;
                        let (ticket, mut reset) = (*ticket, *reset);
                        let step = reset.replaced(&cell, ticket, self.at());
                        self.touch(proc, &cell);
                        return self.reset_step(u, reset, step);
                    }
                    // Any other call from a primary the process retired
                    // counts as unanswered: its pool was closed then. (The
                    // executors judge their own replies.)
                    let resp = match p.who {
                        Who::User(_) => current.then_some(resp),
                        Who::Exec(..) => Some(resp),
                    };
                    self.replied(p, resp)?;
                }
            }
            Ev::Promote => {
                {
                    self.stats.failovers += 1;
                    let old = self.server.promote();
                    let (now, before) = (counters(&self.server), counters(&old));
                    if now.iter().zip(before).any(|(n, b)| *n < b) {
                        self.went_back = true;
                    }
                    self.old = Some(old);
                    self.streamed = 0;
                    self.generation += 1;
                    // Every lease is exposed until its process has verified
                    // it on the new primary: what the old one confirmed may
                    // never have reached the new one.
                    for u in &mut self.users {
                        if let Some(g) = &mut u.guard {
                            g.exposed = true;
                        }
                    }
                    // Each process learns of it later, and goes through the
                    // steps of a switch at instants of their own, with room
                    // for renewals and extensions between them.
                    // The runtime takes them one after another on one thread:
                    // often within a round trip, sometimes far apart.
                    let nt = self.timing.node_timeout.as_micros() as u64;
                    let rtt = self.net.delay.1 * 2;
                    for p in 0..self.procs.len() {
                        let publish = self.now + self.rng.micros(1_000, 300_000);
                        let mut gap = || match self.rng.below(3) {
                            0 => Duration::ZERO,
                            1 => self.rng.micros(0, rtt),
                            _ => self.rng.micros(0, nt * 2),
                        };
                        let retire = publish + gap();
                        let switched = retire + gap();
                        self.queue.push(publish, Ev::Publish(p));
                        self.queue.push(retire, Ev::Retire(p));
                        self.queue.push(switched, Ev::Switched(p));
                    }
                }
            }
            Ev::Publish(p) => self.publish(p),
            Ev::Retire(p) => self.retire(p),
            Ev::Switched(p) => self.switched(p),
            Ev::ResetSend { u, ticket, reset } => self.reset_send(u, ticket, reset)?,
            Ev::ClockStep(ms) => {
                self.stats.clock_steps += 1;
                self.server.step_clock(ms);
                self.stepped = Some((self.now, self.generation));
                for p in &mut self.procs {
                    p.seen_step = false;
                }
                for u in &mut self.users {
                    if let Some(g) = &mut u.guard {
                        g.stepped = true;
                    }
                }
            }
            Ev::Heal => {
                self.net.p_slow = 0.0;
                self.net.p_lose_request = 0.0;
                self.net.p_lose_reply = 0.0;
                self.inject = 0.0;
                self.healed = Some(self.now);
                self.wanted = [Some(self.now); 2];
                // Users that had stopped ask again.
                for u in 0..self.users.len() {
                    self.queue.push(self.now, Ev::UserNext(u));
                }
            }
            Ev::Delete(key) => {
                self.server.put(key_name(key), None);
                // Of a semaphore, the permits go; the meta hash with its
                // counter stays (a deleted counter is a fault of its own).
                if let KeyKind::Permits(_) = self.kinds[key] {
                    self.server.put(sem_keys(key)[2], None);
                }
                self.ended[key] = true;
                let now = self.at();
                self.deleted_at[key] = Some(now);
                // Its holder cannot know until the server tells it.
                for u in &mut self.users {
                    if let Some(g) = &mut u.guard
                        && g.key == key
                    {
                        g.deleted = Some(now);
                    }
                }
            }
            Ev::Timeout { id } => {
                if let Some(p) = self.pending.remove(&id) {
                    self.stats.unanswered += 1;
                    self.replied(p, None)?;
                }
            }
            Ev::UserNext(u) => self.user_step(u)?,
            Ev::SchedWake(p) => {
                // An earlier wake-up that was overtaken leaves the armed one alone.
                if self.procs[p].wake == Some(self.now) {
                    self.procs[p].wake = None;
                }
                let now = self.at();
                let batch = self.procs[p].sched.due(now);

                if !batch.is_empty() {
                    self.procs[p].exec.queue.push_back(Job::Renew(batch));
                }
                self.exec_kick(p);
                self.arm(p);
            }
            Ev::ExecNext(p) => {
                self.exec_kick(p);
                self.arm(p);
            }
            Ev::CounterBack => {
                let back = counters(&self.server)[0].saturating_sub(1 + self.rng.below(5));
                self.server.put(
                    FENCE,
                    Some(Entry {
                        value: Value::Str(back.to_string().into_bytes()),
                        expire_at: None,
                    }),
                );
                self.went_back = true;
            }
        }
        Ok(())
    }

    /// Whether process `p` retired the server `conn` leads to.
    fn retired_for(&self, p: usize, conn: ConnId) -> bool {
        self.conn_gen
            .get(&conn)
            .is_none_or(|g| *g < self.procs[p].live_from)
    }

    /// Process `p`'s executor of the primary of `generation`, if it has one.
    fn exec_of(&mut self, p: usize, generation: u32) -> Option<&mut Exec> {
        self.procs[p].exec_of(generation)
    }

    /// The first step of a switch, as the runtime takes it: process `p`
    /// publishes the new primary. New sends (renewals, the holders' calls)
    /// go there, to a new executor; the old server's executor goes on with
    /// what it was given until it is retired.
    fn publish(&mut self, p: usize) {
        let generation = self.generation;
        if self.procs[p].generation == generation {
            return;
        }
        self.procs[p].generation = generation;
        self.procs[p].switching = true;
        let conn = self.conn_at(generation);
        let new = Exec::new(generation, conn, self.timing);
        let old = std::mem::replace(&mut self.procs[p].exec, new);
        self.procs[p].old = Some(old);
        for u in 0..self.users.len() {
            if self.users[u].proc == p {
                self.users[u].conn = self.conn_for(p);
            }
        }
        self.exec_kick(p);
        self.arm(p);
    }

    /// The second step: the old server is retired. What it says no longer
    /// counts; once its executor has no request out, the shipped machine
    /// frees the claims it held for kills (their worst case kept) and its
    /// clean-ups and verifications go to the new primary's executor.
    fn retire(&mut self, p: usize) {
        let proc = &mut self.procs[p];
        let Some(old) = &mut proc.old else {
            return;
        };
        old.retired = true;
        proc.live_from = old.server + 1;
        if !old.busy {
            self.finish_retire(p);
        }
    }

    /// The retired executor's machine lets go, as the runtime's does after
    /// its last request: what is queued there is planned again, handed over
    /// or (a fence) freed with its worst case kept.
    fn finish_retire(&mut self, p: usize) {
        let Some(mut old) = self.procs[p].old.take() else {
            return;
        };
        let now = self.at();
        let (freed, cleanups) = old.machine.retire(now);
        for lease in freed {
            self.touch(p, &lease);
        }
        for c in cleanups {
            self.procs[p]
                .exec
                .machine
                .clean_up(Vec::new(), c.payload, c.give_up_at, now);
        }
        for job in old.queue.drain(..) {
            match job {
                Job::Renew(batch) => {
                    for (lease, ticket, _) in batch {
                        lease.not_sent(ticket, now);
                        let again = now + Duration::from_millis(2);
                        self.procs[p].sched.completed(lease.id(), now, Some(again));
                    }
                }
                Job::Verify(cell) => self.procs[p].exec.queue.push_back(Job::Verify(cell)),
                Job::Fence(_, lease, ticket) => {
                    lease.fenced(ticket, now);
                    self.touch(p, &lease);
                }
                Job::Cleanup(_, key, Some(owner), give_up) => self.procs[p]
                    .exec
                    .queue
                    .push_back(Job::Cleanup(Vec::new(), key, Some(owner), give_up)),
                Job::Cleanup(_, _, None, _) => {}
            }
        }
        self.exec_kick(p);
        self.arm(p);
    }

    /// The last step: every live lease of process `p` is told the key's
    /// server now (a claim whose command went to another is given up) and
    /// is verified on the new primary.
    fn switched(&mut self, p: usize) {
        let now = self.at();
        self.procs[p].switching = false;
        let current = server_id(self.procs[p].generation);
        for u in 0..self.users.len() {
            if self.users[u].proc != p {
                continue;
            }
            if let Some(g) = &self.users[u].guard {
                let cell = g.cell.clone();
                cell.switched(now, Some(current));
                self.touch(p, &cell);
                self.procs[p].exec.queue.push_back(Job::Verify(cell));
            }
        }
        self.exec_kick(p);
        self.arm(p);
    }

    /// Keeps one wake-up pending at the schedule's next due time.
    fn arm(&mut self, p: usize) {
        if let Some(at) = self.procs[p].sched.next_due() {
            let at = at.saturating_duration_since(self.origin).max(self.now);
            if self.procs[p].wake.is_none_or(|w| at < w) {
                self.procs[p].wake = Some(at);
                self.queue.push(at, Ev::SchedWake(p));
            }
        }
    }

    fn touch(&mut self, p: usize, cell: &Arc<Cell>) {
        if cell.is_watched() {
            let now = self.at();
            self.procs[p].sched.touch(cell.id(), now);
            self.arm(p);
        }
    }

    /// A reply about `cell`'s lease came to a command sent at `sent`: a
    /// deletion before that send is known now.
    fn learned(&mut self, cell: &Arc<Cell>, sent: Instant) {
        for u in &mut self.users {
            if let Some(g) = &mut u.guard
                && Arc::ptr_eq(&g.cell, cell)
                && g.deleted.is_some_and(|d| d <= sent)
            {
                g.deleted = None;
            }
        }
    }

    fn watch(&mut self, p: usize, cell: &Arc<Cell>) {
        if cell.watch() {
            let now = self.at();
            self.procs[p].sched.watch(cell.clone(), now);
        }
        self.arm(p);
    }

    fn think(&mut self, u: usize) {
        let ttl = self.ttls[0];
        let pause = self.rng.micros(0, (ttl.as_micros() as u64) * 2 / 3);
        self.queue.push(self.now + pause, Ev::UserNext(u));
    }

    fn user_step(&mut self, u: usize) -> Result<(), String> {
        if self.users[u].busy {
            return Ok(());
        }
        let now = self.at();
        let p = self.users[u].proc;
        // A reset_expiry waiting for a claim in flight.
        if let Some(mut reset) = self.users[u].claim_wait.take() {
            let step = match &self.users[u].guard {
                Some(g) => reset.claim(&g.cell, now),
                None => return Ok(()),
            };
            return self.reset_step(u, reset, step);
        }
        // After the heal, until its key is granted again.
        let wants = self.wanted[self.users[u].key].is_some();
        if let Some(g) = &self.users[u].guard {
            if g.cell.is_lost(now) {
                self.stats.losses += 1;
                return self.release(u);
            }
            if wants {
                // Held since before the heal: let go, to ask again.
                return self.release(u);
            }
        } else {
            if self.steps_left == 0 && !wants {
                return Ok(());
            }
            self.steps_left = self.steps_left.saturating_sub(1);
            let a = self.users[u].acquiring.get_or_insert_with(|| Acquiring {
                owner: String::new(),
                ttl: Duration::ZERO,
                attempts: Attempts::default(),
                lost: Vec::new(),
                tries: 0,
                waiting: false,
            });
            if a.owner.is_empty() {
                let n = self.users[u].owners;
                self.users[u].owners += 1;
                let ttl = self.ttls[self.rng.below(self.ttls.len() as u64) as usize];
                // Of a reader/writer lease, a reader or a writer.
                let mode = match self.kinds[self.users[u].key] {
                    KeyKind::Rw { .. } if self.rng.chance(0.5) => "r",
                    KeyKind::Rw { .. } => "w",
                    _ => "",
                };
                let a = self.users[u].acquiring.as_mut().expect("set");
                a.owner = format!("u{u}o{n:04}{mode}");
                a.ttl = ttl;
                a.tries = 1 + self.rng.below(4) as u32;
            }
            self.send_attempt(u);
            return Ok(());
        }
        if self.steps_left > 0 {
            self.steps_left -= 1;
        } else {
            return self.release(u);
        }
        let op = self.rng.below(10);
        let (cell, key, value, ttl) = {
            let g = self.users[u].guard.as_ref().expect("holding");
            (g.cell.clone(), g.key, g.value.clone(), g.cell.ttl())
        };
        match op {
            0..=2 => {
                // reset_expiry, longer or shorter.
                let ttl = self.ttls[self.rng.below(self.ttls.len() as u64) as usize];
                if ttl < self.timing.min_keepalive_ttl() {
                    // Too short for keep-alive to save: the holder's choice.
                    self.users[u].guard.as_mut().expect("holding").renewable = false;
                }
                let mut reset = ResetExpiry::new(now, ttl, self.timing.node_timeout);
                let step = reset.claim(&cell, now);
                return self.reset_step(u, reset, step);
            }
            3 => {
                let g = self.users[u].guard.as_mut().expect("holding");
                if !g.keepalive && ttl >= self.timing.min_keepalive_ttl() {
                    g.keepalive = true;
                    // Renewed in time from here on, if the network is kind:
                    // a node timeout for the renewal and one to spare.
                    g.renewable = cell.remaining(now)
                        > self.timing.node_timeout * 2 + Duration::from_millis(5);
                    cell.add_keepalive();
                    self.watch(p, &cell);
                    self.touch(p, &cell);
                }
            }
            4 => {
                let g = self.users[u].guard.as_mut().expect("holding");
                if g.keepalive {
                    g.keepalive = false;
                    cell.remove_keepalive();
                    self.touch(p, &cell);
                }
            }
            5 => {
                self.users[u].busy = true;
                let conn = self.users[u].conn;
                self.send(
                    Who::User(u),
                    conn,
                    Req::Verify { key, value },
                    Purpose::Verify,
                );
                return Ok(());
            }
            6 => {
                let _ = cell.signal(now);
                self.users[u].guard.as_mut().expect("holding").signal = true;
                self.watch(p, &cell);
            }
            7 => return self.release(u),
            _ => {}
        }
        self.think(u);
        Ok(())
    }

    /// Sends user `u`'s next acquire attempt.
    fn send_attempt(&mut self, u: usize) {
        let key = self.users[u].key;
        let a = self.users[u].acquiring.as_ref().expect("acquiring");
        let req = Req::Acquire {
            key,
            owner: a.owner.clone(),
            ttl_ms: a.ttl.as_millis() as u64,
            waiting: a.waiting,
            set_get: match &self.specs[key] {
                Spec::Plain(spec) => spec.set_get(),
                _ => true,
            },
        };
        self.users[u].busy = true;
        let conn = self.users[u].conn;
        self.send(Who::User(u), conn, req, Purpose::Acquire);
    }

    /// The guard's reset_expiry, driven by its machine: a send, a wait for
    /// an extension in flight (looked at every millisecond), or the end.
    fn reset_step(&mut self, u: usize, reset: ResetExpiry, step: ResetStep) -> Result<(), String> {
        let p = self.users[u].proc;
        let Some(g) = &self.users[u].guard else {
            return Ok(());
        };
        let cell = g.cell.clone();
        match step {
            ResetStep::Done(_) => self.think(u),
            ResetStep::Wait(_) => {
                self.users[u].claim_wait = Some(reset);
                self.queue
                    .push(self.now + Duration::from_millis(1), Ev::UserNext(u));
            }
            ResetStep::Send(ticket) => {
                self.touch(p, &cell);
                self.users[u].busy = true;
                // Sent at once, or after a pause (a connection made, the
                // thread descheduled) in which the deployment may switch.
                if self.rng.chance(0.2) {
                    let pause = self.rng.micros(0, self.net.delay.1 * 4);
                    self.queue
                        .push(self.now + pause, Ev::ResetSend { u, ticket, reset });
                    return Ok(());
                }
                return self.reset_send(u, ticket, reset);
            }
        }
        Ok(())
    }

    /// Sends the extension user `u` claimed with `ticket` to the primary its
    /// process knows now, unless the claim was given up meanwhile: then,
    /// as the guard does, it counts as answered by a replaced server.
    fn reset_send(
        &mut self,
        u: usize,
        ticket: Ticket,
        mut reset: ResetExpiry,
    ) -> Result<(), String> {
        let p = self.users[u].proc;
        let Some(g) = &self.users[u].guard else {
            self.users[u].busy = false;
            self.think(u);
            return Ok(());
        };
        let (cell, key, value) = (g.cell.clone(), g.key, g.value.clone());
        let conn = self.users[u].conn;
        let generation = self.conn_gen[&conn];
        if !cell.dispatched(ticket, server_id(generation)) {
            self.users[u].busy = false;
            self.stats.undispatched += 1;
            let step = reset.replaced(&cell, ticket, self.at());
            self.touch(p, &cell);
            return self.reset_step(u, reset, step);
        }
        self.stats.extensions += 1;
        let items = vec![(key, value, reset.ttl().as_millis() as u64)];
        self.send(
            Who::User(u),
            conn,
            Req::Extend { items, time: false },
            Purpose::Reset { ticket, reset },
        );
        Ok(())
    }

    fn release(&mut self, u: usize) -> Result<(), String> {
        let now = self.at();
        let p = self.users[u].proc;
        let Some(g) = self.users[u].guard.take() else {
            return Ok(());
        };
        g.cell.finish(now);
        self.procs[p].sched.forget(g.cell.id());
        self.users[u].busy = true;
        let conn = self.users[u].conn;
        let req = Req::Release {
            key: g.key,
            value: g.value,
        };
        self.send(Who::User(u), conn, req, Purpose::Release);
        Ok(())
    }

    fn replied(&mut self, p: Pending, resp: Option<Resp>) -> Result<(), String> {
        let now = self.at();
        match p.who {
            Who::User(u) => {
                self.users[u].busy = false;
                let proc = self.users[u].proc;
                if resp.is_none() {
                    // The pooled connection is broken; the next call opens another.
                    self.users[u].conn = self.conn_for(proc);
                }
                match p.purpose {
                    Purpose::Acquire => self.acquired(u, p, resp)?,
                    Purpose::Reset { ticket, mut reset } => {
                        let cell = self.users[u].guard.as_ref().map(|g| g.cell.clone());
                        if let Some(cell) = cell {
                            match resp {
                                // The connection's error for an error reply:
                                // not uncertain, so the claim is given back
                                // as not sent.
                                Some(Resp::Extended(v)) if v[0].is_none() => {
                                    // The checker peeks at `is_lost()`: once
                                    // it saw the claim's worst case past, a
                                    // user's call then would have recorded
                                    // the loss, which giving the claim back
                                    // does not undo. That call is made now,
                                    // while the claim is still held.
                                    if self.users[u].guard.as_ref().is_some_and(|g| g.seen_lost) {
                                        cell.is_lost(now);
                                    }
                                    cell.not_sent(ticket, now);
                                }
                                Some(Resp::Extended(v)) => {
                                    let code = v[0].expect("matched above");
                                    let step =
                                        reset.replied(&cell, ticket, ExtendReply::of(code), now);
                                    if step == ResetStep::Done(ResetDone::Held) {
                                        self.extended_after_step(&cell, p.sent);
                                    }
                                    self.learned(&cell, p.sent);
                                    if !matches!(step, ResetStep::Done(_)) {
                                        // Confirmed by a switched-away server:
                                        // sent again to the new one.
                                        self.stats.reset_reruns += 1;
                                        self.touch(proc, &cell);
                                        return self.reset_step(u, reset, step);
                                    }
                                }
                                None => {
                                    cell.unanswered(ticket, now);
                                    let conn = self.procs[proc].ids.then_some(p.conn);
                                    // Fenced by the executor of the server it
                                    // went to; once that one is retired, the
                                    // claim is freed with its worst case kept.
                                    let generation = self.conn_gen[&p.conn];
                                    let live_from = self.procs[proc].live_from;
                                    match self.exec_of(proc, generation) {
                                        Some(exec) if !exec.retired => exec
                                            .queue
                                            .push_back(Job::Fence(conn, cell.clone(), ticket)),
                                        Some(_) => cell.fenced(ticket, now),
                                        None if generation < live_from => cell.fenced(ticket, now),
                                        None => self.procs[proc].exec.queue.push_back(Job::Fence(
                                            conn,
                                            cell.clone(),
                                            ticket,
                                        )),
                                    }
                                    self.exec_kick(proc);
                                }
                                other => return Err(format!("reset reply {other:?}")),
                            }
                            self.touch(proc, &cell);
                        }
                        self.think(u);
                    }
                    Purpose::Verify => {
                        if let (Some(g), Some(Resp::Ints(v))) = (&self.users[u].guard, resp) {
                            let verdict = Verdict::of(&v).ok_or("verify reply")?;
                            let cell = g.cell.clone();
                            cell.verified(verdict, p.sent, now);
                            self.touch(proc, &cell);
                            self.learned(&cell, p.sent);
                        }
                        self.think(u);
                    }
                    Purpose::Release => {
                        // The shipped reading of the reply, against the data.
                        if let Some(Resp::Released { code, expected }) = resp
                            && ReleaseOutcome::of(code) != expected
                        {
                            return Err(format!(
                                "user {u}: a release answered {code} ({:?}) where the server \
                                 held what calls for {expected:?}",
                                ReleaseOutcome::of(code)
                            ));
                        }
                        self.think(u)
                    }
                    _ => return Err("user purpose".into()),
                }
            }
            Who::Exec(proc, generation) => self.exec_replied(proc, generation, p, resp)?,
        }
        Ok(())
    }

    fn acquired(&mut self, u: usize, p: Pending, resp: Option<Resp>) -> Result<(), String> {
        let now = self.at();
        let proc = self.users[u].proc;
        let key = self.users[u].key;
        // The shipped reader's verdict on the replies, against the data.
        let read = match resp {
            Some(Resp::Attempt {
                reply,
                existed,
                holds,
                set_get,
            }) => {
                let a = self.users[u].acquiring.as_ref().expect("acquiring");
                let since = a.attempts.since();
                let ttl_ms = a.ttl.as_millis() as u64;
                // An error reply the shipped classification calls retryable
                // (a redirection, a server loading, read-only or busy): the
                // connection hands the attempt the server's error and the
                // wait rides it out. The attempt was answered and ran
                // nothing: no clean-up is owed. Any other error reply is the
                // shipped reader's to read.
                let refused = reply.iter().find_map(|v| match v {
                    redis::Value::ServerError(e) => Some(crate::error::Error::Server {
                        op: "acquire",
                        source: redis::RedisError::from(e.clone()),
                    }),
                    _ => None,
                });
                let refused = refused.filter(crate::error::Error::is_retryable);
                if let Some(err) = &refused
                    && holds != existed
                {
                    return Err(format!(
                        "user {u}: an attempt answered {err} changed the lease"
                    ));
                }
                let refused = refused.is_some();
                let read = if refused {
                    Some(Attempt::Busy(None))
                } else {
                    self.specs[key]
                        .read(&reply, &a.owner, ttl_ms, a.waiting, set_get, p.sent, since)?
                };
                let Some(read) = read else {
                    // Refused before it ran (a server before Redis 7.0): the
                    // shipped attempt sends the older form at once.
                    if holds != existed {
                        return Err(format!(
                            "user {u}: a refused SET with NX and GET changed the lease"
                        ));
                    }
                    self.stats.older_set += 1;
                    self.send_attempt(u);
                    return Ok(());
                };
                // A grant counts from its send, or (a plain lock's, found
                // already the owner's) from the first unanswered attempt's;
                // the scripts move a repeated grant's expiry to a TTL from
                // now.
                let from = if existed && self.kinds[key] == KeyKind::Plain {
                    dated(since, p.sent)
                } else {
                    p.sent
                };
                match read {
                    Attempt::Acquired((_, _, sent)) if holds && sent == from => {
                        self.stats.repeated += u64::from(existed);
                    }
                    Attempt::Busy(_) if !holds => {}
                    // Ran nothing (checked above).
                    Attempt::Busy(_) if refused => {}
                    _ => {
                        return Err(format!(
                            "user {u}: the reply {reply:?} was read as {:?}, where the server's \
                             data shows the owner {}holding the lease (from {:?})",
                            match &read {
                                Attempt::Acquired((t, v, at)) => format!(
                                    "granted {v} (token {t}) from {:?}",
                                    at.duration_since(self.origin)
                                ),
                                Attempt::Busy(hint) => format!("held (hint {hint:?})"),
                            },
                            if holds { "" } else { "not " },
                            from.duration_since(self.origin),
                        ));
                    }
                }
                Some(read)
            }
            None => None,
            Some(other) => return Err(format!("acquire reply {other:?}")),
        };
        match read {
            Some(Attempt::Acquired((token, value, from))) => {
                self.stats.grants += 1;
                if self.healed.is_some() && self.wanted[key].take().is_some() {
                    self.stats.regranted += 1;
                }
                // Granted by a primary that was replaced meanwhile.
                let exposed = self.conn_gen.get(&p.conn) != Some(&self.generation);
                let mut a = self.users[u].acquiring.take().expect("acquiring");
                // Attempts that got no reply are stopped from granting again.
                let attempts = std::mem::take(&mut a.attempts);
                let since = attempts.since();
                self.clean_up_after(proc, key, None, &a.lost, attempts.finish(true), a.ttl)?;
                if token == 0 {
                    // A plain lock or a reader: no token.
                    self.hold(u, key, value, from, a.ttl, exposed);
                    return Ok(());
                }
                // The counter the token came from.
                let (book, counter) = match self.kinds[key] {
                    KeyKind::Permits(_) => ("sem", 1),
                    KeyKind::Rw { .. } => ("write", 2),
                    _ => ("fence", 0),
                };
                // The token may come from the owner's first unanswered attempt.
                let sent = dated(since, from);
                // The fence book, against the definition: a regression is a
                // token not above one whose reply came before this send.
                let expected = self.procs[proc]
                    .accepted
                    .iter()
                    .any(|&(c, t, r)| c == counter && r < sent && t >= token);
                let checked = self.procs[proc].fences.check(book, token, sent, now);
                // The book may miss a regression only for a grant whose first
                // attempt is older than its horizon; it never reports a false one.
                let blind = sent + self.timing.node_timeout * 4 < now;
                if checked.is_err() && !expected || checked.is_ok() && expected && !blind {
                    return Err(format!(
                        "fence book said {checked:?} for token {token} (sent {:?}); a \
                         regression was {}expected",
                        p.sent.duration_since(self.origin),
                        if expected { "" } else { "not " }
                    ));
                }
                if checked.is_err() && !self.went_back {
                    return Err(format!(
                        "false fencing regression for token {token} sent at {:?} received at \
                         {:?} by user {u}; accepted before: {:?}",
                        sent.duration_since(self.origin),
                        self.now,
                        self.procs[proc]
                            .accepted
                            .iter()
                            .filter(|(c, _, _)| *c == counter)
                            .map(|(_, t, r)| (*t, r.duration_since(self.origin)))
                            .collect::<Vec<_>>()
                    ));
                }
                self.procs[proc].accepted.push((counter, token, now));
                if checked.is_err() {
                    self.stats.regressions += 1;
                    // Refused: the grant is released again.
                    self.users[u].busy = true;
                    let conn = self.users[u].conn;
                    self.send(
                        Who::User(u),
                        conn,
                        Req::Release { key, value },
                        Purpose::Release,
                    );
                    return Ok(());
                }
                // A grant from a replaced primary is history its successor
                // never had: its token may come again.
                if !exposed
                    && let Some(before) = self.delivered.insert((counter, token), a.owner.clone())
                    && before != a.owner
                    && !self.went_back
                {
                    return Err(format!(
                        "token {token} reached user {u} ({}) after {before} had it, with the \
                         counter intact",
                        a.owner
                    ));
                }
                self.hold(u, key, value, from, a.ttl, exposed);
            }
            Some(Attempt::Busy(_)) | None => {
                let wants = self.wanted[key].is_some();
                let a = self.users[u].acquiring.as_mut().expect("acquiring");
                // The next attempts are a wait's.
                a.waiting = true;
                if read.is_none() {
                    // As the shipped wait records it: the attempt's send
                    // first, the connection once the call returned.
                    a.attempts.unanswered(p.sent, []);
                    a.attempts.went_out_on([p.conn]);
                    a.lost.push(p.conn);
                }
                a.tries = a.tries.saturating_sub(1);
                if a.tries == 0 {
                    // The wait ends without the lease: clean up after the
                    // attempts that got no reply.
                    let a = self.users[u].acquiring.take().expect("acquiring");
                    let key = self.users[u].key;
                    let left = a.attempts.finish(false);
                    self.clean_up_after(proc, key, Some(a.owner), &a.lost, left, a.ttl)?;
                    self.think(u);
                } else {
                    let mut pause = self.rng.micros(0, 20_000);
                    // After the heal, a wait that was told how long the key
                    // is held sleeps until then, as the shipped wait does.
                    if let (true, Some(Attempt::Busy(Some(left)))) = (wants, &read) {
                        pause = pause.max(*left + Duration::from_millis(1));
                    }
                    self.queue.push(self.now + pause, Ev::UserNext(u));
                }
            }
        }
        Ok(())
    }

    /// Hands what an ended acquire left to its process's executor: kill the
    /// connections of its unanswered attempts, then delete by `owner` what
    /// they may have set (`None`: a later attempt was granted, only kill).
    fn clean_up_after(
        &mut self,
        proc: usize,
        key: usize,
        owner: Option<String>,
        lost: &[ConnId],
        left: Option<CleanUp<ConnId>>,
        ttl: Duration,
    ) -> Result<(), String> {
        let kills = left.as_ref().map_or(&[][..], |c| &c.conns[..]);
        if let Some(missed) = lost.iter().find(|c| !kills.contains(c)) {
            return Err(format!(
                "the attempt on connection {missed} got no reply, but the ended acquire \
                 leaves {left:?} to clean up"
            ));
        }
        if let Some(c) = left {
            debug_assert_eq!(c.delete, owner.is_some());
            let give_up = self.now + ttl + self.timing.node_timeout;
            self.procs[proc]
                .exec
                .queue
                .push_back(Job::Cleanup(c.conns, key, owner, give_up));
            self.exec_kick(proc);
        }
        Ok(())
    }

    /// The user now holds `value` on `key`, granted by a command sent at `sent`.
    fn hold(
        &mut self,
        u: usize,
        key: usize,
        value: String,
        sent: Instant,
        ttl: Duration,
        exposed: bool,
    ) {
        let core = LeaseCore::granted(self.timing, sent, ttl);
        let cell = Arc::new(LeaseCell::new(
            format!("k{key}"),
            Meta {
                key,
                value: value.clone(),
            },
            core,
        ));
        self.hear(&cell, key, &value);
        self.users[u].guard = Some(Guard {
            cell,
            value,
            key,
            keepalive: false,
            signal: false,
            exposed,
            // Deleted after the grant was sent: perhaps after it was applied.
            deleted: self.deleted_at[key].filter(|d| *d >= sent),
            seen_lost: false,
            renewable: false,
            // Granted on the clock before a jump: the jump may be found
            // only by a later reading, or by its next extension. Once its
            // process has read the server before and after the jump, it
            // knows: a grant sent before the jump counts no longer than what
            // the jump left it.
            stepped: self
                .stepped
                .is_some_and(|(at, _)| sent <= instant(self.origin, at))
                && !self.procs[self.users[u].proc].seen_step,
        });
        self.think(u);
    }

    /// Process `p`'s executors: the current one, and the one of the server it
    /// switched away from until that one is retired.
    fn exec_kick(&mut self, p: usize) {
        let current = self.procs[p].exec.server;
        self.kick(p, current);
        if let Some(old) = self.procs[p].old.as_ref().filter(|e| !e.retired) {
            let old = old.server;
            self.kick(p, old);
        }
    }

    /// The executor of `generation`'s primary: one request at a time; what
    /// the machine hands out first (kills, clean-ups), then queued jobs in
    /// order.
    fn kick(&mut self, p: usize, generation: u32) {
        let now = self.at();
        let who = Who::Exec(p, generation);
        loop {
            let Some(exec) = self.procs[p].exec_of(generation) else {
                return;
            };
            if exec.busy {
                return;
            }
            let conn = exec.conn;
            let command = match exec.machine.poll_command(now) {
                None => None,
                Some(Command::Kill(target)) => Some((Req::Kill { target }, Purpose::Kill)),
                Some(Command::CleanUp((key, Some(owner)))) => Some((
                    Req::ReleasePrefix {
                        key: *key,
                        owner: owner.clone(),
                    },
                    Purpose::CleanupRelease,
                )),
                // Only the kills were asked for: done once they are.
                Some(Command::CleanUp((_, None))) => {
                    exec.machine.clean_up_done(true, now);
                    continue;
                }
            };
            if let Some((req, purpose)) = command {
                exec.busy = true;
                self.send(who, conn, req, purpose);
                return;
            }
            let Some(job) = exec.queue.pop_front() else {
                if let Some(at) = exec.machine.poll_timeout() {
                    let at = at.saturating_duration_since(self.origin).max(self.now);
                    self.queue.push(at, Ev::ExecNext(p));
                }
                return;
            };
            match job {
                Job::Verify(cell) => {
                    if cell.is_lost(now) {
                        continue;
                    }
                    let m = cell.extra();
                    let req = Req::Verify {
                        key: m.key,
                        value: m.value.clone(),
                    };
                    exec.busy = true;
                    self.send(who, conn, req, Purpose::ExecVerify { cell });
                    return;
                }
                Job::Fence(conn, lease, ticket) => exec.machine.fence(conn, lease, ticket, now),
                Job::Cleanup(conns, key, owner, give_up) => {
                    let give_up = self.origin + give_up;
                    exec.machine.clean_up(conns, (key, owner), give_up, now);
                }
                Job::Renew(batch) => {
                    let mut renewal = RenewalBatch { items: batch };
                    // A claim given up meanwhile is not sent: planned again.
                    let mut undispatched = Vec::new();
                    renewal.items.retain(|(lease, ticket, _)| {
                        let sent = lease.dispatched(*ticket, server_id(generation));
                        if !sent {
                            undispatched.push(lease.id());
                        }
                        sent
                    });
                    for id in undispatched {
                        self.stats.undispatched += 1;
                        let again = now + Duration::from_millis(2);
                        self.procs[p].sched.completed(id, now, Some(again));
                    }
                    if renewal.items.is_empty() {
                        continue;
                    }
                    self.stats.extensions += renewal.items.len() as u64;
                    if self.procs[p].switching && generation == self.generation {
                        self.stats.interleaved += renewal.items.len() as u64;
                    }
                    let items = renewal
                        .items
                        .iter()
                        .map(|(lease, _, ttl)| {
                            let m = lease.extra();
                            (m.key, m.value.clone(), ttl.as_millis() as u64)
                        })
                        .collect();
                    self.exec_of(p, generation).expect("present").busy = true;
                    self.send(
                        who,
                        conn,
                        Req::Extend { items, time: true },
                        Purpose::Renew { renewal },
                    );
                    return;
                }
            }
        }
    }

    fn exec_replied(
        &mut self,
        p: usize,
        generation: u32,
        pend: Pending,
        resp: Option<Resp>,
    ) -> Result<(), String> {
        let now = self.at();
        let Some(exec) = self.exec_of(p, generation) else {
            return Err(format!("a reply for a gone executor of {generation}"));
        };
        exec.busy = false;
        if exec.retired {
            // Retired while the request was out: what the old server says no
            // longer counts (a renewal's claims are settled as unreadable,
            // their worst case kept, and planned again for the new primary);
            // then the machine lets go.
            match pend.purpose {
                Purpose::Renew { renewal } => {
                    let len = renewal.items.len();
                    let unread = std::iter::repeat_n(ExtendReply::Unreadable, len);
                    let settled = exec.machine.renewed(renewal, unread, now);
                    for (lease, _, _) in settled {
                        let again = now + Duration::from_millis(2);
                        self.procs[p].sched.completed(lease.id(), now, Some(again));
                    }
                }
                Purpose::ExecVerify { cell } => {
                    self.procs[p].exec.queue.push_back(Job::Verify(cell));
                }
                _ => {}
            }
            self.finish_retire(p);
            return Ok(());
        }
        if resp.is_none() {
            let conn = self.conn_at(generation);
            self.exec_of(p, generation).expect("present").conn = conn;
        }
        let exec = self.exec_of(p, generation).expect("present");
        match pend.purpose {
            Purpose::Renew { renewal } => match resp {
                Some(Resp::Renewed {
                    time,
                    read_at,
                    ints,
                }) => {
                    // As the executor reads them: an error reply was not run.
                    let replies = ints
                        .into_iter()
                        .map(|r| r.map_or(ExtendReply::NotRun, ExtendReply::of));
                    let settled = exec.machine.renewed(renewal, replies, now);
                    let spared = crate::core::executor::extended_in(&settled);
                    let drift = settled.first().map(|(l, _, _)| l.drift_factor());
                    for (lease, outcome, retry) in settled {
                        self.procs[p].sched.completed(lease.id(), now, retry);
                        // An error reply read nothing of the key.
                        if outcome != Settled::NotRun {
                            self.learned(&lease, pend.sent);
                        }
                        if outcome == Settled::Held {
                            self.extended_after_step(&lease, pend.sent);
                        }
                    }
                    if let Some(drift) = drift {
                        self.read_clock(p, generation, &time, read_at, pend.sent, &spared, drift)?;
                    }
                }
                None => {
                    let conn = self.procs[p].ids.then_some(pend.conn);
                    let exec = self.exec_of(p, generation).expect("present");
                    let done = exec.machine.renewal_unanswered(renewal, conn, now);
                    for (id, retry) in done {
                        self.procs[p].sched.completed(id, now, retry);
                    }
                }
                other => return Err(format!("renew reply {other:?}")),
            },
            Purpose::Kill => {
                let freed = exec.machine.kill_done(resp.is_some(), now);
                self.stats.fences += u64::from(!freed.is_empty());
                for lease in freed {
                    self.touch(p, &lease);
                }
            }
            Purpose::CleanupRelease => {
                exec.machine.clean_up_done(resp.is_some(), now);
            }
            Purpose::ExecVerify { cell } => match resp {
                Some(Resp::Ints(v)) => {
                    let verdict = Verdict::of(&v).ok_or("verify reply")?;
                    cell.verified(verdict, pend.sent, now);
                    self.touch(p, &cell);
                    self.learned(&cell, pend.sent);
                    for u in &mut self.users {
                        if let Some(g) = &mut u.guard
                            && Arc::ptr_eq(&g.cell, &cell)
                        {
                            g.exposed = false;
                        }
                    }
                }
                // Tried again until it answers or the lease is lost.
                None => exec.queue.push_back(Job::Verify(cell)),
                other => return Err(format!("verify reply {other:?}")),
            },
            _ => return Err("executor purpose".into()),
        }
        self.exec_kick(p);
        self.arm(p);
        Ok(())
    }

    /// The shipped reading of a server's clock, as the runtime's executor
    /// takes it from a renewal pipeline sent at `sent` whose `TIME` the
    /// server ran at `read_at` (true time): when the clock ran ahead, every
    /// live lease of process `p` on that server but those in `spared` is
    /// cut by what it gained.
    #[allow(clippy::too_many_arguments, reason = "one reading's whole context")]
    fn read_clock(
        &mut self,
        p: usize,
        generation: u32,
        time: &[String],
        read_at: Duration,
        sent: Instant,
        spared: &[u64],
        drift: f64,
    ) -> Result<(), String> {
        let now = self.at();
        let server = server_clock::parse_time(time).ok_or("a TIME reply")?;
        let reading = Reading {
            server,
            sent,
            received: now,
        };
        let exec = self.exec_of(p, generation).expect("present");
        let gain = exec.clock.read(reading, drift);
        let before = exec.last_read.replace(read_at);
        if self.trace {
            eprintln!("  reading of {generation} by {p}: gain {gain:?}, last read at {before:?}");
        }
        // The leases on that server, as the process sees it.
        let on_it = self.procs[p].generation == generation;
        if let Some(gain) = gain
            && on_it
        {
            self.stats.clock_cuts += 1;
            for u in 0..self.users.len() {
                let Some(g) = &self.users[u].guard else {
                    continue;
                };
                if self.users[u].proc != p || spared.contains(&g.cell.id()) {
                    continue;
                }
                let cell = g.cell.clone();
                cell.clock_gained(gain, now);
                self.touch(p, &cell);
            }
        }
        // The checker's side: a jump of this server between the last reading
        // and this one is known to the process now (whether or not the
        // shipped reading found it, which the invariants judge).
        if let (Some(before), Some((at, stepped))) = (before, self.stepped)
            && on_it
            && stepped == generation
            && before < at
            && at < read_at
        {
            self.procs[p].seen_step = true;
            for u in &mut self.users {
                if u.proc == p
                    && let Some(g) = &mut u.guard
                {
                    g.stepped = false;
                }
            }
        }
        Ok(())
    }

    /// A confirmed extension of `cell` sent at `sent`: after a jump of the
    /// server's clock it was set on the new clock.
    fn extended_after_step(&mut self, cell: &Arc<Cell>, sent: Instant) {
        let Some((at, _)) = self.stepped else {
            return;
        };
        if sent < instant(self.origin, at) {
            return;
        }
        for u in &mut self.users {
            if let Some(g) = &mut u.guard
                && Arc::ptr_eq(&g.cell, cell)
            {
                g.stepped = false;
            }
        }
    }

    /// The invariants, at the end of an instant.
    fn check(&mut self) -> Result<(), String> {
        self.check_heard()?;
        let now = self.at();
        let t = self.now;
        // Liveness after the faults healed (see `REGRANT_TTLS`).
        let longest = self.ttls.iter().copied().max().unwrap_or_default();
        for (key, since) in self.wanted.iter().enumerate() {
            if let Some(since) = since
                && t > *since + longest * REGRANT_TTLS
            {
                return Err(format!(
                    "key {key} not granted again within {REGRANT_TTLS} × {longest:?} of the \
                     faults healing at {since:?}; the server has {:?}",
                    self.server
                        .entries()
                        .into_iter()
                        .map(|(k, e)| (String::from_utf8_lossy(&k).into_owned(), e.expire_at))
                        .collect::<Vec<_>>()
                ));
            }
        }
        // A semaphore's unexpired permits never exceed its capacity, and hold
        // distinct slots (the record is the model server's data, read here
        // and nowhere by the code under test).
        // A writer never holds a reader/writer lease beside an unexpired
        // reader (the server's data again).
        if let KeyKind::Rw { .. } = self.kinds[0] {
            let [writer, readers, ..] = rw_keys(0);
            let readers = members(&self.server, readers);
            if let Some(w) = string_at(&self.server, writer)
                && !readers.is_empty()
            {
                return Err(format!("writer {w} beside readers {readers:?} at {t:?}"));
            }
        }
        if let KeyKind::Permits(capacity) = self.kinds[0] {
            let held = permits(&self.server, 0);
            let mut slots: Vec<&str> = held
                .iter()
                .filter_map(|(m, _)| m.split(':').nth(1))
                .collect();
            slots.sort_unstable();
            slots.dedup();
            if held.len() > capacity as usize || slots.len() < held.len() {
                return Err(format!(
                    "{} unexpired permits of a semaphore of capacity {capacity} at {t:?}: {held:?}",
                    held.len()
                ));
            }
        }
        for u in 0..self.users.len() {
            let Some(g) = &self.users[u].guard else {
                continue;
            };
            self.stats.checks += 1;
            let lost = g.cell.peek_lost(now);
            let (key, value) = (g.key, g.value.clone());
            if g.signal && lost && !g.cell.signal_closed() {
                return Err(format!(
                    "user {u}: is_lost() is true at {t:?} but the loss signal is still open \
                     (lost at {:?}, next wake {:?})",
                    g.cell.lost_at().duration_since(self.origin),
                    self.procs[self.users[u].proc].wake
                ));
            }
            if g.seen_lost && !lost {
                return Err(format!(
                    "user {u}: is_lost() was true and is false again at {t:?}"
                ));
            }
            // Liveness: on a network that loses and delays nothing past the
            // node timeout, with no fault, a lease kept alive (at a TTL keep-
            // alive accepts, since a moment with time to renew) stays held.
            if lost
                && !g.seen_lost
                && self.calm
                && g.keepalive
                && g.renewable
                && g.cell.ttl() >= self.timing.min_keepalive_ttl()
                && !g.cell.is_finished()
            {
                return Err(format!(
                    "user {u}: a kept-alive lease was lost at {t:?} on a calm network"
                ));
            }
            if lost {
                if let Some(g) = &mut self.users[u].guard {
                    g.seen_lost = true;
                }
                continue;
            }
            if g.exposed || g.deleted.is_some() || g.stepped {
                self.stats.exposed += 1;
                continue;
            }
            let name = key_name(key);
            let held = self.ends_at(key, &value);
            // The guard's bound, not only `is_lost()` (which comes a node
            // timeout earlier), must be at or before the server's real
            // expiry. Both change only at events, so checking at every event
            // covers every instant, the expiries included.
            let bound = g.cell.valid_until().duration_since(self.origin).as_nanos() as f64;
            if let Some(expires) = held
                && bound > expires + 1.0
            {
                return Err(format!(
                    "user {u} holds {value} with a bound of {:?}, past the server's expiry at \
                     {:?}",
                    Duration::from_nanos(bound as u64),
                    Duration::from_nanos(expires as u64)
                ));
            }
            if held.is_none() {
                let server = (
                    string_at(&self.server, name),
                    self.server.pttl(name),
                    permits(&self.server, key),
                    members(&self.server, rw_keys(key)[1]),
                );
                return Err(format!(
                    "user {u} believes it holds {value} at {t:?} (valid until {:?}), but the \
                     server has {server:?} (value, PTTL, permits, readers)",
                    g.cell.valid_until().duration_since(self.origin)
                ));
            }
        }
        Ok(())
    }
}

// ----- sets of leases, all or nothing ------------------------------------------

/// The leases of the set schedules; fenced ones count on `<key>:fence`.
const SET_KEYS: usize = 4;

/// A set one client believes it holds: its owner, keys, the value each key
/// holds, and the bound of the set (the shipped lease core).
struct HeldSet {
    keys: Vec<usize>,
    values: Vec<String>,
    core: LeaseCore,
}

/// An attempt whose reply was lost and that is still on its way: it reaches
/// the server at `at` on `client`, unless that connection was killed.
struct Late {
    at: Duration,
    client: ClientId,
    cmd: redis::Cmd,
}

struct SetClient {
    client: ClientId,
    held: Option<HeldSet>,
    /// An acquire whose last attempt got no reply: its owner, set, send
    /// times and the connections its attempts went out on (shipped
    /// bookkeeping).
    trying: Option<(String, Vec<usize>, Attempts<ClientId>)>,
    owners: u64,
}

fn set_key(key: usize) -> String {
    format!("m{key}")
}

/// One schedule of sets; see the module docs.
pub(crate) fn sets_case(seed: u64) -> Result<Stats, String> {
    let mut rng = Rng::new(seed);
    let node_timeout = Duration::from_millis(10 + rng.below(190));
    let drift_factor = [0.0, 0.01, 0.05][rng.below(3) as usize];
    let timing = Timing {
        drift_factor,
        node_timeout,
    };
    let fenced = rng.chance(0.5);
    let mut server = ModelServer::new(seed, 1_700_000_000_000 + rng.below(1 << 30) as i64);
    server.set_rate(1.0 + drift_factor * (2.0 * rng.unit() - 1.0) * 0.999);
    let usable = (0..)
        .map(|i| node_timeout + Duration::from_millis(5 + i * 7))
        .find(|t| timing.usable_ttl(*t))
        .expect("some ttl is usable");
    let ttls = [usable, usable * 3, node_timeout * 20];
    let origin = Instant::now();
    let mut now = Duration::ZERO;
    let mut stats = Stats::default();
    let mut late: Vec<Late> = Vec::new();
    // Owners whose acquire gave up and cleaned up: nothing of theirs may
    // be held afterwards.
    let mut abandoned: HashSet<String> = HashSet::new();
    // The highest token handed out per key, by the checker's own record.
    let mut tokens = [0u64; SET_KEYS];
    let mut clients: Vec<SetClient> = (0..3)
        .map(|_| SetClient {
            client: server.connect(),
            held: None,
            trying: None,
            owners: 0,
        })
        .collect();
    let value_of = |server: &ModelServer, key: usize| string_at(server, &set_key(key));
    for _ in 0..40 + rng.below(40) {
        let ttl = ttls[rng.below(3) as usize];
        let step = rng.micros(0, ttl.as_micros() as u64 / 2);
        now += step;
        server.elapse(step);
        let at = instant(origin, now);
        // Late attempts that are due arrive (on a connection still open).
        let (due, rest): (Vec<Late>, Vec<Late>) = late.into_iter().partition(|l| l.at <= now);
        late = rest;
        for l in due {
            run_on(&mut server, l.client, &l.cmd);
        }
        'step: {
            let c = rng.below(clients.len() as u64) as usize;
            let me = &mut clients[c];
            if let Some(held) = me.held.take_if(|_| rng.chance(0.5)) {
                // Release every lease with the shipped script of its kind.
                for (key, value) in held.keys.iter().zip(&held.values) {
                    let ops = Ops::string_value(&set_key(*key), value.clone());
                    let cmd = ops
                        .release_script()
                        .evalsha(&ops.key_refs(), ops.release_arg_refs().as_slice());
                    let code = run_on(&mut server, me.client, &cmd).and_then(|r| r.as_int());
                    if !held.core.is_lost(at) && code != Some(1) {
                        return Err(format!(
                            "a release of {value} on {} within its bound answered {code:?}",
                            set_key(*key)
                        ));
                    }
                }
                break 'step;
            }
            if me.held.is_some() {
                break 'step;
            }
            let (owner, keys, mut attempts) = match me.trying.take() {
                Some(trying) if rng.chance(0.7) => trying,
                Some((owner, keys, attempts)) => {
                    // Give up: kill the connections the unanswered attempts went
                    // out on, then delete by owner what they may have set.
                    if let Some(CleanUp { conns, delete }) = attempts.finish(false) {
                        for conn in conns {
                            server.kill_client(conn);
                        }
                        me.client = server.connect();
                        if delete {
                            let names: Vec<String> = keys.iter().map(|k| set_key(*k)).collect();
                            let names: Vec<&str> = names.iter().map(String::as_str).collect();
                            let cmd = scripts::MULTI_CLEAN_UP.evalsha(&names, &[owner.as_str()]);
                            run_on(&mut server, me.client, &cmd);
                        }
                    }
                    abandoned.insert(owner);
                    break 'step;
                }
                None => {
                    let mut keys: Vec<usize> = (0..SET_KEYS).collect();
                    for i in (1..keys.len()).rev() {
                        keys.swap(i, rng.below(i as u64 + 1) as usize);
                    }
                    keys.truncate(1 + rng.below(3) as usize);
                    me.owners += 1;
                    (format!("o{c}.{}", me.owners), keys, Attempts::default())
                }
            };
            let names: Vec<String> = keys.iter().map(|k| set_key(*k)).collect();
            let counters: Vec<String> = keys
                .iter()
                .map(|k| format!("{}:fence", set_key(*k)))
                .collect();
            let leases: Vec<&str> = names.iter().map(String::as_str).collect();
            let fences: Vec<&str> = if fenced {
                counters.iter().map(String::as_str).collect()
            } else {
                Vec::new()
            };
            let ttl_ms = ttl.as_millis().to_string();
            let (script_keys, args) =
                crate::lease::multi::acquire_call(&leases, &fences, &owner, &ttl_ms);
            let cmd = scripts::MULTI_ACQUIRE.evalsha(&script_keys, &args);
            let before: Vec<Option<String>> = keys.iter().map(|k| value_of(&server, *k)).collect();
            if rng.chance(0.25) {
                // No reply: the attempt may arrive now, later, or never.
                stats.unanswered += 1;
                attempts.unanswered(at, [me.client]);
                match rng.below(3) {
                    0 => {
                        run_on(&mut server, me.client, &cmd);
                    }
                    1 => late.push(Late {
                        at: now + rng.micros(0, 3 * node_timeout.as_micros() as u64),
                        client: me.client,
                        cmd,
                    }),
                    _ => {}
                }
                // Later attempts go out on a new connection.
                me.client = server.connect();
                me.trying = Some((owner, keys, attempts));
                break 'step;
            }
            let reply = run_on(&mut server, me.client, &cmd);
            let after: Vec<Option<String>> = keys.iter().map(|k| value_of(&server, *k)).collect();
            // A script's reply is one array, which the connection hands over as
            // its items; the shipped reader reads them.
            let items: Vec<redis::Value> = match reply.map(Reply::into_value) {
                Some(redis::Value::Array(items)) => items,
                other => return Err(format!("multi_acquire answered {other:?}")),
            };
            let owner_token = OwnerToken::from_raw(owner.clone());
            match read_set(&items, keys.len()).map_err(|e| e.to_string())? {
                SetReply::Granted(granted) => {
                    stats.grants += 1;
                    attempts.granted(at);
                    let since = attempts.since();
                    // The connections of earlier unanswered attempts are killed:
                    // none may grant this owner again after a release.
                    if let Some(CleanUp { conns, .. }) = attempts.finish(true) {
                        for conn in conns {
                            server.kill_client(conn);
                        }
                    }
                    let mut values = Vec::new();
                    for (i, (key, token)) in keys.iter().zip(granted).enumerate() {
                        let token = fenced
                            .then(|| parse_token(token, "acquire"))
                            .transpose()
                            .map_err(|e| format!("grant {i}: {e}"))?;
                        let value = match &token {
                            Some(token) => fenced_value(&owner_token, token),
                            None => owner.clone(),
                        };
                        if after[i].as_deref() != Some(value.as_str()) {
                            return Err(format!(
                                "{owner} was granted {} but it holds {:?}",
                                set_key(*key),
                                after[i]
                            ));
                        }
                        if let Some(token) = token {
                            let t = token.get();
                            let repeated = before[i].as_deref() == Some(value.as_str());
                            if !repeated && t <= tokens[*key] {
                                return Err(format!(
                                    "{} issued token {t} after {}",
                                    set_key(*key),
                                    tokens[*key]
                                ));
                            }
                            tokens[*key] = tokens[*key].max(t);
                        }
                        values.push(value);
                    }
                    me.held = Some(HeldSet {
                        keys,
                        values,
                        core: LeaseCore::granted(timing, dated(since, at), ttl),
                    });
                }
                SetReply::Held { .. } => {
                    // Busy: all or nothing, so nothing changed.
                    if before != after {
                        return Err(format!(
                            "{owner}'s attempt was refused but changed {before:?} to {after:?}"
                        ));
                    }
                    me.trying = None;
                    let _ = attempts.finish(false).map(|CleanUp { conns, delete }| {
                        for conn in conns {
                            server.kill_client(conn);
                        }
                        if delete {
                            let cmd = scripts::MULTI_CLEAN_UP.evalsha(&leases, &[owner.as_str()]);
                            run_on(&mut server, me.client, &cmd);
                        }
                    });
                    abandoned.insert(owner);
                }
            }
        }
        // The invariants, at this instant.
        stats.checks += 1;
        let mut holder: [Option<usize>; SET_KEYS] = [None; SET_KEYS];
        for (i, c) in clients.iter().enumerate() {
            let Some(held) = &c.held else { continue };
            if held.core.is_lost(at) {
                continue;
            }
            for (key, value) in held.keys.iter().zip(&held.values) {
                if let Some(other) = holder[*key].replace(i) {
                    return Err(format!(
                        "{} held by clients {other} and {i}, neither bound run out",
                        set_key(*key)
                    ));
                }
                let on_server = value_of(&server, *key);
                if on_server.as_deref() != Some(value.as_str()) {
                    return Err(format!(
                        "client {i} holds {} as {value} within its bound, but the server has \
                         {on_server:?}",
                        set_key(*key)
                    ));
                }
            }
        }
        for key in 0..SET_KEYS {
            if let Some(v) = value_of(&server, key) {
                let owner = v.split(':').next().unwrap_or_default();
                if abandoned.contains(owner) {
                    return Err(format!(
                        "{} still holds {v} after its acquire gave up and cleaned up",
                        set_key(key)
                    ));
                }
            }
        }
    }
    Ok(stats)
}
