// Weight/bias-gradient accumulation core.  Knows nothing about Paddle.
//
//   dW[K, N] = beta * dW + X[M, K]^T . dY[M, N]      (row-major, fp32 accumulate)
//   db[N]    = beta * db + sum_m dY[m, :]
//
// beta is 1 to accumulate into an existing buffer (fp32 master gradients,
// `main_grad`) and 0 to fill a fresh one.  Inputs may be fp32, bf16 or fp16;
// outputs fp32 (multi-precision) or the input dtype.
#pragma once

#include <cstdint>
#include <string>

namespace pmg {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

const char* dtype_name(DType t);

struct WgradArgs {
  const void* x = nullptr;   // [M, K], dtype in_dtype
  const void* dy = nullptr;  // [M, N], dtype in_dtype
  DType in_dtype = DType::kF32;
  int64_t M = 0, K = 0, N = 0;
  void* dw = nullptr;        // [K, N], dtype dw_dtype (may be null: skip)
  DType dw_dtype = DType::kF32;
  float dw_beta = 1.f;
  void* db = nullptr;        // [N], dtype db_dtype (may be null: skip)
  DType db_dtype = DType::kF32;
  float db_beta = 1.f;
};

// Which GEMM the CPU path uses: "onednn" when linked against oneDNN, else
// "portable" (blocked OpenMP loops).
const char* cpu_gemm_backend();

// Returns an empty string on success, else a message naming what failed.
std::string wgrad_cpu(const WgradArgs& a);

// Conversions (exposed for tests of the portable path).
float bf16_to_f32(uint16_t v);
uint16_t f32_to_bf16(float f);  // round to nearest even, NaN preserved
float f16_to_f32(uint16_t v);
uint16_t f32_to_f16(float f);   // round to nearest even, saturating to inf

}  // namespace pmg
