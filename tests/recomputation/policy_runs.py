"""Micro-steps of a small model with and without recompute, every result as numpy: what the
tests of the recompute policies compare (test_policy.py, test_saved_sublayers.py,
test_budget.py), bit for bit."""

import numpy as np
import paddle
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from paddle_mgrad.recomputation import budget


def train(
    make_net,
    how,
    policy=None,
    steps=2,
    *,
    block=lambda net: net,
    block_input=lambda net, x: x * 1.0,
    after=None,
    seed=11,
    data_seed=2,
    rows=5,
    d=8,
):
    """``steps`` micro-steps of ``make_net()`` (fp32 master gradients: ``MixPrecisionLayer``)
    with recompute ``how`` ("none", "reentrant" or "non_reentrant") of ``block(net)`` under
    ``policy``, fused linear on.  ``block_input(net, x)`` makes the block's input from a
    ``[rows, d]`` leaf ``x`` (by default ``x * 1.0``: no leaf, as in a model); ``after(out)``
    runs on the block's output before the loss (an in-place change after the block).
    Returns each step's output and ``x.grad``, and every parameter's ``.grad`` and
    ``main_grad``, as numpy (None where there is none)."""
    paddle_mgrad.disable()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(seed)
        net = make_net()
        MixPrecisionLayer(net, dtype="float16")
        rs = np.random.RandomState(data_seed)
        weights = paddle.arange(rows * d, dtype="float32").reshape([rows, d])
        result = {}
        for step in range(steps):
            x = paddle.to_tensor(rs.standard_normal([rows, d]).astype("float32"))
            x.stop_gradient = False
            h = block_input(net, x)
            if how == "none":
                out = block(net)(h)
            else:
                out = paddle_mgrad.recompute(
                    block(net), h, use_reentrant=how == "reentrant", policy=policy
                )
            if after is not None:
                after(out)
            (out * weights).sum().backward()
            result[f"out{step}"] = out.numpy()
            result[f"x{step}.grad"] = x.grad.numpy()
        for name, p in net.named_parameters():
            result[name + ".grad"] = None if p.grad is None else p.grad.numpy()
            result[name + ".main_grad"] = None if p.main_grad is None else p.main_grad.numpy()
        return result
    finally:
        paddle_mgrad.disable()


def assert_identical(got, ref):
    """The same results, bit for bit (None where the other is None)."""
    assert sorted(got) == sorted(ref)
    unequal = [
        k
        for k in ref
        if not (got[k] is None and ref[k] is None)
        and (got[k] is None or ref[k] is None or not np.array_equal(got[k], ref[k]))
    ]
    assert not unequal, unequal


def never_the_last_block(monkeypatch):
    """``budget:`` plans never keep a step's last block whole (it never fits the budget): for
    the tests of the other candidates (sublayers, GEMM outputs) whose blocks are each step's
    only one -- kept whole, it would never be recomputed."""
    monkeypatch.setattr(budget.Planner, "last_block_bytes", lambda self, kind: 2.0**62)


def always_the_last_block(monkeypatch):
    """Every ``budget:`` plan keeps a step's last block whole, beside what it chose."""
    choose = budget.Planner._choose
    monkeypatch.setattr(budget.Planner, "_choose", lambda self, kind: (choose(self, kind)[0], True))
