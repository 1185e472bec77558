//! The fake's one thread of state: the model server, every connection to
//! every port, the faults under way. Acceptor and reader threads only turn
//! sockets into [`Event`]s; everything that answers runs here, in the order
//! the events arrive (per connection, the order its commands were sent).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::io::{BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::resp;
use crate::clock::Clock;
use crate::sim::model::{ModelServer, Persistence, Reply};

/// How often the thread looks at the clock when nothing happens: keys
/// expire (and their invalidations go out) at most this late, as a real
/// server's active expiry does within its cycle.
const TICK: Duration = Duration::from_millis(5);
const INVALIDATE: &[u8] = b"__redis__:invalidate";
const SWITCH_MASTER: &[u8] = b"+switch-master";
const READONLY: &str = "READONLY You can't write against a read only replica.";

/// What a port serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Port {
    /// The first data server.
    DataA,
    /// The second data server (with a sentinel only).
    DataB,
    /// The sentinel.
    Sentinel,
}

/// What the acceptor and reader threads, and the handle, tell the thread.
pub(super) enum Event {
    Accepted {
        port: Port,
        conn: u64,
        stream: TcpStream,
    },
    Command {
        conn: u64,
        argv: Vec<Vec<u8>>,
    },
    Closed {
        conn: u64,
    },
    Control(Box<dyn FnOnce(&mut World) + Send>),
}

/// `CLIENT TRACKING` of one connection.
#[derive(Clone, Copy, Debug)]
struct Tracking {
    redirect: u64,
    optin: bool,
}

/// One client connection.
struct Conn {
    port: Port,
    stream: TcpStream,
    /// The id `CLIENT ID` answers: the model server's on the primary's port.
    id: u64,
    peer: String,
    local: String,
    name: Option<Vec<u8>>,
    resp3: bool,
    tracking: Option<Tracking>,
    /// `CLIENT CACHING yes` was the last command (`OPTIN` tracking).
    caching: bool,
    subscribed: BTreeSet<Vec<u8>>,
    /// The commands queued since `MULTI`.
    multi: Option<Vec<Vec<Vec<u8>>>>,
    /// A reply it was sent was dropped: it hears nothing more, and its
    /// commands are not run (a connection cut the client has not noticed).
    mute: bool,
    /// Replies not yet written, each with the instant it may go.
    outbox: VecDeque<(Instant, Vec<u8>)>,
}

/// Faults on the replies to commands that touch keys.
#[derive(Default)]
struct ReplyFaults {
    drop: usize,
    delay: usize,
    delay_by: Duration,
}

/// Everything the thread owns.
pub(super) struct World {
    model: ModelServer,
    /// The port the primary serves on (the other data port, if any, serves
    /// as its replica).
    primary: Port,
    sentinel: Option<String>,
    ports: BTreeMap<Port, u16>,
    conns: HashMap<u64, Conn>,
    /// Keys read with tracking on, and the connections that read them.
    tracked: HashMap<Vec<u8>, BTreeSet<u64>>,
    /// Ids `CLIENT ID` gives connections to the replica's port and the
    /// sentinel's.
    next_side_id: u64,
    started: Instant,
    /// The monotonic clock the fake's own clock runs with, and reply delays
    /// are timed by.
    clock: Arc<dyn Clock>,
    base_ms: i64,
    /// The server clock when the primary's process last started.
    up_since_ms: i64,
    offset_ms: i64,
    paused: bool,
    pending: VecDeque<(u64, Vec<Vec<u8>>)>,
    replication_held: bool,
    faults: ReplyFaults,
    stop: bool,
}

fn lower(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).to_ascii_lowercase()
}

fn error(text: impl Into<String>) -> Reply {
    Reply::Error(text.into())
}

fn ok() -> Reply {
    Reply::Status("OK".to_owned())
}

/// Whether the reply faults apply to `name`: scripts and data commands,
/// not the connection's own business.
fn touches_keys(name: &str) -> bool {
    !matches!(
        name,
        "client"
            | "hello"
            | "auth"
            | "select"
            | "ping"
            | "echo"
            | "time"
            | "info"
            | "role"
            | "script"
            | "subscribe"
            | "unsubscribe"
            | "psubscribe"
            | "punsubscribe"
            | "quit"
            | "reset"
            | "sentinel"
            | "wait"
            | "dbsize"
            | "command"
            | "config"
            | "asking"
            | "readonly"
            | "readwrite"
            | "multi"
            | "discard"
    )
}

