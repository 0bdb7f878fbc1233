//! `--dataset PATH [--dataset_config_name NAME] [--tokenizer PATH]`: local text, tokenized
//! once at start into a [`TokenCorpus`].
//!
//! PATH is a file or a directory ([`files`] says which files count and how they are read);
//! with a config name, the directory `PATH/NAME` is read, as the hub lays configs out
//! (allenai/c4's `en/`). Documents are encoded in file order, each followed by the
//! tokenizer's end-of-document token ([`crate::tokenizer`]). Validation data is the
//! directory's validation files, else the last 1/100 of the tokens (at least one window).
//! There is no network: a hub name is refused with the command that downloads it.
//!
//! Every rank reads and tokenizes the whole dataset and holds its tokens (4 bytes each);
//! that suits datasets up to a few GB of text.

mod corpus;
mod files;

use std::path::{Path, PathBuf};

pub use corpus::TokenCorpus;

use crate::tokenizer::{TextEncoder, looks_like_hub_name};

/// Documents handed to the tokenizer at once.
const DOCUMENTS_PER_BATCH: usize = 1024;

/// Reads and tokenizes the dataset `dataset` (its config `config_name`) with the tokenizer
/// `tokenizer` (bytes without one). Errors are one line, for the user to fix.
pub fn open(
    dataset: &str,
    config_name: Option<&str>,
    tokenizer: Option<&str>,
) -> Result<TokenCorpus, String> {
    let root = dataset_root(dataset, config_name)?;
    let encoder = TextEncoder::load(tokenizer)?;
    let layout = files::layout(&root)?;
    let train = tokenize(&layout.train, &encoder)?;
    let validation = if layout.validation.is_empty() {
        None
    } else {
        Some(tokenize(&layout.validation, &encoder)?)
    };
    Ok(TokenCorpus::new(
        train,
        validation,
        encoder.vocab(),
        encoder.eos(),
        root.display().to_string(),
    ))
}

/// The file or directory to read.
fn dataset_root(dataset: &str, config_name: Option<&str>) -> Result<PathBuf, String> {
    let path = Path::new(dataset);
    if !path.exists() {
        return Err(missing_dataset(dataset, config_name));
    }
    let Some(name) = config_name else {
        return Ok(path.to_path_buf());
    };
    if !path.is_dir() {
        return Err(format!(
            "--dataset_config_name {name}: --dataset {dataset} is a file; a config is a \
             subdirectory of a dataset directory"
        ));
    }
    let dir = path.join(name);
    if dir.is_dir() {
        return Ok(dir);
    }
    let mut configs: Vec<String> = std::fs::read_dir(path)
        .map_err(|e| format!("--dataset {dataset}: {e}"))?
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    configs.sort();
    Err(format!(
        "--dataset_config_name {name}: no directory {} ({})",
        dir.display(),
        if configs.is_empty() {
            format!("{dataset} has no subdirectories; leave out --dataset_config_name")
        } else {
            format!("the configs there: {}", configs.join(", "))
        }
    ))
}

/// The one-line error for a dataset path that does not exist.
fn missing_dataset(dataset: &str, config_name: Option<&str>) -> String {
    if !looks_like_hub_name(dataset) {
        return format!(
            "--dataset {dataset}: no such file or directory; pass a .jsonl, .json or .txt \
             file, or a directory of them"
        );
    }
    let include = config_name.map_or(String::new(), |n| format!(" --include '{n}/*'"));
    let config = config_name.map_or(String::new(), |n| format!(" --dataset_config_name {n}"));
    format!(
        "--dataset {dataset}: no such file or directory, and there is no network to fetch it \
         from the hub; download it elsewhere (`huggingface-cli download --repo-type dataset \
         {dataset}{include} --local-dir DIR`), then pass --dataset DIR{config}"
    )
}

