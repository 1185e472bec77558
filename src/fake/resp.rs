//! The wire: commands read off a socket, replies written in RESP2 or RESP3.

use std::io::{self, BufRead};

use crate::sim::model::Reply;

/// The longest bulk string or array a command may carry (Redis's
/// `proto-max-bulk-len` is 512 MB; the fake needs far less).
const MAX_LEN: usize = 64 << 20;

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

/// One line without its `\r\n`; `None` at the end of the stream.
fn line(r: &mut impl BufRead) -> io::Result<Option<Vec<u8>>> {
    let mut buf = Vec::new();
    if r.read_until(b'\n', &mut buf)? == 0 {
        return Ok(None);
    }
    if !buf.ends_with(b"\r\n") {
        return Err(invalid("a line without \\r\\n"));
    }
    buf.truncate(buf.len() - 2);
    Ok(Some(buf))
}

fn length(digits: &[u8]) -> io::Result<usize> {
    std::str::from_utf8(digits)
        .ok()
        .and_then(|d| d.parse::<usize>().ok())
        .filter(|&n| n <= MAX_LEN)
        .ok_or_else(|| invalid("a bad length"))
}

/// The next command: an array of bulk strings, or an inline command (words
/// on one line, as `telnet` sends them). `None` at the end of the stream;
/// an error for anything else, after which the connection is closed, as
/// Redis closes it after a protocol error.
pub(super) fn read_command(r: &mut impl BufRead) -> io::Result<Option<Vec<Vec<u8>>>> {
    loop {
        let Some(head) = line(r)? else {
            return Ok(None);
        };
        let Some(count) = head.strip_prefix(b"*") else {
            let words: Vec<Vec<u8>> = head
                .split(|b| b.is_ascii_whitespace())
                .filter(|w| !w.is_empty())
                .map(<[u8]>::to_vec)
                .collect();
            if words.is_empty() {
                continue;
            }
            return Ok(Some(words));
        };
        let count = length(count)?;
        let mut argv = Vec::with_capacity(count.min(1024));
        for _ in 0..count {
            let head = line(r)?.ok_or_else(|| invalid("the stream ended in a command"))?;
            let len = length(
                head.strip_prefix(b"$")
                    .ok_or_else(|| invalid("an argument that is not a bulk string"))?,
            )?;
            let mut arg = vec![0; len + 2];
            r.read_exact(&mut arg)?;
            if !arg.ends_with(b"\r\n") {
                return Err(invalid("a bulk string without \\r\\n"));
            }
            arg.truncate(len);
            argv.push(arg);
        }
        if !argv.is_empty() {
            return Ok(Some(argv));
        }
    }
}

/// A bulk string.
pub(super) fn bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(format!("${}\r\n", bytes.len()).as_bytes());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// The header of an aggregate: `*n` (array), `%n` (RESP3 map, `n` pairs)
/// or `>n` (RESP3 push).
pub(super) fn aggregate(out: &mut Vec<u8>, kind: u8, n: usize) {
    out.push(kind);
    out.extend_from_slice(format!("{n}\r\n").as_bytes());
}

/// An integer.
pub(super) fn int(out: &mut Vec<u8>, n: i64) {
    out.extend_from_slice(format!(":{n}\r\n").as_bytes());
}

/// A reply of the model in RESP2, or in RESP3 when `resp3` (a nil is `_`;
/// every other shape is the same in both).
pub(super) fn encode(out: &mut Vec<u8>, reply: &Reply, resp3: bool) {
    match reply {
        Reply::Nil if resp3 => out.extend_from_slice(b"_\r\n"),
        Reply::Nil => out.extend_from_slice(b"$-1\r\n"),
        Reply::Int(n) => int(out, *n),
        Reply::Bulk(b) => bulk(out, b),
        Reply::Status(s) => {
            out.push(b'+');
            out.extend_from_slice(s.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Reply::Error(e) => {
            out.push(b'-');
            out.extend_from_slice(e.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Reply::Array(items) => {
            aggregate(out, b'*', items.len());
            for item in items {
                encode(out, item, resp3);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_arrays_of_bulk_strings_and_inline_commands() {
        let wire = b"*2\r\n$3\r\nGET\r\n$4\r\nk\r\nx\r\nPING  hi\r\n\r\n";
        let mut r = &wire[..];
        assert_eq!(
            read_command(&mut r).unwrap(),
            Some(vec![b"GET".to_vec(), b"k\r\nx".to_vec()])
        );
        assert_eq!(
            read_command(&mut r).unwrap(),
            Some(vec![b"PING".to_vec(), b"hi".to_vec()])
        );
        assert_eq!(read_command(&mut r).unwrap(), None);
    }

    #[test]
    fn a_truncated_or_malformed_command_is_an_error() {
        assert!(read_command(&mut &b"*2\r\n$3\r\nGET\r\n"[..]).is_err());
        assert!(read_command(&mut &b"*1\r\n:3\r\n"[..]).is_err());
        assert!(read_command(&mut &b"*1\r\n$3\r\nGETX\r\n"[..]).is_err());
    }

    #[test]
    fn nil_differs_between_the_protocols() {
        let mut two = Vec::new();
        let mut three = Vec::new();
        let reply = Reply::Array(vec![Reply::Nil, Reply::Int(-2)]);
        encode(&mut two, &reply, false);
        encode(&mut three, &reply, true);
        assert_eq!(two, b"*2\r\n$-1\r\n:-2\r\n");
        assert_eq!(three, b"*2\r\n_\r\n:-2\r\n");
    }
}
