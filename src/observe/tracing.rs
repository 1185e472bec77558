//! [`TracingObserver`]: the events as `tracing` spans and events (feature
//! `tracing`).

use std::cell::RefCell;
use std::collections::HashMap;

use parking_lot::Mutex;
use tracing::field::Empty;
use tracing::span::EnteredSpan;
use tracing::{Span, debug, info, info_span, warn};

use super::{
    AttemptEvent, ContentionEvent, GrantEvent, LossEvent, Observer, PollingEvent, ReleaseEvent,
    RenewalEvent, TopologyChange, TopologyEvent, WaitEndEvent, release_name,
};

thread_local! {
    /// The acquire calls in progress on this thread and their keys, innermost
    /// last.
    static ACQUIRING: RefCell<Vec<(String, EnteredSpan)>> = const { RefCell::new(Vec::new()) };
}

/// An [`Observer`] that reports through [`tracing`]: a span per acquire call
/// and a span per held lease, events for the rest. Needs the `tracing`
/// feature.
///
/// - `respire.acquire` (INFO; fields `key`, `primitive`, `waits`, and at its
///   end `outcome` — `granted` or a [`WaitEnd`](crate::WaitEnd) name — and
///   `waited_ms`): entered on the calling thread from the start of the call to
///   its end, so that what the library logs meanwhile is inside it; a
///   contention is a DEBUG event in it. A set of leases taken all or nothing
///   has one per lease, each entered inside the one before (in the order the
///   keys were given), all ended when the call ends; a contention is then in
///   the span of the lease found held.
/// - `respire.lease` (INFO; fields `key`, `primitive`, `lease`, `token`):
///   from the grant to the release, a child of the span the caller was in
///   and following from its acquire span. Renewals (DEBUG, with `margin_ms`
///   and `ttl_ms`), the loss (WARN, with `cause` and `detail`) and the release
///   (INFO, with `outcome`) are events in it.
/// - A topology change (INFO) and the fall-back to polling (WARN) are events
///   in the span current on the thread that reports them.
///
/// Keys are recorded as they are: spans are not metrics, and a subscriber
/// chooses what to keep.
#[derive(Default)]
#[cfg_attr(docsrs, doc(cfg(feature = "tracing")))]
pub struct TracingObserver {
    leases: Mutex<HashMap<u64, Span>>,
}

impl TracingObserver {
    /// A new observer; spans go to the subscriber current where each event
    /// happens.
    pub fn new() -> Self {
        TracingObserver::default()
    }

    fn lease(&self, id: u64) -> Span {
        self.leases
            .lock()
            .get(&id)
            .cloned()
            .unwrap_or_else(Span::none)
    }
}

impl std::fmt::Debug for TracingObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TracingObserver")
            .field("leases", &self.leases.lock().len())
            .finish()
    }
}

/// Ends the innermost acquire span of this thread for `key` with `outcome`.
fn end_acquire(key: &str, outcome: &str, waited: std::time::Duration) -> Span {
    let entered = ACQUIRING.with(|a| {
        let mut a = a.borrow_mut();
        let at = a.iter().rposition(|(k, _)| k == key)?;
        Some(a.remove(at).1)
    });
    let span = entered.map_or_else(Span::none, EnteredSpan::exit);
    span.record("outcome", outcome);
    span.record("waited_ms", waited.as_secs_f64() * 1e3);
    span
}

impl Observer for TracingObserver {
    fn attempt(&self, e: &AttemptEvent<'_>) {
        let span = info_span!(
            "respire.acquire",
            key = e.key,
            primitive = e.primitive.as_str(),
            waits = e.waits,
            outcome = Empty,
            waited_ms = Empty,
        );
        ACQUIRING.with(|a| a.borrow_mut().push((e.key.to_owned(), span.entered())));
    }

    fn contended(&self, e: &ContentionEvent<'_>) {
        let holder_ttl_ms = e.holder_ttl.map(|t| t.as_millis() as u64);
        let span = ACQUIRING.with(|a| {
            let a = a.borrow();
            let found = a.iter().rev().find(|(k, _)| k == e.key);
            found.map(|(_, s)| Span::clone(s))
        });
        match span {
            Some(span) => debug!(parent: &span, holder_ttl_ms, "held by another owner"),
            None => debug!(holder_ttl_ms, "held by another owner"),
        }
    }

    fn granted(&self, e: &GrantEvent<'_>) {
        let acquire = end_acquire(e.key, "granted", e.waited);
        let token = e.token.map(|t| t.get());
        let lease = info_span!(
            "respire.lease",
            key = e.key,
            primitive = e.primitive.as_str(),
            lease = e.lease.get(),
            token,
        );
        lease.follows_from(&acquire);
        self.leases.lock().insert(e.lease.get(), lease);
    }

    fn wait_ended(&self, e: &WaitEndEvent<'_>) {
        drop(end_acquire(e.key, e.reason.as_str(), e.waited));
    }

    fn renewed(&self, e: &RenewalEvent<'_>) {
        let span = self.lease(e.lease.get());
        debug!(
            parent: &span,
            margin_ms = e.margin.as_secs_f64() * 1e3,
            ttl_ms = e.ttl.as_millis() as u64,
            "renewed"
        );
    }

    fn lost(&self, e: &LossEvent<'_>) {
        let span = self.lease(e.lease.get());
        warn!(parent: &span, cause = e.cause.as_str(), detail = e.detail, "lease lost");
    }

    fn released(&self, e: &ReleaseEvent<'_>) {
        let span = self
            .leases
            .lock()
            .remove(&e.lease.get())
            .unwrap_or_else(Span::none);
        info!(parent: &span, outcome = release_name(e.outcome), "released");
    }

    fn topology_changed(&self, e: &TopologyEvent<'_>) {
        match e.change {
            TopologyChange::PrimarySwitched { from, to } => {
                info!(deployment = e.deployment, from, to, "primary switched");
            }
            TopologyChange::SlotsMoved { slots } => {
                info!(deployment = e.deployment, slots, "slots moved");
            }
        }
    }

    fn polling(&self, e: &PollingEvent<'_>) {
        warn!(
            server = e.server,
            reason = e.reason,
            "waits fall back to polling"
        );
    }
}
