//! glibc malloc tuning for `full` sharding's speed.
//!
//! glibc serves an allocation above its mmap threshold with a mapping of its own, returned
//! to the system on free, and raises that threshold (up to 32 MiB) each time such a block
//! is freed. Fixed at 1 MiB (this module's setting until 2026-11-26), every activation and
//! temporary of 1 MiB or more was a fresh mapping, page-faulted and zeroed by the kernel
//! at each use: `full` ran at 0.75x PyTorch FSDP2's speed on bench/full_shard.py's model.
//! Fixed at glibc's ceiling, 32 MiB, they are reused from the heap: 36-37 samples/s
//! against FSDP2's 32-37 at world 2, 34-36 against 32-34 at world 4, for a peak RSS
//! 2-7% higher (the heap keeps freed blocks; the unit-sized buffers `full` gathers are
//! kept from step to step anyway). Fixed rather than glibc's moving default so that the
//! first steps behave as the later ones. `MALLOC_MMAP_THRESHOLD_=1048576` gives back the
//! tighter peak that the sharding arithmetic predicts (the memory test runs under it).

use std::ffi::c_int;

unsafe extern "C" {
    fn mallopt(param: c_int, value: c_int) -> c_int;
}

/// glibc's `M_MMAP_THRESHOLD`.
const M_MMAP_THRESHOLD: c_int = -3;

/// glibc's largest mmap threshold on 64-bit systems.
const THRESHOLD: c_int = 32 << 20;

/// Fixes the mmap threshold at 32 MiB (before any thread starts) unless
/// `MALLOC_MMAP_THRESHOLD_` sets it already.
pub fn fix_mmap_threshold() {
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
        return;
    }
    // SAFETY: mallopt only changes allocator settings; it is called before any thread is
    // started by this process.
    unsafe {
        mallopt(M_MMAP_THRESHOLD, THRESHOLD);
    }
}
