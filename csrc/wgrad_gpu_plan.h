// The GPU path's decisions, as plain functions with no CUDA and no Paddle.
//
// Everything the CUDA core (wgrad_cuda.cu, in the order of wgrad_cuda_flow.h) and the
// Paddle binding's GPU branch (wgrad_gpu_flow.h) decide -- pointer alignments for
// cuBLASLt, whether the compiled kernels and the CUDA libraries can run on a GPU, which
// bias-gradient path runs (before and after cuBLASLt's heuristic), the bias kernel's grid
// and order (with a CPU reference), the workspace layout and the retry without cuBLASLt
// workspace, whether every input is on the same device, the C ABI's checks, the
// heuristic's row buckets, the algorithm cache's bound, the PADDLE_MGRAD_CUDA_BIAS
// setting -- lives here.  This file is compiled into
// every build (CPU ones too), so the CPU test suite reaches each decision
// through the C ABI (wgrad_capi.cc) without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <string>
#include <utility>

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
// The CUDA libraries of the build's major release run on this GPU: CUDA 13 removed Maxwell,
// Pascal and Volta (sm_50 .. sm_72) from its libraries, so cuBLASLt 13 has no kernel for a
// V100 -- not even the bias-free GEMM.  "" or the message (before any write).
std::string check_library_support(int cap, int cuda_major, bool simulated);

// ---- the epilogue after the heuristic
//
// One of cuBLASLt's heuristic results, as far as the choice needs it (cublasLtMatmulAlgo
// config attributes ALGO_ID, TILE_ID, STAGES_ID, SPLITK_NUM; the result's wavesCount: "1.0f
// suggests that when the kernel is launched it will fully occupy the GPU").
struct GemmCandidate {
  bool found = false;
  int32_t algo_id = -1, tile = -1, stages = -1, splitk = 1;
  float waves = 0.f;
  size_t workspace = 0;
};
// cuBLASLt's epilogue candidate (its first split-K-free BGRADA algorithm) against the plain
// GEMM's best.  Auto mode keeps the epilogue only where it costs the GEMM nothing: its algorithm
// is the plain GEMM's best (same algorithm, tile, stages, no split-K), or it fills the SMs (at
// least one full wave).  Otherwise -- typically small K*N with large M (LoRA, narrow
// projections, MoE experts), where the plain GEMM's best splits K -- the plain GEMM (split-K
// allowed: cublasLt.h documents its reduction as ordered) + our bias kernel.  Forced epilogue:
// the epilogue whenever cuBLASLt has one, else `error`.  `epi_why`: why there is none.
struct EpilogueDecision {
  BiasPath path = BiasPath::kEpilogue;
  std::string why;    // why the kernel runs instead (auto)
  std::string error;  // forced epilogue impossible
};
EpilogueDecision decide_epilogue(BiasMode mode, const GemmCandidate& epi,
                                 const std::string& epi_why, const GemmCandidate& plain);

