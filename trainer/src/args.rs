//! The trainer's flags, named like the seeds' `train.py` so their job scripts carry over.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

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
#[command(name = "fsdp-trainer", version)]
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
    #[arg(long = "vocab_size", default_value_t = 256)]
    pub vocab_size: i64,
    #[arg(long = "rotary_emb_base", default_value_t = 10000.0)]
    pub rotary_emb_base: f64,
    /// Sequences per rank per step.
    #[arg(long = "train_batch_size", default_value_t = 8)]
    pub train_batch_size: i64,
    #[arg(long = "max_steps", default_value_t = 100)]
    pub max_steps: u64,
    #[arg(long = "lr", default_value_t = 3e-3)]
    pub lr: f64,
    /// Floor of the cosine decay (default lr / 10).
    #[arg(long = "min_lr")]
    pub min_lr: Option<f64>,
    /// Warm-up: a fraction of max_steps when below 1, else a number of steps.
    #[arg(long = "warmup", default_value_t = 0.05)]
    pub warmup: f64,
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
    /// Train byte-level on this text file instead of the built-in synthetic corpus.
    #[arg(long = "dataset_path")]
    pub dataset_path: Option<PathBuf>,
    #[arg(long = "checkpoint_dir")]
    pub checkpoint_dir: Option<PathBuf>,
    /// A checkpoint directory, or a directory of them (the newest complete one is used).
    #[arg(long = "resume_from_checkpoint")]
    pub resume_from_checkpoint: Option<PathBuf>,
    /// Save every this many steps (0: only at the end).
    #[arg(long = "checkpoint_freq", default_value_t = 50)]
    pub checkpoint_freq: u64,
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
    /// Seconds a collective waits for the other ranks before failing.
    #[arg(long = "collective_timeout", default_value_t = 60)]
    pub collective_timeout: u64,
}

impl Args {
    /// Refuses combinations that cannot train, with a message that names the fix.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("--hidden_width", self.hidden_width),
            ("--num_layers", self.num_layers),
            ("--num_heads", self.num_heads),
            ("--num_key_value_heads", self.num_key_value_heads),
            ("--intermediate_size", self.intermediate_size),
            ("--max_context_width", self.max_context_width),
            ("--vocab_size", self.vocab_size),
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
        if self.max_steps == 0 {
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
        if self.dataset_path.is_some() && self.vocab_size < 256 {
            return Err(format!(
                "--dataset_path trains on bytes and needs --vocab_size of at least 256, got {}",
                self.vocab_size
            ));
        }
        if self.logging_freq == 0 {
            return Err("--logging_freq must be at least 1".into());
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
