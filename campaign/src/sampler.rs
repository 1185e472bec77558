//! The server oracle: a thread that reads the lease keys straight from the
//! data servers (not through the proxies) every few milliseconds, with each
//! round's send and reply times on the shared monotonic clock. What the
//! server that holds the truth holds at an instant is what a guard's
//! `is_lost() == false` must agree with.
//!
//! Where the truth is depends on the topology:
//!
//! - standalone and Redlock: every server, each its own column (a Redlock
//!   claim needs a quorum of them);
//! - Sentinel: the primary. Each round reads `ROLE` and the keys in one
//!   `MULTI` on every data server; the one that answers `master` is the
//!   truth, and when several do (a restarted or demoted primary the
//!   sentinels have not reconfigured yet) the one most answering sentinels
//!   name. None, or no sentinel naming one of them: nothing is known that
//!   round;
//! - Cluster: each key's slot primary. Each round reads `ROLE` and the keys
//!   in one `MULTI` on every node, with a script that reads only keys of
//!   slots the node serves (any other reads as unknown, so no `MOVED` or
//!   `ASK` reply is ever left unread); what replicas read is not used. One
//!   serving primary is the truth; none, or two that disagree (a switch in
//!   flight), leave the key unknown that round.
//!
//! An unknown round judges nothing: the oracle can miss a violation there,
//! never invent one.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::clock::now_ns;

/// Reads each key as two strings, its value and what is left of it on the
/// server's clock: `str` keys their value (empty if absent) and `PTTL`; `rw`
/// bases `writer|live readers` and `writer PTTL|the latest reader's
/// milliseconds left` (-2: none); `zset` keys their members with a score not
/// below the server's `TIME` in milliseconds, comma separated, and each
/// member's milliseconds left, in the same order. The keys
/// are `KEYS`, or when there are none `ARGV[2..]` (read only where they are
/// local: a key of a slot this node does not serve reads as `false`, nil in
/// the reply, rather than failing the script).
const SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local keys = KEYS
if #keys == 0 then
  keys = {}
  for i = 2, #ARGV do keys[i - 1] = ARGV[i] end
end
local function call(...)
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err then error(r.err) end
  return r
end
local out = {}
for i, k in ipairs(keys) do
  local ok, v, ttl = pcall(function()
    if ARGV[1] == 'str' then
      return call('GET', k) or '', tostring(call('PTTL', k))
    elseif ARGV[1] == 'rw' then
      local last = call('ZREVRANGEBYSCORE', k .. ':r', '+inf', now, 'WITHSCORES', 'LIMIT', 0, 1)
      local readers = -2
      if #last == 2 then readers = tonumber(last[2]) - now end
      return (call('GET', k .. ':w') or '') .. '|' .. call('ZCOUNT', k .. ':r', now, '+inf'),
        tostring(call('PTTL', k .. ':w')) .. '|' .. tostring(readers)
    else
      local m = call('ZRANGEBYSCORE', k, now, '+inf', 'WITHSCORES')
      local names, left = {}, {}
      for j = 1, #m, 2 do
        names[#names + 1] = m[j]
        left[#left + 1] = tostring(tonumber(m[j + 1]) - now)
      end
      return table.concat(names, ','), table.concat(left, ',')
    end
  end)
  if ok then
    out[2 * i - 1] = v
    out[2 * i] = ttl
  else
    out[2 * i - 1] = false
    out[2 * i] = false
  end
end
return out
";

/// Where the truth is read.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    /// Every server, one column each.
    Servers(Vec<String>),
    /// The primary of a Sentinel deployment: its data servers, and the
    /// sentinels that name the primary when several answer `master`.
    Sentinel {
        servers: Vec<String>,
        sentinels: Vec<String>,
        service: String,
    },
    /// Each key's slot primary among the cluster's nodes.
    Cluster(Vec<String>),
}

/// One round.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    /// Before the first read was sent.
    pub(crate) t_b: u64,
    /// After the last reply came.
    pub(crate) t_a: u64,
    /// Per column (a server; the one truth under Sentinel and Cluster), per
    /// key; `None` for a key whose truth is not known that round (the server
    /// did not answer, no primary could be told).
    pub(crate) nodes: Vec<Vec<Option<String>>>,
    /// What was left of each value of `nodes` on the server's clock, in
    /// milliseconds, as the sampler script writes it (see `SCRIPT`); `None`
    /// where the value is unknown. Empty in histories recorded before it
    /// was read.
    pub(crate) ttl: Vec<Vec<Option<String>>>,
}

/// The values and the times left of a script reply, split apart.
fn split(reply: Vec<Option<String>>) -> (Vec<Option<String>>, Vec<Option<String>>) {
    let mut values = Vec::with_capacity(reply.len() / 2);
    let mut ttls = Vec::with_capacity(reply.len() / 2);
    let mut it = reply.into_iter();
    while let (Some(v), Some(t)) = (it.next(), it.next()) {
        values.push(v);
        ttls.push(t);
    }
    (values, ttls)
}

/// One column: values and times left.
type Column = (Vec<Option<String>>, Vec<Option<String>>);

pub(crate) struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<Sample>>>,
}

impl Sampler {
    /// Starts sampling `keys` (physical names, read as `kind`) from `source`.
    pub(crate) fn start(source: Source, keys: Vec<String>, kind: &'static str) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            thread::Builder::new()
                .name("sampler".into())
                .spawn(move || run(&source, &keys, kind, &stop))
                .expect("spawn the sampler")
        };
        Sampler {
            stop,
            thread: Some(thread),
        }
    }

    pub(crate) fn finish(mut self) -> Vec<Sample> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread
            .take()
            .map(|t| t.join().unwrap_or_default())
            .unwrap_or_default()
    }
}

