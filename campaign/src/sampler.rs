//! The server oracle: a thread that reads the lease keys straight from every
//! data server (not through the proxies) every few milliseconds, with each
//! read's send and reply times on the shared monotonic clock. What a server
//! holds at an instant is the truth a guard's `is_lost() == false` must agree
//! with. Standalone and Redlock only: under Sentinel and Cluster the truth
//! moves between servers, and the overlap and token checkers stand alone.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::clock::now_ns;

/// Reads each key as one string: `str` keys their value (empty if absent),
/// `rw` bases `writer|live readers`, `zset` keys their members with a score
/// not below the server's `TIME` in milliseconds, comma separated.
const SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i, k in ipairs(KEYS) do
  if ARGV[1] == 'str' then
    out[i] = redis.call('GET', k) or ''
  elseif ARGV[1] == 'rw' then
    out[i] = (redis.call('GET', k .. ':w') or '') .. '|' .. redis.call('ZCOUNT', k .. ':r', now, '+inf')
  else
    out[i] = table.concat(redis.call('ZRANGEBYSCORE', k, now, '+inf'), ',')
  end
end
return out
";

/// One round over every server.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    /// Before the first read was sent.
    pub(crate) t_b: u64,
    /// After the last reply came.
    pub(crate) t_a: u64,
    /// Per server, per key; `None` for a server that did not answer.
    pub(crate) nodes: Vec<Option<Vec<String>>>,
}

pub(crate) struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<Sample>>>,
}

impl Sampler {
    /// Starts sampling `keys` (physical names, read as `kind`) on `urls`.
    pub(crate) fn start(urls: Vec<String>, keys: Vec<String>, kind: &'static str) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            thread::Builder::new()
                .name("sampler".into())
                .spawn(move || run(&urls, &keys, kind, &stop))
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

fn run(urls: &[String], keys: &[String], kind: &str, stop: &AtomicBool) -> Vec<Sample> {
    let script = redis::Script::new(SCRIPT);
    let mut cons: Vec<Option<redis::Connection>> = urls.iter().map(|_| None).collect();
    let mut samples = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let t_b = now_ns();
        let mut nodes = Vec::with_capacity(urls.len());
        for (i, url) in urls.iter().enumerate() {
            if cons[i].is_none() {
                cons[i] = connect(url);
            }
            let reply = cons[i].as_mut().and_then(|con| {
                let mut inv = script.prepare_invoke();
                for k in keys {
                    inv.key(k);
                }
                inv.arg(kind).invoke::<Vec<String>>(con).ok()
            });
            if reply.is_none() {
                cons[i] = None;
            }
            nodes.push(reply);
        }
        let t_a = now_ns();
        samples.push(Sample { t_b, t_a, nodes });
        thread::sleep(Duration::from_millis(10));
    }
    samples
}
