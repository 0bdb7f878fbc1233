//! The failure policy's settings (`--no-retry-exit-codes`, the restart window,
//! quarantine) and the launcher's error file, resolved in `--print-config` order.

use std::path::PathBuf;

use super::{ConfigError, Resolver, Source, exit_codes, parse, whole_number};
use crate::cli::Args;

impl Resolver<'_> {
    /// `TORCHELASTIC_ERROR_FILE`, where a launcher above this one wants the root cause.
    pub(super) fn launcher_error_file(&mut self) -> Option<PathBuf> {
        let file = (self.env)("TORCHELASTIC_ERROR_FILE")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        if let Some(p) = &file {
            self.record(
                "launcher-error-file",
                p.display(),
                Source::Env("TORCHELASTIC_ERROR_FILE".into()),
            );
        }
        file
    }

    pub(super) fn failure_policy(
        &mut self,
        a: &Args,
    ) -> Result<crate::policy::FailurePolicy, ConfigError> {
        Ok(crate::policy::FailurePolicy {
            no_retry_codes: self.value(
                "no-retry-exit-codes",
                &a.no_retry_exit_codes,
                exit_codes,
            )?,
            no_progress_restarts: self.value(
                "no-progress-restarts",
                &a.no_progress_restarts,
                whole_number,
            )?,
            restart_window: self.value("restart-window", &a.restart_window, |s| match s {
                "" | "run" => Ok(None),
                d => parse::duration(d).map(Some),
            })?,
            quarantine_after: self.value("quarantine-after", &a.quarantine_after, whole_number)?,
            quarantine_for: self.value("quarantine-for", &a.quarantine_for, parse::duration)?,
            machine: self.value("node-name", &a.node_name, |s| {
                // One etcd key segment.
                Ok(match s.trim() {
                    "" => fsdp_rendezvous::hostname(),
                    name => name.to_owned(),
                }
                .replace('/', "_"))
            })?,
        })
    }
}
