//! Which files of a dataset are read, for which split, and the documents in them.
//!
//! * `.jsonl` and `.json` are JSON Lines (as the hub ships them, e.g. allenai/c4's
//!   `en/c4-train.00000-of-01024.json.gz`): one object per line whose `text` string is a
//!   document; other fields are ignored, blank lines skipped.
//! * `.txt` is one document, the whole file.
//! * Each may be gzipped (`.gz`).
//!
//! In a directory (searched recursively, in name order, hidden entries such as `.cache/`
//! skipped), a file or directory whose name has the word `validation`, `valid`, `val` or
//! `dev` in it (words split at `-`, `_`, `.`: `validation.jsonl`, `validation/`,
//! `c4-validation.00000-of-00008.json.gz`) holds validation data, and one with `test` or
//! `testing` is not read at all; the rest is training data. Parquet, Arrow, CSV and other
//! compressions are refused by name; other files (`README.md`, `LICENSE`) are ignored.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// How a file's documents are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    JsonLines,
    Text,
}

/// A file to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DataFile {
    pub path: PathBuf,
    pub format: Format,
    pub gzip: bool,
}

/// The files of each split, in reading order.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Layout {
    pub train: Vec<DataFile>,
    pub validation: Vec<DataFile>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    Train,
    Validation,
    Test,
}

/// The split a file or directory name announces, if any.
fn split_word(name: &str) -> Option<Split> {
    name.to_ascii_lowercase()
        .split(['-', '_', '.', ' '])
        .find_map(|word| match word {
            "validation" | "valid" | "val" | "dev" => Some(Split::Validation),
            "test" | "testing" => Some(Split::Test),
            _ => None,
        })
}

/// A relative path's split: the first of its components (from the top) that names one.
fn split_of(relative: &Path) -> Split {
    relative
        .iter()
        .find_map(|c| split_word(&c.to_string_lossy()))
        .unwrap_or(Split::Train)
}

/// A file's format and compression from its name; `Ok(None)` for files that are not
/// data, an error for data this reader refuses.
fn format_of(name: &str) -> Result<Option<(Format, bool)>, String> {
    let lower = name.to_ascii_lowercase();
    let (stem, gzip) = match lower.strip_suffix(".gz") {
        Some(stem) => (stem, true),
        None => (lower.as_str(), false),
    };
    if stem.ends_with(".jsonl") || stem.ends_with(".json") {
        return Ok(Some((Format::JsonLines, gzip)));
    }
    if stem.ends_with(".txt") {
        return Ok(Some((Format::Text, gzip)));
    }
    let refused = |why: &str| Err(format!("{name}: {why}"));
    if stem.ends_with(".parquet") {
        return refused(
            "Parquet is not read; convert it to JSON Lines (e.g. pandas.read_parquet(f)\
             .to_json(\"train.jsonl\", orient=\"records\", lines=True))",
        );
    }
    if stem.ends_with(".arrow") {
        return refused(
            "Arrow files (the `datasets` cache) are not read; write the split as JSON Lines \
             (datasets' Dataset.to_json(\"train.jsonl\")) or download the raw files with \
             `huggingface-cli download --repo-type dataset`",
        );
    }
    let other = [
        ".csv", ".tsv", ".zst", ".bz2", ".xz", ".zip", ".tar", ".lz4",
    ];
    if gzip || other.iter().any(|ext| stem.ends_with(ext)) {
        return refused(
            "this format is not read; pass JSON Lines (.jsonl or .json) or .txt, each \
             optionally gzipped",
        );
    }
    Ok(None)
}

