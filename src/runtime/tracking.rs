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

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use crate::conn::{Conn, ConnConfig};
use crate::core::timing::resubscribe_after;
use crate::error::{Error, Result, is_noperm};
use crate::runtime::waiters::{Registry, Status, Tracker};

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
