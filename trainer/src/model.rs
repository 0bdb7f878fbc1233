//! The Llama-style decoder: token embedding, RMSNorm, rotary attention with grouped KV
//! heads, SwiGLU MLP, an untied output head. Parameters are plain tensors in a fixed
//! order, so the sharding code can treat them as one flat vector.

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
        let opts = (Kind::Float, device);
        let params = config
            .layout()
            .iter()
            .map(|(name, shape)| {
                let t = if name.ends_with("norm") {
                    Tensor::ones(shape.as_slice(), opts)
                } else {
                    Tensor::randn(shape.as_slice(), opts) * 0.02
                };
                t.set_requires_grad(true)
            })
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
        let logits = self.forward(inputs);
        let v = self.config.vocab_size;
        logits.view([-1, v]).cross_entropy_loss::<Tensor>(
            &targets.reshape([-1]),
            None,
            tch::Reduction::Mean,
            -100,
            0.0,
        )
    }

    #[allow(
        clippy::assign_op_pattern,
        reason = "tch's `+=` is an in-place add, which would clobber a value autograd still needs"
    )]
    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        let c = &self.config;
        let (b, t) = (tokens.size()[0], tokens.size()[1]);
        let (nh, nkv, hd) = (c.num_heads, c.num_key_value_heads, c.head_dim());
        let eps = 1e-5;
        let norm = |x: &Tensor, w: &Tensor| x.rms_norm([c.hidden_width], Some(w), eps);
        let cos = self.cos.narrow(0, 0, t);
        let sin = self.sin.narrow(0, 0, t);
        let p = &self.params;
        let mut x = Tensor::embedding(&p[0], tokens, -1, false, false);
        for l in 0..c.num_layers as usize {
            let w = &p[1 + l * 9..1 + (l + 1) * 9];
            let h = norm(&x, &w[0]);
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
            x = x + att.linear::<Tensor>(&w[4], None);
            let h = norm(&x, &w[5]);
            let gate = h.linear::<Tensor>(&w[6], None).silu();
            let up = h.linear::<Tensor>(&w[7], None);
            x = x + (gate * up).linear::<Tensor>(&w[8], None);
        }
        let n = p.len();
        norm(&x, &p[n - 2]).linear::<Tensor>(&p[n - 1], None)
    }
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
