//! `redis-server` processes on free local ports, one throwaway directory each
//! (`valkey-server` with `RESPIRE_TEST_SERVER=valkey`: see [`ServerKind`]).

use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{self, Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use super::kind::ServerKind;
use super::tls::TlsFiles;

/// How long a server may take to start answering.
const READY_DEADLINE: Duration = Duration::from_secs(10);
/// How many fresh ports `start` tries when another process takes the one it picked.
const PORT_ATTEMPTS: usize = 20;
/// How long `restart` retries when its port is briefly taken.
const RESTART_DEADLINE: Duration = Duration::from_secs(10);
/// Connect and setup timeout of the connections `client` opens.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Read and write timeout of the connections `client` opens, so a broken test
/// fails instead of hanging.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// Log lines printed when a test panics while it owns a server.
const LOG_TAIL_LINES: usize = 60;
/// What redis-server logs once it has loaded its data and listens.
const READY_LINE: &str = "Ready to accept connections";
/// What redis-server logs in Sentinel mode once it listens (it never logs
/// [`READY_LINE`]).
const SENTINEL_READY_LINE: &str = "Sentinel ID is";
/// How far above the client port a cluster node's bus port is. The usual
/// +10000 lands in the ephemeral port range, where other sockets take it.
const CLUSTER_BUS_OFFSET: u16 = 100;
const LOG_FILE: &str = "redis.log";
const STDERR_FILE: &str = "stderr.log";
const ACL_FILE: &str = "users.acl";
const CLUSTER_CONFIG_FILE: &str = "nodes.conf";
const SENTINEL_CONFIG_FILE: &str = "sentinel.conf";

/// Whether a TLS server asks clients for a certificate (`tls-auth-clients`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TlsAuthClients {
    /// Clients are not asked for a certificate.
    No,
    /// A client may present a certificate; if it does, it must be valid.
    Optional,
    /// Every client must present a certificate signed by the test CA.
    Yes,
}

impl TlsAuthClients {
    fn as_config(self) -> &'static str {
        match self {
            TlsAuthClients::No => "no",
            TlsAuthClients::Optional => "optional",
            TlsAuthClients::Yes => "yes",
        }
    }
}

/// Options for a [`TestServer`]; start with [`TestServer::builder`].
#[derive(Debug, Clone, Default)]
#[must_use = "a builder does nothing until `start` is called"]
pub(crate) struct TestServerBuilder {
    append_only: bool,
    tls: Option<TlsAuthClients>,
    acl_users: Vec<String>,
    requirepass: Option<String>,
    extra_args: Vec<String>,
    cluster_node_timeout: Option<Duration>,
    sentinel_config: Option<String>,
    env: Vec<(String, String)>,
    kind: Option<ServerKind>,
}

impl TestServerBuilder {
    /// Runs this server program whatever [`ServerKind::current`] says (a
    /// test of one kind's behaviour). Defaults to [`ServerKind::current`].
    pub(crate) fn kind(mut self, kind: ServerKind) -> Self {
        self.kind = Some(kind);
        self
    }

    /// Sets an environment variable for the server process (and its
    /// restarts), such as `LD_PRELOAD` of libfaketime. Defaults to none.
    pub(crate) fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Turns on the append-only file with `appendfsync always`, so every
    /// acknowledged write survives [`TestServer::kill`] and
    /// [`TestServer::restart`]. Defaults to off (`--appendonly no`).
    pub(crate) fn append_only(mut self) -> Self {
        self.append_only = true;
        self
    }

    /// Serves TLS only on the server's port, with certificates generated in the
    /// server's directory (see [`TestServer::tls`]). Defaults to plain TCP.
    pub(crate) fn tls(mut self, auth_clients: TlsAuthClients) -> Self {
        self.tls = Some(auth_clients);
        self
    }

    /// Adds an ACL user from a raw rule such as
    /// `"user app on >pw ~* &* +@all -client|kill"` (the leading `user` may be
    /// left out). The rules go into an ACL file. Defaults to no extra users.
    pub(crate) fn acl_user(mut self, rule: impl Into<String>) -> Self {
        self.acl_users.push(rule.into());
        self
    }

