//! The training loop: join the group, build or resume the model, then step, log, validate
//! and save, one phase each, until the steps or epochs run out or a warning signal stops it.
//!
//! The loop's state is a [`Trainer`] that borrows its [`Group`] instead of owning it: the
//! collectives are set up before, and torn down after, everything the loop keeps.

// Each phase is one method: one grown past clippy's limit is due to be split.
#![warn(clippy::too_many_lines)]

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tch::{Device, Tensor};

use crate::args::Args;
use crate::c10d::{Comm, GroupSpec, ProcessGroup};
use crate::checkpoint::{self, Meta};
use crate::control::Order;
use crate::data::{Corpus, first_sample, mix};
use crate::engine::Engine;
use crate::inplace::{self, Boundary, InPlace};
use crate::launch::Launch;
use crate::model::ModelConfig;
use crate::progress::Progress;
use crate::saver::Saver;
use crate::schedule::Schedule;
use crate::shard::AdamW;
use crate::snapshot::plan::Short;
use crate::snapshot::{At, Snapshots};
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

/// Trains as the flags say, in the launcher's group (`launch`) or alone, until the steps
/// or epochs run out; a warning signal stops every rank early with [`crate::Warned`].
///
/// Under an agent that re-forms in place (`FSDP_AGENT_CONTROL`), a group that changes
/// does not end the process: it joins the next group its agent names and goes on from
/// the newest step held in peer memory ([`crate::inplace`]).
pub fn run(args: &Args, launch: Option<Launch>) -> anyhow::Result<()> {
    crate::warning::install();
    if let Some(n) = args.threads {
        tch::set_num_threads(n);
    }
    // Snapshots travel point to point on the group's backend: Gloo's, from host memory.
    // NCCL would take device tensors, and its pairwise communicators need grouped calls.
    let gloo = placement(args, launch.as_ref()).is_ok_and(|(_, b)| b == Some("gloo"));
    let mut control = launch
        .as_ref()
        .filter(|_| args.snapshot_freq > 0 && gloo)
        .and_then(|_| crate::control::Control::from_env());
    let mut kept = Snapshots::default();
    let corpus = open_corpus(args)?;
    let on_host = placement(args, launch.as_ref()).is_ok_and(|(d, _)| d == Device::Cpu);
    if control.is_some() && on_host {
        warm_up(args, &corpus);
    }
    let (mut launch, mut order, mut joined) = (launch, None, None);
    let mut ending = Ending(None);
    loop {
        let group = Group::join(args, launch.as_ref(), joined.take())?;
        ending.wait();
        let setup = Setup {
            group: &group,
            corpus: &corpus,
            control: control.as_mut(),
            spec: launch
                .as_ref()
                .zip(group.backend)
                .map(|(l, b)| group_spec(args, l, b)),
            local_world: launch.as_ref().map_or(1, |l| l.local_world),
            order: order.take(),
        };
        let Some(mut trainer) = Trainer::new(args, setup, &mut kept)? else {
            return Ok(());
        };
        match trainer.train()? {
            Ended::Finished => {
                trainer.finish();
                group.close();
                return Ok(());
            }
            Ended::Warned => return Err(trainer.stop_on_warning()),
            Ended::Left => return Err(trainer.leave_on_warning()),
            Ended::Reform(mut next) => {
                trainer.say_reform(&next.order);
                // The old group's end begins before the next is joined: a peer blocked in
                // it on this rank is released, and the next group, which needs that peer,
                // can form. It ends on a thread while the next is joined (Gloo's teardown
                // takes ~20 ms the re-form need not wait for), and is waited for once the
                // next is joined or the process returns.
                drop(trainer);
                ending.0 = Some(std::thread::spawn(move || drop(group)));
                joined = next.joined();
                launch = Some(next.order.launch.clone());
                order = Some(next.order);
            }
        }
    }
}

/// An old group ending on its thread ([`run`]): waited for before the next one starts
/// training and before the process returns, so that libtorch's teardown at exit never
/// runs beside it.
struct Ending(Option<std::thread::JoinHandle<()>>);