/// The keys a command names, tracked as read: a script's `KEYS` (all of
/// them, read or not), every argument of `EXISTS` and `DEL`, the first
/// argument of every other data command (each names one key). Too many keys
/// cost a waiter a spurious wake-up; a key missing would leave it asleep.
fn read_keys(name: &str, argv: &[Vec<u8>]) -> Vec<Vec<u8>> {
    match name {
        "eval" | "evalsha" | "eval_ro" | "evalsha_ro" => {
            let n = argv
                .get(2)
                .and_then(|n| std::str::from_utf8(n).ok()?.parse::<usize>().ok())
                .unwrap_or(0);
            argv.iter().skip(3).take(n).cloned().collect()
        }
        "exists" | "del" | "unlink" => argv.iter().skip(1).cloned().collect(),
        _ if touches_keys(name) => argv.get(1).cloned().into_iter().collect(),
        _ => Vec::new(),
    }
}

impl World {
    pub(super) fn new(seed: u64, sentinel: Option<String>, ports: BTreeMap<Port, u16>) -> World {
        let base_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let mut model = ModelServer::new(seed, base_ms);
        model.add_replica();
        let clock = crate::clock::system();
        World {
            model,
            primary: Port::DataA,
            sentinel,
            ports,
            conns: HashMap::new(),
            tracked: HashMap::new(),
            next_side_id: 1,
            started: clock.now(),
            clock,
            base_ms,
            up_since_ms: base_ms,
            offset_ms: 0,
            paused: false,
            pending: VecDeque::new(),
            replication_held: false,
            faults: ReplyFaults::default(),
            stop: false,
        }
    }

    // ----- controls (run on the thread, called through the handle) -----

    /// The server clock in milliseconds now.
    pub(super) fn now_ms(&self) -> i64 {
        self.base_ms
            + self
                .clock
                .now()
                .saturating_duration_since(self.started)
                .as_millis() as i64
            + self.offset_ms
    }

    pub(super) fn advance_clock(&mut self, by: Duration) {
        self.offset_ms += by.as_millis() as i64;
        // A paused server sees its clock when it runs again.
        if !self.paused {
            self.sync_clock();
            self.after_change();
        }
    }

    pub(super) fn pause(&mut self) {
        self.paused = true;
    }

    pub(super) fn resume(&mut self) {
        self.paused = false;
        self.sync_clock();
        while !self.paused {
            let Some((conn, argv)) = self.pending.pop_front() else {
                break;
            };
            self.command(conn, argv);
        }
        self.after_change();
    }

    pub(super) fn drop_replies(&mut self, n: usize) {
        self.faults.drop += n;
    }

    pub(super) fn delay_replies(&mut self, n: usize, by: Duration) {
        self.faults.delay = n;
        self.faults.delay_by = by;
    }

    pub(super) fn lose_key(&mut self, key: &[u8]) -> bool {
        self.sync_clock();
        let existed = self.model.exists(key);
        self.model.put(key, None);
        self.after_change();
        existed
    }

    pub(super) fn hold_replication(&mut self, held: bool) {
        self.replication_held = held;
        self.after_change();
    }

    pub(super) fn replication_lag(&self) -> usize {
        self.model.replication_lag()
    }

    pub(super) fn run_id(&self) -> String {
        self.model.run_id().to_owned()
    }

    pub(super) fn primary_port(&self) -> u16 {
        self.ports[&self.primary]
    }

    /// The replica takes over with what it had applied; a new replica is
    /// attached; every connection to a data port is cut.
    pub(super) fn fail_over(&mut self) {
        self.sync_clock();
        let old = self.model.promote();
        drop(old);
        self.up_since_ms = self.now_ms();
        self.model.add_replica();
        let from = self.primary;
        if self.ports.contains_key(&Port::DataB) {
            self.primary = match from {
                Port::DataA => Port::DataB,
                _ => Port::DataA,
            };
        }
        self.cut(|p| p != Port::Sentinel);
        if let Some(service) = self.sentinel.clone() {
            let payload = format!(
                "{service} 127.0.0.1 {} 127.0.0.1 {}",
                self.ports[&from], self.ports[&self.primary]
            );
            self.publish(Port::Sentinel, SWITCH_MASTER, payload.as_bytes());
        }
        self.flush();
    }

