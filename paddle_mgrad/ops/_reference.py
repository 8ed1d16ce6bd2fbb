"""Pure-Paddle fallback of the fused weight-gradient op (same semantics).

Used when the C++ op cannot be built (no compiler, failed build) or when
``PADDLE_MGRAD_OPS=python``.  Paddle has no CPU bf16/fp16 matmul, so inputs are
widened to fp32 first; in-place semantics come from ``add_``/``copy_``.
"""
from __future__ import annotations

from .._compat import paddle


def _accumulate(dest, value, acc_dtype):
    """``dest += value`` in place (fp32 ``value``); a fresh ``acc_dtype`` tensor if dest is None."""
    if dest is None:
        return value.astype(acc_dtype)
    if dest.dtype == paddle.float32:
        dest.add_(value)
    else:  # same-precision accumulator: add in fp32, round once
        paddle.assign((dest.astype("float32") + value).astype(dest.dtype), dest)
    return dest


def fused_linear_param_grad_add(x, dout, dweight, dbias, multi_precision, has_bias):
    K, N = x.shape[-1], dout.shape[-1]
    acc = paddle.float32 if multi_precision else x.dtype
    x2 = x.reshape([-1, K]).astype("float32")
    dy2 = dout.reshape([-1, N]).astype("float32")
    with paddle.no_grad():
        dweight = _accumulate(dweight, paddle.matmul(x2, dy2, transpose_x=True), acc)
        dbias = _accumulate(dbias, dy2.sum(axis=0), acc) if has_bias else None
    return dweight, dbias
