//! A static group waits for its nodes before any worker starts, as torchrun's static
//! rendezvous does (its agents meet in a TCPStore on the master's port).
//!
//! Without it, `--nnodes 2` with one node started launched that node's workers at once and
//! left them in `init_process_group` until PyTorch's own timeout (30 minutes by default).
//! Here node rank 0's agent holds the master's port before its workers need it; the other
//! agents connect there, say who they are, and wait. When every node rank of `--nnodes` is
//! there, node 0 says `go` to each, closes the port, and every node starts its workers
//! (whose rank 0 then binds the same port for their own store).
//!
//! The wire, one line each way at a time: node 0 speaks first ([`BANNER`]), so an agent
//! that meets a silent port knows it met something else: a TCPStore of workers that
//! already started (a node restarted into a running group starts at once), or torchrun's
//! agent (its keys show there: a mixed job, refused in one line). A torchrun agent that
//! reaches node 0's gate opens with TCPStore's greeting, and is refused the same way.
//!
//! [`Gathering`] decides who may join, without I/O; [`gather`] does the I/O.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::RendezvousError;
use crate::etcd::waiting::{EVERY, words};
use crate::static_group::StaticConfig;

/// What node 0 says first.
const BANNER: &str = "fsdp-agent static gate 1";
/// Longer lines are not ours.
const MAX_LINE: u64 = 1024;
/// How long a connection may take to say who it is (and an agent to hear the banner).
const HELLO_PATIENCE: Duration = Duration::from_secs(2);

/// A node that asked to join: its rank, its group size and its run id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub node_rank: u32,
    pub nnodes: u32,
    pub run_id: String,
}

impl Hello {
    fn line(&self) -> String {
        format!("node {} {} {}\n", self.node_rank, self.nnodes, self.run_id)
    }

    fn parse(line: &str) -> Option<Self> {
        let mut words = line.trim_end().splitn(4, ' ');
        let (Some("node"), Some(rank), Some(nnodes), Some(run_id)) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            return None;
        };
        Some(Self {
            node_rank: rank.parse().ok()?,
            nnodes: nnodes.parse().ok()?,
            run_id: run_id.to_owned(),
        })
    }
}

/// Node 0's count of who is there: a pure decision per arrival.
#[derive(Debug, Clone)]
pub struct Gathering {
    nnodes: u32,
    run_id: String,
    /// Node ranks present, node 0's own included.
    present: std::collections::BTreeSet<u32>,
}

/// What to do with a node that said hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arrival {
    /// It joins the count.
    Joins,
    /// Its rank is held by a connection that is still open: refused, for this reason.
    Refused(String),
}

impl Gathering {
    pub fn new(cfg: &StaticConfig) -> Self {
        Self {
            nnodes: cfg.nnodes,
            run_id: cfg.run_id.clone(),
            present: [0].into(),
        }
    }

    /// Judges `hello`; `held_open` says whether the connection that holds its rank, if
    /// any, is still open (a node restarted while it waited takes its place back).
    pub fn arrive(&mut self, hello: &Hello, held_open: bool) -> Arrival {
        let refuse = |why: String| Arrival::Refused(why);
        if hello.nnodes != self.nnodes {
            return refuse(format!(
                "node rank {} was started with --nnodes {}, node rank 0 with --nnodes {}; give every node the same --nnodes",
                hello.node_rank, hello.nnodes, self.nnodes
            ));
        }
        if hello.run_id != self.run_id {
            return refuse(format!(
                "node rank {} is in run '{}', node rank 0 in run '{}'; give every node the same --rdzv-id (or another --master-port per job)",
                hello.node_rank, hello.run_id, self.run_id
            ));
        }
        if hello.node_rank == 0 || hello.node_rank >= self.nnodes {
            return refuse(format!(
                "node rank {} does not fit a group of {} whose node rank 0 is here; give each node its own --node-rank in 1..{}",
                hello.node_rank,
                self.nnodes,
                self.nnodes - 1
            ));
        }
        if self.present.contains(&hello.node_rank) && held_open {
            return refuse(format!(
                "node rank {} is already here; give each node its own --node-rank",
                hello.node_rank
            ));
        }
        self.present.insert(hello.node_rank);
        Arrival::Joins
    }

    /// Node `rank`'s connection closed before the group formed.
    pub fn leave(&mut self, rank: u32) {
        if rank != 0 {
            self.present.remove(&rank);
        }
    }

    /// The node ranks present.
    pub fn count(&self) -> u32 {
        self.present.len() as u32
    }

