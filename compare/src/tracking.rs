//! The raw baseline of a waiter that does not poll: a command connection
//! whose reads are tracked (`CLIENT TRACKING ON REDIRECT id`) and a RESP2
//! connection subscribed to `__redis__:invalidate` under that id. An attempt
//! is one round trip: `SET key value NX PX ttl` and `PTTL key` pipelined (the
//! `PTTL` read arms tracking of the key). A failed attempt sleeps until an
//! invalidation of the key arrives, or the holder's TTL runs out.

use std::thread;
use std::time::Duration;

use crossbeam_channel::Receiver;

use crate::child::{Res, connect};
use crate::single::{COMPARE_AND_DELETE, load};

const CHANNEL: &str = "__redis__:invalidate";

pub(crate) struct TrackingWaiter {
    conn: redis::Connection,
    wakes: Receiver<()>,
    key: String,
    release_sha: String,
    ttl_ms: u64,
}

impl TrackingWaiter {
    /// Connects both connections and returns once the subscription is in
    /// place.
    pub(crate) fn connect(url: &str, key: String, ttl: Duration) -> Res<TrackingWaiter> {
        let mut subscriber = connect(url)?;
        subscriber.set_read_timeout(None)?;
        let id: i64 = redis::cmd("CLIENT").arg("ID").query(&mut subscriber)?;
        let mut conn = connect(url)?;
        redis::cmd("CLIENT")
            .arg("TRACKING")
            .arg("ON")
            .arg("REDIRECT")
            .arg(id)
            .query::<()>(&mut conn)?;
        let release_sha = load(&mut conn, COMPARE_AND_DELETE)?;
        let (wake_tx, wakes) = crossbeam_channel::unbounded();
        let (ready_tx, ready) = crossbeam_channel::bounded(1);
        let watched = key.clone();
        thread::Builder::new()
            .name("raw-tracker".into())
            .spawn(move || {
                let mut pubsub = subscriber.as_pubsub();
                let subscribed = pubsub.subscribe(CHANNEL).map_err(|e| e.to_string());
                let failed = subscribed.is_err();
                let _ = ready_tx.send(subscribed);
                if failed {
                    return;
                }
                while let Ok(msg) = pubsub.get_message() {
                    // A flush invalidates everything: its payload is nil.
                    let keys: Option<Vec<String>> = msg.get_payload().ok();
                    let ours = keys.is_none_or(|keys| keys.contains(&watched));
                    if ours && wake_tx.send(()).is_err() {
                        return;
                    }
                }
            })?;
        ready.recv()??;
        Ok(TrackingWaiter {
            conn,
            wakes,
            key,
            release_sha,
            ttl_ms: ttl.as_millis() as u64,
        })
    }

    /// Blocks until the key is set to `value`.
    pub(crate) fn acquire(&mut self, value: &str) -> Res<()> {
        loop {
            // Wake-ups from before this attempt's read are stale; later ones
            // cannot be missed, since the read below arms tracking first.
            while self.wakes.try_recv().is_ok() {}
            let (set, pttl): (redis::Value, i64) = redis::pipe()
                .cmd("SET")
                .arg(&self.key)
                .arg(value)
                .arg("NX")
                .arg("PX")
                .arg(self.ttl_ms)
                .cmd("PTTL")
                .arg(&self.key)
                .query(&mut self.conn)?;
            if set == redis::Value::Okay {
                return Ok(());
            }
            let expiry = Duration::from_millis(pttl.max(1) as u64);
            let _ = self.wakes.recv_timeout(expiry);
        }
    }

    /// Deletes the key if it holds `value`; whether it did.
    pub(crate) fn release(&mut self, value: &str) -> Res<bool> {
        let deleted: i64 = redis::cmd("EVALSHA")
            .arg(&self.release_sha)
            .arg(1)
            .arg(&self.key)
            .arg(value)
            .query(&mut self.conn)?;
        Ok(deleted == 1)
    }
}
