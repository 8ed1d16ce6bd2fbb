// The exactness pass of the native bf16 path (bf16_native_is_exact, wgrad_core.h):
// the smallest nonzero magnitude of the bf16 inputs, by an AVX-512BW, AVX2 or
// portable kernel chosen at run time, over OpenMP threads.
#include <algorithm>
#include <cstdint>

#include <omp.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PMG_X86 1
#endif

#include "wgrad_core.h"
#include "wgrad_cpu_env.h"

namespace pmg {

using cpu::isa;

namespace {

// min over i of ((p[i] & 0x7fff) - 1) as uint16: the smallest nonzero magnitude minus one
// (bf16 magnitudes order like their bit patterns); zeros wrap to 0xffff and drop out.
inline uint16_t mag_min_generic(const uint16_t* p, int64_t n) {
  uint16_t m = 0xffff;
  for (int64_t i = 0; i < n; ++i)
    m = std::min<uint16_t>(m, static_cast<uint16_t>((p[i] & 0x7fff) - 1));
  return m;
}

#ifdef PMG_X86
__attribute__((target("avx2"))) uint16_t mag_min_avx2(const uint16_t* p, int64_t n) {
  const __m256i mask = _mm256_set1_epi16(0x7fff), one = _mm256_set1_epi16(1);
  __m256i m0 = _mm256_set1_epi16(-1), m1 = m0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 16));
    m0 = _mm256_min_epu16(m0, _mm256_sub_epi16(_mm256_and_si256(a, mask), one));
    m1 = _mm256_min_epu16(m1, _mm256_sub_epi16(_mm256_and_si256(b, mask), one));
  }
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_min_epu16(m0, m1));
  uint16_t m = mag_min_generic(p + i, n - i);
  for (uint16_t v : lanes) m = std::min(m, v);
  return m;
}

__attribute__((target("avx512f,avx512bw"))) uint16_t mag_min_avx512(const uint16_t* p, int64_t n) {
  const __m512i mask = _mm512_set1_epi16(0x7fff), one = _mm512_set1_epi16(1);
  __m512i m0 = _mm512_set1_epi16(-1), m1 = m0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i a = _mm512_loadu_si512(p + i);
    const __m512i b = _mm512_loadu_si512(p + i + 32);
    m0 = _mm512_min_epu16(m0, _mm512_sub_epi16(_mm512_and_si512(a, mask), one));
    m1 = _mm512_min_epu16(m1, _mm512_sub_epi16(_mm512_and_si512(b, mask), one));
  }
  alignas(64) uint16_t lanes[32];
  _mm512_store_si512(lanes, _mm512_min_epu16(m0, m1));
  uint16_t m = mag_min_generic(p + i, n - i);
  for (uint16_t v : lanes) m = std::min(m, v);
  return m;
}
#endif

// kernel: 2 = AVX-512BW, 1 = AVX2, 0 = portable, -1 = the best this CPU has.
uint16_t mag_min(const uint16_t* p, int64_t n, int kernel) {
#ifdef PMG_X86
  if (kernel == 2 || (kernel < 0 && isa().avx512_core)) return mag_min_avx512(p, n);
  if (kernel == 1 || (kernel < 0 && isa().avx2)) return mag_min_avx2(p, n);
#endif
  return mag_min_generic(p, n);
}

// The same over threads (memory-bound: one pass over the inputs, 2 bytes a value).
uint16_t mag_min_parallel(const uint16_t* p, int64_t n, int kernel = -1) {
  constexpr int64_t kSerial = int64_t(1) << 18;
  if (n <= kSerial) return mag_min(p, n, kernel);
  uint16_t m = 0xffff;
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = ((n + nt - 1) / nt + 31) / 32 * 32;
    const int64_t b = std::min(n, t * per), e = std::min(n, b + per);
    const uint16_t mine = e > b ? mag_min(p + b, e - b, kernel) : uint16_t(0xffff);
#pragma omp critical(pmg_mag_min)
    m = std::min(m, mine);
  }
  return m;
}

}  // namespace

int bf16_min_nonzero_bits(const uint16_t* p, int64_t n, int kernel) {
#ifdef PMG_X86
  if ((kernel == 2 && !isa().avx512_core) || (kernel == 1 && !isa().avx2)) return -1;
#else
  if (kernel > 0) return -1;
#endif
  return static_cast<int>(mag_min_parallel(p, n, kernel)) + 1;
}

bool bf16_native_is_exact(const uint16_t* x, int64_t nx, const uint16_t* dy, int64_t ny) {
  // An input that is all (signed) zeros makes every product zero: nothing can be flushed.
  const uint16_t mx = mag_min_parallel(x, nx);
  if (mx == 0xffff) return true;
  const uint16_t my = mag_min_parallel(dy, ny);
  if (my == 0xffff) return true;
  // Biased exponents of the smallest nonzero magnitudes (0: subnormal).  bf16 values with
  // exponents ex, ey have products that are multiples of 2^(ex + ey - 254 - 14), so every
  // nonzero product and partial sum of the GEMM is at least 2^(ex + ey - 268) in magnitude,
  // a normal fp32 number (>= 2^-126) when ex + ey >= 142: then no flush can change anything.
  const int ex = (mx + 1) >> 7, ey = (my + 1) >> 7;
  return ex > 0 && ey > 0 && ex + ey >= 142;
}

}  // namespace pmg
