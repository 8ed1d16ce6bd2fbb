// What the CPU core may use, decided at run time: the instruction sets this CPU
// (and its OS) offers, and the environment knobs a call reads.  Internal to the
// CPU core (wgrad_cpu.cc, wgrad_bf16_scan.cc, wgrad_dgemm.cc); the public
// answers (cpu_isa, cpu_bf16_path, cpu_env_problem, ...) are in wgrad_core.h.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

namespace pmg {
namespace cpu {

// What cpuid + xgetbv say (false off x86), and the flags as one line of text.
struct Isa {
  bool avx = false, avx2 = false, fma = false, f16c = false, avx512f = false, avx512_core = false,
       avx512_bf16 = false, amx_bf16 = false;
  std::string text;
};

const Isa& isa();  // detected once, thread-safe

// The knobs read here on every call (tests change them at run time) are also declared
// and validated at import in paddle_mgrad/env.py, with the same accepted texts and the
// same message: a value changed after import fails the call, never crashes or is ignored.

// One of `values` (values[0] when unset or empty), else an error message.
std::string env_choice(const char* name, std::initializer_list<const char*> values,
                       const char* accepted, std::string* out);

// PADDLE_MGRAD_CPU_CHUNK_ROWS: 0 when unset or empty, else 1..kMaxChunkRows, else an
// error message.
std::string env_chunk_rows(int64_t* rows);

// PADDLE_MGRAD_CPU_FP64_KERNEL: "auto" or "generic", else an error message.
std::string env_fp64_kernel(std::string* out);

enum class Bf16Path { kOnednn, kWiden };

// How bf16 inputs run now, or an error message for a bad PADDLE_MGRAD_CPU_BF16.
std::string bf16_path(Bf16Path* path);

// Counts a bf16 call that took the oneDNN path's exactness fallback (cpu_bf16_exact_fallbacks).
void count_bf16_exact_fallback();

}  // namespace cpu
}  // namespace pmg
