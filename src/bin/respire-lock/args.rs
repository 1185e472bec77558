//! The command line: subcommands, options and their environment variables,
//! value parsers, and usage errors cut down to one line and a hint.

use std::ffi::{OsStr, OsString};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use respire_coordination::{Coordinator, MAX_TTL};

/// Bad command line.
pub(crate) const EXIT_USAGE: u8 = 64;

const RUN_AFTER_HELP: &str = "\
Where: --url URL (or REDIS_URL) for one deployment (redis://, rediss://, unix://,
redis+cluster://, redis+sentinel://), or --redlock URL,URL,URL for a quorum of
independent servers. Without either, nothing is started and the exit status is 64;
--throwaway starts a private redis-server for trying the tool out (it coordinates
only with runs that use that same server, i.e. none).

Modes, all on one key layout under <prefix>{KEY}: (so that they exclude each other):
  (default), -x (-e)
              exclusive, fenced: one holder; CMD sees RESPIRE_FENCING_TOKEN, strictly
              increasing per KEY (pass it to the resource, have it refuse lower ones)
  -s, --shared
              shared: many holders at once, never beside an exclusive one;
              CMD sees RESPIRE_WRITE_EPOCH (the last exclusive token)
  --max N     counted: at most N holders; CMD sees RESPIRE_FENCING_TOKEN and
              RESPIRE_LOCK_SLOT (0..N)
  --redlock   exclusive on a quorum, no fencing token
A run that finds KEY held in another mode (such as counted permits while it wants it
exclusive) waits for them like for any holder, or with -n ends with the conflict
code (naming that mode with -v). CMD also sees RESPIRE_LOCK_KEY (the lease key in
Redis).

Options that exclude each other (-n and --wait; -x, --shared and --max;
--events-fd and --events-file) are refused together on the command line; one given
on the command line wins over the others set in the environment.

Supervision: CMD runs in a process group of its own. SIGHUP, SIGINT, SIGQUIT and
SIGTERM to respire-lock are passed on, as themselves, to that whole group; CMD dies
with respire-lock (it gets SIGKILL if respire-lock is killed), and so does the rest
of its group. If the lease is lost, the group gets SIGTERM, then SIGKILL after
--kill-after. When CMD ends, what is left of its group gets the same, then the lease
is released. Because CMD's group is not the terminal's foreground group, a CMD that
reads from the terminal is stopped (SIGTTIN); give it its input another way. Ctrl-C
still reaches it: the terminal signals respire-lock, which passes the signal on;
Ctrl-Z (SIGTSTP) stops CMD's group, then respire-lock, and SIGCONT continues both.
A signal ignored when respire-lock started (nohup) stays ignored, by CMD too.

Dead-man's switch: a guardian process holds the lease's loss deadline, renewed with
each confirmed renewal, and stops CMD's group at it (SIGTERM, then SIGKILL after
--kill-after) even when respire-lock itself is stopped, frozen or starved; CMD
starts only once the guardian holds it.

DURATION: 500ms, 10s, 1m30s, 2h, ... (a bare number is seconds).
--ttl must leave room to renew at half of it: at least (2 x node timeout + 2 ms) /
0.49, which is 2.045s with the default --node-timeout of 500ms.

Exit status: CMD's status (128+N if it died of signal N), or
  64  usage error (nothing was sent to Redis)
  69  Redis unavailable or refused, or CMD could not be started (as flock)
  70  respire-lock itself failed (signal handlers, waiting for CMD)
  75  not acquired: held elsewhere and -n, or the wait ran out (-E sets it;
      -n -E 0 makes a conflict a silent success, as flock -n -E 0)
  76  CMD stopped: the lease was lost (--lost-exit-code sets it)
A conflict prints nothing without -v, whatever mode holds KEY.

