//! The raw Redlock baseline: one thread per node, each with one persistent
//! connection, fed by a channel; the caller returns as soon as a quorum has
//! answered yes, or too few nodes are left for one. Late answers are told
//! apart by a sequence number and dropped. No validity, drift or evidence:
//! only the fan-out and the two commands a Redlock needs per node.

use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::child::Res;
use crate::single::{COMPARE_AND_DELETE, load};

enum Op {
    Acquire { ttl_ms: u64 },
    Release,
}

struct Job {
    seq: u64,
    op: Op,
    key: Arc<str>,
    value: Arc<str>,
}

pub(crate) struct QuorumWorkers {
    jobs: Vec<Sender<Arc<Job>>>,
    answers: Receiver<(u64, bool)>,
    workers: Vec<JoinHandle<()>>,
    seq: u64,
    quorum: usize,
    timeout: Duration,
}

impl QuorumWorkers {
    /// Connects to every node (read and write timeouts of `timeout`) and
    /// starts its worker.
    pub(crate) fn start(urls: &[String], timeout: Duration) -> Res<QuorumWorkers> {
        let (answer_tx, answers) = crossbeam_channel::unbounded();
        let mut jobs = Vec::new();
        let mut workers = Vec::new();
        for url in urls {
            let client = redis::Client::open(url.as_str())?;
            let mut conn = connect(&client, Duration::from_secs(5), timeout)?;
            let sha = load(&mut conn, COMPARE_AND_DELETE)?;
            let (tx, rx) = crossbeam_channel::unbounded::<Arc<Job>>();
            let answer_tx = answer_tx.clone();
            let worker = move || {
                let mut conn = Some(conn);
                for job in rx {
                    let yes = conn.as_mut().map(|c| run(c, &job, &sha));
                    let yes = match yes {
                        Some(Ok(yes)) => yes,
                        // A timed-out connection may be mid-reply: start afresh.
                        _ => {
                            conn = connect(&client, timeout, timeout).ok();
                            false
                        }
                    };
                    if answer_tx.send((job.seq, yes)).is_err() {
                        return;
                    }
                }
            };
            workers.push(
                thread::Builder::new()
                    .name("raw-node".into())
                    .spawn(worker)?,
            );
            jobs.push(tx);
        }
        Ok(QuorumWorkers {
            quorum: jobs.len() / 2 + 1,
            jobs,
            answers,
            workers,
            seq: 0,
            timeout,
        })
    }

    /// Sets `key` to `value` (NX, PX `ttl_ms`) on every node; whether a
    /// quorum did. A failed attempt is released in the background.
    pub(crate) fn acquire(&mut self, key: &Arc<str>, value: &Arc<str>, ttl_ms: u64) -> bool {
        let won = self.fan_out(Op::Acquire { ttl_ms }, key, value) >= self.quorum;
        if !won {
            self.send(Op::Release, key, value);
        }
        won
    }

    /// Deletes `key` where it still holds `value`; whether a quorum did.
    pub(crate) fn release(&mut self, key: &Arc<str>, value: &Arc<str>) -> bool {
        self.fan_out(Op::Release, key, value) >= self.quorum
    }

    fn send(&mut self, op: Op, key: &Arc<str>, value: &Arc<str>) -> u64 {
        self.seq += 1;
        let job = Arc::new(Job {
            seq: self.seq,
            op,
            key: key.clone(),
            value: value.clone(),
        });
        for tx in &self.jobs {
            let _ = tx.send(job.clone());
        }
        self.seq
    }

    /// How many nodes said yes by the time the outcome was decided.
    fn fan_out(&mut self, op: Op, key: &Arc<str>, value: &Arc<str>) -> usize {
        let seq = self.send(op, key, value);
        let deadline = Instant::now() + self.timeout;
        let (mut yes, mut answered) = (0, 0);
        while yes < self.quorum && yes + (self.jobs.len() - answered) >= self.quorum {
            match self.answers.recv_deadline(deadline) {
                Ok((s, ok)) if s == seq => {
                    answered += 1;
                    yes += usize::from(ok);
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        yes
    }
}

/// A connection with read and write timeouts of `timeout`.
fn connect(
    client: &redis::Client,
    connect_timeout: Duration,
    timeout: Duration,
) -> redis::RedisResult<redis::Connection> {
    let conn = client.get_connection_with_timeout(connect_timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))?;
    Ok(conn)
}

fn run(conn: &mut redis::Connection, job: &Job, sha: &str) -> redis::RedisResult<bool> {
    match job.op {
        Op::Acquire { ttl_ms } => {
            let set: redis::Value = redis::cmd("SET")
                .arg(&*job.key)
                .arg(&*job.value)
                .arg("NX")
                .arg("PX")
                .arg(ttl_ms)
                .query(conn)?;
            Ok(set == redis::Value::Okay)
        }
        Op::Release => {
            let deleted: i64 = redis::cmd("EVALSHA")
                .arg(sha)
                .arg(1)
                .arg(&*job.key)
                .arg(&*job.value)
                .query(conn)?;
            Ok(deleted == 1)
        }
    }
}

impl Drop for QuorumWorkers {
    fn drop(&mut self) {
        self.jobs.clear();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}
