//! The etcd v3 rendezvous against a real etcd started by the test: rounds, departures,
//! coordinator failover, fencing, growth, stale runs, etcd restarts, garbage, TLS, auth.

use std::time::{Duration, Instant};

use fsdp_rendezvous::etcd::{EtcdConfig, EtcdRendezvous, Keys, TlsFiles, commit_round, connect};
use fsdp_rendezvous::{
    Change, Departure, Detection, JobRecords, LeftKind, LeftReason, Rendezvous, RendezvousError,
    Round,
};
use fsdp_tests::etcd::{Etcd, ServerTls};
use fsdp_tests::etcd_cluster::EtcdCluster;
use futures::future::join_all;

/// What these tests' nodes say when they leave (status's record; no test here reads it).
fn why() -> LeftReason {
    LeftReason::new(LeftKind::Left, "the test")
}

const TTL: Duration = Duration::from_secs(2);

fn config(etcd: &Etcd, run: &str, min: u32, max: u32) -> EtcdConfig {
    let mut c = EtcdConfig::new(vec![etcd.endpoint()], run, min, max);
    c.keep_alive_ttl = TTL;
    c.last_call = Duration::from_millis(300);
    c.join_timeout = Duration::from_secs(30);
    c.straggler_timeout = Duration::from_secs(10);
    c.options.retry_window = Duration::from_secs(10);
    c
}

async fn nodes(etcd: &Etcd, run: &str, min: u32, max: u32, n: usize) -> Vec<EtcdRendezvous> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(
            EtcdRendezvous::connect(config(etcd, run, min, max))
                .await
                .expect("join"),
        );
    }
    out
}

async fn rounds(nodes: &mut [EtcdRendezvous]) -> Vec<Round> {
    let futs: Vec<_> = nodes.iter_mut().map(|n| n.next_round()).collect();
    join_all(futs)
        .await
        .into_iter()
        .map(|r| r.expect("round"))
        .collect()
}

/// Rounds after a disruption, as agents reach them: a node that joined a round which
/// broke right after (another node refused it, its old registration having gone with a
/// fenced lease) sees the change and joins the next one, as the agent loop does. Done
/// once no node has seen a change for `quiet`.
async fn settled_rounds(nodes: &mut [EtcdRendezvous], quiet: Duration) -> Vec<Round> {
    let futs: Vec<_> = nodes
        .iter_mut()
        .map(|n| async move {
            loop {
                let r = n.next_round().await.expect("round");
                match tokio::time::timeout(quiet, n.changed()).await {
                    Err(_) => return r,
                    Ok(change) => {
                        change.expect("a change, not an error");
                    }
                }
            }
        })
        .collect();
    join_all(futs).await
}

async fn within<T>(limit: Duration, what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(limit, f)
        .await
        .unwrap_or_else(|_| panic!("timed out after {limit:?}: {what}"))
}

fn assert_one_group(rs: &[Round]) {
    let first = &rs[0];
    let mut ranks: Vec<u32> = rs.iter().map(|r| r.group_rank).collect();
    ranks.sort();
    assert_eq!(ranks, (0..rs.len() as u32).collect::<Vec<_>>(), "{rs:?}");
    for r in rs {
        assert_eq!(
            (r.number, r.world_size, r.group_world_size),
            (first.number, first.world_size, first.group_world_size)
        );
        assert_eq!(
            (&r.master_addr, r.master_port),
            (&first.master_addr, first.master_port),
            "one master"
        );
        assert_eq!(r.restart_count, first.restart_count);
    }
    assert_ne!(first.master_port, 0);
}

/// A node whose first read of the run etcd answers later than the retry window (a crowd
/// of 10,000 joining on a busy etcd: every such node gave up, "etcd did not answer the
/// first read of the run", and its agent exited) waits for it up to the join timeout.
/// Here the window is a millisecond, shorter than any read, watch and count on a real
/// etcd take.
#[tokio::test]
async fn a_first_read_slower_than_the_retry_window_is_waited_for_up_to_the_join_timeout() {
    let etcd = Etcd::start();
    let mut cfg = config(&etcd, "slow-first-read", 1, 1);
    cfg.options.retry_window = Duration::from_millis(1);
    let mut node = EtcdRendezvous::connect(cfg).await.expect("joins");
    let r = within(Duration::from_secs(20), "a round of one", node.next_round()).await;
    assert_eq!(r.unwrap().world_size, 1);
}

#[tokio::test]
async fn three_nodes_seal_one_round_and_two_seal_after_the_last_call() {
    let etcd = Etcd::start();
    let mut ns = nodes(&etcd, "three", 2, 3, 3).await;
    let rs = within(Duration::from_secs(20), "round of 3", rounds(&mut ns)).await;
    assert_one_group(&rs);
    assert_eq!(rs[0].world_size, 3);

    let mut cfg = config(&etcd, "lastcall", 2, 4);
    cfg.last_call = Duration::from_secs(1);
    let mut two = vec![
        EtcdRendezvous::connect(cfg.clone()).await.unwrap(),
        EtcdRendezvous::connect(cfg).await.unwrap(),
    ];
    let start = Instant::now();
    let rs = within(Duration::from_secs(20), "round of 2", rounds(&mut two)).await;
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "sealed before the last call: {:?}",
        start.elapsed()
    );
    assert_one_group(&rs);
    assert_eq!(rs[0].group_world_size, 2);
}

