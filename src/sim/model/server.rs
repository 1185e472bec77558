//! One model Redis deployment: a primary with its data, script cache,
//! connections and clock, and at most one replica fed by a replication stream
//! that the simulation drains at its own pace.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::rc::Rc;
use std::time::Duration;

use super::Reply;
use super::keyspace::{self, Entry, Keyspace};
use super::lua::{Exec, LuaEngine, sha1_hex};

thread_local! {
    /// One interpreter per thread, shared by its servers: it keeps no state
    /// between script runs but compiled scripts (by SHA1, so a server's own
    /// script cache still decides `NOSCRIPT`), and a new interpreter costs
    /// far more than a script run.
    static ENGINE: Rc<RefCell<LuaEngine>> = Rc::new(RefCell::new(LuaEngine::new()));
}

fn engine() -> Rc<RefCell<LuaEngine>> {
    ENGINE.with(Rc::clone)
}

/// A connection's id, as `CLIENT ID` answers it.
pub(crate) type ClientId = u64;

/// What survives a restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Persistence {
    /// `--save "" --appendonly no`: the data is lost.
    None,
    /// An append-only file with `appendfsync always`: every acknowledged
    /// write is kept.
    Aof,
}

/// What the server believes it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// Accepts writes (an old primary that has not yet been told it was
    /// replaced still does).
    Primary,
    /// Refuses writes with `READONLY`, inside scripts too.
    Replica,
}

/// An error reply the simulation makes the server answer instead of running
/// the next command (see [`ModelServer::inject`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Injected {
    /// The slot is served by another node (Cluster, after a takeover).
    Moved {
        /// The key's hash slot.
        slot: u16,
        /// `host:port` of the node that serves it.
        addr: String,
    },
    /// The slot is migrating; ask the target with `ASKING` first.
    Ask {
        /// The key's hash slot.
        slot: u16,
        /// `host:port` of the migration target.
        addr: String,
    },
    /// A multi-key command while the slot's keys are split between nodes.
    TryAgain,
    /// A write to a replica.
    ReadOnly,
    /// `EVALSHA` of a script the server does not have.
    NoScript,
    /// The server is loading its data after a restart.
    Loading,
    /// The user may not run this command.
    NoPerm,
    /// The server is over `maxmemory`.
    Oom,
}

const READONLY_TEXT: &str = "READONLY You can't write against a read only replica.";
const OOM_TEXT: &str = "OOM command not allowed when used memory > 'maxmemory'.";
const NOSCRIPT_TEXT: &str = "NOSCRIPT No matching script. Please use EVAL.";
const LOADING_TEXT: &str = "LOADING Redis is loading the dataset in memory";

impl Injected {
    /// The error text Redis 7.0 sends, for a command named `command`.
    pub(crate) fn reply(&self, command: &str) -> Reply {
        Reply::Error(match self {
            Injected::Moved { slot, addr } => format!("MOVED {slot} {addr}"),
            Injected::Ask { slot, addr } => format!("ASK {slot} {addr}"),
            Injected::TryAgain => {
                "TRYAGAIN Multiple keys request during rehashing of slot".to_owned()
            }
            Injected::ReadOnly => READONLY_TEXT.to_owned(),
            Injected::NoScript => NOSCRIPT_TEXT.to_owned(),
            Injected::Loading => LOADING_TEXT.to_owned(),
            Injected::NoPerm => format!(
                "NOPERM this user has no permissions to run the '{}' command",
                command.to_ascii_lowercase()
            ),
            Injected::Oom => OOM_TEXT.to_owned(),
        })
    }
}

/// The replica and the writes it has not applied yet.
#[derive(Clone, Debug)]
struct ReplicaLink {
    run_id: String,
    data: Keyspace,
    /// Key states in the order the primary wrote them, each with the
    /// replication offset after it.
    backlog: VecDeque<(u64, Vec<u8>, Option<Entry>)>,
    applied: u64,
}

/// A script's run: the data it reads and writes, and the commands it called.
struct ScriptRun {
    data: Keyspace,
    calls: usize,
}

/// A connection's state on the server.
#[derive(Clone, Debug, Default)]
struct Client {
    name: Option<Vec<u8>>,
    /// The replication offset after this connection's last write (`WAIT`).
    last_write: u64,
}

