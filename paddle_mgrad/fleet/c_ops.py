"""Our op under Paddle's name: ``paddle._C_ops.fused_linear_param_grad_add`` (registry entry
``"_C_ops.fused_linear_param_grad_add"``, feature ``fused_linear``).

Paddle's kernel exists for CUDA/XPU only; code written for it (PaddleNLP's
``llm/fused_layers.py``, fleet's ``mp_fused_linear_param_grad_add``) fails on
CPU with "kernel not registered".  While fused_linear is on, the attribute is a
dispatcher: CPU tensors in dynamic mode run :func:`paddle_mgrad.ops.fused_linear_param_grad_add`
(same arguments, same in-place semantics), everything else -- other places,
static-graph values -- Paddle's own op.  Code reaching it as
``paddle._C_ops.fused_linear_param_grad_add`` or ``from paddle import _C_ops;
_C_ops.fused_linear_param_grad_add`` sees it; a name bound with
``from paddle._C_ops import fused_linear_param_grad_add`` *before* enable does not.
"""

from __future__ import annotations

from .. import ops, stats
from .._compat import is_tensor, paddle

__all__ = ["wrap_fused_linear_param_grad_add"]


def _runs_here(x) -> bool:
    """Our op takes it: an eager tensor on the CPU, in dynamic mode."""
    return paddle.in_dynamic_mode() and is_tensor(x) and x.place.is_cpu_place()


def wrap_fused_linear_param_grad_add(paddle_op):
    """Registry factory: the dispatcher around Paddle's op (``None`` where Paddle has none)."""

    def fused_linear_param_grad_add(
        x, dout, dweight=None, dbias=None, multi_precision=True, has_bias=True
    ):
        if paddle_op is not None and not _runs_here(x):
            stats.bump(stats.paddle_c_ops, "paddle")
            return paddle_op(x, dout, dweight, dbias, multi_precision, has_bias)
        stats.bump(stats.paddle_c_ops, "ours")
        return ops.fused_linear_param_grad_add(x, dout, dweight, dbias, multi_precision, has_bias)

    fused_linear_param_grad_add.__wrapped__ = paddle_op
    fused_linear_param_grad_add.__doc__ = (
        "paddle_mgrad: CPU tensors run paddle_mgrad.ops.fused_linear_param_grad_add, other "
        "places Paddle's own kernel.\n\n" + (getattr(paddle_op, "__doc__", None) or "")
    )
    return fused_linear_param_grad_add
