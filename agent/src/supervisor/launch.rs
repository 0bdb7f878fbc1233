//! A cold worker's start without copying the agent: `clone(CLONE_VM | CLONE_VFORK)`, the
//! child running in the agent's memory only until it execs.
//!
//! Why not `fork`: a forked child gets a copy of the agent's page tables, and every page
//! the agent then writes takes a copy-on-write fault. At 1,000 agents on one host that was
//! a quarter of each agent's CPU per re-form (measured on two cores). std spawns the same way
//! (`posix_spawn`) only when no `pre_exec` step is asked for, and a worker needs three:
//! a session of its own, `PR_SET_PDEATHSIG`, and the check that the agent did not die
//! before the death signal was armed ([`super::unix::prepare`] is the same steps for a
//! forked spare). So the child here is written against the rules of a vfork child:
//! everything it needs is made before the clone, it allocates nothing, takes no lock and
//! makes only async-signal-safe system calls, and it reports a failure by writing the
//! errno into memory the agent reads once the clone returns (the agent's thread is
//! suspended until the child execs or exits).
//!
//! The child is waited for through a pidfd (`CLONE_PIDFD`): no SIGCHLD handler, and a pid
//! that is reused cannot be signalled by mistake.

use std::ffi::{CString, OsStr, OsString, c_int, c_void};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, Ordering};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Stack of the child between the clone and its exec: it calls a few system calls and
/// `execve`; glibc's own vfork child for `posix_spawn` makes do with less.
const CHILD_STACK: usize = 64 * 1024;

/// One past the highest signal number on Linux.
const NSIG: c_int = 65;

/// What to start: a program, its arguments, and its environment as the agent's own with
/// the `env` changes applied (`None` removes a variable).
pub struct Launch<'a> {
    pub program: &'a Path,
    pub args: &'a [String],
    pub env: &'a [(String, Option<String>)],
    /// Become the child's standard output and error (dup2'd; the agent keeps its copies).
    pub stdout: &'a OwnedFd,
    pub stderr: &'a OwnedFd,
}

/// Everything the child reads, made before the clone (the child may not allocate).
struct Plan {
    path: CString,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    stdout: RawFd,
    stderr: RawFd,
    parent: libc::pid_t,
    /// The errno of the step that failed, written by the child before it exits.
    error: AtomicI32,
}

/// A started worker process, waited for through its pidfd. Dropped before it was waited
/// for, it is killed (as tokio's `kill_on_drop`) and reaped off the runtime.
pub struct Launched {
    pid: u32,
    pidfd: Option<AsyncFd<OwnedFd>>,
    status: Option<ExitStatus>,
}

