//! Catching a fencing counter that went back, without false alarms.
//!
//! Tokens come from one counter per fence key, possibly shared by several
//! leases and many threads. Replies can be processed out of order: thread A
//! gets token 5, thread B token 6, and B's reply is read first. So "lower than
//! the highest seen" is no regression by itself. What is certain is the grant
//! order across time: if the reply carrying token `t'` was received before an
//! attempt was *sent*, the server ran that attempt after it issued `t'`, and
//! an intact counter must issue more than `t'`. A token not above one received
//! before its own attempt was sent is a regression.
//!
//! Per fence key the book keeps the tokens received within a short horizon
//! (an attempt's reply arrives within the node timeout of its send), and for
//! everything older a thinned record of the running maximum: at most
//! [`PAST_POINTS`] points (receipt instant, highest token received until
//! then), dense for the recent past and sparser the older they are. A grant
//! whose first attempt was sent long ago (a wait whose early attempt got no
//! reply, spanning a restart) is checked against the last point received
//! before that send: every token the coordinator received before the point
//! counts, for as long as the coordinator lives, and only tokens received
//! between the point and the send (a gap that grows with the send's age, to
//! at most about that age) may be missed. The check never reports a false regression. The book
//! remembers a bounded number of fence keys, forgetting the least recently
//! used.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// How many fence keys the book remembers.
pub(crate) const REMEMBERED_KEYS: usize = 10_000;

/// How many of an attempt's longest durations the book keeps in its recent
/// history.
const ATTEMPTS_PER_HORIZON: u32 = 4;

/// How many points of a key's older history the book keeps.
pub(crate) const PAST_POINTS: usize = 32;

/// The horizon of a deployment whose attempts take at most `node_timeout`
/// plus `replication` (the `WAIT` pipelined after a grant blocks up to its own
/// timeout before the reply comes): a few of those.
pub(crate) fn horizon(node_timeout: Duration, replication: Duration) -> Duration {
    (node_timeout + replication) * ATTEMPTS_PER_HORIZON
}

#[derive(Debug, Default)]
struct History {
    /// Older history, thinned: (received, running maximum), in order.
    past: Vec<(Instant, u64)>,
    /// Tokens received since: (received, running maximum).
    recent: VecDeque<(Instant, u64)>,
    used: u64,
}

impl History {
    /// Moves what was received before `before` into the thinned past.
    fn settle(&mut self, before: Instant) {
        while let Some(&(at, max)) = self.recent.front() {
            if at >= before {
                break;
            }
            self.recent.pop_front();
            match self.past.last_mut() {
                // Nothing new: the later receipt of the same maximum is
                // worth less than the earlier one.
                Some(last) if last.1 >= max => {}
                _ => self.past.push((at, max)),
            }
            if self.past.len() > PAST_POINTS {
                self.thin(before);
            }
        }
    }

    /// Drops the inner point whose removal costs least: a send between it
    /// and the next point is then checked against the point before it (a
    /// lower running maximum, never a false alarm), so the cost is the window
    /// left between its neighbours, relative to how old the sends in it are
    /// at `now`. The oldest and the newest point (the running maximum of all
    /// the past) stay; the rest end up spaced roughly geometrically by age.
    fn thin(&mut self, now: Instant) {
        let last = self.past.len() - 1;
        let cost = |i: usize| {
            let window = self.past[i + 1]
                .0
                .saturating_duration_since(self.past[i - 1].0);
            let age = now
                .saturating_duration_since(self.past[i + 1].0)
                .max(Duration::from_nanos(1));
            window.as_secs_f64() / age.as_secs_f64()
        };
        if let Some(i) = (1..last).min_by(|&a, &b| cost(a).total_cmp(&cost(b))) {
            self.past.remove(i);
        }
    }

    /// The highest token known to have been received strictly before `sent`.
    fn seen_before(&self, sent: Instant) -> u64 {
        let n = self.recent.partition_point(|&(at, _)| at < sent);
        if n > 0 {
            return self.recent[n - 1].1;
        }
        let n = self.past.partition_point(|&(at, _)| at < sent);
        match n {
            0 => 0,
            n => self.past[n - 1].1,
        }
    }