    /// The node ranks not there yet.
    pub fn missing(&self) -> Vec<u32> {
        (0..self.nnodes)
            .filter(|r| !self.present.contains(r))
            .collect()
    }

    pub fn complete(&self) -> bool {
        self.count() == self.nnodes
    }
}

/// What a waiting node says: the count it last knew and the fix.
fn waiting_line(cfg: &StaticConfig, present: Option<u32>, missing: &str) -> String {
    let at = format!("static group at {}:{}", cfg.master_addr, cfg.master_port);
    match present {
        Some(n) => format!(
            "waiting for nodes: {n} of {} present{missing} ({at})",
            cfg.nnodes
        ),
        None => format!("waiting for node rank 0 to answer ({at})"),
    }
}

fn fix(cfg: &StaticConfig, present: Option<u32>) -> String {
    match present {
        Some(_) => format!(
            "start the others with --nnodes {} and their own --node-rank, or lower --nnodes",
            cfg.nnodes
        ),
        None => {
            "start node rank 0 with the same --master-addr and --master-port, or check them".into()
        }
    }
}

/// Waits until every node of the group is there (or the deadline passes, or the job
/// cannot form). Node rank 0 hosts the gate; the others knock.
pub async fn gather(cfg: &StaticConfig) -> Result<(), RendezvousError> {
    let began = Instant::now();
    let deadline = began + cfg.join_timeout;
    // What the progress line says: the count known, and the missing ranks (node 0 only).
    let present: Cell<Option<u32>> = Cell::new(None);
    let missing: Cell<Vec<u32>> = Cell::new(Vec::new());
    let work = async {
        if cfg.node_rank == 0 {
            host(cfg, &present, &missing).await
        } else {
            knock(cfg, &present).await
        }
    };
    tokio::pin!(work);
    let mut tick = tokio::time::interval_at(began + EVERY, EVERY);
    let say = |waited: Option<Duration>| {
        let gaps = missing.take();
        let shown = match gaps.is_empty() {
            true => String::new(),
            false => {
                let ranks: Vec<String> = gaps.iter().map(u32::to_string).collect();
                format!(", missing node rank {}", ranks.join(", "))
            }
        };
        missing.set(gaps);
        let what = waiting_line(cfg, present.get(), &shown);
        let fix = fix(cfg, present.get());
        match waited {
            Some(w) => format!("{what} for {}; {fix}", words(w)),
            None => format!(
                "no group formed within join_timeout ({}): {what}; {fix}",
                words(cfg.join_timeout)
            ),
        }
    };
    loop {
        tokio::select! {
            r = &mut work => return r,
            _ = tick.tick() => tracing::info!("{}", say(Some(began.elapsed()))),
            () = tokio::time::sleep_until(deadline) => return Err(RendezvousError::Timeout(say(None))),
        }
    }
}

/// Node 0: holds the master's port until every node rank is there.
async fn host(
    cfg: &StaticConfig,
    present: &Cell<Option<u32>>,
    missing: &Cell<Vec<u32>>,
) -> Result<(), RendezvousError> {
    let listener = match listen(cfg.master_port).await {
        Ok(l) => l,
        Err(e) => {
            // Something holds the port: this node's workers from before, or another
            // program, which the workers' store will meet too. Waiting here would not help.
            tracing::warn!(
                port = cfg.master_port,
                error = %e,
                "the master port is taken on this node; starting without waiting for the other nodes"
            );
            return Ok(());
        }
    };
    let mut gathering = Gathering::new(cfg);
    let mut held: BTreeMap<u32, BufReader<TcpStream>> = BTreeMap::new();
    let mut hellos = tokio::task::JoinSet::new();
    let show = |g: &Gathering| {
        present.set(Some(g.count()));
        missing.set(g.missing());
    };
    show(&gathering);
    while !gathering.complete() {
        tokio::select! {
            accepted = listener.accept() => {
                if let Ok((stream, _)) = accepted {
                    hellos.spawn(hear(stream));
                }
            }
            Some(Ok((stream, said))) = hellos.join_next(), if !hellos.is_empty() => {
                let hello = match said {
                    Said::Hello(h) => h,
                    Said::Torchrun => return Err(RendezvousError::TorchrunPeer(format!(
                        "a torchrun agent knocked at this node's master port {}: {}",
                        cfg.master_port,
                        fsdp_store::tcpstore::SAME_LAUNCHER
                    ))),
                    Said::Other => continue,
                };
                // A node that went away while it waited is not counted.
                let gone: Vec<u32> = held.iter().filter(|(_, s)| !still_open(s)).map(|(r, _)| *r).collect();
                for rank in gone {
                    held.remove(&rank);
                    gathering.leave(rank);
                }
                let open = held.contains_key(&hello.node_rank);
                let mut stream = stream;
                match gathering.arrive(&hello, open) {
                    Arrival::Joins => {
                        held.insert(hello.node_rank, stream);
                        show(&gathering);
                        let have = format!("have {}\n", gathering.count());
                        for s in held.values_mut() {
                            let _ = s.get_mut().write_all(have.as_bytes()).await;
                        }
                    }
                    Arrival::Refused(why) => {
                        tracing::warn!(reason = %why, "refused a node at the static group's gate");
                        let _ = stream.get_mut().write_all(format!("refused {why}\n").as_bytes()).await;
                    }
                }
            }
        }
    }
    drop(listener);
    for s in held.values_mut() {
        let _ = s.get_mut().write_all(b"go\n").await;
    }
    // The others close first, so that no closed connection of ours lingers on the port
    // the workers' store is about to bind.
    let closed = async {
        for s in held.values_mut() {
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
        }
    };
    let _ = tokio::time::timeout(HELLO_PATIENCE, closed).await;
    tracing::info!(
        nnodes = cfg.nnodes,
        "every node of the static group is here"
    );
    Ok(())
}

