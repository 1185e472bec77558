//! The command line: subcommands, options and their environment variables,
//! value parsers, and usage errors cut down to one line and a hint.

use std::ffi::{OsStr, OsString};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use respire_coordination::MAX_TTL;

/// Bad command line.
pub(crate) const EXIT_USAGE: u8 = 64;

const RUN_AFTER_HELP: &str = "\
CMD sees RESPIRE_FENCING_TOKEN (not with --redlock; strictly increasing per KEY: pass it
to the resource you protect and have it refuse lower tokens) and RESPIRE_LOCK_KEY (the
lease key in Redis).

DURATION: 500ms, 10s, 1m30s, 2h, ... (a bare number is seconds).

Exit status: CMD's status (128+N if it died of signal N), or
  64  usage error
  69  Redis unavailable or refused
  70  CMD could not be started
  75  not acquired before the wait ran out
  76  CMD stopped: the lease was lost

With --json, each event is one JSON object on a line of stderr, with the fields
\"event\", \"time\" (RFC 3339, UTC) and \"key\", and by event:
  throwaway     url
  acquired      lease_key, token (null with --redlock), ttl_ms, mode (\"fenced\" | \"redlock\")
  started       pid, command
  lost          cause (\"expired\" | \"taken_over\" | \"deadline\" | \"unreachable\" | \"quorum\"), reason
  exited        code, signal (one of them null)
  released      outcome (\"released\" | \"expired\" | \"taken_over\" | \"uncertain\" | \"lapsed\" | \"failed\"), detail
  not_acquired  exit_code
  interrupted   signal
  error         exit_code, message";

const STATUS_AFTER_HELP: &str = "\
Reads the lease and fence keys `run` uses for KEY (<prefix>{KEY}:lease and
<prefix>{KEY}:fence) with one pipelined GET, PTTL, GET; changes nothing. Exits 0
whether KEY is held or free, 69 when Redis cannot be asked.

With --json, one object on stdout: key, lease_key, fence_key, held (bool), token
(the holder's fencing token, or null), ttl_ms (the lease's remaining time-to-live;
null when free or without expiry), last_token (the highest fencing token issued for
KEY, or null).";

const DOCTOR_AFTER_HELP: &str = "\
Exits 0 when nothing failed, 1 when a check failed, 69 when Redis cannot be reached.

With --json, one object on stdout: ok (bool: no check failed) and findings, a list of
objects with level (\"ok\" | \"warn\" | \"fail\"), check (\"version\", \"persistence\",
\"eviction\", \"replication\", \"cluster\", \"acl\") and message.";

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
    /// Take a fenced lease on KEY, run CMD while holding it, release it after.
    ///
    /// The lease is renewed at half its TTL while CMD runs. If it is lost, CMD gets
    /// SIGTERM, then SIGKILL after --kill-after. SIGINT or SIGTERM to respire-lock is
    /// passed on to CMD (a second one kills it); the lease is released when CMD exits.
    #[command(after_long_help = RUN_AFTER_HELP)]
    Run(RunArgs),
    /// Report whether KEY is held, by which fencing token, and for how long.
    #[command(after_long_help = STATUS_AFTER_HELP)]
    Status(StatusArgs),
    /// Report what on a deployment weakens the guarantees.
    ///
    /// Checks persistence and fsync, the eviction policy, replication, cluster mode,
    /// the ACL rights keep-alive and waiting need, and the invalidation channel.
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
}

/// How long `run` waits for the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Until acquired (or interrupted).
    Forever,
    /// At most this long; zero is one attempt.
    For(Duration),
}

#[derive(Args, Debug)]
pub(crate) struct RunArgs {
    /// The Redis deployment. With neither --url nor REDIS_URL, a throwaway local
    /// redis-server is started for the run.
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

    /// How long to wait for the lease: a DURATION (0 = one attempt) or "forever".
    /// A wait too long for the clock (about 35 years or more) waits forever.
    #[arg(long, env = "RESPIRE_LOCK_WAIT", value_name = "DURATION", default_value = "forever", value_parser = parse_wait)]
    pub(crate) wait: Wait,

    /// The lease's time-to-live, renewed at half of it.
    #[arg(long, env = "RESPIRE_LOCK_TTL", value_name = "DURATION", default_value = "30s", value_parser = parse_ttl)]
    pub(crate) ttl: Duration,

    /// After SIGTERM to CMD on lease loss, SIGKILL it this much later.
    #[arg(long, env = "RESPIRE_LOCK_KILL_AFTER", value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub(crate) kill_after: Duration,

    #[command(flatten)]
    pub(crate) keys: KeyOptions,

    /// Report acquisition, the start of CMD and the release on stderr.
    #[arg(short, long, env = "RESPIRE_LOCK_VERBOSE", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) verbose: bool,

    /// Report every event as one JSON object per line on stderr (see --help).
    #[arg(long, env = "RESPIRE_LOCK_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) json: bool,

    /// The name of the lease, shared by every process that takes it.
    #[arg(value_parser = parse_key)]
    pub(crate) key: String,

    /// The command to run, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub(crate) command: Vec<OsString>,
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

    #[command(flatten)]
    pub(crate) keys: KeyOptions,

    /// Print one JSON object on stdout (see --help).
    #[arg(long, env = "RESPIRE_LOCK_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) json: bool,

    /// The name of the lease, as given to `run`.
    #[arg(value_parser = parse_key)]
    pub(crate) key: String,
}

#[derive(Args, Debug)]
pub(crate) struct DoctorArgs {
    /// The Redis deployment to check (also accepted as the positional URL).
    #[arg(
        long = "url",
        env = "REDIS_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    pub(crate) url: Option<String>,

    /// Print one JSON object on stdout (see --help).
    #[arg(long, env = "RESPIRE_LOCK_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) json: bool,

    /// The Redis deployment to check, as --url.
    #[arg(value_name = "URL")]
    pub(crate) positional_url: Option<String>,
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

fn parse_url_list(text: &str) -> Result<UrlList, String> {
    let urls: Vec<String> = text.split(',').map(|u| u.trim().to_owned()).collect();
    if urls.iter().any(String::is_empty) {
        return Err("expected URLs separated by commas, such as redis://a:6379,redis://b:6379,redis://c:6379".into());
    }
    Ok(UrlList(urls))
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
    ["run", "status", "doctor", "completions"]
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
        assert!(parse_url_list("redis://a,,redis://c").is_err());
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
