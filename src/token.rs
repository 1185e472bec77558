//! Owner tokens (128 bits from the operating system's random generator, with
//! the holder's identity after them when one was given) and fencing tokens.

use std::fmt;

use crate::error::{Error, Result};

/// A fencing token: strictly greater for every later grant from the same
/// counter, as long as the counter's history survives on the server.
///
/// Pass it with every write to the protected resource, and have the resource
/// atomically refuse a token lower than the highest it has accepted (equal tokens
/// are the same holder writing again).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// The token as a number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// Identifies one acquisition. Stored as the lease value, so only the holder that
/// set a key can renew or delete it. Never reused: each acquire call draws a new one.
///
/// Its value is 32 lowercase hex digits, followed, when the lease records who
/// holds it, by `@` and the [holder](HolderTag) with `%` and `:` escaped
/// (`%25`, `%3A`): it never contains a `:`, which the scripts put between an
/// owner and its token or slot, and the scripts compare it as a whole, as
/// they compare the bare digits.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct OwnerToken(String);

/// The longest holder identity a lease records, in bytes (before escaping).
pub const MAX_HOLDER_LEN: usize = 128;

/// Checks a holder identity as [`Lease::with_holder`](crate::Lease::with_holder)
/// and [`RedlockGroup::with_holder`](crate::RedlockGroup::with_holder) do,
/// without a handle: for programs that validate their input before they
/// connect.
///
/// # Errors
/// [`Error::InvalidArgument`] for an empty holder, one longer than
/// [`MAX_HOLDER_LEN`] bytes or one with a control character.
pub fn check_holder(holder: &str) -> Result<()> {
    HolderTag::new(holder).map(drop)
}

/// The length of the random part of an owner value.
const OWNER_DIGITS: usize = 32;

/// A holder identity checked and escaped for an owner value: `@` and the
/// holder with `%` and `:` escaped. Cheap to clone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HolderTag {
    /// As the user gave it.
    given: std::sync::Arc<str>,
    /// `@` and the escaped holder.
    suffix: std::sync::Arc<str>,
}

impl HolderTag {
    /// Checks `holder`: not empty, at most [`MAX_HOLDER_LEN`] bytes, no
    /// control characters.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming what is wrong.
    pub(crate) fn new(holder: &str) -> Result<HolderTag> {
        if holder.is_empty() {
            return Err(Error::InvalidArgument("holder identity is empty".into()));
        }
        if holder.len() > MAX_HOLDER_LEN {
            return Err(Error::InvalidArgument(format!(
                "holder identity is {} bytes long, more than the {MAX_HOLDER_LEN} a lease records",
                holder.len()
            )));
        }
        if let Some(c) = holder.chars().find(|c| c.is_control()) {
            return Err(Error::InvalidArgument(format!(
                "holder identity {holder:?} contains the control character {c:?}"
            )));
        }
        let mut suffix = String::with_capacity(holder.len() + 1);
        suffix.push('@');
        for c in holder.chars() {
            match c {
                '%' => suffix.push_str("%25"),
                ':' => suffix.push_str("%3A"),
                c => suffix.push(c),
            }
        }
        Ok(HolderTag {
            given: holder.into(),
            suffix: suffix.into(),
        })
    }

    /// The holder as given.
    pub(crate) fn as_str(&self) -> &str {
        &self.given
    }
}

/// An owner value read from a server, split into its owner id and the holder
/// it records (unescaped), if any. A value that is not `32 hex digits` with
/// an optional `@holder` is all owner id.
pub(crate) fn split_owner(value: &str) -> (&str, Option<String>) {
    let bytes = value.as_bytes();
    let ours = bytes.len() > OWNER_DIGITS
        && bytes[OWNER_DIGITS] == b'@'
        && bytes[..OWNER_DIGITS].iter().all(u8::is_ascii_hexdigit);
    if !ours {
        return (value, None);
    }
    let escaped = &value[OWNER_DIGITS + 1..];
    let mut holder = String::with_capacity(escaped.len());
    let mut rest = escaped;
    while let Some(i) = rest.find('%') {
        holder.push_str(&rest[..i]);
        match rest.get(i..i + 3) {
            Some("%25") => holder.push('%'),
            Some("%3A") => holder.push(':'),
            // Not an escape this crate writes: kept as it is.
            _ => {
                holder.push('%');
                rest = &rest[i + 1..];
                continue;
            }
        }
        rest = &rest[i + 3..];
    }
    holder.push_str(rest);
    (&value[..OWNER_DIGITS], Some(holder))
}