/// A deterministic model of one Redis 7.0 primary (and optionally one
/// replica) on a clock the simulation drives.
///
/// Kinds of methods:
/// - clock: [`now_ms`](Self::now_ms), [`advance_to`](Self::advance_to),
///   [`step_clock`](Self::step_clock), [`set_rate`](Self::set_rate),
///   [`elapse`](Self::elapse),
///   [`straddle_next_script`](Self::straddle_next_script);
/// - commands as a client sends them: [`command`](Self::command),
///   [`eval`](Self::eval), [`evalsha`](Self::evalsha), and on a connection
///   [`connect`](Self::connect) / [`command_from`](Self::command_from);
/// - the truth, for invariants: [`expiry`](Self::expiry),
///   [`next_expiry`](Self::next_expiry), [`pttl`](Self::pttl),
///   [`exists`](Self::exists), [`entry`](Self::entry),
///   [`entries`](Self::entries), [`take_invalidated`](Self::take_invalidated),
///   [`run_id`](Self::run_id);
/// - the deployment: [`add_replica`](Self::add_replica),
///   [`replicate`](Self::replicate), [`replication_lag`](Self::replication_lag),
///   [`promote`](Self::promote), [`rejoin`](Self::rejoin),
///   [`restart`](Self::restart), [`kill_client`](Self::kill_client);
/// - faults: [`inject`](Self::inject), [`inject_on`](Self::inject_on),
///   [`set_loading`](Self::set_loading), [`deny`](Self::deny),
///   [`set_oom`](Self::set_oom), [`set_role`](Self::set_role),
///   [`flush_scripts`](Self::flush_scripts).
pub(crate) struct ModelServer {
    now: i64,
    rate: f64,
    /// Server time owed to [`ModelServer::elapse`] below one millisecond.
    carry: f64,
    data: Keyspace,
    role: Role,
    run_id: String,
    replid: String,
    offset: u64,
    replica: Option<ReplicaLink>,
    scripts: BTreeMap<String, Vec<u8>>,
    lua: Rc<RefCell<LuaEngine>>,
    clients: BTreeMap<ClientId, Client>,
    next_client: ClientId,
    /// Source of `run_id`s and replication ids: the same seed gives the same
    /// ids.
    ids: u64,
    /// Errors to answer instead of running a command: for the next one, or
    /// for the next one of a name.
    injected: VecDeque<(Option<String>, Injected)>,
    loading: bool,
    oom: bool,
    denied: BTreeSet<String>,
    /// The command of the next script from which on its clock reads 1 ms
    /// later (see [`ModelServer::straddle_next_script`]).
    straddle: Option<(usize, i64)>,
    last_script_calls: usize,
    /// Keys written, deleted or expired since the last
    /// [`ModelServer::take_invalidated`].
    invalidated: Vec<Vec<u8>>,
}

impl std::fmt::Debug for ModelServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelServer")
            .field("now", &self.now)
            .field("run_id", &self.run_id)
            .field("role", &self.role)
            .field("keys", &self.data.entries(self.now).count())
            .finish_non_exhaustive()
    }
}

/// splitmix64, for ids.
fn mix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn to_argv<A: AsRef<[u8]>>(args: &[A]) -> Vec<Vec<u8>> {
    args.iter().map(|a| a.as_ref().to_vec()).collect()
}

fn lower(name: &[u8]) -> String {
    String::from_utf8_lossy(name).to_ascii_lowercase()
}

fn error(text: impl Into<String>) -> Reply {
    Reply::Error(text.into())
}

impl ModelServer {
    /// A standalone primary with no data, its clock at `now_ms`, its ids
    /// drawn from `seed`.
    pub(crate) fn new(seed: u64, now_ms: i64) -> Self {
        let mut ids = seed;
        let run_id = Self::fresh_id(&mut ids);
        let replid = Self::fresh_id(&mut ids);
        ModelServer {
            now: now_ms,
            rate: 1.0,
            carry: 0.0,
            data: Keyspace::new(false),
            role: Role::Primary,
            run_id,
            replid,
            offset: 0,
            replica: None,
            scripts: BTreeMap::new(),
            lua: engine(),
            clients: BTreeMap::new(),
            next_client: 1,
            ids,
            injected: VecDeque::new(),
            loading: false,
            oom: false,
            denied: BTreeSet::new(),
            straddle: None,
            last_script_calls: 0,
            invalidated: Vec::new(),
        }
    }

    fn fresh_id(ids: &mut u64) -> String {
        format!("{:016x}{:016x}{:08x}", mix(ids), mix(ids), mix(ids) as u32)
    }

