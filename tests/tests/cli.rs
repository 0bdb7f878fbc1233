//! The command line and the worker environment: torchrun's flags, `PET_*` defaults and
//! the variables every worker gets, checked through real worker processes.

use std::time::Duration;

use fsdp_tests::{AgentCmd, TempDir, fake_worker, records, worker_env};

const LIMIT: Duration = Duration::from_secs(60);

/// Runs 2 fake workers that record their environment and returns (dir, agent).
fn run_env(extra: &[&str], env: &[(&str, &str)]) -> (TempDir, fsdp_tests::Agent) {
    let dir = TempDir::new().unwrap();
    let mut cmd = AgentCmd::new(dir.path(), "agent");
    for (k, v) in env {
        cmd = cmd.env(k, v);
    }
    let worker = fake_worker();
    let mut args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    args.extend(["--no-python".into(), worker.display().to_string()]);
    args.extend([
        "--dir".into(),
        dir.path().display().to_string(),
        "--write-env".into(),
    ]);
    let mut agent = cmd.args(&args).run(LIMIT);
    assert_eq!(agent.code(), 0, "{}", agent.output());
    (dir, agent)
}

#[test]
fn every_worker_variable_for_two_workers() {
    let (dir, _agent) = run_env(
        &[
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            "--role",
            "trainer",
        ],
        &[],
    );
    let envs = [worker_env(dir.path(), 0, 0), worker_env(dir.path(), 0, 1)];
    for (rank, env) in envs.iter().enumerate() {
        let r = rank.to_string();
        for (k, v) in [
            ("LOCAL_RANK", r.as_str()),
            ("RANK", &r),
            ("GROUP_RANK", "0"),
            ("ROLE_RANK", &r),
            ("ROLE_NAME", "trainer"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("WORLD_SIZE", "2"),
            ("GROUP_WORLD_SIZE", "1"),
            ("ROLE_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ("OMP_NUM_THREADS", "1"),
            (
                "TORCHELASTIC_SIGNALS_TO_HANDLE",
                "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            ),
        ] {
            assert_eq!(
                env.get(k).map(String::as_str),
                Some(v),
                "{k} of rank {rank}"
            );
        }
        let port: u16 = env["MASTER_PORT"].parse().expect("MASTER_PORT is a port");
        assert_ne!(port, 0);
        assert!(
            env["TORCHELASTIC_ERROR_FILE"].ends_with(&format!("attempt_0/{rank}/error.json")),
            "{}",
            env["TORCHELASTIC_ERROR_FILE"]
        );
    }
    // One run: same run id and master on both workers, a uuid when --rdzv-id is unset.
    assert_eq!(
        envs[0]["TORCHELASTIC_RUN_ID"],
        envs[1]["TORCHELASTIC_RUN_ID"]
    );
    assert_eq!(envs[0]["TORCHELASTIC_RUN_ID"].len(), 36);
    assert_eq!(envs[0]["MASTER_PORT"], envs[1]["MASTER_PORT"]);
}

#[test]
fn agent_environment_is_inherited_and_omp_is_respected() {
    let (dir, _a) = run_env(
        &["--standalone", "--nproc_per_node", "2"],
        &[
            ("OMP_NUM_THREADS", "4"),
            ("MY_SETTING", "kept"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"),
        ],
    );
    let env = worker_env(dir.path(), 0, 1);
    assert_eq!(env["OMP_NUM_THREADS"], "4");
    assert_eq!(env["MY_SETTING"], "kept");
    assert_eq!(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "0");
}

#[test]
fn both_spellings_of_every_multiword_flag_are_accepted() {
    let pairs: &[(&str, &str, &str)] = &[
        ("--nproc-per-node", "--nproc_per_node", "2"),
        ("--max-restarts", "--max_restarts", "1"),
        ("--monitor-interval", "--monitor_interval", "0.5"),
        ("--rdzv-id", "--rdzv_id", "job7"),
        ("--node-rank", "--node_rank", "0"),
        ("--master-addr", "--master_addr", "127.0.0.1"),
        ("--master-port", "--master_port", "29555"),
        ("--log-dir", "--log_dir", "/tmp"),
        ("--local-ranks-filter", "--local_ranks_filter", "0"),
        (
            "--log-line-prefix-template",
            "--log_line_prefix_template",
            "[${rank}]",
        ),
        ("--term-timeout", "--shutdown_timeout", "5"),
        ("--signals-to-handle", "--signals_to_handle", "SIGTERM"),
        ("--start-method", "--start_method", "fork"),
        ("--event-log-handler", "--event_log_handler", "console"),
        ("--rdzv-backend", "--rdzv_backend", "static"),
        ("--rdzv-endpoint", "--rdzv_endpoint", "127.0.0.1:29556"),
        ("--local-addr", "--local_addr", "127.0.0.1"),
        (
            "--duplicate-stdout-filters",
            "--duplicate_stdout_filters",
            "loss",
        ),
        (
            "--duplicate-stderr-filters",
            "--duplicate_stderr_filters",
            "warn",
        ),
    ];
    let dir = TempDir::new().unwrap();
    for (dashed, underscored, value) in pairs {
        let mut printed = Vec::new();
        for flag in [dashed, underscored] {
            // A master address is used (and shown as given) only with a master port: one
            // node without one runs standalone, on localhost.
            let port: &[&str] = match *dashed {
                "--master-addr" => &["--master-port", "29555"],
                _ => &[],
            };
            let mut a = AgentCmd::new(dir.path(), "cfg")
                .args(["--print-config", flag, value])
                .args(port)
                .args(["--no-python", "true"])
                .run(LIMIT);
            assert_eq!(a.code(), 0, "{flag} {value}: {}", a.output());
            let out = a.stdout();
            // The source names the flag as it was typed (`--shutdown_timeout` was shown as
            // `--term-timeout`, a flag never typed); apart from that, the same.
            assert!(
                out.contains(&format!("flag {flag}")),
                "{flag}: source not shown as typed:\n{out}"
            );
            printed.push(
                out.lines()
                    .filter(|l| l.contains("flag --"))
                    .map(|l| l.replace(flag, dashed))
                    .collect::<Vec<_>>(),
            );
        }
        assert_eq!(
            printed[0], printed[1],
            "{dashed} and {underscored} resolve differently"
        );
    }
}

#[test]
fn pet_variables_are_defaults_and_flags_beat_them() {
    let dir = TempDir::new().unwrap();
    let cfg = |env: &[(&str, &str)], args: &[&str]| {
        let mut c = AgentCmd::new(dir.path(), "cfg");
        for (k, v) in env {
            c = c.env(k, v);
        }
        let mut a = c
            .args(["--print-config"])
            .args(args)
            .args(["--no-python", "true"])
            .run(LIMIT);
        assert_eq!(a.code(), 0, "{}", a.output());
        a.stdout()
    };
    let line = |out: &str, name: &str| -> String {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} not printed:\n{out}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    let env = [
        ("PET_NPROC_PER_NODE", "3"),
        ("PET_MAX_RESTARTS", "4"),
        ("PET_RDZV_ID", "from-env"),
        ("PET_ROLE", "envrole"),
        ("PET_STANDALONE", ""),
        ("PET_MONITOR_INTERVAL", "0.2"),
        ("PET_TEE", "3"),
    ];
    let out = cfg(&env, &[]);
    assert_eq!(
        line(&out, "nproc-per-node"),
        "nproc-per-node 3 (env PET_NPROC_PER_NODE)"
    );
    assert_eq!(
        line(&out, "max-restarts"),
        "max-restarts 4 (env PET_MAX_RESTARTS)"
    );
    assert_eq!(line(&out, "rdzv-id"), "rdzv-id from-env (env PET_RDZV_ID)");
    assert_eq!(line(&out, "role"), "role envrole (env PET_ROLE)");
    assert_eq!(
        line(&out, "monitor-interval"),
        "monitor-interval 0.2 (env PET_MONITOR_INTERVAL)"
    );
    assert_eq!(line(&out, "tee"), "tee 3 (env PET_TEE)");
    // Kubeflow sets PET_STANDALONE to the empty string to mean "on".
    assert_eq!(
        line(&out, "standalone"),
        "standalone true (env PET_STANDALONE)"
    );

    let out = cfg(
        &env,
        &[
            "--nproc-per-node",
            "2",
            "--max_restarts",
            "1",
            "--rdzv-id",
            "from-flag",
        ],
    );
    assert_eq!(
        line(&out, "nproc-per-node"),
        "nproc-per-node 2 (flag --nproc-per-node)"
    );
    assert_eq!(
        line(&out, "max-restarts"),
        "max-restarts 1 (flag --max_restarts)"
    );
    assert_eq!(line(&out, "rdzv-id"), "rdzv-id from-flag (flag --rdzv-id)");

    let out = cfg(&[("PET_STANDALONE", "0")], &[]);
    assert_eq!(
        line(&out, "standalone"),
        "standalone false (env PET_STANDALONE)"
    );

    // Kubeflow's elastic mode: etcd-v2 means our etcd v3 rendezvous.
    let out = cfg(
        &[
            ("PET_RDZV_BACKEND", "etcd-v2"),
            ("PET_RDZV_ENDPOINT", "etcd-client:2379"),
            ("PET_RDZV_ID", "job-7"),
            ("PET_NNODES", "1:4"),
            ("PET_MAX_RESTARTS", "3"),
        ],
        &[],
    );
    assert!(
        line(&out, "rendezvous").contains("etcd endpoints=etcd-client:2379 nnodes=1:4"),
        "{out}"
    );
    assert_eq!(line(&out, "rdzv-id"), "rdzv-id job-7 (env PET_RDZV_ID)");

    // Kubeflow's master mode: static group from PET_* alone.
    let out = cfg(
        &[
            ("PET_NNODES", "2"),
            ("PET_NODE_RANK", "1"),
            ("PET_MASTER_ADDR", "job-master-0"),
            ("PET_MASTER_PORT", "23456"),
        ],
        &[],
    );
    assert!(
        line(&out, "rendezvous").contains("static nnodes=2 node_rank=1 master=job-master-0:23456"),
        "{out}"
    );
}

#[test]
fn pet_values_reach_the_workers() {
    let (dir, _a) = run_env(
        &[],
        &[
            ("PET_NPROC_PER_NODE", "2"),
            ("PET_STANDALONE", "1"),
            ("PET_RDZV_ID", "pet-job"),
        ],
    );
    let env = worker_env(dir.path(), 0, 1);
    assert_eq!(env["WORLD_SIZE"], "2");
    assert_eq!(env["TORCHELASTIC_RUN_ID"], "pet-job");
}

#[test]
fn local_rank_macro_and_script_arguments_pass_through() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--no-python",
            "sh",
            "-c",
        ])
        .args([format!(
            "echo \"args=$0 $1 $2\" > {}/args.$LOCAL_RANK",
            dir.path().display()
        )])
        .args(["--lr", "rank${local_rank}", "-x"])
        .run(LIMIT);
    assert_eq!(a.code(), 0, "{}", a.output());
    for r in 0..2 {
        let got = std::fs::read_to_string(dir.path().join(format!("args.{r}"))).unwrap();
        assert_eq!(got.trim(), format!("args=--lr rank{r} -x"));
    }
}

#[test]
fn virtual_local_rank_gives_each_worker_one_device() {
    let (dir, _a) = run_env(
        &[
            "--standalone",
            "--nproc-per-node",
            "2",
            "--virtual-local-rank",
        ],
        &[("CUDA_VISIBLE_DEVICES", "4,6")],
    );
    let (e0, e1) = (worker_env(dir.path(), 0, 0), worker_env(dir.path(), 0, 1));
    assert_eq!(
        (e0["LOCAL_RANK"].as_str(), e1["LOCAL_RANK"].as_str()),
        ("0", "0")
    );
    assert_eq!(
        (
            e0["CUDA_VISIBLE_DEVICES"].as_str(),
            e1["CUDA_VISIBLE_DEVICES"].as_str()
        ),
        ("4", "6")
    );
    assert_eq!(e1["RANK"], "1");
}

/// Bad input: one clear line naming the problem, exit 64, no worker started.
#[test]
fn bad_input_is_one_clear_line_and_spawns_nothing() {
    let dir = TempDir::new().unwrap();
    let marker = dir.path().join("spawned");
    let worker = [
        "--no-python".to_owned(),
        "sh".into(),
        "-c".into(),
        format!("touch {}", marker.display()),
    ];
    // (flags, environment, what the error line must name)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: &[Case] = &[
        (&["--bogus-flag"], &[], "--bogus-flag"),
        (&["--nproc-per-node", "0"], &[], "--nproc-per-node '0'"),
        (
            &[],
            &[("PET_NPROC_PER_NODE", "zero")],
            "env PET_NPROC_PER_NODE",
        ),
        (&["--rdzv-conf", "join_timeout"], &[], "not key=value"),
        (&["--rdzv-conf", "no_such_key=1"], &[], "unknown key"),
        (&["--nnodes", "3:2"], &[], "MIN (3) is greater than MAX (2)"),
        (&["--nnodes", "2", "--node-rank", "2"], &[], "--node-rank"),
        (
            &["--nnodes", "1:2"],
            &[],
            "static backend needs a fixed node count",
        ),
        // The static master is the workers' MASTER_ADDR: checked like an etcd host.
        (
            &["--nnodes", "2", "--rdzv-endpoint", "::::"],
            &[],
            "--rdzv-endpoint '::::'",
        ),
        (
            &["--nnodes", "2", "--rdzv-endpoint", "h\u{e9}\u{2603}:12"],
            &[],
            "not ASCII",
        ),
        (
            &[
                "--nnodes",
                "2",
                "--master-addr",
                "a b",
                "--master-port",
                "1",
            ],
            &[],
            "--master-addr 'a b'",
        ),
        (&["--max-restarts", "-1"], &[], "--max-restarts"),
        (&["--term-timeout", "soon"], &[], "--term-timeout"),
        // Durations past the documented maximum (7 days) are refused, never a panic.
        (
            &["--term-timeout", "99999999999999999999999"],
            &[],
            "at most 7 days",
        ),
        (&["--monitor-interval", "169h"], &[], "--monitor-interval"),
        (
            &[],
            &[("PET_SHUTDOWN_TIMEOUT", "99999999999999999999999")],
            "env PET_SHUTDOWN_TIMEOUT",
        ),
        (
            &[],
            &[("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "99999999999999999999999")],
            "env TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
        ),
        (
            &[],
            &[("PET_MONITOR_INTERVAL", "99999999999999999999999")],
            "env PET_MONITOR_INTERVAL",
        ),
        (&["--redirects", "5"], &[], "--redirects"),
        (&["--rdzv-backend", "zookeeper"], &[], "zookeeper"),
        (&["--rdzv-backend", "c10d", "--nnodes", "2"], &[], "c10d"),
        (&["--numa-binding", "node"], &[], "--numa-binding"),
        (&["-m"], &[], "cannot be combined"),
        (&["--signals-to-handle", "SIGKILL"], &[], "SIGKILL"),
        (
            &[
                "--standalone",
                "--nproc-per-node",
                "2",
                "--virtual-local-rank",
            ],
            &[("CUDA_VISIBLE_DEVICES", "3")],
            "lists 1 for 2 workers",
        ),
        (
            &["--log-dir", "/proc/no/such/dir"],
            &[],
            "--log-dir /proc/no/such/dir cannot be created",
        ),
        (
            &["--rdzv-backend", "etcd", "--rdzv-endpoint", "e:2379"],
            &[],
            "--rdzv-id is required",
        ),
        (
            &["--rdzv-backend", "etcd-v2", "--rdzv-id", "j"],
            &[],
            "--rdzv-endpoint is required",
        ),
        (
            &[
                "--rdzv-backend",
                "etcd",
                "--rdzv-id",
                "j",
                "--rdzv-endpoint",
                "e",
                "--rdzv-conf",
                "protocol=ftp",
            ],
            &[],
            "protocol=ftp",
        ),
    ];
    // Endpoint mistakes are configuration errors, found before connecting (today they
    // were retried as if etcd were down, then exit 69 after the whole connect window).
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, "not a certificate").unwrap();
    let ca_conf = format!("connect_timeout=3,cacert={}", ca.display());
    let endpoint_cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["http://127.0.0.1:2379", ca_conf.as_str()], "http://"),
        (vec!["127.0.0.1:99999", "connect_timeout=3"], "port"),
        (vec!["a b c", "connect_timeout=3"], "'a b c'"),
        (vec!["ét.cd:2379", "connect_timeout=3"], "ét.cd"),
        (vec!["ftp://e:2379", "connect_timeout=3"], "ftp"),
        (vec!["e:2379,e:0", "connect_timeout=3"], "e:0"),
        (vec!["[::1:2379", "connect_timeout=3"], "[::1:2379"),
        (
            vec!["http://e:2379", "connect_timeout=3,protocol=https"],
            "http://",
        ),
        // Half a client certificate ran silently in plaintext; it names the missing half.
        (vec!["e:2379", "connect_timeout=3,key=/k.pem"], "cert=PATH"),
        (
            vec!["e:2379", "connect_timeout=3,ssl_cert=/c.pem"],
            "key=PATH",
        ),
    ];
    let endpoint_args: Vec<(Vec<&str>, &str)> = endpoint_cases
        .iter()
        .map(|(v, expect)| {
            let mut a = vec!["--rdzv-backend", "etcd", "--rdzv-id", "j"];
            a.extend(["--rdzv-endpoint", v[0], "--rdzv-conf", v[1]]);
            (a, *expect)
        })
        .collect();
    // Every --rdzv-conf duration, and the lease bound torchrun spells interval × attempts.
    // connect_timeout=1 keeps today's failure mode (etcd unreachable) short.
    let etcd = [
        "--rdzv-backend",
        "etcd",
        "--rdzv-id",
        "j",
        "--rdzv-endpoint",
        "e",
    ];
    let huge = "99999999999999999999999";
    let mut rdzv_cases: Vec<(String, String)> = [
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "keep_alive_ttl",
        "keep_alive_interval",
        "straggler_timeout",
    ]
    .iter()
    .flat_map(|k| {
        [
            (format!("connect_timeout=1,{k}={huge}"), k.to_string()),
            // Parses as a Duration today, and overflows `Instant + d` later.
            (
                format!("connect_timeout=1,{k}=10000000000000000000"),
                k.to_string(),
            ),
        ]
    })
    .collect();
    rdzv_cases.push((format!("connect_timeout={huge}"), "connect_timeout".into()));
    rdzv_cases.push((
        "connect_timeout=1,keep_alive_interval=100h,keep_alive_max_attempt=4294967295,straggler_timeout=168h".into(),
        "keep_alive_interval".into(),
    ));
    let rdzv_args: Vec<(Vec<&str>, &str)> = rdzv_cases
        .iter()
        .map(|(conf, key)| {
            let mut v = etcd.to_vec();
            v.extend(["--rdzv-conf", conf.as_str()]);
            (v, key.as_str())
        })
        .collect();
    let rdzv_cases: Vec<Case> = rdzv_args
        .iter()
        .map(|(a, key)| (&a[..], &[][..], *key))
        .collect();
    let endpoint_cases: Vec<Case> = endpoint_args
        .iter()
        .map(|(a, expect)| (&a[..], &[][..], *expect))
        .collect();
    for (args, env, expect) in cases.iter().chain(&rdzv_cases).chain(&endpoint_cases) {
        let mut c = AgentCmd::new(dir.path(), "bad");
        for (k, v) in *env {
            c = c.env(k, v);
        }
        let mut a = c.args(*args).args(&worker).run(LIMIT);
        assert_eq!(a.code(), 64, "{args:?}: {}", a.output());
        let err = a.stderr();
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: expected one line, got:\n{err}");
        assert!(lines[0].starts_with("fsdp-agent: error: "), "{err}");
        assert!(
            lines[0].contains(expect),
            "{args:?}: '{expect}' not in: {err}"
        );
        assert!(!marker.exists(), "{args:?} spawned a worker");
    }
    // `fsdp-agent status` reads the same --rdzv-conf.
    let (code, _, err) = fsdp_tests::status_cmd(&[
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "j",
        "--rdzv-conf",
        &format!("connect_timeout={huge}"),
    ]);
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("connect_timeout") && err.contains("at most 7 days"),
        "{err}"
    );
    // No script at all: one complete line, not clap's "were not provided:" cut short.
    for args in [&["--standalone"][..], &["--nnodes", "1"], &[]] {
        let mut a = AgentCmd::new(dir.path(), "bad").args(args).run(LIMIT);
        assert_eq!(a.code(), 64, "{args:?}: {}", a.output());
        let err = a.stderr();
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.contains("the training script is missing: fsdp-agent [options] TRAINING_SCRIPT"),
            "{args:?}: {err}"
        );
    }
    // A missing script, under Python and as a binary.
    for args in [
        &["no_such_train.py"][..],
        &["--no-python", "/no/such/binary"],
    ] {
        let mut a = AgentCmd::new(dir.path(), "bad").args(args).run(LIMIT);
        assert_eq!(a.code(), 64, "{}", a.output());
        assert!(a.stderr().contains(args[args.len() - 1]), "{}", a.stderr());
        assert_eq!(a.stderr().lines().count(), 1, "{}", a.stderr());
    }
}