With --events-fd N or --events-file PATH, each event is one JSON object on a line
there (stderr stays for people), with the fields \"event\", \"time\" (RFC 3339,
UTC) and \"key\", and by event:
  throwaway     url, dir
  acquired      lease_key, token (null with --redlock and --shared), ttl_ms,
                mode (\"fenced\" | \"redlock\" | \"shared\" | \"counted\"), slot, write_epoch
  started       pid, command
  lost          cause, the library's (LossCause): \"expired\" | \"renewal_unconfirmed\" |
                \"gone\" | \"taken_over\" | \"other\"; reason, the library's detail
  exited        code, signal (one of them null)
  forwarded     signal
  unreachable   message (a wait goes on, but Redis does not answer)
  reachable     (Redis answers again)
  released      outcome (\"released\" | \"expired\" | \"taken_over\" | \"uncertain\" | \"lapsed\" | \"failed\"), detail
  not_acquired  exit_code, held_as (the other mode, or null)
  interrupted   signal
  error         exit_code, message";

const STATUS_AFTER_HELP: &str = "\
Reads the keys `run` uses for KEY (everything under <prefix>{KEY}:) through the
library's inspection call, on every deployment `run` accepts; with --redlock, on
every node. Changes nothing.

Exit status, for scripts to branch on:
  0   KEY is held (in any mode)
  1   KEY is free
  64  usage error (such as no --url, REDIS_URL or --redlock)
  69  Redis cannot be asked

With --lease LEASE_KEY (and --fence FENCE_KEY) instead of KEY, status reads a lease a
program made with the library on keys of its choosing (give its --prefix): a Lock, a
FencedLock (its token, and with --fence the last token issued), a Redlock lock (with
--redlock). KEY on the command line beats --lease from the environment; both on the
command line are refused.

With --json, stdout always gets one object. On an error: key, error (the message)
and exit_code. Otherwise: key, base, held (bool), mode (\"free\" |
\"exclusive\" | \"shared\" | \"counted\" | \"mixed\" | \"redlock\"), token (the exclusive
holder's fencing token, or null), ttl_ms (the exclusive holder's remaining time, or
null), holder (the exclusive holder's identity, or null), readers, waiting_writers,
permits (a list of {slot, token, ttl_ms, owner, holder}), holders (every holder in
every mode: {mode, owner, holder, ttl_ms, and token and slot where it has them}),
capacity, last_token (the last exclusive token issued), last_permit_token; with
--redlock also nodes (how many answered) and held_on (how many hold it with one
owner).

Holder: who holds each lease, as it recorded itself: `run` records \"host pid N:
program\" (this host's name, respire-lock's process id and CMD's program name) or
its --holder; a program, what it gave Lease::with_holder. null when none was
recorded.";

const DOCTOR_AFTER_HELP: &str = "\
Exits 0 when nothing failed, 1 when a check failed, 69 when Redis cannot be reached.
A check that cannot read what it needs (INFO or CONFIG denied) says \"unknown\".

Check ids:
  version      the server version: Redis 7.0 or later is needed (fail below); Valkey
               is named by its valkey_version and judged by the redis_version it
               reports for compatibility
  persistence  appendonly / appendfsync: does the fence counter survive a crash
  eviction     maxmemory-policy: can leases or counters be evicted
  replication  role and replicas
  cluster      a plain URL to one node of a Redis Cluster
  topology     the Cluster or Sentinel deployment behind a topology URL
  sentinel     how many sentinels answer, the quorum
  failover     what a failover loses
  acl          the rights every run needs: CLIENT ID, CLIENT KILL, EVAL,
               CLIENT TRACKING, the invalidation channel; CLIENT INFO (6.2)
               so that a kill matches the connection's address too
  key          reading and writing the keys of KEY (--key; without it, of a probe
               name under --prefix)

With --json, one object on stdout: ok (bool: no check failed) and findings, a list of
objects with level (\"ok\" | \"warn\" | \"fail\"), check (one of the ids above) and
message.";

const ELECT_AFTER_HELP: &str = "\
Campaigns to lead NAME on one deployment (--url or REDIS_URL; --throwaway to try it
out), runs CMD while leader, and stops CMD's process group when the leadership is
lost. Every option of `run` applies, with the same supervision (see
respire-lock run --help), except --redlock, --shared and --max: a leader's term is a
fencing token, which needs the one counter of one deployment.

CMD sees RESPIRE_LEADER_TERM and RESPIRE_FENCING_TOKEN (the term: strictly increasing
per NAME; pass it to what the leader writes to, and have it refuse lower ones),
RESPIRE_LEADER_VALUE (what this leader advertises) and RESPIRE_LOCK_KEY (the lease
key). Keys: <prefix>{NAME}:leader, <prefix>{NAME}:term, <prefix>{NAME}:value.

Without --recampaign, elect ends when CMD ends, with CMD's status, or with 76 when the
leadership was lost. With --recampaign, a lost leadership stops CMD and elect
campaigns again; once elected again it runs CMD again. JSON events are those of
`run`, with mode \"leader\", and a \"recampaign\" event after each loss.";

const LEADER_AFTER_HELP: &str = "\
Prints who leads NAME: its advertised value and its term, or that nobody does (a lease
that expired counts as nobody). One read; changes nothing. Exits 0 whether or not
someone leads, 69 when Redis cannot be asked, 64 without --url or REDIS_URL.

With --json, one object on stdout: name, leader (bool), term (or null), value (or null).

With --watch, it keeps running and prints the current state, then one line (or JSON
object) per change: a new leader, a new value, nobody leading. It sleeps until the
election's keys change (client tracking; it polls only where tracking is denied).
When Redis cannot be read it says so (on stderr, and with --json as an object with
name and error on stdout) rather than print the last leader it knew, and tries again;
it never prints a term lower than one it printed. Stop it with a signal.";

/// `flock(1)` for a fleet: run commands under fenced Redis leases.
#[derive(Parser, Debug)]
#[command(
    name = "respire-lock",
    version,
    subcommand_required = true,
    after_help = "Every option can also be set from the environment variable shown with it."
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Take a lease on KEY, run CMD while holding it, release it after.
    ///
    /// The lease is renewed at half its TTL while CMD runs. CMD runs in its own
    /// process group: HUP, INT, QUIT and TERM are passed on to the group as
    /// themselves, CMD cannot outlive respire-lock, and if the lease is lost the
    /// group gets SIGTERM, then SIGKILL after --kill-after.
    #[command(after_long_help = RUN_AFTER_HELP)]
    Run(RunArgs),
    /// Report who holds KEY, in which mode, by which token and for how long.
    #[command(after_long_help = STATUS_AFTER_HELP)]
    Status(StatusArgs),
    /// Campaign to lead NAME, run CMD while leader, stop it if leadership is lost.
    ///
    /// The leadership is a fenced lease renewed at half its TTL; its fencing
    /// token is the leader's term. CMD runs supervised as under `run`.
    #[command(after_long_help = ELECT_AFTER_HELP)]
    Elect(ElectArgs),
    /// Print who leads NAME (its value and term), or follow changes with --watch.
    #[command(after_long_help = LEADER_AFTER_HELP)]
    Leader(LeaderArgs),
    /// Report what on a deployment weakens the guarantees.
    ///
    /// Checks persistence and fsync, the eviction policy, replication, cluster mode,
    /// the ACL rights keep-alive and waiting need, the invalidation channel, and with
    /// --key the rights on one KEY's keys.
    #[command(after_long_help = DOCTOR_AFTER_HELP)]
    Doctor(DoctorArgs),
    /// Print a completion script for SHELL on stdout.
    ///
    /// bash: respire-lock completions bash > /etc/bash_completion.d/respire-lock
    /// zsh:  respire-lock completions zsh > ~/.zfunc/_respire-lock  (with ~/.zfunc in $fpath)
    /// fish: respire-lock completions fish > ~/.config/fish/completions/respire-lock.fish
    #[command(verbatim_doc_comment)]
    Completions {
        /// The shell to complete for.
        shell: clap_complete::Shell,
    },
    /// Print a manual page (roff) on stdout: the tool's, or a subcommand's.
    ///
    /// man -l <(respire-lock man run)
    /// respire-lock man > /usr/local/share/man/man1/respire-lock.1
    /// respire-lock man run > /usr/local/share/man/man1/respire-lock-run.1
    #[command(verbatim_doc_comment)]
    Man {
        /// The subcommand whose page to print (respire-lock-SUBCOMMAND(1));
        /// without it, the tool's page, respire-lock(1).
        #[arg(value_parser = ["run", "status", "elect", "leader", "doctor", "completions", "man"])]
        subcommand: Option<String>,
    },
}

/// How long `run` waits for the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Until acquired (or interrupted).
    Forever,
    /// At most this long; zero is one attempt.
    For(Duration),
}

