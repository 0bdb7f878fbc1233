//! The trainer's flags, named like the seeds' `train.py` so their job scripts carry over.

use std::path::PathBuf;

use clap::builder::BoolishValueParser;
use clap::{Parser, ValueEnum};

/// The decoder architectures this trainer builds (the seeds' `--model_type`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum ModelType {
    /// Llama 2: RMSNorm, rotary attention with grouped KV heads, SwiGLU.
    #[default]
    #[value(name = "llama_v2")]
    LlamaV2,
    /// Llama 3: the same layers as Llama 2 (its larger vocabulary and rotary base are
    /// `--vocab_size` and `--rotary_emb_base`).
    #[value(name = "llama_v3")]
    LlamaV3,
    /// Mistral: Llama's layers with sliding-window attention (`--sliding_window`).
    #[value(name = "mistral")]
    Mistral,
    /// Refused in `validate`: a mixture of experts is not built.
    #[value(name = "mixtral")]
    Mixtral,
    /// Refused in `validate`: the seeds' default, a different layer design.
    #[value(name = "gpt_neox")]
    GptNeox,
}

/// How the learning rate falls after warm-up and plateau (`--lr_decay_style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DecayStyle {
    #[value(name = "cosine")]
    Cosine,
    #[value(name = "linear")]
    Linear,
    #[value(name = "constant")]
    Constant,
    /// Refused in `validate`.
    #[value(name = "exponential")]
    Exponential,
}

/// How gradients and optimizer state are split across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sharding {
    /// Gradients all-reduced; every rank keeps the whole optimizer state (like DDP).
    #[value(name = "no_shard")]
    NoShard,
    /// Gradients reduce-scattered; each rank keeps and updates only its shard of the
    /// optimizer state and parameters, then parameters are all-gathered (ZeRO-2).
    #[value(name = "shard_grad_op")]
    ShardGradOp,
    /// Parameters sharded too (ZeRO-3): each rank holds 1/world of parameters, gradients
    /// and optimizer state, and one unit (a layer) whole while it computes.
    #[value(name = "full")]
    Full,
    /// Full sharding within a node, replicas across nodes; refused, see `validate`.
    #[value(name = "hybrid_shard")]
    HybridShard,
}

