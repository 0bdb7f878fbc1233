//! The platform edge of supervision: how a worker is started and how its group is signalled.

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::Command;

/// Makes `cmd` start its worker as the leader of a new session (so of a new process group
/// too), set to receive SIGKILL when the agent dies. A session of its own, as torchrun's
/// workers have: the agent's terminal is not the worker's controlling terminal, so a
/// worker that reads it (pdb) is not stopped by job control for being in the background.
///
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the process.
/// The agent runs on a single-threaded runtime on the main thread and spawns only from it,
/// so that thread lives as long as the agent does. If the agent died between `fork` and
/// `prctl`, the parent check below catches it.
pub fn prepare(cmd: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    #[expect(
        unsafe_code,
        reason = "pre_exec is the only way to run prctl in the child before exec"
    )]
    // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
    // system calls (setsid, prctl, getppid, kill); it touches no locks and allocates
    // nothing.
    unsafe {
        cmd.pre_exec(move || {
            // The forked child is never a group leader, so this cannot fail with EPERM.
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            Ok(())
        });
    }
}

/// Sends `signal` to the process group led by `pgid`. A group that is already gone is not
/// an error: the worker and everything it started have exited.
pub fn signal_group(pgid: u32, signal: Signal) {
    match killpg(Pid::from_raw(pgid as i32), signal) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
        Err(e) => {
            tracing::warn!(pgid, %signal, error = %e, "could not signal worker process group")
        }
    }
}

/// Whether the worker leader `pid`, a child of the agent, has exited: a zombie its waiter
/// has not reaped yet, or reaped already (it is no child any more). Nothing is reaped
/// here: its exit status stays its waiter's.
pub fn has_exited(pid: u32) -> bool {
    use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    match waitid(Id::Pid(Pid::from_raw(pid as i32)), flags) {
        Ok(WaitStatus::StillAlive) => false,
        Ok(_) | Err(nix::errno::Errno::ECHILD) => true,
        Err(_) => false,
    }
}

/// Makes the descriptor `fd` (close-on-exec in the agent, as every descriptor it opens)
/// survive into the program `cmd` execs, at the same number.
pub fn inherit_fd(cmd: &mut Command, fd: std::os::fd::RawFd) {
    #[expect(
        unsafe_code,
        reason = "pre_exec is the only way to clear close-on-exec in the child alone"
    )]
    // SAFETY: fcntl is async-signal-safe; the closure allocates nothing and takes no lock.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
