//! The resolver's decisions, through its env seam: `resolve` with a hand-made argv and an
//! environment closure, no process and no real environment. tests/tests/cli.rs checks the
//! same paths end to end (the binary, clap's `PET_*` variables, exit codes); these are the
//! fast tier and cover the variables the resolver reads itself.
//!
//! clap reads the `PET_*` variables of valued flags from the process environment, not
//! through the seam, so precedence over them is left to cli.rs.

use std::time::Duration;

use super::*;

/// A worker every test can use: an absolute path needs no `PATH` and no Python.
const WORKER: [&str; 2] = ["--no-python", "/bin/sh"];

fn run(args: &[&str], env: &[(&str, &str)]) -> Result<Config, Result<String, ConfigError>> {
    let argv = std::iter::once("fsdp-agent")
        .chain(args.iter().copied())
        .map(OsString::from)
        .collect();
    let env = |k: &str| {
        env.iter()
            .find(|(name, _)| *name == k)
            .map(|(_, v)| (*v).to_owned())
    };
    resolve(argv, &env)
}

fn config(args: &[&str], env: &[(&str, &str)]) -> Config {
    let args: Vec<&str> = args.iter().chain(&WORKER).copied().collect();
    run(&args, env).unwrap_or_else(|e| panic!("{args:?}: {e:?}"))
}

fn error(args: &[&str], env: &[(&str, &str)]) -> String {
    let args: Vec<&str> = args.iter().chain(&WORKER).copied().collect();
    match run(&args, env) {
        Ok(c) => panic!("{args:?} resolved: {:?}", c.mode),
        Err(Ok(text)) => panic!("{args:?} printed: {text}"),
        Err(Err(e)) => e.to_string(),
    }
}

/// The recorded value and source of one setting.
fn setting<'c>(c: &'c Config, name: &str) -> (&'c str, &'c Source) {
    let s = c
        .settings
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("{name} not recorded: {:?}", c.settings));
    (&s.value, &s.source)
}

fn recorded(c: &Config, name: &str) -> bool {
    c.settings.iter().any(|s| s.name == name)
}

/// Node 1 of a static group of two (`--master-addr n0`) with `--rdzv-conf conf`.
fn static_node_with_rdzv_conf(conf: &str) -> Config {
    let args = [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "n0",
        "--rdzv-conf",
        conf,
    ];
    config(&args, &[])
}

fn flag(f: &str) -> Source {
    Source::Flag(f.into())
}

fn env(e: &str) -> Source {
    Source::Env(e.into())
}

fn with<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<&'a str> {
    [a, b].concat()
}

fn warned(c: &Config, part: &str) -> bool {
    c.warnings.iter().any(|w| w.contains(part))
}

// ---- value sources ----

#[test]
fn defaults_are_recorded_as_defaults() {
    let c = config(&[], &[]);
    assert_eq!(setting(&c, "nnodes"), ("1:1", &Source::Default));
    assert_eq!(setting(&c, "max-restarts"), ("0", &Source::Default));
    assert_eq!(setting(&c, "standalone"), ("false", &Source::Default));
    assert_eq!(setting(&c, "term-timeout"), ("30", &Source::Default));
    assert_eq!(c.term_timeout, DEFAULT_TERM_TIMEOUT);
    assert_eq!((c.nproc_per_node, c.max_restarts), (1, 0));
    assert_eq!(c.role, "default");
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert!(c.worker_env_scrub.is_empty());
}

#[test]
fn a_flag_is_recorded_under_its_dashed_name_whatever_the_spelling() {
    let c = config(&["--max_restarts", "2", "--shutdown_timeout", "5"], &[]);
    assert_eq!(c.max_restarts, 2);
    // The name is the dashed one; the source is the flag as it was typed.
    assert_eq!(setting(&c, "max-restarts"), ("2", &flag("--max_restarts")));
    assert_eq!(c.term_timeout, Duration::from_secs(5));
    assert_eq!(
        setting(&c, "term-timeout"),
        ("5", &flag("--shutdown_timeout"))
    );
}

#[test]
fn boolean_flags_beat_their_pet_variable_which_beats_off() {
    // Kubeflow sets PET_STANDALONE to the empty string to mean "on".
    let c = config(&[], &[("PET_STANDALONE", "")]);
    assert_eq!(setting(&c, "standalone"), ("true", &env("PET_STANDALONE")));
    assert!(matches!(c.mode, Mode::Standalone { .. }));
    let c = config(&[], &[("PET_STANDALONE", "0")]);
    assert_eq!(setting(&c, "standalone"), ("false", &env("PET_STANDALONE")));
    let c = config(&["--standalone"], &[("PET_STANDALONE", "0")]);
    assert_eq!(setting(&c, "standalone"), ("true", &flag("--standalone")));
    let c = config(&[], &[("PET_VIRTUAL_LOCAL_RANK", "yes")]);
    assert!(c.virtual_local_rank);
    assert_eq!(
        setting(&c, "virtual-local-rank"),
        ("true", &env("PET_VIRTUAL_LOCAL_RANK"))
    );
}

#[test]
fn a_bad_boolean_variable_names_the_variable_and_the_flag() {
    let e = error(&[], &[("PET_MODULE", "maybe")]);
    assert_eq!(
        e,
        "invalid --module 'maybe' (from env PET_MODULE): 'maybe' is not a boolean (use 1 or 0)"
    );
}