/// The files to read for `relative_files` (paths under the dataset directory, any order).
fn plan(root: &Path, mut relative_files: Vec<PathBuf>) -> Result<Layout, String> {
    relative_files.sort();
    let mut layout = Layout::default();
    for rel in &relative_files {
        let name = rel.file_name().unwrap_or_default().to_string_lossy();
        let Some((format, gzip)) =
            format_of(&name).map_err(|e| format!("--dataset {}: {e}", root.display()))?
        else {
            continue;
        };
        let file = DataFile {
            path: root.join(rel),
            format,
            gzip,
        };
        match split_of(rel) {
            Split::Train => layout.train.push(file),
            Split::Validation => layout.validation.push(file),
            Split::Test => {}
        }
    }
    if layout.train.is_empty() {
        let found: Vec<String> = relative_files
            .iter()
            .take(8)
            .map(|p| p.display().to_string())
            .collect();
        return Err(format!(
            "--dataset {}: no training files (.jsonl, .json or .txt, optionally .gz, whose \
             names do not say validation or test); found: {}",
            root.display(),
            if found.is_empty() {
                "nothing".to_owned()
            } else {
                found.join(", ")
            }
        ));
    }
    Ok(layout)
}

/// The files of the dataset at `root`: the file itself (training data), or a directory's.
pub(crate) fn layout(root: &Path) -> Result<Layout, String> {
    if root.is_dir() {
        let mut files = Vec::new();
        walk(root, Path::new(""), &mut files)?;
        return plan(root, files);
    }
    let name = root.file_name().unwrap_or_default().to_string_lossy();
    match format_of(&name).map_err(|e| format!("--dataset {e}"))? {
        Some((format, gzip)) => Ok(Layout {
            train: vec![DataFile {
                path: root.to_path_buf(),
                format,
                gzip,
            }],
            validation: Vec::new(),
        }),
        None => Err(format!(
            "--dataset {}: not a .jsonl, .json or .txt file (optionally .gz), nor a directory \
             of them",
            root.display()
        )),
    }
}

/// Files under `dir/rel`, relative to `dir`, skipping hidden entries.
fn walk(dir: &Path, rel: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let here = dir.join(rel);
    let entries =
        std::fs::read_dir(&here).map_err(|e| format!("--dataset {}: {e}", here.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("--dataset {}: {e}", here.display()))?;
        let name = entry.file_name();
        if name.to_string_lossy().starts_with('.') {
            continue;
        }
        let child = rel.join(&name);
        // Follows symbolic links, as the hub cache's snapshots are links to blobs.
        if entry.path().is_dir() {
            walk(dir, &child, out)?;
        } else {
            out.push(child);
        }
    }
    Ok(())
}

/// Calls `document` with each document of `file`, in order.
pub(crate) fn read_documents(
    file: &DataFile,
    document: &mut dyn FnMut(String) -> Result<(), String>,
) -> Result<(), String> {
    let shown = file.path.display();
    let raw = std::fs::File::open(&file.path).map_err(|e| format!("{shown}: {e}"))?;
    let reader: Box<dyn Read> = if file.gzip {
        Box::new(flate2::read::MultiGzDecoder::new(raw))
    } else {
        Box::new(raw)
    };
    let mut reader = BufReader::new(reader);
    match file.format {
        Format::Text => {
            let mut text = String::new();
            reader
                .read_to_string(&mut text)
                .map_err(|e| format!("{shown}: {e}"))?;
            document(text)
        }
        Format::JsonLines => {
            let mut line = String::new();
            for number in 1.. {
                line.clear();
                let read = reader
                    .read_line(&mut line)
                    .map_err(|e| format!("{shown} line {number}: {e}"))?;
                if read == 0 {
                    break;
                }
                if let Some(text) =
                    text_of_line(&line).map_err(|e| format!("{shown} line {number}: {e}"))?
                {
                    document(text)?;
                }
            }
            Ok(())
        }
    }
}

