//! fsdp-trainer's peer-memory snapshots and in-place re-form, with real trainer processes
//! on real Gloo, SIGKILLed for real: this test plays the agent's part (the rounds it sends
//! over `FSDP_AGENT_CONTROL`), so that which ranks die and which copies are damaged is
//! exact. The agent's side is in the demo test.

use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fsdp_tests::{AgentCmd, TempDir, agent_bin, free_port, wait_for};

const MODEL: &[&str] = &[
    "--hidden_width",
    "64",
    "--num_layers",
    "2",
    "--intermediate_size",
    "172",
    "--num_heads",
    "4",
    "--num_key_value_heads",
    "2",
    "--max_context_width",
    "32",
    "--threads",
    "1",
    "--max_steps",
    "100000",
    "--logging_freq",
    "1",
    "--checkpoint_freq",
    "5",
];

/// One trainer process, as an agent would start it, in its own process group.
struct Rank {
    child: Child,
    out: PathBuf,
    ctl: PathBuf,
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
    }
}

struct Job {
    dir: TempDir,
    ckpt: PathBuf,
    /// The ranks' progress reports, read as an agent reads them: at once, on a thread
    /// (an unread datagram socket holds a few reports; a rank gives one up after 0.1 s).
    heard: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Job {
    fn new() -> Self {
        let dir = TempDir::new().unwrap();
        let ckpt = dir.path().join("ckpt");
        std::fs::create_dir(&ckpt).unwrap();
        let progress = UnixDatagram::bind(dir.path().join("progress")).unwrap();
        let heard = std::sync::Arc::<std::sync::Mutex<Vec<String>>>::default();
        let into = heard.clone();
        // Ends with the test's process; the socket's file goes with `dir`.
        std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while let Ok(n) = progress.recv(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                into.lock().unwrap().push(text);
            }
        });
        Self { dir, ckpt, heard }
    }

    /// Waits up to 10 s for the report `what` (e.g. `0 joined 1 memory`).
    fn heard(&self, what: &str) {
        wait_for(what, Duration::from_secs(10), || {
            self.heard.lock().unwrap().iter().any(|s| s == what)
        });
    }

    /// Starts `name` as rank `rank` of `world`, meeting at `port`.
    fn start(
        &self,
        name: &str,
        (rank, world, port): (u32, u32, u16),
        env: &[(&str, &str)],
    ) -> Rank {
        let out = self.dir.path().join(format!("{name}.out"));
        let ctl = self.dir.path().join(format!("{name}.ctl"));
        let mut cmd = Command::new(agent_bin().with_file_name("fsdp-trainer"));
        cmd.args(MODEL)
            .arg("--checkpoint_dir")
            .arg(&self.ckpt)
            .arg("--resume_from_checkpoint")
            .arg(&self.ckpt)
            .envs([
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", world.to_string()),
                ("LOCAL_RANK", "0".into()),
                ("LOCAL_WORLD_SIZE", "1".into()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", port.to_string()),
                ("OMP_NUM_THREADS", "1".into()),
            ])
            .env("FSDP_AGENT_CONTROL", &ctl)
            .env("FSDP_AGENT_PROGRESS", self.dir.path().join("progress"))
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(Stdio::from(
                std::fs::File::create(out.with_extension("err")).unwrap(),
            ))
            .process_group(0);
        Rank {
            child: cmd.spawn().unwrap(),
            out,
            ctl,
        }
    }
}

/// Sends `r` its place in round `round`, as its agent would.
fn order(r: &Rank, round: u64, (rank, world, port): (u32, u32, u16)) {
    let msg = format!(
        "round {round} RANK={rank} LOCAL_RANK=0 GROUP_RANK={rank} ROLE_RANK={rank} LOCAL_WORLD_SIZE=1 WORLD_SIZE={world} GROUP_WORLD_SIZE={world} ROLE_WORLD_SIZE={world} MASTER_ADDR=127.0.0.1 MASTER_PORT={port} TORCHELASTIC_RESTART_COUNT=0"
    );
    UnixDatagram::unbound()
        .unwrap()
        .send_to(msg.as_bytes(), &r.ctl)
        .unwrap();
}

fn text(r: &Rank) -> String {
    std::fs::read_to_string(&r.out).unwrap_or_default()
}

/// The steps rank `r` logged (`Batch N` is step N + 1), with their losses.
fn steps(out: &str) -> Vec<(u64, f64)> {
    out.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("Batch ")?;
            let (n, rest) = rest.split_once(" Loss: ")?;
            let loss = rest.split(',').next()?.parse().ok()?;
            Some((n.parse::<u64>().ok()? + 1, loss))
        })
        .collect()
}

