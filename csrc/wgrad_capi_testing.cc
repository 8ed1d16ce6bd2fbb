// The test library's C ABI (tests and benchmarks only; never compiled into the op library
// users load): test doubles and probes over the framework-free core, for ctypes.  The library
// is built from build_config's CORE_SOURCES + CAPI_SOURCES + CAPI_TEST_SOURCES by
// benchmarks/gpu/pmg_gpu_bench/build.py (tests: tests/helpers.py test_library()).  dtype codes
// and error convention as in wgrad_capi.cc.
//
//   * the GPU path's decisions (wgrad_gpu_plan.h): alignment, targets, bias mode and path,
//     workspace plan, element alignment, places, the bias kernel's grid and its CPU reference,
//     the algorithm cache;
//   * the bf16 scan's kernels (pmg_bf16_min_nonzero_bits_c, pmg_bf16_native_is_exact_c);
//   * pmg_fake_gpu_flow[_ex]: the Paddle binding's GPU branch (wgrad_gpu_flow.h) run on a
//     recording fake host, and pmg_fake_cuda_core: the CUDA core's steps (wgrad_cuda_flow.h) on
//     a fake GPU (heuristic results, SMs, workspace, pointer places, pending error, allocation
//     failures and exceptions chosen by the caller), in every build.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "wgrad_capi_util.h"
#include "wgrad_core.h"
#include "wgrad_cuda.h"
#include "wgrad_cuda_flow.h"
#include "wgrad_gpu_flow.h"
#include "wgrad_gpu_plan.h"

using pmg_capi::copy_out;
using pmg_capi::cuda_entry_problem;
using pmg_capi::finish;
using pmg_capi::make_args;

// What a fake GPU does (pmg_fake_cuda_core, pmg_fake_gpu_flow_ex); ctypes mirrors it
// (tests/test_gpu_paths.py FakeGpuConfig).  Zeros give a plain 132-SM sm_90 whose heuristic
// offers the same split-K-free algorithm with and without the epilogue.
struct PmgFakeGpu {
  int32_t sms;          // 0: 132
  int32_t capability;   // 0: 90
  int32_t epi_missing;  // cuBLASLt offers no split-K-free BGRADA algorithm
  int32_t epi_algo, epi_tile, epi_stages;
  float epi_waves;
  int32_t plain_missing;                                       // no plain algorithm either
  int32_t plain_algo, plain_tile, plain_stages, plain_splitk;  // splitk 0 = 1
  float plain_waves;
  uint64_t gemm_workspace;  // the algorithms' workspace under the full limit
  int32_t zero_ws_missing;  // no algorithm without workspace
  uint64_t alloc_limit;     // allocations above this fail (0: none fails)
  int32_t pending_error;    // a CUDA error is pending before the call
  int32_t misplaced;        // 0 none; 1..4 x, dy, dweight, dbias is elsewhere (below)
  int32_t misplaced_kind, misplaced_device;  // PointerPlace kind/device for that pointer
  int32_t stream_elsewhere;  // 0: the stream is on the call's device; d + 1: on gpu:d
  int32_t cuda_major;        // the CUDA release built against; 0: 13
};

namespace {

// A fake GPU for pmg::cuda_core_flow: answers from a PmgFakeGpu, records each step.
struct FakeGpu {
  const PmgFakeGpu& cfg;
  std::string* trace;
  int fail = 0;  // bit 2 (4): the launch fails
  std::vector<std::vector<char>>* buffers;