#[test]
fn term_timeout_flag_then_torch_variable_then_thirty_seconds() {
    let torch = [("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "500ms")];
    let c = config(&[], &torch);
    assert_eq!(c.term_timeout, Duration::from_millis(500));
    assert_eq!(
        setting(&c, "term-timeout"),
        ("500ms", &env("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"))
    );
    let c = config(&["--term-timeout", "7"], &torch);
    assert_eq!(c.term_timeout, Duration::from_secs(7));
    assert_eq!(setting(&c, "term-timeout"), ("7", &flag("--term-timeout")));
    let e = error(&[], &[("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")]);
    assert!(
        e.starts_with("invalid --term-timeout 'soon' (from env TORCH_ELASTIC_SHUTDOWN_TIMEOUT)"),
        "{e}"
    );
}

#[test]
fn bad_values_name_the_flag_the_value_and_where_it_came_from() {
    let e = error(&["--max-restarts", "-1"], &[]);
    assert_eq!(
        e,
        "invalid --max-restarts '-1' (from flag --max-restarts): expected a whole number ≥ 0"
    );
    let e = error(&["--monitor-interval", "0"], &[]);
    assert!(
        e.contains("--monitor-interval '0'") && e.contains("greater than 0"),
        "{e}"
    );
    let e = error(&["--start-method", "thread"], &[]);
    assert!(e.contains("spawn, fork or forkserver"), "{e}");
    let e = error(&["--role", ""], &[]);
    assert!(
        e.contains("--role") && e.contains("must not be empty"),
        "{e}"
    );
    let e = error(&["--log-format", "xml"], &[]);
    assert!(e.contains("text or json"), "{e}");
    let e = error(&["--status-addr", "nowhere"], &[]);
    assert!(e.contains("--status-addr 'nowhere'"), "{e}");
}

#[test]
fn torchrun_flags_that_cannot_work_are_refused_by_name() {
    for (args, flag) in [
        (&["--logs-specs", "x"][..], "--logs-specs"),
        (&["--numa-binding", "node"], "--numa-binding"),
        (&["--print-completion", "bash"], "--print-completion"),
    ] {
        let e = error(args, &[]);
        assert!(
            e.starts_with(&format!("{flag} is not supported by fsdp-agent: ")),
            "{e}"
        );
    }
}

#[test]
fn help_and_version_are_text_to_print_and_command_line_errors_are_one_line() {
    let Err(Ok(help)) = run(&["--help"], &[]) else {
        panic!("--help did not come back as text");
    };
    assert!(help.contains("--nproc-per-node"));
    assert!(matches!(run(&["--version"], &[]), Err(Ok(_))));
    let e = error(&["--bogus"], &[]);
    assert!(
        e.contains("--bogus") && e.ends_with("see fsdp-agent --help"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
    let Err(Err(e)) = run(&["--standalone"], &[]) else {
        panic!("no script accepted");
    };
    assert!(
        e.to_string().starts_with("the training script is missing"),
        "{e}"
    );
}

#[test]
fn words_after_the_script_are_the_scripts_even_agent_flags() {
    let c = config(&["--standalone"], &[]);
    assert_eq!(c.entrypoint.program, std::path::Path::new("/bin/sh"));
    assert!(c.entrypoint.args.is_empty());
    let c = run(&["--no-python", "/bin/sh", "--help", "--nnodes", "x"], &[]).unwrap();
    assert_eq!(c.entrypoint.args, ["--help", "--nnodes", "x"]);
}

// ---- mode selection ----

#[test]
fn one_node_without_master_port_runs_standalone() {
    let c = config(&[], &[]);
    assert!(matches!(&c.mode, Mode::Standalone { master_addr } if master_addr == "localhost"));
    assert_eq!(
        setting(&c, "rendezvous"),
        (
            "standalone",
            &Source::Derived("one node and no master port or endpoint".into())
        )
    );
    // A fresh run id per standalone run.
    assert_eq!(c.run_id.len(), 36, "{}", c.run_id);
    assert_ne!(c.run_id, config(&[], &[]).run_id);
    assert_eq!(c.exit_barrier(), Duration::ZERO);
    let c = config(&["--master-addr", "m"], &[]);
    assert!(matches!(c.mode, Mode::Standalone { .. }));
    assert!(warned(&c, "--master-addr is not used"), "{:?}", c.warnings);
}

#[test]
fn standalone_ignores_the_rendezvous_flags_and_says_so() {
    let c = config(
        &[
            "--standalone",
            "--nnodes",
            "2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-id",
            "job",
        ],
        &[],
    );
    assert!(matches!(c.mode, Mode::Standalone { .. }));
    assert_eq!(
        c.warnings,
        ["--standalone runs one node; ignoring --rdzv-backend, --nnodes"]
    );
    assert_eq!(setting(&c, "rendezvous").1, &flag("--standalone"));
    assert_eq!(c.run_id, "job");
    let c = config(&[], &[("PET_STANDALONE", "1")]);
    assert_eq!(setting(&c, "rendezvous").1, &env("PET_STANDALONE"));
}

#[test]
fn static_groups_from_master_port_or_endpoint() {
    let c = config(&["--master-port", "1234"], &[]);
    let Mode::Static {
        nnodes,
        node_rank,
        master_addr,
        master_port,
        ..
    } = &c.mode
    else {
        panic!("{:?}", c.mode);
    };
    assert_eq!(
        (*nnodes, *node_rank, master_addr.as_str(), *master_port),
        (1, 0, "127.0.0.1", 1234)
    );
    assert_eq!(setting(&c, "rdzv-id"), ("none", &Source::Default));
    assert_eq!(c.run_id, "none");
    assert_eq!(
        setting(&c, "rendezvous").0,
        "static nnodes=1 node_rank=0 master=127.0.0.1:1234 join_timeout=600s exit_barrier=none"
    );

    let master = |args: &[&str]| match config(args, &[]).mode {
        Mode::Static {
            node_rank,
            master_addr,
            master_port,
            ..
        } => (node_rank, format!("{master_addr}:{master_port}")),
        other => panic!("{args:?}: {other:?}"),
    };
    assert_eq!(
        master(&["--nnodes", "2", "--node-rank", "1", "--master-addr", "m"]),
        (1, "m:29500".into())
    );
    assert_eq!(
        master(&[
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "h:7",
            "--master-port",
            "9"
        ]),
        (0, "h:7".into())
    );
    assert_eq!(
        master(&[
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "h",
            "--master-port",
            "9"
        ]),
        (0, "h:9".into())
    );
    assert_eq!(
        master(&["--nnodes", "2", "--rdzv-endpoint", "[::1]:8"]),
        (0, "::1:8".into())
    );
    // An endpoint alone makes one node a static group too.
    assert_eq!(master(&["--rdzv-endpoint", "h"]), (0, "h:29500".into()));
}

#[test]
fn static_groups_are_checked() {
    let e = error(&["--nnodes", "1:2"], &[]);
    assert!(e.contains("static backend needs a fixed node count"), "{e}");
    let e = error(&["--nnodes", "2", "--node-rank", "2"], &[]);
    assert_eq!(
        e,
        "invalid --node-rank '2' (from flag --node-rank): must be below --nnodes 2 (node ranks are 0..1)"
    );
    let e = error(&["--nnodes", "2", "--rdzv-endpoint", "h:0"], &[]);
    assert!(e.starts_with("invalid --rdzv-endpoint 'h:0'"), "{e}");
    let e = error(&["--nnodes", "2", "--rdzv-endpoint", "[::1"], &[]);
    assert!(e.contains("unclosed '['"), "{e}");
    let e = error(&["--master-port", "0"], &[]);
    assert!(e.contains("--master-port '0'"), "{e}");
}

#[test]
fn c10d_runs_one_node_standalone_and_several_on_a_store_an_agent_serves() {
    let c = config(&["--rdzv-backend", "c10d"], &[]);
    assert!(matches!(c.mode, Mode::Standalone { .. }));
    assert!(warned(&c, "c10d with one node runs as --standalone"));
    // torchrun's multi-node recipe, and Kubeflow's elastic default.
    let c = config(
        &[
            "--rdzv-backend",
            "c10d",
            "--nnodes",
            "1:2",
            "--rdzv-endpoint",
            "pod0",
        ],
        &[],
    );
    let m = etcd_mode(&c);
    assert_eq!(
        m.store,
        Some(etcd::EmbeddedStore {
            host: "pod0".into(),
            port: 29400,
            is_host: None,
            security: Default::default(),
        })
    );
    assert_eq!(m.rendezvous.options.endpoints, ["pod0:29400"]);
    assert!(m.rendezvous.options.embedded_store);
    assert_eq!(m.rendezvous.outage_timeout, etcd::C10D_OUTAGE_TIMEOUT);
    assert_eq!(c.run_id, "none", "torchrun's default run id");
    assert!(
        setting(&c, "rendezvous")
            .0
            .starts_with("c10d store=pod0:29400")
    );
    let c = config(
        &[
            "--rdzv-backend",
            "c10d",
            "--nnodes",
            "2:3",
            "--rdzv-endpoint",
            "[::1]:1234",
            "--rdzv-id",
            "job",
            "--rdzv-conf",
            "is_host=0,join_timeout=5,timeout=900",
        ],
        &[],
    );
    let m = etcd_mode(&c);
    assert_eq!(m.rendezvous.options.endpoints, ["[::1]:1234"]);
    assert_eq!(m.store.as_ref().unwrap().is_host, Some(false));
    assert_eq!(m.rendezvous.join_timeout, Duration::from_secs(5));
    assert_eq!(c.run_id, "job");
    assert!(warned(
        &c,
        "--rdzv-conf timeout has no effect with the c10d rendezvous (timeout: torchrun's legacy-etcd and static deadline; the rendezvous deadline here is join_timeout)"
    ));
}

#[test]
fn c10d_refuses_what_its_store_cannot_be() {
    let c10d = ["--rdzv-backend", "c10d", "--nnodes", "2"];
    let e = error(&c10d, &[]);
    assert!(
        e.contains("--rdzv-endpoint is required with --rdzv-backend c10d"),
        "{e}"
    );
    let e = error(&with(&c10d, &["--rdzv-endpoint", "a:1,b:2"]), &[]);
    assert!(e.contains("c10d takes one host[:port]"), "{e}");
    let e = error(&with(&c10d, &["--rdzv-endpoint", "http://a:1"]), &[]);
    assert!(e.contains("--rdzv-endpoint 'http://a:1'"), "{e}");
    let e = error(
        &with(
            &c10d,
            &["--rdzv-endpoint", "a", "--rdzv-conf", "store_type=file"],
        ),
        &[],
    );
    assert!(e.contains("store_type=file: only tcp is supported"), "{e}");
    let e = error(
        &with(
            &c10d,
            &["--rdzv-endpoint", "a", "--rdzv-conf", "is_host=maybe"],
        ),
        &[],
    );
    assert!(e.contains("is_host=maybe"), "{e}");
    // The store's TLS needs all three files: the host presents cert/key, the CA checks
    // the clients, and every agent is given the same three.
    let e = error(
        &with(
            &c10d,
            &["--rdzv-endpoint", "a", "--rdzv-conf", "cacert=/ca.pem"],
        ),
        &[],
    );
    assert!(
        e.contains("TLS for the c10d store needs cacert, cert and key together"),
        "{e}"
    );
    let c = config(
        &with(
            &c10d,
            &[
                "--rdzv-endpoint",
                "a",
                "--rdzv-conf",
                "cacert=/ca.pem,cert=/c.pem,key=/k.pem",
            ],
        ),
        &[],
    );
    let m = etcd_mode(&c);
    assert!(m.rendezvous.options.tls.is_some());
    let tls = m.store.as_ref().unwrap().security.tls.clone().unwrap();
    assert_eq!(
        tls.client_ca.as_deref(),
        Some(std::path::Path::new("/ca.pem"))
    );
}

#[test]
fn c10d_takes_the_password_from_the_environment_for_the_store_and_its_clients() {
    let args = [
        "--rdzv-backend",
        "c10d",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "a",
    ];
    let c = config(&args, &[("FSDP_ETCD_PASSWORD", "pw")]);
    let m = etcd_mode(&c);
    let want = Some(("fsdp".to_owned(), "pw".to_owned()));
    assert_eq!(m.rendezvous.options.user, want);
    let creds = m
        .store
        .as_ref()
        .unwrap()
        .security
        .credentials
        .clone()
        .unwrap();
    assert_eq!(
        (creds.user.as_str(), creds.password.as_str()),
        ("fsdp", "pw")
    );
    assert!(
        etcd_mode(&config(&args, &[]))
            .store
            .as_ref()
            .unwrap()
            .security
            .is_open()
    );
}

#[test]
fn unknown_backends_are_refused() {
    let e = error(&["--rdzv-backend", "zookeeper"], &[]);
    assert!(
        e.starts_with("invalid --rdzv-backend 'zookeeper' (from flag --rdzv-backend)"),
        "{e}"
    );
}

const ETCD: [&str; 8] = [
    "--rdzv-backend",
    "etcd",
    "--rdzv-endpoint",
    "e1,e2:2380",
    "--rdzv-id",
    "job",
    "--local-addr",
    "node-a",
];

fn etcd_mode(c: &Config) -> &etcd::EtcdMode {
    match &c.mode {
        Mode::Etcd(m) => m,
        other => panic!("{other:?}"),
    }
}

#[test]
fn etcd_needs_a_run_id_and_an_endpoint() {
    let e = error(&["--rdzv-backend", "etcd", "--rdzv-endpoint", "e"], &[]);
    assert!(
        e.starts_with("--rdzv-id is required with --rdzv-backend etcd"),
        "{e}"
    );
    let e = error(&["--rdzv-backend", "etcd", "--rdzv-id", "j"], &[]);
    assert!(e.starts_with("--rdzv-endpoint is required"), "{e}");
}

#[test]
fn etcd_backends_of_every_spelling_are_the_etcd_rendezvous() {
    for backend in ["etcd", "etcd-v2", "etcd-v3", " ETCD "] {
        let mut args = ETCD.to_vec();
        args[1] = backend;
        let c = config(
            &with(&args, &["--nnodes", "1:4", "--nproc-per-node", "2"]),
            &[],
        );
        let r = &etcd_mode(&c).rendezvous;
        assert_eq!(r.options.endpoints, ["e1:2379", "e2:2380"], "{backend}");
        assert_eq!((r.min_nodes, r.max_nodes), (1, 4));
        assert_eq!((r.run_id.as_str(), r.addr.as_str()), ("job", "node-a"));
        assert_eq!(r.local_world_size, 2);
        assert_eq!(c.run_id, "job");
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    }
    let c = config(&ETCD, &[]);
    assert_eq!(c.exit_barrier(), etcd::DEFAULT_EXIT_BARRIER);
    let (desc, _) = setting(&c, "rendezvous");
    assert!(
        desc.starts_with("etcd endpoints=e1:2379,e2:2380 nnodes=1:1 addr=node-a"),
        "{desc}"
    );
}

#[test]
fn the_etcd_password_variable_is_read_and_kept_from_the_workers() {
    let pw = [
        ("FSDP_ETCD_PASSWORD", "s3cret"),
        ("PET_RDZV_CONF", "username=u,password=old"),
    ];
    let c = config(&with(&ETCD, &["--rdzv-conf", "username=u"]), &pw);
    assert_eq!(
        etcd_mode(&c).rendezvous.options.user,
        Some(("u".into(), "s3cret".into()))
    );
    assert_eq!(
        c.worker_env_scrub,
        [
            ("FSDP_ETCD_PASSWORD".to_owned(), None),
            ("PET_RDZV_CONF".to_owned(), Some("username=u".to_owned())),
        ]
    );
    let e = error(&with(&ETCD, &["--rdzv-conf", "username=u,password=p"]), &pw);
    assert!(e.contains("more than once") && !e.contains("s3cret"), "{e}");
}

// ---- --rdzv-conf ----

#[test]
fn rdzv_conf_keys_are_known_or_refused_and_the_password_is_never_shown() {
    let e = error(&["--rdzv-conf", "password=s3cret,no_such=1"], &[]);
    assert!(
        e.starts_with(
            "invalid --rdzv-conf key 'no_such' (from flag --rdzv-conf): unknown key; known keys: "
        ),
        "{e}"
    );
    assert!(
        e.ends_with(
            "known keys: keep_alive_ttl, straggler_timeout, connect_timeout, username, password, \
             password_file, join_timeout, last_call_timeout, close_timeout, heartbeat_timeout, \
             keep_alive_interval, keep_alive_max_attempt, timeout, read_timeout, is_host, token_ttl, \
             store_type, etcd_prefix, protocol, cacert, cert, key, ca_cert, ssl_cert, \
             ssl_cert_key, rank, cas_backoff_max_seconds, fence_margin, job_check, outage_timeout, \
             segment"
        ),
        "{e}"
    );
    let e = error(&["--rdzv-conf", "password=s3cret,timeout"], &[]);
    assert!(e.contains("password=***") && !e.contains("s3cret"), "{e}");
    let c = config(&["--rdzv-conf", "password=s3cret,timeout=5"], &[]);
    assert_eq!(setting(&c, "rdzv-conf").0, "password=***,timeout=5");
}

#[test]
fn rdzv_conf_keys_without_effect_are_warned_about() {
    let c = config(&["--rdzv-conf", "is_host=1,join_timeout=5"], &[]);
    assert_eq!(
        c.warnings,
        ["--rdzv-conf is_host,join_timeout has no effect with a single-node rendezvous"]
    );
    // A static group's first round waits for its nodes, up to join_timeout.
    let c = static_node_with_rdzv_conf("is_host=1,join_timeout=5");
    assert_eq!(
        c.warnings,
        ["--rdzv-conf is_host has no effect with a static rendezvous"]
    );
    assert!(
        matches!(c.mode, Mode::Static { join_timeout, .. } if join_timeout == Duration::from_secs(5))
    );
    let c = config(
        &with(
            &ETCD,
            &["--rdzv-conf", "is_host=1,join_timeout=5,store_type=x"],
        ),
        &[],
    );
    assert_eq!(
        c.warnings,
        [
            "--rdzv-conf is_host,store_type has no effect with the etcd rendezvous (is_host: only the c10d backend hosts a store; store_type: only a TCP store exists (store_type=tcp is torchrun's default))"
        ]
    );
}

#[test]
fn every_key_the_table_gives_to_etcd_is_taken_by_the_etcd_rendezvous() {
    let dir = std::env::temp_dir().join(format!("fsdp-config-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pw = dir.join("pw");
    std::fs::write(&pw, "p\n").unwrap();
    let first = "join_timeout=5,last_call_timeout=5,close_timeout=5,keep_alive_ttl=2,\
                 keep_alive_interval=1,keep_alive_max_attempt=2,straggler_timeout=10,\
                 connect_timeout=5,etcd_prefix=/p,protocol=https,cacert=/a,cert=/b,key=/c,\
                 username=u,password=p,outage_timeout=60,fence_margin=0.5,job_check=1,segment=z/r";
    let second = format!(
        "ca_cert=/a,ssl_cert=/b,ssl_cert_key=/c,username=u,password_file={}",
        pw.display()
    );
    let mut taken = Vec::new();
    for conf in [first, second.as_str()] {
        let c = config(&with(&ETCD, &["--rdzv-conf", conf]), &[]);
        assert!(c.warnings.is_empty(), "{conf}: {:?}", c.warnings);
        taken.extend(parse::rdzv_conf(conf).unwrap().into_keys());
    }
    std::fs::remove_dir_all(&dir).unwrap();
    for key in rdzv_keys::KEYS {
        assert_eq!(
            taken.iter().any(|k| k == key.name),
            key.etcd,
            "{}: the table and this test disagree",
            key.name
        );
    }
}

#[test]
fn every_key_the_table_gives_to_c10d_is_taken_by_the_c10d_rendezvous() {
    let conf = "join_timeout=5,last_call_timeout=5,close_timeout=5,keep_alive_ttl=2,\
                keep_alive_interval=1,keep_alive_max_attempt=2,straggler_timeout=10,\
                connect_timeout=5,etcd_prefix=/p,outage_timeout=60,fence_margin=0.5,job_check=0,is_host=1,token_ttl=60,\
                username=u,password=p,protocol=https,cacert=/a,cert=/b,key=/c,segment=z/r";
    let args = [
        "--rdzv-backend",
        "c10d",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "a",
        "--rdzv-conf",
        conf,
    ];
    let c = config(&args, &[]);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    // The other spellings, and the password from a file (one source at a time).
    let dir = std::env::temp_dir().join(format!("fsdp-c10d-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pw = dir.join("pw");
    std::fs::write(&pw, "p\n").unwrap();
    let other = format!(
        "password_file={},ca_cert=/a,ssl_cert=/b,ssl_cert_key=/c",
        pw.display()
    );
    let mut other_args = args;
    other_args[7] = &other;
    let c = config(&other_args, &[]);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let mut taken: Vec<String> = parse::rdzv_conf(conf).unwrap().into_keys().collect();
    taken.extend(parse::rdzv_conf(&other).unwrap().into_keys());
    let _ = std::fs::remove_dir_all(&dir);
    for key in rdzv_keys::KEYS {
        assert_eq!(
            taken.iter().any(|k| k == key.name),
            key.c10d,
            "{}: the table and this test disagree",
            key.name
        );
    }
}

// ---- topology ----

#[test]
fn the_segment_comes_from_rdzv_conf_then_slurm_then_the_pod_variable() {
    let nodes = ["--nnodes", "2:4"];
    let args = with(&ETCD, &nodes);
    let c = config(&args, &[]);
    assert_eq!(etcd_mode(&c).rendezvous.segment, "");
    assert_eq!(setting(&c, "segment"), ("none", &Source::Default));
    let pod = [(mode::SEGMENT_ENV, "us-east-1a")];
    let c = config(&args, &pod);
    assert_eq!(etcd_mode(&c).rendezvous.segment, "us-east-1a");
    assert_eq!(
        setting(&c, "segment"),
        ("us-east-1a", &env("FSDP_AGENT_SEGMENT"))
    );
    // Slurm's switches win over the variable.
    let mut step = srun_step("n2", "1");
    step.push(("SLURM_TOPOLOGY_ADDR", "core.leaf3.n2"));
    step.push(("SLURM_TOPOLOGY_ADDR_PATTERN", "switch.switch.node"));
    step.extend(pod);
    let c = config(&[], &step);
    assert_eq!(etcd_mode(&c).rendezvous.segment, "core/leaf3");
    assert!(matches!(setting(&c, "segment").1, Source::Derived(d) if d.starts_with("Slurm:")));
    // And --rdzv-conf over both.
    let c = config(&["--rdzv-conf", "segment=row-2/rack-7"], &step);
    assert_eq!(etcd_mode(&c).rendezvous.segment, "row-2/rack-7");
    assert_eq!(
        setting(&c, "segment"),
        ("row-2/rack-7", &flag("--rdzv-conf"))
    );
    // The c10d backend reads it too; a static group has no use for it.
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let c = static_node_with_rdzv_conf("segment=r");
    assert_eq!(
        c.warnings,
        ["--rdzv-conf segment has no effect with a static rendezvous"]
    );
}

#[test]
fn a_bad_segment_names_where_it_came_from_and_what_a_good_one_is() {
    let args = with(&ETCD, &["--rdzv-conf", "segment=zone-a//rack-3"]);
    let e = error(&args, &[]);
    assert!(
        e.starts_with("--rdzv-conf segment=zone-a//rack-3 has an empty name"),
        "{e}"
    );
    assert!(e.contains("e.g. zone-a/rack-3"), "{e}");
    let e = error(&ETCD, &[(mode::SEGMENT_ENV, "us east")]);
    assert!(
        e.starts_with("invalid segment 'us east' (from env FSDP_AGENT_SEGMENT): has a space"),
        "{e}"
    );
    let long = "r".repeat(300);
    let e = error(&ETCD, &[(mode::SEGMENT_ENV, long.as_str())]);
    assert!(
        e.contains("is 300 characters long; a segment is at most 253"),
        "{e}"
    );
    let mut step = srun_step("n2", "1");
    step.push(("SLURM_TOPOLOGY_ADDR", "s0.s1.n2"));
    step.push(("SLURM_TOPOLOGY_ADDR_PATTERN", "switch.node"));
    let e = error(&[], &step);
    assert!(e.contains("SLURM_TOPOLOGY_ADDR_PATTERN=switch.node"), "{e}");
    assert!(e.contains("--rdzv-conf segment=PATH"), "{e}");
}

/// A pod's variable set from a label the pod lacks is empty: no location, said.
#[test]
fn an_empty_pod_variable_is_no_segment_and_a_warning() {
    let c = config(&ETCD, &[(mode::SEGMENT_ENV, "")]);
    assert_eq!(etcd_mode(&c).rendezvous.segment, "");
    assert!(
        warned(&c, "FSDP_AGENT_SEGMENT is set but empty"),
        "{:?}",
        c.warnings
    );
}

#[test]
fn a_segment_size_needs_a_multiple_within_nnodes_and_an_elastic_rendezvous() {
    let pod = [(mode::SEGMENT_ENV, "rack-1")];
    let c = config(
        &with(&ETCD, &["--nnodes", "4:16", "--segment-size", "4"]),
        &pod,
    );
    assert_eq!(etcd_mode(&c).rendezvous.segment_size, 4);
    assert_eq!(setting(&c, "segment-size"), ("4", &flag("--segment-size")));
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let c = config(&with(&ETCD, &["--nnodes", "4:16"]), &pod);
    assert_eq!(etcd_mode(&c).rendezvous.segment_size, 1);
    assert!(!recorded(&c, "segment-size"));
    let e = error(
        &with(&ETCD, &["--nnodes", "5:7", "--segment-size", "4"]),
        &pod,
    );
    assert!(
        e.starts_with("invalid --segment-size '4' (from flag --segment-size): no multiple of 4 lies within --nnodes 5:7"),
        "{e}"
    );
    let e = error(
        &with(&ETCD, &["--nnodes", "2:4", "--segment-size", "0"]),
        &pod,
    );
    assert!(e.contains("must be at least 1"), "{e}");
    let e = error(
        &with(&ETCD, &["--nnodes", "2:4", "--segment-size", "two"]),
        &pod,
    );
    assert!(e.contains("expected a whole number"), "{e}");
    // Without a segment the node makes blocks only with others that have none.
    let c = config(
        &with(&ETCD, &["--nnodes", "2:4", "--segment-size", "2"]),
        &[],
    );
    assert!(warned(&c, "this node has no segment"), "{:?}", c.warnings);
    let c = config(&["--segment-size", "2"], &[]);
    assert!(
        warned(&c, "--segment-size 2 has no effect"),
        "{:?}",
        c.warnings
    );
}

// ---- log settings ----

#[test]
fn log_settings_default_to_the_console_with_torchruns_prefix() {
    let c = config(&[], &[]);
    let l = &c.logs;
    assert_eq!((l.redirects.clone(), l.tee.clone()), Default::default());
    assert_eq!(l.prefix_template, "[${role_name}${local_rank}]:");
    assert!(!recorded(&c, "log-line-prefix-template"));
    // Shown all the same: where the logs go is what a person looks for first.
    assert_eq!(setting(&c, "log-dir").1, &Source::Default);
    assert_eq!(l.dir, None);
    assert_eq!(l.console_ranks, None);
    assert!(l.stdout_filters.is_empty() && l.stderr_filters.is_empty());
    assert_eq!(c.log_format, LogFormat::Text);
}

#[test]
fn log_settings_from_flags() {
    let c = config(
        &[
            "-r",
            "3",
            "--tee",
            "0:1,12:2",
            "--local-ranks-filter",
            "0,3",
            "--duplicate-stdout-filters",
            "loss,,x,step",
            "--log-dir",
            "/tmp/logs",
            "--log-format",
            "json",
        ],
        &[],
    );
    let l = &c.logs;
    assert!(l.redirects.for_rank(5).stdout && l.redirects.for_rank(5).stderr);
    assert!(l.tee.for_rank(0).stdout && !l.tee.for_rank(0).stderr);
    assert!(l.tee.for_rank(12).stderr && !l.tee.for_rank(1).stderr);
    assert_eq!(l.console_ranks, Some([0, 3].into()));
    assert_eq!(l.stdout_filters, ["loss,x", "step"]);
    assert_eq!(l.dir.as_deref(), Some(std::path::Path::new("/tmp/logs")));
    assert_eq!(setting(&c, "log-dir"), ("/tmp/logs", &flag("--log-dir")));
    assert_eq!(setting(&c, "redirects"), ("3", &flag("--redirects")));
    assert_eq!(c.log_format, LogFormat::Json);
    let e = error(&["--tee", "4"], &[]);
    assert!(e.starts_with("invalid --tee '4' (from flag --tee)"), "{e}");
}

#[test]
fn prefix_template_flag_then_torchelastic_variable_then_default() {
    let var = [("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "<${rank}>")];
    let c = config(&[], &var);
    assert_eq!(c.logs.prefix_template, "<${rank}>");
    assert_eq!(
        setting(&c, "log-line-prefix-template"),
        ("<${rank}>", &env("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"))
    );
    let c = config(&["--log-line-prefix-template", "[${hostname}]"], &var);
    assert_eq!(c.logs.prefix_template, "[${hostname}]");
    assert_eq!(
        setting(&c, "log-line-prefix-template").1,
        &flag("--log-line-prefix-template")
    );
}

// ---- what the workers get, and warnings ----

#[test]
fn flags_without_effect_are_warned_about() {
    let c = config(
        &[
            "--start-method",
            "fork",
            "--event-log-handler",
            "console",
            "--local-addr",
            "10.0.0.1",
        ],
        &[],
    );
    assert!(
        warned(&c, "--start-method has no effect"),
        "{:?}",
        c.warnings
    );
    assert!(
        warned(&c, "--event-log-handler console"),
        "{:?}",
        c.warnings
    );
    assert!(
        warned(
            &c,
            "--local-addr 10.0.0.1 has no effect with a single-node or static rendezvous"
        ),
        "{:?}",
        c.warnings
    );
    assert_eq!(
        setting(&c, "local-addr"),
        ("10.0.0.1", &flag("--local-addr"))
    );
    assert_eq!(c.warnings.len(), 3, "{:?}", c.warnings);
    let c = config(
        &["--start-method", "spawn", "--event-log-handler", "null"],
        &[],
    );
    assert!(
        warned(&c, "--start-method"),
        "an explicit default still warns"
    );
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    // With etcd the address is what the node advertises: no warning.
    assert!(config(&ETCD, &[]).warnings.is_empty());
}

#[test]
fn virtual_local_rank_needs_a_device_per_worker() {
    let args = ["--nproc-per-node", "2", "--virtual-local-rank"];
    let e = error(&args, &[("CUDA_VISIBLE_DEVICES", "3")]);
    assert!(
        e.contains("CUDA_VISIBLE_DEVICES=3 lists 1 for 2 workers"),
        "{e}"
    );
    assert!(config(&args, &[("CUDA_VISIBLE_DEVICES", "3,5")]).virtual_local_rank);
    // Unset or empty: nothing to check against.
    config(&args, &[("CUDA_VISIBLE_DEVICES", " ")]);
    config(&args, &[]);
}

#[test]
fn omp_threads_default_to_one_only_for_several_workers_and_no_setting() {
    assert!(!config(&[], &[]).omp_threads_default);
    assert!(config(&["--nproc-per-node", "2"], &[]).omp_threads_default);
    assert!(!config(&["--nproc-per-node", "2"], &[("OMP_NUM_THREADS", "4")]).omp_threads_default);
}

#[test]
fn nproc_gpu_without_gpus_is_refused_and_cpu_is_counted() {
    let e = error(
        &["--nproc-per-node", "gpu"],
        &[("CUDA_VISIBLE_DEVICES", "")],
    );
    assert!(e.contains("no NVIDIA GPU is visible"), "{e}");
    let c = config(&["--nproc-per-node", "cpu"], &[]);
    assert!(c.nproc_per_node >= 1);
    assert_eq!(
        setting(&c, "nproc-per-node (resolved)").1,
        &Source::Derived("cpu: CPUs available to this process".into())
    );
}

#[test]
fn the_status_address_must_bind_only_when_chosen() {
    let c = config(&[], &[]);
    assert!(matches!(
        c.status,
        StatusAddr::Listen {
            required: false,
            ..
        }
    ));
    let c = config(&["--status-addr", "127.0.0.1:0"], &[]);
    assert!(matches!(
        c.status,
        StatusAddr::Listen { required: true, .. }
    ));
    assert_eq!(
        config(&["--status-addr", "off"], &[]).status,
        StatusAddr::Off
    );
}

#[test]
fn a_standalone_job_keeps_its_status_port_private_unless_told() {
    let listen = |c: Config| match c.status {
        StatusAddr::Listen { addr, required } => (addr.to_string(), required),
        StatusAddr::Off => panic!("off"),
    };
    assert_eq!(
        listen(config(&["--standalone"], &[])),
        ("127.0.0.1:0".into(), false)
    );
    assert_eq!(
        listen(config(&["--nnodes", "2", "--node-rank", "0"], &[])),
        ("0.0.0.0:29450".into(), false)
    );
    // One node on etcd is a one-replica PyTorchJob, whose probes aim at the known port:
    // the default the README gives every job with a rendezvous backend.
    assert_eq!(
        listen(config(
            &[
                "--nnodes",
                "1",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "e:2379",
                "--rdzv-id",
                "j"
            ],
            &[]
        )),
        ("0.0.0.0:29450".into(), false)
    );
    assert_eq!(
        listen(config(
            &["--standalone", "--status-addr", "0.0.0.0:29450"],
            &[]
        )),
        ("0.0.0.0:29450".into(), true)
    );
}

// ---- under srun ----

/// The environment srun gives the agent on node `me` of a three-node step.
fn srun_step(me: &'static str, node_id: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("SLURM_JOB_ID", "42"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_STEP_NUM_NODES", "3"),
        ("SLURM_STEP_NODELIST", "n[1-3]"),
        ("SLURM_STEP_TASKS_PER_NODE", "1(x3)"),
        ("SLURM_NODEID", node_id),
        ("SLURMD_NODENAME", me),
    ]
}

#[test]
fn under_srun_the_group_is_the_steps_nodes_on_a_store_the_first_serves() {
    let c = config(&[], &srun_step("n2", "1"));
    let m = etcd_mode(&c);
    let store = m.store.as_ref().expect("c10d");
    assert_eq!((store.host.as_str(), store.port), ("n1", 29400));
    assert_eq!(store.is_host, Some(false));
    assert_eq!((m.rendezvous.min_nodes, m.rendezvous.max_nodes), (3, 3));
    assert_eq!(c.run_id, "42");
    assert_eq!(setting(&c, "nnodes"), ("3", &env("SLURM_STEP_NUM_NODES")));
    assert_eq!(setting(&c, "rdzv-id"), ("42", &env("SLURM_JOB_ID")));
    let (backend, source) = setting(&c, "rdzv-backend");
    assert_eq!(backend, "c10d");
    assert!(matches!(source, Source::Derived(d) if d.starts_with("Slurm:")));
    assert_eq!(setting(&c, "rdzv-endpoint").0, "n1:29400");
    assert_eq!(setting(&c, "rdzv-conf is_host").0, "false");
    let first = config(&[], &srun_step("n1", "0"));
    assert_eq!(
        etcd_mode(&first).store.as_ref().unwrap().is_host,
        Some(true)
    );
}

#[test]
fn under_srun_given_flags_win_and_standalone_ignores_slurm() {
    let c = config(
        &["--nnodes", "2:3", "--rdzv-id", "mine"],
        &srun_step("n2", "1"),
    );
    assert_eq!(setting(&c, "nnodes"), ("2:3", &flag("--nnodes")));
    assert_eq!(c.run_id, "mine");
    assert_eq!(etcd_mode(&c).rendezvous.min_nodes, 2);
    let c = config(&["--standalone"], &srun_step("n2", "1"));
    assert!(matches!(c.mode, Mode::Standalone { .. }));
    assert_eq!(setting(&c, "nnodes"), ("1:1", &Source::Default));
}

#[test]
fn under_srun_a_static_job_takes_its_rank_from_slurm() {
    let c = config(&["--rdzv-backend", "static"], &srun_step("n3", "2"));
    match &c.mode {
        Mode::Static {
            nnodes,
            node_rank,
            master_addr,
            ..
        } => assert_eq!((*nnodes, *node_rank, master_addr.as_str()), (3, 2, "n1")),
        m => panic!("{m:?}"),
    }
    assert_eq!(setting(&c, "node-rank"), ("2", &env("SLURM_NODEID")));
}

#[test]
fn under_srun_two_agents_on_a_node_is_an_error_naming_the_fix() {
    let mut step = srun_step("n1", "0");
    step.retain(|(k, _)| *k != "SLURM_STEP_TASKS_PER_NODE");
    step.push(("SLURM_STEP_TASKS_PER_NODE", "2(x3)"));
    let e = error(&[], &step);
    assert!(e.contains("--ntasks-per-node=1"), "{e}");
}

// ---- --print-config shows what the workers get ----

#[test]
fn print_config_shows_the_master_the_workers_get_and_where_it_comes_from() {
    // Standalone: the workers get localhost and a free port, not the flag's default.
    let c = config(&["--standalone"], &[]);
    assert_eq!(setting(&c, "master-addr").0, "localhost");
    assert_eq!(
        setting(&c, "master-port").0,
        "a free port, chosen each round"
    );
    assert!(matches!(setting(&c, "master-addr").1, Source::Derived(_)));
    // Static: the given address, and the port with its own source (the default 29500).
    let c = config(
        &["--nnodes", "2", "--node-rank", "0", "--master-addr", "m"],
        &[],
    );
    assert_eq!(setting(&c, "master-addr"), ("m", &flag("--master-addr")));
    assert_eq!(setting(&c, "master-port"), ("29500", &Source::Default));
    let c = config(
        &["--nnodes", "2", "--node-rank", "0", "--master-port", "1234"],
        &[],
    );
    assert_eq!(setting(&c, "master-port"), ("1234", &flag("--master-port")));
    let c = config(
        &[
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--rdzv-endpoint",
            "h:77",
        ],
        &[],
    );
    assert_eq!(setting(&c, "master-addr").0, "h");
    assert_eq!(
        setting(&c, "master-port"),
        ("77", &Source::Derived("--rdzv-endpoint".into()))
    );
    // Elastic: rank 0's node, each round.
    let c = config(
        &[
            "--nnodes",
            "2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "e:2379",
            "--rdzv-id",
            "j",
        ],
        &[],
    );
    assert!(setting(&c, "master-addr").0.contains("rank 0"));
}

#[test]
fn print_config_shows_the_default_log_directory() {
    let c = config(&["--standalone"], &[("TMPDIR", "/scratch/")]);
    assert_eq!(
        setting(&c, "log-dir"),
        (
            "/scratch/fsdp-agent-XXXXXXXX (a new directory each start)",
            &Source::Default
        )
    );
}

#[test]
fn a_flag_is_reported_as_it_was_spelled() {
    let c = config(&["--standalone", "--shutdown-timeout", "5"], &[]);
    assert_eq!(setting(&c, "term-timeout").1, &flag("--shutdown-timeout"));
    let c = config(&["--standalone", "--term_timeout=5"], &[]);
    assert_eq!(setting(&c, "term-timeout").1, &flag("--term_timeout"));
    let c = config(&["--standalone", "--term-timeout", "5"], &[]);
    assert_eq!(setting(&c, "term-timeout").1, &flag("--term-timeout"));
}

#[test]
fn a_static_group_of_several_nodes_on_a_loopback_master_is_warned_about() {
    for master in ["127.0.0.1", "localhost", "::1"] {
        let c = config(
            &["--nnodes", "2", "--node-rank", "0", "--master-addr", master],
            &[],
        );
        assert!(
            warned(&c, "is this machine's loopback"),
            "{master}: {:?}",
            c.warnings
        );
    }
    // The default master is loopback too.
    let c = config(&["--nnodes", "2", "--node-rank", "1"], &[]);
    assert!(
        warned(&c, "--master-addr 127.0.0.1 is this machine's loopback"),
        "{:?}",
        c.warnings
    );
    let c = config(
        &[
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "node0",
        ],
        &[],
    );
    assert!(!warned(&c, "loopback"), "{:?}", c.warnings);
    let c = config(&["--nnodes", "1", "--master-port", "1234"], &[]);
    assert!(!warned(&c, "loopback"), "{:?}", c.warnings);
}

// ---- inputs bounded where they are read: anyone who can write the store or set the ----
// ---- environment can hand the agent any size, so every input has a limit at its reader ----

/// A node list of a hundred million hosts took 2.7 GB and aborted; one of 10^12 padded
/// numbers aborted at once. Only its first host is ever built.
#[test]
fn a_huge_slurm_node_list_costs_nothing() {
    for (list, first) in [
        ("n[1-99999999]", "n1"),
        ("n[000000000000-999999999999]", "n000000000000"),
    ] {
        let mut step = srun_step("n1", "0");
        step.retain(|(k, _)| *k != "SLURM_STEP_NODELIST");
        step.push(("SLURM_STEP_NODELIST", list));
        let c = config(&[], &step);
        let m = etcd_mode(&c);
        assert_eq!(m.store.as_ref().expect("c10d").host, first, "{list}");
    }
}

#[test]
fn worker_counts_no_group_can_hold_are_refused_where_they_are_read() {
    let e = error(&["--nproc-per-node", "99999999"], &[]);
    assert!(e.contains("at most 65536 workers per node"), "{e}");
    for gpus in ["-1", "gpu:8", "99999999"] {
        let mut step = srun_step("n1", "0");
        step.push(("SLURM_GPUS_ON_NODE", gpus));
        let e = error(&[], &step);
        assert!(
            e.contains(&format!(
                "SLURM_GPUS_ON_NODE={gpus} is not a number of GPUs"
            )),
            "{e}"
        );
    }
    let mut step = srun_step("n1", "0");
    step.push(("SLURM_GPUS_ON_NODE", "0"));
    let c = config(&[], &step);
    assert_eq!(c.nproc_per_node, 1, "a node without GPUs keeps the default");
    let mut step = srun_step("n1", "0");
    step.push(("SLURM_GPUS_ON_NODE", "8"));
    assert_eq!(config(&[], &step).nproc_per_node, 8);
}