    /// Requires this password for the default user; [`TestServer::url`] and
    /// [`TestServer::client`] then include it. Defaults to no password.
    pub(crate) fn requirepass(mut self, password: impl Into<String>) -> Self {
        self.requirepass = Some(password.into());
        self
    }

    /// Appends one raw command line argument (such as `"--hz"`), after the
    /// harness's own so it can override them. Defaults to none.
    pub(crate) fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra_args.push(arg.into());
        self
    }

    /// Appends raw command line arguments (such as `["--hz", "100"]`), after
    /// the harness's own so they can override them. Defaults to none.
    pub(crate) fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extra_args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Runs the server as a Redis Cluster node (`--cluster-enabled yes`) with
    /// this `cluster-node-timeout`. Its cluster bus listens on
    /// [`TestServer::port`] + 100 (see [`TestServer::cluster_bus_port`]),
    /// which `start` checks is free too; the node keeps its cluster state in
    /// `nodes.conf` in its directory, so [`TestServer::restart`] brings back
    /// the same node. The node starts alone; [`super::TestCluster`] joins
    /// nodes into a cluster. Defaults to a standalone server.
    pub(crate) fn cluster_node(mut self, node_timeout: Duration) -> Self {
        self.cluster_node_timeout = Some(node_timeout);
        self
    }

    /// Runs the process as a Redis Sentinel (`redis-server sentinel.conf
    /// --sentinel`) with `config` as its configuration file, written to
    /// `sentinel.conf` in its directory. Sentinel rewrites that file as it
    /// learns the deployment, so [`TestServer::restart`] brings back what it
    /// knew. Defaults to a plain server.
    pub(crate) fn sentinel(mut self, config: impl Into<String>) -> Self {
        self.sentinel_config = Some(config.into());
        self
    }

    /// Starts the server and waits until it is ready.
    ///
    /// # Panics
    ///
    /// Panics, with the server log, if the server program cannot be started or
    /// is not ready within 10 seconds.
    pub(crate) fn start(self) -> TestServer {
        TestServer::launch_new(self)
    }

    /// The full `redis-server` command line for `port`.
    fn command_line(&self, port: u16, dir: &Path, tls: Option<&TlsFiles>) -> Vec<String> {
        let path = |p: &Path| p.display().to_string();
        let mut args: Vec<String> = Vec::new();
        if self.sentinel_config.is_some() {
            args.push(path(&dir.join(SENTINEL_CONFIG_FILE)));
            args.push("--sentinel".to_owned());
        }
        let mut push = |name: &str, value: &str| {
            args.push(format!("--{name}"));
            args.push(value.to_owned());
        };
        match (tls, self.tls) {
            (Some(files), Some(auth)) => {
                push("port", "0");
                push("tls-port", &port.to_string());
                push("tls-cert-file", &path(&files.server_cert));
                push("tls-key-file", &path(&files.server_key));
                push("tls-ca-cert-file", &path(&files.ca_cert));
                push("tls-auth-clients", auth.as_config());
            }
            _ => push("port", &port.to_string()),
        }
        push("bind", "127.0.0.1");
        push("save", "");
        if self.append_only {
            push("appendonly", "yes");
            push("appendfsync", "always");
        } else {
            push("appendonly", "no");
        }
        push("enable-debug-command", "yes");
        push("dir", &path(dir));
        push("logfile", &path(&dir.join(LOG_FILE)));
        push("daemonize", "no");
        if let Some(node_timeout) = self.cluster_node_timeout {
            push("cluster-enabled", "yes");
            push("cluster-port", &(port + CLUSTER_BUS_OFFSET).to_string());
            push("cluster-config-file", &path(&dir.join(CLUSTER_CONFIG_FILE)));
            push(
                "cluster-node-timeout",
                &node_timeout.as_millis().to_string(),
            );
        }
        if self.acl_users.is_empty() {
            if let Some(password) = &self.requirepass {
                push("requirepass", password);
            }
        } else {
            // With an ACL file redis ignores `requirepass`; the file sets the
            // default user's password instead.
            push("aclfile", &path(&dir.join(ACL_FILE)));
        }
        args.extend(self.extra_args.iter().cloned());
        args
    }

    /// The line the server logs once it is ready.
    fn ready_line(&self) -> &'static str {
        if self.sentinel_config.is_some() {
            SENTINEL_READY_LINE
        } else {
            READY_LINE
        }
    }

    /// A port that was free a moment ago and, for a cluster node, whose bus
    /// port was free as well.
    fn pick_port(&self) -> u16 {
        if self.cluster_node_timeout.is_none() {
            return free_port();
        }
        for _ in 0..PORT_ATTEMPTS * 5 {
            let port = free_port();
            let Some(bus) = port.checked_add(CLUSTER_BUS_OFFSET) else {
                continue;
            };
            if TcpListener::bind((Ipv4Addr::LOCALHOST, bus)).is_ok() {
                return port;
            }
        }
        panic!("no free port whose cluster bus port (+{CLUSTER_BUS_OFFSET}) is free too");
    }

    /// The ACL file's contents, one `user` rule a line.
    fn acl_file(&self) -> String {
        let mut file = String::new();
        let mut has_default = false;
        for rule in &self.acl_users {
            let rule = rule.trim();
            let rule = rule.strip_prefix("user ").unwrap_or(rule).trim_start();
            has_default |= rule.split_whitespace().next() == Some("default");
            let _ = writeln!(file, "user {rule}");
        }
        if !has_default {
            let password = match &self.requirepass {
                Some(password) => format!(">{password}"),
                None => "nopass".to_owned(),
            };
            let _ = writeln!(file, "user default on {password} ~* &* +@all");
        }
        file
    }
}

