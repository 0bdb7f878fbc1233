//! docs/architecture.md's list of what lives in etcd, held to the records the rendezvous
//! declares. The list once lacked `ctl/noticed/` and the roster for months: nothing compared
//! it with the code.
//!
//! The code's side is read from the rendezvous crate's source: the table of declared
//! records (`DECLARED` in `rendezvous/src/etcd/record.rs`) and each record's `PLACE`. The
//! crate exposes no list of its records, and a source read needs none; it fails loudly
//! when the declarations take another shape, rather than passing on nothing.

use std::collections::BTreeSet;
use std::path::Path;

use fsdp_tests::workspace_file;

/// A record's place under the run's root, as written in the code and in the doc: a key of
/// its own (`ctl/round`), or a prefix whose keys it names (`ctl/faults/`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Place {
    Fixed(String),
    Under(String),
}

/// Every `.rs` file under `dir`, with its text.
fn sources(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            out.push((path.display().to_string(), text));
        }
    }
    out
}

/// The record types in `DECLARED`, in order: each `declare::<Type>()`.
fn declared(record_rs: &str) -> Vec<String> {
    let start = record_rs
        .find("const DECLARED")
        .expect("record.rs declares its records in DECLARED");
    let end = start
        + record_rs[start..]
            .find("};")
            .expect("DECLARED ends with `};`");
    record_rs[start..end]
        .split("declare::<")
        .skip(1)
        .map(|s| s.split('>').next().unwrap().trim().to_owned())
        .collect()
}

/// `Place::Fixed("x")` or `Place::Under("x")` in `expr`.
fn place_of(expr: &str) -> Option<Place> {
    let quoted = |s: &str| s.split('"').nth(1).map(str::to_owned);
    if let Some(rest) = expr.split("Place::Fixed(").nth(1) {
        return quoted(rest).map(Place::Fixed);
    }
    if let Some(rest) = expr.split("Place::Under(").nth(1) {
        return quoted(rest).map(Place::Under);
    }
    None
}

/// The place `impl Record for v1::<name>` declares, looked for in every file of `files`;
/// a place named by a constant (`const PLACE: Place = HALT;`) is that constant's value.
fn place_in(files: &[(String, String)], name: &str) -> Place {
    let header = format!("impl Record for v1::{name} {{");
    let (_, text) = files
        .iter()
        .find(|(_, t)| t.contains(&header))
        .unwrap_or_else(|| panic!("no `{header}` in rendezvous/src/etcd"));
    let body = &text[text.find(&header).unwrap()..];
    let line = body
        .lines()
        .find(|l| l.trim_start().starts_with("const PLACE: Place ="))
        .unwrap_or_else(|| panic!("{name} declares no PLACE"));
    let expr = line.split_once('=').unwrap().1.trim().trim_end_matches(';');
    if let Some(p) = place_of(expr) {
        return p;
    }
    // A constant: `const HALT: Place = Place::Fixed("ctl/halt");` somewhere in the files.
    let def = format!("const {expr}: Place =");
    files
        .iter()
        .flat_map(|(_, t)| t.lines())
        .find(|l| l.contains(&def))
        .and_then(place_of)
        .unwrap_or_else(|| panic!("{name}'s PLACE is {expr}, which is defined nowhere readable"))
}

/// The places the code declares, one per record kind.
fn code_places() -> BTreeSet<Place> {
    let dir = workspace_file("rendezvous/src/etcd");
    let files = sources(&dir);
    let record_rs = &files
        .iter()
        .find(|(p, _)| p.ends_with("etcd/record.rs"))
        .expect("rendezvous/src/etcd/record.rs")
        .1;
    let names = declared(record_rs);
    assert!(names.len() >= 10, "read too few records: {names:?}");
    names.iter().map(|n| place_in(&files, n)).collect()
}

/// The places docs/architecture.md lists: the first word of each unindented line of the
/// code block after "What lives in etcd"; `<...>` marks where a key's own name begins.
fn doc_places(doc: &str) -> BTreeSet<Place> {
    let from = doc
        .find("What lives in etcd")
        .expect("docs/architecture.md has its list of etcd keys");
    let block = doc[from..]
        .split("```")
        .nth(1)
        .expect("the list is a code block");
    block
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with(' '))
        .map(|l| {
            let key = l.split_whitespace().next().unwrap();
            match key.split_once('<') {
                Some((prefix, _)) => Place::Under(prefix.to_owned()),
                None => Place::Fixed(key.to_owned()),
            }
        })
        .collect()
}

#[test]
fn the_architecture_key_list_is_the_declared_records() {
    let doc = std::fs::read_to_string(workspace_file("docs/architecture.md")).unwrap();
    let (code, listed) = (code_places(), doc_places(&doc));
    let missing: Vec<_> = code.difference(&listed).collect();
    let stale: Vec<_> = listed.difference(&code).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "docs/architecture.md's etcd key list and the declared records disagree:\n\
         declared but not listed: {missing:?}\nlisted but not declared: {stale:?}"
    );
}

#[test]
fn the_readers_see_through_a_place_given_by_a_constant() {
    let files = vec![(
        "x.rs".to_owned(),
        "const HALT: Place = Place::Fixed(\"ctl/halt\");\n\
         impl Record for v1::Halt {\n    const PLACE: Place = HALT;\n}\n\
         impl Record for v1::Done {\n    const PLACE: Place = Place::Under(\"ctl/done/\");\n}\n"
            .to_owned(),
    )];
    assert_eq!(place_in(&files, "Halt"), Place::Fixed("ctl/halt".into()));
    assert_eq!(place_in(&files, "Done"), Place::Under("ctl/done/".into()));
    assert_eq!(
        declared(
            "const DECLARED: &[Declared] = {\n  &[declare::<Member>(), declare::<Halt>()]\n};"
        ),
        ["Member", "Halt"]
    );
    let doc =
        "What lives in etcd:\n\n```\nctl/round   x\n            more\nctl/done/<n>/<node> y\n```\n";
    assert_eq!(
        doc_places(doc),
        [
            Place::Fixed("ctl/round".into()),
            Place::Under("ctl/done/".into())
        ]
        .into()
    );
}
