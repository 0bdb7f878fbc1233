//! PyTorch's c10d from Rust: a TCPStore and a process group (Gloo, or NCCL with the `cuda`
//! feature) behind a safe handle. Everything goes through `csrc/c10d_shim.cpp`; no
//! collective is implemented here.

use std::ffi::{CStr, CString, c_char, c_int};
use std::time::Duration;

use tch::Tensor;

#[repr(C)]
struct RawGroup {
    _private: [u8; 0],
}

#[repr(C)]
struct RawWork {
    _private: [u8; 0],
}

// `at::Tensor*` on the C++ side; tch's `C_tensor` is that pointer's target.
use torch_sys::C_tensor as RawTensor;

unsafe extern "C" {
    fn fsdp_free_error(err: *mut c_char);
    fn fsdp_pg_new(
        backend: *const c_char,
        master_addr: *const c_char,
        port: u16,
        rank: c_int,
        world: c_int,
        timeout_ms: i64,
        ifnames: *const c_char,
        err: *mut *mut c_char,
    ) -> *mut RawGroup;
    fn fsdp_pg_free(pg: *mut RawGroup, clean: c_int);
    fn fsdp_all_reduce_sum(pg: *mut RawGroup, t: *mut RawTensor, err: *mut *mut c_char) -> c_int;
    fn fsdp_reduce_scatter_sum(
        pg: *mut RawGroup,
        out: *mut RawTensor,
        input: *mut RawTensor,
        err: *mut *mut c_char,
    ) -> c_int;
    fn fsdp_all_gather(
        pg: *mut RawGroup,
        out: *mut RawTensor,
        input: *mut RawTensor,
        err: *mut *mut c_char,
    ) -> c_int;
    fn fsdp_all_gather_start(
        pg: *mut RawGroup,
        out: *mut RawTensor,
        input: *mut RawTensor,
        err: *mut *mut c_char,
    ) -> *mut RawWork;
    fn fsdp_send_start(
        pg: *mut RawGroup,
        t: *mut RawTensor,
        dst: c_int,
        tag: c_int,
        err: *mut *mut c_char,
    ) -> *mut RawWork;
    fn fsdp_recv_start(
        pg: *mut RawGroup,
        t: *mut RawTensor,
        src: c_int,
        tag: c_int,
        err: *mut *mut c_char,
    ) -> *mut RawWork;
    fn fsdp_work_wait(w: *mut RawWork, err: *mut *mut c_char) -> c_int;
    fn fsdp_work_free(w: *mut RawWork);
    fn fsdp_backward(out: *mut RawTensor, grad: *mut RawTensor, err: *mut *mut c_char) -> c_int;
    fn fsdp_broadcast(
        pg: *mut RawGroup,
        t: *mut RawTensor,
        root: c_int,
        err: *mut *mut c_char,
    ) -> c_int;
    fn fsdp_barrier(pg: *mut RawGroup, err: *mut *mut c_char) -> c_int;
    fn fsdp_set_grad(param: *mut RawTensor, grad: *mut RawTensor, err: *mut *mut c_char) -> c_int;
}

/// Makes `grad` (same shape) the gradient tensor of `param`, so backward accumulates into
/// it in place. Lives here because it goes through the same C++ shim.
pub fn set_grad(param: &mut Tensor, grad: &mut Tensor) -> Result<(), C10dError> {
    let mut err = std::ptr::null_mut();
    // SAFETY: both tensors are alive for the call; the shim copies the handle.
    let rc = unsafe { fsdp_set_grad(param.as_mut_ptr(), grad.as_mut_ptr(), &mut err) };
    if rc == 0 {
        Ok(())
    } else {
        Err(take_error("set_grad", err))
    }
}

