//! `full` sharding (FSDP / ZeRO-3): between steps a rank holds only its shard of every
//! unit's parameters, gradients and AdamW moments, 1/world of each; a unit (the
//! embedding, one decoder layer, or the final norm with the head) is whole only while it
//! computes.
//!
//! One step, as explicit code (tch has no module hooks; the model is ours):
//!
//! * forward, unit by unit without autograd: all-gather the unit, run it, free it; keep
//!   only each unit's output (activation checkpointing at unit boundaries);
//! * backward, last unit first: all-gather again, recompute the unit from its saved input
//!   with autograd, back-propagate the gradient coming from the unit above, reduce-scatter
//!   the unit's parameter gradient into the local gradient shard, free everything whole.
//!   The last unit's forward runs only here, with the loss, so it is gathered once;
//! * the global gradient norm from one all-reduce of the local squared norms, then AdamW
//!   on the local shards.
//!
//! With `prefetch`, the next unit's all-gather runs on Gloo's threads while the current
//! unit computes (two units whole at a time instead of one).

mod plan;

use std::cell::RefCell;
use std::rc::Rc;

use tch::{Device, Kind, Tensor};

use crate::c10d::{self, C10dError, Comm, Pending};
use crate::model::{self, ModelConfig, Rotary};
use crate::shard::{AdamW, FullState, LiveState};
use plan::{Unit, gather_order, local_len};

pub struct FullShard {
    config: ModelConfig,
    rotary: Rotary,
    plan: Vec<Unit>,
    shapes: Vec<Vec<i64>>,
    rank: i64,
    world: i64,
    device: Device,
    prefetch: bool,
    /// This rank's shard of every unit, back to back (`Unit::local_at`).
    params: Tensor,
    /// The reduced gradient for `params` (a sum over ranks).
    grads: Tensor,
    m: Tensor,
    v: Tensor,
    pub adam_step: u64,
    hyper: AdamW,
    /// The precision units are gathered and computed in (bf16 under `--bf16`); shards,
    /// gradients and moments stay fp32.
    compute: Kind,
    /// Unit-sized buffers kept from step to step (as FSDP2 keeps its): gathered units and
    /// unit gradients. Allocated afresh at every use they cost page faults and zeroing on
    /// every unit of every step; a buffer is back here only once nothing refers to it.
    buffers: Rc<RefCell<Vec<Tensor>>>,
}

impl FullShard {
    /// Initialises the model unit by unit from the current RNG state (the same draws, in
    /// the same order, as [`model::Model::new`], so the same seed gives the same model as
    /// `no_shard`), keeping only this rank's shard: no rank ever holds the whole model.
    /// Without `fresh` nothing is drawn: the shards stay zero until a state is loaded.
    pub fn new(
        config: ModelConfig,
        device: Device,
        comm: &Comm,
        hyper: AdamW,
        prefetch: bool,
        compute: Kind,
        fresh: bool,
    ) -> Result<Self, C10dError> {
        let (rank, world) = (comm.rank() as i64, comm.world() as i64);
        let layout = config.layout();
        let sizes: Vec<i64> = layout.iter().map(|(_, s)| s.iter().product()).collect();
        let plan = plan::plan(&sizes, &config.units(), world);
        let zeros = || Tensor::zeros([local_len(&plan)], (Kind::Float, device));
        let me = Self {
            rotary: Rotary::new(&config, device),
            shapes: layout.iter().map(|(_, s)| s.clone()).collect(),
            rank,
            world,
            device,
            prefetch,
            params: zeros(),
            grads: zeros(),
            m: zeros(),
            v: zeros(),
            adam_step: 0,
            hyper,
            plan,
            config,
            compute,
            buffers: Rc::default(),
        };
        if !fresh {
            return Ok(me);
        }
        tch::no_grad(|| {
            for unit in &me.plan {
                let mut whole = Tensor::zeros([unit.padded(world)], (Kind::Float, device));
                let mut at = 0;
                for i in unit.params.clone() {
                    let (name, shape) = &layout[i];
                    let t = model::init(&me.config, name, shape, device);
                    whole.narrow(0, at, sizes[i]).copy_(&t.reshape([-1]));
                    at += sizes[i];
                }
                // Same seed, same values on every rank; the broadcast makes it a fact.
                comm.broadcast(&mut whole, 0)?;
                me.local(&me.params, unit)
                    .copy_(&whole.narrow(0, rank * unit.shard, unit.shard));
            }
            Ok(())
        })?;
        Ok(me)
    }

