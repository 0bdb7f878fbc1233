//! Sharded checkpoints: one shard per rank and a manifest written last; a save killed
//! half-way leaves the previous checkpoint to resume from; either format resumes the other.

mod common;

use std::path::Path;

use common::*;

/// The number that follows the first `marker` in `text`, up to the next space.
fn number_after<T: std::str::FromStr>(text: &str, marker: &str) -> Option<T> {
    text.split(marker).nth(1)?.split(' ').next()?.parse().ok()
}

fn names(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    n.sort();
    n
}

#[test]
fn a_sharded_checkpoint_is_a_shard_per_rank_and_a_manifest_and_either_format_resumes_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let ck_s = ck.to_str().unwrap();
    let base = [
        "--checkpoint_freq",
        "5",
        "--checkpoint_dir",
        ck_s,
        "--resume_from_checkpoint",
        ck_s,
        "--train_batch_size",
        "4",
        "--sharding_strategy",
        "full",
    ];
    let first = stdout(&run(launched(
        2,
        &[&base[..], &["--max_steps", "10"]].concat(),
    )));
    assert!(
        first.contains("2 shards written in the background"),
        "{first}"
    );
    assert_eq!(
        names(&ck.join("step_00000010")),
        [
            "meta.json",
            "shard-00000-of-00002.safetensors",
            "shard-00001-of-00002.safetensors"
        ]
    );
    let manifest = std::fs::read_to_string(ck.join("step_00000010/meta.json")).unwrap();
    assert!(manifest.contains("\"format\": 2"), "{manifest}");
    // Resumed on three ranks in the gathered format, then on one in the sharded.
    let second = stdout(&run(launched(
        3,
        &[
            &base[..6],
            &[
                "--max_steps",
                "15",
                "--train_batch_size",
                "3",
                "--sharded_checkpoints=0",
            ],
        ]
        .concat(),
    )));
    assert!(second.contains("(step 10, sample 80"), "{second}");
    assert_eq!(names(&ck.join("step_00000015")), ["meta.json", "state.pt"]);
    let third = stdout(&run(alone(
        &[
            &base[..6],
            &["--max_steps", "20", "--train_batch_size", "8"],
        ]
        .concat(),
    )));
    assert!(third.contains("(step 15, sample 125"), "{third}");
    assert!(third.contains("Training finished at step 20"), "{third}");
    // A manifest whose shard is gone is refused, naming it.
    std::fs::remove_file(ck.join("step_00000020/shard-00000-of-00001.safetensors")).unwrap();
    fails_with(
        alone(&[&base[..6], &["--max_steps", "25"]].concat()),
        2,
        "shard-00000-of-00001.safetensors",
    );
}

/// Rank 0 dies after writing its shard and before the manifest (the test hook aborts it
/// there): the step's partial directory is left, never renamed, and the next run resumes
/// from the checkpoint before it and cleans the leftovers.
fn a_save_killed_half_way(world: u32) {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let ck_s = ck.to_str().unwrap();
    let args = [
        "--max_steps",
        "30",
        "--checkpoint_freq",
        "10",
        "--checkpoint_dir",
        ck_s,
        "--resume_from_checkpoint",
        ck_s,
        "--train_batch_size",
        if world == 1 { "8" } else { "4" },
    ];
    let start = |args: &[&str]| {
        if world == 1 {
            alone(args)
        } else {
            launched(world, args)
        }
    };
    let mut crashing = start(&args);
    crashing.env("FSDP_TRAINER_CRASH_IN_SAVE", "20");
    assert!(!crashing.output().unwrap().status.success());
    let left = names(&ck);
    assert!(left.contains(&"step_00000010".to_owned()), "{left:?}");
    assert!(!left.contains(&"step_00000020".to_owned()), "{left:?}");
    let partial = left
        .iter()
        .find(|n| n.starts_with(".step_00000020.tmp"))
        .unwrap_or_else(|| panic!("the half-written save is left: {left:?}"));
    assert!(
        !names(&ck.join(partial)).contains(&"meta.json".to_owned()),
        "no manifest in a save that did not finish"
    );
    let text = stdout(&run(start(&args)));
    assert!(text.contains("step_00000010 (step 10, sample 80"), "{text}");
    assert_eq!(losses(&text).first().map(|x| x.0), Some(10));
    let left = names(&ck);
    assert!(left.contains(&"step_00000030".to_owned()), "{left:?}");
    assert!(!left.iter().any(|n| n.contains(".tmp")), "{left:?}");
}

#[test]
fn a_save_killed_half_way_leaves_the_previous_checkpoint_to_resume_from() {
    a_save_killed_half_way(1);
}

#[test]
fn a_save_killed_half_way_on_two_ranks_leaves_the_previous_checkpoint_to_resume_from() {
    a_save_killed_half_way(2);
}

