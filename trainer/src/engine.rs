//! The training step for each sharding strategy behind one interface: the whole model
//! with a flat optimizer (`no_shard`, `shard_grad_op`), or unit-by-unit `full` sharding.

use tch::{Device, Tensor};

use crate::args::Sharding;
use crate::c10d::{C10dError, Comm};
use crate::full_shard::FullShard;
use crate::model::{Model, ModelConfig};
use crate::shard::{AdamW, FlatOptimizer, FullState, LiveState};

pub enum Engine {
    Flat { model: Model, opt: FlatOptimizer },
    Full(FullShard),
}

impl Engine {
    /// Builds the model from the current RNG state (seed it first: every rank must agree).
    /// Without `fresh` the state is about to be loaded (rebuilt from peer memory): the
    /// initial values are neither made the same everywhere nor, under `full`, drawn.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: ModelConfig,
        device: Device,
        comm: &Comm,
        strategy: Sharding,
        hyper: AdamW,
        prefetch: bool,
        compute: tch::Kind,
        fresh: bool,
    ) -> Result<Self, C10dError> {
        if strategy == Sharding::Full {
            return Ok(Self::Full(FullShard::new(
                config, device, comm, hyper, prefetch, compute, fresh,
            )?));
        }
        let mut model = Model::new(config, device);
        // Same seed, same values on every rank; the broadcast makes it a fact, not a hope.
        for p in model.params.iter().filter(|_| fresh) {
            comm.broadcast(&mut p.detach(), 0)?;
        }
        let opt = FlatOptimizer::new(&mut model, comm, strategy, hyper, compute)?;
        Ok(Self::Flat { model, opt })
    }

    pub fn numel(&self) -> i64 {
        match self {
            Self::Flat { model, .. } => model.numel(),
            Self::Full(f) => f.numel(),
        }
    }

    /// What this rank holds, for the start-up log line.
    pub fn describe(&self) -> String {
        let mib = |b: i64| b as f64 / (1 << 20) as f64;
        match self {
            Self::Flat { opt, .. } => {
                format!("{:.1} MiB optimizer state per rank", mib(opt.state_bytes()))
            }
            Self::Full(f) => format!(
                "{:.1} MiB optimizer state per rank, {:.1} MiB of parameters per rank, largest unit {:.1} MiB whole",
                mib(f.state_bytes()),
                mib(f.param_bytes()),
                mib(f.largest_unit_bytes())
            ),
        }
    }

    /// Forward, backward and the optimizer step on this rank's batch; returns this rank's
    /// loss (detached). `before_update` runs before the optimizer changes any state (a
    /// checkpoint in flight may still be reading it).
    pub fn step(
        &mut self,
        comm: &Comm,
        (inputs, targets): (&Tensor, &Tensor),
        lr: f64,
        clip: f64,
        before_update: &mut dyn FnMut(),
    ) -> Result<Tensor, C10dError> {
        match self {
            Self::Flat { model, opt } => {
                let loss = model.loss(inputs, targets);
                loss.backward();
                before_update();
                opt.step(comm, lr, clip)?;
                Ok(loss.detach())
            }
            Self::Full(f) => Ok(f.step(comm, inputs, targets, lr, clip, before_update)?.0),
        }
    }

    /// Sets dropout for the next step or evaluation: `train` or not, and the seed its
    /// masks come from.
    pub fn set_dropout(&mut self, train: bool, seed: i64) {
        let d = match self {
            Self::Flat { model, .. } => &mut model.config.dropout,
            Self::Full(f) => f.dropout(),
        };
        d.train = train;
        d.seed = seed;
    }

    /// This rank's loss on a batch without training (a collective under `full`).
    pub fn eval_loss(
        &mut self,
        comm: &Comm,
        inputs: &Tensor,
        targets: &Tensor,
    ) -> Result<Tensor, C10dError> {
        match self {
            Self::Flat { model, .. } => Ok(tch::no_grad(|| model.loss(inputs, targets))),
            Self::Full(f) => f.eval_loss(comm, inputs, targets),
        }
    }

    pub fn adam_step(&self) -> u64 {
        match self {
            Self::Flat { opt, .. } => opt.adam_step,
            Self::Full(f) => f.adam_step,
        }
    }

    /// The whole state on the lead rank, for a checkpoint (a collective: every rank calls
    /// it).
    pub fn full_state(&self, comm: &Comm, lead: bool) -> Result<Option<FullState>, C10dError> {
        match self {
            Self::Flat { opt, .. } => {
                let s = opt.full_state(comm)?;
                Ok(lead.then_some(s))
            }
            Self::Full(f) => f.full_state(comm, lead),
        }
    }

    /// This rank's part of a sharded checkpoint, to be read in place (not a collective).
    pub fn live_state(&self, comm: &Comm) -> LiveState {
        match self {
            Self::Flat { opt, .. } => opt.live_state(comm.rank() as i64, comm.world() as i64),
            Self::Full(f) => f.live_state(),
        }
    }

    /// The `(flat offset, length)` runs [`Self::live_state`] gives rank `rank` of
    /// `world` (this engine's world): what that rank's snapshot holds.
    pub fn runs_of(&self, rank: usize, world: usize) -> Vec<(i64, i64)> {
        let pieces = match self {
            Self::Flat { opt, .. } => opt.pieces_of(rank as i64, world as i64),
            Self::Full(f) => f.pieces_of(rank as i64),
        };
        pieces.into_iter().map(|(f, _, n)| (f, n)).collect()
    }

    pub fn load(&mut self, state: &FullState, adam_step: u64) {
        match self {
            Self::Flat { opt, .. } => opt.load(state, adam_step),
            Self::Full(f) => f.load(state, adam_step),
        }
    }
}
