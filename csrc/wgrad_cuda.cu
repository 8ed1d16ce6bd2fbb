// CUDA core: dW = beta*dW + X^T.dY with one cuBLASLt matmul (fp32 compute,
// C in fp32 for master gradients or in the input dtype; fp64 inputs: fp64
// compute and C, as Paddle's MPTypeTrait<double>), and db = beta*db + sum_m dY
// either folded into that matmul (cuBLASLt's BGRADA epilogue writes the fp32
// bias gradient into scratch; one small kernel adds it to db) or by our
// deterministic two-pass column reduction.  No Paddle here.  Arguments were
// validated by pmg::check_args (wgrad_core.h) in the binding; the decisions
// (alignment, bias path, workspace layout, kernel images, the epilogue against the
// plain GEMM, the bias kernel's grid and order) are in wgrad_gpu_plan.h, and the
// order of the steps is pmg::cuda_core_flow (wgrad_cuda_flow.h), which the CPU
// tests run on a fake GPU.  This file is the real GPU of that flow.
//
// Row-major dW[K, N] is column-major dW^T[N, K] = dY^T[N, M] . X[M, K], so in
// cuBLAS terms: m = N, n = K, k = M; A = dY stored col-major N x M (ld N, op N);
// B = X stored col-major K x M (ld K, op T); C = D = dW, col-major N x K (ld N).
// The bias gradient has N elements = the rows of D, reduced over the GEMM's k (M):
// that is CUBLASLT_EPILOGUE_BGRADA ("bias size corresponds to the number of rows of the
// matrix D"), the same choice as Paddle's own fused_gemm_epilogue backward for an
// untransposed weight.  (BGRADB would reduce B = X: the wrong operand here.)
//
// Order of the launches (every check passed first): bias partial sums (scratch only), the
// GEMM (writes dW, and the epilogue's scratch), then the one launch that writes db.  The only
// write-then-fail window is that last launch, whose image was checked and whose error message
// says dW was updated.  An error someone else left pending is read before anything and
// reported as theirs.
//
// Per (thread, device), never locked after the first call: the cuBLASLt handle (PyTorch and
// TransformerEngine keep one per thread and device, as the cuBLAS guide advises), the SM
// count, capability and memory-pool support, the kernel-image checks, and the matmul
// descriptors and layouts (re-set per call, not created and destroyed).  Process-wide, under
// one lock: the algorithm cache (least recently used, kAlgoCacheCapacity entries), keyed on the
// shapes -- M rounded to a bucket for the heuristic query only -- dtypes, beta, epilogue, the
// workspace limit and the four pointer alignments.  No memory is cached: scratch comes from the
// caller per call.
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
#include "wgrad_cuda_flow.h"

#define PMG_STR2(x) #x
#define PMG_STR(x) PMG_STR2(x)

