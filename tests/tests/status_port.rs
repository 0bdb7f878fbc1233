//! The status port under a connection flood: whoever can reach the port must not
//! be able to silence the health checks or end the job by exhausting the agent's open files.
//!
//! One test per file on purpose: the test lowers its own open-file limit for a moment so
//! that the agent it spawns inherits the low limit, which must not leak into other tests.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fsdp_tests::{Agent, AgentCmd, wait_for};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const LIMIT: Duration = Duration::from_secs(60);
/// The agent's open-file limit: low, as in many containers, and far below the flood.
const AGENT_NOFILE: u64 = 256;
/// Idle connections the attacker holds (never sending a byte).
const IDLE: usize = 600;
/// Slowloris connections: an HTTP/1 request head that never ends, a byte at a time.
const SLOW: usize = 100;
/// How long the server may keep an idle or slow connection (generous: a busy machine).
const CLOSE_WITHIN: Duration = Duration::from_secs(40);
/// The attacker replaces connections the server closed, at most this many a second, so
/// the flood holds for the whole test without exhausting the machine's ephemeral ports.
const REPLACE_PER_SEC: usize = 50;

/// A worker that starts, records that it did, and exits with the number in
/// `gate.<restart>` once the test writes it.
fn gated_worker(dir: &Path) -> Vec<String> {
    let script = format!(
        "d={}; r=$TORCHELASTIC_RESTART_COUNT; echo $$ > $d/started.$r; \
         while [ ! -f $d/gate.$r ]; do sleep 0.05; done; exit $(cat $d/gate.$r)",
        dir.display()
    );
    vec!["--no-python".into(), "/bin/sh".into(), "-c".into(), script]
}

/// Spawns the agent with its soft open-file limit at `nofile` (inherited across exec).
fn spawn_with_nofile(cmd: AgentCmd, nofile: u64) -> Agent {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    setrlimit(Resource::RLIMIT_NOFILE, nofile.min(hard), hard).expect("lower RLIMIT_NOFILE");
    let agent = cmd.spawn();
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).expect("restore RLIMIT_NOFILE");
    agent
}

/// Makes room for the flood in this process; returns the soft limit it got.
fn raise_own_nofile(want: u64) -> u64 {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    let target = want.min(hard).max(soft);
    setrlimit(Resource::RLIMIT_NOFILE, target, hard).expect("raise RLIMIT_NOFILE");
    target
}

/// The address the agent's status server bound, from its log line.
fn status_addr(agent: &mut Agent) -> SocketAddr {
    let mut addr = None;
    wait_while_alive(agent, "the status server's log line", |a| {
        addr = a
            .stderr()
            .lines()
            .find(|l| l.contains("status server listening"))
            .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("addr=")))
            .map(|a| a.parse().expect("a socket address"));
        addr.is_some()
    });
    addr.unwrap()
}

/// Like `wait_for`, but fails at once, with the agent's output, if the agent exits.
fn wait_while_alive(agent: &mut Agent, what: &str, mut cond: impl FnMut(&Agent) -> bool) {
    let end = Instant::now() + LIMIT;
    while !cond(agent) {
        if let Some(s) = agent.child.try_wait().expect("try_wait") {
            panic!(
                "the agent exited ({s:?}) while waiting for {what}\n{}",
                agent.output()
            );
        }
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One `GET /metrics` over HTTP/1.1: the status line and body, or why not.
fn get_metrics(addr: SocketAddr) -> Result<String, String> {
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("send: {e}"))?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)
        .map_err(|e| format!("read: {e}"))?;
    if resp.starts_with("HTTP/1.1 200") && resp.contains("fsdp_agent_ready") {
        Ok(resp)
    } else {
        Err(format!("bad response: {resp:?}"))
    }
}

/// Tries a probe may take. A kubelet probe gets one try per period, so a newcomer must
/// get in at once even when the port is full, not once a slot frees up (after the head
/// timeout); a few tries allow for one evicted in the instant before it spoke.
const PROBE_TRIES: usize = 5;

