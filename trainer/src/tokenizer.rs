//! Text to token ids: a Hugging Face `tokenizer.json` (`--tokenizer PATH`), or bytes.
//!
//! Without `--tokenizer` a byte is a token (vocab 256) and byte 0, which text does not
//! contain, ends each document. With one, its end-of-text token ends each document; the
//! tokenizer's post-processor (a Llama BOS, say) is not applied, so a document is its own
//! tokens and then that one token.

use std::path::{Path, PathBuf};

/// Tokens that end a document in the common tokenizers, tried in this order when no
/// `tokenizer_config.json` names one: Llama 1/2, Mistral, T5 (`</s>`); Llama 3
/// (`<|end_of_text|>`); GPT-2, GPT-NeoX, Qwen (`<|endoftext|>`); Gemma (`<eos>`).
const EOS_NAMES: [&str; 4] = ["</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"];

/// Documents per `encode_batch` call: enough to keep the tokenizer's threads busy,
/// few enough that a batch's encodings stay small.
const BATCH_DOCS: usize = 256;

/// Byte-level encoding's end of document.
const BYTE_EOS: u32 = 0;

/// How text becomes token ids.
pub enum TextEncoder {
    /// One token per byte.
    Bytes,
    /// A loaded `tokenizer.json`.
    Hf {
        tokenizer: Box<tokenizers::Tokenizer>,
        eos: Option<u32>,
        vocab: i64,
        path: PathBuf,
    },
}

impl TextEncoder {
    /// The byte-level encoder, or the tokenizer `--tokenizer spec` names.
    pub fn load(spec: Option<&str>) -> Result<Self, String> {
        let Some(spec) = spec else {
            return Ok(Self::Bytes);
        };
        let dir_or_file = Path::new(spec);
        let file = tokenizer_file(spec, dir_or_file.exists(), dir_or_file.is_dir())?;
        let mut tokenizer = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| format!("--tokenizer {}: not a tokenizer.json: {e}", file.display()))?;
        // A saved tokenizer may carry truncation (often 512) or padding for its model's
        // inputs; a document must come out whole and unpadded.
        tokenizer
            .with_truncation(None)
            .map_err(|e| format!("--tokenizer {}: {e}", file.display()))?;
        tokenizer.with_padding(None);
        let config_eos = file
            .parent()
            .map(|d| d.join("tokenizer_config.json"))
            .and_then(|c| std::fs::read_to_string(c).ok())
            .and_then(|text| eos_in_config(&text));
        let eos = choose_eos(config_eos.as_deref(), |t| tokenizer.token_to_id(t));
        // Ids can skip numbers (added tokens placed past the model's vocab): the embedding
        // needs a row for the largest.
        let largest = tokenizer.get_vocab(true).into_values().max();
        let vocab =
            (tokenizer.get_vocab_size(true) as i64).max(largest.map_or(0, |id| i64::from(id) + 1));
        Ok(Self::Hf {
            tokenizer: Box::new(tokenizer),
            eos,
            vocab,
            path: file,
        })
    }

    /// Rows the embedding needs: the largest id + 1.
    pub fn vocab(&self) -> i64 {
        match self {
            Self::Bytes => 256,
            Self::Hf { vocab, .. } => *vocab,
        }
    }

    /// The token after each document, if any.
    pub fn eos(&self) -> Option<u32> {
        match self {
            Self::Bytes => Some(BYTE_EOS),
            Self::Hf { eos, .. } => *eos,
        }
    }

    /// Appends each document's tokens, each followed by the end-of-document token when
    /// there is one, to `out`. Empty documents add nothing.
    pub fn encode_documents(&self, docs: &[String], out: &mut Vec<u32>) -> Result<(), String> {
        let docs: Vec<&str> = docs
            .iter()
            .map(String::as_str)
            .filter(|d| !d.is_empty())
            .collect();
        match self {
            Self::Bytes => {
                for d in docs {
                    out.extend(d.bytes().map(u32::from));
                    out.push(BYTE_EOS);
                }
            }
            Self::Hf {
                tokenizer,
                eos,
                path,
                ..
            } => {
                for chunk in docs.chunks(BATCH_DOCS) {
                    let encodings = tokenizer
                        .encode_batch_fast(chunk.to_vec(), false)
                        .map_err(|e| format!("tokenizer {}: {e}", path.display()))?;
                    for e in encodings {
                        out.extend_from_slice(e.get_ids());
                        out.extend(*eos);
                    }
                }
            }
        }
        Ok(())
    }
}

