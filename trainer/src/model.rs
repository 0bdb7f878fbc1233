//! The Llama-style decoder: token embedding, RMSNorm, rotary attention with grouped KV
//! heads, SwiGLU MLP, an untied output head. Parameters are plain tensors in a fixed
//! order, so the sharding code can treat them as one flat vector; the forward pass is
//! written unit by unit (embedding, each decoder layer, final norm and head), so `full`
//! sharding can gather, run and free one unit at a time.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::args::{Args, ModelType};

/// The model's shape; a checkpoint records it and refuses to load into another. What only
/// training uses (dropout, the initial weights' spread) is not part of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub hidden_width: i64,
    pub num_layers: i64,
    pub num_heads: i64,
    pub num_key_value_heads: i64,
    pub intermediate_size: i64,
    pub max_context_width: i64,
    pub vocab_size: i64,
    pub rotary_emb_base: f64,
    /// Checkpoints from before these fields read as Llama 2, whole heads rotated, no
    /// window: what they were.
    #[serde(default)]
    pub model_type: ModelType,
    /// The dimensions of each head that rotary embeddings rotate (`None`: all).
    #[serde(default)]
    pub rotary_dim: Option<i64>,
    /// Each token attends to at most this many (itself included).
    #[serde(default)]
    pub sliding_window: Option<i64>,
    #[serde(skip, default = "default_init_std")]
    pub init_std: f64,
    #[serde(skip)]
    pub dropout: Dropout,
}

fn default_init_std() -> f64 {
    0.02
}

/// Dropout probabilities, whether they apply now (training, not validation), and the
/// step's seed: each unit draws its masks from a generator seeded by the step's seed and
/// the unit, so `full` sharding's recomputation draws the same masks as its forward, and
/// every strategy the same as `no_shard`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Dropout {
    pub embd: f64,
    pub resid: f64,
    pub attn: f64,
    pub train: bool,
    pub seed: i64,
}

impl Dropout {
    fn active(&self) -> bool {
        self.train && (self.embd > 0.0 || self.resid > 0.0 || self.attn > 0.0)
    }

    fn p(&self, p: f64) -> f64 {
        if self.train { p } else { 0.0 }
    }

    /// Seeds the generator for unit `unit` of this step (when any dropout applies).
    pub fn seed_unit(&self, unit: usize) {
        if self.active() {
            let mixed = crate::data::mix(self.seed as u64 ^ crate::data::mix(unit as u64));
            tch::manual_seed((mixed >> 1) as i64);
        }
    }
}

impl ModelConfig {
    pub fn from_args(a: &Args) -> Self {
        Self {
            hidden_width: a.hidden_width,
            num_layers: a.num_layers,
            num_heads: a.num_heads,
            num_key_value_heads: a.num_key_value_heads,
            intermediate_size: a.intermediate_size,
            max_context_width: a.max_context_width,
            vocab_size: a.vocab(),
            rotary_emb_base: a.rotary_emb_base,
            model_type: a.model_type,
            rotary_dim: (a.rotary_dim() < a.hidden_width / a.num_heads).then(|| a.rotary_dim()),
            sliding_window: a.window(),
            init_std: a.initializer_range,
            dropout: Dropout {
                embd: a.embd_pdrop,
                resid: a.resid_pdrop,
                attn: a.attn_pdrop,
                train: true,
                seed: a.seed,
            },
        }
    }

    fn rotary_dim(&self) -> i64 {
        self.rotary_dim.unwrap_or_else(|| self.head_dim())
    }

    fn head_dim(&self) -> i64 {
        self.hidden_width / self.num_heads
    }

    /// Names and shapes of every parameter, in the flat order.
    pub fn layout(&self) -> Vec<(String, Vec<i64>)> {
        let (h, kv) = (
            self.hidden_width,
            self.num_key_value_heads * self.head_dim(),
        );
        let mut out = vec![("embed".to_owned(), vec![self.vocab_size, h])];
        for l in 0..self.num_layers {
            let p = |n: &str| format!("layers.{l}.{n}");
            out.extend([
                (p("attn_norm"), vec![h]),
                (p("wq"), vec![h, h]),
                (p("wk"), vec![kv, h]),
                (p("wv"), vec![kv, h]),
                (p("wo"), vec![h, h]),
                (p("mlp_norm"), vec![h]),
                (p("w_gate"), vec![self.intermediate_size, h]),
                (p("w_up"), vec![self.intermediate_size, h]),
                (p("w_down"), vec![h, self.intermediate_size]),
            ]);
        }
        out.push(("final_norm".to_owned(), vec![h]));
        out.push(("lm_head".to_owned(), vec![self.vocab_size, h]));
        out
    }

