//! One open connection: opening it (the setup round trip), the socket
//! timeouts, and running commands, pipelines and scripts on it.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::{ConnectionLike, FromRedisValue};

use crate::clock::Clock;
use crate::error::{Error, Result, is_noperm};
use crate::identity::Identity;
use crate::replication::ReplicationPoint;
use crate::scripts::Script;

use super::config::{ConnConfig, RoleCheck};
use super::sentinel;

impl ConnConfig {
    /// Opens a connection, spending at most `budget` (capped by the connect timeout).
    ///
    /// One round trip after the handshake names the connection `name`
    /// (`CLIENT SETNAME`, best effort, so `CLIENT LIST` shows what it is for)
    /// and learns what the server knows of it (`CLIENT ID`, and `CLIENT INFO`
    /// for its address from Redis 6.2 on: see [`Identity`]), so that a command
    /// left without a reply can be fenced off by killing it, and which server
    /// it is (`HELLO`: see [`Conn::has_set_ifeq`]). Scripts are not loaded here (`SCRIPT
    /// LOAD` waits out a `CLIENT PAUSE WRITE`, as during a failover): the first
    /// use of one on a server that lacks it sends it within the same deadline.
    pub(crate) fn connect(&self, budget: Duration, name: &str) -> Result<Conn> {
        self.open(&self.client, budget, name, &[]).map(|o| o.conn)
    }

    /// Opens a connection as [`connect`](ConnConfig::connect) does, with `extra`
    /// commands pipelined after `CLIENT SETNAME`, `CLIENT ID` and `CLIENT INFO`
    /// in the same round trip; their replies (error replies in place) come back in order.
    pub(crate) fn connect_with(
        &self,
        budget: Duration,
        name: &str,
        extra: &[redis::Cmd],
    ) -> Result<Opened> {
        self.open(&self.client, budget, name, extra)
    }

    /// Opens a RESP2 connection for receiving pub/sub messages.
    pub(crate) fn connect_pubsub(&self, budget: Duration, name: &str) -> Result<Conn> {
        self.open(&self.pubsub_client, budget, name, &[])
            .map(|o| o.conn)
    }

