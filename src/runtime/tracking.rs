//! The invalidation subscriber: one thread per server a `Coordinator` waits on
//! (the standalone server, the current Sentinel primary, each cluster primary),
//! started by the first wait there. It holds one RESP2 connection subscribed to `__redis__:invalidate`; the
//! command connections waiters use turn on `CLIENT TRACKING … REDIRECT <its id>`,
//! so every key a waiter's attempt read produces one message here when it next
//! changes. Messages are hints: the woken waiter makes its acquire attempt again.
//!
//! RESP2 pub/sub is used because a receive that times out leaves a RESP3
//! connection of the `redis` crate unusable, while a pub/sub read timeout does not;
//! the thread needs a read timeout to notice that its coordinator is gone.
//!
//! After a disconnect the thread reconnects with backoff; each new subscription
//! gets a new generation, so command connections re-arm tracking before their next
//! wait attempt, and every waiter is woken to re-check. While disconnected,
//! waiters poll. When tracking is refused for good (the ACL denies `CLIENT
//! TRACKING`, the channel or `CLIENT ID`; a server without tracking), waiters
//! poll from then on and the thread ends. Each coordinator logs the fallback to
//! polling once, with the reason.
//!
//! Here too, the other end: the subscriber as command connections see it
//! ([`Tracker`]: subscribed or not, the id to redirect to), and the turning on
//! of tracking on a command connection ([`ensure_tracking`], which [`Armed`]
//! remembers until the connection closes).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use parking_lot::{Condvar, Mutex};

use crate::conn::{Conn, ConnConfig};
use crate::core::timing::resubscribe_after;
use crate::error::{Error, Result, is_noperm};
use crate::runtime::registry::Registry;

const CHANNEL: &str = "__redis__:invalidate";
const READ_TIMEOUT: Duration = Duration::from_millis(250);
const PING_EVERY: Duration = Duration::from_secs(5);

/// The handle a server's node keeps; dropping it stops the thread.
pub(crate) struct Tracking {
    pub(crate) tracker: Arc<Tracker>,
    _stop: Sender<()>,
}

impl Tracking {
    /// Starts the subscriber of the server `cfg` reaches; its invalidations
    /// wake the deployment's waiters in `registry`.
    pub(crate) fn spawn(
        cfg: Arc<ConnConfig>,
        node_timeout: Duration,
        registry: Arc<Registry>,
    ) -> std::io::Result<Tracking> {
        let tracker = Arc::new(Tracker::new());
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(0);
        let t = tracker.clone();
        std::thread::Builder::new()
            .name("respire-tracker".into())
            .spawn(move || run(&cfg, node_timeout, &t, &registry, &stop_rx))?;
        Ok(Tracking {
            tracker,
            _stop: stop_tx,
        })
    }
}

fn stopped(stop: &Receiver<()>) -> bool {
    matches!(stop.try_recv(), Err(TryRecvError::Disconnected))
}

fn run(
    cfg: &ConnConfig,
    node_timeout: Duration,
    tracker: &Tracker,
    registry: &Registry,
    stop: &Receiver<()>,
) {
    let mut generation = 0;
    // Failed sessions since the last one that subscribed.
    let mut failures = 0u32;
    loop {
        if stopped(stop) {
            return;
        }
        generation += 1;
        let mut subscribed = false;
        let result = session(
            cfg,
            node_timeout,
            tracker,
            registry,
            stop,
            generation,
            &mut subscribed,
        );
        tracker.set_status(Status::Down);
        let finished = match &result {
            // The coordinator is gone, or tracking was refused to a waiter's
            // connection (already logged).
            Ok(()) => true,
            Err(e) if refused_for_good(e) => {
                // Permanent: waiters poll from now on, and this thread and its
                // connection are not needed any more.
                tracker.deny(registry, &format!("cannot subscribe to {CHANNEL}: {e}"));
                true
            }
            Err(e) => {
                log::debug!("invalidation subscriber for {}: {e}", cfg.addr);
                registry.fallback(&format!(
                    "the invalidation subscriber is disconnected ({e})"
                ));
                false
            }
        };
        if subscribed {
            // Invalidations may have been lost: every waiter re-checks now.
            failures = 0;
            registry.wake_all();
        }
        if finished {
            return;
        }
        // Wait before reconnecting, but stop at once if the coordinator is gone.
        failures = failures.saturating_add(1);
        if let Err(crossbeam_channel::RecvTimeoutError::Disconnected) =
            stop.recv_timeout(resubscribe_after(failures))
        {
            return;
        }
    }
}

