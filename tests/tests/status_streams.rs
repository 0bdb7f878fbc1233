//! Long streams on the status port never starve the probes: 300 `Liveness` streams to an
//! agent with 1,024 descriptors used to hold all 256 connection slots, and every
//! `/metrics` scrape and `Health/Check` was refused while they stayed open (kubelet's
//! gRPC liveness probe would have restarted a healthy pod).
//!
//! One test per file on purpose: the test lowers its own open-file limit for a moment so
//! that the agent it spawns inherits the low limit, which must not leak into other tests.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use fsdp_proto::v1::LivenessRequest;
use fsdp_proto::v1::agent_status_client::AgentStatusClient;
use fsdp_tests::{Agent, AgentCmd, wait_for};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const LIMIT: Duration = Duration::from_secs(60);
/// The agent's open-file limit: 1,024, as in many containers (a cap of 256 connections).
const AGENT_NOFILE: u64 = 1024;
/// More streams than the agent has connection slots.
const STREAMS: usize = 300;
/// The documented per-address limit (`store/src/streams.rs`).
const STREAMS_PER_PEER: usize = 4;
/// Streams in all: three quarters of the 256 connections of `ulimit -n 1024`.
const MAX_STREAMS: usize = 192;

fn gated_worker(dir: &Path) -> Vec<String> {
    let script = format!(
        "d={}; touch $d/started; while [ ! -f $d/gate ]; do sleep 0.05; done",
        dir.display()
    );
    vec!["--no-python".into(), "/bin/sh".into(), "-c".into(), script]
}

/// What one attempt at a stream got.
#[derive(Debug)]
enum Opened {
    /// The stream is open and its first heartbeat came.
    Stream,
    /// The server answered with this gRPC code.
    Refused(tonic::Code),
    /// No answer (the connection was refused or closed).
    Failed(String),
}

/// Opens one `Liveness` stream on a connection of its own, reports how that went, and
/// holds the connection (and the stream, if any) until `release` changes.
async fn hold_stream(
    addr: SocketAddr,
    from: Option<IpAddr>,
    i: usize,
    report: mpsc::UnboundedSender<Opened>,
    mut release: watch::Receiver<bool>,
) {
    let channel = match Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .local_address(from)
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
    {
        Ok(c) => c,
        Err(e) => {
            let _ = report.send(Opened::Failed(format!("connect: {e}")));
            return;
        }
    };
    let request = LivenessRequest {
        watcher: format!("flood{i}"),
    };
    let mut held = None;
    let outcome = match AgentStatusClient::new(channel.clone())
        .liveness(request)
        .await
    {
        Ok(response) => {
            let mut stream = response.into_inner();
            match stream.message().await {
                Ok(Some(_)) => {
                    held = Some(stream);
                    Opened::Stream
                }
                Ok(None) => Opened::Failed("the stream ended at once".into()),
                Err(s) => Opened::Refused(s.code()),
            }
        }
        Err(s) if s.code() == tonic::Code::Unknown || s.code() == tonic::Code::Unavailable => {
            Opened::Failed(s.to_string())
        }
        Err(s) => Opened::Refused(s.code()),
    };
    let _ = report.send(outcome);
    let _ = release.changed().await;
    drop((held, channel));
}

/// One `GET /metrics` on a new connection.
async fn metrics(addr: SocketAddr) -> Result<String, String> {
    let get = async {
        let mut s = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        s.write_all(
            format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .map_err(|e| format!("send: {e}"))?;
        let mut resp = String::new();
        s.read_to_string(&mut resp)
            .await
            .map_err(|e| format!("read: {e}"))?;
        Ok::<_, String>(resp)
    };
    let resp = tokio::time::timeout(Duration::from_secs(10), get)
        .await
        .map_err(|_| "no answer in 10s".to_owned())??;
    if resp.starts_with("HTTP/1.1 200") && resp.contains("fsdp_agent_ready") {
        Ok(resp)
    } else {
        Err(format!("bad response: {resp:?}"))
    }
}

/// One gRPC health check on a new connection, as kubelet's gRPC probe does it.
async fn health(addr: SocketAddr, service: &str) -> Result<ServingStatus, String> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let r = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map_err(|e| format!("check: {e}"))?;
    Ok(ServingStatus::try_from(r.into_inner().status).unwrap())
}

