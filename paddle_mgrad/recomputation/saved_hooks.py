"""Nestable saved-tensor hooks, and ``save_for_backward(..., None)`` on Paddle 2.6.

Paddle allows one pair of saved-tensor hooks at a time
(``core.eager.register_saved_tensors_hooks`` raises when a pair is already
registered, and ``reset`` clears it), so a recompute inside a recompute fails
with Paddle's own context manager.  :func:`hooks` keeps a stack: entering
replaces the active pair, leaving re-registers the enclosing one.

Paddle 2.6's ``PyLayerContext.save_for_backward`` stores its arguments into a
C++ ``container`` whose setter calls the pack hook on every element and raises
``ValueError: save_for_backward only support Tensor, list of Tensor, tuple of
Tensor`` for ``None`` when a hook is active.  :func:`install_none_shim` wraps
the two methods: ``None`` entries are kept out of the container and put back,
in place, by ``saved_tensor``.  The shim is a pure pass-through for contexts
that saved no ``None``.  It is a pair of registry entries installed by the first non-reentrant
recompute and removed by :func:`paddle_mgrad.disable`.  It also tells the pack hook that the tensors come from
a PyLayer (see ``non_reentrant._Frame.pack``: on 2.6 the C++ side of an
ordinary op *moves* the buffer out of whatever the unpack hook returns, so only
PyLayer saves may be given back as the original object).
"""
from __future__ import annotations

import contextlib
import threading

from .. import registry
from .._compat import IS_PADDLE_2, core
from ..errors import RecomputeError

_stack: list = []
_local = threading.local()


def in_pylayer_save() -> bool:
    """True while a PyLayer's ``save_for_backward`` runs the pack hook (2.6 shim only)."""
    return getattr(_local, "pylayer_save", False)


@contextlib.contextmanager
def hooks(pack, unpack):
    if _stack:
        core.eager.reset_saved_tensors_hooks()
    try:
        core.eager.register_saved_tensors_hooks(pack, unpack)
    except Exception as e:  # another (non-paddle_mgrad) hook pair is active
        if _stack:
            core.eager.register_saved_tensors_hooks(*_stack[-1])
        raise RecomputeError(
            "paddle_mgrad.recompute could not install its saved-tensor hooks because "
            "another pair (paddle.autograd.saved_tensors_hooks, or Paddle's own "
            "recompute) is active; call paddle_mgrad.enable() so that Paddle's "
            f"recompute is ours, or do not nest them. Paddle said: {e}"
        ) from e
    _stack.append((pack, unpack))
    try:
        yield
    finally:
        _stack.pop()
        core.eager.reset_saved_tensors_hooks()
        if _stack:
            core.eager.register_saved_tensors_hooks(*_stack[-1])


# ---------------------------------------------------------------- Paddle 2.6
_NONE_MASK = "_paddle_mgrad_none_mask"


def wrap_save_for_backward(orig):
    """Registry factory: ``PyLayerContext.save_for_backward`` accepting None (2.6)."""

    def save_for_backward(self, *tensors):
        if any(t is None for t in tensors):
            setattr(self, _NONE_MASK, tuple(t is None for t in tensors))
            tensors = tuple(t for t in tensors if t is not None)
        elif hasattr(self, _NONE_MASK):
            delattr(self, _NONE_MASK)
        _local.pylayer_save = True
        try:
            orig(self, *tensors)
        finally:
            _local.pylayer_save = False

    save_for_backward.__wrapped__ = orig
    return save_for_backward


def wrap_saved_tensor(orig):
    """Registry factory: ``PyLayerContext.saved_tensor`` putting the None entries back (2.6)."""

    def saved_tensor(self):
        saved = orig(self)
        mask = getattr(self, _NONE_MASK, None)
        if mask is None:
            return saved
        it = iter(saved if saved is not None else ())
        return tuple(None if is_none else next(it) for is_none in mask)

    saved_tensor.__wrapped__ = orig
    return saved_tensor


def install_none_shim() -> bool:
    """Install the 2.6 shim once (first non-reentrant recompute); True if installed."""
    if not IS_PADDLE_2:
        return False
    return registry.ensure("PyLayerContext.save_for_backward", "PyLayerContext.saved_tensor")
