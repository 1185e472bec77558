//! A Redlock lock's acquire handle: what the five verbs of
//! [`Lease<Redlock>`](crate::Lease) run — one attempt on every node, or a wait
//! that polls with jittered, doubling pauses (independent servers share no
//! invalidations to wake it).

use std::fmt;
use std::time::{Duration, Instant};

use super::attempt::Evidence;
use super::guard::{Redlock, RedlockGuard};
use super::{Group, RedlockAttempt, RedlockGroup};
use crate::cancel::CancelToken;
use crate::core::wait::WaitPolicy;
use crate::error::{Error, Result};
use crate::lease::guard::held::Handle;
use crate::lease::kind::Wait;
use crate::observe::{Acquiring, Primitive};
use crate::runtime::backoff::Backoff;
use crate::token::HolderTag;

/// The lock `key` of a group, and the holder its leases record.
#[derive(Clone)]
#[allow(
    unreachable_pub,
    reason = "named by the public `Backend`, but nameable only in this crate"
)]
pub struct RedlockHandle {
    /// A clone: the group's threads live while a handle does.
    group: RedlockGroup,
    key: String,
}

impl RedlockHandle {
    pub(super) fn new(group: RedlockGroup, key: &str) -> Self {
        RedlockHandle {
            group,
            key: key.to_owned(),
        }
    }

    fn inner(&self) -> &std::sync::Arc<Group> {
        &self.group.inner
    }

    /// One attempt, telling `seen` of contention.
    fn try_once(
        &self,
        ttl: Duration,
        seen: &mut Option<Acquiring<'_>>,
    ) -> Result<Option<RedlockGuard>> {
        let holder = self.group.holder.as_ref();
        let result = Group::attempt(self.inner(), &self.key, ttl, Evidence::Guard, holder)
            .and_then(RedlockAttempt::into_result);
        if matches!(result, Ok(None)) {
            Acquiring::busy(seen, None);
        }
        result
    }

    /// Attempts until one is granted, the wait ends or `cancel` is
    /// cancelled, pausing by the group's back-off after each that was not.
    fn wait_seen(
        &self,
        ttl: Duration,
        deadline: Option<Instant>,
        cancel: Option<&CancelToken>,
        seen: &mut Option<Acquiring<'_>>,
    ) -> Result<Option<RedlockGuard>> {
        let never = crossbeam_channel::never();
        let cancelled = cancel.map_or(&never, CancelToken::receiver);
        let options = &self.inner().options;
        let backoff = Backoff::new(options.retry_base, options.retry_max);
        let mut policy: WaitPolicy<Error> = WaitPolicy::new(deadline);
        loop {
            if cancel.is_some_and(CancelToken::is_cancelled) {
                return Err(Error::Cancelled);
            }
            match self.try_once(ttl, seen) {
                // Cancelled while the attempt was in flight: what it got is
                // released (by dropping it).
                Ok(Some(_)) if cancel.is_some_and(CancelToken::is_cancelled) => {
                    return Err(Error::Cancelled);
                }
                Ok(Some(guard)) => return Ok(Some(guard)),
                Ok(None) => policy.busy(),
                Err(e) if e.is_retryable() => {
                    let message = e.to_string();
                    if policy.failed(e) {
                        log::warn!(
                            "waiting for redlock {:?}: {message}; retrying until the wait ends",
                            self.key
                        );
                    }
                }
                Err(e) => return Err(e),
            }
            let now = self.inner().now();
            if policy.past(now) {
                return policy.end();
            }
            let pause = backoff.pause_after(policy.tries());
            let wake = policy.wake_at(now, pause);
            crossbeam_channel::select! {
                recv(cancelled) -> _ => return Err(Error::Cancelled),
                recv(crossbeam_channel::at(wake)) -> _ => {}
            }
        }
    }
}

#[allow(
    private_interfaces,
    reason = "a sealed trait's methods, named only in this crate"
)]
impl Handle<Redlock> for RedlockHandle {
    /// One attempt or a wait, observed.
    fn run(&self, ttl: Duration, wait: Wait<'_>) -> Result<Option<RedlockGuard>> {
        let once = matches!(wait, Wait::Once);
        let now = self.inner().now();
        let start = |o| Acquiring::start(o, &self.key, Primitive::Redlock, !once, now);
        let mut seen = self.inner().options.observer.as_ref().map(start);
        let result = match wait {
            Wait::Once => self.try_once(ttl, &mut seen),
            Wait::Until(deadline, cancel) => self.wait_seen(ttl, deadline, cancel, &mut seen),
        };
        let now = self.inner().now();
        Acquiring::finish(seen, &result, once, now, RedlockGuard::observed);
        result
    }

    fn now(&self) -> Instant {
        self.inner().now()
    }

    fn holder(&self) -> Option<&HolderTag> {
        self.group.holder.as_ref()
    }

    fn holder_mut(&mut self) -> &mut Option<HolderTag> {
        &mut self.group.holder
    }

    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockLock")
            .field("key", &self.key)
            .field("holder", &self.holder().map(HolderTag::as_str))
            .finish()
    }
}