// ---- the bias kernel
//
// db[n] = beta * db[n] + sum_m dY[m, n], deterministic, in two launches:
//   pass 1, grid (col_blocks, splits), block (threads_x, threads_y): block (bx, s) sums the rows
//     [s * rows_per, min(M, (s + 1) * rows_per)) of vec * threads_x columns.  Thread (tx, ty)
//     loads `vec` adjacent columns with one 16-byte load per row (vec = 16 / element size when
//     dY and N allow, else 1) and keeps one running sum per column over the rows
//     m = m0 + ty, m0 + ty + threads_y, ...; the threads_y sums of a column are then added as a
//     binary tree in shared memory (stride threads_y / 2, ..., 1: a[t] = a[t] + a[t + stride])
//     into partial[s, n];
//   pass 2, one thread per column: db[n] = beta * db[n] + cascade_sum(partial[0..splits-1, n]).
// Slices: enough blocks to fill the SMs ~4x, each slice at least kBiasMinSliceRows rows (the
// partial sums' traffic stays small against dY's) and each row lane at least kBiasMinLaneRows,
// no slice longer than kBiasMaxRowsPerSlice unless the partial sums would pass
// kBiasMaxPartialBytes (a huge N: longer slices instead of more scratch).  The order depends on (M,
// N, vec, sms) only, never on scheduling: bias_reduce_reference (CPU) follows it to the bit.
constexpr int kBiasThreads = 256;
constexpr int64_t kBiasMinLaneRows = 4;
constexpr int64_t kBiasMinSliceRows = 64;
constexpr int64_t kBiasMaxRowsPerSlice = 4096;
constexpr int64_t kBiasMaxPartialBytes = 64ll << 20;
struct BiasKernelPlan {
  int vec = 1;
  int threads_x = 0, threads_y = 0;
  int64_t col_blocks = 0, splits = 0, rows_per = 0;
};
// dy_addr: the address of dY (the 16-byte loads need it and every row start 16-byte aligned).
BiasKernelPlan plan_bias_kernel(int64_t M, int64_t N, DType in, uintptr_t dy_addr, int sms);

#if defined(__CUDACC__)
#define PMG_HD __host__ __device__
#else
#define PMG_HD
#endif
// Pairwise sum of v[0], v[stride], ..., v[(n-1)*stride] in a fixed binary-counter order (the
// tree of a balanced pairwise summation, built left to right with a stack of <= 64 levels).
template <typename A>
PMG_HD inline A cascade_sum(const A* v, int64_t n, int64_t stride) {
  A stack[64];
  int depth = 0;
  for (int64_t i = 0; i < n; ++i) {
    A x = v[i * stride];
    for (int64_t c = i + 1; (c & 1) == 0 && depth > 0; c >>= 1) x = stack[--depth] + x;
    stack[depth++] = x;
  }
  if (depth == 0) return A(0);
  A acc = stack[--depth];
  while (depth > 0) acc = stack[--depth] + acc;
  return acc;
}

// The bias kernel's sums (no beta), computed on the CPU in exactly its order: out[n] in fp32
// (fp64 for fp64 inputs) widened to double.  For tests and the GPU check's bitwise comparison.
void bias_reduce_reference(const void* dy, DType in, int64_t M, int64_t N,
                           const BiasKernelPlan& plan, double* out);

// One call's scratch memory, each part 256-byte aligned inside one buffer:
//   [cuBLASLt workspace][epilogue's fp32 bias gradient, N][bias kernel's partial sums]
struct WorkspacePlan {
  size_t gemm_offset = 0, gemm_bytes = 0;
  size_t bias_tmp_offset = 0, bias_tmp_bytes = 0;
  size_t partial_offset = 0, partial_bytes = 0;
  int64_t splits = 0;
  size_t total = 0;    // bytes from a 256-byte aligned base
  size_t request = 0;  // bytes to ask for when the base may be unaligned (total + 255), 0 if none
};
WorkspacePlan plan_workspace(const WgradArgs& a, BiasPath path, size_t gemm_workspace, int sms);

