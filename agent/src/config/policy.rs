//! The failure policy's settings (`--no-retry-exit-codes`, the restart window,
//! quarantine) and the launcher's error file, resolved in `--print-config` order.

use std::path::PathBuf;
use std::time::Duration;

use super::{ConfigError, Resolver, Source, exit_codes, parse, whole_number};
use crate::cli::Args;

/// How failures are judged beyond the restart budget: the settings of the rules in
/// [`crate::policy::RULES`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailurePolicy {
    /// Worker exit codes that mean "do not retry": the run halts with the code.
    pub no_retry_codes: Vec<u8>,
    /// Restarts in a row that never get past the best step reached before, after which
    /// the run halts ([`exit_code::NO_PROGRESS`](crate::exit_code::NO_PROGRESS)); 0: never.
    pub no_progress_restarts: u32,
    /// `--max-restarts` counts the restarts charged within this long before a round was
    /// sealed; `None`: over the whole run (torchrun's rule).
    pub restart_window: Option<Duration>,
    /// Failed rounds in a row whose first failure came from one node, after which that
    /// node's machine is quarantined; 0: never.
    pub quarantine_after: u32,
    /// Worker exit codes that mean "this machine is at fault": the node quarantines its
    /// machine and leaves, the restart budget unspent.
    pub quarantine_on_exit: Vec<u8>,
    /// How long a quarantine lasts.
    pub quarantine_for: Duration,
    /// The machine this agent runs on (what a quarantine keeps out).
    pub machine: String,
    /// What a straggler costs (`--straggler-policy`).
    pub straggler: crate::straggler::Policy,
}

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

    pub(super) fn failure_policy(&mut self, a: &Args) -> Result<FailurePolicy, ConfigError> {
        Ok(FailurePolicy {
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
            quarantine_on_exit: self.value(
                "quarantine-on-exit",
                &a.quarantine_on_exit,
                exit_codes,
            )?,
            quarantine_for: self.value("quarantine-for", &a.quarantine_for, parse::duration)?,
            machine: self.value("node-name", &a.node_name, |s| {
                // One etcd key segment.
                Ok(match s.trim() {
                    "" => fsdp_rendezvous::hostname(),
                    name => name.to_owned(),
                }
                .replace('/', "_"))
            })?,
            straggler: self.value(
                "straggler-policy",
                &a.straggler_policy,
                crate::straggler::Policy::parse,
            )?,
        })
    }
}
