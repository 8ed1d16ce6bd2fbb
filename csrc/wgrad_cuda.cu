// CUDA core: dW = beta*dW + X^T.dY with one cuBLASLt matmul (fp32 compute,
// C in fp32 for master gradients or in the input dtype; fp64 inputs: fp64
// compute and C, as Paddle's MPTypeTrait<double>), and db = beta*db + sum_m dY
// either folded into that matmul (cuBLASLt's BGRADA epilogue writes the fp32
// bias gradient into scratch; one small kernel adds it to db) or by our
// deterministic two-pass column reduction.  No Paddle here.  Arguments were
// validated by pmg::check_args (wgrad_core.h) in the binding; the decisions
// (alignment, bias path, workspace layout, kernel images) are in wgrad_gpu_plan.h.
//
// Row-major dW[K, N] is column-major dW^T[N, K] = dY^T[N, M] . X[M, K], so in
// cuBLAS terms: m = N, n = K, k = M; A = dY stored col-major N x M (ld N, op N);
// B = X stored col-major K x M (ld K, op T); C = D = dW, col-major N x K (ld N).
// The bias gradient has N elements = the rows of D, reduced over the GEMM's k (M):
// that is CUBLASLT_EPILOGUE_BGRADA ("bias size corresponds to the number of rows of the
// matrix D"), the same choice as Paddle's own fused_gemm_epilogue backward for an
// untransposed weight.  (BGRADB would reduce B = X: the wrong operand here.)
//
// Order of one call: every check first -- device, element alignment, algorithm (with the
// real pointers' alignments), kernel images for this GPU, scratch memory -- then the
// launches: bias partial sums (scratch only), the GEMM (writes dW, and the epilogue's
// scratch), then the one launch that writes db.  An error before the launches leaves dW and
// db untouched; the only write-then-fail window left is that last launch, whose image was
// checked and whose error message says dW was updated.
//
// Cached per device: the cuBLASLt handle, SM count, capability, memory-pool support and
// the kernel-image checks (so that nothing but launches, cublasLtMatmul and stream-ordered
// allocation happens inside a CUDA-graph capture once a shape has run).  Cached per
// problem: the heuristic's algorithm, keyed on the shapes, dtypes, beta, epilogue and the
// four pointer alignments.  No memory is cached: scratch comes from the caller per call.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "wgrad_cuda.h"

#define PMG_STR2(x) #x
#define PMG_STR(x) PMG_STR2(x)

