// The GPU path's decisions (see wgrad_gpu_plan.h).  No CUDA, no Paddle.
#include "wgrad_gpu_plan.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

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
      return std::string(it.name) + " pointer " + std::to_string(reinterpret_cast<uintptr_t>(it.p)) +
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

std::string capability_name(int cap) { return "sm_" + std::to_string(cap); }

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

int64_t bias_splits(int64_t M, int64_t N, int sms) {
  if (M <= 0) return 0;
  const int64_t col_blocks = std::max<int64_t>(1, (N + kBiasThreads - 1) / kBiasThreads);
  int64_t splits = std::max<int64_t>(1, (4 * static_cast<int64_t>(std::max(sms, 1))) / col_blocks);
  splits = std::min(splits, std::max<int64_t>(1, M / kBiasMinRows));
  return std::min<int64_t>(splits, 65535);  // gridDim.y limit
}

namespace {
size_t up256(size_t v) { return (v + 255) & ~static_cast<size_t>(255); }
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
    w.splits = bias_splits(a.M, a.N, sms);
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
