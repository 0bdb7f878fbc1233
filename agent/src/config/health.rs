//! The health gate's settings (`--health-check` and its timeout, attempts and interval):
//! what `crate::health` runs, resolved here, so that configuration depends on nothing it
//! configures.

use std::time::Duration;

use super::{ConfigError, Resolver, parse, whole_number};
use crate::cli::Args;

/// The health gate's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    /// Run with `sh -c`.
    pub command: String,
    /// How long one check may take.
    pub timeout: Duration,
    /// Failed checks in a row after which the agent exits
    /// [`UNHEALTHY`](crate::exit_code::UNHEALTHY).
    pub attempts: u32,
    /// How often a node waiting for a round (a spare) checks again.
    pub interval: Duration,
}

impl Resolver<'_> {
    pub(super) fn health(&mut self, a: &Args) -> Result<Option<HealthCheck>, ConfigError> {
        let timeout = self.value(
            "health-check-timeout",
            &a.health_check_timeout,
            parse::duration,
        )?;
        let attempts = self.value("health-check-attempts", &a.health_check_attempts, |s| {
            whole_number(s).and_then(|n| {
                if n == 0 {
                    Err("expected at least 1".into())
                } else {
                    Ok(n)
                }
            })
        })?;
        let interval = self.value(
            "health-check-interval",
            &a.health_check_interval,
            parse::duration,
        )?;
        let command = self.value("health-check", &a.health_check, |s| Ok(s.trim().to_owned()))?;
        Ok((!command.is_empty()).then_some(HealthCheck {
            command,
            timeout,
            attempts,
            interval,
        }))
    }
}
