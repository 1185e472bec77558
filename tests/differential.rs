//! The simulation's model server against a real `redis-server`.
//!
//! Random operation sequences — every shipped Lua script with valid,
//! borderline and bad arguments, and the plain commands the crate sends or
//! that put keys of another type in the way — run against the model and
//! against a real server, which must give the same replies and leave the same
//! data with the same expiries (within 1 ms). This keeps the model honest
//! about Redis: the simulation trusts it to run the scripts the way Redis
//! does.
//!
//! The real server's clock cannot be set, so the model follows it: before
//! each operation the pipeline reads the real `TIME`, runs the operation and
//! reads `TIME` again; the model must give the real reply at one of the
//! milliseconds in between. Redis 7.0 decides expiries at the time a script
//! started but reads the clock afresh for `TIME`, `PTTL`, `SET PX` and
//! `PEXPIRE`, so a script that straddles a millisecond boundary sees two
//! times; when the real operation spanned several milliseconds, the model
//! also tries the script with its clock moving on before each of its
//! commands. The keys are then dumped on both sides by one script (type,
//! `PEXPIRETIME`, contents; it decides expiries when it starts, between the
//! operation's second `TIME` and the one it reads) and must be the same.
//! Only when the real operation spanned more than one millisecond boundary
//! (a script descheduled on a loaded machine) and no instant gives the same
//! expiries exactly, are expiries 1 ms apart accepted; the model then takes
//! the real ones, so that later operations start from the same state (the
//! run prints how often).
//!
//! Expiry edges are sought on purpose: before a quarter of the operations
//! the test waits until the server clock reaches an expiry time (of a key or
//! of a sorted-set member) of that operation's keys, 1 ms before, at or 1 ms
//! after it, so that `>` against `>=` in the scripts and in the model shows.
//!
//! The deployment facts the model keeps are checked the same way against a
//! primary with an append-only file and its replica: what the replica holds
//! once it has acknowledged every write (absolute expiries, expired keys
//! hidden), what a restart keeps (and that it changes the `run_id`), what a
//! promoted replica serves.
//!
//! Scripts beyond the shipped ones check Redis's Lua conversions and error
//! texts one by one.
//!
//! `RESPIRE_DIFF_CASES=n` sets the number of sequences (default 200);
//! `RESPIRE_DIFF_SEED=s` runs one seed's operations again (the real
//! server's timing differs). A failure prints its seed and the operations up
//! to the mismatch.

mod support;
use support::Rng;

#[path = "../src/sim/model/mod.rs"]
mod model;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use model::{ModelServer, Reply};

/// The shipped scripts, by file name.
const SHIPPED: &[(&str, &str)] = &[
    (
        "fenced_acquire.lua",
        include_str!("../src/scripts/fenced_acquire.lua"),
    ),
    (
        "election_leader.lua",
        include_str!("../src/scripts/election_leader.lua"),
    ),
    (
        "election_proclaim.lua",
        include_str!("../src/scripts/election_proclaim.lua"),
    ),
    (
        "lease_extend.lua",
        include_str!("../src/scripts/lease_extend.lua"),
    ),
    (
        "lease_release.lua",
        include_str!("../src/scripts/lease_release.lua"),
    ),
    (
        "lease_verify.lua",
        include_str!("../src/scripts/lease_verify.lua"),
    ),
    (
        "rw_read_acquire.lua",
        include_str!("../src/scripts/rw_read_acquire.lua"),
    ),
    (
        "rw_read_extend.lua",
        include_str!("../src/scripts/rw_read_extend.lua"),
    ),
    (
        "rw_read_release.lua",
        include_str!("../src/scripts/rw_read_release.lua"),
    ),
    (
        "rw_read_verify.lua",
        include_str!("../src/scripts/rw_read_verify.lua"),
    ),
    (
        "rw_write_acquire.lua",
        include_str!("../src/scripts/rw_write_acquire.lua"),
    ),
    (
        "rw_write_clean_up.lua",
        include_str!("../src/scripts/rw_write_clean_up.lua"),
    ),
    (
        "rw_write_withdraw.lua",
        include_str!("../src/scripts/rw_write_withdraw.lua"),
    ),
    (
        "sem_acquire.lua",
        include_str!("../src/scripts/sem_acquire.lua"),
    ),
    (
        "sem_extend.lua",
        include_str!("../src/scripts/sem_extend.lua"),
    ),
    (
        "sem_release.lua",
        include_str!("../src/scripts/sem_release.lua"),
    ),
    (
        "sem_set_capacity.lua",
        include_str!("../src/scripts/sem_set_capacity.lua"),
    ),
    (
        "sem_status.lua",
        include_str!("../src/scripts/sem_status.lua"),
    ),
    (
        "sem_verify.lua",
        include_str!("../src/scripts/sem_verify.lua"),
    ),
    (
        "multi_acquire.lua",
        include_str!("../src/scripts/multi_acquire.lua"),
    ),
    (
        "multi_clean_up.lua",
        include_str!("../src/scripts/multi_clean_up.lua"),
    ),
    (
        "fifo_acquire.lua",
        include_str!("../src/scripts/fifo_acquire.lua"),
    ),
    (
        "fifo_withdraw.lua",
        include_str!("../src/scripts/fifo_withdraw.lua"),
    ),
];