    pub fn numel(&self) -> i64 {
        self.plan.iter().map(|u| u.numel).sum()
    }

    /// Bytes of optimizer state this rank holds (the gradient shard and both moments), as
    /// `FlatOptimizer::state_bytes` counts it.
    pub fn state_bytes(&self) -> i64 {
        3 * local_len(&self.plan) * 4
    }

    /// Bytes of parameters this rank holds between steps.
    pub fn param_bytes(&self) -> i64 {
        local_len(&self.plan) * 4
    }

    /// Bytes of the largest unit, whole.
    pub fn largest_unit_bytes(&self) -> i64 {
        self.plan
            .iter()
            .map(|u| u.padded(self.world))
            .max()
            .unwrap_or(0)
            * 4
    }

    fn local(&self, t: &Tensor, unit: &Unit) -> Tensor {
        t.narrow(0, unit.local_at, unit.shard)
    }

    /// The unit's parameters as views of its gathered flat vector.
    fn views(&self, unit: &Unit, whole: &Tensor) -> Vec<Tensor> {
        let mut at = 0;
        unit.params
            .clone()
            .map(|i| {
                let shape = &self.shapes[i];
                let n: i64 = shape.iter().product();
                let t = whole.narrow(0, at, n).view(shape.as_slice());
                at += n;
                t
            })
            .collect()
    }

    /// The unit's parameters as leaves of autograd that share `whole`'s memory, each with
    /// its `.grad` a view of the flat `grad`, so backward accumulates the unit's gradient
    /// in place in the layout the reduce-scatter takes. (Views of one leaf `whole` would
    /// give the same gradient, but each view's backward allocates a zero-filled copy of
    /// the whole unit.)
    fn leaves(&self, unit: &Unit, whole: &Tensor, grad: &Tensor) -> Result<Vec<Tensor>, C10dError> {
        let params = self.views(unit, whole);
        let grads = self.views(unit, grad);
        params
            .into_iter()
            .zip(grads)
            .map(|(p, mut g)| {
                let mut p = p.detach().set_requires_grad(true);
                c10d::set_grad(&mut p, &mut g)?;
                Ok(p)
            })
            .collect()
    }

    /// A buffer as large as the largest gathered unit, in the compute precision (from
    /// the kept ones when one is free).
    fn buffer(&self) -> Tensor {
        let kept = self.buffers.borrow_mut().pop();
        kept.unwrap_or_else(|| {
            let largest = self.plan.iter().map(|u| u.padded(self.world)).max();
            Tensor::empty([largest.unwrap_or(1)], (self.compute, self.device))
        })
    }

    /// Keeps `buffer` for a later use (nothing may refer to it any more).
    fn give_back(&self, buffer: Tensor) {
        self.buffers.borrow_mut().push(buffer);
    }

    /// Starts gathering unit `u` from every rank's shard of it into `buffer`.
    fn start_gather(&self, comm: &Comm, u: usize, buffer: &Tensor) -> Result<Pending, C10dError> {
        let unit = &self.plan[u];
        let out = buffer.narrow(0, 0, unit.padded(self.world));
        // Under --bf16 half the bytes travel: the shard is cast before the gather.
        comm.all_gather_start(out, self.local(&self.params, unit).to_kind(self.compute))
    }

    /// Runs a unit other than the last: the embedding takes `tokens`, a layer takes `x`.
    fn run(&self, u: usize, w: &[Tensor], tokens: &Tensor, x: &Tensor) -> Tensor {
        // The same masks in the recomputation as in the forward.
        self.config.dropout.seed_unit(u);
        if u == 0 {
            model::embed(&self.config, &w[0], tokens)
        } else {
            model::layer(&self.config, &self.rotary, w, x)
        }
    }

    /// Dropout's state for what follows: training or not, and the step's seed.
    pub fn dropout(&mut self) -> &mut model::Dropout {
        &mut self.config.dropout
    }