    /// An independent copy in the same state (data, clock, scripts, ids,
    /// replica, connections, faults): for trying one operation at several
    /// instants.
    pub(crate) fn fork(&self) -> Self {
        ModelServer {
            now: self.now,
            rate: self.rate,
            carry: self.carry,
            data: self.data.clone(),
            role: self.role,
            run_id: self.run_id.clone(),
            replid: self.replid.clone(),
            offset: self.offset,
            replica: self.replica.clone(),
            scripts: self.scripts.clone(),
            lua: engine(),
            clients: self.clients.clone(),
            next_client: self.next_client,
            ids: self.ids,
            injected: self.injected.clone(),
            loading: self.loading,
            oom: self.oom,
            denied: self.denied.clone(),
            straddle: self.straddle,
            last_script_calls: self.last_script_calls,
            invalidated: self.invalidated.clone(),
        }
    }

    // ----- the clock -----

    /// The server clock in milliseconds (what `TIME` reads).
    pub(crate) fn now_ms(&self) -> i64 {
        self.now
    }

    /// The clock with the fraction of a millisecond [`ModelServer::elapse`]
    /// carries: the server's true reading, of which `now_ms` is the floor.
    pub(crate) fn clock_ms(&self) -> f64 {
        self.now as f64 + self.carry
    }

    /// Server milliseconds per true millisecond.
    pub(crate) fn rate(&self) -> f64 {
        self.rate
    }

    /// Sets the server clock to `ms` (earlier than now is a clock step back)
    /// and deletes every key that has expired by then (active expiry), which
    /// the replication stream carries as deletions.
    pub(crate) fn advance_to(&mut self, ms: i64) {
        self.now = ms;
        self.carry = 0.0;
        self.data.expire_all(ms);
        self.propagate(None);
    }

    /// Jumps the server clock by `delta_ms` (either way), as an NTP step or a
    /// wrong manual setting would.
    pub(crate) fn step_clock(&mut self, delta_ms: i64) {
        self.advance_to(self.now + delta_ms);
    }

    /// Refuses `SET` with both `NX` and `GET` (a syntax error that runs
    /// nothing), as Redis before 7.0 does; a replica added later refuses it
    /// too.
    pub(crate) fn refuse_nx_with_get(&mut self) {
        self.data.refuse_nx_with_get();
    }

    /// Server milliseconds per true millisecond for [`ModelServer::elapse`]
    /// (1.01 runs 1 % fast). Defaults to 1.
    pub(crate) fn set_rate(&mut self, rate: f64) {
        self.rate = rate;
    }

    /// Lets `true_time` pass: the clock moves by `true_time × rate`, whole
    /// milliseconds at a time (the fraction is carried to the next call).
    pub(crate) fn elapse(&mut self, true_time: Duration) {
        let advance = true_time.as_secs_f64() * 1000.0 * self.rate + self.carry;
        let whole = advance.floor();
        let carry = advance - whole;
        self.advance_to(self.now + whole as i64);
        self.carry = carry;
    }

    /// Makes the next script straddle a millisecond boundary, as a real one
    /// does when the clock ticks while it runs (or jumps, when the server is
    /// descheduled): its commands from the `at_call`-th on (0-based) read the
    /// clock `by_ms` later (`TIME`, `PTTL`, the base of `SET PX` and
    /// `PEXPIRE`), while whether a key has expired is still decided at the
    /// time the script started, as Redis 7.0 does. The server clock is
    /// `by_ms` later after that script.
    pub(crate) fn straddle_next_script(&mut self, at_call: usize, by_ms: i64) {
        self.straddle = Some((at_call, by_ms));
    }

    /// How many commands the last script called.
    pub(crate) fn last_script_calls(&self) -> usize {
        self.last_script_calls
    }

    // ----- the truth, for invariants -----

    /// Whether `key` exists now.
    pub(crate) fn exists(&self, key: impl AsRef<[u8]>) -> bool {
        self.data.peek(key.as_ref(), self.now).is_some()
    }

    /// The key's expiry time (absolute server ms, as `PEXPIRETIME`): the key
    /// exists while the clock is at or before it. `None` if the key does not
    /// exist now or never expires.
    pub(crate) fn expiry(&self, key: impl AsRef<[u8]>) -> Option<i64> {
        self.data
            .peek(key.as_ref(), self.now)
            .and_then(|e| e.expire_at)
    }

