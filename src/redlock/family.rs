//! The Redlock backend of the one guard API ([`Guard`]): a [`RedlockGuard`]
//! is used through the same verbs as a single-deployment lease.

use std::time::Duration;

use crossbeam_channel::Receiver;

use super::guard::{RedlockGuard, RedlockKeepAlive};
use crate::error::{Error, Result};
use crate::guard::{Guard, ReleaseOutcome, sealed};

impl sealed::Sealed for RedlockGuard {}

impl RedlockGuard {
    /// Gives the lock a new validity of `ttl` on a quorum of nodes: the
    /// [`Guard`] name of [`extend`](RedlockGuard::extend), which it calls, with
    /// the same blocking, results and errors.
    pub fn reset_expiry(&self, ttl: Duration) -> Result<bool> {
        self.extend(ttl)
    }
}

/// The Redlock backend: [`reset_expiry`](Guard::reset_expiry) is
/// [`RedlockGuard::extend`], and [`release`](Guard::release) is
/// [`RedlockGuard::release`] read as an outcome: `true` (a quorum deleted it)
/// is [`ReleaseOutcome::Released`], `false` (a quorum answered, but it had
/// lapsed on some of them) [`ReleaseOutcome::Expired`], and
/// [`Error::QuorumNotReached`] [`ReleaseOutcome::Uncertain`] (the nodes that
/// did not answer keep the release and send it when they can; the lock ends
/// at its expiry at the latest). Other errors are returned.
impl Guard for RedlockGuard {
    type KeepAlive<'a> = RedlockKeepAlive<'a>;

    fn key(&self) -> &str {
        RedlockGuard::key(self)
    }
    fn is_lost(&self) -> bool {
        RedlockGuard::is_lost(self)
    }
    fn lost_signal(&self) -> &Receiver<()> {
        RedlockGuard::lost_signal(self)
    }
    fn remaining_estimate(&self) -> Duration {
        RedlockGuard::remaining_estimate(self)
    }
    fn reset_expiry(&self, ttl: Duration) -> Result<bool> {
        RedlockGuard::extend(self, ttl)
    }
    fn keep_alive(&self) -> Result<RedlockKeepAlive<'_>> {
        RedlockGuard::keep_alive(self)
    }
    fn release(mut self) -> Result<ReleaseOutcome> {
        match RedlockGuard::release(&mut self) {
            Ok(true) => Ok(ReleaseOutcome::Released),
            Ok(false) => Ok(ReleaseOutcome::Expired),
            Err(Error::QuorumNotReached { .. }) => Ok(ReleaseOutcome::Uncertain),
            Err(e) => Err(e),
        }
    }
}
