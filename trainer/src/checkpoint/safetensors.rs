//! Shard files in the safetensors layout (an 8-byte little-endian header length, a JSON
//! header naming each tensor's dtype, shape and byte range, then the raw bytes), written
//! straight from the live tensors a chunk at a time: a save holds one chunk of host memory
//! beside the model instead of a copy of the shard and its serialized bytes. Read back with
//! tch's reader (the `safetensors` crate, the format's reference implementation).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::Path;

use serde::Serialize;
use tch::{Kind, Tensor};

use super::{CheckpointError, invalid, io};

#[cfg(target_endian = "big")]
compile_error!("shard files are little-endian and written from memory as it is");

/// Elements copied to host memory per write: 16 MiB of f32.
const CHUNK: usize = 1 << 22;

/// One tensor of a file: its name, its dtype and its contents, the concatenation of the
/// `(offset, length)` runs of `source` (1-D).
pub struct Entry<'a> {
    pub name: &'a str,
    pub source: &'a Tensor,
    pub runs: &'a [(i64, i64)],
}

#[derive(Serialize)]
struct Info {
    dtype: String,
    shape: Vec<i64>,
    data_offsets: [u64; 2],
}

fn dtype(kind: Kind) -> Option<(&'static str, usize)> {
    match kind {
        Kind::Float => Some(("F32", 4)),
        Kind::Int64 => Some(("I64", 8)),
        _ => None,
    }
}

/// Writes `entries` into `file` (created or truncated). Returns once every byte was handed
/// to the kernel; the caller syncs.
pub fn write(path: &Path, entries: &[Entry]) -> Result<(), CheckpointError> {
    write_in_chunks(path, entries, CHUNK)
}

fn write_in_chunks(path: &Path, entries: &[Entry], chunk: usize) -> Result<(), CheckpointError> {
    let mut header = BTreeMap::new();
    let mut at = 0u64;
    for e in entries {
        let (name, size) = dtype(e.source.kind())
            .ok_or_else(|| invalid(path, format!("tensor {} is {:?}", e.name, e.source.kind())))?;
        let n: i64 = e.runs.iter().map(|&(_, len)| len).sum();
        let bytes = n as u64 * size as u64;
        header.insert(
            e.name.to_owned(),
            Info {
                dtype: name.to_owned(),
                shape: vec![n],
                data_offsets: [at, at + bytes],
            },
        );
        at += bytes;
    }
    let mut json = serde_json::to_vec(&header).map_err(|e| io(path)(e.into()))?;
    // The data starts 8-aligned, as the format asks; each tensor stays aligned to its
    // element when the caller puts the widest elements first.
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = File::create(path).map_err(io(path))?;
    out.write_all(&(json.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(&json))
        .map_err(io(path))?;
    let mut buffer = Vec::new();
    for e in entries {
        let size = dtype(e.source.kind()).map_or(4, |(_, s)| s);
        for &(offset, len) in e.runs {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(chunk as i64);
                buffer.resize(n as usize * size, 0);
                e.source
                    .narrow(0, offset + done, n)
                    .f_copy_data_u8(&mut buffer, n as usize)
                    .map_err(|err| io(path)(std::io::Error::other(err.to_string())))?;
                out.write_all(&buffer).map_err(io(path))?;
                done += n;
            }
        }
        super::slow_point();
    }
    Ok(())
}

/// The tensors of a shard file, by name (read with tch's safetensors reader, the format's
/// reference implementation).
pub fn read(path: &Path) -> Result<BTreeMap<String, Tensor>, CheckpointError> {
    Tensor::read_safetensors(path)
        .map(|named| named.into_iter().collect())
        .map_err(|e| invalid(path, format!("not a whole shard file: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_live_tensors_read_back_as_one_tensor_each() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("x.safetensors");
        let a = Tensor::arange(10, (Kind::Float, tch::Device::Cpu));
        let b = Tensor::from_slice(&[7i64, 8, 9, 10]).view([-1]);
        // Chunks of 2 elements: a run is written in several.
        write_in_chunks(
            &file,
            &[
                Entry {
                    name: "b",
                    source: &b,
                    runs: &[(0, 4)],
                },
                Entry {
                    name: "a",
                    source: &a,
                    runs: &[(1, 2), (6, 3)],
                },
            ],
            2,
        )
        .unwrap();
        let got = read(&file).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(&got["a"]).unwrap(),
            [1.0, 2.0, 6.0, 7.0, 8.0]
        );
        assert_eq!(Vec::<i64>::try_from(&got["b"]).unwrap(), [7, 8, 9, 10]);
        // The header says where each tensor's bytes are, and nothing else is in the file.
        let bytes = std::fs::read(&file).unwrap();
        let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
        assert_eq!(header["b"]["data_offsets"], serde_json::json!([0, 32]));
        assert_eq!(header["a"]["data_offsets"], serde_json::json!([32, 52]));
        assert_eq!(header["a"]["dtype"], "F32");
        assert_eq!(bytes.len(), 8 + len + 52);
    }

    #[test]
    fn a_truncated_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("x.safetensors");
        let a = Tensor::arange(100, (Kind::Float, tch::Device::Cpu));
        write(
            &file,
            &[Entry {
                name: "a",
                source: &a,
                runs: &[(0, 100)],
            }],
        )
        .unwrap();
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() - 4]).unwrap();
        let err = read(&file).unwrap_err().to_string();
        assert!(
            err.contains("x.safetensors") && err.contains("not a whole shard file"),
            "{err}"
        );
    }
}
