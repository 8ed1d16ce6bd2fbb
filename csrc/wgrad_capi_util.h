// Helpers shared by the C ABI (wgrad_capi.cc, in the op library) and the test library's C ABI
// (wgrad_capi_testing.cc, built only for tests and benchmarks): argument packing, copying a
// message into the caller's buffer, and what every CUDA entry point refuses first.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "wgrad_core.h"

namespace pmg_capi {
namespace {  // internal linkage in each library: nothing here is exported

inline pmg::WgradArgs make_args(const void* x, const void* dy, int in_dtype, int64_t M, int64_t K,
                                int64_t N, void* dw, int dw_dtype, float dw_beta, void* db,
                                int db_dtype, float db_beta) {
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

inline void copy_out(const std::string& msg, char* buf, int len) {
  if (buf != nullptr && len > 0) {
    std::strncpy(buf, msg.c_str(), static_cast<size_t>(len - 1));
    buf[len - 1] = '\0';
  }
}

// 0 when msg is empty, else 1 with msg copied into err[err_len].
inline int finish(const std::string& msg, char* err, int err_len) {
  if (msg.empty()) return 0;
  copy_out(msg, err, err_len);
  return 1;
}

// What the CUDA entry points (the real one and the test library's fake GPU) refuse before
// anything else, so that the fake refuses exactly what the real one does.
inline std::string cuda_entry_problem(const pmg::WgradArgs& a, int bias_mode) {
  std::string bad = pmg::check_args(a);
  if (bad.empty() && (bias_mode < 0 || bias_mode > 2))
    bad =
        "bias_mode must be 0 (auto), 1 (epilogue) or 2 (kernel), got " + std::to_string(bias_mode);
  return bad;
}

}  // namespace
}  // namespace pmg_capi
