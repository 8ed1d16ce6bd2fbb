"""Test-only stand-in for PaddleNLP 2.8.1 code written for Paddle 2.x that breaks on Paddle 3.x.

``paddlenlp/transformers/mixtral/modeling.py``, ``MixtralSparseMoeBlock.forward``::

    idx, top_x = paddle.where(expert_mask[expert_id])
    ...
    current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx]

On Paddle 2.x ``paddle.where(cond)`` (the ``nonzero`` form) returns one ``[n, 1]`` index
tensor per dimension, so ``routing_weights[top_x, idx]`` is ``[n, 1]`` and broadcasts over the
expert's ``[n, hidden]`` output.  Paddle 3.x returns 1-D ``[n]`` indices: ``[n, hidden] * [n]``
raises "Broadcast dimension mismatch ... X = [n, hidden] and ... Y = [n]" on the first forward,
with or without paddle_mgrad.

:func:`install` gives that module (and only it) a ``paddle`` whose single-argument ``where``
returns Paddle 2.x's ``[n, 1]`` indices; every other attribute is Paddle's own.  Nothing here
is part of paddle_mgrad.
"""

from __future__ import annotations

import types

import paddle

__all__ = ["install", "uninstall", "needed"]

_saved = {}


def needed() -> bool:
    """Paddle 3.x: ``paddle.where(cond)`` returns 1-D indices."""
    (i,) = paddle.where(paddle.to_tensor([True, False, True]))
    return len(i.shape) == 1


class _Paddle2xWhere(types.ModuleType):
    """``paddle`` as PaddleNLP 2.8.1 expects it: Paddle 2.x's ``where(cond)`` index shape."""

    def __init__(self):
        super().__init__("paddle")

    def __getattr__(self, name):
        return getattr(paddle, name)

    @staticmethod
    def where(condition, x=None, y=None, name=None):
        if x is None and y is None:
            return tuple(
                i.unsqueeze(-1) if len(i.shape) == 1 else i for i in paddle.where(condition)
            )
        return paddle.where(condition, x, y, name)


def install():
    """Give PaddleNLP's Mixtral modeling module the Paddle 2.x ``where(cond)`` (idempotent)."""
    from paddlenlp.transformers.mixtral import modeling

    if "mixtral" not in _saved:
        _saved["mixtral"] = modeling.paddle
        modeling.paddle = _Paddle2xWhere()


def uninstall():
    from paddlenlp.transformers.mixtral import modeling

    if "mixtral" in _saved:
        modeling.paddle = _saved.pop("mixtral")
