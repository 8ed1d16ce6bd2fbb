// CUDA core: dW = beta*dW + X^T.dY with one cuBLASLt matmul (fp32 compute,
// C in fp32 for master gradients or in the input dtype; fp64 inputs: fp64
// compute and C, as Paddle's MPTypeTrait<double>), and db = beta*db + sum_m dY
// with a deterministic two-pass column reduction.  No Paddle here.  Arguments
// were validated by pmg::check_args (wgrad_core.h) in the binding.
//
// Row-major dW[K, N] is column-major dW^T[N, K] = dY^T[N, M] . X[M, K], so in
// cuBLAS terms: m = N, n = K, k = M; A = dY stored col-major N x M (ld N, op N);
// B = X stored col-major K x M (ld K, op T); C = D = dW, col-major N x K (ld N).
//
// Per device we cache one cuBLASLt handle and the SM count; per (device,
// stream) a 32 MiB workspace (a workspace shared by two streams would race);
// per problem signature the heuristic's algorithm.  Every CUDA/cuBLAS status is
// checked and returned as a message naming the call.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "wgrad_cuda.h"

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

constexpr size_t kWorkspaceBytes = 32u << 20;
constexpr int kBiasThreads = 256;   // columns per bias block (coalesced row reads)
constexpr int64_t kBiasMinRows = 64;  // rows per partial sum, at least

struct Workspace {
  void* ptr = nullptr;
  size_t bytes = 0;
};

struct AlgoKey {
  int64_t m, n, k;
  int in_t, c_t;
  bool beta_zero;
  bool operator<(const AlgoKey& o) const {
    return std::tie(m, n, k, in_t, c_t, beta_zero) <
           std::tie(o.m, o.n, o.k, o.in_t, o.c_t, o.beta_zero);
  }
};

std::mutex g_mu;
std::map<int, cublasLtHandle_t> g_handles;
std::map<int, int> g_sms;
std::map<std::pair<int, void*>, Workspace> g_workspaces;
std::map<std::pair<int, AlgoKey>, cublasLtMatmulAlgo_t> g_algos;

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    case DType::kF64: return CUDA_R_64F;
  }
  return CUDA_R_32F;
}

size_t elem_bytes(DType t) { return t == DType::kF32 ? 4 : (t == DType::kF64 ? 8 : 2); }

std::string get_resources(int device, void* stream, cublasLtHandle_t* handle, Workspace* ws,
                          int* sms) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto h = g_handles.find(device);
  if (h == g_handles.end()) {
    cublasLtHandle_t created;
    PMG_CUBLAS(cublasLtCreate(&created));
    h = g_handles.emplace(device, created).first;
    int count = 0;
    PMG_CUDA(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    g_sms[device] = count;
  }
  *handle = h->second;
  *sms = g_sms[device];
  auto key = std::make_pair(device, stream);
  auto w = g_workspaces.find(key);
  if (w == g_workspaces.end()) {
    Workspace fresh;
    PMG_CUDA(cudaMalloc(&fresh.ptr, kWorkspaceBytes));
    fresh.bytes = kWorkspaceBytes;
    w = g_workspaces.emplace(key, fresh).first;
  }
  *ws = w->second;
  return "";
}

// RAII for the cuBLASLt descriptors of one call.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

std::string gemm(const WgradArgs& p, cudaStream_t stream, int device) {
  const int64_t m = p.N, n = p.K, k = p.M;
  if (k == 0) {  // no tokens: dW = beta * dW
    if (p.dw_beta == 0.f) PMG_CUDA(cudaMemsetAsync(p.dw, 0, m * n * elem_bytes(p.dw_dtype), stream));
    return "";
  }
  cublasLtHandle_t handle;
  Workspace ws;
  int sms = 0;
  PMG_TRY(get_resources(device, stream, &handle, &ws, &sms));

  Descs d;
  const cudaDataType_t in_t = cuda_type(p.in_dtype), c_t = cuda_type(p.dw_dtype);
  const bool f64 = p.in_dtype == DType::kF64;
  PMG_CUBLAS(cublasLtMatmulDescCreate(&d.op, f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F,
                                      f64 ? CUDA_R_64F : CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_T;
  PMG_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  PMG_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  PMG_CUBLAS(cublasLtMatrixLayoutCreate(&d.a, in_t, m, k, m));  // dY^T: N x M, ld N
  PMG_CUBLAS(cublasLtMatrixLayoutCreate(&d.b, in_t, n, k, n));  // X^T:  K x M, ld K
  PMG_CUBLAS(cublasLtMatrixLayoutCreate(&d.c, c_t, m, n, m));   // dW^T: N x K, ld N

  const AlgoKey key{m, n, k, static_cast<int>(p.in_dtype), static_cast<int>(p.dw_dtype),
                    p.dw_beta == 0.f};
  cublasLtMatmulAlgo_t algo;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_algos.find({device, key});
    if (it != g_algos.end()) {
      algo = it->second;
      cached = true;
    }
  }
  if (!cached) {
    PMG_CUBLAS(cublasLtMatmulPreferenceCreate(&d.pref));
    size_t bytes = ws.bytes;
    PMG_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof(bytes)));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    PMG_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.c, d.c, d.pref, 1,
                                              &result, &found));
    if (found == 0)
      return "cuBLASLt found no algorithm for dW[" + std::to_string(n) + ", " +
             std::to_string(m) + "] += X^T.dY over " + std::to_string(k) + " rows (" +
             dtype_name(p.in_dtype) + " -> " + dtype_name(p.dw_dtype) + ")";
    algo = result.algo;
    std::lock_guard<std::mutex> lock(g_mu);
    g_algos[{device, key}] = algo;
  }
  const float alpha = 1.f, beta = p.dw_beta;
  const double alpha64 = 1.0, beta64 = p.dw_beta;  // the scale type is fp64 for fp64 compute
  PMG_CUBLAS(cublasLtMatmul(handle, d.op, f64 ? static_cast<const void*>(&alpha64) : &alpha, p.dy,
                            d.a, p.x, d.b, f64 ? static_cast<const void*>(&beta64) : &beta, p.dw,
                            d.c, p.dw, d.c, &algo, ws.ptr, ws.bytes, stream));
  return "";
}

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

