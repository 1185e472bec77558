//! What the library says of the lease a run holds: an [`Observer`] on every
//! coordinator and Redlock group the tool makes hears each loss with its
//! [`LossCause`](respire_coordination::LossCause) and detail, which the run
//! reports (never a guess of its own), and each confirmed renewal, which
//! moves the loss deadline the run gives its guardian.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use respire_coordination::{LossEvent, Observer, RenewalEvent};

/// A loss as the library reported it.
pub(crate) struct Loss {
    /// The library's cause (`LossCause::as_str`): `expired`,
    /// `renewal_unconfirmed`, `gone`, `taken_over` or `other`.
    pub(crate) cause: &'static str,
    /// The library's detail.
    pub(crate) reason: String,
}

/// Passes every loss and renewal the library reports to the run.
struct Recorder {
    losses: Sender<Loss>,
    renewals: Sender<()>,
}

impl Observer for Recorder {
    fn lost(&self, event: &LossEvent<'_>) {
        let _ = self.losses.send(Loss {
            cause: event.cause.as_str(),
            reason: event.detail.to_owned(),
        });
    }

    fn renewed(&self, _: &RenewalEvent<'_>) {
        // One wake-up pending is enough: the run reads the new deadline.
        let _ = self.renewals.try_send(());
    }
}

/// The observer and the receiving ends of what it hears, one per process.
struct Channels {
    observer: Arc<dyn Observer>,
    losses: Receiver<Loss>,
    renewals: Receiver<()>,
}

fn channels() -> &'static Channels {
    static CHANNELS: OnceLock<Channels> = OnceLock::new();
    CHANNELS.get_or_init(|| {
        let (losses_tx, losses) = crossbeam_channel::unbounded();
        let (renewals_tx, renewals) = crossbeam_channel::bounded(1);
        Channels {
            observer: Arc::new(Recorder {
                losses: losses_tx,
                renewals: renewals_tx,
            }),
            losses,
            renewals,
        }
    })
}

/// The observer to give every coordinator and Redlock group.
pub(crate) fn observer() -> Arc<dyn Observer> {
    channels().observer.clone()
}

/// Forgets the losses reported so far (those of earlier leases).
pub(crate) fn forget() {
    while channels().losses.try_recv().is_ok() {}
}

/// The first loss reported since [`forget`]: the library reports a loss
/// right after it closes the lease's loss signal, so a run that saw the
/// signal close waits for it, at most `within`.
pub(crate) fn first(within: Duration) -> Option<Loss> {
    channels().losses.recv_timeout(within).ok()
}

/// Delivers a message after each confirmed renewal (several may come as
/// one), for `crossbeam_channel::select!`.
pub(crate) fn renewals() -> &'static Receiver<()> {
    &channels().renewals
}
