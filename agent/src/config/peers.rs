//! What the etcd rendezvous holds this node's peers to: the records it accepts from them,
//! the restart budget the coordinator enforces, and the job the run must be. All of it
//! follows from flags every agent of a run is given alike, so it is settled here, with the
//! rest of the configuration, and the rendezvous configuration leaves `config` complete
//! but for what only running can tell (the status server's bound port, the c10d store).

use fsdp_rendezvous::etcd::{Allowed, Budget};

use super::etcd::EtcdMode;
use super::{Entrypoint, FailurePolicy};

/// The parts of the configuration the peers' rules follow from.
pub(super) struct Run<'a> {
    pub failure: &'a FailurePolicy,
    pub max_restarts: u32,
    /// `--nproc-per-node` when it was a number (every node is given the same); `None` when
    /// each node counts its own.
    pub nproc: Option<u32>,
    pub entrypoint: &'a Entrypoint,
}

/// Fills in `m`'s rendezvous configuration from `run`.
pub(super) fn complete(m: &mut EtcdMode, run: &Run<'_>) {
    let rc = &mut m.rendezvous;
    rc.allowed = allowed(run);
    rc.budget = Budget {
        max_restarts: Some(run.max_restarts),
        window_s: run.failure.restart_window.map_or(0, |w| w.as_secs()),
    };
    if m.job_check {
        let job = job(run, (rc.min_nodes, rc.max_nodes));
        rc.job = fsdp_rendezvous::job::with_segment_size(job, rc.segment_size);
    }
}

/// What this node accepts from the records others write: what its own rules would write
/// ([`crate::policy::writes`]), as every agent of the run is given the same flags.
fn allowed(run: &Run<'_>) -> Allowed {
    let writes = crate::policy::writes(run.failure);
    let defaults = Allowed::default();
    Allowed {
        workers_per_node: match run.nproc {
            Some(n) => 1..=n,
            None => defaults.workers_per_node.clone(),
        },
        halt_codes: Some(writes.halt_codes),
        // A quarantine is obeyed only as this node's own policy would write it.
        quarantine_for: writes.quarantine.then_some(run.failure.quarantine_for),
        ..defaults
    }
}

/// What makes this agent's job ([`fsdp_rendezvous::job`]): the entrypoint by its file
/// name (the interpreter may live at another path on another node), its arguments,
/// `--nproc-per-node` (a number, or one word for the forms each node counts itself) and
/// `--nnodes`.
fn job(run: &Run<'_>, nnodes: (u32, u32)) -> String {
    let e = run.entrypoint;
    let program = e.program.file_name().map_or_else(
        || e.program.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let nproc = match run.nproc {
        Some(n) => n.to_string(),
        None => "per-node".to_owned(),
    };
    fsdp_rendezvous::job::fingerprint(&program, &e.args, &nproc, nnodes)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn run<'a>(failure: &'a FailurePolicy, entrypoint: &'a Entrypoint) -> Run<'a> {
        Run {
            failure,
            max_restarts: 3,
            nproc: Some(2),
            entrypoint,
        }
    }

    #[test]
    fn peers_may_halt_and_quarantine_only_as_this_node_would() {
        let e = Entrypoint {
            program: "/usr/bin/python3".into(),
            args: vec!["-u".into(), "train.py".into()],
        };
        let failure = FailurePolicy {
            no_retry_codes: vec![2],
            no_progress_restarts: 3,
            quarantine_after: 0,
            quarantine_for: Duration::from_secs(60),
            ..FailurePolicy::default()
        };
        let a = allowed(&run(&failure, &e));
        assert_eq!(
            a.halt_codes,
            Some([2, crate::exit_code::NO_PROGRESS].into())
        );
        assert_eq!(a.quarantine_for, None, "this node never quarantines");
        assert_eq!(a.workers_per_node, 1..=2);
        let blames = FailurePolicy {
            quarantine_after: 3,
            ..failure
        };
        let a = allowed(&run(&blames, &e));
        assert_eq!(a.quarantine_for, Some(Duration::from_secs(60)));
    }

    #[test]
    fn the_job_names_the_program_by_its_file_name() {
        let e = |program: &str| Entrypoint {
            program: program.into(),
            args: vec!["train.py".into()],
        };
        let failure = FailurePolicy::default();
        let (here, there) = (e("/venv/bin/python3"), e("/usr/bin/python3"));
        assert_eq!(
            job(&run(&failure, &here), (1, 2)),
            job(&run(&failure, &there), (1, 2))
        );
        let mut per_node = run(&failure, &here);
        per_node.nproc = None;
        assert_ne!(job(&per_node, (1, 2)), job(&run(&failure, &here), (1, 2)));
    }
}
