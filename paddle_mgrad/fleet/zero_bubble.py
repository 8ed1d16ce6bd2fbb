"""Zero-bubble pipelines' deferred weight gradient, accumulated in place into fp32 ``main_grad``.

Paddle 3.x's ``paddle.distributed.fleet.meta_parallel.zero_bubble_utils`` splits a linear's
backward (the DualPipeV schedule, PaddleFormers' fp8 linears): ``SplitBWMatmul.backward``
returns ``dx`` (and ``db``) at once and, while ``WeightGradStore.enabled``, puts
``partial(grad_weight_fn, input, weight, out_grad)`` on the store; the schedule runs it later
(``WeightGradStore.pop()``) to fill the pipeline bubble.  Paddle's ``grad_weight_fn`` is
unfused: ``matmul`` into a full temporary, then ``main_grad.add_`` (or a cast to fp32 on the
first micro-step).

With ``fused_linear`` on (registry entry ``zero_bubble_grad_weight_fn``, a code swap, so
``partial`` objects already queued and names imported elsewhere run it too),
:func:`grad_weight_fn` does the same work through our op,
:func:`paddle_mgrad.ops.fused_linear_param_grad_add`: ``main_grad += xᵀ·dy`` (beta = 1, fp32
accumulation, same allocation), or, when ``main_grad`` is None (first micro-step), a fresh fp32
tensor named ``"main_grad@" + weight.name`` exactly as Paddle names it.  It runs when Paddle's
would -- whenever the stored function is called -- so the deferral is unchanged.

Everything else goes to Paddle's own function, unchanged: a weight without a ``main_grad``
attribute (Paddle adds to ``weight.grad``), a weight with ``stop_gradient``, a ``main_grad``
that is not an fp32 ``[K, N]`` dense tensor, inputs that are not 2-D/3-D (Paddle folds only
rank 3), of different or unsupported dtypes (float64 included: Paddle casts its product to
fp32), or on different places.

Recompute: under :func:`paddle_mgrad.recompute` (both modes) the stored function gets the real
parameter.  Paddle's own recompute does not: its reentrant mode hands a weight passed to the
recomputed function as an *argument* over as a detached tensor without ``main_grad``, so
Paddle's ``.grad`` path runs on it, which reaches the parameter only while recompute's backward
is running -- deferred by the store, that gradient is lost; its non-reentrant mode hands the
saved input back with ``stop_gradient`` set, so ``SplitBWMatmul`` returns no ``dx``.  Both are
Paddle's, with or without this module; ``enable(recompute=True)`` fixes both.
"""

from __future__ import annotations

from .. import ops, stats
from .._compat import core, is_tensor, paddle
from ..registry import original

__all__ = ["grad_weight_fn"]

KEY = "zero_bubble_grad_weight_fn"
# inputs our op takes here; float64 is Paddle's (its result is cast to an fp32 main_grad,
# while our op accumulates float64 inputs in float64)
_DTYPES = ("float32", "bfloat16", "float16")


def _dense(t) -> bool:
    return (
        is_tensor(t)
        and (not hasattr(t, "is_dense") or t.is_dense())
        and not (hasattr(t, "is_dist") and t.is_dist())
    )


def _fold(t):
    """Paddle's ``fold_init_dims``: ``[P, M, K]`` -> ``[P*M, K]``; 2-D as is."""
    return t.reshape([-1, t.shape[-1]]) if len(t.shape) == 3 else t


def _ours(input, weight, out_grad) -> bool:
    """Whether our op computes exactly what Paddle's ``grad_weight_fn`` would (module doc)."""
    if weight.stop_gradient or not hasattr(weight, "main_grad"):
        return False
    if not (_dense(input) and _dense(out_grad)):
        return False
    if len(input.shape) not in (2, 3) or len(out_grad.shape) != len(input.shape):
        return False
    if input.dtype != out_grad.dtype or ops._dtype_name(input.dtype) not in _DTYPES:
        return False
    if list(input.shape[:-1]) != list(out_grad.shape[:-1]):
        return False
    if not input.place._equals(out_grad.place):
        return False
    mg = weight.main_grad
    if mg is None:
        return True
    return (
        _dense(mg)
        and mg.dtype == paddle.float32
        and list(mg.shape) == [input.shape[-1], out_grad.shape[-1]]
        and mg.place._equals(input.place)
        and (not hasattr(mg, "is_contiguous") or mg.is_contiguous())
    )


def grad_weight_fn(input, weight, out_grad, inplace_update_grad=True):
    """Drop-in for Paddle's ``zero_bubble_utils.grad_weight_fn`` (see module doc)."""
    if not _ours(input, weight, out_grad):
        return original(KEY)(input, weight, out_grad, inplace_update_grad)
    with paddle.no_grad():
        main_grad = weight.main_grad
        dw, _ = ops.fused_linear_param_grad_add(
            _fold(input), _fold(out_grad), main_grad, None, True, False
        )
        if main_grad is None:  # first micro-step: a new fp32 tensor, named as Paddle names it
            weight.main_grad = core.eager.Tensor(
                value=dw.value(), place=dw.place, name="main_grad@" + weight.name
            )
    stats.fused_params.add(weight.name)
    stats.bump(stats.linear, "into_main_grad")
    stats.bump(stats.linear, "zero_bubble")


def _paddle_grad_weight_fn_trampoline(input, weight, out_grad, inplace_update_grad=True):
    """Becomes the code of Paddle's ``grad_weight_fn`` (registry entry ``zero_bubble_grad_weight_fn``);
    runs in Paddle's module globals, hence the import here."""
    import paddle_mgrad.fleet.zero_bubble as _zb

    return _zb.grad_weight_fn(input, weight, out_grad, inplace_update_grad)
