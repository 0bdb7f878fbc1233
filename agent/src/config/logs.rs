//! Log settings: where worker output goes (files, console, prefixes, filters) and the
//! agent's own log format.

use super::sources::Resolver;
use super::{ConfigError, LogConfig, LogFormat, parse};
use crate::cli::Args;

/// torchrun's variable for the prefix template when `--log-line-prefix-template` is unset.
const PREFIX_TEMPLATE_ENV: &str = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE";

/// torchrun's default prefix of worker lines.
const DEFAULT_PREFIX_TEMPLATE: &str = "[${role_name}${local_rank}]:";

impl Resolver<'_> {
    pub(super) fn logs(&mut self, a: &Args) -> Result<LogConfig, ConfigError> {
        let redirects = self.value("redirects", &a.redirects, parse::stream_spec)?;
        let tee = self.value("tee", &a.tee, parse::stream_spec)?;
        let console_ranks = self.value(
            "local-ranks-filter",
            &a.local_ranks_filter,
            parse::rank_list,
        )?;
        let stdout_filters = self.value(
            "duplicate-stdout-filters",
            &a.duplicate_stdout_filters,
            |s| Ok(parse::filter_list(s)),
        )?;
        let stderr_filters = self.value(
            "duplicate-stderr-filters",
            &a.duplicate_stderr_filters,
            |s| Ok(parse::filter_list(s)),
        )?;
        // The default is not recorded: --print-config shows only a template someone set.
        let chosen = self.flag_or_var(
            "log-line-prefix-template",
            a.log_line_prefix_template.as_deref(),
            PREFIX_TEMPLATE_ENV,
            |t| Ok(t.to_owned()),
        )?;
        let prefixed = chosen.is_some();
        let prefix_template = chosen.unwrap_or_else(|| DEFAULT_PREFIX_TEMPLATE.to_owned());
        match &a.log_dir {
            Some(dir) => self.record_flag("log-dir", dir.display()),
            // Where the logs go is what a person looks for first when a worker fails.
            None => {
                let tmp = (self.env)("TMPDIR").filter(|t| !t.is_empty());
                let tmp = tmp.as_deref().unwrap_or("/tmp").trim_end_matches('/');
                self.record(
                    "log-dir",
                    format!("{tmp}/fsdp-agent-XXXXXXXX (a new directory each start)"),
                    super::Source::Default,
                );
            }
        }
        Ok(LogConfig {
            dir: a.log_dir.clone(),
            redirects,
            tee,
            console_ranks,
            prefix_template,
            prefixed,
            stdout_filters,
            stderr_filters,
        })
    }

    pub(super) fn log_format(&mut self, raw: &str) -> Result<LogFormat, ConfigError> {
        self.value("log-format", raw, |s| match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err("expected text or json".into()),
        })
    }
}
