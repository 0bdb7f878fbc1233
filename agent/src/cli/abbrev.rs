//! Which flag an abbreviated long flag means: torchrun's answer first, then ours.
//!
//! argparse (torchrun's parser, `allow_abbrev`) takes any prefix of a long option string
//! that only one option string starts with, and refuses a prefix that several start with,
//! counting the two spellings of one flag (`--nproc-per-node`, `--nproc_per_node`) as two:
//! `--nproc` is ambiguous under torchrun. A command line written for torchrun must mean the
//! same here, so torchrun's flag list decides every prefix it matches at all, and
//! fsdp-agent's own flags only get the prefixes torchrun leaves unclaimed.

/// A prefix that several flags start with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "ambiguous option: {word} could match {}{}; write the flag out in full",
    candidates.join(", "),
    if *torchrun { " (torchrun refuses it too)" } else { "" }
)]
pub struct AmbiguousFlag {
    /// The flag as typed, without any `=value`.
    pub word: String,
    /// What it could be: option strings in argparse's order when `torchrun`, else the
    /// main name of each of fsdp-agent's flags it could be.
    pub candidates: Vec<String>,
    /// Whether torchrun's own flags are the candidates (torchrun refuses the word too).
    pub torchrun: bool,
}

/// The flag that `word` (a long flag as typed, `--` included, `=value` removed) means:
/// `Ok(Some(name))` with one of the names in the lists, `Ok(None)` when no flag starts with
/// it (or `word` is a bare `--`), or the candidates when several do.
///
/// `torchrun` and `ours` list each flag's names, main name first; `ours` holds every flag
/// fsdp-agent accepts, torchrun's included. The rule:
/// 1. a name typed in full is that flag, whichever list has it;
/// 2. a prefix of one or more of torchrun's option strings is decided as argparse decides
///    it: one option string is its flag, several (even two spellings of one flag) refuse it;
/// 3. any other prefix is the one fsdp-agent flag whose names start with it, and is
///    refused when several flags' names do (spellings of one flag count once, as before).
pub fn resolve_long(
    word: &str,
    torchrun: &[&[&str]],
    ours: &[&[&str]],
) -> Result<Option<String>, AmbiguousFlag> {
    // `--=x` names nothing (argparse would list every flag as a candidate).
    if word == "--" {
        return Ok(None);
    }
    let all_names = || torchrun.iter().chain(ours).flat_map(|names| names.iter());
    if let Some(name) = all_names().find(|n| **n == word) {
        return Ok(Some((*name).to_owned()));
    }
    let by_torchrun: Vec<&str> = torchrun
        .iter()
        .flat_map(|names| names.iter().copied())
        .filter(|n| n.starts_with(word))
        .collect();
    let by_ours: Vec<&str> = ours
        .iter()
        .filter(|names| names.iter().any(|n| n.starts_with(word)))
        .filter_map(|names| names.first().copied())
        .collect();
    let (candidates, torchrun) = match (by_torchrun.as_slice(), by_ours.as_slice()) {
        ([one], _) => return Ok(Some((*one).to_owned())),
        ([], []) => return Ok(None),
        ([], [one]) => return Ok(Some((*one).to_owned())),
        ([], several) => (several, false),
        (several, _) => (several, true),
    };
    Err(AmbiguousFlag {
        word: word.to_owned(),
        candidates: candidates.iter().map(|c| (*c).to_owned()).collect(),
        torchrun,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // A small torchrun and a small fsdp-agent: ours has torchrun's flags and its own.
    const TORCHRUN: &[&[&str]] = &[
        &["--help"],
        &["--nproc-per-node", "--nproc_per_node"],
        &["--no-python", "--no_python"],
        &["--node-rank", "--node_rank"],
        &["--max-restarts", "--max_restarts"],
        &["--redirects"],
        &["--tee"],
        &["--log-dir", "--log_dir"],
        &["--shutdown-timeout", "--shutdown_timeout"],
    ];
    const OURS: &[&[&str]] = &[
        &["--help"],
        &["--version"],
        &["--nproc-per-node", "--nproc_per_node"],
        &["--no-python", "--no_python"],
        &["--no-retry-exit-codes", "--no_retry_exit_codes"],
        &["--node-rank", "--node_rank"],
        &["--node-name", "--node_name"],
        &["--max-restarts", "--max_restarts"],
        &["--redirects"],
        &["--restart-window", "--restart_window"],
        &["--prewarm"],
        &["--prewarm-modules"],
        &["--tee"],
        &["--term-timeout", "--shutdown-timeout", "--shutdown_timeout"],
        &["--log-dir", "--log_dir"],
        &["--log-format"],
        &["--hang-timeout", "--hang_timeout"],
        &["--hang-min", "--hang_min"],
    ];

    fn resolve(word: &str) -> Result<Option<String>, AmbiguousFlag> {
        resolve_long(word, TORCHRUN, OURS)
    }

    fn flag(word: &str) -> String {
        match resolve(word) {
            Ok(Some(name)) => name,
            other => panic!("{word}: {other:?}"),
        }
    }

    fn refused(word: &str) -> AmbiguousFlag {
        resolve(word).expect_err(word)
    }

    #[test]
    fn what_torchrun_resolves_means_the_same_flag() {
        // Each clashes with a flag of ours, which must not win.
        assert_eq!(flag("--no-p"), "--no-python"); // --no-retry-exit-codes
        assert_eq!(flag("--re"), "--redirects"); // --restart-window
        assert_eq!(flag("--te"), "--tee"); // --term-timeout
        assert_eq!(flag("--log-"), "--log-dir"); // --log-format
        assert_eq!(flag("--h"), "--help"); // --hang-timeout, --hang-min
        assert_eq!(flag("--nproc_"), "--nproc_per_node");
        assert_eq!(flag("--nproc-per"), "--nproc-per-node");
    }

    #[test]
    fn what_torchrun_finds_ambiguous_is_refused_with_its_candidates() {
        // Two spellings of one flag are two candidates, as argparse counts them.
        let e = refused("--max");
        assert_eq!(e.candidates, ["--max-restarts", "--max_restarts"]);
        assert!(e.torchrun);
        assert_eq!(
            e.to_string(),
            "ambiguous option: --max could match --max-restarts, --max_restarts \
             (torchrun refuses it too); write the flag out in full"
        );
        assert_eq!(
            refused("--nproc").candidates,
            ["--nproc-per-node", "--nproc_per_node"]
        );
        assert_eq!(
            refused("--shut").candidates,
            ["--shutdown-timeout", "--shutdown_timeout"]
        );
        // In argparse's order, flags of ours that also match (--node-name) left out.
        assert_eq!(
            refused("--no").candidates,
            ["--no-python", "--no_python", "--node-rank", "--node_rank"]
        );
        assert_eq!(refused("--log").candidates, ["--log-dir", "--log_dir"]);
    }

    #[test]
    fn a_prefix_torchrun_does_not_claim_is_resolved_among_ours() {
        assert_eq!(flag("--prewarm-"), "--prewarm-modules");
        assert_eq!(flag("--no-r"), "--no-retry-exit-codes");
        assert_eq!(flag("--node-n"), "--node-name");
        assert_eq!(flag("--log-f"), "--log-format");
        assert_eq!(flag("--ver"), "--version");
        // The spellings of one flag of ours count once: its main name comes back.
        assert_eq!(flag("--restart"), "--restart-window");
        assert_eq!(flag("--term"), "--term-timeout");
        let e = refused("--hang");
        assert_eq!(e.candidates, ["--hang-timeout", "--hang-min"]);
        assert!(!e.torchrun);
        assert_eq!(
            e.to_string(),
            "ambiguous option: --hang could match --hang-timeout, --hang-min; \
             write the flag out in full"
        );
    }

    #[test]
    fn a_name_typed_in_full_always_wins() {
        // --prewarm is also a prefix of --prewarm-modules; --tee of nothing else.
        assert_eq!(flag("--prewarm"), "--prewarm");
        assert_eq!(flag("--tee"), "--tee");
        assert_eq!(flag("--max_restarts"), "--max_restarts");
        assert_eq!(flag("--shutdown_timeout"), "--shutdown_timeout");
        assert_eq!(flag("--term-timeout"), "--term-timeout");
    }

    #[test]
    fn a_word_no_flag_starts_with_is_left_unresolved() {
        assert_eq!(resolve("--bogus"), Ok(None));
        assert_eq!(resolve("---no-p"), Ok(None));
        assert_eq!(resolve("--nproc-per-node-x"), Ok(None));
        assert_eq!(resolve("--"), Ok(None), "--=x");
    }
}
