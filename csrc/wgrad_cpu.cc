// CPU implementation of the weight/bias-gradient core.
//
// fp32 GEMM: oneDNN's row-major `dnnl_sgemm` (takes beta, so accumulating into
// fp32 main_grad costs no extra pass) when the build links the libdnnl.so.3
// that ships with the Paddle wheel; otherwise a blocked OpenMP loop nest.
//
// bf16 inputs: decided at RUN time (cpu_bf16_path()): on CPUs with native bf16
// dot products (avx512_bf16 / AMX, and oneDNN allowed to use them) oneDNN's
// `dnnl_gemm_bf16bf16f32`; elsewhere (e.g. AVX2-only CPUs, where that call falls
// to a ~0.5 GFLOP/s reference kernel) the inputs are widened to fp32 in row
// chunks and multiplied by the fp32 GEMM.  fp16 inputs (no f16 GEMM in oneDNN's
// C API) are always widened.  The chunk loop applies beta on the first chunk
// only; kWidenBudget bounds the extra memory (a per-thread workspace reused
// between calls).  A bf16/fp16 weight gradient (multi_precision=False) is
// accumulated in fp32 and rounded once, in a second kept scratch when its K*N
// floats fit the same budget.
//
// Exactness of the native path: the hardware bf16 dot products (VDPBF16PS; AMX)
// treat subnormal inputs as zero and flush subnormal results to zero, whatever
// MXCSR says.  Before each oneDNN bf16 GEMM one pass over x and dy finds their
// smallest nonzero magnitudes (bf16_native_is_exact); when a subnormal could
// appear anywhere -- a subnormal input, or two inputs whose product could land
// below FLT_MIN -- the call takes the widen path instead, so both paths give
// IEEE fp32 results with gradual underflow (measured cost of the pass:
// benchmarks/bench_bf16_scan.py).
//
// fp64 inputs: our own packed, register-blocked OpenMP DGEMM (oneDNN has no
// dgemm), whose micro-kernel is chosen at run time (AVX2+FMA or generic C++).
//
// Files of the CPU core, one concern each: this one (the entry point, argument
// checks, the fp32 GEMM and the widening path, bias sums); wgrad_cpu_env.{h,cc}
// (run-time ISA, the PADDLE_MGRAD_CPU_* knobs); wgrad_bf16_scan.cc (the
// exactness pass); wgrad_dgemm.{h,cc} (fp64 GEMM); wgrad_cpu_dtype.h (element
// conversions).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include <omp.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PMG_X86 1
#endif

#include "wgrad_core.h"
#include "wgrad_cpu_dtype.h"
#include "wgrad_cpu_env.h"
#include "wgrad_dgemm.h"

#ifdef PMG_WITH_ONEDNN
// The wheel ships the library but not oneapi/dnnl/dnnl.h, so we declare the
// entry points of oneDNN's stable C API ourselves (dnnl_status_t is an int-sized
// enum, 0 == dnnl_success; dnnl_dim_t is int64_t; bf16 is 16 raw bits).
extern "C" {
int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
               int64_t ldc);
int dnnl_gemm_bf16bf16f32(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
                          const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                          float beta, float* C, int64_t ldc);
}
#endif

namespace pmg {

namespace {
// Widened rows of X and dY per fp32 GEMM: as many as fit in kWidenBudget bytes
// (rows * (K + N) * 4), at least kMinChunkRows.  Each chunk re-reads and
// re-writes all of C and re-packs in oneDNN, so few large chunks are faster:
// Zen 3, 4096x1024x4096 bf16/fp32 throughput 0.76 with 512-row chunks, 0.9-1.0
// with 2048-4096 rows.  PADDLE_MGRAD_CPU_CHUNK_ROWS=n forces n rows (tests; its
// bound is cpu::kMaxChunkRows in wgrad_cpu_env.cc).
constexpr int64_t kWidenBudget = int64_t(64) << 20;
constexpr int64_t kMinChunkRows = 256;
constexpr int64_t kKB = 16;   // portable GEMM: rows of C per tile
constexpr int64_t kNB = 512;  // portable GEMM / bias: columns per tile
// bias sums of fewer elements of dY run on the calling thread (see bias_columns)
constexpr int64_t kParallelBiasElems = int64_t(1) << 22;
}  // namespace

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kF64: return "float64";
  }
  return "unknown";
}

