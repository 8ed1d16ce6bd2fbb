"""Validation of the fused weight-gradient op's inputs, shared by every backend.

:func:`check` runs before any backend writes anything: a bad ``dbias`` (wrong shape,
dtype, place, or not a tensor) must not leave ``dweight`` half-updated.  It checks the
two flags (:func:`flag`: a bool, or the ints 0/1, as Paddle's op takes them -- the string
``"no"`` is not False), the types, ranks, shapes, dtypes (THE accumulator rule:
:func:`acc_dtypes`) and places of every tensor, and raises
:class:`~paddle_mgrad.FusedLinearError` naming the offending shapes and dtypes.

Places are compared as ``str(t.place)`` through :func:`.devices.place` (which
:func:`~paddle_mgrad.ops.override` fakes in tests, for devices this machine does not have).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from .._compat import paddle
from ..errors import FusedLinearError
from .devices import place

SUPPORTED = ("float32", "bfloat16", "float16", "float64")


class RouteFacts(NamedTuple):
    """What routing a linear call found out about its inputs, when the call is ours
    (``paddle_mgrad.routing.route``): kept on the PyLayer's ``ctx`` so that its backward
    asks Paddle nothing again.  The op library's fast entry answers with these objects, one
    per combination, made once (``csrc/wgrad_pyentry.cc``)."""

    #: the one dtype name of ``x``, ``weight`` (and ``bias``), one of :data:`SUPPORTED`
    dtype: str
    #: ``"cpu"`` or ``"gpu"`` (CUDA) with K, N > 0: the fast backward's common case; None for
    #: a zero-size product or another place (the checked backward)
    where: Optional[str]
    #: True: the op library's fast entry found every ``main_grad`` the weight and bias carry
    #: (``getattr(p, "main_grad", None)``) None or a dense tensor of the master dtype
    #: (:func:`mp_dtype`), so the forward's check (``linear.check_main_grads``) would pass and
    #: is skipped.  False: the forward checks (and raises); the Python route always answers it.
    main_grads: bool


def _dtype_name_slow(dt) -> str:
    # (not an lru_cache: its keys compare by ==, and enum values of two types are equal ints)
    return str(dt).replace("paddle.", "")


# A dtype's name without asking Paddle twice.  Every question to a Paddle dtype object is a
# pybind call of 1-7 us (``str()``, ``==``, ``hash()`` -- what an ``lru_cache`` lookup does --
# and ``.value``), and a fused linear asks a few dozen per step.
# * Paddle 3.x hands out the same dtype objects every time (``x.dtype is paddle.float32``):
#   they are looked up by ``id()``, and the ``is`` check against the object kept here makes a
#   recycled id impossible to mistake.
# * Paddle 2.6 makes a new object per ``.dtype``: looked up by ``(type, int(dt))``, the enum
#   value (one pybind call).  Strings (``"float32"``) are their own names.
_BY_ID: dict = {}  # id(dtype object) -> (the object, its name)
_BY_ENUM: dict = {}  # (type, enum value) -> name


def _remember(dt):
    name = _dtype_name_slow(dt)
    _BY_ID[id(dt)] = (dt, name)
    return name


for _n in SUPPORTED + (
    "int32",
    "int64",
    "bool",
    "uint8",
    "int8",
    "int16",
    "complex64",
    "complex128",
):
    _dt = getattr(paddle, _n)  # each of these names is a dtype on 2.6 and 3.x
    _remember(_dt)
    _BY_ID[id(_n)] = (_n, _n)
del _n, _dt


def dtype_name(dt) -> str:
    """``"bfloat16"`` for ``paddle.bfloat16`` (or ``"bfloat16"``), fast (see above)."""
    hit = _BY_ID.get(id(dt))
    if hit is not None and hit[0] is dt:
        return hit[1]
    if isinstance(dt, str):
        return dt.replace("paddle.", "")
    try:
        key = (type(dt), int(dt))
    except (TypeError, ValueError):
        return _dtype_name_slow(dt)
    name = _BY_ENUM.get(key)
    if name is None:
        name = _BY_ENUM[key] = _dtype_name_slow(dt)
    return name


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


def flag(name, value) -> bool:
    """``multi_precision`` / ``has_bias``: a bool (numpy's too) or the ints 0 and 1."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise FusedLinearError(
        f"fused_linear_param_grad_add: {name} must be a bool (True/False, or 1/0), got "
        f"{value!r} ({type(value).__name__})"
    )


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
            f"{type(x).__name__} and {type(dout).__name__}"
        )
    dbias = dbias if has_bias else None

    def bad(msg):
        raise FusedLinearError(
            f"fused_linear_param_grad_add: {msg} (x {list(x.shape)} {dtype_name(x.dtype)}, "
            f"dout {list(dout.shape)} {dtype_name(dout.dtype)}"
            + _describe("dweight", dweight)
            + _describe("dbias", dbias)
            + ")"
        )

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
            bad(
                f"{name} must be {' or '.join(sorted(acc_ok))}"
                + (" when multi_precision=True" if multi_precision else "")
            )
        if place(t) != where:
            bad(f"{name} must be on the same device as x ({where} vs {place(t)})")
