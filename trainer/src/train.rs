//! The training loop: set up the group, build or resume the model, step, log, save.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tch::Device;

use crate::args::Args;
use crate::c10d::{Comm, GroupSpec, ProcessGroup};
use crate::checkpoint::{self, Meta};
use crate::data::{Corpus, first_sample, mix};
use crate::engine::Engine;
use crate::launch::Launch;
use crate::model::ModelConfig;
use crate::saver::Saver;
use crate::schedule::Schedule;
use crate::shard::AdamW;
use crate::tensorboard::EventWriter;

fn placement(
    args: &Args,
    launch: Option<&Launch>,
) -> Result<(Device, Option<&'static str>), crate::BadInput> {
    #[cfg(feature = "cuda")]
    let gpus = usize::try_from(tch::Cuda::device_count()).unwrap_or(0);
    #[cfg(not(feature = "cuda"))]
    let gpus = 0;
    let p = crate::device::choose(
        args.backend,
        gpus,
        launch.map(|l| l.local_rank),
        launch.map(|l| l.world),
    )
    .map_err(crate::BadInput)?;
    Ok((p.cuda.map_or(Device::Cpu, Device::Cuda), p.group))
}

pub fn run(args: &Args, launch: Option<Launch>) -> anyhow::Result<()> {
    crate::warning::install();
    if let Some(n) = args.threads {
        tch::set_num_threads(n);
    }
    let (device, backend) = placement(args, launch.as_ref())?;
    let comm = match (&launch, backend) {
        (Some(l), Some(backend)) => Comm::Group(
            ProcessGroup::new(&GroupSpec {
                backend,
                master_addr: l.master_addr.clone(),
                master_port: l.master_port,
                rank: l.rank,
                world: l.world,
                timeout: Duration::from_secs(args.collective_timeout),
                gloo_ifnames: std::env::var("GLOO_SOCKET_IFNAME")
                    .ok()
                    .filter(|s| !s.is_empty()),
            })
            .context("joining the process group")?,
        ),
        _ => Comm::Single,
    };
    let (rank, world) = (comm.rank(), comm.world());
    let lead = rank == 0;
    let progress = crate::progress::Progress::from_env(rank);
    let say = |msg: String| {
        if lead {
            println!("{msg}");
        }
    };
    say(format!(
        "Device: {}; collectives: {}",
        match device {
            Device::Cuda(i) => format!("cuda:{i} on each rank's LOCAL_RANK"),
            _ => "cpu".to_string(),
        },
        backend.map_or("none (one rank)".to_string(), |b| format!(
            "{b}, world {world}"
        ))
    ));
    for note in args.notes(device != Device::Cpu) {
        say(format!("Note: {note}"));
    }

    let corpus = open_corpus(args)?;
    let mut sized = args.clone();
    if let Corpus::Tokens(t) = &corpus {
        say(format!(
            "Data: {}",
            t.describe(args.max_context_width as usize + 1)
        ));
        // Without --vocab_size the model is as wide as the tokenizer's vocabulary.
        sized.vocab_size = Some(args.vocab_size.unwrap_or(t.vocab()));
    }
    let args = &sized;
    let config = ModelConfig::from_args(args);
    tch::manual_seed(args.seed);
    let hyper = AdamW {
        beta1: args.beta1,
        beta2: args.beta2,
        eps: 1e-8,
        weight_decay: args.weight_decay,
    };
    let mut engine = Engine::new(
        config.clone(),
        device,
        &comm,
        args.sharding_strategy,
        hyper,
        args.prefetch,
        if args.bf16 {
            tch::Kind::BFloat16
        } else {
            tch::Kind::Float
        },
    )?;
    say(format!(
        "Model: {} parameters, {} layers, hidden {}; world size {world}, {:?}, {}",
        engine.numel(),
        config.num_layers,
        config.hidden_width,
        args.sharding_strategy,
        engine.describe()
    ));

    let (mut step, mut samples_seen) = (0u64, 0u64);
    match args
        .resume_from_checkpoint
        .as_deref()
        .map(checkpoint::find)
        .transpose()?
    {
        Some(Some(path)) => {
            let (meta, state) = checkpoint::load(&path, &config)?;
            engine.load(&state, meta.adam_step);
            step = meta.step;
            samples_seen = meta.samples_seen;
            say(format!(
                "Loaded checkpoint {} (step {}, sample {}, saved by {} rank(s), loss {:.5})",
                path.display(),
                meta.step,
                meta.samples_seen,
                meta.world_size,
                meta.loss
            ));
        }
        Some(None) => say(format!(
            "No checkpoint in {}; starting from scratch",
            args.resume_from_checkpoint
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        )),
        None => {}
    }
    let max_steps = args.steps();
    // --epochs bounds the samples too, where the data has an end.
    let sample_limit = args
        .epochs
        .zip(corpus.samples_per_epoch(args.max_context_width))
        .map(|(e, n)| e * n);
    let epochs_done = |seen: u64| sample_limit.is_some_and(|l| seen >= l);
    if step >= max_steps || epochs_done(samples_seen) {
        say(format!(
            "Already at step {step} (sample {samples_seen}) of --max_steps {max_steps}{}; nothing to do",
            sample_limit
                .map(|l| format!(" and {l} samples (--epochs)"))
                .unwrap_or_default()
        ));
        return Ok(());
    }

    let mut board = Board::open(
        args.tensorboard_dir.as_deref().filter(|_| lead),
        &comm,
        device,
    )?;
    if let Some(path) = board.path() {
        say(format!("TensorBoard scalars go to {}", path.display()));
    }
    let mut saver = match &args.checkpoint_dir {
        Some(dir) => Some(Saver::new(
            dir.clone(),
            args.checkpoints_to_keep,
            args.sharded_checkpoints,
            &comm,
            device,
        )?),
        None => None,
    };
    let schedule = Schedule::from_args(args);
    let per_rank = args.train_batch_size;
    let global_batch = per_rank as u64 * world as u64;
    let mut window_start = Instant::now();
    let mut window_samples = 0u64;
    let mut last_loss = f64::NAN;
    let mut epoch = None;
    while step < max_steps && !epochs_done(samples_seen) {
        let now_in = corpus.epoch_of(samples_seen, args.max_context_width);
        if now_in != epoch {
            if let Some(e) = now_in {
                say(format!(
                    "Epoch {} of {} begins at step {step} (sample {samples_seen})",
                    e + 1,
                    args.epochs.map_or("no limit".into(), |n| n.to_string())
                ));
            }
            epoch = now_in;
        }
        let lr = schedule.at(step);
        let first = first_sample(samples_seen, rank, per_rank);
        let (inputs, targets) = corpus.batch(first, per_rank, args.max_context_width, device);
        engine.set_dropout(true, dropout_seed(args, step, rank));
        let mut fenced = Duration::ZERO;
        let mut fence = || {
            if let Some(s) = saver.as_mut() {
                fenced += s.fence();
            }
        };
        let loss = engine.step(&comm, (&inputs, &targets), lr, args.grad_clip, &mut fence)?;
        // Speed is training speed: waiting for a save's writer is not counted.
        window_start += fenced;
        samples_seen += global_batch;
        window_samples += global_batch;
        let done = step + 1;
        // Every rank asks every step: a warning that reached one rank stops them all here.
        let warned = warned_anywhere(&comm, device)?;
        let last = done == max_steps || epochs_done(samples_seen) || warned;
        let save = args.checkpoint_dir.is_some()
            && (last || (args.checkpoint_freq > 0 && done % args.checkpoint_freq == 0));
        if done % args.logging_freq == 0 || last || save {
            let mut l = loss.reshape([1]);
            comm.all_reduce_sum(&mut l)?;
            last_loss = l.double_value(&[0]) / world as f64;
            if !last_loss.is_finite() {
                bail!("the loss became {last_loss} at step {step}; lower --lr or raise --warmup");
            }
        }
        if done % args.logging_freq == 0 || last {
            let secs = window_start.elapsed().as_secs_f64().max(1e-9);
            let speed = window_samples as f64 / secs;
            say(format!(
                "Batch {step} Loss: {last_loss:.5}, Speed: {speed:.2} samples/sec, lr: {lr:.6}"
            ));
            board.scalars(
                done,
                &[
                    ("train/loss", last_loss),
                    ("train/lr", lr),
                    ("train/samples_per_s", speed),
                ],
            );
            window_start = Instant::now();
            window_samples = 0;
        }
        progress.step(done as usize);
        if args.validation_freq > 0 && (done % args.validation_freq == 0 || last) && !warned {
            progress.begin("validation");
            let validating = Instant::now();
            let loss = validate(args, &mut engine, &comm, &corpus, device)?;
            say(format!(
                "Validation Loss: {loss:.5} (step {done}, {} batches of {} per rank)",
                args.validation_batches,
                args.val_batch()
            ));
            board.scalars(done, &[("val/loss", loss)]);
            progress.end("validation");
            window_start += validating.elapsed();
        }
        if let Some(saver) = saver.as_mut() {
            if save {
                progress.begin("checkpoint");
                let meta = Meta {
                    format: checkpoint::FORMAT,
                    step: done,
                    samples_seen,
                    adam_step: engine.adam_step(),
                    model: config.clone(),
                    world_size: world,
                    sharding: args.sharding_strategy,
                    loss: last_loss,
                    shards: Vec::new(),
                };
                let paused = saver.save(&engine, &comm, meta, last, &say)?;
                progress.end("checkpoint");
                // Speed is training speed: the pause for the save is not counted.
                window_start += paused;
            } else {
                saver.poll(&comm, &say)?;
            }
        }
        step = done;
        if warned {
            say(format!(
                "Stopping at step {step} on a warning signal (SIGUSR1/SIGUSR2, Slurm's before a pre-emption or the time limit){}",
                if saver.is_some() {
                    "; the checkpoint above resumes it"
                } else {
                    "; no --checkpoint_dir to save in"
                }
            ));
            return Err(crate::Warned(crate::warning::received().unwrap_or(libc::SIGUSR1)).into());
        }
    }
    // What follows the last step (the group's teardown) is judged as the end of training,
    // not timed as a step.
    progress.begin("finish");
    say(format!(
        "Training finished at step {step}, loss {last_loss:.5}"
    ));
    // Every rank reports its own peak: sharding is about per-rank memory.
    if let Some(kib) = peak_rss_kib() {
        println!("Rank {rank} peak RSS: {:.1} MiB", kib as f64 / 1024.0);
    }
    drop(saver);
    comm.close();
    Ok(())
}

