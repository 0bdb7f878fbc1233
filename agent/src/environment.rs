//! The node's own environment, when a worker fails: a filesystem it writes to that is
//! full fails every attempt alike, on this node only. Outside testing saw a full log
//! directory spend a three-node job's whole restart budget in 9 s (every rank restarted
//! each time) and then quarantine the machine for an hour, with nothing saying why.
//!
//! So a failed worker is followed by a look at the log directory's and the working
//! directory's filesystems; a full one is named, and the node leaves the group as
//! unhealthy (exit 79, so that the pod is replaced) instead of charging the job.

use std::path::{Path, PathBuf};

/// Below this much free space a filesystem counts as full: writes of checkpoints, logs or
/// a traceback fail there.
pub const FULL_BELOW: u64 = 1 << 20;

/// One filesystem the workers write to: what it is to them, a path on it, and its free
/// and total bytes (`None`: could not be asked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub what: &'static str,
    pub path: PathBuf,
    pub space: Option<(u64, u64)>,
}

/// The full filesystems among `places`, in words; `None` when none is full.
pub fn full(places: &[Place]) -> Option<String> {
    let said: Vec<String> = places
        .iter()
        .filter_map(|p| {
            let (free, total) = p.space?;
            (free < FULL_BELOW).then(|| {
                format!(
                    "the {}'s filesystem is full ({} free of {} at {})",
                    p.what,
                    bytes(free),
                    bytes(total),
                    p.path.display()
                )
            })
        })
        .collect();
    (!said.is_empty()).then(|| said.join("; "))
}

/// Asks the filesystems of `log_dir` (if any) and `cwd` for their space. Blocks on a hung
/// mount: call it where that costs nothing (the log-file thread, with a deadline).
#[allow(
    clippy::unnecessary_cast,
    reason = "the block counts are u64 here, 32 bits on other targets"
)]
pub fn look(log_dir: Option<&Path>, cwd: Option<&Path>) -> Vec<Place> {
    let ask = |path: &Path| {
        nix::sys::statvfs::statvfs(path).ok().map(|s| {
            let unit = s.fragment_size() as u64;
            (
                (s.blocks_available() as u64).saturating_mul(unit),
                (s.blocks() as u64).saturating_mul(unit),
            )
        })
    };
    let mut places = Vec::new();
    for (what, path) in [("log directory", log_dir), ("working directory", cwd)] {
        if let Some(path) = path {
            places.push(Place {
                what,
                path: path.to_path_buf(),
                space: ask(path),
            });
        }
    }
    places
}

fn bytes(n: u64) -> String {
    const KIB: u64 = 1 << 10;
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= KIB => format!("{} KiB", n / KIB),
        n => format!("{n} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(what: &'static str, free: u64, total: u64) -> Place {
        Place {
            what,
            path: PathBuf::from(format!("/mnt/{}", what.replace(' ', "-"))),
            space: Some((free, total)),
        }
    }

    #[test]
    fn a_full_filesystem_is_named_with_its_space_and_path() {
        let places = [
            place("log directory", 0, 1 << 20),
            place("working directory", 40 << 30, 100 << 30),
        ];
        assert_eq!(
            full(&places).as_deref(),
            Some(
                "the log directory's filesystem is full (0 B free of 1.0 MiB at /mnt/log-directory)"
            )
        );
        let both = [
            place("log directory", 12 << 10, 1 << 30),
            place("working directory", 100, 4 << 20),
        ];
        assert_eq!(
            full(&both).as_deref(),
            Some(
                "the log directory's filesystem is full (12 KiB free of 1.0 GiB at /mnt/log-directory); \
                 the working directory's filesystem is full (100 B free of 4.0 MiB at /mnt/working-directory)"
            )
        );
    }

    #[test]
    fn room_or_no_answer_is_not_full() {
        assert_eq!(full(&[place("log directory", FULL_BELOW, 1 << 30)]), None);
        let unknown = Place {
            space: None,
            ..place("working directory", 0, 0)
        };
        assert_eq!(full(&[unknown]), None);
        assert_eq!(full(&[]), None);
    }

    #[test]
    fn this_machine_s_filesystems_answer() {
        let places = look(Some(Path::new("/")), Some(Path::new(".")));
        assert_eq!(places.len(), 2);
        assert!(places.iter().all(|p| p.space.is_some_and(|(f, t)| f <= t)));
    }
}
