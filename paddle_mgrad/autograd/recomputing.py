"""Whether this thread is re-running a block for a non-reentrant recompute right now, and the
GEMM outputs a recompute policy keeps from the block's forward.

The recomputation (:mod:`paddle_mgrad.recomputation.non_reentrant`) re-runs a block in backward
under a pack hook of its own that collects the tensors the block saves, in the forward's order.
The graph it builds is never back-propagated, so our fused linear (:mod:`paddle_mgrad.linear`)
need not be a ``PyLayer`` there: it runs Paddle's linear and hands the one tensor its
``PyLayer`` would save to that hook itself (a node, a guard and a context less per linear per
recomputation).  A recompute's forward running inside a recomputation (a nested block) sets
None for its duration: its saves go to its own hooks, and the PyLayer it builds is
back-propagated.

Under a recompute policy that keeps GEMM outputs (:mod:`paddle_mgrad.recomputation.policy`),
the block's forward records each fused linear's output in a :class:`KeptOutputs`, and the
recomputation hands the same output back instead of multiplying again: the linear's input is
recomputed (the backward needs it, and the ops before the linear reproduce it anyway), its
output is not.  The n-th fused linear of the replay is the n-th of the forward (the replay runs
the same code on the same values; the determinism check covers what is recomputed), counting
only the linears outside the sublayers the policy keeps whole
(:mod:`paddle_mgrad.recomputation.saved_sublayers`): those run once, in the forward, and the
replay skips them.

Here, below both, so that neither imports the other (tests/test_import_graph.py).
"""

from __future__ import annotations

import contextlib
import math
import time

import paddle
from paddle import _C_ops

from ..threadstate import thread_state

__all__ = ["state", "running", "KeptOutputs", "replayed_output", "timed"]

#: ``state.pack``: the pack hook of the recomputation this thread runs right now, None when there
#: is none.  ``state.kept``: the :class:`KeptOutputs` of the block whose forward or recomputation
#: this thread runs, None when its policy keeps nothing.  Read by our fused linear on every call,
#: hence attributes and not functions.
state = thread_state("RecomputingState", pack=None, kept=None)


@contextlib.contextmanager
def running(pack_hook, kept=None):
    """Run the body with ``pack_hook`` (a recomputation's, or None: a forward) as this
    thread's ``state.pack`` and ``kept`` as its ``state.kept``."""
    prev = state.pack, state.kept
    state.pack, state.kept = pack_hook, kept
    try:
        yield
    finally:
        state.pack, state.kept = prev


def timed(first, fn, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)`` on the host clock; where ``first`` (a tensor the call
    reads) lies on an accelerator, its queue is emptied at both ends (the time is the call's
    work, not its launch).  For a ``budget:`` policy's measuring calls only."""
    on_device = first is not None and not first.place.is_cpu_place()
    if on_device:
        paddle.device.synchronize()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if on_device:
        paddle.device.synchronize()
    return out, time.perf_counter() - t0


def replayed_output(y, stop_gradient):
    """A value a recomputation hands on in place of what the forward computed (a fused
    linear's output, a kept output of a linear or of a sublayer the policy does not
    recompute): ``y``, a tensor of the caller's own (computed with grad off, or a new detached
    alias of a kept output: the replay may set attributes on it), as a non-leaf view that
    needs a gradient -- or as it is where the forward's output needed none.

    Needing a gradient, the ops after it save what they saved in the forward; being no leaf,
    it takes in-place ops (a leaf that needs a gradient refuses them: "Leaf Var () that doesn't
    stop gradient can't use inplace strategy").  A ``reshape`` to its own shape taken with grad
    on is such a view: no copy, and a node that saves nothing, so the pack hook sees nothing
    of it."""
    if stop_gradient:
        return y
    y.stop_gradient = False
    return _C_ops.reshape(y, y.shape)