// Accumulation type of the bias sums: fp32, or fp64 for fp64 inputs.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

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

std::string bias(const WgradArgs& p, cudaStream_t stream, int device) {
  cublasLtHandle_t handle;
  Workspace ws;
  int sms = 0;
  PMG_TRY(get_resources(device, stream, &handle, &ws, &sms));
  const int64_t N = p.N, M = p.M;
  const int64_t col_blocks = (N + kBiasThreads - 1) / kBiasThreads;
  // Enough slices to fill the GPU ~4x, each at least kBiasMinRows rows, and the
  // partial sums must fit the workspace (reused after the GEMM: same stream).
  int64_t splits = std::max<int64_t>(1, (4 * static_cast<int64_t>(sms)) / std::max<int64_t>(1, col_blocks));
  splits = std::min(splits, std::max<int64_t>(1, M / kBiasMinRows));
  const bool f64 = p.in_dtype == DType::kF64;
  const int64_t acc_bytes = f64 ? 8 : 4;
  splits = std::min<int64_t>(splits, static_cast<int64_t>(ws.bytes / (acc_bytes * std::max<int64_t>(1, N))));
  splits = std::min<int64_t>(splits, 65535);
  if (M == 0) splits = 0;
  if (splits == 0 && M > 0) return "bias gradient: N = " + std::to_string(N) + " too large for the workspace";
  float* partial = static_cast<float*>(ws.ptr);
  double* partial64 = static_cast<double*>(ws.ptr);
  if (splits > 0) {
    const int64_t rows_per = (M + splits - 1) / splits;
    dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(splits));
    switch (p.in_dtype) {
      case DType::kF32:
        bias_partial<float, float><<<grid, kBiasThreads, 0, stream>>>(static_cast<const float*>(p.dy), M, N,
                                                               rows_per, partial);
        break;
      case DType::kBF16:
        bias_partial<__nv_bfloat16, float><<<grid, kBiasThreads, 0, stream>>>(
            static_cast<const __nv_bfloat16*>(p.dy), M, N, rows_per, partial);
        break;
      case DType::kF16:
        bias_partial<__half, float><<<grid, kBiasThreads, 0, stream>>>(static_cast<const __half*>(p.dy), M, N,
                                                                rows_per, partial);
        break;
      case DType::kF64:
        bias_partial<double, double><<<grid, kBiasThreads, 0, stream>>>(
            static_cast<const double*>(p.dy), M, N, rows_per, partial64);
        break;
    }
    PMG_CUDA(cudaGetLastError());
  }
  if (f64)
    bias_finish<double><<<static_cast<unsigned>(col_blocks), kBiasThreads, 0, stream>>>(
        partial64, splits, N, p.db, static_cast<int>(p.db_dtype), p.db_beta);
  else
    bias_finish<float><<<static_cast<unsigned>(col_blocks), kBiasThreads, 0, stream>>>(
        partial, splits, N, p.db, static_cast<int>(p.db_dtype), p.db_beta);
  PMG_CUDA(cudaGetLastError());
  return "";
}

struct DeviceGuard {
  int prev = -1;
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

std::string wgrad_cuda(const WgradArgs& a, void* stream_ptr, int device) {
  DeviceGuard guard;
  PMG_TRY(guard.enter(device));
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (a.dw != nullptr && a.K > 0 && a.N > 0) PMG_TRY(gemm(a, stream, device));
  if (a.db != nullptr && a.N > 0) PMG_TRY(bias(a, stream, device));
  return "";
}

}  // namespace pmg