/// Back-propagates `grad`, the gradient of the non-scalar `out`, into the leaves `out`
/// depends on (tch's own `backward` starts only from a scalar).
pub fn backward(out: &Tensor, grad: &Tensor) -> Result<(), C10dError> {
    let (mut out, mut grad) = (out.shallow_clone(), grad.shallow_clone());
    let mut err = std::ptr::null_mut();
    // SAFETY: both tensors are alive for the call.
    let rc = unsafe { fsdp_backward(out.as_mut_ptr(), grad.as_mut_ptr(), &mut err) };
    if rc == 0 {
        Ok(())
    } else {
        Err(take_error("backward", err))
    }
}

thread_local! {
    /// Time this thread spent blocked in collectives and copies ([`blocked_so_far`]).
    static BLOCKED: std::cell::Cell<std::time::Duration> = const { std::cell::Cell::new(std::time::Duration::ZERO) };
}

/// How long this thread has been blocked in c10d calls since it started. A step's wall
/// time less the growth of this is the rank's own work: in a synchronous job every rank's
/// step takes as long as the slowest one's, and only the time outside the collectives
/// tells the slow rank (its own compute) from the ranks that wait for it. Per thread,
/// because copies are also waited for on other threads (an old group ending).
pub fn blocked_so_far() -> std::time::Duration {
    BLOCKED.with(std::cell::Cell::get)
}

/// Runs the blocking call `f`, adding its time to this thread's [`blocked_so_far`].
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    let start = std::time::Instant::now();
    let out = f();
    BLOCKED.with(|b| b.set(b.get() + start.elapsed()));
    out
}

/// A collective or a point-to-point copy in flight. Its tensors are kept here until it is
/// waited for (or dropped, which waits too: Gloo must not write into freed memory).
pub struct Pending {
    raw: *mut RawWork,
    op: &'static str,
    out: Tensor,
    _input: Tensor,
}

impl Pending {
    /// Blocks until the collective is done and returns its output.
    pub fn wait(mut self) -> Result<Tensor, C10dError> {
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        if raw.is_null() {
            return Ok(self.out.shallow_clone());
        }
        let mut err = std::ptr::null_mut();
        // SAFETY: raw came from fsdp_all_gather_start and is freed exactly once here.
        let rc = blocking(|| unsafe { fsdp_work_wait(raw, &mut err) });
        unsafe { fsdp_work_free(raw) };
        if rc == 0 {
            Ok(self.out.shallow_clone())
        } else {
            Err(take_error(self.op, err))
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            let mut err = std::ptr::null_mut();
            // SAFETY: as in `wait`; an error here has nobody to go to.
            let raw = self.raw;
            unsafe {
                if blocking(|| fsdp_work_wait(raw, &mut err)) != 0 {
                    fsdp_free_error(err);
                }
                fsdp_work_free(raw);
            }
        }
    }
}

/// A c10d call failed (a peer died, a timeout, a bad argument).
#[derive(Debug, thiserror::Error)]
#[error("c10d {op} failed: {message}")]
pub struct C10dError {
    pub op: &'static str,
    pub message: String,
}

impl C10dError {
    /// Whether this process failed, not the group: the allocator found no memory for the
    /// collective's buffers (a host's `can't allocate memory`, CUDA's `out of memory`, a
    /// C++ `bad_alloc`). A peer's death or a timeout says nothing of the kind. Such a rank
    /// has nothing to wait for: its agent sees no node lost and sends no new round, and
    /// waiting for one held the failure back two minutes (`inplace::ORDER_WAIT`) while the
    /// other ranks waited on it.
    pub fn is_own_failure(&self) -> bool {
        let m = self.message.to_ascii_lowercase();
        ["can't allocate memory", "out of memory", "bad_alloc"]
            .iter()
            .any(|what| m.contains(what))
    }
}

fn take_error(op: &'static str, err: *mut c_char) -> C10dError {
    let message = if err.is_null() {
        "no message".to_owned()
    } else {
        // SAFETY: the shim returns a NUL-terminated malloc'd string we now own.
        let m = unsafe { CStr::from_ptr(err) }
            .to_string_lossy()
            .into_owned();
        unsafe { fsdp_free_error(err) };
        m
    };
    C10dError { op, message }
}