    /// Restarts the primary without persistence: no data, a new `run_id`,
    /// every connection to it cut.
    pub(super) fn restart(&mut self) {
        self.sync_clock();
        self.model.restart(Persistence::None);
        self.up_since_ms = self.now_ms();
        let primary = self.primary;
        self.cut(|p| p == primary);
    }

    pub(super) fn stop(&mut self) {
        self.stop = true;
        self.cut(|_| true);
    }

    // ----- the loop -----

    /// Runs until the handle is dropped or [`World::stop`].
    pub(super) fn run(mut self, events: &Receiver<Event>) {
        loop {
            let wait = self
                .conns
                .values()
                .filter_map(|c| c.outbox.front().map(|(due, _)| *due))
                .min()
                .map_or(TICK, |due| due.saturating_duration_since(self.clock.now()))
                .min(TICK);
            match events.recv_timeout(wait) {
                Ok(event) => {
                    self.handle(event);
                    while let Ok(event) = events.try_recv() {
                        self.handle(event);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            if self.stop {
                return;
            }
            if !self.paused {
                self.sync_clock();
                self.after_change();
            }
            self.flush();
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Accepted { port, conn, stream } => self.accept(port, conn, stream),
            Event::Command { conn, argv } => {
                if self.paused {
                    self.pending.push_back((conn, argv));
                } else {
                    self.command(conn, argv);
                }
            }
            Event::Closed { conn } => self.forget(conn),
            Event::Control(f) => f(self),
        }
    }

    fn accept(&mut self, port: Port, conn: u64, stream: TcpStream) {
        let id = if port == self.primary {
            self.model.connect()
        } else {
            self.next_side_id += 1;
            1_000_000 + self.next_side_id
        };
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let local = stream
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let _ = stream.set_nodelay(true);
        // A client that stops reading is disconnected, as by a server's
        // output buffer limit, rather than stalling every other connection.
        let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
        self.conns.insert(
            conn,
            Conn {
                port,
                stream,
                id,
                peer,
                local,
                name: None,
                resp3: false,
                tracking: None,
                caching: false,
                subscribed: BTreeSet::new(),
                multi: None,
                mute: false,
                outbox: VecDeque::new(),
            },
        );
    }

    /// Closes a connection and forgets it (the model's too).
    fn forget(&mut self, conn: u64) {
        if let Some(c) = self.conns.remove(&conn) {
            let _ = c.stream.shutdown(Shutdown::Both);
            if c.port == self.primary {
                self.model.kill_client(c.id);
            }
        }
        self.tracked.retain(|_, readers| {
            readers.remove(&conn);
            !readers.is_empty()
        });
    }

    /// Cuts every connection to a port `which` selects.
    fn cut(&mut self, which: impl Fn(Port) -> bool) {
        let doomed: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| which(c.port))
            .map(|(k, _)| *k)
            .collect();
        for conn in doomed {
            self.forget(conn);
        }
    }

    fn sync_clock(&mut self) {
        let now = self.now_ms();
        if now > self.model.now_ms() {
            self.model.advance_to(now);
        }
    }

    /// Replicates (unless held) and sends the invalidations of the keys
    /// that changed.
    fn after_change(&mut self) {
        if !self.replication_held {
            self.model.replicate(usize::MAX);
        }
        for key in self.model.take_invalidated() {
            let Some(readers) = self.tracked.remove(&key) else {
                continue;
            };
            for reader in readers {
                let Some(redirect) = self
                    .conns
                    .get(&reader)
                    .and_then(|c| c.tracking)
                    .map(|t| t.redirect)
                else {
                    continue;
                };
                let primary = self.primary;
                let target = self.conns.iter_mut().find(|(_, c)| {
                    c.port == primary && c.id == redirect && c.subscribed.contains(INVALIDATE)
                });
                if let Some((_, c)) = target {
                    let mut out = Vec::new();
                    resp::aggregate(&mut out, if c.resp3 { b'>' } else { b'*' }, 3);
                    resp::bulk(&mut out, b"message");
                    resp::bulk(&mut out, INVALIDATE);
                    resp::aggregate(&mut out, b'*', 1);
                    resp::bulk(&mut out, &key);
                    if !c.mute {
                        c.outbox.push_back((self.clock.now(), out));
                    }
                }
            }
        }
    }

    fn publish(&mut self, port: Port, channel: &[u8], payload: &[u8]) {
        for c in self.conns.values_mut() {
            if c.port == port && c.subscribed.contains(channel) && !c.mute {
                let mut out = Vec::new();
                resp::aggregate(&mut out, if c.resp3 { b'>' } else { b'*' }, 3);
                resp::bulk(&mut out, b"message");
                resp::bulk(&mut out, channel);
                resp::bulk(&mut out, payload);
                c.outbox.push_back((self.clock.now(), out));
            }
        }
    }

    /// Writes every reply that is due, in order per connection.
    fn flush(&mut self) {
        let now = self.clock.now();
        let mut broken = Vec::new();
        for (key, c) in &mut self.conns {
            while c.outbox.front().is_some_and(|(due, _)| *due <= now) {
                let (_, bytes) = c.outbox.pop_front().expect("looked at");
                if (&c.stream).write_all(&bytes).is_err() {
                    broken.push(*key);
                    break;
                }
            }
        }
        for conn in broken {
            self.forget(conn);
        }
    }

    // ----- commands -----

    fn command(&mut self, conn: u64, argv: Vec<Vec<u8>>) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        if c.mute {
            return;
        }
        self.sync_clock();
        let name = lower(&argv[0]);
        let mut out = Vec::new();
        if let Some(reply) = self.dispatch(conn, &name, &argv, &mut out) {
            let resp3 = self.conns.get(&conn).is_some_and(|c| c.resp3);
            encode_reply(&mut out, &name, &argv, &reply, resp3);
        }
        self.after_change();
        let mut due = self.clock.now();
        let mut dropped = false;
        if touches_keys(&name) {
            if self.faults.drop > 0 {
                self.faults.drop -= 1;
                dropped = true;
            } else if self.faults.delay > 0 {
                self.faults.delay -= 1;
                due += self.faults.delay_by;
            }
        }
        if let Some(c) = self.conns.get_mut(&conn) {
            if dropped {
                c.mute = true;
                c.outbox.clear();
            } else if !out.is_empty() {
                c.outbox.push_back((due, out));
            }
        }
        self.flush();
    }

    /// Answers one command: a reply to encode, or `None` when the answer was
    /// written to `out` already (or there is none).
    fn dispatch(
        &mut self,
        conn: u64,
        name: &str,
        argv: &[Vec<u8>],
        out: &mut Vec<u8>,
    ) -> Option<Reply> {
        let c = self.conns.get_mut(&conn)?;
        let caching = std::mem::take(&mut c.caching);
        if !c.subscribed.is_empty()
            && !matches!(
                name,
                "subscribe" | "unsubscribe" | "psubscribe" | "punsubscribe" | "ping" | "quit"
            )
            && !c.resp3
        {
            return Some(error(format!(
                "ERR Can't execute '{name}': only (P|S)SUBSCRIBE / (P|S)UNSUBSCRIBE / PING / \
                 QUIT / RESET are allowed in this context"
            )));
        }
        if let Some(queued) = c.multi.as_mut() {
            match name {
                "exec" => return self.exec(conn, out),
                "discard" => {
                    c.multi = None;
                    return Some(ok());
                }
                "multi" => return Some(error("ERR MULTI calls can not be nested")),
                _ => {
                    queued.push(argv.to_vec());
                    return Some(Reply::Status("QUEUED".to_owned()));
                }
            }
        }
        match name {
            "multi" => {
                c.multi = Some(Vec::new());
                return Some(ok());
            }
            "exec" => return Some(error("ERR EXEC without MULTI")),
            "discard" => return Some(error("ERR DISCARD without MULTI")),
            "hello" => return self.hello(conn, argv, out),
            "client" => return Some(self.client(conn, argv)),
            "select" => {
                return Some(match argv.get(1).map(Vec::as_slice) {
                    Some(b"0") if argv.len() == 2 => ok(),
                    _ => error("ERR DB index is out of range"),
                });
            }
            "auth" => {
                return Some(error(
                    "ERR AUTH <password> called without any password configured for the default \
                     user. Are you sure your configuration is correct?",
                ));
            }
            "quit" => {
                self.forget(conn);
                return None;
            }
            "subscribe" | "unsubscribe" => return self.subscribe(conn, name, argv, out),
            "ping" if !c.subscribed.is_empty() && !c.resp3 => {
                resp::aggregate(out, b'*', 2);
                resp::bulk(out, b"pong");
                resp::bulk(out, argv.get(1).map_or(&b""[..], Vec::as_slice));
                return None;
            }
            _ => {}
        }
        let port = c.port;
        if port == Port::Sentinel {
            return Some(self.sentinel_command(name, argv));
        }
        if port != self.primary {
            return Some(match name {
                "ping" => Reply::Status("PONG".to_owned()),
                "role" => Reply::Array(vec![
                    Reply::Bulk(b"slave".to_vec()),
                    Reply::Bulk(b"127.0.0.1".to_vec()),
                    Reply::Int(i64::from(self.primary_port())),
                    Reply::Bulk(b"connected".to_vec()),
                    Reply::Int(0),
                ]),
                "info" => Reply::Bulk(
                    b"# Server\r\nredis_version:7.0.15\r\n\r\n# Replication\r\nrole:slave\r\n"
                        .to_vec(),
                ),
                _ => error(READONLY),
            });
        }
        let id = c.id;
        let track = c.tracking.is_some_and(|t| !t.optin || caching);
        let reply = self.model.command_from(id, argv)?;
        let reply = match (name, reply) {
            ("info", Reply::Bulk(text)) => Reply::Bulk(self.server_info(&text)),
            (_, reply) => reply,
        };
        if track {
            for key in read_keys(name, argv) {
                self.tracked.entry(key).or_default().insert(conn);
            }
        }
        Some(reply)
    }

    /// The model's `INFO` with what a real server also says of its process
    /// in `# Server`: mode, port, uptime (since the last restart or
    /// failover, on the server's clock).
    fn server_info(&self, text: &[u8]) -> Vec<u8> {
        let header = b"# Server\r\n";
        let Some(at) = text.windows(header.len()).position(|w| w == header) else {
            return text.to_vec();
        };
        let uptime = (self.now_ms() - self.up_since_ms).max(0) / 1000;
        let fields = format!(
            "redis_mode:standalone\r\nprocess_id:{}\r\ntcp_port:{}\r\n\
             uptime_in_seconds:{uptime}\r\nuptime_in_days:{}\r\n",
            std::process::id(),
            self.primary_port(),
            uptime / 86_400
        );
        let mut out = text[..at + header.len()].to_vec();
        out.extend_from_slice(fields.as_bytes());
        out.extend_from_slice(&text[at + header.len()..]);
        out
    }

    /// `EXEC`: the queued commands one after another, nothing between them
    /// (the thread runs nothing else meanwhile), their replies in one array.
    fn exec(&mut self, conn: u64, out: &mut Vec<u8>) -> Option<Reply> {
        let queued = self.conns.get_mut(&conn)?.multi.take()?;
        let mut replies = Vec::new();
        for argv in &queued {
            let name = lower(&argv[0]);
            let mut written = Vec::new();
            if let Some(reply) = self.dispatch(conn, &name, argv, &mut written) {
                let resp3 = self.conns.get(&conn).is_some_and(|c| c.resp3);
                encode_reply(&mut written, &name, argv, &reply, resp3);
            }
            replies.push(written);
        }
        resp::aggregate(out, b'*', replies.len());
        for reply in replies {
            out.extend_from_slice(&reply);
        }
        None
    }

    fn hello(&mut self, conn: u64, argv: &[Vec<u8>], out: &mut Vec<u8>) -> Option<Reply> {
        let mut resp3 = self.conns.get(&conn)?.resp3;
        let mut rest = argv.iter().skip(1);
        if let Some(version) = rest.next() {
            match version.as_slice() {
                b"2" => resp3 = false,
                b"3" => resp3 = true,
                _ => return Some(error("NOPROTO unsupported protocol version")),
            }
        }
        let mut name = None;
        while let Some(option) = rest.next() {
            match lower(option).as_str() {
                "auth" => {
                    return Some(error(
                        "WRONGPASS invalid username-password pair or user is disabled.",
                    ));
                }
                "setname" => name = rest.next().cloned(),
                _ => return Some(error("ERR Syntax error in HELLO option")),
            }
        }
        let mode = if self.conns.get(&conn)?.port == Port::Sentinel {
            "sentinel"
        } else {
            "standalone"
        };
        let role = if self.conns.get(&conn)?.port == self.primary {
            "master"
        } else {
            "replica"
        };
        let c = self.conns.get_mut(&conn)?;
        c.resp3 = resp3;
        if name.is_some() {
            c.name = name;
        }
        let id = c.id;
        resp::aggregate(
            out,
            if resp3 { b'%' } else { b'*' },
            if resp3 { 7 } else { 14 },
        );
        for (field, value) in [
            ("server", "redis"),
            ("version", "7.0.15"),
            ("proto", if resp3 { "3" } else { "2" }),
            ("id", ""),
            ("mode", mode),
            ("role", role),
            ("modules", ""),
        ] {
            resp::bulk(out, field.as_bytes());
            match field {
                "proto" => resp::int(out, if resp3 { 3 } else { 2 }),
                "id" => resp::int(out, id as i64),
                "modules" => resp::aggregate(out, b'*', 0),
                _ => resp::bulk(out, value.as_bytes()),
            }
        }
        None
    }

    fn client(&mut self, conn: u64, argv: &[Vec<u8>]) -> Reply {
        let sub = argv.get(1).map(|s| lower(s)).unwrap_or_default();
        let primary = self.primary;
        let Some(c) = self.conns.get_mut(&conn) else {
            return error("ERR the connection is gone");
        };
        match (sub.as_str(), argv.len()) {
            ("id", 2) => Reply::Int(c.id as i64),
            ("setname", 3) => {
                if argv[2].iter().any(|b| *b <= b' ' || *b > b'~') {
                    return error(
                        "ERR Client names cannot contain spaces, newlines or special characters.",
                    );
                }
                c.name = (!argv[2].is_empty()).then(|| argv[2].clone());
                ok()
            }
            ("getname", 2) => c.name.clone().map_or(Reply::Nil, Reply::Bulk),
            ("setinfo", 4) => ok(),
            ("info", 2) => Reply::Bulk(client_line(c).into_bytes()),
            ("list", 2) => {
                let port = c.port;
                let mut conns: Vec<&Conn> =
                    self.conns.values().filter(|o| o.port == port).collect();
                conns.sort_by_key(|o| o.id);
                Reply::Bulk(
                    conns
                        .into_iter()
                        .map(client_line)
                        .collect::<String>()
                        .into_bytes(),
                )
            }
            ("caching", 3) => match (c.tracking, lower(&argv[2]).as_str()) {
                (Some(t), "yes") if t.optin => {
                    c.caching = true;
                    ok()
                }
                (None, _) => error(
                    "ERR CLIENT CACHING can be called only when the client is in tracking mode \
                     with OPTIN or OPTOUT mode enabled",
                ),
                _ => error("ERR syntax error"),
            },
            ("tracking", n) if n >= 3 => {
                let mut redirect = None;
                let mut optin = false;
                let mut options = argv[3..].iter();
                while let Some(option) = options.next() {
                    match lower(option).as_str() {
                        "redirect" => {
                            redirect = options
                                .next()
                                .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok());
                            if redirect.is_none() {
                                return error("ERR value is not an integer or out of range");
                            }
                        }
                        "optin" => optin = true,
                        "noloop" | "bcast" | "optout" => {}
                        _ => return error("ERR syntax error"),
                    }
                }
                match lower(&argv[2]).as_str() {
                    "on" => {
                        let own = c.id;
                        let redirect = redirect.unwrap_or(own);
                        let exists = redirect == own
                            || self
                                .conns
                                .values()
                                .any(|o| o.port == primary && o.id == redirect);
                        if !exists {
                            return error("ERR The client ID you want redirect to does not exist");
                        }
                        let c = self.conns.get_mut(&conn).expect("looked up above");
                        c.tracking = Some(Tracking { redirect, optin });
                        ok()
                    }
                    "off" => {
                        c.tracking = None;
                        for readers in self.tracked.values_mut() {
                            readers.remove(&conn);
                        }
                        ok()
                    }
                    _ => error("ERR syntax error"),
                }
            }
            ("kill", n) if n >= 4 => self.kill(conn, &argv[2..]),
            _ => error(format!(
                "ERR unknown subcommand '{}'. Try CLIENT HELP.",
                String::from_utf8_lossy(argv.get(1).map_or(&b""[..], Vec::as_slice))
            )),
        }
    }

