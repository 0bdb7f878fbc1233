//! Sharded checkpoints (format 2): every rank writes the elements it holds, in parallel,
//! into one shared partial directory `.step_<N>.tmp.<token>`; once every rank's shard is
//! there, the lead writes the manifest (`meta.json`, naming the shards) last and renames
//! the directory to `step_<N>`. A kill at any moment leaves the newest complete checkpoint
//! as the one resumed: a directory without its manifest is never renamed, and resume only
//! looks at renamed ones.
//!
//! Each shard file (safetensors) holds its rank's `params`, `adam_m` and `adam_v` elements
//! and `runs`, where they go in the whole flat order (`(offset, length)` pairs), so a
//! checkpoint loads on any world size and strategy: the loader assembles the whole state
//! from the runs. The shards are written from the live tensors, without a copy; the
//! optimizer's next update waits until they are read. `.pt` shards (the format's first
//! files) still load.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use tch::Tensor;

use super::safetensors::{self, Entry};
use super::{
    CheckpointError, Meta, crash_point, fsync, invalid, io, name, named_tensors, prune, replace_dir,
};
use crate::shard::{Assembly, FullState, LiveState};

pub const FORMAT: u32 = 2;

/// Where the ranks write step `step`'s shards until the lead renames it; `token` is the
/// same on every rank of one run and differs between runs.
pub fn partial_dir(dir: &Path, step: u64, token: u64) -> PathBuf {
    dir.join(format!(".{}.tmp.{token:x}", name(step)))
}

fn shard_name(rank: usize, world: usize) -> String {
    format!("shard-{rank:05}-of-{world:05}.safetensors")
}

/// Writes this rank's shard into `partial` from the live tensors: under a temporary name,
/// synced, then renamed, so a shard file that exists is whole. `read` is called once the
/// live tensors are no longer read (before the sync), whether the write failed or not.
/// Tensors on a GPU are staged in host memory first and `read` called then.
pub fn write_shard(
    partial: &Path,
    step: u64,
    rank: usize,
    world: usize,
    live: &LiveState,
    read: impl FnOnce(),
) -> Result<PathBuf, CheckpointError> {
    let mut read = Some(read);
    let staged;
    let live = if live.on_host() {
        live
    } else {
        staged = live.to_host();
        if let Some(read) = read.take() {
            read();
        }
        &staged
    };
    let file = partial.join(shard_name(rank, world));
    let part = partial.join(format!("{}.part", shard_name(rank, world)));
    let flat: Vec<i64> = live.runs().iter().flat_map(|&(at, n)| [at, n]).collect();
    let runs = Tensor::from_slice(&flat);
    let whole = [(0, flat.len() as i64)];
    let (in_params, in_moments) = live.offsets();
    let written = fs::create_dir_all(partial)
        .map_err(io(partial))
        .and_then(|()| {
            safetensors::write(
                &part,
                // Widest elements first: every tensor's data stays aligned to its element.
                &[
                    Entry {
                        name: "runs",
                        source: &runs,
                        runs: &whole,
                    },
                    Entry {
                        name: "params",
                        source: &live.params,
                        runs: &in_params,
                    },
                    Entry {
                        name: "adam_m",
                        source: &live.m,
                        runs: &in_moments,
                    },
                    Entry {
                        name: "adam_v",
                        source: &live.v,
                        runs: &in_moments,
                    },
                ],
            )
        });
    if let Some(read) = read {
        read();
    }
    written?;
    fsync(&part)?;
    // Opened before the rename: once the shard is there the lead may rename the directory
    // to `step_<N>` at any moment, and the directory must still be synced after it.
    let dir = fs::File::open(partial).map_err(io(partial))?;
    fs::rename(&part, &file).map_err(io(&file))?;
    dir.sync_all().map_err(io(partial))?;
    if rank == 0 {
        crash_point(step);
    }
    Ok(file)
}

/// The shards of `world` ranks found in `partial` so far (whole ones: renamed into place).
pub fn shards_written(partial: &Path, world: usize) -> usize {
    (0..world)
        .filter(|&r| partial.join(shard_name(r, world)).is_file())
        .count()
}