/// The synthetic corpus, or `--dataset` (`--dataset_path`, its older name) read and
/// tokenized; a dataset that cannot train this model is the user's to fix.
fn open_corpus(args: &Args) -> anyhow::Result<Corpus> {
    let path = args
        .dataset
        .clone()
        .or_else(|| args.dataset_path.as_ref().map(|p| p.display().to_string()));
    let Some(path) = path else {
        if args.tokenizer.is_some() {
            return Err(crate::BadInput(
                "--tokenizer encodes a --dataset; give the dataset too (the built-in corpus is already tokens)".into(),
            )
            .into());
        }
        return Ok(Corpus::synthetic(args.vocab()));
    };
    let bad = |e: String| anyhow::Error::from(crate::BadInput(e));
    let tokens = crate::dataset::open(
        &path,
        args.dataset_config_name.as_deref(),
        args.tokenizer.as_deref(),
    )
    .map_err(bad)?;
    tokens
        .check(args.max_context_width as usize + 1)
        .map_err(bad)?;
    if let Some(given) = args.vocab_size.filter(|&v| v < tokens.vocab()) {
        return Err(bad(format!(
            "the data's tokens run up to {} but --vocab_size is {given}: raise --vocab_size to at least {} (or leave it out to take the tokenizer's)",
            tokens.vocab() - 1,
            tokens.vocab()
        )));
    }
    Ok(Corpus::Tokens(tokens))
}

