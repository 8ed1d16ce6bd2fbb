// fp64 GEMM of the CPU core (wgrad_dgemm.h).
#include "wgrad_dgemm.h"

#include <algorithm>
#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PMG_X86 1
#endif

#include "wgrad_cpu_dtype.h"
#include "wgrad_cpu_env.h"

namespace pmg {
namespace cpu {

namespace {

// C[K, N] (+)= A[M, K]^T . B[M, N] in double: GotoBLAS-style blocking.  The
// reduction dim (M) is cut into kDc-deep slices; for each slice a kDNc-wide
// panel of B is packed into kNr-column strips, then OpenMP threads take
// kDMc-row blocks of C, pack the matching A^T block into kMr-row strips and run
// a kMr x kNr register-tile micro-kernel over them.  Packed strips are
// zero-padded, so edge tiles need no special kernel.
constexpr int kMr = 6, kNr = 8;
constexpr int64_t kDc = 256, kDMc = 96, kDNc = 1024;

using MicroKernel = void (*)(int64_t, const double*, const double*, double*, int64_t, int, int);

inline void store_tile(const double* acc, double* c, int64_t ldc, int mr, int nr) {
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) c[i * ldc + j] += acc[i * kNr + j];
}

void micro_generic(int64_t kc, const double* a, const double* b, double* c, int64_t ldc, int mr,
                   int nr) {
  double acc[kMr * kNr] = {};
  for (int64_t p = 0; p < kc; ++p, a += kMr, b += kNr)
    for (int i = 0; i < kMr; ++i)
#pragma omp simd
      for (int j = 0; j < kNr; ++j) acc[i * kNr + j] += a[i] * b[j];
  store_tile(acc, c, ldc, mr, nr);
}

#ifdef PMG_X86
__attribute__((target("avx2,fma"))) void micro_avx2(int64_t kc, const double* a, const double* b,
                                                    double* c, int64_t ldc, int mr, int nr) {
  __m256d c00 = _mm256_setzero_pd(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
          c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t p = 0; p < kc; ++p, a += kMr, b += kNr) {
    const __m256d b0 = _mm256_load_pd(b), b1 = _mm256_load_pd(b + 4);
    __m256d x = _mm256_broadcast_sd(a + 0);
    c00 = _mm256_fmadd_pd(x, b0, c00);
    c01 = _mm256_fmadd_pd(x, b1, c01);
    x = _mm256_broadcast_sd(a + 1);
    c10 = _mm256_fmadd_pd(x, b0, c10);
    c11 = _mm256_fmadd_pd(x, b1, c11);
    x = _mm256_broadcast_sd(a + 2);
    c20 = _mm256_fmadd_pd(x, b0, c20);
    c21 = _mm256_fmadd_pd(x, b1, c21);
    x = _mm256_broadcast_sd(a + 3);
    c30 = _mm256_fmadd_pd(x, b0, c30);
    c31 = _mm256_fmadd_pd(x, b1, c31);
    x = _mm256_broadcast_sd(a + 4);
    c40 = _mm256_fmadd_pd(x, b0, c40);
    c41 = _mm256_fmadd_pd(x, b1, c41);
    x = _mm256_broadcast_sd(a + 5);
    c50 = _mm256_fmadd_pd(x, b0, c50);
    c51 = _mm256_fmadd_pd(x, b1, c51);
  }
  if (mr == kMr && nr == kNr) {
    const __m256d rows[kMr][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                                  {c30, c31}, {c40, c41}, {c50, c51}};
    for (int i = 0; i < kMr; ++i) {
      double* ci = c + i * ldc;
      _mm256_storeu_pd(ci, _mm256_add_pd(_mm256_loadu_pd(ci), rows[i][0]));
      _mm256_storeu_pd(ci + 4, _mm256_add_pd(_mm256_loadu_pd(ci + 4), rows[i][1]));
    }
    return;
  }
  alignas(32) double acc[kMr * kNr];
  const __m256d all[kMr * 2] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  for (int i = 0; i < kMr * 2; ++i) _mm256_store_pd(acc + 4 * i, all[i]);
  store_tile(acc, c, ldc, mr, nr);
}
#endif

// By the CPU at run time, or the generic kernel when PADDLE_MGRAD_CPU_FP64_KERNEL=generic
// (what CPUs without AVX2+FMA run), so tests on any machine cover both.
std::string pick_dgemm_kernel(MicroKernel* micro) {
  std::string v;
  std::string err = env_fp64_kernel(&v);
  if (!err.empty()) return err;
  *micro = micro_generic;
#ifdef PMG_X86
  if (v == "auto" && isa().avx2 && isa().fma) *micro = micro_avx2;
#endif
  return "";
}

struct AlignedBuf {  // 64-byte aligned scratch (the AVX2 kernel uses aligned loads)
  double* p = nullptr;
  explicit AlignedBuf(size_t n) {
    p = static_cast<double*>(std::aligned_alloc(64, ((n * sizeof(double) + 63) / 64) * 64));
  }
  ~AlignedBuf() { std::free(p); }
};

// Packs strip s of a kc x cols block of a row-major matrix (element (p, j) at
// src[p * ld + j]): columns [s * kWidth, s * kWidth + kWidth) of every row p
// go to dst[p * kWidth + j], zero-padded past `cols`.  Both operands are packed
// by it: B panels as kNr-wide strips (ld = N), A^T blocks as kMr-wide strips
// (ld = K: A row m is contiguous in k, so A^T's row strips are A's column strips).
template <int kWidth>
inline void pack_strip(const double* src, int64_t ld, int64_t kc, int64_t cols, int64_t s,
                       double* dst) {
  const int64_t j0 = s * kWidth, w = std::min<int64_t>(kWidth, cols - j0);
  src += j0;
  for (int64_t p = 0; p < kc; ++p, src += ld, dst += kWidth)
    for (int64_t j = 0; j < kWidth; ++j) dst[j] = j < w ? src[j] : 0.0;
}

// B[m0:m0+kc, n0:n0+nc] as kNr-wide strips [strip][p][kNr], over the threads (shared by
// every row block of C).
void pack_b_panel(const double* B, int64_t N, int64_t m0, int64_t kc, int64_t n0, int64_t nc,
                  double* dst) {
  const int64_t strips = (nc + kNr - 1) / kNr;
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < strips; ++s)
    pack_strip<kNr>(B + m0 * N + n0, N, kc, nc, s, dst + s * kc * kNr);
}

// A^T[k0:k0+mc, m0:m0+kc] (that is A[m0:m0+kc, k0:k0+mc]) as kMr-wide strips, by the
// calling thread (one row block of C each).
void pack_at_block(const double* A, int64_t K, int64_t m0, int64_t kc, int64_t k0, int64_t mc,
                   double* dst) {
  const int64_t rstrips = (mc + kMr - 1) / kMr;
  for (int64_t r = 0; r < rstrips; ++r)
    pack_strip<kMr>(A + m0 * K + k0, K, kc, mc, r, dst + r * kc * kMr);
}

}  // namespace