/// How the connections are made: TLS material for `rediss://`.
#[derive(Args, Debug, Clone)]
pub(crate) struct TlsOptions {
    /// PEM file of the certificate authorities to trust for rediss:// (instead of
    /// the system's).
    #[arg(long, env = "RESPIRE_LOCK_TLS_CA", value_name = "FILE")]
    pub(crate) tls_ca: Option<std::path::PathBuf>,

    /// PEM file of a client certificate for rediss:// (with --tls-key).
    #[arg(
        long,
        env = "RESPIRE_LOCK_TLS_CERT",
        value_name = "FILE",
        requires = "tls_key"
    )]
    pub(crate) tls_cert: Option<std::path::PathBuf>,

    /// PEM file of the client certificate's private key (with --tls-cert).
    #[arg(
        long,
        env = "RESPIRE_LOCK_TLS_KEY",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub(crate) tls_key: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
pub(crate) struct RunArgs {
    /// The Redis deployment. Without --url, REDIS_URL, --redlock or --throwaway,
    /// nothing is started (exit 64).
    #[arg(long, env = "REDIS_URL", value_name = "URL", hide_env_values = true)]
    pub(crate) url: Option<String>,

    /// Take a Redlock quorum across these independent servers (an odd number, at
    /// least 3) instead of a fenced lease on one deployment; no fencing token.
    #[arg(
        long,
        env = "RESPIRE_LOCK_REDLOCK",
        value_name = "URL,URL,URL",
        hide_env_values = true,
        value_parser = parse_url_list
    )]
    pub(crate) redlock: Option<UrlList>,

    /// Start a private throwaway redis-server for this run, to try the tool out.
    /// It coordinates with nothing else; it is removed when the run ends.
    #[arg(long, env = "RESPIRE_LOCK_THROWAWAY", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) throwaway: bool,

    /// Fail at once (exit with the conflict code) if KEY is held: one attempt.
    /// Excludes --wait (on the command line; from the environment, the option
    /// given on the command line wins).
    #[arg(short = 'n', long, env = "RESPIRE_LOCK_NONBLOCK", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) nonblock: bool,

    /// How long to wait for the lease: a DURATION (0 = one attempt) or "forever".
    /// A wait too long for the clock (about 35 years or more) waits forever.
    #[arg(short, long, env = "RESPIRE_LOCK_WAIT", value_name = "DURATION", default_value = "forever", value_parser = parse_wait)]
    pub(crate) wait: Wait,

    /// The exit status when KEY is held elsewhere (with -n, or when the wait runs
    /// out); 0 to treat a conflict as success, as `flock -n -E 0` does.
    #[arg(short = 'E', long, env = "RESPIRE_LOCK_CONFLICT_EXIT_CODE", value_name = "CODE", default_value = "75", value_parser = parse_conflict_exit_code)]
    pub(crate) conflict_exit_code: u8,

    /// The exit status when CMD was stopped because the lease was lost.
    #[arg(long, env = "RESPIRE_LOCK_LOST_EXIT_CODE", value_name = "CODE", default_value = "76", value_parser = parse_exit_code)]
    pub(crate) lost_exit_code: u8,

    /// Take KEY exclusive and fenced: the default mode, as flock's -x (-e).
    #[arg(short = 'x', long, short_alias = 'e', env = "RESPIRE_LOCK_EXCLUSIVE", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) exclusive: bool,

    /// Take KEY shared: many shared runs at once, none beside an exclusive one.
    #[arg(short = 's', long, env = "RESPIRE_LOCK_SHARED", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) shared: bool,

    /// Let at most N runs hold KEY at once (a semaphore of N permits; 1..=10000).
    /// Every run on KEY must give the same N.
    #[arg(long, env = "RESPIRE_LOCK_MAX", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub(crate) max: Option<u32>,

    /// The lease's time-to-live, renewed at half of it; at least (2 x node timeout +
    /// 2 ms) / 0.49 (2.045s with the default node timeout).
    #[arg(long, env = "RESPIRE_LOCK_TTL", value_name = "DURATION", default_value = "30s", value_parser = parse_ttl)]
    pub(crate) ttl: Duration,

    /// After SIGTERM to CMD's group (lease lost, or what is left of the group
    /// once CMD ended), SIGKILL it this much later.
    #[arg(long, env = "RESPIRE_LOCK_KILL_AFTER", value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub(crate) kill_after: Duration,

    #[command(flatten)]
    pub(crate) keys: KeyOptions,

    #[command(flatten)]
    pub(crate) tls: TlsOptions,

    /// Report acquisition, the start of CMD, the release and conflicts on stderr.
    #[arg(short, long, env = "RESPIRE_LOCK_VERBOSE", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) verbose: bool,

    /// Write every event as one JSON object per line to this open file
    /// descriptor (see --help).
    #[arg(long, env = "RESPIRE_LOCK_EVENTS_FD", value_name = "N")]
    pub(crate) events_fd: Option<u32>,

    /// Append every event as one JSON object per line to this file (see --help).
    #[arg(long, env = "RESPIRE_LOCK_EVENTS_FILE", value_name = "PATH")]
    pub(crate) events_file: Option<std::path::PathBuf>,

    /// Who holds the lease, as `status` shows it: at most 128 bytes, no control
    /// characters, readable by anyone who can read the key (put no secret in
    /// it). Defaults to this host's name, respire-lock's process id and CMD's
    /// program name (not its arguments, which may carry secrets). Not for
    /// `elect`, whose leader advertises --value.
    #[arg(long, env = "RESPIRE_LOCK_HOLDER", value_name = "TEXT")]
    pub(crate) holder: Option<String>,

    /// The name of the lease, shared by every process that takes it.
    #[arg(value_parser = parse_key)]
    pub(crate) key: String,

    /// The command to run, with its arguments (after `--` when they could be
    /// taken for options of respire-lock).
    #[arg(
        required = true,
        value_name = "CMD",
        trailing_var_arg = true,
        allow_hyphen_values = true,
        num_args = 1..
    )]
    pub(crate) command: Vec<OsString>,
}