/// The lead rank's TensorBoard file, if asked for. A write that fails (a full disk) is
/// said once and ends the scalars, not the training.
struct Board(Option<EventWriter>);

impl Board {
    /// Opens the file on the lead (`dir` given there only); every rank calls it, and a
    /// directory the lead cannot use stops every rank, not the lead alone.
    fn open(dir: Option<&std::path::Path>, comm: &Comm, device: Device) -> anyhow::Result<Self> {
        let opened = dir.map(EventWriter::create).transpose();
        let failed = comm.sum_over_ranks(f32::from(u8::from(opened.is_err())), device)?;
        match opened {
            Err(e) => Err(crate::BadInput(format!(
                "--tensorboard_dir {}: {e}",
                dir.map(|d| d.display().to_string()).unwrap_or_default()
            ))
            .into()),
            Ok(_) if failed > 0.0 => Err(crate::BadInput(
                "--tensorboard_dir: the lead rank cannot write there (see its error)".into(),
            )
            .into()),
            Ok(w) => Ok(Self(w)),
        }
    }

    fn path(&self) -> Option<&std::path::Path> {
        self.0.as_ref().map(EventWriter::path)
    }

    fn scalars(&mut self, step: u64, values: &[(&str, f64)]) {
        let Some(w) = &mut self.0 else { return };
        if let Err(e) = values
            .iter()
            .try_for_each(|(tag, v)| w.scalar(tag, step, *v))
        {
            eprintln!(
                "fsdp-trainer: warning: writing TensorBoard scalars to {} failed ({e}); training goes on without them",
                w.path().display()
            );
            self.0 = None;
        }
    }
}

