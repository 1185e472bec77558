//! A throwaway `redis-server` for the examples, used when no URL is given.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` on a free loopback port, killed on drop.
pub(crate) struct ThrowawayServer {
    child: Child,
    port: u16,
}

impl ThrowawayServer {
    /// Starts `redis-server` (it must be on `PATH`) and waits until it accepts
    /// connections.
    pub(crate) fn start() -> Result<Self, Box<dyn std::error::Error>> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start redis-server (is it installed?): {e}"))?;
        let server = ThrowawayServer { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err("redis-server did not start within 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    /// `redis://127.0.0.1:PORT`
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for ThrowawayServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The URL in `var` if set, else a throwaway server's (kept alive by the second
/// value of the pair).
pub(crate) fn url_or_throwaway(
    var: &str,
) -> Result<(String, Option<ThrowawayServer>), Box<dyn std::error::Error>> {
    match std::env::var(var) {
        Ok(url) => Ok((url, None)),
        Err(_) => {
            let server = ThrowawayServer::start()?;
            Ok((server.url(), Some(server)))
        }
    }
}
