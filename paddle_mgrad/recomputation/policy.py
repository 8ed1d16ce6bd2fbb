"""Recompute policies: which parts of a recompute block are kept from its forward instead of
recomputed in backward.

Full recompute keeps nothing a block computes and replays all of it in backward.  A policy keeps
some of it: what backward needs from a kept part comes from the forward, and the replay skips the
part.  Kept values are exactly the forward's, so every gradient is bit-identical to full
recompute (and to no recompute); only memory and time change.

* ``"full"`` (the default): keep nothing; the block is replayed whole.
* ``"gemm"``: keep the output of every fused linear of the block (``nn.Linear``,
  ``F.linear``, fleet's Column/RowParallel linears: every linear paddle_mgrad's fused linear
  runs); the replay recomputes the linear's input (its backward needs it) and everything that
  is not a GEMM, and multiplies nothing.  A GEMM is the costliest op to replay per byte it
  produces on a GPU (compute-bound, while the elementwise ops around it are memory-bound).
* ``"save:<pattern>[,<pattern>...]"``: the sublayers of the block whose class name or
  attribute path matches a pattern (a glob: ``save:*MLP``, ``save:self_attn``) are not
  recomputed at all: what their ops saved and their outputs are kept from the forward, and the
  replay skips them (:mod:`.saved_sublayers`).  Megatron's ``--recompute-modules`` inverted, at
  sublayer grain; no model edits.
* ``"budget:<fraction>"``: automatic.  Keep the sublayers and the GEMM outputs that spare the
  most replay time, measured on this machine in the block's first calls, so that the
  blocks alive at once (a step's decoder layers) hold ``fraction`` times the bytes they hold
  without recompute (:mod:`.budget`); a plan may keep the step's last block whole (its
  backward reads the forward's values: it is not recomputed).
* a callable ``policy(call) -> bool``: asked once per fused linear in the block's forward with
  a :class:`GemmCall`; True keeps that output (``lambda c: c.flops > 1e9``).

An output changed in place after the linear (fleet's in-place all-reduce, a residual ``add_``)
cannot be handed back as it was: the replay then computes that linear as full recompute does
(``KeptOutputs.forward_done``).

Where a policy applies: :func:`paddle_mgrad.recompute` with ``policy=``, else
``PADDLE_MGRAD_RECOMPUTE_POLICY`` (read at each call, so Paddle's own ``recompute`` as
PaddleNLP, PaddleFormers and fleet's ``recompute_hybrid`` call it follows it with no edits).
A policy runs on the non-reentrant engine: a reentrant call with a policy other than ``full``
runs non-reentrant (same gradients; what else changes: limits.md), except with
``offload_indices`` or ``recompute_hybrid``'s ``offload``/``partition``, which keep full
reentrant recompute.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

from .. import env, stats
from ..autograd.recomputing import KeptOutputs
from . import budget as _budget, saved_sublayers as _saved

__all__ = ["POLICIES", "ENV_POLICY", "GemmCall", "Policy", "resolve"]

#: the named policies (and the values ``PADDLE_MGRAD_RECOMPUTE_POLICY`` accepts)
POLICIES = env.RECOMPUTE_POLICIES
ENV_POLICY = env.RECOMPUTE_POLICY


@dataclass(frozen=True)
class GemmCall:
    """What a callable policy is asked about: one fused linear in a block's forward."""

    kind: str  # "gemm"
    weight: object  # the weight tensor (a parameter: ``weight.name``)
    x_shape: tuple
    out_shape: tuple
    dtype: str
    flops: int  # 2·M·K·N of the forward GEMM
    out_bytes: int  # what keeping the output costs


@dataclass(frozen=True)
class Policy:
    """A resolved policy other than ``full``: its name (for stats), whether it keeps GEMM
    outputs (``gemm``: every one, or those ``chooser`` picks) or the sublayers ``patterns``
    match (``save:``)."""

    name: str
    chooser: Optional[Callable] = None  # None: keep every GEMM output
    gemm: bool = True
    patterns: Tuple[str, ...] = ()
    planner: Optional[_budget.Planner] = None  # budget: measures, then chooses what to keep

    def plan(self, function, args, kwargs) -> _budget.Plan:
        """What this policy keeps of one call of the block ``function(*args, **kwargs)``
        (:class:`.budget.Plan`): the GEMM outputs it keeps, the sublayers it does not
        recompute, whether the call is kept whole while it is its thread's last block."""
        if self.planner is not None:
            plan = self.planner.plan(function, args, kwargs)
        else:
            kept = sublayers = None
            if self.gemm:
                kept = KeptOutputs(_keep_all if self.chooser is None else self._asks)
            if self.patterns:
                layers = _saved.matching(self.patterns, function, args, kwargs)
                sublayers = _saved.Sublayers(layers) if layers else None
            plan = _budget.Plan(kept, sublayers)
        if plan.kept is not None:
            plan.kept.inside = plan.sublayers
        return plan

    def _asks(self, x, weight, y) -> bool:
        out_shape = tuple(y.shape)
        k = x.shape[-1]
        call = GemmCall(
            "gemm",
            weight,
            tuple(x.shape),
            out_shape,
            str(y.dtype),
            2 * math.prod(out_shape) * k,
            math.prod(out_shape) * y.element_size(),
        )
        return bool(self.chooser(call))


