//! torchrun's file-timer watchdog, served by the agent: with
//! `TORCHELASTIC_ENABLE_FILE_TIMER=1` the agent makes a FIFO at `TORCHELASTIC_TIMER_FILE`
//! (or a fresh temporary path) and gives its path to the workers, so that code written for
//! torchrun — `timer.configure(timer.FileTimerClient(path))` and
//! `with timer.expires(after=...)` — works unchanged.
//!
//! PyTorch's client writes one JSON line per request: `{"version": 1, "pid": P,
//! "scope_id": S, "expiration_time": T, "signal": N}` (T in seconds since the epoch; a
//! negative T releases the scope). When a scope expires, its worker gets the signal it
//! asked for, as under torchrun; the group then fails like any crash and restarts within
//! the budget — where torchrun 2.13's watchdog, having reaped the worker, leaves its
//! launcher to exit without restarting. Only the agent's own workers (or processes in
//! their process groups) are ever signalled.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The variable that turns it on (in the agent's environment), as in torchrun.
pub const ENABLE: &str = "TORCHELASTIC_ENABLE_FILE_TIMER";
/// The FIFO's path, in the agent's environment (optional) and the workers'.
pub const FILE: &str = "TORCHELASTIC_TIMER_FILE";

/// One armed scope.
#[derive(Debug, Clone, PartialEq)]
pub struct Scope {
    pub pid: i32,
    pub scope_id: String,
    /// Seconds since the epoch.
    pub expires: f64,
    pub signal: i32,
}

#[derive(Debug, serde::Deserialize)]
struct Request {
    pid: i32,
    scope_id: String,
    expiration_time: f64,
    #[serde(default)]
    signal: i32,
}

type Scopes = Arc<Mutex<BTreeMap<(i32, String), Scope>>>;

/// The FIFO and the scopes armed through it.
pub struct FileTimer {
    path: PathBuf,
    scopes: Scopes,
}

impl Drop for FileTimer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Applies one JSON line to `scopes`.
pub fn apply(scopes: &mut BTreeMap<(i32, String), Scope>, line: &str) -> bool {
    let Ok(r) = serde_json::from_str::<Request>(line.trim()) else {
        return false;
    };
    let key = (r.pid, r.scope_id.clone());
    if r.expiration_time < 0.0 {
        scopes.remove(&key);
    } else {
        scopes.insert(
            key,
            Scope {
                pid: r.pid,
                scope_id: r.scope_id,
                expires: r.expiration_time,
                signal: r.signal,
            },
        );
    }
    true
}

fn epoch_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl FileTimer {
    /// Serves the file timer if the agent's environment asks for it.
    pub fn from_env() -> Option<std::io::Result<Self>> {
        if std::env::var(ENABLE).ok().as_deref() != Some("1") {
            return None;
        }
        let path = std::env::var_os(FILE)
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let tag = uuid::Uuid::new_v4();
                std::env::temp_dir().join(format!("watchdog_timer_{tag}"))
            });
        Some(Self::start(path))
    }

    /// Makes the FIFO at `path` and reads it on a thread of its own (reading a FIFO
    /// blocks; it never runs on the runtime).
    pub fn start(path: PathBuf) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(&path);
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600))
            .map_err(std::io::Error::from)?;
        // Read and write: the reader never sees end-of-file when a client closes, and a
        // client's non-blocking open always finds a reader.
        let fifo = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)?;
        let scopes: Scopes = Arc::default();
        let armed = scopes.clone();
        std::thread::Builder::new()
            .name("file-timer".into())
            .spawn(move || {
                for line in std::io::BufReader::new(fifo).lines() {
                    let Ok(line) = line else { return };
                    let mut s = armed.lock().unwrap_or_else(|p| p.into_inner());
                    if !apply(&mut s, &line) {
                        tracing::debug!(%line, "not a file-timer request");
                    }
                }
            })?;
        Ok(Self { path, scopes })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Forgets every scope (a new group).
    pub fn reset(&self) {
        self.scopes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Removes and returns the scopes expired now, and how long until the next expires.
    pub fn expired(&self) -> (Vec<Scope>, Option<Duration>) {
        let now = epoch_now();
        let mut s = self.scopes.lock().unwrap_or_else(|p| p.into_inner());
        let gone: Vec<(i32, String)> = s
            .iter()
            .filter(|(_, sc)| sc.expires <= now)
            .map(|(k, _)| k.clone())
            .collect();
        let expired = gone.iter().filter_map(|k| s.remove(k)).collect();
        let next = s
            .values()
            .map(|sc| Duration::from_secs_f64((sc.expires - now).max(0.0)))
            .min();
        (expired, next)
    }
}

/// Whether `pid` is one of `workers` or in one of their process groups.
pub fn ours(pid: i32, workers: &[u32]) -> bool {
    let in_group = nix::unistd::getpgid(Some(nix::unistd::Pid::from_raw(pid))).is_ok_and(|g| {
        workers
            .iter()
            .any(|w| i64::from(*w) == i64::from(g.as_raw()))
    });
    workers.iter().any(|w| i64::from(*w) == i64::from(pid)) || in_group
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_arm_and_release_scopes() {
        let mut s = BTreeMap::new();
        let arm = r#"{"version": 1, "pid": 7, "scope_id": "step", "expiration_time": 100.5, "signal": 9}"#;
        assert!(apply(&mut s, arm));
        assert_eq!(s[&(7, "step".to_owned())].signal, 9);
        let release =
            r#"{"version": 1, "pid": 7, "scope_id": "step", "expiration_time": -1, "signal": 0}"#;
        assert!(apply(&mut s, release));
        assert!(s.is_empty());
        assert!(!apply(&mut s, "garbage"));
    }

    #[test]
    fn a_client_writing_the_fifo_arms_a_scope_that_expires() {
        let path = std::env::temp_dir().join(format!("fsdp-timer-{}", std::process::id()));
        let t = FileTimer::start(path.clone()).unwrap();
        let when = epoch_now() + 0.2;
        // As torch's FileTimerClient does: a non-blocking open for writing, one line.
        let mut w = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .unwrap();
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        writeln!(w, r#"{{"version": 1, "pid": 42, "scope_id": "s", "expiration_time": {when}, "signal": 9}}"#).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let (expired, next) = t.expired();
        assert!(expired.is_empty() && next.is_some(), "{expired:?} {next:?}");
        std::thread::sleep(Duration::from_millis(200));
        let (expired, next) = t.expired();
        assert_eq!(expired.len(), 1);
        assert_eq!((expired[0].pid, expired[0].signal), (42, 9));
        assert_eq!(next, None);
        drop(t);
        assert!(!path.exists());
    }

    #[test]
    fn only_our_workers_are_ours() {
        let me = std::process::id();
        assert!(ours(me as i32, &[me]));
        assert!(!ours(1, &[me]));
    }
}