    /// [`FenceBook::check`] on this key's history, at tick `clock`.
    fn check(
        &mut self,
        clock: u64,
        horizon: Duration,
        token: u64,
        sent: Instant,
        received: Instant,
    ) -> Result<(), u64> {
        self.used = clock;
        if let Some(before) = received.checked_sub(horizon) {
            self.settle(before);
        }
        let seen = self.seen_before(sent);
        self.record(received, token);
        if token <= seen { Err(seen) } else { Ok(()) }
    }

    fn record(&mut self, received: Instant, token: u64) {
        let settled = self.past.last().map_or(0, |&(_, m)| m);
        let max = self.recent.back().map_or(settled, |&(_, m)| m);
        // Replies are recorded as they are processed; keep the deque sorted
        // even if two threads record out of order by a hair.
        let at = self
            .recent
            .back()
            .map_or(received, |&(a, _)| a.max(received));
        self.recent.push_back((at, max.max(token)));
    }
}

/// What one coordinator has seen of its fence counters.
#[derive(Debug)]
pub(crate) struct FenceBook {
    keys: HashMap<String, History>,
    horizon: Duration,
    capacity: usize,
    clock: u64,
}

impl FenceBook {
    /// `horizon`: a few times the longest time between an attempt's send and
    /// the processing of its reply (see [`horizon`]).
    pub(crate) fn new(horizon: Duration, capacity: usize) -> Self {
        FenceBook {
            keys: HashMap::new(),
            horizon,
            capacity: capacity.max(1),
            clock: 0,
        }
    }

    /// Checks a token issued by an attempt sent at `sent` whose reply was
    /// received at `received`, and records it. `Err(seen)` names the token it
    /// is not above.
    pub(crate) fn check(
        &mut self,
        key: &str,
        token: u64,
        sent: Instant,
        received: Instant,
    ) -> Result<(), u64> {
        self.clock += 1;
        let (clock, horizon) = (self.clock, self.horizon);
        if let Some(history) = self.keys.get_mut(key) {
            return history.check(clock, horizon, token, sent, received);
        }
        if self.keys.len() >= self.capacity {
            self.forget_oldest();
        }
        // Only a key not seen yet is copied.
        let history = self.keys.entry(key.to_owned()).or_default();
        history.check(clock, horizon, token, sent, received)
    }