/// `/metrics` answers within [`PROBE_TRIES`] connections.
fn assert_metrics_answer(agent: &Agent, addr: SocketAddr) -> String {
    let mut errors = Vec::new();
    loop {
        match get_metrics(addr) {
            Ok(body) => return body,
            Err(e) => errors.push(e),
        }
        assert!(
            errors.len() < PROBE_TRIES,
            "/metrics did not answer under the flood: {errors:?}\n{}",
            agent.output()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The gRPC health check for `service` answers (over HTTP/2) within [`PROBE_TRIES`]
/// connections.
fn health(agent: &Agent, addr: SocketAddr, service: &str) -> ServingStatus {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut errors = Vec::new();
    loop {
        let r = rt.block_on(async {
            let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect_timeout(Duration::from_secs(5))
                .timeout(Duration::from_secs(10))
                .connect()
                .await
                .map_err(|e| format!("connect: {e}"))?;
            HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .map_err(|e| format!("check: {e}"))
        });
        match r {
            Ok(r) => return ServingStatus::try_from(r.into_inner().status).unwrap(),
            Err(e) => errors.push(e),
        }
        assert!(
            errors.len() < PROBE_TRIES,
            "the health check did not answer under the flood: {errors:?}\n{}",
            agent.output()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// What the attacker saw.
#[derive(Debug, Default)]
struct Seen {
    /// Whether the first wave has been opened (or failed to).
    first_wave_done: bool,
    /// Connections of the first wave still open.
    first_wave_open: usize,
    /// How long each connection the server closed had lived.
    lifetimes: Vec<Duration>,
    /// Connections that could not be opened (refused or timed out).
    connect_failures: usize,
    /// The oldest connection still open, at the last scan.
    oldest_open: Duration,
}

struct Conn {
    stream: TcpStream,
    opened: Instant,
    first_wave: bool,
    /// Bytes of the never-ending request head sent so far; `None` for an idle connection.
    slow: Option<usize>,
}

/// The flood: `IDLE` idle and `SLOW` slowloris connections, each replaced when the server
/// closes it, until stopped.
struct Attack {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

const SLOW_HEAD: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: a\r\n";
const SLOW_LINE: &[u8] = b"X-a: b\r\n";

fn slow_byte(sent: usize) -> u8 {
    if sent < SLOW_HEAD.len() {
        SLOW_HEAD[sent]
    } else {
        SLOW_LINE[(sent - SLOW_HEAD.len()) % SLOW_LINE.len()]
    }
}

fn connect(addr: SocketAddr) -> Option<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_nonblocking(true).ok()?;
    Some(s)
}

/// Whether the server has closed `c` (EOF or an error on read or write).
fn closed(c: &mut Conn) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match c.stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(_) => return true,
        }
    }
    if let Some(sent) = &mut c.slow {
        match c.stream.write(&[slow_byte(*sent)]) {
            Ok(n) => *sent += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(_) => return true,
        }
    }
    false
}

impl Attack {
    fn start(addr: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (stop2, seen2) = (stop.clone(), seen.clone());
        let thread = std::thread::spawn(move || {
            let mut conns: Vec<Conn> = Vec::new();
            let mut failed_in_a_row = 0;
            for i in 0..IDLE + SLOW {
                // A port whose backlog is full drops new connections: it is already
                // saturated, and waiting out every timeout would only slow the test.
                if failed_in_a_row >= 3 {
                    seen2.lock().unwrap().connect_failures += 1;
                    continue;
                }
                match connect(addr) {
                    Some(stream) => {
                        failed_in_a_row = 0;
                        conns.push(Conn {
                            stream,
                            opened: Instant::now(),
                            first_wave: true,
                            slow: (i >= IDLE).then_some(0),
                        });
                    }
                    None => {
                        failed_in_a_row += 1;
                        seen2.lock().unwrap().connect_failures += 1;
                    }
                }
            }
            let mut missing = (IDLE + SLOW - conns.len(), 0);
            let mut budget = 0.0f64;
            let mut last = Instant::now();
            while !stop2.load(Ordering::SeqCst) {
                let now = Instant::now();
                budget = (budget + now.duration_since(last).as_secs_f64() * REPLACE_PER_SEC as f64)
                    .min(REPLACE_PER_SEC as f64);
                last = now;
                let mut lifetimes = Vec::new();
                conns.retain_mut(|c| {
                    if closed(c) {
                        lifetimes.push(c.opened.elapsed());
                        if c.slow.is_some() {
                            missing.1 += 1;
                        } else {
                            missing.0 += 1;
                        }
                        false
                    } else {
                        true
                    }
                });
                let mut failures = 0;
                while budget >= 1.0 && missing.0 + missing.1 > 0 {
                    budget -= 1.0;
                    let slow = missing.1 > 0;
                    match connect(addr) {
                        Some(stream) => {
                            if slow {
                                missing.1 -= 1;
                            } else {
                                missing.0 -= 1;
                            }
                            conns.push(Conn {
                                stream,
                                opened: Instant::now(),
                                first_wave: false,
                                slow: slow.then_some(0),
                            });
                        }
                        None => failures += 1,
                    }
                }
                {
                    let mut s = seen2.lock().unwrap();
                    s.lifetimes.extend(lifetimes);
                    s.connect_failures += failures;
                    s.first_wave_done = true;
                    s.first_wave_open = conns.iter().filter(|c| c.first_wave).count();
                    s.oldest_open = conns
                        .iter()
                        .map(|c| c.opened.elapsed())
                        .max()
                        .unwrap_or_default();
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Self {
            stop,
            seen,
            thread: Some(thread),
        }
    }

    fn seen<T>(&self, f: impl FnOnce(&Seen) -> T) -> T {
        f(&self.seen.lock().unwrap())
    }
}

impl Drop for Attack {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn a_connection_flood_on_the_status_port_neither_silences_it_nor_ends_the_job() {
    // Room for the flood here, whatever limit the test runner has.
    let own = raise_own_nofile(4096);
    assert!(
        own as usize >= IDLE + SLOW + 200,
        "this test needs an open-file limit of at least {} (ulimit -n is {own})",
        IDLE + SLOW + 200
    );
    let dir = tempfile::tempdir().unwrap();
    let cmd = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "1",
            "--rdzv-id",
            "floodjob",
        ])
        .args(gated_worker(dir.path()));
    let mut agent = spawn_with_nofile(cmd, AGENT_NOFILE);
    let addr = status_addr(&mut agent);
    let records = dir.path().to_path_buf();
    let started = |n: u32| {
        let p = records.join(format!("started.{n}"));
        move |_: &Agent| p.exists()
    };
    wait_while_alive(&mut agent, "the first worker", started(0));

    let attack = Attack::start(addr);
    wait_for("the flood's first wave", LIMIT, || {
        attack.seen(|s| s.first_wave_done)
    });

    // The port keeps answering, over HTTP/1.1 and HTTP/2, while the flood holds.
    assert_metrics_answer(&agent, addr);
    assert_eq!(health(&agent, addr, ""), ServingStatus::Serving);
    assert_eq!(health(&agent, addr, "readiness"), ServingStatus::Serving);
    // Most of the agent's descriptors stay free for its workers.
    let fds = open_fds(agent.pid());
    eprintln!("the agent holds {fds} descriptors under the flood");
    assert!(
        fds as u64 <= AGENT_NOFILE / 2,
        "the agent holds {fds} of its {AGENT_NOFILE} descriptors under the flood"
    );

    // A worker fails and the agent restarts the group, still under the flood.
    std::fs::write(dir.path().join("gate.0"), "3").unwrap();
    wait_while_alive(&mut agent, "the restarted worker", started(1));
    wait_for("readiness after the restart", LIMIT, || {
        health(&agent, addr, "readiness") == ServingStatus::Serving
    });
    let m = assert_metrics_answer(&agent, addr);
    assert!(m.contains("fsdp_agent_restarts_used 1"), "{m}");

    // The server closed the idle and slow connections, each within a bounded time.
    wait_for("the server to close the first wave", LIMIT, || {
        attack.seen(|s| s.first_wave_open) == 0
    });
    let (lifetimes, oldest) = attack.seen(|s| (s.lifetimes.clone(), s.oldest_open));
    let longest = lifetimes.iter().max().copied().unwrap_or_default();
    eprintln!(
        "{} connections closed by the server, the longest after {longest:?}; {} connects failed",
        lifetimes.len(),
        attack.seen(|s| s.connect_failures)
    );
    assert!(
        longest <= CLOSE_WITHIN && oldest <= CLOSE_WITHIN,
        "connections lived {longest:?} (closed) and {oldest:?} (still open)"
    );
    drop(attack);

    // Below the cap nothing is evicted: the timeouts alone close silent and slow peers.
    let mut quiet: Vec<Conn> = (0..10)
        .map(|i| Conn {
            stream: connect(addr).expect("connect after the flood"),
            opened: Instant::now(),
            first_wave: true,
            slow: (i % 2 == 1).then_some(0),
        })
        .collect();
    let mut lifetimes = Vec::new();
    wait_for(
        "the server to time out silent and slow connections",
        LIMIT,
        || {
            quiet.retain_mut(|c| {
                let gone = closed(c);
                if gone {
                    lifetimes.push(c.opened.elapsed());
                }
                !gone
            });
            std::thread::sleep(Duration::from_millis(100));
            quiet.is_empty()
        },
    );
    let longest = lifetimes.iter().max().unwrap();
    assert!(
        *longest <= CLOSE_WITHIN,
        "a silent or slow connection lived {longest:?}"
    );

    std::fs::write(dir.path().join("gate.1"), "0").unwrap();
    assert_eq!(agent.code(), 0, "{}", agent.output());
}

/// A status server peers cannot reach (loopback, on a node that advertises another
/// address) turns fast detection off for the node: one warning says so and what detection
/// falls back to (it once fell back in silence).
#[test]
fn a_status_address_peers_cannot_reach_is_said_with_the_fallback() {
    let dir = fsdp_tests::TempDir::new().unwrap();
    let etcd = fsdp_tests::etcd::Etcd::start();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--nnodes",
            "2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-id",
            "unreach",
        ])
        .args([
            "--rdzv-endpoint",
            &etcd.endpoint(),
            "--local-addr",
            "10.9.8.7",
        ])
        .args(["--status-addr", "127.0.0.1:0", "--no-python", "true"])
        .spawn();
    wait_for("the warning", Duration::from_secs(60), || {
        a.stderr()
            .contains("peers cannot reach status server 127.0.0.1:")
    });
    let err = a.stderr();
    assert!(
        err.contains("at 10.9.8.7: no fast detection here, death seen at lease expiry"),
        "{err}"
    );
    a.signal(libc::SIGKILL);
    let _ = a.wait(Duration::from_secs(10));
}