/// A `redis-server` process on a free port of 127.0.0.1, in a fresh directory.
///
/// Dropping it kills the process and removes the directory; if the test is
/// panicking, the end of the server log is printed first. The server runs
/// under a small `sh` supervisor that kills it, reaps it and removes the
/// directory as soon as the test process exits, even without a drop (as with
/// [`super::shared_server`]).
pub(crate) struct TestServer {
    port: u16,
    cluster_bus_port: Option<u16>,
    dir: PathBuf,
    command_line: Vec<String>,
    /// Environment variables of the server process.
    env: Vec<(String, String)>,
    /// The server program it runs.
    kind: ServerKind,
    ready_line: &'static str,
    tls: Option<TlsFiles>,
    requirepass: Option<String>,
    process: Mutex<Process>,
}

/// The running (or last) server process and the shell that supervises it.
struct Process {
    /// `sh` running [`SUPERVISOR`]: it started the server in the background
    /// and reaps it, so the server never outlives this test process.
    supervisor: Child,
    /// The server's pid; its parent is `supervisor`, so the pid cannot be
    /// reused before `supervisor` has exited.
    pid: u32,
    stopped: bool,
    paused: bool,
}

impl Process {
    /// SIGKILLs the server and waits until it is reaped.
    fn stop(&mut self) {
        if self.stopped {
            return;
        }
        if let Some(stdin) = self.supervisor.stdin.as_mut() {
            let _ = stdin.write_all(b"stop\n");
        }
        let _ = self.supervisor.wait();
        self.stopped = true;
        self.paused = false;
    }

    /// Whether the server process is alive (neither reaped nor a zombie).
    fn is_running(&self) -> bool {
        !self.stopped
            && matches!(process_state(self.pid), Some(state) if state != 'Z' && state != 'X')
    }
}

/// Why a launch failed.
enum LaunchError {
    /// Another process listens on the port.
    PortTaken(String),
    /// Anything else, with the details.
    Failed(String),
}

impl TestServer {
    /// Starts a plain server with default options; see [`TestServer::builder`].
    ///
    /// # Panics
    ///
    /// Panics, with the server log, if the server does not become ready.
    pub(crate) fn start() -> TestServer {
        TestServer::builder().start()
    }