size_t dtype_bytes(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBF16:
    case DType::kF16: return 2;
  }
  return 4;
}

namespace {
// "" when `acc` may accumulate `in` inputs (acc_dtype_ok), else the message naming `what`.
std::string acc_problem(const char* what, DType in, DType acc) {
  if (acc_dtype_ok(in, acc)) return "";
  return std::string(what) + " is " + dtype_name(acc) + "; it must be " + dtype_name(in) + " or " +
         dtype_name(mp_type(in)) + " for " + dtype_name(in) + " inputs";
}
}  // namespace

std::string check_args(const WgradArgs& a) {
  for (DType t : {a.in_dtype, a.dw_dtype, a.db_dtype})
    if (!valid_dtype_code(static_cast<int>(t)))
      return "dtype code must be 0 (float32), 1 (bfloat16), 2 (float16) or 3 (float64), got " +
             std::to_string(static_cast<int>(t));
  if (a.M < 0 || a.K < 0 || a.N < 0)
    return "negative dimension (M=" + std::to_string(a.M) + ", K=" + std::to_string(a.K) +
           ", N=" + std::to_string(a.N) + ")";
  std::string err = a.dw != nullptr ? acc_problem("dweight", a.in_dtype, a.dw_dtype) : "";
  if (err.empty() && a.db != nullptr) err = acc_problem("dbias", a.in_dtype, a.db_dtype);
  if (!err.empty()) return err;
  // Zero-element tensors may have null data: only what will be read must exist.
  const bool gemm = a.dw != nullptr && a.M > 0 && a.K > 0 && a.N > 0;
  const bool bias = a.db != nullptr && a.M > 0 && a.N > 0;
  if (gemm && a.x == nullptr)
    return "null input pointer x [M=" + std::to_string(a.M) + ", K=" + std::to_string(a.K) + "]";
  if ((gemm || bias) && a.dy == nullptr)
    return "null input pointer dy [M=" + std::to_string(a.M) + ", N=" + std::to_string(a.N) + "]";
  return "";
}

const char* cpu_gemm_backend() {
#ifdef PMG_WITH_ONEDNN
  return "onednn";
#else
  return "portable";
#endif
}

namespace {

using cpu::Bf16Path;
using cpu::isa;
using cpu::load;
using cpu::scale_or_zero;
using cpu::store;

// ------------------------------------------------------------ widening
void widen_bf16(const uint16_t* src, int64_t n, float* dst) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}

#ifdef PMG_X86
__attribute__((target("avx,f16c"))) void widen_f16_f16c(const uint16_t* src, int64_t n,
                                                        float* dst) {
  const int64_t blocks = n / 8;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t b = 0; b < blocks; ++b) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8 * b));
    _mm256_storeu_ps(dst + 8 * b, _mm256_cvtph_ps(h));
  }
  for (int64_t i = blocks * 8; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
#endif

void widen(const void* src, DType t, int64_t n, float* dst) {
  if (t == DType::kBF16) return widen_bf16(static_cast<const uint16_t*>(src), n, dst);
#ifdef PMG_X86
  if (t == DType::kF16 && isa().f16c)
    return widen_f16_f16c(static_cast<const uint16_t*>(src), n, dst);
#endif
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src, t, i);
}

// ------------------------------------------------------------ fp32 GEMM
// C[K, N] = beta * C + A[M, K]^T . B[M, N], fp32, row-major.
void portable_sgemm_tn(const float* A, const float* B, float* C, int64_t M, int64_t K, int64_t N,
                       float beta) {
  scale_or_zero(C, K * N, beta);
  const int64_t kt = (K + kKB - 1) / kKB, nt = (N + kNB - 1) / kNB;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t ki = 0; ki < kt; ++ki) {
    for (int64_t ni = 0; ni < nt; ++ni) {
      const int64_t k0 = ki * kKB, k1 = std::min(K, k0 + kKB);
      const int64_t n0 = ni * kNB, nl = std::min(N, n0 + kNB) - n0;
      for (int64_t m = 0; m < M; ++m) {
        const float* a = A + m * K;
        const float* b = B + m * N + n0;
        for (int64_t k = k0; k < k1; ++k) {
          const float av = a[k];
          float* c = C + k * N + n0;
#pragma omp simd
          for (int64_t n = 0; n < nl; ++n) c[n] += av * b[n];
        }
      }
    }
  }
}

