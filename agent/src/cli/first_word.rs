//! What the first word asks for: the `status` subcommand, help, or a run.
//!
//! torchrun has neither word: `torchrun help` runs a script named `help`. `status` is
//! always the subcommand (`./status` still runs a program of that name). `help` is help
//! unless the working directory holds something Python can run by that name, so that
//! every command line that works under torchrun works the same here; where `torchrun help`
//! would fail (no such file) fsdp-agent prints its help instead.

use std::ffi::OsString;
use std::path::Path;

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    /// `fsdp-agent status ...`.
    Status,
    /// `fsdp-agent help [TOPIC]`.
    Help(HelpTopic),
    /// Agent flags and a training script.
    Run,
}

/// What `fsdp-agent help` was asked about.
#[derive(Debug, PartialEq, Eq)]
pub enum HelpTopic {
    /// `help`: the same as `--help`.
    Summary,
    /// `help all`: the same as `--help-all`.
    All,
    /// `help status`: the same as `status --help`.
    Status,
    /// Anything else, as typed.
    Unknown(String),
}

/// Reads `argv` (`argv[0]` is the program). `runnable` says whether a path in the working
/// directory is something Python runs as a script (a file, or a directory with a
/// `__main__.py`).
pub fn request(argv: &[OsString], runnable: impl Fn(&Path) -> bool) -> Request {
    let Some(first) = argv.get(1) else {
        return Request::Run;
    };
    if first == "status" {
        return Request::Status;
    }
    if first != "help" || runnable(Path::new("help")) {
        return Request::Run;
    }
    let topic: Vec<String> = argv[2..]
        .iter()
        .map(|w| w.to_string_lossy().into_owned())
        .collect();
    Request::Help(match topic.as_slice() {
        [] => HelpTopic::Summary,
        [t] if t == "all" => HelpTopic::All,
        [t] if t == "status" => HelpTopic::Status,
        _ => HelpTopic::Unknown(topic.join(" ")),
    })
}

/// Whether Python runs `path` as a script: a file, or a directory with a `__main__.py`.
pub fn python_runs(path: &Path) -> bool {
    path.is_file() || path.join("__main__.py").is_file()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(line: &str, help_file: bool) -> Request {
        let argv: Vec<OsString> = std::iter::once("fsdp-agent")
            .chain(line.split_whitespace())
            .map(OsString::from)
            .collect();
        request(&argv, |p| {
            assert_eq!(p, Path::new("help"), "only `help` is looked for");
            help_file
        })
    }

    #[test]
    fn help_and_its_topics() {
        assert_eq!(ask("help", false), Request::Help(HelpTopic::Summary));
        assert_eq!(ask("help all", false), Request::Help(HelpTopic::All));
        assert_eq!(ask("help status", false), Request::Help(HelpTopic::Status));
        assert_eq!(
            ask("help --nnodes 2", false),
            Request::Help(HelpTopic::Unknown("--nnodes 2".into()))
        );
    }

    #[test]
    fn a_script_named_help_runs_as_under_torchrun() {
        assert_eq!(ask("help", true), Request::Run);
        assert_eq!(ask("help all", true), Request::Run);
        // Only the first word is a subcommand: after a flag, `help` is the script.
        assert_eq!(ask("--standalone help", false), Request::Run);
        assert_eq!(ask("./help", false), Request::Run);
    }

    #[test]
    fn status_is_always_the_subcommand() {
        assert_eq!(ask("status --json", true), Request::Status);
        assert_eq!(ask("--no-python status", false), Request::Run);
        assert_eq!(ask("", false), Request::Run);
        assert_eq!(ask("train.py", false), Request::Run);
    }

    #[test]
    fn python_runs_files_and_packages_not_other_directories() {
        let tmp = tempfile::TempDir::new().unwrap();
        let dir = tmp.path();
        let pkg = dir.join("pkg");
        let plain = dir.join("plain");
        std::fs::create_dir_all(&pkg).unwrap();
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::write(pkg.join("__main__.py"), "").unwrap();
        std::fs::write(dir.join("help"), "").unwrap();
        let answers = (
            python_runs(&dir.join("help")),
            python_runs(&pkg),
            python_runs(&plain),
            python_runs(&dir.join("absent")),
        );
        assert_eq!(answers, (true, true, false, false));
    }
}
