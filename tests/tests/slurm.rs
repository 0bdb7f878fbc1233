//! fsdp-agent under `srun` on a real three-node Slurm cluster (scripts/slurm): one group of
//! the step's nodes with no rendezvous flags, the agent's exit code as Slurm records it,
//! a node lost under `srun --no-kill`, pre-emption, requeue and the example batch script.
//! Workers are real PyTorch gloo processes that checkpoint (tests/py/elastic_worker.py).

use std::collections::BTreeSet;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use fsdp_tests::etcd::Etcd;
use fsdp_tests::slurm::Cluster;
use fsdp_tests::{TempDir, wait_for, workspace_file};

const LIMIT: Duration = Duration::from_secs(60);

/// A `srun` running in the background, its output in files.
struct Step {
    child: Child,
    dir: TempDir,
}

impl Step {
    fn start(mut cmd: Command) -> Self {
        let dir = TempDir::new().unwrap();
        let out = std::fs::File::create(dir.path().join("stdout")).unwrap();
        let err = std::fs::File::create(dir.path().join("stderr")).unwrap();
        let child = cmd.stdout(out).stderr(err).spawn().expect("srun");
        Self { child, dir }
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stdout")).unwrap_or_default()
    }

    fn output(&self) -> String {
        let err = std::fs::read_to_string(self.dir.path().join("stderr")).unwrap_or_default();
        format!("--- stdout\n{}\n--- stderr\n{err}", self.stdout())
    }

