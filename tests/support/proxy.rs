//! A TCP proxy on std threads that delays, drops or cuts traffic on demand.
//!
//! Each proxied connection has four threads: per direction a reader that
//! stamps every chunk with the time it may leave, and a writer that sends the
//! chunks in order once that time has come. A delay therefore shifts the
//! stream in time without limiting its throughput.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How often blocked proxy threads look at the shutdown and reset flags.
const POLL: Duration = Duration::from_millis(50);
/// How often a writer holding bytes ([`Mode::HoldClientToServer`]) looks
/// whether it may send them.
const HOLD_POLL: Duration = Duration::from_millis(2);
/// How long the proxy waits to connect to the upstream server.
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const CHUNK_SIZE: usize = 16 * 1024;

/// What a [`FaultProxy`] does with the bytes it receives. A new mode applies
/// at once to existing and new connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Forward everything as it arrives.
    Pass,
    /// Forward everything, in order, this long after it arrived, in both
    /// directions (a round trip takes at least twice this).
    Delay(Duration),
    /// Accept connections and read from both sides but forward nothing, not
    /// even a close: like a network partition. A connection that was open
    /// stays open (and counted) until both sides have closed, or until
    /// [`FaultProxy::reset_all`] or the proxy's drop; after a switch back to
    /// [`Mode::Pass`] its byte stream has a gap, so clients should reconnect.
    Blackhole,
    /// Discard what the client sends; forward what the server sends.
    DropClientToServer,
    /// Forward what the client sends; discard what the server sends.
    DropServerToClient,
    /// Forward what the client sends as it arrives, and what the server sends
    /// this long after it arrived: replies come late, commands do not.
    DelayServerToClient(Duration),
    /// Keep what the client sends, in order, for as long as this mode lasts
    /// (a close included), and forward it once another mode that forwards it
    /// applies; forward what the server sends. Meant for one connection (see
    /// [`FaultProxy::set_connection_mode`]): a command held so is delivered
    /// late, when the test says.
    HoldClientToServer,
}

impl Mode {
    fn drops(self, direction: Direction) -> bool {
        match self {
            Mode::Pass
            | Mode::Delay(_)
            | Mode::DelayServerToClient(_)
            | Mode::HoldClientToServer => false,
            Mode::Blackhole => true,
            Mode::DropClientToServer => direction == Direction::ClientToServer,
            Mode::DropServerToClient => direction == Direction::ServerToClient,
        }
    }

    fn holds(self, direction: Direction) -> bool {
        self == Mode::HoldClientToServer && direction == Direction::ClientToServer
    }

    fn delay(self, direction: Direction) -> Duration {
        match self {
            Mode::Delay(delay) => delay,
            Mode::DelayServerToClient(delay) if direction == Direction::ServerToClient => delay,
            _ => Duration::ZERO,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    ClientToServer,
    ServerToClient,
}

impl Direction {
    fn label(self) -> &'static str {
        match self {
            Direction::ClientToServer => "c2s",
            Direction::ServerToClient => "s2c",
        }
    }
}

/// State shared by the proxy handle and its threads.
struct Shared {
    mode: Mutex<Mode>,
    shutdown: AtomicBool,
    /// Open connections by id; an entry goes when the connection's last
    /// thread ends.
    connections: Mutex<HashMap<u64, Entry>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Chunks read from clients, forwarded or not.
    client_chunks: std::sync::atomic::AtomicU64,
    /// Chunks read from clients that the proxy is done with: written to the
    /// server (or found it gone) once due, or discarded by the mode.
    client_chunks_done: std::sync::atomic::AtomicU64,
    /// How many more new connections are forwarded (see
    /// [`FaultProxy::admit_only`]); `None`: all of them.
    admit: Mutex<Option<usize>>,
    /// New connections held without being forwarded because none was left to
    /// admit.
    turned_away: std::sync::atomic::AtomicU64,
    /// Connections from this address are treated as in [`Mode::Blackhole`]
    /// whatever the mode (see [`FaultProxy::blackhole_from`]).
    blackholed_peer: Mutex<Option<IpAddr>>,
}

impl Shared {
    fn mode(&self) -> Mode {
        *lock(&self.mode)
    }

