//! SIGUSR1 and SIGUSR2, Slurm's warning before a pre-emption or the time limit (`sbatch
//! --signal`), which fsdp-agent passes on to its workers: the trainer saves a checkpoint
//! and stops, instead of dying of the signal with every step since its last save lost.
//!
//! The handler only records the signal; the loop asks every rank once a step (one
//! all-reduce), so a warning that reached one rank stops all of them at the same step.
//! SIGTERM keeps its default: the agent sends it to stop workers whose group broke, where
//! a save would wait on peers that are gone.
//!
//! fsdp-agent also warns its workers before a re-form that loses no node (a node joining),
//! once they said they save on a warning (`can save-on-warning` on the progress channel):
//! the group resumes at the step it saved, not at its last checkpoint. The agents see the
//! join a few milliseconds apart, so a rank can learn of a warning from the all-reduce
//! before its own agent has sent one: it waits for its own ([`wait_for_own`]) before it
//! stops, or its agent would see a worker that stopped on its own, a failure.

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// How long a rank warned only through the others waits for its own agent's word.
pub const OWN_WARNING_WAIT: Duration = Duration::from_secs(10);

static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn record(signal: libc::c_int) {
    RECEIVED.store(signal, Ordering::Relaxed);
}

/// Installs the handlers (restarting interrupted system calls).
pub fn install() {
    for signal in [libc::SIGUSR1, libc::SIGUSR2] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe; the
        // sigaction struct is zeroed and then filled as the man page describes.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = record as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// The warning signal this process received, if any.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::Relaxed) {
        0 => None,
        s => Some(s),
    }
}

/// Returns once this process received a warning signal, or after `limit`. Its agent stops
/// it meanwhile with SIGTERM (the default action ends it) or warns it (the handler records
/// it, and this returns).
pub fn wait_for_own(limit: Duration) {
    let end = Instant::now() + limit;
    while received().is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
}
