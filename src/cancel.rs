//! Cancellation of unbounded waits.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// The wake-up channels of the waits blocked on this token now, by id:
    /// such a wait sleeps on its one channel (a receive on several, in
    /// `select!`, costs the thread that wakes it a lock hand-over), and
    /// cancellation sends to it there.
    wakers: Mutex<Vec<(u64, Sender<()>)>>,
    next_id: AtomicU64,
}

/// A wait's wake-up channel registered with a token: [`CancelToken::cancel`]
/// sends to it until this is dropped.
pub(crate) struct OnCancel {
    inner: Arc<Inner>,
    id: u64,
}

impl Drop for OnCancel {
    fn drop(&mut self) {
        self.inner.wakers.lock().retain(|(id, _)| *id != self.id);
    }
}

impl CancelToken {
    /// A token that is not cancelled.
    pub fn new() -> Self {
        let (tx, rx) = crossbeam_channel::bounded(0);
        CancelToken {
            inner: Arc::new(Inner {
                sender: Mutex::new(Some(tx)),
                receiver: rx,
                wakers: Mutex::new(Vec::new()),
                next_id: AtomicU64::new(0),
            }),
        }
    }

    /// Cancels every wait using this token, now and later. Does not block.
    pub fn cancel(&self) {
        self.inner.sender.lock().take();
        for (_, wake) in self.inner.wakers.lock().iter() {
            // A full channel already holds a wake-up.
            let _ = wake.try_send(());
        }
    }

    /// Sends to `wake` on cancellation, until the result is dropped. A wait
    /// registers before it checks [`is_cancelled`](CancelToken::is_cancelled)
    /// and sleeps: a cancellation before the registration is seen by the
    /// check, one after it sends.
    pub(crate) fn wake_on_cancel(&self, wake: Sender<()>) -> OnCancel {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        self.inner.wakers.lock().push((id, wake));
        OnCancel {
            inner: self.inner.clone(),
            id,
        }
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

#[cfg(test)]
impl CancelToken {
    /// Whether no wait is registered to be woken.
    pub(crate) fn inner_wakers_is_empty(&self) -> bool {
        self.inner.wakers.lock().is_empty()
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
