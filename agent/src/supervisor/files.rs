//! The log directory's layout and where each worker stream goes. The decisions are pure
//! functions; [`prepare`] does the file-system work and runs on the log-file thread
//! ([`super::disk`]), never on the runtime.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::LogConfig;

/// Whether this group's log files exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Files {
    /// The attempt directory and the files were made.
    Written,
    /// `--log-dir /dev/null`: redirected streams are discarded.
    DevNull,
    /// The log directory did not answer in time: every stream is treated as neither
    /// redirected nor tee'd, so no output is lost with the files.
    Unavailable,
}

/// Where one worker stream goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Route {
    /// Its own `stdout.log` / `stderr.log`.
    pub file: bool,
    /// The console, prefixed.
    pub console: bool,
    /// The attempt's shared `filtered_*.log`, for lines that match a filter.
    pub filtered: bool,
}

impl Route {
    /// Only the console.
    pub fn console_only(self) -> bool {
        self.console && !self.file && !self.filtered
    }
}

/// The routes of one local rank's stdout and stderr.
pub fn routes(logs: &LogConfig, local_rank: u32, files: Files) -> [Route; 2] {
    let on_console = logs
        .console_ranks
        .as_ref()
        .is_none_or(|r| r.contains(&local_rank));
    let (redirect, tee) = (
        logs.redirects.for_rank(local_rank),
        logs.tee.for_rank(local_rank),
    );
    let route = |redirected: bool, teed: bool, filters: &[String]| {
        let to_file = redirected || teed;
        match files {
            Files::Unavailable => Route {
                console: on_console,
                ..Route::default()
            },
            // A redirected stream leaves the console unless it is also tee'd.
            _ => Route {
                file: to_file && files == Files::Written,
                console: on_console && (!to_file || teed),
                filtered: teed && !filters.is_empty() && files == Files::Written,
            },
        }
    };
    [
        route(redirect.stdout, tee.stdout, &logs.stdout_filters),
        route(redirect.stderr, tee.stderr, &logs.stderr_filters),
    ]
}

/// The files of one attempt, opened.
#[derive(Debug, Default)]
pub struct AttemptFiles {
    /// By local rank: stdout, stderr.
    pub ranks: Vec<[Option<File>; 2]>,
    /// `filtered_stdout.log`, `filtered_stderr.log`, shared by the ranks.
    pub filtered: [Option<Arc<File>>; 2],
}

/// A file-system call in the log directory failed.
pub type PrepareError = (PathBuf, std::io::Error);

/// Empties `dir` if a previous round used it and creates it, a directory per local rank
/// (where the error files go), the files `routes` name, and the filtered copies for the
/// streams that have filters (`filtered`: stdout, stderr). Blocks on a stalled disk.
pub fn prepare(
    dir: &Path,
    routes: &[[Route; 2]],
    filtered: [bool; 2],
) -> Result<AttemptFiles, PrepareError> {
    let at = |path: &Path| {
        let path = path.to_path_buf();
        move |e| (path, e)
    };
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(at(dir))?;
    }
    std::fs::create_dir_all(dir).map_err(at(dir))?;
    let create = |path: PathBuf| File::create(&path).map_err(at(&path));
    let mut files = AttemptFiles::default();
    for (i, name) in ["filtered_stdout.log", "filtered_stderr.log"]
        .into_iter()
        .enumerate()
    {
        if filtered[i] {
            files.filtered[i] = Some(Arc::new(create(dir.join(name))?));
        }
    }
    for (local_rank, rank_routes) in routes.iter().enumerate() {
        let rank_dir = dir.join(local_rank.to_string());
        std::fs::create_dir_all(&rank_dir).map_err(at(&rank_dir))?;
        let mut pair = [None, None];
        for (i, name) in ["stdout.log", "stderr.log"].into_iter().enumerate() {
            if rank_routes[i].file {
                pair[i] = Some(create(rank_dir.join(name))?);
            }
        }
        files.ranks.push(pair);
    }
    Ok(files)
}