/// The `tokenizer.json` that `--tokenizer spec` means: the file itself, or the one in the
/// directory it names. A name that is no path here is a hub name, which needs a network.
fn tokenizer_file(spec: &str, exists: bool, is_dir: bool) -> Result<PathBuf, String> {
    if !exists {
        return Err(if looks_like_hub_name(spec) {
            format!(
                "--tokenizer {spec}: no such file or directory, and there is no network to fetch \
                 it from the hub; pass a local path to a tokenizer.json or a directory holding \
                 one (download it elsewhere with `huggingface-cli download {spec} \
                 tokenizer.json`)"
            )
        } else {
            format!(
                "--tokenizer {spec}: no such file or directory; pass a tokenizer.json or a \
                 directory holding one"
            )
        });
    }
    if !is_dir {
        return Ok(PathBuf::from(spec));
    }
    let file = Path::new(spec).join("tokenizer.json");
    if file.is_file() {
        Ok(file)
    } else {
        Err(format!(
            "--tokenizer {spec}: the directory has no tokenizer.json (a sentencepiece \
             tokenizer.model alone is not read; save the tokenizer with transformers' \
             save_pretrained, which writes tokenizer.json)"
        ))
    }
}

/// Whether a missing path reads as a hub repository id (`gpt2`, `owner/name`) rather than
/// a mistyped local path (`./tok`, `/data/tokenizer.json`, `a/b/c`).
pub(crate) fn looks_like_hub_name(spec: &str) -> bool {
    let segments: Vec<&str> = spec.split('/').collect();
    let name_char = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    let is_file_name = [".json", ".jsonl", ".txt", ".gz", ".model"]
        .iter()
        .any(|ext| spec.ends_with(ext));
    segments.len() <= 2
        && segments
            .iter()
            .all(|s| !s.is_empty() && !s.starts_with('.') && s.chars().all(name_char))
        && !is_file_name
}

/// `eos_token` of a `tokenizer_config.json`: a string, or `{"content": ...}` as older
/// transformers wrote it.
fn eos_in_config(text: &str) -> Option<String> {
    let config: serde_json::Value = serde_json::from_str(text).ok()?;
    let eos = config.get("eos_token")?;
    eos.as_str()
        .or_else(|| eos.get("content")?.as_str())
        .map(str::to_owned)
}

