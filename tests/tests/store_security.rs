//! The c10d store against whoever can reach its port: a password (etcd's own
//! authentication) and TLS with client certificates close it, and a flood of idle
//! connections to a host with 1,024 descriptors neither takes the host's descriptors nor
//! stops its workers restarting. Real agents on 127.0.0.1 (the first to bind serves),
//! the fake worker, and etcd-client as the outsider.

use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, Error as EtcdError, GetOptions};
use fsdp_tests::{Agent, AgentCmd, TempDir, fake_worker_args, free_port, wait_for};

const LIMIT: Duration = Duration::from_secs(90);
const SECRET: &str = "c10d-Pw-4e1f9a";
const SERVING: &str = "serving the c10d rendezvous store";
const OPEN: &str = "the c10d store is open";
const RUN: &str = "sec";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// One agent of a 2-node c10d job on `endpoint`, its workers recording into `dir/name`.
fn agent(
    cmd: AgentCmd,
    dir: &Path,
    name: &str,
    endpoint: &str,
    conf: &str,
    worker: &[&str],
) -> Agent {
    let wdir = dir.join(name);
    std::fs::create_dir_all(&wdir).unwrap();
    let mut args: Vec<String> = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "3",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        RUN,
        "--local-addr",
        "127.0.0.1",
    ]
    .map(String::from)
    .to_vec();
    if !conf.is_empty() {
        args.extend(["--rdzv-conf".into(), conf.into()]);
    }
    args.extend(fake_worker_args(&wdir, worker));
    cmd.args(args).spawn()
}

/// The host first (it must have bound before the other looks), then the other.
fn wait_serving(host: &Agent) {
    wait_for("the host to serve the store", LIMIT, || {
        host.stderr().contains(SERVING)
    });
}

fn grpc_error(e: &EtcdError) -> (tonic::Code, String) {
    match e {
        EtcdError::GRpcStatus(s) => (s.code(), s.message().to_owned()),
        other => panic!("not a gRPC status: {other}"),
    }
}

async fn client(endpoint: &str, user: Option<(&str, &str)>) -> Result<Client, EtcdError> {
    let mut o = ConnectOptions::new().with_connect_timeout(Duration::from_secs(5));
    if let Some((u, p)) = user {
        o = o.with_user(u, p);
    }
    Client::connect([endpoint], Some(o)).await
}

#[test]
fn a_password_keeps_outsiders_out_of_the_store_and_the_job_runs_with_it() {
    let dir = TempDir::new().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let start = |name: &str| {
        let cmd = AgentCmd::new(dir.path(), name).env("FSDP_ETCD_PASSWORD", SECRET);
        agent(cmd, dir.path(), name, &endpoint, "", &["--sleep", "4"])
    };
    let mut host = start("host");
    wait_serving(&host);
    assert!(!host.stderr().contains(OPEN), "{}", host.stderr());
    let mut other = start("other");

    let halt = format!("/fsdp/{RUN}/ctl/halt");
    runtime().block_on(async {
        // No credentials: refused as etcd refuses them, reads and the forged halt alike.
        let mut anon = client(&endpoint, None).await.expect("connect");
        let e = anon
            .get("/", Some(GetOptions::new().with_prefix()))
            .await
            .expect_err("an unauthenticated read is refused");
        assert_eq!(
            grpc_error(&e),
            (
                tonic::Code::InvalidArgument,
                "etcdserver: user name is empty".into()
            )
        );
        let e = anon
            .put(halt.as_str(), "forged", None)
            .await
            .expect_err("a forged ctl/halt is refused");
        assert_eq!(grpc_error(&e).0, tonic::Code::InvalidArgument, "{e:?}");

        // A wrong password: etcd's authentication failure, at connect.
        let e = client(&endpoint, Some(("fsdp", "wrong")))
            .await
            .err()
            .expect("a wrong password is refused");
        assert_eq!(
            grpc_error(&e),
            (
                tonic::Code::InvalidArgument,
                "etcdserver: authentication failed, invalid user ID or password".into()
            )
        );

        // The right one reads the store; the forged halt never landed.
        let mut admin = client(&endpoint, Some(("fsdp", SECRET)))
            .await
            .expect("the password opens the store");
        let r = admin
            .get(halt.as_str(), None)
            .await
            .expect("an authenticated read");
        assert!(r.kvs().is_empty(), "the forged halt was written");
    });

    assert_eq!(host.wait(LIMIT).code(), Some(0), "{}", host.output());
    assert_eq!(other.wait(LIMIT).code(), Some(0), "{}", other.output());
    assert!(
        other
            .stderr()
            .contains("the c10d rendezvous store is served by another agent"),
        "{}",
        other.stderr()
    );
    assert!(!host.output().contains(SECRET) && !other.output().contains(SECRET));
}

