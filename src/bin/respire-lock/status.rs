//! `respire-lock status`: who holds a key, through the library's inspection
//! call (`Coordinator::inspect`) on every deployment `run` accepts, and on
//! every node of a Redlock group.

use std::process::ExitCode;
use std::time::Duration;

use respire_coordination::{HeldAs, Inspection};

use crate::args::{EXIT_USAGE, StatusArgs, Usage};
use crate::endpoint::{self, Tls};
use crate::json::{self, Object};
use crate::{EXIT_UNAVAILABLE, say, show};

/// `status`'s exit status when KEY is held (in any mode).
const HELD: u8 = 0;
/// `status`'s exit status when KEY is free.
const FREE: u8 = 1;

pub(crate) fn main(args: StatusArgs, matches: &clap::ArgMatches) -> ExitCode {
    let json = args.json;
    // What is read: KEY's keys in `run`'s layout, or a lease on keys of a
    // program's choosing. KEY beats --lease from the environment.
    let lease_on_line =
        matches.value_source("lease") == Some(clap::parser::ValueSource::CommandLine);
    let target = match (&args.key, &args.lease) {
        (Some(_), Some(_)) if lease_on_line => None,
        (Some(key), _) => Some(Read::Layout(key.clone())),
        (None, Some(lease)) => Some(Read::Lease(lease.clone(), args.fence.clone())),
        (None, None) => None,
    };
    let key = match &target {
        Some(Read::Layout(key) | Read::Lease(key, _)) => key.clone(),
        None => args.key.clone().unwrap_or_default(),
    };
    // Every failure: a sentence on stderr, and with --json an object on
    // stdout too, so that a program reading stdout always gets one.
    let fail = |code: u8, message: &str| {
        if json {
            show(
                &Object::new()
                    .str("key", &key)
                    .str("error", message)
                    .num("exit_code", code)
                    .finish(),
            );
        }
        ExitCode::from(code)
    };
    let usage = |usage: Usage| {
        usage.print();
        fail(EXIT_USAGE, &usage.problem)
    };
    let Some(target) = target else {
        return usage(Usage::new(
            "KEY and --lease exclude each other: give one",
            Some("status"),
        ));
    };
    if args.fence.is_some() && matches!(target, Read::Layout(_)) {
        return usage(Usage::new(
            "--fence goes with --lease: KEY's layout has its own counter",
            Some("status"),
        ));
    }
    let tls = match Tls::read(&args.tls, "status") {
        Ok(t) => t,
        Err(u) => return usage(u),
    };
    // As for `run`: --url on the command line beats --redlock; from the
    // environment, RESPIRE_LOCK_REDLOCK beats REDIS_URL.
    let url_given = matches.value_source("url") == Some(clap::parser::ValueSource::CommandLine);
    let url = args
        .url
        .as_ref()
        .filter(|_| url_given || args.redlock.is_none());
    let (urls, redlock) = match (url, &args.redlock) {
        (Some(url), _) => (vec![url.clone()], false),
        (None, Some(list)) => {
            if let Err(u) = list.check("status") {
                return usage(u);
            }
            (list.0.clone(), true)
        }
        (None, None) => {
            return usage(Usage::new(
                "status needs a Redis deployment to ask: give --url or set REDIS_URL \
                 (or --redlock)",
                Some("status"),
            ));
        }
    };
    let mut answers = Vec::new();
    for url in &urls {
        let read = endpoint::connect(url, &args.keys, &tls).and_then(|c| match &target {
            Read::Layout(key) => c.inspect(&endpoint::base(key)),
            Read::Lease(lease, fence) => c.inspect_lease(lease, fence.as_deref()),
        });
        match read {
            Ok(ins) => answers.push(ins),
            Err(e) if !redlock => {
                let message = crate::scrub(&e.to_string());
                say(&format!("respire-lock: {message}"));
                let code = if endpoint::is_usage(&e) {
                    EXIT_USAGE
                } else {
                    EXIT_UNAVAILABLE
                };
                return fail(code, &message);
            }
            Err(e) => say(&format!("respire-lock: a node did not answer: {e}")),
        }
    }
    if answers.is_empty() {
        let message = "no node of the Redlock group answered";
        say(&format!("respire-lock: {message}"));
        return fail(EXIT_UNAVAILABLE, message);
    }
    let mut view = if redlock {
        View::redlock(&answers, urls.len())
    } else {
        View::single(&answers[0])
    };
    view.counter_read = !matches!(target, Read::Lease(_, None));
    if args.json {
        show(&view.json(&key));
    } else {
        show(&view.describe(&key));
    }
    ExitCode::from(if view.held() { HELD } else { FREE })
}

