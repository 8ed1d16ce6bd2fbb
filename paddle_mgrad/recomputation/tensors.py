"""Small tensor helpers shared by both recompute implementations."""
from __future__ import annotations

from .._compat import core, is_tensor, paddle


def describe(t) -> str:
    if t is None:
        return "None"
    return f"Tensor(name={t.name!r}, shape={list(t.shape)}, dtype={t.dtype})"


def spec(t):
    """What the determinism check compares: ``(shape, dtype)``, or None for None."""
    return None if t is None else (tuple(t.shape), t.dtype)


def function_name(function) -> str:
    if isinstance(function, paddle.nn.Layer):
        return type(function).__name__
    return getattr(function, "__qualname__", None) or repr(function)


def iter_tensors(obj):
    """Every tensor in ``obj``, descending into tuples, lists and dict values."""
    if is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_tensors(o)


def any_needs_grad(obj) -> bool:
    """Whether any tensor in ``obj`` (see :func:`iter_tensors`) needs a gradient."""
    return any(not t.stop_gradient for t in iter_tensors(obj))


def detached_view(t):
    """A tensor sharing ``t``'s buffer, with its ``stop_gradient`` and Python attributes."""
    view = t.detach()
    view.stop_gradient = t.stop_gradient
    attrs = getattr(t, "__dict__", None)
    if attrs:
        view.__dict__.update(attrs)
    return view


def buffer_sharing_tensor(t):
    """A new tensor object with its own DenseTensor that shares ``t``'s allocation.

    Paddle 2.6's ``TensorWrapper::recover`` *moves* the memory holder out of
    whatever the unpack hook returns; handing it the parameter itself would
    leave the parameter without storage (wrong values, then a segfault).
    """
    out = core.eager.Tensor(t.dtype, t.shape, t.name + "@mgrad", core.VarDesc.VarType.LOD_TENSOR,
                            t.persistable)
    t._share_buffer_to(out)
    out.stop_gradient = t.stop_gradient
    return out
