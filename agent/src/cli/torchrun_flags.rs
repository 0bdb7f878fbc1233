//! torchrun's long flags, as its argparse parser lists them.

/// The long names of every torchrun 2.13 flag, one entry per flag, in the order its
/// parser adds them (argparse names ambiguous candidates in this order).
///
/// This list decides abbreviations (see [`super::abbrev`]), so it is torchrun's and not
/// ours: flags that newer torchrun releases added (`--log-line-prefix-template`,
/// `--print-completion`) are absent from 2.13 and count as fsdp-agent's own here, which
/// keeps `--log-` meaning `--log-dir` as it does under 2.13. The test
/// `agent/tests/cli_torchrun_abbreviations.rs` compares this list with the venv's parser.
pub const TORCHRUN_LONG_FLAGS: &[&[&str]] = &[
    &["--help"],
    &["--nnodes"],
    &["--nproc-per-node", "--nproc_per_node"],
    &["--rdzv-backend", "--rdzv_backend"],
    &["--rdzv-endpoint", "--rdzv_endpoint"],
    &["--rdzv-id", "--rdzv_id"],
    &["--rdzv-conf", "--rdzv_conf"],
    &["--standalone"],
    &["--max-restarts", "--max_restarts"],
    &["--monitor-interval", "--monitor_interval"],
    &["--start-method", "--start_method"],
    &["--event-log-handler", "--event_log_handler"],
    &["--role"],
    &["--module"],
    &["--no-python", "--no_python"],
    &["--run-path", "--run_path"],
    &["--log-dir", "--log_dir"],
    &["--redirects"],
    &["--tee"],
    &["--local-ranks-filter", "--local_ranks_filter"],
    &["--duplicate-stdout-filters", "--duplicate_stdout_filters"],
    &["--duplicate-stderr-filters", "--duplicate_stderr_filters"],
    &["--node-rank", "--node_rank"],
    &["--master-addr", "--master_addr"],
    &["--master-port", "--master_port"],
    &["--local-addr", "--local_addr"],
    &["--logs-specs", "--logs_specs"],
    &["--numa-binding", "--numa_binding"],
    &["--signals-to-handle", "--signals_to_handle"],
    &["--shutdown-timeout", "--shutdown_timeout"],
    &["--virtual-local-rank", "--virtual_local_rank"],
];