#[test]
fn help_and_version_exit_zero() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "help")
        .args(["--help"])
        .run(LIMIT);
    assert_eq!(a.code(), 0);
    assert!(a.stdout().contains("--nproc-per-node"));
    assert!(a.stdout().contains("--rdzv-conf"));
    let mut a = AgentCmd::new(dir.path(), "version")
        .args(["--version"])
        .run(LIMIT);
    assert_eq!(a.code(), 0);
    assert!(a.stdout().starts_with("fsdp-agent "));
    let _ = records;
}

/// Runs the agent in `dir` (its working directory too) to completion: (code, stdout, stderr).
fn run_in(dir: &std::path::Path, name: &str, args: &[&str]) -> (i32, String, String) {
    let mut a = AgentCmd::new(dir, name)
        .current_dir(dir)
        .args(args)
        .run(LIMIT);
    (a.code(), a.stdout(), a.stderr())
}

/// Words collapsed to single spaces: `--help-all` wraps its text.
fn words(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `--help` is one screen for a torchrun user: torchrun's flags first under their own
/// heading, one line each, then fsdp-agent's by topic; it names the `status` subcommand.
#[test]
fn help_is_one_screen_with_torchruns_flags_first() {
    let dir = TempDir::new().unwrap();
    let (code, help, err) = run_in(dir.path(), "help", &["--help"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = help.lines().collect();
    assert!(lines.len() <= 60, "{} lines:\n{help}", lines.len());
    let headings: Vec<usize> = (0..lines.len())
        .filter(|&i| !lines[i].starts_with(' ') && lines[i].ends_with(':'))
        .collect();
    assert!(
        headings.len() >= 3,
        "torchrun's and fsdp-agent's topics:\n{help}"
    );
    assert!(
        lines[headings[0]].starts_with("torchrun's options"),
        "torchrun's heading comes first:\n{help}"
    );
    let torchruns = &lines[headings[0]..headings[1]];
    let ours = &lines[headings[1]..];
    // The flag a summary line is about: its first `--` word.
    let flag_of = |l: &str| {
        l.split_whitespace()
            .map(|w| w.trim_end_matches(','))
            .find(|w| w.starts_with("--"))
            .map(str::to_owned)
    };
    let listed = |section: &[&str]| -> Vec<String> {
        section.iter().skip(1).filter_map(|l| flag_of(l)).collect()
    };
    let (torchruns, ours) = (listed(torchruns), listed(ours));
    for flag in [
        "--nnodes",
        "--nproc-per-node",
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--rdzv-conf",
        "--standalone",
        "--max-restarts",
        "--redirects",
        "--tee",
        "--log-dir",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--term-timeout",
    ] {
        assert!(
            torchruns.contains(&flag.to_owned()),
            "{flag} under torchrun's heading:\n{help}"
        );
    }
    for flag in [
        "--hang-timeout",
        "--no-retry-exit-codes",
        "--restart-window",
        "--health-check",
        "--prewarm",
        "--status-addr",
        "--log-format",
        "--print-config",
    ] {
        assert!(
            ours.contains(&flag.to_owned()),
            "{flag} under fsdp-agent's:\n{help}"
        );
        assert!(
            !torchruns.contains(&flag.to_owned()),
            "{flag} is not torchrun's"
        );
    }
    // One line per flag: no flag's line is repeated or continued.
    let all: Vec<&String> = torchruns.iter().chain(&ours).collect();
    let mut unique = all.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), all.len(), "{help}");
    assert!(
        help.contains("fsdp-agent status") && help.contains("status --help"),
        "{help}"
    );
    // The c10d line no longer says "single node".
    assert!(!help.contains("single node"), "{help}");
}

/// `fsdp-agent help` is `--help`, `help all` is `--help-all` (every flag in full, with its
/// variable, default and other spellings), `help status` is `status --help`.
#[test]
fn help_word_and_help_all() {
    let dir = TempDir::new().unwrap();
    let (_, help, _) = run_in(dir.path(), "help", &["--help"]);
    let (code, by_word, err) = run_in(dir.path(), "word", &["help"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(by_word, help);

    let (code, all, err) = run_in(dir.path(), "all", &["--help-all"]);
    assert_eq!(code, 0, "{err}");
    let (code, all_by_word, _) = run_in(dir.path(), "all-word", &["help", "all"]);
    assert_eq!(code, 0);
    assert_eq!(all_by_word, all);
    let all = words(&all);
    // Every flag of the summary is there with its line, and more.
    let mut flags = 0;
    for line in help.lines().filter(|l| l.trim_start().starts_with('-')) {
        let (flag, text) = line.trim().split_once("  ").expect("flag, then its text");
        assert!(
            all.contains(&words(flag)),
            "{flag} is missing from --help-all"
        );
        assert!(
            all.contains(text.trim()),
            "{flag}'s text is missing from --help-all"
        );
        flags += 1;
    }
    assert!(flags > 40, "{flags} flags in the summary");
    for long in [
        "[env: PET_NPROC_PER_NODE] [default: 1] [aliases: --nproc_per_node]",
        "[aliases: --term_timeout, --shutdown-timeout, --shutdown_timeout]",
        "`c10d`: no etcd, on one node or several",
        "ten times the slowest recent step",
        "exits 79 so the pod is replaced",
        "Arguments passed to the training program unchanged",
    ] {
        assert!(all.contains(long), "--help-all lacks: {long}");
    }
    assert!(!all.contains("single node"));

    let (code, status, err) = run_in(dir.path(), "status", &["help", "status"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        status.contains("--rdzv-endpoint") && status.contains("--json"),
        "{status}"
    );
    let (code, _, err) = run_in(dir.path(), "bogus", &["help", "bogus"]);
    assert_eq!(code, 64);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("'bogus'") && err.contains("fsdp-agent help all"),
        "{err}"
    );
}

/// As under torchrun, a script named `help` in the working directory is run, not shadowed
/// by the help word.
#[test]
fn a_script_named_help_still_runs() {
    let dir = TempDir::new().unwrap();
    std::fs::write(
        dir.path().join("help"),
        "import sys\nopen('ran', 'w').write(' '.join(sys.argv[1:]))\n",
    )
    .unwrap();
    let python = fsdp_tests::python();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .current_dir(dir.path())
        .env("PYTHON_EXEC", &python)
        .args(["help", "all"])
        .run(LIMIT);
    assert_eq!(a.code(), 0, "{}", a.output());
    assert!(!a.stdout().contains("Usage:"), "{}", a.output());
    let ran = std::fs::read_to_string(dir.path().join("ran")).expect("the script ran");
    assert_eq!(ran, "all");
}

#[test]
fn an_unreachable_etcd_is_a_clear_error_after_a_bounded_retry() {
    let dir = TempDir::new().unwrap();
    let port = fsdp_tests::free_port().to_string();
    let endpoint = format!("127.0.0.1:{port}");
    let start = std::time::Instant::now();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--rdzv-backend",
            "etcd",
            "--rdzv-id",
            "job",
            "--rdzv-endpoint",
            &endpoint,
        ])
        .args(["--rdzv-conf", "connect_timeout=1", "--no-python", "true"])
        .run(LIMIT);
    assert_eq!(a.code(), 69, "{}", a.output());
    assert!(
        a.stderr().contains(&endpoint) && a.stderr().contains("unreachable"),
        "{}",
        a.stderr()
    );
    assert!(
        start.elapsed() < std::time::Duration::from_secs(30),
        "retried for {:?}",
        start.elapsed()
    );
    // Short lines a person reads: the cause in a few words, said once, no debug output of
    // nested transport errors; only the causes that apply (no TLS, no password here).
    let err = a.stderr();
    assert!(err.contains("Connection refused"), "{err}");
    assert_eq!(err.matches("is unreachable or refused").count(), 1, "{err}");
    assert!(!err.contains("tonic::") && !err.contains("Os {"), "{err}");
    assert!(
        !err.contains("TLS") && !err.contains("credentials"),
        "{err}"
    );
    for line in err.lines() {
        assert!(line.len() < 240, "a long line: {line}");
    }
}

/// Everything after the training script is the script's, even words that are agent flags
/// (torchrun's rule): the agent neither takes `--nnodes 4` nor prints its help.
#[test]
fn agent_flags_after_the_script_reach_the_script_unchanged() {
    let dir = TempDir::new().unwrap();
    let script_args = [
        "--nnodes",
        "4",
        "--help",
        "-r",
        "3",
        "-t",
        "3",
        "--max-restarts",
        "9",
        "-m",
        "--",
        "--nproc-per-node=2",
    ];
    // (agent flags before the script, how they end)
    let cases: &[&[&str]] = &[
        &["--standalone", "--no-python"],
        &[
            "--standalone",
            "-r3",
            "--max-restarts=1",
            "--no-python",
            "--",
        ],
        &[
            "--standalone",
            "-r",
            "0",
            "--max_restarts",
            "1",
            "--no-python",
        ],
    ];
    // A script whose first argument is already an agent flag.
    let script = dir.path().join("record-argv");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$@\" > {}/argv.$ARGV_CASE\n",
            dir.path().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    for (i, before) in cases.iter().enumerate() {
        let out = dir.path().join(format!("argv.{i}"));
        let mut a = AgentCmd::new(dir.path(), &format!("argv{i}"))
            .env("ARGV_CASE", i.to_string())
            .args(*before)
            .arg_path(&script)
            .args(script_args)
            .run(LIMIT);
        assert_eq!(a.code(), 0, "{before:?}: {}", a.output());
        assert!(
            !a.stdout().contains("Usage:"),
            "{before:?}: the agent printed its help:\n{}",
            a.output()
        );
        let got = std::fs::read_to_string(&out).unwrap_or_else(|e| {
            panic!("{before:?}: the script did not run ({e}):\n{}", a.output())
        });
        assert_eq!(got.lines().collect::<Vec<_>>(), script_args, "{before:?}");
        // The agent kept its own values: one node, one worker.
        assert!(!a.stderr().contains("nnodes=4"), "{}", a.stderr());
    }
}

/// argparse's habits: a flag given twice keeps its last value, and an unambiguous
/// abbreviation is the flag; an ambiguous one is a clear error.
#[test]
fn repeated_flags_keep_the_last_value_and_abbreviations_are_their_flag() {
    let dir = fsdp_tests::TempDir::new().unwrap();
    let script = dir.path().join("x.py");
    std::fs::write(&script, "").unwrap();
    let print = |args: &[&str]| {
        let mut a = AgentCmd::new(dir.path(), "agent")
            .args(args)
            .args(["--print-config"])
            .arg_path(&script)
            .run(Duration::from_secs(30));
        (a.code(), a.stdout(), a.stderr())
    };
    let (code, out, err) = print(&[
        "--nproc-per-node",
        "2",
        "--nproc-per-node",
        "3",
        "--standalone",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("nproc-per-node") && l.contains(" 3 ")),
        "{out}"
    );
    let (code, out, err) = print(&["--nproc-per", "4", "--stand", "--max_rest", "2"]);
    assert_eq!(code, 0, "{err}");
    for (flag, value) in [
        ("nproc-per-node", " 4 "),
        ("standalone", " true "),
        ("max-restarts", " 2 "),
    ] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(flag) && l.contains(value)),
            "{flag}: {out}"
        );
    }
    let (code, _, err) = print(&["--hang", "3", "--standalone"]);
    assert_eq!(code, 64);
    assert!(err.contains("--hang"), "{err}");
}