    fn open(
        &self,
        client: &redis::Client,
        budget: Duration,
        name: &str,
        extra: &[redis::Cmd],
    ) -> Result<Opened> {
        let started = self.clock.now();
        let budget = budget
            .min(self.connect_timeout)
            .max(Duration::from_millis(1));
        let inner = client
            .get_connection_with_timeout(budget)
            .map_err(|e| self.connect_error(e, budget))?;

        let mut conn = Conn {
            inner,
            addr: self.addr.clone(),
            identity: None,
            timeout_ms: 0,
            broken: false,
            asking: false,
            wait: None,
            waited: None,
            history: None,
            track: false,
            replicas: None,
            fresh: true,
            set_ifeq: false,
            uncached: Vec::new(),
            attachment: None,
            clock: self.clock.clone(),
        };
        // The first round trip also completes a TLS handshake and surfaces a
        // server that accepts connections but does not answer, so its transport
        // errors are connect errors.
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        pipe.cmd("CLIENT").arg("SETNAME").arg(name);
        pipe.cmd("CLIENT").arg("ID");
        // Beside `CLIENT ID` rather than in its place: a server older than
        // 6.2 (or an ACL that allows only `CLIENT ID`) still gives the id.
        pipe.cmd("CLIENT").arg("INFO");
        // Without a protocol version it switches nothing; refused (an ACL, a
        // server that is not Redis), the connection uses the scripts alone.
        pipe.cmd("HELLO");
        let ask_role = self.role != RoleCheck::None;
        if ask_role {
            pipe.cmd("ROLE");
        }
        for cmd in extra {
            pipe.add_command(cmd.clone());
        }
        let deadline = started + budget;
        let sent = self.clock.now();
        let values = match conn.pipeline(&pipe, "connection setup", deadline) {
            Ok(values) => values,
            Err(Error::Timeout { .. }) => {
                return Err(self.connect_error(
                    redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut)),
                    budget,
                ));
            }
            Err(Error::Io { source, .. }) => return Err(self.connect_error(source, budget)),
            Err(e) => return Err(e),
        };
        let round_trip = self.clock.now().saturating_duration_since(sent);
        let mut values = values.into_iter();
        match values.next() {
            Some(redis::Value::ServerError(e)) if matches!(e.code(), "NOAUTH" | "WRONGPASS") => {
                return Err(self.connect_error(redis::RedisError::from(e), budget));
            }
            // An ACL without CLIENT SETNAME, or an old server: names are optional.
            Some(redis::Value::ServerError(e)) => log::debug!("cannot name connection: {e:?}"),
            _ => {}
        }
        let mut id_error = None;
        let id = match values.next() {
            Some(redis::Value::Int(id)) => u64::try_from(id).ok(),
            other => {
                log::debug!("no CLIENT ID for the connection: {other:?}");
                id_error = Some(match other {
                    Some(redis::Value::ServerError(e)) => {
                        format!("{} {}", e.code(), e.details().unwrap_or_default())
                    }
                    other => format!("unexpected reply {other:?}"),
                });
                None
            }
        };
        let info = values.next();
        conn.identity = id.map(|id| Identity::of(id, info.as_ref()));
        conn.set_ifeq = has_set_ifeq(values.next().as_ref());
        if ask_role {
            match values.next().map(|v| sentinel::parse_role(&v)) {
                Some(sentinel::Role::Primary { replicas }) => conn.replicas = Some(replicas),
                Some(role) if self.role == RoleCheck::Primary => {
                    return Err(Error::Topology(format!(
                        "{} is not the primary (ROLE says {role}); the deployment is being \
                         looked up again",
                        self.addr
                    )));
                }
                // An ACL without ROLE: the replica count is unknown.
                other => log::debug!("no usable ROLE for {}: {other:?}", self.addr),
            }
        }
        Ok(Opened {
            conn,
            replies: values.collect(),
            round_trip,
            id_error,
        })
    }

    fn connect_error(&self, err: redis::RedisError, budget: Duration) -> Error {
        let addr = self.addr.to_string();
        if err.kind() == redis::ErrorKind::AuthenticationFailed
            || matches!(err.code(), Some("WRONGPASS" | "NOAUTH"))
        {
            return Error::Auth {
                addr,
                detail: err.detail().unwrap_or("credentials refused").to_owned(),
            };
        }
        if is_noperm(&err) {
            return Error::Permission(format!("connecting to {addr}: {err}"));
        }
        if self.tls {
            let text = err.to_string();
            if err.is_timeout() {
                return Error::Tls {
                    addr,
                    detail: format!(
                        "no TLS handshake within {budget:?}: the port does not speak TLS, \
                         or the server is not answering"
                    ),
                };
            }
            if !err.is_connection_refusal() && !text.contains("refused") {
                return Error::Tls { addr, detail: text };
            }
        }
        let detail = if err.is_timeout() {
            format!("timed out after {budget:?}")
        } else {
            err.to_string()
        };
        Error::Connect { addr, detail }
    }
}

/// A connection just opened by [`ConnConfig::connect_with`].
pub(crate) struct Opened {
    pub(crate) conn: Conn,
    /// The replies to the extra setup commands, in order.
    pub(crate) replies: Vec<redis::Value>,
    /// From sending the setup pipeline to its last reply: one round trip.
    pub(crate) round_trip: Duration,
    /// Why `CLIENT ID` gave no id, when it did not.
    pub(crate) id_error: Option<String>,
}

