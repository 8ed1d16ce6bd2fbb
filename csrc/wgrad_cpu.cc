// CPU implementation of the weight/bias-gradient accumulation core.
//
// GEMM: oneDNN's row-major `dnnl_sgemm` / `dnnl_gemm_bf16bf16f32` (both take
// beta, so accumulation into fp32 main_grad costs no extra pass) when the
// build links the libdnnl.so.3 that ships with the Paddle wheel; otherwise a
// blocked OpenMP loop nest.  fp16 inputs (no f16 GEMM in oneDNN's C API) and
// bf16 on CPUs where oneDNN refuses bf16 are widened to fp32 in row chunks, so
// the extra memory is bounded (kChunkRows rows of X and dY).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "wgrad_core.h"

#ifdef PMG_WITH_ONEDNN
// The wheel ships the library but not oneapi/dnnl/dnnl.h, so we declare the two
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
constexpr int64_t kChunkRows = 512;  // rows of X/dY widened at a time
constexpr int64_t kKB = 16;          // portable GEMM: rows of C per tile
constexpr int64_t kNB = 512;         // portable GEMM: columns of C per tile
}  // namespace

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
  }
  return "unknown";
}

const char* cpu_gemm_backend() {
#ifdef PMG_WITH_ONEDNN
  return "onednn";
#else
  return "portable";
#endif
}

// ------------------------------------------------------------ conversions
float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;             // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;            // overflow (incl. inf) -> inf
  if (a < 0x38800000u) {                                  // result is subnormal or zero
    if (a < 0x33000000u) return sign;                     // < half the smallest subnormal
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(a >> 23);          // 14..24
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);  // rebias 127 -> 15, round
  return sign | static_cast<uint16_t>(r >> 13);
}

namespace {

inline float load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.f;
}

inline void store(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
  }
}

size_t elem_size(DType t) { return t == DType::kF32 ? 4 : 2; }

void widen(const void* src, DType t, int64_t n, float* dst) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src, t, i);
}

void scale_or_zero(float* c, int64_t n, float beta) {
  if (beta == 1.f) return;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) c[i] = beta == 0.f ? 0.f : beta * c[i];
}

// C[K, N] = beta * C + A[M, K]^T . B[M, N], fp32, row-major.
void portable_sgemm_tn(const float* A, const float* B, float* C, int64_t M, int64_t K,
                       int64_t N, float beta) {
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

std::string sgemm_tn(const float* A, const float* B, float* C, int64_t M, int64_t K, int64_t N,
                     float beta) {
#ifdef PMG_WITH_ONEDNN
  int st = dnnl_sgemm('T', 'N', K, N, M, 1.f, A, K, B, N, beta, C, N);
  if (st == 0) return "";
  // Any refusal (unusual shapes, ISA): the portable kernel computes the same thing.
#endif
  portable_sgemm_tn(A, B, C, M, K, N, beta);
  return "";
}

// fp32 accumulate of any input dtype into fp32 C.
std::string gemm_f32acc(const WgradArgs& a, float* C, float beta) {
  const int64_t M = a.M, K = a.K, N = a.N;
  if (M == 0) {
    scale_or_zero(C, K * N, beta);
    return "";
  }
  if (a.in_dtype == DType::kF32)
    return sgemm_tn(static_cast<const float*>(a.x), static_cast<const float*>(a.dy), C, M, K, N,
                    beta);
#ifdef PMG_WITH_ONEDNN
  if (a.in_dtype == DType::kBF16) {
    int st = dnnl_gemm_bf16bf16f32('T', 'N', K, N, M, 1.f, static_cast<const uint16_t*>(a.x), K,
                                   static_cast<const uint16_t*>(a.dy), N, beta, C, N);
    if (st == 0) return "";
  }
#endif
  // Widen row chunks to fp32; the first chunk applies beta, later ones accumulate.
  const int64_t rows = std::min(M, kChunkRows);
  std::vector<float> xa(static_cast<size_t>(rows * K)), ya(static_cast<size_t>(rows * N));
  const size_t es = elem_size(a.in_dtype);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t r = std::min(rows, M - m0);
    widen(static_cast<const char*>(a.x) + m0 * K * es, a.in_dtype, r * K, xa.data());
    widen(static_cast<const char*>(a.dy) + m0 * N * es, a.in_dtype, r * N, ya.data());
    std::string err = sgemm_tn(xa.data(), ya.data(), C, r, K, N, m0 == 0 ? beta : 1.f);
    if (!err.empty()) return err;
  }
  return "";
}

void bias_grad(const WgradArgs& a) {
  const int64_t M = a.M, N = a.N, nt = (N + kNB - 1) / kNB;
#pragma omp parallel for schedule(static)
  for (int64_t ni = 0; ni < nt; ++ni) {
    const int64_t n0 = ni * kNB, nl = std::min(N, n0 + kNB) - n0;
    float acc[kNB];
    for (int64_t n = 0; n < nl; ++n) acc[n] = 0.f;
    if (a.in_dtype == DType::kF32) {
      const float* dy = static_cast<const float*>(a.dy);
      for (int64_t m = 0; m < M; ++m) {
        const float* row = dy + m * N + n0;
#pragma omp simd
        for (int64_t n = 0; n < nl; ++n) acc[n] += row[n];
      }
    } else {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < nl; ++n) acc[n] += load(a.dy, a.in_dtype, m * N + n0 + n);
    }
    for (int64_t n = 0; n < nl; ++n) {
      const float old = a.db_beta == 0.f ? 0.f : a.db_beta * load(a.db, a.db_dtype, n0 + n);
      store(a.db, a.db_dtype, n0 + n, old + acc[n]);
    }
  }
}

}  // namespace

std::string wgrad_cpu(const WgradArgs& a) {
  if (a.M < 0 || a.K < 0 || a.N < 0) return "negative dimension";
  if ((a.M > 0 && (a.x == nullptr || a.dy == nullptr)))
    return "null input pointer";
  if (a.dw != nullptr) {
    if (a.dw_dtype == DType::kF32) {
      std::string err = gemm_f32acc(a, static_cast<float*>(a.dw), a.dw_beta);
      if (!err.empty()) return err;
    } else {
      // Same-precision gradient (multi_precision=False): accumulate in fp32, round once.
      std::vector<float> tmp(static_cast<size_t>(a.K * a.N));
      std::string err = gemm_f32acc(a, tmp.data(), 0.f);
      if (!err.empty()) return err;
      const int64_t n = a.K * a.N;
#pragma omp parallel for schedule(static) if (n > 65536)
      for (int64_t i = 0; i < n; ++i) {
        const float old = a.dw_beta == 0.f ? 0.f : a.dw_beta * load(a.dw, a.dw_dtype, i);
        store(a.dw, a.dw_dtype, i, old + tmp[i]);
      }
    }
  }
  if (a.db != nullptr) bias_grad(a);
  return "";
}

}  // namespace pmg
