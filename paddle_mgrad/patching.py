"""``enable()`` / ``disable()``: install paddle_mgrad into Paddle and take it out again.

Modelling code binds Paddle's functions at import time
(``from paddle.distributed.fleet.utils import recompute`` in PaddleNLP), so
replacing module attributes would miss those aliases.  We swap the *code object*
of Paddle's function instead: every alias refers to the same function object,
so all of them run our trampoline, which forwards to paddle_mgrad.  The original
code object (and defaults) are kept and put back by :func:`disable`; a private
copy of the original function stays callable for our own use.
"""
from __future__ import annotations

import threading
import types

from ._compat import paddle

_lock = threading.RLock()
_patched: dict = {}  # key -> (function object, original code, defaults, kwdefaults)
_originals: dict = {}  # key -> callable copy of the original function


def _trampoline_recompute(function, *args, **kwargs):
    import paddle_mgrad.recomputation as _m  # resolved in Paddle's module globals

    return _m.recompute(function, *args, **kwargs)


def _trampoline_linear(x, weight, bias=None, name=None):
    import paddle_mgrad.linear as _m

    return _m.fused_linear(x, weight, bias, name)


def _trampoline_incubate_fused_linear(x, weight, bias=None, transpose_weight=False, name=None):
    import paddle_mgrad.linear as _m

    return _m._incubate_fused_linear(x, weight, bias, transpose_weight, name)


ORIGIN = "_paddle_mgrad_origin"


def _trampoline_varbase_help(param):
    import paddle_mgrad.patching as _m

    return _m._param_copy_with_origin(param)


def _param_copy_with_origin(param):
    """Paddle's reentrant recompute re-creates parameter *arguments* as new parameters
    with a deep copy of ``__dict__`` (so ``main_grad`` on them is a copy).  Tag the copy
    with the real parameter, so the fused linear writes ``main_grad`` where it belongs."""
    origin = param.__dict__.pop(ORIGIN, None)  # never deep-copy a parameter
    try:
        new = original("varbase_help")(param)
    finally:
        if origin is not None:
            param.__dict__[ORIGIN] = origin
    new.__dict__[ORIGIN] = origin if origin is not None else param
    return new


def _recompute_module():
    import importlib

    # (the package re-exports the function under the module's name)
    return importlib.import_module("paddle.distributed.fleet.recompute.recompute")


def _targets(feature):
    if feature == "recompute":
        return [("recompute", _recompute_module().recompute, _trampoline_recompute)]
    if feature == "fused_linear":
        out = [("linear", paddle.nn.functional.linear, _trampoline_linear)]
        helper = getattr(_recompute_module(), "_varbase_help", None)
        if helper is not None:
            out.append(("varbase_help", helper, _trampoline_varbase_help))
        inc = getattr(paddle.incubate.nn.functional, "fused_linear", None)
        if inc is not None:
            out.append(("incubate_fused_linear", inc, _trampoline_incubate_fused_linear))
        return out
    raise ValueError(f"unknown feature {feature!r}")


def original(key):
    """A callable copy of Paddle's original function (patched or not)."""
    with _lock:
        if key in _originals:
            return _originals[key]
        feature = "recompute" if key == "recompute" else "fused_linear"
        for k, fn, _ in _targets(feature):
            if k == key:
                copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__,
                                          fn.__defaults__, fn.__closure__)
                copy.__kwdefaults__ = fn.__kwdefaults__
                _originals[key] = copy
                return copy
    raise KeyError(key)


def is_patched(key) -> bool:
    return key in _patched


def patch(feature):
    with _lock:
        for key, fn, tramp in _targets(feature):
            if key in _patched:
                continue
            original(key)  # snapshot before swapping
            if fn.__closure__:
                raise RuntimeError(f"cannot patch {fn.__qualname__}: it is a closure")
            _patched[key] = (fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__)
            fn.__code__ = tramp.__code__
            fn.__defaults__ = tramp.__defaults__
            fn.__kwdefaults__ = tramp.__kwdefaults__


def unpatch(feature=None):
    with _lock:
        keys = [k for k in list(_patched)
                if feature is None or (k == "recompute") == (feature == "recompute")]
        for key in keys:
            fn, code, defaults, kwdefaults = _patched.pop(key)
            fn.__code__ = code
            fn.__defaults__ = defaults
            fn.__kwdefaults__ = kwdefaults


def enable(recompute: bool = True, fused_linear: bool = False):
    """Install paddle_mgrad's fixes into Paddle (idempotent).

    ``recompute=True``: Paddle's ``recompute`` (every alias of it, including
    ``paddle.distributed.fleet.utils.recompute`` and names bound by
    ``from ... import recompute`` before this call) runs
    :func:`paddle_mgrad.recompute`.

    ``fused_linear=True``: ``paddle.nn.functional.linear`` (hence
    ``paddle.nn.Linear`` and fleet's parallel linears) and
    ``paddle.incubate.nn.functional.fused_linear`` run
    :func:`paddle_mgrad.fused_linear`, whose weight/bias gradients accumulate
    in place into fp32 ``main_grad``.

    A feature passed as ``False`` is switched off if it was on.
    """
    for feature, on in (("recompute", recompute), ("fused_linear", fused_linear)):
        if on:
            patch(feature)
        else:
            unpatch(feature)


def disable():
    """Restore Paddle's own functions exactly.

    Also removes what the first :func:`paddle_mgrad.recompute` call installed
    (the backward error translation; on Paddle 2.6 the ``save_for_backward``
    None shim), so call it between runs, not while a graph awaits backward.
    """
    from . import backward_errors, saved_hooks

    unpatch(None)
    backward_errors.uninstall()
    saved_hooks.uninstall_none_shim()


def enabled() -> dict:
    return {"recompute": is_patched("recompute"), "fused_linear": is_patched("linear")}