    /// Drops the least recently used tenth of the keys.
    fn forget_oldest(&mut self) {
        let mut used: Vec<u64> = self.keys.values().map(|h| h.used).collect();
        let cut = (self.capacity / 10).max(1).min(used.len());
        used.select_nth_unstable(cut - 1);
        let limit = used[cut - 1];
        self.keys.retain(|_, h| h.used > limit);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn out_of_order_replies_of_overlapping_attempts_are_fine() {
        let t0 = Instant::now();
        let mut book = FenceBook::new(ms(2_000), 100);
        // B (token 6) and A (token 5) were in flight at once; B's reply first.
        assert!(book.check("f", 6, t0 + ms(1), t0 + ms(3)).is_ok());
        assert!(book.check("f", 5, t0, t0 + ms(4)).is_ok());
    }

    #[test]
    fn a_token_not_above_one_received_before_the_send_is_a_regression() {
        let t0 = Instant::now();
        let mut book = FenceBook::new(ms(2_000), 100);
        book.check("f", 220, t0, t0 + ms(1)).unwrap();
        assert_eq!(book.check("f", 20, t0 + ms(5), t0 + ms(6)), Err(220));
        // The same token again after it was received is a regression too.
        let mut book = FenceBook::new(ms(2_000), 100);
        book.check("f", 7, t0, t0 + ms(1)).unwrap();
        assert_eq!(book.check("f", 7, t0 + ms(2), t0 + ms(3)), Err(7));
    }

    #[test]
    fn old_history_is_settled_but_still_counts() {
        let t0 = Instant::now();
        let mut book = FenceBook::new(ms(100), 100);
        for i in 0..1_000u64 {
            let at = t0 + ms(i * 10);
            book.check("f", i + 1, at, at + ms(1)).unwrap();
        }
        let h = &book.keys["f"];
        assert!(h.recent.len() <= 12, "{}", h.recent.len());
        let late = t0 + ms(20_000);
        assert_eq!(book.check("f", 3, late, late + ms(1)), Err(1_000));
    }

    #[test]
    fn an_attempt_that_waits_for_replicas_is_checked_against_what_came_before_it() {
        let t0 = Instant::now();
        let (nt, wait) = (ms(100), ms(2_000));
        let horizon = horizon(nt, wait);
        assert!(horizon >= (nt + wait) * 2, "{horizon:?}");
        let mut book = FenceBook::new(horizon, 100);
        book.check("f", 220, t0, t0 + ms(1)).unwrap();
        // Sent after 220 came back; its reply waited for WAIT's whole timeout.
        let sent = t0 + ms(5);
        assert_eq!(book.check("f", 20, sent, sent + nt + wait), Err(220));
        // With a horizon of node timeouts alone, 220 is settled before this
        // attempt's reply, and still counts.
        let mut short = FenceBook::new(nt * ATTEMPTS_PER_HORIZON, 100);
        short.check("f", 220, t0, t0 + ms(1)).unwrap();
        assert_eq!(short.check("f", 20, sent, sent + nt + wait), Err(220));
    }

    #[test]
    fn a_wait_that_began_long_ago_is_checked_against_what_came_before_it() {
        // Token 6 received; a wait sends its first attempt after that, gets
        // no reply (the server went down) and is granted token 1 by the
        // restarted server seconds later.
        let t0 = Instant::now();
        let mut book = FenceBook::new(ms(400), 100);
        book.check("f", 6, t0, t0 + ms(1)).unwrap();
        let first_send = t0 + ms(10);
        let granted = t0 + ms(1_500);
        assert_eq!(book.check("f", 1, first_send, granted), Err(6));
        // A day of grants later, a send made after token 6 still sees it.
        let mut book = FenceBook::new(ms(400), 100);
        for i in 0..86_400u64 {
            let at = t0 + Duration::from_secs(i);
            book.check("f", i + 1, at, at + ms(1)).unwrap();
        }
        let h = &book.keys["f"];
        assert!(h.past.len() <= PAST_POINTS, "{}", h.past.len());
        let late = t0 + Duration::from_secs(86_400 + 60);
        // Sent an hour ago: a token issued well before then is refused.
        let sent = late - Duration::from_secs(3_600);
        let seen = book.check("f", 80_000, sent, late).unwrap_err();
        assert!(seen >= 80_000, "{seen}");
        // And never a false alarm: a token above everything received
        // before the send is fine, however old the send.
        let mut book = FenceBook::new(ms(400), 100);
        for i in 0..1_000u64 {
            let at = t0 + ms(i * 100);
            book.check("f", i + 1, at, at + ms(1)).unwrap();
        }
        assert!(
            book.check("f", 500, t0 + ms(49_900), t0 + ms(200_000))
                .is_ok()
        );
    }

    #[test]
    fn a_full_book_forgets_exactly_its_least_recently_used_tenth() {
        let t0 = Instant::now();
        let mut book = FenceBook::new(ms(100), 20);
        for i in 0..20 {
            book.check(&format!("f{i}"), 1, t0, t0).unwrap();
        }
        // f0 used again: f1 and f2 are now the least recently used.
        book.check("f0", 2, t0 + ms(1), t0 + ms(1)).unwrap();
        assert_eq!(book.len(), 20);
        book.check("new", 1, t0, t0).unwrap();
        assert_eq!(book.len(), 19, "two of twenty forgotten, one added");
        for i in 0..20 {
            let remembered = book.keys.contains_key(&format!("f{i}"));
            assert_eq!(remembered, !(1..=2).contains(&i), "f{i}");
        }
    }

    #[test]
    fn a_reply_received_at_the_very_send_of_another_attempt_is_not_before_it() {
        let t0 = Instant::now();
        let mut book = FenceBook::new(ms(2_000), 100);
        book.check("f", 7, t0, t0 + ms(1)).unwrap();
        assert_eq!(book.check("f", 7, t0 + ms(1), t0 + ms(2)), Ok(()));
    }

    #[test]
    fn keys_are_bounded() {
        let t0 = Instant::now();
        let mut book = FenceBook::new(ms(100), 50);
        for i in 0..1_000 {
            book.check(&format!("f{i}"), 1, t0, t0).unwrap();
        }
        assert!(book.len() <= 50);
        // The most recent keys are remembered.
        assert_eq!(book.check("f999", 1, t0 + ms(1), t0 + ms(1)), Err(1));
    }
}
