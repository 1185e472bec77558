//! The wait for the lease: attempts until `--wait` runs out or a signal
//! cancels it, a grant that finds KEY held in another mode given back, and
//! word when the deployment stops or starts answering.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use crossbeam_channel::select;
use respire_coordination::{Backoff, CancelToken, Error, MAX_TTL};
use signal_hook::consts::SIGINT;

use super::Run;
use super::signals::FORWARDED;
use crate::EXIT_UNAVAILABLE;
use crate::args::{EXIT_USAGE, Wait};
use crate::endpoint;
use crate::losses;

/// How often a wait checks that the deployment answers.
const PROBE_EVERY: Duration = Duration::from_secs(5);

impl Run<'_> {
    /// Waits for the lease as `--wait` / `-n` say; HUP, INT, QUIT and TERM
    /// cancel the wait. A grant that finds KEY held in another mode is given
    /// back, and the wait goes on after a short pause. On failure, returns the
    /// exit code to end with.
    pub(super) fn acquire<G>(
        &self,
        mut attempt: impl FnMut(
            Option<Instant>,
            &CancelToken,
        ) -> respire_coordination::Result<Option<G>>,
        mut conflict: impl FnMut(&G) -> respire_coordination::Result<Option<String>>,
        mut give_back: impl FnMut(G),
        probe: impl Fn() -> Result<(), String> + Sync,
    ) -> Result<G, ExitCode> {
        let (args, report) = (self.args, self.report);
        // A loss reported from now on is this lease's.
        losses::forget();
        let cancel = CancelToken::new();
        let wait = if args.nonblock {
            Wait::For(Duration::ZERO)
        } else {
            args.wait
        };
        let deadline = deadline(wait, Instant::now());
        let signals = self.signals;
        let (result, signal) = std::thread::scope(|s| {
            let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
            let cancel = &cancel;
            // A wait rides out a deployment that does not answer; say so
            // rather than wait in silence, and say when it answers again.
            let probe = &probe;
            let probe_done = done_rx.clone();
            s.spawn(move || {
                let mut silent = false;
                loop {
                    select! {
                        recv(probe_done) -> _ => return,
                        recv(crossbeam_channel::after(PROBE_EVERY)) -> _ => {}
                    }
                    match probe() {
                        Err(why) if !silent => {
                            silent = true;
                            report.unreachable(&why);
                        }
                        Ok(()) if silent => {
                            silent = false;
                            report.reachable();
                        }
                        _ => {}
                    }
                }
            });
            let watcher = s.spawn(move || {
                loop {
                    select! {
                        recv(signals) -> sig => match sig {
                            Ok(sig) if FORWARDED.contains(&sig) => {
                                cancel.cancel();
                                return Some(sig);
                            }
                            Err(_) => {
                                cancel.cancel();
                                return None;
                            }
                            Ok(_) => {}
                        },
                        recv(done_rx) -> _ => return None,
                    }
                }
            });
            let mut backoff = conflict_backoff();
            let result = loop {
                let guard = match attempt(deadline, cancel) {
                    Ok(Some(g)) => g,
                    other => break other.map(|_| None).map_err(|e| (e, None)),
                };
                match conflict(&guard) {
                    Ok(None) => break Ok(Some(guard)),
                    Ok(Some(other)) => {
                        give_back(guard);
                        let now = Instant::now();
                        if deadline.is_some_and(|d| d <= now) {
                            break Err((Error::Cancelled, Some(other)));
                        }
                        let pause = backoff.next_pause().min(
                            deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(now)),
                        );
                        select! {
                            recv(cancel.receiver()) -> _ => break Err((Error::Cancelled, None)),
                            recv(crossbeam_channel::after(pause)) -> _ => {}
                        }
                    }
                    Err(e) => {
                        give_back(guard);
                        break Err((e, None));
                    }
                }
            };
            drop(done_tx);
            (result, watcher.join().unwrap_or(None))
        });
        match result {
            // A signal that came while the grant was being checked: the
            // command never starts.
            Ok(Some(guard)) if signal.is_some() => {
                give_back(guard);
                Err(report.interrupted(signal.unwrap_or(SIGINT)))
            }
            Ok(Some(guard)) => Ok(guard),
            Ok(None) => Err(report.not_acquired(args.conflict_exit_code, None)),
            Err((Error::Cancelled, Some(other))) => {
                Err(report.not_acquired(args.conflict_exit_code, Some(&other)))
            }
            Err((Error::Cancelled, None)) => Err(report.interrupted(signal.unwrap_or(SIGINT))),
            Err((e, _)) if endpoint::is_usage(&e) => Err(report.error(EXIT_USAGE, &e.to_string())),
            Err((e, _)) => Err(report.error(EXIT_UNAVAILABLE, &e.to_string())),
        }
    }
}

/// The pauses before trying again after conflicts with another mode: from
/// 20–40 ms after the first, doubling, to 110–220 ms, random in every
/// process so that two modes do not keep meeting.
fn conflict_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(40), Duration::from_millis(220))
}

/// The deadline of a wait: `None` to wait until acquired, also for a wait too
/// long for the monotonic clock (or longer than any lease, [`MAX_TTL`]).
fn deadline(wait: Wait, now: Instant) -> Option<Instant> {
    match wait {
        Wait::Forever => None,
        Wait::For(wait) if wait > MAX_TTL => None,
        Wait::For(wait) => now.checked_add(wait),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_too_long_for_the_clock_have_no_deadline() {
        let now = Instant::now();
        assert_eq!(deadline(Wait::Forever, now), None);
        assert_eq!(deadline(Wait::For(Duration::ZERO), now), Some(now));
        assert_eq!(
            deadline(Wait::For(Duration::from_secs(5)), now),
            Some(now + Duration::from_secs(5))
        );
        assert_eq!(
            deadline(Wait::For(MAX_TTL + Duration::from_secs(1)), now),
            None
        );
        assert_eq!(
            deadline(
                Wait::For(Duration::from_secs(10_000_000_000_000_000_000)),
                now
            ),
            None
        );
        assert_eq!(deadline(Wait::For(Duration::MAX), now), None);
    }

    #[test]
    fn conflict_pauses_are_bounded() {
        for _ in 0..100 {
            let mut backoff = conflict_backoff();
            for _ in 0..10 {
                let b = backoff.next_pause();
                assert!(b >= Duration::from_millis(20) && b < Duration::from_millis(220));
            }
        }
    }
}