/// The master's port on every address (IPv6 and IPv4 where the host has both).
async fn listen(port: u16) -> std::io::Result<TcpListener> {
    match TcpListener::bind(("::", port)).await {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(e),
        Err(_) => TcpListener::bind(("0.0.0.0", port)).await,
    }
}

/// Whether a held connection is still open (its node did not go away while it waited).
fn still_open(s: &BufReader<TcpStream>) -> bool {
    let mut byte = [0u8; 1];
    match s.get_ref().try_read(&mut byte) {
        // The node closed it.
        Ok(0) => false,
        // Said more than it should: still there all the same.
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
    }
}

/// What a connection to the gate said first.
enum Said {
    Hello(Hello),
    /// TCPStore's greeting: torchrun's agent.
    Torchrun,
    /// Nothing we understand, or nothing in time.
    Other,
}

/// Greets a connection and hears who it is.
async fn hear(stream: TcpStream) -> (BufReader<TcpStream>, Said) {
    let mut stream = BufReader::new(stream);
    let said = async {
        stream
            .get_mut()
            .write_all(format!("{BANNER}\n").as_bytes())
            .await
            .ok()?;
        let first = stream.fill_buf().await.ok()?.to_vec();
        if fsdp_store::tcpstore::greeting(&first) != fsdp_store::tcpstore::Greeting::Other {
            return Some(Said::Torchrun);
        }
        let line = read_line(&mut stream).await?;
        Some(Hello::parse(&line).map_or(Said::Other, Said::Hello))
    };
    let said = tokio::time::timeout(HELLO_PATIENCE, said)
        .await
        .ok()
        .flatten()
        .unwrap_or(Said::Other);
    (stream, said)
}

/// One line, at most [`MAX_LINE`] bytes; `None` at the end of the stream.
async fn read_line(stream: &mut BufReader<TcpStream>) -> Option<String> {
    let mut line = String::new();
    let n = (&mut *stream)
        .take(MAX_LINE)
        .read_line(&mut line)
        .await
        .ok()?;
    (n > 0).then_some(line)
}

