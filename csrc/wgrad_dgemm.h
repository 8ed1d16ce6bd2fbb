// The CPU core's fp64 GEMM (oneDNN has no dgemm): packed, register-blocked,
// OpenMP, its micro-kernel chosen at run time (AVX2+FMA or generic C++;
// PADDLE_MGRAD_CPU_FP64_KERNEL=generic forces the generic one).
#pragma once

#include <cstdint>
#include <string>

namespace pmg {
namespace cpu {

// C[K, N] = beta * C + A[M, K]^T . B[M, N] (row-major, beta 0 or 1); requires M, K, N > 0.
// Returns "" or a message naming what failed (a bad knob, out of memory).
std::string dgemm_tn(const double* A, const double* B, double* C, int64_t M, int64_t K, int64_t N,
                     float beta);

}  // namespace cpu
}  // namespace pmg