impl Ending {
    fn wait(&mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Ending {
    fn drop(&mut self) {
        self.wait();
    }
}

/// How a group's training ended.
enum Ended {
    Finished,
    /// A warning signal: the checkpoint is saved.
    Warned,
    /// A warning signal for this rank's node, which leaves; the others go on from peer
    /// memory, where this rank's part is.
    Left,
    /// The group changed: the next one meets where the order says (its join may be
    /// under way in the background).
    Reform(inplace::Next),
}

/// What a group's [`Trainer`] starts from, beside the flags.
struct Setup<'g> {
    group: &'g Group,
    corpus: &'g Corpus,
    control: Option<&'g mut crate::control::Control>,
    /// How this group met (the next ones meet the same way, elsewhere).
    spec: Option<GroupSpec>,
    local_world: usize,
    /// The agent's round this group is (`None`: the process's first group).
    order: Option<Order>,
}

/// The ranks this process trains with, and the device its tensors live on.
struct Group {
    comm: Comm,
    device: Device,
    /// The collectives library, where there is a process group.
    backend: Option<&'static str>,
}

impl Group {
    /// Joins the launcher's process group (or trains alone without one), or takes the
    /// group already joined in the background ([`InPlace::ready`]).
    fn join(
        args: &Args,
        launch: Option<&Launch>,
        joined: Option<ProcessGroup>,
    ) -> anyhow::Result<Self> {
        let (device, backend) = placement(args, launch)?;
        let comm = match (launch, backend, joined) {
            (_, _, Some(pg)) => Comm::Group(pg),
            (Some(l), Some(backend), None) => Comm::Group(
                ProcessGroup::connect(&group_spec(args, l, backend))
                    .context("joining the process group")?,
            ),
            _ => Comm::Single,
        };
        Ok(Self {
            comm,
            device,
            backend,
        })
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    /// The start-up line saying where tensors live and what carries the collectives.
    fn describe(&self) -> String {
        let world = self.world();
        format!(
            "Device: {}; collectives: {}",
            match self.device {
                Device::Cuda(i) => format!("cuda:{i} on each rank's LOCAL_RANK"),
                _ => "cpu".to_string(),
            },
            self.backend
                .map_or("none (one rank)".to_string(), |b| format!(
                    "{b}, world {world}"
                ))
        )
    }

    /// Ends the group after a finished run; any other exit drops it, which aborts it.
    fn close(self) {
        self.comm.close();
    }
}

/// Where and how `launch`'s group meets.
fn group_spec(args: &Args, launch: &Launch, backend: &'static str) -> GroupSpec {
    GroupSpec {
        backend,
        master_addr: launch.master_addr.clone(),
        master_port: launch.master_port,
        rank: launch.rank,
        world: launch.world,
        timeout: Duration::from_secs(args.collective_timeout),
        gloo_ifnames: std::env::var("GLOO_SOCKET_IFNAME")
            .ok()
            .filter(|s| !s.is_empty()),
    }
}

/// Where the lead's lines go: stdout on rank 0, nowhere on the others.
#[derive(Clone, Copy)]
struct Console {
    lead: bool,
}

impl Console {
    fn say(self, msg: String) {
        if self.lead {
            println!("{msg}");
        }
    }
}

/// Where training stands: the steps taken, the global samples they consumed (the next
/// step's batches start there on any world size), and the epoch those samples are in.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Position {
    step: u64,
    samples_seen: u64,
    epoch: Option<u64>,
}

/// Where training ends: `--max_steps`, and `--epochs` where the data has an end.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Limits {
    max_steps: u64,
    sample_limit: Option<u64>,
}

impl Limits {
    fn from_args(args: &Args, corpus: &Corpus) -> Self {
        Self {
            max_steps: args.steps(),
            sample_limit: args
                .epochs
                .zip(corpus.samples_per_epoch(args.max_context_width))
                .map(|(e, n)| e * n),
        }
    }

    fn reached(&self, at: &Position) -> bool {
        at.step >= self.max_steps || self.sample_limit.is_some_and(|l| at.samples_seen >= l)
    }

    /// The line for a run resumed where it already ends.
    fn nothing_to_do(&self, at: &Position) -> String {
        let (step, samples_seen, max_steps) = (at.step, at.samples_seen, self.max_steps);
        format!(
            "Already at step {step} (sample {samples_seen}) of --max_steps {max_steps}{}; nothing to do",
            self.sample_limit
                .map(|l| format!(" and {l} samples (--epochs)"))
                .unwrap_or_default()
        )
    }
}

/// How often the phases after a step come: every N steps each, 0 for never; checkpoints
/// only with a `--checkpoint_dir`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cadence {
    logging: u64,
    validation: u64,
    checkpoint: Option<u64>,
}

/// Which phases follow a step.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Due {
    log: bool,
    validate: bool,
    save: bool,
}

impl Cadence {
    fn from_args(args: &Args) -> Self {
        Self {
            logging: args.logging_freq,
            validation: args.validation_freq,
            checkpoint: args.checkpoint_dir.as_ref().map(|_| args.checkpoint_freq),
        }
    }

    /// After the step that made `done` steps: the last step logs, validates and saves
    /// whatever the frequencies, except that a warning leaves no time to validate.
    fn due(&self, done: u64, last: bool, warned: bool) -> Due {
        Due {
            log: done % self.logging == 0 || last,
            validate: self.validation > 0 && (done % self.validation == 0 || last) && !warned,
            save: self
                .checkpoint
                .is_some_and(|freq| last || (freq > 0 && done % freq == 0)),
        }
    }
}

/// Training speed over the steps since the last log line. It is training speed: the
/// pauses for validation and saves are left out.
struct Meter {
    since: Instant,
    samples: u64,
}

impl Meter {
    fn start() -> Self {
        Self {
            since: Instant::now(),
            samples: 0,
        }
    }

    fn add(&mut self, samples: u64) {
        self.samples += samples;
    }

    fn leave_out(&mut self, pause: Duration) {
        self.since += pause;
    }

    /// Samples per second since the window began.
    fn speed(&self) -> f64 {
        let secs = self.since.elapsed().as_secs_f64().max(1e-9);
        self.samples as f64 / secs
    }
}

