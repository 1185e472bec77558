//! The command's process group under the lease: started once the guardian
//! holds its deadline, signals passed on to it, the guardian told each new
//! loss deadline, and the group stopped if the lease is lost.

use std::process::{Child, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, select};
use rustix::process::Signal;

use super::Run;
use super::signals::FORWARDED;
use crate::losses::{self, Loss};
use crate::supervise;
use crate::{EXIT_CANNOT_RUN, EXIT_UNAVAILABLE};

impl Run<'_> {
    /// Starts the command in its own process group and supervises it until it
    /// and its group are gone. The guardian stops the group when the loss
    /// deadline of `held` passes, even if this process cannot.
    pub(super) fn run_child(&mut self, env: &[(&str, String)], held: &Held<'_>) -> Ended {
        let args = self.args;
        let program = &args.command[0];
        if let Err(why) = supervise::resolve(program) {
            return Ended::CannotStart(why);
        }
        if let Err(e) = self.guardian.ensure_started() {
            return Ended::CannotStart(format!("cannot start the guardian: {e}"));
        }
        let deadline = self.loss_deadline(held);
        let child =
            supervise::command(program, &args.command[1..], Some(deadline)).and_then(|mut cmd| {
                cmd.envs(env.iter().map(|(k, v)| (k, v)))
                    .stdin(Stdio::inherit())
                    .spawn()
            });
        let mut child = match child {
            Ok(child) => child,
            Err(e) => return Ended::CannotStart(format!("cannot run {program:?}: {e}")),
        };
        let pgid = child.id() as i32;
        // The command runs only once the guardian holds its deadline.
        let started = self
            .guardian
            .guard_group(pgid, deadline, args.kill_after)
            .map_err(|e| format!("cannot reach the guardian: {e}"))
            .and_then(|()| {
                supervise::handshake(&child).map_err(|e| format!("cannot start {program:?}: {e}"))
            });
        match started {
            Ok(true) => {}
            Ok(false) | Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                supervise::stop_group(pgid, Duration::ZERO);
                self.guardian.forget_group(pgid);
                return match started {
                    Err(why) => Ended::CannotStart(why),
                    // The exec step found the deadline passed (this process
                    // was held up between the grant and the start).
                    _ if (held.is_lost)() => {
                        self.report
                            .lost(&(held.why_lost)(), "the command was not started");
                        Ended::LostBeforeStart
                    }
                    _ => Ended::CannotStart(format!("cannot start {program:?}")),
                };
            }
        }
        supervise::set_current_group(pgid);
        self.report.started(child.id(), &args.command);
        let ended = self.supervise(&mut child, pgid, deadline, held);
        if let Ended::Exited(status) | Ended::LeaseLost(status) = &ended {
            self.report.exited(*status);
        }
        // Whatever is left of the group goes before the lease does.
        supervise::stop_group(pgid, args.kill_after);
        supervise::set_current_group(0);
        self.guardian.forget_group(pgid);
        ended
    }

    /// The lease's loss deadline on the machine's monotonic clock: its
    /// `remaining` estimate less one node timeout (the library's loss
    /// deadline), counted from a reading of the clock taken before the
    /// estimate, so never later than the library's own.
    fn loss_deadline(&self, held: &Held<'_>) -> Duration {
        let before = supervise::monotonic_now();
        before + (held.remaining)().saturating_sub(self.args.keys.node_timeout)
    }

    /// Waits for the command, passing signals on to its group, telling the
    /// guardian each new loss deadline, and stopping the group if the lease
    /// is lost.
    fn supervise(
        &mut self,
        child: &mut Child,
        pgid: i32,
        mut told: Duration,
        held: &Held<'_>,
    ) -> Ended {
        let mut kill_at: Option<Instant> = None;
        let mut lease_lost = false;
        loop {
            match child.try_wait() {
                Ok(Some(status)) if lease_lost => return Ended::LeaseLost(status),
                Ok(Some(status)) => {
                    // A command that ended once the lease was gone (the
                    // guardian stopped it while this process could not) ends
                    // as any loss does.
                    if (held.is_lost)() {
                        self.report.lost(
                            &(held.why_lost)(),
                            "the command ended after the loss deadline, stopped by the \
                             guardian if it was still running then",
                        );
                        return Ended::LeaseLost(status);
                    }
                    return Ended::Exited(status);
                }
                Ok(None) => {}
                Err(e) => return Ended::WaitFailed(e),
            }
            if kill_at.is_some_and(|at| Instant::now() >= at) {
                supervise::signal_group(pgid, Signal::KILL);
            }
            // A guardian that died is replaced, told this group's deadline.
            let _ = self.guardian.keep_running();
            if !lease_lost {
                // Told again when a renewal moved it (not for the jitter of
                // the clock readings that compute it).
                let deadline = self.loss_deadline(held);
                if deadline.abs_diff(told) > Duration::from_millis(1) {
                    self.guardian.deadline(pgid, deadline);
                    told = deadline;
                }
            }
            // SIGCHLD wakes this promptly, and a confirmed renewal; the
            // timeout covers a coalesced signal, the SIGKILL deadline, and a
            // deadline moved without a renewal (a verify that shortened it).
            let tick = crossbeam_channel::after(Duration::from_millis(100));
            let lost = if lease_lost {
                crossbeam_channel::never()
            } else {
                held.lost.clone()
            };
            select! {
                recv(lost) -> _ => {
                    lease_lost = true;
                    supervise::signal_group(pgid, Signal::TERM);
                    supervise::signal_group(pgid, Signal::CONT);
                    kill_at = Some(Instant::now() + self.args.kill_after);
                    // Stop first, explain after: the explanation asks Redis.
                    self.report.lost(&(held.why_lost)(), "stopping the command");
                }
                recv(self.signals) -> sig => {
                    if let Ok(sig) = sig
                        && FORWARDED.contains(&sig)
                        && let Some(signal) = Signal::from_named_raw(sig)
                    {
                        supervise::signal_group(pgid, signal);
                        self.report.forwarded(sig);
                    }
                }
                // A confirmed renewal moved the deadline: tell the guardian
                // at once, at the top of the loop.
                recv(losses::renewals()) -> _ => {}
                recv(tick) -> _ => {}
            }
        }
    }

    pub(super) fn finish(&self, ended: Ended) -> ExitCode {
        let report = self.report;
        match ended {
            Ended::Exited(status) => ExitCode::from(status_code(status)),
            Ended::LeaseLost(_) => report.error(
                self.args.lost_exit_code,
                &format!(
                    "the lease on {:?} was lost; the command was stopped",
                    report.key
                ),
            ),
            Ended::LostBeforeStart => report.error(
                self.args.lost_exit_code,
                &format!(
                    "the lease on {:?} was lost before the command could start",
                    report.key
                ),
            ),
            Ended::CannotStart(msg) => report.error(EXIT_UNAVAILABLE, &msg),
            Ended::WaitFailed(e) => report.error(
                EXIT_CANNOT_RUN,
                &format!("waiting for the command failed: {e}"),
            ),
        }
    }
}

/// The lease a command runs under, as its supervision reads it.
pub(super) struct Held<'a> {
    /// Disconnects at the loss deadline.
    pub(super) lost: &'a Receiver<()>,
    /// The lease's `remaining_estimate`.
    pub(super) remaining: &'a dyn Fn() -> Duration,
    /// The lease's `is_lost`.
    pub(super) is_lost: &'a dyn Fn() -> bool,
    /// Why it was lost, once it is.
    pub(super) why_lost: &'a dyn Fn() -> Loss,
}

/// How the command's supervision ended.
pub(super) enum Ended {
    Exited(ExitStatus),
    /// The lease was lost; the command was stopped and ended with this status.
    LeaseLost(ExitStatus),
    /// The lease was lost before the command could start; it never ran.
    LostBeforeStart,
    CannotStart(String),
    WaitFailed(std::io::Error),
}

fn status_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => 128u8.wrapping_add(signal as u8),
        (None, None) => EXIT_CANNOT_RUN,
    }
}
