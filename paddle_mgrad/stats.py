"""Counters that prove paddle_mgrad's paths ran, in one place.

Trainers, the llama example and tests read them to assert that nothing was
silently bypassed (e.g. "every decoder layer went through our recompute", "the
fused op wrote N gradients into main_grad").  :func:`reset` zeroes them;
:func:`snapshot` returns a plain copy to diff against later.
"""

from __future__ import annotations

import threading

__all__ = ["recompute", "policy", "linear", "paddle_c_ops", "fused_params", "reset", "snapshot"]

_lock = threading.Lock()

#: calls of paddle_mgrad.recompute by mode, of fleet's recompute_hybrid (ours), and
#: recomputations run in backward; ``reentrant_as_non_reentrant``: of the reentrant and
#: hybrid calls, those whose arguments needed no gradient, run non-reentrant
#: (:mod:`paddle_mgrad.recomputation.reentrant`); ``kept_from_forward``: non-reentrant calls
#: whose block changed one of its own tensor arguments in place, whose saved tensors were
#: therefore kept from the forward and are never recomputed
#: (:mod:`paddle_mgrad.recomputation.non_reentrant`)
recompute = {
    "non_reentrant": 0,
    "reentrant": 0,
    "hybrid": 0,
    "recomputations": 0,
    "reentrant_as_non_reentrant": 0,
    "kept_from_forward": 0,
}
#: per recompute policy other than ``full`` (:mod:`paddle_mgrad.recomputation.policy`), by its
#: name: block ``calls``, GEMM outputs kept from their forwards (``kept_outputs``, after those
#: changed in place were dropped), sublayer calls kept (``sublayers_kept``, ``save:``), the
#: bytes of both (``kept_bytes``: kept outputs, and a kept sublayer's outputs and saved
#: tensors), ``replays`` (recomputations), and over those the GEMMs not recomputed, their
#: FLOPs, and the sublayer calls not recomputed; ``blocks_kept_whole``: block calls whose
#: backward read what their forward saved, not recomputed (a step's last block, ``budget:``)
policy: dict = {}
#: per ``budget:`` policy, per kind of block (its Layer's class): the plan made after the
#: measured calls -- ``chosen`` candidates, ``budget_bytes`` (what the plan may add to the
#: step's memory over full recompute), ``block_bytes`` and ``input_bytes`` (one call's
#: activations without recompute, and its arguments that need a gradient), ``outside_bytes``
#: (what a measured step held outside the blocks at its peak), ``live_blocks``
#: (block calls alive at once), ``measured_calls`` and per candidate the ``measured`` seconds
#: and bytes; ``last_block`` (whether the step's last block is kept whole, not recomputed),
#: what that adds to the step's peak (``last_block_bytes``) and ``block_seconds`` (a block's
#: measured forward time).  A plan holds for the rest of the process (not cleared by :func:`reset`).
plans: dict = {}
POLICY_COUNTERS = (
    "calls",
    "kept_outputs",
    "kept_bytes",
    "replays",
    "gemms_not_recomputed",
    "gemm_flops_not_recomputed",
    "sublayers_kept",
    "sublayers_not_recomputed",
    "blocks_kept_whole",
)
#: fused linear forwards/backwards (``overlap_*``: fleet's mp_async_allreduce column linear,
#: ours; ``sp_overlap_*``: fleet's sp_async_reduce_scatter column linear, ours), gradients the
#: op accumulated into main_grad, of those the zero-bubble deferred weight gradients
#: (``zero_bubble``: Paddle 3.x ``WeightGradStore``, ours), and backwards of any of them in a
#: ``paddle.grad`` pass (``functional_backward``: plain gradients, nothing accumulated)
linear = {
    "forward": 0,
    "backward": 0,
    "overlap_forward": 0,
    "overlap_backward": 0,
    "sp_overlap_forward": 0,
    "sp_overlap_backward": 0,
    "into_main_grad": 0,
    "zero_bubble": 0,
    "functional_backward": 0,
}
#: calls of ``paddle._C_ops.fused_linear_param_grad_add`` while fused_linear is on: run by our
#: op (CPU tensors) or handed to Paddle's own kernel (places where Paddle has one)
paddle_c_ops = {"ours": 0, "paddle": 0}
#: names of parameters whose gradient went through the fused op
fused_params: set = set()


def bump(counters: dict, key: str, n: int = 1):
    with _lock:
        counters[key] += n


def bump2(counters: dict, key: str, n: int, key2: str, n2: int):
    """Two :func:`bump` s under one lock (a hot path's pair of counters)."""
    with _lock:
        counters[key] += n
        counters[key2] += n2


def bump_policy(name: str, **increments):
    """Add ``increments`` (keys of :data:`POLICY_COUNTERS`) to policy ``name``'s counters."""
    with _lock:
        counters = policy.get(name)
        if counters is None:
            counters = policy[name] = dict.fromkeys(POLICY_COUNTERS, 0)
        for k, n in increments.items():
            counters[k] += n


def set_plan(name: str, kind: str, plan: dict):
    """Record the plan a ``budget:`` policy made for a kind of block."""
    with _lock:
        plans.setdefault(name, {})[kind] = plan


def reset():
    with _lock:
        for counters in (recompute, linear, paddle_c_ops):
            for k in counters:
                counters[k] = 0
        policy.clear()
        fused_params.clear()


def snapshot() -> dict:
    with _lock:
        return {
            "recompute": dict(recompute),
            "linear": dict(linear),
            "paddle_c_ops": dict(paddle_c_ops),
            "policy": {k: dict(v) for k, v in policy.items()},
            "plans": {k: dict(v) for k, v in plans.items()},
            "fused_params": set(fused_params),
        }
