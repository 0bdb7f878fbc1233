//! Rendezvous scale benchmark: N simulated nodes (tasks in one process, sharing a few
//! connections) form one round on an etcd. Prints a line
//! `nodes=N seal_s=<seconds> etcd_writes=<count> shard_txns=<count> coordinator_cpu_ms=<ms>
//! seal_cpu_ms=<ms> leases_lost=<count> reregistered=<count> ...`: the time from the first
//! join to every node holding the sealed round, the writes all nodes made (a seal counts
//! once; the transactions that wrote a placed round's shards ahead of its header are
//! `shard_txns`), the coordinator's CPU time
//! for its decisions (all of them, and those that sealed), and how many times a node
//! found its lease gone and wrote its registration again on a new one (a crowd that
//! etcd could not keep up with: 0 when formation is admitted at etcd's pace), and
//! `round=` the round every node held at the end (0 unless a lease lapsed after a seal:
//! that node is driven on as an agent is, and the time counts the re-form;
//! `--revoke-at-seal K` revokes the leases of the first K nodes to hold round 0, so that
//! this happens);
//! `formed_p50_s` and `formed_p99_s` say when the median node and the slowest hundredth
//! held the round (a gap to `seal_s` is a few stragglers, not a slow crowd), and
//! `paced_max_s` and `slowest_paced_s` how long the most paced node's requests and the
//! slowest node's were held by their pace (admission, after a slow answer or a refusal);
//! `gated_max_s` and `gated_nodes` the longest a node was held at the gate before its
//! grant (etcd behind) and how many were held there at all, `gate_pushed` how many of
//! those went on at the coordinator's push before their pause was over; `turn_looks_per_node` and
//! `turn_max_s` the looks a node made waiting its turn in the crowd (`session::Turn`: a
//! read of the admission keys and a watch of them) and the longest a node waited after
//! its first look; `pushed_nodes` how many turns came by the coordinator's word rather
//! than at their place in the spread, and `admission_keys` the keys the coordinator
//! wrote for it (apart from `etcd_writes`, the nodes' own).
//! The seal's moments, as a watch of the run on a connection of the bench's own sees
//! them: `last_joined_s` (the last node's join returned), `registered_s` (the last
//! registration's event before the header), `shards_s=FIRST..LAST` (a placed round's
//! shards written ahead) and `header_s`.
//!
//! With `--lose leave|kill`, one node then leaves the sealed round — `leave` revokes its
//! lease (a pod deleted: SIGTERM), `kill` drops it without a word (SIGKILL: its lease
//! expires after its TTL) — and a further line `nodes=N lose=<how> reform_s=<seconds>
//! reform_etcd_writes=<count> reform_p50_s=<seconds> reform_p99_s=<seconds>
//! settled_s=<seconds>` gives the time from the loss to every survivor holding the next
//! round, the writes that took, the median survivor's and the 99th percentile's times, and
//! how long the round ran before the loss: `--settle S` (default 0, the loss at once; a
//! loss at the seal meets the formation's own tail). `--lose-count K` takes K nodes out
//! at once instead of one (a rack, or a job's pods deleted together; `lose=<how>x<K>` on
//! the line).
//!
//! With `--ceiling`, no rendezvous runs: each of the N nodes grants a lease, puts one key
//! on it, opens a watch and a keep-alive stream, and renews the lease every third of a TTL
//! (as an agent does) until the last node holds its part, over the same connections; the
//! line `nodes=N ceiling_s=<seconds> writes=<2N>` says how fast this etcd on this machine
//! takes the least a formation must do (a lease kept alive, a registration and a watch per
//! node), whatever the protocol does above it, and a last line `nodes=N renewals=<count>
//! leases_lapsed=<count>` what keeping the leases cost and that none lapsed
//! (`--ceiling-hold S` keeps every lease renewed S seconds more first, and its watch open
//! unless a round took it: whether this etcd holds N leases at all, not only while they
//! come; `held_s=S` ends the line) (`--ceiling-renew once` renews once and keeps the streams open: the floor before issue
//! 53's seventh sitting, whose early leases lapsed in a run longer than a TTL). At most
//! `--inflight K` nodes (default 500) are between their first request and their last at
//! once: with all N at once, etcd's limiter refuses tens of thousands of requests at
//! 10,000 and the floor measures the refusals. That limit is a semaphore the floor's
//! nodes share, which nodes on separate hosts do not have: `--ceiling-spread S` starts
//! node `i` of N at `S * i / N` seconds instead, whatever etcd answers, with no limit
//! unless `--inflight` is given too (the floor of nodes that share nothing, as a
//! crowd's agents; `spread_s=S` on the line). `--ceiling-without watch,keepalive`
//! leaves those steps out, to see what each costs.
//!
//! `--ceiling-round whole|placement|header` adds to the floor the least a sealed round costs
//! once every node is there, timed from the seal to the last node holding its part:
//! `whole` puts a round of N members (as the coordinator writes it, ~100 bytes a member)
//! under the `ctl/` every node watches, and each node receives it; `placement` puts a
//! header of a few bytes there and, before it (in transactions under etcd's limits), the
//! members in shards of [`PLACEMENT_SHARD`] outside it (each member beside its ring neighbour), and
//! each node receives the header and reads its own shard; `header` puts the header alone
//! (a placed re-form that says its moves there). A further line
//! `nodes=N round=<how> round_s=<seconds> round_bytes=<each node received>` says which
//! shape a round of N can afford.
//!
//! `--ttl S` is every lease's TTL (default 5 s, the agent's). `--placement-above K` seals
//! a round of more than K members placed (default the agent's,
//! [`fsdp_rendezvous::etcd::PLACEMENT_ABOVE`]).
//!
//! Usage: rdzv-bench --endpoint HOST:PORT --nodes N [--clients K] [--revoke-at-seal K] [--lose leave|kill [--lose-count K] [--settle S]]
//! [--ttl S] [--ceiling [--inflight K] [--ceiling-spread S] [--ceiling-without watch,keepalive] [--ceiling-renew kept|once] [--ceiling-hold S]
//! [--ceiling-round whole|placement|header]]
//! (`RUST_LOG` as the agent's: what the nodes' sessions log, on stderr)

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fsdp_proto::v1;
use fsdp_rendezvous::etcd::{EtcdConfig, EtcdRendezvous, Keys, connect};
use fsdp_rendezvous::{JobRecords, Rendezvous};