/// Reads every key of a case: the server time, then per key its type,
/// `PEXPIRETIME` and contents (a string's value, a hash's fields, a sorted
/// set's members with scores).
const DUMP: &str = r"
local t = redis.call('TIME')
local out = {t[1], t[2]}
for _, k in ipairs(KEYS) do
  local ty = redis.call('TYPE', k).ok
  local body = {}
  if ty == 'string' then body = {redis.call('GET', k)}
  elseif ty == 'hash' then body = redis.call('HGETALL', k)
  elseif ty == 'zset' then body = redis.call('ZRANGE', k, 0, -1, 'WITHSCORES') end
  out[#out + 1] = {ty, redis.call('PEXPIRETIME', k), body}
end
return out
";

const OPS_PER_CASE: usize = 40;
const DEFAULT_CASES: u64 = 200;
/// How many sequences a planted fault may take to show; the runs stop at
/// the first mismatch, which usually comes within a few dozen.
const PLANTED_BUDGET: u64 = 3_000;

// ----- a seeded generator -----

// ----- a plain RESP2 connection, so error texts arrive as they are -----

struct Resp {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Resp {
    fn connect(server: &support::TestServer) -> Resp {
        let stream = TcpStream::connect(server.addr()).expect("connect to the test server");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        stream.set_nodelay(true).expect("nodelay");
        Resp {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        }
    }

    /// Sends the commands in one write and reads their replies.
    fn pipeline(&mut self, commands: &[Vec<Vec<u8>>]) -> Vec<Reply> {
        let mut out = Vec::new();
        for argv in commands {
            out.extend_from_slice(format!("*{}\r\n", argv.len()).as_bytes());
            for arg in argv {
                out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
                out.extend_from_slice(arg);
                out.extend_from_slice(b"\r\n");
            }
        }
        self.writer.write_all(&out).expect("write");
        commands.iter().map(|_| self.read()).collect()
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("read");
        line.trim_end_matches("\r\n").to_owned()
    }

    fn read(&mut self) -> Reply {
        let line = self.line();
        let (kind, rest) = line.split_at(1);
        match kind {
            "+" => Reply::Status(rest.to_owned()),
            "-" => Reply::Error(rest.to_owned()),
            ":" => Reply::Int(rest.parse().expect("integer")),
            "$" => {
                let len: i64 = rest.parse().expect("length");
                if len < 0 {
                    return Reply::Nil;
                }
                let mut body = vec![0; len as usize + 2];
                self.reader.read_exact(&mut body).expect("bulk");
                body.truncate(len as usize);
                Reply::Bulk(body)
            }
            "*" => {
                let len: i64 = rest.parse().expect("length");
                if len < 0 {
                    return Reply::Nil;
                }
                Reply::Array((0..len).map(|_| self.read()).collect())
            }
            _ => panic!("unexpected RESP line {line:?}"),
        }
    }
}

fn argv(items: &[&str]) -> Vec<Vec<u8>> {
    items.iter().map(|s| s.as_bytes().to_vec()).collect()
}

fn time_ms(reply: &Reply) -> i64 {
    let Reply::Array(parts) = reply else {
        panic!("TIME answered {reply}");
    };
    let field = |i: usize| -> i64 {
        match &parts[i] {
            Reply::Bulk(b) => String::from_utf8_lossy(b).parse().expect("a TIME field"),
            other => panic!("TIME field {other}"),
        }
    };
    field(0) * 1000 + field(1) / 1000
}

// ----- operations -----

/// One operation of a sequence.
#[derive(Clone, Debug)]
enum Op {
    /// A shipped script (index into [`SHIPPED`]) with its keys and arguments.
    Script {
        script: usize,
        keys: Vec<String>,
        args: Vec<String>,
    },
    /// A plain command.
    Command(Vec<String>),
    /// Let real time pass (ms) before the next operation.
    Pause(u64),
    /// Wait until the server clock reaches an expiry time the model holds
    /// for one of `keys` (a key's or a member's, the `n`-th one within the
    /// next 40 ms), plus `offset` ms: the next operation, on those keys, then
    /// lands at the edge, where a key or a member is last alive or just gone.
    ToEdge {
        keys: Vec<String>,
        n: usize,
        offset: i64,
    },
}

impl Op {
    /// The command for a server running `sources` (one per shipped script).
    fn argv(&self, sources: &[String]) -> Vec<Vec<u8>> {
        match self {
            Op::Script { script, keys, args } => {
                let mut v = vec![
                    b"EVAL".to_vec(),
                    sources[*script].as_bytes().to_vec(),
                    keys.len().to_string().into_bytes(),
                ];
                v.extend(keys.iter().map(|k| k.as_bytes().to_vec()));
                v.extend(args.iter().map(|a| a.as_bytes().to_vec()));
                v
            }
            Op::Command(items) => items.iter().map(|s| s.as_bytes().to_vec()).collect(),
            Op::Pause(_) | Op::ToEdge { .. } => Vec::new(),
        }
    }

    fn describe(&self) -> String {
        match self {
            Op::Script { script, keys, args } => {
                format!("{} KEYS={keys:?} ARGV={args:?}", SHIPPED[*script].0)
            }
            Op::Command(items) => items.join(" "),
            Op::Pause(ms) => format!("(pause {ms} ms)"),
            Op::ToEdge { n, offset, .. } => format!("(wait for expiry edge #{n} {offset:+} ms)"),
        }
    }
}

fn script_index(file: &str) -> usize {
    SHIPPED
        .iter()
        .position(|(name, _)| *name == file)
        .unwrap_or_else(|| panic!("no shipped script {file}"))
}

/// Draws operations over the keys of one case, remembering the lease values
/// and permits it was granted so that later operations can use them.
struct Generator {
    rng: Rng,
    tag: String,
    leases: Vec<String>,
    permits: Vec<String>,
    /// The operation a [`Op::ToEdge`] was drawn for.
    pending: Option<Op>,
    /// The family most scripts of this case come from: 0 the fenced lease, 1
    /// the reader/writer lease, 2 the semaphore, 3 any.
    focus: usize,
    /// The capacity this case's semaphore participants mostly agree on.
    capacity: &'static str,
    /// The server time last read (ms), for absolute expiry times.
    now: i64,
}

const LEASE: &str = "lease";
const FENCE: &str = "fence";
const WRITER: &str = "rw:w";
const READERS: &str = "rw:r";
const INTENTS: &str = "rw:q";
const WRITE_FENCE: &str = "rw:fence";
const PERMITS: &str = "sem:permits";
const META: &str = "sem:meta";
const SLOTS: &str = "sem:slots";
const VALUE: &str = "value";
const QUEUE: &str = "queue";
const QUEUE_EXPIRY: &str = "queue:expiry";
const ALL_KEYS: [&str; 12] = [
    LEASE,
    FENCE,
    VALUE,
    WRITER,
    READERS,
    INTENTS,
    WRITE_FENCE,
    PERMITS,
    META,
    SLOTS,
    QUEUE,
    QUEUE_EXPIRY,
];

impl Generator {
    fn new(seed: u64) -> Self {
        Generator {
            rng: Rng::new(seed),
            tag: format!("{{diff{seed}}}"),
            leases: Vec::new(),
            permits: Vec::new(),
            pending: None,
            focus: 0,
            capacity: "1",
            now: 0,
        }
        .focused()
    }

    fn focused(mut self) -> Self {
        self.focus = self.rng.index(6);
        self.capacity = self.rng.pick(&["1", "2", "3"]);
        self
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.tag)
    }

    fn pick_key(&mut self, names: &[&str]) -> String {
        let name = self.rng.pick(names);
        self.key(name)
    }

    fn keys(&self, names: &[&str]) -> Vec<String> {
        names.iter().map(|n| self.key(n)).collect()
    }

    fn owner(&mut self) -> String {
        if self.rng.chance(3) {
            return self.rng.pick(&["", "x:y", "a:"]).to_owned();
        }
        self.rng.pick(&["a", "b", "c"]).to_owned()
    }

    fn ttl(&mut self) -> String {
        if self.rng.chance(4) {
            return self
                .rng
                .pick(&[
                    "0",
                    "-1",
                    "abc",
                    "1.5",
                    "",
                    "99999999999999",
                    "9999999999999",
                ])
                .to_owned();
        }
        self.rng
            .pick(&[
                "1", "2", "3", "5", "8", "13", "20", "30", "40", "100", "1000", "60000",
            ])
            .to_owned()
    }

    fn capacity(&mut self) -> String {
        if self.rng.chance(4) {
            return self.rng.pick(&["0", "10001", "x", "10000"]).to_owned();
        }
        if self.rng.chance(10) {
            return self.rng.pick(&["1", "2", "3"]).to_owned();
        }
        self.capacity.to_owned()
    }

    fn lease_value(&mut self) -> String {
        if !self.leases.is_empty() && self.rng.chance(80) {
            return self.leases[self.rng.index(self.leases.len())].clone();
        }
        format!("{}:{}", self.owner(), self.rng.index(3) + 1)
    }

    /// A value a leader advertises.
    fn advertised(&mut self) -> String {
        self.rng.pick(&["v", "", "a:b", "10.0.0.1:80"]).to_owned()
    }

    fn permit(&mut self) -> String {
        if !self.permits.is_empty() && self.rng.chance(80) {
            return self.permits[self.rng.index(self.permits.len())].clone();
        }
        format!(
            "{}:{}:{}",
            self.owner(),
            self.rng.index(3),
            self.rng.index(5) + 1
        )
    }

    fn script(&mut self, file: &str, keys: &[&str], args: Vec<String>) -> Op {
        Op::Script {
            script: script_index(file),
            keys: self.keys(keys),
            args,
        }
    }

    fn next_op(&mut self) -> Op {
        if let Some(op) = self.pending.take() {
            return op;
        }
        if self.rng.chance(4) {
            return Op::Pause(1 + self.rng.index(10) as u64);
        }
        let op = self.draw();
        if self.rng.chance(25) {
            let keys = match &op {
                Op::Script { keys, .. } => keys.clone(),
                Op::Command(items) => items.iter().skip(1).take(1).cloned().collect(),
                _ => Vec::new(),
            };
            let edge = Op::ToEdge {
                keys,
                n: self.rng.index(3),
                offset: self.rng.index(3) as i64 - 1,
            };
            self.pending = Some(op);
            return edge;
        }
        op
    }

    fn draw(&mut self) -> Op {
        if self.rng.chance(22) {
            return self.plain();
        }
        let rw = [WRITER, READERS, INTENTS, WRITE_FENCE];
        let sem = [PERMITS, META, SLOTS];
        // Scripts 0..4 are the fenced lease's, 4..11 the reader/writer
        // lease's, 11..17 the semaphore's, 17..19 the election's (with the
        // fenced lease's), 19..21 those of a set of leases, 21..23 those of a
        // lock's queue of waiters.
        let script = match self.focus {
            0 if self.rng.chance(70) => self.rng.index(4),
            1 if self.rng.chance(70) => 4 + self.rng.index(7),
            2 if self.rng.chance(70) => 11 + self.rng.index(6),
            3 if self.rng.chance(70) => [0, 1, 3, 17, 18][self.rng.index(5)],
            4 if self.rng.chance(70) => 21 + self.rng.index(2),
            _ => self.rng.index(23),
        };
        match script {
            0 if self.rng.chance(40) => {
                let args = vec![self.owner(), self.ttl(), self.advertised()];
                self.script("fenced_acquire.lua", &[LEASE, FENCE, VALUE], args)
            }
            0 => {
                let args = vec![self.owner(), self.ttl()];
                self.script("fenced_acquire.lua", &[LEASE, FENCE], args)
            }
            17 => self.script("election_leader.lua", &[LEASE, VALUE], Vec::new()),
            19 => {
                // Two leases (the writer key is a string lease too), plain
                // or each with its counter; now and then one alone.
                let fenced = self.rng.chance(50);
                let keys: &[&str] = match (fenced, self.rng.chance(20)) {
                    (true, true) => &[LEASE, FENCE],
                    (true, false) => &[LEASE, WRITER, FENCE, WRITE_FENCE],
                    (false, true) => &[LEASE],
                    (false, false) => &[WRITER, LEASE],
                };
                let kind = if fenced { "fenced" } else { "plain" };
                let args = vec![self.owner(), self.ttl(), kind.to_owned()];
                self.script("multi_acquire.lua", keys, args)
            }
            20 => {
                let args = vec![self.owner()];
                self.script("multi_clean_up.lua", &[LEASE, WRITER], args)
            }
            21 => {
                // The lock is a plain string lease: its value is an owner.
                let entry = if self.rng.chance(10) {
                    self.rng.pick(&["-1", "abc", "1.5", ""]).to_owned()
                } else {
                    self.rng.pick(&["0", "5", "20", "200", "5000"]).to_owned()
                };
                let args = vec![self.owner(), self.ttl(), entry];
                self.script("fifo_acquire.lua", &[LEASE, QUEUE, QUEUE_EXPIRY], args)
            }
            22 => {
                let args = vec![self.owner()];
                self.script("fifo_withdraw.lua", &[QUEUE, QUEUE_EXPIRY], args)
            }
            18 => {
                let lease = self.lease_value();
                let term = if self.rng.chance(80) {
                    lease.rsplit(':').next().unwrap_or_default().to_owned()
                } else {
                    self.rng.pick(&["1", "2", ""]).to_owned()
                };
                let args = vec![lease, term, self.advertised()];
                self.script("election_proclaim.lua", &[LEASE, VALUE], args)
            }
            1 => {
                let args = vec![self.lease_value(), self.ttl()];
                self.script("lease_extend.lua", &[LEASE], args)
            }
            2 => {
                let args = if self.rng.chance(30) {
                    vec![format!("{}:", self.owner()), "prefix".to_owned()]
                } else {
                    vec![self.lease_value(), "exact".to_owned()]
                };
                self.script("lease_release.lua", &[LEASE], args)
            }
            3 => {
                let args = vec![self.lease_value()];
                self.script("lease_verify.lua", &[LEASE], args)
            }
            4 => {
                let pref = self
                    .rng
                    .pick(&["writer", "reader", "writer", "either"])
                    .to_owned();
                let args = vec![self.owner(), self.ttl(), pref];
                self.script("rw_read_acquire.lua", &rw, args)
            }
            5 => {
                let args = vec![self.owner(), self.ttl()];
                self.script("rw_read_extend.lua", &[READERS], args)
            }
            6 => {
                let mut args = vec![self.owner()];
                match self.rng.index(3) {
                    0 => {}
                    1 => args.push("exact".to_owned()),
                    _ => args.push(self.rng.pick(&["exact", "prefix"]).to_owned()),
                }
                self.script("rw_read_release.lua", &[READERS], args)
            }
            7 => {
                let args = vec![self.owner()];
                self.script("rw_read_verify.lua", &[READERS], args)
            }
            8 => {
                let intent = if self.rng.chance(5) {
                    "-1".to_owned()
                } else {
                    self.rng.pick(&["0", "5", "20", "100", "0"]).to_owned()
                };
                let args = vec![self.owner(), self.ttl(), intent];
                self.script("rw_write_acquire.lua", &rw, args)
            }
            9 => {
                let args = vec![self.owner()];
                self.script("rw_write_clean_up.lua", &[WRITER, INTENTS], args)
            }
            10 => {
                let args = vec![self.owner()];
                self.script("rw_write_withdraw.lua", &[INTENTS], args)
            }
            11 => {
                let args = vec![self.owner(), self.ttl(), self.capacity()];
                self.script("sem_acquire.lua", &sem, args)
            }
            12 => {
                let args = vec![self.permit(), self.ttl()];
                self.script("sem_extend.lua", &sem, args)
            }
            13 => {
                let args = if self.rng.chance(30) {
                    vec![self.owner(), "prefix".to_owned()]
                } else {
                    let mode = self.rng.pick(&["exact", "exact", "other"]).to_owned();
                    vec![self.permit(), mode]
                };
                self.script("sem_release.lua", &sem, args)
            }
            14 => {
                let args = vec![self.capacity()];
                self.script("sem_set_capacity.lua", &[META, PERMITS], args)
            }
            15 => self.script("sem_status.lua", &sem, Vec::new()),
            _ => {
                let args = vec![self.permit()];
                self.script("sem_verify.lua", &[PERMITS], args)
            }
        }
    }

    /// A plain command: what the crate sends itself, and what puts a key of
    /// another type, a counter at its limit or an odd member in the way.
    fn plain(&mut self) -> Op {
        let any = self.pick_key(&ALL_KEYS);
        let s = |items: &[&str]| Op::Command(items.iter().map(|s| (*s).to_owned()).collect());
        match self.rng.index(16) {
            0 => {
                let (owner, ttl) = (self.owner(), self.ttl());
                let key = self.key(LEASE);
                // A lock's attempt: alone with `GET` (Redis 7.0 on), or
                // pipelined with a `GET` of its own.
                if self.rng.index(2) == 0 {
                    s(&["SET", &key, &owner, "NX", "PX", &ttl, "GET"])
                } else {
                    s(&["SET", &key, &owner, "NX", "PX", &ttl])
                }
            }
            1 => s(&[
                self.rng
                    .pick(&["GET", "PTTL", "PEXPIRETIME", "TYPE", "EXISTS"]),
                &any,
            ]),
            2 => {
                let ttl = self.ttl();
                s(&["PEXPIRE", &any, &ttl])
            }
            3 => s(&["DEL", &any]),
            4 => s(&["INCR", &self.pick_key(&[FENCE, WRITE_FENCE])]),
            5 => {
                let value = self.rng.pick(&[
                    "9223372036854775807",
                    "9223372036854775806",
                    "-3",
                    "abc",
                    "007",
                    "0",
                ]);
                s(&["SET", &self.pick_key(&[FENCE, WRITE_FENCE]), value])
            }
            6 => {
                let (field, value) = match self.rng.index(4) {
                    0 => ("capacity", self.capacity()),
                    1 => (
                        "fence",
                        self.rng.pick(&["9223372036854775807", "x", "5"]).to_owned(),
                    ),
                    2 => ("holder:a", self.rng.pick(&["0:1", "7:7"]).to_owned()),
                    _ => ("f", "v".to_owned()),
                };
                s(&["HSET", &any, field, &value])
            }
            7 => {
                let score = self.rng.pick(&["1", "99999999999999", "+inf", "2.5"]);
                let member = self.rng.pick(&["a", "b", "a:0:1", "b:1:2", "odd"]);
                s(&["ZADD", &any, score, member])
            }
            8 => {
                let bit = self.rng.index(4).to_string();
                s(&["SETBIT", &self.key(SLOTS), &bit, self.rng.pick(&["0", "1"])])
            }
            9 => s(&["SET", &any, "v"]),
            10 => {
                let key = self.pick_key(&[FENCE, WRITE_FENCE, META]);
                s(&["PEXPIRE", &key, "100000"])
            }
            11 => {
                // An absolute time near the server's last reading, or far.
                let at = match self.rng.index(3) {
                    0 => self.rng.pick(&["1", "99999999999999"]).to_owned(),
                    _ => (self.now + self.rng.index(8) as i64 - 2).to_string(),
                };
                let verb = if self.rng.chance(50) {
                    "PEXPIREAT"
                } else {
                    "PXAT"
                };
                if verb == "PXAT" {
                    s(&["SET", &any, "v", "PXAT", &at])
                } else {
                    s(&["PEXPIREAT", &any, &at])
                }
            }
            12 => {
                let ttl = self.ttl();
                s(&["SET", &any, "v", "PX", &ttl])
            }
            13 => s(&["HMGET", &self.key(META), "capacity", "fence", "nope"]),
            14 => s(&[
                "ZRANGEBYSCORE",
                &any,
                "-inf",
                "(99999999999999",
                "WITHSCORES",
            ]),
            _ => s(&["ZREMRANGEBYSCORE", &any, "-inf", "2"]),
        }
    }

    /// Remembers what a grant handed out.
    fn learn(&mut self, op: &Op, reply: &Reply) {
        let Op::Script { script, args, .. } = op else {
            return;
        };
        let Reply::Array(items) = reply else {
            return;
        };
        let text = |r: &Reply| match r {
            Reply::Bulk(b) => Some(String::from_utf8_lossy(b).into_owned()),
            Reply::Int(n) => Some(n.to_string()),
            _ => None,
        };
        if items.first() != Some(&Reply::Int(1)) {
            return;
        }
        match SHIPPED[*script].0 {
            "fenced_acquire.lua" | "rw_write_acquire.lua" => {
                if let Some(token) = items.get(1).and_then(text) {
                    self.leases.push(format!("{}:{token}", args[0]));
                }
            }
            "multi_acquire.lua" if args[2] == "fenced" => {
                // The first lease of the set is `LEASE`, or the writer key.
                if let Some(token) = items.get(1).and_then(text) {
                    self.leases.push(format!("{}:{token}", args[0]));
                }
            }
            "sem_acquire.lua" => {
                if let (Some(slot), Some(token)) =
                    (items.get(1).and_then(text), items.get(2).and_then(text))
                {
                    self.permits.push(format!("{}:{slot}:{token}", args[0]));
                }
            }
            _ => {}
        }
    }
}

// ----- one case -----

/// What ran and how it compared, for the failure message and the coverage
/// check.
#[derive(Default)]
struct Tally {
    ops: usize,
    /// Per script: (runs, replies that were not errors).
    scripts: BTreeMap<&'static str, (usize, usize)>,
    adopted: usize,
}

/// Compares two dumps, allowing an expiry to differ by `tolerance` ms;
/// returns the keys whose real expiry the model should take.
fn dumps_match(
    real: &Reply,
    model: &Reply,
    keys: &[String],
    tolerance: i64,
) -> Option<Vec<(String, i64)>> {
    let (Reply::Array(r), Reply::Array(m)) = (real, model) else {
        return None;
    };
    if r.len() != m.len() {
        return None;
    }
    let mut adopt = Vec::new();
    for (i, (rk, mk)) in r.iter().zip(m).enumerate().skip(2) {
        let (Reply::Array(rk), Reply::Array(mk)) = (rk, mk) else {
            return None;
        };
        if rk[0] != mk[0] || rk[2] != mk[2] {
            return None;
        }
        let (Some(re), Some(me)) = (rk[1].as_int(), mk[1].as_int()) else {
            return None;
        };
        if re != me {
            if re < 0 || me < 0 || (re - me).abs() > tolerance {
                return None;
            }
            adopt.push((keys[i - 2].clone(), re));
        }
    }
    Some(adopt)
}

/// One sequence: its operations and keys, and the model following the real
/// server.
struct Case {
    seed: u64,
    g: Generator,
    keys: Vec<String>,
    dump_cmd: Vec<Vec<u8>>,
    history: Vec<String>,
    model: ModelServer,
    shipped: Vec<String>,
}

impl Case {
    /// Deletes the case's keys on the real server and starts a model at the
    /// real server's time.
    fn start(seed: u64, real: &mut Resp) -> Case {
        let g = Generator::new(seed);
        let keys = g.keys(&ALL_KEYS);
        let mut dump_cmd = argv(&["EVAL", DUMP]);
        dump_cmd.push(keys.len().to_string().into_bytes());
        dump_cmd.extend(keys.iter().map(|k| k.as_bytes().to_vec()));
        let mut del = argv(&["DEL"]);
        del.extend(keys.iter().map(|k| k.as_bytes().to_vec()));
        let start = real.pipeline(&[del, argv(&["TIME"])]);
        let model = ModelServer::new(seed, time_ms(&start[1]));
        let mut case = Case {
            seed,
            g,
            keys,
            dump_cmd,
            history: Vec::new(),
            model,
            shipped: shipped_sources(),
        };
        case.g.now = case.model.now_ms();
        case
    }

    /// Dumps the case's keys on another real server (the replica, or the
    /// primary after a restart) and on `model`, at some instant from the
    /// model's time to the real dump's, and compares them.
    fn compare_dump(&self, real: &mut Resp, model: &ModelServer, what: &str) -> Result<(), String> {
        let real_dump = real
            .pipeline(std::slice::from_ref(&self.dump_cmd))
            .remove(0);
        let td = time_ms(&real_dump.clone().array_head());
        let mut tried = Vec::new();
        for at in (model.now_ms().min(td)..=td).rev() {
            let mut view = model.fork();
            view.advance_to(at);
            let dump = view.command(&self.dump_cmd);
            if dumps_match(&real_dump, &dump, &self.keys, 0).is_some_and(|adopt| adopt.is_empty()) {
                return Ok(());
            }
            tried.push(format!("at {at}: {dump}"));
        }
        Err(format!(
            "seed {}: {what}: the model's keys differ\noperations:\n  {}\nreal: {real_dump}\nmodel:\n  {}",
            self.seed,
            self.history.join("\n  "),
            tried.join("\n  ")
        ))
    }

    /// Runs the next operation on the real server and on the model running
    /// `sources`; `Err` describes a mismatch.
    fn step(
        &mut self,
        real: &mut Resp,
        sources: &[String],
        tally: &mut Tally,
    ) -> Result<(), String> {
        let seed = self.seed;
        let op = self.g.next_op();
        self.history.push(op.describe());
        match op {
            Op::Pause(ms) => {
                std::thread::sleep(Duration::from_millis(ms));
                return Ok(());
            }
            Op::ToEdge { keys, n, offset } => {
                wait_for_edge(&self.model, &keys, n, offset);
                return Ok(());
            }
            _ => {}
        }
        let replies = real.pipeline(&[
            argv(&["TIME"]),
            op.argv(&self.shipped),
            argv(&["TIME"]),
            self.dump_cmd.clone(),
        ]);
        let (t0, real_reply, t1, real_dump) = (
            time_ms(&replies[0]),
            &replies[1],
            time_ms(&replies[2]),
            &replies[3],
        );
        let td = time_ms(&replies[3].clone().array_head());
        let model_argv = op.argv(sources);
        let mut matched = None;
        let mut tried = Vec::new();
        // Every instant of the real operation, each also as a script whose
        // clock moves on to a later instant of it before one of its
        // commands; exact expiries first.
        let mut candidates: Vec<(i64, Option<(usize, i64)>)> = Vec::new();
        for t in t0.max(self.model.now_ms())..=t1 {
            candidates.push((t, None));
            if t < t1 && matches!(op, Op::Script { .. }) {
                let mut probe = self.model.fork();
                probe.advance_to(t);
                probe.command(&model_argv);
                for by in 1..=t1 - t {
                    candidates.extend((0..=probe.last_script_calls()).map(|k| (t, Some((k, by)))));
                }
            }
        }
        // Expiries 1 ms apart only if the real operation spanned more than one
        // millisecond boundary (a script descheduled on a loaded machine),
        // where its clock may have moved more than once.
        let tolerances: &[i64] = if t1 - t0 >= 2 { &[0, 1] } else { &[0] };
        'tolerance: for &tolerance in tolerances {
            for &(t, straddle) in &candidates {
                let mut fork = self.model.fork();
                fork.advance_to(t);
                if let Some((k, by)) = straddle {
                    fork.straddle_next_script(k, by);
                }
                let reply = fork.command(&model_argv);
                let at = match straddle {
                    Some((k, by)) => format!("at {t}, {by} ms later from command {k}"),
                    None => format!("at {t}"),
                };
                if &reply != real_reply {
                    if tolerance == 0 {
                        tried.push(format!("{at}: {reply}"));
                    }
                    continue;
                }
                // The dump decides expiries when it starts: after the second
                // TIME, at or before the TIME it reads (later if the server
                // was descheduled in between).
                for dump_at in (t1.max(fork.now_ms())..=td).rev() {
                    let mut after = fork.fork();
                    after.advance_to(dump_at);
                    let dump = after.command(&self.dump_cmd);
                    match dumps_match(real_dump, &dump, &self.keys, tolerance) {
                        Some(adopt) => {
                            for (key, at) in adopt {
                                let mut entry = after.entry(&key).cloned().expect("a dumped key");
                                entry.expire_at = Some(at);
                                after.put(&key, Some(entry));
                                tally.adopted += 1;
                            }
                            matched = Some(after);
                            break 'tolerance;
                        }
                        None if tolerance == 0 => {
                            tried.push(format!("{at}, dumped at {dump_at}: {dump}"));
                        }
                        None => {}
                    }
                }
            }
        }
        tally.ops += 1;
        if let Op::Script { script, .. } = &op {
            let entry = tally.scripts.entry(SHIPPED[*script].0).or_default();
            entry.0 += 1;
            entry.1 += usize::from(!real_reply.is_error());
        }
        match matched {
            Some(next) => self.model = next,
            None => {
                return Err(format!(
                    "seed {seed}: the model disagrees with redis-server on operation {}\n\
                 operations:\n  {}\nreal (TIME {t0}..={t1}): {real_reply}\nreal dump (TIME {td}): {real_dump}\n\
                 model:\n  {}",
                    self.history.len(),
                    self.history.join("\n  "),
                    tried.join("\n  ")
                ));
            }
        }
        self.g.learn(&op, real_reply);
        self.g.now = td;
        Ok(())
    }
}