/// Starts `launch` as the leader of a new session, set to receive SIGKILL when the agent
/// dies. An error when the program cannot be found or executed, or a step before the exec
/// failed; no process is left behind then.
pub fn start(launch: &Launch<'_>) -> io::Result<Launched> {
    let path = resolve(launch.program, launch.env)?;
    let args: Vec<CString> = std::iter::once(launch.program.as_os_str().as_bytes())
        .chain(launch.args.iter().map(|a| a.as_bytes()))
        .map(c_string)
        .collect::<io::Result<_>>()?;
    let env = environment(launch.env)?;
    let plan = Plan {
        path: c_string(path.as_os_str().as_bytes())?,
        argv: null_terminated(&args),
        envp: null_terminated(&env),
        stdout: launch.stdout.as_raw_fd(),
        stderr: launch.stderr.as_raw_fd(),
        parent: std::process::id() as libc::pid_t,
        error: AtomicI32::new(0),
    };
    // Not zeroed: the child touches only the top few pages of it.
    let mut stack: Vec<std::mem::MaybeUninit<u128>> =
        Vec::with_capacity(CHILD_STACK / size_of::<u128>());
    let mut pidfd: c_int = -1;
    #[expect(
        unsafe_code,
        reason = "clone with CLONE_VM | CLONE_VFORK has no safe wrapper; the child's rules are in the module's doc"
    )]
    // SAFETY: the child runs `child` on a stack of its own that outlives it (this thread is
    // suspended until the child execs or exits, CLONE_VFORK); `plan` and the strings it
    // points into live until after the clone returns. Every signal is blocked on this
    // thread meanwhile, so no handler of the agent's runs in the child before it restores
    // the defaults.
    let (pid, clone_errno) = unsafe {
        let top = stack.as_mut_ptr().add(stack.capacity()).cast::<c_void>();
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let pid = libc::clone(
            child,
            top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD | libc::SIGCHLD,
            (&raw const plan).cast_mut().cast::<c_void>(),
            &raw mut pidfd,
        );
        let clone_errno = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        (pid, clone_errno)
    };
    drop(stack);
    if pid < 0 {
        return Err(clone_errno);
    }
    #[expect(unsafe_code, reason = "the pidfd CLONE_PIDFD returned is ours alone")]
    // SAFETY: the kernel wrote a new descriptor there, which nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let failed = plan.error.load(Ordering::SeqCst);
    if failed != 0 {
        // The child has exited already (127): reap it before reporting.
        let _ = reap(&pidfd, 0);
        return Err(io::Error::from_raw_os_error(failed));
    }
    #[expect(
        unsafe_code,
        reason = "tokio asks that the descriptor stay the same while registered"
    )]
    // SAFETY: the `OwnedFd` moves into the registration and is only closed with it.
    let registered = unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) };
    match registered {
        Ok(pidfd) => Ok(Launched {
            pid: pid as u32,
            pidfd: Some(pidfd),
            status: None,
        }),
        Err(e) => {
            let (pidfd, cause) = e.into_parts();
            kill_and_reap(pidfd);
            Err(cause)
        }
    }
}

/// The child, from the clone to the exec. Only async-signal-safe calls, no allocation.
extern "C" fn child(arg: *mut c_void) -> c_int {
    #[expect(unsafe_code, reason = "the vfork child's steps are system calls")]
    // SAFETY: `arg` is the parent's `Plan`, alive while this thread runs (see `start`).
    unsafe {
        let plan = &*arg.cast::<Plan>();
        let fail = |plan: &Plan| -> c_int {
            plan.error
                .store(*libc::__errno_location(), Ordering::SeqCst);
            libc::_exit(127)
        };
        // The agent's handlers would run in the agent's memory: the defaults, as an exec
        // would give. SIGPIPE too: std ignores it in the agent, and an ignored signal stays
        // ignored across exec (std's own spawn resets it the same way).
        for sig in 1..NSIG {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                && (old.sa_sigaction != libc::SIG_IGN || sig == libc::SIGPIPE)
                && old.sa_sigaction != libc::SIG_DFL
            {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        // A session of its own, as torchrun's workers have: the agent's terminal is not the
        // worker's controlling terminal, so a worker that reads it (pdb) is not stopped by
        // job control. The child is never a group leader, so this cannot fail with EPERM.
        if libc::setsid() < 0 {
            return fail(plan);
        }
        if libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        ) != 0
        {
            return fail(plan);
        }
        // The agent died before the death signal was armed: it will never come.
        if libc::getppid() != plan.parent {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        // dup2 onto itself keeps close-on-exec: a descriptor already in place (the agent's
        // own 1 or 2 closed, and the copy given that number) is let through instead.
        for (fd, target) in [(plan.stdout, 1), (plan.stderr, 2)] {
            let placed = match fd == target {
                true => libc::fcntl(fd, libc::F_SETFD, 0),
                false => libc::dup2(fd, target),
            };
            if placed < 0 {
                return fail(plan);
            }
        }
        libc::execve(plan.path.as_ptr(), plan.argv.as_ptr(), plan.envp.as_ptr());
        fail(plan)
    }
}

impl Launched {
    pub fn id(&self) -> u32 {
        self.pid
    }

    /// Waits for the process to exit and reaps it.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        let Some(pidfd) = &self.pidfd else {
            return Err(io::Error::other("the worker was already reaped"));
        };
        loop {
            let mut ready = pidfd.readable().await?;
            match reap(pidfd.get_ref(), libc::WNOHANG)? {
                Some(status) => {
                    self.status = Some(status);
                    return Ok(status);
                }
                None => ready.clear_ready(),
            }
        }
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        if self.status.is_some() {
            return;
        }
        let Some(pidfd) = self.pidfd.take() else {
            return;
        };
        kill_and_reap(pidfd.into_inner());
    }
}

