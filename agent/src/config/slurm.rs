//! Under `srun` (`SLURM_JOB_ID` and `SLURM_STEP_ID` set), the flags the user did not give
//! take their values from Slurm, so `srun -N3 fsdp-agent train.py` forms one group of
//! three nodes instead of three trainings of one: `--nnodes` from the step's node count,
//! `--rdzv-id` from the job ID, the c10d backend (none given, several nodes) with its
//! endpoint on the step's first host, `--node-rank` from `SLURM_NODEID` for a static job,
//! `--nproc-per-node` from the GPUs Slurm gave the node. Flags and `PET_*` variables
//! always win. A batch script's own shell (no step ID) is not a step: it is one process
//! on the first node, and nothing is filled in.
//!
//! [`plan`] decides from the environment and what was given, without I/O;
//! [`Resolver::slurm`] applies it before anything is parsed, recording each value's source.

use super::sources::{Resolver, whole_number};
use super::{ConfigError, Source, hostlist, parse};
use crate::cli::Args;

/// What the user gave (flag or `PET_*` variable) among the values Slurm can fill.
#[derive(Debug, Default, Clone)]
pub(super) struct Given<'a> {
    pub nnodes: Option<&'a str>,
    pub backend: Option<&'a str>,
    pub endpoint: Option<&'a str>,
    pub rdzv_id: bool,
    pub node_rank: bool,
    pub nproc_per_node: bool,
    pub master_addr: bool,
    /// `--rdzv-conf` has `is_host`.
    pub is_host: bool,
    pub signals: bool,
}

/// The flags Slurm can fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Flag {
    Nnodes,
    RdzvId,
    RdzvBackend,
    RdzvEndpoint,
    NodeRank,
    NprocPerNode,
    SignalsToHandle,
}

impl Flag {
    /// The flag's long name, as the resolved configuration names its source.
    pub(super) fn name(self) -> &'static str {
        match self {
            Flag::Nnodes => "nnodes",
            Flag::RdzvId => "rdzv-id",
            Flag::RdzvBackend => "rdzv-backend",
            Flag::RdzvEndpoint => "rdzv-endpoint",
            Flag::NodeRank => "node-rank",
            Flag::NprocPerNode => "nproc-per-node",
            Flag::SignalsToHandle => "signals-to-handle",
        }
    }

    /// Gives the flag `value` in `a`, as if the user had passed it.
    fn set(self, a: &mut Args, value: String) {
        match self {
            Flag::Nnodes => a.nnodes = value,
            Flag::RdzvId => a.rdzv_id = Some(value),
            Flag::RdzvBackend => a.rdzv_backend = value,
            Flag::RdzvEndpoint => a.rdzv_endpoint = value,
            Flag::NodeRank => a.node_rank = value,
            Flag::NprocPerNode => a.nproc_per_node = value,
            Flag::SignalsToHandle => a.signals_to_handle = value,
        }
    }
}

/// One flag's value taken from Slurm, and where from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Fill {
    pub flag: Flag,
    pub value: String,
    pub source: Source,
}

/// Everything Slurm fills in for this node.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Plan {
    pub fills: Vec<Fill>,
    /// The c10d store's `is_host`: whether this node is the endpoint's host, when the
    /// endpoint names a node of the step. All "nodes" may share one address (a test
    /// cluster, or several steps on one machine), and then the first to bind would serve.
    pub is_host: Option<(bool, Source)>,
}

/// Why `srun` must start one agent per node, as the error says it.
fn one_task_per_node(var: &str, value: &str) -> String {
    format!(
        "srun started more than one fsdp-agent on a node ({var}={value}): the agent is one per node and starts --nproc-per-node workers itself; run srun with --ntasks-per-node=1"
    )
}