namespace pmg {
namespace {

#define PMG_CUDA(expr)                                                                           \
  do {                                                                                           \
    cudaError_t e_ = (expr);                                                                     \
    if (e_ != cudaSuccess)                                                                       \
      return std::string(#expr) + " failed: " + cudaGetErrorString(e_) + " (" + __FILE__ + ":" + \
             std::to_string(__LINE__) + ")";                                                     \
  } while (0)

#define PMG_CUBLAS(expr)                                                                        \
  do {                                                                                          \
    cublasStatus_t s_ = (expr);                                                                 \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                            \
      return std::string(#expr) + " failed: " + cublasLtGetStatusString(s_) + " (" + __FILE__ + \
             ":" + std::to_string(__LINE__) + ")";                                              \
  } while (0)

#define PMG_TRY(expr)           \
  do {                          \
    std::string m_ = (expr);    \
    if (!m_.empty()) return m_; \
  } while (0)

#ifdef PMG_CUDA_TARGETS
const char* const kTargets = PMG_STR(PMG_CUDA_TARGETS);
#else
const char* const kTargets = "";  // not recorded: only the driver's image check applies
#endif

constexpr int kHeuristicResults = 8;
// The epilogue's bias pointer while asking the heuristic: only its alignment matters there
// ("routines that don't dereference this pointer ... depend on its value to determine
// expected pointer alignment"); the real one is 256-byte aligned in our scratch.
void* const kAligned256 = reinterpret_cast<void*>(uintptr_t{256});

struct AlgoKey {
  int device;
  int64_t m, n, k;  // k: the heuristic's rows (heuristic_rows(M)), or the exact M when `exact`
  int in_t, c_t;
  bool beta_zero, epilogue, exact;
  uint64_t max_ws;
  uint32_t a0, a1, a2, a3;
  bool operator<(const AlgoKey& o) const {
    return std::tie(device, m, n, k, in_t, c_t, beta_zero, epilogue, exact, max_ws, a0, a1, a2,
                    a3) < std::tie(o.device, o.m, o.n, o.k, o.in_t, o.c_t, o.beta_zero, o.epilogue,
                                   o.exact, o.max_ws, o.a0, o.a1, o.a2, o.a3);
  }
};

struct AlgoEntry {
  GemmCandidate cand;
  cublasLtMatmulAlgo_t algo;
  std::string why;  // when not found
};

std::mutex g_mu;  // guards g_algos and g_last
LruCache<AlgoKey, AlgoEntry> g_algos(kAlgoCacheCapacity);
std::atomic<long long> g_bias_epilogue{0}, g_bias_kernel{0}, g_calls{0}, g_ws_retries{0},
    g_heuristic_queries{0};
std::string g_last;

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    case DType::kF64: return CUDA_R_64F;
  }
  return CUDA_R_32F;
}

// ------------------------------------------------------------------ bias kernels
template <typename A, typename T>
__device__ __forceinline__ A to_acc(T v);
template <>
__device__ __forceinline__ float to_acc<float, float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_acc<float, __nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_acc<float, __half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ double to_acc<double, double>(double v) {
  return v;
}

__device__ __forceinline__ double load_any(const void* p, int t, int64_t i) {
  if (t == 0) return static_cast<const float*>(p)[i];
  if (t == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (t == 3) return static_cast<const double*>(p)[i];
  return __half2float(static_cast<const __half*>(p)[i]);
}

template <typename A>
__device__ __forceinline__ void store_any(void* p, int t, int64_t i, A v) {
  if (t == 0)
    static_cast<float*>(p)[i] = static_cast<float>(v);
  else if (t == 1)
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(static_cast<float>(v));
  else if (t == 3)
    static_cast<double*>(p)[i] = static_cast<double>(v);
  else
    static_cast<__half*>(p)[i] = __float2half(static_cast<float>(v));
}

// Pass 1 (see BiasKernelPlan): partial[s, n] = sum of dY[m, n] over the s-th slice of rows.
// Block (threads_x, threads_y); thread (tx, ty) owns VEC adjacent columns, read with one
// 16-byte load per row (VEC = 16 / sizeof(T)) or one element (VEC = 1); its row lane ty sums
// rows m0 + ty, m0 + ty + threads_y, ...; the lanes are added as a binary tree in shared memory.
template <typename T, typename A, int VEC>
__global__ void bias_partial(const T* __restrict__ dy, int64_t M, int64_t N, int64_t rows_per,
                             A* __restrict__ partial) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* sm = reinterpret_cast<A*>(smem_raw);
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int nx = static_cast<int>(blockDim.x), ny = static_cast<int>(blockDim.y);
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * nx + tx) * VEC;
  const int64_t s = blockIdx.y;
  const int64_t m0 = s * rows_per, m1 = min(M, m0 + rows_per);
  A acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = A(0);
  if (n0 < N) {
#pragma unroll 4
    for (int64_t m = m0 + ty; m < m1; m += ny) {
      const T* row = dy + m * N + n0;
      if constexpr (VEC > 1) {
        static_assert(VEC * sizeof(T) == 16, "one 16-byte load per row");
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(row));
        T e[VEC];
        memcpy(e, &v, 16);
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += to_acc<A, T>(e[j]);
      } else {
        acc[0] += to_acc<A, T>(row[0]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) sm[(ty * nx + tx) * VEC + j] = acc[j];
  __syncthreads();
  for (int stride = ny / 2; stride > 0; stride /= 2) {
    if (ty < stride) {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        sm[(ty * nx + tx) * VEC + j] =
            sm[(ty * nx + tx) * VEC + j] + sm[((ty + stride) * nx + tx) * VEC + j];
    }
    __syncthreads();
  }
  if (ty == 0 && n0 < N) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) partial[s * N + n0 + j] = sm[tx * VEC + j];
  }
}

// Pass 2: db[n] = beta * db[n] + cascade_sum(partial[0..splits-1, n]) (a fixed pairwise tree:
// deterministic).  With splits = 1 this is the epilogue's add: db[n] = beta * db[n] + grad[n].
template <typename A>
__global__ void bias_finish(const A* __restrict__ partial, int64_t splits, int64_t N, void* db,
                            int db_t, float beta) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const A acc = cascade_sum<A>(partial + n, splits, N);
  const A old = beta == 0.f ? A(0) : static_cast<A>(beta * load_any(db, db_t, n));
  store_any<A>(db, db_t, n, old + acc);
}