/// Abbreviations mean what torchrun 2.13's argparse makes of them, even where a flag of
/// ours shares the prefix (`--no-progress-restarts`, `--log-format`, `--term-timeout`,
/// `--restart-window`); what torchrun finds ambiguous is refused here too. The whole table
/// of prefixes is compared with torchrun's parser in agent/tests/cli_torchrun_abbreviations.rs.
#[test]
fn abbreviations_read_as_torchrun_reads_them() {
    let dir = fsdp_tests::TempDir::new().unwrap();
    let script = dir.path().join("x.py");
    std::fs::write(&script, "").unwrap();
    let logs = dir.path().join("logs");
    let print = |before: &[&str], script: &str, after: &[&str]| {
        let mut a = AgentCmd::new(dir.path(), "agent")
            .args(["--standalone", "--print-config"])
            .args(before)
            .args([script])
            .args(after)
            .run(Duration::from_secs(30));
        (a.code(), a.stdout(), a.stderr())
    };
    let x = script.to_str().unwrap();
    let setting = |out: &str, name: &str, value: &str, flag: &str| {
        assert!(
            out.lines().any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.first() == Some(&name)
                    && cols.get(1) == Some(&value)
                    && l.ends_with(&format!("(flag {flag})"))
            }),
            "{name} = {value} from {flag}:\n{out}"
        );
    };

    let (code, out, err) = print(&["--no-p"], "true", &[]);
    assert_eq!(code, 0, "{err}");
    setting(&out, "no-python", "true", "--no-python");
    let (code, out, err) = print(&["--log-", logs.to_str().unwrap()], x, &[]);
    assert_eq!(code, 0, "{err}");
    setting(&out, "log-dir", logs.to_str().unwrap(), "--log-dir");
    let (code, out, err) = print(&["--te", "3", "--re=2"], x, &[]);
    assert_eq!(code, 0, "{err}");
    setting(&out, "tee", "3", "--tee");
    setting(&out, "redirects", "2", "--redirects");

    for (word, candidates) in [
        ("--max", "--max-restarts, --max_restarts"),
        ("--max=3", "--max-restarts, --max_restarts"),
        ("--nproc", "--nproc-per-node, --nproc_per_node"),
        ("--vi", "--virtual-local-rank, --virtual_local_rank"),
    ] {
        let (code, _, err) = print(&[word, "3"], x, &[]);
        assert_eq!(code, 64, "{word}: {err}");
        assert_eq!(err.lines().count(), 1, "{word}: {err}");
        assert!(
            err.contains(&format!(
                "could match {candidates} (torchrun refuses it too)"
            )) && err.contains("write the flag out in full"),
            "{word}: {err}"
        );
        assert!(
            !err.contains("=3"),
            "{word}: the value is not repeated: {err}"
        );
    }
    // Our own flags: by prefixes torchrun leaves alone, ambiguity named the same way.
    let (code, out, err) = print(&["--no-pr", "5", "--log-f", "text"], x, &[]);
    assert_eq!(code, 0, "{err}");
    setting(&out, "no-progress-restarts", "5", "--no-progress-restarts");
    let (code, _, err) = print(&["--hang", "3"], x, &[]);
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("could match --hang-timeout, --hang-min;"),
        "{err}"
    );
    // After the script nothing is an agent flag (torchrun, parsing every word up front,
    // would refuse this `--max`).
    let (code, _, err) = print(&[], x, &["--max", "3"]);
    assert_eq!(code, 0, "{err}");
}

