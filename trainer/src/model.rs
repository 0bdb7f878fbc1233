//! The Llama-style decoder: token embedding, RMSNorm, rotary attention with grouped KV
//! heads, SwiGLU MLP, an untied output head. Parameters are plain tensors in a fixed
//! order, so the sharding code can treat them as one flat vector; the forward pass is
//! written unit by unit (embedding, each decoder layer, final norm and head), so `full`
//! sharding can gather, run and free one unit at a time.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::args::Args;

/// The model's shape; a checkpoint records it and refuses to load into another.
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
            vocab_size: a.vocab_size,
            rotary_emb_base: a.rotary_emb_base,
        }
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
            .map(|(name, shape)| init(name, shape, device).set_requires_grad(true))
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
        let mut x = embed(&p[0], tokens);
        for unit in &c.units()[1..=c.num_layers as usize] {
            x = layer(c, &rotary, &p[unit.clone()], &x);
        }
        let n = p.len();
        head(c, &p[n - 2..], &x)
    }
}

/// One parameter's initial value, drawn from the current RNG state: ranks that draw the
/// parameters in layout order from the same seed get the same model, whole or unit by unit.
pub fn init(name: &str, shape: &[i64], device: Device) -> Tensor {
    if name.ends_with("norm") {
        Tensor::ones(shape, (Kind::Float, device))
    } else {
        Tensor::randn(shape, (Kind::Float, device)) * 0.02
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
pub fn embed(weight: &Tensor, tokens: &Tensor) -> Tensor {
    Tensor::embedding(weight, tokens, -1, false, false)
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
    let cos = rotary.cos.narrow(0, 0, t);
    let sin = rotary.sin.narrow(0, 0, t);
    let h = norm(c, x, &w[0]);
    let heads = |wt: &Tensor, n: i64| {
        h.linear::<Tensor>(wt, None)
            .view([b, t, n, hd])
            .transpose(1, 2)
    };
    let q = rotate(&heads(&w[1], nh), &cos, &sin);
    let k = rotate(&heads(&w[2], nkv), &cos, &sin);
    let v = heads(&w[3], nkv);
    let att = Tensor::scaled_dot_product_attention::<Tensor>(
        &q,
        &k,
        &v,
        None,
        0.0,
        true,
        None,
        nkv != nh,
    );
    let att = att.transpose(1, 2).reshape([b, t, c.hidden_width]);
    let x = x + att.linear::<Tensor>(&w[4], None);
    let h = norm(c, &x, &w[5]);
    let gate = h.linear::<Tensor>(&w[6], None).silu();
    let up = h.linear::<Tensor>(&w[7], None);
    x + (gate * up).linear::<Tensor>(&w[8], None)
}

/// The last unit: final norm (`w[0]`) and output head (`w[1]`), to logits.
pub fn head(c: &ModelConfig, w: &[Tensor], x: &Tensor) -> Tensor {
    norm(c, x, &w[0]).linear::<Tensor>(&w[1], None)
}

/// Mean next-token cross-entropy of `logits` against `targets`.
pub fn cross_entropy(c: &ModelConfig, logits: &Tensor, targets: &Tensor) -> Tensor {
    logits
        .view([-1, c.vocab_size])
        .cross_entropy_loss::<Tensor>(
            &targets.reshape([-1]),
            None,
            tch::Reduction::Mean,
            -100,
            0.0,
        )
}

/// cos and sin of position × frequency, `[max_context, head_dim]`, halves repeated.
fn rotary_tables(c: &ModelConfig, device: Device) -> (Tensor, Tensor) {
    let hd = c.head_dim();
    let inv_freq = (Tensor::arange_start_step(0, hd, 2, (Kind::Float, device)) / hd as f64)
        .multiply_scalar(-c.rotary_emb_base.ln())
        .exp();
    let pos = Tensor::arange(c.max_context_width, (Kind::Float, device));
    let freqs = pos.outer(&inv_freq);
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    (emb.cos(), emb.sin())
}

/// Rotary position embedding, "rotate half" form: `x·cos + rot(x)·sin`.
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let x1 = x.narrow(3, 0, half);
    let x2 = x.narrow(3, half, half);
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    x * cos + rotated * sin
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
        }
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
