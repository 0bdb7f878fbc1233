//! The agent's exit codes, in one table (also in `docs/exit-codes.md`).
//!
//! | code      | meaning |
//! |-----------|---------|
//! | 0         | the job finished: every worker of this node exited 0 |
//! | 1-255     | a worker's own exit code, when its failure ended the job (restart budget spent) |
//! | 64        | bad command line or configuration (also: etcd refused the credentials or certificate, or the prefix nests in another run); nothing was started |
//! | 66        | `fsdp-agent status`: no run with that id under the prefix |
//! | 69        | the rendezvous is unavailable (e.g. etcd unreachable after the retry window) |
//! | 70        | internal error of the agent (a worker could not be spawned, an I/O error) |
//! | 75        | this node's workers succeeded but other nodes did not finish within the exit barrier |
//! | 76        | restart budget spent and no worker exit of this node to propagate (a peer failed, or a worker's end is unknown) |
//! | 77        | restart budget spent, the last failure of this node a hang (a worker stopped reporting progress) |
//! | 78        | no progress: `--no-progress-restarts` restarts in a row never got past the step reached before (every node exits 78) |
//! | 79        | this node's `--health-check` failed `--health-check-attempts` times in a row: replace the node |
//! | 80        | this node's machine was quarantined by the failure policy (docs/failure-policy.md), or is quarantined |
//! | 101       | the agent panicked: a bug in the agent (its workers die with it, by `PR_SET_PDEATHSIG`) |
//! | 128+n     | the agent itself was stopped by signal n (SIGTERM: 143, SIGINT: 130), or its failed worker was killed by signal n (SIGSEGV: 139), when that failure ended the job |
//!
//! A worker that exits with one of 64, 69, 70, 75, 76 or 128+n makes the agent exit with the same
//! number; the failure summary in the log says which it was. Kubernetes `podFailurePolicy`
//! can retry on 128+n (a pod that was stopped) and fail the job on 76 or 64.

/// Success.
pub const SUCCESS: u8 = 0;
/// Bad command line or configuration (sysexits `EX_USAGE`).
pub const CONFIG: u8 = 64;
/// `fsdp-agent status` found no such run (sysexits `EX_NOINPUT`).
pub const NO_SUCH_RUN: u8 = 66;
/// Rendezvous unavailable (sysexits `EX_UNAVAILABLE`).
pub const RENDEZVOUS_UNAVAILABLE: u8 = 69;
/// Internal error (sysexits `EX_SOFTWARE`).
pub const INTERNAL: u8 = 70;
/// This node finished but its peers did not within the exit barrier (sysexits `EX_TEMPFAIL`).
pub const BARRIER_TIMEOUT: u8 = 75;
/// Restart budget spent and no worker code to propagate: a permanent failure.
pub const BUDGET_EXHAUSTED: u8 = 76;
/// Restart budget spent on a hang.
pub const HUNG: u8 = 77;
/// Restarts that make no progress: the job halts.
pub const NO_PROGRESS: u8 = 78;
/// This node's health check kept failing: replace the node.
pub const UNHEALTHY: u8 = 79;
/// This node's machine was quarantined by the failure policy.
pub const QUARANTINED: u8 = 80;

/// What Rust's runtime exits with when the agent's main thread panics. The agent never
/// chooses it: it is here so that the table of codes is whole (a closed console once
/// made it, `| head` on the agent's stderr).
pub const PANICKED: u8 = 101;

/// Every code the agent itself can end with; a worker's own code and 128+n pass through.
/// Each has its row in docs/exit-codes.md (checked by a test).
pub const ALL: &[u8] = &[
    SUCCESS,
    CONFIG,
    NO_SUCH_RUN,
    RENDEZVOUS_UNAVAILABLE,
    INTERNAL,
    BARRIER_TIMEOUT,
    BUDGET_EXHAUSTED,
    HUNG,
    NO_PROGRESS,
    UNHEALTHY,
    QUARANTINED,
    PANICKED,
];

/// The code for an agent stopped by `signal` (the shell convention).
pub fn signalled(signal: i32) -> u8 {
    (128 + signal).min(255) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first cell of each row of the doc's table: a code, `1–255` or `128+n`.
    fn documented(doc: &str) -> Vec<String> {
        doc.lines()
            .filter_map(|l| l.strip_prefix("| "))
            .filter_map(|l| l.split(" |").next())
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn every_code_the_agent_ends_with_has_its_row_in_the_docs() {
        let doc = include_str!("../../docs/exit-codes.md");
        let rows = documented(doc);
        for code in ALL {
            assert!(
                rows.contains(&code.to_string()),
                "exit code {code} has no row in docs/exit-codes.md (rows: {rows:?})"
            );
        }
        let module = include_str!("exit_code.rs");
        for code in ALL {
            assert!(
                module.contains(&format!("//! | {code:<9} |")),
                "exit code {code} has no row in exit_code.rs's own table"
            );
        }
    }

    #[test]
    fn a_documented_code_is_one_the_agent_can_end_with() {
        let doc = include_str!("../../docs/exit-codes.md");
        for row in documented(doc) {
            if let Ok(code) = row.parse::<u8>() {
                assert!(
                    ALL.contains(&code),
                    "docs/exit-codes.md documents {code}, which the agent never uses"
                );
            }
        }
    }
}
