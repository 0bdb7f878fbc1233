//! Zombie reaping for an agent that runs as PID 1 (a container without an init, the usual
//! case in a PyTorchJob). Processes a worker leaves behind when it dies (DataLoader
//! workers, shells) are re-parented to PID 1; nobody else will ever wait for them.
//!
//! Worker leaders stay tokio's to reap (their exit status is the agent's business), so
//! they are registered in [`LEADERS`] right after spawn, before the runtime can switch to
//! the reaper, and only other children are waited for.
//!
//! A leaf beside the supervisor rather than inside it: the supervisor registers its
//! workers here, and the health check and the stack dumps (which spawn children of their
//! own) keep theirs with [`Owned`], without reaching into the supervisor.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// Pids of live worker leaders: reaped by their own waiters, never here.
static LEADERS: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

pub fn register(pid: u32) {
    LEADERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(pid);
}

/// Keeps a child of the agent's own (a health check, a stack dump) from the reaper while it
/// lives: its exit status is its waiter's. Registered at creation, released on drop.
pub struct Owned(u32);

impl Owned {
    pub fn new(pid: u32) -> Self {
        register(pid);
        Self(pid)
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        unregister(self.0);
    }
}

pub fn unregister(pid: u32) {
    LEADERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&pid);
}

/// A process's pid in its own (innermost) namespace, from `NSpid:`. The /proc the agent
/// sees may belong to an outer namespace (a PID namespace without its own /proc mount).
fn own_ns_pid(host_pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{host_pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// The agent's children that are not worker leaders, as pids it can wait for.
fn adopted() -> Vec<i32> {
    let leaders = LEADERS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        let Ok(list) = std::fs::read_to_string(t.path().join("children")) else {
            continue;
        };
        out.extend(
            list.split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok())
                .filter_map(own_ns_pid)
                .filter(|p| !leaders.contains(p))
                .map(|p| p as i32),
        );
    }
    out
}

/// Waits, without blocking, for every adopted child that has exited. Returns how many.
pub fn reap_adopted() -> usize {
    let mut reaped = 0;
    for pid in adopted() {
        match waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => {}
            Ok(_) => reaped += 1,
        }
    }
    reaped
}

/// When this process is PID 1, reaps adopted zombies on every SIGCHLD (and once a second,
/// in case signals were coalesced) for as long as the runtime runs.
pub fn start_if_init() {
    if std::process::id() != 1 {
        return;
    }
    tracing::info!("running as PID 1: reaping orphaned processes");
    tokio::spawn(async {
        let mut sigchld =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()).ok();
        loop {
            match sigchld.as_mut() {
                Some(s) => {
                    let _ = tokio::time::timeout(Duration::from_secs(1), s.recv()).await;
                }
                None => tokio::time::sleep(Duration::from_secs(1)).await,
            }
            let n = reap_adopted();
            if n > 0 {
                tracing::debug!(reaped = n, "reaped orphaned processes");
            }
        }
    });
}