/// One connection, with the state this crate keeps about it.
pub(crate) struct Conn {
    inner: redis::Connection,
    addr: Arc<str>,
    /// What the server knows of it, when the ACL allows asking `CLIENT ID`.
    identity: Option<Identity>,
    /// The socket timeout now set, in whole milliseconds (0: none yet).
    timeout_ms: u64,
    broken: bool,
    /// Send `ASKING` before the next script (an `ASK` redirection's target).
    asking: bool,
    /// Pipeline `WAIT replicas timeout` after the next script.
    wait: Option<WaitAfter>,
    /// Send `CLIENT CACHING yes` right before the next script or pipeline.
    track: bool,
    /// What that `WAIT` answered.
    waited: Option<u32>,
    /// Where the primary's replication history stood right after that
    /// script, when asked for.
    history: Option<ReplicationPoint>,
    /// How many replicas `ROLE` listed when the connection was made.
    replicas: Option<u32>,
    /// Not yet returned to a pool: just opened.
    pub(super) fresh: bool,
    /// The server has `SET … IFEQ … GET` (see [`Conn::has_set_ifeq`]).
    set_ifeq: bool,
    /// SHA1s of scripts the server is known to lack: sent with EVAL at once.
    uncached: Vec<String>,
    /// State a higher layer keeps with this connection and drops with it (the
    /// waiters keep client-tracking state here, and hear of the close by its drop).
    pub(crate) attachment: Option<Box<dyn Any + Send>>,
    /// The clock its deadlines are read on (the deployment's).
    clock: Arc<dyn Clock>,
}

impl Conn {
    /// The time left until `deadline`, at least 1 ms (the smallest socket
    /// timeout).
    fn left(&self, deadline: Instant) -> Duration {
        deadline
            .saturating_duration_since(self.clock.now())
            .max(Duration::from_millis(1))
    }

    /// Whether the connection was just opened (never idle in a pool, where
    /// the server may have closed it meanwhile).
    pub(crate) fn is_fresh(&self) -> bool {
        self.fresh
    }

    /// The id of the server it is connected to (see
    /// [`ConnConfig::server_id`](super::ConnConfig::server_id)).
    pub(crate) fn server_id(&self) -> u64 {
        super::config::server_id(&self.addr)
    }