/// The tokens of `files`' documents, in order.
fn tokenize(files: &[files::DataFile], encoder: &TextEncoder) -> Result<Vec<u32>, String> {
    let mut tokens = Vec::new();
    let mut documents = Vec::with_capacity(DOCUMENTS_PER_BATCH);
    for file in files {
        files::read_documents(file, &mut |doc| {
            documents.push(doc);
            if documents.len() == DOCUMENTS_PER_BATCH {
                encoder.encode_documents(&documents, &mut tokens)?;
                documents.clear();
            }
            Ok(())
        })?;
    }
    encoder.encode_documents(&documents, &mut tokens)?;
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::tokenizer::tests::word_tokenizer_json;

    fn write(dir: &Path, rel: &str, text: &str) {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    fn bytes(text: &str) -> Vec<i64> {
        text.bytes().map(i64::from).collect()
    }

    fn s(p: &Path) -> &str {
        p.to_str().unwrap()
    }

    #[test]
    fn a_jsonl_file_is_its_text_fields_each_ended_by_byte_zero() {
        let dir = tempfile::TempDir::new().unwrap();
        write(
            dir.path(),
            "d.jsonl",
            "{\"text\": \"ab\", \"id\": 1}\n\n{\"meta\": {}, \"text\": \"\"}\n{\"text\": \"cd\"}\n",
        );
        let c = open(s(&dir.path().join("d.jsonl")), None, None).unwrap();
        assert_eq!(c.vocab(), 256);
        assert_eq!(c.eos(), Some(0));
        // 6 tokens [a b 0 c d 0], no validation file: the tail held out is one window.
        assert!(c.check(3).is_ok());
        assert_eq!(c.train_sample(0, 3), vec![97, 98, 0]);
        assert_eq!(c.validation_sample(0, 3), vec![99, 100, 0]);
    }

    #[test]
    fn a_malformed_line_names_the_file_and_line() {
        let dir = tempfile::TempDir::new().unwrap();
        write(
            dir.path(),
            "a.jsonl",
            "{\"text\": \"x\"}\n{\"text\": \"y\"}\nnot json\n",
        );
        let e = open(s(dir.path()), None, None).err().unwrap();
        assert!(e.contains("a.jsonl line 3: expected a JSON object"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        write(
            dir.path(),
            "a.jsonl",
            "{\"text\": \"x\"}\n{\"title\": \"y\"}\n",
        );
        let e = open(s(dir.path()), None, None).err().unwrap();
        assert!(e.contains("a.jsonl line 2: no \"text\" field"), "{e}");
    }

    #[test]
    fn a_directory_with_validation_jsonl_holds_it_out_and_trains_on_the_rest_in_order() {
        let dir = tempfile::TempDir::new().unwrap();
        write(dir.path(), "b.txt", "second\n\nstill second");
        write(dir.path(), "a.jsonl", "{\"text\": \"first\"}\n");
        write(dir.path(), "validation.jsonl", "{\"text\": \"held\"}\n");
        write(dir.path(), "test.jsonl", "{\"text\": \"never\"}\n");
        write(dir.path(), "README.md", "# a dataset card");
        write(
            dir.path(),
            ".cache/huggingface/x.jsonl",
            "{\"text\": \"never\"}\n",
        );
        let c = open(s(dir.path()), None, None).unwrap();
        let all = "first\0second\n\nstill second\0";
        let len = all.len();
        // One window: the whole training text, one .txt file being one document.
        assert_eq!(c.windows_per_epoch(len), 1);
        assert_eq!(c.train_sample(0, len), bytes(all));
        assert_eq!(c.validation_windows(5), 1);
        assert_eq!(c.validation_sample(0, 5), bytes("held\0"));
        assert!(c.describe(len).contains("from validation files"));
    }

    #[test]
    fn a_config_name_reads_that_subdirectory_gzipped_like_the_hub() {
        let dir = tempfile::TempDir::new().unwrap();
        let gz = |rel: &str, text: &str| {
            let path = dir.path().join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let mut enc = flate2::write::GzEncoder::new(
                std::fs::File::create(path).unwrap(),
                flate2::Compression::fast(),
            );
            enc.write_all(text.as_bytes()).unwrap();
            enc.finish().unwrap();
        };
        gz(
            "en/c4-train.00000-of-00002.json.gz",
            "{\"text\": \"one\"}\n",
        );
        gz(
            "en/c4-train.00001-of-00002.json.gz",
            "{\"text\": \"two\"}\n",
        );
        gz(
            "en/c4-validation.00000-of-00001.json.gz",
            "{\"text\": \"val\"}\n",
        );
        write(
            dir.path(),
            "realnewslike/c4-train.jsonl",
            "{\"text\": \"other\"}\n",
        );
        let c = open(s(dir.path()), Some("en"), None).unwrap();
        assert_eq!(c.windows_per_epoch(8), 1);
        assert_eq!(c.train_sample(0, 8), bytes("one\0two\0"));
        assert_eq!(c.validation_sample(0, 4), bytes("val\0"));
        let e = open(s(dir.path()), Some("fr"), None).err().unwrap();
        assert!(e.contains("the configs there: en, realnewslike"), "{e}");
        let e = open(
            s(&dir.path().join("realnewslike/c4-train.jsonl")),
            Some("en"),
            None,
        )
        .err()
        .unwrap();
        assert!(e.contains("is a file"), "{e}");
    }

    #[test]
    fn hub_names_fail_saying_there_is_no_network() {
        let e = open("allenai/c4", Some("en"), None).err().unwrap();
        assert!(e.contains("no network"), "{e}");
        assert!(
            e.contains("huggingface-cli download --repo-type dataset allenai/c4 --include 'en/*'"),
            "{e}"
        );
        assert!(e.contains("--dataset DIR --dataset_config_name en"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let e = open("/no/such/data.jsonl", None, None).err().unwrap();
        assert!(e.contains("no such file") && !e.contains("network"), "{e}");
        // The tokenizer's hub name fails too, once the dataset is found.
        let dir = tempfile::TempDir::new().unwrap();
        write(dir.path(), "d.txt", "x");
        let e = open(s(dir.path()), None, Some("meta-llama/Llama-3.1-8B"))
            .err()
            .unwrap();
        assert!(e.contains("--tokenizer meta-llama/Llama-3.1-8B") && e.contains("no network"));
    }

    #[test]
    fn a_tokenizer_sets_the_vocab_and_ends_documents_with_its_eos() {
        let dir = tempfile::TempDir::new().unwrap();
        let tok = dir.path().join("tok");
        write(
            &tok,
            "tokenizer.json",
            &word_tokenizer_json(&["a", "b", "c"], "<|end_of_text|>"),
        );
        write(
            dir.path(),
            "data/x.jsonl",
            "{\"text\": \"a b c a\"}\n{\"text\": \"c\"}\n",
        );
        write(dir.path(), "data/validation.jsonl", "{\"text\": \"b b\"}\n");
        let c = open(s(&dir.path().join("data")), None, Some(s(&tok))).unwrap();
        assert_eq!(c.vocab(), 6);
        assert_eq!(c.eos(), Some(2));
        // [a b c a EOS c EOS] in windows of 4 every 3: [a b c a], [a EOS c EOS].
        assert_eq!(c.windows_per_epoch(4), 2);
        let mut epoch: Vec<Vec<i64>> = (0..2).map(|i| c.train_sample(i, 4)).collect();
        epoch.sort();
        assert_eq!(epoch, vec![vec![3, 2, 5, 2], vec![3, 4, 5, 3]]);
        assert_eq!(c.validation_sample(0, 3), vec![4, 4, 2]);
    }
}
