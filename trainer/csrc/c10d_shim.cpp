// A C interface to PyTorch's own c10d: TCPStore plus ProcessGroupGloo (and, when built
// with FSDP_WITH_NCCL, ProcessGroupNCCL). Rust reaches it through `extern "C"`; tensors
// cross as tch's `at::Tensor*`. Every call catches C++ exceptions and returns the message,
// so a dead peer becomes an error in Rust rather than an abort.

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef FSDP_WITH_NCCL
#include <dlfcn.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

// A collective in flight (Gloo runs it on its own threads); the tensors stay referenced
// by the work until it completes.
struct fsdp_work {
  c10::intrusive_ptr<c10d::Work> work;
};

struct fsdp_pg {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

static char* dup_message(const char* what) {
  size_t n = std::strlen(what);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) {
    std::memcpy(out, what, n + 1);
  }
  return out;
}

#define FSDP_TRY(err, body)                  \
  try {                                      \
    body                                     \
  } catch (const std::exception& e) {        \
    *(err) = dup_message(e.what());          \
  } catch (...) {                            \
    *(err) = dup_message("unknown C++ error"); \
  }

extern "C" {

void fsdp_free_error(char* err) { std::free(err); }

// Creates the store (rank 0 hosts it at master_addr:port) and the process group.
// `backend` is "gloo" or "nccl"; `ifnames` is GLOO_SOCKET_IFNAME (comma-separated) or "".
fsdp_pg* fsdp_pg_new(const char* backend, const char* master_addr, uint16_t port, int rank,
                     int world, int64_t timeout_ms, const char* ifnames, char** err) {
  FSDP_TRY(err, {
#ifdef FSDP_WITH_NCCL
    if (std::string(backend) == "nccl") {
      // ProcessGroupNCCL::Options embeds NCCL's ncclConfig_t, which grows between NCCL
      // releases: compiled against other NCCL headers than the library PyTorch loads,
      // this file and libtorch lay it out differently (seen: a crash in ~Options when
      // the group was freed, after training had run). Refused before anyone waits on
      // the store. (A statically linked NCCL has no symbol to ask: not checked.)
      using get_version_fn = ncclResult_t (*)(int*);
      auto get = reinterpret_cast<get_version_fn>(dlsym(RTLD_DEFAULT, "ncclGetVersion"));
      int loaded = 0;
      if (get != nullptr && get(&loaded) == ncclSuccess && loaded / 100 != NCCL_VERSION_CODE / 100) {
        std::ostringstream msg;
        msg << "this fsdp-trainer was compiled against NCCL " << NCCL_MAJOR << "." << NCCL_MINOR
            << " headers but NCCL " << loaded / 10000 << "." << (loaded / 100) % 100
            << " is loaded (PyTorch's): rebuild it (cargo build --features cuda) in the "
               "environment whose nvidia-nccl package this PyTorch uses";
        *err = dup_message(msg.str().c_str());
        return nullptr;
      }
    }
#endif
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = rank == 0;
    opts.numWorkers = static_cast<size_t>(world);
    opts.waitWorkers = true;
    opts.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(std::string(master_addr), opts);
    c10::intrusive_ptr<c10d::Store> store = tcp;
    auto pg = new fsdp_pg();
    pg->store = store;
    std::string which(backend);
    if (which == "gloo") {
      auto o = c10d::ProcessGroupGloo::Options::create(timeout);
      std::string names(ifnames);
      if (!names.empty()) {
        std::stringstream ss(names);
        std::string name;
        while (std::getline(ss, name, ',')) {
          o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
        }
      } else {
        o->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      o->threads = static_cast<int>(o->devices.size()) * 2;
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("gloo", store);
      pg->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, world, o);
    }
#ifdef FSDP_WITH_NCCL
    else if (which == "nccl") {
      auto o = c10d::ProcessGroupNCCL::Options::create();
      o->timeout = timeout;
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("nccl", store);
      pg->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, world, o);
    }
#endif
    else {
      delete pg;
      *err = dup_message(("backend not built into this trainer: " + which).c_str());
      return nullptr;
    }
    return pg;
  })
  return nullptr;
}

