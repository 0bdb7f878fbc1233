//! Worker exits, error files and the failure summary.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerExit {
    Code(i32),
    Signal(i32),
    /// It is gone, but the agent could not learn how it ended (waiting for it failed).
    Lost,
    /// It was alive but made no progress in time (`crate::hang`); the agent stopped it.
    Hung,
}

impl WorkerExit {
    pub fn from_status(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(c), _) => Self::Code(c),
            (None, Some(s)) => Self::Signal(s),
            // Neither a code nor a signal cannot happen for a reaped process.
            (None, None) => Self::Lost,
        }
    }

    pub fn success(self) -> bool {
        self == Self::Code(0)
    }
}

impl fmt::Display for WorkerExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Code(c) => write!(f, "exit code {c}"),
            Self::Signal(s) => {
                let name = nix::sys::signal::Signal::try_from(s)
                    .map(|s| s.as_str())
                    .unwrap_or("?");
                write!(f, "signal {s} ({name})")
            }
            Self::Lost => f.write_str("exit status unknown (the agent lost track of it)"),
            Self::Hung => f.write_str("hung (no progress reported in time; stopped by the agent)"),
        }
    }
}

/// One worker that failed on its own (not stopped by the agent).
#[derive(Debug, Clone)]
pub struct Failure {
    pub local_rank: u32,
    pub rank: u32,
    pub pid: u32,
    pub exit: WorkerExit,
    pub at: SystemTime,
    pub error_file: Option<PathBuf>,
    /// What `error_file` said, read when the worker exited (off the runtime thread);
    /// `None` when the worker wrote none.
    pub report: Option<ErrorReport>,
    /// The last lines of its stderr, when they went to a log file (`--redirects`/`--tee`);
    /// empty otherwise (on the console they are just above the summary).
    pub stderr_tail: Vec<String>,
}

/// How many of a failed worker's last stderr lines the summary quotes.
pub const TAIL_LINES: usize = 10;
/// Whether decorating the worker's main with `@record` would have given an error file:
/// a Python worker that ended on an uncaught exception (exit code 1) — unless its last
/// lines show the exception came before main could run (an import or a syntax error).
pub fn record_would_help(python: bool, exit: WorkerExit, stderr_tail: &[String]) -> bool {
    const BEFORE_MAIN: [&str; 3] = ["ModuleNotFoundError", "ImportError", "SyntaxError"];
    let before_main = stderr_tail
        .last()
        .is_some_and(|l| BEFORE_MAIN.iter().any(|e| l.contains(e)));
    python && exit == WorkerExit::Code(1) && !before_main
}

/// What a worker's `TORCHELASTIC_ERROR_FILE` says, as written by torch's `@record`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReport {
    pub message: String,
    pub traceback: Option<String>,
}

/// Reads an error file. A missing file is `Ok(None)` (the worker did not use `@record`);
/// a file that is not the expected JSON is reported as its first line, never trusted further.
pub fn read_error_file(path: &Path) -> Option<ErrorReport> {
    let text = std::fs::read_to_string(path).ok()?;
    let Ok(json) = serde_json::from_str::<serde_json::Value>(&text) else {
        return Some(ErrorReport {
            message: format!(
                "(unparsable error file) {}",
                text.lines().next().unwrap_or("")
            ),
            traceback: None,
        });
    };
    let msg = &json["message"];
    let (message, traceback) = match msg {
        serde_json::Value::String(s) => (s.clone(), None),
        serde_json::Value::Object(_) => (
            msg["message"].as_str().unwrap_or("").to_owned(),
            msg["extraInfo"]["py_callstack"].as_str().map(str::to_owned),
        ),
        _ => (text.lines().next().unwrap_or("").to_owned(), None),
    };
    Some(ErrorReport { message, traceback })
}