/// Where and how to meet the other ranks (from the launcher's environment).
#[derive(Debug, Clone)]
pub struct GroupSpec {
    pub backend: &'static str,
    pub master_addr: String,
    pub master_port: u16,
    pub rank: usize,
    pub world: usize,
    pub timeout: Duration,
    /// `GLOO_SOCKET_IFNAME`, as in PyTorch's Python front end.
    pub gloo_ifnames: Option<String>,
}

/// A process group of `world` ranks. Collectives block until every rank took part.
pub struct ProcessGroup {
    raw: *mut RawGroup,
    pub rank: usize,
    pub world: usize,
}

// SAFETY: the group is a c10d object behind a pointer, used by one thread at a time: the
// thread that joins a new group in the background hands it over whole once it is made.
unsafe impl Send for ProcessGroup {}

/// Waits until rank 0's store accepts connections (at most `limit`). c10d's client backs
/// off for hundreds of milliseconds after a refused connection: a rank that re-forms in
/// place a few milliseconds before rank 0 would otherwise hold the whole group for its
/// back-off. Whatever happens here, the store's own connect follows and says what failed.
fn await_store(addr: &str, port: u16, limit: Duration) {
    use std::net::{TcpStream, ToSocketAddrs};
    let end = std::time::Instant::now() + limit;
    while std::time::Instant::now() < end {
        let Some(to) = (addr, port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
        else {
            return;
        };
        if TcpStream::connect_timeout(&to, Duration::from_millis(100)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

impl ProcessGroup {
    /// Joins the group `spec` names: rank 0 hosts the store, the others wait until it
    /// accepts before connecting.
    pub fn connect(spec: &GroupSpec) -> Result<Self, C10dError> {
        if spec.rank != 0 {
            await_store(&spec.master_addr, spec.master_port, spec.timeout);
        }
        Self::new(spec)
    }

    /// Ends the group after a finished run, as `destroy_process_group` (NCCL's
    /// communicators shut down gracefully). Dropping it instead aborts them.
    pub fn close(mut self) {
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        // SAFETY: created by fsdp_pg_new and freed once (Drop skips a null one).
        unsafe { fsdp_pg_free(raw, 1) };
    }

    /// Rank 0 hosts the store at `master_addr:master_port`; everyone connects to it.
    pub fn new(spec: &GroupSpec) -> Result<Self, C10dError> {
        let cstr = |s: &str| {
            CString::new(s).map_err(|_| C10dError {
                op: "init",
                message: format!("'{s}' contains a NUL byte"),
            })
        };
        let backend = cstr(spec.backend)?;
        let addr = cstr(&spec.master_addr)?;
        let ifnames = cstr(spec.gloo_ifnames.as_deref().unwrap_or(""))?;
        let mut err = std::ptr::null_mut();
        // SAFETY: valid C strings for the duration of the call; err is an out-pointer.
        let raw = unsafe {
            fsdp_pg_new(
                backend.as_ptr(),
                addr.as_ptr(),
                spec.master_port,
                spec.rank as c_int,
                spec.world as c_int,
                spec.timeout.as_millis() as i64,
                ifnames.as_ptr(),
                &mut err,
            )
        };
        if raw.is_null() {
            return Err(take_error("init", err));
        }
        Ok(Self {
            raw,
            rank: spec.rank,
            world: spec.world,
        })
    }

    fn check(&self, op: &'static str, rc: c_int, err: *mut c_char) -> Result<(), C10dError> {
        if rc == 0 {
            Ok(())
        } else {
            Err(take_error(op, err))
        }
    }

    /// `t` ← the sum of `t` over all ranks.
    pub fn all_reduce_sum(&self, t: &mut Tensor) -> Result<(), C10dError> {
        let mut err = std::ptr::null_mut();
        // SAFETY: the tensor outlives the blocking call.
        let rc = blocking(|| unsafe { fsdp_all_reduce_sum(self.raw, t.as_mut_ptr(), &mut err) });
        self.check("all_reduce", rc, err)
    }

    /// `out` (n) ← the sum over ranks of this rank's n-slice of `input` (n × world).
    pub fn reduce_scatter_sum(
        &self,
        out: &mut Tensor,
        input: &mut Tensor,
    ) -> Result<(), C10dError> {
        let mut err = std::ptr::null_mut();
        // SAFETY: both tensors outlive the blocking call.
        let rc = blocking(|| unsafe {
            fsdp_reduce_scatter_sum(self.raw, out.as_mut_ptr(), input.as_mut_ptr(), &mut err)
        });
        self.check("reduce_scatter", rc, err)
    }

    /// `out` (n × world) ← every rank's `input` (n), in rank order.
    pub fn all_gather(&self, out: &mut Tensor, input: &mut Tensor) -> Result<(), C10dError> {
        let mut err = std::ptr::null_mut();
        // SAFETY: both tensors outlive the blocking call.
        let rc = blocking(|| unsafe {
            fsdp_all_gather(self.raw, out.as_mut_ptr(), input.as_mut_ptr(), &mut err)
        });
        self.check("all_gather", rc, err)
    }

    /// Starts `all_gather(out, input)` and returns at once.
    pub fn all_gather_start(&self, out: Tensor, input: Tensor) -> Result<Pending, C10dError> {
        let (mut out, mut input) = (out, input);
        let mut err = std::ptr::null_mut();
        // SAFETY: `Pending` keeps both tensors alive until the work is waited for.
        let raw = unsafe {
            fsdp_all_gather_start(self.raw, out.as_mut_ptr(), input.as_mut_ptr(), &mut err)
        };
        if raw.is_null() {
            return Err(take_error("all_gather", err));
        }
        Ok(Pending {
            raw,
            op: "all_gather",
            out,
            _input: input,
        })
    }

    /// Starts sending `t` to rank `dst`; the receiver's [`Self::recv_start`] names the
    /// same `tag`.
    pub fn send_start(&self, t: Tensor, dst: usize, tag: i32) -> Result<Pending, C10dError> {
        let mut t = t;
        let mut err = std::ptr::null_mut();
        // SAFETY: `Pending` keeps the tensor alive until the work is waited for.
        let raw = unsafe { fsdp_send_start(self.raw, t.as_mut_ptr(), dst as c_int, tag, &mut err) };
        if raw.is_null() {
            return Err(take_error("send", err));
        }
        Ok(Pending {
            raw,
            op: "send",
            out: t,
            _input: Tensor::new(),
        })
    }

    /// Starts receiving into `t` (its size is the sender's) from rank `src`.
    pub fn recv_start(&self, t: Tensor, src: usize, tag: i32) -> Result<Pending, C10dError> {
        let mut t = t;
        let mut err = std::ptr::null_mut();
        // SAFETY: as in `send_start`.
        let raw = unsafe { fsdp_recv_start(self.raw, t.as_mut_ptr(), src as c_int, tag, &mut err) };
        if raw.is_null() {
            return Err(take_error("recv", err));
        }
        Ok(Pending {
            raw,
            op: "recv",
            out: t,
            _input: Tensor::new(),
        })
    }

    /// `t` ← rank `root`'s `t`.
    pub fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), C10dError> {
        let mut err = std::ptr::null_mut();
        // SAFETY: the tensor outlives the blocking call.
        let rc = blocking(|| unsafe {
            fsdp_broadcast(self.raw, t.as_mut_ptr(), root as c_int, &mut err)
        });
        self.check("broadcast", rc, err)
    }

    pub fn barrier(&self) -> Result<(), C10dError> {
        let mut err = std::ptr::null_mut();
        // SAFETY: plain call on a live group.
        let rc = blocking(|| unsafe { fsdp_barrier(self.raw, &mut err) });
        self.check("barrier", rc, err)
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: created by fsdp_pg_new and freed once.
            unsafe { fsdp_pg_free(self.raw, 0) };
        }
    }
}

/// The ranks this process trains with: alone, or in a c10d group.
pub enum Comm {
    Single,
    Group(ProcessGroup),
}

impl Comm {
    pub fn rank(&self) -> usize {
        match self {
            Self::Single => 0,
            Self::Group(g) => g.rank,
        }
    }

    pub fn world(&self) -> usize {
        match self {
            Self::Single => 1,
            Self::Group(g) => g.world,
        }
    }

    /// The process group, when there is one (point-to-point copies need it).
    pub fn group(&self) -> Option<&ProcessGroup> {
        match self {
            Self::Single => None,
            Self::Group(g) => Some(g),
        }
    }

    /// Ends the group after a finished run ([`ProcessGroup::close`]).
    pub fn close(self) {
        if let Self::Group(g) = self {
            g.close();
        }
    }

    pub fn all_reduce_sum(&self, t: &mut Tensor) -> Result<(), C10dError> {
        match self {
            Self::Single => Ok(()),
            Self::Group(g) => g.all_reduce_sum(t),
        }
    }

    /// The sum over ranks of one number from each: the ranks agreeing on a flag or a
    /// status. The number travels on `device` (NCCL takes device tensors only).
    pub fn sum_over_ranks(&self, value: f32, device: tch::Device) -> Result<f64, C10dError> {
        let mut t = Tensor::from_slice(&[value]).to_device(device);
        self.all_reduce_sum(&mut t)?;
        Ok(t.double_value(&[0]))
    }

    pub fn reduce_scatter_sum(
        &self,
        out: &mut Tensor,
        input: &mut Tensor,
    ) -> Result<(), C10dError> {
        match self {
            Self::Single => {
                out.copy_(input);
                Ok(())
            }
            Self::Group(g) => g.reduce_scatter_sum(out, input),
        }
    }

    pub fn all_gather(&self, out: &mut Tensor, input: &mut Tensor) -> Result<(), C10dError> {
        match self {
            Self::Single => {
                out.copy_(input);
                Ok(())
            }
            Self::Group(g) => g.all_gather(out, input),
        }
    }

    /// Starts `all_gather(out, input)`; alone, it is done at once.
    pub fn all_gather_start(&self, out: Tensor, input: Tensor) -> Result<Pending, C10dError> {
        match self {
            Self::Single => {
                let mut out = out;
                out.copy_(&input);
                Ok(Pending {
                    raw: std::ptr::null_mut(),
                    op: "all_gather",
                    out,
                    _input: input,
                })
            }
            Self::Group(g) => g.all_gather_start(out, input),
        }
    }

    pub fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), C10dError> {
        match self {
            Self::Single => Ok(()),
            Self::Group(g) => g.broadcast(t, root),
        }
    }

    pub fn barrier(&self) -> Result<(), C10dError> {
        match self {
            Self::Single => Ok(()),
            Self::Group(g) => g.barrier(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::C10dError;

    fn error(message: &str) -> C10dError {
        C10dError {
            op: "all_gather",
            message: message.to_owned(),
        }
    }

    /// The messages libtorch gives when this process's allocator fails, against those of a
    /// group that broke under it (a peer gone, a timeout): only the first end the rank.
    #[test]
    fn a_failed_allocation_is_the_ranks_own_failure_and_a_lost_peer_is_not() {
        for own in [
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate \
             memory: you tried to allocate 46407680 bytes. Error code 12 (Cannot allocate memory)",
            "CUDA out of memory. Tried to allocate 20.00 MiB",
            "CUDA error: out of memory",
            "std::bad_alloc",
        ] {
            assert!(error(own).is_own_failure(), "{own}");
        }
        for group in [
            "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting \
             20000ms for recv operation to complete",
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer \
             [127.0.0.1]:53012",
            "NCCL communicator was aborted on rank 1",
            "no message",
        ] {
            assert!(!error(group).is_own_failure(), "{group}");
        }
    }
}
