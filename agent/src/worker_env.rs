//! The environment of each worker, exactly torchrun's variables.

use std::path::Path;

use fsdp_rendezvous::Round;

/// Inputs that do not change between the workers of one group.
#[derive(Debug, Clone)]
pub struct GroupEnv<'a> {
    pub round: &'a Round,
    pub role: &'a str,
    pub local_world_size: u32,
    pub run_id: &'a str,
    pub max_restarts: u32,
    pub virtual_local_rank: bool,
    /// The agent's own `TORCH_NCCL_ASYNC_ERROR_HANDLING`, if set.
    pub nccl_async_error_handling: Option<&'a str>,
    /// The agent's own `CUDA_VISIBLE_DEVICES`, for `--virtual-local-rank`.
    pub cuda_visible_devices: Option<&'a str>,
    /// Set `OMP_NUM_THREADS=1` (unset in the agent and more than one worker).
    pub omp_threads_default: bool,
    pub signals_to_handle: &'a str,
}

/// The variables to overlay on the agent's environment for worker `local_rank`.
///
/// `TORCHELASTIC_USE_AGENT_STORE` is `False`: the agent does not host a c10d store, so
/// worker rank 0 must create it at `MASTER_ADDR:MASTER_PORT` (with `True`, every worker
/// would connect as a client and wait for a server nobody starts).
pub fn worker_env(
    g: &GroupEnv<'_>,
    local_rank: u32,
    error_file: Option<&Path>,
) -> Vec<(&'static str, String)> {
    let r = g.round;
    let rank = r.base_rank + local_rank;
    let mut env = vec![
        (
            "LOCAL_RANK",
            if g.virtual_local_rank { 0 } else { local_rank }.to_string(),
        ),
        ("RANK", rank.to_string()),
        ("GROUP_RANK", r.group_rank.to_string()),
        // One role per job: role ranks are global ranks.
        ("ROLE_RANK", rank.to_string()),
        ("ROLE_NAME", g.role.to_owned()),
        ("LOCAL_WORLD_SIZE", g.local_world_size.to_string()),
        ("WORLD_SIZE", r.world_size.to_string()),
        ("GROUP_WORLD_SIZE", r.group_world_size.to_string()),
        ("ROLE_WORLD_SIZE", r.world_size.to_string()),
        ("MASTER_ADDR", r.master_addr.clone()),
        ("MASTER_PORT", r.master_port.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", r.restart_count.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS", g.max_restarts.to_string()),
        ("TORCHELASTIC_RUN_ID", g.run_id.to_owned()),
        ("TORCHELASTIC_USE_AGENT_STORE", "False".to_owned()),
        (
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            g.nccl_async_error_handling.unwrap_or("1").to_owned(),
        ),
        (
            "TORCHELASTIC_ERROR_FILE",
            error_file
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        ),
        (
            "TORCHELASTIC_SIGNALS_TO_HANDLE",
            g.signals_to_handle.to_owned(),
        ),
    ];
    if g.omp_threads_default {
        env.push(("OMP_NUM_THREADS", "1".to_owned()));
    }
    if g.virtual_local_rank {
        let device = g
            .cuda_visible_devices
            .filter(|v| !v.is_empty())
            .and_then(|v| v.split(',').nth(local_rank as usize).map(str::to_owned))
            .unwrap_or_else(|| local_rank.to_string());
        env.push(("CUDA_VISIBLE_DEVICES", device));
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round() -> Round {
        Round {
            number: 3,
            group_rank: 1,
            group_world_size: 2,
            base_rank: 4,
            world_size: 8,
            master_addr: "10.0.0.1".into(),
            master_port: 29511,
            restart_count: 2,
            members: Vec::new().into(),
            reason: String::new(),
            charged_at_ms: Vec::new(),
            sealed_at_ms: 0,
            broken: None,
        }
    }

    fn group(round: &Round) -> GroupEnv<'_> {
        GroupEnv {
            round,
            role: "trainer",
            local_world_size: 4,
            run_id: "job42",
            max_restarts: 3,
            virtual_local_rank: false,
            nccl_async_error_handling: None,
            cuda_visible_devices: Some("4,5,6,7"),
            omp_threads_default: true,
            signals_to_handle: "SIGTERM,SIGINT",
        }
    }

    fn get(env: &[(&'static str, String)], k: &str) -> String {
        env.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("{k} missing"))
    }

    #[test]
    fn every_torchrun_variable_for_a_second_node() {
        let r = round();
        let env = worker_env(
            &group(&r),
            2,
            Some(Path::new("/logs/attempt_2/2/error.json")),
        );
        for (k, v) in [
            ("LOCAL_RANK", "2"),
            ("RANK", "6"),
            ("GROUP_RANK", "1"),
            ("ROLE_RANK", "6"),
            ("ROLE_NAME", "trainer"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("WORLD_SIZE", "8"),
            ("GROUP_WORLD_SIZE", "2"),
            ("ROLE_WORLD_SIZE", "8"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29511"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
            ("TORCHELASTIC_RUN_ID", "job42"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ("TORCHELASTIC_ERROR_FILE", "/logs/attempt_2/2/error.json"),
            ("OMP_NUM_THREADS", "1"),
        ] {
            assert_eq!(get(&env, k), v, "{k}");
        }
        assert!(env.iter().all(|(k, _)| *k != "CUDA_VISIBLE_DEVICES"));
    }

    #[test]
    fn virtual_local_rank_pins_one_device() {
        let r = round();
        let mut g = group(&r);
        g.virtual_local_rank = true;
        let env = worker_env(&g, 1, None);
        assert_eq!(get(&env, "LOCAL_RANK"), "0");
        assert_eq!(get(&env, "RANK"), "5");
        assert_eq!(get(&env, "CUDA_VISIBLE_DEVICES"), "5");
        assert_eq!(get(&env, "TORCHELASTIC_ERROR_FILE"), "");
    }

    #[test]
    fn the_agents_nccl_setting_is_kept() {
        let r = round();
        let mut g = group(&r);
        g.nccl_async_error_handling = Some("0");
        g.omp_threads_default = false;
        let env = worker_env(&g, 0, None);
        assert_eq!(get(&env, "TORCH_NCCL_ASYNC_ERROR_HANDLING"), "0");
        assert!(env.iter().all(|(k, _)| *k != "OMP_NUM_THREADS"));
    }
}