    /// `CLIENT KILL` with `ID`, `ADDR` and `SKIPME` filters.
    fn kill(&mut self, conn: u64, filters: &[Vec<u8>]) -> Reply {
        let mut id = None;
        let mut addr = None;
        let mut skip_me = true;
        for pair in filters.chunks(2) {
            let [filter, value] = pair else {
                return error("ERR syntax error");
            };
            match lower(filter).as_str() {
                "id" => match std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                {
                    Some(v) if v > 0 => id = Some(v),
                    _ => return error("ERR client-id should be greater than 0"),
                },
                "addr" => addr = Some(String::from_utf8_lossy(value).into_owned()),
                "skipme" => skip_me = lower(value) == "yes",
                _ => return error("ERR syntax error"),
            }
        }
        let port = self.conns[&conn].port;
        let doomed: Vec<u64> = self
            .conns
            .iter()
            .filter(|(k, c)| {
                c.port == port
                    && id.is_none_or(|id| c.id == id)
                    && addr.as_ref().is_none_or(|a| *a == c.peer)
                    && !(skip_me && **k == conn)
            })
            .map(|(k, _)| *k)
            .collect();
        let killed = doomed.len();
        for victim in doomed {
            self.forget(victim);
        }
        Reply::Int(killed as i64)
    }