void sgemm_tn(const float* A, const float* B, float* C, int64_t M, int64_t K, int64_t N,
              float beta) {
#ifdef PMG_WITH_ONEDNN
  if (dnnl_sgemm('T', 'N', K, N, M, 1.f, A, K, B, N, beta, C, N) == 0) return;
  // Any refusal (unusual shapes, ISA): the portable kernel computes the same thing.
#endif
  portable_sgemm_tn(A, B, C, M, K, N, beta);
}

// Rows per widening chunk of an M-row product into C[K, N] (see kWidenBudget), or an
// error for a bad PADDLE_MGRAD_CPU_CHUNK_ROWS.  Never more rows than M: the workspace
// is at most the widened inputs, and the chunk count below cannot overflow.
std::string widen_chunk_rows(int64_t M, int64_t K, int64_t N, int64_t* rows) {
  std::string err = cpu::env_chunk_rows(rows);
  if (!err.empty()) return err;
  if (*rows == 0) *rows = std::max(kMinChunkRows, kWidenBudget / ((K + N) * 4));
  *rows = std::max<int64_t>(1, std::min(*rows, M));
  return "";
}

// Scratch buffers kept per thread between calls, one per purpose: a fresh
// 10-80 MiB buffer is a fresh mmap whose first touch costs one page fault per
// 4 KiB page (measured: 21k faults, ~10% of a 4096x1024x4096 bf16 call).
enum Scratch { kWidenScratch = 0, kAccumScratch = 1, kScratchKinds = 2 };

struct ThreadScratch {
  float* p[kScratchKinds] = {};
  size_t bytes[kScratchKinds] = {};
  ~ThreadScratch() {
    for (float* q : p) std::free(q);
  }
};

ThreadScratch& this_thread_scratch() {
  static thread_local ThreadScratch ws;
  return ws;
}

float* thread_scratch(Scratch which, int64_t n) {
  ThreadScratch& ws = this_thread_scratch();
  const size_t bytes = ((static_cast<size_t>(n) * 4 + 4095) / 4096) * 4096;
  if (bytes > ws.bytes[which]) {
    std::free(ws.p[which]);
    ws.p[which] = static_cast<float*>(std::aligned_alloc(4096, bytes));
    ws.bytes[which] = ws.p[which] ? bytes : 0;
  }
  return ws.p[which];
}

// fp32 accumulate of any 16/32-bit input dtype into fp32 C (K, N > 0).
std::string gemm_f32acc(const WgradArgs& a, float* C, float beta) {
  const int64_t M = a.M, K = a.K, N = a.N;
  if (M == 0) {
    scale_or_zero(C, K * N, beta);
    return "";
  }
  if (a.in_dtype == DType::kF32) {
    sgemm_tn(static_cast<const float*>(a.x), static_cast<const float*>(a.dy), C, M, K, N, beta);
    return "";
  }
  if (a.in_dtype == DType::kBF16) {
    Bf16Path path;
    std::string err = cpu::bf16_path(&path);
    if (!err.empty()) return err;
#ifdef PMG_WITH_ONEDNN
    if (path == Bf16Path::kOnednn) {
      const auto* x = static_cast<const uint16_t*>(a.x);
      const auto* dy = static_cast<const uint16_t*>(a.dy);
      if (!bf16_native_is_exact(x, M * K, dy, M * N)) {
        cpu::count_bf16_exact_fallback();  // widen below
      } else if (dnnl_gemm_bf16bf16f32('T', 'N', K, N, M, 1.f, x, K, dy, N, beta, C, N) == 0) {
        return "";
      }
    }
#endif
  }
  // Widen row chunks to fp32; the first chunk applies beta, later ones accumulate.
  int64_t rows = 0;
  std::string err = widen_chunk_rows(M, K, N, &rows);
  if (!err.empty()) return err;
  // Equal chunks (4096 rows at a 3072-row budget: 2 x 2048, not 3072 + 1024).
  const int64_t chunks = (M + rows - 1) / rows;
  rows = (M + chunks - 1) / chunks;
  float* xa = thread_scratch(kWidenScratch, rows * (K + N));
  if (xa == nullptr)
    return "cannot allocate " + std::to_string(rows * (K + N) * 4) + " bytes to widen " +
           dtype_name(a.in_dtype) + " inputs to float32 (" + std::to_string(rows) +
           " rows of K=" + std::to_string(K) + " + N=" + std::to_string(N) +
           "); set PADDLE_MGRAD_CPU_CHUNK_ROWS lower";
  float* ya = xa + rows * K;
  const size_t es = dtype_bytes(a.in_dtype);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t r = std::min(rows, M - m0);
    widen(static_cast<const char*>(a.x) + m0 * K * es, a.in_dtype, r * K, xa);
    widen(static_cast<const char*>(a.dy) + m0 * N * es, a.in_dtype, r * N, ya);
    sgemm_tn(xa, ya, C, r, K, N, m0 == 0 ? beta : 1.f);
  }
  return "";
}