fn connect(url: &str) -> Option<redis::Connection> {
    let client = redis::Client::open(url).ok()?;
    let con = client
        .get_connection_with_timeout(Duration::from_millis(50))
        .ok()?;
    con.set_read_timeout(Some(Duration::from_millis(50))).ok()?;
    con.set_write_timeout(Some(Duration::from_millis(50)))
        .ok()?;
    Some(con)
}

/// Connections by URL, dropped after any failure (a late reply must never be
/// read as the answer to the next request).
struct Pool(HashMap<String, redis::Connection>);

impl Pool {
    fn with<T>(
        &mut self,
        url: &str,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Option<T> {
        if !self.0.contains_key(url) {
            self.0.insert(url.to_string(), connect(url)?);
        }
        let con = self.0.get_mut(url)?;
        let result = f(con).ok();
        if result.is_none() {
            self.0.remove(url);
        }
        result
    }
}

/// The keys read on one server, without a role.
fn read_keys(
    pool: &mut Pool,
    script: &redis::Script,
    url: &str,
    keys: &[String],
    kind: &str,
) -> Option<Column> {
    pool.with(url, |con| {
        let mut inv = script.prepare_invoke();
        for k in keys {
            inv.key(k);
        }
        inv.arg(kind).invoke(con).map(split)
    })
}

/// `ROLE`'s first word and the keys (`None`: a key of a slot the server does
/// not serve), read in one `MULTI` on one server; `None` when the server did
/// not answer.
fn read_role_and_keys(
    pool: &mut Pool,
    url: &str,
    keys: &[String],
    kind: &str,
) -> Option<(String, Column)> {
    pool.with(url, |con| {
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("ROLE")
            .cmd("EVAL")
            .arg(SCRIPT)
            .arg(0)
            .arg(kind)
            .arg(keys);
        let (role, values): (Vec<redis::Value>, Vec<Option<String>>) = pipe.query(con)?;
        let role: String = role
            .first()
            .map(redis::from_redis_value_ref)
            .transpose()?
            .unwrap_or_default();
        Ok((role, split(values)))
    })
}

/// The primary the most answering sentinels name, as `host:port`.
fn named_primary(pool: &mut Pool, sentinels: &[String], service: &str) -> Option<String> {
    let mut votes: HashMap<String, usize> = HashMap::new();
    for url in sentinels {
        let named: Option<Option<(String, u16)>> = pool.with(url, |con| {
            redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(service)
                .query(con)
        });
        if let Some(Some((host, port))) = named {
            *votes.entry(format!("{host}:{port}")).or_default() += 1;
        }
    }
    votes.into_iter().max_by_key(|(_, n)| *n).map(|(a, _)| a)
}

fn round(
    source: &Source,
    pool: &mut Pool,
    script: &redis::Script,
    keys: &[String],
    kind: &str,
) -> Vec<Column> {
    let unknown = || (vec![None; keys.len()], vec![None; keys.len()]);
    match source {
        Source::Servers(urls) => urls
            .iter()
            .map(|url| read_keys(pool, script, url, keys, kind).unwrap_or_else(unknown))
            .collect(),
        Source::Sentinel {
            servers,
            sentinels,
            service,
        } => {
            let masters: Vec<(&String, Column)> = servers
                .iter()
                .filter_map(|url| match read_role_and_keys(pool, url, keys, kind) {
                    Some((role, values)) if role == "master" => Some((url, values)),
                    _ => None,
                })
                .collect();
            let truth = match masters.len() {
                0 => None,
                1 => masters.into_iter().next().map(|(_, values)| values),
                _ => named_primary(pool, sentinels, service).and_then(|addr| {
                    masters
                        .into_iter()
                        .find(|(url, _)| url.ends_with(&addr))
                        .map(|(_, values)| values)
                }),
            };
            vec![truth.unwrap_or_else(unknown)]
        }
        Source::Cluster(nodes) => {
            // Per key, what each serving primary read.
            let mut found: Vec<Vec<(String, Option<String>)>> = vec![Vec::new(); keys.len()];
            for url in nodes {
                if let Some((role, (values, ttls))) = read_role_and_keys(pool, url, keys, kind)
                    && role == "master"
                {
                    for (k, (v, t)) in values.into_iter().zip(ttls).enumerate() {
                        if let Some(v) = v {
                            found[k].push((v, t));
                        }
                    }
                }
            }
            let column: Vec<(Option<String>, Option<String>)> = found
                .into_iter()
                .map(|reads| match reads.as_slice() {
                    [first, rest @ ..] if rest.iter().all(|(v, _)| *v == first.0) => {
                        (Some(first.0.clone()), first.1.clone())
                    }
                    _ => (None, None),
                })
                .collect();
            vec![column.into_iter().unzip()]
        }
    }
}

fn run(source: &Source, keys: &[String], kind: &str, stop: &AtomicBool) -> Vec<Sample> {
    let script = redis::Script::new(SCRIPT);
    let mut pool = Pool(HashMap::new());
    let mut samples = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let t_b = now_ns();
        let (nodes, ttl) = round(source, &mut pool, &script, keys, kind)
            .into_iter()
            .unzip();
        let t_a = now_ns();
        samples.push(Sample {
            t_b,
            t_a,
            nodes,
            ttl,
        });
        thread::sleep(Duration::from_millis(10));
    }
    samples
}
