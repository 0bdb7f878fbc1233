//! The status server (gRPC status, grpc.health.v1, /metrics) against running agents, and
//! `fsdp-agent status` against a real etcd.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use fsdp_proto::v1::agent_status_client::AgentStatusClient;
use fsdp_proto::v1::{AgentState, GetStatusRequest, Phase, WorkerState};
use fsdp_tests::etcd::Etcd;
use fsdp_tests::{Agent, AgentCmd, alive, status_cmd, wait_for};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const LIMIT: Duration = Duration::from_secs(60);

/// `GET /metrics` over plain HTTP/1.1, parsed into `name{labels}` → value. Checks the
/// Prometheus text format on the way: every sample's family has a TYPE line before it.
fn metrics(addr: &str) -> BTreeMap<String, f64> {
    let resp = fsdp_tests::metrics_text(addr);
    let (head, body) = resp.split_once("\r\n\r\n").expect("HTTP response");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    let mut typed = std::collections::HashSet::new();
    let mut out = BTreeMap::new();
    for line in body.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            let name = parts.next().unwrap().to_owned();
            let kind = parts.next().expect("a type");
            assert!(
                ["gauge", "counter", "summary"].contains(&kind),
                "bad type in {line}"
            );
            typed.insert(name);
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (name, value) = line.rsplit_once(' ').expect("`name value`");
        let family = name.split('{').next().unwrap();
        let family = ["_sum", "_count"]
            .iter()
            .find_map(|s| family.strip_suffix(s))
            .filter(|f| typed.contains(*f))
            .unwrap_or(family);
        assert!(typed.contains(family), "sample before its TYPE: {line}");
        let v: f64 = value.parse().unwrap_or_else(|_| panic!("value in {line}"));
        out.insert(name.to_owned(), v);
    }
    out
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn get_status(addr: &str) -> AgentState {
    let mut c = AgentStatusClient::connect(format!("http://{addr}"))
        .await
        .expect("connect to the status service");
    c.get_status(GetStatusRequest {})
        .await
        .expect("GetStatus")
        .into_inner()
}

async fn health(addr: &str, service: &str) -> ServingStatus {
    let mut c = health_client(addr).await;
    let r = c
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .expect("Check")
        .into_inner();
    ServingStatus::try_from(r.status).unwrap()
}

async fn health_client(addr: &str) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect to grpc.health.v1");
    HealthClient::new(channel)
}

/// A worker that waits for a file named after its restart count, then exits with the
/// number in it (local rank 1 just waits to be stopped).
fn gated_worker(dir: &Path) -> Vec<String> {
    let script = format!(
        "d={}; f=$d/gate.$TORCHELASTIC_RESTART_COUNT; \
         if [ \"$LOCAL_RANK\" = 0 ]; then while [ ! -f $f ]; do sleep 0.05; done; exit $(cat $f); \
         else exec sleep 600; fi",
        dir.display()
    );
    vec!["--no-python".into(), "/bin/sh".into(), "-c".into(), script]
}

