//! Data-parallel gradient exchange and AdamW on a flat view of the parameters.
//!
//! Every parameter is a view of one flat vector, and its `.grad` a view of one flat
//! gradient vector, so exchanging gradients and applying updates needs no copies.
//!
//! * `no_shard`: the flat gradient is all-reduced; every rank updates every parameter and
//!   keeps the whole optimizer state (DDP).
//! * `shard_grad_op`: the flat vector is cut into buckets of `world × BUCKET` elements;
//!   within each bucket rank r owns the r-th `BUCKET` slice. Each bucket's gradient is
//!   reduce-scattered, each rank updates only what it owns and keeps AdamW state only for
//!   that, and the updated slices are all-gathered back bucket by bucket (ZeRO-2). Buckets
//!   keep the collectives' temporary buffers small, so the saving in optimizer state is
//!   not eaten by one whole-vector copy inside Gloo.

use tch::{Device, Kind, Tensor};

use crate::args::Sharding;
use crate::c10d::{C10dError, Comm};
use crate::model::Model;

/// Elements per rank per bucket (1 MiB of f32).
const BUCKET: i64 = 1 << 18;
/// Elements per AdamW pass on the CPU, sized to stay in cache across its nine passes.
const CACHE_CHUNK: i64 = 1 << 15;
/// Elements per pass on a GPU: in CPU-sized chunks a 90 M-parameter model launched 27,000
/// kernels a step and trained at a fifth of its speed (scripts/gpu-check.sh on an H100:
/// 25 samples/s whatever the precision); in chunks this size a few launches, and the
/// pass's temporaries stay at a few 64 MiB vectors instead of the whole shard's size each.
const GPU_CHUNK: i64 = 1 << 24;

pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl AdamW {
    /// Step `t` (1-based, for bias correction) of AdamW on parameters `p` with gradient
    /// `g · scale` and moments `m`, `v`, all flat and of one length, in place (as
    /// torch.optim.AdamW's single-tensor path: decoupled decay first, then the
    /// bias-corrected Adam step). Done in chunks that stay in cache across the nine passes:
    /// on a whole vector at once it is memory-bound and about twice as slow as PyTorch's
    /// per-parameter loop.
    #[allow(
        clippy::too_many_arguments,
        reason = "one call site per strategy, all flat tensors"
    )]
    pub fn update(
        &self,
        t: u64,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        scale: f64,
        lr: f64,
    ) {
        let t = t as i32;
        let (bc1, bc2) = (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t));
        let len = p.numel() as i64;
        let chunk = if p.device() == tch::Device::Cpu {
            CACHE_CHUNK
        } else {
            GPU_CHUNK
        };
        let mut at = 0;
        tch::no_grad(|| {
            while at < len {
                let n = chunk.min(len - at);
                let g = g.narrow(0, at, n) * scale;
                let mut m = m.narrow(0, at, n);
                let mut v = v.narrow(0, at, n);
                let _ = m.lerp_(&g, 1.0 - self.beta1);
                let _ = v.lerp_(&g.square(), 1.0 - self.beta2);
                let mut denom = v.sqrt();
                let _ = denom.g_div_scalar_(bc2.sqrt());
                let _ = denom.g_add_scalar_(self.eps);
                let mut p = p.narrow(0, at, n);
                let _ = p.g_mul_scalar_(1.0 - lr * self.weight_decay);
                let _ = p.addcdiv_(&(&m * (-lr / bc1)), &denom);
                at += n;
            }
        });
    }
}

/// Which elements of the flat vector a rank owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    sharded: bool,
    world: i64,
    rank: i64,
    /// Elements per rank per bucket (`sharded`), or the whole padded length.
    slice: i64,
    buckets: i64,
}

impl Layout {
    fn new(total: i64, world: i64, rank: i64, sharded: bool) -> Self {
        if !sharded {
            return Self {
                sharded,
                world,
                rank,
                slice: total,
                buckets: 1,
            };
        }
        let per_rank = (total + world - 1) / world;
        let slice = per_rank.clamp(1, BUCKET);
        let buckets = (per_rank + slice - 1) / slice;
        Self {
            sharded,
            world,
            rank,
            slice,
            buckets,
        }
    }

    fn padded(&self) -> i64 {
        if self.sharded {
            self.buckets * self.world * self.slice
        } else {
            self.slice
        }
    }

    /// Elements this rank owns (and keeps optimizer state for).
    fn owned(&self) -> i64 {
        self.buckets * self.slice
    }

