"""Where a tensor is, as the op sees it, and :func:`override`, the one way to fake it.

The op asks three questions of a call's tensors: their place as a string (:func:`place`: the
input checks compare them), whether one is a GPU tensor (:func:`is_gpu`) or a CPU tensor
(:func:`is_cpu`: the tier choice); the tier choice asks whether a tier is forced
(:func:`forced_tier`), and the checked call whether anything is faked (:func:`faking`).
Outside :func:`override` the answers are Paddle's, from ``t.place``.

Tests reach devices this machine does not have, and tiers its build does not choose, through
:func:`override` alone: the device choice is explicit state held here, which the rest of the
package reads through these functions (never a replaced function it compares against).  While
an override is in effect the fast paths step aside (:data:`overridden` is not None), so every
call takes the checked path, where the faked answers are used.
"""

from __future__ import annotations

import contextlib
import re

TIERS = ("cpp", "paddle-fused", "python")

#: the override in effect (an :class:`Override`), or None: Paddle's answers.  The fast paths
#: step aside while it is set.
overridden = None

_KIND = re.compile(r"Place\(([a-z_]+)")


class Override:
    """What :func:`override` fakes: ``place`` (a function tensor -> place string, or None for
    the tensor's own place) and ``tier`` (a forced tier, or None)."""

    __slots__ = ("place", "tier")

    def __init__(self, place, tier):
        self.place = place
        self.tier = tier


def place(t) -> str:
    """``str(t.place)``: ``Place(cpu)``, ``Place(gpu:0)``, ``Place(xpu:1)``... (faked within
    :func:`override`)."""
    o = overridden
    if o is None or o.place is None:
        return str(t.place)
    return o.place(t)


def _faked_kind(t):
    """The device kind of ``t``'s faked place (``"gpu"`` for ``Place(gpu:0)``), or None when
    its place is not faked."""
    o = overridden
    if o is None or o.place is None:
        return None
    m = _KIND.match(o.place(t))
    return m.group(1) if m else ""


def is_gpu(t) -> bool:
    """``t`` is on a GPU (CUDA-pinned host memory is not)."""
    kind = _faked_kind(t)
    if kind is not None:
        return kind == "gpu"
    try:
        return bool(t.place.is_gpu_place())
    except AttributeError:
        return False


def is_cpu(t) -> bool:
    """``t`` is on the CPU."""
    kind = _faked_kind(t)
    if kind is not None:
        return kind == "cpu"
    try:
        return bool(t.place.is_cpu_place())
    except AttributeError:
        return False


def forced_tier():
    """The tier :func:`override` forces (``"cpp"``, ``"paddle-fused"``, ``"python"``), or None:
    the tier follows the place."""
    o = overridden
    return None if o is None else o.tier


def faking() -> bool:
    """An override is in effect: its faked places exist in Python only, so the Python input
    checks decide the call (our op would see the tensors' real places)."""
    return overridden is not None


@contextlib.contextmanager
def override(place=None, tier=None):
    """Fake, for the block, where tensors are and which tier runs them (process-wide).

    ``place``: a place string given to every tensor (``"Place(gpu:0)"``, ``"Place(xpu:0)"``),
    or a function ``tensor -> place string`` (e.g. one tensor on another device).  The input
    checks compare these strings and name them in their errors; the tier choice reads the
    device kind from them: ``gpu`` takes the GPU tier :func:`~paddle_mgrad.ops.load` settled,
    ``cpu`` our C++ op, anything else the pure-Paddle reference.  The tensors stay where they
    are: a faked GPU call runs its tier's code on CPU tensors.

    ``tier``: ``"cpp"`` (our op), ``"paddle-fused"`` (Paddle's ``_C_ops`` op) or ``"python"``
    (the reference) for every call, whatever the place.

    While the block runs, :func:`~paddle_mgrad.ops.cpu_entry`,
    :func:`~paddle_mgrad.ops.gpu_entry` and :func:`~paddle_mgrad.ops.cpu_runner` return None
    and the op's fast CPU call steps aside: every call is checked in Python and dispatched by
    tier, where the faked answers are used.  Overrides nest: an inner one keeps what it does
    not set from the outer one.  Everything is restored on exit.

    Example (a test on a machine without a GPU)::

        with ops.override(place="Place(gpu:0)"), ops.loader.settled(gpu="paddle-fused"):
            ops.fused_linear_param_grad_add(x, dy, main_grad, None, True, False)
    """
    global overridden
    if place is not None and not (callable(place) or isinstance(place, str)):
        raise TypeError(f"override: place must be a place string or a function, got {place!r}")
    if tier is not None and tier not in TIERS:
        raise ValueError(f"override: tier must be one of {', '.join(TIERS)}, got {tier!r}")
    if isinstance(place, str):

        def place(t, where=place):
            return where

    outer = overridden
    if outer is not None:
        place = outer.place if place is None else place
        tier = outer.tier if tier is None else tier
    overridden = Override(place, tier)
    try:
        yield overridden
    finally:
        overridden = outer