/// Subscribes to the invalidation channel and checks the reply. (The `redis`
/// crate's `PubSub::subscribe` takes an error reply, such as the `NOPERM` of an
/// ACL without the channel, for success: the thread would then be subscribed to
/// nothing and every waiter would sleep until its timer.)
fn subscribe(raw: &mut redis::Connection) -> Result<()> {
    let io = |source| Error::Io {
        op: "SUBSCRIBE",
        source,
    };
    let cmd = redis::cmd("SUBSCRIBE").arg(CHANNEL).get_packed_command();
    raw.send_packed_command(&cmd).map_err(io)?;
    let confirms = |reply: &[redis::Value]| matches!(reply.first(), Some(redis::Value::BulkString(kind)) if kind == b"subscribe");
    match raw.recv_response().map_err(io)?.extract_error() {
        Ok(redis::Value::Array(reply)) if confirms(&reply) => Ok(()),
        Ok(other) => Err(Error::UnexpectedReply {
            op: "SUBSCRIBE",
            reply: format!("{other:?}"),
        }),
        Err(e) if is_noperm(&e) => Err(Error::Permission(e.to_string())),
        Err(source) => Err(Error::Server {
            op: "SUBSCRIBE",
            source,
        }),
    }
}

/// Whether a failed session means tracking can never work with this server and
/// user (so waiters should poll for good), rather than a transient failure.
fn refused_for_good(err: &Error) -> bool {
    match err {
        Error::Permission(_) | Error::UnexpectedReply { .. } => true,
        Error::Server { .. } => !err.is_retryable(),
        _ => false,
    }
}

/// One subscription: connects, subscribes, announces the redirect id, then
/// delivers invalidations until the connection fails (`Err`) or the coordinator
/// is gone (`Ok`).
fn session(
    cfg: &ConnConfig,
    node_timeout: Duration,
    tracker: &Tracker,
    registry: &Registry,
    stop: &Receiver<()>,
    generation: u64,
    subscribed: &mut bool,
) -> Result<()> {
    let mut conn: Conn = cfg.connect_pubsub(cfg.connect_timeout, "respire-tracking")?;
    let id = conn.id().ok_or_else(|| {
        Error::Permission("CLIENT ID is denied, so no connection can redirect to this one".into())
    })?;
    let raw = conn.raw();
    let io = |op: &'static str| move |e: redis::RedisError| Error::Io { op, source: e };
    raw.set_read_timeout(Some(node_timeout.max(READ_TIMEOUT)))
        .and_then(|()| raw.set_write_timeout(Some(node_timeout)))
        .map_err(io("setting socket timeouts"))?;
    subscribe(raw)?;
    let mut pubsub = raw.as_pubsub();
    pubsub
        .set_read_timeout(Some(READ_TIMEOUT))
        .map_err(io("setting socket timeouts"))?;
    *subscribed = true;
    tracker.set_status(Status::Ready {
        redirect: id,
        generation,
    });
    registry.wake_all();
    let mut last_heard = registry.now();
    loop {
        match pubsub.get_message() {
            Ok(msg) => {
                last_heard = registry.now();
                if msg.get_channel_name() != CHANNEL {
                    continue;
                }
                match msg.get_payload::<redis::Value>() {
                    Ok(redis::Value::Array(keys)) | Ok(redis::Value::Set(keys)) => {
                        for key in keys {
                            if let redis::Value::BulkString(key) = key {
                                registry.wake_key(&key);
                            }
                        }
                    }
                    // FLUSHALL / FLUSHDB: every key may have changed.
                    _ => registry.wake_all(),
                }
            }
            Err(e) if e.is_timeout() => {
                // Stop when the coordinator is gone, or when waiters poll for
                // good because their connections may not turn tracking on.
                if stopped(stop) || tracker.is_denied() {
                    return Ok(());
                }
                let now = registry.now();
                if now.saturating_duration_since(last_heard) >= PING_EVERY {
                    // A silent peer may be gone: its pong must come back within
                    // the read timeout or the connection is replaced.
                    pubsub.ping::<redis::Value>().map_err(io("PING"))?;
                    last_heard = now;
                }
            }
            Err(e) => return Err(io("receiving invalidations")(e)),
        }
    }
}

