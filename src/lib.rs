//! Blocking Redis coordination primitives for programs without an async runtime:
//! sync servers, workers, cron jobs and command-line tools.
//!
//! # Quick start
//!
//! ```no_run
//! use std::time::Duration;
//! use respire_coordination::Coordinator;
//!
//! # fn write_with_fence(_: u64) -> Result<(), Box<dyn std::error::Error>> { Ok(()) }
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let coord = Coordinator::connect("redis://127.0.0.1:6379")?;
//! let lock = coord.fenced_lock("{reports:daily}:lease", "{reports:daily}:fence")?;
//! if let Some(guard) = lock.try_acquire(Duration::from_secs(30))? {
//!     let _renewal = guard.keep_alive()?; // ends before the guard does
//!     if !guard.is_lost() {
//!         write_with_fence(guard.fencing_token().get())?;
//!     }
//! } // dropping the guard releases the lease
//! # Ok(()) }
//! ```
//!
//! The servers must run Redis 7.0 or later (or a server compatible with it,
//! such as Valkey 8): [`CoordinatorBuilder::build`] refuses an older one with
//! [`Error::ServerTooOld`].
//!
//! # Choosing a primitive
//!
//! None of these is consensus. Pick the safety model first:
//!
//! | Need | Primitive | Model |
//! |---|---|---|
//! | One Redis deployment is the authority, and the protected resource can reject stale writers | [`FencedLock`] → [`FencedGuard`] | lease key + persistent counter; every grant carries a strictly increasing [`FencingToken`] |
//! | Plain mutual exclusion, for efficiency only | [`Lock`] → [`LockGuard`] | one key, `SET NX PX`, compare-and-delete |
//! | Many readers or one writer on one deployment | [`ReadWriteLease`] → [`ReadGuard`] / [`WriteGuard`] | writers fenced like [`FencedLock`]; a waiting writer's expiring intent holds back new readers (no starvation); each reader expires by its own score; readers get the last write token |
//! | At most N holders | [`Semaphore`] → [`Permit`] | capacity stored beside the permits (a disagreeing participant gets [`Error::CapacityMismatch`]); every permit expires on the server's clock; each permit holds a slot `0..N` with a fencing token |
//! | A majority across independent deployments | [`RedlockGroup`] → [`RedlockGuard`] | an odd number ≥ 3 of independent standalone servers; no fencing, no consensus |
//! | One leader at a time, and everyone can see who | [`Election`] → [`Leadership`] | a fenced lease whose fencing token is the leader's term, with an advertised value beside it |
//! | Several resources at once, all or none | [`Coordinator::lock_all`] / [`Coordinator::fenced_lock_all`] → [`MultiGuard`] | plain or fenced leases granted by one script call when they share a cluster slot, otherwise taken in one global order (slot, then key bytes); one guard for the set, a fencing token per key |
//!
//! The single-deployment primitives work on a standalone server, a Sentinel
//! deployment or a Redis Cluster alike; see [Topologies](#topologies-standalone-sentinel-cluster).
//!
//! # Fencing
//!
//! A lease cannot stop a holder that paused (a GC pause, swapping, `SIGSTOP`) or
//! whose packets were delayed from acting after its lease ended and someone else
//! got it. A fencing token can, if the protected resource checks it: the resource
//! must refuse, atomically with the write and in the same durable transaction, any
//! token lower than the highest it has accepted. Logging or checking the token in
//! the caller fences nothing. Tokens are monotonic only while the counter's
//! history survives: a failover to a replica that missed increments, a restart
//! without persistence (use `appendfsync always`), a restored backup or eviction
//! (`allkeys-*` policies) can issue a token twice. Never expire, evict, reset or
//! delete the counter. A [`Coordinator`] refuses a token not above one it already
//! saw for the same counter ([`Error::FencingRegression`]).
//!
//! # Reader/writer leases
//!
//! [`Coordinator::read_write_lease`] takes a base key with a hash tag
//! (`"{catalog}"`) and keeps four keys under it: the writer's lease, the
//! readers (a sorted set, each reader scored by its own expiry on the server's
//! clock), the intents of waiting writers, and the write counter. Readers share;
//! a writer excludes everyone and carries a fencing token from the counter, as a
//! [`FencedLock`] does; each reader learns the *write epoch*, the last writer's
//! token. A writer that waits records an intent that expires by itself, is
//! refreshed while it waits and is withdrawn when it stops waiting: it holds
//! back readers that arrive after it (current readers finish), so a stream of
//! overlapping readers cannot starve writers. [`Preference::Reader`] turns that
//! off. There is no upgrade, downgrade or reentrancy; [`ReadWriteLease`] says why.
//!
//! ```no_run
//! use std::time::Duration;
//! use respire_coordination::Coordinator;
//!
//! # fn main() -> Result<(), respire_coordination::Error> {
//! let coord = Coordinator::connect("redis://127.0.0.1:6379")?;
//! let rw = coord.read_write_lease("{catalog}")?;
//! let ttl = Duration::from_secs(30);
//! if let Some(read) = rw.read().acquire_timeout(ttl, Duration::from_secs(5))? {
//!     // read; data stamped with a token above read.write_epoch() is newer
//! }
//! if let Some(write) = rw.write().acquire_timeout(ttl, Duration::from_secs(5))? {
//!     // write, sending write.fencing_token() with every write
//! }
//! # Ok(()) }
//! ```
//!
//! # Semaphores
//!
//! [`Coordinator::semaphore`] admits at most `capacity` holders. The capacity is
//! stored beside the permits by the first acquire, and a participant that
//! declares another gets [`Error::CapacityMismatch`] (nothing changes);
//! [`set_capacity`](Lease::set_capacity) changes it on purpose, and lowering it
//! drains rather than revokes. Every permit expires by its own score on the
//! server's clock, so a crashed holder frees its permit at its expiry while the
//! others renew. Each permit holds the lowest free slot in `0..capacity` and a
//! fencing token; a resource that keeps the highest token per slot never
//! accepts more than `capacity` writers, even from paused holders.
//! [`available`](Lease::available) and [`holders`](Lease::holders) prune expired
//! permits first.
//!
//! ```no_run
//! use std::time::Duration;
//! use respire_coordination::Coordinator;
//!
//! # fn main() -> Result<(), respire_coordination::Error> {
//! let coord = Coordinator::connect("redis://127.0.0.1:6379")?;
//! let exports = coord.semaphore("{exports}", 4)?;
//! if let Some(permit) = exports.acquire_timeout(Duration::from_secs(60), Duration::from_secs(5))? {
//!     let _renewal = permit.keep_alive()?;
//!     // export, sending (permit.slot(), permit.fencing_token()) with every write
//! }
//! # Ok(()) }
//! ```
//!
//! A [`RedlockGroup`] offers neither: a reader set or a permit set needs one
//! authority that orders every change.
//!
//! # Leader election
//!
//! [`Coordinator::election`] elects one leader among contenders that
//! [`campaign`](Election::campaign) with a value to advertise. A
//! [`Leadership`] is a [`FencedGuard`] whose fencing token is the leader's
//! *term*, so a leader that paused past its lease is fenced like any holder;
//! [`proclaim`](Leadership::proclaim) changes the value only while the lease is
//! still this leader's. Everyone else reads the leader with
//! [`leader`](Election::leader) or follows it with
//! [`observe`](Election::observe), a blocking iterator woken by invalidations
//! that never goes back a term. Not offered on a [`RedlockGroup`]: see
//! [`Election`] for why.
//!
//! ```no_run
//! use std::time::Duration;
//! use respire_coordination::{CancelToken, Coordinator};
//!
//! # fn main() -> Result<(), respire_coordination::Error> {
//! let coord = Coordinator::connect("redis://127.0.0.1:6379")?;
//! let election = coord.election("{scheduler}")?;
//! let leading = election.campaign("10.0.0.7:8080", Duration::from_secs(10), &CancelToken::new())?;
//! let _renewal = leading.keep_alive()?;
//! // lead, sending leading.term() with every write, until leading.is_lost()
//! # Ok(()) }
//! ```
//!
//! # Waiting and cancellation
//!
//! Every primitive has the same verbs (they are methods of [`Lease`], the type
//! every single-deployment primitive is):
//!
//! - `try_acquire(ttl)`: one attempt, `Ok(None)` when held by someone else.
//! - `acquire_timeout(ttl, wait)` / `acquire_deadline(ttl, deadline)`: a bounded
//!   wait, `Ok(None)` when it runs out; a zero wait is exactly one attempt, and
//!   `Duration::MAX` waits without end.
//! - `acquire(ttl, &cancel)`: waits until acquired; [`Error::Cancelled`] when the
//!   [`CancelToken`] is cancelled.
//! - `acquire_until(ttl, deadline, &cancel)`: both: `Ok(None)` at the deadline,
//!   `Err(Cancelled)` on cancellation (a caller's cancellation is never turned
//!   into "not acquired").
//!
//! Contention is never an error; `Err` means misuse or infrastructure. Waiters do
//! not poll: one subscriber thread per coordinator receives `CLIENT TRACKING`
//! invalidations and wakes the waiter of the changed key, and a timer wakes it at
//! the holder's expiry (Redis reports expiries late). Within one process, waiters
//! on one key are woken one at a time in arrival order, and a wait that starts
//! while others of the process are queued joins behind them (a thread that has
//! just released a lock does not take it back from the waiter it woke); across
//! processes, each change starts a race, unless the [`Lock`] has
//! [`Fairness::Fifo`]: a queue on the server then grants it in the order its
//! waiters began to wait, and a crashed waiter drops out once its entry
//! expires. A wait on several keys (a reader
//! on the writer's lease and the intents, a writer on the writer's lease and
//! the readers, a permit on the permits and the capacity) is woken by a change
//! of any of them, and its timer is set at the earliest expiry that could free
//! it. If tracking is unavailable (an ACL
//! that denies it, a disconnected subscriber), waiters fall back to polling every
//! 50–150 ms, logged once.
//!
//! **Failures during a wait.** One rule for every wait of every primitive,
//! [`RedlockGroup`]'s included: a wait rides out failures that may pass —
//! timeouts, I/O errors, refused connections, a quorum not reached (Redlock
//! nodes down, slow or not connected), a server loading or failing over
//! ([`Error::is_retryable`]) — with jittered pauses that grow to a ceiling
//! (10 ms doubling to 1 s on one deployment; [`RedlockOptions::retry_base`]
//! doubling to [`RedlockOptions::retry_max`] for Redlock), until its deadline
//! or cancellation. At its deadline it returns the *last error* if its last
//! attempt failed, so a deployment that went away is never reported as "held
//! by someone else"; `Ok(None)` only if the last attempt found the lock held.
//! Permanent errors (authentication, TLS, permissions, bad keys or arguments,
//! independence, a fencing regression; for a Redlock group, such an error on
//! enough nodes that no quorum can form without them) end a wait at once.
//! `acquire` and `acquire_until` end only that way or by cancellation, and
//! `Duration::MAX` as a wait means no deadline. `try_acquire` makes one
//! attempt and returns its error.
//!
//! A command that got no reply may still be applied. When attempts of a wait got
//! no reply and the wait ends without the lock, the connections they went out on
//! are killed and then whatever they may have set is deleted, in the background
//! (so the clean-up cannot be overtaken by a late grant). Cancellation cannot
//! recall a command Redis already accepted; a grant that arrives for an attempt in
//! flight when the wait is cancelled is released.
//!
//! **Time bounds.** One attempt takes at most the node timeout, plus the connect
//! timeout when it has to open a connection (a Redlock attempt never opens one:
//! its nodes connect in the background); a script the server lost from its
//! cache (a restart) is sent again within the same bound. A guard's `release`
//! and its `Drop` take at most the node timeout in all.
//!
//! # Lease loss
//!
//! A guard is *lost* when its local loss deadline passes — the send time of the
//! grant or last *confirmed* renewal, plus the TTL, minus clock drift
//! (`ttl × drift_factor + 2 ms`), minus the node timeout — or when a renewal,
//! verification or extension finds the key expired or owned by someone else.
//! While an extension is in flight, or after one got no reply, the guard assumes
//! the worst of it: a shorter TTL counts from its send time, a longer one counts
//! for nothing until confirmed; extensions of one lease never overlap, and one
//! whose reply never came keeps the lease bounded by its worst case until the
//! connection it went out on has been killed. Loss is permanent. `is_lost()`
//! reads the flag and the monotonic clock and is exact; `lost_signal()` is a
//! channel for `select!` that the renewal thread closes at that moment, and that
//! thread never waits on the network. `keep_alive()` renews at half the TTL and
//! retries failed renewals while time remains. Because the deadline is computed
//! from the *send* time on the local monotonic clock, a server that stops
//! answering (paused, partitioned) makes the guard lost before the lease can
//! expire on the server, whatever the sockets say.
//!
//! Releasing reports a [`ReleaseOutcome`]: `Released`, `Expired`, `TakenOver`, or
//! `Uncertain` when it was sent but no reply came (the lease then ends at its
//! expiry). A release that could not be sent at all is an error, and is sent
//! again in the background until the server answers or the lease would have
//! expired.
//!
//! # Testing your code against lost leases
//!
//! The `test-util` feature (for `[dev-dependencies]`) adds
//! `fake::FakeDeployment`: a Redis server, or a Sentinel deployment, that
//! runs in your test process on loopback ports, with the same Lua scripts a
//! server runs and controls a server cannot offer in milliseconds: advance
//! its clock, pause it, drop or delay replies, lose a key, fail over to a
//! replica that missed the last writes, restart without persistence. A
//! [`Coordinator`] connects to it with its URL, so your test exercises your
//! code's handling of [lease loss](#lease-loss) with the library's real
//! connection code.
//!
//! # Topologies: standalone, Sentinel, Cluster
//!
//! A [`Coordinator`] speaks to one deployment of one of three shapes, and every
//! primitive works the same on each:
//!
//! ```no_run
//! use respire_coordination::Coordinator;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let one = Coordinator::connect("redis://10.0.0.1:6379")?;
//! let failover = Coordinator::sentinel(
//!     &["redis://10.0.0.5:26379", "redis://10.0.0.6:26379", "redis://10.0.0.7:26379"],
//!     "locks",
//! )?;
//! let sharded = Coordinator::cluster(&["redis://10.0.1.1:7000", "redis://10.0.1.2:7000"])?;
//! // The same as URLs: "redis+sentinel://10.0.0.5,10.0.0.6,10.0.0.7/locks",
//! // "redis+cluster://10.0.1.1:7000,10.0.1.2:7000/".
//! # let _ = (one, failover, sharded);
//! # Ok(()) }
//! ```
//!
//! This crate follows the topology itself, over plain connections, so that
//! every step keeps the node timeout as its bound (the `redis` crate's sync
//! cluster client retries a read timeout on one socket up to 16 times, and its
//! sync Sentinel client does not follow `+switch-master`).
//!
//! **Cluster.** The keys of one primitive must share a slot (a common hash tag,
//! checked when the primitive is made). Each command goes to the primary that
//! owns its slot in the slot map (`CLUSTER SHARDS`, or `CLUSTER SLOTS` before
//! Redis 7), read at start, again every
//! [`topology_refresh`](CoordinatorBuilder::topology_refresh) (1 s) and at once
//! after a `MOVED`. A `MOVED` reply updates the map and the command is tried
//! once more on the new owner; `ASK` is followed with `ASKING`; `TRYAGAIN` (a
//! two-key script while a slot's keys are split between two nodes during a
//! migration) is tried again after pauses of 2 ms doubling to 50 ms, within the
//! call's deadline — and a wait rides it out like any retryable error. Each
//! primary has its own connection pool, invalidation subscriber (client ids
//! are per node) and renewal executor, so a slow primary delays nobody else's
//! renewals.
//!
//! **Sentinel.** The coordinator asks the sentinels for the primary, checks
//! `ROLE` on every connection it opens to it, follows `+switch-master` on every
//! sentinel, and asks every sentinel again each refresh interval (a majority
//! wins). On a switch the old primary's pool is closed, the new primary gets a
//! subscriber, and a call whose reply came from the old primary while it was
//! being retired is run once more on the new one: nothing is granted by a
//! demoted primary after the switch is seen.
//!
//! **When keys may have moved** — a slot changed owner, a new primary — every
//! waiter on them is woken (the old owner may never send an invalidation; a
//! forced slot takeover deletes keys without one) and re-arms tracking on the
//! new server, and every live guard on them is verified there: one whose lease
//! is not there is flagged lost and its loss signal closed at once, not at its
//! loss deadline.
//!
//! **What a failover does to safety.** Replication is asynchronous: a promoted
//! replica lacks the grants and fence increments it had not received, so a
//! lease can be granted twice and a fencing token issued twice. The
//! coordinator's fencing check spans the switch (a repeated token is
//! [`Error::FencingRegression`]), and the replication guard
//! ([`CoordinatorBuilder::replication`], [`Replication`]) pipelines `WAIT`
//! after every grant: `Report` tells each guard how many replicas acknowledged
//! ([`LeaseGuard::replicas_acknowledged`]), `Require` refuses a grant too few
//! acknowledged ([`Error::NotReplicated`]). `respire-lock doctor` reports
//! replicas and persistence on every primary.
//!
//! Extensions replicate asynchronously too. What a guard counts on depends on
//! the replication guard:
//!
//! - **`Replication::Require`** closes the window. `WAIT` follows every
//!   extension as it follows every grant (the renewal pipeline and
//!   [`LeaseGuard::reset_expiry`]), and an extension too few replicas
//!   acknowledged counts as one that got no reply: the bound does not move
//!   (a shorter TTL still bounds it from its send time), and `reset_expiry`
//!   fails with [`Error::ExtensionNotReplicated`]. So no guard counts on
//!   more than what the required replicas hold, and a replica promoted in
//!   their place holds the lease at least until the guard's bound, whether or
//!   not this client ever hears of the promotion: under a partition that
//!   leaves the client with the old primary and hides the switch from it (no
//!   sentinel reachable, no `+switch-master`, the old primary confirming
//!   every renewal), its guards are flagged lost at the last replicated
//!   extension's bound, before the new primary lets the key go. Each renewal
//!   and `reset_expiry` may then take up to the replication timeout longer.
//!   It holds for the replicas that acknowledged, so require as many as may
//!   be promoted without the others (one, with one replica; Sentinel promotes
//!   the best replica it can reach).
//! - **`Off` and `Report`** (the default is `Off` on every topology: `Require`
//!   turns a replica's outage into failed grants and renewals, which only the
//!   operator can weigh) leave a window. At a switch the coordinator sees,
//!   every live lease is verified on the new server and its bound becomes at
//!   most the time it has left there (`sent + remaining − drift`); nothing the
//!   old primary confirms counts any more. Until then — the time the
//!   sentinels take to announce the switch, or a slot-map refresh, and
//!   *without bound* when a partition hides the switch from the client — a
//!   guard may count on renewals the new primary never received, and another
//!   client may be granted the lease there. To close it without `Require`,
//!   configure the primaries with `min-replicas-to-write 1` and
//!   `min-replicas-max-lag N`: a primary cut off from its replicas then
//!   refuses renewals after `N` seconds, so the guard is flagged lost within
//!   `N` seconds plus its usual margin (choose TTLs longer than that).
//!   `respire-lock doctor` reports both settings. Redis Cluster behaves the
//!   same, with `cluster-node-timeout` in place of the sentinels' timing.
//!
//! **Time bounds** are those of a standalone server: one attempt takes at most
//! the node timeout (plus the connect timeout per connection it opens, a
//! redirection's target included), a release at most the node timeout in all.
//! [`CoordinatorBuilder::build`] documents how long connecting may take.
//!
//! # Redlock
//!
//! [`RedlockGroup`] takes a lock on a majority of independent standalone
//! servers (antirez's Redlock): every attempt goes to all nodes at once, each
//! bounded by the node timeout, and returns as soon as a quorum granted or
//! cannot; the lock is valid for `ttl − elapsed − (ttl × drift + 2 ms)` from
//! the first send. It survives a minority of nodes failing, but it issues no
//! fencing token and is not consensus: a paused holder, delayed packets, a
//! server clock jump, or a node restarted without its data (see
//! [`RedlockOptions::restart_delay`]) can let two holders overlap. Waiting
//! polls with jittered, bounded pauses, since invalidations from independent
//! servers cannot be combined. Every node is connected when the group is
//! made and reconnects in the background, so an attempt costs one round trip
//! to the quorum's slowest node; the node timeout must be at least twice the
//! slowest node's round trip, which the group measures and checks.
//! [`RedlockGroup`] documents the algorithm, choosing the node timeout, what
//! it does not promise, antirez's delayed-restart rule, the threads and the
//! ACL rights.
//!
//! ```no_run
//! use std::time::Duration;
//! use respire_coordination::{RedlockGroup, RedlockOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let group = RedlockGroup::connect(
//!     &["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"],
//!     RedlockOptions::default(),
//! )?;
//! let wait = Duration::from_secs(2);
//! if let Some(guard) = group.lock("nightly-report")?.acquire_timeout(Duration::from_secs(10), wait)? {
//!     // work while guard.remaining_estimate() leaves enough time
//!     guard.release()?;
//! }
//! # Ok(()) }
//! ```
//!
//! # Threads this crate starts
//!
//! None until needed. Per [`Coordinator`]: a renewal thread (`respire-renewal`,
//! which runs the timer heap of watched leases and does no I/O), started by
//! the first `lost_signal()` or `keep_alive()`; per server it uses (the
//! standalone server, the Sentinel primary, each cluster primary) one executor
//! (`respire-io`, one connection of its own: renewal pipelines, killing
//! connections whose command got no reply, clean-ups, re-verification after a
//! topology change), started by the first renewal or clean-up there, and one
//! invalidation subscriber (`respire-tracker`), started by the first wait
//! there. A Cluster coordinator also runs `respire-topology` (the slot map)
//! from the start; a Sentinel coordinator runs `respire-topology` and one
//! `respire-sentinel-N` per sentinel. A guard that nobody keeps alive or
//! watches involves no thread of its own. Per [`RedlockGroup`]: one worker per
//! node (`respire-node-N`, one connection each), started with the group; a
//! renewal thread (`respire-redlock`), started by the first `keep_alive()` or
//! `lost_signal()` of one of its guards; one watcher per node
//! (`respire-watch-N`, one idle connection each), started with the group; and,
//! only while a node reconnects after a failure, a connector thread
//! (`respire-conn-N`). No thread or
//! connection is created per guard or per waiter. These threads never wait on
//! a lock held across network I/O, and stop when the last handle
//! (coordinator, group or guard) that needs them is dropped. A failure in a
//! background thread flags leases lost and logs; it never panics. A
//! `fake::FakeDeployment` (`test-util`) runs threads of its own
//! (`respire-fake`, one `respire-fake-accept` per port, one
//! `respire-fake-conn` per connection to it) until it is dropped.
//!
//! # Signals
//!
//! A signal handled by a thread that is inside a call of this crate can fail
//! that call. Every socket the crate reads has a timeout, and Linux does not
//! restart a read with a timeout after a signal handler has run (`SA_RESTART`
//! does not cover it): the read fails with `EINTR`. A reply cannot be read on
//! after a failed read, so the call fails with [`Error::Io`] and its command
//! counts as one whose reply is missing, with its worst possible effect
//! assumed. That is safe, but it is a failure nothing caused. A program that
//! handles signals should block them (`pthread_sigmask`) before it starts
//! any thread and take them on one thread that calls nothing of this crate,
//! as `respire-lock` does: the threads this crate starts inherit the mask of
//! the thread that starts them.
//!
//! # Guarantees and limits
//!
//! - Mutual exclusion holds while clocks advance at similar rates and processes
//!   do not pause longer than the loss margin; fencing covers the rest, for
//!   resources that check tokens.
//! - Redis expires keys by its *wall* clock: a server clock stepped forward
//!   (an NTP step, a resumed virtual machine) ends every lease on it early by
//!   the step. Each renewal pipeline reads the server's `TIME` first, and when
//!   the server's clock ran ahead of this process's monotonic clock since the
//!   last reading by more than the drift allows, every lease on that server
//!   has its bound moved earlier by what the server gained (until an
//!   extension set on the new clock is confirmed), is renewed at once if kept
//!   alive, and the [`Observer`] is told (`server_clock_jumped`). A step is
//!   found by the next renewal on that server (every kept-alive lease renews
//!   at half its TTL), so a lease is flagged before the server lets it go
//!   when the server still had more time left than that after the step; a
//!   step larger than a lease's remaining time ends it on the server at once,
//!   and its next renewal finds it gone. A server on which nothing is kept
//!   alive is not read at all.
//! - One Redis deployment is one authority: asynchronous replication means a
//!   failover can lose a grant, and then two holders can exist (see
//!   [Topologies](#topologies-standalone-sentinel-cluster) for what the
//!   coordinator does about it).
//! - The counter and lease keys must not be evicted: use `noeviction` (or a
//!   `volatile-*` policy, which can still drop leases).
//! - Keep-alive needs the ACL rights to run the renewal script on the lease's
//!   keys (`EVALSHA`, `EVAL`), `CLIENT ID` and `CLIENT KILL` (checked by
//!   `keep_alive()` itself); a [`RedlockGroup`] needs `CLIENT ID` and `CLIENT
//!   KILL` on every node (checked when it is made).
//! - A connection whose command got no reply is killed by its id and the
//!   address the server sees it come from (`CLIENT INFO`, Redis 6.2), so that
//!   a restarted server's connection that took the same id is left alone.
//!   Without `CLIENT INFO` (an older server, or an ACL that denies it) the
//!   kill goes by id alone, and after a restart it may close another client's
//!   connection; a [`RedlockGroup`] also compares the server's `run_id`, and
//!   kills nothing on a server that restarted.
//! - A [`RedlockGroup`] survives a minority of failed nodes, but a node that
//!   restarts without its data can hand out a held lock again; it gives no
//!   fencing token.
//!
//! # Who holds it
//!
//! [`Coordinator::inspect`] (a base key's read/write lease, fenced lock and
//! semaphore keys), [`Coordinator::inspect_lease`] (a lease on keys of your
//! choosing) and [`RedlockGroup::inspect`] read, without changing anything,
//! who holds a lease: each holder's owner id, fencing token, slot and time
//! left on the server's clock. A handle given a holder identity with
//! [`Lease::with_holder`] or [`RedlockGroup::with_holder`] records it in
//! every lease it takes, where these calls (and `respire-lock status`) show
//! it; it rides in the owner value the lease stores anyway, so it adds no
//! command. Inspections are for reports and checks: what they read may
//! change as soon as they return.
//!
//! ```no_run
//! use std::time::Duration;
//! use respire_coordination::Coordinator;
//!
//! # fn main() -> Result<(), respire_coordination::Error> {
//! let coord = Coordinator::connect("redis://127.0.0.1:6379")?;
//! let lock = coord.fenced_lock("{reports:daily}:lease", "{reports:daily}:fence")?
//!     .with_holder("host-a pid 4242")?;
//! let guard = lock.try_acquire(Duration::from_secs(30))?;
//! let seen = coord.inspect_lease("{reports:daily}:lease", Some("{reports:daily}:fence"))?;
//! if let Some(x) = seen.exclusive {
//!     println!("held by {:?}, token {:?}, {:?} left", x.holder, x.fencing_token, x.remaining);
//! }
//! # drop(guard);
//! # Ok(()) }
//! ```
//!
//! # Logging
//!
//! Through the `log` crate: `warn!` for lost leases, failed renewals and the
//! polling fallback, `error!` for a fencing counter that went back, `debug!` for
//! routine events.
//!
//! # Observing locks
//!
//! An [`Observer`] given to [`CoordinatorBuilder::observer`] or
//! [`RedlockOptions::with_observer`] hears every acquire call (its
//! [attempt](Observer::attempt), [contention](Observer::contended) with the
//! holder's TTL, and its end: a [grant](Observer::granted) with its fencing
//! token and wait time, or the [reason](WaitEnd) it ended without one), every
//! confirmed [renewal](Observer::renewed) with its margin (how long the lease
//! was still sure to be held when the renewal was confirmed), every
//! [loss](Observer::lost) with its [cause](LossCause), every
//! [release](Observer::released) with its outcome, Sentinel switches and
//! cluster slot moves, and the fall-back to polling. Its methods run on the
//! library's threads and must not block; a panic in one is caught and
//! logged. With no observer set, none of this runs: no clock read, no
//! allocation, no dynamic call.
//!
//! Two implementations come with optional features: `tracing`
//! (`TracingObserver`: a span per acquire call and per held lease) and
//! `metrics` (`MetricsObserver`: counters and histograms, with the key as a
//! label only through a function you give, so the number of series stays
//! your choice).
//!
//! ```no_run
//! use std::sync::Arc;
//! use respire_coordination::{Coordinator, LossEvent, Observer};
//!
//! struct Alert;
//!
//! impl Observer for Alert {
//!     fn lost(&self, e: &LossEvent<'_>) {
//!         eprintln!("lost {} ({}): {}", e.key, e.cause.as_str(), e.detail);
//!     }
//! }
//!
//! # fn main() -> Result<(), respire_coordination::Error> {
//! let coord = Coordinator::builder("redis://127.0.0.1:6379")
//!     .observer(Arc::new(Alert))
//!     .build()?;
//! # let _ = coord;
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![warn(unreachable_pub)]