// The kernels a call will launch, as one cache key: 0 none; 1 fp32 finish (epilogue);
// 2..5 partial<dtype> (both vector widths) + finish (kernel path, by input dtype code).
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

template <typename T, typename A>
std::string partial_images(const char* name) {
  PMG_TRY(driver_image(bias_partial<T, A, 1>, name));
  PMG_TRY(driver_image(bias_partial<T, A, static_cast<int>(16 / sizeof(T))>, name));
  return driver_image(bias_finish<A>, "bias_finish");
}

std::string driver_images(int set) {
  switch (set) {
    case 1: return driver_image(bias_finish<float>, "bias_finish<float>");
    case 2 + 0: return partial_images<float, float>("bias_partial<float>");
    case 2 + 1: return partial_images<__nv_bfloat16, float>("bias_partial<bfloat16>");
    case 2 + 2: return partial_images<__half, float>("bias_partial<float16>");
    case 2 + 3: return partial_images<double, double>("bias_partial<float64>");
  }
  return "";
}

template <typename T, typename A>
void launch_partial(const BiasKernelPlan& p, const void* dy, int64_t M, int64_t N, void* part,
                    cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.col_blocks), static_cast<unsigned>(p.splits));
  const dim3 block(static_cast<unsigned>(p.threads_x), static_cast<unsigned>(p.threads_y));
  const size_t smem = static_cast<size_t>(kBiasThreads) * static_cast<size_t>(p.vec) * sizeof(A);
  constexpr int kVec = static_cast<int>(16 / sizeof(T));
  if (p.vec == kVec)
    bias_partial<T, A, kVec><<<grid, block, smem, stream>>>(static_cast<const T*>(dy), M, N,
                                                            p.rows_per, static_cast<A*>(part));
  else
    bias_partial<T, A, 1><<<grid, block, smem, stream>>>(static_cast<const T*>(dy), M, N,
                                                         p.rows_per, static_cast<A*>(part));
}

// ------------------------------------------------------------------ per (thread, device)

struct ThreadDevice {
  bool ready = false;
  cublasLtHandle_t handle = nullptr;
  int sms = 0, cap = 0;
  bool pools = false;  // cudaMallocAsync usable
  cublasLtMatmulDesc_t ops[2][2] = {{nullptr, nullptr}, {nullptr, nullptr}};  // [f64][epilogue]
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;               // the call's layouts
  cublasLtMatrixLayout_t qa = nullptr, qb = nullptr;  // the heuristic's (rows rounded)
  cublasLtMatmulPreference_t pref = nullptr;
  std::map<int, std::string> images;  // kernel set -> "" or error
  ThreadDevice() = default;
  ThreadDevice(const ThreadDevice&) = delete;
  ThreadDevice& operator=(const ThreadDevice&) = delete;
  ~ThreadDevice() {  // host memory only (thread exit)
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    for (cublasLtMatrixLayout_t l : {a, b, c, qa, qb})
      if (l) cublasLtMatrixLayoutDestroy(l);
    for (auto& row : ops)
      for (cublasLtMatmulDesc_t d : row)
        if (d) cublasLtMatmulDescDestroy(d);
    if (handle) cublasLtDestroy(handle);
  }
};