/// A local rank's error file, in its directory of the attempt.
pub fn error_file(attempt_dir: &Path, local_rank: u32) -> PathBuf {
    attempt_dir.join(local_rank.to_string()).join("error.json")
}

/// `<base>/<run_id>_<random>`: one directory per agent run, as torchrun lays it out.
pub fn run_log_dir(base: &Path, run_id: &str) -> std::io::Result<PathBuf> {
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let dir = base.join(format!("{run_id}_{suffix}"));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// `attempt_<n>` under the run's log directory. Only the path: the group empties and
/// creates it when it starts, off the runtime thread.
pub fn attempt_dir(run_dir: &Path, attempt: u32) -> std::io::Result<PathBuf> {
    Ok(run_dir.join(format!("attempt_{attempt}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse::stream_spec;

    fn logs(redirects: &str, tee: &str, filters: &[&str]) -> LogConfig {
        LogConfig {
            dir: None,
            redirects: stream_spec(redirects).unwrap(),
            tee: stream_spec(tee).unwrap(),
            console_ranks: Some([0].into()),
            prefix_template: String::new(),
            prefixed: false,
            stdout_filters: filters.iter().map(|s| s.to_string()).collect(),
            stderr_filters: Vec::new(),
        }
    }

    const FILE: Route = Route {
        file: true,
        console: false,
        filtered: false,
    };
    const CONSOLE: Route = Route {
        file: false,
        console: true,
        filtered: false,
    };
    const NOWHERE: Route = Route {
        file: false,
        console: false,
        filtered: false,
    };

    #[test]
    fn redirected_streams_leave_the_console_and_teed_ones_do_not() {
        let l = logs("1", "2", &[]);
        let [out, err] = routes(&l, 0, Files::Written);
        assert_eq!(out, FILE);
        assert_eq!(
            err,
            Route {
                file: true,
                console: true,
                filtered: false
            }
        );
        // Rank 1 is not on the console: its tee'd stream goes only to the file.
        assert_eq!(routes(&l, 1, Files::Written), [FILE, FILE]);
    }

    #[test]
    fn filtered_copies_are_made_of_teed_streams_with_filters() {
        let [out, err] = routes(&logs("0", "3", &["loss"]), 0, Files::Written);
        assert!(out.filtered && out.console);
        assert!(!err.filtered, "no stderr filters");
        let [out, _] = routes(&logs("1", "0", &["loss"]), 0, Files::Written);
        assert!(!out.filtered, "redirected, not tee'd");
    }

    #[test]
    fn without_files_redirects_discard_and_an_unanswering_disk_keeps_the_console() {
        let l = logs("3", "0", &["loss"]);
        assert_eq!(routes(&l, 0, Files::DevNull), [NOWHERE, NOWHERE]);
        assert_eq!(routes(&l, 0, Files::Unavailable), [CONSOLE, CONSOLE]);
        assert_eq!(routes(&l, 1, Files::Unavailable), [NOWHERE, NOWHERE]);
        let teed = logs("0", "3", &["loss"]);
        assert_eq!(routes(&teed, 0, Files::Unavailable), [CONSOLE, CONSOLE]);
    }

    #[test]
    fn prepare_empties_a_used_attempt_directory_and_opens_what_the_routes_name() {
        let base = std::env::temp_dir().join(format!("fsdp-files-{}", std::process::id()));
        let dir = base.join("attempt_0");
        std::fs::create_dir_all(dir.join("0")).unwrap();
        std::fs::write(dir.join("0/stale.log"), "old").unwrap();
        let l = logs("0", "1", &["loss"]);
        let r = [routes(&l, 0, Files::Written), routes(&l, 1, Files::Written)];
        let files = prepare(&dir, &r, [true, false]).unwrap();
        assert!(!dir.join("0/stale.log").exists());
        assert_eq!(files.ranks.len(), 2);
        assert!(files.ranks[0][0].is_some() && files.ranks[0][1].is_none());
        assert!(dir.join("1/stdout.log").exists() && !dir.join("1/stderr.log").exists());
        assert!(files.filtered[0].is_some() && files.filtered[1].is_none());
        assert!(dir.join("filtered_stdout.log").exists());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
