//! Cancellation of unbounded waits.

use std::fmt;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

/// Cancels waits: the `acquire` calls that block until they succeed.
///
/// Cloning gives another handle to the same token. [`CancelToken::cancel`] wakes
/// every wait that uses the token at once; they return [`Error::Cancelled`](crate::Error::Cancelled).
/// Cancellation is permanent.
///
/// The token's [`receiver`](CancelToken::receiver) becomes ready (disconnected) on
/// cancellation, so a program can wait on it in `crossbeam_channel::select!` beside
/// its own channels.
#[derive(Clone)]
pub struct CancelToken {
    inner: Arc<Inner>,
}

struct Inner {
    sender: Mutex<Option<Sender<()>>>,
    receiver: Receiver<()>,
}

impl CancelToken {
    /// A token that is not cancelled.
    pub fn new() -> Self {
        let (tx, rx) = crossbeam_channel::bounded(0);
        CancelToken {
            inner: Arc::new(Inner {
                sender: Mutex::new(Some(tx)),
                receiver: rx,
            }),
        }
    }

    /// Cancels every wait using this token, now and later. Does not block.
    pub fn cancel(&self) {
        self.inner.sender.lock().take();
    }

    /// Whether [`cancel`](CancelToken::cancel) was called.
    pub fn is_cancelled(&self) -> bool {
        self.inner.sender.lock().is_none()
    }

    /// A channel that never delivers a message and disconnects on cancellation:
    /// `recv()` on it blocks until the token is cancelled, then returns `Err`.
    pub fn receiver(&self) -> &Receiver<()> {
        &self.inner.receiver
    }
}

impl Default for CancelToken {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for CancelToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CancelToken")
            .field("cancelled", &self.is_cancelled())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn cancel_disconnects_every_clone() {
        let token = CancelToken::new();
        let clone = token.clone();
        assert!(!clone.is_cancelled());
        assert!(
            clone
                .receiver()
                .recv_timeout(Duration::from_millis(1))
                .unwrap_err()
                .is_timeout()
        );
        token.cancel();
        assert!(clone.is_cancelled());
        assert!(clone.receiver().recv().is_err());
    }
}