namespace pmg {
namespace {

#define PMG_CUDA(expr)                                                                     \
  do {                                                                                     \
    cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess)                                                                 \
      return std::string(#expr) + " failed: " + cudaGetErrorString(e_) + " (" + __FILE__ + \
             ":" + std::to_string(__LINE__) + ")";                                         \
  } while (0)

#define PMG_CUBLAS(expr)                                                                     \
  do {                                                                                       \
    cublasStatus_t s_ = (expr);                                                              \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                         \
      return std::string(#expr) + " failed: " + cublasLtGetStatusString(s_) + " (" +         \
             __FILE__ + ":" + std::to_string(__LINE__) + ")";                                \
  } while (0)

#define PMG_TRY(expr)                   \
  do {                                  \
    std::string m_ = (expr);            \
    if (!m_.empty()) return m_;         \
  } while (0)

#ifdef PMG_CUDA_TARGETS
const char* const kTargets = PMG_STR(PMG_CUDA_TARGETS);
#else
const char* const kTargets = "";  // not recorded: only the driver's image check applies
#endif

// cuBLASLt may use up to this much scratch (H100-class GEMMs want up to 32 MiB); we ask the
// caller for what the chosen algorithm actually needs (its workspaceSize), usually less.
constexpr uint64_t kMaxGemmWorkspace = 32ull << 20;
constexpr int kHeuristicResults = 8;
// The epilogue's bias pointer while asking the heuristic: only its alignment matters there
// ("routines that don't dereference this pointer ... depend on its value to determine
// expected pointer alignment"); the real one is 256-byte aligned in our scratch.
void* const kAligned256 = reinterpret_cast<void*>(uintptr_t{256});

struct DeviceInfo {
  cublasLtHandle_t handle = nullptr;
  int sms = 0;
  int cap = 0;
  bool pools = false;  // cudaMallocAsync usable
};

struct AlgoKey {
  int device;
  int64_t m, n, k;
  int in_t, c_t;
  bool beta_zero, epilogue;
  uint32_t a0, a1, a2, a3;
  bool operator<(const AlgoKey& o) const {
    return std::tie(device, m, n, k, in_t, c_t, beta_zero, epilogue, a0, a1, a2, a3) <
           std::tie(o.device, o.m, o.n, o.k, o.in_t, o.c_t, o.beta_zero, o.epilogue, o.a0, o.a1,
                    o.a2, o.a3);
  }
};

struct AlgoEntry {
  bool found = false;
  cublasLtMatmulAlgo_t algo;
  size_t workspace = 0;
  std::string why;  // when not found
};

std::mutex g_mu;
std::map<int, DeviceInfo> g_devices;
std::map<std::pair<int, int>, std::string> g_images;  // (device, kernel set) -> "" or error
std::map<AlgoKey, AlgoEntry> g_algos;
std::atomic<long long> g_bias_epilogue{0}, g_bias_kernel{0}, g_calls{0};
std::string g_last;  // guarded by g_mu

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    case DType::kF64: return CUDA_R_64F;
  }
  return CUDA_R_32F;
}

std::string get_device(int device, DeviceInfo* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_devices.find(device);
  if (it == g_devices.end()) {
    DeviceInfo d;
    int major = 0, minor = 0, pools = 0;
    PMG_CUDA(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device));
    PMG_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    PMG_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    PMG_CUDA(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
    d.cap = major * 10 + minor;
    d.pools = pools != 0;
    PMG_CUBLAS(cublasLtCreate(&d.handle));  // the device is current (DeviceGuard)
    it = g_devices.emplace(device, d).first;
  }
  *out = it->second;
  return "";
}

// ------------------------------------------------------------------ bias kernels
template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

__device__ __forceinline__ double load_any(const void* p, int t, int64_t i) {
  if (t == 0) return static_cast<const float*>(p)[i];
  if (t == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (t == 3) return static_cast<const double*>(p)[i];
  return __half2float(static_cast<const __half*>(p)[i]);
}

template <typename A>
__device__ __forceinline__ void store_any(void* p, int t, int64_t i, A v) {
  if (t == 0) static_cast<float*>(p)[i] = static_cast<float>(v);
  else if (t == 1) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(static_cast<float>(v));
  else if (t == 3) static_cast<double*>(p)[i] = static_cast<double>(v);
  else static_cast<__half*>(p)[i] = __float2half(static_cast<float>(v));
}

// Pass 1: partial[s, n] = sum of dY[m, n] over the s-th slice of rows.
template <typename T, typename A>
__global__ void bias_partial(const T* __restrict__ dy, int64_t M, int64_t N, int64_t rows_per,
                             A* __restrict__ partial) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t s = blockIdx.y;
  if (n >= N) return;
  const int64_t m0 = s * rows_per, m1 = min(M, m0 + rows_per);
  A acc = 0;
  for (int64_t m = m0; m < m1; ++m) {
    if constexpr (sizeof(T) == 8) acc += dy[m * N + n];
    else acc += to_f32<T>(dy[m * N + n]);
  }
  partial[s * N + n] = acc;
}

// Pass 2: db[n] = beta * db[n] + sum_s partial[s, n], in a fixed order (deterministic).
// With splits = 1 this is the epilogue's add: db[n] = beta * db[n] + grad[n].
template <typename A>
__global__ void bias_finish(const A* __restrict__ partial, int64_t splits, int64_t N, void* db,
                            int db_t, float beta) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  A acc = 0;
  for (int64_t s = 0; s < splits; ++s) acc += partial[s * N + n];
  const A old = beta == 0.f ? A(0) : static_cast<A>(beta * load_any(db, db_t, n));
  store_any<A>(db, db_t, n, old + acc);
}

// The kernels a call will launch, as one cache key: 0 none; 1 fp32 finish (epilogue);
// 2..5 partial<dtype> + finish (kernel path, by input dtype code).
int kernel_set(BiasPath path, DType in) {
  if (path == BiasPath::kEpilogue) return 1;
  if (path == BiasPath::kKernel) return 2 + static_cast<int>(in);
  return 0;
}