/// What one step leaves for the phases after it.
struct Stepped {
    /// The step taken, counted from 0 (the number the log line gives it).
    index: u64,
    lr: f64,
    /// The last step: the limits are reached, or a warning arrived.
    last: bool,
    /// What every rank does next ([`inplace::boundary`]).
    boundary: Boundary,
    /// This rank was warned, as it told the others.
    warned_here: bool,
    due: Due,
    /// This rank's own time in the step: its wall time less what it spent blocked in
    /// collectives and waiting for a save's writer (what names a straggler). `None` on a
    /// GPU: NCCL's waits return at once (the stream waits, not the host), and the host
    /// blocks later, in a copy to the CPU, so the difference would be the whole step.
    busy: Option<Duration>,
}

impl Stepped {
    /// The steps taken once this one is.
    fn done(&self) -> u64 {
        self.index + 1
    }
}

/// The loop's state, and one method per phase of a step. Every method that runs a
/// collective is called by every rank in the same order.
struct Trainer<'g> {
    group: &'g Group,
    /// The flags, with `--vocab_size` settled by the data.
    args: Args,
    console: Console,
    progress: Progress,
    corpus: &'g Corpus,
    config: ModelConfig,
    engine: Engine,
    schedule: Schedule,
    limits: Limits,
    cadence: Cadence,
    position: Position,
    board: Board,
    saver: Option<Saver>,
    meter: Meter,
    /// The loss averaged over ranks at the last step that logged or saved.
    last_loss: f64,
    /// Peer-memory snapshots, kept across groups.
    kept: &'g mut Snapshots,
    /// Re-forming in place, when the agent offers it.
    in_place: Option<InPlace<'g>>,
    /// Time in steps, for the snapshots' share of it.
    stepping: Duration,
}

impl<'g> Trainer<'g> {
    /// Builds the model in the group and resumes it: from peer memory when the group
    /// holds a step whole, else from disk (collectives: every rank calls it). `None`: the
    /// run resumed where it already ends, and says so.
    fn new(args: &Args, setup: Setup<'g>, kept: &'g mut Snapshots) -> anyhow::Result<Option<Self>> {
        let Setup {
            group,
            corpus,
            control,
            spec: launch_spec,
            local_world,
            order,
        } = setup;
        let console = Console {
            lead: group.rank() == 0,
        };
        let progress = Progress::from_env(group.rank());
        console.say(group.describe());
        let args = if order.is_none() {
            for note in args.notes(group.device != Device::Cpu) {
                console.say(format!("Note: {note}"));
            }
            sized(args, corpus, console)
        } else {
            sized(args, corpus, Console { lead: false })
        };
        let config = ModelConfig::from_args(&args);
        if let Ok(which) = std::env::var("FSDP_TRAINER_FAULT_FLIP") {
            kept.flip_for_test(&which);
        }
        let held = survey_memory(group, kept, console)?;
        let mut engine = build_engine(&args, &config, group, console, held.is_none())?;
        let in_place = in_place_here(
            &args,
            &engine,
            group,
            control.zip(launch_spec),
            local_world,
            console,
        )?;
        let position = match &held {
            Some(plan) => from_memory(group, kept, plan, &mut engine, console)?,
            None => resume(&args, &config, &mut engine, console)?,
        };
        let limits = Limits::from_args(&args, corpus);
        if limits.reached(&position) {
            console.say(limits.nothing_to_do(&position));
            return Ok(None);
        }
        let lead_dir = args.tensorboard_dir.as_deref().filter(|_| console.lead);
        let board = Board::open(lead_dir, &group.comm, group.device)?;
        if let Some(path) = board.path() {
            console.say(format!("TensorBoard scalars go to {}", path.display()));
        }
        let saver = open_saver(&args, group, &progress)?;
        let mut me = Self {
            group,
            console,
            progress,
            corpus,
            config,
            engine,
            schedule: Schedule::from_args(&args),
            limits,
            cadence: Cadence::from_args(&args),
            position,
            board,
            saver,
            meter: Meter::start(),
            last_loss: f64::NAN,
            args,
            kept,
            in_place,
            stepping: Duration::ZERO,
        };
        // `disk` is every other way back: the last checkpoint, or step 0 without one.
        let restored = if held.is_some() { "memory" } else { "disk" };
        me.ready_in_place(order.as_ref(), restored)?;
        Ok(Some(me))
    }