/// Says what is wrong with the command line, prints the usage line, and exits 64.
fn refuse(what: &str) -> ! {
    eprintln!("rdzv-bench: {what}");
    eprintln!("usage: rdzv-bench --endpoint HOST:PORT --nodes N [--clients K] ...");
    std::process::exit(64)
}

/// `flag`'s value `said` as a number, or [`refuse`].
fn number<T: std::str::FromStr>(flag: &str, said: String) -> T {
    said.parse()
        .unwrap_or_else(|_| refuse(&format!("{flag} takes a number, not '{said}'")))
}

/// The bench's allocator: its 10,000 sessions in one process spent a quarter of their CPU in
/// glibc's (`perf`, issue 53's twenty-fourth section), on the two cores etcd shares.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Turns transparent huge pages off for this process. mimalloc asks for them, and each
/// first touch of its memory then zeroed a whole 2 MiB page: 16% of the bench's CPU at a
/// formation of 10,000 nodes (`perf`: `clear_page_erms` under `do_huge_pmd_anonymous_page`),
/// 1% with them off (issue 53's twenty-sixth section). The kernel checks the flag at each
/// fault, so memory mapped before `main` is covered too.
fn no_huge_pages() {
    if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
        eprintln!(
            "rdzv-bench: could not turn transparent huge pages off ({e}); figures may differ"
        );
    }
}