  void log(const std::string& s) { *trace += (trace->empty() ? "" : " ") + s; }
  std::string pending_error() {
    if (!cfg.pending_error) return "";
    log("pending-error");
    return pmg::pending_error_message("cudaErrorIllegalAddress",
                                      "an illegal memory access was encountered");
  }
  std::string device_info(int* cap, int* sms) {
    *cap = cfg.capability ? cfg.capability : 90;
    *sms = cfg.sms ? cfg.sms : 132;
    return "";
  }
  int cuda_major() const { return cfg.cuda_major ? cfg.cuda_major : 13; }
  int device = 0;
  std::string pointer_place(const void*, pmg::PointerPlace* out) {
    static const char* const names[] = {"", "x", "dy", "dweight", "dbias"};
    out->kind = 2;
    out->device = device;
    if (cfg.misplaced > 0 && cfg.misplaced <= 4 &&
        std::strcmp(out->name, names[cfg.misplaced]) == 0) {
      out->kind = cfg.misplaced_kind;
      out->device = cfg.misplaced_device;
    }
    return "";
  }
  std::string stream_device(void*, int* d) {
    *d = cfg.stream_elsewhere > 0 ? cfg.stream_elsewhere - 1 : device;
    return "";
  }
  std::string heuristic(const pmg::WgradArgs& a, bool epilogue, uint64_t max_ws,
                        pmg::GemmCandidate* out, std::string* why, pmg::CudaReport* rep) {
    log(std::string("heuristic(") + (epilogue ? "epilogue" : "plain") +
        ",M=" + std::to_string(pmg::heuristic_rows(a.M)) + ",ws<=" + std::to_string(max_ws) + ")");
    rep->align[0] = pmg::pointer_alignment(a.dy);
    rep->align[1] = pmg::pointer_alignment(a.x);
    rep->align[2] = rep->align[3] = pmg::pointer_alignment(a.dw);
    pmg::GemmCandidate g;
    const bool missing =
        (epilogue ? cfg.epi_missing : cfg.plain_missing) || (max_ws == 0 && cfg.zero_ws_missing);
    g.found = !missing;
    if (epilogue) {
      g.algo_id = cfg.epi_algo;
      g.tile = cfg.epi_tile;
      g.stages = cfg.epi_stages;
      g.splitk = 1;
      g.waves = cfg.epi_waves;
    } else {
      g.algo_id = cfg.plain_algo;
      g.tile = cfg.plain_tile;
      g.stages = cfg.plain_stages;
      g.splitk = cfg.plain_splitk ? cfg.plain_splitk : 1;
      g.waves = cfg.plain_waves;
    }
    g.workspace = std::min<uint64_t>(cfg.gemm_workspace, max_ws);
    if (!g.found)
      *why = std::string("cuBLASLt offers no ") +
             (epilogue ? "split-K-free BGRADA-epilogue " : "") +
             "algorithm (fake, workspace <= " + std::to_string(max_ws) + ")";
    *out = g;
    return "";
  }
  std::string check_images(int cap, bool simulated, pmg::BiasPath path, pmg::DType) {
    if (path == pmg::BiasPath::kNone) return "";
    if (!pmg::targets_cover("sm_80+sm_90+compute_90", cap))
      return "this GPU is " + pmg::capability_name(cap) + (simulated ? " (simulated)" : "") +
             " but paddle_mgrad's CUDA kernels were built for sm_80+sm_90+compute_90";
    return "";
  }
  const pmg::CudaExec* exec = nullptr;
  void* alloc(size_t bytes, std::string* why, pmg::CudaReport* rep) {
    if (cfg.alloc_limit && bytes > cfg.alloc_limit) {
      log("alloc-failed(" + std::to_string(bytes) + ")");
      *why = "out of memory (fake limit " + std::to_string(cfg.alloc_limit) + " bytes)";
      return nullptr;
    }
    if (exec->alloc) {  // the binding's allocator (FakeHost: it logs, and may fail)
      void* p = exec->alloc(bytes, exec->alloc_user);
      if (p == nullptr)
        *why = "the allocator returned null";
      else
        rep->workspace_from = "allocator";
      return p;
    }
    log("alloc(" + std::to_string(bytes) + ")");
    buffers->emplace_back(bytes);
    rep->workspace_from = "stream-ordered";
    return buffers->back().data();
  }
  std::string launch(const pmg::WgradArgs&, const pmg::CallPlan& cp, char*, int) {
    if (fail & 4) return "fake core failure";
    log(std::string("launch(bias=") + pmg::bias_path_name(cp.path) +
        ",gemm_ws=" + std::to_string(cp.gemm.found ? cp.gemm.workspace : 0) +
        ",splitk=" + std::to_string(cp.gemm.found ? cp.gemm.splitk : 0) +
        ",splits=" + std::to_string(cp.ws.splits) + ")");
    return "";
  }
};

// A fake host for pmg::gpu_flow: records each step into `trace`, fails where told.
struct FakeHost {
  std::vector<pmg::Placement> places;
  std::vector<const char*> names;
  const char* bias_env = nullptr;
  // bit 0: the guard, bit 1: the workspace allocator, bit 2: the core's launch,
  // bit 3: allocate_outputs throws, bit 4: the core throws (both inside the device guard)
  int fail = 0;
  PmgFakeGpu gpu = {};
  std::string report;  // the core's CudaReport::text()
  bool dweight_given = false, dbias_wanted = false, dbias_given = false;
  int current = 0;  // the "current device"
  std::string trace;
  float dw[4] = {0, 0, 0, 0}, db[2] = {0, 0};
  std::vector<std::vector<char>> buffers;