/// Runs one sequence on the real server and on a model running `sources`;
/// `Err` describes the first mismatch.
fn run_case(
    seed: u64,
    real: &mut Resp,
    sources: &[String],
    tally: &mut Tally,
) -> Result<(), String> {
    let mut case = Case::start(seed, real);
    for _ in 0..OPS_PER_CASE {
        case.step(real, sources, tally)?;
    }
    Ok(())
}

/// Sleeps until the machine's clock (which the local server's `TIME` reads)
/// is a little past the start of the millisecond `offset` after the `n`-th
/// expiry time ahead in the model among `keys` (their expiries and their
/// sorted-set scores, up to 40 ms ahead); does nothing if there is none.
fn wait_for_edge(model: &ModelServer, keys: &[String], n: usize, offset: i64) {
    let now = model.now_ms();
    let mut edges: Vec<i64> = Vec::new();
    for key in keys {
        let Some(entry) = model.entry(key) else {
            continue;
        };
        edges.extend(entry.expire_at);
        if let model::Value::ZSet(z) = &entry.value {
            edges.extend(
                z.iter()
                    .filter(|(_, score)| score.abs() < 1e15)
                    .map(|(_, score)| score.ceil() as i64),
            );
        }
    }
    edges.retain(|&at| at > now - 2 && at <= now + 40);
    edges.sort_unstable();
    edges.dedup();
    let Some(&at) = edges.get(n % edges.len().max(1)) else {
        return;
    };
    let target = Duration::from_millis((at + offset) as u64) + Duration::from_micros(150);
    loop {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970");
        if wall >= target {
            return;
        }
        std::thread::sleep((target - wall).min(Duration::from_millis(5)));
    }
}

