//! Key validation, the key prefix, TTL limits and Redis Cluster hash slots.

use std::time::Duration;

use crate::error::{Error, Result};

/// The longest lease this crate accepts: 2^40 ms, about 35 years.
///
/// Redis refuses expiries whose absolute time overflows its millisecond clock;
/// anything near that is a mistake (a unit error or `Duration::MAX`), not a lease.
pub const MAX_TTL: Duration = Duration::from_millis(1 << 40);

/// The number of hash slots in Redis Cluster.
pub(crate) const SLOTS: u16 = 16384;

/// CRC16/XMODEM, the checksum Redis Cluster uses for key slots.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The part of a key that Redis Cluster hashes: the content of the first `{…}`
/// if it is non-empty, else the whole key.
pub(crate) fn hash_tag(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{')
        && let Some(len) = key[open + 1..].iter().position(|&b| b == b'}')
        && len > 0
    {
        return &key[open + 1..open + 1 + len];
    }
    key
}

/// The Redis Cluster hash slot of a key (0..16384), honouring hash tags.
pub fn key_slot(key: &[u8]) -> u16 {
    crc16(hash_tag(key)) % SLOTS
}

/// Refuses a key prefix that would change which part of a key is hashed.
pub(crate) fn check_prefix(prefix: &str) -> Result<()> {
    if prefix.contains(['{', '}']) {
        return Err(Error::InvalidArgument(format!(
            "key prefix {prefix:?} contains a brace: it would change which part of every key \
             is hashed to a cluster slot and break the keys' own hash tags"
        )));
    }
    Ok(())
}

/// Checks a user key and returns the physical key (prefix + key).
pub(crate) fn physical(prefix: &str, key: &str, what: &str) -> Result<String> {
    if key.is_empty() {
        return Err(Error::InvalidArgument(format!("{what} is empty")));
    }
    Ok(format!("{prefix}{key}"))
}

/// Checks a multi-key primitive's base key and returns its physical form
/// (prefix + base). The base must carry a non-empty hash tag, so that every key
/// derived from it (`base:suffix`) lands in one cluster slot; a key without one
/// is refused rather than wrapped in braces behind the caller's back.
pub(crate) fn physical_base(prefix: &str, base: &str, what: &str) -> Result<String> {
    if base.is_empty() {
        return Err(Error::InvalidArgument(format!("{what} is empty")));
    }
    if hash_tag(base.as_bytes()).len() == base.len() {
        return Err(Error::InvalidArgument(format!(
            "{what} {base:?} has no hash tag: the keys made from it must share a cluster slot,              so name it with a non-empty {{tag}}, such as \"{{{base}}}\""
        )));
    }
    Ok(format!("{prefix}{base}"))
}

/// Checks that physical keys that one script touches share a cluster slot.
pub(crate) fn same_slot(first: &str, second: &str) -> Result<()> {
    let (a, b) = (key_slot(first.as_bytes()), key_slot(second.as_bytes()));
    if a != b {
        return Err(Error::CrossSlot {
            first: first.to_owned(),
            first_slot: a,
            second: second.to_owned(),
            second_slot: b,
        });
    }
    Ok(())
}

/// Validates a lease TTL and returns it in whole milliseconds, rounded up so the
/// server never holds a lease for less time than the holder was told.
pub(crate) fn ttl_ms(ttl: Duration) -> Result<u64> {
    if ttl.is_zero() {
        return Err(Error::InvalidArgument("ttl is zero".into()));
    }
    if ttl > MAX_TTL {
        return Err(Error::InvalidArgument(format!(
            "ttl {ttl:?} is longer than the maximum of {MAX_TTL:?}"
        )));
    }
    let ms = ttl.as_millis() as u64;
    Ok(if Duration::from_millis(ms) < ttl {
        ms + 1
    } else {
        ms
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis_cluster() {
        // Values from CLUSTER KEYSLOT on a real cluster.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"123456789"), 12739);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(
            key_slot(b"{user1000}.following"),
            key_slot(b"{user1000}.followers")
        );
    }

    #[test]
    fn hash_tag_rules() {
        assert_eq!(hash_tag(b"{a}b"), b"a");
        assert_eq!(hash_tag(b"x{}y"), b"x{}y");
        assert_eq!(hash_tag(b"{}{a}"), b"{}{a}");
        assert_eq!(hash_tag(b"a{b}{c}"), b"b");
        assert_eq!(hash_tag(b"a{bc"), b"a{bc");
    }

    #[test]
    fn prefix_with_brace_is_refused() {
        assert!(check_prefix("app:").is_ok());
        assert!(check_prefix("").is_ok());
        assert!(matches!(
            check_prefix("app{"),
            Err(Error::InvalidArgument(_))
        ));
        assert!(check_prefix("{app}:").is_err());
    }

    #[test]
    fn ttl_limits() {
        assert!(ttl_ms(Duration::ZERO).is_err());
        assert!(ttl_ms(Duration::MAX).is_err());
        assert!(ttl_ms(MAX_TTL + Duration::from_millis(1)).is_err());
        assert_eq!(ttl_ms(MAX_TTL).unwrap(), 1 << 40);
        assert_eq!(ttl_ms(Duration::from_micros(1)).unwrap(), 1);
        assert_eq!(ttl_ms(Duration::from_micros(1500)).unwrap(), 2);
        assert_eq!(ttl_ms(Duration::from_secs(30)).unwrap(), 30_000);
    }

    #[test]
    fn a_base_key_needs_a_non_empty_hash_tag() {
        assert_eq!(
            physical_base("app:", "{jobs}", "base").unwrap(),
            "app:{jobs}"
        );
        assert_eq!(physical_base("", "x{jobs}y", "base").unwrap(), "x{jobs}y");
        for bad in ["", "jobs", "{}jobs", "jobs{}", "{jobs", "jobs}", "}jobs{"] {
            let e = physical_base("app:", bad, "base").unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
        }
        let e = physical_base("", "jobs", "semaphore base key").unwrap_err();
        assert!(e.to_string().contains("\"{jobs}\""), "{e}");
    }

    #[test]
    fn cross_slot_is_named() {
        let err = same_slot("a:lease", "b:fence").unwrap_err();
        assert!(err.to_string().contains("different cluster slots"));
        same_slot("{r}:lease", "{r}:fence").unwrap();
    }
}