/// A shard's tensors by name: this trainer's safetensors shards, or the `.pt` archives
/// that earlier ones wrote.
fn shard_tensors(file: &Path) -> Result<BTreeMap<String, Tensor>, CheckpointError> {
    if file.extension().is_some_and(|e| e == "pt") {
        let get = named_tensors(file)?;
        ["params", "adam_m", "adam_v", "runs"]
            .into_iter()
            .map(|n| Ok((n.to_owned(), get(n)?)))
            .collect()
    } else {
        safetensors::read(file)
    }
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
    let mut whole = Assembly::new(total);
    for shard in &meta.shards {
        let file = path.join(shard);
        let tensors = shard_tensors(&file)?;
        let get = |n: &str| {
            tensors
                .get(n)
                .map(Tensor::shallow_clone)
                .ok_or_else(|| invalid(&file, format!("no tensor '{n}'")))
        };
        let runs = get("runs")?;
        if runs.numel() % 2 != 0 {
            return Err(invalid(&file, "its runs are not (offset, length) pairs"));
        }
        let runs = runs.view([-1, 2]);
        let (sp, sm, sv) = (get("params")?, get("adam_m")?, get("adam_v")?);
        if sm.numel() != sp.numel() || sv.numel() != sp.numel() || runs.dim() != 2 {
            return Err(invalid(&file, "its tensors do not match each other"));
        }
        let runs =
            (0..runs.size()[0]).map(|r| (runs.int64_value(&[r, 0]), runs.int64_value(&[r, 1])));
        whole
            .add(runs, [&sp, &sm, &sv])
            .map_err(|why| invalid(&file, why))?;
    }
    whole.finish().map_err(|(covered, total)| {
        invalid(
            path,
            format!("its shards hold {covered} of the model's {total} elements"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a GPU rank writes (its runs staged in host memory) is byte for byte what the
    /// live tensors give, for a rank holding the whole flat model (`shard_grad_op`) and
    /// for one holding its shard only (`full`).
    #[test]
    fn a_shard_staged_in_host_memory_is_the_shard_read_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let whole = Tensor::arange(40, (tch::Kind::Float, tch::Device::Cpu));
        let moments = Tensor::arange(12, (tch::Kind::Float, tch::Device::Cpu)) * 0.5;
        // This rank's elements: flat 4..10 (local 0..6) and flat 20..26 (local 6..12).
        let pieces = vec![(4, 0, 6), (20, 6, 6)];
        let local = Tensor::cat(&[whole.narrow(0, 4, 6), whole.narrow(0, 20, 6)], 0);
        for (params, flat) in [(&whole, true), (&local, false)] {
            let live = LiveState::new(pieces.clone(), params, flat, &moments, &(&moments + 1.0));
            let staged = live.to_host();
            assert!(!staged.params_flat);
            assert_eq!(staged.params.numel(), 12);
            let mut read = 0;
            let a = write_shard(&dir.path().join("a"), 1, 0, 2, &live, || read += 1).unwrap();
            let b = write_shard(&dir.path().join("b"), 1, 0, 2, &staged, || read += 1).unwrap();
            assert_eq!(read, 2);
            assert_eq!(
                fs::read(a).unwrap(),
                fs::read(b).unwrap(),
                "params_flat {flat}"
            );
            let got = shard_tensors(&dir.path().join("b").join(shard_name(0, 2))).unwrap();
            assert_eq!(
                Vec::<f32>::try_from(&got["params"]).unwrap(),
                [
                    4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 20.0, 21.0, 22.0, 23.0, 24.0, 25.0
                ]
            );
            fs::remove_dir_all(dir.path().join("a")).unwrap();
            fs::remove_dir_all(dir.path().join("b")).unwrap();
        }
    }

    #[test]
    fn shards_of_the_first_files_pt_archives_still_load() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("shard-00000-of-00001.pt");
        let params = Tensor::from_slice(&[1.0f32, 2.0]);
        let runs = Tensor::from_slice(&[0i64, 2]).view([-1, 2]);
        Tensor::save_multi(
            &[
                ("params", &params),
                ("adam_m", &params),
                ("adam_v", &params),
                ("runs", &runs),
            ],
            &file,
        )
        .unwrap();
        let got = shard_tensors(&file).unwrap();
        assert_eq!(got.len(), 4);
        assert_eq!(
            Vec::<i64>::try_from(got["runs"].view([-1])).unwrap(),
            [0, 2]
        );
        assert_eq!(Vec::<f32>::try_from(&got["adam_v"]).unwrap(), [1.0, 2.0]);
    }
}