#[test]
fn liveness_streams_never_starve_the_health_check_or_the_metrics() {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    let own = 4096.min(hard).max(soft);
    setrlimit(Resource::RLIMIT_NOFILE, own, hard).expect("raise RLIMIT_NOFILE");
    assert!(
        own as usize >= STREAMS * 2 + 100,
        "this test needs an open-file limit of at least {} (ulimit -n is {own})",
        STREAMS * 2 + 100
    );
    let dir = tempfile::tempdir().unwrap();
    let mut agent = AgentCmd::with_nofile(dir.path(), "agent", AGENT_NOFILE)
        .args(["--standalone", "--nproc-per-node", "1"])
        .args(gated_worker(dir.path()))
        .spawn();
    let addr: SocketAddr = agent.status_addr().parse().expect("a socket address");
    let started = dir.path().join("started");
    wait_for("the worker", LIMIT, || started.exists());

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();

    // One address: a ring watcher's few streams, and the rest told why not.
    let (outcomes, release) = rt.block_on(wave(addr, |_| None));
    let (opened, exhausted) = tally(&outcomes);
    rt.block_on(assert_probes_answer(&agent, addr));
    assert!(
        (1..=STREAMS_PER_PEER).contains(&opened),
        "{opened} streams open from one address"
    );
    assert!(
        exhausted >= STREAMS / 2,
        "{exhausted} refusals said RESOURCE_EXHAUSTED"
    );
    release.send(true).unwrap();

    // Many addresses (127.0.0.2 and up), each below the per-address limit: together they
    // still get only the stream slots, and the probes their reserved quarter.
    let (outcomes, release) = rt.block_on(wave(addr, |i| {
        let n = 2 + i / (STREAMS_PER_PEER - 1);
        Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, n as u8)))
    }));
    let (opened, _) = tally(&outcomes);
    rt.block_on(assert_probes_answer(&agent, addr));
    assert!(
        (STREAMS_PER_PEER..=MAX_STREAMS).contains(&opened),
        "{opened} streams open from many addresses"
    );
    release.send(true).unwrap();

    drop(rt);
    std::fs::write(dir.path().join("gate"), "").unwrap();
    assert_eq!(agent.code(), 0, "{}", agent.output());
}

/// Opens [`STREAMS`] streams at once, the `i`th from `from(i)`; returns how each went,
/// and what ends them all.
async fn wave(
    addr: SocketAddr,
    from: impl Fn(usize) -> Option<IpAddr>,
) -> (Vec<Opened>, watch::Sender<bool>) {
    let (report, mut reports) = mpsc::unbounded_channel();
    let (release, released) = watch::channel(false);
    for i in 0..STREAMS {
        tokio::spawn(hold_stream(
            addr,
            from(i),
            i,
            report.clone(),
            released.clone(),
        ));
    }
    let mut outcomes = Vec::new();
    while outcomes.len() < STREAMS {
        let next = tokio::time::timeout(LIMIT, reports.recv()).await;
        outcomes.push(next.expect("every stream attempt ends").unwrap());
    }
    (outcomes, release)
}

/// How many streams opened and how many were refused as `RESOURCE_EXHAUSTED`; says so.
fn tally(outcomes: &[Opened]) -> (usize, usize) {
    let opened = outcomes
        .iter()
        .filter(|o| matches!(o, Opened::Stream))
        .count();
    let exhausted = outcomes
        .iter()
        .filter(|o| matches!(o, Opened::Refused(tonic::Code::ResourceExhausted)))
        .count();
    eprintln!(
        "{opened} streams open, {exhausted} refused as RESOURCE_EXHAUSTED, of {STREAMS}; failed: {:?}",
        outcomes
            .iter()
            .filter_map(|o| match o {
                Opened::Failed(e) => Some(e.as_str()),
                _ => None,
            })
            .take(3)
            .collect::<Vec<_>>()
    );
    (opened, exhausted)
}

/// While every stream and connection is held: each probe answers at its first try, as
/// a kubelet probe gets one try per period.
async fn assert_probes_answer(agent: &Agent, addr: SocketAddr) {
    if let Err(e) = metrics(addr).await {
        panic!(
            "/metrics refused under {STREAMS} streams: {e}\n{}",
            agent.output()
        );
    }
    for service in ["", "liveness"] {
        match health(addr, service).await {
            Ok(s) => assert_eq!(s, ServingStatus::Serving, "{service:?}"),
            Err(e) => panic!(
                "Health/Check({service:?}) refused under {STREAMS} streams: {e}\n{}",
                agent.output()
            ),
        }
    }
}
