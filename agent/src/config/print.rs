//! `--print-config`: the resolved configuration and where each value came from.

use super::{Config, LogFormat, describe};

impl Config {
    /// The printout: a table for people, or one JSON object with `--log-format json`.
    pub fn render(&self) -> String {
        if self.log_format == LogFormat::Json {
            let settings: Vec<serde_json::Value> = self
                .settings
                .iter()
                .map(|s| serde_json::json!({"name": s.name, "value": s.value, "source": describe(&s.source)}))
                .collect();
            let doc = serde_json::json!({
                "run_id": self.run_id,
                "nproc_per_node": self.nproc_per_node,
                "max_restarts": self.max_restarts,
                "settings": settings,
                "warnings": self.warnings,
            });
            return format!("{doc}\n");
        }
        let width = self
            .settings
            .iter()
            .map(|s| s.name.len())
            .max()
            .unwrap_or(0);
        let vwidth = self
            .settings
            .iter()
            .map(|s| s.value.chars().count().min(60))
            .max()
            .unwrap_or(0);
        let mut out = String::new();
        for s in &self.settings {
            out += &format!(
                "{:width$}  {:vwidth$}  ({})\n",
                s.name,
                s.value,
                describe(&s.source)
            );
        }
        for w in &self.warnings {
            out += &format!("warning: {w}\n");
        }
        out
    }
}