#[tokio::test]
async fn a_dead_node_is_out_after_the_ttl_and_a_leaving_node_at_once() {
    let etcd = Etcd::start();
    let mut ns = nodes(&etcd, "leave", 1, 3, 3).await;
    rounds(&mut ns).await;
    // Dropping a handle stops its keep-alive without revoking: a crash.
    let dead = ns.pop().unwrap();
    let dead_id = dead.node_id().to_owned();
    drop(dead);
    let start = Instant::now();
    let change = within(
        Duration::from_secs(15),
        "loss of the dead node",
        ns[0].changed(),
    )
    .await
    .unwrap();
    assert_eq!(
        change,
        Change::MemberLost {
            node: dead_id.clone()
        }
    );
    assert!(
        start.elapsed() >= Duration::from_millis(500),
        "noticed before the lease could expire"
    );
    let rs = within(Duration::from_secs(20), "re-form of 2", rounds(&mut ns)).await;
    assert_one_group(&rs);
    assert_eq!(rs[0].group_world_size, 2);

    // A graceful leave revokes the lease: the survivor learns long before a TTL.
    let id1 = ns[1].node_id().to_owned();
    let start = Instant::now();
    ns[1].depart(Departure::Left, why()).await.unwrap();
    let change = within(Duration::from_secs(5), "graceful leave", ns[0].changed())
        .await
        .unwrap();
    let took = start.elapsed();
    assert_eq!(change, Change::MemberLost { node: id1 });
    assert!(
        took < TTL / 2,
        "took {took:?}: looks like lease expiry, not a revoke"
    );
    let r = within(Duration::from_secs(20), "round of 1", ns[0].next_round())
        .await
        .unwrap();
    assert_eq!(r.group_world_size, 1);
}

/// A run that leaves at once (a job deleted) says only its first departure: once the
/// members know the round broke, another word of a departure from it is no news to them,
/// and each would go to every member still watching (a million events for 1,000 nodes,
/// seconds of etcd's and the agents' CPU on the machines a run starting beside it
/// shares). Neither the nodes that go nor the coordinator, which stays and sees each
/// registration go, write one.
#[tokio::test]
async fn a_run_leaving_at_once_says_only_its_first_departure() {
    let etcd = Etcd::start();
    // No smaller round forms: the one sealed stays the round they all leave.
    let mut ns = nodes(&etcd, "crowd", 5, 5, 5).await;
    let number = rounds(&mut ns).await[0].number;
    let coordinator = ns[0].view().coordinator.expect("a coordinator");
    let stays = ns.iter().position(|n| n.node_id() == coordinator).unwrap();
    let mut stays = ns.remove(stays);
    let mut first = ns.pop().unwrap();
    let first_id = first.node_id().to_owned();
    first.depart(Departure::Left, why()).await.unwrap();
    for n in ns.iter_mut().chain([&mut stays]) {
        let change = within(Duration::from_secs(5), "the first leave", n.changed()).await;
        let node = first_id.clone();
        assert_eq!(change.unwrap(), Change::MemberLost { node });
    }
    let others: Vec<String> = ns.iter().map(|n| n.node_id().to_owned()).collect();
    let leaving: Vec<_> = ns
        .iter_mut()
        .map(|n| n.depart(Departure::Left, why()))
        .collect();
    for left in join_all(leaving).await {
        left.unwrap();
    }
    // The coordinator sees each revoke at once; a "lost" would follow within a second.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(stays.view().coordinator, Some(coordinator));
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    let opts = etcd_client::GetOptions::new().with_prefix();
    let keys = Keys::new("/fsdp", "crowd").unwrap();
    let words = c
        .get(keys.key::<fsdp_proto::v1::Left>(""), Some(opts))
        .await
        .unwrap();
    let said: Vec<String> = words
        .kvs()
        .iter()
        .map(|kv| kv.key_str().unwrap().to_owned())
        .collect();
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].contains(&first_id), "{said:?}");
    // How each went, as the agent reports it: the first left, the others unsaid.
    let records = stays.records().unwrap();
    assert_eq!(records.detection(&first_id, number), Detection::Left);
    for node in &others {
        assert_eq!(records.detection(node, number), Detection::Unsaid, "{node}");
    }
    stays.depart(Departure::Left, why()).await.unwrap();
}

#[tokio::test]
async fn a_new_coordinator_takes_over_when_the_old_one_dies() {
    let etcd = Etcd::start();
    let mut ns = nodes(&etcd, "coord", 1, 3, 3).await;
    rounds(&mut ns).await;
    let coord = ns[0].view().coordinator.expect("a coordinator");
    let idx = ns
        .iter()
        .position(|n| n.node_id() == coord)
        .expect("coordinator is a member");
    drop(ns.remove(idx));
    for n in ns.iter_mut() {
        within(
            Duration::from_secs(15),
            "loss of the coordinator",
            n.changed(),
        )
        .await
        .unwrap();
    }
    let rs = within(
        Duration::from_secs(20),
        "round after failover",
        rounds(&mut ns),
    )
    .await;
    assert_one_group(&rs);
    assert_eq!(rs[0].group_world_size, 2);
    let new = ns[0].view().coordinator.expect("a new coordinator");
    assert_ne!(new, coord);
}

#[tokio::test]
async fn racing_commits_of_the_same_round_have_exactly_one_winner() {
    let etcd = Etcd::start();
    let opts = config(&etcd, "race", 1, 2).options;
    let keys = Keys::new("/fsdp", "race").unwrap();
    let (mut a, mut b) = (connect(&opts).await.unwrap(), connect(&opts).await.unwrap());
    let record = |n: u64, who: &str| fsdp_proto::v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number: n,
        reason: who.into(),
        ..Default::default()
    };
    // The coordinator key both commits name, on a lease of its own.
    let lease = claim_coordinator(&mut a, &keys, "a").await;
    for round in 0..20u64 {
        let fence = if round == 0 {
            None
        } else {
            let r = a
                .get(keys.key::<fsdp_proto::v1::Round>(""), None)
                .await
                .unwrap();
            Some(r.kvs()[0].mod_revision())
        };
        let (ra, rb) = (record(round, "a"), record(round, "b"));
        let (wa, wb) = tokio::join!(
            commit_round(&mut a, &keys, fence, lease, &ra),
            commit_round(&mut b, &keys, fence, lease, &rb)
        );
        let (wa, wb) = (wa.unwrap(), wb.unwrap());
        assert!(wa ^ wb, "round {round}: a won {wa}, b won {wb}");
    }
    // The right revision on another lease (a commit decided before etcd lost its data,
    // where revisions start again) is refused; the same commit on the key's lease is not.
    let r = a
        .get(keys.key::<fsdp_proto::v1::Round>(""), None)
        .await
        .unwrap();
    let fence = Some(r.kvs()[0].mod_revision());
    let next = record(20, "a");
    let stale = commit_round(&mut a, &keys, fence, lease + 1, &next).await;
    assert!(!stale.unwrap(), "a commit on a lease the key is not on won");
    let live = commit_round(&mut a, &keys, fence, lease, &next).await;
    assert!(live.unwrap());
}