// ------------------------------------------------------------ bias
// db[N] = beta * db + the column sums of dY[M, N], in column tiles over the threads.
// Acc is the sum's type: fp64 for fp64 inputs (the only fp64 accumulator), fp32 for the
// others; `finish(n, sum)` writes column n.
// A small product (`parallel` false) runs on the calling thread without entering an OpenMP
// region at all: even a one-thread region costs libgomp a team start, measured as much as
// the whole sum of an 8x64 dY.
template <typename Acc, typename Finish>
void bias_columns(const WgradArgs& a, bool parallel, Finish finish) {
  const int64_t M = a.M, N = a.N, nt = (N + kNB - 1) / kNB;
  auto block = [&](int64_t ni) {
    const int64_t n0 = ni * kNB, nl = std::min(N, n0 + kNB) - n0;
    Acc acc[kNB];
    for (int64_t n = 0; n < nl; ++n) acc[n] = 0;
    constexpr DType kOwn = sizeof(Acc) == 8 ? DType::kF64 : DType::kF32;
    if (a.in_dtype == kOwn) {  // inputs of the sum's own type: whole rows, vectorised
      const Acc* dy = static_cast<const Acc*>(a.dy);
      for (int64_t m = 0; m < M; ++m) {
        const Acc* row = dy + m * N + n0;
#pragma omp simd
        for (int64_t n = 0; n < nl; ++n) acc[n] += row[n];
      }
    } else {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < nl; ++n) acc[n] += load(a.dy, a.in_dtype, m * N + n0 + n);
    }
    for (int64_t n = 0; n < nl; ++n) finish(n0 + n, acc[n]);
  };
  // Threads only for several tiles of a large dY: a region with one tile (N <= 512, most
  // layers' bias) still starts a team of OMP_NUM_THREADS and waits at its barrier for every
  // member, and on a CPU wheel the members compete for cores with MKL's own OpenMP threads,
  // which spin for 200 ms after each of Paddle's matmuls: measured 70-400 us per call for
  // 512x64..512x259 (2 cores, Intel Xeon) where the sum itself takes a few microseconds.
  if (!parallel || nt < 2 || M * N < kParallelBiasElems) {
    for (int64_t ni = 0; ni < nt; ++ni) block(ni);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t ni = 0; ni < nt; ++ni) block(ni);
}

void bias_grad(const WgradArgs& a, bool parallel) {
  if (a.in_dtype == DType::kF64) {  // fp64 in, fp64 out (check_args)
    double* db = static_cast<double*>(a.db);
    bias_columns<double>(a, parallel, [&](int64_t n, double sum) {
      db[n] = (a.db_beta == 0.f ? 0.0 : a.db_beta * db[n]) + sum;
    });
  } else {
    bias_columns<float>(a, parallel, [&](int64_t n, float sum) {
      const float old = a.db_beta == 0.f ? 0.f : a.db_beta * load(a.db, a.db_dtype, n);
      store(a.db, a.db_dtype, n, old + sum);
    });
  }
}

// ------------------------------------------------------------ weight gradient
// dW (+)= X^T . dY into an fp32 or fp64 accumulator of the mp type (K, N > 0).
std::string wgrad_mp(const WgradArgs& a) {
  if (a.in_dtype != DType::kF64) return gemm_f32acc(a, static_cast<float*>(a.dw), a.dw_beta);
  double* C = static_cast<double*>(a.dw);
  if (a.M == 0) {
    scale_or_zero(C, a.K * a.N, a.dw_beta);
    return "";
  }
  return cpu::dgemm_tn(static_cast<const double*>(a.x), static_cast<const double*>(a.dy), C, a.M,
                       a.K, a.N, a.dw_beta);
}