/// A holder's name as a sentence shows it.
fn who(holder: Option<&str>) -> String {
    match holder {
        Some(h) => format!("holder {}", json::string(h)),
        None => "no holder recorded".into(),
    }
}

/// What `status` reads.
enum Read {
    /// KEY's keys in the layout `run` uses.
    Layout(String),
    /// A lease key and, for a fenced lock, its counter key.
    Lease(String, Option<String>),
}

/// What `status` reports.
struct View<'a> {
    ins: &'a Inspection,
    mode: &'static str,
    /// With --redlock: nodes that answered, nodes holding it, nodes in all.
    redlock: Option<(usize, usize, usize)>,
    /// Whether a fence counter was read (not for --lease without --fence).
    counter_read: bool,
}

impl<'a> View<'a> {
    fn single(ins: &'a Inspection) -> View<'a> {
        let mode = match ins.held_as() {
            HeldAs::Free => "free",
            HeldAs::Exclusive => "exclusive",
            HeldAs::Shared => "shared",
            HeldAs::Counted => "counted",
            _ => "mixed",
        };
        View {
            ins,
            mode,
            redlock: None,
            counter_read: true,
        }
    }

    /// A Redlock group: held when a majority of all nodes hold the exclusive
    /// key with one owner's value; a holding node of that owner's is shown.
    fn redlock(answers: &'a [Inspection], nodes: usize) -> View<'a> {
        fn owner<'i>(i: &&'i Inspection) -> Option<&'i str> {
            i.exclusive.as_ref().map(|x| x.owner.as_str())
        }
        let holding: Vec<&Inspection> = answers.iter().filter(|i| owner(i).is_some()).collect();
        // The owner found on the most nodes.
        let top = holding
            .iter()
            .max_by_key(|a| holding.iter().filter(|b| owner(b) == owner(a)).count())
            .copied();
        let same = top.map_or(0, |t| {
            holding.iter().filter(|b| owner(b) == owner(&t)).count()
        });
        let held = same * 2 > nodes;
        let shown = match top {
            Some(t) if held => t,
            _ => &answers[0],
        };
        View {
            ins: shown,
            mode: if held {
                "redlock"
            } else {
                View::single(shown).mode
            },
            redlock: Some((answers.len(), same, nodes)),
            counter_read: true,
        }
    }

    fn held(&self) -> bool {
        self.mode != "free"
    }