/// The `text` of one JSON Lines line; `None` for a blank line.
fn text_of_line(line: &str) -> Result<Option<String>, String> {
    #[derive(serde::Deserialize)]
    struct Line {
        text: Option<String>,
    }
    let line = line.trim();
    if line.is_empty() {
        return Ok(None);
    }
    // A struct also deserializes from an array (`["..."]` as its fields in order).
    if !line.starts_with('{') {
        return Err("expected a JSON object with a \"text\" string".to_owned());
    }
    let parsed: Line = serde_json::from_str(line)
        .map_err(|e| format!("expected a JSON object with a \"text\" string: {e}"))?;
    match parsed.text {
        Some(text) => Ok(Some(text)),
        None => Err(
            "no \"text\" field; each line must be a JSON object with a \"text\" string".to_owned(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(names: &[&str]) -> Vec<PathBuf> {
        names.iter().map(PathBuf::from).collect()
    }

    fn names(files: &[DataFile]) -> Vec<String> {
        files
            .iter()
            .map(|f| f.path.strip_prefix("/d").unwrap().display().to_string())
            .collect()
    }

    #[test]
    fn split_words_pick_validation_and_test_files() {
        let layout = plan(
            Path::new("/d"),
            paths(&[
                "validation.jsonl",
                "train.jsonl",
                "README.md",
                "en/c4-validation.00000-of-00008.json.gz",
                "en/c4-train.00001-of-01024.json.gz",
                "en/c4-train.00000-of-01024.json.gz",
                "test.jsonl",
                "validation/part-1.txt",
                "dev_set.txt",
                "medieval.txt",
                "contest-data.jsonl",
            ]),
        )
        .unwrap();
        assert_eq!(
            names(&layout.train),
            [
                "contest-data.jsonl",
                "en/c4-train.00000-of-01024.json.gz",
                "en/c4-train.00001-of-01024.json.gz",
                "medieval.txt",
                "train.jsonl"
            ]
        );
        assert_eq!(
            names(&layout.validation),
            [
                "dev_set.txt",
                "en/c4-validation.00000-of-00008.json.gz",
                // Component by component: the directory `validation` before
                // `validation.jsonl`.
                "validation/part-1.txt",
                "validation.jsonl"
            ]
        );
        assert!(layout.train[1].gzip && layout.train[1].format == Format::JsonLines);
        assert!(!layout.train[3].gzip && layout.train[3].format == Format::Text);
    }

    #[test]
    fn refused_formats_are_named_and_other_files_ignored() {
        let e = plan(Path::new("/d"), paths(&["train-00000.parquet"])).unwrap_err();
        assert!(
            e.contains("train-00000.parquet: Parquet is not read"),
            "{e}"
        );
        let e = plan(Path::new("/d"), paths(&["data-00000-of-00001.arrow"])).unwrap_err();
        assert!(e.contains("the `datasets` cache"), "{e}");
        let e = plan(Path::new("/d"), paths(&["train.csv.gz"])).unwrap_err();
        assert!(e.contains("train.csv.gz: this format is not read"), "{e}");
        let e = plan(Path::new("/d"), paths(&["README.md", "validation.jsonl"])).unwrap_err();
        assert!(
            e.contains("no training files") && e.contains("found: README.md, validation.jsonl"),
            "{e}"
        );
        assert_eq!(format_of("LICENSE"), Ok(None));
        assert_eq!(format_of("a.TXT"), Ok(Some((Format::Text, false))));
    }

    #[test]
    fn a_line_needs_a_text_string() {
        assert_eq!(
            text_of_line("{\"id\": 3, \"text\": \"hi\", \"url\": \"x\"}\n"),
            Ok(Some("hi".to_owned()))
        );
        assert_eq!(text_of_line("  \n"), Ok(None));
        assert!(
            text_of_line("{\"id\": 3}")
                .unwrap_err()
                .contains("no \"text\" field")
        );
        assert!(
            text_of_line("{\"text\": null}")
                .unwrap_err()
                .contains("no \"text\" field")
        );
        let e = text_of_line("{\"text\": 5}").unwrap_err();
        assert!(
            e.contains("expected a JSON object with a \"text\" string"),
            "{e}"
        );
        assert!(text_of_line("{\"text\": \"a\"").is_err());
        assert!(text_of_line("[\"a\"]").is_err());
    }
}
