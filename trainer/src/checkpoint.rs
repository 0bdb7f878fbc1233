//! Checkpoints: one directory per save, written under a temporary name and renamed into
//! place, so a kill at any moment leaves either the new checkpoint whole or nothing of it;
//! resume only looks at renamed directories.
//!
//! Two formats: [`sharded`] (2, the default: every rank writes its part in the background,
//! [`writer`]) and the gathered one (1, `step_<N>/{state.pt, meta.json}` written by the lead
//! alone, `--sharded_checkpoints=0`). Both load on any world size and strategy.

pub mod safetensors;
pub mod sharded;
pub mod writer;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::args::Sharding;
use crate::model::ModelConfig;
use crate::shard::FullState;

/// The gathered format.
pub const FORMAT: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Meta {
    pub format: u32,
    /// Steps completed; training resumes at this step.
    pub step: u64,
    /// Global samples consumed; the next step starts at this sample.
    pub samples_seen: u64,
    pub adam_step: u64,
    pub model: ModelConfig,
    pub world_size: usize,
    pub sharding: Sharding,
    pub loss: f64,
    /// Format 2: the shard files, one per rank that saved.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint I/O at {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    }
}

pub(crate) fn invalid(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::Invalid {
        path: path.to_owned(),
        message: message.into(),
    }
}

pub(crate) fn name(step: u64) -> String {
    format!("step_{step:08}")
}

fn step_of(p: &Path) -> Option<u64> {
    p.file_name()?.to_str()?.strip_prefix("step_")?.parse().ok()
}

pub(crate) fn fsync(path: &Path) -> Result<(), CheckpointError> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

/// Writes a checkpoint into `dir` and keeps only the newest `keep`.
pub fn save(
    dir: &Path,
    meta: &Meta,
    state: &FullState,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    fs::create_dir_all(dir).map_err(io(dir))?;
    let final_path = dir.join(name(meta.step));
    let tmp = dir.join(format!(".{}.tmp.{}", name(meta.step), std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    fs::create_dir(&tmp).map_err(io(&tmp))?;
    let state_file = tmp.join("state.pt");
    fs::write(&state_file, serialize(&state_file, state)?).map_err(io(&state_file))?;
    fsync(&state_file)?;
    crash_point(meta.step);
    let meta_file = tmp.join("meta.json");
    let json = serde_json::to_vec_pretty(meta).map_err(|e| io(&meta_file)(e.into()))?;
    fs::write(&meta_file, json).map_err(io(&meta_file))?;
    fsync(&meta_file)?;
    fsync(&tmp)?;
    replace_dir(&tmp, &final_path)?;
    fsync(dir)?;
    prune(dir, keep, &format!(".tmp.{}", std::process::id()))?;
    Ok(final_path)
}

/// Renames `from` to `to`. A `to` already there (the same step saved again after a
/// restart) is moved aside first and removed after, so a kill in between never leaves
/// neither.
pub(crate) fn replace_dir(from: &Path, to: &Path) -> Result<(), CheckpointError> {
    let aside = to.with_extension("old");
    let had = to.exists();
    if had {
        let _ = fs::remove_dir_all(&aside);
        fs::rename(to, &aside).map_err(io(to))?;
    }
    fs::rename(from, to).map_err(io(to))?;
    if had {
        fs::remove_dir_all(&aside).map_err(io(&aside))?;
    }
    Ok(())
}

/// The state in PyTorch's archive format, in memory. Written to a file by libtorch itself,
/// a failed write (a full disk) aborts the process: its archive writer throws again from
/// its destructor. In memory nothing can fail that way, and the file is written by `std`,
/// whose errors are I/O errors (exit 1), not bad input.
fn serialize(path: &Path, state: &FullState) -> Result<Vec<u8>, CheckpointError> {
    to_bytes(
        path,
        &[
            ("params", &state.params),
            ("adam_m", &state.m),
            ("adam_v", &state.v),
        ],
    )
}

/// Named tensors in PyTorch's archive format, in memory.
pub(crate) fn to_bytes(path: &Path, named: &[(&str, &Tensor)]) -> Result<Vec<u8>, CheckpointError> {
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);
    impl Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buffer = Buffer::default();
    Tensor::save_multi_to_stream(named, buffer.clone())
        .map_err(|e| io(path)(std::io::Error::other(e.to_string())))?;
    let bytes = std::mem::take(&mut *buffer.0.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(bytes)
}

/// Test hook: `FSDP_TRAINER_CRASH_IN_SAVE=<step>` aborts half-way through that step's
/// save, as a kill would, to prove resume never sees the half-written checkpoint.
pub(crate) fn crash_point(step: u64) {
    if std::env::var("FSDP_TRAINER_CRASH_IN_SAVE")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        == Some(step)
    {
        eprintln!(
            "fsdp-trainer: FSDP_TRAINER_CRASH_IN_SAVE={step}: aborting in the middle of the save"
        );
        std::process::abort();
    }
}

/// Test hook: `FSDP_TRAINER_SLOW_SAVE_MS=<ms>` makes a shard writer pause that long after
/// each tensor it reads, to prove training does not change what it has yet to read.
pub(crate) fn slow_point() {
    static PAUSE: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    let pause = PAUSE.get_or_init(|| {
        std::env::var("FSDP_TRAINER_SLOW_SAVE_MS")
            .ok()
            .and_then(|s| s.parse().ok())
    });
    if let Some(ms) = pause {
        std::thread::sleep(std::time::Duration::from_millis(*ms));
    }
}

/// Deletes all but the newest `keep` checkpoints and leftovers of interrupted saves.
/// `ours` is the suffix of this run's own partial directories (`.tmp.<pid>` for the
/// gathered format, `.tmp.<token>` for the sharded one): another rank may already be
/// writing the next save into one of them.
pub(crate) fn prune(dir: &Path, keep: usize, ours: &str) -> Result<(), CheckpointError> {
    let mut complete = list(dir)?;
    complete.sort_by_key(|(s, _)| *s);
    let excess = complete.len().saturating_sub(keep.max(1));
    for (_, p) in complete.into_iter().take(excess) {
        fs::remove_dir_all(&p).map_err(io(&p))?;
    }
    for e in fs::read_dir(dir).map_err(io(dir))?.flatten() {
        let n = e.file_name();
        let n = n.to_string_lossy();
        if n.starts_with(".step_") && n.contains(".tmp.") && !n.ends_with(ours) {
            let _ = fs::remove_dir_all(e.path());
        }
    }
    Ok(())
}

/// Complete checkpoints in `dir`: renamed `step_N` directories holding `meta.json` (the
/// manifest, written last in either format).
fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).map_err(io(dir))?.flatten() {
        let p = e.path();
        if let Some(s) = step_of(&p) {
            if p.join("meta.json").is_file() {
                out.push((s, p));
            }
        }
    }
    Ok(out)
}

