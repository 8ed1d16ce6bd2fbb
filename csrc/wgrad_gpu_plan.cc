// The GPU path's decisions (see wgrad_gpu_plan.h).  No CUDA, no Paddle.
#include "wgrad_gpu_plan.h"

#include "wgrad_cpu_dtype.h"  // bf16/fp16 -> fp32 for the bias reference

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <vector>

namespace pmg {

uint32_t pointer_alignment(const void* p) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && addr % align != 0) align /= 2;
  return align;
}

std::string check_element_alignment(const WgradArgs& a) {
  const bool gemm = a.dw != nullptr && a.M > 0 && a.K > 0 && a.N > 0;
  const bool bias = a.db != nullptr && a.M > 0 && a.N > 0;
  struct Item {
    const char* name;
    const void* p;
    DType t;
    bool used;
  };
  const Item items[] = {{"x", a.x, a.in_dtype, gemm},
                        {"dy", a.dy, a.in_dtype, gemm || bias},
                        {"dweight", a.dw, a.dw_dtype, a.dw != nullptr && a.K > 0 && a.N > 0},
                        {"dbias", a.db, a.db_dtype, a.db != nullptr && a.N > 0}};
  for (const Item& it : items) {
    if (!it.used || it.p == nullptr) continue;
    const size_t es = dtype_bytes(it.t);
    if (reinterpret_cast<uintptr_t>(it.p) % es != 0)
      return std::string(it.name) + " pointer " +
             std::to_string(reinterpret_cast<uintptr_t>(it.p)) +
             " is not aligned to its element size (" + std::to_string(es) + " bytes for " +
             dtype_name(it.t) + ")";
  }
  return "";
}

const char* bias_mode_name(BiasMode m) {
  switch (m) {
    case BiasMode::kAuto: return "auto";
    case BiasMode::kEpilogue: return "epilogue";
    case BiasMode::kKernel: return "kernel";
  }
  return "auto";
}

std::string parse_bias_mode(const char* text, BiasMode* out) {
  std::string t;  // stripped and lower-cased, as env.py's _choice reads it
  for (const char* c = text; c != nullptr && *c; ++c)
    t += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
  const size_t b = t.find_first_not_of(" \t\n\r\f\v"), e = t.find_last_not_of(" \t\n\r\f\v");
  t = b == std::string::npos ? "" : t.substr(b, e - b + 1);
  if (t.empty() || t == "auto") {
    *out = BiasMode::kAuto;
  } else if (t == "epilogue") {
    *out = BiasMode::kEpilogue;
  } else if (t == "kernel") {
    *out = BiasMode::kKernel;
  } else {
    return std::string("PADDLE_MGRAD_CUDA_BIAS='") + (text ? text : "") +
           "' is invalid; accepted: auto (default), epilogue or kernel";
  }
  return "";
}

const char* bias_path_name(BiasPath p) {
  switch (p) {
    case BiasPath::kNone: return "none";
    case BiasPath::kEpilogue: return "epilogue";
    case BiasPath::kKernel: return "kernel";
  }
  return "none";
}

BiasChoice choose_bias(const WgradArgs& a, BiasMode mode) {
  BiasChoice c;
  if (a.db == nullptr || a.N == 0) return c;  // no bias gradient to compute
  if (mode == BiasMode::kKernel) {
    c.path = BiasPath::kKernel;
    c.why = "PADDLE_MGRAD_CUDA_BIAS=kernel";
    return c;
  }
  std::string why;
  if (a.dw == nullptr || a.K == 0)
    why = "no weight-gradient GEMM to fuse into";
  else if (a.M == 0)
    why = "no rows (M = 0)";
  else if (a.in_dtype == DType::kF64)
    why = "float64 inputs (the fused bias gradient is for fp32 compute)";
  else if (a.dw_dtype != DType::kF32)
    why = std::string("dweight is ") + dtype_name(a.dw_dtype) +
          " (the epilogue's bias gradient has dweight's type; we add it in float32)";
  if (why.empty()) {
    c.path = BiasPath::kEpilogue;
    return c;
  }
  c.why = why;
  if (mode == BiasMode::kEpilogue) {
    c.refused = true;
    return c;
  }
  c.path = BiasPath::kKernel;
  return c;
}

std::string capability_name(int cap) {
  return "sm_" + std::to_string(cap);
}

std::string check_library_support(int cap, int cuda_major, bool simulated) {
  if (cuda_major < 13 || cap >= 75) return "";
  return "this GPU is " + capability_name(cap) + (simulated ? " (simulated)" : "") +
         " but paddle_mgrad's CUDA part was built with CUDA " + std::to_string(cuda_major) +
         ", whose libraries (cuBLASLt) dropped Maxwell, Pascal and Volta (sm_50 .. sm_72): "
         "dweight and dbias were not touched. Build with CUDA 12 (nvcc 12 and "
         "nvidia-cublas-cu12), or set PADDLE_MGRAD_NO_CUDA=1 to use Paddle's own fused kernel";
}