#[derive(Args, Debug)]
pub(crate) struct ElectArgs {
    /// The value to advertise while leading (an address, a node name). Defaults
    /// to this host's name and the process id, as host:pid.
    #[arg(long, env = "RESPIRE_LOCK_VALUE", value_name = "VALUE")]
    pub(crate) value: Option<String>,

    /// After the leadership is lost and CMD stopped, campaign again, and run CMD
    /// again once elected.
    #[arg(long, env = "RESPIRE_LOCK_RECAMPAIGN", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) recampaign: bool,

    /// The options of `run` (KEY is the election's NAME).
    #[command(flatten)]
    pub(crate) run: RunArgs,
}

#[derive(Args, Debug)]
pub(crate) struct LeaderArgs {
    /// The Redis deployment to ask.
    #[arg(long, env = "REDIS_URL", value_name = "URL", hide_env_values = true)]
    pub(crate) url: Option<String>,

    #[command(flatten)]
    pub(crate) keys: KeyOptions,

    #[command(flatten)]
    pub(crate) tls: TlsOptions,

    /// Print one JSON object on stdout per state (see --help).
    #[arg(long, env = "RESPIRE_LOCK_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) json: bool,

    /// Keep running and print every change of leader.
    #[arg(long, env = "RESPIRE_LOCK_WATCH", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) watch: bool,