/// A CA and one certificate for 127.0.0.1 that every agent presents, as server and client.
fn tls_files(dir: &Path) -> String {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SanType};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec!["localhost".into()]).unwrap();
    p.subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    let cert = p.signed_by(&key, &ca).unwrap();
    for (name, body) in [
        ("ca.pem", ca.pem()),
        ("cert.pem", cert.pem()),
        ("key.pem", key.serialize_pem()),
    ] {
        std::fs::write(dir.join(name), body).unwrap();
    }
    let d = dir.display();
    format!("cacert={d}/ca.pem,cert={d}/cert.pem,key={d}/key.pem")
}

#[test]
fn with_tls_files_the_store_wants_a_client_certificate_and_the_job_runs_over_tls() {
    let dir = TempDir::new().unwrap();
    let conf = tls_files(dir.path());
    let endpoint = format!("127.0.0.1:{}", free_port());
    let start = |name: &str| {
        let cmd = AgentCmd::new(dir.path(), name);
        agent(cmd, dir.path(), name, &endpoint, &conf, &["--sleep", "4"])
    };
    let mut host = start("host");
    wait_serving(&host);
    assert!(!host.stderr().contains(OPEN), "{}", host.stderr());
    let mut other = start("other");

    runtime().block_on(async {
        // Plaintext, and TLS without a client certificate, never get a request through.
        let mut plain = client(&endpoint, None).await.expect("a lazy connect");
        assert!(plain.get("/", None).await.is_err(), "plaintext was served");
        let ca = std::fs::read(dir.path().join("ca.pem")).unwrap();
        let tls =
            etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(ca));
        let anon = Client::connect(
            [format!("https://{endpoint}")],
            Some(
                ConnectOptions::new()
                    .with_tls(tls)
                    .with_connect_timeout(Duration::from_secs(5)),
            ),
        )
        .await;
        if let Ok(mut c) = anon {
            assert!(
                c.get("/", None).await.is_err(),
                "served a client without a certificate"
            );
        }
    });

    assert_eq!(host.wait(LIMIT).code(), Some(0), "{}", host.output());
    assert_eq!(other.wait(LIMIT).code(), Some(0), "{}", other.output());
}

/// Opens `n` TCP connections to `addr` that never send a byte.
fn idle_connections(addr: &str, n: usize) -> Vec<TcpStream> {
    (0..n)
        .filter_map(|_| TcpStream::connect(addr).ok())
        .collect()
}

/// Room for the flood in this process: its soft open-file limit raised to the hard one.
fn raise_own_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
}