// ---- memory pressure
// The most workspace cuBLASLt is offered (H100-class GEMMs want up to 32 MiB).
constexpr uint64_t kMaxGemmWorkspace = 32ull << 20;
// One call's plan: the bias path, the GEMM's workspace and the scratch layout.
struct CallPlan {
  BiasPath path = BiasPath::kNone;
  std::string why;
  GemmCandidate gemm;  // the algorithm the matmul runs (found = false: no matmul)
  WorkspacePlan ws;
};
// plan(max_gemm_workspace, CallPlan*) -> "" or error; alloc(bytes, std::string* why) -> base or
// null.  When the scratch cannot be had and the plan included cuBLASLt workspace, plan again
// with none (cuBLASLt runs every GEMM without workspace; Paddle's own op offers 4 MiB) and try
// once more; `*retried` says so.  Nothing is written in here: an error leaves dW and db as they
// were.
template <class Plan, class Alloc>
std::string plan_and_allocate(Plan&& plan, Alloc&& alloc, CallPlan* out, char** base,
                              bool* retried) {
  *retried = false;
  *base = nullptr;
  std::string err = plan(kMaxGemmWorkspace, out);
  if (!err.empty() || out->ws.request == 0) return err;
  std::string why;
  *base = static_cast<char*>(alloc(out->ws.request, &why));
  if (*base != nullptr) return "";
  const size_t first = out->ws.request;
  const std::string tail = "; dweight and dbias were not touched";
  if (out->ws.gemm_bytes == 0)
    return "could not allocate " + std::to_string(first) + " bytes of scratch (" + why + ")" + tail;
  *retried = true;
  err = plan(0, out);
  if (!err.empty())
    return "could not allocate " + std::to_string(first) + " bytes of scratch (" + why +
           "), and without cuBLASLt workspace: " + err + tail;
  if (out->ws.request == 0) return "";
  std::string why2;
  *base = static_cast<char*>(alloc(out->ws.request, &why2));
  if (*base != nullptr) return "";
  return "could not allocate " + std::to_string(first) + " bytes of scratch (" + why + "), nor " +
         std::to_string(out->ws.request) + " without cuBLASLt workspace (" + why2 + ")" + tail;
}

// ---- the C ABI's extra checks
// Without rows (M = 0) dW = beta * dW needs a scale the core does not have: only beta 0 (clear)
// and 1 (keep) are accepted.  "" or the message.
std::string check_rowless_beta(const WgradArgs& a);
// Where a pointer lives, from cudaPointerGetAttributes: kind 0 unregistered host memory,
// 1 registered/pinned host memory, 2 device memory, 3 managed memory; `device` its ordinal.
struct PointerPlace {
  const char* name = "";
  int kind = 2;
  int device = 0;
};
// Every pointer is device memory on `device` (managed memory is accepted anywhere); the stream,
// when its device is known (stream_device >= 0), belongs to `device` too.  "" or the message.
std::string check_pointer_places(const PointerPlace* p, int n, int device, int stream_device);
// The text for a CUDA error that was pending before the call (someone else's earlier work).
std::string pending_error_message(const std::string& error_name, const std::string& error_text);

// ---- the algorithm cache
// The heuristic is asked for M rounded up to a bucket (8 per power of two, <= 12.5 % more rows,
// exact below 64): MoE experts and variable-length batches share one query per bucket.  The
// matmul itself always runs with the real M.
int64_t heuristic_rows(int64_t M);
constexpr size_t kAlgoCacheCapacity = 1024;
// A least-recently-used map of at most `capacity` entries.
template <class K, class V>
class LruCache {
 public:
  explicit LruCache(size_t capacity) : capacity_(capacity) {}
  // The value, made most recent; null when absent.
  V* find(const K& k) {
    auto it = index_.find(k);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return &it->second->second;
  }
  void put(const K& k, const V& v) {
    auto it = index_.find(k);
    if (it != index_.end()) {
      it->second->second = v;
      order_.splice(order_.begin(), order_, it->second);
      return;
    }
    order_.emplace_front(k, v);
    index_[k] = order_.begin();
    while (index_.size() > capacity_ && !order_.empty()) {
      index_.erase(order_.back().first);
      order_.pop_back();
      ++evictions_;
    }
  }
  size_t size() const { return index_.size(); }
  size_t evictions() const { return evictions_; }

 private:
  size_t capacity_;
  size_t evictions_ = 0;
  std::list<std::pair<K, V>> order_;
  std::map<K, typename std::list<std::pair<K, V>>::iterator> index_;
};

// Where a tensor lives: kind 0 = CPU, 1 = GPU, 2 = anything else (pinned, XPU, custom).
struct Placement {
  int kind = 0;
  int device = 0;
};
// Every given tensor is where names[0] (x) is.  "" or the message naming the misplaced one.
std::string check_places(const char* const* names, const Placement* places, int n);

}  // namespace pmg