// Ends the group. `clean` (a finished run): as destroy_process_group() does, NCCL's
// communicators are shut down first, or its destructor warns that destroy_process_group()
// was not called. Otherwise (a failed collective, a peer gone, a warning signal) they are
// aborted: a graceful end could wait on work a dead peer will never complete.
void fsdp_pg_free(fsdp_pg* pg, int clean) {
#ifdef FSDP_WITH_NCCL
  if (auto nccl = c10::dynamic_intrusive_pointer_cast<c10d::ProcessGroupNCCL>(pg->backend)) {
    try {
      if (clean != 0) {
        nccl->shutdown();
      } else {
        nccl->abort();
      }
    } catch (...) {
      // Nothing to report to: the group is going away either way.
    }
  }
#else
  (void)clean;
#endif
  delete pg;
}

int fsdp_all_reduce_sum(fsdp_pg* pg, at::Tensor* t, char** err) {
  FSDP_TRY(err, {
    std::vector<at::Tensor> ts{*t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    pg->backend->allreduce(ts, o)->wait();
    return 0;
  })
  return 1;
}

// `out` (n elements) = the sum over ranks of this rank's slice of `in` (n * world).
int fsdp_reduce_scatter_sum(fsdp_pg* pg, at::Tensor* out, at::Tensor* in, char** err) {
  FSDP_TRY(err, {
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    pg->backend->_reduce_scatter_base(*out, *in, o)->wait();
    return 0;
  })
  return 1;
}

// `out` (n * world elements) = every rank's `in` (n), in rank order.
int fsdp_all_gather(fsdp_pg* pg, at::Tensor* out, at::Tensor* in, char** err) {
  FSDP_TRY(err, {
    pg->backend->_allgather_base(*out, *in)->wait();
    return 0;
  })
  return 1;
}

// Starts the same all-gather without waiting for it: `fsdp_work_wait` finishes it.
fsdp_work* fsdp_all_gather_start(fsdp_pg* pg, at::Tensor* out, at::Tensor* in, char** err) {
  FSDP_TRY(err, {
    auto w = new fsdp_work();
    w->work = pg->backend->_allgather_base(*out, *in);
    return w;
  })
  return nullptr;
}

// Starts sending `t` to rank `dst` (a point-to-point copy beside the collectives: the
// snapshot a rank keeps of its buddy's shard). `fsdp_work_wait` finishes it.
fsdp_work* fsdp_send_start(fsdp_pg* pg, at::Tensor* t, int dst, int tag, char** err) {
  FSDP_TRY(err, {
    std::vector<at::Tensor> ts{*t};
    auto w = new fsdp_work();
    w->work = pg->backend->send(ts, dst, tag);
    return w;
  })
  return nullptr;
}

// Starts receiving into `t` from rank `src`, matched with its `fsdp_send_start` by tag.
fsdp_work* fsdp_recv_start(fsdp_pg* pg, at::Tensor* t, int src, int tag, char** err) {
  FSDP_TRY(err, {
    std::vector<at::Tensor> ts{*t};
    auto w = new fsdp_work();
    w->work = pg->backend->recv(ts, src, tag);
    return w;
  })
  return nullptr;
}

int fsdp_work_wait(fsdp_work* w, char** err) {
  FSDP_TRY(err, {
    w->work->wait();
    return 0;
  })
  return 1;
}

void fsdp_work_free(fsdp_work* w) { delete w; }

int fsdp_broadcast(fsdp_pg* pg, at::Tensor* t, int root, char** err) {
  FSDP_TRY(err, {
    std::vector<at::Tensor> ts{*t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    pg->backend->broadcast(ts, o)->wait();
    return 0;
  })
  return 1;
}

int fsdp_barrier(fsdp_pg* pg, char** err) {
  FSDP_TRY(err, {
    pg->backend->barrier()->wait();
    return 0;
  })
  return 1;
}

// Makes `grad` the gradient of `param`: autograd then accumulates into it in place, so
// the trainer's flat gradient buffer is the gradients themselves, with no copy.
int fsdp_set_grad(at::Tensor* param, at::Tensor* grad, char** err) {
  FSDP_TRY(err, {
    param->mutable_grad() = *grad;
    return 0;
  })
  return 1;
}

// Back-propagates `grad` (the gradient of `out`) into the leaves `out` depends on, as
// torch.autograd.backward(out, grad): tch only back-propagates from a scalar.
int fsdp_backward(at::Tensor* out, at::Tensor* grad, char** err) {
  FSDP_TRY(err, {
    torch::autograd::backward({*out}, {*grad});
    return 0;
  })
  return 1;
}

}  // extern "C"