/// Whether a warning signal reached any rank (a collective: every rank calls it each step).
fn warned_anywhere(comm: &Comm, device: Device) -> anyhow::Result<bool> {
    let mine = f32::from(u8::from(crate::warning::received().is_some()));
    Ok(comm.sum_over_ranks(mine, device)? > 0.0)
}

/// The seed of a step's dropout masks: the rank's own unless `--same_seed=1`.
fn dropout_seed(args: &Args, step: u64, rank: usize) -> i64 {
    let rank = if args.same_seed { 0 } else { rank as u64 + 1 };
    let mixed = mix(mix(mix(args.seed as u64) ^ step) ^ rank);
    (mixed >> 1) as i64
}

/// The mean loss over `--validation_batches` held-out batches of `--val_batch_size` per
/// rank, the same samples at every validation (a collective: every rank calls it).
fn validate(
    args: &Args,
    engine: &mut Engine,
    comm: &Comm,
    corpus: &Corpus,
    device: Device,
) -> anyhow::Result<f64> {
    engine.set_dropout(false, 0);
    let (per_rank, world) = (args.val_batch(), comm.world() as u64);
    let mut sum = tch::Tensor::zeros([1], (tch::Kind::Float, device));
    for b in 0..args.validation_batches {
        let first = first_sample(b * per_rank as u64 * world, comm.rank(), per_rank);
        let (inputs, targets) =
            corpus.validation_batch(first, per_rank, args.max_context_width, device);
        sum += engine.eval_loss(comm, &inputs, &targets)?.reshape([1]);
    }
    comm.all_reduce_sum(&mut sum)?;
    Ok(sum.double_value(&[0]) / (world * args.validation_batches) as f64)
}

/// The process's peak resident set (VmHWM), in KiB.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