template <typename K>
std::string driver_image(K kernel, const char* name) {
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, kernel);
  if (e == cudaSuccess) return "";
  cudaGetLastError();  // not sticky; clear it
  return std::string(name) + ": " + cudaGetErrorString(e);
}

std::string driver_images(int set) {
  switch (set) {
    case 1: return driver_image(bias_finish<float>, "bias_finish<float>");
    case 2 + 0: {
      PMG_TRY(driver_image(bias_partial<float, float>, "bias_partial<float>"));
      return driver_image(bias_finish<float>, "bias_finish<float>");
    }
    case 2 + 1: {
      PMG_TRY(driver_image(bias_partial<__nv_bfloat16, float>, "bias_partial<bfloat16>"));
      return driver_image(bias_finish<float>, "bias_finish<float>");
    }
    case 2 + 2: {
      PMG_TRY(driver_image(bias_partial<__half, float>, "bias_partial<float16>"));
      return driver_image(bias_finish<float>, "bias_finish<float>");
    }
    case 2 + 3: {
      PMG_TRY(driver_image(bias_partial<double, double>, "bias_partial<float64>"));
      return driver_image(bias_finish<double>, "bias_finish<double>");
    }
  }
  return "";
}

// Our kernels can run on this GPU (or on the simulated capability): before any write.
std::string check_images(int device, int cap, bool simulated, BiasPath path, DType in) {
  const int set = kernel_set(path, in);
  if (set == 0) return "";  // only cuBLASLt runs: it carries its own kernels
  const std::string fix =
      ": dweight and dbias were not touched. Rebuild the op on this machine (the build adds the "
      "running GPU's capability; delete the op cache directory), or set PADDLE_MGRAD_NO_CUDA=1 "
      "to use Paddle's own fused kernel";
  if (*kTargets && !targets_cover(kTargets, cap))
    return "this GPU is " + capability_name(cap) + (simulated ? " (simulated)" : "") +
           " but paddle_mgrad's CUDA kernels were built for " + kTargets + fix;
  if (simulated) {
    if (!*kTargets) return "cannot simulate a capability: this build did not record its targets";
    return "";
  }
  std::string err;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_images.find({device, set});
    if (it == g_images.end()) it = g_images.emplace(std::make_pair(device, set), driver_images(set)).first;
    err = it->second;
  }
  if (!err.empty())
    return "no kernel image of paddle_mgrad's bias kernels for this GPU (" + capability_name(cap) +
           ", built for " + (*kTargets ? kTargets : "unrecorded targets") + "): " + err + fix;
  return "";
}

// RAII for the cuBLASLt descriptors of one call.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  Descs() = default;
  Descs(const Descs&) = delete;
  Descs& operator=(const Descs&) = delete;
  ~Descs() { reset(); }
  void reset() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
    op = nullptr;
    a = b = c = nullptr;
    pref = nullptr;
  }
};

