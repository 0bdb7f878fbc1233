//! Sharded checkpoints (format 2): every rank writes the elements it holds, in parallel,
//! into one shared partial directory `.step_<N>.tmp.<token>`; once every rank's shard is
//! there, the lead writes the manifest (`meta.json`, naming the shards) last and renames
//! the directory to `step_<N>`. A kill at any moment leaves the newest complete checkpoint
//! as the one resumed: a directory without its manifest is never renamed, and resume only
//! looks at renamed ones.
//!
//! Each shard file holds its ranks's `params`, `adam_m` and `adam_v` elements and `runs`,
//! where they go in the whole flat order, so a checkpoint loads on any world size and
//! strategy: the loader assembles the whole state from the runs.

use std::fs;
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use super::{
    CheckpointError, Meta, crash_point, fsync, invalid, io, name, named_tensors, prune,
    replace_dir, to_bytes,
};
use crate::shard::{FullState, LocalState};

pub const FORMAT: u32 = 2;

/// Where the ranks write step `step`'s shards until the lead renames it; `token` is the
/// same on every rank of one run and differs between runs.
pub fn partial_dir(dir: &Path, step: u64, token: u64) -> PathBuf {
    dir.join(format!(".{}.tmp.{token:x}", name(step)))
}

fn shard_name(rank: usize, world: usize) -> String {
    format!("shard-{rank:05}-of-{world:05}.pt")
}

/// Writes this rank's shard into `partial`: under a temporary name, synced, then renamed,
/// so a shard file that exists is whole.
pub fn write_shard(
    partial: &Path,
    step: u64,
    rank: usize,
    world: usize,
    local: &LocalState,
) -> Result<PathBuf, CheckpointError> {
    fs::create_dir_all(partial).map_err(io(partial))?;
    let file = partial.join(shard_name(rank, world));
    let part = partial.join(format!("{}.part", shard_name(rank, world)));
    let flat: Vec<i64> = local.runs.iter().flat_map(|&(at, n)| [at, n]).collect();
    let runs = Tensor::from_slice(&flat).view([-1, 2]);
    let bytes = to_bytes(
        &file,
        &[
            ("params", &local.params),
            ("adam_m", &local.m),
            ("adam_v", &local.v),
            ("runs", &runs),
        ],
    )?;
    fs::write(&part, bytes).map_err(io(&part))?;
    fsync(&part)?;
    fs::rename(&part, &file).map_err(io(&file))?;
    fsync(partial)?;
    if rank == 0 {
        crash_point(step);
    }
    Ok(file)
}

/// The lead, once every rank's shard is written: the manifest last, then the rename that
/// makes the checkpoint complete; older checkpoints beyond `keep` and leftovers go.
pub fn finish(
    dir: &Path,
    partial: &Path,
    meta: &Meta,
    world: usize,
    keep: usize,
    token: u64,
) -> Result<PathBuf, CheckpointError> {
    let shards: Vec<String> = (0..world).map(|r| shard_name(r, world)).collect();
    if let Some(missing) = shards.iter().find(|s| !partial.join(s).is_file()) {
        return Err(invalid(
            partial,
            format!(
                "shard {missing} is missing though its rank wrote it: every rank must see the same --checkpoint_dir (a filesystem all nodes share)"
            ),
        ));
    }
    let meta = Meta {
        format: FORMAT,
        shards,
        ..meta.clone()
    };
    let meta_file = partial.join("meta.json");
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| io(&meta_file)(e.into()))?;
    fs::write(&meta_file, json).map_err(io(&meta_file))?;
    fsync(&meta_file)?;
    fsync(partial)?;
    let final_path = dir.join(name(meta.step));
    replace_dir(partial, &final_path)?;
    fsync(dir)?;
    prune(dir, keep, &format!(".tmp.{token:x}"))?;
    Ok(final_path)
}

/// The whole state of a sharded checkpoint, assembled from its shards' runs.
pub fn load(path: &Path, meta: &Meta, total: i64) -> Result<FullState, CheckpointError> {
    let zeros = || Tensor::zeros([total], (Kind::Float, tch::Device::Cpu));
    let (params, m, v) = (zeros(), zeros(), zeros());
    let mut covered = 0;
    for shard in &meta.shards {
        let file = path.join(shard);
        let get = named_tensors(&file)?;
        let runs = get("runs")?;
        let (sp, sm, sv) = (get("params")?, get("adam_m")?, get("adam_v")?);
        if sm.numel() != sp.numel() || sv.numel() != sp.numel() || runs.dim() != 2 {
            return Err(invalid(&file, "its tensors do not match each other"));
        }
        let mut at = 0;
        for r in 0..runs.size()[0] {
            let (flat_at, n) = (runs.int64_value(&[r, 0]), runs.int64_value(&[r, 1]));
            if flat_at < 0 || n < 0 || flat_at + n > total || at + n > sp.numel() as i64 {
                return Err(invalid(&file, "its runs do not fit the model"));
            }
            for (dst, src) in [(&params, &sp), (&m, &sm), (&v, &sv)] {
                dst.narrow(0, flat_at, n).copy_(&src.narrow(0, at, n));
            }
            at += n;
            covered += n;
        }
    }
    if covered != total {
        return Err(invalid(
            path,
            format!("its shards hold {covered} of the model's {total} elements"),
        ));
    }
    Ok(FullState { params, m, v })
}