    fn subscribe(
        &mut self,
        conn: u64,
        name: &str,
        argv: &[Vec<u8>],
        out: &mut Vec<u8>,
    ) -> Option<Reply> {
        let c = self.conns.get_mut(&conn)?;
        let channels: Vec<Vec<u8>> = if argv.len() > 1 {
            argv[1..].to_vec()
        } else if name == "unsubscribe" {
            c.subscribed.iter().cloned().collect()
        } else {
            return Some(error(
                "ERR wrong number of arguments for 'subscribe' command",
            ));
        };
        let kind = if c.resp3 { b'>' } else { b'*' };
        for channel in channels {
            if name == "subscribe" {
                c.subscribed.insert(channel.clone());
            } else {
                c.subscribed.remove(&channel);
            }
            resp::aggregate(out, kind, 3);
            resp::bulk(out, name.as_bytes());
            resp::bulk(out, &channel);
            resp::int(out, c.subscribed.len() as i64);
        }
        None
    }

    fn sentinel_command(&mut self, name: &str, argv: &[Vec<u8>]) -> Reply {
        let service = self.sentinel.clone().unwrap_or_default();
        match name {
            "ping" => Reply::Status("PONG".to_owned()),
            "role" => Reply::Array(vec![
                Reply::Bulk(b"sentinel".to_vec()),
                Reply::Array(vec![Reply::Bulk(service.into_bytes())]),
            ]),
            "info" => {
                Reply::Bulk(b"# Server\r\nredis_version:7.0.15\r\nredis_mode:sentinel\r\n".to_vec())
            }
            "sentinel" => match argv.get(1).map(|s| lower(s)).as_deref() {
                Some("get-master-addr-by-name") if argv.len() == 3 => {
                    if argv[2] == service.as_bytes() {
                        Reply::Array(vec![
                            Reply::Bulk(b"127.0.0.1".to_vec()),
                            Reply::Bulk(self.primary_port().to_string().into_bytes()),
                        ])
                    } else {
                        Reply::Nil
                    }
                }
                _ => error("ERR Unknown sentinel subcommand"),
            },
            _ => error(format!(
                "ERR unknown command '{}', with args beginning with: ",
                String::from_utf8_lossy(&argv[0])
            )),
        }
    }
}

