//! fsdp-trainer: a Llama-style decoder trained data-parallel with `tch` on PyTorch's own
//! c10d collectives, the program fsdp-agent launches once per GPU (or CPU rank).
//!
//! # Tour
//!
//! * [`args`]: flags named like the seeds' `train.py`, checked up front.
//! * [`launch`]: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher.
//! * [`c10d`]: TCPStore and ProcessGroupGloo (NCCL with `cuda`) through a C++ shim.
//! * [`device`]: which GPU (or the CPU) a rank uses and which backend, from `--backend`.
//! * [`model`]: embedding, RMSNorm, rotary GQA attention, SwiGLU MLP.
//! * [`data`]: samples addressed by a global index, so any world size resumes in place.
//! * [`tokenizer`]: a Hugging Face `tokenizer.json` (`--tokenizer`), or bytes.
//! * [`dataset`]: local `.jsonl`/`.txt` datasets (`--dataset`), tokenized into windows
//!   visited once per epoch in an order keyed by the epoch.
//! * [`shard`]: gradient exchange and AdamW on a flat vector, `no_shard` or `shard_grad_op`.
//! * [`full_shard`]: `full` sharding, unit by unit with activation checkpointing.
//! * [`engine`]: one training step interface over both.
//! * [`checkpoint`]: atomic saves (sharded and written in the background, or gathered),
//!   newest-complete resume on any world size, shape checks.
//! * [`saver`]: the loop's side of a save: one in flight, completed once every rank's
//!   shard is written.
//! * [`train`]: the loop and its log lines.
//! * [`snapshot`]: peer-memory snapshots: each rank's part after a step, in its own host
//!   memory and a buddy's on another node, and the newest step rebuilt from them.
//! * [`control`], [`inplace`]: re-forming in place under fsdp-agent: the agent's new
//!   round, and what every rank does at a step boundary.
//! * [`warning`]: Slurm's SIGUSR1/SIGUSR2 warning: save, then stop.
//! * [`tensorboard`]: `--tensorboard_dir` scalars as a TensorBoard event file, hand-encoded.
//!
//! Exit codes: 0 done, 128 + n stopped by warning signal n (SIGUSR1: 138) after saving,
//! 1 a runtime failure (a collective, I/O, a diverged loss), 2 bad
//! input (flags, launcher environment, a checkpoint of another shape).

mod args;
mod c10d;
mod checkpoint;
mod control;
mod data;
mod dataset;
mod device;
mod engine;
mod full_shard;
mod inplace;
mod launch;
mod malloc;
mod model;
mod progress;
mod saver;
mod schedule;
mod shard;
mod snapshot;
mod tensorboard;
mod tokenizer;
mod train;
mod warning;

use std::process::ExitCode;

use clap::Parser;

/// Stopped at a step boundary by a warning signal, after the checkpoint: exit 128 + it,
/// as a death by the signal would have been reported.
#[derive(Debug, thiserror::Error)]
#[error("stopped by signal {0} after saving")]
pub struct Warned(pub i32);

/// Input the user must fix (exit 2), as opposed to a failure while training (exit 1).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

/// A panic on the main thread (a failed allocation in a tensor op, most often) ends the
/// process at once, with the code Rust gives a panic (101). Unwinding dropped the
/// collectives in flight, and dropping one waits for it while the peers wait on this
/// rank: the process lingered until the collective timed out (20 s in the benchmark's
/// memory probe; NCCL's default is 10 minutes) before its agent saw it end and stopped
/// the others. Other threads' panics still unwind: their joiners turn them into errors.
fn exit_on_a_main_thread_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        if std::thread::current().name() == Some("main") {
            // SAFETY: ends the process without running anything more, which is the point.
            unsafe { libc::_exit(101) };
        }
    }));
}

fn main() -> ExitCode {
    exit_on_a_main_thread_panic();
    let args = args::Args::parse();
    // `full` allocates the most temporaries per step (every unit recomputed): see malloc.rs.
    if args.sharding_strategy == args::Sharding::Full {
        malloc::fix_mmap_threshold();
    }
    if let Err(e) = args.validate() {
        eprintln!("fsdp-trainer: error: {e}");
        return ExitCode::from(2);
    }
    let launch = match launch::from_env(&|k| std::env::var(k).ok()) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("fsdp-trainer: error: {e}");
            return ExitCode::from(2);
        }
    };
    match train::run(&args, launch) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<Warned>() => {
            let signal = e.downcast_ref::<Warned>().map_or(libc::SIGUSR1, |w| w.0);
            ExitCode::from((128 + signal) as u8)
        }
        Err(e) => {
            eprintln!("fsdp-trainer: error: {e:#}");
            let bad_input = e.is::<BadInput>()
                || e.downcast_ref::<checkpoint::CheckpointError>()
                    .is_some_and(|c| matches!(c, checkpoint::CheckpointError::Invalid { .. }));
            ExitCode::from(if bad_input { 2 } else { 1 })
        }
    }
}