/// fsdp-trainer: a Llama-style decoder trained data-parallel on PyTorch's c10d.
///
/// Run it under fsdp-agent (or torchrun); without RANK/WORLD_SIZE it trains alone.
#[derive(Debug, Clone, Parser)]
// A flag given twice takes its last value, as argparse does: job scripts append overrides.
#[command(name = "fsdp-trainer", version, args_override_self = true)]
pub struct Args {
    #[arg(long = "hidden_width", default_value_t = 64)]
    pub hidden_width: i64,
    #[arg(long = "num_layers", default_value_t = 2)]
    pub num_layers: i64,
    #[arg(long = "num_heads", default_value_t = 4)]
    pub num_heads: i64,
    #[arg(long = "num_key_value_heads", default_value_t = 2)]
    pub num_key_value_heads: i64,
    #[arg(long = "intermediate_size", default_value_t = 172)]
    pub intermediate_size: i64,
    #[arg(long = "max_context_width", default_value_t = 64)]
    pub max_context_width: i64,
    /// Default: the tokenizer's vocabulary with --tokenizer, else 256.
    #[arg(long = "vocab_size")]
    pub vocab_size: Option<i64>,
    #[arg(long = "rotary_emb_base", default_value_t = 10000.0)]
    pub rotary_emb_base: f64,
    /// The fraction of each head's width that rotary embeddings rotate (the rest passes
    /// through unrotated).
    #[arg(long = "rotary_pct", default_value_t = 1.0)]
    pub rotary_pct: f64,
    #[arg(long = "model_type", value_enum, default_value = "llama_v2")]
    pub model_type: ModelType,
    /// Mistral's attention window in tokens (0: none); default 4096 for mistral.
    #[arg(long = "sliding_window")]
    pub sliding_window: Option<i64>,
    /// The standard deviation of the initial weights.
    #[arg(long = "initializer_range", default_value_t = 0.02)]
    pub initializer_range: f64,
    /// Dropout after the embedding.
    #[arg(long = "embd_pdrop", default_value_t = 0.0)]
    pub embd_pdrop: f64,
    /// Dropout on each layer's attention and MLP output, before the residual add.
    #[arg(long = "resid_pdrop", default_value_t = 0.0)]
    pub resid_pdrop: f64,
    /// Dropout on the attention weights.
    #[arg(long = "attn_pdrop", default_value_t = 0.0)]
    pub attn_pdrop: f64,
    /// GPT-style summary heads' dropout: these decoders have none (accepted, said).
    #[arg(long = "summary_first_pdrop", default_value_t = 0.0)]
    pub summary_first_pdrop: f64,
    /// Sequences per rank per step.
    #[arg(long = "train_batch_size", default_value_t = 8)]
    pub train_batch_size: i64,
    /// Sequences per rank per validation batch (default: --train_batch_size).
    #[arg(long = "val_batch_size")]
    pub val_batch_size: Option<i64>,
    /// Steps to train (default 100).
    #[arg(long = "max_steps")]
    pub max_steps: Option<u64>,
    /// Another name for --max_steps (the seeds' scripts use both).
    #[arg(long = "max_training_steps")]
    pub max_training_steps: Option<u64>,
    /// Passes over the dataset; training stops at --max_steps or here, whichever comes
    /// first (not with the synthetic corpus, which has no end).
    #[arg(long = "epochs")]
    pub epochs: Option<u64>,
    /// A validation loss every this many steps (0: never).
    #[arg(long = "validation_freq", default_value_t = 0)]
    pub validation_freq: u64,
    /// Batches per rank in each validation.
    #[arg(long = "validation_batches", default_value_t = 10)]
    pub validation_batches: u64,
    #[arg(long = "lr", default_value_t = 3e-3)]
    pub lr: f64,
    /// Floor of the decay (default lr / 10).
    #[arg(long = "min_lr")]
    pub min_lr: Option<f64>,
    /// Warm-up: a fraction of --lr_decay_iters when below 1, else a number of steps.
    #[arg(long = "warmup", default_value_t = 0.05)]
    pub warmup: f64,
    /// Steps at the peak rate after warm-up: a fraction of --lr_decay_iters when below
    /// 1, else a number of steps.
    #[arg(long = "plateau", default_value_t = 0.0)]
    pub plateau: f64,
    #[arg(long = "lr_decay_style", value_enum, default_value = "cosine")]
    pub lr_decay_style: DecayStyle,
    /// The step where the decay reaches --min_lr (default --max_steps).
    #[arg(long = "lr_decay_iters")]
    pub lr_decay_iters: Option<u64>,
    #[arg(long = "weight_decay", default_value_t = 0.01)]
    pub weight_decay: f64,
    #[arg(long = "beta1", default_value_t = 0.9)]
    pub beta1: f64,
    #[arg(long = "beta2", default_value_t = 0.95)]
    pub beta2: f64,
    /// Clip the global gradient norm to this (0 disables).
    #[arg(long = "grad_clip", default_value_t = 1.0)]
    pub grad_clip: f64,
    #[arg(long = "seed", default_value_t = 42)]
    pub seed: i64,
    /// Every rank draws the same dropout masks (default: each rank its own). The model's
    /// initial weights come from --seed alone either way: every rank must agree on them.
    #[arg(long = "same_seed", default_value = "0", value_parser = BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub same_seed: bool,
    /// Mixed precision (bf16 compute, fp32 master weights).
    #[arg(long = "bf16", default_value = "0", value_parser = BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub bf16: bool,
    /// Recompute activations in backward instead of keeping them: what `full` sharding
    /// does at every unit boundary.
    #[arg(long = "activation_checkpointing", default_value = "0", value_parser = BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub activation_checkpointing: bool,
    /// GPU only: keep checkpointed activations in host memory.
    #[arg(long = "offload_activations", default_value = "0", value_parser = BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub offload_activations: bool,
    /// GPU only: how many offloaded activations are loaded back ahead of use.
    #[arg(long = "activation_loading_horizon", default_value_t = 2)]
    pub activation_loading_horizon: i64,
    /// GPU only: keep parameter shards in host memory.
    #[arg(long = "cpu_offload", default_value = "0", value_parser = BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub cpu_offload: bool,
    /// At most one all-gather ahead of the unit computing (FSDP's rate limit).
    #[arg(long = "limit_all_gathers", default_value = "1", value_parser = BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub limit_all_gathers: bool,
    /// The older name of --dataset.
    #[arg(long = "dataset_path")]
    pub dataset_path: Option<PathBuf>,
    /// A local dataset: a .jsonl (a `text` field per line) or .txt file, or a directory
    /// of them. Hub names need a network this trainer does not use.
    #[arg(long = "dataset")]
    pub dataset: Option<String>,
    /// With --dataset: read the subdirectory of this name.
    #[arg(long = "dataset_config_name")]
    pub dataset_config_name: Option<String>,
    /// A tokenizer.json, or a directory holding one (default: bytes).
    #[arg(long = "tokenizer")]
    pub tokenizer: Option<String>,
    /// Write TensorBoard scalars (loss, learning rate, speed, validation loss) here.
    #[arg(long = "tensorboard_dir")]
    pub tensorboard_dir: Option<PathBuf>,
    #[arg(long = "checkpoint_dir")]
    pub checkpoint_dir: Option<PathBuf>,
    /// A checkpoint directory, or a directory of them (the newest complete one is used).
    #[arg(long = "resume_from_checkpoint")]
    pub resume_from_checkpoint: Option<PathBuf>,
    /// Save every this many steps (0: only at the end).
    #[arg(long = "checkpoint_freq", default_value_t = 50)]
    pub checkpoint_freq: u64,
    /// Each rank writes its own shard in the background (1), or the lead writes the
    /// gathered state while every rank waits (0).
    #[arg(long = "sharded_checkpoints", default_value = "1", value_parser = BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub sharded_checkpoints: bool,
    /// Checkpoints kept in checkpoint_dir; older ones are deleted.
    #[arg(long = "checkpoints_to_keep", default_value_t = 3)]
    pub checkpoints_to_keep: usize,
    #[arg(long = "logging_freq", default_value_t = 1)]
    pub logging_freq: u64,
    #[arg(long = "sharding_strategy", value_enum, default_value = "no_shard")]
    pub sharding_strategy: Sharding,
    /// Intra-op threads per rank (default: OMP_NUM_THREADS, else PyTorch's choice).
    #[arg(long = "threads")]
    pub threads: Option<i32>,
    /// With `full`: gather the next unit while the current one computes (two units whole
    /// at a time instead of one).
    #[arg(long = "prefetch", default_value_t = true, action = clap::ArgAction::Set)]
    pub prefetch: bool,
    /// The collectives library: `auto` (NCCL on a GPU, Gloo on CPU, no group at world 1),
    /// `gloo` or `nccl` (a group even at world 1).
    #[arg(long = "backend", value_enum, default_value = "auto")]
    pub backend: crate::device::Backend,
    /// Snapshot each rank's part of the state into host memory (its own and a buddy's on
    /// another node) every this many steps, so that under fsdp-agent a lost node costs the
    /// others no restart and no reload (0: off). Only under an agent that re-forms in
    /// place (FSDP_AGENT_CONTROL); otherwise nothing is kept.
    #[arg(long = "snapshot_freq", default_value_t = 1)]
    pub snapshot_freq: u64,
    /// MiB of host memory a rank's snapshots may take (own and a buddy's, two steps of
    /// each); past it that rank keeps none, said at start.
    #[arg(long = "snapshot_max_memory")]
    pub snapshot_max_memory: Option<u64>,
    /// Seconds a collective waits for the other ranks before failing.
    #[arg(long = "collective_timeout", default_value_t = 60)]
    pub collective_timeout: u64,
    /// Words that are not flags. The seeds' job scripts pass a comment inside their
    /// argument array (`' #' 'https://pytorch.org/docs/stable/fsdp.html'`), which their
    /// train.py ignores: so does this trainer, saying so.
    #[arg(hide = true)]
    pub stray: Vec<String>,
}