    /// With in-place re-form: the step the group starts from is snapshotted in the new
    /// layout and its copy to the buddies starts (finished at the first step's fence, as
    /// every copy: the ~30 ms of a copy held before the first step were a tenth of a
    /// re-form's stall), the agent hears that this process re-forms in place, and, in a
    /// group it re-formed into, that it joined.
    fn ready_in_place(&mut self, order: Option<&Order>, restored: &str) -> anyhow::Result<()> {
        let Some(p) = self.in_place.as_mut() else {
            return Ok(());
        };
        let at = At {
            step: self.position.step,
            samples_seen: self.position.samples_seen,
            adam_step: self.engine.adam_step(),
        };
        p.after_step(self.kept, &self.engine, &self.group.comm, at, true)?;
        self.progress.can("re-form-in-place");
        if let Some(o) = order {
            self.progress.joined(o.round, restored);
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        self.limits.reached(&self.position)
    }

    /// Steps until the limits, a warning, or a change of the group.
    fn train(&mut self) -> anyhow::Result<Ended> {
        while !self.finished() {
            match self.one_step() {
                Ok(None) => {}
                Ok(Some(end)) => return Ok(end),
                Err(e) => return self.broken(e),
            }
        }
        if let Some(p) = self.in_place.as_mut() {
            p.settle(self.kept);
        }
        Ok(Ended::Finished)
    }

    /// A step and the phases after it; `Some` when the group's training ends here.
    fn one_step(&mut self) -> anyhow::Result<Option<Ended>> {
        let began = Instant::now();
        let stepped = self.step()?;
        self.stepping += began.elapsed();
        self.report(&stepped);
        if stepped.due.validate {
            self.validate(stepped.done())?;
        }
        self.save(&stepped)?;
        Ok(match stepped.boundary {
            Boundary::Go => None,
            Boundary::Stop => {
                crate::warning::wait_for_own(crate::warning::OWN_WARNING_WAIT);
                Some(Ended::Warned)
            }
            Boundary::Leave | Boundary::Reform => Some(self.leave_group(stepped.warned_here)?),
        })
    }

    /// At a boundary every rank agreed on: the copy in flight is finished (the buddies
    /// then hold this very step), then a rank whose own node is leaving stops, and the
    /// others wait for the round their agents send.
    fn leave_group(&mut self, warned_here: bool) -> anyhow::Result<Ended> {
        let Some(p) = self.in_place.as_mut() else {
            return Ok(Ended::Warned);
        };
        p.fence(self.kept)?;
        if warned_here {
            return Ok(Ended::Left);
        }
        match p.next_group(inplace::ORDER_WAIT) {
            Some(next) => Ok(Ended::Reform(next)),
            None if crate::warning::received().is_some() => Ok(Ended::Left),
            None => bail!(
                "the group changed at step {} but no new round came from the agent within {:?}",
                self.position.step,
                inplace::ORDER_WAIT
            ),
        }
    }

    /// A step or a phase failed. Re-forming in place, a failed collective is a group that
    /// broke (a peer lost): whatever of the copy in flight arrived is kept, and the
    /// process waits for its agent's next round. Any other failure ends the process, and so
    /// does a collective that failed for this process's own lack of memory
    /// ([`crate::c10d::C10dError::is_own_failure`]).
    fn broken(&mut self, e: anyhow::Error) -> anyhow::Result<Ended> {
        let Some(p) = self.in_place.as_mut() else {
            return Err(e);
        };
        match e.downcast_ref::<crate::c10d::C10dError>() {
            Some(c) if !c.is_own_failure() => {}
            _ => return Err(e),
        }
        p.settle(self.kept);
        println!(
            "Rank {}: the group broke during step {} ({e:#}); waiting for the agent's next round",
            self.group.rank(),
            self.position.step
        );
        match p.next_group(inplace::ORDER_WAIT) {
            Some(next) => Ok(Ended::Reform(next)),
            None if crate::warning::received().is_some() => Ok(Ended::Left),
            None => Err(e.context(format!(
                "no new round came from the agent within {:?}",
                inplace::ORDER_WAIT
            ))),
        }
    }

    /// The line a rank says when it re-forms in place.
    fn say_reform(&self, next: &Order) {
        println!(
            "Rank {} re-forms in place at step {}: round {}, rank {} of {} (was {} of {})",
            self.group.rank(),
            self.position.step,
            next.round,
            next.launch.rank,
            next.launch.world,
            self.group.rank(),
            self.group.world()
        );
    }

    /// One optimizer step on every rank's next batch, then what every rank must agree on
    /// before the phases after it: whether a warning or a new round arrived anywhere, and
    /// the mean loss when a log line or a checkpoint will show it.
    fn step(&mut self) -> anyhow::Result<Stepped> {
        let (began, blocked_before) = (Instant::now(), crate::c10d::blocked_so_far());
        self.note_epoch();
        let (group, args) = (self.group, &self.args);
        let index = self.position.step;
        let lr = self.schedule.at(index);
        let per_rank = args.train_batch_size;
        let first = first_sample(self.position.samples_seen, group.rank(), per_rank);
        let (inputs, targets) =
            self.corpus
                .batch(first, per_rank, args.max_context_width, group.device);
        self.engine
            .set_dropout(true, dropout_seed(args, index, group.rank()));
        let mut fenced = Duration::ZERO;
        let mut copy_failed = None;
        let (saver, in_place, kept) = (&mut self.saver, &mut self.in_place, &mut *self.kept);
        let mut fence = || {
            if let Some(s) = saver.as_mut() {
                fenced += s.fence();
            }
            // The buddy's copy of the last snapshot is in before the state changes again.
            if let Some(Err(e)) = in_place.as_mut().map(|p| p.fence(kept)) {
                copy_failed = Some(e);
            }
        };
        let loss = self.engine.step(
            &group.comm,
            (&inputs, &targets),
            lr,
            args.grad_clip,
            &mut fence,
        )?;
        if let Some(e) = copy_failed {
            return Err(e.into());
        }
        // Speed is training speed: waiting for a save's writer is not counted.
        self.meter.leave_out(fenced);
        let global_batch = per_rank as u64 * group.world() as u64;
        self.position.samples_seen += global_batch;
        self.meter.add(global_batch);
        self.position.step = index + 1;
        if let Some(p) = self.in_place.as_mut() {
            let at = At {
                step: self.position.step,
                samples_seen: self.position.samples_seen,
                adam_step: self.engine.adam_step(),
            };
            p.after_step(self.kept, &self.engine, &group.comm, at, false)?;
        }
        let (boundary, warned_here) = self.agree_on_boundary()?;
        let warned = boundary == Boundary::Stop;
        let last = self.finished() || warned;
        let due = self.cadence.due(index + 1, last, warned);
        if due.log || due.save {
            self.last_loss = mean_loss(&group.comm, &loss, index)?;
        }
        let blocked = crate::c10d::blocked_so_far().saturating_sub(blocked_before) + fenced;
        Ok(Stepped {
            index,
            lr,
            last,
            boundary,
            warned_here,
            due,
            busy: (group.device == tch::Device::Cpu)
                .then(|| began.elapsed().saturating_sub(blocked)),
        })
    }

    /// Every rank asks every step: a warning or a new round that reached one rank is
    /// acted on by all of them here ([`inplace::boundary`]). Also returns whether this
    /// rank was warned, as it said it: a signal after this is for the next boundary.
    fn agree_on_boundary(&mut self) -> anyhow::Result<(Boundary, bool)> {
        let mine = inplace::Flags {
            warned: crate::warning::received().is_some(),
            ready: self.in_place.as_mut().is_some_and(InPlace::ready),
            in_place: self.in_place.is_some(),
        };
        let all = inplace::flags(&self.group.comm, self.group.device, mine)?;
        let buddy_of = |r: usize| self.in_place.as_ref().and_then(|p| p.buddy_of(r));
        Ok((inplace::boundary(&all, &buddy_of), mine.warned))
    }

    /// Says when the step about to be taken begins an epoch.
    fn note_epoch(&mut self) {
        let Position {
            step,
            samples_seen,
            epoch,
        } = self.position;
        let now_in = self
            .corpus
            .epoch_of(samples_seen, self.args.max_context_width);
        if now_in != epoch {
            if let Some(e) = now_in {
                self.console.say(format!(
                    "Epoch {} of {} begins at step {step} (sample {samples_seen})",
                    e + 1,
                    self.args
                        .epochs
                        .map_or("no limit".into(), |n| n.to_string())
                ));
            }
            self.position.epoch = now_in;
        }
    }

    /// The log line and scalars when due; the agent hears of every step.
    fn report(&mut self, stepped: &Stepped) {
        if stepped.due.log {
            let (step, last_loss, lr) = (stepped.index, self.last_loss, stepped.lr);
            let speed = self.meter.speed();
            self.console.say(format!(
                "Batch {step} Loss: {last_loss:.5}, Speed: {speed:.2} samples/sec, lr: {lr:.6}"
            ));
            self.board.scalars(
                stepped.done(),
                &[
                    ("train/loss", last_loss),
                    ("train/lr", lr),
                    ("train/samples_per_s", speed),
                ],
            );
            self.meter = Meter::start();
        }
        self.progress.step(stepped.done() as usize, stepped.busy);
    }

    /// The validation loss after `done` steps, said and logged (a collective).
    fn validate(&mut self, done: u64) -> anyhow::Result<()> {
        self.progress.begin("validation");
        let validating = Instant::now();
        let loss = validation_loss(&self.args, &mut self.engine, self.group, self.corpus)?;
        self.console.say(format!(
            "Validation Loss: {loss:.5} (step {done}, {} batches of {} per rank)",
            self.args.validation_batches,
            self.args.val_batch()
        ));
        self.board.scalars(done, &[("val/loss", loss)]);
        self.progress.end("validation");
        self.meter.leave_out(validating.elapsed());
        Ok(())
    }

    /// A checkpoint when due; otherwise the save in flight, if any, is asked whether it
    /// is complete (either way a collective, with a `--checkpoint_dir`).
    fn save(&mut self, stepped: &Stepped) -> anyhow::Result<()> {
        let Some(saver) = self.saver.as_mut() else {
            return Ok(());
        };
        let console = self.console;
        let say = move |msg: String| console.say(msg);
        if !stepped.due.save {
            return saver.poll(&self.group.comm, &say);
        }
        self.progress.begin("checkpoint");
        let meta = Meta {
            format: checkpoint::FORMAT,
            step: stepped.done(),
            samples_seen: self.position.samples_seen,
            adam_step: self.engine.adam_step(),
            model: self.config.clone(),
            world_size: self.group.world(),
            sharding: self.args.sharding_strategy,
            loss: self.last_loss,
            shards: Vec::new(),
        };
        let paused = saver.save(&self.engine, &self.group.comm, meta, stepped.last, &say)?;
        self.progress.end("checkpoint");
        // Speed is training speed: the pause for the save is not counted.
        self.meter.leave_out(paused);
        Ok(())
    }

    /// Says why training stops early; the error carries the signal for the exit code.
    fn stop_on_warning(&self) -> anyhow::Error {
        self.console.say(format!(
            "Stopping at step {} on a warning signal (SIGUSR1/SIGUSR2: Slurm's before a pre-emption or the time limit, fsdp-agent's before a re-form or a pod delete){}",
            self.position.step,
            if self.saver.is_some() {
                "; the checkpoint above resumes it"
            } else {
                "; no --checkpoint_dir to save in"
            }
        ));
        crate::Warned(crate::warning::received().unwrap_or(libc::SIGUSR1)).into()
    }

    /// Says that this rank's node leaves; the error carries the signal for the exit code.
    fn leave_on_warning(&self) -> anyhow::Error {
        println!(
            "Rank {}: stopping at step {} on a warning signal: this node leaves the group, which goes on without it from peer memory",
            self.group.rank(),
            self.position.step
        );
        crate::Warned(crate::warning::received().unwrap_or(libc::SIGUSR1)).into()
    }

    /// The closing lines.
    fn finish(self) {
        // What follows the last step (the group's teardown) is judged as the end of
        // training, not timed as a step.
        self.progress.begin("finish");
        self.console.say(format!(
            "Training finished at step {}, loss {:.5}",
            self.position.step, self.last_loss
        ));
        if let Some(p) = self.in_place.as_ref().filter(|p| p.cost.taken > 0) {
            let spent = p.cost.spent.as_secs_f64();
            let (own, held) = self.kept.bytes();
            let mib = |b: i64| b as f64 / (1 << 20) as f64;
            self.console.say(format!(
                "Snapshots: {} taken, {:.2} ms each, {:.2}% of the time in steps; {:.1} MiB held (own {:.1}, a buddy's {:.1})",
                p.cost.taken,
                1e3 * spent / p.cost.taken as f64,
                100.0 * spent / self.stepping.as_secs_f64().max(1e-9),
                mib(own + held),
                mib(own),
                mib(held)
            ));
        }
        // Every rank reports its own peak: sharding is about per-rank memory.
        if let Some(kib) = peak_rss_kib() {
            println!(
                "Rank {} peak RSS: {:.1} MiB",
                self.group.rank(),
                kib as f64 / 1024.0
            );
        }
    }
}

/// The flags with `--vocab_size` settled: without it the model is as wide as the
/// tokenizer's vocabulary. Says what the data is.
fn sized(args: &Args, corpus: &Corpus, console: Console) -> Args {
    let mut sized = args.clone();
    if let Corpus::Tokens(t) = corpus {
        console.say(format!(
            "Data: {}",
            t.describe(args.max_context_width as usize + 1)
        ));
        sized.vocab_size = Some(args.vocab_size.unwrap_or(t.vocab()));
    }
    sized
}

/// The model, initialised from `--seed` on every rank and laid out for the sharding
/// strategy (a collective). Says its size.
fn build_engine(
    args: &Args,
    config: &ModelConfig,
    group: &Group,
    console: Console,
    fresh: bool,
) -> anyhow::Result<Engine> {
    tch::manual_seed(args.seed);
    let hyper = AdamW {
        beta1: args.beta1,
        beta2: args.beta2,
        eps: 1e-8,
        weight_decay: args.weight_decay,
    };
    let engine = Engine::new(
        config.clone(),
        group.device,
        &group.comm,
        args.sharding_strategy,
        hyper,
        args.prefetch,
        if args.bf16 {
            tch::Kind::BFloat16
        } else {
            tch::Kind::Float
        },
        fresh,
    )?;
    console.say(format!(
        "Model: {} parameters, {} layers, hidden {}; world size {}, {:?}, {}",
        engine.numel(),
        config.num_layers,
        config.hidden_width,
        group.world(),
        args.sharding_strategy,
        engine.describe()
    ));
    Ok(engine)
}

/// Loads the newest checkpoint under `--resume_from_checkpoint` into `engine`, if there
/// is one, and returns where it left off (the start without one).
fn resume(
    args: &Args,
    config: &ModelConfig,
    engine: &mut Engine,
    console: Console,
) -> anyhow::Result<Position> {
    let mut at = Position {
        step: 0,
        samples_seen: 0,
        epoch: None,
    };
    let Some(dir) = args.resume_from_checkpoint.as_deref() else {
        return Ok(at);
    };
    match checkpoint::find(dir)? {
        Some(path) => {
            let (meta, state) = checkpoint::load(&path, config)?;
            engine.load(&state, meta.adam_step);
            (at.step, at.samples_seen) = (meta.step, meta.samples_seen);
            console.say(format!(
                "Loaded checkpoint {} (step {}, sample {}, saved by {} rank(s), loss {:.5})",
                path.display(),
                meta.step,
                meta.samples_seen,
                meta.world_size,
                meta.loss
            ));
        }
        None => console.say(format!(
            "No checkpoint in {}; starting from scratch",
            dir.display()
        )),
    }
    Ok(at)
}

/// This rank's loss averaged over ranks (a collective); one that is no longer finite ends
/// training, at step `index`.
fn mean_loss(comm: &Comm, loss: &Tensor, index: u64) -> anyhow::Result<f64> {
    let mut l = loss.reshape([1]);
    comm.all_reduce_sum(&mut l)?;
    let mean = l.double_value(&[0]) / comm.world() as f64;
    if !mean.is_finite() {
        bail!("the loss became {mean} at step {index}; lower --lr or raise --warmup");
    }
    Ok(mean)
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

/// A new process that re-forms in place trains one step alone, on the host, before it
/// meets its group. A node coming back joins a running group, whose ranks join the new
/// group on a thread and train on until it is there; then all of them wait for the
/// newcomer's first step, which would otherwise be its first ever (libtorch's kernels
/// chosen, the allocator's pages touched): measured 0.2 s against 0.12 s for the others.
/// Not under `full`: its model is the one too large to hold whole; and only for ranks
/// that train on the host (a GPU's warm-up would be its own).
fn warm_up(args: &Args, corpus: &Corpus) {
    if args.sharding_strategy == crate::args::Sharding::Full {
        return;
    }
    let sized = sized(args, corpus, Console { lead: false });
    let model = crate::model::Model::new(ModelConfig::from_args(&sized), Device::Cpu);
    let (inputs, targets) = corpus.batch(
        0,
        args.train_batch_size,
        args.max_context_width,
        Device::Cpu,
    );
    model.loss(&inputs, &targets).backward();
}

/// The saver of `--checkpoint_dir`, if any (a collective), said to the agent when a
/// warning makes it save.
fn open_saver(args: &Args, group: &Group, progress: &Progress) -> anyhow::Result<Option<Saver>> {
    let Some(dir) = &args.checkpoint_dir else {
        return Ok(None);
    };
    let saver = Saver::new(
        dir.clone(),
        args.checkpoints_to_keep,
        args.sharded_checkpoints,
        &group.comm,
        group.device,
    )?;
    // Only a save the next group resumes from is worth a warning; and the agent signals
    // its worker's whole process group, so only a trainer that leads its own (started by
    // the agent, not under a wrapper shell that SIGUSR1 would end) says so.
    // SAFETY: getpgrp and getpid take nothing and cannot fail.
    let leads_group = unsafe { libc::getpgrp() == libc::getpid() };
    if args.resume_from_checkpoint.is_some() && leads_group {
        progress.can("save-on-warning");
    }
    Ok(Some(saver))
}

/// This group's in-place state, where every rank has one (a collective: every rank calls
/// it). A rank without (no control socket, or its snapshots past
/// `--snapshot_max_memory`) would leave its buddy waiting on copies it never sends: then
/// no rank of the group keeps snapshots, and each is restarted on a change.
fn in_place_here<'c>(
    args: &Args,
    engine: &Engine,
    group: &Group,
    offered: Option<(&'c mut crate::control::Control, GroupSpec)>,
    local_world: usize,
    console: Console,
) -> anyhow::Result<Option<InPlace<'c>>> {
    let group_id = agree_on_id(&group.comm, group.device)?;
    let mine = offered
        .map(|(c, spec)| {
            let cadence = (local_world, args.snapshot_freq);
            InPlace::new(c, group_id, (&group.comm, engine), cadence, spec)
        })
        .filter(|p| snapshots_fit(args, engine, group, p.buddy(), console));
    let able = group
        .comm
        .sum_over_ranks(f32::from(u8::from(mine.is_some())), group.device)?;
    if (able.round() as usize) < group.world() {
        if able > 0.0 {
            console.say(format!(
                "Snapshots: off: {able:.0} of {} ranks can keep them; every rank is restarted when the group changes",
                group.world()
            ));
        }
        return Ok(None);
    }
    Ok(mine)
}

/// An id for this group that every rank agrees on (rank 0's, broadcast): it names the
/// group's snapshots, whose ranks are this group's.
fn agree_on_id(comm: &Comm, device: Device) -> anyhow::Result<u64> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mine = mix(nanos ^ u64::from(std::process::id()));
    let mut t = Tensor::from_slice(&[(mine >> 1) as i64]).to_device(device);
    comm.broadcast(&mut t, 0)?;
    Ok(t.int64_value(&[0]) as u64)
}

