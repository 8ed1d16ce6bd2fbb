"""The ``save:<pattern>`` recompute policy: sublayers of a block that are not recomputed.

A recompute block replays all of its forward in backward.  Under ``save:<pattern>`` the
sublayers of the block that match are run once: in the block's forward every tensor their ops
save for backward is kept (a kept holder of the non-reentrant frame, :mod:`.non_reentrant`) and
their outputs are held (detached aliases: no autograd node, nothing tied to the graph).  The
recomputation does not run them: a matched sublayer's call hands back the held outputs, the
recomputation's pack walk skips the tensors the sublayer saved in the forward, and the random
state jumps to where the forward left it after the sublayer (its dropout masks are not drawn
again, and the ops after it draw the forward's).  Backward through the sublayer's own nodes
reads the kept tensors; backward through the rest of the block reads the recomputation, which
consumed the held outputs -- the forward's values, so every gradient is bit-identical to full
recompute and to no recompute.  What it costs: the sublayer's saved tensors and its outputs stay
in memory until backward, as without recompute.  What it saves: the sublayer's replay.

**Which sublayers.**  Each pattern (a glob, :func:`fnmatch.fnmatchcase`) is compared with a
sublayer's class name and with its attribute path below the block's Layer, whole or its
ending (``mlp`` matches ``mlp`` and ``layers.3.mlp``; ``self_attn.q_proj``).  The block's
Layer: the function itself when it is a Layer, the Layer of a bound method, the Layers a
closure, a ``functools.partial`` or a list they hold reach (PaddleNLP's and PaddleFormers'
``create_custom_forward(layer)``, fleet's pipeline ``execute_func`` over its
``run_function``), and the Layers among the block's arguments.  The outermost match wins: a matched sublayer's own
sublayers run inside it.  The Layer itself matches by class name only (its path is empty): then
the block is not recomputed at all (PaddleNLP's ``no_recompute_layers``).

**How a call is intercepted.**  ``Layer.__call__`` runs ``self.forward`` between the layer's
pre- and post-hooks.  For the duration of the block's forward and of each recomputation, each
matched sublayer's ``forward`` is wrapped on the instance; the wrapper asks this thread's active
block (:func:`running`) and otherwise calls the original, so other threads and code outside the
block see the sublayer unchanged.  Installs are counted per layer (nested blocks, threads) and
the last one out restores the instance as it was.

**When a sublayer is replayed after all** (run as under full recompute; its kept tensors stay
kept): its outputs were changed in place after it returned (a residual ``add_``: the held alias
shares the change), it changed one of its tensor inputs in place (the ops after it would see
another value), or the recomputation diverged from the forward (another layer, or another
number of saved tensors before it: the determinism check then speaks).  A tensor the sublayer
saved and that an in-place op changed afterwards raises in backward, as without recompute
(:meth:`.non_reentrant._Frame.unpack`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
import sys
import threading
import warnings
import weakref

from .._compat import is_tensor, paddle
from ..autograd.recomputing import replayed_output, timed
from ..threadstate import thread_state
from . import rng as _rng
from .tensors import function_name, iter_tensors

__all__ = ["block_layers", "matching", "Sublayers", "running"]

#: ``_active.block``: ``(Sublayers, frame)`` of the block whose forward or recomputation this
#: thread runs right now, None when none (or when the innermost block keeps no sublayer).
_active = thread_state("ActiveBlock", block=None)


# -- which sublayers ------------------------------------------------------------
def _closed_over(function):
    """The values ``function`` closes over.  A segment of fleet's pipeline
    (``PipelineLayer.forward_function``) closes over the stage's whole layer list and the
    int bounds ``start``/``end`` of its segment: a list or tuple among the values is sliced
    to them, so the segment's Layers are found, not the stage's first ones."""
    cells = getattr(function, "__closure__", None) or ()
    code = getattr(function, "__code__", None)
    names = code.co_freevars if code is not None else ()
    values = {}
    for name, cell in zip(names, cells):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    start, end = values.get("start"), values.get("end")
    if type(start) is int and type(end) is int:
        for name, value in values.items():
            if isinstance(value, (list, tuple)):
                values[name] = value[start:end]
    return list(values.values())


def block_layers(function, args, kwargs):
    """The Layers a block runs (module docstring): found through the function, one level of
    closures and partials, and the arguments."""
    layers = []

    def visit(obj, depth):
        if isinstance(obj, paddle.nn.Layer):
            layers.append(obj)
            return
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, paddle.nn.Layer):
            layers.append(owner)
            return
        if depth == 2:
            return
        if isinstance(obj, functools.partial):
            for o in (obj.func, *obj.args, *obj.keywords.values()):
                visit(o, depth + 1)
            return
        if isinstance(obj, (list, tuple)):  # fleet's pipeline closes over its run_function
            for o in obj:
                visit(o, depth + 1)
            return
        for value in _closed_over(obj):
            visit(value, depth + 1)

    visit(function, 0)
    for a in (*args, *kwargs.values()):
        if isinstance(a, paddle.nn.Layer):
            layers.append(a)
    return layers


# root Layer -> {patterns: matched layers}; a model's structure is fixed once built
_matches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_matches_lock = threading.Lock()


def _match_below(root, patterns):
    found, inside = [], []
    for path, layer in [("", root), *root.named_sublayers()]:
        if any(path.startswith(p + ".") for p in inside):
            continue  # runs inside a matched sublayer
        name = type(layer).__name__
        if any(
            fnmatch.fnmatchcase(name, p)
            or (path and (fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, "*." + p)))
            for p in patterns
        ):
            found.append(layer)
            if not path:  # the block's Layer itself: the whole block
                break
            inside.append(path)
    return tuple(found)


def matching(patterns, function, args, kwargs):
    """The sublayers of the block ``function(*args, **kwargs)`` that ``patterns`` select
    (module docstring), outermost first; a warning, once per place, when none does."""
    found, seen = [], set()
    for root in block_layers(function, args, kwargs):
        with _matches_lock:
            per_root = _matches.setdefault(root, {})
            layers = per_root.get(patterns)
            if layers is None:
                layers = per_root[patterns] = _match_below(root, patterns)
        for layer in layers:
            if id(layer) not in seen:
                seen.add(id(layer))
                found.append(layer)
    if not found:
        warnings.warn(
            f"recompute policy save:{','.join(patterns)} matches no sublayer of the block "
            f"{function_name(function)}: it is recomputed whole (patterns are compared with "
            "the class names and attribute paths of the sublayers of the Layer the block runs)",
            RuntimeWarning,
            stacklevel=_users_stacklevel(sys._getframe()),
        )
    return tuple(found)


#: where paddle_mgrad's and Paddle's code lives: a warning about a recompute call belongs to
#: the first frame outside both (the model's forward, a trainer, a test), however many of our
#: and Paddle's frames (its ``recompute``, ``recompute_hybrid``, fleet's pipeline) lie between
_NOT_USERS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(paddle.__file__)) + os.sep,
)


def _users_stacklevel(frame):
    """The ``stacklevel`` that makes a warning issued in ``frame`` name the first frame
    outside paddle_mgrad and Paddle (``stacklevel=1`` names ``frame`` itself)."""
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_USERS):
        frame, level = frame.f_back, level + 1
    return level


# -- one block call ---------------------------------------------------------------
class _Held:
    """One tensor output of a kept sublayer: a detached alias, its inplace version then, and
    whether it needed a gradient."""

    __slots__ = ("tensor", "version", "stop_gradient")

    def __init__(self, t):
        self.tensor = t.detach()
        self.version = t._inplace_version()
        self.stop_gradient = t.stop_gradient


def _map(obj, fn):
    """``obj`` with ``fn`` applied to every leaf (tuples, lists, dict values descended)."""
    if isinstance(obj, (list, tuple)):
        mapped = [_map(o, fn) for o in obj]
        return (
            mapped
            if isinstance(obj, list)
            else type(obj)(mapped)
            if type(obj) is tuple
            else type(obj)(*mapped)
        )
    if isinstance(obj, dict):
        return type(obj)((k, _map(v, fn)) for k, v in obj.items())
    return fn(obj)


class _Region:
    """One call of a kept sublayer in the block's forward: the pack indices of the tensors its
    ops saved (``start`` to ``end``), its outputs (``_Held`` leaves; None: replay it) with
    ``held``, those leaves in order, and the random state it left (None: the block does not
    preserve it)."""

    __slots__ = ("layer", "start", "end", "outputs", "held", "rng")

    def __init__(self, layer, start, end, outputs, held, rng):
        self.layer, self.start, self.end, self.rng = layer, start, end, rng
        self.outputs, self.held = outputs, held

    def unchanged(self) -> bool:
        return all(h.tensor._inplace_version() == h.version for h in self.held)


class Sublayers:
    """The kept sublayers of one block call and the regions its forward recorded.

    ``depth``: how many kept sublayers this thread is inside right now (the frame's pack hook
    keeps what is saved while it is not 0).  ``cursor``, ``skipped``: the current (or last)
    recomputation's next region and how many it did not run.

    With ``measure`` (the ``budget:`` policy's measuring calls, :mod:`.budget`) nothing is
    kept: each sublayer's forward is timed (``times``) and what keeping it would cost is
    counted (``costs``: the activations its ops save, and its tensor outputs), by the name
    ``measure.names`` gives it; ``measure.done`` gets them when the block's forward ends."""

    __slots__ = (
        "layers",
        "ids",
        "regions",
        "depth",
        "cursor",
        "skipped",
        "measure",
        "times",
        "costs",
        "release",
    )

    def __init__(self, layers, measure=None):
        self.layers = layers
        self.ids = frozenset(id(layer) for layer in layers)
        self.regions: list = []
        self.depth = 0
        self.cursor = 0
        self.skipped = 0
        self.measure = measure
        self.times: dict = {}
        self.costs: dict = {}
        self.release = False  # the current recomputation lets go of the outputs it hands on

    def call(self, frame, layer, forward, args, kwargs):
        """``layer``'s call inside the block: recorded in the forward, skipped (or run) in a
        recomputation (``frame.replaying``)."""
        if self.depth or id(layer) not in self.ids:  # inside a kept sublayer, or not ours
            return forward(*args, **kwargs)
        if frame.replaying:
            return self._replay(frame, layer, forward, args, kwargs)
        if self.measure is not None:
            return self._measured(frame, layer, forward, args, kwargs)
        inputs = list(iter_tensors((args, kwargs)))
        versions = [t._inplace_version() for t in inputs]
        start = len(frame.specs)
        self.depth += 1
        try:
            out = forward(*args, **kwargs)
        finally:
            self.depth -= 1
        changed_input = any(t._inplace_version() != v for t, v in zip(inputs, versions))
        held: list = []

        def hold(o):
            if not is_tensor(o):
                return o
            held.append(_Held(o))
            return held[-1]

        outputs = None if changed_input else _map(out, hold)
        rng = None if frame.rng is None else _rng.capture()
        self.regions.append(_Region(layer, start, len(frame.specs), outputs, held, rng))
        return out

    def _measured(self, frame, layer, forward, args, kwargs):
        first = next(iter_tensors((args, kwargs)), None)
        start = len(frame.specs)
        out, seconds = timed(first, forward, *args, **kwargs)
        name = self.measure.names[id(layer)]
        self.times[name] = self.times.get(name, 0.0) + seconds
        self.costs[name] = self.costs.get(name, 0) + frame.activation_bytes(
            start, iter_tensors(out)
        )
        return out

    def _replay(self, frame, layer, forward, args, kwargs):
        i = self.cursor
        self.cursor += 1
        region = self.regions[i] if i < len(self.regions) else None
        if (
            region is None
            or region.layer is not layer
            or region.outputs is None
            or frame.cursor != region.start
            or not region.unchanged()
            or frame.wants(region.start, region.end)
        ):
            self.depth += 1
            try:
                return forward(*args, **kwargs)
            finally:
                self.depth -= 1
        frame.cursor = region.end
        if region.rng is not None:
            region.rng.apply()
        self.skipped += 1
        outputs = region.outputs
        if self.release:  # (a later recomputation runs the sublayer again)
            region.outputs, region.held = None, ()
        return _map(
            outputs,
            lambda h: (
                replayed_output(h.tensor.detach(), h.stop_gradient) if isinstance(h, _Held) else h
            ),
        )

    # -- bookkeeping ------------------------------------------------------------
    def rewind(self, release):
        """Before a recomputation (a second backward replays again).  ``release``: it runs in a
        backward that frees the graph: the held outputs it hands on are let go of (the ops
        after the sublayer hold what they saved of them until their own backward), and a
        later recomputation runs that sublayer again."""
        self.cursor = self.skipped = 0
        self.release = release

    def drop(self):
        """The block will never be recomputed: hold nothing."""
        self.regions.clear()

    @property
    def kept(self) -> int:
        return sum(r.outputs is not None for r in self.regions)

    def held_tensors(self) -> list:
        """The kept sublayers' tensor outputs."""
        return [h.tensor for r in self.regions if r.outputs is not None for h in r.held]


# -- the wrappers ----------------------------------------------------------------
_installed: dict = {}  # id(layer) -> [count, the instance's own forward or _NONE]
_installed_lock = threading.Lock()
_NONE = object()


def _dispatch(layer, forward, *args, **kwargs):
    block = _active.block
    if block is None:
        return forward(*args, **kwargs)
    sublayers, frame = block
    return sublayers.call(frame, layer, forward, args, kwargs)


def _install(layers):
    with _installed_lock:
        for layer in layers:
            entry = _installed.get(id(layer))
            if entry is not None:
                entry[0] += 1
                continue
            own = layer.__dict__.get("forward", _NONE)
            _installed[id(layer)] = [1, own]
            layer.__dict__["forward"] = functools.partial(_dispatch, layer, layer.forward)


def _uninstall(layers):
    with _installed_lock:
        for layer in layers:
            entry = _installed[id(layer)]
            entry[0] -= 1
            if entry[0]:
                continue
            del _installed[id(layer)]
            if entry[1] is _NONE:
                del layer.__dict__["forward"]
            else:
                layer.__dict__["forward"] = entry[1]


def running(sublayers, frame):
    """A context manager that runs its body (a block's forward or recomputation) with
    ``sublayers`` (None: the block keeps none) as this thread's active block, their wrappers
    installed.  Nothing to do (no sublayers, no block active around): a shared no-op, for
    every full-recompute block pays this call."""
    if sublayers is None and _active.block is None:
        return _NOTHING
    return _running(sublayers, frame)


_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def _running(sublayers, frame):
    prev = _active.block
    if sublayers is not None:
        _install(sublayers.layers)
    _active.block = None if sublayers is None else (sublayers, frame)
    try:
        yield
    finally:
        _active.block = prev
        if sublayers is not None:
            _uninstall(sublayers.layers)