impl OwnerToken {
    /// Draws 128 fresh bits from the OS generator.
    ///
    /// # Panics
    /// If the operating system cannot provide randomness, which leaves no safe
    /// way to tell holders apart.
    pub(crate) fn new() -> Self {
        OwnerToken::held_by(None)
    }

    /// A fresh owner token recording `holder`, when given.
    ///
    /// # Panics
    /// As [`new`](OwnerToken::new).
    pub(crate) fn held_by(holder: Option<&HolderTag>) -> Self {
        let bytes = os_random_16();
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let suffix = holder.map_or("", |h| &h.suffix);
        let mut value = String::with_capacity(OWNER_DIGITS + suffix.len());
        for b in bytes {
            value.push(char::from(DIGITS[usize::from(b >> 4)]));
            value.push(char::from(DIGITS[usize::from(b & 0xf)]));
        }
        value.push_str(suffix);
        OwnerToken(value)
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }

    /// A given owner value, for the simulation's named owners.
    #[cfg(test)]
    pub(crate) fn from_raw(value: String) -> Self {
        OwnerToken(value)
    }
}

/// A random number in `0.0..1.0` from the operating system's generator (0.5
/// if it fails): the jitter of back-offs and polls.
pub(crate) fn random_unit() -> f64 {
    let mut b = [0u8; 4];
    if getrandom::fill(&mut b).is_err() {
        return 0.5;
    }
    f64::from(u32::from_le_bytes(b)) / (f64::from(u32::MAX) + 1.0)
}

/// 16 bytes from the operating system's generator, read 1 KiB at a time per
/// thread (one system call per 64 tokens, each byte used once).
fn os_random_16() -> [u8; 16] {
    use std::cell::RefCell;
    thread_local! {
        static POOL: RefCell<([u8; 1024], usize)> = const { RefCell::new(([0; 1024], 1024)) };
    }
    POOL.with(|pool| {
        let mut pool = pool.borrow_mut();
        let (buf, used) = &mut *pool;
        if *used + 16 > buf.len() {
            getrandom::fill(buf).expect("the OS random generator failed");
            *used = 0;
        }
        let mut out = [0u8; 16];
        out.copy_from_slice(&buf[*used..*used + 16]);
        // Each byte serves once: wipe what was handed out.
        buf[*used..*used + 16].fill(0);
        *used += 16;
        out
    })
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn tokens_are_128_bit_hex_and_distinct() {
        let tokens: HashSet<String> = (0..10_000).map(|_| OwnerToken::new().0).collect();
        assert_eq!(tokens.len(), 10_000);
        assert!(
            tokens
                .iter()
                .all(|t| t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit()))
        );
    }

    #[test]
    fn a_holder_is_escaped_after_the_digits_and_read_back() {
        let tag = HolderTag::new("host-a pid 42: 100% sure").unwrap();
        let owner = OwnerToken::held_by(Some(&tag));
        let value = owner.as_str();
        assert!(!value.contains(':'), "{value}");
        assert_eq!(&value[32..], "@host-a pid 42%3A 100%25 sure");
        let (id, holder) = split_owner(value);
        assert_eq!(id, &value[..32]);
        assert_eq!(holder.as_deref(), Some("host-a pid 42: 100% sure"));
        // No holder: the bare digits, as before.
        let bare = OwnerToken::new();
        assert_eq!(split_owner(bare.as_str()), (bare.as_str(), None));
        // Values this crate does not write are all owner id.
        for other in ["me", "x@y", "0123456789abcdef0123456789abcdeg@h"] {
            assert_eq!(split_owner(other), (other, None));
        }
        // An escape this crate does not write is kept.
        let odd = format!("{}@a%41%3A%", &value[..32]);
        assert_eq!(split_owner(&odd).1.as_deref(), Some("a%41:%"));
    }

    #[test]
    fn bad_holders_are_refused() {
        for bad in ["", "a\nb", "tab\there", "nul\0"] {
            let e = HolderTag::new(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
        }
        let long = "x".repeat(MAX_HOLDER_LEN + 1);
        assert!(HolderTag::new(&long).is_err());
        assert!(HolderTag::new(&long[1..]).is_ok());
        assert!(HolderTag::new("ünïcode ok").is_ok());
    }
}