    /// This rank's loss on a batch without training: every unit gathered in turn and run
    /// without autograd (a collective: every rank calls it).
    pub fn eval_loss(
        &self,
        comm: &Comm,
        inputs: &Tensor,
        targets: &Tensor,
    ) -> Result<Tensor, C10dError> {
        let n = self.plan.len();
        let mut gathers = Gathers::new(self, (0..n).collect(), self.prefetch);
        let mut x = Tensor::new();
        for u in 0..n {
            let whole = gathers.next(self, comm)?;
            let w = self.views(&self.plan[u], &whole);
            x = tch::no_grad(|| {
                if u == n - 1 {
                    let logits = model::head(&self.config, &w, &x);
                    model::cross_entropy(&self.config, &logits, targets)
                } else {
                    self.run(u, &w, inputs, &x)
                }
            });
        }
        Ok(x)
    }

    /// One training step on this rank's batch: forward and backward unit by unit, the
    /// gradients reduce-scattered into the local shard, the global norm clipped to `clip`
    /// (0: off), AdamW at `lr` on the local shard, after `before_update`. Returns this
    /// rank's loss and the global gradient norm before clipping.
    pub fn step(
        &mut self,
        comm: &Comm,
        inputs: &Tensor,
        targets: &Tensor,
        lr: f64,
        clip: f64,
        before_update: &mut dyn FnMut(),
    ) -> Result<(Tensor, f64), C10dError> {
        let n = self.plan.len();
        let mut gathers = Gathers::new(self, gather_order(n), self.prefetch);
        // boundary[u]: the output of unit u, the input of unit u + 1.
        let mut boundary: Vec<Tensor> = Vec::with_capacity(n - 1);
        let none = Tensor::new();
        for u in 0..n - 1 {
            let whole = gathers.next(self, comm)?;
            let w = self.views(&self.plan[u], &whole);
            let x = tch::no_grad(|| self.run(u, &w, inputs, boundary.last().unwrap_or(&none)));
            boundary.push(x);
        }
        let mut loss = none.shallow_clone();
        let mut upstream = none.shallow_clone();
        for u in (0..n).rev() {
            let whole = gathers.next(self, comm)?;
            let unit = &self.plan[u];
            let grad_buffer = self.buffer();
            let mut grad = grad_buffer.narrow(0, 0, unit.padded(self.world));
            let _ = grad.zero_();
            let w = self.leaves(unit, &whole, &grad)?;
            let x = match boundary.pop() {
                Some(x) => x.detach().set_requires_grad(true),
                None => none.shallow_clone(),
            };
            if u == n - 1 {
                let logits = model::head(&self.config, &w, &x);
                let l = model::cross_entropy(&self.config, &logits, targets);
                l.backward();
                loss = l.detach();
            } else {
                let y = self.run(u, &w, inputs, &x);
                c10d::backward(&y, &upstream)?;
            }
            if u > 0 {
                upstream = x.grad();
            }
            // Reduced in fp32: bf16 sums over many ranks lose the small gradients.
            let mut grad = grad.to_kind(Kind::Float);
            comm.reduce_scatter_sum(&mut self.local(&self.grads, unit), &mut grad)?;
            // The unit's graph went with its backward; its leaves and views go here.
            drop((w, grad, whole));
            self.give_back(grad_buffer);
        }
        before_update();
        let norm = self.update(comm, lr, clip)?;
        Ok((loss, norm))
    }

    /// Clipping by the global norm and AdamW on the local shard.
    fn update(&mut self, comm: &Comm, lr: f64, clip: f64) -> Result<f64, C10dError> {
        let world = self.world as f64;
        // Gradients are sums over ranks; the mean's norm is the sum's over `world`.
        let mut sq = self.grads.norm().square().reshape([1]);
        comm.all_reduce_sum(&mut sq)?;
        let norm = sq.double_value(&[0]).sqrt() / world;
        let mut scale = 1.0 / world;
        if clip > 0.0 && norm > clip {
            scale *= clip / (norm + 1e-6);
        }
        self.adam_step += 1;
        self.hyper.update(
            self.adam_step,
            &self.params,
            &self.grads,
            &self.m,
            &self.v,
            scale,
            lr,
        );
        Ok(norm)
    }

    /// This rank's part of a sharded checkpoint: the real (unpadded) elements of its shard
    /// of every unit.
    pub fn live_state(&self) -> LiveState {
        LiveState::new(
            self.pieces_of(self.rank),
            &self.params,
            false,
            &self.m,
            &self.v,
        )
    }

