"""fleet's sequence-parallel overlap column linear (``sp_async_reduce_scatter``, Paddle 3.x)
with in-place fp32 ``main_grad``.

``ColumnSequenceParallelLinear`` with ``hybrid_configs["mp_configs"].sp_async_reduce_scatter``
runs ``paddle.distributed.fleet.utils.sequence_parallel_utils.SPInnerOverlapLinear``, a
``PyLayer`` that all-gathers the sequence-sharded input in forward and, in backward, starts
the reduce-scatter of ``dx`` asynchronously and computes ``dW``/``db`` itself while it runs:
with ``matmul`` (a separate gradient that ``MixPrecisionLayer``'s hook then adds to
``main_grad``), or, with ``mp_async_allreduce`` + ``mp_fused_linear_param_grad_add``, with
Paddle's ``_C_ops.fused_linear_param_grad_add`` -- refused (``NotImplementedError``) by a
build-time check wherever Paddle is not compiled for CUDA/XPU, whoever provides the op.
It saves ``weight`` and ``bias`` with ``save_for_backward``.  Paddle 2.6 has no such class.

With ``paddle_mgrad.enable(fused_linear=True)`` the module attribute is
:class:`SPOverlapLinearWithGradAdd` (registry entry ``SPInnerOverlapLinear``;
``ColumnSequenceParallelLinear.forward`` looks the name up at call time): same arguments,
same forward, the ``dx`` reduce-scatter kept asynchronous (``recompute_allgather``: the
input all-gathered again in backward, asynchronously, as Paddle does), and ``dW``/``db``
accumulated in place into fp32 ``main_grad`` by our op whichever flags are set (see
:mod:`paddle_mgrad.linear` for the accumulator rules).  Only the activation goes through
``save_for_backward``; the parameters stay on ``ctx`` as the real objects (recompute-proof,
as in our linear).  The collectives are looked up at call time
(``sequence_parallel_utils.all_gather``, ``paddle.distributed.all_gather``,
``paddle.distributed.stream.reduce_scatter``), exactly the ones Paddle's class calls.
"""

from __future__ import annotations

from .. import stats
from .._compat import paddle
from ..autograd import backward_errors, passes as autograd_passes
from ..linear import (
    apply_under_policy,
    check_main_grads,
    input_grad,
    plain_param_grads,
    stash_for_backward,
)
from .collective_overlap import let_collective_start
from .overlap_linear import forward_matmul, grads_while

__all__ = ["SPOverlapLinearWithGradAdd", "replace"]


def _sp_utils():
    from paddle.distributed.fleet.utils import sequence_parallel_utils

    return sequence_parallel_utils


def _gather(x):
    """The sequence-parallel input all ranks' shards make (what the forward multiplies)."""
    return _sp_utils().all_gather(x)


class SPOverlapLinearWithGradAdd(autograd_passes.GuardedPyLayer):
    """Drop-in for fleet's ``SPInnerOverlapLinear`` (see module docstring)."""

    @classmethod
    def apply(cls, x, weight, bias, fuse_matmul_bias, recompute_allgather, *args):
        # under a recompute policy that keeps GEMM outputs, its output is one of them; a
        # recomputation that takes it back still saves what the forward saves: x, or (without
        # recompute_allgather) the gathered input, gathered again as under full recompute
        saves = None if recompute_allgather else _gather
        return apply_under_policy(
            super().apply,
            x,
            weight,
            bias,
            fuse_matmul_bias,
            recompute_allgather,
            *args,
            saves=saves,
        )

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        fuse_matmul_bias,
        recompute_allgather,
        mp_fused_linear_param_grad_add,
        model_parallel_group,
    ):
        check_main_grads(weight, bias)  # before the all-gather: no collective on bad input
        input_parallel = _gather(x)
        # what backward's dW needs: the gathered input, or (recompute_allgather) x alone
        stash_for_backward(ctx, x if recompute_allgather else input_parallel, weight, bias)
        ctx.x_needs_grad = not x.stop_gradient
        ctx.recompute_allgather = recompute_allgather
        ctx.group = model_parallel_group
        stats.bump(stats.linear, "sp_overlap_forward")
        return forward_matmul(input_parallel, weight, bias, fuse_matmul_bias)

    @staticmethod
    def backward(ctx, dy):
        (saved,) = ctx.saved_tensor()
        weight, bias, group = ctx.weight, ctx.bias, ctx.group
        nranks = group.nranks
        # paddle.grad: plain gradients at the slots Paddle wants, nothing accumulated
        fpass = backward_errors.current_pass()
        need = None if fpass is None else fpass.slots(ctx.guard, 2 if bias is None else 3)
        stats.bump(stats.linear, "sp_overlap_backward" if need is None else "functional_backward")
        gather_task = None
        if ctx.recompute_allgather:
            shape = list(saved.shape)
            shape[0] *= nranks
            input_parallel = paddle.empty(shape=shape, dtype=saved.dtype)
            gather_task = paddle.distributed.all_gather(
                input_parallel, saved, group=group, sync_op=False
            )
            let_collective_start(dy)  # as Paddle, before dx's GEMM
        else:
            input_parallel = saved
        dx = task = None
        if ctx.x_needs_grad if need is None else need[0]:
            dinput_parallel = input_grad(dy, weight)
            if gather_task is not None:  # as Paddle: one collective in flight at a time
                gather_task.wait()
                gather_task = None
            if dinput_parallel.shape[0] % nranks:
                raise ValueError(
                    f"SPInnerOverlapLinear: sequence length {dinput_parallel.shape[0]} of dx "
                    f"{list(dinput_parallel.shape)} is not divisible by the {nranks} ranks"
                )
            shape = list(dinput_parallel.shape)
            shape[0] //= nranks
            dx = paddle.empty(shape=shape, dtype=dinput_parallel.dtype)
            # the sequence-parallel input gradient: summed and scattered while dW runs
            task = paddle.distributed.stream.reduce_scatter(
                dx, dinput_parallel, op=paddle.distributed.ReduceOp.SUM, group=group, sync_op=False
            )
        if gather_task is not None:
            gather_task.wait()
        if need is not None:
            if task is not None and hasattr(task, "wait"):
                task.wait()
            dw, db = plain_param_grads(
                input_parallel, dy, weight, bias, False, need[1], bias is not None and need[2]
            )
            return (dx, dw) if bias is None else (dx, dw, db)
        out = grads_while(task, dx, input_parallel, dy, weight, bias)
        autograd_passes.ran(ctx)
        return out


def replace(original_class):
    """Registry factory for ``sequence_parallel_utils.SPInnerOverlapLinear``."""
    return SPOverlapLinearWithGradAdd