trait ArrayHead {
    /// The dump's first two elements (the `TIME` it read) as a `TIME` reply.
    fn array_head(self) -> Reply;
}

impl ArrayHead for Reply {
    fn array_head(self) -> Reply {
        match self {
            Reply::Array(mut items) => {
                items.truncate(2);
                Reply::Array(items)
            }
            other => panic!("the dump answered {other}"),
        }
    }
}

/// `RESPIRE_DIFF_CASES`, or `default` sequences.
fn cases(default: u64) -> u64 {
    std::env::var("RESPIRE_DIFF_CASES")
        .ok()
        .map_or(default, |n| {
            n.parse().expect("RESPIRE_DIFF_CASES is a number")
        })
}

/// The seeds of a run: `RESPIRE_DIFF_SEED` alone, or `cases` fresh ones.
fn seeds(salt: u64, cases: u64) -> Vec<u64> {
    if let Ok(seed) = std::env::var("RESPIRE_DIFF_SEED") {
        return vec![seed.parse().expect("RESPIRE_DIFF_SEED is a number")];
    }
    let base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ salt;
    let mut rng = Rng::new(base);
    (0..cases).map(|_| rng.next() >> 16).collect()
}

fn shipped_sources() -> Vec<String> {
    SHIPPED.iter().map(|(_, s)| (*s).to_owned()).collect()
}