/// The checkpoint to resume from: `path` itself if it is one, else the newest complete one
/// inside it; `None` if there is none yet (a first run pointed at its own output dir).
pub fn find(path: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    if path.join("meta.json").is_file() {
        return Ok(Some(path.to_owned()));
    }
    if !path.exists() {
        return Ok(None);
    }
    Ok(list(path)?
        .into_iter()
        .max_by_key(|(s, _)| *s)
        .map(|(_, p)| p))
}

/// The tensors of `file`, to take by name (a missing one is an error naming it).
pub(crate) fn named_tensors(
    file: &Path,
) -> Result<impl Fn(&str) -> Result<Tensor, CheckpointError> + '_, CheckpointError> {
    let tensors = Tensor::load_multi(file).map_err(|e| invalid(file, e.to_string()))?;
    Ok(move |n: &str| {
        tensors
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, t)| t.shallow_clone())
            .ok_or_else(|| invalid(file, format!("no tensor '{n}'")))
    })
}

/// Reads a checkpoint and checks it fits `model`.
pub fn load(path: &Path, model: &ModelConfig) -> Result<(Meta, FullState), CheckpointError> {
    let meta_file = path.join("meta.json");
    let text = fs::read(&meta_file).map_err(io(&meta_file))?;
    let meta: Meta = serde_json::from_slice(&text)
        .map_err(|e| invalid(&meta_file, format!("unreadable meta.json: {e}")))?;
    if meta.format != FORMAT && meta.format != sharded::FORMAT {
        return Err(invalid(
            path,
            format!(
                "format {} (this trainer reads {FORMAT} and {})",
                meta.format,
                sharded::FORMAT
            ),
        ));
    }
    let diff = model.differences(&meta.model);
    if !diff.is_empty() {
        return Err(invalid(
            path,
            format!(
                "it was saved for another model shape ({}); use matching flags or another --checkpoint_dir",
                diff.join("; ")
            ),
        ));
    }
    if meta.format == sharded::FORMAT {
        let total = model
            .layout()
            .iter()
            .map(|(_, s)| s.iter().product::<i64>())
            .sum();
        let state = sharded::load(path, &meta, total)?;
        return Ok((meta, state));
    }
    let state_file = path.join("state.pt");
    let get = named_tensors(&state_file)?;
    Ok((
        meta,
        FullState {
            params: get("params")?,
            m: get("adam_m")?,
            v: get("adam_v")?,
        },
    ))
}