    /// `(offset in the flat vector, offset in the owned state, length)` of every owned run.
    fn runs(&self) -> impl Iterator<Item = (i64, i64, i64)> + '_ {
        (0..self.buckets).map(move |b| {
            let flat = if self.sharded {
                b * self.world * self.slice + self.rank * self.slice
            } else {
                0
            };
            (flat, b * self.slice, self.slice)
        })
    }

    /// The span of bucket `b` in the flat vector.
    fn bucket(&self, b: i64) -> (i64, i64) {
        (b * self.world * self.slice, self.world * self.slice)
    }
}

pub struct FlatOptimizer {
    layout: Layout,
    total: i64,
    /// The flat gradient (padded); every parameter's `.grad` is a view of it.
    grads: Tensor,
    /// This rank's owned part of the reduced gradient (`shard_grad_op`; empty otherwise).
    shard: Tensor,
    /// The model's parameters live in this padded vector: every parameter tensor is a view
    /// of it, so updating it updates the model without a copy.
    flat: Tensor,
    /// AdamW's moments for the owned elements.
    m: Tensor,
    v: Tensor,
    /// AdamW's step counter (for bias correction).
    pub adam_step: u64,
    hyper: AdamW,
    /// Under `--bf16`: the bf16 copy of `flat` the model computes with (its parameters are
    /// views of it) and the bf16 gradient they accumulate into; `flat` and `grads` stay the
    /// fp32 master weights and the fp32 gradient that is reduced.
    half: Option<(Tensor, Tensor)>,
}

/// `(offset, length)` runs of a 1-D tensor.
pub type Runs = Vec<(i64, i64)>;

/// What one rank writes of a sharded checkpoint: the elements it holds, read in place.
pub struct LiveState {
    /// `(flat offset, offset in the local tensors, length)`: where each run of this rank's
    /// elements goes in the whole flat order and where it is held.
    pub pieces: Vec<(i64, i64, i64)>,
    /// The live tensors (shallow clones): the writer reads them in place, and the next
    /// optimizer update waits for it ([`crate::saver::Saver::fence`]).
    pub params: Tensor,
    /// `params` is indexed by flat offsets (it holds the whole model) rather than local ones.
    pub params_flat: bool,
    pub m: Tensor,
    pub v: Tensor,
}

impl LiveState {
    pub fn new(
        pieces: Vec<(i64, i64, i64)>,
        params: &Tensor,
        params_flat: bool,
        m: &Tensor,
        v: &Tensor,
    ) -> Self {
        Self {
            pieces,
            params: params.shallow_clone(),
            params_flat,
            m: m.shallow_clone(),
            v: v.shallow_clone(),
        }
    }

    /// `(flat offset, length)` of each run.
    pub fn runs(&self) -> Runs {
        self.pieces.iter().map(|&(f, _, n)| (f, n)).collect()
    }

    /// `(offset, length)` of each run in `params`, then in `m` and `v`.
    pub fn offsets(&self) -> (Runs, Runs) {
        let local: Runs = self.pieces.iter().map(|&(_, l, n)| (l, n)).collect();
        let params = if self.params_flat {
            self.runs()
        } else {
            local.clone()
        };
        (params, local)
    }

    /// A copy in host memory of what this rank writes, its runs laid end to end. On a GPU
    /// the writer reads this instead of the live tensors: training then waits for one
    /// device-to-host copy (as PyTorch's async checkpoint stages its state dict in host
    /// memory), not for the disk, and no device memory is taken for it (host memory of
    /// the shard's size is).
    pub fn to_host(&self) -> LiveState {
        let (in_params, in_moments) = self.offsets();
        let total: i64 = self.pieces.iter().map(|&(_, _, n)| n).sum();
        let stage = |t: &Tensor, runs: &Runs| {
            // Page-locked memory takes the copy at the bus's speed: the copy holds the GPU's
            // stream (training's kernels wait behind it) for tens of milliseconds a GB
            // rather than a second. PyTorch's host allocator keeps it for the next save.
            // (tch makes no empty page-locked tensor; one grown by `resize_` from a
            // page-locked one behaved as pageable on an H100: its copy stalled training.)
            let host = Tensor::empty([total], (t.kind(), tch::Device::Cpu));
            let host = match t.device() {
                tch::Device::Cuda(_) => host.f_pin_memory(t.device()).unwrap_or(host),
                _ => host,
            };
            let mut at = 0;
            tch::no_grad(|| {
                for &(offset, n) in runs {
                    host.narrow(0, at, n).copy_(&t.narrow(0, offset, n));
                    at += n;
                }
            });
            host
        };
        let mut at = 0;
        let pieces = self
            .pieces
            .iter()
            .map(|&(flat, _, n)| {
                at += n;
                (flat, at - n, n)
            })
            .collect();
        LiveState {
            pieces,
            params: stage(&self.params, &in_params),
            params_flat: false,
            m: stage(&self.m, &in_moments),
            v: stage(&self.v, &in_moments),
        }
    }

