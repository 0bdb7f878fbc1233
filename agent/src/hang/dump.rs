//! Where the workers are stuck, captured before they are stopped: each worker's Python
//! stack with `py-spy dump` when `py-spy` is on PATH (the venv has it), else the kernel's
//! view of every thread (`/proc/<pid>/task/<tid>/wchan` and `stack` where readable).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// How a dump without Python frames starts.
pub const KERNEL_VIEW: &str = "the kernel's view";

/// How long one `py-spy dump` may take.
const PY_SPY_PATIENCE: Duration = Duration::from_secs(10);

/// One worker's dump: its text, and where it was written.
#[derive(Debug, Clone)]
pub struct Dump {
    pub rank: u32,
    pub pid: u32,
    pub text: String,
    pub path: Option<PathBuf>,
}

impl Dump {
    /// The first lines that say where it is (for the failure summary).
    pub fn top(&self, lines: usize) -> String {
        self.text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .take(lines)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

fn py_spy(pid: u32) -> Option<String> {
    let mut child = Command::new("py-spy")
        .args(["dump", "--pid", &pid.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    // An agent that runs as PID 1 reaps orphans; this exit status is ours.
    let _owned = crate::reaper::Owned::new(child.id());
    let end = std::time::Instant::now() + PY_SPY_PATIENCE;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => break,
            Ok(Some(_)) | Err(_) => return None,
            Ok(None) if std::time::Instant::now() > end => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take()?, &mut out).ok()?;
    Some(out)
}

fn kernel_view(pid: u32) -> String {
    let mut out = format!(
        "{KERNEL_VIEW} of pid {pid} (no Python stack: py-spy is not on PATH or could not attach):\n"
    );
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"));
    for task in tasks.into_iter().flatten().flatten() {
        let dir = task.path();
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        let name = read("comm");
        out.push_str(&format!(
            "thread {} ({}) wchan={}\n{}",
            task.file_name().to_string_lossy(),
            name.trim(),
            read("wchan").trim(),
            read("stack")
        ));
    }
    out
}

/// Dumps every `(rank, pid)` and writes each to `dir/hang_rank<R>.txt` when a directory
/// is given. Blocking: run it off the runtime thread.
pub fn dump_all(workers: &[(u32, u32)], dir: Option<&Path>) -> Vec<Dump> {
    workers
        .iter()
        .map(|&(rank, pid)| {
            let text = py_spy(pid).unwrap_or_else(|| kernel_view(pid));
            let path = dir.map(|d| d.join(format!("hang_rank{rank}.txt")));
            let path = path.filter(|p| std::fs::write(p, &text).is_ok());
            Dump {
                rank,
                pid,
                text,
                path,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sleeping_process_is_dumped_and_written() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let dir = std::env::temp_dir().join(format!("fsdp-dump-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dumps = dump_all(&[(3, child.id())], Some(&dir));
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(dumps.len(), 1);
        let d = &dumps[0];
        assert!(
            d.text.contains("sleep") || d.text.contains("Thread"),
            "{}",
            d.text
        );
        let written = std::fs::read_to_string(d.path.as_ref().unwrap()).unwrap();
        assert_eq!(written, d.text);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
