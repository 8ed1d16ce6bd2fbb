"""Deliver our errors raised inside Paddle's backward engine with their own type.

Recomputation (from an unpack hook) and our PyLayers' backward (the fused
linear's weight-gradient op) run inside Paddle's C++ backward engine, which
turns any Python exception into ``OSError: (External) ...`` and, on Paddle 2.6
and 3.x alike, leaves grad mode *disabled* after the failed backward.  We
record a :class:`~paddle_mgrad.RecomputeError` or
:class:`~paddle_mgrad.FusedLinearError` before raising it, and thin wrappers
around ``Tensor.backward`` and ``paddle.autograd.backward`` re-raise the
recorded error (chained to Paddle's) and switch grad mode back on.  The
wrappers are pass-throughs otherwise; they are registry entries
(``Tensor.backward``, ``autograd.backward`` in :mod:`paddle_mgrad.registry`)
installed by the first recompute call or fused-linear forward and removed by
:func:`paddle_mgrad.disable`.
"""
from __future__ import annotations

import functools
import threading

from . import registry
from ._compat import tracer

_state = threading.local()


def record(error: BaseException):
    if getattr(_state, "error", None) is None:
        _state.error = error


def wrap(orig):
    """``orig`` (a backward entry point) re-raising the recorded error."""

    @functools.wraps(orig)
    def backward(*args, **kwargs):
        depth = getattr(_state, "depth", 0)
        if depth == 0:
            _state.error = None
        _state.depth = depth + 1
        has_grad = tracer()._has_grad
        try:
            return orig(*args, **kwargs)
        except Exception as e:
            err = getattr(_state, "error", None)
            if err is None or e is err:
                raise
            tracer()._has_grad = has_grad
            raise err from e
        finally:
            _state.depth = depth
            if depth == 0:
                _state.error = None

    backward.__wrapped_by_paddle_mgrad__ = True
    return backward


def install():
    """Install the wrappers (first recompute call or fused-linear forward; idempotent)."""
    if not (registry.is_installed("Tensor.backward")
            and registry.is_installed("autograd.backward")):  # skip the lock once installed
        registry.ensure("Tensor.backward", "autograd.backward")