    /// Whether the tensors live on the host.
    pub fn on_host(&self) -> bool {
        self.params.device() == tch::Device::Cpu
    }
}

/// The whole optimizer state, world-size independent, as a checkpoint stores it.
pub struct FullState {
    pub params: Tensor,
    pub m: Tensor,
    pub v: Tensor,
}

/// A whole state filled from parts that each hold runs of it (a checkpoint's shards,
/// peer-memory snapshots): every run is checked to fit, and the parts to cover the model.
pub struct Assembly {
    state: FullState,
    total: i64,
    covered: i64,
}

impl Assembly {
    /// An empty state of `total` elements per tensor, on the host.
    pub fn new(total: i64) -> Self {
        let zeros = || Tensor::zeros([total], (Kind::Float, Device::Cpu));
        Self {
            state: FullState {
                params: zeros(),
                m: zeros(),
                v: zeros(),
            },
            total,
            covered: 0,
        }
    }

    /// Copies one part: `runs` of `(flat offset, length)`, whose elements follow one
    /// another in each of `parts` (its parameters, m and v). `Err` when a run falls
    /// outside the model or the part.
    pub fn add(
        &mut self,
        runs: impl IntoIterator<Item = (i64, i64)>,
        parts: [&Tensor; 3],
    ) -> Result<(), &'static str> {
        let held = parts.iter().map(|t| t.numel() as i64).min().unwrap_or(0);
        let mut at = 0;
        for (flat, n) in runs {
            if flat < 0 || n < 0 || flat + n > self.total || at + n > held {
                return Err("its runs do not fit the model");
            }
            let whole = [&self.state.params, &self.state.m, &self.state.v];
            for (dst, src) in whole.into_iter().zip(parts) {
                dst.narrow(0, flat, n).copy_(&src.narrow(0, at, n));
            }
            at += n;
            self.covered += n;
        }
        Ok(())
    }

    /// The state, once the parts cover the model; else `(covered, total)` elements.
    pub fn finish(self) -> Result<FullState, (i64, i64)> {
        if self.covered == self.total {
            Ok(self.state)
        } else {
            Err((self.covered, self.total))
        }
    }
}

impl FlatOptimizer {
    /// Moves the model's parameters into one flat buffer (each parameter becomes a view of
    /// it) and sets up this rank's share of the optimizer state.
    pub fn new(
        model: &mut Model,
        comm: &Comm,
        strategy: Sharding,
        hyper: AdamW,
        compute: Kind,
    ) -> Result<Self, C10dError> {
        let total = model.numel();
        let layout = Layout::new(
            total,
            comm.world() as i64,
            comm.rank() as i64,
            strategy == Sharding::ShardGradOp,
        );
        let device = model.params[0].device();
        let zeros = |n: i64| Tensor::zeros([n], (Kind::Float, device));
        // Parameters move into the flat buffer one by one, and the originals are dropped
        // before anything else is allocated: the peak of this set-up counts in VmHWM too.
        let flat = zeros(layout.padded());
        let mut off = 0;
        tch::no_grad(|| {
            for p in &mut model.params {
                let n = p.numel() as i64;
                let shape = p.size();
                flat.narrow(0, off, n).copy_(&p.reshape([-1]));
                *p = flat.narrow(0, off, n).view(shape.as_slice());
                off += n;
            }
        });
        let half = (compute != Kind::Float).then(|| {
            (
                flat.to_kind(compute),
                Tensor::zeros([layout.padded()], (compute, device)),
            )
        });
        let me = Self {
            layout,
            total,
            grads: zeros(layout.padded()),
            shard: zeros(if layout.sharded { layout.owned() } else { 0 }),
            flat,
            m: zeros(layout.owned()),
            v: zeros(layout.owned()),
            adam_step: 0,
            hyper,
            half,
        };
        me.bind(model)?;
        Ok(me)
    }