    /// The server's address, as configured.
    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    /// Whether a transport failure made this connection unusable.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken || !self.inner.is_open()
    }

    /// Whether the server has `SET key value IFEQ old … GET` — Valkey 8.1
    /// and later, which `HELLO` named when the connection was made —, the
    /// compare-and-set that extends a lease held as a string value without a
    /// script. Redis 8.4 has the option too, but no server of it has run this
    /// crate's tests, so it gets the scripts.
    pub(crate) fn has_set_ifeq(&self) -> bool {
        self.set_ifeq
    }

    /// The server's id for this connection, if known.
    pub(crate) fn id(&self) -> Option<u64> {
        self.identity.as_ref().map(Identity::id)
    }

    /// What the server knows of this connection (to kill it), if known.
    pub(crate) fn identity(&self) -> Option<&Identity> {
        self.identity.as_ref()
    }

    /// Sets the socket timeouts to the time left until `deadline`, in whole
    /// milliseconds rounded down, touching the socket only when that changes.
    fn set_deadline(&mut self, deadline: Instant) -> Result<Duration> {
        self.set_left(self.left(deadline))
    }

    /// Sets the socket timeouts to `left`, in whole milliseconds rounded down
    /// (at least 1), touching the socket only when that changes.
    fn set_left(&mut self, left: Duration) -> Result<Duration> {
        let ms = (left.as_millis() as u64).max(1);
        if self.timeout_ms != ms {
            let timeout = Some(Duration::from_millis(ms));
            let r = self
                .inner
                .set_read_timeout(timeout)
                .and_then(|()| self.inner.set_write_timeout(timeout));
            if let Err(e) = r {
                self.broken = true;
                return Err(Error::Io {
                    op: "setting socket timeouts",
                    source: e,
                });
            }
            self.timeout_ms = ms;
        }
        Ok(Duration::from_millis(ms))
    }

    /// Classifies an error; transport failures mark the connection broken.
    fn fail(&mut self, err: redis::RedisError, op: &'static str, timeout: Duration) -> Error {
        if err.is_timeout() {
            self.broken = true;
            return Error::Timeout { op, after: timeout };
        }
        if err.is_io_error() || err.is_connection_dropped() || err.is_unrecoverable_error() {
            self.broken = true;
            return Error::Io { op, source: err };
        }
        if is_noperm(&err) {
            return Error::Permission(format!("{op}: {err}"));
        }
        if matches!(err.code(), Some("NOAUTH" | "WRONGPASS")) {
            return Error::Auth {
                addr: self.addr.to_string(),
                detail: err.to_string(),
            };
        }
        Error::Server { op, source: err }
    }

    /// Runs one command, finishing by `deadline`.
    pub(crate) fn query<T: FromRedisValue>(
        &mut self,
        cmd: &redis::Cmd,
        op: &'static str,
        deadline: Instant,
    ) -> Result<T> {
        let timeout = self.set_deadline(deadline)?;
        cmd.query(&mut self.inner)
            .map_err(|e| self.fail(e, op, timeout))
    }

    /// Runs a pipeline, finishing by `deadline`; each command's own error reply
    /// is returned in place, and the first transport failure fails the whole
    /// call. (The `redis` crate's own pipeline keeps reading after a read
    /// timeout, one more timeout per command: n commands on a stalled server
    /// would block n times the deadline.)
    ///
    /// After [`Conn::ask_next`], every command goes after its own `ASKING`;
    /// after [`Conn::wait_after_next`], `WAIT` (and `INFO replication`, when
    /// asked for) follows the last one; after [`Conn::track_next`], `CLIENT
    /// CACHING yes` goes first, so the keys the first command reads are
    /// tracked (their replies are not returned).
    pub(crate) fn pipeline(
        &mut self,
        pipe: &redis::Pipeline,
        op: &'static str,
        deadline: Instant,
    ) -> Result<Vec<redis::Value>> {
        if !self.asking && self.wait.is_none() && !self.track {
            return self.raw_pipeline(pipe, op, deadline);
        }
        let asking = std::mem::take(&mut self.asking);
        let wait = self.wait.take();
        let track = std::mem::take(&mut self.track);
        let wrapped = wrap(pipe.cmd_iter(), asking, wait, track);
        let mut values = self.raw_pipeline(&wrapped, op, deadline)?;
        if track {
            let timeout = self.left(deadline);
            if let redis::Value::ServerError(e) = values.remove(0) {
                return Err(self.fail(redis::RedisError::from(e), op, timeout));
            }
        }
        if let Some(wait) = wait {
            let waited = values.pop();
            let history = if wait.history { values.pop() } else { None };
            self.note_wait(waited, history);
        }
        Ok(if asking {
            values.into_iter().skip(1).step_by(2).collect()
        } else {
            values
        })
    }

    fn raw_pipeline(
        &mut self,
        pipe: &redis::Pipeline,
        op: &'static str,
        deadline: Instant,
    ) -> Result<Vec<redis::Value>> {
        let timeout = self.set_deadline(deadline)?;
        let count = pipe.len();
        let packed = pipe.get_packed_pipeline();
        if let Err(e) = self.inner.send_packed_command(&packed) {
            return Err(self.fail(e, op, timeout));
        }
        let mut values = Vec::with_capacity(count);
        while values.len() < count {
            // One clock read per reply: no time left ends the call, and what
            // is left bounds the read.
            let left = deadline.saturating_duration_since(self.clock.now());
            if left.is_zero() {
                self.broken = true;
                return Err(Error::Timeout { op, after: timeout });
            }
            self.set_left(left)?;
            match self.inner.recv_response() {
                // Out-of-band data (RESP3) is not a reply.
                Ok(redis::Value::Push { .. }) => {}
                // Error replies come back as values, in their place.
                Ok(value) => values.push(value),
                Err(e) => return Err(self.fail(e, op, timeout)),
            }
        }
        Ok(values)
    }

    /// Notes that the server lacks `script` (`SCRIPT EXISTS` said so): its
    /// next use goes out as EVAL straight away, which also caches it there.
    pub(crate) fn lacks_script(&mut self, script: &Script) {
        if !self.uncached.contains(&script.sha) {
            self.uncached.push(script.sha.clone());
        }
    }

    /// Runs a script in one round trip (EVALSHA; EVAL in the time left when the
    /// server does not have it cached; EVAL at once when it is known not to),
    /// finishing by `deadline`.
    pub(crate) fn script<T: FromRedisValue>(
        &mut self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        op: &'static str,
        deadline: Instant,
    ) -> Result<T> {
        if self.asking || self.wait.is_some() || self.track {
            return self.wrapped_script(script, keys, args, op, deadline);
        }
        if let Some(i) = self.uncached.iter().position(|sha| *sha == script.sha) {
            // Cached by this EVAL whatever it returns; a transport failure
            // ends the connection anyway.
            self.uncached.swap_remove(i);
            return self.query(&script.eval(keys, args), op, deadline);
        }
        match self.query(&script.evalsha(keys, args), op, deadline) {
            Err(Error::Server { source, .. }) if source.code() == Some("NOSCRIPT") => {
                log::debug!(
                    "script {} not cached on the server; sending it",
                    script.name
                );
                if self.clock.now() >= deadline {
                    return Err(Error::Timeout {
                        op,
                        after: Duration::ZERO,
                    });
                }
                self.query(&script.eval(keys, args), op, deadline)
            }
            other => other,
        }
    }

    /// Sends `ASKING` right before the next script, in the same round trip (the
    /// target of an `ASK` redirection serves a slot it is importing only then).
    pub(crate) fn ask_next(&mut self) {
        self.asking = true;
    }

    /// Sends `CLIENT CACHING yes` right before the next script or pipeline, in
    /// the same round trip, so that on a connection with `CLIENT TRACKING …
    /// OPTIN` on, the keys it reads are tracked (and only those: every other
    /// command on the connection tracks nothing). Not combined with
    /// [`Conn::ask_next`]: `ASKING` would clear it.
    pub(crate) fn track_next(&mut self) {
        self.track = true;
    }

    /// Takes the request of [`Conn::track_next`], for a caller that places
    /// `CLIENT CACHING yes` in its pipeline itself (right before the command
    /// whose keys are to be tracked).
    pub(crate) fn take_track(&mut self) -> bool {
        std::mem::take(&mut self.track)
    }

    /// Whether the next script or pipeline goes after `ASKING`.
    pub(crate) fn is_asking(&self) -> bool {
        self.asking
    }

    /// Pipelines `WAIT replicas timeout` after the next script, in the same
    /// round trip; [`Conn::take_waited`] then tells what it answered. With
    /// `history`, `INFO replication` goes between the script and `WAIT`, and
    /// [`Conn::take_history`] tells where the primary's replication history
    /// stood right after the script. The caller's deadline must leave room
    /// for `timeout`.
    pub(crate) fn wait_after_next(&mut self, replicas: u32, timeout: Duration, history: bool) {
        self.wait = Some(WaitAfter {
            replicas,
            timeout,
            history,
        });
        self.waited = None;
        self.history = None;
    }

    /// How many replicas acknowledged the script's writes, if a `WAIT` was
    /// pipelined after it and answered.
    pub(crate) fn take_waited(&mut self) -> Option<u32> {
        self.wait = None;
        self.waited.take()
    }

    /// Where the primary's replication history stood right after the script,
    /// if [`Conn::wait_after_next`] asked and the server told (a replica, or
    /// a user without the right to run `INFO`, does not).
    pub(crate) fn take_history(&mut self) -> Option<ReplicationPoint> {
        self.history.take()
    }

    /// Keeps the replies to the `WAIT` and `INFO replication` pipelined
    /// after a script.
    fn note_wait(&mut self, waited: Option<redis::Value>, history: Option<redis::Value>) {
        if let Some(redis::Value::Int(n)) = waited {
            self.waited = u32::try_from(n).ok();
        }
        self.history = match history.as_ref().map(|h| (h, crate::reply::text(h))) {
            Some((_, Some(text))) => ReplicationPoint::parse(text),
            None => None,
            Some((other, None)) => {
                log::debug!("no replication history from {}: {other:?}", self.addr);
                None
            }
        };
    }

    /// How many replicas `ROLE` listed when this connection was made (`None`
    /// when it was not asked or not allowed).
    pub(crate) fn replicas(&self) -> Option<u32> {
        self.replicas
    }

    /// [`Conn::script`] with `ASKING` or `CLIENT CACHING yes` before and/or
    /// `WAIT` after it, in one pipeline; a server without the script gets
    /// `EVAL` the same way.
    fn wrapped_script<T: FromRedisValue>(
        &mut self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        op: &'static str,
        deadline: Instant,
    ) -> Result<T> {
        let asking = std::mem::take(&mut self.asking);
        let wait = self.wait.take();
        let track = std::mem::take(&mut self.track);
        let uncached = self.uncached.iter().position(|sha| *sha == script.sha);
        let mut cmd = match uncached {
            Some(i) => {
                self.uncached.swap_remove(i);
                script.eval(keys, args)
            }
            None => script.evalsha(keys, args),
        };
        for sha in [uncached.is_none(), false] {
            let pipe = wrap(std::iter::once(&cmd), asking, wait, track);
            let timeout = self.left(deadline);
            let mut values = self.raw_pipeline(&pipe, op, deadline)?.into_iter();
            if track && let Some(redis::Value::ServerError(e)) = values.next() {
                return Err(self.fail(redis::RedisError::from(e), op, timeout));
            }
            if asking {
                values.next();
            }
            let reply = values.next().unwrap_or(redis::Value::Nil);
            if let Some(wait) = wait {
                let history = if wait.history { values.next() } else { None };
                self.note_wait(values.next(), history);
            }
            match reply {
                redis::Value::ServerError(e) if sha && e.code() == "NOSCRIPT" => {
                    log::debug!(
                        "script {} not cached on the server; sending it",
                        script.name
                    );
                    if self.clock.now() >= deadline {
                        return Err(Error::Timeout {
                            op,
                            after: Duration::ZERO,
                        });
                    }
                    cmd = script.eval(keys, args);
                }
                redis::Value::ServerError(e) => {
                    return Err(self.fail(redis::RedisError::from(e), op, timeout));
                }
                value => {
                    return T::from_redis_value(value).map_err(|e| Error::UnexpectedReply {
                        op,
                        reply: e.to_string(),
                    });
                }
            }
        }
        unreachable!("the second pass sends EVAL and returns")
    }

    /// Runs one command as [`Conn::script`] runs a script (after `ASKING` or
    /// `CLIENT CACHING yes`, before `WAIT`, when asked for), finishing by
    /// `deadline`, and reads its reply with `read`. An error reply that `read`
    /// does not take is an error, as a script's is; any other reply it does
    /// not take is [`Error::UnexpectedReply`].
    pub(crate) fn command<T>(
        &mut self,
        cmd: &redis::Cmd,
        op: &'static str,
        deadline: Instant,
        read: impl FnOnce(&redis::Value) -> Option<T>,
    ) -> Result<T> {
        let mut pipe = redis::pipe();
        pipe.add_command(cmd.clone());
        let timeout = self.left(deadline);
        let reply = self
            .pipeline(&pipe, op, deadline)?
            .pop()
            .unwrap_or(redis::Value::Nil);
        if let Some(value) = read(&reply) {
            return Ok(value);
        }
        match reply {
            redis::Value::ServerError(e) => Err(self.fail(redis::RedisError::from(e), op, timeout)),
            other => Err(Error::UnexpectedReply {
                op,
                reply: format!("{other:?}"),
            }),
        }
    }

    /// Gives the raw connection for pub/sub use.
    pub(crate) fn raw(&mut self) -> &mut redis::Connection {
        &mut self.inner
    }

    /// Subscribes this connection (made with
    /// [`ConnConfig::connect_pubsub`]) to `channel`, waiting at most
    /// `node_timeout` for the confirmation, and returns it as a subscriber
    /// whose reads wait at most `read_every`, so that its owner can look at
    /// its stop signal between messages.
    pub(crate) fn subscribe(
        &mut self,
        channel: &'static str,
        node_timeout: Duration,
        read_every: Duration,
    ) -> Result<Subscriber<'_>> {
        let io = |op: &'static str| move |source: redis::RedisError| Error::Io { op, source };
        let clock = self.clock.clone();
        let raw = &mut self.inner;
        raw.set_read_timeout(Some(node_timeout.max(read_every)))
            .and_then(|()| raw.set_write_timeout(Some(node_timeout)))
            .map_err(io("setting socket timeouts"))?;
        let cmd = redis::cmd("SUBSCRIBE").arg(channel).get_packed_command();
        raw.send_packed_command(&cmd).map_err(io("SUBSCRIBE"))?;
        match raw
            .recv_response()
            .map_err(io("SUBSCRIBE"))?
            .extract_error()
        {
            Ok(redis::Value::Array(reply)) if matches!(reply.first(), Some(redis::Value::BulkString(k)) if k == b"subscribe") =>
                {}
            Ok(other) => {
                return Err(Error::UnexpectedReply {
                    op: "SUBSCRIBE",
                    reply: format!("{other:?}"),
                });
            }
            Err(e) if is_noperm(&e) => return Err(Error::Permission(e.to_string())),
            Err(source) => {
                return Err(Error::Server {
                    op: "SUBSCRIBE",
                    source,
                });
            }
        }
        let pubsub = raw.as_pubsub();
        pubsub
            .set_read_timeout(Some(read_every))
            .map_err(io("setting socket timeouts"))?;
        Ok(Subscriber { pubsub, clock })
    }
}