impl Args {
    /// The step count, whichever of its two names was given.
    pub fn steps(&self) -> u64 {
        self.max_steps.or(self.max_training_steps).unwrap_or(100)
    }

    /// The vocabulary the model is built for (the trainer fills in a tokenizer's).
    pub fn vocab(&self) -> i64 {
        self.vocab_size.unwrap_or(256)
    }

    pub fn val_batch(&self) -> i64 {
        self.val_batch_size.unwrap_or(self.train_batch_size)
    }

    /// Mistral's window unless given; none for the others (0 given: none).
    pub fn window(&self) -> Option<i64> {
        match (self.sliding_window, self.model_type) {
            (Some(0), _) => None,
            (Some(w), _) => Some(w),
            (None, ModelType::Mistral) => Some(4096),
            (None, _) => None,
        }
    }

    /// The dimensions of each head that rotary embeddings rotate: even, at most the head.
    pub fn rotary_dim(&self) -> i64 {
        let head = self.hidden_width / self.num_heads.max(1);
        let d = (head as f64 * self.rotary_pct).round() as i64;
        (d / 2 * 2).min(head)
    }

    /// What accepted flags do on this run when that is less than their name says, one line
    /// each, for the start-up log.
    pub fn notes(&self, on_gpu: bool) -> Vec<String> {
        let mut out = Vec::new();
        let device_only = [
            (
                self.offload_activations,
                "--offload_activations=1",
                "activations stay in device memory",
            ),
            (
                self.cpu_offload,
                "--cpu_offload=1",
                "parameter shards stay in device memory",
            ),
        ];
        for (on, flag, what) in device_only {
            if on {
                out.push(if on_gpu {
                    format!("{flag}: not built in this trainer; {what}")
                } else {
                    format!("{flag}: on CPU there is nothing to offload; it does nothing here")
                });
            }
        }
        if self.summary_first_pdrop > 0.0 {
            out.push(format!(
                "--summary_first_pdrop={}: {:?} has no summary head; it does nothing here",
                self.summary_first_pdrop, self.model_type
            ));
        }
        if !self.limit_all_gathers && self.sharding_strategy == Sharding::Full {
            out.push(
                "--limit_all_gathers=0: all-gathers still run at most one unit ahead here".into(),
            );
        }
        if self.sharding_strategy == Sharding::Full && !self.activation_checkpointing {
            out.push("--sharding_strategy full recomputes activations unit by unit whatever --activation_checkpointing says".into());
        }
        if self.epochs.is_some() && self.dataset.is_none() && self.dataset_path.is_none() {
            out.push("--epochs: the synthetic corpus has no end; --max_steps decides".into());
        }
        if !self.stray.is_empty() {
            let words: Vec<String> = self.stray.iter().map(|w| format!("{w:?}")).collect();
            out.push(format!(
                "ignoring words that are not flags: {} (as the seeds' train.py does)",
                words.join(" ")
            ));
        }
        out
    }