std::string dgemm_tn(const double* A, const double* B, double* C, int64_t M, int64_t K, int64_t N,
                     float beta) {
  MicroKernel micro = nullptr;
  std::string err = pick_dgemm_kernel(&micro);
  if (!err.empty()) return err;
  scale_or_zero(C, K * N, beta);
  const int64_t nc_max = std::min(N, kDNc), kc_max = std::min(M, kDc);
  const int64_t strips_max = (nc_max + kNr - 1) / kNr;
  AlignedBuf bp(static_cast<size_t>(strips_max * kNr * kc_max));
  if (bp.p == nullptr) return "out of memory (fp64 GEMM packing buffer)";
  const int64_t row_blocks = (K + kDMc - 1) / kDMc;
  bool oom = false;
  for (int64_t n0 = 0; n0 < N; n0 += kDNc) {
    const int64_t nc = std::min(kDNc, N - n0), strips = (nc + kNr - 1) / kNr;
    for (int64_t m0 = 0; m0 < M; m0 += kDc) {
      const int64_t kc = std::min(kDc, M - m0);
      pack_b_panel(B, N, m0, kc, n0, nc, bp.p);
#pragma omp parallel
      {
        AlignedBuf ap(static_cast<size_t>(kDMc * kc));
        if (ap.p == nullptr) {
#pragma omp atomic write
          oom = true;
        }
#pragma omp for schedule(dynamic)
        for (int64_t rb = 0; rb < row_blocks; ++rb) {
          if (ap.p == nullptr) continue;
          const int64_t k0 = rb * kDMc, mc = std::min(kDMc, K - k0);
          const int64_t rstrips = (mc + kMr - 1) / kMr;
          pack_at_block(A, K, m0, kc, k0, mc, ap.p);
          for (int64_t s = 0; s < strips; ++s) {
            const int64_t j0 = n0 + s * kNr;
            const int nr = static_cast<int>(std::min<int64_t>(kNr, n0 + nc - j0));
            for (int64_t r = 0; r < rstrips; ++r) {
              const int64_t i0 = k0 + r * kMr;
              const int mr = static_cast<int>(std::min<int64_t>(kMr, k0 + mc - i0));
              micro(kc, ap.p + r * kc * kMr, bp.p + s * kc * kNr, C + i0 * N + j0, N, mr, nr);
            }
          }
        }
      }
      if (oom) return "out of memory (fp64 GEMM packing buffer)";
    }
  }
  return "";
}

}  // namespace cpu
}  // namespace pmg