/// A subscribed connection (see [`Conn::subscribe`]).
pub(crate) struct Subscriber<'a> {
    pubsub: redis::PubSub<'a>,
    clock: Arc<dyn Clock>,
}

impl Subscriber<'_> {
    /// Hands each message to `on` until it returns `false` (`Ok`), `stop`
    /// says so between messages (`Ok`), or the connection fails (`Err`).
    /// Pings the server when nothing was heard for `ping_every`, so that a
    /// dead peer is noticed.
    pub(crate) fn listen(
        &mut self,
        ping_every: Duration,
        stop: &dyn Fn() -> bool,
        on: &mut dyn FnMut(redis::Msg) -> bool,
    ) -> Result<()> {
        let io = |op: &'static str| move |source: redis::RedisError| Error::Io { op, source };
        let mut last_heard = self.clock.now();
        loop {
            match self.pubsub.get_message() {
                Ok(msg) => {
                    last_heard = self.clock.now();
                    if !on(msg) {
                        return Ok(());
                    }
                }
                Err(e) if e.is_timeout() => {
                    if stop() {
                        return Ok(());
                    }
                    let now = self.clock.now();
                    if now.saturating_duration_since(last_heard) >= ping_every {
                        self.pubsub.ping::<redis::Value>().map_err(io("PING"))?;
                        last_heard = now;
                    }
                }
                Err(e) => return Err(io("receiving a subscribed message")(e)),
            }
        }
    }
}

