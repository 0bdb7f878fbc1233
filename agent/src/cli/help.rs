//! `--help` for a torchrun user: one screen, torchrun's flags first under their own heading,
//! then fsdp-agent's own by topic, one line each. `--help-all` has every flag in full.
//!
//! [`super::Args`] declares the headings and the two texts of each flag; [`command`] moves
//! each flag's variable, default and other spellings from its `--help` line, which they
//! would stretch over several, to its `--help-all` text.

use clap::{Arg, CommandFactory};

use super::Args;

/// torchrun's flags, exactly those of [`super::torchrun_flags::TORCHRUN_LONG_FLAGS`].
pub const TORCHRUN: &str =
    "torchrun's options (also spelt with _, e.g. --nproc_per_node, and read from PET_*)";
/// fsdp-agent's own: what ends a job or a node, and what counts as stuck.
pub const FAILURES: &str = "fsdp-agent's failure policy and hangs";
/// fsdp-agent's own: what a node does before it joins or (re)starts workers.
pub const READINESS: &str = "fsdp-agent's health check and pre-warm";
/// fsdp-agent's own: what the agent shows of itself.
pub const STATUS: &str = "fsdp-agent's status, logging and help";

/// The usage lines: a run, the `status` subcommand and the `help` word.
pub const USAGE: &str = "\
fsdp-agent [OPTIONS] TRAINING_SCRIPT [ARGS]...
       fsdp-agent status [OPTIONS]   a run's nodes, round and restarts (status --help)
       fsdp-agent help [all]         this summary; all: every option in full (--help-all)";

/// No description above the usage in `--help` (the screen is for the flags); `--help-all`
/// starts with [`LONG_PREAMBLE`].
pub const TEMPLATE: &str = "{before-help}{usage-heading} {usage}\n\n{all-args}{after-help}";

/// The start of `--help-all`.
const LONG_PREAMBLE: &str = "\
fsdp-agent launches one training process per GPU with torchrun's flags, variables and
worker environment, supervises them and re-forms the group when nodes come and go.
docs/migrating-from-torchrun.md lists every difference from torchrun.";

/// The agent's command line, as it parses and as `--help` and `--help-all` show it.
pub fn command() -> clap::Command {
    parser().mut_args(details_in_long_help)
}

/// The same command line without its help texts rewritten: it parses alike (the rewrite
/// changes only what help shows), for the start of every agent, where rewrapping every
/// flag's text was a thirtieth of its CPU (1,000 agents on two cores). Whatever
/// clap has to print, help or an error, is printed by [`command`].
pub fn parser() -> clap::Command {
    Args::command().before_long_help(LONG_PREAMBLE)
}

/// Where `--help-all` starts a flag's text (clap's indent for text under the flag), and
/// the width it is wrapped to: clap wraps only with its `wrap_help` feature, which would
/// bring a terminal-size dependency for this one screen.
const LONG_INDENT: usize = 10;
const WIDTH: usize = 100;

/// Moves what clap would append to a flag's line (its variable, default and aliases) into
/// its long text, which `--help-all` shows and `--help` does not, and wraps that text.
fn details_in_long_help(a: Arg) -> Arg {
    let mut text = a
        .get_long_help()
        .or_else(|| a.get_help())
        .map(ToString::to_string)
        .unwrap_or_default();
    let details = details(&a);
    if !details.is_empty() {
        text = format!("{text}\n\n{details}");
    }
    let a = a.long_help(wrap(&text, WIDTH - LONG_INDENT)).hide_env(true);
    // clap refuses the setting on flags without a value (their default is `false`).
    if takes_value(&a) {
        a.hide_default_value(true)
    } else {
        a
    }
}

/// `text` with each paragraph's words filled into lines of at most `width` characters (a
/// longer word gets a line of its own).
fn wrap(text: &str, width: usize) -> String {
    let paragraphs = text.split("\n\n").map(|p| {
        let mut lines: Vec<String> = Vec::new();
        for word in p.split_whitespace() {
            match lines.last_mut() {
                Some(line) if line.chars().count() + 1 + word.chars().count() <= width => {
                    line.push(' ');
                    line.push_str(word);
                }
                _ => lines.push(word.to_owned()),
            }
        }
        lines.join("\n")
    });
    paragraphs.collect::<Vec<_>>().join("\n\n")
}

fn takes_value(a: &Arg) -> bool {
    a.get_action().takes_values()
}

