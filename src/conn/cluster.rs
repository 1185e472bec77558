//! What Redis Cluster says about itself: redirections (`MOVED`, `ASK`,
//! `TRYAGAIN`) and the slot map (`CLUSTER SHARDS`, or `CLUSTER SLOTS` on
//! servers before 7.0), read into plain values.

use std::fmt;

use crate::error::{Error, Result};

/// One server's address as the cluster reports it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct NodeAddr {
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl NodeAddr {
    /// Reads `host:port` (`[v6]:port` too); an empty host (`:port`, a node
    /// that does not know its own address) is `default_host`.
    pub(crate) fn parse(text: &str, default_host: &str) -> Option<NodeAddr> {
        let (host, port) = text.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let host = if host.is_empty() || host == "?" {
            default_host
        } else {
            host
        };
        Some(NodeAddr {
            host: host.to_owned(),
            port: port.parse().ok()?,
        })
    }
}

impl fmt::Display for NodeAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// A cluster redirection: the command was not run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Redirect {
    /// The slot belongs to another node for good.
    Moved { slot: u16, addr: NodeAddr },
    /// The key is being migrated: ask that node, once, with `ASKING`.
    Ask { addr: NodeAddr },
    /// A multi-key command while the slot's keys are split between two nodes.
    TryAgain,
}

/// The redirection an error reply carries, if any (`default_host`: the host of
/// the node that replied, for a redirection without one).
pub(crate) fn redirect_of(
    code: &str,
    detail: Option<&str>,
    default_host: &str,
) -> Option<Redirect> {
    let target = || {
        let mut words = detail?.split_whitespace();
        let slot: u16 = words.next()?.parse().ok()?;
        Some((slot, NodeAddr::parse(words.next()?, default_host)?))
    };
    match code {
        "MOVED" => target().map(|(slot, addr)| Redirect::Moved { slot, addr }),
        "ASK" => target().map(|(_, addr)| Redirect::Ask { addr }),
        "TRYAGAIN" => Some(Redirect::TryAgain),
        _ => None,
    }
}

/// The redirection a command's error carries, if any.
pub(crate) fn redirect(err: &Error, default_host: &str) -> Option<Redirect> {
    match err {
        Error::Server { source, .. } => redirect_of(source.code()?, source.detail(), default_host),
        _ => None,
    }
}

/// One shard: its slot ranges (inclusive), its primary and how many healthy
/// replicas it has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Shard {
    pub(crate) slots: Vec<(u16, u16)>,
    pub(crate) primary: NodeAddr,
    pub(crate) replicas: u32,
}

fn text(v: &redis::Value) -> Option<String> {
    match v {
        redis::Value::Int(n) => Some(n.to_string()),
        v => crate::reply::text(v).map(str::to_owned),
    }
}

fn int(v: &redis::Value) -> Option<i64> {
    match v {
        redis::Value::Int(n) => Some(*n),
        // Some 7.2 builds send slot numbers as strings (redis/redis#12561).
        other => text(other)?.parse().ok(),
    }
}

/// The key/value pairs of a flat RESP2 array or a RESP3 map.
fn pairs(v: &redis::Value) -> Option<Vec<(String, &redis::Value)>> {
    match v {
        redis::Value::Array(items) => Some(
            items
                .chunks_exact(2)
                .filter_map(|kv| Some((text(&kv[0])?, &kv[1])))
                .collect(),
        ),
        redis::Value::Map(items) => Some(
            items
                .iter()
                .filter_map(|(k, v)| Some((text(k)?, v)))
                .collect(),
        ),
        _ => None,
    }
}

fn items(v: &redis::Value) -> Option<&[redis::Value]> {
    match v {
        redis::Value::Array(items) | redis::Value::Set(items) => Some(items),
        _ => None,
    }
}

fn bad(op: &'static str, what: impl fmt::Display) -> Error {
    Error::UnexpectedReply {
        op,
        reply: what.to_string(),
    }
}