  void log(const std::string& s) { trace += (trace.empty() ? "" : " ") + s; }
  int count() const { return static_cast<int>(places.size()); }
  const char* name(int i) const { return names[i]; }
  pmg::Placement place(int i) const { return places[i]; }
  const char* env(const char*) const { return bias_env; }

  class Guard {
   public:
    Guard(FakeHost* h, int device) : h_(h) {
      if (h->fail & 1) {
        err_ = "fake guard failure for gpu:" + std::to_string(device);
        h->log("guard-failed");
        return;
      }
      prev_ = h->current;
      h->current = device;
      h->log("guard(" + std::to_string(device) + ")");
    }
    ~Guard() {
      if (!err_.empty()) return;
      h_->current = prev_;
      h_->log("unguard(" + std::to_string(prev_) + ")");
    }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    bool ok() const { return err_.empty(); }
    std::string error() const { return err_; }

   private:
    FakeHost* h_;
    int prev_ = 0;
    std::string err_;
  };
  Guard enter_device(int device) { return Guard(this, device); }
  void* stream() {
    log("stream(" + std::to_string(current) + ")");
    return reinterpret_cast<void*>(static_cast<uintptr_t>(0x5000 + current));
  }
  std::string allocate_outputs(pmg::WgradArgs* a) {
    if (fail & 8) {
      log("throw");
      throw std::runtime_error("fake exception from allocate_outputs");
    }
    a->dw = dw;
    a->dw_beta = dweight_given ? 1.f : 0.f;
    if (!dweight_given) log("alloc-dweight(" + std::to_string(current) + ")");
    if (dbias_wanted) {
      a->db = db;
      a->db_beta = dbias_given ? 1.f : 0.f;
      if (!dbias_given) log("alloc-dbias(" + std::to_string(current) + ")");
    }
    return "";
  }
  static void* allocate_workspace(size_t bytes, void* self) {
    auto* h = static_cast<FakeHost*>(self);
    h->log("workspace(" + std::to_string(bytes) + "@" + std::to_string(h->current) + ")");
    if (h->fail & 2) return nullptr;
    h->buffers.emplace_back(bytes);
    return h->buffers.back().data();
  }
  std::string run_core(const pmg::WgradArgs& a, const pmg::CudaExec& exec) {
    log("core(device=" + std::to_string(exec.device) +
        ",stream=" + std::to_string(reinterpret_cast<uintptr_t>(exec.stream) - 0x5000) +
        ",bias=" + pmg::bias_mode_name(exec.bias_mode) + ")");
    if (fail & 16) {
      log("throw");
      throw std::runtime_error("fake exception from the core");
    }
    // the real core's steps (pmg::cuda_core_flow) on a fake GPU, scratch from this host
    FakeGpu g{gpu, &trace, fail, &buffers};
    g.device = exec.device;
    g.exec = &exec;
    pmg::CudaReport rep;
    const std::string err = pmg::cuda_core_flow(g, a, exec, &rep);
    report = rep.text();
    return err;
  }
};

}  // namespace