    /// The mode that applies to a connection from `peer`.
    fn mode_for(&self, peer: Option<IpAddr>) -> Mode {
        match (*lock(&self.blackholed_peer), peer) {
            (Some(cut), Some(peer)) if cut == peer => Mode::Blackhole,
            _ => self.mode(),
        }
    }
}

/// The proxy's own handles on one connection's sockets.
struct Entry {
    client: TcpStream,
    upstream: Option<TcpStream>,
    reset: Arc<AtomicBool>,
    /// Chunks from the server that the mode discarded.
    server_chunks_dropped: Arc<AtomicU64>,
    /// Chunks from the client still in the proxy.
    client_chunks_held: Arc<AtomicU64>,
    /// The client's address.
    peer: Option<IpAddr>,
    /// This connection's own mode, if set (see
    /// [`FaultProxy::set_connection_mode`]).
    own_mode: Arc<Mutex<Option<Mode>>>,
}

/// Held by each thread of a connection; the last one to finish unregisters it,
/// closing the proxy's remaining handles on its sockets.
struct Connection {
    id: u64,
    shared: Arc<Shared>,
    reset: Arc<AtomicBool>,
    server_chunks_dropped: Arc<AtomicU64>,
    client_chunks_held: Arc<AtomicU64>,
    /// The client's address.
    peer: Option<IpAddr>,
    own_mode: Arc<Mutex<Option<Mode>>>,
}

impl Connection {
    fn stopping(&self) -> bool {
        self.reset.load(Ordering::SeqCst) || self.shared.shutdown.load(Ordering::SeqCst)
    }

    /// The mode that applies to this connection now.
    fn mode(&self) -> Mode {
        match *lock(&self.own_mode) {
            Some(mode) => mode,
            None => self.shared.mode_for(self.peer),
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        lock(&self.shared.connections).remove(&self.id);
    }
}

/// One chunk on its way; `data: None` forwards a close (EOF).
struct Chunk {
    data: Option<Vec<u8>>,
    due: Instant,
}

/// A TCP proxy on 127.0.0.1 in front of one upstream address, whose
/// [`Mode`] can be switched while connections are open.
///
/// Dropping it stops accepting, closes every connection and joins its threads.
pub(crate) struct FaultProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on a free port of 127.0.0.1 and forwards each accepted
    /// connection to `upstream`, in [`Mode::Pass`].
    ///
    /// A connection whose upstream cannot be reached is closed at once, except
    /// in [`Mode::Blackhole`], where it is held open and read from.
    pub(crate) fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(Shared {
            mode: Mutex::new(Mode::Pass),
            shutdown: AtomicBool::new(false),
            connections: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
            client_chunks: std::sync::atomic::AtomicU64::new(0),
            client_chunks_done: std::sync::atomic::AtomicU64::new(0),
            admit: Mutex::new(None),
            turned_away: std::sync::atomic::AtomicU64::new(0),
            blackholed_peer: Mutex::new(None),
        });
        let acceptor = thread::Builder::new()
            .name(format!("proxy-{}-accept", addr.port()))
            .spawn({
                let shared = Arc::clone(&shared);
                move || accept_loop(&listener, upstream, &shared)
            })
            .expect("spawn the proxy's accept thread");
        FaultProxy {
            addr,
            upstream,
            shared,
            acceptor: Some(acceptor),
        }
    }

