//! The fenced resource: a hash on a redis-server of its own (never faulted)
//! that the workers read and write under their leases, after Kleppmann's
//! fencing argument ("How to do distributed locking", 2016). It is the
//! oracle outside the library: it accepts an operation only with a token not
//! below the last one it accepted, and it counts what the checkers need.
//!
//! Each worker increments a counter under its lease in two steps, as a
//! client of a storage service would: a fenced read, a pause, then a fenced
//! write of the value read plus one. An accepted write that finds the counter
//! changed since that read is a *lost update*; an accepted operation with the
//! same token as the last one but another owner is a *repeated token
//! accepted* (the only way a lost update can pass the fence). Unfenced
//! workloads (`Lock`, Redlock) pass token 0, which is never refused.

use std::time::Duration;

/// KEYS[1] resource hash; ARGV[1] `r` (read) or `w` (write), ARGV[2] token,
/// ARGV[3] owner (worker and grant), ARGV[4] the value the write's read saw.
/// Returns `{flags, counter}` when accepted (flags: 1, plus 2 for a repeated
/// token accepted, plus 4 for a lost update), `{-1, last}` when refused as
/// stale.
const SCRIPT: &str = r"
local last = tonumber(redis.call('HGET', KEYS[1], 'last') or '0')
local token = tonumber(ARGV[2])
if token < last then
  redis.call('HINCRBY', KEYS[1], 'refused', 1)
  return {-1, last}
end
local flags = 1
if token > 0 and token == last then
  local owner = redis.call('HGET', KEYS[1], 'owner')
  if owner and owner ~= ARGV[3] then
    redis.call('HINCRBY', KEYS[1], 'repeated', 1)
    flags = flags + 2
  end
end
redis.call('HSET', KEYS[1], 'last', ARGV[2], 'owner', ARGV[3])
local counter = tonumber(redis.call('HGET', KEYS[1], 'counter') or '0')
if ARGV[1] == 'r' then
  return {flags, counter}
end
if counter ~= tonumber(ARGV[4]) then
  redis.call('HINCRBY', KEYS[1], 'lost', 1)
  flags = flags + 4
end
redis.call('HSET', KEYS[1], 'counter', tonumber(ARGV[4]) + 1)
redis.call('HINCRBY', KEYS[1], 'accepted', 1)
return {flags, tonumber(ARGV[4]) + 1}
";

/// What the resource answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reply {
    /// The counter, and what the resource flagged: a repeated token, a lost
    /// update.
    Accepted {
        value: i64,
        repeated: bool,
        lost: bool,
    },
    Stale,
    Failed,
}

impl Reply {
    /// `ok`, `ok+repeated`, `ok+lost`, `ok+repeated+lost`, `stale` or `err`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Reply::Accepted {
                repeated: false,
                lost: false,
                ..
            } => "ok",
            Reply::Accepted {
                repeated: true,
                lost: false,
                ..
            } => "ok+repeated",
            Reply::Accepted {
                repeated: false,
                lost: true,
                ..
            } => "ok+lost",
            Reply::Accepted {
                repeated: true,
                lost: true,
                ..
            } => "ok+repeated+lost",
            Reply::Stale => "stale",
            Reply::Failed => "err",
        }
    }
}

/// A worker's connection to the resource server.
pub(crate) struct Resource {
    url: String,
    con: Option<redis::Connection>,
    script: redis::Script,
}

impl Resource {
    pub(crate) fn new(url: &str) -> Resource {
        Resource {
            url: url.to_string(),
            con: None,
            script: redis::Script::new(SCRIPT),
        }
    }

    fn connection(&mut self) -> redis::RedisResult<&mut redis::Connection> {
        if self.con.is_none() {
            let client = redis::Client::open(self.url.as_str())?;
            let con = client.get_connection_with_timeout(Duration::from_secs(2))?;
            con.set_read_timeout(Some(Duration::from_secs(2)))?;
            con.set_write_timeout(Some(Duration::from_secs(2)))?;
            self.con = Some(con);
        }
        Ok(self.con.as_mut().expect("just connected"))
    }

    /// A fenced read (`write == None`) or write of `read + 1`.
    pub(crate) fn op(&mut self, key: &str, token: u64, owner: &str, write: Option<i64>) -> Reply {
        let script = self.script.clone();
        let result: redis::RedisResult<(i64, i64)> = self.connection().and_then(|con| {
            script
                .key(key)
                .arg(if write.is_some() { "w" } else { "r" })
                .arg(token)
                .arg(owner)
                .arg(write.unwrap_or(0))
                .invoke(con)
        });
        match result {
            Ok((flags, value)) if flags > 0 => Reply::Accepted {
                value,
                repeated: flags & 2 != 0,
                lost: flags & 4 != 0,
            },
            Ok(_) => Reply::Stale,
            Err(_) => {
                self.con = None;
                Reply::Failed
            }
        }
    }
}

/// The counters of one resource hash at the end of a run.
#[derive(Debug, Default, Clone)]
pub(crate) struct Tally {
    pub(crate) accepted: u64,
    pub(crate) refused: u64,
    pub(crate) lost: u64,
    pub(crate) repeated: u64,
}

/// Reads every resource hash (`res:*`) on the resource server.
pub(crate) fn tally(con: &mut redis::Connection) -> redis::RedisResult<Vec<(String, Tally)>> {
    let keys: Vec<String> = redis::cmd("KEYS").arg("res:*").query(con)?;
    let mut out = Vec::new();
    for key in keys {
        let map: std::collections::HashMap<String, String> =
            redis::cmd("HGETALL").arg(&key).query(con)?;
        let get = |f: &str| map.get(f).and_then(|v| v.parse().ok()).unwrap_or(0);
        out.push((
            key,
            Tally {
                accepted: get("accepted"),
                refused: get("refused"),
                lost: get("lost"),
                repeated: get("repeated"),
            },
        ));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}