    /// Options for a server with an append-only file, TLS, ACL users, a
    /// password or extra configuration.
    pub(crate) fn builder() -> TestServerBuilder {
        TestServerBuilder::default()
    }

    fn launch_new(builder: TestServerBuilder) -> TestServer {
        let dir = fresh_dir();
        let tls = builder.tls.map(|_| TlsFiles::generate(&dir));
        if !builder.acl_users.is_empty() {
            let acl = dir.join(ACL_FILE);
            fs::write(&acl, builder.acl_file())
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", acl.display()));
        }
        let ready_line = builder.ready_line();
        let mut last_error = String::new();
        for _ in 0..PORT_ATTEMPTS {
            let port = builder.pick_port();
            if let Some(config) = &builder.sentinel_config {
                // Written afresh for each port: a failed launch may have rewritten it.
                let file = dir.join(SENTINEL_CONFIG_FILE);
                fs::write(&file, config)
                    .unwrap_or_else(|e| panic!("cannot write {}: {e}", file.display()));
            }
            // A node that failed to launch may have saved its state for another port.
            let _ = fs::remove_file(dir.join(CLUSTER_CONFIG_FILE));
            let command_line = builder.command_line(port, &dir, tls.as_ref());
            match launch(
                &command_line,
                &builder.env,
                builder.kind.unwrap_or_else(ServerKind::current),
                &dir,
                port,
                tls.is_some(),
                ready_line,
            ) {
                Ok(process) => {
                    return TestServer {
                        port,
                        cluster_bus_port: builder
                            .cluster_node_timeout
                            .map(|_| port + CLUSTER_BUS_OFFSET),
                        dir,
                        command_line,
                        env: builder.env.clone(),
                        kind: builder.kind.unwrap_or_else(ServerKind::current),
                        ready_line,
                        tls,
                        requirepass: builder.requirepass,
                        process: Mutex::new(process),
                    };
                }
                Err(LaunchError::PortTaken(details)) => last_error = details,
                Err(LaunchError::Failed(details)) => {
                    let _ = fs::remove_dir_all(&dir);
                    panic!("{details}");
                }
            }
        }
        let _ = fs::remove_dir_all(&dir);
        panic!("no free port after {PORT_ATTEMPTS} attempts; last failure:\n{last_error}");
    }

    /// The TCP port the server listens on (TLS only for a TLS server).
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// The cluster bus port of a [`TestServerBuilder::cluster_node`], `None`
    /// for any other server.
    pub(crate) fn cluster_bus_port(&self) -> Option<u16> {
        self.cluster_bus_port
    }

    /// `127.0.0.1:port`.
    pub(crate) fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// `redis://127.0.0.1:PORT`, or `rediss://` for a TLS server, with the
    /// default user's password if one is required.
    pub(crate) fn url(&self) -> String {
        let auth = match &self.requirepass {
            Some(password) => format!(":{}@", percent_encode(password)),
            None => String::new(),
        };
        format!("{}://{auth}127.0.0.1:{}", self.scheme(), self.port)
    }

    /// Like [`TestServer::url`] but logging in as an ACL user.
    pub(crate) fn url_for_user(&self, user: &str, password: &str) -> String {
        format!(
            "{}://{}:{}@127.0.0.1:{}",
            self.scheme(),
            percent_encode(user),
            percent_encode(password),
            self.port
        )
    }

    fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        }
    }

    /// The generated CA, server and client certificates of a TLS server.
    pub(crate) fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// The pid of the current (or, after [`TestServer::kill`], the last) process.
    pub(crate) fn pid(&self) -> u32 {
        self.lock().pid
    }

    /// The server's directory: log, append-only file, ACL file, certificates.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// A `redis::Client` for [`TestServer::url`], with the test CA and client
    /// certificate for a TLS server.
    ///
    /// # Panics
    ///
    /// Panics for a TLS server unless the crate feature `tls` is on.
    pub(crate) fn redis_client(&self) -> redis::Client {
        self.redis_client_for(&self.url())
    }

    /// A `redis::Client` for `url` (such as [`TestServer::url_for_user`]),
    /// with the test certificates for a TLS server.
    ///
    /// # Panics
    ///
    /// Panics for a TLS server unless the crate feature `tls` is on.
    pub(crate) fn redis_client_for(&self, url: &str) -> redis::Client {
        let client = match &self.tls {
            None => redis::Client::open(url),
            Some(files) => tls_client(url, files),
        };
        client.unwrap_or_else(|e| panic!("bad url {url}: {e}"))
    }

    /// A new connection as the default user, for setting up and checking state.
    /// It has 10 second read and write timeouts so a broken test fails rather
    /// than hangs.
    ///
    /// # Panics
    ///
    /// Panics, with the server log, if connecting takes longer than 5 seconds
    /// or fails.
    pub(crate) fn client(&self) -> redis::Connection {
        // A connection the server closes as it is made is tried again: Sentinel
        // closes every normal client of a server it promotes or turns into a
        // replica (`CLIENT KILL TYPE normal`), which can catch one mid-setup.
        let deadline = Instant::now() + CONNECT_TIMEOUT;
        let connection = loop {
            match self
                .redis_client()
                .get_connection_with_timeout(CONNECT_TIMEOUT)
            {
                Ok(connection) => break connection,
                Err(e)
                    if e.is_connection_dropped()
                        && !e.is_connection_refusal()
                        && Instant::now() < deadline =>
                {
                    thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!(
                    "cannot connect to the test server on port {}: {e}\n{}",
                    self.port,
                    self.log_tail()
                ),
            }
        };
        connection
            .set_read_timeout(Some(COMMAND_TIMEOUT))
            .and_then(|()| connection.set_write_timeout(Some(COMMAND_TIMEOUT)))
            .expect("set timeouts");
        connection
    }

    /// How many times the server ran `command` (lowercase, `INFO
    /// commandstats`) since it started or `CONFIG RESETSTAT`.
    pub(crate) fn command_calls(&self, command: &str) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.client())
            .expect("INFO commandstats");
        let prefix = format!("cmdstat_{command}:");
        info.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|rest| rest.split(',').find_map(|f| f.strip_prefix("calls=")))
            .map_or(0, |n| n.parse().expect("a count of calls"))
    }

    /// Stops the server with SIGSTOP and returns once it is stopped. It still
    /// accepts TCP connections (the kernel completes the handshake) but
    /// answers nothing until [`TestServer::resume`].
    pub(crate) fn pause(&self) {
        let mut process = self.lock();
        let pid = process.pid;
        signal(pid, "STOP");
        process.paused = true;
        super::wait_until(Duration::from_secs(5), "the server to stop", || {
            process_state(pid) == Some('T')
        });
    }

    /// Continues a server stopped by [`TestServer::pause`] with SIGCONT.
    pub(crate) fn resume(&self) {
        let mut process = self.lock();
        let pid = process.pid;
        signal(pid, "CONT");
        process.paused = false;
        super::wait_until(Duration::from_secs(5), "the server to continue", || {
            process_state(pid) != Some('T')
        });
    }

    /// Kills the server with SIGKILL and waits for it to exit. Nothing is
    /// flushed: only what the append-only file already holds survives.
    pub(crate) fn kill(&self) {
        self.lock().stop();
    }

    /// Starts the server again with the same directory, port and
    /// configuration, killing it first if it runs, and waits until it is ready.
    /// With [`TestServerBuilder::append_only`] the data is loaded back from the
    /// append-only file.
    ///
    /// # Panics
    ///
    /// Panics, with the server log, if the server does not become ready.
    pub(crate) fn restart(&self) {
        let mut process = self.lock();
        process.stop();
        let started = Instant::now();
        loop {
            match launch(
                &self.command_line,
                &self.env,
                self.kind,
                &self.dir,
                self.port,
                self.tls.is_some(),
                self.ready_line,
            ) {
                Ok(new) => {
                    *process = new;
                    return;
                }
                Err(LaunchError::PortTaken(_)) if started.elapsed() < RESTART_DEADLINE => {
                    thread::sleep(Duration::from_millis(100));
                }
                Err(LaunchError::PortTaken(details) | LaunchError::Failed(details)) => {
                    panic!("restart on port {} failed:\n{details}", self.port)
                }
            }
        }
    }

    /// Whether the server process is alive (a paused server is alive).
    pub(crate) fn is_running(&self) -> bool {
        self.lock().is_running()
    }

    /// Whether the server is stopped by [`TestServer::pause`].
    pub(crate) fn is_paused(&self) -> bool {
        self.lock().paused
    }

    /// The whole server log, across restarts.
    pub(crate) fn log(&self) -> String {
        read_lossy(&self.dir.join(LOG_FILE))
    }

    /// The last lines of the log and anything written to stderr, for messages.
    fn log_tail(&self) -> String {
        describe_logs(&self.dir, 0, self.port)
    }

    fn lock(&self) -> MutexGuard<'_, Process> {
        self.process.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let process = self.process.get_mut().unwrap_or_else(|e| e.into_inner());
        if process.paused && !process.stopped {
            let _ = try_signal(process.pid, "CONT");
        }
        process.stop();
        if thread::panicking() {
            eprintln!("{}", describe_logs(&self.dir, 0, self.port));
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl std::fmt::Debug for TestServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestServer")
            .field("port", &self.port)
            .field("dir", &self.dir)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "tls")]
