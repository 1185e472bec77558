//! Who gets a [`Lock`](crate::Lock) next: [`Fairness::Barging`] (the default:
//! whoever asks after a release may take it) or [`Fairness::Fifo`] (a queue
//! on the server, after Redisson's fair lock: a list of waiters in arrival
//! order beside their timeouts, so that a crashed waiter drops out by
//! itself).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::conn::{Conn, Connect};
use crate::core::acquire::dated;
use crate::error::{Error, Result};
use crate::keys::{MAX_TTL, hash_tag};
use crate::lease::acquire::Lease;
use crate::lease::deployment::{Deployment, bad_key_in};
use crate::lease::kind::{Acquire, Granted, Plain, Try, WaitKeys};
use crate::lease::{busy, string_clean_up};
use crate::runtime::renewal::Ops;
use crate::runtime::waiters::{Attempt, Order};
use crate::scripts;
use crate::token::OwnerToken;

/// Who gets a [`Lock`](crate::Lock) next when it is released; see
/// [`Lock::with_fairness`](crate::Lease::with_fairness).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fairness {
    /// Whoever attempts first after a release gets the lock: no queue on the
    /// server and no extra command on any path. Within one process, waiters
    /// on a key queue in arrival order, a release wakes the first, and a
    /// wait that starts while others of the process are queued joins behind
    /// them (so a thread that has just released the lock does not take it
    /// back from the waiter its release woke); a single attempt
    /// (`try_acquire`) does not queue. Across processes each change starts a
    /// race between every process's first waiter; a wait on a key that a wait
    /// in the process had to wait for within the last second pauses 1 ms
    /// before its first attempt, which lets a waiter elsewhere, woken by a
    /// release this process may just have made, get there first most of the
    /// time (no guarantee: use `Fifo` for one). The default.
    Barging,
    /// The lock goes to its waiters in the order they began to wait, across
    /// processes: every waiter holds an entry in a queue on the server (two
    /// sorted sets beside the lock, `KEY:queue` and `KEY:queue:expiry`), and
    /// the lock is granted only to the head of that queue, or to anyone while
    /// the queue is empty. A single attempt (`try_acquire`, a wait's first
    /// attempt) never takes the lock ahead of a queued waiter and does not
    /// queue; a wait whose first attempt was not granted joins the tail.
    ///
    /// Each entry expires `entry_ttl` after its waiter last refreshed it; a
    /// waiter refreshes it with every attempt, at least every third of
    /// `entry_ttl`. A waiter that crashed, or was paused longer than
    /// `entry_ttl`, thus holds up the queue for at most `entry_ttl` after its
    /// last refresh; a paused waiter that comes back joins the tail again. A
    /// wait that ends without the lock (deadline, cancellation, error) takes
    /// its entry out at once (in the background if the server does not
    /// answer in time).
    ///
    /// Costs: a waiting acquire runs one script per attempt instead of
    /// `SET NX` (the uncontended path is still one round trip); every waiter
    /// of a process is woken by every release and every change of the queue,
    /// and each wakes at least once per third of `entry_ttl` to refresh.
    Fifo {
        /// How long a waiter's queue entry outlives its last refresh: the
        /// longest a dead waiter can hold up those behind it. More than three
        /// node timeouts, at most [`MAX_TTL`](crate::MAX_TTL).
        entry_ttl: Duration,
    },
}

impl Fairness {
    /// [`Fairness::Fifo`] whose entries outlive their waiter by 5 s.
    pub const fn fifo() -> Fairness {
        Fairness::Fifo {
            entry_ttl: Duration::from_secs(5),
        }
    }
}

impl Default for Fairness {
    /// [`Fairness::Barging`].
    fn default() -> Self {
        Fairness::Barging
    }
}

impl Lease<Plain> {
    /// This lock, with waiters served as `fairness` says. Every handle on one
    /// key must use the same fairness: a [`Fairness::Barging`] handle does not
    /// look at the queue a [`Fairness::Fifo`] one keeps, and takes the lock
    /// whenever it finds it free. Nothing is sent.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for [`Fairness::Fifo`] on a key without a
    /// non-empty hash tag (the queue's keys must share the lock's cluster
    /// slot: name it `{name}` or `{tag}name`), or with an `entry_ttl` not
    /// above three node timeouts or above [`MAX_TTL`](crate::MAX_TTL).
    pub fn with_fairness(self, fairness: Fairness) -> Result<Self> {
        let key = self.physical_keys()[0].clone();
        match fairness {
            Fairness::Barging => Ok(self.keeping_holder(Lease::new(
                self.deployment().clone(),
                Arc::new(crate::lease::lock::PlainSpec::new(key)),
            ))),
            Fairness::Fifo { entry_ttl } => {
                let dep = self.deployment();
                if hash_tag(key.as_bytes()).len() == key.len() {
                    return Err(Error::InvalidArgument(format!(
                        "a first-in-first-out lock keeps its queue beside the lock, so its key \
                         needs a non-empty hash tag; {key:?} has none (name it with a {{tag}})"
                    )));
                }
                let shortest = dep.node_timeout() * 3;
                if entry_ttl <= shortest || entry_ttl > MAX_TTL {
                    return Err(Error::InvalidArgument(format!(
                        "queue entry ttl {entry_ttl:?} must be above three node timeouts \
                         ({shortest:?}), so that a waiter can refresh it in time, and at most \
                         {MAX_TTL:?}"
                    )));
                }
                let entry_ms = u64::try_from(entry_ttl.as_millis().max(1)).unwrap_or(u64::MAX);
                Ok(self.keeping_holder(Lease::new(
                    dep.clone(),
                    Arc::new(FifoSpec {
                        keys: [
                            key.clone(),
                            format!("{key}:queue"),
                            format!("{key}:queue:expiry"),
                        ],
                        entry_ms,
                    }),
                )))
            }
        }
    }

