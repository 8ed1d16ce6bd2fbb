// Weight/bias-gradient accumulation core.  Knows nothing about Paddle.
//
//   dW[K, N] = beta * dW + X[M, K]^T . dY[M, N]      (row-major)
//   db[N]    = beta * db + sum_m dY[m, :]
//
// beta is 1 to accumulate into an existing buffer (fp32 master gradients,
// `main_grad`) and 0 to fill a fresh one.  Inputs may be fp32, bf16, fp16 or
// fp64.  Accumulators are the input dtype or its "multi-precision" type
// (mp_type: fp32 for fp32/bf16/fp16, fp64 for fp64 -- Paddle's MPTypeTrait);
// sums are computed in mp_type and rounded once into the accumulator.
//
// Any of M, K, N may be 0: a zero-element tensor's data pointer may be null,
// and the core reads X only when M, K, N > 0 and dY only when M, N > 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pmg {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3 };

const char* dtype_name(DType t);

// Bytes per element of a dtype (4, 2, 2, 8).
size_t dtype_bytes(DType t);

inline bool valid_dtype_code(int d) {
  return d >= 0 && d <= 3;
}

// Paddle's MPTypeTrait: the accumulation type of an input dtype.
inline DType mp_type(DType in) {
  return in == DType::kF64 ? DType::kF64 : DType::kF32;
}

// THE accumulator rule (checked here for both bindings, and once in Python's
// ops._check): an accumulator is the input dtype or its multi-precision type.
inline bool acc_dtype_ok(DType in, DType acc) {
  return acc == in || acc == mp_type(in);
}

struct WgradArgs {
  const void* x = nullptr;   // [M, K], dtype in_dtype
  const void* dy = nullptr;  // [M, N], dtype in_dtype
  DType in_dtype = DType::kF32;
  int64_t M = 0, K = 0, N = 0;
  void* dw = nullptr;  // [K, N], dtype dw_dtype (may be null: skip)
  DType dw_dtype = DType::kF32;
  float dw_beta = 1.f;
  void* db = nullptr;  // [N], dtype db_dtype (may be null: skip)
  DType db_dtype = DType::kF32;
  float db_beta = 1.f;
};

// Validates dimensions, dtypes and the pointers the computation will read or
// write.  Both bindings (wgrad_op.cc, wgrad_capi.cc) call it before a core;
// the cores assume it passed.  Returns "" or a message naming the problem.
std::string check_args(const WgradArgs& a);

// Which GEMM the CPU path uses: "onednn" when linked against oneDNN, else
// "portable" (blocked OpenMP loops).
const char* cpu_gemm_backend();

// What this CPU offers, detected at run time (cpuid + xgetbv), e.g.
// "avx2 fma f16c" or "avx512f avx512_bf16 amx_bf16 ...".
const char* cpu_isa();
// True when the CPU has native bf16 dot products (avx512_bf16 or AMX-BF16) usable
// by the OS AND oneDNN will use them (ONEDNN_MAX_CPU_ISA=AVX2 or lower says no).
bool cpu_has_native_bf16();
// Bytes of the scratch buffers the CPU path keeps for the calling thread between calls (the
// widen workspace and the fp32 product of a same-precision weight gradient); 0 before the
// thread's first call that needs one.
size_t cpu_thread_scratch_bytes();

// How bf16 inputs are multiplied on the CPU, decided at run time on each call:
//   "onednn-bf16"  oneDNN's dnnl_gemm_bf16bf16f32 (native bf16 CPUs),
//   "widen-sgemm"  bf16 widened to fp32 in row chunks + fp32 GEMM (others).
// PADDLE_MGRAD_CPU_BF16=native|widen forces one (auto: by the CPU).  Without
// oneDNN the answer is always "widen-sgemm" (portable fp32 GEMM).
// Either way the results are IEEE fp32 with gradual underflow: a call whose
// inputs could make the native kernel flush a subnormal (bf16_native_is_exact)
// is widened instead, and counted in cpu_bf16_exact_fallbacks().
const char* cpu_bf16_path();

// False when oneDNN's bf16 GEMM could flush a subnormal for these inputs (it
// reads subnormal bf16 as zero and flushes subnormal fp32 results): a subnormal
// in x [nx values] or dy [ny], or smallest nonzero magnitudes whose exponents
// add up to less than -112 (a product or partial sum could fall below FLT_MIN).
// One memory-bound pass over both inputs.
bool bf16_native_is_exact(const uint16_t* x, int64_t nx, const uint16_t* dy, int64_t ny);

// Its pass, exposed for tests: the smallest nonzero |value| of n bf16 values as bits
// (0x0001..0x7fff; 0x10000 when all are zeros) computed by `kernel` (2 = AVX-512BW,
// 1 = AVX2, 0 = portable, -1 = the best this CPU has); -1 when this CPU lacks that kernel.
int bf16_min_nonzero_bits(const uint16_t* p, int64_t n, int kernel);

// Calls (process-wide, since load) that took the widen path for that reason.
uint64_t cpu_bf16_exact_fallbacks();

// The environment knobs a CPU call with this input dtype reads (PADDLE_MGRAD_CPU_BF16,
// PADDLE_MGRAD_CPU_CHUNK_ROWS, PADDLE_MGRAD_CPU_FP64_KERNEL; also declared and checked
// at import by paddle_mgrad/env.py): "" or the message naming the variable and the
// accepted values.  wgrad_cpu checks it before writing anything.
std::string cpu_env_problem(DType in_dtype);

// Returns an empty string on success, else a message naming what failed.
std::string wgrad_cpu(const WgradArgs& a);

}  // namespace pmg
