//! JSON output, written by hand: the tool prints only flat objects of strings,
//! numbers, booleans and null, plus arrays of such objects or strings, so a
//! small, tested writer is all it needs.

use std::fmt::Write as _;

/// Appends `text` to `out` as a JSON string (RFC 8259): quotes, backslashes and
/// control characters escaped, everything else as UTF-8.
pub(crate) fn push_str(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            // The other C0 controls, DEL, and the line and paragraph separators
            // that some JavaScript parsers refuse inside strings.
            c if c < ' ' || c == '\u{7f}' || c == '\u{2028}' || c == '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A JSON string value.
pub(crate) fn string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    push_str(&mut out, text);
    out
}

/// A JSON array of values already written as JSON.
pub(crate) fn array<I: IntoIterator<Item = String>>(items: I) -> String {
    let mut out = String::from("[");
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&item);
    }
    out.push(']');
    out
}

/// One JSON object, built field by field in order.
pub(crate) struct Object {
    out: String,
    empty: bool,
}

impl Object {
    pub(crate) fn new() -> Object {
        Object {
            out: String::from("{"),
            empty: true,
        }
    }

    fn key(&mut self, key: &str) {
        if !self.empty {
            self.out.push(',');
        }
        self.empty = false;
        push_str(&mut self.out, key);
        self.out.push(':');
    }

    pub(crate) fn str(mut self, key: &str, value: &str) -> Object {
        self.key(key);
        push_str(&mut self.out, value);
        self
    }

    pub(crate) fn opt_str(self, key: &str, value: Option<&str>) -> Object {
        match value {
            Some(v) => self.str(key, v),
            None => self.raw(key, "null"),
        }
    }

    pub(crate) fn num(mut self, key: &str, value: impl Into<i128>) -> Object {
        self.key(key);
        let _ = write!(self.out, "{}", value.into());
        self
    }

    pub(crate) fn opt_num<N: Into<i128>>(self, key: &str, value: Option<N>) -> Object {
        match value {
            Some(v) => self.num(key, v),
            None => self.raw(key, "null"),
        }
    }

    pub(crate) fn bool(self, key: &str, value: bool) -> Object {
        self.raw(key, if value { "true" } else { "false" })
    }

    /// A field whose value is already JSON.
    pub(crate) fn raw(mut self, key: &str, json: &str) -> Object {
        self.key(key);
        self.out.push_str(json);
        self
    }

    pub(crate) fn finish(mut self) -> String {
        self.out.push('}');
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped() {
        assert_eq!(string("plain"), r#""plain""#);
        assert_eq!(string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(string("l1\nl2\r\t"), r#""l1\nl2\r\t""#);
        assert_eq!(string("\u{0}\u{1f}\u{7f}"), r#""\u0000\u001f\u007f""#);
        assert_eq!(string("\u{8}\u{c}"), r#""\b\f""#);
        assert_eq!(string("\u{2028}"), r#""\u2028""#);
        assert_eq!(string("{clé} ✓"), "\"{clé} ✓\"");
    }

    #[test]
    fn objects_and_arrays() {
        let obj = Object::new()
            .str("event", "acquired")
            .num("token", 7u64)
            .opt_num::<i64>("ttl_ms", None)
            .num("code", -1i32)
            .bool("held", true)
            .opt_str("error", None)
            .raw("list", &array([string("a"), string("b")]))
            .finish();
        assert_eq!(
            obj,
            r#"{"event":"acquired","token":7,"ttl_ms":null,"code":-1,"held":true,"error":null,"list":["a","b"]}"#
        );
        assert_eq!(Object::new().finish(), "{}");
        assert_eq!(array(Vec::new()), "[]");
        assert_eq!(
            Object::new().num("max", u64::MAX).finish(),
            r#"{"max":18446744073709551615}"#
        );
    }
}