/// Whether this rank's snapshots fit `--snapshot_max_memory`; says what they take (the
/// lead) or that they are off (any rank past the limit: that rank is then restarted on a
/// re-form, as without snapshots).
fn snapshots_fit(
    args: &Args,
    engine: &Engine,
    group: &Group,
    buddy: Option<usize>,
    console: Console,
) -> bool {
    let len: i64 = engine
        .runs_of(group.rank(), group.world())
        .iter()
        .map(|&(_, n)| n)
        .sum();
    let mib = crate::snapshot::budget_bytes(len, buddy.is_some()) as f64 / (1 << 20) as f64;
    if let Some(limit) = args.snapshot_max_memory.filter(|&l| mib > l as f64) {
        eprintln!(
            "fsdp-trainer: warning: rank {}'s snapshots would take {mib:.1} MiB of host memory, past --snapshot_max_memory {limit}; this rank keeps none and is restarted when its group changes (raise the limit, or snapshot less: --snapshot_freq)",
            group.rank()
        );
        return false;
    }
    console.say(format!(
        "Snapshots: every {} step(s), in host memory: each rank's own{}; up to {mib:.1} MiB per rank",
        args.snapshot_freq,
        buddy.map_or(
            " only (every rank is on one node)".to_string(),
            |b| format!(" and a copy on a rank of another node (rank 0's on rank {b})")
        ),
    ));
    true
}

