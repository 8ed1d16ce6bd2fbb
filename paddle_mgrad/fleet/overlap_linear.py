"""fleet's overlap column linear (``mp_async_allreduce``) with in-place fp32 ``main_grad``.

``ColumnParallelLinear`` with ``tensor_parallel_config`` ``enable_mp_async_allreduce``
runs ``paddle.distributed.fleet.layers.mpu.mp_layers.InnerOverlapLinear``, a
``PyLayer`` whose backward starts the all-reduce of ``dx`` asynchronously and
computes ``dW``/``db`` itself while it runs: with ``matmul`` (a separate
gradient tensor that ``MixPrecisionLayer``'s hook then adds to ``main_grad``),
or, with ``enable_mp_fused_linear_param_grad_add``, with Paddle's GPU-only
``_C_ops.fused_linear_param_grad_add`` (``NotImplementedError`` elsewhere).

With ``paddle_mgrad.enable(fused_linear=True)`` the module attribute is
:class:`OverlapLinearWithGradAdd` (registry entry ``InnerOverlapLinear``;
``ColumnParallelLinear.forward`` looks the name up at call time): same
arguments, same forward, ``dx`` all-reduce kept asynchronous, and ``dW``/``db``
accumulated in place into fp32 ``main_grad`` by our op whichever of the two
flags is set (see :mod:`paddle_mgrad.linear` for the accumulator rules).  Like
our linear it saves only ``x`` with ``save_for_backward`` and keeps the
parameters on ``ctx``, so recompute hands back the real objects.  The forward's
``c_identity`` is an identity (its backward, the all-reduce of ``dx``, is done
here explicitly, as in Paddle), so it is not called.
"""

from __future__ import annotations

from .. import stats
from .._compat import paddle
from ..autograd import backward_errors, passes as autograd_passes
from ..linear import (
    apply_under_policy,
    functional_grads,
    input_grad,
    stash_for_backward,
    weight_and_bias_grads,
)
from ..registry import original
from .collective_overlap import let_collective_start

__all__ = ["OverlapLinearWithGradAdd", "replace"]


class OverlapLinearWithGradAdd(autograd_passes.GuardedPyLayer):
    """Drop-in for fleet's ``InnerOverlapLinear`` (see module docstring)."""

    @classmethod
    def apply(cls, x, weight, *args):
        # under a recompute policy that keeps GEMM outputs, its output is one of them
        return apply_under_policy(super().apply, x, weight, *args)

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        fuse_matmul_bias,
        mp_async_allreduce,
        mp_skip_c_identity,
        mp_fused_linear_param_grad_add,
        model_parallel_group,
    ):
        stash_for_backward(ctx, x, weight, bias)  # main_grad checked here, as in our linear
        ctx.group = model_parallel_group
        stats.bump(stats.linear, "overlap_forward")
        return forward_matmul(x, weight, bias, fuse_matmul_bias)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensor()
        weight, bias = ctx.weight, ctx.bias
        fpass = backward_errors.current_pass()
        if fpass is not None:  # paddle.grad: plain gradients, nothing accumulated

            def dx_fn():
                dx = input_grad(dy, weight)
                paddle.distributed.all_reduce(dx, group=ctx.group)
                return dx

            return functional_grads(ctx, x, dy, fpass, dx_fn)
        stats.bump(stats.linear, "overlap_backward")
        dx = task = None
        if ctx.x_needs_grad:
            dx = input_grad(dy, weight)
            # the column-parallel input gradient: summed over the group while dW runs
            task = paddle.distributed.all_reduce(dx, group=ctx.group, sync_op=False)
        out = grads_while(task, dx, x, dy, weight, bias)
        autograd_passes.ran(ctx)
        return out


def forward_matmul(x, weight, bias, fuse_matmul_bias):
    """The forward product of both overlap linears, as fleet computes it: Paddle's GPU
    ``fused_gemm_epilogue`` when ``fuse_matmul_bias``, else Paddle's own (unpatched) ``linear``.
    Without a bias there is no epilogue to fuse (and ``fused_gemm_epilogue(x, w, None)``
    fails, in Paddle too): Paddle's ``linear``, the same product."""
    if fuse_matmul_bias and bias is not None:
        return paddle._legacy_C_ops.fused_gemm_epilogue(x, weight, bias)
    return original("linear")(x, weight, bias)


def grads_while(task, dx, x, dy, weight, bias):
    """The end of an overlapped backward (both overlap linears): dW/db through our op while
    ``task`` (dx's collective) runs, then wait for it; returns what the PyLayer returns."""
    if task is not None:
        let_collective_start(dy)  # Paddle's warning + small launch (GPU, connections != 1)
    with paddle.no_grad():
        dw, db = weight_and_bias_grads(x, dy, weight, bias, False)
    if task is not None and hasattr(task, "wait"):
        task.wait()
    if bias is None:
        return dx, dw
    return dx, dw, db


def replace(original_class):
    """Registry factory for ``mp_layers.InnerOverlapLinear``."""
    return OverlapLinearWithGradAdd