    /// The name of the election, as given to `elect`.
    #[arg(value_parser = parse_key)]
    pub(crate) name: String,
}

/// The options that decide the physical keys and the bound on each command.
#[derive(Args, Debug)]
pub(crate) struct KeyOptions {
    /// Prefix of every key in Redis.
    #[arg(long, env = "RESPIRE_LOCK_PREFIX", value_name = "PREFIX", default_value = "respire-lock:", value_parser = parse_prefix)]
    pub(crate) prefix: String,

    /// The longest one Redis command may take.
    #[arg(long, env = "RESPIRE_LOCK_NODE_TIMEOUT", value_name = "DURATION", default_value = "500ms", value_parser = parse_node_timeout)]
    pub(crate) node_timeout: Duration,
}

#[derive(Args, Debug)]
pub(crate) struct StatusArgs {
    /// The Redis deployment to ask.
    #[arg(long, env = "REDIS_URL", value_name = "URL", hide_env_values = true)]
    pub(crate) url: Option<String>,

    /// Ask every node of this Redlock group instead.
    #[arg(
        long,
        env = "RESPIRE_LOCK_REDLOCK",
        value_name = "URL,URL,URL",
        hide_env_values = true,
        value_parser = parse_url_list
    )]
    pub(crate) redlock: Option<UrlList>,

    #[command(flatten)]
    pub(crate) keys: KeyOptions,

    #[command(flatten)]
    pub(crate) tls: TlsOptions,

    /// Print one JSON object on stdout (see --help).
    #[arg(long, env = "RESPIRE_LOCK_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) json: bool,

    /// Instead of KEY: read the lease at this key (under --prefix) that a
    /// program made with the library (`Lock`, `FencedLock` with any keys, a
    /// Redlock lock).
    #[arg(long, env = "RESPIRE_LOCK_LEASE_KEY", value_name = "LEASE_KEY", value_parser = parse_lease_key)]
    pub(crate) lease: Option<String>,

    /// With --lease: the fenced lock's counter key, for the last token issued.
    #[arg(long, env = "RESPIRE_LOCK_FENCE_KEY", value_name = "FENCE_KEY", value_parser = parse_lease_key)]
    pub(crate) fence: Option<String>,

    /// The name of the lease, as given to `run`.
    #[arg(value_parser = parse_key, required_unless_present = "lease")]
    pub(crate) key: Option<String>,
}

#[derive(Args, Debug)]
pub(crate) struct DoctorArgs {
    /// The Redis deployment to check; or give it as the positional URL (not
    /// both).
    #[arg(
        long = "url",
        env = "REDIS_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    pub(crate) url: Option<String>,

    /// Check the rights on the keys `run` uses for KEY (with --prefix); without
    /// it, on those of a probe name under the prefix.
    #[arg(long, env = "RESPIRE_LOCK_DOCTOR_KEY", value_name = "KEY", value_parser = parse_key)]
    pub(crate) key: Option<String>,

    /// Prefix of every key in Redis (for --key).
    #[arg(long, env = "RESPIRE_LOCK_PREFIX", value_name = "PREFIX", default_value = "respire-lock:", value_parser = parse_prefix)]
    pub(crate) prefix: String,

    #[command(flatten)]
    pub(crate) tls: TlsOptions,

    /// Print one JSON object on stdout (see --help).
    #[arg(long, env = "RESPIRE_LOCK_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) json: bool,

    /// The Redis deployment to check, as --url (not both; either beats
    /// REDIS_URL).
    #[arg(value_name = "URL")]
    pub(crate) positional_url: Option<String>,
}