/// The most tasks on one node: `SLURM_STEP_TASKS_PER_NODE` (`2(x3),1`), else
/// `SLURM_NTASKS_PER_NODE`, the job's request the step inherits.
fn tasks_per_node(env: &dyn Fn(&str) -> Option<String>) -> Result<(), String> {
    for var in ["SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"] {
        let Some(value) = env(var) else { continue };
        let most = value
            .split(',')
            .filter_map(|item| item.split('(').next()?.trim().parse::<u32>().ok())
            .max()
            .unwrap_or(1);
        if most > 1 {
            return Err(one_task_per_node(var, &value));
        }
        return Ok(());
    }
    Ok(())
}

/// The first of two variables that is set: (name, value).
fn first_of(env: &dyn Fn(&str) -> Option<String>, a: &str, b: &str) -> Option<(String, String)> {
    [a, b].into_iter().find_map(|v| {
        env(v)
            .filter(|s| !s.trim().is_empty())
            .map(|s| (v.to_owned(), s))
    })
}

/// torchrun's default list, and Slurm's warning signals.
pub(super) const SLURM_SIGNALS: &str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2";

/// What Slurm fills in, given the environment and what the user gave. Empty outside a
/// step. An error is a step the agent cannot run in (several agents per node) or a
/// variable it cannot read.
pub(super) fn plan(env: &dyn Fn(&str) -> Option<String>, given: &Given) -> Result<Plan, String> {
    let (Some(job_id), Some(_)) = (env("SLURM_JOB_ID"), env("SLURM_STEP_ID")) else {
        return Ok(Plan::default());
    };
    let mut fills = Vec::new();
    let nnodes = nnodes(env, given, &mut fills)?;
    let several = parse::nnodes(&nnodes).is_ok_and(|(_, max)| max > 1);
    if !given.rdzv_id {
        let source = Source::Env("SLURM_JOB_ID".into());
        fills.push(Fill::new(Flag::RdzvId, job_id.trim().to_owned(), source));
    }
    let backend = backend(given, several, &mut fills);
    let nodes = NodeList::from_env(env)?;
    let endpoint = endpoint(given, &backend, several, nodes.as_ref(), &mut fills);
    if backend == "static" && several && !given.node_rank {
        node_rank(env, &mut fills)?;
    }
    if !given.nproc_per_node {
        nproc_per_node(env, &mut fills)?;
    }
    let is_host = match (&endpoint, &nodes, env("SLURMD_NODENAME")) {
        (Some(e), Some(nodes), Some(me)) if backend == "c10d" && !given.is_host => {
            nodes.is_host(e, &me)
        }
        _ => None,
    };

    // Several agents on one node only matter when Slurm shapes the group: each would
    // count as a node. Given every value, the user has said what they run.
    if !fills.is_empty() {
        tasks_per_node(env)?;
    }

    // Slurm warns of a pre-emption or the time limit with the signal of `sbatch
    // --signal`, SIGUSR1 or SIGUSR2 by convention; an agent not handling it would die of
    // it (their default action) and take its workers with it, checkpoint unsaved.
    if !given.signals {
        let source = Source::Derived(
            "Slurm: sbatch --signal warns with SIGUSR1 or SIGUSR2 by convention; the agent passes them to the workers".into(),
        );
        fills.push(Fill::new(
            Flag::SignalsToHandle,
            SLURM_SIGNALS.into(),
            source,
        ));
    }
    Ok(Plan { fills, is_host })
}