/// Kills the process behind `pidfd` and reaps it: at once when it is dead already, else
/// off the runtime, so no zombie stays behind and nothing waits here (a process in
/// uninterruptible sleep may take long to die).
fn kill_and_reap(pidfd: OwnedFd) {
    #[expect(unsafe_code, reason = "pidfd_send_signal has no wrapper in libc")]
    // SAFETY: a signal sent through a pidfd we own; no memory is passed.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        );
    }
    if let Ok(Some(_)) = reap(&pidfd, libc::WNOHANG) {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("reap-worker".into())
        .spawn(move || reap(&pidfd, 0));
}

/// Reaps the process behind `pidfd` if it has exited (`WNOHANG`), or once it does.
fn reap(pidfd: &OwnedFd, options: c_int) -> io::Result<Option<ExitStatus>> {
    loop {
        #[expect(unsafe_code, reason = "waitid has no safe wrapper for a pidfd")]
        // SAFETY: `info` is written by the kernel; the descriptor is ours.
        let (rc, info) = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let rc = libc::waitid(
                libc::P_PIDFD,
                pidfd.as_raw_fd() as libc::id_t,
                &mut info,
                libc::WEXITED | options,
            );
            (rc, info)
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        #[expect(unsafe_code, reason = "siginfo_t's fields are a union")]
        // SAFETY: waitid filled in a SIGCHLD siginfo, or left it zeroed (no child yet).
        let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
        if pid == 0 {
            return Ok(None);
        }
        // Back to the wait(2) encoding std's ExitStatus reads.
        let raw = match info.si_code {
            libc::CLD_EXITED => (status & 0xff) << 8,
            libc::CLD_DUMPED => status | 0x80,
            _ => status,
        };
        return Ok(Some(ExitStatus::from_raw(raw)));
    }
}

/// Where `program` is: itself when it names a path, else the first executable file of
/// that name in the worker's `PATH` (its own when the changes set one), as `execvp`
/// would find it.
fn resolve(program: &Path, env: &[(String, Option<String>)]) -> io::Result<PathBuf> {
    if program.as_os_str().as_bytes().contains(&b'/') {
        return Ok(program.to_path_buf());
    }
    let path: Option<OsString> = match env.iter().rev().find(|(k, _)| k == "PATH") {
        Some((_, v)) => v.as_ref().map(OsString::from),
        None => std::env::var_os("PATH"),
    };
    let path = path.unwrap_or_else(|| OsString::from("/usr/local/bin:/usr/bin:/bin"));
    std::env::split_paths(&path)
        .map(|dir| match dir.as_os_str().is_empty() {
            true => Path::new(".").join(program),
            false => dir.join(program),
        })
        .find(|candidate| is_executable(candidate))
        .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The agent's environment with `changes` applied, as `KEY=VALUE` strings.
fn environment(changes: &[(String, Option<String>)]) -> io::Result<Vec<CString>> {
    let changed = |k: &OsStr| changes.iter().any(|(c, _)| OsStr::new(c) == k);
    let mut env: Vec<CString> = std::env::vars_os()
        .filter(|(k, _)| !changed(k))
        .map(|(k, v)| {
            let mut kv = k.into_vec();
            kv.push(b'=');
            kv.extend(v.into_vec());
            c_string(&kv)
        })
        .collect::<io::Result<_>>()?;
    // The last change of a variable named twice wins, as with `Command::env`.
    for (i, (k, v)) in changes.iter().enumerate() {
        let later = changes[i + 1..].iter().any(|(c, _)| c == k);
        if let (Some(v), false) = (v, later) {
            env.push(c_string(format!("{k}={v}").as_bytes())?);
        }
    }
    Ok(env)
}

fn c_string(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "an argument or environment variable contains a NUL byte",
        )
    })
}

fn null_terminated(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

#[cfg(test)]
mod tests;
