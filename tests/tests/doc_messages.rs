//! Every message docs/troubleshooting.md quotes is one the agent's binary can print.
//!
//! The page is searched by people pasting a line from their log, so a quote the binary
//! never prints finds nothing (it quoted `WARN etcd not reachable yet` and a `(retried for
//! 30s); check --rdzv-endpoint, TLS files and credentials` that no code path wrote).
//!
//! A quote is each backtick span of a `###` heading, and each span of four words or more
//! in the text that is not a command, a setting or a metric. `...` stands for what varies;
//! ` key=` starts one of the log line's fields, whose name must be in the binary too. The
//! text between is looked for in the binary's read-only data, where the compiler keeps
//! every literal piece of a format string: covered by pieces the binary holds, each long
//! enough to mean something (a piece between two of a format string's arguments can be as
//! short as `): `). Quotes of other programs (Gloo, NCCL, the kubelet) are listed below
//! with who prints them.

use std::path::PathBuf;
use std::process::Command;

use fsdp_tests::{TempDir, agent_bin, workspace_file};

/// What other programs print, quoted on the page beside ours, and who prints them.
const OTHERS: &[(&str, &str)] = &[
    ("Connection closed by peer", "Gloo"),
    ("Connection reset by peer", "Gloo"),
    ("NCCL communicator was aborted", "NCCL"),
    ("Watchdog caught collective operation timeout", "NCCL"),
    ("DistNetworkError", "PyTorch's c10d"),
    ("Readiness probe failed: ... NOT_SERVING", "the kubelet"),
    ("Liveness probe failed", "the kubelet"),
    ("Bus error", "the kernel"),
    ("No space left on device", "the kernel"),
    ("apply request took too long", "etcd"),
    ("0/1", "kubectl's READY column"),
];

/// The start of a span that is a command, a setting or a metric, not a message.
const NOT_MESSAGES: &[&str] = &[
    "kubectl ",
    "etcdctl ",
    "ss ",
    "fsdp-agent ",
    "grpcurl ",
    "rdzvConf",
    "--",
    "rate(",
    "exec ",
    "bash ",
    "fsdp_agent_",
    "/",
];

/// gRPC's own words before ours, in what a gRPC client shows.
const GRPC_PREFIXES: &[&str] = &["RESOURCE_EXHAUSTED: "];

/// The binary's read-only data.
fn rodata() -> Vec<u8> {
    let dir = TempDir::new().unwrap();
    let out: PathBuf = dir.path().join("rodata");
    let status = Command::new("objcopy")
        .args(["-O", "binary", "--only-section=.rodata"])
        .arg(agent_bin())
        .arg(&out)
        .status()
        .expect("objcopy (binutils)");
    assert!(status.success(), "objcopy failed");
    std::fs::read(out).unwrap()
}

/// The quotes of `doc`, with the line their heading or paragraph starts on (a span may
/// wrap onto the next line).
fn quotes(doc: &str) -> Vec<(usize, String)> {
    let mut blocks: Vec<(usize, bool, String)> = Vec::new();
    let mut open = false;
    for (n, line) in doc.lines().enumerate() {
        let heading = line.starts_with('#');
        if heading || line.trim().is_empty() {
            if heading {
                blocks.push((n + 1, true, line.to_owned()));
            }
            open = false;
        } else if open {
            let last = blocks.last_mut().expect("an open paragraph");
            last.2.push(' ');
            last.2.push_str(line.trim());
        } else {
            blocks.push((n + 1, false, line.trim().to_owned()));
            open = true;
        }
    }
    let mut found = Vec::new();
    for (line, heading, text) in blocks {
        for span in text.split('`').skip(1).step_by(2) {
            let words = span.split_whitespace().count();
            let command = NOT_MESSAGES.iter().any(|p| span.starts_with(p));
            let message = !command && (heading || words >= 4);
            if message {
                found.push((line, span.to_owned()));
            }
        }
    }
    found
}

/// The parts of `quote` the binary must hold: the text between `...`s and fields, and each
/// field's name.
fn parts(quote: &str) -> Vec<String> {
    let mut quote = quote;
    for p in GRPC_PREFIXES {
        quote = quote.strip_prefix(p).unwrap_or(quote);
    }
    let mut out = Vec::new();
    for chunk in quote.split("...") {
        // ` reason=the lease could not be renewed: `: the field's name, then its value.
        let mut rest = chunk;
        while let Some(eq) = field_at(rest) {
            let (before, after) = rest.split_at(eq.0);
            out.push(before.to_owned());
            out.push(after[1..eq.1].to_owned());
            rest = &after[eq.1 + 1..];
        }
        out.push(rest.to_owned());
    }
    out.into_iter()
        .map(|p| p.trim().to_owned())
        .filter(|p| p.chars().any(|c| c.is_alphanumeric()))
        .collect()
}

