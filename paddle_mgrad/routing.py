"""Which linear calls are ours: the route a fused linear's forward takes.

:func:`route` answers None (Paddle's own function runs, unchanged) or the
:class:`~paddle_mgrad.ops._inputs.RouteFacts` our PyLayer keeps for its backward
(:mod:`paddle_mgrad.linear`).  Once the op library is loaded, its fast entry answers in one
call (``csrc/wgrad_pyentry.cc``: the same checks in the same order); before, and where the entry
leaves the answer to Python, :func:`_route_meta` asks Paddle question by question.
``tests/ops/test_fast_entry.py`` checks that both give the same answer or the same error.
"""

from __future__ import annotations

from . import _compat, ops
from ._compat import paddle
from .autograd import backward_errors
from .errors import FusedLinearError
from .ops._inputs import RouteFacts

__all__ = ["route"]

# ``paddle.in_dynamic_mode()`` is ``_dygraph_tracer_ is not None`` on Paddle 2.6 and 3.x (a
# thread-local of paddle.base.framework); the eager Tensor class
_global_var = _compat.global_var
_Tensor = _compat.core.eager.Tensor
# the dtype name of a Paddle dtype, fast (ops._inputs.dtype_name)
_dtname = ops._dtype_name

# ``Tensor._place_str`` of a CPU tensor: the text of Paddle's CPUPlace (no tensor made at import)
_CPU_PLACE = str(paddle.CPUPlace())

# The answers of the op library's fast entry (``ops.fast_route``, csrc/wgrad_pyentry.cc) besides
# None (Paddle's call) and a RouteFacts (ours):
#: x's last dim does not match the weight: :func:`_route_meta` raises the error naming the shapes
ENTRY_SHAPE_MISMATCH = False
#: a meta the entry could not read (say of an uninitialized tensor): Python asks Paddle itself
ENTRY_UNDECIDED = NotImplemented


def route(x, weight, bias, transpose_weight=False):
    """None when the call goes to Paddle's own function unchanged; else the
    :class:`RouteFacts` our PyLayer keeps for its backward.

    The PyLayer takes only what it computes exactly like Paddle: dynamic mode with
    grad on and a weight/bias that needs a gradient; ``x``, ``weight`` (and ``bias``)
    plain dense eager tensors (not numpy arrays, tuples, SelectedRows or dist tensors:
    ``is_dense()`` is False for the last two on Paddle 2.6 and 3.x alike) of one dtype the
    op supports, on one place (zero-size included: the
    op handles K = 0 / N = 0 / M = 0, and main_grad still receives the gradient);
    ``weight`` 2-D, ``x`` at least 2-D, ``bias`` None or 1-D ``[N]``.  Everything
    else -- Paddle 2.6's ``linear((x,), w)`` (``recompute_sequential`` does that),
    numpy inputs, 1-D ``x``, broadcast biases, dtype mixes --
    is Paddle's, with Paddle's result or Paddle's error.  A mismatched ``x``/``weight``
    inner dimension stays ours: it raises a ValueError (:class:`FusedLinearError`) naming
    the shapes.  "where" is ``"cpu"`` or ``"gpu"`` (CUDA) with K, N > 0 (the common case of
    ``linear._backward_fast``), else None (a zero-size product, another place: the general
    backward).
    """
    tr = _global_var._dygraph_tracer_  # paddle.in_dynamic_mode(): not None
    if tr is None or not tr._has_grad:
        return None
    # Every question to Paddle is a call into it, and in a model's step (Paddle's code and ours
    # competing for the CPU's caches) each costs about a microsecond, several times its cost in
    # a loop of its own: once the op library is loaded, its fast entry answers the meta
    # questions below in one call (csrc/wgrad_pyentry.cc: the same checks in the same order).
    fast = ops.fast_route
    if fast is not None:
        facts = fast(x, weight, bias, transpose_weight)
        if facts is None:
            return None
        if facts is not ENTRY_SHAPE_MISMATCH and facts is not ENTRY_UNDECIDED:
            if weight.stop_gradient and (bias is None or bias.stop_gradient):
                return None  # nothing to accumulate
            return facts
        # the error below names the shapes, or Python asks what the entry could not
    return _route_meta(x, weight, bias, transpose_weight)


def _route_meta(x, weight, bias, transpose_weight):
    """:func:`route` after grad mode, asking Paddle question by question (before the op
    library is loaded, and where its fast entry leaves the answer to Python)."""
    # cheapest first; each dtype, shape and place is asked once
    if not (
        isinstance(x, _Tensor)
        and isinstance(weight, _Tensor)
        and x.is_dense()
        and weight.is_dense()
    ):
        return None
    if bias is not None and not (isinstance(bias, _Tensor) and bias.is_dense()):
        return None
    if weight.stop_gradient and (bias is None or bias.stop_gradient):
        return None  # nothing to accumulate
    w_shape, x_shape = weight.shape, x.shape
    if len(w_shape) != 2 or len(x_shape) < 2:
        return None
    x_name = _dtname(x.dtype)
    if x_name not in ops._SUPPORTED or _dtname(weight.dtype) != x_name:
        return None
    k, n = (w_shape[1], w_shape[0]) if transpose_weight else w_shape
    if bias is not None and (bias.shape != [n] or _dtname(bias.dtype) != x_name):
        return None
    # one string per tensor (each ``.place`` read builds a Place object: several times dearer)
    place = x._place_str
    if place != weight._place_str:
        return None
    if x_shape[-1] != k:
        error = FusedLinearError(
            f"fused_linear: x {list(x_shape)} does not match weight {list(w_shape)} "
            f"(x's last dim must be {k})"
        )
        backward_errors.record(error)  # (in a recomputation: see stash_for_backward)
        raise error
    if k <= 0 or n <= 0:
        return RouteFacts(x_name, None, False)
    if place == _CPU_PLACE:
        return RouteFacts(x_name, "cpu", False)
    return RouteFacts(x_name, "gpu" if x.place.is_gpu_place() else None, False)  # (not CUDA-pinned)
