//! The loop every timer thread runs: sleep until the earliest timer is due or a
//! message arrives, handle all messages waiting, run what is due; stop when every
//! sender is gone.

use std::time::Instant;

use crossbeam_channel::{Receiver, RecvTimeoutError};

/// A thread's timers and the messages that change them.
pub(crate) trait Timers {
    type Msg;
    /// When the earliest timer is due (`None`: no timer).
    fn next_due(&self) -> Option<Instant>;
    fn handle(&mut self, msg: Self::Msg);
    fn process_due(&mut self);
}

/// Runs `timers` until every sender of `rx` is dropped.
pub(crate) fn run<T: Timers>(rx: &Receiver<T::Msg>, mut timers: T) {
    loop {
        let msg = match timers.next_due() {
            Some(at) => rx.recv_timeout(at.saturating_duration_since(Instant::now())),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match msg {
            Ok(msg) => {
                timers.handle(msg);
                while let Ok(msg) = rx.try_recv() {
                    timers.handle(msg);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        timers.process_due();
    }
}