/// `venv/bin/fsdp-agent train.py` with no venv activated runs the venv's Python (the one
/// beside the agent), as torchrun runs its own interpreter; `PYTHON_EXEC` still wins, and
/// `--print-config` says which and why.
#[test]
fn an_agent_in_a_venv_runs_that_venvs_python() {
    let dir = TempDir::new().unwrap();
    let venv = dir.path().join("venv");
    let made = std::process::Command::new("/usr/bin/python3")
        .args(["-m", "venv", "--without-pip"])
        .arg(&venv)
        .status()
        .expect("python3 -m venv");
    assert!(made.success());
    let agent = venv.join("bin/fsdp-agent");
    std::os::unix::fs::symlink(fsdp_tests::agent_bin(), &agent).unwrap();
    let script = dir.path().join("where.py");
    std::fs::write(&script, "import sys; print('prefix=' + sys.prefix)\n").unwrap();
    let run = |extra_env: &[(&str, &str)], print: bool| {
        let mut cmd = std::process::Command::new(&agent);
        cmd.env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("FSDP_STATUS_ADDR", "off")
            .env("TMPDIR", std::env::temp_dir())
            .arg("--standalone");
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        if print {
            cmd.arg("--print-config");
        }
        let out = cmd.arg(&script).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let out = run(&[], false);
    assert!(
        out.contains(&format!("prefix={}", venv.display())),
        "not the venv's python: {out}"
    );
    let shown = run(&[], true);
    let line = shown
        .lines()
        .find(|l| l.starts_with("python "))
        .unwrap_or_else(|| panic!("{shown}"));
    assert!(line.contains("beside fsdp-agent in"), "{line}");
    let out = run(&[("PYTHON_EXEC", "/usr/bin/python3")], false);
    assert!(
        out.contains("prefix=/usr"),
        "PYTHON_EXEC comes first: {out}"
    );
}

/// A worker killed by a signal ends a single-node job with 128+n, as a shell reports it
/// (not 76, the code for a node whose peer failed).
#[test]
fn a_worker_killed_by_sigsegv_makes_the_agent_exit_139() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args(["--standalone", "--no-python", "sh", "-c", "kill -SEGV $$"])
        .run(LIMIT);
    assert_eq!(a.code(), 139, "{}", a.output());
    assert!(a.stderr().contains("SIGSEGV"), "{}", a.stderr());
}