// Descriptors for dW (+ the BGRADA epilogue), and the algorithm for the real pointers'
// alignments: from the cache or the heuristic.  `entry->found` false with `why` when
// cuBLASLt has none (a caller asking for the epilogue then falls back to the kernel).
std::string plan_gemm(const WgradArgs& p, int device, const DeviceInfo& dev, bool epilogue,
                      Descs* d, AlgoEntry* entry, CudaReport* rep) {
  const int64_t m = p.N, n = p.K, k = p.M;
  const cudaDataType_t in_t = cuda_type(p.in_dtype), c_t = cuda_type(p.dw_dtype);
  const bool f64 = p.in_dtype == DType::kF64;
  PMG_CUBLAS(cublasLtMatmulDescCreate(&d->op, f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F,
                                      f64 ? CUDA_R_64F : CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_T;
  PMG_CUBLAS(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  PMG_CUBLAS(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (epilogue) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BGRADA;
    PMG_CUBLAS(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    PMG_CUBLAS(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &kAligned256,
                                              sizeof(kAligned256)));
  }
  PMG_CUBLAS(cublasLtMatrixLayoutCreate(&d->a, in_t, m, k, m));  // dY^T: N x M, ld N
  PMG_CUBLAS(cublasLtMatrixLayoutCreate(&d->b, in_t, n, k, n));  // X^T:  K x M, ld K
  PMG_CUBLAS(cublasLtMatrixLayoutCreate(&d->c, c_t, m, n, m));   // dW^T: N x K, ld N

  // The heuristic assumes 256-byte aligned buffers unless told otherwise; a view that starts
  // inside an allocation (a slice along dim 0) may be aligned to 2 bytes only.  Tell it the
  // truth, and key the cached algorithm on it.
  const uint32_t al[4] = {pointer_alignment(p.dy), pointer_alignment(p.x), pointer_alignment(p.dw),
                          pointer_alignment(p.dw)};
  std::copy(al, al + 4, rep->align);
  const AlgoKey key{device, m, n, k, static_cast<int>(p.in_dtype), static_cast<int>(p.dw_dtype),
                    p.dw_beta == 0.f, epilogue, al[0], al[1], al[2], al[3]};
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_algos.find(key);
    if (it != g_algos.end()) {
      *entry = it->second;
      rep->algo_cached = true;
      return "";
    }
  }
  PMG_CUBLAS(cublasLtMatmulPreferenceCreate(&d->pref));
  const uint64_t max_ws = kMaxGemmWorkspace;
  PMG_CUBLAS(cublasLtMatmulPreferenceSetAttribute(d->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &max_ws, sizeof(max_ws)));
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    PMG_CUBLAS(cublasLtMatmulPreferenceSetAttribute(d->pref, align_attr[i], &al[i], sizeof(al[i])));
  cublasLtMatmulHeuristicResult_t results[kHeuristicResults];
  int count = 0;
  const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(dev.handle, d->op, d->a, d->b, d->c, d->c,
                                                          d->pref, kHeuristicResults, results, &count);
  AlgoEntry e;
  if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED)
    return std::string("cublasLtMatmulAlgoGetHeuristic failed: ") + cublasLtGetStatusString(s);
  for (int i = 0; s == CUBLAS_STATUS_SUCCESS && i < count && !e.found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    if (epilogue) {
      // Split-K: the GEMM's partial products are reduced in a documented, sequential order;
      // how the bias gradient's partial sums are combined is not documented -- keep the
      // epilogue only where there is nothing to combine.
      int32_t splitk = 1;
      size_t written = 0;
      if (cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                               &splitk, sizeof(splitk), &written) !=
              CUBLAS_STATUS_SUCCESS ||
          splitk > 1)
        continue;
    }
    e.found = true;
    e.algo = results[i].algo;
    e.workspace = results[i].workspaceSize;
  }
  if (!e.found)
    e.why = std::string("cuBLASLt offers no ") + (epilogue ? "split-K-free BGRADA-epilogue " : "") +
            "algorithm for dW[" + std::to_string(n) + ", " + std::to_string(m) +
            "] += X^T.dY over " + std::to_string(k) + " rows (" + dtype_name(p.in_dtype) + " -> " +
            dtype_name(p.dw_dtype) + ", alignments " + std::to_string(al[0]) + "/" +
            std::to_string(al[1]) + "/" + std::to_string(al[2]) + " bytes" +
            (s == CUBLAS_STATUS_NOT_SUPPORTED ? ", not supported" : "") + ")";
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_algos[key] = e;
  }
  *entry = e;
  return "";
}

struct DeviceGuard {
  int prev = -1;
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  std::string enter(int device) {
    PMG_CUDA(cudaGetDevice(&prev));
    if (prev != device) PMG_CUDA(cudaSetDevice(device));
    return "";
  }
  ~DeviceGuard() {
    int cur = -1;
    if (prev >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
};

// Stream-ordered scratch, released on every exit path (after the launches that use it).
struct AsyncScratch {
  void* ptr = nullptr;
  cudaStream_t stream = nullptr;
  AsyncScratch() = default;
  AsyncScratch(const AsyncScratch&) = delete;
  AsyncScratch& operator=(const AsyncScratch&) = delete;
  ~AsyncScratch() {
    if (ptr) cudaFreeAsync(ptr, stream);
  }
};

char* align256(void* p) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 255) & ~uintptr_t{255});
}