#[tokio::test]
async fn a_new_node_below_max_triggers_a_round_that_includes_it() {
    let etcd = Etcd::start();
    let mut ns = nodes(&etcd, "grow", 1, 3, 2).await;
    let rs = rounds(&mut ns).await;
    assert_eq!(rs[0].group_world_size, 2);
    let mut newcomer = EtcdRendezvous::connect(config(&etcd, "grow", 1, 3))
        .await
        .unwrap();
    let new_id = newcomer.node_id().to_owned();
    let join = newcomer.next_round();
    let watch = async {
        for n in ns.iter_mut() {
            let c = n.changed().await.unwrap();
            assert!(matches!(c, Change::NewRound { .. }), "{c:?}");
        }
        rounds(&mut ns).await
    };
    let (mine, theirs) = within(Duration::from_secs(20), "growth to 3", async {
        tokio::join!(join, watch)
    })
    .await;
    let mine = mine.unwrap();
    let mut all = theirs;
    all.push(mine.clone());
    assert_one_group(&all);
    assert_eq!(mine.group_world_size, 3);
    // Survivors keep their ranks; the newcomer comes last.
    assert_eq!(
        (all[0].group_rank, all[1].group_rank, mine.group_rank),
        (rs[0].group_rank, rs[1].group_rank, 2)
    );
    assert!(ns.iter().all(|n| n.node_id() != new_id));
}

#[tokio::test]
async fn finished_and_failed_runs_do_not_block_a_new_job_with_the_same_id() {
    let etcd = Etcd::start();
    for how in [Departure::Finished, Departure::Failed] {
        let mut ns = nodes(&etcd, "reuse", 2, 2, 2).await;
        let first = rounds(&mut ns).await;
        if how == Departure::Failed {
            ns[0].record_failure().await.unwrap();
        }
        for n in ns.iter_mut() {
            n.depart(how, why()).await.unwrap();
        }
        drop(ns);
        let mut again = nodes(&etcd, "reuse", 2, 2, 2).await;
        let rs = within(Duration::from_secs(20), "a fresh round", rounds(&mut again)).await;
        assert_one_group(&rs);
        assert_eq!(
            rs[0].restart_count, 0,
            "{how:?}: history charged to the new job"
        );
        assert!(rs[0].number > first[0].number);
    }
}