    /// The units `full` sharding gathers one at a time, as ranges of [`Self::layout`]
    /// indices: the embedding, each decoder layer, then the final norm with the head.
    pub fn units(&self) -> Vec<Range<usize>> {
        let n = 1 + 9 * self.num_layers as usize + 2;
        let mut out = Vec::with_capacity(self.num_layers as usize + 2);
        out.push(0..1);
        out.extend((0..self.num_layers as usize).map(|l| 1 + 9 * l..1 + 9 * (l + 1)));
        out.push(n - 2..n);
        out
    }

    /// Differences from `other`, as `name: ours vs theirs`.
    pub fn differences(&self, other: &Self) -> Vec<String> {
        let a = serde_json::to_value(self).unwrap_or_default();
        let b = serde_json::to_value(other).unwrap_or_default();
        let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
            return vec!["unreadable model config".into()];
        };
        a.iter()
            .filter(|(k, v)| b.get(*k) != Some(v))
            .map(|(k, v)| {
                format!(
                    "{k}: {v} here vs {} in the checkpoint",
                    b.get(k).cloned().unwrap_or_default()
                )
            })
            .collect()
    }
}

pub struct Model {
    pub config: ModelConfig,
    /// In [`ModelConfig::layout`] order.
    pub params: Vec<Tensor>,
    cos: Tensor,
    sin: Tensor,
}

impl Model {
    /// Initialises from the current RNG state (seed it first: every rank must agree).
    pub fn new(config: ModelConfig, device: Device) -> Self {
        let params = config
            .layout()
            .iter()
            .map(|(name, shape)| init(&config, name, shape, device).set_requires_grad(true))
            .collect();
        let (cos, sin) = rotary_tables(&config, device);
        Self {
            config,
            params,
            cos,
            sin,
        }
    }

    pub fn numel(&self) -> i64 {
        self.params.iter().map(|p| p.numel() as i64).sum()
    }

    /// Mean next-token cross-entropy of `tokens[:, 1:]` given `tokens[:, :-1]`.
    pub fn loss(&self, inputs: &Tensor, targets: &Tensor) -> Tensor {
        cross_entropy(&self.config, &self.forward(inputs), targets)
    }

    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        let c = &self.config;
        let p = &self.params;
        let rotary = Rotary {
            cos: self.cos.shallow_clone(),
            sin: self.sin.shallow_clone(),
        };
        c.dropout.seed_unit(0);
        let mut x = embed(c, &p[0], tokens);
        for (u, unit) in c.units()[1..=c.num_layers as usize].iter().enumerate() {
            c.dropout.seed_unit(u + 1);
            x = layer(c, &rotary, &p[unit.clone()], &x);
        }
        let n = p.len();
        head(c, &p[n - 2..], &x)
    }
}

/// One parameter's initial value, drawn from the current RNG state: ranks that draw the
/// parameters in layout order from the same seed get the same model, whole or unit by unit.
pub fn init(c: &ModelConfig, name: &str, shape: &[i64], device: Device) -> Tensor {
    if name.ends_with("norm") {
        Tensor::ones(shape, (Kind::Float, device))
    } else {
        Tensor::randn(shape, (Kind::Float, device)) * c.init_std
    }
}

/// The rotary tables a decoder layer needs.
pub struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    pub fn new(c: &ModelConfig, device: Device) -> Self {
        let (cos, sin) = rotary_tables(c, device);
        Self { cos, sin }
    }
}

/// The embedding unit: token ids to `[batch, time, hidden]`.
pub fn embed(c: &ModelConfig, weight: &Tensor, tokens: &Tensor) -> Tensor {
    let x = Tensor::embedding(weight, tokens, -1, false, false);
    dropout(&x, c.dropout.p(c.dropout.embd))
}