fn main() {
    no_huge_pages();
    let mut args = std::env::args().skip(1);
    let (mut endpoint, mut nodes, mut clients) = (None, 8usize, None);
    let (mut lose, mut ttl, mut ceiling) = (None::<String>, 5u64, false);
    let mut inflight = None::<usize>;
    let mut settle = Duration::ZERO;
    let mut lose_count = 1usize;
    let mut revoke_at_seal = 0usize;
    let mut placement_above = fsdp_rendezvous::etcd::PLACEMENT_ABOVE;
    let mut steps = CeilingSteps {
        watch: true,
        keep_alive: true,
        renew_once: false,
        round: None,
        hold: Duration::ZERO,
        spread: Duration::ZERO,
    };
    while let Some(a) = args.next() {
        let mut v = || {
            args.next()
                .unwrap_or_else(|| refuse(&format!("{a} needs a value")))
        };
        match a.as_str() {
            "--endpoint" => endpoint = Some(v()),
            "--nodes" => nodes = number(&a, v()),
            "--clients" => clients = Some(number(&a, v())),
            "--lose" => {
                let said = v();
                if said != "leave" && said != "kill" {
                    refuse(&format!("--lose takes leave or kill, not '{said}'"));
                }
                lose = Some(said);
            }
            "--lose-count" => lose_count = number(&a, v()),
            "--revoke-at-seal" => revoke_at_seal = number(&a, v()),
            "--ttl" => ttl = number(&a, v()),
            "--settle" => {
                let said = v();
                let Some(s) = said
                    .parse()
                    .ok()
                    .and_then(|s| Duration::try_from_secs_f64(s).ok())
                else {
                    refuse(&format!("--settle takes seconds (0 or more), not '{said}'"));
                };
                settle = s;
            }
            "--ceiling" => ceiling = true,
            "--inflight" => inflight = Some(number(&a, v())),
            "--placement-above" => placement_above = number(&a, v()),
            "--ceiling-round" => {
                let said = v();
                let Some(shape) = RoundShape::named(&said) else {
                    refuse(&format!(
                        "--ceiling-round takes one of {}, not '{said}'",
                        RoundShape::ALL.map(RoundShape::name).join(", ")
                    ));
                };
                steps.round = Some(shape);
            }
            "--ceiling-hold" => {
                steps.hold = v()
                    .parse::<f64>()
                    .ok()
                    .and_then(|s| Duration::try_from_secs_f64(s).ok())
                    .unwrap_or_else(|| refuse("--ceiling-hold takes seconds (e.g. 30)"));
            }
            "--ceiling-spread" => {
                steps.spread = v()
                    .parse::<f64>()
                    .ok()
                    .filter(|s| *s <= 3600.0)
                    .and_then(|s| Duration::try_from_secs_f64(s).ok())
                    .unwrap_or_else(|| {
                        refuse("--ceiling-spread takes seconds, at most 3600 (e.g. 6)")
                    });
            }
            "--ceiling-renew" => {
                steps.renew_once = match v().as_str() {
                    "kept" => false,
                    "once" => true,
                    bad => refuse(&format!("--ceiling-renew takes kept or once, not '{bad}'")),
                }
            }
            "--ceiling-without" => {
                for step in v().split(',') {
                    match step {
                        "watch" => steps.watch = false,
                        "keepalive" => steps.keep_alive = false,
                        bad => refuse(&format!(
                            "--ceiling-without takes watch, keepalive or both \
                             (comma-separated), not '{bad}'"
                        )),
                    }
                }
            }
            other => refuse(&format!("unknown {other}")),
        }
    }
    let Some(endpoint) = endpoint else {
        refuse("--endpoint is required");
    };
    if revoke_at_seal >= nodes {
        refuse(&format!(
            "--revoke-at-seal takes 0 to one less than --nodes ({nodes}): a node must hold \
             the round its lease is revoked in, not {revoke_at_seal}"
        ));
    }
    if lose.is_none() && lose_count != 1 {
        refuse("--lose-count takes effect with --lose leave|kill only");
    }
    if lose.is_some() && !(1..nodes).contains(&lose_count) {
        refuse(&format!(
            "--lose-count takes 1 to one less than --nodes ({nodes}): one node must survive, \
             not {lose_count}"
        ));
    }
    // One HTTP/2 connection carries many nodes' streams, as separate hosts would not;
    // a few connections keep one slow stream from holding up everyone.
    let clients = clients.unwrap_or(nodes.div_ceil(100)).max(1);
    // RUST_LOG=fsdp_rendezvous=info shows what the nodes' sessions do (off by default).
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let run_id = format!("bench-{}", std::process::id());
        // MIN the lost nodes below MAX: the survivors of a loss re-form on their own.
        let min = if lose.is_some() {
            nodes - lose_count
        } else {
            nodes
        };
        let mut cfg = EtcdConfig::new(vec![endpoint], &run_id, min.max(1) as u32, nodes as u32);
        cfg.keep_alive_ttl = Duration::from_secs(ttl.max(1));
        cfg.straggler_timeout = cfg.keep_alive_ttl * 4;
        cfg.join_timeout = Duration::from_secs(300);
        cfg.placement_above = placement_above;
        let mut conns = Vec::new();
        for _ in 0..clients {
            conns.push(connect(&cfg.options).await.expect("connect to etcd"));
        }
        if ceiling {
            let ttl = ttl.max(1) as i64;
            // A spread's nodes share no semaphore unless one is asked for.
            let shared = if steps.spread.is_zero() { 500 } else { nodes };
            let inflight = inflight.unwrap_or(shared).max(1);
            return etcd_ceiling(&conns, nodes, &run_id, inflight, steps, ttl).await;
        }
        let start = Instant::now();
        // The seal's moments, on a connection of the bench's own (one more watcher of
        // the whole run, as the coordinator is: a round's registrations and shards).
        let own = connect(&cfg.options).await.expect("connect to etcd");
        let sealed = watch_seal(own.clone(), &cfg, start).await;
        let formed = Formed::new(nodes, revoke_at_seal, own.clone(), &cfg);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..nodes {
            let client = conns[i % clients].clone();
            let mut c = cfg.clone();
            c.node_id = format!("sim-{i:05}");
            let formed = formed.clone();
            tasks.spawn(async move {
                let id = c.node_id.clone();
                // Boxed, as the rounds below: held in place, the join's future (12 KB)
                // sized every node's task for its whole life, memory the kernel zeroed
                // page by page on the two cores etcd shares.
                let join = Box::pin(EtcdRendezvous::join(client, c));
                let mut node = said_if_stalled(join, || format!("joining {id}"))
                    .await
                    .expect("join");
                let joined = start.elapsed().as_secs_f64();
                let views = node.views();
                let (round, after) = formed
                    .hold_until_formed(&mut node, start, || {
                        format!("forming {}", stalled_words(&views.borrow(), &id))
                    })
                    .await;
                (node, round, after, joined)
            });
        }
        let (mut held, mut took) = (Vec::new(), Vec::new());
        let (mut paced_max_s, mut slowest) = (0f64, (0f64, 0f64));
        let mut last_joined = 0f64;
        while let Some(r) = tasks.join_next().await {
            let (node, round, after, joined) = r.expect("node task");
            last_joined = last_joined.max(joined);
            let paced = node.counters().paced_ns.load(Ordering::Relaxed) as f64 / 1e9;
            paced_max_s = paced_max_s.max(paced);
            if after > slowest.0 {
                slowest = (after, paced);
            }
            took.push(after);
            held.push((node, round));
        }
        let seal_s = formed.at_s();
        let world: Vec<u32> = held.iter().map(|(_, r)| r.world_size).collect();
        assert!(
            world.iter().all(|w| *w as usize == nodes),
            "every node holds the full round"
        );
        let round = held[0].1.number;
        assert!(
            held.iter().all(|(_, r)| r.number == round),
            "every node holds the same round"
        );
        let writes: u64 = held.iter().map(|(n, _)| n.writes()).sum();
        println!("per_node_writes={:.2}", writes as f64 / nodes as f64);
        // The coordinator's own CPU (every coordinator's, if the role moved): all its
        // looks at the registrations, and the decisions that sealed.
        let ms = |pick: fn(&fsdp_rendezvous::Counters) -> u64| {
            held.iter().map(|(n, _)| pick(&n.counters())).sum::<u64>() as f64 / 1e6
        };
        let coordinating_ms = ms(|c| c.coordinating_ns.load(Ordering::Relaxed));
        let sealing_ms = ms(|c| c.sealing_ns.load(Ordering::Relaxed));
        let count = |pick: fn(&fsdp_rendezvous::Counters) -> u64| {
            held.iter().map(|(n, _)| pick(&n.counters())).sum::<u64>()
        };
        let lost = count(|c| c.leases_lost.load(Ordering::Relaxed));
        let again = count(|c| c.reregistered.load(Ordering::Relaxed));
        let shard_txns = count(|c| c.shard_txns.load(Ordering::Relaxed));
        let admission_keys = count(|c| c.admission_keys.load(Ordering::Relaxed));
        let gated: Vec<u64> = held
            .iter()
            .map(|(n, _)| n.counters().gated_ns.load(Ordering::Relaxed))
            .collect();
        let gated_max_s = gated.iter().max().copied().unwrap_or(0) as f64 / 1e9;
        let gated_nodes = gated.iter().filter(|g| **g > 0).count();
        let gate_pushed = count(|c| c.gate_pushed.load(Ordering::Relaxed));
        // Looks a node made waiting its turn (of all nodes), and the longest it waited.
        let turn_looks = count(|c| c.turn_looks.load(Ordering::Relaxed)) as f64 / nodes as f64;
        let pushed = count(|c| c.turn_pushed.load(Ordering::Relaxed));
        let turn_max_s = held
            .iter()
            .map(|(n, _)| n.counters().turn_ns.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0) as f64
            / 1e9;
        let (p50, p99) = p50_p99(&mut took);
        println!(
            "nodes={nodes} seal_s={seal_s:.3} etcd_writes={writes} shard_txns={shard_txns} \
             admission_keys={admission_keys} \
             coordinator_cpu_ms={coordinating_ms:.3} seal_cpu_ms={sealing_ms:.3} \
             leases_lost={lost} reregistered={again} round={round} ttl_s={ttl} placement_above={placement_above} \
             formed_p50_s={p50:.3} formed_p99_s={p99:.3} paced_max_s={paced_max_s:.2} \
             slowest_paced_s={:.2} gated_max_s={gated_max_s:.2} gated_nodes={gated_nodes} \
             gate_pushed={gate_pushed} last_joined_s={last_joined:.3} turn_looks_per_node={turn_looks:.2} \
             turn_max_s={turn_max_s:.2} pushed_nodes={pushed} {} bench_cpu_s={:.2} bench_rss_mb={}",
            slowest.1,
            sealed.lock().unwrap().words(),
            own_cpu_s(),
            own_peak_rss_mb()
        );
        if let Some(how) = lose {
            // The round runs a while before the loss (`--settle`), as a job's does: a
            // loss at the seal is timed with the formation's own tail beside it.
            tokio::time::sleep(settle).await;
            let mut probe = conns[0].clone();
            let survivors = reform_after_loss(held, &how, lose_count, &mut probe, settle).await;
            leave_all(survivors, cfg.keep_alive_ttl).await;
            return;
        }
        leave_all(
            held.into_iter().map(|(n, _)| n).collect(),
            cfg.keep_alive_ttl,
        )
        .await;
    });
}

