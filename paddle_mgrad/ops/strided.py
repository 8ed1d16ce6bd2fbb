"""Strided accumulators and inputs: telling a view from a dense tensor, and a contiguous copy
that leaves the caller's view attached to its buffer.

A ``dweight``/``dbias`` may be a strided view into a flat gradient buffer.  Paddle's custom-op
runner would hand the C++ op a contiguous temporary and drop what it wrote, so the checked path
computes into a copy from :func:`contiguous` and writes it back into the view.
"""

from __future__ import annotations

from .._compat import paddle


def is_strided(t) -> bool:
    """``t`` is a tensor whose elements are not laid out densely (None is not)."""
    return t is not None and hasattr(t, "is_contiguous") and not t.is_contiguous()


def contiguous(t):
    """``t``, or a contiguous copy of a strided view.  (Not ``t.contiguous()``: in Paddle 2.6 and
    3.x that converts the tensor itself, detaching the caller's view from its base buffer.)"""
    if not is_strided(t):
        return t
    with paddle.no_grad():
        return paddle.assign(t)
