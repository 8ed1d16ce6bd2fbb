"""Every place where paddle_mgrad replaces something inside Paddle: one table, one installer.

Each :class:`Replacement` says *what* is replaced (a module path and an attribute
path inside it), *with what* (``"module:name"`` of our object, resolved only when
installed, so this module imports nothing of paddle_mgrad's features), *why*, and
*which feature* it belongs to:

* ``recompute`` / ``fused_linear`` -- installed by :func:`paddle_mgrad.enable`;
* ``support`` -- installed on first use by the code that needs it
  (:func:`ensure`), e.g. the backward error translation by the first recompute.

Two ways of replacing:

* ``code``: the *code object* (and defaults) of Paddle's function is swapped for
  a trampoline's.  Modelling code binds Paddle's functions at import time
  (``from paddle.distributed.fleet.utils import recompute`` in PaddleNLP); every
  alias refers to the same function object, so all of them run the trampoline.
  A trampoline runs in Paddle's module globals, so it imports its target itself.
* ``attr``: the attribute is rebound (``setattr``) to ``factory(original)``.
  With ``create=True`` an attribute this Paddle lacks is added as
  ``factory(None)`` and removed again (``delattr``) by :func:`uninstall`.

:func:`uninstall` puts back exactly the objects that were there (identity), and
:func:`original` gives a callable copy of Paddle's own function whether or not
it is replaced, for our code to call.
"""

from __future__ import annotations

import importlib
import threading
import types
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

__all__ = [
    "Replacement",
    "REPLACEMENTS",
    "install",
    "uninstall",
    "ensure",
    "original",
    "is_installed",
    "installed_keys",
    "resolve_target",
]

FEATURES = ("recompute", "fused_linear")


@dataclass(frozen=True)
class Replacement:
    key: str
    feature: str  # "recompute", "fused_linear" or "support" (installed on first use)
    module: str  # Paddle module holding the target
    attr: str  # attribute path inside it ("recompute", "Tensor.backward")
    kind: str  # "code": swap __code__; "attr": setattr to factory(original)
    new: str  # "paddle_mgrad.module:name": trampoline (code) or factory (attr)
    why: str
    optional: bool = False  # absent on some Paddle versions: skipped, not an error
    when: Callable[[], bool] = field(default=lambda: True, compare=False)
    create: bool = False  # "attr" only: add the attribute when this Paddle lacks it


_ABSENT = object()  # recorded for a created attribute: uninstall deletes it