/// Whether invalidations from one server can be relied on right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    /// The subscriber is connecting for the first time.
    Starting,
    /// Subscribed; command connections redirect their invalidations to `redirect`.
    Ready { redirect: u64, generation: u64 },
    /// No subscriber (disconnected or refused): waiters poll.
    Down,
}

/// The invalidation subscriber of one server, as its command connections see
/// it: whether it is subscribed, and the id they redirect to.
pub(crate) struct Tracker {
    status: Mutex<Status>,
    status_changed: Condvar,
    denied: AtomicBool,
    /// `CLIENT CACHING` is denied: connections track every key they read.
    every_read: AtomicBool,
    /// The first connection attempt has settled (status left `Starting`).
    settled: AtomicBool,
}

impl Tracker {
    pub(crate) fn new() -> Self {
        Tracker {
            status: Mutex::new(Status::Starting),
            status_changed: Condvar::new(),
            denied: AtomicBool::new(false),
            every_read: AtomicBool::new(false),
            settled: AtomicBool::new(false),
        }
    }

    pub(crate) fn set_status(&self, status: Status) {
        *self.status.lock() = status;
        if status != Status::Starting {
            self.settled.store(true, Ordering::Release);
        }
        self.status_changed.notify_all();
    }

    pub(crate) fn status(&self) -> Status {
        if self.denied.load(Ordering::Acquire) {
            return Status::Down;
        }
        *self.status.lock()
    }

    /// Waits (bounded) for the subscriber's first connection attempt to settle.
    pub(crate) fn await_settled(&self, until: Instant) {
        if self.settled.load(Ordering::Acquire) {
            return;
        }
        let mut status = self.status.lock();
        while *status == Status::Starting {
            if self
                .status_changed
                .wait_until(&mut status, until)
                .timed_out()
            {
                return;
            }
        }
    }

    /// Tracking is refused for good on this server (ACL or server): poll.
    pub(crate) fn deny(&self, registry: &Registry, why: &str) {
        self.denied.store(true, Ordering::Release);
        registry.fallback(why);
    }

    /// The ACL denies `CLIENT CACHING`: from now on command connections
    /// turn on tracking of every key they read (logged once).
    fn track_every_read(&self, registry: &Registry, why: &str) {
        if !self.every_read.swap(true, Ordering::AcqRel) {
            log::warn!(
                "waiters on {} track every key their connections read, since {why}: an \
                 uncontended acquire on a connection that once waited then costs an \
                 invalidation",
                registry.addr()
            );
        }
    }

    /// Whether tracking was refused for good.
    pub(crate) fn is_denied(&self) -> bool {
        self.denied.load(Ordering::Acquire)
    }
}

/// Client tracking turned on for one command connection, redirected to the
/// subscriber of `generation`. The server tracks the keys a connection read only
/// while that connection lives, so this is dropped with it: when a connection
/// whose tracking is current closes (a transport failure broke it), every first
/// waiter re-checks, and so re-arms its key on a connection that is open.
pub(crate) struct Armed {
    pub(super) generation: u64,
    pub(super) reads: Reads,
    pub(super) tracker: Weak<Tracker>,
    pub(super) registry: Weak<Registry>,
}

/// Which reads of a command connection arm invalidations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reads {
    /// None: no subscriber, or tracking refused (waiters poll).
    Untracked,
    /// Those right after `CLIENT CACHING yes` (`OPTIN` mode).
    OnRequest,
    /// Every one (the ACL denies `CLIENT CACHING`).
    All,
}

impl Drop for Armed {
    fn drop(&mut self) {
        if let (Some(tracker), Some(registry)) = (self.tracker.upgrade(), self.registry.upgrade())
            && matches!(tracker.status(), Status::Ready { generation, .. } if generation == self.generation)
        {
            // The server forgot the keys this connection tracked: every first
            // waiter re-checks, and so re-arms on an open connection.
            log::debug!(
                "a tracked connection to {} closed; waiters re-check",
                registry.addr()
            );
            registry.wake_all();
        }
    }
}

