//! Owner tokens (128 bits from the operating system's random generator) and
//! fencing tokens.

use std::fmt;

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
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct OwnerToken(String);

impl OwnerToken {
    /// Draws 128 fresh bits from the OS generator.
    ///
    /// # Panics
    /// If the operating system cannot provide randomness, which leaves no safe
    /// way to tell holders apart.
    pub(crate) fn new() -> Self {
        let bytes = os_random_16();
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut hex = vec![0u8; 32];
        for (pair, b) in hex.chunks_exact_mut(2).zip(bytes) {
            pair[0] = DIGITS[usize::from(b >> 4)];
            pair[1] = DIGITS[usize::from(b & 0xf)];
        }
        OwnerToken(String::from_utf8(hex).expect("hex digits are ASCII"))
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
}