/// Where a ` name=` field starts in `s` (the space's index) and where its `=` is.
fn field_at(s: &str) -> Option<(usize, usize)> {
    let bytes = s.as_bytes();
    for (i, _) in s.match_indices('=') {
        let start = s[..i].rfind(' ')?;
        let name = &s[start + 1..i];
        if !name.is_empty()
            && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
            && bytes.get(i + 1).is_none_or(|b| *b != b'=')
        {
            return Some((start, i - start));
        }
    }
    None
}

/// Whether `text` is covered by pieces the binary holds: greedily the longest prefix found,
/// each at least 4 bytes unless it holds no letter (the `): ` between two arguments), and
/// no more of them than one per 16 bytes of text and two more (a real line is a few long
/// literals; English made of scraps from anywhere in the binary is many short ones).
fn covered(bin: &[u8], text: &str) -> Result<(), String> {
    let text = text.as_bytes();
    let (mut at, mut pieces) = (0, 0);
    while at < text.len() {
        let rest = &text[at..];
        let mut best = 0;
        // The longest prefix of `rest` in the binary: found prefixes are nested.
        let (mut lo, mut hi) = (1, rest.len());
        while lo <= hi {
            let mid = (lo + hi) / 2;
            if memchr::memmem::find(bin, &rest[..mid]).is_some() {
                best = mid;
                lo = mid + 1;
            } else {
                hi = mid - 1;
            }
        }
        let piece = &rest[..best];
        let wordy = piece.iter().any(u8::is_ascii_alphabetic);
        if best == 0 || (wordy && best < 4 && best < rest.len()) {
            return Err(format!(
                "nothing in the binary holds {:?}",
                String::from_utf8_lossy(rest)
            ));
        }
        pieces += usize::from(wordy);
        at += best;
    }
    if pieces > 2 + text.len() / 16 {
        return Err(format!("it is in the binary only as {pieces} scraps"));
    }
    Ok(())
}

fn check(bin: &[u8], quote: &str) -> Result<(), String> {
    if OTHERS.iter().any(|(q, _)| *q == quote) {
        return Ok(());
    }
    for part in parts(quote) {
        covered(bin, &part).map_err(|why| format!("{part:?}: {why}"))?;
    }
    Ok(())
}

#[test]
fn every_message_troubleshooting_quotes_is_one_the_binary_prints() {
    let bin = rodata();
    let doc = std::fs::read_to_string(workspace_file("docs/troubleshooting.md")).unwrap();
    let quotes = quotes(&doc);
    assert!(quotes.len() > 40, "found only {} quotes", quotes.len());
    let wrong: Vec<String> = quotes
        .iter()
        .filter_map(|(line, q)| {
            check(&bin, q)
                .err()
                .map(|why| format!("docs/troubleshooting.md:{line}: `{q}`\n    {why}"))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "quoted messages the agent never prints (quote the real line, `...` for what varies):\n{}",
        wrong.join("\n")
    );
}

/// The check fails on the quotes the page once had, which no code path printed, and on
/// words the binary holds only in scraps; it passes the real lines.
#[test]
fn the_check_refuses_what_the_binary_never_prints() {
    let bin = rodata();
    for never in [
        "WARN etcd not reachable yet",
        "etcd at ... refused the connection after 30s of retries; check the firewall and the credentials",
        "the rendezvous exploded while forming",
    ] {
        assert!(check(&bin, never).is_err(), "passed: {never}");
    }
    for real in [
        "the restart budget is spent; giving up",
        "no round formed within join_timeout (...): waiting for nodes: ... of min ... present (run '...' on ... at ...); start the others with the same --rdzv-id, or lower --nnodes",
        "fencing: stopping the workers reason=the lease could not be renewed: ...",
    ] {
        check(&bin, real).unwrap_or_else(|why| panic!("refused `{real}`: {why}"));
    }
}

#[test]
fn quotes_split_into_text_and_field_names() {
    assert_eq!(
        parts("fencing: stopping the workers reason=the lease could not be renewed: ..."),
        [
            "fencing: stopping the workers",
            "reason",
            "the lease could not be renewed:"
        ]
    );
    assert_eq!(parts("a (...): b"), ["a (", "): b"]);
    assert_eq!(parts("... = ..."), Vec::<String>::new());
}
