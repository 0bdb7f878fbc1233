//! Counting the accelerators `--nproc-per-node gpu|auto` stands for, without CUDA.

use std::path::Path;

/// Visible NVIDIA GPUs: the entries of `CUDA_VISIBLE_DEVICES` when it is set, else the
/// `/dev/nvidiaN` device nodes. The agent does not link CUDA, so this is what the driver
/// exposes to the container; `CUDA_VISIBLE_DEVICES` narrows it as CUDA itself would.
pub fn gpu_count(env: &dyn Fn(&str) -> Option<String>) -> u32 {
    if let Some(list) = env("CUDA_VISIBLE_DEVICES") {
        return list
            .split(',')
            .filter(|d| !d.trim().is_empty() && d.trim() != "-1")
            .count() as u32;
    }
    count_device_nodes(Path::new("/dev"))
}

fn count_device_nodes(dev: &Path) -> u32 {
    std::fs::read_dir(dev)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .and_then(|n| n.strip_prefix("nvidia"))
                        .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
                })
                .count() as u32
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_visible_devices_narrows_the_count() {
        let env = |k: &str| (k == "CUDA_VISIBLE_DEVICES").then(|| "0,2".to_owned());
        assert_eq!(gpu_count(&env), 2);
        let none = |k: &str| (k == "CUDA_VISIBLE_DEVICES").then(String::new);
        assert_eq!(gpu_count(&none), 0);
    }

    #[test]
    fn only_numbered_nvidia_nodes_count() {
        let dir = std::env::temp_dir().join(format!("fsdp-dev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for n in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
            std::fs::write(dir.join(n), b"").unwrap();
        }
        assert_eq!(count_device_nodes(&dir), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
