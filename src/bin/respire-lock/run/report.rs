//! What a run reports: sentences for people on stderr, and with
//! `--events-fd` / `--events-file` one JSON object per event.

use std::ffi::OsString;
use std::io::Write as _;
use std::process::{ExitCode, ExitStatus};
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;

use super::Grant;
use crate::args::{RunArgs, Usage};
use crate::json::{self, Object};
use crate::losses::Loss;
use crate::say;

/// Where JSON events go: a file descriptor or a file given on the command
/// line, or nowhere.
pub(super) struct Events(Option<Mutex<Box<dyn std::io::Write + Send>>>);

impl Events {
    pub(super) fn open(args: &RunArgs, subcommand: &str) -> Result<Events, Usage> {
        let usage = |what: String| Usage::new(what, Some(subcommand));
        let some = |w: Box<dyn std::io::Write + Send>| Events(Some(Mutex::new(w)));
        if let Some(fd) = args.events_fd {
            return match fd {
                // The tool's own standard streams are written as they are,
                // at the offset every other writer of them shares.
                1 => Ok(some(Box::new(std::io::stdout()))),
                2 => Ok(some(Box::new(std::io::stderr()))),
                // Any other descriptor is opened again through /dev/fd, which
                // needs no unsafe code and leaves the caller's descriptor as
                // it is; in append mode, so a file is written at its end.
                _ => {
                    let path = format!("/dev/fd/{fd}");
                    std::fs::OpenOptions::new()
                        .append(true)
                        .open(&path)
                        .map(|f| some(Box::new(f)))
                        .map_err(|e| {
                            usage(format!("--events-fd {fd}: not an open descriptor ({e})"))
                        })
                }
            };
        }
        if let Some(path) = &args.events_file {
            return std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map(|f| some(Box::new(f)))
                .map_err(|e| usage(format!("--events-file {}: {e}", path.display())));
        }
        Ok(Events(None))
    }
}

/// Reports the events of one run: sentences for people on stderr, and with
/// `--events-fd` / `--events-file` one JSON object per event there.
pub(super) struct Reporter {
    pub(super) events: Events,
    pub(super) verbose: bool,
    pub(super) key: String,
}

impl Reporter {
    /// Reports one event: `fields` adds the event's own JSON fields; `text` is
    /// the sentence printed on stderr (`None`: nothing).
    fn emit(&self, event: &str, fields: impl FnOnce(Object) -> Object, text: Option<String>) {
        if let Some(file) = &self.events.0 {
            let time = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
            let obj = Object::new()
                .str("event", event)
                .str("time", &time)
                .str("key", &self.key);
            let line = fields(obj).finish();
            let _ = writeln!(file.lock(), "{}", crate::scrub(&line));
        }
        if let Some(text) = text {
            say(&format!("respire-lock: {text}"));
        }
    }

    pub(super) fn throwaway(&self, url: &str, dir: &std::path::Path) {
        self.emit(
            "throwaway",
            |o| o.str("url", url).str("dir", &dir.display().to_string()),
            Some(format!(
                "--throwaway: started a private redis-server at {url} in {} \
                 (it coordinates with nothing else)",
                dir.display()
            )),
        );
    }

    pub(super) fn acquired(&self, grant: &Grant, mode: &str, ttl: Duration) {
        let text = match (grant.token, grant.slot, grant.write_epoch) {
            (Some(t), Some(slot), _) => {
                format!("acquired {:?}: permit {slot}, fencing token {t}", self.key)
            }
            (Some(t), None, _) => format!("acquired {:?} with fencing token {t}", self.key),
            (None, _, Some(e)) => format!("acquired {:?} shared (write epoch {e})", self.key),
            (None, _, None) => format!("acquired {:?} on a quorum (no fencing token)", self.key),
        };
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.emit(
            "acquired",
            |o| {
                o.str("lease_key", &grant.lease_key)
                    .opt_num("token", grant.token)
                    .num("ttl_ms", ttl_ms)
                    .str("mode", mode)
                    .opt_num("slot", grant.slot)
                    .opt_num("write_epoch", grant.write_epoch)
            },
            self.verbose.then_some(text),
        );
    }