async fn survives_etcd_restart(keep_data: bool) {
    let mut etcd = Etcd::start();
    let mut ns = nodes(&etcd, "restart", 2, 2, 2).await;
    let before = rounds(&mut ns).await;
    etcd.restart(keep_data);
    // For a few lease TTLs, no agent may see a change: workers keep running.
    let quiet = async {
        let futs: Vec<_> = ns.iter_mut().map(|n| n.changed()).collect();
        join_all(futs).await
    };
    match tokio::time::timeout(TTL * 4 + Duration::from_secs(2), quiet).await {
        Err(_) => {}
        Ok(changes) => panic!(
            "keep_data={keep_data}: agents saw a change: {changes:?}\n{}",
            etcd.log()
        ),
    }
    // The same membership is committed in etcd again.
    let opts = config(&etcd, "restart", 2, 2).options;
    let mut c = connect(&opts).await.unwrap();
    let keys = Keys::new("/fsdp", "restart").unwrap();
    let resp = c
        .get(keys.key::<fsdp_proto::v1::Round>(""), None)
        .await
        .unwrap();
    let round: fsdp_proto::v1::Round = fsdp_proto::decode(
        &keys.key::<fsdp_proto::v1::Round>(""),
        resp.kvs()[0].value(),
    )
    .unwrap();
    assert_eq!(round.number, before[0].number);
    let mut ids: Vec<String> = round.members.iter().map(|m| m.node_id.clone()).collect();
    let mut expect: Vec<String> = ns.iter().map(|n| n.node_id().to_owned()).collect();
    ids.sort();
    expect.sort();
    assert_eq!(ids, expect);
    // And the run still works: a leave is noticed.
    ns[1].depart(Departure::Left, why()).await.unwrap();
    within(
        Duration::from_secs(10),
        "a leave after the restart",
        ns[0].changed(),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn an_etcd_restart_with_its_data_changes_nothing() {
    survives_etcd_restart(true).await;
}

#[tokio::test]
async fn an_etcd_restart_without_its_data_changes_nothing() {
    survives_etcd_restart(false).await;
}

/// A run whose whole read is larger than 4 MiB still forms. At 20,000 nodes a
/// coordinator's read of the run (every registration and the placed round's shards, ~5
/// MB) passed the gRPC client's default limit on an answer; each read failed as "decoded
/// message length too large", the coordinator read again for ever, and the crowd stalled
/// at the seal. Here the size is made by six shards of 1 MB under the placements (the
/// whole read holds them; a member's view passes over them) and five records of 1 MB
/// under the control keys, which the join's nesting check and every member's read of
/// them hold (a run's `done/` records while it ends; these are refused, and ignored).
#[tokio::test]
async fn a_run_whose_whole_read_passes_4_mib_still_forms() {
    let etcd = Etcd::start();
    let opts = config(&etcd, "big", 2, 2).options;
    let mut c = connect(&opts).await.unwrap();
    let keys = Keys::new("/fsdp", "big").unwrap();
    let first = c.get("/", None).await.unwrap().header().unwrap().revision() + 1;
    for (under, count) in [(keys.placements(), 6), (keys.ctl(), 5)] {
        for i in 0..count {
            let key = format!("{under}junk/{i:05}");
            c.put(key, vec![b'x'; 1_000_000], None).await.unwrap();
        }
    }
    let mut ns = nodes(&etcd, "big", 2, 2, 2).await;
    let rs = within(Duration::from_secs(30), "a round", rounds(&mut ns)).await;
    assert_one_group(&rs);
    // A watch opened at an older revision gets the events since in one batch, as the
    // coordinator's after a read of the run: 11 MB here.
    let opts = etcd_client::WatchOptions::new()
        .with_prefix()
        .with_start_revision(first);
    let mut w = fsdp_rendezvous::etcd::watcher(&c)
        .watch(keys.root(), Some(opts))
        .await
        .unwrap();
    let mut events = 0;
    while events < 11 {
        let batch = within(Duration::from_secs(10), "the watch's events", w.message()).await;
        events += batch
            .expect("events over 4 MiB")
            .expect("the stream")
            .events()
            .len();
    }
    // And the agent's report of the run.
    let report = fsdp_rendezvous::etcd::inspect::inspect(&mut c, "/fsdp", "big").await;
    assert!(report.expect("the run's keys read").is_some());
}

/// A node id whose place in a crowd of 10,000 is between `from` and `to` (of 1): such a
/// node waits its turn, looks first at `(place - 1,000) / 4,000` seconds and goes on its
/// own only at its place in the slowed spread (about 3 s a thousand places).
fn placed_between(from: f64, to: f64, not: &str) -> String {
    (0..)
        .map(|i| format!("crowd-{i}"))
        .find(|id| {
            let p = fsdp_rendezvous::etcd::place_in_crowd(id);
            p > from && p < to && id != not
        })
        .expect("a node id")
}

/// A crowd's node waits for the coordinator's word, not for its place in the spread: a
/// node of a run of 10,000 whose place comes at about 17 s joins within a second or two of
/// the put of an admission key at or past its own, made while it watches; one that
/// looks after the put goes at its first look. Neither goes through the gate.
#[tokio::test]
async fn a_crowd_node_goes_when_the_coordinator_lets_the_crowd_that_far() {
    let etcd = Etcd::start();
    let keys = Keys::new("/fsdp", "crowd").unwrap();
    let started = Instant::now();
    let mut cfg = config(&etcd, "crowd", 1, 10_000);
    cfg.node_id = placed_between(0.62, 0.65, "");
    let watching = tokio::spawn(EtcdRendezvous::connect(cfg));
    // Past its first look (about 1.3 s): it reads, finds nothing and watches.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!watching.is_finished(), "joined before its turn");
    let mut c = connect(&config(&etcd, "crowd", 1, 10_000).options)
        .await
        .unwrap();
    let leases = c.leases().await.unwrap();
    assert!(leases.leases().is_empty(), "a lease before its turn");
    c.put(keys.admission(200), "", None).await.unwrap();
    let put = Instant::now();
    let node = within(Duration::from_secs(10), "the join", watching)
        .await
        .unwrap()
        .expect("join");
    let joined = put.elapsed();
    assert!(joined < Duration::from_secs(3), "{joined:?} after the put");
    assert!(started.elapsed() < Duration::from_secs(10));
    let counters = node.counters();
    assert_eq!(
        counters
            .turn_pushed
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(
        counters.gated_ns.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    // The key is there before this one's first look: it goes then.
    let mut cfg = config(&etcd, "crowd", 1, 10_000);
    cfg.node_id = placed_between(0.62, 0.65, node.node_id());
    let started = Instant::now();
    let other = within(
        Duration::from_secs(10),
        "the second join",
        EtcdRendezvous::connect(cfg),
    )
    .await
    .expect("join");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    let counters = other.counters();
    assert_eq!(
        counters
            .turn_pushed
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

/// Watch streams etcd opened so far (`grpc_server_started_total` of `Watch`).
fn watch_streams_opened(etcd: &Etcd) -> u64 {
    let text = fsdp_tests::metrics_text(&etcd.endpoint());
    text.lines()
        .filter(|l| l.starts_with("grpc_server_started_total") && l.contains("\"Watch\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A crowd's node that waited for its turn keeps what it saw while it waited: the control
/// keys written then are in its first view (its read brought up to date by its turn's
/// watch, which watches them too), and its session watches them on the stream it waited
/// on, not on one of its own (one stream a node, as the floor: at 10,000 nodes the turns
/// were 9,000 stream opens more). A change after the join still reaches it there.
#[tokio::test]
async fn a_crowd_node_let_in_keeps_what_its_turns_watch_saw_and_its_stream() {
    let etcd = Etcd::start();
    let keys = Keys::new("/fsdp", "turn-kept").unwrap();
    let mut cfg = config(&etcd, "turn-kept", 1, 10_000);
    cfg.node_id = placed_between(0.62, 0.65, "");
    let watching = tokio::spawn(EtcdRendezvous::connect(cfg));
    // Past its first look (about 1.3 s): it read, found nothing and watches.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!watching.is_finished(), "joined before its turn");
    assert_eq!(watch_streams_opened(&etcd), 1, "the turn's watch");
    let mut c = connect(&config(&etcd, "turn-kept", 1, 10_000).options)
        .await
        .unwrap();
    // Written while it waits, after its look's read.
    let claim = claim_coordinator(&mut c, &keys, "elsewhere").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.put(keys.admission(200), "", None).await.unwrap();
    let node = within(Duration::from_secs(10), "the join", watching)
        .await
        .unwrap()
        .expect("join");
    assert_eq!(
        node.view().coordinator.as_deref(),
        Some("elsewhere"),
        "the claim made while it waited"
    );
    assert_eq!(
        watch_streams_opened(&etcd),
        1,
        "the session's watches open on the turn's stream"
    );
    // The claim gone: the session's watch on that stream says so.
    c.lease_revoke(claim).await.unwrap();
    let mut views = node.views();
    within(
        Duration::from_secs(10),
        "the claim's end seen",
        views.wait_for(|v| v.coordinator.as_deref() != Some("elsewhere")),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn garbage_in_a_rendezvous_key_is_a_clear_error() {
    let etcd = Etcd::start();
    let opts = config(&etcd, "garbage", 1, 1).options;
    let mut c = connect(&opts).await.unwrap();
    let keys = Keys::new("/fsdp", "garbage").unwrap();
    c.put(
        keys.key::<fsdp_proto::v1::Round>(""),
        b"\xde\xad\xbe\xef not a protobuf".to_vec(),
        None,
    )
    .await
    .unwrap();
    let mut n = EtcdRendezvous::connect(config(&etcd, "garbage", 1, 1))
        .await
        .unwrap();
    let err = within(
        Duration::from_secs(10),
        "an error, not a hang",
        n.next_round(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, RendezvousError::Corrupt(_)), "{err}");
    let text = err.to_string();
    assert!(text.contains("/fsdp/garbage/ctl/round"), "{text}");
}

fn tls_material(dir: &std::path::Path) -> (ServerTls, TlsFiles, TlsFiles) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SanType};
    let write = |name: &str, body: String| {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p
    };
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(names).unwrap();
        p.subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        let cert = p.signed_by(&key, &ca).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["localhost".into()]);
    let (client_cert, client_key) = leaf(vec!["client".into()]);
    let ca_path = write("ca.pem", ca.pem());
    // A second CA the server does not trust, for the wrong-certificate case.
    let mut rogue_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    rogue_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let rogue = CertifiedIssuer::self_signed(rogue_params, KeyPair::generate().unwrap()).unwrap();
    let rogue_key = KeyPair::generate().unwrap();
    let rogue_cert = CertificateParams::new(vec!["client".into()])
        .unwrap()
        .signed_by(&rogue_key, &rogue)
        .unwrap();
    let server = ServerTls {
        cert: write("server.pem", server_cert),
        key: write("server-key.pem", server_key),
        ca: ca_path.clone(),
    };
    let good = TlsFiles {
        ca: Some(ca_path.clone()),
        cert: Some(write("client.pem", client_cert)),
        key: Some(write("client-key.pem", client_key)),
    };
    let bad = TlsFiles {
        ca: Some(ca_path),
        cert: Some(write("rogue.pem", rogue_cert.pem())),
        key: Some(write("rogue-key.pem", rogue_key.serialize_pem())),
    };
    (server, good, bad)
}

#[tokio::test]
async fn tls_with_client_certificates() {
    let dir = tempfile::TempDir::new().unwrap();
    let (server, good, bad) = tls_material(dir.path());
    let etcd = Etcd::start_with(Some(server));
    let mut cfg = config(&etcd, "tls", 1, 1);
    cfg.options.tls = Some(good);
    let mut n = EtcdRendezvous::connect(cfg.clone())
        .await
        .expect("join over TLS");
    let r = within(Duration::from_secs(20), "a round over TLS", n.next_round())
        .await
        .unwrap();
    assert_eq!(r.world_size, 1);

    cfg.options.tls = Some(bad);
    cfg.options.retry_window = Duration::from_secs(2);
    let err = EtcdRendezvous::connect(cfg)
        .await
        .err()
        .expect("a rogue client certificate is refused");
    assert!(matches!(err, RendezvousError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains(&etcd.endpoint()), "{err}");
}

#[tokio::test]
async fn user_and_password_authentication() {
    let etcd = Etcd::start();
    let mut admin = connect(&config(&etcd, "auth", 1, 1).options).await.unwrap();
    admin.user_add("root", "s3cret", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();

    let mut cfg = config(&etcd, "auth", 1, 1);
    cfg.options.user = Some(("root".into(), "s3cret".into()));
    let mut n = EtcdRendezvous::connect(cfg.clone())
        .await
        .expect("join with credentials");
    within(Duration::from_secs(20), "a round with auth", n.next_round())
        .await
        .unwrap();

    cfg.options.user = Some(("root".into(), "wrong".into()));
    let start = Instant::now();
    let err = EtcdRendezvous::connect(cfg)
        .await
        .err()
        .expect("wrong password is refused");
    assert!(matches!(err, RendezvousError::Unreachable { .. }), "{err}");
    let chain = format!(
        "{err}: {}",
        std::error::Error::source(&err)
            .map(|s| s.to_string())
            .unwrap_or_default()
    );
    assert!(
        chain.to_lowercase().contains("authentication failed"),
        "{chain}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "a bad password is not retried for the whole window"
    );
    // Nor does the error claim it was: "retried for 10s" sent people after the network.
    assert!(
        !chain.contains("retried for") && chain.contains("first attempt"),
        "{chain}"
    );
}

/// The second node leaves; the first sees it gone within seconds, not a lease TTL.
async fn a_leave_is_noticed_at_once(ns: &mut [EtcdRendezvous]) {
    ns[1].depart(Departure::Left, why()).await.unwrap();
    let seen = within(Duration::from_secs(10), "a leave", ns[0].changed()).await;
    assert_eq!(
        seen.unwrap(),
        Change::MemberLost {
            node: ns[1].node_id().to_owned()
        }
    );
}

/// Outside testing: an agent whose failure report met an etcd that was down exited 69.
/// Now the request waits for etcd and goes through, and the others learn of the failure.
#[tokio::test]
async fn a_request_made_while_etcd_is_down_waits_for_etcd_instead_of_failing() {
    let mut etcd = Etcd::start();
    let mut ns = nodes(&etcd, "outage-request", 2, 2, 2).await;
    let formed = rounds(&mut ns).await;
    etcd.kill();
    let (a, b) = ns.split_at_mut(1);
    let report = a[0].record_failure();
    let restart = async {
        // Down for most of a lease TTL: long enough for the report to fail at once before,
        // short enough that nothing else happens.
        tokio::time::sleep(TTL * 3 / 4).await;
        etcd.start_again();
    };
    let (reported, ()) = within(Duration::from_secs(20), "the report", async {
        tokio::join!(report, restart)
    })
    .await;
    assert_eq!(reported.expect("the report waits for etcd"), 1);
    let seen = within(Duration::from_secs(10), "the failure", b[0].changed()).await;
    assert_eq!(
        seen.unwrap(),
        Change::PeerFailed {
            restart_count: formed[0].restart_count + 1
        }
    );
}

/// etcd down (its process gone, or starting and not yet serving) for three lease TTLs:
/// no lease can expire without an etcd leader, so no agent fences its workers, and the
/// same round goes on when etcd is back, with or without its data.
async fn a_long_etcd_outage_fences_no_one(keep_data: bool) {
    let mut etcd = Etcd::start();
    let mut ns = nodes(&etcd, "outage-long", 2, 2, 2).await;
    let before = rounds(&mut ns).await;
    etcd.kill();
    if !keep_data {
        std::fs::remove_dir_all(&etcd.data_dir).unwrap();
    }
    let quiet = async {
        let futs: Vec<_> = ns.iter_mut().map(|n| n.changed()).collect();
        join_all(futs).await
    };
    let outage = async {
        tokio::time::sleep(TTL * 3).await;
        etcd.start_again();
        tokio::time::sleep(TTL * 3).await;
    };
    tokio::select! {
        changes = quiet => panic!("keep_data={keep_data}: agents saw a change: {changes:?}"),
        () = outage => {}
    }
    // The run still works: a leave is noticed at once.
    a_leave_is_noticed_at_once(&mut ns).await;
    assert_eq!(before[0].number, before[1].number);
}

#[tokio::test]
async fn etcd_down_for_three_lease_ttls_fences_no_one() {
    a_long_etcd_outage_fences_no_one(true).await;
}

#[tokio::test]
async fn etcd_down_for_three_lease_ttls_and_back_empty_fences_no_one() {
    a_long_etcd_outage_fences_no_one(false).await;
}

/// A frozen etcd accepts connections and answers nothing, like a starting one: agents
/// hold (no leader can expire a lease meanwhile), and when it thaws the run goes on as
/// one group.
#[tokio::test]
async fn a_frozen_etcd_stops_no_worker_while_frozen_and_the_run_goes_on_after() {
    let etcd = Etcd::start();
    let mut ns = nodes(&etcd, "etcd-frozen", 2, 2, 2).await;
    rounds(&mut ns).await;
    let pid = etcd.pid();
    let signal = |s| nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), s).unwrap();
    signal(nix::sys::signal::Signal::SIGSTOP);
    let quiet = async {
        let futs: Vec<_> = ns.iter_mut().map(|n| n.changed()).collect();
        join_all(futs).await
    };
    tokio::select! {
        changes = quiet => panic!("agents saw a change while etcd was frozen: {changes:?}"),
        () = tokio::time::sleep(TTL * 3) => {}
    }
    signal(nix::sys::signal::Signal::SIGCONT);
    // The thawed etcd may expire every lease at once; whatever it does, the agents end
    // up in one group again.
    let settle = async {
        let changes = join_all(ns.iter_mut().map(|n| n.changed())).await;
        changes.into_iter().map(|c| c.unwrap()).collect::<Vec<_>>()
    };
    match tokio::time::timeout(TTL * 3, settle).await {
        Err(_) => {} // nothing changed: the same group goes on
        Ok(_) => {
            let rs = within(
                Duration::from_secs(30),
                "a new round",
                settled_rounds(&mut ns, TTL),
            )
            .await;
            assert_one_group(&rs);
        }
    }
}

/// A node id named `name`-i that is one of a crowd's first 1,000 places at MAX 2,000: no
/// turn to wait, the gate at once.
fn in_the_crowds_first_places(name: &str) -> String {
    (0..)
        .map(|i| format!("{name}-{i}"))
        .find(|id| fsdp_rendezvous::etcd::place_in_crowd(id) < 0.4)
        .unwrap()
}

/// Starts the join of `cfg` with `etcd` frozen (SIGSTOP) for 5 s, so that its first
/// request is answered that late, and returns once etcd thawed: the join, and a client
/// of its own to look at etcd with.
async fn join_while_etcd_is_frozen(
    etcd: &Etcd,
    cfg: EtcdConfig,
) -> (
    tokio::task::JoinHandle<Result<EtcdRendezvous, RendezvousError>>,
    etcd_client::Client,
) {
    let pid = nix::unistd::Pid::from_raw(etcd.pid());
    let signal = |s| nix::sys::signal::kill(pid, s).unwrap();
    let client = connect(&cfg.options).await.unwrap();
    let outsider = connect(&cfg.options).await.unwrap();
    signal(nix::sys::signal::Signal::SIGSTOP);
    let join = tokio::spawn(EtcdRendezvous::join(client, cfg));
    tokio::time::sleep(Duration::from_secs(5)).await;
    signal(nix::sys::signal::Signal::SIGCONT);
    (join, outsider)
}

/// A crowd's node (MAX above 1,000) reads its nesting check linearizably: etcd answers it
/// only once its apply loop caught up, and a late answer holds the node at the gate, with
/// no lease and no registration, before it looks again and joins. A frozen etcd stands in
/// for one whose apply loop is behind. A run of up to 1,000 nodes has no gate.
#[tokio::test]
async fn a_crowds_node_answered_late_waits_at_the_gate_without_a_lease_then_joins() {
    use fsdp_rendezvous::Rendezvous;
    let etcd = Etcd::start();
    for (max, gated) in [(2_000, true), (1_000, false)] {
        let mut cfg = config(&etcd, &format!("gate-{max}"), 1, max);
        cfg.node_id = in_the_crowds_first_places(&format!("gate-node-{max}"));
        // The nesting read, sent at once, waits the 5 s of the freeze, so a gated node is
        // held 2.5 s or more after etcd thaws.
        let (join, mut outsider) = join_while_etcd_is_frozen(&etcd, cfg).await;
        // For the first second of its hold (it lasts 1.3 s or more), looked at often.
        let thawed = Instant::now();
        while gated && thawed.elapsed() < Duration::from_secs(1) {
            let leases = outsider.leases().await.unwrap();
            assert!(
                leases.leases().is_empty(),
                "a node held at the gate holds no lease ({:?} after the thaw): {:?}",
                thawed.elapsed(),
                leases.leases()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut n = within(Duration::from_secs(30), "the join", join)
            .await
            .unwrap()
            .expect("joins");
        let held = n
            .counters()
            .gated_ns
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(held > 0, gated, "MAX {max}: held at the gate for {held} ns");
        let r = within(Duration::from_secs(30), "a round", n.next_round())
            .await
            .expect("round");
        assert_eq!(r.members.len(), 1, "the node forms its round alone");
        n.depart(Departure::Left, why()).await.unwrap();
    }
}

/// A node held at the gate goes on when the coordinator lets the crowd as far as its
/// place, not when its pause is over: held out, the crowd's first nodes, whose first
/// looks met etcd at its busiest, were the last of 10,000 to join. A frozen etcd answers
/// the look 5 s late, which held the node 2.3 s or more after the thaw (its pause drawn
/// from half the latency on); the admission key is put 0.3 s after the thaw, and the node
/// joins within 1.5 s of the thaw.
#[tokio::test]
async fn a_node_held_at_the_gate_goes_on_at_the_coordinators_push() {
    let etcd = Etcd::start();
    let keys = Keys::new("/fsdp", "gate-push").unwrap();
    let mut cfg = config(&etcd, "gate-push", 1, 2_000);
    cfg.node_id = in_the_crowds_first_places("gate-push");
    let (join, mut outsider) = join_while_etcd_is_frozen(&etcd, cfg).await;
    let thawed = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!join.is_finished(), "the node was not held");
    let leases = outsider.leases().await.unwrap();
    assert!(leases.leases().is_empty(), "a lease while held");
    outsider.put(keys.admission(200), "", None).await.unwrap();
    let n = within(Duration::from_secs(30), "the join", join)
        .await
        .unwrap()
        .expect("joins");
    let joined = thawed.elapsed();
    assert!(
        joined < Duration::from_millis(1_500),
        "joined {joined:?} after the thaw: its pause, not the push"
    );
    // Held and pushed; or, on a machine so busy that etcd answered the look only after
    // the put, not held at all (the look itself saw the key).
    let counters = n.counters();
    let pushed = counters
        .gate_pushed
        .load(std::sync::atomic::Ordering::Relaxed);
    let held = counters.gated_ns.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        (pushed == 1 && held > 0) || (pushed == 0 && held == 0),
        "pushed {pushed}, held {held} ns"
    );
}

/// Writes the run's coordinator key for `node_id` through `client`, on a 60 s lease of its
/// own (returned), as a coordinator's claim is written.
async fn claim_coordinator(client: &mut etcd_client::Client, keys: &Keys, node_id: &str) -> i64 {
    let lease = client.lease_grant(60, None).await.unwrap().id();
    let claim = fsdp_proto::v1::Coordinator {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: node_id.into(),
    };
    client
        .put(
            keys.key::<fsdp_proto::v1::Coordinator>(""),
            prost::Message::encode_to_vec(&claim),
            Some(etcd_client::PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();
    lease
}

/// etcd gone for longer than `outage_timeout`: the agent stops waiting, with an error that
/// names the bound (the agent exits 69 on it).
#[tokio::test]
async fn etcd_gone_longer_than_outage_timeout_ends_the_rendezvous_with_a_clear_error() {
    let mut etcd = Etcd::start();
    let mut c = config(&etcd, "outage-bound", 1, 1);
    c.outage_timeout = Duration::from_secs(3);
    let mut n = EtcdRendezvous::connect(c).await.unwrap();
    n.next_round().await.unwrap();
    etcd.kill();
    let started = Instant::now();
    let err = within(Duration::from_secs(20), "giving up", n.changed())
        .await
        .expect_err("the rendezvous gives up");
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(err, RendezvousError::Outage(_)), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("outage_timeout"), "{text}");
    assert!(!err.is_configuration());
}

/// The leader of the member `endpoints` name, found by asking each member.
async fn leader_endpoint(endpoints: &[String]) -> String {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        for e in endpoints {
            let opts = fsdp_rendezvous::etcd::EtcdOptions::new(vec![e.clone()]);
            let Ok(mut c) = connect(&opts).await else {
                continue;
            };
            if let Ok(s) = c.status().await
                && s.leader() != 0
                && s.header().is_some_and(|h| h.member_id() == s.leader())
            {
                return e.clone();
            }
        }
        assert!(Instant::now() < end, "no etcd leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Outside testing: with the three endpoints of a three-member cluster given and the
/// leader SIGKILLed (quorum intact), requests kept going to the dead member, keep-alives
/// missed the TTL and every agent exited 69. A dead endpoint is skipped: nothing changes.
#[tokio::test]
async fn losing_the_etcd_leader_of_three_members_changes_nothing() {
    let mut cluster = EtcdCluster::start(3);
    let mut endpoints = cluster.endpoints();
    let leader = leader_endpoint(&endpoints).await;
    // The leader first: an agent that sticks to its first endpoint meets the death.
    endpoints.sort_by_key(|e| *e != leader);
    let mut ns = Vec::new();
    for _ in 0..2 {
        let mut c = EtcdConfig::new(endpoints.clone(), "leader-death", 2, 2);
        c.last_call = Duration::from_millis(300);
        c.options.retry_window = Duration::from_secs(10);
        ns.push(EtcdRendezvous::connect(c).await.expect("join"));
    }
    let before = rounds(&mut ns).await;
    cluster.kill(&leader);
    let ttl = EtcdConfig::new(vec![], "x", 1, 1).keep_alive_ttl;
    let quiet = async {
        let futs: Vec<_> = ns.iter_mut().map(|n| n.changed()).collect();
        join_all(futs).await
    };
    tokio::select! {
        changes = quiet => panic!("agents saw a change: {changes:?}\n{}", cluster.logs()),
        () = tokio::time::sleep(ttl * 3) => {}
    }
    // The run still works on the two members left: a leave is noticed at once.
    a_leave_is_noticed_at_once(&mut ns).await;
    assert_eq!(before[0].number, before[1].number);
}

/// Given several endpoints, a member cut off from its quorum is waited for three connect
/// timeouts at most before the next is tried: its first read (linearizable, it must show a
/// leader) was held for about 30 s, and the members after it in the list waited as long.
/// Here no member has a leader, so joining fails, within the retry window and those
/// bounds rather than after 38 s.
#[tokio::test]
async fn a_member_cut_off_from_its_quorum_holds_the_connection_no_longer_than_its_bound() {
    let mut cluster = EtcdCluster::start(3);
    let endpoints = cluster.endpoints();
    // Formed first: a member serves nothing until its cluster has had a quorum.
    leader_endpoint(&endpoints).await;
    for e in &endpoints[1..] {
        cluster.kill(e);
    }
    let mut opts = EtcdConfig::new(endpoints.clone(), "connect", 1, 1).options;
    opts.retry_window = Duration::from_secs(3);
    opts.connect_timeout = Duration::from_millis(500);
    let began = Instant::now();
    let Err(err) = connect(&opts).await else {
        panic!("connected, but no member of the three has a leader");
    };
    assert!(
        matches!(err, RendezvousError::Unreachable { .. }),
        "{err:?}"
    );
    // Each attempt waits 1.5 s for the cut-off member and none for the dead ones; the
    // last attempt starts within the 3 s window. Unbounded, the first attempt alone took
    // about 35 s.
    let took = began.elapsed();
    assert!(took < Duration::from_secs(20), "gave up after {took:?}");
}

/// Two of three etcd members gone: quorum is lost, and a member of a larger cluster proves
/// nothing about leases, so every agent fences (its workers stop before the others could
/// be given their ranks). When quorum returns, the job re-forms.
#[tokio::test]
async fn losing_etcd_quorum_fences_every_agent_and_the_job_re_forms_when_it_returns() {
    let mut cluster = EtcdCluster::start(3);
    let endpoints = cluster.endpoints();
    let mut ns = Vec::new();
    for _ in 0..2 {
        let mut c = EtcdConfig::new(endpoints.clone(), "quorum", 2, 2);
        c.keep_alive_ttl = TTL;
        c.last_call = Duration::from_millis(300);
        c.options.retry_window = Duration::from_secs(10);
        ns.push(EtcdRendezvous::connect(c).await.expect("join"));
    }
    rounds(&mut ns).await;
    for e in &endpoints[1..] {
        cluster.kill(e);
    }
    let changes = within(TTL * 3, "every agent to fence", async {
        join_all(ns.iter_mut().map(|n| n.changed())).await
    })
    .await;
    for c in changes {
        assert!(
            matches!(c, Ok(Change::Fenced { .. })),
            "{c:?}\n{}",
            cluster.logs()
        );
    }
    for e in &endpoints[1..] {
        cluster.start_again(e);
    }
    let rs = within(
        Duration::from_secs(60),
        "a round after quorum returns",
        settled_rounds(&mut ns, TTL),
    )
    .await;
    assert_one_group(&rs);
}

/// A placed round (`placement_above` below its size: what rounds of thousands are): each
/// node holds its own part, runs at the ranks of one group, learns of a leave and of a
/// death, and re-forms with the others; `fsdp-agent status` reads the round whole.
#[tokio::test]
async fn a_placed_round_forms_and_reforms_after_a_leave_and_a_death() {
    placed_round_forms_and_reforms(fsdp_rendezvous::etcd::placement::Shape::ETCD).await;
}

/// The same, cut as finely as a round of thousands: a shard a member, the shards written
/// ahead of the header in transactions of two, and each seal's transaction deleting the
/// shards of the rounds before (what etcd itself must take: range deletes beside puts).
/// Afterwards only the last two rounds' shards are left.
#[tokio::test]
async fn a_placed_round_with_its_shards_written_ahead_forms_and_reforms() {
    placed_round_forms_and_reforms(fsdp_rendezvous::etcd::placement::Shape::FINEST).await;
}

async fn placed_round_forms_and_reforms(shape: fsdp_rendezvous::etcd::placement::Shape) {
    let etcd = Etcd::start();
    let mut ns = Vec::new();
    for _ in 0..4 {
        let mut c = config(&etcd, "placed", 2, 4);
        c.placement_above = 0;
        c.placement_shape = shape;
        ns.push(EtcdRendezvous::connect(c).await.expect("join"));
    }
    let rs = within(Duration::from_secs(20), "a placed round", rounds(&mut ns)).await;
    assert_one_group(&rs);
    assert_eq!(rs[0].group_world_size, 4);
    // Each member holds its own part, not the whole round; the coordinator, the whole.
    let parts = rs.iter().filter(|r| r.members.len() == 1).count();
    assert_eq!(parts, 3, "{rs:?}");
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    let report = fsdp_rendezvous::etcd::inspect::inspect(&mut c, "/fsdp", "placed")
        .await
        .unwrap()
        .expect("the run");
    assert_eq!(report.round, Some(rs[0].number));
    assert_eq!(report.members.len(), 4, "{report:?}");
    let leaver = ns.pop().unwrap();
    let left = leaver.node_id().to_owned();
    let mut leaver = leaver;
    leaver.depart(Departure::Left, why()).await.unwrap();
    for n in ns.iter_mut() {
        let change = within(Duration::from_secs(10), "the leave", n.changed()).await;
        let node = left.clone();
        assert_eq!(change.unwrap(), Change::MemberLost { node });
    }
    let rs = within(Duration::from_secs(20), "a round of 3", rounds(&mut ns)).await;
    assert_one_group(&rs);
    assert_eq!(rs[0].group_world_size, 3);
    // Dropped without a word: its lease expires.
    drop(ns.pop().unwrap());
    for n in ns.iter_mut() {
        let change = within(Duration::from_secs(15), "the death", n.changed()).await;
        assert!(
            matches!(change, Ok(Change::MemberLost { .. })),
            "{change:?}"
        );
    }
    let rs = within(
        Duration::from_secs(30),
        "a round of 2",
        settled_rounds(&mut ns, Duration::from_secs(1)),
    )
    .await;
    assert_one_group(&rs);
    assert_eq!(rs[0].group_world_size, 2);
    // Three rounds sealed at least, each deleting the shards of all but the round it
    // replaced: those two rounds' shards are left, and no other's.
    let shards = c
        .get(
            "/fsdp/placed/placement/",
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .unwrap();
    let rounds: std::collections::BTreeSet<String> = shards
        .kvs()
        .iter()
        .filter_map(|kv| {
            kv.key_str()
                .ok()?
                .split('/')
                .nth(4)
                .map(|t| t[..20].to_owned())
        })
        .collect();
    assert_eq!(rounds.len(), 2, "{rounds:?}");
    for n in ns.iter_mut() {
        n.depart(Departure::Left, why()).await.unwrap();
    }
}
