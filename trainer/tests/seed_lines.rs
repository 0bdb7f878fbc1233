//! The seeds' own training lines, as their Slurm and EKS guides write them, under
//! `fsdp-agent --standalone --nproc-per-node 2`: only the model is shrunk (by
//! `--hidden_width`, `--num_layers` and `--max_context_width`), and `--dataset` and
//! `--tokenizer` name local files this test makes in place of the hub names. Each line runs
//! twice: cut short by an appended `--max_steps` (a flag given twice takes its last value),
//! then as written, resuming from the checkpoint, to its last step.

mod common;

use std::path::Path;

use common::*;

/// The Llama 3 line of the seeds' Slurm guide.
const LLAMA_V3: &[&str] = &[
    "--max_context_width=8192",
    "--num_key_value_heads=8",
    "--intermediate_size=14336",
    "--hidden_width=4096",
    "--num_layers=32",
    "--num_heads=32",
    "--model_type=llama_v3",
    "--tokenizer=hf-internal-testing/llama-tokenizer",
    "--checkpoint_freq=50",
    "--validation_freq=25",
    "--max_steps=100",
    "--checkpoint_dir=./checkpoints",
    "--dataset=allenai/c4",
    "--dataset_config_name=en",
    "--resume_from_checkpoint=./checkpoints",
    "--train_batch_size=1",
    "--val_batch_size=1",
    "--sharding_strategy=full",
    "--offload_activations=1",
];

/// The Mistral line of the seeds' EKS guide, with the `--bf16=1` its Mixtral sibling has.
const MISTRAL: &[&str] = &[
    "--train_batch_size=1",
    "--val_batch_size=1",
    "--max_steps=5000",
    "--seed=42",
    "--bf16=1",
    "--grad_clip=1.0",
    "--weight_decay=0.2",
    "--beta1=0.9",
    "--beta2=0.95",
    "--activation_checkpointing=1",
    "--intermediate_size=14336",
    "--num_key_value_heads=8",
    "--logging_freq=1",
    "--max_context_width=32768",
    "--vocab_size=32768",
    "--hidden_width=4096",
    "--num_layers=32",
    "--num_heads=32",
    "--resid_pdrop=0.1",
    "--embd_pdrop=0.1",
    "--attn_pdrop=0.1",
    "--summary_first_pdrop=0.1",
    "--initializer_range=0.02",
    "--model_type=mistral",
    "--rotary_pct=0.25",
    "--rotary_emb_base=10000",
    "--lr=0.0001",
    "--lr_decay_style=cosine",
    "--min_lr=1e-5",
    "--warmup=0.0032",
    "--plateau=0.0",
    "--dataset=allenai/c4",
    "--tokenizer=mistralai/mathstral-7B-v0.1",
    "--epochs=3",
    "--checkpoint_dir=./checkpoints/mathstral-7B",
    "--resume_from_checkpoint=./checkpoints/mathstral-7B",
    "--checkpoint_freq=50",
    "--validation_freq=500",
    "--dataset_config_name=en",
    "--limit_all_gathers=1",
    "--sharding_strategy=full",
    " #",
    "https://pytorch.org/docs/stable/fsdp.html",
    "--offload_activations=1",
];

const WORDS: [&str; 24] = [
    "the", "a", "cat", "dog", "bird", "sat", "ran", "flew", "on", "under", "over", "mat", "tree",
    "roof", "and", "then", "slept", "ate", "quickly", "slowly", "red", "big", "small", "green",
];

/// A word-level `tokenizer.json` over [`WORDS`] with `</s>` as its end-of-document token.
fn write_tokenizer(dir: &Path) {
    let mut vocab = serde_json::Map::new();
    for (i, w) in ["[UNK]", "</s>"].iter().chain(&WORDS).enumerate() {
        vocab.insert((*w).to_owned(), serde_json::json!(i));
    }
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true})
    };
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "[UNK]"), special(1, "</s>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
}

/// `docs` documents of 20 words each, as JSON lines with a `text` field.
fn jsonl(docs: usize, salt: u64) -> String {
    let mut state = salt;
    let mut out = String::new();
    for _ in 0..docs {
        let words: Vec<&str> = (0..20)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                WORDS[(state >> 33) as usize % WORDS.len()]
            })
            .collect();
        out += &serde_json::json!({"text": words.join(" "), "url": "local"}).to_string();
        out.push('\n');
    }
    out
}

