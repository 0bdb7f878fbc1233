//! glibc malloc tuning for per-rank peak memory.
//!
//! glibc serves an allocation above its mmap threshold with its own mapping, returned to
//! the system on free, but it raises that threshold (up to 32 MiB) each time such a block
//! is freed. After that, the unit-sized buffers `full` sharding gathers and frees every
//! step come from the heap arenas instead, one per thread that allocates (the main thread,
//! Gloo's, the intra-op pool's), and freed blocks stay resident in each: the peak then
//! counts a unit several times over. A fixed threshold keeps every large buffer a mapping
//! of its own, which is what the sharding arithmetic assumes.

use std::ffi::c_int;

unsafe extern "C" {
    fn mallopt(param: c_int, value: c_int) -> c_int;
}

/// glibc's `M_MMAP_THRESHOLD`.
const M_MMAP_THRESHOLD: c_int = -3;

/// Fixes the mmap threshold at 1 MiB (before any thread starts) unless `MALLOC_MMAP_THRESHOLD_` sets it already.
pub fn fix_mmap_threshold() {
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
        return;
    }
    // SAFETY: mallopt only changes allocator settings; it is called before any thread is
    // started by this process.
    unsafe {
        mallopt(M_MMAP_THRESHOLD, 1 << 20);
    }
}
