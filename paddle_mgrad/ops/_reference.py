"""Pure-Paddle fallback of the fused weight-gradient op (same semantics).

Used when the C++ op cannot be built (no compiler, failed build) or when
``PADDLE_MGRAD_OPS=python``.  Paddle has no CPU bf16/fp16 matmul, so inputs are
widened to fp32 first; in-place semantics come from ``add_``/``copy_``.
"""
from __future__ import annotations

from .._compat import paddle


def fused_linear_param_grad_add(x, dout, dweight, dbias, multi_precision, has_bias):
    K, N = x.shape[-1], dout.shape[-1]
    acc = paddle.float32 if multi_precision else x.dtype
    x2 = x.reshape([-1, K]).astype("float32")
    dy2 = dout.reshape([-1, N]).astype("float32")
    with paddle.no_grad():
        dw = paddle.matmul(x2, dy2, transpose_x=True)
        if dweight is None:
            dweight = dw.astype(acc)
        elif dweight.dtype == paddle.float32:
            dweight.add_(dw)
        else:  # same-precision accumulator: add in fp32, round once
            paddle.assign((dweight.astype("float32") + dw).astype(dweight.dtype), dweight)
        if has_bias:
            db = dy2.sum(axis=0)
            if dbias is None:
                dbias = db.astype(acc)
            elif dbias.dtype == paddle.float32:
                dbias.add_(db)
            else:
                paddle.assign((dbias.astype("float32") + db).astype(dbias.dtype), dbias)
        else:
            dbias = None
    return dweight, dbias