mod cancel;
mod clock;
mod conn;
mod coordinator;
mod core;
mod error;
mod guard;
mod identity;
mod keys;
mod lease;
mod observe;
mod redlock;
mod replication;
mod reply;
mod report;
mod runtime;
mod scripts;
// The model server behind `fake`; the simulation around it is test-only.
#[cfg(any(test, feature = "test-util"))]
mod sim;
mod token;

#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod fake;

pub use cancel::CancelToken;
pub use conn::Protocol;
pub use conn::url::{DeploymentUrl, UrlKind};
pub use coordinator::inspect::{ExclusiveHolder, HeldAs, Inspection, ReaderHolder};
pub use coordinator::{Coordinator, CoordinatorBuilder};
pub use error::{Error, Result};
pub use guard::{Fencing, Guard, ReleaseOutcome, Verifiable};
pub use keys::{MAX_TTL, key_slot};
pub use lease::acquire::Lease;
pub use lease::election::{Election, Leader, LeaderChanges, Leadership};
pub use lease::fairness::Fairness;
pub use lease::fenced::{FencedGuard, FencedLock};
pub use lease::guard::{Backend, KeepAlive, LeaseGuard};
pub use lease::kind::{Fenced, FencedKind, Kind, Plain, Read, Slot, Write};
pub use lease::lock::{Lock, LockGuard};
pub use lease::multi::{
    FencedMultiGuard, FencedMultiLock, MultiGuard, MultiKeepAlive, MultiLease, MultiLock,
    MultiLockGuard,
};
pub use lease::rwlease::{
    Preference, ReadGuard, ReadLease, ReadWriteLease, WriteGuard, WriteLease,
};
pub use lease::semaphore::{Permit, PermitHolder, Semaphore};
#[cfg(feature = "metrics")]
pub use observe::MetricsObserver;
#[cfg(feature = "tracing")]
pub use observe::TracingObserver;
pub use observe::{
    AttemptEvent, ContentionEvent, GrantEvent, LeaseId, LossCause, LossEvent, Observer,
    PollingEvent, Primitive, ReleaseEvent, RenewalEvent, ServerClockEvent, TopologyChange,
    TopologyEvent, WaitEnd, WaitEndEvent,
};
pub use redlock::{
    NodeInspection, Redlock, RedlockAttempt, RedlockGroup, RedlockGuard, RedlockInspection,
    RedlockNode, RedlockOptions,
};
pub use replication::Replication;
pub use report::{NodeOutcome, NodeReport};
pub use runtime::backoff::Backoff;
pub use runtime::renewal::RenewalStats;
pub use token::{FencingToken, MAX_HOLDER_LEN, check_holder};

/// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// The migration guide's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../MIGRATING.md")]
struct MigratingDoctests;

#[allow(dead_code, reason = "compile-time check only")]
fn _ensure_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<Coordinator>();
    check::<Lock>();
    check::<LockGuard>();
    check::<FencedLock>();
    check::<FencedGuard>();
    check::<ReadWriteLease>();
    check::<ReadLease>();
    check::<ReadGuard>();
    check::<WriteLease>();
    check::<WriteGuard>();
    check::<Semaphore>();
    check::<Permit>();
    check::<Election>();
    check::<Leadership>();
    check::<MultiLock>();
    check::<MultiLockGuard>();
    check::<FencedMultiLock>();
    check::<FencedMultiGuard>();
    check::<Leader>();
    check::<LeaderChanges>();
    check::<KeepAlive<'static>>();
    check::<RedlockGroup>();
    check::<RedlockGuard>();
    check::<RedlockAttempt>();
    check::<CancelToken>();
    check::<Replication>();
    check::<Error>();
    #[cfg(feature = "test-util")]
    check::<fake::FakeDeployment>();
}
