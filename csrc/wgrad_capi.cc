// The op library's C ABI, for ctypes: run the cores on raw pointers and ask what the library
// is and does (pmg_cuda_stats, pmg_cpu_bf16_path, ...).  dtype codes: 0 = float32,
// 1 = bfloat16, 2 = float16, 3 = float64 (pmg::DType).  Calls return 0 on success, else 1 with
// the message copied into err[err_len].
//
//   * the cores: pmg_wgrad_cpu_c, pmg_wgrad_cuda_c (CUDA builds), pmg_wgrad_cuda_ex (CUDA
//     builds: explicit device, stream, workspace or allocator, bias mode, simulated capability,
//     and a one-line report of what ran);
//   * what the library carries and does: pmg_has_cuda, pmg_cpu_gemm_backend, pmg_cpu_isa,
//     pmg_cpu_bf16_path, pmg_cpu_thread_scratch_bytes, pmg_cuda_targets, pmg_cuda_stats.
//
// Exactly these pmg_* names (and wgrad_pyentry.cc's pmg_fast_module) are exported:
// paddle_mgrad/ops/build_config.py EXPORTED_C_SYMBOLS lists them, and
// tests/ops/test_exported_symbols.py checks the built library against that list.  Test
// doubles -- the fake GPU and fake host, the probes of the GPU path's decisions and of the bf16
// scan kernels, the bias kernel's CPU reference -- live in wgrad_capi_testing.cc, which only the
// test and benchmark library (benchmarks/gpu/pmg_gpu_bench/build.py) compiles.
#include <cstdint>
#include <string>

#include "wgrad_capi_util.h"
#include "wgrad_core.h"
#include "wgrad_cuda.h"

using pmg_capi::copy_out;
using pmg_capi::finish;
using pmg_capi::make_args;

extern "C" {

const char* pmg_cpu_gemm_backend() {
  return pmg::cpu_gemm_backend();
}
// What the CPU offers (run-time cpuid), and how a bf16 call would run now
// ("onednn-bf16" or "widen-sgemm"; PADDLE_MGRAD_CPU_BF16 forces one).
const char* pmg_cpu_isa() {
  return pmg::cpu_isa();
}
const char* pmg_cpu_bf16_path() {
  return pmg::cpu_bf16_path();
}
// What the CPU path keeps for the calling thread between calls (pmg::cpu_thread_scratch_bytes).
uint64_t pmg_cpu_thread_scratch_bytes() {
  return pmg::cpu_thread_scratch_bytes();
}

int pmg_wgrad_cpu_c(const void* x, const void* dy, int in_dtype, int64_t M, int64_t K, int64_t N,
                    void* dw, int dw_dtype, float dw_beta, void* db, int db_dtype, float db_beta,
                    char* err, int err_len) {
  const pmg::WgradArgs a =
      make_args(x, dy, in_dtype, M, K, N, dw, dw_dtype, dw_beta, db, db_dtype, db_beta);
  const std::string bad = pmg::check_args(a);
  return finish(bad.empty() ? pmg::wgrad_cpu(a) : bad, err, err_len);
}

// 1 when this library carries the CUDA core.
int pmg_has_cuda() {
#ifdef PMG_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

#ifdef PMG_WITH_CUDA
// The full CUDA entry point.  `alloc` (may be null) is a pmg::WorkspaceAllocFn; bias_mode:
// 0 auto, 1 epilogue, 2 kernel; sim_capability: 0 = the real GPU.  `info` receives one line
// saying what ran (CudaReport::text()), also on errors.
int pmg_wgrad_cuda_ex(const void* x, const void* dy, int in_dtype, int64_t M, int64_t K, int64_t N,
                      void* dw, int dw_dtype, float dw_beta, void* db, int db_dtype, float db_beta,
                      int device, void* stream, void* workspace, size_t workspace_bytes,
                      pmg::WorkspaceAllocFn alloc, void* alloc_user, int bias_mode,
                      int sim_capability, char* info, int info_len, char* err, int err_len) {
  const pmg::WgradArgs a =
      make_args(x, dy, in_dtype, M, K, N, dw, dw_dtype, dw_beta, db, db_dtype, db_beta);
  const std::string bad = pmg_capi::cuda_entry_problem(a, bias_mode);
  if (!bad.empty()) return finish(bad, err, err_len);
  pmg::CudaExec exec;
  exec.device = device;
  exec.stream = stream;
  exec.workspace = workspace;
  exec.workspace_bytes = workspace_bytes;
  exec.alloc = alloc;
  exec.alloc_user = alloc_user;
  exec.bias_mode = static_cast<pmg::BiasMode>(bias_mode);
  exec.sim_capability = sim_capability;
  pmg::CudaReport rep;
  const std::string msg = pmg::wgrad_cuda(a, exec, &rep);
  copy_out(rep.text(), info, info_len);
  return finish(msg, err, err_len);
}

// The short form (kept for existing callers): auto bias path, stream-ordered scratch.
int pmg_wgrad_cuda_c(const void* x, const void* dy, int in_dtype, int64_t M, int64_t K, int64_t N,
                     void* dw, int dw_dtype, float dw_beta, void* db, int db_dtype, float db_beta,
                     void* stream, int device, char* err, int err_len) {
  return pmg_wgrad_cuda_ex(x, dy, in_dtype, M, K, N, dw, dw_dtype, dw_beta, db, db_dtype, db_beta,
                           device, stream, nullptr, 0, nullptr, nullptr, 0, 0, nullptr, 0, err,
                           err_len);
}

const char* pmg_cuda_targets() {
  return pmg::cuda_targets();
}

void pmg_cuda_stats(char* buf, int len) {
  copy_out(pmg::cuda_stats(), buf, len);
}
#endif  // PMG_WITH_CUDA

}  // extern "C"