/// The hub layout the lines expect, made locally: `c4/en/{train,validation}.jsonl`.
fn write_dataset(root: &Path, train_docs: usize) {
    let en = root.join("c4/en");
    std::fs::create_dir_all(&en).unwrap();
    std::fs::write(
        en.join("c4-train.00000-of-00001.jsonl"),
        jsonl(train_docs, 1),
    )
    .unwrap();
    std::fs::write(en.join("c4-validation.00000-of-00001.jsonl"), jsonl(8, 2)).unwrap();
}

/// `line` with the hub names replaced by local paths and the model shrunk.
fn localised(line: &[&str], work: &Path, tokenizer: &str) -> Vec<String> {
    let shrink = [
        ("--hidden_width=", "256"),
        ("--num_layers=", "1"),
        ("--max_context_width=", "32"),
    ];
    line.iter()
        .map(|a| {
            if let Some((flag, v)) = shrink.iter().find(|(f, _)| a.starts_with(f)) {
                return format!("{flag}{v}");
            }
            if a.starts_with("--dataset=") {
                return format!("--dataset={}", work.join("c4").display());
            }
            if a.starts_with("--tokenizer=") {
                return format!("--tokenizer={}", work.join(tokenizer).display());
            }
            for flag in ["--checkpoint_dir=", "--resume_from_checkpoint="] {
                if let Some(dir) = a.strip_prefix(flag) {
                    return format!("{flag}{}", work.join(dir).display());
                }
            }
            (*a).to_owned()
        })
        .collect()
}

/// Runs `line` under the agent on two ranks (plus `extra` at the end); its stdout.
fn run_line(line: &[String], extra: &[&str]) -> String {
    let args: Vec<&str> = line
        .iter()
        .map(String::as_str)
        .chain(extra.iter().copied())
        .collect();
    stdout(&run(launched(2, &args)))
}

fn validations(text: &str) -> usize {
    text.matches("Validation Loss: ").count()
}

#[test]
fn the_llama_v3_line_runs_to_its_last_step_with_validation_checkpoints_and_a_resume() {
    let work = tempfile::tempdir().unwrap();
    write_dataset(work.path(), 60);
    write_tokenizer(&work.path().join("llama-tokenizer"));
    let line = localised(LLAMA_V3, work.path(), "llama-tokenizer");
    let first = run_line(&line, &["--max_steps=60"]);
    assert!(first.contains("Training finished at step 60"), "{first}");
    assert_eq!(validations(&first), 3, "steps 25, 50 and 60\n{first}");
    assert!(
        first.contains("Saved checkpoint") && first.contains("step_00000050"),
        "{first}"
    );
    let second = run_line(&line, &[]);
    assert!(second.contains("Loaded checkpoint"), "{second}");
    assert!(second.contains("(step 60, sample 120"), "{second}");
    assert!(second.contains("Training finished at step 100"), "{second}");
    assert_eq!(validations(&second), 2, "steps 75 and 100\n{second}");
    // The model took the tokenizer's vocabulary (the line gives no --vocab_size).
    assert!(second.contains("vocab 26"), "{second}");
    assert_eq!(losses(&second).first().map(|l| l.0), Some(60), "{second}");
}

#[test]
fn the_mistral_line_runs_its_three_epochs_in_bf16_with_a_resume() {
    let work = tempfile::tempdir().unwrap();
    write_dataset(work.path(), 40);
    write_tokenizer(&work.path().join("mathstral"));
    let line = localised(MISTRAL, work.path(), "mathstral");
    let first = run_line(&line, &["--max_steps=20"]);
    assert!(first.contains("Training finished at step 20"), "{first}");
    let second = run_line(&line, &[]);
    assert!(second.contains("(step 20, sample 40"), "{second}");
    // --epochs=3 ends it long before --max_steps=5000.
    assert!(second.contains("Epoch 3 of 3 begins"), "{second}");
    let finished = second
        .lines()
        .find_map(|l| l.split("Training finished at step ").nth(1))
        .and_then(|r| r.split(',').next())
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no end\n{second}"));
    assert!((30..5000).contains(&finished), "{second}");
    // The last step validates (--validation_freq=500 is never reached) and saves.
    assert_eq!(validations(&second), 1, "{second}");
    assert!(
        second.contains(&format!("step_{finished:08}")),
        "the last step saves\n{second}"
    );
    for said in [
        "--offload_activations=1: on CPU",
        "ignoring words that are not flags",
    ] {
        assert!(second.contains(said), "{said}\n{second}");
    }
}