    /// Refuses combinations that cannot train, with a message that names the fix.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("--hidden_width", self.hidden_width),
            ("--num_layers", self.num_layers),
            ("--num_heads", self.num_heads),
            ("--num_key_value_heads", self.num_key_value_heads),
            ("--intermediate_size", self.intermediate_size),
            ("--max_context_width", self.max_context_width),
            ("--vocab_size", self.vocab()),
            ("--train_batch_size", self.train_batch_size),
        ];
        for (name, v) in positive {
            if v <= 0 {
                return Err(format!("{name} must be positive, got {v}"));
            }
        }
        if self.hidden_width % self.num_heads != 0 {
            return Err(format!(
                "--hidden_width {} is not divisible by --num_heads {}",
                self.hidden_width, self.num_heads
            ));
        }
        if (self.hidden_width / self.num_heads) % 2 != 0 {
            return Err(format!(
                "the head width (--hidden_width / --num_heads = {}) must be even for rotary embeddings",
                self.hidden_width / self.num_heads
            ));
        }
        if self.num_heads % self.num_key_value_heads != 0 {
            return Err(format!(
                "--num_heads {} is not a multiple of --num_key_value_heads {}",
                self.num_heads, self.num_key_value_heads
            ));
        }
        if self.steps() == 0 {
            return Err("--max_steps must be at least 1".into());
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return Err(format!("--lr must be a positive number, got {}", self.lr));
        }
        if self.warmup < 0.0 {
            return Err(format!(
                "--warmup must not be negative, got {}",
                self.warmup
            ));
        }
        if self.logging_freq == 0 {
            return Err("--logging_freq must be at least 1".into());
        }
        if let (Some(a), Some(b)) = (self.max_steps, self.max_training_steps) {
            if a != b {
                return Err(format!(
                    "--max_steps {a} and --max_training_steps {b} disagree; give one of them"
                ));
            }
        }
        match self.model_type {
            ModelType::Mixtral => {
                return Err("--model_type mixtral is not supported: a mixture of experts is not built in this trainer; \
                            use llama_v2, llama_v3 or mistral"
                    .into());
            }
            ModelType::GptNeox => {
                return Err("--model_type gpt_neox is not supported: this trainer builds Llama-style decoders; \
                            use llama_v2, llama_v3 or mistral"
                    .into());
            }
            _ => {}
        }
        if self.lr_decay_style == DecayStyle::Exponential {
            return Err(
                "--lr_decay_style exponential is not supported; use cosine, linear or constant"
                    .into(),
            );
        }
        for (name, p) in [
            ("--embd_pdrop", self.embd_pdrop),
            ("--resid_pdrop", self.resid_pdrop),
            ("--attn_pdrop", self.attn_pdrop),
            ("--summary_first_pdrop", self.summary_first_pdrop),
        ] {
            if !(0.0..1.0).contains(&p) {
                return Err(format!("{name} is a probability below 1, got {p}"));
            }
        }
        if !(self.rotary_pct > 0.0 && self.rotary_pct <= 1.0) {
            return Err(format!(
                "--rotary_pct is a fraction of the head width in (0, 1], got {}",
                self.rotary_pct
            ));
        }
        if self.rotary_dim() < 2 {
            return Err(format!(
                "--rotary_pct {} rotates fewer than 2 of the head's {} dimensions; raise it",
                self.rotary_pct,
                self.hidden_width / self.num_heads
            ));
        }
        if !(self.initializer_range > 0.0 && self.initializer_range.is_finite()) {
            return Err(format!(
                "--initializer_range must be a positive number, got {}",
                self.initializer_range
            ));
        }
        if self.plateau < 0.0 {
            return Err(format!(
                "--plateau must not be negative, got {}",
                self.plateau
            ));
        }
        if self.val_batch_size.is_some_and(|b| b <= 0) {
            return Err("--val_batch_size must be positive".into());
        }
        if self.validation_freq > 0 && self.validation_batches == 0 {
            return Err(
                "--validation_batches must be at least 1 when --validation_freq is set".into(),
            );
        }
        if self.epochs == Some(0) {
            return Err("--epochs must be at least 1".into());
        }
        if self.sliding_window.is_some_and(|w| w < 0) {
            return Err("--sliding_window must not be negative (0: none)".into());
        }
        if self.dataset.is_some() && self.dataset_path.is_some() {
            return Err("--dataset and --dataset_path both name data; give one (--dataset takes a file or a directory)".into());
        }
        if self.dataset_config_name.is_some() && self.dataset.is_none() {
            return Err(
                "--dataset_config_name names a subdirectory of --dataset; give --dataset too"
                    .into(),
            );
        }
        if self.activation_checkpointing && self.sharding_strategy != Sharding::Full {
            return Err(format!(
                "--activation_checkpointing=1 is built into --sharding_strategy full (activations recomputed unit by unit); \
                 {:?} keeps every activation: use full, or --activation_checkpointing=0",
                self.sharding_strategy
            ));
        }
        if self.sharding_strategy == Sharding::HybridShard {
            // It needs a second process group (the node's ranks) beside the world's, which
            // the c10d shim does not create; on one machine it would be `full` anyway.
            return Err("--sharding_strategy hybrid_shard is not supported: this trainer has one process group, \
                        not one per node; use full (sharded across all ranks) or shard_grad_op"
                .into());
        }
        Ok(())
    }
}