REPLACEMENTS: Tuple[Replacement, ...] = (
    Replacement(
        "recompute",
        "recompute",
        "paddle.distributed.fleet.recompute.recompute",
        "recompute",
        "code",
        "paddle_mgrad.recomputation.api:_paddle_recompute_trampoline",
        "Paddle's recompute hands back '<name>cpy' copies of saved parameters (main_grad and "
        "attributes lost), rejects None in save_for_backward on 2.6, cannot preserve CPU RNG on "
        "2.6, and reentrant mode loses main_grad on parameter arguments (#70508).",
    ),
    Replacement(
        "recompute_hybrid",
        "recompute",
        "paddle.distributed.fleet.recompute.recompute_hybrid",
        "recompute_hybrid",
        "code",
        "paddle_mgrad.recomputation.hybrid:_paddle_recompute_hybrid_trampoline",
        "fleet's hybrid-parallel recompute (PipelineLayer with recompute_interval > 0, mp models) "
        "asserts on CPU, rebuilds parameter arguments as copies (main_grad lost) and does not "
        "check recomputation; ours keeps offload/partition.",
    ),
    Replacement(
        "linear",
        "fused_linear",
        "paddle.nn.functional.common",
        "linear",
        "code",
        "paddle_mgrad.linear:_paddle_linear_trampoline",
        "nn.Linear, llama projections and fleet's parallel linears call it: their weight/bias "
        "gradients accumulate in place into fp32 main_grad through our op.",
    ),
    Replacement(
        "incubate_fused_linear",
        "fused_linear",
        "paddle.incubate.nn.functional.fused_matmul_bias",
        "fused_linear",
        "code",
        "paddle_mgrad.linear:_paddle_incubate_fused_linear_trampoline",
        "PaddleNLP's fused layers call it (GPU-only in Paddle); same gradient path as linear.",
        optional=True,
    ),
    Replacement(
        "InnerOverlapLinear",
        "fused_linear",
        "paddle.distributed.fleet.layers.mpu.mp_layers",
        "InnerOverlapLinear",
        "attr",
        "paddle_mgrad.fleet.overlap_linear:replace",
        "ColumnParallelLinear with mp_async_allreduce (and mp_fused_linear_param_grad_add) runs "
        "this PyLayer, which computes dW/db itself (or needs Paddle's GPU-only op); ours "
        "accumulates them in place into fp32 main_grad through our op, dx all-reduce kept async.",
        optional=True,
    ),
    Replacement(
        "SPInnerOverlapLinear",
        "fused_linear",
        "paddle.distributed.fleet.utils.sequence_parallel_utils",
        "SPInnerOverlapLinear",
        "attr",
        "paddle_mgrad.fleet.sp_overlap_linear:replace",
        "ColumnSequenceParallelLinear with sp_async_reduce_scatter (Paddle 3.x) runs this "
        "PyLayer, which saves weight/bias with save_for_backward and computes dW/db itself (or "
        "refuses mp_fused_linear_param_grad_add off CUDA/XPU builds); ours accumulates them in "
        "place into fp32 main_grad through our op, dx reduce-scatter kept async.",
        optional=True,
    ),
    Replacement(
        "zero_bubble_grad_weight_fn",
        "fused_linear",
        "paddle.distributed.fleet.meta_parallel.zero_bubble_utils",
        "grad_weight_fn",
        "code",
        "paddle_mgrad.fleet.zero_bubble:_paddle_grad_weight_fn_trampoline",
        "Zero-bubble pipelines (Paddle 3.x SplitBWMatmul, DualPipeV) defer the weight gradient "
        "to WeightGradStore.pop(), where Paddle's function matmuls into a temporary and then "
        "adds it to main_grad; ours accumulates it in place into fp32 main_grad through our op, "
        "still when the store runs it.",
        optional=True,
    ),
    Replacement(
        "varbase_help",
        "fused_linear",
        "paddle.distributed.fleet.recompute.recompute",
        "_varbase_help",
        "code",
        "paddle_mgrad.linear:_paddle_varbase_help_trampoline",
        "Paddle 2.6's reentrant recompute re-creates parameter arguments as copies; tag each copy "
        "with the real parameter so the fused linear writes main_grad where it belongs.",
        optional=True,
    ),
    Replacement(
        "Tensor.backward",
        "support",
        "paddle",
        "Tensor.backward",
        "attr",
        "paddle_mgrad.autograd.backward_errors:wrap",
        "Paddle's backward engine turns a RecomputeError (recomputation) or FusedLinearError "
        "(fused linear backward) into OSError and leaves grad mode off; the wrapper re-raises "
        "ours and restores grad mode.",
    ),
    Replacement(
        "autograd.backward",
        "support",
        "paddle.autograd",
        "backward",
        "attr",
        "paddle_mgrad.autograd.backward_errors:wrap",
        "As Tensor.backward, for paddle.autograd.backward.",
    ),
    Replacement(
        "grad",
        "support",
        "paddle.base.dygraph.base",
        "grad.__wrapped__",
        "code",
        "paddle_mgrad.autograd.passes:_paddle_grad_trampoline",
        "paddle.grad runs a copy of the graph and wants gradients only at the slots that lead "
        "to its inputs, without touching .grad/main_grad (differentiable with create_graph): "
        "the wrapper tells our PyLayers' backward it runs such a functional pass, and refuses "
        "a graph holding a PyLayer node a backward() already ran (Paddle would segfault).",
    ),
    Replacement(
        "Tensor.register_hook",
        "fused_linear",
        "paddle",
        "Tensor.register_hook",
        "attr",
        "paddle_mgrad.autograd.param_hooks:wrap_register_hook",
        "The fused linear returns None for a weight/bias gradient it accumulated in place, so "
        "a user hook would see None (3.x) or an uninitialized tensor (2.6: heap corruption); "
        "the wrapper counts user hooks so that such parameters get the plain gradient.",
    ),
    Replacement(
        "_C_ops.fused_linear_param_grad_add",
        "fused_linear",
        "paddle._C_ops",
        "fused_linear_param_grad_add",
        "attr",
        "paddle_mgrad.fleet.c_ops:wrap_fused_linear_param_grad_add",
        "Paddle's op has no CPU kernel ('not registered'), so PaddleNLP's own llm/fused_layers.py "
        "and fleet's mp_fused_linear_param_grad_add fail on CPU; CPU tensors run our op, other "
        "places Paddle's kernel. Added where this Paddle has no such attribute.",
        create=True,
    ),
    Replacement(
        "PyLayerContext.save_for_backward",
        "support",
        "paddle.autograd.py_layer",
        "PyLayerContext.save_for_backward",
        "attr",
        "paddle_mgrad.recomputation.saved_hooks:wrap_save_for_backward",
        "While saved-tensor hooks are active (non-reentrant recompute) Paddle accepts only "
        "tensors in save_for_backward (ValueError for a bool, an int, a string; for None on "
        "2.6; a list crashes); the shim saves the tensors and keeps every other object on the "
        "context. Installed by enable() and the first non-reentrant recompute; it also tells "
        "the pack hook that the save comes from a PyLayer.",
    ),
    Replacement(
        "PyLayerContext.saved_tensor",
        "support",
        "paddle.autograd.py_layer",
        "PyLayerContext.saved_tensor",
        "attr",
        "paddle_mgrad.recomputation.saved_hooks:wrap_saved_tensor",
        "Puts the non-tensor objects kept out by the save_for_backward shim back in place.",
    ),
)

