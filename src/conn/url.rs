//! Deployment URLs: the one parser of every form the crate accepts, built on
//! the `url` crate (WHATWG URL parsing), and the redaction of passwords in
//! anything shown.
//!
//! - `redis://[user[:password]@]host[:port][/db]`, `rediss://…` and
//!   `unix:///path[?db=N]`: one server (the `redis` crate connects with the
//!   text as given, after it passed here).
//! - `redis+cluster://[user[:password]@]host[:port],host[:port]…[/]` (and
//!   `rediss+cluster://`): the seeds of a Redis Cluster.
//! - `redis+sentinel://[user[:password]@]host[:port],…/service[/db]` (and
//!   `rediss+sentinel://`): the sentinels of a Sentinel deployment.
//!
//! No error message ever holds the password: every message names the URL in
//! its redacted form, and an escape that does not decode is reported without
//! the text around it.

use std::fmt;

use percent_encoding::percent_decode_str;

use crate::error::{Error, Result};

/// The default port of a data server.
pub(crate) const DEFAULT_PORT: u16 = 6379;
/// The default port of a sentinel.
pub(crate) const DEFAULT_SENTINEL_PORT: u16 = 26379;

/// What a deployment URL names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum UrlKind {
    /// One server: `redis://`, `rediss://` or `unix://`.
    Server,
    /// A Redis Cluster: `redis+cluster://` or `rediss+cluster://`.
    Cluster,
    /// A Sentinel deployment: `redis+sentinel://` or `rediss+sentinel://`.
    Sentinel,
}

/// A deployment URL, checked and taken apart: what
/// [`Coordinator::connect`](crate::Coordinator::connect) accepts.
///
/// Its `Display` and `Debug` show the URL with the password replaced by
/// `***`; the password itself is only handed to the connections.
///
/// ```
/// use respire_coordination::{DeploymentUrl, UrlKind};
/// let url = DeploymentUrl::parse("redis+sentinel://app:s3cret@s1,s2:5000/jobs").unwrap();
/// assert_eq!(url.kind(), UrlKind::Sentinel);
/// assert_eq!(url.hosts(), ["s1:26379", "s2:5000"]);
/// assert_eq!(url.service(), Some("jobs"));
/// assert_eq!(url.to_string(), "redis+sentinel://app:***@s1,s2:5000/jobs");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct DeploymentUrl {
    text: String,
    kind: UrlKind,
    /// TLS on the data nodes (and the sentinels).
    tls: bool,
    /// `host:port` of each seed or sentinel; the server's for `Server`.
    hosts: Vec<String>,
    user: Option<String>,
    password: Option<String>,
    service: Option<String>,
    database: Option<i64>,
}

/// User info from a topology URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Auth {
    pub(crate) user: Option<String>,
    pub(crate) password: Option<String>,
}

/// A builder's target with topology URLs taken apart.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ParsedTarget {
    Standalone(String),
    Cluster {
        seeds: Vec<String>,
        auth: Option<Auth>,
    },
    Sentinel {
        sentinels: Vec<String>,
        service: String,
        auth: Option<Auth>,
        database: Option<i64>,
    },
}