/// The step the group can rebuild from peer memory (a collective in a group). `None`:
/// alone, or no step held whole (said when anyone held anything).
fn survey_memory(
    group: &Group,
    kept: &Snapshots,
    console: Console,
) -> anyhow::Result<Option<crate::snapshot::plan::Plan>> {
    if matches!(group.comm, Comm::Single) {
        return Ok(None);
    }
    match crate::snapshot::restore::survey(&group.comm, group.device, kept)? {
        Ok(plan) => Ok(Some(plan)),
        Err(Short::Nothing) => Ok(None),
        Err(short) => {
            console.say(format!(
                "Peer memory cannot rebuild a step: {short}; resuming from disk"
            ));
            Ok(None)
        }
    }
}

/// `plan`'s step, rebuilt from peer memory into `engine` (a collective), and said.
fn from_memory(
    group: &Group,
    kept: &Snapshots,
    plan: &crate::snapshot::plan::Plan,
    engine: &mut Engine,
    console: Console,
) -> anyhow::Result<Position> {
    let began = Instant::now();
    let at = crate::snapshot::restore::rebuild(&group.comm, group.device, kept, plan, engine)?;
    console.say(format!(
        "Restored step {} from peer memory (sample {}, {} parts, in {:.3} s): nothing read from disk, no step redone",
        at.step,
        at.samples_seen,
        plan.senders.len(),
        began.elapsed().as_secs_f64()
    ));
    Ok(Position {
        step: at.step,
        samples_seen: at.samples_seen,
        epoch: None,
    })
}