/// torchrun's launcher-level error file: `TORCHELASTIC_ERROR_FILE` in the agent's own
/// environment, where a scheduler reads why the job failed. Like torchrun's `@record` on
/// its `main`, the root-cause worker's own error file is copied there with
/// `message.errorCode` set to `exit_code`; a worker that wrote none gets one in the same format, saying how it
/// ended (torchrun writes nothing then).
pub fn write_launcher_error(
    path: &Path,
    root: &Failure,
    host: &str,
    exit_code: u8,
) -> std::io::Result<()> {
    let from_worker = root
        .error_file
        .as_deref()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .filter(serde_json::Value::is_object);
    let mut json = from_worker.unwrap_or_else(|| {
        let at = root
            .at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        serde_json::json!({
            "message": {
                "message": format!(
                    "worker rank {} (local_rank {}, host {host}, pid {}) failed: {}",
                    root.rank, root.local_rank, root.pid, root.exit
                ),
                "extraInfo": {"py_callstack": "", "timestamp": at.to_string()},
            }
        })
    });
    // Where torchrun's error handler puts it: inside "message" (a bare string message
    // becomes the object form first).
    if let Some(text) = json["message"].as_str().map(str::to_owned) {
        json["message"] = serde_json::json!({"message": text, "extraInfo": {}});
    }
    json["message"]["errorCode"] = serde_json::json!(exit_code);
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("fsdp-agent.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec(&json).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(&tmp, path)
}

/// The summary printed when a group fails: the first observed failure is the root cause.
/// `python`: the workers run Python (where `@record` can help).
pub fn summary(
    entrypoint: &str,
    python: bool,
    attempt: u32,
    host: &str,
    failures: &[Failure],
) -> String {
    let bar = "=".repeat(72);
    let mut out = format!("{bar}\n{entrypoint} FAILED (attempt {attempt})\n");
    let mut sorted: Vec<&Failure> = failures.iter().collect();
    sorted.sort_by_key(|f| f.at);
    let describe = |f: &Failure| {
        let mut s = format!(
            "  rank {} (local_rank {}, host {host}, pid {}): {}\n",
            f.rank, f.local_rank, f.pid, f.exit
        );
        match &f.error_file {
            Some(p) => match &f.report {
                Some(report) => {
                    s += &format!(
                        "  error_file: {}\n  message: {}\n",
                        p.display(),
                        report.message
                    );
                    if let Some(tb) = &report.traceback {
                        for line in tb.lines() {
                            s += &format!("    {line}\n");
                        }
                    }
                }
                None if record_would_help(python, f.exit, &f.stderr_tail) => {
                    s += "  error_file: <N/A> (decorate the worker's main with torch.distributed.elastic.multiprocessing.errors.record to get one)\n"
                }
                None => s += "  error_file: <N/A>\n",
            },
            None => s += "  error_file: <N/A>\n",
        }
        if f.report.is_none() && !f.stderr_tail.is_empty() {
            s += "  last lines of its stderr:\n";
            for line in &f.stderr_tail {
                s += &format!("    {line}\n");
            }
        }
        s
    };
    if let Some((root, rest)) = sorted.split_first() {
        out += "Root cause (first observed failure):\n";
        out += &describe(root);
        if !rest.is_empty() {
            out += "Other failures:\n";
            for f in rest {
                out += &describe(f);
            }
        }
    }
    out += &bar;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn failure(rank: u32, secs: u64, exit: WorkerExit, file: Option<PathBuf>) -> Failure {
        let report = file.as_deref().and_then(read_error_file);
        Failure {
            local_rank: rank,
            rank: rank + 10,
            pid: 100 + rank,
            exit,
            at: SystemTime::UNIX_EPOCH + Duration::from_secs(secs),
            error_file: file,
            report,
            stderr_tail: Vec::new(),
        }
    }

    #[test]
    fn root_cause_is_the_earliest_failure_with_its_message() {
        let dir = std::env::temp_dir().join(format!("fsdp-failure-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("error.json");
        std::fs::write(
            &file,
            r#"{"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback\n  line 3", "timestamp": "1"}}}"#,
        )
        .unwrap();
        let text = summary(
            "python -u train.py",
            true,
            2,
            "node-a",
            &[
                failure(0, 20, WorkerExit::Signal(9), None),
                failure(1, 10, WorkerExit::Code(7), Some(file)),
            ],
        );
        let root = text.find("Root cause").unwrap();
        let other = text.find("Other failures").unwrap();
        let rank11 = text.find("rank 11").unwrap();
        assert!(root < rank11 && rank11 < other, "{text}");
        assert!(text.contains("exit code 7"), "{text}");
        assert!(text.contains("message: ValueError: boom"), "{text}");
        assert!(text.contains("signal 9 (SIGKILL)"), "{text}");
        assert!(text.contains("attempt 2"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_lost_worker_and_an_unwritten_error_file_are_said_so() {
        let mut f = failure(0, 1, WorkerExit::Lost, None);
        f.error_file = Some(PathBuf::from("/logs/attempt_0/0/error.json"));
        let text = summary("train.py", true, 0, "node-a", &[f]);
        assert!(text.contains("exit status unknown"), "{text}");
        assert!(!text.contains("exit code -1"), "{text}");
        // Lost, not an exception: @record would not have helped.
        assert!(!text.contains("decorate"), "{text}");
    }

    #[test]
    fn the_record_hint_is_given_only_where_it_would_have_helped() {
        let tail = |l: &str| {
            vec![
                "Traceback (most recent call last):".to_owned(),
                l.to_owned(),
            ]
        };
        let code1 = WorkerExit::Code(1);
        assert!(record_would_help(true, code1, &[]));
        assert!(record_would_help(true, code1, &tail("ValueError: boom")));
        assert!(!record_would_help(
            true,
            code1,
            &tail("ModuleNotFoundError: No module named 'x'")
        ));
        assert!(!record_would_help(
            true,
            code1,
            &tail("SyntaxError: invalid syntax")
        ));
        assert!(!record_would_help(false, code1, &[]), "not Python");
        assert!(
            !record_would_help(true, WorkerExit::Code(3), &[]),
            "sys.exit(3)"
        );
        assert!(!record_would_help(true, WorkerExit::Signal(9), &[]));
    }

    #[test]
    fn the_summary_quotes_the_end_of_the_workers_stderr() {
        let tail: Vec<String> = (20..30).map(|i| format!("line {i}")).collect();
        let mut f = failure(0, 1, WorkerExit::Code(1), None);
        f.stderr_tail = tail;
        let text = summary("train.py", true, 0, "node-a", &[f]);
        assert!(
            text.contains("last lines of its stderr:\n    line 20\n"),
            "{text}"
        );
    }

    #[test]
    fn garbage_error_file_is_shown_not_trusted() {
        let dir = std::env::temp_dir().join(format!("fsdp-failure-g-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("error.json");
        std::fs::write(&file, "not json at all\nsecond").unwrap();
        let r = read_error_file(&file).unwrap();
        assert!(r.message.contains("unparsable"));
        assert!(r.message.contains("not json at all"));
        assert!(read_error_file(&dir.join("missing.json")).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