#[test]
fn every_shipped_script_is_covered() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/scripts");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .expect("src/scripts")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".lua"))
        .collect();
    on_disk.sort();
    let mut covered: Vec<String> = SHIPPED.iter().map(|(n, _)| (*n).to_owned()).collect();
    covered.sort();
    assert_eq!(
        on_disk, covered,
        "every shipped script needs a generator here"
    );
}

#[test]
fn the_model_answers_every_operation_as_redis_server_does() {
    let mut real = Resp::connect(support::shared_server());
    let sources = shipped_sources();
    let mut tally = Tally::default();
    let started = Instant::now();
    let seeds = seeds(0x5eed, cases(DEFAULT_CASES));
    for &seed in &seeds {
        if let Err(mismatch) = run_case(seed, &mut real, &sources, &mut tally) {
            panic!("{mismatch}");
        }
    }
    eprintln!(
        "{} sequences, {} operations in {:.1?}; {} expiries taken from the real server \
         (1 ms apart)",
        seeds.len(),
        tally.ops,
        started.elapsed(),
        tally.adopted
    );
    if std::env::var("RESPIRE_DIFF_SEED").is_err() {
        for (file, _) in SHIPPED {
            let (runs, answered) = tally.scripts.get(file).copied().unwrap_or_default();
            assert!(
                runs > 0 && answered > 0,
                "{file}: {runs} runs, {answered} without an error"
            );
        }
    }
}