_BY_KEY = {r.key: r for r in REPLACEMENTS}
_lock = threading.RLock()
# key -> what was there before install: (function, code, defaults, kwdefaults) for "code",
# (owner, attribute name, original object) for "attr"
_installed: dict = {}
_copies: dict = {}  # key -> callable copy of Paddle's original function ("code" kind)


def _resolve_name(spec: str):
    module, _, name = spec.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _owner(rep: Replacement):
    owner = importlib.import_module(rep.module)
    *path, last = rep.attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, last


def resolve_target(rep: Replacement):
    """``(owner, attribute name, current object)`` or None when absent on this Paddle."""
    try:
        owner, last = _owner(rep)
        return owner, last, getattr(owner, last)
    except (ImportError, AttributeError):
        if rep.optional or rep.create:
            return None
        raise


def _applies(rep: Replacement) -> bool:
    return rep.when()


def _function_copy(fn):
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


def original(key: str):
    """Paddle's own object for ``key``, callable whether or not it is replaced now."""
    rep = _BY_KEY[key]
    with _lock:
        if rep.kind == "code":
            if key not in _copies:
                target = resolve_target(rep)
                if target is None:
                    raise KeyError(f"{rep.module}.{rep.attr} does not exist in this Paddle")
                _copies[key] = _function_copy(target[2])  # snapshot taken before any swap
            return _copies[key]
        if key in _installed:
            if _installed[key][2] is _ABSENT:
                raise KeyError(f"{rep.module}.{rep.attr} does not exist in this Paddle")
            return _installed[key][2]
        target = resolve_target(rep)
        if target is None:
            raise KeyError(f"{rep.module}.{rep.attr} does not exist in this Paddle")
        return target[2]


def _install_one(rep: Replacement) -> bool:
    if rep.key in _installed or not _applies(rep):
        return rep.key in _installed
    target = resolve_target(rep)
    if target is None and rep.create and rep.kind == "attr":
        try:
            target = (*_owner(rep), _ABSENT)
        except (ImportError, AttributeError):
            target = None
    if target is None:
        return False
    owner, name, current = target
    new = _resolve_name(rep.new)
    if rep.kind == "code":
        original(rep.key)  # snapshot before swapping
        if current.__closure__:
            raise RuntimeError(f"cannot replace {current.__qualname__}: it is a closure")
        _installed[rep.key] = (
            current,
            current.__code__,
            current.__defaults__,
            current.__kwdefaults__,
        )
        current.__code__ = new.__code__
        current.__defaults__ = new.__defaults__
        current.__kwdefaults__ = new.__kwdefaults__
    elif rep.kind == "attr":
        _installed[rep.key] = (owner, name, current)
        setattr(owner, name, new(None if current is _ABSENT else current))
    else:  # pragma: no cover - table error
        raise ValueError(f"unknown replacement kind {rep.kind!r}")
    return True


def _uninstall_one(key: str):
    rep = _BY_KEY[key]
    saved = _installed.pop(key)
    if rep.kind == "code":
        fn, code, defaults, kwdefaults = saved
        fn.__code__ = code
        fn.__defaults__ = defaults
        fn.__kwdefaults__ = kwdefaults
    else:
        owner, name, obj = saved
        if obj is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, obj)


def install(feature: str):
    """Install every replacement of ``feature`` (idempotent)."""
    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r}; known: {', '.join(FEATURES)}")
    with _lock:
        for rep in REPLACEMENTS:
            if rep.feature == feature:
                _install_one(rep)


def ensure(*keys: str) -> bool:
    """Install the named ``support`` replacements if they are not yet (first use)."""
    with _lock:
        done = True
        for key in keys:
            done = _install_one(_BY_KEY[key]) and done
        return done


def uninstall(feature: Optional[str] = None):
    """Restore what ``feature`` (None: everything, support entries included) replaced."""
    with _lock:
        # reverse order: a later entry may wrap what an earlier one installed
        for rep in reversed(REPLACEMENTS):
            if rep.key in _installed and (feature is None or rep.feature == feature):
                _uninstall_one(rep.key)


def is_installed(key: str) -> bool:
    return key in _installed


def all_installed(keys) -> bool:
    """Whether every key of the set ``keys`` is installed (one set operation: hot paths ask it
    per call before taking the lock of :func:`ensure`)."""
    return _installed.keys() >= keys


def installed_keys() -> list:
    return [r.key for r in REPLACEMENTS if r.key in _installed]