    /// `PTTL` now: -2 no key, -1 no expiry, else the ms left (0 in the key's
    /// last millisecond). Changes nothing.
    pub(crate) fn pttl(&self, key: impl AsRef<[u8]>) -> i64 {
        match self.data.peek(key.as_ref(), self.now) {
            None => -2,
            Some(e) => e.expire_at.map_or(-1, |when| (when - self.now).max(0)),
        }
    }

    /// The earliest expiry time (as [`ModelServer::expiry`]) of any key that
    /// exists now: the key is gone from the millisecond after it. For
    /// drivers that check invariants at every server-side expiry.
    pub(crate) fn next_expiry(&self) -> Option<i64> {
        self.data
            .entries(self.now)
            .filter_map(|(_, e)| e.expire_at)
            .min()
    }

    /// The keys written, deleted or expired (lazily or actively) since the
    /// last call, in order, repeats included: what `CLIENT TRACKING` would
    /// invalidate for a client that had read them. A write that left a key
    /// as it was may be listed too (a spurious wake-up, never a missed one).
    pub(crate) fn take_invalidated(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.invalidated)
    }

    /// The key's value and expiry now.
    pub(crate) fn entry(&self, key: impl AsRef<[u8]>) -> Option<&Entry> {
        self.data.peek(key.as_ref(), self.now)
    }

    /// Every key that exists now, in key order.
    pub(crate) fn entries(&self) -> Vec<(Vec<u8>, Entry)> {
        self.data
            .entries(self.now)
            .map(|(k, e)| (k.to_vec(), e.clone()))
            .collect()
    }

    /// Replaces a key's whole state (`None` deletes it) without a command,
    /// as a fixture or an operator editing keys by hand; it is replicated.
    pub(crate) fn put(&mut self, key: impl AsRef<[u8]>, entry: Option<Entry>) {
        self.data.put(key.as_ref(), entry);
        self.propagate(None);
    }

    /// The server's `run_id` (new at every restart).
    pub(crate) fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The replication id (`master_replid`).
    pub(crate) fn replid(&self) -> &str {
        &self.replid
    }

    /// What the server believes it is.
    pub(crate) fn role(&self) -> Role {
        self.role
    }

    // ----- commands -----

    /// Runs one command as a client without a connection of its own would
    /// (`CLIENT ID` and `CLIENT SETNAME` need [`ModelServer::command_from`];
    /// `WAIT` counts every write).
    pub(crate) fn command<A: AsRef<[u8]>>(&mut self, argv: &[A]) -> Reply {
        self.dispatch(None, &to_argv(argv))
    }

    /// `EVAL source numkeys keys… args…` (the script is cached, as Redis
    /// does). It names the source by its SHA1 at every call (a source seen
    /// before on this thread is looked up, others hashed) and copies it: a
    /// driver that runs a script often loads it once and uses
    /// [`ModelServer::evalsha`].
    pub(crate) fn eval<K: AsRef<[u8]>, A: AsRef<[u8]>>(
        &mut self,
        source: &str,
        keys: &[K],
        args: &[A],
    ) -> Reply {
        let argv = script_argv(b"EVAL", source.as_bytes(), keys, args);
        self.dispatch(None, &argv)
    }

    /// `EVALSHA sha numkeys keys… args…` (`NOSCRIPT` unless the script was
    /// loaded since the last restart or script flush).
    pub(crate) fn evalsha<K: AsRef<[u8]>, A: AsRef<[u8]>>(
        &mut self,
        sha: &str,
        keys: &[K],
        args: &[A],
    ) -> Reply {
        let argv = script_argv(b"EVALSHA", sha.as_bytes(), keys, args);
        self.dispatch(None, &argv)
    }

    /// Opens a connection and returns its id. Ids count from 1 again after a
    /// restart or a promotion, so an id kept from before may name another
    /// connection, as on a real server.
    pub(crate) fn connect(&mut self) -> ClientId {
        let id = self.next_client;
        self.next_client += 1;
        self.clients.insert(id, Client::default());
        id
    }

    /// Whether the connection is open (not killed, not cut by a restart).
    pub(crate) fn is_connected(&self, client: ClientId) -> bool {
        self.clients.contains_key(&client)
    }

    /// Closes a connection, as `CLIENT KILL ID` does.
    pub(crate) fn kill_client(&mut self, client: ClientId) -> bool {
        self.clients.remove(&client).is_some()
    }

    /// Runs one command on a connection; `None` if the connection is closed
    /// (the command never reaches the server).
    pub(crate) fn command_from<A: AsRef<[u8]>>(
        &mut self,
        client: ClientId,
        argv: &[A],
    ) -> Option<Reply> {
        if !self.is_connected(client) {
            return None;
        }
        Some(self.dispatch(Some(client), &to_argv(argv)))
    }

    fn dispatch(&mut self, client: Option<ClientId>, argv: &[Vec<u8>]) -> Reply {
        let Some(first) = argv.first() else {
            return error("ERR empty command");
        };
        let name = lower(first);
        let due = self
            .injected
            .iter()
            .position(|(only, _)| only.as_ref().is_none_or(|only| *only == name));
        if let Some((_, injected)) = due.and_then(|i| self.injected.remove(i)) {
            return injected.reply(&name);
        }
        if self.loading {
            return error(LOADING_TEXT);
        }
        if !self.denied.is_empty() {
            let full = match argv.get(1) {
                Some(sub) if matches!(name.as_str(), "client" | "script" | "config") => {
                    format!("{name}|{}", lower(sub))
                }
                _ => name.clone(),
            };
            if self.denied.contains(&name) || self.denied.contains(&full) {
                return Injected::NoPerm.reply(&full);
            }
        }
        let reply = match name.as_str() {
            "eval" | "evalsha" => self.run_script(&name, argv),
            "script" => self.script_command(argv),
            "client" => self.client_command(client, argv),
            "wait" => self.wait(client, argv),
            "role" => self.role_reply(),
            // A redirection is an injected error; the retry that follows it
            // runs here like any other command.
            "asking" | "readonly" | "readwrite" => Reply::Status("OK".to_owned()),
            "info" => Reply::Bulk(self.info().into_bytes()),
            "flushall" => {
                let keys: Vec<Vec<u8>> = self.entries().into_iter().map(|(k, _)| k).collect();
                for k in keys {
                    self.data.put(&k, None);
                }
                Reply::Status("OK".to_owned())
            }
            _ => data_command(&mut self.data, self.now, self.role, self.oom, argv, false),
        };
        self.propagate(client);
        reply
    }

    fn run_script(&mut self, name: &str, argv: &[Vec<u8>]) -> Reply {
        if argv.len() < 3 {
            return Reply::Error(format!(
                "ERR wrong number of arguments for '{name}' command"
            ));
        }
        let Some(numkeys) = keyspace::parse_i64(&argv[2]) else {
            return error("ERR value is not an integer or out of range");
        };
        if numkeys < 0 {
            return error("ERR Number of keys can't be negative");
        }
        let rest = &argv[3..];
        if numkeys as usize > rest.len() {
            return error("ERR Number of keys can't be greater than number of args");
        }
        let (keys, args) = rest.split_at(numkeys as usize);
        let sha = if name == "eval" {
            let sha = sha1_hex(&argv[1]);
            self.scripts.insert(sha.clone(), argv[1].clone());
            sha
        } else {
            let sha = lower(&argv[1]);
            if !self.scripts.contains_key(&sha) {
                return error(NOSCRIPT_TEXT);
            }
            sha
        };
        if self.oom {
            return error(OOM_TEXT);
        }
        // One server time for the whole script (TIME, expiry decisions, the
        // base of PX), unless it is to straddle a millisecond boundary.
        let start = self.now;
        let straddle = self.straddle.take();
        let role = self.role;
        self.data.set_script_start(Some(start));
        // The data goes with the script for its run and comes back after.
        let run = Rc::new(RefCell::new(ScriptRun {
            data: std::mem::take(&mut self.data),
            calls: 0,
        }));
        let host = Rc::clone(&run);
        let exec: Exec = Box::new(move |argv| {
            let mut run = host.borrow_mut();
            let clock = match straddle {
                Some((at, by)) if run.calls >= at => start + by,
                _ => start,
            };
            run.calls += 1;
            let denied = [
                "eval", "evalsha", "script", "client", "wait", "flushall", "info", "role",
            ];
            if denied
                .iter()
                .any(|d| d.as_bytes().eq_ignore_ascii_case(&argv[0]))
            {
                return error("ERR This Redis command is not allowed from script");
            }
            data_command(&mut run.data, clock, role, false, argv, true)
        });
        let source = &self.scripts[&sha];
        let reply = self.lua.borrow_mut().eval(&sha, source, keys, args, exec);
        let run = Rc::try_unwrap(run)
            .ok()
            .expect("the engine drops the handler after the run")
            .into_inner();
        self.data = run.data;
        self.data.set_script_start(None);
        self.last_script_calls = run.calls;
        if let Some((_, by)) = straddle {
            self.advance_to(start + by);
        }
        reply
    }

    fn script_command(&mut self, argv: &[Vec<u8>]) -> Reply {
        let sub = argv.get(1).map(|s| lower(s)).unwrap_or_default();
        match (sub.as_str(), argv.len()) {
            ("load", 3) => {
                let sha = sha1_hex(&argv[2]);
                self.scripts.insert(sha.clone(), argv[2].clone());
                Reply::Bulk(sha.into_bytes())
            }
            ("exists", n) if n >= 3 => Reply::Array(
                argv[2..]
                    .iter()
                    .map(|sha| Reply::Int(i64::from(self.scripts.contains_key(&lower(sha)))))
                    .collect(),
            ),
            ("flush", _) => {
                self.flush_scripts();
                Reply::Status("OK".to_owned())
            }
            _ => error("ERR unknown subcommand or wrong number of arguments for 'script'"),
        }
    }

    fn client_command(&mut self, client: Option<ClientId>, argv: &[Vec<u8>]) -> Reply {
        let sub = argv.get(1).map(|s| lower(s)).unwrap_or_default();
        match sub.as_str() {
            "id" => match client {
                Some(id) => Reply::Int(id as i64),
                None => error("ERR the model runs CLIENT ID on a connection only"),
            },
            "setname" if argv.len() == 3 => {
                if let Some(c) = client.and_then(|id| self.clients.get_mut(&id)) {
                    c.name = Some(argv[2].clone());
                }
                Reply::Status("OK".to_owned())
            }
            "getname" => match client
                .and_then(|id| self.clients.get(&id))
                .and_then(|c| c.name.clone())
            {
                Some(name) => Reply::Bulk(name),
                None => Reply::Nil,
            },
            // Invalidation messages are the network model's business.
            "tracking" => Reply::Status("OK".to_owned()),
            "kill" => {
                let mut target = None;
                let mut skip_me = true;
                let mut pairs = argv[2..].chunks(2);
                for pair in pairs.by_ref() {
                    let [filter, value] = pair else {
                        return error("ERR syntax error");
                    };
                    match lower(filter).as_str() {
                        "id" => match keyspace::parse_i64(value) {
                            Some(id) => target = Some(id),
                            None => return error("ERR client-id should be greater than 0"),
                        },
                        "skipme" => skip_me = lower(value) == "yes",
                        _ => return error("ERR syntax error"),
                    }
                }
                let killed = match target {
                    Some(id) if id > 0 => {
                        let id = id as u64;
                        if skip_me && client == Some(id) {
                            0
                        } else {
                            i64::from(self.kill_client(id))
                        }
                    }
                    _ => 0,
                };
                Reply::Int(killed)
            }
            _ => error("ERR unknown subcommand or wrong number of arguments for 'client'"),
        }
    }

    fn wait(&mut self, client: Option<ClientId>, argv: &[Vec<u8>]) -> Reply {
        if argv.len() != 3 {
            return error("ERR wrong number of arguments for 'wait' command");
        }
        let (Some(_), Some(_)) = (keyspace::parse_i64(&argv[1]), keyspace::parse_i64(&argv[2]))
        else {
            return error("ERR value is not an integer or out of range");
        };
        let target = match client.and_then(|id| self.clients.get(&id)) {
            Some(c) => c.last_write,
            None => self.offset,
        };
        let acked = self.replica.as_ref().is_some_and(|r| r.applied >= target);
        Reply::Int(i64::from(acked))
    }

    fn role_reply(&self) -> Reply {
        match self.role {
            Role::Primary => Reply::Array(vec![
                Reply::Bulk(b"master".to_vec()),
                Reply::Int(self.offset as i64),
                Reply::Array(
                    self.replica
                        .iter()
                        .map(|r| {
                            Reply::Array(vec![
                                Reply::Bulk(b"127.0.0.1".to_vec()),
                                Reply::Bulk(b"0".to_vec()),
                                Reply::Bulk(r.applied.to_string().into_bytes()),
                            ])
                        })
                        .collect(),
                ),
            ]),
            Role::Replica => Reply::Array(vec![
                Reply::Bulk(b"slave".to_vec()),
                Reply::Bulk(b"127.0.0.1".to_vec()),
                Reply::Int(0),
                Reply::Bulk(b"connected".to_vec()),
                Reply::Int(self.offset as i64),
            ]),
        }
    }

    fn info(&self) -> String {
        let role = match self.role {
            Role::Primary => "master",
            Role::Replica => "slave",
        };
        format!(
            "# Server\r\nredis_version:7.0.15\r\nrun_id:{}\r\n\r\n# Replication\r\nrole:{role}\r\n\
             connected_slaves:{}\r\nmaster_replid:{}\r\nmaster_repl_offset:{}\r\n\r\n\
             # Cluster\r\ncluster_enabled:0\r\n",
            self.run_id,
            usize::from(self.replica.is_some()),
            self.replid,
            self.offset
        )
    }

    /// Moves the keys the last command changed into the replication stream,
    /// each as its whole new state (Redis 7.0 replicates a script's effects,
    /// with absolute expiry times).
    fn propagate(&mut self, client: Option<ClientId>) {
        let changed = self.data.take_changed();
        if changed.is_empty() {
            return;
        }
        for (key, entry) in changed {
            self.offset += 1;
            self.invalidated.push(key.clone());
            if let Some(r) = self.replica.as_mut() {
                r.backlog.push_back((self.offset, key, entry));
            }
        }
        if let Some(c) = client.and_then(|id| self.clients.get_mut(&id)) {
            c.last_write = self.offset;
        }
    }

    // ----- the deployment -----

    /// Attaches a replica that starts as a full copy of the data (a full
    /// sync), with a new `run_id`. Replaces any replica there was.
    pub(crate) fn add_replica(&mut self) {
        let run_id = Self::fresh_id(&mut self.ids);
        self.attach(run_id);
    }

    /// Makes `old` (an earlier primary, see [`ModelServer::promote`]) this
    /// server's replica: its own data, writes accepted since it was replaced
    /// included, is discarded for a full copy of this one's; its `run_id` is
    /// kept.
    pub(crate) fn rejoin(&mut self, old: ModelServer) {
        self.attach(old.run_id);
    }

    fn attach(&mut self, run_id: String) {
        let mut data = self.data.clone();
        data.set_replica(true);
        let _ = data.take_changed();
        self.replica = Some(ReplicaLink {
            run_id,
            data,
            backlog: VecDeque::new(),
            applied: self.offset,
        });
    }

    /// Writes the replica has not applied yet (0 without a replica).
    pub(crate) fn replication_lag(&self) -> usize {
        self.replica.as_ref().map_or(0, |r| r.backlog.len())
    }

    /// Applies up to `n` writes of the stream to the replica, oldest first;
    /// returns how many it applied.
    pub(crate) fn replicate(&mut self, n: usize) -> usize {
        let Some(r) = self.replica.as_mut() else {
            return 0;
        };
        let mut applied = 0;
        while applied < n {
            let Some((offset, key, entry)) = r.backlog.pop_front() else {
                break;
            };
            r.data.put(&key, entry);
            r.applied = offset;
            applied += 1;
        }
        let _ = r.data.take_changed();
        applied
    }

    /// The replica's view of a key: its entry, expired or not (a replica
    /// keeps an expired key until the primary's deletion arrives).
    pub(crate) fn replica_entry(&self, key: impl AsRef<[u8]>) -> Option<Entry> {
        let r = self.replica.as_ref()?;
        r.data.peek(key.as_ref(), i64::MIN).cloned()
    }

    /// Fails over to the replica: it becomes this server (its data, its
    /// `run_id`, a new replication id, no scripts loaded, no connections, no
    /// replica), and the writes it had not applied are lost. Returns the old
    /// primary, which still believes it is the primary and accepts writes
    /// from the connections it had, until [`ModelServer::rejoin`] (or a drop)
    /// ends it.
    ///
    /// # Panics
    ///
    /// Panics without a replica.
    pub(crate) fn promote(&mut self) -> ModelServer {
        let link = self.replica.take().expect("promote needs a replica");
        let mut data = link.data;
        data.set_replica(false);
        let mut ids = self.ids;
        let replid = Self::fresh_id(&mut ids);
        let new = ModelServer {
            now: self.now,
            rate: self.rate,
            carry: self.carry,
            data,
            role: Role::Primary,
            run_id: link.run_id,
            replid,
            offset: link.applied,
            replica: None,
            scripts: BTreeMap::new(),
            lua: engine(),
            clients: BTreeMap::new(),
            next_client: 1,
            ids,
            injected: VecDeque::new(),
            loading: false,
            oom: false,
            denied: self.denied.clone(),
            straddle: None,
            last_script_calls: 0,
            invalidated: Vec::new(),
        };
        let mut old = std::mem::replace(self, new);
        old.ids = mix(&mut old.ids);
        // Keys that expired on the replica while it waited for deletions.
        self.data.expire_all(self.now);
        let _ = self.data.take_changed();
        old
    }

    /// Kills the process and starts it again: a new `run_id` and replication
    /// id, no connections, no scripts, no injected faults; the data is kept
    /// with [`Persistence::Aof`] and lost with [`Persistence::None`]. A
    /// replica resyncs to whatever the server came back with.
    pub(crate) fn restart(&mut self, persistence: Persistence) {
        if persistence == Persistence::None {
            self.data = Keyspace::new(false);
        }
        let _ = self.data.take_changed();
        self.data.expire_all(self.now);
        let _ = self.data.take_changed();
        self.run_id = Self::fresh_id(&mut self.ids);
        self.replid = Self::fresh_id(&mut self.ids);
        self.offset = 0;
        self.clients.clear();
        self.next_client = 1;
        self.flush_scripts();
        self.injected.clear();
        self.loading = false;
        if let Some(r) = self.replica.take() {
            self.attach(r.run_id);
        }
    }

    // ----- faults -----

    /// Makes the server answer the next command (whatever it is, on any
    /// connection) with `error` instead of running it. Several queue up.
    pub(crate) fn inject(&mut self, error: Injected) {
        self.injected.push_back((None, error));
    }

    /// Makes the server answer the next command named `command` (`"evalsha"`,
    /// any case) with `error` instead of running it; other commands run.
    pub(crate) fn inject_on(&mut self, command: &str, error: Injected) {
        self.injected
            .push_back((Some(command.to_ascii_lowercase()), error));
    }

    /// While on, every command is answered `LOADING` (a restarted server
    /// reading its append-only file).
    pub(crate) fn set_loading(&mut self, loading: bool) {
        self.loading = loading;
    }

    /// Denies a command (`"eval"`, or `"client|kill"` for a subcommand) to
    /// every connection with `NOPERM`, as an ACL rule would.
    pub(crate) fn deny(&mut self, command: &str) {
        self.denied.insert(command.to_ascii_lowercase());
    }

    /// While on, write commands and scripts are refused with `OOM`.
    pub(crate) fn set_oom(&mut self, oom: bool) {
        self.oom = oom;
    }

    /// Sets what the server believes it is; a [`Role::Replica`] refuses
    /// writes with `READONLY` (a write inside a script fails there).
    pub(crate) fn set_role(&mut self, role: Role) {
        self.role = role;
    }

    /// Forgets every cached script (`SCRIPT FLUSH`): `EVALSHA` gets
    /// `NOSCRIPT` until the next `EVAL` or `SCRIPT LOAD`.
    pub(crate) fn flush_scripts(&mut self) {
        self.scripts.clear();
    }
}