/// Reads a `CLUSTER SHARDS` reply. `tls`: use the nodes' `tls-port`;
/// `default_host`: the host of the node that answered, for nodes that do not
/// know their own address. Shards without slots (or without a primary that is
/// not failed) are left out.
pub(crate) fn parse_shards(v: &redis::Value, tls: bool, default_host: &str) -> Result<Vec<Shard>> {
    const OP: &str = "CLUSTER SHARDS";
    let shards = items(v).ok_or_else(|| bad(OP, format!("{v:?}")))?;
    let mut out = Vec::new();
    for shard in shards {
        let fields = pairs(shard).ok_or_else(|| bad(OP, format!("shard {shard:?}")))?;
        let get = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| *v);
        let slot_list: Vec<i64> = match get("slots") {
            Some(list) => items(list)
                .ok_or_else(|| bad(OP, "slots is not a list"))?
                .iter()
                .map(|s| int(s).ok_or_else(|| bad(OP, format!("slot {s:?}"))))
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        if !slot_list.len().is_multiple_of(2) {
            return Err(bad(OP, "an odd number of slot bounds"));
        }
        let slots = slot_list
            .chunks_exact(2)
            .map(|r| match (u16::try_from(r[0]), u16::try_from(r[1])) {
                (Ok(a), Ok(b)) if a <= b && b < crate::keys::SLOTS => Ok((a, b)),
                _ => Err(bad(OP, format!("slot range {}-{}", r[0], r[1]))),
            })
            .collect::<Result<Vec<_>>>()?;
        if slots.is_empty() {
            continue;
        }
        let mut primary = None;
        let mut replicas = 0;
        for node in get("nodes").and_then(items).unwrap_or_default() {
            let fields = pairs(node).ok_or_else(|| bad(OP, format!("node {node:?}")))?;
            let get = |name: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == name)
                    .and_then(|(_, v)| text(v))
            };
            let health = get("health").unwrap_or_default();
            let role = get("role").unwrap_or_default();
            if health == "failed" {
                continue;
            }
            if role == "master" {
                let host = get("endpoint")
                    .filter(|e| !e.is_empty() && e != "?")
                    .or_else(|| get("ip"))
                    .unwrap_or_default();
                let port = if tls { get("tls-port") } else { get("port") }
                    .or_else(|| get("port"))
                    .and_then(|p| p.parse().ok());
                let host = if host.is_empty() {
                    default_host.to_owned()
                } else {
                    host
                };
                if let Some(port) = port {
                    primary = Some(NodeAddr { host, port });
                }
            } else if health == "online" {
                replicas += 1;
            }
        }
        if let Some(primary) = primary {
            out.push(Shard {
                slots,
                primary,
                replicas,
            });
        }
    }
    Ok(out)
}