#[test]
fn status_health_and_metrics_follow_a_worker_failure_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let agent = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--term-timeout",
            "5",
            "--rdzv-id",
            "statusjob",
        ])
        .args(gated_worker(dir.path()))
        .spawn();
    let addr = agent.status_addr();
    let rt = runtime();
    rt.block_on(async {
        wait_for_async("workers running", || async {
            get_status(&addr).await.phase == Phase::Running as i32
        })
        .await;
        let s = get_status(&addr).await;
        assert_eq!(s.run_id, "statusjob");
        assert_eq!(s.backend, "standalone");
        assert!(s.ready);
        assert_eq!((s.world_size, s.restarts_used, s.restarts_left), (2, 0, 1));
        assert_eq!(s.workers.len(), 2);
        for (i, w) in s.workers.iter().enumerate() {
            assert_eq!(w.local_rank, i as u32);
            assert_eq!(w.state, WorkerState::Running as i32);
            assert!(alive(w.pid as i32), "worker pid {} is not alive", w.pid);
        }
        assert!(
            s.last_transition
                .as_ref()
                .unwrap()
                .reason
                .contains("workers started"),
            "{:?}",
            s.last_transition
        );
        assert_eq!(health(&addr, "").await, ServingStatus::Serving);
        assert_eq!(health(&addr, "liveness").await, ServingStatus::Serving);
        assert_eq!(health(&addr, "readiness").await, ServingStatus::Serving);

        // Follow readiness through the failure with the health service's Watch.
        let mut hc = health_client(&addr).await;
        let mut watch = hc
            .watch(HealthCheckRequest {
                service: "readiness".into(),
            })
            .await
            .unwrap()
            .into_inner();
        let first = watch.message().await.unwrap().unwrap();
        assert_eq!(first.status, ServingStatus::Serving as i32);

        let m = metrics(&addr);
        assert_eq!(m["fsdp_agent_ready"], 1.0);
        assert_eq!(m["fsdp_agent_restarts_used"], 0.0);
        assert_eq!(m["fsdp_agent_reform_seconds_count"], 0.0);
        // Two workers started cold (no --prewarm): the counter says so (it once said 0).
        assert_eq!(m["fsdp_agent_worker_starts_total{start=\"cold\"}"], 2.0);

        std::fs::write(dir.path().join("gate.0"), "3").unwrap();
        let mut seen = Vec::new();
        while seen.last() != Some(&(ServingStatus::Serving as i32)) || seen.len() < 2 {
            let msg = tokio::time::timeout(LIMIT, watch.message())
                .await
                .expect("readiness changes")
                .unwrap()
                .unwrap();
            seen.push(msg.status);
        }
        assert_eq!(
            seen,
            [
                ServingStatus::NotServing as i32,
                ServingStatus::Serving as i32
            ],
            "readiness went down for the restart and came back"
        );

        let s = get_status(&addr).await;
        assert_eq!((s.restarts_used, s.restarts_left), (1, 0));
        assert_eq!(s.phase, Phase::Running as i32);
        let m = metrics(&addr);
        assert_eq!(m["fsdp_agent_restarts_used"], 1.0);
        assert_eq!(m["fsdp_agent_restarts_left"], 0.0);
        assert_eq!(m["fsdp_agent_worker_exits_total{exit=\"3\"}"], 1.0);
        assert_eq!(m["fsdp_agent_reforms_total{reason=\"worker failed\"}"], 1.0);
        assert_eq!(m["fsdp_agent_reform_seconds_count"], 1.0);
        assert!(m["fsdp_agent_reform_seconds_sum"] > 0.0);
        assert_eq!(m["fsdp_agent_worker_starts_total{start=\"cold\"}"], 4.0);
    });
    std::fs::write(dir.path().join("gate.1"), "0").unwrap();
    let mut agent = agent;
    // Local rank 1 never ends by itself; SIGTERM the agent to finish the test.
    agent.signal(libc::SIGTERM);
    assert_eq!(agent.code(), 143, "{}", agent.output());
}

