// What the Paddle binding (wgrad_op.cc) offers the other Paddle-aware source of the op library,
// the Python fast entry (wgrad_pyentry.cc): the op's kernels, callable without Paddle's
// custom-op dispatch.
#pragma once

#include <vector>

#include "paddle/extension.h"

namespace pmg_bind {

// pmg_fused_wgrad_add's kernel: returns {dweight_out, dbias_out} (a [1] placeholder for
// dbias_out when has_bias is false).  Throws (PD_CHECK) before writing anything when it
// refuses the call; x and dout must be contiguous.
std::vector<paddle::Tensor> FusedWgrad(const paddle::Tensor& x, const paddle::Tensor& dout,
                                       const paddle::optional<paddle::Tensor>& dweight,
                                       const paddle::optional<paddle::Tensor>& dbias,
                                       bool multi_precision, bool has_bias);

// The whole ordinary backward of y = x . W (+ b) for float32 / float64 CPU tensors: returns
// {dx, dweight_out, dbias_out} (wgrad_op.cc).  Throws (PD_CHECK) before writing anything when
// it refuses the call; x and dout must be contiguous (Paddle's custom-op runner guarantees it
// for the op; the fast entry checks it).
std::vector<paddle::Tensor> FusedLinearBwd(const paddle::Tensor& x, const paddle::Tensor& dout,
                                           const paddle::Tensor& weight,
                                           const paddle::optional<paddle::Tensor>& dweight,
                                           const paddle::optional<paddle::Tensor>& dbias,
                                           bool has_bias);

}  // namespace pmg_bind
