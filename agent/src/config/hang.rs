//! The hang watch's settings (`--hang-timeout`, `--hang-min`): what `crate::hang` judges
//! a group by, parsed and resolved here, so that configuration depends on nothing it
//! configures.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{ConfigError, Resolver, parse};

/// How long a rank may go without progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HangTimeout {
    /// Never judge.
    Off,
    /// A fixed allowance per step.
    Fixed(Duration),
    /// [`AUTO_FACTOR`](crate::hang::AUTO_FACTOR) times the slowest recent step, at least
    /// `min`.
    Auto { min: Duration },
}

/// What [`judge`](crate::hang::judge) needs besides the progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HangConfig {
    pub timeout: HangTimeout,
    /// Until a rank's first step after a (re)start: imports, data loading, compilation.
    pub startup: Duration,
    /// Inside a named phase (a checkpoint): the phase reports where it is.
    pub phase: Duration,
    /// Allowances of particular phases, by name, instead of `phase`.
    pub phases: BTreeMap<String, Duration>,
}

impl HangConfig {
    /// Parses `--hang-timeout`: `auto`, `off` or seconds per step, then optionally
    /// `,startup=D`, `,phase=D` (any phase) and `,<name>=D` (the phase of that name), with
    /// durations as `parse_duration` reads them; `min` is `--hang-min`.
    pub fn parse(
        spec: &str,
        min: Duration,
        parse_duration: impl Fn(&str) -> Result<Duration, String>,
    ) -> Result<Self, String> {
        let mut parts = spec.split(',').map(str::trim);
        let timeout = match parts.next().unwrap_or_default() {
            "auto" => HangTimeout::Auto { min },
            "off" => HangTimeout::Off,
            other => HangTimeout::Fixed(
                parse_duration(other).map_err(|e| format!("{e}; or 'auto' or 'off'"))?,
            ),
        };
        let mut cfg = Self {
            timeout,
            startup: STARTUP,
            phase: PHASE,
            phases: BTreeMap::new(),
        };
        for part in parts {
            let Some((name, value)) = part.split_once('=') else {
                return Err(format!(
                    "'{part}' is not NAME=DURATION (e.g. startup=900, phase=3600, checkpoint=2h)"
                ));
            };
            let (name, value) = (name.trim(), value.trim());
            let d = parse_duration(value).map_err(|e| format!("{name}: {e}"))?;
            match name {
                "startup" => cfg.startup = d,
                "phase" => cfg.phase = d,
                n if n.is_empty() || n.chars().any(char::is_whitespace) || n.len() > 64 => {
                    return Err(format!(
                        "'{n}' is not a phase name (one word of at most 64 characters)"
                    ));
                }
                n => {
                    cfg.phases.insert(n.to_owned(), d);
                }
            }
        }
        Ok(cfg)
    }

    /// The allowance of the phase called `name`.
    pub fn phase_allowance(&self, name: &str) -> Duration {
        self.phases.get(name).copied().unwrap_or(self.phase)
    }
}

/// Until the first steps after a (re)start: imports, data loading, compilation.
pub const STARTUP: Duration = Duration::from_secs(600);
/// Inside a reported phase (a checkpoint, an evaluation).
pub const PHASE: Duration = Duration::from_secs(1800);

impl Resolver<'_> {
    pub(super) fn hang(&mut self, timeout: &str, min: &str) -> Result<HangConfig, ConfigError> {
        let min = self.value("hang-min", min, parse::duration)?;
        self.value("hang-timeout", timeout, |s| {
            HangConfig::parse(s, min, parse::duration)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn secs(s: &str) -> Result<Duration, String> {
        s.parse::<u64>()
            .map(Duration::from_secs)
            .map_err(|_| format!("'{s}' is not a number of seconds"))
    }

    #[test]
    fn the_timeout_spec_sets_the_mode_startup_and_each_phase() {
        let c = HangConfig::parse("auto", 30 * S, secs).unwrap();
        assert_eq!(c.timeout, HangTimeout::Auto { min: 30 * S });
        assert_eq!((c.startup, c.phase), (STARTUP, PHASE));
        let c = HangConfig::parse("120, startup=900,phase=60,checkpoint=7200", S, secs).unwrap();
        assert_eq!(c.timeout, HangTimeout::Fixed(120 * S));
        assert_eq!((c.startup, c.phase), (900 * S, 60 * S));
        assert_eq!(c.phase_allowance("checkpoint"), 7200 * S);
        assert_eq!(c.phase_allowance("eval"), 60 * S);
        for bad in ["soon", "auto,checkpoint", "auto,checkpoint=x", "auto,a b=3"] {
            assert!(HangConfig::parse(bad, S, secs).is_err(), "{bad}");
        }
    }
}