bool targets_cover(const std::string& targets, int cap) {
  size_t i = 0;
  while (i <= targets.size()) {
    size_t j = targets.find_first_of("+,; ", i);
    if (j == std::string::npos) j = targets.size();
    const std::string tok = targets.substr(i, j - i);
    i = j + 1;
    const bool sass = tok.rfind("sm_", 0) == 0, ptx = tok.rfind("compute_", 0) == 0;
    if (!sass && !ptx) continue;
    const std::string num = tok.substr(sass ? 3 : 8);
    size_t k = 0;
    while (k < num.size() && std::isdigit(static_cast<unsigned char>(num[k]))) ++k;
    if (k == 0) continue;
    const int t = std::atoi(num.substr(0, k).c_str());
    const bool exact = num.size() > k && num[k] == 'a';  // sm_90a: that capability only
    if (exact) {
      if (t == cap) return true;
    } else if (sass) {
      if (t / 10 == cap / 10 && t % 10 <= cap % 10) return true;
    } else if (t <= cap) {
      return true;
    }
  }
  return false;
}

namespace {
int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
}  // namespace

EpilogueDecision decide_epilogue(BiasMode mode, const GemmCandidate& epi,
                                 const std::string& epi_why, const GemmCandidate& plain) {
  EpilogueDecision d;
  if (!epi.found) {
    if (mode == BiasMode::kEpilogue) {
      d.error = "PADDLE_MGRAD_CUDA_BIAS=epilogue, but it cannot apply: " + epi_why;
    } else {
      d.path = BiasPath::kKernel;
      d.why = epi_why;
    }
    return d;
  }
  if (mode == BiasMode::kEpilogue || !plain.found) return d;  // forced, or nothing to compare
  const bool same = epi.algo_id == plain.algo_id && epi.tile == plain.tile &&
                    epi.stages == plain.stages && plain.splitk <= 1;
  if (same || epi.waves >= 1.f) return d;
  auto num = [](float v) {
    const int h = static_cast<int>(v * 100.f + 0.5f);
    return std::to_string(h / 100) + "." + (h % 100 < 10 ? "0" : "") + std::to_string(h % 100);
  };
  d.path = BiasPath::kKernel;
  d.why = "the epilogue's algorithm (" + num(epi.waves) +
          " waves) is not the plain GEMM's best (algorithm " + std::to_string(plain.algo_id) +
          ", split-K " + std::to_string(plain.splitk) + ", " + num(plain.waves) +
          " waves): plain GEMM + bias kernel";
  return d;
}

BiasKernelPlan plan_bias_kernel(int64_t M, int64_t N, DType in, uintptr_t dy_addr, int sms) {
  BiasKernelPlan p;
  if (M <= 0 || N <= 0) return p;
  const int64_t es = static_cast<int64_t>(dtype_bytes(in));
  const int64_t vec = 16 / es;
  p.vec = (dy_addr % 16 == 0 && N % vec == 0) ? static_cast<int>(vec) : 1;
  const int64_t vectors = ceil_div(N, p.vec);  // column groups, one per thread across x
  int tx = 1;
  while (tx < kBiasThreads && tx < vectors) tx *= 2;
  p.threads_x = tx;
  p.threads_y = kBiasThreads / tx;
  p.col_blocks = ceil_div(vectors, tx);
  const int64_t want_blocks = 4 * static_cast<int64_t>(std::max(sms, 1));
  int64_t splits = std::max<int64_t>(1, ceil_div(want_blocks, p.col_blocks));
  // every slice gets >= kBiasMinSliceRows rows, every row lane >= kBiasMinLaneRows ...
  const int64_t min_rows = std::max<int64_t>(kBiasMinSliceRows, kBiasMinLaneRows * p.threads_y);
  splits = std::min(splits, std::max<int64_t>(1, M / min_rows));
  // ... and no slice is longer than kBiasMaxRowsPerSlice (bounds each fp32 running sum)
  splits = std::max(splits, ceil_div(M, kBiasMaxRowsPerSlice));
  const int64_t acc = in == DType::kF64 ? 8 : 4;
  splits = std::min(splits, std::max<int64_t>(1, kBiasMaxPartialBytes / (N * acc)));
  splits = std::min<int64_t>(splits, 65535);  // gridDim.y limit
  p.rows_per = ceil_div(M, splits);
  p.splits = ceil_div(M, p.rows_per);  // no empty slice
  return p;
}

namespace {
template <typename A>
A load_acc(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<A>(static_cast<const float*>(p)[i]);
    case DType::kF64: return static_cast<A>(static_cast<const double*>(p)[i]);
    case DType::kBF16: return static_cast<A>(bf16_to_f32(static_cast<const uint16_t*>(p)[i]));
    case DType::kF16: return static_cast<A>(f16_to_f32(static_cast<const uint16_t*>(p)[i]));
  }
  return A(0);
}