/// A data command, from a client or from a script (which checks the arity
/// itself and words the errors its own way).
fn data_command(
    data: &mut Keyspace,
    now: i64,
    role: Role,
    oom: bool,
    argv: &[Vec<u8>],
    in_script: bool,
) -> Reply {
    let Some(spec) = keyspace::command_spec(&argv[0]) else {
        return if in_script {
            error("ERR Unknown Redis command called from script")
        } else {
            Reply::Error(format!(
                "ERR unknown command '{}', with args beginning with: {}",
                String::from_utf8_lossy(&argv[0]),
                argv[1..]
                    .iter()
                    .map(|a| format!("'{}' ", String::from_utf8_lossy(a)))
                    .collect::<String>()
            ))
        };
    };
    if !keyspace::arity_ok(spec.arity, argv.len()) {
        return if in_script {
            error("ERR Wrong number of args calling Redis command from script")
        } else {
            Reply::Error(format!(
                "ERR wrong number of arguments for '{}' command",
                spec.name
            ))
        };
    }
    if spec.write && role == Role::Replica {
        return error(READONLY_TEXT);
    }
    if spec.write && oom {
        return error(OOM_TEXT);
    }
    data.exec(now, argv)
        .unwrap_or_else(|| error("ERR unknown command"))
}

fn script_argv<K: AsRef<[u8]>, A: AsRef<[u8]>>(
    verb: &[u8],
    script: &[u8],
    keys: &[K],
    args: &[A],
) -> Vec<Vec<u8>> {
    let mut argv = vec![
        verb.to_vec(),
        script.to_vec(),
        keys.len().to_string().into_bytes(),
    ];
    argv.extend(keys.iter().map(|k| k.as_ref().to_vec()));
    argv.extend(args.iter().map(|a| a.as_ref().to_vec()));
    argv
}
