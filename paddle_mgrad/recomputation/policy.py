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
from typing import Callable, Optional, Union

from .. import env, stats
from ..autograd.recomputing import KeptOutputs

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
    """A resolved policy other than ``full``: its name (for stats) and whether it keeps a
    given GEMM output."""

    name: str
    chooser: Optional[Callable] = None  # None: keep every GEMM output

    def kept_outputs(self) -> KeptOutputs:
        """A new :class:`KeptOutputs` for one block call, asking this policy."""
        return KeptOutputs(_keep_all if self.chooser is None else self._asks)

    def _asks(self, x, weight, y) -> bool:
        out_shape = tuple(y.shape)
        k = x.shape[-1]
        call = GemmCall("gemm", weight, tuple(x.shape), out_shape, str(y.dtype),
                        2 * math.prod(out_shape) * k, math.prod(out_shape) * y.element_size())
        return bool(self.chooser(call))


def _keep_all(x, weight, y) -> bool:
    return True


_GEMM = Policy("gemm")


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
    return None if name == "full" else _GEMM


def record_call(policy: Policy, kept: KeptOutputs):
    """Count one block call under ``policy`` once its forward is done."""
    stats.bump_policy(policy.name, calls=1, kept_outputs=kept.kept, kept_bytes=kept.kept_bytes)


def record_replay(policy: Policy, kept: KeptOutputs):
    """Count one recomputation of a block under ``policy`` (after it ran)."""
    stats.bump_policy(policy.name, replays=1, gemms_not_recomputed=kept.skipped,
                      gemm_flops_not_recomputed=kept.skipped_flops)