    pub(super) fn started(&self, pid: u32, command: &[OsString]) {
        let words: Vec<String> = command
            .iter()
            .map(|w| w.to_string_lossy().into_owned())
            .collect();
        self.emit(
            "started",
            |o| {
                o.num("pid", pid).raw(
                    "command",
                    &json::array(words.iter().map(|w| json::string(w))),
                )
            },
            self.verbose
                .then(|| format!("started {:?} (pid {pid})", words.join(" "))),
        );
    }

    /// The lease was lost; `after` says what became of the command.
    pub(super) fn lost(&self, cause: &Loss, after: &str) {
        self.emit(
            "lost",
            |o| o.str("cause", cause.cause).str("reason", &cause.reason),
            Some(format!("the lease was lost ({}); {after}", cause.reason)),
        );
    }

    pub(super) fn recampaign(&self) {
        self.emit(
            "recampaign",
            |o| o,
            Some(format!(
                "campaigning again for {:?} (--recampaign)",
                self.key
            )),
        );
    }

    pub(super) fn unreachable(&self, why: &str) {
        self.emit(
            "unreachable",
            |o| o.str("message", why),
            Some(format!(
                "still waiting for {:?}, but Redis does not answer: {why}",
                self.key
            )),
        );
    }

    pub(super) fn reachable(&self) {
        self.emit(
            "reachable",
            |o| o,
            Some(format!(
                "Redis answers again; still waiting for {:?}",
                self.key
            )),
        );
    }

    pub(super) fn forwarded(&self, signal: i32) {
        self.emit(
            "forwarded",
            |o| o.num("signal", signal),
            self.verbose
                .then(|| format!("passed signal {signal} on to the command's group")),
        );
    }

    pub(super) fn exited(&self, status: ExitStatus) {
        use std::os::unix::process::ExitStatusExt;
        self.emit(
            "exited",
            |o| {
                o.opt_num("code", status.code())
                    .opt_num("signal", status.signal())
            },
            self.verbose.then(|| format!("the command ended: {status}")),
        );
    }

    pub(super) fn released(&self, outcome: &str, detail: Option<&str>) {
        let text = match detail {
            None => self.verbose.then(|| format!("released {:?}", self.key)),
            Some(detail) => Some(format!("release of {:?}: {outcome}: {detail}", self.key)),
        };
        self.emit(
            "released",
            |o| o.str("outcome", outcome).opt_str("detail", detail),
            text,
        );
    }

    /// Held elsewhere, in whatever mode: quiet without `-v`, as flock (a cron
    /// job's conflict mails nobody); `-v` names the holder's mode.
    pub(super) fn not_acquired(&self, code: u8, other_mode: Option<&str>) -> ExitCode {
        let text = self.verbose.then(|| match other_mode {
            Some(other) => format!(
                "{:?} is held in another mode: {other}; not acquired",
                self.key
            ),
            None => format!("{:?} is held elsewhere; not acquired", self.key),
        });
        self.emit(
            "not_acquired",
            |o| o.num("exit_code", code).opt_str("held_as", other_mode),
            text,
        );
        ExitCode::from(code)
    }

    pub(super) fn interrupted(&self, signal: i32) -> ExitCode {
        self.emit(
            "interrupted",
            |o| o.num("signal", signal),
            Some(format!("interrupted while waiting for {:?}", self.key)),
        );
        ExitCode::from(128u8.wrapping_add(signal as u8))
    }

    pub(super) fn error(&self, exit_code: u8, message: &str) -> ExitCode {
        self.emit(
            "error",
            |o| o.num("exit_code", exit_code).str("message", message),
            Some(message.to_owned()),
        );
        ExitCode::from(exit_code)
    }
}