template <typename A>
void reference(const void* dy, DType in, int64_t M, int64_t N, const BiasKernelPlan& p,
               double* out) {
  std::vector<A> partial(static_cast<size_t>(p.splits * N));
  std::vector<A> lanes(static_cast<size_t>(p.threads_y));
  for (int64_t s = 0; s < p.splits; ++s) {
    const int64_t m0 = s * p.rows_per, m1 = std::min(M, m0 + p.rows_per);
    for (int64_t n = 0; n < N; ++n) {
      for (int t = 0; t < p.threads_y; ++t) {
        A acc = 0;
        for (int64_t m = m0 + t; m < m1; m += p.threads_y) acc += load_acc<A>(dy, in, m * N + n);
        lanes[static_cast<size_t>(t)] = acc;
      }
      for (int stride = p.threads_y / 2; stride > 0; stride /= 2)
        for (int t = 0; t < stride; ++t)
          lanes[static_cast<size_t>(t)] =
              lanes[static_cast<size_t>(t)] + lanes[static_cast<size_t>(t + stride)];
      partial[static_cast<size_t>(s * N + n)] = lanes[0];
    }
  }
  for (int64_t n = 0; n < N; ++n)
    out[n] = static_cast<double>(cascade_sum<A>(partial.data() + n, p.splits, N));
}
}  // namespace

void bias_reduce_reference(const void* dy, DType in, int64_t M, int64_t N,
                           const BiasKernelPlan& plan, double* out) {
  if (in == DType::kF64)
    reference<double>(dy, in, M, N, plan, out);
  else
    reference<float>(dy, in, M, N, plan, out);
}

std::string check_rowless_beta(const WgradArgs& a) {
  if (a.M != 0 || a.dw == nullptr || a.K == 0 || a.N == 0) return "";
  if (a.dw_beta == 0.f || a.dw_beta == 1.f) return "";
  return "M = 0 (no rows) with dweight beta " + std::to_string(a.dw_beta) +
         ": without rows the CUDA core can only keep dweight (beta 1) or clear it (beta 0)";
}

std::string check_pointer_places(const PointerPlace* p, int n, int device, int stream_device) {
  for (int i = 0; i < n; ++i) {
    const PointerPlace& q = p[i];
    if (q.kind == 3) continue;  // managed memory: reachable from every device
    if (q.kind != 2)
      return std::string(q.name) + " is " + (q.kind == 0 ? "host memory" : "pinned host memory") +
             ", not device memory on gpu:" + std::to_string(device) +
             "; dweight and dbias were not touched";
    if (q.device != device)
      return std::string(q.name) + " is on gpu:" + std::to_string(q.device) +
             " but the call runs on gpu:" + std::to_string(device) +
             "; dweight and dbias were not touched";
  }
  if (stream_device >= 0 && stream_device != device)
    return "the stream belongs to gpu:" + std::to_string(stream_device) +
           " but the call runs on gpu:" + std::to_string(device) +
           "; dweight and dbias were not touched";
  return "";
}

std::string pending_error_message(const std::string& error_name, const std::string& error_text) {
  return "a CUDA error was already pending before paddle_mgrad's call (from earlier work on "
         "this thread, not from this op): " +
         error_name + ": " + error_text + "; dweight and dbias were not touched";
}

int64_t heuristic_rows(int64_t M) {
  if (M <= 64) return M;
  int64_t top = 1;
  while (top * 2 <= M) top *= 2;  // 2^floor(log2 M)
  const int64_t step = top / 8;
  return ceil_div(M, step) * step;
}

namespace {
size_t up256(size_t v) {
  return (v + 255) & ~static_cast<size_t>(255);
}
}  // namespace

WorkspacePlan plan_workspace(const WgradArgs& a, BiasPath path, size_t gemm_workspace, int sms) {
  WorkspacePlan w;
  w.gemm_bytes = gemm_workspace;
  size_t off = up256(gemm_workspace);
  if (path == BiasPath::kEpilogue) {
    w.bias_tmp_offset = off;
    w.bias_tmp_bytes = static_cast<size_t>(a.N) * 4;
    off = up256(off + w.bias_tmp_bytes);
  } else if (path == BiasPath::kKernel) {
    w.splits =
        plan_bias_kernel(a.M, a.N, a.in_dtype, reinterpret_cast<uintptr_t>(a.dy), sms).splits;
    const size_t acc = a.in_dtype == DType::kF64 ? 8 : 4;
    w.partial_offset = off;
    w.partial_bytes = static_cast<size_t>(w.splits) * static_cast<size_t>(a.N) * acc;
    off = up256(off + w.partial_bytes);
  }
  w.total = off;
  w.request = off == 0 ? 0 : off + 255;
  return w;
}

std::string check_places(const char* const* names, const Placement* places, int n) {
  auto where = [](const Placement& p) {
    if (p.kind == 0) return std::string("cpu");
    if (p.kind == 1) return "gpu:" + std::to_string(p.device);
    return std::string("an unsupported place");
  };
  if (n <= 0) return "";
  const Placement& x = places[0];
  if (x.kind == 2) return std::string(names[0]) + " is on " + where(x) + " (CPU or GPU only)";
  for (int i = 1; i < n; ++i) {
    const Placement& p = places[i];
    if (p.kind != x.kind || (p.kind == 1 && p.device != x.device))
      return std::string(names[i]) + " is on " + where(p) + " but " + names[0] + " is on " +
             where(x) + ": every input must be on " + names[0] + "'s device";
  }
  return "";
}

}  // namespace pmg