async fn wait_for_async<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + LIMIT;
    while !cond().await {
        assert!(
            tokio::time::Instant::now() < end,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn a_busy_status_port_is_an_error_only_when_chosen() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let mut a = AgentCmd::new(dir.path(), "chosen")
        .args([
            "--standalone",
            "--status-addr",
            &format!("127.0.0.1:{port}"),
        ])
        .args(["--no-python", "/bin/true"])
        .run(LIMIT);
    assert_eq!(a.code(), 64, "{}", a.output());
    assert!(
        a.stderr().contains("--status-addr") && a.stderr().contains("cannot be bound"),
        "{}",
        a.output()
    );
    let mut a = AgentCmd::new(dir.path(), "bad")
        .args(["--standalone", "--status-addr", "nonsense"])
        .args(["--no-python", "/bin/true"])
        .run(LIMIT);
    assert_eq!(a.code(), 64, "{}", a.output());
    assert!(a.stderr().contains("HOST:PORT"), "{}", a.output());
    let mut a = AgentCmd::new(dir.path(), "off")
        .args(["--standalone", "--status-addr", "off"])
        .args(["--no-python", "/bin/true"])
        .run(LIMIT);
    assert_eq!(a.code(), 0, "{}", a.output());
    assert!(!a.stderr().contains("status server listening"));
}

fn etcd_agent(dir: &Path, etcd: &Etcd, name: &str, addr: &str) -> Agent {
    AgentCmd::new(dir, name)
        .args([
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
            "--rdzv-id",
            "livejob",
            "--rdzv-conf",
            "last_call_timeout=1,keep_alive_ttl=2",
            "--local-addr",
            addr,
            "--no-python",
            "/bin/sleep",
            "600",
        ])
        .spawn()
}

#[test]
fn status_command_shows_a_live_run_and_the_survivor_reports_the_reform() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start();
    let a = etcd_agent(dir.path(), &etcd, "a", "127.0.1.1");
    wait_for("a's first round", LIMIT, || {
        a.stderr().contains("group formed")
    });
    let b = etcd_agent(dir.path(), &etcd, "b", "127.0.1.2");
    wait_for("a round of two", LIMIT, || {
        a.stderr().contains("world_size=4") && b.stderr().contains("world_size=4")
    });

    let endpoint = etcd.endpoint();
    let (code, json, err) = status_cmd(&[
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "livejob",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).expect("status --json is JSON");
    assert_eq!(v["health"], "healthy", "{json}");
    assert_eq!(v["world_size"], 4);
    let members = v["members"].as_array().unwrap();
    assert_eq!(members.len(), 2, "{json}");
    let addrs: Vec<&str> = members
        .iter()
        .map(|m| m["addr"].as_str().unwrap())
        .collect();
    assert!(
        addrs.contains(&"127.0.1.1") && addrs.contains(&"127.0.1.2"),
        "{json}"
    );
    let bases: Vec<u64> = members
        .iter()
        .map(|m| m["base_rank"].as_u64().unwrap())
        .collect();
    assert_eq!(bases, [0, 2]);
    let ids: Vec<&str> = members
        .iter()
        .map(|m| m["node_id"].as_str().unwrap())
        .collect();
    assert!(ids.contains(&v["coordinator"].as_str().unwrap()), "{json}");

    let (code, table, err) = status_cmd(&["--rdzv-endpoint", &endpoint, "--rdzv-id", "livejob"]);
    assert_eq!(code, 0, "{err}");
    assert!(table.contains("healthy"), "{table}");
    assert!(
        table.contains("NODE") && table.contains("GLOBAL RANKS"),
        "{table}"
    );
    assert!(table.contains("0-1") && table.contains("2-3"), "{table}");

    // The agents' own status agrees: two members with addresses, the same coordinator.
    let a_addr = a.status_addr();
    let rt = runtime();
    let s = rt.block_on(get_status(&a_addr));
    assert_eq!(s.backend, "etcd");
    assert_eq!(s.members.len(), 2);
    assert_eq!(s.world_size, 4);
    assert!(ids.contains(&s.node_id.as_str()));
    assert_eq!(s.coordinator, v["coordinator"].as_str().unwrap());

    // SIGKILL b: a re-forms alone and its metrics say how long that took.
    let a_id = s.node_id.clone();
    b.signal(libc::SIGKILL);
    wait_for("a re-forms alone", LIMIT, || {
        metrics(&a_addr).get("fsdp_agent_members") == Some(&1.0)
            && metrics(&a_addr).get("fsdp_agent_ready") == Some(&1.0)
    });
    let m = metrics(&a_addr);
    assert_eq!(
        m["fsdp_agent_reforms_total{reason=\"member lost\"}"],
        1.0,
        "{m:?}\n{}",
        a.stderr()
    );
    assert_eq!(m["fsdp_agent_detect_seconds_count"], 1.0);
    // Two re-forms: b joining (growth, nothing lost) and b's death.
    assert_eq!(m["fsdp_agent_reform_seconds_count"], 2.0);
    assert!(m["fsdp_agent_reform_seconds_last"] >= m["fsdp_agent_detect_seconds_last"]);
    assert_eq!(m["fsdp_agent_world_size"], 2.0);
    let (code, json, err) = status_cmd(&[
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "livejob",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["members"].as_array().unwrap().len(), 1, "{json}");
    assert_eq!(v["members"][0]["node_id"], a_id.as_str(), "{json}");
    assert_eq!(v["health"], "healthy", "{json}");
    drop(a);
}

#[test]
fn status_command_names_an_unknown_run_and_a_dead_etcd() {
    let etcd = Etcd::start();
    let (code, _, err) = status_cmd(&[
        "--rdzv-endpoint",
        &etcd.endpoint(),
        "--rdzv-id",
        "nosuchrun",
    ]);
    assert_eq!(code, 66, "{err}");
    assert!(
        err.contains("no run 'nosuchrun'") && err.contains("--rdzv-id"),
        "{err}"
    );

    let dead = format!("127.0.0.1:{}", fsdp_tests::free_port());
    let start = std::time::Instant::now();
    let (code, _, err) = status_cmd(&[
        "--rdzv-endpoint",
        &dead,
        "--rdzv-id",
        "x",
        "--rdzv-conf",
        "connect_timeout=2",
    ]);
    assert_eq!(code, 69, "{err}");
    assert!(err.contains("unreachable") && err.contains(&dead), "{err}");
    assert!(start.elapsed() < Duration::from_secs(30));

    let (code, _, err) = status_cmd(&["--rdzv-id", "x"]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("--rdzv-endpoint"), "{err}");
}

/// Server reflection lists the status and health services, so grpcurl needs no .proto.
#[test]
fn reflection_lists_the_status_and_health_services() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let dir = tempfile::tempdir().unwrap();
    let agent = AgentCmd::new(dir.path(), "agent")
        .args(["--standalone", "--no-python", "/bin/sleep", "30"])
        .spawn();
    let addr = agent.status_addr();
    let names = runtime().block_on(async {
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = ServerReflectionClient::new(channel);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut stream = client
            .server_reflection_info(one_message(request))
            .await
            .unwrap()
            .into_inner();
        let reply = stream.message().await.unwrap().unwrap();
        match reply.message_response {
            Some(MessageResponse::ListServicesResponse(l)) => {
                l.service.into_iter().map(|s| s.name).collect::<Vec<_>>()
            }
            other => panic!("unexpected reply {other:?}"),
        }
    });
    for s in ["fsdp.v1.AgentStatus", "grpc.health.v1.Health"] {
        assert!(names.iter().any(|n| n == s), "{s} not in {names:?}");
    }
}

/// A one-message request stream.
fn one_message<T: Send + 'static>(item: T) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::iter(std::iter::once(item))
}