fn tls_client(url: &str, files: &TlsFiles) -> redis::RedisResult<redis::Client> {
    super::tls::install_crypto_provider();
    redis::Client::build_with_tls(url, files.redis_certificates())
}

#[cfg(not(feature = "tls"))]
fn tls_client(_url: &str, _files: &TlsFiles) -> redis::RedisResult<redis::Client> {
    panic!("a client for a TLS test server needs the crate feature `tls`")
}

/// Starts the server program in the background and prints its pid, then waits
/// for a line on stdin (sent by [`Process::stop`]) or for EOF (this test
/// process has exited): either way it SIGKILLs and reaps the server; on EOF it
/// also removes the server's directory. Arguments: the directory, the server
/// program ([`ServerKind::server_program`]), then the server's command line.
const SUPERVISOR: &str = r#"
dir=$1
program=$2
shift 2
"$program" "$@" </dev/null >/dev/null &
server=$!
echo "$server"
if read -r line; then
    kill -9 "$server" 2>/dev/null
    wait "$server"
else
    kill -9 "$server" 2>/dev/null
    wait "$server"
    rm -rf "$dir"
fi
"#;

/// Spawns the server program of `kind` (with the environment variables
/// `env`) with `command_line` and waits until it is ready.
fn launch(
    command_line: &[String],
    env: &[(String, String)],
    kind: ServerKind,
    dir: &Path,
    port: u16,
    tls: bool,
    ready_line: &str,
) -> Result<Process, LaunchError> {
    let log = dir.join(LOG_FILE);
    let log_offset = fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
    let stderr = File::create(dir.join(STDERR_FILE))
        .map_err(|e| LaunchError::Failed(format!("cannot create {STDERR_FILE}: {e}")))?;
    let mut supervisor = Command::new("sh")
        .arg("-c")
        .arg(SUPERVISOR)
        .arg("respire-test-server")
        .arg(dir)
        .arg(kind.server_program())
        .args(command_line)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .map_err(|e| LaunchError::Failed(format!("cannot run sh: {e}")))?;
    let mut pid = String::new();
    let stdout = supervisor.stdout.take().expect("piped stdout");
    let read = BufReader::new(stdout).read_line(&mut pid);
    let mut process = Process {
        supervisor,
        pid: 0,
        stopped: false,
        paused: false,
    };
    match (read, pid.trim().parse()) {
        (Ok(_), Ok(pid)) => process.pid = pid,
        (read, _) => {
            process.stop();
            return Err(LaunchError::Failed(format!(
                "the supervising shell did not report a pid ({read:?}, {pid:?})\n{}",
                describe_logs(dir, log_offset, port)
            )));
        }
    }
    let started = Instant::now();
    loop {
        if !process.is_running() {
            process.stop();
            let details = format!(
                "{} exited before it was ready\n{}",
                kind.server_program().display(),
                describe_logs(dir, log_offset, port)
            );
            let new_log = read_lossy(&log);
            let new_log = new_log.get(log_offset as usize..).unwrap_or_default();
            return Err(if new_log.contains("Address already in use") {
                LaunchError::PortTaken(details)
            } else if tls && new_log.contains("Failed finding TLS support") {
                // The Valkey build from the PyPI wheel has no TLS.
                LaunchError::Failed(format!(
                    "{} is built without TLS: a TLS test server cannot run on it\n{details}",
                    kind.server_program().display()
                ))
            } else {
                LaunchError::Failed(details)
            });
        }
        if logged_ready(&log, log_offset, ready_line) && answers(port, tls) {
            return Ok(process);
        }
        if started.elapsed() > READY_DEADLINE {
            process.stop();
            return Err(LaunchError::Failed(format!(
                "{} was not ready within {READY_DEADLINE:?}\n{}",
                kind.server_program().display(),
                describe_logs(dir, log_offset, port)
            )));
        }
        thread::sleep(Duration::from_millis(10));
    }
}