def _keep_all(x, weight, y) -> bool:
    return True


_GEMM = Policy("gemm")
#: "save:..." / "budget:..." -> its Policy (resolved at every recompute call; a budget's plans
#: live as long as the process)
_NAMED: dict = {}


def resolve(value: Union[None, str, Callable] = None) -> Optional[Policy]:
    """The policy to run, or None for ``full`` (nothing to keep, no bookkeeping): ``value``,
    else ``$PADDLE_MGRAD_RECOMPUTE_POLICY`` (validated by :func:`paddle_mgrad.env.get`: an
    :class:`~paddle_mgrad.errors.EnvError` naming the variable), else ``full``.  A bad
    ``value`` is a ValueError naming the accepted ones."""
    if value is None:
        if os.environ.get(ENV_POLICY) is None:  # (every recompute call asks: unset is quick)
            return None
        name = env.get(ENV_POLICY)
    elif callable(value):
        return Policy(getattr(value, "__name__", "callable"), value)
    else:
        name = env.parse_recompute_policy(str(value), f"policy={value!r}")
    if name == "full":
        return None
    if name == "gemm":
        return _GEMM
    policy = _NAMED.get(name)
    if policy is None:
        if name.startswith("budget:"):
            policy = Policy(
                name, gemm=False, planner=_budget.Planner(name, env.budget_fraction(name))
            )
        else:
            policy = Policy(name, gemm=False, patterns=env.save_patterns(name))
        policy = _NAMED.setdefault(name, policy)
    return policy


def forward_done(
    policy: Policy,
    kept: Optional[KeptOutputs],
    sublayers,
    recomputed: bool,
    saved_bytes: int,
    block: Optional[_budget.BlockSaved] = None,
):
    """A block's forward under ``policy`` returned: drop what cannot be handed back (all of it
    when the block will not be ``recomputed``), count the call; a ``budget:`` policy's
    measuring call reports what it measured and what the ``block`` saved.  ``saved_bytes``:
    what the kept sublayers keep (their saved activations and outputs)."""
    if policy.planner is not None:
        policy.planner.forward_returned()
    if sublayers is not None and sublayers.measure is not None:
        sublayers.measure.done(sublayers, kept, block)
    if not recomputed:
        let_go(kept, sublayers)
    kept_outputs = kept_bytes = kept_sublayers = 0
    if kept is not None:
        kept.forward_done()
        kept_outputs, kept_bytes = kept.kept, kept.kept_bytes
    if sublayers is not None:
        kept_sublayers = sublayers.kept
        kept_bytes += saved_bytes
    stats.bump_policy(
        policy.name,
        calls=1,
        kept_outputs=kept_outputs,
        kept_bytes=kept_bytes,
        sublayers_kept=kept_sublayers,
    )


def let_go(kept: Optional[KeptOutputs], sublayers):
    """The block will not be recomputed (it changed an argument in place, or backward read it
    kept whole): hold none of what the policy kept for a recomputation."""
    if kept is not None:
        kept.entries.clear()
    if sublayers is not None:
        sublayers.drop()


def rewind(policy: Policy, kept: Optional[KeptOutputs], sublayers, release: bool):
    """Before a recomputation of a block (a second backward replays again).  ``release``: it
    runs in a backward that frees the graph; what it hands on of the forward's is let go of
    (:meth:`.KeptOutputs.rewind`, :meth:`.saved_sublayers.Sublayers.rewind`).  A ``budget:``
    policy reads what a measured step held before it (:meth:`.budget.Planner.replay_starts`)."""
    if policy.planner is not None:
        policy.planner.replay_starts()
    if kept is not None:
        kept.rewind(release)
    if sublayers is not None:
        sublayers.rewind(release)


def record_whole(policy: Policy, kept: Optional[KeptOutputs], sublayers, release: bool):
    """Count one block kept whole that backward reads (not recomputed); to a ``budget:``
    planner its backward begins as a recomputation's would (:meth:`.budget.Planner.replay_starts`,
    :meth:`.budget.Planner.replayed`).  ``release``: a backward that frees the graph; what the
    policy kept for a recomputation is let go of (one comes only if an in-place change after
    the block wants it recomputed, and computes them)."""
    if policy.planner is not None:
        policy.planner.replay_starts(whole=True)
        policy.planner.replayed()
    if release:
        let_go(kept, sublayers)
    stats.bump_policy(policy.name, blocks_kept_whole=1)


def record_replay(policy: Policy, kept: Optional[KeptOutputs], sublayers):
    """Count one recomputation of a block under ``policy`` (after it ran); a ``budget:``
    policy learns from it how many blocks were alive at once (:meth:`.budget.Planner.replayed`)."""
    if policy.planner is not None:
        policy.planner.replayed()
    stats.bump_policy(
        policy.name,
        replays=1,
        gemms_not_recomputed=0 if kept is None else kept.skipped,
        gemm_flops_not_recomputed=0 if kept is None else kept.skipped_flops,
        sublayers_not_recomputed=0 if sublayers is None else sublayers.skipped,
    )