// The calling thread's state for `device` (created on its first call there; the device is
// current: the flow runs inside the guard).
std::string thread_device(int device, ThreadDevice** out) {
  thread_local std::map<int, ThreadDevice> mine;
  ThreadDevice& d = mine[device];
  if (!d.ready) {
    int major = 0, minor = 0, pools = 0;
    PMG_CUDA(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device));
    PMG_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    PMG_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    PMG_CUDA(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
    d.cap = major * 10 + minor;
    d.pools = pools != 0;
    if (!d.handle) PMG_CUBLAS(cublasLtCreate(&d.handle));
    for (int f64 = 0; f64 < 2; ++f64)
      for (int epi = 0; epi < 2; ++epi) {
        cublasLtMatmulDesc_t& op = d.ops[f64][epi];
        if (op) continue;
        PMG_CUBLAS(cublasLtMatmulDescCreate(&op, f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F,
                                            f64 ? CUDA_R_64F : CUDA_R_32F));
        const cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_T;
        PMG_CUBLAS(
            cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
        PMG_CUBLAS(
            cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
        if (epi) {
          const cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BGRADA;
          PMG_CUBLAS(
              cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
          PMG_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                    &kAligned256, sizeof(kAligned256)));
        }
      }
    for (cublasLtMatrixLayout_t* l : {&d.a, &d.b, &d.c, &d.qa, &d.qb})
      if (!*l) PMG_CUBLAS(cublasLtMatrixLayoutCreate(l, CUDA_R_32F, 1, 1, 1));
    if (!d.pref) PMG_CUBLAS(cublasLtMatmulPreferenceCreate(&d.pref));
    d.ready = true;
  }
  *out = &d;
  return "";
}

std::string set_layout(cublasLtMatrixLayout_t l, cudaDataType_t t, int64_t rows, int64_t cols,
                       int64_t ld) {
  const uint32_t type = static_cast<uint32_t>(t);
  const uint64_t r = static_cast<uint64_t>(rows), c = static_cast<uint64_t>(cols);
  PMG_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_TYPE, &type, sizeof(type)));
  PMG_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &r, sizeof(r)));
  PMG_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_COLS, &c, sizeof(c)));
  PMG_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof(ld)));
  return "";
}

GemmCandidate describe(const cublasLtMatmulHeuristicResult_t& r) {
  GemmCandidate g;
  g.found = true;
  g.workspace = r.workspaceSize;
  g.waves = r.wavesCount;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_ID, &g.algo_id,
                                       sizeof(g.algo_id), &written);
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &g.tile,
                                       sizeof(g.tile), &written);
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &g.stages,
                                       sizeof(g.stages), &written);
  if (cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &g.splitk,
                                           sizeof(g.splitk), &written) != CUBLAS_STATUS_SUCCESS)
    g.splitk = -1;  // unknown: never taken for the epilogue
  return g;
}

char* align256(void* p) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 255) & ~uintptr_t{255});
}

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

// The real GPU of pmg::cuda_core_flow (wgrad_cuda_flow.h).
struct CudaGpu {
  const CudaExec& exec;
  AsyncScratch* scratch;
  ThreadDevice* dev = nullptr;
  cublasLtMatmulAlgo_t algo[2] = {};  // [epilogue]: the heuristic's choice for this call
  CudaGpu(const CudaExec& e, AsyncScratch* s) : exec(e), scratch(s) {}
  cudaStream_t stream() const { return static_cast<cudaStream_t>(exec.stream); }

  std::string pending_error() {
    const cudaError_t e = cudaGetLastError();  // reads and clears a non-sticky error
    if (e == cudaSuccess) return "";
    return pending_error_message(cudaGetErrorName(e), cudaGetErrorString(e));
  }

  std::string device_info(int* cap, int* sms) {
    PMG_TRY(thread_device(exec.device, &dev));
    *cap = dev->cap;
    *sms = dev->sms;
    return "";
  }

  int cuda_major() const { return CUDART_VERSION / 1000; }

  std::string pointer_place(const void* p, PointerPlace* out) {
    cudaPointerAttributes attr;
    const cudaError_t e = cudaPointerGetAttributes(&attr, p);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return std::string("cudaPointerGetAttributes(") + out->name +
             ") failed: " + cudaGetErrorString(e);
    }
    switch (attr.type) {
      case cudaMemoryTypeDevice: out->kind = 2; break;
      case cudaMemoryTypeManaged: out->kind = 3; break;
      case cudaMemoryTypeHost: out->kind = 1; break;
      default: out->kind = 0; break;
    }
    out->device = attr.device;
    return "";
  }

  std::string stream_device(void* s, int* device) {
    *device = -1;
    const uintptr_t v = reinterpret_cast<uintptr_t>(s);
    if (v == 0 || s == static_cast<void*>(cudaStreamLegacy) ||
        s == static_cast<void*>(cudaStreamPerThread))
      return "";  // the current device's own streams: the guard made it exec.device
#if CUDART_VERSION >= 12080
    int d = -1;
    const cudaError_t e = cudaStreamGetDevice(static_cast<cudaStream_t>(s), &d);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return std::string("cudaStreamGetDevice failed: ") + cudaGetErrorString(e) +
             " (is the stream valid?); dweight and dbias were not touched";
    }
    *device = d;