#[test]
fn idle_connections_to_a_host_with_1024_descriptors_neither_end_the_job_nor_block_a_restart() {
    raise_own_nofile();
    let dir = TempDir::new().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let worker = ["--sleep", "8"];
    let mut host = agent(
        AgentCmd::with_nofile(dir.path(), "host", 1024),
        dir.path(),
        "host",
        &endpoint,
        "",
        &worker,
    );
    wait_serving(&host);

    // The flood, kept up: 1,100 fresh idle connections every few seconds, as a client
    // that never gives up its connections would hold them.
    let mut flood = idle_connections(&endpoint, 1100);
    assert!(
        flood.len() > 1024,
        "only {} connections opened",
        flood.len()
    );
    let mut other = agent(
        AgentCmd::new(dir.path(), "other"),
        dir.path(),
        "other",
        &endpoint,
        "",
        &worker,
    );

    // The store still answers an outsider's read within a few seconds.
    runtime().block_on(async {
        let read = async {
            let mut c = client(&endpoint, None).await?;
            c.get("/", Some(GetOptions::new().with_prefix().with_keys_only()))
                .await
        };
        tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .expect("a read within 10 s under the flood")
            .expect("a read under the flood");
    });

    // Kill the host's worker once it runs; the restart must find descriptors.
    let pid_file = dir.path().join("host").join("pid.0.0");
    let pid_file_1 = dir.path().join("host").join("pid.0.1");
    let deadline = Instant::now() + LIMIT;
    let mut killed = false;
    let mut refreshed = Instant::now();
    while Instant::now() < deadline && host.child.try_wait().unwrap().is_none() {
        if refreshed.elapsed() > Duration::from_secs(3) {
            flood = idle_connections(&endpoint, 1100);
            refreshed = Instant::now();
        }
        if !killed {
            let found = [&pid_file, &pid_file_1]
                .into_iter()
                .find_map(|p| std::fs::read_to_string(p).ok());
            if let Some(pid) = found.and_then(|t| t.trim().parse::<i32>().ok()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                killed = true;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(flood);
    assert!(killed, "the host's worker never started: {}", host.output());
    assert_eq!(host.wait(LIMIT).code(), Some(0), "{}", host.output());
    assert_eq!(other.wait(LIMIT).code(), Some(0), "{}", other.output());
    let host_dir = dir.path().join("host");
    assert!(
        host_dir.join("pid.1.0").exists() || host_dir.join("pid.1.1").exists(),
        "the killed worker was not restarted: {}",
        host.output()
    );
    assert!(
        !host.stderr().contains("Too many open files"),
        "{}",
        host.stderr()
    );
    // Open, it said so once, at start.
    assert_eq!(host.stderr().matches(OPEN).count(), 1, "{}", host.stderr());
}

/// With a password, the lease calls are behind it too (etcd-client sends them without a
/// token: they are taken on a connection that authenticated). Open, an outsider found a
/// killed agent's lease id in a few probes and kept it alive: the survivors never
/// re-formed, and status said "healthy". Here the outsider is refused every call while it
/// tries, and the survivor re-forms without the killed agent at its lease's expiry.
#[test]
fn an_outsider_cannot_keep_a_dead_agents_lease_alive_on_a_password_store() {
    outsider_holds_the_lease_of(libc::SIGKILL);
}

/// The same with the agent frozen (SIGSTOP): its lease is as silent as a dead one's.
#[test]
fn an_outsider_cannot_keep_a_frozen_agents_lease_alive_on_a_password_store() {
    outsider_holds_the_lease_of(libc::SIGSTOP);
}

fn outsider_holds_the_lease_of(signal: libc::c_int) {
    let dir = TempDir::new().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let run = "held";
    let start = |name: &str| {
        let wdir = dir.path().join(name);
        std::fs::create_dir_all(&wdir).unwrap();
        AgentCmd::new(dir.path(), name)
            .env("FSDP_ETCD_PASSWORD", SECRET)
            .args([
                "--nnodes",
                "1:2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
            ])
            .args([
                "--rdzv-endpoint",
                &endpoint,
                "--rdzv-id",
                run,
                "--local-addr",
                "127.0.0.1",
            ])
            .args(["--rdzv-conf", "keep_alive_ttl=2,last_call_timeout=1"])
            // No ring liveness: the lease alone tells of a death, as for a silent host.
            .args(["--status-addr", "off"])
            .args(fake_worker_args(&wdir, &["--sleep", "600"]))
            .spawn()
    };
    let mut host = start("host");
    wait_serving(&host);
    let victim = start("victim");
    wait_for("a group of two", LIMIT, || {
        host.stderr().contains("world_size=2")
    });
    let rt = runtime();
    let lease = rt.block_on(async {
        let mut admin = client(&endpoint, Some(("fsdp", SECRET))).await.unwrap();
        let members = admin
            .get(
                format!("/fsdp/{run}/members/"),
                Some(GetOptions::new().with_prefix()),
            )
            .await
            .unwrap();
        let host_id = host_node_id(&host.stderr());
        members
            .kvs()
            .iter()
            .find(|kv| !kv.key_str().unwrap().ends_with(&host_id))
            .map(|kv| kv.lease())
            .expect("the victim's registration")
    });
    rt.block_on(async {
        let mut anon = client(&endpoint, None).await.expect("connect");
        let refused = |e: EtcdError| grpc_error(&e);
        let e = refused(anon.lease_grant(5, None).await.expect_err("grant"));
        assert_eq!(e.1, "etcdserver: user name is empty");
        let e = anon
            .lease_time_to_live(
                lease,
                Some(etcd_client::LeaseTimeToLiveOptions::new().with_keys()),
            )
            .await
            .expect_err("time to live");
        assert_eq!(refused(e).1, "etcdserver: user name is empty");
        let e = anon.member_list().await.expect_err("member list");
        assert_eq!(refused(e).1, "etcdserver: user name is empty");
    });
    let killed = Instant::now();
    victim.signal(signal);
    // The outsider keeps trying to renew the dead agent's lease, as fast as it can.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tries = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let outsider = {
        let (stop, tries, endpoint) = (stop.clone(), tries.clone(), endpoint.clone());
        std::thread::spawn(move || {
            runtime().block_on(async {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(mut anon) = client(&endpoint, None).await {
                        let renewed = match anon.lease_keep_alive(lease).await {
                            Ok((mut keeper, mut answers)) => {
                                keeper.keep_alive().await.is_ok()
                                    && matches!(answers.message().await, Ok(Some(a)) if a.ttl() > 0)
                            }
                            Err(_) => false,
                        };
                        assert!(!renewed, "an outsider renewed a lease");
                        tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        })
    };
    wait_for(
        "the survivor re-formed alone",
        Duration::from_secs(30),
        || {
            host.stderr().matches("group formed").count() >= 2
                && host
                    .stderr()
                    .lines()
                    .rfind(|l| l.contains("group formed"))
                    .is_some_and(|l| l.contains("world_size=1"))
        },
    );
    let took = killed.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    outsider
        .join()
        .expect("the outsider never renewed the lease");
    assert!(
        tries.load(std::sync::atomic::Ordering::Relaxed) > 3,
        "the outsider kept trying"
    );
    println!("re-formed {took:?} after signal {signal}, the outsider refused throughout");
    host.signal(libc::SIGTERM);
    let _ = host.wait(LIMIT);
    victim.signal(libc::SIGKILL);
}

/// The node id in an agent's `joined the rendezvous` line.
fn host_node_id(log: &str) -> String {
    log.lines()
        .find(|l| l.contains("joined the rendezvous"))
        .and_then(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("node_id="))
        })
        .expect("the node id")
        .trim_matches('"')
        .to_owned()
}

/// Failed logins were neither slowed nor said: 2,000 guesses took 0.31 s. Now each refusal
/// is answered one at a time after 200 ms, whatever the connections, and the host says so.
#[test]
fn wrong_passwords_are_answered_slowly_and_said_in_the_log() {
    let dir = TempDir::new().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let cmd = AgentCmd::new(dir.path(), "host").env("FSDP_ETCD_PASSWORD", SECRET);
    let mut host = agent(cmd, dir.path(), "host", &endpoint, "", &["--sleep", "600"]);
    wait_serving(&host);
    let started = Instant::now();
    runtime().block_on(async {
        let guesses = (0..10).map(|i| {
            let endpoint = endpoint.clone();
            async move {
                let e = client(&endpoint, Some(("fsdp", &format!("guess-{i}"))))
                    .await
                    .err()
                    .expect("a wrong password is refused");
                grpc_error(&e).0
            }
        });
        for code in futures::future::join_all(guesses).await {
            assert_eq!(code, tonic::Code::InvalidArgument);
        }
        client(&endpoint, Some(("fsdp", SECRET)))
            .await
            .expect("the right password still opens the store");
    });
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1900),
        "10 refusals in {took:?}"
    );
    wait_for("the host says so", LIMIT, || {
        host.stderr()
            .contains("refused a login with a wrong user or password")
    });
    host.signal(libc::SIGTERM);
    let _ = host.wait(LIMIT);
}

/// Tokens expire (`token_ttl`, as etcd's `--auth-token-ttl`): one an outsider copied stops
/// working, and the agents, whose tokens expire too, authenticate again. Before, tokens
/// never expired, and etcd-client never authenticates again by itself: with a 1 s TTL the
/// agents' first write after a second (a failure report, the next round) was refused as a
/// bad password and the job ended.
#[test]
fn tokens_expire_and_the_agents_authenticate_again() {
    let dir = TempDir::new().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    // Restarts 0 and 1 fail after 2.5 s, restart 2 succeeds: two re-forms, each well past
    // the token's second.
    let worker = [
        "--exit-code",
        "1",
        "--fail-after",
        "2.5",
        "--fail-until-restart",
        "2",
        "--sleep",
        "1",
    ];
    let start = |name: &str| {
        let cmd = AgentCmd::new(dir.path(), name).env("FSDP_ETCD_PASSWORD", SECRET);
        agent(cmd, dir.path(), name, &endpoint, "token_ttl=1", &worker)
    };
    let mut host = start("host");
    wait_serving(&host);
    let mut other = start("other");

    runtime().block_on(async {
        let mut copied = client(&endpoint, Some(("fsdp", SECRET))).await.unwrap();
        copied.get("/", None).await.expect("a fresh token reads");
        tokio::time::sleep(Duration::from_millis(2100)).await;
        let e = copied
            .get("/", None)
            .await
            .expect_err("an expired token is refused");
        assert_eq!(
            grpc_error(&e),
            (
                tonic::Code::Unauthenticated,
                "etcdserver: invalid auth token".into()
            )
        );
    });

    assert_eq!(host.wait(LIMIT).code(), Some(0), "{}", host.output());
    assert_eq!(other.wait(LIMIT).code(), Some(0), "{}", other.output());
    for a in [&host, &other] {
        assert!(
            a.stderr().matches("group formed").count() >= 3,
            "two re-forms after the tokens expired: {}",
            a.stderr()
        );
    }
}
