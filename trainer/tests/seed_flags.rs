//! The seeds' `train.py` command lines: every flag accepted with its meaning or refused
//! with one line; validation, dropout, sliding windows and the schedule end to end.

mod common;

use common::*;

/// Every flag of the seeds' `train.py`, in their `--flag=value` form with `1`/`0` for
/// booleans, at a size that trains in a second.
const SEED_FLAGS: &[&str] = &[
    "--train_batch_size=2",
    "--val_batch_size=2",
    "--max_steps=6",
    "--seed=42",
    "--same_seed=0",
    "--bf16=0",
    "--grad_clip=1.0",
    "--weight_decay=0.2",
    "--beta1=0.9",
    "--beta2=0.95",
    "--activation_checkpointing=1",
    "--intermediate_size=96",
    "--num_key_value_heads=2",
    "--logging_freq=1",
    "--max_context_width=32",
    "--vocab_size=256",
    "--hidden_width=32",
    "--num_layers=2",
    "--num_heads=4",
    "--resid_pdrop=0.1",
    "--embd_pdrop=0.1",
    "--attn_pdrop=0.1",
    "--summary_first_pdrop=0.1",
    "--initializer_range=0.02",
    "--model_type=mistral",
    "--rotary_pct=0.25",
    "--rotary_emb_base=10000",
    "--offload_activations=1",
    "--activation_loading_horizon=2",
    "--limit_all_gathers=1",
    "--sharding_strategy=full",
    "--cpu_offload=0",
    "--lr=0.0001",
    "--lr_decay_style=cosine",
    "--lr_decay_iters=6",
    "--min_lr=1e-5",
    "--warmup=0.0032",
    "--plateau=0.0",
    "--epochs=3",
    "--checkpoint_freq=3",
    "--validation_freq=3",
    "--validation_batches=2",
];

#[test]
fn every_flag_of_the_seeds_train_py_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let ck = format!("--checkpoint_dir={}", dir.path().display());
    let resume = format!("--resume_from_checkpoint={}", dir.path().display());
    // The seeds' scripts also pass a comment inside their argument array.
    let stray = [" #", "https://pytorch.org/docs/stable/fsdp.html"];
    let out = run(alone(
        &[SEED_FLAGS, &[ck.as_str(), resume.as_str()], &stray].concat(),
    ));
    let text = stdout(&out);
    assert_eq!(losses(&text).len(), 6, "{text}");
    assert_eq!(text.matches("Validation Loss: ").count(), 2, "{text}");
    assert_eq!(text.matches("Saved checkpoint").count(), 2, "{text}");
    // What a flag does not do here is said, once, at the start.
    for said in [
        "--offload_activations=1: on CPU there is nothing to offload",
        "--summary_first_pdrop=0.1: Mistral has no summary head",
        "ignoring words that are not flags: \" #\"",
    ] {
        assert!(text.contains(said), "expected '{said}' in:\n{text}");
    }
}

#[test]
fn what_is_not_built_is_refused_in_one_line() {
    for (flag, says) in [
        ("--model_type=mixtral", "a mixture of experts is not built"),
        ("--model_type=gpt_neox", "use llama_v2, llama_v3 or mistral"),
        (
            "--lr_decay_style=exponential",
            "use cosine, linear or constant",
        ),
        ("--rotary_pct=0", "--rotary_pct is a fraction"),
        ("--attn_pdrop=1", "--attn_pdrop is a probability below 1"),
        ("--bf16=maybe", "invalid value 'maybe'"),
    ] {
        fails_with(alone(&["--max_steps=1", flag]), 2, says);
    }
    fails_with(
        alone(&["--max_steps=5", "--max_training_steps=6"]),
        2,
        "disagree; give one of them",
    );
    fails_with(
        alone(&[
            "--activation_checkpointing=1",
            "--sharding_strategy=no_shard",
        ]),
        2,
        "built into --sharding_strategy full",
    );
    // The other name of --max_steps counts the same.
    let text = stdout(&run(alone(&["--max_training_steps=3"])));
    assert_eq!(losses(&text).len(), 3, "{text}");
}