/// Which of a member's least steps beyond its lease and key the ceiling takes.
#[derive(Clone, Copy)]
struct CeilingSteps {
    watch: bool,
    keep_alive: bool,
    /// Renew each lease once and stop (the floor before the seventh sitting's), instead of
    /// every third of a TTL until the last node holds its part, as an agent does.
    renew_once: bool,
    /// And a sealed round, in this shape, once every node is there.
    round: Option<RoundShape>,
    /// How long every lease is then kept alive before the count of lapsed ones: whether
    /// this etcd holds N leases at all, not only while they come.
    hold: Duration,
    /// Node `i` of N starts `i / N` of this after the first, at an even rate and whatever
    /// etcd answers (`--ceiling-spread`): the floor of nodes that share no semaphore.
    spread: Duration,
}

/// How a sealed round reaches its members (`--ceiling-round`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum RoundShape {
    /// The whole round at the key every member watches.
    Whole,
    /// A header there; each member reads its own shard of the members outside it.
    Placement,
    /// A header there and nothing else: what a placed re-form that says its moves in the
    /// header costs (every member makes its copy from it).
    Header,
}

impl RoundShape {
    const ALL: [RoundShape; 3] = [Self::Whole, Self::Placement, Self::Header];

    /// The name `--ceiling-round` gives it.
    fn name(self) -> &'static str {
        match self {
            Self::Whole => "whole",
            Self::Placement => "placement",
            Self::Header => "header",
        }
    }

    fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// Members in one shard of a round's placement, as the rendezvous cuts it: what each
/// member reads is this many members and their neighbours, whatever the round's size.
const PLACEMENT_SHARD: usize = fsdp_rendezvous::etcd::placement::SHARD_MEMBERS;

/// Shards in one transaction of the placement, as the rendezvous writes them.
const PLACEMENT_TXN_OPS: usize = fsdp_rendezvous::etcd::placement::Shape::ETCD.per_txn;