/// Settles the options of `run` that exclude each other (-n and --wait;
/// -x, --shared and --max; --events-fd and --events-file): two on the
/// command line are a usage error; one on the command line wins over the
/// others from the environment, which are dropped; two from the environment
/// alone are a usage error naming their variables.
pub(crate) fn settle_run(
    mut args: RunArgs,
    matches: &clap::ArgMatches,
    subcommand: &str,
) -> Result<RunArgs, Usage> {
    use clap::parser::ValueSource;
    let given = |id: &str, set: bool| match matches.value_source(id) {
        Some(ValueSource::CommandLine) if set => Some(true),
        Some(ValueSource::EnvVariable) if set => Some(false),
        _ => None,
    };
    let groups: [&[(&str, &str, &str, bool)]; 3] = [
        &[
            ("nonblock", "-n", "RESPIRE_LOCK_NONBLOCK", args.nonblock),
            ("wait", "--wait", "RESPIRE_LOCK_WAIT", true),
        ],
        &[
            ("exclusive", "-x", "RESPIRE_LOCK_EXCLUSIVE", args.exclusive),
            ("shared", "--shared", "RESPIRE_LOCK_SHARED", args.shared),
            ("max", "--max", "RESPIRE_LOCK_MAX", args.max.is_some()),
        ],
        &[
            (
                "events_fd",
                "--events-fd",
                "RESPIRE_LOCK_EVENTS_FD",
                args.events_fd.is_some(),
            ),
            (
                "events_file",
                "--events-file",
                "RESPIRE_LOCK_EVENTS_FILE",
                args.events_file.is_some(),
            ),
        ],
    ];
    let mut dropped = Vec::new();
    for group in groups {
        let on_line: Vec<_> = group
            .iter()
            .filter(|o| given(o.0, o.3) == Some(true))
            .collect();
        let from_env: Vec<_> = group
            .iter()
            .filter(|o| given(o.0, o.3) == Some(false))
            .collect();
        let names = |opts: &[&(&str, &str, &str, bool)], env: bool| {
            let names: Vec<&str> = opts.iter().map(|o| if env { o.2 } else { o.1 }).collect();
            names.join(" and ")
        };
        if on_line.len() > 1 {
            return Err(Usage::new(
                format!("{} exclude each other", names(&on_line, false)),
                Some(subcommand),
            ));
        }
        if on_line.is_empty() && from_env.len() > 1 {
            return Err(Usage::new(
                format!(
                    "{} are both set and exclude each other: unset one, or give the \
                     option you want on the command line",
                    names(&from_env, true)
                ),
                Some(subcommand),
            ));
        }
        if !on_line.is_empty() {
            dropped.extend(from_env.iter().map(|o| o.0));
        }
    }
    // The holder is checked here rather than by clap, whose message would
    // repeat the value with its control characters as they are, and named
    // by where it came from. Only `run` records one: a leader advertises
    // --value, and --holder on elect's command line is refused.
    if let Some(holder) = &args.holder {
        let from_env = matches.value_source("holder") == Some(ValueSource::EnvVariable);
        if subcommand != "run" {
            if !from_env {
                return Err(Usage::new(
                    "--holder is for run: a leader advertises --value",
                    Some(subcommand),
                ));
            }
        } else if let Err(e) = respire_coordination::check_holder(holder) {
            let why = match e {
                respire_coordination::Error::InvalidArgument(why) => why,
                other => other.to_string(),
            };
            let name = if from_env {
                "RESPIRE_LOCK_HOLDER"
            } else {
                "--holder"
            };
            return Err(Usage::new(format!("{name}: {why}"), Some(subcommand)));
        }
    }
    for id in dropped {
        match id {
            "nonblock" => args.nonblock = false,
            "wait" => args.wait = Wait::Forever,
            "exclusive" => args.exclusive = false,
            "shared" => args.shared = false,
            "max" => args.max = None,
            "events_fd" => args.events_fd = None,
            "events_file" => args.events_file = None,
            _ => {}
        }
    }
    Ok(args)
}

/// The rules between `run`'s options, checked before anything is sent.
pub(crate) fn check_run(args: &RunArgs, subcommand: &str) -> Result<(), Usage> {
    let min = Coordinator::builder("redis://unused")
        .node_timeout(args.keys.node_timeout)
        .min_keep_alive_ttl();
    if args.ttl < min {
        // Rounded up to the millisecond so that the named minimum passes.
        let min_ms = Duration::from_millis(min.as_nanos().div_ceil(1_000_000) as u64);
        return Err(Usage::new(
            format!(
                "--ttl {} is too short to renew at half with --node-timeout {}: use at least {}",
                humantime::format_duration(args.ttl),
                humantime::format_duration(args.keys.node_timeout),
                humantime::format_duration(min_ms)
            ),
            Some(subcommand),
        ));
    }
    check_tls(&args.tls, subcommand)
}

/// TLS options need the `tls` feature.
pub(crate) fn check_tls(tls: &TlsOptions, subcommand: &str) -> Result<(), Usage> {
    let given = tls.tls_ca.is_some() || tls.tls_cert.is_some();
    if given && !cfg!(feature = "tls") {
        return Err(Usage::new(
            "--tls-ca, --tls-cert and --tls-key need a respire-lock built with the tls feature \
             (cargo install respire-coordination --features cli,tls)",
            Some(subcommand),
        ));
    }
    Ok(())
}