/// `full` recomputes each unit in backward: the dropout masks it draws there must be the
/// ones of its forward, and the ones `no_shard` draws (both seed each unit's masks from the
/// step and the unit), or its gradients would be another model's.
#[test]
fn dropout_under_full_sharding_trains_as_under_no_shard() {
    let common = [
        "--max_steps=12",
        "--train_batch_size=4",
        "--resid_pdrop=0.2",
        "--embd_pdrop=0.2",
        "--attn_pdrop=0.2",
    ];
    let reference = losses(&stdout(&run(launched(2, &common))));
    let full = [&common[..], &["--sharding_strategy=full"]].concat();
    let sharded = losses(&stdout(&run(launched(2, &full))));
    assert_eq!(reference.len(), 12);
    assert_close(&reference, &sharded, 2e-3);
    // Dropout is on: without it the curve is another.
    let plain = losses(&stdout(&run(launched(2, &common[..2]))));
    assert!(
        reference
            .iter()
            .zip(&plain)
            .any(|(a, b)| (a.1 - b.1).abs() > 1e-3),
        "dropout changed nothing: {reference:?}"
    );
}

/// Validation runs on held-out samples without dropout, at every `--validation_freq` step
/// and the last, and its loss falls as the model learns.
#[test]
fn validation_losses_are_reported_and_fall() {
    let text = stdout(&run(alone(&[
        "--max_steps=40",
        "--validation_freq=15",
        "--validation_batches=4",
        "--resid_pdrop=0.1",
    ])));
    let validations: Vec<(u64, f64)> = text
        .lines()
        .filter_map(|l| {
            let rest = l.split("Validation Loss: ").nth(1)?;
            let (loss, rest) = rest.split_once(" (step ")?;
            let step = rest.split(',').next()?;
            Some((step.parse().ok()?, loss.parse().ok()?))
        })
        .collect();
    assert_eq!(
        validations.iter().map(|v| v.0).collect::<Vec<_>>(),
        [15, 30, 40],
        "{text}"
    );
    assert!(validations[2].1 < validations[0].1, "{validations:?}");
}

/// A window narrower than the context changes what attention sees; one as wide does not.
#[test]
fn a_sliding_window_narrower_than_the_context_changes_the_model() {
    let base = ["--max_steps=5", "--max_context_width=32"];
    let run_with = |extra: &[&str]| losses(&stdout(&run(alone(&[&base[..], extra].concat()))));
    let causal = run_with(&["--model_type=llama_v3"]);
    let wide = run_with(&["--model_type=mistral", "--sliding_window=32"]);
    let narrow = run_with(&["--model_type=mistral", "--sliding_window=4"]);
    assert_close(&causal, &wide, 1e-6);
    assert!(
        causal
            .iter()
            .zip(&narrow)
            .skip(1)
            .any(|(a, b)| (a.1 - b.1).abs() > 1e-4),
        "a window of 4 of 32 tokens changed nothing: {causal:?} vs {narrow:?}"
    );
}

/// `--tensorboard_dir`: one event file, written by rank 0, holding the training and
/// validation scalars (its framing and encoding are unit-tested against TensorBoard's
/// format in `tensorboard.rs`).
#[test]
fn tensorboard_scalars_are_written_by_the_lead_rank_only() {
    let dir = tempfile::tempdir().unwrap();
    let board = dir.path().join("tb");
    let flag = format!("--tensorboard_dir={}", board.display());
    run(launched(
        2,
        &[
            "--max_steps=4",
            "--validation_freq=2",
            "--train_batch_size=2",
            &flag,
        ],
    ));
    let files: Vec<_> = std::fs::read_dir(&board)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let bytes = std::fs::read(&files[0]).unwrap();
    let count = |tag: &str| {
        bytes
            .windows(tag.len())
            .filter(|w| *w == tag.as_bytes())
            .count()
    };
    assert_eq!(count("train/loss"), 4);
    assert_eq!(count("val/loss"), 2);
    assert_eq!(count("brain.Event:2"), 1);
    // A directory that cannot be made is the user's to fix.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    fails_with(
        alone(&[
            "--max_steps=1",
            &format!("--tensorboard_dir={}/tb", file.display()),
        ]),
        2,
        "--tensorboard_dir",
    );
}