/// Whether a `HELLO` reply names a server with `SET … IFEQ … GET`: Valkey
/// 8.1 or later. (Valkey reports `redis_version` 7.2.4 in `INFO` for clients
/// that look for features by it; `HELLO` gives its own name and version.)
fn has_set_ifeq(hello: Option<&redis::Value>) -> bool {
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        redis::Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let field = |name: &str| -> Option<String> {
        match hello? {
            redis::Value::Map(pairs) => pairs
                .iter()
                .find(|(k, _)| text(k).as_deref() == Some(name))
                .and_then(|(_, v)| text(v)),
            redis::Value::Array(items) => items
                .chunks_exact(2)
                .find(|pair| text(&pair[0]).as_deref() == Some(name))
                .and_then(|pair| text(&pair[1])),
            _ => None,
        }
    };
    if field("server").as_deref() != Some("valkey") {
        return false;
    }
    let Some(version) = field("version") else {
        return false;
    };
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= (8, 1),
        _ => false,
    }
}

/// A `WAIT` to pipeline after the next script.
#[derive(Clone, Copy, Debug)]
struct WaitAfter {
    replicas: u32,
    timeout: Duration,
    /// `INFO replication` before the `WAIT`.
    history: bool,
}

/// `cmds` as one pipeline: after `CLIENT CACHING yes` when `track`, each after
/// `ASKING` when `asking` (a slot being imported), and `WAIT replicas
/// timeout` after them all when asked for, after `INFO replication` when that
/// is asked for too.
fn wrap<'a>(
    cmds: impl Iterator<Item = &'a redis::Cmd>,
    asking: bool,
    wait: Option<WaitAfter>,
    track: bool,
) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    if track {
        pipe.cmd("CLIENT").arg("CACHING").arg("yes");
    }
    for cmd in cmds {
        if asking {
            pipe.cmd("ASKING");
        }
        pipe.add_command(cmd.clone());
    }
    if let Some(wait) = wait {
        if wait.history {
            pipe.cmd("INFO").arg("replication");
        }
        let ms = (wait.timeout.as_millis() as u64).max(1);
        pipe.cmd("WAIT").arg(wait.replicas).arg(ms);
    }
    pipe
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(cmd: &redis::Cmd) -> Vec<String> {
        cmd.args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => String::from_utf8_lossy(b).into_owned(),
                _ => "<not a word>".into(),
            })
            .collect()
    }

    #[test]
    fn a_kill_must_match_the_address_client_info_gave_for_the_same_id() {
        let line = "id=7 addr=127.0.0.1:50412 laddr=127.0.0.1:6379 fd=9 name=respire idle=0\n";
        let by_addr = [
            "CLIENT",
            "KILL",
            "ID",
            "7",
            "ADDR",
            "127.0.0.1:50412",
            "SKIPME",
            "yes",
        ];
        let resp2 = redis::Value::BulkString(line.as_bytes().to_vec());
        assert_eq!(words(&Identity::of(7, Some(&resp2)).kill_cmd()), by_addr);
        let resp3 = redis::Value::VerbatimString {
            format: redis::VerbatimFormat::Text,
            text: line.into(),
        };
        assert_eq!(words(&Identity::of(7, Some(&resp3)).kill_cmd()), by_addr);
    }

    #[test]
    fn set_ifeq_is_valkey_8_1_or_later_by_the_name_and_version_hello_gives() {
        let resp2 = |server: &str, version: &str| {
            let words = ["server", server, "version", version, "proto", "2"];
            redis::Value::Array(
                words
                    .iter()
                    .map(|w| redis::Value::BulkString(w.as_bytes().to_vec()))
                    .collect(),
            )
        };
        let resp3 = |server: &str, version: &str| {
            let pair = |k: &str, v: &str| {
                (
                    redis::Value::BulkString(k.as_bytes().to_vec()),
                    redis::Value::BulkString(v.as_bytes().to_vec()),
                )
            };
            redis::Value::Map(vec![pair("server", server), pair("version", version)])
        };
        for reply in [resp2, resp3] {
            assert!(has_set_ifeq(Some(&reply("valkey", "8.1.8"))));
            assert!(has_set_ifeq(Some(&reply("valkey", "8.10.0"))));
            assert!(has_set_ifeq(Some(&reply("valkey", "9.0.0"))));
            assert!(!has_set_ifeq(Some(&reply("valkey", "8.0.4"))));
            assert!(!has_set_ifeq(Some(&reply("valkey", "7.2.9"))));
            assert!(!has_set_ifeq(Some(&reply("valkey", "nine"))));
            assert!(!has_set_ifeq(Some(&reply("redis", "8.4.0"))));
            assert!(!has_set_ifeq(Some(&reply("redis", "7.0.15"))));
        }
        let refused = redis::parse_redis_value(b"-NOPERM no permissions\r\n").unwrap();
        assert!(!has_set_ifeq(Some(&refused)));
        assert!(!has_set_ifeq(None));
    }

    #[test]
    fn without_an_address_for_the_same_id_a_kill_goes_by_id_alone() {
        let by_id = ["CLIENT", "KILL", "ID", "7", "SKIPME", "yes"];
        let refused = redis::parse_redis_value(b"-ERR unknown subcommand 'INFO'\r\n").unwrap();
        let other = redis::Value::BulkString(b"id=8 addr=127.0.0.1:50413 fd=9".to_vec());
        let no_addr = redis::Value::BulkString(b"id=7 laddr=127.0.0.1:6379 fd=9".to_vec());
        for info in [None, Some(refused), Some(other), Some(no_addr)] {
            let who = Identity::of(7, info.as_ref());
            assert_eq!(who.id(), 7);
            assert_eq!(words(&who.kill_cmd()), by_id, "{info:?}");
        }
    }
}