/// What `CLIENT INFO` and `CLIENT LIST` say of a connection: the fields a
/// client reads (`id`, `addr`, `name`), in a server's format.
fn client_line(c: &Conn) -> String {
    format!(
        "id={} addr={} laddr={} fd=8 name={} db=0 sub={} psub=0 flags={} resp={}\n",
        c.id,
        c.peer,
        c.local,
        String::from_utf8_lossy(c.name.as_deref().unwrap_or_default()),
        c.subscribed.len(),
        if c.tracking.is_some() { "t" } else { "N" },
        if c.resp3 { 3 } else { 2 }
    )
}

/// A reply to `argv` in the connection's protocol. RESP3 gives some
/// commands shapes of their own: `HGETALL` a map, `ZSCORE` a double, a
/// `WITHSCORES` range pairs of member and double.
fn encode_reply(out: &mut Vec<u8>, name: &str, argv: &[Vec<u8>], reply: &Reply, resp3: bool) {
    let double = |out: &mut Vec<u8>, score: &Reply| match score {
        Reply::Bulk(text) => {
            out.push(b',');
            out.extend_from_slice(text);
            out.extend_from_slice(b"\r\n");
        }
        other => resp::encode(out, other, true),
    };
    let with_scores = argv.iter().any(|a| a.eq_ignore_ascii_case(b"withscores"));
    match (resp3, name, reply) {
        (true, "hgetall", Reply::Array(items)) => {
            resp::aggregate(out, b'%', items.len() / 2);
            for item in items {
                resp::encode(out, item, true);
            }
        }
        (true, "zscore", score @ Reply::Bulk(_)) => double(out, score),
        (true, "zrange" | "zrangebyscore", Reply::Array(items)) if with_scores => {
            resp::aggregate(out, b'*', items.len() / 2);
            for pair in items.chunks(2) {
                resp::aggregate(out, b'*', 2);
                resp::encode(out, &pair[0], true);
                if let Some(score) = pair.get(1) {
                    double(out, score);
                }
            }
        }
        _ => resp::encode(out, reply, resp3),
    }
}