    fn describe(&self, key: &str) -> String {
        let ins = self.ins;
        let last = match ins.last_write_token {
            Some(t) => format!("last fencing token issued: {t}"),
            None => "no fencing token issued yet".into(),
        };
        let ttl = |d: Option<Duration>| match d {
            Some(d) => format!(
                "expires in {}",
                humantime::format_duration(Duration::from_millis(d.as_millis() as u64))
            ),
            None => "no expiry set".into(),
        };
        let what = match self.mode {
            "free" => "free".to_owned(),
            "redlock" => {
                let (answered, holding, nodes) = self.redlock.unwrap_or_default();
                format!(
                    "held by a Redlock run on {holding} of {nodes} nodes ({answered} answered), {}, {}",
                    who(ins.exclusive.as_ref().and_then(|x| x.holder.as_deref())),
                    ttl(ins.exclusive.as_ref().and_then(|x| x.remaining))
                )
            }
            "exclusive" => {
                let x = ins.exclusive.as_ref();
                let holder = match x.and_then(|x| x.fencing_token) {
                    Some(t) => format!("fencing token {t}"),
                    None => "a value without a fencing token (a Redlock run's, or a plain lock's)"
                        .into(),
                };
                format!(
                    "held exclusive by {holder}, {}, {}",
                    who(x.and_then(|x| x.holder.as_deref())),
                    ttl(x.and_then(|x| x.remaining))
                )
            }
            "shared" => format!(
                "held shared by {} holder(s) ({}), the last expires in {}{}",
                ins.readers.len(),
                ins.readers
                    .iter()
                    .map(|r| who(r.holder.as_deref()))
                    .collect::<Vec<_>>()
                    .join("; "),
                humantime::format_duration(Duration::from_millis(
                    ins.readers
                        .iter()
                        .map(|r| r.remaining)
                        .max()
                        .unwrap_or_default()
                        .as_millis() as u64
                )),
                if ins.waiting_writers > 0 {
                    format!(", {} exclusive run(s) waiting", ins.waiting_writers)
                } else {
                    String::new()
                }
            ),
            "counted" => {
                let permits: Vec<String> = ins
                    .permits
                    .iter()
                    .map(|p| {
                        format!(
                            "slot {} token {}, {}",
                            p.slot,
                            p.fencing_token,
                            who(p.holder.as_deref())
                        )
                    })
                    .collect();
                format!(
                    "held counted: {} of {} permit(s) ({})",
                    ins.permits.len(),
                    ins.capacity.map_or("?".into(), |c| c.to_string()),
                    permits.join("; ")
                )
            }
            _ => "held in several modes at once (keys written outside one layout)".into(),
        };
        if self.counter_read {
            format!("{key}: {what} ({last})")
        } else {
            format!("{key}: {what}")
        }
    }

    fn json(&self, key: &str) -> String {
        let ins = self.ins;
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let x = ins.exclusive.as_ref();
        let permits = ins.permits.iter().map(|p| {
            Object::new()
                .num("slot", p.slot)
                .num("token", p.fencing_token.get())
                .num("ttl_ms", ms(p.remaining))
                .str("owner", &p.owner)
                .opt_str("holder", p.holder.as_deref())
                .finish()
        });
        // Every holder, whatever its mode, in one list.
        let exclusive = x.map(|x| {
            Object::new()
                .str(
                    "mode",
                    if self.mode == "redlock" {
                        "redlock"
                    } else {
                        "exclusive"
                    },
                )
                .str("owner", &x.owner)
                .opt_str("holder", x.holder.as_deref())
                .opt_num("ttl_ms", x.remaining.map(ms))
                .opt_num("token", x.fencing_token.map(|t| t.get()))
                .finish()
        });
        let readers = ins.readers.iter().map(|r| {
            Object::new()
                .str("mode", "shared")
                .str("owner", &r.owner)
                .opt_str("holder", r.holder.as_deref())
                .num("ttl_ms", ms(r.remaining))
                .finish()
        });
        let counted = ins.permits.iter().map(|p| {
            Object::new()
                .str("mode", "counted")
                .str("owner", &p.owner)
                .opt_str("holder", p.holder.as_deref())
                .num("ttl_ms", ms(p.remaining))
                .num("token", p.fencing_token.get())
                .num("slot", p.slot)
                .finish()
        });
        let holders = json::array(exclusive.into_iter().chain(readers).chain(counted));
        let mut obj = Object::new()
            .str("key", key)
            .str("base", &ins.base)
            .bool("held", self.held())
            .str("mode", self.mode)
            .opt_num("token", x.and_then(|x| x.fencing_token).map(|t| t.get()))
            .opt_num("ttl_ms", x.and_then(|x| x.remaining).map(ms))
            .opt_str("holder", x.and_then(|x| x.holder.as_deref()))
            .num("readers", ins.readers.len() as u64)
            .num("waiting_writers", ins.waiting_writers)
            .raw("permits", &json::array(permits))
            .raw("holders", &holders)
            .opt_num("capacity", ins.capacity)
            .opt_num("last_token", ins.last_write_token.map(|t| t.get()))
            .opt_num("last_permit_token", ins.last_permit_token.map(|t| t.get()));
        if let Some((answered, holding, _)) = self.redlock {
            obj = obj
                .num("nodes", answered as u64)
                .num("held_on", holding as u64);
        }
        obj.finish()
    }
}
