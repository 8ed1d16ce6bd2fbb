"""Pure-Paddle fallback of the fused weight-gradient op (same semantics).

Used when the C++ op cannot be built (no compiler, failed build), when
``PADDLE_MGRAD_OPS=python``, and for zero-size results (K = 0 or N = 0).  Paddle
has no CPU bf16/fp16 matmul, so inputs are widened to their multi-precision type
first (fp32, or fp64 for fp64: Paddle's MPTypeTrait); in-place semantics come
from ``add_``/``assign``.
"""
from __future__ import annotations

from .._compat import paddle


def _accumulate(dest, value, acc_dtype):
    """``dest += value`` in place (``value`` in the mp type); a fresh ``acc_dtype`` tensor
    if dest is None."""
    if dest is None:
        return value.astype(acc_dtype)
    if 0 in dest.shape:
        return dest  # nothing to add to a zero-size accumulator
    if dest.dtype == value.dtype:
        dest.add_(value)
    else:  # same-precision accumulator: add in the mp type, round once
        paddle.assign((dest.astype(value.dtype) + value).astype(dest.dtype), dest)
    return dest


def _mp(dtype):
    return paddle.float64 if dtype == paddle.float64 else paddle.float32


def fused_linear_param_grad_add(x, dout, dweight, dbias, multi_precision, has_bias):
    K, N = x.shape[-1], dout.shape[-1]
    mp = _mp(x.dtype)
    acc = mp if multi_precision else x.dtype
    M = 1
    for d in x.shape[:-1]:
        M *= d
    with paddle.no_grad():
        if 0 in (M, K, N):  # no product to compute (and Paddle 2.6's matmul rejects some)
            dw = paddle.zeros([K, N], dtype=mp)
            db = paddle.zeros([N], dtype=mp)
            if M > 0 and N > 0:
                db = dout.reshape([M, N]).astype(mp).sum(axis=0)
        else:
            x2 = x.reshape([M, K]).astype(mp)
            dy2 = dout.reshape([M, N]).astype(mp)
            dw = paddle.matmul(x2, dy2, transpose_x=True)
            db = dy2.sum(axis=0) if has_bias else None
        dweight = _accumulate(dweight, dw, acc)
        dbias = _accumulate(dbias, db, acc) if has_bias else None
    return dweight, dbias
