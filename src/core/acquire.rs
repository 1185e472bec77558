//! One acquire's attempts, without I/O: which of them got no reply (their
//! connections must be killed, and what they may have set deleted), from when
//! a grant an attempt finds in place may date, and what the acquire leaves to
//! clean up when it ends.
//!
//! An attempt that got no reply may still be applied later, on the connection
//! it went out on. If the acquire ends without the lease, it may have left a
//! grant nobody holds: its connection is killed first (so that the clean-up
//! cannot be overtaken by it), then whatever it set is deleted by owner. If a
//! later attempt was granted, the late one would grant this owner again after
//! the release (a lease nobody holds, and a token burnt): its connection is
//! killed, and nothing is deleted.

use std::time::Instant;

/// The attempts of one acquire, `C` naming where each went.
#[derive(Debug)]
pub(crate) struct Attempts<C> {
    /// The send of the first attempt that got no reply.
    uncertain_since: Option<Instant>,
    /// The send of the first attempt whose grant came back. An attempt runs
    /// again after a grant only when its reply came from a server retired
    /// during the call (a failover): the grant may have reached the new
    /// primary and count from that earlier send.
    granted_at: Option<Instant>,
    /// Where the attempts that got no reply went.
    unanswered: Vec<C>,
}

/// What an ended acquire leaves to do.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct CleanUp<C> {
    /// The connections of the attempts that got no reply: kill each.
    pub(crate) conns: Vec<C>,
    /// Then delete by owner what they may have set (the acquire ended without
    /// the lease); `false`: a later attempt was granted, only kill.
    pub(crate) delete: bool,
}

/// The send a grant sent at `sent` counts from for its fencing token, given
/// the acquire's [`Attempts::since`]: the earliest attempt that may have drawn
/// it (a repeated grant to this owner returns the token an earlier attempt
/// drew).
pub(crate) fn dated(since: Option<Instant>, sent: Instant) -> Instant {
    since.map_or(sent, |t| t.min(sent))
}

impl<C> Default for Attempts<C> {
    fn default() -> Self {
        Attempts {
            uncertain_since: None,
            granted_at: None,
            unanswered: Vec::new(),
        }
    }
}

impl<C> Attempts<C> {
    /// The earliest send that may have made a grant the next attempt finds in
    /// place: the first attempt that got no reply, or the first whose grant
    /// came back but was discarded. `None`: only the next attempt's own send.
    pub(crate) fn since(&self) -> Option<Instant> {
        self.uncertain_since
            .into_iter()
            .chain(self.granted_at)
            .min()
    }

    /// An attempt sent at `sent` got no reply; it went out on `conns`.
    pub(crate) fn unanswered(&mut self, sent: Instant, conns: impl IntoIterator<Item = C>) {
        self.uncertain_since.get_or_insert(sent);
        self.unanswered.extend(conns);
    }

    /// More connections that an unanswered attempt went out on (a call that
    /// followed redirections left several).
    pub(crate) fn went_out_on(&mut self, conns: impl IntoIterator<Item = C>) {
        self.unanswered.extend(conns);
    }

    /// A try of an attempt sent at `sent` ended: with no reply (`unanswered`:
    /// it may have been applied), or with one; either way it went out on
    /// `conns` (a call that followed redirections left several).
    pub(crate) fn tried(
        &mut self,
        unanswered: bool,
        sent: Instant,
        conns: impl IntoIterator<Item = C>,
    ) {
        if unanswered {
            self.unanswered(sent, conns);
        } else {
            self.went_out_on(conns);
        }
    }

    /// An attempt sent at `sent` was granted.
    pub(crate) fn granted(&mut self, sent: Instant) {
        self.granted_at.get_or_insert(sent);
    }

    /// The acquire ended, with the lease (`granted`) or without: what its
    /// unanswered attempts leave to do, if anything.
    pub(crate) fn finish(self, granted: bool) -> Option<CleanUp<C>> {
        (!self.unanswered.is_empty()).then(|| CleanUp {
            conns: self.unanswered,
            delete: !granted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_clean_acquire_leaves_nothing() {
        let t0 = Instant::now();
        let mut a = Attempts::<u64>::default();
        assert_eq!(a.since(), None);
        a.granted(t0);
        assert_eq!(dated(a.since(), t0), t0);
        assert_eq!(a.finish(true), None);
    }

    #[test]
    fn a_grant_after_an_unanswered_attempt_dates_from_it_and_kills_it() {
        let t0 = Instant::now();
        let mut a = Attempts::default();
        a.unanswered(t0, [7u64]);
        a.unanswered(t0 + ms(50), [8]);
        assert_eq!(a.since(), Some(t0));
        a.granted(t0 + ms(100));
        assert_eq!(dated(a.since(), t0 + ms(100)), t0);
        assert_eq!(
            a.finish(true),
            Some(CleanUp {
                conns: vec![7, 8],
                delete: false
            })
        );
    }

    #[test]
    fn an_acquire_that_ends_without_the_lease_deletes_what_it_may_have_set() {
        let t0 = Instant::now();
        let mut a = Attempts::default();
        a.unanswered(t0, [3u64]);
        assert_eq!(
            a.finish(false),
            Some(CleanUp {
                conns: vec![3],
                delete: true
            })
        );
    }

    #[test]
    fn a_rerun_after_a_discarded_grant_counts_from_that_grant() {
        let t0 = Instant::now();
        let mut a = Attempts::<u64>::default();
        a.granted(t0);
        a.granted(t0 + ms(10));
        assert_eq!(a.since(), Some(t0));
        // The rerun returns the token the first grant drew.
        assert_eq!(dated(a.since(), t0 + ms(10)), t0);
    }
}
