//! SIGUSR1 and SIGUSR2, Slurm's warning before a pre-emption or the time limit (`sbatch
//! --signal`), which fsdp-agent passes on to its workers: the trainer saves a checkpoint
//! and stops, instead of dying of the signal with every step since its last save lost.
//!
//! The handler only records the signal; the loop asks every rank once a step (one
//! all-reduce), so a warning that reached one rank stops all of them at the same step.
//! SIGTERM keeps its default: the agent sends it to stop workers whose group broke, where
//! a save would wait on peers that are gone.

use std::sync::atomic::{AtomicI32, Ordering};

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
