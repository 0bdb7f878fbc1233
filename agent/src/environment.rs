//! The node's own environment, when a worker fails: a local filesystem it writes to that
//! is full fails every attempt alike, on this node only. Outside testing saw a full log
//! directory spend a three-node job's whole restart budget in 9 s (every rank restarted
//! each time) and then quarantine the machine for an hour, with nothing saying why.
//!
//! So a failed worker is followed by a look at the working directory's filesystem; a full
//! one is named, and the node leaves the group as unhealthy (exit 79, so that the pod is
//! replaced) instead of charging the job. Only a local filesystem is this node's fault: a
//! full shared one (NFS, Lustre) fails every node alike, and replacing pods would loop
//! where the restart budget should end the job. The log directory is not looked at: its
//! lines go through the agent, so a full one never fails a worker.

use std::path::{Path, PathBuf};

/// Below this much free space a filesystem counts as full: writes of checkpoints, logs or
/// a traceback fail there.
pub const FULL_BELOW: u64 = 1 << 20;

/// One filesystem the workers write to: what it is to them, a path on it, and its free
/// and total bytes (`None`: could not be asked, or not local to this node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub what: &'static str,
    pub path: PathBuf,
    pub space: Option<(u64, u64)>,
}

/// Filesystems that live on this node (`statfs`'s `f_type`): ext2/3/4, XFS, Btrfs, tmpfs,
/// overlayfs (a container's root), ZFS, F2FS, ramfs. Anything else (NFS, Lustre, CIFS,
/// GPFS, Ceph, FUSE) may be shared, and is not judged.
const LOCAL: [i64; 8] = [
    0xEF53,
    0x5846_5342,
    0x9123_683E,
    0x0102_1994,
    0x794C_7630,
    0x2FC1_2FC1,
    0xF2F5_2010,
    0x8584_58F6,
];

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

/// Asks the working directory's filesystem for its space, if it is local. Blocks on a hung
/// mount: call it where that costs nothing (the log-file thread, with a deadline).
#[allow(
    clippy::unnecessary_cast,
    clippy::useless_conversion,
    reason = "the field types differ between targets"
)]
pub fn look(cwd: &Path) -> Vec<Place> {
    let local = nix::sys::statfs::statfs(cwd)
        .is_ok_and(|s| LOCAL.contains(&(s.filesystem_type().0 as i64)));
    let space = local
        .then(|| nix::sys::statvfs::statvfs(cwd).ok())
        .flatten()
        .map(|s| {
            let unit = s.fragment_size() as u64;
            (
                (s.blocks_available() as u64).saturating_mul(unit),
                (s.blocks() as u64).saturating_mul(unit),
            )
        });
    vec![Place {
        what: "working directory",
        path: cwd.to_path_buf(),
        space,
    }]
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
    fn a_local_filesystem_answers_and_a_pseudo_one_is_not_judged() {
        let tmp = std::env::temp_dir();
        let places = look(&tmp);
        assert_eq!(places.len(), 1);
        assert!(
            places[0].space.is_some_and(|(f, t)| f <= t),
            "{tmp:?} is local here: {places:?}"
        );
        // procfs is not among the local kinds: never judged, whatever it reports.
        assert_eq!(look(Path::new("/proc"))[0].space, None);
    }
}