/// Reads a `CLUSTER SLOTS` reply (servers before 7.0). Replicas that have not
/// reported a replication offset yet are not listed by the server.
pub(crate) fn parse_slots(v: &redis::Value, default_host: &str) -> Result<Vec<Shard>> {
    const OP: &str = "CLUSTER SLOTS";
    let ranges = items(v).ok_or_else(|| bad(OP, format!("{v:?}")))?;
    let mut out: Vec<Shard> = Vec::new();
    for range in ranges {
        let r = items(range).ok_or_else(|| bad(OP, format!("range {range:?}")))?;
        let (Some(start), Some(end), Some(primary)) = (
            r.first().and_then(int),
            r.get(1).and_then(int),
            r.get(2).and_then(items),
        ) else {
            return Err(bad(OP, format!("range {range:?}")));
        };
        let (Ok(start), Ok(end)) = (u16::try_from(start), u16::try_from(end)) else {
            return Err(bad(OP, format!("slot range {start}-{end}")));
        };
        if start > end || end >= crate::keys::SLOTS {
            return Err(bad(OP, format!("slot range {start}-{end}")));
        }
        let host = primary.first().and_then(text).unwrap_or_default();
        let host = if host.is_empty() || host == "?" {
            default_host.to_owned()
        } else {
            host
        };
        let port = primary
            .get(1)
            .and_then(int)
            .and_then(|p| u16::try_from(p).ok())
            .ok_or_else(|| bad(OP, format!("node {primary:?}")))?;
        let addr = NodeAddr { host, port };
        let replicas = u32::try_from(r.len().saturating_sub(3)).unwrap_or(u32::MAX);
        match out.iter_mut().find(|s| s.primary == addr) {
            Some(shard) => shard.slots.push((start, end)),
            None => out.push(Shard {
                slots: vec![(start, end)],
                primary: addr,
                replicas,
            }),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value::{Array, BulkString, Int, Map};

    fn b(s: &str) -> redis::Value {
        BulkString(s.as_bytes().to_vec())
    }

    fn node(id: &str, port: i64, role: &str, health: &str) -> redis::Value {
        Array(vec![
            b("id"),
            b(id),
            b("port"),
            Int(port),
            b("ip"),
            b("127.0.0.1"),
            b("endpoint"),
            b("127.0.0.1"),
            b("role"),
            b(role),
            b("replication-offset"),
            Int(0),
            b("health"),
            b(health),
        ])
    }

    #[test]
    fn redirections_are_read() {
        assert_eq!(
            redirect_of("MOVED", Some("3175 127.0.0.1:33171"), "h"),
            Some(Redirect::Moved {
                slot: 3175,
                addr: NodeAddr {
                    host: "127.0.0.1".into(),
                    port: 33171
                }
            })
        );
        assert_eq!(
            redirect_of("ASK", Some("3175 :7001"), "10.0.0.5"),
            Some(Redirect::Ask {
                addr: NodeAddr {
                    host: "10.0.0.5".into(),
                    port: 7001
                }
            })
        );
        assert_eq!(
            redirect_of("MOVED", Some("12 [::1]:7002"), "h").map(|r| match r {
                Redirect::Moved { addr, .. } => addr.to_string(),
                _ => String::new(),
            }),
            Some("[::1]:7002".to_owned())
        );
        assert_eq!(
            redirect_of("TRYAGAIN", Some("Multiple keys request"), "h"),
            Some(Redirect::TryAgain)
        );
        assert_eq!(redirect_of("MOVED", Some("garbage"), "h"), None);
        assert_eq!(redirect_of("ERR", Some("3175 127.0.0.1:1"), "h"), None);
    }

    #[test]
    fn shards_in_resp2_and_resp3_shapes() {
        let shard = Array(vec![
            b("slots"),
            Array(vec![Int(0), Int(5460), Int(6000), Int(6001)]),
            b("nodes"),
            Array(vec![
                node("a", 7000, "master", "online"),
                node("b", 7003, "replica", "online"),
                node("c", 7004, "replica", "loading"),
            ]),
        ]);
        let empty = Array(vec![b("slots"), Array(vec![]), b("nodes"), Array(vec![])]);
        let shards = parse_shards(&Array(vec![shard, empty]), false, "h").unwrap();
        assert_eq!(
            shards,
            vec![Shard {
                slots: vec![(0, 5460), (6000, 6001)],
                primary: NodeAddr {
                    host: "127.0.0.1".into(),
                    port: 7000
                },
                replicas: 1,
            }]
        );
        // RESP3 maps and string slot numbers (some 7.2 builds).
        let resp3 = Array(vec![Map(vec![
            (b("slots"), Array(vec![b("10"), b("20")])),
            (
                b("nodes"),
                Array(vec![Map(vec![
                    (b("port"), Int(7001)),
                    (b("tls-port"), Int(8001)),
                    (b("ip"), b("10.0.0.1")),
                    (b("endpoint"), b("")),
                    (b("role"), b("master")),
                    (b("health"), b("online")),
                ])]),
            ),
        ])]);
        let shards = parse_shards(&resp3, true, "h").unwrap();
        assert_eq!(shards[0].slots, vec![(10, 20)]);
        assert_eq!(shards[0].primary.to_string(), "10.0.0.1:8001");
        assert!(parse_shards(&Int(1), false, "h").is_err());
        let odd = Array(vec![Array(vec![b("slots"), Array(vec![Int(1)])])]);
        assert!(parse_shards(&odd, false, "h").is_err());
        let out_of_range = Array(vec![Array(vec![
            b("slots"),
            Array(vec![Int(1), Int(16384)]),
        ])]);
        assert!(parse_shards(&out_of_range, false, "h").is_err());
    }

    #[test]
    fn a_failed_primary_is_not_routed_to() {
        // Whichever of the two the server lists first.
        for nodes in [
            vec![
                node("a", 7000, "master", "failed"),
                node("b", 7003, "master", "online"),
            ],
            vec![
                node("b", 7003, "master", "online"),
                node("a", 7000, "master", "failed"),
            ],
        ] {
            let shard = Array(vec![
                b("slots"),
                Array(vec![Int(0), Int(100)]),
                b("nodes"),
                Array(nodes),
            ]);
            let shards = parse_shards(&Array(vec![shard]), false, "h").unwrap();
            assert_eq!(shards[0].primary.port, 7003);
        }
    }

    #[test]
    fn slots_reply_groups_ranges_by_primary() {
        let range = |s, e, port| {
            Array(vec![
                Int(s),
                Int(e),
                Array(vec![b("127.0.0.1"), Int(port), b("id")]),
                Array(vec![b("127.0.0.1"), Int(port + 3), b("rid")]),
            ])
        };
        let v = Array(vec![
            range(0, 10, 7000),
            range(11, 20, 7001),
            range(21, 30, 7000),
        ]);
        let shards = parse_slots(&v, "h").unwrap();
        assert_eq!(shards.len(), 2);
        assert_eq!(shards[0].slots, vec![(0, 10), (21, 30)]);
        assert_eq!(shards[0].replicas, 1);
        assert!(parse_slots(&Array(vec![Array(vec![Int(5), Int(1)])]), "h").is_err());
    }
}
