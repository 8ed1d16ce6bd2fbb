"""Activation recomputation that keeps parameters (and their ``main_grad``) intact.

Where things are:

* :mod:`.api` -- :func:`recompute`, the public entry (and the trampoline that
  Paddle's own ``recompute`` runs once :func:`paddle_mgrad.enable` is called);
* :mod:`.non_reentrant` -- ``use_reentrant=False``: saved-tensor hooks that keep
  parameters as the very objects and recompute the rest; the determinism check;
* :mod:`.reentrant` -- ``use_reentrant=True``: Paddle's PyLayer scheme with
  parameter arguments routed around the PyLayer;
* :mod:`.rng`, :mod:`.amp` -- capture in forward, replay in recomputation;
* :mod:`.saved_hooks` -- per-thread stacks of saved-tensor hook pairs (threads,
  nesting) and ``save_for_backward`` of non-tensor objects;
* :mod:`.policy` -- what a block keeps from its forward instead of recomputing it:
  :mod:`.saved_sublayers` (``save:``), :mod:`.budget` (``budget:``, measured; what the
  allocator holds: :mod:`.memory`);
* :mod:`.tensors` -- small helpers shared by both implementations;
* :mod:`.to_static` -- recompute under ``paddle.jit.to_static`` runs as dygraph.
"""

from ..errors import RecomputeError
from .api import recompute

__all__ = ["recompute", "RecomputeError"]
