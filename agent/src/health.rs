//! The health gate: a command the user names (`--health-check`) that must pass before this
//! node joins a round. A bad GPU or NIC then keeps the node out of the group instead of
//! crashing it round after round.
//!
//! The command runs under `sh -c` in its own process group with a time limit; its exit
//! status is the verdict and its last output line the reason, which the node records in
//! etcd (`ctl/unhealthy/<node>`) for `fsdp-agent status`. [`retry_in`] and [`verdict`] are
//! the pure decisions: how long to wait before the next try, and when to give up so the
//! pod is replaced.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;

use crate::config::HealthCheck;
use crate::exit_code;

/// What to do after a failed check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Stay out of rounds and try again after this long.
    RetryIn(Duration),
    /// Give up: exit with this code so the pod is replaced.
    GiveUp(u8),
}

/// The pause before try `failures + 1`: 1 s doubling, at most 30 s.
pub fn retry_in(failures: u32) -> Duration {
    fsdp_rendezvous::backoff::nth(
        Duration::from_secs(1),
        Duration::from_secs(30),
        failures.saturating_sub(1),
    )
}

/// After `failures` failed checks in a row.
pub fn verdict(failures: u32, cfg: &HealthCheck) -> Verdict {
    if failures >= cfg.attempts.max(1) {
        Verdict::GiveUp(exit_code::UNHEALTHY)
    } else {
        Verdict::RetryIn(retry_in(failures))
    }
}

/// Output kept from a check: its last line is the reason.
const KEEP: usize = 64 * 1024;

/// Runs the check once: `Ok` when it exits 0, else why not (its last output line, or how
/// it ended).
pub async fn check(cfg: &HealthCheck) -> Result<(), String> {
    let mut child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(&cfg.command)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("could not start `sh -c {}`: {e}", cfg.command))?;
    // An agent that runs as PID 1 reaps orphans; this exit status is ours.
    let _owned = child.id().map(crate::reaper::Owned::new);
    let pgid = child.id().and_then(|p| i32::try_from(p).ok());
    let (mut out, mut err) = (child.stdout.take(), child.stderr.take());
    let run = async {
        let mut text = Vec::new();
        let mut more = Vec::new();
        let read_out = async {
            if let Some(o) = out.as_mut() {
                let _ = o.take(KEEP as u64).read_to_end(&mut text).await;
            }
        };
        let read_err = async {
            if let Some(e) = err.as_mut() {
                let _ = e.take(KEEP as u64).read_to_end(&mut more).await;
            }
        };
        tokio::join!(read_out, read_err);
        text.extend(more);
        (child.wait().await, text)
    };
    let (status, text) = match tokio::time::timeout(cfg.timeout, run).await {
        Ok((status, text)) => (status, text),
        Err(_) => {
            // The whole group: a check that started its own children does not outlive us.
            if let Some(pg) = pgid {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pg),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            return Err(format!("did not finish within {:?}", cfg.timeout));
        }
    };
    let status = status.map_err(|e| format!("could not wait for the check: {e}"))?;
    if status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&text);
    let last = text
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or_default();
    let how = match status.code() {
        Some(c) => format!("exit code {c}"),
        None => "killed by a signal".to_owned(),
    };
    let last: String = last.chars().take(300).collect();
    Err(if last.is_empty() {
        how
    } else {
        format!("{last} ({how})")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(command: &str) -> HealthCheck {
        HealthCheck {
            command: command.into(),
            timeout: Duration::from_secs(5),
            attempts: 3,
            interval: Duration::from_secs(300),
        }
    }

    #[test]
    fn retries_back_off_and_give_up_after_the_attempts() {
        let c = cfg("true");
        assert_eq!(verdict(1, &c), Verdict::RetryIn(Duration::from_secs(1)));
        assert_eq!(verdict(2, &c), Verdict::RetryIn(Duration::from_secs(2)));
        assert_eq!(verdict(3, &c), Verdict::GiveUp(exit_code::UNHEALTHY));
        assert_eq!(retry_in(20), Duration::from_secs(30));
    }

    #[tokio::test]
    async fn the_reason_is_the_last_line_and_how_it_ended() {
        assert_eq!(check(&cfg("echo fine")).await, Ok(()));
        let e = check(&cfg(
            "echo checking; echo 'GPU 3: 12 ECC errors' >&2; exit 4",
        ))
        .await
        .unwrap_err();
        assert_eq!(e, "GPU 3: 12 ECC errors (exit code 4)");
        assert_eq!(check(&cfg("exit 1")).await.unwrap_err(), "exit code 1");
    }

    #[tokio::test]
    async fn a_check_past_its_time_is_killed_with_its_children() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("child");
        let mut c = cfg(&format!(
            "sleep 30 & echo $! > {}; wait",
            pid_file.display()
        ));
        c.timeout = Duration::from_millis(500);
        let t0 = std::time::Instant::now();
        let e = check(&c).await.unwrap_err();
        assert!(e.contains("did not finish"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
            && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .unwrap_or_default()
                .contains(") Z ");
        assert!(!alive, "the check's child outlived it");
    }
}