#endif
    return "";
  }

  std::string heuristic(const WgradArgs& p, bool epilogue, uint64_t max_ws, GemmCandidate* out,
                        std::string* why, CudaReport* rep) {
    const int64_t m = p.N, n = p.K, k = p.M, qk = heuristic_rows(p.M);
    const cudaDataType_t in_t = cuda_type(p.in_dtype), c_t = cuda_type(p.dw_dtype);
    const bool f64 = p.in_dtype == DType::kF64;
    cublasLtMatmulDesc_t op = dev->ops[f64][epilogue];
    PMG_TRY(set_layout(dev->a, in_t, m, k, m));  // dY^T: N x M, ld N
    PMG_TRY(set_layout(dev->b, in_t, n, k, n));  // X^T:  K x M, ld K
    PMG_TRY(set_layout(dev->c, c_t, m, n, m));   // dW^T: N x K, ld N
    // The heuristic assumes 256-byte aligned buffers unless told otherwise; a view that starts
    // inside an allocation (a slice along dim 0) may be aligned to 2 bytes only.  Tell it the
    // truth, and key the cached algorithm on it.
    const uint32_t al[4] = {pointer_alignment(p.dy), pointer_alignment(p.x),
                            pointer_alignment(p.dw), pointer_alignment(p.dw)};
    std::copy(al, al + 4, rep->align);
    AlgoKey key{exec.device,
                m,
                n,
                qk,
                static_cast<int>(p.in_dtype),
                static_cast<int>(p.dw_dtype),
                p.dw_beta == 0.f,
                epilogue,
                false,
                max_ws,
                al[0],
                al[1],
                al[2],
                al[3]};
    AlgoEntry e;
    bool have = false;
    for (int attempt = 0; attempt < 2; ++attempt) {  // the bucket's algorithm, else M's own
      if (attempt == 1) {
        key.k = k;
        key.exact = true;
      }
      {
        std::lock_guard<std::mutex> lock(g_mu);
        if (AlgoEntry* hit = g_algos.find(key)) {
          e = *hit;
          have = true;
        }
      }
      rep->algo_cached = have;
      if (!have) {
        PMG_TRY(query(p, op, key.k, max_ws, al, epilogue, &e));
        std::lock_guard<std::mutex> lock(g_mu);
        g_algos.put(key, e);
      }
      if (!e.cand.found || key.k == k) break;
      // The bucket's algorithm must also hold for the real M: ask cuBLASLt (host only).
      cublasLtMatmulHeuristicResult_t check;
      if (cublasLtMatmulAlgoCheck(dev->handle, op, dev->a, dev->b, dev->c, dev->c, &e.algo,
                                  &check) == CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= max_ws) {
        e.cand.workspace = std::max(e.cand.workspace, check.workspaceSize);
        break;
      }
      have = false;
    }
    *out = e.cand;
    *why = e.why;
    algo[epilogue ? 1 : 0] = e.algo;
    return "";
  }

  // One heuristic query for `rows` rows (the layouts' k), results described for the choice.
  std::string query(const WgradArgs& p, cublasLtMatmulDesc_t op, int64_t rows, uint64_t max_ws,
                    const uint32_t* al, bool epilogue, AlgoEntry* e) {
    const cudaDataType_t in_t = cuda_type(p.in_dtype);
    PMG_TRY(set_layout(dev->qa, in_t, p.N, rows, p.N));
    PMG_TRY(set_layout(dev->qb, in_t, p.K, rows, p.K));
    PMG_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
        dev->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws)));
    const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i)
      PMG_CUBLAS(
          cublasLtMatmulPreferenceSetAttribute(dev->pref, align_attr[i], &al[i], sizeof(al[i])));
    cublasLtMatmulHeuristicResult_t results[kHeuristicResults];
    int count = 0;
    g_heuristic_queries++;
    const cublasStatus_t s =
        cublasLtMatmulAlgoGetHeuristic(dev->handle, op, dev->qa, dev->qb, dev->c, dev->c, dev->pref,
                                       kHeuristicResults, results, &count);
    if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED)
      return std::string("cublasLtMatmulAlgoGetHeuristic failed: ") + cublasLtGetStatusString(s);
    for (int i = 0; s == CUBLAS_STATUS_SUCCESS && i < count; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      const GemmCandidate g = describe(results[i]);
      // The epilogue: split-K-free only (how split-K would combine the bias gradient's partial
      // sums is not documented).  The plain GEMM: the heuristic's best, split-K or not.
      if (epilogue && g.splitk != 1) continue;
      e->cand = g;
      e->algo = results[i].algo;
      break;
    }
    if (!e->cand.found)
      e->why = std::string("cuBLASLt offers no ") +
               (epilogue ? "split-K-free BGRADA-epilogue " : "") + "algorithm for dW[" +
               std::to_string(p.K) + ", " + std::to_string(p.N) + "] += X^T.dY over " +
               std::to_string(p.M) + " rows (" + dtype_name(p.in_dtype) + " -> " +
               dtype_name(p.dw_dtype) + ", alignments " + std::to_string(al[0]) + "/" +
               std::to_string(al[1]) + "/" + std::to_string(al[2]) +
               " bytes, workspace <= " + std::to_string(max_ws) +
               (s == CUBLAS_STATUS_NOT_SUPPORTED ? ", not supported" : "") + ")";
    return "";
  }

  // Our kernels can run on this GPU (or on the simulated capability): before any write.
  std::string check_images(int cap, bool simulated, BiasPath path, DType in) {
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
    auto it = dev->images.find(set);
    if (it == dev->images.end()) it = dev->images.emplace(set, driver_images(set)).first;
    if (!it->second.empty())
      return "no kernel image of paddle_mgrad's bias kernels for this GPU (" +
             capability_name(cap) + ", built for " + (*kTargets ? kTargets : "unrecorded targets") +
             "): " + it->second + fix;
    return "";
  }

  // Scratch in this order: the caller's buffer when large enough; the caller's allocator;
  // a too-small buffer without allocator is a failure; else stream-ordered cudaMallocAsync.
  void* alloc(size_t bytes, std::string* why, CudaReport* rep) {
    const size_t total = bytes - 255;  // plan_workspace: request = total + 255
    char* given = static_cast<char*>(exec.workspace);
    if (given && align256(given) + total <= given + exec.workspace_bytes) {
      rep->workspace_from = "caller";
      return align256(given);
    }
    if (exec.alloc) {
      void* p = exec.alloc(bytes, exec.alloc_user);
      if (p == nullptr) {
        *why = "the allocator returned null";
        return nullptr;
      }
      rep->workspace_from = "allocator";
      return align256(p);
    }
    if (given) {
      *why = "the workspace given has " + std::to_string(exec.workspace_bytes) + " bytes; " +
             std::to_string(bytes) + " are needed and no allocator was given";
      return nullptr;
    }
    if (!dev->pools) {
      *why =
          "this GPU has no stream-ordered allocator (cudaMallocAsync): pass a workspace or an "
          "allocator";
      return nullptr;
    }
    void* p = nullptr;
    const cudaError_t e = cudaMallocAsync(&p, bytes, stream());
    if (e != cudaSuccess || p == nullptr) {
      cudaGetLastError();  // out of memory is not sticky: clear it, the caller may retry
      *why = std::string("cudaMallocAsync: ") + cudaGetErrorString(e);
      return nullptr;
    }
    if (scratch->ptr) cudaFreeAsync(scratch->ptr, scratch->stream);
    scratch->ptr = p;
    scratch->stream = stream();
    rep->workspace_from = "stream-ordered";
    return align256(p);
  }

  std::string launch(const WgradArgs& a, const CallPlan& cp, char* base, int sms) {
    cudaStream_t st = stream();
    const bool gemm = a.dw != nullptr && a.K > 0 && a.N > 0;
    const bool matmul = gemm && a.M > 0;
    if (cp.path == BiasPath::kKernel && cp.ws.splits > 0) {
      const BiasKernelPlan bp =
          plan_bias_kernel(a.M, a.N, a.in_dtype, reinterpret_cast<uintptr_t>(a.dy), sms);
      void* part = base + cp.ws.partial_offset;
      switch (a.in_dtype) {
        case DType::kF32: launch_partial<float, float>(bp, a.dy, a.M, a.N, part, st); break;
        case DType::kBF16:
          launch_partial<__nv_bfloat16, float>(bp, a.dy, a.M, a.N, part, st);
          break;
        case DType::kF16: launch_partial<__half, float>(bp, a.dy, a.M, a.N, part, st); break;
        case DType::kF64: launch_partial<double, double>(bp, a.dy, a.M, a.N, part, st); break;
      }
      PMG_CUDA(cudaGetLastError());  // scratch only so far: dW and db untouched
    }
    if (matmul) {
      const bool epi = cp.path == BiasPath::kEpilogue;
      const bool f64 = a.in_dtype == DType::kF64;
      cublasLtMatmulDesc_t op = dev->ops[f64][epi];
      if (epi) {
        void* grad = base + cp.ws.bias_tmp_offset;  // 256-byte aligned, as told to the heuristic
        PMG_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &grad,
                                                  sizeof(grad)));
      }
      PMG_TRY(set_layout(dev->a, cuda_type(a.in_dtype), a.N, a.M, a.N));
      PMG_TRY(set_layout(dev->b, cuda_type(a.in_dtype), a.K, a.M, a.K));
      PMG_TRY(set_layout(dev->c, cuda_type(a.dw_dtype), a.N, a.K, a.N));
      const float alpha = 1.f, beta = a.dw_beta;
      const double alpha64 = 1.0, beta64 = a.dw_beta;  // the scale type is fp64 for fp64 compute
      const size_t ws = cp.gemm.workspace;
      PMG_CUBLAS(cublasLtMatmul(
          dev->handle, op, f64 ? static_cast<const void*>(&alpha64) : &alpha, a.dy, dev->a, a.x,
          dev->b, f64 ? static_cast<const void*>(&beta64) : &beta, a.dw, dev->c, a.dw, dev->c,
          &algo[epi ? 1 : 0], ws ? base + cp.ws.gemm_offset : nullptr, ws, st));
    } else if (gemm && a.dw_beta == 0.f) {  // no rows: dW = 0 * dW (beta 1: untouched)
      PMG_CUDA(
          cudaMemsetAsync(a.dw, 0, static_cast<size_t>(a.K * a.N) * dtype_bytes(a.dw_dtype), st));
    }
    if (cp.path != BiasPath::kNone) {
      const std::string after = gemm ? " (dweight was updated, dbias was not)" : "";
      const unsigned blocks = static_cast<unsigned>((a.N + kBiasThreads - 1) / kBiasThreads);
      if (cp.path == BiasPath::kEpilogue) {
        bias_finish<float><<<blocks, kBiasThreads, 0, st>>>(
            reinterpret_cast<const float*>(base + cp.ws.bias_tmp_offset), 1, a.N, a.db,
            static_cast<int>(a.db_dtype), a.db_beta);
      } else if (a.in_dtype == DType::kF64) {
        bias_finish<double><<<blocks, kBiasThreads, 0, st>>>(
            reinterpret_cast<const double*>(base + cp.ws.partial_offset), cp.ws.splits, a.N, a.db,
            static_cast<int>(a.db_dtype), a.db_beta);
      } else {
        bias_finish<float><<<blocks, kBiasThreads, 0, st>>>(
            reinterpret_cast<const float*>(base + cp.ws.partial_offset), cp.ws.splits, a.N, a.db,
            static_cast<int>(a.db_dtype), a.db_beta);
      }
      const cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess)
        return std::string("bias gradient launch failed: ") + cudaGetErrorString(e) + after;
    }
    return "";
  }
};

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

}  // namespace

std::string wgrad_cuda(const WgradArgs& a, const CudaExec& exec, CudaReport* report) {
  CudaReport local;
  CudaReport* rep = report ? report : &local;
  *rep = CudaReport();
  DeviceGuard guard;
  if (exec.device >= 0) PMG_TRY(guard.enter(exec.device));
  AsyncScratch scratch;  // destroyed (freed in stream order) after the launches
  CudaGpu gpu(exec, &scratch);
  std::string err = cuda_core_flow(gpu, a, exec, rep);
  g_calls++;
  if (rep->workspace_retry) g_ws_retries++;
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

const char* cuda_targets() {
  return kTargets;
}

std::string cuda_stats() {
  std::lock_guard<std::mutex> lock(g_mu);
  return "calls=" + std::to_string(g_calls.load()) +
         " bias_epilogue=" + std::to_string(g_bias_epilogue.load()) +
         " bias_kernel=" + std::to_string(g_bias_kernel.load()) +
         " workspace_retries=" + std::to_string(g_ws_retries.load()) +
         " heuristic_queries=" + std::to_string(g_heuristic_queries.load()) +
         " algo_cache=" + std::to_string(g_algos.size()) + " last: " + g_last;
}

}  // namespace pmg