    /// The address clients connect to.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port clients connect to.
    pub(crate) fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The address the proxy forwards to.
    pub(crate) fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// `redis://127.0.0.1:PORT` for the proxy's port.
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port())
    }

    /// The current mode.
    pub(crate) fn mode(&self) -> Mode {
        self.shared.mode()
    }

    /// Switches the mode for existing and new connections. Chunks already
    /// waiting out a delay leave at their original time unless the new mode
    /// drops their direction, in which case they are discarded.
    pub(crate) fn set_mode(&self, mode: Mode) {
        *lock(&self.shared.mode) = mode;
    }

    /// Aborts every open connection: both of its sockets are closed with
    /// `SO_LINGER` 0, so both peers get a reset. Returns at once; the sockets
    /// close within about 50 ms (see [`FaultProxy::connection_count`]).
    /// New connections are accepted as before.
    pub(crate) fn reset_all(&self) {
        for entry in lock(&self.shared.connections).values() {
            entry.reset.store(true, Ordering::SeqCst);
            for stream in std::iter::once(&entry.client).chain(entry.upstream.as_ref()) {
                let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
                // Wakes the blocked readers without sending a FIN; the reset
                // goes out when the last handle on the socket is closed.
                let _ = stream.shutdown(Shutdown::Read);
            }
        }
    }

    /// From now on forwards only the next `n` new connections, whatever the
    /// mode; later ones are accepted and held open without a byte forwarded
    /// (as in [`Mode::Blackhole`]), so a client's connection set-up waits
    /// out its own timeout. Connections already open are not affected.
    pub(crate) fn admit_only(&self, n: usize) {
        *lock(&self.shared.admit) = Some(n);
    }

    /// From now on treats every connection whose client connects from `peer`
    /// (its source address, such as a server's `bind-source-addr`) as in
    /// [`Mode::Blackhole`], open ones included, whatever the mode; `None`
    /// ends that. Connections from other addresses follow the mode. Defaults
    /// to `None`.
    pub(crate) fn blackhole_from(&self, peer: Option<IpAddr>) {
        *lock(&self.shared.blackholed_peer) = peer;
    }

    /// Gives the open connection the server lists at `127.0.0.1:port` (its
    /// `CLIENT LIST` address) a mode of its own, which applies to it instead
    /// of the proxy's from now on (`None`: the proxy's again). Returns false
    /// if no open connection is at that address.
    pub(crate) fn set_connection_mode(&self, port: u16, mode: Option<Mode>) -> bool {
        self.on_connection_to(port, |entry| *lock(&entry.own_mode) = mode)
            .is_some()
    }

    /// How many open connections came from `peer` (their client's address).
    pub(crate) fn connections_from(&self, peer: IpAddr) -> usize {
        lock(&self.shared.connections)
            .values()
            .filter(|entry| entry.peer == Some(peer))
            .count()
    }

    /// How many new connections were held because none was left to admit.
    pub(crate) fn turned_away(&self) -> u64 {
        self.shared.turned_away.load(Ordering::SeqCst)
    }

    /// How many proxied connections are open.
    pub(crate) fn connection_count(&self) -> usize {
        lock(&self.shared.connections).len()
    }

    /// How many thread handles the proxy keeps (to join on drop): those of
    /// threads not yet seen finished when a connection was last served.
    pub(crate) fn kept_threads(&self) -> usize {
        lock(&self.shared.threads).len()
    }

    /// How many chunks of bytes clients have sent through the proxy so far,
    /// counted as they arrive (whatever the mode then does with them): a
    /// command has reached the proxy once this grew.
    pub(crate) fn client_chunks(&self) -> u64 {
        self.shared.client_chunks.load(Ordering::SeqCst)
    }

    /// How many of [`client_chunks`](FaultProxy::client_chunks) the proxy is
    /// done with: discarded by the mode, or, once due, handed on to the
    /// server (counted just before it is written, so that a chunk the server
    /// may have answered is never still counted). While it is below
    /// `client_chunks()`, bytes a client sent are still held in the proxy
    /// (such as a command waiting out a [`Mode::Delay`]). Chunks of a
    /// connection ended by [`FaultProxy::reset_all`] or the proxy's drop
    /// before they were due are never counted.
    pub(crate) fn client_chunks_done(&self) -> u64 {
        self.shared.client_chunks_done.load(Ordering::SeqCst)
    }

    /// How many chunks of bytes the server sent on one open connection that
    /// the mode discarded (such as replies in [`Mode::DropServerToClient`]):
    /// a reply to that connection's client was lost once this grew. The
    /// connection is the one the server lists at `127.0.0.1:port` (its
    /// `CLIENT LIST` address); `None` if no open connection is.
    pub(crate) fn server_chunks_dropped_to(&self, port: u16) -> Option<u64> {
        self.on_connection_to(port, |entry| {
            entry.server_chunks_dropped.load(Ordering::SeqCst)
        })
    }

    /// How many chunks of bytes the client of one open connection sent that
    /// the proxy still holds (such as a command kept by
    /// [`Mode::HoldClientToServer`]): unlike comparing
    /// [`client_chunks_done`](FaultProxy::client_chunks_done) with
    /// [`client_chunks`](FaultProxy::client_chunks), this is not fooled by
    /// another connection's bytes on their way through. The connection is the
    /// one the server lists at `127.0.0.1:port`; `None` if no open connection
    /// is.
    pub(crate) fn client_chunks_held_from(&self, port: u16) -> Option<u64> {
        self.on_connection_to(port, |entry| {
            entry.client_chunks_held.load(Ordering::SeqCst)
        })
    }

    /// `f` of the open connection the server lists at `127.0.0.1:port`.
    fn on_connection_to<T>(&self, port: u16, f: impl FnOnce(&Entry) -> T) -> Option<T> {
        let connections = lock(&self.shared.connections);
        let entry = connections.values().find(|entry| {
            entry
                .upstream
                .as_ref()
                .and_then(|u| u.local_addr().ok())
                .is_some_and(|a| a.port() == port)
        })?;
        Some(f(entry))
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        // Wakes the accept thread, which sees the flag and returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        for entry in lock(&self.shared.connections).values() {
            let _ = entry.client.shutdown(Shutdown::Both);
            if let Some(upstream) = &entry.upstream {
                let _ = upstream.shutdown(Shutdown::Both);
            }
        }
        let threads = std::mem::take(&mut *lock(&self.shared.threads));
        for thread in threads {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.upstream)
            .field("mode", &self.mode())
            .finish_non_exhaustive()
    }
}