/// Slurm's warning (SIGUSR1 to the agent, which passes it to its workers): the workers
/// save at the step they are in and stop with 138, the agent with them, and the run
/// resumes from that very step.
#[test]
fn a_warning_signal_saves_at_the_current_step_and_the_run_resumes_there() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let ck_s = ck.to_str().unwrap();
    let args = [
        "--max_steps",
        "100000",
        "--checkpoint_freq",
        "0",
        "--checkpoint_dir",
        ck_s,
        "--resume_from_checkpoint",
        ck_s,
        "--train_batch_size",
        "4",
    ];
    let mut cmd = std::process::Command::new(agent());
    clean(&mut cmd)
        .args(["--standalone", "--nproc-per-node", "2"])
        .args(["--signals-to-handle", "SIGTERM,SIGUSR1", "--no-python"])
        .arg(trainer())
        .args(MODEL)
        .args(args);
    let log = dir.path().join("out");
    cmd.stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let end = Instant::now() + Duration::from_secs(120);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("Batch 5 ")
    {
        assert!(child.try_wait().unwrap().is_none(), "exited early");
        assert!(Instant::now() < end, "no step 5");
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: a signal to our own child, which has not been reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) }, 0);
    let status = child.wait().unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(138), "{text}");
    let stopped: u64 =
        number_after(&text, "Stopping at step ").unwrap_or_else(|| panic!("no stop line\n{text}"));
    assert!(
        ck.join(format!("step_{stopped:08}/meta.json")).is_file(),
        "{text}"
    );
    let resumed = stdout(&run(launched(
        2,
        &[&args[..], &["--max_steps", &(stopped + 2).to_string()]].concat(),
    )));
    assert!(
        resumed.contains(&format!("(step {stopped}, sample {}", stopped * 8)),
        "{resumed}"
    );
}

/// Each shard is written from the live tensors while training goes on. With the writer
/// slowed down (a test hook: 600 ms after each tensor it writes), the next optimizer
/// update waits for it, the pause is reported, and the shards hold exactly the state the
/// gathered save of the same run holds at that step: under `full` (the shards of units)
/// and `shard_grad_op` (the flat optimizer's owned runs).
#[test]
fn a_slow_shard_writer_holds_the_next_update_back_and_saves_its_steps_state() {
    slow_writer("full");
    slow_writer("shard_grad_op");
}

fn slow_writer(strategy: &str) {
    let dir = tempfile::tempdir().unwrap();
    let run_to = |name: &str, extra: &[&str], slow: bool| {
        let ck = dir.path().join(name);
        let args = [
            &[
                "--max_steps",
                "6",
                "--checkpoint_freq",
                "3",
                "--checkpoint_dir",
                ck.to_str().unwrap(),
                "--train_batch_size",
                "4",
                "--sharding_strategy",
                strategy,
            ][..],
            extra,
        ]
        .concat();
        let mut command = launched(2, &args);
        if slow {
            command.env("FSDP_TRAINER_SLOW_SAVE_MS", "600");
        }
        (stdout(&run(command)), ck.join("step_00000003"))
    };
    let (text, sharded) = run_to("sharded", &[], true);
    let line = text
        .lines()
        .find(|l| l.contains("(step 3, sample"))
        .unwrap_or_else(|| panic!("no save of step 3: {text}"));
    let paused: f64 =
        number_after(line, "training paused ").unwrap_or_else(|| panic!("no pause in: {line}"));
    assert!(
        paused > 1.0,
        "{strategy}: the update waited for the writer: {line}"
    );
    let (_, gathered) = run_to("gathered", &["--sharded_checkpoints=0"], false);

    let whole: Vec<(String, tch::Tensor)> =
        tch::Tensor::load_multi(gathered.join("state.pt")).unwrap();
    let whole = |n: &str| {
        whole
            .iter()
            .find(|(k, _)| k == n)
            .unwrap()
            .1
            .shallow_clone()
    };
    let mut covered = 0;
    for shard in ["shard-00000-of-00002", "shard-00001-of-00002"] {
        let part: Vec<(String, tch::Tensor)> =
            tch::Tensor::read_safetensors(sharded.join(format!("{shard}.safetensors"))).unwrap();
        let part = |n: &str| part.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
        let runs = Vec::<i64>::try_from(part("runs")).unwrap();
        let mut at = 0;
        for pair in runs.chunks(2) {
            let (flat_at, n) = (pair[0], pair[1]);
            for name in ["params", "adam_m", "adam_v"] {
                assert!(
                    part(name)
                        .narrow(0, at, n)
                        .equal(&whole(name).narrow(0, flat_at, n)),
                    "{strategy}: {shard}'s {name} at {flat_at}..{} differ from the gathered save's",
                    flat_at + n
                );
            }
            at += n;
            covered += n;
        }
    }
    assert_eq!(covered, whole("params").numel() as i64);
}