    /// How its waiters are served.
    pub fn fairness(&self) -> Fairness {
        self.spec()
            .as_any()
            .and_then(|a| a.downcast_ref::<FifoSpec>())
            .map_or(Fairness::Barging, |f| Fairness::Fifo {
                entry_ttl: Duration::from_millis(f.entry_ms),
            })
    }
}

/// The keys and acquire script of a [`Fairness::Fifo`] lock.
pub(crate) struct FifoSpec {
    /// The lock, the queue's order and its entries' expiries.
    keys: [String; 3],
    entry_ms: u64,
}

impl FifoSpec {
    /// The queue entry ms an attempt sends: none for the plain one.
    fn entry_arg(&self, waiting: bool) -> String {
        if waiting {
            self.entry_ms.to_string()
        } else {
            "0".to_owned()
        }
    }
}

impl Acquire<()> for FifoSpec {
    fn keys(&self) -> &[String] {
        &self.keys
    }

    fn wait_keys(&self) -> WaitKeys<'_> {
        // A change of the order (the head left) may make this waiter the
        // head of a free lock.
        WaitKeys::two(&self.keys[0], &self.keys[1])
    }

    fn attempt(
        &self,
        _dep: &Deployment,
        conn: &mut Conn,
        t: Try<'_>,
    ) -> Result<Attempt<Granted<()>>> {
        let keys: Vec<&str> = self.keys.iter().map(String::as_str).collect();
        let ttl = t.ttl_ms.to_string();
        let entry = self.entry_arg(t.waiting);
        let reply: Vec<redis::Value> = conn
            .script(
                &scripts::FIFO_ACQUIRE,
                &keys,
                &[t.owner.as_str(), &ttl, &entry],
                "acquire",
                t.deadline,
            )
            .map_err(|e| bad_key_in(e, &keys))?;
        match reply.as_slice() {
            // A grant found in place may be an earlier attempt's whose reply
            // was lost: its expiry counts from that attempt at the earliest.
            [redis::Value::Int(1)] => Ok(Attempt::Acquired(Granted {
                grant: (),
                ops: Ops::string_value(&self.keys[0], t.owner.as_str().to_owned()),
                sent: dated(t.uncertain_since, t.sent),
            })),
            [
                redis::Value::Int(0),
                redis::Value::Int(wait),
                redis::Value::Int(_),
            ] => Ok(Attempt::Busy(busy(*wait))),
            other => Err(Error::UnexpectedReply {
                op: "acquire",
                reply: format!("{other:?}"),
            }),
        }
    }

    fn order(&self) -> Order {
        Order::Server {
            refresh: Duration::from_millis(self.entry_ms / 3),
        }
    }

    fn clean_up(&self, owner: &OwnerToken) -> redis::Cmd {
        string_clean_up(&self.keys[0], owner)
    }

    fn stopped_waiting(&self, dep: &Deployment, owner: &OwnerToken, by: Instant) {
        let (queue, expiry) = (self.keys[1].as_str(), self.keys[2].as_str());
        let now = dep.now();
        let deadline = by.min(now + dep.node_timeout());
        if deadline > now {
            let (withdrawn, _) = dep.on_key(queue, deadline, Connect::Within, |conn, deadline| {
                conn.script::<i64>(
                    &scripts::FIFO_WITHDRAW,
                    &[queue, expiry],
                    &[owner.as_str()],
                    "leave queue",
                    deadline,
                )
            });
            match withdrawn {
                Ok(_) => return,
                Err(e) if !e.is_retryable() && !e.is_uncertain() => {
                    log::warn!(
                        "could not take a waiter out of the queue {queue:?} ({e}); it holds \
                         up those behind it until its entry expires"
                    );
                    return;
                }
                Err(e) => log::debug!(
                    "taking a waiter out of the queue {queue:?}: {e}; retrying in the background"
                ),
            }
        }
        // No time left in the wait's bound, or no answer in it: the server's
        // executor sends it (it is idempotent) until the entry would have
        // expired by itself.
        dep.in_background(
            queue,
            scripts::FIFO_WITHDRAW.eval(&[queue, expiry], &[owner.as_str()]),
            now + Duration::from_millis(self.entry_ms),
        );
    }

    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("key", &self.keys[0])
            .field("fairness", &"fifo")
            .field("entry_ttl_ms", &self.entry_ms)
            .finish()
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}