fn accept_loop(listener: &TcpListener, upstream: SocketAddr, shared: &Arc<Shared>) {
    let mut next_id: u64 = 0;
    loop {
        let accepted = listener.accept();
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        match accepted {
            Ok((client, peer)) => {
                let id = next_id;
                next_id += 1;
                if let Err(e) = serve(client, id, peer.ip(), upstream, shared) {
                    eprintln!("fault proxy: cannot serve connection {id}: {e}");
                }
            }
            // Such as running out of file descriptors: try again shortly.
            Err(_) => thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Connects to `upstream` and starts the connection's threads.
fn serve(
    client: TcpStream,
    id: u64,
    peer: IpAddr,
    upstream: SocketAddr,
    shared: &Arc<Shared>,
) -> io::Result<()> {
    client.set_nodelay(true)?;
    if let Some(left) = lock(&shared.admit).as_mut() {
        if *left == 0 {
            shared.turned_away.fetch_add(1, Ordering::SeqCst);
            return hold(client, id, shared);
        }
        *left -= 1;
    }
    let server = match TcpStream::connect_timeout(&upstream, UPSTREAM_CONNECT_TIMEOUT) {
        Ok(server) => server,
        Err(_) if shared.mode_for(Some(peer)) == Mode::Blackhole => {
            return hold(client, id, shared);
        }
        // Closing the client mirrors the refused connection.
        Err(_) => return Ok(()),
    };
    server.set_nodelay(true)?;
    let reset = Arc::new(AtomicBool::new(false));
    let dropped = Arc::new(AtomicU64::new(0));
    let held = Arc::new(AtomicU64::new(0));
    let own_mode = Arc::new(Mutex::new(None));
    lock(&shared.connections).insert(
        id,
        Entry {
            client: client.try_clone()?,
            upstream: Some(server.try_clone()?),
            reset: Arc::clone(&reset),
            server_chunks_dropped: Arc::clone(&dropped),
            client_chunks_held: Arc::clone(&held),
            peer: Some(peer),
            own_mode: Arc::clone(&own_mode),
        },
    );
    let connection = Arc::new(Connection {
        id,
        shared: Arc::clone(shared),
        reset,
        server_chunks_dropped: dropped,
        client_chunks_held: held,
        peer: Some(peer),
        own_mode,
    });
    let directions = [
        (Direction::ClientToServer, &client, &server),
        (Direction::ServerToClient, &server, &client),
    ];
    for (direction, from, to) in directions {
        let (sender, receiver) = mpsc::channel();
        let name = |role: &str| format!("proxy-{id}-{}-{role}", direction.label());
        let reader = {
            let (from, to) = (from.try_clone()?, to.try_clone()?);
            let connection = Arc::clone(&connection);
            thread::Builder::new()
                .name(name("read"))
                .spawn(move || read_side(direction, from, &to, &sender, &connection))?
        };
        let writer = {
            let (from, to) = (from.try_clone()?, to.try_clone()?);
            let connection = Arc::clone(&connection);
            thread::Builder::new()
                .name(name("write"))
                .spawn(move || write_side(direction, &from, to, &receiver, &connection))?
        };
        keep_threads(shared, [reader, writer]);
    }
    Ok(())
}

/// Adds a connection's threads to those joined on drop, and lets go of the
/// handles of threads that have finished: a finished thread that is never
/// joined or detached keeps its stack mapped, and a proxy that serves
/// thousands of connections would run out of mappings for new threads.
fn keep_threads(shared: &Shared, new: impl IntoIterator<Item = JoinHandle<()>>) {
    let mut threads = lock(&shared.threads);
    threads.retain(|t| !t.is_finished());
    threads.extend(new);
}

/// Holds a blackholed client whose upstream is unreachable: reads and
/// discards until the client closes or the connection is reset.
fn hold(client: TcpStream, id: u64, shared: &Arc<Shared>) -> io::Result<()> {
    let reset = Arc::new(AtomicBool::new(false));
    let dropped = Arc::new(AtomicU64::new(0));
    let held = Arc::new(AtomicU64::new(0));
    lock(&shared.connections).insert(
        id,
        Entry {
            client: client.try_clone()?,
            upstream: None,
            reset: Arc::clone(&reset),
            server_chunks_dropped: Arc::clone(&dropped),
            client_chunks_held: Arc::clone(&held),
            peer: client.peer_addr().ok().map(|a| a.ip()),
            own_mode: Arc::new(Mutex::new(None)),
        },
    );
    let connection = Connection {
        id,
        shared: Arc::clone(shared),
        reset,
        server_chunks_dropped: dropped,
        client_chunks_held: held,
        peer: None,
        own_mode: Arc::new(Mutex::new(None)),
    };
    let thread = thread::Builder::new()
        .name(format!("proxy-{id}-hold"))
        .spawn(move || {
            let _ = client.set_read_timeout(Some(POLL));
            let mut buf = vec![0; CHUNK_SIZE];
            let mut client = &client;
            while !connection.stopping() {
                match client.read(&mut buf) {
                    Ok(0) => return,
                    Ok(_) => {}
                    Err(e) if is_transient(&e) => {}
                    Err(_) => return,
                }
            }
        })?;
    keep_threads(shared, [thread]);
    Ok(())
}

/// Reads chunks from `from` and queues them with the time they may leave.
fn read_side(
    direction: Direction,
    from: TcpStream,
    to: &TcpStream,
    queue: &Sender<Chunk>,
    connection: &Connection,
) {
    let _ = from.set_read_timeout(Some(POLL));
    let mut from = &from;
    let mut buf = vec![0; CHUNK_SIZE];
    loop {
        if connection.stopping() {
            return;
        }
        let read = from.read(&mut buf);
        let mode = connection.mode();
        if direction == Direction::ClientToServer && matches!(read, Ok(n) if n > 0) {
            connection
                .shared
                .client_chunks
                .fetch_add(1, Ordering::SeqCst);
            connection.client_chunks_held.fetch_add(1, Ordering::SeqCst);
        }
        let due = Instant::now() + mode.delay(direction);
        match read {
            Ok(_) | Err(_) if connection.stopping() => return,
            // A close in a dropped direction is lost like the data.
            Ok(0) if mode.drops(direction) => return,
            Ok(0) => {
                let _ = queue.send(Chunk { data: None, due });
                return;
            }
            Ok(_) if mode.drops(direction) => chunk_dropped(direction, connection),
            Ok(n) => {
                let data = Some(buf[..n].to_vec());
                if queue.send(Chunk { data, due }).is_err() {
                    chunk_done(direction, connection);
                    return;
                }
            }
            Err(e) if is_transient(&e) => {}
            Err(_) => {
                // The sender is gone abruptly: so is the receiver's peer.
                if !mode.drops(direction) {
                    let _ = to.shutdown(Shutdown::Both);
                }
                return;
            }
        }
    }
}

/// Sends queued chunks to `to`, each once its time has come.
fn write_side(
    direction: Direction,
    from: &TcpStream,
    to: TcpStream,
    queue: &Receiver<Chunk>,
    connection: &Connection,
) {
    let _ = to.set_write_timeout(Some(POLL));
    loop {
        let chunk = match queue.recv_timeout(POLL) {
            Ok(chunk) => chunk,
            Err(RecvTimeoutError::Timeout) if connection.stopping() => return,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        loop {
            if connection.stopping() {
                return;
            }
            let now = Instant::now();
            if now >= chunk.due && !connection.mode().holds(direction) {
                break;
            }
            let wait = chunk.due.saturating_duration_since(now);
            thread::sleep(if wait.is_zero() {
                HOLD_POLL
            } else {
                wait.min(POLL)
            });
        }
        if connection.mode().drops(direction) {
            if chunk.data.is_some() {
                chunk_dropped(direction, connection);
            }
            continue;
        }
        let Some(data) = chunk.data else {
            let _ = to.shutdown(Shutdown::Write);
            return;
        };
        // Done with before it is written: once the server has it (and a
        // reply may be on its way), it no longer counts as held.
        chunk_done(direction, connection);
        let written = write_all(&to, &data, connection);
        if written.is_err() {
            // The receiver is gone: tell the sender.
            let _ = from.shutdown(Shutdown::Both);
            return;
        }
    }
}

/// Counts a chunk of data a client sent as done with (see
/// [`FaultProxy::client_chunks_done`]).
fn chunk_done(direction: Direction, connection: &Connection) {
    if direction == Direction::ClientToServer {
        connection
            .shared
            .client_chunks_done
            .fetch_add(1, Ordering::SeqCst);
        connection.client_chunks_held.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counts a chunk of data discarded by the mode: done with, if a client sent
/// it; dropped (see [`FaultProxy::server_chunks_dropped_to`]), if the server
/// did.
fn chunk_dropped(direction: Direction, connection: &Connection) {
    chunk_done(direction, connection);
    if direction == Direction::ServerToClient {
        connection
            .server_chunks_dropped
            .fetch_add(1, Ordering::SeqCst);
    }
}

/// `write_all` that gives up when the connection is reset or the proxy stops.
fn write_all(mut to: &TcpStream, mut data: &[u8], connection: &Connection) -> io::Result<()> {
    while !data.is_empty() {
        if connection.stopping() {
            return Err(io::ErrorKind::ConnectionAborted.into());
        }
        match to.write(data) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if is_transient(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
