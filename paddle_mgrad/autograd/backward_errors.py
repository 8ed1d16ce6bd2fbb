"""Wrappers of Paddle's backward entry points: our errors keep their type, and our PyLayers
know which kind of pass runs them.

Recomputation (from an unpack hook) and our PyLayers' backward (the fused
linear's weight-gradient op) run inside Paddle's C++ backward engine, which
turns any Python exception into ``OSError: (External) ...`` and, on Paddle 2.6
and 3.x alike, leaves grad mode *disabled* after the failed backward.  We
record a :class:`~paddle_mgrad.RecomputeError` or
:class:`~paddle_mgrad.FusedLinearError` before raising it, and thin wrappers
around ``Tensor.backward`` and ``paddle.autograd.backward`` (and, through
:func:`run`, ``paddle.grad``: :mod:`paddle_mgrad.autograd.passes`) re-raise the
recorded error (chained to Paddle's), and after *any* error -- ours, Paddle's,
the user's -- put grad mode back as it was before the pass.

Each wrapper also pushes the kind of pass it starts on a per-thread stack that
:func:`current_pass` reads: ``None`` for an ordinary ``backward()`` (gradients
accumulate into ``.grad`` / ``main_grad``), or the
:class:`~paddle_mgrad.autograd.passes.FunctionalPass` of a ``paddle.grad`` call
(gradients are only returned).  A backward nested in another (Paddle's reentrant
recompute runs ``paddle.autograd.backward`` inside its PyLayer's backward) pushes
its own kind and pops it on return.  With the kind goes whether the pass frees the graph it
runs (:func:`frees_graph`): an ordinary backward without ``retain_graph``.

The wrappers are pass-throughs otherwise; they are registry entries
(``Tensor.backward``, ``autograd.backward``, ``grad`` in :mod:`paddle_mgrad.registry`)
installed by the first recompute call or fused-linear forward and removed by
:func:`paddle_mgrad.disable`.
"""

from __future__ import annotations

import functools

from .. import registry
from .._compat import tracer
from ..threadstate import thread_state

_state = thread_state("BackwardPassState", depth=0, error=None, passes=None)

#: where ``retain_graph`` lies among the positional arguments of ``Tensor.backward(self,
#: grad_tensor, retain_graph)`` and ``paddle.autograd.backward(tensors, grad_tensors,
#: retain_graph)`` (Paddle 2.6 and 3.x; default False)
_RETAIN_GRAPH_AT = 2


def record(error: BaseException):
    """Keep ``error`` (the first one) to re-raise as itself when the running pass ends; outside
    a wrapped pass nobody would, and nothing is kept."""
    if _state.depth and _state.error is None:
        _state.error = error


def current_pass():
    """The innermost running pass of this thread: None (ordinary ``backward()``, or no
    wrapped pass at all) or the functional pass object of a ``paddle.grad`` call."""
    stack = _state.passes
    return stack[-1][0] if stack else None


def frees_graph() -> bool:
    """Whether the innermost running pass of this thread is an ordinary backward that frees
    the graph it runs (no ``retain_graph``): what that pass reads of a saved tensor is not read
    again.  False outside a wrapped pass (nobody can tell) and in a ``paddle.grad`` pass (it
    runs a copy of the graph: an ordinary backward may run the graph itself afterwards)."""
    stack = _state.passes
    return bool(stack) and stack[-1][1]


def run(orig, args, kwargs, kind=None, frees=False):
    """Call ``orig`` (a backward entry point) as a pass of ``kind`` (see module doc) that frees
    its graph or not (``frees``), re-raising an error recorded during it as itself."""
    depth = _state.depth
    if depth == 0:
        _state.error = None
    _state.depth = depth + 1
    stack = _state.passes
    if stack is None:
        stack = _state.passes = []
    stack.append((kind, frees))
    has_grad = tracer()._has_grad
    try:
        return orig(*args, **kwargs)
    except BaseException as e:
        # Paddle's engine leaves grad mode off after an error raised inside it (an unpack
        # hook's recomputation, a PyLayer's backward): every later step of the process would
        # record no graph and train nothing, silently.  Whatever raised, grad mode is as before.
        tracer()._has_grad = has_grad
        err = _state.error
        if err is None or e is err or not isinstance(e, Exception):
            raise
        raise err from e
    finally:
        stack.pop()
        _state.depth = depth
        if depth == 0:
            _state.error = None


def wrap(orig):
    """``orig`` (``Tensor.backward`` / ``paddle.autograd.backward``) as an ordinary pass
    re-raising the recorded error."""

    @functools.wraps(orig)
    def backward(*args, **kwargs):
        retain = (
            args[_RETAIN_GRAPH_AT]
            if len(args) > _RETAIN_GRAPH_AT
            else kwargs.get("retain_graph", False)
        )
        return run(orig, args, kwargs, None, not retain)

    backward.__wrapped_by_paddle_mgrad__ = True
    return backward


_KEYS = ("Tensor.backward", "autograd.backward", "grad")
#: the registry entries of the wrappers (what :func:`install` installs)
ENTRY_KEYS = frozenset(_KEYS)


def install():
    """Install the wrappers (first recompute call or fused-linear forward; idempotent)."""
    if not registry.all_installed(ENTRY_KEYS):  # skip the lock once installed
        registry.ensure(*_KEYS)