class KeptOutputs:
    """The outputs of a block's fused linears that its policy keeps, in call order.

    Forward: :meth:`add` for every fused linear call (an entry, or None where the policy
    recomputes it).  :meth:`forward_done` drops every output changed in place since it was kept
    (fleet's in-place all-reduce, a residual ``add_``): the recomputation must then re-run that
    linear and the op after it, as without a policy.  Recomputation: :meth:`take` for every
    fused linear call, in the same order; it answers None where the linear must be computed
    (not kept, dropped, changed after the forward, or not the call the forward made).
    Entries hold detached tensors (buffer and inplace version shared with the output, no
    autograd node), so keeping them ties nothing to the forward's graph.

    A linear inside a sublayer the policy keeps whole (``inside.depth``) is neither offered
    nor taken: the replay skips that sublayer, so counting its linears would shift every later
    one onto another's entry.

    With ``timings`` (a dict: a ``budget:`` policy's measuring call) nothing is kept: each
    linear's forward is timed and its output counted, by weight (:meth:`offer`)."""

    __slots__ = (
        "wants",
        "entries",
        "cursor",
        "kept_bytes",
        "skipped",
        "skipped_flops",
        "inside",
        "timings",
        "release",
    )

    def __init__(self, wants, timings=None):
        #: ``wants(x, weight, y) -> bool``: whether the policy keeps this output
        self.wants = wants
        self.entries: list = []
        self.cursor = 0
        self.kept_bytes = 0
        self.skipped = 0  # GEMMs not recomputed by the current (or last) recomputation
        self.skipped_flops = 0
        #: the block's kept sublayers (``saved_sublayers.Sublayers``), or None: none
        self.inside = None
        #: ``{id(weight): [seconds, output bytes, [(output alias, its inplace version)]]}``
        self.timings = timings
        #: whether the current recomputation lets go of each entry it takes (:meth:`rewind`)
        self.release = False

    # -- forward --------------------------------------------------------------
    def offer(self, apply, x, weight, *args):
        """In the block's forward: ``apply(x, weight, *args)`` (a linear), its output offered
        to the policy."""
        if self.inside is not None and self.inside.depth:
            return apply(x, weight, *args)
        if self.timings is not None:
            y, seconds = timed(x, apply, x, weight, *args)
            entry = self.timings.setdefault(id(weight), [0.0, 0, []])
            entry[0] += seconds
            entry[1] += math.prod(y.shape) * y.element_size()
            entry[2].append((y.detach(), y._inplace_version()))
            return y
        y = apply(x, weight, *args)
        self.add(x, weight, y)
        return y

    def keepable_timings(self):
        """A measuring call's :attr:`timings` as ``{id(weight): (seconds, bytes)}``, less the
        linears whose output was changed in place since (they cannot be kept:
        :meth:`forward_done`)."""
        return {
            w: (seconds, nbytes)
            for w, (seconds, nbytes, outputs) in self.timings.items()
            if all(self.unchanged(t, version) for t, version in outputs)
        }

    def add(self, x, weight, y):
        if not self.wants(x, weight, y):
            self.entries.append(None)
            return
        self.entries.append(
            (y.detach(), y._inplace_version(), y.stop_gradient, list(weight.shape), list(x.shape))
        )

    def forward_done(self):
        """Drop what changed in place during the forward; count the bytes kept."""
        total = 0
        for i, entry in enumerate(self.entries):
            if entry is None:
                continue
            t, version = entry[0], entry[1]
            if not self.unchanged(t, version):
                self.entries[i] = None
            else:
                total += math.prod(t.shape) * t.element_size()
        self.kept_bytes = total

    @staticmethod
    def unchanged(t, version) -> bool:
        """Whether the kept output still holds what the linear computed (no in-place op on it
        or on a view of it since: they share its inplace version)."""
        return t._inplace_version() == version

    @property
    def kept(self) -> int:
        return sum(e is not None for e in self.entries)

    # -- recomputation ----------------------------------------------------------
    def rewind(self, release):
        """Before a recomputation (a second backward replays again).  ``release``: the
        recomputation runs in a backward that frees the graph: each entry it takes is let go of
        (the replay's ops hold what they saved of it until their own backward, as under full
        recompute), where kept it would live as long as the graph -- in a training loop that
        holds the last ``loss``, through the next step's forward.  A later recomputation of
        the block (a second backward all the same) computes those linears again."""
        self.cursor = self.skipped = self.skipped_flops = 0
        self.release = release

    def take(self, x, weight):
        """``(output, stop_gradient)`` kept for this call, or None: compute it."""
        if self.inside is not None and self.inside.depth:
            return None
        i = self.cursor
        self.cursor += 1
        entry = self.entries[i] if i < len(self.entries) else None
        if entry is None:
            return None
        t, version, stop_gradient, w_shape, x_shape = entry
        # (a replay that diverged from the forward: compute, and let the determinism check
        # speak about what was recomputed)
        if (
            not self.unchanged(t, version)
            or list(x.shape) != x_shape
            or list(weight.shape) != w_shape
        ):
            return None
        if self.release:
            self.entries[i] = None
        self.skipped += 1
        self.skipped_flops += 2 * math.prod(t.shape) * x_shape[-1]
        return t, stop_gradient