fn dropout(x: &Tensor, p: f64) -> Tensor {
    if p > 0.0 {
        x.dropout(p, true)
    } else {
        x.shallow_clone()
    }
}

/// Which keys each query may see: causal, and within the window when there is one
/// (`None`: plain causal attention, which SDPA does without a mask).
fn attention_mask(c: &ModelConfig, t: i64, device: Device) -> Option<Tensor> {
    let w = c.sliding_window.filter(|&w| w < t)?;
    let i = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(1);
    let j = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(0);
    let back = &i - &j;
    Some(back.ge(0).logical_and(&back.lt(w)))
}

const EPS: f64 = 1e-5;

fn norm(c: &ModelConfig, x: &Tensor, w: &Tensor) -> Tensor {
    x.rms_norm([c.hidden_width], Some(w), EPS)
}

/// One decoder layer, `w` its nine parameters in layout order. (No `+=` on tensors: tch's
/// is an in-place add, which would clobber a value autograd still needs.)
pub fn layer(c: &ModelConfig, rotary: &Rotary, w: &[Tensor], x: &Tensor) -> Tensor {
    let (b, t) = (x.size()[0], x.size()[1]);
    let (nh, nkv, hd) = (c.num_heads, c.num_key_value_heads, c.head_dim());
    // In the activations' precision (bf16 under --bf16), or the products would be fp32.
    let cos = rotary.cos.narrow(0, 0, t).to_kind(x.kind());
    let sin = rotary.sin.narrow(0, 0, t).to_kind(x.kind());
    let h = norm(c, x, &w[0]);
    let heads = |wt: &Tensor, n: i64| {
        h.linear::<Tensor>(wt, None)
            .view([b, t, n, hd])
            .transpose(1, 2)
    };
    let q = rotate(&heads(&w[1], nh), &cos, &sin);
    let k = rotate(&heads(&w[2], nkv), &cos, &sin);
    let v = heads(&w[3], nkv);
    let mask = attention_mask(c, t, x.device());
    let att = Tensor::scaled_dot_product_attention(
        &q,
        &k,
        &v,
        mask.as_ref(),
        c.dropout.p(c.dropout.attn),
        mask.is_none(),
        None,
        nkv != nh,
    );
    let att = att.transpose(1, 2).reshape([b, t, c.hidden_width]);
    let resid = c.dropout.p(c.dropout.resid);
    let x = x + dropout(&att.linear::<Tensor>(&w[4], None), resid);
    let h = norm(c, &x, &w[5]);
    let gate = h.linear::<Tensor>(&w[6], None).silu();
    let up = h.linear::<Tensor>(&w[7], None);
    x + dropout(&(gate * up).linear::<Tensor>(&w[8], None), resid)
}

/// The last unit: final norm (`w[0]`) and output head (`w[1]`), to logits.
pub fn head(c: &ModelConfig, w: &[Tensor], x: &Tensor) -> Tensor {
    norm(c, x, &w[0]).linear::<Tensor>(&w[1], None)
}

/// Mean next-token cross-entropy of `logits` against `targets`.
pub fn cross_entropy(c: &ModelConfig, logits: &Tensor, targets: &Tensor) -> Tensor {
    // The softmax over the vocabulary in fp32 whatever the compute precision, as mixed
    // precision training does.
    logits
        .to_kind(Kind::Float)
        .view([-1, c.vocab_size])
        .cross_entropy_loss::<Tensor>(
            &targets.reshape([-1]),
            None,
            tch::Reduction::Mean,
            -100,
            0.0,
        )
}

/// cos and sin of position × frequency, `[max_context, rotary_dim]`, halves repeated.
fn rotary_tables(c: &ModelConfig, device: Device) -> (Tensor, Tensor) {
    let hd = c.rotary_dim();
    let inv_freq = (Tensor::arange_start_step(0, hd, 2, (Kind::Float, device)) / hd as f64)
        .multiply_scalar(-c.rotary_emb_base.ln())
        .exp();
    let pos = Tensor::arange(c.max_context_width, (Kind::Float, device));
    let freqs = pos.outer(&inv_freq);
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    (emb.cos(), emb.sin())
}

