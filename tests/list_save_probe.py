"""Crash probe for tests/recomputation/test_save_for_backward.py: a PyLayer that saves ``(x, [a, b])`` -- a
list of tensors -- under non-reentrant recompute.  Paddle's own unpack of a list container
segfaults (3.3.1: SIGSEGV in ``GradNodePyLayer``'s ``call_unpack_hook``); paddle_mgrad's
``save_for_backward`` flattens the list, so backward runs and the gradients equal a run
without recompute.  ``python list_save_probe.py ours`` prints ``OURS OK``; ``native`` runs
Paddle's own recompute (for the record: it crashes on 3.3.1)."""

import sys
import zlib  # noqa: F401  (before paddle on 2.6)

import numpy as np
import paddle
from paddle.autograd import PyLayer

import paddle_mgrad


class L(PyLayer):
    @staticmethod
    def forward(ctx, x, a, b):
        ctx.save_for_backward(x, [a, b])
        return paddle.matmul(paddle.matmul(x, a), b)

    @staticmethod
    def backward(ctx, dy):
        x, (a, b) = ctx.saved_tensor()
        h = paddle.matmul(x, a)
        db = paddle.matmul(h, dy, transpose_x=True)
        dh = paddle.matmul(dy, b, transpose_y=True)
        return paddle.matmul(dh, a, transpose_y=True), paddle.matmul(x, dh, transpose_x=True), db


def run(mode):
    paddle.seed(0)
    x = paddle.randn([4, 3])
    x.stop_gradient = False
    a = paddle.create_parameter([3, 5], "float32")
    b = paddle.create_parameter([5, 2], "float32")

    def f(x):
        return L.apply(x, a, b)

    if mode == "plain":
        y = f(x)
    else:
        y = paddle_mgrad.recompute(f, x, use_reentrant=(mode == "reentrant"))
    (y * y).sum().backward()
    return [t.grad.numpy() for t in (x, a, b)]


if sys.argv[1] == "native":
    from paddle.distributed.fleet.utils import recompute

    paddle.seed(0)
    x = paddle.randn([4, 3])
    x.stop_gradient = False
    a = paddle.create_parameter([3, 5], "float32")
    b = paddle.create_parameter([5, 2], "float32")
    y = recompute(lambda x: L.apply(x, a, b), x, use_reentrant=False)
    (y * y).sum().backward()
    print("NATIVE OK")
else:
    paddle_mgrad.enable(recompute=True)
    ref = run("plain")
    for mode in ("non_reentrant", "reentrant"):
        got = run(mode)
        for r, g in zip(ref, got):
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
    print("OURS OK")