/// `--bf16=1`: bf16 compute over fp32 master weights and fp32 gradient reduction; the
/// losses stay within 1% of fp32's over 100 steps (0.05% measured on this model), and
/// `full` computes what `no_shard` does (to bf16 rounding).
#[test]
fn bf16_losses_track_fp32_within_one_percent() {
    let common = [
        "--max_steps=100",
        "--logging_freq=10",
        "--train_batch_size=4",
    ];
    let fp32 = losses(&stdout(&run(launched(2, &common))));
    let bf16 = [&common[..], &["--bf16=1"]].concat();
    let no_shard = losses(&stdout(&run(launched(2, &bf16))));
    let full = [&bf16[..], &["--sharding_strategy=full"]].concat();
    let full = losses(&stdout(&run(launched(2, &full))));
    assert_eq!(fp32.len(), 10);
    assert_close(&no_shard, &full, 2e-3);
    assert!(
        fp32.iter().zip(&no_shard).any(|(a, b)| a.1 != b.1),
        "bf16 changed nothing: {fp32:?}"
    );
    for ((step, a), (_, b)) in fp32.iter().zip(&no_shard) {
        assert!((a - b).abs() <= 0.01 * a, "step {step}: fp32 {a}, bf16 {b}");
    }
}

/// The trainer arguments of the shipped GPU manifest, as written there, are flags this
/// trainer takes: run with them, then overrides (last wins) that shrink the model to a
/// CPU's size and point the checkpoints at a temporary directory.
#[test]
fn the_gpu_manifests_trainer_arguments_are_accepted() {
    let manifest = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../k8s/pytorchjob-gpu.yaml"),
    )
    .unwrap();
    let args: Vec<String> = manifest
        .lines()
        .map(str::trim)
        .skip_while(|l| *l != "- fsdp-trainer")
        .skip(1)
        .take_while(|l| !l.ends_with(':'))
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix("- "))
        .map(|a| a.trim_matches('"').to_owned())
        .collect();
    assert!(
        args.contains(&"full".to_owned()) && args.contains(&"--bf16".to_owned()),
        "{args:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let ck = format!("--checkpoint_dir={}", dir.path().display());
    let ck: Vec<String> = vec![ck, "--resume_from_checkpoint=/nonexistent".into()];
    runs_shrunk(&[args, ck].concat());
}

/// Runs the trainer with `args`, then overrides (a flag given twice takes its last value)
/// that shrink the model to a CPU's size, for two steps.
fn runs_shrunk(args: &[String]) {
    let shrink = [
        "--hidden_width=64",
        "--num_layers=1",
        "--intermediate_size=96",
        "--max_context_width=16",
        "--vocab_size=256",
        "--max_steps=2",
    ];
    let all: Vec<&str> = args.iter().map(String::as_str).chain(shrink).collect();
    let text = stdout(&run(alone(&all)));
    assert!(text.contains("Training finished at step 2"), "{text}");
}

/// The Slurm example's model and training flags are flags this trainer takes (the script
/// itself runs on a GPU cluster; here its arrays run shrunk, last value wins).
#[test]
fn the_slurm_examples_trainer_arguments_are_accepted() {
    let script = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/slurm/llama.sbatch"),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = Vec::new();
    for array in ["MODEL=(", "TRAINING=("] {
        let lines = script.lines().skip_while(|l| *l != array).skip(1);
        args.extend(lines.take_while(|l| *l != ")").map(|l| {
            l.trim()
                .replace("\"$CKPT\"", &dir.path().display().to_string())
        }));
    }
    assert!(
        args.contains(&"--sharding_strategy=full".to_owned()),
        "{args:?}"
    );
    assert!(args.contains(&"--bf16=1".to_owned()), "{args:?}");
    runs_shrunk(&args);
}
