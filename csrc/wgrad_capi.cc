// A C ABI over the framework-free core, for ctypes (benchmarks/gpu/ and the
// Paddle-free core tests).  dtype codes: 0 = float32, 1 = bfloat16, 2 = float16,
// 3 = float64 (pmg::DType).
// Returns 0 on success, else 1 with the message copied into err[err_len].
#include <cstring>
#include <string>

#include "wgrad_core.h"
#ifdef PMG_WITH_CUDA
#include "wgrad_cuda.h"
#endif

namespace {

pmg::WgradArgs make_args(const void* x, const void* dy, int in_dtype, int64_t M, int64_t K,
                         int64_t N, void* dw, int dw_dtype, float dw_beta, void* db, int db_dtype,
                         float db_beta) {
  pmg::WgradArgs a;
  a.x = x;
  a.dy = dy;
  a.in_dtype = static_cast<pmg::DType>(in_dtype);
  a.M = M;
  a.K = K;
  a.N = N;
  a.dw = dw;
  a.dw_dtype = static_cast<pmg::DType>(dw_dtype);
  a.dw_beta = dw_beta;
  a.db = db;
  a.db_dtype = static_cast<pmg::DType>(db_dtype);
  a.db_beta = db_beta;
  return a;
}

int finish(const std::string& msg, char* err, int err_len) {
  if (msg.empty()) return 0;
  if (err != nullptr && err_len > 0) {
    std::strncpy(err, msg.c_str(), static_cast<size_t>(err_len - 1));
    err[err_len - 1] = '\0';
  }
  return 1;
}

}  // namespace

extern "C" {

const char* pmg_cpu_gemm_backend() { return pmg::cpu_gemm_backend(); }
// What the CPU offers (run-time cpuid), and how a bf16 call would run now
// ("onednn-bf16" or "widen-sgemm"; PADDLE_MGRAD_CPU_BF16 forces one).
const char* pmg_cpu_isa() { return pmg::cpu_isa(); }
const char* pmg_cpu_bf16_path() { return pmg::cpu_bf16_path(); }

int pmg_wgrad_cpu_c(const void* x, const void* dy, int in_dtype, int64_t M, int64_t K, int64_t N,
                    void* dw, int dw_dtype, float dw_beta, void* db, int db_dtype, float db_beta,
                    char* err, int err_len) {
  const pmg::WgradArgs a =
      make_args(x, dy, in_dtype, M, K, N, dw, dw_dtype, dw_beta, db, db_dtype, db_beta);
  const std::string bad = pmg::check_args(a);
  return finish(bad.empty() ? pmg::wgrad_cpu(a) : bad, err, err_len);
}

// 1 when oneDNN's bf16 GEMM of these bf16 inputs cannot flush a subnormal (the check the CPU
// core runs before it; benchmarks/bench_bf16_scan.py times it against the GEMM), else 0.
int pmg_bf16_native_is_exact_c(const void* x, int64_t nx, const void* dy, int64_t ny) {
  return pmg::bf16_native_is_exact(static_cast<const uint16_t*>(x), nx,
                                   static_cast<const uint16_t*>(dy), ny) ? 1 : 0;
}

int pmg_bf16_min_nonzero_bits_c(const void* p, int64_t n, int kernel) {
  return pmg::bf16_min_nonzero_bits(static_cast<const uint16_t*>(p), n, kernel);
}

#ifdef PMG_WITH_CUDA
int pmg_wgrad_cuda_c(const void* x, const void* dy, int in_dtype, int64_t M, int64_t K, int64_t N,
                     void* dw, int dw_dtype, float dw_beta, void* db, int db_dtype, float db_beta,
                     void* stream, int device, char* err, int err_len) {
  const pmg::WgradArgs a =
      make_args(x, dy, in_dtype, M, K, N, dw, dw_dtype, dw_beta, db, db_dtype, db_beta);
  const std::string bad = pmg::check_args(a);
  return finish(bad.empty() ? pmg::wgrad_cuda(a, stream, device) : bad, err, err_len);
}
#endif

}  // extern "C"
