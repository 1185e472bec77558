//! Why a lease was lost, in the library's words: an [`Observer`] on every
//! coordinator and Redlock group the tool makes hears each loss with its
//! [`LossCause`] and detail, and the run reports those, never a guess of its
//! own.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use respire_coordination::{LossEvent, Observer};

/// A loss as the library reported it.
pub(crate) struct Loss {
    /// The library's cause (`LossCause::as_str`): `expired`,
    /// `renewal_unconfirmed`, `gone`, `taken_over` or `other`.
    pub(crate) cause: &'static str,
    /// The library's detail.
    pub(crate) reason: String,
}

/// Passes every loss the library reports to the run.
struct Recorder(Sender<Loss>);

impl Observer for Recorder {
    fn lost(&self, event: &LossEvent<'_>) {
        let _ = self.0.send(Loss {
            cause: event.cause.as_str(),
            reason: event.detail.to_owned(),
        });
    }
}

/// The observer and the receiving end of what it hears, one per process.
fn channel() -> &'static (Arc<dyn Observer>, Receiver<Loss>) {
    static CHANNEL: OnceLock<(Arc<dyn Observer>, Receiver<Loss>)> = OnceLock::new();
    CHANNEL.get_or_init(|| {
        let (tx, rx) = crossbeam_channel::unbounded();
        (Arc::new(Recorder(tx)), rx)
    })
}

/// The observer to give every coordinator and Redlock group.
pub(crate) fn observer() -> Arc<dyn Observer> {
    channel().0.clone()
}

/// Forgets the losses reported so far (those of earlier leases).
pub(crate) fn forget() {
    while channel().1.try_recv().is_ok() {}
}

/// The first loss reported since [`forget`]: the library reports a loss
/// right after it closes the lease's loss signal, so a run that saw the
/// signal close waits for it, at most `within`.
pub(crate) fn first(within: Duration) -> Option<Loss> {
    channel().1.recv_timeout(within).ok()
}