/// A field of `INFO`.
fn info_field(real: &mut Resp, field: &str) -> String {
    let reply = real.pipeline(&[argv(&["INFO"])]).remove(0);
    let Reply::Bulk(text) = reply else {
        panic!("INFO answered {reply}");
    };
    String::from_utf8_lossy(&text)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")).map(str::to_owned))
        .unwrap_or_default()
}

#[test]
fn replication_restart_and_promotion_match_redis_servers() {
    let primary = support::TestServer::builder().append_only().start();
    let replica = support::TestServer::builder()
        .args(["--replicaof", "127.0.0.1", &primary.port().to_string()])
        .start();
    let mut to_primary = Resp::connect(&primary);
    let mut to_replica = Resp::connect(&replica);
    support::wait_until(Duration::from_secs(10), "the replica to sync", || {
        info_field(&mut to_replica, "master_link_status") == "up"
    });
    let sources = shipped_sources();
    let mut tally = Tally::default();
    let mut last = None;
    for seed in seeds(0xd1ff, (cases(DEFAULT_CASES) / 25).max(2)) {
        let mut case = Case::start(seed, &mut to_primary);
        // The real replica holds what the primary held: the model's starts
        // as a copy.
        case.model.add_replica();
        for _ in 0..OPS_PER_CASE {
            if let Err(mismatch) = case.step(&mut to_primary, &sources, &mut tally) {
                panic!("{mismatch}");
            }
        }
        let acked = to_primary
            .pipeline(&[argv(&["WAIT", "1", "10000"])])
            .remove(0);
        assert_eq!(acked, Reply::Int(1), "the replica did not acknowledge");
        case.model.replicate(usize::MAX);
        let mut replica_view = case.model.fork();
        let _ = replica_view.promote();
        if let Err(mismatch) = case.compare_dump(&mut to_replica, &replica_view, "on the replica") {
            panic!("{mismatch}");
        }
        last = Some(case);
    }
    let mut case = last.expect("a sequence ran");

    // A restart with the append-only file keeps every key and its expiry,
    // under a new run_id.
    let run_id = info_field(&mut to_primary, "run_id");
    let model_run_id = case.model.run_id().to_owned();
    primary.restart();
    case.model.restart(model::Persistence::Aof);
    let mut to_primary = Resp::connect(&primary);
    assert_ne!(info_field(&mut to_primary, "run_id"), run_id);
    assert_ne!(case.model.run_id(), model_run_id);
    if let Err(mismatch) = case.compare_dump(&mut to_primary, &case.model, "after a restart") {
        panic!("{mismatch}");
    }

    // Promotion: the replica becomes a primary with what it had applied.
    support::wait_until(Duration::from_secs(10), "the replica to sync again", || {
        info_field(&mut to_replica, "master_link_status") == "up"
    });
    let acked = to_primary
        .pipeline(&[argv(&["WAIT", "1", "10000"])])
        .remove(0);
    assert_eq!(acked, Reply::Int(1), "the replica did not acknowledge");
    case.model.replicate(usize::MAX);
    let replica_run_id = info_field(&mut to_replica, "run_id");
    let reply = to_replica
        .pipeline(&[argv(&["REPLICAOF", "NO", "ONE"])])
        .remove(0);
    assert_eq!(reply, Reply::Status("OK".into()));
    let _old = case.model.promote();
    assert_eq!(info_field(&mut to_replica, "role"), "master");
    assert_eq!(info_field(&mut to_replica, "run_id"), replica_run_id);
    if let Err(mismatch) = case.compare_dump(&mut to_replica, &case.model, "after promotion") {
        panic!("{mismatch}");
    }
}