/// Under srun, `PET_*` variables (a Kubeflow-style environment, or the user's own) win over
/// what Slurm says, as flags do, and `--print-config` names each source.
#[test]
fn under_srun_pet_variables_win_over_slurm_and_print_config_names_the_source() {
    let dir = TempDir::new().unwrap();
    let slurm = [
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_STEP_NUM_NODES", "3"),
        ("SLURM_STEP_NODELIST", "gpu-[007-009]"),
        ("SLURM_STEP_TASKS_PER_NODE", "1(x3)"),
        ("SLURM_NODEID", "1"),
        ("SLURMD_NODENAME", "gpu-008"),
    ];
    let mut c = AgentCmd::new(dir.path(), "cfg");
    for (k, v) in slurm.iter().chain(&[("PET_NNODES", "2:3")]) {
        c = c.env(k, v);
    }
    let mut a = c.args(["--print-config", "--no-python", "true"]).run(LIMIT);
    assert_eq!(a.code(), 0, "{}", a.output());
    let out = a.stdout();
    let line = |name: &str| -> String {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} not printed:\n{out}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(line("nnodes"), "nnodes 2:3 (env PET_NNODES)");
    assert_eq!(line("rdzv-id"), "rdzv-id 4242 (env SLURM_JOB_ID)");
    assert!(
        line("rdzv-endpoint").starts_with(
            "rdzv-endpoint gpu-007:29400 (derived: Slurm: first host of SLURM_STEP_NODELIST"
        ),
        "{out}"
    );

    // Two tasks on this node: refused with the fix, nothing started.
    let mut c = AgentCmd::new(dir.path(), "two");
    for (k, v) in slurm
        .iter()
        .filter(|(k, _)| *k != "SLURM_STEP_TASKS_PER_NODE")
        .chain(&[("SLURM_STEP_TASKS_PER_NODE", "2(x3)")])
    {
        c = c.env(k, v);
    }
    let mut a = c.args(["--no-python", "true"]).run(LIMIT);
    assert_eq!(a.code(), 64, "{}", a.output());
    assert!(a.stderr().contains("--ntasks-per-node=1"), "{}", a.output());
}

