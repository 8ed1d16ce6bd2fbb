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
#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>

#include <omp.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define PMG_X86 1
#endif

#include "wgrad_core.h"

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
int dnnl_get_effective_cpu_isa();  // dnnl_cpu_isa_t, a bit mask
}
#endif

namespace pmg {

namespace {
// Widened rows of X and dY per fp32 GEMM: as many as fit in kWidenBudget bytes
// (rows * (K + N) * 4), at least kMinChunkRows.  Each chunk re-reads and
// re-writes all of C and re-packs in oneDNN, so few large chunks are faster:
// Zen 3, 4096x1024x4096 bf16/fp32 throughput 0.76 with 512-row chunks, 0.9-1.0
// with 2048-4096 rows.  PADDLE_MGRAD_CPU_CHUNK_ROWS=n forces n rows (tests).
constexpr int64_t kWidenBudget = int64_t(64) << 20;
constexpr int64_t kMinChunkRows = 256;
// The largest PADDLE_MGRAD_CPU_CHUNK_ROWS accepted (paddle_mgrad.env.MAX_CHUNK_ROWS):
// 2^24 rows of even one column are 64 MiB of workspace; values near 2^63 overflowed
// the chunk count to 0 (SIGFPE).
constexpr int64_t kMaxChunkRows = int64_t(1) << 24;
constexpr int64_t kKB = 16;          // portable GEMM: rows of C per tile
constexpr int64_t kNB = 512;         // portable GEMM / bias: columns per tile
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

std::string check_args(const WgradArgs& a) {
  for (DType t : {a.in_dtype, a.dw_dtype, a.db_dtype})
    if (!valid_dtype_code(static_cast<int>(t)))
      return "dtype code must be 0 (float32), 1 (bfloat16), 2 (float16) or 3 (float64), got " +
             std::to_string(static_cast<int>(t));
  if (a.M < 0 || a.K < 0 || a.N < 0)
    return "negative dimension (M=" + std::to_string(a.M) + ", K=" + std::to_string(a.K) +
           ", N=" + std::to_string(a.N) + ")";
  if (a.dw != nullptr && !acc_dtype_ok(a.in_dtype, a.dw_dtype))
    return std::string("dweight is ") + dtype_name(a.dw_dtype) + "; it must be " +
           dtype_name(a.in_dtype) + " or " + dtype_name(mp_type(a.in_dtype)) + " for " +
           dtype_name(a.in_dtype) + " inputs";
  if (a.db != nullptr && !acc_dtype_ok(a.in_dtype, a.db_dtype))
    return std::string("dbias is ") + dtype_name(a.db_dtype) + "; it must be " +
           dtype_name(a.in_dtype) + " or " + dtype_name(mp_type(a.in_dtype)) + " for " +
           dtype_name(a.in_dtype) + " inputs";
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

// ------------------------------------------------------------ run-time ISA
namespace {

struct Isa {
  bool avx = false, avx2 = false, fma = false, f16c = false, avx512f = false,
       avx512_core = false, avx512_bf16 = false, amx_bf16 = false;
  std::string text;
};

Isa detect_isa() {
  Isa s;
#ifdef PMG_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return s;
  const bool osxsave = c & (1u << 27);
  const bool has_avx = c & (1u << 28), has_fma = c & (1u << 12), has_f16c = c & (1u << 29);
  uint64_t xcr0 = 0;
  if (osxsave) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  const bool os_ymm = (xcr0 & 0x6) == 0x6, os_zmm = (xcr0 & 0xe6) == 0xe6;
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;
  unsigned b7 = 0, c7 = 0, d7 = 0, a71 = 0;
  if (__get_cpuid_count(7, 0, &a, &b7, &c7, &d7)) {
    unsigned b71, c71, d71;
    if (a >= 1) __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71);
  }
  s.avx = has_avx && os_ymm;
  s.avx2 = s.avx && (b7 & (1u << 5));
  s.fma = s.avx && has_fma;
  s.f16c = s.avx && has_f16c;
  s.avx512f = os_zmm && (b7 & (1u << 16));
  // oneDNN's avx512_core: F + BW + VL + DQ
  s.avx512_core = s.avx512f && (b7 & (1u << 30)) && (b7 & (1u << 31)) && (b7 & (1u << 17));
  s.avx512_bf16 = s.avx512_core && (a71 & (1u << 5));
  s.amx_bf16 = s.avx512_core && os_amx && (d7 & (1u << 22)) && (d7 & (1u << 24));
#endif
  const char* names[] = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512_core", "avx512_bf16",
                         "amx_bf16"};
  const bool flags[] = {s.avx, s.avx2, s.fma, s.f16c, s.avx512f, s.avx512_core, s.avx512_bf16,
                        s.amx_bf16};
  for (int i = 0; i < 8; ++i)
    if (flags[i]) s.text += (s.text.empty() ? "" : " ") + std::string(names[i]);
  if (s.text.empty()) s.text = "baseline";
  return s;
}

const Isa& isa() {
  static const Isa s = detect_isa();  // thread-safe init
  return s;
}

// ------------------------------------------------------------ environment
// The knobs read here on every call (tests change them at run time) are also declared
// and validated at import in paddle_mgrad/env.py, with the same accepted texts and the
// same message: a value changed after import fails the call, never crashes or is ignored.
std::string trim_lower(const char* s) {
  std::string t(s);
  const auto sp = [](unsigned char c) { return std::isspace(c) != 0; };
  while (!t.empty() && sp(t.back())) t.pop_back();
  size_t i = 0;
  while (i < t.size() && sp(t[i])) ++i;
  t.erase(0, i);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return t;
}

std::string env_message(const char* name, const char* text, const char* accepted) {
  return std::string(name) + "='" + text + "' is not valid; accepted: " + accepted;
}

// One of `values` (values[0] when unset or empty), else an error message.
std::string env_choice(const char* name, std::initializer_list<const char*> values,
                       const char* accepted, std::string* out) {
  const char* env = std::getenv(name);
  const std::string t = env ? trim_lower(env) : "";
  *out = *values.begin();
  if (t.empty()) return "";
  for (const char* v : values)
    if (t == v) {
      *out = v;
      return "";
    }
  return env_message(name, env, accepted);
}

// PADDLE_MGRAD_CPU_CHUNK_ROWS: 0 when unset or empty, else 1..kMaxChunkRows (digits only,
// surrounding spaces allowed: paddle_mgrad.env._chunk_rows), else an error message.
std::string env_chunk_rows(int64_t* rows) {
  static const char* kName = "PADDLE_MGRAD_CPU_CHUNK_ROWS";
  const char* env = std::getenv(kName);
  *rows = 0;
  const std::string t = env ? trim_lower(env) : "";
  if (t.empty()) return "";
  const std::string accepted = "an integer from 1 to " + std::to_string(kMaxChunkRows);
  int64_t v = 0;
  for (char c : t) {
    if (c < '0' || c > '9') return env_message(kName, env, accepted.c_str());
    v = v * 10 + (c - '0');
    if (v > kMaxChunkRows) return env_message(kName, env, accepted.c_str());  // no overflow
  }
  if (v < 1) return env_message(kName, env, accepted.c_str());
  *rows = v;
  return "";
}

#ifdef PMG_WITH_ONEDNN
// dnnl_cpu_isa_avx512_core_bf16 (0xe7): every oneDNN ISA at or above it (AMX included)
// has its bits.  ONEDNN_MAX_CPU_ISA=AVX2 (or lower) takes them away.
constexpr int kOnednnIsaBf16 = 0xe7;

bool onednn_may_use_bf16() {
  static const bool ok = (dnnl_get_effective_cpu_isa() & kOnednnIsaBf16) == kOnednnIsaBf16;
  return ok;
}
#endif

enum class Bf16Path { kOnednn, kWiden };

// How bf16 inputs run now, or an error message for a bad PADDLE_MGRAD_CPU_BF16.
std::string bf16_path(Bf16Path* path) {
  std::string v;
  std::string err = env_choice("PADDLE_MGRAD_CPU_BF16", {"auto", "native", "widen"},
                               "auto (default), native or widen", &v);
  if (!err.empty()) return err;
#ifndef PMG_WITH_ONEDNN
  *path = Bf16Path::kWiden;
#else
  if (v == "native")
    *path = Bf16Path::kOnednn;
  else if (v == "widen")
    *path = Bf16Path::kWiden;
  else
    *path = cpu_has_native_bf16() ? Bf16Path::kOnednn : Bf16Path::kWiden;
#endif
  return "";
}

// bf16 calls that took the oneDNN path's exactness fallback (bf16_native_is_exact).
std::atomic<uint64_t> g_bf16_exact_fallbacks{0};

}  // namespace

const char* cpu_isa() { return isa().text.c_str(); }
// The CPU has the instructions AND oneDNN will use them (ONEDNN_MAX_CPU_ISA may cap it):
// otherwise oneDNN's bf16 GEMM is a slow reference kernel, and widening is faster.
bool cpu_has_native_bf16() {
  return (isa().avx512_bf16 || isa().amx_bf16) &&
#ifdef PMG_WITH_ONEDNN
         onednn_may_use_bf16();
#else
         true;
#endif
}

const char* cpu_bf16_path() {
  Bf16Path path;
  if (!bf16_path(&path).empty()) return "invalid PADDLE_MGRAD_CPU_BF16";
  return path == Bf16Path::kOnednn ? "onednn-bf16" : "widen-sgemm";
}

uint64_t cpu_bf16_exact_fallbacks() { return g_bf16_exact_fallbacks.load(); }

std::string cpu_env_problem(DType in_dtype) {
  std::string err;
  if (in_dtype == DType::kBF16) {
    Bf16Path path;
    err = bf16_path(&path);
  }
  if (err.empty() && (in_dtype == DType::kBF16 || in_dtype == DType::kF16)) {
    int64_t rows;
    err = env_chunk_rows(&rows);
  }
  if (err.empty() && in_dtype == DType::kF64) {
    std::string v;
    err = env_choice("PADDLE_MGRAD_CPU_FP64_KERNEL", {"auto", "generic"},
                     "auto (default) or generic", &v);
  }
  return err;
}

// ------------------------------------------------------------ bf16 exactness scan
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

__attribute__((target("avx512f,avx512bw"))) uint16_t mag_min_avx512(const uint16_t* p,
                                                                     int64_t n) {
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
    case DType::kF64: return static_cast<float>(static_cast<const double*>(p)[i]);
  }
  return 0.f;
}