/// The end-of-document id: the config's `eos_token` when the tokenizer knows it, else the
/// first of [`EOS_NAMES`] it knows, else none (documents then simply abut).
fn choose_eos(config_eos: Option<&str>, id_of: impl Fn(&str) -> Option<u32>) -> Option<u32> {
    config_eos.into_iter().chain(EOS_NAMES).find_map(id_of)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small word-level tokenizer.json: `[UNK]` 0, `<s>` 1, `</s>` 2, then the words,
    /// whitespace pre-tokenizer, a post-processor that puts `<s>` first (as Llama's does),
    /// and truncation at 3 tokens (as some saved tokenizers carry).
    pub(crate) fn word_tokenizer_json(words: &[&str], eos: &str) -> String {
        let mut vocab = serde_json::Map::new();
        for (i, w) in ["[UNK]", "<s>", eos].iter().chain(words).enumerate() {
            vocab.insert((*w).to_owned(), serde_json::json!(i));
        }
        let added = |id: u32, content: &str| {
            serde_json::json!({"id": id, "content": content, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        };
        let bos = serde_json::json!({"SpecialToken": {"id": "<s>", "type_id": 0}});
        serde_json::json!({
            "version": "1.0",
            "truncation": {"direction": "Right", "max_length": 3, "strategy": "LongestFirst",
                "stride": 0},
            "padding": null,
            "added_tokens": [added(0, "[UNK]"), added(1, "<s>"), added(2, eos)],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                    {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
            },
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        })
        .to_string()
    }

    fn docs(texts: &[&str]) -> Vec<String> {
        texts.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn bytes_are_tokens_and_byte_zero_ends_each_document() {
        let enc = TextEncoder::load(None).unwrap();
        assert_eq!(enc.vocab(), 256);
        let mut out = Vec::new();
        enc.encode_documents(&docs(&["ab", "", "c"]), &mut out)
            .unwrap();
        assert_eq!(out, vec![97, 98, 0, 99, 0]);
    }

    #[test]
    fn a_tokenizer_json_encodes_whole_documents_with_eos_and_no_bos() {
        let dir = tempfile::TempDir::new().unwrap();
        let words = ["the", "cat", "sat", "on", "mat"];
        std::fs::write(
            dir.path().join("tokenizer.json"),
            word_tokenizer_json(&words, "</s>"),
        )
        .unwrap();
        // The directory and the file itself name the same tokenizer.
        for spec in [dir.path().to_path_buf(), dir.path().join("tokenizer.json")] {
            let enc = TextEncoder::load(Some(spec.to_str().unwrap())).unwrap();
            assert_eq!(enc.vocab(), 8);
            assert_eq!(enc.eos(), Some(2));
            let mut out = Vec::new();
            enc.encode_documents(&docs(&["the cat sat on the mat", "dog sat"]), &mut out)
                .unwrap();
            // Not truncated to 3, no <s>, an unknown word is [UNK].
            assert_eq!(out, vec![3, 4, 5, 6, 3, 7, 2, 0, 5, 2]);
        }
    }

    /// The pre-tokenizer pattern of Llama 3's tokenizer.json (tiktoken's cl100k split).
    const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    #[test]
    fn fancy_regex_splits_like_llama3_lookahead_included() {
        // A byte-level BPE over the 256 byte characters and three merges; the merges show
        // where the split put boundaries, since a merge never crosses one.
        let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
            .into_iter()
            .collect();
        alphabet.sort_unstable();
        let mut vocab = serde_json::Map::new();
        let merged = ["ĠĠ", "Ġb", "34"];
        let tokens = alphabet.iter().map(char::to_string);
        for (i, t) in tokens.chain(merged.map(str::to_owned)).enumerate() {
            vocab.insert(t, serde_json::json!(i));
        }
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "post_processor": null, "decoder": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated",
                    "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": false}
            ]},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": ["Ġ Ġ", "Ġ b", "3 4"]}
        });
        let dir = tempfile::TempDir::new().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
        let enc = TextEncoder::load(dir.path().to_str()).unwrap();
        let TextEncoder::Hf { tokenizer, .. } = &enc else {
            unreachable!()
        };
        assert_eq!(enc.eos(), None);
        let mut ids = Vec::new();
        enc.encode_documents(&docs(&["a   b 1234"]), &mut ids)
            .unwrap();
        let pieces: Vec<String> = ids
            .iter()
            .map(|&id| tokenizer.id_to_token(id).unwrap())
            .collect();
        // `\s+(?!\S)` leaves the last space to the word (a plain `\s+` would take all
        // three: "ĠĠ", "Ġ", "b"), and `\p{N}{1,3}` splits 1234 as 123|4, so 3 and 4 stay
        // apart.
        assert_eq!(pieces, ["a", "ĠĠ", "Ġb", "Ġ", "1", "2", "3", "4"]);
    }

    #[test]
    fn the_config_eos_token_wins_over_the_usual_names() {
        let dir = tempfile::TempDir::new().unwrap();
        let json = word_tokenizer_json(&["</s>", "hi"], "<|eot|>");
        std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
        let enc = TextEncoder::load(dir.path().to_str()).unwrap();
        assert_eq!(enc.eos(), Some(3), "</s> without a config");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"eos_token": {"content": "<|eot|>"}}"#,
        )
        .unwrap();
        let enc = TextEncoder::load(dir.path().to_str()).unwrap();
        assert_eq!(enc.eos(), Some(2));
    }

    #[test]
    fn eos_is_the_first_known_name_or_none() {
        let ids = |known: &'static [&'static str]| {
            move |t: &str| known.iter().position(|k| *k == t).map(|p| p as u32)
        };
        assert_eq!(choose_eos(None, ids(&["x", "<|endoftext|>"])), Some(1));
        assert_eq!(
            choose_eos(None, ids(&["<|endoftext|>", "<|end_of_text|>"])),
            Some(1)
        );
        assert_eq!(choose_eos(Some("<eot>"), ids(&["</s>", "<eot>"])), Some(1));
        assert_eq!(choose_eos(Some("<missing>"), ids(&["</s>"])), Some(0));
        assert_eq!(choose_eos(None, ids(&["a", "b"])), None);
        assert_eq!(
            eos_in_config(r#"{"eos_token": "</s>"}"#).as_deref(),
            Some("</s>")
        );
        assert_eq!(eos_in_config(r#"{"bos_token": "<s>"}"#), None);
    }

    #[test]
    fn a_hub_name_fails_saying_there_is_no_network() {
        let e = TextEncoder::load(Some("mistralai/Mixtral-8x7B-v0.1"))
            .err()
            .unwrap();
        assert!(e.contains("no network"), "{e}");
        assert!(
            e.contains("huggingface-cli download mistralai/Mixtral-8x7B-v0.1 tokenizer.json"),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
        let e = TextEncoder::load(Some("./no/such/tokenizer.json"))
            .err()
            .unwrap();
        assert!(e.contains("no such file") && !e.contains("network"), "{e}");
    }

    #[test]
    fn hub_names_are_told_from_mistyped_paths() {
        for hub in [
            "gpt2",
            "mistralai/Mixtral-8x7B-v0.1",
            "allenai/c4",
            "meta-llama/Llama-3.1-8B",
        ] {
            assert!(looks_like_hub_name(hub), "{hub}");
        }
        for path in [
            "/abs/tok",
            "./tok",
            "../tok",
            "a/b/c",
            "tok.json",
            "data/train.jsonl",
            "",
        ] {
            assert!(!looks_like_hub_name(path), "{path}");
        }
    }

    #[test]
    fn a_directory_without_tokenizer_json_and_a_bad_file_are_named() {
        let dir = tempfile::TempDir::new().unwrap();
        let e = TextEncoder::load(dir.path().to_str()).err().unwrap();
        assert!(e.contains("has no tokenizer.json"), "{e}");
        let file = dir.path().join("tokenizer.json");
        std::fs::write(&file, "{}").unwrap();
        let e = TextEncoder::load(file.to_str()).err().unwrap();
        assert!(e.contains("not a tokenizer.json"), "{e}");
    }
}
