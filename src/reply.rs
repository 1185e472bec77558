//! Reading the text out of a server's reply, whichever of RESP's string
//! kinds carries it.

/// The text of a string reply (bulk, simple or verbatim), if it is one and
/// valid UTF-8.
pub(crate) fn text(reply: &redis::Value) -> Option<&str> {
    match reply {
        redis::Value::BulkString(bytes) => std::str::from_utf8(bytes).ok(),
        redis::Value::SimpleString(text) | redis::Value::VerbatimString { text, .. } => Some(text),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_string_kind_reads_as_its_text_and_nothing_else_does() {
        let verbatim = redis::Value::VerbatimString {
            format: redis::VerbatimFormat::Text,
            text: "role:master".into(),
        };
        assert_eq!(text(&verbatim), Some("role:master"));
        assert_eq!(
            text(&redis::Value::BulkString(b"a b".to_vec())),
            Some("a b")
        );
        assert_eq!(text(&redis::Value::SimpleString("OK".into())), Some("OK"));
        assert_eq!(text(&redis::Value::BulkString(vec![0xff])), None);
        assert_eq!(text(&redis::Value::Int(1)), None);
        assert_eq!(text(&redis::Value::Nil), None);
    }
}