std::string run(const WgradArgs& a, const CudaExec& exec, CudaReport* rep, AsyncScratch* scratch) {
  if (exec.device < 0) return "no CUDA device given (CudaExec.device)";
  PMG_TRY(check_element_alignment(a));
  DeviceInfo dev;
  PMG_TRY(get_device(exec.device, &dev));
  const bool simulated = exec.sim_capability > 0;
  const int cap = simulated ? exec.sim_capability : dev.cap;
  rep->capability = cap;
  cudaStream_t stream = static_cast<cudaStream_t>(exec.stream);

  const bool gemm = a.dw != nullptr && a.K > 0 && a.N > 0;
  const bool matmul = gemm && a.M > 0;
  BiasChoice bias = choose_bias(a, exec.bias_mode);
  if (bias.refused) return "PADDLE_MGRAD_CUDA_BIAS=epilogue, but it cannot apply: " + bias.why;

  Descs d;
  AlgoEntry entry;
  if (matmul && bias.path == BiasPath::kEpilogue) {
    PMG_TRY(plan_gemm(a, exec.device, dev, true, &d, &entry, rep));
    if (!entry.found) {
      if (exec.bias_mode == BiasMode::kEpilogue)
        return "PADDLE_MGRAD_CUDA_BIAS=epilogue, but it cannot apply: " + entry.why;
      bias.path = BiasPath::kKernel;
      bias.why = entry.why;
    }
  }
  if (matmul && bias.path != BiasPath::kEpilogue) {
    d.reset();  // drop the epilogue's descriptors, if any
    rep->algo_cached = false;
    PMG_TRY(plan_gemm(a, exec.device, dev, false, &d, &entry, rep));
    if (!entry.found) return entry.why;
  }
  rep->bias = bias.path;
  rep->bias_why = bias.why;
  PMG_TRY(check_images(exec.device, cap, simulated, bias.path, a.in_dtype));

  const WorkspacePlan wp = plan_workspace(a, bias.path, matmul ? entry.workspace : 0, dev.sms);
  char* base = nullptr;
  if (wp.request > 0) {
    char* given = static_cast<char*>(exec.workspace);
    if (given && align256(given) + wp.total <= given + exec.workspace_bytes) {
      base = align256(given);
      rep->workspace_from = "caller";
    } else if (exec.alloc) {
      void* p = exec.alloc(wp.request, exec.alloc_user);
      if (p == nullptr)
        return "could not allocate " + std::to_string(wp.request) +
               " bytes of scratch (the allocator returned null); dweight and dbias were not touched";
      base = align256(p);
      rep->workspace_from = "allocator";
    } else if (given) {
      return "the workspace given has " + std::to_string(exec.workspace_bytes) + " bytes; " +
             std::to_string(wp.request) + " are needed (and no allocator was given)";
    } else {
      if (!dev.pools)
        return "this GPU has no stream-ordered allocator (cudaMallocAsync): pass a workspace or an "
               "allocator";
      scratch->stream = stream;
      PMG_CUDA(cudaMallocAsync(&scratch->ptr, wp.request, stream));
      base = align256(scratch->ptr);
      rep->workspace_from = "stream-ordered";
    }
    rep->workspace_bytes = wp.request;
  }

  // ---- launches (every check passed)
  const int64_t col_blocks = (a.N + kBiasThreads - 1) / kBiasThreads;
  if (bias.path == BiasPath::kKernel && wp.splits > 0) {
    const int64_t rows_per = (a.M + wp.splits - 1) / wp.splits;
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(wp.splits));
    void* part = base + wp.partial_offset;
    switch (a.in_dtype) {
      case DType::kF32:
        bias_partial<float, float><<<grid, kBiasThreads, 0, stream>>>(
            static_cast<const float*>(a.dy), a.M, a.N, rows_per, static_cast<float*>(part));
        break;
      case DType::kBF16:
        bias_partial<__nv_bfloat16, float><<<grid, kBiasThreads, 0, stream>>>(
            static_cast<const __nv_bfloat16*>(a.dy), a.M, a.N, rows_per, static_cast<float*>(part));
        break;
      case DType::kF16:
        bias_partial<__half, float><<<grid, kBiasThreads, 0, stream>>>(
            static_cast<const __half*>(a.dy), a.M, a.N, rows_per, static_cast<float*>(part));
        break;
      case DType::kF64:
        bias_partial<double, double><<<grid, kBiasThreads, 0, stream>>>(
            static_cast<const double*>(a.dy), a.M, a.N, rows_per, static_cast<double*>(part));
        break;
    }
    PMG_CUDA(cudaGetLastError());  // scratch only so far: dW and db untouched
  }
  if (matmul) {
    if (bias.path == BiasPath::kEpilogue) {
      void* grad = base + wp.bias_tmp_offset;  // 256-byte aligned, as told to the heuristic
      PMG_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &grad,
                                                sizeof(grad)));
    }
    const float alpha = 1.f, beta = a.dw_beta;
    const double alpha64 = 1.0, beta64 = a.dw_beta;  // the scale type is fp64 for fp64 compute
    const bool f64 = a.in_dtype == DType::kF64;
    PMG_CUBLAS(cublasLtMatmul(dev.handle, d.op, f64 ? static_cast<const void*>(&alpha64) : &alpha,
                              a.dy, d.a, a.x, d.b, f64 ? static_cast<const void*>(&beta64) : &beta,
                              a.dw, d.c, a.dw, d.c, &entry.algo,
                              entry.workspace ? base + wp.gemm_offset : nullptr, entry.workspace,
                              stream));
  } else if (gemm && a.dw_beta == 0.f) {  // no rows: dW = 0 * dW
    PMG_CUDA(cudaMemsetAsync(a.dw, 0, static_cast<size_t>(a.K) * a.N * dtype_bytes(a.dw_dtype), stream));
  }
  if (bias.path != BiasPath::kNone) {
    const std::string after = gemm ? " (dweight was updated, dbias was not)" : "";
    const unsigned blocks = static_cast<unsigned>(col_blocks);
    if (bias.path == BiasPath::kEpilogue) {
      bias_finish<float><<<blocks, kBiasThreads, 0, stream>>>(
          reinterpret_cast<const float*>(base + wp.bias_tmp_offset), 1, a.N, a.db,
          static_cast<int>(a.db_dtype), a.db_beta);
    } else if (a.in_dtype == DType::kF64) {
      bias_finish<double><<<blocks, kBiasThreads, 0, stream>>>(
          reinterpret_cast<const double*>(base + wp.partial_offset), wp.splits, a.N, a.db,
          static_cast<int>(a.db_dtype), a.db_beta);
    } else {
      bias_finish<float><<<blocks, kBiasThreads, 0, stream>>>(
          reinterpret_cast<const float*>(base + wp.partial_offset), wp.splits, a.N, a.db,
          static_cast<int>(a.db_dtype), a.db_beta);
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
      return std::string("bias gradient launch failed: ") + cudaGetErrorString(e) + after;
  }
  return "";
}

}  // namespace

std::string wgrad_cuda(const WgradArgs& a, const CudaExec& exec, CudaReport* report) {
  CudaReport local;
  CudaReport* rep = report ? report : &local;
  *rep = CudaReport();
  DeviceGuard guard;
  if (exec.device >= 0) PMG_TRY(guard.enter(exec.device));
  AsyncScratch scratch;  // destroyed (freed in stream order) after run()'s launches
  std::string err = run(a, exec, rep, &scratch);
  g_calls++;
  if (err.empty()) {
    if (rep->bias == BiasPath::kEpilogue) g_bias_epilogue++;
    if (rep->bias == BiasPath::kKernel) g_bias_kernel++;
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_last = rep->text() + (err.empty() ? "" : " error");
  }
  return err;
}

const char* cuda_targets() { return kTargets; }

std::string cuda_stats() {
  std::lock_guard<std::mutex> lock(g_mu);
  return "calls=" + std::to_string(g_calls.load()) + " bias_epilogue=" +
         std::to_string(g_bias_epilogue.load()) + " bias_kernel=" +
         std::to_string(g_bias_kernel.load()) + " last: " + g_last;
}

}  // namespace pmg
