"""Whether this thread is re-running a block for a non-reentrant recompute right now.

The recomputation (:mod:`paddle_mgrad.recomputation.non_reentrant`) re-runs a block in backward
under a pack hook of its own that collects the tensors the block saves, in the forward's order.
The graph it builds is never back-propagated, so our fused linear (:mod:`paddle_mgrad.linear`)
need not be a ``PyLayer`` there: it runs Paddle's linear and hands the one tensor its
``PyLayer`` would save to that hook itself (issue 23: a node, a guard and a context less per
linear per recomputation).  A recompute's forward running inside a recomputation (a nested
block) sets None for its duration: its saves go to its own hooks, and the PyLayer it builds
is back-propagated.

Here, below both, so that neither imports the other (tests/test_import_graph.py).
"""
from __future__ import annotations

import contextlib
import threading

__all__ = ["state", "running"]

#: ``state.pack``: the pack hook of the recomputation this thread runs right now; absent or None
#: when there is none.  Read as ``getattr(state, "pack", None)`` -- by our fused linear on every
#: call, hence an attribute and not a function.
state = threading.local()


@contextlib.contextmanager
def running(pack_hook):
    """Run the body with ``pack_hook`` (a recomputation's, or None: a forward) as this
    thread's ``state.pack``."""
    prev = getattr(state, "pack", None)
    state.pack = pack_hook
    try:
        yield
    finally:
        state.pack = prev