// Same-precision gradient (multi_precision=False, bf16/fp16 dW): accumulate in fp32, round
// once.  The fp32 product lives in this thread's kept scratch when it fits the widening
// budget, else in a buffer freed on return (a 4096x28672 layer would otherwise pin 470 MiB
// per calling thread).
std::string wgrad_rounded(const WgradArgs& a) {
  const int64_t n = a.K * a.N;
  std::unique_ptr<float, decltype(&std::free)> once(nullptr, &std::free);
  float* tmp = nullptr;
  if (n * 4 <= kWidenBudget) {
    tmp = thread_scratch(kAccumScratch, n);
  } else {
    once.reset(static_cast<float*>(std::malloc(static_cast<size_t>(n) * 4)));
    tmp = once.get();
  }
  if (tmp == nullptr)
    return "cannot allocate " + std::to_string(n * 4) + " bytes for the float32 product of a " +
           dtype_name(a.dw_dtype) + " weight gradient [" + std::to_string(a.K) + ", " +
           std::to_string(a.N) + "]";
  std::string err = gemm_f32acc(a, tmp, 0.f);
  if (!err.empty()) return err;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float old = a.dw_beta == 0.f ? 0.f : a.dw_beta * load(a.dw, a.dw_dtype, i);
    store(a.dw, a.dw_dtype, i, old + tmp[i]);
  }
  return "";
}

// Products below this many multiply-adds (M*K*N) run on the calling thread alone: a
// 2-thread OpenMP region costs a fork/join of a few microseconds on a quiet machine, more
// than the whole GEMM of a small layer, and on a loaded one (other processes, or Paddle's
// MKL threads of its own OpenMP runtime still spinning after a matmul) every barrier waits
// for a time slice: measured 20-30 ms for an 8x64x64 call on a busy 2-core Xeon, against
// ~10 us on one thread.  At 2^20 the single-threaded GEMM takes ~10-20 us.
constexpr int64_t kSerialMacs = int64_t(1) << 20;

// omp_set_num_threads(1) for this thread while it lives (oneDNN's GEMMs read the calling
// thread's nthreads ICV of the same libgomp), restored after.
class SerialScope {
 public:
  explicit SerialScope(bool serial) : prev_(serial ? omp_get_max_threads() : 1) {
    if (prev_ > 1) omp_set_num_threads(1);
  }
  ~SerialScope() {
    if (prev_ > 1) omp_set_num_threads(prev_);
  }
  SerialScope(const SerialScope&) = delete;
  SerialScope& operator=(const SerialScope&) = delete;

 private:
  int prev_;
};

bool small_product(const WgradArgs& a) {
  // overflow-safe: each dim is bounded by the tensor sizes, compare step by step
  if (a.M == 0 || a.K == 0 || a.N == 0) return true;
  if (a.M > kSerialMacs || a.K > kSerialMacs || a.N > kSerialMacs) return false;
  const int64_t mk = a.M * a.K;
  return mk <= kSerialMacs && mk * a.N <= kSerialMacs;
}

}  // namespace

size_t cpu_thread_scratch_bytes() {
  const ThreadScratch& ws = this_thread_scratch();
  size_t total = 0;
  for (size_t b : ws.bytes) total += b;
  return total;
}

std::string wgrad_cpu(const WgradArgs& a) {
  // Environment first: a bad knob (changed after import) fails before anything is written.
  std::string bad = cpu_env_problem(a.in_dtype);
  if (!bad.empty()) return bad;
  const bool small = small_product(a);
  const SerialScope serial(small);
  if (a.dw != nullptr && a.K > 0 && a.N > 0) {
    // fp64 accumulators are always fp64 (check_args): only 16-bit ones are rounded.
    std::string err = a.dw_dtype == mp_type(a.in_dtype) ? wgrad_mp(a) : wgrad_rounded(a);
    if (!err.empty()) return err;
  }
  if (a.db != nullptr && a.N > 0) bias_grad(a, !small);
  return "";
}

}  // namespace pmg