fn wait_text(r: &Rank, what: &str, cond: impl Fn(&str) -> bool) {
    wait_for(what, Duration::from_secs(120), || {
        let t = text(r);
        assert!(
            !t.contains("fsdp-trainer: error"),
            "{what}: the rank failed\n{t}"
        );
        cond(&t)
    });
}

/// Kills `ranks` at once (their whole process groups) and waits until each is gone.
fn kill(ranks: Vec<Rank>) {
    drop(ranks);
}

/// Step `n`'s line after the last re-form, once rank `r` trained past where it was.
fn trains_past(r: &Rank, step: u64) {
    wait_text(r, &format!("training past step {step}"), |t| {
        let last_reform = t
            .rfind("Restored step")
            .or_else(|| t.rfind("Loaded checkpoint"));
        last_reform.is_some_and(|at| steps(&t[at..]).iter().any(|&(s, _)| s > step))
    });
}

fn the_line<'a>(out: &'a str, start: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line starting '{start}' in\n{out}"))
}

#[test]
fn a_lost_rank_and_a_joiner_cost_the_survivors_no_restart_no_reload_and_no_step() {
    let job = Job::new();
    let port = free_port();
    let mut ranks: Vec<Rank> = (0..3)
        .map(|r| job.start(&format!("r{r}"), (r, 3, port), &[]))
        .collect();
    wait_text(&ranks[0], "step 8", |t| steps(t).len() >= 8);
    let pids: Vec<u32> = ranks.iter().map(|r| r.child.id()).collect();
    let lost = ranks.remove(1);
    kill(vec![lost]);
    let port = free_port();
    order(&ranks[0], 1, (0, 2, port));
    order(&ranks[1], 1, (1, 2, port));
    wait_text(&ranks[0], "the restore", |t| t.contains("Restored step"));
    let out = text(&ranks[0]);
    let before = &out[..out.find("Restored step").unwrap()];
    let furthest = steps(before).last().copied().unwrap();
    let restored = the_line(&out, "Restored step");
    let at: u64 = restored["Restored step ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    // The step the group was in when the rank died is the one rebuilt: nothing redone.
    assert!(at >= furthest.0, "{restored}, furthest step {}", furthest.0);
    assert!(restored.contains("3 parts"), "{restored}");
    job.heard("0 joined 1 memory");
    trains_past(&ranks[0], at);
    let out = text(&ranks[0]);
    let after = steps(&out[out.find("Restored step").unwrap()..]);
    assert_eq!(after[0].0, at + 1, "the first step after is the next one");
    assert!(
        (after[0].1 - furthest.1).abs() <= 0.1 * furthest.1,
        "the loss goes on from where it was: {} then {}",
        furthest.1,
        after[0].1
    );
    // A new process joins a running group of two: the two leave at a step boundary and
    // the three rebuild it, the joiner receiving its part.
    let port = free_port();
    ranks.push(job.start("joiner", (2, 3, port), &[]));
    order(&ranks[0], 2, (0, 3, port));
    order(&ranks[1], 2, (1, 3, port));
    wait_text(&ranks[0], "the second restore", |t| {
        t.matches("Restored step").count() == 2
    });
    // (The joiner is not the lead: its lines are not printed.)
    trains_past(&ranks[0], 0);
    let out = text(&ranks[0]);
    assert!(
        out.lines()
            .filter(|l| l.starts_with("Restored step"))
            .nth(1)
            .is_some_and(|l| l.contains("2 parts")),
        "{out}"
    );
    // Still the same processes, and nothing was read from disk.
    assert_eq!(ranks[0].child.id(), pids[0]);
    assert!(
        ranks
            .iter_mut()
            .all(|r| r.child.try_wait().unwrap().is_none())
    );
    assert!(!out.contains("Loaded checkpoint"), "{out}");
}

/// Rank 1's part lives on rank 1 and, as a copy, on rank 2: both die at once.
#[test]
fn both_copies_lost_falls_back_to_the_newest_checkpoint_and_says_so() {
    let job = Job::new();
    let port = free_port();
    let mut ranks: Vec<Rank> = (0..4)
        .map(|r| job.start(&format!("r{r}"), (r, 4, port), &[]))
        .collect();
    wait_text(&ranks[0], "a checkpoint and step 8", |t| {
        t.contains("Saved checkpoint") && steps(t).len() >= 8
    });
    let dead: Vec<Rank> = ranks.drain(1..3).collect();
    kill(dead);
    let port = free_port();
    order(&ranks[0], 1, (0, 2, port));
    order(&ranks[1], 1, (1, 2, port));
    wait_text(&ranks[0], "the fallback", |t| {
        t.contains("Loaded checkpoint")
    });
    let out = text(&ranks[0]);
    let said = the_line(&out, "Peer memory cannot rebuild a step");
    assert!(
        said.contains("lacks the part of rank(s) [1] of 4 (both copies lost); resuming from disk"),
        "{said}"
    );
    assert!(!out.contains("Restored step"), "{out}");
    // The agent counts the fallback (fsdp_agent_in_place_reforms_total{restored="disk"}).
    job.heard("0 joined 1 disk");
    trains_past(&ranks[0], 0);
}

/// A flipped bit in a copy: the checksum refuses it, and the other copy serves (rank 0's
/// own part damaged, its copy on rank 1 intact), or, with no other copy, the disk.
#[test]
fn a_corrupted_copy_is_refused_and_the_other_copy_or_the_disk_serves() {
    let job = Job::new();
    let port = free_port();
    let flip_own: &[(&str, &str)] = &[("FSDP_TRAINER_FAULT_FLIP", "own")];
    let mut ranks: Vec<Rank> = (0..3)
        .map(|r| {
            let env = if r == 0 { flip_own } else { &[] };
            job.start(&format!("r{r}"), (r, 3, port), env)
        })
        .collect();
    wait_text(&ranks[0], "a checkpoint and step 8", |t| {
        t.contains("Saved checkpoint") && steps(t).len() >= 8
    });
    // Rank 2 dies; its part survives as rank 0's copy, rank 0's own part as rank 1's.
    kill(vec![ranks.remove(2)]);
    let port = free_port();
    order(&ranks[0], 1, (0, 2, port));
    order(&ranks[1], 1, (1, 2, port));
    wait_text(&ranks[0], "the restore", |t| {
        t.contains("Restored step") || t.contains("Loaded checkpoint")
    });
    let out = text(&ranks[0]);
    assert!(the_line(&out, "Restored step").contains("3 parts"), "{out}");
    trains_past(&ranks[0], 0);

    // In the group of two, rank 0's own part flips again at the next re-form, and its
    // only copy dies with rank 1: no step is whole in memory, and the disk serves.
    kill(vec![ranks.remove(1)]);
    let port = free_port();
    let joiner = job.start("joiner", (1, 2, port), &[]);
    order(&ranks[0], 2, (0, 2, port));
    wait_text(&ranks[0], "the fallback", |t| {
        t.contains("Loaded checkpoint")
    });
    let out = text(&ranks[0]);
    assert!(out.contains("Peer memory cannot rebuild a step"), "{out}");
    trains_past(&ranks[0], 0);
    let mut joiner = joiner;
    assert!(
        joiner.child.try_wait().unwrap().is_none(),
        "the joiner trains"
    );
}

/// The agent's side of the hang path: a kept worker frozen where no abort reaches it
/// (SIGSTOP: it never reads the round) is not waited for past the handover bound
/// (`--hang-timeout auto,handover=4s` here; 90 s by default). Both survivors' workers are
/// stopped, fresh ones start in the same round, nothing is charged, and the job goes on
/// from disk.
#[test]
fn a_kept_worker_frozen_during_the_handover_is_stopped_and_restarted_fresh() {
    use fsdp_tests::job::{Job as Elastic, wait_until};
    let job = Elastic::new("wedged", "2:3", 0, 0, 61);
    let trainer = agent_bin().with_file_name("fsdp-trainer");
    let mut worker = vec!["--no-python".to_string(), trainer.display().to_string()];
    worker.extend(MODEL.iter().map(|s| s.to_string()));
    let ckpt = job.dir.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    worker.extend(
        ["--checkpoint_dir", "--resume_from_checkpoint"]
            .iter()
            .flat_map(|f| [f.to_string(), ckpt.display().to_string()]),
    );
    let flags = ["--hang-timeout", "auto,handover=4s"];
    let mut pods: Vec<_> = (0..3)
        .map(|i| job.pod_running(i, 1, &flags, &worker))
        .collect();
    // Rank 0, whichever pod it is on, prints the lines.
    let said = |pods: &[fsdp_tests::pod::Pod], what: &str| -> usize {
        pods.iter().map(|p| p.stdout().matches(what).count()).sum()
    };
    wait_until(
        "three pods training",
        &pods.iter().collect::<Vec<_>>(),
        || said(&pods, "Saved checkpoint") >= 1 && said(&pods, "Batch ") >= 8,
    );
    // Pod 1's worker: the agent's only child.
    let agent = pods[1].agent_pid();
    let children = format!("/proc/{agent}/task/{agent}/children");
    let frozen: i32 = std::fs::read_to_string(&children)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let stop = |sig| nix::sys::signal::kill(nix::unistd::Pid::from_raw(frozen), sig);
    stop(nix::sys::signal::Signal::SIGSTOP).unwrap();
    let frozen_at = std::time::Instant::now();
    pods[2].kill();
    let all: Vec<&fsdp_tests::pod::Pod> = pods.iter().take(2).collect();
    wait_until("both survivors to give the handover up", &all, || {
        all.iter()
            .all(|p| p.stderr().contains("the workers did not re-form in place"))
    });
    // The bound given (4 s after the round went out), not the default 90 s.
    let waited = frozen_at.elapsed();
    assert!(waited < Duration::from_secs(40), "gave up after {waited:?}");
    let gave_up = pods[1]
        .stderr()
        .lines()
        .find(|l| l.contains("the workers did not re-form in place"))
        .unwrap()
        .to_owned();
    // It names the rank (of the new round) that did not confirm.
    let named = gave_up.split("unconfirmed=").nth(1).unwrap_or_default();
    assert!(named.starts_with(|c: char| c.is_ascii_digit()), "{gave_up}");
    // The frozen process is gone (SIGKILL reaches a stopped process), and fresh workers
    // train on from the checkpoint: the restart budget (0) was not charged.
    wait_until("the frozen worker to be gone", &all, || {
        !fsdp_tests::alive(frozen)
    });
    let trained = said(&pods[..2], "Batch ");
    wait_until("training to go on in fresh workers", &all, || {
        said(&pods[..2], "Loaded checkpoint") >= 1 && said(&pods[..2], "Batch ") >= trained + 5
    });
    assert!(
        pods.iter_mut().take(2).all(|p| p.exited().is_none()),
        "the survivors' agents run on"
    );
}

/// A rank whose own allocator fails (here `ulimit -d` under the agent, as
/// `bench/full_shard.py` probes a memory budget) ends at once and the agent stops the
/// group, well within the collective timeout. In a collective the rank used to take the
/// failure for a group that broke and wait up to two minutes for a round its agent would
/// never send (no node was lost); in a tensor op it panicked, and unwinding waited for
/// the collective in flight until it timed out. Where the allocation fails first varies
/// from run to run: three budgets, each of which took one way or the other.
#[test]
fn a_rank_out_of_memory_in_a_collective_ends_at_once_instead_of_waiting_for_a_round() {
    let trainer = agent_bin().with_file_name("fsdp-trainer");
    // A layer of 11.6M parameters: ~70 MiB of optimizer state a rank and a 44 MiB unit
    // to gather, past what these data segments leave beside the trainer itself.
    let model = [
        "--hidden_width",
        "1024",
        "--num_heads",
        "16",
        "--num_key_value_heads",
        "8",
        "--intermediate_size",
        "2752",
        "--max_context_width",
        "32",
        "--num_layers",
        "1",
        "--max_steps",
        "2",
        "--threads",
        "1",
        "--collective_timeout",
        "90",
        "--sharding_strategy",
        "full",
    ];
    for mib in [400, 450, 500] {
        let dir = TempDir::new().unwrap();
        let mut agent = AgentCmd::new(dir.path(), "agent")
            .current_dir(dir.path())
            .env("OMP_NUM_THREADS", "1")
            .env("RUST_BACKTRACE", "0")
            .args([
                "--standalone",
                "--nproc-per-node",
                "2",
                "--status-addr",
                "off",
            ])
            .args(["--max-restarts", "0", "--no-python", "/bin/sh", "-c"])
            .arg(format!("ulimit -d {}; exec \"$0\" \"$@\"", mib * 1024))
            .arg(&trainer)
            .args(model)
            .spawn();
        // Well within the collective timeout: no rank waited for it.
        let ended = agent.wait(Duration::from_secs(45));
        let out = agent.output();
        assert!(!ended.success(), "{mib} MiB: {out}");
        assert!(
            out.contains("allocate memory") || out.contains("out of memory"),
            "{mib} MiB did not run the trainer out of memory:\n{out}"
        );
        // What a rank said of a broken group, up to its "waiting": never its own
        // allocation (the message may span lines: libtorch adds its frames).
        for said in out.split("the group broke during step").skip(1) {
            let said = said
                .split("waiting for the agent's next round")
                .next()
                .unwrap_or(said);
            assert!(
                !said.contains("allocate memory"),
                "{mib} MiB: {said}\n{out}"
            );
        }
    }
}
