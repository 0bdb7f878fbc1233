//! Where each value comes from: the [`Resolver`] reads clap's matches and the environment
//! seam, records every value with its [`Source`] for `--print-config`, and turns a bad
//! value into an error naming the flag, the value and its origin.

use clap::ArgMatches;
use clap::parser::ValueSource;

use super::{ConfigError, Setting, Source, parse};

/// The state of one resolution: what clap parsed, the environment, and what has been
/// recorded and warned about so far (in the order `--print-config` shows it).
pub(super) struct Resolver<'a> {
    pub(super) command: clap::Command,
    pub(super) matches: ArgMatches,
    pub(super) env: &'a dyn Fn(&str) -> Option<String>,
    /// The directory of the agent's executable as it was invoked (`argv[0]`, not resolved
    /// through links): a venv's `bin` when installed there.
    pub(super) agent_dir: Option<std::path::PathBuf>,
    pub(super) settings: Vec<Setting>,
    pub(super) warnings: Vec<String>,
    /// Flags the user did not give that took their value from Slurm (`super::slurm`),
    /// with where from: for every purpose they count as given.
    pub(super) filled: Vec<(&'static str, Source)>,
    /// The agent's own words as given (abbreviations written out), for the spelling of
    /// each flag ([`Resolver::spelled`]).
    pub(super) typed: Vec<String>,
}

/// The clap id of the flag `--name`: the field name, dashes written as underscores.
fn id(name: &str) -> String {
    name.replace('-', "_")
}

impl Resolver<'_> {
    /// Where the flag `--name` got its value: the command line, clap's `PET_*` variable, or
    /// its default.
    pub(super) fn source(&self, name: &str) -> Source {
        let id = id(name);
        let arg = self.command.get_arguments().find(|a| a.get_id() == &id);
        match self.matches.value_source(&id) {
            Some(ValueSource::CommandLine) => Source::Flag(format!(
                "--{}",
                arg.and_then(|a| self.spelled(a))
                    .or_else(|| arg.and_then(|a| a.get_long()))
                    .unwrap_or(&id)
            )),
            Some(ValueSource::EnvVariable) => Source::Env(
                arg.and_then(|a| a.get_env())
                    .map(|e| e.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            ),
            _ => self
                .filled
                .iter()
                .find(|(flag, _)| *flag == name)
                .map_or(Source::Default, |(_, source)| source.clone()),
        }
    }

    /// How the command line spelled `arg` (its name or one of its aliases, the last one
    /// given): `--shutdown-timeout 5` was reported as `flag --term-timeout`, a flag the
    /// user never typed.
    fn spelled<'c>(&self, arg: &'c clap::Arg) -> Option<&'c str> {
        let names: Vec<&'c str> = arg
            .get_long()
            .into_iter()
            .chain(arg.get_all_aliases().unwrap_or_default())
            .collect();
        self.typed.iter().rev().find_map(|word| {
            let flag = word.strip_prefix("--")?;
            let flag = flag.split_once('=').map_or(flag, |(f, _)| f);
            names.iter().copied().find(|n| *n == flag)
        })
    }

    /// Whether the flag `--name` was given, on the command line or by its variable.
    pub(super) fn explicit(&self, name: &str) -> bool {
        !matches!(self.source(name), Source::Default)
    }

    /// Where the flag `--name` got its value, as error messages say it.
    pub(super) fn origin(&self, name: &str) -> String {
        describe(&self.source(name))
    }

    pub(super) fn record(&mut self, name: &'static str, value: impl ToString, source: Source) {
        self.settings.push(Setting {
            name,
            value: value.to_string(),
            source,
        });
    }

    /// Records the flag `--name` with the source clap gave it.
    pub(super) fn record_flag(&mut self, name: &'static str, value: impl ToString) {
        let source = self.source(name);
        self.record(name, value, source);
    }

    pub(super) fn warn(&mut self, warning: impl Into<String>) {
        self.warnings.push(warning.into());
    }

    /// An error about the value of `--name` that came from clap.
    pub(super) fn invalid(
        &self,
        name: &str,
        value: impl Into<String>,
        reason: impl Into<String>,
    ) -> ConfigError {
        ConfigError::Invalid {
            what: format!("--{name}"),
            value: value.into(),
            origin: self.origin(name),
            reason: reason.into(),
        }
    }

    /// Parses the value of `--name` with `parse`, turning a failure into an error that
    /// names the flag and the origin of the value, and records the result.
    pub(super) fn value<T>(
        &mut self,
        name: &'static str,
        raw: &str,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<T, ConfigError> {
        let parsed = parse(raw).map_err(|reason| self.invalid(name, raw, reason))?;
        self.record_flag(name, raw);
        Ok(parsed)
    }

    /// A boolean flag: on when given, else from its `PET_*` variable (read through the
    /// seam: clap would not take Kubeflow's empty `PET_STANDALONE` as on), else off.
    pub(super) fn flag(
        &mut self,
        name: &'static str,
        on: bool,
        env_name: &str,
    ) -> Result<bool, ConfigError> {
        let (v, source) = if on {
            (true, Source::Flag(format!("--{name}")))
        } else if let Some(raw) = (self.env)(env_name) {
            let v = parse::env_bool(&raw).map_err(|reason| ConfigError::Invalid {
                what: format!("--{name}"),
                value: raw.clone(),
                origin: format!("env {env_name}"),
                reason,
            })?;
            (v, Source::Env(env_name.to_owned()))
        } else {
            (false, Source::Default)
        };
        self.record(name, v, source);
        Ok(v)
    }

    /// A value that clap does not know a variable for: the flag `--name` when given
    /// (`flag`), else the variable `var` read through the seam, parsed and recorded; `None`
    /// when neither is set, with nothing recorded.
    pub(super) fn flag_or_var<T>(
        &mut self,
        name: &'static str,
        flag: Option<&str>,
        var: &str,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<Option<T>, ConfigError> {
        if let Some(raw) = flag {
            return self.value(name, raw, parse).map(Some);
        }
        let Some(raw) = (self.env)(var) else {
            return Ok(None);
        };
        let parsed = parse(&raw).map_err(|reason| ConfigError::Invalid {
            what: format!("--{name}"),
            value: raw.clone(),
            origin: format!("env {var}"),
            reason,
        })?;
        self.record(name, raw, Source::Env(var.to_owned()));
        Ok(Some(parsed))
    }

    /// The source recorded for `name`, for values derived from it.
    pub(super) fn recorded_source(&self, name: &str) -> Source {
        self.settings
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.source.clone())
            .unwrap_or(Source::Default)
    }
}

/// A whole number ≥ 0 (`--max-restarts`, `--node-rank`).
pub(super) fn whole_number(s: &str) -> Result<u32, String> {
    s.trim()
        .parse::<u32>()
        .map_err(|_| "expected a whole number ≥ 0".to_owned())
}

/// A comma-separated list of worker exit codes, 1-255 (`""`: none).
pub(super) fn exit_codes(s: &str) -> Result<Vec<u8>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(|c| {
            c.parse::<u8>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("'{c}' is not an exit code 1-255 (e.g. 2,3)"))
        })
        .collect()
}

pub(crate) fn describe(s: &Source) -> String {
    match s {
        Source::Flag(f) => format!("flag {f}"),
        Source::Env(e) => format!("env {e}"),
        Source::Default => "default".into(),
        Source::Derived(how) => format!("derived: {how}"),
    }
}