/// The threads behind one fake: the world's and one acceptor per port.
pub(super) struct Threads {
    pub(super) events: Sender<Event>,
    pub(super) world: Option<JoinHandle<()>>,
    pub(super) acceptors: Vec<(u16, JoinHandle<()>)>,
    pub(super) stopping: Arc<AtomicBool>,
}

/// Starts the world and its listeners: data ports (one, or two with a
/// sentinel) and the sentinel's port.
pub(super) fn start(sentinel: Option<String>) -> std::io::Result<Threads> {
    let mut wanted = vec![Port::DataA];
    if sentinel.is_some() {
        wanted.extend([Port::DataB, Port::Sentinel]);
    }
    let mut listeners = Vec::new();
    let mut ports = BTreeMap::new();
    for port in wanted {
        let listener = TcpListener::bind(("127.0.0.1", 0))?;
        ports.insert(port, listener.local_addr()?.port());
        listeners.push((port, listener));
    }
    let (events, rx) = crossbeam_channel::unbounded();
    let stopping = Arc::new(AtomicBool::new(false));
    let next_conn = Arc::new(AtomicU64::new(1));
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id());
    let world_ports = ports.clone();
    let world = std::thread::Builder::new()
        .name("respire-fake".into())
        .spawn(move || World::new(seed, sentinel, world_ports).run(&rx))?;
    let mut acceptors = Vec::new();
    for (port, listener) in listeners {
        let events = events.clone();
        let stopping = stopping.clone();
        let next_conn = next_conn.clone();
        let number = ports[&port];
        let handle = std::thread::Builder::new()
            .name("respire-fake-accept".into())
            .spawn(move || accept_loop(&listener, port, &events, &stopping, &next_conn))?;
        acceptors.push((number, handle));
    }
    Ok(Threads {
        events,
        world: Some(world),
        acceptors,
        stopping,
    })
}

fn accept_loop(
    listener: &TcpListener,
    port: Port,
    events: &Sender<Event>,
    stopping: &AtomicBool,
    next_conn: &AtomicU64,
) {
    for stream in listener.incoming() {
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let Ok(reader) = stream.try_clone() else {
            continue;
        };
        let conn = next_conn.fetch_add(1, Ordering::SeqCst);
        if events.send(Event::Accepted { port, conn, stream }).is_err() {
            return;
        }
        let to_world = events.clone();
        let spawned = std::thread::Builder::new()
            .name("respire-fake-conn".into())
            .spawn(move || read_loop(conn, reader, &to_world));
        if spawned.is_err() {
            let _ = events.send(Event::Closed { conn });
        }
    }
}

fn read_loop(conn: u64, stream: TcpStream, events: &Sender<Event>) {
    let mut r = BufReader::new(stream);
    loop {
        match resp::read_command(&mut r) {
            Ok(Some(argv)) => {
                if events.send(Event::Command { conn, argv }).is_err() {
                    return;
                }
            }
            Ok(None) | Err(_) => {
                let _ = events.send(Event::Closed { conn });
                return;
            }
        }
    }
}
