//! Text that crosses from one node to another through the store: what a writer may put in
//! a record's text field, what a reader accepts, and how it is shown.
//!
//! Anyone who can write the store can write any bytes. A reason, a detail or a node id is
//! shown on a terminal (`fsdp-agent status`) and in log lines; ESC there can clear the
//! screen, set the window title or forge a line. So agents write one line of bounded
//! length ([`one_line`]), readers refuse anything else ([`field`]), and whatever is shown
//! anyway (a key, a refused value in a reason) goes through [`shown`].

use std::borrow::Cow;

/// The longest name a record carries (a node id, a machine, an address): a DNS name's
/// limit.
pub const NAME_MAX: usize = 253;
/// The longest line of text a record carries (a reason, a detail).
pub const LINE_MAX: usize = 500;

/// `text` as one line of at most `max` characters: line breaks become spaces, other
/// control characters are dropped. What an agent writes.
pub fn one_line(text: &str, max: usize) -> String {
    text.chars()
        .map(|c| {
            if matches!(c, '\n' | '\r' | '\t') {
                ' '
            } else {
                c
            }
        })
        .filter(|c| !c.is_control())
        .take(max)
        .collect()
}

/// Checks a text field a record brought: at most `max` characters, no control character.
/// `what` names the field in the refusal.
pub fn field(what: &str, text: &str, max: usize) -> Result<(), String> {
    let chars = text.chars().count();
    if chars > max {
        return Err(format!(
            "has a {what} of {chars} characters; agents write at most {max}"
        ));
    }
    if let Some(c) = text.chars().find(|c| c.is_control()) {
        return Err(format!(
            "has a control character ({}) in its {what}; agents write none",
            c.escape_unicode()
        ));
    }
    Ok(())
}

/// `text` safe for a terminal or a log line: each control character written as its
/// escape (`\u{1b}`), so that what a forged record holds is seen, never obeyed.
pub fn shown(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(
        text.chars()
            .map(|c| match c.is_control() {
                true => c.escape_unicode().to_string(),
                false => c.to_string(),
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writer_puts_one_bounded_line() {
        assert_eq!(one_line("a\nb\r\tc\x1b[2J", 100), "a b  c[2J");
        assert_eq!(one_line("héllo", 2), "hé");
    }

    #[test]
    fn a_reader_refuses_control_characters_and_length() {
        assert!(field("reason", "fine, really", 20).is_ok());
        let e = field("reason", "\x1b]0;owned\x07", 20).unwrap_err();
        assert!(
            e.contains("control character (\\u{1b}) in its reason"),
            "{e}"
        );
        assert!(field("reason", "two\nlines", 20).is_err());
        let e = field("node id", &"x".repeat(21), 20).unwrap_err();
        assert!(e.contains("node id of 21 characters"), "{e}");
    }

    #[test]
    fn shown_text_holds_no_control_character() {
        assert_eq!(shown("plain"), "plain");
        let s = shown("\x1b[2Jhealth healthy\n");
        assert_eq!(s, "\\u{1b}[2Jhealth healthy\\u{a}");
        assert!(!s.chars().any(char::is_control));
    }
}