    /// Makes every model parameter a view of the flat buffer, and its gradient a view of
    /// the flat gradient (of their bf16 copies under `--bf16`).
    fn bind(&self, model: &mut Model) -> Result<(), C10dError> {
        let (flat, grads) = match &self.half {
            Some((flat, grads)) => (flat, grads),
            None => (&self.flat, &self.grads),
        };
        let mut off = 0;
        for p in &mut model.params {
            let n = p.numel() as i64;
            let shape = p.size();
            let mut view = flat
                .narrow(0, off, n)
                .view(shape.as_slice())
                .set_requires_grad(true);
            let mut grad = grads.narrow(0, off, n).view(shape.as_slice());
            crate::c10d::set_grad(&mut view, &mut grad)?;
            *p = view;
            off += n;
        }
        Ok(())
    }

    /// Bytes of optimizer state this rank holds: both moments, plus the gradient shard
    /// when sharded.
    pub fn state_bytes(&self) -> i64 {
        (2 * self.layout.owned() + self.shard.numel() as i64) * 4
    }

    /// Averages gradients over ranks, clips the global norm to `clip` (0: off), applies
    /// one AdamW step at `lr` and leaves every rank with the same updated parameters.
    /// Returns the global gradient norm before clipping.
    pub fn step(&mut self, comm: &Comm, lr: f64, clip: f64) -> Result<f64, C10dError> {
        let world = comm.world() as f64;
        let l = self.layout;
        if let Some((_, half_grads)) = &self.half {
            // Reduced in fp32: bf16 sums over many ranks lose the small gradients.
            let mut half_grads = half_grads.shallow_clone();
            tch::no_grad(|| {
                self.grads.copy_(&half_grads);
                let _ = half_grads.zero_();
            });
        }
        let g = if l.sharded {
            for b in 0..l.buckets {
                let (at, n) = l.bucket(b);
                let mut out = self.shard.narrow(0, b * l.slice, l.slice);
                comm.reduce_scatter_sum(&mut out, &mut self.grads.narrow(0, at, n))?;
            }
            self.shard.shallow_clone()
        } else {
            comm.all_reduce_sum(&mut self.grads)?;
            self.grads.shallow_clone()
        };
        // Gradients are sums over ranks here; the mean's norm is the sum's over `world`.
        let mut sq = g.norm().square();
        if l.sharded {
            comm.all_reduce_sum(&mut sq)?;
        }
        let norm = sq.double_value(&[]).sqrt() / world;
        let mut scale = 1.0 / world;
        if clip > 0.0 && norm > clip {
            scale *= clip / (norm + 1e-6);
        }
        tch::no_grad(|| self.adamw(&g, scale, lr));
        self.gather_params(comm)?;
        let _ = self.grads.zero_();
        self.refresh_half();
        Ok(norm)
    }

    /// The bf16 copy the model computes with, from the master weights.
    fn refresh_half(&mut self) {
        if let Some((half, _)) = &mut self.half {
            tch::no_grad(|| half.copy_(&self.flat));
        }
    }

    /// AdamW on the owned elements, in place.
    fn adamw(&mut self, g: &Tensor, scale: f64, lr: f64) {
        self.adam_step += 1;
        for (flat_at, own_at, len) in self.layout.runs() {
            self.hyper.update(
                self.adam_step,
                &self.flat.narrow(0, flat_at, len),
                &g.narrow(0, own_at, len),
                &self.m.narrow(0, own_at, len),
                &self.v.narrow(0, own_at, len),
                scale,
                lr,
            );
        }
    }

    /// When sharded, every rank's updated slices are gathered into every rank's
    /// parameters. The gradient shard is spent by now; its buffer carries the slices (the
    /// input of an all-gather must not alias its output).
    fn gather_params(&mut self, comm: &Comm) -> Result<(), C10dError> {
        let l = self.layout;
        if !l.sharded {
            return Ok(());
        }
        tch::no_grad(|| {
            for (b, (flat_at, own_at, len)) in l.runs().enumerate() {
                let mut send = self.shard.narrow(0, own_at, len);
                send.copy_(&self.flat.narrow(0, flat_at, len));
                let (at, n) = l.bucket(b as i64);
                comm.all_gather(&mut self.flat.narrow(0, at, n), &mut send)?;
            }
            Ok(())
        })
    }