/// A node other than 0: knocks at the master's port until node 0's gate says `go`, or
/// finds the group already started.
async fn knock(cfg: &StaticConfig, present: &Cell<Option<u32>>) -> Result<(), RendezvousError> {
    use fsdp_store::tcpstore::{Found, SAME_LAUNCHER, has_torchrun_agent_keys, probe};
    let hello = Hello {
        node_rank: cfg.node_rank,
        nnodes: cfg.nnodes,
        run_id: cfg.run_id.clone(),
    };
    let at = (cfg.master_addr.as_str(), cfg.master_port);
    loop {
        let connected = tokio::time::timeout(HELLO_PATIENCE, TcpStream::connect(at)).await;
        let Ok(Ok(stream)) = connected else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let mut stream = BufReader::new(stream);
        match tokio::time::timeout(HELLO_PATIENCE, read_line(&mut stream)).await {
            Ok(Some(banner)) if banner.trim_end() == BANNER => {}
            Ok(_) => {
                // Not our gate, and it spoke: not a TCPStore either. Try again later.
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            Err(_) => {
                drop(stream);
                // A silent port: the workers' store, if the group started without this
                // node (it restarted), or torchrun's agent's.
                match probe(at.0, at.1, HELLO_PATIENCE).await {
                    Found::TcpStore { keys: Some(keys) } if has_torchrun_agent_keys(&keys) => {
                        return Err(RendezvousError::TorchrunPeer(format!(
                            "torchrun's agent keys are in the master's store at {}:{}: {SAME_LAUNCHER}",
                            at.0, at.1
                        )));
                    }
                    Found::TcpStore { .. } => {
                        tracing::info!(
                            master = %format!("{}:{}", at.0, at.1),
                            "the master's store is already up: the group started; starting this node's workers"
                        );
                        return Ok(());
                    }
                    _ => {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                }
            }
        }
        if stream
            .get_mut()
            .write_all(hello.line().as_bytes())
            .await
            .is_err()
        {
            continue;
        }
        while let Some(line) = read_line(&mut stream).await {
            let line = line.trim_end();
            if line == "go" {
                return Ok(());
            }
            if let Some(n) = line.strip_prefix("have ").and_then(|n| n.parse().ok()) {
                present.set(Some(n));
            } else if let Some(why) = line.strip_prefix("refused ") {
                return Err(RendezvousError::InvalidConfig(format!(
                    "node rank 0 at {}:{} refused this node: {why}",
                    at.0, at.1
                )));
            }
        }
        // Node 0 went away before the group formed: knock again.
        present.set(None);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(nnodes: u32) -> StaticConfig {
        StaticConfig {
            run_id: "none".into(),
            nnodes,
            node_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            join_timeout: Duration::from_secs(600),
        }
    }

    fn hello(rank: u32, nnodes: u32) -> Hello {
        Hello {
            node_rank: rank,
            nnodes,
            run_id: "none".into(),
        }
    }

    #[test]
    fn a_hello_reads_back_as_written() {
        let h = Hello {
            run_id: "job 7".into(),
            ..hello(2, 3)
        };
        assert_eq!(Hello::parse(&h.line()), Some(h));
        assert_eq!(Hello::parse("GET / HTTP/1.1\r\n"), None);
        assert_eq!(Hello::parse("node x 3 none\n"), None);
    }

    #[test]
    fn the_group_is_complete_when_every_rank_is_there() {
        let mut g = Gathering::new(&cfg(3));
        assert_eq!((g.count(), g.missing()), (1, vec![1, 2]));
        assert_eq!(g.arrive(&hello(2, 3), false), Arrival::Joins);
        assert!(!g.complete());
        assert_eq!(g.arrive(&hello(1, 3), false), Arrival::Joins);
        assert!(g.complete());
    }

    #[test]
    fn a_node_of_another_shape_or_run_or_a_taken_rank_is_refused_with_the_fix() {
        let mut g = Gathering::new(&cfg(2));
        let refused = |a: Arrival| match a {
            Arrival::Refused(why) => why,
            Arrival::Joins => panic!("joined"),
        };
        assert!(refused(g.arrive(&hello(1, 3), false)).contains("same --nnodes"));
        assert!(refused(g.arrive(&hello(0, 2), false)).contains("own --node-rank"));
        assert!(refused(g.arrive(&hello(5, 2), false)).contains("1..1"));
        let other = Hello {
            run_id: "b".into(),
            ..hello(1, 2)
        };
        assert!(refused(g.arrive(&other, false)).contains("same --rdzv-id"));
        assert_eq!(g.count(), 1, "nobody refused is counted");
        let mut g = Gathering::new(&cfg(3));
        assert_eq!(g.arrive(&hello(1, 3), false), Arrival::Joins);
        assert!(refused(g.arrive(&hello(1, 3), true)).contains("already here"));
        // Its first connection closed (the node restarted): the rank is taken back.
        assert_eq!(g.arrive(&hello(1, 3), false), Arrival::Joins);
        assert_eq!(g.count(), 2);
    }

    #[test]
    fn the_waiting_lines_say_the_count_the_place_and_the_fix() {
        let c = cfg(2);
        assert_eq!(
            waiting_line(&c, Some(1), ", missing node rank 1"),
            "waiting for nodes: 1 of 2 present, missing node rank 1 (static group at 127.0.0.1:29500)"
        );
        assert!(fix(&c, Some(1)).contains("--nnodes 2 and their own --node-rank"));
        assert!(waiting_line(&c, None, "").starts_with("waiting for node rank 0 to answer"));
    }
}
