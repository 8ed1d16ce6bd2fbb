"""Validation of the fused weight-gradient op's inputs, shared by every backend.

:func:`check` runs before any backend writes anything: a bad ``dbias`` (wrong shape,
dtype, place, or not a tensor) must not leave ``dweight`` half-updated.  It checks the
two flags (:func:`flag`: a bool, or the ints 0/1, as Paddle's op takes them -- the string
``"no"`` is not False), the types, ranks, shapes, dtypes (THE accumulator rule:
:func:`acc_dtypes`) and places of every tensor, and raises
:class:`~paddle_mgrad.FusedLinearError` naming the offending shapes and dtypes.

Places are compared as ``str(t.place)`` through :func:`place` (a seam tests use to fake
devices this machine does not have).
"""
from __future__ import annotations

import functools

import numpy as np

from .._compat import paddle
from ..errors import FusedLinearError

SUPPORTED = ("float32", "bfloat16", "float16", "float64")


@functools.lru_cache(maxsize=None)
def dtype_name(dt) -> str:
    """``"bfloat16"`` for ``paddle.bfloat16`` (cached: ``str()`` of a Paddle 3 dtype costs ~2 us,
    and a call checks several)."""
    return str(dt).replace("paddle.", "")


def mp_dtype(dtype) -> str:
    """Paddle's MPTypeTrait: the multi-precision accumulator of an input dtype
    (float64 for float64, float32 for everything else we support)."""
    return "float64" if dtype_name(dtype) == "float64" else "float32"


def acc_dtypes(dtype, multi_precision) -> set:
    """THE accumulator rule (the C++ core's ``pmg::acc_dtype_ok`` is the other half):
    with multi_precision the accumulator is ``mp_dtype(dtype)``; without it, that or
    the input dtype itself."""
    mp = mp_dtype(dtype)
    return {mp} if multi_precision else {mp, dtype_name(dtype)}


def place(t) -> str:
    """``str(t.place)``: ``Place(cpu)``, ``Place(gpu:0)``, ``Place(xpu:1)``..."""
    return str(t.place)


def flag(name, value) -> bool:
    """``multi_precision`` / ``has_bias``: a bool (numpy's too) or the ints 0 and 1."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise FusedLinearError(
        f"fused_linear_param_grad_add: {name} must be a bool (True/False, or 1/0), got "
        f"{value!r} ({type(value).__name__})")


def _describe(name, t):
    if t is None:
        return ""
    if not isinstance(t, paddle.Tensor):
        return f", {name} {type(t).__name__}"
    return f", {name} {list(t.shape)} {dtype_name(t.dtype)} on {place(t)}"


def check(x, dout, dweight, dbias, multi_precision, has_bias):
    """Raise FusedLinearError unless the call is valid; ``dbias`` counts only with has_bias."""
    if not isinstance(x, paddle.Tensor) or not isinstance(dout, paddle.Tensor):
        raise FusedLinearError(
            "fused_linear_param_grad_add: x and dout must be paddle Tensors, got "
            f"{type(x).__name__} and {type(dout).__name__}")
    dbias = dbias if has_bias else None

    def bad(msg):
        raise FusedLinearError(
            f"fused_linear_param_grad_add: {msg} (x {list(x.shape)} {dtype_name(x.dtype)}, "
            f"dout {list(dout.shape)} {dtype_name(dout.dtype)}"
            + _describe("dweight", dweight) + _describe("dbias", dbias) + ")")

    for name, t in (("dweight", dweight), ("dbias", dbias)):
        if t is not None and not isinstance(t, paddle.Tensor):
            bad(f"{name} must be a paddle Tensor or None, got {type(t).__name__}")
    if len(x.shape) < 2:
        bad(f"x must be at least 2-D [..., K], got {len(x.shape)}-D")
    if len(dout.shape) != len(x.shape) or list(x.shape[:-1]) != list(dout.shape[:-1]):
        bad("x [..., K] and dout [..., N] must have the same leading dims")
    if dtype_name(x.dtype) not in SUPPORTED:
        bad(f"unsupported dtype {dtype_name(x.dtype)}; supported: {', '.join(SUPPORTED)}")
    if x.dtype != dout.dtype:
        bad("x and dout must have the same dtype")
    K, N = x.shape[-1], dout.shape[-1]
    acc_ok = acc_dtypes(x.dtype, multi_precision)
    where = place(x)
    if place(dout) != where:
        bad(f"dout must be on the same device as x ({where} vs {place(dout)})")
    for name, t, shape in (("dweight", dweight, [K, N]), ("dbias", dbias, [N])):
        if t is None:
            continue
        if list(t.shape) != shape:
            bad(f"{name} must be {'[K, N]' if name == 'dweight' else '[N]'} = {shape}")
        if dtype_name(t.dtype) not in acc_ok:
            bad(f"{name} must be {' or '.join(sorted(acc_ok))}"
                + (" when multi_precision=True" if multi_precision else ""))
        if place(t) != where:
            bad(f"{name} must be on the same device as x ({where} vs {place(t)})")