/// `[env: X] [default: Y] [aliases: --a, --b]`, the parts that apply.
fn details(a: &Arg) -> String {
    let mut parts = Vec::new();
    if let Some(env) = a.get_env() {
        parts.push(format!("[env: {}]", env.to_string_lossy()));
    }
    let defaults: Vec<_> = a
        .get_default_values()
        .iter()
        .filter(|_| takes_value(a))
        .map(|v| v.to_string_lossy())
        .filter(|v| !v.is_empty())
        .collect();
    if !defaults.is_empty() {
        parts.push(format!("[default: {}]", defaults.join(" ")));
    }
    let aliases: Vec<String> = a
        .get_all_aliases()
        .unwrap_or_default()
        .iter()
        .map(|n| format!("--{n}"))
        .collect();
    if !aliases.is_empty() {
        parts.push(format!("[aliases: {}]", aliases.join(", ")));
    }
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::torchrun_flags::TORCHRUN_LONG_FLAGS;

    /// Where `a` stands in torchrun's flag list, if it is torchrun's.
    fn torchrun_index(a: &Arg) -> Option<usize> {
        let names: Vec<String> = a
            .get_long()
            .into_iter()
            .chain(a.get_all_aliases().unwrap_or_default())
            .map(|n| format!("--{n}"))
            .collect();
        TORCHRUN_LONG_FLAGS
            .iter()
            .position(|flag| flag.iter().any(|n| names.iter().any(|ours| ours == n)))
    }

    fn flags(cmd: &clap::Command) -> impl Iterator<Item = &Arg> {
        cmd.get_arguments().filter(|a| !a.is_positional())
    }

    /// Words collapsed to single spaces: clap wraps long text at the terminal width.
    fn words(s: &str) -> String {
        s.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    /// The agent parses with [`parser`] and prints with [`command`]: what decides a parse
    /// must be the same in both, flag by flag.
    #[test]
    fn the_parser_and_the_shown_command_parse_alike() {
        let parsing = |a: &Arg| {
            format!(
                "{:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?}",
                a.get_id(),
                a.get_long(),
                a.get_short(),
                a.get_all_aliases(),
                a.get_env(),
                a.get_default_values(),
                a.get_action(),
                a.get_num_args(),
                a.get_value_delimiter(),
                a.get_possible_values(),
            )
        };
        let shown: Vec<String> = command().get_arguments().map(parsing).collect();
        let parsed: Vec<String> = parser().get_arguments().map(parsing).collect();
        assert_eq!(shown, parsed);
        assert!(shown.len() > 40, "every flag compared: {}", shown.len());
        // And the texts do differ, or there would be nothing to spare.
        let long = |c: clap::Command| {
            c.get_arguments()
                .map(|a| format!("{:?}", a.get_long_help()))
                .collect::<Vec<_>>()
        };
        assert_ne!(long(command()), long(parser()));
    }

    #[test]
    fn torchruns_flags_and_no_others_are_under_torchruns_heading_in_its_order() {
        let cmd = command();
        let mut under_torchrun = Vec::new();
        for a in flags(&cmd) {
            let name = a.get_long().unwrap_or_default();
            match torchrun_index(a) {
                Some(i) => {
                    assert_eq!(
                        a.get_help_heading(),
                        Some(TORCHRUN),
                        "--{name} is torchrun's"
                    );
                    under_torchrun.push(i);
                }
                None => {
                    let heading = a.get_help_heading();
                    assert!(
                        heading.is_some() && heading != Some(TORCHRUN),
                        "--{name} is fsdp-agent's own, under {heading:?}"
                    );
                }
            }
        }
        let expected: Vec<usize> = (0..TORCHRUN_LONG_FLAGS.len()).collect();
        assert_eq!(
            under_torchrun, expected,
            "one flag each, in torchrun's order"
        );
    }

    #[test]
    fn the_summary_is_one_screen_torchrun_first_one_line_per_flag() {
        let mut cmd = command();
        let help = cmd.render_help().to_string();
        let lines: Vec<&str> = help.lines().collect();
        assert!(lines.len() <= 60, "{} lines:\n{help}", lines.len());
        for l in &lines {
            assert!(l.chars().count() <= 100, "too wide: {l}");
        }
        let first_heading = lines
            .iter()
            .position(|l| l.ends_with(':') && !l.starts_with(' '));
        assert_eq!(
            first_heading.map(|i| lines[i]),
            Some(&*format!("{TORCHRUN}:"))
        );
        cmd.build();
        for a in flags(&cmd).filter(|a| !a.is_hide_set() && !a.is_hide_short_help_set()) {
            let long = format!("--{}", a.get_long().unwrap());
            let line = lines
                .iter()
                .find(|l| {
                    l.split_whitespace()
                        .any(|w| w.trim_end_matches(',') == long)
                })
                .unwrap_or_else(|| panic!("{long} is not in the summary:\n{help}"));
            let short = a.get_help().expect("every flag has a line").to_string();
            assert!(line.ends_with(&short), "{long}'s line is cut: {line}");
        }
        assert!(help.contains("fsdp-agent status"), "{help}");
        assert!(!help.contains("[env:"), "{help}");
    }

    #[test]
    fn the_long_text_has_every_flag_in_full() {
        let mut cmd = command();
        let long = words(&cmd.render_long_help().to_string());
        cmd.build();
        for a in flags(&cmd).filter(|a| !a.is_hide_set()) {
            let name = a.get_long().unwrap();
            let text = a.get_long_help().or_else(|| a.get_help()).unwrap();
            assert!(
                long.contains(&words(&text.to_string())),
                "--{name}'s text is missing"
            );
        }
        for detail in [
            "[env: PET_NPROC_PER_NODE] [default: 1] [aliases: --nproc_per_node]",
            "[env: PET_SHUTDOWN_TIMEOUT] [aliases: --term_timeout, --shutdown-timeout",
            "[env: FSDP_HANG_TIMEOUT] [default: auto] [aliases: --hang_timeout]",
            "`c10d`: no etcd, on one node or several",
        ] {
            assert!(long.contains(detail), "{detail}");
        }
    }

    #[test]
    fn wrapping_fills_lines_and_keeps_paragraphs() {
        assert_eq!(wrap("a bb ccc dd\n\ne", 6), "a bb\nccc dd\n\ne");
        assert_eq!(wrap("longword x", 4), "longword\nx");
        assert_eq!(wrap("", 4), "");
    }

    #[test]
    fn details_name_the_variable_default_and_other_spellings() {
        let a = Arg::new("x")
            .long("max-restarts")
            .alias("max_restarts")
            .env("PET_MAX_RESTARTS")
            .default_value("0");
        assert_eq!(
            details(&a),
            "[env: PET_MAX_RESTARTS] [default: 0] [aliases: --max_restarts]"
        );
        assert_eq!(details(&Arg::new("x").long("x").default_value("")), "");
    }
}