impl DeploymentUrl {
    /// Checks `text` and takes it apart; nothing is connected.
    ///
    /// # Errors
    /// [`Error::Config`] naming what is wrong (an unknown scheme, a bad port,
    /// an empty host, a `%`-escape that does not decode, a missing service
    /// name…), with the URL shown redacted.
    pub fn parse(text: &str) -> Result<DeploymentUrl> {
        let bad = |why: &str| Error::Config(format!("{}: {why}", redact_url(text)));
        let (scheme, rest) = text
            .split_once("://")
            .ok_or_else(|| bad("not a URL: expected redis://host:port"))?;
        let (kind, tls) = match scheme.to_ascii_lowercase().as_str() {
            "redis" => (UrlKind::Server, false),
            "rediss" => (UrlKind::Server, true),
            "unix" | "redis+unix" => (UrlKind::Server, false),
            "redis+cluster" => (UrlKind::Cluster, false),
            "rediss+cluster" => (UrlKind::Cluster, true),
            "redis+sentinel" => (UrlKind::Sentinel, false),
            "rediss+sentinel" => (UrlKind::Sentinel, true),
            other => {
                return Err(bad(&format!(
                    "unknown scheme {other:?}: expected redis, rediss, unix, redis+cluster or \
                     redis+sentinel"
                )));
            }
        };
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((info, hosts)) => (Some(info), hosts),
            None => (None, authority),
        };
        let (user, password) = match userinfo {
            Some(info) => decode_userinfo(info).map_err(|why| bad(&why))?,
            None => (None, None),
        };
        let mut url = DeploymentUrl {
            text: text.to_owned(),
            kind,
            tls,
            hosts: Vec::new(),
            user,
            password,
            service: None,
            database: None,
        };
        if kind == UrlKind::Server {
            if scheme.eq_ignore_ascii_case("unix") || scheme.eq_ignore_ascii_case("redis+unix") {
                let parsed = ::url::Url::parse(text).map_err(|e| bad(&e.to_string()))?;
                if parsed.path().is_empty() || parsed.path() == "/" {
                    return Err(bad("no socket path"));
                }
                return Ok(url);
            }
            let parsed = ::url::Url::parse(text).map_err(|e| bad(&e.to_string()))?;
            let host = parsed
                .host_str()
                .filter(|h| !h.is_empty())
                .ok_or_else(|| bad("no host given"))?;
            let port = parsed.port().unwrap_or(DEFAULT_PORT);
            if port == 0 {
                return Err(bad("bad port 0"));
            }
            url.hosts = vec![format!("{host}:{port}")];
            let path = parsed.path().trim_start_matches('/');
            if !path.is_empty() {
                url.database = Some(
                    path.parse::<i64>()
                        .map_err(|_| bad(&format!("bad database {path:?}")))?,
                );
            }
            return Ok(url);
        }
        if tail.contains(['?', '#']) {
            return Err(bad("query strings and fragments are not supported"));
        }
        let path = tail.strip_prefix('/').unwrap_or(tail);
        let default_port = match kind {
            UrlKind::Sentinel => DEFAULT_SENTINEL_PORT,
            _ => DEFAULT_PORT,
        };
        url.hosts = host_list(hosts, default_port).map_err(|why| bad(&why))?;
        if kind == UrlKind::Cluster {
            if !path.is_empty() && path != "0" {
                return Err(bad("a Redis Cluster URL has no path (database 0 only)"));
            }
            return Ok(url);
        }
        let mut parts = path.split('/').filter(|p| !p.is_empty());
        let service = parts
            .next()
            .ok_or_else(|| bad("no service name: redis+sentinel://host,host/service"))?;
        url.service = Some(
            percent_decode_str(service)
                .decode_utf8()
                .map_err(|_| bad("the service name is not UTF-8"))?
                .into_owned(),
        );
        if let Some(db) = parts.next() {
            url.database = Some(
                db.parse::<i64>()
                    .map_err(|_| bad(&format!("bad database {db:?}")))?,
            );
        }
        if parts.next().is_some() {
            return Err(bad("too many path segments: /service[/db]"));
        }
        Ok(url)
    }

    /// What the URL names.
    pub fn kind(&self) -> UrlKind {
        self.kind
    }

    /// Whether connections use TLS (`rediss…` schemes).
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// `host:port` of the server, of each cluster seed or of each sentinel, in
    /// the order given (empty for a `unix://` socket).
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// The Sentinel service name.
    pub fn service(&self) -> Option<&str> {
        self.service.as_deref()
    }

    /// The user name given in the URL, decoded.
    pub fn username(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// Whether the URL carries a password.
    pub fn has_password(&self) -> bool {
        self.password.is_some()
    }

    /// The URL of one data server at `host_port` of this deployment, with the
    /// same TLS setting and credentials. It holds the password: use it to
    /// connect, never to show (show this type's `Display` instead).
    pub fn server_url(&self, host_port: &str) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        let enc = |s: &str| {
            percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
        };
        let userinfo = match (&self.user, &self.password) {
            (Some(u), Some(p)) => format!("{}:{}@", enc(u), enc(p)),
            (None, Some(p)) => format!(":{}@", enc(p)),
            (Some(u), None) => format!("{}@", enc(u)),
            (None, None) => String::new(),
        };
        format!("{scheme}://{userinfo}{host_port}")
    }

    /// The target the coordinator builder connects to.
    pub(crate) fn target(&self) -> ParsedTarget {
        let auth = (self.user.is_some() || self.password.is_some()).then(|| Auth {
            user: self.user.clone(),
            password: self.password.clone(),
        });
        let base = if self.tls { "rediss" } else { "redis" };
        let urls = || self.hosts.iter().map(|h| format!("{base}://{h}")).collect();
        match self.kind {
            UrlKind::Server => ParsedTarget::Standalone(self.text.clone()),
            UrlKind::Cluster => ParsedTarget::Cluster {
                seeds: urls(),
                auth,
            },
            UrlKind::Sentinel => ParsedTarget::Sentinel {
                sentinels: urls(),
                service: self.service.clone().unwrap_or_default(),
                auth,
                database: self.database,
            },
        }
    }
}

