//! Data-parallel gradient exchange and AdamW on a flat view of the parameters.
//!
//! * `no_shard`: the flat gradient is all-reduced; every rank updates every parameter and
//!   keeps the whole optimizer state (DDP).
//! * `shard_grad_op`: the flat gradient is reduce-scattered; rank r owns slice r of the
//!   flat vector, keeps AdamW state for that slice only, updates it, and the updated
//!   slices are all-gathered back into every rank's parameters (ZeRO-2). The optimizer
//!   state per rank shrinks by the world size.
//!
//! The flat vector is padded to a multiple of the world size so every slice is equal.

use tch::{Kind, Tensor};

use crate::args::Sharding;
use crate::c10d::{C10dError, Comm};
use crate::model::Model;

pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

pub struct FlatOptimizer {
    strategy: Sharding,
    total: i64,
    padded: i64,
    /// The flat range this rank updates: `start .. start + len`.
    start: i64,
    len: i64,
    /// fp32 master values of that range, and AdamW's moments for it.
    master: Tensor,
    m: Tensor,
    v: Tensor,
    /// AdamW's step counter (for bias correction).
    pub adam_step: u64,
    hyper: AdamW,
}

/// The whole optimizer state, world-size independent, as a checkpoint stores it.
pub struct FullState {
    pub params: Tensor,
    pub m: Tensor,
    pub v: Tensor,
}

fn flatten(ts: &[Tensor]) -> Tensor {
    let views: Vec<Tensor> = ts.iter().map(|t| t.detach().reshape([-1])).collect();
    Tensor::cat(&views, 0)
}

impl FlatOptimizer {
    pub fn new(model: &Model, comm: &Comm, strategy: Sharding, hyper: AdamW) -> Self {
        let total = model.numel();
        let world = comm.world() as i64;
        let padded = (total + world - 1) / world * world;
        let (start, len) = match strategy {
            Sharding::ShardGradOp => {
                let len = padded / world;
                (comm.rank() as i64 * len, len)
            }
            _ => (0, padded),
        };
        let device = model.params[0].device();
        let full = pad(&flatten(&model.params), padded);
        let master = full.narrow(0, start, len).copy();
        let zeros = || Tensor::zeros([len], (Kind::Float, device));
        Self {
            strategy,
            total,
            padded,
            start,
            len,
            master,
            m: zeros(),
            v: zeros(),
            adam_step: 0,
            hyper,
        }
    }

    /// Bytes of optimizer state (master copy and both moments) this rank holds.
    pub fn state_bytes(&self) -> i64 {
        3 * self.len * 4
    }

    /// Averages gradients over ranks, clips the global norm to `clip` (0: off), applies
    /// one AdamW step at `lr` and leaves every rank with the same updated parameters.
    /// Returns the global gradient norm before clipping.
    pub fn step(
        &mut self,
        model: &mut Model,
        comm: &Comm,
        lr: f64,
        clip: f64,
    ) -> Result<f64, C10dError> {
        let world = comm.world() as f64;
        let grads: Vec<Tensor> = model
            .params
            .iter()
            .map(|p| {
                let g = p.grad();
                if g.defined() { g } else { p.zeros_like() }
            })
            .collect();
        let mut flat = pad(&flatten(&grads), self.padded);
        let mut g = match self.strategy {
            Sharding::ShardGradOp => {
                let mut shard = Tensor::zeros([self.len], (Kind::Float, flat.device()));
                comm.reduce_scatter_sum(&mut shard, &mut flat)?;
                shard
            }
            _ => {
                comm.all_reduce_sum(&mut flat)?;
                flat
            }
        };
        g /= world;
        let mut sq = g.square().sum(Kind::Float);
        if self.strategy == Sharding::ShardGradOp {
            comm.all_reduce_sum(&mut sq)?;
        }
        let norm = sq.double_value(&[]).sqrt();
        if clip > 0.0 && norm > clip {
            g *= clip / (norm + 1e-6);
        }
        tch::no_grad(|| self.adamw(&g, lr));
        self.write_back(model, comm)?;
        for p in &mut model.params {
            p.zero_grad();
        }
        Ok(norm)
    }

    fn adamw(&mut self, g: &Tensor, lr: f64) {
        let h = &self.hyper;
        self.adam_step += 1;
        let t = self.adam_step as i32;
        self.m *= h.beta1;
        self.m += g * (1.0 - h.beta1);
        self.v *= h.beta2;
        self.v += g.square() * (1.0 - h.beta2);
        let m_hat = &self.m / (1.0 - h.beta1.powi(t));
        let v_hat = &self.v / (1.0 - h.beta2.powi(t));
        let update = m_hat / (v_hat.sqrt() + h.eps) + &self.master * h.weight_decay;
        self.master -= update * lr;
    }

    /// Copies the master values into the model, gathering the slices when sharded.
    fn write_back(&self, model: &mut Model, comm: &Comm) -> Result<(), C10dError> {
        let full = self.gather(comm, &self.master)?;
        tch::no_grad(|| {
            let mut off = 0;
            for p in &mut model.params {
                let n = p.numel() as i64;
                let src = full.narrow(0, off, n).view(p.size().as_slice());
                p.copy_(&src);
                off += n;
            }
        });
        Ok(())
    }

    /// This rank's range of `t` gathered into the whole padded vector.
    fn gather(&self, comm: &Comm, t: &Tensor) -> Result<Tensor, C10dError> {
        match self.strategy {
            Sharding::ShardGradOp => {
                let mut full = Tensor::zeros([self.padded], (Kind::Float, t.device()));
                let mut mine = t.copy();
                comm.all_gather(&mut full, &mut mine)?;
                Ok(full)
            }
            _ => Ok(t.shallow_clone()),
        }
    }

    /// The whole state (a collective when sharded: every rank must call it).
    pub fn full_state(&self, comm: &Comm) -> Result<FullState, C10dError> {
        let cut = |t: Tensor| t.narrow(0, 0, self.total).copy();
        Ok(FullState {
            params: cut(self.gather(comm, &self.master)?),
            m: cut(self.gather(comm, &self.m)?),
            v: cut(self.gather(comm, &self.v)?),
        })
    }

    /// Takes this rank's range of a whole state (saved with any world size) and writes
    /// the parameters into the model.
    pub fn load(
        &mut self,
        state: &FullState,
        adam_step: u64,
        model: &mut Model,
        comm: &Comm,
    ) -> Result<(), C10dError> {
        let take = |t: &Tensor| pad(t, self.padded).narrow(0, self.start, self.len).copy();
        self.master = take(&state.params);
        self.m = take(&state.m);
        self.v = take(&state.v);
        self.adam_step = adam_step;
        self.write_back(model, comm)
    }
}

/// `t` extended with zeros to `len` elements.
fn pad(t: &Tensor, len: i64) -> Tensor {
    let n = t.numel() as i64;
    if n == len {
        return t.shallow_clone();
    }
    Tensor::cat(
        &[t, &Tensor::zeros([len - n], (Kind::Float, t.device()))],
        0,
    )
}