/// The least any formation does, per node: a lease, a key on it, a watch and a keep-alive
/// stream that has renewed once; the floor under `seal_s` that this etcd on this machine
/// sets. At most `inflight` nodes are under way at once. Ends by revoking the leases.
async fn etcd_ceiling(
    conns: &[etcd_client::Client],
    nodes: usize,
    run_id: &str,
    inflight: usize,
    steps: CeilingSteps,
    ttl: i64,
) {
    let start = Instant::now();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(inflight));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..nodes {
        let c = conns[i % conns.len()].clone();
        let key = format!("/fsdp/{run_id}/ceiling/{i:05}");
        // One prefix that every member watches, as every member watches the run's `ctl/`.
        let ctl = format!("/fsdp/{run_id}/ctl/");
        let (gate, stopped) = (gate.clone(), stopped.clone());
        let starts = steps.spread.mul_f64(i as f64 / nodes as f64);
        tasks.spawn(async move {
            tokio::time::sleep_until((start + starts).into()).await;
            let turn = gate.acquire_owned().await.expect("the gate stays open");
            let mut refused = 0u64;
            let lease = until_taken("lease grant", &mut refused, || {
                let mut c = c.clone();
                async move { c.lease_grant(ttl, None).await }
            })
            .await
            .id();
            let opts = etcd_client::PutOptions::new().with_lease(lease);
            until_taken("put", &mut refused, || {
                let (mut c, key, opts) = (c.clone(), key.clone(), opts.clone());
                async move { c.put(key, vec![0u8; 64], Some(opts)).await }
            })
            .await;
            // And the watch every member holds (nothing is written under it here).
            let watch = if steps.watch {
                Some(
                    until_taken("watch", &mut refused, || {
                        let (mut c, ctl) = (c.clone(), ctl.clone());
                        let opts = etcd_client::WatchOptions::new().with_prefix();
                        async move { c.watch(ctl, Some(opts)).await }
                    })
                    .await,
                )
            } else {
                None
            };
            // And its lease's keep-alive stream, renewed once and answered (all again if
            // etcd says it is too busy to answer).
            let keeper = if steps.keep_alive {
                Some(
                    until_taken("keep-alive", &mut refused, || {
                        let mut c = c.clone();
                        async move {
                            let (mut keeper, mut kept) = c.lease_keep_alive(lease).await?;
                            keeper.keep_alive().await?;
                            match kept.message().await? {
                                Some(_) => Ok((keeper, kept)),
                                None => Err(etcd_client::Error::IoError(std::io::Error::other(
                                    "the keep-alive stream ended unanswered",
                                ))),
                            }
                        }
                    })
                    .await,
                )
            } else {
                None
            };
            drop(turn);
            // Renewed to the end, or (the old floor) held open unrenewed.
            let renewing = keeper.map(|(keeper, kept)| {
                if steps.renew_once {
                    tokio::spawn(async move {
                        let _open = (keeper, kept);
                        let _ = stopped.clone().changed().await;
                        (0, false)
                    })
                } else {
                    tokio::spawn(keep_renewing(keeper, kept, ttl, stopped))
                }
            });
            (lease, refused, watch, renewing)
        });
    }
    let (mut leases, mut refused, mut watches, mut renewing) =
        (Vec::new(), 0, Vec::new(), Vec::new());
    while let Some(r) = tasks.join_next().await {
        let (lease, n, watch, renewer) = r.expect("ceiling task");
        leases.push(lease);
        refused += n;
        watches.push(watch);
        renewing.extend(renewer);
    }
    let ceiling_s = start.elapsed().as_secs_f64();
    println!(
        "nodes={nodes} ceiling_s={ceiling_s:.3} writes={} refused={refused} \
         inflight={inflight} spread_s={:.3} watch={} keepalive={} ttl_s={ttl} bench_cpu_s={:.2} \
         bench_rss_mb={}",
        2 * nodes,
        steps.spread.as_secs_f64(),
        steps.watch,
        steps.keep_alive,
        own_cpu_s(),
        own_peak_rss_mb()
    );
    if let Some(shape) = steps.round.filter(|_| steps.watch) {
        let watches = watches
            .iter_mut()
            .map(|w| w.take().expect("a watch"))
            .collect();
        seal_round(conns, run_id, shape, watches).await;
    }
    tokio::time::sleep(steps.hold).await;
    drop(watches);
    let _ = stop.send(true);
    let (mut renewals, mut lapsed) = (0, 0);
    for r in renewing {
        let (n, gone) = r.await.expect("renewing task");
        renewals += n;
        lapsed += u64::from(gone);
    }
    // A floor whose own leases lapsed is not one (etcd was past its pace).
    let lapsed = if steps.keep_alive && !steps.renew_once {
        lapsed.to_string()
    } else {
        "unchecked".to_owned()
    };
    let held_s = steps.hold.as_secs_f64();
    println!("nodes={nodes} renewals={renewals} leases_lapsed={lapsed} held_s={held_s}");
    let mut tasks = tokio::task::JoinSet::new();
    for (i, lease) in leases.into_iter().enumerate() {
        let mut c = conns[i % conns.len()].clone();
        tasks.spawn(async move { c.lease_revoke(lease).await.map(|_| ()) });
    }
    while tasks.join_next().await.is_some() {}
}