/// The seed of a step's dropout masks: the rank's own unless `--same_seed=1`.
fn dropout_seed(args: &Args, step: u64, rank: usize) -> i64 {
    let rank = if args.same_seed { 0 } else { rank as u64 + 1 };
    let mixed = mix(mix(mix(args.seed as u64) ^ step) ^ rank);
    (mixed >> 1) as i64
}

/// The mean loss over `--validation_batches` held-out batches of `--val_batch_size` per
/// rank, the same samples at every validation (a collective: every rank calls it).
fn validation_loss(
    args: &Args,
    engine: &mut Engine,
    group: &Group,
    corpus: &Corpus,
) -> anyhow::Result<f64> {
    let (comm, device) = (&group.comm, group.device);
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn cadence(flags: &[&str]) -> Cadence {
        Cadence::from_args(&Args::try_parse_from([&["fsdp-trainer"], flags].concat()).unwrap())
    }

    fn due(log: bool, validate: bool, save: bool) -> Due {
        Due {
            log,
            validate,
            save,
        }
    }

    #[test]
    fn each_phase_comes_at_its_frequency_and_all_at_the_last_step() {
        let c = cadence(&[
            "--logging_freq=5",
            "--validation_freq=4",
            "--checkpoint_freq=6",
            "--checkpoint_dir=/ckpt",
        ]);
        assert_eq!(c.due(1, false, false), due(false, false, false));
        assert_eq!(c.due(4, false, false), due(false, true, false));
        assert_eq!(c.due(5, false, false), due(true, false, false));
        assert_eq!(c.due(6, false, false), due(false, false, true));
        assert_eq!(c.due(7, true, false), due(true, true, true));
        // A warning leaves time to save, not to validate.
        assert_eq!(c.due(8, true, true), due(true, false, true));
    }

    #[test]
    fn without_a_directory_nothing_is_saved_and_zero_means_never() {
        let c = cadence(&["--checkpoint_freq=1", "--validation_freq=0"]);
        assert_eq!(c.due(1, true, false), due(true, false, false));
        let c = cadence(&["--checkpoint_freq=0", "--checkpoint_dir=/ckpt"]);
        assert_eq!(c.due(50, false, false), due(true, false, false));
        assert_eq!(c.due(51, true, false), due(true, false, true));
    }

    #[test]
    fn training_ends_at_the_step_limit_or_the_sample_limit() {
        let at = |step, samples_seen| Position {
            step,
            samples_seen,
            epoch: None,
        };
        let steps_only = Limits {
            max_steps: 10,
            sample_limit: None,
        };
        assert!(!steps_only.reached(&at(9, u64::MAX)));
        assert!(steps_only.reached(&at(10, 0)));
        let both = Limits {
            max_steps: 10,
            sample_limit: Some(64),
        };
        assert!(!both.reached(&at(3, 63)));
        assert!(both.reached(&at(3, 64)));
        assert_eq!(
            both.nothing_to_do(&at(8, 64)),
            "Already at step 8 (sample 64) of --max_steps 10 and 64 samples (--epochs); nothing to do"
        );
    }
}
