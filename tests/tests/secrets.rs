//! The etcd password: accepted from a file or `FSDP_ETCD_PASSWORD` (never argv), and never
//! shown: not to the workers, not in the agent's log, `--print-config`, errors, the status
//! reply or the metrics. Against a real etcd with authentication on.

use std::path::Path;
use std::time::Duration;

use fsdp_proto::v1::GetStatusRequest;
use fsdp_proto::v1::agent_status_client::AgentStatusClient;
use fsdp_tests::etcd::Etcd;
use fsdp_tests::{AgentCmd, TempDir, metrics_text, wait_for};

const LIMIT: Duration = Duration::from_secs(60);
const SECRET: &str = "Pw-9f2c7e1b-never-shown";

/// An etcd with user `root` / [`SECRET`] and authentication enabled.
fn etcd_with_auth() -> Etcd {
    let etcd = Etcd::start();
    let rt = runtime();
    rt.block_on(async {
        let mut admin =
            fsdp_rendezvous::etcd::connect(&fsdp_rendezvous::etcd::EtcdOptions::new(vec![
                etcd.endpoint(),
            ]))
            .await
            .unwrap();
        admin.user_add("root", SECRET, None).await.unwrap();
        admin.user_grant_role("root", "root").await.unwrap();
        admin.auth_enable().await.unwrap();
    });
    etcd
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn status_reply(addr: &str) -> String {
    runtime().block_on(async {
        let mut c = AgentStatusClient::connect(format!("http://{addr}"))
            .await
            .expect("connect to the status service");
        let r = c.get_status(GetStatusRequest {}).await.expect("GetStatus");
        format!("{:?}", r.into_inner())
    })
}

/// A worker that records its whole environment, then waits for `gate`.
fn recording_worker(dir: &Path) -> Vec<String> {
    let d = dir.display();
    vec![
        "--no-python".into(),
        "/bin/sh".into(),
        "-c".into(),
        format!("env > {d}/env.$RANK; while [ ! -f {d}/gate ]; do sleep 0.05; done"),
    ]
}

#[test]
fn the_password_reaches_etcd_and_nothing_else() {
    let etcd = etcd_with_auth();
    let dir = TempDir::new().unwrap();
    let pw_file = dir.path().join("etcd-password");
    std::fs::write(&pw_file, format!("{SECRET}\n")).unwrap();
    let file_conf = format!("username=root,password_file={}", pw_file.display());
    let env_conf = format!("username=root,password={SECRET},last_call_timeout=1");
    // (how the password is given: --rdzv-conf, environment)
    let ways: [(&str, Vec<(&str, &str)>); 3] = [
        ("", vec![("PET_RDZV_CONF", env_conf.as_str())]),
        (file_conf.as_str(), vec![]),
        ("username=root", vec![("FSDP_ETCD_PASSWORD", SECRET)]),
    ];
    for (i, (conf, env)) in ways.iter().enumerate() {
        let run = dir.path().join(format!("run{i}"));
        std::fs::create_dir(&run).unwrap();
        let mut cmd = AgentCmd::new(dir.path(), &format!("agent{i}"))
            .env("RUST_LOG", "debug")
            .args([
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                &etcd.endpoint(),
            ])
            .args(["--rdzv-id", &format!("secret{i}"), "--nproc-per-node", "2"]);
        if !conf.is_empty() {
            cmd = cmd.args(["--rdzv-conf", conf]);
        }
        for (k, v) in env {
            cmd = cmd.env(k, v);
        }
        let mut agent = cmd.args(recording_worker(&run)).spawn();
        let addr = agent.status_addr();
        wait_for("both workers' environment", LIMIT, || {
            (0..2).all(|r| {
                std::fs::read_to_string(run.join(format!("env.{r}")))
                    .is_ok_and(|e| e.contains("WORLD_SIZE"))
            })
        });
        let reply = status_reply(&addr);
        let metrics = metrics_text(&addr);
        std::fs::write(run.join("gate"), "").unwrap();
        assert_eq!(agent.code(), 0, "way {i}: {}", agent.output());

        for r in 0..2 {
            let env = std::fs::read_to_string(run.join(format!("env.{r}"))).unwrap();
            assert!(!env.contains(SECRET), "way {i}: worker {r} got it:\n{env}");
            assert!(!env.contains("FSDP_ETCD_PASSWORD"), "way {i}:\n{env}");
            if i == 0 {
                // The rest of PET_RDZV_CONF is still the workers'.
                assert!(
                    env.lines()
                        .any(|l| l == "PET_RDZV_CONF=username=root,last_call_timeout=1"),
                    "way {i}:\n{env}"
                );
            }
        }
        assert!(
            !agent.output().contains(SECRET),
            "way {i}: {}",
            agent.output()
        );
        assert!(!reply.contains(SECRET), "way {i}: {reply}");
        assert!(!metrics.contains(SECRET), "way {i}: {metrics}");
    }

    // A wrong password fails fast, and the error does not echo it either.
    let mut a = AgentCmd::new(dir.path(), "wrong")
        .args([
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
        ])
        .args(["--rdzv-id", "wrong", "--rdzv-conf", "username=root"])
        .env("FSDP_ETCD_PASSWORD", "Wrong-Pw-77ad")
        .args(["--no-python", "/bin/true"])
        .run(LIMIT);
    // A refused credential is configuration (64), not an etcd outage (69).
    assert_eq!(a.code(), 64, "{}", a.output());
    assert!(
        a.stderr().contains("authentication failed"),
        "{}",
        a.stderr()
    );
    assert!(!a.output().contains("Wrong-Pw-77ad"), "{}", a.output());
}

#[test]
fn print_config_and_errors_never_show_the_password() {
    let dir = TempDir::new().unwrap();
    let pw_file = dir.path().join("pw");
    std::fs::write(&pw_file, SECRET).unwrap();
    let etcd = [
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        "e",
        "--rdzv-id",
        "j",
    ];
    let flag_conf = format!("username=root,password={SECRET}");
    let file_conf = format!("username=root,password_file={}", pw_file.display());
    type Way<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>);
    let ways: Vec<Way> = vec![
        (vec!["--rdzv-conf", &flag_conf], vec![]),
        (vec![], vec![("PET_RDZV_CONF", flag_conf.as_str())]),
        (vec!["--rdzv-conf", &file_conf], vec![]),
        (
            vec!["--rdzv-conf", "username=root"],
            vec![("FSDP_ETCD_PASSWORD", SECRET)],
        ),
    ];
    for (args, env) in &ways {
        for format in ["text", "json"] {
            let mut c = AgentCmd::new(dir.path(), "cfg");
            for (k, v) in env {
                c = c.env(k, v);
            }
            let mut a = c
                .args(["--print-config", "--log-format", format])
                .args(etcd)
                .args(args)
                .args(["--no-python", "true"])
                .run(LIMIT);
            assert_eq!(a.code(), 0, "{args:?} {env:?}: {}", a.output());
            assert!(
                !a.output().contains(SECRET),
                "{args:?} {env:?}: {}",
                a.output()
            );
            assert!(a.stdout().contains("rdzv-conf"), "{}", a.stdout());
        }
    }
    // Errors that echo --rdzv-conf, and a password given twice.
    for (conf, env, expect) in [
        (
            format!("password={SECRET},oops"),
            None,
            "'oops' is not key=value",
        ),
        (
            format!("username=root,password={SECRET},no_such_key=1"),
            None,
            "unknown key",
        ),
        (
            format!("username=root,password={SECRET}"),
            Some(("FSDP_ETCD_PASSWORD", SECRET)),
            "FSDP_ETCD_PASSWORD",
        ),
        (
            format!("username=root,password={SECRET},{file_conf}"),
            None,
            "password_file",
        ),
        (format!("password={SECRET}"), None, "username"),
        (
            "username=root,password_file=/no/such/file".into(),
            None,
            "/no/such/file",
        ),
    ] {
        let mut c = AgentCmd::new(dir.path(), "bad");
        if let Some((k, v)) = env {
            c = c.env(k, v);
        }
        let mut a = c
            .args(etcd)
            .args(["--rdzv-conf", &conf])
            .args(["--no-python", "true"])
            .run(LIMIT);
        assert_eq!(a.code(), 64, "{conf}: {}", a.output());
        assert_eq!(a.stderr().lines().count(), 1, "{conf}: {}", a.stderr());
        assert!(a.stderr().contains(expect), "{conf}: {}", a.stderr());
        assert!(!a.output().contains(SECRET), "{conf}: {}", a.output());
    }
}

