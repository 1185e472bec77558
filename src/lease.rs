//! The part every single-deployment guard shares: the lease's key and value, its
//! local validity, the lost flag and loss signal, and the verify / extend /
//! release operations.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use crate::coordinator::Shared;
use crate::error::{Error, Result};
use crate::keys;
use crate::runtime::clock::{self, Validity};
use crate::runtime::renewal::{self, KeepAlive};
use crate::scripts;

/// What [`release`](crate::LockGuard::release) found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReleaseOutcome {
    /// The lease was still ours and is now deleted.
    Released,
    /// The key was gone: the lease had expired (or was deleted by someone else).
    Expired,
    /// Someone else holds the key now: the lease expired and was taken over (or the
    /// key was overwritten). Their lease was left alone.
    TakenOver,
    /// The release got no answer (timeout or connection failure): it may or may not
    /// have happened. The lease ends at its expiry at the latest.
    Uncertain,
}

/// State shared between a guard and the renewal runtime.
pub(crate) struct LeaseState {
    pub(crate) id: u64,
    pub(crate) key: String,
    pub(crate) value: String,
    ttl_ms: AtomicU64,
    sent: AtomicU64,
    valid_until: AtomicU64,
    lost_at: AtomicU64,
    lost: AtomicBool,
    done: AtomicBool,
    /// Set while an extension (renewal or `reset_expiry`) of this lease is in
    /// flight: extensions of one lease never overlap, so each confirmation's
    /// expiry is the one the server applied last.
    extending: AtomicBool,
    keepalives: AtomicUsize,
    loss_tx: Mutex<Option<Sender<()>>>,
    loss_rx: Receiver<()>,
    pub(crate) drift_factor: f64,
    pub(crate) node_timeout: Duration,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl LeaseState {
    pub(crate) fn new(
        key: String,
        value: String,
        sent: Instant,
        ttl_ms: u64,
        drift_factor: f64,
        node_timeout: Duration,
    ) -> Self {
        let (tx, rx) = crossbeam_channel::bounded(0);
        let v = Validity::from_send(
            sent,
            Duration::from_millis(ttl_ms),
            drift_factor,
            node_timeout,
        );
        LeaseState {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            key,
            value,
            ttl_ms: AtomicU64::new(ttl_ms),
            sent: AtomicU64::new(clock::to_ns(sent)),
            valid_until: AtomicU64::new(clock::to_ns(v.valid_until)),
            lost_at: AtomicU64::new(clock::to_ns(v.lost_at)),
            lost: AtomicBool::new(false),
            done: AtomicBool::new(false),
            extending: AtomicBool::new(false),
            keepalives: AtomicUsize::new(0),
            loss_tx: Mutex::new(Some(tx)),
            loss_rx: rx,
            drift_factor,
            node_timeout,
        }
    }

    pub(crate) fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms.load(Ordering::Acquire))
    }

    pub(crate) fn ttl_ms(&self) -> u64 {
        self.ttl_ms.load(Ordering::Acquire)
    }

    /// When the last confirmed grant or renewal was sent.
    pub(crate) fn sent(&self) -> Instant {
        clock::from_ns(self.sent.load(Ordering::Acquire))
    }

    /// Whether the lost flag is set (the deadline alone does not set it).
    pub(crate) fn flagged_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    pub(crate) fn lost_at(&self) -> Instant {
        clock::from_ns(self.lost_at.load(Ordering::Acquire))
    }

    pub(crate) fn valid_until(&self) -> Instant {
        clock::from_ns(self.valid_until.load(Ordering::Acquire))
    }

    /// Records a confirmed grant or renewal sent at `sent` with `ttl_ms`. Never
    /// moves the deadlines back for a confirmation of an older send.
    pub(crate) fn confirm(&self, sent: Instant, ttl_ms: u64) {
        let v = Validity::from_send(
            sent,
            Duration::from_millis(ttl_ms),
            self.drift_factor,
            self.node_timeout,
        );
        self.ttl_ms.store(ttl_ms, Ordering::Release);
        self.sent.store(clock::to_ns(sent), Ordering::Release);
        self.valid_until
            .store(clock::to_ns(v.valid_until), Ordering::Release);
        self.lost_at
            .store(clock::to_ns(v.lost_at), Ordering::Release);
    }

    /// Flags the lease lost and fires the loss signal (once).
    pub(crate) fn mark_lost(&self, why: &str) {
        if !self.lost.swap(true, Ordering::AcqRel) && !self.done.load(Ordering::Acquire) {
            log::warn!("lease {:?} lost: {why}", self.key);
        }
        self.loss_tx.lock().take();
    }

    /// Lost: flagged, or past the local loss deadline.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire) || Instant::now() >= self.lost_at()
    }

    /// Claims the right to extend this lease; `false` if an extension is in flight.
    pub(crate) fn try_begin_extend(&self) -> bool {
        self.extending
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    pub(crate) fn end_extend(&self) {
        self.extending.store(false, Ordering::Release);
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    pub(crate) fn keepalive_count(&self) -> usize {
        self.keepalives.load(Ordering::Acquire)
    }

    pub(crate) fn add_keepalive(&self) {
        self.keepalives.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn remove_keepalive(&self) {
        self.keepalives.fetch_sub(1, Ordering::AcqRel);
    }

    pub(crate) fn remaining(&self) -> Duration {
        self.valid_until().saturating_duration_since(Instant::now())
    }

    /// Marks the lease finished by its holder (released or given up): it counts
    /// as lost from now on, without a loss warning, and the loss signal fires.
    pub(crate) fn finish(&self) {
        self.done.store(true, Ordering::Release);
        self.lost.store(true, Ordering::Release);
        self.loss_tx.lock().take();
    }

    /// The channel that disconnects on loss or [`finish`](LeaseState::finish).
    pub(crate) fn loss_signal(&self) -> &Receiver<()> {
        &self.loss_rx
    }
}

/// One held lease on one deployment: what `LockGuard` and `FencedGuard` are made of.
pub(crate) struct LeaseCore {
    pub(crate) shared: Arc<Shared>,
    pub(crate) state: Arc<LeaseState>,
}

impl LeaseCore {
    /// Wraps a lease just granted by a command sent at `sent`, and lets the
    /// runtime fire its loss signal at the deadline.
    pub(crate) fn new(
        shared: Arc<Shared>,
        key: String,
        value: String,
        sent: Instant,
        ttl_ms: u64,
    ) -> Self {
        let state = Arc::new(LeaseState::new(
            key,
            value,
            sent,
            ttl_ms,
            shared.drift_factor,
            shared.node_timeout(),
        ));
        shared.renewal().track(state.clone());
        LeaseCore { shared, state }
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.state.is_lost()
    }

    pub(crate) fn lost_signal(&self) -> &Receiver<()> {
        &self.state.loss_rx
    }

    pub(crate) fn remaining_estimate(&self) -> Duration {
        if self.state.lost.load(Ordering::Acquire) {
            return Duration::ZERO;
        }
        self.state.remaining()
    }

    pub(crate) fn verify_still_held(&self) -> Result<Option<Duration>> {
        let timeout = self.shared.node_timeout();
        let mut conn = self.shared.pool.get(timeout)?;
        let reply: Vec<i64> = conn
            .script(
                &scripts::LEASE_VERIFY,
                &[&self.state.key],
                &[&self.state.value],
                "verify",
                timeout,
            )
            .map_err(|e| self.shared.bad_key(e, &self.state.key))?;
        match reply.as_slice() {
            [1, pttl] => Ok(Some(if *pttl < 0 {
                Duration::MAX
            } else {
                Duration::from_millis(*pttl as u64)
            })),
            [0] => {
                self.state.mark_lost("the key is gone (expired or deleted)");
                Ok(None)
            }
            _ => {
                self.state.mark_lost("another owner holds the key");
                Ok(None)
            }
        }
    }

    pub(crate) fn reset_expiry(&self, ttl: Duration) -> Result<bool> {
        let ttl_ms = self.shared.check_ttl(ttl)?;
        let timeout = self.shared.node_timeout();
        // Wait for a renewal of this lease that is in flight (at most a node
        // timeout): two extensions racing could leave the server with the older
        // expiry while we count on the newer one.
        let waited = Instant::now();
        while !self.state.try_begin_extend() {
            if waited.elapsed() >= timeout {
                return Err(Error::Timeout {
                    op: "reset expiry (waiting for a renewal in flight)",
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        struct Claim<'a>(&'a LeaseState);
        impl Drop for Claim<'_> {
            fn drop(&mut self) {
                self.0.end_extend();
            }
        }
        let _claim = Claim(&self.state);
        let mut conn = self.shared.pool.get(timeout)?;
        let ttl_arg = ttl_ms.to_string();
        let sent = Instant::now();
        let reply: i64 = conn.script(
            &scripts::LEASE_EXTEND,
            &[&self.state.key],
            &[&self.state.value, &ttl_arg],
            "reset expiry",
            timeout,
        )?;
        drop(conn);
        match reply {
            1 => {
                self.state.confirm(sent, ttl_ms);
                self.shared.renewal().reschedule(self.state.id);
                Ok(true)
            }
            0 => {
                self.state.mark_lost("the key is gone (expired or deleted)");
                Ok(false)
            }
            _ => {
                self.state.mark_lost("another owner holds the key");
                Ok(false)
            }
        }
    }

    pub(crate) fn keep_alive(&self) -> Result<KeepAlive<'_>> {
        let ttl = self.state.ttl();
        let min = clock::min_keepalive_ttl(self.shared.drift_factor, self.shared.node_timeout());
        if ttl < min {
            return Err(Error::InvalidArgument(format!(
                "ttl {ttl:?} is too short for keep-alive with a node timeout of {:?}: \
                 use at least {min:?}",
                self.shared.node_timeout()
            )));
        }
        self.shared.check_keepalive_rights()?;
        Ok(renewal::start(&self.shared, &self.state))
    }

    /// One compare-and-delete, taking at most the node timeout in all (getting a
    /// connection included); transport failures become `Uncertain`.
    pub(crate) fn release(&self) -> Result<ReleaseOutcome> {
        self.state.done.store(true, Ordering::Release);
        self.shared.renewal().forget(self.state.id);
        let deadline = Instant::now() + self.shared.node_timeout();
        let reply: Result<i64> = self
            .shared
            .pool
            .get_within(self.shared.node_timeout())
            .and_then(|mut conn| {
                let left = deadline.saturating_duration_since(Instant::now());
                conn.script(
                    &scripts::LEASE_RELEASE,
                    &[&self.state.key],
                    &[&self.state.value, "exact"],
                    "release",
                    left.max(Duration::from_millis(1)),
                )
            });
        // The guard is finished either way; wake anyone select!-ing on it.
        self.state.lost.store(true, Ordering::Release);
        self.state.loss_tx.lock().take();
        match reply {
            Ok(1) => Ok(ReleaseOutcome::Released),
            Ok(0) => Ok(ReleaseOutcome::Expired),
            Ok(_) => Ok(ReleaseOutcome::TakenOver),
            Err(e) if e.is_uncertain() || e.is_timeout() || matches!(e, Error::Connect { .. }) => {
                log::warn!(
                    "release of {:?} is uncertain ({e}); it ends at its expiry at the latest",
                    self.state.key
                );
                Ok(ReleaseOutcome::Uncertain)
            }
            Err(e) => Err(e),
        }
    }

    pub(crate) fn debug_fields(&self, d: &mut fmt::DebugStruct<'_, '_>) {
        d.field("key", &self.state.key)
            .field("lost", &self.is_lost())
            .field("remaining_estimate", &self.remaining_estimate());
    }
}

impl Drop for LeaseCore {
    fn drop(&mut self) {
        if self.state.is_done() {
            return;
        }
        match self.release() {
            Ok(outcome) => log::debug!("dropped lease {:?}: {outcome:?}", self.state.key),
            Err(e) => log::warn!("dropping lease {:?}: release failed: {e}", self.state.key),
        }
    }
}

/// Validates a TTL against the crate's limits and the coordinator's timeouts.
pub(crate) fn check_ttl(ttl: Duration, drift_factor: f64, node_timeout: Duration) -> Result<u64> {
    let ms = keys::ttl_ms(ttl)?;
    if !clock::usable_ttl(Duration::from_millis(ms), drift_factor, node_timeout) {
        return Err(Error::InvalidArgument(format!(
            "ttl {ttl:?} is not longer than the node timeout ({node_timeout:?}) plus clock \
             drift: the lease would count as lost as soon as it was granted"
        )));
    }
    Ok(ms)
}

/// The methods every single-deployment guard has, forwarding to its
/// `core: LeaseCore`; `$what` names the thing held ("lock", "lease").
macro_rules! lease_guard_methods {
    ($what:literal) => {
        /// The physical key.
        pub fn key(&self) -> &str {
            &self.core.state.key
        }

        #[doc = concat!(
            "Whether the ", $what, " is lost: its local loss deadline (send time of the \
             grant or last confirmed renewal + TTL − drift − node timeout) passed, or a \
             renewal, verification or extension found it expired or taken over. Does \
             not block or touch the network."
        )]
        pub fn is_lost(&self) -> bool {
            self.core.is_lost()
        }

        #[doc = concat!(
            "A channel that disconnects when the ", $what, " is lost or released; use \
             it in `crossbeam_channel::select!`. It never delivers a message."
        )]
        pub fn lost_signal(&self) -> &crossbeam_channel::Receiver<()> {
            self.core.lost_signal()
        }

        #[doc = concat!(
            "How long the ", $what, " can still be assumed held: on the local monotonic \
             clock, from when the grant (or the last confirmed renewal) was *sent*, \
             minus clock drift. Zero once lost. Does not touch the network."
        )]
        pub fn remaining_estimate(&self) -> std::time::Duration {
            self.core.remaining_estimate()
        }

        /// Asks Redis whether the key still holds this guard's owner token. One
        /// round trip. Returns `Some(server-side TTL)` when held, `None` (and flags
        /// the guard lost) when not. Only says what was true at one instant.
        ///
        /// # Errors
        /// Transport errors (the guard is unchanged).
        pub fn verify_still_held(&self) -> $crate::Result<Option<std::time::Duration>> {
            self.core.verify_still_held()
        }

        #[doc = concat!(
            "Sets the ", $what, "'s expiry to `ttl` from now, if it is still held. Never \
             re-creates a missing key. Returns `false` (and flags the guard lost) when \
             the ", $what, " expired or was taken over: stop the work. Waits for a \
             keep-alive renewal of it in flight, at most a node timeout.\n\n\
             # Errors\n\
             [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad TTL; \
             transport errors (the outcome is then unknown and the local estimate \
             keeps the old expiry)."
        )]
        pub fn reset_expiry(&self, ttl: std::time::Duration) -> $crate::Result<bool> {
            self.core.reset_expiry(ttl)
        }

        #[doc = concat!(
            "Renews the ", $what, " in the background until the returned \
             [`KeepAlive`](crate::KeepAlive) is dropped; see there for when loss is \
             flagged.\n\n\
             # Errors\n\
             [`Error::InvalidArgument`](crate::Error::InvalidArgument) when the TTL is \
             too short to renew at half of it with a node timeout to spare; \
             [`Error::Permission`](crate::Error::Permission) when the ACL user may not \
             run `CLIENT ID` and `CLIENT KILL`; transport errors from that check."
        )]
        pub fn keep_alive(&self) -> $crate::Result<$crate::KeepAlive<'_>> {
            self.core.keep_alive()
        }

        #[doc = concat!(
            "Releases the ", $what, " if this guard still holds it. One round trip; \
             takes at most the node timeout in all.\n\n\
             Returns what it found: [`ReleaseOutcome::Released`](crate::ReleaseOutcome::Released), \
             `Expired`, `TakenOver` (the other holder keeps it), or `Uncertain` when no \
             reply came (the ", $what, " then ends at its expiry).\n\n\
             # Errors\n\
             Server errors such as a missing ACL right."
        )]
        pub fn release(self) -> $crate::Result<$crate::ReleaseOutcome> {
            self.core.release()
        }
    };
}
pub(crate) use lease_guard_methods;