    /// Owned state `t` laid out in the whole flat order (a collective when sharded).
    fn gather(&self, comm: &Comm, t: &Tensor) -> Result<Tensor, C10dError> {
        let l = self.layout;
        if !l.sharded {
            return Ok(t.shallow_clone());
        }
        let full = Tensor::zeros([l.padded()], (Kind::Float, t.device()));
        for (b, (_, own_at, len)) in l.runs().enumerate() {
            let (at, n) = l.bucket(b as i64);
            let mut mine = t.narrow(0, own_at, len).copy();
            comm.all_gather(&mut full.narrow(0, at, n), &mut mine)?;
        }
        Ok(full)
    }

    /// This rank's part of a sharded checkpoint: what it owns under `shard_grad_op`; an
    /// even 1/world slice under `no_shard`, where every rank holds everything, so that the
    /// ranks write in parallel.
    pub fn live_state(&self, rank: i64, world: i64) -> LiveState {
        LiveState::new(
            self.pieces_of(rank, world),
            &self.flat,
            true,
            &self.m,
            &self.v,
        )
    }

    /// The pieces `(flat offset, local offset, length)` [`Self::live_state`] gives rank
    /// `rank` of `world`: the same arithmetic, for any rank.
    pub fn pieces_of(&self, rank: i64, world: i64) -> Vec<(i64, i64, i64)> {
        let total = self.total;
        if self.layout.sharded {
            Layout::new(total, world, rank, true)
                .runs()
                .filter(|&(flat_at, _, _)| flat_at < total)
                .map(|(flat_at, own_at, len)| (flat_at, own_at, len.min(total - flat_at)))
                .collect()
        } else {
            let per = (total + world - 1) / world;
            let start = (rank * per).min(total);
            let len = per.min(total - start);
            if len > 0 {
                vec![(start, start, len)]
            } else {
                Vec::new()
            }
        }
    }

    /// The whole state (a collective when sharded: every rank must call it).
    pub fn full_state(&self, comm: &Comm) -> Result<FullState, C10dError> {
        let cut = |t: Tensor| host_copy(&t.narrow(0, 0, self.total));
        Ok(FullState {
            params: cut(self.flat.shallow_clone()),
            m: cut(self.gather(comm, &self.m)?),
            v: cut(self.gather(comm, &self.v)?),
        })
    }

    /// Takes this rank's part of a whole state (saved with any world size).
    pub fn load(&mut self, state: &FullState, adam_step: u64) {
        let padded = self.layout.padded();
        let (m, v) = (pad(&state.m, padded), pad(&state.v, padded));
        tch::no_grad(|| {
            for (flat_at, own_at, len) in self.layout.runs() {
                self.m
                    .narrow(0, own_at, len)
                    .copy_(&m.narrow(0, flat_at, len));
                self.v
                    .narrow(0, own_at, len)
                    .copy_(&v.narrow(0, flat_at, len));
            }
            self.flat.copy_(&pad(&state.params, padded));
        });
        self.refresh_half();
        self.adam_step = adam_step;
    }
}

/// An owned copy of `t` in host memory. A checkpoint is written from the host anyway;
/// kept there, it loads on any device (a GPU run's checkpoint resumes on CPU), and the
/// saved copy takes no GPU memory.
fn host_copy(t: &Tensor) -> Tensor {
    if t.device() == tch::Device::Cpu {
        t.copy()
    } else {
        t.to_device(tch::Device::Cpu)
    }
}

/// `t` extended with zeros to `len` elements.
pub(crate) fn pad(t: &Tensor, len: i64) -> Tensor {
    let n = t.numel() as i64;
    if n == len {
        return t.shallow_clone();
    }
    Tensor::cat(
        &[t, &Tensor::zeros([len - n], (Kind::Float, t.device()))],
        0,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_runs_of_all_ranks_tile_the_padded_vector_once() {
        for (total, world) in [(10, 3), (1 << 20, 2), ((1 << 20) + 7, 4), (5, 8)] {
            let mut seen = vec![0u8; Layout::new(total, world, 0, true).padded() as usize];
            for rank in 0..world {
                let l = Layout::new(total, world, rank, true);
                assert!(l.padded() >= total);
                for (flat, _, len) in l.runs() {
                    for i in flat..flat + len {
                        seen[i as usize] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "total {total} world {world}");
        }
        let l = Layout::new(100, 4, 2, false);
        assert_eq!((l.padded(), l.owned()), (100, 100));
    }
}