extern "C" {

// 1 when oneDNN's bf16 GEMM of these bf16 inputs cannot flush a subnormal (the check the CPU
// core runs before it; benchmarks/bench_bf16_scan.py times it against the GEMM), else 0.
int pmg_bf16_native_is_exact_c(const void* x, int64_t nx, const void* dy, int64_t ny) {
  return pmg::bf16_native_is_exact(static_cast<const uint16_t*>(x), nx,
                                   static_cast<const uint16_t*>(dy), ny)
             ? 1
             : 0;
}

int pmg_bf16_min_nonzero_bits_c(const void* p, int64_t n, int kernel) {
  return pmg::bf16_min_nonzero_bits(static_cast<const uint16_t*>(p), n, kernel);
}

// ---- the GPU path's decisions (wgrad_gpu_plan.h), reachable without a GPU
uint32_t pmg_pointer_alignment(uintptr_t address) {
  return pmg::pointer_alignment(reinterpret_cast<const void*>(address));
}

int pmg_targets_cover(const char* targets, int capability) {
  return pmg::targets_cover(targets ? targets : "", capability) ? 1 : 0;
}

// Returns 0 auto, 1 epilogue, 2 kernel, or -1 with the message in err.
int pmg_parse_bias_mode(const char* text, char* err, int err_len) {
  pmg::BiasMode m;
  const std::string msg = pmg::parse_bias_mode(text, &m);
  if (!msg.empty()) {
    copy_out(msg, err, err_len);
    return -1;
  }
  return static_cast<int>(m);
}

// Returns the bias path before cuBLASLt is asked (0 none, 1 epilogue, 2 kernel), or -1 when
// a forced epilogue cannot apply; `why` says why the kernel (or why refused).
int pmg_choose_bias(int in_dtype, int64_t M, int64_t K, int64_t N, int has_dw, int dw_dtype,
                    int has_db, int db_dtype, int bias_mode, char* why, int why_len) {
  static float dummy;
  const pmg::WgradArgs a = make_args(&dummy, &dummy, in_dtype, M, K, N, has_dw ? &dummy : nullptr,
                                     dw_dtype, 1.f, has_db ? &dummy : nullptr, db_dtype, 1.f);
  const pmg::BiasChoice c = pmg::choose_bias(a, static_cast<pmg::BiasMode>(bias_mode));
  copy_out(c.why, why, why_len);
  return c.refused ? -1 : static_cast<int>(c.path);
}

// out[0..7]: gemm_offset, bias_tmp_offset, bias_tmp_bytes, partial_offset, partial_bytes,
// splits, total, request.
void pmg_plan_workspace(int in_dtype, int64_t M, int64_t K, int64_t N, int bias_path,
                        uint64_t gemm_workspace, int sms, int64_t* out) {
  const pmg::WgradArgs a =
      make_args(nullptr, nullptr, in_dtype, M, K, N, nullptr, 0, 1.f, nullptr, 0, 1.f);
  const pmg::WorkspacePlan w =
      pmg::plan_workspace(a, static_cast<pmg::BiasPath>(bias_path), gemm_workspace, sms);
  const int64_t v[8] = {
      static_cast<int64_t>(w.gemm_offset),    static_cast<int64_t>(w.bias_tmp_offset),
      static_cast<int64_t>(w.bias_tmp_bytes), static_cast<int64_t>(w.partial_offset),
      static_cast<int64_t>(w.partial_bytes),  w.splits,
      static_cast<int64_t>(w.total),          static_cast<int64_t>(w.request)};
  std::memcpy(out, v, sizeof(v));
}

int pmg_check_element_alignment(const void* x, const void* dy, int in_dtype, int64_t M, int64_t K,
                                int64_t N, void* dw, int dw_dtype, void* db, int db_dtype,
                                char* err, int err_len) {
  const pmg::WgradArgs a =
      make_args(x, dy, in_dtype, M, K, N, dw, dw_dtype, 1.f, db, db_dtype, 1.f);
  return finish(pmg::check_element_alignment(a), err, err_len);
}

// kinds/devices: x, dout, then the given dweight / dbias (names in that order).
int pmg_check_places(const int* kinds, const int* devices, int n, char* err, int err_len) {
  static const char* const all[] = {"x", "dout", "dweight", "dbias"};
  if (n < 0 || n > 4) return finish("n must be 0..4", err, err_len);
  std::vector<pmg::Placement> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p[i] = pmg::Placement{kinds[i], devices[i]};
  return finish(pmg::check_places(all, p.data(), n), err, err_len);
}

// The binding's GPU branch on a fake host (see FakeHost) and the core's steps on a fake GPU
// (`gpu`, may be null: defaults): inputs x, dout [, dweight] [, dbias] at kinds[i]/devices[i];
// `current` is the fake's current device; `fail` bits: 1 guard, 2 workspace allocator, 4 the
// core's launch, 8 allocate_outputs throws, 16 the core throws (both inside the device guard:
// the exception is caught here and reported as "exception: ...").  `trace` receives the steps,
// in order; `report` the core's one-line report.
int pmg_fake_gpu_flow_ex(const int* kinds, const int* devices, int has_dweight, int has_bias,
                         int has_dbias, int in_dtype, int64_t M, int64_t K, int64_t N,
                         const char* bias_env, int current, int fail, const PmgFakeGpu* gpu,
                         char* trace, int trace_len, char* report, int report_len, char* err,
                         int err_len) {
  FakeHost h;
  h.names = {"x", "dout"};
  int n = 2;
  if (has_dweight) h.names.push_back("dweight"), ++n;
  if (has_bias && has_dbias) h.names.push_back("dbias"), ++n;
  for (int i = 0; i < n; ++i) h.places.push_back(pmg::Placement{kinds[i], devices[i]});
  h.bias_env = bias_env;
  h.fail = fail;
  h.current = current;
  h.dweight_given = has_dweight != 0;
  h.dbias_wanted = has_bias != 0;
  h.dbias_given = has_dbias != 0;
  if (gpu != nullptr) h.gpu = *gpu;
  static const double xs[16] = {0}, dys[16] = {0};  // never read: the fake launches nothing
  pmg::WgradArgs a;
  a.x = xs;
  a.dy = dys;
  a.in_dtype = static_cast<pmg::DType>(in_dtype);
  a.M = M;
  a.K = K;
  a.N = N;
  a.dw_dtype = pmg::mp_type(a.in_dtype);
  a.db_dtype = pmg::mp_type(a.in_dtype);
  std::string msg;
  try {
    msg = pmg::gpu_flow(h, a);  // the guard is released inside: its step is traced
  } catch (const std::exception& e) {
    msg = std::string("exception: ") + e.what();
  }
  copy_out(h.trace, trace, trace_len);
  copy_out(h.report, report, report_len);
  return finish(msg, err, err_len);
}

// The first form (kept for callers): M = K = N = 2, a default fake GPU.
int pmg_fake_gpu_flow(const int* kinds, const int* devices, int has_dweight, int has_bias,
                      int has_dbias, int in_dtype, const char* bias_env, int current, int fail,
                      char* trace, int trace_len, char* err, int err_len) {
  return pmg_fake_gpu_flow_ex(kinds, devices, has_dweight, has_bias, has_dbias, in_dtype, 2, 2, 2,
                              bias_env, current, fail, nullptr, trace, trace_len, nullptr, 0, err,
                              err_len);
}

// The CUDA core's steps (pmg::cuda_core_flow) on a fake GPU, called as the C ABI's CUDA entry
// point would be (pointers are not dereferenced: the fake launches nothing).  No allocator is
// given: the fake GPU's own (stream-ordered) allocation, limited by gpu->alloc_limit.
int pmg_fake_cuda_core(const void* x, const void* dy, int in_dtype, int64_t M, int64_t K, int64_t N,
                       void* dw, int dw_dtype, float dw_beta, void* db, int db_dtype, float db_beta,
                       int device, int bias_mode, int sim_capability, int fail,
                       const PmgFakeGpu* gpu, char* trace, int trace_len, char* report,
                       int report_len, char* err, int err_len) {
  const pmg::WgradArgs a =
      make_args(x, dy, in_dtype, M, K, N, dw, dw_dtype, dw_beta, db, db_dtype, db_beta);
  const std::string bad = cuda_entry_problem(a, bias_mode);
  if (!bad.empty()) return finish(bad, err, err_len);
  PmgFakeGpu cfg = {};
  if (gpu != nullptr) cfg = *gpu;
  std::string steps;
  std::vector<std::vector<char>> buffers;
  FakeGpu g{cfg, &steps, fail, &buffers};
  pmg::CudaExec exec;
  exec.device = device;
  exec.bias_mode = static_cast<pmg::BiasMode>(bias_mode);
  exec.sim_capability = sim_capability;
  g.device = device;
  g.exec = &exec;
  pmg::CudaReport rep;
  const std::string msg = pmg::cuda_core_flow(g, a, exec, &rep);
  copy_out(steps, trace, trace_len);
  copy_out(rep.text(), report, report_len);
  return finish(msg, err, err_len);
}

// The bias kernel's grid for these inputs: out[0..5] = vec, threads_x, threads_y, col_blocks,
// splits, rows_per.
void pmg_plan_bias_kernel(int64_t M, int64_t N, int in_dtype, uintptr_t dy_address, int sms,
                          int64_t* out) {
  const pmg::BiasKernelPlan p =
      pmg::plan_bias_kernel(M, N, static_cast<pmg::DType>(in_dtype), dy_address, sms);
  const int64_t v[6] = {p.vec, p.threads_x, p.threads_y, p.col_blocks, p.splits, p.rows_per};
  std::memcpy(out, v, sizeof(v));
}

// The bias kernel's column sums of dy[M, N] on the CPU, in its exact order for a GPU of `sms`
// SMs with dY at `dy_address` (the plan's vector width); out[N] (fp32 or fp64 sums, widened).
void pmg_bias_reduce_reference(const void* dy, int in_dtype, int64_t M, int64_t N,
                               uintptr_t dy_address, int sms, double* out) {
  const pmg::DType t = static_cast<pmg::DType>(in_dtype);
  pmg::bias_reduce_reference(dy, t, M, N, pmg::plan_bias_kernel(M, N, t, dy_address, sms), out);
}

int64_t pmg_heuristic_rows(int64_t M) {
  return pmg::heuristic_rows(M);
}

// The algorithm cache's behaviour for a sequence of token counts (one shape otherwise):
// out[0] heuristic queries, out[1] final size, out[2] evictions.
void pmg_algo_cache_sim(const int64_t* rows, int n, int capacity, int64_t* out) {
  pmg::LruCache<int64_t, int> cache(static_cast<size_t>(capacity));
  int64_t queries = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t k = pmg::heuristic_rows(rows[i]);
    if (cache.find(k) == nullptr) {
      ++queries;
      cache.put(k, 1);
    }
  }
  out[0] = queries;
  out[1] = static_cast<int64_t>(cache.size());
  out[2] = static_cast<int64_t>(cache.evictions());
}

}  // extern "C"