fn parse_conflict_exit_code(text: &str) -> Result<u8, String> {
    text.trim()
        .parse::<u8>()
        .map_err(|_| "expected an exit status from 0 to 255".into())
}

fn parse_exit_code(text: &str) -> Result<u8, String> {
    match text.trim().parse::<u8>() {
        Ok(0) | Err(_) => Err("expected an exit status from 1 to 255".into()),
        Ok(code) => Ok(code),
    }
}

/// Parses a duration: humantime's `500ms`, `10s`, `1m30s`, `2h`..., or a bare
/// number of seconds (`10`, `0.5`).
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let bad = |why: &str| format!("expected a duration such as 500ms, 10s, 1m30s or 2h ({why})");
    if text.is_empty() {
        return Err(bad("empty"));
    }
    if text.chars().all(|c| c.is_ascii_digit() || c == '.') {
        let seconds: f64 = text.parse().map_err(|_| bad("not a number"))?;
        return Duration::try_from_secs_f64(seconds).map_err(|_| bad("out of range"));
    }
    humantime::parse_duration(text).map_err(|e| bad(&e.to_string()))
}

fn parse_wait(text: &str) -> Result<Wait, String> {
    if text.trim() == "forever" {
        return Ok(Wait::Forever);
    }
    parse_duration(text).map(Wait::For)
}

fn parse_ttl(text: &str) -> Result<Duration, String> {
    let ttl = parse_duration(text)?;
    if ttl.is_zero() {
        return Err("the ttl must be longer than zero".into());
    }
    if ttl > MAX_TTL {
        return Err(format!(
            "the ttl may be at most {}",
            humantime::format_duration(MAX_TTL)
        ));
    }
    Ok(ttl)
}

fn parse_node_timeout(text: &str) -> Result<Duration, String> {
    let timeout = parse_duration(text)?;
    if timeout.is_zero() {
        return Err("the node timeout must be longer than zero".into());
    }
    // A TTL must exceed the node timeout, so nothing above the longest TTL works.
    if timeout > MAX_TTL {
        return Err(format!(
            "the node timeout may be at most {}",
            humantime::format_duration(MAX_TTL)
        ));
    }
    Ok(timeout)
}

fn parse_key(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("KEY is empty".into());
    }
    if text.contains(['{', '}']) {
        return Err("KEY may not contain braces: it becomes the keys' hash tag".into());
    }
    Ok(text.to_owned())
}

fn parse_lease_key(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("the key is empty".into());
    }
    Ok(text.to_owned())
}

fn parse_prefix(text: &str) -> Result<String, String> {
    if text.contains(['{', '}']) {
        return Err(
            "the prefix may not contain braces: they would change the keys' hash tag".into(),
        );
    }
    Ok(text.to_owned())
}

/// The servers of a Redlock group, in the order given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UrlList(pub(crate) Vec<String>);

/// Splits the list; never fails, because clap would print the rejected value
/// (and the passwords in it): [`UrlList::check`] judges it instead.
fn parse_url_list(text: &str) -> Result<UrlList, String> {
    Ok(UrlList(
        text.split(',').map(|u| u.trim().to_owned()).collect(),
    ))
}

impl UrlList {
    /// Refuses an empty item, without showing the list.
    pub(crate) fn check(&self, subcommand: &str) -> Result<(), Usage> {
        if self.0.iter().any(String::is_empty) {
            return Err(Usage::new(
                "--redlock: expected URLs separated by commas, such as \
                 redis://a:6379,redis://b:6379,redis://c:6379",
                Some(subcommand),
            ));
        }
        Ok(())
    }
}

/// A usage error as one line naming the problem, and one line with a hint.
pub(crate) struct Usage {
    pub(crate) problem: String,
    pub(crate) hint: String,
}

impl Usage {
    /// The usage error of a subcommand (`None`: the tool as a whole).
    pub(crate) fn new(problem: impl Into<String>, subcommand: Option<&str>) -> Usage {
        Usage {
            problem: problem.into(),
            hint: help_hint(subcommand),
        }
    }

