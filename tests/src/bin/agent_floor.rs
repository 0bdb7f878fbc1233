//! The least an agent can do, for `bench/agents_scale.py --floor`: the floor under the
//! real agents' figures that this machine and etcd set, as `rdzv-bench --ceiling` is for
//! the simulated ones.
//!
//! Each process grants a lease (kept alive), registers a key on it and watches one round
//! key; node 0 also watches the registrations and, once `--nodes` have registered and
//! whenever their count changes after that, writes the count as the round (one write, one watch event fanned out to every node). A node
//! that sees a round stops its worker (SIGTERM to its process group, then waits for the
//! exit), logs `group formed world_size=N` as the agent does, and starts the worker again
//! in its own process group, by vfork and exec as the agent does (without the agent's
//! death signal: see `Floor::start`). SIGTERM revokes the lease and exits: the leave of a deleted pod. No ranks, no
//! fencing, no status, no checks: so a real agent cannot re-form faster than this on the
//! same machine, whatever its protocol.
//!
//! Usage: agent-floor --endpoint HOST:PORT --run ID --node I --nodes N [--ttl S] -- WORKER [ARGS...]

use std::os::unix::process::CommandExt;
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, PutOptions, WatchOptions};

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut endpoint, mut run, mut node, mut ttl) = (None, None, None, 5i64);
    let mut nodes = None;
    let mut worker = Vec::new();
    while let Some(a) = args.next() {
        let mut v = || {
            args.next()
                .unwrap_or_else(|| usage(&format!("{a} needs a value")))
        };
        match a.as_str() {
            "--endpoint" => endpoint = Some(v()),
            "--run" => run = Some(v()),
            "--node" => node = Some(v().parse::<u32>().unwrap_or_else(|_| usage("--node I"))),
            "--nodes" => nodes = Some(v().parse::<i64>().unwrap_or_else(|_| usage("--nodes N"))),
            "--ttl" => ttl = v().parse().unwrap_or_else(|_| usage("--ttl seconds")),
            "--" => worker = args.by_ref().collect(),
            other => usage(&format!("unknown argument {other}")),
        }
    }
    let (Some(endpoint), Some(run), Some(node), Some(nodes)) = (endpoint, run, node, nodes) else {
        usage("--endpoint, --run, --node and --nodes are required")
    };
    if worker.is_empty() {
        usage("no worker command after --");
    }
    tracing_subscriber::fmt()
        .with_ansi(false)
        .with_target(false)
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let floor = Floor {
        prefix: format!("/floor/{run}/"),
        node,
        nodes,
        ttl,
        worker,
    };
    if let Err(e) = rt.block_on(floor.run(&endpoint)) {
        eprintln!("agent-floor: {e}");
        std::process::exit(1);
    }
}

fn usage(why: &str) -> ! {
    eprintln!(
        "agent-floor: {why}\nusage: agent-floor --endpoint HOST:PORT --run ID --node I --nodes N [--ttl S] -- WORKER [ARGS...]"
    );
    std::process::exit(64)
}

struct Floor {
    prefix: String,
    node: u32,
    nodes: i64,
    ttl: i64,
    worker: Vec<String>,
}

impl Floor {
    async fn run(self, endpoint: &str) -> Result<(), etcd_client::Error> {
        let mut c = Client::connect([endpoint], None).await?;
        let lease = c.lease_grant(self.ttl, None).await?.id();
        let (mut keeper, mut answers) = c.lease_keep_alive(lease).await?;
        let round_key = format!("{}round", self.prefix);
        let members = format!("{}m/", self.prefix);
        let mut rounds = c.watch(round_key.as_str(), None).await?;
        // Node 0 is the coordinator: it counts the registrations from a read, then from
        // a watch that starts where the read ended.
        let mut registrations = None;
        if self.node == 0 {
            let got = c
                .get(
                    members.as_str(),
                    Some(GetOptions::new().with_prefix().with_count_only()),
                )
                .await?;
            let from = got.header().map_or(0, |h| h.revision()) + 1;
            let opts = WatchOptions::new().with_prefix().with_start_revision(from);
            let stream = c.watch(members.as_str(), Some(opts)).await?;
            registrations = Some((stream, got.count()));
        }
        c.put(
            format!("{members}{:05}", self.node),
            Vec::new(),
            Some(PutOptions::new().with_lease(lease)),
        )
        .await?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("a SIGTERM handler");
        let mut tick = tokio::time::interval(Duration::from_secs((self.ttl as u64 / 3).max(1)));
        let mut worker: Option<tokio::process::Child> = None;
        // The first round waits for every node, as `--nnodes N-1:N` seals at N at once.
        let mut count = None::<i64>;
        loop {
            tokio::select! {
                _ = term.recv() => {
                    stop(&mut worker).await;
                    c.lease_revoke(lease).await?;
                    return Ok(());
                }
                _ = tick.tick() => keeper.keep_alive().await?,
                a = answers.message() => { a?; }
                r = rounds.message() => {
                    let Some(r) = r? else { return Ok(()) };
                    for e in r.events() {
                        let Some(kv) = e.kv().filter(|_| e.event_type() == EventType::Put) else { continue };
                        let world: u64 = kv.value_str()?.parse().unwrap_or(0);
                        stop(&mut worker).await;
                        tracing::info!(round = kv.version(), world_size = world, node = self.node, "group formed");
                        worker = Some(self.start());
                    }
                }
                r = async { registrations.as_mut().expect("the coordinator's watch").0.message().await },
                    if registrations.is_some() =>
                {
                    let Some(r) = r? else { return Ok(()) };
                    let (_, before) = registrations.as_mut().expect("the coordinator's watch");
                    for e in r.events() {
                        *before += if e.event_type() == EventType::Put { 1 } else { -1 };
                    }
                    let now = *before;
                    if count.map_or(now >= self.nodes, |c| c != now) {
                        count = Some(now);
                        c.put(round_key.as_str(), now.to_string(), None).await?;
                    }
                }
            }
        }
    }

    /// The worker in its own process group, started without copying this process (std's
    /// `posix_spawn`, a vfork, as the agent's clone is). Less than the agent does: no
    /// death signal, which needs a step in the child that std's spawn cannot run; a floor
    /// may do less, never more.
    fn start(&self) -> tokio::process::Child {
        let mut cmd = std::process::Command::new(&self.worker[0]);
        cmd.args(&self.worker[1..])
            .stdin(std::process::Stdio::null())
            .process_group(0);
        tokio::process::Command::from(cmd)
            .spawn()
            .expect("the worker starts")
    }
}

/// SIGTERM to the worker's group, then waits for it (a `sleep` ends at once).
async fn stop(worker: &mut Option<tokio::process::Child>) {
    if let Some(mut w) = worker.take() {
        if let Some(pid) = w.id() {
            // SAFETY-free: a signal to a process group this process made.
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let _ = w.wait().await;
    }
}
