"""fleet's ``recompute_hybrid`` (tensor/pipeline parallel) with our guarantees.

``paddle.distributed.fleet.recompute.recompute_hybrid(ctx, function, *args,
**kwargs)`` is what ``PipelineLayer`` calls when ``recompute_interval > 0`` (and
what mp models call directly).  Paddle's version is a reentrant ``PyLayer``
that asserts on a CPU device ("Recompute with RNG is not support current
device: cpu"), rebuilds parameter arguments as copies, and does not check the
recomputation.  Ours is the reentrant implementation of :mod:`.reentrant`
(parameters -- with ``main_grad`` and every Python attribute -- stay the very
objects; RNG of every device, fleet's model-parallel RNG tracker, numpy,
``random`` and the AMP state are replayed; a recomputation whose outputs differ
in count, shape or dtype raises :class:`~paddle_mgrad.RecomputeError`), with
the semantics of the ``ctx`` keys kept:

* ``mp_group`` (required, as in Paddle);
* ``offload``: the saved inputs live on the CPU between forward and backward;
* ``partition``: each saved input is flattened and only this rank's
  ``1/mp_degree`` slice is kept; backward all-gathers the slices over
  ``mp_group`` and restores the shape (Paddle uses the group's CUDA
  ``all_gather``; ours is :func:`paddle.distributed.all_gather`, which also runs
  on gloo).

RNG is always preserved (Paddle's hybrid recompute has no switch for it).  As
Paddle, tuple outputs that are not floating point are returned with
``stop_gradient=True``.  Registry entry ``recompute_hybrid`` (feature
``recompute``) swaps the code of Paddle's function, so the name
``pp_layers.py`` imported through ``paddle.incubate.distributed.fleet`` runs
this too.
"""

from __future__ import annotations

from .. import stats
from .._compat import is_tensor, paddle, tracer
from . import non_reentrant as _non_reentrant, policy as _policy, reentrant as _reentrant
from .api import determinism_check_mode
from .tensors import any_needs_grad

__all__ = ["recompute_hybrid"]

_FLOAT = ("float16", "bfloat16", "float32", "float64")


def _is_float(t) -> bool:
    return any(str(t.dtype).endswith(name) for name in _FLOAT)


class _HybridStash(_reentrant.Offload):
    """Keeps the PyLayer's tensor inputs as fleet's recompute_hybrid does."""

    mark_frozen = True

    def __init__(self, mp_group, offload, partition):
        super().__init__()
        self.group = mp_group
        self.offload = bool(offload)
        self.partition = bool(partition) and mp_group.nranks > 1
        self.shapes: list = []

    def pack(self, tensors):
        out = []
        for t in tensors:
            state = t.stop_gradient
            if self.partition:
                self.shapes.append(list(t.shape))
                numel = int(t.numel())
                n, rank = self.group.nranks, self.group.rank
                if numel == 0 or numel % n:
                    raise ValueError(
                        f"recompute_hybrid(partition=True): activation {list(t.shape)} "
                        f"({numel} elements) is not divisible by mp_degree {n}"
                    )
                part = numel // n
                t = t.detach().flatten()[part * rank : part * (rank + 1)].clone()
            if self.offload:
                t = t.cpu()
            t.stop_gradient = state
            out.append(t)
        return out

    def unpack(self, saved):
        place = paddle.framework._current_expected_place()
        out = []
        for i, t in enumerate(saved):
            state = t.stop_gradient
            if self.offload:
                t = t.to(place)
            if self.partition:
                parts: list = []
                paddle.distributed.all_gather(parts, t, group=self.group)
                t = paddle.concat(parts).reshape(self.shapes[i])
            t.stop_gradient = state
            out.append(t)
        return out


def recompute_hybrid(ctx, function, *args, **kwargs):
    """Drop-in for ``paddle.distributed.fleet.recompute.recompute_hybrid`` (see module doc)."""
    mp_group = ctx.get("mp_group", None)
    if mp_group is None:
        raise ValueError(
            f"recompute_hybrid: ctx must contain 'mp_group' (a Group), got keys {sorted(ctx)}"
        )
    if not paddle.in_dynamic_mode():
        raise RuntimeError("recompute_hybrid works in dynamic (dygraph) mode only")
    stats.bump(stats.recompute, "hybrid")
    stash = _HybridStash(mp_group, ctx.get("offload", False), ctx.get("partition", False))
    policy = _policy.resolve()
    if not tracer()._has_grad:
        outputs = function(*args, **kwargs)
    elif not any_needs_grad((args, kwargs)) or (
        policy is not None and not stash.offload and not stash.partition
    ):
        # No argument needs a gradient (a first stage behind frozen embeddings): the
        # PyLayer would get no grad node and the block's parameters no gradient, so it
        # runs non-reentrant (reentrant module docstring); offload/partition concern
        # saved inputs, and these are kept as they are.  A recompute policy runs there too
        # (:mod:`.policy`), unless offload/partition asked for the reentrant engine.
        stats.bump(stats.recompute, "reentrant_as_non_reentrant")
        outputs = _non_reentrant.run(function, True, args, kwargs, determinism_check_mode(), policy)
    else:
        layout, tensors, call_kwargs, anchor = _reentrant._prepare(
            function, args, kwargs, "recompute_hybrid"
        )
        outputs = _reentrant.run(
            function, True, stash, layout, tensors, call_kwargs, anchor, determinism_check_mode()
        )
    if is_tensor(outputs) or isinstance(outputs, dict):
        return outputs
    outputs = tuple(outputs)
    if len(outputs) == 1:
        return outputs[0]
    for o in outputs:
        if is_tensor(o) and not _is_float(o):
            o.stop_gradient = True
    return outputs


def _paddle_recompute_hybrid_trampoline(ctx, function, *args, **kwargs):
    """Becomes the code of Paddle's ``recompute_hybrid`` (registry entry ``recompute_hybrid``)."""
    import paddle_mgrad.recomputation.hybrid as _h  # runs in Paddle's module globals

    return _h.recompute_hybrid(ctx, function, *args, **kwargs)