    /// The pieces `(flat offset, local offset, length)` rank `rank` holds.
    pub fn pieces_of(&self, rank: i64) -> Vec<(i64, i64, i64)> {
        self.plan
            .iter()
            .filter_map(|unit| {
                let (start, len) = unit.owned(rank);
                (len > 0).then_some((unit.flat_at + start, unit.local_at, len))
            })
            .collect()
    }

    /// The whole state, world-size independent, on the lead rank (`None` elsewhere). Every
    /// rank must call it: it gathers unit by unit, so the other ranks never hold more
    /// than one unit; the lead holds the whole state it is about to save, in host memory
    /// (on a GPU, the model this sharding makes fit would not fit whole beside it).
    pub fn full_state(&self, comm: &Comm, lead: bool) -> Result<Option<FullState>, C10dError> {
        let total = self.numel();
        let mut out = Vec::new();
        for src in [&self.params, &self.m, &self.v] {
            let dst = lead.then(|| Tensor::zeros([total], (Kind::Float, Device::Cpu)));
            for unit in &self.plan {
                let mut whole =
                    Tensor::empty([unit.padded(self.world)], (Kind::Float, self.device));
                comm.all_gather(&mut whole, &mut self.local(src, unit))?;
                if let Some(d) = &dst {
                    d.narrow(0, unit.flat_at, unit.numel)
                        .copy_(&whole.narrow(0, 0, unit.numel));
                }
            }
            out.extend(dst);
        }
        let mut out = out.into_iter();
        Ok(match (out.next(), out.next(), out.next()) {
            (Some(params), Some(m), Some(v)) => Some(FullState { params, m, v }),
            _ => None,
        })
    }

    /// Takes this rank's shard of a whole state (saved with any world size and strategy).
    pub fn load(&mut self, state: &FullState, adam_step: u64) {
        tch::no_grad(|| {
            for (dst, src) in [
                (&self.params, &state.params),
                (&self.m, &state.m),
                (&self.v, &state.v),
            ] {
                for unit in &self.plan {
                    let (start, len) = unit.owned(self.rank);
                    let mut local = self.local(dst, unit);
                    let _ = local.zero_();
                    if len > 0 {
                        local
                            .narrow(0, 0, len)
                            .copy_(&src.narrow(0, unit.flat_at + start, len));
                    }
                }
            }
        });
        self.adam_step = adam_step;
    }
}

/// The step's all-gathers in [`gather_order`], with at most one in flight ahead of the
/// unit computing when prefetching. The buffer of the unit before goes back to the kept
/// ones when the next is asked for: by then nothing refers to it (a unit's forward keeps
/// only its output, its backward only its input's gradient).
struct Gathers {
    order: Vec<usize>,
    at: usize,
    current: Option<Tensor>,
    ahead: Option<(Pending, Tensor)>,
    prefetch: bool,
    buffers: Rc<RefCell<Vec<Tensor>>>,
}

impl Gathers {
    fn new(fsdp: &FullShard, order: Vec<usize>, prefetch: bool) -> Self {
        Self {
            order,
            at: 0,
            current: None,
            ahead: None,
            prefetch,
            buffers: fsdp.buffers.clone(),
        }
    }

    /// The next unit in the order, whole; with prefetch, the one after it is started
    /// before this returns, so it travels while this one computes.
    fn next(&mut self, fsdp: &FullShard, comm: &Comm) -> Result<Tensor, C10dError> {
        if let Some(done) = self.current.take() {
            fsdp.give_back(done);
        }
        let (pending, buffer) = match self.ahead.take() {
            Some(p) => p,
            None => {
                let buffer = fsdp.buffer();
                (
                    fsdp.start_gather(comm, self.order[self.at], &buffer)?,
                    buffer,
                )
            }
        };
        let whole = pending.wait()?;
        self.current = Some(buffer);
        self.at += 1;
        if self.prefetch && self.at < self.order.len() {
            let buffer = fsdp.buffer();
            let pending = fsdp.start_gather(comm, self.order[self.at], &buffer)?;
            self.ahead = Some((pending, buffer));
        }
        Ok(whole)
    }
}

impl Drop for Gathers {
    /// The last unit's buffer, and one gathered ahead (its gather waited for first).
    fn drop(&mut self) {
        let ahead = self.ahead.take().map(|(pending, buffer)| {
            drop(pending);
            buffer
        });
        self.buffers
            .borrow_mut()
            .extend(self.current.take().into_iter().chain(ahead));
    }
}