impl fmt::Display for DeploymentUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(&self.text))
    }
}

impl fmt::Debug for DeploymentUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DeploymentUrl")
            .field(&redact_url(&self.text))
            .finish()
    }
}

/// Reads `topology URL` targets; any other URL is one server's.
pub(crate) fn parse_target(url: &str) -> Result<ParsedTarget> {
    DeploymentUrl::parse(url).map(|u| u.target())
}

/// Decodes `user[:password]`; an escape that does not decode is refused
/// without showing the text.
fn decode_userinfo(info: &str) -> std::result::Result<(Option<String>, Option<String>), String> {
    // The `url` crate accepts user info as given (it neither checks nor
    // decodes escapes): check every `%` first, then decode.
    let check = |part: &str, what: &str| -> std::result::Result<String, String> {
        let bytes = part.as_bytes();
        for (i, b) in bytes.iter().enumerate() {
            if *b == b'%'
                && !(bytes.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                    && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
            {
                return Err(format!("bad %-escape in the {what}"));
            }
        }
        percent_decode_str(part)
            .decode_utf8()
            .map(|s| s.into_owned())
            .map_err(|_| format!("the {what} is not UTF-8 once decoded"))
    };
    let parsed = ::url::Url::parse(&format!("redis://{info}@host/"))
        .map_err(|_| "the user info does not parse".to_owned())?;
    let user = check(parsed.username(), "user name")?;
    let password = parsed
        .password()
        .map(|p| check(p, "password"))
        .transpose()?;
    Ok(((!user.is_empty()).then_some(user), password))
}

/// Splits `host[:port],host[:port]…` (`[v6]:port` too) into `host:port`
/// items, each checked by the `url` crate.
fn host_list(list: &str, default_port: u16) -> std::result::Result<Vec<String>, String> {
    if list.trim().is_empty() {
        return Err("no host given".into());
    }
    list.split(',')
        .map(|item| {
            let item = item.trim();
            if item.is_empty() {
                return Err("an empty host in the list".to_owned());
            }
            if item.starts_with('[') && !item.contains(']') {
                return Err(format!("unclosed '[' in {item:?}"));
            }
            let parsed = ::url::Url::parse(&format!("redis://{item}/"))
                .map_err(|e| format!("bad host {item:?}: {e}"))?;
            let host = parsed
                .host_str()
                .filter(|h| !h.is_empty())
                .ok_or_else(|| format!("bad host {item:?}"))?;
            let port = parsed.port().unwrap_or(default_port);
            if port == 0 {
                return Err(format!("bad port 0 in {item:?}"));
            }
            Ok(format!("{host}:{port}"))
        })
        .collect()
}

/// `url` with any password replaced by `***` (the user name is kept). Text
/// that is not a well-formed URL loses everything before its last `@`.
pub(crate) fn redact_url(url: &str) -> String {
    let Some(at) = url.rfind('@') else {
        return url.to_owned();
    };
    match url.find("://") {
        Some(scheme) if scheme + 3 <= at => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) if !user.contains(['/', '?', '#']) => {
                    format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
                }
                Some(_) => format!("{}***{}", &url[..scheme + 3], &url[at..]),
                None => format!("{}***{}", &url[..scheme + 3], &url[at..]),
            }
        }
        _ => format!("***{}", &url[at..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(user: Option<&str>, password: Option<&str>) -> Option<Auth> {
        Some(Auth {
            user: user.map(str::to_owned),
            password: password.map(str::to_owned),
        })
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("redis://app:secret@host:6379/2"),
            "redis://app:***@host:6379/2"
        );
        assert_eq!(redact_url("redis://:secret@host"), "redis://:***@host");
        assert_eq!(redact_url("redis://secret@host"), "redis://***@host");
        assert_eq!(redact_url("redis://host:6379"), "redis://host:6379");
        assert_eq!(redact_url("app:secret@host"), "***@host");
        assert_eq!(redact_url("redis://u:p@ss@host"), "redis://u:***@host");
    }

    #[test]
    fn topology_urls_are_taken_apart() {
        assert_eq!(
            parse_target("redis://h:1/2").unwrap(),
            ParsedTarget::Standalone("redis://h:1/2".into())
        );
        assert_eq!(
            parse_target("redis+cluster://a:7000,b,[::1]:7002/").unwrap(),
            ParsedTarget::Cluster {
                seeds: vec![
                    "redis://a:7000".into(),
                    "redis://b:6379".into(),
                    "redis://[::1]:7002".into()
                ],
                auth: None
            }
        );
        assert_eq!(
            parse_target("rediss+cluster://app:p%40ss@a:7000").unwrap(),
            ParsedTarget::Cluster {
                seeds: vec!["rediss://a:7000".into()],
                auth: auth(Some("app"), Some("p@ss")),
            }
        );
        assert_eq!(
            parse_target("redis+sentinel://:pw@s1,s2:5000/mymaster/3").unwrap(),
            ParsedTarget::Sentinel {
                sentinels: vec!["redis://s1:26379".into(), "redis://s2:5000".into()],
                service: "mymaster".into(),
                auth: auth(None, Some("pw")),
                database: Some(3),
            }
        );
        let url = DeploymentUrl::parse("redis+cluster://u:p%3Aw@a:7000").unwrap();
        assert_eq!(url.server_url("b:7001"), "redis://u:p%3Aw@b:7001");
    }

    #[test]
    fn bad_urls_are_refused_with_a_reason_and_no_password() {
        for (url, why) in [
            ("redis+cluster:///", "no host"),
            ("redis+cluster://a:7000/5", "no path"),
            ("redis+cluster://a:x", "bad host"),
            ("redis+cluster://a:0", "bad port"),
            ("redis+cluster://a,,b", "empty host"),
            ("redis+cluster://[::1", "unclosed"),
            ("redis+sentinel://s1,s2", "no service name"),
            ("redis+sentinel://s1/", "no service name"),
            ("redis+sentinel://s1/svc/x", "bad database"),
            ("redis+sentinel://s1/svc/1/2", "too many"),
            ("redis+sentinel://s1/svc?x=1", "query"),
            ("redis+cluster://u:%zz@a", "escape"),
            ("redis://u:%zz@a", "escape"),
            ("redis://u:pw@a:99999", "port"),
            ("redis://u:pw@/", "host"),
            ("ftp://u:pw@a", "scheme"),
            ("u:pw@a", "not a URL"),
        ] {
            let err = DeploymentUrl::parse(url).unwrap_err();
            assert!(
                matches!(&err, Error::Config(m) if m.contains(why)),
                "{url}: {err}"
            );
        }
        for url in [
            "redis+cluster://u:secret@a:x",
            "redis+sentinel://u:secret%zz@a/s",
            "rediss://:secret%@a",
            "redis://u:secret@[::1:6379",
        ] {
            let err = DeploymentUrl::parse(url).unwrap_err();
            assert!(!err.to_string().contains("secret"), "{err}");
        }
    }
}