/// Turns on tracking for this connection, redirected to the current subscriber
/// of its server, in `OPTIN` mode: the connection's commands track no key
/// unless `CLIENT CACHING yes` goes right before them ([`Conn::track_next`]),
/// so the plain attempts and releases that share the pooled connection never
/// cost an invalidation. Where the ACL denies `CLIENT CACHING`, tracking of
/// every read instead. Returns which reads of the connection now arm
/// invalidations.
pub(crate) fn ensure_tracking(
    conn: &mut Conn,
    tracker: &Arc<Tracker>,
    registry: &Arc<Registry>,
    deadline: Instant,
) -> Result<Reads> {
    let Status::Ready {
        redirect,
        generation,
    } = tracker.status()
    else {
        return Ok(Reads::Untracked);
    };
    let armed = conn
        .attachment
        .as_ref()
        .and_then(|a| a.downcast_ref::<Armed>());
    if let Some(armed) = armed.filter(|a| a.generation == generation) {
        return Ok(armed.reads);
    }
    let mut reads = if tracker.every_read.load(Ordering::Acquire) {
        Reads::All
    } else {
        Reads::OnRequest
    };
    let on = |reads| {
        let mut pipe = redis::pipe();
        let cmd = pipe
            .cmd("CLIENT")
            .arg("TRACKING")
            .arg("ON")
            .arg("REDIRECT")
            .arg(redirect);
        if reads == Reads::OnRequest {
            // `CLIENT CACHING yes` is sent here too, so that an ACL that
            // denies it is found now; what it marks is the attempt that
            // follows on this connection, which marks itself anyway.
            cmd.arg("OPTIN");
            pipe.cmd("CLIENT").arg("CACHING").arg("yes");
        }
        pipe
    };
    let error = |v: redis::Value| match v {
        redis::Value::ServerError(e) => Some(redis::RedisError::from(e)),
        _ => None,
    };
    let mut replies = conn
        .pipeline(&on(reads), "CLIENT TRACKING", deadline)?
        .into_iter();
    let mut refusal = replies.next().and_then(error);
    if refusal.is_none()
        && let Some(caching) = replies.next().and_then(error)
    {
        if !crate::error::is_noperm(&caching) {
            return Err(Error::Server {
                op: "CLIENT CACHING",
                source: caching,
            });
        }
        tracker.track_every_read(
            registry,
            &format!("the ACL denies CLIENT CACHING ({caching})"),
        );
        reads = Reads::All;
        refusal = conn
            .pipeline(&on(reads), "CLIENT TRACKING", deadline)?
            .into_iter()
            .next()
            .and_then(error);
    }
    match refusal {
        None => {
            match conn
                .attachment
                .as_mut()
                .and_then(|a| a.downcast_mut::<Armed>())
            {
                // Re-pointed at a new subscriber: the same connection, still open.
                Some(armed) => {
                    armed.generation = generation;
                    armed.reads = reads;
                }
                None => {
                    conn.attachment = Some(Box::new(Armed {
                        generation,
                        reads,
                        tracker: Arc::downgrade(tracker),
                        registry: Arc::downgrade(registry),
                    }));
                }
            }
            Ok(reads)
        }
        Some(e) if crate::error::is_noperm(&e) => {
            tracker.deny(registry, &format!("the ACL denies CLIENT TRACKING ({e})"));
            Ok(Reads::Untracked)
        }
        Some(source) => {
            let why = format!("the server refused CLIENT TRACKING ({source})");
            if source.code() == Some("ERR") && source.to_string().contains("redirect") {
                // The subscriber went away between the status read and this
                // command; it is reconnecting and will wake every waiter.
                log::debug!("{why}");
            } else {
                tracker.deny(registry, &why);
            }
            Ok(Reads::Untracked)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closing_a_connection_with_current_tracking_wakes_every_first_waiter() {
        let reg = Arc::new(Registry::new("redis://test".into(), crate::clock::system()));
        let tracker = Arc::new(Tracker::new());
        tracker.set_status(Status::Ready {
            redirect: 7,
            generation: 2,
        });
        let a = reg.register(&["k"], false, None);
        let b = reg.register(&["k"], false, None);
        let other = reg.register(&["j"], false, None);
        let armed = |generation| Armed {
            generation,
            reads: Reads::OnRequest,
            tracker: Arc::downgrade(&tracker),
            registry: Arc::downgrade(&reg),
        };
        // Tracking that went to an earlier subscriber was re-armed already.
        drop(armed(1));
        assert!(a.rx.try_recv().is_err());
        assert!(other.rx.try_recv().is_err());
        drop(armed(2));
        assert!(a.rx.try_recv().is_ok());
        assert!(b.rx.try_recv().is_err());
        assert!(other.rx.try_recv().is_ok());
    }
}