/// Scripts beyond the shipped ones, each on its own keys, for Redis's Lua
/// conversions and error texts: what a future script may rely on.
const SNIPPETS: &[&str] = &[
    "return {1, 2.7, -2.7, true, false, 'x', nil, 5}",
    "return {1, {2, {3, 'x'}}, {}}",
    "return 3.99",
    "return -0.5",
    "return 1/0",
    "return 0/0",
    "return 2^63",
    "return {ok='fine'}",
    "return redis.status_reply('fine')",
    "return redis.error_reply('BADARG foo')",
    "return redis.error_reply('foo')",
    "return redis.error_reply('-X foo')",
    "return redis.error_reply('BADARG')",
    "return {err='ybar'}",
    "return {err='y bar', ok='no'}",
    "return nil",
    "return false",
    "return true",
    "redis.call('SET', KEYS[1], 'x') return redis.call('HGET', KEYS[1], 'f')",
    "redis.call('SET', KEYS[1], 'x') return redis.pcall('HGET', KEYS[1], 'f')",
    "redis.call('SET', KEYS[1], 'x')\nlocal r = redis.pcall('INCR', KEYS[1])\nreturn {type(r), r.err}",
    "return redis.call('SET', KEYS[1], 'v', 'PX', 'abc')",
    "return redis.call('SET', KEYS[1], 'v', 'PX', 0)",
    "return redis.call('SET', KEYS[1], 'v', 'NX', 'GET')",
    "return redis.call('NOSUCH')",
    "return redis.call('GET')",
    "return redis.call('GET', true)",
    "return redis.call('GET', {})",
    "local t = nil; return t.x",
    "error('boom')",
    "error({err='X boom'})",
    "x = 5",
    "return undefined_global",
    "redis.call('SET', KEYS[1], 123456789012345678) return redis.call('GET', KEYS[1])",
    "redis.call('SET', KEYS[1], 1.5) return redis.call('GET', KEYS[1])",
    "redis.call('SET', KEYS[1], -0.0) return redis.call('GET', KEYS[1])",
    "redis.call('ZADD', KEYS[1], 1e20, 'a', 0.1, 'b', 1e15 + 0.5, 'c') \
     return redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')",
    "return redis.call('ZADD', KEYS[1], 'nan', 'a')",
    "return redis.call('ZADD', KEYS[1], 'XX', 'NX', 1, 'a')",
    "return redis.call('ZADD', KEYS[1], 'GT', 'LT', 1, 'a')",
    "return redis.call('ZRANGEBYSCORE', KEYS[1], 'x', 1)",
    "redis.call('ZADD', KEYS[1], 1, 'a', 2, 'b', 3, 'c') \
     return {redis.call('ZRANGEBYSCORE', KEYS[1], '(1', '+inf', 'LIMIT', 1, 5), \
     redis.call('ZRANGE', KEYS[1], -2, 10), redis.call('ZREMRANGEBYSCORE', KEYS[1], '(1', 2), \
     redis.call('ZCARD', KEYS[1])}",
    "redis.call('HSET', KEYS[1], 'b', 1, 'a', 2) redis.call('HDEL', KEYS[1], 'b') \
     redis.call('HSET', KEYS[1], 'b', 3) return redis.call('HGETALL', KEYS[1])",
    "redis.call('HSET', KEYS[1], 'f', 'x') return redis.pcall('HINCRBY', KEYS[1], 'f', 1)",
    "redis.call('HSET', KEYS[1], 'f', '9223372036854775807') \
     return redis.pcall('HINCRBY', KEYS[1], 'f', 1)",
    "redis.call('SET', KEYS[1], '9223372036854775807') return redis.pcall('INCR', KEYS[1])",
    "redis.call('SET', KEYS[1], ' 1') return redis.pcall('INCR', KEYS[1])",
    "return {redis.call('SETBIT', KEYS[1], 9, 1), redis.call('GET', KEYS[1]), \
     redis.call('BITPOS', KEYS[1], 1), redis.call('BITPOS', KEYS[1], 0), \
     redis.call('GETBIT', KEYS[1], 9)}",
    "return redis.pcall('SETBIT', KEYS[1], -1, 1)",
    "return redis.pcall('SETBIT', KEYS[1], 1, 2)",
    "redis.call('SET', KEYS[1], '') return {redis.call('BITPOS', KEYS[1], 0), \
     redis.call('BITPOS', KEYS[1], 1)}",
    "redis.call('SET', KEYS[1], 'v') return {redis.call('PEXPIRE', KEYS[1], 100, 'XX'), \
     redis.call('PEXPIRE', KEYS[1], 100, 'NX'), redis.call('PEXPIRE', KEYS[1], 50, 'GT'), \
     redis.call('PEXPIRE', KEYS[1], 50, 'LT'), redis.call('PTTL', KEYS[1])}",
    "return redis.pcall('PEXPIRE', KEYS[1], 100, 'NX', 'XX')",
    "redis.call('SET', KEYS[1], 'v') \
     return {redis.call('PEXPIRE', KEYS[1], 0), redis.call('EXISTS', KEYS[1])}",
    "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) \
     redis.call('SET', KEYS[1], 'v') \
     return {redis.call('PEXPIREAT', KEYS[1], now), redis.call('EXISTS', KEYS[1])}",
    "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) \
     return {redis.call('SET', KEYS[1], 'v', 'PXAT', now), redis.call('EXISTS', KEYS[1]), \
     redis.call('PTTL', KEYS[1]), redis.call('PEXPIRETIME', KEYS[1]) - now}",
    "return redis.pcall('PEXPIRE', KEYS[1], 9223372036854775807)",
    "return {redis.call('TYPE', KEYS[1]), redis.call('EXISTS', KEYS[1], KEYS[1]), \
     redis.call('PEXPIRETIME', KEYS[1]), redis.call('PTTL', KEYS[1])}",
    "return redis.call('HMGET', KEYS[1], 'a', 'b')",
    "return redis.sha1hex('abc')",
    "return tostring(12345678901234567)",
    "return string.format('%d', 2^53 + 1)",
];