    /// srun's exit code once it ends.
    fn wait(&mut self) -> i32 {
        let end = Instant::now() + LIMIT;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s.code().unwrap_or(-1);
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                panic!("srun did not end within {LIMIT:?}\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The workers' `start` lines (tests/py/elastic_worker.py) as key=value maps.
    fn starts(&self) -> Vec<std::collections::BTreeMap<String, String>> {
        lines_with(&self.stdout(), "start ")
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The key=value fields of each line that starts with `tag`.
fn lines_with(text: &str, tag: &str) -> Vec<std::collections::BTreeMap<String, String>> {
    text.lines()
        .filter_map(|l| l.strip_prefix(tag))
        .map(|rest| {
            rest.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        })
        .collect()
}

fn elastic_worker(ckpt: &TempDir, steps: u32) -> Vec<String> {
    vec![
        workspace_file("tests/py/elastic_worker.py")
            .display()
            .to_string(),
        ckpt.path().display().to_string(),
        steps.to_string(),
    ]
}

/// The step the workers' checkpoint has reached.
fn progress(ckpt: &TempDir) -> u32 {
    std::fs::read_to_string(ckpt.path().join("step"))
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0)
}

fn set(values: impl IntoIterator<Item = String>) -> BTreeSet<String> {
    values.into_iter().collect()
}

#[test]
fn srun_with_no_rendezvous_flags_forms_one_group_of_the_steps_nodes() {
    let cluster = Cluster::start();
    let ckpt = TempDir::new().unwrap();
    let mut step = Step::start(cluster.srun_agent(&["-N3"], &elastic_worker(&ckpt, 5)));
    let code = step.wait();
    assert_eq!(code, 0, "{}", step.output());
    let starts = step.starts();
    assert_eq!(starts.len(), 3, "one worker per node\n{}", step.output());
    let field = |k: &str| set(starts.iter().map(|s| s[k].clone()));
    assert_eq!(field("world"), set(["3".into()]), "{}", step.output());
    assert_eq!(field("host"), set(["n1", "n2", "n3"].map(String::from)));
    assert_eq!(field("rank"), set(["0", "1", "2"].map(String::from)));
    assert_eq!(field("group_rank"), set(["0", "1", "2"].map(String::from)));
    // One training, not three: one checkpoint that reached the end once.
    let done = lines_with(&step.stdout(), "done ");
    assert!(done.iter().all(|d| d["world"] == "3" && d["step"] == "5"));
}

#[test]
fn the_agents_exit_code_is_the_one_slurm_records() {
    let cluster = Cluster::start();
    // Success, with the repository's own example: one all-reduce over the three nodes.
    let example = vec![
        workspace_file("examples/allreduce.py")
            .display()
            .to_string(),
    ];
    let mut ok = Step::start(cluster.srun_agent(&["-N3", "-J", "fsdp-ok"], &example));
    assert_eq!(ok.wait(), 0, "{}", ok.output());
    let sums = ok
        .stdout()
        .matches("all_reduce sum = 6 (expected 6)")
        .count();
    assert_eq!(sums, 3, "{}", ok.output());
    let job = cluster.wait_job("fsdp-ok", LIMIT);
    assert_eq!(Cluster::field(&job, "JobState"), "COMPLETED", "{job}");
    assert_eq!(Cluster::field(&job, "ExitCode"), "0:0", "{job}");

    // A worker's error code: with --no-retry-exit-codes every node exits with it at once,
    // so the step (the highest of its tasks' codes) carries the worker's own code.
    let mut fail = vec!["--no-retry-exit-codes".to_owned(), "3".into()];
    let ckpt = TempDir::new().unwrap();
    fail.extend(elastic_worker(&ckpt, 5));
    fail.extend(["--fail-on".into(), "n2".into()]);
    let mut failed = Step::start(cluster.srun_agent(&["-N3", "-J", "fsdp-fail"], &fail));
    assert_eq!(failed.wait(), 3, "{}", failed.output());
    let job = cluster.wait_job("fsdp-fail", LIMIT);
    assert_eq!(Cluster::field(&job, "JobState"), "FAILED", "{job}");
    assert_eq!(Cluster::field(&job, "ExitCode"), "3:0", "{job}");

    // A worker killed by a signal: its agent exits 128+9, the others 76 (the budget is
    // spent, their own workers did not fail), and the step reports the highest.
    let kill = [
        "--no-python",
        "sh",
        "-c",
        "[ \"$GROUP_RANK\" = 1 ] && kill -9 $$; sleep 30",
    ]
    .map(String::from);
    let mut killed = Step::start(cluster.srun_agent(&["-N3", "-J", "fsdp-kill"], &kill));
    assert_eq!(killed.wait(), 137, "{}", killed.output());
    let job = cluster.wait_job("fsdp-kill", LIMIT);
    assert_eq!(Cluster::field(&job, "JobState"), "FAILED", "{job}");
    assert_eq!(Cluster::field(&job, "ExitCode"), "137:0", "{job}");
}

/// `srun -N3 --no-kill` of a `--nnodes 2:3` job with `rdzv` flags; `lost` is killed
/// mid-run. The other two re-form from the checkpoint and finish; the step exits 0.
fn a_node_lost_under_no_kill(rdzv: &[String], lost: &str) {
    let cluster = Cluster::start();
    let ckpt = TempDir::new().unwrap();
    let steps = 300;
    let mut args = vec![
        "--nnodes".to_owned(),
        "2:3".into(),
        "--max-restarts".into(),
        "3".into(),
    ];
    args.extend_from_slice(rdzv);
    args.extend(elastic_worker(&ckpt, steps));
    let mut step = Step::start(cluster.srun_agent(&["-N3", "--no-kill"], &args));
    wait_for("training to pass step 20", LIMIT, || progress(&ckpt) >= 20);
    let killed_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let step_at_kill = progress(&ckpt);
    cluster.kill_node(lost);
    let code = step.wait();
    assert_eq!(code, 0, "{}", step.output());
    // The three nodes share one address here, as two jobs' steps can share a real node:
    // each agent still serves a status port (a free one), so its ring neighbour watches it.
    assert!(
        !step.output().contains("running without the status server"),
        "{}",
        step.output()
    );
    let survivors = set(["n1", "n2", "n3"]
        .into_iter()
        .filter(|n| *n != lost)
        .map(String::from));
    let regrouped: Vec<_> = step
        .starts()
        .into_iter()
        .filter(|s| s["world"] == "2")
        .collect();
    assert_eq!(
        set(regrouped.iter().map(|s| s["host"].clone())),
        survivors,
        "the survivors re-form as a group of two\n{}",
        step.output()
    );
    assert!(
        regrouped
            .iter()
            .all(|s| s["step"].parse::<u32>().unwrap() >= step_at_kill.saturating_sub(1)),
        "the group of two resumes from the checkpoint\n{}",
        step.output()
    );
    let done = lines_with(&step.stdout(), "done ");
    assert_eq!(done.len(), 2, "{}", step.output());
    assert!(
        done.iter()
            .all(|d| d["world"] == "2" && d["step"] == steps.to_string())
    );
    // For docs/slurm.md: the node's death to the group of two's first all-reduce.
    let again = lines_with(&step.stdout(), "allreduced ")
        .into_iter()
        .filter(|a| a["world"] == "2")
        .filter_map(|a| a["t"].parse::<f64>().ok())
        .fold(f64::MAX, f64::min);
    eprintln!(
        "node {lost} killed to training again in a group of two: {:.2} s",
        again - killed_at
    );
}

#[test]
fn a_node_lost_under_no_kill_leaves_the_others_training_to_the_end_on_c10d() {
    // No rendezvous flags but the range: n1's agent serves the c10d store (the step's
    // first host), so n3 is lost and the store survives.
    a_node_lost_under_no_kill(&[], "n3");
}

#[test]
fn a_node_lost_under_no_kill_leaves_the_others_training_to_the_end_on_etcd() {
    // On etcd any node may go, the first one included (with c10d its store goes with it).
    let etcd = Etcd::start();
    let rdzv = [
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        &etcd.endpoint(),
    ]
    .map(String::from);
    a_node_lost_under_no_kill(&rdzv, "n1");
}

#[test]
fn a_preemption_signal_reaches_every_worker_and_ends_the_job_without_a_restart() {
    let cluster = Cluster::start();
    let ckpt = TempDir::new().unwrap();
    // No --signals-to-handle: under Slurm the agent handles SIGUSR1 unasked.
    let mut args: Vec<String> = ["--max-restarts", "3"].map(String::from).into();
    args.extend(elastic_worker(&ckpt, 5000));
    let mut step = Step::start(cluster.srun_agent(&["-N3", "-J", "fsdp-preempt"], &args));
    wait_for("training to pass step 20", LIMIT, || progress(&ckpt) >= 20);
    // What Slurm sends ahead of a pre-emption (sbatch --signal=USR1@N does the same).
    let id = cluster.job_id("fsdp-preempt");
    let scancel = cluster
        .client("scancel")
        .args(["--signal=USR1", &id])
        .status()
        .expect("scancel");
    assert!(scancel.success());
    assert_eq!(step.wait(), 128 + 10, "{}", step.output());
    let preempted = lines_with(&step.stdout(), "preempted ");
    assert_eq!(
        set(preempted.iter().map(|p| p["host"].clone())),
        set(["n1", "n2", "n3"].map(String::from)),
        "every worker got the signal\n{}",
        step.output()
    );
    assert_eq!(step.starts().len(), 3, "no restart\n{}", step.output());
    let reached = progress(&ckpt);
    assert!((20..5000).contains(&reached), "checkpoint at {reached}");
    let job = cluster.wait_job("fsdp-preempt", LIMIT);
    assert_eq!(Cluster::field(&job, "JobState"), "FAILED", "{job}");
    assert_eq!(Cluster::field(&job, "ExitCode"), "138:0", "{job}");
}

/// A three-node batch job, requeued by `requeue` (given the cluster and the job ID) once it
/// passed step 30: it runs again with `SLURM_RESTART_COUNT=1`, a group of three that resumes
/// from the newest checkpoint, and completes.
fn a_requeued_job_resumes(name: &str, requeue: impl FnOnce(&Cluster, &str)) {
    let cluster = Cluster::start();
    let ckpt = TempDir::new().unwrap();
    let dir = TempDir::new().unwrap();
    let script = dir.path().join("train.sbatch");
    let out = dir.path().join("job.out");
    let steps = 120;
    std::fs::write(
        &script,
        format!(
            "#!/bin/bash\necho \"batch restart_count=${{SLURM_RESTART_COUNT:-0}}\"\nsrun \"$FSDP_AGENT\" {}\n",
            elastic_worker(&ckpt, steps).join(" ")
        ),
    )
    .unwrap();
    let submitted = cluster
        .job_client("sbatch")
        .args(["-N3", "-J", name, "--open-mode=append", "-o"])
        .arg(&out)
        .arg(&script)
        .output()
        .expect("sbatch");
    assert!(submitted.status.success(), "{submitted:?}");
    wait_for("training to pass step 30", LIMIT, || progress(&ckpt) >= 30);
    let reached = progress(&ckpt);
    requeue(&cluster, &cluster.job_id(name));
    let t = Instant::now();
    // Slurm holds a requeued job for cred_expire (10 s on the test cluster) first.
    let job = cluster.wait_job(name, Duration::from_secs(90));
    eprintln!("requeued to completed: {:?}", t.elapsed());
    let output = std::fs::read_to_string(&out).unwrap_or_default();
    assert_eq!(
        Cluster::field(&job, "JobState"),
        "COMPLETED",
        "{job}\n{output}"
    );
    assert_eq!(Cluster::field(&job, "Restarts"), "1", "{job}");
    let (first, again) = output
        .split_once("batch restart_count=1")
        .unwrap_or_else(|| panic!("the job ran once\n{output}"));
    assert!(first.contains("batch restart_count=0"), "{output}");
    let resumed = lines_with(again, "start ");
    assert_eq!(resumed.len(), 3, "{output}");
    assert!(
        resumed
            .iter()
            .all(|s| s["world"] == "3" && s["step"].parse::<u32>().unwrap() >= reached),
        "the requeued job resumes from step {reached} or later, not 0\n{output}"
    );
    // A new run of the batch script: the agents' restart budget is untouched.
    assert!(
        resumed.iter().all(|s| s["restart"] == "0"),
        "TORCHELASTIC_RESTART_COUNT starts at 0 again\n{output}"
    );
    let done = lines_with(again, "done ");
    assert!(
        done.len() == 3 && done.iter().all(|d| d["step"] == steps.to_string()),
        "{output}"
    );
}

#[test]
fn a_requeued_job_resumes_from_its_newest_checkpoint() {
    a_requeued_job_resumes("fsdp-requeue", |cluster, id| {
        let requeue = cluster
            .client("scontrol")
            .args(["requeue", id])
            .status()
            .expect("scontrol requeue");
        assert!(requeue.success());
    });
}

#[test]
fn a_batch_job_whose_node_fails_is_requeued_and_resumes() {
    a_requeued_job_resumes("fsdp-node-fail", |cluster, id| {
        // Without --no-kill, Slurm ends the job once the node is marked down and requeues
        // it; it waits for three nodes, so the lost one comes back.
        let t = Instant::now();
        cluster.kill_node("n3");
        cluster.wait_state(id, "PENDING", LIMIT);
        eprintln!("node killed to the job requeued: {:?}", t.elapsed());
        cluster.start_lost_nodes();
    });
}

#[test]
fn the_time_limit_warning_to_the_batch_shell_reaches_every_worker() {
    // `--signal=B:USR1@110` with a two-minute limit: Slurm signals the example's batch
    // shell about 10 s in (its check runs every few tens of seconds), the shell passes it
    // to the step, and every worker checkpoints and ends before the limit.
    let cluster = Cluster::start();
    let ckpt = TempDir::new().unwrap();
    let dir = TempDir::new().unwrap();
    let out = dir.path().join("job.out");
    let name = "fsdp-warned";
    let submitted = cluster
        .job_client("sbatch")
        .args(["-J", name, "--time=2", "--signal=B:USR1@110", "--chdir"])
        .arg(workspace_file(""))
        .arg("-o")
        .arg(&out)
        .arg(workspace_file("examples/slurm/train.sbatch"))
        .args(elastic_worker(&ckpt, 5000))
        .output()
        .expect("sbatch");
    assert!(submitted.status.success(), "{submitted:?}");
    let job = cluster.wait_job(name, Duration::from_secs(150));
    let output = std::fs::read_to_string(&out).unwrap_or_default();
    let preempted = lines_with(&output, "preempted ");
    assert_eq!(
        set(preempted.iter().map(|p| p["host"].clone())),
        set(["n1", "n2", "n3"].map(String::from)),
        "every worker got the warning\n{job}\n{output}"
    );
    assert_eq!(
        lines_with(&output, "start ").len(),
        3,
        "no restart\n{output}"
    );
    let reached = progress(&ckpt);
    assert!((20..5000).contains(&reached), "checkpoint at {reached}");
    assert_eq!(
        Cluster::field(&job, "JobState"),
        "FAILED",
        "{job}\n{output}"
    );
    assert_eq!(Cluster::field(&job, "ExitCode"), "138:0", "{job}");
}

#[test]
fn the_example_batch_script_runs_the_example_on_every_node() {
    let cluster = Cluster::start();
    let dir = TempDir::new().unwrap();
    let out = dir.path().join("job.out");
    let name = "fsdp-example";
    let submitted = cluster
        .job_client("sbatch")
        .args(["-J", name, "--chdir"])
        .arg(workspace_file(""))
        .arg("-o")
        .arg(&out)
        .arg(workspace_file("examples/slurm/train.sbatch"))
        .output()
        .expect("sbatch");
    assert!(submitted.status.success(), "{submitted:?}");
    let job = cluster.wait_job(name, LIMIT);
    let output = std::fs::read_to_string(&out).unwrap_or_default();
    assert_eq!(
        Cluster::field(&job, "JobState"),
        "COMPLETED",
        "{job}\n{output}"
    );
    assert_eq!(Cluster::field(&job, "ExitCode"), "0:0", "{job}");
    let sums = output.matches("all_reduce sum = 6 (expected 6)").count();
    assert_eq!(sums, 3, "one group of the job's three nodes\n{output}");
}
