// CUDA implementation of the weight/bias-gradient core (see wgrad_core.h).
// Knows nothing about Paddle; `stream` is a cudaStream_t passed as void* so
// that this header needs no CUDA includes.
#pragma once

#include <string>

#include "wgrad_core.h"

namespace pmg {

// Enqueues dW = beta*dW + X^T.dY (cuBLASLt, fp32 compute) and db = beta*db + sum_m dY
// (deterministic two-pass reduction) on `stream` of `device`.  All pointers are
// device pointers.  Returns "" on success, else a message naming the failed call.
std::string wgrad_cuda(const WgradArgs& a, void* stream, int device);

}  // namespace pmg