/// `fsdp-agent ... 2>&1 | head -1`: the reader goes after one line. The agent once
/// panicked on its next log line ("failed printing to stderr: Broken pipe", exit 101) and
/// left its workers unsupervised; now it drops what it cannot print and its workers run to
/// their end.
#[test]
fn a_console_closed_after_one_line_neither_panics_nor_stops_the_job() {
    let dir = TempDir::new().unwrap();
    let done = dir.path().join("done");
    let code = dir.path().join("code");
    // The workers write nothing (a worker shares the agent's console, as under torchrun,
    // and one that writes into a closed pipe dies of SIGPIPE there too); the agent logs on
    // after the reader left: the group formed, the workers' end, its own exit.
    let worker = format!("sleep 1; touch {}.$LOCAL_RANK", done.display());
    let script = format!(
        "{agent} --standalone --nproc-per-node 2 --max-restarts 0 --no-python sh -c '{worker}' 2>&1 | head -1; \
         echo ${{PIPESTATUS[0]}} > {code}",
        agent = fsdp_tests::agent_bin().display(),
        code = code.display()
    );
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(&script)
        .env("RUST_LOG", "info")
        .env("FSDP_STATUS_ADDR", "127.0.0.1:0")
        .env("TMPDIR", fsdp_tests::tmpdir_in(dir.path()))
        .output()
        .expect("bash");
    let code = std::fs::read_to_string(&code).unwrap_or_default();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        code.trim(),
        "0",
        "the agent's exit code; head printed: {shown}"
    );
    assert!(!shown.contains("panicked"), "{shown}");
    for rank in 0..2 {
        assert!(
            dir.path().join(format!("done.{rank}")).exists(),
            "worker {rank} did not run to its end"
        );
    }
}