inline void store(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
    case DType::kF64: static_cast<double*>(p)[i] = v; break;
  }
}

size_t elem_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    default: return 2;
  }
}

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

template <typename T>
void scale_or_zero(T* c, int64_t n, float beta) {
  if (beta == 1.f) return;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) c[i] = beta == 0.f ? T(0) : static_cast<T>(beta) * c[i];
}

// ------------------------------------------------------------ fp32 GEMM
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
  std::string err = env_chunk_rows(rows);
  if (!err.empty()) return err;
  if (*rows == 0) *rows = std::max(kMinChunkRows, kWidenBudget / ((K + N) * 4));
  *rows = std::max<int64_t>(1, std::min(*rows, M));
  return "";
}

// Scratch buffers kept per thread between calls, one per purpose: a fresh
// 10-80 MiB buffer is a fresh mmap whose first touch costs one page fault per
// 4 KiB page (measured: 21k faults, ~10% of a 4096x1024x4096 bf16 call).
enum Scratch { kWidenScratch = 0, kAccumScratch = 1, kScratchKinds = 2 };

float* thread_scratch(Scratch which, int64_t n) {
  struct Ws {
    float* p[kScratchKinds] = {};
    size_t bytes[kScratchKinds] = {};
    ~Ws() {
      for (float* q : p) std::free(q);
    }
  };
  static thread_local Ws ws;
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
    std::string err = bf16_path(&path);
    if (!err.empty()) return err;
#ifdef PMG_WITH_ONEDNN
    if (path == Bf16Path::kOnednn) {
      const auto* x = static_cast<const uint16_t*>(a.x);
      const auto* dy = static_cast<const uint16_t*>(a.dy);
      if (!bf16_native_is_exact(x, M * K, dy, M * N)) {
        g_bf16_exact_fallbacks.fetch_add(1, std::memory_order_relaxed);  // widen below
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
    return "cannot allocate " + std::to_string(rows * (K + N) * 4) +
           " bytes to widen " + dtype_name(a.in_dtype) + " inputs to float32 (" +
           std::to_string(rows) + " rows of K=" + std::to_string(K) + " + N=" +
           std::to_string(N) + "); set PADDLE_MGRAD_CPU_CHUNK_ROWS lower";
  float* ya = xa + rows * K;
  const size_t es = elem_size(a.in_dtype);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t r = std::min(rows, M - m0);
    widen(static_cast<const char*>(a.x) + m0 * K * es, a.in_dtype, r * K, xa);
    widen(static_cast<const char*>(a.dy) + m0 * N * es, a.in_dtype, r * N, ya);
    sgemm_tn(xa, ya, C, r, K, N, m0 == 0 ? beta : 1.f);
  }
  return "";
}

// ------------------------------------------------------------ fp64 GEMM
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
__attribute__((target("avx2,fma"))) void micro_avx2(int64_t kc, const double* a,
                                                    const double* b, double* c, int64_t ldc,
                                                    int mr, int nr) {
  __m256d c00 = _mm256_setzero_pd(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
          c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t p = 0; p < kc; ++p, a += kMr, b += kNr) {
    const __m256d b0 = _mm256_load_pd(b), b1 = _mm256_load_pd(b + 4);
    __m256d x = _mm256_broadcast_sd(a + 0);
    c00 = _mm256_fmadd_pd(x, b0, c00); c01 = _mm256_fmadd_pd(x, b1, c01);
    x = _mm256_broadcast_sd(a + 1);
    c10 = _mm256_fmadd_pd(x, b0, c10); c11 = _mm256_fmadd_pd(x, b1, c11);
    x = _mm256_broadcast_sd(a + 2);
    c20 = _mm256_fmadd_pd(x, b0, c20); c21 = _mm256_fmadd_pd(x, b1, c21);
    x = _mm256_broadcast_sd(a + 3);
    c30 = _mm256_fmadd_pd(x, b0, c30); c31 = _mm256_fmadd_pd(x, b1, c31);
    x = _mm256_broadcast_sd(a + 4);
    c40 = _mm256_fmadd_pd(x, b0, c40); c41 = _mm256_fmadd_pd(x, b1, c41);
    x = _mm256_broadcast_sd(a + 5);
    c50 = _mm256_fmadd_pd(x, b0, c50); c51 = _mm256_fmadd_pd(x, b1, c51);
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

// By the CPU at run time; PADDLE_MGRAD_CPU_FP64_KERNEL=generic forces the portable
// kernel (what CPUs without AVX2+FMA run), so tests on any machine cover both.
std::string pick_dgemm_kernel(MicroKernel* micro) {
  std::string v;
  std::string err = env_choice("PADDLE_MGRAD_CPU_FP64_KERNEL", {"auto", "generic"},
                               "auto (default) or generic", &v);
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
// go to dst[p * kWidth + j], zero-padded past `cols` -- B panels as kNr-wide
// strips (ld = N), A^T blocks as kMr-wide strips (ld = K: A row m is
// contiguous in k, so A^T's row strips are A's column strips).
template <int kWidth>
inline void pack_strip(const double* src, int64_t ld, int64_t kc, int64_t cols, int64_t s,
                       double* dst) {
  const int64_t j0 = s * kWidth, w = std::min<int64_t>(kWidth, cols - j0);
  src += j0;
  for (int64_t p = 0; p < kc; ++p, src += ld, dst += kWidth)
    for (int64_t j = 0; j < kWidth; ++j) dst[j] = j < w ? src[j] : 0.0;
}

// Requires M, K, N > 0.
std::string dgemm_tn(const double* A, const double* B, double* C, int64_t M, int64_t K,
                     int64_t N, float beta) {
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
      // Pack B[m0:m0+kc, n0:n0+nc] as kNr-wide strips [strip][p][kNr].
#pragma omp parallel for schedule(static)
      for (int64_t s = 0; s < strips; ++s)
        pack_strip<kNr>(B + m0 * N + n0, N, kc, nc, s, bp.p + s * kc * kNr);
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
          // Pack A^T[k0:k0+mc, m0:m0+kc] (A[m0:m0+kc, k0:k0+mc]) as kMr-wide strips.
          for (int64_t r = 0; r < rstrips; ++r)
            pack_strip<kMr>(A + m0 * K + k0, K, kc, mc, r, ap.p + r * kc * kMr);
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

// ------------------------------------------------------------ bias
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

void bias_grad_f64(const WgradArgs& a) {  // fp64 in, fp64 out (the only fp64 accumulator)
  const int64_t M = a.M, N = a.N, nt = (N + kNB - 1) / kNB;
  const double* dy = static_cast<const double*>(a.dy);
  double* db = static_cast<double*>(a.db);
#pragma omp parallel for schedule(static)
  for (int64_t ni = 0; ni < nt; ++ni) {
    const int64_t n0 = ni * kNB, nl = std::min(N, n0 + kNB) - n0;
    double acc[kNB];
    for (int64_t n = 0; n < nl; ++n) acc[n] = 0.0;
    for (int64_t m = 0; m < M; ++m) {
      const double* row = dy + m * N + n0;
#pragma omp simd
      for (int64_t n = 0; n < nl; ++n) acc[n] += row[n];
    }
    for (int64_t n = 0; n < nl; ++n)
      db[n0 + n] = (a.db_beta == 0.f ? 0.0 : a.db_beta * db[n0 + n]) + acc[n];
  }
}

std::string wgrad_f64(const WgradArgs& a) {
  if (a.dw != nullptr && a.K > 0 && a.N > 0) {
    double* C = static_cast<double*>(a.dw);
    if (a.M == 0) {
      scale_or_zero(C, a.K * a.N, a.dw_beta);
    } else {
      std::string err = dgemm_tn(static_cast<const double*>(a.x),
                                 static_cast<const double*>(a.dy), C, a.M, a.K, a.N, a.dw_beta);
      if (!err.empty()) return err;
    }
  }
  if (a.db != nullptr && a.N > 0) bias_grad_f64(a);
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

std::string wgrad_cpu(const WgradArgs& a) {
  // Environment first: a bad knob (changed after import) fails before anything is written.
  std::string bad = cpu_env_problem(a.in_dtype);
  if (!bad.empty()) return bad;
  const SerialScope serial(small_product(a));
  if (a.in_dtype == DType::kF64) return wgrad_f64(a);  // accumulators are fp64 (check_args)
  if (a.dw != nullptr && a.K > 0 && a.N > 0) {
    if (a.dw_dtype == DType::kF32) {
      std::string err = gemm_f32acc(a, static_cast<float*>(a.dw), a.dw_beta);
      if (!err.empty()) return err;
    } else {
      // Same-precision gradient (multi_precision=False): accumulate in fp32, round once.
      // The fp32 product lives in this thread's kept scratch when it fits the widening
      // budget, else in a buffer freed on return (a 4096x28672 layer would otherwise pin
      // 470 MiB per calling thread).
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
    }
  }
  if (a.db != nullptr && a.N > 0) bias_grad(a);
  return "";
}

}  // namespace pmg
