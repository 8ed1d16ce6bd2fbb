// Run-time ISA detection and the CPU core's environment knobs (wgrad_cpu_env.h),
// with the public answers built on them: cpu_isa, cpu_has_native_bf16,
// cpu_bf16_path, cpu_bf16_exact_fallbacks, cpu_env_problem (wgrad_core.h).
#include "wgrad_cpu_env.h"

#include <atomic>
#include <cctype>
#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define PMG_X86 1
#endif

#include "wgrad_core.h"

#ifdef PMG_WITH_ONEDNN
// oneDNN's stable C API, declared here (the wheel ships no headers: see wgrad_cpu.cc).
extern "C" int dnnl_get_effective_cpu_isa();  // dnnl_cpu_isa_t, a bit mask
#endif

namespace pmg {
namespace cpu {

// The largest PADDLE_MGRAD_CPU_CHUNK_ROWS accepted (paddle_mgrad.env.MAX_CHUNK_ROWS):
// 2^24 rows of even one column are 64 MiB of workspace; values near 2^63 overflowed
// the chunk count to 0 (SIGFPE).
constexpr int64_t kMaxChunkRows = int64_t(1) << 24;

// ------------------------------------------------------------ run-time ISA
namespace {

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
  const char* names[] = {"avx",     "avx2",        "fma",         "f16c",
                         "avx512f", "avx512_core", "avx512_bf16", "amx_bf16"};
  const bool flags[] = {s.avx,     s.avx2,        s.fma,         s.f16c,
                        s.avx512f, s.avx512_core, s.avx512_bf16, s.amx_bf16};
  for (int i = 0; i < 8; ++i)
    if (flags[i]) s.text += (s.text.empty() ? "" : " ") + std::string(names[i]);
  if (s.text.empty()) s.text = "baseline";
  return s;
}

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

#ifdef PMG_WITH_ONEDNN
// dnnl_cpu_isa_avx512_core_bf16 (0xe7): every oneDNN ISA at or above it (AMX included)
// has its bits.  ONEDNN_MAX_CPU_ISA=AVX2 (or lower) takes them away.
constexpr int kOnednnIsaBf16 = 0xe7;

bool onednn_may_use_bf16() {
  static const bool ok = (dnnl_get_effective_cpu_isa() & kOnednnIsaBf16) == kOnednnIsaBf16;
  return ok;
}
#endif

// bf16 calls that took the oneDNN path's exactness fallback (bf16_native_is_exact).
std::atomic<uint64_t> g_bf16_exact_fallbacks{0};

}  // namespace

const Isa& isa() {
  static const Isa s = detect_isa();  // thread-safe init
  return s;
}

// ------------------------------------------------------------ environment
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

// By the CPU at run time; "generic" forces the portable fp64 micro-kernel (what CPUs
// without AVX2+FMA run), so tests on any machine cover both.
std::string env_fp64_kernel(std::string* out) {
  return env_choice("PADDLE_MGRAD_CPU_FP64_KERNEL", {"auto", "generic"},
                    "auto (default) or generic", out);
}

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

void count_bf16_exact_fallback() {
  g_bf16_exact_fallbacks.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace cpu

// ------------------------------------------------------------ public answers
using cpu::Bf16Path;
using cpu::isa;

const char* cpu_isa() {
  return isa().text.c_str();
}
// The CPU has the instructions AND oneDNN will use them (ONEDNN_MAX_CPU_ISA may cap it):
// otherwise oneDNN's bf16 GEMM is a slow reference kernel, and widening is faster.
bool cpu_has_native_bf16() {
  return (isa().avx512_bf16 || isa().amx_bf16) &&
#ifdef PMG_WITH_ONEDNN
         cpu::onednn_may_use_bf16();
#else
         true;
#endif
}

const char* cpu_bf16_path() {
  Bf16Path path;
  if (!cpu::bf16_path(&path).empty()) return "invalid PADDLE_MGRAD_CPU_BF16";
  return path == Bf16Path::kOnednn ? "onednn-bf16" : "widen-sgemm";
}

uint64_t cpu_bf16_exact_fallbacks() {
  return cpu::g_bf16_exact_fallbacks.load();
}

std::string cpu_env_problem(DType in_dtype) {
  std::string err;
  if (in_dtype == DType::kBF16) {
    Bf16Path path;
    err = cpu::bf16_path(&path);
  }
  if (err.empty() && (in_dtype == DType::kBF16 || in_dtype == DType::kF16)) {
    int64_t rows;
    err = cpu::env_chunk_rows(&rows);
  }
  if (err.empty() && in_dtype == DType::kF64) {
    std::string v;
    err = cpu::env_fp64_kernel(&v);
  }
  return err;
}

}  // namespace pmg