#[test]
fn lua_conversions_and_errors_match_redis_server() {
    let mut real = Resp::connect(support::shared_server());
    let now = time_ms(&real.pipeline(&[argv(&["TIME"])])[0]);
    let mut model = ModelServer::new(9, now);
    for (i, snippet) in SNIPPETS.iter().enumerate() {
        let key = format!("{{snip}}{i}:{}", std::process::id());
        let command = |source: &str| argv(&["EVAL", source, "1", &key]);
        let got = real.pipeline(&[argv(&["DEL", &key]), command(snippet)]);
        let model_reply = model.command(&command(snippet));
        assert_eq!(model_reply, got[1], "{snippet}");
    }
}

/// A copy of one shipped script with one change, run by the model only.
fn mutated(file: &str, from: &str, to: &str) -> Vec<String> {
    let mut sources = shipped_sources();
    let i = script_index(file);
    assert!(sources[i].contains(from), "{file} has no {from:?}");
    sources[i] = sources[i].replacen(from, to, 1);
    sources
}

/// Runs sequences (up to [`PLANTED_BUDGET`]) until the model with `sources`
/// disagrees with the real server; the mismatch found, if any.
fn first_mismatch(sources: &[String], salt: u64) -> Option<String> {
    let mut real = Resp::connect(support::shared_server());
    let mut tally = Tally::default();
    let found = seeds(salt, cases(DEFAULT_CASES).max(PLANTED_BUDGET))
        .into_iter()
        .enumerate()
        .find_map(|(i, seed)| {
            run_case(seed, &mut real, sources, &mut tally)
                .err()
                .map(|e| (i, e))
        });
    let (i, mismatch) = found?;
    let first_line = mismatch.lines().next().unwrap_or_default().to_owned();
    eprintln!(
        "caught in sequence {} after {} operations: {first_line}",
        i + 1,
        tally.ops
    );
    Some(mismatch)
}

#[test]
fn a_model_whose_script_returns_a_wrong_remaining_time_is_caught() {
    let sources = mutated(
        "fenced_acquire.lua",
        "return {0, redis.call('PTTL', KEYS[1])}",
        "return {0, redis.call('PTTL', KEYS[1]) + 1}",
    );
    let found = first_mismatch(&sources, 1);
    assert!(found.is_some(), "a wrong busy reply went unseen");
}

#[test]
fn a_model_whose_script_prunes_one_millisecond_late_is_caught() {
    let sources = mutated(
        "sem_acquire.lua",
        "redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))",
        "redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now - 1))",
    );
    let found = first_mismatch(&sources, 2);
    assert!(
        found.is_some(),
        "a permit pruned a millisecond late went unseen"
    );
}

#[test]
fn a_model_whose_script_sets_an_expiry_1_ms_late_is_caught() {
    let sources = mutated(
        "rw_write_acquire.lua",
        "redis.call('SET', KEYS[1], owner .. ':' .. token, 'PX', ARGV[2])",
        "redis.call('SET', KEYS[1], owner .. ':' .. token, 'PX', ARGV[2] + 1)",
    );
    let found = first_mismatch(&sources, 3);
    assert!(found.is_some(), "a writer lease 1 ms too long went unseen");
}