/// An agent of run `leftjob` (`--nnodes 2:3`, one worker) advertising `addr`, with
/// `extra` flags.
fn leaving_agent(dir: &Path, etcd: &Etcd, name: &str, addr: &str, extra: &[&str]) -> Agent {
    AgentCmd::new(dir, name)
        .args([
            "--nnodes",
            "2:3",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
            "--rdzv-id",
            "leftjob",
            // The default lease TTL: a loaded machine that delays a keep-alive past a short
            // one fences a live agent, and its own row would join the ones asserted.
            "--rdzv-conf",
            "last_call_timeout=1",
            "--local-addr",
            addr,
        ])
        .args(extra)
        .args(["--no-python", "/bin/sleep", "600"])
        .spawn()
}

/// `fsdp-agent status --json` of `leftjob`.
fn leftjob_status(etcd: &Etcd) -> serde_json::Value {
    let endpoint = etcd.endpoint();
    let args = [
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "leftjob",
        "--json",
    ];
    let (code, json, err) = status_cmd(&args);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&json).expect("status --json is JSON")
}

/// Polls `leftjob`'s status until `cond` holds; on timeout, fails with the last status and
/// the agents' logs.
fn wait_status(
    etcd: &Etcd,
    what: &str,
    agents: &[&Agent],
    mut cond: impl FnMut(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let end = std::time::Instant::now() + LIMIT;
    loop {
        let v = leftjob_status(etcd);
        if cond(&v) {
            return v;
        }
        if std::time::Instant::now() > end {
            let logs: Vec<String> = agents.iter().map(|a| a.stderr()).collect();
            panic!(
                "timed out waiting for {what}\n{v:#}\n{}",
                logs.join("\n------\n")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The `left` rows of `v` for the node advertising `addr`.
fn left_rows<'a>(v: &'a serde_json::Value, addr: &str) -> Vec<&'a serde_json::Value> {
    v["left"]
        .as_array()
        .expect("a left array")
        .iter()
        .filter(|l| l["addr"] == addr)
        .collect()
}

/// The node ids of the running members of `v`.
fn running(v: &serde_json::Value) -> Vec<String> {
    v["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["state"] == "running")
        .map(|m| m["addr"].as_str().unwrap().to_owned())
        .collect()
}

/// A node whose health check failed exits 79 and its leased record dies with
/// its lease; status, taken once the others formed, still says why it left. So it does
/// for a node stopped by a signal (its own word, and no second "lost" row though its
/// registration went before its word arrived), and for a SIGKILLed node (the coordinator's
/// "lost", nobody else's).
#[test]
fn status_remembers_why_each_node_left() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start();
    let check = "echo checking; echo 'GPU 3: 12 ECC errors' >&2; exit 1";
    let mut sick = leaving_agent(
        dir.path(),
        &etcd,
        "sick",
        "127.0.3.3",
        &["--health-check", check, "--health-check-attempts", "3"],
    );
    let a = leaving_agent(dir.path(), &etcd, "a", "127.0.3.1", &[]);
    let b = leaving_agent(dir.path(), &etcd, "b", "127.0.3.2", &[]);
    assert_eq!(sick.code(), 79, "{}", sick.output());
    let v = wait_status(&etcd, "a and b in a round of two", &[&a, &b], |v| {
        running(v).len() == 2
    });
    let rows = left_rows(&v, "127.0.3.3");
    assert_eq!(rows.len(), 1, "{v:#}");
    assert_eq!(rows[0]["reason"], "unhealthy", "{v:#}");
    let detail = rows[0]["detail"].as_str().unwrap();
    assert!(
        detail.contains("GPU 3: 12 ECC errors") && detail.contains("exit code 79"),
        "{detail}"
    );
    assert_eq!(rows[0]["written_by"], rows[0]["node_id"], "its own word");
    assert!(v["unhealthy"].as_array().unwrap().is_empty(), "{v:#}");

    // The table: the members, then who left and why.
    let endpoint = etcd.endpoint();
    let (code, table, err) = status_cmd(&["--rdzv-endpoint", &endpoint, "--rdzv-id", "leftjob"]);
    assert_eq!(code, 0, "{err}");
    let left_at = table.find("left (newest last):").expect(&table);
    assert!(table.find("127.0.3.1").unwrap() < left_at, "{table}");
    let row = table[left_at..]
        .lines()
        .find(|l| l.contains("127.0.3.3"))
        .expect(&table);
    assert!(
        row.contains("unhealthy") && row.contains("GPU 3: 12 ECC errors"),
        "{table}"
    );

    // A third node joins, then is stopped: it says it left, once.
    let mut c = leaving_agent(dir.path(), &etcd, "c", "127.0.3.4", &[]);
    wait_status(&etcd, "a round of three", &[&a, &b, &c], |v| {
        running(v).len() == 3
    });
    c.signal(libc::SIGTERM);
    assert_eq!(c.code(), 143, "{}", c.output());
    let v = wait_status(&etcd, "a and b again in a round of two", &[&a, &b], |v| {
        running(v).len() == 2 && v["health"] == "healthy"
    });
    let rows = left_rows(&v, "127.0.3.4");
    assert_eq!(rows.len(), 1, "one row for one departure: {v:#}");
    assert_eq!(rows[0]["reason"], "left", "{v:#}");
    assert!(
        rows[0]["detail"].as_str().unwrap().contains("SIGTERM"),
        "{v:#}"
    );

    // SIGKILL b: it says nothing; the coordinator (a, by now) records it lost.
    b.signal(libc::SIGKILL);
    let v = wait_status(&etcd, "b recorded lost", &[&a], |v| {
        !left_rows(v, "127.0.3.2").is_empty()
    });
    let rows = left_rows(&v, "127.0.3.2");
    assert_eq!(rows.len(), 1, "{v:#}");
    assert_eq!(rows[0]["reason"], "lost", "{v:#}");
    let coordinator = v["coordinator"].as_str().expect("a coordinates");
    assert_eq!(rows[0]["written_by"], coordinator, "{v:#}");
    assert_ne!(rows[0]["written_by"], rows[0]["node_id"], "{v:#}");
    // Newest last: the sick node, then c, then b.
    let order: Vec<&str> = v["left"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["addr"].as_str().unwrap())
        .filter(|a| *a != "127.0.3.1")
        .collect();
    assert_eq!(order, ["127.0.3.3", "127.0.3.4", "127.0.3.2"], "{v:#}");
    drop(a);
}
