//! The files `scripts/dist.sh` builds, the wheel and the plain binary, found through
//! `FSDP_DIST_DIR` (scripts/test.sh builds them into target/dist-test before the suite).
//! A missing or ambiguous file fails the test that asks for it: an install test that skips
//! would prove nothing.

use std::path::{Path, PathBuf};

/// The directory holding `scripts/dist.sh`'s output.
pub const DIST_DIR_VAR: &str = "FSDP_DIST_DIR";

/// The wheel (`fsdp_agent-*.whl`) and the plain binary (`fsdp-agent-*-linux-gnu`).
pub struct Dist {
    pub wheel: PathBuf,
    pub binary: PathBuf,
}

/// The artefacts in `$FSDP_DIST_DIR`; panics with the command that makes them.
pub fn dist() -> Dist {
    let dir = std::env::var_os(DIST_DIR_VAR)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!(
                "{DIST_DIR_VAR} is not set: run `scripts/dist.sh DIR` and set \
                 {DIST_DIR_VAR}=DIR (scripts/test.sh does both)"
            )
        });
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{DIST_DIR_VAR}={}: {e}", dir.display()))
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let (wheel, binary) = pick_artefacts(&names).unwrap_or_else(|e| {
        panic!(
            "{DIST_DIR_VAR}={}: {e}: run scripts/dist.sh {0}",
            dir.display()
        )
    });
    Dist {
        wheel: dir.join(wheel),
        binary: dir.join(binary),
    }
}

/// Exactly one wheel and one binary among a directory's file names.
pub fn pick_artefacts(names: &[String]) -> Result<(&str, &str), String> {
    let one = |what: &str, matches: &dyn Fn(&str) -> bool| {
        let found: Vec<&str> = names
            .iter()
            .map(String::as_str)
            .filter(|n| matches(n))
            .collect();
        match found[..] {
            [name] => Ok(name),
            [] => Err(format!("no {what}")),
            _ => Err(format!("{} {what}s ({})", found.len(), found.join(", "))),
        }
    };
    Ok((
        one("wheel", &|n| {
            n.starts_with("fsdp_agent-") && n.ends_with(".whl")
        })?,
        one("binary", &|n| {
            n.starts_with("fsdp-agent-") && n.ends_with("-linux-gnu")
        })?,
    ))
}

/// The files the dynamic loader maps for a program, from `ldd`'s output: the loader itself
/// and each resolved library (the vDSO has no file). A library `ldd` cannot find is an
/// error naming it.
pub fn ldd_paths(ldd_output: &str) -> Result<Vec<PathBuf>, String> {
    let mut paths = Vec::new();
    for line in ldd_output.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let target = match line.split_once("=>") {
            Some((name, target)) if target.trim().starts_with("not found") => {
                return Err(format!("{} not found", name.trim()));
            }
            Some((_, target)) => target.trim(),
            None => line,
        };
        let file = target.split_whitespace().next().unwrap_or_default();
        if file.starts_with('/') {
            paths.push(PathBuf::from(file));
        }
    }
    Ok(paths)
}

/// Whether a shared library is part of glibc (or libgcc_s, GCC's unwinder, which every
/// glibc system has and manylinux allows): all a binary that "needs only glibc" may load.
pub fn is_glibc(library: &Path) -> bool {
    let name = library
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    name.starts_with("ld-linux")
        || [
            "libc.so.6",
            "libm.so.6",
            "libpthread.so.0",
            "libdl.so.2",
            "librt.so.1",
            "libutil.so.1",
            "libgcc_s.so.1",
        ]
        .contains(&name.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn one_wheel_and_one_binary_are_picked() {
        let v = names(&[
            "fsdp-agent-0.1.0-x86_64-linux-gnu",
            "fsdp_agent-0.1.0-py3-none-manylinux_2_34_x86_64.whl",
            "notes.txt",
        ]);
        assert_eq!(
            pick_artefacts(&v),
            Ok((
                "fsdp_agent-0.1.0-py3-none-manylinux_2_34_x86_64.whl",
                "fsdp-agent-0.1.0-x86_64-linux-gnu"
            ))
        );
    }

    #[test]
    fn a_missing_or_doubled_artefact_is_named() {
        let v = names(&["fsdp-agent-0.1.0-x86_64-linux-gnu"]);
        assert_eq!(pick_artefacts(&v), Err("no wheel".into()));
        let v = names(&[
            "fsdp_agent-0.1.0-py3-none-linux_x86_64.whl",
            "fsdp_agent-0.2.0-py3-none-linux_x86_64.whl",
            "fsdp-agent-0.2.0-x86_64-linux-gnu",
        ]);
        assert!(pick_artefacts(&v).unwrap_err().starts_with("2 wheels ("));
        let v = names(&["fsdp_agent-0.1.0-py3-none-linux_x86_64.whl"]);
        assert_eq!(pick_artefacts(&v), Err("no binary".into()));
    }

    #[test]
    fn ldd_output_gives_the_loader_and_the_resolved_libraries() {
        let out = "\tlinux-vdso.so.1 (0x00007ffc1d5f2000)\n\
                   \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f0e1c1a0000)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0e1bfbf000)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f0e1c1e0000)\n";
        assert_eq!(
            ldd_paths(out),
            Ok(vec![
                PathBuf::from("/lib/x86_64-linux-gnu/libgcc_s.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ])
        );
    }

    #[test]
    fn a_library_ldd_cannot_find_is_an_error() {
        let out = "\tlibssl.so.3 => not found\n\tlibc.so.6 => /lib/libc.so.6 (0x1)\n";
        assert_eq!(ldd_paths(out), Err("libssl.so.3 not found".into()));
    }

    #[test]
    fn glibc_and_libgcc_are_glibc_and_nothing_else_is() {
        for lib in [
            "/lib64/ld-linux-x86-64.so.2",
            "/lib/ld-linux-aarch64.so.1",
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/lib/x86_64-linux-gnu/libgcc_s.so.1",
        ] {
            assert!(is_glibc(Path::new(lib)), "{lib}");
        }
        for lib in [
            "/lib/x86_64-linux-gnu/libssl.so.3",
            "/lib/x86_64-linux-gnu/libstdc++.so.6",
            "/lib/x86_64-linux-gnu/libtinfo.so.6",
        ] {
            assert!(!is_glibc(Path::new(lib)), "{lib}");
        }
    }
}