fn logged_ready(log: &Path, offset: u64, ready_line: &str) -> bool {
    let text = read_lossy(log);
    text.get(offset as usize..)
        .is_some_and(|new| new.contains(ready_line))
}

/// Whether a plain server answers `PING` with anything but `-LOADING`
/// (`-NOAUTH` means it is up). A TLS server is ready once it logs so.
fn answers(port: u16, tls: bool) -> bool {
    if tls {
        return true;
    }
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let ping = || -> io::Result<String> {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
        stream.set_read_timeout(Some(Duration::from_secs(1)))?;
        stream.write_all(b"PING\r\n")?;
        let mut line = String::new();
        BufReader::new(&stream).read_line(&mut line)?;
        Ok(line)
    };
    matches!(ping(), Ok(line) if line.starts_with('+') || (line.starts_with('-') && !line.starts_with("-LOADING")))
}

/// Log lines written since `offset` (the last [`LOG_TAIL_LINES`]) and stderr.
fn describe_logs(dir: &Path, offset: u64, port: u16) -> String {
    let log = read_lossy(&dir.join(LOG_FILE));
    let log = log.get(offset as usize..).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
    let mut text = format!(
        "--- {}-server on port {port}: last {} log lines ---\n",
        ServerKind::current().name(),
        tail.len()
    );
    for line in tail {
        text.push_str(line);
        text.push('\n');
    }
    let stderr = read_lossy(&dir.join(STDERR_FILE));
    if !stderr.trim().is_empty() {
        let _ = write!(text, "--- stderr ---\n{stderr}");
    }
    text
}

fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

/// A port that was free a moment ago; `start` retries if it is taken since.
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("bind 127.0.0.1:0")
}

/// A new empty directory under the system temporary directory.
fn fresh_dir() -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("respire-test-{}-{n}", process::id()));
        match fs::create_dir(&dir) {
            Ok(()) => return dir,
            // Left over from an earlier process with the same pid.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let _ = fs::remove_dir_all(&dir);
            }
            Err(e) => panic!("cannot create {}: {e}", dir.display()),
        }
    }
}

/// Sends a signal with the `kill` command (std has no way to send one).
///
/// # Panics
///
/// Panics if `kill` fails, such as when the process is gone.
fn signal(pid: u32, name: &str) {
    let status = try_signal(pid, name).unwrap_or_else(|e| panic!("cannot run kill: {e}"));
    assert!(status.success(), "kill -{name} {pid} failed: {status}");
}

fn try_signal(pid: u32, name: &str) -> io::Result<ExitStatus> {
    Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
}

/// The state letter from `/proc/<pid>/stat` (`T` when stopped).
fn process_state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.trim_start().chars().next()
}

/// Percent-encodes everything but unreserved URL characters.
fn percent_encode(text: &str) -> String {
    let mut encoded = String::new();
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            encoded.push(char::from(byte));
        } else {
            let _ = write!(encoded, "%{byte:02X}");
        }
    }
    encoded
}