/// `op`'s answer, asked again every 50 ms while etcd says it is too busy ("too many
/// requests" while its applied index trails the committed one by 5,000), each such
/// refusal counted in `refused`; any other error ends the bench, naming `what`.
async fn until_taken<T, F, Fut>(what: &str, refused: &mut u64, mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    loop {
        match op().await {
            Ok(answer) => return answer,
            Err(e) if fsdp_rendezvous::etcd::is_overloaded(&e) => *refused += 1,
            Err(e) => panic!("{what}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Renews a floor node's lease on its stream every third of `ttl` (as an agent keeps its
/// lease alive while it forms) until `stop` changes. Returns the renewals etcd answered
/// and whether the lease was found gone (or its stream broken) before.
async fn keep_renewing(
    mut keeper: etcd_client::LeaseKeeper,
    mut kept: etcd_client::LeaseKeepAliveStream,
    ttl: i64,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> (u64, bool) {
    let period = Duration::from_secs(ttl.max(1) as u64) / 3;
    let mut renewed = 0;
    loop {
        tokio::select! {
            _ = stop.changed() => return (renewed, false),
            () = tokio::time::sleep(period) => {}
        }
        // The stop also ends a renewal etcd has not answered.
        let renewal = async {
            keeper.keep_alive().await?;
            kept.message().await
        };
        tokio::select! {
            _ = stop.changed() => return (renewed, false),
            answer = renewal => match answer {
                Ok(Some(answer)) if answer.ttl() > 0 => renewed += 1,
                _ => return (renewed, true),
            },
        }
    }
}

/// This process's CPU so far (every simulated node's, user and system): on a machine
/// shared with etcd, what the nodes took from it.
fn own_cpu_s() -> f64 {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF);
    usage.map_or(0.0, |u| {
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
        t(u.user_time()) + t(u.system_time())
    })
}

/// This process's peak resident memory in MB.
fn own_peak_rss_mb() -> i64 {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF);
    usage.map_or(0, |u| u.max_rss() / 1024)
}

/// Every node leaves at once, as a job's pods do when it is deleted (one by one, each
/// departure would be a loss the others re-form for). A departure that has not returned
/// within a minute (six lease TTLs if longer) is a hang: named, and the bench fails (exit
/// 3) instead of waiting.
async fn leave_all(nodes: Vec<EtcdRendezvous>, ttl: Duration) {
    let patience = Duration::from_secs(60).max(6 * ttl);
    let mut waiting: std::collections::BTreeSet<String> =
        nodes.iter().map(|n| n.node_id().to_string()).collect();
    let mut tasks = tokio::task::JoinSet::new();
    for mut n in nodes {
        tasks.spawn(async move {
            let _ = n
                .depart(fsdp_rendezvous::Departure::Finished, finished())
                .await;
            n.node_id().to_string()
        });
    }
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        match tokio::time::timeout_at(deadline, tasks.join_next()).await {
            Ok(Some(done)) => {
                waiting.remove(&done.expect("node task"));
            }
            Ok(None) => return,
            Err(_) => {
                let ids: Vec<&String> = waiting.iter().take(20).collect();
                eprintln!(
                    "rdzv-bench: {} departures did not return within {patience:?}: {ids:?}",
                    waiting.len()
                );
                std::process::exit(3);
            }
        }
    }
}

fn finished() -> fsdp_rendezvous::LeftReason {
    fsdp_rendezvous::LeftReason::new(fsdp_rendezvous::LeftKind::Finished, "the bench")
}

/// How long a node waits (to join, for a round) before it says what it holds.
const STALLED: Duration = Duration::from_secs(30);

/// `step`'s outcome; each [`STALLED`] it takes, a line `stalled <seconds>s <words>` on
/// stderr: the lines of a formation or re-form that never ends (what a node holds at 30
/// s may be a slow node's way, at 90 s a stall), summed with
/// `sed -E 's/sim-[0-9]+//' | sort | uniq -c`.
async fn said_if_stalled<T>(step: impl Future<Output = T>, words: impl Fn() -> String) -> T {
    tokio::pin!(step);
    let mut waited = Duration::ZERO;
    loop {
        tokio::select! {
            done = &mut step => return done,
            () = tokio::time::sleep(STALLED) => {
                waited += STALLED;
                eprintln!("stalled {}s {}", waited.as_secs(), words());
            }
        }
    }
}

/// What a survivor that waits too long holds: whether connected, its round (number,
/// members held, placed or not), a round it wants read, a placed header it reads, the
/// coordinator (and whether it is this node).
fn stalled_words(v: &fsdp_rendezvous::etcd::View, me: &str) -> String {
    let round = v.round.as_ref().map_or("none".to_owned(), |r| {
        format!(
            "{} members={} world={} placed={}",
            r.record.number,
            r.record.members.len(),
            r.record.group_world_size,
            r.record.placed.is_some()
        )
    });
    format!(
        "connected={} round={round} wanted={:?} placing={:?} master={:?} coordinator_is_me={} \
         departed={}",
        v.connected,
        v.round_wanted,
        v.placing.as_ref().map(|p| p.record.number),
        v.master.as_ref().map(|m| m.round),
        v.coordinator.as_deref() == Some(me),
        v.departed.len(),
    )
}

/// Nodes holding each round, and when one round was first held by all (seconds).
type Holding = (std::collections::HashMap<u64, usize>, Option<f64>);

/// When the crowd formed: the first moment every node held one round of all of them.
/// A node whose round ends before that (its lease lapsed after the seal, in a run etcd
/// could not keep up with) is driven on as an agent is (`changed`, then `next_round`), so
/// the lapse costs a round more (`round=` on the line, `leases_lost`) rather than a bench
/// that waits for a node nothing drives; the run with no such lapse ends at round 0.
#[derive(Clone)]
struct Formed {
    nodes: usize,
    /// Nodes holding each round (of all nodes), and when a round was first held by all.
    holding: std::sync::Arc<std::sync::Mutex<Holding>>,
    done: tokio::sync::watch::Sender<bool>,
    /// `--revoke-at-seal`: how many of the first nodes to hold round 0 have their lease
    /// revoked by the bench then, before they count as holding it (a lapse after the seal,
    /// made sure of), and the connection and keys that find and revoke it.
    revoke: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    etcd: etcd_client::Client,
    keys: Keys,
}

impl Formed {
    fn new(nodes: usize, revoke: usize, etcd: etcd_client::Client, cfg: &EtcdConfig) -> Self {
        Self {
            nodes,
            holding: Default::default(),
            done: tokio::sync::watch::channel(false).0,
            revoke: std::sync::Arc::new(revoke.into()),
            etcd,
            keys: Keys::new(&cfg.prefix, &cfg.run_id).expect("the bench's keys"),
        }
    }

    /// Whether `node`, holding `round`, is one of the first to hold round 0 that
    /// `--revoke-at-seal` takes: its lease is then revoked, as etcd does to a lease it
    /// could not renew in time.
    async fn revoked(&self, node: &EtcdRendezvous, round: &fsdp_rendezvous::Round) -> bool {
        let take = |left: usize| left.checked_sub(1);
        if round.number != 0
            || self
                .revoke
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, take)
                .is_err()
        {
            return false;
        }
        let mut etcd = self.etcd.clone();
        let key = format!("{}{}", self.keys.members(), node.node_id());
        let read = etcd
            .get(key.as_str(), None)
            .await
            .expect("read a registration");
        let lease = read
            .kvs()
            .first()
            .map(|kv| kv.lease())
            .expect("a registration on its lease");
        etcd.lease_revoke(lease)
            .await
            .expect("revoke a held node's lease");
        true
    }

    /// The moment every node held one round, in seconds after the start.
    fn at_s(&self) -> f64 {
        let holding = self.holding.lock().expect("formed");
        holding.1.expect("the crowd formed")
    }

    /// `node`'s rounds until every node holds the same one: that round, and when this
    /// node took it (seconds after `start`).
    async fn hold_until_formed(
        &self,
        node: &mut EtcdRendezvous,
        start: Instant,
        words: impl Fn() -> String,
    ) -> (fsdp_rendezvous::Round, f64) {
        let mut done = self.done.subscribe();
        loop {
            let round = said_if_stalled(Box::pin(node.next_round()), &words)
                .await
                .expect("round");
            let after = start.elapsed().as_secs_f64();
            if self.revoked(node, &round).await {
                node.changed().await.expect("a revoked lease's end is seen");
                continue;
            }
            self.took(&round, after);
            tokio::select! {
                r = done.wait_for(|d| *d) => {
                    r.expect("the bench holds the sender");
                    return (round, after);
                }
                change = node.changed() => {
                    change.expect("a held round's end is seen");
                    // No longer held from now: the crowd must not count it in a round
                    // it left while it asks for the next.
                    self.left(&round);
                }
            }
        }
    }

    /// A node left `round` (its end seen).
    fn left(&self, round: &fsdp_rendezvous::Round) {
        let mut holding = self.holding.lock().expect("formed");
        if let Some(n) = holding.0.get_mut(&round.number) {
            *n -= 1;
        }
    }

    /// A node took `round`, `after` seconds in: the crowd formed if every node holds it.
    fn took(&self, round: &fsdp_rendezvous::Round, after: f64) {
        let mut holding = self.holding.lock().expect("formed");
        let n = holding.0.entry(round.number).or_default();
        *n += 1;
        if *n == self.nodes && round.world_size as usize == self.nodes && holding.1.is_none() {
            holding.1 = Some(after);
            self.done.send_replace(true);
        }
    }
}

/// Takes `count` nodes out of the sealed round at once (`leave`: revoking their leases;
/// `kill`: dropping them, so their leases expire) and times the survivors' way to the
/// round without them.
async fn reform_after_loss(
    mut held: Vec<(EtcdRendezvous, fsdp_rendezvous::Round)>,
    how: &str,
    count: usize,
    etcd: &mut etcd_client::Client,
    settle: Duration,
) -> Vec<EtcdRendezvous> {
    // Every write that changes etcd moves its revision by one: the re-form's cost is how
    // far it moved (the master's key included, written once the new round is held).
    let revision = |c: &mut etcd_client::Client| {
        let mut c = c.clone();
        async move {
            let r = c.get("/", None).await.expect("read etcd's revision");
            r.header().map_or(0, |h| h.revision())
        }
    };
    let before = revision(etcd).await;
    let nodes = held.len();
    // The round's last nodes: never the coordinator's first claim, plain members.
    held.sort_by_key(|(_, r)| r.group_rank);
    let lost = held.split_off(nodes - count);
    let start = Instant::now();
    // All at once, as a rack's pods deleted together leave.
    let mut leaving = tokio::task::JoinSet::new();
    for (mut node, _) in lost {
        let how = how.to_owned();
        leaving.spawn(async move {
            if how == "leave" {
                let why =
                    fsdp_rendezvous::LeftReason::new(fsdp_rendezvous::LeftKind::Left, "the bench");
                let _ = node.depart(fsdp_rendezvous::Departure::Left, why).await;
            }
        });
    }
    let world = nodes - count;
    let mut tasks = tokio::task::JoinSet::new();
    for (mut node, _) in held {
        let views = node.views();
        let id = node.node_id().to_owned();
        tasks.spawn(async move {
            let seen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let saw = seen.clone();
            let next = async move {
                // Losses seen apart are re-formed apart: the round wanted is the one
                // without them all.
                loop {
                    node.changed().await.expect("the loss is seen");
                    saw.store(true, Ordering::Relaxed);
                    let round = node.next_round().await.expect("the next round");
                    // Smaller than wanted: a survivor lost too, which the assert below says.
                    if round.world_size as usize <= world {
                        break (node, round, start.elapsed());
                    }
                }
            };
            said_if_stalled(next, || {
                let phase = if seen.load(Ordering::Relaxed) {
                    "next_round"
                } else {
                    "changed"
                };
                format!("in {phase} {}", stalled_words(&views.borrow(), &id))
            })
            .await
        });
    }
    let (mut survivors, mut took) = (Vec::new(), Vec::new());
    while let Some(r) = tasks.join_next().await {
        let (node, round, after) = r.expect("survivor task");
        took.push(after.as_secs_f64());
        assert_eq!(
            round.world_size as usize, world,
            "the round without the lost nodes"
        );
        survivors.push(node);
    }
    let reform_s = start.elapsed().as_secs_f64();
    while leaving.join_next().await.is_some() {}
    let writes = revision(etcd).await - before;
    let (p50, p99) = p50_p99(&mut took);
    let many = if count > 1 {
        format!("x{count}")
    } else {
        String::new()
    };
    println!(
        "nodes={nodes} lose={how}{many} reform_s={reform_s:.3} reform_etcd_writes={writes} \
         reform_p50_s={p50:.3} reform_p99_s={p99:.3} settled_s={:.3}",
        settle.as_secs_f64(),
    );
    survivors
}

/// The seal's moments, in seconds after the formation's start, as the bench's own watch
/// saw them: the last registration before the header, the first and last shard written
/// ahead (none in a whole round) and the header.
#[derive(Debug, Default, Clone, Copy)]
struct SealTimes {
    last_member: Option<f64>,
    first_shard: Option<f64>,
    last_shard: Option<f64>,
    header: Option<f64>,
}

impl SealTimes {
    /// `registered_s=R shards_s=FIRST..LAST header_s=H` (`-` for what did not come).
    fn words(&self) -> String {
        let s = |t: Option<f64>| t.map_or("-".to_owned(), |t| format!("{t:.3}"));
        format!(
            "registered_s={} shards_s={}..{} header_s={}",
            s(self.last_member),
            s(self.first_shard),
            s(self.last_shard),
            s(self.header)
        )
    }
}

/// Watches the run's round key and shards from the bench's own connection and keeps
/// when the first seal's shards and header were put: what the seal's tail is made of
/// (the last registration, the coordinator's writes, every member's read of its shard).
async fn watch_seal(
    client: etcd_client::Client,
    cfg: &EtcdConfig,
    start: Instant,
) -> std::sync::Arc<std::sync::Mutex<SealTimes>> {
    let times = std::sync::Arc::new(std::sync::Mutex::new(SealTimes::default()));
    let keys = Keys::new(&cfg.prefix, &cfg.run_id).expect("the bench's run id");
    let (round, placements) = (keys.key::<v1::Round>(""), keys.placements());
    let members = keys.members();
    let opts = etcd_client::WatchOptions::new().with_prefix();
    // As the agents' watches: a batch of events over 4 MiB would end the stream, and
    // the seal's moments would go missing without a word.
    let mut stream = fsdp_rendezvous::etcd::watcher(&client)
        .watch(keys.root(), Some(opts))
        .await
        .expect("watch the run");
    let kept = times.clone();
    tokio::spawn(async move {
        while let Ok(Some(r)) = stream.message().await {
            let now = start.elapsed().as_secs_f64();
            let mut t = kept.lock().unwrap();
            for e in r.events() {
                let key = e.kv().map(|kv| kv.key()).unwrap_or_default();
                if key == round.as_bytes() {
                    t.header = Some(now);
                    return;
                }
                if key.starts_with(placements.as_bytes()) {
                    t.first_shard.get_or_insert(now);
                    t.last_shard = Some(now);
                } else if key.starts_with(members.as_bytes())
                    && e.event_type() == etcd_client::EventType::Put
                {
                    t.last_member = Some(now);
                }
            }
        }
    });
    times
}

/// The median and the 99th percentile of `took` (sorted here; 0 when it is empty): how
/// long the median node and the slowest hundredth took, beside the slowest one's time
/// that ends a step.
fn p50_p99(took: &mut [f64]) -> (f64, f64) {
    took.sort_by(f64::total_cmp);
    let at = |q: f64| {
        took.get(((took.len().max(1) - 1) as f64 * q) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    (at(0.5), at(0.99))
}

/// The least a sealed round of `watches.len()` members costs in `shape`: one write, then
/// every member holding its part (see `--ceiling-round`). Prints the round's line.
async fn seal_round(
    conns: &[etcd_client::Client],
    run_id: &str,
    shape: RoundShape,
    watches: Vec<etcd_client::WatchStream>,
) {
    use prost::Message;
    let nodes = watches.len();
    let member = |i: usize| {
        fsdp_proto::v1::Member::from(fsdp_proto::v1::MemberFields {
            schema: fsdp_proto::SCHEMA_VERSION,
            node_id: format!("node-{i:05}-{:08x}", i.wrapping_mul(2_654_435_761)),
            addr: format!("10.{}.{}.{}", i >> 16 & 255, i >> 8 & 255, i & 255),
            local_world_size: 8,
            status_addr: format!("10.{}.{}.{}:29450", i >> 16 & 255, i >> 8 & 255, i & 255),
            lease: 7_587_000_000_000_000_000 + i as i64,
            incarnation: 1,
            ..Default::default()
        })
    };
    let round = |members| fsdp_proto::v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number: 1,
        members,
        reason: "first round".into(),
        sealed_at_ms: 1,
        ..Default::default()
    };
    let ctl = format!("/fsdp/{run_id}/ctl/round");
    let shard_key = |k: usize| format!("/fsdp/{run_id}/placement/{k:03}");
    let shards = nodes.div_ceil(PLACEMENT_SHARD);
    let mut c = conns[0].clone();
    let start = Instant::now();
    match shape {
        RoundShape::Whole => {
            let whole = round((0..nodes).map(member).collect()).encode_to_vec();
            if let Err(e) = c.put(ctl.as_str(), whole, None).await {
                println!("nodes={nodes} round={} round_s=none: {e}", shape.name());
                return;
            }
        }
        RoundShape::Placement => {
            // Member i sits in shard i % shards, beside its ring neighbour i + 1. The
            // shards go first, in transactions under etcd's request limit (1.5 MiB), at
            // keys no member reads before the header names them; then the header.
            let mut batches = vec![Vec::new()];
            let mut bytes = 0;
            for k in 0..shards {
                let placed = (k..nodes)
                    .step_by(shards)
                    .flat_map(|i| [member(i), member((i + 1) % nodes)])
                    .collect();
                let shard = round(placed).encode_to_vec();
                let full = batches.last().is_some_and(|b| b.len() == PLACEMENT_TXN_OPS);
                if full
                    || bytes + shard.len() > fsdp_rendezvous::etcd::placement::SHARD_BYTES_PER_TXN
                {
                    batches.push(Vec::new());
                    bytes = 0;
                }
                bytes += shard.len();
                let batch = batches.last_mut().expect("one batch at least");
                batch.push(etcd_client::TxnOp::put(shard_key(k), shard, None));
            }
            // One a backend commit apart, as the rendezvous writes them: etcd 3.4 copies
            // its uncommitted writes into every answer, and a burst of them made every
            // later answer dearer.
            for (i, batch) in batches.into_iter().enumerate() {
                if i > 0 {
                    tokio::time::sleep(fsdp_rendezvous::etcd::placement::AHEAD_SPACING).await;
                }
                c.txn(etcd_client::Txn::new().and_then(batch))
                    .await
                    .expect("the placement's transaction");
            }
        }
        RoundShape::Header => {}
    }
    if shape != RoundShape::Whole {
        c.put(ctl, round(Vec::new()).encode_to_vec(), None)
            .await
            .expect("the round's header");
    }
    let mut tasks = tokio::task::JoinSet::new();
    for (i, mut watch) in watches.into_iter().enumerate() {
        let mut c = conns[i % conns.len()].clone();
        let key = shard_key(i % shards);
        tasks.spawn(async move {
            let mut got = 0usize;
            while got == 0 {
                let answer = watch.message().await.expect("the watch").expect("an event");
                got = answer
                    .events()
                    .iter()
                    .filter_map(|e| e.kv())
                    .map(|kv| kv.value().len())
                    .sum();
            }
            if shape == RoundShape::Placement {
                // Serializable, as an agent reads its shard.
                let opts = etcd_client::GetOptions::new().with_serializable();
                let r = c.get(key, Some(opts)).await.expect("the member's shard");
                let kv = r.kvs().first().expect("the shard is there");
                let shard = fsdp_proto::v1::Round::decode(kv.value()).expect("a round");
                assert!(
                    shard
                        .members
                        .iter()
                        .any(|m| m.node_id.contains(&format!("{i:05}")))
                );
                got += kv.value().len();
            }
            got
        });
    }
    let mut received = 0;
    while let Some(r) = tasks.join_next().await {
        received = received.max(r.expect("a member's part"));
    }
    println!(
        "nodes={nodes} round={} round_s={:.3} round_bytes={received} bench_cpu_s={:.2}",
        shape.name(),
        start.elapsed().as_secs_f64(),
        own_cpu_s()
    );
}
