//! [`MetricsObserver`]: the events as `metrics` counters and histograms
//! (feature `metrics`).

use metrics::{Label, counter, histogram};

use super::{
    AttemptEvent, ContentionEvent, GrantEvent, LossEvent, Observer, PollingEvent, Primitive,
    ReleaseEvent, RenewalEvent, TopologyChange, TopologyEvent, WaitEndEvent, release_name,
};

/// Turns a key into the value of the `key` label, or `None` for no label.
type KeyLabel = dyn Fn(&str) -> Option<String> + Send + Sync;

/// An [`Observer`] that records through the [`metrics`] facade, to whatever
/// recorder the program installed. Needs the `metrics` feature.
///
/// Every metric has the label `primitive` ([`Primitive::as_str`]); those of a
/// lease or an acquire call also `key` when a key-label function was given
/// ([`with_key_label`](MetricsObserver::with_key_label)) and returns a value
/// for the key. Without one there is no key label, so the number of series
/// does not grow with the number of keys.
///
/// A set of leases taken all or nothing counts as its leases: one call of a
/// set of three keys adds three attempts and three grants (or three ends of
/// the one reason), each with that call's wait, so that grants and releases
/// count the same leases, and a key label says which keys of the set were
/// contended.
///
/// | metric | kind | labels beside `primitive` (and `key`) |
/// |---|---|---|
/// | `respire_acquire_attempts_total` | counter | |
/// | `respire_acquire_grants_total` | counter | |
/// | `respire_acquire_contended_total` | counter | |
/// | `respire_acquire_not_granted_total` | counter | `reason`: `busy`, `timed_out`, `cancelled`, `failed` |
/// | `respire_acquire_wait_seconds` | histogram | `outcome`: `granted` or a `reason` |
/// | `respire_lease_renewals_total` | counter | |
/// | `respire_lease_renewal_margin_seconds` | histogram | |
/// | `respire_lease_losses_total` | counter | `cause` ([`LossCause::as_str`](crate::LossCause::as_str)) |
/// | `respire_lease_releases_total` | counter | `outcome`: `released`, `expired`, `taken_over`, `uncertain`, `failed` |
/// | `respire_topology_changes_total` | counter | `change`: `primary_switched`, `slots_moved` (no `primitive`) |
/// | `respire_polling_fallbacks_total` | counter | (no `primitive`) |
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub struct MetricsObserver {
    key_label: Option<Box<KeyLabel>>,
}

impl Default for MetricsObserver {
    fn default() -> Self {
        MetricsObserver::new()
    }
}

impl std::fmt::Debug for MetricsObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsObserver")
            .field("key_label", &self.key_label.is_some())
            .finish()
    }
}

impl MetricsObserver {
    /// An observer without a key label.
    pub fn new() -> Self {
        MetricsObserver { key_label: None }
    }

    /// Labels each lease's and acquire call's metrics with `key =
    /// label(physical key)` when it returns `Some`: the identity
    /// (`|k| Some(k.to_owned())`) for one series per key, or a function that
    /// keeps the part of the key that names a small set (a prefix, a table).
    /// The function runs on the library's threads and must not block.
    /// Defaults to no key label.
    pub fn with_key_label(
        mut self,
        label: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.key_label = Some(Box::new(label));
        self
    }

    fn labels(&self, key: &str, primitive: Primitive) -> Vec<Label> {
        let mut labels = vec![Label::new("primitive", primitive.as_str())];
        if let Some(value) = self.key_label.as_ref().and_then(|f| f(key)) {
            labels.push(Label::new("key", value));
        }
        labels
    }

    fn with(
        &self,
        key: &str,
        primitive: Primitive,
        name: &'static str,
        value: &'static str,
    ) -> Vec<Label> {
        let mut labels = self.labels(key, primitive);
        labels.push(Label::new(name, value));
        labels
    }
}

impl Observer for MetricsObserver {
    fn attempt(&self, e: &AttemptEvent<'_>) {
        counter!(
            "respire_acquire_attempts_total",
            self.labels(e.key, e.primitive)
        )
        .increment(1);
    }

    fn granted(&self, e: &GrantEvent<'_>) {
        counter!(
            "respire_acquire_grants_total",
            self.labels(e.key, e.primitive)
        )
        .increment(1);
        let labels = self.with(e.key, e.primitive, "outcome", "granted");
        histogram!("respire_acquire_wait_seconds", labels).record(e.waited.as_secs_f64());
    }

    fn contended(&self, e: &ContentionEvent<'_>) {
        counter!(
            "respire_acquire_contended_total",
            self.labels(e.key, e.primitive)
        )
        .increment(1);
    }

    fn wait_ended(&self, e: &WaitEndEvent<'_>) {
        let reason = e.reason.as_str();
        let labels = self.with(e.key, e.primitive, "reason", reason);
        counter!("respire_acquire_not_granted_total", labels).increment(1);
        let labels = self.with(e.key, e.primitive, "outcome", reason);
        histogram!("respire_acquire_wait_seconds", labels).record(e.waited.as_secs_f64());
    }

    fn renewed(&self, e: &RenewalEvent<'_>) {
        counter!(
            "respire_lease_renewals_total",
            self.labels(e.key, e.primitive)
        )
        .increment(1);
        histogram!(
            "respire_lease_renewal_margin_seconds",
            self.labels(e.key, e.primitive)
        )
        .record(e.margin.as_secs_f64());
    }

    fn lost(&self, e: &LossEvent<'_>) {
        let labels = self.with(e.key, e.primitive, "cause", e.cause.as_str());
        counter!("respire_lease_losses_total", labels).increment(1);
    }

    fn released(&self, e: &ReleaseEvent<'_>) {
        let labels = self.with(e.key, e.primitive, "outcome", release_name(e.outcome));
        counter!("respire_lease_releases_total", labels).increment(1);
    }

    fn topology_changed(&self, e: &TopologyEvent<'_>) {
        let change = match e.change {
            TopologyChange::PrimarySwitched { .. } => "primary_switched",
            TopologyChange::SlotsMoved { .. } => "slots_moved",
        };
        counter!("respire_topology_changes_total", "change" => change).increment(1);
    }

    fn polling(&self, _: &PollingEvent<'_>) {
        counter!("respire_polling_fallbacks_total").increment(1);
    }
}
