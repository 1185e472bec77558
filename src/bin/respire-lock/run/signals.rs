//! The signals the tool takes: passed on to the command's group, ending a
//! wait, or stopping and continuing the group with the tool.

use crossbeam_channel::Receiver;
use nix::sys::signal::SigSet;
use signal_hook::consts::{SIGCHLD, SIGCONT, SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGTSTP};

use crate::supervise;

/// The signals passed on to the command's group (and that end a wait).
pub(super) const FORWARDED: [i32; 4] = [SIGHUP, SIGINT, SIGQUIT, SIGTERM];

/// Signals for this process, delivered on a channel.
///
/// They are blocked in the calling thread, and so in every thread started
/// after (the library's among them), and taken by a thread of their own. A
/// handler run by a thread inside a library call would fail that call: Linux
/// does not restart a socket read with a timeout after a handler, whatever
/// `SA_RESTART` says, and the library takes a reply it could not read as
/// missing. Call this before anything starts a thread; the command starts
/// through [`supervise::command`], which gives it the mask the tool started
/// with.
///
/// A signal ignored when the tool started (as under `nohup`) is left ignored,
/// as flock leaves it, and the command inherits it ignored. SIGTSTP stops the
/// command's group, then the tool; SIGCONT continues the group (see
/// [`supervise::stop_all`]); neither reaches the channel's receivers.
pub(super) fn signals() -> std::io::Result<Receiver<i32>> {
    let mut wanted: Vec<i32> = [&FORWARDED[..], &[SIGTSTP, SIGCONT]]
        .concat()
        .into_iter()
        .filter(|s| !supervise::ignored_at_start(*s))
        .collect();
    wanted.push(SIGCHLD);
    let mut mask = SigSet::empty();
    for &signal in &wanted {
        mask.add(nix::sys::signal::Signal::try_from(signal)?);
    }
    supervise::block_signals(&mask)?;
    let mut signals = signal_hook::iterator::Signals::new(wanted)?;
    let (tx, rx) = crossbeam_channel::unbounded();
    let (unblocked_tx, unblocked) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name("respire-signals".into())
        .spawn(move || {
            // Signals that came before are pending, and delivered here now.
            let unblocked = mask.thread_unblock();
            let failed = unblocked.is_err();
            let _ = unblocked_tx.send(unblocked);
            if failed {
                return;
            }
            for signal in signals.forever() {
                match signal {
                    SIGTSTP => supervise::stop_all(),
                    SIGCONT => supervise::continue_all(),
                    _ => {
                        if tx.send(signal).is_err() {
                            return;
                        }
                    }
                }
            }
        })?;
    match unblocked.recv() {
        Ok(Ok(())) => Ok(rx),
        Ok(Err(errno)) => Err(errno.into()),
        Err(_) => Err(std::io::Error::other("the signal thread ended at once")),
    }
}
