//! `respire-lock doctor`: what on a deployment weakens the guarantees.

use std::process::ExitCode;
use std::time::Duration;

use respire_coordination::{Coordinator, DeploymentUrl, UrlKind};

use crate::args::{DoctorArgs, EXIT_USAGE, Usage};
use crate::endpoint::{self, Tls};
use crate::json::{self, Object};
use crate::{EXIT_UNAVAILABLE, say, show};

/// The oldest Redis the library runs on: the read/write scripts behind
/// `run`'s default mode call `PEXPIRETIME` (7.0).
const MIN_REDIS: (u32, u32) = (7, 0);

/// The channel the invalidation subscriber listens on.
const CHANNEL: &str = "__redis__:invalidate";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    Ok,
    Warn,
    Fail,
}

/// What `doctor` found about one aspect of the deployment.
struct Finding {
    level: Level,
    /// Which check: "version", "persistence", "eviction", "replication",
    /// "cluster", "acl", "topology", "sentinel", "failover" or "key" (the
    /// list in `--help`).
    check: &'static str,
    message: String,
}

impl Finding {
    fn new(level: Level, check: &'static str, message: impl Into<String>) -> Finding {
        Finding {
            level,
            check,
            message: message.into(),
        }
    }
}

pub(crate) fn main(args: DoctorArgs, matches: &clap::ArgMatches) -> ExitCode {
    // One URL, given one way: the positional URL and --url together are
    // refused (neither is shown: they may hold passwords); either on the
    // command line beats REDIS_URL.
    let url_on_line = matches.value_source("url") == Some(clap::parser::ValueSource::CommandLine);
    if url_on_line && args.positional_url.is_some() {
        Usage::new(
            "doctor takes one URL: give it as URL or with --url, not both",
            Some("doctor"),
        )
        .print();
        return ExitCode::from(EXIT_USAGE);
    }
    let Some(url) = args.positional_url.or(args.url) else {
        Usage::new(
            "doctor needs a Redis deployment to check: give URL, --url or set REDIS_URL",
            Some("doctor"),
        )
        .print();
        return ExitCode::from(EXIT_USAGE);
    };
    let tls = match Tls::read(&args.tls, "doctor") {
        Ok(t) => t,
        Err(usage) => {
            usage.print();
            return ExitCode::from(EXIT_USAGE);
        }
    };
    // Without --key, a probe name checks the rights under the prefix.
    let key = (
        args.prefix.as_str(),
        args.key.as_deref().unwrap_or("doctor-probe"),
    );
    let findings = match diagnose(&url, &tls, key) {
        Ok(f) => f,
        Err(e) => {
            say(&format!("respire-lock: {e}"));
            return ExitCode::from(EXIT_UNAVAILABLE);
        }
    };
    let failed = findings.iter().any(|f| f.level == Level::Fail);
    if args.json {
        let items = findings.iter().map(|f| {
            Object::new()
                .str(
                    "level",
                    match f.level {
                        Level::Ok => "ok",
                        Level::Warn => "warn",
                        Level::Fail => "fail",
                    },
                )
                .str("check", f.check)
                .str("message", &f.message)
                .finish()
        });
        show(
            &Object::new()
                .bool("ok", !failed)
                .raw("findings", &json::array(items))
                .finish(),
        );
    } else {
        let lines: Vec<String> = findings
            .iter()
            .map(|f| {
                let level = match f.level {
                    Level::Ok => "ok",
                    Level::Warn => "warn",
                    Level::Fail => "FAIL",
                };
                format!("{level:<6}{}", f.message)
            })
            .collect();
        show(&lines.join("\n"));
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// Checks the deployment at `url`, and the rights on the keys of KEY under
/// the prefix.
fn diagnose(
    url: &str,
    tls: &Tls,
    (prefix, key): (&str, &str),
) -> Result<Vec<Finding>, Box<dyn std::error::Error>> {
    let parsed = DeploymentUrl::parse(url)?;
    // Checks that the library can connect at all (auth, TLS, the topology)
    // first.
    let keys = crate::args::KeyOptions {
        prefix: prefix.to_owned(),
        node_timeout: std::time::Duration::from_millis(500),
    };
    let coord = endpoint::connect(url, &keys, tls)?;
    let mut out = Vec::new();
    match parsed.kind() {
        UrlKind::Cluster => {
            let primaries = coord.primaries();
            out.push(Finding::new(
                Level::Ok,
                "topology",
                format!(
                    "topology: Redis Cluster, {} primaries; each lease lives on its slot's \
                     primary, and slot moves and failovers are followed",
                    primaries.len()
                ),
            ));
            for (i, primary) in primaries.iter().enumerate() {
                let addr = primary.split("://").nth(1).unwrap_or(primary);
                let node = parsed.server_url(addr);
                node_checks(&node, &format!("{addr}: "), true, i == 0, &mut out)?;
            }
            out.push(Finding::new(
                Level::Warn,
                "failover",
                "failover: a promoted replica has only the grants and fence increments it had \
                 received; the rest are lost, so a lease can be granted twice and a token \
                 issued twice (this tool then reports a fencing regression); use \
                 Replication::Require in the library to refuse grants no replica acknowledged",
            ));
        }
        UrlKind::Sentinel => {
            let service = parsed.service().unwrap_or_default();
            out.push(sentinel_checks(parsed.hosts(), service, parsed.is_tls()));
            let primary = coord.primaries().pop().unwrap_or_default();
            let addr = primary.split("://").nth(1).unwrap_or(&primary).to_owned();
            out.push(Finding::new(
                Level::Ok,
                "topology",
                format!(
                    "topology: Sentinel service {service:?}, primary {addr}; switches are \
                     followed"
                ),
            ));
            let node = parsed.server_url(&addr);
            node_checks(&node, "primary: ", true, true, &mut out)?;
            out.push(Finding::new(
                Level::Warn,
                "failover",
                "failover: after a switch the old primary keeps accepting writes until Sentinel \
                 reconfigures it (seconds later) and then discards them; grants and fence \
                 increments the new primary never received are lost, so a token can be issued \
                 twice (this tool then reports a fencing regression, and such leases are \
                 flagged lost at the switch); use Replication::Require in the library to refuse \
                 grants no replica acknowledged",
            ));
        }
        _ => node_checks(url, "", false, true, &mut out)?,
    }
    out.push(key_check(&coord, prefix, key));
    Ok(out)
}

/// Whether this user may read and write the keys `run` uses for KEY: the
/// library's inspection reads every key of the layout (as `status` does), and
/// a lock on a probe key of the same layout is taken and released at once
/// (as `run` writes). A key the ACL denies fails with NOPERM.
fn key_check(coord: &Coordinator, prefix: &str, key: &str) -> Finding {
    let base = endpoint::base(key);
    let shown = format!("{prefix}{base}:*");
    let denied = |e: &respire_coordination::Error| {
        let text = e.to_string();
        text.contains("NOPERM") || text.contains("permission")
    };
    if let Err(e) = coord.inspect(&base) {
        return if denied(&e) {
            Finding::new(
                Level::Fail,
                "key",
                format!("key: reading {shown} denied: run cannot take {key:?} ({e})"),
            )
        } else {
            Finding::new(
                Level::Warn,
                "key",
                format!("key: unknown: cannot read {shown} ({e})"),
            )
        };
    }
    let probe = coord
        .lock(&format!("{base}:doctor-probe"))
        .and_then(|lock| lock.try_acquire(std::time::Duration::from_secs(5)));
    match probe {
        Ok(guard) => {
            if let Some(guard) = guard {
                let _ = guard.release();
            }
            Finding::new(
                Level::Ok,
                "key",
                format!("key: {shown} can be read and written"),
            )
        }
        Err(e) if denied(&e) => Finding::new(
            Level::Fail,
            "key",
            format!("key: writing {shown} denied: run cannot take {key:?} ({e})"),
        ),
        Err(e) => Finding::new(
            Level::Warn,
            "key",
            format!("key: unknown: cannot write {shown} ({e})"),
        ),
    }
}

/// Asks every sentinel about `service`: how many answer, the quorum, the
/// replicas and sentinels they know.
fn sentinel_checks(sentinels: &[String], service: &str, tls: bool) -> Finding {
    let scheme = if tls { "rediss" } else { "redis" };
    let timeout = Duration::from_secs(2);
    let mut answered = Vec::new();
    for host in sentinels {
        let fields = (|| -> Result<Vec<String>, Box<dyn std::error::Error>> {
            let client = redis::Client::open(format!("{scheme}://{host}"))?;
            let mut conn = client.get_connection_with_timeout(timeout)?;
            conn.set_read_timeout(Some(timeout))?;
            Ok(redis::cmd("SENTINEL")
                .arg("MASTER")
                .arg(service)
                .query(&mut conn)?)
        })();
        if let Ok(fields) = fields {
            let get = |name: &str| {
                fields
                    .chunks_exact(2)
                    .find(|kv| kv[0] == name)
                    .map(|kv| kv[1].clone())
                    .unwrap_or_default()
            };
            answered.push((get("quorum"), get("num-slaves"), get("num-other-sentinels")));
        }
    }
    let Some((quorum, replicas, others)) = answered.first().cloned() else {
        return Finding::new(
            Level::Fail,
            "sentinel",
            format!(
                "sentinel: none of {} sentinel(s) answers for {service:?}",
                sentinels.len()
            ),
        );
    };
    let level = if answered.len() * 2 > sentinels.len() && replicas != "0" {
        Level::Ok
    } else {
        Level::Warn
    };
    Finding::new(
        level,
        "sentinel",
        format!(
            "sentinel: {} of {} sentinel(s) answer; quorum {quorum}; {replicas} replica(s); each \
             knows {others} other sentinel(s)",
            answered.len(),
            sentinels.len()
        ),
    )
}

/// The checks of one data server at `url`; every message starts with
/// `prefix` (the server, when there are several). `topology`: the server is
/// part of a cluster or Sentinel deployment the coordinator follows; `acl`:
/// also check the ACL rights (the same on every node).
fn node_checks(
    url: &str,
    prefix: &str,
    topology: bool,
    acl: bool,
    out: &mut Vec<Finding>,
) -> Result<(), Box<dyn std::error::Error>> {
    let client = redis::Client::open(url)?;
    let timeout = Duration::from_secs(2);
    let mut conn = client.get_connection_with_timeout(timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    let start = out.len();
    let info = |conn: &mut redis::Connection, section: &str| -> String {
        redis::cmd("INFO")
            .arg(section)
            .query(conn)
            .unwrap_or_default()
    };
    let field = |text: &str, name: &str| -> Option<String> {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.trim().to_owned())
    };
    let config = |conn: &mut redis::Connection, name: &str| -> Option<String> {
        let pair: Vec<String> = redis::cmd("CONFIG").arg("GET").arg(name).query(conn).ok()?;
        pair.get(1).cloned()
    };

    let server = info(&mut conn, "server");
    out.extend(version_findings(&server));

    let persistence = match (
        config(&mut conn, "appendonly"),
        config(&mut conn, "appendfsync"),
    ) {
        (Some(aof), Some(fsync)) if aof == "yes" && fsync == "always" => Finding::new(
            Level::Ok,
            "persistence",
            "persistence: appendonly yes, appendfsync always: the fence counter survives a crash",
        ),
        (Some(aof), Some(fsync)) if aof == "yes" => Finding::new(
            Level::Warn,
            "persistence",
            format!(
                "persistence: appendfsync {fsync}: a crash can lose the last fence increments, \
                 and tokens can then repeat; use appendfsync always"
            ),
        ),
        (Some(_), _) => Finding::new(
            Level::Fail,
            "persistence",
            "persistence: appendonly no: a restart loses the fence counter (tokens repeat) \
             and every lease",
        ),
        _ => Finding::new(
            Level::Warn,
            "persistence",
            "persistence: unknown: CONFIG cannot be read (ACL?); check appendonly yes / \
             appendfsync always",
        ),
    };
    out.push(persistence);

    let eviction = match config(&mut conn, "maxmemory-policy") {
        Some(p) if p == "noeviction" => Finding::new(
            Level::Ok,
            "eviction",
            "eviction: noeviction: keys are never evicted",
        ),
        Some(p) if p.starts_with("allkeys") => Finding::new(
            Level::Fail,
            "eviction",
            format!("eviction: {p} can evict the fence counter (tokens then restart) and leases"),
        ),
        Some(p) => Finding::new(
            Level::Warn,
            "eviction",
            format!("eviction: {p} can evict leases (they carry expiries) before they expire"),
        ),
        None => Finding::new(
            Level::Warn,
            "eviction",
            "eviction: unknown: maxmemory-policy cannot be read (ACL?)",
        ),
    };
    out.push(eviction);

    let replication = info(&mut conn, "replication");
    let replication = match field(&replication, "role").as_deref() {
        Some("master") => {
            let replicas: u32 = field(&replication, "connected_slaves")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            if topology && replicas == 0 {
                Finding::new(
                    Level::Warn,
                    "replication",
                    "replication: no replica: nothing can take over if this primary fails",
                )
            } else if replicas > 0 {
                // A primary cut off from its replicas keeps confirming
                // renewals unless it refuses writes without them.
                let min =
                    config(&mut conn, "min-replicas-to-write").and_then(|v| v.parse::<u32>().ok());
                let lag = config(&mut conn, "min-replicas-max-lag");
                let guarded = match (min, lag) {
                    (Some(n), Some(lag)) if n > 0 => format!(
                        "min-replicas-to-write {n} with min-replicas-max-lag {lag}: cut off from \
                         its replicas, it refuses renewals after {lag} s, so a guard that cannot \
                         see a failover is flagged lost within that plus its margin"
                    ),
                    (Some(0), _) => "min-replicas-to-write 0: cut off from its replicas (a \
                         partition that hides a failover), it keeps confirming renewals that no \
                         promoted replica has; set min-replicas-to-write 1 and \
                         min-replicas-max-lag, or use Replication::Require"
                        .to_owned(),
                    _ => "min-replicas-to-write unknown (CONFIG cannot be read)".to_owned(),
                };
                Finding::new(
                    Level::Warn,
                    "replication",
                    format!(
                        "replication: {replicas} replica(s), asynchronous: a failover can lose \
                         grants and fence increments (two holders, repeated tokens); {guarded}"
                    ),
                )
            } else {
                Finding::new(Level::Ok, "replication", "replication: standalone primary")
            }
        }
        Some(role) => Finding::new(
            Level::Fail,
            "replication",
            format!("replication: this server is a {role}: locks must be taken on the primary"),
        ),
        None => Finding::new(
            Level::Warn,
            "replication",
            "replication: unknown: INFO replication cannot be read (ACL?)",
        ),
    };
    out.push(replication);
    if !topology && field(&info(&mut conn, "cluster"), "cluster_enabled").as_deref() == Some("1") {
        out.push(Finding::new(
            Level::Warn,
            "cluster",
            "cluster mode: this server is one node of a Redis Cluster; connect with \
             redis+cluster://HOST:PORT,HOST:PORT/ so that slot moves and failovers are followed",
        ));
    }
    out.push(tracking_check(&client, timeout));
    if !acl {
        prefix_messages(&mut out[start..], prefix);
        return Ok(());
    }

    // ACL rights, each tried harmlessly.
    let rights: [(&str, &[&str]); 5] = [
        ("CLIENT ID", &["CLIENT", "ID"]),
        ("CLIENT INFO", &["CLIENT", "INFO"]),
        (
            "CLIENT KILL",
            &["CLIENT", "KILL", "ID", "9223372036854775807"],
        ),
        ("EVAL", &["EVAL", "return 1", "0"]),
        ("CLIENT TRACKING", &["CLIENT", "TRACKING", "OFF"]),
    ];
    for (what, args) in rights {
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        match cmd.query::<redis::Value>(&mut conn) {
            Err(e) if e.code() == Some("NOPERM") && what == "CLIENT INFO" => {
                out.push(Finding::new(
                    Level::Warn,
                    "acl",
                    "acl: CLIENT INFO denied: a connection is killed by id alone, and after a \
                     server restart that id may be another client's",
                ))
            }
            Err(e) if e.code() == Some("NOPERM") => out.push(Finding::new(
                Level::Fail,
                "acl",
                format!(
                    "acl: {what} denied: {}",
                    match what {
                        "CLIENT TRACKING" => "waiters fall back to polling",
                        "EVAL" => "no primitive works",
                        _ => "keep-alive cannot run",
                    }
                ),
            )),
            _ => out.push(Finding::new(
                Level::Ok,
                "acl",
                format!("acl: {what} allowed"),
            )),
        }
    }
    let mut sub = client.get_connection_with_timeout(timeout)?;
    sub.set_read_timeout(Some(timeout))?;
    sub.set_write_timeout(Some(timeout))?;
    out.push(match subscribe(&mut sub) {
        Subscribed::Yes => {
            Finding::new(Level::Ok, "acl", format!("acl: channel {CHANNEL} allowed"))
        }
        Subscribed::Denied(e) => Finding::new(
            Level::Fail,
            "acl",
            format!("acl: channel {CHANNEL} denied: waiters fall back to polling ({e})"),
        ),
        Subscribed::Failed(e) => Finding::new(
            Level::Warn,
            "acl",
            format!("acl: cannot tell whether channel {CHANNEL} is allowed: {e}"),
        ),
    });
    prefix_messages(&mut out[start..], prefix);
    Ok(())
}

/// Whether waits can be woken by invalidations and pay for tracking only
/// while they wait: `CLIENT TRACKING ON REDIRECT id OPTIN` then `CLIENT
/// CACHING yes`, on a connection of its own (closed after, which ends its
/// tracking), redirected to another.
fn tracking_check(client: &redis::Client, timeout: Duration) -> Finding {
    let connect = || -> redis::RedisResult<redis::Connection> {
        let conn = client.get_connection_with_timeout(timeout)?;
        conn.set_read_timeout(Some(timeout))?;
        conn.set_write_timeout(Some(timeout))?;
        Ok(conn)
    };
    let tried =
        (|| -> redis::RedisResult<(redis::RedisResult<()>, Option<redis::RedisResult<()>>)> {
            let mut target = connect()?;
            let id: i64 = redis::cmd("CLIENT").arg("ID").query(&mut target)?;
            let mut conn = connect()?;
            let on: redis::RedisResult<()> = redis::cmd("CLIENT")
                .arg("TRACKING")
                .arg("ON")
                .arg("REDIRECT")
                .arg(id)
                .arg("OPTIN")
                .query(&mut conn);
            if on.is_err() {
                return Ok((on, None));
            }
            let caching = redis::cmd("CLIENT")
                .arg("CACHING")
                .arg("yes")
                .query(&mut conn);
            Ok((on, Some(caching)))
        })();
    match tried {
        Ok((Ok(()), Some(Ok(())))) => Finding::new(
            Level::Ok,
            "tracking",
            "tracking: CLIENT TRACKING OPTIN and CLIENT CACHING supported: waits are woken by \
             invalidations and track a key only while they wait",
        ),
        Ok((Ok(()), Some(Err(e)))) => Finding::new(
            Level::Warn,
            "tracking",
            format!(
                "tracking: CLIENT CACHING refused ({e}): waiting connections track every key \
                 they read, so an uncontended acquire on a connection that once waited costs \
                 an invalidation"
            ),
        ),
        Ok((Err(e), _)) => Finding::new(
            Level::Warn,
            "tracking",
            format!(
                "tracking: CLIENT TRACKING OPTIN refused ({e}): waits fall back to polling \
                 every 50–150 ms"
            ),
        ),
        Ok((Ok(()), None)) => unreachable!("CLIENT CACHING is tried once tracking is on"),
        Err(e) => Finding::new(
            Level::Warn,
            "tracking",
            format!("tracking: cannot tell whether client tracking works: {e}"),
        ),
    }
}

fn prefix_messages(findings: &mut [Finding], prefix: &str) {
    for f in findings {
        f.message = format!("{prefix}{}", f.message);
    }
}

/// What a `SUBSCRIBE` to the invalidation channel got.
enum Subscribed {
    Yes,
    /// The server refused it (`NOPERM`).
    Denied(String),
    /// Any other error or reply.
    Failed(String),
}

/// Subscribes `conn` to the invalidation channel and reads the reply itself:
/// the `redis` crate's `PubSub::subscribe` takes an error reply, such as the
/// `NOPERM` of an ACL without the channel, for success.
fn subscribe(conn: &mut redis::Connection) -> Subscribed {
    let cmd = redis::cmd("SUBSCRIBE").arg(CHANNEL).get_packed_command();
    if let Err(e) = conn.send_packed_command(&cmd) {
        return Subscribed::Failed(e.to_string());
    }
    match conn.recv_response().and_then(|reply| reply.extract_error()) {
        Ok(redis::Value::Array(reply)) if matches!(reply.first(), Some(redis::Value::BulkString(kind)) if kind == b"subscribe") => {
            Subscribed::Yes
        }
        Ok(other) => Subscribed::Failed(format!("unexpected reply {other:?}")),
        Err(e) if e.code() == Some("NOPERM") => Subscribed::Denied(e.to_string()),
        Err(e) => Subscribed::Failed(e.to_string()),
    }
}

/// The server's name and version from `INFO server`: Valkey reports
/// `redis_version` (the Redis version it is compatible with) and
/// `valkey_version` beside it; the minimum is judged on `redis_version`.
fn version_findings(server: &str) -> Vec<Finding> {
    let field = |name: &str| {
        server
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.trim().to_owned())
    };
    let (min_major, min_minor) = MIN_REDIS;
    let Some(version) = field("redis_version") else {
        return vec![Finding::new(
            Level::Warn,
            "version",
            format!(
                "version: unknown: INFO server cannot be read (ACL?); Redis \
                 {min_major}.{min_minor} or later is needed"
            ),
        )];
    };
    let name = match field("valkey_version") {
        Some(valkey) => format!("valkey {valkey} (redis_version {version})"),
        None => format!("redis {version}"),
    };
    let mut parts = version.split('.').map(|v| v.parse::<u32>().unwrap_or(0));
    let major = parts.next().unwrap_or(0);
    let minor = parts.next().unwrap_or(0);
    if (major, minor) < MIN_REDIS {
        return vec![Finding::new(
            Level::Fail,
            "version",
            format!(
                "{name}: too old: Redis {min_major}.{min_minor} or later is needed \
                 (the scripts of run's default exclusive mode and of --shared call \
                 PEXPIRETIME, and fail on older servers)"
            ),
        )];
    }
    vec![Finding::new(
        Level::Ok,
        "version",
        format!(
            "{name}: at least Redis {min_major}.{min_minor}: every script, client tracking \
             and CLIENT INFO supported"
        ),
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judged(info: &str) -> (Level, String) {
        let findings = version_findings(info);
        assert_eq!(findings.len(), 1);
        (findings[0].level, findings[0].message.clone())
    }

    #[test]
    fn the_minimum_server_is_redis_7_0_and_valkey_is_named_as_valkey() {
        let (level, message) =
            judged("# Server\r\nredis_version:6.2.14\r\nredis_mode:standalone\r\n");
        assert_eq!(level, Level::Fail, "{message}");
        assert!(message.starts_with("redis 6.2.14: too old"), "{message}");
        let (level, message) = judged("redis_version:7.0.15\r\n");
        assert_eq!(level, Level::Ok, "{message}");
        assert!(message.starts_with("redis 7.0.15:"), "{message}");
        let (level, message) = judged(
            "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:8.1.1\r\n",
        );
        assert_eq!(level, Level::Ok, "{message}");
        assert!(
            message.starts_with("valkey 8.1.1 (redis_version 7.2.4):"),
            "{message}"
        );
        let (level, _) = judged("# Server\r\n");
        assert_eq!(level, Level::Warn);
    }
}