/// This node's place in the network from Slurm's topology, as a segment: the switches of
/// `SLURM_TOPOLOGY_ADDR` (`s0.s1.node7`, set by the topology/tree plugin, widest first),
/// without the node itself, written `s0/s1`. `SLURM_TOPOLOGY_ADDR_PATTERN`
/// (`switch.switch.node`) says which names are switches; without it the last name is the
/// node (Slurm ends the path with it). Nodes under one leaf switch then share a segment,
/// which `--segment-size` counts blocks in; the node's own name would make each node a
/// segment of one. `None` outside a step, without the variable, or for a node under no
/// switch.
pub(super) fn segment(
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<(String, Source)>, String> {
    if env("SLURM_JOB_ID").is_none() || env("SLURM_STEP_ID").is_none() {
        return Ok(None);
    }
    let Some(addr) = env("SLURM_TOPOLOGY_ADDR").filter(|a| !a.trim().is_empty()) else {
        return Ok(None);
    };
    let addr = addr.trim();
    let names: Vec<&str> = addr.split('.').collect();
    let pattern = env("SLURM_TOPOLOGY_ADDR_PATTERN").filter(|p| !p.trim().is_empty());
    let fix = "give this node's place with --rdzv-conf segment=PATH (e.g. spine0/leaf3)";
    let switches: Vec<&str> = match &pattern {
        Some(pattern) => {
            let kinds: Vec<&str> = pattern.trim().split('.').collect();
            if kinds.len() != names.len() {
                return Err(format!(
                    "SLURM_TOPOLOGY_ADDR={addr} has {} names but SLURM_TOPOLOGY_ADDR_PATTERN={} has {} kinds, so which are switches is unknown; {fix}",
                    names.len(),
                    pattern.trim(),
                    kinds.len()
                ));
            }
            names
                .iter()
                .zip(kinds)
                .filter(|(_, kind)| *kind != "node")
                .map(|(name, _)| *name)
                .collect()
        }
        None => names[..names.len() - 1].to_vec(),
    };
    if switches.is_empty() {
        return Ok(None);
    }
    let segment = switches.join("/");
    fsdp_rendezvous::topology::check(&segment).map_err(|e| {
        format!("SLURM_TOPOLOGY_ADDR={addr} makes segment '{segment}', which {e}; {fix}")
    })?;
    let source = Source::Derived(format!(
        "Slurm: the switches above this node in SLURM_TOPOLOGY_ADDR={addr}"
    ));
    Ok(Some((segment, source)))
}

impl Fill {
    fn new(flag: Flag, value: String, source: Source) -> Self {
        Fill {
            flag,
            value,
            source,
        }
    }
}

/// The node count: the user's, else the step's (or job's), else one.
fn nnodes(
    env: &dyn Fn(&str) -> Option<String>,
    given: &Given,
    fills: &mut Vec<Fill>,
) -> Result<String, String> {
    if let Some(n) = given.nnodes {
        return Ok(n.to_owned());
    }
    let Some((var, n)) = first_of(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES") else {
        return Ok("1".to_owned());
    };
    let n = n.trim().to_owned();
    whole_number(&n).map_err(|e| format!("{var}={n}: {e}"))?;
    fills.push(Fill::new(Flag::Nnodes, n.clone(), Source::Env(var)));
    Ok(n)
}

/// The rendezvous backend, lowercase: the user's, else c10d for several nodes (their
/// agents must meet somewhere), else static.
fn backend(given: &Given, several: bool, fills: &mut Vec<Fill>) -> String {
    match given.backend {
        Some(b) => b.trim().to_ascii_lowercase(),
        None if several => {
            let source = Source::Derived(
                "Slurm: a step of several nodes and no backend given (the store served by the first node's agent)".into(),
            );
            fills.push(Fill::new(Flag::RdzvBackend, "c10d".into(), source));
            "c10d".into()
        }
        None => "static".into(),
    }
}

/// The step's (or job's) node list, with its first host.
struct NodeList {
    var: String,
    list: String,
    first: String,
}

impl NodeList {
    /// Only the first host is built, and the list matched against, never expanded.
    fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>, String> {
        let Some((var, list)) = first_of(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") else {
            return Ok(None);
        };
        let first = hostlist::first(&list).map_err(|e| format!("{var}: {e}"))?;
        Ok(Some(NodeList { var, list, first }))
    }

    /// The first host, with a source saying what it was taken for (`what`, e.g.
    /// `", the master"`).
    fn first_host(&self, what: &str) -> (String, Source) {
        let NodeList { var, list, first } = self;
        let source = Source::Derived(format!("Slurm: first host of {var}={list}{what}"));
        (first.clone(), source)
    }

    /// Whether node `me` is the host of `endpoint`; `None` when the endpoint names no
    /// node of the list.
    fn is_host(&self, endpoint: &str, me: &str) -> Option<(bool, Source)> {
        let host = parse::split_host_port(endpoint)
            .map(|(h, _)| h)
            .unwrap_or_default();
        // The list was checked when its first host was read.
        hostlist::contains(&self.list, &host)
            .unwrap_or(false)
            .then(|| {
                let here = host == me;
                let how = if here { "is" } else { "is not" };
                (
                    here,
                    Source::Derived(format!(
                        "Slurm: this node (SLURMD_NODENAME={me}) {how} the endpoint's host"
                    )),
                )
            })
    }
}

/// The rendezvous endpoint: the user's, else for several nodes the first host (c10d's
/// store, or static's master unless `--master-addr` names it).
fn endpoint(
    given: &Given,
    backend: &str,
    several: bool,
    nodes: Option<&NodeList>,
    fills: &mut Vec<Fill>,
) -> Option<String> {
    if let Some(e) = given.endpoint {
        return Some(e.to_owned());
    }
    let nodes = nodes.filter(|_| several)?;
    let (value, source) = match backend {
        "c10d" => {
            let (h, source) = nodes.first_host(", c10d's port");
            (format!("{h}:{}", fsdp_store::DEFAULT_PORT), source)
        }
        "static" if !given.master_addr => nodes.first_host(", the master"),
        _ => return None,
    };
    fills.push(Fill::new(Flag::RdzvEndpoint, value.clone(), source));
    Some(value)
}

/// A static job's node rank, from `SLURM_NODEID` when Slurm sets it.
fn node_rank(env: &dyn Fn(&str) -> Option<String>, fills: &mut Vec<Fill>) -> Result<(), String> {
    let Some(rank) = env("SLURM_NODEID") else {
        return Ok(());
    };
    let rank = rank.trim().to_owned();
    whole_number(&rank).map_err(|e| format!("SLURM_NODEID={rank}: {e}"))?;
    let source = Source::Env("SLURM_NODEID".into());
    fills.push(Fill::new(Flag::NodeRank, rank, source));
    Ok(())
}

/// The worker count, from the GPUs Slurm gave this node.
fn nproc_per_node(
    env: &dyn Fn(&str) -> Option<String>,
    fills: &mut Vec<Fill>,
) -> Result<(), String> {
    let Some(gpus) = env("SLURM_GPUS_ON_NODE") else {
        return Ok(());
    };
    let gpus = gpus.trim().to_owned();
    match whole_number(&gpus) {
        Ok(n) if n > 0 && n <= fsdp_rendezvous::ranks::MAX_LOCAL_WORLD_SIZE => {
            let source = Source::Env("SLURM_GPUS_ON_NODE".into());
            fills.push(Fill::new(Flag::NprocPerNode, gpus, source));
            Ok(())
        }
        // No GPU on this node: the default count stands.
        Ok(0) => Ok(()),
        // Slurm writes a count; anything else (`-1`, `gpu:8`) was ignored without
        // a word, and the node then ran one worker.
        _ => Err(format!(
            "SLURM_GPUS_ON_NODE={gpus} is not a number of GPUs; give --nproc-per-node"
        )),
    }
}

impl Resolver<'_> {
    /// Fills the flags the user did not give from Slurm ([`plan`]); what it filled is
    /// recorded with Slurm as its source. Returns the c10d `is_host` to apply once
    /// `--rdzv-conf` is parsed.
    pub(super) fn slurm(&mut self, a: &mut Args) -> Result<Option<(bool, Source)>, ConfigError> {
        let given_str = |r: &Self, name: &str, v: &str| r.explicit(name).then(|| v.to_owned());
        let nnodes = given_str(self, "nnodes", &a.nnodes);
        let backend = given_str(self, "rdzv-backend", &a.rdzv_backend);
        let endpoint = given_str(self, "rdzv-endpoint", &a.rdzv_endpoint);
        let given = Given {
            nnodes: nnodes.as_deref(),
            backend: backend.as_deref(),
            endpoint: endpoint.as_deref(),
            rdzv_id: a.rdzv_id.is_some(),
            node_rank: self.explicit("node-rank"),
            nproc_per_node: self.explicit("nproc-per-node"),
            master_addr: self.explicit("master-addr"),
            is_host: parse::rdzv_conf(&a.rdzv_conf).is_ok_and(|c| c.contains_key("is_host")),
            signals: self.explicit("signals-to-handle"),
        };
        let plan = plan(self.env, &given).map_err(ConfigError::Conflict)?;
        for f in plan.fills {
            f.flag.set(a, f.value);
            self.filled.push((f.flag.name(), f.source));
        }
        Ok(plan.is_host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step of three nodes as `srun -N3` starts it, seen from node `me`.
    fn step(me: &str) -> Vec<(&'static str, String)> {
        vec![
            ("SLURM_JOB_ID", "42".into()),
            ("SLURM_STEP_ID", "0".into()),
            ("SLURM_STEP_NUM_NODES", "3".into()),
            ("SLURM_JOB_NUM_NODES", "3".into()),
            ("SLURM_STEP_NODELIST", "gpu-[007-009]".into()),
            ("SLURM_NODEID", "1".into()),
            ("SLURM_STEP_TASKS_PER_NODE", "1(x3)".into()),
            ("SLURMD_NODENAME", me.into()),
        ]
    }

    fn plan_in(env: &[(&'static str, String)], given: &Given) -> Result<Plan, String> {
        let env = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        plan(&env, given)
    }

    /// The values that shape the group (the signals have their own test).
    fn filled(p: &Plan) -> Vec<(&str, &str)> {
        p.fills
            .iter()
            .filter(|f| f.flag != Flag::SignalsToHandle)
            .map(|f| (f.flag.name(), f.value.as_str()))
            .collect()
    }

    fn signals(p: &Plan) -> Option<&str> {
        p.fills
            .iter()
            .find(|f| f.flag == Flag::SignalsToHandle)
            .map(|f| f.value.as_str())
    }

    #[test]
    fn in_a_step_slurms_warning_signals_are_handled_unless_the_user_chose() {
        let p = plan_in(&step("gpu-008"), &Given::default()).unwrap();
        assert_eq!(signals(&p), Some(SLURM_SIGNALS));
        assert!(SLURM_SIGNALS.starts_with("SIGTERM,SIGINT,SIGHUP,SIGQUIT,"));
        let given = Given {
            signals: true,
            ..Given::default()
        };
        assert_eq!(signals(&plan_in(&step("gpu-008"), &given).unwrap()), None);
        let batch = [("SLURM_JOB_ID", "42".to_owned())];
        assert_eq!(signals(&plan_in(&batch, &Given::default()).unwrap()), None);
    }

    #[test]
    fn outside_a_step_nothing_is_filled() {
        assert_eq!(plan_in(&[], &Given::default()), Ok(Plan::default()));
        // A batch script's own shell: a job, no step.
        let batch = [("SLURM_JOB_ID", "42".to_owned())];
        assert_eq!(plan_in(&batch, &Given::default()), Ok(Plan::default()));
    }

    #[test]
    fn a_step_of_three_nodes_is_one_c10d_group_on_its_first_host() {
        let p = plan_in(&step("gpu-008"), &Given::default()).unwrap();
        assert_eq!(
            filled(&p),
            [
                ("nnodes", "3"),
                ("rdzv-id", "42"),
                ("rdzv-backend", "c10d"),
                ("rdzv-endpoint", "gpu-007:29400"),
            ]
        );
        assert_eq!(
            p.fills[0].source,
            Source::Env("SLURM_STEP_NUM_NODES".into())
        );
        assert!(
            matches!(&p.fills[3].source, Source::Derived(d) if d.contains("SLURM_STEP_NODELIST=gpu-[007-009]"))
        );
        assert_eq!(p.is_host.map(|h| h.0), Some(false));
        let first = plan_in(&step("gpu-007"), &Given::default()).unwrap();
        assert_eq!(first.is_host.map(|h| h.0), Some(true));
    }

    #[test]
    fn the_jobs_values_stand_in_for_the_steps() {
        let env: Vec<_> = step("gpu-007")
            .into_iter()
            .filter(|(k, _)| !k.starts_with("SLURM_STEP_") || *k == "SLURM_STEP_ID")
            .chain([("SLURM_JOB_NODELIST", "a,b[1-2]".to_owned())])
            .collect();
        let p = plan_in(&env, &Given::default()).unwrap();
        assert!(filled(&p).contains(&("rdzv-endpoint", "a:29400")));
        assert_eq!(p.fills[0].source, Source::Env("SLURM_JOB_NUM_NODES".into()));
    }

    #[test]
    fn what_the_user_gave_wins() {
        let given = Given {
            nnodes: Some("2:3"),
            backend: Some("etcd"),
            endpoint: Some("etcd-host:2379"),
            rdzv_id: true,
            nproc_per_node: true,
            ..Given::default()
        };
        let mut env = step("gpu-007");
        env.push(("SLURM_GPUS_ON_NODE", "8".into()));
        let p = plan_in(&env, &given).unwrap();
        assert_eq!(filled(&p), []);
        assert_eq!(p.is_host, None);
        // An endpoint given on a step node still decides who serves it.
        let given = Given {
            endpoint: Some("gpu-009"),
            ..Given::default()
        };
        let p = plan_in(&step("gpu-009"), &given).unwrap();
        assert!(!filled(&p).iter().any(|(f, _)| *f == "rdzv-endpoint"));
        assert_eq!(p.is_host.map(|h| h.0), Some(true));
        // is_host in --rdzv-conf is the user's.
        let given = Given {
            is_host: true,
            ..Given::default()
        };
        assert_eq!(plan_in(&step("gpu-007"), &given).unwrap().is_host, None);
    }

    #[test]
    fn a_static_job_takes_its_rank_and_master_from_slurm() {
        let given = Given {
            backend: Some("static"),
            ..Given::default()
        };
        let p = plan_in(&step("gpu-008"), &given).unwrap();
        assert_eq!(
            filled(&p),
            [
                ("nnodes", "3"),
                ("rdzv-id", "42"),
                ("rdzv-endpoint", "gpu-007"),
                ("node-rank", "1"),
            ]
        );
        let given = Given {
            backend: Some("static"),
            master_addr: true,
            node_rank: true,
            ..Given::default()
        };
        let p = plan_in(&step("gpu-008"), &given).unwrap();
        assert_eq!(filled(&p), [("nnodes", "3"), ("rdzv-id", "42")]);
    }

    #[test]
    fn one_node_stays_standalone_and_gpus_set_the_worker_count() {
        let env = vec![
            ("SLURM_JOB_ID", "7".to_owned()),
            ("SLURM_STEP_ID", "0".into()),
            ("SLURM_STEP_NUM_NODES", "1".into()),
            ("SLURM_STEP_NODELIST", "n1".into()),
            ("SLURM_GPUS_ON_NODE", "4".into()),
        ];
        let p = plan_in(&env, &Given::default()).unwrap();
        assert_eq!(
            filled(&p),
            [("nnodes", "1"), ("rdzv-id", "7"), ("nproc-per-node", "4")]
        );
    }

    #[test]
    fn several_agents_per_node_are_refused_naming_the_fix() {
        let mut env = step("gpu-007");
        env.retain(|(k, _)| *k != "SLURM_STEP_TASKS_PER_NODE");
        env.push(("SLURM_STEP_TASKS_PER_NODE", "2(x2),1".into()));
        let err = plan_in(&env, &Given::default()).unwrap_err();
        assert!(err.contains("--ntasks-per-node=1"), "{err}");
        assert!(err.contains("SLURM_STEP_TASKS_PER_NODE=2(x2),1"), "{err}");
        assert!(!err.contains('\n'));
        env.retain(|(k, _)| *k != "SLURM_STEP_TASKS_PER_NODE");
        env.push(("SLURM_NTASKS_PER_NODE", "8".into()));
        assert!(plan_in(&env, &Given::default()).is_err());
        // The step's own count is the truth: srun --ntasks-per-node=1 in an 8-per-node job.
        env.push(("SLURM_STEP_TASKS_PER_NODE", "1(x3)".into()));
        assert!(plan_in(&env, &Given::default()).is_ok());
    }

    fn segment_in(env: &[(&'static str, String)]) -> Result<Option<String>, String> {
        let env = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        segment(&env).map(|s| s.map(|(segment, _)| segment))
    }

    #[test]
    fn the_switches_above_a_node_are_its_segment() {
        let mut env = step("gpu-008");
        assert_eq!(segment_in(&env), Ok(None), "no topology plugin");
        env.push(("SLURM_TOPOLOGY_ADDR", "core.spine1.leaf3.gpu-008".into()));
        assert_eq!(segment_in(&env), Ok(Some("core/spine1/leaf3".to_owned())));
        env.push((
            "SLURM_TOPOLOGY_ADDR_PATTERN",
            "switch.switch.switch.node".into(),
        ));
        assert_eq!(segment_in(&env), Ok(Some("core/spine1/leaf3".to_owned())));
        let p = segment(&|k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()));
        assert!(
            matches!(p, Ok(Some((_, Source::Derived(d)))) if d.contains("SLURM_TOPOLOGY_ADDR=core.spine1.leaf3.gpu-008"))
        );
        // A node under no switch has no place to tell.
        let alone = [
            ("SLURM_JOB_ID", "42".to_owned()),
            ("SLURM_STEP_ID", "0".into()),
            ("SLURM_TOPOLOGY_ADDR", "gpu-008".into()),
            ("SLURM_TOPOLOGY_ADDR_PATTERN", "node".into()),
        ];
        assert_eq!(segment_in(&alone), Ok(None));
        // A batch script's shell is no step: nothing is taken.
        let batch = [
            ("SLURM_JOB_ID", "42".to_owned()),
            ("SLURM_TOPOLOGY_ADDR", "s0.n1".into()),
        ];
        assert_eq!(segment_in(&batch), Ok(None));
    }

    #[test]
    fn a_topology_that_does_not_add_up_names_both_variables_and_the_fix() {
        let mut env = step("gpu-008");
        env.push(("SLURM_TOPOLOGY_ADDR", "s0.s1.gpu-008".into()));
        env.push(("SLURM_TOPOLOGY_ADDR_PATTERN", "switch.node".into()));
        let e = segment_in(&env).unwrap_err();
        assert!(e.contains("SLURM_TOPOLOGY_ADDR=s0.s1.gpu-008"), "{e}");
        assert!(e.contains("SLURM_TOPOLOGY_ADDR_PATTERN=switch.node"), "{e}");
        assert!(e.contains("--rdzv-conf segment=PATH"), "{e}");
        let mut env = step("gpu-008");
        env.push(("SLURM_TOPOLOGY_ADDR", "s0..gpu-008".into()));
        let e = segment_in(&env).unwrap_err();
        assert!(e.contains("empty name"), "{e}");
    }

    #[test]
    fn a_malformed_node_list_names_its_variable() {
        let mut env = step("gpu-007");
        env.retain(|(k, _)| *k != "SLURM_STEP_NODELIST");
        env.push(("SLURM_STEP_NODELIST", "gpu-[007-".into()));
        let err = plan_in(&env, &Given::default()).unwrap_err();
        assert!(err.starts_with("SLURM_STEP_NODELIST:"), "{err}");
    }
}
