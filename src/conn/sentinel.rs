//! What Sentinel and `ROLE` say, read into plain values.

use std::fmt;

use super::cluster::NodeAddr;

/// A server's role, from `ROLE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// A primary, with this many connected replicas.
    Primary { replicas: u32 },
    /// A replica (`ROLE` says `slave`), with its link state.
    Replica { state: String },
    /// A sentinel.
    Sentinel,
    /// Anything else, or an error reply.
    Unknown(String),
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Primary { replicas } => write!(f, "master with {replicas} replica(s)"),
            Role::Replica { state } => write!(f, "slave, link {state}"),
            Role::Sentinel => f.write_str("sentinel"),
            Role::Unknown(what) => write!(f, "{what}"),
        }
    }
}

fn text(v: &redis::Value) -> Option<String> {
    match v {
        redis::Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        redis::Value::SimpleString(s) => Some(s.clone()),
        redis::Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Reads a `ROLE` reply.
pub(crate) fn parse_role(v: &redis::Value) -> Role {
    let redis::Value::Array(items) = v else {
        return Role::Unknown(format!("{v:?}"));
    };
    match items.first().and_then(text).as_deref() {
        Some("master") => {
            let replicas = match items.get(2) {
                Some(redis::Value::Array(r)) => u32::try_from(r.len()).unwrap_or(u32::MAX),
                _ => 0,
            };
            Role::Primary { replicas }
        }
        Some("slave" | "replica") => Role::Replica {
            state: items.get(3).and_then(text).unwrap_or_default(),
        },
        Some("sentinel") => Role::Sentinel,
        other => Role::Unknown(other.unwrap_or("no role").to_owned()),
    }
}

/// Reads `SENTINEL GET-MASTER-ADDR-BY-NAME`: `None` for a service the
/// sentinel does not know (`Nil`) or a reply of another shape.
pub(crate) fn parse_master_addr(v: &redis::Value) -> Option<NodeAddr> {
    let redis::Value::Array(items) = v else {
        return None;
    };
    let [host, port] = items.as_slice() else {
        return None;
    };
    Some(NodeAddr {
        host: text(host)?,
        port: text(port)?.parse().ok()?,
    })
}

/// Reads a `+switch-master` payload, `<service> <old ip> <old port> <new ip>
/// <new port>`: (service, old, new).
pub(crate) fn parse_switch(payload: &str) -> Option<(String, NodeAddr, NodeAddr)> {
    let words: Vec<&str> = payload.split_whitespace().collect();
    let [service, old_host, old_port, new_host, new_port] = words.as_slice() else {
        return None;
    };
    let addr = |host: &str, port: &str| {
        Some(NodeAddr {
            host: host.to_owned(),
            port: port.parse().ok()?,
        })
    };
    Some((
        (*service).to_owned(),
        addr(old_host, old_port)?,
        addr(new_host, new_port)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value::{Array, BulkString, Int, Nil};

    fn b(s: &str) -> redis::Value {
        BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn roles() {
        let primary = Array(vec![
            b("master"),
            Int(100),
            Array(vec![Array(vec![b("127.0.0.1"), b("7001"), b("100")])]),
        ]);
        assert_eq!(parse_role(&primary), Role::Primary { replicas: 1 });
        let replica = Array(vec![
            b("slave"),
            b("127.0.0.1"),
            Int(7000),
            b("connected"),
            Int(100),
        ]);
        assert_eq!(
            parse_role(&replica),
            Role::Replica {
                state: "connected".into()
            }
        );
        assert_eq!(
            parse_role(&Array(vec![b("sentinel"), Array(vec![])])),
            Role::Sentinel
        );
        assert!(matches!(parse_role(&Nil), Role::Unknown(_)));
    }

    #[test]
    fn master_addresses_and_switches() {
        assert_eq!(
            parse_master_addr(&Array(vec![b("127.0.0.1"), b("41229")])),
            Some(NodeAddr {
                host: "127.0.0.1".into(),
                port: 41229
            })
        );
        assert_eq!(parse_master_addr(&Nil), None);
        assert_eq!(parse_master_addr(&Array(vec![b("h"), b("port")])), None);
        let (service, old, new) = parse_switch("respire 127.0.0.1 41229 127.0.0.1 40165").unwrap();
        assert_eq!(service, "respire");
        assert_eq!(old.port, 41229);
        assert_eq!(new.port, 40165);
        assert_eq!(parse_switch("respire 127.0.0.1 41229"), None);
    }
}
