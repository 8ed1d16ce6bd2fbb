// The GPU path's decisions, as plain functions with no CUDA and no Paddle.
//
// Everything the CUDA core (wgrad_cuda.cu) and the Paddle binding's GPU branch
// (wgrad_gpu_flow.h) decide -- pointer alignments for cuBLASLt, whether the
// compiled kernels can run on a GPU, which bias-gradient path runs, the
// workspace layout, whether every input is on the same device, the
// PADDLE_MGRAD_CUDA_BIAS setting -- lives here.  This file is compiled into
// every build (CPU ones too), so the CPU test suite reaches each decision
// through the C ABI (wgrad_capi.cc) without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "wgrad_core.h"

namespace pmg {

// Largest power of two that divides the address, capped at 256 (what cuBLASLt assumes by
// default: CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES, "uint32_t, default: 256").  A null
// pointer (nothing is read) counts as 256.
uint32_t pointer_alignment(const void* p);

// Every pointer the call will touch is aligned to its element size (a bf16 view may start
// at +2 bytes, an fp32 one at +4, never at +2: that is no view of real data).  "" or the
// message naming the pointer.
std::string check_element_alignment(const WgradArgs& a);

// How the bias gradient is computed on the GPU (PADDLE_MGRAD_CUDA_BIAS):
//   auto      cuBLASLt's BGRADA epilogue when it applies, else our deterministic kernel;
//   epilogue  the epilogue or an error saying why it cannot run (tests, benchmarks);
//   kernel    always our deterministic two-pass kernel.
enum class BiasMode : int { kAuto = 0, kEpilogue = 1, kKernel = 2 };
const char* bias_mode_name(BiasMode m);
// Parses the variable's text (null or "" = auto; case-insensitive).  "" or the message.
std::string parse_bias_mode(const char* text, BiasMode* out);

enum class BiasPath : int { kNone = 0, kEpilogue = 1, kKernel = 2 };
const char* bias_path_name(BiasPath p);

// The bias path before asking cuBLASLt: the epilogue only fuses into a GEMM that runs
// (dW given, M, K, N > 0), only for fp32 compute (not fp64 inputs) and only into an fp32
// dW -- the epilogue's bias-gradient vector has D's type ("Bias gradient vector elements
// are the same type as the output elements"), and we want it in fp32 before adding it.
// `why` says why the kernel runs (auto mode) or why the forced epilogue cannot ("" else).
struct BiasChoice {
  BiasPath path = BiasPath::kNone;
  std::string why;
  bool refused = false;  // BiasMode::kEpilogue asked for, and it cannot apply
};
BiasChoice choose_bias(const WgradArgs& a, BiasMode mode);

// Code targets the module was compiled for, e.g. "sm_80+sm_90+compute_90" (build_config's
// -DPMG_CUDA_TARGETS): can a GPU of compute capability `cap` (major * 10 + minor) run them?
// SASS sm_XY runs on the same major with minor >= Y; PTX compute_XY is JIT-compiled by the
// driver for any capability >= XY.
bool targets_cover(const std::string& targets, int cap);
// "sm_70" for 70.
std::string capability_name(int cap);

// The bias kernel's grid: row slices (`splits`) so that the GPU is filled ~4x, each slice
// at least kBiasMinRows rows; 0 when M == 0.
constexpr int kBiasThreads = 256;
constexpr int64_t kBiasMinRows = 64;
int64_t bias_splits(int64_t M, int64_t N, int sms);

// One call's scratch memory, each part 256-byte aligned inside one buffer:
//   [cuBLASLt workspace][epilogue's fp32 bias gradient, N][bias kernel's partial sums]
struct WorkspacePlan {
  size_t gemm_offset = 0, gemm_bytes = 0;
  size_t bias_tmp_offset = 0, bias_tmp_bytes = 0;
  size_t partial_offset = 0, partial_bytes = 0;
  int64_t splits = 0;
  size_t total = 0;  // bytes from a 256-byte aligned base
  size_t request = 0;  // bytes to ask for when the base may be unaligned (total + 255), 0 if none
};
WorkspacePlan plan_workspace(const WgradArgs& a, BiasPath path, size_t gemm_workspace, int sms);

// Where a tensor lives: kind 0 = CPU, 1 = GPU, 2 = anything else (pinned, XPU, custom).
struct Placement {
  int kind = 0;
  int device = 0;
};
// Every given tensor is where names[0] (x) is.  "" or the message naming the misplaced one.
std::string check_places(const char* const* names, const Placement* places, int n);

}  // namespace pmg
