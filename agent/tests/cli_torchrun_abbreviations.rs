//! Abbreviated flags mean here what they mean to torchrun: every prefix (three characters
//! and longer) of every long flag, torchrun's and ours, is put to torchrun's real parser in
//! the venv's Python (one process, `torchrun_abbreviations.py`) and to the agent's
//! resolution of abbreviations, which must agree.
//!
//! This tests the function the parser calls, with the parser's own flag lists, because a
//! process per word would be thousands of processes; tests/tests/cli.rs runs the binary
//! on a handful of the same words.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use fsdp_agent::cli::abbrev::AmbiguousFlag;
use fsdp_agent::cli::torchrun_flags::TORCHRUN_LONG_FLAGS;
use fsdp_agent::cli::{LongFlags, command};
use serde_json::Value;

/// The venv's Python, with torch: missing is a failure, never a skip.
fn python() -> PathBuf {
    let p = std::env::var_os("FSDP_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").map_or_else(|| "/root".into(), PathBuf::from);
            home.join(".cache/fsdp-agent/venv/bin/python")
        });
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup.sh (or set FSDP_TEST_PYTHON)",
        p.display()
    );
    p
}

/// torchrun's answers for `words`, and its flags, from one Python process.
fn ask_torchrun(words: &BTreeSet<String>) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/torchrun_abbreviations.py");
    let mut child = Command::new(python())
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the venv's python");
    let input: String = words.iter().map(|w| format!("{w}\n")).collect();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script prints JSON")
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .expect("a list")
        .iter()
        .map(|s| s.as_str().expect("a string").to_owned())
        .collect()
}

/// Every prefix of `name` from `--x` on.
fn prefixes(name: &str) -> impl Iterator<Item = String> + '_ {
    (3..=name.len()).map(|n| name[..n].to_owned())
}

#[test]
fn cli_abbreviations_resolve_as_torchruns_parser_resolves_them() {
    let ours = LongFlags::of(&command());
    let words: BTreeSet<String> = TORCHRUN_LONG_FLAGS
        .iter()
        .copied()
        .flatten()
        .copied()
        .chain(ours.names())
        .flat_map(prefixes)
        .collect();
    let torchrun = ask_torchrun(&words);
    eprintln!(
        "torch {} on Python {}: {} words",
        torchrun["torch"],
        torchrun["python"],
        words.len()
    );
    assert_eq!(torchrun["allow_abbrev"], Value::Bool(true));
    let dest_of = torchruns_flags(&torchrun);

    let mut mismatches = Vec::new();
    let mut seen = BTreeMap::<&str, usize>::new();
    for a in torchrun["answers"].as_array().unwrap() {
        let word = a["word"].as_str().unwrap();
        let here = ours.resolve(word);
        let (kind, agrees) = compare(a, &here, &dest_of);
        *seen.entry(kind).or_default() += 1;
        if !agrees {
            mismatches.push(format!("{word}: torchrun {a}, fsdp-agent {here:?}"));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} words read differently:\n{}",
        mismatches.len(),
        words.len(),
        mismatches.join("\n")
    );
    // Not a vacuous pass: all three kinds of answer came up, with the reported cases.
    assert!(
        seen.len() == 3 && seen.values().all(|n| *n > 10),
        "{seen:?}"
    );
    assert_reported_cases_asked(&torchrun);
}

/// Checks that the agent's copy of torchrun's flag list is the parser's, and returns
/// each of torchrun's flag names with the option (`dest`) it sets.
fn torchruns_flags(torchrun: &Value) -> BTreeMap<&str, &str> {
    let flags = torchrun["flags"].as_array().unwrap();
    let names: Vec<Vec<String>> = flags.iter().map(|f| strings(&f["names"])).collect();
    let listed: Vec<Vec<String>> = TORCHRUN_LONG_FLAGS
        .iter()
        .map(|f| f.iter().map(|n| (*n).to_owned()).collect())
        .collect();
    assert_eq!(listed, names, "TORCHRUN_LONG_FLAGS is not torchrun's list");
    flags
        .iter()
        .flat_map(|f| {
            let dest = f["dest"].as_str().unwrap();
            f["names"]
                .as_array()
                .unwrap()
                .iter()
                .map(move |n| (n.as_str().unwrap(), dest))
        })
        .collect()
}

/// torchrun's answer `a` for one word against the agent's (`here`): the kind of answer
/// (resolved, ambiguous, unknown) and whether the two agree.
fn compare(
    a: &Value,
    here: &Result<Option<String>, AmbiguousFlag>,
    dest_of: &BTreeMap<&str, &str>,
) -> (&'static str, bool) {
    if let Some(dest) = a["dest"].as_str() {
        let agrees = matches!(here, Ok(Some(name)) if dest_of.get(name.as_str()) == Some(&dest));
        ("resolved", agrees)
    } else if let Some(candidates) = a.get("ambiguous") {
        let agrees = matches!(here, Err(e) if e.torchrun && e.candidates == strings(candidates));
        ("ambiguous", agrees)
    } else {
        // No torchrun flag starts with it: it is one of ours, by one flag's names or
        // refused as ambiguous among ours, never unknown (it is a prefix of our names).
        assert_eq!(a["unknown"], Value::Bool(true), "{a}");
        let agrees = match here {
            Ok(Some(_)) => true,
            Err(e) => !e.torchrun,
            Ok(None) => false,
        };
        ("unknown", agrees)
    }
}

/// The words of past reports were asked, and torchrun answered each as it did then.
fn assert_reported_cases_asked(torchrun: &Value) {
    for (word, kind) in [
        ("--no-p", "dest"),
        ("--log-", "dest"),
        ("--te", "dest"),
        ("--re", "dest"),
        ("--max", "ambiguous"),
        ("--nproc", "ambiguous"),
        ("--hang", "unknown"),
    ] {
        let a = torchrun["answers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["word"] == word)
            .unwrap_or_else(|| panic!("{word} was not asked"));
        assert!(a.get(kind).is_some(), "{word}: {a}");
    }
}
