// CUDA implementation of the weight/bias-gradient core (see wgrad_core.h).
// Knows nothing about Paddle and needs no CUDA header: streams and device
// memory are void*.  Decisions it makes are in wgrad_gpu_plan.h.
#pragma once

#include <cstddef>
#include <string>

#include "wgrad_core.h"
#include "wgrad_gpu_plan.h"

namespace pmg {

// Scratch memory for one call: `bytes` of device memory on the call's device, usable by work
// enqueued on the call's stream until the core returns and, after that, released in stream
// order (a caching allocator that hands blocks back to the same stream -- Paddle's -- does
// exactly that).  Returns null when it cannot.
using WorkspaceAllocFn = void* (*)(size_t bytes, void* user);

// Where and how a call runs.  Nothing is taken from "the current device".
struct CudaExec {
  int device = -1;         // CUDA ordinal of every pointer in WgradArgs (required)
  void* stream = nullptr;  // cudaStream_t on `device` (null: the legacy default stream)
  // Scratch, in this order of preference: `workspace` when at least the needed bytes; else
  // `alloc`; else (neither given) stream-ordered cudaMallocAsync/cudaFreeAsync on `stream`,
  // which CUDA-graph capture records as memory nodes.  When the scratch cannot be had (a
  // `workspace` too small without `alloc`, `alloc` returning null, cudaMallocAsync failing) the
  // call is planned again without cuBLASLt workspace and tried once more; then it is an error
  // (before any write).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  WorkspaceAllocFn alloc = nullptr;
  void* alloc_user = nullptr;
  BiasMode bias_mode = BiasMode::kAuto;
  // Tests only: act as if the GPU had this compute capability (major * 10 + minor) when
  // deciding whether our kernels can run on it; 0 = the real one.
  int sim_capability = 0;
};

// What a call did (filled as far as it got, also on errors).
struct CudaReport {
  int capability = 0;  // the GPU's (or the simulated) major * 10 + minor
  BiasPath bias = BiasPath::kNone;
  std::string bias_why;                 // why the kernel ran in auto mode ("" for the epilogue)
  uint32_t align[4] = {0, 0, 0, 0};     // alignment given to cuBLASLt for A (dy), B (x), C = D (dW)
  size_t workspace_bytes = 0;           // bytes used (0: none)
  const char* workspace_from = "none";  // "caller", "allocator", "stream-ordered" or "none"
  bool algo_cached = false;             // the algorithm came from the cache
  bool workspace_retry = false;         // the scratch could not be had: planned again without
                                        // cuBLASLt workspace (memory pressure)
  // One line, e.g.
  // "cap=90 bias=epilogue align=256,2,256,256 workspace=1024@caller cached=1 ws_retry=0".
  std::string text() const {
    std::string s = "cap=" + std::to_string(capability) + " bias=" + bias_path_name(bias);
    if (!bias_why.empty()) s += " (" + bias_why + ")";
    s += " align=" + std::to_string(align[0]) + "," + std::to_string(align[1]) + "," +
         std::to_string(align[2]) + "," + std::to_string(align[3]);
    s += " workspace=" + std::to_string(workspace_bytes) + "@" + workspace_from;
    s += std::string(" cached=") + (algo_cached ? "1" : "0");
    s += std::string(" ws_retry=") + (workspace_retry ? "1" : "0");
    return s;
  }
};

// dW = beta*dW + X^T.dY (cuBLASLt, fp32 compute; fp64 for fp64 inputs) and
// db = beta*db + sum_m dY (cuBLASLt's BGRADA epilogue into an fp32 buffer, then added; or a
// deterministic two-pass reduction), enqueued on exec.stream of exec.device.  All pointers
// are device pointers on exec.device; the arguments passed pmg::check_args.
//
// Every check (device, pointer alignment, algorithm, kernel image for this GPU, scratch
// memory) happens before the first write to dW or db; an error returns with both untouched.
// Returns "" or a message naming what failed.
std::string wgrad_cuda(const WgradArgs& a, const CudaExec& exec, CudaReport* report = nullptr);

// The code targets this build carries, e.g. "sm_80+sm_90+compute_90".
const char* cuda_targets();

// Process-wide counts of bias gradients by path, of calls that planned again without cuBLASLt
// workspace (workspace_retries), and the last call's report (one line).
std::string cuda_stats();

}  // namespace pmg