/// `FSDP_ETCD_PASSWORD=` (a Secret key that does not exist) served an open c10d store with
/// only the generic warning, where an empty `password_file` is exit 64; a FIFO as the
/// password file hung even `--print-config`.
#[test]
fn an_empty_password_variable_or_a_fifo_is_refused_at_once() {
    let dir = TempDir::new().unwrap();
    let c10d = [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:29999",
    ];
    let mut a = AgentCmd::new(dir.path(), "empty")
        .env("FSDP_ETCD_PASSWORD", "")
        .args(["--print-config"])
        .args(c10d)
        .args(["--no-python", "true"])
        .run(LIMIT);
    assert_eq!(a.code(), 64, "{}", a.output());
    assert!(
        a.stderr().contains("FSDP_ETCD_PASSWORD is set but empty"),
        "{}",
        a.output()
    );
    let fifo = dir.path().join("pw");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let mut a = AgentCmd::new(dir.path(), "fifo")
        .args(["--print-config"])
        .args(c10d)
        .arg("--rdzv-conf")
        .arg(format!("password_file={}", fifo.display()))
        .args(["--no-python", "true"])
        .run(Duration::from_secs(10));
    assert_eq!(a.code(), 64, "{}", a.output());
    assert!(
        a.stderr().contains("is not a regular file"),
        "{}",
        a.output()
    );
}
