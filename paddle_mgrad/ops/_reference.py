"""Pure-Paddle fallback of the fused weight-gradient op (same semantics).

Used when the C++ op cannot be built (no compiler, failed build), when
``PADDLE_MGRAD_OPS=python``, for places our op does not run (XPU, custom devices),
for zero-size results (K = 0 or N = 0; on the ``paddle-fused`` GPU tier any zero
dimension), and by tests.  Paddle has no CPU bf16/fp16 matmul, so inputs are
widened to their multi-precision type first (fp32, or fp64 for fp64: Paddle's
MPTypeTrait); in-place semantics come from ``add_``/``assign``.

Every input is checked (:func:`._inputs.check`) and both sums are computed before
either accumulator is written, so a bad ``dbias`` leaves ``dweight`` untouched.
Tensors it creates live on ``x``'s place, not on Paddle's default device.
"""

from __future__ import annotations

from .._compat import paddle
from . import _inputs


def _zeros(shape, dtype_name, like):
    """Zeros of the dtype named ``dtype_name`` on ``like``'s place (``paddle.zeros`` would use
    the default device: GPU zeros for CPU inputs in a CUDA build).  Paddle 2.6's ``full``
    takes a dtype object, not its name."""
    from paddle import _C_ops

    return _C_ops.full(shape, 0.0, getattr(paddle, dtype_name), like.place)


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


def fused_linear_param_grad_add(x, dout, dweight, dbias, multi_precision, has_bias):
    multi_precision = _inputs.flag("multi_precision", multi_precision)
    has_bias = _inputs.flag("has_bias", has_bias)
    _inputs.check(x, dout, dweight, dbias, multi_precision, has_bias)
    K, N = x.shape[-1], dout.shape[-1]
    mp = _inputs.mp_dtype(x.dtype)
    acc = mp if multi_precision else x.dtype
    M = 1
    for d in x.shape[:-1]:
        M *= d
    with paddle.no_grad():
        if 0 in (M, K, N):  # no product to compute (and Paddle 2.6's matmul rejects some)
            dw = _zeros([K, N], mp, x)
            db = _zeros([N], mp, x)
            if M > 0 and N > 0:
                db = dout.reshape([M, N]).astype(mp).sum(axis=0)
        else:
            x2 = x.reshape([M, K]).astype(mp)
            dy2 = dout.reshape([M, N]).astype(mp)
            dw = paddle.matmul(x2, dy2, transpose_x=True)
            db = dy2.sum(axis=0) if has_bias else None
        # both sums exist before either accumulator is written
        dweight = _accumulate(dweight, dw, acc)
        dbias = _accumulate(dbias, db, acc) if has_bias else None
    return dweight, dbias