    /// Cuts clap's error (message, tip, usage block) down to its message and tip.
    pub(crate) fn from_clap(err: &clap::Error, args: &[OsString]) -> Usage {
        let subcommand = subcommand_of(args);
        if err.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            || err.kind() == clap::error::ErrorKind::MissingSubcommand
        {
            return Usage::new("no command given", None);
        }
        let rendered = err.to_string();
        let mut lines = rendered.lines().peekable();
        let mut problem = String::new();
        let mut tips = Vec::new();
        while let Some(line) = lines.next() {
            if let Some(message) = line.strip_prefix("error: ") {
                problem = message.trim().to_owned();
                // "the following required arguments were not provided:" is followed
                // by one indented line per argument.
                if problem.ends_with(':') {
                    let mut items = Vec::new();
                    while let Some(item) = lines.next_if(|l| l.starts_with(' ')) {
                        items.push(item.trim().to_owned());
                    }
                    problem = format!("{} {}", problem, items.join(", "));
                }
            } else if let Some(tip) = line.trim_start().strip_prefix("tip: ") {
                // "to pass '--x' as a value, use '-- --x'" misleads where `--`
                // starts the command.
                if !tip.starts_with("to pass ") {
                    tips.push(tip.trim().to_owned());
                }
            }
        }
        if problem.is_empty() {
            problem = rendered
                .lines()
                .next()
                .unwrap_or("bad command line")
                .to_owned();
        }
        let mut hint = help_hint(subcommand);
        if !tips.is_empty() {
            hint = format!("{}; {hint}", tips.join("; "));
        }
        Usage { problem, hint }
    }

    pub(crate) fn print(&self) {
        crate::say(&format!(
            "respire-lock: {}\nhint: {}",
            self.problem, self.hint
        ));
    }
}

fn help_hint(subcommand: Option<&str>) -> String {
    match subcommand {
        Some(sub) => format!("try 'respire-lock {sub} --help'"),
        None => "try 'respire-lock --help'".into(),
    }
}

/// The subcommand named on the command line, if a known one is: the first
/// argument that is not an option (the tool's own options take no values).
fn subcommand_of(args: &[OsString]) -> Option<&'static str> {
    let first = args
        .iter()
        .skip(1)
        .map(OsString::as_os_str)
        .find(|a| !a.as_encoded_bytes().starts_with(b"-"))?;
    [
        "run",
        "status",
        "elect",
        "leader",
        "doctor",
        "completions",
        "man",
    ]
    .into_iter()
    .find(|name| OsStr::new(name) == first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(
            parse_duration("10000000000000000000s").unwrap(),
            Duration::from_secs(10_000_000_000_000_000_000)
        );
        for bad in ["", "ten", "5x", "-1s", "1.2.3", "100000000000000000000000s"] {
            let err = parse_duration(bad).unwrap_err();
            assert!(err.starts_with("expected a duration"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn limits() {
        assert_eq!(parse_wait("forever").unwrap(), Wait::Forever);
        assert_eq!(parse_wait("0").unwrap(), Wait::For(Duration::ZERO));
        assert!(parse_ttl("0s").is_err());
        assert!(parse_ttl("100y").is_err());
        assert_eq!(parse_ttl("30s").unwrap(), Duration::from_secs(30));
        assert!(parse_node_timeout("0ms").is_err());
        assert!(parse_node_timeout("10000000000000000000s").is_err());
        assert!(parse_key("").is_err());
        assert!(parse_key("{job}").is_err());
        assert_eq!(parse_key("nightly:report").unwrap(), "nightly:report");
        assert!(parse_prefix("app{").is_err());
        assert_eq!(parse_prefix("").unwrap(), "");
        assert_eq!(
            parse_url_list("redis://a, redis://b,redis://c").unwrap().0,
            ["redis://a", "redis://b", "redis://c"]
        );
        assert!(
            parse_url_list("redis://a,,redis://c")
                .unwrap()
                .check("run")
                .is_err()
        );
    }

    fn usage_of(args: &[&str]) -> Usage {
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let err = Cli::command().try_get_matches_from(&args).unwrap_err();
        Usage::from_clap(&err, &args)
    }

    #[test]
    fn usage_errors_are_one_line_and_a_hint() {
        let u = usage_of(&["respire-lock", "run", "--bogus", "job", "--", "true"]);
        assert!(u.problem.contains("'--bogus'"), "{}", u.problem);
        assert!(
            u.hint.ends_with("try 'respire-lock run --help'"),
            "{}",
            u.hint
        );
        let u = usage_of(&["respire-lock", "run", "--ttl", "ten", "job", "--", "true"]);
        assert!(
            u.problem.contains("'ten'") && u.problem.contains("--ttl"),
            "{}",
            u.problem
        );
        let u = usage_of(&["respire-lock", "run"]);
        assert!(
            u.problem.contains("<KEY>") && u.problem.contains("<CMD>"),
            "{}",
            u.problem
        );
        let u = usage_of(&["respire-lock", "frobnicate"]);
        assert!(u.problem.contains("'frobnicate'"), "{}", u.problem);
        assert_eq!(u.hint, "try 'respire-lock --help'");
        let u = usage_of(&["respire-lock"]);
        assert_eq!(u.problem, "no command given");
        for u in [
            usage_of(&["respire-lock", "status"]),
            usage_of(&["respire-lock", "completions", "tcsh"]),
        ] {
            assert!(!u.problem.contains('\n') && !u.hint.contains('\n'));
        }
    }
}