/// Rotary position embedding, "rotate half" form: `x·cos + rot(x)·sin` on the first
/// `cos`-width dimensions of each head; the rest pass through (`--rotary_pct`).
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (head, rd) = (x.size()[3], cos.size()[1]);
    let (r, pass) = if rd < head {
        (x.narrow(3, 0, rd), Some(x.narrow(3, rd, head - rd)))
    } else {
        (x.shallow_clone(), None)
    };
    let half = rd / 2;
    let x1 = r.narrow(3, 0, half);
    let x2 = r.narrow(3, half, half);
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    let out = &r * cos + rotated * sin;
    match pass {
        Some(p) => Tensor::cat(&[&out, &p], -1),
        None => out,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(layers: i64) -> ModelConfig {
        ModelConfig {
            hidden_width: 8,
            num_layers: layers,
            num_heads: 2,
            num_key_value_heads: 1,
            intermediate_size: 12,
            max_context_width: 4,
            vocab_size: 16,
            rotary_emb_base: 10000.0,
            model_type: ModelType::LlamaV2,
            rotary_dim: None,
            sliding_window: None,
            init_std: 0.02,
            dropout: Dropout::default(),
        }
    }

    #[test]
    fn a_sliding_window_keeps_each_query_to_its_last_tokens() {
        let mut c = config(1);
        c.sliding_window = Some(2);
        let m = attention_mask(&c, 4, Device::Cpu).unwrap();
        let rows: Vec<Vec<bool>> = (0..4)
            .map(|i| (0..4).map(|j| m.int64_value(&[i, j]) != 0).collect())
            .collect();
        assert_eq!(
            rows,
            [
                [true, false, false, false],
                [true, true, false, false],
                [false, true, true, false],
                [false, false, true, true]
            ]
        );
        // A window as wide as the context is plain causal attention.
        c.sliding_window = Some(4);
        assert!(attention_mask(&c, 4, Device::Cpu).is_none());
    }

    #[test]
    fn partial_rotary_leaves_the_rest_of_each_head_alone() {
        let mut c = config(1);
        c.hidden_width = 16;
        c.rotary_dim = Some(4);
        let (cos, sin) = rotary_tables(&c, Device::Cpu);
        assert_eq!(cos.size(), [4, 4]);
        let x = Tensor::randn([1, 2, 4, 8], (Kind::Float, Device::Cpu));
        let y = rotate(&x, &cos.narrow(0, 0, 4), &sin.narrow(0, 0, 4));
        assert_eq!(y.size(), x.size());
        assert!(y.narrow(3, 4, 4).equal(&x.narrow(3, 4, 4)));
        assert!(
            !y.narrow(3, 0, 4)
                .allclose(&x.narrow(3, 0, 4), 1e-6, 1e-6, false)
        );
    }

    #[test]
    fn dropout_masks_repeat_for_the_same_step_and_unit() {
        let mut c = config(1);
        c.dropout = Dropout {
            embd: 0.5,
            train: true,
            seed: 7,
            ..Dropout::default()
        };
        let w = Tensor::ones([16, 8], (Kind::Float, Device::Cpu));
        let tokens = Tensor::from_slice(&[1i64, 2, 3]).view([1, 3]);
        let draw = |c: &ModelConfig, unit| {
            c.dropout.seed_unit(unit);
            embed(c, &w, &tokens)
        };
        assert!(draw(&c, 0).equal(&draw(&c, 0)));
        assert!(!draw(&c, 0).equal(&draw(&c, 1)));
        c.dropout.train = false;
        assert!(draw(&c, 0).equal(&embed(&c, &w, &tokens)));
        assert!(draw(&c, 0).equal(&w.index_select(0, &tokens.view([-1])).view([1, 3, 8])));
    }

    #[test]
    fn units_cover_every_parameter_once_in_order() {
        for layers in [1, 3] {
            let c = config(layers);
            let units = c.units();
            assert_eq!(units.len(), layers as usize + 2);
            let flat: Vec<usize> = units.iter().flat_map(|u| u.clone()).collect();
            assert_eq!(flat, (0..c.layout().len()).collect::<Vec<_>>());
            assert_eq!(units[0], 0..1);
            assert_eq!(c.layout()[units[layers as usize + 1].start].0, "final_norm");
        }
    }
}
